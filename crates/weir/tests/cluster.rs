//! `weir sql --cluster` (built with `--features cluster`): a Ballista scheduler and two weir
//! executors on 127.0.0.1 answer a query's rows together, each row exactly once.
#![cfg(feature = "cluster")]

mod util;

use serde_json::Value;
use util::*;
use weir_sim::{SimConfig, SimServer};

/// The sum of the series of counter `name` whose labels include `label` (every model's and
/// endpoint's series of it).
fn counter(page: &str, name: &str, label: &str) -> u64 {
    page.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// How many processes the executor serving metrics on `port` saw sharing its quota.
async fn quota_shared_by(port: u16) -> Option<f64> {
    metrics(port)
        .await
        .lines()
        .find(|l| l.starts_with("weir_quota_processes{"))
        .and_then(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
}

/// The most processes any of the executors serving metrics on `ports` saw sharing a quota
/// (an executor that ran no task has called no endpoint, and shows none), once their gauges
/// (updated every second) show it: for up to 3 s.
async fn most_sharing(ports: &[u16]) -> Option<f64> {
    let mut most = None;
    for _ in 0..30 {
        for p in ports {
            if let Some(n) = quota_shared_by(*p).await {
                most = Some(most.map_or(n, |m: f64| m.max(n)));
            }
        }
        if most.is_some_and(|m| m >= 2.0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    most
}

/// A stranger who asks the scheduler's quota service (at `addr`) to admit a call, as an
/// executor would but without the cluster's credentials, is answered nothing and closed.
async fn stranger_gets_nothing_from_quota_service(addr: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let hello = r#"{"quota":"00000000000000000000abcd","told":{"max_concurrency":4,"adaptive":false,"requests":null,"tokens":null,"window_ms":60000,"learn":true,"sre_k":null}}"#;
    let _ = s.write_all(format!("{hello}\n{{\"admit\":{{\"id\":0,\"tokens\":1}}}}\n").as_bytes()).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(15), s.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the quota service held a stranger's connection open");
    assert!(!String::from_utf8_lossy(&got).contains("granted"), "a stranger was granted a call: {got:?}");
}

/// A free port for a scheduler whose quota service (the port below) is free too.
fn scheduler_port() -> u16 {
    loop {
        let p = free_port();
        if p > 2
            && std::net::TcpListener::bind(("127.0.0.1", p - 1)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.2", p - 1)).is_ok()
        {
            return p;
        }
    }
}

async fn metrics(port: u16) -> String {
    let url = format!("http://127.0.0.1:{port}/metrics");
    reqwest::get(&url).await.unwrap().text().await.unwrap()
}

/// A scheduler and executors on 127.0.0.1 calling `sim`; the processes end with the test.
struct Cluster {
    scheduler: u16,
    executors: Vec<tokio::process::Child>,
    metric_ports: Vec<u16>,
    /// The scheduler's live page of the cluster (`--ui`).
    ui_port: u16,
    /// Each executor's ports: Flight, gRPC, metrics.
    ports: Vec<(u16, u16, u16)>,
    _scheduler: tokio::process::Child,
}

impl Cluster {
    /// Executors started in `dir`, so that their queries may read and write there (only).
    async fn start(sim: &SimServer, executors: usize, dir: &std::path::Path) -> Cluster {
        Self::start_with(sim, executors, dir, &[]).await
    }

    /// As [`Cluster::start`], with more flags for each executor.
    async fn start_with(sim: &SimServer, executors: usize, dir: &std::path::Path, extra: &[&str]) -> Cluster {
        let scheduler = scheduler_port();
        let ui_port = free_port();
        let sched = weir()
            .current_dir(dir)
            .args(["cluster", "scheduler", "--bind", &format!("127.0.0.1:{scheduler}")])
            .args(["--ui", &format!("127.0.0.1:{ui_port}")])
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        wait_for_port(scheduler).await;
        wait_for_port(ui_port).await;
        let mut children = Vec::new();
        let mut metric_ports = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..executors {
            let at = (free_port(), free_port(), free_port());
            children.push(Self::executor(sim, dir, scheduler, extra, at).await);
            metric_ports.push(at.2);
            ports.push(at);
        }
        Cluster { scheduler, executors: children, metric_ports, ui_port, ports, _scheduler: sched }
    }

    /// An executor of the scheduler at port `scheduler`, at `ports` (Flight, gRPC, metrics),
    /// once it listens.
    async fn executor(
        sim: &SimServer,
        dir: &std::path::Path,
        scheduler: u16,
        extra: &[&str],
        (port, grpc, mport): (u16, u16, u16),
    ) -> tokio::process::Child {
        let child = weir()
            .current_dir(dir)
            .args(["cluster", "executor", "--scheduler", &format!("127.0.0.1:{scheduler}")])
            .arg("--work-dir")
            .arg(dir.join("work"))
            .args(extra)
            .args(["--port", &port.to_string(), "--grpc-port", &grpc.to_string(), "--slots", "2"])
            .args(["--metrics-listen", &format!("127.0.0.1:{mport}"), "--base-url", &sim.url()])
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        wait_for_port(port).await;
        wait_for_port(mport).await;
        child
    }
}

/// A cluster on 127.0.0.2 behind its guards, for the tests of who gets in: the scheduler and
/// each executor started in `dir` with their own credentials (TLS flags, or a token).
struct Guarded {
    scheduler: u16,
    /// The last executor's Flight port.
    flight: u16,
    /// Held so that the executors end with the cluster.
    _executors: Vec<tokio::process::Child>,
    _scheduler: tokio::process::Child,
}

impl Guarded {
    /// The scheduler with `scheduler_args`; an executor for each of `executors`: its flags,
    /// and its token in `WEIR_CLUSTER_TOKEN` (as a service manager would give it) if any.
    async fn start(
        dir: &std::path::Path,
        sim: &SimServer,
        scheduler_args: &[String],
        executors: &[(Vec<String>, Option<&str>)],
    ) -> Guarded {
        let scheduler = scheduler_port();
        let sched = weir()
            .current_dir(dir)
            .args(["cluster", "scheduler", "--bind", &format!("127.0.0.2:{scheduler}")])
            .args(scheduler_args)
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        wait_for_port(scheduler).await;
        let (mut children, mut flight) = (Vec::new(), 0);
        for (args, token) in executors {
            let (port, grpc) = (free_port(), free_port());
            flight = port;
            let mut cmd = weir();
            cmd.current_dir(dir)
                .args(["cluster", "executor", "--scheduler", &format!("127.0.0.2:{scheduler}"), "--host", "127.0.0.2"])
                .args(["--port", &port.to_string(), "--grpc-port", &grpc.to_string(), "--slots", "2"])
                .args(["--base-url", &sim.url()])
                .args(args)
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true);
            if let Some(t) = token {
                cmd.env("WEIR_CLUSTER_TOKEN", t);
            }
            children.push(cmd.spawn().unwrap());
            wait_for_port(port).await;
        }
        Guarded { scheduler, flight, _executors: children, _scheduler: sched }
    }
}

/// `n` prompts in `dir`/in.jsonl, split by `weir sql` into `parts` Parquet files under
/// `dir`/parts; the prompts' keys.
async fn parted_input(dir: &Dir, n: usize, parts: usize) -> Vec<String> {
    let (data, keys) = prompts(n);
    dir.write("in.jsonl", &data);
    std::fs::create_dir(dir.path("parts")).unwrap();
    for i in 0..parts {
        let copy = format!("COPY (SELECT * FROM 'in.jsonl' WHERE n % {parts} = {i}) TO 'parts/p{i}.parquet'");
        let out = weir().current_dir(&dir.0).args(["sql", &copy]).output().await.unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
    keys
}

/// Runs `cmd` to its end; over 60 s fails the test (a hang, not a slow run).
async fn bounded(cmd: &mut tokio::process::Command) -> std::process::Output {
    let run = cmd.kill_on_drop(true).output();
    tokio::time::timeout(std::time::Duration::from_secs(60), run).await.expect("hung").unwrap()
}

/// The rows of `path` answer every key of `keys` exactly once.
fn assert_every_row_once(path: &std::path::Path, keys: &[String]) {
    let mut seen: Vec<String> = rows(path).iter().map(|r| r["key"].as_str().unwrap().to_string()).collect();
    seen.sort();
    let mut expected = keys.to_vec();
    expected.sort();
    assert_eq!(seen, expected, "every row exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_executors_answer_every_row_once() {
    let dir = Dir::new("cluster");
    // Four files, so the scan has partitions to spread.
    let keys = parted_input(&dir, 800, 4).await;
    let sim = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let Cluster { scheduler, mut executors, metric_ports, _scheduler: _sched, .. } =
        Cluster::start(&sim, 2, &dir.0).await;
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--cluster", &format!("df://127.0.0.1:{scheduler}"), "--partitions", "4"])
        .args(["--table", "reviews=parts"])
        .arg(
            "COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS answer FROM reviews) \
             TO 'answers.parquet'",
        )
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // Read back on this machine (no model involved).
    let read = weir()
        .current_dir(&dir.0)
        .args(["sql", "--format", "jsonl", "SELECT key, answer FROM 'answers.parquet'"])
        .output()
        .await
        .unwrap();
    assert!(read.status.success(), "{}", stderr(&read));
    let rows: Vec<Value> =
        String::from_utf8(read.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut seen: Vec<String> = rows.iter().map(|r| r["key"].as_str().unwrap().to_string()).collect();
    assert!(rows.iter().all(|r| r["answer"].as_str().is_some_and(|a| !a.is_empty())));
    seen.sort();
    let mut expected = keys.clone();
    expected.sort();
    assert_eq!(seen, expected, "every row exactly once");
    // Both executors answered rows, and together they made one call per row.
    let mut per_executor = Vec::new();
    for p in &metric_ports {
        per_executor.push(counter(&metrics(*p).await, "weir_records_total", "outcome=\"success\""));
    }
    assert!(per_executor.iter().all(|n| *n > 0), "rows per executor: {per_executor:?}");
    assert_eq!(per_executor.iter().sum::<u64>(), 800, "rows per executor: {per_executor:?}");
    assert_eq!(sim.stats().requests, 800);
    // A call inside an aggregate, planned on the client and the scheduler, run on the executors.
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--format", "jsonl", "--cluster", &format!("df://127.0.0.1:{scheduler}")])
        .args(["--table", "reviews=parts"])
        .arg("SELECT count(llm_generate('gemini/gemini-2.5-flash', prompt)) AS answered FROM reviews")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), r#"{"answered":800}"#);
    assert_eq!(sim.stats().requests, 1600);
    // Array functions over embeddings, and COPY to JSON lines, run on the executors too.
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--cluster", &format!("df://127.0.0.1:{scheduler}"), "--table", "reviews=parts"])
        .arg(
            "COPY (SELECT key, array_length(llm_embed('gemini/gemini-embedding-001', prompt)) AS n FROM reviews \
             WHERE n < 10) TO 'dims.jsonl'",
        )
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let dims = std::fs::read_to_string(dir.path("dims.jsonl")).unwrap();
    assert_eq!(dims.lines().count(), 10, "{dims}");
    assert!(dims.lines().all(|l| serde_json::from_str::<Value>(l).unwrap()["n"].as_u64().is_some_and(|n| n > 0)));
    // Stopped, an executor prints what its calls came to.
    let child = executors.pop().unwrap();
    let pid = child.id().unwrap();
    assert!(std::process::Command::new("kill").arg(pid.to_string()).status().unwrap().success());
    let out = child.wait_with_output().await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gemini/gemini-2.5-flash: calls"), "{err}");
    // A table named by its path works on a cluster too (its name's dot broke the plan).
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--cluster", &format!("df://127.0.0.1:{scheduler}"), "--format", "jsonl"])
        .arg("COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM 'in.jsonl') TO 'again.jsonl'")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(dir.path("again.jsonl")).unwrap().lines().count(), 800);
    sim.shutdown().await;
}

/// Executors stopped with SIGTERM (a rolling restart) and started again at their ports: the
/// next query's rows are called once each. Ended at once, the stopped ones stayed registered
/// for the scheduler's 30-s timeout, the new ones at their addresses were handed their tasks,
/// and the query ran twice (600 calls for 300 rows, in 87 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executors_stopped_and_started_again_at_their_ports_call_each_row_once() {
    let dir = Dir::new("cluster-restart");
    let (data, _) = prompts(60);
    dir.write("in.jsonl", &data);
    // Calls that take a while, as a quota makes them: the query is still running when the
    // scheduler would take the old executors for lost.
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 300.0;
    config.quota.requests_per_window = 20;
    config.quota.window_secs = 2.0;
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let Cluster { scheduler, executors, ports, _scheduler: _sched, .. } = Cluster::start(&sim, 2, &dir.0).await;
    for mut child in executors {
        let pid = child.id().unwrap();
        assert!(std::process::Command::new("kill").arg(pid.to_string()).status().unwrap().success());
        let stopped = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait()).await;
        assert!(stopped.is_ok(), "an executor stopped with SIGTERM and no task took over 10 s to end");
    }
    let mut again = Vec::new();
    for &at in &ports {
        again.push(Cluster::executor(&sim, &dir.0, scheduler, &[], at).await);
    }
    let started = std::time::Instant::now();
    let out = bounded(
        weir()
            .current_dir(&dir.0)
            .args(["sql", "--cluster", &format!("df://127.0.0.1:{scheduler}"), "--partitions", "2"])
            .arg("COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM 'in.jsonl') TO 'out.jsonl'"),
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 60);
    assert_eq!(sim.stats().successes, 60, "rows called twice after the restart");
    assert!(started.elapsed().as_secs() < 20, "the query waited {:?} for the old executors", started.elapsed());
    drop(again);
    sim.shutdown().await;
}

/// Executors given a pool of two endpoints (`--base-url` twice) answer a query's rows over
/// both, each row exactly once and each row with one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executors_with_a_pool_answer_every_row_once_over_both_endpoints() {
    let dir = Dir::new("cluster-pool");
    let keys = parted_input(&dir, 400, 4).await;
    let a = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let b = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let cluster = Cluster::start_with(&a, 2, &dir.0, &["--base-url", &b.url()]).await;
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--cluster", &format!("df://127.0.0.1:{}", cluster.scheduler), "--partitions", "4"])
        .args(["--table", "reviews=parts"])
        .arg("COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM reviews) TO 'pooled.jsonl'")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = std::fs::read_to_string(dir.path("pooled.jsonl")).unwrap();
    let rows: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(rows.iter().all(|r| r["a"].as_str().is_some_and(|a| !a.is_empty())));
    assert_every_row_once(&dir.path("pooled.jsonl"), &keys);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.successes + sb.successes, 400, "{sa:?} {sb:?}");
    assert_eq!(sa.requests + sb.requests, 400, "a call per row: {sa:?} {sb:?}");
    assert!(sa.successes > 0 && sb.successes > 0, "both endpoints of the pool answered: {sa:?} {sb:?}");
    a.shutdown().await;
    b.shutdown().await;
}

/// Ctrl-C, and SIGTERM (as `timeout` or a service manager sends it), alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_cancels_the_job_and_its_calls_stop_and_a_copy_leaves_the_old_file() {
    for (signal, status) in [("-INT", 130), ("-TERM", 143)] {
        cancelled_by(signal, status).await;
    }
}

