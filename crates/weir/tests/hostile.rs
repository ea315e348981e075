//! Regression tests for the defects of issue #29, found by trying tables, streams, batch jobs
//! and SQL as a hurried, unlucky or hostile user would: one test per item, on the built binary.

mod util;

use std::path::Path;
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use util::*;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `weir run --model sim/demo --progress never` run in `dir`, with `args` (input, output, …).
fn demo(dir: &Dir, args: &[&str]) -> tokio::process::Command {
    let mut c = weir();
    c.current_dir(&dir.0).args(["run", "--model", "sim/demo", "--progress", "never"]).args(args);
    c
}

/// 14. Runs on one output started at the same moment: one writes, the others are refused or
///     find the work done, and no refused run removes what the winner made. (A refused run
///     used to remove, by path, the files it believed it had created: 2 times in 250 pairs
///     the winner exited 0 and its output was gone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_started_together_never_remove_the_winners_output() {
    let (data, ids) = prompts(20);
    let rounds: usize = std::env::var("WEIR_RACE_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(40);
    for round in 0..rounds {
        let dir = Dir::new("race");
        dir.write("in.jsonl", &data);
        // JSONL and table outputs, with and without a state directory.
        let (output, extra): (&str, &[&str]) = match round % 3 {
            0 => ("out.jsonl", &[]),
            1 => ("out.jsonl", &["--no-state"]),
            _ => ("out.csv", &[]),
        };
        let starts: Vec<_> = (0..4)
            .map(|_| {
                demo(&dir, &["--input", "in.jsonl", "--output", output])
                    .args(["--id-field", "key"])
                    .args(extra)
                    .output()
            })
            .collect();
        let outs: Vec<_> = futures::future::join_all(starts).await.into_iter().map(Result::unwrap).collect();
        let mut winners = 0;
        for o in &outs {
            match o.status.code() {
                Some(0) => winners += 1,
                // Refused: held by another run, or (without a state directory) already written.
                Some(2) => {}
                c => panic!("round {round}: exit {c:?}: {}", stderr(o)),
            }
        }
        assert!(winners >= 1, "round {round}: nobody ran");
        if output.ends_with(".jsonl") {
            let results = rows(&dir.path(output));
            // With --no-state, a later start writes the output again in full (no resume).
            assert_each_id_once(&ids, &results, &[]);
            assert!(rows(&dir.path("out.errors.jsonl")).is_empty());
        } else {
            let parts: Vec<_> =
                walk(&dir.path(output)).into_iter().filter(|p| p.extension().is_some_and(|e| e == "csv")).collect();
            let lines: usize = parts.iter().map(|p| std::fs::read_to_string(p).unwrap().lines().count() - 1).sum();
            assert_eq!(lines, ids.len(), "round {round}: {} parts in {}", parts.len(), s(&dir.0));
        }
    }
}

