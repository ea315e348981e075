//! Anthropic's Messages API (`POST {base}/v1/messages`): Claude models called with an API key
//! (`x-api-key`) and the API's version header, answers read from their content blocks, streams
//! from its named SSE events, errors and rate-limit headers read the Anthropic way.

use serde_json::{json, Map, Value};
use weir_core::{
    Delta, DeltaStream, ErrorKind, GenParams, LimitInfo, ModelError, ModelHandler, ModelRequest, ModelResponse,
    QuotaScope, RetryHint, Usage,
};

use crate::http::{clip, cut_stream, deltas, encode, redact, status_error, Credential, Opened, Secret, StreamParser};

/// The API version weir speaks (sent as `anthropic-version` on every request).
pub const API_VERSION: &str = "2023-06-01";

/// Output tokens asked for when the run does not say (`--param max_output_tokens=N`): the API
/// requires a number, and this one fits every current Claude model.
pub const DEFAULT_MAX_TOKENS: u64 = 4096;

/// The tool a response schema is asked through: the model is made to call it, and its input is
/// the answer.
const ANSWER_TOOL: &str = "answer";

/// A client of one Anthropic endpoint and model.
#[derive(Debug)]
pub struct AnthropicHandler {
    client: reqwest::Client,
    url: String,
    /// Where streamed calls go (Vertex AI's `:streamRawPredict`; the same URL on Anthropic's).
    stream_url: String,
    model: String,
    model_id: String,
    credential: Credential,
    /// Claude on Vertex AI: the model is in the URL, and the body names the API version.
    vertex: bool,
}

/// The API version Claude on Vertex AI takes in the body (`anthropic_version`).
pub const VERTEX_VERSION: &str = "vertex-2023-10-16";

impl AnthropicHandler {
    /// `base` is the API root (`https://api.anthropic.com`, or `ANTHROPIC_BASE_URL`); `client`
    /// must send `anthropic-version` (see [`client`]).
    pub fn new(client: reqwest::Client, base: &reqwest::Url, model: &str, key: Option<Secret>) -> Self {
        let url = format!("{}/v1/messages", base.as_str().trim_end_matches('/'));
        let credential = key.map_or(Credential::None, |k| Credential::Key(k, Some("x-api-key")));
        let model_id = format!("anthropic/{model}");
        Self { client, stream_url: url.clone(), url, model: model.to_string(), model_id, credential, vertex: false }
    }

    /// Claude on Vertex AI: `root` is the publisher model's URL
    /// (`…/locations/L/publishers/anthropic/models/M`), called at `:rawPredict` and
    /// `:streamRawPredict` with Google access tokens (`tokens`).
    pub fn vertex(client: reqwest::Client, root: &str, tokens: Credential, model: &str, model_id: String) -> Self {
        Self {
            client,
            url: format!("{root}:rawPredict"),
            stream_url: format!("{root}:streamRawPredict"),
            model: model.to_string(),
            model_id,
            credential: tokens,
            vertex: true,
        }
    }

    /// The request body for `request` (`stream`: as a streamed call).
    pub fn body(&self, request: &ModelRequest, stream: bool) -> Result<Value, ModelError> {
        self.body_with(request, stream, false)
    }

    fn body_with(&self, request: &ModelRequest, stream: bool, marks: bool) -> Result<Value, ModelError> {
        let mut body = Map::new();
        match self.vertex {
            true => body.insert("anthropic_version".into(), json!(VERTEX_VERSION)),
            false => body.insert("model".into(), json!(self.model)),
        };
        let content = match request.media.is_empty() {
            true => json!(request.prompt),
            false => Value::Array(content_blocks(request, marks)?),
        };
        body.insert("messages".into(), json!([{"role": "user", "content": content}]));
        if let Some(system) = &request.system {
            body.insert("system".into(), json!(&**system));
        }
        apply_params(&mut body, &request.params)?;
        if stream {
            body.insert("stream".into(), json!(true));
        }
        Ok(Value::Object(body))
    }

