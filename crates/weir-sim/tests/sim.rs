//! The simulator over real HTTP: every route, quotas, faults, streaming timing.

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use weir_sim::{SimConfig, SimServer};

async fn start(config: SimConfig) -> SimServer {
    SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap()
}

fn gemini_body(text: &str) -> Value {
    json!({"contents": [{"role": "user", "parts": [{"text": text}]}], "generationConfig": {"maxOutputTokens": 100}})
}

fn openai_body(text: &str) -> Value {
    json!({"model": "sim-1", "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn gemini_routes_answer_in_the_gemini_format() {
    let sim = start(SimConfig::default()).await;
    let c = client();
    for (path, key_in_query) in [
        ("/v1beta/models/gemini-2.5-flash:generateContent", false),
        ("/v1/models/gemini-2.5-flash:generateContent", true),
        ("/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-flash:generateContent", false),
        ("/v1beta1/projects/p/locations/global/publishers/google/models/gemini-2.5-flash:generateContent", false),
    ] {
        let url = if key_in_query { format!("{}{path}?key=k", sim.url()) } else { format!("{}{path}", sim.url()) };
        let r = c
            .post(url)
            .header("x-goog-api-key", "k")
            .bearer_auth("t")
            .json(&gemini_body("hello there"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let v: Value = r.json().await.unwrap();
        let text = v["candidates"][0]["content"]["parts"][0]["text"].as_str().unwrap();
        assert!(!text.is_empty());
        assert_eq!(v["candidates"][0]["finishReason"], "STOP");
        assert_eq!(v["usageMetadata"]["promptTokenCount"], 3); // "hello there" = 11 chars
        let out = v["usageMetadata"]["candidatesTokenCount"].as_u64().unwrap();
        assert_eq!(v["usageMetadata"]["totalTokenCount"].as_u64().unwrap(), 3 + out);
    }
    // Deterministic: the same request, the same answer.
    let url = format!("{}/v1beta/models/m:generateContent", sim.url());
    let a: Value = c.post(&url).json(&gemini_body("same")).send().await.unwrap().json().await.unwrap();
    let b: Value = c.post(&url).json(&gemini_body("same")).send().await.unwrap().json().await.unwrap();
    assert_eq!(a["candidates"], b["candidates"]);
    let stats = sim.stats();
    assert_eq!(stats.requests, 6);
    assert_eq!(stats.successes, 6);
    sim.shutdown().await;
}

#[tokio::test]
async fn max_output_tokens_is_respected() {
    let sim = start(SimConfig::default()).await;
    let body = json!({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"maxOutputTokens": 2}});
    let v: Value = client()
        .post(format!("{}/v1beta/models/m:generateContent", sim.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["candidates"][0]["finishReason"], "MAX_TOKENS");
    assert_eq!(v["usageMetadata"]["candidatesTokenCount"], 2);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3});
    let v: Value = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    sim.shutdown().await;
}

#[tokio::test]
async fn openai_and_predict_routes() {
    let sim = start(SimConfig::default()).await;
    let c = client();
    let r = c.post(format!("{}/v1/chat/completions", sim.url())).json(&openai_body("hi")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().len() > 3);
    assert_eq!(v["usage"]["prompt_tokens"], 1);

    let models: Value = c.get(format!("{}/v1/models", sim.url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["object"], "list");

    let predict = format!("{}/v1/projects/p/locations/us-central1/endpoints/123:predict", sim.url());
    let v: Value = c
        .post(&predict)
        .bearer_auth("t")
        .json(&json!({"instances": [{"prompt": "a", "max_tokens": 5}, {"prompt": "b", "raw_response": true}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let preds = v["predictions"].as_array().unwrap();
    assert_eq!(preds.len(), 2);
    assert!(preds[0].as_str().unwrap().starts_with("Prompt:\na\nOutput:\n"));
    assert!(!preds[1].as_str().unwrap().starts_with("Prompt:"));
    assert!(v["deployedModelId"].is_string());

    let v: Value = c
        .post(&predict)
        .json(&json!({"instances": [{"@requestFormat": "chatCompletions", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(v["predictions"]["choices"][0]["message"]["content"].is_string());

    // Bad bodies are 400 in the API's own format.
    let r = c.post(format!("{}/v1/chat/completions", sim.url())).body("{not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let r = c.post(format!("{}/v1beta/models/m:generateContent", sim.url())).json(&json!({})).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["status"], "INVALID_ARGUMENT");
    sim.shutdown().await;
}

#[tokio::test]
async fn keys_are_checked_when_configured() {
    let sim = start(SimConfig { api_keys: vec!["good".into()], ..SimConfig::default() }).await;
    let c = client();
    let url = format!("{}/v1beta/models/m:generateContent", sim.url());
    let r = c.post(&url).header("x-goog-api-key", "bad").json(&gemini_body("x")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["details"][0]["reason"], "API_KEY_INVALID");
    assert_eq!(c.post(&url).json(&gemini_body("x")).send().await.unwrap().status(), 403);
    assert_eq!(
        c.post(&url).header("x-goog-api-key", "good").json(&gemini_body("x")).send().await.unwrap().status(),
        200
    );
    let r = c
        .post(format!("{}/v1/chat/completions", sim.url()))
        .bearer_auth("bad")
        .json(&openai_body("x"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    assert_eq!(sim.stats().auth_failures, 3);
    sim.shutdown().await;
}

/// Under overload, a sliding-window quota admits exactly R per window.
#[tokio::test]
async fn quota_admits_exactly_r_per_window_with_provider_429s() {
    let mut config = SimConfig::default();
    config.quota.requests_per_window = 10;
    config.quota.window_secs = 2.0;
    let sim = start(config).await;
    let c = client();
    let url = format!("{}/v1beta/models/gemini-2.5-flash:generateContent", sim.url());
    let mut tasks = Vec::new();
    for i in 0..40 {
        let c = c.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            c.post(url).header("x-goog-api-key", "k").json(&gemini_body(&format!("p{i}"))).send().await.unwrap()
        }));
    }
    let mut ok = 0;
    let mut limited = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        match r.status().as_u16() {
            200 => ok += 1,
            429 => limited.push(r.json::<Value>().await.unwrap()),
            s => panic!("status {s}"),
        }
    }
    assert_eq!(ok, 10);
    assert_eq!(limited.len(), 30);
    let e = &limited[0]["error"];
    assert_eq!(e["status"], "RESOURCE_EXHAUSTED");
    assert_eq!(e["details"][0]["@type"], "type.googleapis.com/google.rpc.QuotaFailure");
    assert!(e["details"][0]["violations"][0]["quotaId"].as_str().unwrap().contains("PerMinute"));
    let delay = e["details"][2]["retryDelay"].as_str().unwrap();
    let secs: f64 = delay.trim_end_matches('s').parse().unwrap();
    assert!(secs > 1.0 && secs <= 2.0, "{delay}");
    // Another key has its own quota.
    assert_eq!(
        c.post(&url).header("x-goog-api-key", "other").json(&gemini_body("z")).send().await.unwrap().status(),
        200
    );

    // OpenAI: headers on success and on 429.
    let url = format!("{}/v1/chat/completions", sim.url());
    let r = c.post(&url).bearer_auth("o").json(&openai_body("a")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-ratelimit-limit-requests"], "10");
    assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "9");
    for _ in 0..9 {
        assert_eq!(c.post(&url).bearer_auth("o").json(&openai_body("a")).send().await.unwrap().status(), 200);
    }
    let r = c.post(&url).bearer_auth("o").json(&openai_body("a")).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let ms: u64 = r.headers()["retry-after-ms"].to_str().unwrap().parse().unwrap();
    assert!(ms > 1000 && ms <= 2000, "{ms}");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    // After the window slides, requests are admitted again.
    tokio::time::sleep(Duration::from_millis(2050)).await;
    assert_eq!(c.post(&url).bearer_auth("o").json(&openai_body("a")).send().await.unwrap().status(), 200);
    assert_eq!(sim.stats().rate_limited, 31);
    sim.shutdown().await;
}

#[tokio::test]
async fn token_and_daily_quotas() {
    let mut config = SimConfig::default();
    config.quota.tokens_per_window = 200;
    config.quota.requests_per_day = 5;
    config.output.min_tokens = 10;
    config.output.max_tokens = 10;
    let sim = start(config).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", sim.url());
    // Each request: 40 prompt tokens + 10 output = 50 tokens; four fit in 200.
    let long = "x".repeat(160);
    for _ in 0..4 {
        assert_eq!(c.post(&url).bearer_auth("k").json(&openai_body(&long)).send().await.unwrap().status(), 200);
    }
    let r = c.post(&url).bearer_auth("k").json(&openai_body(&long)).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "tokens");
    // A request bigger than the whole quota can never succeed: 400.
    let huge = "x".repeat(2000);
    assert_eq!(c.post(&url).bearer_auth("k2").json(&openai_body(&huge)).send().await.unwrap().status(), 400);
    // The daily quota: key k3 gets 5 requests, then is refused with a per-day quota id.
    let gurl = format!("{}/v1beta/models/m:generateContent", sim.url());
    for _ in 0..5 {
        assert_eq!(
            c.post(&gurl).header("x-goog-api-key", "k3").json(&gemini_body("a")).send().await.unwrap().status(),
            200
        );
    }
    let r = c.post(&gurl).header("x-goog-api-key", "k3").json(&gemini_body("a")).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["details"][0]["violations"][0]["quotaId"].as_str().unwrap().contains("PerDay"));
    sim.shutdown().await;
}

#[tokio::test]
async fn every_fault_kind_can_be_forced_by_a_directive() {
    let mut config = SimConfig::default();
    config.faults.hang_secs = 30.0;
    let sim = start(config).await;
    let c = client();
    let g = format!("{}/v1beta/models/m:generateContent", sim.url());
    let o = format!("{}/v1/chat/completions", sim.url());

    let r = c.post(&g).json(&gemini_body("[sim:error_500]")).send().await.unwrap();
    assert_eq!(r.status(), 500);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["status"], "INTERNAL");
    let r = c.post(&o).json(&openai_body("[sim:error_503]")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let r = c.post(&g).json(&gemini_body("[sim:reset]")).send().await;
    assert!(r.is_err(), "a reset must be a transport error: {r:?}");
    let r = client().post(&g).timeout(Duration::from_millis(300)).json(&gemini_body("[sim:hang]")).send().await;
    assert!(r.unwrap_err().is_timeout());
    let r = c.post(&g).json(&gemini_body("[sim:malformed]")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.json::<Value>().await.is_err());
    let v: Value = c.post(&g).json(&gemini_body("[sim:block_prompt]")).send().await.unwrap().json().await.unwrap();
    assert!(v.get("candidates").is_none());
    assert_eq!(v["promptFeedback"]["blockReason"], "SAFETY");
    let v: Value = c.post(&g).json(&gemini_body("[sim:block_candidate]")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["candidates"][0]["finishReason"], "SAFETY");
    assert!(v["candidates"][0].get("content").is_none());
    let r = c.post(&o).json(&openai_body("[sim:block_prompt]")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "content_filter");
    let v: Value = c.post(&o).json(&openai_body("[sim:block_candidate]")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter");
    assert!(v["choices"][0]["message"]["content"].is_null());
    // A truncated stream: some events, then the connection breaks without [DONE].
    let mut body = openai_body("[sim:truncate]");
    body["stream"] = json!(true);
    let r = c.post(&o).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await;
    assert!(text.is_err(), "truncated body must fail: {text:?}");

    let f = sim.stats().faults;
    for k in ["error_500", "error_503", "reset", "hang", "malformed", "truncate"] {
        assert_eq!(f[k], 1, "{k}");
    }
    assert_eq!(f["block_prompt"], 2);
    assert_eq!(f["block_candidate"], 2);
    // Shutdown does not wait for the hung request.
    tokio::time::timeout(Duration::from_secs(5), sim.shutdown()).await.unwrap();
}

#[tokio::test]
async fn fault_rates_are_applied() {
    let mut config = SimConfig::default();
    config.faults.error_500 = 0.2;
    config.faults.error_503 = 0.2;
    config.seed = 3;
    let sim = start(config).await;
    let c = client();
    let g = format!("{}/v1beta/models/m:generateContent", sim.url());
    let mut ok = 0;
    for i in 0..500 {
        if c.post(&g).json(&gemini_body(&format!("{i}"))).send().await.unwrap().status() == 200 {
            ok += 1;
        }
    }
    assert!((250..=350).contains(&ok), "{ok} of 500 succeeded with 40 % faults");
    let s = sim.stats();
    assert_eq!(s.faults["error_500"] + s.faults["error_503"], 500 - ok);
    assert_eq!(s.unavailable, s.faults["error_503"]);
    sim.shutdown().await;
}

#[tokio::test]
async fn hidden_concurrency_cap_rejects_above_n() {
    let mut config = SimConfig::default();
    config.concurrency.max_in_flight = 2;
    config.latency.fixed_ms = 300.0;
    let sim = start(config).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", sim.url());
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                c.post(url).json(&openai_body(&format!("{i}"))).send().await.unwrap().status().as_u16()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    statuses.sort();
    assert_eq!(statuses, vec![200, 200, 503, 503, 503, 503]);
    let s = sim.stats();
    assert_eq!(s.overloaded, 4);
    assert!(s.peak_in_flight >= 3, "{}", s.peak_in_flight);
    sim.shutdown().await;
}

#[tokio::test]
async fn slow_mode_slows_down_with_load() {
    let mut config = SimConfig::default();
    config.concurrency.max_in_flight = 1;
    config.concurrency.mode = weir_sim::OverloadMode::Slow;
    config.latency.fixed_ms = 100.0;
    let sim = start(config).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", sim.url());
    let t0 = Instant::now();
    c.post(&url).json(&openai_body("a")).send().await.unwrap();
    let alone = t0.elapsed();
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                c.post(url).json(&openai_body(&format!("{i}"))).send().await.unwrap().status().as_u16()
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let loaded = t0.elapsed();
    assert!(loaded > alone * 2, "alone {alone:?}, under load {loaded:?}");
    sim.shutdown().await;
}

#[tokio::test]
async fn streaming_sends_tokens_over_time() {
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 150.0;
    config.latency.per_token_ms = 30.0;
    config.output.min_tokens = 10;
    config.output.max_tokens = 10;
    let sim = start(config).await;
    let c = client();
    // OpenAI SSE with usage.
    let mut body = openai_body("stream me");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let t0 = Instant::now();
    let mut r = c.post(format!("{}/v1/chat/completions", sim.url())).json(&body).send().await.unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        arrivals.push(t0.elapsed());
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let events: Vec<&str> = text.split("\r\n\r\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let usage: Value = serde_json::from_str(events[events.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 10);
    let first = arrivals[0];
    let last = *arrivals.last().unwrap();
    assert!(first >= Duration::from_millis(140), "first token at {first:?}");
    assert!(first < Duration::from_millis(280), "first token at {first:?}");
    assert!(last >= Duration::from_millis(150 + 9 * 30 - 20), "last at {last:?}");

    // Gemini SSE: text pieces add up, the last event has the finish reason and usage.
    let t0 = Instant::now();
    let r = c
        .post(format!("{}/v1beta/models/m:streamGenerateContent?alt=sse", sim.url()))
        .json(&gemini_body("stream me"))
        .send()
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(150 + 9 * 30 - 20));
    let chunks: Vec<Value> = text
        .split("\r\n\r\n")
        .filter(|e| !e.is_empty())
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(chunks.len(), 10);
    assert_eq!(chunks[9]["candidates"][0]["finishReason"], "STOP");
    assert_eq!(chunks[9]["usageMetadata"]["candidatesTokenCount"], 10);
    // Without alt=sse, Gemini streams a JSON array.
    let r = c
        .post(format!("{}/v1beta/models/m:streamGenerateContent", sim.url()))
        .json(&gemini_body("stream me"))
        .send()
        .await
        .unwrap();
    let arr: Value = r.json().await.unwrap();
    assert_eq!(arr.as_array().unwrap().len(), 10);
    assert_eq!(sim.stats().streams, 3);
    sim.shutdown().await;
}

#[tokio::test]
async fn stats_reset() {
    let sim = start(SimConfig::default()).await;
    let c = client();
    c.post(format!("{}/v1/chat/completions", sim.url())).json(&openai_body("a")).send().await.unwrap();
    let s: Value = c.get(format!("{}/stats", sim.url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(s["requests"], 1);
    assert_eq!(s["successes"], 1);
    c.post(format!("{}/stats/reset", sim.url())).send().await.unwrap();
    let s: Value = c.get(format!("{}/stats", sim.url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(s["requests"], 0);
    sim.shutdown().await;
}

/// The Gemini Files API's resumable upload is checked: a start without the protocol header or
/// the declared length, an upload of another length than declared, or one that does not
/// finalize at offset 0, is refused and counted; a proper one makes a file.
#[tokio::test]
async fn gemini_uploads_that_do_not_follow_the_resumable_protocol_are_refused() {
    let sim = start(SimConfig::default()).await;
    let c = client();
    let start = format!("{}/upload/v1beta/files", sim.url());
    let begin = |protocol: Option<&str>, length: Option<&str>| {
        let mut r =
            c.post(&start).header("X-Goog-Upload-Command", "start").json(&json!({"file": {"display_name": "x"}}));
        if let Some(p) = protocol {
            r = r.header("X-Goog-Upload-Protocol", p);
        }
        if let Some(n) = length {
            r = r.header("X-Goog-Upload-Header-Content-Length", n);
        }
        r.send()
    };
    assert_eq!(begin(None, Some("5")).await.unwrap().status(), 400);
    assert_eq!(begin(Some("resumable"), None).await.unwrap().status(), 400);
    let ok = begin(Some("resumable"), Some("5")).await.unwrap();
    assert_eq!(ok.status(), 200);
    let session = ok.headers()["x-goog-upload-url"].to_str().unwrap().to_string();
    let send = |command: &str, offset: &str, body: &'static str| {
        c.post(&session)
            .header("X-Goog-Upload-Command", command)
            .header("X-Goog-Upload-Offset", offset)
            .body(body)
            .send()
    };
    assert_eq!(send("upload, finalize", "0", "toolong").await.unwrap().status(), 400);
    assert_eq!(send("upload", "0", "hello").await.unwrap().status(), 400);
    assert_eq!(send("upload, finalize", "3", "hello").await.unwrap().status(), 400);
    let done = send("upload, finalize", "0", "hello").await.unwrap();
    assert_eq!(done.status(), 200);
    let file: Value = done.json().await.unwrap();
    let name = file["file"]["name"].as_str().unwrap().to_string();
    let bytes = c.get(format!("{}/v1beta/{name}:download?alt=media", sim.url())).send().await.unwrap();
    assert_eq!(bytes.text().await.unwrap(), "hello");
    let s = sim.stats();
    assert_eq!((s.gemini_files_uploaded, s.gemini_upload_refusals), (1, 5));
}
