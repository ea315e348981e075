//! `weir run --mode batch` with `vertex_ai/` models against the simulator's Vertex AI
//! `batchPredictionJobs`, which read each job's input from and write its output to the
//! simulator's Cloud Storage (`--job-bucket gs://…`, `STORAGE_EMULATOR_HOST`), with Google
//! credentials from a service account whose token endpoint is the simulator's: every id exactly
//! once, split to the job limit, partially succeeded and expired jobs accounted for, a killed run
//! re-attaching without a second submission, `weir batch status`, and the refusals.

#[path = "../../weir-providers/tests/support/keys.rs"]
mod keys;
mod util;

use std::time::Duration;
use util::*;
use weir_sim::{GcsServer, SimConfig, SimServer};

const TOKEN: &str = "ya29.vertex-batch-token";
const MODEL: &str = "vertex_ai/gemini-2.5-flash";

/// A simulator that accepts only `TOKEN` (which its token endpoint hands out), and its GCS.
async fn start(run_secs: f64, f: impl FnOnce(&mut SimConfig)) -> (SimServer, GcsServer) {
    let mut cfg = SimConfig { api_keys: vec![TOKEN.into()], ..SimConfig::default() };
    cfg.batch.run_secs = run_secs;
    f(&mut cfg);
    let sim = SimServer::start(cfg, ([127, 0, 0, 1], 0).into()).await.unwrap();
    let gcs = sim.serve_gcs(([127, 0, 0, 1], 0).into()).await.unwrap();
    (sim, gcs)
}

/// `weir` with a service account for the simulator and its GCS as the storage emulator.
fn weir_for(sim: &SimServer, gcs: &GcsServer, dir: &Dir) -> tokio::process::Command {
    let sa = keys::throwaway_rsa_key();
    let file = serde_json::json!({
        "type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": sa,
        "client_email": "weir@p.iam.gserviceaccount.com", "token_uri": format!("{}/token", sim.url()),
    });
    let sa = dir.write("sa.json", file.to_string().as_bytes());
    let mut c = weir();
    c.env("GOOGLE_APPLICATION_CREDENTIALS", sa).env("STORAGE_EMULATOR_HOST", gcs.url()).env("HOME", dir.path("home"));
    c
}