/// 14, made certain: run B looks for its errors file before run A creates it, and claims it
/// after A holds it (B's output is a FIFO it waits on in between). B is refused; it used to
/// remove A's errors file on the way out, and A's error rows then went to a file nobody
/// could see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_run_never_removes_a_file_another_run_made_meanwhile() {
    let dir = Dir::new("race-fifo");
    let (data, _) = prompts(5);
    dir.write("in.jsonl", &data);
    let fifo = dir.path("out.fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let errors = dir.path("e.jsonl");
    let mut b = demo(&dir, &["--input", "in.jsonl", "--output", s(&fifo), "--errors", s(&errors)])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut b_err = tokio::io::BufReader::new(b.stderr.take().unwrap()).lines();
    let line = b_err.next_line().await.unwrap().unwrap_or_default();
    assert!(line.contains("waiting for something to read the FIFO"), "{line}");
    assert!(!errors.exists());
    // A makes and holds the errors file, reading its records from a pipe it keeps open.
    let mut a = demo(&dir, &["--input", "-", "--output", "a.jsonl", "--errors", s(&errors)])
        .args(["--id-field", "key"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for _ in 0..500 {
        if errors.exists() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(errors.exists(), "A made its errors file");
    // Now B goes on, and is refused the errors file.
    let reader = std::fs::File::open(&fifo).unwrap();
    let b = b.wait_with_output().await.unwrap();
    let mut rest = String::new();
    while let Ok(Some(l)) = b_err.next_line().await {
        rest.push_str(&l);
    }
    drop(reader);
    assert_eq!(b.status.code(), Some(2), "{rest}");
    assert!(rest.contains("another weir run is writing"), "{rest}");
    assert!(errors.exists(), "B removed the errors file A holds");
    // A's records, one refused by the model, land in files that are there.
    let mut stdin = a.stdin.take().unwrap();
    stdin
        .write_all(b"{\"key\": \"ok\", \"prompt\": \"hi\"}\n{\"key\": \"bad\", \"prompt\": \"[sim:block_prompt]\"}\n")
        .await
        .unwrap();
    drop(stdin);
    let a = a.wait_with_output().await.unwrap();
    assert_eq!(a.status.code(), Some(1), "{}", stderr(&a));
    assert_eq!(rows(&dir.path("a.jsonl")).len(), 1);
    let errs = rows(&errors);
    assert_eq!(errs.len(), 1, "A's error row is in the file at its path");
    assert_eq!(errs[0]["id"], "bad");
}

/// 1. A local Parquet or CSV table reads as one table at every moment of a run killed
///    repeatedly with parts over 10 MiB: a part being written is hidden until complete (the
///    object store's `NAME#1` staging file used to appear inside the table, so readers failed
///    on it, and a kill left it there for good), and a resume clears what a kill left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_table_reads_as_one_table_at_every_moment_of_a_killed_run() {
    use std::time::Duration;
    let Some(py) = peer("WEIR_PYTHON") else { return };
    for format in ["parquet", "csv"] {
        let mut config = weir_sim::SimConfig::default();
        config.latency.fixed_ms = 20.0;
        let server = sim(config).await;
        let dir = Dir::new(&format!("hidden-staging-{format}"));
        const N: usize = 8_000;
        let blob = "x".repeat(4_000);
        let mut data = Vec::new();
        for i in 0..N {
            data.extend(
                serde_json::to_vec(
                    &serde_json::json!({"key": format!("k{i}"), "prompt": format!("p {i}"), "blob": blob}),
                )
                .unwrap(),
            );
            data.push(b'\n');
        }
        dir.write("in.jsonl", &data);
        let out = dir.path(&format!("out.{format}"));
        let url = server.url();
        let args = [
            "run",
            "--model",
            "gemini/m",
            "--base-url",
            &url,
            "--input",
            "in.jsonl",
            "--output",
            s(&out),
            "--id-field",
            "key",
            "--max-concurrency",
            "8",
            "--progress",
            "never",
            "--checkpoint-secs",
            "60",
        ];
        // A reader that reads the directory as one table over and over while weir writes it.
        let stop = dir.path("stop");
        let mut watcher = std::process::Command::new(&py)
            .arg("-c")
            .arg(
                r#"
import os, sys, time, pyarrow.dataset as ds
out, stop, fmt = sys.argv[1:4]
reads = bad = 0
while not os.path.exists(stop):
    if os.path.isdir(out):
        try:
            ds.dataset(out, format=fmt).to_table()
            reads += 1
        except Exception as e:
            bad += 1
            print("unreadable:", e, sorted(os.listdir(out)), flush=True)
    time.sleep(0.02)
print("reads", reads, "bad", bad, flush=True)
os._exit(0)
"#,
            )
            .args([s(&out), s(&stop), format])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let watched = watcher.stdout.take().unwrap();
        // Killed with the test if it fails.
        let _watcher = Emulator { child: watcher, url: String::new() };
        for kill in 0..2 {
            let mut child = weir().current_dir(&dir.0).args(args).stderr(Stdio::null()).spawn().unwrap();
            // Long enough for the part to pass 10 MiB (2,600 rows of 4 KB at about 400 a
            // second), never for the run to end (the cache answers what a kill lost at once).
            tokio::time::sleep(Duration::from_millis(7_000)).await;
            assert!(child.try_wait().unwrap().is_none(), "{format}: kill {kill}: the run ended first");
            child.start_kill().unwrap();
            child.wait().await.unwrap();
        }
        let o = weir().current_dir(&dir.0).args(args).output().await.unwrap();
        assert_eq!(o.status.code(), Some(0), "{format}: {}", stderr(&o));
        std::fs::write(&stop, b"").unwrap();
        let watched = std::io::read_to_string(watched).unwrap();
        assert!(watched.contains(" bad 0"), "{format}: {watched}");
        let names: Vec<String> =
            std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().all(|n| !n.contains('#') && !n.ends_with(".partial")), "{format}: {names:?}");
        let counted = python(
            r#"
import sys, collections, pyarrow.dataset as ds
keys = ds.dataset(sys.argv[1], format=sys.argv[2]).to_table(columns=["key"]).column("key").to_pylist()
c = collections.Counter(keys)
print(len(keys), len(c), max(c.values()))
"#,
            &[s(&out), format],
        );
        assert_eq!(counted.trim(), format!("{N} {N} 1"), "{format}: rows, ids, most copies of one id");
        server.shutdown().await;
    }
}

/// 3 and 4. What pandas writes for a `category` column (dictionary-encoded) and for a
/// tz-aware datetime (a named time zone) goes through to every output: those used to crash
/// table outputs after the calls were paid for, and fail every record into JSONL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pandas_categories_and_named_time_zones_go_through() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let dir = Dir::new("pandas-types");
    let input = dir.path("in.parquet");
    python(
        r#"
import sys, pandas as pd
n = 50
df = pd.DataFrame({
    "key": [f"k{i}" for i in range(n)],
    "prompt": pd.Categorical([f"say {i % 3}" for i in range(n)]),
    "colour": pd.Categorical(["red", "green"] * (n // 2)),
    "at": pd.date_range("2026-01-01", periods=n, freq="h", tz="America/New_York"),
    "utc": pd.date_range("2026-01-01", periods=n, freq="h", tz="UTC"),
})
df.to_parquet(sys.argv[1])
"#,
        &[s(&input)],
    );
    for output in ["out.parquet", "out.csv", "out.jsonl"] {
        let o = demo(&dir, &["--input", s(&input), "--output", output, "--id-field", "key"]).output().await.unwrap();
        assert_eq!(o.status.code(), Some(0), "{output}: {}", stderr(&o));
    }
    let got = python(
        r#"
import sys, pandas as pd, pyarrow.dataset as ds
d = sys.argv[1]
src = pd.read_parquet(d + "/in.parquet").set_index("key")
for name, fmt in [("out.parquet", "parquet"), ("out.csv", "csv")]:
    t = ds.dataset(d + "/" + name, format=fmt).to_table().to_pandas().set_index("key")
    assert len(t) == 50 and t["response"].notna().all(), name
    assert list(t.loc[src.index, "colour"].astype(str)) == list(src["colour"].astype(str)), name
    at = pd.to_datetime(t.loc[src.index, "at"], utc=True)
    assert list(at) == list(src["at"].dt.tz_convert("UTC")), (name, at.iloc[0], src["at"].iloc[0])
import json
rows = [json.loads(l) for l in open(d + "/out.jsonl")]
assert len(rows) == 50 and all(r["response"] for r in rows)
print(rows[0]["input"]["colour"], rows[0]["input"]["at"])
"#,
        &[s(&dir.0)],
    );
    assert!(got.starts_with("red 2026-01-01T00:00:00"), "{got}");
}

/// 9. `--output - | head -1`: the reader going away ends the run as an interrupt does. The
///    records whose rows it never got have error rows (aborted, with their input) in the
///    errors file, and the exit status is that of a closed pipe (141). It used to exit 3 with
///    299 of 300 records in neither file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_accounts_for_every_record_left() {
    let mut config = weir_sim::SimConfig::default();
    config.latency.fixed_ms = 30.0;
    let server = sim(config).await;
    let dir = Dir::new("closed-stdout");
    let (data, ids) = prompts(300);
    dir.write("in.jsonl", &data);
    let url = server.url();
    let mut child = weir()
        .current_dir(&dir.0)
        .args(["run", "--model", "gemini/m", "--base-url", &url, "--input", "in.jsonl", "--output", "-"])
        .args(["--id-field", "key", "--max-concurrency", "4", "--progress", "never"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first: serde_json::Value = serde_json::from_str(&out.next_line().await.unwrap().unwrap()).unwrap();
    drop(out);
    let o = child.wait_with_output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(141), "{err}");
    assert!(err.contains("the output was closed"), "{err}");
    let errors = rows(&dir.path("weir.errors.jsonl"));
    assert!(errors.iter().all(|r| r["kind"] == "aborted" && r["input"]["prompt"].is_string()), "{errors:?}");
    // Rows handed to the pipe before it closed went with the reader: a few at most.
    assert!(errors.len() >= 290, "{} error rows; {err}", errors.len());
    let mut seen: Vec<String> = errors.iter().map(|r| r["id"].as_str().unwrap().to_string()).collect();
    seen.push(first["id"].as_str().unwrap().to_string());
    seen.sort();
    seen.dedup();
    assert!(seen.iter().all(|id| ids.contains(id)));
    server.shutdown().await;
}

/// A reader of stderr that goes away (`weir run … 2>&1 | head -1`): the run goes on and writes
/// every row. Every line to stderr panicked (exit 101): a finished run's summary, and, mid-run,
/// the message that the output was closed, with answered records unwritten and no `aborted`
/// rows for the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stderr_loses_nothing() {
    let dir = Dir::new("closed-stderr");
    let (data, _) = prompts(200);
    dir.write("in.jsonl", &data);
    // Into `output` with stderr closed at once, logging at `log`: every row written, exit 0.
    let at = &dir;
    let finishes = |output: &'static str, log: &'static str| {
        let mut cmd = demo(at, &["--input", "in.jsonl", "--output", output, "--id-field", "key"]);
        cmd.env("WEIR_LOG", log).stderr(Stdio::piped());
        async move {
            let mut child = cmd.spawn().unwrap();
            drop(child.stderr.take());
            assert_eq!(child.wait().await.unwrap().code(), Some(0), "WEIR_LOG={log}");
            assert_eq!(rows(&at.path(output)).len(), 200, "WEIR_LOG={log}");
        }
    };
    finishes("out.jsonl", "warn").await;
    // Log lines too (a pool's warnings, WEIR_LOG=debug): tracing said on stderr that it could
    // not write to stderr, and that panicked.
    finishes("logged.jsonl", "debug").await;
    // With the results on a pipe too, closed after one row: an `aborted` row for the rest.
    let mut child = demo(&dir, &["--input", "in.jsonl", "--output", "-", "--errors", "e.jsonl", "--id-field", "key"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    out.next_line().await.unwrap().unwrap();
    drop(out);
    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), Some(141));
    let errors = rows(&dir.path("e.jsonl"));
    assert!(errors.len() >= 150 && errors.iter().all(|r| r["kind"] == "aborted"), "{} error rows", errors.len());
}

/// A JSONL output another run wrote over since (from another state directory, with
/// `--overwrite`): the first command run again is refused, not resumed over. It said "Resuming:
/// 150 of 200 finished" and kept 150 rows answering the other run's prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jsonl_output_another_run_wrote_since_is_not_resumed_over() {
    let dir = Dir::new("jsonl-written-since");
    let (data, _) = prompts(40);
    dir.write("in.jsonl", &data);
    let (other, _) = prompts(25);
    let other = String::from_utf8(other).unwrap().replace("Tell me about", "ANOTHER prompt about");
    dir.write("other.jsonl", other.as_bytes());
    let mine = ["--input", "in.jsonl", "--output", "out.jsonl", "--id-field", "key"];
    let o = demo(&dir, &mine).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // Run again untouched: resumed, nothing to do.
    let o = demo(&dir, &mine).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("Resuming: 40 of 40"), "{}", stderr(&o));
    // Touched (a copy, a backup tool), and its empty errors file removed: the same rows, resumed.
    let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    std::fs::File::options().append(true).open(dir.path("out.jsonl")).unwrap().set_modified(when).unwrap();
    let errors = dir.path("out.errors.jsonl");
    if std::fs::metadata(&errors).is_ok_and(|m| m.len() == 0) {
        std::fs::remove_file(&errors).unwrap();
    }
    let o = demo(&dir, &mine).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("Resuming: 40 of 40"), "{}", stderr(&o));
    let theirs = ["--input", "other.jsonl", "--output", "out.jsonl", "--id-field", "key"];
    let o = demo(&dir, &theirs).args(["--state", "elsewhere", "--overwrite"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = demo(&dir, &mine).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("changed since this command's last run ended"), "{}", stderr(&o));
    let o = demo(&dir, &mine).arg("--fresh").output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 40);
}

