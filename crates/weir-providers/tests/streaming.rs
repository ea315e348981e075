//! Streamed calls through the real HTTP providers against `weir sim`: OpenAI's and Gemini's SSE
//! framings, time to first token, and a stream cut part-way retried from the start.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use weir_core::{
    ErrorKind, Executor, GenParams, ModelHandler, ModelRequest, RetryPolicy, RunMetrics, StreamEvent, Throttle,
    ThrottleSettings, Weight,
};
use weir_providers::{GeminiHandler, OpenAiHandler, Secret};
use weir_sim::{SimConfig, SimServer};

fn request(prompt: &str) -> ModelRequest {
    ModelRequest {
        prompt: prompt.into(),
        system: None,
        params: Arc::new(GenParams::default()),
        media: Default::default(),
        fields: None,
    }
}

fn executor() -> Executor {
    let throttle = Arc::new(Throttle::new(&ThrottleSettings::default()));
    let policy = RetryPolicy { max_retries: 8, base: Duration::from_millis(10), ..RetryPolicy::default() };
    Executor::new(throttle, policy, Duration::from_secs(30), Arc::new(RunMetrics::default()))
}

async fn sim(config: SimConfig) -> (SimServer, reqwest::Url) {
    let sim = SimServer::start(config, ([127, 0, 0, 1], 0).into()).await.unwrap();
    let url = reqwest::Url::parse(&sim.url()).unwrap();
    (sim, url)
}

fn handlers(base: &reqwest::Url) -> Vec<Arc<dyn ModelHandler>> {
    let client = reqwest::Client::new();
    let openai = base.join("v1").unwrap();
    vec![
        Arc::new(OpenAiHandler::new(client.clone(), &openai, "sim-1", None)),
        Arc::new(GeminiHandler::new(client, base, "sim-1", Some(Secret::new("k".into())), "gemini/sim-1".into())),
    ]
}

/// What a consumer of the events saw.
#[derive(Default, Debug)]
struct Seen {
    events: Vec<String>,
    restarts: usize,
    first_text: Option<Instant>,
}

impl Seen {
    /// Takes one event: text is kept (and the first one's time), a restart drops what was kept.
    fn on(&mut self, e: StreamEvent) -> std::future::Ready<()> {
        match e {
            StreamEvent::Text(t) => {
                self.first_text.get_or_insert_with(Instant::now);
                self.events.push(t);
            }
            StreamEvent::Restart => {
                self.restarts += 1;
                self.events.clear();
            }
        }
        std::future::ready(())
    }

    /// The text since the last restart.
    fn text(&self) -> String {
        self.events.concat()
    }
}

#[tokio::test]
async fn both_framings_stream_text_in_order_and_it_equals_the_whole_answer() {
    let mut config = SimConfig::default();
    config.latency.fixed_ms = 150.0;
    config.latency.per_token_ms = 10.0;
    config.output.min_tokens = 20;
    config.output.max_tokens = 20;
    let (server, base) = sim(config).await;
    let ex = executor();
    let cancel = CancellationToken::new();
    for handler in handlers(&base) {
        let req = request("tell me about rivers");
        let whole = handler.generate(&req).await.unwrap();
        let seen = Mutex::new(Seen::default());
        let sent = Instant::now();
        let done = ex
            .run_stream(Weight::default(), &cancel, || handler.generate_stream(&req), |e| seen.lock().unwrap().on(e))
            .await
            .unwrap();
        let total = sent.elapsed();
        let seen = seen.into_inner().unwrap();
        let id = handler.model_id();
        assert!(seen.events.len() >= 10, "{id}: {} events", seen.events.len());
        assert_eq!(seen.text(), whole.text, "{id}: the deltas make the whole answer");
        assert_eq!(done.value.text, whole.text, "{id}");
        assert_eq!(done.value.usage, whole.usage, "{id}: usage arrives at the end");
        assert_eq!(done.value.finish_reason, whole.finish_reason, "{id}");
        assert_eq!(seen.restarts, 0);
        // The first token comes after the server's fixed latency, well before the whole answer
        // (20 tokens × 10 ms after it).
        let ttft = seen.first_text.unwrap() - sent;
        assert!(ttft >= Duration::from_millis(150), "{id}: first text after {ttft:?}");
        assert!(total - ttft >= Duration::from_millis(150), "{id}: first text {ttft:?}, whole answer {total:?}");
    }
    assert_eq!(server.stats().streams, 2);
    server.shutdown().await;
}

#[tokio::test]
async fn a_stream_cut_part_way_is_retried_from_the_start_with_a_restart() {
    let mut config = SimConfig::default();
    config.faults.truncate = 0.5;
    config.output.min_tokens = 12;
    config.output.max_tokens = 30;
    let (server, base) = sim(config).await;
    let ex = executor();
    let cancel = CancellationToken::new();
    let mut restarts = 0;
    for handler in handlers(&base) {
        for i in 0..20 {
            let req = request(&format!("prompt {i}"));
            let whole = handler.generate(&req).await.unwrap();
            let seen = Mutex::new(Seen::default());
            let done = ex
                .run_stream(
                    Weight::default(),
                    &cancel,
                    || handler.generate_stream(&req),
                    |e| seen.lock().unwrap().on(e),
                )
                .await
                .unwrap();
            let seen = seen.into_inner().unwrap();
            assert_eq!(seen.text(), whole.text, "after restarts the consumer holds the answer once");
            assert_eq!(done.value.text, whole.text);
            restarts += seen.restarts;
        }
    }
    let streams = server.stats().streams as usize;
    let calls = ex.metrics().calls.load(std::sync::atomic::Ordering::Relaxed) as usize;
    assert_eq!(streams, calls, "every call the executor made reached the server as a stream");
    assert!(restarts > 5, "half the streams were cut: {restarts} restarts");
    // A stream cut before any text is retried without a restart (the consumer holds nothing).
    assert!(calls >= 40 + restarts, "{calls} calls, {restarts} restarts");
    server.shutdown().await;
}

#[tokio::test]
async fn a_refused_stream_is_classified_before_any_text() {
    let config = SimConfig { api_keys: vec!["right".into()], ..SimConfig::default() };
    let (server, base) = sim(config).await;
    for handler in handlers(&base) {
        let e = match handler.generate_stream(&request("x")).await {
            Ok(_) => panic!("{}: a wrong key was accepted", handler.model_id()),
            Err(e) => e,
        };
        assert_eq!(e.kind, ErrorKind::Auth, "{}: {e}", handler.model_id());
    }
    server.shutdown().await;
}
