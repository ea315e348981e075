//! A bucket prefix where batch jobs are staged (`--job-bucket gs://BUCKET/PREFIX`): the job's
//! input is written there, and the provider's output directory read back, through the same
//! `object_store` clients, credentials and emulator settings as tables use.

use futures::TryStreamExt;
use object_store::buffered::BufWriter;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use weir_core::{ErrorKind, JobInput, JobStaging, LineSplitter, ModelError};

use crate::location::{Env, Location};
use crate::TableError;

/// A staging prefix in a bucket.
pub struct BucketStaging {
    at: Location,
    store: Arc<dyn ObjectStore>,
}

impl BucketStaging {
    /// Connects to the bucket of `url` (`gs://` or `s3://`; a local directory works too, for
    /// providers that read local files).
    pub fn open(url: &str, env: Env) -> Result<Self, TableError> {
        let at = Location::parse(url.trim_end_matches('/'))?;
        let store = at.store(env)?;
        Ok(Self { at, store })
    }

    /// The object path of `url`, which must be in this staging's bucket.
    fn path_of(&self, url: &str) -> Result<ObjectPath, ModelError> {
        let other = Location::parse(url.trim_end_matches('/')).map_err(|e| bad(&e.to_string()))?;
        if other.scheme != self.at.scheme || other.bucket != self.at.bucket {
            return Err(bad(&format!("{url} is not in the staging bucket {}", self.at.display)));
        }
        Ok(other.path)
    }
}

fn bad(message: &str) -> ModelError {
    ModelError::new(ErrorKind::BadRequest, format!("job staging: {message}"))
}

/// A store's failure: a missing object or a refusal is the command's to fix, the rest may pass.
fn failed(what: &str, e: object_store::Error) -> ModelError {
    let kind = match e {
        object_store::Error::NotFound { .. }
        | object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => ErrorKind::BadRequest,
        _ => ErrorKind::Server,
    };
    ModelError::new(kind, format!("job staging: {what}: {e}"))
}

#[async_trait::async_trait]
impl JobStaging for BucketStaging {
    fn url_of(&self, name: &str) -> String {
        let path = self.at.path.as_ref();
        let joined = if path.is_empty() { name.to_string() } else { format!("{path}/{name}") };
        self.at.url_of(&ObjectPath::from(joined))
    }

    async fn put(&self, name: &str, input: &JobInput) -> Result<(), ModelError> {
        let url = self.url_of(name);
        let path = self.path_of(&url)?;
        // Up to 10 MB in one request, larger inputs in parts of that size: never the whole file
        // in memory (a Vertex AI job's input may be a gigabyte).
        let mut file = tokio::fs::File::open(&input.path).await.map_err(|e| {
            ModelError::new(ErrorKind::InvalidInput, format!("job input {}: {e}", input.path.display()))
        })?;
        let mut out = BufWriter::new(self.store.clone(), path);
        let copied = tokio::io::copy(&mut file, &mut out).await;
        match copied {
            Ok(_) => {
                out.shutdown().await.map_err(|e| ModelError::new(ErrorKind::Server, format!("job staging: {url}: {e}")))
            }
            Err(e) => {
                // The parts written so far are let go.
                let _ = out.abort().await;
                Err(ModelError::new(ErrorKind::Server, format!("job staging: {url}: {e}")))
            }
        }
    }

    async fn read_lines(&self, url: &str, each: &mut (dyn for<'a> FnMut(&'a [u8]) + Send)) -> Result<(), ModelError> {
        let dir = self.path_of(url)?;
        let mut metas: Vec<_> =
            self.store.list(Some(&dir)).try_collect().await.map_err(|e| failed(&format!("listing {url}"), e))?;
        metas.sort_by(|a, b| a.location.cmp(&b.location));
        for m in metas {
            let at = || self.at.url_of(&m.location);
            let got = self.store.get(&m.location).await.map_err(|e| failed(&at(), e))?;
            let mut chunks = got.into_stream();
            let mut lines = LineSplitter::default();
            while let Some(chunk) = chunks.try_next().await.map_err(|e| failed(&at(), e))? {
                lines.push(&chunk, each);
            }
            lines.finish(each);
        }
        Ok(())
    }

    async fn delete(&self, url: &str) {
        if let Ok(path) = self.path_of(url) {
            if let Err(e) = self.store.delete(&path).await {
                tracing::debug!("could not delete the staged {url}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job input larger than one part (10 MB) is staged in parts, from the disk, and read
    /// back line by line whole: every line, in order, none cut at a chunk's edge.
    #[tokio::test]
    async fn a_large_input_is_staged_in_parts_and_read_back_line_by_line() {
        let root = std::env::temp_dir().join(format!("weir-staging-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("bucket")).unwrap();
        let mut body = Vec::new();
        let lines = 200_000;
        for i in 0..lines {
            body.extend_from_slice(format!("{{\"content\":\"line {i} {}\"}}\n", "x".repeat(i % 200)).as_bytes());
        }
        assert!(body.len() > 20 * 1000 * 1000, "{} bytes: more than two parts", body.len());
        let file = root.join("s0.body");
        std::fs::write(&file, &body).unwrap();
        let input = JobInput { path: file, len: body.len() as u64, count: lines };
        let env: Env = &|_| None;
        let staging = BucketStaging::open(root.join("bucket").to_str().unwrap(), env).unwrap();
        staging.put("job-1/input.jsonl", &input).await.unwrap();
        assert_eq!(std::fs::read(root.join("bucket/job-1/input.jsonl")).unwrap(), body);
        let mut seen = 0usize;
        let mut each = |l: &[u8]| {
            let want = format!("{{\"content\":\"line {seen} {}\"}}", "x".repeat(seen % 200));
            assert_eq!(l, want.as_bytes());
            seen += 1;
        };
        staging.read_lines(&staging.url_of("job-1"), &mut each).await.unwrap();
        assert_eq!(seen, lines);
        // An input gone from the disk is an error, and leaves nothing staged.
        let gone = JobInput { path: root.join("missing.body"), len: 1, count: 1 };
        assert!(staging.put("job-2/input.jsonl", &gone).await.is_err());
        assert!(!root.join("bucket/job-2/input.jsonl").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
