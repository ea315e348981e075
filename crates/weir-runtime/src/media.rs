//! The media loader every driver of the runtime gets: records' media fields read from local
//! files and `https://` URLs (`http://` on loopback only), capped at the inline limit while
//! they are read, so an oversized part costs neither memory nor a call.

use bytes::Bytes;
use futures::StreamExt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use weir_core::media::{too_large, MediaLoader};
use weir_providers::http::is_loopback;

/// Reads files and URLs, and `gs://` and `s3://` objects through `objects` when given.
pub struct Loader {
    client: Option<reqwest::Client>,
    objects: Option<Arc<dyn MediaLoader>>,
}

impl Loader {
    /// The process's loader (one HTTP client for every driver), without buckets.
    pub fn shared() -> Arc<Loader> {
        static ONE: OnceLock<Arc<Loader>> = OnceLock::new();
        ONE.get_or_init(|| Arc::new(Loader::new(None))).clone()
    }

    /// A loader that reads `gs://` and `s3://` sources with `objects` (the front end's store
    /// clients, with their credentials and emulators).
    pub fn new(objects: Option<Arc<dyn MediaLoader>>) -> Loader {
        // A redirect is followed only where a first URL could go: never to plain http:// off
        // this machine (a loopback server's redirect must not carry a fetch off it unencrypted).
        let policy = reqwest::redirect::Policy::custom(|a| {
            if a.previous().len() >= 10 {
                a.error("more than 10 redirects")
            } else if a.url().scheme() != "https" && !(a.url().scheme() == "http" && is_loopback(a.url())) {
                a.error("a redirect to plain http:// off this machine")
            } else {
                a.follow()
            }
        });
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .connect_timeout(Duration::from_secs(20))
            .redirect(policy)
            .build()
            .ok();
        Loader { client, objects }
    }
}

#[async_trait::async_trait]
impl MediaLoader for Loader {
    async fn load(&self, source: &str, max: usize) -> Result<Bytes, String> {
        if source.starts_with("https://") || source.starts_with("http://") {
            let url = reqwest::Url::parse(source).map_err(|_| "not a URL".to_string())?;
            if url.scheme() == "http" && !is_loopback(&url) {
                return Err("plain http:// is read only from loopback: give an https:// URL".into());
            }
            let client = self.client.as_ref().ok_or("no HTTP client could be made")?;
            let resp = client.get(url).send().await.map_err(|e| {
                let why = match () {
                    _ if e.is_timeout() => "no answer in time",
                    _ if e.is_redirect() => "a redirect weir does not follow (to plain http:// off this machine)",
                    _ => "the connection failed",
                };
                format!("could not be fetched: {why}")
            })?;
            if !resp.status().is_success() {
                return Err(format!("could not be fetched: HTTP {}", resp.status().as_u16()));
            }
            if let Some(len) = resp.content_length().filter(|l| *l > max as u64) {
                return Err(too_large(len, max));
            }
            let mut body = resp.bytes_stream();
            let mut data = Vec::new();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| format!("cut while fetched: {}", e.without_url()))?;
                if data.len() + chunk.len() > max {
                    return Err(format!("over the {max} bytes left for a request's inline parts (15 MB in all)"));
                }
                data.extend_from_slice(&chunk);
            }
            return Ok(Bytes::from(data));
        }
        if source.starts_with("gs://") || source.starts_with("s3://") {
            return match &self.objects {
                Some(objects) => objects.load(source, max).await,
                None => Err("gs:// and s3:// media are not read here: give a local path or an https:// URL".into()),
            };
        }
        if let Some((scheme, _)) = source.split_once("://") {
            return Err(format!("{scheme}:// is not a place weir reads media from (a path, https://)"));
        }
        // One trip to the blocking pool for the whole file (open, size, read): a trip per step
        // cost more in thread switches than the reading (seen in a profile at 20 KB a file).
        let path = source.to_string();
        let read = tokio::task::spawn_blocking(move || -> Result<Bytes, String> {
            use std::io::Read;
            // Asked of the path before it is opened: opening a FIFO waits for a writer forever.
            if let Ok(m) = std::fs::metadata(&path) {
                if !m.is_file() {
                    return Err("not a file".into());
                }
            }
            let f = std::fs::File::open(&path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => "no such file".to_string(),
                _ => format!("cannot be read: {e}"),
            })?;
            let meta = f.metadata().map_err(|e| format!("cannot be read: {e}"))?;
            if !meta.is_file() {
                return Err("not a file".into());
            }
            if meta.len() > max as u64 {
                return Err(too_large(meta.len(), max));
            }
            let mut data = Vec::with_capacity(meta.len() as usize);
            // At most one byte past the limit: a file that grew since is caught too.
            f.take(max as u64 + 1).read_to_end(&mut data).map_err(|e| format!("cannot be read: {e}"))?;
            if data.len() > max {
                return Err(too_large(data.len() as u64, max));
            }
            Ok(Bytes::from(data))
        });
        read.await.map_err(|e| format!("cannot be read: {e}"))?
    }
}
