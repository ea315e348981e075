//! The media loader every driver of the runtime gets: records' media fields read from local
//! files and `https://` URLs (`http://` on loopback only), capped at the inline limit while
//! they are read, so an oversized part costs neither memory nor a call.

use bytes::Bytes;
use futures::StreamExt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use weir_core::media::{too_large_to_upload, Loaded, MediaError, MediaLoader, Spill, Turn};
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

/// Why a file of the system is not read.
const SYSTEM_FILE: &str = "a file of the system (/proc, /sys, /dev), not media";

/// Whether `f` is on a file system the kernel makes up (procfs, sysfs and their kind), whose
/// files are the system's state, not media: one `fstatfs` of the open file, where resolving
/// its path took a call per directory (seen in a profile at 20 KB a file).
fn of_the_system(f: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    const KERNEL_MADE: [i64; 10] = [
        0x9fa0,      // proc
        0x6265_6572, // sysfs
        0x6462_6720, // debugfs
        0x7472_6163, // tracefs
        0x7363_6673, // securityfs
        0x6367_7270, // cgroup2
        0x0027_e0eb, // cgroup
        0xcafe_4a11, // bpf
        0x6265_6570, // configfs
        0xde5e_81e4, // efivarfs
    ];
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `f` is an open file for the duration of the call, and `st` is written in full
    // by a call that returns 0.
    if unsafe { libc::fstatfs(f.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: the call above returned 0.
    // `f_type`'s type differs between platforms (i64 here, u32 on some).
    #[allow(clippy::unnecessary_cast)]
    let kind = unsafe { st.assume_init() }.f_type as i64;
    KERNEL_MADE.contains(&kind)
}

/// `source` as a URL weir fetches, when it is an `http(s)://` one.
fn url_of(source: &str) -> Result<Option<reqwest::Url>, MediaError> {
    if !(source.starts_with("https://") || source.starts_with("http://")) {
        return Ok(None);
    }
    let url = reqwest::Url::parse(source).map_err(|_| "not a URL")?;
    if url.scheme() == "http" && !is_loopback(&url) {
        return Err("plain http:// is read only from loopback: give an https:// URL".into());
    }
    Ok(Some(url))
}

/// Tries of a URL whose fetch failed in a way that may pass (a timeout, a cut connection, a
/// 5xx or 429), the waits between them doubling from [`FETCH_WAIT`].
const FETCH_TRIES: u32 = 3;
/// The wait before the second try of a URL.
const FETCH_WAIT: Duration = Duration::from_millis(500);

impl Loader {
    /// `url`'s bytes, tried again after a failure that may pass; the last failure otherwise.
    /// Past `max`, read on up to `spill`'s limit in the turn for large parts, if it comes within
    /// [`TURN_WAIT`]; once taken, the turn is kept for the later tries.
    async fn fetch(&self, url: reqwest::Url, max: usize, spill: Option<&Spill>) -> Result<Loaded, MediaError> {
        let mut wait = FETCH_WAIT;
        let mut tries = 1;
        let mut turn = None;
        loop {
            match self.fetch_once(url.clone(), max, spill, &mut turn).await {
                Err(e) if e.is_transient() && tries < FETCH_TRIES => {
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                    tries += 1;
                }
                Err(e) => return Err(e),
                Ok(bytes) => {
                    let spilled = bytes.len() > max;
                    return Ok(Loaded { bytes, spilled, turn: turn.filter(|_| spilled) });
                }
            }
        }
    }

    async fn fetch_once(
        &self,
        url: reqwest::Url,
        max: usize,
        spill: Option<&Spill>,
        turn: &mut Option<Turn>,
    ) -> Result<Bytes, MediaError> {
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
        let mut limit = match (&*turn, spill) {
            (Some(_), Some(s)) => s.max,
            _ => max,
        };
        if let Some(len) = resp.content_length().filter(|l| *l > limit as u64) {
            past(Some(len), &mut limit, max, spill, turn).await?;
        }
        let mut body = resp.bytes_stream();
        let mut data = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| {
                if e.is_timeout() {
                    MediaError::transient(ErrorKind::Timeout, "not fetched whole within 30 s")
                } else {
                    MediaError::transient(ErrorKind::Transport, format!("cut while fetched: {}", e.without_url()))
                }
            })?;
            if data.len() + chunk.len() > limit {
                past(None, &mut limit, max, spill, turn).await?;
                if data.len() + chunk.len() > limit {
                    return Err(MediaError::permanent(too_large_to_upload(None, limit)));
                }
            }
            data.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(data))
    }
}

/// How long a read past the inline limit waits for the turn for large parts (another record's
/// upload) before it lets go of what it read, to read it again in that turn.
const TURN_WAIT: Duration = Duration::from_secs(5);

/// A source does not fit in `limit` (its size `len` when it is known, or bytes past `limit`
/// read): `limit` becomes `spill`'s when the turn for large parts is ours or comes within
/// [`TURN_WAIT`], and otherwise the error says why the bytes are not read on (too large to go
/// inline, which may go by upload in its turn; or too large to upload).
async fn past(
    len: Option<u64>,
    limit: &mut usize,
    max: usize,
    spill: Option<&Spill>,
    turn: &mut Option<Turn>,
) -> Result<(), MediaError> {
    if let Some(s) = spill.filter(|_| *limit == max) {
        if turn.is_none() {
            if let Some(t) = s.turn {
                *turn = tokio::time::timeout(TURN_WAIT, t.lock()).await.ok();
            }
        }
        if turn.is_some() || s.turn.is_none() {
            *limit = s.max;
        }
    }
    match len {
        Some(len) if len <= *limit as u64 => Ok(()),
        None if *limit > max => Ok(()),
        Some(len) if *limit == max => Err(MediaError::too_large(len, max)),
        None if *limit == max => Err(MediaError::too_large_unsized(max)),
        len => Err(MediaError::permanent(too_large_to_upload(len, *limit))),
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

    async fn load_or_spill(&self, source: &str, max: usize, spill: Option<&Spill>) -> Result<Loaded, MediaError> {
        match url_of(source)? {
            Some(url) => self.fetch(url, max, spill).await,
            None => Ok(Loaded::whole(self.load(source, max).await?)),
        }
    }

    async fn load(&self, source: &str, max: usize) -> Result<Bytes, MediaError> {
        if let Some(url) = url_of(source)? {
            return self.fetch(url, max, None).await.map(|l| l.bytes);
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
            use std::os::unix::fs::OpenOptionsExt;
            // The system's own files are not a dataset's media: /proc/self/environ would send
            // weir's environment (its keys) to the model. Asked of the name here, and of the
            // file opened below (a link to one is refused too).
            if ["/proc/", "/sys/", "/dev/"].iter().any(|d| path.starts_with(d)) {
                return Err(SYSTEM_FILE.into());
            }
            // Asked of the path before it is opened: opening a device can do something (a
            // watchdog starts, a tape rewinds), and opening a FIFO waits for a writer.
            if std::fs::metadata(&path).is_ok_and(|m| !m.is_file()) {
                return Err("not a file".into());
            }
            // Opened without waiting, for a FIFO put in the file's place since.
            let f =
                std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&path).map_err(
                    |e| match e.kind() {
                        std::io::ErrorKind::NotFound => "no such file".to_string(),
                        _ => format!("cannot be read: {e}"),
                    },
                )?;
            let meta = f.metadata().map_err(|e| format!("cannot be read: {e}"))?;
            if !meta.is_file() {
                return Err("not a file".into());
            }
            if of_the_system(&f) {
                return Err(SYSTEM_FILE.into());
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
