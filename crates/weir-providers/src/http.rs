//! What every HTTP provider shares: the client, URL rules, secrets, and the classification of
//! transport failures and HTTP statuses into [`ModelError`]s.

use reqwest::header::HeaderMap;
use std::time::Duration;
use weir_core::{Delta, DeltaStream, ErrorKind, ModelError, RetryHint};

use crate::ProviderError;

/// What percent-encoding leaves as it is: RFC 3986's unreserved characters (letters, digits,
/// `-._~`); everything else is escaped, so an encoded value adds no path segment, query or
/// fragment to a URL.
pub(crate) const UNRESERVED: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

pub use weir_core::secret::{mask, mask_value, masked_body, Secret};

/// How a provider's requests are authorised.
#[derive(Debug, Clone)]
pub enum Credential {
    /// None (a local server).
    None,
    /// A fixed key: in the named header, or as `Authorization: Bearer` when there is none.
    Key(Secret, Option<&'static str>),
    /// Access tokens, as `Authorization: Bearer` (Google's for Vertex AI), renewed as they
    /// expire.
    Tokens(std::sync::Arc<dyn AccessTokens>),
}

/// Where short-lived access tokens come from (`google_auth::TokenSource`). A trait here, so
/// that sending requests does not depend on how tokens are made.
#[async_trait::async_trait]
pub trait AccessTokens: Send + Sync + std::fmt::Debug {
    /// A token to send now (cached until near its expiry).
    async fn token(&self) -> Result<Secret, ModelError>;
    /// Forgets `rejected`, which the server refused (expired or revoked), so that the next
    /// [`AccessTokens::token`] fetches a fresh one.
    async fn reject(&self, rejected: &Secret);
}

impl Credential {
    /// The key, when the credential is a fixed key (what a quota per key is counted against).
    pub fn quota_id(&self) -> Option<&str> {
        match self {
            Credential::Key(k, _) => Some(k.expose()),
            _ => None,
        }
    }

    /// The credential to send now (an access token is fetched or taken from the cache).
    async fn secret(&self) -> Result<Option<Secret>, ModelError> {
        match self {
            Credential::None => Ok(None),
            Credential::Key(k, _) => Ok(Some(k.clone())),
            Credential::Tokens(t) => t.token().await.map(Some),
        }
    }

