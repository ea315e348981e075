//! The Gemini API's `generateContent` (and the same body on Vertex AI, later).

use serde_json::{json, Map, Value};
use weir_core::{
    Delta, DeltaStream, ErrorKind, GenParams, ModelError, ModelHandler, ModelRequest, ModelResponse, QuotaScope,
    RetryHint, Usage,
};

use crate::google_auth::TokenSource;
use crate::http::{
    clip, cut_stream, deltas, encode, proto_duration, put_sampling, redact, status_error, Credential, Opened,
    SamplingNames, Secret, StreamParser,
};

/// A client of one Gemini model.
#[derive(Debug)]
pub struct GeminiHandler {
    client: reqwest::Client,
    url: String,
    stream_url: String,
    endpoint: String,
    model_id: String,
    credential: Credential,
    /// Where the Files API is (the Gemini API's base URL), for media too large to go inline;
    /// `None` on Vertex AI.
    files_base: Option<String>,
    /// Media uploaded to the Files API, by digest: its URI and when it was uploaded (the API
    /// keeps a file 48 hours), so a part is uploaded once however many records or tries send it.
    uploads: std::sync::Mutex<std::collections::HashMap<[u8; 32], (String, tokio::time::Instant)>>,
}

/// How long an uploaded file is reused: the API deletes it after 48 hours.
const UPLOAD_KEPT: std::time::Duration = std::time::Duration::from_secs(47 * 3600);

/// The largest file the Files API takes.
const MAX_UPLOAD_BYTES: u64 = 2 * 1000 * 1000 * 1000;

/// Finish reasons that mean the answer was withheld.
const BLOCKED_FINISH: &[&str] = &[
    "SAFETY",
    "RECITATION",
    "BLOCKLIST",
    "PROHIBITED_CONTENT",
    "SPII",
    "IMAGE_SAFETY",
    "LANGUAGE",
    "IMAGE_PROHIBITED_CONTENT",
];

impl GeminiHandler {
    /// `base` is the scheme and host (and optional path prefix) that `/v1beta/models/…` follows.
    pub fn new(
        client: reqwest::Client,
        base: &reqwest::Url,
        model: &str,
        key: Option<Secret>,
        model_id: String,
    ) -> Self {
        let files_base = base.as_str().trim_end_matches('/').to_string();
        let root = format!("{files_base}/v1beta/models/{model}");
        let credential = key.map_or(Credential::None, |k| Credential::Key(k, Some("x-goog-api-key")));
        let mut handler = Self::with_root(client, root, credential, model_id);
        handler.files_base = Some(files_base);
        handler
    }

    /// Gemini on Vertex AI: `root` is the model's URL up to its method
    /// (`…/v1/projects/P/locations/L/publishers/google/models/M`); calls carry access tokens.
    pub fn vertex(
        client: reqwest::Client,
        root: String,
        tokens: std::sync::Arc<TokenSource>,
        model_id: String,
    ) -> Self {
        Self::with_root(client, root, Credential::Tokens(tokens), model_id)
    }

    fn with_root(client: reqwest::Client, root: String, credential: Credential, model_id: String) -> Self {
        let url = format!("{root}:generateContent");
        let stream_url = format!("{root}:streamGenerateContent?alt=sse");
        let endpoint = url.clone();
        Self { client, url, stream_url, endpoint, model_id, credential, files_base: None, uploads: Default::default() }
    }

    /// Names the endpoint `name` instead of its URL (the in-process simulator, whose port
    /// changes from run to run while its answers do not).
    pub fn named(mut self, name: &str) -> Self {
        self.endpoint = name.to_string();
        self
    }

    /// The request body for `request`.
    pub fn body(request: &ModelRequest) -> Value {
        Self::body_with(request, false)
    }

    /// The body of a call, written: inline media spliced in as it is written ([`encode`]).
    fn encoded(request: &ModelRequest) -> Result<bytes::Bytes, ModelError> {
        encode(&Self::body_with(request, true), &request.media)
    }

