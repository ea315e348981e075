//! Helpers for black-box tests of the built `weir` binary.
#![allow(dead_code)]

use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;

/// A scratch directory, removed on drop.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("weir-test-{name}-{}-{}", std::process::id(), rand_suffix()));
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_suffix() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos() as u64
}

/// The binary under test.
pub fn weir() -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_weir"));
    c.env_remove("GEMINI_API_KEY")
        .env_remove("GOOGLE_API_KEY")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("GOOGLE_APPLICATION_CREDENTIALS")
        .env_remove("GOOGLE_CLOUD_PROJECT")
        .env_remove("GOOGLE_CLOUD_LOCATION")
        .env_remove("CLOUDSDK_CONFIG")
        .env_remove("GCE_METADATA_HOST");
    c.kill_on_drop(true);
    c
}

/// The simulator with `config`, on a free loopback port.
pub async fn sim(config: weir_sim::SimConfig) -> weir_sim::SimServer {
    weir_sim::SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

pub async fn run(args: &[&str]) -> Output {
    weir().args(args).output().await.unwrap()
}

pub fn rows(path: &Path) -> Vec<Value> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad row {l}: {e}"))).collect()
        }
        Err(_) => Vec::new(),
    }
}

/// Checks that every id in `expected` appears exactly once across results and errors.
pub fn assert_each_id_once(expected: &[String], results: &[Value], errors: &[Value]) {
    let mut seen: HashMap<String, u32> = HashMap::new();
    for r in results.iter().chain(errors) {
        let id = match &r["id"] {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => panic!("row without id: {r}"),
        };
        *seen.entry(id).or_default() += 1;
    }
    for id in expected {
        assert_eq!(seen.get(id).copied().unwrap_or(0), 1, "id {id} must appear exactly once");
    }
    assert_eq!(seen.len(), expected.len(), "no extra ids");
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn prompts(n: usize) -> (Vec<u8>, Vec<String>) {
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for i in 0..n {
        let id = format!("r{i}");
        data.extend_from_slice(
            format!("{{\"key\":\"{id}\",\"prompt\":\"Tell me about item {i}\",\"n\":{i}}}\n").as_bytes(),
        );
        ids.push(id);
    }
    (data, ids)
}

/// The value of a peer's environment variable; `None` (skip) when unset, unless
/// `WEIR_REQUIRE_PEERS=1`, when a missing peer fails the test.
pub fn peer(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ if std::env::var("WEIR_REQUIRE_PEERS").as_deref() == Ok("1") => {
            panic!("{var} is not set; run ./scripts/test (it installs the peers)")
        }
        _ => {
            eprintln!("skipped: {var} is not set (./scripts/test sets it)");
            None
        }
    }
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Every file under `dir`, recursively.
#[allow(dead_code)]
pub fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Drops the notes finished runs under `dir` left of their output files (`*.closed` in their
/// state), as a killed run leaves none: a test that edits a finished run's output to play a
/// crash then resumes it as after one (an edit after a run that ended is refused otherwise).
#[allow(dead_code)]
pub fn as_if_killed(dir: &std::path::Path) {
    for p in walk(dir).into_iter().filter(|p| p.extension().is_some_and(|e| e == "closed")) {
        std::fs::remove_file(p).unwrap();
    }
}

/// Waits until something listens on 127.0.0.1:`port` (a server a test started).
pub async fn wait_for_port(port: u16) {
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("nothing listens on 127.0.0.1:{port}");
}

/// Runs a Python script with the peers' Python (pyarrow, boto3) and returns its stdout. The
/// script ends with `os._exit(0)`: pyarrow can abort at interpreter exit ("terminate called
/// without an active exception") after the script has done its work.
pub fn python(script: &str, args: &[&str]) -> String {
    let py = peer("WEIR_PYTHON").expect("checked by the caller");
    let script = format!("{script}\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_os._exit(0)\n");
    let o = std::process::Command::new(py).arg("-c").arg(&script).args(args).output().unwrap();
    assert!(o.status.success(), "python failed: {}\n{}", String::from_utf8_lossy(&o.stderr), script);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A server process started for a test and killed with it.
pub struct Emulator {
    pub child: std::process::Child,
    pub url: String,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// moto's S3 server on a free loopback port, with bucket `bkt`.
pub async fn moto() -> Option<Emulator> {
    let py = peer("WEIR_PYTHON")?;
    let bin = Path::new(&py).with_file_name("moto_server");
    let port = free_port();
    let child = std::process::Command::new(bin)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let e = Emulator { child, url: format!("http://127.0.0.1:{port}") };
    wait_for_port(port).await;
    python(
        r#"
import sys, boto3
boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket="bkt")
"#,
        &[&e.url],
    );
    Some(e)
}

/// Points a weir command at moto's S3 on `endpoint`.
pub fn s3_env(cmd: &mut tokio::process::Command, endpoint: &str) {
    cmd.env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ENDPOINT_URL", endpoint)
        .env_remove("AWS_PROFILE");
}

/// The page at `url` as Chromium shows it once its scripts have run.
pub async fn dom(chromium: &str, url: &str) -> String {
    match dom_if_served(chromium, url).await {
        Ok(html) => html,
        Err(stderr) => panic!("chromium showed no page for {url}: {stderr}"),
    }
}

/// As [`dom`], or chromium's stderr when nothing served the page (a run's live page after the
/// run ended).
pub async fn dom_if_served(chromium: &str, url: &str) -> Result<String, String> {
    // A profile of its own: two browsers on one profile hand the page to each other and exit.
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let profile = std::env::temp_dir().join(format!("weir-chromium-{}-{n}", std::process::id()));
    let o = tokio::process::Command::new(chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--virtual-time-budget=3000", "--dump-dom", url])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("chromium runs");
    let _ = std::fs::remove_dir_all(&profile);
    assert!(o.status.success(), "chromium failed: {}", String::from_utf8_lossy(&o.stderr));
    let html = String::from_utf8_lossy(&o.stdout).into_owned();
    if html.contains("</html>") {
        Ok(html)
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

/// The text of the element with `id` in `html` (as the page wrote it: plain text).
pub fn shown(html: &str, id: &str) -> String {
    let at = html.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id} in the page"));
    let rest = &html[at..];
    let start = rest.find('>').unwrap() + 1;
    let end = rest[start..].find('<').unwrap() + start;
    rest[start..end].replace("&amp;", "&").trim().to_string()
}

/// A figure as the page shows it (`1,234`), as a number.
pub fn number(html: &str, id: &str) -> f64 {
    let s = shown(html, id).replace([',', '$'], "");
    s.parse().unwrap_or_else(|_| panic!("#{id} shows {s:?}"))
}
