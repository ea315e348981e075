//! The HTTP server: routing, the request life cycle (auth → parse → overload → quota → fault →
//! latency → answer) and clean shutdown.
//!
//! It is built on hyper directly rather than a framework because two faults need control a
//! framework hides: a connection reset (the service fails, hyper drops the connection without an
//! answer) and a truncated stream (the body fails mid-way, so the chunked encoding never ends).

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::config::{OverloadMode, SimConfig};
use crate::gen::{count_tokens, generate, stable_hash, Generation};
use crate::proto::{self, Api, Ending, ErrorReply, SimRequest, StreamFraming};
use crate::quota::Quotas;
use crate::stats::{Stats, StatsSnapshot, FAULT_KINDS};

use crate::serve::accept_loop;
pub(crate) use crate::serve::Body;

struct State {
    config: SimConfig,
    stats: Arc<Stats>,
    quotas: Mutex<Quotas>,
    counter: AtomicU64,
    any_fault: bool,
    /// The last `config.capture_requests` model requests, oldest first.
    captured: Mutex<std::collections::VecDeque<Captured>>,
    /// The last `config.capture_requests` streamed answers' timings, oldest first.
    streams: Mutex<std::collections::VecDeque<StreamTiming>>,
    /// Batch-prediction files and jobs.
    jobs: crate::jobs::Jobs,
    /// The buckets of the GCS that [`SimServer::serve_gcs`] serves, where Vertex AI jobs read
    /// and write.
    gcs: Arc<crate::gcs::Store>,
}

/// A model request as it arrived, for comparing what clients send (`GET /requests`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Captured {
    /// The request path.
    pub path: String,
    /// The query string, without any `key=` (credentials are never kept).
    pub query: String,
    /// The body, parsed.
    pub body: Value,
}

/// When a streamed answer's text went out (`GET /streams`): the server's own time to first
/// token, for measuring what a client adds to it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct StreamTiming {
    /// The request's text (system and user), to match it with what the client saw.
    pub prompt: String,
    /// When the request arrived, in microseconds since the Unix epoch.
    pub received_us: u64,
    /// When the event carrying the first text was handed to the connection, in microseconds
    /// since the Unix epoch (absent when no text was sent: a block, a cut before any).
    pub first_text_us: Option<u64>,
    /// Events sent.
    pub events: u64,
}

fn unix_micros() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// A running simulator. Dropping it does not stop it; call [`SimServer::shutdown`].
pub struct SimServer {
    addr: SocketAddr,
    state: Arc<State>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The scenario is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why binding failed.
        source: io::Error,
    },
}

impl SimServer {
    /// Starts a simulator on `addr` (port 0 picks a free port; see [`SimServer::addr`]).
    pub async fn start(config: SimConfig, addr: SocketAddr) -> Result<Self, StartError> {
        config.validate()?;
        let listener = TcpListener::bind(addr).await.map_err(|source| StartError::Bind { addr, source })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind { addr, source })?;
        let any_fault = config.faults.rates().iter().any(|r| *r > 0.0);
        let state = Arc::new(State {
            quotas: Mutex::new(Quotas::new(config.quota.clone())),
            config,
            stats: Arc::new(Stats::default()),
            counter: AtomicU64::new(0),
            any_fault,
            captured: Mutex::new(std::collections::VecDeque::new()),
            streams: Mutex::new(std::collections::VecDeque::new()),
            jobs: Default::default(),
            gcs: Default::default(),
        });
        let (shutdown, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, state.clone(), handle, rx));
        Ok(Self { addr, state, shutdown, task })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, a base URL for clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serves the simulator's GCS buckets on `addr` (port 0 picks one): Vertex AI batch jobs
    /// read their input from there and write their output there, as the real ones do with
    /// Cloud Storage. Point `STORAGE_EMULATOR_HOST` at its [`GcsServer::url`].
    pub async fn serve_gcs(&self, addr: SocketAddr) -> io::Result<crate::gcs::GcsServer> {
        crate::gcs::GcsServer::serve(addr, self.state.gcs.clone()).await
    }

    /// The model requests kept by `capture_requests`, oldest first.
    pub fn captured(&self) -> Vec<Captured> {
        self.state.captured.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect()
    }

    /// What the server has seen so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.state.snapshot()
    }

    /// Stops accepting, closes every connection (hung requests included) and waits for the
    /// accept loop to end.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }
}

