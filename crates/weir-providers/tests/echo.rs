//! A server that repeats the request's key in a successful answer (a gateway that echoes
//! headers, an echo model behind a proxy): the key is masked in the answer, streamed or whole,
//! as it is in error messages. An outside tester found it in result rows and the cache.

use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use weir_core::{Delta, GenParams, ModelHandler, ModelRequest};
use weir_providers::{OpenAiHandler, Secret};

const KEY: &str = "SECRET-abc123XYZ";

/// Serves every connection one answer that holds the `Authorization` header it was sent:
/// a chat completion, or the same as server-sent events when the request asked to stream.
async fn echo_server() -> reqwest::Url {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                // The head and the whole body (the test's bodies are small and sent at once).
                while !String::from_utf8_lossy(&got).contains("\"messages\"") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&got).to_string();
                let auth = text
                    .lines()
                    .find_map(|l| l.strip_prefix("authorization: ").or_else(|| l.strip_prefix("Authorization: ")))
                    .unwrap_or("none")
                    .trim()
                    .to_string();
                let said = format!("you sent {auth}");
                let (kind, body) = if text.contains("\"stream\":true") {
                    // The key split between two events when the prompt asks for it.
                    let cut = if text.contains("split") { said.len() - 6 } else { said.len() };
                    let piece = |t: &str| serde_json::json!({"choices": [{"index": 0, "delta": {"content": t}}]});
                    let (a, b) = (piece(&said[..cut]), piece(&said[cut..]));
                    let end = serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
                    ("text/event-stream", format!("data: {a}\n\ndata: {b}\n\ndata: {end}\n\ndata: [DONE]\n\n"))
                } else {
                    let whole = serde_json::json!({"choices": [{"index": 0, "message": {"role": "assistant",
                        "content": said}, "finish_reason": "stop"}], "model": "m"});
                    ("application/json", whole.to_string())
                };
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            });
        }
    });
    reqwest::Url::parse(&format!("http://{addr}/v1")).unwrap()
}

#[tokio::test]
async fn a_key_the_server_repeats_in_its_answer_is_masked() {
    let base = echo_server().await;
    let handler = OpenAiHandler::new(reqwest::Client::new(), &base, "m", Some(Secret::new(KEY.into())));
    let request = ModelRequest {
        prompt: "hello".into(),
        system: None,
        params: Arc::new(GenParams::default()),
        media: Default::default(),
        fields: None,
    };
    let whole = handler.generate(&request).await.unwrap();
    assert_eq!(whole.text, "you sent Bearer ***");
    use futures::StreamExt;
    let mut deltas = handler.generate_stream(&request).await.unwrap();
    let mut streamed = String::new();
    while let Some(d) = deltas.next().await {
        if let Delta::Text(t) = d.unwrap() {
            streamed.push_str(&t);
        }
    }
    assert_eq!(streamed, "you sent Bearer ***");
}

/// A key split between two streamed pieces is not found in either; the answer put together is
/// masked before it becomes the record's result (an outside tester found it whole in the row
/// and the cache).
#[tokio::test]
async fn a_key_split_between_streamed_pieces_is_masked_in_the_result() {
    use weir_core::{Driver, DriverSettings, Outcome, Record, RecordId, RunMetrics, Throttle, ThrottleSettings};
    let base = echo_server().await;
    let handler = Arc::new(OpenAiHandler::new(reqwest::Client::new(), &base, "m", Some(Secret::new(KEY.into()))));
    let throttle = Arc::new(Throttle::new(&ThrottleSettings::default()));
    let driver = Driver::new(handler, throttle, DriverSettings::default(), Arc::new(RunMetrics::default()));
    let record = Record::new(RecordId::Text("1".into()), 1, "split".into(), Default::default());
    let mut pieces = Vec::new();
    let outcome = driver
        .run_streamed(record, |e| {
            pieces.push(format!("{e:?}"));
            std::future::ready(())
        })
        .await;
    let Outcome::Success(s) = outcome else { panic!("{outcome:?}") };
    assert_eq!(s.response.text, "you sent Bearer ***");
    assert!(pieces.len() >= 2, "{pieces:?}");
}