    fn encoded(&self, request: &ModelRequest, stream: bool) -> Result<bytes::Bytes, ModelError> {
        encode(&self.body_with(request, stream, true)?, &request.media)
    }
}

/// An HTTP client that sends the API's version header with every request.
pub fn client() -> Result<reqwest::Client, crate::ProviderError> {
    crate::http::client_with(version_header())
}

/// [`client`] for Message Batches (with the job APIs' read timeout).
pub fn job_client() -> Result<reqwest::Client, crate::ProviderError> {
    crate::http::job_client_with(version_header())
}

fn version_header() -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("anthropic-version", reqwest::header::HeaderValue::from_static(API_VERSION));
    headers
}

/// Media types the Messages API takes as `image` blocks.
const IMAGES: [&str; 4] = ["image/jpeg", "image/png", "image/gif", "image/webp"];
/// Media types the Messages API takes as `document` blocks.
const DOCUMENTS: [&str; 2] = ["application/pdf", "text/plain"];

/// Whether the Messages API takes a part of this media type: checked before any call for a
/// type the run names (`--media-field photo:audio/wav`), which would otherwise fail every
/// record.
pub fn takes_media_type(mime: &str) -> bool {
    IMAGES.contains(&mime) || DOCUMENTS.contains(&mime)
}

/// A user message's content with media: the text, then images (`image`) and PDFs and plain
/// text (`document`), each as base64 in its block; other types no Messages API takes.
fn content_blocks(request: &ModelRequest, marks: bool) -> Result<Vec<Value>, ModelError> {
    let mut content = vec![json!({"type": "text", "text": request.prompt})];
    for (i, p) in request.media.iter().enumerate() {
        let data = match marks {
            true => crate::http::inline_mark(i),
            false => crate::http::base64(&p.data),
        };
        let source = json!({"type": "base64", "media_type": p.mime, "data": data});
        content.push(match p.mime.as_str() {
            m if IMAGES.contains(&m) => json!({"type": "image", "source": source}),
            m if DOCUMENTS.contains(&m) => json!({"type": "document", "source": source}),
            other => {
                return Err(ModelError::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "part {} is {other}, which Anthropic's Messages API does not take (images: JPEG, PNG, GIF, WebP; documents: PDF, plain text)",
                        i + 1
                    ),
                )
                .with_hint(RetryHint::Never))
            }
        });
        if p.uri.is_some() {
            return Err(ModelError::new(ErrorKind::InvalidInput, "Anthropic's Messages API takes media inline only")
                .with_hint(RetryHint::Never));
        }
    }
    Ok(content)
}

/// Maps provider-neutral parameters to the Messages API's; a parameter it has no place for is
/// refused (sent, the API would refuse every request).
pub fn apply_params(body: &mut Map<String, Value>, p: &GenParams) -> Result<(), ModelError> {
    let refused = |name: &str| {
        Err(ModelError::new(
            ErrorKind::BadRequest,
            format!("--param {name}: Anthropic's Messages API has no such parameter"),
        )
        .with_hint(RetryHint::StopRun))
    };
    if p.seed.is_some() {
        return refused("seed");
    }
    if p.presence_penalty.is_some() {
        return refused("presence_penalty");
    }
    if p.frequency_penalty.is_some() {
        return refused("frequency_penalty");
    }
    body.insert("max_tokens".into(), json!(p.max_output_tokens.map_or(DEFAULT_MAX_TOKENS, u64::from)));
    if let Some(t) = p.temperature {
        body.insert("temperature".into(), json!(t));
    }
    if let Some(t) = p.top_p {
        body.insert("top_p".into(), json!(t));
    }
    if let Some(k) = p.top_k {
        body.insert("top_k".into(), json!(k));
    }
    if !p.stop.is_empty() {
        body.insert("stop_sequences".into(), json!(p.stop));
    }
    if let Some(schema) = &p.response_schema {
        // Through a tool the model must call: its input is the answer, of the schema's shape.
        let schema = weir_core::schema::to_json_schema(schema);
        let input_schema = match schema.get("type").and_then(Value::as_str) {
            Some("object") => schema,
            // A tool's input is an object: any other schema is its one field, `value`.
            _ => json!({"type": "object", "properties": {"value": schema}, "required": ["value"]}),
        };
        body.insert(
            "tools".into(),
            json!([{"name": ANSWER_TOOL, "description": "Give the answer.", "input_schema": input_schema}]),
        );
        body.insert("tool_choice".into(), json!({"type": "tool", "name": ANSWER_TOOL}));
    }
    Ok(())
}

