//! `vertex_ai/` models: Gemini on Vertex AI with Google credentials, against `weir sim` serving
//! both the Vertex model route and the token endpoint.

#[path = "../../weir-providers/tests/support/keys.rs"]
mod keys;
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
    let key = keys::throwaway_rsa_key();
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
    model_run("vertex_ai/gemini-2.5-flash", server, dir, &prompts(records), extra).await
}

/// A run of the prompts `data` against `server` as `model`, with a service account whose
/// `token_uri` is the simulator's: the output, the result path and the ids.
async fn model_run(
    model: &str,
    server: &SimServer,
    dir: &Dir,
    (data, ids): &(Vec<u8>, Vec<String>),
    extra: &[&str],
) -> (std::process::Output, std::path::PathBuf, Vec<String>) {
    let sa = service_account(dir, &format!("{}/token", server.url()));
    let input = dir.write("in.jsonl", data);
    let out = dir.path("out.jsonl");
    let o = weir()
        .args(["run", "--model", model, "--base-url", &server.url(), "--id-field", "key"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .args(extra)
        .env("GOOGLE_APPLICATION_CREDENTIALS", &sa)
        .env("HOME", dir.path("home"))
        .output()
        .await
        .unwrap();
    (o, out, ids.clone())
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

/// A call refused for one record's sake (a blocked prompt; more instances than the endpoint
/// takes) is split until only that record fails: the others in its batch are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_for_one_records_sake_fails_only_that_record() {
    let server = sim(|c| c.predict.max_instances = 4).await;
    let dir = Dir::new("vertex-endpoint-poison");
    let (mut data, ids) = prompts(64);
    let text = String::from_utf8(data.clone()).unwrap().replacen("item 5\"", "item 5 [sim:block_prompt]\"", 1);
    data = text.into_bytes();
    let args = ["--project", "p", "--batch-size", "16", "--buckets", "off"];
    let (o, out, _) = model_run("vertex_endpoint/1234", &server, &dir, &(data, ids.clone()), &args).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_each_id_once(&ids, &rows(&out), &errors);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0]["id"], "r5");
    server.shutdown().await;
}

/// A Vertex AI endpoint's `:predict` carries many records per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vertex_endpoint_takes_many_records_per_predict_call() {
    let server = sim(|c| c.latency.fixed_ms = 5.0).await;
    let dir = Dir::new("vertex-endpoint");
    // A long linger, so that every batch is full and the count of calls is exact.
    let args = ["--project", "p", "--batch-size", "8", "--batch-linger-ms", "5000", "--buckets", "off"];
    let (o, out, ids) = model_run("vertex_endpoint/1234", &server, &dir, &prompts(1000), &args).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = rows(&out);
    assert_each_id_once(&ids, &results, &[]);
    assert_eq!(results[0]["model"], "vertex_endpoint/1234");
    assert!(results.iter().all(|r| r["response"].as_str().is_some_and(|t| !t.is_empty())));
    let stats = server.stats();
    assert_eq!(stats.predict_instances, 1000);
    assert!(stats.predict_batches <= 1000 / 8, "{} calls for 1,000 records", stats.predict_batches);
    assert_eq!(stats.requests, stats.predict_batches, "every call was a :predict");
    server.shutdown().await;
}

