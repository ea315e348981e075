//! Writing result and error rows as JSONL.
//!
//! A result row: `{"id", "line", "input": {the input object, untouched}, "response", "finish_reason",
//! "usage", "model", "model_version", "attempts", "latency_ms"}`. Nesting the input keeps its
//! fields exactly as they were, whatever their names, and weir's fields never collide with them.
//!
//! An error row: `{"id", "line", "kind", "message", "status", "attempts", "input"}`, or `"raw"`
//! (the line as text) in place of `"input"` when the line was not a JSON object, so a failed
//! record can always be fixed and run again.

use serde::Serialize;
use serde_json::{Map, Value};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use weir_core::{ErrorKind, Failure, RecordId, Success, Usage};

/// Where rows go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputPath {
    /// Standard output (`-`, `/dev/stdout`).
    Stdout,
    /// A regular file (created, or truncated unless resumed).
    File(PathBuf),
    /// Something that exists and is not a regular file: a FIFO, a terminal, `/dev/stderr`. It is
    /// written to, never locked, truncated, read back or resumed.
    Stream(PathBuf),
}

impl OutputPath {
    /// `-` and `/dev/stdout` are stdout; an existing non-regular file, or anything under
    /// `/dev/` or `/proc/` (`/dev/stderr` redirected to a file is still not a file weir may put
    /// state beside), is a stream; anything else a file.
    pub fn parse(s: &str) -> Self {
        if matches!(s, "-" | "/dev/stdout" | "/dev/fd/1" | "/proc/self/fd/1") {
            Self::Stdout
        } else if s.starts_with("/dev/") || s.starts_with("/proc/") || crate::paths::is_stream(Path::new(s)) {
            Self::Stream(PathBuf::from(s))
        } else {
            Self::File(PathBuf::from(s))
        }
    }

    /// True for a regular file, the only kind of output a run can be resumed into.
    pub fn is_file(&self) -> bool {
        matches!(self, Self::File(_))
    }

    /// How to name it in messages.
    pub fn display(&self) -> String {
        match self {
            Self::Stdout => "stdout".into(),
            Self::File(p) | Self::Stream(p) => p.display().to_string(),
        }
    }
}

/// A JSONL writer.
pub struct JsonlWriter {
    /// The file's name, put before its errors (`out.jsonl: No space left on device`).
    name: Option<String>,
    out: BufWriter<Box<dyn Write + Send>>,
    file: Option<std::fs::File>,
    rows: u64,
    /// Set when the reader of a pipe went away.
    gone: Arc<AtomicBool>,
}

/// An output file opened and locked by [`claim`].
#[derive(Debug)]
pub struct Claimed {
    /// The locked handle (the lock lives as long as this handle or a clone of it).
    pub file: std::fs::File,
    /// True if this claim made the file: only then may a run refused before it starts remove
    /// it again (see [`remove_if_unused`]).
    pub created: bool,
}

/// Opens an output file for one run and locks it: created if missing, never truncated here,
/// opened for appending, and held with an advisory lock on the file itself, so two weir
/// processes can never write one file, whatever state directories they use. The lock goes
/// with the returned handle.
///
/// Whether this run created the file is decided by the create itself (`O_EXCL`), never by
/// looking first: two runs started together both see no file, and the one refused must not
/// believe it made the other's.
pub fn claim(path: &Path) -> io::Result<Claimed> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    match lock_path(path, |o| o.append(true))? {
        Some(claimed) => Ok(claimed),
        None => Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            "another weir run is writing this file; wait for it to finish or choose another path",
        )),
    }
}