fn full(status: u16, headers: &[(&str, String)], content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut builder = Response::builder().status(status).header(header::CONTENT_TYPE, content_type);
    for (k, v) in headers {
        builder = builder.header(*k, v.as_str());
    }
    builder
        .body(Full::new(body.into()).map_err(|never| match never {}).boxed())
        .expect("static response parts are valid")
}

fn json_reply(status: u16, headers: &[(&str, String)], value: &Value) -> Response<Body> {
    full(status, headers, "application/json; charset=UTF-8", serde_json::to_vec(value).unwrap_or_default())
}

fn error_reply(state: &State, e: ErrorReply) -> Response<Body> {
    state.stats.status(e.status);
    json_reply(e.status, &e.headers, &e.body)
}

/// Aborts the connection without an answer: the client sees a reset.
fn reset() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "weir-sim: injected connection reset")
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, io::Error> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path();
    match (&parts.method, path) {
        (&Method::GET, "/stats") => {
            let v = serde_json::to_value(state.snapshot()).unwrap_or_default();
            return Ok(json_reply(200, &[], &v));
        }
        (&Method::POST, "/stats/reset") => {
            state.stats.reset();
            state.jobs.reset_counts();
            return Ok(json_reply(200, &[], &json!({"reset": true})));
        }
        (&Method::GET, "/healthz") => return Ok(full(200, &[], "text/plain", "ok")),
        (&Method::GET, "/requests") => {
            let c: Vec<Captured> = state.captured.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
            return Ok(json_reply(200, &[], &serde_json::to_value(c).unwrap_or_default()));
        }
        (&Method::GET, "/streams") => {
            let c: Vec<StreamTiming> =
                state.streams.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
            return Ok(json_reply(200, &[], &serde_json::to_value(c).unwrap_or_default()));
        }
        // Google's OAuth token endpoint (a service account's `token_uri`, or the refresh of an
        // `authorized_user` file) and the GCE metadata server's token route, so that Google
        // credentials can be tested offline.
        (&Method::POST, "/token") => {
            let bytes = body.collect().await.map_err(io::Error::other)?.to_bytes();
            let (status, reply) = crate::auth::token_grant(&state.config, &bytes);
            if status == 200 {
                state.stats.token_issued();
            }
            return Ok(json_reply(status, &[], &reply));
        }
        (&Method::GET, "/computeMetadata/v1/instance/service-accounts/default/token") => {
            let flavor = parts.headers.get("metadata-flavor").and_then(|v| v.to_str().ok());
            if flavor != Some("Google") {
                return Ok(full(403, &[], "text/plain", "Missing Metadata-Flavor:Google header."));
            }
            state.stats.token_issued();
            return Ok(json_reply(200, &[], &crate::auth::access_token(&state.config)));
        }
        (&Method::GET, "/v1/models") | (&Method::GET, "/models") => {
            return Ok(json_reply(
                200,
                &[],
                &json!({"object": "list", "data": [
                    {"id": "sim-1", "object": "model", "created": 0, "owned_by": "weir-sim"},
                ]}),
            ));
        }
        (&Method::GET, "/v1beta/models") => {
            return Ok(json_reply(
                200,
                &[],
                &json!({"models": [
                    {"name": "models/sim-1", "displayName": "weir sim", "supportedGenerationMethods": ["generateContent", "streamGenerateContent"]},
                ]}),
            ));
        }
        _ => {}
    }
    if path.contains("/batches")
        || path.starts_with("/v1/files")
        || path.starts_with("/v1beta/files")
        || path.starts_with("/upload/v1beta/files")
        || path.starts_with("/download/v1beta/files")
        || path.ends_with(":batchGenerateContent")
        || path.contains("/batchPredictionJobs")
    {
        let api = match path {
            _ if path.contains("/batchPredictionJobs") => Api::Vertex,
            _ if path.starts_with("/v1/messages/") => Api::Anthropic,
            _ if path.starts_with("/v1/") => Api::OpenAi,
            _ => Api::Gemini,
        };
        if let Some(refused) = refuse_key(&state, api, key_of(api, &parts).as_deref()) {
            return Ok(refused);
        }
        let bytes = body.collect().await.map_err(io::Error::other)?.to_bytes();
        let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        let request = crate::jobs::JobRequest {
            method: parts.method.as_str(),
            path,
            query: parts.uri.query(),
            content_type,
            headers: &parts.headers,
            body: &bytes,
        };
        let reply = state.jobs.handle(&state.config, request, &state.gcs);
        return Ok(match reply {
            Some(crate::jobs::Reply::Json(status, v)) => json_reply(status, &[], &v),
            Some(crate::jobs::Reply::JsonWith(status, headers, v)) => json_reply(status, &headers, &v),
            Some(crate::jobs::Reply::Bytes(b)) => full(200, &[], "application/jsonl", b),
            None => error_reply(&state, proto::error(api, 404, &format!("no route for {} {path}", parts.method))),
        });
    }
    let Some(route) = route(path, parts.uri.query()) else {
        let api = if path.contains("chat/completions") { Api::OpenAi } else { Api::Gemini };
        return Ok(error_reply(&state, proto::error(api, 404, &format!("no route for {} {path}", parts.method))));
    };
    if parts.method != Method::POST {
        return Ok(error_reply(&state, proto::error(route.api, 404, &format!("{path} takes POST"))));
    }
    let key = key_of(route.api, &parts);
    let guard = state.stats.start_request();
    if let Some(refused) = refuse_key(&state, route.api, key.as_deref()) {
        return Ok(refused);
    }
    let bytes = body.collect().await.map_err(io::Error::other)?.to_bytes();
    let limits = &state.config.predict;
    // `:predict` and embedding requests are bounded in size, as Vertex AI bounds them.
    if (route.api == Api::Predict || route.embed.is_some()) && bytes.len() as u64 > limits.max_request_bytes {
        state.stats.predict_refused();
        let msg = format!("Request payload size exceeds the limit: {} bytes.", limits.max_request_bytes);
        return Ok(error_reply(&state, proto::error(route.api, 400, &msg)));
    }
    let parsed: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            let msg = format!("Invalid JSON payload received. {e}");
            return Ok(error_reply(&state, proto::error(route.api, 400, &msg)));
        }
    };
    let keep = state.config.capture_requests;
    if keep > 0 {
        let query = parts
            .uri
            .query()
            .unwrap_or("")
            .split('&')
            .filter(|kv| !kv.is_empty() && !kv.starts_with("key="))
            .collect::<Vec<_>>()
            .join("&");
        let mut c = state.captured.lock().unwrap_or_else(|e| e.into_inner());
        c.push_back(Captured { path: path.to_string(), query, body: parsed.clone() });
        while c.len() > keep {
            c.pop_front();
        }
    }
    let request = match (route.embed, route.api) {
        (Some(form), api) => proto::parse_embed(api, form, &route.model, &parsed),
        (None, Api::Gemini | Api::Vertex) => proto::parse_gemini(route.api, &route.model, &parsed, route.stream),
        (None, Api::OpenAi) => proto::parse_openai(&parsed),
        (None, Api::Anthropic) => proto::parse_anthropic(&parsed, &route.model),
        (None, Api::Predict) => proto::parse_predict(&route.model, &parsed),
    };
    let request = match request {
        Ok(r) => r,
        Err(proto::BadRequest(msg)) => return Ok(error_reply(&state, proto::error(route.api, 400, &msg))),
    };
    let served = &state.config.models;
    if !served.is_empty() && !served.iter().any(|m| m == &request.model) {
        let msg = format!("models/{} is not found for API version v1beta, or is not supported.", request.model);
        return Ok(error_reply(&state, proto::error(route.api, 404, &msg)));
    }
    let max = if request.embed.is_some() {
        state.config.embedding.max_inputs
    } else if request.api == Api::Predict {
        state.config.predict.max_instances
    } else {
        0
    };
    if max > 0 && request.instances.len() as u64 > max {
        state.stats.predict_refused();
        let msg = format!("{} instances in one request; this endpoint takes at most {max}.", request.instances.len());
        return Ok(error_reply(&state, proto::error(route.api, 400, &msg)));
    }
    serve_model(state, request, key.unwrap_or_default(), guard).await
}

