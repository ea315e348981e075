//! The response cache seam: answers already paid for are never paid for again.
//!
//! The key is a SHA-256 over the canonical request — `provider/model`, the system text, the
//! prompt and the generation parameters, each length-prefixed — and never over a credential or
//! a URL, so no secret can be part of a key or a value. The store lives elsewhere (`weir-io`).

use sha2::{Digest, Sha256};

use crate::handler::ModelRequest;
use crate::outcome::ModelResponse;

/// A cache key: SHA-256 of the canonical request.
pub type CacheKey = [u8; 32];

/// Computes the key of `request` sent to `model_id` (`provider/model`).
pub fn cache_key(model_id: &str, request: &ModelRequest) -> CacheKey {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(b"weir-cache-v1");
    field(model_id.as_bytes());
    field(request.system.as_deref().unwrap_or("").as_bytes());
    field(&[u8::from(request.system.is_some())]);
    field(request.prompt.as_bytes());
    field(serde_json::to_string(&*request.params).unwrap_or_default().as_bytes());
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
        }
    }

    #[test]
    fn keys_depend_on_everything_that_shapes_the_answer() {
        let base = cache_key("sim/a", &req("p", None, None));
        assert_eq!(base, cache_key("sim/a", &req("p", None, None)));
        assert_ne!(base, cache_key("sim/b", &req("p", None, None)));
        assert_ne!(base, cache_key("sim/a", &req("q", None, None)));
        assert_ne!(base, cache_key("sim/a", &req("p", Some(""), None)));
        assert_ne!(base, cache_key("sim/a", &req("p", None, Some(0.5))));
    }
}
