//! Batch-prediction job clients: the OpenAI Batch API (`/files` + `/batches`, also what vLLM's
//! batch runner reads), the Gemini API's batch mode (`:batchGenerateContent` with the
//! requests inline), Vertex AI's `batchPredictionJobs` (JSONL staged in Cloud Storage) and
//! Anthropic's Message Batches (requests inline). Requests are built by the online clients' own
//! code, so a job asks exactly what an online call would; results are parsed and classified by
//! it too.

use serde_json::{json, Value};
use std::sync::Arc;
use weir_core::{
    ErrorKind, JobApi, JobInput, JobLimits, JobRef, JobResult, JobStaging, JobState, JobStatus, ModelError,
    ModelRequest, Sought,
};

use crate::http::{clip, redact, Credential, Reply, Secret};
use crate::{gemini, openai, GeminiHandler, OpenAiHandler};

/// The OpenAI Batch API's limits per input file: 50,000 requests and 200 MB.
pub const OPENAI_LIMITS: JobLimits = JobLimits { max_lines: 50_000, max_bytes: 200 * 1000 * 1000 };

/// A Gemini API job: its input is an uploaded JSONL file (the Files API takes up to 2 GB; weir
/// streams it from the disk, and stays under with a margin). Lines: no documented limit;
/// 50,000 keeps a job's results, which are matched to its records in memory, of a sane size.
pub const GEMINI_LIMITS: JobLimits = JobLimits { max_lines: 50_000, max_bytes: 1900 * 1000 * 1000 };

/// Gemini API jobs of at most this many bytes send their requests inline (one call, no file to
/// upload and delete); larger ones upload a file. The API takes inline requests under 20 MB,
/// but their answers come back inline too, in one JSON document read whole.
pub const GEMINI_INLINE_MAX: usize = 1_000_000;

/// Vertex AI's limits per Gemini batch job: 200,000 requests, and an input file of at most 1 GB.
pub const VERTEX_LIMITS: JobLimits = JobLimits { max_lines: 200_000, max_bytes: 1000 * 1000 * 1000 };

/// Vertex AI's limit per batch job of a text-embedding model: 30,000 prompts.
pub const VERTEX_EMBED_LIMITS: JobLimits = JobLimits { max_lines: 30_000, max_bytes: 1000 * 1000 * 1000 };

/// An error reading a job API's answer.
fn malformed(what: &str) -> ModelError {
    ModelError::new(ErrorKind::MalformedResponse, format!("batch job API: {what}"))
}

/// Sends the request `build` makes with `credential`; an answer other than 200 is the error
/// `classify` makes of it (as the online client would), with the key taken out.
async fn send_ok(
    credential: &Credential,
    build: impl Fn() -> reqwest::RequestBuilder,
    classify: fn(u16, &reqwest::header::HeaderMap, &[u8]) -> ModelError,
) -> Result<Reply, ModelError> {
    let (reply, secret) = credential.send(build).await?;
    if reply.status != 200 {
        return Err(redact(classify(reply.status, &reply.headers, &reply.body), secret.as_ref()));
    }
    Ok(reply)
}

/// [`send_ok`] for a download whose body is handed over line by line as it arrives.
async fn lines_ok(
    credential: &Credential,
    build: impl Fn() -> reqwest::RequestBuilder,
    classify: fn(u16, &reqwest::header::HeaderMap, &[u8]) -> ModelError,
    each: &mut (dyn FnMut(&[u8]) + Send),
) -> Result<(), ModelError> {
    match credential.send_lines(build, each).await? {
        None => Ok(()),
        Some((reply, secret)) => Err(redact(classify(reply.status, &reply.headers, &reply.body), secret.as_ref())),
    }
}

/// Hands each line of a job's results that `parse` reads to `each`, counting in `unread` those
/// it cannot read (blank lines are not counted): one such line names no record, whose request is
/// then missing from the results and tried again.
fn result_lines<'a>(
    parse: impl Fn(&[u8]) -> Option<JobResult> + Send + 'a,
    each: &'a mut (dyn FnMut(JobResult) + Send),
    unread: &'a mut usize,
) -> impl FnMut(&[u8]) + Send + 'a {
    move |l: &[u8]| match parse(l) {
        Some(r) => each(r),
        None if !l.iter().all(u8::is_ascii_whitespace) => *unread += 1,
        None => {}
    }
}

/// Says how many lines of a job's results could not be read (each names no record, whose
/// request is then tried again): a provider's format weir does not know, or a file cut short.
fn unreadable(job: &str, lines: usize) {
    if lines > 0 {
        tracing::warn!("job {job}: {lines} lines of its results could not be read; their records are tried again");
    }
}

/// The job's input file could not be read (removed under the run): nothing was sent.
fn local_input(input: &JobInput, e: std::io::Error) -> ModelError {
    ModelError::new(ErrorKind::InvalidInput, format!("batch job input {}: {e}", input.path.display()))
}

fn json_post(client: &reqwest::Client, url: &str, body: &bytes::Bytes) -> reqwest::RequestBuilder {
    client.post(url).header(reqwest::header::CONTENT_TYPE, "application/json").body(body.clone())
}

/// A job input line: `line` as JSON, newline-terminated.
fn json_line(line: &Value) -> Result<Vec<u8>, ModelError> {
    let mut bytes = serde_json::to_vec(line).map_err(|e| ModelError::new(ErrorKind::InvalidInput, e.to_string()))?;
    bytes.push(b'\n');
    Ok(bytes)
}

fn json_of(reply: &Reply) -> Result<Value, ModelError> {
    serde_json::from_slice(&reply.body).map_err(|e| malformed(&format!("the answer is not JSON: {e}")))
}

/// A `multipart/form-data` body with a `purpose` field and the job's input file, streamed from
/// the disk; its content type and length. The boundary is 128 random bits, which a file does
/// not contain but by a chance not worth counting.
fn multipart(
    purpose: &str,
    filename: &str,
    input: &JobInput,
) -> (impl futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send + Sync + 'static, String, u64) {
    use futures::StreamExt;
    let mut random = [0u8; 16];
    // An error of the system's random source leaves the zeros and the input's length.
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random);
    let boundary = format!("weir-jobs-{}-{}", hex::encode(random), input.len);
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
         Content-Type: application/jsonl\r\n\r\n"
    );
    let tail = format!("\r\n--{boundary}--\r\n");
    let len = head.len() as u64 + input.len + tail.len() as u64;
    let part = |s: String| futures::stream::once(futures::future::ready(Ok(bytes::Bytes::from(s))));
    let body = part(head).chain(input.stream()).chain(part(tail));
    (body, format!("multipart/form-data; boundary={boundary}"), len)
}

/// Jobs of an OpenAI-compatible server's Batch API.
pub struct OpenAiJobs {
    client: reqwest::Client,
    base: String,
    online: OpenAiHandler,
    model: String,
    model_id: String,
    credential: Credential,
    limits: JobLimits,
    /// Jobs of `/v1/embeddings` requests, not chat completions.
    embed: bool,
}

