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

/// The moment wall-time counters are measured from (the first time one is asked for).
fn epoch() -> tokio::time::Instant {
    static EPOCH: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(tokio::time::Instant::now)
}

/// Live counters of a run.
#[derive(Debug, Default)]
pub struct RunMetrics {
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
    /// Streamed calls: time from sending to the first text.
    first_token: Sketch,
    /// Streamed calls: time between one piece of text and the next.
    inter_token: Sketch,
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
    /// Counts a record's failure.
    pub fn record_failure(&self, kind: ErrorKind) {
        self.failed.fetch_add(1, Relaxed);
        self.done.fetch_add(1, Relaxed);
        *self.failures_by_kind.lock().unwrap_or_else(|e| e.into_inner()).entry(kind).or_default() += 1;
        metrics::counter!("weir_records_total", "outcome" => "failure").increment(1);
        metrics::counter!("weir_failures_total", "kind" => kind.as_str()).increment(1);
    }

    /// Counts a record's success.
    pub fn record_success(&self, tokens_in: u64, tokens_out: u64) {
        self.succeeded.fetch_add(1, Relaxed);
        self.done.fetch_add(1, Relaxed);
        self.tokens_in.fetch_add(tokens_in, Relaxed);
        self.tokens_out.fetch_add(tokens_out, Relaxed);
        metrics::counter!("weir_records_total", "outcome" => "success").increment(1);
        metrics::counter!("weir_tokens_total", "direction" => "in").increment(tokens_in);
        metrics::counter!("weir_tokens_total", "direction" => "out").increment(tokens_out);
    }

    /// Counts a call made; `retry` when it was not the first for its record or batch.
    pub fn record_call(&self, retry: bool) {
        self.calls.fetch_add(1, Relaxed);
        metrics::counter!("weir_calls_total").increment(1);
        if retry {
            self.retries.fetch_add(1, Relaxed);
            metrics::counter!("weir_retries_total").increment(1);
        }
    }

    /// Counts a call answered with a rate-limit error.
    pub fn record_rate_limited(&self) {
        self.rate_limited.fetch_add(1, Relaxed);
        metrics::counter!("weir_rate_limited_total").increment(1);
    }

    /// Counts a record answered from the response cache.
    pub fn record_cache_hit(&self, prompt_tokens: u64, output_tokens: u64) {
        self.cache_tokens[0].fetch_add(prompt_tokens, Relaxed);
        self.cache_tokens[1].fetch_add(output_tokens, Relaxed);
        self.cache_hits.fetch_add(1, Relaxed);
        metrics::counter!("weir_cache_hits_total").increment(1);
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

    /// Records how long one call took, answered or not (a histogram when exported).
    pub fn record_latency(&self, d: Duration) {
        metrics::histogram!("weir_call_seconds").record(d.as_secs_f64());
    }

    /// Records the time from sending a streamed call to its first text.
    pub fn record_first_token(&self, d: Duration) {
        self.first_token.add(d);
        metrics::histogram!("weir_time_to_first_token_seconds").record(d.as_secs_f64());
    }

    /// Records the time between two pieces of a streamed answer.
    pub fn record_inter_token(&self, d: Duration) {
        self.inter_token.add(d);
        metrics::histogram!("weir_inter_token_seconds").record(d.as_secs_f64());
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
        self.throttled_micros.fetch_add(d.as_micros() as u64, Relaxed);
        // The wait was [now - d, now]; only its part after the last counted wait's end is new.
        let now = tokio::time::Instant::now().saturating_duration_since(epoch()).as_micros() as u64;
        let start = now.saturating_sub(d.as_micros() as u64);
        let prev = self.throttled_until.fetch_max(now, Relaxed);
        let from = start.max(prev);
        if now > from {
            self.throttled_wall_micros.fetch_add(now - from, Relaxed);
        }
        metrics::counter!("weir_throttled_microseconds_total").increment(d.as_micros() as u64);
    }

    /// Counts a batched call of records with these estimated token counts.
    pub fn record_batch(&self, tokens: &[u64]) {
        let real: u64 = tokens.iter().sum();
        let padded = tokens.iter().max().copied().unwrap_or(0) * tokens.len() as u64;
        self.batches.fetch_add(1, Relaxed);
        self.batch_items.fetch_add(tokens.len() as u64, Relaxed);
        self.batch_tokens.fetch_add(real, Relaxed);
        self.batch_padded_tokens.fetch_add(padded, Relaxed);
        metrics::counter!("weir_batches_total").increment(1);
        metrics::counter!("weir_batch_items_total").increment(tokens.len() as u64);
        metrics::counter!("weir_batch_tokens_total", "kind" => "real").increment(real);
        metrics::counter!("weir_batch_tokens_total", "kind" => "padded").increment(padded);
    }

    /// Records how long a record waited in the batching stage for its batch.
    pub fn record_batch_wait(&self, d: Duration) {
        let ms = d.as_millis() as u64;
        let i = WAIT_BOUNDS_MS.iter().position(|b| ms < *b).unwrap_or(WAIT_BOUNDS_MS.len());
        self.batch_waits[i].fetch_add(1, Relaxed);
        metrics::histogram!("weir_batch_wait_seconds").record(d.as_secs_f64());
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

    /// Describes the exported metrics and makes every counter visible from the start (a
    /// counter a scraper never saw cannot be told from one that is zero).
    pub fn describe() {
        metrics::describe_counter!("weir_records_total", "Records finished, by outcome.");
        metrics::describe_counter!("weir_failures_total", "Failed records, by kind.");
        metrics::describe_counter!("weir_calls_total", "Calls made to the endpoint.");
        metrics::describe_counter!("weir_retries_total", "Calls beyond each record's first.");
        metrics::describe_counter!("weir_rate_limited_total", "Calls answered with a rate-limit error (429).");
        metrics::describe_counter!("weir_cache_hits_total", "Records answered from the response cache.");
        metrics::describe_counter!("weir_tokens_total", "Tokens reported by successful calls.");
        metrics::describe_counter!(
            "weir_throttled_microseconds_total",
            metrics::Unit::Microseconds,
            "Time calls were held by the throttle (Beam: cumulativeThrottlingSeconds)."
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
        metrics::describe_gauge!("weir_requests_per_second_limit", "Request rate allowed now.");
        metrics::describe_gauge!("weir_tokens_per_second_limit", "Token rate allowed now.");
        for outcome in ["success", "failure"] {
            metrics::counter!("weir_records_total", "outcome" => outcome).increment(0);
        }
        for direction in ["in", "out"] {
            metrics::counter!("weir_tokens_total", "direction" => direction).increment(0);
        }
        for name in [
            "weir_calls_total",
            "weir_retries_total",
            "weir_rate_limited_total",
            "weir_cache_hits_total",
            "weir_throttled_microseconds_total",
            "weir_batches_total",
            "weir_batch_items_total",
        ] {
            metrics::counter!(name).increment(0);
        }
    }

    /// Failed records by kind.
    pub fn failures_by_kind(&self) -> BTreeMap<ErrorKind, u64> {
        self.failures_by_kind.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn overlapping_waits_count_once_in_wall_time() {
        let m = RunMetrics::default();
        epoch();
        tokio::time::sleep(Duration::from_secs(10)).await;
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
