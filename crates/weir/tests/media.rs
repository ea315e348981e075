//! Issue #35: records with media. `--media-field` names a file path or a URL per record; weir
//! reads the bytes when the record is sent and sends them inline after the prompt (Gemini
//! `inlineData`, OpenAI `image_url` data URLs). The simulator decodes and counts the parts.
//! Bad media (a missing file, an oversized one) is the record's error row, with no call.

mod util;

use std::collections::HashMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use util::*;

/// A small PNG: the signature, then bytes that make each image distinct.
fn png(i: usize) -> Vec<u8> {
    let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
    b.extend_from_slice(format!("image number {i}").as_bytes());
    b
}

/// Serves `files` (path → bytes) over HTTP/1.1 on loopback, one request per connection.
/// A body `FLAKY n rest` is answered 503 the first n times, then `rest`; `ALWAYS503` always;
/// `STALL` never; `UNSIZED rest` is `rest` with no Content-Length (the body ends when the
/// connection closes). `/hits` answers how many times each path was asked for, as JSON.
async fn serve(files: HashMap<String, Vec<u8>>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = std::sync::Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let files = files.clone();
            let hits = hits.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                let hit = {
                    let mut h = hits.lock().unwrap();
                    let c = h.entry(path.clone()).or_default();
                    *c += 1;
                    *c
                };
                let unavailable =
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec();
                let mut file = files.get(&path).cloned();
                if let Some(body) = file.as_ref().filter(|b| b.starts_with(b"FLAKY ")) {
                    let rest = &body[6..];
                    let sp = rest.iter().position(|b| *b == b' ').unwrap();
                    let n: usize = std::str::from_utf8(&rest[..sp]).unwrap().parse().unwrap();
                    file = if hit <= n { Some(b"ALWAYS503".to_vec()) } else { Some(rest[sp + 1..].to_vec()) };
                }
                if path == "/hits" {
                    let counts = serde_json::to_string(&*hits.lock().unwrap()).unwrap();
                    file = Some(counts.into_bytes());
                }
                let reply = match file.as_ref() {
                    Some(body) if body.as_slice() == b"STALL" => {
                        tokio::time::sleep(std::time::Duration::from_secs(600)).await;
                        return;
                    }
                    Some(body) if body.as_slice() == b"ALWAYS503" => unavailable,
                    Some(body) if body.starts_with(b"REDIRECT ") => {
                        let to = String::from_utf8_lossy(&body[9..]).to_string();
                        format!(
                            "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        )
                        .into_bytes()
                    }
                    Some(body) if body.starts_with(b"UNSIZED ") => {
                        let mut r = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".to_vec();
                        r.extend_from_slice(&body[8..]);
                        r
                    }
                    Some(body) => {
                        let mut r =
                            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())
                                .into_bytes();
                        r.extend_from_slice(body);
                        r
                    }
                    None => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec(),
                };
                let _ = s.write_all(&reply).await;
            });
        }
    });
    format!("http://{addr}")
}

async fn run_media(
    sim: &weir_sim::SimServer,
    dir: &Dir,
    model: &str,
    input: &std::path::Path,
    out: &str,
) -> std::process::Output {
    let base = if model.starts_with("openai/") { format!("{}/v1", sim.url()) } else { sim.url() };
    weir()
        .env("OPENAI_API_KEY", "sk-test")
        .args(["run", "--model", model, "--base-url", &base, "--progress", "never", "--id-field", "id"])
        .args(["--input", input.to_str().unwrap(), "--output", dir.path(out).to_str().unwrap()])
        .args(["--media-field", "image"])
        .output()
        .await
        .unwrap()
}

