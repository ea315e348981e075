//! The wire formats: parsing requests of each API into one shape, and rendering answers and
//! errors exactly as the real services do (../shared/reference/wire-formats.md).

use serde_json::{json, Map, Value};
use std::time::Duration;

use crate::gen::Generation;
use crate::quota::{Rejection, Usage};

/// Which API a request came in through; it decides every body and header of the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// The Gemini API (`/v1beta/models/…` or `/v1/models/…`), API key auth.
    Gemini,
    /// Gemini on Vertex AI (`/v1/projects/…/publishers/google/models/…`), bearer auth.
    Vertex,
    /// OpenAI chat completions.
    OpenAi,
    /// A Vertex AI endpoint's `:predict`.
    Predict,
    /// Anthropic's Messages API (`/v1/messages`), `x-api-key` auth.
    Anthropic,
}

/// How a streamed Gemini answer is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamFraming {
    /// Server-sent events (`?alt=sse`, and always for OpenAI).
    Sse,
    /// A JSON array sent piece by piece (Gemini without `alt=sse`).
    JsonArray,
}

/// One instance of a `:predict` call.
#[derive(Debug, Clone)]
pub struct PredictInstance {
    /// The instance's prompt text (or its messages' text, for the chat form).
    pub prompt: String,
    /// `max_tokens` of the instance.
    pub max_tokens: Option<u32>,
    /// `raw_response` of the plain form: when false the answer is wrapped as "Prompt:…Output:…".
    pub raw_response: bool,
}

/// A request of any API, reduced to what the simulator needs.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// The API it came through.
    pub api: Api,
    /// The model named in the path or body.
    pub model: String,
    /// All text of the request (system and user), which is what gets billed.
    pub prompt: String,
    /// The output token limit.
    pub max_tokens: Option<u32>,
    /// Streaming requested.
    pub stream: Option<StreamFraming>,
    /// OpenAI `stream_options.include_usage`.
    pub include_usage: bool,
    /// Canonical generation settings, part of the seed of the answer.
    pub settings: String,
    /// The instances of a `:predict` call (one answer each); empty for other APIs.
    pub instances: Vec<PredictInstance>,
    /// True for the `@requestFormat: chatCompletions` form of `:predict`.
    pub chat_predict: bool,
    /// For an embedding request, its form; the texts are in `instances`.
    pub embed: Option<EmbedForm>,
    /// The response schema asked for (Gemini `responseJsonSchema`/`responseSchema`, OpenAI
    /// `response_format.json_schema.schema`): the answer is JSON of that shape.
    pub schema: Option<Value>,
    /// A digest of each media part (decoded inline data, or a file's URI), in order: part of
    /// the answer's seed.
    pub media: Vec<u64>,
    /// How many of the parts were files by reference (`fileData` with a URI).
    pub file_uris: u64,
}

/// The wire form of an embedding request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbedForm {
    /// OpenAI `/v1/embeddings`, `input` a string or a list.
    OpenAi,
    /// Gemini `:batchEmbedContents`.
    GeminiBatch,
    /// Gemini `:embedContent`.
    GeminiOne,
    /// Vertex AI text-embedding `:predict` (`instances[].content`).
    Vertex,
}

/// A request body that does not fit its API.
#[derive(Debug)]
pub struct BadRequest(pub String);

fn text_of_parts(parts: Option<&Value>, out: &mut String) {
    if let Some(Value::Array(parts)) = parts {
        for p in parts {
            if let Some(t) = p.get("text").and_then(Value::as_str) {
                if !out.is_empty() {
                    out.push('\n');
                }
                out.push_str(t);
            }
        }
    }
}

/// A media part's digest, once its type and base64 data are checked (the API refuses a
/// part without a type, or whose data does not decode).
fn media_digest(mime: Option<&str>, data: Option<&str>, at: &str) -> Result<u64, BadRequest> {
    use base64::Engine;
    let Some(mime) = mime.filter(|m| m.contains('/')) else {
        return Err(BadRequest(format!("Invalid value at '{at}.mime_type': a MIME type is required")));
    };
    let bytes = data
        .and_then(|d| base64::engine::general_purpose::STANDARD.decode(d).ok())
        .filter(|b| !b.is_empty())
        .ok_or_else(|| BadRequest(format!("Invalid value at '{at}.data': not valid base64 data")))?;
    Ok(crate::gen::stable_hash(&[mime.as_bytes(), &crate::gen::word_hash(&bytes).to_le_bytes()]))
}

/// A file part's digest, once its type and URI are checked: Vertex AI takes `gs://` objects
/// (and the Gemini API its own files' URIs), which the simulator does not read: the URI
/// stands for the content.
fn file_digest(file: &Value, at: &str) -> Result<u64, BadRequest> {
    let mime = file.get("mimeType").or_else(|| file.get("mime_type")).and_then(Value::as_str);
    let Some(mime) = mime.filter(|m| m.contains('/')) else {
        return Err(BadRequest(format!("Invalid value at '{at}.mime_type': a MIME type is required")));
    };
    let uri = file.get("fileUri").or_else(|| file.get("file_uri")).and_then(Value::as_str).unwrap_or("");
    if !(uri.starts_with("gs://") || uri.starts_with("https://") || uri.starts_with("http://")) {
        return Err(BadRequest(format!("Invalid value at '{at}.file_uri': expected a gs:// or https:// URI")));
    }
    Ok(crate::gen::stable_hash(&[mime.as_bytes(), b"uri", uri.as_bytes()]))
}

