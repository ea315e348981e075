//! The proof that the simulator speaks the real protocols: the official Python clients
//! (`openai`, `google-genai`), pointed at it by base URL, complete calls and streaming calls and
//! recognise its 429s as rate-limit errors. Needs `WEIR_PYTHON` (a Python with both clients,
//! set up by `scripts/setup-peers`); skipped without it unless `WEIR_REQUIRE_PEERS=1`.

use std::time::Duration;
use weir_sim::{SimConfig, SimServer};

fn peer(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ if std::env::var("WEIR_REQUIRE_PEERS").as_deref() == Ok("1") => {
            panic!("{var} is not set; run ./scripts/test (it installs the peers)")
        }
        _ => {
            eprintln!("skipped: {var} is not set (./scripts/test sets it)");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_clients_work_against_the_simulator() {
    let Some(python) = peer("WEIR_PYTHON") else { return };
    let mut config = SimConfig::default();
    config.quota.requests_per_window = 2;
    config.quota.window_secs = 600.0;
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    // The directory cargo runs the test for (a build shared between checkouts would carry the
    // path of the checkout it was compiled in).
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    let script = format!("{root}/tests/python/clients.py");
    let run = tokio::process::Command::new(python).arg(script).arg(sim.url()).kill_on_drop(true).output();
    let out = tokio::time::timeout(Duration::from_secs(120), run).await.expect("the clients finish").unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all client checks passed"));
    let stats = sim.stats();
    // The upload followed the Files API's resumable protocol, as the simulator checks it.
    assert_eq!((stats.gemini_files_uploaded, stats.gemini_upload_refusals), (1, 0));
    assert_eq!(stats.rate_limited, 3, "one 429 for each client");
    assert_eq!(stats.media_parts, 4, "two images through google-genai, one through openai, one through anthropic");
    assert!(stats.streams >= 3);
    sim.shutdown().await;
}