/// 12. Ctrl-C while the reader of `--events` has stopped reading (the writer is blocked on
///     it): the run says so and ends within the drain time; it used to print nothing and
///     wait for the reader for ever. Run again, it resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_is_heard_while_the_events_reader_does_not_read() {
    let dir = Dir::new("blocked-events");
    let (data, ids) = prompts(3_000);
    dir.write("in.jsonl", &data);
    let fifo = dir.path("events.fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let args = [
        "run",
        "--model",
        "sim/demo",
        "--input",
        "in.jsonl",
        "--output",
        "out.jsonl",
        "--id-field",
        "key",
        "--stream",
        "--events",
        s(&fifo),
        "--timeout",
        "3",
        "--progress",
        "never",
    ];
    let child = weir().current_dir(&dir.0).args(args).stderr(Stdio::piped()).spawn().unwrap();
    // A reader that opens the FIFO and never reads: weir fills the pipe and blocks.
    let reader = std::fs::File::open(&fifo).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let started = std::time::Instant::now();
    let o = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("weir ended within the drain time")
        .unwrap();
    drop(reader);
    let err = stderr(&o);
    assert!(started.elapsed() < std::time::Duration::from_secs(12), "{:?}: {err}", started.elapsed());
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("reader"), "{err}");
    // Resumed with a reader that reads: every record once.
    let drain = std::thread::spawn({
        let fifo = fifo.clone();
        move || std::io::copy(&mut std::fs::File::open(fifo).unwrap(), &mut std::io::sink())
    });
    let o = weir().current_dir(&dir.0).args(args).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    drop(drain);
    assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &rows(&dir.path("out.errors.jsonl")));
}

