//! `--metrics-listen`: the run's counters in the Prometheus text format at `GET /metrics`, for
//! dashboards and alerts while a long run goes on. Served by a minimal hyper server on the given
//! address (loopback unless told otherwise); it stops with the run.

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::time::Instant;
use weir_core::Driver;

/// Renders the counters of a run.
pub fn render(driver: &Driver, started: Instant) -> String {
    let m = driver.metrics();
    let mut s = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
        let _ = writeln!(s, "# HELP {name} {help}");
        let _ = writeln!(s, "# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(s, "{name}{labels} {v}");
        }
    };
    let g = |c: &std::sync::atomic::AtomicU64| c.load(Relaxed) as f64;
    metric(
        "weir_records_total",
        "counter",
        "Records finished, by outcome.",
        &[("{outcome=\"success\"}", g(&m.succeeded)), ("{outcome=\"failure\"}", g(&m.failed))],
    );
    metric("weir_calls_total", "counter", "Calls made to the endpoint.", &[("", g(&m.calls))]);
    metric("weir_retries_total", "counter", "Calls beyond each record's first.", &[("", g(&m.retries))]);
    metric(
        "weir_rate_limited_total",
        "counter",
        "Calls answered with a rate-limit error (429).",
        &[("", g(&m.rate_limited))],
    );
    metric("weir_cache_hits_total", "counter", "Records answered from the response cache.", &[("", g(&m.cache_hits))]);
    metric(
        "weir_throttled_seconds_total",
        "counter",
        "Seconds calls were held by the throttle (Beam: cumulativeThrottlingSeconds).",
        &[("", m.throttled_micros.load(Relaxed) as f64 / 1e6)],
    );
    metric(
        "weir_tokens_total",
        "counter",
        "Tokens reported by successful calls.",
        &[("{direction=\"in\"}", g(&m.tokens_in)), ("{direction=\"out\"}", g(&m.tokens_out))],
    );
    let kinds: Vec<(String, f64)> =
        m.failures_by_kind().into_iter().map(|(k, n)| (format!("{{kind=\"{k}\"}}"), n as f64)).collect();
    let kinds: Vec<(&str, f64)> = kinds.iter().map(|(l, v)| (l.as_str(), *v)).collect();
    metric("weir_failures_total", "counter", "Failed records, by kind.", &kinds);
    metric("weir_concurrency_limit", "gauge", "Calls allowed in flight now.", &[("", driver.concurrency() as f64)]);
    if let Some(r) = driver.rate_snapshot() {
        if let Some((cap, window, _)) = r.requests {
            metric(
                "weir_requests_per_second_limit",
                "gauge",
                "Request rate allowed now.",
                &[("", cap / window.as_secs_f64())],
            );
        }
        if let Some((cap, window, _)) = r.tokens {
            metric(
                "weir_tokens_per_second_limit",
                "gauge",
                "Token rate allowed now.",
                &[("", cap / window.as_secs_f64())],
            );
        }
    }
    let secs = started.elapsed().as_secs_f64().max(1e-6);
    metric("weir_success_rate", "gauge", "Successes per second since the start.", &[("", g(&m.succeeded) / secs)]);
    s
}

/// Serves `/metrics` on `addr` until the returned handle is aborted.
pub async fn serve(
    addr: SocketAddr,
    driver: Arc<Driver>,
    started: Instant,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let driver = driver.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let driver = driver.clone();
                    async move {
                        let (status, body) = if req.uri().path() == "/metrics" {
                            (200, render(&driver, started))
                        } else {
                            (404, "see /metrics\n".to_string())
                        };
                        http::Response::builder()
                            .status(status)
                            .header(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")
                            .body(Full::new(Bytes::from(body)))
                    }
                });
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok((local, task))
}