/// Images by path and by URL, each sent exactly once; a missing file, a missing URL and an
/// oversized file become error rows naming the field, with no call; the answers depend on the
/// image; the same bytes under other names are answered from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_by_path_and_url_go_inline_and_bad_ones_are_error_rows_without_a_call() {
    for model in ["gemini/gemini-2.5-flash", "openai/gpt-4o-mini"] {
        let sim = sim(weir_sim::SimConfig::default()).await;
        let dir = Dir::new(&format!("media-{}", model.replace('/', "-")));
        let mut served = HashMap::new();
        let mut lines = String::new();
        for i in 0..10 {
            let p = dir.write(&format!("img{i}.png"), &png(i));
            lines.push_str(&format!("{{\"id\":\"p{i}\",\"prompt\":\"describe\",\"image\":\"{}\"}}\n", p.display()));
            // Served only to the signed URL: the fetch uses it whole.
            served.insert(format!("/u{i}.png?sig=SECRET"), png(100 + i));
        }
        let url = serve(served).await;
        for i in 0..10 {
            lines.push_str(&format!(
                "{{\"id\":\"u{i}\",\"prompt\":\"describe\",\"image\":\"{url}/u{i}.png?sig=SECRET\"}}\n"
            ));
        }
        let big = dir.write("big.png", &[png(0), vec![0u8; 21_000_000]].concat());
        lines.push_str(&format!("{{\"id\":\"big\",\"prompt\":\"describe\",\"image\":\"{}\"}}\n", big.display()));
        lines.push_str(&format!(
            "{{\"id\":\"gone\",\"prompt\":\"describe\",\"image\":\"{}\"}}\n",
            dir.path("no.png").display()
        ));
        lines.push_str(&format!(
            "{{\"id\":\"404\",\"prompt\":\"describe\",\"image\":\"{url}/missing.png?sig=SECRET\"}}\n"
        ));
        // null and empty are no part; a record without the field (a misspelt name) is an error.
        lines.push_str("{\"id\":\"text\",\"prompt\":\"describe\",\"image\":null}\n");
        lines.push_str("{\"id\":\"empty\",\"prompt\":\"describe it\",\"image\":\" \"}\n");
        lines.push_str("{\"id\":\"typo\",\"prompt\":\"describe\",\"imgae\":\"a.png\"}\n");
        let input = dir.write("in.jsonl", lines.as_bytes());
        let o = run_media(&sim, &dir, model, &input, "out.jsonl").await;
        let err = stderr(&o);
        let out = rows(&dir.path("out.jsonl"));
        let errors = rows(&dir.path("out.errors.jsonl"));
        // The Gemini API takes the oversized part through its Files API; OpenAI refuses it.
        let uploads = usize::from(model.starts_with("gemini/"));
        assert_eq!(out.len(), 22 + uploads, "{model}: {err}");
        assert_eq!(errors.len(), 4 - uploads, "{model}: {err}");
        for e in &errors {
            assert_eq!(e["kind"], "invalid_input", "{e}");
            let m = e["message"].as_str().unwrap();
            assert!(m.contains("media field 'image'"), "{e}");
            assert!(!m.contains("SECRET"), "a URL's query is not shown: {e}");
            let why = match e["id"].as_str().unwrap() {
                "big" => "over the",
                "typo" => "has no media field 'image'",
                "gone" => "no such file",
                _ => "HTTP 404",
            };
            assert!(m.contains(why), "{e}");
        }
        // Rows echo a signed URL without its signature; nothing weir wrote holds it.
        assert!(out.iter().any(|r| r["input"]["image"] == format!("{url}/u0.png")), "{model}");
        for file in walk(&dir.0) {
            let text = String::from_utf8_lossy(&std::fs::read(&file).unwrap()).to_string();
            let input = file.file_name().is_some_and(|n| n == "in.jsonl");
            assert!(input || !text.contains("SECRET"), "{model}: {} holds a signature", file.display());
        }
        let s = sim.stats();
        assert_eq!(s.requests as usize, 22 + uploads, "{model}: no call for the bad media");
        assert_eq!(s.media_parts as usize, 20 + uploads, "{model}: each image once");
        assert_eq!((s.media_uris as usize, s.gemini_files_uploaded as usize), (uploads, uploads), "{model}");
        // Each image gets its own answer.
        let answers: std::collections::HashSet<&str> = out.iter().map(|r| r["response"].as_str().unwrap()).collect();
        assert_eq!(answers.len(), 22 + uploads, "{model}");
        // The same bytes under other names, same ids: answered from the cache.
        let mut again = String::new();
        for i in 0..10 {
            let p = dir.write(&format!("copy{i}.png"), &png(i));
            again.push_str(&format!("{{\"id\":\"p{i}\",\"prompt\":\"describe\",\"image\":\"{}\"}}\n", p.display()));
        }
        let input2 = dir.write("in2.jsonl", again.as_bytes());
        let o = run_media(&sim, &dir, model, &input2, "out2.jsonl").await;
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert_eq!(rows(&dir.path("out2.jsonl")).len(), 10);
        assert_eq!(
            sim.stats().requests as usize,
            22 + uploads,
            "{model}: the copies were answered from the cache: {}",
            stderr(&o)
        );
        sim.shutdown().await;
    }
}

