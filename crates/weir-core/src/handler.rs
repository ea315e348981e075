//! The seam between the engine and the providers.
//!
//! A provider makes calls of three shapes, and nothing else: one request to one answer
//! ([`ModelHandler::generate`]); one request carrying many records to one outcome per record
//! ([`ModelHandler::generate_batch`]: Vertex `:predict` instances, embedding batches); and one
//! request to a stream of [`Delta`]s ending with the usage ([`ModelHandler::generate_stream`]).
//! Retrying, throttling and timeouts belong to the [`Executor`](crate::Executor), so a handler
//! never sleeps or loops and every provider gets the same resilience.

use futures::stream::BoxStream;
use std::sync::Arc;

use crate::error::{ErrorKind, ModelError};
use crate::outcome::ModelResponse;
use crate::params::GenParams;

/// One call's worth of input.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    /// The user prompt.
    pub prompt: String,
    /// System instructions.
    pub system: Option<Arc<str>>,
    /// Generation parameters (shared, since most requests of a run carry the same ones).
    pub params: Arc<GenParams>,
    /// Media parts after the prompt, in the order of the record's media fields (read when the
    /// record is about to be sent; empty for text).
    pub media: Arc<[crate::media::Part]>,
    /// The record's fields that the handler builds its request from
    /// ([`ModelHandler::record_fields`]: an `http/` model's templates), those the record has;
    /// `None` for handlers that read the prompt alone.
    pub fields: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
}

/// A piece of a streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// More text, in order.
    Text(String),
    /// The end of the answer: everything but the text (which the deltas carried), with the
    /// usage the provider reported at the end. A stream that stops without it was cut.
    End(ModelResponse),
}

/// A streamed answer as it arrives. An error item ends it (a cut connection, an error event).
pub type DeltaStream = BoxStream<'static, Result<Delta, ModelError>>;

/// What a batched call answers: one result per request, in order. The outer error is a failure
/// of the whole call (a 429 or 503 retries the call); an inner error failed that item alone.
pub type BatchAnswer = Result<Vec<Result<ModelResponse, ModelError>>, ModelError>;

/// One request's answer from a handler whose calls are batches: a batch of one. (For handlers
/// that implement [`ModelHandler::generate_batch`] natively, as their `generate`.)
pub async fn answer_one<H: ModelHandler + ?Sized>(
    handler: &H,
    request: &ModelRequest,
) -> Result<ModelResponse, ModelError> {
    let mut answers = handler.generate_batch(std::slice::from_ref(request)).await?;
    answers.pop().unwrap_or_else(|| Err(ModelError::new(ErrorKind::MalformedResponse, "the batch answer is empty")))
}

/// Something that turns requests into answers: a provider client. Each method makes exactly one
/// call per invocation. Errors are classified here, where the provider's answer is understood.
#[async_trait::async_trait]
pub trait ModelHandler: Send + Sync {
    /// Makes one call for one request.
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError>;

    /// `provider/model`, as written in the output rows.
    fn model_id(&self) -> &str;

    /// Where the calls go (the model's URL, without credentials). With the model id it names
    /// the source of the answers, which the response cache keeps apart: the same model name on
    /// a simulator, another project or another server answers differently.
    fn endpoint(&self) -> &str {
        self.model_id()
    }

    /// How the requests are put to [`Self::endpoint`], when one URL takes them in more than one
    /// form that answers differently (a Vertex AI endpoint's `:predict` with raw prompts, or
    /// with chat messages its server puts through the chat template): kept apart in the
    /// response cache too. `None` for the one form most handlers have.
    fn request_form(&self) -> Option<&str> {
        None
    }

    /// The record fields a request is built from besides the prompt (an `http/` model's body
    /// template names them): the engine hands them over in [`ModelRequest::fields`], and the
    /// response cache keys on them. Empty for models that read the prompt alone.
    fn record_fields(&self) -> &[String] {
        &[]
    }