/// Opens `path` (creating it if missing, with `options` for the rest) and takes its advisory
/// lock without waiting; `None` if another process holds it.
///
/// A refused or finished run may remove a file it created while still holding its lock; a
/// run that opened that file just before, and locks it just after, would hold a lock on a
/// file no longer in the directory and write rows nobody can read. So after locking, the path
/// must still name the locked file; if not, the open is made again.
pub fn lock_path(
    path: &Path,
    options: impl Fn(&mut std::fs::OpenOptions) -> &mut std::fs::OpenOptions,
) -> io::Result<Option<Claimed>> {
    for _ in 0..100 {
        let (file, created) = match options(std::fs::OpenOptions::new().write(true).create_new(true)).open(path) {
            Ok(f) => (f, true),
            // Something is there (a file, or a symlink, maybe to nothing yet): open it, making
            // what it names if missing, but never count it as made by this run.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                (options(std::fs::OpenOptions::new().write(true).create(true)).open(path)?, false)
            }
            Err(e) => return Err(e),
        };
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
        if names(path, &file)? {
            return Ok(Some(Claimed { file, created }));
        }
    }
    Err(io::Error::other("it was replaced again and again while being opened; is another program removing it?"))
}

/// True if `path` (followed through symlinks, as the open that claimed it was) names the very
/// file `file` is open on.
fn names(path: &Path, file: &std::fs::File) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let held = file.metadata()?;
    match std::fs::metadata(path) {
        Ok(m) => Ok(m.dev() == held.dev() && m.ino() == held.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes `path` if it still names `file` (whose lock the caller holds) and nothing was
/// written to it: what a run refused before it started does with a file its [`claim`]
/// created. A file another run holds, has replaced, or has written to is left alone.
pub fn remove_if_unused(path: &Path, file: &std::fs::File) {
    let empty = file.metadata().is_ok_and(|m| m.len() == 0);
    if empty && names(path, file).unwrap_or(false) {
        let _ = std::fs::remove_file(path);
    }
}

impl JsonlWriter {
    /// Writes to standard output.
    pub fn stdout() -> Self {
        Self::new(Box::new(io::stdout()), None)
    }

    /// Writes to a file opened by [`claim`] (rows go after what it holds), named `name` in its
    /// errors.
    pub fn to_file(file: std::fs::File, name: &str) -> io::Result<Self> {
        let mut w = Self::new(Box::new(file.try_clone()?), Some(file));
        w.name = Some(name.to_string());
        Ok(w)
    }

    /// `e`, naming the file it happened to.
    fn named(&self, e: io::Error) -> io::Error {
        match &self.name {
            Some(name) => io::Error::new(e.kind(), format!("{name}: {e}")),
            None => e,
        }
    }

    /// True once the reader of a pipe written to has gone away (`| head`): what is written
    /// after that is dropped.
    pub fn reader_gone(&self) -> bool {
        self.gone.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn new(out: Box<dyn Write + Send>, file: Option<std::fs::File>) -> Self {
        let gone = Arc::new(AtomicBool::new(false));
        let out: Box<dyn Write + Send> = match &file {
            Some(f) if f.metadata().is_ok_and(|m| m.is_file()) => out,
            _ => Box::new(Closable { inner: out, gone: gone.clone() }),
        };
        Self { name: None, out: BufWriter::with_capacity(256 * 1024, out), file, rows: 0, gone }
    }
}

/// A pipe, terminal or device whose reader may go away: a broken pipe is noted (not an error
/// that would stop the run before its rows are accounted for) and later writes are dropped.
struct Closable {
    inner: Box<dyn Write + Send>,
    gone: Arc<AtomicBool>,
}

impl Closable {
    fn absorb(&self, r: io::Result<usize>, len: usize) -> io::Result<usize> {
        match r {
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
                self.gone.store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(len)
            }
            r => r,
        }
    }
}

impl Write for Closable {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.gone.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(buf.len());
        }
        let r = self.inner.write(buf);
        self.absorb(r, buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.gone.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let r = self.inner.flush().map(|()| 0);
        self.absorb(r, 0).map(|_| ())
    }
}

impl JsonlWriter {
    /// Flushes and asks the kernel to put the rows on disk (`fdatasync`).
    pub fn sync(&mut self) -> io::Result<()> {
        self.out.flush().map_err(|e| self.named(e))?;
        if let Some(f) = &self.file {
            f.sync_data().map_err(|e| self.named(e))?;
        }
        Ok(())
    }

    /// A second handle on the file, so another thread can make written rows durable while
    /// this one keeps writing (`None` for stdout or a stream).
    pub fn sync_handle(&self) -> io::Result<Option<std::fs::File>> {
        self.file.as_ref().map(std::fs::File::try_clone).transpose()
    }

    /// Writes one row and its newline.
    pub fn write<T: Serialize>(&mut self, row: &T) -> io::Result<()> {
        self.write_line(row)?;
        self.rows += 1;
        Ok(())
    }

    /// Writes one line that is not a row (a stream event): not counted in [`rows`](Self::rows).
    pub fn write_line<T: Serialize>(&mut self, line: &T) -> io::Result<()> {
        serde_json::to_writer(&mut self.out, line)
            .map_err(io::Error::from)
            .and_then(|()| self.out.write_all(b"\n"))
            .map_err(|e| self.named(e))
    }

    /// Rows written.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Flushes buffered rows to the file.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush().map_err(|e| self.named(e))
    }
}