/// `--media-field` with embeddings, or naming no field, is refused before anything is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_with_embeddings_or_no_field_is_a_usage_error() {
    let dir = Dir::new("media-refused");
    let input = dir.write("in.jsonl", b"{\"id\":\"a\",\"prompt\":\"x\",\"image\":\"a.png\"}\n");
    for extra in [&["--task", "embed"][..], &["--media-field", ""][..], &["--media-field", "x:application/zip"][..]] {
        let o = weir()
            .args(["run", "--model", "sim/a", "--input", input.to_str().unwrap(), "--media-field", "image"])
            .args(["--output", dir.path("out.jsonl").to_str().unwrap()])
            .args(extra)
            .output()
            .await
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("--media-field"), "{}", stderr(&o));
    }
    // A type Claude does not take, named for the field: refused before any call (a tester's
    // run failed every record instead).
    let o = weir()
        .args(["run", "--model", "anthropic/claude-haiku-4-5", "--base-url", "http://127.0.0.1:9"])
        .args(["--input", input.to_str().unwrap(), "--media-field", "image:audio/wav"])
        .args(["--output", dir.path("claude.jsonl").to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--media-field image:audio/wav: audio/wav is not a type"), "{}", stderr(&o));
}

/// Images in buckets: `gs://` (the simulator's GCS, through `STORAGE_EMULATOR_HOST`) and
/// `s3://` (moto, when installed), read through the tables' store clients; a missing object is
/// the record's error row, with no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_in_gcs_and_s3_buckets_are_sent_once_each() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let gcs = weir_sim::GcsServer::start(([127, 0, 0, 1], 0).into()).await.unwrap();
    let dir = Dir::new("media-buckets");
    let http = reqwest::Client::new();
    let mut lines = String::new();
    for i in 0..5 {
        let r = http.put(format!("{}/bkt/photos/g{i}.png", gcs.url())).body(png(200 + i)).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        lines
            .push_str(&format!("{{\"id\":\"g{i}\",\"prompt\":\"describe\",\"image\":\"gs://bkt/photos/g{i}.png\"}}\n"));
    }
    lines.push_str("{\"id\":\"nog\",\"prompt\":\"describe\",\"image\":\"gs://bkt/photos/none.png\"}\n");
    let moto = moto().await;
    if let Some(m) = &moto {
        for i in 0..5 {
            let f = dir.write(&format!("s{i}.png"), &png(300 + i));
            python(
                r#"
import sys, boto3
boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1").upload_file(sys.argv[2], "bkt", sys.argv[3])
"#,
                &[&m.url, f.to_str().unwrap(), &format!("photos/s{i}.png")],
            );
            lines.push_str(&format!(
                "{{\"id\":\"s{i}\",\"prompt\":\"describe\",\"image\":\"s3://bkt/photos/s{i}.png\"}}\n"
            ));
        }
    }
    let input = dir.write("in.jsonl", lines.as_bytes());
    let mut cmd = weir();
    cmd.env("STORAGE_EMULATOR_HOST", gcs.url())
        .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &sim.url(), "--progress", "never"])
        .args(["--id-field", "id", "--media-field", "image", "--input", input.to_str().unwrap()])
        .args(["--output", dir.path("out.jsonl").to_str().unwrap()]);
    if let Some(m) = &moto {
        s3_env(&mut cmd, &m.url);
    }
    let o = cmd.output().await.unwrap();
    let err = stderr(&o);
    let n = if moto.is_some() { 10 } else { 5 };
    assert_eq!(rows(&dir.path("out.jsonl")).len(), n, "{err}");
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0]["message"].as_str().unwrap().contains("no such object"), "{}", errors[0]);
    let s = sim.stats();
    assert_eq!((s.requests, s.media_parts), (n as u64, n as u64), "{err}");
    gcs.shutdown().await;
    sim.shutdown().await;
}

