//! `--task embed`: one vector per record from an embedding model, many records per call, through
//! each provider's wire form (OpenAI `/embeddings`, Gemini `batchEmbedContents`, Vertex AI
//! text-embedding `:predict`) against `weir sim`.

mod util;

use util::*;
use weir_sim::{SimConfig, SimServer};

async fn sim(shape: impl FnOnce(&mut SimConfig)) -> SimServer {
    let mut config = SimConfig::default();
    shape(&mut config);
    SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

/// Prompts whose lengths span two orders of magnitude (1 to 300 words, mixed), each unique
/// to this test file (so no cache can answer them).
fn texts(n: usize, tag: &str) -> (Vec<u8>, Vec<String>) {
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for i in 0..n {
        let words = [1, 3, 10, 30, 100, 300][(i * 7919) % 6];
        let text: Vec<String> = (0..words).map(|w| format!("{tag}{i}w{w}")).collect();
        data.extend(serde_json::to_vec(&serde_json::json!({"id": i, "prompt": text.join(" ")})).unwrap());
        data.push(b'\n');
        ids.push(i.to_string());
    }
    (data, ids)
}

async fn embed_run(model: &str, base: Option<&str>, dir: &Dir, data: &[u8], extra: &[&str]) -> std::process::Output {
    let input = dir.write("in.jsonl", data);
    let out = dir.path("out.jsonl");
    let mut cmd = weir();
    cmd.args(["run", "--task", "embed", "--model", model, "--id-field", "id"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .args(extra)
        .env("GEMINI_API_KEY", "k")
        .env("OPENAI_API_KEY", "k");
    if let Some(b) = base {
        cmd.args(["--base-url", b]);
    }
    cmd.output().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_through_each_wire_form_one_vector_per_record_many_per_call() {
    for (model, batch) in [("openai/text-embedding-3-small", 128), ("gemini/gemini-embedding-001", 100)] {
        let server = sim(|c| c.embedding.dimensions = 32).await;
        let dir = Dir::new(&format!("embed-{}", model.replace('/', "-")));
        let (data, ids) = texts(500, "e");
        let url = server.url();
        let base = if model.starts_with("openai/") { format!("{url}/v1") } else { url };
        // Arrival order and a long linger: every call is full, so the count is exact.
        let args = ["--batch-linger-ms", "5000", "--buckets", "off"];
        let o = embed_run(model, Some(&base), &dir, &data, &args).await;
        assert_eq!(o.status.code(), Some(0), "{model}: {}", stderr(&o));
        let results = rows(&dir.path("out.jsonl"));
        assert_each_id_once(&ids, &results, &[]);
        for r in &results {
            let v = r["embedding"].as_array().unwrap_or_else(|| panic!("{model}: no vector in {r}"));
            assert_eq!(v.len(), 32);
            assert_eq!(r["dimensions"], 32);
            assert!(r.get("response").is_none());
        }
        let stats = server.stats();
        assert_eq!(stats.embed_inputs, 500, "{model}");
        assert_eq!(stats.embed_batches, 500u64.div_ceil(batch), "{model}: calls of up to {batch}");
        server.shutdown().await;
    }
}

/// Each record gets its own text's vector, whatever batch it travelled in: the same texts
/// embedded one per call and many per call give the same vectors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_records_vector_does_not_depend_on_its_batch() {
    let server = sim(|c| c.embedding.dimensions = 8).await;
    let (data, _) = texts(200, "b");
    let vectors = |dir: &Dir| -> std::collections::HashMap<String, serde_json::Value> {
        rows(&dir.path("out.jsonl")).into_iter().map(|r| (r["id"].to_string(), r["embedding"].clone())).collect()
    };
    let one = Dir::new("embed-one");
    let o = embed_run("gemini/e", Some(&server.url()), &one, &data, &["--batch-size", "1"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let many = Dir::new("embed-many");
    let o = embed_run(
        "gemini/e",
        Some(&server.url()),
        &many,
        &data,
        &["--batch-size", "50", "--buckets", "off", "--batch-linger-ms", "5000"],
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(vectors(&one), vectors(&many));
    // A long linger: on a loaded machine 20 ms can pass between two records, and a batch would
    // leave short.
    assert_eq!(server.stats().embed_batches as usize, 200 + 200usize.div_ceil(50));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_from_the_built_in_simulator_resume_and_refuse_generation_flags() {
    // The built-in simulator: no key, no server.
    let dir = Dir::new("embed-sim");
    let (data, ids) = texts(300, "s");
    let o = embed_run("sim/embed", None, &dir, &data, &[]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &[]);
    // A resumed embedding run is the same command; a generation run into its output is refused.
    let again = embed_run("sim/embed", None, &dir, &data, &[]).await;
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    assert!(stderr(&again).contains("Resuming: 300"), "{}", stderr(&again));
    // Started over, every vector comes from the response cache: no call is paid twice.
    let fresh = embed_run("sim/embed", None, &dir, &data, &["--fresh"]).await;
    assert_eq!(fresh.status.code(), Some(0), "{}", stderr(&fresh));
    assert!(stderr(&fresh).contains("calls 0 ") && stderr(&fresh).contains("300 from cache"), "{}", stderr(&fresh));
    let input = dir.path("in.jsonl");
    let out = dir.path("out.jsonl");
    let gen = weir()
        .args(["run", "--model", "sim/embed", "--id-field", "id", "--input", input.to_str().unwrap()])
        .args(["--output", out.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert_eq!(gen.status.code(), Some(2), "{}", stderr(&gen));
    assert!(stderr(&gen).contains("task=embed"), "{}", stderr(&gen));
    // Parameters of generation do not apply.
    let o = embed_run("sim/embed", None, &Dir::new("embed-param"), &data, &["--param", "temperature=0"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--param does not apply to --task embed"), "{}", stderr(&o));
}

/// Length buckets cut the padding of batches of mixed lengths (what a batch computed together
/// wastes), and the summary says so; a bad --buckets is a usage error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buckets_cut_padding_and_the_summary_reports_it() {
    let (data, ids) = texts(2000, "p");
    let padding = |o: &std::process::Output| -> f64 {
        let err = stderr(o);
        let line = err.lines().find(|l| l.contains("batches:")).unwrap_or_else(|| panic!("{err}")).to_string();
        line.split("padding ").nth(1).and_then(|s| s.split('×').next()).unwrap().parse().unwrap()
    };
    let mut seen = Vec::new();
    for buckets in
        [&["--buckets", "off"][..], &["--buckets", "auto"], &["--sort-window", "500"], &["--buckets", "8,32,128"]]
    {
        let dir = Dir::new("embed-buckets");
        let o = embed_run("sim/embed", None, &dir, &data, &[&["--batch-size", "32"][..], buckets].concat()).await;
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert_each_id_once(&ids, &rows(&dir.path("out.jsonl")), &[]);
        seen.push(padding(&o));
    }
    let off = seen[0];
    assert!(seen[1..].iter().all(|p| p * 2.0 < off), "padding off vs bucketed: {seen:?}");
    for bad in ["auto:1", "64,32", "x", "0,5"] {
        let o = embed_run("sim/embed", None, &Dir::new("embed-bad-buckets"), &data, &["--buckets", bad]).await;
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", stderr(&o));
        assert!(stderr(&o).contains("--buckets"), "{}", stderr(&o));
    }
}

/// The local model: `local/all-minilm-l6-v2` in-process, 384-dimensional vectors, batches padded
/// to their longest member (its own tokenizer's counts), so buckets cut real compute.
#[cfg(feature = "local")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_model_embeds_in_process_and_buckets_cut_its_padding() {
    let Some(models) = peer("WEIR_MODELS") else { return };
    // Plain words (one token each), 2 to 128 of them: the model's compute is real, so the
    // lengths stay modest.
    let vocab = ["river", "stone", "light", "green", "house", "music", "paper", "storm"];
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for i in 0..300usize {
        let n = [2, 4, 8, 16, 32, 64, 128][(i * 7919) % 7];
        let text: Vec<&str> = (0..n).map(|w| vocab[(i + w * 3) % vocab.len()]).collect();
        data.extend(
            serde_json::to_vec(&serde_json::json!({"id": i, "prompt": format!("{i} {}", text.join(" "))})).unwrap(),
        );
        data.push(b'\n');
        ids.push(i.to_string());
    }
    let mut padding = Vec::new();
    for buckets in ["off", "auto"] {
        let dir = Dir::new(&format!("embed-local-{buckets}"));
        let input = dir.write("in.jsonl", &data);
        let out = dir.path("out.jsonl");
        let o = weir()
            .args(["run", "--task", "embed", "--model", "local/all-minilm-l6-v2", "--id-field", "id"])
            .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap(), "--buckets", buckets])
            .env("WEIR_MODELS", &models)
            .output()
            .await
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let results = rows(&out);
        assert_each_id_once(&ids, &results, &[]);
        assert!(results.iter().all(|r| r["dimensions"] == 384 && r["usage"]["prompt_tokens"].as_u64() > Some(0)));
        let err = stderr(&o);
        let line = err.lines().find(|l| l.contains("batches:")).unwrap_or_else(|| panic!("{err}")).to_string();
        padding.push(line.split("padding ").nth(1).and_then(|s| s.split('×').next()).unwrap().parse::<f64>().unwrap());
    }
    assert!(padding[1] * 2.0 < padding[0], "padding off vs auto: {padding:?}");
    // Generation is refused with a message that says why.
    let dir = Dir::new("embed-local-generate");
    let input = dir.write("in.jsonl", &data);
    let o = weir()
        .args(["run", "--model", "local/all-minilm-l6-v2", "--input", input.to_str().unwrap()])
        .args(["--output", dir.path("out.jsonl").to_str().unwrap()])
        .env("WEIR_MODELS", &models)
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--task embed"), "{}", stderr(&o));
}

/// `local/` models are served to `weir sql` as to `weir run` (one registry of how models are
/// connected): the same 384-dimensional vectors from `llm_embed`.
#[cfg(all(feature = "local", feature = "sql"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_model_embeds_in_sql_too() {
    let Some(models) = peer("WEIR_MODELS") else { return };
    let dir = Dir::new("embed-local-sql");
    dir.write(
        "in.jsonl",
        b"{\"id\": 1, \"prompt\": \"river stone\"}\n{\"id\": 2, \"prompt\": \"green house music\"}\n",
    );
    let o = weir()
        .current_dir(&dir.0)
        .args(["sql", "--format", "jsonl"])
        .arg("SELECT id, array_length(llm_embed('local/all-minilm-l6-v2', prompt)) AS n FROM 'in.jsonl' ORDER BY id")
        .env("WEIR_MODELS", &models)
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    let rows: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert!(rows.iter().all(|r| r["n"] == 384), "{text}");
}