struct Route {
    api: Api,
    model: String,
    stream: Option<StreamFraming>,
    embed: Option<proto::EmbedForm>,
}

/// The API key a request carries, where its API carries it.
fn key_of(api: Api, parts: &hyper::http::request::Parts) -> Option<String> {
    match api {
        // `x-api-key`, or a bearer token (as newer Anthropic clients send the key).
        Api::Anthropic if parts.headers.contains_key("x-api-key") => {
            parts.headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::to_string)
        }
        Api::Gemini => parts
            .headers
            .get("x-goog-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .or_else(|| query_param(parts.uri.query(), "key")),
        _ => parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::to_string),
    }
}

/// The provider's refusal when keys are configured and `key` is not one of them.
fn refuse_key(state: &State, api: Api, key: Option<&str>) -> Option<Response<Body>> {
    if state.config.api_keys.is_empty() || key.is_some_and(|k| state.config.api_keys.iter().any(|a| a == k)) {
        return None;
    }
    let e = proto::auth_error(api, key.is_some());
    state.stats.auth_failure();
    Some(json_reply(e.status, &e.headers, &e.body))
}

fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| v.to_string())
    })
}

fn route(path: &str, query: Option<&str>) -> Option<Route> {
    if path == "/v1/messages" {
        return Some(Route { api: Api::Anthropic, model: String::new(), stream: None, embed: None });
    }
    if path.ends_with("/chat/completions") {
        return Some(Route { api: Api::OpenAi, model: String::new(), stream: None, embed: None });
    }
    if path == "/v1/embeddings" || path == "/embeddings" {
        let embed = Some(proto::EmbedForm::OpenAi);
        return Some(Route { api: Api::OpenAi, model: String::new(), stream: None, embed });
    }
    let (prefix, method) = path.rsplit_once(':')?;
    let segs: Vec<&str> = prefix.trim_start_matches('/').split('/').collect();
    let stream = match method {
        "generateContent" => None,
        "streamGenerateContent" => Some(if query_param(query, "alt").as_deref() == Some("sse") {
            StreamFraming::Sse
        } else {
            StreamFraming::JsonArray
        }),
        "predict" | "rawPredict" | "streamRawPredict" => {
            // `:rawPredict` passes the body to the model server as it is: here, an OpenAI
            // chat completion, which is what vLLM and most serving containers take
            // (`:streamRawPredict` the same with `"stream": true`, answered as events).
            let api = if method == "predict" { Api::Predict } else { Api::OpenAi };
            return match segs.as_slice() {
                // Claude on Vertex AI: Anthropic's Messages API at the publisher model.
                ["v1" | "v1beta1", "projects", _, "locations", _, "publishers", "anthropic", "models", model]
                    if method != "predict" =>
                {
                    Some(Route { api: Api::Anthropic, model: model.to_string(), stream: None, embed: None })
                }
                ["v1" | "v1beta1", "projects", _, "locations", _, "endpoints", id] => {
                    Some(Route { api, model: id.to_string(), stream: None, embed: None })
                }
                // A publisher model's `:predict`: Vertex AI's text embeddings.
                ["v1" | "v1beta1", "projects", _, "locations", _, "publishers", "google", "models", model]
                    if method == "predict" =>
                {
                    let embed = Some(proto::EmbedForm::Vertex);
                    Some(Route { api: Api::Vertex, model: model.to_string(), stream: None, embed })
                }
                _ => None,
            };
        }
        "batchEmbedContents" | "embedContent" => {
            let form =
                if method == "embedContent" { proto::EmbedForm::GeminiOne } else { proto::EmbedForm::GeminiBatch };
            return match segs.as_slice() {
                ["v1beta" | "v1", "models", model] => {
                    Some(Route { api: Api::Gemini, model: model.to_string(), stream: None, embed: Some(form) })
                }
                _ => None,
            };
        }
        _ => return None,
    };
    match segs.as_slice() {
        ["v1beta" | "v1", "models", model] => {
            Some(Route { api: Api::Gemini, model: model.to_string(), stream, embed: None })
        }
        ["v1" | "v1beta1", "projects", _, "locations", _, "publishers", "google", "models", model] => {
            Some(Route { api: Api::Vertex, model: model.to_string(), stream, embed: None })
        }
        _ => None,
    }
}

