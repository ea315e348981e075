//! Black-box tests of streaming: `--stream` events (OpenAI and Gemini SSE, cut streams, the
//! cache), `--follow` of a growing file, and stdin that stays open.

mod util;

use serde_json::Value;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use util::*;
use weir_sim::SimConfig;

/// A simulator whose first token comes after 150 ms and every further one 10 ms later.
fn paced() -> SimConfig {
    let mut c = SimConfig { seed: 3, ..SimConfig::default() };
    c.latency.fixed_ms = 150.0;
    c.latency.per_token_ms = 10.0;
    c.output.min_tokens = 12;
    c.output.max_tokens = 20;
    c
}

fn id_of(v: &Value) -> String {
    match &v["id"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// What a consumer of events holds for each id: the text since the last restart, the events
/// seen, the restarts, and the `seq` numbers in order.
#[derive(Default, Debug)]
struct Held {
    text: String,
    seqs: Vec<u64>,
    restarts: usize,
}

fn consume(events: &[Value]) -> HashMap<String, Held> {
    let mut held: HashMap<String, Held> = HashMap::new();
    for e in events {
        let h = held.entry(id_of(e)).or_default();
        h.seqs.push(e["seq"].as_u64().expect("seq"));
        if e["restart"] == true {
            h.restarts += 1;
            h.text.clear();
        } else {
            h.text.push_str(e["delta"].as_str().expect("delta"));
        }
    }
    held
}

/// Both SSE framings, with the events between the rows on stdout: every record's events come
/// in order (seq 0, 1, …), all before its row, make up its answer, and arrive while the answer
/// is generated — the first of a record well before its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arrive_in_order_as_generated_and_before_each_row_openai_and_gemini() {
    let server = sim(paced()).await;
    for (model, base) in [("openai/sim-1", format!("{}/v1", server.url())), ("gemini/sim-1", server.url())] {
        let dir = Dir::new("stream-order");
        let (data, ids) = prompts(20);
        let input = dir.write("in.jsonl", &data);
        let errors = dir.path("errors.jsonl");
        let mut child = weir()
            .args(["run", "--model", model, "--base-url", &base, "--input", input.to_str().unwrap()])
            .args(["--output", "-", "--errors", errors.to_str().unwrap(), "--stream", "--id-field", "key"])
            .args(["--progress", "never"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut seen: Vec<(Instant, Value)> = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            seen.push((Instant::now(), serde_json::from_str(&line).unwrap()));
        }
        let o = child.wait_with_output().await.unwrap();
        assert_eq!(o.status.code(), Some(0), "{model}: {}", stderr(&o));
        let (rows, events): (Vec<_>, Vec<_>) = seen.iter().partition(|(_, v)| v.get("response").is_some());
        let results: Vec<Value> = rows.iter().map(|(_, v)| v.clone()).collect();
        assert_each_id_once(&ids, &results, &[]);
        let events: Vec<Value> = events.iter().map(|(_, v)| v.clone()).collect();
        let held = consume(&events);
        for (at, row) in &rows {
            let id = id_of(row);
            let h = &held[&id];
            assert_eq!(h.restarts, 0, "{model} {id}");
            assert_eq!(h.seqs, (0..h.seqs.len() as u64).collect::<Vec<_>>(), "{model} {id}: seq in order");
            assert!(h.seqs.len() >= 10, "{model} {id}: {} events for 12-20 tokens", h.seqs.len());
            assert_eq!(h.text, row["response"].as_str().unwrap(), "{model} {id}: the events make the answer");
            // No event of this record after its row; its first event well before it.
            let mine: Vec<&(Instant, Value)> = seen.iter().filter(|(_, v)| id_of(v) == id).collect();
            assert!(mine.last().unwrap().1.get("response").is_some(), "{model} {id}: the row comes last");
            let first = mine[0].0;
            assert!(
                *at - first >= Duration::from_millis(60),
                "{model} {id}: first event only {:?} before the row",
                *at - first
            );
        }
        // The summary reports the server's time to first token (150 ms and up).
        let err = stderr(&o);
        let line = err.lines().find(|l| l.contains("time to first token")).unwrap_or_else(|| panic!("{err}"));
        let p50: f64 =
            line.split("time to first token p50 ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!((150.0..600.0).contains(&p50), "{model}: {line}");
        assert!(line.contains("between pieces"), "{line}");
    }
    server.shutdown().await;
}

/// Streams cut part-way (40 % of calls) are made again: the consumer gets a restart event
/// for a record whose text it had, the record's row is written once, and what the consumer
/// holds after the last restart is the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_gives_a_restart_and_exactly_one_row() {
    let mut config = paced();
    config.latency.fixed_ms = 20.0;
    config.latency.per_token_ms = 2.0;
    config.faults.truncate = 0.4;
    let server = sim(config).await;
    let dir = Dir::new("stream-cut");
    let (data, ids) = prompts(40);
    let input = dir.write("in.jsonl", &data);
    let (out, events) = (dir.path("out.jsonl"), dir.path("events.jsonl"));
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
        "--events",
        events.to_str().unwrap(),
        "--id-field",
        "key",
        "--max-retries",
        "20",
        "--progress",
        "never",
    ])
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = rows(&out);
    assert_each_id_once(&ids, &results, &rows(&dir.path("out.errors.jsonl")));
    let held = consume(&rows(&events));
    let mut restarts = 0;
    for r in &results {
        let h = &held[&id_of(r)];
        assert_eq!(h.text, r["response"].as_str().unwrap(), "{}: text after the last restart", id_of(r));
        assert_eq!(h.seqs, (0..h.seqs.len() as u64).collect::<Vec<_>>(), "seq counts every event");
        restarts += h.restarts;
    }
    assert!(restarts >= 5, "40 % of 40+ streams were cut, {restarts} restarts");
    let stats = server.stats();
    assert!(stats.streams as usize > ids.len(), "cut streams were made again: {} streams", stats.streams);
    server.shutdown().await;
}

