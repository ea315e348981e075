//! The media loader every driver of the runtime gets: records' media fields read from local
//! files and `https://` URLs (`http://` on loopback only), capped at the inline limit while
//! they are read, so an oversized part costs neither memory nor a call.

use bytes::Bytes;
use futures::StreamExt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use weir_core::media::{MediaError, MediaLoader};
use weir_core::ErrorKind;
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
            // A media fetch that stalls holds its record (and, tried three times, for long):
            // 30 s is ample for the 15 MB a request takes inline.
            .timeout(Duration::from_secs(30))
            .connect_timeout(Duration::from_secs(10))
            .redirect(policy)
            .build()
            .ok();
        Loader { client, objects }
    }
}

/// Tries of a URL whose fetch failed in a way that may pass (a timeout, a cut connection, a
/// 5xx or 429), the waits between them doubling from [`FETCH_WAIT`].
const FETCH_TRIES: u32 = 3;
/// The wait before the second try of a URL.
const FETCH_WAIT: Duration = Duration::from_millis(500);

impl Loader {
    /// `url`'s bytes, tried again after a failure that may pass; the last failure otherwise.
    async fn fetch(&self, url: reqwest::Url, max: usize) -> Result<Bytes, MediaError> {
        let mut wait = FETCH_WAIT;
        let mut tries = 1;
        loop {
            match self.fetch_once(url.clone(), max).await {
                Err(e) if e.is_transient() && tries < FETCH_TRIES => {
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                    tries += 1;
                }
                done => return done,
            }
        }
    }

    async fn fetch_once(&self, url: reqwest::Url, max: usize) -> Result<Bytes, MediaError> {
        let client = self.client.as_ref().ok_or("no HTTP client could be made")?;
        let resp = client.get(url).send().await.map_err(|e| {
            let fetched = |why: &str| format!("could not be fetched: {why}");
            if e.is_timeout() {
                MediaError::transient(ErrorKind::Timeout, fetched("no answer in time"))
            } else if e.is_redirect() {
                MediaError::permanent(fetched("a redirect weir does not follow (to plain http:// off this machine)"))
            } else {
                MediaError::transient(ErrorKind::Transport, fetched("the connection failed"))
            }
        })?;
        let status = resp.status();
        if !status.is_success() {
            let msg = format!("could not be fetched: HTTP {}", status.as_u16());
            // A server's failure, a refusal to serve now, or a timeout of its own may pass.
            return Err(if status.is_server_error() || status.as_u16() == 429 || status.as_u16() == 408 {
                MediaError::transient(ErrorKind::Server, msg)
            } else {
                MediaError::permanent(msg)
            });
        }
        if let Some(len) = resp.content_length().filter(|l| *l > max as u64) {
            return Err(MediaError::too_large(len, max));
        }
        let mut body = resp.bytes_stream();
        let mut data = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| {
                MediaError::transient(ErrorKind::Transport, format!("cut while fetched: {}", e.without_url()))
            })?;
            if data.len() + chunk.len() > max {
                return Err(MediaError::too_large((data.len() + chunk.len()) as u64, max));
            }
            data.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(data))
    }
}

#[async_trait::async_trait]
impl MediaLoader for Loader {
    async fn peek(&self, source: &str) -> Result<weir_core::media::Peek, MediaError> {
        match &self.objects {
            Some(objects) if source.starts_with("gs://") || source.starts_with("s3://") => objects.peek(source).await,
            _ => Err("only gs:// and s3:// objects are read by reference".into()),
        }
    }

    async fn load(&self, source: &str, max: usize) -> Result<Bytes, MediaError> {
        if source.starts_with("https://") || source.starts_with("http://") {
            let url = reqwest::Url::parse(source).map_err(|_| "not a URL")?;
            if url.scheme() == "http" && !is_loopback(&url) {
                return Err("plain http:// is read only from loopback: give an https:// URL".into());
            }
            return self.fetch(url, max).await;
        }
        if source.starts_with("gs://") || source.starts_with("s3://") {
            return match &self.objects {
                Some(objects) => objects.load(source, max).await,
                None => Err("gs:// and s3:// media are not read here: give a local path or an https:// URL".into()),
            };
        }
        if let Some((scheme, _)) = source.split_once("://") {
            return Err(format!("{scheme}:// is not a place weir reads media from (a path, https://)").into());
        }
        // One trip to the blocking pool for the whole file (open, size, read): a trip per step
        // cost more in thread switches than the reading (seen in a profile at 20 KB a file).
        let path = source.to_string();
        let read = tokio::task::spawn_blocking(move || -> Result<Bytes, MediaError> {
            use std::io::Read;
            // Asked of the path before it is opened: opening a FIFO waits for a writer forever.
            if let Ok(m) = std::fs::metadata(&path) {
                if !m.is_file() {
                    return Err("not a file".into());
                }
            }
            // The system's own files are not a dataset's media: /proc/self/environ would send
            // weir's environment (its keys) to the model. They report no size, and some never
            // end; a file that says it is empty is refused before it is read.
            if let Ok(real) = std::fs::canonicalize(&path) {
                if ["/proc", "/sys", "/dev"].iter().any(|d| real.starts_with(d)) {
                    return Err("a file of the system (/proc, /sys, /dev), not media".into());
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
                return Err(MediaError::too_large(meta.len(), max));
            }
            if meta.len() == 0 {
                return Err("it is empty".into());
            }
            let mut data = Vec::with_capacity(meta.len() as usize);
            // At most one byte past the limit: a file that grew since is caught too.
            f.take(max as u64 + 1).read_to_end(&mut data).map_err(|e| format!("cannot be read: {e}"))?;
            if data.len() > max {
                return Err(MediaError::too_large(data.len() as u64, max));
            }
            Ok(Bytes::from(data))
        });
        read.await.map_err(|e| MediaError::permanent(format!("cannot be read: {e}")))?
    }
}
