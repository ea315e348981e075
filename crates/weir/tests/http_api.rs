//! `http/<name>` models (issue #37): any JSON-over-HTTP API, here a translation service on
//! loopback that enforces a quota of 20 requests per 1-second window and answers above it with
//! 429 and a whole-second `Retry-After`. Every record is answered once (the service counts the
//! calls that succeeded for each text), a finished run pays nothing again, a record without a
//! field the template names is an error row with no call, and the key never leaves the
//! request.

mod util;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use util::*;

const KEY: &str = "tr-key-4f1c9e0b77";

#[derive(Default)]
struct Seen {
    /// Successful calls for each text.
    answered: HashMap<String, u32>,
    refused: u32,
    window: (u64, u32),
}

/// The service: `POST /v2/translate {"q", "target"}` → `{"data": {"translations":
/// [{"translatedText"}]}, "usage": {"characters"}}`, the text reversed and tagged.
async fn serve(limit: u32) -> (String, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let start = Instant::now();
    let state = seen.clone();
    let url = listen(move |req| {
        let state = state.clone();
        async move {
            let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("");
            let ok_key = auth == format!("Bearer {KEY}");
            let path = req.uri().path().to_string();
            let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let reply = |status: u16, headers: &[(&str, &str)], body: String| {
                let mut r = hyper::Response::builder().status(status);
                for (k, v) in headers {
                    r = r.header(*k, *v);
                }
                r.body(Full::new(Bytes::from(body))).unwrap()
            };
            if !ok_key {
                return reply(401, &[], r#"{"error": "bad key"}"#.into());
            }
            if path != "/v2/translate" {
                return reply(404, &[], "{}".into());
            }
            let v: serde_json::Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(_) => return reply(400, &[], r#"{"error": "not JSON"}"#.into()),
            };
            let (Some(q), Some(target)) = (v["q"].as_str(), v["target"].as_str()) else {
                return reply(400, &[], r#"{"error": "q and target are required"}"#.into());
            };
            {
                let mut s = state.lock().unwrap();
                let window = start.elapsed().as_secs();
                if s.window.0 != window {
                    s.window = (window, 0);
                }
                if s.window.1 >= limit {
                    s.refused += 1;
                    return reply(429, &[("retry-after", "1")], r#"{"error": "quota"}"#.into());
                }
                s.window.1 += 1;
                *s.answered.entry(q.to_string()).or_default() += 1;
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
            let text: String = q.chars().rev().collect();
            let out = serde_json::json!({"data": {"translations": [{"translatedText": format!("{target}:{text}")}]},
                            "usage": {"characters": q.chars().count()}});
            reply(200, &[("content-type", "application/json")], out.to_string())
        }
    })
    .await;
    (url, seen)
}

/// Serves `answer` on a free loopback port, each connection in a task of its own: the URL.
async fn listen<F, Fut>(answer: F) -> String
where
    F: Fn(hyper::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = hyper::Response<Full<Bytes>>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let reply = answer(req);
                    async move { Ok::<_, std::convert::Infallible>(reply.await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

fn models(dir: &Dir, url: &str) -> std::path::PathBuf {
    dir.write(
        "models.toml",
        format!(
            r#"[models.translate]
url = "{url}/v2/translate"
headers = {{ Authorization = "Bearer ${{TR_KEY}}" }}
body = {{ q = "{{prompt}}", target = "{{lang}}", format = "text" }}
answer = "/data/translations/0/translatedText"
prompt_tokens = "/usage/characters"
"#
        )
        .as_bytes(),
    )
}

fn args(dir: &Dir, models: &std::path::Path, input: &std::path::Path) -> Vec<String> {
    let out = dir.path("out.jsonl");
    [
        "run",
        "--model",
        "http/translate",
        "--http-models",
        models.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--id-field",
        "id",
        "--prompt-field",
        "text",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_http_model_under_a_quota_answers_every_record_once() {
    let (url, seen) = serve(20).await;
    let dir = Dir::new("http-api-quota");
    let models = models(&dir, &url);
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for i in 0..300 {
        let lang = ["de", "fr", "ja"][i % 3];
        data.extend_from_slice(
            format!("{{\"id\":\"t{i}\",\"text\":\"sentence {i}\",\"lang\":\"{lang}\"}}\n").as_bytes(),
        );
        ids.push(format!("t{i}"));
    }
    // A record without the field the body names: an error row, no call.
    data.extend_from_slice(b"{\"id\":\"nolang\",\"text\":\"sentence x\"}\n");
    let input = dir.write("in.jsonl", &data);
    let started = Instant::now();
    let o = weir().args(args(&dir, &models, &input)).env("TR_KEY", KEY).output().await.unwrap();
    let took = started.elapsed();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "one error row: {err}");
    let (results, errors) = (rows(&dir.path("out.jsonl")), rows(&dir.path("out.errors.jsonl")));
    let mut all = ids.clone();
    all.push("nolang".into());
    assert_each_id_once(&all, &results, &errors);
    assert_eq!(results.len(), 300, "{err}");
    for r in &results {
        let i: usize = r["id"].as_str().unwrap()[1..].parse().unwrap();
        let want =
            format!("{}:{}", ["de", "fr", "ja"][i % 3], format!("sentence {i}").chars().rev().collect::<String>());
        assert_eq!(r["response"], want.as_str(), "{r}");
        assert_eq!(r["model"], "http/translate");
        assert_eq!(r["usage"]["prompt_tokens"], format!("sentence {i}").len() as u64, "{r}");
    }
    assert_eq!(errors[0]["kind"], "invalid_input", "{}", errors[0]);
    assert!(errors[0]["message"].as_str().unwrap().contains("'lang'"), "{}", errors[0]);
    let (answered, refused) = {
        let s = seen.lock().unwrap();
        (s.answered.clone(), s.refused)
    };
    assert_eq!(answered.len(), 300, "each text once");
    assert!(answered.values().all(|n| *n == 1), "a text answered twice");
    assert!(!answered.contains_key("sentence x"), "the record without its field made no call");
    // 300 calls at 20 per second take 15 windows at least.
    assert!(took >= Duration::from_secs(14), "{took:?}");
    eprintln!("http model: 300 calls in {took:?}, {refused} refused ({:.1} %)", 100.0 * refused as f64 / 300.0);
    assert!((refused as f64) < 0.25 * 300.0, "{refused} refusals: {err}");
    // The key is in no file weir wrote, and not in its log.
    assert!(!err.contains(KEY));
    for path in walk(&dir.0) {
        if path.file_name().is_some_and(|n| n == "models.toml") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap_or_default();
        assert!(!String::from_utf8_lossy(&bytes).contains(KEY), "{}", path.display());
    }
    // Run again: every record is finished, nothing is sent.
    let o = weir().args(args(&dir, &models, &input)).env("TR_KEY", KEY).output().await.unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(seen.lock().unwrap().answered.values().sum::<u32>(), 300, "{}", stderr(&o));
}

/// A models file that cannot work is exit 2 before any call, saying what to fix; a rejected
/// key stops the run without showing the key.
#[tokio::test(flavor = "multi_thread")]
async fn http_model_mistakes_are_usage_errors_and_a_wrong_key_stops_the_run() {
    let (url, seen) = serve(100).await;
    let dir = Dir::new("http-api-refusals");
    let input = dir.write("in.jsonl", b"{\"id\":\"a\",\"text\":\"x\",\"lang\":\"de\"}\n");
    let good = models(&dir, &url);
    let bad = |name: &str, text: &str| dir.write(name, text.as_bytes());
    for (models, env, says) in [
        (good.clone(), None, "TR_KEY is not set"),
        (
            bad("m1.toml", "[models.other]\nurl = \"https://x.com/\"\nanswer = \"/a\"\n"),
            Some(KEY),
            "has no [models.translate]",
        ),
        (bad("m2.toml", "[models.translate]\nurl = \"http://example.com/\"\nanswer = \"/a\"\n"), Some(KEY), "https"),
        (
            bad("m3.toml", "[models.translate]\nurl = \"https://x.com/\"\nanswer = \"/a\"\ncolour = 1\n"),
            Some(KEY),
            "unknown field",
        ),
        (dir.path("missing.toml"), Some(KEY), "cannot read it"),
    ] {
        let mut cmd = weir();
        cmd.args(args(&dir, &models, &input));
        match env {
            Some(k) => cmd.env("TR_KEY", k),
            None => cmd.env_remove("TR_KEY"),
        };
        let o = cmd.output().await.unwrap();
        assert_eq!(o.status.code(), Some(2), "{says}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{says}: {}", stderr(&o));
    }
    let o = weir().args(args(&dir, &good, &input)).env("TR_KEY", "wrong-key-123456").output().await.unwrap();
    let err = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("wrong-key-123456"), "{err}");
    assert!(seen.lock().unwrap().answered.is_empty());
}

/// The same model over a CSV table in `weir run`, and in `weir sql` (where its template has the
/// prompt: `llm_generate('http/…', column)`), each row answered once.
#[tokio::test(flavor = "multi_thread")]
async fn an_http_model_over_tables_and_in_sql() {
    let (url, seen) = serve(100).await;
    let dir = Dir::new("http-api-tables");
    let models = models(&dir, &url);
    let csv = dir.write("in.csv", b"id,text,lang\nc1,first line,de\nc2,\"second, quoted\",fr\nc3,third,ja\n");
    let o = weir().args(args(&dir, &models, &csv)).env("TR_KEY", KEY).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out: HashMap<String, String> = rows(&dir.path("out.jsonl"))
        .into_iter()
        .map(|r| (r["id"].as_str().unwrap().to_string(), r["response"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(out["c2"], "fr:detouq ,dnoces");
    assert_eq!(out.len(), 3);
    // The models file changed (the same fields, another body): new answers, not the cached ones.
    let changed = std::fs::read_to_string(&models).unwrap().replace("q = \"{prompt}\"", "q = \"{prompt}!\"");
    let changed = dir.write("models-xx.toml", changed.as_bytes());
    // Resuming the first run's output with the edited model is refused: its answers would mix
    // with the old ones.
    let o = weir().args(args(&dir, &changed, &csv)).env("TR_KEY", KEY).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("http=translate#"), "{}", stderr(&o));
    let mut again = args(&dir, &changed, &csv);
    let at = again.iter().position(|a| a == "--output").unwrap();
    again[at + 1] = dir.path("out-xx.jsonl").to_str().unwrap().to_string();
    let o = weir().args(&again).env("TR_KEY", KEY).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let xx = rows(&dir.path("out-xx.jsonl"));
    assert!(xx.len() == 3 && xx.iter().all(|r| r["response"].as_str().unwrap().contains(":!")), "{xx:?}");
    if cfg!(feature = "sql") {
        // In SQL the template knows {prompt} only: a model whose body names no other field.
        let sql_models = dir.write(
            "sql-models.toml",
            format!(
                "[models.de]\nurl = \"{url}/v2/translate\"\nheaders = {{ Authorization = \"Bearer ${{TR_KEY}}\" }}\n\
                 body = {{ q = \"{{prompt}}\", target = \"de\" }}\nanswer = \"/data/translations/0/translatedText\"\n"
            )
            .as_bytes(),
        );
        let o = weir()
            .current_dir(&dir.0)
            .env("TR_KEY", KEY)
            .args(["sql", "--format", "jsonl", "--http-models", sql_models.to_str().unwrap()])
            .arg("SELECT id, llm_generate('http/de', text) AS t FROM 'in.csv' ORDER BY id")
            .output()
            .await
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let rows: Vec<serde_json::Value> =
            String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let got: Vec<&str> = rows.iter().map(|r| r["t"].as_str().unwrap()).collect();
        assert_eq!(got, ["de:enil tsrif", "de:detouq ,dnoces", "de:driht"]);
    }
    assert_eq!(seen.lock().unwrap().answered.values().sum::<u32>(), if cfg!(feature = "sql") { 9 } else { 6 });
}

/// A server that answers every request with `status` and the header `name: value`.
async fn fixed(status: u16, name: &'static str, to: String) -> String {
    listen(move |_req| {
        let answer = hyper::Response::builder()
            .status(status)
            .header(name, to.clone())
            .body(Full::new(Bytes::from_static(b"")))
            .unwrap();
        async move { answer }
    })
    .await
}

/// A server that keeps every request line and header value it saw.
async fn catcher() -> (String, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let state = seen.clone();
    let url = listen(move |req| {
        let mut s = state.lock().unwrap();
        s.push(format!("{} {}", req.method(), req.uri()));
        s.extend(req.headers().values().map(|v| String::from_utf8_lossy(v.as_bytes()).to_string()));
        async move {
            hyper::Response::new(Full::new(Bytes::from_static(
                br#"{"data":{"translations":[{"translatedText":"caught"}]}}"#,
            )))
        }
    })
    .await;
    (url, seen)
}

/// A model endpoint that redirects (to another host here: another port) is not followed, for
/// an `http/` model with its key in a custom header and for the Gemini API (`x-goog-api-key`):
/// the key never reaches the other host, no answer of a POST turned GET is taken, and the run
/// stops saying the endpoint redirects.
#[tokio::test(flavor = "multi_thread")]
async fn redirects_are_not_followed_and_carry_no_key_away() {
    let (elsewhere, caught) = catcher().await;
    let dir = Dir::new("http-api-redirect");
    let input = dir.write("in.jsonl", b"{\"id\":\"a\",\"text\":\"x\"}\n{\"id\":\"b\",\"text\":\"y\"}\n");
    for status in [301u16, 302, 307, 308] {
        let moved = fixed(status, "location", format!("{elsewhere}/v2/translate")).await;
        let models = dir.write(
            "models.toml",
            format!(
                "[models.translate]\nurl = \"{moved}/v2/translate\"\nheaders = {{ X-Api-Key = \"${{TR_KEY}}\" }}\n\
                 body = {{ q = \"{{prompt}}\" }}\nanswer = \"/data/translations/0/translatedText\"\n"
            )
            .as_bytes(),
        );
        let out = dir.path(&format!("out-{status}.jsonl"));
        let o = weir()
            .args(["run", "--model", "http/translate", "--http-models", models.to_str().unwrap()])
            .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
            .args(["--id-field", "id", "--prompt-field", "text"])
            .env("TR_KEY", KEY)
            .output()
            .await
            .unwrap();
        let err = stderr(&o);
        assert_ne!(o.status.code(), Some(0), "{status}: {err}");
        assert!(rows(&out).is_empty(), "{status}: an answer was taken: {err}");
        assert!(err.contains("redirects"), "{status}: {err}");
        let gemini =
            fixed(status, "location", format!("{elsewhere}/v1beta/models/gemini-2.5-flash:generateContent")).await;
        let out = dir.path(&format!("gemini-{status}.jsonl"));
        let o = weir()
            .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &gemini])
            .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
            .args(["--id-field", "id", "--prompt-field", "text"])
            .env("GEMINI_API_KEY", KEY)
            .output()
            .await
            .unwrap();
        assert_ne!(o.status.code(), Some(0), "gemini {status}: {}", stderr(&o));
        assert!(rows(&out).is_empty(), "gemini {status}: {}", stderr(&o));
    }
    let caught = caught.lock().unwrap();
    assert!(caught.is_empty(), "requests reached the other host: {caught:?}");
}

/// A refusal that asks to wait a day (or until a date years away) stops the run at once saying
/// so, rather than holding every call in silence; the next run is not held either.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_after_of_a_day_stops_the_run_saying_so() {
    let dir = Dir::new("http-api-retry-after");
    let input = dir.write("in.jsonl", b"{\"id\":\"a\",\"text\":\"x\"}\n{\"id\":\"b\",\"text\":\"y\"}\n");
    for (i, after) in ["86400", "Fri, 01 Jan 2100 00:00:00 GMT"].into_iter().enumerate() {
        let url = fixed(429, "retry-after", after.to_string()).await;
        let models = dir.write(
            "models.toml",
            format!("[models.t]\nurl = \"{url}/t\"\nbody = {{ q = \"{{prompt}}\" }}\nanswer = \"/a\"\n").as_bytes(),
        );
        let out = dir.path(&format!("out-{i}.jsonl"));
        let started = Instant::now();
        let o = weir()
            .args(["run", "--model", "http/t", "--http-models", models.to_str().unwrap()])
            .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
            .args(["--id-field", "id", "--prompt-field", "text"])
            .output()
            .await
            .unwrap();
        let err = stderr(&o);
        assert!(started.elapsed() < Duration::from_secs(30), "{after}: {:?} {err}", started.elapsed());
        assert_ne!(o.status.code(), Some(0), "{after}: {err}");
        assert!(err.contains("asks to wait") && err.contains("run again"), "{after}: {err}");
        assert!(rows(&out).is_empty(), "{after}");
    }
}

/// A model whose templates name no `{prompt}` needs no prompt field; flags that would shape
/// another provider's request are exit 2, not ignored (and so is a parameter Claude has no
/// place for), before any call.
#[tokio::test(flavor = "multi_thread")]
async fn a_model_without_a_prompt_and_flags_that_do_not_apply() {
    let (url, seen) = serve(100).await;
    let dir = Dir::new("http-api-no-prompt");
    let models = dir.write(
        "models.toml",
        format!(
            "[models.translate]\nurl = \"{url}/v2/translate\"\nheaders = {{ Authorization = \"Bearer ${{TR_KEY}}\" }}\n\
             body = {{ q = \"{{text}}\", target = \"{{lang}}\" }}\nanswer = \"/data/translations/0/translatedText\"\n"
        )
        .as_bytes(),
    );
    let input = dir.write("in.jsonl", b"{\"id\":\"a\",\"text\":\"hello\",\"lang\":\"de\"}\n");
    let out = dir.path("out.jsonl");
    let base = |extra: &[&str]| {
        let mut c = weir();
        c.args(["run", "--model", "http/translate", "--http-models", models.to_str().unwrap()])
            .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap(), "--id-field", "id"])
            .args(extra)
            .env("TR_KEY", KEY);
        c
    };
    for (extra, says) in [
        (&["--param", "temperature=0.2"][..], "--param does not apply"),
        (&["--base-url", "http://127.0.0.1:9/v1"][..], "--base-url"),
        (&["--stream"][..], "--stream"),
        (&["--system", "be brief"][..], "{system}"),
        (&["--template", "say {text}"][..], "{prompt}"),
        (&["--prompt-field", "text"][..], "{prompt}"),
    ] {
        let o = base(extra).output().await.unwrap();
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{extra:?}: {}", stderr(&o));
    }
    assert!(seen.lock().unwrap().answered.is_empty());
    let o = base(&[]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(rows(&out)[0]["response"], "de:olleh");
    let o = weir()
        .args(["run", "--model", "anthropic/claude-haiku-4-5", "--param", "seed=1"])
        .args(["--input", input.to_str().unwrap(), "--output", dir.path("c.jsonl").to_str().unwrap()])
        .env("ANTHROPIC_API_KEY", "k-123456")
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--param seed"), "{}", stderr(&o));
}

/// Statuses in none of the file's lists are not tried again (an outside tester saw 409, 425,
/// 501 and 529 retried); a fixed url not found (404) stops the run, and its record is the run's
/// failure (`endpoint`), tried again by the next run, where it was a finished `bad_request`.
#[tokio::test(flavor = "multi_thread")]
async fn unlisted_statuses_are_not_retried_and_a_missing_url_is_the_runs_failure() {
    let dir = Dir::new("http-api-statuses");
    let input = dir.write("in.jsonl", b"{\"id\":\"a\",\"text\":\"x\"}\n");
    for (status, code, kind) in [(409u16, 1, "bad_request"), (529, 1, "server"), (404, 3, "endpoint")] {
        let calls = Arc::new(Mutex::new(0u32));
        let counted = calls.clone();
        let url = listen(move |_req| {
            *counted.lock().unwrap() += 1;
            let answer = hyper::Response::builder().status(status).body(Full::new(Bytes::from_static(b"{}"))).unwrap();
            async move { answer }
        })
        .await;
        let models = dir.write(
            "models.toml",
            format!("[models.t]\nurl = \"{url}/t\"\nbody = {{ q = \"{{prompt}}\" }}\nanswer = \"/a\"\n").as_bytes(),
        );
        let out = dir.path(&format!("out-{status}.jsonl"));
        let run = || {
            let mut c = weir();
            c.args(["run", "--model", "http/t", "--http-models", models.to_str().unwrap()])
                .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
                .args(["--id-field", "id", "--prompt-field", "text"]);
            c
        };
        let o = run().output().await.unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(code), "{status}: {err}");
        assert_eq!(*calls.lock().unwrap(), 1, "{status}: tried once: {err}");
        let errors = rows(&dir.path(&format!("out-{status}.errors.jsonl")));
        assert_eq!(errors.len(), 1, "{status}: {err}");
        assert_eq!(errors[0]["kind"], kind, "{status}: {}", errors[0]);
        let o = run().output().await.unwrap();
        // A record's own error is finished; the run's is tried again.
        let again = if status == 404 { 2 } else { 1 };
        assert_eq!(*calls.lock().unwrap(), again, "{status}: {}", stderr(&o));
    }
}

/// A record that `--model-field` sends to an `http/` model, in a run given `--param`, is that
/// record's error naming the flag: the parameters were dropped in silence before.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_routed_to_an_http_model_with_params_is_its_error() {
    let (url, seen) = serve(100).await;
    let dir = Dir::new("http-api-routed-params");
    let models = dir.write(
        "models.toml",
        format!("[models.t]\nurl = \"{url}/v2/translate\"\nbody = {{ q = \"{{prompt}}\" }}\nanswer = \"/data/translations/0/translatedText\"\n")
            .as_bytes(),
    );
    let input = dir.write("in.jsonl", b"{\"id\":\"a\",\"text\":\"x\",\"m\":\"http/t\"}\n");
    let out = dir.path("out.jsonl");
    // --system too, where the model's templates name no {system}.
    for (flag, value, says) in [
        ("--param", "temperature=0.2", "--param does not apply"),
        ("--system", "Be brief.", "--system and --system-field do not apply"),
    ] {
        let o = weir()
            .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &url, "--model-field", "m"])
            .args(["--http-models", models.to_str().unwrap(), flag, value, "--fresh"])
            .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()])
            .args(["--id-field", "id", "--prompt-field", "text"])
            .env("GEMINI_API_KEY", "k")
            .output()
            .await
            .unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{flag}: {err}");
        let errors = rows(&dir.path("out.errors.jsonl"));
        assert_eq!(errors.len(), 1, "{flag}: {err}");
        assert!(errors[0]["message"].as_str().unwrap().contains(says), "{flag}: {}", errors[0]);
    }
    assert!(seen.lock().unwrap().answered.is_empty(), "no call");
}
