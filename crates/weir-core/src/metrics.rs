//! Counters of a run, shared by the driver, the progress bar and the summary.
//!
//! Every count is also reported through the `metrics` facade (a no-op until a recorder is
//! installed: `weir run --metrics-listen` installs the Prometheus exporter), from this one
//! place, so the summary and the exported metrics can never disagree.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use crate::error::ErrorKind;

/// Set once an exporter is installed ([`RunMetrics::describe`]): until then no series is
/// reported through the `metrics` facade (it would go nowhere, and cost a few allocations per
/// record).
static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The moment wall-time counters are measured from (the first time one is asked for).
fn epoch() -> tokio::time::Instant {
    static EPOCH: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(tokio::time::Instant::now)
}

/// Live counters of a run, or of one endpoint's model within it.
///
/// An endpoint's counters ([`RunMetrics::of_endpoint`]) carry its model and endpoint as labels
/// of every exported series, and count everything into the run's counters too (the totals the
/// progress bar and the summary read), which export nothing themselves: a series is reported
/// once, by the endpoint it happened at.
#[derive(Debug, Default)]
pub struct RunMetrics {
    /// The labels of every exported series (the model and endpoint; none for a run's totals
    /// when they have no parts).
    labels: Vec<metrics::Label>,
    /// The run's counters, which count what these count but export nothing.
    totals: Option<std::sync::Arc<RunMetrics>>,
    /// Records finished (either way).
    pub done: AtomicU64,
    /// Records that succeeded.
    pub succeeded: AtomicU64,
    /// Records that failed.
    pub failed: AtomicU64,
    /// Calls made.
    pub calls: AtomicU64,
    /// Calls beyond each record's first.
    pub retries: AtomicU64,
    /// Records answered from the response cache, without a call.
    pub cache_hits: AtomicU64,
    /// Prompt and output tokens of those cached answers (in `tokens_in`/`tokens_out` too, but
    /// not paid for by this run).
    cache_tokens: [AtomicU64; 2],
    /// Calls answered with a rate-limit error.
    pub rate_limited: AtomicU64,
    /// Answers that did not match the response schema (each paid for, and tried again).
    pub invalid_outputs: AtomicU64,
    /// Prompt tokens reported by successful calls.
    pub tokens_in: AtomicU64,
    /// Output tokens reported by successful calls.
    pub tokens_out: AtomicU64,
    /// Time calls spent held by a server-advised pause, in microseconds (summed over calls).
    pub throttled_micros: AtomicU64,
    /// Wall time during which at least one call was held by the throttle, in microseconds: what
    /// Beam's `cumulativeThrottlingSeconds` means (a worker's time spent throttled), where the
    /// sum above counts each of many concurrent waits.
    pub throttled_wall_micros: AtomicU64,
    /// The end of the last wait counted into `throttled_wall_micros`, in microseconds since
    /// [`epoch`], so overlapping waits are counted once.
    throttled_until: AtomicU64,
    /// Batched calls sent (every attempt, and each half of a split call; a call of one record to
    /// an endpoint that takes batches counts too).
    pub batches: AtomicU64,
    /// Records those batched calls carried.
    pub batch_items: AtomicU64,
    /// Estimated tokens of the records in batched calls.
    pub batch_tokens: AtomicU64,
    /// The same, as if every record were as long as the longest of its call (what a padded
    /// batch computes).
    pub batch_padded_tokens: AtomicU64,
    /// Records by how long they waited for their batch: counts per [`WAIT_BOUNDS_MS`] bucket.
    batch_waits: [AtomicU64; WAIT_BOUNDS_MS.len() + 1],
    failures_by_kind: Mutex<BTreeMap<ErrorKind, u64>>,
    /// A few recent failed records of each kind (id, message), for a page that shows what is
    /// failing; bounded, whatever fails.
    failure_examples: Mutex<BTreeMap<ErrorKind, std::collections::VecDeque<(String, String)>>>,
    /// Calls that failed, by kind (every attempt, not records: a 429 retried is one here).
    call_errors: Mutex<BTreeMap<ErrorKind, u64>>,
    /// Call latencies and times to first token since a watcher last took them
    /// ([`RunMetrics::take_recent_latencies`]): percentiles over time, not since the start.
    recent_latency: Sketch,
    recent_first_token: Sketch,
    /// Streamed calls: time from sending to the first text.
    first_token: Sketch,
    /// Streamed calls: time between one piece of text and the next.
    inter_token: Sketch,
    /// An endpoint's counters count into these (so they are totals, and export nothing).
    fed: std::sync::atomic::AtomicBool,
}