impl OpenAiJobs {
    /// Jobs at `base` (the API root, as for online calls) for `model`.
    pub fn new(client: reqwest::Client, base: &reqwest::Url, model: &str, key: Option<Secret>) -> Self {
        let online = OpenAiHandler::new(client.clone(), base, model, key.clone());
        let credential = key.map_or(Credential::None, |k| Credential::Key(k, None));
        let base = base.as_str().trim_end_matches('/').to_string();
        Self {
            client,
            base,
            online,
            model: model.to_string(),
            model_id: format!("openai/{model}"),
            credential,
            limits: OPENAI_LIMITS,
            embed: false,
        }
    }

    /// Jobs of embeddings (`/v1/embeddings`), each record's text one input.
    pub fn embeddings(mut self) -> Self {
        self.embed = true;
        self
    }

    /// The route the job's requests go to.
    fn endpoint(&self) -> &'static str {
        if self.embed {
            "/v1/embeddings"
        } else {
            "/v1/chat/completions"
        }
    }

    /// Smaller jobs than the provider allows (tests, or to spread a run over several jobs).
    pub fn with_limits(mut self, limits: JobLimits) -> Self {
        self.limits = limits;
        self
    }

    async fn get(&self, path: &str) -> Result<Value, ModelError> {
        let url = format!("{}{path}", self.base);
        let reply = send_ok(&self.credential, || self.client.get(&url), openai::classify_error).await?;
        json_of(&reply)
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value, ModelError> {
        let url = format!("{}{path}", self.base);
        let bytes = bytes::Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
        let reply = send_ok(&self.credential, || json_post(&self.client, &url, &bytes), openai::classify_error).await?;
        json_of(&reply)
    }

    /// A file's content (results and errors are files).
    /// An uploaded or output file's lines, each handed over as it is downloaded.
    async fn file_lines(&self, id: &str, each: &mut (dyn FnMut(&[u8]) + Send)) -> Result<(), ModelError> {
        let url = format!("{}/files/{id}/content", self.base);
        lines_ok(&self.credential, || self.client.get(&url), openai::classify_error, each).await
    }

    fn job_ref(v: &Value) -> Result<JobRef, ModelError> {
        let id = v.get("id").and_then(Value::as_str).ok_or_else(|| malformed("a batch without an id"))?;
        Ok(JobRef { id: id.to_string(), file: v.get("input_file_id").and_then(Value::as_str).map(str::to_string) })
    }
}

/// One line of an OpenAI batch's output or error file.
fn openai_result(line: &[u8], embed: bool) -> Option<JobResult> {
    let v: Value = serde_json::from_slice(line).ok()?;
    let key = v.get("custom_id")?.as_str()?.to_string();
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        let code = err.get("code").and_then(Value::as_str).unwrap_or("error");
        let message = err.get("message").and_then(Value::as_str).unwrap_or("");
        // `batch_expired`, `batch_cancelled`: not tried. A retryable kind, so that it goes to a
        // follow-up job, and if none is left, to an error row that a later run tries again
        // (never `aborted`, whose rows a resumable run does not write).
        return Some((key, Err(ModelError::new(ErrorKind::Server, clip(&format!("not run: {code}: {message}"))))));
    }
    let response = v.get("response")?;
    let status = response.get("status_code").and_then(Value::as_u64).unwrap_or(0) as u16;
    let body = serde_json::to_vec(response.get("body").unwrap_or(&Value::Null)).unwrap_or_default();
    let result = if status == 200 && embed {
        // One input per request: its vector, and the whole usage.
        crate::embed::parse(crate::embed::EmbedApi::OpenAi, &body, &["x"])
            .and_then(|mut v| v.pop().unwrap_or_else(|| Err(malformed("an embedding answer with no vector"))))
    } else if status == 200 {
        openai::parse_response(&body)
    } else {
        Err(openai::classify_error(status, &reqwest::header::HeaderMap::new(), &body))
    };
    Some((key, result))
}

fn openai_state(status: &str) -> JobState {
    match status {
        "validating" => JobState::Pending,
        "in_progress" | "finalizing" | "cancelling" => JobState::Running,
        "completed" => JobState::Succeeded,
        "failed" => JobState::Failed,
        "expired" => JobState::Expired,
        "cancelled" => JobState::Cancelled,
        _ => JobState::Running,
    }
}

#[async_trait::async_trait]
impl JobApi for OpenAiJobs {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn limits(&self) -> JobLimits {
        self.limits
    }

    fn line(&self, key: &str, request: &ModelRequest) -> Result<Vec<u8>, ModelError> {
        let body = match self.embed {
            true => json!({"model": self.model, "input": request.prompt}),
            false => self.online.body(request),
        };
        let line = json!({"custom_id": key, "method": "POST", "url": self.endpoint(), "body": body});
        json_line(&line)
    }

    async fn submit(&self, name: &str, input: &JobInput) -> Result<JobRef, ModelError> {
        let url = format!("{}/files", self.base);
        let filename = format!("{name}.jsonl");
        let reply = send_ok(
            &self.credential,
            || {
                let (body, content_type, len) = multipart("batch", &filename, input);
                self.client
                    .post(&url)
                    .header(reqwest::header::CONTENT_TYPE, content_type)
                    .header(reqwest::header::CONTENT_LENGTH, len)
                    .body(reqwest::Body::wrap_stream(body))
            },
            openai::classify_error,
        )
        .await?;
        let file = json_of(&reply)?;
        let file_id =
            file.get("id").and_then(Value::as_str).ok_or_else(|| malformed("an uploaded file without an id"))?;
        let batch = self
            .post(
                "/batches",
                json!({"input_file_id": file_id, "endpoint": self.endpoint(), "completion_window": "24h",
                       "metadata": {"weir_job": name}}),
            )
            .await?;
        Self::job_ref(&batch)
    }

    async fn find(&self, sought: &Sought) -> Result<Option<JobRef>, ModelError> {
        let name = sought.name.as_str();
        let mut after: Option<String> = None;
        loop {
            let path = match &after {
                Some(a) => format!("/batches?limit=100&after={a}"),
                None => "/batches?limit=100".to_string(),
            };
            let page = self.get(&path).await?;
            let data = page.get("data").and_then(Value::as_array).cloned().unwrap_or_default();
            for b in &data {
                if b.pointer("/metadata/weir_job").and_then(Value::as_str) == Some(name) {
                    return Self::job_ref(b).map(Some);
                }
            }
            let more = page.get("has_more").and_then(Value::as_bool).unwrap_or(false);
            match data.last().and_then(|b| b.get("id")).and_then(Value::as_str) {
                Some(last) if more => after = Some(last.to_string()),
                _ => return Ok(None),
            }
        }
    }

    async fn status(&self, job: &JobRef) -> Result<JobStatus, ModelError> {
        let b = self.get(&format!("/batches/{}", job.id)).await?;
        let count = |k: &str| b.pointer(&format!("/request_counts/{k}")).and_then(Value::as_u64).unwrap_or(0);
        let state = openai_state(b.get("status").and_then(Value::as_str).unwrap_or(""));
        let message = b
            .pointer("/errors/data")
            .and_then(Value::as_array)
            .map(|errs| {
                errs.iter().filter_map(|e| e.get("message").and_then(Value::as_str)).collect::<Vec<_>>().join("; ")
            })
            .filter(|m| !m.is_empty());
        Ok(JobStatus {
            state,
            total: count("total"),
            completed: count("completed"),
            failed: count("failed"),
            message,
            described: Some(Arc::new(b)),
        })
    }

