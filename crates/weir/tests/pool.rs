//! One model, many endpoints (`--base-url` repeated, `--endpoints FILE`): `weir run` against
//! several simulators as one pool.

mod util;

use util::*;
use weir_sim::SimConfig;

fn quota(requests: u64, window_secs: f64) -> SimConfig {
    let mut c = SimConfig::default();
    c.quota.requests_per_window = requests;
    c.quota.window_secs = window_secs;
    c.quota.round_advice = true;
    c.latency.fixed_ms = 20.0;
    c
}

fn run_args<'a>(input: &'a str, out: &'a str, pool: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "run",
        "--model",
        "gemini/gemini-2.5-flash",
        "--input",
        input,
        "--output",
        out,
        "--id-field",
        "key",
        "--progress",
        "never",
        "--max-retries",
        "30",
    ];
    args.extend_from_slice(pool);
    args
}

/// Three endpoints with quotas of 30, 15 and 6 a second: every record once, each endpoint
/// answering about its share of the sum (calls go where there is budget, not round-robin), and
/// the summary naming each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_gets_the_sum_of_its_endpoints_quotas() {
    let sims = [sim(quota(30, 1.0)).await, sim(quota(15, 1.0)).await, sim(quota(6, 1.0)).await];
    let dir = Dir::new("pool-sum");
    let (data, ids) = prompts(400);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let pool: Vec<&str> = urls.iter().flat_map(|u| ["--base-url", u.as_str()]).collect();
    let o = run(&run_args(input.to_str().unwrap(), out.to_str().unwrap(), &pool)).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&out), &[]);
    let answered: Vec<u64> = sims.iter().map(|s| s.stats().successes).collect();
    assert_eq!(answered.iter().sum::<u64>(), 400, "{answered:?}");
    // About 30 : 15 : 6 of 51 (each endpoint held to its own quota; the big one answers most).
    let share = |i: usize| answered[i] as f64 / 400.0;
    assert!((share(0) - 30.0 / 51.0).abs() < 0.12, "{answered:?}");
    assert!((share(1) - 15.0 / 51.0).abs() < 0.12, "{answered:?}");
    assert!((share(2) - 6.0 / 51.0).abs() < 0.08, "{answered:?}");
    let err = stderr(&o);
    for u in &urls {
        assert!(err.contains(&format!("endpoint {u}/")), "{err}");
    }
    assert_eq!(err.matches(": active;").count(), 3, "{err}");
}

/// An endpoint where nothing listens, and one that rejects the key it is called with: both are
/// left (cooled down, dead), their records answered by the third, every record once, and the
/// run ends well. A key stays in the environment: the file names its variable only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_goes_on_without_endpoints_that_refuse_connections_or_the_key() {
    let good = sim(SimConfig { api_keys: vec!["good-key".into()], ..quota(0, 1.0) }).await;
    let strict = sim(SimConfig { api_keys: vec!["other-key".into()], ..quota(0, 1.0) }).await;
    let nothing = format!("http://127.0.0.1:{}", free_port());
    let dir = Dir::new("pool-failover");
    let (data, ids) = prompts(300);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let file = dir.write(
        "pool.toml",
        format!(
            "[[endpoint]]\nbase_url = \"{nothing}\"\nkey_env = \"POOL_KEY_GOOD\"\n\n\
             [[endpoint]]\nname = \"strict\"\nbase_url = \"{}\"\nkey_env = \"POOL_KEY_GOOD\"\n\n\
             [[endpoint]]\nbase_url = \"{}\"\nkey_env = \"POOL_KEY_GOOD\"\nweight = 2\n",
            strict.url(),
            good.url()
        )
        .as_bytes(),
    );
    // No retries at all: a record that met a dead endpoint is tried again elsewhere anyway (it
    // did nothing wrong), not failed.
    let mut args = run_args(input.to_str().unwrap(), out.to_str().unwrap(), &["--endpoints", file.to_str().unwrap()]);
    let at = args.iter().position(|a| *a == "--max-retries").unwrap();
    args[at + 1] = "0";
    let o = weir().args(args).env("POOL_KEY_GOOD", "good-key").output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_each_id_once(&ids, &rows(&out), &[]);
    assert_eq!(good.stats().successes, 300);
    assert_eq!(strict.stats().successes, 0);
    assert!(err.contains("endpoint strict: dead (credentials rejected);"), "{err}");
    assert!(
        err.contains(&format!("endpoint {nothing}/")) && err.contains(": cooling down (connections refused);"),
        "{err}"
    );
    assert!(!err.contains("good-key"), "a key in the output: {err}");
}

