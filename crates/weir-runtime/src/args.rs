//! The flags that say how to reach a model's endpoint and how hard to push it: base URL and
//! Google Cloud site, concurrency, rate limits, timeout and retries. `weir run` and `weir sql`
//! (and the cluster's executors) take the same ones, validated the same way; the Python
//! package takes them as keyword arguments of the same names, parsed by the same code.

use clap::{Args, ValueEnum};
use std::time::Duration;
use weir_core::{DriverSettings, QuotaStore, RateSettings, RetryPolicy, ThrottleSettings};
use weir_providers::ProviderOptions;

/// The most times an answer that fails the schema is asked for again (`--max-invalid-retries`).
const MAX_INVALID_RETRIES: u32 = 10;

/// Settings that cannot be used, with what to fix (the CLI exits with status 2 on it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SettingsError(pub String);

/// How concurrency is limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConcurrencyMode {
    /// Found from push-back and latency.
    Adaptive,
    /// Always --max-concurrency.
    Fixed,
}

/// Where the endpoint is and how to call it.
#[derive(Debug, Clone, Args)]
pub struct EndpointArgs {
    /// The provider's base URL (OpenAI-compatible: the API root, e.g. http://127.0.0.1:8000/v1;
    /// Gemini: replaces https://generativelanguage.googleapis.com; Vertex AI: replaces
    /// https://LOCATION-aiplatform.googleapis.com). Plain http only to loopback. Repeat it for
    /// replicas of one model that share its key: they are called as one pool (each call goes
    /// to the one with spare capacity; one that stops answering is cooled down).
    #[arg(long, value_name = "URL")]
    pub base_url: Vec<String>,
    /// Google Cloud project for vertex_ai/ models [default: GOOGLE_CLOUD_PROJECT].
    #[arg(long, value_name = "PROJECT")]
    pub project: Option<String>,
    /// Google Cloud location for vertex_ai/ models, e.g. us-central1 or global
    /// [default: GOOGLE_CLOUD_LOCATION, else us-central1]; several, comma-separated
    /// (us-central1,europe-west4), call the model in each as one pool.
    #[arg(long, value_name = "LOCATION")]
    pub location: Option<String>,
    /// A pool of endpoints for the model: a TOML file of [[endpoint]] tables, each with
    /// base_url, key_env (the environment variable holding its key), project, location,
    /// weight, rpm and tpm, all optional (see the README). Keys stay in the environment.
    #[arg(long, value_name = "FILE")]
    pub endpoints: Option<String>,
    /// The TOML file describing http/<name> models, one [models.NAME] table each: url, method,
    /// headers (values may read ${ENV_VARS}), body template, answer and usage JSON pointers,
    /// and which statuses to retry (see the README) [default: WEIR_HTTP_MODELS].
    #[arg(long, value_name = "FILE")]
    pub http_models: Option<String>,
    /// Most calls in flight at once.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_concurrency: usize,
    /// How many calls may be in flight: `adaptive` finds the endpoint's capacity from
    /// push-back and latency (up to --max-concurrency); `fixed` always allows --max-concurrency.
    #[arg(long, value_enum, default_value_t = ConcurrencyMode::Adaptive)]
    pub concurrency: ConcurrencyMode,
    /// Requests allowed per --limit-window (the endpoint's quota, when you know it).
    #[arg(long, value_name = "N")]
    pub rpm: Option<u64>,
    /// Tokens (prompt + output) allowed per --limit-window.
    #[arg(long, value_name = "N")]
    pub tpm: Option<u64>,
    /// The window --rpm and --tpm are counted over, in seconds (60 for per-minute quotas); also
    /// the window assumed for a quota learned from 429s that advise no delay (Vertex AI's).
    #[arg(long, value_name = "SECS", default_value_t = 60.0, allow_negative_numbers = true)]
    pub limit_window: f64,
    /// Do not learn limits from 429s and rate-limit headers.
    #[arg(long)]
    pub no_learn_limits: bool,
    /// Beam's client-side throttler: reject locally when requests exceed K × accepted requests
    /// over --limit-window (Beam's overload_ratio; 2 is its default). Off unless given.
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    pub sre_throttle: Option<f64>,
    /// Seconds a call may take before it is cancelled and retried.
    #[arg(long, value_name = "SECS", default_value_t = 120.0, allow_negative_numbers = true)]
    pub timeout: f64,
    /// Retries per record after its first call (retryable errors only).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub max_retries: u32,
    /// With a response schema (`--param response_schema=@FILE`): times an answer that is not
    /// JSON matching it is asked for again (each is paid for; at most 10), apart from
    /// --max-retries; then the record is an `invalid_output` error row quoting the answer.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub max_invalid_retries: u32,
    /// Where processes that call the same endpoint with the same key share its quota: `local`
    /// (this machine's processes of this user, through a socket in a private runtime
    /// directory: they learn and keep one quota together), `redis://HOST:PORT` (every process,
    /// on any machine, naming that Redis server; `rediss://` for TLS, required off this
    /// machine), or `off` (this process alone). A Redis URL with a password belongs in
    /// WEIR_QUOTA_STORE: any user of the machine can read a process's arguments.
    #[arg(long, value_name = "STORE", default_value = "local", env = "WEIR_QUOTA_STORE", hide_env_values = true)]
    pub quota_store: String,
}