/// The media of an OpenAI user message's content parts (`image_url` data URLs, `input_audio`,
/// `file` data); a link to an image is taken as named, by its URL.
fn media_of_openai(parts: &[Value], media: &mut Vec<u64>) -> Result<(), BadRequest> {
    for (i, p) in parts.iter().enumerate() {
        let at = format!("messages.content[{i}]");
        let data_url = |u: &str| -> Result<u64, BadRequest> {
            let rest = u.strip_prefix("data:").ok_or_else(|| BadRequest(format!("{at}: not a data URL")))?;
            let (mime, data) = rest.split_once(";base64,").ok_or_else(|| BadRequest(format!("{at}: not base64")))?;
            media_digest(Some(mime), Some(data), &at)
        };
        match p.get("type").and_then(Value::as_str) {
            Some("image_url") => {
                let url = p.pointer("/image_url/url").and_then(Value::as_str).unwrap_or("");
                media.push(match url.starts_with("data:") {
                    true => data_url(url)?,
                    false => crate::gen::stable_hash(&[url.as_bytes()]),
                });
            }
            Some("input_audio") => {
                let format = p.pointer("/input_audio/format").and_then(Value::as_str).unwrap_or("");
                let mime = match format {
                    "wav" => "audio/wav",
                    "mp3" => "audio/mpeg",
                    _ => return Err(BadRequest(format!("{at}: input_audio.format must be wav or mp3"))),
                };
                media.push(media_digest(Some(mime), p.pointer("/input_audio/data").and_then(Value::as_str), &at)?);
            }
            Some("file") => media.push(data_url(p.pointer("/file/file_data").and_then(Value::as_str).unwrap_or(""))?),
            _ => {}
        }
    }
    Ok(())
}

fn text_of_messages(messages: &Value, out: &mut String) -> Result<(), BadRequest> {
    text_and_media_of_messages(messages, out, &mut Vec::new())
}

fn text_and_media_of_messages(messages: &Value, out: &mut String, media: &mut Vec<u64>) -> Result<(), BadRequest> {
    let Value::Array(messages) = messages else {
        return Err(BadRequest("'messages' must be an array".into()));
    };
    if messages.is_empty() {
        return Err(BadRequest("'messages' must not be empty".into()));
    }
    for m in messages {
        let content = m.get("content").ok_or_else(|| BadRequest("each message needs 'content'".into()))?;
        let mut push = |t: &str| {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(t);
        };
        match content {
            Value::String(s) => push(s),
            Value::Array(parts) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        push(t);
                    }
                }
                media_of_openai(parts, media)?;
            }
            Value::Null => {}
            _ => return Err(BadRequest("message 'content' must be a string or an array of parts".into())),
        }
    }
    Ok(())
}

fn as_u32(v: Option<&Value>, name: &str) -> Result<Option<u32>, BadRequest> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|n| *n >= 1 && *n <= u32::MAX as u64)
            .map(|n| Some(n as u32))
            .ok_or_else(|| BadRequest(format!("'{name}' must be a positive integer"))),
    }
}

/// Parses a Gemini `GenerateContentRequest` (Gemini API and Vertex AI share it).
pub fn parse_gemini(
    api: Api,
    model: &str,
    body: &Value,
    stream: Option<StreamFraming>,
) -> Result<SimRequest, BadRequest> {
    let contents = body
        .get("contents")
        .ok_or_else(|| BadRequest("* GenerateContentRequest.contents: contents is not specified".into()))?;
    let Value::Array(contents) = contents else {
        return Err(BadRequest("Invalid value at 'contents': must be a list of Content".into()));
    };
    if contents.is_empty() {
        return Err(BadRequest("* GenerateContentRequest.contents: contents is not specified".into()));
    }
    let mut prompt = String::new();
    text_of_parts(body.get("systemInstruction").and_then(|s| s.get("parts")), &mut prompt);
    let mut media = Vec::new();
    let mut file_uris = 0;
    for (i, c) in contents.iter().enumerate() {
        text_of_parts(c.get("parts"), &mut prompt);
        if let Some(Value::Array(parts)) = c.get("parts") {
            for (j, p) in parts.iter().enumerate() {
                if let Some(file) = p.get("fileData").or_else(|| p.get("file_data")) {
                    let at = format!("contents[{i}].parts[{j}].file_data");
                    media.push(file_digest(file, &at)?);
                    file_uris += 1;
                    continue;
                }
                let Some(inline) = p.get("inlineData").or_else(|| p.get("inline_data")) else { continue };
                let at = format!("contents[{i}].parts[{j}].inline_data");
                let mime = inline.get("mimeType").or_else(|| inline.get("mime_type")).and_then(Value::as_str);
                let data = inline.get("data").and_then(Value::as_str);
                media.push(media_digest(mime, data, &at)?);
            }
        }
    }
    let config = body.get("generationConfig");
    let max_tokens = as_u32(config.and_then(|c| c.get("maxOutputTokens")), "generationConfig.maxOutputTokens")?;
    Ok(SimRequest {
        api,
        model: model.to_string(),
        prompt,
        max_tokens,
        stream,
        include_usage: true,
        settings: config.map(Value::to_string).unwrap_or_default(),
        instances: Vec::new(),
        chat_predict: false,
        embed: None,
        schema: config.and_then(|c| c.get("responseJsonSchema").or_else(|| c.get("responseSchema"))).cloned(),
        media,
        file_uris,
    })
}