/// A distribution of durations in constant memory (a DDSketch: quantiles within 1 % of the
/// true value), so a run of millions of streamed tokens can report its percentiles.
#[derive(Default)]
struct Sketch(Mutex<sketches_ddsketch::DDSketch>);

impl std::fmt::Debug for Sketch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sketch")
    }
}

impl Sketch {
    fn add(&self, d: Duration) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).add(d.as_secs_f64());
    }

    /// The summary so far, and empty again.
    fn take(&self) -> Option<Percentiles> {
        let summary = self.summary();
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Default::default();
        summary
    }

    fn summary(&self) -> Option<Percentiles> {
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let q = |q: f64| Duration::from_secs_f64(s.quantile(q).ok().flatten().unwrap_or(0.0).max(0.0));
        (s.count() > 0).then(|| Percentiles { count: s.count() as u64, p50: q(0.5), p95: q(0.95), p99: q(0.99) })
    }
}

/// Percentiles of a distribution of durations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// How many were measured.
    pub count: u64,
    /// The median.
    pub p50: Duration,
    /// The 95th percentile.
    pub p95: Duration,
    /// The 99th percentile.
    pub p99: Duration,
}

/// Upper bounds (milliseconds) of the buckets batch waits are counted in.
pub const WAIT_BOUNDS_MS: [u64; 12] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];

impl RunMetrics {
    /// The counters of `model` at `endpoint`: exported with those labels, and counted into
    /// `totals` (the run's) as well.
    pub fn of_endpoint(totals: Option<std::sync::Arc<RunMetrics>>, model: &str, endpoint: &str) -> Self {
        Self {
            labels: vec![
                metrics::Label::new("model", model.to_string()),
                metrics::Label::new("endpoint", endpoint.to_string()),
            ],
            totals,
            ..Default::default()
        }
    }

    /// The labels of an exported series: this endpoint's, and `extra`.
    fn labels(&self, extra: &[(&'static str, &'static str)]) -> Vec<metrics::Label> {
        let mut labels = self.labels.clone();
        labels.extend(extra.iter().map(|(k, v)| metrics::Label::new(*k, *v)));
        labels
    }

    /// Whether these counters export their series: only once an exporter is installed (a
    /// series is not built for nothing), and then an endpoint's do, and a run's totals only
    /// when nothing counts into them (then they are the only counters there are).
    fn exports(&self) -> bool {
        EXPORTING.load(Relaxed) && (!self.labels.is_empty() || !self.fed.load(Relaxed))
    }

    /// Counts `f` here and in the run's totals (marking them as fed, so they export nothing).
    fn count(&self, f: &dyn Fn(&RunMetrics)) {
        f(self);
        if let Some(t) = &self.totals {
            t.fed.store(true, Relaxed);
            t.count(f);
        }
    }
    /// Counts a record's failure.
    pub fn record_failure(&self, kind: ErrorKind) {
        self.count(&|m| {
            m.failed.fetch_add(1, Relaxed);
            m.done.fetch_add(1, Relaxed);
            *m.failures_by_kind.lock().unwrap_or_else(|e| e.into_inner()).entry(kind).or_default() += 1;
        });
        if self.exports() {
            metrics::counter!("weir_records_total", self.labels(&[("outcome", "failure")])).increment(1);
            metrics::counter!("weir_failures_total", self.labels(&[("kind", kind.as_str())])).increment(1);
        }
    }

    /// Counts a record's success.
    pub fn record_success(&self, tokens_in: u64, tokens_out: u64) {
        self.count(&|m| {
            m.succeeded.fetch_add(1, Relaxed);
            m.done.fetch_add(1, Relaxed);
            m.tokens_in.fetch_add(tokens_in, Relaxed);
            m.tokens_out.fetch_add(tokens_out, Relaxed);
        });
        if self.exports() {
            metrics::counter!("weir_records_total", self.labels(&[("outcome", "success")])).increment(1);
            metrics::counter!("weir_tokens_total", self.labels(&[("direction", "in")])).increment(tokens_in);
            metrics::counter!("weir_tokens_total", self.labels(&[("direction", "out")])).increment(tokens_out);
        }
    }

