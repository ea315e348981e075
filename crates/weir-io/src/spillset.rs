//! A set of 128-bit keys that keeps at most a fixed number in memory and the rest in sorted
//! files on the disk.
//!
//! A run checks each record's id against every id before it (a duplicate id is an error row):
//! at 17 bytes a key in a [`KeySet`], 10^7 records would hold 170 MB for that alone, more than
//! everything else a batch run keeps. Here the newest keys are in a `KeySet` of at most `cap`
//! keys; when it is full they are written out, sorted (a `KeySet` iterates in key order), as a
//! run file, with a Bloom filter (10 bits a key) and every 256th key kept in memory. A look-up
//! of a key the set does not hold — nearly every look-up — is answered by the filters; a
//! filter's false positive (about 1 %) costs one read of 4 KiB from each run that has it. Keys
//! are SHA-256 digests, so the filters probe with the key's own bits. The run files are
//! unlinked as soon as they are made: they vanish with the process.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use crate::keyset::KeySet;

/// Keys per block of a run file: one block is read to settle a filter's "maybe".
const BLOCK: usize = 256;
/// Bloom filter probes per key.
const PROBES: u32 = 7;

/// One run of spilled keys, sorted, on the disk.
struct Run {
    file: File,
    len: usize,
    /// The first key of every block.
    fences: Vec<u128>,
    bits: Vec<u64>,
    mask: u64,
}

impl Run {
    fn probes(key: u128, mask: u64) -> impl Iterator<Item = u64> {
        // Two 64-bit halves of a uniform digest, combined (Kirsch–Mitzenmacher).
        let (a, b) = (key as u64, (key >> 64) as u64 | 1);
        (0..PROBES).map(move |i| a.wrapping_add(b.wrapping_mul(u64::from(i))) & mask)
    }

    fn maybe(&self, key: u128) -> bool {
        Self::probes(key, self.mask).all(|bit| self.bits[(bit / 64) as usize] & (1 << (bit % 64)) != 0)
    }

    fn contains(&self, key: u128) -> std::io::Result<bool> {
        if !self.maybe(key) {
            return Ok(false);
        }
        let block = match self.fences.partition_point(|f| *f <= key) {
            0 => return Ok(false),
            i => i - 1,
        };
        let start = block * BLOCK;
        let n = BLOCK.min(self.len - start);
        let mut buf = vec![0u8; n * 16];
        self.file.read_exact_at(&mut buf, (start * 16) as u64)?;
        let keys: Vec<u128> = buf.chunks_exact(16).map(|c| u128::from_le_bytes(c.try_into().expect("16"))).collect();
        Ok(keys.binary_search(&key).is_ok())
    }
}

/// A set of uniformly distributed `u128` keys (digests) in bounded memory.
pub struct SpillSet {
    mem: KeySet,
    cap: usize,
    runs: Vec<Run>,
    dir: PathBuf,
}

impl std::fmt::Debug for SpillSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpillSet").field("in_memory", &self.mem.len()).field("runs", &self.runs.len()).finish()
    }
}

impl SpillSet {
    /// A set that keeps at most `cap` keys in memory, spilling to files in `dir`.
    pub fn new(cap: usize, dir: PathBuf) -> Self {
        Self { mem: KeySet::new(), cap: cap.max(BLOCK), runs: Vec::new(), dir }
    }

    /// A set of at most about 2^20 keys (17 MiB) in memory, spilling to the temporary directory.
    pub fn in_temp() -> Self {
        Self::new(1 << 20, std::env::temp_dir())
    }

    /// Adds `key`; false when it was already there. An error reading or writing a run file is
    /// returned (the caller cannot tell whether the key is new).
    pub fn insert(&mut self, key: u128) -> std::io::Result<bool> {
        if self.contains(&key)? {
            return Ok(false);
        }
        self.mem.insert(key);
        if self.mem.len() >= self.cap {
            self.spill()?;
        }
        Ok(true)
    }

    /// True when `key` is in the set.
    pub fn contains(&self, key: &u128) -> std::io::Result<bool> {
        if self.mem.contains(key) {
            return Ok(true);
        }
        for run in &self.runs {
            if run.contains(*key)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn spill(&mut self) -> std::io::Result<()> {
        let mem = std::mem::take(&mut self.mem);
        let len = mem.len();
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = self.dir.join(format!(".weir-seen-{}-{n}", std::process::id()));
        let file = std::fs::OpenOptions::new().create_new(true).read(true).write(true).open(&path)?;
        // Gone from the directory at once; the open file lives until the set is dropped.
        let _ = std::fs::remove_file(&path);
        let bit_count = (len * 10).next_power_of_two().max(64) as u64;
        let mut run =
            Run { file, len, fences: Vec::new(), bits: vec![0; (bit_count / 64) as usize], mask: bit_count - 1 };
        let mut w = std::io::BufWriter::new(&run.file);
        for (i, key) in mem.iter().enumerate() {
            if i % BLOCK == 0 {
                run.fences.push(key);
            }
            for bit in Run::probes(key, run.mask) {
                run.bits[(bit / 64) as usize] |= 1 << (bit % 64);
            }
            w.write_all(&key.to_le_bytes())?;
        }
        w.flush()?;
        drop(w);
        self.runs.push(run);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    proptest! {
        /// Inserting and looking up keys answers as a `HashSet` does, with a tiny memory cap
        /// so that most keys are in run files.
        #[test]
        fn behaves_as_a_hash_set(ops in proptest::collection::vec((any::<bool>(), any::<u16>(), any::<u128>()), 0..3000)) {
            let mut set = SpillSet::new(300, std::env::temp_dir());
            let mut model = HashSet::new();
            for (insert, low, high) in ops {
                // Repeats: half the keys come from a small pool.
                let key = if low % 2 == 0 { u128::from(low % 200).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835) } else { high };
                if insert {
                    prop_assert_eq!(set.insert(key).unwrap(), model.insert(key));
                } else {
                    prop_assert_eq!(set.contains(&key).unwrap(), model.contains(&key));
                }
            }
            for key in &model {
                prop_assert!(set.contains(key).unwrap());
            }
        }
    }
}
