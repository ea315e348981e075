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
//! Before fjall is asked, an in-memory Bloom filter of the keys stored (see [`KeyFilter`])
//! answers the common miss: fjall's own look-up of a key it does not hold walks its memtables
//! and the filters of every flushed table, which perf put at about 4 % of the driving thread's
//! time at zero latency. The filter is saved beside the database (`cache.keys`) when the cache
//! closes cleanly, and rebuilt from the database's keys after a crash.
//! The cache is an
//! optimisation, never the record of what is finished (the output files are, see
//! [`crate::state`]); a killed process loses at most its last 200 ms of answers, a lost machine
//! its last second, and that costs at most those calls again.

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
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
/// The key filter has room for at least this many keys at 16 bits a key (2 MiB), and for twice
/// the keys already stored.
const FILTER_MIN_KEYS: usize = 1 << 20;
/// The first bytes of a saved key filter.
const FILTER_MAGIC: &[u8; 8] = b"weirkf01";

/// A Bloom filter over cache keys: "certainly not stored" without touching fjall.
///
/// Keys are SHA-256 digests, so their bytes are already uniform: the four probe positions are
/// four of the key's 64-bit words, with no hashing. Bits are set with atomic ORs, so lookups
/// and inserts need no lock. A false positive only costs the fjall look-up that would have been
/// made anyway; there are no false negatives, because a key's bits are set before its answer
/// can be read back (in [`DiskCache::put`], before it enters `pending`).
pub struct KeyFilter {
    words: Box<[AtomicU64]>,
    /// Bit index mask (the number of bits is a power of two).
    mask: u64,
}

impl KeyFilter {
    /// An empty filter with room for `keys` keys at 16 bits a key.
    pub fn with_capacity(keys: usize) -> Self {
        let bits = (keys.max(1) * 16).next_power_of_two().max(64);
        Self::from_words((0..bits / 64).map(|_| AtomicU64::new(0)).collect())
    }

    fn from_words(words: Box<[AtomicU64]>) -> Self {
        let mask = (words.len() as u64 * 64) - 1;
        Self { words, mask }
    }

    /// How many bits the filter has.
    pub fn bits(&self) -> u64 {
        self.mask + 1
    }

    /// The (word, bit) of each of the key's four probes.
    fn probes(&self, key: &CacheKey) -> [(usize, u64); 4] {
        std::array::from_fn(|i| {
            let word: [u8; 8] = key[i * 8..i * 8 + 8].try_into().expect("8 bytes");
            let bit = u64::from_le_bytes(word) & self.mask;
            ((bit / 64) as usize, 1u64 << (bit % 64))
        })
    }

    /// Records `key`.
    pub fn insert(&self, key: &CacheKey) {
        for (w, b) in self.probes(key) {
            self.words[w].fetch_or(b, Ordering::Relaxed);
        }
    }

    /// False if `key` was certainly never inserted.
    pub fn may_contain(&self, key: &CacheKey) -> bool {
        self.probes(key).into_iter().all(|(w, b)| self.words[w].load(Ordering::Relaxed) & b != 0)
    }

    /// The filter's bytes: magic, word count, words (little-endian).
    fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.words.len() * 8);
        out.extend_from_slice(FILTER_MAGIC);
        out.extend_from_slice(&(self.words.len() as u64).to_le_bytes());
        for w in self.words.iter() {
            out.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        out
    }

    /// A filter from [`Self::to_bytes`]; `None` if the bytes are not one.
    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let rest = bytes.strip_prefix(FILTER_MAGIC)?;
        let (n, words) = rest.split_at_checked(8)?;
        let n = u64::from_le_bytes(n.try_into().ok()?) as usize;
        if n == 0 || !n.is_power_of_two() || words.len() != n * 8 {
            return None;
        }
        Some(Self::from_words(
            words.chunks_exact(8).map(|c| AtomicU64::new(u64::from_le_bytes(c.try_into().expect("8 bytes")))).collect(),
        ))
    }
}

