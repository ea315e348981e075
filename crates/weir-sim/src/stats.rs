//! What the server saw, as lock-free counters, served at `GET /stats`.
//!
//! Tests and benchmarks read the ground truth from here rather than trusting the client's own
//! account: how many requests arrived, how many succeeded, how many were refused and why.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use tokio::time::Instant;

pub use crate::config::FAULT_KINDS;

/// Live counters.
#[derive(Debug)]
pub struct Stats {
    requests: AtomicU64,
    successes: AtomicU64,
    rate_limited: AtomicU64,
    unavailable: AtomicU64,
    bad_requests: AtomicU64,
    auth_failures: AtomicU64,
    overloaded: AtomicU64,
    faults: [AtomicU64; 8],
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
    tokens_in: AtomicU64,
    tokens_out: AtomicU64,
    streams: AtomicU64,
    tokens_issued: AtomicU64,
    predict_batches: AtomicU64,
    predict_instances: AtomicU64,
    predict_refused: AtomicU64,
    predict_short: AtomicU64,
    embed_batches: AtomicU64,
    embed_inputs: AtomicU64,
    media_parts: AtomicU64,
    media_uris: AtomicU64,
    timeline: Mutex<Timeline>,
}

#[derive(Debug)]
struct Timeline {
    start: Instant,
    first_success: Option<Instant>,
    last_success: Option<Instant>,
    /// Successes per whole second since `start` (bounded to one hour).
    per_second: Vec<u64>,
    /// Tokens (prompt + generated) of those successes.
    tokens_per_second: Vec<u64>,
    /// 429s per whole second since `start` (bounded as `per_second`).
    refused_per_second: Vec<u64>,
    /// 503s per whole second since `start` (bounded as `per_second`).
    unavailable_per_second: Vec<u64>,
}

/// Seconds a timeline counts, from its start: bounds its memory in a simulator left running.
const TIMELINE_SECONDS: usize = 3600;

/// Adds `n` to second `sec` of a per-second count (nothing past [`TIMELINE_SECONDS`]).
fn count_at(per_second: &mut Vec<u64>, sec: usize, n: u64) {
    if sec < TIMELINE_SECONDS {
        if per_second.len() <= sec {
            per_second.resize(sec + 1, 0);
        }
        per_second[sec] += n;
    }
}

/// A snapshot of the counters, as served by `/stats`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct StatsSnapshot {
    /// Requests that reached a model route.
    pub requests: u64,
    /// Requests answered with a whole model response (safety blocks included; a truncated stream is
    /// a fault, not a success).
    pub successes: u64,
    /// Answers with HTTP 429 (quota or overload).
    pub rate_limited: u64,
    /// Answers with HTTP 503 (overload or injected).
    pub unavailable: u64,
    /// Answers with HTTP 400 or 404.
    pub bad_requests: u64,
    /// Requests refused for a missing or unknown key.
    pub auth_failures: u64,
    /// Requests that met the hidden concurrency cap (rejected or slowed).
    pub overloaded: u64,
    /// Injected faults by kind.
    pub faults: std::collections::BTreeMap<String, u64>,
    /// Requests in flight now.
    pub in_flight: u64,
    /// Most requests ever in flight at once.
    pub peak_in_flight: u64,
    /// Prompt tokens of successful requests.
    pub tokens_in: u64,
    /// Batch-prediction jobs submitted (OpenAI batches and Gemini batches).
    #[serde(default)]
    pub batch_jobs: u64,
    /// Requests answered (or failed alone) by batch jobs.
    #[serde(default)]
    pub batch_answered: u64,
    /// Files uploaded through the Gemini Files API's resumable protocol (each checked: a start
    /// with the declared length, then one upload of exactly that many bytes that finalizes).
    #[serde(default)]
    pub gemini_files_uploaded: u64,
    /// Gemini API uploads refused for not following that protocol.
    #[serde(default)]
    pub gemini_upload_refusals: u64,
    /// Distinct request keys submitted in batch jobs.
    #[serde(default)]
    pub batch_keys: u64,
    /// Request keys submitted in more than one batch job.
    #[serde(default)]
    pub batch_keys_in_two_jobs: u64,
    /// Generated tokens of successful requests.
    pub tokens_out: u64,
    /// Streaming requests started.
    pub streams: u64,
    /// Access tokens issued by `/token` and the metadata route.
    #[serde(default)]
    pub tokens_issued: u64,
    /// `:predict` requests answered (successfully or with a fault after admission).
    #[serde(default)]
    pub predict_batches: u64,
    /// Instances those `:predict` requests carried.
    #[serde(default)]
    pub predict_instances: u64,
    /// `:predict` requests refused for too many instances or too large a body.
    #[serde(default)]
    pub predict_refused: u64,
    /// `:predict` answers whose `predictions` left instances out.
    #[serde(default)]
    pub predict_short: u64,
    /// Embedding requests answered.
    #[serde(default)]
    pub embed_batches: u64,
    /// Texts those embedding requests carried.
    #[serde(default)]
    pub embed_inputs: u64,
    /// Media parts (inline data, decoded and typed, or files by URI) of the requests answered.
    #[serde(default)]
    pub media_parts: u64,
    /// Of those, files by reference (`fileData` with a `gs://` or `https://` URI).
    #[serde(default)]
    pub media_uris: u64,
    /// Media parts of the requests batch jobs answered.
    #[serde(default)]
    pub batch_media_parts: u64,
    /// Seconds since start or the last reset.
    pub elapsed_secs: f64,
    /// Successes per second between the first and the last success.
    pub successes_per_sec: f64,
    /// Successes in each whole second since start or the last reset.
    pub successes_per_second: Vec<u64>,
    /// Tokens (prompt + generated) of the successes in each whole second.
    pub tokens_per_second: Vec<u64>,
    /// 429s in each whole second since start or the last reset: when a client is refused, not
    /// only how often.
    #[serde(default)]
    pub rate_limited_per_second: Vec<u64>,
    /// 503s in each whole second since start or the last reset (overload and injected).
    #[serde(default)]
    pub unavailable_per_second: Vec<u64>,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            successes: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            bad_requests: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            overloaded: AtomicU64::new(0),
            faults: Default::default(),
            in_flight: AtomicU64::new(0),
            peak_in_flight: AtomicU64::new(0),
            tokens_in: AtomicU64::new(0),
            tokens_out: AtomicU64::new(0),
            streams: AtomicU64::new(0),
            tokens_issued: AtomicU64::new(0),
            predict_batches: AtomicU64::new(0),
            predict_instances: AtomicU64::new(0),
            predict_refused: AtomicU64::new(0),
            predict_short: AtomicU64::new(0),
            embed_batches: AtomicU64::new(0),
            embed_inputs: AtomicU64::new(0),
            media_parts: AtomicU64::new(0),
            media_uris: AtomicU64::new(0),
            timeline: Mutex::new(Timeline {
                start: Instant::now(),
                first_success: None,
                last_success: None,
                per_second: Vec::new(),
                tokens_per_second: Vec::new(),
                refused_per_second: Vec::new(),
                unavailable_per_second: Vec::new(),
            }),
        }
    }
}

