//! `weir._weir`: the native half of weir's Python package (`import weir`).
//!
//! The Python half (`python/weir/`) turns prompts and records into plain tuples and results
//! back into `weir.Result` objects; this half owns the engine. Every engine of a process with
//! the same settings is one [`weir_runtime::Runtime`] — one connection and one throttle per
//! endpoint — so all threads of a process (a Beam worker's bundles, say) reach the endpoint's
//! quota together, whatever number of `weir.Engine` objects they made. Calls run on one tokio
//! runtime per process with the GIL released; a blocking call still answers Ctrl-C.

use clap::{CommandFactory, Parser};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;
use weir_core::{GenParams, Outcome, RecordId, ResponseCache, RetryHint, RunMetrics};
use weir_io::DiskCache;
use weir_runtime::{Call, EndpointArgs, Row, RowResult, Runtime, RuntimeSettings};

// Named as `weir.ConfigError` (where the package re-exports it), so that it pickles: Beam
// sends a failed batch's exception to its dead-letter output.
pyo3::create_exception!(
    weir,
    ConfigError,
    PyValueError,
    "Settings, a model or a record weir cannot use; the message says what to fix."
);

/// The keyword arguments that configure an engine, parsed as `weir run` parses its flags.
#[derive(Debug, Parser)]
#[command(name = "weir", no_binary_name = true, disable_help_flag = true, disable_version_flag = true)]
struct Settings {
    #[command(flatten)]
    endpoint: EndpointArgs,
}

/// What engines with the same settings share: the engine, the cache it writes, and what of
/// its counters has been handed out as deltas (to Beam's counters).
struct Shared {
    engine: Arc<Runtime>,
    cache: Option<Arc<DiskCache>>,
    reported: Mutex<HashMap<&'static str, f64>>,
}

/// The cache of a `cache_dir` (or of the default `.weir`): its files in `dir/cache`, opened
/// once per process (engines with other settings share it).
fn cache_in(dir: &str) -> Result<Arc<DiskCache>, weir_io::CacheError> {
    weir_runtime::open_cache(&std::path::Path::new(dir).join("cache"))
}

/// The process's runtime for every engine's calls.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("weir")
            .build()
            .expect("the tokio runtime starts")
    })
}

/// The process's engines by their settings (weak: an engine no Python object holds is closed).
fn registry() -> &'static Mutex<HashMap<String, Weak<Shared>>> {
    static ENGINES: OnceLock<Mutex<HashMap<String, Weak<Shared>>>> = OnceLock::new();
    ENGINES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A digest of the process's environment, part of an engine's key in [`registry`]: an engine
/// reads its credentials (`GEMINI_API_KEY`, `OPENAI_API_KEY`, `GOOGLE_APPLICATION_CREDENTIALS`,
/// the variables an endpoints file names, ...) from the environment when it is made, so a new
/// `Engine` made after one changed must not take an older one's. Without this, a notebook that
/// fixed a wrong key kept failing with it, and one that switched to another account's key was
/// still billed to the first. The whole environment, not a list of names: an endpoints file may
/// name any variable. (Only a 64-bit digest is kept, in memory.)
fn environment_digest() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut vars: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os().collect();
    vars.sort();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    vars.hash(&mut h);
    h.finish()
}

/// A keyword-argument error from clap, in the words of Python (`max_concurrency`, not
/// `--max-concurrency`).
fn settings_error(e: &clap::Error) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or("invalid settings").trim_start_matches("error: ");
    settings_error_text(&first.replace("unexpected argument '--", "unknown setting '").replace("' found", "'"))
}

/// Parses a JSON object of generation parameters (`{"temperature": 0.2}`) over `base`.
fn params_over(base: &GenParams, json: Option<&str>, whose: &str) -> PyResult<Arc<GenParams>> {
    let Some(json) = json else { return Ok(Arc::new(base.clone())) };
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| ConfigError::new_err(format!("{whose} params: not JSON ({e})")))?;
    let serde_json::Value::Object(object) = value else {
        return Err(ConfigError::new_err(format!("{whose} params: expected a dict, e.g. {{\"temperature\": 0.2}}")));
    };
    let mut own = GenParams::default();
    own.apply_object(&object).map_err(|e| ConfigError::new_err(format!("{whose} params: {}", e.reason)))?;
    Ok(Arc::new(base.overlay(&own)))
}

