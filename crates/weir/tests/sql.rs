//! `weir sql` (built with `--features sql`): a Parquet table through `llm_generate` into a
//! Parquet result against the simulator, the summary and its cost, and the exit statuses.
#![cfg(feature = "sql")]

mod util;

use serde_json::Value;
use util::*;
use weir_sim::{SimConfig, SimServer};

/// Rows of a query's result, as JSON objects (`--format jsonl`).
async fn query(dir: &Dir, sql: &str) -> Vec<Value> {
    let out = weir().current_dir(&dir.0).args(["sql", "--format", "jsonl", sql]).output().await.unwrap();
    assert!(out.status.success(), "{sql}: {}", stderr(&out));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_table_through_llm_generate_into_parquet() {
    let dir = Dir::new("sql-parquet");
    let (data, ids) = prompts(300);
    dir.write("in.jsonl", &data);
    // The input as Parquet (DataFusion's own writer; no model involved).
    let made = query(&dir, "COPY (SELECT * FROM 'in.jsonl') TO 'reviews.parquet'").await;
    assert_eq!(made[0]["count"], 300);
    let mut config = SimConfig::default();
    config.quota.requests_per_window = 120;
    config.quota.window_secs = 1.0;
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--base-url", &sim.url(), "--table", "reviews=reviews.parquet"])
        .arg(
            "COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt, '{\"max_tokens\": 64}') AS answer \
             FROM reviews) TO 'answers.parquet'",
        )
        .output()
        .await
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let rows = query(&dir, "SELECT key, answer FROM 'answers.parquet'").await;
    let mut seen: Vec<String> = rows.iter().map(|r| r["key"].as_str().unwrap().to_string()).collect();
    assert!(rows.iter().all(|r| r["answer"].as_str().is_some_and(|a| !a.is_empty())));
    seen.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(seen, expected, "every row answered exactly once");
    let stats = sim.stats();
    assert_eq!(stats.requests - stats.rate_limited, 300, "one successful call per row");
    // The summary: calls, refusals and tokens, and the cost at the price table's rate.
    assert!(err.contains("model calls for 300 rows: 300 succeeded, 0 failed"), "{err}");
    assert!(err.contains(&format!("calls {} (", stats.requests)), "{err}");
    assert!(err.contains("cost: about $") && err.contains("gemini-2.5-flash at $0.3/$2.5"), "{err}");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_rows_are_null_and_the_exit_status_says_so() {
    let dir = Dir::new("sql-status");
    let sql = "SELECT p, llm_generate('sim/demo', p) AS a, llm_generate_result('sim/demo', p)['error_kind'] AS k \
               FROM (VALUES ('status: fine'), ('status: [sim:block_prompt]')) AS t(p) ORDER BY p";
    let out = weir().current_dir(&dir.0).args(["sql", "--format", "jsonl", sql]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let rows: Vec<Value> =
        String::from_utf8(out.stdout.clone()).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["k"], "blocked");
    assert!(rows[0].get("a").is_none_or(Value::is_null), "{rows:?}");
    assert!(rows[1]["a"].as_str().is_some_and(|a| !a.is_empty()) && rows[1].get("k").is_none_or(Value::is_null));
    assert!(stderr(&out).contains("failed rows by kind: blocked 2"), "{}", stderr(&out));
}

#[tokio::test]
async fn problems_with_the_query_or_flags_exit_2_with_what_to_fix() {
    let dir = Dir::new("sql-usage");
    dir.write("t.jsonl", b"{\"prompt\": \"x\"}\n");
    for (args, expect) in [
        (vec!["sql", "SELECT * FROM nowhere"], "nowhere"),
        (vec!["sql", "SELEC 1"], "SELEC"),
        (vec!["sql", "--table", "t", "SELECT 1"], "NAME=PATH"),
        (vec!["sql", "--table", "1t=t.jsonl", "SELECT 1"], "letters, digits"),
        (vec!["sql", "--table", "t=t.txt", "SELECT 1"], "cannot tell the format"),
        (
            vec!["sql", "--table", "t=t.jsonl", "SELECT llm_generate('openai/gpt-4o-mini', prompt) FROM t"],
            "OPENAI_API_KEY",
        ),
        (
            vec!["sql", "--table", "t=t.jsonl", "SELECT llm_generate('sim/demo', prompt, '{\"temp\": 1}') FROM t"],
            "temp",
        ),
        (vec!["sql", "--max-concurrency", "0", "SELECT 1"], "--max-concurrency"),
        // Results CSV cannot hold are refused before any call, printed or copied.
        (
            vec![
                "sql",
                "--format",
                "csv",
                "--table",
                "t=t.jsonl",
                "SELECT llm_generate_result('sim/demo', prompt) AS r FROM t",
            ],
            "CSV cannot hold column r (a struct)",
        ),
        (
            vec!["sql", "--table", "t=t.jsonl", "COPY (SELECT llm_embed('sim/demo', prompt) AS v FROM t) TO 'v.csv'"],
            "CSV cannot hold column v (a list)",
        ),
        // A prompt that is no text: DataFusion's "internal error" is replaced by what to do.
        (vec!["sql", "SELECT llm_generate('sim/demo', struct(1 AS a))"], "CAST(x AS VARCHAR)"),
        (vec!["sql", "--cluster", "df://127.0.0.1", "SELECT 1"], "df://HOST:PORT"),
        (vec!["sql", "  ; "], "no SQL given"),
    ] {
        let out = weir().current_dir(&dir.0).args(&args).output().await.unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(expect), "{args:?}: {}", stderr(&out));
    }
    assert!(!dir.path("v.csv").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_fails_leaves_the_earlier_file_as_it_was() {
    let dir = Dir::new("sql-copy-fails");
    let (data, _) = prompts(50);
    dir.write("in.jsonl", &data);
    let copy = |options: &str| {
        format!("COPY (SELECT key, llm_generate('sim/demo', prompt, '{options}') AS a FROM t) TO 'answers.parquet'")
    };
    let out = weir().current_dir(&dir.0).args(["sql", "--table", "t=in.jsonl", &copy("{}")]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let before = std::fs::read(dir.path("answers.parquet")).unwrap();
    // The same COPY, strict, over a table with one refused prompt: it fails part-way.
    let mut lines: Vec<u8> = data.clone();
    lines.extend_from_slice(b"{\"key\": \"bad\", \"prompt\": \"[sim:block_prompt]\"}\n");
    dir.write("in.jsonl", &lines);
    let strict = copy(r#"{"fail_on_error": true}"#);
    let out = weir().current_dir(&dir.0).args(["sql", "--table", "t=in.jsonl", &strict]).output().await.unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("prompt \"[sim:block_prompt]\" failed") && err.contains("is as it was"), "{err}");
    assert_eq!(std::fs::read(dir.path("answers.parquet")).unwrap(), before, "the earlier result is untouched");
    let names: Vec<String> =
        std::fs::read_dir(&dir.0).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.contains("weir-partial")), "{names:?}");
    // Issue #29, item 21: EXPLAIN ANALYZE runs the COPY too, and is staged the same way.
    let explained = format!("EXPLAIN ANALYZE {strict}");
    let out = weir().current_dir(&dir.0).args(["sql", "--table", "t=in.jsonl", &explained]).output().await.unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("is as it was"), "{err}");
    assert_eq!(std::fs::read(dir.path("answers.parquet")).unwrap(), before, "EXPLAIN ANALYZE kept the earlier result");
    // Without fail_on_error it succeeds and replaces the file: 51 rows, one NULL.
    let rows = query(&dir, "SELECT count(*) AS n FROM 'answers.parquet'").await;
    assert_eq!(rows[0]["n"], 50);
    let out = weir().current_dir(&dir.0).args(["sql", "--table", "t=in.jsonl", &copy("{}")]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let rows = query(&dir, "SELECT count(*) AS n, count(a) AS answered FROM 'answers.parquet'").await;
    assert_eq!((rows[0]["n"].as_u64(), rows[0]["answered"].as_u64()), (Some(51), Some(50)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_endpoint_or_an_unwritable_target_keeps_the_earlier_file_and_pays_nothing_more() {
    let dir = Dir::new("sql-stopped");
    let (data, _) = prompts(200);
    dir.write("in.jsonl", &data);
    dir.write("answers.parquet", b"an earlier result");
    let copy = "COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM t) TO 'answers.parquet'";
    // A key the endpoint rejects: the calls stop early, and the query fails rather than write
    // 200 NULLs over the earlier file.
    let config = SimConfig { api_keys: vec!["right-key".into()], ..Default::default() };
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let out = weir()
        .current_dir(&dir.0)
        .env("GEMINI_API_KEY", "wrong-key")
        .args(["sql", "--base-url", &sim.url(), "--table", "t=in.jsonl", copy])
        .output()
        .await
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("stopped early (auth"), "{err}");
    assert!(sim.stats().requests < 20, "{} calls", sim.stats().requests);
    assert_eq!(std::fs::read(dir.path("answers.parquet")).unwrap(), b"an earlier result");
    // Fewer rows than the rule that stops on rejected credentials counts (it needs three calls):
    // every call refused is that stop too, not a file of NULLs and exit 1.
    let one = copy.replace("FROM t)", "FROM t LIMIT 1)");
    let out = weir()
        .current_dir(&dir.0)
        .env("GEMINI_API_KEY", "wrong-key")
        .args(["sql", "--no-cache", "--base-url", &sim.url(), "--table", "t=in.jsonl", &one])
        .output()
        .await
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("every call was refused for its credentials"), "{err}");
    assert_eq!(std::fs::read(dir.path("answers.parquet")).unwrap(), b"an earlier result");
    sim.shutdown().await;
    // Too few or too many arguments are said as such (it said they "must be text").
    for (sql, n) in [
        ("SELECT llm_generate('sim/demo') AS a", "1 argument"),
        ("SELECT llm_embed('sim/demo', 'x', '{}', 'a', 'b', 'c', 'd', 'e') AS a", "8 arguments"),
    ] {
        let out = weir().current_dir(&dir.0).args(["sql", sql]).output().await.unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains(&format!("it was given {n}")), "{}", stderr(&out));
    }
    // A target that cannot be written: refused before any call.
    let sim = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    for target in ["/proc/out.parquet", "in.jsonl/out.parquet"] {
        let sql = copy.replace("answers.parquet", target);
        let out = weir()
            .current_dir(&dir.0)
            .args(["sql", "--base-url", &sim.url(), "--table", "t=in.jsonl", &sql])
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{target}: {}", stderr(&out));
        assert!(stderr(&out).contains("cannot write there"), "{}", stderr(&out));
    }
    assert_eq!(sim.stats().requests, 0);
    sim.shutdown().await;
    // A misspelt model in a column fails its rows, counted (exit 1), the others answered.
    dir.write("models.jsonl", b"{\"m\": \"sim/demo\", \"p\": \"a\"}\n{\"m\": \"gemini-2.5-flash\", \"p\": \"b\"}\n");
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--table", "t=models.jsonl", "SELECT llm_generate(m, p) AS a FROM t"])
        .output()
        .await
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("invalid_input 1"), "{err}");
}

#[tokio::test]
async fn empty_prompts_fail_without_a_call_and_an_empty_result_prints_its_header() {
    let dir = Dir::new("sql-edges");
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--format", "jsonl"])
        .arg("SELECT llm_generate_result('sim/demo', p)['error_kind'] AS k FROM (VALUES (''), ('  ')) AS t(p)")
        .output()
        .await
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).matches("invalid_input").count(), 2);
    assert!(err.contains("calls 0 (") && err.contains("invalid_input 2"), "{err}");
    let out = weir().current_dir(&dir.0).args(["sql", "SELECT 1 AS one WHERE false"]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("| one |"), "{}", String::from_utf8_lossy(&out.stdout));
}

