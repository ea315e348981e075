//! OpenAI-compatible chat completions: OpenAI itself, vLLM, llama.cpp's server, and any other
//! server that speaks `POST {base}/chat/completions`.

use serde_json::{json, Map, Value};
use weir_core::{
    Delta, DeltaStream, ErrorKind, GenParams, LimitInfo, ModelError, ModelHandler, ModelRequest, ModelResponse,
    QuotaScope, RetryHint, Usage,
};

use crate::http::{
    clip, cut_stream, deltas, encode, put_sampling, redact, status_error, Credential, Opened, SamplingNames, Secret,
    StreamParser,
};

/// A client of one OpenAI-compatible endpoint and model.
#[derive(Debug)]
pub struct OpenAiHandler {
    client: reqwest::Client,
    url: String,
    /// Where streamed calls go: the same URL, but for Vertex AI's `:rawPredict`, whose
    /// streaming form is `:streamRawPredict`.
    stream_url: String,
    endpoint: String,
    model: String,
    model_id: String,
    credential: Credential,
    /// OpenAI's tokenizer for this model, when it is one of OpenAI's (exact token weights).
    bpe: Option<Tokenizer>,
}

/// One of OpenAI's tokenizers (tiktoken's, built in).
#[derive(Clone, Copy)]
pub struct Tokenizer(&'static tiktoken_rs::CoreBPE);

impl Tokenizer {
    /// The tokens of `text`.
    pub fn count(&self, text: &str) -> u64 {
        self.0.encode_ordinary(text).len() as u64
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokenizer")
    }
}

/// OpenAI's tokenizer for `model` (`gpt-4o-mini`, `text-embedding-3-small`, …), known offline;
/// `None` for other servers' models, whose tokens are then estimated from their length.
pub fn tokenizer_for(model: &str) -> Option<Tokenizer> {
    tiktoken_rs::bpe_for_model(model).ok().map(Tokenizer)
}

impl OpenAiHandler {
    /// `base` is the API root (for example `https://api.openai.com/v1`); `model` is sent as is.
    pub fn new(client: reqwest::Client, base: &reqwest::Url, model: &str, key: Option<Secret>) -> Self {
        let url = format!("{}/chat/completions", base.as_str().trim_end_matches('/'));
        let credential = key.map_or(Credential::None, |k| Credential::Key(k, None));
        Self::at(client, url, model.to_string(), format!("openai/{model}"), credential)
    }

    /// A chat-completions client posting to `url` itself (Vertex AI endpoints' OpenAI-compatible
    /// route, or `:rawPredict`), sending `model` in the body and naming itself `model_id`.
    pub fn at(client: reqwest::Client, url: String, model: String, model_id: String, credential: Credential) -> Self {
        let endpoint = url.clone();
        let bpe = tokenizer_for(&model);
        Self { client, stream_url: url.clone(), url, endpoint, model, model_id, credential, bpe }
    }

    /// Sends streamed calls to `url` instead (Vertex AI's `:streamRawPredict`).
    pub fn with_stream_url(mut self, url: String) -> Self {
        self.stream_url = url;
        self
    }

    /// The request body for `request`.
    pub fn body(&self, request: &ModelRequest) -> Value {
        self.body_with(request, false)
    }

    /// The body of a call, written: inline media spliced in as it is written ([`encode`]).
    fn encoded(&self, request: &ModelRequest, stream: bool) -> Result<bytes::Bytes, ModelError> {
        let mut body = self.body_with(request, true);
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        encode(&body, &request.media)
    }

    /// The body, with each inline part's base64 in place, or (`marks`) a mark where
    /// [`encode`] writes it.
    fn body_with(&self, request: &ModelRequest, marks: bool) -> Value {
        let mut messages = Vec::with_capacity(2);
        if let Some(system) = &request.system {
            messages.push(json!({"role": "system", "content": &**system}));
        }
        messages.push(match request.media.is_empty() {
            true => json!({"role": "user", "content": request.prompt}),
            false => json!({"role": "user", "content": content_parts(request, marks)}),
        });
        let mut body = Map::new();
        body.insert("model".into(), json!(self.model));
        body.insert("messages".into(), Value::Array(messages));
        apply_params(&mut body, &request.params);
        Value::Object(body)
    }
}

/// A user message's content with media: the text, then each part in the form the Chat
/// Completions API takes it (images as data URLs, audio as `input_audio`, other files as `file`).
fn content_parts(request: &ModelRequest, marks: bool) -> Vec<Value> {
    let mut content = vec![json!({"type": "text", "text": request.prompt})];
    for (i, p) in request.media.iter().enumerate() {
        let data = match marks {
            true => crate::http::inline_mark(i),
            false => crate::http::base64(&p.data),
        };
        content.push(match p.mime.as_str() {
            m if m.starts_with("image/") => {
                json!({"type": "image_url", "image_url": {"url": format!("data:{m};base64,{data}")}})
            }
            "audio/wav" => json!({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}),
            "audio/mpeg" => json!({"type": "input_audio", "input_audio": {"data": data, "format": "mp3"}}),
            m => {
                let ext = m.rsplit('/').next().unwrap_or("bin");
                json!({"type": "file", "file": {"filename": format!("part{}.{ext}", i + 1),
                       "file_data": format!("data:{m};base64,{data}")}})
            }
        });
    }
    content
}

/// OpenAI's names for the sampling parameters (vLLM and llama.cpp also take `top_k`).
pub(crate) const NAMES: SamplingNames = SamplingNames {
    temperature: "temperature",
    top_p: "top_p",
    top_k: "top_k",
    max_output_tokens: "max_tokens",
    seed: "seed",
    stop: "stop",
    presence_penalty: "presence_penalty",
    frequency_penalty: "frequency_penalty",
};

/// Maps provider-neutral parameters to OpenAI's names.
pub fn apply_params(body: &mut Map<String, Value>, p: &GenParams) {
    put_sampling(body, p, &NAMES);
    if let Some(schema) = &p.response_schema {
        let schema = weir_core::schema::to_json_schema(schema);
        let strict = strict_ok(&schema);
        body.insert(
            "response_format".into(),
            json!({"type": "json_schema", "json_schema": {"name": "response", "schema": schema, "strict": strict}}),
        );
    } else if p.response_mime_type.as_deref() == Some("application/json") {
        body.insert("response_format".into(), json!({"type": "json_object"}));
    }
}

/// Whether OpenAI's strict structured output takes `schema`: every object closed
/// (`additionalProperties: false`) with all its properties required. OpenAI refuses a strict
/// schema that is not, failing every record; such a schema is sent as guidance instead, and
/// weir's own check of each answer against it still holds.
fn strict_ok(schema: &Value) -> bool {
    match schema {
        Value::Object(o) => {
            let is_object = o
                .get("type")
                .is_some_and(|t| t == "object" || t.as_array().is_some_and(|a| a.contains(&json!("object"))))
                || o.contains_key("properties");
            if is_object {
                let closed = o.get("additionalProperties") == Some(&Value::Bool(false));
                let required: Vec<&str> = o
                    .get("required")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                let props = o.get("properties").and_then(Value::as_object);
                if !closed || props.is_some_and(|p| p.keys().any(|k| !required.contains(&k.as_str()))) {
                    return false;
                }
            }
            o.values().all(strict_ok)
        }
        Value::Array(a) => a.iter().all(strict_ok),
        _ => true,
    }
}

/// Classifies an OpenAI error answer.
pub fn classify_error(status: u16, headers: &reqwest::header::HeaderMap, body: &[u8]) -> ModelError {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let err = v.get("error").unwrap_or(&Value::Null);
    let message = err
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let code = err.get("code").and_then(Value::as_str).unwrap_or("");
    let mut e = status_error(status, headers, clip(&format!("HTTP {status}: {message}")));
    if status == 429 {
        e.quota = match err.get("type").and_then(Value::as_str) {
            Some("tokens") => Some(QuotaScope::Tokens),
            Some("requests") => Some(QuotaScope::Requests),
            _ => None,
        };
    }
    match code {
        "insufficient_quota" => ModelError { kind: ErrorKind::QuotaExhausted, hint: RetryHint::StopRun, ..e },
        "content_filter" => ModelError { kind: ErrorKind::Blocked, hint: RetryHint::Never, ..e },
        "invalid_api_key" => ModelError { kind: ErrorKind::Auth, hint: RetryHint::Never, ..e },
        _ => e,
    }
}

/// Reads `x-ratelimit-limit-*` and `x-ratelimit-reset-*` (durations such as `12ms`, `1.5s`,
/// `6m0s`).
pub fn limit_headers(headers: &reqwest::header::HeaderMap) -> Option<LimitInfo> {
    let num = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let dur = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).and_then(parse_reset);
    let info = LimitInfo {
        requests: num("x-ratelimit-limit-requests"),
        requests_reset: dur("x-ratelimit-reset-requests"),
        tokens: num("x-ratelimit-limit-tokens"),
        tokens_reset: dur("x-ratelimit-reset-tokens"),
    };
    (info.requests.is_some() || info.tokens.is_some()).then_some(info)
}

