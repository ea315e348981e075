//! The batching stage: records in, batches out, for endpoints that take many records per call.
//!
//! A batch is cut when it holds `max_items` records, when one more record would take it past
//! `max_weight` (estimated tokens), or when its oldest record has waited `linger` — whichever
//! comes first — so a slow trickle of records is never held long, and a full batch goes at once.
//!
//! Records are kept apart by a *group* the caller names (batches never mix endpoints) and, within
//! a group, by length: where a batch is computed together its cost is set by its longest member,
//! so batching records of like length wastes less on padding. Two ways to get there:
//! - **buckets**: each record goes to the buffer of its length bucket (fixed boundaries, or
//!   boundaries taken from quantiles of the lengths seen so far), each buffer with its own timer;
//! - **sorted window**: records collect in one buffer until `window` of them (or the linger time),
//!   which is then sorted by length and cut into batches.
//!
//! The stage never drops or repeats a record: everything that comes in goes out in exactly one
//! batch, and what is buffered when the input ends is flushed.

use futures::stream::{Fuse, Stream, StreamExt};
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::Duration;
use tokio::time::Instant;

/// How records are grouped by length before batches are cut.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Bucketing {
    /// Arrival order: one buffer per group.
    #[default]
    Off,
    /// Upper bounds of the buckets, ascending, in the same unit as the weights (estimated
    /// tokens); records heavier than the last bound share one more bucket.
    Fixed(Vec<u64>),
    /// Buckets that double: up to 8, 9–16, 17–32, … tokens, so that within a bucket the longest
    /// record is at most twice the shortest (padding at most 2×) whatever the distribution.
    Doubling,
    /// `n` buckets whose boundaries are quantiles of the weights seen so far (re-taken as the
    /// input goes on). Equal counts per bucket: with a skewed distribution the top bucket can
    /// still mix short and very long records.
    Auto(usize),
    /// Collect this many records, sort them by weight, then cut batches.
    SortWindow(usize),
}

/// Limits of one batch and how long a record may wait for company.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSettings {
    /// Records per batch at most (at least 1).
    pub max_items: usize,
    /// Total weight per batch at most; a single record heavier than this goes alone.
    pub max_weight: u64,
    /// The longest a record waits in the stage before its batch is sent anyway.
    pub linger: Duration,
    /// Grouping by length.
    pub bucketing: Bucketing,
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self { max_items: 1, max_weight: u64::MAX, linger: Duration::from_millis(20), bucketing: Bucketing::Off }
    }
}

/// How many recent weights the automatic boundaries are taken from, and how often they are
/// re-taken (records).
const AUTO_SAMPLE: usize = 2048;
const AUTO_EVERY: usize = 256;

struct Buffer<T> {
    items: Vec<T>,
    weight: u64,
    /// When the oldest record came in, plus the linger time.
    deadline: Instant,
}

struct Stage<S: Stream, K, W, G> {
    input: Fuse<S>,
    settings: BatchSettings,
    weigh: W,
    group: G,
    buffers: HashMap<(K, usize), Buffer<S::Item>>,
    ready: VecDeque<Vec<S::Item>>,
    ended: bool,
    /// Boundaries in force (fixed, or the latest automatic ones).
    bounds: Vec<u64>,
    recent: VecDeque<u64>,
    since_bounds: usize,
}

