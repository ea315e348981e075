//! Tables: JSONL, CSV and Parquet in and out, local and in object stores (moto's S3 and
//! fake-gcs-server, started here on 127.0.0.1), with pyarrow reading back what weir wrote; a
//! Parquet output in s3:// survives SIGKILL three times with every id exactly once.

mod util;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use util::*;
use weir_sim::{SimConfig, SimServer};

/// Puts a local file into moto's bucket `bkt` under `key`.
fn s3_put(endpoint: &str, file: &Path, key: &str) {
    python(
        r#"
import sys, boto3
boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1").upload_file(sys.argv[2], "bkt", sys.argv[3])
"#,
        &[endpoint, file.to_str().unwrap(), key],
    );
}

/// fake-gcs-server on a free loopback port, with bucket `bkt`.
async fn fake_gcs() -> Option<Emulator> {
    let bin = peer("WEIR_FAKE_GCS")?;
    let port = free_port();
    let child = std::process::Command::new(bin)
        .args(["-scheme", "http", "-host", "127.0.0.1", "-port", &port.to_string(), "-backend", "memory"])
        .args(["-public-host", &format!("127.0.0.1:{port}"), "-log-level", "error"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let e = Emulator { child, url: format!("http://127.0.0.1:{port}") };
    wait_for_port(port).await;
    let r = reqwest::Client::new()
        .post(format!("{}/storage/v1/b", e.url))
        .json(&json!({"name": "bkt"}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "create bucket: {}", r.status());
    Some(e)
}

async fn run_with(args: &[&str], envs: &[(&str, &str)]) -> std::process::Output {
    let mut c = weir();
    c.args(args);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().await.unwrap()
}

/// `weir run` of sim/demo from `input` to `output`, ids in the `id` field.
async fn demo(input: &Path, output: &Path) -> std::process::Output {
    let (i, o) = (input.to_str().unwrap(), output.to_str().unwrap());
    run(&["run", "--model", "sim/demo", "--input", i, "--output", o, "--id-field", "id", "--progress", "never"]).await
}

fn records(n: usize) -> (Vec<u8>, Vec<Value>) {
    let mut data = Vec::new();
    let mut rows = Vec::new();
    for i in 0..n {
        let r = json!({
            "id": format!("r{i}"),
            "prompt": format!("Tell me about item {i}"),
            "n": i,
            "score": i as f64 * 0.5 + 0.25,
            "ok": i % 2 == 0,
            "tags": ["a", format!("b{i}")],
            "meta": {"k": i, "s": format!("x{i}")},
        });
        data.extend_from_slice(format!("{r}\n").as_bytes());
        rows.push(r);
    }
    (data, rows)
}

/// JSONL in, Parquet out (a directory of parts): every input column, nested and list ones
/// included, reads back through pyarrow as it was written.
#[tokio::test]
async fn jsonl_to_parquet_keeps_every_column() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let dir = Dir::new("jsonl-parquet");
    let (data, _) = records(60);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.parquet");
    let o = demo(&input, &out).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(out.join("part-00000.parquet").exists());
    let got = python(
        r#"
import json, sys, pyarrow.parquet as pq
inp = [json.loads(l) for l in open(sys.argv[1])]
t = pq.read_table(sys.argv[2])
rows = {r["id"]: r for r in t.to_pylist()}
assert len(rows) == len(inp) == t.num_rows, (len(rows), len(inp), t.num_rows)
for r in inp:
    o = rows[r["id"]]
    for k, v in r.items():
        assert o[k] == v, (k, o[k], v)
    assert o["response"] and o["finish_reason"] and o["model"] == "sim/demo" and o["line"] >= 1
print(t.schema.field("tags").type, t.schema.field("meta").type)
"#,
        &[input.to_str().unwrap(), out.to_str().unwrap()],
    );
    assert!(got.contains("list<") && got.contains("struct<"), "{got}");
}

/// Parquet in (several row groups), CSV out: flat columns read back by pyarrow as they were;
/// a list column, which CSV cannot hold, as its JSON text.
#[tokio::test]
async fn parquet_to_csv_keeps_columns() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let dir = Dir::new("parquet-csv");
    let input = dir.path("in.parquet");
    let out = dir.path("out.csv");
    python(
        r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
n = 45
t = pa.table({
    "id": list(range(n)),
    "prompt": [f"Say something about {i}" for i in range(n)],
    "name": [f'a, "b"\nc{i}' for i in range(n)],
    "score": [i / 4 for i in range(n)],
    "ok": [i % 3 == 0 for i in range(n)],
    "tags": [["x", f"y{i}"] for i in range(n)],
})
pq.write_table(t, sys.argv[1], row_group_size=10)
"#,
        &[input.to_str().unwrap()],
    );
    let o = demo(&input, &out).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let got = python(
        r#"
import json, sys, glob, pyarrow.csv as pc, pyarrow.parquet as pq, pyarrow as pa
inp = pq.read_table(sys.argv[1]).to_pylist()
parts = sorted(glob.glob(sys.argv[2] + "/part-*.csv"))
t = pa.concat_tables([pc.read_csv(p) for p in parts])
rows = {r["id"]: r for r in t.to_pylist()}
assert len(rows) == len(inp) == t.num_rows
for r in inp:
    o = rows[r["id"]]
    for k in ("prompt", "name", "score", "ok"):
        assert o[k] == r[k], (k, o[k], r[k])
    assert json.loads(o["tags"]) == r["tags"]
    assert o["response"]
print(len(parts), t.num_rows)
"#,
        &[input.to_str().unwrap(), out.to_str().unwrap()],
    );
    assert!(got.trim().ends_with("45"), "{got}");
}

/// CSV in (quoted commas and newlines, an empty number, a line of the wrong width), JSONL
/// out: each good row's input object is what pyarrow reads from the CSV; the bad line is an
/// error row naming the file and its line, and the run goes on.
#[tokio::test]
async fn csv_to_jsonl_with_a_bad_line() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let dir = Dir::new("csv-jsonl");
    let csv = "id,prompt,n,note\n\
               a1,First prompt,1,plain\n\
               a2,\"Second, with a comma\",2,\"two\nlines\"\n\
               a3,Third,,\"with \"\"quotes\"\"\"\n\
               a4,too few fields\n\
               a5,Fifth,5,last\n";
    let input = dir.write("in.csv", csv.as_bytes());
    let out = dir.path("out.jsonl");
    let o = demo(&input, &out).await;
    assert_eq!(o.status.code(), Some(1), "one error row: {}", stderr(&o));
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0]["line"], 6, "{errors:?}");
    assert_eq!(errors[0]["kind"], "invalid_input");
    let msg = errors[0]["message"].as_str().unwrap();
    assert!(msg.contains("in.csv") && msg.contains("line 6"), "{msg}");
    assert_eq!(errors[0]["raw"], "a4,too few fields");
    let results = rows(&out);
    assert_eq!(results.len(), 4);
    let inputs: Vec<Value> = results.iter().map(|r| r["input"].clone()).collect();
    let got = python(
        r#"
import json, sys, pyarrow.csv as pc
t = pc.read_csv(sys.argv[1], parse_options=pc.ParseOptions(newlines_in_values=True, invalid_row_handler=lambda r: "skip"))
want = {r["id"]: r for r in t.to_pylist()}
got = {r["id"]: r for r in json.loads(sys.argv[2])}
assert want == got, (want, got)
print(len(got))
"#,
        &[input.to_str().unwrap(), &Value::from(inputs).to_string()],
    );
    assert_eq!(got.trim(), "4");
}

