//! Media in records: images, audio, video and documents that a record's fields name (a file
//! path, an `https://` URL, a `gs://` or `s3://` URI), sent with its prompt as parts of the
//! request.
//!
//! A record carries only the references ([`MediaRef`]); the bytes are read when the record is
//! about to be sent (by a [`MediaLoader`] the front end gives the driver) and dropped after its
//! call, so memory depends on the records in flight, not on the dataset. A part that cannot be
//! read, is of a type no provider takes, or is too large is the record's error before any call.
//! The response cache keys on the parts' content (a digest), so the same bytes under another
//! name are a hit and a changed file a miss.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The most bytes of media one request carries inline: the Gemini API takes requests of up to
/// 20 MB with their inline data, OpenAI images of up to 20 MB, and base64 makes 4 bytes of 3,
/// so 15 MB of media is about 20 MB on the wire.
pub const MAX_INLINE_BYTES: usize = 15 * 1000 * 1000;

/// Why a part of `len` bytes cannot be sent when `max` bytes are left for the request's parts
/// (one wording for every place media is read from).
pub fn too_large(len: u64, max: usize) -> String {
    format!("{len} bytes, over the {max} bytes left for a request's inline parts (15 MB in all, 20 MB as base64)")
}

/// A record's media field: which field, and what it names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MediaRef {
    /// The field (or column) it came from, named in errors.
    pub field: String,
    /// A file path, `https://…` (or `http://` on loopback), `gs://…` or `s3://…`.
    pub source: String,
}

/// One part of a request, read and typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Its MIME type (`image/png`, `application/pdf`, …).
    pub mime: String,
    /// Its bytes.
    pub data: Bytes,
    /// A digest of `mime` and the bytes, for the response cache.
    pub digest: [u8; 32],
}

impl Part {
    /// A part of `data`, typed from its content (magic numbers), else from `name`'s extension.
    /// `None` when neither says a type a provider takes.
    pub fn typed(data: Bytes, name: &str) -> Option<Self> {
        // Content that says its type is taken at its word (a zip named `.png` is a zip); the
        // name is trusted only for text, which has no signature (text named `.png` is not an
        // image, and a provider would refuse the call after it was paid for).
        let mime = match infer::get(&data) {
            Some(_) => sniff(&data)?,
            None => by_extension(name).filter(|m| *m == "text/plain")?,
        };
        Some(Self::new(mime.to_string(), data))
    }

    /// A part of `data` of type `mime`.
    pub fn new(mime: String, data: Bytes) -> Self {
        let mut h = Sha256::new();
        h.update(mime.as_bytes());
        h.update([0]);
        h.update(&data);
        Self { mime, data, digest: h.finalize().into() }
    }
}

/// The MIME types weir sends as parts: what Gemini, Vertex AI and OpenAI take as images, audio,
/// video and documents.
pub const TAKEN: &[&str] = &[
    "image/png",
    "image/jpeg",
    "image/webp",
    "image/gif",
    "image/heic",
    "image/heif",
    "audio/wav",
    "audio/mpeg",
    "audio/aac",
    "audio/ogg",
    "audio/flac",
    "video/mp4",
    "video/webm",
    "video/quicktime",
    "application/pdf",
    "text/plain",
];

/// The type of `data` from its first bytes, when it is one weir sends.
fn sniff(data: &[u8]) -> Option<&'static str> {
    let t = infer::get(data)?;
    let mime = match t.mime_type() {
        "audio/x-wav" => "audio/wav",
        "audio/x-flac" => "audio/flac",
        m => m,
    };
    TAKEN.iter().copied().find(|m| *m == mime)
}

/// The type `name`'s extension says, when it is one weir sends.
fn by_extension(name: &str) -> Option<&'static str> {
    let path = name.split(['?', '#']).next().unwrap_or(name);
    let ext = path.rsplit_once('.')?.1.to_ascii_lowercase();
    Some(match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "webp" => "image/webp",
        "gif" => "image/gif",
        "heic" => "image/heic",
        "heif" => "image/heif",
        "wav" => "audio/wav",
        "mp3" => "audio/mpeg",
        "aac" => "audio/aac",
        "ogg" => "audio/ogg",
        "flac" => "audio/flac",
        "mp4" => "video/mp4",
        "webm" => "video/webm",
        "mov" => "video/quicktime",
        "pdf" => "application/pdf",
        "txt" => "text/plain",
        _ => return None,
    })
}

/// Reads what media fields name. The front end gives the driver one (files, URLs, buckets);
/// the driver calls it when a record is about to be sent.
#[async_trait::async_trait]
pub trait MediaLoader: Send + Sync {
    /// The bytes `source` names, at most `max` of them; the error says why not, in words for
    /// an error row (never a secret: a signed URL's query is left out).
    async fn load(&self, source: &str, max: usize) -> Result<Bytes, String>;
}

/// `source` as it may be shown: a URL without its query (a signed URL's signature) and without
/// a user and password (`https://user:pass@host/…`).
pub fn shown(source: &str) -> String {
    let Some((scheme, rest)) = source.split_once("://") else { return source.to_string() };
    let rest = rest.split(['?', '#']).next().unwrap_or(rest);
    let (host, path) = rest.split_once('/').map_or((rest, ""), |(h, p)| (h, p));
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    let slash = if rest.contains('/') { "/" } else { "" };
    format!("{scheme}://{host}{slash}{path}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_typed_by_content_then_by_name() {
        let png = Bytes::from_static(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR");
        assert_eq!(Part::typed(png.clone(), "photo.jpg").unwrap().mime, "image/png", "the content wins");
        assert_eq!(Part::typed(Bytes::from_static(b"%PDF-1.7\n"), "x").unwrap().mime, "application/pdf");
        assert_eq!(Part::typed(Bytes::from_static(b"hello"), "notes.TXT").unwrap().mime, "text/plain");
        assert!(Part::typed(Bytes::from_static(b"hello"), "archive.zip").is_none());
        assert!(Part::typed(Bytes::from_static(b"hello"), "photo.png").is_none(), "text named .png is no image");
        assert!(Part::typed(Bytes::from_static(b"PK\x03\x04rest"), "a.png").is_none(), "a zip named .png is a zip");
        // Equal bytes, equal digests; another type, another digest.
        assert_eq!(Part::typed(png.clone(), "a").unwrap().digest, Part::typed(png.clone(), "b.png").unwrap().digest);
        assert_ne!(Part::new("image/png".into(), png.clone()).digest, Part::new("image/gif".into(), png).digest);
        assert_eq!(shown("https://h/p.png?X-Goog-Signature=abc"), "https://h/p.png");
        assert_eq!(shown("http://user:SECRET@127.0.0.1:8/a/b.png#x"), "http://127.0.0.1:8/a/b.png");
        assert_eq!(shown("gs://bkt"), "gs://bkt");
        assert_eq!(shown("dir/a?b.png"), "dir/a?b.png");
    }
}