/// Found by an outside tester: a FIFO named as media hung its record forever; a URL's password
/// was shown in the error row; a loopback server's redirect to plain http:// off the machine
/// was followed; text named `.png` was sent as an image. Each is now the record's error row,
/// with no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_a_password_an_outward_redirect_and_a_false_name_are_refused() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("media-hostile");
    let fifo = dir.path("pipe.png");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let text = dir.write("text.png", b"hello, I am text\n");
    let mut served = HashMap::new();
    served.insert("/out.png".to_string(), b"REDIRECT http://10.255.255.1/x.png".to_vec());
    let url = serve(served).await;
    let pw = url.replace("http://", "http://user:PASSWORDSECRET@");
    let lines = format!(
        "{{\"id\":\"fifo\",\"prompt\":\"d\",\"image\":\"{}\"}}\n\
         {{\"id\":\"pw\",\"prompt\":\"d\",\"image\":\"{pw}/none.png\"}}\n\
         {{\"id\":\"redirect\",\"prompt\":\"d\",\"image\":\"{url}/out.png\"}}\n\
         {{\"id\":\"text\",\"prompt\":\"d\",\"image\":\"{}\"}}\n",
        fifo.display(),
        text.display()
    );
    let input = dir.write("in.jsonl", lines.as_bytes());
    let run = run_media(&sim, &dir, "gemini/gemini-2.5-flash", &input, "out.jsonl");
    let o = tokio::time::timeout(std::time::Duration::from_secs(60), run).await.expect("the run ended");
    let err = stderr(&o);
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 4, "{err}");
    for e in &errors {
        let m = e["message"].as_str().unwrap();
        assert!(!m.contains("PASSWORDSECRET"), "{e}");
        let want = match e["id"].as_str().unwrap() {
            "fifo" => "not a file",
            "pw" => "HTTP 404",
            "redirect" => "redirect",
            _ => "not a type",
        };
        assert!(m.contains(want), "{e}");
    }
    assert_eq!(sim.stats().requests, 0, "no call for any of them");
    sim.shutdown().await;
}