/// Parses an OpenAI chat completions request.
pub fn parse_openai(body: &Value) -> Result<SimRequest, BadRequest> {
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| BadRequest("you must provide a model parameter".into()))?;
    let mut prompt = String::new();
    let mut media = Vec::new();
    text_and_media_of_messages(
        body.get("messages").ok_or_else(|| BadRequest("'messages' is a required property".into()))?,
        &mut prompt,
        &mut media,
    )?;
    let max_tokens = match as_u32(body.get("max_completion_tokens"), "max_completion_tokens")? {
        Some(n) => Some(n),
        None => as_u32(body.get("max_tokens"), "max_tokens")?,
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let mut settings = Map::new();
    for k in ["temperature", "top_p", "seed", "stop", "response_format", "presence_penalty", "frequency_penalty"] {
        if let Some(v) = body.get(k) {
            settings.insert(k.into(), v.clone());
        }
    }
    Ok(SimRequest {
        api: Api::OpenAi,
        model: model.to_string(),
        prompt,
        max_tokens,
        stream: stream.then_some(StreamFraming::Sse),
        include_usage,
        settings: Value::Object(settings).to_string(),
        instances: Vec::new(),
        chat_predict: false,
        embed: None,
        schema: body.pointer("/response_format/json_schema/schema").cloned(),
        media,
        file_uris: 0,
    })
}

/// Parses an Anthropic Messages API request: `max_tokens` is required; image and document
/// blocks are decoded and counted as media; a forced tool's `input_schema` is the answer's
/// schema.
/// On Vertex AI (`publisher`: the model in the URL) the body names no model but the API version,
/// `anthropic_version: "vertex-2023-10-16"`.
pub fn parse_anthropic(body: &Value, publisher: &str) -> Result<SimRequest, BadRequest> {
    let model = match publisher {
        "" => body.get("model").and_then(Value::as_str).ok_or_else(|| BadRequest("model: Field required".into()))?,
        m => {
            if body.get("anthropic_version").and_then(Value::as_str) != Some("vertex-2023-10-16") {
                return Err(BadRequest("anthropic_version: must be \"vertex-2023-10-16\" on Vertex AI".into()));
            }
            if body.get("model").is_some() {
                return Err(BadRequest("model: Extra inputs are not permitted (the model is in the URL)".into()));
            }
            m
        }
    };
    let max_tokens =
        as_u32(body.get("max_tokens"), "max_tokens")?.ok_or_else(|| BadRequest("max_tokens: Field required".into()))?;
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Err(BadRequest("messages: Field required".into()));
    };
    let mut prompt = String::new();
    let mut media = Vec::new();
    if let Some(system) = body.get("system").and_then(Value::as_str) {
        prompt.push_str(system);
    }
    for m in messages {
        let mut push = |t: &str| {
            if !prompt.is_empty() {
                prompt.push('\n');
            }
            prompt.push_str(t);
        };
        match m.get("content") {
            Some(Value::String(t)) => push(t),
            Some(Value::Array(blocks)) => {
                for (i, b) in blocks.iter().enumerate() {
                    let at = format!("messages.content.{i}");
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => push(b.get("text").and_then(Value::as_str).unwrap_or("")),
                        Some("image" | "document") => {
                            if b.pointer("/source/type").and_then(Value::as_str) != Some("base64") {
                                return Err(BadRequest(format!("{at}.source: only base64 sources are served here")));
                            }
                            let mime = b.pointer("/source/media_type").and_then(Value::as_str);
                            media.push(media_digest(mime, b.pointer("/source/data").and_then(Value::as_str), &at)?);
                        }
                        _ => return Err(BadRequest(format!("{at}.type: Input tag not found"))),
                    }
                }
            }
            _ => return Err(BadRequest("messages.content: Field required".into())),
        }
    }
    let mut settings = Map::new();
    for k in ["temperature", "top_p", "top_k", "stop_sequences", "tools", "tool_choice"] {
        if let Some(v) = body.get(k) {
            settings.insert(k.into(), v.clone());
        }
    }
    let forced = body.pointer("/tool_choice/name").and_then(Value::as_str);
    let schema = body.get("tools").and_then(Value::as_array).and_then(|tools| {
        tools.iter().find(|t| t.get("name").and_then(Value::as_str) == forced)?.get("input_schema").cloned()
    });
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    Ok(SimRequest {
        api: Api::Anthropic,
        model: model.to_string(),
        prompt,
        max_tokens: Some(max_tokens),
        stream: stream.then_some(StreamFraming::Sse),
        include_usage: true,
        settings: Value::Object(settings).to_string(),
        instances: Vec::new(),
        chat_predict: false,
        embed: None,
        schema,
        media,
        file_uris: 0,
    })
}

