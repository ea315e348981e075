//! A set of 128-bit keys in about 17 bytes each.
//!
//! A run remembers one key per record twice over: the ids it has seen (to reject a duplicate
//! id) and, when resuming, the records already finished. A `HashSet<u128>` spends 35–50 bytes
//! a key and, when it grows, briefly holds its old table and a new one twice the size — at
//! 10^6 records that was 53 MB of a run's peak memory. The keys are SHA-256 digests, so they
//! are spread evenly: their top bits pick one of a fixed number of small sorted vectors, and a
//! lookup is a binary search in a few hundred bytes. The vectors grow by an eighth at a time,
//! so nothing is ever allocated twice over, and the slack stays near 6 %.

/// Vectors the keys are spread over (their top 14 bits choose one).
const BUCKETS: usize = 1 << 14;
const SHIFT: u32 = 128 - 14;

/// A set of uniformly distributed `u128` keys (digests), compact in memory.
pub struct KeySet {
    buckets: Box<[Vec<u128>]>,
    len: usize,
}

impl Default for KeySet {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySet").field("len", &self.len).finish()
    }
}

impl KeySet {
    /// An empty set (about 400 KB of empty vectors).
    pub fn new() -> Self {
        Self { buckets: (0..BUCKETS).map(|_| Vec::new()).collect(), len: 0 }
    }

    fn bucket(key: u128) -> usize {
        (key >> SHIFT) as usize
    }

    /// Adds `key`; false when it was already there.
    pub fn insert(&mut self, key: u128) -> bool {
        let bucket = &mut self.buckets[Self::bucket(key)];
        match bucket.binary_search(&key) {
            Ok(_) => false,
            Err(at) => {
                if bucket.len() == bucket.capacity() {
                    bucket.reserve_exact((bucket.len() / 8).max(4));
                }
                bucket.insert(at, key);
                self.len += 1;
                true
            }
        }
    }

    /// True when `key` is in the set.
    pub fn contains(&self, key: &u128) -> bool {
        self.buckets[Self::bucket(*key)].binary_search(key).is_ok()
    }

    /// Keys in the set.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the set holds no key.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every key, in ascending order (the buckets are the keys' top bits, each one sorted).
    pub fn iter(&self) -> impl Iterator<Item = u128> + '_ {
        self.buckets.iter().flatten().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    proptest! {
        /// Inserting and looking up keys answers as a `HashSet` does, with keys that share
        /// their top bits (one bucket) as well as keys spread over many.
        #[test]
        fn behaves_as_a_hash_set(ops in proptest::collection::vec((any::<bool>(), any::<u8>(), any::<u128>()), 0..2000)) {
            let mut set = KeySet::new();
            let mut model = HashSet::new();
            for (insert, low, high) in ops {
                // Half the keys crowd into a few buckets, with few distinct values (repeats).
                let key = if low % 2 == 0 { u128::from(low) | ((high >> SHIFT) % 3) << SHIFT } else { high };
                if insert {
                    prop_assert_eq!(set.insert(key), model.insert(key));
                } else {
                    prop_assert_eq!(set.contains(&key), model.contains(&key));
                }
                prop_assert_eq!(set.len(), model.len());
            }
            for key in &model {
                prop_assert!(set.contains(key));
            }
        }
    }

    #[test]
    fn edge_keys() {
        let mut set = KeySet::new();
        assert!(set.is_empty());
        for key in [0, u128::MAX, 1 << SHIFT, (1 << SHIFT) - 1] {
            assert!(!set.contains(&key));
            assert!(set.insert(key));
            assert!(!set.insert(key));
            assert!(set.contains(&key));
        }
        assert_eq!(set.len(), 4);
    }
}
