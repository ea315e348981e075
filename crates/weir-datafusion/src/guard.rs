//! Who may use a cluster: the holders of its credentials — a certificate its authority signed
//! (mutual TLS, see [`crate::tls`]), its shared token, or both.
//!
//! Ballista 55 has no authentication on its servers, but every one of its clients takes a hook
//! that can rebuild the connection's endpoint. So, with credentials set:
//! - each Ballista server (the scheduler, an executor's task and Flight ports) listens on
//!   127.0.0.1 only, and weir puts a listener on the advertised address and port in front of it
//!   ([`serve`]), which lets a connection through only from a holder of the credentials: with
//!   TLS, the handshake asks for a certificate from the cluster's authority before a byte is
//!   passed on; with a token, every gRPC request must carry the token's proof, checked in
//!   constant time, or is answered `UNAUTHENTICATED` without reaching Ballista;
//! - every Ballista client (`weir sql`, executors calling the scheduler and each other, the
//!   scheduler calling executors) connects with them ([`Credentials::endpoint_override`]).
//!
//! The token's proof rides in the `user-agent` header, the one header every request of a tonic
//! channel carries that the endpoint hook can set. It is a digest of the token, not the token.
//! Processes on the same machine can still reach the plain ports on 127.0.0.1; the threat is
//! the network.

use ballista_core::extension::EndpointOverrideFn;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::tls::ClusterTls;

/// The environment variable that holds a cluster's shared token.
pub const TOKEN_VARIABLE: &str = "WEIR_CLUSTER_TOKEN";

/// The shortest token taken: a token is a password that an attacker on the network may guess
/// at every request.
pub const TOKEN_MIN_CHARS: usize = 16;

/// The `user-agent` product that carries the token's proof.
const AGENT: &str = "weir-cluster";

/// A cluster's shared secret, held as the proof its requests carry.
pub struct Token {
    proof: String,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token, nor its proof (which admits as well as the token does).
        f.debug_struct("Token").finish_non_exhaustive()
    }
}

impl Token {
    /// A token from its text (surrounding white space, such as a file's last newline, is not
    /// part of it); at least [`TOKEN_MIN_CHARS`] characters.
    pub fn new(secret: &str) -> Result<Self, String> {
        use sha2::Digest;
        let secret = secret.trim();
        if secret.chars().count() < TOKEN_MIN_CHARS {
            return Err(format!(
                "the cluster token is too short ({} characters; at least {TOKEN_MIN_CHARS}: make one with weir \
                 cluster token)",
                secret.chars().count()
            ));
        }
        let digest = sha2::Sha256::new().chain_update(b"weir-cluster-token\0").chain_update(secret).finalize();
        Ok(Self { proof: digest.iter().map(|b| format!("{b:02x}")).collect() })
    }

    /// A new random token (32 bytes from the operating system's generator, in hex).
    pub fn generate() -> Result<String, String> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| format!("no random numbers from the system: {e}"))?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The `user-agent` value a client sends.
    fn agent(&self) -> String {
        format!("{AGENT}/{}", self.proof)
    }

    /// The line a connection that is not gRPC opens with (the scheduler's quota service).
    pub(crate) fn proof_line(&self) -> String {
        format!("{}\n", self.agent())
    }

    /// Whether `line` is this token's [`Token::proof_line`], compared in constant time.
    pub(crate) fn proves(&self, line: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        bool::from(line.ct_eq(self.proof_line().as_bytes()))
    }

    /// Whether `headers` carry this token's proof; compared in constant time, so that the time
    /// of a refusal tells nothing about how much of a guess was right.
    fn admits(&self, headers: &hyper::HeaderMap) -> bool {
        use subtle::ConstantTimeEq;
        let Some(agent) = headers.get(hyper::header::USER_AGENT).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let mut admitted = false;
        for product in agent.split_whitespace() {
            if let Some(proof) = product.strip_prefix(AGENT).and_then(|p| p.strip_prefix('/')) {
                admitted |= bool::from(proof.as_bytes().ct_eq(self.proof.as_bytes()));
            }
        }
        admitted
    }
}

/// What this process proves itself with, and asks of others.
#[derive(Debug, Default)]
pub struct Credentials {
    /// Mutual TLS.
    pub tls: Option<Arc<ClusterTls>>,
    /// The shared token.
    pub token: Option<Token>,
}

impl Credentials {
    /// Whether connections are TLS (clients use https, `dfs://`).
    pub fn tls_on(&self) -> bool {
        self.tls.is_some()
    }

    /// A hook for Ballista's clients: the same endpoint, over TLS with this process's
    /// certificate when TLS is on, and carrying the token's proof when there is one.
    pub fn endpoint_override(self: &Arc<Self>) -> EndpointOverrideFn {
        let me = self.clone();
        let tls = self.tls.as_ref().map(|t| t.endpoint_override());
        Arc::new(move |endpoint: tonic::transport::Endpoint| {
            let endpoint = match &tls {
                Some(tls) => tls(endpoint)?,
                None => endpoint,
            };
            Ok(match &me.token {
                Some(token) => endpoint.user_agent(token.agent())?,
                None => endpoint,
            })
        })
    }
}

