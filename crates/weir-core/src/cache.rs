//! The response cache seam: answers already paid for are never paid for again.
//!
//! The key is a SHA-256 over the canonical request — `provider/model`, the system text, the
//! prompt and the generation parameters, each length-prefixed — and never over a credential or
//! a URL, so no secret can be part of a key or a value. The store lives elsewhere (`weir-io`).
//!
//! # Which answers may be reused
//!
//! A sampled answer is one draw. Users who repeat a prompt on purpose (to sample it several
//! times, or because two rows happen to share it) expect independent draws, so an answer may be
//! reused only where reuse cannot change what they get:
//! - for the *same record* (same id) in a later run — the answer it already paid for;
//! - across records only when the request is deterministic: temperature 0 or a fixed seed.
//!
//! Otherwise the record's id is part of the key, so two records never share a sampled answer.

use sha2::{Digest, Sha256};

use crate::handler::ModelRequest;
use crate::outcome::ModelResponse;
use crate::params::GenParams;
use crate::record::RecordId;

/// A cache key: SHA-256 of the canonical request.
pub type CacheKey = [u8; 32];

/// True when the same request gives the same answer, so records may share it: temperature 0,
/// or a fixed seed.
pub fn is_deterministic(params: &GenParams) -> bool {
    params.temperature == Some(0.0) || params.seed.is_some()
}

/// Computes the key of `request` sent to `model_id` (`provider/model`) for `record`. The record
/// is part of the key unless the request is deterministic (see the module docs).
pub fn cache_key(model_id: &str, request: &ModelRequest, record: &RecordId) -> CacheKey {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(b"weir-cache-v2");
    field(model_id.as_bytes());
    field(request.system.as_deref().unwrap_or("").as_bytes());
    field(&[u8::from(request.system.is_some())]);
    field(request.prompt.as_bytes());
    field(serde_json::to_string(&*request.params).unwrap_or_default().as_bytes());
    // Media by content: the same bytes under another name are the same request.
    for part in request.media.iter() {
        field(&part.digest);
    }
    // The record's fields a request is built from (an `http/` model's body), when it has any.
    if let Some(fields) = &request.fields {
        field(b"fields");
        field(serde_json::to_string(&**fields).unwrap_or_default().as_bytes());
    }
    if is_deterministic(&request.params) {
        field(b"shared");
    } else {
        field(&record.key_bytes());
    }
    h.finalize().into()
}

/// A store of answers by request.
pub trait ResponseCache: Send + Sync {
    /// The stored answer, if any.
    fn get(&self, key: &CacheKey) -> Option<ModelResponse>;
    /// Stores an answer (it may become durable a little later).
    fn put(&self, key: CacheKey, response: &ModelResponse);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::GenParams;
    use std::sync::Arc;

    fn req(prompt: &str, system: Option<&str>, temp: Option<f64>) -> ModelRequest {
        ModelRequest {
            prompt: prompt.into(),
            system: system.map(Arc::from),
            params: Arc::new(GenParams { temperature: temp, ..GenParams::default() }),
            media: Default::default(),
            fields: None,
        }
    }

    #[test]
    fn keys_depend_on_everything_that_shapes_the_answer() {
        let r = RecordId::from("r1");
        let base = cache_key("sim/a", &req("p", None, None), &r);
        assert_eq!(base, cache_key("sim/a", &req("p", None, None), &r));
        assert_ne!(base, cache_key("sim/b", &req("p", None, None), &r));
        assert_ne!(base, cache_key("sim/a", &req("q", None, None), &r));
        assert_ne!(base, cache_key("sim/a", &req("p", Some(""), None), &r));
        assert_ne!(base, cache_key("sim/a", &req("p", None, Some(0.5)), &r));
    }

    #[test]
    fn sampled_answers_belong_to_their_record_deterministic_ones_are_shared() {
        let (a, b) = (RecordId::from("a"), RecordId::from("b"));
        // Default or positive temperature: a draw per record.
        assert_ne!(cache_key("m", &req("p", None, None), &a), cache_key("m", &req("p", None, None), &b));
        assert_ne!(cache_key("m", &req("p", None, Some(0.7)), &a), cache_key("m", &req("p", None, Some(0.7)), &b));
        // "7" and 7 are two records.
        assert_ne!(
            cache_key("m", &req("p", None, None), &RecordId::Text("7".into())),
            cache_key("m", &req("p", None, None), &RecordId::Number("7".into()))
        );
        // Temperature 0, or a seed: one answer for every record.
        assert_eq!(cache_key("m", &req("p", None, Some(0.0)), &a), cache_key("m", &req("p", None, Some(0.0)), &b));
        let seeded = |id: &RecordId| {
            let r = ModelRequest {
                prompt: "p".into(),
                system: None,
                params: Arc::new(GenParams { seed: Some(3), temperature: Some(1.0), ..GenParams::default() }),
                media: Default::default(),
                fields: None,
            };
            cache_key("m", &r, id)
        };
        assert_eq!(seeded(&a), seeded(&b));
    }
}