/// 18. `--mode auto` says when it runs online at the full price (stdin, --model-field, a
///     model without jobs), and with `--stream` it runs online instead of refusing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mode_says_when_it_runs_online() {
    let server = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("auto-online");
    let (data, _) = prompts(20);
    dir.write("in.jsonl", &data);
    let base = format!("{}/v1", server.url());
    let common = ["run", "--model", "openai/gpt-4o-mini", "--base-url", &base, "--mode", "auto", "--progress", "never"];
    // From stdin: not counted, so online.
    let mut child = weir()
        .current_dir(&dir.0)
        .args(common)
        .args(["--input", "-", "--output", "a.jsonl", "--id-field", "key"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&data).await.unwrap();
    drop(stdin);
    let o = child.wait_with_output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("--mode auto: a stream of records → online calls"), "{}", stderr(&o));
    // Several models.
    let o = weir()
        .current_dir(&dir.0)
        .args(common)
        .args(["--input", "in.jsonl", "--output", "b.jsonl", "--id-field", "key", "--model-field", "m"])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("online calls at the full price: --model-field"), "{}", stderr(&o));
    // Streamed: online.
    let o = weir()
        .current_dir(&dir.0)
        .args(common)
        .args(["--input", "in.jsonl", "--output", "c.jsonl", "--id-field", "key", "--stream", "--events", "e.jsonl"])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("--mode auto with --stream: online calls"), "{}", stderr(&o));
    assert_eq!(rows(&dir.path("c.jsonl")).len(), 20);
    server.shutdown().await;
}