    async fn results(
        &self,
        job: &JobRef,
        status: &JobStatus,
        each: &mut (dyn FnMut(JobResult) + Send),
    ) -> Result<(), ModelError> {
        let b = match &status.described {
            Some(b) => b.clone(),
            None => Arc::new(self.get(&format!("/batches/{}", job.id)).await?),
        };
        for field in ["output_file_id", "error_file_id"] {
            if let Some(id) = b.get(field).and_then(Value::as_str) {
                // A line that cannot be read names no key; its record is then missing and is
                // tried again.
                let embed = self.embed;
                let mut unread = 0usize;
                self.file_lines(id, &mut result_lines(|l| openai_result(l, embed), each, &mut unread)).await?;
                unreadable(&job.id, unread);
            }
        }
        Ok(())
    }

    async fn cancel(&self, job: &JobRef) -> Result<(), ModelError> {
        self.post(&format!("/batches/{}/cancel", job.id), json!({})).await.map(|_| ())
    }

    async fn clean_up(&self, job: &JobRef) {
        if let Some(file) = &job.file {
            let url = format!("{}/files/{file}", self.base);
            if let Err(e) = self.credential.send(|| self.client.delete(&url)).await {
                tracing::debug!("could not delete batch input file {file}: {e}");
            }
        }
    }
}

/// Uploads a file to the Gemini API's Files API at `base` (the resumable protocol: a start
/// that declares the length and type, then the bytes `body` makes in one request that
/// finalizes); the file's resource (`name`, `uri`, `state`, …). For batch jobs' inputs and for
/// media too large to go inline.
pub(crate) async fn files_upload(
    client: &reqwest::Client,
    credential: &Credential,
    base: &str,
    display_name: &str,
    mime: &str,
    len: u64,
    body: impl Fn() -> reqwest::Body,
) -> Result<Value, ModelError> {
    let url = format!("{base}/upload/v1beta/files");
    let start = bytes::Bytes::from(json!({"file": {"display_name": display_name}}).to_string());
    let reply = send_ok(
        credential,
        || {
            json_post(client, &url, &start)
                .header("X-Goog-Upload-Protocol", "resumable")
                .header("X-Goog-Upload-Command", "start")
                .header("X-Goog-Upload-Header-Content-Length", len.to_string())
                .header("X-Goog-Upload-Header-Content-Type", mime)
        },
        gemini::classify_error,
    )
    .await?;
    let session = reply
        .headers
        .get("x-goog-upload-url")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| malformed("the upload's start gave no X-Goog-Upload-URL"))?
        .to_string();
    // The key goes with the bytes only to where it was going already.
    let origin = |u: &str| reqwest::Url::parse(u).ok().map(|u| u.origin());
    if origin(&session).is_none() || origin(&session) != origin(base) {
        return Err(malformed("the upload's start named a place other than the API's to send the file to"));
    }
    let reply = send_ok(
        credential,
        || {
            client
                .post(&session)
                .header("X-Goog-Upload-Command", "upload, finalize")
                .header("X-Goog-Upload-Offset", "0")
                .header(reqwest::header::CONTENT_TYPE, mime)
                .header(reqwest::header::CONTENT_LENGTH, len)
                .body(body())
        },
        gemini::classify_error,
    )
    .await?;
    let file = json_of(&reply)?;
    file.get("file").cloned().ok_or_else(|| malformed("the finished upload named no file"))
}

/// Fetches the Gemini API file `name` (`files/…`) at `base` until it is `ACTIVE` (a video is
/// `PROCESSING` for a while after its upload), at most `patience`; its resource.
pub(crate) async fn files_active(
    client: &reqwest::Client,
    credential: &Credential,
    base: &str,
    mut file: Value,
    patience: std::time::Duration,
) -> Result<Value, ModelError> {
    let started = tokio::time::Instant::now();
    loop {
        match file.get("state").and_then(Value::as_str) {
            None | Some("ACTIVE") | Some("STATE_UNSPECIFIED") => return Ok(file),
            Some("FAILED") => return Err(malformed("the uploaded file failed the API's processing")),
            Some(_) if started.elapsed() >= patience => {
                return Err(ModelError::new(ErrorKind::Timeout, "an uploaded file was still being processed"))
            }
            Some(_) => {}
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let name =
            file.get("name").and_then(Value::as_str).ok_or_else(|| malformed("an uploaded file without a name"))?;
        let url = format!("{base}/v1beta/{name}");
        file = json_of(&send_ok(credential, || client.get(&url), gemini::classify_error).await?)?;
    }
}

/// Jobs of the Gemini API's batch mode: small ones with their requests inline, larger ones
/// from a JSONL file uploaded through the Files API (resumable protocol), answered in a file.
pub struct GeminiJobs {
    client: reqwest::Client,
    /// The base URL (uploads and downloads go under it, beside `/v1beta`).
    base: String,
    root: String,
    model: String,
    model_id: String,
    credential: Credential,
    limits: JobLimits,
}

impl GeminiJobs {
    /// Jobs at `base` (`https://generativelanguage.googleapis.com`, or a simulator) for `model`.
    pub fn new(client: reqwest::Client, base: &reqwest::Url, model: &str, key: Option<Secret>) -> Self {
        let credential = key.map_or(Credential::None, |k| Credential::Key(k, Some("x-goog-api-key")));
        let base = base.as_str().trim_end_matches('/').to_string();
        let root = format!("{base}/v1beta");
        Self {
            client,
            base,
            root,
            model: model.to_string(),
            model_id: format!("gemini/{model}"),
            credential,
            limits: GEMINI_LIMITS,
        }
    }

    /// Smaller jobs than the provider allows.
    pub fn with_limits(mut self, limits: JobLimits) -> Self {
        self.limits = limits;
        self
    }

    async fn call(&self, post: Option<&Value>, path: &str) -> Result<Value, ModelError> {
        let url = format!("{}/{path}", self.root);
        let bytes = post.map(|b| bytes::Bytes::from(serde_json::to_vec(b).unwrap_or_default()));
        let reply = send_ok(
            &self.credential,
            || match &bytes {
                Some(body) => json_post(&self.client, &url, body),
                None => self.client.get(&url),
            },
            gemini::classify_error,
        )
        .await?;
        json_of(&reply)
    }

    /// Uploads a job's input file; its name (`files/…`).
    async fn upload(&self, name: &str, input: &JobInput) -> Result<String, ModelError> {
        let file =
            files_upload(&self.client, &self.credential, &self.base, name, "application/jsonl", input.len, || {
                reqwest::Body::wrap_stream(input.stream())
            })
            .await?;
        file.get("name")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| malformed("the finished upload named no file"))
    }

    /// A results file's bytes.
    /// A file's lines, each handed over as it is downloaded.
    async fn download_lines(&self, file: &str, each: &mut (dyn FnMut(&[u8]) + Send)) -> Result<(), ModelError> {
        // Where google-genai's `files.download` asks.
        let url = format!("{}/{file}:download?alt=media", self.root);
        lines_ok(&self.credential, || self.client.get(&url), gemini::classify_error, each).await
    }

    /// The batch's own fields: an operation carries them in `metadata`.
    fn batch_of(v: &Value) -> &Value {
        v.get("metadata").filter(|m| m.get("state").is_some()).unwrap_or(v)
    }

    fn job_ref(v: &Value) -> Result<JobRef, ModelError> {
        let b = Self::batch_of(v);
        let name = b.get("name").or_else(|| v.get("name")).and_then(Value::as_str);
        let name = name.ok_or_else(|| malformed("a batch without a name"))?;
        Ok(JobRef { id: name.to_string(), file: None })
    }
}

