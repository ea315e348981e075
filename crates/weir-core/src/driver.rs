//! The record driver: `weir run`'s front end over the [`Executor`]. It takes a record to
//! exactly one outcome.
//!
//! It turns the record into a request (system text and parameters are per request, so a front
//! end may vary them per record), answers from the response cache when the cache's rule allows
//! (see [`crate::cache`]), and otherwise hands the call to the executor of the record's
//! endpoint. What a *run* means is decided here, not below: a run stops early, rather than burn
//! through its input, when an error says no record can succeed (a spent daily quota), when
//! credentials are rejected by the first calls before any success, or when nothing can be
//! reached at all. Stopping cancels the run's token; records not yet tried end as `aborted`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cache::{cache_key, is_deterministic, CacheKey, ResponseCache};
use crate::error::{ErrorKind, ModelError, RetryHint};
use crate::executor::{Checked, Done, Executor, Failed, Observer, StreamEvent};
use crate::handler::{ModelHandler, ModelRequest};
use crate::media::{MediaLoader, MediaRef, MediaSource, Part, Spill, MAX_INLINE_BYTES};
use crate::metrics::RunMetrics;
use crate::outcome::{Failure, ModelResponse, Outcome, Success};
use crate::params::GenParams;
use crate::record::Record;
use crate::retry::RetryPolicy;
use crate::schema::OutputSchema;
use crate::throttle::{RateSnapshot, Throttle, Weight};

/// How long connecting may fail, with nothing ever answering, before the run stops: long enough
/// for a server that is still starting, short enough not to burn through the input.
const DEAD_ENDPOINT_AFTER: Duration = Duration::from_secs(5);

/// How long connecting may fail with no answer between, after the endpoint had answered, before
/// the run stops (the server went away: a crashed vLLM, a closed tunnel), unless a record used
/// up its retries on it first. Every record tried meanwhile would only use up its retries into
/// a `transport` error row; stopped, the records not yet tried are left to a resume (or
/// `aborted` rows).
const GONE_ENDPOINT_AFTER: Duration = Duration::from_secs(60);

/// Settings of the driver, validated by the caller.
#[derive(Debug, Clone)]
pub struct DriverSettings {
    /// Hard limit on one call.
    pub timeout: Duration,
    /// The retry policy.
    pub retry: RetryPolicy,
    /// Stop the run after this many auth failures with no success yet.
    pub auth_failures_to_stop: u64,
    /// System instructions for every request.
    pub system: Option<Arc<str>>,
    /// Generation parameters for every request.
    pub params: Arc<GenParams>,
}

impl Default for DriverSettings {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(120),
            retry: RetryPolicy::default(),
            auth_failures_to_stop: 3,
            system: None,
            params: Arc::new(GenParams::default()),
        }
    }
}

/// Why a run stopped early.
#[derive(Debug, Clone, PartialEq)]
pub struct StopReason {
    /// The kind of the error that stopped it.
    pub kind: ErrorKind,
    /// What to tell the user.
    pub message: String,
}

/// The run's rules for stopping early, fed every attempt by the executor.
struct StopRules {
    cancel: CancellationToken,
    reason: Mutex<Option<StopReason>>,
    auth_failures: AtomicU64,
    /// Refused calls since the last answer.
    auth_in_a_row: AtomicU64,
    auth_failures_to_stop: u64,
    /// Records whose first answer could not be read (`malformed_response`).
    unreadable: AtomicU64,
    /// A call of the run has succeeded (an answer kept or not).
    call_succeeded: AtomicBool,
    max_retries: u32,
    answered: AtomicBool,
    first_unreachable: Mutex<Option<Instant>>,
    /// Since when connecting has failed with no answer between, after answers (and whether it
    /// has: checked before the lock on every answer).
    unreachable_since: Mutex<Option<Instant>>,
    unreachable: AtomicBool,
    metrics: Arc<RunMetrics>,
}

/// Records whose first answer could not be read, before any call of the run succeeded, that
/// stop it: a server of another API, or a proxy that breaks every answer, is paid for each (a
/// tester's server of broken 200s was called 9 times for every record). Two first waves of
/// calls, not a few answers: records that only this server cannot answer, first in the input,
/// must not stop every run of it (a second tester's 20 such records did, resume after resume).
const UNREADABLE_TO_STOP: u64 = 32;

/// After answers, this many times `auth_failures_to_stop` refusals in a row stop the run: more
/// than at the start, since calls in flight when the credentials changed all fail together.
const REVOKED_FACTOR: u64 = 8;

impl StopRules {
    fn stop(&self, reason: StopReason) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            if reason.kind != ErrorKind::Aborted {
                tracing::error!("stopping the run: {}", reason.message);
            }
            *r = Some(reason);
        }
        self.cancel.cancel();
    }
}

impl Observer for StopRules {
    fn answered(&self) {
        self.answered.store(true, Relaxed);
        self.call_succeeded.store(true, Relaxed);
        self.auth_in_a_row.store(0, Relaxed);
        self.reached();
    }

    fn failed_attempt(&self, error: &ModelError, attempts: u32) {
        if error.status.is_some() {
            self.answered.store(true, Relaxed);
            self.reached();
        }
        // An endpoint that answered and then went away: connecting has failed, with nothing
        // answered between, for GONE_ENDPOINT_AFTER.
        let mut streak = Duration::ZERO;
        let gone = error.unreachable && self.answered.load(Relaxed) && {
            let now = Instant::now();
            self.unreachable.store(true, Relaxed);
            let since = *self.unreachable_since.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(now);
            // Or a record used up its retries on it, with nothing answered for a while (in a
            // pool, other endpoints' answers end the streak): every other record would fare
            // the same.
            streak = now.duration_since(since);
            streak >= GONE_ENDPOINT_AFTER || (attempts > self.max_retries && streak >= DEAD_ENDPOINT_AFTER)
        };
        if gone {
            self.stop(StopReason {
                kind: ErrorKind::Transport,
                message: format!(
                    "the endpoint stopped answering: connecting has failed for {} s with no answer since: {}; \
                     run the same command again once the server is back",
                    streak.as_secs(),
                    error.message
                ),
            });
            return;
        }
        // A dead endpoint: no call of the run has ever reached a server, and connecting has
        // failed for a while (a server still starting up gets that long) or a record is out of
        // retries. Every other record would fare the same.
        let dead = error.unreachable && !self.answered.load(Relaxed) && {
            let now = Instant::now();
            let first = *self.first_unreachable.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(now);
            now.duration_since(first) >= DEAD_ENDPOINT_AFTER || attempts > self.max_retries
        };
        if dead {
            self.stop(StopReason {
                kind: ErrorKind::Transport,
                message: format!(
                    "cannot connect to the endpoint (nothing has answered any call yet): {}; check the base URL (--base-url) and that the server is running",
                    error.message
                ),
            });
        } else if error.hint == RetryHint::StopRun {
            self.stop(StopReason { kind: error.kind, message: error.message.clone() });
        } else if error.kind == ErrorKind::MalformedResponse && attempts == 1 {
            let n = self.unreadable.fetch_add(1, Relaxed) + 1;
            if n >= UNREADABLE_TO_STOP && !self.call_succeeded.load(Relaxed) {
                self.stop(StopReason {
                    kind: ErrorKind::MalformedResponse,
                    message: format!(
                        "the answers to the first {n} records could not be read and no call succeeded (is the base URL \
                         a server of this provider's API?): {}",
                        error.message
                    ),
                });
            }
        } else if error.kind == ErrorKind::Auth {
            let n = self.auth_failures.fetch_add(1, Relaxed) + 1;
            let in_a_row = self.auth_in_a_row.fetch_add(1, Relaxed) + 1;
            if n >= self.auth_failures_to_stop && !self.answered_ok() {
                self.stop(StopReason {
                    kind: ErrorKind::Auth,
                    message: format!(
                        "the credentials failed on the first {n} calls and none succeeded: {}",
                        error.message
                    ),
                });
            } else if in_a_row >= self.auth_failures_to_stop.saturating_mul(REVOKED_FACTOR) {
                // Credentials that worked and then stop working (a revoked key or token) fail
                // every call from then on: a run of refusals with no answer between them.
                self.stop(StopReason {
                    kind: ErrorKind::Auth,
                    message: format!(
                        "the credentials stopped working: the last {in_a_row} calls were refused, after earlier \
                         calls succeeded: {}",
                        error.message
                    ),
                });
            }
        }
    }
}