    fn auth<'a>(&self, secret: Option<&'a Secret>) -> Auth<'a> {
        match (self, secret) {
            (Credential::Key(_, Some(header)), Some(k)) => Auth::Header(header, k),
            (_, Some(k)) => Auth::Bearer(k),
            (_, None) => Auth::None,
        }
    }

    /// After a 401: true when the rejected access token was dropped and one more try with a
    /// fresh one is worth it (an expired or revoked token); a key is simply wrong.
    async fn renew(&self, status: u16, secret: Option<&Secret>, tried: bool) -> bool {
        match (self, secret) {
            (Credential::Tokens(t), Some(s)) if status == 401 && !tried => {
                t.reject(s).await;
                true
            }
            _ => false,
        }
    }

    /// POSTs `body` with this credential and reads the whole answer; a 401 with an access token
    /// is tried once more with a fresh token. Returns the answer and the secret it was sent
    /// with (to redact from an error message).
    pub async fn post(
        &self,
        client: &reqwest::Client,
        url: &str,
        body: &serde_json::Value,
    ) -> Result<(Reply, Option<Secret>), ModelError> {
        self.post_encoded(client, url, encode(body, &[])?).await
    }

    /// As [`post`](Self::post), with the body already written ([`encode`]).
    pub async fn post_encoded(
        &self,
        client: &reqwest::Client,
        url: &str,
        body: bytes::Bytes,
    ) -> Result<(Reply, Option<Secret>), ModelError> {
        let mut tried = false;
        loop {
            let secret = self.secret().await?;
            let mut reply = post_json(client, url, body.clone(), self.auth(secret.as_ref())).await?;
            if reply.status == 200 || !self.renew(reply.status, secret.as_ref(), tried).await {
                reply.mask(secret.as_ref());
                return Ok((reply, secret));
            }
            tried = true;
        }
    }

    /// `req` carrying `secret` the way this credential is sent.
    fn authorised(&self, req: reqwest::RequestBuilder, secret: Option<&Secret>) -> reqwest::RequestBuilder {
        match self.auth(secret) {
            Auth::None => req,
            Auth::Bearer(key) => req.bearer_auth(key.expose()),
            Auth::Header(name, key) => req.header(name, key.expose()),
        }
    }

    /// Sends the request `build` makes (any method, any body) with this credential and reads
    /// the whole answer, as [`post`](Self::post) does; for the batch-job APIs' files and jobs.
    pub async fn send(
        &self,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<(Reply, Option<Secret>), ModelError> {
        let mut tried = false;
        loop {
            let secret = self.secret().await?;
            let req = self.authorised(build(), secret.as_ref());
            let mut reply = read_reply(req.send().await.map_err(|e| transport_error(&e))?).await?;
            if reply.status == 200 || !self.renew(reply.status, secret.as_ref(), tried).await {
                reply.mask(secret.as_ref());
                return Ok((reply, secret));
            }
            tried = true;
        }
    }

    /// As [`send`](Self::send), with a 200 answer's body handed to `each_line` line by line as
    /// it arrives (without its `\n`), not gathered: a batch job's results file may be hundreds
    /// of megabytes. Any other answer is read whole and returned, for the caller to classify.
    pub async fn send_lines(
        &self,
        build: impl Fn() -> reqwest::RequestBuilder,
        each_line: &mut (dyn FnMut(&[u8]) + Send),
    ) -> Result<Option<(Reply, Option<Secret>)>, ModelError> {
        let mut tried = false;
        loop {
            let secret = self.secret().await?;
            let req = self.authorised(build(), secret.as_ref());
            let resp = req.send().await.map_err(|e| transport_error(&e))?;
            if resp.status().as_u16() == 200 {
                use futures::StreamExt;
                let mut body = resp.bytes_stream();
                let mut lines = weir_core::LineSplitter::default();
                let each_line = &mut |line: &[u8]| each_line(&masked_body(line, secret.as_ref()));
                while let Some(chunk) = body.next().await {
                    lines.push(&chunk.map_err(|e| transport_error(&e))?, each_line);
                }
                lines.finish(each_line);
                return Ok(None);
            }
            let reply = read_reply(resp).await?;
            if !self.renew(reply.status, secret.as_ref(), tried).await {
                return Ok(Some((reply, secret)));
            }
            tried = true;
        }
    }

    /// As [`post`](Self::post), asking for a streamed answer.
    pub async fn post_sse(
        &self,
        client: &reqwest::Client,
        url: &str,
        body: bytes::Bytes,
    ) -> Result<(Opened, Option<Secret>), ModelError> {
        let mut tried = false;
        loop {
            let secret = self.secret().await?;
            match post_sse(client, url, body.clone(), self.auth(secret.as_ref())).await? {
                Opened::Error(reply) if self.renew(reply.status, secret.as_ref(), tried).await => tried = true,
                Opened::Events(events) => {
                    use futures::StreamExt;
                    // Each event masked alone (an echo split between two events is not
                    // found: no server splits a header it repeats).
                    let shown = secret.clone();
                    let events = events.map(move |e| {
                        e.map(|data| match &shown {
                            Some(s) => s.masked_in(&data),
                            None => data,
                        })
                    });
                    return Ok((Opened::Events(Box::pin(events)), secret));
                }
                opened => return Ok((opened, secret)),
            }
        }
    }
}

/// One result per item of a batched call that sent `sent` items and got `got` back in order.
/// Items the answer left out fail alone with a retryable error (so they are sent again, never
/// dropped); more answers than items cannot be matched to them and fail the call.
pub fn one_per_item(mut got: Vec<Result<weir_core::ModelResponse, ModelError>>, sent: usize) -> weir_core::BatchAnswer {
    let answered = got.len();
    if answered > sent {
        return Err(ModelError::new(
            ErrorKind::MalformedResponse,
            format!("{answered} answers for {sent} items cannot be matched to them"),
        ));
    }
    got.extend((answered..sent).map(|i| {
        Err(ModelError::new(
            ErrorKind::MalformedResponse,
            format!("the endpoint answered {answered} items of {sent}; item {} had no answer", i + 1),
        ))
    }));
    Ok(got)
}