/// An answer from the response cache is streamed as one event; a finished run streams
/// nothing when run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_answers_come_as_one_event_and_a_finished_run_sends_none() {
    let server = sim(paced()).await;
    let dir = Dir::new("stream-cache");
    let (data, ids) = prompts(10);
    let input = dir.write("in.jsonl", &data);
    let (out, events) = (dir.path("out.jsonl"), dir.path("events.jsonl"));
    let base = format!("{}/v1", server.url());
    let args = |extra: &[&str]| {
        let mut a: Vec<String> = [
            "run",
            "--model",
            "openai/sim-1",
            "--base-url",
            &base,
            "--input",
            input.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--events",
            events.to_str().unwrap(),
            "--param",
            "temperature=0",
            "--progress",
            "never",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let first = weir().args(args(&[])).output().await.unwrap();
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    let streamed = rows(&events).len();
    assert!(streamed >= 10 * 10, "{streamed} events");
    let calls = server.stats().requests;
    // The same command again: everything is finished, nothing is streamed or called.
    let again = weir().args(args(&[])).output().await.unwrap();
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    assert!(stderr(&again).contains("Resuming: 10 of 10 finished"), "{}", stderr(&again));
    assert_eq!(rows(&events).len(), streamed);
    // Started over: the cache answers, one whole event per record, no call.
    let fresh = weir().args(args(&["--fresh"])).output().await.unwrap();
    assert_eq!(fresh.status.code(), Some(0), "{}", stderr(&fresh));
    assert_eq!(server.stats().requests, calls, "no call: the cache answered");
    let results = rows(&out);
    let events = rows(&events);
    assert_eq!(events.len(), 10, "one event per cached answer");
    let texts: HashMap<String, String> =
        results.iter().map(|r| (id_of(r), r["response"].as_str().unwrap().to_string())).collect();
    for e in &events {
        assert_eq!(e["seq"], 0);
        assert_eq!(e["delta"].as_str().unwrap(), texts[&id_of(e)]);
    }
    assert_eq!(results.len(), ids.len());
    server.shutdown().await;
}

async fn wait_rows(path: &std::path::Path, n: usize, within: Duration) -> Vec<Value> {
    let end = Instant::now() + within;
    loop {
        let r = rows(path);
        if r.len() >= n || Instant::now() > end {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn append(path: &std::path::Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

fn line(id: &str) -> String {
    format!("{{\"id\":\"{id}\",\"prompt\":\"Tell me about {id}\"}}\n")
}

/// `--follow`: records appended to the file are answered as they come; a half-written last
/// line waits for its newline; Ctrl-C drains and stops; the same command goes on from where
/// it stopped, calling only for the new lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followed_file_is_answered_as_it_grows_and_resumed_where_it_stopped() {
    let server = sim(SimConfig { seed: 5, ..SimConfig::default() }).await;
    let dir = Dir::new("follow");
    let input = dir.write("in.jsonl", (line("a") + &line("b") + &line("c")).as_bytes());
    let out = dir.path("out.jsonl");
    let base = format!("{}/v1", server.url());
    let spawn = || {
        weir()
            .args(["run", "--model", "openai/sim-1", "--base-url", &base, "--follow", input.to_str().unwrap()])
            .args(["--output", out.to_str().unwrap(), "--id-field", "id", "--progress", "never"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let child = spawn();
    assert_eq!(wait_rows(&out, 3, Duration::from_secs(10)).await.len(), 3);
    let appended = Instant::now();
    append(&input, &(line("d") + &line("e")));
    assert_eq!(wait_rows(&out, 5, Duration::from_secs(10)).await.len(), 5);
    assert!(appended.elapsed() < Duration::from_secs(2), "appended lines answered in {:?}", appended.elapsed());
    // Half a line: not a record yet.
    append(&input, "{\"id\":\"f\",\"prompt\":");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(rows(&out).len(), 5);
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let o = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(stderr(&o).contains("run the same command again"), "{}", stderr(&o));
    assert_eq!(server.stats().requests, 5);
    // The rest of the half line, and one more; then the same command again.
    append(&input, &("\"Tell me about f\"}\n".to_string() + &line("g")));
    let child = spawn();
    let results = wait_rows(&out, 7, Duration::from_secs(10)).await;
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let o = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(143), "SIGTERM drains as Ctrl-C does, exit 128 + 15: {}", stderr(&o));
    assert!(stderr(&o).contains("Resuming: 5 finished"), "{}", stderr(&o));
    let ids: Vec<String> = ["a", "b", "c", "d", "e", "f", "g"].iter().map(|s| s.to_string()).collect();
    assert_each_id_once(&ids, &results, &rows(&dir.path("out.errors.jsonl")));
    assert_eq!(server.stats().requests, 7, "the second run called only for the new lines");
    // Another file put in its place (or the file truncated and written anew) is another input:
    // resuming from it would skip or repeat records by line number, so it is refused.
    let other = dir.write("other.jsonl", (line("h") + &line("i")).as_bytes());
    std::fs::rename(&other, &input).unwrap();
    let o = tokio::time::timeout(Duration::from_secs(20), spawn().wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("different run"), "{}", stderr(&o));
    std::fs::write(&input, line("j")).unwrap();
    let o = tokio::time::timeout(Duration::from_secs(20), spawn().wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(2), "a file truncated and written anew: {}", stderr(&o));
    assert_eq!(server.stats().requests, 7);
    server.shutdown().await;
}

/// An empty followed file is waited on until its first line is written (it identifies the
/// file for a resume); one Ctrl-C while waiting ends the run, having done nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_followed_file_waits_for_its_first_line() {
    let dir = Dir::new("follow-empty");
    let input = dir.write("in.jsonl", b"");
    let out = dir.path("out.jsonl");
    let spawn = || {
        weir()
            .args(["run", "--model", "sim/demo", "--follow", input.to_str().unwrap()])
            .args(["--output", out.to_str().unwrap(), "--id-field", "id", "--progress", "never"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let child = spawn();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(std::process::Command::new("kill")
        .args(["-INT", &child.id().unwrap().to_string()])
        .status()
        .unwrap()
        .success());
    let o = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(stderr(&o).contains("waiting for the first line"), "{}", stderr(&o));
    let child = spawn();
    tokio::time::sleep(Duration::from_millis(300)).await;
    append(&input, &line("a"));
    assert_eq!(wait_rows(&out, 1, Duration::from_secs(10)).await.len(), 1);
    assert!(std::process::Command::new("kill")
        .args(["-INT", &child.id().unwrap().to_string()])
        .status()
        .unwrap()
        .success());
    let o = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
}

/// With the events on stdout, a record that fails after its text began streaming ends with an
/// `error` event, so a consumer of stdout alone knows it ended (its error row is in the errors
/// file); one that never streamed gets one too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_record_ends_its_events_with_an_error_event() {
    let mut config = paced();
    config.latency.fixed_ms = 5.0;
    config.latency.per_token_ms = 1.0;
    config.faults.truncate = 1.0;
    let server = sim(config).await;
    let dir = Dir::new("stream-failed");
    let (data, ids) = prompts(6);
    let input = dir.write("in.jsonl", &data);
    let errors = dir.path("errors.jsonl");
    let o = run(&[
        "run",
        "--model",
        "openai/sim-1",
        "--base-url",
        &format!("{}/v1", server.url()),
        "--input",
        input.to_str().unwrap(),
        "--output",
        "-",
        "--errors",
        errors.to_str().unwrap(),
        "--stream",
        "--id-field",
        "key",
        "--max-retries",
        "1",
        "--progress",
        "never",
    ])
    .await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let lines: Vec<Value> =
        String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_each_id_once(&ids, &[], &rows(&errors));
    for id in &ids {
        let mine: Vec<&Value> = lines.iter().filter(|v| id_of(v) == *id).collect();
        let last = mine.last().unwrap_or_else(|| panic!("no events for {id}"));
        assert_eq!(last["error"]["kind"], "transport", "{id}: {last}");
        assert!(mine.iter().any(|v| v.get("delta").is_some()), "{id}: text streamed before the cut");
        assert_eq!(last["seq"].as_u64().unwrap() as usize, mine.len() - 1);
    }
    server.shutdown().await;
}

/// A FIFO for the events with nothing reading it: weir says it is waiting, and one Ctrl-C
/// ends the run before anything is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_events_fifo_without_a_reader_is_waited_on_and_interruptible() {
    let dir = Dir::new("stream-fifo");
    let input = dir.write("in.jsonl", line("a").as_bytes());
    let fifo = dir.path("events.fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let out = dir.path("out.jsonl");
    let child = weir()
        .args(["run", "--model", "sim/demo", "--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .args(["--events", fifo.to_str().unwrap(), "--progress", "never"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(std::process::Command::new("kill")
        .args(["-INT", &child.id().unwrap().to_string()])
        .status()
        .unwrap()
        .success());
    let o = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(stderr(&o).contains("waiting for something to read the FIFO --events"), "{}", stderr(&o));
    assert!(rows(&out).is_empty());
}

/// `weir run --input - --output -` on `sim/demo` with its stdin and stdout piped.
fn pipe_run(dir: &Dir) -> tokio::process::Child {
    weir()
        .args(["run", "--model", "sim/demo", "--input", "-", "--output", "-", "--progress", "never"])
        .args(["--errors", dir.path("errors.jsonl").to_str().unwrap(), "--id-field", "id"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// `--input -` from a pipe that stays open: each record's row is written as soon as it is
/// answered, not when the input ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_an_open_pipe_come_out_as_records_go_in() {
    let dir = Dir::new("pipe");
    let mut child = pipe_run(&dir);
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    for id in ["x1", "x2", "x3"] {
        stdin.write_all(line(id).as_bytes()).await.unwrap();
        stdin.flush().await.unwrap();
        let row = tokio::time::timeout(Duration::from_secs(5), out.next_line())
            .await
            .unwrap_or_else(|_| panic!("no row for {id} while the pipe is open"))
            .unwrap()
            .unwrap();
        let row: Value = serde_json::from_str(&row).unwrap();
        assert_eq!(row["id"], id);
    }
    drop(stdin);
    assert!(out.next_line().await.unwrap().is_none());
    let o = child.wait_with_output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));

    // Ctrl-C while the pipe is still open: the run stops reading and ends, without a second
    // press (with --output - there is no journal, and a pipe that never ends cannot be read
    // to its end).
    let mut child = pipe_run(&dir);
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(line("y1").as_bytes()).await.unwrap();
    stdin.flush().await.unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(5), out.next_line()).await.unwrap().unwrap().unwrap();
    assert!(first.contains("\"y1\""), "{first}");
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let o = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("one Ctrl-C ends a run over an open pipe")
        .unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    drop(stdin);
}

/// Flags that cannot go together are refused with what to do (exit 2), before anything is
/// written.
#[tokio::test]
async fn stream_and_follow_usage_errors() {
    let dir = Dir::new("stream-usage");
    let input = dir.write("in.jsonl", line("a").as_bytes());
    let (i, out) = (input.to_str().unwrap(), dir.path("out.jsonl"));
    let o_ = out.to_str().unwrap();
    let csv = dir.write("t.csv", b"id,prompt\na,hi\n");
    let missing = dir.path("missing.jsonl");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--input", i, "--output", o_, "--stream"], "add --events"),
        (vec!["--input", i, "--output", "-", "--stream", "--task", "embed"], "an embedding comes whole"),
        (vec!["--input", i, "--output", o_, "--events", "e.jsonl", "--mode", "batch"], "batch jobs answer"),
        (vec!["--follow", "-", "--output", o_], "use --input -"),
        (vec!["--follow", missing.to_str().unwrap(), "--output", o_], "does not exist"),
        (vec!["--follow", csv.to_str().unwrap(), "--output", o_], "follows a local JSONL file"),
        (vec!["--follow", "s3://bucket/x.jsonl", "--output", o_], "follows a local file"),
        (vec!["--input", i, "--output", o_, "--events", "e.jsonl", "--task", "embed"], "--stream/--events"),
        (vec!["--follow", i, "--input", i, "--output", o_], "cannot be used with"),
        (vec!["--output", o_], "--input"),
        (vec!["--input", i, "--output", o_, "--events", i], "are the same file"),
    ];
    for (args, want) in cases {
        let mut all = vec!["run", "--model", "sim/demo"];
        all.extend(&args);
        let o = run(&all).await;
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{args:?}: wanted {want:?} in {}", stderr(&o));
        assert!(!out.exists(), "{args:?} wrote the output");
    }
}

/// `--metrics-listen` exports the streams' time to first token and inter-token latency as
/// histograms while the run goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_latencies_are_histograms_at_metrics() {
    let server = sim(paced()).await;
    let dir = Dir::new("stream-metrics");
    let (data, _) = prompts(200);
    let input = dir.write("in.jsonl", &data);
    let port = free_port();
    let mut child = weir()
        .args(["run", "--model", "openai/sim-1", "--base-url", &format!("{}/v1", server.url())])
        .args(["--input", input.to_str().unwrap(), "--output", dir.path("out.jsonl").to_str().unwrap()])
        .args(["--events", dir.path("ev.jsonl").to_str().unwrap(), "--max-concurrency", "4"])
        .args(["--concurrency", "fixed", "--metrics-listen", &format!("127.0.0.1:{port}"), "--progress", "never"])
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    let mut text = String::new();
    while Instant::now() < end {
        if let Ok(r) = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
            text = r.text().await.unwrap_or_default();
            if text.contains("weir_time_to_first_token_seconds_bucket")
                && text.contains("weir_inter_token_seconds_bucket")
            {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = child.start_kill();
    let bucket = |name: &str, le: &str| {
        text.lines()
            // The run's one model: its series (labelled by model and endpoint) for bucket `le`.
            .find(|l| l.starts_with(&format!("{name}_bucket{{")) && l.contains(&format!("le=\"{le}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} bucket {le} in {text}"))
    };
    // First tokens come after 150 ms: none under 0.1 s, some under 0.3 s.
    assert_eq!(bucket("weir_time_to_first_token_seconds", "0.1"), 0.0);
    assert!(bucket("weir_time_to_first_token_seconds", "0.3") > 0.0);
    // Pieces come 10 ms apart: most under 20 ms, none under 1 ms.
    assert_eq!(bucket("weir_inter_token_seconds", "0.001"), 0.0);
    assert!(bucket("weir_inter_token_seconds", "0.02") > 0.0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_of_the_events_that_goes_away_is_said_and_every_row_is_written() {
    // `--events - | head -1`: the events after the reader went are dropped, which nothing said.
    let dir = Dir::new("stream-events-reader-gone");
    let (data, ids) = prompts(2000);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let mut child = weir()
        .args(["run", "--model", "sim/demo", "--stream", "--events", "-", "--id-field", "key"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap(), "--progress", "never"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut events = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(events.next_line().await.unwrap().is_some_and(|l| l.contains("\"seq\":0")));
    drop(events);
    let o = child.wait_with_output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("the reader of --events went away"), "{err}");
    assert_each_id_once(&ids, &rows(&out), &rows(&dir.path("out.errors.jsonl")));
}