/// Classifies an error answer by its `error.type` and status (429 `rate_limit_error` with
/// `retry-after`, 529 `overloaded_error`, …).
pub fn classify_error(status: u16, headers: &reqwest::header::HeaderMap, body: &[u8]) -> ModelError {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let err = v.get("error").unwrap_or(&Value::Null);
    let kind = err.get("type").and_then(Value::as_str).unwrap_or("");
    let message = err
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let e = status_error(status, headers, clip(&format!("HTTP {status}: {kind}: {message}")));
    match (status, kind) {
        // Overloaded: the service's, not the key's; wait as advised, else back off.
        (529, _) | (_, "overloaded_error") => {
            let advised = crate::http::retry_after(headers);
            ModelError { kind: ErrorKind::Server, hint: RetryHint::Later(advised), ..e }
        }
        (429, _) | (_, "rate_limit_error") => {
            let mut e = ModelError { kind: ErrorKind::RateLimited, ..e };
            let lower = message.to_ascii_lowercase();
            e.quota = if lower.contains("token") {
                Some(QuotaScope::Tokens)
            } else if lower.contains("request") {
                Some(QuotaScope::Requests)
            } else {
                None
            };
            e
        }
        (_, "authentication_error" | "permission_error") => {
            ModelError { kind: ErrorKind::Auth, hint: RetryHint::Never, ..e }
        }
        (_, "billing_error") => ModelError { kind: ErrorKind::QuotaExhausted, hint: RetryHint::StopRun, ..e },
        _ => e,
    }
}

/// Reads `anthropic-ratelimit-requests-limit` and `-reset` (an RFC 3339 time), and the tokens'
/// (`-tokens-`, else the input tokens' limit, which is what a prompt-heavy run meets).
pub fn limit_headers(headers: &reqwest::header::HeaderMap) -> Option<LimitInfo> {
    let text = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).map(str::trim);
    let num = |k: &str| text(k).and_then(|v| v.parse::<u64>().ok());
    let reset = |k: &str| {
        let stamp = text(k)?.trim_end_matches('Z');
        let at = humantime::parse_rfc3339_weak(stamp).ok()?;
        let left = at.duration_since(std::time::SystemTime::now()).unwrap_or_default();
        // A time in whole seconds is the true one cut down to its second: the wait is rounded
        // up to whole seconds, which is then never shorter than the true one by a second (a
        // quota window learned from it would be a second short: 100 per 4 s for 100 per 5 s).
        Some(match stamp.contains('.') {
            true => left,
            false => std::time::Duration::from_secs(left.as_secs() + u64::from(left.subsec_nanos() > 0)),
        })
    };
    let (tokens, tokens_reset) = match num("anthropic-ratelimit-tokens-limit") {
        Some(n) => (Some(n), reset("anthropic-ratelimit-tokens-reset")),
        None => (num("anthropic-ratelimit-input-tokens-limit"), reset("anthropic-ratelimit-input-tokens-reset")),
    };
    let info = LimitInfo {
        requests: num("anthropic-ratelimit-requests-limit"),
        requests_reset: reset("anthropic-ratelimit-requests-reset"),
        tokens,
        tokens_reset,
    };
    (info.requests.is_some() || info.tokens.is_some()).then_some(info)
}

/// weir's finish reason for a stop reason: `stop` for an answer that ended (also by a stop
/// sequence, or by the answer tool), `length` for one cut at `max_tokens`, else the API's own.
fn finish_of(stop: &str) -> String {
    match stop {
        "end_turn" | "stop_sequence" | "tool_use" => "stop".into(),
        "max_tokens" => "length".into(),
        other => other.to_string(),
    }
}

