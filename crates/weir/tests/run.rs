//! Black-box tests of `weir run` against the simulator.

mod util;

use serde_json::Value;
use util::*;
use weir_sim::SimConfig;

fn faulty(rate_each: f64, seed: u64) -> SimConfig {
    let mut c = SimConfig { seed, ..SimConfig::default() };
    let f = &mut c.faults;
    f.error_500 = rate_each;
    f.error_503 = rate_each;
    f.reset = rate_each;
    f.hang = rate_each;
    f.malformed = rate_each;
    f.block_prompt = rate_each;
    f.block_candidate = rate_each;
    f.hang_secs = 3.0;
    c
}

/// 10,000 records, 20 % of calls faulted with every kind: each id ends exactly once; retryable
/// faults end in success; safety blocks end in errors as `blocked`, one per injected block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_records_with_faults_each_id_exactly_once() {
    let server = sim(faulty(0.2 / 7.0, 11)).await;
    let dir = Dir::new("faults");
    let (data, ids) = prompts(10_000);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let o = run(&[
        "run",
        "--model",
        "gemini/gemini-2.5-flash",
        "--base-url",
        &server.url(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "key",
        "--timeout",
        "0.5",
        "--max-retries",
        "30",
        "--max-concurrency",
        "64",
        "--progress",
        "never",
    ])
    .await;
    let results = rows(&out);
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_each_id_once(&ids, &results, &errors);
    let stats = server.stats();
    let blocks = stats.faults["block_prompt"] + stats.faults["block_candidate"];
    assert!(blocks > 100, "{stats:?}");
    assert_eq!(errors.len() as u64, blocks, "exactly the blocked calls fail");
    assert!(errors.iter().all(|e| e["kind"] == "blocked" && e["retryable"] == false), "{:?}", &errors[..3]);
    assert!(errors.iter().all(|e| e["input"]["key"].is_string()), "the input is kept");
    // Every transient fault was retried to success.
    for kind in ["error_500", "error_503", "reset", "hang", "malformed"] {
        assert!(stats.faults[kind] > 100, "{kind}: {stats:?}");
    }
    assert!(results.iter().any(|r| r["attempts"].as_u64().unwrap() > 1));
    assert_eq!(stats.successes - blocks, results.len() as u64, "one successful call per result");
    // Which records are blocked depends on the order calls reach the server: check one that
    // was not.
    let r = &results[results.len() / 2];
    let n: u64 = r["id"].as_str().unwrap()[1..].parse().unwrap();
    assert_eq!(r["input"]["n"], n);
    assert_eq!(r["model"], "gemini/gemini-2.5-flash");
    assert!(r["response"].as_str().unwrap().len() > 3);
    assert!(r["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    let summary = stderr(&o);
    assert!(summary.contains("10,000 records"), "{summary}");
    assert!(summary.contains("blocked"), "{summary}");
    server.shutdown().await;
}

/// The same through the OpenAI-compatible route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_route_with_faults() {
    let server = sim(faulty(0.2 / 7.0, 5)).await;
    let dir = Dir::new("openai-faults");
    let (data, ids) = prompts(2_000);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let o = run(&[
        "run",
        "--model",
        "openai/sim-1",
        "--base-url",
        &format!("{}/v1", server.url()),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "key",
        "--timeout",
        "0.5",
        "--max-retries",
        "30",
        "--progress",
        "never",
    ])
    .await;
    let results = rows(&out);
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_each_id_once(&ids, &results, &errors);
    let stats = server.stats();
    assert_eq!(errors.len() as u64, stats.faults["block_prompt"] + stats.faults["block_candidate"]);
    assert!(errors.iter().all(|e| e["kind"] == "blocked"));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_sim_needs_no_key_and_exits_zero() {
    let dir = Dir::new("embedded");
    let (data, ids) = prompts(500);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("res.jsonl");
    let o = run(&[
        "run",
        "--model",
        "sim/demo",
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "key",
    ])
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = rows(&out);
    assert_each_id_once(&ids, &results, &[]);
    assert!(stderr(&o).contains("500 records"));
    assert!(dir.path("res.errors.jsonl").exists());
    assert!(rows(&dir.path("res.errors.jsonl")).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_become_error_rows_naming_their_line() {
    let dir = Dir::new("bad-rows");
    let mut data = Vec::new();
    data.extend_from_slice(b"{\"prompt\":\"fine\"}\n");
    data.extend_from_slice(b"{not json\n");
    data.extend_from_slice(b"[1,2,3]\n");
    data.extend_from_slice(b"{\"text\":\"no prompt field\"}\n");
    data.extend_from_slice(b"{\"prompt\":\"bad \xff utf8\"}\n");
    data.extend_from_slice(b"\n");
    data.extend_from_slice(b"{\"prompt\":\"also fine\"}");
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let o =
        run(&["run", "--model", "sim/x", "--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let results = rows(&out);
    let errors = rows(&dir.path("out.errors.jsonl"));
    let mut ok_ids: Vec<&str> = results.iter().map(|r| r["id"].as_str().unwrap()).collect();
    ok_ids.sort();
    assert_eq!(ok_ids, vec!["1", "7"]);
    let mut lines: Vec<u64> = errors.iter().map(|e| e["line"].as_u64().unwrap()).collect();
    lines.sort();
    assert_eq!(lines, vec![2, 3, 4, 5]);
    for e in &errors {
        assert_eq!(e["kind"], "invalid_input");
        let line = e["line"].as_u64().unwrap();
        assert!(e["message"].as_str().unwrap().contains(&format!("line {line}")), "{e}");
        assert!(e.get("raw").is_some() || e.get("input").is_some(), "{e}");
    }
    let utf8 = errors.iter().find(|e| e["line"] == 5).unwrap();
    assert!(utf8["message"].as_str().unwrap().contains("UTF-8"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_input_is_a_clean_zero() {
    let dir = Dir::new("empty");
    let input = dir.write("in.jsonl", b"");
    let out = dir.path("out.jsonl");
    let o =
        run(&["run", "--model", "sim/x", "--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("0 records"), "{}", stderr(&o));
    assert!(rows(&out).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_ids_fail_their_second_occurrence() {
    let dir = Dir::new("dupes");
    let input = dir.write(
        "in.jsonl",
        b"{\"k\":\"a\",\"prompt\":\"x\"}\n{\"k\":\"b\",\"prompt\":\"y\"}\n{\"k\":\"a\",\"prompt\":\"z\"}\n",
    );
    let out = dir.path("out.jsonl");
    let o = run(&[
        "run",
        "--model",
        "sim/x",
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "k",
    ])
    .await;
    assert_eq!(o.status.code(), Some(1));
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 1);
    assert_eq!((errors[0]["line"].as_u64(), errors[0]["kind"].as_str()), (Some(3), Some("invalid_input")));
    assert!(errors[0]["message"].as_str().unwrap().contains("duplicate id 'a'"));
    assert_eq!(rows(&out).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_exit_2_and_write_nothing() {
    let dir = Dir::new("usage");
    let input = dir.write("in.jsonl", b"{\"prompt\":\"x\"}\n");
    let out = dir.path("out.jsonl");
    let (i, o_) = (input.to_str().unwrap(), out.to_str().unwrap());
    for (args, needle) in [
        (vec!["run", "--model", "sim/x", "--input", i, "--output", o_, "--bogus"], "--bogus"),
        (vec!["run", "--model", "nope", "--input", i, "--output", o_], "provider/model"),
        (vec!["run", "--model", "claude/x", "--input", i, "--output", o_], "unknown provider"),
        (vec!["run", "--model", "sim/x", "--input", i, "--output", o_, "--param", "temprature=1"], "unknown parameter"),
        (vec!["run", "--model", "sim/x", "--input", i, "--output", o_, "--template", "no {field"], "--template"),
        (vec!["run", "--model", "sim/x", "--input", "/nonexistent/in.jsonl", "--output", o_], "cannot read --input"),
        (vec!["run", "--model", "gemini/gemini-2.5-flash", "--input", i, "--output", o_], "GEMINI_API_KEY"),
        (vec!["run", "--model", "openai/m", "--base-url", "http://10.1.2.3/v1", "--input", i, "--output", o_], "https"),
        (vec!["run", "--model", "sim/x", "--input", i, "--output", o_, "--max-concurrency", "0"], "--max-concurrency"),
        (vec!["run", "--model", "sim/x", "--input", i, "--output", o_, "--timeout", "0"], "--timeout"),
    ] {
        let o = run(&args).await;
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
        assert!(!out.exists(), "{args:?} wrote output");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_credentials_stop_early_with_exit_3_then_resume() {
    let server = sim(SimConfig { api_keys: vec!["right".into()], ..SimConfig::default() }).await;
    let dir = Dir::new("auth");
    let (data, ids) = prompts(5_000);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let args = [
        "run",
        "--model",
        "gemini/m",
        "--base-url",
        &server.url(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "key",
        "--max-concurrency",
        "4",
    ];
    // Without state, every record gets a row: the rejected ones and the ones never tried.
    let o =
        util::weir().args(args).arg("--no-state").env("GEMINI_API_KEY", "wrong-secret-value").output().await.unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("the credentials failed on the first"), "{err}");
    assert!(!err.contains("wrong-secret-value"), "the key must not be printed");
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_each_id_once(&ids, &[], &errors);
    assert!(errors.iter().all(|e| e["kind"] == "auth" || e["kind"] == "aborted"));
    assert!(server.stats().requests <= 10, "stopped early");
    assert!(!std::fs::read_to_string(dir.path("out.errors.jsonl")).unwrap().contains("wrong-secret-value"));

    // With state (the default), the run stops the same way and the next run, with the right
    // key, finishes the job: each id exactly once. (The --no-state run's errors file is not
    // this run's: replacing it takes --overwrite.)
    let o = util::weir().args(args).env("GEMINI_API_KEY", "wrong-secret-value").output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--overwrite"), "{}", stderr(&o));
    let o =
        util::weir().args(args).arg("--overwrite").env("GEMINI_API_KEY", "wrong-secret-value").output().await.unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("run the same command again to resume"), "{}", stderr(&o));
    let o = util::weir().args(args).env("GEMINI_API_KEY", "right").output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("Resuming:"), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    assert!(rows(&dir.path("out.errors.jsonl")).is_empty());
    for dir in std::fs::read_dir(&dir.0).unwrap() {
        let p = dir.unwrap().path();
        if p.is_file() {
            assert!(!std::fs::read_to_string(&p).unwrap_or_default().contains("wrong-secret-value"), "{p:?}");
        }
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_to_stdout_with_template_system_and_params() {
    use tokio::io::AsyncWriteExt;
    let dir = Dir::new("stdio");
    let mut child = util::weir()
        .args([
            "run",
            "--model",
            "sim/x",
            "--input",
            "-",
            "--output",
            "-",
            "--errors",
            dir.path("e.jsonl").to_str().unwrap(),
            "--template",
            "Translate {text} into {lang}.",
            "--system",
            "Be terse.",
            "--param",
            "max_tokens=3",
            "--param",
            "temperature=0",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"{\"text\":\"hello\",\"lang\":\"French\"}\n{\"text\":\"bye\"}\n").await.unwrap();
    drop(stdin);
    let o = child.wait_with_output().await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out: Vec<Value> =
        String::from_utf8(o.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0]["finish_reason"], "length");
    assert_eq!(out[0]["usage"]["output_tokens"], 3);
    // "Be terse." + "Translate hello into French." = 9 + 1 + 28 chars → 10 tokens at 4 chars each.
    assert_eq!(out[0]["usage"]["prompt_tokens"], 10);
    let errors = rows(&dir.path("e.jsonl"));
    assert_eq!(errors.len(), 1);
    assert!(errors[0]["message"].as_str().unwrap().contains("'lang'"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_record_may_carry_its_own_system_text_and_parameters() {
    let dir = Dir::new("per-record");
    let input = dir.write(
        "in.jsonl",
        concat!(
            "{\"text\":\"aaaaaaaa\",\"sys\":\"SSSSSSSSSSSSSSS\",\"p\":{\"max_tokens\":2}}\n",
            "{\"text\":\"bbbbbbbb\"}\n",
            "{\"text\":\"cccccccc\",\"p\":{\"max_tokns\":2}}\n",
            "{\"text\":\"dddddddd\",\"sys\":5}\n",
            "{\"text\":\"eeeeeeee\",\"sys\":null,\"p\":{\"max_tokens\":1,\"temperature\":0}}\n",
        )
        .as_bytes(),
    );
    let out = dir.path("out.jsonl");
    let o = util::weir()
        .args(["run", "--model", "sim/x", "--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .args(["--prompt-field", "text", "--system", "Be terse.", "--param", "max_tokens=3"])
        .args(["--system-field", "sys", "--params-field", "p"])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let by_line = |rows: &[Value], line: u64| rows.iter().find(|r| r["line"] == line).cloned().unwrap();
    let results = rows(&out);
    assert_eq!(results.len(), 3);
    // The record's own system text (15 chars) and max_tokens; the sim counts 4 chars a token.
    let r1 = by_line(&results, 1);
    assert_eq!((r1["usage"]["prompt_tokens"].as_u64(), r1["usage"]["output_tokens"].as_u64()), (Some(6), Some(2)));
    // The run's: "Be terse." (9 chars) and max_tokens=3.
    let r2 = by_line(&results, 2);
    assert_eq!((r2["usage"]["prompt_tokens"].as_u64(), r2["usage"]["output_tokens"].as_u64()), (Some(5), Some(3)));
    // A null field means the run's system text; the record's parameters still apply.
    let r5 = by_line(&results, 5);
    assert_eq!((r5["usage"]["prompt_tokens"].as_u64(), r5["usage"]["output_tokens"].as_u64()), (Some(5), Some(1)));
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 2);
    let e3 = by_line(&errors, 3)["message"].as_str().unwrap().to_string();
    assert!(e3.contains("line 3") && e3.contains("max_tokns"), "{e3}");
    let e4 = by_line(&errors, 4)["message"].as_str().unwrap().to_string();
    assert!(e4.contains("line 4") && e4.contains("not a string"), "{e4}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daily_quota_stops_the_run_and_the_next_day_resumes() {
    let mut config = SimConfig::default();
    config.quota.requests_per_day = 50;
    config.quota.day_secs = 1.0;
    let server = sim(config).await;
    let dir = Dir::new("daily");
    let (data, ids) = prompts(120);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let args = [
        "run",
        "--model",
        "gemini/m",
        "--base-url",
        &server.url(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "key",
        "--max-concurrency",
        "4",
    ];
    let o = run(&args).await;
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("per-day quota"), "{}", stderr(&o));
    assert_eq!(rows(&out).len(), 50);
    let mut runs = 1;
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        let o = run(&args).await;
        runs += 1;
        assert!(stderr(&o).contains("Resuming:"), "{}", stderr(&o));
        if o.status.code() == Some(0) {
            break;
        }
        assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
        assert!(runs < 6);
    }
    assert_eq!(runs, 3, "50 + 50 + 20");
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
    // One call per record: the quota refusals were the only extra calls.
    let s = server.stats();
    assert_eq!(s.successes, 120);
    assert!(s.rate_limited <= 10, "{s:?}");
    server.shutdown().await;
}

/// `/metrics` during a run: every series labelled by the model and the endpoint it is about,
/// so a run that calls two models (`--model-field`) shows each one's calls and limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_in_the_prometheus_format_during_a_run() {
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 100.0;
    let server = sim(config).await;
    let dir = Dir::new("metrics");
    let mut data = String::new();
    // Records no model answers (first, so they are done when /metrics is read): counted as no
    // model's failures, not the run's model's.
    data.push_str(
        "{\"id\":\"bad1\",\"prompt\":\"x\",\"m\":\"nosuch/x\"}\n{\"id\":\"bad2\",\"prompt\":\"x\",\"m\":7}\n",
    );
    for i in 0..300 {
        let model = if i % 2 == 0 { "gemini/m" } else { "gemini/n" };
        data.push_str(&format!("{{\"id\":\"r{i}\",\"prompt\":\"p {i}\",\"m\":\"{model}\"}}\n"));
    }
    let input = dir.write("in.jsonl", data.as_bytes());
    let out = dir.path("out.jsonl");
    let port = util::free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let child = util::weir()
        .args([
            "run",
            "--model",
            "gemini/m",
            "--model-field",
            "m",
            "--base-url",
            &server.url(),
            "--input",
            input.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--max-concurrency",
            "8",
            "--metrics-listen",
            &listen,
        ])
        .spawn()
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let text = reqwest::get(format!("http://{listen}/metrics")).await.unwrap().text().await.unwrap();
    for name in [
        "# TYPE weir_tokens_total counter",
        "# TYPE weir_call_seconds histogram",
        "weir_call_seconds_bucket{",
        "weir_throttled_microseconds_total{",
        "weir_rate_limited_total{",
        "weir_batches_total{",
        "weir_batch_items_total{",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    let endpoint = format!("endpoint=\"{}", server.url());
    // A series of `name` about `model`, labelled with the endpoint too, and its value.
    let series = |name: &str, model: &str, more: &str| -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .find(|l| l.contains(&format!("model=\"{model}\"")) && l.contains(&endpoint) && l.contains(more))?
            .rsplit_once(' ')?
            .1
            .trim()
            .parse()
            .ok()
    };
    for model in ["gemini/m", "gemini/n"] {
        let calls = series("weir_calls_total", model, "").unwrap_or_else(|| panic!("{model}: no calls in:\n{text}"));
        assert!(calls > 0.0, "{model}: {calls} calls");
        assert!(series("weir_records_total", model, "outcome=\"success\"").is_some(), "{model}:\n{text}");
        assert!(series("weir_concurrency_limit", model, "").is_some(), "{model}: no gauge in:\n{text}");
    }
    assert_eq!(series("weir_records_total", "gemini/m", "outcome=\"failure\""), Some(0.0), "{text}");
    let unrouted = text
        .lines()
        .find(|l| l.starts_with("weir_records_total{") && l.contains("model=\"none\"") && l.contains("failure"))
        .unwrap_or_else(|| panic!("no model=\"none\" failures in:\n{text}"));
    assert!(unrouted.ends_with(" 2"), "{unrouted}");
    // Every series says which model it is about: none is left without the labels.
    for l in text.lines().filter(|l| l.starts_with("weir_") && !l.starts_with("weir_call_seconds_")) {
        assert!(l.contains("model=\"") && l.contains("endpoint=\""), "a series without its model: {l}");
    }
    let o = child.wait_with_output().await.unwrap();
    // Exit 1: the two records no model answers failed.
    assert_eq!(o.status.code(), Some(1));
    server.shutdown().await;
}

/// `--model-field` sends each record to its own model (one throttle each); records without the
/// field use --model; a bad model name is that record's `invalid_input` row, not the run's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_field_routes_each_record_to_its_model() {
    let dir = Dir::new("model-field");
    let mut data = String::new();
    for i in 0..30 {
        let m = match i % 3 {
            0 => ",\"m\":\"sim/a\"",
            1 => ",\"m\":\"sim/b\"",
            _ => "",
        };
        data.push_str(&format!("{{\"id\":\"r{i}\",\"prompt\":\"p {i}\"{m}}}\n"));
    }
    data.push_str("{\"id\":\"bad1\",\"prompt\":\"x\",\"m\":\"nope\"}\n{\"id\":\"bad2\",\"prompt\":\"x\",\"m\":5}\n");
    let input = dir.write("in.jsonl", data.as_bytes());
    let out = dir.path("out.jsonl");
    let o = run(&[
        "run",
        "--model",
        "sim/demo",
        "--model-field",
        "m",
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "id",
        "--progress",
        "never",
    ])
    .await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let results = rows(&out);
    let errors = rows(&dir.path("out.errors.jsonl"));
    let count = |m: &str| results.iter().filter(|r| r["model"] == m).count();
    assert_eq!((count("sim/a"), count("sim/b"), count("sim/demo")), (10, 10, 10));
    for r in &results {
        let want = r["input"]["m"].as_str().unwrap_or("sim/demo");
        assert_eq!(r["model"], want, "{r}");
    }
    assert_eq!(errors.len(), 2);
    assert!(errors.iter().all(|e| e["kind"] == "invalid_input"), "{errors:?}");
    assert!(errors.iter().any(|e| e["message"].as_str().unwrap().contains("model field 'm': nope")));
    // The summary gives each endpoint's limits, not only --model's.
    for model in ["sim/a", "sim/b"] {
        assert!(stderr(&o).contains(&format!("limits of {model}: concurrency ")), "{}", stderr(&o));
    }
}

/// With `--model-field`, each model's tokens are priced at its own price in the summary, with
/// the sum of them (they were all priced at `--model`'s before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_field_prices_each_models_tokens_at_its_own_price() {
    let sim = weir_sim::SimServer::start(Default::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let dir = Dir::new("model-field-cost");
    let mut data = String::new();
    for i in 0..40 {
        let m = if i % 2 == 0 { "gemini/gemini-2.5-pro" } else { "gemini/gemini-2.5-flash" };
        data.push_str(&format!("{{\"id\":\"r{i}\",\"prompt\":\"price me {i}\",\"m\":\"{m}\"}}\n"));
    }
    let input = dir.write("in.jsonl", data.as_bytes());
    let out = dir.path("out.jsonl");
    let o = run(&[
        "run",
        "--model",
        "gemini/gemini-2.5-flash",
        "--model-field",
        "m",
        "--base-url",
        &sim.url(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "id",
        "--progress",
        "never",
    ])
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    // Each model's dollars from its rows' tokens and its price (prices.toml).
    let mut expected = Vec::new();
    for (model, name, (pin, pout)) in [
        ("gemini/gemini-2.5-flash", "gemini-2.5-flash", (0.30, 2.50)),
        ("gemini/gemini-2.5-pro", "gemini-2.5-pro", (1.25, 10.0)),
    ] {
        let (tin, tout) = rows(&out).iter().filter(|r| r["model"] == model).fold((0u64, 0u64), |(i, o), r| {
            (i + r["usage"]["prompt_tokens"].as_u64().unwrap(), o + r["usage"]["output_tokens"].as_u64().unwrap())
        });
        assert!(tin > 0 && tout > 0, "{model}");
        let usd = (tin as f64 * pin + tout as f64 * pout) / 1e6;
        let line = err
            .lines()
            .find(|l| l.contains("cost:") && l.contains(&format!("({name} at")))
            .unwrap_or_else(|| panic!("no cost line for {name}: {err}"));
        let shown: f64 = line.split('$').nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
        assert!((shown - usd).abs() <= usd * 1e-3 + 1e-6, "{name}: shown {shown}, expected {usd}: {line}");
        expected.push(usd);
    }
    let all = err.lines().find(|l| l.contains("cost in all")).unwrap_or_else(|| panic!("{err}"));
    let shown: f64 = all.split('$').nth(1).unwrap().trim().parse().unwrap();
    let sum: f64 = expected.iter().sum();
    assert!((shown - sum).abs() <= sum * 1e-3 + 1e-6, "{all}");
    sim.shutdown().await;
}

/// The cache keeps answers apart by where they came from: the same model name on another server
/// (a simulator, then the real endpoint) is asked again, never answered from the first one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_does_not_answer_for_another_endpoint() {
    let a = sim(SimConfig { seed: 1, ..SimConfig::default() }).await;
    let b = sim(SimConfig { seed: 2, ..SimConfig::default() }).await;
    let dir = Dir::new("cache-endpoint");
    let (data, ids) = prompts(20);
    let input = dir.write("in.jsonl", &data);
    let go = |url: String, out: &str| {
        let out = dir.path(out);
        let input = input.clone();
        async move {
            let o = util::weir()
                .args(["run", "--model", "gemini/m", "--base-url", &url, "--param", "temperature=0"])
                .args(["--id-field", "key", "--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
                .output()
                .await
                .unwrap();
            assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
            (rows(&out), stderr(&o))
        }
    };
    let (first, _) = go(a.url(), "a.jsonl").await;
    let (second, err) = go(b.url(), "b.jsonl").await;
    assert!(err.contains("0 from cache"), "{err}");
    assert_eq!(b.stats().successes, 20, "every record was asked of the second server");
    assert_each_id_once(&ids, &second, &[]);
    let text = |rows: &[Value], id: &str| rows.iter().find(|r| r["id"] == id).unwrap()["response"].clone();
    assert_ne!(text(&first, "r0"), text(&second, "r0"), "the answers are the second server's own");
    // The same endpoint again: answered from the cache.
    let (_, err) = go(a.url(), "a2.jsonl").await;
    assert!(err.contains("20 from cache"), "{err}");
    a.shutdown().await;
    b.shutdown().await;
}

/// A model or route that does not exist (404) stops the run at once, exit 3, instead of writing
/// an error row for every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_is_not_there_stops_the_run() {
    let server = sim(SimConfig::default()).await;
    let dir = util::Dir::new("run-404");
    let (data, _) = util::prompts(3000);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    // The simulator serves no route under /nothing.
    let base = format!("{}/nothing", server.url());
    let o = util::weir()
        .args(["run", "--model", "gemini/m", "--base-url", &base, "--id-field", "key"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .env("GEMINI_API_KEY", "k")
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("not found"), "{}", stderr(&o));
    assert!(server.stats().requests <= 200, "stopped early: {} calls", server.stats().requests);
    server.shutdown().await;
}