/// Images held as bytes in a Parquet binary column (the common layout for a photo dataset):
/// each row's bytes go inline exactly once; bytes of no type a provider takes are that row's
/// error, with no call; a null adds no part; the Parquet output keeps the column as bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_as_bytes_in_a_parquet_column_go_inline_once_each() {
    if peer("WEIR_PYTHON").is_none() {
        return;
    }
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("media-parquet-bytes");
    let input = dir.path("photos.parquet");
    let out = dir.path("out.parquet");
    python(
        r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
def png(i):
    return b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + f"image number {i}".encode()
ids = [f"r{i}" for i in range(30)] + ["junk", "none"]
imgs = [png(i) for i in range(30)] + [b"\x00\xff\xfe not an image", None]
t = pa.table({"id": ids, "prompt": ["describe"] * 32, "image": pa.array(imgs, pa.binary())})
pq.write_table(t, sys.argv[1], row_group_size=7)
"#,
        &[input.to_str().unwrap()],
    );
    let o = weir()
        .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &sim.url(), "--progress", "never"])
        .args(["--id-field", "id", "--media-field", "image", "--input", input.to_str().unwrap()])
        .args(["--output", out.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    let err = stderr(&o);
    let s = sim.stats();
    assert_eq!((s.requests, s.media_parts), (31, 30), "each image once, the null row as text: {err}");
    let got = python(
        r#"
import sys, glob, pyarrow.parquet as pq, pyarrow as pa
t = pa.concat_tables([pq.read_table(p) for p in sorted(glob.glob(sys.argv[1] + "/part-*.parquet"))])
assert pa.types.is_binary(t.schema.field("image").type) or pa.types.is_large_binary(t.schema.field("image").type), t.schema
rows = {r["id"]: r for r in t.to_pylist()}
assert rows["r3"]["image"].endswith(b"image number 3"), rows["r3"]["image"]
assert rows["none"]["image"] is None
print(t.num_rows)
"#,
        &[out.to_str().unwrap()],
    );
    assert_eq!(got.trim(), "31", "{err}");
    let errors = python(
        r#"
import sys, glob, pyarrow.parquet as pq
for p in sorted(glob.glob(sys.argv[1] + "/part-*.parquet")):
    for r in pq.read_table(p).to_pylist():
        print(r["id"], r["message"])
"#,
        &[dir.path("out.errors.parquet").to_str().unwrap()],
    );
    assert_eq!(errors.lines().count(), 1, "{errors}\n{err}");
    assert!(errors.starts_with("junk "), "{errors}");
    for needle in ["media field 'image'", "bytes in the record", "not a type"] {
        assert!(errors.contains(needle), "{errors}");
    }
    sim.shutdown().await;
}

/// A URL whose server fails for a while (503 twice) is fetched again and sent; one that keeps
/// failing ends as a retryable `server` error row, not `invalid_input`, with no call, and
/// `--retry-errors` sends it once the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_that_fails_for_a_while_is_fetched_again_and_one_that_keeps_failing_is_retryable() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("media-flaky");
    let mut served = HashMap::new();
    served.insert("/flaky.png".to_string(), [b"FLAKY 2 ".to_vec(), png(1)].concat());
    // Fails its first 3 fetches (one record's tries), then serves.
    served.insert("/down.png".to_string(), [b"FLAKY 3 ".to_vec(), png(2)].concat());
    let url = serve(served).await;
    let lines = format!(
        "{{\"id\":\"flaky\",\"prompt\":\"describe\",\"image\":\"{url}/flaky.png\"}}\n\
         {{\"id\":\"down\",\"prompt\":\"describe\",\"image\":\"{url}/down.png\"}}\n"
    );
    let input = dir.write("in.jsonl", lines.as_bytes());
    let o = run_media(&sim, &dir, "gemini/gemini-2.5-flash", &input, "out.jsonl").await;
    let err = stderr(&o);
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 1, "{err}");
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 1, "{err}");
    assert_eq!(errors[0]["id"], "down");
    assert_eq!(errors[0]["kind"], "server", "{}", errors[0]);
    assert_eq!(errors[0]["retryable"], true, "{}", errors[0]);
    assert!(errors[0]["message"].as_str().unwrap().contains("HTTP 503"), "{}", errors[0]);
    assert_eq!(sim.stats().requests, 1, "no call for the record whose image could not be read");
    let base = sim.url();
    let again = weir()
        .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &base, "--progress", "never"])
        .args(["--id-field", "id", "--media-field", "image", "--retry-errors"])
        .args(["--input", input.to_str().unwrap(), "--output", dir.path("out.jsonl").to_str().unwrap()])
        .output()
        .await
        .unwrap();
    let err = stderr(&again);
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 2, "{err}");
    assert_eq!(rows(&dir.path("out.errors.jsonl")).len(), 0, "{err}");
    let s = sim.stats();
    assert_eq!((s.requests, s.media_parts), (2, 2), "{err}");
    sim.shutdown().await;
}