/// The tool a forced `tool_choice` names, if any (its input is the answer).
pub fn anthropic_tool(settings: &str) -> Option<String> {
    let v: Value = serde_json::from_str(settings).ok()?;
    v.pointer("/tool_choice/name").and_then(Value::as_str).map(str::to_string)
}

/// An Anthropic message: the answer as a text block, or as the forced tool's input (the
/// answer's JSON, or the text as is when it is not JSON: a broken answer).
pub fn anthropic_response(model: &str, id: &str, gen: &Generation, prompt_tokens: u64, tool: Option<&str>) -> Value {
    let text = gen.text();
    let (block, stop) = match (tool, serde_json::from_str::<Value>(&text)) {
        (Some(name), Ok(input)) => {
            (json!({"type": "tool_use", "id": format!("toolu_{id}"), "name": name, "input": input}), "tool_use")
        }
        _ => (json!({"type": "text", "text": text}), if gen.truncated_by_limit { "max_tokens" } else { "end_turn" }),
    };
    json!({
        "id": format!("msg_{id}"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [block],
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": gen.tokens.len() as u64,
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    })
}

/// A streamed Anthropic message's events (name, data): `message_start`, a text block's
/// deltas in pieces of `chunk` tokens, `message_delta` with the stop reason, `message_stop`.
pub fn anthropic_events(
    model: &str,
    id: &str,
    gen: &Generation,
    prompt_tokens: u64,
    chunk: usize,
) -> Vec<(&'static str, Value)> {
    let mut events = vec![
        (
            "message_start",
            json!({"type": "message_start", "message": {
            "id": format!("msg_{id}"), "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 1}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        ("ping", json!({"type": "ping"})),
    ];
    for piece in gen.tokens.chunks(chunk.max(1)) {
        events.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": piece.concat()}}),
        ));
    }
    let stop = if gen.truncated_by_limit { "max_tokens" } else { "end_turn" };
    events.push(("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
    events.push((
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
        "usage": {"output_tokens": gen.tokens.len() as u64}}),
    ));
    events.push(("message_stop", json!({"type": "message_stop"})));
    events
}

/// Parses a Vertex AI endpoint `:predict` request, plain or chat form.
pub fn parse_predict(endpoint: &str, body: &Value) -> Result<SimRequest, BadRequest> {
    let Some(Value::Array(instances)) = body.get("instances") else {
        return Err(BadRequest("'instances' must be a non-empty list".into()));
    };
    if instances.is_empty() {
        return Err(BadRequest("'instances' must be a non-empty list".into()));
    }
    let chat = instances.iter().any(|i| i.get("@requestFormat").and_then(Value::as_str) == Some("chatCompletions"));
    if chat && instances.len() != 1 {
        return Err(BadRequest("the chatCompletions request format takes exactly one instance".into()));
    }
    let params = body.get("parameters");
    let mut all = String::new();
    let mut out = Vec::with_capacity(instances.len());
    for inst in instances {
        let mut prompt = String::new();
        if chat {
            text_of_messages(inst.get("messages").unwrap_or(&Value::Null), &mut prompt)?;
        } else {
            prompt = inst
                .get("prompt")
                .and_then(Value::as_str)
                .ok_or_else(|| BadRequest("each instance needs a 'prompt' string".into()))?
                .to_string();
        }
        let max_tokens = match as_u32(inst.get("max_tokens"), "max_tokens")? {
            Some(n) => Some(n),
            None => as_u32(params.and_then(|p| p.get("max_tokens")), "parameters.max_tokens")?,
        };
        let raw_response = inst.get("raw_response").and_then(Value::as_bool).unwrap_or(false);
        if !all.is_empty() {
            all.push('\n');
        }
        all.push_str(&prompt);
        out.push(PredictInstance { prompt, max_tokens, raw_response });
    }
    Ok(SimRequest {
        api: Api::Predict,
        model: endpoint.to_string(),
        prompt: all,
        max_tokens: None,
        stream: None,
        include_usage: false,
        settings: params.map(Value::to_string).unwrap_or_default(),
        instances: out,
        chat_predict: chat,
        embed: None,
        schema: None,
        media: Vec::new(),
        file_uris: 0,
    })
}

/// Parses an embedding request of any form: one instance per text.
pub fn parse_embed(api: Api, form: EmbedForm, model: &str, body: &Value) -> Result<SimRequest, BadRequest> {
    let texts: Vec<String> = match form {
        EmbedForm::OpenAi => match body.get("input") {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) if !items.is_empty() => items
                .iter()
                .map(|i| i.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| BadRequest("'input' must be a string or a list of strings".into()))?,
            _ => return Err(BadRequest("'input' must be a non-empty string or list of strings".into())),
        },
        EmbedForm::GeminiOne => {
            let mut t = String::new();
            text_of_parts(body.pointer("/content/parts"), &mut t);
            vec![t]
        }
        EmbedForm::GeminiBatch => {
            let Some(Value::Array(requests)) = body.get("requests") else {
                return Err(BadRequest("* BatchEmbedContentsRequest.requests: requests is not specified".into()));
            };
            if requests.is_empty() {
                return Err(BadRequest("* BatchEmbedContentsRequest.requests: requests is not specified".into()));
            }
            requests
                .iter()
                .map(|r| {
                    let mut t = String::new();
                    text_of_parts(r.pointer("/content/parts"), &mut t);
                    t
                })
                .collect()
        }
        EmbedForm::Vertex => {
            let Some(Value::Array(instances)) = body.get("instances") else {
                return Err(BadRequest("'instances' must be a non-empty list".into()));
            };
            if instances.is_empty() {
                return Err(BadRequest("'instances' must be a non-empty list".into()));
            }
            instances
                .iter()
                .map(|i| {
                    i.get("content")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .ok_or_else(|| BadRequest("each instance needs a 'content' string".into()))
                })
                .collect::<Result<_, _>>()?
        }
    };
    let model = match form {
        EmbedForm::OpenAi => body
            .get("model")
            .and_then(Value::as_str)
            .ok_or_else(|| BadRequest("you must provide a model parameter".into()))?
            .to_string(),
        _ => model.to_string(),
    };
    Ok(SimRequest {
        api,
        model,
        prompt: texts.join("\n"),
        max_tokens: None,
        stream: None,
        include_usage: false,
        settings: String::new(),
        instances: texts
            .into_iter()
            .map(|prompt| PredictInstance { prompt, max_tokens: None, raw_response: true })
            .collect(),
        chat_predict: false,
        embed: Some(form),
        schema: None,
        media: Vec::new(),
        file_uris: 0,
    })
}

/// The embedding of `text`: a unit vector of `dims` values, a pure function of the text, the
/// model and the seed (equal texts, equal vectors).
pub fn embedding_of(seed: u64, model: &str, text: &str, dims: u32) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let h = crate::gen::stable_hash(&[&seed.to_le_bytes(), model.as_bytes(), text.as_bytes()]);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(h);
    let mut v: Vec<f32> = (0..dims).map(|_| rng.gen::<f32>() * 2.0 - 1.0).collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(f32::MIN_POSITIVE);
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

/// The answer to an embedding request, in its form.
pub fn embed_response(req: &SimRequest, vectors: &[Vec<f32>]) -> Value {
    let tokens: Vec<u64> = req.instances.iter().map(|i| crate::gen::count_tokens(&i.prompt)).collect();
    match req.embed {
        Some(EmbedForm::OpenAi) => {
            let total: u64 = tokens.iter().sum();
            json!({
                "object": "list",
                "data": vectors.iter().enumerate().map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": v})).collect::<Vec<_>>(),
                "model": req.model,
                "usage": {"prompt_tokens": total, "total_tokens": total},
            })
        }
        Some(EmbedForm::GeminiOne) => json!({"embedding": {"values": vectors.first()}}),
        Some(EmbedForm::Vertex) => json!({
            "predictions": vectors.iter().zip(&tokens).map(|(v, t)| json!({
                "embeddings": {"values": v, "statistics": {"token_count": t, "truncated": false}}
            })).collect::<Vec<_>>(),
            "metadata": {"billableCharacterCount": req.instances.iter().map(|i| i.prompt.chars().count()).sum::<usize>()},
        }),
        _ => json!({"embeddings": vectors.iter().map(|v| json!({"values": v})).collect::<Vec<_>>()}),
    }
}

/// How the answer of a successful request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// A normal answer.
    Normal,
    /// The prompt was blocked (Gemini: no candidates; OpenAI: a 400).
    BlockPrompt,
    /// The answer was blocked (no content; finish reason SAFETY / content_filter).
    BlockCandidate,
}

/// Formats a duration the way `google.protobuf.Duration` is written in JSON: "1.500s".
pub fn proto_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{}.{:03}s", ms / 1000, ms % 1000)
    }
}

