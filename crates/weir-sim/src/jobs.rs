//! Batch-prediction jobs, as the OpenAI Batch API (`/v1/files`, `/v1/batches`) and the Gemini
//! API's batch mode (`:batchGenerateContent` with inline requests, `/v1beta/batches`) run them:
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
use crate::gen::{count_tokens, generate, stable_hash};
use crate::proto::{self, Api, Ending};

/// Which API a job came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    OpenAi,
    Gemini,
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
}

/// A reply: status and JSON body, or raw bytes (a file's content).
pub enum Reply {
    /// JSON.
    Json(u16, Value),
    /// A file's bytes.
    Bytes(Vec<u8>),
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
    fn finish(&mut self, cfg: &SimConfig, files: &mut BTreeMap<String, Vec<u8>>, next: &mut u64) -> u64 {
        if self.results.is_some() || !self.terminal(cfg) {
            return 0;
        }
        let answered = self.answered_in_the_end(cfg);
        let api = if self.kind == Kind::OpenAi { Api::OpenAi } else { Api::Gemini };
        let results: Vec<_> = self.requests[..answered]
            .iter()
            .enumerate()
            .map(|(i, (key, body))| (key.clone(), answer(cfg, api, &self.model, body, &self.id, i)))
            .collect();
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
        json!({"id": self.id, "object": "batch", "endpoint": "/v1/chat/completions", "errors": null,
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
        if let Some(results) = &self.results {
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

/// The answer to one request of a job, as the online route would give it (no latency, no
/// quota: a job has its own pool).
fn answer(cfg: &SimConfig, api: Api, model: &str, body: &Value, job: &str, i: usize) -> Result<Value, (u16, Value)> {
    let req = match api {
        Api::OpenAi => proto::parse_openai(body),
        _ => proto::parse_gemini(Api::Gemini, model, body, None),
    }
    .map_err(|proto::BadRequest(m)| (400, proto::error(api, 400, &m).body))?;
    let seed = cfg.seed.to_le_bytes();
    let draw = stable_hash(&[&seed, job.as_bytes(), &i.to_le_bytes()]) as f64 / u64::MAX as f64;
    if req.prompt.contains("[sim:error_500]") || draw < cfg.batch.item_error_rate {
        return Err((500, proto::error(api, 500, "An internal error has occurred.").body));
    }
    let limit = req.max_tokens.map(|m| m.to_le_bytes()).unwrap_or_default();
    let h = stable_hash(&[&seed, req.model.as_bytes(), req.prompt.as_bytes(), req.settings.as_bytes(), &limit]);
    let g = generate(h, cfg.output.min_tokens, cfg.output.max_tokens, req.max_tokens, 0.0);
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

    /// Zeroes the counts (`POST /stats/reset`); jobs and files stay.
    pub fn reset_counts(&self) {
        let mut g = self.lock();
        g.submitted = 0;
        g.answered = 0;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Handles a request to the job routes, or `None` when the path is not one of them.
    pub fn handle(
        &self,
        cfg: &SimConfig,
        method: &str,
        path: &str,
        query: Option<&str>,
        content_type: &str,
        body: &[u8],
    ) -> Option<Reply> {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let mut g = self.lock();
        let inner = &mut *g;
        // Bring every job whose time has come to its end.
        for job in inner.jobs.values_mut() {
            inner.answered += job.finish(cfg, &mut inner.files, &mut inner.next);
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
                for (n, line) in content.split(|c| *c == b'\n').filter(|l| !l.is_empty()).enumerate() {
                    let Ok(v) = serde_json::from_slice::<Value>(line) else {
                        return Some(openai_error(400, &format!("line {}: not JSON", n + 1)));
                    };
                    let (Some(key), Some(body)) = (v.get("custom_id").and_then(Value::as_str), v.get("body")) else {
                        return Some(openai_error(400, &format!("line {}: custom_id and body are required", n + 1)));
                    };
                    if requests.iter().any(|(k, _): &(String, Value)| k == key) {
                        return Some(openai_error(400, &format!("line {}: duplicate custom_id {key}", n + 1)));
                    }
                    model = body.get("model").and_then(Value::as_str).unwrap_or("").to_string();
                    requests.push((key.to_string(), body.clone()));
                }
                if requests.len() > cfg.batch.max_requests as usize {
                    return Some(openai_error(
                        400,
                        &format!(
                            "a batch takes at most {} requests, this file has {}",
                            cfg.batch.max_requests,
                            requests.len()
                        ),
                    ));
                }
                inner.next += 1;
                inner.submitted += 1;
                let id = format!("batch_{}", inner.next);
                let name = b.pointer("/metadata/weir_job").and_then(Value::as_str).unwrap_or("").to_string();
                let job = Job::new(Kind::OpenAi, id.clone(), name, model, Some(file.to_string()), requests);
                let view = job.openai_view(cfg);
                inner.jobs.insert(id, job);
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
            ("POST", ["v1", "batches", id, "cancel"]) => match inner.jobs.get_mut(*id) {
                Some(j) => {
                    if !j.terminal(cfg) {
                        j.cancelled_at = Some(j.elapsed());
                    }
                    inner.answered += j.finish(cfg, &mut inner.files, &mut inner.next);
                    Reply::Json(200, j.openai_view(cfg))
                }
                None => openai_error(404, &format!("No such Batch object: {id}")),
            },
            // ---- Gemini
            ("POST", ["v1beta", model_method]) | ("POST", ["v1beta", "models", model_method])
                if model_method.ends_with(":batchGenerateContent") =>
            {
                let model = model_method.trim_end_matches(":batchGenerateContent").to_string();
                let b = json_body();
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
                inner.next += 1;
                inner.submitted += 1;
                let id = format!("batches/sim{}", inner.next);
                let name = b.pointer("/batch/displayName").and_then(Value::as_str).unwrap_or("").to_string();
                let job = Job::new(Kind::Gemini, id.clone(), name, model, None, requests);
                let view = job.gemini_view(cfg);
                inner.jobs.insert(id, job);
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
                match inner.jobs.get_mut(&id) {
                    Some(j) => {
                        if !j.terminal(cfg) {
                            j.cancelled_at = Some(j.elapsed());
                        }
                        inner.answered += j.finish(cfg, &mut inner.files, &mut inner.next);
                        Reply::Json(200, json!({}))
                    }
                    None => gemini_error(404, &format!("batch {id} not found")),
                }
            }
            _ => return None,
        })
    }
}
