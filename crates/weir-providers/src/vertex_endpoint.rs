//! Models deployed to Vertex AI endpoints (Gemma, Llama, any Model Garden or custom container),
//! called through the endpoint's `:predict` method.
//!
//! `:predict` takes many records in one request as `instances` and answers one `prediction`
//! each, so one call carries a whole batch (split by count and by Vertex AI's 1.5 MB request
//! limit). Two instance formats, as Model Garden's vLLM containers take them:
//! - **raw**: `{"prompt", "max_tokens", "temperature", …, "raw_response": true}`, answered by a
//!   list of strings; system text, which the format has no place for, goes before the prompt;
//! - **chat**: one `{"@requestFormat": "chatCompletions", "messages": […]}` instance per call,
//!   answered by a chat completion as `predictions`.
//!
//! An answer with fewer predictions than instances never loses records: the instances left
//! unanswered fail alone (and are retried alone); the answered ones stand.
//! (Endpoints that speak the OpenAI protocol — the `/chat/completions` route or `:rawPredict` —
//! use [`OpenAiHandler`](crate::openai::OpenAiHandler) with the endpoint's URL.)

use serde_json::{json, Map, Value};
use weir_core::{BatchAnswer, ErrorKind, ModelError, ModelHandler, ModelRequest, ModelResponse};

use crate::http::{put_sampling, redact, Credential};

/// Vertex AI refuses request bodies over 1.5 MB; instances are kept under this, leaving room
/// for the envelope and parameters.
pub const MAX_REQUEST_BYTES: usize = 1_500_000;

/// How records become `:predict` instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InstanceFormat {
    /// Model Garden vLLM's raw prompt instances, many per request.
    #[default]
    Raw,
    /// `@requestFormat: chatCompletions`, one instance per request.
    Chat,
}

/// A client of one Vertex AI endpoint's `:predict`.
#[derive(Debug)]
pub struct PredictHandler {
    client: reqwest::Client,
    url: String,
    model_id: String,
    credential: Credential,
    format: InstanceFormat,
    max_batch: usize,
}

impl PredictHandler {
    /// A client posting to `url` (`…/endpoints/{id}:predict`), at most `max_batch` instances
    /// per call (raw format; the chat format takes one).
    pub fn new(
        client: reqwest::Client,
        url: String,
        model_id: String,
        credential: Credential,
        format: InstanceFormat,
        max_batch: usize,
    ) -> Self {
        let max_batch = match format {
            InstanceFormat::Raw => max_batch.max(1),
            InstanceFormat::Chat => 1,
        };
        Self { client, url, model_id, credential, format, max_batch }
    }

    /// The instance for `request`.
    pub fn instance(&self, request: &ModelRequest) -> Result<Value, ModelError> {
        let p = &request.params;
        if p.response_schema.is_some() || p.response_mime_type.is_some() {
            return Err(ModelError::new(
                ErrorKind::InvalidInput,
                "a response schema or MIME type cannot be sent in a :predict instance; leave it out or call the \
                 endpoint's OpenAI-compatible route (--endpoint-format openai)",
            ));
        }
        let mut inst = Map::new();
        match self.format {
            InstanceFormat::Raw => {
                let prompt = match &request.system {
                    Some(system) => format!("{system}\n\n{}", request.prompt),
                    None => request.prompt.clone(),
                };
                inst.insert("prompt".into(), json!(prompt));
                put_sampling(&mut inst, p, &crate::openai::NAMES);
                inst.insert("raw_response".into(), json!(true));
            }
            InstanceFormat::Chat => {
                inst.insert("@requestFormat".into(), json!("chatCompletions"));
                let mut messages = Vec::with_capacity(2);
                if let Some(system) = &request.system {
                    messages.push(json!({"role": "system", "content": &**system}));
                }
                messages.push(json!({"role": "user", "content": request.prompt}));
                inst.insert("messages".into(), Value::Array(messages));
                put_sampling(&mut inst, p, &crate::openai::NAMES);
            }
        }
        Ok(Value::Object(inst))
    }
}

/// Reads one raw-format prediction: a string, or an object carrying the text under a name
/// serving containers use.
fn raw_prediction(p: &Value) -> Result<ModelResponse, ModelError> {
    let text = match p {
        Value::String(s) => s.clone(),
        Value::Object(o) => ["output", "generated_text", "text", "content"]
            .iter()
            .find_map(|k| o.get(*k).and_then(Value::as_str))
            .map(str::to_string)
            .ok_or_else(|| {
                ModelError::new(ErrorKind::MalformedResponse, "a prediction has no text (output, generated_text, text)")
            })?,
        other => {
            return Err(ModelError::new(
                ErrorKind::MalformedResponse,
                format!("a prediction is neither text nor an object: {}", crate::http::clip(&other.to_string())),
            ))
        }
    };
    Ok(ModelResponse { text, finish_reason: "stop".into(), ..ModelResponse::default() })
}

