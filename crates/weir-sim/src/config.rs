//! Scenario configuration for the simulator.
//!
//! A scenario is a TOML file (or the same structure built in code) that says how the simulated
//! endpoint behaves: its latency, its quotas, its hidden concurrency cap and the faults it injects.
//! Unknown keys are rejected so that a misspelt setting never silently changes nothing.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Everything that shapes the simulator's behaviour. `Default` is a fast, fault-free, unlimited
/// endpoint, which is what the embedded `sim/` model of `weir run` uses.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SimConfig {
    /// Seed for generated text, latency spread and fault decisions; same seed, same behaviour.
    pub seed: u64,
    /// How long answers take.
    pub latency: LatencyConfig,
    /// Quotas enforced per API key, the way providers enforce them.
    pub quota: QuotaConfig,
    /// A concurrency limit the client is not told about.
    pub concurrency: ConcurrencyConfig,
    /// Rates of injected faults.
    pub faults: FaultConfig,
    /// Length of generated answers.
    pub output: OutputConfig,
    /// When non-empty, only these keys (API keys or bearer tokens) are accepted.
    pub api_keys: Vec<String>,
    /// When non-empty, only these models are served; a request for another is answered 404
    /// "model not found", as providers answer a misspelt model.
    pub models: Vec<String>,
    /// The simulated Google token endpoints (`/token`, the metadata route).
    pub auth: AuthConfig,
    /// Vertex AI endpoints' `:predict`: its limits and its batched compute.
    pub predict: PredictConfig,
    /// Embedding requests (OpenAI `/v1/embeddings`, Gemini `batchEmbedContents`, Vertex AI
    /// text-embedding `:predict`).
    pub embedding: EmbeddingConfig,
    /// Batch-prediction jobs (OpenAI Batch API, Gemini API batch mode).
    pub batch: BatchJobConfig,
    /// Keep the last this many model requests (path, query without keys, body) for `GET
    /// /requests`, to compare what clients send, and as many streamed answers' timings (when
    /// the first text was sent) for `GET /streams`; 0 keeps none.
    pub capture_requests: usize,
}

/// How a Vertex AI endpoint's `:predict` behaves. The instances of one request are computed
/// together, so its latency is set by its longest instance: `latency.fixed_ms +
/// prompt_token_ms × the longest prompt + latency.per_token_ms × the longest output`, the way
/// a padded batch costs on an accelerator.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PredictConfig {
    /// Instances per request at most (0 = no limit); more is a 400.
    pub max_instances: u64,
    /// `:predict` and embedding request bodies larger than this are a 400, as Vertex AI refuses
    /// bodies over 1.5 MB.
    pub max_request_bytes: u64,
    /// Per prompt token of the longest instance, in milliseconds (prefill of a padded batch).
    pub prompt_token_ms: f64,
    /// Probability that an answer's `predictions` leaves out the last instance (a server that
    /// answers short). An instance whose prompt contains `[sim:short]` always cuts the
    /// `predictions` before it.
    pub short_rate: f64,
}

/// How embedding requests behave. A request's inputs are computed as one padded batch, so its
/// latency is `latency.fixed_ms + token_ms × (tokens of the longest input)`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddingConfig {
    /// Length of the vectors.
    pub dimensions: u32,
    /// Inputs per request at most (0 = no limit); more is a 400.
    pub max_inputs: u64,
    /// Per token of the longest input, in milliseconds.
    pub token_ms: f64,
}

/// How batch-prediction jobs behave.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BatchJobConfig {
    /// Seconds from a job's creation to its end (a fifth pending, the rest running).
    pub run_secs: f64,
    /// Every job expires at its end with only the first half of its requests answered.
    pub expire: bool,
    /// Share of a job's requests that fail alone with a 500.
    pub item_error_rate: f64,
    /// Requests per OpenAI batch at most (OpenAI: 50,000).
    pub max_requests: u64,
    /// Bytes of a Gemini batch's inline requests at most (the Gemini API: 20 MB).
    pub max_inline_bytes: u64,
}

