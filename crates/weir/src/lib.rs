//! The `weir` command's library half: the `weir run` pipeline, wired from the library crates,
//! and its report. The binary (`main.rs`) only parses flags and maps results to exit codes.

#![warn(missing_docs)]

// Before the other modules, so that its `eprintln!` and `eprint!` are theirs.
#[macro_use]
mod stderr_lines;
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
