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

/// A stable 64-bit hash of a large buffer (media), eight bytes a step: FNV-1a's step over
/// words, then the tail byte by byte, so a 20 KB image costs a few microseconds.
pub fn word_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h ^= u64::from_le_bytes(w.try_into().expect("eight bytes"));
        h = h.wrapping_mul(0x0100_0000_01b3).rotate_left(29);
    }
    stable_hash(&[&h.to_le_bytes(), words.remainder()])
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

/// The answer to a request with a response schema: a JSON value of the schema's shape, a pure
/// function of the request (`request_hash`) like any answer. `broken` cuts it in half, as a
/// model that ran out of tokens or ignored the constraint would answer: not JSON.
pub fn shaped(schema: &serde_json::Value, request_hash: u64, broken: bool) -> Generation {
    let mut rng = SmallRng::seed_from_u64(request_hash);
    let mut text = instance_of(schema, &mut rng, 0).to_string();
    if broken {
        let mut cut = text.len() / 2;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    // Four characters a token, as streamed.
    let chars: Vec<char> = text.chars().collect();
    let tokens = chars.chunks(4).map(|c| c.iter().collect()).collect();
    Generation { tokens, truncated_by_limit: false, jitter_ms: 0.0 }
}

/// A value of `schema`'s shape (JSON Schema, or Gemini's upper-case types): every property of
/// an object, one to three items of an array, an `enum`'s value, the first of `anyOf`/`oneOf`.
fn instance_of(schema: &serde_json::Value, rng: &mut SmallRng, depth: u32) -> serde_json::Value {
    use serde_json::{json, Value};
    if let Some(Value::Array(options)) = schema.get("enum") {
        if !options.is_empty() {
            return options[rng.gen_range(0..options.len())].clone();
        }
    }
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    for k in ["anyOf", "oneOf"] {
        if let Some(first) = schema.get(k).and_then(|v| v.get(0)) {
            return instance_of(first, rng, depth + 1);
        }
    }
    let kind = match schema.get("type") {
        Some(Value::String(t)) => t.to_ascii_lowercase(),
        Some(Value::Array(ts)) => {
            ts.iter().filter_map(Value::as_str).find(|t| *t != "null").unwrap_or("null").to_ascii_lowercase()
        }
        _ if schema.get("properties").is_some() => "object".into(),
        _ => "string".into(),
    };
    let word = |rng: &mut SmallRng| WORDS[rng.gen_range(0..WORDS.len())];
    match kind.as_str() {
        "object" if depth < 8 => {
            let mut m = serde_json::Map::new();
            if let Some(Value::Object(props)) = schema.get("properties") {
                for (name, s) in props {
                    m.insert(name.clone(), instance_of(s, rng, depth + 1));
                }
            }
            Value::Object(m)
        }
        "array" if depth < 8 => {
            let n = rng.gen_range(1..=3);
            let items = schema.get("items").cloned().unwrap_or(json!({"type": "string"}));
            Value::Array((0..n).map(|_| instance_of(&items, rng, depth + 1)).collect())
        }
        "integer" => json!(rng.gen_range(0..100)),
        "number" => json!((rng.gen_range(0.0..1.0f64) * 1000.0).round() / 1000.0),
        "boolean" => json!(rng.gen_bool(0.5)),
        "null" => Value::Null,
        "object" => json!({}),
        "array" => json!([]),
        _ => {
            let n = rng.gen_range(1..=3);
            Value::String((0..n).map(|_| word(rng)).collect::<Vec<_>>().join(" "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shaped_answers_follow_the_schema_and_broken_ones_do_not_parse() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "label": {"type": "string", "enum": ["shoe", "hat"]},
                "score": {"type": "number"},
                "tags": {"type": "ARRAY", "items": {"type": "STRING"}},
            },
        });
        let v: serde_json::Value = serde_json::from_str(&shaped(&schema, 7, false).text()).unwrap();
        assert!(v["label"] == "shoe" || v["label"] == "hat", "{v}");
        assert!(v["score"].is_f64() && v["tags"].as_array().is_some_and(|t| !t.is_empty() && t[0].is_string()), "{v}");
        assert_eq!(shaped(&schema, 7, false).text(), shaped(&schema, 7, false).text());
        assert!(serde_json::from_str::<serde_json::Value>(&shaped(&schema, 7, true).text()).is_err());
    }

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
