//! The driver: takes a record to exactly one outcome.
//!
//! For each attempt it waits for the gate (a server-advised pause), takes a concurrency permit,
//! makes the call under a hard timeout (the call's future is dropped when time is up, which
//! cancels the request), and reports the result to the limiter. The retry policy decides what
//! happens after a failure; the driver only carries the decision out. Only the failed record is
//! retried, never a batch.
//!
//! A run stops early, rather than burn through its input, when an error says no record can
//! succeed (a spent daily quota), or when credentials are rejected by the first calls before any
//! success. After a stop, records not yet tried end as `aborted` failures without a call.

use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use crate::cache::{cache_key, is_deterministic, ResponseCache};
use crate::error::{ErrorKind, ModelError, RetryHint};
use crate::handler::{ModelHandler, ModelRequest};
use crate::limit::{CallResult, ConcurrencyLimit, Gate};
use crate::metrics::RunMetrics;
use crate::outcome::{Failure, Outcome, Success};
use crate::params::GenParams;
use crate::record::Record;
use crate::retry::{Decision, RetryPolicy};
use crate::throttle::{RateLimiter, SreThrottler};

/// How long connecting may fail, with nothing ever answering, before the run stops: long enough
/// for a server that is still starting, short enough not to burn through the input.
const DEAD_ENDPOINT_AFTER: Duration = Duration::from_secs(5);

/// How long a call rejected by the SRE throttler waits before asking again.
const SRE_DELAY: Duration = Duration::from_millis(500);

/// Push-back that says the endpoint is over capacity (for the concurrency limit), as opposed to a
/// quota (for the rate budgets): a 503, or a 429 that names no quota and advises no delay.
fn is_pushback(e: &ModelError) -> bool {
    e.status == Some(503) || (e.kind == ErrorKind::RateLimited && e.quota.is_none() && e.retry_after().is_none())
}

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

/// Runs records through a model handler.
pub struct Driver {
    handler: Arc<dyn ModelHandler>,
    limit: Arc<dyn ConcurrencyLimit>,
    gate: Arc<Gate>,
    settings: DriverSettings,
    metrics: Arc<RunMetrics>,
    stopped: AtomicBool,
    stop_reason: Mutex<Option<StopReason>>,
    auth_failures: AtomicU64,
    answered: AtomicBool,
    first_unreachable: Mutex<Option<Instant>>,
    seed: AtomicU64,
    wake: tokio::sync::Notify,
    cache: Option<Arc<dyn ResponseCache>>,
    rate: Option<Arc<RateLimiter>>,
    sre: Option<Mutex<SreThrottler>>,
    model_id: String,
}

impl Driver {
    /// A driver over `handler`, limited by `limit`, counting into `metrics`.
    pub fn new(
        handler: Arc<dyn ModelHandler>,
        limit: Arc<dyn ConcurrencyLimit>,
        settings: DriverSettings,
        metrics: Arc<RunMetrics>,
    ) -> Self {
        Self {
            limit,
            gate: Arc::new(Gate::default()),
            settings,
            metrics,
            stopped: AtomicBool::new(false),
            stop_reason: Mutex::new(None),
            auth_failures: AtomicU64::new(0),
            answered: AtomicBool::new(false),
            first_unreachable: Mutex::new(None),
            seed: AtomicU64::new(0x5eed),
            wake: tokio::sync::Notify::new(),
            model_id: handler.model_id().to_string(),
            cache: None,
            rate: None,
            sre: None,
            handler,
        }
    }

    /// Keeps sends within the rate budgets of `rate`.
    pub fn with_rate(mut self, rate: Arc<RateLimiter>) -> Self {
        self.rate = Some(rate);
        self
    }

    /// Adds Beam's client-side SRE throttler.
    pub fn with_sre(mut self, sre: SreThrottler) -> Self {
        self.sre = Some(Mutex::new(sre));
        self
    }

    /// The concurrency limit in force.
    pub fn concurrency(&self) -> usize {
        self.limit.current()
    }

    /// The rate limits in force.
    pub fn rate_snapshot(&self) -> Option<crate::throttle::RateSnapshot> {
        self.rate.as_ref().map(|r| r.snapshot())
    }

    /// Answers from `cache` when it has the request, and stores every new answer in it.
    pub fn with_cache(mut self, cache: Arc<dyn ResponseCache>) -> Self {
        self.cache = Some(cache);
        self
    }

