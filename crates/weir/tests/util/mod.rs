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