/// The HTTP client of a run: one connection pool shared by every call.
pub fn client() -> Result<reqwest::Client, ProviderError> {
    client_with(HeaderMap::new())
}

/// How long a batch-job API call may go without receiving a byte before it fails and is tried
/// again: a server that takes the connection and never answers held a run waiting on its jobs
/// for ever (found by an outside tester). Long enough for an upload of a job's input to finish
/// before the answer is read; downloads of large results go on while bytes arrive.
pub const JOB_READ_TIMEOUT: Duration = Duration::from_secs(600);

/// The client of batch-job APIs: [`client_with`], with [`JOB_READ_TIMEOUT`]. (Model calls have
/// `--timeout`, applied by the executor around each call.)
pub fn job_client_with(headers: HeaderMap) -> Result<reqwest::Client, ProviderError> {
    builder(headers)
        .redirect(reqwest::redirect::Policy::custom(same_origin))
        .read_timeout(JOB_READ_TIMEOUT)
        .build()
        .map_err(|e| ProviderError::Config(format!("cannot build the HTTP client: {e}")))
}

/// As [`client`], sending `headers` with every request (an API's version header).
pub fn client_with(headers: HeaderMap) -> Result<reqwest::Client, ProviderError> {
    builder(headers).build().map_err(|e| ProviderError::Config(format!("cannot build the HTTP client: {e}")))
}

/// A job API's redirect is followed only to the same scheme, host and port (at most 10): an
/// API key travels in a header of its own (`x-goog-api-key`, `x-api-key`), which reqwest, unlike
/// `Authorization`, would carry to whatever host a redirect names. Another origin's redirect is
/// the 3xx answer itself, an error that names where it pointed.
fn same_origin(attempt: reqwest::redirect::Attempt<'_>) -> reqwest::redirect::Action {
    let first = attempt
        .previous()
        .first()
        .map(|u| (u.scheme().to_string(), u.host_str().map(str::to_string), u.port_or_known_default()));
    let next = attempt.url();
    let same = first.is_some_and(|(scheme, host, port)| {
        scheme == next.scheme() && host.as_deref() == next.host_str() && port == next.port_or_known_default()
    });
    if same && attempt.previous().len() <= 10 {
        attempt.follow()
    } else {
        attempt.stop()
    }
}

/// The settings every client of weir's has: `headers` on every request, a connection within
/// 10 s, idle connections kept a minute, and no redirects followed. A model call's redirect is
/// an error (see [`status_error`]): following one would carry a key in a custom header to another
/// host, and a 301/302 turns the POST into a GET without its body, whose answer would be taken
/// for the record's.
fn builder(headers: HeaderMap) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .default_headers(headers)
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(60))
        .tcp_nodelay(true)
        .user_agent(concat!("weir/", env!("CARGO_PKG_VERSION")))
}

/// A provider's names for the sampling parameters, which every provider takes with the same
/// meaning and only names differently.
#[derive(Debug, Clone, Copy)]
pub struct SamplingNames {
    /// Sampling temperature.
    pub temperature: &'static str,
    /// Nucleus sampling mass.
    pub top_p: &'static str,
    /// Top-k sampling.
    pub top_k: &'static str,
    /// Most output tokens.
    pub max_output_tokens: &'static str,
    /// Sampling seed.
    pub seed: &'static str,
    /// Stop sequences.
    pub stop: &'static str,
    /// Presence penalty.
    pub presence_penalty: &'static str,
    /// Frequency penalty.
    pub frequency_penalty: &'static str,
}

/// Puts the sampling parameters that are set into `out`, under the provider's `names`. (The
/// answer's format is shaped differently by each provider and is mapped by each.)
pub fn put_sampling(
    out: &mut serde_json::Map<String, serde_json::Value>,
    p: &weir_core::GenParams,
    names: &SamplingNames,
) {
    use serde_json::json;
    let mut put = |k: &str, v: serde_json::Value| {
        out.insert(k.to_string(), v);
    };
    if let Some(t) = p.temperature {
        put(names.temperature, json!(t));
    }
    if let Some(t) = p.top_p {
        put(names.top_p, json!(t));
    }
    if let Some(k) = p.top_k {
        put(names.top_k, json!(k));
    }
    if let Some(m) = p.max_output_tokens {
        put(names.max_output_tokens, json!(m));
    }
    if let Some(s) = p.seed {
        put(names.seed, json!(s));
    }
    if !p.stop.is_empty() {
        put(names.stop, json!(p.stop));
    }
    if let Some(x) = p.presence_penalty {
        put(names.presence_penalty, json!(x));
    }
    if let Some(x) = p.frequency_penalty {
        put(names.frequency_penalty, json!(x));
    }
}

