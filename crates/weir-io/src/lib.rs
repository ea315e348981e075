//! weir-io: where records come from and where outcomes go, and what survives a crash.

#![warn(missing_docs)]

pub mod cache;
pub mod keyset;
pub mod paths;
pub mod sink;
pub mod source;
pub mod spillset;
pub mod state;
pub mod writer;

pub use cache::{CacheError, DiskCache};
pub use keyset::KeySet;
pub use sink::{default_errors_path, ErrorRow, EventError, EventRow, JsonlWriter, OutputPath, ResultRow};
pub use source::{count_records, InputPath, RawLine};
pub use spillset::SpillSet;
pub use writer::{EventSender, Events, Row, RowWriter, WriterSettings, WriterThread};