impl Default for BatchJobConfig {
    fn default() -> Self {
        Self { run_secs: 2.0, expire: false, item_error_rate: 0.0, max_requests: 50_000, max_inline_bytes: 20_000_000 }
    }
}

impl Default for EmbeddingConfig {
    fn default() -> Self {
        Self { dimensions: 256, max_inputs: 0, token_ms: 0.0 }
    }
}

impl Default for PredictConfig {
    fn default() -> Self {
        Self { max_instances: 0, max_request_bytes: 1_572_864, prompt_token_ms: 0.0, short_rate: 0.0 }
    }
}

/// What the simulated Google token endpoints hand out.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Lifetime of issued access tokens, in seconds (`expires_in`).
    pub token_lifetime_secs: u64,
    /// The access token issued; default: the first of `api_keys` (so it is accepted), else a
    /// fixed one. Set it to something not in `api_keys` to simulate a revoked token.
    pub issued_token: Option<String>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self { token_lifetime_secs: 3600, issued_token: None }
    }
}

/// Latency model: `fixed_ms + per_token_ms × output tokens + uniform(0, jitter_ms)`, the spread
/// seeded by the request. When streaming, the first token comes after `fixed_ms` plus the spread
/// and each further token after `per_token_ms`, so time to first token is real.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct LatencyConfig {
    /// Fixed part of every answer's latency, in milliseconds.
    pub fixed_ms: f64,
    /// Added per generated token, in milliseconds.
    pub per_token_ms: f64,
    /// Upper bound of a uniformly distributed extra delay, in milliseconds.
    pub jitter_ms: f64,
}

/// Quotas over a sliding window, per API key. `window_secs` is 60 for a real per-minute quota;
/// a shorter window simulates a minute in a few seconds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct QuotaConfig {
    /// Requests accepted per window (0 = unlimited).
    pub requests_per_window: u64,
    /// Tokens (prompt + generated) accepted per window (0 = unlimited).
    pub tokens_per_window: u64,
    /// Length of the sliding window, in seconds.
    pub window_secs: f64,
    /// Requests accepted per day (0 = unlimited). Once spent it stays spent until the day ends.
    pub requests_per_day: u64,
    /// Length of the simulated day, in seconds.
    pub day_secs: f64,
    /// Round every advised delay up to whole seconds, as real servers do (OpenAI's
    /// `retry-after: 2`, Gemini's `retryDelay: "13s"`), instead of advising it exactly.
    pub round_advice: bool,
    /// How the window moves: sliding (a request leaves it `window_secs` after it came), or
    /// fixed (counts start again at each multiple of `window_secs` since the server started,
    /// and a refusal advises the time until then, as a per-minute quota reset on the minute).
    pub window: WindowKind,
}

/// How a quota window moves.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum WindowKind {
    /// Each request counts for `window_secs` after it came.
    #[default]
    Sliding,
    /// Counts start again at every multiple of `window_secs`.
    Fixed,
}

impl std::str::FromStr for WindowKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sliding" => Ok(Self::Sliding),
            "fixed" => Ok(Self::Fixed),
            other => Err(format!("window '{other}': expected sliding or fixed")),
        }
    }
}

impl Default for QuotaConfig {
    fn default() -> Self {
        Self {
            requests_per_window: 0,
            tokens_per_window: 0,
            window_secs: 60.0,
            requests_per_day: 0,
            day_secs: 86_400.0,
            round_advice: false,
            window: WindowKind::Sliding,
        }
    }
}

/// What an endpoint does beyond its hidden concurrency cap.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum OverloadMode {
    /// Reject with 429, like a managed API.
    #[serde(rename = "429")]
    TooManyRequests,
    /// Reject with 503, like an overloaded proxy.
    #[default]
    #[serde(rename = "503")]
    Unavailable,
    /// Accept everything but slow down in proportion to the load, like a self-hosted server.
    Slow,
}

