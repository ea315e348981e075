//! Resumable runs: crash (SIGKILL) tests, identity checks, torn tails, Ctrl-C, the response
//! cache and `--retry-errors`, all black-box against the simulator.

mod util;

use rand::{Rng, SeedableRng};
use std::time::Duration;
use util::*;
use weir_sim::SimConfig;

fn base_args<'a>(server: &'a str, input: &'a str, out: &'a str) -> Vec<&'a str> {
    vec!["run", "--model", "gemini/m", "--base-url", server, "--input", input, "--output", out, "--id-field", "key"]
}

/// 20,000 records against a simulator with latency and faults; the CLI is killed with SIGKILL
/// at 5 random moments and restarted each time. At the end every id is in the output or the
/// errors exactly once, and the calls beyond each record's first attempt and the retries of
/// injected faults number at most the in-flight limit per kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_five_times_loses_nothing_and_pays_little_twice() {
    const N: usize = 20_000;
    const IN_FLIGHT: u64 = 32;
    const KILLS: u64 = 5;
    let mut config = SimConfig { seed: 21, ..SimConfig::default() };
    config.latency.fixed_ms = 8.0;
    config.latency.jitter_ms = 8.0;
    config.faults.error_503 = 0.03;
    config.faults.error_500 = 0.02;
    config.faults.reset = 0.01;
    config.faults.block_prompt = 0.01;
    config.faults.block_candidate = 0.01;
    let server = sim(config).await;
    let url = server.url();
    let dir = Dir::new("crash");
    let (data, ids) = prompts(N);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
    let mut args = base_args(&url, &i, &o);
    args.extend(["--max-concurrency", "32", "--max-retries", "30", "--progress", "never", "--no-cache"]);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    for k in 0..KILLS {
        let mut child = weir().args(&args).stderr(std::process::Stdio::null()).spawn().unwrap();
        let wait = Duration::from_millis(rng.gen_range(400..2000));
        tokio::time::sleep(wait).await;
        assert!(child.try_wait().unwrap().is_none(), "kill {k}: the run ended before it could be killed");
        child.start_kill().unwrap(); // SIGKILL
        let status = child.wait().await.unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
    }
    let o = run(&args).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("Resuming:"));
    let results = rows(&out);
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_each_id_once(&ids, &results, &errors);
    assert!(errors.iter().all(|e| e["kind"] == "blocked"), "only safety blocks fail");

    let s = server.stats();
    let f = &s.faults;
    let retried_faults = f["error_500"] + f["error_503"] + f["reset"];
    let extra = s.requests as i64 - N as i64 - retried_faults as i64;
    println!("requests {}, faults retried {retried_faults}, extra {extra}", s.requests);
    assert!(extra >= 0, "{s:?}");
    assert!(extra as u64 <= KILLS * IN_FLIGHT, "{extra} calls paid twice for {KILLS} kills: {s:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_command_refuses_to_resume_and_fresh_starts_over() {
    let server = sim(SimConfig::default()).await;
    let url = server.url();
    let dir = Dir::new("changed");
    let (data, ids) = prompts(50);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
    let args = base_args(&url, &i, &o);
    let r = run(&[&args[..], &["--param", "temperature=0.2"]].concat()).await;
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    let r = run(&[&args[..], &["--param", "temperature=0.7"]].concat()).await;
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    let msg = stderr(&r);
    assert!(
        msg.contains("parameters") && msg.contains("0.2") && msg.contains("0.7") && msg.contains("--fresh"),
        "{msg}"
    );
    assert_eq!(rows(&out).len(), 50, "nothing was touched");
    let r = run(&[&args[..], &["--param", "temperature=0.7", "--fresh", "--no-cache"]].concat()).await;
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    assert!(!stderr(&r).contains("Resuming"));
    assert_each_id_once(&ids, &rows(&out), &[]);
    assert_eq!(server.stats().requests, 100);
    // The same command again: everything is finished, no call is made.
    let r = run(&[&args[..], &["--param", "temperature=0.7"]].concat()).await;
    assert_eq!(r.status.code(), Some(0));
    assert!(stderr(&r).contains("Resuming: 50 of 50 finished"), "{}", stderr(&r));
    assert_eq!(server.stats().requests, 100);
    // Another errors file is another run (resumed, it read an empty one: the records whose rows
    // were in the first were paid for again, and their ids ended up in both files); another
    // spelling of the same one is not.
    let other = dir.path("other.errors.jsonl");
    let r = run(&[&args[..], &["--param", "temperature=0.7", "--errors", other.to_str().unwrap()]].concat()).await;
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    assert!(stderr(&r).contains("outputs: errors ") && stderr(&r).contains("other.errors.jsonl"), "{}", stderr(&r));
    let same = format!("{}/./out.errors.jsonl", dir.path("").display());
    let r = run(&[&args[..], &["--param", "temperature=0.7", "--errors", &same]].concat()).await;
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    assert_eq!(server.stats().requests, 100);
    // A changed input is a different run.
    std::fs::write(&input, [&data[..], b"{\"key\":\"new\",\"prompt\":\"x\"}\n"].concat()).unwrap();
    let r = run(&[&args[..], &["--param", "temperature=0.7"]].concat()).await;
    assert_eq!(r.status.code(), Some(2));
    assert!(stderr(&r).contains("input:"), "{}", stderr(&r));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_is_cut_and_its_record_done_again() {
    let server = sim(SimConfig::default()).await;
    let url = server.url();
    let dir = Dir::new("torn");
    let (data, ids) = prompts(30);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
    let mut args = base_args(&url, &i, &o);
    args.push("--no-cache");
    assert_eq!(run(&args).await.status.code(), Some(0));
    // Keep 20 whole rows and half of the 21st, as a crash mid-write would.
    as_if_killed(&dir.0);
    let text = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut torn = lines[..20].join("\n");
    torn.push('\n');
    torn.push_str(&lines[20][..lines[20].len() / 2]);
    std::fs::write(&out, torn).unwrap();
    let r = run(&args).await;
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    assert!(stderr(&r).contains("Resuming: 20 of 30 finished"), "{}", stderr(&r));
    assert!(stderr(&r).contains("torn tail"), "{}", stderr(&r));
    assert_each_id_once(&ids, &rows(&out), &[]);
    assert_eq!(server.stats().requests, 40);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_drains_in_flight_calls_and_the_run_resumes() {
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 300.0;
    let server = sim(config).await;
    let url = server.url();
    let dir = Dir::new("ctrlc");
    let (data, ids) = prompts(400);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
    let mut args = base_args(&url, &i, &o);
    args.extend(["--max-concurrency", "8", "--progress", "never", "--no-cache"]);
    let child = weir().args(&args).stderr(std::process::Stdio::piped()).spawn().unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let o1 = child.wait_with_output().await.unwrap();
    let err = stderr(&o1);
    assert_eq!(o1.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(err.contains("run the same command again to resume"), "{err}");
    let done = rows(&out).len() as u64;
    let stats = server.stats();
    // In-flight calls finished and were written: every call made got its row.
    assert_eq!(stats.requests, done, "{stats:?}");
    assert!(done > 0 && done < 400);
    let r = run(&args).await;
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    assert_each_id_once(&ids, &rows(&out), &[]);
    assert_eq!(server.stats().requests, 400, "nothing paid twice");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_answers_reruns_without_calls() {
    let server = sim(SimConfig::default()).await;
    let url = server.url();
    let dir = Dir::new("cache");
    let (data, ids) = prompts(200);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
    let args = base_args(&url, &i, &o);
    assert_eq!(run(&args).await.status.code(), Some(0));
    let first = rows(&out);
    assert_eq!(server.stats().requests, 200);
    // --fresh discards the outputs but not the cache.
    let r = run(&[&args[..], &["--fresh"]].concat()).await;
    assert_eq!(r.status.code(), Some(0));
    assert!(stderr(&r).contains("200 from cache"), "{}", stderr(&r));
    assert_eq!(server.stats().requests, 200, "no call");
    let again = rows(&out);
    assert_each_id_once(&ids, &again, &[]);
    let text = |rows: &[serde_json::Value], id: &str| rows.iter().find(|r| r["id"] == id).unwrap()["response"].clone();
    assert_eq!(text(&first, "r5"), text(&again, "r5"));
    assert_eq!(again[0]["attempts"], 0);
    // Another output in the same directory shares the state directory and so the cache.
    let other = dir.path("other.jsonl");
    let mut a2 = base_args(&url, &i, other.to_str().unwrap());
    a2.push("--progress");
    a2.push("never");
    assert_eq!(run(&a2).await.status.code(), Some(0));
    assert_eq!(server.stats().requests, 200);
    // --no-cache calls again.
    let r = run(&[&args[..], &["--fresh", "--no-cache"]].concat()).await;
    assert_eq!(r.status.code(), Some(0));
    assert_eq!(server.stats().requests, 400);
    // The cache holds no secret.
    server.shutdown().await;
    let server = sim(SimConfig::default()).await;
    let url2 = server.url();
    let o = weir()
        .args(base_args(&url2, &i, dir.path("keyed.jsonl").to_str().unwrap()))
        .args(["--param", "seed=3"])
        .env("GEMINI_API_KEY", "very-secret-key-123")
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    // Every file of the state directory (the cache is a directory of journals and tables).
    let mut files = vec![dir.path(".weir")];
    let mut cache_bytes = 0;
    while let Some(p) = files.pop() {
        if p.is_dir() {
            files.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        if p.starts_with(dir.path(".weir/cache")) {
            cache_bytes += bytes.len();
        }
        assert!(!bytes.windows(19).any(|w| w == b"very-secret-key-123"), "{} holds the key", p.display());
    }
    assert!(cache_bytes > 0, "the cache was written");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_errors_runs_only_retryable_failures_again() {
    // First run: every call fails with 500 and retries are off, so all records fail retryably,
    // except the ones whose prompt forces a safety block.
    let mut config = SimConfig::default();
    config.faults.error_500 = 1.0;
    let bad = sim(config).await;
    let dir = Dir::new("retry-errors");
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for i in 0..40 {
        let prompt = if i % 10 == 0 { "[sim:block_prompt]".to_string() } else { format!("p{i}") };
        data.extend_from_slice(format!("{{\"key\":\"k{i}\",\"prompt\":\"{prompt}\"}}\n").as_bytes());
        ids.push(format!("k{i}"));
    }
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
    let url = bad.url();
    let mut args = base_args(&url, &i, &o);
    args.extend(["--max-retries", "0"]);
    let r = run(&args).await;
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.iter().filter(|e| e["kind"] == "server").count(), 36);
    assert_eq!(errors.iter().filter(|e| e["kind"] == "blocked").count(), 4);
    // Without --retry-errors, a rerun has nothing to do.
    let r = run(&args).await;
    assert_eq!(r.status.code(), Some(1));
    assert!(stderr(&r).contains("Resuming: 40 of 40 finished"), "{}", stderr(&r));
    // ... and says how to run the ones that may pass again (not the blocked ones).
    assert!(stderr(&r).contains("36 of them failed for a reason that may pass"), "{}", stderr(&r));
    assert!(stderr(&r).contains("add --retry-errors"), "{}", stderr(&r));
    bad.shutdown().await;
    // The healthy server is elsewhere (a server restarted on another port): the run resumes
    // there, keeping what the first one finished, and says so.
    let good = sim(SimConfig::default()).await;
    let good_url = good.url();
    let mut args = base_args(&good_url, &i, &o);
    args.extend(["--max-retries", "0"]);
    let r = run(&[&args[..], &["--retry-errors"]].concat()).await;
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("36 more error rows are to run again"), "{}", stderr(&r));
    assert!(stderr(&r).contains(&format!("the base URL changed since the earlier run ({url} → ")), "{}", stderr(&r));
    let results = rows(&out);
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(results.len(), 36);
    assert!(errors.iter().all(|e| e["kind"] == "blocked"));
    assert_each_id_once(&ids, &results, &errors);
    assert_eq!(good.stats().requests, 36, "blocked records were not called again");
    good.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_without_state_still_accounts_for_every_record() {
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 300.0;
    let server = sim(config).await;
    let url = server.url();
    // Ctrl-C, and SIGTERM (a service manager, `timeout`) alike; each says which it was and how
    // to stop at once.
    for (signal, status, says) in [
        ("-INT", 130, "interrupted; letting calls in flight finish (up to 30 s). Press Ctrl-C again to stop at once."),
        (
            "-TERM",
            143,
            "terminated (SIGTERM); letting calls in flight finish (up to 30 s). Send SIGTERM again or press Ctrl-C \
             to stop at once.",
        ),
    ] {
        let before = server.stats().requests;
        let dir = Dir::new("ctrlc-nostate");
        let (data, ids) = prompts(300);
        let input = dir.write("in.jsonl", &data);
        let out = dir.path("out.jsonl");
        let (i, o) = (input.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
        let mut args = base_args(&url, &i, &o);
        args.extend(["--max-concurrency", "8", "--progress", "never", "--no-state"]);
        let child = weir().args(&args).stderr(std::process::Stdio::piped()).spawn().unwrap();
        tokio::time::sleep(Duration::from_millis(800)).await;
        let pid = child.id().unwrap().to_string();
        assert!(std::process::Command::new("kill").args([signal, &pid]).status().unwrap().success());
        let o1 = child.wait_with_output().await.unwrap();
        assert_eq!(o1.status.code(), Some(status), "{}", stderr(&o1));
        assert!(stderr(&o1).contains(says), "{}", stderr(&o1));
        let results = rows(&out);
        let errors = rows(&dir.path("out.errors.jsonl"));
        assert_each_id_once(&ids, &results, &errors);
        assert!(!results.is_empty() && !errors.is_empty());
        assert!(errors.iter().all(|e| e["kind"] == "aborted"));
        assert_eq!(server.stats().requests - before, results.len() as u64, "every call made got its result row");
        // The summary says those failed records were not run, rather than only that they failed.
        let said = format!("interrupted: {} of the failed records were not run or were cut off", errors.len());
        assert!(stderr(&o1).contains(&said), "{}", stderr(&o1));
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_base_url_from_the_environment_is_the_runs_own() {
    // `OPENAI_BASE_URL` instead of `--base-url`: recorded as the provider's own, a resume with
    // the variable pointed elsewhere was not seen as moved (a batch run's records were submitted
    // again there), the same URL given the other way was, and `weir batch status` went to
    // api.openai.com.
    let sim = sim(SimConfig::default()).await;
    let other = self::sim(SimConfig::default()).await;
    let dir = Dir::new("resume-base-url-env");
    let (data, _) = prompts(3);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let base = format!("{}/v1", sim.url());
    let args = ["run", "--model", "openai/m", "--id-field", "key", "--input", input.to_str().unwrap()];
    let args: Vec<&str> = args.into_iter().chain(["--output", out.to_str().unwrap()]).collect();
    let o = weir().env("OPENAI_BASE_URL", &base).args(&args).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let recorded = std::fs::read_to_string(dir.path(".weir/runs/out.jsonl.json")).unwrap();
    assert!(recorded.contains(&base), "{recorded}");
    // The same URL given as --base-url: no change.
    let o = weir().args(&args).args(["--base-url", &base]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stderr(&o).contains("base URL changed"), "{}", stderr(&o));
    // The variable pointed elsewhere: a change, said.
    let o = weir().env("OPENAI_BASE_URL", format!("{}/v1", other.url())).args(&args).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("base URL changed"), "{}", stderr(&o));
    sim.shutdown().await;
    other.shutdown().await;
}
