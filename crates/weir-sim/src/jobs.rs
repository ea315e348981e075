//! Batch-prediction jobs, as the OpenAI Batch API (`/v1/files`, `/v1/batches`), the Gemini
//! API's batch mode (`:batchGenerateContent` with inline requests, `/v1beta/batches`),
//! Anthropic's Message Batches (`/v1/messages/batches`, requests inline, results as JSON lines)
//! and Vertex AI (`…/locations/L/batchPredictionJobs`, JSONL read from and written to the
//! simulator's GCS bucket, see [`crate::gcs`]) run them:
//! a job is accepted, pending for a fifth of its time, running for the rest, then terminal.
//! Answers are the same pure function of the request as online ones. Per-request failures
//! (`batch.item_error_rate`, or a `[sim:error_500]` / `[sim:block_prompt]` in a prompt) come
//! back in the results; `batch.expire` ends every job expired with half its requests
//! answered, as a provider does when its window runs out. Everything is in memory.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::config::SimConfig;
use crate::gcs::Store;
use crate::gen::{count_tokens, generate, stable_hash};
use crate::proto::{self, Api, Ending};

/// Which API a job came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    OpenAi,
    Gemini,
    Vertex,
    Anthropic,
}

/// Where a Vertex AI job reads its input and writes its output.
#[derive(Debug, Clone)]
struct VertexIo {
    /// The job's input lines as sent (Vertex echoes every key but `request` with the answer).
    lines: Vec<Value>,
    input_uri: String,
    /// `gs://bucket/prefix` the output directory goes under.
    output_prefix: String,
    /// The directory written when the job ended.
    output_dir: Option<String>,
    /// A text-embedding model's job: `{"content"}` instances, each echoed as `instance` with
    /// its `predictions` (no key of the caller's comes back).
    embed: bool,
}

/// `gs://bucket/name` → (bucket, name).
fn gs_parts(uri: &str) -> Option<(&str, &str)> {
    let rest = uri.strip_prefix("gs://")?;
    Some(rest.split_once('/').unwrap_or((rest, "")))
}

/// One request's key and its answer body, or its error status and body.
type ItemResult = (String, Result<Value, (u16, Value)>);

#[derive(Debug)]
struct Job {
    kind: Kind,
    id: String,
    name: String,
    model: String,
    input_file: Option<String>,
    /// (key, request body)
    requests: Vec<(String, Value)>,
    created: Instant,
    created_unix: u64,
    cancelled_at: Option<f64>,
    /// (key, Ok(answer body) | Err((status, error body))) once terminal.
    results: Option<Vec<ItemResult>>,
    output_file: Option<String>,
    error_file: Option<String>,
    vertex: Option<VertexIo>,
    /// An OpenAI batch's route, as its creation named it.
    endpoint: String,
}

/// A request to the job routes.
pub(crate) struct JobRequest<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub content_type: &'a str,
    pub headers: &'a hyper::HeaderMap,
    pub body: &'a [u8],
}

/// The simulator's files and jobs.
#[derive(Debug, Default)]
pub struct Jobs {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    files: BTreeMap<String, Vec<u8>>,
    jobs: BTreeMap<String, Job>,
    next: u64,
    submitted: u64,
    answered: u64,
    /// Resumable uploads started and not finished: id → (display name, declared length).
    uploads: BTreeMap<String, (String, u64)>,
    uploaded: u64,
    upload_refusals: u64,
    /// Media parts of the requests jobs answered.
    media_parts: u64,
    /// How many submitted jobs held each request key (a key in two jobs was paid twice,
    /// unless the first job left it unanswered).
    keys: std::collections::HashMap<String, u32>,
}