/// Parts too large to go inline (over 15 MB) go to the Gemini API through its Files API and
/// are referred to by URI; the same bytes in two records are uploaded once. An OpenAI-compatible
/// server, which takes no uploads, gets the record's error row instead, with no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_parts_go_through_the_gemini_files_api_once() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("media-files-api");
    let big = dir.write("big.png", &[png(7), vec![7u8; 18_000_000]].concat());
    let copy = dir.write("copy.png", &std::fs::read(&big).unwrap());
    let small = dir.write("small.png", &png(8));
    let lines = format!(
        "{{\"id\":\"big\",\"prompt\":\"describe\",\"image\":\"{}\"}}\n\
         {{\"id\":\"copy\",\"prompt\":\"describe it\",\"image\":\"{}\"}}\n\
         {{\"id\":\"small\",\"prompt\":\"describe\",\"image\":\"{}\"}}\n",
        big.display(),
        copy.display(),
        small.display()
    );
    let input = dir.write("in.jsonl", lines.as_bytes());
    let o = run_media(&sim, &dir, "gemini/gemini-2.5-flash", &input, "out.jsonl").await;
    let err = stderr(&o);
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 3, "{err}");
    let s = sim.stats();
    assert_eq!((s.requests, s.media_parts, s.media_uris), (3, 3, 2), "{err}");
    assert_eq!(s.gemini_files_uploaded, 1, "the same bytes are uploaded once: {err}");
    // Run again into another output (another process): the answers come from the cache, and
    // a cached answer costs no upload.
    let o = run_media(&sim, &dir, "gemini/gemini-2.5-flash", &input, "again.jsonl").await;
    let err = stderr(&o);
    assert_eq!(rows(&dir.path("again.jsonl")).len(), 3, "{err}");
    let s = sim.stats();
    assert_eq!((s.requests, s.gemini_files_uploaded), (3, 1), "answered from the cache, nothing uploaded: {err}");
    // OpenAI-compatible servers take parts inline only.
    let o = run_media(&sim, &dir, "openai/gpt-4o-mini", &input, "oai.jsonl").await;
    let err = stderr(&o);
    assert_eq!(rows(&dir.path("oai.jsonl")).len(), 1, "{err}");
    let errors = rows(&dir.path("oai.errors.jsonl"));
    assert_eq!(errors.len(), 2, "{err}");
    assert!(errors.iter().all(|e| e["message"].as_str().unwrap().contains("over the")), "{errors:?}");
    assert_eq!(sim.stats().requests, 4, "{err}");
    sim.shutdown().await;
}

/// A URL answered with no Content-Length, found too large to go inline only as it is read,
/// is read once: on past the inline limit, in the turn for large parts, and uploaded. Two
/// such records at once: the one that finds the turn taken waits for it (a few seconds at
/// most, then it reads again in its turn), and the two are uploaded one after the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_url_of_unknown_size_is_read_once() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("media-unsized");
    let big = |i: usize| [b"UNSIZED ".to_vec(), png(i), vec![i as u8; 17_000_000]].concat();
    let files: HashMap<String, Vec<u8>> = [("/one.png".to_string(), big(1)), ("/two.png".to_string(), big(2))].into();
    let base = serve(files).await;
    let hits = || async {
        let counts =
            reqwest::get(format!("{base}/hits")).await.unwrap().json::<HashMap<String, usize>>().await.unwrap();
        (counts.get("/one.png").copied().unwrap_or(0), counts.get("/two.png").copied().unwrap_or(0))
    };
    let input = dir.write(
        "one.jsonl",
        format!("{{\"id\":\"one\",\"prompt\":\"describe\",\"image\":\"{base}/one.png\"}}\n").as_bytes(),
    );
    let o = run_media(&sim, &dir, "gemini/gemini-2.5-flash", &input, "one-out.jsonl").await;
    let err = stderr(&o);
    assert_eq!(rows(&dir.path("one-out.jsonl")).len(), 1, "{err}");
    assert_eq!(sim.stats().gemini_files_uploaded, 1, "{err}");
    assert_eq!(hits().await, (1, 0), "read once: {err}");
    let lines = format!(
        "{{\"id\":\"one\",\"prompt\":\"describe it\",\"image\":\"{base}/one.png\"}}\n\
         {{\"id\":\"two\",\"prompt\":\"describe it\",\"image\":\"{base}/two.png\"}}\n"
    );
    let input = dir.write("two.jsonl", lines.as_bytes());
    let o = run_media(&sim, &dir, "gemini/gemini-2.5-flash", &input, "two-out.jsonl").await;
    let err = stderr(&o);
    assert_eq!(rows(&dir.path("two-out.jsonl")).len(), 2, "{err}");
    let (one, two) = hits().await;
    assert!((one - 1) + two <= 3 && one >= 2 && two >= 1, "at most one of the two read again: {one}, {two}: {err}");
    // An endpoint that takes no uploads: the error says the part is over the limit, not that
    // the bytes read before stopping are its size.
    let o = run_media(&sim, &dir, "openai/gpt-4o-mini", &input, "oai.jsonl").await;
    let errors = rows(&dir.path("oai.errors.jsonl"));
    assert_eq!(errors.len(), 2, "{}", stderr(&o));
    for e in &errors {
        let m = e["message"].as_str().unwrap();
        assert!(m.contains("more than the 15000000 bytes left"), "{m}");
    }
    sim.shutdown().await;
}

