//! Outcomes: every input record ends in exactly one, a success or a failure.

use serde::{Deserialize, Serialize};
use std::time::Duration;

use crate::record::Record;

/// Token usage as the provider reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the prompt (system text included).
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub output_tokens: u64,
    /// What the provider billed in all (may include thinking tokens).
    pub total_tokens: u64,
}

/// A model's answer to one request: generated text, or an embedding vector (then `text` is
/// empty).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelResponse {
    /// The generated text.
    pub text: String,
    /// The embedding, for an embedding model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Vec<f32>>,
    /// Why generation stopped, normalised: `stop`, `length`, or the provider's own value in
    /// lower case.
    pub finish_reason: String,
    /// Token usage.
    pub usage: Usage,
    /// The model version that answered, when the provider says.
    pub model_version: Option<String>,
    /// Rate limits the answer's headers reported (not cached).
    #[serde(skip)]
    pub limits: Option<LimitInfo>,
}

/// Rate limits as reported by response headers (OpenAI's `x-ratelimit-*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LimitInfo {
    /// Requests per window.
    pub requests: Option<u64>,
    /// Time until the request window is back to its initial state.
    pub requests_reset: Option<Duration>,
    /// Tokens per window.
    pub tokens: Option<u64>,
    /// Time until the token window is back to its initial state.
    pub tokens_reset: Option<Duration>,
}

/// A record that got an answer.
#[derive(Debug, Clone)]
pub struct Success {
    /// The record.
    pub record: Record,
    /// The answer.
    pub response: ModelResponse,
    /// Calls made, the successful one included.
    pub attempts: u32,
    /// Time from the first attempt to the answer, backoff included.
    pub latency: Duration,
    /// `provider/model` that answered (records of one run may go to different models).
    pub model: std::sync::Arc<str>,
}

// A failure is made where records are read (a line that does not parse) as well as where calls
// end: it lives with the record, and is part of this module's vocabulary through this use.
pub use crate::record::Failure;

/// The end of one record.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// It got an answer.
    Success(Box<Success>),
    /// It failed for good.
    Failure(Box<Failure>),
}
