//! The response cache as every front end opens it (`weir run` and `weir sql` in their state
//! directory, Python in `.weir/` or its `cache_dir`): once per directory per process, so that
//! two engines or runs of one process share it, while another process that holds it is told
//! apart (`CacheError::in_use`) for the caller to go on without it or to refuse.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use weir_io::{CacheError, DiskCache};

/// The caches this process has open, by directory.
fn open_caches() -> &'static Mutex<HashMap<PathBuf, Weak<DiskCache>>> {
    static OPEN: OnceLock<Mutex<HashMap<PathBuf, Weak<DiskCache>>>> = OnceLock::new();
    OPEN.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The response cache in `dir` (made if missing): the one this process already has open
/// there, or opened now.
pub fn open_cache(dir: &Path) -> Result<Arc<DiskCache>, CacheError> {
    let fail =
        |e: std::io::Error| CacheError { path: dir.display().to_string(), message: e.to_string(), in_use: false };
    std::fs::create_dir_all(dir).map_err(fail)?;
    let path = std::fs::canonicalize(dir).map_err(fail)?;
    let mut open = open_caches().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = open.get(&path).and_then(Weak::upgrade) {
        return Ok(c);
    }
    let cache = Arc::new(DiskCache::open(&path)?);
    open.retain(|_, w| w.strong_count() > 0);
    open.insert(path, Arc::downgrade(&cache));
    Ok(cache)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One process opens a directory's cache once: a second opener gets the same cache (two
    /// engines of one process), and once nothing holds it, it is opened again.
    #[test]
    fn a_process_opens_a_cache_once() {
        let dir = std::env::temp_dir().join(format!("weir-runtime-cache-{}", std::process::id()));
        let a = open_cache(&dir).unwrap();
        let b = open_cache(&dir.join(".").join("")).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "two caches of one directory in one process");
        drop((a, b));
        let c = open_cache(&dir);
        assert!(c.is_ok(), "reopened after release: {:?}", c.err());
        drop(c);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
