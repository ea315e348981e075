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
use sha2::{Digest, Sha256};

/// The most bytes of media one request carries inline: the Gemini API takes requests of up to
/// 20 MB with their inline data, OpenAI images of up to 20 MB, and base64 makes 4 bytes of 3,
/// so 15 MB of media is about 20 MB on the wire.
pub const MAX_INLINE_BYTES: usize = 15 * 1000 * 1000;

/// Why a part of `len` bytes cannot be sent when `max` bytes are left for the request's parts
/// (one wording for every place media is read from).
pub fn too_large(len: u64, max: usize) -> String {
    format!("{len} bytes, over the {max} bytes left for {INLINE}")
}

/// Why a part of `len` bytes (or more than `max`, when its size was not known) cannot be
/// uploaded either.
pub fn too_large_to_upload(len: Option<u64>, max: usize) -> String {
    match len {
        Some(len) => format!("{len} bytes, over the {max} bytes an upload takes"),
        None => format!("more than the {max} bytes an upload takes"),
    }
}

/// What the inline limit is, for messages.
const INLINE: &str = "a request's inline parts (15 MB in all, 20 MB as base64)";

/// A record's media field: which field, and what it names or holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaRef {
    /// The field (or column) it came from, named in errors.
    pub field: String,
    /// Where the part's bytes are.
    pub source: MediaSource,
    /// Its MIME type as given (`--media-field FIELD:TYPE`), in place of the one its content
    /// says; one of [`TAKEN`].
    pub mime: Option<String>,
}

/// A media field as given on the command line: `FIELD`, or `FIELD:TYPE` with a MIME type that
/// overrides the content's (`scan:application/pdf`). `Err` says what to fix.
pub fn field_spec(spec: &str) -> Result<(String, Option<String>), String> {
    match spec.rsplit_once(':') {
        Some((field, mime)) if mime.contains('/') => {
            let mime = mime.trim().to_ascii_lowercase();
            if field.trim().is_empty() {
                return Err(format!("'{spec}' names no field before the type"));
            }
            if !TAKEN.contains(&mime.as_str()) {
                return Err(format!("'{mime}' is not a type the providers take as a part ({})", TAKEN.join(", ")));
            }
            Ok((field.to_string(), Some(mime)))
        }
        _ if spec.trim().is_empty() => Err("a media field needs a name".into()),
        _ => Ok((spec.to_string(), None)),
    }
}

/// Where a part's bytes are: named by the field, or the field's own value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MediaSource {
    /// A file path, `https://…` (or `http://` on loopback), `gs://…` or `s3://…`, read when
    /// the record is sent.
    Named(String),
    /// The bytes themselves: a Parquet binary column, a Python `bytes` value, or JSON
    /// `{"base64": "…"}`.
    Bytes(Bytes),
}

impl MediaSource {
    /// What may be shown of it in an error: a name without secrets, or the size of bytes
    /// (never the bytes).
    pub fn shown(&self) -> String {
        match self {
            Self::Named(s) => shown(s),
            Self::Bytes(b) => format!("{} bytes in the record", b.len()),
        }
    }
}

/// A field's value as media: a non-empty string names it; `{"base64": "…"}` (how bytes read
/// from a table reach a record, and how JSON carries bytes) holds it. `Err` says why the value
/// is neither; `Ok(None)` is no part: a null or empty value (an empty CSV cell, an empty SQL
/// or Python value: every front end reads "nothing here" the same way). A field the record
/// lacks altogether is the caller's to refuse: it is more often a misspelt name than a record
/// without media.
pub fn source_of(value: Option<&serde_json::Value>) -> Result<Option<MediaSource>, &'static str> {
    use base64::Engine;
    use serde_json::Value;
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(MediaSource::Named(s.trim().to_string()))),
        Some(Value::Object(o)) if o.len() == 1 && o.contains_key("base64") => {
            let text = o["base64"].as_str().ok_or("has a \"base64\" that is not a string")?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|_| "has a \"base64\" that is not base64")?;
            Ok((!bytes.is_empty()).then(|| MediaSource::Bytes(Bytes::from(bytes))))
        }
        Some(_) => Err("is not a file path, a URL or bytes"),
    }
}