/// True when the URL's host is a loopback address or `localhost`.
pub fn is_loopback(url: &reqwest::Url) -> bool {
    match url.host() {
        Some(url::Host::Domain(d)) => d == "localhost",
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    }
}

/// Checks a base URL: it must parse, and plain `http` is only allowed to loopback hosts, so
/// prompts and keys never cross a network unencrypted.
pub fn check_base_url(raw: &str) -> Result<reqwest::Url, ProviderError> {
    // A user and password (`https://u:pw@host`) are never echoed either, in any message.
    let url = &without_userinfo(raw);
    // A query may carry a key (`?key=…`): never echo it, never keep it, never send it.
    if url.contains('?') || url.contains('#') {
        let shown = url.split(['?', '#']).next().unwrap_or_default();
        return Err(ProviderError::Config(format!(
            "--base-url {shown}?…: must not have a query or fragment (keys go in GEMINI_API_KEY, OPENAI_API_KEY, …); give the API root only"
        )));
    }
    if url.as_str() != raw {
        return Err(ProviderError::Config(format!(
            "--base-url {url}: must not contain credentials; use the API key variables"
        )));
    }
    let parsed =
        reqwest::Url::parse(url).map_err(|e| ProviderError::Config(format!("--base-url {url}: not a URL ({e})")))?;
    match parsed.scheme() {
        "https" => {}
        "http" => {
            if !is_loopback(&parsed) {
                return Err(ProviderError::Config(format!(
                    "--base-url {url}: plain http is only allowed to loopback (127.0.0.1, ::1, localhost); use https"
                )));
            }
        }
        other => return Err(ProviderError::Config(format!("--base-url {url}: scheme '{other}' is not http or https"))),
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(ProviderError::Config("--base-url must not contain credentials; use the API key variables".into()));
    }
    Ok(parsed)
}

/// `url` with whatever comes before an `@` (a user and password: `https://***@host/v1`) shown
/// as `***`: what a message may echo of a base URL given with credentials in it, however
/// malformed (`u:pw@host` with no scheme, `//u:pw@host`, `http//u:pw@host`). An `@` in a
/// path is hidden too: a message loses a little, never a secret.
fn without_userinfo(url: &str) -> String {
    let end = url.find(['?', '#']).unwrap_or(url.len());
    let start = url[..end].find("://").map_or(0, |i| i + 3);
    match url[start..end].rfind('@') {
        Some(at) => format!("{}***{}", &url[..start], &url[start + at..]),
        None => url.to_string(),
    }
}

/// A base URL as messages may show it: no user or password (see [`check_base_url`]) and no
/// query or fragment (`?…`), which may carry a key.
pub fn shown_url(url: &str) -> String {
    let url = without_userinfo(url);
    match url.find(['?', '#']) {
        Some(i) => format!("{}?…", &url[..i]),
        None => url,
    }
}

/// How a request carries its credential.
#[derive(Debug, Clone, Copy)]
pub enum Auth<'a> {
    /// No credential.
    None,
    /// `Authorization: Bearer …` (OpenAI, Vertex AI).
    Bearer(&'a Secret),
    /// A named header (`x-goog-api-key` for the Gemini API).
    Header(&'static str, &'a Secret),
}

/// An answer of any status, read whole.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Response headers.
    pub headers: HeaderMap,
    /// Response body.
    pub body: bytes::Bytes,
}

impl Reply {
    /// Masks `secret` in the body wherever the server echoed it ([`masked_body`]).
    fn mask(&mut self, secret: Option<&Secret>) {
        if let std::borrow::Cow::Owned(masked) = masked_body(&self.body, secret) {
            self.body = masked.into();
        }
    }
}

/// About how many bytes `v` takes as JSON (its strings' lengths and a little per value).
fn size_hint(v: &serde_json::Value) -> usize {
    use serde_json::Value;
    match v {
        Value::String(s) => s.len() + 8,
        Value::Array(a) => 2 + a.iter().map(size_hint).sum::<usize>(),
        Value::Object(m) => 2 + m.iter().map(|(k, v)| k.len() + 4 + size_hint(v)).sum::<usize>(),
        _ => 24,
    }
}