fn gemini_state(state: &str) -> JobState {
    match state {
        "BATCH_STATE_PENDING" | "JOB_STATE_PENDING" | "JOB_STATE_QUEUED" => JobState::Pending,
        "BATCH_STATE_RUNNING" | "JOB_STATE_RUNNING" => JobState::Running,
        "BATCH_STATE_SUCCEEDED" | "JOB_STATE_SUCCEEDED" => JobState::Succeeded,
        "BATCH_STATE_FAILED" | "JOB_STATE_FAILED" => JobState::Failed,
        "BATCH_STATE_CANCELLED" | "JOB_STATE_CANCELLED" => JobState::Cancelled,
        "BATCH_STATE_EXPIRED" | "JOB_STATE_EXPIRED" => JobState::Expired,
        _ => JobState::Running,
    }
}

/// One request's result in a Gemini job's answer (inline or a results file line): its response
/// or its error.
fn gemini_item(item: &Value) -> Result<weir_core::ModelResponse, ModelError> {
    match (item.get("response"), item.get("error")) {
        (_, Some(err)) if !err.is_null() => Err(gemini_item_error(err)),
        (Some(resp), _) => gemini::parse_response(&serde_json::to_vec(resp).unwrap_or_default()),
        _ => Err(malformed("a result with neither response nor error")),
    }
}

/// A Gemini `google.rpc.Status` of one failed request, classified by its HTTP-like code.
fn gemini_item_error(err: &Value) -> ModelError {
    let code = err.get("code").and_then(Value::as_u64).unwrap_or(500) as u16;
    let body = serde_json::to_vec(&json!({"error": err})).unwrap_or_default();
    gemini::classify_error(code, &reqwest::header::HeaderMap::new(), &body)
}

#[async_trait::async_trait]
impl JobApi for GeminiJobs {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn limits(&self) -> JobLimits {
        self.limits
    }

    /// A line of the input file (`{"key", "request"}`); a job small enough to go inline is
    /// rewritten as the inline form wants it.
    fn line(&self, key: &str, request: &ModelRequest) -> Result<Vec<u8>, ModelError> {
        let line = json!({"key": key, "request": GeminiHandler::body(request)});
        json_line(&line)
    }

    async fn submit(&self, name: &str, input: &JobInput) -> Result<JobRef, ModelError> {
        let create = format!("models/{}:batchGenerateContent", self.model);
        if input.len > GEMINI_INLINE_MAX as u64 {
            let file = self.upload(name, input).await?;
            let body = json!({"batch": {"displayName": name, "inputConfig": {"fileName": file}}});
            let op = self.call(Some(&body), &create).await?;
            return Ok(JobRef { file: Some(file), ..Self::job_ref(&op)? });
        }
        let lines = input.read().await.map_err(|e| local_input(input, e))?;
        let mut requests = Vec::with_capacity(input.count);
        for line in lines.split(|c| *c == b'\n').filter(|l| !l.is_empty()) {
            let mut v = serde_json::from_slice::<Value>(line).map_err(|e| malformed(&e.to_string()))?;
            let key = v.get_mut("key").map(Value::take).unwrap_or(Value::Null);
            let request = v.get_mut("request").map(Value::take).unwrap_or(Value::Null);
            requests.push(json!({"request": request, "metadata": {"key": key}}));
        }
        let body = json!({"batch": {"displayName": name, "inputConfig": {"requests": {"requests": requests}}}});
        let op = self.call(Some(&body), &create).await?;
        Self::job_ref(&op)
    }

    async fn find(&self, sought: &Sought) -> Result<Option<JobRef>, ModelError> {
        let name = sought.name.as_str();
        let mut token: Option<String> = None;
        loop {
            let path = match &token {
                Some(t) => format!("batches?pageSize=100&pageToken={t}"),
                None => "batches?pageSize=100".to_string(),
            };
            let page = self.call(None, &path).await?;
            let ops = page.get("operations").or_else(|| page.get("batches")).and_then(Value::as_array);
            for op in ops.into_iter().flatten() {
                if Self::batch_of(op).get("displayName").and_then(Value::as_str) == Some(name) {
                    return Self::job_ref(op).map(Some);
                }
            }
            match page.get("nextPageToken").and_then(Value::as_str).filter(|t| !t.is_empty()) {
                Some(t) => token = Some(t.to_string()),
                None => return Ok(None),
            }
        }
    }

    async fn status(&self, job: &JobRef) -> Result<JobStatus, ModelError> {
        let op = self.call(None, &job.id).await?;
        let b = Self::batch_of(&op);
        let count = |k: &str| {
            b.pointer(&format!("/batchStats/{k}"))
                .and_then(|v| v.as_u64().or_else(|| v.as_str().and_then(|s| s.parse().ok())))
                .unwrap_or(0)
        };
        let state = gemini_state(b.get("state").and_then(Value::as_str).unwrap_or(""));
        let message = op.pointer("/error/message").and_then(Value::as_str).map(str::to_string);
        Ok(JobStatus {
            state,
            total: count("requestCount"),
            completed: count("successfulRequestCount"),
            failed: count("failedRequestCount"),
            message,
            described: Some(Arc::new(op)),
        })
    }

    async fn results(
        &self,
        job: &JobRef,
        status: &JobStatus,
        each: &mut (dyn FnMut(JobResult) + Send),
    ) -> Result<(), ModelError> {
        let op = match &status.described {
            Some(op) => op.clone(),
            None => Arc::new(self.call(None, &job.id).await?),
        };
        let file = op
            .pointer("/response/responsesFile")
            .or_else(|| op.pointer("/metadata/output/responsesFile"))
            .and_then(Value::as_str);
        if let Some(file) = file {
            // A line that cannot be read names no key: its record is missing and tried again.
            let mut unread = 0usize;
            let parse = |l: &[u8]| {
                let item = serde_json::from_slice::<Value>(l).ok()?;
                let key = item.get("key").and_then(Value::as_str)?.to_string();
                Some((key, gemini_item(&item)))
            };
            self.download_lines(file, &mut result_lines(parse, each, &mut unread)).await?;
            unreadable(&job.id, unread);
            return Ok(());
        }
        let inlined = op
            .pointer("/response/inlinedResponses/inlinedResponses")
            .or_else(|| op.pointer("/metadata/output/inlinedResponses/inlinedResponses"))
            .and_then(Value::as_array);
        for item in inlined.into_iter().flatten() {
            let Some(key) = item.pointer("/metadata/key").and_then(Value::as_str) else { continue };
            each((key.to_string(), gemini_item(item)));
        }
        Ok(())
    }