/// One part of a request, read and typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Its MIME type (`image/png`, `application/pdf`, …).
    pub mime: String,
    /// Its bytes (empty for a part sent by reference).
    pub data: Bytes,
    /// A digest of `mime` and the bytes (or of the reference and its version), for the
    /// response cache.
    pub digest: [u8; 32],
    /// Where the endpoint reads the part itself (Vertex AI reads `gs://` objects): sent as a
    /// reference (`fileData`), not inline.
    pub uri: Option<String>,
}

impl Part {
    /// A part of `data`, typed from its content (magic numbers), else from `name`'s extension.
    /// `None` when neither says a type a provider takes.
    pub fn typed(data: Bytes, name: &str) -> Option<Self> {
        Some(Self::new(mime_of(&data, name)?.to_string(), data))
    }

    /// As [`Part::typed`], or of the type `given` when one was (the user's word over the
    /// content's).
    pub fn typed_as(data: Bytes, name: &str, given: Option<&str>) -> Option<Self> {
        match given {
            Some(m) => Some(Self::new(m.to_string(), data)),
            None => Self::typed(data, name),
        }
    }

    /// A part of `data` of type `mime`.
    pub fn new(mime: String, data: Bytes) -> Self {
        let mut h = Sha256::new();
        h.update(mime.as_bytes());
        h.update([0]);
        h.update(&data);
        Self { mime, data, digest: h.finalize().into(), uri: None }
    }

    /// A part the endpoint reads itself from `uri`, typed from its first bytes `head` (else from
    /// its name); `version` (the object's ETag or generation) makes a changed object another
    /// part to the cache, as changed bytes are. `None` when no type a provider takes is found.
    pub fn by_reference(uri: &str, head: &[u8], version: &str, given: Option<&str>) -> Option<Self> {
        let mime = match given {
            Some(m) => m.to_string(),
            None => mime_of(head, uri)?.to_string(),
        };
        let mut h = Sha256::new();
        for piece in [mime.as_bytes(), b"\0uri\0", uri.as_bytes(), b"\0", version.as_bytes()] {
            h.update(piece);
        }
        Some(Self { mime, data: Bytes::new(), digest: h.finalize().into(), uri: Some(uri.to_string()) })
    }
}

/// The type of content starting with `head`, else (for text, which has no signature) the one
/// `name`'s extension says.
fn mime_of(head: &[u8], name: &str) -> Option<&'static str> {
    // Content that says its type is taken at its word (a zip named `.png` is a zip); the name
    // is trusted only for text, which has no signature (text named `.png` is not an image, and
    // a provider would refuse the call after it was paid for).
    match infer::get(head) {
        Some(_) => sniff(head),
        None => by_extension(name).filter(|m| *m == "text/plain"),
    }
}

/// What a loader tells of media an endpoint reads by reference, without downloading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peek {
    /// The first bytes (enough to tell the type).
    pub head: Bytes,
    /// The object's version (ETag, generation): another version is another part.
    pub version: String,
    /// Its size in bytes.
    pub size: u64,
}

/// How many first bytes of an object tell its type (the longest signature `infer` reads).
pub const PEEK_BYTES: u64 = 8192;

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

/// Why media could not be read: in words for an error row (never a secret: a signed URL's
/// query is left out), and whether trying again later may read it (a timeout, a server's 5xx)
/// or not (no such file, a type no provider takes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaError {
    /// What went wrong.
    pub message: String,
    /// `Timeout`, `Transport` or `Server` for a failure that may pass (the record's error row
    /// is then retryable: `--retry-errors` tries it again); `InvalidInput` otherwise.
    pub kind: crate::ErrorKind,
    /// The media is larger than the bytes asked for (it may go by upload where the endpoint
    /// takes uploads).
    pub over: bool,
    /// The media's size, when `over` and it was known: the upload path, with a larger limit,
    /// words its own refusal from it rather than the inline limit's.
    pub len: Option<u64>,
}