/// `--media-field FIELD:TYPE` gives a part's type where its content says none (a file of
/// plain text under any name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_type_is_the_parts_type() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("media-given-type");
    let notes = dir.write("notes.bin", b"meeting notes, plain text\n");
    let input = dir.write(
        "in.jsonl",
        format!("{{\"id\":\"n\",\"prompt\":\"summarise\",\"doc\":\"{}\"}}\n", notes.display()).as_bytes(),
    );
    let run = |field: &'static str, out: &'static str| {
        let (input, out, base) = (input.clone(), dir.path(out), sim.url());
        async move {
            weir()
                .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &base, "--progress", "never"])
                .args(["--id-field", "id", "--media-field", field, "--input", input.to_str().unwrap()])
                .args(["--output", out.to_str().unwrap()])
                .output()
                .await
                .unwrap()
        }
    };
    let o = run("doc", "untyped.jsonl").await;
    assert_eq!(rows(&dir.path("untyped.errors.jsonl")).len(), 1, "no type from a .bin of text: {}", stderr(&o));
    let o = run("doc:text/plain", "typed.jsonl").await;
    assert_eq!(rows(&dir.path("typed.jsonl")).len(), 1, "{}", stderr(&o));
    assert_eq!(sim.stats().media_parts, 1);
    sim.shutdown().await;
}

/// Found by an outside tester: `/proc/self/environ` named as media (with a type given) sent
/// weir's environment, keys and all, to the model; a finished text run was "resumed" with
/// `--media-field` added, answering nothing with the images. The system's files are refused,
/// and other media fields make another run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_files_are_not_media_and_other_media_fields_are_another_run() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("media-proc");
    let img = dir.write("a.png", &png(1));
    // A link to one is the system's file too, as is the same file by another name.
    let link = dir.path("env.txt");
    std::os::unix::fs::symlink("/proc/self/environ", &link).unwrap();
    let input = dir.write(
        "in.jsonl",
        format!(
            "{{\"id\":\"env\",\"prompt\":\"x\",\"m\":\"/proc/self/environ\"}}\n{{\"id\":\"img\",\"prompt\":\"x\",\"m\":\"{}\"}}\n\
             {{\"id\":\"link\",\"prompt\":\"x\",\"m\":\"{}\"}}\n{{\"id\":\"dots\",\"prompt\":\"x\",\"m\":\"/tmp/../proc/self/environ\"}}\n",
            img.display(),
            link.display()
        )
        .as_bytes(),
    );
    let run = |extra: &'static [&'static str]| {
        let (input, out, base) = (input.clone(), dir.path("out.jsonl"), sim.url());
        async move {
            weir()
                .env("GEMINI_API_KEY", "key-that-must-not-leave")
                .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &base, "--progress", "never"])
                .args(["--id-field", "id", "--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
                .args(extra)
                .output()
                .await
                .unwrap()
        }
    };
    let o = run(&[]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let before = sim.stats().requests;
    let o = run(&["--media-field", "m:text/plain"]).await;
    assert_eq!(o.status.code(), Some(2), "another run, not a resumed one: {}", stderr(&o));
    assert_eq!(sim.stats().requests, before);
    let o = run(&["--media-field", "m:text/plain", "--fresh"]).await;
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 3, "{}", stderr(&o));
    assert!(errors.iter().all(|e| e["message"].as_str().unwrap().contains("a file of the system")), "{errors:?}");
    assert_eq!(sim.stats().requests, before + 1, "only the image's record is sent");
    sim.shutdown().await;
}