/// An answer with fewer predictions than instances: the ones left out are errors (and retried
/// alone), never dropped and never matched to the wrong record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_predict_answer_fails_only_the_instances_left_out() {
    let server = sim(|c| c.predict.short_rate = 0.3).await;
    let dir = Dir::new("vertex-endpoint-short");
    let data = prompts(400);
    // No retries: each instance left out must become exactly one error row.
    let args = ["--project", "p", "--batch-size", "8", "--max-retries", "0"];
    let (o, out, ids) = model_run("vertex_endpoint/77", &server, &dir, &data, &args).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let results = rows(&out);
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_each_id_once(&ids, &results, &errors);
    let short = server.stats().predict_short;
    assert!(short > 0, "the simulator answered short");
    assert_eq!(errors.len() as u64, short, "one instance left out per short answer");
    assert!(errors.iter().all(|e| e["kind"] == "malformed_response"), "{:?}", errors[0]);
    assert!(errors[0]["message"].as_str().unwrap().contains("had no answer"), "{:?}", errors[0]);
    // The records answered are answered with their own text: the same prompts through a server
    // that never answers short give the same responses.
    let full = sim(|_| {}).await;
    let dir2 = Dir::new("vertex-endpoint-full");
    let (o2, out2, _) = model_run("vertex_endpoint/77", &full, &dir2, &data, &["--project", "p"]).await;
    assert_eq!(o2.status.code(), Some(0), "{}", stderr(&o2));
    let by_id: std::collections::HashMap<String, String> = rows(&out2)
        .into_iter()
        .map(|r| (r["id"].as_str().unwrap().to_string(), r["response"].as_str().unwrap().to_string()))
        .collect();
    for r in &results {
        assert_eq!(by_id[r["id"].as_str().unwrap()], r["response"].as_str().unwrap(), "{r}");
    }
    // With retries, the instances left out are sent again and every record succeeds.
    let dir3 = Dir::new("vertex-endpoint-short-retried");
    let (o3, out3, _) = model_run("vertex_endpoint/77", &server, &dir3, &data, &["--project", "p"]).await;
    assert_eq!(o3.status.code(), Some(0), "{}", stderr(&o3));
    assert_each_id_once(&ids, &rows(&out3), &[]);
    server.shutdown().await;
    full.shutdown().await;
}

/// Requests are split to stay under Vertex AI's 1.5 MB body limit, which the simulator enforces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predict_calls_stay_under_the_request_size_limit() {
    let server = sim(|_| {}).await;
    let dir = Dir::new("vertex-endpoint-size");
    let big = "x".repeat(300_000);
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for i in 0..24 {
        data.extend(
            serde_json::to_vec(&serde_json::json!({"key": format!("k{i}"), "prompt": format!("{i} {big}")})).unwrap(),
        );
        data.push(b'\n');
        ids.push(format!("k{i}"));
    }
    let args = ["--project", "p", "--batch-size", "16", "--batch-linger-ms", "5000", "--buckets", "off"];
    let (o, out, _) = model_run("vertex_endpoint/9", &server, &dir, &(data, ids.clone()), &args).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&out), &[]);
    let stats = server.stats();
    assert_eq!(stats.predict_refused, 0, "no call was over the limit");
    // 300 KB instances: four fit under 1.5 MB, so 24 records need at least six calls.
    assert!(stats.predict_batches >= 6 && stats.predict_batches <= 8, "{} calls", stats.predict_batches);
    server.shutdown().await;
}

/// The one-record-per-call ways to reach an endpoint: a chatCompletions instance, the
/// OpenAI-compatible route and :rawPredict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vertex_endpoint_through_chat_instances_the_openai_route_and_raw_predict() {
    for format in ["chat", "openai", "rawpredict"] {
        let server = sim(|_| {}).await;
        let dir = Dir::new(&format!("vertex-endpoint-{format}"));
        let args = ["--project", "p", "--endpoint-format", format, "--system", "be brief"];
        let (o, out, ids) = model_run("vertex_endpoint/5", &server, &dir, &prompts(30), &args).await;
        assert_eq!(o.status.code(), Some(0), "{format}: {}", stderr(&o));
        let results = rows(&out);
        assert_each_id_once(&ids, &results, &[]);
        assert!(results.iter().all(|r| r["usage"]["total_tokens"].as_u64().unwrap_or(0) > 0), "{format}: usage");
        let stats = server.stats();
        assert_eq!(stats.requests, 30, "{format}: one call per record");
        assert_eq!(stats.predict_batches, if format == "chat" { 30 } else { 0 }, "{format}");
        server.shutdown().await;
    }
}