/// The default errors file beside an output file: `out.jsonl` → `out.errors.jsonl`; with
/// `--output -` (or a stream), `weir.errors.jsonl` in the working directory.
pub fn default_errors_path(output: &OutputPath) -> OutputPath {
    match output {
        OutputPath::Stdout | OutputPath::Stream(_) => OutputPath::File(PathBuf::from("weir.errors.jsonl")),
        OutputPath::File(p) => {
            let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
            let name = format!("{stem}.errors.jsonl");
            OutputPath::File(p.parent().unwrap_or(Path::new("")).join(name))
        }
    }
}

/// A result row, borrowed from a success.
#[derive(Debug, Serialize)]
pub struct ResultRow<'a> {
    /// The record's id, as the input wrote it.
    pub id: &'a RecordId,
    /// 1-based input line.
    pub line: u64,
    /// The input object, untouched.
    pub input: &'a Map<String, Value>,
    /// The generated text (absent for an embedding).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response: Option<&'a str>,
    /// The embedding vector, for an embedding model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embedding: Option<&'a [f32]>,
    /// The embedding's length.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<usize>,
    /// Why generation stopped.
    pub finish_reason: &'a str,
    /// Token usage.
    pub usage: &'a Usage,
    /// `provider/model`.
    pub model: &'a str,
    /// The model version that answered, when reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_version: Option<&'a str>,
    /// Calls made (0 when answered from the cache).
    pub attempts: u32,
    /// Milliseconds from the first attempt to the answer.
    pub latency_ms: u64,
}

impl<'a> ResultRow<'a> {
    /// The row of a success.
    pub fn of(s: &'a Success) -> Self {
        Self {
            id: &s.record.id,
            line: s.record.line,
            input: &s.record.input,
            response: s.response.embedding.is_none().then_some(s.response.text.as_str()),
            embedding: s.response.embedding.as_deref(),
            dimensions: s.response.embedding.as_ref().map(Vec::len),
            finish_reason: &s.response.finish_reason,
            usage: &s.response.usage,
            model: &s.model,
            model_version: s.response.model_version.as_deref(),
            attempts: s.attempts,
            latency_ms: s.latency.as_millis() as u64,
        }
    }
}

/// An error row, borrowed from a failure.
#[derive(Debug, Serialize)]
pub struct ErrorRow<'a> {
    /// The record's id, when it could be read.
    pub id: Option<&'a RecordId>,
    /// 1-based input line.
    pub line: u64,
    /// What went wrong.
    pub kind: ErrorKind,
    /// The explanation.
    pub message: &'a str,
    /// HTTP status of the last call, if any.
    pub status: Option<u16>,
    /// Calls made.
    pub attempts: u32,
    /// Whether a later run may succeed.
    pub retryable: bool,
    /// The input object, when the line parsed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<&'a Map<String, Value>>,
    /// The raw line, when it did not parse.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw: Option<&'a str>,
}

