//! weir's SQL functions for Apache DataFusion: `llm_generate(model, prompt [, options])` and
//! `llm_embed(model, text [, options])`, with `_result` companions that return a struct per row
//! (the answer, or the error kind and message, attempts and usage).
//!
//! They are async scalar UDFs: DataFusion hands each a batch of rows, and every row's call runs
//! at once through weir's engine, admitted by one [`weir_core::Throttle`] per endpoint that all
//! partitions (and all queries) of the process share — so a query with many partitions reaches
//! the endpoint's quota together instead of each partition guessing its own share.
//!
//! A failed row never fails the query unless asked (`{"fail_on_error": true}`): `llm_generate`
//! gives NULL, `llm_generate_result` says why. A query that cannot work at all — an unknown
//! model, a missing key, options weir does not know — fails at once with what to fix.

#![warn(missing_docs)]

#[cfg(feature = "cluster")]
mod cancel;
#[cfg(feature = "cluster")]
pub mod cluster;
pub mod copy;
#[cfg(feature = "cluster")]
pub mod fence;
#[cfg(feature = "cluster")]
mod flight_guard;
#[cfg(feature = "cluster")]
pub mod guard;
mod hoist;
mod options;
#[cfg(feature = "cluster")]
pub mod quota;
pub mod tables;
#[cfg(feature = "cluster")]
pub mod tls;
mod udf;

pub use hoist::{optimizer_rules, HoistModelCalls, MOVES_CALLS};
pub use options::{CallOptions, OptionsError};
pub use udf::{LlmUdf, UdfKind, MAX_MEDIA};
pub use weir_runtime::{Connector, Runtime, RuntimeSettings};

pub use datafusion;

/// The scheduler's `HOST:PORT` in a cluster address, `df://HOST:PORT` or `dfs://HOST:PORT`
/// (mutual TLS, which the installed credentials give; the address is the same); `None` for
/// another scheme. Messages keep the address as given.
pub fn scheduler_address(url: &str) -> Option<&str> {
    url.strip_prefix("df://").or_else(|| url.strip_prefix("dfs://"))
}

use datafusion::prelude::SessionContext;
use std::sync::Arc;

/// Registers weir's functions (`llm_generate`, `llm_generate_result`, `llm_embed`,
/// `llm_embed_result`) on `ctx`, all sharing `functions` (its throttles, counters and
/// settings), and sets its optimizer rules so that each call is made once per row and after
/// the filters under it (see [`HoistModelCalls`]).
pub fn register(ctx: &SessionContext, functions: &Arc<Runtime>) {
    for udf in udf::all(functions) {
        ctx.register_udf(udf);
    }
    for rule in MOVES_CALLS {
        ctx.remove_optimizer_rule(rule);
    }
    ctx.add_optimizer_rule(Arc::new(HoistModelCalls));
}