/// Decrements the in-flight count when a request is finished, however it ends (a streamed answer
/// keeps it until its last byte).
#[derive(Debug)]
pub struct InFlight {
    stats: std::sync::Arc<Stats>,
    /// Requests in flight including this one, at the time it started.
    pub level: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Relaxed);
    }
}

impl Stats {
    /// Counts a request and marks it in flight until the guard drops.
    pub fn start_request(self: &std::sync::Arc<Self>) -> InFlight {
        self.requests.fetch_add(1, Relaxed);
        let level = self.in_flight.fetch_add(1, Relaxed) + 1;
        self.peak_in_flight.fetch_max(level, Relaxed);
        InFlight { stats: self.clone(), level }
    }

    /// Counts a successful answer and its tokens.
    pub fn success(&self, tokens_in: u64, tokens_out: u64) {
        self.successes.fetch_add(1, Relaxed);
        self.tokens_in.fetch_add(tokens_in, Relaxed);
        self.tokens_out.fetch_add(tokens_out, Relaxed);
        let now = Instant::now();
        let mut t = self.timeline.lock().unwrap_or_else(|e| e.into_inner());
        t.first_success.get_or_insert(now);
        t.last_success = Some(now);
        let sec = now.duration_since(t.start).as_secs() as usize;
        count_at(&mut t.per_second, sec, 1);
        count_at(&mut t.tokens_per_second, sec, tokens_in + tokens_out);
    }

    /// Counts an answer by its HTTP status.
    pub fn status(&self, status: u16) {
        if status == 429 || status == 503 {
            let mut t = self.timeline.lock().unwrap_or_else(|e| e.into_inner());
            let sec = t.start.elapsed().as_secs() as usize;
            let per_second = if status == 429 { &mut t.refused_per_second } else { &mut t.unavailable_per_second };
            count_at(per_second, sec, 1);
        }
        match status {
            429 => self.rate_limited.fetch_add(1, Relaxed),
            503 => self.unavailable.fetch_add(1, Relaxed),
            400 | 404 | 413 => self.bad_requests.fetch_add(1, Relaxed),
            _ => 0,
        };
    }

    /// Counts a request refused for its key (whatever the status the API uses for it).
    pub fn auth_failure(&self) {
        self.auth_failures.fetch_add(1, Relaxed);
    }

    /// Counts a request that met the hidden concurrency cap.
    pub fn overloaded(&self) {
        self.overloaded.fetch_add(1, Relaxed);
    }

    /// Counts an injected fault by its index in [`FAULT_KINDS`].
    pub fn fault(&self, index: usize) {
        self.faults[index].fetch_add(1, Relaxed);
    }

