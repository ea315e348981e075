//! Issue #35: answers checked against the response schema. The simulator answers requests with
//! a schema in JSON of its shape, and cuts a share of them in half (not JSON); weir parses and
//! validates every answer, asks again for one that fails (`invalid_output`, counted in the
//! summary, apart from --max-retries), and writes what still fails as an error row quoting it.

mod util;

use util::*;

const SCHEMA: &str = r#"{"type": "object",
  "properties": {"label": {"type": "string", "enum": ["shoe", "hat", "bag"]}, "score": {"type": "number"},
                 "tags": {"type": "array", "items": {"type": "string"}}},
  "required": ["label", "score", "tags"], "additionalProperties": false}"#;

fn input(dir: &Dir, n: usize) -> std::path::PathBuf {
    let data: String = (0..n).map(|i| format!("{{\"id\":\"r{i}\",\"prompt\":\"classify item {i}\"}}\n")).collect();
    dir.write("in.jsonl", data.as_bytes())
}

async fn classify(sim: &weir_sim::SimServer, dir: &Dir, model: &str, n: usize, extra: &[&str]) -> std::process::Output {
    let schema = dir.write("schema.json", SCHEMA.as_bytes());
    let base = if model.starts_with("openai/") { format!("{}/v1", sim.url()) } else { sim.url() };
    let (input, out) = (input(dir, n), dir.path("out.jsonl"));
    weir()
        .env("OPENAI_API_KEY", "sk-test")
        .args(["run", "--model", model, "--base-url", &base, "--progress", "never", "--id-field", "id"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .args(["--param", &format!("response_schema=@{}", schema.display())])
        .args(extra)
        .output()
        .await
        .unwrap()
}

/// Every row's answer is JSON of the schema's shape.
fn assert_valid(rows: &[serde_json::Value]) {
    for r in rows {
        let v: serde_json::Value = serde_json::from_str(r["response"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("row {} is not JSON ({e}): {r}", r["id"]));
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 3, "{v}");
        assert!(["shoe", "hat", "bag"].contains(&v["label"].as_str().unwrap()), "{v}");
        assert!(v["score"].is_number() && v["tags"].as_array().is_some_and(|t| t.iter().all(|x| x.is_string())), "{v}");
    }
}

/// 10 % of the answers broken: every row valid against the schema, the broken answers asked
/// for again and counted, every call the simulator saw accounted for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_answers_are_asked_again_until_every_row_matches_the_schema() {
    for model in ["gemini/gemini-2.5-flash", "openai/gpt-4o-mini"] {
        let mut cfg = weir_sim::SimConfig::default();
        cfg.output.invalid_json_rate = 0.1;
        let sim = sim(cfg).await;
        let dir = Dir::new(&format!("schema-retry-{}", model.replace('/', "-")));
        // Six tries: a record broken six times running (10^-6 each) does not make the test flaky.
        let o = classify(&sim, &dir, model, 300, &["--max-invalid-retries", "5"]).await;
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{model}: {err}");
        let out = rows(&dir.path("out.jsonl"));
        assert_eq!(out.len(), 300, "{err}");
        assert!(rows(&dir.path("out.errors.jsonl")).is_empty(), "{err}");
        assert_valid(&out);
        let line = err.lines().find(|l| l.contains("invalid_output:")).unwrap_or_else(|| panic!("{model}: {err}"));
        let invalid: u64 = line.split_whitespace().nth(1).unwrap().replace(',', "").parse().unwrap();
        assert!((10..=70).contains(&invalid), "{model}: about 30 of 330 broken: {line}");
        assert_eq!(sim.stats().requests, 300 + invalid, "{model}: every call is one answer or one broken answer");
        sim.shutdown().await;
    }
}

/// Every answer broken, one retry allowed: each record is an `invalid_output` error row after
/// two calls, quoting what came back; the record is not cached as answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_never_match_become_error_rows_quoting_them() {
    let mut cfg = weir_sim::SimConfig::default();
    cfg.output.invalid_json_rate = 1.0;
    let sim = sim(cfg).await;
    let dir = Dir::new("schema-never");
    let o = classify(&sim, &dir, "gemini/gemini-2.5-flash", 20, &["--max-invalid-retries", "1"]).await;
    let err = stderr(&o);
    assert!(rows(&dir.path("out.jsonl")).is_empty(), "{err}");
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 20, "{err}");
    for e in &errors {
        assert_eq!(e["kind"], "invalid_output", "{e}");
        assert_eq!(e["attempts"], 2, "{e}");
        let m = e["message"].as_str().unwrap();
        assert!(m.contains("not JSON") && m.contains("answer: {\""), "{e}");
    }
    assert_eq!(sim.stats().requests, 40);
    assert!(err.contains("invalid_output: 40 answers"), "{err}");
    sim.shutdown().await;
}