/// Accepts connections on `listen` from holders of this process's credentials and passes them
/// on to the plain Ballista server at `to` (on 127.0.0.1); runs until the listener fails.
pub async fn serve(creds: Arc<Credentials>, listen: tokio::net::TcpListener, to: SocketAddr) -> Result<(), String> {
    // With a token, requests are read (to check each one's proof) and sent on over one channel;
    // with TLS alone, the bytes of an admitted connection are passed on as they are.
    let backend = match creds.token {
        Some(_) => Some(
            tonic::transport::Endpoint::from_shared(format!("http://{to}"))
                .map_err(|e| e.to_string())?
                .tcp_nodelay(true)
                .initial_connection_window_size(64 << 20)
                .initial_stream_window_size(16 << 20)
                .connect_lazy(),
        ),
        None => None,
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let strangers: Strangers = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let mut told = None::<tokio::time::Instant>;
    loop {
        let (socket, peer) = match listen.accept().await {
            Ok(accepted) => accepted,
            // Out of file descriptors (a flood of connections), or one reset before it was
            // taken: no reason to stop serving the cluster's own processes.
            Err(e) => {
                if told.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(10)) {
                    tracing::warn!("cannot take a connection ({e}); going on");
                    told = Some(tokio::time::Instant::now());
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // A flood of connections from strangers must not use up the process's files: past the
        // cap, new connections are closed at once.
        let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
        // Nor may one peer hold the slots with connections that never prove themselves, and so
        // keep the cluster's own processes out.
        let Some(unproven) = Unproven::take(&strangers, peer.ip()) else { continue };
        let creds = creds.clone();
        let backend = backend.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let unproven = Arc::new(std::sync::Mutex::new(Some(unproven)));
            let _ = socket.set_nodelay(true);
            match &creds.tls {
                Some(tls) => {
                    let handshake =
                        tokio::time::timeout(std::time::Duration::from_secs(10), tls.acceptor.accept(socket));
                    let secure = match handshake.await {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            // A connection closed before any TLS (a port check, as executors
                            // make of their scheduler) is not worth a warning; a refused
                            // certificate is.
                            if e.kind() != std::io::ErrorKind::UnexpectedEof {
                                tracing::warn!("refused a connection from {peer}: {e}");
                            }
                            return;
                        }
                        Err(_) => return,
                    };
                    // A certificate of the cluster's is proof enough when there is no token.
                    if creds.token.is_none() {
                        unproven.lock().unwrap_or_else(|e| e.into_inner()).take();
                    }
                    pass_on(secure, &creds, backend, to, peer, unproven).await;
                }
                None => pass_on(socket, &creds, backend, to, peer, unproven).await,
            }
        });
    }
}

/// Passes an admitted connection on: as bytes, or request by request when each must carry the
/// token.
async fn pass_on<S>(
    mut io: S,
    creds: &Arc<Credentials>,
    backend: Option<tonic::transport::Channel>,
    to: SocketAddr,
    peer: SocketAddr,
    unproven: Arc<std::sync::Mutex<Option<Unproven>>>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let Some(backend) = backend else {
        let Ok(mut plain) = tokio::net::TcpStream::connect(to).await else { return };
        let _ = plain.set_nodelay(true);
        let _ = tokio::io::copy_bidirectional(&mut io, &mut plain).await;
        return;
    };
    let creds = creds.clone();
    // Whether a request of this connection carried the token; a refusal ends the connection.
    let proven = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let refused = Arc::new(tokio::sync::Notify::new());
    let (proven_, refused_) = (proven.clone(), refused.clone());
    let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
        let mut backend = backend.clone();
        let admitted = creds.token.as_ref().is_some_and(|t| t.admits(request.headers()));
        if admitted {
            proven_.store(true, std::sync::atomic::Ordering::Relaxed);
            unproven.lock().unwrap_or_else(|e| e.into_inner()).take();
        }
        let refused = refused_.clone();
        async move {
            if !admitted {
                tracing::warn!("refused a request from {peer}: no cluster token, or a wrong one");
                refused.notify_one();
                let status = tonic::Status::unauthenticated(
                    "this cluster takes only its own processes: give the cluster's token (WEIR_CLUSTER_TOKEN or \
                     --token-file)",
                );
                return Ok::<_, std::convert::Infallible>(status.into_http::<tonic::body::Body>());
            }
            // The proof goes no further than this listener.
            request.headers_mut().remove(hyper::header::USER_AGENT);
            let request = request.map(tonic::body::Body::new);
            use tonic::codegen::Service;
            let answer = match std::future::poll_fn(|cx| backend.poll_ready(cx)).await {
                Ok(()) => backend.call(request).await,
                Err(e) => Err(e),
            };
            Ok(answer.unwrap_or_else(|e| tonic::Status::unavailable(e.to_string()).into_http()))
        }
    });
    let mut http2 = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    http2.initial_connection_window_size(64 << 20).initial_stream_window_size(16 << 20).max_frame_size(1 << 20);
    let mut connection = std::pin::pin!(http2.serve_connection(hyper_util::rt::TokioIo::new(io), service));
    // A connection that has not proven itself soon, or was refused, is closed: strangers may
    // not hold connections open.
    let unwelcome = async {
        tokio::select! {
            _ = tokio::time::sleep(PROVE_WITHIN) => {
                if proven.load(std::sync::atomic::Ordering::Relaxed) {
                    std::future::pending::<()>().await;
                }
            }
            _ = refused.notified() => {
                // Time for the refusal to reach the client before the connection goes.
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    };
    tokio::select! {
        _ = connection.as_mut() => return,
        _ = unwelcome => {}
    }
    // GOAWAY first, so that a client of ours that merely had not asked anything yet reconnects
    // cleanly when it does.
    connection.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), connection).await;
}