/// One item from Python: id (text, and whether it was a number), prompt, model, system text and
/// parameters (JSON), each `None` when the item does not set it, and its media fields.
/// The prompt is `None` when it is empty: such an item fails as invalid input, with no call.
type Item = (
    Option<String>,
    bool,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Vec<(String, Option<String>, Media)>,
);

/// A media field's value from Python: a path or URL, or the bytes. The field comes with the
/// MIME type given for it (`image:image/png`), if any.
#[derive(FromPyObject)]
enum Media {
    Named(String),
    Bytes(pyo3::pybacked::PyBackedBytes),
}

/// One result for Python: ok, text, embedding, finish reason, error kind, error message,
/// retryable, attempts, prompt tokens, output tokens, model.
type Answer = (
    bool,
    Option<String>,
    Option<Vec<f32>>,
    Option<String>,
    Option<String>,
    Option<String>,
    bool,
    u32,
    u64,
    u64,
    String,
);

fn answer_of(r: RowResult) -> Answer {
    match r {
        RowResult::Null => (
            false,
            None,
            None,
            None,
            Some("invalid_input".into()),
            Some("no prompt".into()),
            false,
            0,
            0,
            0,
            String::new(),
        ),
        RowResult::Done(outcome, model) => match *outcome {
            Outcome::Success(s) => {
                let usage = s.response.usage;
                (
                    true,
                    s.response.embedding.is_none().then_some(s.response.text),
                    s.response.embedding,
                    Some(s.response.finish_reason),
                    None,
                    None,
                    false,
                    s.attempts,
                    usage.prompt_tokens,
                    usage.output_tokens,
                    s.model.to_string(),
                )
            }
            Outcome::Failure(f) => {
                // Aborted: not tried, or given up when the request stopped (a dead endpoint, say):
                // it may well succeed later.
                let retryable = matches!(f.error.hint, RetryHint::Backoff | RetryHint::Later(_))
                    || f.error.kind == weir_core::ErrorKind::Aborted;
                (
                    false,
                    None,
                    None,
                    None,
                    Some(f.error.kind.as_str().to_string()),
                    Some(f.error.message.clone()),
                    retryable,
                    f.attempts,
                    0,
                    0,
                    model.to_string(),
                )
            }
        },
    }
}

/// Where a started request's results arrive.
type Answers = std::sync::mpsc::Receiver<Result<Vec<RowResult>, String>>;

/// Answers being worked out on weir's threads (see [`PyEngine::start`]).
#[pyclass(frozen, module = "weir._weir")]
struct Pending {
    rx: Mutex<Option<Answers>>,
    task: tokio::task::AbortHandle,
}

