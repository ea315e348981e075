//! What the reading end of `weir run` hands on: a record to call for, a line that ended
//! without a call (it did not parse), or an input that could not be read. Shared by the online
//! pipeline and the batch-job front, which both take it.

use weir_core::{Failure, Record};

/// One item from the input.
pub(crate) enum Work {
    /// A record to call the model for.
    Call(Record),
    /// A line that is already a failure (it did not parse).
    Done(Box<Failure>),
    /// The input could not be read on.
    ReadError(std::io::Error),
}