    /// The run's metrics.
    pub fn metrics(&self) -> &Arc<RunMetrics> {
        &self.metrics
    }

    /// Why the run stopped early, if it did.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop_reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// True once the run has stopped early.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Relaxed)
    }

    /// Stops the run: records not yet tried end as `aborted`.
    pub fn stop(&self, reason: StopReason) {
        let mut r = self.stop_reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            tracing::error!("stopping the run: {}", reason.message);
            *r = Some(reason);
        }
        self.stopped.store(true, Relaxed);
        // Records sleeping in backoff or held by the gate give up at once.
        self.wake.notify_waiters();
    }

    /// Sleeps for `d`, or less if the run stops meanwhile.
    async fn pause(&self, d: Duration) {
        let woken = self.wake.notified();
        if self.is_stopped() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = woken => {}
        }
    }

    /// Counts a failure that never reached the driver (invalid input) and passes it on.
    pub fn reject(&self, failure: Box<Failure>) -> Outcome {
        self.metrics.record_failure(failure.error.kind);
        Outcome::Failure(failure)
    }

    /// Takes one record to its outcome, retrying as the policy decides.
    pub async fn run(&self, record: Record) -> Outcome {
        let request = ModelRequest {
            prompt: record.prompt.clone(),
            system: self.settings.system.clone(),
            params: self.settings.params.clone(),
        };
        let mut rng = SmallRng::seed_from_u64(self.seed.fetch_add(1, Relaxed));
        let start = Instant::now();
        let key = self.cache.as_ref().map(|c| (c, cache_key(&self.model_id, &request, &record.id)));
        let cached = |record: Record, attempts: u32| {
            let (cache, key) = key.as_ref()?;
            let response = cache.get(key)?;
            self.metrics.cache_hits.fetch_add(1, Relaxed);
            self.metrics.record_success(response.usage.prompt_tokens, response.usage.output_tokens);
            Some(Outcome::Success(Box::new(Success { record, response, attempts, latency: start.elapsed() })))
        };
        if key.is_some() {
            if let Some(hit) = cached(record.clone(), 0) {
                return hit;
            }
        }
        let prompt_chars = if self.rate.is_some() {
            request.prompt.chars().count() + request.system.as_deref().map_or(0, |s| s.chars().count())
        } else {
            0
        };
        let mut attempts = 0u32;
        loop {
            if self.is_stopped() {
                let reason = self.stop_reason().map(|r| r.message).unwrap_or_default();
                return self.fail(
                    record,
                    ModelError::new(ErrorKind::Aborted, format!("not tried: the run stopped ({reason})")),
                    attempts,
                );
            }
            let held = tokio::select! {
                held = self.gate.wait() => held,
                _ = self.wake.notified() => continue,
            };
            if !held.is_zero() {
                self.metrics.add_throttled(held);
            }
            let (permit, level) = self.limit.acquire().await;
            if self.is_stopped() {
                // The run stopped while this record waited for a slot.
                continue;
            }
            if key.is_some() && is_deterministic(&request.params) {
                // A shared answer may have arrived while this record waited for its slot (an
                // identical request ahead of it): ask again before paying for it.
                if let Some(hit) = cached(record.clone(), attempts) {
                    return hit;
                }
            }
            if let Some(sre) = &self.sre {
                while sre.lock().unwrap_or_else(|e| e.into_inner()).throttle(Instant::now()) && !self.is_stopped() {
                    self.metrics.add_throttled(SRE_DELAY);
                    self.pause(SRE_DELAY).await;
                }
            }
            let ticket = match &self.rate {
                Some(rate) => {
                    let estimate = rate.estimate(prompt_chars, request.params.max_output_tokens);
                    let ticket = tokio::select! {
                        t = rate.acquire(estimate) => t,
                        _ = self.wake.notified() => continue,
                    };
                    if !ticket.waited.is_zero() {
                        self.metrics.add_throttled(ticket.waited);
                    }
                    Some(ticket)
                }
                None => None,
            };
            attempts += 1;
            self.metrics.calls.fetch_add(1, Relaxed);
            if attempts > 1 {
                self.metrics.retries.fetch_add(1, Relaxed);
            }
            let t0 = Instant::now();
            let result = match tokio::time::timeout(self.settings.timeout, self.handler.generate(&request)).await {
                Ok(r) => r,
                Err(_) => {
                    Err(ModelError::new(ErrorKind::Timeout, format!("no answer within {:?}", self.settings.timeout)))
                }
            };
            let latency = t0.elapsed();
            drop(permit);
            if let (Some(rate), Some(ticket)) = (&self.rate, ticket) {
                rate.complete(ticket, &result);
            }
            let class = match &result {
                Ok(_) => CallResult::Ok,
                Err(e) if is_pushback(e) => CallResult::Backpressure,
                Err(_) => CallResult::Other,
            };
            if let Some(sre) = &self.sre {
                if class != CallResult::Backpressure && !matches!(&result, Err(e) if e.kind == ErrorKind::RateLimited) {
                    sre.lock().unwrap_or_else(|e| e.into_inner()).accepted(Instant::now());
                }
            }
            self.limit.feedback(level, latency, class);
            if !matches!(&result, Err(e) if e.unreachable || e.status.is_none()) {
                self.answered.store(true, Relaxed);
            }
            match result {
                Ok(response) => {
                    if let Some((cache, key)) = &key {
                        cache.put(*key, &response);
                    }
                    self.metrics.record_success(response.usage.prompt_tokens, response.usage.output_tokens);
                    return Outcome::Success(Box::new(Success {
                        record,
                        response,
                        attempts,
                        latency: start.elapsed(),
                    }));
                }
                Err(error) => {
                    if error.kind == ErrorKind::RateLimited {
                        self.metrics.rate_limited.fetch_add(1, Relaxed);
                    }
                    self.check_stop(&error, attempts);
                    match self.settings.retry.decide(attempts, &error, &mut rng) {
                        Decision::GiveUp => return self.fail(record, error, attempts),
                        Decision::Retry(delay) => {
                            if let RetryHint::Later(Some(advised)) = error.hint {
                                self.gate.hold(advised);
                            }
                            tracing::debug!(id = %record.id, attempts, ?delay, "retrying: {error}");
                            self.pause(delay).await;
                        }
                    }
                }
            }
        }
    }

    fn fail(&self, record: Record, error: ModelError, attempts: u32) -> Outcome {
        self.metrics.record_failure(error.kind);
        Outcome::Failure(Box::new(Failure::of(record, error, attempts)))
    }

    fn check_stop(&self, error: &ModelError, attempts: u32) {
        // A dead endpoint: no call of the run has ever reached a server, and connecting has
        // failed for a while (a server still starting up gets that long) or this record is out
        // of retries. Every other record would fare the same, so stop, resumable, rather than
        // burn through the input.
        let dead = error.unreachable && !self.answered.load(Relaxed) && {
            let now = Instant::now();
            let first = *self.first_unreachable.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(now);
            now.duration_since(first) >= DEAD_ENDPOINT_AFTER || attempts > self.settings.retry.max_retries
        };
        if dead {
            self.stop(StopReason {
                kind: ErrorKind::Transport,
                message: format!(
                    "cannot connect to the endpoint (nothing has answered any call yet): {}; check --base-url and that the server is running",
                    error.message
                ),
            });
        } else if error.hint == RetryHint::StopRun {
            self.stop(StopReason { kind: error.kind, message: error.message.clone() });
        } else if error.kind == ErrorKind::Auth {
            let n = self.auth_failures.fetch_add(1, Relaxed) + 1;
            if n >= self.settings.auth_failures_to_stop && RunMetrics::get(&self.metrics.succeeded) == 0 {
                self.stop(StopReason {
                    kind: ErrorKind::Auth,
                    message: format!(
                        "credentials were rejected by the first {n} calls and none succeeded: {}",
                        error.message
                    ),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::FixedLimit;
    use crate::outcome::{ModelResponse, Usage};
    use crate::record::RecordId;
    use std::collections::VecDeque;

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
            })
        }
        fn model_id(&self) -> &str {
            "test/scripted"
        }
    }

    fn record(id: &str) -> Record {
        Record { id: RecordId::from(id), line: 1, prompt: "p".into(), input: Default::default() }
    }

    fn driver(script: Vec<Result<Duration, ModelError>>, settings: DriverSettings) -> (Driver, Arc<Scripted>) {
        let h = Arc::new(Scripted { script: Mutex::new(script.into()), calls: AtomicU64::new(0) });
        (Driver::new(h.clone(), Arc::new(FixedLimit::new(4)), settings, Arc::new(RunMetrics::default())), h)
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