/// A concurrency cap the client is not told about.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ConcurrencyConfig {
    /// Requests in flight above which the endpoint is overloaded (0 = no cap).
    pub max_in_flight: u64,
    /// What happens above the cap.
    pub mode: OverloadMode,
}

/// The probability, per request, of each injected fault. The sum must not exceed 1.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FaultConfig {
    /// HTTP 500 with the provider's error body.
    pub error_500: f64,
    /// HTTP 503 with the provider's error body.
    pub error_503: f64,
    /// The connection is dropped before any answer.
    pub reset: f64,
    /// No answer until the client gives up (or `hang_secs` pass).
    pub hang: f64,
    /// HTTP 200 with a body that is not valid JSON.
    pub malformed: f64,
    /// A streamed answer that stops before its end (streaming requests only).
    pub truncate: f64,
    /// Gemini: the prompt is blocked (no `candidates`, `promptFeedback.blockReason`).
    /// OpenAI: 400 `content_filter`.
    pub block_prompt: f64,
    /// Gemini: a candidate with `finishReason: SAFETY` and no content.
    /// OpenAI: `finish_reason: content_filter` and no content.
    pub block_candidate: f64,
    /// How long a hung request waits before the server closes it.
    pub hang_secs: f64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            error_500: 0.0,
            error_503: 0.0,
            reset: 0.0,
            hang: 0.0,
            malformed: 0.0,
            truncate: 0.0,
            block_prompt: 0.0,
            block_candidate: 0.0,
            hang_secs: 600.0,
        }
    }
}

/// The kinds of injected fault, in the order of [`FaultConfig::rates`]; the names used in TOML,
/// on the command line (`--fault KIND=RATE`), in `[sim:KIND]` directives and in `/stats`.
pub const FAULT_KINDS: [&str; 8] =
    ["error_500", "error_503", "reset", "hang", "malformed", "truncate", "block_prompt", "block_candidate"];

impl FaultConfig {
    /// The rate of each kind, in the order of [`FAULT_KINDS`].
    pub fn rates(&self) -> [f64; 8] {
        [
            self.error_500,
            self.error_503,
            self.reset,
            self.hang,
            self.malformed,
            self.truncate,
            self.block_prompt,
            self.block_candidate,
        ]
    }

    /// The rate of the kind named `kind`, to set it; `None` for an unknown name.
    pub fn rate_mut(&mut self, kind: &str) -> Option<&mut f64> {
        Some(match kind {
            "error_500" => &mut self.error_500,
            "error_503" => &mut self.error_503,
            "reset" => &mut self.reset,
            "hang" => &mut self.hang,
            "malformed" => &mut self.malformed,
            "truncate" => &mut self.truncate,
            "block_prompt" => &mut self.block_prompt,
            "block_candidate" => &mut self.block_candidate,
            _ => return None,
        })
    }
}

/// Length of generated answers, in tokens, before `max_tokens` caps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OutputConfig {
    /// Fewest tokens in an answer.
    pub min_tokens: u32,
    /// Most tokens in an answer.
    pub max_tokens: u32,
    /// Tokens per streamed event.
    pub stream_chunk_tokens: u32,
    /// Share of the answers to requests with a response schema that are cut in half (not
    /// JSON), drawn afresh for every call: a client that checks and asks again gets a valid one.
    pub invalid_json_rate: f64,
}

impl Default for OutputConfig {
    fn default() -> Self {
        Self { min_tokens: 8, max_tokens: 48, stream_chunk_tokens: 1, invalid_json_rate: 0.0 }
    }
}

