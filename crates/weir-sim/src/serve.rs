//! What the model simulator and the in-memory GCS share to serve HTTP/1: the body type of their
//! answers and the loop that accepts connections until shutdown.

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::io;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// An answer's body: whole, streamed, or failing mid-way (a fault).
pub(crate) type Body = BoxBody<Bytes, io::Error>;

/// Serves `handle` on every connection `listener` accepts until `shutdown` changes; then
/// closes every connection, hung requests included. Shared by the model simulator and the
/// in-memory GCS.
pub(crate) async fn accept_loop<S, F, Fut>(
    listener: TcpListener,
    state: Arc<S>,
    handle: F,
    mut shutdown: watch::Receiver<bool>,
) where
    S: Send + Sync + 'static,
    F: Fn(Arc<S>, Request<Incoming>) -> Fut + Copy + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<Body>, io::Error>> + Send + 'static,
{
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let state = state.clone();
                let mut stop = shutdown.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| handle(state.clone(), req));
                    let conn = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::select! {
                        _ = conn => {}
                        _ = stop.changed() => {}
                    }
                });
            }
            _ = shutdown.changed() => break,
        }
    }
}