    async fn cancel(&self, job: &JobRef) -> Result<(), ModelError> {
        self.call(Some(&json!({})), &format!("{}:cancel", job.id)).await.map(|_| ())
    }

    async fn clean_up(&self, job: &JobRef) {
        if let Some(file) = &job.file {
            let url = format!("{}/{file}", self.root);
            if let Err(e) = self.credential.send(|| self.client.delete(&url)).await {
                tracing::debug!("could not delete batch input file {file}: {e}");
            }
        }
    }
}

/// Jobs of Vertex AI's `batchPredictionJobs` for a Gemini or text-embedding model: each job's
/// input is streamed to the staging bucket as JSONL, and its output read line by line from the
/// directory Vertex AI writes.
pub struct VertexJobs {
    client: reqwest::Client,
    /// `{base}/v1`: job names (`projects/…/batchPredictionJobs/ID`) follow it.
    api: String,
    /// `{base}/v1/projects/P/locations/L`.
    site: String,
    model: String,
    model_id: String,
    credential: Credential,
    staging: Arc<dyn JobStaging>,
    limits: JobLimits,
    /// Jobs of a text-embedding model: `{"content"}` instances, answered by instance.
    embed: bool,
}

impl VertexJobs {
    /// Jobs at `site` (`{base}/v1/projects/P/locations/L`) for the publisher model `model`,
    /// staged in `staging`.
    pub fn new(
        client: reqwest::Client,
        site: String,
        model: &str,
        credential: Credential,
        staging: Arc<dyn JobStaging>,
    ) -> Self {
        let api = site.split("/projects/").next().unwrap_or(&site).to_string();
        Self {
            client,
            api,
            site,
            model: model.to_string(),
            model_id: format!("vertex_ai/{model}"),
            credential,
            staging,
            limits: VERTEX_LIMITS,
            embed: false,
        }
    }

    /// Jobs of a text-embedding model (`text-embedding-005`, …), each record's text one
    /// `{"content"}` instance. Their output echoes the instance, not a key of weir's, so
    /// records are matched to answers by their text ([`JobApi::answer_key`]).
    pub fn embeddings(mut self) -> Self {
        self.embed = true;
        self.limits = VERTEX_EMBED_LIMITS;
        self
    }

    /// Smaller jobs than the provider allows.
    pub fn with_limits(mut self, limits: JobLimits) -> Self {
        self.limits = limits;
        self
    }

    async fn call(&self, post: Option<&Value>, url: &str) -> Result<Value, ModelError> {
        let bytes = post.map(|b| bytes::Bytes::from(serde_json::to_vec(b).unwrap_or_default()));
        let reply = send_ok(
            &self.credential,
            || match &bytes {
                Some(body) => json_post(&self.client, url, body),
                None => self.client.get(url),
            },
            gemini::classify_error,
        )
        .await?;
        json_of(&reply)
    }

    fn job_ref(v: &Value) -> Result<JobRef, ModelError> {
        let name = v.get("name").and_then(Value::as_str).ok_or_else(|| malformed("a job without a name"))?;
        let input = v.pointer("/inputConfig/gcsSource/uris/0").and_then(Value::as_str).map(str::to_string);
        Ok(JobRef { id: name.to_string(), file: input })
    }

    /// The directory of a job's input and output in the staging bucket.
    fn dir(name: &str) -> String {
        format!("weir-jobs/{name}")
    }
}

fn vertex_state(state: &str) -> JobState {
    match state {
        "JOB_STATE_QUEUED" | "JOB_STATE_PENDING" => JobState::Pending,
        "JOB_STATE_SUCCEEDED" => JobState::Succeeded,
        "JOB_STATE_PARTIALLY_SUCCEEDED" => JobState::PartiallySucceeded,
        "JOB_STATE_FAILED" => JobState::Failed,
        "JOB_STATE_CANCELLED" => JobState::Cancelled,
        "JOB_STATE_EXPIRED" => JobState::Expired,
        // Running, cancelling, updating, paused (a paused job may resume, so it is waited for).
        _ => JobState::Running,
    }
}

/// The `status` of a Vertex output line that failed (`"Bad Request: {json error}"`),
/// classified by the HTTP code of the error it quotes; an unknown one may pass if tried again.
fn vertex_item_error(status: &str) -> ModelError {
    let quoted = status.find('{').and_then(|i| serde_json::from_str::<Value>(&status[i..]).ok());
    let err = quoted.map(|v| v.get("error").cloned().unwrap_or(v));
    match err.as_ref().and_then(|e| e.get("code")).and_then(Value::as_u64) {
        Some(_) => gemini_item_error(err.as_ref().unwrap_or(&Value::Null)),
        None => ModelError::new(ErrorKind::Server, format!("batch job: {}", clip(status))),
    }
}

/// One line of a Vertex job's output: the echoed `key`, and the answer or the error.
fn vertex_result(line: &[u8]) -> Option<JobResult> {
    let v: Value = serde_json::from_slice(line).ok()?;
    let key = v.get("key")?.as_str()?.to_string();
    let status = v.get("status").and_then(Value::as_str).unwrap_or("");
    let result = match v.get("response") {
        Some(resp) if status.is_empty() && !resp.is_null() => {
            gemini::parse_response(&serde_json::to_vec(resp).unwrap_or_default())
        }
        _ if !status.is_empty() => Err(vertex_item_error(status)),
        _ => Err(malformed("a result with neither response nor status")),
    };
    Some((key, result))
}

/// The answer key of a Vertex embedding instance: a digest of its text (the output echoes the
/// instance, and identical texts have identical embeddings).
fn content_key(content: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, content.as_bytes());
    let hex: String = d.as_ref()[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("#{hex}")
}

/// One line of a Vertex embedding job's output (`{"instance", "predictions", "status"}`),
/// keyed by its instance's text.
fn vertex_embed_result(line: &[u8]) -> Option<JobResult> {
    let v: Value = serde_json::from_slice(line).ok()?;
    let key = content_key(v.pointer("/instance/content")?.as_str()?);
    let status = v.get("status").and_then(Value::as_str).unwrap_or("");
    let result = match v.get("predictions") {
        Some(p) if status.is_empty() && p.is_array() => {
            let body = serde_json::to_vec(&json!({"predictions": p})).unwrap_or_default();
            crate::embed::parse(crate::embed::EmbedApi::Vertex, &body, &["x"])
                .and_then(|mut v| v.pop().unwrap_or_else(|| Err(malformed("an embedding answer with no vector"))))
        }
        _ if !status.is_empty() => Err(vertex_item_error(status)),
        _ => Err(malformed("a result with neither predictions nor status")),
    };
    Some((key, result))
}

#[async_trait::async_trait]
impl JobApi for VertexJobs {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn limits(&self) -> JobLimits {
        self.limits
    }

    fn line(&self, key: &str, request: &ModelRequest) -> Result<Vec<u8>, ModelError> {
        // Vertex echoes every key of an input line but `request` with its answer; an embedding
        // instance is sent as the model takes it, and echoed whole.
        let line = match self.embed {
            true => json!({"content": request.prompt}),
            false => json!({"key": key, "request": GeminiHandler::body(request)}),
        };
        json_line(&line)
    }