    /// The body, with each inline part's base64 in place, or (`marks`) a mark where
    /// [`encode`] writes it.
    fn body_with(request: &ModelRequest, marks: bool) -> Value {
        let mut body = Map::new();
        let mut parts = vec![json!({"text": request.prompt})];
        let mut inline = 0;
        // Media after the text, inline (base64), as the record's fields list them.
        for p in request.media.iter() {
            parts.push(match &p.uri {
                // Read by the endpoint itself (a `gs://` object on Vertex AI, an uploaded file).
                Some(uri) => json!({"fileData": {"mimeType": p.mime, "fileUri": uri}}),
                None => {
                    let data = match marks {
                        true => crate::http::inline_mark(inline),
                        false => crate::http::base64(&p.data),
                    };
                    inline += 1;
                    json!({"inlineData": {"mimeType": p.mime, "data": data}})
                }
            });
        }
        body.insert("contents".into(), json!([{"role": "user", "parts": parts}]));
        if let Some(system) = &request.system {
            // The role is what Google's own SDK sends with system text.
            body.insert("systemInstruction".into(), json!({"role": "user", "parts": [{"text": &**system}]}));
        }
        let config = generation_config(&request.params);
        if !config.is_empty() {
            body.insert("generationConfig".into(), Value::Object(config));
        }
        Value::Object(body)
    }
}

/// Gemini's names for the sampling parameters.
const NAMES: SamplingNames = SamplingNames {
    temperature: "temperature",
    top_p: "topP",
    top_k: "topK",
    max_output_tokens: "maxOutputTokens",
    seed: "seed",
    stop: "stopSequences",
    presence_penalty: "presencePenalty",
    frequency_penalty: "frequencyPenalty",
};

/// Maps provider-neutral parameters to Gemini's `generationConfig`.
pub fn generation_config(p: &GenParams) -> Map<String, Value> {
    let mut c = Map::new();
    put_sampling(&mut c, p, &NAMES);
    if let Some(schema) = &p.response_schema {
        c.insert("responseMimeType".into(), json!("application/json"));
        c.insert("responseJsonSchema".into(), weir_core::schema::to_json_schema(schema));
    } else if let Some(m) = &p.response_mime_type {
        c.insert("responseMimeType".into(), json!(m));
    }
    c
}

/// Classifies a Google error answer (`google.rpc.Status` with details).
pub fn classify_error(status: u16, headers: &reqwest::header::HeaderMap, body: &[u8]) -> ModelError {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let err = v.get("error").unwrap_or(&Value::Null);
    let message = err
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let rpc_status = err.get("status").and_then(Value::as_str).unwrap_or("");
    let mut e = status_error(status, headers, clip(&format!("HTTP {status} {rpc_status}: {message}")));
    let details = err.get("details").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
    let mut per_day = false;
    for d in details {
        match d.get("@type").and_then(Value::as_str).unwrap_or("") {
            "type.googleapis.com/google.rpc.RetryInfo" => {
                if let Some(delay) = d.get("retryDelay").and_then(Value::as_str).and_then(proto_duration) {
                    if matches!(e.hint, RetryHint::Later(_) | RetryHint::Backoff) {
                        e.hint = RetryHint::Later(Some(delay));
                    }
                }
            }
            "type.googleapis.com/google.rpc.QuotaFailure" => {
                let violations = d.get("violations").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
                for v in violations {
                    let id = v.get("quotaId").and_then(Value::as_str).unwrap_or("");
                    per_day |= id.contains("PerDay");
                    if id.contains("Token") {
                        e.quota = Some(QuotaScope::Tokens);
                    } else if id.contains("Requests") && e.quota.is_none() {
                        e.quota = Some(QuotaScope::Requests);
                    }
                }
            }
            "type.googleapis.com/google.rpc.ErrorInfo"
                if d.get("reason").and_then(Value::as_str) == Some("API_KEY_INVALID") =>
            {
                e.kind = ErrorKind::Auth;
                e.hint = RetryHint::Never;
            }
            _ => {}
        }
    }
    // Vertex AI's 429 names no quota and advises no delay, only `rateLimitExceeded`: its quotas
    // are per minute, so it is taken as a refusal by a requests quota, whose window the rate
    // budget then learns (a minute, unless a later answer advises otherwise), rather than as
    // push-back the concurrency limit could not stop at zero latency.
    let rate_limit_exceeded = err
        .get("errors")
        .and_then(Value::as_array)
        .is_some_and(|es| es.iter().any(|x| x.get("reason").and_then(Value::as_str) == Some("rateLimitExceeded")));
    if status == 429 && e.quota.is_none() && rate_limit_exceeded {
        e.quota = Some(QuotaScope::Requests);
    }
    if status == 429 && per_day {
        e.kind = ErrorKind::QuotaExhausted;
        e.hint = RetryHint::StopRun;
        e.message = clip(&format!("the per-day quota is spent; it resets at the end of the quota day: {message}"));
    }
    e
}

