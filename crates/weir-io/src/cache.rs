//! The response cache on disk, in a redb database (`cache.redb` in the state directory).
//!
//! Why redb: a well-kept, pure-Rust embedded B-tree with crash-safe commits; lookups stay on
//! disk, so memory does not grow with the number of cached answers (an in-memory index over an
//! append-only file would). Writes are batched: answers collect in memory and are committed every
//! 256 answers without an fsync, and durably about once a second and at the end. The cache is an
//! optimisation, never the record of what is finished (the output files are, see
//! [`crate::state`]); losing its last second to a crash costs at most those calls again.

use redb::{Database, Durability, ReadableDatabase, TableDefinition};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use weir_core::{CacheKey, ModelResponse, ResponseCache};

const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("responses");
const BATCH: usize = 256;

/// A response cache in a redb file.
pub struct RedbCache {
    db: Database,
    pending: Mutex<HashMap<CacheKey, Vec<u8>>>,
}

/// Why the cache cannot be opened.
#[derive(Debug, thiserror::Error)]
#[error("response cache {path}: {message}")]
pub struct CacheError {
    /// The database file.
    pub path: String,
    /// What failed.
    pub message: String,
}

impl RedbCache {
    /// Opens or creates the cache file.
    pub fn open(path: &Path) -> Result<Self, CacheError> {
        let err = |e: &dyn std::fmt::Display| CacheError { path: path.display().to_string(), message: e.to_string() };
        let db = Database::create(path).map_err(|e| err(&e))?;
        Ok(Self { db, pending: Mutex::new(HashMap::new()) })
    }

    fn commit(&self, durability: Durability) -> Result<(), redb::Error> {
        let batch: Vec<(CacheKey, Vec<u8>)> = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if p.is_empty() && matches!(durability, Durability::None) {
                return Ok(());
            }
            p.drain().collect()
        };
        let mut txn = self.db.begin_write()?;
        txn.set_durability(durability)?;
        {
            let mut table = txn.open_table(TABLE)?;
            for (k, v) in &batch {
                table.insert(&k[..], &v[..])?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Makes every answer stored so far durable.
    pub fn checkpoint(&self) {
        if let Err(e) = self.commit(Durability::Immediate) {
            tracing::warn!("response cache: {e}");
        }
    }
}

impl ResponseCache for RedbCache {
    fn get(&self, key: &CacheKey) -> Option<ModelResponse> {
        if let Some(v) = self.pending.lock().unwrap_or_else(|e| e.into_inner()).get(key) {
            return serde_json::from_slice(v).ok();
        }
        let txn = self.db.begin_read().ok()?;
        let table = txn.open_table(TABLE).ok()?;
        let value = table.get(&key[..]).ok()??;
        serde_json::from_slice(value.value()).ok()
    }

    fn put(&self, key: CacheKey, response: &ModelResponse) {
        let Ok(bytes) = serde_json::to_vec(response) else { return };
        let full = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.insert(key, bytes);
            p.len() >= BATCH
        };
        if full {
            if let Err(e) = self.commit(Durability::None) {
                tracing::warn!("response cache: {e}");
            }
        }
    }
}

impl Drop for RedbCache {
    fn drop(&mut self) {
        self.checkpoint();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_core::Usage;

    #[test]
    fn answers_survive_reopening() {
        let path = std::env::temp_dir().join(format!("weir-cache-{}.redb", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let r = ModelResponse {
            text: "hi".into(),
            finish_reason: "stop".into(),
            usage: Usage { prompt_tokens: 1, output_tokens: 2, total_tokens: 3 },
            model_version: None,
            limits: None,
        };
        {
            let c = RedbCache::open(&path).unwrap();
            assert!(c.get(&[1; 32]).is_none());
            c.put([1; 32], &r);
            assert_eq!(c.get(&[1; 32]).as_ref(), Some(&r), "pending answers are visible");
            for i in 0..300u16 {
                let mut k = [0u8; 32];
                k[..2].copy_from_slice(&i.to_le_bytes());
                k[31] = 9;
                c.put(k, &r);
            }
        }
        let c = RedbCache::open(&path).unwrap();
        assert_eq!(c.get(&[1; 32]), Some(r));
        drop(c);
        std::fs::remove_file(&path).unwrap();
    }
}
