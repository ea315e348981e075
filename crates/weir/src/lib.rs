//! The `weir` command's library half: the `weir run` pipeline, wired from the library crates,
//! and its report. The binary (`main.rs`) only parses flags and maps results to exit codes.

#![warn(missing_docs)]

pub mod cost;
mod drain;
mod input;
pub mod jobs;
pub mod metrics_server;
mod output;
pub mod pipeline;
pub mod report;
mod resume;

pub use drain::BY_SIGTERM;
pub use pipeline::{run, EventsTo, RunError, RunSettings, StateMode, TableIn, TableOut};
pub use report::RunReport;