/// A prompt blocked before any candidate, from `promptFeedback`.
fn prompt_blocked(v: &Value) -> ModelError {
    let feedback = v.get("promptFeedback");
    let reason = feedback.and_then(|f| f.get("blockReason")).and_then(Value::as_str);
    let detail = feedback.and_then(|f| f.get("blockReasonMessage")).and_then(Value::as_str).unwrap_or("");
    let msg = match reason {
        Some(r) => format!("the prompt was blocked (blockReason {r}) {detail}"),
        None => "the answer has no candidates and no blockReason".to_string(),
    };
    ModelError::new(ErrorKind::Blocked, msg.trim().to_string())
}

/// A candidate's finish reason, normalised; a withheld answer is a `blocked` error.
fn finish_reason(candidate: &Value) -> Result<Option<String>, ModelError> {
    let Some(finish) = candidate.get("finishReason").and_then(Value::as_str) else { return Ok(None) };
    if BLOCKED_FINISH.contains(&finish) {
        return Err(ModelError::new(ErrorKind::Blocked, format!("the answer was withheld (finishReason {finish})")));
    }
    Ok(Some(match finish {
        "STOP" => "stop".to_string(),
        "MAX_TOKENS" => "length".to_string(),
        other => other.to_ascii_lowercase(),
    }))
}

/// A candidate's text, thoughts left out.
fn push_text(candidate: &Value, text: &mut String) {
    if let Some(parts) = candidate.pointer("/content/parts").and_then(Value::as_array) {
        for p in parts {
            if p.get("thought").and_then(Value::as_bool) == Some(true) {
                continue;
            }
            if let Some(t) = p.get("text").and_then(Value::as_str) {
                text.push_str(t);
            }
        }
    }
}

/// Reads `usageMetadata`.
fn usage(v: &Value) -> Usage {
    let u = v.get("usageMetadata");
    let n = |k: &str| u.and_then(|u| u.get(k)).and_then(Value::as_u64).unwrap_or(0);
    Usage {
        prompt_tokens: n("promptTokenCount"),
        // Thinking models (gemini-2.5-*) bill their thoughts as output tokens.
        output_tokens: n("candidatesTokenCount") + n("thoughtsTokenCount"),
        total_tokens: n("totalTokenCount"),
    }
}

/// Parses a `GenerateContentResponse`. A blocked prompt (no candidates) or a withheld answer
/// (no content, a safety finish reason) is a `blocked` error with the reason, never an empty
/// answer.
pub fn parse_response(body: &[u8]) -> Result<ModelResponse, ModelError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ModelError::new(ErrorKind::MalformedResponse, format!("the answer is not JSON: {e}")))?;
    let candidate = v.get("candidates").and_then(|c| c.get(0)).ok_or_else(|| prompt_blocked(&v))?;
    let finish_reason = finish_reason(candidate)?.unwrap_or_else(|| "finish_reason_unspecified".into());
    let mut text = String::new();
    push_text(candidate, &mut text);
    Ok(ModelResponse {
        text,
        finish_reason,
        usage: usage(&v),
        model_version: v.get("modelVersion").and_then(Value::as_str).map(str::to_string),
        ..ModelResponse::default()
    })
}

/// Reads a streamed answer (`:streamGenerateContent?alt=sse`): each event is a
/// `GenerateContentResponse` carrying the next text; the last carries the finish reason and the
/// usage, and the events then end.
#[derive(Debug, Default)]
pub struct ChunkParser {
    finish: Option<String>,
    usage: Usage,
    model: Option<String>,
}