/// Formats a duration the way OpenAI's `x-ratelimit-reset-*` headers do: "12ms", "1.5s", "6m0s".
pub fn openai_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = d.as_secs_f64();
        let text = format!("{s:.3}");
        let text = text.trim_end_matches('0').trim_end_matches('.');
        format!("{text}s")
    } else {
        format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

/// Usage block of a Gemini answer.
pub fn gemini_usage(prompt_tokens: u64, output_tokens: Option<u64>) -> Value {
    let mut u = json!({
        "promptTokenCount": prompt_tokens,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt_tokens}],
    });
    if let Some(out) = output_tokens {
        u["candidatesTokenCount"] = json!(out);
        u["totalTokenCount"] = json!(prompt_tokens + out);
    } else {
        u["totalTokenCount"] = json!(prompt_tokens);
    }
    u
}

/// A whole (non-streamed) Gemini answer.
pub fn gemini_response(model: &str, response_id: &str, gen: &Generation, prompt_tokens: u64, ending: Ending) -> Value {
    let out = gen.tokens.len() as u64;
    match ending {
        Ending::BlockPrompt => json!({
            "promptFeedback": {
                "blockReason": "SAFETY",
                "safetyRatings": safety_ratings(true),
            },
            "usageMetadata": gemini_usage(prompt_tokens, None),
            "modelVersion": model,
            "responseId": response_id,
        }),
        Ending::BlockCandidate => json!({
            "candidates": [{"finishReason": "SAFETY", "index": 0, "safetyRatings": safety_ratings(true)}],
            "usageMetadata": gemini_usage(prompt_tokens, Some(0)),
            "modelVersion": model,
            "responseId": response_id,
        }),
        Ending::Normal => json!({
            "candidates": [{
                "content": {"role": "model", "parts": [{"text": gen.text()}]},
                "finishReason": if gen.truncated_by_limit { "MAX_TOKENS" } else { "STOP" },
                "avgLogprobs": -0.25,
                "index": 0,
            }],
            "usageMetadata": gemini_usage(prompt_tokens, Some(out)),
            "modelVersion": model,
            "responseId": response_id,
        }),
    }
}

