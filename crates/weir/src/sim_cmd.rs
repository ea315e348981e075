//! `weir sim`: the simulator as a standalone server.

use anyhow::Context;
use clap::Args;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use weir_sim::config::FAULT_KINDS;
use weir_sim::{OverloadMode, SimConfig, SimServer};

use crate::UsageError;

/// Options of `weir sim`. Flags override the values of `--config`.
#[derive(Debug, Args)]
#[command(
    after_help = "Routes: POST /v1beta/models/{m}:generateContent and :streamGenerateContent[?alt=sse] (also under /v1/); \
POST /v1[beta1]/projects/{p}/locations/{l}/publishers/google/models/{m}:generateContent (Vertex AI); \
POST /v1/chat/completions (OpenAI, stream included; any path ending in /chat/completions, e.g. a Vertex \
endpoint's OpenAI-compatible route); POST /v1/embeddings; GET /v1/models; POST /v1/messages (Anthropic, stream \
included) and /v1/messages/batches (Message Batches); \
POST /v1beta/models/{m}:batchEmbedContents and :embedContent; \
POST /v1[beta1]/projects/{p}/locations/{l}/endpoints/{id}:predict and :rawPredict; \
POST /v1/projects/{p}/locations/{l}/publishers/google/models/{m}:predict (text embeddings); \
batch jobs: /v1/files and /v1/batches (OpenAI), :batchGenerateContent and /v1beta/batches (Gemini API), \
/v1/projects/{p}/locations/{l}/batchPredictionJobs (Vertex AI; input and output in the buckets of --gcs-listen); \
POST /token and GET /computeMetadata/v1/instance/service-accounts/default/token (Google tokens); \
GET /stats; POST /stats/reset; GET /requests (with capture_requests).\n\n\
A prompt containing [sim:KIND] always gets that fault, e.g. [sim:error_503]."
)]
pub struct SimArgs {
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Also serve the simulator's Cloud Storage buckets here (XML API, no auth), where its
    /// Vertex AI batch jobs read their input and write their output: point
    /// `STORAGE_EMULATOR_HOST` at it for `weir run --mode batch --model vertex_ai/…`.
    #[arg(long, value_name = "ADDR")]
    gcs_listen: Option<SocketAddr>,
    /// A TOML scenario file (sections: latency, quota, concurrency, faults, output, auth,
    /// predict, embedding, batch; and seed, api_keys, models, capture_requests).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Seed for generated text, latency spread and fault decisions.
    #[arg(long)]
    seed: Option<u64>,
    /// Fixed latency of every answer, in milliseconds.
    #[arg(long, value_name = "MS")]
    latency_ms: Option<f64>,
    /// Latency added per generated token, in milliseconds.
    #[arg(long, value_name = "MS")]
    per_token_ms: Option<f64>,
    /// Upper bound of a random extra latency per request, in milliseconds.
    #[arg(long, value_name = "MS")]
    jitter_ms: Option<f64>,
    /// Requests accepted per quota window, per key (0 = unlimited).
    #[arg(long, value_name = "N")]
    rpm: Option<u64>,
    /// Tokens (prompt + generated) accepted per quota window, per key (0 = unlimited).
    #[arg(long, value_name = "N")]
    tpm: Option<u64>,
    /// Length of the quota window in seconds (60 is a real minute).
    #[arg(long, value_name = "SECS")]
    window_secs: Option<f64>,
    /// Requests accepted per day, per key; once spent it stays spent (0 = unlimited).
    #[arg(long, value_name = "N")]
    rpd: Option<u64>,
    /// Length of the simulated day, in seconds.
    #[arg(long, value_name = "SECS")]
    day_secs: Option<f64>,
    /// Round advised delays (retry-after, retryDelay) up to whole seconds, as real servers do.
    #[arg(long)]
    round_advice: bool,
    /// How the quota window moves: sliding (each request counts for --window-secs after it
    /// came) or fixed (counts start again every --window-secs, as a quota reset on the minute).
    #[arg(long, value_name = "KIND")]
    window: Option<weir_sim::WindowKind>,
    /// Hidden concurrency cap: requests in flight above this are overloaded (0 = none).
    #[arg(long, value_name = "N")]
    max_in_flight: Option<u64>,
    /// What happens above the cap: 429, 503, or slow (latency grows with load).
    #[arg(long, value_name = "MODE", value_parser = ["429", "503", "slow"])]
    overload: Option<String>,
    /// A fault rate, KIND=RATE (repeatable). Kinds: error_500, error_503, reset, hang,
    /// malformed, truncate (streams only), block_prompt, block_candidate.
    #[arg(long = "fault", value_name = "KIND=RATE")]
    faults: Vec<String>,
    /// Seconds a hung request waits before the server drops it.
    #[arg(long, value_name = "SECS")]
    hang_secs: Option<f64>,
    /// Fewest tokens in a generated answer.
    #[arg(long, value_name = "N")]
    min_tokens: Option<u32>,
    /// Most tokens in a generated answer (before max_tokens caps it).
    #[arg(long, value_name = "N")]
    max_tokens: Option<u32>,
    /// Accept only this key (repeatable); without it any key, or none, is accepted.
    #[arg(long = "api-key", value_name = "KEY")]
    api_keys: Vec<String>,
}

