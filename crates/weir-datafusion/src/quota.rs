//! One quota for a whole cluster: the scheduler keeps one throttle per endpoint and key for its
//! executors (weir-runtime's [`weir_runtime::share::Keeper`]), so that executors on different
//! machines that call one endpoint with one key send as one client: the quota learned from all
//! their calls, told limits counted together, the server's advised pauses holding them all.
//!
//! The service listens on the port below the scheduler's (`50049` beside `50050`), on the
//! scheduler's address, behind the same credentials as the rest of the cluster: with mutual TLS
//! the handshake asks for a certificate of the cluster's authority; with a token, the first
//! line must carry its proof (compared in constant time) before anything else is read.
//! Executors find it from the scheduler's address alone.

use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use weir_runtime::gather::Gathered;
use weir_runtime::share::{Hub, Keeper, Link};

use crate::guard::Credentials;

/// The quota service's address for a scheduler at `scheduler`: the same host, the port below.
pub fn service_addr(scheduler: SocketAddr) -> Option<SocketAddr> {
    let port = scheduler.port().checked_sub(1).filter(|p| *p > 0)?;
    Some(SocketAddr::new(scheduler.ip(), port))
}

/// How soon a connection must be past the guard.
const PROVE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Connections served at once (each executor keeps one per endpoint it calls).
const MAX_CONNECTIONS: usize = 1024;

/// Serves the quota service on `listener` until it fails, admitting only the cluster's
/// processes (all of them when the cluster has no credentials: it then listens on loopback, or
/// where the user said `--insecure`).
///
/// The same service takes the executors' reports for the cluster's page (`page`, see
/// [`weir_runtime::gather`]): a connection's first line says which it is.
pub async fn serve(
    listener: tokio::net::TcpListener,
    creds: Option<Arc<Credentials>>,
    page: Arc<Gathered>,
) -> Result<(), String> {
    let keeper = Keeper::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!("quota service: cannot take a connection ({e})");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
        let (keeper, creds, page) = (keeper.clone(), creds.clone(), page.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let _ = socket.set_nodelay(true);
            let link: Box<dyn Link> = match creds.as_ref().and_then(|c| c.tls.as_ref()) {
                Some(tls) => match tokio::time::timeout(PROVE_WITHIN, tls.acceptor.accept(socket)).await {
                    Ok(Ok(s)) => Box::new(s),
                    Ok(Err(e)) => {
                        if e.kind() != std::io::ErrorKind::UnexpectedEof {
                            tracing::warn!("quota service: refused a connection from {peer}: {e}");
                        }
                        return;
                    }
                    Err(_) => return,
                },
                None => Box::new(socket),
            };
            let link = match creds.as_ref().and_then(|c| c.token.as_ref()) {
                Some(token) => match tokio::time::timeout(PROVE_WITHIN, first_line(link, 256)).await {
                    Ok(Ok((link, line))) if token.proves(&line) => link,
                    Ok(Ok(_)) => {
                        tracing::warn!(
                            "quota service: refused a connection from {peer}: no cluster token, or a wrong one"
                        );
                        return;
                    }
                    _ => return,
                },
                None => link,
            };
            // A quota's hello, or an executor's report for the page.
            let Ok(Ok((link, first))) = tokio::time::timeout(PROVE_WITHIN, first_line(link, HELLO_BYTES)).await else {
                return;
            };
            let first = String::from_utf8_lossy(&first).trim_end().to_string();
            match serde_json::from_str::<weir_runtime::gather::Hello>(&first) {
                Ok(hello) => page.serve(hello, link).await,
                Err(_) => keeper.serve(&first, link).await,
            }
        });
    }
}

/// The longest first line taken after the guard (a quota's hello with its told limits, or an
/// executor's for the page).
const HELLO_BYTES: usize = 4096;

/// Reads the connection's first line (at most `most` bytes), byte by byte so that nothing after
/// it is taken from the stream.
async fn first_line(mut link: Box<dyn Link>, most: usize) -> std::io::Result<(Box<dyn Link>, Vec<u8>)> {
    let mut line = Vec::new();
    while line.len() < most {
        let b = link.read_u8().await?;
        line.push(b);
        if b == b'\n' {
            break;
        }
    }
    Ok((link, line))
}

/// An executor's way to its scheduler's quota service, with this process's credentials.
pub struct SchedulerHub {
    addr: SocketAddr,
    creds: Option<Arc<Credentials>>,
}

impl SchedulerHub {
    /// The quota service of the scheduler at `scheduler`, reached with `creds`.
    pub fn new(scheduler: SocketAddr, creds: Option<Arc<Credentials>>) -> Option<Self> {
        Some(Self { addr: service_addr(scheduler)?, creds })
    }
}

impl Hub for SchedulerHub {
    fn connect(&self) -> futures::future::BoxFuture<'static, std::io::Result<Box<dyn Link>>> {
        let (addr, creds) = (self.addr, self.creds.clone());
        Box::pin(async move {
            let timeout = |e| std::io::Error::new(std::io::ErrorKind::TimedOut, e);
            let tcp = tokio::time::timeout(PROVE_WITHIN, tokio::net::TcpStream::connect(addr))
                .await
                .map_err(|_| timeout("no answer"))??;
            let _ = tcp.set_nodelay(true);
            let mut link: Box<dyn Link> = match creds.as_ref().and_then(|c| c.tls.as_ref()) {
                Some(tls) => {
                    let name = tokio_rustls::rustls::pki_types::ServerName::try_from(crate::tls::CLUSTER_NAME)
                        .expect("the cluster's name is a DNS name");
                    let handshake = tls.connector.connect(name, tcp);
                    Box::new(tokio::time::timeout(PROVE_WITHIN, handshake).await.map_err(|_| timeout("no TLS"))??)
                }
                None => Box::new(tcp),
            };
            if let Some(token) = creds.as_ref().and_then(|c| c.token.as_ref()) {
                link.write_all(token.proof_line().as_bytes()).await?;
            }
            Ok(link)
        })
    }

    fn describe(&self) -> String {
        self.addr.to_string()
    }
}
