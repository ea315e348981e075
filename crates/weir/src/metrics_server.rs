//! `--metrics-listen`: the run's metrics in the Prometheus text format at `GET /metrics`, for
//! dashboards and alerts while a long run goes on.
//!
//! The counters and the call-latency histogram are reported where they happen, through the
//! `metrics` facade (see `weir_core::RunMetrics`); this module installs the Prometheus exporter
//! (`metrics-exporter-prometheus`, serving on the given address) and keeps the gauges of the
//! limits in force up to date once a second.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use weir_core::RunMetrics;
use weir_runtime::{EndpointState, Runtime};

/// Reads `--metrics-listen`'s address: an IP address and port, or `localhost:PORT` (this
/// machine's loopback, as most tools take it; other names are not looked up, so the address
/// served is the one written).
pub fn listen_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    match s.strip_prefix("localhost:").map(str::parse::<u16>) {
        Some(Ok(port)) => Ok(SocketAddr::from(([127, 0, 0, 1], port))),
        _ => Err(format!("'{s}': expected IP:PORT (127.0.0.1:9464, [::1]:9464) or localhost:PORT")),
    }
}

/// Installs the exporter on `addr` and starts the task that updates, once a second, the gauges
/// of every endpoint `runtime` has connected, labelled by model and endpoint (abort it when the
/// run ends; a cluster executor keeps it for as long as it serves).
pub fn serve(addr: SocketAddr, runtime: Arc<Runtime>) -> Result<tokio::task::JoinHandle<()>, String> {
    let addr = chosen_port(addr)?;
    install(addr)?;
    tracing::info!("metrics on http://{addr}/metrics");
    let started = Instant::now();
    Ok(tokio::spawn(async move {
        loop {
            for e in runtime.endpoints().await {
                update_gauges(&e, started);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }))
}

/// `addr` with port 0 ("any free port") made a port that is free now, and said on stderr, since
/// a scraper has to be told where to look. (The exporter binds its own listener: the port is
/// found by binding one and letting it go, which another program could take in between; the
/// exporter's bind then fails with a message rather than serving elsewhere.)
fn chosen_port(addr: SocketAddr) -> Result<SocketAddr, String> {
    if addr.port() != 0 {
        return Ok(addr);
    }
    let picked = std::net::TcpListener::bind(addr).and_then(|l| l.local_addr()).map_err(|e| e.to_string())?;
    eprintln!("weir: metrics on http://{picked}/metrics");
    Ok(picked)
}

/// Installs the exporter on `addr`: the counters and histograms (the gauges are [`serve`]'s).
fn install(addr: SocketAddr) -> Result<(), String> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full("weir_call_seconds".into()),
            &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0],
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full("weir_time_to_first_token_seconds".into()),
                &[0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0],
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full("weir_inter_token_seconds".into()),
                &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0],
            )
        })
        .and_then(|b| b.install())
        .map_err(|e| e.to_string())?;
    RunMetrics::describe();
    Ok(())
}

/// An endpoint's gauges: the limits in force and its success rate.
fn update_gauges(e: &EndpointState, started: Instant) {
    // Counters a scraper has not seen yet show as zero from the endpoint's first second.
    e.metrics.announce();
    let labels = [("model", e.model.clone()), ("endpoint", e.endpoint.clone())];
    metrics::gauge!("weir_concurrency_limit", &labels).set(e.concurrency as f64);
    if let Some(r) = &e.rate {
        if let Some((cap, window, _)) = r.requests {
            metrics::gauge!("weir_requests_per_second_limit", &labels).set(cap / window.as_secs_f64());
        }
        if let Some((cap, window, _)) = r.tokens {
            metrics::gauge!("weir_tokens_per_second_limit", &labels).set(cap / window.as_secs_f64());
        }
    }
    metrics::gauge!("weir_quota_processes", &labels).set(e.sharing.processes.max(1) as f64);
    metrics::gauge!("weir_calls_held", &labels).set(e.held as f64);
    let secs = started.elapsed().as_secs_f64().max(1e-6);
    metrics::gauge!("weir_success_rate", &labels).set(e.metrics.succeeded.load(Relaxed) as f64 / secs);
    // A pool's endpoints, each under its own `member` label (the model's series above are
    // the pool's together).
    for m in &e.pool {
        let labels = [("model", e.model.clone()), ("member", m.endpoint.clone())];
        metrics::counter!("weir_pool_calls_total", &labels).absolute(m.calls);
        metrics::counter!("weir_pool_rate_limited_total", &labels).absolute(m.rate_limited);
        metrics::counter!("weir_pool_failed_total", &labels).absolute(m.failed);
        metrics::gauge!("weir_pool_concurrency_limit", &labels).set(m.concurrency as f64);
        if let Some((cap, window, _)) = m.rates.requests {
            metrics::gauge!("weir_pool_requests_per_second_limit", &labels).set(cap / window.as_secs_f64());
        }
        // 1 active, 0.5 cooling down, 0 dead.
        let up = match m.health {
            weir_core::EndpointHealth::Active => 1.0,
            weir_core::EndpointHealth::CoolingDown => 0.5,
            weir_core::EndpointHealth::Dead => 0.0,
        };
        metrics::gauge!("weir_pool_endpoint_up", &labels).set(up);
    }
}

#[cfg(test)]
mod listen_tests {
    use super::listen_addr;

    #[test]
    fn listen_addresses_take_ips_and_localhost() {
        assert_eq!(listen_addr("127.0.0.1:0").unwrap().port(), 0);
        assert_eq!(listen_addr("localhost:9464").unwrap(), "127.0.0.1:9464".parse().unwrap());
        assert!(listen_addr("[::1]:1").is_ok());
        assert!(listen_addr("localhost").is_err());
        assert!(listen_addr("example.com:80").unwrap_err().contains("localhost:PORT"));
    }
}