/// A fault chosen for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    E500,
    E503,
    Reset,
    Hang,
    Malformed,
    Truncate,
    BlockPrompt,
    BlockCandidate,
}

const FAULTS: [Fault; 8] = [
    Fault::E500,
    Fault::E503,
    Fault::Reset,
    Fault::Hang,
    Fault::Malformed,
    Fault::Truncate,
    Fault::BlockPrompt,
    Fault::BlockCandidate,
];

impl State {
    /// The counters, the batch jobs' included.
    fn snapshot(&self) -> StatsSnapshot {
        let mut snap = self.stats.snapshot();
        snap.batch_jobs = self.jobs.submitted();
        snap.batch_answered = self.jobs.answered();
        (snap.gemini_files_uploaded, snap.gemini_upload_refusals) = self.jobs.uploads();
        snap.batch_media_parts = self.jobs.media_parts();
        (snap.batch_keys, snap.batch_keys_in_two_jobs) = self.jobs.keys();
        snap
    }

    /// How many of a `:predict` request's instances its answer covers: all, unless an instance
    /// asks for `[sim:short]` (the answer stops before it) or the short rate draws one short.
    fn short_predictions(&self, req: &SimRequest, n: u64) -> usize {
        let all = req.instances.len();
        if req.chat_predict {
            // One instance, answered as an object: nothing to leave out.
            return all;
        }
        if let Some(i) = req.instances.iter().position(|i| i.prompt.contains("[sim:short]")) {
            return i;
        }
        let rate = self.config.predict.short_rate;
        if rate > 0.0 && all > 0 {
            let mut rng = SmallRng::seed_from_u64(self.config.seed ^ n.wrapping_mul(0xd1b5_4a32_d192_ed03));
            if rng.gen::<f64>() < rate {
                return all - 1;
            }
        }
        all
    }

