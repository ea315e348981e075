//! A Google Cloud Storage bucket in memory, speaking the part of the XML API that clients such
//! as `object_store` use: upload (`PUT`), download with ranges (`GET`, `HEAD`), delete, listing
//! (`GET /BUCKET?list-type=2`) and multipart uploads (`POST ?uploads`, `PUT ?partNumber`,
//! `POST ?uploadId`, `DELETE ?uploadId`).
//!
//! Why weir has its own: the GCS emulators on PyPI implement the JSON API, and
//! `object_store` writes and lists through the XML API (fake-gcs-server answers its `PUT` with
//! "invalid uploadType"; gcp-storage-emulator has no XML listing). Tests start one with
//! [`GcsServer::start`] and point `STORAGE_EMULATOR_HOST` at it. Buckets exist as soon as
//! something is written to them. No authentication.

use bytes::Bytes;
use http::{header, Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::serve::Body;

struct Object {
    data: Bytes,
    generation: u64,
    /// Seconds since the epoch.
    updated: u64,
}

impl Object {
    fn etag(&self) -> String {
        format!("\"{:x}-{}\"", self.generation, self.data.len())
    }
}

struct Upload {
    bucket: String,
    name: String,
    parts: BTreeMap<u32, Bytes>,
}

/// The objects of every bucket. A simulator keeps one, so that its Vertex AI batch jobs read
/// their input from, and write their output to, the bucket its GCS serves.
#[derive(Default)]
pub(crate) struct Store {
    objects: Mutex<BTreeMap<(String, String), Object>>,
    uploads: Mutex<HashMap<String, Upload>>,
    counter: AtomicU64,
}

impl Store {
    /// Writes (or replaces) an object.
    pub(crate) fn put(&self, bucket: &str, name: &str, data: Bytes) {
        let generation = self.counter.fetch_add(1, Ordering::Relaxed) + 1;
        let o = Object { data, generation, updated: now() };
        self.objects.lock().unwrap_or_else(|e| e.into_inner()).insert((bucket.to_string(), name.to_string()), o);
    }

    /// An object's content.
    pub(crate) fn get(&self, bucket: &str, name: &str) -> Option<Bytes> {
        let objects = self.objects.lock().unwrap_or_else(|e| e.into_inner());
        objects.get(&(bucket.to_string(), name.to_string())).map(|o| o.data.clone())
    }
}

/// A running in-memory GCS.
pub struct GcsServer {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl GcsServer {
    /// Starts one on `addr` (port 0 picks a free port).
    pub async fn start(addr: SocketAddr) -> io::Result<Self> {
        Self::serve(addr, Arc::new(Store::default())).await
    }

    /// Serves `store` on `addr`.
    pub(crate) async fn serve(addr: SocketAddr, store: Arc<Store>) -> io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (shutdown, rx) = watch::channel(false);
        let task = tokio::spawn(crate::serve::accept_loop(listener, store, handle, rx));
        Ok(Self { addr, shutdown, task })
    }

    /// `http://ADDR`: the value for `STORAGE_EMULATOR_HOST`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops it.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }
}

fn reply(status: u16, headers: &[(&str, String)], body: impl Into<Bytes>) -> Response<Body> {
    let mut b = Response::builder().status(status);
    for (k, v) in headers {
        b = b.header(*k, v.as_str());
    }
    b.body(Full::new(body.into()).map_err(|never| match never {}).boxed()).expect("valid response parts")
}

fn xml_error(status: u16, code: &str, message: &str) -> Response<Body> {
    let body = format!(
        "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{}</Message></Error>",
        escape(message)
    );
    reply(status, &[("content-type", "application/xml".into())], body)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// `%XX` decoding of a path (no `+` for space: that is a query's convention).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    while i < b.len() {
        if b[i] == b'%' && i + 3 <= b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push(h * 16 + l);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Days since 1970-01-01 → (year, month, day), in the proleptic Gregorian calendar.
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `secs` since the epoch as an RFC 3339 time, as Google's APIs write times.
pub(crate) fn rfc3339_of(secs: u64) -> String {
    rfc3339(secs)
}

fn rfc3339(secs: u64) -> String {
    let (y, m, d) = civil((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.000Z", s / 3600, s / 60 % 60, s % 60)
}

fn http_date(secs: u64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let days = secs / 86_400;
    let (y, m, d) = civil(days as i64);
    let s = secs % 86_400;
    format!(
        "{}, {d:02} {} {y:04} {:02}:{:02}:{:02} GMT",
        DAYS[(days % 7) as usize],
        MONTHS[(m - 1) as usize],
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The byte range a `Range` header asks of an object of `len` bytes.
fn range(spec: &str, len: usize) -> Option<(usize, usize)> {
    let r = spec.strip_prefix("bytes=")?;
    let (a, b) = r.split_once('-')?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", n) => {
            let n: usize = n.parse().ok()?;
            (len.saturating_sub(n), len)
        }
        (a, "") => (a.parse().ok()?, len),
        (a, b) => (a.parse().ok()?, b.parse::<usize>().ok()?.saturating_add(1).min(len)),
    };
    (start < end || (start == 0 && len == 0)).then_some((start, end))
}

async fn handle(store: Arc<Store>, req: Request<Incoming>) -> Result<Response<Body>, io::Error> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().trim_start_matches('/').to_string();
    let query: HashMap<String, String> =
        form_urlencoded::parse(parts.uri.query().unwrap_or("").as_bytes()).into_owned().collect();
    let (bucket, name) = match path.split_once('/') {
        Some((b, n)) => (percent_decode(b), percent_decode(n)),
        None => (percent_decode(&path), String::new()),
    };
    if bucket.is_empty() {
        return Ok(xml_error(400, "InvalidURI", "no bucket in the path"));
    }
    let data = body.collect().await.map_err(io::Error::other)?.to_bytes();
    let key = (bucket.clone(), name.clone());
    let method = parts.method.clone();
    if name.is_empty() {
        return Ok(if method == Method::GET {
            list(&store, &bucket, &query)
        } else {
            xml_error(405, "MethodNotAllowed", "")
        });
    }
    match method {
        Method::PUT => {
            if let (Some(n), Some(id)) = (query.get("partNumber"), query.get("uploadId")) {
                let mut uploads = store.uploads.lock().unwrap_or_else(|e| e.into_inner());
                let Some(u) = uploads.get_mut(id) else { return Ok(xml_error(404, "NoSuchUpload", id)) };
                let n: u32 = n.parse().unwrap_or(0);
                let etag = format!("\"part-{n}-{}\"", data.len());
                u.parts.insert(n, data);
                return Ok(reply(200, &[("etag", etag)], ""));
            }
            let generation = store.counter.fetch_add(1, Ordering::Relaxed) + 1;
            let o = Object { data, generation, updated: now() };
            let headers = [("etag", o.etag()), ("x-goog-generation", generation.to_string())];
            store.objects.lock().unwrap_or_else(|e| e.into_inner()).insert(key, o);
            Ok(reply(200, &headers, ""))
        }
        Method::POST if query.contains_key("uploads") => {
            let id = format!("upload-{}", store.counter.fetch_add(1, Ordering::Relaxed) + 1);
            let upload = Upload { bucket: bucket.clone(), name: name.clone(), parts: BTreeMap::new() };
            store.uploads.lock().unwrap_or_else(|e| e.into_inner()).insert(id.clone(), upload);
            let body = format!(
                "<?xml version='1.0' encoding='UTF-8'?><InitiateMultipartUploadResult><Bucket>{}</Bucket><Key>{}</Key><UploadId>{id}</UploadId></InitiateMultipartUploadResult>",
                escape(&bucket),
                escape(&name)
            );
            Ok(reply(200, &[("content-type", "application/xml".into())], body))
        }
        Method::POST if query.contains_key("uploadId") => {
            let id = &query["uploadId"];
            let Some(u) = store.uploads.lock().unwrap_or_else(|e| e.into_inner()).remove(id) else {
                return Ok(xml_error(404, "NoSuchUpload", id));
            };
            let mut whole = Vec::new();
            for p in u.parts.values() {
                whole.extend_from_slice(p);
            }
            let generation = store.counter.fetch_add(1, Ordering::Relaxed) + 1;
            let o = Object { data: whole.into(), generation, updated: now() };
            let etag = o.etag();
            store.objects.lock().unwrap_or_else(|e| e.into_inner()).insert((u.bucket, u.name), o);
            let body = format!(
                "<?xml version='1.0' encoding='UTF-8'?><CompleteMultipartUploadResult><ETag>{}</ETag></CompleteMultipartUploadResult>",
                escape(&etag)
            );
            Ok(reply(
                200,
                &[("content-type", "application/xml".into()), ("x-goog-generation", generation.to_string())],
                body,
            ))
        }
        Method::DELETE if query.contains_key("uploadId") => {
            store.uploads.lock().unwrap_or_else(|e| e.into_inner()).remove(&query["uploadId"]);
            Ok(reply(204, &[], ""))
        }
        Method::DELETE => match store.objects.lock().unwrap_or_else(|e| e.into_inner()).remove(&key) {
            Some(_) => Ok(reply(204, &[], "")),
            None => Ok(xml_error(404, "NoSuchKey", &name)),
        },
        Method::GET | Method::HEAD => {
            let objects = store.objects.lock().unwrap_or_else(|e| e.into_inner());
            let Some(o) = objects.get(&key) else { return Ok(xml_error(404, "NoSuchKey", &name)) };
            let len = o.data.len();
            let mut headers = vec![
                ("etag", o.etag()),
                ("last-modified", http_date(o.updated)),
                ("x-goog-generation", o.generation.to_string()),
                ("content-type", "application/octet-stream".to_string()),
            ];
            let wanted = parts.headers.get(header::RANGE).and_then(|v| v.to_str().ok());
            let (status, slice) = match wanted {
                Some(spec) => match range(spec, len) {
                    Some((a, b)) => {
                        headers.push(("content-range", format!("bytes {a}-{}/{len}", b.saturating_sub(1))));
                        (206, o.data.slice(a..b))
                    }
                    None => return Ok(xml_error(416, "InvalidRange", spec)),
                },
                None => (200, o.data.clone()),
            };
            headers.push(("content-length", slice.len().to_string()));
            Ok(reply(status, &headers, if method == Method::HEAD { Bytes::new() } else { slice }))
        }
        _ => Ok(xml_error(405, "MethodNotAllowed", method.as_str())),
    }
}

/// `GET /BUCKET?list-type=2&prefix=P[&delimiter=/]`: every object under the prefix, in one
/// page.
fn list(store: &Store, bucket: &str, query: &HashMap<String, String>) -> Response<Body> {
    let prefix = query.get("prefix").cloned().unwrap_or_default();
    let delimiter = query.get("delimiter").filter(|d| !d.is_empty()).cloned();
    let after = query.get("start-after").cloned().unwrap_or_default();
    let objects = store.objects.lock().unwrap_or_else(|e| e.into_inner());
    let mut contents = String::new();
    let mut prefixes = std::collections::BTreeSet::new();
    for ((b, name), o) in objects.iter() {
        if b != bucket || !name.starts_with(&prefix) || name.as_str() <= after.as_str() {
            continue;
        }
        if let Some(d) = &delimiter {
            if let Some(i) = name[prefix.len()..].find(d.as_str()) {
                prefixes.insert(name[..prefix.len() + i + d.len()].to_string());
                continue;
            }
        }
        contents.push_str(&format!(
            "<Contents><Key>{}</Key><LastModified>{}</LastModified><ETag>{}</ETag><Size>{}</Size></Contents>",
            escape(name),
            rfc3339(o.updated),
            escape(&o.etag()),
            o.data.len()
        ));
    }
    let common: String =
        prefixes.iter().map(|p| format!("<CommonPrefixes><Prefix>{}</Prefix></CommonPrefixes>", escape(p))).collect();
    let body = format!(
        "<?xml version='1.0' encoding='UTF-8'?><ListBucketResult><Name>{}</Name><Prefix>{}</Prefix>{contents}{common}</ListBucketResult>",
        escape(bucket),
        escape(&prefix)
    );
    reply(200, &[("content-type", "application/xml".into())], body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_ranges() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_460_408), "2026-11-23T19:00:08.000Z");
        assert_eq!(http_date(1_795_460_408), "Mon, 23 Nov 2026 19:00:08 GMT");
        assert_eq!(range("bytes=2-4", 10), Some((2, 5)));
        assert_eq!(range("bytes=-3", 10), Some((7, 10)));
        assert_eq!(range("bytes=8-", 10), Some((8, 10)));
        assert_eq!(range("bytes=20-30", 10), None);
        assert_eq!(percent_decode("out%2Fr%2Eparquet"), "out/r.parquet");
    }
}