/// Raw prompts and chat instances go to one `:predict` URL and answer differently (a vLLM
/// server puts only the latter through the chat template): a tester's switch to chat instances
/// got the raw answers back from the response cache, with no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_instances_are_not_answered_from_the_cache_of_raw_prompts() {
    let server = sim(|_| {}).await;
    let dir = Dir::new("vertex-endpoint-forms");
    let data = prompts(20);
    let (o, _, _) = model_run("vertex_endpoint/5", &server, &dir, &data, &["--project", "p"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let before = server.stats().requests;
    let args = ["--project", "p", "--endpoint-format", "chat", "--fresh"];
    let (o, out, ids) = model_run("vertex_endpoint/5", &server, &dir, &data, &args).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&out), &[]);
    assert_eq!(server.stats().requests - before, 20, "each chat instance called: {}", stderr(&o));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batching_flags_that_cannot_apply_exit_2() {
    let dir = Dir::new("vertex-endpoint-flags");
    let input = dir.write("in.jsonl", b"{\"prompt\":\"hi\"}\n");
    let out = dir.path("out.jsonl");
    let io = ["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()];
    for (args, says) in [
        (vec!["--model", "sim/demo", "--batch-size", "8"], "takes one record per call"),
        (vec!["--model", "sim/demo", "--endpoint-format", "chat"], "only applies to vertex_endpoint/"),
        (vec!["--model", "vertex_endpoint/1", "--endpoint-format", "grpc"], "expected raw, chat, openai or rawpredict"),
        (vec!["--model", "vertex_endpoint/projects/p/endpoints/1"], "by its id alone"),
        (vec!["--model", "vertex_endpoint/1", "--batch-size", "0"], "at least 1"),
        (
            vec!["--model", "vertex_endpoint/1", "--endpoint-format", "chat", "--batch-linger-ms", "5"],
            "one record per call",
        ),
        (vec!["--model", "vertex_ai/g", "--batch-tokens", "500"], "one record per call"),
        (
            vec!["--model", "vertex_endpoint/1", "--param", "response_mime_type=application/json"],
            "cannot be sent in a :predict",
        ),
        (vec!["--model", "vertex_endpoint/..", "--project", "p"], "may not hold"),
        (vec!["--model", "vertex_ai/gemini", "--project", ".."], "project '..'"),
    ] {
        let o = weir().arg("run").args(&args).args(io).output().await.unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
        assert!(!out.exists(), "{args:?} wrote the output");
    }
}

/// Google's own client (google-genai in Vertex AI mode) and weir send the same request for the
/// same prompt, system text and parameters: the same path (apart from the API version: the SDK
/// calls v1beta1, weir the GA v1) and the same body, for a call and for a streamed call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn google_genai_in_vertex_mode_and_weir_send_the_same_requests() {
    let Some(python) = peer("WEIR_PYTHON") else { return };
    let server = sim(|c| c.capture_requests = 10).await;
    let script = r#"
import sys
from google import genai
from google.genai import types
from google.oauth2.credentials import Credentials
c = genai.Client(vertexai=True, project="p", location="us-central1", credentials=Credentials(token=sys.argv[2]),
                 http_options=types.HttpOptions(base_url=sys.argv[1]))
config = types.GenerateContentConfig(
    system_instruction="be brief", temperature=0.5, max_output_tokens=30, top_p=0.9, top_k=20, seed=7,
    stop_sequences=["END"], presence_penalty=0.1, frequency_penalty=0.2,
    response_mime_type="application/json", response_json_schema={"type": "object"})
assert c.models.generate_content(model="gemini-2.5-flash", contents="hello there", config=config).text
assert "".join(ch.text or "" for ch in c.models.generate_content_stream(model="gemini-2.5-flash", contents="hello there", config=config))
"#;
    let o = tokio::process::Command::new(python)
        .args(["-c", script, &server.url(), TOKEN])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let sdk = server.captured();
    assert_eq!(sdk.len(), 2, "{sdk:?}");

    // weir's requests for the same settings, a call and a streamed call, through the same
    // provider code `weir run` uses.
    let dir = Dir::new("vertex-wire");
    let sa = service_account(&dir, &format!("{}/token", server.url()));
    let env = move |k: &str| match k {
        "GOOGLE_APPLICATION_CREDENTIALS" => Some(sa.display().to_string()),
        "GOOGLE_CLOUD_PROJECT" => Some("p".into()),
        _ => None,
    };
    let options = weir_providers::ProviderOptions { base_url: Some(server.url()), ..Default::default() };
    let spec: weir_providers::ModelSpec = "vertex_ai/gemini-2.5-flash".parse().unwrap();
    let endpoint = weir_providers::connect(&spec, &options, &env).await.unwrap();
    let params = weir_core::GenParams::from_specs([
        "temperature=0.5",
        "max_tokens=30",
        "top_p=0.9",
        "top_k=20",
        "seed=7",
        "stop=END",
        "presence_penalty=0.1",
        "frequency_penalty=0.2",
        r#"response_schema={"type":"object"}"#,
    ])
    .unwrap();
    let request = weir_core::ModelRequest {
        prompt: "hello there".into(),
        system: Some("be brief".into()),
        params: std::sync::Arc::new(params),
        media: Default::default(),
        fields: None,
    };
    endpoint.handler.generate(&request).await.unwrap();
    use futures::StreamExt;
    let mut deltas = endpoint.handler.generate_stream(&request).await.unwrap();
    while let Some(d) = deltas.next().await {
        d.unwrap();
    }
    let ours = &server.captured()[2..];
    assert_eq!(ours.len(), 2);
    for (theirs, ours) in sdk.iter().zip(ours) {
        assert_eq!(theirs.path.replacen("/v1beta1/", "/v1/", 1), ours.path);
        assert_eq!(theirs.query, ours.query, "{}", ours.path);
        assert!(
            same_json(&theirs.body, &ours.body),
            "{}:\n  google-genai: {}\n  weir:         {}",
            ours.path,
            theirs.body,
            ours.body
        );
    }
    assert!(ours[1].path.ends_with(":streamGenerateContent") && ours[1].query == "alt=sse", "{:?}", ours[1]);
    server.shutdown().await;
}