/// A scenario that cannot be used, with what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The TOML did not parse or had unknown keys.
    #[error("invalid simulator config: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value is out of range.
    #[error("invalid simulator config: {0}")]
    Invalid(String),
    /// The file could not be read.
    #[error("cannot read simulator config {path}: {source}")]
    Read {
        /// The file named by the user.
        path: String,
        /// Why reading it failed.
        source: std::io::Error,
    },
}

impl SimConfig {
    /// Parses a TOML scenario and validates it.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: SimConfig = toml::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and validates a TOML scenario file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
        Self::from_toml(&text)
    }

    /// Checks ranges; called by the constructors and by the server before it starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let f = &self.faults;
        let rates = FAULT_KINDS.iter().zip(f.rates());
        for (name, rate) in rates {
            if !(0.0..=1.0).contains(&rate) {
                return bad(format!("faults.{name} = {rate}: a rate must be between 0 and 1"));
            }
        }
        let total: f64 = f.rates().iter().sum();
        if total > 1.0 + 1e-9 {
            return bad(format!("fault rates add up to {total}, more than 1"));
        }
        for (name, v) in [
            ("latency.fixed_ms", self.latency.fixed_ms),
            ("latency.per_token_ms", self.latency.per_token_ms),
            ("latency.jitter_ms", self.latency.jitter_ms),
            ("faults.hang_secs", f.hang_secs),
            ("predict.prompt_token_ms", self.predict.prompt_token_ms),
            ("embedding.token_ms", self.embedding.token_ms),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(format!("{name} = {v}: must be a finite number ≥ 0"));
            }
        }
        for (name, v) in [("quota.window_secs", self.quota.window_secs), ("quota.day_secs", self.quota.day_secs)] {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{name} = {v}: must be a number > 0"));
            }
        }
        if self.output.min_tokens == 0 || self.output.min_tokens > self.output.max_tokens {
            return bad(format!(
                "output.min_tokens = {} and output.max_tokens = {}: need 1 ≤ min ≤ max",
                self.output.min_tokens, self.output.max_tokens
            ));
        }
        if self.embedding.dimensions == 0 || self.embedding.dimensions > 8192 {
            return bad(format!("embedding.dimensions = {}: must be between 1 and 8192", self.embedding.dimensions));
        }
        if !(0.0..=1.0).contains(&self.output.invalid_json_rate) {
            return bad(format!(
                "output.invalid_json_rate = {}: a rate must be between 0 and 1",
                self.output.invalid_json_rate
            ));
        }
        if !(0.0..=1.0).contains(&self.predict.short_rate) {
            return bad(format!("predict.short_rate = {}: a rate must be between 0 and 1", self.predict.short_rate));
        }
        if self.output.stream_chunk_tokens == 0 {
            return bad("output.stream_chunk_tokens must be at least 1".into());
        }
        Ok(())
    }

    /// The sliding quota window.
    pub fn window(&self) -> Duration {
        Duration::from_secs_f64(self.quota.window_secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_rejected() {
        let err = SimConfig::from_toml("[quota]\nrequests_per_minute = 5\n").unwrap_err();
        assert!(err.to_string().contains("requests_per_minute"), "{err}");
    }

    #[test]
    fn parses_a_scenario() {
        let c = SimConfig::from_toml(
            "seed = 7\n[quota]\nrequests_per_window = 100\nwindow_secs = 2\n[concurrency]\nmax_in_flight = 8\nmode = \"slow\"\n[faults]\nerror_503 = 0.1\n",
        )
        .unwrap();
        assert_eq!(c.seed, 7);
        assert_eq!(c.quota.requests_per_window, 100);
        assert_eq!(c.concurrency.mode, OverloadMode::Slow);
        assert_eq!(c.faults.error_503, 0.1);
    }

    #[test]
    fn fault_rates_must_add_up_to_at_most_one() {
        let err = SimConfig::from_toml("[faults]\nerror_500 = 0.6\nerror_503 = 0.6\n").unwrap_err();
        assert!(err.to_string().contains("more than 1"), "{err}");
    }
}
