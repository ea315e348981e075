//! Embedding models: many texts per call, one vector per text.
//!
//! - OpenAI-compatible `POST {base}/embeddings` with `input` a list (OpenAI, vLLM, llama.cpp);
//! - the Gemini API's `:batchEmbedContents` (and the simulator behind `sim/…`);
//! - Vertex AI text-embedding models' `:predict` with `{"content": …}` instances.
//!
//! Each handler answers one result per text, in order, matched by position (OpenAI's by
//! `index`); an answer with fewer vectors than texts fails only the texts left out.

use serde_json::{json, Value};
use weir_core::{BatchAnswer, ErrorKind, ModelError, ModelHandler, ModelRequest, ModelResponse, Usage};

use crate::http::{redact, Credential};

/// Which wire form an [`EmbedHandler`] speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbedApi {
    /// OpenAI-compatible `/embeddings`.
    OpenAi,
    /// Gemini API `:batchEmbedContents`.
    Gemini,
    /// Vertex AI publisher model `:predict`.
    Vertex,
}

/// Texts per call by default, within each API's documented limit (OpenAI 2,048 inputs; Gemini
/// 100 requests per batch; Vertex AI 250 instances and 20,000 tokens per request).
pub fn default_batch(api: EmbedApi) -> usize {
    match api {
        EmbedApi::OpenAi => 128,
        EmbedApi::Gemini => 100,
        EmbedApi::Vertex => 64,
    }
}

/// A client of one embedding model.
#[derive(Debug)]
pub struct EmbedHandler {
    client: reqwest::Client,
    api: EmbedApi,
    url: String,
    endpoint: String,
    /// The model as the body names it (OpenAI `model`; Gemini `models/…`).
    model: String,
    model_id: String,
    credential: Credential,
    max_batch: usize,
    /// OpenAI's tokenizer, for OpenAI's embedding models.
    bpe: Option<crate::openai::Tokenizer>,
}

impl EmbedHandler {
    /// A client posting to `url` (the API's embedding method for the model).
    pub fn new(
        client: reqwest::Client,
        api: EmbedApi,
        url: String,
        model: String,
        model_id: String,
        credential: Credential,
        max_batch: usize,
    ) -> Self {
        let endpoint = url.clone();
        let bpe = if api == EmbedApi::OpenAi { crate::openai::tokenizer_for(&model) } else { None };
        Self { client, api, url, endpoint, model, model_id, credential, max_batch: max_batch.max(1), bpe }
    }

    /// The Gemini API's embedding client for `spec` at `base` (the API, or a server that
    /// speaks it), with its key when it needs one, `max_batch` texts per call at most (else
    /// the API's default).
    pub fn gemini(
        client: reqwest::Client,
        base: &reqwest::Url,
        spec: &crate::ModelSpec,
        key: Option<crate::Secret>,
        max_batch: Option<usize>,
    ) -> Self {
        let url = format!("{}/v1beta/models/{}:batchEmbedContents", base.as_str().trim_end_matches('/'), spec.model);
        let credential = key.map_or(Credential::None, |k| Credential::Key(k, Some("x-goog-api-key")));
        let batch = max_batch.unwrap_or_else(|| default_batch(EmbedApi::Gemini));
        Self::new(client, EmbedApi::Gemini, url, spec.model.clone(), spec.to_string(), credential, batch)
    }

    /// Names the endpoint `name` instead of its URL (the in-process simulator).
    pub fn named(mut self, name: &str) -> Self {
        self.endpoint = format!("{name} (embeddings)");
        self
    }

    /// The request body for `texts`.
    pub fn body(&self, texts: &[&str]) -> Value {
        match self.api {
            EmbedApi::OpenAi => json!({"model": self.model, "input": texts}),
            EmbedApi::Gemini => json!({"requests": texts.iter().map(|t| json!({
                "model": format!("models/{}", self.model),
                "content": {"parts": [{"text": t}]},
            })).collect::<Vec<_>>()}),
            EmbedApi::Vertex => json!({"instances": texts.iter().map(|t| json!({"content": t})).collect::<Vec<_>>()}),
        }
    }

    fn classify(&self, reply: &crate::http::Reply) -> ModelError {
        match self.api {
            EmbedApi::OpenAi => crate::openai::classify_error(reply.status, &reply.headers, &reply.body),
            _ => crate::gemini::classify_error(reply.status, &reply.headers, &reply.body),
        }
    }
}

fn malformed(what: &str) -> ModelError {
    ModelError::new(ErrorKind::MalformedResponse, format!("the embedding answer {what}"))
}

fn vector(v: Option<&Value>) -> Result<Vec<f32>, ModelError> {
    let Some(Value::Array(xs)) = v else { return Err(malformed("has an item without a vector")) };
    xs.iter()
        .map(|x| x.as_f64().map(|f| f as f32).ok_or_else(|| malformed("has a value that is not a number")))
        .collect()
}

fn embedding(values: Vec<f32>, prompt_tokens: u64) -> ModelResponse {
    ModelResponse {
        finish_reason: "stop".into(),
        usage: Usage { prompt_tokens, output_tokens: 0, total_tokens: prompt_tokens },
        embedding: Some(values),
        ..ModelResponse::default()
    }
}