/// Equal JSON, numbers compared by value (the SDK sends `topK` as 20.0, weir as 20).
fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_json(a, b)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// Vertex AI's text-embedding models: `:predict` on the publisher model with `content`
/// instances, many per call, the token counts read from each prediction's statistics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_on_vertex_ai() {
    let server = sim(|c| c.embedding.dimensions = 16).await;
    let dir = Dir::new("vertex-embed");
    let args = ["--project", "p", "--task", "embed", "--batch-linger-ms", "5000", "--buckets", "off"];
    let (o, out, ids) = model_run("vertex_ai/text-embedding-005", &server, &dir, &prompts(300), &args).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = rows(&out);
    assert_each_id_once(&ids, &results, &[]);
    assert!(results.iter().all(|r| r["dimensions"] == 16 && r["usage"]["prompt_tokens"].as_u64() > Some(0)));
    let stats = server.stats();
    assert_eq!((stats.embed_inputs, stats.embed_batches), (300, 5), "calls of 64");
    server.shutdown().await;
}

/// A token endpoint that echoes what it was sent (the signed JWT grant) in its refusal: the
/// grant appears in no message or row, and the run stops (exit 3) instead of burning its input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_endpoint_that_echoes_the_grant_leaks_nothing_and_stops_the_run() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                // The whole request: headers, then content-length bytes of body.
                let mut buf = vec![0u8; 65536];
                let mut got = Vec::new();
                let whole = |got: &[u8]| {
                    let text = String::from_utf8_lossy(got);
                    let Some(end) = text.find("\r\n\r\n") else { return false };
                    let len = text[..end]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string())
                        })
                        .and_then(|v| v.parse::<usize>().ok())
                        .unwrap_or(0);
                    got.len() >= end + 4 + len
                };
                while !whole(&got) {
                    match tokio::time::timeout(std::time::Duration::from_secs(10), sock.read(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
                        _ => break,
                    }
                }
                let request = String::from_utf8_lossy(&got).replace('"', "'");
                let body = format!(
                    "{{\"error\":\"invalid_grant\",\"error_description\":\"bad request: {}\"}}",
                    request.replace("\r\n", " ")
                );
                let reply = format!(
                    "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(reply.as_bytes()).await;
            });
        }
    });
    let server = sim(|_| {}).await;
    let dir = Dir::new("vertex-echo");
    let sa = service_account(&dir, &format!("http://{addr}/token"));
    let (data, _) = prompts(2000);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let o = weir()
        .args(["run", "--model", "vertex_endpoint/1", "--base-url", &server.url(), "--project", "p"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .env("GOOGLE_APPLICATION_CREDENTIALS", &sa)
        .env("HOME", dir.path("home"))
        .env("RUST_LOG", "debug")
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("refused (HTTP 400): bad request"), "the endpoint's words are kept: {err}");
    assert!(!err.contains("eyJ"), "the grant leaked: {err}");
    for f in walk(&dir.path("")) {
        if f != sa {
            let text = String::from_utf8_lossy(&std::fs::read(&f).unwrap_or_default()).into_owned();
            assert!(!text.contains("eyJ"), "{f:?} holds the grant");
        }
    }
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert!(errors.len() < 500, "stopped early: {} error rows of 2,000", errors.len());
    echo.abort();
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_private_key_is_a_usage_error_naming_the_file() {
    let dir = Dir::new("vertex-badkey");
    let file = serde_json::json!({
        "type": "service_account", "project_id": "p", "private_key_id": "k1",
        "private_key": "-----BEGIN PRIVATE KEY-----\nMIIBVQIBADANBgkqhkiG9w0BAQEFAASCAT8wggE7AgEAAkEA\n-----END PRIVATE KEY-----\n",
        "client_email": "weir@p.iam.gserviceaccount.com", "token_uri": "http://127.0.0.1:9/token",
    });
    let sa = dir.write("broken-sa.json", file.to_string().as_bytes());
    let input = dir.write("in.jsonl", b"{\"prompt\":\"hi\"}\n");
    let out = dir.path("out.jsonl");
    let o = weir()
        .args(["run", "--model", "vertex_ai/gemini-2.5-flash", "--project", "p"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .env("GOOGLE_APPLICATION_CREDENTIALS", &sa)
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("broken-sa.json") && stderr(&o).contains("private_key"), "{}", stderr(&o));
    assert!(!out.exists());
}

/// `--stream` on Vertex AI: Gemini through `:streamGenerateContent?alt=sse`, an endpoint's
/// OpenAI-compatible route with `"stream": true`, and `:streamRawPredict`; an endpoint called
/// through `:predict` (raw instances, many records per call, or one chat instance: no
/// streaming) gives each answer as one event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_calls_on_vertex_models_and_endpoints() {
    for (model, format, streamed) in [
        ("vertex_ai/gemini-2.5-flash", None, true),
        ("vertex_endpoint/5", Some("openai"), true),
        ("vertex_endpoint/5", Some("rawpredict"), true),
        ("vertex_endpoint/5", Some("raw"), false),
        ("vertex_endpoint/5", Some("chat"), false),
    ] {
        let server = sim(|c| {
            c.output.min_tokens = 6;
            c.output.max_tokens = 12;
            c.capture_requests = 100;
        })
        .await;
        let dir = Dir::new("vertex-stream");
        let events = dir.path("events.jsonl");
        let mut args = vec!["--project", "p", "--events", events.to_str().unwrap()];
        if let Some(f) = format {
            args.extend(["--endpoint-format", f]);
        }
        let (o, out, ids) = model_run(model, &server, &dir, &prompts(12), &args).await;
        let what = format!("{model} {format:?}");
        assert_eq!(o.status.code(), Some(0), "{what}: {}", stderr(&o));
        let results = rows(&out);
        assert_each_id_once(&ids, &results, &[]);
        let mut text: std::collections::HashMap<String, (String, usize)> = Default::default();
        for e in rows(&events) {
            let t = text.entry(e["id"].as_str().unwrap().to_string()).or_default();
            t.0.push_str(e["delta"].as_str().unwrap());
            t.1 += 1;
        }
        for r in &results {
            let (whole, n) = &text[r["id"].as_str().unwrap()];
            assert_eq!(whole, r["response"].as_str().unwrap(), "{what}");
            assert!(if streamed { *n >= 6 } else { *n == 1 }, "{what}: {n} events");
        }
        let stats = server.stats();
        assert_eq!(stats.streams, if streamed { 12 } else { 0 }, "{what}");
        // Only calls that streamed are counted as streams in the summary.
        assert_eq!(stderr(&o).contains("time to first token"), streamed, "{what}: {}", stderr(&o));
        if format == Some("rawpredict") {
            assert!(server.captured().iter().all(|c| c.path.ends_with(":streamRawPredict")), "{what}");
        }
        server.shutdown().await;
    }
}

/// Issue #35: on Vertex AI, media in `gs://` goes by reference (`fileData`): Vertex AI reads
/// the object itself, so weir reads only its first bytes (for the type) and its version (for the
/// cache), never the whole object. A missing object is the record's error row, with no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gs_media_goes_to_vertex_by_reference() {
    let server = sim(|_| {}).await;
    let gcs = weir_sim::GcsServer::start(([127, 0, 0, 1], 0).into()).await.unwrap();
    let dir = Dir::new("vertex-media-uri");
    let http = reqwest::Client::new();
    let mut lines = String::new();
    for i in 0..4 {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
        png.extend_from_slice(&vec![i as u8; 20_000_000 / (i + 1)]);
        let r = http.put(format!("{}/bkt/p/{i}.png", gcs.url())).body(png).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        lines.push_str(&format!("{{\"key\":\"k{i}\",\"prompt\":\"describe\",\"image\":\"gs://bkt/p/{i}.png\"}}\n"));
    }
    lines.push_str("{\"key\":\"gone\",\"prompt\":\"describe\",\"image\":\"gs://bkt/p/none.png\"}\n");
    let sa = service_account(&dir, &format!("{}/token", server.url()));
    let input = dir.write("in.jsonl", lines.as_bytes());
    let o = weir()
        .args(["run", "--model", "vertex_ai/gemini-2.5-flash", "--base-url", &server.url(), "--id-field", "key"])
        .args(["--input", input.to_str().unwrap(), "--output", dir.path("out.jsonl").to_str().unwrap()])
        .args(["--media-field", "image", "--progress", "never", "--project", "p", "--location", "us-central1"])
        .env("GOOGLE_APPLICATION_CREDENTIALS", &sa)
        .env("STORAGE_EMULATOR_HOST", gcs.url())
        .env("HOME", dir.path("home"))
        .output()
        .await
        .unwrap();
    let err = stderr(&o);
    // An object of 20 MB, past the 15 MB of inline parts: by reference they are no problem.
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 4, "{err}");
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0]["message"].as_str().unwrap().contains("no such object"), "{}", errors[0]);
    let s = server.stats();
    assert_eq!((s.media_parts, s.media_uris), (4, 4), "{err}");
    gcs.shutdown().await;
    server.shutdown().await;
}