impl StreamParser for ChunkParser {
    fn event(&mut self, data: &str) -> Result<Option<Delta>, ModelError> {
        let v: Value = serde_json::from_str(data)
            .map_err(|e| ModelError::new(ErrorKind::MalformedResponse, format!("a streamed chunk is not JSON: {e}")))?;
        if let Some(err) = v.get("error") {
            let code = err.get("code").and_then(Value::as_u64).and_then(|c| u16::try_from(c).ok()).unwrap_or(500);
            return Err(classify_error(code, &reqwest::header::HeaderMap::new(), data.as_bytes()));
        }
        if v.get("usageMetadata").is_some() {
            self.usage = usage(&v);
        }
        if let Some(m) = v.get("modelVersion").and_then(Value::as_str) {
            self.model = Some(m.to_string());
        }
        let Some(candidate) = v.get("candidates").and_then(|c| c.get(0)) else {
            return match v.pointer("/promptFeedback/blockReason") {
                Some(_) => Err(prompt_blocked(&v)),
                None => Ok(None),
            };
        };
        if let Some(f) = finish_reason(candidate)? {
            self.finish = Some(f);
        }
        let mut text = String::new();
        push_text(candidate, &mut text);
        Ok((!text.is_empty()).then_some(Delta::Text(text)))
    }

    fn finish(&mut self) -> Result<Delta, ModelError> {
        let finish_reason = self.finish.take().ok_or_else(cut_stream)?;
        Ok(Delta::End(ModelResponse {
            finish_reason,
            usage: self.usage,
            model_version: self.model.take(),
            ..ModelResponse::default()
        }))
    }
}