#[pymethods]
impl Pending {
    /// Waits for the answers with the GIL released, looking for signals every 100 ms so that
    /// Ctrl-C stops a long request (its calls still to make or in flight are dropped).
    fn wait(&self, py: Python<'_>) -> PyResult<Vec<Answer>> {
        let rx = self.rx.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(mut rx) = rx else { return Err(PyValueError::new_err("already waited for")) };
        loop {
            // The receiver goes to the waiting side and back (it may not be shared across threads).
            let (got, back) = py.detach(move || (rx.recv_timeout(Duration::from_millis(100)), rx));
            rx = back;
            match got {
                Ok(Ok(results)) => return Ok(results.into_iter().map(answer_of).collect()),
                Ok(Err(e)) => return Err(ConfigError::new_err(e)),
                Err(RecvTimeoutError::Timeout) => {
                    if let Err(e) = py.check_signals() {
                        self.task.abort();
                        return Err(e);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(pyo3::exceptions::PyRuntimeError::new_err("cancelled"))
                }
            }
        }
    }

    /// Drops the calls still to be made or in flight.
    fn cancel(&self) {
        self.task.abort();
    }
}

/// An engine: a model, its endpoint's settings, and default system text and parameters.
#[pyclass(weakref, frozen, name = "Engine", module = "weir._weir")]
struct PyEngine {
    shared: Arc<Shared>,
    model: String,
    system: Option<Arc<str>>,
    params: Arc<GenParams>,
}

impl PyEngine {
    /// The engine's rows for `items`: equal system text and parameters share one `Call`, so
    /// their rows go through one driver (and batch together where the endpoint batches).
    fn rows(&self, items: Vec<Item>, system: Option<String>, params: Option<String>) -> PyResult<Vec<Row>> {
        let system: Option<Arc<str>> = system.map(Arc::from).or_else(|| self.system.clone());
        let params = params_over(&self.params, params.as_deref(), "call")?;
        let default = Arc::new(Call { system: system.clone(), params: params.clone() });
        let mut calls: HashMap<(Option<String>, Option<String>), Arc<Call>> = HashMap::new();
        let mut rows = Vec::with_capacity(items.len());
        for (i, (id, numeric, prompt, model, own_system, own_params, media)) in items.into_iter().enumerate() {
            let call = if own_system.is_none() && own_params.is_none() {
                default.clone()
            } else {
                let key = (own_system, own_params);
                match calls.get(&key) {
                    Some(c) => c.clone(),
                    None => {
                        let c = Arc::new(Call {
                            system: key.0.as_deref().map(Arc::from).or_else(|| system.clone()),
                            params: params_over(&params, key.1.as_deref(), &format!("item {i}"))?,
                        });
                        calls.insert(key, c.clone());
                        c
                    }
                }
            };
            let id = id.map(|s| if numeric { RecordId::Number(s) } else { RecordId::Text(s) });
            let media = media
                .into_iter()
                .map(|(field, mime, m)| weir_core::media::MediaRef {
                    field,
                    source: match m {
                        Media::Named(s) => weir_core::media::MediaSource::Named(s),
                        Media::Bytes(b) => weir_core::media::MediaSource::Bytes(bytes::Bytes::copy_from_slice(&b)),
                    },
                    mime,
                })
                .collect();
            rows.push(Row { model: Some(model.unwrap_or_else(|| self.model.clone())), prompt, id, call, media });
        }
        Ok(rows)
    }
}

fn sum_metrics(engine: &Runtime) -> HashMap<&'static str, f64> {
    let mut out: HashMap<&'static str, f64> = HashMap::new();
    for m in engine.metrics_by_model().values() {
        let get = RunMetrics::get;
        for (name, value) in [
            ("calls", get(&m.calls) as f64),
            ("retries", get(&m.retries) as f64),
            ("succeeded", get(&m.succeeded) as f64),
            ("failed", get(&m.failed) as f64),
            ("rate_limited", get(&m.rate_limited) as f64),
            ("cache_hits", get(&m.cache_hits) as f64),
            // Paid for: an answer from the cache costs nothing (counted apart), and a user who
            // priced a rerun from these was told it cost as much as the first run.
            ("prompt_tokens", m.paid_tokens().0 as f64),
            ("output_tokens", m.paid_tokens().1 as f64),
            ("cached_prompt_tokens", m.cache_tokens_in() as f64),
            ("cached_output_tokens", m.cache_tokens_out() as f64),
            ("throttled_seconds", get(&m.throttled_wall_micros) as f64 / 1e6),
            ("throttled_call_seconds", get(&m.throttled_micros) as f64 / 1e6),
        ] {
            *out.entry(name).or_default() += value;
        }
    }
    out
}