/// A schema that is not one is a usage error before any call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_that_does_not_compile_is_a_usage_error() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("schema-bad");
    let input = input(&dir, 3);
    let o = weir()
        .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &sim.url(), "--progress", "never"])
        .args(["--input", input.to_str().unwrap(), "--output", dir.path("out.jsonl").to_str().unwrap()])
        .args(["--param", r#"response_schema={"type": "no-such-type"}"#])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("response schema"), "{}", stderr(&o));
    // Each invalid retry is paid for: a number past 10 is a slip, refused before any call.
    let o = classify(&sim, &dir, "gemini/gemini-2.5-flash", 3, &["--max-invalid-retries", "1000000"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--max-invalid-retries 1000000: at most 10"), "{}", stderr(&o));
    assert_eq!(sim.stats().requests, 0);
    sim.shutdown().await;
}

/// Batch jobs' answers are checked too: a broken one goes to a follow-up job (or online, with
/// `--fallback online`), and every row written matches the schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_answers_of_batch_jobs_go_to_follow_up_jobs() {
    let mut cfg = weir_sim::SimConfig::default();
    cfg.output.invalid_json_rate = 0.1;
    cfg.batch.run_secs = 0.2;
    let sim = sim(cfg).await;
    let dir = Dir::new("schema-batch");
    let extra = ["--mode", "batch", "--poll-secs", "0.1", "--fallback", "online", "--job-max-requests", "100"];
    let o = classify(&sim, &dir, "gemini/gemini-2.5-flash", 300, &extra).await;
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let out = rows(&dir.path("out.jsonl"));
    assert_eq!(out.len(), 300, "{err}");
    assert_valid(&out);
    let line = err.lines().find(|l| l.contains("invalid_output:")).unwrap_or_else(|| panic!("{err}"));
    let invalid: u64 = line.split_whitespace().nth(1).unwrap().replace(',', "").parse().unwrap();
    assert!(invalid >= 10, "about 30 of 330 broken: {line}");
    // Three jobs from the input, and follow-ups for the broken answers.
    assert!(sim.stats().batch_jobs > 3, "{err}");
    sim.shutdown().await;
}

/// Parquet out with a response schema: the `response` column is a struct of the schema's
/// fields (read back by pyarrow), not a JSON string; CSV keeps the JSON text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_output_gets_a_typed_response_column() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("schema-parquet");
    let schema = dir.write("schema.json", SCHEMA.as_bytes());
    let input = input(&dir, 50);
    for out in ["out.parquet", "out.csv"] {
        let o = weir()
            .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &sim.url(), "--progress", "never"])
            .args(["--id-field", "id", "--input", input.to_str().unwrap(), "--output", dir.path(out).to_str().unwrap()])
            .args(["--param", &format!("response_schema=@{}", schema.display())])
            .output()
            .await
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{out}: {}", stderr(&o));
    }
    let got = python(
        r#"
import sys, json, pyarrow.parquet as pq, pyarrow.csv as pc
t = pq.read_table(sys.argv[1])
print(t.schema.field("response").type)
rows = t.to_pylist()
assert len(rows) == 50, len(rows)
for r in rows:
    v = r["response"]
    assert v["label"] in ("shoe", "hat", "bag") and isinstance(v["score"], float) and all(isinstance(x, str) for x in v["tags"]), v
c = pc.read_csv(sys.argv[2]).to_pylist()
assert len(c) == 50 and all(json.loads(r["response"])["label"] for r in c), c[0]
"#,
        &[dir.path("out.parquet").to_str().unwrap(), dir.path("out.csv/part-00000.csv").to_str().unwrap()],
    );
    assert!(got.contains("struct<label: string, score: double, tags: list<"), "{got}");
    // A string schema's answers are JSON strings: the column holds their text, no quotes.
    let o = weir()
        .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &sim.url(), "--progress", "never"])
        .args(["--id-field", "id", "--input", input.to_str().unwrap()])
        .args(["--output", dir.path("text.parquet").to_str().unwrap()])
        .args(["--param", r#"response_schema={"type": "string"}"#])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let got = python(
        r#"
import sys, pyarrow.parquet as pq
t = pq.read_table(sys.argv[1])
print(t.schema.field("response").type)
for r in t.to_pylist():
    assert r["response"] and not r["response"].startswith('"'), r
"#,
        &[dir.path("text.parquet").to_str().unwrap()],
    );
    assert!(got.trim() == "string", "{got}");
    sim.shutdown().await;
}
