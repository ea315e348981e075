//! weir's engine for front ends that are handed rows to answer, rather than running over an
//! input of their own: the SQL functions (`weir-datafusion`) and the Python package
//! (`weir-py`). One [`Engine`] per process holds one connection and one
//! [`weir_core::Throttle`] per endpoint, so everything that process asks of an endpoint —
//! every partition of a query, every thread of a Beam worker — reaches its quota together
//! instead of each caller guessing its own share.
//!
//! [`EndpointArgs`] are the flags (and, in Python, the keyword arguments) that say how to reach
//! an endpoint and how hard to push it, parsed and checked in one place for every front end.

#![warn(missing_docs)]

pub mod args;
mod engine;

pub use args::{ConcurrencyMode, EndpointArgs, SettingsError};
pub use engine::{Call, Connector, Engine, EngineSettings, Row, RowResult};