/// Connections not yet proven (no token seen, no TLS handshake finished), by peer address.
type Strangers = Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>;

/// Most connections one peer address may hold before proving itself: the cluster's own
/// processes prove themselves at their first request, so only a flood reaches it.
const MAX_UNPROVEN_PER_PEER: usize = 64;

/// One unproven connection of a peer, counted while it lives.
struct Unproven {
    strangers: Strangers,
    ip: std::net::IpAddr,
}

impl Unproven {
    /// Counts a new connection from `ip`, unless it already holds the most it may.
    fn take(strangers: &Strangers, ip: std::net::IpAddr) -> Option<Self> {
        let mut all = strangers.lock().unwrap_or_else(|e| e.into_inner());
        let n = all.entry(ip).or_default();
        if *n >= MAX_UNPROVEN_PER_PEER {
            return None;
        }
        *n += 1;
        Some(Self { strangers: strangers.clone(), ip })
    }
}

impl Drop for Unproven {
    fn drop(&mut self) {
        let mut all = self.strangers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = all.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                all.remove(&self.ip);
            }
        }
    }
}

/// Connections one guard holds at once (the cluster's own processes keep a few each).
const MAX_CONNECTIONS: usize = 2048;

/// How soon a connection to a token-guarded port must send a request with the token.
const PROVE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// This process's credentials, once set (see [`install`]).
static INSTALLED: std::sync::OnceLock<Arc<Credentials>> = std::sync::OnceLock::new();

/// Makes every cluster connection and server of this process use `creds` (a process belongs to
/// one cluster, so this is set once, at start-up). Credentials with neither TLS nor a token are
/// not installed.
pub fn install(creds: Credentials) -> Result<(), String> {
    if creds.tls.is_none() && creds.token.is_none() {
        return Ok(());
    }
    INSTALLED
        .set(Arc::new(creds))
        .map_err(|_| "the cluster's credentials are already set up in this process".to_string())
}

/// This process's credentials, if it has any.
pub fn installed() -> Option<Arc<Credentials>> {
    INSTALLED.get().cloned()
}

/// A client of the scheduler at `url` (`df://HOST:PORT`), with this process's credentials.
pub async fn scheduler_client(
    url: &str,
) -> Result<
    ballista_core::serde::protobuf::scheduler_grpc_client::SchedulerGrpcClient<tonic::transport::Channel>,
    tonic::transport::Error,
> {
    let address = crate::scheduler_address(url).unwrap_or(url);
    let mut endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?;
    if let Some(creds) = installed() {
        endpoint = (creds.endpoint_override())(endpoint).map_err(|e| {
            // The override only fails on a URI or setting tonic refuses: said as such.
            tonic::transport::Endpoint::from_shared(format!("bad endpoint: {e}")).unwrap_err()
        })?;
    }
    Ok(ballista_core::serde::protobuf::scheduler_grpc_client::SchedulerGrpcClient::new(endpoint.connect().await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_admits_its_own_proof_only() {
        let token = Token::new("correct horse battery staple\n").unwrap();
        let mut headers = hyper::HeaderMap::new();
        assert!(!token.admits(&headers), "no header");
        headers.insert(hyper::header::USER_AGENT, format!("{} tonic/0.14.9", token.agent()).parse().unwrap());
        assert!(token.admits(&headers));
        let other = Token::new("correct horse battery stapler").unwrap();
        headers.insert(hyper::header::USER_AGENT, format!("{} tonic/0.14.9", other.agent()).parse().unwrap());
        assert!(!token.admits(&headers), "another token");
        headers.insert(hyper::header::USER_AGENT, format!("{AGENT}/ tonic/0.14.9").parse().unwrap());
        assert!(!token.admits(&headers), "an empty proof");
        assert!(!format!("{token:?}").contains(&token.proof), "the proof in Debug");
        assert!(Token::new("short").unwrap_err().contains("at least 16"));
        let made = Token::generate().unwrap();
        assert_eq!(made.len(), 64);
        assert_ne!(made, Token::generate().unwrap());
    }
}
