//! Deterministic text generation and token counting.
//!
//! The simulator has no model; it produces text that is a pure function of the request (and the
//! scenario seed), so tests can compare runs, and it counts tokens the way a rough tokenizer would:
//! about four characters a token, so that token counts grow with prompt length.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const WORDS: &[&str] = &[
    "the", "river", "runs", "over", "weir", "and", "stone", "water", "flows", "slow", "down", "past", "mill", "bank",
    "reed", "cold", "clear", "deep", "wide", "bend", "fish", "leap", "at", "dawn", "mist", "lies", "on", "field",
    "oak", "ash", "grows", "near", "bridge", "old", "path", "leads", "to", "town", "where", "bells", "ring", "rain",
    "falls", "soft", "wind", "turns", "wheel", "grain",
];

/// Counts tokens the way the simulator bills them: one per four characters, rounded up.
pub fn count_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

/// A stable 64-bit FNV-1a hash, so generated text does not depend on the Rust version.
pub fn stable_hash(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.iter() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // Separator, so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The answer the simulator will give to one request.
#[derive(Debug, Clone)]
pub struct Generation {
    /// One string per output token; joined they make the answer.
    pub tokens: Vec<String>,
    /// True when `max_tokens` cut the answer short.
    pub truncated_by_limit: bool,
    /// Extra latency drawn for this request, in milliseconds.
    pub jitter_ms: f64,
}

impl Generation {
    /// The whole answer text.
    pub fn text(&self) -> String {
        self.tokens.concat()
    }
}

/// Generates the answer for a request whose content hashes to `request_hash`.
pub fn generate(request_hash: u64, min_tokens: u32, max_tokens: u32, limit: Option<u32>, jitter_ms: f64) -> Generation {
    let mut rng = SmallRng::seed_from_u64(request_hash);
    let natural = rng.gen_range(min_tokens..=max_tokens);
    let n = match limit {
        Some(l) => natural.min(l),
        None => natural,
    };
    let truncated_by_limit = n < natural;
    let mut tokens = Vec::with_capacity(n as usize);
    for i in 0..n {
        let w = WORDS[rng.gen_range(0..WORDS.len())];
        if i == 0 {
            let mut first = w.to_string();
            first[..1].make_ascii_uppercase();
            tokens.push(first);
        } else {
            tokens.push(format!(" {w}"));
        }
    }
    if let Some(last) = tokens.last_mut() {
        if !truncated_by_limit {
            last.push('.');
        }
    }
    let jitter_ms = if jitter_ms > 0.0 { rng.gen_range(0.0..jitter_ms) } else { 0.0 };
    Generation { tokens, truncated_by_limit, jitter_ms }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_request_same_answer() {
        let a = generate(42, 8, 48, None, 10.0);
        let b = generate(42, 8, 48, None, 10.0);
        assert_eq!(a.text(), b.text());
        assert_eq!(a.jitter_ms, b.jitter_ms);
        let c = generate(43, 8, 48, None, 10.0);
        assert_ne!(a.text(), c.text());
    }

    #[test]
    fn limit_caps_the_answer() {
        let g = generate(1, 20, 20, Some(5), 0.0);
        assert_eq!(g.tokens.len(), 5);
        assert!(g.truncated_by_limit);
        let g = generate(1, 20, 20, Some(50), 0.0);
        assert_eq!(g.tokens.len(), 20);
        assert!(!g.truncated_by_limit);
    }

    #[test]
    fn tokens_grow_with_length() {
        assert_eq!(count_tokens(""), 0);
        assert_eq!(count_tokens("abcd"), 1);
        assert_eq!(count_tokens("abcde"), 2);
        assert!(count_tokens(&"x".repeat(4000)) == 1000);
    }

    #[test]
    fn hash_separates_parts() {
        assert_ne!(stable_hash(&[b"ab", b"c"]), stable_hash(&[b"a", b"bc"]));
    }
}