/// Parses OpenAI's reset durations: `12ms`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn parse_reset(s: &str) -> Option<std::time::Duration> {
    let s = s.trim();
    if let Some(ms) = s.strip_suffix("ms") {
        return ms
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .map(|v| std::time::Duration::from_secs_f64(v / 1000.0));
    }
    let mut total = 0.0;
    let mut num = String::new();
    for c in s.chars() {
        match c {
            '0'..='9' | '.' => num.push(c),
            'h' | 'm' | 's' => {
                let v: f64 = num.parse().ok()?;
                total += v * match c {
                    'h' => 3600.0,
                    'm' => 60.0,
                    _ => 1.0,
                };
                num.clear();
            }
            _ => return None,
        }
    }
    (num.is_empty() && total.is_finite()).then(|| std::time::Duration::from_secs_f64(total))
}

/// Reads an OpenAI `usage` object.
fn usage(u: Option<&Value>) -> Usage {
    let n = |k: &str| u.and_then(|u| u.get(k)).and_then(Value::as_u64).unwrap_or(0);
    Usage { prompt_tokens: n("prompt_tokens"), output_tokens: n("completion_tokens"), total_tokens: n("total_tokens") }
}

/// Reads a streamed chat completion: `chat.completion.chunk` events, a finish reason, the usage
/// chunk (`stream_options.include_usage`), then `[DONE]`.
#[derive(Debug, Default)]
pub struct ChunkParser {
    finish: Option<String>,
    usage: Usage,
    model: Option<String>,
}