/// Reads a `usage` object (input tokens include those read from or written to the prompt cache).
fn usage(u: Option<&Value>) -> Usage {
    let n = |k: &str| u.and_then(|u| u.get(k)).and_then(Value::as_u64).unwrap_or(0);
    let input = n("input_tokens") + n("cache_creation_input_tokens") + n("cache_read_input_tokens");
    let output = n("output_tokens");
    Usage { prompt_tokens: input, output_tokens: output, total_tokens: input + output }
}

/// Parses a message: its text blocks joined, or the answer tool's input as JSON.
pub fn parse_response(body: &[u8]) -> Result<ModelResponse, ModelError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ModelError::new(ErrorKind::MalformedResponse, format!("the answer is not JSON: {e}")))?;
    if v.get("type").and_then(Value::as_str) == Some("error") {
        return Err(ModelError::new(ErrorKind::Server, clip(&format!("error in a 200 answer: {}", v["error"]))));
    }
    let blocks = v
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| ModelError::new(ErrorKind::MalformedResponse, "the answer has no content blocks".to_string()))?;
    let stop = v.get("stop_reason").and_then(Value::as_str).unwrap_or("unknown");
    if stop == "refusal" {
        return Err(ModelError::new(ErrorKind::Blocked, "the model refused to answer (stop_reason refusal)"));
    }
    let mut text = String::new();
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("tool_use") if b.get("name").and_then(Value::as_str) == Some(ANSWER_TOOL) => {
                let input = b.get("input").cloned().unwrap_or(Value::Null);
                // A schema that was not an object was asked for as the field `value`.
                let answer = match input.as_object() {
                    Some(o) if o.len() == 1 && o.contains_key("value") => o["value"].clone(),
                    _ => input,
                };
                text = answer.to_string();
            }
            _ => {}
        }
    }
    Ok(ModelResponse {
        text,
        finish_reason: finish_of(stop),
        usage: usage(v.get("usage")),
        model_version: v.get("model").and_then(Value::as_str).map(str::to_string),
        limits: None,
        embedding: None,
    })
}

/// Reads a streamed message: `message_start` (the model, input tokens), `content_block_delta`
/// text (and the answer tool's `input_json_delta` pieces), `message_delta` (the stop reason,
/// output tokens), `message_stop`; `ping` is nothing, `error` fails the call.
#[derive(Debug, Default)]
pub struct EventParser {
    stop: Option<String>,
    usage: Usage,
    model: Option<String>,
    ended: bool,
}

impl EventParser {
    fn end(&mut self) -> Delta {
        self.ended = true;
        let usage = Usage { total_tokens: self.usage.prompt_tokens + self.usage.output_tokens, ..self.usage };
        Delta::End(ModelResponse {
            finish_reason: finish_of(self.stop.as_deref().unwrap_or("unknown")),
            usage,
            model_version: self.model.take(),
            ..ModelResponse::default()
        })
    }
}