/// A Parquet row group that cannot be decoded becomes an error row for each of its rows,
/// naming the file and the group; the other groups' rows are answered.
#[tokio::test]
async fn an_unreadable_row_group_is_error_rows() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let dir = Dir::new("bad-group");
    let input = dir.path("in.parquet");
    python(
        r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
n = 30
t = pa.table({"id": [f"r{i}" for i in range(n)], "prompt": [f"prompt number {i} " * 20 for i in range(n)]})
pq.write_table(t, sys.argv[1], row_group_size=10, compression="snappy")
col = pq.ParquetFile(sys.argv[1]).metadata.row_group(1).column(1)
start = col.dictionary_page_offset or col.data_page_offset
with open(sys.argv[1], "r+b") as f:
    f.seek(start)
    f.write(b"\xff" * 24)
"#,
        &[input.to_str().unwrap()],
    );
    let out = dir.path("out.jsonl");
    let o = demo(&input, &out).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let errors = rows(&dir.path("out.errors.jsonl"));
    let results = rows(&out);
    assert_eq!((results.len(), errors.len()), (20, 10), "{errors:?}");
    let mut lines: Vec<u64> = errors.iter().map(|e| e["line"].as_u64().unwrap()).collect();
    lines.sort();
    assert_eq!(lines, (11..=20).collect::<Vec<_>>());
    assert!(errors.iter().all(|e| e["message"].as_str().unwrap().contains("row group 1")), "{errors:?}");
}