/// Where a request body holds inline part `i`'s base64 until [`encode`] writes it: a mark no
/// text can hold by chance (a random token of this process), so a prompt that quotes it is
/// left alone.
pub fn inline_mark(i: usize) -> String {
    static TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let token = TOKEN.get_or_init(|| {
        let mut random = [0u8; 12];
        // An error of the system's random source leaves zeros: still no text a user writes.
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random);
        random.iter().map(|b| format!("{b:02x}")).collect()
    });
    format!("@weir-inline-{token}-{i}@")
}

/// `body` as JSON bytes, with part `i`'s bytes written as base64 where [`inline_mark`]`(i)`
/// stands. The base64 goes straight into the body: not built as a string, copied into the
/// JSON tree and scanned for characters to escape (it has none), which for a body of images
/// cost more than the rest of the call (seen in a profile).
pub fn encode(body: &serde_json::Value, parts: &[weir_core::media::Part]) -> Result<bytes::Bytes, ModelError> {
    use base64::Engine;
    let bad = |e: String| ModelError::new(ErrorKind::InvalidInput, e);
    let mut json = Vec::with_capacity(size_hint(body));
    serde_json::to_writer(&mut json, body).map_err(|e| bad(e.to_string()))?;
    let inline: Vec<&weir_core::media::Part> = parts.iter().filter(|p| p.uri.is_none()).collect();
    if inline.is_empty() {
        return Ok(json.into());
    }
    let engine = &base64::engine::general_purpose::STANDARD;
    let extra: usize = inline.iter().map(|p| base64::encoded_len(p.data.len(), true).unwrap_or(0)).sum();
    let mut out = Vec::with_capacity(json.len() + extra);
    let mut rest = &json[..];
    for (i, p) in inline.iter().enumerate() {
        let mark = inline_mark(i);
        let at = memchr::memmem::find(rest, mark.as_bytes())
            .ok_or_else(|| bad(format!("inline part {i} has no place in the body")))?;
        out.extend_from_slice(&rest[..at]);
        let start = out.len();
        out.resize(start + base64::encoded_len(p.data.len(), true).unwrap_or(0), 0);
        let n = engine.encode_slice(&p.data, &mut out[start..]).map_err(|e| bad(e.to_string()))?;
        out.truncate(start + n);
        rest = &rest[at + mark.len()..];
    }
    out.extend_from_slice(rest);
    Ok(out.into())
}

/// A JSON POST carrying its credential.
fn post(
    client: &reqwest::Client,
    url: &str,
    body: bytes::Bytes,
    auth: Auth<'_>,
) -> Result<reqwest::RequestBuilder, ModelError> {
    let req = client.post(url).header(reqwest::header::CONTENT_TYPE, "application/json").body(body);
    Ok(match auth {
        Auth::None => req,
        Auth::Bearer(key) => req.bearer_auth(key.expose()),
        Auth::Header(name, key) => req.header(name, key.expose()),
    })
}

/// POSTs a JSON body and reads the whole answer; only a failure to get an answer is an error
/// here (each provider classifies error statuses from their bodies).
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    body: bytes::Bytes,
    auth: Auth<'_>,
) -> Result<Reply, ModelError> {
    let resp = post(client, url, body, auth)?.send().await.map_err(|e| transport_error(&e))?;
    read_answer(resp).await
}

/// The most of one model call's answer weir reads: far above any record's answer, and a bound
/// on the memory a server answering without end (or a wrong endpoint serving a file) can take.
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

/// Reads one model call's answer whole, up to [`MAX_ANSWER_BYTES`]; a longer one is the
/// record's error (sent again, it would be as long).
pub async fn read_answer(mut resp: reqwest::Response) -> Result<Reply, ModelError> {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let too_long = || {
        // The answer's fault, not the request's: a malformed response, not tried again.
        ModelError::new(
            ErrorKind::MalformedResponse,
            format!(
                "HTTP {status}: the answer is longer than {} MiB, the most weir reads of one",
                MAX_ANSWER_BYTES >> 20
            ),
        )
        .with_status(status)
        .with_hint(RetryHint::Never)
    };
    if resp.content_length().is_some_and(|n| n > MAX_ANSWER_BYTES as u64) {
        return Err(too_long());
    }
    let mut body = bytes::BytesMut::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| transport_error(&e))? {
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err(too_long());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Reply { status, headers, body: body.freeze() })
}