fn safety_ratings(blocked: bool) -> Value {
    json!([
        {"category": "HARM_CATEGORY_HATE_SPEECH", "probability": "NEGLIGIBLE"},
        {"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": if blocked { "HIGH" } else { "NEGLIGIBLE" }, "blocked": blocked},
        {"category": "HARM_CATEGORY_HARASSMENT", "probability": "NEGLIGIBLE"},
        {"category": "HARM_CATEGORY_SEXUALLY_EXPLICIT", "probability": "NEGLIGIBLE"},
    ])
}

/// One streamed Gemini chunk carrying `text`; the last one carries the finish reason and usage.
pub fn gemini_chunk(
    model: &str,
    response_id: &str,
    text: &str,
    prompt_tokens: u64,
    finish: Option<(&str, u64)>,
) -> Value {
    let mut cand = json!({"content": {"role": "model", "parts": [{"text": text}]}, "index": 0});
    if let Some((reason, _)) = finish {
        cand["finishReason"] = json!(reason);
    }
    json!({
        "candidates": [cand],
        "usageMetadata": gemini_usage(prompt_tokens, finish.map(|f| f.1)),
        "modelVersion": model,
        "responseId": response_id,
    })
}

/// A whole (non-streamed) OpenAI chat completion. `content` is `None` for a filtered answer.
pub fn openai_response(
    model: &str,
    id: &str,
    created: u64,
    gen: &Generation,
    prompt_tokens: u64,
    ending: Ending,
) -> Value {
    let (content, finish, out) = match ending {
        Ending::BlockCandidate => (Value::Null, "content_filter", 0),
        _ => (json!(gen.text()), if gen.truncated_by_limit { "length" } else { "stop" }, gen.tokens.len() as u64),
    };
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content, "refusal": null},
            "logprobs": null,
            "finish_reason": finish,
        }],
        "usage": openai_usage(prompt_tokens, out),
        "system_fingerprint": "weir-sim",
    })
}

/// OpenAI `usage`.
pub fn openai_usage(prompt_tokens: u64, out: u64) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": out,
        "total_tokens": prompt_tokens + out,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    })
}

/// One OpenAI `chat.completion.chunk`.
pub fn openai_chunk(
    model: &str,
    id: &str,
    created: u64,
    delta: Value,
    finish: Option<&str>,
    include_usage: bool,
) -> Value {
    let mut v = json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": "weir-sim",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
    });
    if include_usage {
        v["usage"] = Value::Null;
    }
    v
}

/// The final usage chunk of an OpenAI stream with `include_usage`.
pub fn openai_usage_chunk(model: &str, id: &str, created: u64, prompt_tokens: u64, out: u64) -> Value {
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": "weir-sim",
        "choices": [],
        "usage": openai_usage(prompt_tokens, out),
    })
}

/// An error answer: status, extra headers and body.
#[derive(Debug, Clone)]
pub struct ErrorReply {
    /// HTTP status.
    pub status: u16,
    /// Extra headers (for example `retry-after`).
    pub headers: Vec<(&'static str, String)>,
    /// JSON body.
    pub body: Value,
}

fn google_status(code: u16) -> &'static str {
    match code {
        400 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        429 => "RESOURCE_EXHAUSTED",
        500 => "INTERNAL",
        503 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        _ => "UNKNOWN",
    }
}