    /// A fault forced by a `[sim:KIND]` directive in the prompt, else one drawn at the
    /// configured rates. `truncate` only applies to streams.
    fn pick_fault(&self, req: &SimRequest, n: u64) -> Option<Fault> {
        if let Some(start) = req.prompt.find("[sim:") {
            let rest = &req.prompt[start + 5..];
            if let Some(end) = rest.find(']') {
                if let Some(i) = FAULT_KINDS.iter().position(|k| *k == &rest[..end]) {
                    return Some(FAULTS[i]);
                }
            }
        }
        if !self.any_fault {
            return None;
        }
        let rates = self.config.faults.rates();
        let mut rng = SmallRng::seed_from_u64(self.config.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let draw: f64 = rng.gen();
        let mut acc = 0.0;
        for (fault, rate) in FAULTS.iter().zip(rates) {
            acc += rate;
            if draw < acc {
                if *fault == Fault::Truncate && req.stream.is_none() {
                    return None;
                }
                return Some(*fault);
            }
        }
        None
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

async fn sleep_ms(ms: f64) {
    if ms > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0)).await;
    }
}

async fn serve_model(
    state: Arc<State>,
    req: SimRequest,
    key: String,
    guard: crate::stats::InFlight,
) -> Result<Response<Body>, io::Error> {
    let cfg = &state.config;
    let n = state.counter.fetch_add(1, Relaxed);
    let id = format!("sim-{n}");

    // The hidden concurrency cap.
    let mut slow = 1.0;
    if cfg.concurrency.max_in_flight > 0 && guard.level > cfg.concurrency.max_in_flight {
        state.stats.overloaded();
        match cfg.concurrency.mode {
            OverloadMode::TooManyRequests => {
                let e = match req.api {
                    Api::OpenAi => {
                        proto::error(req.api, 429, "The server is overloaded. Please retry your request later.")
                    }
                    _ => proto::error(req.api, 429, "Resource has been exhausted (e.g. check quota)."),
                };
                return Ok(error_reply(&state, e));
            }
            OverloadMode::Unavailable => {
                let (status, msg) = match req.api {
                    Api::OpenAi => (503, "The server is overloaded or not ready yet."),
                    Api::Anthropic => (529, "Overloaded"),
                    _ => (503, "The model is overloaded. Please try again later."),
                };
                return Ok(error_reply(&state, proto::error(req.api, status, msg)));
            }
            OverloadMode::Slow => slow = guard.level as f64 / cfg.concurrency.max_in_flight as f64,
        }
    }

    // The answer is a pure function of the request and the seed.
    let seed = cfg.seed.to_le_bytes();
    let gens: Vec<Generation> = if req.instances.is_empty() {
        let limit = req.max_tokens.map(|m| m.to_le_bytes()).unwrap_or_default();
        // The answer depends on the media's content too.
        let media: Vec<u8> = req.media.iter().flat_map(|d| d.to_le_bytes()).collect();
        state.stats.media(req.media.len() as u64, req.file_uris);
        let mut fields: Vec<&[u8]> =
            vec![&seed, req.model.as_bytes(), req.prompt.as_bytes(), req.settings.as_bytes(), &limit];
        if !media.is_empty() {
            fields.push(&media);
        }
        let h = stable_hash(&fields);
        match &req.schema {
            // A fresh draw per call, so that asking again can mend a broken answer.
            Some(schema) => vec![crate::gen::shaped(schema, h, broken_draw(cfg.output.invalid_json_rate))],
            None => {
                vec![generate(h, cfg.output.min_tokens, cfg.output.max_tokens, req.max_tokens, cfg.latency.jitter_ms)]
            }
        }
    } else {
        req.instances
            .iter()
            .map(|i| {
                let h = stable_hash(&[&seed, req.model.as_bytes(), i.prompt.as_bytes(), req.settings.as_bytes()]);
                generate(h, cfg.output.min_tokens, cfg.output.max_tokens, i.max_tokens, cfg.latency.jitter_ms)
            })
            .collect()
    };
    let prompt_tokens = count_tokens(&req.prompt);
    // An embedding generates nothing; only its input is counted.
    let out_tokens: u64 = if req.embed.is_some() { 0 } else { gens.iter().map(|g| g.tokens.len() as u64).sum() };

    // Quotas.
    let usage = {
        let mut q = state.quotas.lock().unwrap_or_else(|e| e.into_inner());
        if q.unlimited() {
            None
        } else {
            match q.admit(&key, prompt_tokens + out_tokens, Instant::now()) {
                Ok(u) => Some(u),
                Err(rej) => {
                    drop(q);
                    return Ok(error_reply(&state, proto::quota_error(req.api, &req.model, &rej)));
                }
            }
        }
    };
    let limit_headers = match (&usage, req.api) {
        (Some(u), Api::OpenAi) => proto::openai_limit_headers(u),
        (Some(u), Api::Anthropic) => proto::anthropic_limit_headers(u),
        _ => Vec::new(),
    };

    let first = &gens[0];
    let fixed = (cfg.latency.fixed_ms + first.jitter_ms) * slow;
    let per_token = cfg.latency.per_token_ms * slow;

    let fault = state.pick_fault(&req, n);
    if let Some(f) = fault {
        state.stats.fault(FAULTS.iter().position(|x| *x == f).unwrap_or(0));
    }
    let mut ending = Ending::Normal;
    match fault {
        Some(Fault::E500) => {
            sleep_ms(fixed).await;
            let msg = match req.api {
                Api::OpenAi => "The server had an error while processing your request. Sorry about that!",
                _ => "An internal error has occurred. Please retry or report in https://developers.generativeai.google/guide/troubleshooting",
            };
            return Ok(error_reply(&state, proto::error(req.api, 500, msg)));
        }
        Some(Fault::E503) => {
            sleep_ms(fixed).await;
            let (status, msg) = match req.api {
                Api::OpenAi => (503, "The engine is currently overloaded, please try again later."),
                // Anthropic's overload is 529 overloaded_error.
                Api::Anthropic => (529, "Overloaded"),
                _ => (503, "The model is overloaded. Please try again later."),
            };
            return Ok(error_reply(&state, proto::error(req.api, status, msg)));
        }
        Some(Fault::Reset) => {
            sleep_ms(fixed).await;
            return Err(reset());
        }
        Some(Fault::Hang) => {
            tokio::time::sleep(Duration::from_secs_f64(cfg.faults.hang_secs)).await;
            drop(guard);
            return Err(reset());
        }
        Some(Fault::Malformed) => {
            sleep_ms(fixed).await;
            return Ok(full(
                200,
                &limit_headers,
                "application/json; charset=UTF-8",
                r#"{"candidates": [{"content": {"parts": [{"text": "unterminated"#,
            ));
        }
        Some(Fault::BlockPrompt) => match req.api {
            Api::Gemini | Api::Vertex => ending = Ending::BlockPrompt,
            _ => {
                sleep_ms(fixed).await;
                let mut e = proto::error(req.api, 400, "The response was filtered due to the prompt triggering content management policy. Please modify your prompt and retry.");
                if req.api == Api::OpenAi {
                    e.body["error"]["code"] = json!("content_filter");
                    e.body["error"]["param"] = json!("prompt");
                }
                return Ok(error_reply(&state, e));
            }
        },
        Some(Fault::BlockCandidate) => ending = Ending::BlockCandidate,
        Some(Fault::Truncate) | None => {}
    }

    if req.embed.is_some() {
        // The inputs are computed as one padded batch: the longest sets the time.
        let longest = req.instances.iter().map(|i| count_tokens(&i.prompt)).max().unwrap_or(0);
        sleep_ms(fixed + cfg.embedding.token_ms * slow * longest as f64).await;
        let dims = cfg.embedding.dimensions;
        let vectors: Vec<Vec<f32>> =
            req.instances.iter().map(|i| proto::embedding_of(cfg.seed, &req.model, &i.prompt, dims)).collect();
        state.stats.embed_batch(req.instances.len() as u64);
        state.stats.success(prompt_tokens, 0);
        drop(guard);
        return Ok(json_reply(200, &limit_headers, &proto::embed_response(&req, &vectors)));
    }

    if let Some(framing) = req.stream {
        state.stats.stream();
        let truncate = fault == Some(Fault::Truncate);
        return Ok(stream_reply(
            state.clone(),
            req,
            gens.into_iter().next().unwrap_or_else(|| generate(0, 1, 1, None, 0.0)),
            prompt_tokens,
            ending,
            framing,
            truncate,
            fixed,
            per_token,
            id,
            limit_headers,
            guard,
        ));
    }

    let emitted = if ending == Ending::Normal { out_tokens } else { 0 };
    if req.api == Api::Predict {
        // The instances are computed together, padded to the longest one.
        let longest_prompt = req.instances.iter().map(|i| count_tokens(&i.prompt)).max().unwrap_or(0);
        let longest_out = gens.iter().map(|g| g.tokens.len()).max().unwrap_or(0);
        let prefill = cfg.predict.prompt_token_ms * slow * longest_prompt as f64;
        let decode = if ending == Ending::Normal { per_token * longest_out as f64 } else { 0.0 };
        state.stats.predict_batch(req.instances.len() as u64);
        sleep_ms(fixed + prefill + decode).await;
    } else {
        sleep_ms(fixed + per_token * emitted as f64).await;
    }
    let created = unix_now();
    let body = match req.api {
        Api::Gemini | Api::Vertex => proto::gemini_response(&req.model, &id, first, prompt_tokens, ending),
        Api::OpenAi => proto::openai_response(&req.model, &id, created, first, prompt_tokens, ending),
        Api::Anthropic => {
            let tool = req.schema.as_ref().and(proto::anthropic_tool(&req.settings));
            proto::anthropic_response(&req.model, &id, first, prompt_tokens, tool.as_deref())
        }
        Api::Predict => {
            let answered = state.short_predictions(&req, n);
            if answered < req.instances.len() {
                state.stats.predict_short();
            }
            proto::predict_response(&req, &gens[..answered], created, &id)
        }
    };
    state.stats.success(prompt_tokens, emitted);
    drop(guard);
    Ok(json_reply(200, &limit_headers, &body))
}