#[pymethods]
impl PyEngine {
    /// An engine for `model` (`provider/model`); `settings` are `weir run`'s endpoint flags as
    /// arguments (`["--rpm=100", "--limit-window=5"]`), `params` a JSON object.
    #[new]
    #[pyo3(signature = (model, settings, system=None, params=None, cache_dir=None, default_cache=false))]
    fn new(
        py: Python<'_>,
        model: String,
        settings: Vec<String>,
        system: Option<String>,
        params: Option<String>,
        cache_dir: Option<String>,
        default_cache: bool,
    ) -> PyResult<Self> {
        let spec: weir_providers::ModelSpec = model.trim().parse().map_err(|e: weir_providers::ProviderError| {
            ConfigError::new_err(e.to_string().replacen("--model ", "model ", 1))
        })?;
        let parsed = Settings::try_parse_from(&settings).map_err(|e| ConfigError::new_err(settings_error(&e)))?;
        parsed.endpoint.check().map_err(|e| ConfigError::new_err(settings_error_text(&e.0)))?;
        let params = params_over(&GenParams::default(), params.as_deref(), "engine")?;
        // The key is the settings as parsed, so that keyword order, `60` against `60.0` or a
        // default spelt out make no second engine (and no second throttle on one quota).
        let mut endpoint = parsed.endpoint.clone();
        endpoint.base_url = endpoint.base_url.iter().map(|u| u.trim_end_matches('/').to_string()).collect();
        let cache = match cache_dir.as_deref().map(|dir| (dir, cache_in(dir))) {
            None => None,
            Some((_, Ok(c))) => Some(c),
            // The default cache (`.weir/cache` of the working directory, as `weir sql`'s): a
            // process that finds it held by another goes on without it, and says so.
            Some((dir, Err(e))) if default_cache => {
                let why = if e.in_use {
                    "is in use by another process".to_string()
                } else {
                    format!("cannot be opened ({})", e.message)
                };
                let message = std::ffi::CString::new(format!(
                    "weir: the response cache in {dir}/cache {why}; this engine runs without it (give it \
                     cache_dir=... of its own, or cache=False)"
                ))
                .unwrap_or_default();
                PyErr::warn(py, &py.get_type::<pyo3::exceptions::PyUserWarning>(), &message, 1)?;
                None
            }
            // A cache_dir asked for is that directory or an error.
            Some((dir, Err(e))) => {
                return Err(ConfigError::new_err(format!(
                    "cache_dir {dir}: {}",
                    if e.in_use {
                        "is in use by another process (a cache directory is one process's at a time: give each \
                         process its own, or none)"
                            .to_string()
                    } else {
                        e.message
                    }
                )))
            }
        };
        let key = format!("{endpoint:?}\u{0}{:?}\u{0}{:016x}", cache.as_ref().map(Arc::as_ptr), environment_digest());
        let mut engines = registry().lock().unwrap_or_else(|e| e.into_inner());
        let shared = match engines.get(&key).and_then(Weak::upgrade) {
            Some(s) => s,
            None => {
                let e = &parsed.endpoint;
                let engine = Runtime::new(RuntimeSettings {
                    provider: e.provider(),
                    throttle: e.throttle(),
                    driver: e.driver(),
                    cache: cache.clone().map(|c| c as Arc<dyn ResponseCache>),
                    pool: e.pool().map_err(|err| ConfigError::new_err(settings_error_text(&err.0)))?,
                });
                // Media fields may name gs:// and s3:// objects, read with the environment's
                // credentials (or emulators), as `weir run` reads them.
                let buckets = weir_tables::BucketMedia::new(Arc::new(|k: &str| std::env::var(k).ok()));
                engine.set_media(Arc::new(weir_runtime::media::Loader::new(Some(Arc::new(buckets)))));
                let s = Arc::new(Shared { engine, cache, reported: Mutex::new(HashMap::new()) });
                engines.retain(|_, w| w.strong_count() > 0);
                engines.insert(key, Arc::downgrade(&s));
                s
            }
        };
        Ok(Self { shared, model: spec.to_string(), system: system.map(Arc::from), params })
    }

    /// The engine's `provider/model`.
    #[getter]
    fn model(&self) -> String {
        self.model.clone()
    }

    /// Starts answering `items` (generation, or embeddings when `embed`) on weir's threads and
    /// returns at once: the caller waits on the [`Pending`] (a blocking call on its own thread,
    /// asyncio in an executor thread). weir's threads never touch a Python
    /// object, so nothing of theirs can outlive the interpreter at exit.
    #[pyo3(signature = (items, embed, system=None, params=None))]
    fn start(
        &self,
        items: Vec<Item>,
        embed: bool,
        system: Option<String>,
        params: Option<String>,
    ) -> PyResult<Pending> {
        let rows = self.rows(items, system, params)?;
        let engine = self.shared.engine.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let task = runtime().spawn(async move {
            let _ = tx.send(engine.answer(rows, embed).await);
        });
        Ok(Pending { rx: Mutex::new(Some(rx)), task: task.abort_handle() })
    }