async fn cancelled_by(signal: &str, status: i32) {
    let dir = Dir::new("cluster-cancel");
    let (data, _) = prompts(400);
    dir.write("in.jsonl", &data);
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 500.0;
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let cluster = Cluster::start(&sim, 1, &dir.0).await;
    dir.write("answers.parquet", b"an earlier result");
    let query = weir()
        .current_dir(&dir.0)
        .args(["sql", "--cluster", &format!("df://127.0.0.1:{}", cluster.scheduler), "--table", "t=in.jsonl"])
        .arg("COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM t) TO 'answers.parquet'")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Until calls are being made.
    let started = std::time::Instant::now();
    while sim.stats().requests < 20 {
        assert!(started.elapsed().as_secs() < 30, "no calls after 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let pid = query.id().unwrap();
    assert!(std::process::Command::new("kill").args([signal, &pid.to_string()]).status().unwrap().success());
    let out = query.wait_with_output().await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(status), "{signal}: {err}");
    assert!(err.contains("cancelled job"), "{err}");
    // The executor's calls stop (those in flight end within their 0.5 s).
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let after = sim.stats().requests;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(sim.stats().requests, after, "calls went on after the job was cancelled");
    assert!(after < 200, "{after} calls for a query stopped early");
    // The earlier file is untouched, and no staging file is left beside it.
    assert_eq!(std::fs::read(dir.path("answers.parquet")).unwrap(), b"an earlier result");
    let names: Vec<_> = std::fs::read_dir(&dir.0).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(!names.iter().any(|n| n.to_string_lossy().contains("weir-partial")), "{names:?}");
    sim.shutdown().await;
}

/// An executor killed during a two-stage query (a GROUP BY over the calls) after some of its
/// first-stage tasks finished: the query still finishes with every row counted once, and the
/// executor that runs the lost tasks again says how many calls it made again (paid before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_lost_in_a_two_stage_query_is_survived_and_its_repeated_calls_are_told() {
    let dir = Dir::new("cluster-lost");
    let (data, _) = prompts(1600);
    dir.write("in.jsonl", &data);
    std::fs::create_dir(dir.path("parts")).unwrap();
    for i in 0..8 {
        let copy = format!("COPY (SELECT * FROM 'in.jsonl' WHERE n % 8 = {i}) TO 'parts/p{i}.parquet'");
        let out = weir().current_dir(&dir.0).args(["sql", &copy]).output().await.unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 200.0;
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let Cluster { scheduler, mut executors, _scheduler: _sched, .. } = Cluster::start(&sim, 2, &dir.0).await;
    let mut query = weir()
        .current_dir(&dir.0)
        .args(["sql", "--format", "jsonl", "--cluster", &format!("df://127.0.0.1:{scheduler}")])
        .args(["--partitions", "8", "--table", "reviews=parts"])
        .arg(
            "SELECT length(llm_generate('gemini/gemini-2.5-flash', prompt)) % 3 AS k, count(*) AS n \
             FROM reviews GROUP BY k",
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Past the first round of tasks (two of eight partitions per executor at a time).
    let started = std::time::Instant::now();
    while sim.stats().requests < 1000 {
        assert!(started.elapsed().as_secs() < 60, "{} calls after 60 s", sim.stats().requests);
        assert!(query.try_wait().unwrap().is_none(), "{}", stderr(&query.wait_with_output().await.unwrap()));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut lost = executors.remove(0);
    lost.start_kill().unwrap();
    lost.wait().await.unwrap();
    let out = tokio::time::timeout(std::time::Duration::from_secs(150), query.wait_with_output())
        .await
        .expect("the query hung after an executor was lost")
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let total: u64 = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["n"].as_u64().unwrap())
        .sum();
    assert_eq!(total, 1600, "every row counted once");
    // The client is told an upper bound of the rows paid twice: the rows of the partitions run
    // again (those the lost executor had finished, and those it was running, which it had
    // called only in part).
    let err = stderr(&out);
    let again: u64 = err
        .split("weir sql: ")
        .find_map(|l| l.strip_prefix("up to ")?.split_once(" rows of job ")?.0.parse().ok())
        .unwrap_or_else(|| panic!("no word of rows called again: {err}"));
    let answered = sim.stats().successes;
    assert!(answered > 1600, "{answered} answers: no task ran again");
    assert!(again >= answered - 1600 && again < 1600, "{again} told; {:?}", sim.stats());
    sim.shutdown().await;
}

/// A query may read and write only under the executor's allowed places: reading a file
/// elsewhere, writing one with COPY, INSERT INTO or EXPLAIN ANALYZE COPY, all fail before any
/// model is called, naming the place; and no scheduler or executor listens where other machines
/// could reach it without --insecure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executors_touch_only_allowed_places_and_do_not_listen_beyond_loopback() {
    let dir = Dir::new("cluster-fence");
    let (data, _) = prompts(20);
    dir.write("in.jsonl", &data);
    let outside = Dir::new("cluster-fence-outside");
    let secret = outside.write("secret.csv", b"line\nthe executor's secret\n");
    let made = weir()
        .current_dir(&outside.0)
        .args(["sql", "COPY (SELECT 31337 AS n, 'secret' AS s) TO 'secret.parquet'"])
        .output()
        .await
        .unwrap();
    assert!(made.status.success(), "{}", stderr(&made));
    let sim = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let cluster = Cluster::start(&sim, 1, &dir.0).await;
    let url = format!("df://127.0.0.1:{}", cluster.scheduler);
    let target = outside.path("stolen.csv");
    let attacks = [
        format!(
            "CREATE EXTERNAL TABLE s (line VARCHAR) STORED AS CSV LOCATION '{}' OPTIONS ('format.has_header' 'true'); \
             SELECT llm_generate('gemini/gemini-2.5-flash', line) AS a FROM s",
            secret.display()
        ),
        format!("SELECT llm_generate('gemini/gemini-2.5-flash', line) AS a FROM '{}'", secret.display()),
        // Answered from Parquet statistics while the scheduler plans: no executor reads it.
        format!(
            "CREATE EXTERNAL TABLE p STORED AS PARQUET LOCATION '{}'; SELECT count(*), max(n) FROM p",
            outside.path("secret.parquet").display()
        ),
        // Listing a directory to see its files' names.
        format!(
            "CREATE EXTERNAL TABLE l (line VARCHAR) STORED AS CSV LOCATION '{}/'; EXPLAIN SELECT * FROM l",
            outside.0.display()
        ),
        format!("COPY (SELECT llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM t) TO '{}'", target.display()),
        format!(
            "CREATE EXTERNAL TABLE o (a VARCHAR) STORED AS CSV LOCATION '{}'; \
             INSERT INTO o SELECT llm_generate('gemini/gemini-2.5-flash', prompt) FROM t",
            outside.path("o/").display()
        ),
        format!(
            "EXPLAIN ANALYZE COPY (SELECT llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM t) TO '{}'",
            target.display()
        ),
    ];
    for sql in &attacks {
        let out = weir()
            .current_dir(&dir.0)
            .args(["sql", "--cluster", &url, "--table", "t=in.jsonl", sql])
            .output()
            .await
            .unwrap();
        let err = stderr(&out);
        assert_ne!(out.status.code(), Some(0), "{sql}: {err}");
        assert!(err.contains("may not read or write"), "{sql}: {err}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!stdout.contains("secret") && !stdout.contains("31337"), "{sql}: {stdout}");
        assert_eq!(sim.stats().requests, 0, "{sql}: a model was called");
    }
    assert!(!target.exists() && !outside.path("o").read_dir().is_ok_and(|mut d| d.next().is_some()));
    // Inside the allowed directory the same query runs.
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--cluster", &url, "--table", "t=in.jsonl"])
        .arg("COPY (SELECT llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM t) TO 'answers.csv'")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(sim.stats().requests, 20);
    // The executor's work directory is its user's alone, and goes when it stops.
    let work: Vec<_> = std::fs::read_dir(dir.path("work")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(work.len(), 1, "{work:?}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&work[0]).unwrap().permissions().mode() & 0o777, 0o700);
    let Cluster { mut executors, _scheduler: _sched, .. } = cluster;
    let executor = executors.pop().unwrap();
    assert!(std::process::Command::new("kill").arg(executor.id().unwrap().to_string()).status().unwrap().success());
    executor.wait_with_output().await.unwrap();
    assert!(!work[0].exists(), "the work directory outlived its executor");
    // Reachable addresses need --insecure (refused before anything listens).
    for args in [
        vec!["cluster", "scheduler", "--bind", "0.0.0.0:1"],
        vec!["cluster", "executor", "--host", "0.0.0.0", "--port", "1", "--grpc-port", "2"],
    ] {
        let out = weir().args(&args).output().await.unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("--insecure"), "{}", stderr(&out));
    }
    sim.shutdown().await;
}

/// An executor whose scheduler died stops its tasks' calls (nobody could collect their
/// results) instead of paying for every remaining row, and the client says what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executors_stop_calling_when_their_scheduler_is_gone() {
    let dir = Dir::new("cluster-schedkill");
    let (data, _) = prompts(400);
    dir.write("in.jsonl", &data);
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 1000.0;
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let extra = ["--max-concurrency", "4", "--concurrency", "fixed"];
    let Cluster { scheduler, executors: _executors, _scheduler: mut sched, .. } =
        Cluster::start_with(&sim, 1, &dir.0, &extra).await;
    let query = weir()
        .current_dir(&dir.0)
        .args(["sql", "--cluster", &format!("df://127.0.0.1:{scheduler}"), "--table", "t=in.jsonl"])
        .arg("COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS a FROM t) TO 'answers.parquet'")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while sim.stats().requests < 8 {
        assert!(started.elapsed().as_secs() < 30, "no calls after 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    sched.start_kill().unwrap();
    sched.wait().await.unwrap();
    let out = query.wait_with_output().await.unwrap();
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("stopped answering"), "{err}");
    // Within the executor's 15 s (checked every 5 s), its calls stop.
    tokio::time::sleep(std::time::Duration::from_secs(25)).await;
    let after = sim.stats().requests;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(sim.stats().requests, after, "calls went on without a scheduler");
    assert!(after < 200, "{after} calls for 400 rows whose results nobody could collect");
    sim.shutdown().await;
}

/// A scheduler and executors with mutual TLS (on 127.0.0.2: the plain servers behind the TLS
/// listeners use 127.0.0.1): a client holding a certificate of the cluster gets every row once;
/// a plain client, a client whose certificate another authority signed, and an executor without
/// a certificate are all refused, and no model is called for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mutual_tls_only_holders_of_the_clusters_certificates_get_in() {
    let dir = Dir::new("cluster-tls");
    let keys = parted_input(&dir, 400, 4).await;
    for (out, names) in [("certs", vec!["scheduler", "e1", "e2", "client"]), ("other", vec!["client"])] {
        let mut cmd = weir();
        cmd.current_dir(&dir.0).args(["cluster", "certs", "--out", out]);
        for n in names {
            cmd.args(["--name", n]);
        }
        let made = cmd.output().await.unwrap();
        assert!(made.status.success(), "{}", stderr(&made));
    }
    let tls = |dir_: &str, name: &str| -> Vec<String> {
        vec![
            "--tls-ca".into(),
            format!("{dir_}/ca.pem"),
            "--tls-cert".into(),
            format!("{dir_}/{name}.pem"),
            "--tls-key".into(),
            format!("{dir_}/{name}.key"),
        ]
    };
    let sim = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let tls_metrics = [free_port(), free_port()];
    let cluster = Guarded::start(
        &dir.0,
        &sim,
        &tls("certs", "scheduler"),
        &[
            (
                [tls("certs", "e1"), vec!["--metrics-listen".into(), format!("127.0.0.1:{}", tls_metrics[0])]].concat(),
                None,
            ),
            (
                [tls("certs", "e2"), vec!["--metrics-listen".into(), format!("127.0.0.1:{}", tls_metrics[1])]].concat(),
                None,
            ),
        ],
    )
    .await;
    let scheduler = cluster.scheduler;
    stranger_gets_nothing_from_quota_service(&format!("127.0.0.2:{}", scheduler - 1)).await;
    let url = format!("dfs://127.0.0.2:{scheduler}");
    let query = "COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS answer FROM reviews) \
                 TO 'answers.jsonl'";
    // Strangers first: nothing may be called for them.
    let plain = format!("df://127.0.0.2:{scheduler}");
    let strangers: Vec<Vec<String>> = vec![
        vec!["--cluster".into(), plain],
        [vec!["--cluster".into(), url.clone()], tls("other", "client")].concat(),
        // A certificate of another authority, though this client trusts the cluster's.
        vec![
            "--cluster".into(),
            url.clone(),
            "--tls-ca".into(),
            "certs/ca.pem".into(),
            "--tls-cert".into(),
            "other/client.pem".into(),
            "--tls-key".into(),
            "other/client.key".into(),
        ],
    ];
    for args in &strangers {
        // A plain client once hung here against the TLS listener (not understood yet): bounded,
        // so that a hang fails the test instead of stalling the run.
        let out =
            bounded(weir().current_dir(&dir.0).arg("sql").args(args).args(["--table", "reviews=parts", query])).await;
        assert_ne!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    let rogue = bounded(
        weir()
            .current_dir(&dir.0)
            .args(["cluster", "executor", "--scheduler", &format!("127.0.0.2:{scheduler}"), "--host", "127.0.0.3"])
            .args(["--port", &free_port().to_string(), "--grpc-port", &free_port().to_string()])
            .args(["--base-url", &sim.url()]),
    )
    .await;
    assert_ne!(rogue.status.code(), Some(0), "a rogue executor registered");
    assert_eq!(sim.stats().requests, 0, "a stranger's query was run");
    assert!(!dir.path("answers.jsonl").exists());
    // The cluster's own client: every row once.
    let out = weir()
        .current_dir(&dir.0)
        .args(["sql", "--cluster", &url, "--partitions", "4"])
        .args(tls("certs", "client"))
        .args(["--table", "reviews=parts", query])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_every_row_once(&dir.path("answers.jsonl"), &keys);
    assert_eq!(sim.stats().requests, 400);
    // The executors shared the quota through the scheduler's guarded quota service.
    assert_eq!(most_sharing(&tls_metrics).await, Some(2.0));
    // With TLS, the address must leave 127.0.0.1 to the plain server behind it.
    let out = weir()
        .current_dir(&dir.0)
        .args(["cluster", "scheduler", "--bind", "127.0.0.1:1"])
        .args(tls("certs", "scheduler"))
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    drop(cluster);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_shared_token_only_its_holders_get_in() {
    let dir = Dir::new("cluster-token");
    let keys = parted_input(&dir, 200, 2).await;
    for name in ["token", "other"] {
        let made = weir().current_dir(&dir.0).args(["cluster", "token", "--out", name]).output().await.unwrap();
        assert!(made.status.success(), "{}", stderr(&made));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path("token")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the token file is readable by others");
    }
    let again = weir().current_dir(&dir.0).args(["cluster", "token", "--out", "token"]).output().await.unwrap();
    assert_eq!(again.status.code(), Some(2), "an existing token was replaced");
    let secret = std::fs::read_to_string(dir.path("token")).unwrap();
    let sim = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let token_metrics = [free_port(), free_port()];
    let watched = |port: u16| (vec!["--metrics-listen".to_string(), format!("127.0.0.1:{port}")], Some(secret.trim()));
    let cluster = Guarded::start(
        &dir.0,
        &sim,
        &["--token-file".into(), "token".into()],
        &[watched(token_metrics[0]), watched(token_metrics[1])],
    )
    .await;
    let (scheduler, flight) = (cluster.scheduler, cluster.flight);
    stranger_gets_nothing_from_quota_service(&format!("127.0.0.2:{}", scheduler - 1)).await;
    // A stranger who connects and says nothing is shown the door (checked at the end).
    let mut idle = tokio::net::TcpStream::connect(("127.0.0.2", scheduler)).await.unwrap();
    // A stranger (from 127.0.0.9) holding more silent connections than the guard holds in all
    // keeps nobody else out: one peer may hold only a few unproven ones.
    let mut flood = Vec::new();
    for _ in 0..2100 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.9:0".parse().unwrap()).unwrap();
        if let Ok(s) = socket.connect(format!("127.0.0.2:{scheduler}").parse().unwrap()).await {
            flood.push(s);
        }
    }
    let url = format!("df://127.0.0.2:{scheduler}");
    let query = "COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS answer FROM reviews) \
                 TO 'answers.jsonl'";
    // Strangers: no token, another token — to the scheduler and to an executor's Flight port.
    for (target, token) in
        [(url.clone(), None), (url.clone(), Some("other")), (format!("df://127.0.0.2:{flight}"), None)]
    {
        let mut cmd = weir();
        cmd.current_dir(&dir.0).env_remove("WEIR_CLUSTER_TOKEN").args(["sql", "--cluster", &target]);
        if let Some(t) = token {
            cmd.args(["--token-file", t]);
        }
        let out = bounded(cmd.args(["--table", "reviews=parts", query])).await;
        assert_eq!(out.status.code(), Some(2), "{target} {token:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("token"), "{target} {token:?}: {}", stderr(&out));
    }
    let rogue = bounded(
        weir()
            .current_dir(&dir.0)
            .env_remove("WEIR_CLUSTER_TOKEN")
            .args(["cluster", "executor", "--scheduler", &format!("127.0.0.2:{scheduler}"), "--host", "127.0.0.3"])
            .args(["--port", &free_port().to_string(), "--grpc-port", &free_port().to_string(), "--insecure"])
            .args(["--base-url", &sim.url()]),
    )
    .await;
    assert_ne!(rogue.status.code(), Some(0), "a rogue executor registered");
    assert!(stderr(&rogue).contains("token"), "{}", stderr(&rogue));
    assert_eq!(sim.stats().requests, 0, "a stranger's query was run");
    assert!(!dir.path("answers.jsonl").exists());
    // A token too short is refused with what to do.
    let short = bounded(weir().current_dir(&dir.0).env("WEIR_CLUSTER_TOKEN", "secret").args([
        "sql",
        "--cluster",
        &url,
        "SELECT 1",
    ]))
    .await;
    assert_eq!(short.status.code(), Some(2), "{}", stderr(&short));
    assert!(stderr(&short).contains("at least 16"), "{}", stderr(&short));
    // The cluster's own client: every row once.
    let out = bounded(
        weir()
            .current_dir(&dir.0)
            .env("WEIR_CLUSTER_TOKEN", secret.trim())
            .args(["sql", "--cluster", &url, "--partitions", "2"])
            .args(["--table", "reviews=parts", query]),
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_every_row_once(&dir.path("answers.jsonl"), &keys);
    assert_eq!(sim.stats().requests, 200);
    assert_eq!(most_sharing(&token_metrics).await, Some(2.0), "the executors did not share the quota");
    drop(flood);
    // The stranger's silent connection was closed (not held open until the process runs out
    // of files), while the cluster's own connections, idle as long, still work.
    // (The server's HTTP/2 greeting comes first; then the connection ends.)
    let closed = async {
        let mut buf = [0u8; 256];
        while let Ok(n) = tokio::io::AsyncReadExt::read(&mut idle, &mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), closed)
        .await
        .expect("a silent stranger's connection was held open");
    let again = bounded(
        weir()
            .current_dir(&dir.0)
            .env("WEIR_CLUSTER_TOKEN", secret.trim())
            .args(["sql", "--cluster", &url, "--partitions", "2"])
            .args(["--table", "reviews=parts", &query.replace("answers.jsonl", "again.jsonl")]),
    )
    .await;
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    assert_eq!(std::fs::read_to_string(dir.path("again.jsonl")).unwrap().lines().count(), 200);
    // An executor whose port is taken where its server listens behind the guard (127.0.0.1)
    // says so and exits 2, instead of starting without it.
    let clash = bounded(
        weir()
            .current_dir(&dir.0)
            .env("WEIR_CLUSTER_TOKEN", secret.trim())
            .args(["cluster", "executor", "--scheduler", &format!("127.0.0.2:{scheduler}"), "--host", "127.0.0.4"])
            .args(["--port", &scheduler.to_string(), "--grpc-port", &free_port().to_string()]),
    )
    .await;
    assert_eq!(clash.status.code(), Some(2), "{}", stderr(&clash));
    assert!(stderr(&clash).contains(&format!("127.0.0.1:{scheduler}")), "{}", stderr(&clash));
    // A token file others can read is refused.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path("other"), std::fs::Permissions::from_mode(0o644)).unwrap();
        let open = bounded(weir().current_dir(&dir.0).env_remove("WEIR_CLUSTER_TOKEN").args([
            "sql",
            "--cluster",
            &url,
            "--token-file",
            "other",
            "SELECT 1",
        ]))
        .await;
        assert_eq!(open.status.code(), Some(2), "{}", stderr(&open));
        assert!(stderr(&open).contains("chmod 600"), "{}", stderr(&open));
    }
    drop(cluster);
    sim.shutdown().await;
}

/// `weir sql --cluster` answering the parted table `reviews` of `dir` into `answers.jsonl`, in
/// two partitions, on the cluster whose scheduler listens on `scheduler`.
async fn answer_reviews(dir: &Dir, scheduler: u16) -> std::process::Output {
    bounded(
        weir()
            .current_dir(&dir.0)
            .args(["sql", "--cluster", &format!("df://127.0.0.1:{scheduler}"), "--partitions", "2"])
            .args(["--table", "reviews=parts"])
            .arg(
                "COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS answer FROM reviews) \
                 TO 'answers.jsonl'",
            ),
    )
    .await
}

/// Executors share one quota through their scheduler (issue #32): two executors each told
/// `--rpm 10 --limit-window 1` send 10 a second together, not 20, and each counts two
/// processes sharing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executors_keep_one_quota_through_their_scheduler() {
    let dir = Dir::new("cluster-quota");
    let keys = parted_input(&dir, 60, 2).await;
    let sim = SimServer::start(
        SimConfig {
            latency: weir_sim::config::LatencyConfig { fixed_ms: 20.0, per_token_ms: 0.0, jitter_ms: 0.0 },
            ..SimConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let cluster = Cluster::start_with(&sim, 2, &dir.0, &["--rpm", "10", "--limit-window", "1"]).await;
    let started = std::time::Instant::now();
    let out = answer_reviews(&dir, cluster.scheduler).await;
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_every_row_once(&dir.path("answers.jsonl"), &keys);
    let busiest = sim.stats().successes_per_second.iter().copied().max().unwrap_or(0);
    // A second of the server's clock may hold a little more than one of the clients' windows.
    assert!(busiest <= 12, "{busiest} calls in one second from two executors told 10 a second together");
    assert!(took >= std::time::Duration::from_secs(4), "60 calls at 10 a second took {took:?}");
    let mut both_executors_called = 0;
    for p in &cluster.metric_ports {
        assert_eq!(quota_shared_by(*p).await, Some(2.0));
        let page = metrics(*p).await;
        if counter(&page, "weir_records_total", "outcome=\"success\"") > 0 {
            both_executors_called += 1;
        }
    }
    assert_eq!(both_executors_called, 2);
    drop(cluster);
    sim.shutdown().await;
}

/// The scheduler's page gathers its executors' (issue #36): what the cluster's calls add up to
/// and each executor as a row, as the page `weir run --ui` shows, from the executors' reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schedulers_page_gathers_its_executors_calls() {
    let dir = Dir::new("cluster-page");
    let keys = parted_input(&dir, 40, 2).await;
    let sim = SimServer::start(SimConfig::default(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let cluster = Cluster::start(&sim, 2, &dir.0).await;
    let out = answer_reviews(&dir, cluster.scheduler).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_every_row_once(&dir.path("answers.jsonl"), &keys);
    let calls = sim.stats().requests;
    // Executors report every 2 s and the page sums once a second.
    let url = format!("http://127.0.0.1:{}/api/update", cluster.ui_port);
    let mut summary = serde_json::Value::Null;
    for _ in 0..40 {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let update: serde_json::Value = reqwest::get(&url).await.unwrap().json().await.unwrap();
        summary = update["summary"].clone();
        if summary["calls"].as_u64() == Some(calls) && summary["done"].as_u64() == Some(40) {
            break;
        }
    }
    assert_eq!(summary["calls"].as_u64(), Some(calls), "{summary}");
    assert_eq!((summary["done"].as_u64(), summary["succeeded"].as_u64()), (Some(40), Some(40)), "{summary}");
    assert_eq!(summary["state"], "2 executors reporting", "{summary}");
    let rows: Vec<&str> =
        summary["endpoints"].as_array().unwrap().iter().filter_map(|r| r["endpoint"].as_str()).collect();
    assert_eq!(rows.len(), 2, "{summary}");
    assert!(rows.iter().all(|r| r.starts_with("127.0.0.1:") && r.contains(&sim.url())), "{rows:?}");
    // The page as a browser shows it: the same figures, a row per executor, the charts drawn.
    let page = format!("http://127.0.0.1:{}/", cluster.ui_port);
    if let Some(chromium) = peer("WEIR_CHROMIUM") {
        let html = dom(&chromium, &page).await;
        assert_eq!(shown(&html, "state"), "2 executors reporting", "{html}");
        assert_eq!(number(&html, "records-done"), 40.0);
        assert_eq!(number(&html, "succeeded"), 40.0);
        assert_eq!(number(&html, "calls"), calls as f64);
        assert_eq!(shown(&html, "eta"), "–", "no total, no time left");
        let table = &html[html.find("id=\"endpoints\"").unwrap()..];
        let table = &table[..table.find("</table>").unwrap()];
        let shown_rows = table.split("<tr").filter(|r| r.contains(&sim.url())).count();
        assert_eq!(shown_rows, 2, "a row per executor: {table}");
        assert!(html.contains("class=\"u-wrap\""), "the charts are drawn (uPlot)");
    } else {
        let text = reqwest::get(&page).await.unwrap().text().await.unwrap();
        assert!(text.contains("uPlot"), "the page with its charts");
    }
    drop(cluster);
    sim.shutdown().await;
}
