//! weir's runtime, above the executor, for front ends that are handed rows to answer rather than running over an
//! input of their own: the SQL functions (`weir-datafusion`) and the Python package
//! (`weir-py`). One [`Runtime`] per process holds one connection and one
//! [`weir_core::Throttle`] per endpoint, so everything that process asks of an endpoint —
//! every partition of a query, every thread of a Beam worker — reaches its quota together
//! instead of each caller guessing its own share.
//!
//! With the `cli` feature, `EndpointArgs` are the flags (and, in Python, the keyword arguments)
//! that say how to reach an endpoint and how hard to push it, parsed and checked in one place
//! for every front end. With `sim` (on by default), `sim/` models run weir's simulator in the
//! process.

#![warn(missing_docs)]

#[cfg(feature = "cli")]
pub mod args;
mod cache;
pub mod dash;
pub mod dispatch;
pub mod endpoints;
pub mod gather;
#[cfg(feature = "local")]
mod local;
pub mod media;
mod route;
mod runtime;
pub mod share;
#[cfg(feature = "redis")]
pub mod share_redis;
#[cfg(feature = "sim")]
pub mod sim;

#[cfg(feature = "cli")]
pub use args::{declared_pool, ConcurrencyMode, EndpointArgs, SettingsError};
pub use cache::open_cache;
pub use dispatch::{DispatchSettings, Work};
pub use endpoints::EndpointEntry;
pub use route::Router;
pub use runtime::{Call, Connector, EndpointState, Row, RowResult, Runtime, RuntimeSettings};

/// Sets up the client for `spec`, as every front end connects a model: the providers of
/// `weir_providers`, and the ones registered with its connectors (`sim/`, served by this
/// crate's simulator unless a program installed another scenario; `local/`, when the program
/// links a local runtime and registered it).
pub async fn connect(
    spec: &weir_providers::ModelSpec,
    options: &weir_providers::ProviderOptions,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<weir_providers::Endpoint, weir_providers::ProviderError> {
    #[cfg(feature = "sim")]
    sim::ensure();
    #[cfg(feature = "local")]
    local::ensure();
    weir_providers::connect(spec, options, env).await
}
