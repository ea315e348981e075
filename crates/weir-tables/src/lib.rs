//! weir-tables: datasets where they live. JSONL, CSV and Parquet, read and written locally or
//! in `s3://` and `gs://` through `object_store`, with a journal that makes a run over them
//! resumable whatever the output's format and location.
//!
//! The pipeline reads records as JSON-object lines ([`read`]) and hands outcomes to a writer
//! ([`write`]) that puts them in parts committed with the [`journal`] at checkpoints.

#![warn(missing_docs)]

pub mod format;
pub mod journal;
pub mod location;
mod masked;
pub mod media;
pub mod read;
pub mod schema;
pub mod staging;
pub mod write;

pub use arrow_schema::SchemaRef;
pub use format::Format;
pub use journal::{Committed, Journal};
pub use location::{Location, Scheme};
pub use media::BucketMedia;
pub use read::TableInput;
pub use schema::{arrow_type_of, holds_text, shaped_column, OutputColumns, Task};
pub use staging::BucketStaging;
pub use write::{prepare, spawn, TableSettings};

/// Why a table cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The command must change (no such file, bad location, bad credentials setting): exit 2.
    #[error("{0}")]
    Usage(String),
    /// The store could not be reached or failed (not the command's fault): exit 3.
    #[error("{0}")]
    Unavailable(String),
}

impl TableError {
    /// A failed listing: a missing bucket or path is the command's to fix, anything else (an
    /// unreachable endpoint, a server error) is not.
    pub fn listing(what: &str, e: object_store::Error) -> Self {
        match e {
            object_store::Error::NotFound { .. } => TableError::Usage(format!("{what}: {e}")),
            e => TableError::Unavailable(format!("{what}: {e}")),
        }
    }
}