/// A directory input is its table files, not hidden ones (the state in `.weir/`) nor this
/// run's own output inside it; the run resumes with nothing left to do.
#[tokio::test]
async fn a_directory_input_never_reads_its_own_output_or_state() {
    let dir = Dir::new("dir-input");
    let (data, _) = records(7);
    std::fs::create_dir_all(dir.path("data/more")).unwrap();
    let cut = data.iter().enumerate().filter(|(_, b)| **b == b'\n').nth(2).unwrap().0 + 1;
    dir.write("data/a.jsonl", &data[..cut]);
    dir.write("data/more/b.jsonl", &data[cut..]);
    dir.write("data/_SUCCESS", b"");
    let d = dir.path("data");
    let out = d.join("results.jsonl");
    let args = [
        "run",
        "--model",
        "sim/demo",
        "--input",
        d.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "id",
        "--progress",
        "never",
    ];
    let o = run(&args).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(rows(&out).len(), 7);
    assert!(d.join(".weir").exists());
    let o = run(&args).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("Resuming: 7 of 7"), "{}", stderr(&o));
    assert_eq!(rows(&out).len(), 7);
}

/// A table resumed with other kept columns or into another errors table would mix parts of two
/// shapes (a reader of the table saw half its rows without the dropped columns): another run.
#[tokio::test]
async fn a_table_output_resumed_with_another_shape_is_another_run() {
    let dir = Dir::new("table-shape");
    let (data, _) = records(6);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.csv");
    let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
    let base = ["run", "--model", "sim/demo", "--input", i, "--output", o, "--id-field", "id", "--progress", "never"];
    let r = run(&base).await;
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    let r = run(&[&base[..], &["--keep-columns", "prompt"]].concat()).await;
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    assert!(stderr(&r).contains("outputs: csv table") && stderr(&r).contains("columns all"), "{}", stderr(&r));
    let errors = dir.path("elsewhere.csv");
    let r = run(&[&base[..], &["--errors", errors.to_str().unwrap()]].concat()).await;
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    let o = run(&base).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("Resuming: 6 of 6"), "{}", stderr(&o));
}

/// A glob skips hidden names (`.x`, `_x`) below its fixed part as a directory does, unless the
/// pattern itself starts the name so (`out.parquet/*` read weir's own `.weir.lock`).
#[tokio::test]
async fn a_glob_skips_hidden_files_unless_it_names_them() {
    let dir = Dir::new("glob-hidden");
    std::fs::create_dir_all(dir.path("in")).unwrap();
    dir.write("in/a.csv", b"id,prompt\na1,x\na2,y\n");
    dir.write("in/.h.csv", b"id,prompt\nh1,x\n");
    dir.write("in/_x.csv", b"id,prompt\nx1,x\n");
    dir.write("in/_extra1.csv", b"id,prompt\ne1,x\n");
    let ids = |glob: &str, out: &str| {
        let input = dir.path(glob);
        let out = dir.path(out);
        async move {
            let (i, o) = (input.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
            let r =
                run(&["run", "--model", "sim/demo", "--input", &i, "--output", &o, "--id-field", "id", "--no-state"])
                    .await;
            assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
            let mut ids: Vec<String> = rows(&out).iter().map(|r| r["id"].as_str().unwrap().to_string()).collect();
            ids.sort();
            ids
        }
    };
    assert_eq!(ids("in/*.csv", "all.jsonl").await, ["a1", "a2"]);
    assert_eq!(ids("in/_extra*.csv", "extra.jsonl").await, ["e1"]);
}

/// A CSV whose header lacks the prompt column (or the id column) is a usage error before any
/// row: every row used to become an `invalid_input` row.
#[tokio::test]
async fn a_csv_without_the_prompt_column_is_refused_before_any_row() {
    let dir = Dir::new("csv-columns");
    let input = dir.write("in.csv", b"id,text\n1,a\n2,b\n");
    let out = dir.path("out.jsonl");
    let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
    let r = run(&["run", "--model", "sim/demo", "--input", i, "--output", o, "--id-field", "id"]).await;
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    assert!(stderr(&r).contains("has no column \"prompt\"") && stderr(&r).contains("\"text\""), "{}", stderr(&r));
    assert!(!out.exists() || rows(&out).is_empty());
    let r = run(&["run", "--model", "sim/demo", "--input", i, "--output", o, "--id-field", "key"]).await;
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    let r =
        run(&["run", "--model", "sim/demo", "--input", i, "--output", o, "--id-field", "id", "--prompt-field", "text"])
            .await;
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    assert_eq!(rows(&out).len(), 2);
}

/// A new run will not mix its parts with files it did not write; --overwrite replaces weir's
/// parts and leaves other files; bad table flags are usage errors.
#[tokio::test]
async fn table_outputs_refuse_foreign_files_and_bad_flags() {
    let dir = Dir::new("foreign");
    let (data, _) = records(5);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.parquet");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), b"mine").unwrap();
    let i = input.to_str().unwrap();
    let args = ["run", "--model", "sim/demo", "--input", i, "--output", out.to_str().unwrap(), "--progress", "never"];
    let o = run(&args).await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("notes.txt"), "{}", stderr(&o));
    let mut with = args.to_vec();
    with.push("--overwrite");
    let o = run(&with).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"mine");
    assert!(out.join("part-00000.parquet").exists());

    for (extra, want) in [
        (vec!["--keep-columns", "nope"], "no column 'nope'"),
        (vec!["--output-format", "xml"], "unknown format"),
        (vec!["--retry-errors"], "--retry-errors"),
        (vec!["--part-mib", "0"], "--part-mib"),
    ] {
        let mut a = vec!["run", "--model", "sim/demo", "--input", i, "--output"];
        let o2 = dir.path("other.parquet");
        a.push(o2.to_str().unwrap());
        a.extend(extra);
        let o = run(&a).await;
        assert_eq!(o.status.code(), Some(2), "{a:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{a:?}: {}", stderr(&o));
    }
    let o = run(&["run", "--model", "sim/demo", "--input", i, "--output", "s3://bkt/out"]).await;
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--output-format"), "{}", stderr(&o));
}