/// A plain error in the API's own format.
pub fn error(api: Api, status: u16, message: &str) -> ErrorReply {
    let body = match api {
        Api::Anthropic => {
            let kind = match status {
                400 | 413 => "invalid_request_error",
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                429 => "rate_limit_error",
                529 | 503 => "overloaded_error",
                _ => "api_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
        Api::OpenAi => {
            let (kind, code) = match status {
                400 | 404 => ("invalid_request_error", Value::Null),
                401 => ("invalid_request_error", json!("invalid_api_key")),
                429 => ("requests", json!("rate_limit_exceeded")),
                _ => ("server_error", Value::Null),
            };
            json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        }
        _ => json!({"error": {"code": status, "message": message, "status": google_status(status)}}),
    };
    ErrorReply { status, headers: Vec::new(), body }
}

/// The error for a request whose API key is missing or not accepted.
pub fn auth_error(api: Api, present: bool) -> ErrorReply {
    match api {
        Api::Gemini if present => ErrorReply {
            status: 400,
            headers: Vec::new(),
            body: json!({"error": {
                "code": 400,
                "message": "API key not valid. Please pass a valid API key.",
                "status": "INVALID_ARGUMENT",
                "details": [{
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "API_KEY_INVALID",
                    "domain": "googleapis.com",
                    "metadata": {"service": "generativelanguage.googleapis.com"},
                }],
            }}),
        },
        Api::Gemini => error(api, 403, "Method doesn't allow unregistered callers (callers without established identity). Please use API Key or other form of API consumer identity to call this API."),
        Api::Anthropic => error(api, 401, "invalid x-api-key"),
        Api::OpenAi => error(api, 401, if present { "Incorrect API key provided. You can find your API key at https://platform.openai.com/account/api-keys." } else { "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)." }),
        _ => error(api, 401, "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential."),
    }
}

/// The 429 for a spent quota, in the API's format, with the advised delay.
pub fn quota_error(api: Api, model: &str, rejection: &Rejection) -> ErrorReply {
    let (retry_after, limit, per_day, tokens) = match rejection {
        Rejection::Requests { retry_after, limit } => (*retry_after, *limit, false, false),
        Rejection::Tokens { retry_after, limit, .. } => (*retry_after, *limit, false, true),
        Rejection::Daily { retry_after, limit } => (*retry_after, *limit, true, false),
        Rejection::TooLarge { limit, requested } => {
            let msg = format!("Request too large: it needs {requested} tokens and the limit is {limit} per window.");
            return error(api, 400, &msg);
        }
    };
    match api {
        Api::Gemini => {
            let (metric, quota_id) = match (per_day, tokens) {
                (true, _) => (
                    "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                    "GenerateRequestsPerDayPerProjectPerModel-FreeTier",
                ),
                (false, true) => (
                    "generativelanguage.googleapis.com/generate_content_free_tier_input_token_count",
                    "GenerateContentInputTokensPerModelPerMinute-FreeTier",
                ),
                (false, false) => (
                    "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                    "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                ),
            };
            ErrorReply {
                status: 429,
                headers: Vec::new(),
                body: json!({"error": {
                    "code": 429,
                    "message": format!("You exceeded your current quota, please check your plan and billing details. For more information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.\n* Quota exceeded for metric: {metric}, limit: {limit}, model: {model}\nPlease retry in {:.6}s.", retry_after.as_secs_f64()),
                    "status": "RESOURCE_EXHAUSTED",
                    "details": [
                        {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{
                            "quotaMetric": metric,
                            "quotaId": quota_id,
                            "quotaDimensions": {"location": "global", "model": model},
                            "quotaValue": limit.to_string(),
                        }]},
                        {"@type": "type.googleapis.com/google.rpc.Help", "links": [{"description": "Learn more about Gemini API quotas", "url": "https://ai.google.dev/gemini-api/docs/rate-limits"}]},
                        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": proto_duration(retry_after)},
                    ],
                }}),
            }
        }
        Api::Vertex | Api::Predict => ErrorReply {
            status: 429,
            headers: Vec::new(),
            body: json!({"error": {
                "code": 429,
                "message": "Resource exhausted. Please try again later. Please refer to https://cloud.google.com/vertex-ai/generative-ai/docs/error-code-429 for more details.",
                "errors": [{"domain": "global", "reason": "rateLimitExceeded", "message": "Resource exhausted. Please try again later."}],
                "status": "RESOURCE_EXHAUSTED",
            }}),
        },
        Api::Anthropic => {
            let what = if tokens { "input tokens per minute" } else { "requests per minute" };
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            ErrorReply {
                status: 429,
                headers: vec![("retry-after", secs.to_string())],
                body: json!({"type": "error", "error": {"type": "rate_limit_error",
                    "message": format!("This request would exceed the rate limit for your organization of {limit} {what}. Please try again later.")}}),
            }
        }
        Api::OpenAi => {
            let (kind, what) = match (per_day, tokens) {
                (true, _) => ("requests", "requests per day (RPD)"),
                (false, true) => ("tokens", "tokens per min (TPM)"),
                (false, false) => ("requests", "requests per min (RPM)"),
            };
            let detail = match rejection {
                Rejection::Tokens { used, requested, .. } => {
                    format!("Limit {limit}, Used {used}, Requested {requested}.")
                }
                _ => format!("Limit {limit}, Used {limit}, Requested 1."),
            };
            let secs = retry_after.as_secs_f64();
            ErrorReply {
                status: 429,
                headers: vec![
                    ("retry-after", format!("{}", secs.ceil().max(1.0) as u64)),
                    ("retry-after-ms", format!("{}", retry_after.as_millis().max(1))),
                ],
                body: json!({"error": {
                    "message": format!("Rate limit reached for {model} in organization org-weirsim on {what}: {detail} Please try again in {}. Visit https://platform.openai.com/account/rate-limits to learn more.", openai_duration(retry_after)),
                    "type": kind,
                    "param": null,
                    "code": "rate_limit_exceeded",
                }}),
            }
        }
    }
}

/// OpenAI's rate-limit headers for an admitted request.
pub fn openai_limit_headers(usage: &Usage) -> Vec<(&'static str, String)> {
    let mut h = Vec::new();
    if usage.request_limit > 0 {
        h.push(("x-ratelimit-limit-requests", usage.request_limit.to_string()));
        h.push(("x-ratelimit-remaining-requests", usage.requests_remaining.to_string()));
        h.push(("x-ratelimit-reset-requests", openai_duration(usage.requests_reset)));
    }
    if usage.token_limit > 0 {
        h.push(("x-ratelimit-limit-tokens", usage.token_limit.to_string()));
        h.push(("x-ratelimit-remaining-tokens", usage.tokens_remaining.to_string()));
        h.push(("x-ratelimit-reset-tokens", openai_duration(usage.tokens_reset)));
    }
    h
}

/// Anthropic's rate-limit headers for an admitted request (resets as RFC 3339 times).
pub fn anthropic_limit_headers(usage: &Usage) -> Vec<(&'static str, String)> {
    let at = |d: Duration| humantime::format_rfc3339_seconds(std::time::SystemTime::now() + d).to_string();
    let mut h = Vec::new();
    if usage.request_limit > 0 {
        h.push(("anthropic-ratelimit-requests-limit", usage.request_limit.to_string()));
        h.push(("anthropic-ratelimit-requests-remaining", usage.requests_remaining.to_string()));
        h.push(("anthropic-ratelimit-requests-reset", at(usage.requests_reset)));
    }
    if usage.token_limit > 0 {
        h.push(("anthropic-ratelimit-tokens-limit", usage.token_limit.to_string()));
        h.push(("anthropic-ratelimit-tokens-remaining", usage.tokens_remaining.to_string()));
        h.push(("anthropic-ratelimit-tokens-reset", at(usage.tokens_reset)));
    }
    h
}

/// The `:predict` answer for the given generations (one per instance).
pub fn predict_response(req: &SimRequest, gens: &[Generation], created: u64, id: &str) -> Value {
    let meta = |predictions: Value| {
        json!({
            "predictions": predictions,
            "deployedModelId": "4242424242424242424",
            "model": format!("projects/weir-sim/locations/us-central1/models/{}", req.model),
            "modelDisplayName": req.model,
            "modelVersionId": "1",
        })
    };
    if req.chat_predict {
        let inst = &req.instances[0];
        let g = &gens[0];
        return meta(openai_response(
            &req.model,
            id,
            created,
            g,
            crate::gen::count_tokens(&inst.prompt),
            Ending::Normal,
        ));
    }
    let preds: Vec<Value> = req
        .instances
        .iter()
        .zip(gens)
        .map(|(inst, g)| {
            if inst.raw_response {
                json!(g.text())
            } else {
                json!(format!("Prompt:\n{}\nOutput:\n{}", inst.prompt, g.text()))
            }
        })
        .collect();
    meta(Value::Array(preds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_formatted_like_the_services() {
        assert_eq!(proto_duration(Duration::from_secs(26)), "26s");
        assert_eq!(proto_duration(Duration::from_millis(1500)), "1.500s");
        assert_eq!(openai_duration(Duration::from_millis(12)), "12ms");
        assert_eq!(openai_duration(Duration::from_millis(1574)), "1.574s");
        assert_eq!(openai_duration(Duration::from_millis(2000)), "2s");
        assert_eq!(openai_duration(Duration::from_secs(360)), "6m0s");
    }

    #[test]
    fn gemini_request_text_includes_system_and_all_parts() {
        let body = json!({
            "systemInstruction": {"parts": [{"text": "be brief"}]},
            "contents": [{"role": "user", "parts": [{"text": "hello"}, {"text": "world"}]}],
            "generationConfig": {"maxOutputTokens": 5},
        });
        let r = parse_gemini(Api::Gemini, "m", &body, None).unwrap();
        assert_eq!(r.prompt, "be brief\nhello\nworld");
        assert_eq!(r.max_tokens, Some(5));
        assert!(parse_gemini(Api::Gemini, "m", &json!({}), None).is_err());
    }

    #[test]
    fn openai_request_prefers_max_completion_tokens() {
        let body = json!({"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 4});
        assert_eq!(parse_openai(&body).unwrap().max_tokens, Some(4));
        assert!(parse_openai(&json!({"model": "x"})).is_err());
    }
}