#[async_trait::async_trait]
impl ModelHandler for GeminiHandler {
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let (reply, secret) = self.credential.post_encoded(&self.client, &self.url, Self::encoded(request)?).await?;
        if reply.status != 200 {
            return Err(redact(classify_error(reply.status, &reply.headers, &reply.body), secret.as_ref()));
        }
        parse_response(&reply.body)
    }

    fn streams(&self) -> bool {
        true
    }

    async fn generate_stream(&self, request: &ModelRequest) -> Result<DeltaStream, ModelError> {
        let (opened, secret) =
            self.credential.post_sse(&self.client, &self.stream_url, Self::encoded(request)?).await?;
        match opened {
            Opened::Events(events) => Ok(deltas(events, ChunkParser::default())),
            Opened::Error(reply) => {
                Err(redact(classify_error(reply.status, &reply.headers, &reply.body), secret.as_ref()))
            }
        }
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn max_upload_bytes(&self) -> Option<u64> {
        self.files_base.as_ref().map(|_| MAX_UPLOAD_BYTES)
    }

    async fn upload_media(&self, part: &weir_core::media::Part) -> Result<String, ModelError> {
        let Some(base) = &self.files_base else {
            return Err(ModelError::new(ErrorKind::InvalidInput, "media goes inline only on Vertex AI"));
        };
        let now = tokio::time::Instant::now();
        if let Some((uri, at)) = self.uploads.lock().unwrap_or_else(|e| e.into_inner()).get(&part.digest) {
            if now.duration_since(*at) < UPLOAD_KEPT {
                return Ok(uri.clone());
            }
        }
        let hex = hex::encode(&part.digest[..8]);
        let data = part.data.clone();
        let file = crate::jobs::files_upload(
            &self.client,
            &self.credential,
            base,
            &format!("weir-media-{hex}"),
            &part.mime,
            data.len() as u64,
            || reqwest::Body::from(data.clone()),
        )
        .await?;
        let file =
            crate::jobs::files_active(&self.client, &self.credential, base, file, std::time::Duration::from_secs(600))
                .await?;
        let uri = file.get("uri").and_then(Value::as_str).map(str::to_string).ok_or_else(|| {
            ModelError::new(ErrorKind::MalformedResponse, "the Files API gave an uploaded file no URI")
        })?;
        self.uploads.lock().unwrap_or_else(|e| e.into_inner()).insert(part.digest, (uri.clone(), now));
        Ok(uri)
    }

    /// Vertex AI reads `gs://` objects itself (with the project's service agent), so media
    /// there goes by reference (`fileData`), of any size Vertex AI takes, and is never
    /// downloaded; the Gemini API reads no buckets.
    fn reads_by_reference(&self, source: &str) -> bool {
        matches!(self.credential, Credential::Tokens(_)) && source.starts_with("gs://")
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
    use super::*;
    use reqwest::header::HeaderMap;
    use std::time::Duration;

    #[test]
    fn parameters_take_gemini_names() {
        let p = GenParams::from_specs([
            "temperature=0.5",
            "max_tokens=7",
            "stop=END",
            "top_p=0.9",
            "response_schema={\"type\":\"object\"}",
        ])
        .unwrap();
        let c = generation_config(&p);
        assert_eq!(c["temperature"], 0.5);
        assert_eq!(c["maxOutputTokens"], 7);
        assert_eq!(c["stopSequences"], serde_json::json!(["END"]));
        assert_eq!(c["topP"], 0.9);
        assert_eq!(c["responseMimeType"], "application/json");
        assert_eq!(c["responseJsonSchema"]["type"], "object");
        assert_eq!(c.len(), 6);
        // Gemini's OpenAPI form goes out as the JSON Schema the field takes.
        let p = GenParams::from_specs([
            "response_schema={\"type\":\"OBJECT\",\"properties\":{\"n\":{\"type\":\"INTEGER\",\"nullable\":true}}}",
        ])
        .unwrap();
        let c = generation_config(&p);
        assert_eq!(
            c["responseJsonSchema"],
            serde_json::json!({"type": "object", "properties": {"n": {"type": ["integer", "null"]}}})
        );
    }

    #[test]
    fn blocks_are_blocked_errors() {
        let e =
            parse_response(br#"{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":3}}"#)
                .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Blocked);
        assert!(e.message.contains("SAFETY"));
        let e = parse_response(br#"{"candidates":[{"finishReason":"SAFETY","index":0}]}"#).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Blocked);
        assert_eq!(parse_response(br#"{"candidates":[]}"#).unwrap_err().kind, ErrorKind::Blocked);
    }

    #[test]
    fn parses_text_usage_and_finish() {
        let r = parse_response(br#"{"candidates":[{"content":{"parts":[{"text":"think","thought":true},{"text":"a"},{"text":"b"}]},"finishReason":"MAX_TOKENS"}],"usageMetadata":{"promptTokenCount":2,"candidatesTokenCount":5,"totalTokenCount":9}}"#).unwrap();
        assert_eq!(r.text, "ab");
        assert_eq!(r.finish_reason, "length");
        assert_eq!(r.usage, Usage { prompt_tokens: 2, output_tokens: 5, total_tokens: 9 });
    }

    #[test]
    fn quota_errors_carry_the_advised_delay_and_tell_per_day_apart() {
        let h = HeaderMap::new();
        let per_minute = br#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","message":"quota","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"26s"}]}}"#;
        let e = classify_error(429, &h, per_minute);
        assert_eq!(e.kind, ErrorKind::RateLimited);
        assert_eq!(e.hint, RetryHint::Later(Some(Duration::from_secs(26))));
        assert_eq!(e.quota, Some(QuotaScope::Requests));
        let per_day = br#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","message":"quota","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"3600s"}]}}"#;
        let e = classify_error(429, &h, per_day);
        assert_eq!((e.kind, e.hint), (ErrorKind::QuotaExhausted, RetryHint::StopRun));
        let bad_key = br#"{"error":{"code":400,"status":"INVALID_ARGUMENT","message":"API key not valid.","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID"}]}}"#;
        assert_eq!(classify_error(400, &h, bad_key).kind, ErrorKind::Auth);
        // Vertex AI's 429: no RetryInfo, no QuotaFailure, `rateLimitExceeded` in `errors`.
        let vertex = br#"{"error":{"code":429,"message":"Resource exhausted. Please try again later.","status":"RESOURCE_EXHAUSTED","errors":[{"domain":"global","reason":"rateLimitExceeded","message":"Resource exhausted."}]}}"#;
        let e = classify_error(429, &h, vertex);
        assert_eq!((e.kind, e.hint), (ErrorKind::RateLimited, RetryHint::Later(None)));
        assert_eq!(e.quota, Some(QuotaScope::Requests), "a quota refusal, for the rate budget to learn");
        assert!(e.message.contains("RESOURCE_EXHAUSTED"), "{}", e.message);
    }
}