#[allow(clippy::too_many_arguments)]
fn stream_reply(
    state: Arc<State>,
    req: SimRequest,
    gen: Generation,
    prompt_tokens: u64,
    ending: Ending,
    framing: StreamFraming,
    truncate: bool,
    fixed_ms: f64,
    per_token_ms: f64,
    id: String,
    headers: Vec<(&'static str, String)>,
    guard: crate::stats::InFlight,
) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, io::Error>>(8);
    let chunk = state.config.output.stream_chunk_tokens as usize;
    let received_us = unix_micros();
    tokio::spawn(async move {
        let _guard = guard;
        let created = unix_now();
        let model = req.model.clone();
        let mut events: Vec<Value> = Vec::new();
        let tokens = if ending == Ending::Normal { gen.tokens.len() } else { 0 };
        // Build the events first; send them over time.
        match req.api {
            Api::OpenAi => {
                let iu = req.include_usage;
                events.push(proto::openai_chunk(
                    &model,
                    &id,
                    created,
                    json!({"role": "assistant", "content": "", "refusal": null}),
                    None,
                    iu,
                ));
                for piece in gen.tokens[..tokens].chunks(chunk) {
                    events.push(proto::openai_chunk(
                        &model,
                        &id,
                        created,
                        json!({"content": piece.concat()}),
                        None,
                        iu,
                    ));
                }
                let finish = match ending {
                    Ending::BlockCandidate => "content_filter",
                    _ if gen.truncated_by_limit => "length",
                    _ => "stop",
                };
                events.push(proto::openai_chunk(&model, &id, created, json!({}), Some(finish), iu));
                if iu {
                    events.push(proto::openai_usage_chunk(&model, &id, created, prompt_tokens, tokens as u64));
                }
            }
            Api::Anthropic => {
                let gen = if ending == Ending::Normal {
                    gen.clone()
                } else {
                    Generation { tokens: Vec::new(), ..gen.clone() }
                };
                events.extend(
                    proto::anthropic_events(&model, &id, &gen, prompt_tokens, chunk).into_iter().map(|(_, v)| v),
                );
            }
            _ => match ending {
                Ending::Normal => {
                    let pieces: Vec<String> = gen.tokens.chunks(chunk).map(|p| p.concat()).collect();
                    let last = pieces.len().saturating_sub(1);
                    let reason = if gen.truncated_by_limit { "MAX_TOKENS" } else { "STOP" };
                    for (i, p) in pieces.iter().enumerate() {
                        let finish = (i == last).then_some((reason, tokens as u64));
                        events.push(proto::gemini_chunk(&model, &id, p, prompt_tokens, finish));
                    }
                }
                _ => events.push(proto::gemini_response(&model, &id, &gen, prompt_tokens, ending)),
            },
        }
        // A truncated stream stops half-way, before any final event.
        let cut = if truncate { (events.len() / 2).max(1) } else { events.len() };
        let encode = |i: usize, v: &Value| -> Bytes {
            let s = serde_json::to_string(v).unwrap_or_default();
            match framing {
                // Anthropic's events are named (their `type`).
                StreamFraming::Sse if req.api == Api::Anthropic => {
                    Bytes::from(format!("event: {}\r\ndata: {s}\r\n\r\n", v["type"].as_str().unwrap_or("")))
                }
                StreamFraming::Sse => Bytes::from(format!("data: {s}\r\n\r\n")),
                StreamFraming::JsonArray => Bytes::from(format!("{}{s}", if i == 0 { "[" } else { ",\r\n" })),
            }
        };
        // Which event carries the first text: OpenAI's first chunk only names the role.
        let first_text = match req.api {
            Api::OpenAi => 1,
            // message_start, content_block_start, ping, then the first text.
            Api::Anthropic => 3,
            _ => 0,
        };
        let mut timing = StreamTiming { prompt: req.prompt.clone(), received_us, first_text_us: None, events: 0 };
        let log = |timing: StreamTiming| {
            let keep = state.config.capture_requests;
            if keep > 0 {
                let mut s = state.streams.lock().unwrap_or_else(|e| e.into_inner());
                s.push_back(timing);
                while s.len() > keep {
                    s.pop_front();
                }
            }
        };
        sleep_ms(fixed_ms).await;
        let content_events = events.len();
        for (i, ev) in events.iter().enumerate().take(cut) {
            if i > 0 && i < content_events && per_token_ms > 0.0 {
                sleep_ms(per_token_ms * chunk as f64).await;
            }
            if i == first_text && tokens > 0 {
                timing.first_text_us = Some(unix_micros());
            }
            timing.events += 1;
            if tx.send(Ok(Frame::data(encode(i, ev)))).await.is_err() {
                log(timing);
                return;
            }
        }
        log(timing);
        if truncate {
            let _ =
                tx.send(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "weir-sim: injected truncated stream"))).await;
            return;
        }
        let tail = match (req.api, framing) {
            (Api::OpenAi, _) => Some("data: [DONE]\r\n\r\n"),
            (_, StreamFraming::JsonArray) => Some("]"),
            _ => None,
        };
        if let Some(t) = tail {
            if tx.send(Ok(Frame::data(Bytes::from_static(t.as_bytes())))).await.is_err() {
                return;
            }
        }
        state.stats.success(prompt_tokens, tokens as u64);
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
    let content_type = match framing {
        StreamFraming::Sse => "text/event-stream",
        StreamFraming::JsonArray => "application/json; charset=UTF-8",
    };
    let mut builder = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, "no-cache");
    for (k, v) in &headers {
        builder = builder.header(*k, v.as_str());
    }
    builder.body(BodyExt::boxed(StreamBody::new(stream))).expect("static response parts are valid")
}

/// Whether this answer to a request with a response schema is broken: true for a share `rate`
/// of calls, each drawn afresh (from a process-wide counter, so runs are repeatable).
pub(crate) fn broken_draw(rate: f64) -> bool {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if rate <= 0.0 {
        return false;
    }
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (stable_hash(&[b"invalid-json", &n.to_le_bytes()]) as f64 / u64::MAX as f64) < rate
}
