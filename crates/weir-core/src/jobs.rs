//! The seam of provider batch-prediction jobs (the OpenAI Batch API, Gemini API batch mode,
//! Vertex AI `batchPredictionJobs`): many requests submitted at once, answered hours later at
//! about half the online price.
//!
//! A provider implements [`JobApi`]: it writes one request as a line of its job input, submits
//! lines as a job under a name weir chooses (so that a run that died between submitting and
//! recording the job's id can find it again instead of paying twice), reports the job's state,
//! and reads back one result per key. Waiting, splitting, resuming and falling back belong to
//! the caller (`weir-jobs`), as retrying belongs to the executor for online calls.

use bytes::Bytes;
use futures::{Stream, TryStreamExt};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::ModelError;
use crate::handler::ModelRequest;
use crate::outcome::ModelResponse;

/// Where a job stands, in weir's words (each provider has its own names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Accepted, not started (queued, validating).
    Pending,
    /// Answering (in progress, finalizing, cancelling).
    Running,
    /// Every request was tried; some may have failed alone.
    Succeeded,
    /// Ended with some requests answered and others not (Vertex `PARTIALLY_SUCCEEDED`).
    PartiallySucceeded,
    /// The job failed as a whole (its input was refused, say); it may hold no results.
    Failed,
    /// Cancelled; results finished before the cancel may be kept.
    Cancelled,
    /// Not done within the provider's window (24 h for OpenAI, 48 h for Gemini); results
    /// finished before may be kept.
    Expired,
}

impl JobState {
    /// The job will not change any more: its results can be read.
    pub fn is_terminal(self) -> bool {
        !matches!(self, JobState::Pending | JobState::Running)
    }

    /// The name shown in progress and status lines.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::PartiallySucceeded => "partially_succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::Expired => "expired",
        }
    }
}

/// A job's state and counts, as the provider reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStatus {
    /// Where it stands.
    pub state: JobState,
    /// Requests in the job (0 when the provider has not counted them yet).
    pub total: u64,
    /// Requests answered so far.
    pub completed: u64,
    /// Requests that failed so far.
    pub failed: u64,
    /// The provider's own words about a failed, cancelled or expired job.
    pub message: Option<String>,
    /// The job as the provider described it when asked, for [`JobApi::results`] to read
    /// instead of asking again (a Gemini job's description holds its answers: up to ~20 MB).
    pub described: Option<Arc<serde_json::Value>>,
}

/// How much one job may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobLimits {
    /// Requests per job.
    pub max_lines: usize,
    /// Bytes of the job's input (the file, or the inline request body).
    pub max_bytes: usize,
}

/// A submitted job: the provider's ids, which weir records before it waits on them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRef {
    /// The job's id or resource name.
    pub id: String,
    /// The id of its uploaded input file, when it has one (removed after the results are in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
}

/// A job's input as it goes to the provider: a file of lines, each from [`JobApi::line`] and
/// newline-terminated, read as it is sent. A job may carry up to a gigabyte (Vertex AI): it is
/// streamed from the disk, never held whole, and may be read again for another try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInput {
    /// The file.
    pub path: PathBuf,
    /// Its size in bytes (uploads declare it before they send).
    pub len: u64,
    /// Its requests.
    pub count: usize,
}

impl JobInput {
    /// The file's bytes in chunks of 64 KiB, from the start; opened when first polled.
    pub fn stream(&self) -> impl Stream<Item = std::io::Result<Bytes>> + Send + Sync + 'static {
        let path = self.path.clone();
        futures::stream::once(async move { tokio::fs::File::open(path).await })
            .map_ok(|f| tokio_util::io::ReaderStream::with_capacity(f, 64 * 1024))
            .try_flatten()
    }

    /// The whole file (for inputs small enough to send inline).
    pub async fn read(&self) -> std::io::Result<Vec<u8>> {
        tokio::fs::read(&self.path).await
    }
}

/// Cuts a download into lines as its chunks arrive: a job's results file may be hundreds of
/// megabytes, and is handed over a line at a time, never gathered.
#[derive(Debug, Default)]
pub struct LineSplitter {
    carry: Vec<u8>,
}

impl LineSplitter {
    /// Hands `each` every line `chunk` completes (without its `\n`).
    pub fn push<F: FnMut(&[u8]) + ?Sized>(&mut self, chunk: &[u8], each: &mut F) {
        self.carry.extend_from_slice(chunk);
        let mut start = 0;
        while let Some(n) = self.carry[start..].iter().position(|b| *b == b'\n') {
            each(&self.carry[start..start + n]);
            start += n + 1;
        }
        self.carry.drain(..start);
    }

    /// Hands `each` the last line, when the download did not end with a `\n`.
    pub fn finish<F: FnMut(&[u8]) + ?Sized>(&mut self, each: &mut F) {
        if !self.carry.is_empty() {
            each(&self.carry);
            self.carry.clear();
        }
    }
}

