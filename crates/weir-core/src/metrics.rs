//! Counters of a run, shared by the driver, the progress bar and the summary.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use crate::error::ErrorKind;

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
    /// Calls answered with a rate-limit error.
    pub rate_limited: AtomicU64,
    /// Prompt tokens reported by successful calls.
    pub tokens_in: AtomicU64,
    /// Output tokens reported by successful calls.
    pub tokens_out: AtomicU64,
    /// Time calls spent held by a server-advised pause, in microseconds (summed over calls;
    /// Beam's name for it is `cumulativeThrottlingSeconds`).
    pub throttled_micros: AtomicU64,
    failures_by_kind: Mutex<BTreeMap<ErrorKind, u64>>,
}

impl RunMetrics {
    /// Counts a record's failure.
    pub fn record_failure(&self, kind: ErrorKind) {
        self.failed.fetch_add(1, Relaxed);
        self.done.fetch_add(1, Relaxed);
        *self.failures_by_kind.lock().unwrap_or_else(|e| e.into_inner()).entry(kind).or_default() += 1;
    }

    /// Counts a record's success.
    pub fn record_success(&self, tokens_in: u64, tokens_out: u64) {
        self.succeeded.fetch_add(1, Relaxed);
        self.done.fetch_add(1, Relaxed);
        self.tokens_in.fetch_add(tokens_in, Relaxed);
        self.tokens_out.fetch_add(tokens_out, Relaxed);
    }

    /// Adds time spent held by the gate.
    pub fn add_throttled(&self, d: Duration) {
        self.throttled_micros.fetch_add(d.as_micros() as u64, Relaxed);
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
