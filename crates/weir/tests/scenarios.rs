//! Deterministic throttling scenarios under `tokio::time::pause()`, described in
//! `tests/scenarios/*.toml`: a simulated endpoint (the simulator's own quota logic, a latency
//! model, a hidden concurrency cap, 503 bursts, quota changes) behind the real driver, rate
//! budgets and adaptive concurrency. Time is virtual, so a ten-minute scenario runs in a moment
//! and gives the same result every time. Each file states the ranges its results must fall in.

use futures::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use weir_core::{
    Driver, DriverSettings, ErrorKind, ModelError, ModelHandler, ModelRequest, ModelResponse, Outcome, QuotaScope,
    RateSettings, Record, RetryHint, RetryPolicy, RunMetrics, Throttle, ThrottleSettings, Usage,
};
use weir_sim::config::QuotaConfig;
use weir_sim::quota::{Quotas, Rejection};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    description: String,
    records: usize,
    #[serde(default = "default_max")]
    max_concurrency: usize,
    #[serde(default)]
    client: Client,
    endpoint: Endpoint,
    expect: Expect,
}

fn default_max() -> usize {
    64
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Client {
    rpm: Option<u64>,
    tpm: Option<u64>,
    limit_window_secs: Option<f64>,
    #[serde(default)]
    fixed_concurrency: bool,
    /// Independent clients (processes) sharing the endpoint's quota.
    #[serde(default)]
    clients: usize,
    /// Beam's SRE throttler with this overload ratio.
    sre_k: Option<f64>,
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct Endpoint {
    latency_ms: f64,
    #[serde(default)]
    requests_per_window: u64,
    #[serde(default)]
    tokens_per_window: u64,
    #[serde(default = "default_window")]
    window_secs: f64,
    #[serde(default)]
    requests_per_day: u64,
    #[serde(default)]
    max_in_flight: u64,
    #[serde(default)]
    overload: Option<String>,
    #[serde(default)]
    change: Vec<Change>,
    #[serde(default)]
    burst_503: Vec<Burst>,
    /// Share of calls answered 503 at random, whatever the load (a flaky backend, not overload).
    #[serde(default)]
    random_503: f64,
    /// Advised delays rounded up to whole seconds, as real servers send them.
    #[serde(default)]
    round_advice: bool,
}

fn default_window() -> f64 {
    60.0
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct Change {
    at_secs: f64,
    requests_per_window: u64,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct Burst {
    from_secs: f64,
    to_secs: f64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    window_share: Option<[f64; 2]>,
    rejected_share: Option<[f64; 2]>,
    learned_requests: Option<[f64; 2]>,
    throughput_share: Option<[f64; 2]>,
    final_concurrency: Option<[usize; 2]>,
    all_succeed: Option<bool>,
    stopped: Option<String>,
    successes: Option<[u64; 2]>,
    /// Tokens per full window (after the first) ÷ the token quota.
    token_window_share: Option<[f64; 2]>,
    /// The ideal completion time (every window full from the start) ÷ the actual one.
    completion_share: Option<[f64; 2]>,
}

/// The simulated endpoint: the simulator's quota logic with virtual time.
struct SimEndpoint {
    cfg: Endpoint,
    quotas: Mutex<Quotas>,
    in_flight: AtomicU64,
    start: Instant,
    successes: Mutex<Vec<f64>>,
    tokens: Mutex<Vec<(f64, u64)>>,
    rejected: AtomicU64,
    calls: AtomicU64,
    rng: Mutex<SmallRng>,
}

struct Leave<'a>(&'a AtomicU64);
impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

#[async_trait::async_trait]
impl ModelHandler for SimEndpoint {
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        self.calls.fetch_add(1, Relaxed);
        let now = Instant::now();
        let t = now.duration_since(self.start).as_secs_f64();
        let level = self.in_flight.fetch_add(1, Relaxed) + 1;
        let _leave = Leave(&self.in_flight);
        let reject = |e: ModelError| {
            self.rejected.fetch_add(1, Relaxed);
            Err(e)
        };
        if self.cfg.burst_503.iter().any(|b| t >= b.from_secs && t < b.to_secs) {
            tokio::time::sleep(Duration::from_millis(5)).await;
            return reject(ModelError::new(ErrorKind::Server, "503 overloaded").with_status(503));
        }
        if self.cfg.random_503 > 0.0 && self.rng.lock().unwrap().gen_bool(self.cfg.random_503) {
            tokio::time::sleep(Duration::from_millis(5)).await;
            return reject(ModelError::new(ErrorKind::Server, "503 unavailable").with_status(503));
        }
        let mut latency = self.cfg.latency_ms;
        if self.cfg.max_in_flight > 0 && level > self.cfg.max_in_flight {
            match self.cfg.overload.as_deref().unwrap_or("503") {
                "503" => return reject(ModelError::new(ErrorKind::Server, "503 overloaded").with_status(503)),
                "429" => {
                    return reject(
                        ModelError::new(ErrorKind::RateLimited, "429 overloaded")
                            .with_status(429)
                            .with_hint(RetryHint::Later(None)),
                    )
                }
                _ => latency *= level as f64 / self.cfg.max_in_flight as f64,
            }
        }
        let prompt_tokens = (request.prompt.len() as u64).div_ceil(4);
        let output_tokens = 20;
        let admitted = {
            let mut q = self.quotas.lock().unwrap();
            if let Some(c) = self.cfg.change.iter().rfind(|c| t >= c.at_secs) {
                q.set_limits(c.requests_per_window, self.cfg.tokens_per_window);
            }
            q.admit("key", prompt_tokens + output_tokens, now)
        };
        match admitted {
            Ok(_) => {}
            Err(Rejection::Requests { retry_after, .. }) => {
                return reject(
                    ModelError::new(ErrorKind::RateLimited, "429 requests")
                        .with_status(429)
                        .with_hint(RetryHint::Later(Some(retry_after)))
                        .with_quota(QuotaScope::Requests),
                )
            }
            Err(Rejection::Tokens { retry_after, .. }) => {
                return reject(
                    ModelError::new(ErrorKind::RateLimited, "429 tokens")
                        .with_status(429)
                        .with_hint(RetryHint::Later(Some(retry_after)))
                        .with_quota(QuotaScope::Tokens),
                )
            }
            Err(Rejection::Daily { .. }) => {
                return reject(ModelError::new(ErrorKind::QuotaExhausted, "per-day quota spent").with_status(429))
            }
            Err(Rejection::TooLarge { .. }) => return Err(ModelError::new(ErrorKind::BadRequest, "too large")),
        }
        tokio::time::sleep(Duration::from_secs_f64(latency / 1000.0)).await;
        let at = Instant::now().duration_since(self.start).as_secs_f64();
        self.successes.lock().unwrap().push(at);
        self.tokens.lock().unwrap().push((at, prompt_tokens + output_tokens));
        Ok(ModelResponse {
            text: "ok".into(),
            finish_reason: "stop".into(),
            usage: Usage { prompt_tokens, output_tokens, total_tokens: prompt_tokens + output_tokens },
            model_version: None,
            limits: None,
            embedding: None,
        })
    }

    fn model_id(&self) -> &str {
        "sim/scenario"
    }
}

fn check(name: &str, what: &str, value: f64, range: [f64; 2], failures: &mut Vec<String>) {
    let ok = value >= range[0] - 1e-9 && value <= range[1] + 1e-9;
    println!("  {what}: {value:.4} (expected {}..={}) {}", range[0], range[1], if ok { "ok" } else { "FAIL" });
    if !ok {
        failures.push(format!("{name}: {what} = {value:.4}, expected {}..={}", range[0], range[1]));
    }
}

async fn run_scenario(name: &str) -> Vec<String> {
    // The directory cargo runs the test for (a build shared between checkouts would carry the
    // path of the checkout it was compiled in).
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    let path = format!("{root}/tests/scenarios/{name}.toml");
    let sc: Scenario =
        toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap_or_else(|e| panic!("{path}: {e}"));
    println!("{name}: {}", sc.description);
    let e = &sc.expect;
    let asserts = [
        e.window_share.is_some(),
        e.rejected_share.is_some(),
        e.learned_requests.is_some(),
        e.throughput_share.is_some(),
        e.final_concurrency.is_some(),
        e.all_succeed.is_some(),
        e.stopped.is_some(),
        e.successes.is_some(),
        e.token_window_share.is_some(),
        e.completion_share.is_some(),
    ];
    assert!(asserts.iter().any(|a| *a), "{path}: [expect] asserts nothing, so the scenario could not fail");
    let quota = QuotaConfig {
        requests_per_window: sc.endpoint.requests_per_window,
        tokens_per_window: sc.endpoint.tokens_per_window,
        window_secs: sc.endpoint.window_secs,
        requests_per_day: sc.endpoint.requests_per_day,
        day_secs: 86_400.0,
        round_advice: sc.endpoint.round_advice,
        ..QuotaConfig::default()
    };
    let endpoint = Arc::new(SimEndpoint {
        cfg: sc.endpoint.clone(),
        quotas: Mutex::new(Quotas::new(quota)),
        in_flight: AtomicU64::new(0),
        start: Instant::now(),
        successes: Mutex::new(Vec::new()),
        tokens: Mutex::new(Vec::new()),
        rejected: AtomicU64::new(0),
        calls: AtomicU64::new(0),
        rng: Mutex::new(SmallRng::seed_from_u64(7)),
    });
    let window = Duration::from_secs_f64(sc.client.limit_window_secs.unwrap_or(60.0));
    let rate = RateSettings { requests: sc.client.rpm, tokens: sc.client.tpm, window, learn: true };
    let settings = DriverSettings {
        timeout: Duration::from_secs(60),
        retry: RetryPolicy { max_retries: 100, ..RetryPolicy::default() },
        ..DriverSettings::default()
    };
    let metrics = Arc::new(RunMetrics::default());
    // Each client is a process of its own: its own throttle, the endpoint's quota shared.
    let drivers: Vec<Arc<Driver>> = (0..sc.client.clients.max(1))
        .map(|_| {
            let throttle = Arc::new(Throttle::new(&ThrottleSettings {
                max_concurrency: sc.max_concurrency,
                adaptive: !sc.client.fixed_concurrency,
                rate: rate.clone(),
                sre_k: sc.client.sre_k,
                store: weir_core::QuotaStore::Off,
            }));
            Arc::new(Driver::new(endpoint.clone(), throttle, settings.clone(), metrics.clone()))
        })
        .collect();
    let driver = drivers[0].clone();
    let records = (0..sc.records).map(|i| {
        let id = weir_core::RecordId::Text(i.to_string());
        Record::new(id, i as u64 + 1, format!("prompt {i:06} about the river"), Default::default())
    });
    let t0 = Instant::now();
    // The records are dealt to the clients in turn; each client works through its share.
    let n = drivers.len();
    let mut shares: Vec<Vec<Record>> = (0..n).map(|_| Vec::new()).collect();
    for (i, r) in records.enumerate() {
        shares[i % n].push(r);
    }
    let tasks: Vec<_> = drivers
        .iter()
        .cloned()
        .zip(shares)
        .map(|(d, share)| {
            let width = sc.max_concurrency * 4;
            tokio::spawn(async move {
                futures::stream::iter(share)
                    .map(|r| {
                        let d = d.clone();
                        async move { d.run(r).await }
                    })
                    .buffer_unordered(width)
                    .collect::<Vec<Outcome>>()
                    .await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(t.await.unwrap());
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let ok = outcomes.iter().filter(|o| matches!(o, Outcome::Success(_))).count() as u64;
    let calls = endpoint.calls.load(Relaxed);
    let rejected = endpoint.rejected.load(Relaxed);
    println!("  {ok} of {} succeeded in {elapsed:.1} virtual s; {calls} calls, {rejected} refused", sc.records);
    let mut failures = Vec::new();
    let e = &sc.expect;
    if let Some(r) = e.rejected_share {
        check(name, "refused share of calls", rejected as f64 / calls.max(1) as f64, r, &mut failures);
    }
    if let Some(r) = e.window_share {
        // Successes per window after the first, up to the last full window, against the quota
        // in force for most of that window.
        let w = sc.endpoint.window_secs;
        let times = endpoint.successes.lock().unwrap().clone();
        let last = times.iter().cloned().fold(0.0, f64::max);
        let full = (last / w).floor() as usize;
        let mut shares = Vec::new();
        for k in 1..full {
            let (a, b) = (k as f64 * w, (k + 1) as f64 * w);
            let n = times.iter().filter(|t| **t >= a && **t < b).count() as f64;
            let quota = sc
                .endpoint
                .change
                .iter()
                .rfind(|c| c.at_secs <= a)
                .map_or(sc.endpoint.requests_per_window, |c| c.requests_per_window);
            // The window in which a change happens is judged against neither quota.
            if sc.endpoint.change.iter().any(|c| c.at_secs > a - w && c.at_secs < b) {
                continue;
            }
            shares.push(n / quota as f64);
        }
        println!("  per-window shares: {:?}", shares.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>());
        let mean = shares.iter().sum::<f64>() / shares.len().max(1) as f64;
        check(name, "mean successes per window / quota", mean, r, &mut failures);
    }
    if let Some(r) = e.token_window_share {
        let w = sc.endpoint.window_secs;
        let tokens = endpoint.tokens.lock().unwrap().clone();
        let last = tokens.iter().map(|t| t.0).fold(0.0, f64::max);
        let full = (last / w).floor() as usize;
        let shares: Vec<f64> = (1..full)
            .map(|k| {
                let (a, b) = (k as f64 * w, (k + 1) as f64 * w);
                tokens.iter().filter(|t| t.0 >= a && t.0 < b).map(|t| t.1).sum::<u64>() as f64
                    / sc.endpoint.tokens_per_window as f64
            })
            .collect();
        println!("  per-window token shares: {:?}", shares.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>());
        let mean = shares.iter().sum::<f64>() / shares.len().max(1) as f64;
        check(name, "mean tokens per window / token quota", mean, r, &mut failures);
    }
    if let Some(r) = e.completion_share {
        let w = sc.endpoint.window_secs;
        let times = endpoint.successes.lock().unwrap().clone();
        let last = times.iter().cloned().fold(0.0, f64::max);
        let counts: Vec<usize> = (0..=(last / w).floor() as usize)
            .map(|k| times.iter().filter(|t| **t >= k as f64 * w && **t < (k + 1) as f64 * w).count())
            .collect();
        println!("  successes per window: {counts:?}");
        // Every window full from the start: the last window's requests start when it opens.
        let q = sc.endpoint.requests_per_window as f64;
        let ideal = ((sc.records as f64 - 1.0) / q).floor() * sc.endpoint.window_secs + sc.endpoint.latency_ms / 1000.0;
        check(name, "ideal completion time / actual", ideal / elapsed, r, &mut failures);
    }
    if let Some(r) = e.learned_requests {
        // The learned rate, in requests per the endpoint's window (the learned window may differ
        // a little from the endpoint's, with the count to match).
        let learned = driver.rate_snapshot().and_then(|s| s.requests).map_or(0.0, |(n, w, _)| {
            println!("  learned: {n} requests per {w:?}");
            n * sc.endpoint.window_secs / w.as_secs_f64()
        });
        check(name, "learned requests per window", learned, r, &mut failures);
    }
    if let Some(r) = e.throughput_share {
        let cap = sc.endpoint.max_in_flight as f64;
        let physical = cap / (sc.endpoint.latency_ms / 1000.0);
        check(name, "throughput / (cap / latency)", ok as f64 / elapsed / physical, r, &mut failures);
    }
    if let Some(r) = e.final_concurrency {
        let c = driver.concurrency() as f64;
        check(name, "final concurrency limit", c, [r[0] as f64, r[1] as f64], &mut failures);
    }
    if e.all_succeed == Some(true) && ok != sc.records as u64 {
        failures.push(format!("{name}: {ok} of {} succeeded", sc.records));
    }
    if let Some(r) = e.successes {
        check(name, "successes", ok as f64, [r[0] as f64, r[1] as f64], &mut failures);
    }
    if let Some(kind) = &e.stopped {
        let got = driver.stop_reason().map(|s| s.kind.as_str().to_string());
        println!("  stopped: {got:?}");
        if got.as_deref() != Some(kind.as_str()) {
            failures.push(format!("{name}: stopped {got:?}, expected {kind}"));
        }
    }
    failures
}

macro_rules! scenario {
    ($name:ident) => {
        #[tokio::test(start_paused = true)]
        async fn $name() {
            let failures = run_scenario(stringify!($name)).await;
            assert!(failures.is_empty(), "{failures:#?}");
        }
    };
}

scenario!(steady_quota);
scenario!(steady_quota_told);
scenario!(quota_drop);
scenario!(hidden_cap);
scenario!(latency_grows);
scenario!(bursts_503);
scenario!(daily_quota);
scenario!(random_503_quota);
scenario!(random_503_cap);
scenario!(token_quota);
scenario!(coarse_advice);
scenario!(two_clients);
scenario!(sre_throttle);

/// The same machinery through the real HTTP provider against the real simulator, in real time:
/// a Gemini API client, `weir sim` with a quota of 40 requests per 2 s window and advice rounded
/// to whole seconds, the record driver over one throttle. The simulator's own counts are the
/// truth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_quota_through_the_real_provider() {
    use weir_providers::{connect, ModelSpec, ProviderOptions};
    let mut config = weir_sim::SimConfig::default();
    config.quota.requests_per_window = 40;
    config.quota.window_secs = 2.0;
    config.quota.round_advice = true;
    config.latency.fixed_ms = 30.0;
    let sim = weir_sim::SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let spec: ModelSpec = "gemini/m".parse().unwrap();
    let options = ProviderOptions { base_url: Some(sim.url()), ..ProviderOptions::default() };
    let handler = connect(&spec, &options, &|_| None).await.unwrap().handler;
    let throttle = Arc::new(Throttle::new(&ThrottleSettings::default()));
    let settings =
        DriverSettings { retry: RetryPolicy { max_retries: 30, ..RetryPolicy::default() }, ..Default::default() };
    let driver = Arc::new(Driver::new(handler, throttle, settings, Arc::new(RunMetrics::default())));
    let records = (0..400).map(|i| {
        Record::new(weir_core::RecordId::Text(i.to_string()), i + 1, format!("http prompt {i}"), Default::default())
    });
    let outcomes: Vec<Outcome> = futures::stream::iter(records)
        .map(|r| {
            let d = driver.clone();
            async move { d.run(r).await }
        })
        .buffer_unordered(128)
        .collect()
        .await;
    let stats = sim.stats();
    sim.shutdown().await;
    assert!(outcomes.iter().all(|o| matches!(o, Outcome::Success(_))));
    let per_s = &stats.successes_per_second;
    // Full 2-second windows after the first, up to the last full one.
    let windows: Vec<u64> = per_s.chunks(2).filter(|c| c.len() == 2).map(|c| c.iter().sum()).collect();
    let inner = &windows[1..windows.len().saturating_sub(1)];
    let mean = inner.iter().sum::<u64>() as f64 / inner.len().max(1) as f64 / 40.0;
    println!(
        "successes per window: {windows:?}; mean share {mean:.3}; {} of {} refused",
        stats.rate_limited, stats.requests
    );
    assert!(mean >= 0.85, "windows {windows:?}");
    assert!((stats.rate_limited as f64) < 0.1 * stats.requests as f64, "{} of {}", stats.rate_limited, stats.requests);
}