    fn answer_key(&self, _key: &str, line: &[u8]) -> Option<String> {
        if !self.embed {
            return None;
        }
        let v: Value = serde_json::from_slice(line).ok()?;
        Some(content_key(v.get("content")?.as_str()?))
    }

    async fn submit(&self, name: &str, job_input: &JobInput) -> Result<JobRef, ModelError> {
        let input = format!("{}/input.jsonl", Self::dir(name));
        self.staging.put(&input, job_input).await?;
        let body = json!({
            "displayName": name,
            "model": format!("publishers/google/models/{}", self.model),
            "inputConfig": {"instancesFormat": "jsonl", "gcsSource": {"uris": [self.staging.url_of(&input)]}},
            "outputConfig": {"predictionsFormat": "jsonl",
                "gcsDestination": {"outputUriPrefix": self.staging.url_of(&format!("{}/output", Self::dir(name)))}},
        });
        let job = self.call(Some(&body), &format!("{}/batchPredictionJobs", self.site)).await?;
        Self::job_ref(&job)
    }

    async fn find(&self, sought: &Sought) -> Result<Option<JobRef>, ModelError> {
        let name = sought.name.as_str();
        let mut token: Option<String> = None;
        loop {
            let mut url = format!("{}/batchPredictionJobs?pageSize=100", self.site);
            if let Some(t) = &token {
                url.push_str(&format!("&pageToken={t}"));
            }
            let page = self.call(None, &url).await?;
            let jobs = page.get("batchPredictionJobs").and_then(Value::as_array);
            for job in jobs.into_iter().flatten() {
                if job.get("displayName").and_then(Value::as_str) == Some(name) {
                    return Self::job_ref(job).map(Some);
                }
            }
            match page.get("nextPageToken").and_then(Value::as_str).filter(|t| !t.is_empty()) {
                Some(t) => token = Some(t.to_string()),
                None => return Ok(None),
            }
        }
    }

    async fn status(&self, job: &JobRef) -> Result<JobStatus, ModelError> {
        let v = self.call(None, &format!("{}/{}", self.api, job.id)).await?;
        // int64 counts are JSON strings; an unknown incomplete count is -1.
        let count = |k: &str| {
            v.pointer(&format!("/completionStats/{k}"))
                .and_then(|x| x.as_i64().or_else(|| x.as_str().and_then(|s| s.parse().ok())))
                .map_or(0, |n| n.max(0) as u64)
        };
        let (completed, failed) = (count("successfulCount"), count("failedCount"));
        Ok(JobStatus {
            state: vertex_state(v.get("state").and_then(Value::as_str).unwrap_or("")),
            total: completed + failed + count("incompleteCount"),
            completed,
            failed,
            message: v.pointer("/error/message").and_then(Value::as_str).map(str::to_string),
            described: Some(Arc::new(v)),
        })
    }

    async fn results(
        &self,
        job: &JobRef,
        status: &JobStatus,
        each: &mut (dyn FnMut(JobResult) + Send),
    ) -> Result<(), ModelError> {
        let v = match &status.described {
            Some(v) => v.clone(),
            None => Arc::new(self.call(None, &format!("{}/{}", self.api, job.id)).await?),
        };
        // A job that wrote nothing (failed at once, cancelled early) has no output directory.
        let Some(dir) = v.pointer("/outputInfo/gcsOutputDirectory").and_then(Value::as_str) else {
            return Ok(());
        };
        let parse = if self.embed { vertex_embed_result } else { vertex_result };
        let mut unread = 0usize;
        self.staging.read_lines(dir, &mut result_lines(parse, each, &mut unread)).await?;
        unreadable(&job.id, unread);
        Ok(())
    }

    async fn cancel(&self, job: &JobRef) -> Result<(), ModelError> {
        self.call(Some(&json!({})), &format!("{}/{}:cancel", self.api, job.id)).await.map(|_| ())
    }

    /// Deletes the staged input; the output directory stays (a run that stops before writing
    /// its rows reads it again when resumed).
    async fn clean_up(&self, job: &JobRef) {
        if let Some(input) = &job.file {
            self.staging.delete(input).await;
        }
    }
}

/// Anthropic's Message Batches limits: 100,000 requests and 256 MB per batch (weir keeps the
/// body a little under, for the JSON around the requests).
pub const ANTHROPIC_LIMITS: JobLimits = JobLimits { max_lines: 100_000, max_bytes: 250 * 1000 * 1000 };

/// How far a provider's clock may be behind this machine's when a batch is looked up by its
/// creation time ([`AnthropicJobs`]' `find`).
const CLOCK_SLACK_SECS: u64 = 120;

/// Anthropic's Message Batches (`POST {base}/v1/messages/batches`): the requests go inline as
/// `{"custom_id", "params"}` items, the batch is polled, and its results read as JSON lines.
/// A batch has no name of its own, so a batch made but not recorded is found by its size and
/// creation time (see [`Sought`]).
#[derive(Debug)]
pub struct AnthropicJobs {
    client: reqwest::Client,
    /// `{base}/v1/messages/batches`.
    root: String,
    online: crate::anthropic::AnthropicHandler,
    model_id: String,
    credential: Credential,
    limits: JobLimits,
}

/// The `custom_id` of the request keyed `key`: the key itself when the API takes it (1 to 64 of
/// letters, digits, `_` and `-`), else `k_` and a digest of it (keys are record ids, which may
/// hold any character). Keys that start with `k_` are digested too, so no two keys share an id.
fn custom_id(key: &str) -> std::borrow::Cow<'_, str> {
    let takes = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
    if !key.is_empty() && key.len() <= 64 && !key.starts_with("k_") && key.bytes().all(takes) {
        return key.into();
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    format!("k_{}", hex::encode(&digest.as_ref()[..20])).into()
}

impl AnthropicJobs {
    /// Batches at `base` (the API root, as for online calls; `client` sends the API version,
    /// see [`crate::anthropic::client`]) for `model`.
    pub fn new(client: reqwest::Client, base: &reqwest::Url, model: &str, key: Option<Secret>) -> Self {
        let online = crate::anthropic::AnthropicHandler::new(client.clone(), base, model, key.clone());
        let credential = key.map_or(Credential::None, |k| Credential::Key(k, Some("x-api-key")));
        let root = format!("{}/v1/messages/batches", base.as_str().trim_end_matches('/'));
        let model_id = format!("anthropic/{model}");
        Self { client, root, online, model_id, credential, limits: ANTHROPIC_LIMITS }
    }

    /// Smaller batches than the API allows.
    pub fn with_limits(mut self, limits: JobLimits) -> Self {
        self.limits = limits;
        self
    }

    async fn get(&self, url: &str) -> Result<Value, ModelError> {
        let reply = send_ok(&self.credential, || self.client.get(url), crate::anthropic::classify_error).await?;
        json_of(&reply)
    }

    fn job_ref(v: &Value) -> Result<JobRef, ModelError> {
        let id = v.get("id").and_then(Value::as_str).ok_or_else(|| malformed("a message batch without an id"))?;
        Ok(JobRef { id: id.to_string(), file: None })
    }

