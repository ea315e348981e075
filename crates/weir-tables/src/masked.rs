//! An object store whose errors never show the credentials it signs with. object_store puts a
//! server's error body in its messages; a proxy or an S3-compatible server that echoes the
//! request's headers there (`x-amz-security-token`, `Credential=AKIA…`) would put them in error
//! rows, reports and the terminal. Every store weir opens is wrapped, so no message built from
//! its errors, anywhere, needs to remember to mask.

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, UploadPart,
};
use std::ops::Range;
use std::sync::Arc;
use weir_core::secret::{mask, Secret};

/// `inner` with `secrets` (and any `Bearer` token) masked in every error it returns.
#[derive(Debug)]
pub(crate) struct Masked {
    inner: Arc<dyn ObjectStore>,
    secrets: Arc<[Secret]>,
}

impl Masked {
    /// Wraps `inner`; `secrets` are the credentials it was given (an access key id, a secret, a
    /// session token). Tokens the store fetches itself are masked where they follow `Bearer`.
    pub(crate) fn wrap(inner: Arc<dyn ObjectStore>, secrets: Vec<String>) -> Arc<dyn ObjectStore> {
        let secrets = secrets.into_iter().filter(|s| !s.is_empty()).map(Secret::new).collect();
        Arc::new(Self { inner, secrets })
    }
}

impl std::fmt::Display for Masked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

/// A message whose text was masked, in place of the error that held the secret.
#[derive(Debug)]
struct MaskedText(String);

impl std::fmt::Display for MaskedText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MaskedText {}

/// `text` with `secrets` masked, and whatever follows `Bearer ` (a token the store fetched).
fn masked_text(text: &str, secrets: &[Secret]) -> String {
    let mut out = mask(text, secrets);
    let mut from = 0;
    while let Some(at) = out[from..].find("Bearer ").map(|i| from + i + "Bearer ".len()) {
        let end = out[at..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || "-._~+/=".contains(c)))
            .map_or(out.len(), |i| at + i);
        if end > at {
            out.replace_range(at..end, "***");
        }
        from = at;
    }
    out
}

/// `e` with its message masked; its kind (not found, refused, …) is kept, as callers tell a
/// missing object from an unreachable store by it.
fn masked_error(e: object_store::Error, secrets: &[Secret]) -> object_store::Error {
    use object_store::Error as E;
    let text = e.to_string();
    let shown = masked_text(&text, secrets);
    if shown == text {
        return e;
    }
    let source = |s: Box<dyn std::error::Error + Send + Sync>| -> Box<dyn std::error::Error + Send + Sync> {
        Box::new(MaskedText(masked_text(&s.to_string(), secrets)))
    };
    match e {
        E::NotFound { path, source: s } => E::NotFound { path, source: source(s) },
        E::PermissionDenied { path, source: s } => E::PermissionDenied { path, source: source(s) },
        E::Unauthenticated { path, source: s } => E::Unauthenticated { path, source: source(s) },
        E::AlreadyExists { path, source: s } => E::AlreadyExists { path, source: source(s) },
        E::Precondition { path, source: s } => E::Precondition { path, source: source(s) },
        E::NotModified { path, source: s } => E::NotModified { path, source: source(s) },
        E::Generic { store, source: s } => E::Generic { store, source: source(s) },
        _ => E::Generic { store: "object store", source: Box::new(MaskedText(shown)) },
    }
}

type Result<T> = object_store::Result<T>;

impl Masked {
    fn mask<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| masked_error(e, &self.secrets))
    }

    fn masked_stream<T: Send + 'static>(&self, s: BoxStream<'static, Result<T>>) -> BoxStream<'static, Result<T>> {
        let secrets = self.secrets.clone();
        s.map(move |r| r.map_err(|e| masked_error(e, &secrets))).boxed()
    }
}

#[async_trait::async_trait]
impl ObjectStore for Masked {
    async fn put_opts(&self, location: &Path, payload: PutPayload, opts: PutOptions) -> Result<PutResult> {
        self.mask(self.inner.put_opts(location, payload, opts).await)
    }

    async fn put_multipart_opts(&self, location: &Path, opts: PutMultipartOptions) -> Result<Box<dyn MultipartUpload>> {
        let upload = self.mask(self.inner.put_multipart_opts(location, opts).await)?;
        Ok(Box::new(MaskedUpload { inner: upload, secrets: self.secrets.clone() }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let mut got = self.mask(self.inner.get_opts(location, options).await)?;
        got.payload = match got.payload {
            GetResultPayload::Stream(s) => GetResultPayload::Stream(self.masked_stream(s)),
            file => file,
        };
        Ok(got)
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.mask(self.inner.get_ranges(location, ranges).await)
    }

    fn delete_stream(&self, locations: BoxStream<'static, Result<Path>>) -> BoxStream<'static, Result<Path>> {
        self.masked_stream(self.inner.delete_stream(locations))
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.masked_stream(self.inner.list(prefix))
    }

    fn list_with_offset(&self, prefix: Option<&Path>, offset: &Path) -> BoxStream<'static, Result<ObjectMeta>> {
        self.masked_stream(self.inner.list_with_offset(prefix, offset))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.mask(self.inner.list_with_delimiter(prefix).await)
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.mask(self.inner.copy_opts(from, to, options).await)
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        self.mask(self.inner.rename_opts(from, to, options).await)
    }
}

/// A multipart upload whose errors are masked as the store's are.
#[derive(Debug)]
struct MaskedUpload {
    inner: Box<dyn MultipartUpload>,
    secrets: Arc<[Secret]>,
}

#[async_trait::async_trait]
impl MultipartUpload for MaskedUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        let secrets = self.secrets.clone();
        self.inner.put_part(data).map(move |r| r.map_err(|e| masked_error(e, &secrets))).boxed()
    }

    async fn complete(&mut self) -> Result<PutResult> {
        self.inner.complete().await.map_err(|e| masked_error(e, &self.secrets))
    }

    async fn abort(&mut self) -> Result<()> {
        self.inner.abort().await.map_err(|e| masked_error(e, &self.secrets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_a_store_error_are_masked_and_its_kind_kept() {
        let secrets: Vec<Secret> =
            ["AKIASECRETabc123XYZ", "SECRET-sess-abc123XYZ"].iter().map(|s| Secret::new(s.to_string())).collect();
        let body = r#"400 Bad Request: {"x-amz-security-token": "SECRET-sess-abc123XYZ", "authorization": "AWS4-HMAC-SHA256 Credential=AKIASECRETabc123XYZ/20261203/us-east-1/s3/aws4_request", "x": "Bearer ya29.a0Af-_x/y="}"#;
        let e = object_store::Error::NotFound { path: "b/x".into(), source: Box::new(MaskedText(body.into())) };
        let e = masked_error(e, &secrets);
        let shown = e.to_string();
        assert!(matches!(e, object_store::Error::NotFound { .. }), "{shown}");
        for s in ["AKIASECRET", "SECRET-sess", "ya29"] {
            assert!(!shown.contains(s), "{shown}");
        }
        assert!(shown.contains("Credential=***/20261203") && shown.contains("Bearer ***\""), "{shown}");
    }
}