impl<'a> ErrorRow<'a> {
    /// The row of a failure.
    pub fn of(f: &'a Failure) -> Self {
        Self {
            id: f.id.as_ref(),
            line: f.line,
            kind: f.error.kind,
            message: &f.error.message,
            status: f.error.status,
            attempts: f.attempts,
            retryable: f.error.kind.may_succeed_later(),
            input: f.input.as_ref(),
            raw: f.raw.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_path_sits_beside_the_output() {
        assert_eq!(
            default_errors_path(&OutputPath::parse("out/res.jsonl")),
            OutputPath::File("out/res.errors.jsonl".into())
        );
        assert_eq!(default_errors_path(&OutputPath::parse("res")), OutputPath::File("res.errors.jsonl".into()));
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("weir-claim-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_refused_claim_knows_it_did_not_create_the_file() {
        let d = scratch("refused");
        let path = d.join("out.jsonl");
        let winner = claim(&path).unwrap();
        assert!(winner.created);
        let refused = claim(&path).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::WouldBlock);
        // The winner's file is still there, and its claim alone may remove it while empty.
        assert!(path.exists());
        remove_if_unused(&path, &winner.file);
        assert!(!path.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn only_an_empty_file_the_path_still_names_is_removed() {
        let d = scratch("unused");
        let path = d.join("out.jsonl");
        let mut first = claim(&path).unwrap();
        first.file.write_all(b"{}\n").unwrap();
        remove_if_unused(&path, &first.file);
        assert!(path.exists(), "a file with rows is never removed");
        drop(first);
        // Replaced under the same name: the old handle no longer names it.
        let old = claim(&path).unwrap();
        assert!(!old.created);
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"").unwrap();
        remove_if_unused(&path, &old.file);
        assert!(path.exists(), "another file at the path is left alone");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_lock_taken_on_a_removed_file_is_taken_again_on_the_new_one() {
        let d = scratch("relock");
        let path = d.join("out.jsonl");
        let holder = claim(&path).unwrap();
        // Another run opens the file and waits to lock it while the holder removes it.
        let waiting = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        remove_if_unused(&path, &holder.file);
        drop(holder);
        drop(waiting);
        let next = claim(&path).unwrap();
        assert!(next.created && path.exists());
        let racers: Vec<_> = (0..8)
            .map(|_| {
                let path = path.clone();
                std::thread::spawn(move || claim(&path).map(|c| (c.created, c.file)))
            })
            .collect();
        let won: Vec<_> = racers.into_iter().filter_map(|t| t.join().unwrap().ok()).collect();
        assert!(won.is_empty(), "the file is held: every other claim is refused");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn many_claims_started_together_leave_exactly_one_file_held() {
        for round in 0..200 {
            let d = scratch(&format!("together{round}"));
            let path = d.join("out.jsonl");
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
            let runs: Vec<_> = (0..4)
                .map(|_| {
                    let (path, barrier) = (path.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        match claim(&path) {
                            Ok(mut c) => {
                                // The winner writes; it must be writing the file at the path.
                                c.file.write_all(b"row\n").unwrap();
                                Some(c)
                            }
                            // A refused run cleans up as the pipeline does.
                            Err(_) => None,
                        }
                    })
                })
                .collect();
            let won: Vec<_> = runs.into_iter().filter_map(|t| t.join().unwrap()).collect();
            assert_eq!(won.len(), 1);
            assert_eq!(std::fs::read(&path).unwrap(), b"row\n");
            std::fs::remove_dir_all(&d).unwrap();
        }
    }
}

/// A piece of a streamed answer, as `--stream` writes it: `{"id", "seq", "delta"}`, or
/// `{"id", "seq", "restart": true}` when the call is made again from the start (the consumer
/// drops the text it holds for that id). `seq` counts a record's events from 0.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EventRow {
    /// The record's id, as its rows write it.
    pub id: RecordId,
    /// The event's place among the record's events, from 0.
    pub seq: u64,
    /// More text of the answer, in order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<String>,
    /// The text so far is void: the call is being made again.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub restart: bool,
    /// The record failed (its error row is in the errors file): the last event of a record that
    /// has no result row, so a consumer of the events knows it ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<EventError>,
}

/// Why a streamed record failed, in its last event.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EventError {
    /// The error's kind, as in the error row.
    pub kind: String,
    /// What went wrong.
    pub message: String,
}