impl<S, K, W, G> Stage<S, K, W, G>
where
    S: Stream + Unpin,
    K: Eq + Hash + Clone,
    W: Fn(&S::Item) -> u64,
    G: Fn(&S::Item) -> Option<K>,
{
    fn bucket_of(&mut self, weight: u64) -> usize {
        if let Bucketing::Auto(n) = self.settings.bucketing {
            self.recent.push_back(weight);
            if self.recent.len() > AUTO_SAMPLE {
                self.recent.pop_front();
            }
            self.since_bounds += 1;
            // Early on, when few lengths are known, the boundaries are re-taken each time the
            // sample doubles; then every AUTO_EVERY records.
            if self.since_bounds >= AUTO_EVERY.min(self.recent.len().div_ceil(2).max(1)) {
                self.since_bounds = 0;
                self.bounds = quantile_bounds(self.recent.iter().copied().collect(), n);
            }
        }
        match self.settings.bucketing {
            Bucketing::Fixed(_) | Bucketing::Auto(_) => self.bounds.partition_point(|&b| b < weight),
            // ⌈log2 w⌉, all records of up to 8 tokens together.
            Bucketing::Doubling => (u64::BITS - weight.saturating_sub(1).leading_zeros()).saturating_sub(3) as usize,
            Bucketing::Off | Bucketing::SortWindow(_) => 0,
        }
    }

    fn push(&mut self, item: S::Item) {
        let Some(group) = (self.group)(&item) else {
            // Not to be batched: it goes on alone, at once.
            self.ready.push_back(vec![item]);
            return;
        };
        let weight = (self.weigh)(&item);
        let key = (group, self.bucket_of(weight));
        let (max_items, max_weight) = match self.settings.bucketing {
            // A sorted window collects `window` records; its batches are cut when it is flushed.
            Bucketing::SortWindow(window) => (window.max(1), u64::MAX),
            _ => (self.settings.max_items.max(1), self.settings.max_weight),
        };
        // A record that would take its batch past the weight limit sends the batch first.
        let over =
            self.buffers.get(&key).is_some_and(|b| !b.items.is_empty() && b.weight.saturating_add(weight) > max_weight);
        if over {
            self.flush(&key);
        }
        let linger = self.settings.linger;
        let b = self.buffers.entry(key.clone()).or_insert_with(|| Buffer {
            items: Vec::new(),
            weight: 0,
            deadline: Instant::now() + linger,
        });
        b.items.push(item);
        b.weight = b.weight.saturating_add(weight);
        if b.items.len() >= max_items || b.weight >= max_weight {
            self.flush(&key);
        }
    }

    /// Moves a buffer's records into ready batches.
    fn flush(&mut self, key: &(K, usize)) {
        let Some(b) = self.buffers.remove(key) else { return };
        if b.items.is_empty() {
            return;
        }
        match self.settings.bucketing {
            Bucketing::SortWindow(_) => {
                let mut items: Vec<(u64, S::Item)> = b.items.into_iter().map(|t| ((self.weigh)(&t), t)).collect();
                items.sort_by_key(|(w, _)| *w);
                let (max_items, max_weight) = (self.settings.max_items.max(1), self.settings.max_weight);
                let mut batch = Vec::new();
                let mut weight = 0u64;
                for (w, t) in items {
                    if !batch.is_empty() && (batch.len() >= max_items || weight.saturating_add(w) > max_weight) {
                        self.ready.push_back(std::mem::take(&mut batch));
                        weight = 0;
                    }
                    weight = weight.saturating_add(w);
                    batch.push(t);
                }
                if !batch.is_empty() {
                    self.ready.push_back(batch);
                }
            }
            _ => self.ready.push_back(b.items),
        }
    }

    /// Flushes the buffers whose time is up (all of them when the input has ended), oldest first.
    fn flush_due(&mut self, now: Option<Instant>) {
        let mut due: Vec<((K, usize), Instant)> = self
            .buffers
            .iter()
            .filter(|(_, b)| now.is_none_or(|n| b.deadline <= n))
            .map(|(k, b)| (k.clone(), b.deadline))
            .collect();
        due.sort_by_key(|(_, d)| *d);
        for (k, _) in due {
            self.flush(&k);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.buffers.values().map(|b| b.deadline).min()
    }
}

/// Boundaries that split `weights` into `n` groups of about equal count.
fn quantile_bounds(mut weights: Vec<u64>, n: usize) -> Vec<u64> {
    if weights.is_empty() || n <= 1 {
        return Vec::new();
    }
    weights.sort_unstable();
    let mut bounds: Vec<u64> = (1..n).map(|i| weights[(i * weights.len() / n).min(weights.len() - 1)]).collect();
    bounds.dedup();
    bounds
}

/// Cuts `input` into batches as [`BatchSettings`] say. `weigh` gives a record's weight (estimated
/// tokens); `group` names what a batch must not mix (the endpoint a record goes to), or `None`
/// for an item that is not to be batched, which then goes on alone at once.
pub fn batches<S, K, W, G>(input: S, settings: BatchSettings, weigh: W, group: G) -> impl Stream<Item = Vec<S::Item>>
where
    S: Stream + Unpin,
    K: Eq + Hash + Clone,
    W: Fn(&S::Item) -> u64,
    G: Fn(&S::Item) -> Option<K>,
{
    let bounds = match &settings.bucketing {
        Bucketing::Fixed(b) => {
            let mut b = b.clone();
            b.sort_unstable();
            b.dedup();
            b
        }
        _ => Vec::new(),
    };
    let stage = Stage {
        input: input.fuse(),
        settings,
        weigh,
        group,
        buffers: HashMap::new(),
        ready: VecDeque::new(),
        ended: false,
        bounds,
        recent: VecDeque::new(),
        since_bounds: 0,
    };
    futures::stream::unfold(stage, |mut st| async move {
        loop {
            if let Some(batch) = st.ready.pop_front() {
                return Some((batch, st));
            }
            if st.ended {
                st.flush_due(None);
                if st.ready.is_empty() {
                    return None;
                }
                continue;
            }
            let deadline = st.next_deadline();
            tokio::select! {
                // A batch whose time is up goes before more input is read.
                biased;
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                    st.flush_due(Some(Instant::now()));
                }
                item = st.input.next() => match item {
                    Some(t) => st.push(t),
                    None => st.ended = true,
                },
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A record in the property test: its index, weight and arrival time.
    type Arrival = (usize, u64, Instant);

    /// Records arrive with the given gaps and weights; every batch is checked against the limits
    /// and the linger time, and every record must come out exactly once.
    fn check(gaps_ms: Vec<u64>, weights: Vec<u64>, settings: BatchSettings, groups: u32) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        rt.block_on(async move {
            let n = gaps_ms.len().min(weights.len());
            let arrivals: Vec<(usize, u64, u64)> = (0..n).map(|i| (i, gaps_ms[i], weights[i])).collect();
            let input = Box::pin(futures::stream::iter(arrivals).then(|(i, gap, w)| async move {
                tokio::time::sleep(Duration::from_millis(gap)).await;
                (i, w, Instant::now())
            }));
            let out: Vec<(Vec<Arrival>, Instant)> = batches(
                input,
                settings.clone(),
                |t: &(usize, u64, Instant)| t.1,
                move |t| {
                    // Every seventh record is not to be batched.
                    (t.0 % 7 != 3).then_some(t.0 as u32 % groups)
                },
            )
            .map(|b| (b, Instant::now()))
            .collect()
            .await;
            let mut seen = vec![0u32; n];
            for (batch, at) in &out {
                assert!(!batch.is_empty());
                assert!(batch.len() <= settings.max_items.max(1), "{} items", batch.len());
                let w: u64 = batch.iter().map(|t| t.1).sum();
                assert!(batch.len() == 1 || w <= settings.max_weight, "weight {w}");
                if batch[0].0 % 7 == 3 {
                    assert_eq!(batch.len(), 1, "a record not to be batched shared a batch");
                    assert_eq!(*at, batch[0].2, "a record not to be batched waited");
                }
                let g = batch[0].0 as u32 % groups;
                assert!(batch.iter().all(|t| t.0 as u32 % groups == g), "a batch mixed groups");
                for t in batch {
                    seen[t.0] += 1;
                    assert!(*at - t.2 <= settings.linger, "waited {:?}", *at - t.2);
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
        });
    }

    fn bucketing() -> impl Strategy<Value = Bucketing> {
        prop_oneof![
            Just(Bucketing::Off),
            Just(Bucketing::Fixed(vec![16, 64, 256])),
            Just(Bucketing::Doubling),
            (1usize..6).prop_map(Bucketing::Auto),
            (1usize..40).prop_map(Bucketing::SortWindow),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        #[test]
        fn no_record_is_lost_repeated_over_limit_or_held_past_the_linger(
            gaps in proptest::collection::vec(prop_oneof![Just(0u64), 0u64..5, 0u64..200], 0..300),
            weights in proptest::collection::vec(1u64..600, 300),
            max_items in 1usize..20,
            max_weight in 50u64..3000,
            linger in 1u64..100,
            bucketing in bucketing(),
            groups in 1u32..4,
        ) {
            let settings = BatchSettings { max_items, max_weight, linger: Duration::from_millis(linger), bucketing };
            check(gaps, weights, settings, groups);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn doubling_buckets_keep_the_longest_at_most_twice_the_shortest() {
        let weights: Vec<u64> = (1..=600).collect();
        let settings = BatchSettings {
            max_items: 1000,
            max_weight: u64::MAX,
            linger: Duration::from_secs(1),
            bucketing: Bucketing::Doubling,
        };
        let out: Vec<Vec<u64>> =
            batches(futures::stream::iter(weights), settings, |w| *w, |_| Some(())).collect().await;
        assert_eq!(out.len(), 8, "≤8, 9–16, …, 513–1024");
        for b in &out {
            let (lo, hi) = (b.iter().min().unwrap(), b.iter().max().unwrap());
            assert!(*hi <= 8 || *hi <= 2 * lo, "{lo}..{hi}");
        }
    }

    #[test]
    fn quantile_bounds_split_evenly() {
        assert_eq!(quantile_bounds((1..=100).collect(), 4), vec![26, 51, 76]);
        assert_eq!(quantile_bounds(vec![5; 10], 4), vec![5]);
        assert!(quantile_bounds(vec![], 4).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn buckets_keep_short_and_long_apart_and_a_full_batch_goes_at_once() {
        let weights = [10u64, 500, 12, 480, 9, 510, 11, 490];
        let input = futures::stream::iter(weights.iter().copied().enumerate());
        let settings = BatchSettings {
            max_items: 4,
            max_weight: u64::MAX,
            linger: Duration::from_secs(3600),
            bucketing: Bucketing::Fixed(vec![100]),
        };
        let t0 = Instant::now();
        let out: Vec<Vec<(usize, u64)>> = batches(input, settings, |t| t.1, |_| Some(())).collect().await;
        assert_eq!(out.len(), 2);
        assert!(out[0].iter().all(|t| t.1 < 100));
        assert!(out[1].iter().all(|t| t.1 >= 100));
        assert_eq!(t0.elapsed(), Duration::ZERO, "full batches did not wait for the linger time");
    }

    #[tokio::test(start_paused = true)]
    async fn a_sorted_window_cuts_batches_of_like_length() {
        let weights = [300u64, 10, 200, 20, 100, 30];
        let input = futures::stream::iter(weights.iter().copied());
        let settings = BatchSettings {
            max_items: 2,
            max_weight: u64::MAX,
            linger: Duration::from_millis(5),
            bucketing: Bucketing::SortWindow(6),
        };
        let out: Vec<Vec<u64>> = batches(input, settings, |w| *w, |_| Some(())).collect().await;
        assert_eq!(out, vec![vec![10, 20], vec![30, 100], vec![200, 300]]);
    }
}