/// The store `--quota-store` names.
pub fn quota_store(s: &str) -> Result<QuotaStore, SettingsError> {
    match s {
        "local" => Ok(QuotaStore::Local),
        "off" => Ok(QuotaStore::Off),
        url if url.starts_with("redis://") || url.starts_with("rediss://") => {
            #[cfg(feature = "redis")]
            {
                crate::share_redis::check_url(url).map_err(SettingsError)?;
                Ok(QuotaStore::Redis(url.to_string()))
            }
            #[cfg(not(feature = "redis"))]
            Err(SettingsError(
                "--quota-store redis://…: this build of weir has no Redis client (feature `redis`)".into(),
            ))
        }
        other => Err(SettingsError(format!(
            // Not repeated when it may hold a password (`REDIS://:pw@…`, a slip of the scheme).
            "--quota-store {}: say `local` (share the quota with this machine's processes), a Redis URL \
             (redis://HOST:PORT, or rediss:// for TLS: share it with every process that names the same server) or \
             `off`",
            if other.contains('@') || other.contains("password") {
                "(not repeated: it may hold a password)".to_string()
            } else {
                format!("{other:?}")
            }
        ))),
    }
}

impl EndpointArgs {
    /// Every problem with these flags, as a usage error naming the flag.
    pub fn check(&self) -> Result<(), SettingsError> {
        if self.max_concurrency == 0 {
            return Err(SettingsError("--max-concurrency must be at least 1".into()));
        }
        // Checked here, not at the first call: an executor or a Python engine with a base URL
        // it can never use must not start, to fail every job later.
        for url in &self.base_url {
            weir_providers::http::check_base_url(url).map_err(|e| SettingsError(e.to_string()))?;
        }
        self.pool()?;
        // A week at most: longer would overflow the clock's arithmetic, and no quota or call is
        // measured in weeks.
        const MAX_SECS: f64 = 7.0 * 86_400.0;
        if !(self.limit_window.is_finite() && self.limit_window > 0.0 && self.limit_window <= MAX_SECS) {
            return Err(SettingsError(format!(
                "--limit-window {}: must be a number of seconds > 0 and at most a week (604800)",
                self.limit_window
            )));
        }
        if self.rpm == Some(0) || self.tpm == Some(0) {
            return Err(SettingsError("--rpm and --tpm must be at least 1".into()));
        }
        if let Some(k) = self.sre_throttle {
            if !(k.is_finite() && k >= 1.0) {
                return Err(SettingsError(format!("--sre-throttle {k}: K must be a number ≥ 1 (Beam's default is 2)")));
            }
        }
        quota_store(&self.quota_store)?;
        // Each is a paid call: a large number is more likely a slip than a wish to pay for it.
        if self.max_invalid_retries > MAX_INVALID_RETRIES {
            return Err(SettingsError(format!(
                "--max-invalid-retries {}: at most {MAX_INVALID_RETRIES} (each is paid for; an answer that fails the schema that often will not pass)",
                self.max_invalid_retries
            )));
        }
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout <= MAX_SECS) {
            return Err(SettingsError(format!(
                "--timeout {}: must be a number of seconds > 0 and at most a week (604800)",
                self.timeout
            )));
        }
        Ok(())
    }

    /// The rate budgets: given limits, and whether to learn them.
    pub fn rate(&self) -> RateSettings {
        RateSettings {
            requests: self.rpm,
            tokens: self.tpm,
            window: Duration::from_secs_f64(self.limit_window),
            learn: !self.no_learn_limits,
        }
    }

    /// Each endpoint's throttle.
    pub fn throttle(&self) -> ThrottleSettings {
        ThrottleSettings {
            max_concurrency: self.max_concurrency,
            adaptive: self.concurrency == ConcurrencyMode::Adaptive,
            rate: self.rate(),
            sre_k: self.sre_throttle,
            store: quota_store(&self.quota_store).unwrap_or_default(),
        }
    }

    /// Timeout and retries (system text and parameters are the caller's).
    pub fn driver(&self) -> DriverSettings {
        DriverSettings {
            timeout: Duration::from_secs_f64(self.timeout),
            retry: RetryPolicy {
                max_retries: self.max_retries,
                max_invalid_retries: self.max_invalid_retries,
                ..RetryPolicy::default()
            },
            ..DriverSettings::default()
        }
    }

    /// Base URL and Google Cloud site (the caller sets the task and what else it has); a
    /// pool's first endpoint's.
    pub fn provider(&self) -> ProviderOptions {
        ProviderOptions {
            base_url: self.base_url.first().cloned(),
            project: self.project.clone(),
            location: self.locations().first().cloned(),
            http_models: self.http_models.clone(),
            ..ProviderOptions::default()
        }
    }

    /// The locations `--location` names (none, one, or a pool's).
    fn locations(&self) -> Vec<String> {
        locations(self.location.as_deref())
    }

    /// The pool of endpoints these flags declare, checked (see [`crate::endpoints`]): empty
    /// for a single endpoint.
    pub fn pool(&self) -> Result<Vec<crate::EndpointEntry>, SettingsError> {
        declared_pool(&self.base_url, self.location.as_deref(), self.endpoints.as_deref())
    }
}