/// The arguments of a Vertex batch run, writing `out.jsonl` in `dir`.
fn args(sim: &SimServer, dir: &Dir, input: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let out = dir.path("out.jsonl");
    let mut a: Vec<String> = [
        "run",
        "--model",
        MODEL,
        "--base-url",
        &sim.url(),
        "--project",
        "my-project",
        "--location",
        "us-central1",
        "--job-bucket",
        "gs://weir-stage/jobs",
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "key",
        "--mode",
        "batch",
        "--poll-secs",
        "0.1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[tokio::test(flavor = "multi_thread")]
async fn vertex_batch_of_10000_is_split_staged_in_gcs_and_every_id_comes_once() {
    let (sim, gcs) = start(0.5, |_| {}).await;
    let dir = Dir::new("vertex-batch-10k");
    let (data, ids) = prompts(10_000);
    let input = dir.write("in.jsonl", &data);
    let o = weir_for(&sim, &gcs, &dir).args(args(&sim, &dir, &input, &["--job-max-requests", "4000"])).output().await;
    let o = o.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let results = rows(&dir.path("out.jsonl"));
    assert_each_id_once(&ids, &results, &rows(&dir.path("out.errors.jsonl")));
    assert!(results.iter().all(|r| r["model"] == MODEL && r["response"].as_str().is_some_and(|t| !t.is_empty())));
    let stats = sim.stats();
    assert_eq!(stats.batch_jobs, 3, "9,999 requests at 4,000 per job: {err}");
    assert_eq!(stats.batch_answered, 9_999);
    assert_eq!(stats.requests, 1, "one online call, the first record, checks the request: {err}");
    assert_eq!(stats.auth_failures, 0);
    assert!(err.contains("batch jobs: 3 (3 submitted by this run); 9,999 records settled by them, 1 online"), "{err}");
    // The token is written nowhere.
    for entry in walk(&dir.path("")) {
        let text = String::from_utf8_lossy(&std::fs::read(&entry).unwrap_or_default()).into_owned();
        assert!(!text.contains(TOKEN), "{} holds the access token", entry.display());
    }
    // The staged inputs are deleted once answered; the outputs stay. Run again: nothing is
    // submitted.
    let again = weir_for(&sim, &gcs, &dir).args(args(&sim, &dir, &input, &[])).output().await.unwrap();
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    assert_eq!(sim.stats().batch_jobs, 3);
    gcs.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn partially_succeeded_and_expired_vertex_jobs_account_for_every_record() {
    // A fifth of the requests fail alone: the job ends partially succeeded, and what failed goes
    // online with --fallback online after the one round.
    let (sim, gcs) = start(0.3, |c| c.batch.item_error_rate = 0.2).await;
    let dir = Dir::new("vertex-batch-partial");
    let (data, ids) = prompts(500);
    let input = dir.write("in.jsonl", &data);
    let extra = ["--job-rounds", "1", "--fallback", "online"];
    let o = weir_for(&sim, &gcs, &dir).args(args(&sim, &dir, &input, &extra)).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let results = rows(&dir.path("out.jsonl"));
    assert_each_id_once(&ids, &results, &rows(&dir.path("out.errors.jsonl")));
    assert_eq!(results.len(), 500, "{err}");
    let online = sim.stats().successes;
    assert!((60..=150).contains(&online), "about a fifth of 499 failed in the job and went online: {online}: {err}");
    assert_eq!(sim.stats().batch_jobs, 1);
    gcs.shutdown().await;
    sim.shutdown().await;

    // An expired job keeps the half it answered; follow-up rounds send the rest.
    let (sim, gcs) = start(0.3, |c| c.batch.expire = true).await;
    let dir = Dir::new("vertex-batch-expired");
    let (data, ids) = prompts(200);
    let input = dir.write("in.jsonl", &data);
    let o = weir_for(&sim, &gcs, &dir).args(args(&sim, &dir, &input, &["--job-rounds", "2"])).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "unanswered records are error rows: {err}");
    let (results, errors) = (rows(&dir.path("out.jsonl")), rows(&dir.path("out.errors.jsonl")));
    assert_each_id_once(&ids, &results, &errors);
    // The first online, then two rounds each answering half of what they got: 1 + 99 + 50.
    assert_eq!(results.len(), 150, "{err}");
    assert!(
        errors.iter().all(|e| e["retryable"] == true && e["message"].as_str().is_some_and(|m| m.contains("expired"))),
        "{}",
        errors[0]
    );
    assert_eq!(sim.stats().batch_jobs, 2);
    gcs.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_vertex_run_re_attaches_to_its_jobs_and_submits_nothing_twice() {
    let (sim, gcs) = start(10.0, |_| {}).await;
    let dir = Dir::new("vertex-batch-killed");
    let (data, ids) = prompts(3_000);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let a = args(&sim, &dir, &input, &["--job-max-requests", "1000"]);
    let mut child = weir_for(&sim, &gcs, &dir).args(&a).stderr(std::process::Stdio::null()).spawn().unwrap();
    for _ in 0..1000 {
        if sim.stats().batch_jobs == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sim.stats().batch_jobs, 3);
    child.start_kill().unwrap();
    let _ = child.wait().await;
    assert_eq!(rows(&out).len(), 1, "only the first record, sent online; no job had ended");

    // Where the jobs stand, from the run's ledger.
    let site = [
        "--model",
        MODEL,
        "--base-url",
        &sim.url(),
        "--project",
        "my-project",
        "--location",
        "us-central1",
        "--job-bucket",
        "gs://weir-stage/jobs",
        "--output",
        out.to_str().unwrap(),
    ];
    let status = weir_for(&sim, &gcs, &dir).args(["batch", "status"]).args(site).output().await.unwrap();
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    assert_eq!(status.status.code(), Some(0), "{}", stderr(&status));
    // The kill may fall between the third submission and its record in the ledger: status
    // finds that job by its name, as the resumed run does.
    let listed = text.lines().filter(|l| l.contains(": pending") || l.contains(": running")).count();
    assert_eq!(listed, 3, "{text}");

    let o = weir_for(&sim, &gcs, &dir).args(&a).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    assert_eq!(sim.stats().batch_jobs, 3, "re-attached, not submitted again: {err}");
    assert!(err.contains("batch jobs: 3 (0 submitted by this run)"), "{err}");
    gcs.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn vertex_batch_refusals_are_usage_errors() {
    let dir = Dir::new("vertex-batch-refusals");
    let (data, _) = prompts(3);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
    let base = ["run", "--input", i, "--output", o, "--base-url", "http://127.0.0.1:9", "--project", "p"];
    for (args, says) in [
        (vec!["--model", MODEL, "--mode", "batch"], "give --job-bucket gs://BUCKET/PREFIX"),
        (vec!["--model", MODEL, "--mode", "batch", "--job-bucket", "s3://b/x"], "give gs://BUCKET/PREFIX"),
        (vec!["--model", "gemini/x", "--mode", "batch", "--job-bucket", "gs://b/x"], "drop it"),
        (vec!["--model", MODEL, "--job-bucket", "gs://b/x"], "add --mode batch"),
    ] {
        let r = weir().args(base).args(&args).env("GOOGLE_API_KEY", "k").output().await.unwrap();
        assert_eq!(r.status.code(), Some(2), "{args:?}: {}", stderr(&r));
        assert!(stderr(&r).contains(says), "{args:?}: {}", stderr(&r));
    }
}

/// The jobs the simulator holds in `location`, with the Cloud Storage URI of each one's input.
async fn jobs_in(sim: &SimServer, location: &str) -> Vec<String> {
    let url = format!("{}/v1/projects/my-project/locations/{location}/batchPredictionJobs", sim.url());
    let v: serde_json::Value =
        reqwest::Client::new().get(url).bearer_auth(TOKEN).send().await.unwrap().json().await.unwrap();
    v["batchPredictionJobs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|j| j["inputConfig"]["gcsSource"]["uris"][0].as_str().unwrap_or("").to_string())
        .collect()
}

/// Issue #33: `--location a,b` with a bucket for each spreads a batch run's jobs over both
/// locations, each staged in its own bucket; killed and resumed, the run asks each location
/// about its jobs and submits nothing twice; resumed without one of the locations, it is
/// refused before any call, naming the location its jobs are in.
#[tokio::test(flavor = "multi_thread")]
async fn a_vertex_batch_over_two_locations_stages_each_jobs_in_its_bucket_and_resumes_from_both() {
    let (sim, gcs) = start(10.0, |_| {}).await;
    let dir = Dir::new("vertex-batch-pool");
    let (data, ids) = prompts(601);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let swap = |a: Vec<String>, location: &str, bucket: &str| -> Vec<String> {
        let mut a = a;
        let at = a.iter().position(|x| x == "--location").unwrap();
        a[at + 1] = location.into();
        let at = a.iter().position(|x| x == "--job-bucket").unwrap();
        a[at + 1] = bucket.into();
        a
    };
    let pooled = swap(
        args(&sim, &dir, &input, &["--job-max-requests", "100"]),
        "us-central1,europe-west4",
        "gs://weir-us/jobs,gs://weir-eu/jobs",
    );
    let mut child = weir_for(&sim, &gcs, &dir).args(&pooled).stderr(std::process::Stdio::null()).spawn().unwrap();
    for _ in 0..1000 {
        if sim.stats().batch_jobs == 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sim.stats().batch_jobs, 6);
    // Let the last id reach the ledger, then kill.
    tokio::time::sleep(Duration::from_millis(200)).await;
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let (us, eu) = (jobs_in(&sim, "us-central1").await, jobs_in(&sim, "europe-west4").await);
    assert_eq!((us.len(), eu.len()), (3, 3), "{us:?} {eu:?}");
    assert!(us.iter().all(|u| u.starts_with("gs://weir-us/jobs/")), "{us:?}");
    assert!(eu.iter().all(|u| u.starts_with("gs://weir-eu/jobs/")), "{eu:?}");

    // Resumed with one location only: refused before any call, naming the other.
    let one = swap(pooled.clone(), "us-central1", "gs://weir-us/jobs");
    let o = weir_for(&sim, &gcs, &dir).args(&one).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("location=europe-west4"), "{}", stderr(&o));

    // `weir batch status` with the run's pool asks each job's location.
    let status = weir_for(&sim, &gcs, &dir)
        .args(["batch", "status", "--model", MODEL, "--base-url", &sim.url(), "--project", "my-project"])
        .args(["--location", "us-central1,europe-west4", "--job-bucket", "gs://weir-us/jobs,gs://weir-eu/jobs"])
        .args(["--output", out.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    assert_eq!(status.status.code(), Some(0), "{text}{}", stderr(&status));
    assert_eq!(text.lines().filter(|l| l.contains(": pending") || l.contains(": running")).count(), 6, "{text}");

    let o = weir_for(&sim, &gcs, &dir).args(&pooled).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    assert_eq!(rows(&out).len(), 601, "{err}");
    assert_eq!(sim.stats().batch_jobs, 6, "re-attached, not submitted again: {err}");
    assert!(err.contains("batch jobs: 6 (0 submitted by this run)"), "{err}");
    gcs.shutdown().await;
    sim.shutdown().await;
}

/// Issue #34: Vertex AI batch embeddings. A text-embedding model's job takes `{"content"}`
/// instances and echoes each instance, not a key, with its vector: every id comes once with
/// the vector an online call gives its text, records with the same text included (matched by
/// the text), split at the job limit, and a second run submits nothing.
#[tokio::test(flavor = "multi_thread")]
async fn vertex_batch_embeddings_match_records_by_text_and_equal_the_online_vectors() {
    let (sim, gcs) = start(0.3, |_| {}).await;
    let dir = Dir::new("vertex-batch-embed");
    let mut data = String::new();
    let ids: Vec<String> = (0..600).map(|i| format!("r{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        // 150 texts, each in four records.
        data.push_str(&format!("{{\"key\":\"{id}\",\"prompt\":\"text number {}\"}}\n", i % 150));
    }
    let input = dir.write("in.jsonl", data.as_bytes());
    let model = "vertex_ai/text-embedding-005";
    let with_model =
        |a: Vec<String>| -> Vec<String> { a.into_iter().map(|x| if x == MODEL { model.into() } else { x }).collect() };
    let batch = with_model(args(&sim, &dir, &input, &["--task", "embed", "--job-max-requests", "250"]));
    let o = weir_for(&sim, &gcs, &dir).args(&batch).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let results = rows(&dir.path("out.jsonl"));
    assert_each_id_once(&ids, &results, &rows(&dir.path("out.errors.jsonl")));
    let stats = sim.stats();
    assert_eq!(stats.batch_jobs, 3, "599 instances at 250 per job: {err}");
    // The same records online (`:predict`), into another file.
    let online_out = dir.path("online.jsonl");
    let mut online = with_model(args(&sim, &dir, &input, &["--task", "embed"]));
    for flag in ["--mode", "--job-bucket"] {
        let at = online.iter().position(|a| a == flag).unwrap();
        online.drain(at..at + 2);
    }
    let at = online.iter().position(|a| a == "--output").unwrap();
    online[at + 1] = online_out.to_str().unwrap().to_string();
    let o = weir_for(&sim, &gcs, &dir).args(&online).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let by_id: std::collections::HashMap<String, serde_json::Value> = rows(&online_out)
        .into_iter()
        .map(|r| (r["id"].as_str().unwrap().to_string(), r["embedding"].clone()))
        .collect();
    assert_eq!(by_id.len(), 600);
    for r in &results {
        let id = r["id"].as_str().unwrap();
        let v = &r["embedding"];
        assert!(v.as_array().is_some_and(|a| !a.is_empty()), "{r}");
        assert_eq!(v, &by_id[id], "record {id}: the job's vector is the online one");
    }
    // Resumed: every row is written, nothing is submitted.
    let again = weir_for(&sim, &gcs, &dir).args(&batch).output().await.unwrap();
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    assert_eq!(sim.stats().batch_jobs, 3);
    gcs.shutdown().await;
    sim.shutdown().await;
}

/// Issue #35: images in `gs://` go into a Vertex AI job by reference (`fileData`): Vertex AI
/// reads them itself, so an image over the 15 MB of inline parts is no problem, and weir reads
/// only their first bytes.
#[tokio::test(flavor = "multi_thread")]
async fn vertex_batch_takes_gs_images_by_reference() {
    let (sim, gcs) = start(0.2, |_| {}).await;
    let dir = Dir::new("vertex-batch-media");
    let http = reqwest::Client::new();
    let mut lines = String::new();
    for i in 0..10usize {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
        png.extend_from_slice(&vec![i as u8; if i == 5 { 20_000_000 } else { 1000 + i }]);
        let r = http.put(format!("{}/photos/p/{i}.png", gcs.url())).body(png).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        lines.push_str(&format!("{{\"key\":\"k{i}\",\"prompt\":\"describe\",\"image\":\"gs://photos/p/{i}.png\"}}\n"));
    }
    let input = dir.write("in.jsonl", lines.as_bytes());
    let o =
        weir_for(&sim, &gcs, &dir).args(args(&sim, &dir, &input, &["--media-field", "image"])).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}\n{:?}", rows(&dir.path("out.errors.jsonl")));
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 10, "{err}");
    let s = sim.stats();
    assert_eq!((s.requests, s.media_parts, s.media_uris), (1, 1, 1), "the first record online: {err}");
    assert_eq!((s.batch_jobs, s.batch_answered, s.batch_media_parts), (1, 9, 9), "{err}");
    gcs.shutdown().await;
    sim.shutdown().await;
}
