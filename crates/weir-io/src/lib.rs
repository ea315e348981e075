//! weir-io: where records come from and where outcomes go.

#![warn(missing_docs)]

pub mod sink;
pub mod source;

pub use sink::{default_errors_path, ErrorRow, JsonlWriter, OutputPath, ResultRow};
pub use source::{count_records, InputPath, RawLine};