/// A reply: status and JSON body, or raw bytes (a file's content).
pub enum Reply {
    /// JSON.
    Json(u16, Value),
    /// A file's bytes.
    Bytes(Vec<u8>),
    /// JSON with response headers.
    JsonWith(u16, Vec<(&'static str, String)>, Value),
}

fn openai_error(status: u16, message: &str) -> Reply {
    Reply::Json(status, proto::error(Api::OpenAi, status, message).body)
}

fn gemini_error(status: u16, message: &str) -> Reply {
    Reply::Json(status, proto::error(Api::Gemini, status, message).body)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The file of a `multipart/form-data` body (the part named `file`).
fn multipart_file(content_type: &str, body: &[u8]) -> Option<(String, Vec<u8>)> {
    let boundary = content_type.split("boundary=").nth(1)?.trim_matches('"');
    let delim = format!("--{boundary}");
    let mut parts = Vec::new();
    let mut rest = body;
    while let Some(i) = find(rest, delim.as_bytes()) {
        parts.push(&rest[..i]);
        rest = &rest[i + delim.len()..];
    }
    for part in parts {
        let Some(h) = find(part, b"\r\n\r\n") else { continue };
        let headers = String::from_utf8_lossy(&part[..h]);
        if !headers.contains("name=\"file\"") {
            continue;
        }
        let filename = headers.split("filename=\"").nth(1).and_then(|s| s.split('"').next()).unwrap_or("input.jsonl");
        let content = &part[h + 4..];
        let content = content.strip_suffix(b"\r\n").unwrap_or(content);
        return Some((filename.to_string(), content.to_vec()));
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

impl Job {
    fn new(
        kind: Kind,
        id: String,
        name: String,
        model: String,
        input_file: Option<String>,
        requests: Vec<(String, Value)>,
    ) -> Self {
        Self {
            kind,
            id,
            name,
            model,
            input_file,
            requests,
            created: Instant::now(),
            created_unix: unix_now(),
            cancelled_at: None,
            results: None,
            output_file: None,
            error_file: None,
            vertex: None,
            endpoint: "/v1/chat/completions".into(),
        }
    }

    fn run_secs(cfg: &SimConfig) -> f64 {
        cfg.batch.run_secs.max(0.0)
    }

    /// Seconds since creation, stopped at a cancel.
    fn elapsed(&self) -> f64 {
        self.cancelled_at.unwrap_or_else(|| self.created.elapsed().as_secs_f64())
    }

    /// Share of the requests answered so far.
    fn progress(&self, cfg: &SimConfig) -> f64 {
        let run = Self::run_secs(cfg);
        let start = run * 0.2;
        if run <= 0.0 {
            return 1.0;
        }
        ((self.elapsed() - start) / (run - start)).clamp(0.0, 1.0)
    }

    fn terminal(&self, cfg: &SimConfig) -> bool {
        self.cancelled_at.is_some() || self.elapsed() >= Self::run_secs(cfg)
    }

    fn state_name(&self, cfg: &SimConfig) -> &'static str {
        if self.kind == Kind::Vertex {
            return self.vertex_state(cfg);
        }
        let openai = self.kind == Kind::OpenAi;
        let run = Self::run_secs(cfg);
        match () {
            _ if self.cancelled_at.is_some() => {
                if openai {
                    "cancelled"
                } else {
                    "BATCH_STATE_CANCELLED"
                }
            }
            _ if self.terminal(cfg) && cfg.batch.expire => {
                if openai {
                    "expired"
                } else {
                    "BATCH_STATE_EXPIRED"
                }
            }
            _ if self.terminal(cfg) => {
                if openai {
                    "completed"
                } else {
                    "BATCH_STATE_SUCCEEDED"
                }
            }
            _ if self.elapsed() < run * 0.2 => {
                if openai {
                    "validating"
                } else {
                    "BATCH_STATE_PENDING"
                }
            }
            _ => {
                if openai {
                    "in_progress"
                } else {
                    "BATCH_STATE_RUNNING"
                }
            }
        }
    }

    /// Vertex AI's names: a job with failed requests ends partially succeeded.
    fn vertex_state(&self, cfg: &SimConfig) -> &'static str {
        match () {
            _ if self.cancelled_at.is_some() => "JOB_STATE_CANCELLED",
            _ if self.terminal(cfg) && cfg.batch.expire => "JOB_STATE_EXPIRED",
            _ if self.terminal(cfg) => match &self.results {
                Some(r) if r.iter().any(|(_, x)| x.is_err()) => "JOB_STATE_PARTIALLY_SUCCEEDED",
                _ => "JOB_STATE_SUCCEEDED",
            },
            _ if self.elapsed() < Self::run_secs(cfg) * 0.1 => "JOB_STATE_QUEUED",
            _ if self.elapsed() < Self::run_secs(cfg) * 0.2 => "JOB_STATE_PENDING",
            _ => "JOB_STATE_RUNNING",
        }
    }

    /// How many requests the job answers in the end (the first ones).
    fn answered_in_the_end(&self, cfg: &SimConfig) -> usize {
        let n = self.requests.len();
        if self.cancelled_at.is_some() {
            (n as f64 * self.progress(cfg)).floor() as usize
        } else if cfg.batch.expire {
            n / 2
        } else {
            n
        }
    }

    /// Computes the results once the job is terminal.
    fn finish(
        &mut self,
        cfg: &SimConfig,
        files: &mut BTreeMap<String, Vec<u8>>,
        next: &mut u64,
        gcs: &Store,
        media: &mut u64,
    ) -> u64 {
        if self.results.is_some() || !self.terminal(cfg) {
            return 0;
        }
        let answered = self.answered_in_the_end(cfg);
        let api = match (&self.kind, &self.vertex) {
            (Kind::OpenAi, _) => Api::OpenAi,
            (Kind::Anthropic, _) => Api::Anthropic,
            (_, Some(v)) if v.embed => Api::Vertex,
            _ => Api::Gemini,
        };
        let model = self.model.clone();
        let results: Vec<_> = self.requests[..answered]
            .iter()
            .enumerate()
            .map(|(i, (key, body))| (key.clone(), answer(cfg, api, &model, body, &self.id, i, media)))
            .collect();
        if let Some(v) = &mut self.vertex {
            // One `predictions.jsonl` in a directory of its own under the output prefix, each
            // line the input line with `response` or a `status` saying why it failed.
            let mut out = Vec::new();
            for ((line, _), (_, r)) in v.lines.iter().zip(&self.requests).zip(&results) {
                let mut o = line.clone();
                o["processed_time"] = json!(unix_now().to_string());
                if v.embed {
                    o = json!({"instance": line, "processed_time": o["processed_time"]});
                }
                match r {
                    Ok(body) if v.embed => {
                        o["status"] = json!("");
                        o["predictions"] = body["predictions"].clone();
                    }
                    Ok(body) => {
                        o["status"] = json!("");
                        o["response"] = body.clone();
                    }
                    Err((status, body)) => {
                        let reason = if *status == 400 { "Bad Request" } else { "Internal Server Error" };
                        o["status"] = json!(format!("{reason}: {body}"));
                    }
                }
                out.extend_from_slice(o.to_string().as_bytes());
                out.push(b'\n');
            }
            let dir = format!(
                "{}/prediction-model-{}",
                v.output_prefix.trim_end_matches('/'),
                self.id.rsplit('/').next().unwrap_or("")
            );
            if let Some((bucket, name)) = gs_parts(&format!("{dir}/predictions_00001.jsonl")) {
                gcs.put(bucket, name, out.into());
            }
            v.output_dir = Some(dir);
        }
        // A Gemini job from a file answers in a file: one `{"key", "response"|"error"}` a line.
        if self.kind == Kind::Gemini && self.input_file.is_some() {
            let mut out = Vec::new();
            for (key, r) in &results {
                let line = match r {
                    Ok(body) => json!({"key": key, "response": body}),
                    Err((_, body)) => json!({"key": key, "error": body["error"]}),
                };
                out.extend_from_slice(line.to_string().as_bytes());
                out.push(b'\n');
            }
            *next += 1;
            let id = format!("files/out{next}");
            files.insert(id.clone(), out);
            self.output_file = Some(id);
        }
        if self.kind == Kind::OpenAi {
            let mut out = Vec::new();
            let mut err = Vec::new();
            for (i, (key, r)) in results.iter().enumerate() {
                let (status, body) = match r {
                    Ok(b) => (200, b.clone()),
                    Err((s, b)) => (*s, b.clone()),
                };
                let line = json!({"id": format!("batch_req_{}_{i}", self.id), "custom_id": key,
                    "response": {"status_code": status, "request_id": format!("req_{i}"), "body": body}, "error": null});
                let target = if status == 200 { &mut out } else { &mut err };
                target.extend_from_slice(line.to_string().as_bytes());
                target.push(b'\n');
            }
            // Requests never run: in the error file, as OpenAI reports an expired batch's.
            let (code, why) = if self.cancelled_at.is_some() {
                ("batch_cancelled", "This request was not executed because the batch was cancelled.")
            } else {
                ("batch_expired", "This request could not be executed before the completion window expired.")
            };
            for (i, (key, _)) in self.requests.iter().enumerate().skip(answered) {
                let line = json!({"id": format!("batch_req_{}_{i}", self.id), "custom_id": key, "response": null,
                    "error": {"code": code, "message": why}});
                err.extend_from_slice(line.to_string().as_bytes());
                err.push(b'\n');
            }
            for (bytes, slot) in [(out, &mut self.output_file), (err, &mut self.error_file)] {
                if !bytes.is_empty() {
                    *next += 1;
                    let id = format!("file-{next}");
                    files.insert(id.clone(), bytes);
                    *slot = Some(id);
                }
            }
        }
        // A message batch's results: a line for every request, in the order they were sent.
        if self.kind == Kind::Anthropic {
            let mut out = Vec::new();
            let not_run = if self.cancelled_at.is_some() { "canceled" } else { "expired" };
            for (i, (key, _)) in self.requests.iter().enumerate() {
                let result = match results.get(i) {
                    Some((_, Ok(message))) => json!({"type": "succeeded", "message": message}),
                    Some((_, Err((_, body)))) => json!({"type": "errored", "error": body}),
                    None => json!({"type": not_run}),
                };
                out.extend_from_slice(json!({"custom_id": key, "result": result}).to_string().as_bytes());
                out.push(b'\n');
            }
            *next += 1;
            let id = format!("msgbatch-results-{next}");
            files.insert(id.clone(), out);
            self.output_file = Some(id);
        }
        // A job answered in files (OpenAI, Gemini from a file, Vertex AI) keeps only what its
        // status needs: its requests' keys and which of them failed. Holding every request and
        // answer as JSON trees (about 2 KB a request, twice over) ran the simulator out of
        // memory at 10^7 records.
        let mut results = results;
        if self.output_file.is_some() || self.error_file.is_some() || self.vertex.is_some() {
            for (_, body) in &mut self.requests {
                *body = Value::Null;
            }
            if let Some(v) = &mut self.vertex {
                v.lines = Vec::new();
            }
            for (_, r) in &mut results {
                match r {
                    Ok(body) | Err((_, body)) => *body = Value::Null,
                }
            }
        }
        let n = results.len() as u64;
        self.results = Some(results);
        n
    }

    fn counts(&self, cfg: &SimConfig) -> (u64, u64, u64) {
        let total = self.requests.len() as u64;
        match &self.results {
            Some(r) => {
                let failed = r.iter().filter(|(_, x)| x.is_err()).count() as u64;
                let not_run = total - r.len() as u64;
                (total, r.len() as u64 - failed, failed + if self.kind == Kind::OpenAi { not_run } else { 0 })
            }
            None => (total, (total as f64 * self.progress(cfg)).floor() as u64, 0),
        }
    }

    fn openai_view(&self, cfg: &SimConfig) -> Value {
        let (total, completed, failed) = self.counts(cfg);
        json!({"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": null,
            "input_file_id": self.input_file, "completion_window": "24h", "status": self.state_name(cfg),
            "output_file_id": self.output_file, "error_file_id": self.error_file, "created_at": self.created_unix,
            "request_counts": {"total": total, "completed": completed, "failed": failed},
            "metadata": {"weir_job": self.name}})
    }

    fn gemini_view(&self, cfg: &SimConfig) -> Value {
        let (total, ok, failed) = self.counts(cfg);
        let state = self.state_name(cfg);
        let mut meta = json!({"@type": "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatch",
            "name": self.id, "displayName": self.name, "model": format!("models/{}", self.model), "state": state,
            "batchStats": {"requestCount": total.to_string(), "successfulRequestCount": ok.to_string(),
                "failedRequestCount": failed.to_string(), "pendingRequestCount": (total - ok - failed).to_string()}});
        let mut op = json!({"name": self.id, "done": self.results.is_some()});
        if let (Some(_), Some(file)) = (&self.results, &self.output_file) {
            let output = json!({"responsesFile": file});
            meta["output"] = output.clone();
            let mut response = output;
            response["@type"] =
                json!("type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatchOutput");
            op["response"] = response;
        } else if let Some(results) = &self.results {
            let inlined: Vec<Value> = results
                .iter()
                .map(|(key, r)| match r {
                    Ok(body) => json!({"response": body, "metadata": {"key": key}}),
                    Err((_, body)) => json!({"error": body["error"], "metadata": {"key": key}}),
                })
                .collect();
            let output = json!({"inlinedResponses": {"inlinedResponses": inlined}});
            meta["output"] = output.clone();
            let mut response = output;
            response["@type"] =
                json!("type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatchOutput");
            op["response"] = response;
        }
        op["metadata"] = meta;
        op
    }
}

impl Job {
    /// A message batch as Anthropic describes it: in progress, then ended, with its requests
    /// counted by what became of them.
    fn anthropic_view(&self, cfg: &SimConfig, host: &str) -> Value {
        let total = self.requests.len() as u64;
        let (ok, errored, canceled, expired, processing) = match &self.results {
            Some(r) => {
                let errored = r.iter().filter(|(_, x)| x.is_err()).count() as u64;
                let not_run = total - r.len() as u64;
                match self.cancelled_at.is_some() {
                    true => (r.len() as u64 - errored, errored, not_run, 0, 0),
                    false => (r.len() as u64 - errored, errored, 0, not_run, 0),
                }
            }
            None => {
                let ok = (total as f64 * self.progress(cfg)).floor() as u64;
                (ok, 0, 0, 0, total - ok)
            }
        };
        let ended = self.results.is_some();
        let at = crate::gcs::rfc3339_of;
        json!({"id": self.id, "type": "message_batch",
            "processing_status": if ended { "ended" } else if self.cancelled_at.is_some() { "canceling" } else { "in_progress" },
            "request_counts": {"processing": processing, "succeeded": ok, "errored": errored,
                "canceled": canceled, "expired": expired},
            "ended_at": if ended { json!(at(unix_now())) } else { Value::Null },
            "created_at": at(self.created_unix), "expires_at": at(self.created_unix + 86_400),
            "archived_at": null,
            "cancel_initiated_at": match self.cancelled_at { Some(_) => json!(at(unix_now())), None => Value::Null },
            "results_url": if ended { json!(format!("http://{host}/v1/messages/batches/{}/results", self.id)) } else { Value::Null }})
    }

    fn vertex_view(&self, cfg: &SimConfig) -> Value {
        let (total, ok, failed) = self.counts(cfg);
        let state = self.state_name(cfg);
        let v = self.vertex.as_ref();
        let mut view = json!({"name": self.id, "displayName": self.name,
            "model": format!("publishers/google/models/{}", self.model), "state": state,
            "inputConfig": {"instancesFormat": "jsonl", "gcsSource": {"uris": [v.map(|v| v.input_uri.clone())]}},
            "outputConfig": {"predictionsFormat": "jsonl",
                "gcsDestination": {"outputUriPrefix": v.map(|v| v.output_prefix.clone())}},
            "createTime": crate::gcs::rfc3339_of(self.created_unix),
            "completionStats": {"successfulCount": ok.to_string(), "failedCount": failed.to_string(),
                "incompleteCount": (total - ok - failed).to_string()}});
        if let Some(dir) = v.and_then(|v| v.output_dir.clone()) {
            view["outputInfo"] = json!({"gcsOutputDirectory": dir});
        }
        if self.cancelled_at.is_some() {
            view["error"] = json!({"code": 1, "message": "CANCELED"});
        }
        view
    }
}

impl Inner {
    /// Keeps a submitted job, counting its requests' keys.
    fn add(&mut self, id: String, job: Job) {
        for (key, _) in &job.requests {
            *self.keys.entry(key.clone()).or_default() += 1;
        }
        self.jobs.insert(id, job);
    }

    /// Counts a submitted job; its number.
    fn next_job(&mut self) -> u64 {
        self.next += 1;
        self.submitted += 1;
        self.next
    }

    /// Cancels job `id` if it has not ended, and finishes it (counting what it answered);
    /// false if there is no such job.
    fn cancel(&mut self, id: &str, cfg: &SimConfig, gcs: &Store) -> bool {
        let Some(j) = self.jobs.get_mut(id) else { return false };
        if !j.terminal(cfg) {
            j.cancelled_at = Some(j.elapsed());
        }
        self.answered += j.finish(cfg, &mut self.files, &mut self.next, gcs, &mut self.media_parts);
        true
    }
}

/// The refusal of a job of more than `batch.max_requests` requests.
fn over_limit(cfg: &SimConfig, n: usize) -> Option<String> {
    (n > cfg.batch.max_requests as usize)
        .then(|| format!("a job takes at most {} requests, this one has {n}", cfg.batch.max_requests))
}

fn vertex_error(status: u16, message: &str) -> Reply {
    Reply::Json(status, proto::error(Api::Vertex, status, message).body)
}

/// The answer to one request of a job, as the online route would give it (no latency, no
/// quota: a job has its own pool).
fn answer(
    cfg: &SimConfig,
    api: Api,
    model: &str,
    body: &Value,
    job: &str,
    i: usize,
    media: &mut u64,
) -> Result<Value, (u16, Value)> {
    // A Vertex AI text-embedding instance, answered as its `:predict` would be; an OpenAI
    // batch's `/v1/embeddings` line (its body has `input`, not `messages`).
    let embed = match api {
        Api::Vertex => Some((proto::EmbedForm::Vertex, json!({"instances": [body]}))),
        Api::OpenAi if body.get("input").is_some() && body.get("messages").is_none() => {
            Some((proto::EmbedForm::OpenAi, body.clone()))
        }
        _ => None,
    };
    if let Some((form, body)) = embed {
        let req = proto::parse_embed(api, form, model, &body)
            .map_err(|proto::BadRequest(m)| (400, proto::error(api, 400, &m).body))?;
        let vectors: Vec<Vec<f32>> = req
            .instances
            .iter()
            .map(|x| proto::embedding_of(cfg.seed, &req.model, &x.prompt, cfg.embedding.dimensions))
            .collect();
        return Ok(proto::embed_response(&req, &vectors));
    }
    let req = match api {
        Api::OpenAi => proto::parse_openai(body),
        Api::Anthropic => proto::parse_anthropic(body, ""),
        _ => proto::parse_gemini(Api::Gemini, model, body, None),
    }
    .map_err(|proto::BadRequest(m)| (400, proto::error(api, 400, &m).body))?;
    let seed = cfg.seed.to_le_bytes();
    let draw = stable_hash(&[&seed, job.as_bytes(), &i.to_le_bytes()]) as f64 / u64::MAX as f64;
    if req.prompt.contains("[sim:error_500]") || draw < cfg.batch.item_error_rate {
        return Err((500, proto::error(api, 500, "An internal error has occurred.").body));
    }
    let limit = req.max_tokens.map(|m| m.to_le_bytes()).unwrap_or_default();
    // The answer depends on the media's content too, as online.
    *media += req.media.len() as u64;
    let parts: Vec<u8> = req.media.iter().flat_map(|d| d.to_le_bytes()).collect();
    // Hashed as online (the media only when there is some), so a job answers as a call would.
    let mut fields: Vec<&[u8]> =
        vec![&seed, req.model.as_bytes(), req.prompt.as_bytes(), req.settings.as_bytes(), &limit];
    if !parts.is_empty() {
        fields.push(&parts);
    }
    let h = stable_hash(&fields);
    let g = match &req.schema {
        Some(schema) => crate::gen::shaped(schema, h, crate::server::broken_draw(cfg.output.invalid_json_rate)),
        None => generate(h, cfg.output.min_tokens, cfg.output.max_tokens, req.max_tokens, 0.0),
    };
    let prompt_tokens = count_tokens(&req.prompt);
    let id = format!("{job}-{i}");
    Ok(match api {
        Api::OpenAi => {
            if req.prompt.contains("[sim:block_prompt]") {
                let mut e = proto::error(
                    api,
                    400,
                    "The response was filtered due to the prompt triggering content management policy.",
                );
                e.body["error"]["code"] = json!("content_filter");
                return Err((400, e.body));
            }
            proto::openai_response(&req.model, &id, unix_now(), &g, prompt_tokens, Ending::Normal)
        }
        Api::Anthropic => {
            let tool = req.schema.as_ref().and(proto::anthropic_tool(&req.settings));
            proto::anthropic_response(&req.model, &id, &g, prompt_tokens, tool.as_deref())
        }
        _ => {
            let ending = if req.prompt.contains("[sim:block_prompt]") { Ending::BlockPrompt } else { Ending::Normal };
            proto::gemini_response(&req.model, &id, &g, prompt_tokens, ending)
        }
    })
}

impl Jobs {
    /// Jobs submitted so far (of either API).
    pub fn submitted(&self) -> u64 {
        self.lock().submitted
    }

    /// Requests answered by jobs so far.
    pub fn answered(&self) -> u64 {
        self.lock().answered
    }

    /// Request keys submitted in any job, and those submitted in more than one.
    pub fn keys(&self) -> (u64, u64) {
        let g = self.lock();
        (g.keys.len() as u64, g.keys.values().filter(|n| **n > 1).count() as u64)
    }

    /// Files uploaded through the Gemini API's resumable protocol, and uploads refused for not
    /// following it.
    pub fn uploads(&self) -> (u64, u64) {
        let g = self.lock();
        (g.uploaded, g.upload_refusals)
    }

    /// Media parts of the requests jobs answered.
    pub fn media_parts(&self) -> u64 {
        self.lock().media_parts
    }

    /// Zeroes the counts (`POST /stats/reset`); jobs and files stay.
    pub fn reset_counts(&self) {
        let mut g = self.lock();
        g.submitted = 0;
        g.answered = 0;
        g.keys.clear();
        (g.uploaded, g.upload_refusals, g.media_parts) = (0, 0, 0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Handles a request to the job routes, or `None` when the path is not one of them.
    pub(crate) fn handle(&self, cfg: &SimConfig, req: JobRequest<'_>, gcs: &Store) -> Option<Reply> {
        let JobRequest { method, path, query, content_type, headers, body } = req;
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let mut g = self.lock();
        let inner = &mut *g;
        // Bring every job whose time has come to its end.
        for job in inner.jobs.values_mut() {
            inner.answered += job.finish(cfg, &mut inner.files, &mut inner.next, gcs, &mut inner.media_parts);
        }
        let json_body = || serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
        Some(match (method, segs.as_slice()) {
            // ---- OpenAI
            ("POST", ["v1", "files"]) => match multipart_file(content_type, body) {
                Some((filename, content)) => {
                    inner.next += 1;
                    let id = format!("file-{}", inner.next);
                    let bytes = content.len();
                    inner.files.insert(id.clone(), content);
                    Reply::Json(
                        200,
                        json!({"id": id, "object": "file", "bytes": bytes, "filename": filename, "purpose": "batch", "created_at": unix_now()}),
                    )
                }
                None => openai_error(400, "expected multipart/form-data with a 'file' part"),
            },
            ("GET", ["v1", "files", id, "content"]) => match inner.files.get(*id) {
                Some(bytes) => Reply::Bytes(bytes.clone()),
                None => openai_error(404, &format!("No such File object: {id}")),
            },
            ("DELETE", ["v1", "files", id]) => match inner.files.remove(*id) {
                Some(_) => Reply::Json(200, json!({"id": id, "object": "file", "deleted": true})),
                None => openai_error(404, &format!("No such File object: {id}")),
            },
            ("POST", ["v1", "batches"]) => {
                let b = json_body();
                let Some(file) = b.get("input_file_id").and_then(Value::as_str) else {
                    return Some(openai_error(400, "input_file_id is required"));
                };
                let Some(content) = inner.files.get(file) else {
                    return Some(openai_error(404, &format!("No such File object: {file}")));
                };
                let mut requests = Vec::new();
                let mut model = String::new();
                // Each custom_id once (a set: a job holds up to 50,000).
                let mut keys = std::collections::HashSet::new();
                for (n, line) in content.split(|c| *c == b'\n').filter(|l| !l.is_empty()).enumerate() {
                    let Ok(v) = serde_json::from_slice::<Value>(line) else {
                        return Some(openai_error(400, &format!("line {}: not JSON", n + 1)));
                    };
                    let (Some(key), Some(body)) = (v.get("custom_id").and_then(Value::as_str), v.get("body")) else {
                        return Some(openai_error(400, &format!("line {}: custom_id and body are required", n + 1)));
                    };
                    if !keys.insert(key.to_string()) {
                        return Some(openai_error(400, &format!("line {}: duplicate custom_id {key}", n + 1)));
                    }
                    model = body.get("model").and_then(Value::as_str).unwrap_or("").to_string();
                    requests.push((key.to_string(), body.clone()));
                }
                if let Some(m) = over_limit(cfg, requests.len()) {
                    return Some(openai_error(400, &m));
                }
                let id = format!("batch_{}", inner.next_job());
                let name = b.pointer("/metadata/weir_job").and_then(Value::as_str).unwrap_or("").to_string();
                let mut job = Job::new(Kind::OpenAi, id.clone(), name, model, Some(file.to_string()), requests);
                if let Some(e) = b.get("endpoint").and_then(Value::as_str) {
                    job.endpoint = e.to_string();
                }
                let view = job.openai_view(cfg);
                inner.add(id, job);
                Reply::Json(200, view)
            }
            ("GET", ["v1", "batches"]) => {
                let after = query.and_then(|q| q.split('&').find_map(|p| p.strip_prefix("after=")));
                let limit: usize = query
                    .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("limit=")))
                    .and_then(|l| l.parse().ok())
                    .unwrap_or(20);
                // Newest first, as OpenAI lists them.
                let all: Vec<&Job> = inner.jobs.values().rev().filter(|j| j.kind == Kind::OpenAi).collect();
                let start = after.and_then(|a| all.iter().position(|j| j.id == a).map(|p| p + 1)).unwrap_or(0);
                let page: Vec<Value> = all.iter().skip(start).take(limit).map(|j| j.openai_view(cfg)).collect();
                let more = all.len() > start + page.len();
                Reply::Json(200, json!({"object": "list", "data": page, "has_more": more}))
            }
            ("GET", ["v1", "batches", id]) => match inner.jobs.get(*id) {
                Some(j) => Reply::Json(200, j.openai_view(cfg)),
                None => openai_error(404, &format!("No such Batch object: {id}")),
            },
            ("POST", ["v1", "batches", id, "cancel"]) => match inner.cancel(id, cfg, gcs) {
                true => Reply::Json(200, inner.jobs[*id].openai_view(cfg)),
                false => openai_error(404, &format!("No such Batch object: {id}")),
            },
            // ---- Anthropic's Message Batches
            ("POST", ["v1", "messages", "batches"]) => {
                let anthropic_error =
                    |status, m: &str| Reply::Json(status, proto::error(Api::Anthropic, status, m).body);
                if body.len() as u64 > cfg.batch.max_inline_bytes.max(256 * 1000 * 1000) {
                    return Some(anthropic_error(413, "a batch's body may be at most 256 MB"));
                }
                let b = json_body();
                let Some(list) = b.get("requests").and_then(Value::as_array) else {
                    return Some(anthropic_error(400, "requests: Field required"));
                };
                let mut requests = Vec::new();
                let mut keys = std::collections::HashSet::new();
                let takes = |k: &str| {
                    !k.is_empty()
                        && k.len() <= 64
                        && k.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
                };
                for (n, r) in list.iter().enumerate() {
                    let (Some(key), Some(params)) = (r.get("custom_id").and_then(Value::as_str), r.get("params"))
                    else {
                        return Some(anthropic_error(400, &format!("requests.{n}: custom_id and params are required")));
                    };
                    if !takes(key) {
                        return Some(anthropic_error(
                            400,
                            &format!("requests.{n}.custom_id: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"),
                        ));
                    }
                    if !keys.insert(key.to_string()) {
                        return Some(anthropic_error(400, &format!("requests.{n}: duplicate custom_id {key}")));
                    }
                    requests.push((key.to_string(), params.clone()));
                }
                if requests.is_empty() {
                    return Some(anthropic_error(400, "requests: List should have at least 1 item"));
                }
                if let Some(m) = over_limit(cfg, requests.len()) {
                    return Some(anthropic_error(400, &m));
                }
                let model = requests[0].1.get("model").and_then(Value::as_str).unwrap_or("").to_string();
                let id = format!("msgbatch_sim{:06}", inner.next_job());
                let job = Job::new(Kind::Anthropic, id.clone(), String::new(), model, None, requests);
                let view = job.anthropic_view(cfg, &header("host"));
                inner.add(id, job);
                Reply::Json(200, view)
            }
            ("GET", ["v1", "messages", "batches"]) => {
                let param = |name: &str| {
                    query.and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')))
                };
                let limit: usize = param("limit").and_then(|l| l.parse().ok()).unwrap_or(20).clamp(1, 1000);
                // Newest first, as Anthropic lists them.
                let all: Vec<&Job> = inner.jobs.values().rev().filter(|j| j.kind == Kind::Anthropic).collect();
                let start =
                    param("after_id").and_then(|a| all.iter().position(|j| j.id == a).map(|p| p + 1)).unwrap_or(0);
                let host = header("host");
                let page: Vec<Value> =
                    all.iter().skip(start).take(limit).map(|j| j.anthropic_view(cfg, &host)).collect();
                let (first, last) = (page.first().map(|v| v["id"].clone()), page.last().map(|v| v["id"].clone()));
                let more = all.len() > start + page.len();
                Reply::Json(200, json!({"data": page, "has_more": more, "first_id": first, "last_id": last}))
            }
            ("GET", ["v1", "messages", "batches", id]) => {
                match inner.jobs.get(*id).filter(|j| j.kind == Kind::Anthropic) {
                    Some(j) => Reply::Json(200, j.anthropic_view(cfg, &header("host"))),
                    None => Reply::Json(404, proto::error(Api::Anthropic, 404, &format!("batch {id} not found")).body),
                }
            }
            ("GET", ["v1", "messages", "batches", id, "results"]) => {
                match inner.jobs.get(*id).filter(|j| j.kind == Kind::Anthropic) {
                    Some(j) => match j.output_file.as_ref().and_then(|f| inner.files.get(f)) {
                        Some(bytes) => Reply::Bytes(bytes.clone()),
                        None => Reply::Json(
                            400,
                            proto::error(Api::Anthropic, 400, &format!("batch {id} has not ended")).body,
                        ),
                    },
                    None => Reply::Json(404, proto::error(Api::Anthropic, 404, &format!("batch {id} not found")).body),
                }
            }
            ("POST", ["v1", "messages", "batches", id, "cancel"])
                if inner.jobs.get(*id).is_some_and(|j| j.kind == Kind::Anthropic) =>
            {
                inner.cancel(id, cfg, gcs);
                Reply::Json(200, inner.jobs[*id].anthropic_view(cfg, &header("host")))
            }
            ("POST", ["v1", "messages", "batches", id, "cancel"]) => {
                Reply::Json(404, proto::error(Api::Anthropic, 404, &format!("batch {id} not found")).body)
            }
            // ---- Gemini
            ("POST", ["v1beta", model_method]) | ("POST", ["v1beta", "models", model_method])
                if model_method.ends_with(":batchGenerateContent") =>
            {
                let model = model_method.trim_end_matches(":batchGenerateContent").to_string();
                let b = json_body();
                // From an uploaded file: one `{"key", "request"}` per line.
                if let Some(file) = b.pointer("/batch/inputConfig/fileName").and_then(Value::as_str) {
                    let Some(content) = inner.files.get(file) else {
                        return Some(gemini_error(404, &format!("file {file} not found")));
                    };
                    let mut requests = Vec::new();
                    for (n, line) in content.split(|c| *c == b'\n').filter(|l| !l.is_empty()).enumerate() {
                        let Ok(v) = serde_json::from_slice::<Value>(line) else {
                            return Some(gemini_error(400, &format!("{file} line {}: not JSON", n + 1)));
                        };
                        let (Some(key), Some(request)) = (v.get("key").and_then(Value::as_str), v.get("request"))
                        else {
                            return Some(gemini_error(
                                400,
                                &format!("{file} line {}: key and request are required", n + 1),
                            ));
                        };
                        requests.push((key.to_string(), request.clone()));
                    }
                    let id = format!("batches/sim{}", inner.next_job());
                    let name = b.pointer("/batch/displayName").and_then(Value::as_str).unwrap_or("").to_string();
                    let job = Job::new(Kind::Gemini, id.clone(), name, model, Some(file.to_string()), requests);
                    let view = job.gemini_view(cfg);
                    inner.add(id, job);
                    return Some(Reply::Json(200, view));
                }
                let Some(list) = b.pointer("/batch/inputConfig/requests/requests").and_then(Value::as_array) else {
                    return Some(gemini_error(
                        400,
                        "batch.inputConfig.requests.requests is required (inline requests)",
                    ));
                };
                if body.len() as u64 > cfg.batch.max_inline_bytes {
                    return Some(gemini_error(
                        400,
                        &format!(
                            "inline requests must be under {} bytes, this is {}",
                            cfg.batch.max_inline_bytes,
                            body.len()
                        ),
                    ));
                }
                let mut requests = Vec::new();
                for (n, r) in list.iter().enumerate() {
                    let key = r
                        .pointer("/metadata/key")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .unwrap_or_else(|| n.to_string());
                    let Some(request) = r.get("request") else {
                        return Some(gemini_error(400, &format!("requests[{n}].request is required")));
                    };
                    requests.push((key, request.clone()));
                }
                let id = format!("batches/sim{}", inner.next_job());
                let name = b.pointer("/batch/displayName").and_then(Value::as_str).unwrap_or("").to_string();
                let job = Job::new(Kind::Gemini, id.clone(), name, model, None, requests);
                let view = job.gemini_view(cfg);
                inner.add(id, job);
                Reply::Json(200, view)
            }
            ("GET", ["v1beta", "batches"]) => {
                let ops: Vec<Value> =
                    inner.jobs.values().rev().filter(|j| j.kind == Kind::Gemini).map(|j| j.gemini_view(cfg)).collect();
                Reply::Json(200, json!({"operations": ops}))
            }
            ("GET", ["v1beta", "batches", id]) => match inner.jobs.get(&format!("batches/{id}")) {
                Some(j) => Reply::Json(200, j.gemini_view(cfg)),
                None => gemini_error(404, &format!("batch batches/{id} not found")),
            },
            ("POST", ["v1beta", "batches", id_method]) if id_method.ends_with(":cancel") => {
                let id = format!("batches/{}", id_method.trim_end_matches(":cancel"));
                match inner.cancel(&id, cfg, gcs) {
                    true => Reply::Json(200, json!({})),
                    false => gemini_error(404, &format!("batch {id} not found")),
                }
            }
            // ---- Gemini Files API, resumable uploads: a start declaring the length, then the
            // bytes in one request that finalizes (what weir sends; chunked uploads are refused).
            ("POST", ["upload", "v1beta", "files"]) if query.is_none_or(|q| !q.contains("upload_id=")) => {
                let declared = header("x-goog-upload-header-content-length").parse::<u64>();
                let refusal = if header("x-goog-upload-protocol") != "resumable" {
                    Some("X-Goog-Upload-Protocol: resumable is required")
                } else if header("x-goog-upload-command") != "start" {
                    Some("the first request of an upload must be X-Goog-Upload-Command: start")
                } else if declared.is_err() {
                    Some("X-Goog-Upload-Header-Content-Length must give the file's length")
                } else {
                    None
                };
                if let Some(why) = refusal {
                    inner.upload_refusals += 1;
                    return Some(gemini_error(400, why));
                }
                let display =
                    json_body().pointer("/file/display_name").and_then(Value::as_str).unwrap_or("").to_string();
                inner.next += 1;
                let id = format!("up{}", inner.next);
                inner.uploads.insert(id.clone(), (display, declared.unwrap_or(0)));
                let host = header("host");
                let url = format!("http://{host}/upload/v1beta/files?upload_id={id}");
                Reply::JsonWith(
                    200,
                    vec![("x-goog-upload-url", url), ("x-goog-upload-status", "active".into())],
                    json!({}),
                )
            }
            ("POST", ["upload", "v1beta", "files"]) => {
                let id = query.and_then(|q| q.split('&').find_map(|p| p.strip_prefix("upload_id="))).unwrap_or("");
                let Some((display, declared)) = inner.uploads.get(id).cloned() else {
                    inner.upload_refusals += 1;
                    return Some(gemini_error(404, &format!("no upload session {id}")));
                };
                let command = header("x-goog-upload-command");
                let refusal = if !command.split(',').map(str::trim).eq(["upload", "finalize"]) {
                    Some(format!("X-Goog-Upload-Command must be 'upload, finalize', not '{command}'"))
                } else if header("x-goog-upload-offset") != "0" {
                    Some("X-Goog-Upload-Offset must be 0 for a single upload".to_string())
                } else if body.len() as u64 != declared {
                    Some(format!("{} bytes uploaded, {declared} declared at the start", body.len()))
                } else {
                    None
                };
                if let Some(why) = refusal {
                    inner.upload_refusals += 1;
                    return Some(gemini_error(400, &why));
                }
                inner.uploads.remove(id);
                inner.uploaded += 1;
                let name = format!("files/{id}");
                inner.files.insert(name.clone(), body.to_vec());
                let file = json!({"name": name, "displayName": display, "mimeType": header("content-type"),
                    "sizeBytes": body.len().to_string(), "state": "ACTIVE", "uri": format!("http://{}/v1beta/{name}", header("host"))});
                Reply::JsonWith(200, vec![("x-goog-upload-status", "final".into())], json!({"file": file}))
            }
            // A file's bytes, at the path google-genai's `files.download` asks (and the media
            // path under /download).
            ("GET", ["v1beta", "files", id_method]) | ("GET", ["download", "v1beta", "files", id_method])
                if id_method.ends_with(":download") =>
            {
                let name = format!("files/{}", id_method.trim_end_matches(":download"));
                match inner.files.get(&name) {
                    Some(bytes) => Reply::Bytes(bytes.clone()),
                    None => gemini_error(404, &format!("file {name} not found")),
                }
            }
            ("GET", ["v1beta", "files", id]) => match inner.files.get(&format!("files/{id}")) {
                Some(b) => Reply::Json(
                    200,
                    json!({"name": format!("files/{id}"), "sizeBytes": b.len().to_string(), "state": "ACTIVE"}),
                ),
                None => gemini_error(404, &format!("file files/{id} not found")),
            },
            ("DELETE", ["v1beta", "files", id]) => match inner.files.remove(&format!("files/{id}")) {
                Some(_) => Reply::Json(200, json!({})),
                None => gemini_error(404, &format!("file files/{id} not found")),
            },
            // ---- Vertex AI
            ("POST", ["v1" | "v1beta1", "projects", p, "locations", l, "batchPredictionJobs"]) => {
                let b = json_body();
                let model = b.get("model").and_then(Value::as_str).unwrap_or("");
                let Some(model) = model.rsplit_once("models/").map(|(_, m)| m.to_string()) else {
                    return Some(vertex_error(400, "model must be publishers/google/models/MODEL"));
                };
                let uri = b.pointer("/inputConfig/gcsSource/uris/0").and_then(Value::as_str).unwrap_or("");
                let prefix =
                    b.pointer("/outputConfig/gcsDestination/outputUriPrefix").and_then(Value::as_str).unwrap_or("");
                if b.pointer("/inputConfig/instancesFormat").and_then(Value::as_str) != Some("jsonl")
                    || !prefix.starts_with("gs://")
                {
                    return Some(vertex_error(
                        400,
                        "inputConfig.instancesFormat must be jsonl and outputConfig.gcsDestination.outputUriPrefix a gs:// URI",
                    ));
                }
                let Some(content) = gs_parts(uri).and_then(|(bucket, name)| gcs.get(bucket, name)) else {
                    return Some(vertex_error(400, &format!("the input {uri} does not exist")));
                };
                let mut requests = Vec::new();
                let mut lines = Vec::new();
                let embed = model.contains("embedding");
                for (n, line) in content.split(|c| *c == b'\n').filter(|l| !l.is_empty()).enumerate() {
                    let Ok(v) = serde_json::from_slice::<Value>(line) else {
                        return Some(vertex_error(400, &format!("{uri} line {}: not JSON", n + 1)));
                    };
                    // A text-embedding model takes instances as its `:predict` does.
                    let request = match embed {
                        true => v.get("content").filter(|c| c.is_string()).map(|_| v.clone()),
                        false => v.get("request").cloned(),
                    };
                    let Some(request) = request else {
                        let want = if embed { "no string content (a text-embedding instance)" } else { "no request" };
                        return Some(vertex_error(400, &format!("{uri} line {}: {want}", n + 1)));
                    };
                    // An embedding instance has no key: its text stands for it (so that a text
                    // sent in two jobs counts as a key in two jobs).
                    let key = match v.get("key").and_then(Value::as_str) {
                        Some(k) => k.to_string(),
                        None if embed => v.get("content").and_then(Value::as_str).unwrap_or("").to_string(),
                        None => n.to_string(),
                    };
                    requests.push((key, request));
                    lines.push(v);
                }
                if let Some(m) = over_limit(cfg, requests.len()) {
                    return Some(vertex_error(400, &m));
                }
                let id = format!("projects/{p}/locations/{l}/batchPredictionJobs/{}", 7000 + inner.next_job());
                let name = b.get("displayName").and_then(Value::as_str).unwrap_or("").to_string();
                let mut job = Job::new(Kind::Vertex, id.clone(), name, model, None, requests);
                job.vertex = Some(VertexIo {
                    lines,
                    input_uri: uri.to_string(),
                    output_prefix: prefix.to_string(),
                    output_dir: None,
                    embed,
                });
                let view = job.vertex_view(cfg);
                inner.add(id, job);
                Reply::Json(200, view)
            }
            ("GET", ["v1" | "v1beta1", "projects", p, "locations", l, "batchPredictionJobs"]) => {
                let param = |name: &str| {
                    query.and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')))
                };
                let size: usize = param("pageSize").and_then(|s| s.parse().ok()).unwrap_or(100).max(1);
                let start: usize = param("pageToken").and_then(|s| s.parse().ok()).unwrap_or(0);
                let prefix = format!("projects/{p}/locations/{l}/");
                let all: Vec<&Job> =
                    inner.jobs.values().rev().filter(|j| j.kind == Kind::Vertex && j.id.starts_with(&prefix)).collect();
                let page: Vec<Value> = all.iter().skip(start).take(size).map(|j| j.vertex_view(cfg)).collect();
                let mut reply = json!({"batchPredictionJobs": page});
                if all.len() > start + size {
                    reply["nextPageToken"] = json!((start + size).to_string());
                }
                Reply::Json(200, reply)
            }
            ("GET", ["v1" | "v1beta1", "projects", p, "locations", l, "batchPredictionJobs", id]) => {
                let id = format!("projects/{p}/locations/{l}/batchPredictionJobs/{id}");
                match inner.jobs.get(&id) {
                    Some(j) => Reply::Json(200, j.vertex_view(cfg)),
                    None => vertex_error(404, &format!("The BatchPredictionJob does not exist: {id}")),
                }
            }
            ("POST", ["v1" | "v1beta1", "projects", p, "locations", l, "batchPredictionJobs", id_method])
                if id_method.ends_with(":cancel") =>
            {
                let id =
                    format!("projects/{p}/locations/{l}/batchPredictionJobs/{}", id_method.trim_end_matches(":cancel"));
                match inner.cancel(&id, cfg, gcs) {
                    true => Reply::Json(200, json!({})),
                    false => vertex_error(404, &format!("The BatchPredictionJob does not exist: {id}")),
                }
            }
            _ => return None,
        })
    }
}