/// A response cache in a fjall database (a directory).
pub struct DiskCache {
    shared: Arc<Shared>,
    /// Where the key filter is saved when the cache closes cleanly.
    filter_path: PathBuf,
    wake: Mutex<mpsc::Sender<Msg>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    db: Database,
    table: Keyspace,
    /// Every key stored, or on its way (a superset: see [`KeyFilter`]).
    filter: KeyFilter,
    /// Answers not yet committed; `get` looks here first. Serialised by the committing thread,
    /// not by the caller (the run's driving thread); shared, so that thread holds the lock only
    /// to copy pointers.
    pending: Mutex<HashMap<CacheKey, Arc<ModelResponse>>>,
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
    /// Another process holds the cache (one process holds a cache directory at a time).
    pub in_use: bool,
}

impl Shared {
    /// Commits what is pending; the entries leave `pending` only once committed, so a lookup
    /// never misses an answer that is on its way to disk.
    fn commit(&self, durable: bool) -> Result<(), fjall::Error> {
        let batch: Vec<(CacheKey, Arc<ModelResponse>)> = {
            let p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.iter().map(|(k, v)| (*k, v.clone())).collect()
        };
        if !batch.is_empty() {
            let mut b = self.db.batch();
            for (k, v) in &batch {
                if let Ok(bytes) = serde_json::to_vec(&**v) {
                    b.insert(&self.table, &k[..], bytes);
                }
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
        let err = |e: &dyn std::fmt::Display| CacheError {
            path: path.display().to_string(),
            message: e.to_string(),
            in_use: false,
        };
        // Commits reach the disk when the writer thread asks (`persist`), not with each batch.
        let db = Database::builder(path)
            .cache_size(CACHE_BYTES)
            .manual_journal_persist(true)
            .worker_threads(1)
            .open()
            .map_err(|e| match e {
                fjall::Error::Locked => CacheError {
                    in_use: true,
                    ..err(&"is in use by another weir process (runs that share a state directory share its cache; \
                         let that one finish, or give this run another --state DIR)")
                },
                e => err(&e),
            })?;
        let table = db
            .keyspace("responses", || {
                KeyspaceCreateOptions::default()
                    .max_memtable_size(MEMTABLE_BYTES)
                    .compaction_strategy(Arc::new(fjall::compaction::Leveled::default().with_l0_threshold(16)))
            })
            .map_err(|e| err(&e))?;
        let filter_path = filter_path_of(path);
        let filter = load_filter(&filter_path, &table).map_err(|e| err(&e))?;
        let shared = Arc::new(Shared { db, table, filter, pending: Mutex::new(HashMap::new()) });
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
        Ok(Self { shared, filter_path, wake: Mutex::new(tx), writer: Some(writer) })
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
        if !self.shared.filter.may_contain(key) {
            return None;
        }
        let pending = self.shared.pending.lock().unwrap_or_else(|e| e.into_inner()).get(key).cloned();
        if let Some(v) = pending {
            return Some((*v).clone());
        }
        let value = self.shared.table.get(&key[..]).ok()??;
        serde_json::from_slice(&value).ok()
    }

    fn put(&self, key: CacheKey, response: &ModelResponse) {
        self.shared.filter.insert(&key);
        let full = {
            let mut p = self.shared.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.insert(key, Arc::new(response.clone()));
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
        // Every answer is committed: the filter describes the database as it is left. Written
        // whole and renamed into place, so a crash leaves no half file (and no file means a scan).
        let tmp = self.filter_path.with_extension("keys.tmp");
        let saved = std::fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&self.shared.filter.to_bytes()))
            .and_then(|()| std::fs::rename(&tmp, &self.filter_path));
        if let Err(e) = saved {
            let _ = std::fs::remove_file(&tmp);
            tracing::debug!("response cache: key filter not saved ({e}); the next run rebuilds it");
        }
    }
}

/// `cache.keys` beside the database directory `cache`.
fn filter_path_of(db: &Path) -> PathBuf {
    let mut name = db.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".keys");
    db.with_file_name(name)
}