impl MediaError {
    /// A failure that trying again will not mend.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self { message: message.into(), kind: crate::ErrorKind::InvalidInput, over: false, len: None }
    }

    /// A failure that may pass: `kind` is `Timeout`, `Transport` or `Server`.
    pub fn transient(kind: crate::ErrorKind, message: impl Into<String>) -> Self {
        Self { message: message.into(), kind, over: false, len: None }
    }

    /// Media of `len` bytes where at most `max` were asked for.
    pub fn too_large(len: u64, max: usize) -> Self {
        Self { over: true, len: Some(len), ..Self::permanent(too_large(len, max)) }
    }

    /// Media whose size is not known (a URL's body with no length) found longer than `max` as
    /// it was read: the bytes read so far are not its size.
    pub fn too_large_unsized(max: usize) -> Self {
        Self { over: true, ..Self::permanent(format!("more than the {max} bytes left for {INLINE}")) }
    }

    /// Whether trying again later may succeed.
    pub fn is_transient(&self) -> bool {
        self.kind != crate::ErrorKind::InvalidInput
    }
}

impl From<String> for MediaError {
    fn from(message: String) -> Self {
        Self::permanent(message)
    }
}

impl From<&str> for MediaError {
    fn from(message: &str) -> Self {
        Self::permanent(message)
    }
}

/// The turn for large parts: one record's parts too large to go inline are read and uploaded
/// at a time in the process, so memory holds at most those beside the inline parts in flight.
pub type Turn = tokio::sync::MutexGuard<'static, ()>;

/// Where a part too large to go inline may go instead (an upload), for
/// [`MediaLoader::load_or_spill`].
pub struct Spill {
    /// The most bytes an upload takes.
    pub max: usize,
    /// The turn to take before reading past the inline limit; `None` when the caller holds it.
    pub turn: Option<&'static tokio::sync::Mutex<()>>,
}

/// What [`MediaLoader::load_or_spill`] read.
pub struct Loaded {
    /// The bytes.
    pub bytes: Bytes,
    /// More than the inline limit: the part goes by upload.
    pub spilled: bool,
    /// The turn for large parts, when it was taken to read past the inline limit.
    pub turn: Option<Turn>,
}

impl Loaded {
    /// Bytes read within the inline limit, with no turn taken.
    pub fn whole(bytes: Bytes) -> Self {
        Self { bytes, spilled: false, turn: None }
    }
}

/// Reads what media fields name. The front end gives the driver one (files, URLs, buckets);
/// the driver calls it when a record is about to be sent.
#[async_trait::async_trait]
pub trait MediaLoader: Send + Sync {
    /// The bytes `source` names, at most `max` of them, or why not.
    async fn load(&self, source: &str, max: usize) -> Result<Bytes, MediaError>;

    /// Like [`load`](Self::load), for a caller that can upload what is too large to go inline.
    /// A source whose size shows only as it is read (a URL answered with no Content-Length)
    /// and that passes `max` is read on, up to `spill.max`, in the turn for large parts when
    /// that turn comes soon (the loader decides how long to wait): otherwise the bytes read so
    /// far are dropped and read again from the start in that turn. The default reads as
    /// `load` does, for sources whose size is known before their bytes are read (files,
    /// bucket objects).
    async fn load_or_spill(&self, source: &str, max: usize, _spill: Option<&Spill>) -> Result<Loaded, MediaError> {
        Ok(Loaded::whole(self.load(source, max).await?))
    }

    /// The first bytes, version and size of `source`, for an endpoint that reads it by
    /// reference ([`crate::ModelHandler::reads_by_reference`]); only bucket objects have them.
    async fn peek(&self, _source: &str) -> Result<Peek, MediaError> {
        Err(MediaError::permanent("not read by reference here"))
    }
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
    fn a_field_may_give_its_type() {
        assert_eq!(field_spec("photo").unwrap(), ("photo".into(), None));
        assert_eq!(field_spec("scan:Application/PDF").unwrap(), ("scan".into(), Some("application/pdf".into())));
        assert_eq!(field_spec("a:b").unwrap(), ("a:b".into(), None), "no type without a slash");
        assert!(field_spec("x:application/zip").unwrap_err().contains("not a type"));
        assert!(field_spec(":image/png").is_err());
        assert!(field_spec(" ").is_err());
        let p = Part::typed_as(Bytes::from_static(b"plain"), "", Some("application/pdf")).unwrap();
        assert_eq!(p.mime, "application/pdf");
    }

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