/// Claude on Vertex AI (#37): `vertex_ai/claude-…` through the publisher `anthropic` routes
/// (`:rawPredict`, `:streamRawPredict`) with the same Google credentials as Gemini, the API
/// version in the body; answered, streamed, and refused without the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_on_vertex_through_raw_predict() {
    let server = sim(|c| c.capture_requests = 4).await;
    let dir = Dir::new("vertex-claude");
    let (o, out, ids) = model_run(
        "vertex_ai/claude-haiku-4-5",
        &server,
        &dir,
        &prompts(30),
        &["--project", "p", "--location", "us-east5"],
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = rows(&out);
    assert_each_id_once(&ids, &results, &[]);
    assert_eq!(results[0]["model"], "vertex_ai/claude-haiku-4-5");
    let seen = server.captured();
    let last = seen.last().unwrap();
    assert!(last.path.ends_with("/publishers/anthropic/models/claude-haiku-4-5:rawPredict"), "{}", last.path);
    assert_eq!(last.body["anthropic_version"], "vertex-2023-10-16");
    assert!(stderr(&o).contains("claude-haiku-4-5 at $1/$5"), "{}", stderr(&o));
    let events = dir.path("events.jsonl");
    let (o, _, _) = model_run(
        "vertex_ai/claude-haiku-4-5",
        &server,
        &dir,
        &prompts(3),
        &[
            "--project",
            "p",
            "--location",
            "us-east5",
            "--stream",
            "--events",
            events.to_str().unwrap(),
            "--fresh",
            "--no-cache",
        ],
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(server.captured().last().unwrap().path.ends_with(":streamRawPredict"));
    assert!(!std::fs::read_to_string(&events).unwrap().is_empty());
    server.shutdown().await;
}
