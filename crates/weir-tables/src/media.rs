//! Records' media in buckets (`gs://`, `s3://`): read through the same `object_store` clients,
//! credentials and emulator settings as tables, one client per bucket, and refused by size
//! (from the object's metadata) before any byte is downloaded.

use bytes::Bytes;
use object_store::{ObjectStore, ObjectStoreExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use weir_core::media::{MediaError, MediaLoader, Peek, PEEK_BYTES};
use weir_core::ErrorKind;

use crate::location::{Location, Scheme};

/// An owned environment: variable name → value.
pub type OwnedEnv = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Reads media objects; the environment names credentials and emulators, as for tables.
pub struct BucketMedia {
    env: OwnedEnv,
    stores: Mutex<HashMap<(bool, String), Arc<dyn ObjectStore>>>,
}

impl BucketMedia {
    /// A reader with `env` for credentials (the process's environment, in the binary).
    pub fn new(env: OwnedEnv) -> Self {
        Self { env, stores: Mutex::new(HashMap::new()) }
    }

    fn store(&self, at: &Location) -> Result<Arc<dyn ObjectStore>, String> {
        let key = (at.scheme == Scheme::S3, at.bucket.clone());
        let mut stores = self.stores.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = stores.get(&key) {
            return Ok(s.clone());
        }
        let env = &*self.env;
        let store = at.store(&|k| env(k)).map_err(|e| e.to_string())?;
        stores.insert(key, store.clone());
        Ok(store)
    }
}

/// A store's error as the record's: a missing object or refused credentials will not mend;
/// anything else (the store's own retries spent on timeouts, 5xx, cut connections) may.
fn read_error(e: object_store::Error) -> MediaError {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => MediaError::permanent("no such object"),
        E::PermissionDenied { .. } | E::Unauthenticated { .. } | E::InvalidPath { .. } | E::NotSupported { .. } => {
            MediaError::permanent(format!("cannot be read: {e}"))
        }
        e => MediaError::transient(ErrorKind::Transport, format!("cannot be read: {e}")),
    }
}

#[async_trait::async_trait]
impl MediaLoader for BucketMedia {
    async fn load(&self, source: &str, max: usize) -> Result<Bytes, MediaError> {
        let at = Location::parse(source).map_err(|e| e.to_string())?;
        let store = self.store(&at)?;
        let meta = store.head(&at.path).await.map_err(read_error)?;
        if meta.size > max as u64 {
            return Err(MediaError::too_large(meta.size, max));
        }
        let got = store.get(&at.path).await.map_err(read_error)?;
        got.bytes().await.map_err(read_error)
    }

    async fn peek(&self, source: &str) -> Result<Peek, MediaError> {
        let at = Location::parse(source).map_err(|e| e.to_string())?;
        let store = self.store(&at)?;
        let meta = store.head(&at.path).await.map_err(read_error)?;
        let head = match meta.size.min(PEEK_BYTES) {
            0 => Bytes::new(),
            n => store.get_range(&at.path, 0..n).await.map_err(read_error)?,
        };
        // The store's version of the object, else its ETag, else when and how large it was
        // written: a changed object is another part to the cache.
        let version = meta
            .version
            .or(meta.e_tag)
            .unwrap_or_else(|| format!("{}/{}", meta.last_modified.timestamp_nanos_opt().unwrap_or(0), meta.size));
        Ok(Peek { head, version, size: meta.size })
    }
}