impl ChunkParser {
    fn end(&mut self) -> Delta {
        Delta::End(ModelResponse {
            finish_reason: self.finish.take().unwrap_or_else(|| "unknown".into()),
            usage: self.usage,
            model_version: self.model.take(),
            ..ModelResponse::default()
        })
    }
}

impl StreamParser for ChunkParser {
    fn event(&mut self, data: &str) -> Result<Option<Delta>, ModelError> {
        if data.trim() == "[DONE]" {
            return Ok(Some(self.end()));
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| ModelError::new(ErrorKind::MalformedResponse, format!("a streamed chunk is not JSON: {e}")))?;
        if let Some(err) = v.get("error") {
            return Err(ModelError::new(ErrorKind::Server, clip(&format!("error in the stream: {err}"))));
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = usage(Some(u));
        }
        if let Some(m) = v.get("model").and_then(Value::as_str) {
            self.model = Some(m.to_string());
        }
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else { return Ok(None) };
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            if f == "content_filter" {
                return Err(ModelError::new(ErrorKind::Blocked, "the answer was blocked by the content filter"));
            }
            self.finish = Some(f.to_string());
        }
        let delta = choice.get("delta");
        if let Some(r) = delta.and_then(|d| d.get("refusal")).and_then(Value::as_str).filter(|r| !r.is_empty()) {
            return Err(ModelError::new(ErrorKind::Blocked, clip(&format!("the model refused: {r}"))));
        }
        let text = delta.and_then(|d| d.get("content")).and_then(Value::as_str).unwrap_or("");
        Ok((!text.is_empty()).then(|| Delta::Text(text.to_string())))
    }

    fn finish(&mut self) -> Result<Delta, ModelError> {
        // A server that ends the events without `[DONE]` after a finish reason has answered.
        if self.finish.is_some() {
            Ok(self.end())
        } else {
            Err(cut_stream())
        }
    }
}

/// Parses a chat completion.
pub fn parse_response(body: &[u8]) -> Result<ModelResponse, ModelError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ModelError::new(ErrorKind::MalformedResponse, format!("the answer is not JSON: {e}")))?;
    let malformed = |what: &str| ModelError::new(ErrorKind::MalformedResponse, format!("the answer has no {what}"));
    if let Some(err) = v.get("error") {
        return Err(ModelError::new(ErrorKind::Server, clip(&format!("error in a 200 answer: {err}"))));
    }
    let choice = v.get("choices").and_then(|c| c.get(0)).ok_or_else(|| malformed("choices"))?;
    let finish = choice.get("finish_reason").and_then(Value::as_str).unwrap_or("unknown").to_string();
    if finish == "content_filter" {
        return Err(ModelError::new(
            ErrorKind::Blocked,
            "the answer was blocked by the content filter (finish_reason content_filter)",
        ));
    }
    let message = choice.get("message").ok_or_else(|| malformed("message"))?;
    let text = match message.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => match message.get("refusal").and_then(Value::as_str) {
            Some(r) => return Err(ModelError::new(ErrorKind::Blocked, clip(&format!("the model refused: {r}")))),
            None => String::new(),
        },
        Some(_) => return Err(malformed("string content")),
    };
    Ok(ModelResponse {
        text,
        finish_reason: finish,
        usage: usage(v.get("usage")),
        model_version: v.get("model").and_then(Value::as_str).map(str::to_string),
        limits: None,
        embedding: None,
    })
}