/// Reads ids from every part of a table in S3 (moto) with boto3 and pyarrow: id → count.
fn s3_ids(endpoint: &str, prefix: &str) -> HashMap<String, u64> {
    let out = python(
        r#"
import io, json, sys, boto3, pyarrow.parquet as pq
s3 = boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1")
counts = {}
for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bkt", Prefix=sys.argv[2] + "/"):
    for obj in page.get("Contents", []):
        body = s3.get_object(Bucket="bkt", Key=obj["Key"])["Body"].read()
        for i in pq.read_table(io.BytesIO(body)).column("key").to_pylist():
            counts[i] = counts.get(i, 0) + 1
print(json.dumps(counts), flush=True)
# pyarrow's threads can abort the interpreter's exit after boto3 has run; the answer is out.
import os; os._exit(0)
"#,
        &[endpoint, prefix],
    );
    serde_json::from_str(out.trim()).unwrap()
}

/// 20,000 records from s3:// to Parquet in s3://, against a simulator with latency and
/// faults; the run is killed with SIGKILL three times and resumed. At the end every id is in
/// the results or the errors exactly once, and the calls made beyond each record's first and
/// the retried faults are few (the response cache answers what an uncommitted part lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_parquet_survives_sigkill_three_times() {
    const N: usize = 20_000;
    const KILLS: u64 = 3;
    let Some(s3) = moto().await else { return };
    let mut config = SimConfig { seed: 12, ..SimConfig::default() };
    config.latency.fixed_ms = 8.0;
    config.latency.jitter_ms = 8.0;
    config.faults.error_503 = 0.03;
    config.faults.reset = 0.01;
    config.faults.block_prompt = 0.01;
    let server = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let url = server.url();
    let (data, ids) = prompts(N);
    let dir = Dir::new("s3-crash");
    s3_put(&s3.url, &dir.write("prompts.jsonl", &data), "in/prompts.jsonl");
    let state = dir.path("state");
    let args = [
        "run",
        "--model",
        "gemini/m",
        "--base-url",
        &url,
        "--input",
        "s3://bkt/in/prompts.jsonl",
        "--output",
        "s3://bkt/out.parquet",
        "--id-field",
        "key",
        "--max-concurrency",
        "32",
        "--max-retries",
        "30",
        "--progress",
        "never",
        "--checkpoint-secs",
        "1",
        "--state",
        state.to_str().unwrap(),
    ];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
    for k in 0..KILLS {
        let mut cmd = weir();
        cmd.args(args).stderr(std::process::Stdio::null());
        s3_env(&mut cmd, &s3.url);
        let mut child = cmd.spawn().unwrap();
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1500..3500))).await;
        assert!(child.try_wait().unwrap().is_none(), "kill {k}: the run ended before it could be killed");
        child.start_kill().unwrap();
        let status = child.wait().await.unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
    }
    let mut cmd = weir();
    cmd.args(args);
    s3_env(&mut cmd, &s3.url);
    let o = cmd.output().await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("Resuming:"), "{}", stderr(&o));
    let results = s3_ids(&s3.url, "out.parquet");
    let errors = s3_ids(&s3.url, "out.errors.parquet");
    for id in &ids {
        let n = results.get(id).copied().unwrap_or(0) + errors.get(id).copied().unwrap_or(0);
        assert_eq!(n, 1, "{id} is in the outputs {n} times");
    }
    assert_eq!(results.len() + errors.len(), N);
    let s = server.stats();
    let retried = s.faults["error_503"] + s.faults["reset"];
    let extra = s.requests as i64 - N as i64 - retried as i64;
    println!("requests {}, faults retried {retried}, paid twice {extra}, errors {}", s.requests, errors.len());
    assert!(extra >= 0);
    // Per kill: the calls in flight (32) and the answers the cache had not yet handed to the
    // kernel (at most 256 or 200 ms of them).
    assert!(extra as u64 <= KILLS * (32 + 256), "{extra} calls paid twice for {KILLS} kills");
    server.shutdown().await;
}