/// 10. `--resume-stream` with `--id-field`: the id is the identity. The same records fed again
///     after one new record (or in another order) are not run or written again; they used to
///     be, every one of them, keyed on id and line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_stream_knows_finished_ids_in_any_order() {
    let server = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("resume-stream-ids");
    let (data, ids) = prompts(100);
    let url = server.url();
    let feed = |bytes: Vec<u8>, output: &'static [&'static str]| {
        let dir = &dir.0;
        let url = url.clone();
        async move {
            let mut child = weir()
                .current_dir(dir)
                .args(["run", "--model", "gemini/m", "--base-url", &url, "--input", "-"])
                .args(output)
                .args(["--id-field", "key", "--progress", "never", "--no-cache", "--resume-stream"])
                .stdin(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(&bytes).await.unwrap();
            drop(stdin);
            child.wait_with_output().await.unwrap()
        }
    };
    let o = feed(data.clone(), &["--output", "out.jsonl"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(server.stats().requests, 100);
    // One new record first, then the same hundred in reverse order.
    let mut again = b"{\"key\": \"new\", \"prompt\": \"one more\"}\n".to_vec();
    for line in data.split(|b| *b == b'\n').filter(|l| !l.is_empty()).rev() {
        again.extend_from_slice(line);
        again.push(b'\n');
    }
    let o = feed(again.clone(), &["--output", "out.jsonl"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(server.stats().requests, 101, "only the new record is paid for: {}", stderr(&o));
    let mut all = ids.clone();
    all.push("new".into());
    assert_each_id_once(&all, &rows(&dir.path("out.jsonl")), &rows(&dir.path("out.errors.jsonl")));
    // Into a table output (a directory of parts) alike: each id once. Keyed on id and line, the
    // hundred were written again (answered from nowhere but a call with --no-cache).
    std::fs::create_dir(dir.path("table")).unwrap();
    const TABLE: &[&str] = &["--output", "table", "--output-format", "jsonl"];
    let o = feed(data.clone(), TABLE).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = feed(again, TABLE).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(server.stats().requests, 202, "only the new record is paid for: {}", stderr(&o));
    let parts = |d: &str| -> Vec<serde_json::Value> {
        let mut names: Vec<_> = std::fs::read_dir(dir.path(d)).unwrap().map(|e| e.unwrap().path()).collect();
        names.sort();
        names.iter().filter(|p| p.extension().is_some_and(|e| e == "jsonl")).flat_map(|p| rows(p)).collect()
    };
    assert_each_id_once(&all, &parts("table"), &[]);
    server.shutdown().await;
}

/// 7. CSV inputs as they come from spreadsheets: a byte that is not UTF-8 is one error row (it
///    used to refuse the whole file), UTF-16 and `;`-separated files are refused with what to
///    do (`--csv-delimiter`), prompts that look like numbers are sent as written, and a CRLF
///    copy of a file numbers (and so identifies) its records as the LF copy does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csv_files_from_spreadsheets() {
    let dir = Dir::new("csv-edges");
    let run = |input: &str, output: &str, extra: &[&str]| {
        let mut c = demo(&dir, &["--input", input, "--output", output]);
        c.args(extra);
        c
    };
    dir.write("bad.csv", b"id,prompt\n1,hello\n2,caf\xe9\n3,bye\n");
    let o = run("bad.csv", "bad.jsonl", &[]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let errors = rows(&dir.path("bad.errors.jsonl"));
    assert_eq!((rows(&dir.path("bad.jsonl")).len(), errors.len()), (2, 1));
    assert!(errors[0]["message"].as_str().unwrap().contains("line 3: not valid UTF-8"), "{errors:?}");

    dir.write("semi.csv", b"id;prompt\n1;hello\n2;bye\n");
    let o = run("semi.csv", "semi.jsonl", &[]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--csv-delimiter ';'"), "{}", stderr(&o));
    let o = run("semi.csv", "semi.jsonl", &["--csv-delimiter", ";", "--id-field", "id"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(rows(&dir.path("semi.jsonl")).len(), 2);

    let mut utf16 = vec![0xFF, 0xFE];
    utf16.extend("prompt\nhello\n".encode_utf16().flat_map(u16::to_le_bytes));
    dir.write("u16.csv", &utf16);
    let o = run("u16.csv", "u16.jsonl", &[]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("UTF-16") && stderr(&o).contains("UTF-8"), "{}", stderr(&o));

    dir.write("num.csv", b"id,prompt\n1,123\n2,4.5\n");
    let o = run("num.csv", "num.jsonl", &["--id-field", "id"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let got = rows(&dir.path("num.jsonl"));
    assert!(got.iter().any(|r| r["input"]["prompt"] == "4.5"), "{got:?}");

    // An unterminated quote in the last column swallowed the rest of the file in silence.
    dir.write("quote.csv", b"prompt,x\nhello,1\noops,\"2\nbye,3\nlast,4\n");
    let o = run("quote.csv", "quote.jsonl", &[]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let errors = rows(&dir.path("quote.errors.jsonl"));
    assert!(
        errors[0]["message"].as_str().unwrap().contains("line 3: a quote opened on this line is never closed"),
        "{errors:?}"
    );

    dir.write("lf.csv", b"prompt,x\n\nhello,1\n\"two\nlines\",5\nbye,2\n");
    dir.write("crlf.csv", b"prompt,x\r\n\r\nhello,1\r\n\"two\r\nlines\",5\r\nbye,2\r\n");
    let mut lines = Vec::new();
    for name in ["lf", "crlf"] {
        let o = run(&format!("{name}.csv"), &format!("{name}.jsonl"), &[]).output().await.unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let mut ids: Vec<String> =
            rows(&dir.path(&format!("{name}.jsonl"))).iter().map(|r| r["id"].to_string()).collect();
        ids.sort();
        lines.push(ids);
    }
    assert_eq!(lines[0], ["\"3\"", "\"4\"", "\"6\""], "physical lines of the LF file");
    assert_eq!(lines[0], lines[1], "the CRLF copy numbers its records as the LF copy does");
}

/// 13. A usage error found while a table output is being set up (a `--keep-columns` the input
///     lacks) writes nothing: the table's directory and lock file it made are gone again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_table_run_leaves_no_directory() {
    let dir = Dir::new("refused-table");
    let (data, _) = prompts(5);
    dir.write("in.jsonl", &data);
    for output in ["out.parquet", "out.csv"] {
        let o = demo(&dir, &["--input", "in.jsonl", "--output", output])
            .args(["--keep-columns", "nosuch"])
            .output()
            .await
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("no column 'nosuch'"), "{}", stderr(&o));
        assert!(!dir.path(output).exists(), "{output} was left behind");
    }
    // A table output that is a symlink to nothing says so (it was a bare "No such file").
    std::os::unix::fs::symlink("nowhere", dir.path("linked.parquet")).unwrap();
    let o = demo(&dir, &["--input", "in.jsonl", "--output", "linked.parquet"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("is a symlink to nowhere, which does not exist"), "{}", stderr(&o));
}

/// 5. A Parquet prompt column of bytes (`BYTE_ARRAY` without the UTF-8 mark): UTF-8 bytes are
///    the prompt as text (they were sent as hex, and paid for); other bytes are that record's
///    error, before any call, and are kept (as base64) in its error row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_prompt_column_is_text_or_the_records_error() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let dir = Dir::new("binary-prompt");
    let input = dir.path("in.parquet");
    python(
        r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
pq.write_table(pa.table({"key": ["a", "b", "c"],
    "prompt": pa.array([b"hello", b"caf\xc3\xa9", b"\xff\xfe bad"], pa.binary())}), sys.argv[1])
"#,
        &[s(&input)],
    );
    let server = sim(weir_sim::SimConfig::default()).await;
    let url = server.url();
    let o = weir()
        .current_dir(&dir.0)
        .args(["run", "--model", "gemini/m", "--base-url", &url, "--input", s(&input), "--output", "out.jsonl"])
        .args(["--id-field", "key", "--progress", "never"])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let got = rows(&dir.path("out.jsonl"));
    let prompts: Vec<&str> = got.iter().map(|r| r["input"]["prompt"].as_str().unwrap()).collect();
    assert!(prompts.contains(&"hello") && prompts.contains(&"café"), "{prompts:?}");
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 1);
    assert_eq!((errors[0]["id"].as_str(), errors[0]["kind"].as_str()), (Some("c"), Some("invalid_input")));
    assert_eq!(errors[0]["input"]["prompt"]["base64"], "//4gYmFk");
    assert_eq!(server.stats().requests, 2, "no call for the bytes that are not text");
    server.shutdown().await;
}

/// 6. Values JSON has no words for reach a Parquet output as they were: NaN and ±infinity (they
///    became null in every output), durations (null in Parquet; now a count of their unit) and
///    date64 (an Int64 of milliseconds; now a date).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floats_durations_and_dates_keep_their_values() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let dir = Dir::new("odd-values");
    let input = dir.path("in.parquet");
    python(
        r#"
import sys, datetime, pyarrow as pa, pyarrow.parquet as pq
pq.write_table(pa.table({"key": ["a", "b", "c"], "prompt": ["x", "y", "z"],
    "dur": pa.array([1000000, 2, None], pa.duration("us")),
    "f": pa.array([float("nan"), float("inf"), -float("inf")]),
    "d64": pa.array([datetime.date(2026, 1, 1), datetime.date(2026, 1, 2), None], pa.date64())}), sys.argv[1])
"#,
        &[s(&input)],
    );
    for output in ["out.parquet", "out.jsonl"] {
        let o = demo(&dir, &["--input", s(&input), "--output", output, "--id-field", "key"]).output().await.unwrap();
        assert_eq!(o.status.code(), Some(0), "{output}: {}", stderr(&o));
    }
    let got = python(
        r#"
import sys, json, math, pyarrow.dataset as ds
rows = {r["key"]: r for r in ds.dataset(sys.argv[1] + "/out.parquet").to_table().to_pylist()}
assert math.isnan(rows["a"]["f"]) and rows["b"]["f"] == math.inf and rows["c"]["f"] == -math.inf, rows
assert (rows["a"]["dur"], rows["b"]["dur"], rows["c"]["dur"]) == (1000000, 2, None), rows
assert str(rows["a"]["d64"]) == "2026-01-01", rows
lines = {r["id"]: r["input"] for r in map(json.loads, open(sys.argv[1] + "/out.jsonl"))}
print(lines["a"]["f"], lines["b"]["f"], lines["c"]["f"], lines["a"]["dur"])
"#,
        &[s(&dir.0)],
    );
    assert_eq!(got.trim(), "NaN Infinity -Infinity 1000000");
}

/// Found by a hostile try of the fixes above: an errors table is locked as an output table is
/// (two runs sharing `--errors t.csv` lost each other's error rows, and one naming another
/// run's output table as its errors cleared its staging part and crashed it), and a FIFO
/// output is locked too (three runs writing one FIFO interleaved their rows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_errors_table_and_a_fifo_are_held_by_one_run() {
    let mut config = weir_sim::SimConfig::default();
    config.latency.fixed_ms = 200.0;
    let server = sim(config).await;
    let url = server.url();
    let dir = Dir::new("errors-table-lock");
    let (data, _) = prompts(40);
    dir.write("in.jsonl", &data);
    let fifo = dir.path("out.fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let run = |output: &str, errors: &str, state: &str| {
        let mut c = weir();
        c.current_dir(&dir.0)
            .args(["run", "--model", "gemini/m", "--base-url", &url, "--input", "in.jsonl", "--output", output])
            .args(["--errors", errors, "--state", state, "--max-concurrency", "2", "--progress", "never"]);
        c
    };
    let to_fifo = |errors: &str| {
        let mut c = weir();
        c.current_dir(&dir.0)
            .args(["run", "--model", "gemini/m", "--base-url", &url, "--input", "in.jsonl", "--output", s(&fifo)])
            .args(["--errors", errors, "--max-concurrency", "2", "--progress", "never"]);
        c
    };
    let mut first = run("a.csv", "shared.csv", "s1").stderr(Stdio::null()).spawn().unwrap();
    let mut fifo_writer = to_fifo("f1.jsonl").stderr(Stdio::null()).spawn().unwrap();
    let reader = std::thread::spawn({
        let fifo = fifo.clone();
        move || std::io::read_to_string(std::fs::File::open(fifo).unwrap()).unwrap()
    });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    for (output, errors) in [("b.csv", "shared.csv"), ("c.csv", "a.csv")] {
        let o = run(output, errors, "s2").output().await.unwrap();
        assert_eq!(o.status.code(), Some(2), "{errors}: {}", stderr(&o));
        assert!(stderr(&o).contains("another weir run is writing"), "{}", stderr(&o));
    }
    let o = to_fifo("f2.jsonl").output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("another weir run is writing this FIFO"), "{}", stderr(&o));
    assert_eq!(first.wait().await.unwrap().code(), Some(0));
    assert_eq!(fifo_writer.wait().await.unwrap().code(), Some(0));
    let rows: Vec<serde_json::Value> =
        reader.join().unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 40);
    server.shutdown().await;
}

/// Without a state directory, Ctrl-C while the reader has stopped reading waits for it
/// (rows not written would have no row anywhere); when it reads again, every record ends in a
/// row. (A resumable run gives up after the drain time instead: see item 12.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_state_ctrl_c_waits_for_a_stalled_reader_and_loses_nothing() {
    let dir = Dir::new("stalled-no-state");
    let (data, ids) = prompts(2_000);
    dir.write("in.jsonl", &data);
    let fifo = dir.path("events.fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let child = demo(&dir, &["--input", "in.jsonl", "--output", "out.jsonl", "--id-field", "key"])
        .args(["--no-state", "--stream", "--events", s(&fifo), "--timeout", "2"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stalled = std::fs::File::open(&fifo).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    // Well past the drain time (2 s): still waiting.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let drained = std::thread::spawn(move || {
        let mut stalled = stalled;
        std::io::copy(&mut stalled, &mut std::io::sink())
    });
    let o = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait_with_output()).await.unwrap().unwrap();
    drained.join().unwrap().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &rows(&dir.path("out.errors.jsonl")));
}

/// 13. A column a stream first shows after the rows a table's columns are taken from is not
///     dropped without a word: the run warns, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_column_of_a_stream_into_a_table_is_named() {
    let dir = Dir::new("late-column");
    let mut data = Vec::new();
    for i in 0..1_200 {
        let extra = if i >= 1_100 { ", \"extra\": \"x\"" } else { "" };
        data.extend(format!("{{\"key\": \"k{i}\", \"prompt\": \"p {i}\"{extra}}}\n").into_bytes());
    }
    let mut child = demo(&dir, &["--input", "-", "--output", "out.parquet", "--id-field", "key"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&data).await.unwrap();
    drop(stdin);
    let o = child.wait_with_output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("100 rows had input columns the table does not have (such as 'extra'"), "{err}");
}