    /// Counts a call made; `retry` when it was not the first for its record or batch.
    pub fn record_call(&self, retry: bool) {
        self.count(&|m| {
            m.calls.fetch_add(1, Relaxed);
            if retry {
                m.retries.fetch_add(1, Relaxed);
            }
        });
        if self.exports() {
            metrics::counter!("weir_calls_total", self.labels(&[])).increment(1);
            if retry {
                metrics::counter!("weir_retries_total", self.labels(&[])).increment(1);
            }
        }
    }

    /// Counts an answer that did not match the response schema, and its tokens (paid for).
    pub fn record_invalid_output(&self, tokens_in: u64, tokens_out: u64) {
        self.count(&|m| {
            m.invalid_outputs.fetch_add(1, Relaxed);
            m.tokens_in.fetch_add(tokens_in, Relaxed);
            m.tokens_out.fetch_add(tokens_out, Relaxed);
        });
        if self.exports() {
            metrics::counter!("weir_invalid_outputs_total", self.labels(&[])).increment(1);
            metrics::counter!("weir_tokens_total", self.labels(&[("direction", "in")])).increment(tokens_in);
            metrics::counter!("weir_tokens_total", self.labels(&[("direction", "out")])).increment(tokens_out);
        }
    }

    /// Counts a call answered with a rate-limit error.
    pub fn record_rate_limited(&self) {
        self.count(&|m| {
            m.rate_limited.fetch_add(1, Relaxed);
        });
        if self.exports() {
            metrics::counter!("weir_rate_limited_total", self.labels(&[])).increment(1);
        }
    }

    /// Counts a record answered from the response cache.
    pub fn record_cache_hit(&self, prompt_tokens: u64, output_tokens: u64) {
        self.count(&|m| {
            m.cache_tokens[0].fetch_add(prompt_tokens, Relaxed);
            m.cache_tokens[1].fetch_add(output_tokens, Relaxed);
            m.cache_hits.fetch_add(1, Relaxed);
        });
        if self.exports() {
            metrics::counter!("weir_cache_hits_total", self.labels(&[])).increment(1);
        }
    }

    /// Prompt tokens of answers from the cache.
    pub fn cache_tokens_in(&self) -> u64 {
        self.cache_tokens[0].load(Relaxed)
    }

    /// Output tokens of answers from the cache.
    pub fn cache_tokens_out(&self) -> u64 {
        self.cache_tokens[1].load(Relaxed)
    }

    /// Prompt and output tokens paid for: those of every answer but the cache's.
    pub fn paid_tokens(&self) -> (u64, u64) {
        (
            self.tokens_in.load(Relaxed).saturating_sub(self.cache_tokens_in()),
            self.tokens_out.load(Relaxed).saturating_sub(self.cache_tokens_out()),
        )
    }

    /// Counts `failure` (a record that failed without a call) and keeps it as an example of its
    /// kind.
    pub fn record_rejected(&self, failure: &crate::Failure) {
        self.record_failure(failure.error.kind);
        let id = failure.id.as_ref().map_or_else(|| format!("line {}", failure.line), |id| id.as_str().to_string());
        self.record_failure_example(&id, failure.error.kind, &failure.error.message);
    }

    /// The most examples kept of each kind of failure.
    const EXAMPLES: usize = 3;

    /// Keeps record `id`'s failure as an example of its kind (the newest few are kept, the
    /// message cut to 300 characters). Messages name no keys (errors never carry them), and the
    /// record's prompt is not kept.
    pub fn record_failure_example(&self, id: &str, kind: ErrorKind, message: &str) {
        let message: String = message.chars().take(300).collect();
        self.count(&|m| {
            let mut all = m.failure_examples.lock().unwrap_or_else(|e| e.into_inner());
            let kept = all.entry(kind).or_default();
            if kept.len() >= Self::EXAMPLES {
                kept.pop_front();
            }
            kept.push_back((id.to_string(), message.clone()));
        });
    }