/// GCS through weir's in-memory GCS (the XML API that object_store writes through; the PyPI
/// emulators do not take its uploads): JSONL in gs:// → Parquet in gs:// (resumed: nothing
/// left to do) → read back by weir as a Parquet input, and by pyarrow over plain HTTP.
// Two workers: the Python check blocks one while the in-process GCS answers it on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcs_round_trip() {
    let gcs = weir_sim::GcsServer::start("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let (data, inputs) = records(40);
    let http = reqwest::Client::new();
    let r = http.put(format!("{}/bkt/in/data.jsonl", gcs.url())).body(data).send().await.unwrap();
    assert!(r.status().is_success(), "upload: {}", r.status());
    let url = gcs.url();
    let env = [("STORAGE_EMULATOR_HOST", url.as_str())];
    let dir = Dir::new("gcs");
    let state = dir.path("state");
    let st = state.to_str().unwrap();
    let args = [
        "run",
        "--model",
        "sim/demo",
        "--input",
        "gs://bkt/in/data.jsonl",
        "--output",
        "gs://bkt/out/results.parquet",
        "--id-field",
        "id",
        "--progress",
        "never",
        "--state",
        st,
    ];
    let o = run_with(&args, &env).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // The same command again: resumed, nothing left to do.
    let o = run_with(&args, &env).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("Resuming: 40 finished"), "{}", stderr(&o));
    // weir reads its own Parquet output back from GCS.
    let back = dir.path("back.jsonl");
    let o = run_with(
        &[
            "run",
            "--model",
            "sim/demo",
            "--input",
            "gs://bkt/out/results.parquet/",
            "--output",
            back.to_str().unwrap(),
            "--id-field",
            "id",
            "--template",
            "Again: {response}",
            "--progress",
            "never",
        ],
        &env,
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let rows = rows(&back);
    assert_eq!(rows.len(), 40);
    let by_id: HashMap<String, &Value> = rows.iter().map(|r| (r["id"].as_str().unwrap().to_string(), r)).collect();
    for want in &inputs {
        let got = &by_id[want["id"].as_str().unwrap()]["input"];
        for k in ["prompt", "n", "score", "ok", "tags", "meta"] {
            assert_eq!(&got[k], &want[k], "{k}");
        }
        assert!(got["response"].as_str().is_some_and(|s| !s.is_empty()));
    }
    if peer("WEIR_PYTHON").is_some() {
        let got = python(
            r#"
import io, sys, urllib.request, xml.etree.ElementTree as ET, pyarrow.parquet as pq
base = sys.argv[1]
listing = ET.parse(urllib.request.urlopen(base + "/bkt?list-type=2&prefix=out/results.parquet/")).getroot()
names = [c.find("Key").text for c in listing.findall("Contents")]
rows = 0
for n in names:
    rows += pq.read_table(io.BytesIO(urllib.request.urlopen(base + "/bkt/" + n).read())).num_rows
print(len(names), rows)
"#,
            &[&url],
        );
        assert!(got.trim().ends_with(" 40"), "{got}");
    }
    gcs.shutdown().await;
}