impl StreamParser for EventParser {
    fn event(&mut self, data: &str) -> Result<Option<Delta>, ModelError> {
        let v: Value = serde_json::from_str(data)
            .map_err(|e| ModelError::new(ErrorKind::MalformedResponse, format!("a streamed event is not JSON: {e}")))?;
        match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "message_start" => {
                let m = v.get("message");
                self.model = m.and_then(|m| m.get("model")).and_then(Value::as_str).map(str::to_string);
                let u = usage(m.and_then(|m| m.get("usage")));
                self.usage.prompt_tokens = u.prompt_tokens;
                self.usage.output_tokens = u.output_tokens;
                Ok(None)
            }
            "content_block_delta" => {
                let d = v.get("delta");
                let piece = match d.and_then(|d| d.get("type")).and_then(Value::as_str) {
                    Some("text_delta") => d.and_then(|d| d.get("text")).and_then(Value::as_str),
                    Some("input_json_delta") => d.and_then(|d| d.get("partial_json")).and_then(Value::as_str),
                    _ => None,
                };
                Ok(piece.filter(|p| !p.is_empty()).map(|p| Delta::Text(p.to_string())))
            }
            "message_delta" => {
                if let Some(s) = v.pointer("/delta/stop_reason").and_then(Value::as_str) {
                    if s == "refusal" {
                        return Err(ModelError::new(ErrorKind::Blocked, "the model refused to answer"));
                    }
                    self.stop = Some(s.to_string());
                }
                if let Some(n) = v.pointer("/usage/output_tokens").and_then(Value::as_u64) {
                    self.usage.output_tokens = n;
                }
                Ok(None)
            }
            "message_stop" => Ok(Some(self.end())),
            "error" => {
                let kind = v.pointer("/error/type").and_then(Value::as_str).unwrap_or("");
                let message = v.pointer("/error/message").and_then(Value::as_str).unwrap_or("");
                let e = ModelError::new(ErrorKind::Server, clip(&format!("error in the stream: {kind}: {message}")));
                Err(match kind {
                    "overloaded_error" => e.with_hint(RetryHint::Later(None)),
                    "rate_limit_error" => ModelError { kind: ErrorKind::RateLimited, ..e },
                    _ => e,
                })
            }
            _ => Ok(None),
        }
    }

    fn finish(&mut self) -> Result<Delta, ModelError> {
        match (self.ended, &self.stop) {
            (false, Some(_)) => Ok(self.end()),
            _ => Err(cut_stream()),
        }
    }
}