    /// What tells apart the quotas of calls to the same endpoint: the API key the calls carry,
    /// for providers whose quota is per key (`None`: the endpoint's URL says it all, as Vertex
    /// AI's names the project). Only ever hashed, into the name under which this machine's
    /// processes share the quota; never written or shown.
    fn quota_credential(&self) -> Option<&str> {
        None
    }

    /// `text` with the key this handler's calls carry ([`ModelHandler::quota_credential`])
    /// masked wherever it stands. A streamed answer's pieces are masked one by one as they
    /// arrive; a key a server split between two pieces is whole only in the answer put
    /// together, which is masked with this before it is written or cached.
    fn masked(&self, text: &str) -> String {
        match self.quota_credential() {
            Some(key) => crate::secret::mask(text, &[crate::secret::Secret::new(key.to_string())]),
            None => text.to_string(),
        }
    }

    /// How many tokens the model reads for `text`, when the handler knows the model's tokenizer
    /// (weights and batches are then exact); `None`: estimated from its length.
    fn count_tokens(&self, _text: &str) -> Option<u64> {
        None
    }

    /// True when the endpoint reads media at `source` itself (Vertex AI reads `gs://` objects
    /// it may access): the part is then sent as a reference, not downloaded and sent inline.
    fn reads_by_reference(&self, _source: &str) -> bool {
        false
    }

    /// The largest part the endpoint takes by upload rather than inline (the Gemini API's
    /// Files API: 2 GB); `None` when parts go inline only (15 MB for a request's parts).
    fn max_upload_bytes(&self) -> Option<u64> {
        None
    }

    /// Uploads `part` to where the endpoint reads it (the Gemini API's Files API), for a part
    /// too large to go inline; its URI, for `fileData`. Only called where
    /// [`max_upload_bytes`](Self::max_upload_bytes) says uploads are taken.
    async fn upload_media(&self, _part: &crate::media::Part) -> Result<String, ModelError> {
        Err(ModelError::new(crate::ErrorKind::InvalidInput, "this endpoint takes media inline only"))
    }

    /// The most requests one call may carry; 1 when the endpoint takes one at a time.
    fn max_batch(&self) -> usize {
        1
    }

    /// The most bytes one batched call's body may have (Vertex `:predict` takes 1.5 MB), if the
    /// endpoint sets a limit; batches are split to stay under it.
    fn max_batch_bytes(&self) -> Option<usize> {
        None
    }

    /// About how many bytes `request` adds to a batched call's body.
    fn request_bytes(&self, request: &ModelRequest) -> usize {
        request.prompt.len() + request.system.as_deref().map_or(0, str::len) + 64
    }

    /// Makes one call carrying every request in `requests` (at most [`max_batch`](Self::max_batch)).
    /// Endpoints that take one request per call answer a batch of one.
    async fn generate_batch(&self, requests: &[ModelRequest]) -> BatchAnswer {
        match requests {
            [one] => Ok(vec![self.generate(one).await]),
            _ => Err(ModelError::new(
                ErrorKind::BadRequest,
                format!("{} takes one request per call, not {}", self.model_id(), requests.len()),
            )),
        }
    }

    /// True when [`generate_stream`](Self::generate_stream) streams for real (the answer comes
    /// in pieces as it is generated); false when it answers the whole text as one piece, and a
    /// streaming front end may as well make a plain call.
    fn streams(&self) -> bool {
        false
    }

    /// Makes one call whose answer arrives as a stream. Endpoints that cannot stream answer the
    /// whole text as one delta.
    async fn generate_stream(&self, request: &ModelRequest) -> Result<DeltaStream, ModelError> {
        let mut whole = self.generate(request).await?;
        let text = std::mem::take(&mut whole.text);
        Ok(Box::pin(futures::stream::iter([Ok(Delta::Text(text)), Ok(Delta::End(whole))])))
    }
}