    /// Counts an access token issued.
    pub fn token_issued(&self) {
        self.tokens_issued.fetch_add(1, Relaxed);
    }

    /// Counts a `:predict` request computed, with its instances.
    pub fn predict_batch(&self, instances: u64) {
        self.predict_batches.fetch_add(1, Relaxed);
        self.predict_instances.fetch_add(instances, Relaxed);
    }

    /// Counts a `:predict` request refused by the instance or size limit.
    pub fn predict_refused(&self) {
        self.predict_refused.fetch_add(1, Relaxed);
    }

    /// Counts a `:predict` answer that left instances out.
    pub fn predict_short(&self) {
        self.predict_short.fetch_add(1, Relaxed);
    }

    /// Counts the media parts of a request answered, and those of them by URI.
    pub fn media(&self, parts: u64, uris: u64) {
        self.media_parts.fetch_add(parts, Relaxed);
        self.media_uris.fetch_add(uris, Relaxed);
    }

    /// Counts an embedding request computed, with its inputs.
    pub fn embed_batch(&self, inputs: u64) {
        self.embed_batches.fetch_add(1, Relaxed);
        self.embed_inputs.fetch_add(inputs, Relaxed);
    }

    /// Counts a streaming request.
    pub fn stream(&self) {
        self.streams.fetch_add(1, Relaxed);
    }

    /// A consistent-enough copy of the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let t = self.timeline.lock().unwrap_or_else(|e| e.into_inner());
        let successes = self.successes.load(Relaxed);
        let successes_per_sec = match (t.first_success, t.last_success) {
            (Some(a), Some(b)) if b > a => successes.saturating_sub(1) as f64 / (b - a).as_secs_f64(),
            _ => 0.0,
        };
        StatsSnapshot {
            requests: self.requests.load(Relaxed),
            successes,
            rate_limited: self.rate_limited.load(Relaxed),
            unavailable: self.unavailable.load(Relaxed),
            bad_requests: self.bad_requests.load(Relaxed),
            auth_failures: self.auth_failures.load(Relaxed),
            overloaded: self.overloaded.load(Relaxed),
            faults: FAULT_KINDS.iter().zip(&self.faults).map(|(k, v)| (k.to_string(), v.load(Relaxed))).collect(),
            in_flight: self.in_flight.load(Relaxed),
            peak_in_flight: self.peak_in_flight.load(Relaxed),
            tokens_in: self.tokens_in.load(Relaxed),
            batch_jobs: 0,
            batch_answered: 0,
            gemini_files_uploaded: 0,
            gemini_upload_refusals: 0,
            batch_keys: 0,
            batch_keys_in_two_jobs: 0,
            tokens_out: self.tokens_out.load(Relaxed),
            streams: self.streams.load(Relaxed),
            tokens_issued: self.tokens_issued.load(Relaxed),
            predict_batches: self.predict_batches.load(Relaxed),
            predict_instances: self.predict_instances.load(Relaxed),
            predict_refused: self.predict_refused.load(Relaxed),
            predict_short: self.predict_short.load(Relaxed),
            embed_batches: self.embed_batches.load(Relaxed),
            embed_inputs: self.embed_inputs.load(Relaxed),
            media_parts: self.media_parts.load(Relaxed),
            media_uris: self.media_uris.load(Relaxed),
            batch_media_parts: 0,
            elapsed_secs: t.start.elapsed().as_secs_f64(),
            successes_per_sec,
            successes_per_second: t.per_second.clone(),
            tokens_per_second: t.tokens_per_second.clone(),
            rate_limited_per_second: t.refused_per_second.clone(),
            unavailable_per_second: t.unavailable_per_second.clone(),
        }
    }

    /// Zeroes every counter except those of requests still in flight.
    pub fn reset(&self) {
        for c in [
            &self.requests,
            &self.successes,
            &self.rate_limited,
            &self.unavailable,
            &self.bad_requests,
            &self.auth_failures,
            &self.overloaded,
            &self.tokens_in,
            &self.tokens_out,
            &self.streams,
            &self.tokens_issued,
            &self.predict_batches,
            &self.predict_instances,
            &self.predict_refused,
            &self.predict_short,
            &self.embed_batches,
            &self.embed_inputs,
            &self.media_parts,
            &self.media_uris,
        ] {
            c.store(0, Relaxed);
        }
        for c in &self.faults {
            c.store(0, Relaxed);
        }
        self.peak_in_flight.store(self.in_flight.load(Relaxed), Relaxed);
        let mut t = self.timeline.lock().unwrap_or_else(|e| e.into_inner());
        *t = Timeline {
            start: Instant::now(),
            first_success: None,
            last_success: None,
            per_second: Vec::new(),
            tokens_per_second: Vec::new(),
            refused_per_second: Vec::new(),
            unavailable_per_second: Vec::new(),
        };
    }
}