/// weir reads from fake-gcs-server, a GCS emulator that is not weir's own (it cannot take
/// object_store's uploads, so only reading is checked against it).
#[tokio::test]
async fn reads_from_fake_gcs_server() {
    let Some(gcs) = fake_gcs().await else { return };
    let (data, _) = records(25);
    let r = reqwest::Client::new()
        .post(format!("{}/upload/storage/v1/b/bkt/o?uploadType=media&name=in/data.jsonl", gcs.url))
        .body(data)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "upload: {}", r.status());
    let dir = Dir::new("fake-gcs");
    let out = dir.path("out.jsonl");
    let o = run_with(
        &[
            "run",
            "--model",
            "sim/demo",
            "--input",
            "gs://bkt/in/data.jsonl",
            "--output",
            out.to_str().unwrap(),
            "--id-field",
            "id",
            "--progress",
            "never",
        ],
        &[("STORAGE_EMULATOR_HOST", gcs.url.as_str())],
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(rows(&out).len(), 25);
}

/// Found by a hostile try: stdin into a table resumed whatever was piped; a second run wrote
/// the same table at once; ids that turned from numbers to text after the first 1,000 lines of
/// stdin were dropped; input columns `model` and `weir_model`, or an always-empty object,
/// failed the run after its calls; an errors table inside the results table, `.pq` names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_table_edges() {
    let dir = Dir::new("hostile-tables");
    let piped = |n: usize, text_after: usize| {
        let mut data = Vec::new();
        for i in 0..n {
            let id = if i < text_after { json!(i) } else { json!(format!("x{i}")) };
            let row = json!({"id": id, "prompt": format!("p {i}"), "model": "m", "weir_model": "w", "empty": {}});
            data.extend_from_slice(format!("{row}\n").as_bytes());
        }
        data
    };
    let out = dir.path("s.parquet");
    let o = out.to_str().unwrap();
    let stdin_run = |data: Vec<u8>, extra: Vec<&'static str>| {
        let o = o.to_string();
        async move {
            use tokio::io::AsyncWriteExt;
            let mut c = weir();
            c.args(["run", "--model", "sim/demo", "--input", "-", "--output", &o, "--id-field", "id"])
                .args(["--progress", "never"])
                .args(extra)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            let mut child = c.spawn().unwrap();
            let mut stdin = child.stdin.take().unwrap();
            tokio::spawn(async move {
                let _ = stdin.write_all(&data).await;
            });
            child.wait_with_output().await.unwrap()
        }
    };
    let first = stdin_run(piped(1500, 1200), vec![]).await;
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    assert!(!stderr(&first).contains("WARN"), "{}", stderr(&first));
    // Every id is in the table, text and number alike.
    if peer("WEIR_PYTHON").is_some() {
        let got = python(
            r#"
import sys, pyarrow.parquet as pq
t = pq.read_table(sys.argv[1])
ids = t.column("id").to_pylist()
assert None not in ids and len(set(ids)) == 1500, (ids.count(None), len(set(ids)))
print(t.schema.field("weir_weir_model").type, t.schema.field("empty").type)
"#,
            &[o],
        );
        assert!(got.contains("string"), "{got}");
    }
    // Different data through the pipe is not silently resumed.
    let again = stdin_run(piped(10, 10), vec![]).await;
    assert_eq!(again.status.code(), Some(2), "{}", stderr(&again));
    assert!(stderr(&again).contains("--resume-stream"), "{}", stderr(&again));

    // Two runs at once on one local table: the second is refused.
    let (data, _) = records(3000);
    let input = dir.write("in.jsonl", &data);
    let two = dir.path("two.parquet");
    let args = |state: &str| {
        vec![
            "run".to_string(),
            "--model".into(),
            "sim/demo".into(),
            "--input".into(),
            input.to_str().unwrap().into(),
            "--output".into(),
            two.to_str().unwrap().into(),
            "--id-field".into(),
            "id".into(),
            "--progress".into(),
            "never".into(),
            "--max-concurrency".into(),
            "1".into(),
            "--state".into(),
            dir.path(state).to_str().unwrap().into(),
        ]
    };
    let mut slow = weir();
    slow.args(args("s1")).stderr(std::process::Stdio::null());
    let mut child = slow.spawn().unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let second = weir().args(args("s2")).output().await.unwrap();
    assert_eq!(second.status.code(), Some(2), "{}", stderr(&second));
    assert!(stderr(&second).contains("another weir run is writing"), "{}", stderr(&second));
    child.start_kill().unwrap();
    let _ = child.wait().await;

    // Errors inside the results, and odd extensions.
    let i = input.to_str().unwrap();
    let inside = dir.path("r.parquet");
    let errs = inside.join("errs.parquet");
    let o = run(&[
        "run",
        "--model",
        "sim/demo",
        "--input",
        i,
        "--output",
        inside.to_str().unwrap(),
        "--errors",
        errs.to_str().unwrap(),
    ])
    .await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("inside the other"), "{}", stderr(&o));
    let pq = dir.path("out.pq");
    let o = run(&["run", "--model", "sim/demo", "--input", i, "--output", pq.to_str().unwrap(), "--progress", "never"])
        .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(pq.join("part-00000.pq").exists() || pq.join("part-00000.parquet").exists());
    let o = run(&[
        "run",
        "--model",
        "sim/demo",
        "--input",
        i,
        "--output",
        "s3://bucket-root",
        "--output-format",
        "parquet",
    ])
    .await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("not at its root"), "{}", stderr(&o));
    // An endpoint nobody answers is not the command's fault: exit 3, nothing written.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let none = dir.path("none.jsonl");
    let mut c = weir();
    c.args(["run", "--model", "sim/demo", "--input", "s3://bkt/in/", "--output", none.to_str().unwrap()]);
    s3_env(&mut c, &dead);
    let o = c.output().await.unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(!none.exists());
}

