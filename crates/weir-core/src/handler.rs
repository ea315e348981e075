//! The seam between the engine and the providers.

use std::sync::Arc;

use crate::error::ModelError;
use crate::outcome::ModelResponse;
use crate::params::GenParams;

/// One call's worth of input. Parameters are shared by every request of a run.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    /// The user prompt.
    pub prompt: String,
    /// System instructions.
    pub system: Option<Arc<str>>,
    /// Generation parameters.
    pub params: Arc<GenParams>,
}

/// Something that turns a request into an answer: a provider client. It makes exactly one call
/// per invocation; retrying, throttling and timeouts are the driver's job, so a handler never
/// sleeps or loops, and every handler gets the same resilience.
#[async_trait::async_trait]
pub trait ModelHandler: Send + Sync {
    /// Makes one call. Errors are classified here, where the provider's answer is understood.
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError>;

    /// `provider/model`, as written in the output rows.
    fn model_id(&self) -> &str;
}
