//! `vertex_ai/` models: Gemini on Vertex AI with Google credentials, against `weir sim` serving
//! both the Vertex model route and the token endpoint.

mod util;

use util::*;
use weir_sim::{SimConfig, SimServer};

const TOKEN: &str = "ya29.vertex-test-token";

/// A simulator whose model route accepts only `TOKEN`, which its token endpoint hands out
/// unless `shape` says otherwise.
async fn sim(shape: impl FnOnce(&mut SimConfig)) -> SimServer {
    let mut config = SimConfig { api_keys: vec![TOKEN.into()], ..SimConfig::default() };
    shape(&mut config);
    SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

fn service_account(dir: &Dir, token_uri: &str) -> std::path::PathBuf {
    let key = include_str!("../../weir-providers/tests/fixtures/test-service-account-key.pem");
    let file = serde_json::json!({
        "type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": key,
        "client_email": "weir@p.iam.gserviceaccount.com", "token_uri": token_uri,
    });
    dir.write("sa.json", file.to_string().as_bytes())
}

/// A run of `records` prompts against `server` as `vertex_ai/gemini-2.5-flash`, with a service
/// account whose `token_uri` is the simulator's: the output, the result path and the ids.
async fn vertex_run(
    server: &SimServer,
    dir: &Dir,
    records: usize,
    extra: &[&str],
) -> (std::process::Output, std::path::PathBuf, Vec<String>) {
    let sa = service_account(dir, &format!("{}/token", server.url()));
    let (data, ids) = prompts(records);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let o = weir()
        .args(["run", "--model", "vertex_ai/gemini-2.5-flash", "--base-url", &server.url(), "--id-field", "key"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .args(extra)
        .env("GOOGLE_APPLICATION_CREDENTIALS", &sa)
        .env("HOME", dir.path("home"))
        .output()
        .await
        .unwrap();
    (o, out, ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_on_vertex_with_a_service_account() {
    let server = sim(|_| {}).await;
    let dir = Dir::new("vertex-sa");
    let (o, out, ids) = vertex_run(&server, &dir, 50, &["--project", "my-project", "--location", "us-central1"]).await;
    let sa = dir.path("sa.json");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = rows(&out);
    assert_each_id_once(&ids, &results, &[]);
    assert_eq!(results[0]["model"], "vertex_ai/gemini-2.5-flash");
    let stats = server.stats();
    assert_eq!(stats.tokens_issued, 1, "one token, shared by every call");
    assert_eq!(stats.auth_failures, 0);
    // Neither the token nor the key is written anywhere.
    let key_line = "MII";
    for entry in walk(&dir.path("")) {
        let text = std::fs::read(&entry).unwrap_or_default();
        let text = String::from_utf8_lossy(&text);
        if entry == sa {
            continue;
        }
        assert!(!text.contains(TOKEN), "{entry:?} holds the access token");
        assert!(!text.contains(key_line) || entry.ends_with("in.jsonl"), "{entry:?} holds key material");
    }
    assert!(!stderr(&o).contains(TOKEN));
    server.shutdown().await;
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vertex_settings_that_cannot_work_exit_2_saying_what_to_fix() {
    let dir = Dir::new("vertex-bad");
    let input = dir.write("in.jsonl", b"{\"prompt\":\"hi\"}\n");
    let out = dir.path("out.jsonl");
    let base = ["run", "--model", "vertex_ai/gemini-2.5-flash", "--input", input.to_str().unwrap()];
    let base: Vec<&str> = base.into_iter().chain(["--output", out.to_str().unwrap()]).collect();
    // No project.
    let o = weir().args(&base).env("HOME", dir.path("home")).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("GOOGLE_CLOUD_PROJECT"), "{}", stderr(&o));
    // A credentials file that is not there.
    let o = weir()
        .args(&base)
        .args(["--project", "p"])
        .env("GOOGLE_APPLICATION_CREDENTIALS", dir.path("missing.json"))
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("GOOGLE_APPLICATION_CREDENTIALS"), "{}", stderr(&o));
    // A project name that would change the URL.
    let o = weir().args(&base).args(["--project", "p/../x"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(!out.exists() || std::fs::metadata(&out).unwrap().len() == 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_renewed_as_they_expire_during_a_long_run() {
    let server = sim(|c| {
        c.auth.token_lifetime_secs = 1;
        c.latency.fixed_ms = 25.0;
    })
    .await;
    let dir = Dir::new("vertex-renew");
    let started = std::time::Instant::now();
    let one_at_a_time = ["--project", "p", "--concurrency", "fixed", "--max-concurrency", "1"];
    let (o, out, ids) = vertex_run(&server, &dir, 100, &one_at_a_time).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&out), &[]);
    let secs = started.elapsed().as_secs_f64();
    let issued = server.stats().tokens_issued;
    // A 1 s token is renewed after 0.75 s: about one fetch per 0.75 s of the run, not per call.
    assert!(secs > 2.5, "the run must outlive several tokens ({secs:.1} s)");
    assert!(issued >= 3 && (issued as f64) <= secs / 0.75 + 2.0, "{issued} tokens in {secs:.1} s");
    assert_eq!(server.stats().auth_failures, 0, "no call was made with an expired token");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_stops_the_run_with_exit_3() {
    let server = sim(|c| c.auth.issued_token = Some("ya29.revoked".into())).await;
    let dir = Dir::new("vertex-revoked");
    let (o, _, _) = vertex_run(&server, &dir, 500, &["--project", "p"]).await;
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.to_lowercase().contains("credential") || err.contains("401"), "{err}");
    assert!(!err.contains("ya29.revoked"), "the token is not shown: {err}");
    let stats = server.stats();
    assert!(stats.requests <= 40, "stopped early: {} calls", stats.requests);
    // Every 401 was followed by one fresh token before giving up on that call.
    assert!(stats.tokens_issued >= 2, "{}", stats.tokens_issued);
    server.shutdown().await;
}