/// The saved key filter, taken (deleted, so that a process killed later leaves none behind to
/// describe a database it has since written to), or a new one built from the database's keys.
fn load_filter(path: &Path, table: &Keyspace) -> Result<KeyFilter, String> {
    let saved = std::fs::read(path).ok();
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        // A saved filter that cannot be removed could outlive this process's writes: stop.
        Err(e) => return Err(format!("cannot remove {}: {e}", path.display())),
    }
    let stored = table.approximate_len();
    // A saved filter is kept while it has at least 8 bits a key (about 2.4 % false positives);
    // a cache that has outgrown it gets a bigger one.
    if let Some(filter) = saved.as_deref().and_then(KeyFilter::from_bytes).filter(|f| f.bits() >= stored as u64 * 8) {
        return Ok(filter);
    }
    let filter = KeyFilter::with_capacity(FILTER_MIN_KEYS.max(stored * 2));
    for guard in table.iter() {
        let key = guard.key().map_err(|e| e.to_string())?;
        if let Ok(k) = <CacheKey>::try_from(&key[..]) {
            filter.insert(&k);
        }
    }
    Ok(filter)
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
        assert!(filter_path_of(&path).exists(), "a clean close saves the key filter");
        let c = DiskCache::open(&path).unwrap();
        assert!(!filter_path_of(&path).exists(), "taken at open: a crash must not leave a stale one");
        assert_eq!(c.get(&[1; 32]).as_ref(), Some(&r));
        let second = DiskCache::open(&path).err().expect("one process at a time");
        assert!(second.to_string().contains("in use by another weir process"), "{second}");
        drop(c);
        // Without a saved filter (a killed process leaves none) or with a damaged one, the
        // filter is rebuilt from the database: every stored answer is still found.
        for damage in [None, Some(&b"weirkf01 short"[..])] {
            match damage {
                None => std::fs::remove_file(filter_path_of(&path)).unwrap(),
                Some(bytes) => std::fs::write(filter_path_of(&path), bytes).unwrap(),
            }
            let c = DiskCache::open(&path).unwrap();
            assert_eq!(c.get(&[1; 32]).as_ref(), Some(&r));
            for i in 0..300u16 {
                let mut k = [0u8; 32];
                k[..2].copy_from_slice(&i.to_le_bytes());
                k[31] = 9;
                assert!(c.get(&k).is_some(), "key {i} after rebuild");
            }
            assert!(c.get(&[2; 32]).is_none());
        }
        std::fs::remove_dir_all(&path).unwrap();
        let _ = std::fs::remove_file(filter_path_of(&path));
    }

    /// A uniformly random 32-byte key from a counter (SHA-256, as real keys are).
    fn key(i: u64) -> CacheKey {
        use sha2::Digest as _;
        sha2::Sha256::digest(i.to_le_bytes()).into()
    }

    #[test]
    fn key_filter_has_no_false_negatives_and_few_false_positives() {
        let f = KeyFilter::with_capacity(10_000);
        for i in 0..10_000 {
            f.insert(&key(i));
        }
        assert!((0..10_000).all(|i| f.may_contain(&key(i))));
        let false_positives = (10_000..110_000).filter(|&i| f.may_contain(&key(i))).count();
        // 16 bits a key (rounded up to a power of two: ~26 here) and 4 probes: well under 1 %.
        assert!(false_positives < 500, "{false_positives} of 100,000");
        let back = KeyFilter::from_bytes(&f.to_bytes()).expect("round trip");
        assert_eq!(back.bits(), f.bits());
        assert!((0..10_000).all(|i| back.may_contain(&key(i))));
        assert!(KeyFilter::from_bytes(b"weirkf01").is_none());
        let mut bad = f.to_bytes();
        bad.pop();
        assert!(KeyFilter::from_bytes(&bad).is_none(), "a truncated file is not a filter");
    }
}