/// A URL that never answers holds its record no longer than the run's `--timeout`: the record
/// is a retryable `timeout` error row, with no call, and the run ends soon after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_that_never_answers_is_given_up_after_the_runs_timeout() {
    let sim = sim(weir_sim::SimConfig::default()).await;
    let dir = Dir::new("media-stall");
    let mut served = HashMap::new();
    served.insert("/stall.png".to_string(), b"STALL".to_vec());
    served.insert("/ok.png".to_string(), png(3));
    let url = serve(served).await;
    let lines = format!(
        "{{\"id\":\"stall\",\"prompt\":\"describe\",\"image\":\"{url}/stall.png\"}}\n\
         {{\"id\":\"ok\",\"prompt\":\"describe\",\"image\":\"{url}/ok.png\"}}\n"
    );
    let input = dir.write("in.jsonl", lines.as_bytes());
    let started = std::time::Instant::now();
    let o = weir()
        .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &sim.url(), "--progress", "never"])
        .args(["--id-field", "id", "--media-field", "image", "--timeout", "2"])
        .args(["--input", input.to_str().unwrap(), "--output", dir.path("out.jsonl").to_str().unwrap()])
        .output()
        .await
        .unwrap();
    let took = started.elapsed();
    let err = stderr(&o);
    assert!(took < std::time::Duration::from_secs(20), "took {took:?}: {err}");
    assert_eq!(rows(&dir.path("out.jsonl")).len(), 1, "{err}");
    let errors = rows(&dir.path("out.errors.jsonl"));
    assert_eq!(errors.len(), 1, "{err}");
    assert_eq!(
        (errors[0]["id"].as_str(), errors[0]["kind"].as_str()),
        (Some("stall"), Some("timeout")),
        "{}",
        errors[0]
    );
    assert_eq!(errors[0]["retryable"], true, "{}", errors[0]);
    assert!(errors[0]["message"].as_str().unwrap().contains("--timeout"), "{}", errors[0]);
    assert_eq!(sim.stats().requests, 1, "no call for the record whose image could not be read");
    sim.shutdown().await;
}

/// Ctrl-C while records' media is being fetched from a URL that does not answer: the fetches
/// are given up at once (no call was paid for them), with `--output -` (each record an
/// `aborted` row) as with a file (each record left to a resume).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_gives_up_media_fetches_at_once() {
    let dir = Dir::new("media-ctrl-c");
    let mut served = HashMap::new();
    let mut lines = String::new();
    for i in 0..6 {
        served.insert(format!("/s{i}.png"), b"STALL".to_vec());
    }
    let url = serve(served).await;
    for i in 0..6 {
        lines.push_str(&format!("{{\"id\":\"s{i}\",\"prompt\":\"describe\",\"image\":\"{url}/s{i}.png\"}}\n"));
    }
    let input = dir.write("in.jsonl", lines.as_bytes());
    for out in ["-", "out.jsonl"] {
        let target = if out == "-" { out.to_string() } else { dir.path(out).to_str().unwrap().to_string() };
        let child = weir()
            .args(["run", "--model", "sim/demo", "--progress", "never", "--id-field", "id", "--media-field", "image"])
            .args(["--input", input.to_str().unwrap(), "--output", &target])
            .current_dir(&dir.0)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        let pid = child.id().unwrap().to_string();
        let interrupted = std::time::Instant::now();
        assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
        let o = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait_with_output())
            .await
            .expect("weir ended soon after Ctrl-C")
            .unwrap();
        let err = stderr(&o);
        assert!(
            interrupted.elapsed() < std::time::Duration::from_secs(10),
            "{out}: {:?}: {err}",
            interrupted.elapsed()
        );
        if out == "-" {
            let errors = rows(&dir.path("weir.errors.jsonl"));
            assert_eq!(errors.len(), 6, "{err}");
            assert!(errors.iter().all(|e| e["kind"] == "aborted"), "{errors:?}");
        } else {
            assert!(err.contains("6 records not finished"), "{err}");
        }
    }
}