#[async_trait::async_trait]
impl ModelHandler for AnthropicHandler {
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
            (Opened::Events(events), _) => Ok(deltas(events, EventParser::default())),
            (Opened::Error(reply), secret) => {
                Err(redact(classify_error(reply.status, &reply.headers, &reply.body), secret.as_ref()))
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(prompt: &str) -> ModelRequest {
        ModelRequest {
            prompt: prompt.into(),
            system: None,
            params: Default::default(),
            media: Vec::new().into(),
            fields: None,
        }
    }

    fn handler() -> AnthropicHandler {
        let base = reqwest::Url::parse("https://api.anthropic.com").unwrap();
        AnthropicHandler::new(reqwest::Client::new(), &base, "claude-sonnet-4-5", Some(Secret::new("k".into())))
    }

    #[test]
    fn a_body_has_max_tokens_system_and_a_schema_as_a_tool() {
        let mut r = request("classify");
        r.system = Some("be brief".into());
        let mut p = GenParams { temperature: Some(0.2), stop: vec!["END".into()], ..GenParams::default() };
        p.response_schema = Some(json!({"type": "string"}));
        r.params = std::sync::Arc::new(p);
        let b = handler().body(&r, true).unwrap();
        assert_eq!(b["model"], "claude-sonnet-4-5");
        assert_eq!(b["max_tokens"], DEFAULT_MAX_TOKENS);
        assert_eq!(b["system"], "be brief");
        assert_eq!(b["messages"][0]["content"], "classify");
        assert_eq!(b["stop_sequences"], json!(["END"]));
        assert_eq!(b["stream"], true);
        assert_eq!(b["tool_choice"]["name"], ANSWER_TOOL);
        assert_eq!(b["tools"][0]["input_schema"]["properties"]["value"]["type"], "string");
        let seeded = GenParams { seed: Some(1), ..GenParams::default() };
        r.params = std::sync::Arc::new(seeded);
        assert_eq!(handler().body(&r, false).unwrap_err().kind, ErrorKind::BadRequest);
    }

    #[test]
    fn on_vertex_ai_the_model_is_in_the_url_and_the_version_in_the_body() {
        let h = AnthropicHandler::vertex(
            reqwest::Client::new(),
            "https://x/v1/projects/p/locations/l/publishers/anthropic/models/claude-x",
            Credential::None,
            "claude-x",
            "vertex_ai/claude-x".into(),
        );
        let b = h.body(&request("hi"), true).unwrap();
        assert!(b.get("model").is_none());
        assert_eq!(b["anthropic_version"], VERTEX_VERSION);
        assert!(h.url.ends_with("/claude-x:rawPredict") && h.stream_url.ends_with("/claude-x:streamRawPredict"));
    }

    #[test]
    fn answers_are_text_blocks_or_the_tools_input() {
        let text = br#"{"type":"message","content":[{"type":"text","text":"Hel"},{"type":"text","text":"lo"}],
            "model":"claude-x","stop_reason":"max_tokens","usage":{"input_tokens":5,"cache_read_input_tokens":2,"output_tokens":3}}"#;
        let r = parse_response(text).unwrap();
        assert_eq!((r.text.as_str(), r.finish_reason.as_str()), ("Hello", "length"));
        assert_eq!((r.usage.prompt_tokens, r.usage.output_tokens, r.usage.total_tokens), (7, 3, 10));
        let tool = br#"{"type":"message","content":[{"type":"tool_use","name":"answer","input":{"value":"cat"}}],
            "stop_reason":"tool_use","usage":{"input_tokens":1,"output_tokens":1}}"#;
        let r = parse_response(tool).unwrap();
        assert_eq!((r.text.as_str(), r.finish_reason.as_str()), ("\"cat\"", "stop"));
        let refusal = br#"{"type":"message","content":[],"stop_reason":"refusal","usage":{}}"#;
        assert_eq!(parse_response(refusal).unwrap_err().kind, ErrorKind::Blocked);
    }

    #[test]
    fn errors_are_read_the_anthropic_way() {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("retry-after", "3".parse().unwrap());
        let e = classify_error(429, &h, br#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"}}"#);
        assert_eq!(e.kind, ErrorKind::RateLimited);
        assert_eq!(e.hint, RetryHint::Later(Some(std::time::Duration::from_secs(3))));
        assert_eq!(e.quota, Some(QuotaScope::Tokens));
        let e = classify_error(
            529,
            &Default::default(),
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        assert_eq!((e.kind, e.hint), (ErrorKind::Server, RetryHint::Later(None)));
        let e = classify_error(
            401,
            &Default::default(),
            br#"{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"}}"#,
        );
        assert_eq!(e.kind, ErrorKind::Auth);
    }

    #[test]
    fn limits_come_from_the_ratelimit_headers() {
        let mut h = reqwest::header::HeaderMap::new();
        let reset =
            humantime::format_rfc3339_seconds(std::time::SystemTime::now() + std::time::Duration::from_secs(30));
        h.insert("anthropic-ratelimit-requests-limit", "50".parse().unwrap());
        h.insert("anthropic-ratelimit-requests-reset", reset.to_string().parse().unwrap());
        h.insert("anthropic-ratelimit-input-tokens-limit", "40000".parse().unwrap());
        let l = limit_headers(&h).unwrap();
        assert_eq!((l.requests, l.tokens), (Some(50), Some(40000)));
        // Whole seconds: the wait rounded up, never a second short of the true 30 s.
        assert_eq!(l.requests_reset, Some(std::time::Duration::from_secs(30)));
    }

    #[test]
    fn streams_are_read_from_their_events() {
        let mut p = EventParser::default();
        let events = [
            r#"{"type":"message_start","message":{"model":"claude-x","usage":{"input_tokens":9,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" there"}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":4}}"#,
        ];
        let mut text = String::new();
        for e in events {
            if let Some(Delta::Text(t)) = p.event(e).unwrap() {
                text.push_str(&t);
            }
        }
        assert_eq!(text, "Hi there");
        let Some(Delta::End(r)) = p.event(r#"{"type":"message_stop"}"#).unwrap() else { panic!() };
        assert_eq!((r.finish_reason.as_str(), r.usage.prompt_tokens, r.usage.output_tokens), ("stop", 9, 4));
        let mut cut = EventParser::default();
        cut.event(events[0]).unwrap();
        assert!(cut.finish().is_err(), "a stream cut before its stop reason");
        let err = p.event(r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#);
        assert_eq!(err.unwrap_err().kind, ErrorKind::Server);
    }
}