impl SimArgs {
    /// Raw flags → a validated scenario.
    pub fn to_config(&self) -> Result<SimConfig, UsageError> {
        let mut c = match &self.config {
            Some(path) => SimConfig::from_file(path).map_err(|e| UsageError(e.to_string()))?,
            None => SimConfig::default(),
        };
        macro_rules! set {
            ($field:expr, $flag:expr) => {
                if let Some(v) = $flag {
                    $field = v;
                }
            };
        }
        set!(c.seed, self.seed);
        set!(c.latency.fixed_ms, self.latency_ms);
        set!(c.latency.per_token_ms, self.per_token_ms);
        set!(c.latency.jitter_ms, self.jitter_ms);
        set!(c.quota.requests_per_window, self.rpm);
        set!(c.quota.tokens_per_window, self.tpm);
        set!(c.quota.window_secs, self.window_secs);
        set!(c.quota.requests_per_day, self.rpd);
        set!(c.quota.day_secs, self.day_secs);
        if self.round_advice {
            c.quota.round_advice = true;
        }
        set!(c.quota.window, self.window);
        set!(c.concurrency.max_in_flight, self.max_in_flight);
        set!(c.faults.hang_secs, self.hang_secs);
        set!(c.output.min_tokens, self.min_tokens);
        set!(c.output.max_tokens, self.max_tokens);
        if let Some(mode) = &self.overload {
            c.concurrency.mode = match mode.as_str() {
                "429" => OverloadMode::TooManyRequests,
                "503" => OverloadMode::Unavailable,
                _ => OverloadMode::Slow,
            };
        }
        for spec in &self.faults {
            let (kind, rate) = spec
                .split_once('=')
                .ok_or_else(|| UsageError(format!("--fault {spec}: expected KIND=RATE, for example error_503=0.05")))?;
            let rate: f64 = rate.parse().map_err(|_| UsageError(format!("--fault {spec}: {rate} is not a number")))?;
            let slot = c.faults.rate_mut(kind).ok_or_else(|| {
                UsageError(format!("--fault {spec}: unknown kind '{kind}'; kinds are {}", FAULT_KINDS.join(", ")))
            })?;
            *slot = rate;
        }
        if !self.api_keys.is_empty() {
            c.api_keys = self.api_keys.clone();
        }
        c.validate().map_err(|e| UsageError(e.to_string()))?;
        Ok(c)
    }
}

/// Waits for Ctrl-C or SIGTERM.
async fn shutdown_signal() -> anyhow::Result<()> {
    let mut signals = crate::signals::StopSignals::new().context("installing the SIGTERM handler")?;
    signals.next().await.context("waiting for Ctrl-C or SIGTERM")?;
    Ok(())
}

/// Runs the simulator until Ctrl-C or SIGTERM.
pub async fn run(args: SimArgs) -> anyhow::Result<u8> {
    let config = args.to_config()?;
    let server = SimServer::start(config, args.listen).await.context("starting the simulator")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "weir sim listening on {}", server.url())?;
        out.flush()?;
    }
    let gcs = match args.gcs_listen {
        Some(addr) => {
            let gcs = server.serve_gcs(addr).await.with_context(|| format!("--gcs-listen {addr}"))?;
            let mut out = std::io::stdout().lock();
            writeln!(out, "weir sim GCS on {} (STORAGE_EMULATOR_HOST={})", gcs.url(), gcs.url())?;
            out.flush()?;
            Some(gcs)
        }
        None => None,
    };
    shutdown_signal().await?;
    if let Some(gcs) = gcs {
        gcs.shutdown().await;
    }
    let stats = server.stats();
    server.shutdown().await;
    eprintln!(
        "weir sim: {} requests, {} successes, {} rate-limited, {} unavailable",
        stats.requests, stats.successes, stats.rate_limited, stats.unavailable
    );
    Ok(0)
}