/// Reads an embedding answer for `texts`: one result per text.
pub fn parse(api: EmbedApi, body: &[u8], texts: &[&str]) -> BatchAnswer {
    let v: Value = serde_json::from_slice(body).map_err(|e| malformed(&format!("is not JSON: {e}")))?;
    let got: Vec<Result<ModelResponse, ModelError>> = match api {
        EmbedApi::OpenAi => {
            let Some(Value::Array(data)) = v.get("data") else { return Err(malformed("has no data list")) };
            // The usage covers the whole call; each text is given its share by length.
            let total = v.pointer("/usage/prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
            let chars: usize = texts.iter().map(|t| t.chars().count()).sum::<usize>().max(1);
            let mut slots: Vec<Option<Result<ModelResponse, ModelError>>> = (0..data.len()).map(|_| None).collect();
            for (pos, item) in data.iter().enumerate() {
                let i = item.get("index").and_then(Value::as_u64).map_or(pos, |i| i as usize);
                if i >= slots.len() || slots[i].is_some() {
                    return Err(malformed("has items whose index does not match the inputs"));
                }
                let share = texts.get(i).map_or(0, |t| (total as usize * t.chars().count()).div_ceil(chars)) as u64;
                slots[i] = Some(vector(item.get("embedding")).map(|x| embedding(x, share)));
            }
            slots.into_iter().map(|s| s.unwrap_or_else(|| Err(malformed("misses an index")))).collect()
        }
        EmbedApi::Gemini => {
            let Some(Value::Array(items)) = v.get("embeddings") else { return Err(malformed("has no embeddings")) };
            // The Gemini API reports no usage for embeddings, yet bills their input tokens:
            // about four characters a token, as the throttle estimates them before a call.
            items
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let tokens = texts.get(i).map_or(0, |t| t.chars().count().div_ceil(4)) as u64;
                    vector(e.get("values")).map(|x| embedding(x, tokens))
                })
                .collect()
        }
        EmbedApi::Vertex => {
            let Some(Value::Array(items)) = v.get("predictions") else { return Err(malformed("has no predictions")) };
            items
                .iter()
                .map(|p| {
                    let tokens = p.pointer("/embeddings/statistics/token_count").and_then(Value::as_u64).unwrap_or(0);
                    vector(p.pointer("/embeddings/values")).map(|x| embedding(x, tokens))
                })
                .collect()
        }
    };
    crate::http::one_per_item(got, texts.len())
}

#[async_trait::async_trait]
impl ModelHandler for EmbedHandler {
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        weir_core::handler::answer_one(self, request).await
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn quota_credential(&self) -> Option<&str> {
        self.credential.quota_id()
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn count_tokens(&self, text: &str) -> Option<u64> {
        self.bpe.map(|b| b.count(text))
    }

    fn max_batch_bytes(&self) -> Option<usize> {
        // Vertex AI takes 20,000 tokens per request: about 80,000 characters.
        (self.api == EmbedApi::Vertex).then_some(80_000)
    }

    fn request_bytes(&self, request: &ModelRequest) -> usize {
        request.prompt.len()
    }

    async fn generate_batch(&self, requests: &[ModelRequest]) -> BatchAnswer {
        let texts: Vec<&str> = requests.iter().map(|r| r.prompt.as_str()).collect();
        let (reply, secret) = self.credential.post(&self.client, &self.url, &self.body(&texts)).await?;
        if reply.status != 200 {
            return Err(redact(self.classify(&reply), secret.as_ref()));
        }
        parse(self.api, &reply.body, &texts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_items_are_matched_by_index_and_share_the_usage() {
        let body = br#"{"data":[{"index":1,"embedding":[0.5,0.5]},{"index":0,"embedding":[1,0]}],"usage":{"prompt_tokens":9,"total_tokens":9}}"#;
        let a = parse(EmbedApi::OpenAi, body, &["aa", "aaaa"]).unwrap();
        let first = a[0].as_ref().unwrap();
        assert_eq!(first.embedding.as_deref(), Some(&[1.0f32, 0.0][..]));
        assert_eq!(a[1].as_ref().unwrap().embedding.as_deref(), Some(&[0.5f32, 0.5][..]));
        assert_eq!(first.usage.prompt_tokens, 3);
        assert_eq!(a[1].as_ref().unwrap().usage.prompt_tokens, 6);
        let dup = br#"{"data":[{"index":0,"embedding":[1]},{"index":0,"embedding":[1]}]}"#;
        assert!(parse(EmbedApi::OpenAi, dup, &["a", "b"]).is_err());
    }

    #[test]
    fn a_short_answer_fails_only_the_texts_left_out() {
        let a = parse(EmbedApi::Gemini, br#"{"embeddings":[{"values":[1,2]}]}"#, &["a river", "b"]).unwrap();
        // No usage in the Gemini API's answer: the input tokens are estimated (7 characters).
        assert_eq!(a[0].as_ref().unwrap().usage.prompt_tokens, 2);
        assert_eq!(a[1].as_ref().unwrap_err().kind, ErrorKind::MalformedResponse);
        let v = br#"{"predictions":[{"embeddings":{"values":[1],"statistics":{"token_count":4}}}]}"#;
        let a = parse(EmbedApi::Vertex, v, &["a"]).unwrap();
        assert_eq!(a[0].as_ref().unwrap().usage.prompt_tokens, 4);
    }
}
