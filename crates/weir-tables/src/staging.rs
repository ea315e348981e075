//! A bucket prefix where batch jobs are staged (`--job-bucket gs://BUCKET/PREFIX`): the job's
//! input is written there, and the provider's output directory read back, through the same
//! `object_store` clients, credentials and emulator settings as tables use.

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use std::sync::Arc;
use weir_core::{ErrorKind, JobStaging, ModelError};

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

    async fn put(&self, name: &str, data: Vec<u8>) -> Result<(), ModelError> {
        let url = self.url_of(name);
        let path = self.path_of(&url)?;
        self.store.put(&path, PutPayload::from(data)).await.map_err(|e| failed(&url, e))?;
        Ok(())
    }

    async fn read_dir(&self, url: &str) -> Result<Vec<Vec<u8>>, ModelError> {
        let dir = self.path_of(url)?;
        let mut metas: Vec<_> =
            self.store.list(Some(&dir)).try_collect().await.map_err(|e| failed(&format!("listing {url}"), e))?;
        metas.sort_by(|a, b| a.location.cmp(&b.location));
        let mut out = Vec::with_capacity(metas.len());
        for m in metas {
            let got = self.store.get(&m.location).await.map_err(|e| failed(&self.at.url_of(&m.location), e))?;
            let bytes = got.bytes().await.map_err(|e| failed(&self.at.url_of(&m.location), e))?;
            out.push(bytes.to_vec());
        }
        Ok(out)
    }

    async fn delete(&self, url: &str) {
        if let Ok(path) = self.path_of(url) {
            if let Err(e) = self.store.delete(&path).await {
                tracing::debug!("could not delete the staged {url}: {e}");
            }
        }
    }
}