/// Reads an answer whole (a batch-job API's: a job's inline results may be large).
async fn read_reply(resp: reqwest::Response) -> Result<Reply, ModelError> {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.bytes().await.map_err(|e| transport_error(&e))?;
    Ok(Reply { status, headers, body })
}

/// Server-sent events, each event's `data` as it arrives.
pub type Events = futures::stream::BoxStream<'static, Result<String, ModelError>>;

/// What a streamed POST got: the event stream of a 200 answer, or any other answer read whole.
pub enum Opened {
    /// A 200 answer's events.
    Events(Events),
    /// An error answer, to be classified by the provider.
    Error(Reply),
}

/// POSTs a JSON body that asks for a streamed answer, and opens its server-sent events.
pub async fn post_sse(
    client: &reqwest::Client,
    url: &str,
    body: bytes::Bytes,
    auth: Auth<'_>,
) -> Result<Opened, ModelError> {
    use eventsource_stream::{EventStreamError, Eventsource};
    use futures::StreamExt;
    let req = post(client, url, body, auth)?.header(reqwest::header::ACCEPT, "text/event-stream");
    let resp = req.send().await.map_err(|e| transport_error(&e))?;
    if resp.status().as_u16() != 200 {
        return Ok(Opened::Error(read_reply(resp).await?));
    }
    let events = resp.bytes_stream().eventsource().map(|e| match e {
        Ok(event) => Ok(event.data),
        // reqwest calls a body that stops part-way a decoding error; for a stream it is a cut
        // connection, and retried as one.
        Err(EventStreamError::Transport(e)) => {
            let mut error = transport_error(&e);
            if error.kind == ErrorKind::MalformedResponse {
                error = ModelError::new(ErrorKind::Transport, format!("the stream was cut: {}", error.message));
            }
            Err(error)
        }
        Err(e) => Err(ModelError::new(ErrorKind::MalformedResponse, format!("a bad event in the stream: {e}"))),
    });
    Ok(Opened::Events(Box::pin(events)))
}

/// A provider's reading of its streamed events.
pub trait StreamParser: Send + 'static {
    /// Reads one event's data: a delta to pass on, or nothing (bookkeeping only).
    fn event(&mut self, data: &str) -> Result<Option<Delta>, ModelError>;
    /// The events ended without an explicit end: the end, if the answer was complete.
    fn finish(&mut self) -> Result<Delta, ModelError>;
}

/// The answer cut before its end.
pub fn cut_stream() -> ModelError {
    ModelError::new(ErrorKind::Transport, "the streamed answer was cut before its end")
}

/// Turns server-sent events into deltas with `parser`; the stream ends after an end delta or
/// the first error.
pub fn deltas<P: StreamParser>(events: Events, parser: P) -> DeltaStream {
    use futures::StreamExt;
    let state = Some((events, parser));
    Box::pin(futures::stream::unfold(state, |state| async move {
        let (mut events, mut parser) = state?;
        loop {
            let item = match events.next().await {
                None => parser.finish(),
                Some(Err(e)) => Err(e),
                Some(Ok(data)) => match parser.event(&data) {
                    Ok(None) => continue,
                    Ok(Some(delta)) => Ok(delta),
                    Err(e) => Err(e),
                },
            };
            let more = matches!(item, Ok(Delta::Text(_)));
            return Some((item, more.then_some((events, parser))));
        }
    }))
}

/// Classifies a failure to get a response at all.
pub fn transport_error(e: &reqwest::Error) -> ModelError {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.is_decode() {
        ErrorKind::MalformedResponse
    } else {
        ErrorKind::Transport
    };
    // reqwest's messages name the URL, which never carries a key here.
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    let error = ModelError::new(kind, msg);
    if e.is_connect() {
        error.with_unreachable()
    } else {
        error
    }
}

