//! `weir run --mode batch` against the simulator's batch APIs (OpenAI `/v1/files` +
//! `/v1/batches`, Gemini `:batchGenerateContent`): every id exactly once, inputs split to the
//! job limit, follow-up jobs for requests that failed alone, expired jobs falling back online,
//! a killed run re-attaching to its jobs without submitting again (the simulator's job count),
//! and the cost line checked against the price table.

mod util;

use std::time::Duration;
use util::*;
use weir_sim::{SimConfig, SimServer};

async fn sim(run_secs: f64, f: impl FnOnce(&mut SimConfig)) -> SimServer {
    let mut cfg = SimConfig::default();
    cfg.batch.run_secs = run_secs;
    f(&mut cfg);
    SimServer::start(cfg, ([127, 0, 0, 1], 0).into()).await.unwrap()
}

/// The arguments of a batch run of `model` against `sim`, writing `out.jsonl` in `dir`.
fn batch_args(sim: &SimServer, model: &str, dir: &Dir, input: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let base = if model.starts_with("openai/") { format!("{}/v1", sim.url()) } else { sim.url() };
    let out = dir.path("out.jsonl");
    let mut args: Vec<String> = [
        "run",
        "--model",
        model,
        "--base-url",
        &base,
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
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Runs weir in batch mode; returns the process output.
async fn batch_run(
    sim: &SimServer,
    model: &str,
    dir: &Dir,
    input: &std::path::Path,
    extra: &[&str],
) -> std::process::Output {
    weir().args(batch_args(sim, model, dir, input, extra)).output().await.unwrap()
}

/// 10,000 records through jobs of at most 4,000: three jobs, every id once, no second
/// submission when the finished run is run again.
async fn ten_thousand(model: &str, name: &str) {
    let sim = sim(0.5, |_| {}).await;
    let dir = Dir::new(name);
    let (data, ids) = prompts(10_000);
    let input = dir.write("in.jsonl", &data);
    let o = batch_run(&sim, model, &dir, &input, &["--job-max-requests", "4000"]).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &rows(&dir.path("out.errors.jsonl")));
    let stats = sim.stats();
    assert_eq!(stats.batch_jobs, 3, "9,999 requests at 4,000 per job: {err}");
    assert_eq!(stats.batch_answered, 9_999);
    assert_eq!(stats.requests, 1, "one online call, the first record, checks the request: {err}");
    assert!(err.contains("batch jobs: 3 (3 submitted by this run); 9,999 records settled by them, 1 online"), "{err}");
    // Run again: everything is finished, nothing is submitted.
    let again = batch_run(&sim, model, &dir, &input, &[]).await;
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    assert_eq!(sim.stats().batch_jobs, 3);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_batch_of_10000_is_split_and_every_id_comes_once() {
    ten_thousand("openai/gpt-4o-mini", "batch-openai-10k").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn gemini_batch_of_10000_is_split_and_every_id_comes_once() {
    ten_thousand("gemini/gemini-2.5-flash", "batch-gemini-10k").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_batch_of_10000_is_split_and_every_id_comes_once() {
    ten_thousand("anthropic/claude-haiku-4-5", "batch-anthropic-10k").await;
}

/// Issue #34: a Gemini API job over 1 MB uploads its input as a JSONL file (the Files API's
/// resumable protocol, which the simulator checks) and reads its answers from the results file,
/// so a 22 MB input is one job (inline requests would have needed two, under 20 MB each); a
/// small job still sends its requests inline.
#[tokio::test(flavor = "multi_thread")]
async fn gemini_jobs_over_a_megabyte_upload_their_input_and_small_ones_go_inline() {
    let sim = sim(0.3, |_| {}).await;
    let dir = Dir::new("batch-gemini-bytes");
    let filler = "lorem ipsum dolor sit amet ".repeat(80);
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for i in 0..11_000 {
        data.extend_from_slice(format!("{{\"key\":\"g{i}\",\"prompt\":\"{i} {filler}\"}}\n").as_bytes());
        ids.push(format!("g{i}"));
    }
    assert!(data.len() > 22_000_000);
    let input = dir.write("in.jsonl", &data);
    let o = batch_run(&sim, "gemini/gemini-2.5-flash", &dir, &input, &[]).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &rows(&dir.path("out.errors.jsonl")));
    let s = sim.stats();
    assert_eq!((s.batch_jobs, s.gemini_files_uploaded, s.gemini_upload_refusals), (1, 1, 0), "{err}");
    // A small job: inline, no file.
    let small = Dir::new("batch-gemini-small");
    let (data, ids) = prompts(50);
    let input = small.write("in.jsonl", &data);
    let o = batch_run(&sim, "gemini/gemini-2.5-flash", &small, &input, &[]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&small.path("out.jsonl")), &rows(&small.path("out.errors.jsonl")));
    let s = sim.stats();
    assert_eq!((s.batch_jobs, s.gemini_files_uploaded), (2, 1), "{}", stderr(&o));
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn gemini_requests_that_fail_alone_go_into_follow_up_jobs() {
    let sim = sim(0.3, |c| c.batch.item_error_rate = 0.2).await;
    let dir = Dir::new("batch-gemini-rounds");
    let (data, ids) = prompts(500);
    let input = dir.write("in.jsonl", &data);
    let o = batch_run(&sim, "gemini/gemini-2.5-flash", &dir, &input, &["--job-rounds", "6"]).await;
    let err = stderr(&o);
    let results = rows(&dir.path("out.jsonl"));
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_each_id_once(&ids, &results, &errors);
    let jobs = sim.stats().batch_jobs;
    // 20 % fail per job: about 100, 20, 4, 1 are left after each round.
    assert!((3..=6).contains(&jobs), "{jobs} jobs: {err}");
    assert!(results.len() >= 495, "{} results after {jobs} rounds: {err}", results.len());
    assert!(
        results
            .iter()
            .all(|r| r["model"] == "gemini/gemini-2.5-flash" && r["response"].as_str().is_some_and(|t| !t.is_empty())),
        "{}",
        results[0]
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn expired_jobs_keep_their_answers_and_the_rest_go_online() {
    let sim = sim(0.3, |c| c.batch.expire = true).await;
    let dir = Dir::new("batch-expired");
    let (data, ids) = prompts(400);
    let input = dir.write("in.jsonl", &data);
    let o = batch_run(&sim, "openai/gpt-4o-mini", &dir, &input, &["--job-rounds", "1", "--fallback", "online"]).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &rows(&dir.path("out.errors.jsonl")));
    let stats = sim.stats();
    assert_eq!(stats.batch_jobs, 1);
    // The first record online, then the half of 399 the expired job did not answer.
    assert_eq!(stats.successes, 201, "{err}");
    assert!(err.contains("199 records settled by them, 201 online"), "{err}");

    // Without the fallback, the unanswered half are error rows that may succeed later (OpenAI
    // reports them as `batch_expired` results, Gemini leaves them out), and --retry-errors
    // sends them in new jobs.
    for model in ["gemini/gemini-2.5-flash", "openai/gpt-4o-mini", "anthropic/claude-haiku-4-5"] {
        let dir = Dir::new(&format!("batch-expired-nofallback-{}", &model[..6]));
        let (data, ids) = prompts(100);
        let input = dir.write("in.jsonl", &data);
        let o = batch_run(&sim, model, &dir, &input, &["--job-rounds", "2"]).await;
        assert_eq!(o.status.code(), Some(1), "{model}: {}", stderr(&o));
        let (results, errors) = (rows(&dir.path("out.jsonl")), rows(&dir.path("out.errors.jsonl")));
        assert_each_id_once(&ids, &results, &errors);
        // The first online, then two rounds, each answering half of what it got: 1 + 49 + 25.
        assert_eq!(results.len(), 75, "{model}");
        assert!(errors.iter().all(|e| e["retryable"] == true), "{}", errors[0]);
        let jobs = sim.stats().batch_jobs;
        let o = batch_run(&sim, model, &dir, &input, &["--job-rounds", "2", "--retry-errors"]).await;
        assert_eq!(o.status.code(), Some(1), "{model}: {}", stderr(&o));
        let (results, errors) = (rows(&dir.path("out.jsonl")), rows(&dir.path("out.errors.jsonl")));
        assert_each_id_once(&ids, &results, &errors);
        // Every row of the first run was written, so its spools were removed: the 25 go into
        // new jobs, two rounds, each answering half of what it got (12, then 6).
        assert_eq!(results.len(), 75 + 18, "{model}: {}", stderr(&o));
        assert_eq!(sim.stats().batch_jobs, jobs + 2, "{model}");
    }
    sim.shutdown().await;
}

/// A run killed once its three jobs are submitted re-attaches to them.
async fn killed_and_resumed(model: &str, name: &str) {
    let sim = sim(10.0, |_| {}).await;
    let dir = Dir::new(name);
    let (data, ids) = prompts(3_000);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let args = batch_args(&sim, model, &dir, &input, &["--job-max-requests", "1000"]);
    let mut child = weir().args(&args).stderr(std::process::Stdio::null()).spawn().unwrap();
    // Killed once its three jobs are submitted, long before they end.
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
    // An online run of a command whose jobs hold records is refused, not paid twice.
    let mut online = Vec::new();
    let mut rest = args.iter();
    while let Some(a) = rest.next() {
        match a.as_str() {
            "--mode" | "--job-max-requests" | "--poll-secs" => drop(rest.next()),
            _ => online.push(a.clone()),
        }
    }
    let o = weir().args(&online).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("resume with --mode batch"), "{}", stderr(&o));
    // Resumed at another base URL while its jobs are open at this one: refused, not submitted
    // again there (their records were paid for twice), and nothing recorded.
    let elsewhere = self::sim(10.0, |_| {}).await;
    let moved = batch_args(&elsewhere, model, &dir, &input, &["--job-max-requests", "1000"]);
    let o = weir().args(&moved).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("are still open at the old one"), "{}", stderr(&o));
    // --fresh there too: it would ask the other server about these jobs' ids (and took another
    // run's job of the same id for this run's).
    let fresh: Vec<String> = moved.iter().cloned().chain(["--fresh".to_string()]).collect();
    let o = weir().args(&fresh).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("submitted at another base URL"), "{}", stderr(&o));
    assert_eq!(elsewhere.stats().batch_jobs, 0);
    // `weir batch status` asks where the run recorded its jobs: without --base-url, there (it
    // asked the provider's own), and another is refused.
    let status = ["batch", "status", "--model", model, "--output", out.to_str().unwrap()];
    let o = weir().args(status).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).matches("answered").count(), 3, "{}", stderr(&o));
    let o = weir().args(status).args(["--base-url", &elsewhere.url()]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("were submitted at --base-url"), "{}", stderr(&o));
    elsewhere.shutdown().await;
    let o = weir().args(&args).output().await.unwrap();
    let err = stderr(&o);
    assert!(!err.contains("base URL changed"), "{err}");
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    assert_eq!(sim.stats().batch_jobs, 3, "re-attached, not submitted again: {err}");
    assert!(err.contains("batch jobs: 3 (0 submitted by this run)"), "{err}");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_openai_run_re_attaches_to_its_jobs_and_submits_nothing_twice() {
    killed_and_resumed("openai/gpt-4o-mini", "batch-killed-openai").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_gemini_run_re_attaches_to_its_jobs_and_submits_nothing_twice() {
    killed_and_resumed("gemini/gemini-2.5-flash", "batch-killed-gemini").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_anthropic_run_re_attaches_to_its_batches_and_submits_nothing_twice() {
    killed_and_resumed("anthropic/claude-haiku-4-5", "batch-killed-anthropic").await;
}

/// Issue #37: a message batch has no name, so a run killed after Anthropic made a batch but
/// before weir wrote its id down finds it again by its size and the time it was planned (the
/// other batches of the run, whose ids are written, are not taken for it). Record ids the API
/// does not take as `custom_id`s (spaces, `#`, over 64 characters) come back to their records;
/// the results carry the batch price, and `weir batch status`, `cancel` and `fetch` work on
/// message batches.
#[tokio::test(flavor = "multi_thread")]
async fn anthropic_batches_made_but_not_recorded_are_found_by_size_and_time() {
    let sim = sim(8.0, |_| {}).await;
    let dir = Dir::new("batch-anthropic-unrecorded");
    let long = "x".repeat(70);
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for i in 0..601 {
        let id = match i % 4 {
            0 => format!("a {i}"),
            1 => format!("k_{i}"),
            2 => format!("{long}{i}"),
            _ => format!("r-{i}"),
        };
        data.extend_from_slice(format!("{{\"key\":\"{id}\",\"prompt\":\"{i} river\"}}\n").as_bytes());
        ids.push(id);
    }
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let model = "anthropic/claude-haiku-4-5";
    let args = batch_args(&sim, model, &dir, &input, &["--job-max-requests", "300"]);
    let mut child = weir().args(&args).stderr(std::process::Stdio::null()).spawn().unwrap();
    for _ in 0..1000 {
        if sim.stats().batch_jobs == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sim.stats().batch_jobs, 2);
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let target = ["--model", model, "--base-url", &sim.url(), "--output", out.to_str().unwrap()];
    let status = run(&[&["batch", "status"][..], &target[..]].concat()).await;
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    assert_eq!(status.status.code(), Some(0), "{}", stderr(&status));
    assert_eq!(text.matches(": running").count(), 2, "{text}");
    // Asked with another provider's model, the wrong API is not asked about these batches.
    let other = ["--model", "openai/gpt-4o-mini", "--base-url", &sim.url(), "--output", out.to_str().unwrap()];
    let status = run(&[&["batch", "status"][..], &other[..]].concat()).await;
    assert_eq!(status.status.code(), Some(2), "{}", stderr(&status));
    assert!(stderr(&status).contains("give --model anthropic/claude-haiku-4-5"), "{}", stderr(&status));
    // As if killed between the batches' making and their ids' writing: the second chunk's id
    // is forgotten (the first's stays, and must not be taken for the second).
    let ledger = walk(&dir.0).into_iter().find(|p| p.to_string_lossy().ends_with(".jobs.jsonl")).unwrap();
    let full = std::fs::read_to_string(&ledger).unwrap();
    let kept: String = full
        .lines()
        .filter(|l| !(l.contains("\"job\"") && l.contains("\"chunk\":1")))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(kept.lines().count(), 3, "{full}");
    std::fs::write(&ledger, &kept).unwrap();
    let status = run(&[&["batch", "status"][..], &target[..]].concat()).await;
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    assert!(text.contains("found at the provider"), "{text}");
    let o = weir().args(&args).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    let s = sim.stats();
    assert_eq!((s.batch_jobs, s.batch_keys_in_two_jobs), (2, 0), "re-attached to both, none made again: {err}");
    assert!(err.contains("batch jobs: 2 (0 submitted by this run)"), "{err}");
    assert!(err.contains("claude-haiku-4-5") && err.contains("batch jobs at 50 %"), "{err}");
    assert_eq!(s.batch_answered, 600, "every request in a batch answered once: {err}");
    // Each answer went to its own record: the same prompts online (no cache) get the same
    // answers, whatever their ids looked like.
    let few = Dir::new("batch-anthropic-unrecorded-online");
    let picked: Vec<String> =
        data.split(|b| *b == b'\n').skip(1).take(8).map(|l| String::from_utf8_lossy(l).into()).collect();
    let few_input = few.write("in.jsonl", format!("{}\n", picked.join("\n")).as_bytes());
    let few_out = few.path("out.jsonl");
    let o = weir()
        .args(["run", "--model", model, "--base-url", &sim.url(), "--id-field", "key", "--no-cache", "--input"])
        .args([few_input.to_str().unwrap(), "--output", few_out.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let batch: std::collections::HashMap<String, serde_json::Value> =
        rows(&out).into_iter().map(|r| (r["id"].as_str().unwrap().to_string(), r["response"].clone())).collect();
    for r in rows(&few_out) {
        assert_eq!(batch[r["id"].as_str().unwrap()], r["response"], "{r}");
    }
    // One batch's results, as JSON lines; a cancel of ended batches asks nothing of them.
    let fetch =
        run(&["batch", "fetch", "--model", model, "--base-url", &sim.url(), "--job", "msgbatch_sim000002"]).await;
    assert_eq!(fetch.status.code(), Some(0), "{}", stderr(&fetch));
    assert_eq!(String::from_utf8_lossy(&fetch.stdout).lines().count(), 300);
    sim.shutdown().await;
}

/// Issue #37: `weir batch cancel` cancels running message batches; the run waiting on them
/// sends what they left in follow-up batches, every id once.
#[tokio::test(flavor = "multi_thread")]
async fn cancelled_anthropic_batches_leave_their_records_to_follow_ups() {
    let sim = sim(10.0, |_| {}).await;
    let dir = Dir::new("batch-anthropic-cancel");
    let (data, ids) = prompts(801);
    let input = dir.write("in.jsonl", &data);
    let model = "anthropic/claude-haiku-4-5";
    let args = batch_args(&sim, model, &dir, &input, &["--job-max-requests", "400"]);
    let child = weir().args(&args).stderr(std::process::Stdio::piped()).spawn().unwrap();
    for _ in 0..1000 {
        if sim.stats().batch_jobs == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = dir.path("out.jsonl");
    let target = ["--model", model, "--base-url", &sim.url(), "--output", out.to_str().unwrap()];
    let cancel = run(&[&["batch", "cancel"][..], &target[..]].concat()).await;
    let text = String::from_utf8_lossy(&cancel.stdout).into_owned();
    assert_eq!(text.matches("cancel requested").count(), 2, "{text}");
    let o = child.wait_with_output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    assert!(sim.stats().batch_jobs > 2, "follow-up batches for what the cancelled ones left: {err}");
    assert_eq!(sim.stats().batch_answered, 800, "what the cancelled batches answered is not asked again: {err}");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cost_line_follows_the_price_table() {
    let sim = sim(0.2, |_| {}).await;
    let dir = Dir::new("batch-cost");
    let (data, _) = prompts(50);
    let input = dir.write("in.jsonl", &data);
    let o = batch_run(&sim, "gemini/gemini-2.5-flash", &dir, &input, &[]).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let stats = sim.stats();
    let table: toml::Value = toml::from_str(include_str!("../src/prices.toml")).unwrap();
    let price = &table["models"]["gemini-2.5-flash"];
    let (pin, pout, share) =
        (price["input"].as_float().unwrap(), price["output"].as_float().unwrap(), price["batch"].as_float().unwrap());
    // The run's tokens, as the simulator counted them in the answers it gave.
    let line = err.lines().find(|l| l.contains("tokens")).unwrap();
    // The first record went online (the simulator's own counts), the rest through jobs.
    let (oin, oout) = (stats.tokens_in as f64, stats.tokens_out as f64);
    let num = |after: &str| -> f64 {
        let rest = &line[line.find(after).unwrap() + after.len()..];
        rest.split(|c: char| !c.is_ascii_digit() && c != ',')
            .find(|s| !s.is_empty())
            .unwrap()
            .replace(',', "")
            .parse()
            .unwrap()
    };
    let (tin, tout) = (num("tokens "), num(" in, "));
    assert!(tin > oin && tout > oout && oin > 0.0 && stats.batch_answered == 49, "{line}");
    let online = (tin * pin + tout * pout) / 1e6;
    let paid = (oin * pin + oout * pout) / 1e6 + ((tin - oin) * pin + (tout - oout) * pout) / 1e6 * share;
    let cost = err.lines().find(|l| l.contains("cost: about $")).unwrap_or_else(|| panic!("no cost line: {err}"));
    let shown: f64 = cost["  cost: about $".len()..].split(' ').next().unwrap().parse().unwrap();
    assert!((shown - paid).abs() <= 1e-6, "{cost}: expected {paid}");
    let shown_online: f64 = cost.split("would cost $").nth(1).unwrap().split(';').next().unwrap().parse().unwrap();
    assert!((shown_online - online).abs() <= 1e-6, "{cost}");

    // A model the table does not list gets no cost line.
    let o = run(&[
        "run",
        "--model",
        "sim/demo",
        "--input",
        input.to_str().unwrap(),
        "--output",
        dir.path("sim.jsonl").to_str().unwrap(),
    ])
    .await;
    assert!(!stderr(&o).contains("cost:"), "{}", stderr(&o));
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn batch_mode_refusals_are_usage_errors() {
    let dir = Dir::new("batch-refusals");
    let (data, _) = prompts(3);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
    for (args, says) in [
        (vec!["--model", "sim/demo", "--mode", "batch"], "start `weir sim`"),
        (
            vec!["--model", "gemini/x", "--base-url", "http://127.0.0.1:9", "--mode", "batch", "--no-state"],
            "and no --no-state",
        ),
        (vec!["--model", "gemini/x", "--base-url", "http://127.0.0.1:9", "--mode", "batch", "--output", "-"], "not -"),
        (vec!["--model", "sim/demo", "--fallback", "online"], "add --mode batch"),
        (
            vec!["--model", "gemini/x", "--base-url", "http://127.0.0.1:9", "--mode", "batch", "--poll-secs", "0"],
            "--poll-secs",
        ),
    ] {
        let mut full = vec!["run", "--input", i];
        if !args.contains(&"--output") {
            full.extend(["--output", o]);
        }
        full.extend(args.iter().copied());
        let r = run(&full).await;
        assert_eq!(r.status.code(), Some(2), "{args:?}: {}", stderr(&r));
        assert!(stderr(&r).contains(says), "{args:?}: {}", stderr(&r));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn auto_mode_status_cancel_and_fetch() {
    let sim = sim(10.0, |_| {}).await;
    let dir = Dir::new("batch-auto");
    let (data, ids) = prompts(1_200);
    let input = dir.write("in.jsonl", &data);
    let args = batch_args(&sim, "openai/gpt-4o-mini", &dir, &input, &["--job-max-requests", "500"]);
    let args: Vec<String> = args.into_iter().map(|a| if a == "batch" { "auto".to_string() } else { a }).collect();
    let child = weir().args(&args).stderr(std::process::Stdio::piped()).spawn().unwrap();
    for _ in 0..1000 {
        if sim.stats().batch_jobs == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let base = format!("{}/v1", sim.url());
    let out = dir.path("out.jsonl");
    let target = ["--model", "openai/gpt-4o-mini", "--base-url", &base, "--output", out.to_str().unwrap()];
    let status = run(&[&["batch", "status"][..], &target[..]].concat()).await;
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    assert_eq!(status.status.code(), Some(0), "{}", stderr(&status));
    assert_eq!(text.lines().filter(|l| l.contains(": pending") || l.contains(": running")).count(), 3, "{text}");
    // Cancel all three while the run waits: it sends what they did not answer in follow-up jobs.
    let cancel = run(&[&["batch", "cancel"][..], &target[..]].concat()).await;
    let text = String::from_utf8_lossy(&cancel.stdout).into_owned();
    assert_eq!(text.matches("cancel requested").count(), 3, "{text}");
    let o = child.wait_with_output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("--mode auto: 1,200 records → batch jobs"), "{err}");
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    assert!(sim.stats().batch_jobs > 3, "follow-up jobs for what the cancelled ones left: {err}");
    // One job's results, as JSONL.
    let fetch =
        run(&["batch", "fetch", "--model", "openai/gpt-4o-mini", "--base-url", &base, "--job", "batch_2"]).await;
    assert_eq!(fetch.status.code(), Some(0), "{}", stderr(&fetch));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&fetch.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines.len() == 500 || lines.len() == 499, "a cancelled job lists every request: answered, or not run");
    assert!(lines.iter().any(|l| l["error"]["message"].as_str().is_some_and(|m| m.contains("batch_cancelled"))));

    // A small input runs online.
    let small = Dir::new("batch-auto-small");
    let (data, ids) = prompts(20);
    let input = small.write("in.jsonl", &data);
    let args: Vec<String> = batch_args(&sim, "openai/gpt-4o-mini", &small, &input, &[])
        .into_iter()
        .map(|a| if a == "batch" { "auto".to_string() } else { a })
        .collect();
    let jobs_before = sim.stats().batch_jobs;
    let o = weir().args(&args).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&small.path("out.jsonl")), &[]);
    assert_eq!(sim.stats().batch_jobs, jobs_before);
    assert!(!stderr(&o).contains("batch jobs:"), "{}", stderr(&o));
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_the_endpoint_refuses_online_submits_no_job() {
    let sim = sim(0.2, |c| c.api_keys = vec!["right-key".into()]).await;
    let dir = Dir::new("batch-refused-first");
    let (data, _) = prompts(30);
    let input = dir.write("in.jsonl", &data);
    let o = weir()
        .args(batch_args(&sim, "openai/gpt-4o-mini", &dir, &input, &[]))
        .env("OPENAI_API_KEY", "wrong-key")
        .output()
        .await
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("refused the first request online, so no job was submitted"), "{err}");
    assert!(!err.contains("wrong-key"), "the key is never shown: {err}");
    assert_eq!(sim.stats().batch_jobs, 0);
    // The job routes want the key too.
    let listed = reqwest::get(format!("{}/v1/batches", sim.url())).await.unwrap();
    assert_eq!(listed.status().as_u16(), 401);
    // With the right key the same command runs; the rejected record was not finished.
    let o = weir()
        .args(batch_args(&sim, "openai/gpt-4o-mini", &dir, &input, &[]))
        .env("OPENAI_API_KEY", "right-key")
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 30);
    assert_eq!(sim.stats().batch_jobs, 1);
    sim.shutdown().await;
}

/// Issue #29, item 15: `--fresh` after an interrupted batch run used to forget its jobs (still
/// charged, no longer seen by `weir batch status`) and submit every record again. It is
/// refused while they run, naming them and the way out; once they are cancelled it starts over.
#[tokio::test(flavor = "multi_thread")]
async fn fresh_is_refused_while_the_earlier_runs_jobs_are_live() {
    let sim = sim(8.0, |_| {}).await;
    let dir = Dir::new("batch-fresh-live");
    let (data, ids) = prompts(600);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let model = "openai/gpt-4o-mini";
    let args = batch_args(&sim, model, &dir, &input, &["--job-max-requests", "300"]);
    let mut child = weir().args(&args).stderr(std::process::Stdio::null()).spawn().unwrap();
    for _ in 0..1000 {
        if sim.stats().batch_jobs == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sim.stats().batch_jobs, 2);
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let fresh = |extra: &[&str]| {
        let mut a = batch_args(&sim, model, &dir, &input, &["--job-max-requests", "300", "--fresh"]);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let o = weir().args(fresh(&[])).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("still live at the provider") && err.contains("weir batch cancel"), "{err}");
    assert_eq!(sim.stats().batch_jobs, 2, "nothing submitted again: {err}");
    // Found by an outside tester: a run killed after submitting a job but before writing its id
    // down left a ledger that --fresh took for empty, and it paid again. Such a chunk is looked
    // up by its name: the ledger without its ids (as if killed then) is refused the same way.
    let ledger = walk(&dir.0).into_iter().find(|p| p.to_string_lossy().ends_with(".jobs.jsonl")).unwrap();
    let full = std::fs::read_to_string(&ledger).unwrap();
    let planned: String = full.lines().filter(|l| !l.contains("\"job\"")).map(|l| format!("{l}\n")).collect();
    assert_eq!(planned.lines().count(), 2, "{full}");
    std::fs::write(&ledger, &planned).unwrap();
    let o = weir().args(fresh(&[])).output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("still live at the provider"), "{err}");
    assert_eq!(sim.stats().batch_jobs, 2, "nothing submitted again: {err}");
    // Without --mode batch weir cannot ask the provider: refused too, saying what to do.
    let mut online: Vec<String> = fresh(&[]);
    let at = online.iter().position(|a| a == "--mode").unwrap();
    online.drain(at..at + 2);
    let o = weir().args(&online).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--mode batch"), "{}", stderr(&o));
    assert_eq!(sim.stats().requests, 1, "no call made: {}", stderr(&o));
    // Cancelled, the jobs are no longer in the way.
    let base = format!("{}/v1", sim.url());
    let o = weir()
        .args(["batch", "cancel", "--model", model, "--base-url", &base, "--output", out.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = weir().args(fresh(&[])).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    sim.shutdown().await;
}

/// Issue #34: embeddings through the OpenAI Batch API (`/v1/embeddings` lines): every id once,
/// each vector the one an online call gives for the same text; other providers' embeddings are
/// refused in batch mode, saying they run online.
#[tokio::test(flavor = "multi_thread")]
async fn openai_embeddings_go_through_jobs_and_match_the_online_vectors() {
    let sim = sim(0.3, |_| {}).await;
    let dir = Dir::new("batch-embed");
    let (data, ids) = prompts(250);
    let input = dir.write("in.jsonl", &data);
    let model = "openai/text-embedding-3-small";
    let extra = ["--task", "embed", "--job-max-requests", "100"];
    let o = batch_run(&sim, model, &dir, &input, &extra).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let batch = rows(&dir.path("out.jsonl"));
    assert_each_id_once(&ids, &batch, &rows(&dir.path("out.errors.jsonl")));
    let s = sim.stats();
    assert_eq!((s.batch_jobs, s.batch_keys, s.requests), (3, 249, 1), "{err}");
    let listed: serde_json::Value =
        reqwest::get(format!("{}/v1/batches", sim.url())).await.unwrap().json().await.unwrap();
    assert!(listed["data"].as_array().unwrap().iter().all(|b| b["endpoint"] == "/v1/embeddings"), "{listed}");
    // The same records online.
    let online_dir = Dir::new("batch-embed-online");
    let out = online_dir.path("out.jsonl");
    let base = format!("{}/v1", sim.url());
    let o = weir()
        .args(["run", "--model", model, "--task", "embed", "--base-url", &base, "--input", input.to_str().unwrap()])
        .args(["--output", out.to_str().unwrap(), "--id-field", "key"])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let online: std::collections::HashMap<String, serde_json::Value> =
        rows(&out).into_iter().map(|r| (r["id"].as_str().unwrap().to_string(), r["embedding"].clone())).collect();
    for r in &batch {
        let v = &r["embedding"];
        assert!(v.as_array().is_some_and(|a| !a.is_empty()), "{r}");
        assert_eq!(v, &online[r["id"].as_str().unwrap()], "the job's vector is the online one");
    }
    let o = batch_run(&sim, "gemini/gemini-embedding-001", &dir, &input, &["--task", "embed", "--fresh"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("embeds online"), "{}", stderr(&o));
    sim.shutdown().await;
}

/// Found by an outside tester (issue #34): `--fresh` after a kill, once the jobs had ended but
/// before their answers were written, paid for every record again; a spool cut short lost its
/// records' answers and the run exited 0; a batch run from stdin could never be resumed.
#[tokio::test(flavor = "multi_thread")]
async fn ended_jobs_block_fresh_a_damaged_spool_is_said_and_a_stream_is_refused() {
    let sim = sim(1.0, |_| {}).await;
    let dir = Dir::new("batch-hostile");
    let (data, ids) = prompts(3_000);
    let input = dir.write("in.jsonl", &data);
    let args = batch_args(&sim, "openai/gpt-4o-mini", &dir, &input, &["--job-max-requests", "1000"]);
    let mut child = weir().args(&args).stderr(std::process::Stdio::null()).spawn().unwrap();
    for _ in 0..1000 {
        if sim.stats().batch_jobs == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.start_kill().unwrap();
    let _ = child.wait().await;
    assert_eq!(sim.stats().batch_jobs, 3);
    // The jobs end at the simulator; their answers are not written yet.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut fresh = args.clone();
    fresh.push("--fresh".into());
    let o = weir().args(&fresh).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--fresh would throw away the answers of 3 batch job(s)"), "{}", stderr(&o));
    // A spool cut short is said, not read as fewer records.
    let spool = dir.path(".weir/runs/out.jsonl.jobs.jsonl.spool/s0.records");
    let text = std::fs::read_to_string(&spool).unwrap();
    let half: String = text.lines().take(500).map(|l| format!("{l}\n")).collect();
    std::fs::write(&spool, &half).unwrap();
    let o = weir().args(&args).output().await.unwrap();
    assert_ne!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("cut short"), "{}", stderr(&o));
    // Restored, the run ends with every record once, and nothing submitted again.
    std::fs::write(&spool, &text).unwrap();
    let o = weir().args(&args).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &rows(&dir.path("out.errors.jsonl")));
    assert_eq!((sim.stats().batch_jobs, sim.stats().batch_keys_in_two_jobs), (3, 0));
    // A stream is refused before anything is written.
    let mut piped: Vec<String> = args.clone();
    let i = piped.iter().position(|a| a == "--input").unwrap();
    piped[i + 1] = "-".into();
    let i = piped.iter().position(|a| a == "--output").unwrap();
    piped[i + 1] = dir.path("other.jsonl").to_str().unwrap().into();
    let o = weir().args(&piped).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("batch jobs need an input file"), "{}", stderr(&o));
    assert!(!dir.path("other.jsonl").exists());
    sim.shutdown().await;
}

/// Issue #35: records with media in batch jobs. Each image goes into the job's input (inline),
/// is answered once, and its answer depends on it; a missing file is the record's error row
/// and goes into no job; the finished run run again submits nothing (the answers are keyed on
/// the images' bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_with_images_go_into_jobs_once_each() {
    for model in ["gemini/gemini-2.5-flash", "openai/gpt-4o-mini"] {
        let sim = sim(0.2, |_| {}).await;
        let dir = Dir::new(&format!("batch-media-{}", model.replace('/', "-")));
        let mut lines = String::new();
        for i in 0..20 {
            let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
            png.extend_from_slice(format!("batch image {i}").as_bytes());
            let p = dir.write(&format!("img{i}.png"), &png);
            lines.push_str(&format!("{{\"key\":\"k{i}\",\"prompt\":\"describe\",\"image\":\"{}\"}}\n", p.display()));
        }
        lines.push_str(&format!(
            "{{\"key\":\"gone\",\"prompt\":\"describe\",\"image\":\"{}\"}}\n",
            dir.path("none.png").display()
        ));
        let input = dir.write("in.jsonl", lines.as_bytes());
        let o = batch_run(&sim, model, &dir, &input, &["--media-field", "image"]).await;
        let err = stderr(&o);
        let out = rows(&dir.path("out.jsonl"));
        assert_eq!(out.len(), 20, "{model}: {err}");
        let errors = rows(&dir.path("out.errors.jsonl"));
        assert_eq!(errors.len(), 1, "{model}: {err}");
        assert!(errors[0]["message"].as_str().unwrap().contains("no such file"), "{}", errors[0]);
        let s = sim.stats();
        assert_eq!((s.requests, s.media_parts), (1, 1), "{model}: the first record online: {err}");
        assert_eq!((s.batch_jobs, s.batch_answered, s.batch_media_parts), (1, 19, 19), "{model}: {err}");
        let answers: std::collections::HashSet<&str> = out.iter().map(|r| r["response"].as_str().unwrap()).collect();
        assert_eq!(answers.len(), 20, "{model}: each image its own answer");
        let again = batch_run(&sim, model, &dir, &input, &["--media-field", "image"]).await;
        let s = sim.stats();
        assert_eq!((s.requests, s.batch_jobs), (1, 1), "{model}: nothing paid again: {}", stderr(&again));
        sim.shutdown().await;
    }
}

/// A new batch run's first record goes online first; a 400 for what that record holds (a
/// prompt refused) says nothing of the others: the run goes on to its batches, that record an
/// error row. Three refused in a row stop it before any batch, as a misconfigured run.
#[tokio::test(flavor = "multi_thread")]
async fn the_first_records_own_refusal_does_not_stop_a_batch_run() {
    let sim = sim(0.2, |_| {}).await;
    let model = "anthropic/claude-haiku-4-5";
    let dir = Dir::new("batch-first-refused");
    let mut data = b"{\"key\":\"bad\",\"prompt\":\"no [sim:block_prompt]\"}\n".to_vec();
    let (rest, mut ids) = prompts(50);
    data.extend_from_slice(&rest);
    ids.push("bad".into());
    let input = dir.write("in.jsonl", &data);
    let o = batch_run(&sim, model, &dir, &input, &[]).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "one error row: {err}");
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &errors);
    assert_eq!((errors.len(), errors[0]["id"].as_str()), (1, Some("bad")), "{err}");
    assert_eq!(sim.stats().batch_jobs, 1, "{err}");
    // Three refused first: no batch.
    let dir = Dir::new("batch-first-three-refused");
    let mut data = Vec::new();
    for i in 0..3 {
        data.extend_from_slice(format!("{{\"key\":\"bad{i}\",\"prompt\":\"no [sim:block_prompt]\"}}\n").as_bytes());
    }
    data.extend_from_slice(&prompts(20).0);
    let input = dir.write("in.jsonl", &data);
    let o = batch_run(&sim, model, &dir, &input, &[]).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("refused the first 3 requests online, so no job was submitted"), "{err}");
    assert_eq!(sim.stats().batch_jobs, 1, "{err}");
    sim.shutdown().await;
}
