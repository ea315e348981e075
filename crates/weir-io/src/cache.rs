//! The response cache on disk, in a fjall database (`cache/` in the state directory).
//!
//! Why fjall, a well-kept pure-Rust log-structured merge tree: answers are keyed by a SHA-256,
//! so they arrive in random key order, which a B-tree pays for with a random page write per
//! answer (redb, used before, cost about 18 µs of CPU per answer and two and a half times the
//! answers' size on disk). An LSM tree writes sequentially, and its Bloom filters answer the
//! common case — a request never seen — without reading the disk. Memory is set by the
//! settings below (the tables' filters and indexes add a few bytes per answer). One background
//! worker: with two, fjall's idle worker re-queues compaction requests the busy one holds, and
//! spins (a tenth of a core at 10^6 answers); compaction starts after 16 flushed tables, not 4,
//! because random keys make every compaction rewrite the whole next level. Writes are batched
//! and off the async workers: answers collect in memory and a thread of their own commits them
//! (every 256 answers or 200 ms, handed to the kernel but not synced, so a killed process keeps
//! them; on the disk about once a second and at the end).
//! The cache is an
//! optimisation, never the record of what is finished (the output files are, see
//! [`crate::state`]); a killed process loses at most its last 200 ms of answers, a lost machine
//! its last second, and that costs at most those calls again.

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use weir_core::{CacheKey, ModelResponse, ResponseCache};

const BATCH: usize = 256;
/// Memory for cached blocks of the files on disk. Small: lookups of requests never seen are
/// answered by the Bloom filters without reading blocks, and a hit reads one block, which the
/// operating system usually has in its page cache.
const CACHE_BYTES: u64 = 2 * 1024 * 1024;
/// Answers held in memory before they are written out as a sorted file (fjall's default is
/// 64 MiB, which would be most of weir's memory).
const MEMTABLE_BYTES: u64 = 8 * 1024 * 1024;

/// A response cache in a fjall database (a directory).
pub struct DiskCache {
    shared: Arc<Shared>,
    wake: Mutex<mpsc::Sender<Msg>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    db: Database,
    table: Keyspace,
    /// Answers not yet committed; `get` looks here first.
    /// Shared slices, so the committing thread holds the lock only to copy pointers.
    pending: Mutex<HashMap<CacheKey, Arc<[u8]>>>,
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
    /// The database directory.
    pub path: String,
    /// What failed.
    pub message: String,
}

impl Shared {
    /// Commits what is pending; the entries leave `pending` only once committed, so a lookup
    /// never misses an answer that is on its way to disk.
    fn commit(&self, durable: bool) -> Result<(), fjall::Error> {
        let batch: Vec<(CacheKey, Arc<[u8]>)> = {
            let p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.iter().map(|(k, v)| (*k, v.clone())).collect()
        };
        if !batch.is_empty() {
            let mut b = self.db.batch();
            for (k, v) in &batch {
                b.insert(&self.table, &k[..], &v[..]);
            }
            b.commit()?;
        }
        // Handed to the kernel at every commit (one `write`), so a killed process keeps its
        // answers; on the disk (`fdatasync`) about once a second, against losing the machine.
        self.db.persist(if durable { PersistMode::SyncData } else { PersistMode::Buffer })?;
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        for (k, _) in &batch {
            p.remove(k);
        }
        Ok(())
    }
}

impl DiskCache {
    /// Opens or creates the cache directory, and starts the thread that commits to it.
    pub fn open(path: &Path) -> Result<Self, CacheError> {
        let err = |e: &dyn std::fmt::Display| CacheError { path: path.display().to_string(), message: e.to_string() };
        // Commits reach the disk when the writer thread asks (`persist`), not with each batch.
        let db = Database::builder(path)
            .cache_size(CACHE_BYTES)
            .manual_journal_persist(true)
            .worker_threads(1)
            .open()
            .map_err(|e| match e {
                fjall::Error::Locked => err(&"is in use by another weir process (runs that share a state directory \
                     share its cache; let that one finish, give this run another --state DIR"),
                e => err(&e),
            })?;
        let table = db
            .keyspace("responses", || {
                KeyspaceCreateOptions::default()
                    .max_memtable_size(MEMTABLE_BYTES)
                    .compaction_strategy(Arc::new(fjall::compaction::Leveled::default().with_l0_threshold(16)))
            })
            .map_err(|e| err(&e))?;
        let shared = Arc::new(Shared { db, table, pending: Mutex::new(HashMap::new()) });
        let (tx, rx) = mpsc::channel::<Msg>();
        let s = shared.clone();
        let writer = std::thread::Builder::new()
            .name("weir-cache".into())
            .spawn(move || {
                let report = |r: Result<(), fjall::Error>| {
                    if let Err(e) = r {
                        tracing::warn!("response cache: {e}");
                    }
                };
                loop {
                    match rx.recv_timeout(Duration::from_millis(200)) {
                        Ok(Msg::Batch) | Err(mpsc::RecvTimeoutError::Timeout) => report(s.commit(false)),
                        Ok(Msg::Checkpoint(ack)) => {
                            report(s.commit(true));
                            let _ = ack.send(());
                        }
                        Ok(Msg::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                            report(s.commit(true));
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

impl ResponseCache for DiskCache {
    fn get(&self, key: &CacheKey) -> Option<ModelResponse> {
        let pending = self.shared.pending.lock().unwrap_or_else(|e| e.into_inner()).get(key).cloned();
        if let Some(v) = pending {
            return serde_json::from_slice(&v).ok();
        }
        let value = self.shared.table.get(&key[..]).ok()??;
        serde_json::from_slice(&value).ok()
    }

    fn put(&self, key: CacheKey, response: &ModelResponse) {
        let Ok(bytes) = serde_json::to_vec(response) else { return };
        let full = {
            let mut p = self.shared.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.insert(key, bytes.into());
            p.len() == BATCH
        };
        if full {
            let _ = self.wake.lock().unwrap_or_else(|e| e.into_inner()).send(Msg::Batch);
        }
    }
}

impl Drop for DiskCache {
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
        let path = std::env::temp_dir().join(format!("weir-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        let r = ModelResponse {
            text: "hi".into(),
            finish_reason: "stop".into(),
            usage: Usage { prompt_tokens: 1, output_tokens: 2, total_tokens: 3 },
            model_version: None,
            limits: None,
            embedding: None,
        };
        {
            let c = DiskCache::open(&path).unwrap();
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
        let c = DiskCache::open(&path).unwrap();
        assert_eq!(c.get(&[1; 32]), Some(r));
        let second = DiskCache::open(&path).err().expect("one process at a time");
        assert!(second.to_string().contains("in use by another weir process"), "{second}");
        drop(c);
        std::fs::remove_dir_all(&path).unwrap();
    }
}