    /// What the engine's counters gained since the last call of this (by any engine of the
    /// process with the same settings): each gain is handed out once, to Beam's counters.
    fn take_deltas(&self) -> HashMap<&'static str, f64> {
        let now = sum_metrics(&self.shared.engine);
        let mut reported = self.shared.reported.lock().unwrap_or_else(|e| e.into_inner());
        // Whole units (Beam's counters are integers); the fractions are handed out when they add
        // up.
        now.into_iter()
            .map(|(k, v)| {
                let v = v.floor();
                let old = reported.insert(k, v).unwrap_or(0.0);
                (k, (v - old).max(0.0))
            })
            .collect()
    }

    /// Counters summed over the engine's endpoints (shared with every engine of the process
    /// that has the same settings).
    fn metrics(&self, py: Python<'_>) -> HashMap<&'static str, f64> {
        let mut out = sum_metrics(&self.shared.engine);
        // How many processes shared an endpoint's quota at most (1: this one alone), the most
        // over the endpoints: processes on one machine that call one endpoint with one key meet.
        let engine = &self.shared.engine;
        let endpoints = py.detach(|| runtime().block_on(engine.endpoints()));
        let processes = endpoints.iter().map(|e| e.sharing.processes).max().unwrap_or(1);
        out.insert("quota_processes", processes as f64);
        out
    }

    /// Makes every answer cached so far durable (it is otherwise handed to the kernel within
    /// 200 ms and synced about once a second).
    fn flush(&self, py: Python<'_>) {
        if let Some(c) = &self.shared.cache {
            py.detach(|| c.checkpoint());
        }
    }
}

/// A settings check's message, in the words of Python.
fn settings_error_text(text: &str) -> String {
    let mut out = text.to_string();
    for arg in Settings::command().get_arguments() {
        if let Some(long) = arg.get_long() {
            out = out.replace(&format!("--{long}"), &long.replace('-', "_"));
        }
    }
    out
}

/// The names of the settings an engine takes as keyword arguments.
#[pyfunction]
fn setting_names() -> Vec<String> {
    Settings::command().get_arguments().filter_map(|a| a.get_long()).map(|l| l.replace('-', "_")).collect()
}

/// A `media_fields` entry as the CLI's `--media-field` takes it: `FIELD` or `FIELD:TYPE`, as
/// (field, MIME type or `None`); `ConfigError` says what to fix (one parser for every front end).
/// Checks one item's generation parameters (a JSON object) as an engine would read them, so
/// that an item with parameters weir cannot send fails alone, as an unreadable item does, before
/// any call: in a Beam pipeline, a misspelt parameter in one element used to raise for its whole
/// batch after other batches had been paid for, and the pipeline failed.
#[pyfunction]
fn check_params(json: &str, label: &str) -> PyResult<()> {
    params_over(&GenParams::default(), Some(json), label).map(drop)
}

#[pyfunction]
fn media_field(spec: &str) -> PyResult<(String, Option<String>)> {
    weir_core::media::field_spec(spec).map_err(|e| ConfigError::new_err(format!("media_fields: {e}")))
}

/// Logs to stderr when `WEIR_LOG` is set (`warn`, `weir_core=debug`, …), as the CLI does; a
/// Python process is left quiet otherwise (every failure is in its item's result).
fn init_logging() {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("WEIR_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            // A line stderr could not take is lost, not said on stderr again (that panicked).
            .log_internal_errors(false)
            .with_target(false)
            .try_init();
    }
}

/// Leaves every quota this process shares with others (registered with `atexit` by the Python
/// package): the engines end their shared throttles and give up the Redis leases they hold, so
/// a process started next holds the quota at once instead of following one that has gone until
/// its lease runs out. Bounded to a few seconds; the interpreter exits after it whatever Redis
/// does.
#[pyfunction]
fn leave_quotas(py: Python<'_>) {
    let engines: Vec<Arc<Shared>> =
        registry().lock().unwrap_or_else(|e| e.into_inner()).values().filter_map(Weak::upgrade).collect();
    py.detach(|| {
        runtime().block_on(async {
            let all = async {
                for s in &engines {
                    s.engine.shutdown().await;
                }
                weir_runtime::share_redis::leave_all().await;
            };
            let _ = tokio::time::timeout(std::time::Duration::from_secs(3), all).await;
        })
    });
}

#[pymodule]
fn _weir(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add_class::<PyEngine>()?;
    m.add_class::<Pending>()?;
    m.add("ConfigError", m.py().get_type::<ConfigError>())?;
    m.add_function(wrap_pyfunction!(setting_names, m)?)?;
    m.add_function(wrap_pyfunction!(leave_quotas, m)?)?;
    m.add_function(wrap_pyfunction!(media_field, m)?)?;
    m.add_function(wrap_pyfunction!(check_params, m)?)?;
    Ok(())
}