impl StopRules {
    fn answered_ok(&self) -> bool {
        self.metrics.succeeded.load(Relaxed) > 0
    }

    /// A call reached a server: a streak of failed connections, if any, is over.
    fn reached(&self) {
        if self.unreachable.swap(false, Relaxed) {
            *self.unreachable_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

/// The record's error for media that could not be read: `invalid_input`, or, for a failure
/// that may pass (a timeout, a 5xx), of that kind and retryable (`--retry-errors`), since it
/// is not the input's fault.
fn media_error(mut error: ModelError, e: &crate::media::MediaError) -> ModelError {
    if e.is_transient() {
        error.kind = e.kind;
        error.hint = RetryHint::Backoff;
    }
    error
}

/// `read`'s result, or a timeout (which may pass: the record is retryable) if it takes longer
/// than `timeout`.
async fn within<T>(
    timeout: Duration,
    read: impl Future<Output = Result<T, crate::media::MediaError>>,
) -> Result<T, crate::media::MediaError> {
    tokio::time::timeout(timeout, read).await.unwrap_or_else(|_| {
        let why = format!("not read within the --timeout of {} s", timeout.as_secs_f64());
        Err(crate::media::MediaError::transient(ErrorKind::Timeout, why))
    })
}

/// A record's parts as read for its request, some of them perhaps still to be uploaded.
struct Read {
    parts: Vec<Part>,
    /// Parts too large to go inline, by index, to be uploaded before they are sent (after the
    /// cache is asked), each with the error naming its field should the upload fail.
    pending: Vec<(usize, ModelError)>,
    /// Held while a record has large parts in memory: one such record at a time.
    _large: Option<tokio::sync::MutexGuard<'static, ()>>,
    /// The inline parts' share of [`MEDIA_BUDGET`], held until the record has its answer.
    held: Held,
}

/// A share of [`MEDIA_BUDGET`], in KiB.
type Held = Option<tokio::sync::SemaphorePermit<'static>>;

/// The most bytes of media read from files, URLs and buckets that the records of a process
/// hold at once, inline parts waiting or in flight: a run of 15 MB scans at a concurrency in
/// the hundreds would otherwise hold gigabytes (and their base64 bodies beside them). Records
/// over it wait for their turn to read; a part over it alone still goes (the budget is taken
/// whole). Parts given as bytes (a Parquet column) are in memory already and not counted.
pub const MEDIA_BUDGET_BYTES: usize = 512 * 1024 * 1024;

/// [`MEDIA_BUDGET_BYTES`] in KiB permits.
static MEDIA_BUDGET: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MEDIA_BUDGET_BYTES / 1024);

/// What a part of unknown size (a URL, an object) is taken to need before it is read; the rest
/// is taken once its size is known.
const UNKNOWN_SIZE_GUESS: usize = 1024 * 1024;

/// Makes `held` (a record's share of the media budget) `bytes`: the excess let go, or, to
/// take more, all of it let go first and the whole asked for again in line (the semaphore is
/// fair), so that records each waiting for more cannot hold the budget between them and wait
/// on each other forever. At most the whole budget is taken: a part larger than it still goes.
async fn fit_budget(held: Held, bytes: usize) -> Held {
    fit(&MEDIA_BUDGET, MEDIA_BUDGET_BYTES, held, bytes).await
}

/// [`fit_budget`] of `budget`, of `whole` bytes.
async fn fit(budget: &'static tokio::sync::Semaphore, whole: usize, held: Held, bytes: usize) -> Held {
    if bytes == 0 {
        return None;
    }
    let kib = bytes.div_ceil(1024).min(whole / 1024);
    match held {
        Some(mut h) if h.num_permits() >= kib => {
            drop(h.split(h.num_permits() - kib));
            Some(h)
        }
        other => {
            drop(other);
            Some(budget.acquire_many(kib as u32).await.expect("the media budget is never closed"))
        }
    }
}

impl Read {
    /// The parts as they key the cache: by their content, uploaded or not.
    fn keyed(&self) -> Arc<[Part]> {
        Arc::from(self.parts.clone())
    }

    /// The parts as they are sent: each large one uploaded through `handler` and referred to,
    /// its bytes let go (the provider has them).
    async fn uploaded(mut self, handler: &dyn ModelHandler) -> Result<(Arc<[Part]>, Held), ModelError> {
        let held = self.held.take();
        for (at, named) in std::mem::take(&mut self.pending) {
            let part = &mut self.parts[at];
            let uri = handler.upload_media(part).await.map_err(|e| {
                let mut error = named.clone();
                error.message = format!("{}: {}", error.message, e.message);
                (error.kind, error.hint) = (e.kind, e.hint);
                error
            })?;
            *part = Part { uri: Some(uri), data: bytes::Bytes::new(), ..part.clone() };
        }
        Ok((Arc::from(self.parts), held))
    }
}

/// Runs records through a model handler and its endpoint's executor.
pub struct Driver {
    /// The first endpoint's client: what every endpoint of the pool can do (stream, batch,
    /// count tokens) is the same, since they serve one model of one provider.
    handler: Arc<dyn ModelHandler>,
    /// Each endpoint's client, in the pool's order.
    handlers: Vec<Arc<dyn ModelHandler>>,
    executor: Executor,
    settings: DriverSettings,
    metrics: Arc<RunMetrics>,
    rules: Arc<StopRules>,
    cache: Option<Arc<dyn ResponseCache>>,
    /// Deterministic requests in flight, so identical ones wait for the first answer (and take
    /// it from the cache) instead of paying for it again.
    inflight: Mutex<HashMap<CacheKey, Arc<tokio::sync::Mutex<()>>>>,
    /// The run's response schema, compiled: every generated answer is checked against it.
    schema: Option<Arc<OutputSchema>>,
    /// Reads what records' media fields name, when they are about to be sent.
    media: Option<Arc<dyn MediaLoader>>,
    model_id: Arc<str>,
    /// Whose answers these are, for the cache: the model and the endpoint that serves it (the
    /// same model name behind a simulator, another project or another server is not the same
    /// source).
    source: Arc<str>,
}

impl Driver {
    /// A driver over `handler`, admitted by `throttle` (shared with whatever else calls the
    /// same endpoint), counting into `metrics`.
    pub fn new(
        handler: Arc<dyn ModelHandler>,
        throttle: Arc<Throttle>,
        settings: DriverSettings,
        metrics: Arc<RunMetrics>,
    ) -> Self {
        Self::pooled(vec![handler], Arc::new(crate::Pool::single(throttle)), settings, metrics)
    }

    /// A driver over a pool of endpoints that serve one model, `handlers[i]` calling the
    /// pool's endpoint `i`: each attempt goes to the one that admits it first (see
    /// [`crate::pool`]). The pool (its health and counters) may be shared by many drivers.
    /// Answers are cached under the first endpoint's name, whichever endpoint gave them, so a
    /// pool reuses what a run against its first endpoint alone paid for, and the other way round.
    pub fn pooled(
        handlers: Vec<Arc<dyn ModelHandler>>,
        pool: Arc<crate::Pool>,
        settings: DriverSettings,
        metrics: Arc<RunMetrics>,
    ) -> Self {
        assert_eq!(handlers.len(), pool.len(), "one client per endpoint of the pool");
        let handler = handlers.first().expect("a pool has at least one endpoint").clone();
        let rules = Arc::new(StopRules {
            cancel: CancellationToken::new(),
            reason: Mutex::new(None),
            auth_failures: AtomicU64::new(0),
            auth_in_a_row: AtomicU64::new(0),
            unreadable: AtomicU64::new(0),
            call_succeeded: AtomicBool::new(false),
            auth_failures_to_stop: settings.auth_failures_to_stop,
            max_retries: settings.retry.max_retries,
            answered: AtomicBool::new(false),
            first_unreachable: Mutex::new(None),
            unreachable_since: Mutex::new(None),
            unreachable: AtomicBool::new(false),
            metrics: metrics.clone(),
        });
        let executor = Executor::pooled(pool, settings.retry.clone(), settings.timeout, metrics.clone())
            .with_observer(rules.clone());
        // Checked when the parameters were read (a usage error then), so rarely `None` here.
        let settings_schema = settings.params.response_schema.as_ref().and_then(|s| match OutputSchema::new(s) {
            Ok(s) => Some(Arc::new(s)),
            Err(e) => {
                tracing::warn!("answers are not checked: {e}");
                None
            }
        });
        Self {
            model_id: Arc::from(handler.model_id()),
            source: Arc::from(match handler.request_form() {
                None => format!("{} at {}", handler.model_id(), handler.endpoint()),
                Some(form) => format!("{} at {} ({form})", handler.model_id(), handler.endpoint()),
            }),
            handler,
            handlers,
            executor,
            settings,
            metrics,
            rules,
            cache: None,
            inflight: Mutex::new(HashMap::new()),
            schema: settings_schema,
            media: None,
        }
    }

    /// Reads records' media (`--media-field`) with `loader`.
    pub fn with_media(mut self, loader: Arc<dyn MediaLoader>) -> Self {
        self.media = Some(loader);
        self
    }

    /// The parts `record`'s media fields name, read now; the error (an `invalid_input`, no call
    /// made) names the field, what it named and why it cannot be sent.
    ///
    /// Parts go inline, up to 15 MB for a request. Past that, an endpoint that takes uploads
    /// (the Gemini API's Files API) gets the part uploaded and referred to ([`Read::uploaded`],
    /// once the cache has no answer: a cached answer costs no upload); one record's large
    /// parts at a time in the process are read and uploaded, so memory holds at most those
    /// beside the inline parts in flight. Media an endpoint reads itself (`gs://` on Vertex AI)
    /// is only typed here, from its first bytes.
    async fn parts_of(&self, record: &Record) -> Result<Read, ModelError> {
        /// One record's large parts read and uploaded at a time in the process.
        static LARGE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        if record.media.is_empty() {
            return Ok(Read { parts: Vec::new(), pending: Vec::new(), _large: None, held: None });
        }
        let bad = |r: &MediaRef, why: String| {
            let at = r.source.shown();
            ModelError::new(ErrorKind::InvalidInput, format!("media field '{}' ({at}): {why}", r.field))
                .with_hint(RetryHint::Never)
        };
        let untyped = |r: &MediaRef| {
            bad(r, format!("not a type the providers take as a part ({})", crate::media::TAKEN.join(", ")))
        };
        let loader = |r: &MediaRef| self.media.as_ref().ok_or_else(|| bad(r, "this front end reads no media".into()));
        // A part is read within the run's --timeout, as a call is answered within it.
        let timeout = self.settings.timeout;
        // An uploaded file is the uploading key's: uploads only for a driver of one endpoint.
        let upload_max = match self.handlers.as_slice() {
            [h] => h.max_upload_bytes().map(|m| m as usize),
            _ => None,
        };
        let (mut parts, mut pending, mut large) = (Vec::with_capacity(record.media.len()), Vec::new(), None);
        let mut total = 0usize;
        // Bytes read from files, URLs and objects for this record, and their share of the budget.
        let (mut read_bytes, mut held): (usize, Held) = (0, None);
        for r in &record.media {
            let inline_left = MAX_INLINE_BYTES - total;
            let read = match &r.source {
                MediaSource::Bytes(b) if b.len() <= inline_left => Ok((b.clone(), "", false)),
                MediaSource::Bytes(b) => Err(crate::media::MediaError::too_large(b.len() as u64, inline_left)),
                MediaSource::Named(source) if self.handlers.iter().all(|h| h.reads_by_reference(source)) => {
                    // Read by the endpoint itself: only its type and version are asked here.
                    let peek = within(timeout, loader(r)?.peek(source))
                        .await
                        .map_err(|e| media_error(bad(r, e.message.clone()), &e))?;
                    if peek.size == 0 {
                        return Err(bad(r, "it is empty".into()));
                    }
                    parts.push(
                        Part::by_reference(source, &peek.head, &peek.version, r.mime.as_deref())
                            .ok_or_else(|| untyped(r))?,
                    );
                    continue;
                }
                MediaSource::Named(source) => {
                    // The budget is taken before the bytes are read: a file's size, or a guess.
                    let size = (!source.contains("://"))
                        .then(|| std::fs::metadata(source).ok().filter(|m| m.is_file()).map(|m| m.len() as usize))
                        .flatten();
                    let guess = size.unwrap_or(UNKNOWN_SIZE_GUESS).min(inline_left);
                    held = fit_budget(held, read_bytes + guess).await;
                    // Where the part could go by upload, a source found too large only as it
                    // is read goes on being read in the turn for large parts, if it comes soon.
                    let spill = upload_max.map(|max| Spill { max, turn: large.is_none().then_some(&LARGE) });
                    let read = within(timeout, loader(r)?.load_or_spill(source, inline_left, spill.as_ref())).await;
                    // A spilled part is in the turn for large parts, not in the budget.
                    read_bytes += read.as_ref().map_or(0, |l| if l.spilled { 0 } else { l.bytes.len() });
                    held = fit_budget(held, read_bytes).await;
                    read.map(|l| {
                        if l.turn.is_some() {
                            large = l.turn;
                        }
                        (l.bytes, source.as_str(), l.spilled)
                    })
                }
            };
            let (data, name, upload) = match read {
                Ok(got) => got,
                // Too large to go inline, to an endpoint that takes uploads: read in its turn.
                Err(e) if e.over && upload_max.is_some() => {
                    let max = upload_max.unwrap_or(0);
                    if large.is_none() {
                        large = Some(LARGE.lock().await);
                    }
                    match &r.source {
                        MediaSource::Bytes(b) if b.len() <= max => (b.clone(), "", true),
                        MediaSource::Bytes(b) => {
                            return Err(bad(r, crate::media::too_large_to_upload(Some(b.len() as u64), max)))
                        }
                        MediaSource::Named(source) => {
                            let data = loader(r)?.load(source, max).await.map_err(|e| match e.over {
                                // Over the upload limit (2 GB), not the inline one.
                                true => bad(r, crate::media::too_large_to_upload(e.len, max)),
                                false => media_error(bad(r, e.message.clone()), &e),
                            })?;
                            (data, source.as_str(), true)
                        }
                    }
                }
                Err(e) => return Err(media_error(bad(r, e.message.clone()), &e)),
            };
            if upload {
                let part = Part::typed_as(data, name, r.mime.as_deref()).ok_or_else(|| untyped(r))?;
                pending.push((parts.len(), bad(r, "could not be uploaded".into())));
                parts.push(part);
                continue;
            }
            total += data.len();
            if data.is_empty() {
                return Err(bad(r, "it is empty".into()));
            }
            parts.push(Part::typed_as(data, name, r.mime.as_deref()).ok_or_else(|| untyped(r))?);
        }
        Ok(Read { parts, pending, _large: large, held })
    }

    /// Starts as if connecting had failed for the whole detection window already: the first
    /// call that cannot connect stops the driver at once, and one answer clears it. For a front
    /// end that makes a driver per request (a SQL batch, a Python call) just after another found
    /// the endpoint dead: each request asks once, instead of waiting out the window again.
    pub fn presumed_unreachable(self) -> Self {
        let since = Instant::now().checked_sub(DEAD_ENDPOINT_AFTER).unwrap_or_else(Instant::now);
        *self.rules.first_unreachable.lock().unwrap_or_else(|e| e.into_inner()) = Some(since);
        self
    }

    /// Answers from `cache` when its rule allows, and stores every new answer in it.
    pub fn with_cache(mut self, cache: Arc<dyn ResponseCache>) -> Self {
        self.cache = Some(cache);
        self
    }

    /// `provider/model` of the handler.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The endpoint's throttle (a pool's first endpoint's).
    pub fn throttle(&self) -> &Arc<Throttle> {
        self.executor.throttle()
    }

    /// The endpoints calls go to.
    pub fn pool(&self) -> &Arc<crate::Pool> {
        self.executor.pool()
    }

    /// The concurrency limit in force.
    pub fn concurrency(&self) -> usize {
        self.pool().concurrency()
    }

    /// The rate limits in force.
    pub fn rate_snapshot(&self) -> Option<RateSnapshot> {
        Some(self.throttle().rates())
    }

    /// The run's metrics.
    pub fn metrics(&self) -> &Arc<RunMetrics> {
        &self.metrics
    }

    /// Why the run stopped early, if it did.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.rules.reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// True once the run has stopped early.
    pub fn is_stopped(&self) -> bool {
        self.rules.cancel.is_cancelled()
    }

    /// Stops the run: records not yet tried end as `aborted`, calls in backoff give up.
    pub fn stop(&self, reason: StopReason) {
        self.rules.stop(reason);
    }

    /// Counts a failure that never reached the driver (invalid input) and passes it on.
    pub fn reject(&self, failure: Box<Failure>) -> Outcome {
        self.metrics.record_rejected(&failure);
        Outcome::Failure(failure)
    }

    /// The cached answer for `key`, counted as a hit.
    fn cached(&self, key: Option<&CacheKey>) -> Option<crate::outcome::ModelResponse> {
        let response = self.cache.as_ref()?.get(key?)?;
        self.metrics.record_cache_hit(response.usage.prompt_tokens, response.usage.output_tokens);
        self.metrics.record_success(response.usage.prompt_tokens, response.usage.output_tokens);
        Some(response)
    }

    /// The request a record makes: its own system text and parameters over the run's.
    fn request_of(&self, record: &Record) -> ModelRequest {
        ModelRequest {
            prompt: record.prompt.clone(),
            system: record.system.clone().or_else(|| self.settings.system.clone()),
            params: match &record.params {
                Some(own) => Arc::new(self.settings.params.overlay(own)),
                None => self.settings.params.clone(),
            },
            // The parts are read when the record is sent; where they were read before (for a
            // batch job), their digests stand in for them in the cache key.
            media: record
                .media_digests
                .iter()
                .map(|d| Part { mime: String::new(), data: bytes::Bytes::new(), digest: *d, uri: None })
                .collect(),
            fields: match self.handler.record_fields() {
                [] => None,
                names => Some(Arc::new(
                    names.iter().filter_map(|n| record.input.get(n).map(|v| (n.clone(), v.clone()))).collect(),
                )),
            },
        }
    }

    /// `record`'s request with its media read now (for a batch job's input, which goes to the
    /// provider long after): the parts' digests are kept in the record, to key its answer in
    /// the cache when it comes back. The error is the record's, as for a call.
    pub async fn request_with_media(&self, record: &mut Record) -> Result<ModelRequest, ModelError> {
        let mut request = self.request_of(record);
        let (parts, _held) = self.parts_of(record).await?.uploaded(self.handler.as_ref()).await?;
        record.media_digests = parts.iter().map(|p| p.digest).collect();
        request.media = parts;
        Ok(request)
    }

    /// Why `response`, an answer to `record` that came another way than through this driver's
    /// calls (a batch job's), is not one to keep: it does not match the response schema
    /// (counted as an invalid output, as for calls).
    pub fn check_answer(&self, record: &Record, response: &ModelResponse) -> Option<ModelError> {
        let invalid = self.schema_for(&self.request_of(record))?.invalid(response)?;
        self.metrics.record_invalid_output(response.usage.prompt_tokens, response.usage.output_tokens);
        Some(invalid)
    }

    /// The compiled response schema of `request`: the run's, or a record's own (compiled for
    /// it; a record whose schema does not compile is not checked, with a warning).
    fn schema_for(&self, request: &ModelRequest) -> Option<Arc<OutputSchema>> {
        let own = request.params.response_schema.as_ref()?;
        if Arc::ptr_eq(&request.params, &self.settings.params)
            || Some(own) == self.settings.params.response_schema.as_ref()
        {
            return self.schema.clone();
        }
        match OutputSchema::new(own) {
            Ok(s) => Some(Arc::new(s)),
            Err(e) => {
                tracing::warn!("a record's answer is not checked: {e}");
                None
            }
        }
    }

    /// The throttle's weight of one request.
    fn weight_of(&self, request: &ModelRequest) -> Weight {
        let max_output = request.params.max_output_tokens;
        if let Some(tokens) = self.handler.count_tokens(&request.prompt) {
            let system = request.system.as_deref().and_then(|s| self.handler.count_tokens(s)).unwrap_or(0);
            return self.throttle().estimate_counted(tokens + system, max_output);
        }
        let chars = request.prompt.chars().count() + request.system.as_deref().map_or(0, |s| s.chars().count());
        self.throttle().estimate(chars, max_output)
    }

    /// Estimated tokens of a record's call, for cutting batches by weight.
    pub fn estimate(&self, record: &Record) -> u64 {
        self.weight_of(&self.request_of(record)).tokens
    }

    /// The most records one call may carry (1 unless the endpoint takes batches).
    pub fn max_batch(&self) -> usize {
        self.handler.max_batch().max(1)
    }

    /// A success answered from the cache.
    fn hit(&self, record: Record, response: crate::outcome::ModelResponse, start: Instant) -> Outcome {
        Outcome::Success(Box::new(Success {
            record,
            response,
            attempts: 0,
            latency: start.elapsed(),
            model: self.model_id.clone(),
        }))
    }

    /// The outcome of a call the executor finished, stored in the cache when it succeeded.
    fn settle(
        &self,
        record: Record,
        result: Result<Done<crate::outcome::ModelResponse>, Failed>,
        key: Option<&CacheKey>,
        start: Instant,
    ) -> Outcome {
        match result {
            Ok(done) => {
                if let (Some(cache), Some(k)) = (&self.cache, key) {
                    cache.put(*k, &done.value);
                }
                self.metrics.record_success(done.value.usage.prompt_tokens, done.value.usage.output_tokens);
                Outcome::Success(Box::new(Success {
                    record,
                    response: done.value,
                    attempts: done.attempts,
                    latency: start.elapsed(),
                    model: self.model_id.clone(),
                }))
            }
            Err(failed) => {
                let error = if failed.cancelled {
                    let reason = self.stop_reason().map(|r| r.message).unwrap_or_default();
                    ModelError::new(ErrorKind::Aborted, format!("not finished: the run stopped ({reason})"))
                } else {
                    failed.error
                };
                self.metrics.record_failure(error.kind);
                self.metrics.record_failure_example(record.id.as_str(), error.kind, &error.message);
                Outcome::Failure(Box::new(Failure::of(record, error, failed.attempts)))
            }
        }
    }

    /// The request `record` makes: its own system text and parameters over the run's (what a
    /// batch job is sent, so that it asks exactly what an online call would).
    pub fn request_for(&self, record: &Record) -> ModelRequest {
        self.request_of(record)
    }

    /// The record's answer from the response cache, as its outcome, if the cache has one.
    pub fn answer_from_cache(&self, record: &Record) -> Option<Outcome> {
        let start = Instant::now();
        let key = self.cache.as_ref().map(|_| cache_key(&self.source, &self.request_of(record), &record.id));
        self.cached(key.as_ref()).map(|response| self.hit(record.clone(), response, start))
    }

    /// The outcome of a record answered elsewhere (a provider batch job), stored in the cache
    /// and counted as the driver's own answers are.
    pub fn settle_answer(&self, record: Record, result: Result<ModelResponse, ModelError>, since: Instant) -> Outcome {
        let key = self.cache.as_ref().map(|_| cache_key(&self.source, &self.request_of(&record), &record.id));
        let result = match result {
            Ok(value) => Ok(Done { value, attempts: 1, latency: since.elapsed() }),
            Err(error) => Err(Failed { error, attempts: 1, cancelled: false }),
        };
        self.settle(record, result, key.as_ref(), since)
    }

    /// Takes one record to its outcome.
    pub async fn run(&self, record: Record) -> Outcome {
        self.run_with(record, None::<fn(StreamEvent) -> std::future::Ready<()>>).await
    }

    /// Takes one record to its outcome through a streamed call, handing each piece of the
    /// answer to `on_event` as it arrives ([`StreamEvent::Restart`] when a cut stream is
    /// made again). An answer from the response cache comes as one piece. Endpoints that
    /// cannot stream answer the whole text as one piece.
    pub async fn run_streamed<E, EFut>(&self, record: Record, mut on_event: E) -> Outcome
    where
        E: FnMut(StreamEvent) -> EFut,
        EFut: Future<Output = ()>,
    {
        // An endpoint that cannot stream is called plainly.
        if !self.handler.streams() {
            let outcome = self.run(record).await;
            if let Outcome::Success(s) = &outcome {
                one_piece(&mut on_event, &s.response).await;
            }
            return outcome;
        }
        self.run_with(record, Some(on_event)).await
    }

    async fn run_with<E, EFut>(&self, record: Record, mut on_event: Option<E>) -> Outcome
    where
        E: FnMut(StreamEvent) -> EFut,
        EFut: Future<Output = ()>,
    {
        let start = Instant::now();
        let mut request = self.request_of(&record);
        // Media is read now and let go with the request, once the record has its answer. A
        // read is no call paid for: a run that stops (Ctrl-C) gives it up at once, and the
        // record is not finished, rather than waiting out a slow URL's fetches.
        let read = tokio::select! {
            read = self.parts_of(&record) => read,
            _ = self.rules.cancel.cancelled(), if !record.media.is_empty() => {
                let error = ModelError::new(ErrorKind::Aborted, "the run stopped while its media was read");
                let failed = Failed { error, attempts: 0, cancelled: true };
                return self.settle(record, Err(failed), None, start);
            }
        };
        let read = match read {
            Ok(read) => read,
            Err(e) => {
                let failed = Failed { error: e, attempts: 0, cancelled: false };
                return self.settle(record, Err(failed), None, start);
            }
        };
        request.media = read.keyed();
        let key = self.cache.as_ref().map(|_| cache_key(&self.source, &request, &record.id));
        let hit = |record: Record, response: ModelResponse, on_event: Option<E>| async move {
            if let Some(mut e) = on_event {
                one_piece(&mut e, &response).await;
            }
            self.hit(record, response, start)
        };
        if let Some(response) = self.cached(key.as_ref()) {
            return hit(record, response, on_event).await;
        }
        // Not answered before: large parts are uploaded now (and their bytes let go).
        // The parts' share of the media budget, held until the record has its answer.
        let _held = match read.uploaded(self.handler.as_ref()).await {
            Ok((parts, held)) => {
                request.media = parts;
                held
            }
            Err(e) => {
                let failed = Failed { error: e, attempts: 0, cancelled: false };
                return self.settle(record, Err(failed), None, start);
            }
        };
        // One request at a time per deterministic key: the others then find its answer cached.
        let _single = match (&key, is_deterministic(&request.params)) {
            (Some(k), true) => {
                let m = self.inflight.lock().unwrap_or_else(|e| e.into_inner()).entry(*k).or_default().clone();
                Some(m.lock_owned().await)
            }
            _ => None,
        };
        if _single.is_some() {
            if let Some(response) = self.cached(key.as_ref()) {
                return hit(record, response, on_event).await;
            }
        }
        let weight = self.weight_of(&request);
        let cancel = &self.rules.cancel;
        let schema = self.schema_for(&request);
        let check = |r: &ModelResponse| schema.as_ref().and_then(|s| s.invalid(r));
        let result = match on_event.take() {
            Some(e) => {
                let open = |at: usize| self.handlers[at].generate_stream(&request);
                let mut result = self.executor.run_stream_at(weight, cancel, open, e, Some(&check)).await;
                if let Ok(done) = &mut result {
                    for h in &self.handlers {
                        done.value.text = h.masked(&done.value.text);
                    }
                }
                result
            }
            None if schema.is_some() => {
                let call = |at: usize| {
                    let answer = self.handlers[at].generate(&request);
                    let check = &check;
                    async move { answer.await.map(|response| Checked { invalid: check(&response), response }) }
                };
                let done = self.executor.run_at(weight, cancel, call).await;
                done.map(|d| Done { value: d.value.response, attempts: d.attempts, latency: d.latency })
            }
            None => self.executor.run_at(weight, cancel, |at| self.handlers[at].generate(&request)).await,
        };
        if let Some(k) = &key {
            let mut m = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            if m.get(k).is_some_and(|a| Arc::strong_count(a) <= 2) {
                m.remove(k);
            }
        }
        self.settle(record, result, key.as_ref(), start)
    }

    /// Takes records to one outcome each, sending them together in as few calls as the endpoint
    /// allows ([`ModelHandler::max_batch`] requests and [`ModelHandler::max_batch_bytes`] per
    /// call). Cached answers are not sent; deterministic requests repeated within the batch are
    /// sent once and the answer shared. Outcomes come back in the order of `records`.
    pub async fn run_batch(&self, records: Vec<Record>) -> Vec<Outcome> {
        let start = Instant::now();
        let requests: Vec<ModelRequest> = records.iter().map(|r| self.request_of(r)).collect();
        let keys: Vec<Option<CacheKey>> = records
            .iter()
            .zip(&requests)
            .map(|(r, q)| self.cache.as_ref().map(|_| cache_key(&self.source, q, &r.id)))
            .collect();
        let mut outcomes: Vec<Option<Outcome>> = (0..records.len()).map(|_| None).collect();
        // What must be sent: each index that the cache cannot answer, once per deterministic
        // request (`copies` maps a repeat to the index whose answer it takes).
        let mut send: Vec<usize> = Vec::new();
        let mut copies: Vec<(usize, usize)> = Vec::new();
        let mut first_of: HashMap<CacheKey, usize> = HashMap::new();
        for (i, record) in records.iter().enumerate() {
            if let Some(response) = self.cached(keys[i].as_ref()) {
                outcomes[i] = Some(self.hit(record.clone(), response, start));
                continue;
            }
            let shared = is_deterministic(&requests[i].params).then(|| {
                // Deterministic keys do not depend on the record, so equal keys mean equal
                // requests; without a cache, the request itself is compared.
                keys[i].unwrap_or_else(|| cache_key(&self.source, &requests[i], &record.id))
            });
            match shared.and_then(|k| first_of.get(&k).copied()) {
                Some(first) => copies.push((i, first)),
                None => {
                    if let Some(k) = shared {
                        first_of.insert(k, i);
                    }
                    send.push(i);
                }
            }
        }
        // Calls: at most max_batch requests and max_batch_bytes each.
        let (max_items, max_bytes) = (self.max_batch(), self.handler.max_batch_bytes().unwrap_or(usize::MAX));
        let mut calls: Vec<Vec<usize>> = Vec::new();
        let mut bytes = 0usize;
        for i in send {
            let b = self.handler.request_bytes(&requests[i]);
            match calls.last_mut() {
                Some(c) if c.len() < max_items && bytes.saturating_add(b) <= max_bytes => {
                    c.push(i);
                    bytes += b;
                }
                _ => {
                    calls.push(vec![i]);
                    bytes = b;
                }
            }
        }
        // Each request's weight, once (a tokenizer may be behind it), for every attempt of its call.
        let weights: Vec<u64> = requests.iter().map(|r| self.weight_of(r).tokens).collect();
        let results = futures::future::join_all(calls.iter().map(|call| {
            let (requests, weights) = (&requests, &weights);
            self.executor.run_batch_at(
                call.len(),
                |items: &[usize]| Weight { tokens: items.iter().map(|&j| weights[call[j]]).sum() },
                &self.rules.cancel,
                move |at: usize, items: Vec<usize>| {
                    let chunk: Vec<ModelRequest> = items.iter().map(|&j| requests[call[j]].clone()).collect();
                    let tokens: Vec<u64> = items.iter().map(|&j| weights[call[j]]).collect();
                    async move {
                        // Counted as sent (retries and the halves of a split call included).
                        self.metrics.record_batch(&tokens);
                        self.handlers[at].generate_batch(&chunk).await
                    }
                },
            )
        }))
        .await;
        let mut answers: HashMap<usize, Result<Done<crate::outcome::ModelResponse>, Failed>> = HashMap::new();
        for (call, result) in calls.iter().zip(results) {
            for (&i, r) in call.iter().zip(result) {
                answers.insert(i, r);
            }
        }
        for &(copy, first) in &copies {
            if let Some(a) = answers.get(&first) {
                answers.insert(copy, a.clone());
            }
        }
        let mut out = Vec::with_capacity(records.len());
        for (i, record) in records.into_iter().enumerate() {
            match outcomes[i].take() {
                Some(o) => out.push(o),
                None => {
                    let result = answers.remove(&i).unwrap_or_else(|| {
                        Err(Failed {
                            error: ModelError::new(ErrorKind::Aborted, "the batch ended without an answer for it"),
                            attempts: 0,
                            cancelled: true,
                        })
                    });
                    out.push(self.settle(record, result, keys[i].as_ref(), start));
                }
            }
        }
        out
    }
}

/// Hands an answer that came whole (from the cache, or from an endpoint that cannot stream)
/// to a streaming consumer, as one piece.
async fn one_piece<E, EFut>(on_event: &mut E, response: &ModelResponse)
where
    E: FnMut(StreamEvent) -> EFut,
    EFut: Future<Output = ()>,
{
    if !response.text.is_empty() {
        on_event(StreamEvent::Text(response.text.clone())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::{ModelResponse, Usage};
    use crate::record::RecordId;
    use crate::throttle::ThrottleSettings;
    use std::collections::VecDeque;

    /// The media budget: a record's share shrinks to what it read; one that needs more than is
    /// free waits, holding nothing, until another lets its share go; a part over the whole
    /// budget takes all of it rather than waiting forever.
    #[tokio::test]
    async fn the_media_budget_holds_what_records_read_and_makes_the_rest_wait() {
        static BUDGET: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(10);
        const WHOLE: usize = 10 * 1024;
        let a = fit(&BUDGET, WHOLE, None, 4 * 1024).await;
        assert_eq!(BUDGET.available_permits(), 6);
        let a = fit(&BUDGET, WHOLE, a, 1500).await;
        assert_eq!((a.as_ref().unwrap().num_permits(), BUDGET.available_permits()), (2, 8), "the guess shrunk");
        let b = fit(&BUDGET, WHOLE, None, 8 * 1024).await;
        assert_eq!(BUDGET.available_permits(), 0);
        // b wants more than is free: it lets its 8 go (first in line for them) and waits for 9
        // until a lets go.
        let grow = tokio::spawn(fit(&BUDGET, WHOLE, b, 9 * 1024));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!grow.is_finished(), "waits while a holds its share");
        drop(a);
        let b = grow.await.unwrap();
        assert_eq!(b.as_ref().unwrap().num_permits(), 9);
        drop(b);
        let huge = fit(&BUDGET, WHOLE, None, 50 * 1024).await;
        assert_eq!(huge.as_ref().unwrap().num_permits(), 10, "the whole budget, not a wait forever");
        drop(huge);
        assert!(fit(&BUDGET, WHOLE, None, 0).await.is_none());
        assert_eq!(BUDGET.available_permits(), 10);
    }

    /// A handler that replays a script of results, one per call, and counts calls.
    struct Scripted {
        script: Mutex<VecDeque<Result<Duration, ModelError>>>,
        calls: AtomicU64,
    }

    #[async_trait::async_trait]
    impl ModelHandler for Scripted {
        async fn generate(&self, _r: &ModelRequest) -> Result<ModelResponse, ModelError> {
            self.calls.fetch_add(1, Relaxed);
            let next = self.script.lock().unwrap().pop_front().unwrap_or(Ok(Duration::ZERO));
            let delay = next?;
            tokio::time::sleep(delay).await;
            Ok(ModelResponse {
                text: "ok".into(),
                finish_reason: "stop".into(),
                usage: Usage { prompt_tokens: 1, output_tokens: 2, total_tokens: 3 },
                model_version: None,
                limits: None,
                embedding: None,
            })
        }
        fn model_id(&self) -> &str {
            "test/scripted"
        }
    }

    fn record(id: &str) -> Record {
        Record::new(RecordId::from(id), 1, "p".into(), Default::default())
    }

    fn driver(script: Vec<Result<Duration, ModelError>>, settings: DriverSettings) -> (Driver, Arc<Scripted>) {
        let h = Arc::new(Scripted { script: Mutex::new(script.into()), calls: AtomicU64::new(0) });
        let throttle = Arc::new(Throttle::new(&ThrottleSettings {
            max_concurrency: 4,
            adaptive: false,
            ..ThrottleSettings::default()
        }));
        (Driver::new(h.clone(), throttle, settings, Arc::new(RunMetrics::default())), h)
    }

    /// Takes uploads of up to 2 GB, as the Gemini API's Files API does; answers nothing.
    struct Uploads;

    #[async_trait::async_trait]
    impl ModelHandler for Uploads {
        async fn generate(&self, _r: &ModelRequest) -> Result<ModelResponse, ModelError> {
            Err(ModelError::new(ErrorKind::Server, "not called"))
        }
        fn model_id(&self) -> &str {
            "test/uploads"
        }
        fn max_upload_bytes(&self) -> Option<u64> {
            Some(2_000_000_000)
        }
    }

    /// Says every source is a file of this many bytes.
    struct OfSize(u64);

    #[async_trait::async_trait]
    impl MediaLoader for OfSize {
        async fn load(&self, _source: &str, max: usize) -> Result<bytes::Bytes, crate::media::MediaError> {
            Err(crate::media::MediaError::too_large(self.0, max))
        }
    }

    #[tokio::test]
    async fn a_part_over_the_upload_limit_is_said_to_be_over_that_limit() {
        // Read again in the turn for large parts, a 3 GB file was reported as over "the
        // 2000000000 bytes left for a request's inline parts": the inline limit's words for
        // the upload limit.
        let throttle = Arc::new(Throttle::new(&ThrottleSettings::default()));
        let d = Driver::new(Arc::new(Uploads), throttle, DriverSettings::default(), Arc::new(RunMetrics::default()))
            .with_media(Arc::new(OfSize(3_000_000_000)));
        let mut r = record("a");
        r.media = vec![MediaRef { field: "image".into(), source: MediaSource::Named("big.png".into()), mime: None }];
        match d.run(r).await {
            Outcome::Failure(f) => {
                assert_eq!(f.error.kind, ErrorKind::InvalidInput);
                assert!(
                    f.error.message.contains("3000000000 bytes, over the 2000000000 bytes an upload takes"),
                    "{}",
                    f.error.message
                );
            }
            Outcome::Success(_) => panic!("a 3 GB part was sent"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn transient_errors_are_retried_until_success() {
        let (d, h) = driver(
            vec![
                Err(ModelError::new(ErrorKind::Server, "500")),
                Err(ModelError::new(ErrorKind::Transport, "reset")),
                Ok(Duration::ZERO),
            ],
            DriverSettings::default(),
        );
        match d.run(record("a")).await {
            Outcome::Success(s) => assert_eq!(s.attempts, 3),
            Outcome::Failure(f) => panic!("{:?}", f.error),
        }
        assert_eq!(h.calls.load(Relaxed), 3);
        assert_eq!(RunMetrics::get(&d.metrics().retries), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_errors_fail_at_once() {
        let (d, h) = driver(vec![Err(ModelError::new(ErrorKind::Blocked, "SAFETY"))], DriverSettings::default());
        match d.run(record("a")).await {
            Outcome::Failure(f) => {
                assert_eq!(f.error.kind, ErrorKind::Blocked);
                assert_eq!(f.attempts, 1);
            }
            Outcome::Success(_) => panic!(),
        }
        assert_eq!(h.calls.load(Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn timeout_cancels_the_call_and_retries() {
        let settings = DriverSettings { timeout: Duration::from_secs(1), ..DriverSettings::default() };
        let (d, h) = driver(vec![Ok(Duration::from_secs(3600)), Ok(Duration::ZERO)], settings);
        let t0 = Instant::now();
        match d.run(record("a")).await {
            Outcome::Success(s) => assert_eq!(s.attempts, 2),
            Outcome::Failure(f) => panic!("{:?}", f.error),
        }
        // One second for the timeout plus at most the first backoff ceiling, not an hour.
        assert!(t0.elapsed() <= Duration::from_millis(1250), "{:?}", t0.elapsed());
        assert_eq!(h.calls.load(Relaxed), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn advised_delay_is_honoured() {
        let e =
            ModelError::new(ErrorKind::RateLimited, "429").with_hint(RetryHint::Later(Some(Duration::from_secs(7))));
        let (d, _) = driver(vec![Err(e), Ok(Duration::ZERO)], DriverSettings::default());
        let t0 = Instant::now();
        assert!(matches!(d.run(record("a")).await, Outcome::Success(_)));
        assert!(t0.elapsed() >= Duration::from_secs(7));
        assert!(t0.elapsed() < Duration::from_secs(8));
        assert_eq!(RunMetrics::get(&d.metrics().rate_limited), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_max_retries_with_the_last_error() {
        let settings = DriverSettings {
            retry: RetryPolicy { max_retries: 2, ..RetryPolicy::default() },
            ..DriverSettings::default()
        };
        let script = (0..5).map(|_| Err(ModelError::new(ErrorKind::Server, "500").with_status(500))).collect();
        let (d, h) = driver(script, settings);
        match d.run(record("a")).await {
            Outcome::Failure(f) => {
                assert_eq!(f.error.kind, ErrorKind::Server);
                assert_eq!(f.error.status, Some(500));
                assert_eq!(f.attempts, 3);
            }
            Outcome::Success(_) => panic!(),
        }
        assert_eq!(h.calls.load(Relaxed), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn rejected_credentials_stop_the_run() {
        let script = (0..10).map(|_| Err(ModelError::new(ErrorKind::Auth, "401").with_status(401))).collect();
        let (d, h) = driver(script, DriverSettings::default());
        for i in 0..3 {
            assert!(matches!(d.run(record(&i.to_string())).await, Outcome::Failure(_)));
        }
        assert!(d.is_stopped());
        match d.run(record("later")).await {
            Outcome::Failure(f) => assert_eq!(f.error.kind, ErrorKind::Aborted),
            Outcome::Success(_) => panic!(),
        }
        assert_eq!(h.calls.load(Relaxed), 3, "no call after the stop");
        assert_eq!(d.stop_reason().unwrap().kind, ErrorKind::Auth);
    }

    /// A server whose every answer cannot be read (a tester's broken 200s: 9 calls per record,
    /// each billable) stops the run after the first few, when nothing has succeeded; after a
    /// success, an unreadable answer is the record's own and is retried as before.
    #[tokio::test(start_paused = true)]
    async fn answers_that_cannot_be_read_from_the_start_stop_the_run() {
        let unreadable = || Err(ModelError::new(ErrorKind::MalformedResponse, "the answer is not JSON"));
        let settings = DriverSettings {
            retry: RetryPolicy { max_retries: 0, ..RetryPolicy::default() },
            ..DriverSettings::default()
        };
        let (d, h) = driver((0..100).map(|_| unreadable()).collect(), settings);
        for i in 0..40 {
            let _ = d.run(record(&i.to_string())).await;
            if d.is_stopped() {
                break;
            }
        }
        assert!(d.is_stopped());
        assert_eq!(h.calls.load(Relaxed), UNREADABLE_TO_STOP, "one call for each record, then the stop");
        assert_eq!(d.stop_reason().unwrap().kind, ErrorKind::MalformedResponse);
        let mut script: Vec<Result<Duration, ModelError>> = vec![Ok(Duration::from_millis(1))];
        script.extend((0..40).map(|_| unreadable()));
        let (d, _) = driver(script, DriverSettings::default());
        for i in 0..4 {
            let _ = d.run(record(&i.to_string())).await;
        }
        assert!(!d.is_stopped(), "after a success, unreadable answers are the records' own");
    }

    /// Issue #29, item 16: credentials revoked part-way (answers, then only refusals) stop the
    /// run after a run of refusals, instead of failing every record left.
    #[tokio::test(start_paused = true)]
    async fn credentials_revoked_part_way_stop_the_run() {
        let mut script: Vec<Result<Duration, ModelError>> = (0..5).map(|_| Ok(Duration::from_millis(1))).collect();
        script.extend((0..200).map(|_| Err(ModelError::new(ErrorKind::Auth, "401 revoked").with_status(401))));
        let (d, h) = driver(script, DriverSettings::default());
        for i in 0..100 {
            let _ = d.run(record(&i.to_string())).await;
            if d.is_stopped() {
                break;
            }
        }
        assert!(d.is_stopped(), "{} calls", h.calls.load(Relaxed));
        assert_eq!(h.calls.load(Relaxed), 5 + 3 * REVOKED_FACTOR, "refusals in a row until the stop");
        assert!(d.stop_reason().unwrap().message.contains("stopped working"));
    }

    /// An endpoint that answered and then went away (connection refused on every call) stops
    /// the run once connecting has failed for GONE_ENDPOINT_AFTER with no answer between,
    /// instead of using up every record's retries into an error row; a refusal now and then
    /// between answers does not.
    #[tokio::test(start_paused = true)]
    async fn an_endpoint_that_goes_away_stops_the_run() {
        let refused = || Err(ModelError { unreachable: true, ..ModelError::new(ErrorKind::Transport, "refused") });
        // Answers with a refused connection now and then, for longer than the bound: no stop.
        let mut script: Vec<Result<Duration, ModelError>> = Vec::new();
        for _ in 0..30 {
            script.extend([refused(), Ok(Duration::from_secs(5))]);
        }
        let (d, _) = driver(script, DriverSettings::default());
        for i in 0..30 {
            assert!(matches!(d.run(record(&i.to_string())).await, Outcome::Success(_)));
        }
        assert!(!d.is_stopped(), "answers between refusals");
        // Answers, then only refusals.
        let mut script: Vec<Result<Duration, ModelError>> = (0..3).map(|_| Ok(Duration::from_millis(1))).collect();
        script.extend((0..10_000).map(|_| refused()));
        let (d, h) = driver(script, DriverSettings::default());
        let started = Instant::now();
        let mut failed = 0;
        for i in 0..1000 {
            if let Outcome::Failure(f) = d.run(record(&i.to_string())).await {
                failed += usize::from(f.error.kind == ErrorKind::Transport);
            }
            if d.is_stopped() {
                break;
            }
        }
        assert!(d.is_stopped(), "{} calls, {failed} transport rows", h.calls.load(Relaxed));
        assert_eq!(failed, 1, "one record used up its retries, then the run stopped");
        assert!(started.elapsed() < GONE_ENDPOINT_AFTER, "{:?}", started.elapsed());
        assert!(d.stop_reason().unwrap().message.contains("stopped answering"));
        assert!(matches!(d.run(record("later")).await, Outcome::Failure(f) if f.error.kind == ErrorKind::Aborted));
    }

    /// A handler that takes up to four requests per call, answers each with its prompt, and
    /// fails the prompts named "flaky" once.
    struct Batched {
        calls: Mutex<Vec<Vec<String>>>,
        flaked: AtomicBool,
    }

    #[async_trait::async_trait]
    impl ModelHandler for Batched {
        async fn generate(&self, r: &ModelRequest) -> Result<ModelResponse, ModelError> {
            self.generate_batch(std::slice::from_ref(r)).await?.pop().unwrap()
        }
        fn model_id(&self) -> &str {
            "test/batched"
        }
        fn max_batch(&self) -> usize {
            4
        }
        async fn generate_batch(&self, requests: &[ModelRequest]) -> crate::handler::BatchAnswer {
            self.calls.lock().unwrap().push(requests.iter().map(|r| r.prompt.clone()).collect());
            Ok(requests
                .iter()
                .map(|r| {
                    if r.prompt == "flaky" && !self.flaked.swap(true, Relaxed) {
                        Err(ModelError::new(ErrorKind::Server, "once"))
                    } else {
                        Ok(ModelResponse { text: format!("re: {}", r.prompt), ..ModelResponse::default() })
                    }
                })
                .collect())
        }
    }

    #[derive(Default)]
    struct MapCache(Mutex<HashMap<CacheKey, ModelResponse>>);

    impl ResponseCache for MapCache {
        fn get(&self, key: &CacheKey) -> Option<ModelResponse> {
            self.0.lock().unwrap().get(key).cloned()
        }
        fn put(&self, key: CacheKey, response: &ModelResponse) {
            self.0.lock().unwrap().insert(key, response.clone());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_is_split_by_the_endpoints_limit_and_answers_each_record_in_order() {
        let h = Arc::new(Batched { calls: Mutex::new(Vec::new()), flaked: AtomicBool::new(false) });
        let throttle = Arc::new(Throttle::new(&ThrottleSettings::default()));
        let settings = DriverSettings {
            params: Arc::new(GenParams { temperature: Some(0.0), ..GenParams::default() }),
            ..DriverSettings::default()
        };
        let cache = Arc::new(MapCache::default());
        let d = Driver::new(h.clone(), throttle, settings, Arc::new(RunMetrics::default())).with_cache(cache);
        let mk = |i: usize, p: &str| {
            Record::new(RecordId::from(format!("r{i}").as_str()), i as u64, p.into(), Default::default())
        };
        // Nine records, two of them the same deterministic prompt, one failing once.
        let prompts = ["a", "b", "same", "c", "flaky", "same", "d", "e", "f"];
        let records: Vec<Record> = prompts.iter().enumerate().map(|(i, p)| mk(i, p)).collect();
        let out = d.run_batch(records).await;
        let texts: Vec<String> = out
            .iter()
            .map(|o| match o {
                Outcome::Success(s) => s.response.text.clone(),
                Outcome::Failure(f) => panic!("{:?}", f.error),
            })
            .collect();
        assert_eq!(texts, prompts.iter().map(|p| format!("re: {p}")).collect::<Vec<_>>());
        let calls = h.calls.lock().unwrap().clone();
        // Eight distinct prompts: two calls of four, then the flaky one alone again.
        assert_eq!(calls.len(), 3, "{calls:?}");
        assert!(calls[..2].iter().all(|c| c.len() == 4));
        assert_eq!(calls[2], vec!["flaky".to_string()]);
        assert_eq!(calls.iter().flatten().filter(|p| *p == "same").count(), 1, "a repeated prompt was paid once");
        // Everything is cached now: the same batch again makes no call.
        let again = d.run_batch(prompts.iter().enumerate().map(|(i, p)| mk(i, p)).collect()).await;
        assert!(again.iter().all(|o| matches!(o, Outcome::Success(s) if s.attempts == 0)));
        assert_eq!(h.calls.lock().unwrap().len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn spent_daily_quota_stops_the_run() {
        let (d, _) = driver(
            vec![Err(ModelError::new(ErrorKind::QuotaExhausted, "per-day quota spent"))],
            DriverSettings::default(),
        );
        assert!(matches!(d.run(record("a")).await, Outcome::Failure(_)));
        assert!(d.is_stopped());
    }
}