    /// The newest examples of failures of `kind` (id, message), oldest first.
    pub fn failure_examples(&self, kind: ErrorKind) -> Vec<(String, String)> {
        let all = self.failure_examples.lock().unwrap_or_else(|e| e.into_inner());
        all.get(&kind).map(|k| k.iter().cloned().collect()).unwrap_or_default()
    }

    /// Counts a call that failed with an error of `kind`.
    pub fn record_call_error(&self, kind: ErrorKind) {
        self.count(&|m| {
            *m.call_errors.lock().unwrap_or_else(|e| e.into_inner()).entry(kind).or_default() += 1;
        });
    }

    /// Calls that failed, by kind.
    pub fn call_errors_by_kind(&self) -> BTreeMap<ErrorKind, u64> {
        self.call_errors.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Percentiles of call latency and of time to first token since the last time this was
    /// asked (`None`: nothing measured since), then forgotten: one watcher asks, once a period.
    pub fn take_recent_latencies(&self) -> (Option<Percentiles>, Option<Percentiles>) {
        (self.recent_latency.take(), self.recent_first_token.take())
    }

    /// Records how long one call took, answered or not (a histogram when exported).
    pub fn record_latency(&self, d: Duration) {
        self.count(&|m| m.recent_latency.add(d));
        if self.exports() {
            metrics::histogram!("weir_call_seconds", self.labels(&[])).record(d.as_secs_f64());
        }
    }

    /// Records the time from sending a streamed call to its first text.
    pub fn record_first_token(&self, d: Duration) {
        self.count(&|m| {
            m.first_token.add(d);
            m.recent_first_token.add(d);
        });
        if self.exports() {
            metrics::histogram!("weir_time_to_first_token_seconds", self.labels(&[])).record(d.as_secs_f64());
        }
    }

    /// Records the time between two pieces of a streamed answer.
    pub fn record_inter_token(&self, d: Duration) {
        self.count(&|m| m.inter_token.add(d));
        if self.exports() {
            metrics::histogram!("weir_inter_token_seconds", self.labels(&[])).record(d.as_secs_f64());
        }
    }

    /// Time to first token of the streamed calls so far (`None`: nothing streamed).
    pub fn first_token(&self) -> Option<Percentiles> {
        self.first_token.summary()
    }

    /// Time between pieces of streamed answers so far (`None`: no answer had two pieces).
    pub fn inter_token(&self) -> Option<Percentiles> {
        self.inter_token.summary()
    }

    /// Adds time spent held by the gate.
    pub fn add_throttled(&self, d: Duration) {
        // The wait was [now - d, now]; only its part after the last counted wait's end is new.
        let now = tokio::time::Instant::now().saturating_duration_since(epoch()).as_micros() as u64;
        let start = now.saturating_sub(d.as_micros() as u64);
        self.count(&|m| {
            m.throttled_micros.fetch_add(d.as_micros() as u64, Relaxed);
            let prev = m.throttled_until.fetch_max(now, Relaxed);
            let from = start.max(prev);
            if now > from {
                m.throttled_wall_micros.fetch_add(now - from, Relaxed);
            }
        });
        if self.exports() {
            metrics::counter!("weir_throttled_microseconds_total", self.labels(&[])).increment(d.as_micros() as u64);
        }
    }

    /// Counts a batched call of records with these estimated token counts.
    pub fn record_batch(&self, tokens: &[u64]) {
        let real: u64 = tokens.iter().sum();
        let padded = tokens.iter().max().copied().unwrap_or(0) * tokens.len() as u64;
        self.count(&|m| {
            m.batches.fetch_add(1, Relaxed);
            m.batch_items.fetch_add(tokens.len() as u64, Relaxed);
            m.batch_tokens.fetch_add(real, Relaxed);
            m.batch_padded_tokens.fetch_add(padded, Relaxed);
        });
        if self.exports() {
            metrics::counter!("weir_batches_total", self.labels(&[])).increment(1);
            metrics::counter!("weir_batch_items_total", self.labels(&[])).increment(tokens.len() as u64);
            metrics::counter!("weir_batch_tokens_total", self.labels(&[("kind", "real")])).increment(real);
            metrics::counter!("weir_batch_tokens_total", self.labels(&[("kind", "padded")])).increment(padded);
        }
    }

    /// Records how long a record waited in the batching stage for its batch.
    pub fn record_batch_wait(&self, d: Duration) {
        let ms = d.as_millis() as u64;
        let i = WAIT_BOUNDS_MS.iter().position(|b| ms < *b).unwrap_or(WAIT_BOUNDS_MS.len());
        self.count(&|m| {
            m.batch_waits[i].fetch_add(1, Relaxed);
        });
        if self.exports() {
            metrics::histogram!("weir_batch_wait_seconds", self.labels(&[])).record(d.as_secs_f64());
        }
    }

    /// The upper bound of the bucket holding the 95th percentile of batch waits, in
    /// milliseconds (`None`: nothing waited, or the last bucket, above 5 s).
    pub fn batch_wait_p95_ms(&self) -> Option<Option<u64>> {
        let counts: Vec<u64> = self.batch_waits.iter().map(|c| c.load(Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen * 100 >= total * 95 {
                return Some(WAIT_BOUNDS_MS.get(i).copied());
            }
        }
        Some(None)
    }

    /// Describes the exported metrics, and has every count reported through the facade from
    /// now on: called once, when an exporter is installed.
    pub fn describe() {
        EXPORTING.store(true, Relaxed);
        metrics::describe_counter!("weir_records_total", "Records finished, by outcome.");
        metrics::describe_counter!("weir_failures_total", "Failed records, by kind.");
        metrics::describe_counter!("weir_calls_total", "Calls made to the endpoint.");
        metrics::describe_counter!("weir_retries_total", "Calls beyond each record's first.");
        metrics::describe_counter!("weir_rate_limited_total", "Calls answered with a rate-limit error (429).");
        metrics::describe_counter!(
            "weir_invalid_outputs_total",
            "Answers that did not match the response schema (paid for, and tried again)."
        );
        metrics::describe_counter!("weir_cache_hits_total", "Records answered from the response cache.");
        metrics::describe_counter!(
            "weir_tokens_total",
            "Tokens of answered records, those answered from the cache included (not paid for again: see weir_cache_hits_total)."
        );
        metrics::describe_counter!(
            "weir_throttled_microseconds_total",
            metrics::Unit::Microseconds,
            "Time calls were held by the throttle, summed over calls (concurrent waits each count; the summary's 'throttled' is wall time, as Beam's cumulativeThrottlingSeconds)."
        );
        metrics::describe_histogram!("weir_call_seconds", metrics::Unit::Seconds, "Latency of each call.");
        metrics::describe_histogram!(
            "weir_time_to_first_token_seconds",
            metrics::Unit::Seconds,
            "Time from sending a streamed call to its first text."
        );
        metrics::describe_histogram!(
            "weir_inter_token_seconds",
            metrics::Unit::Seconds,
            "Time between one piece of a streamed answer and the next."
        );
        metrics::describe_counter!("weir_batches_total", "Batched calls sent (retries and split halves included).");
        metrics::describe_counter!("weir_batch_items_total", "Records carried by batched calls.");
        metrics::describe_counter!(
            "weir_batch_tokens_total",
            "Estimated tokens of batched records: real, and padded to the longest of each call."
        );
        metrics::describe_histogram!(
            "weir_batch_wait_seconds",
            metrics::Unit::Seconds,
            "Time a record waited in the batching stage for its batch."
        );
        metrics::describe_gauge!("weir_concurrency_limit", "Calls allowed in flight now.");
        metrics::describe_gauge!(
            "weir_quota_processes",
            "The most processes on this machine that shared the endpoint's quota at once (1: this one alone)."
        );
        metrics::describe_gauge!(
            "weir_calls_held",
            "This process's calls held for the quota now (an advised pause, the budgets, or another process's shared throttle)."
        );
        metrics::describe_gauge!("weir_requests_per_second_limit", "Request rate allowed now.");
        metrics::describe_gauge!("weir_tokens_per_second_limit", "Token rate allowed now.");
    }

    /// Makes every counter of these counters' labels visible (a counter a scraper never saw
    /// cannot be told from one that is zero): called for each endpoint once it is known.
    pub fn announce(&self) {
        if !self.exports() {
            return;
        }
        for outcome in ["success", "failure"] {
            metrics::counter!("weir_records_total", self.labels(&[("outcome", outcome)])).increment(0);
        }
        for direction in ["in", "out"] {
            metrics::counter!("weir_tokens_total", self.labels(&[("direction", direction)])).increment(0);
        }
        for name in [
            "weir_calls_total",
            "weir_retries_total",
            "weir_rate_limited_total",
            "weir_invalid_outputs_total",
            "weir_cache_hits_total",
            "weir_throttled_microseconds_total",
            "weir_batches_total",
            "weir_batch_items_total",
        ] {
            metrics::counter!(name, self.labels(&[])).increment(0);
        }
    }

    /// Failed records by kind.
    pub fn failures_by_kind(&self) -> BTreeMap<ErrorKind, u64> {
        self.failures_by_kind.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records a stop cut off (`aborted`): not failures. A resumable run leaves them to the next
    /// one, with no row; a run without state writes them as error rows its summary explains.
    pub fn cut_off(&self) -> u64 {
        self.failures_by_kind().get(&ErrorKind::Aborted).copied().unwrap_or(0)
    }

    /// Records done and failed, without those a stop cut off ([`RunMetrics::cut_off`]): counted
    /// as failures, they showed as "12 errors" after Ctrl-C in a run that had none, as a pace
    /// while nothing was being done, and as failed on the live page and in the report's plots.
    pub fn done_and_failed(&self) -> (u64, u64) {
        let cut = self.cut_off();
        (self.done.load(Relaxed).saturating_sub(cut), self.failed.load(Relaxed).saturating_sub(cut))
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an endpoint counts, the run's totals count too; each endpoint keeps its own.
    #[test]
    fn endpoints_count_into_the_totals() {
        let totals = std::sync::Arc::new(RunMetrics::default());
        let a = RunMetrics::of_endpoint(Some(totals.clone()), "sim/a", "http://a");
        let b = RunMetrics::of_endpoint(Some(totals.clone()), "sim/b", "http://b");
        a.record_success(10, 5);
        a.record_call(false);
        b.record_success(1, 1);
        b.record_failure(ErrorKind::RateLimited);
        b.record_cache_hit(1, 1);
        assert_eq!(a.paid_tokens(), (10, 5));
        assert_eq!(b.paid_tokens(), (0, 0));
        assert_eq!(totals.paid_tokens(), (10, 5));
        assert_eq!(RunMetrics::get(&totals.done), 3);
        assert_eq!(RunMetrics::get(&totals.calls), 1);
        assert_eq!(totals.failures_by_kind()[&ErrorKind::RateLimited], 1);
        RunMetrics::describe();
        assert!(!totals.exports(), "totals fed by endpoints would export every series twice");
        assert!(a.exports());
    }

    #[tokio::test(start_paused = true)]
    async fn overlapping_waits_count_once_in_wall_time() {
        let m = RunMetrics::default();
        // The epoch is the process's, maybe taken by another test's paused clock, which may
        // have run minutes ahead of this one's: a day later, every wait here is after it.
        epoch();
        tokio::time::sleep(Duration::from_secs(86_400)).await;
        // Three calls held over the same 10 s, ending together, then one more 2 s later.
        for _ in 0..3 {
            m.add_throttled(Duration::from_secs(10));
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        m.add_throttled(Duration::from_secs(2));
        assert_eq!(RunMetrics::get(&m.throttled_micros), 32_000_000);
        assert_eq!(RunMetrics::get(&m.throttled_wall_micros), 12_000_000);
    }

    #[test]
    fn stream_latencies_have_percentiles_within_a_percent() {
        let m = RunMetrics::default();
        assert_eq!(m.first_token(), None);
        for ms in 1..=1000u64 {
            m.record_first_token(Duration::from_millis(ms));
        }
        let p = m.first_token().unwrap();
        assert_eq!(p.count, 1000);
        let near = |d: Duration, ms: f64| (d.as_secs_f64() * 1000.0 - ms).abs() <= ms * 0.02;
        assert!(near(p.p50, 500.0) && near(p.p95, 950.0) && near(p.p99, 990.0), "{p:?}");
        assert_eq!(m.inter_token(), None);
    }
}