#[async_trait::async_trait]
impl ModelHandler for OpenAiHandler {
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let (reply, secret) =
            self.credential.post_encoded(&self.client, &self.url, self.encoded(request, false)?).await?;
        if reply.status != 200 {
            return Err(redact(classify_error(reply.status, &reply.headers, &reply.body), secret.as_ref()));
        }
        let mut r = parse_response(&reply.body)?;
        r.limits = limit_headers(&reply.headers);
        Ok(r)
    }

    fn streams(&self) -> bool {
        true
    }

    async fn generate_stream(&self, request: &ModelRequest) -> Result<DeltaStream, ModelError> {
        match self.credential.post_sse(&self.client, &self.stream_url, self.encoded(request, true)?).await? {
            (Opened::Events(events), _) => Ok(deltas(events, ChunkParser::default())),
            (Opened::Error(reply), secret) => {
                Err(redact(classify_error(reply.status, &reply.headers, &reply.body), secret.as_ref()))
            }
        }
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn count_tokens(&self, text: &str) -> Option<u64> {
        self.bpe.map(|b| b.count(text))
    }

    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn quota_credential(&self) -> Option<&str> {
        self.credential.quota_id()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_closed_schemas_with_every_property_required_are_sent_strict() {
        use serde_json::json;
        let closed = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "object", "properties": {"c": {"type": "number"}}, "required": ["c"], "additionalProperties": false}}}, "required": ["a", "b"], "additionalProperties": false});
        assert!(super::strict_ok(&closed));
        let mut open = closed.clone();
        open["additionalProperties"] = json!(true);
        assert!(!super::strict_ok(&open));
        let mut inner_open = closed.clone();
        inner_open["properties"]["b"]["items"].as_object_mut().unwrap().remove("additionalProperties");
        assert!(!super::strict_ok(&inner_open));
        let mut optional = closed.clone();
        optional["required"] = json!(["a"]);
        assert!(!super::strict_ok(&optional));
        assert!(super::strict_ok(&json!({"type": "string"})));
    }

    use super::*;
    use reqwest::header::HeaderMap;

    #[test]
    fn openai_models_are_counted_with_their_own_tokenizer() {
        let bpe = tokenizer_for("gpt-4o-mini").expect("o200k for gpt-4o");
        assert_eq!(bpe.count("Hello, world!"), 4);
        assert!(tokenizer_for("text-embedding-3-small").is_some());
        assert!(tokenizer_for("meta-llama/Llama-3.1-8B-Instruct").is_none(), "other servers' models are estimated");
    }

    #[test]
    fn parses_answers_and_filters() {
        let ok = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"model":"m"}"#;
        let r = parse_response(ok).unwrap();
        assert_eq!((r.text.as_str(), r.finish_reason.as_str(), r.usage.total_tokens), ("hi", "stop", 4));
        let filtered = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":null},"finish_reason":"content_filter"}]}"#;
        assert_eq!(parse_response(filtered).unwrap_err().kind, ErrorKind::Blocked);
        assert_eq!(parse_response(b"{\"choices\": [").unwrap_err().kind, ErrorKind::MalformedResponse);
        assert_eq!(parse_response(b"{}").unwrap_err().kind, ErrorKind::MalformedResponse);
    }

    #[test]
    fn parameters_take_openai_names() {
        let p = GenParams::from_specs([
            "temperature=0.5",
            "max_tokens=7",
            "stop=END",
            "top_k=3",
            "response_mime_type=application/json",
        ])
        .unwrap();
        let mut body = Map::new();
        apply_params(&mut body, &p);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["max_tokens"], 7);
        assert_eq!(body["stop"], serde_json::json!(["END"]));
        assert_eq!(body["top_k"], 3);
        assert_eq!(body["response_format"]["type"], "json_object");
        assert_eq!(body.len(), 5);
    }

    #[test]
    fn reset_durations() {
        use std::time::Duration;
        assert_eq!(parse_reset("12ms"), Some(Duration::from_millis(12)));
        assert_eq!(parse_reset("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset("1h2m3s"), Some(Duration::from_secs(3723)));
        assert_eq!(parse_reset("soon"), None);
    }

    #[test]
    fn classifies_errors() {
        let h = HeaderMap::new();
        let e = classify_error(
            429,
            &h,
            br#"{"error":{"code":"insufficient_quota","message":"You exceeded your current quota"}}"#,
        );
        assert_eq!((e.kind, e.hint), (ErrorKind::QuotaExhausted, RetryHint::StopRun));
        let e = classify_error(400, &h, br#"{"error":{"code":"content_filter","message":"filtered"}}"#);
        assert_eq!(e.kind, ErrorKind::Blocked);
        let e = classify_error(
            429,
            &h,
            br#"{"error":{"code":"rate_limit_exceeded","type":"tokens","message":"slow down"}}"#,
        );
        assert_eq!(e.kind, ErrorKind::RateLimited);
        assert_eq!(e.quota, Some(QuotaScope::Tokens));
        assert!(e.message.contains("slow down"));
    }
}