/// When every endpoint of the pool rejects its key, the run stops as it would at one endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_every_endpoint_rejects_the_key_stops_the_run() {
    let a = sim(SimConfig { api_keys: vec!["x".into()], ..quota(0, 1.0) }).await;
    let b = sim(SimConfig { api_keys: vec!["y".into()], ..quota(0, 1.0) }).await;
    let dir = Dir::new("pool-dead");
    let (data, _) = prompts(200);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let o = weir()
        .args(run_args(
            input.to_str().unwrap(),
            out.to_str().unwrap(),
            &["--base-url", &a.url(), "--base-url", &b.url()],
        ))
        .env("GEMINI_API_KEY", "z")
        .output()
        .await
        .unwrap();
    let err = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("stopping the run") || err.contains("credentials"), "{err}");
    // The stop names where every endpoint stands, not the last one's error alone.
    assert!(err.contains("no endpoint of the pool is usable"), "{err}");
    assert!(err.contains(&format!("{}/", a.url())) && err.contains(&format!("{}/", b.url())), "{err}");
    assert!(a.stats().requests + b.stats().requests < 100, "kept calling dead endpoints: {err}");
}

/// Pools weir cannot use exit 2 before any call, naming the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_cannot_be_used_exits_2_naming_the_entry() {
    let server = sim(quota(0, 1.0)).await;
    let dir = Dir::new("pool-bad");
    let (data, _) = prompts(5);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let url = server.url();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--base-url".into(), url.clone(), "--base-url".into(), format!("{url}/")], "are the same endpoint"),
        (
            vec!["--endpoints".into(), dir.write("k.toml", b"[[endpoint]]\nkey_env = \"POOL_NOT_SET\"\n").display().to_string()],
            "endpoint 1: key_env \"POOL_NOT_SET\" names an environment variable that is not set",
        ),
        (
            vec!["--endpoints".into(), dir.write("u.toml", b"[[endpoint]]\napi_key = \"secret\"\n").display().to_string()],
            "unknown field `api_key`",
        ),
        (
            vec![
                "--endpoints".into(),
                dir.write("p.toml", format!("[[endpoint]]\nbase_url = \"{url}\"\n[[endpoint]]\nname = \"eu\"\nlocation = \"europe-west4\"\n").as_bytes())
                    .display()
                    .to_string(),
            ],
            "eu: a project or location is for vertex_ai/ models",
        ),
        (vec!["--endpoints".into(), dir.path("missing.toml").display().to_string()], "cannot read it"),
        (
            vec![
                "--endpoints".into(),
                dir.write("s.toml", b"[[endpoint]]\nkey_env = \"AIzaSy-secret-key\"\n").display().to_string(),
            ],
            "key_env must name an environment variable",
        ),
        (
            vec![
                "--endpoints".into(),
                dir.write("w.toml", b"[[endpoint]]\nweight = \"2\"\n").display().to_string(),
            ],
            "line 2",
        ),
        (
            vec![
                "--endpoints".into(),
                dir.write("b.toml", format!("[[endpoint]]\nbase_url = \"{url}\"\n").as_bytes()).display().to_string(),
                "--base-url".into(),
                url.clone(),
            ],
            "--endpoints lists the pool",
        ),
    ];
    for (pool, says) in cases {
        let pool: Vec<&str> = pool.iter().map(String::as_str).collect();
        let o = run(&run_args(input.to_str().unwrap(), out.to_str().unwrap(), &pool)).await;
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{pool:?}: {err}");
        assert!(err.contains(says), "{pool:?}: {err}");
        assert!(!err.contains("secret"), "{err}");
    }
    assert_eq!(server.stats().requests, 0);
}

/// `weir sql` over a pool: each row answered once, over both endpoints, and the summary shows
/// each endpoint as `weir run`'s does.
#[cfg(feature = "sql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_sql_over_a_pool_answers_each_row_once_and_shows_each_endpoint() {
    let a = sim(quota(0, 1.0)).await;
    let b = sim(quota(0, 1.0)).await;
    let dir = Dir::new("pool-sql");
    let (data, _) = prompts(300);
    dir.write("in.jsonl", &data);
    let o = weir()
        .current_dir(&dir.0)
        .args(["sql", "--format", "jsonl", "--base-url", &a.url(), "--base-url", &b.url()])
        .arg("SELECT count(DISTINCT key) AS k, count(llm_generate('gemini/gemini-2.5-flash', prompt)) AS n FROM 'in.jsonl'")
        .output()
        .await
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), r#"{"k":300,"n":300}"#);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!((sa.requests + sb.requests, sa.successes + sb.successes), (300, 300), "{sa:?} {sb:?}");
    assert!(sa.successes > 0 && sb.successes > 0, "{sa:?} {sb:?}");
    for url in [a.url(), b.url()] {
        assert!(err.lines().any(|l| l.contains(&format!("endpoint {url}/")) && l.contains("active")), "{err}");
    }
}