/// Reads a `:predict` answer for `sent` instances: one result per instance. Instances the
/// answer leaves out fail alone with a retryable error, so they are sent again; more
/// predictions than instances cannot be matched and fail the call.
pub fn parse_predictions(body: &[u8], sent: usize, format: InstanceFormat) -> BatchAnswer {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ModelError::new(ErrorKind::MalformedResponse, format!("the answer is not JSON: {e}")))?;
    let preds = v
        .get("predictions")
        .ok_or_else(|| ModelError::new(ErrorKind::MalformedResponse, "the answer has no predictions"))?;
    if format == InstanceFormat::Chat {
        // The chat form answers its one instance with a chat completion object.
        let bytes = serde_json::to_vec(preds).unwrap_or_default();
        return Ok(vec![crate::openai::parse_response(&bytes)]);
    }
    let Value::Array(preds) = preds else {
        return Err(ModelError::new(ErrorKind::MalformedResponse, "predictions is not a list"));
    };
    crate::http::one_per_item(preds.iter().map(raw_prediction).collect(), sent)
}

#[async_trait::async_trait]
impl ModelHandler for PredictHandler {
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        weir_core::handler::answer_one(self, request).await
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn endpoint(&self) -> &str {
        &self.url
    }

    fn quota_credential(&self) -> Option<&str> {
        self.credential.quota_id()
    }

    fn request_form(&self) -> Option<&str> {
        // The raw form keeps the source it always had (its cached answers stay good).
        (self.format == InstanceFormat::Chat).then_some("chat instances")
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn max_batch_bytes(&self) -> Option<usize> {
        Some(MAX_REQUEST_BYTES)
    }

    fn request_bytes(&self, request: &ModelRequest) -> usize {
        self.instance(request).map(|i| i.to_string().len() + 1).unwrap_or(0)
    }

    async fn generate_batch(&self, requests: &[ModelRequest]) -> BatchAnswer {
        // A request that cannot become an instance fails alone; the others are sent.
        let mut slots: Vec<Option<Result<ModelResponse, ModelError>>> = Vec::with_capacity(requests.len());
        let mut instances = Vec::with_capacity(requests.len());
        for r in requests {
            match self.instance(r) {
                Ok(i) => {
                    instances.push(i);
                    slots.push(None);
                }
                Err(e) => slots.push(Some(Err(e))),
            }
        }
        if instances.is_empty() {
            return Ok(slots.into_iter().flatten().collect());
        }
        let sent = instances.len();
        let body = json!({ "instances": instances });
        let (reply, secret) = self.credential.post(&self.client, &self.url, &body).await?;
        if reply.status != 200 {
            return Err(redact(
                crate::gemini::classify_error(reply.status, &reply.headers, &reply.body),
                secret.as_ref(),
            ));
        }
        let mut answers = parse_predictions(&reply.body, sent, self.format)?.into_iter();
        Ok(slots
            .into_iter()
            .map(|s| {
                s.unwrap_or_else(|| {
                    answers
                        .next()
                        .unwrap_or_else(|| Err(ModelError::new(ErrorKind::MalformedResponse, "no prediction")))
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_answer_fails_only_the_instances_left_out() {
        let answers = parse_predictions(br#"{"predictions":["a","b"]}"#, 4, InstanceFormat::Raw).unwrap();
        assert_eq!(answers.len(), 4);
        assert_eq!(answers[0].as_ref().unwrap().text, "a");
        assert_eq!(answers[1].as_ref().unwrap().text, "b");
        for a in &answers[2..] {
            let e = a.as_ref().unwrap_err();
            assert_eq!(e.kind, ErrorKind::MalformedResponse);
            assert!(e.message.contains("answered 2 items of 4"), "{}", e.message);
        }
        assert!(parse_predictions(br#"{"predictions":["a","b","c"]}"#, 2, InstanceFormat::Raw).is_err());
        assert!(parse_predictions(br#"{"deployedModelId":"1"}"#, 2, InstanceFormat::Raw).is_err());
    }

    #[test]
    fn predictions_may_be_objects() {
        let a =
            parse_predictions(br#"{"predictions":[{"generated_text":"x"},{"n":1}]}"#, 2, InstanceFormat::Raw).unwrap();
        assert_eq!(a[0].as_ref().unwrap().text, "x");
        assert!(a[1].is_err());
    }

    #[test]
    fn chat_predictions_are_a_chat_completion() {
        let body = br#"{"predictions":{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}}"#;
        let a = parse_predictions(body, 1, InstanceFormat::Chat).unwrap();
        let r = a[0].as_ref().unwrap();
        assert_eq!((r.text.as_str(), r.usage.total_tokens), ("hi", 4));
    }
}
