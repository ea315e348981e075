//! weir-core: the engine of weir, independent of any provider or file format.
//!
//! A [`Record`] is parsed from an input row by a [`RecordSpec`]; the [`Driver`] takes it
//! through a [`ModelHandler`] (a provider client) under a concurrency limit, a server-advised
//! pause gate, a hard timeout and a [`RetryPolicy`], to exactly one [`Outcome`].

#![warn(missing_docs)]

pub mod batch;
pub mod cache;
pub mod driver;
pub mod error;
pub mod executor;
pub mod handler;
pub mod jobs;
pub mod limit;
pub mod media;
pub mod metrics;
pub mod outcome;
pub mod params;
pub mod pool;
pub mod rate;
pub mod record;
pub mod retry;
pub mod schema;
pub mod secret;
pub mod throttle;

pub use batch::{batches, BatchSettings, Bucketing};
pub use cache::{cache_key, is_deterministic, CacheKey, ResponseCache};
pub use driver::{Driver, DriverSettings, StopReason};
pub use error::{ErrorKind, ModelError, QuotaScope, RetryHint};
pub use executor::{Done, Executor, Failed, Metered, NoObserver, Observer, StreamEvent};
pub use handler::{BatchAnswer, Delta, DeltaStream, ModelHandler, ModelRequest};
pub use jobs::{JobApi, JobInput, JobLimits, JobRef, JobResult, JobStaging, JobState, JobStatus, LineSplitter, Sought};
pub use limit::{Adaptive, AdaptiveLimit, CallResult, ConcurrencyLimit, FixedLimit, Gate};
pub use metrics::{Percentiles, RunMetrics};
pub use outcome::{Failure, LimitInfo, ModelResponse, Outcome, Success, Usage};
pub use params::{GenParams, ParamError};
pub use pool::{Absorbed, EndpointHealth, EndpointStatus, Pool, PoolMember};
pub use record::{template_pieces, PromptSource, Record, RecordId, RecordSpec, Template, TemplateError, TemplatePiece};
pub use retry::{Decision, RetryPolicy};
pub use secret::Secret;
pub use throttle::{
    is_pushback, Admitted, Delegate, Grant, QuotaStore, RateLimiter, RateSettings, RateSnapshot, Sharing, SreThrottler,
    Throttle, ThrottleSettings, Ticket, Weight,
};