    /// Seconds since the Unix epoch of a batch's `created_at` (RFC 3339), if readable.
    fn created(v: &Value) -> Option<u64> {
        let text = v.get("created_at")?.as_str()?;
        let at = humantime::parse_rfc3339_weak(text.trim_end_matches('Z')).ok()?;
        at.duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs())
    }

    /// A batch's requests by what became of them: (succeeded, errored, canceled, expired,
    /// processing).
    fn counts(v: &Value) -> [u64; 5] {
        let n = |k: &str| v.pointer(&format!("/request_counts/{k}")).and_then(Value::as_u64).unwrap_or(0);
        [n("succeeded"), n("errored"), n("canceled"), n("expired"), n("processing")]
    }
}

/// One line of a message batch's results: its `custom_id` and the message or why there is none.
fn anthropic_result(line: &[u8]) -> Option<JobResult> {
    let v: Value = serde_json::from_slice(line).ok()?;
    let key = v.get("custom_id")?.as_str()?.to_string();
    let result = v.get("result")?;
    let outcome = match result.get("type")?.as_str()? {
        "succeeded" => {
            let message = serde_json::to_vec(result.get("message")?).unwrap_or_default();
            crate::anthropic::parse_response(&message)
        }
        "errored" => {
            // `{"type": "error", "error": {"type", "message"}}`, read as the online error body.
            let body = serde_json::to_vec(result.get("error").unwrap_or(&Value::Null)).unwrap_or_default();
            let kind = result.pointer("/error/error/type").and_then(Value::as_str).unwrap_or("");
            let status = match kind {
                "invalid_request_error" => 400,
                "authentication_error" => 401,
                "permission_error" => 403,
                "not_found_error" => 404,
                "request_too_large" => 413,
                "rate_limit_error" => 429,
                "overloaded_error" => 529,
                _ => 500,
            };
            Err(crate::anthropic::classify_error(status, &reqwest::header::HeaderMap::new(), &body))
        }
        // Not run before the batch was cancelled or expired: a retryable kind, so that the
        // record goes to a follow-up batch, or to an error row a later run tries again.
        other @ ("canceled" | "expired") => {
            Err(ModelError::new(ErrorKind::Server, format!("not run: the batch's request was {other}")))
        }
        _ => return None,
    };
    Some((key, outcome))
}

#[async_trait::async_trait]
impl JobApi for AnthropicJobs {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn limits(&self) -> JobLimits {
        self.limits
    }

    fn line(&self, key: &str, request: &ModelRequest) -> Result<Vec<u8>, ModelError> {
        let line = json!({"custom_id": custom_id(key), "params": self.online.body(request, false)?});
        json_line(&line)
    }

    fn answer_key(&self, key: &str, _line: &[u8]) -> Option<String> {
        match custom_id(key) {
            std::borrow::Cow::Owned(id) => Some(id),
            std::borrow::Cow::Borrowed(_) => None,
        }
    }

    async fn submit(&self, name: &str, input: &JobInput) -> Result<JobRef, ModelError> {
        use futures::StreamExt;
        // `{"requests": [line, line, …]}`, streamed from the input: its lines are JSON objects
        // (a raw newline occurs only between them), so each newline becomes a comma, and the
        // last one a space.
        let (head, tail) = (&b"{\"requests\":["[..], &b"]}"[..]);
        let len = head.len() as u64 + input.len + tail.len() as u64;
        let body = || {
            let mut at = 0u64;
            let end = input.len;
            let lines = input.stream().map(move |chunk| {
                chunk.map(|c| {
                    let mut c = c.to_vec();
                    for b in c.iter_mut() {
                        at += 1;
                        if *b == b'\n' {
                            *b = if at == end { b' ' } else { b',' };
                        }
                    }
                    bytes::Bytes::from(c)
                })
            });
            let part = |b: &'static [u8]| futures::stream::once(futures::future::ready(Ok(bytes::Bytes::from(b))));
            reqwest::Body::wrap_stream(part(head).chain(lines).chain(part(tail)))
        };
        let reply = send_ok(
            &self.credential,
            || {
                self.client
                    .post(&self.root)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .header(reqwest::header::CONTENT_LENGTH, len)
                    .body(body())
            },
            crate::anthropic::classify_error,
        )
        .await?;
        let batch = json_of(&reply)?;
        let job = Self::job_ref(&batch)?;
        tracing::debug!("message batch {} made for {name}", job.id);
        Ok(job)
    }

    async fn find(&self, sought: &Sought) -> Result<Option<JobRef>, ModelError> {
        // Newest first. Without a time to start from, only whether the API answers is learnt.
        let mut after: Option<String> = None;
        let mut best: Option<(u64, JobRef)> = None;
        for _page in 0..20 {
            let url = match &after {
                Some(a) => format!("{}?limit=100&after_id={a}", self.root),
                None => format!("{}?limit=100", self.root),
            };
            let page = self.get(&url).await?;
            let Some(since) = sought.since else { return Ok(None) };
            let from = since.saturating_sub(CLOCK_SLACK_SECS);
            let data = page.get("data").and_then(Value::as_array).cloned().unwrap_or_default();
            let mut older = false;
            for b in &data {
                let Some(created) = Self::created(b) else { continue };
                if created < from {
                    older = true;
                    continue;
                }
                let total: u64 = Self::counts(b).iter().sum();
                let id = b.get("id").and_then(Value::as_str).unwrap_or("");
                if total == sought.count && !id.is_empty() && !sought.known.iter().any(|k| k == id) {
                    // The earliest made after planning is the one this run made first.
                    if best.as_ref().is_none_or(|(t, _)| created < *t) {
                        best = Some((created, Self::job_ref(b)?));
                    }
                }
            }
            let more = page.get("has_more").and_then(Value::as_bool).unwrap_or(false);
            let last = page.get("last_id").and_then(Value::as_str).map(str::to_string);
            match last {
                Some(last) if more && !older => after = Some(last),
                _ => break,
            }
        }
        if let Some((_, job)) = &best {
            tracing::info!(
                "message batch {} matches {} ({} requests, made after it was planned)",
                job.id,
                sought.name,
                sought.count
            );
        }
        Ok(best.map(|(_, job)| job))
    }

    async fn status(&self, job: &JobRef) -> Result<JobStatus, ModelError> {
        let b = self.get(&format!("{}/{}", self.root, job.id)).await?;
        let [succeeded, errored, canceled, expired, processing] = Self::counts(&b);
        let state = match b.get("processing_status").and_then(Value::as_str).unwrap_or("") {
            "ended" if b.get("cancel_initiated_at").is_some_and(|c| !c.is_null()) => JobState::Cancelled,
            "ended" if expired > 0 => JobState::Expired,
            "ended" => JobState::Succeeded,
            _ => JobState::Running,
        };
        let message = match state {
            JobState::Cancelled => Some(format!("cancelled; {canceled} requests were not run")),
            JobState::Expired => Some(format!("expired (24 h) with {expired} requests not run")),
            _ => None,
        };
        Ok(JobStatus {
            state,
            total: succeeded + errored + canceled + expired + processing,
            completed: succeeded,
            failed: errored + canceled + expired,
            message,
            described: Some(Arc::new(b)),
        })
    }