/// Tables in S3 (moto, on 127.0.0.1): a glob of Parquet objects in, `COPY … TO 's3://…'` out,
/// read back with pyarrow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_tables_in_and_out() {
    let Some(s3) = moto().await else { return };
    let dir = Dir::new("sql-s3");
    let (data, keys) = prompts(120);
    dir.write("in.jsonl", &data);
    let sql = |query: String| {
        let mut c = weir();
        c.current_dir(&dir.0).args(["sql", &query]);
        s3_env(&mut c, &s3.url);
        c
    };
    for part in 0..2 {
        let copy = format!("COPY (SELECT * FROM 'in.jsonl' WHERE n % 2 = {part}) TO 's3://bkt/in/p{part}.parquet'");
        let out = sql(copy).output().await.unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let mut c = sql(
        "COPY (SELECT key, llm_generate('sim/demo', prompt) AS answer FROM reviews) TO 's3://bkt/out/answers.parquet'"
            .into(),
    );
    c.args(["--table", "reviews=s3://bkt/in/*.parquet"]);
    let out = c.output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let listed = python(
        r#"
import sys, io, boto3, pyarrow.parquet as pq
s3 = boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1")
body = s3.get_object(Bucket="bkt", Key="out/answers.parquet")["Body"].read()
t = pq.read_table(io.BytesIO(body))
keys = [o["Key"] for o in s3.list_objects_v2(Bucket="bkt", Prefix="out/")["Contents"]]
assert keys == ["out/answers.parquet"], keys
for k, a in zip(t.column("key").to_pylist(), t.column("answer").to_pylist()):
    print(k, "ok" if a else "null")
"#,
        &[&s3.url],
    );
    let mut seen: Vec<String> = listed.lines().map(|l| l.split(' ').next().unwrap().to_string()).collect();
    assert!(listed.lines().all(|l| l.ends_with(" ok")), "{listed}");
    seen.sort();
    let mut expected = keys;
    expected.sort();
    assert_eq!(seen, expected);
}