/// A job weir may have made without recording its id (the run stopped, or the answer to its
/// submission was lost, in between): what is known of it, for [`JobApi::find`] to look it up.
/// Providers that name jobs look for the name; Anthropic's Message Batches carry no name, and
/// are matched by their size and creation time instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sought {
    /// The name it was submitted under.
    pub name: String,
    /// Its requests.
    pub count: u64,
    /// When it was planned (seconds since the Unix epoch), if recorded: a job made for it was
    /// created after.
    pub since: Option<u64>,
    /// Ids of the run's jobs already recorded, which are other chunks' (never this one's).
    pub known: Vec<String>,
}

impl Sought {
    /// A job known by its name alone (a probe of whether the provider has jobs at all).
    pub fn named(name: &str) -> Self {
        Self { name: name.to_string(), count: 0, since: None, known: Vec::new() }
    }
}

/// One request's result from a job: its key and its answer or error.
pub type JobResult = (String, Result<ModelResponse, ModelError>);

/// A provider's batch-prediction jobs. Each method makes the calls it needs once; errors are
/// classified as for online calls (a retryable kind may be tried again by the caller).
#[async_trait::async_trait]
pub trait JobApi: Send + Sync {
    /// `provider/model`, as written in the output rows.
    fn model_id(&self) -> &str;

    /// How much one job may carry.
    fn limits(&self) -> JobLimits;

    /// One request as a line of the job's input, keyed by `key` (the provider echoes the key
    /// with its result: results come back in no particular order).
    fn line(&self, key: &str, request: &ModelRequest) -> Result<Vec<u8>, ModelError>;

    /// The key under which the result of `line` (made by [`line`](Self::line) for `key`) comes
    /// back, when it is not `key`: a provider that echoes no key of the caller's (Vertex AI's
    /// batch embeddings echo the instance alone) names results by their input. Records with
    /// the same answer key share one result.
    fn answer_key(&self, _key: &str, _line: &[u8]) -> Option<String> {
        None
    }

    /// Submits `input` as one job named `name`.
    async fn submit(&self, name: &str, input: &JobInput) -> Result<JobRef, ModelError>;

    /// The job submitted for `sought`, if the provider has one (a run that stopped between
    /// submitting and recording the id finds it here instead of submitting again).
    async fn find(&self, sought: &Sought) -> Result<Option<JobRef>, ModelError>;

    /// The job's state and counts.
    async fn status(&self, job: &JobRef) -> Result<JobStatus, ModelError>;

    /// The results a terminal job holds, one per key it answered or failed, each handed to
    /// `each` as it is read (a job may answer 200,000 requests: they are not gathered first);
    /// keys it left out have no result. Called again after an error, it hands them all over
    /// again. `status` is what [`status`](Self::status) last said of the job.
    async fn results(
        &self,
        job: &JobRef,
        status: &JobStatus,
        each: &mut (dyn FnMut(JobResult) + Send),
    ) -> Result<(), ModelError>;

    /// Asks the provider to cancel the job.
    async fn cancel(&self, job: &JobRef) -> Result<(), ModelError>;

    /// Frees what the job left behind at the provider (its input file), once its results are
    /// read. Failing to do so is not an error of the run.
    async fn clean_up(&self, _job: &JobRef) {}
}

/// Object storage where jobs whose provider reads input from a bucket (Vertex AI reads
/// `gs://`) are staged: weir writes each job's input there and reads the output directory the
/// provider writes. Kept apart from the providers so that they need no storage client of their
/// own; `weir-tables` implements it over `object_store`.
#[async_trait::async_trait]
pub trait JobStaging: Send + Sync {
    /// The URL (`gs://bucket/prefix/name`) of `name` under the staging prefix.
    fn url_of(&self, name: &str) -> String;

    /// Writes the file of `input` as `name` under the staging prefix, streamed (in parts when
    /// it is large), not read whole.
    async fn put(&self, name: &str, input: &JobInput) -> Result<(), ModelError>;

    /// Hands every line (without its `\n`) of every object under the directory `url` (which the
    /// provider named) to `each`, object by object in name order, as they are downloaded.
    async fn read_lines(&self, url: &str, each: &mut (dyn for<'a> FnMut(&'a [u8]) + Send)) -> Result<(), ModelError>;

    /// Deletes the object `url`. Failing to is not an error of the run.
    async fn delete(&self, url: &str);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines come out whole whatever the chunks' edges: split inside a line, several in one
    /// chunk, an empty line, and a last line without its `\n`.
    #[test]
    fn lines_are_whole_across_chunk_edges() {
        let text = b"alpha\nbe\n\ngamma delta\nlast";
        for cut in 1..text.len() {
            let mut got: Vec<Vec<u8>> = Vec::new();
            let mut each = |l: &[u8]| got.push(l.to_vec());
            let mut lines = LineSplitter::default();
            for chunk in text.chunks(cut) {
                lines.push(chunk, &mut each);
            }
            lines.finish(&mut each);
            let want: Vec<&[u8]> = vec![b"alpha", b"be", b"", b"gamma delta", b"last"];
            assert_eq!(got, want, "chunks of {cut}");
        }
    }
}