/// A table another run wrote over since (from another state directory, with `--overwrite`):
/// resuming the first run's command is refused, not taken as finished. It said "Resuming: 40 of
/// 40 finished" over the other run's rows (or, after a stop, added its own to them: 2,904 rows
/// for 1,500 ids in a tester's S3 table).
#[tokio::test]
async fn a_table_another_run_replaced_is_not_resumed_over() {
    let dir = Dir::new("replaced-table");
    let (data, _) = records(40);
    dir.write("in.jsonl", &data);
    let (other, _) = records(25);
    dir.write("other.jsonl", &other);
    let run = |input: &str, extra: &[&str]| {
        let mut c = weir();
        c.current_dir(&dir.0)
            .args(["run", "--model", "sim/demo", "--input", input, "--output", "out.csv", "--id-field", "id"])
            .args(["--progress", "never"])
            .args(extra);
        c.output()
    };
    let first = run("in.jsonl", &[]).await.unwrap();
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    let theirs = run("other.jsonl", &["--state", "elsewhere", "--overwrite"]).await.unwrap();
    assert_eq!(theirs.status.code(), Some(0), "{}", stderr(&theirs));
    let again = run("in.jsonl", &[]).await.unwrap();
    assert_eq!(again.status.code(), Some(2), "{}", stderr(&again));
    assert!(stderr(&again).contains("was replaced since it was written"), "{}", stderr(&again));
}

/// An S3 table output whose own name is an object (an older single-file output) is refused, as
/// a local file there is: readers of the name got the old object and not the parts written
/// under it. A console's folder marker (`name/`, empty) is no such object.
#[tokio::test]
async fn an_object_at_a_tables_own_name_is_refused_and_a_folder_marker_is_not() {
    let Some(s3) = moto().await else { return };
    let dir = Dir::new("s3-object-at-name");
    let (data, _) = records(5);
    dir.write("in.jsonl", &data);
    s3_put(&s3.url, &dir.write("old.parquet", b"an older output"), "single.parquet");
    s3_put(&s3.url, &dir.write("marker", b""), "folder.parquet/");
    let run = |out: &str| {
        let mut c = weir();
        c.current_dir(&dir.0)
            .args(["run", "--model", "sim/demo", "--input", "in.jsonl", "--output", out, "--id-field", "id"])
            .args(["--progress", "never"]);
        s3_env(&mut c, &s3.url);
        c.output()
    };
    let o = run("s3://bkt/single.parquet").await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("s3://bkt/single.parquet: is an object"), "{}", stderr(&o));
    let o = run("s3://bkt/folder.parquet/").await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("results: s3://bkt/folder.parquet/ (a table"), "{}", stderr(&o));
}