/// Issue #29, item 23: a call inside a window function or an ORDER BY is a usage error that
/// says how to write it (it was DataFusion's "internal error … file a bug"), before any call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_where_datafusion_cannot_compute_it_says_how_to_write_it() {
    let dir = Dir::new("sql-async-places");
    let (data, _) = prompts(5);
    dir.write("t.jsonl", &data);
    for sql in [
        "SELECT key, row_number() OVER (PARTITION BY llm_generate('sim/demo', prompt)) AS n FROM t",
        "SELECT key FROM t ORDER BY llm_generate('sim/demo', prompt)",
    ] {
        let out = weir().current_dir(&dir.0).args(["sql", "--table", "t=t.jsonl", sql]).output().await.unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{sql}: {err}");
        assert!(err.contains("compute the call in a subquery or a WITH clause"), "{sql}: {err}");
    }
    let with =
        "WITH a AS (SELECT *, llm_generate('sim/demo', prompt) AS answer FROM t) SELECT key FROM a ORDER BY answer";
    let out = weir().current_dir(&dir.0).args(["sql", "--table", "t=t.jsonl", with]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// Issue #29, item 22: a model a column misspells, which the endpoint answers 404, fails its
/// own rows (NULL, with the reason in `llm_generate_result`); the other rows are answered and
/// written. It used to fail the statement after paying for every other row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_the_endpoint_does_not_have_fails_only_its_rows() {
    let config = SimConfig { models: vec!["gemini-2.5-flash".into()], ..SimConfig::default() };
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let dir = Dir::new("sql-misspelt");
    let mut data = Vec::new();
    for i in 0..60 {
        let m = if i % 20 == 7 { "gemini/gemini-2.5-flsh" } else { "gemini/gemini-2.5-flash" };
        data.extend(format!("{{\"k\": {i}, \"m\": \"{m}\", \"p\": \"say {i}\"}}\n").into_bytes());
    }
    dir.write("t.jsonl", &data);
    let copy = "COPY (SELECT k, llm_generate(m, p) AS a FROM t) TO 'out.jsonl'";
    let out = weir()
        .current_dir(&dir.0)
        .env("GEMINI_API_KEY", "k")
        .args(["sql", "--base-url", &sim.url(), "--table", "t=t.jsonl", copy])
        .output()
        .await
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let rows: Vec<Value> = std::fs::read_to_string(dir.path("out.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 60, "{err}");
    assert_eq!(rows.iter().filter(|r| r["a"].is_string()).count(), 57, "{err}");
    assert!(err.contains("endpoint"), "{err}");
    sim.shutdown().await;
}

/// `weir sql` keeps a response cache in `.weir/` of the working directory (or `--state DIR`):
/// the same deterministic query run again makes no calls and gives the same answers;
/// `--no-cache` asks again; sampled calls without an id are never reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_of_a_deterministic_query_is_answered_from_the_cache() {
    let dir = Dir::new("sql-cache");
    let mut data = String::new();
    for i in 0..20 {
        data.push_str(&format!("{{\"key\": {i}, \"prompt\": \"cache me {i}\"}}\n"));
    }
    dir.write("t.jsonl", data.as_bytes());
    let sql = |options: &str| {
        format!("SELECT key, llm_generate('sim/demo', prompt, '{options}') AS a FROM 't.jsonl' ORDER BY key")
    };
    let calls = |err: &str| -> u64 {
        let at = err.find(": calls ").unwrap_or_else(|| panic!("{err}"));
        err[at + 8..].split_whitespace().next().unwrap().replace(',', "").parse().unwrap()
    };
    let go = |args: Vec<String>| {
        let dir = dir.0.clone();
        async move {
            let o = weir().current_dir(&dir).arg("sql").args(["--format", "jsonl"]).args(&args).output().await.unwrap();
            assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
            (String::from_utf8_lossy(&o.stdout).to_string(), stderr(&o))
        }
    };
    let deterministic = sql("{\"temperature\": 0}");
    let (first, err) = go(vec![deterministic.clone()]).await;
    assert_eq!(calls(&err), 20, "{err}");
    assert!(dir.0.join(".weir/cache").is_dir(), "no cache in .weir/");
    let (second, err) = go(vec![deterministic.clone()]).await;
    assert_eq!(calls(&err), 0, "the second run paid again: {err}");
    assert!(err.contains("tokens 0 in, 0 out; 20 rows answered from the cache"), "{err}");
    assert_eq!(first, second, "the cache gave other answers");
    let (_, err) = go(vec!["--no-cache".into(), deterministic.clone()]).await;
    assert_eq!(calls(&err), 20, "--no-cache: {err}");
    // Another state directory is another cache.
    let (_, err) = go(vec!["--state".into(), "elsewhere".into(), deterministic]).await;
    assert_eq!(calls(&err), 20, "--state elsewhere: {err}");
    // Sampled answers belong to no row: asked again every time.
    let sampled = sql("{}");
    go(vec![sampled.clone()]).await;
    let (_, err) = go(vec![sampled]).await;
    assert_eq!(calls(&err), 20, "a sampled answer was reused: {err}");
}

/// Issue #35 in SQL: media arguments after the options (a path as text, the bytes as binary)
/// go inline once per row; with a literal `response_schema` in the options, `llm_generate`
/// returns a struct of the schema's fields, which SQL can take apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_arguments_and_a_schema_give_a_struct_per_row() {
    use base64::Engine;
    let dir = Dir::new("sql-media");
    let mut lines = String::new();
    for i in 0..6 {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
        png.extend_from_slice(format!("sql image {i}").as_bytes());
        let path = dir.write(&format!("p{i}.png"), &png);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
        lines.push_str(&format!("{{\"key\":\"k{i}\",\"path\":\"{}\",\"b64\":\"{b64}\"}}\n", path.display()));
    }
    dir.write("photos.jsonl", lines.as_bytes());
    let sim = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let options = r#"{"response_schema": {"type": "object", "properties": {"label": {"type": "string"}, "score": {"type": "number"}}, "required": ["label", "score"]}}"#;
    let sql = format!(
        "SELECT key, llm_generate('gemini/gemini-2.5-flash', 'classify', '{options}', path) AS by_path, \
         llm_generate('gemini/gemini-2.5-flash', 'classify', '{options}', decode(b64, 'base64'))['label'] AS label, \
         llm_generate('gemini/gemini-2.5-flash', 'caption', '{{\"response_schema\": {{\"type\": \"string\"}}}}') AS caption \
         FROM photos ORDER BY key"
    );
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--base-url", &sim.url(), "--table", "photos=photos.jsonl", "--format", "jsonl", &sql])
        .output()
        .await
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let rows: Vec<Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 6, "{err}");
    for r in &rows {
        assert!(r["by_path"]["label"].is_string() && r["by_path"]["score"].is_number(), "a struct: {r}");
        assert!(r["label"].is_string(), "a field of the struct: {r}");
        assert_eq!(r["by_path"]["label"], r["label"], "the same image by path and as bytes: {r}");
        let caption = r["caption"].as_str().unwrap_or_default();
        assert!(!caption.is_empty() && !caption.starts_with('"'), "a string schema's answer is its text: {r}");
    }
    let s = sim.stats();
    // Each image once by path; the same bytes again are answered from the cache or called once.
    assert!(s.media_parts >= 6 && s.media_parts <= 12, "{}", s.media_parts);
    let captions = s.requests - s.media_parts;
    assert!((1..=6).contains(&captions), "every call carried its image but the captions': {captions}");
    // A media argument of a type that holds no media is refused before any call.
    let bad = weir()
        .current_dir(&dir.0)
        .args(["sql", "--base-url", &sim.url(), "--table", "photos=photos.jsonl"])
        .arg("SELECT llm_generate('gemini/gemini-2.5-flash', 'classify', '{}', 42) FROM photos")
        .output()
        .await
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("is media"), "{}", stderr(&bad));
    assert_eq!(sim.stats().requests, s.requests);
    sim.shutdown().await;
}
