//! Records' media in buckets (`gs://`, `s3://`): read through the same `object_store` clients,
//! credentials and emulator settings as tables, one client per bucket, and refused by size
//! (from the object's metadata) before any byte is downloaded.

use bytes::Bytes;
use object_store::{ObjectStore, ObjectStoreExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use weir_core::media::MediaLoader;

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

#[async_trait::async_trait]
impl MediaLoader for BucketMedia {
    async fn load(&self, source: &str, max: usize) -> Result<Bytes, String> {
        let at = Location::parse(source).map_err(|e| e.to_string())?;
        let store = self.store(&at)?;
        let meta = store.head(&at.path).await.map_err(|e| match e {
            object_store::Error::NotFound { .. } => "no such object".to_string(),
            e => format!("cannot be read: {e}"),
        })?;
        if meta.size > max as u64 {
            return Err(weir_core::media::too_large(meta.size, max));
        }
        let got = store.get(&at.path).await.map_err(|e| format!("cannot be read: {e}"))?;
        got.bytes().await.map_err(|e| format!("cannot be read: {e}"))
    }
}