/// 13. `--keep-columns` naming a column no JSONL row has is said at the end (a table output
///     refuses it up front); it was accepted in silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_columns_no_row_has_are_named() {
    let dir = Dir::new("keep-nosuch");
    let (data, _) = prompts(5);
    dir.write("in.jsonl", &data);
    let o = demo(&dir, &["--input", "in.jsonl", "--output", "out.jsonl"])
        .args(["--keep-columns", "key,nosuch"])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("--keep-columns: no input row had 'nosuch'"), "{}", stderr(&o));
    assert!(rows(&dir.path("out.jsonl")).iter().all(|r| r["input"]["key"].is_string()));
}

/// An outside tester's inputs that are not what their names or flags say, each once refused
/// with what it is (exit 2, nothing written), where before each became error rows that did not
/// say why: a gzip file (2 records, 1 row "not valid UTF-8"), a pretty-printed JSON array (2
/// records, 8 rows), a Parquet file read as JSONL (43 rows for 6), a template naming a column
/// the CSV lacks and a prompt column of numbers (a row each), a CSV from a FIFO ("Requested
/// range was invalid"). And of many JSONL files, a bad line is named by its file and its line
/// there, not by its place among all of them.
#[tokio::test]
async fn inputs_that_are_not_what_they_say_are_named_before_any_row() {
    let dir = Dir::new("not-what-they-say");
    let ok = b"{\"prompt\":\"hi\"}\n{\"prompt\":\"yo\"}\n";
    // `gzip` of the two lines (its header, then the deflated bytes).
    let mut gz = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03".to_vec();
    gz.extend_from_slice(b"\xabV*(\xca\xcf-(Q\xb2R\xca\xc8T\xaa\xe5\x02\x00");
    dir.write("in.jsonl.gz", &gz);
    dir.write("arr.json", b"[\n  {\n    \"prompt\": \"hi\"\n  },\n  {\n    \"prompt\": \"yo\"\n  }\n]\n");
    dir.write("in.csv", b"id,prompt\n1,hi\n2,yo\n");
    dir.write("fake.jsonl", b"PAR1\x15\x04\x15\x10\x15\x14");
    let cases: &[(&[&str], &str)] = &[
        (&["--input", "in.jsonl.gz"], "is gzip-compressed"),
        (&["--input", "arr.json"], "is a JSON array written over many lines"),
        (&["--input", "in.csv", "--template", "Q: {promt}"], "has no column \"promt\" (named in --template)"),
        (&["--input", "in.csv", "--prompt-field", "id"], ""),
        (&["--input", "fake.jsonl", "--input-format", "jsonl", "--output-format", "jsonl"], "is a Parquet file"),
    ];
    for (args, says) in cases {
        let out = dir.path("out.jsonl");
        let _ = std::fs::remove_file(&out);
        let o = demo(&dir, args).args(["--output", s(&out), "--no-state"]).output().await.unwrap();
        if says.is_empty() {
            // A CSV column of digits is kept as text when it is the prompt: it runs.
            assert!(o.status.success(), "{args:?}: {}", stderr(&o));
            continue;
        }
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
        assert!(!out.exists(), "{args:?}");
    }
    // In a directory, any file, not only the first by name.
    std::fs::create_dir_all(dir.path("mixed")).unwrap();
    dir.write("mixed/a.jsonl", ok);
    dir.write("mixed/b.jsonl", &gz);
    let o = demo(&dir, &["--input", "mixed", "--output", "mixed.out.jsonl"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("mixed/b.jsonl: is gzip-compressed"), "{}", stderr(&o));
    let fifo = dir.path("f.csv");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let o = demo(&dir, &["--input", s(&fifo), "--output", "o.jsonl"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("is a stream (a pipe or a FIFO)"), "{}", stderr(&o));
    std::fs::create_dir_all(dir.path("many")).unwrap();
    dir.write("many/a.jsonl", ok);
    dir.write("many/b.jsonl", b"{\"prompt\":\"fine\"}\n{broken\n");
    let o = demo(&dir, &["--input", "many", "--output", "m.jsonl"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let errors = rows(&dir.path("m.errors.jsonl"));
    assert_eq!(errors.len(), 1, "{errors:?}");
    let message = errors[0]["message"].as_str().unwrap();
    assert!(message.contains("b.jsonl line 2 is not valid JSON"), "{message}");
    assert_eq!(errors[0]["line"], 4, "the input's own numbering is kept, for resuming");
    if peer("WEIR_PYTHON").is_some() {
        let ints = dir.path("ints.parquet");
        python(
            "import sys, pyarrow as pa, pyarrow.parquet as pq\npq.write_table(pa.table({'prompt': [1, 2, 3]}), sys.argv[1])",
            &[s(&ints)],
        );
        let o = demo(&dir, &["--input", s(&ints), "--output", "i.jsonl"]).output().await.unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("the prompt column \"prompt\" holds Int64, not text"), "{}", stderr(&o));
    }
}

/// Rows that cannot be written (a tester's `--output /dev/full`) stop the run naming the file
/// and what the records not written come to; it said only "writing rows failed: No space left
/// on device".
#[tokio::test]
async fn a_full_output_is_named_with_what_it_costs() {
    if !Path::new("/dev/full").exists() {
        return;
    }
    let dir = Dir::new("full-output");
    let (data, _) = prompts(500);
    dir.write("in.jsonl", &data);
    let o =
        demo(&dir, &["--input", "in.jsonl", "--output", "/dev/full", "--errors", "errs.jsonl"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("/dev/full: No space left on device") && err.contains("keeps no state"), "{err}");
}
