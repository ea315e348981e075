//! The response cache on disk, in a redb database (`cache.redb` in the state directory).
//!
//! Why redb: a well-kept, pure-Rust embedded B-tree with crash-safe commits; lookups stay on
//! disk, so memory does not grow with the number of cached answers (an in-memory index over an
//! append-only file would). Writes are batched and off the async workers: answers collect in
//! memory and a thread of their own commits them (every 256 answers or 200 ms, without an fsync;
//! durably about once a second and at the end). The cache is an
//! optimisation, never the record of what is finished (the output files are, see
//! [`crate::state`]); losing its last second to a crash costs at most those calls again.

use redb::{Database, Durability, ReadableDatabase, TableDefinition};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use weir_core::{CacheKey, ModelResponse, ResponseCache};

const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("responses");
const BATCH: usize = 256;
/// Memory redb may use for its page cache.
const CACHE_BYTES: usize = 32 * 1024 * 1024;

/// A response cache in a redb file.
pub struct RedbCache {
    shared: Arc<Shared>,
    wake: Mutex<mpsc::Sender<Msg>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    db: Database,
    /// Answers not yet committed; `get` looks here first.
    pending: Mutex<HashMap<CacheKey, Vec<u8>>>,
}

enum Msg {
    /// A batch is ready.
    Batch,
    /// Commit durably and say when done.
    Checkpoint(mpsc::Sender<()>),
    /// Commit durably and end.
    Stop,
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

impl Shared {
    /// Commits what is pending; the entries leave `pending` only once committed, so a lookup
    /// never misses an answer that is on its way to disk.
    fn commit(&self, durability: Durability) -> Result<(), redb::Error> {
        let batch: Vec<(CacheKey, Vec<u8>)> = {
            let p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if p.is_empty() && matches!(durability, Durability::None) {
                return Ok(());
            }
            p.iter().map(|(k, v)| (*k, v.clone())).collect()
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
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        for (k, _) in &batch {
            p.remove(k);
        }
        Ok(())
    }
}

impl RedbCache {
    /// Opens or creates the cache file, and starts the thread that commits to it.
    pub fn open(path: &Path) -> Result<Self, CacheError> {
        let err = |e: &dyn std::fmt::Display| CacheError { path: path.display().to_string(), message: e.to_string() };
        // redb keeps up to 1 GiB of pages in memory by default, so a large cache would grow the
        // process with the dataset; the pages it needs most fit in far less.
        let db = redb::Builder::new().set_cache_size(CACHE_BYTES).create(path).map_err(|e| err(&e))?;
        let shared = Arc::new(Shared { db, pending: Mutex::new(HashMap::new()) });
        let (tx, rx) = mpsc::channel::<Msg>();
        let s = shared.clone();
        let writer = std::thread::Builder::new()
            .name("weir-cache".into())
            .spawn(move || {
                let report = |r: Result<(), redb::Error>| {
                    if let Err(e) = r {
                        tracing::warn!("response cache: {e}");
                    }
                };
                loop {
                    match rx.recv_timeout(Duration::from_millis(200)) {
                        Ok(Msg::Batch) | Err(mpsc::RecvTimeoutError::Timeout) => report(s.commit(Durability::None)),
                        Ok(Msg::Checkpoint(ack)) => {
                            report(s.commit(Durability::Immediate));
                            let _ = ack.send(());
                        }
                        Ok(Msg::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                            report(s.commit(Durability::Immediate));
                            return;
                        }
                    }
                }
            })
            .map_err(|e| err(&e))?;
        Ok(Self { shared, wake: Mutex::new(tx), writer: Some(writer) })
    }

    /// Makes every answer stored so far durable (waits for the commit).
    pub fn checkpoint(&self) {
        let (ack, done) = mpsc::channel();
        if self.wake.lock().unwrap_or_else(|e| e.into_inner()).send(Msg::Checkpoint(ack)).is_ok() {
            let _ = done.recv();
        }
    }
}

impl ResponseCache for RedbCache {
    fn get(&self, key: &CacheKey) -> Option<ModelResponse> {
        if let Some(v) = self.shared.pending.lock().unwrap_or_else(|e| e.into_inner()).get(key) {
            return serde_json::from_slice(v).ok();
        }
        let txn = self.shared.db.begin_read().ok()?;
        let table = txn.open_table(TABLE).ok()?;
        let value = table.get(&key[..]).ok()??;
        serde_json::from_slice(value.value()).ok()
    }

    fn put(&self, key: CacheKey, response: &ModelResponse) {
        let Ok(bytes) = serde_json::to_vec(response) else { return };
        let full = {
            let mut p = self.shared.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.insert(key, bytes);
            p.len() == BATCH
        };
        if full {
            let _ = self.wake.lock().unwrap_or_else(|e| e.into_inner()).send(Msg::Batch);
        }
    }
}

impl Drop for RedbCache {
    fn drop(&mut self) {
        let _ = self.wake.lock().unwrap_or_else(|e| e.into_inner()).send(Msg::Stop);
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
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
            embedding: None,
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