    async fn results(
        &self,
        job: &JobRef,
        _status: &JobStatus,
        each: &mut (dyn FnMut(JobResult) + Send),
    ) -> Result<(), ModelError> {
        // Read at the API's own route for them, not at `results_url`: the key goes only to the
        // host the run was pointed at.
        let url = format!("{}/{}/results", self.root, job.id);
        let mut unread = 0usize;
        {
            let mut line = result_lines(anthropic_result, each, &mut unread);
            lines_ok(&self.credential, || self.client.get(&url), crate::anthropic::classify_error, &mut line).await?;
        }
        unreadable(&job.id, unread);
        Ok(())
    }

    async fn cancel(&self, job: &JobRef) -> Result<(), ModelError> {
        let url = format!("{}/{}/cancel", self.root, job.id);
        send_ok(&self.credential, || self.client.post(&url), crate::anthropic::classify_error).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Record ids the Messages Batches API does not take as `custom_id`s get `k_` and a digest;
    /// no two keys share an id (a plain key that looks like a digest is digested too).
    #[test]
    fn custom_ids_are_what_anthropic_takes_and_unique() {
        assert_eq!(custom_id("r-17_a"), "r-17_a");
        let taken = |id: &str| {
            (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        };
        let keys = ["a b", "#7", "~0123", "k_1", &"x".repeat(65), "é", ""];
        let ids: std::collections::HashSet<String> = keys.iter().map(|k| custom_id(k).into_owned()).collect();
        assert_eq!(ids.len(), keys.len());
        assert!(ids.iter().all(|id| taken(id) && id.starts_with("k_")), "{ids:?}");
    }

    /// A message batch's result lines: a message, an error read as the online error, and
    /// requests not run (retryable, for a follow-up batch).
    #[test]
    fn anthropic_result_lines() {
        let ok = br#"{"custom_id":"a","result":{"type":"succeeded","message":{"id":"m","type":"message","role":"assistant","model":"claude-x","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":3,"output_tokens":1}}}}"#;
        let (key, r) = anthropic_result(ok).unwrap();
        let r = r.unwrap();
        assert_eq!((key.as_str(), r.text.as_str(), r.finish_reason.as_str()), ("a", "hi", "stop"));
        assert_eq!((r.usage.prompt_tokens, r.usage.output_tokens), (3, 1));
        let bad = br#"{"custom_id":"b","result":{"type":"errored","error":{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: too large"}}}}"#;
        let e = anthropic_result(bad).unwrap().1.unwrap_err();
        assert_eq!(e.kind, ErrorKind::BadRequest, "{e}");
        assert!(e.message.contains("max_tokens: too large"), "{e}");
        let busy = br#"{"custom_id":"c","result":{"type":"errored","error":{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}}}"#;
        assert!(anthropic_result(busy).unwrap().1.unwrap_err().kind.is_retryable());
        for not_run in ["canceled", "expired"] {
            let line = format!(r#"{{"custom_id":"d","result":{{"type":"{not_run}"}}}}"#);
            let e = anthropic_result(line.as_bytes()).unwrap().1.unwrap_err();
            assert!(e.kind.is_retryable() && e.message.contains(not_run), "{e}");
        }
        assert!(anthropic_result(b"{\"custom_id\":\"e\"}").is_none());
        assert!(anthropic_result(b"not json").is_none());
    }

    #[tokio::test]
    async fn multipart_streams_the_file_between_its_parts() {
        use futures::TryStreamExt;
        let path = std::env::temp_dir().join(format!("weir-multipart-{}.jsonl", std::process::id()));
        std::fs::write(&path, b"{\"x\":1}\n{\"x\":2}\n").unwrap();
        let input = JobInput { path: path.clone(), len: 16, count: 2 };
        let (body, ct, len) = multipart("batch", "a.jsonl", &input);
        let chunks: Vec<bytes::Bytes> = body.try_collect().await.unwrap();
        let text = String::from_utf8(chunks.concat()).unwrap();
        assert_eq!(text.len() as u64, len, "the declared length is the body's");
        let boundary = ct.split("boundary=").nth(1).unwrap();
        assert!(text.starts_with(&format!("--{boundary}\r\n")));
        assert!(text.ends_with(&format!("}}\n{{\"x\":2}}\n\r\n--{boundary}--\r\n")), "{text}");
        assert!(text.contains("name=\"purpose\"\r\n\r\nbatch\r\n"));
        assert!(text.contains("filename=\"a.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n{\"x\":1}\n"));
        let (_, again, _) = multipart("batch", "a.jsonl", &input);
        assert_ne!(again, ct, "each body has a boundary of its own");
        // A file gone under the run is an error of the stream, not an empty upload.
        std::fs::remove_file(&path).unwrap();
        let (body, _, _) = multipart("batch", "a.jsonl", &input);
        assert!(body.try_collect::<Vec<_>>().await.is_err());
    }

    #[test]
    fn vertex_result_lines() {
        let ok = br#"{"key":"a","status":"","processed_time":"1","request":{},"response":{"candidates":[{"content":{"parts":[{"text":"hi"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":3,"candidatesTokenCount":1}}}"#;
        let (key, r) = vertex_result(ok).unwrap();
        assert_eq!((key.as_str(), r.unwrap().text.as_str()), ("a", "hi"));
        let bad = br#"{"key":"b","status":"Bad Request: {\"error\": {\"code\": 400, \"message\": \"no\", \"status\": \"INVALID_ARGUMENT\"}}","request":{}}"#;
        let e = vertex_result(bad).unwrap().1.unwrap_err();
        assert!(!e.kind.is_retryable(), "{e:?}");
        let odd = br#"{"key":"c","status":"something broke","request":{}}"#;
        let e = vertex_result(odd).unwrap().1.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Server);
        assert!(vertex_result(br#"{"status":""}"#).is_none(), "a line without a key is not a result");
        assert_eq!(vertex_state("JOB_STATE_PARTIALLY_SUCCEEDED"), JobState::PartiallySucceeded);
        assert_eq!(vertex_state("JOB_STATE_PAUSED"), JobState::Running);
    }

    #[test]
    fn openai_result_lines() {
        let ok = br#"{"id":"r1","custom_id":"k1","response":{"status_code":200,"body":{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}},"error":null}"#;
        let (k, r) = openai_result(ok, false).unwrap();
        assert_eq!((k.as_str(), r.unwrap().text.as_str()), ("k1", "hi"));
        let limited = br#"{"custom_id":"k2","response":{"status_code":429,"body":{"error":{"message":"slow down","type":"requests"}}},"error":null}"#;
        assert_eq!(openai_result(limited, false).unwrap().1.unwrap_err().kind, ErrorKind::RateLimited);
        let expired =
            br#"{"custom_id":"k3","response":null,"error":{"code":"batch_expired","message":"not done in time"}}"#;
        assert_eq!(openai_result(expired, false).unwrap().1.unwrap_err().kind, ErrorKind::Server);
        assert!(openai_result(b"{not json", false).is_none());
    }
}
