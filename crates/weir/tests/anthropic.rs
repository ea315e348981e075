//! Issue #37, first part: `anthropic/` models through the Messages API, against `weir sim`
//! speaking it (its rate limits, 429s with whole-second `retry-after`, 529 overloads, named SSE
//! events, a response schema through a forced tool).

mod util;

use util::*;

async fn claude(sim: &weir_sim::SimServer, dir: &Dir, n: usize, extra: &[&str]) -> std::process::Output {
    let (data, _) = prompts(n);
    let input = dir.write("in.jsonl", &data);
    weir()
        .env("ANTHROPIC_API_KEY", "sk-ant-test-SECRET")
        .args(["run", "--model", "anthropic/claude-haiku-4-5", "--base-url", &sim.url(), "--id-field", "key"])
        .args(["--progress", "never", "--input", input.to_str().unwrap()])
        .args(["--output", dir.path("out.jsonl").to_str().unwrap()])
        .args(extra)
        .output()
        .await
        .unwrap()
}

/// A quota of 40 requests a second, refusals advised in whole seconds: every record answered
/// once, refusals bounded, the summary priced at Claude's rates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_at_its_quota_with_whole_second_advice() {
    let mut config = weir_sim::SimConfig::default();
    config.quota.requests_per_window = 40;
    config.quota.window_secs = 1.0;
    config.quota.round_advice = true;
    let sim = sim(config).await;
    let dir = Dir::new("anthropic-quota");
    let o = claude(&sim, &dir, 300, &[]).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let out = rows(&dir.path("out.jsonl"));
    assert_eq!(out.len(), 300, "{err}");
    assert!(out.iter().all(|r| r["finish_reason"] == "stop" || r["finish_reason"] == "length"), "{:?}", out[0]);
    assert!(out.iter().all(|r| r["usage"]["output_tokens"].as_u64() > Some(0)));
    let s = sim.stats();
    assert_eq!(s.requests - s.rate_limited, 300, "each record answered once");
    eprintln!("anthropic quota: {} of {} refused", s.rate_limited, s.requests);
    // Reset headers in whole seconds are rounded up, not down (read as 0 s for a 1 s window,
    // they sent a window's worth early: 12 % refused on a loaded machine); 0 of 300 here
    // unloaded, and the issue's ≤ 2 % is measured in bench/quota.py. Bounded at 5 % for load.
    assert!(s.rate_limited * 100 <= s.requests * 5, "{} of {} refused: {err}", s.rate_limited, s.requests);
    assert!(err.contains("claude-haiku-4-5 at $1/$5"), "{err}");
    assert!(!err.contains("SECRET") && !std::fs::read_to_string(dir.path("out.jsonl")).unwrap().contains("SECRET"));
    sim.shutdown().await;
}

/// 529 overloaded_error on a third of the calls: backed off and tried again, every record
/// answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overload_storm_is_backed_off() {
    let mut config = weir_sim::SimConfig::default();
    config.faults.error_503 = 0.3;
    let sim = sim(config).await;
    let dir = Dir::new("anthropic-529");
    let o = claude(&sim, &dir, 60, &[]).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 60, "{err}");
    let s = sim.stats();
    assert!(s.requests > 60, "the overloaded calls were tried again: {err}");
    sim.shutdown().await;
}

/// Streamed answers (its named events), and a response schema through the forced tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_schemas() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("anthropic-stream");
    let events = dir.path("events.jsonl");
    let o = claude(&sim, &dir, 5, &["--stream", "--events", events.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = rows(&dir.path("out.jsonl"));
    assert_eq!(out.len(), 5);
    assert!(out.iter().all(|r| !r["response"].as_str().unwrap().is_empty()), "{:?}", out[0]);
    assert!(stderr(&o).contains("time to first token"), "{}", stderr(&o));
    let dir = Dir::new("anthropic-schema");
    let schema = r#"response_schema={"type":"object","properties":{"label":{"type":"string"},"score":{"type":"number"}},"required":["label","score"]}"#;
    let o = claude(&sim, &dir, 5, &["--param", schema]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for r in rows(&dir.path("out.jsonl")) {
        let v: serde_json::Value = serde_json::from_str(r["response"].as_str().unwrap()).unwrap();
        assert!(v["label"].is_string() && v["score"].is_number(), "{v}");
    }
    // A parameter the API has no place for stops the run at once, with no call.
    let dir = Dir::new("anthropic-seed");
    let before = sim.stats().requests;
    let o = claude(&sim, &dir, 5, &["--param", "seed=3"]).await;
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("--param seed"), "{}", stderr(&o));
    assert_eq!(sim.stats().requests, before);
    sim.shutdown().await;
}