/// Parses `retry-after-ms`, then `retry-after` (seconds or an HTTP date).
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    if let Some(ms) =
        headers.get("retry-after-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<f64>().ok())
    {
        if ms.is_finite() && ms >= 0.0 {
            return Some(Duration::from_secs_f64(ms / 1000.0));
        }
    }
    let v = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(std::time::SystemTime::now()).unwrap_or_default())
}

/// Parses a `google.protobuf.Duration` in JSON form, such as `"26s"` or `"1.500s"`.
pub fn proto_duration(s: &str) -> Option<Duration> {
    let secs: f64 = s.strip_suffix('s')?.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs))
}

/// Classifies an HTTP error status; providers refine the result from the body.
pub fn status_error(status: u16, headers: &HeaderMap, message: String) -> ModelError {
    // An answer with an empty body leaves `HTTP 301: ` with nothing after it.
    let message = match message.trim_end().trim_end_matches(':') {
        m if m.len() < message.len() && !m.is_empty() => m.to_string(),
        _ => message,
    };
    let advised = retry_after(headers);
    let e = match status {
        // No such model or route: no other record can fare better.
        404 | 405 => ModelError::new(
            ErrorKind::Endpoint,
            format!(
                "{message} (the model or its route was not found: check --model, --base-url, --project and --location)"
            ),
        )
        .with_hint(RetryHint::StopRun),
        // weir follows no redirect of a model call (see `builder`): the endpoint moved, and every
        // record would get the same answer.
        300..=399 => ModelError::new(
            ErrorKind::Endpoint,
            format!(
                "{message} (the endpoint redirects{}; weir does not follow redirects, which could carry the key to \
                 another host: write the new address where the endpoint is named)",
                // Only where it points: its path or query may carry a key or a signature.
                headers
                    .get(reqwest::header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .map(|l| match reqwest::Url::parse(l) {
                        Ok(u) => format!(
                            " to {}://{}{}",
                            u.scheme(),
                            u.host_str().unwrap_or(""),
                            u.port().map(|p| format!(":{p}")).unwrap_or_default()
                        ),
                        Err(_) => " to another path of the same host".to_string(),
                    })
                    .unwrap_or_default()
            ),
        )
        .with_hint(RetryHint::StopRun),
        400 | 413 | 422 => ModelError::new(ErrorKind::BadRequest, message),
        401 | 403 => ModelError::new(ErrorKind::Auth, message),
        408 => ModelError::new(ErrorKind::Timeout, message),
        429 => ModelError::new(ErrorKind::RateLimited, message).with_hint(RetryHint::Later(advised)),
        503 => ModelError::new(ErrorKind::Server, message).with_hint(RetryHint::Later(advised)),
        500..=599 => ModelError::new(ErrorKind::Server, message),
        409 | 425 => ModelError::new(ErrorKind::Server, message),
        _ => ModelError::new(ErrorKind::BadRequest, message),
    }
    .with_status(status);
    // OpenAI's servers may say explicitly whether to retry.
    match headers.get("x-should-retry").and_then(|v| v.to_str().ok()) {
        Some("false") if e.hint != RetryHint::StopRun => e.with_hint(RetryHint::Never),
        Some("true") if e.hint == RetryHint::Never && e.kind != ErrorKind::Auth => e.with_hint(RetryHint::Backoff),
        _ => e,
    }
}

/// Masks `secret` wherever a server echoed it into an error's message (some proxies and
/// gateways echo the `Authorization` header whole), so it never reaches an errors file or log.
pub fn redact(mut e: ModelError, secret: Option<&Secret>) -> ModelError {
    if let Some(s) = secret {
        e.message = s.masked_in(&e.message);
    }
    e
}

/// Shortens a server's message for an errors file.
pub fn clip(s: &str) -> String {
    const MAX: usize = 600;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// `bytes` in standard base64 (inline media).
pub fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {

    #[test]
    fn inline_parts_are_spliced_in_as_base64() {
        use bytes::Bytes;
        use weir_core::media::Part;
        let parts = [
            Part::new("image/png".into(), Bytes::from_static(b"\x89PNG one")),
            Part::new("image/png".into(), Bytes::from_static(b"two\"quoted")),
        ];
        // A prompt quoting a mark of another process is left alone.
        let body = serde_json::json!({
            "prompt": "@weir-inline-000000000000000000000000-0@",
            "a": inline_mark(0),
            "b": format!("data:image/png;base64,{}", inline_mark(1)),
        });
        let written = encode(&body, &parts).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&written).unwrap();
        assert_eq!(v["a"], base64(b"\x89PNG one"));
        assert_eq!(v["b"], format!("data:image/png;base64,{}", base64(b"two\"quoted")));
        assert_eq!(v["prompt"], "@weir-inline-000000000000000000000000-0@");
        // Without parts, the body as it is.
        assert_eq!(encode(&body, &[]).unwrap(), serde_json::to_vec(&body).unwrap());
    }

    use super::*;
    use reqwest::header::{HeaderValue, RETRY_AFTER};

    #[test]
    fn base_urls_need_tls_off_loopback() {
        assert!(check_base_url("https://api.openai.com/v1").is_ok());
        assert!(check_base_url("http://127.0.0.1:8080/v1").is_ok());
        assert!(check_base_url("http://localhost:8080").is_ok());
        assert!(check_base_url("http://[::1]:8080").is_ok());
        let e = check_base_url("http://10.0.0.5:8000/v1").unwrap_err();
        assert!(e.to_string().contains("use https"), "{e}");
        assert!(check_base_url("ftp://x").is_err());
        assert!(check_base_url("not a url").is_err());
        assert!(check_base_url("https://user:pw@host").is_err());
        let e = check_base_url("http://127.0.0.1:8080/v1?key=SECRET123").unwrap_err().to_string();
        assert!(e.contains("query") && !e.contains("SECRET123"), "{e}");
        // A user and password are never echoed, whatever else is wrong with the URL.
        for url in [
            "http://u:pw-SECRET@127.0.0.1:18006/?key=QSECRET",
            "http://u:pw-SECRET@10.0.0.5/v1",
            "ftp://u:pw-SECRET@host",
            "https://u:pw-SECRET@host/v1",
            "https://pw-SECRET@host",
            "u:pw-SECRET@127.0.0.1:17101",
            "//u:pw-SECRET@127.0.0.1:17101",
            "http//u:pw-SECRET@127.0.0.1:17101",
            "mailto:pw-SECRET@x",
        ] {
            let e = check_base_url(url).unwrap_err().to_string();
            assert!(!e.contains("SECRET") && e.contains("***@"), "{e}");
            assert!(!shown_url(url).contains("SECRET"), "{}", shown_url(url));
        }
    }

    #[test]
    fn retry_after_forms() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(3)));
        h.insert("retry-after-ms", HeaderValue::from_static("1500"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(1500)));
        let mut h = HeaderMap::new();
        let later = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(30));
        h.insert(RETRY_AFTER, HeaderValue::from_str(&later).unwrap());
        let d = retry_after(&h).unwrap();
        assert!(d > Duration::from_secs(28) && d <= Duration::from_secs(30), "{d:?}");
        assert_eq!(proto_duration("26s"), Some(Duration::from_secs(26)));
        assert_eq!(proto_duration("1.500s"), Some(Duration::from_millis(1500)));
        assert_eq!(proto_duration("1.5"), None);
    }

    #[test]
    fn statuses_classify() {
        let h = HeaderMap::new();
        assert_eq!(status_error(400, &h, "x".into()).kind, ErrorKind::BadRequest);
        assert_eq!(status_error(401, &h, "x".into()).kind, ErrorKind::Auth);
        assert_eq!(status_error(429, &h, "x".into()).hint, RetryHint::Later(None));
        assert_eq!(status_error(500, &h, "x".into()).hint, RetryHint::Backoff);
        assert_eq!(status_error(503, &h, "x".into()).kind, ErrorKind::Server);
        let mut h = HeaderMap::new();
        h.insert("x-should-retry", HeaderValue::from_static("false"));
        assert_eq!(status_error(500, &h, "x".into()).hint, RetryHint::Never);
    }

    #[test]
    fn a_key_echoed_by_a_server_is_masked() {
        let key = Secret::new("sk-LEAKCHECK-777".into());
        let e = ModelError::new(ErrorKind::Auth, "HTTP 401: Incorrect API key provided: Bearer sk-LEAKCHECK-777");
        let e = redact(e, Some(&key));
        assert_eq!(e.message, "HTTP 401: Incorrect API key provided: Bearer ***");
    }
}