/// The locations a `--location` value names (none, one, or a pool's, comma-separated).
fn locations(location: Option<&str>) -> Vec<String> {
    location.map(|l| l.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect()).unwrap_or_default()
}

/// The pool that `--base-url` (repeated), `--location` (comma-separated) and `--endpoints`
/// declare, checked (see [`crate::endpoints`]): empty for a single endpoint. `weir run`,
/// `weir sql`, executors and `weir batch` read a pool the same way.
pub fn declared_pool(
    base_url: &[String],
    location: Option<&str>,
    endpoints: Option<&str>,
) -> Result<Vec<crate::EndpointEntry>, SettingsError> {
    let locations = locations(location);
    if location.is_some_and(|l| l.split(',').any(|x| x.trim().is_empty())) {
        return Err(SettingsError(
            "--location: name a location (e.g. us-central1), or several separated by single commas".into(),
        ));
    }
    let entries = match endpoints {
        Some(_) if !base_url.is_empty() || location.is_some() => {
            return Err(SettingsError(
                "--endpoints lists the pool: give its base URLs and locations there, not with --base-url or \
                 --location as well"
                    .into(),
            ))
        }
        // A JSON list in place of a file (how Python passes endpoints=[...]).
        Some(list) if list.trim_start().starts_with('[') => {
            crate::endpoints::parse(list, "endpoints").map_err(SettingsError)?
        }
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| SettingsError(format!("--endpoints {path}: cannot read it: {e}")))?;
            crate::endpoints::parse(&text, &format!("--endpoints {path}")).map_err(SettingsError)?
        }
        None if base_url.len() > 1 && locations.len() > 1 => {
            return Err(SettingsError(
                "several --base-url and several --location: list each endpoint in an --endpoints file instead".into(),
            ))
        }
        None if base_url.len() > 1 => {
            base_url.iter().map(|u| crate::EndpointEntry { base_url: Some(u.clone()), ..Default::default() }).collect()
        }
        None if locations.len() > 1 => {
            locations.iter().map(|l| crate::EndpointEntry { location: Some(l.clone()), ..Default::default() }).collect()
        }
        None => return Ok(Vec::new()),
    };
    let from = match endpoints {
        Some(p) if p.trim_start().starts_with('[') => "--endpoints".into(),
        Some(p) => format!("--endpoints {p}"),
        None if base_url.len() > 1 => "--base-url".into(),
        None => "--location".into(),
    };
    crate::endpoints::check(&entries, &|k| std::env::var(k).ok()).map_err(|e| SettingsError(format!("{from}: {e}")))?;
    Ok(entries)
}
