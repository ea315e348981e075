//! Resumable runs: the state directory, the run's identity, and recovery of the output files.
//!
//! # The journal is the output
//!
//! A finished record is one complete line in the results file or the errors file, and nothing
//! else. weir hands each row to the kernel as soon as no other row is waiting to be written (a
//! burst of rows in one `write`; see [`crate::writer`]), so the row *is* the journal entry:
//! there is no second record that could disagree with it, and a crash between "writing the row"
//! and "recording it" cannot happen because they are the same act.
//!
//! On resume, each file is scanned: every complete line that parses as a row is a finished
//! record; an unfinished last line (no newline), or zeros to the end (what a power loss can
//! leave), is a torn tail and is cut. A whole line that is not a row is never cut, nor anything
//! after it: the run is refused, naming the line, since the user may have edited the file. The
//! records of the dropped rows are simply requested again.
//!
//! Error rows that describe the run rather than the record (`aborted`: not tried;
//! `quota_exhausted`: a spent daily quota; `auth`: rejected credentials) are not finished:
//! resume removes them from the errors file (rewritten to a temporary file and renamed over it,
//! so a crash mid-way leaves the old or the new file, never a mix) and runs their records again.
//! With `--retry-errors`, every error row of a retryable kind is treated the same way.
//!
//! # Durability
//!
//! - A process that dies (Ctrl-C twice, SIGKILL, out of memory) loses nothing it wrote: each row
//!   reaches the kernel with a `write` before the next outcome is handled. At most the calls in
//!   flight at that moment are made again.
//! - A machine that dies may lose what the kernel had not yet written to disk: weir calls
//!   `fdatasync` on both files about once a second and at the end, so at most about the last
//!   second of rows is lost, then requested again on resume.
//! - The run's identity (`run.json`) is written to a temporary file, synced, and renamed.
//!
//! # Identity
//!
//! A state belongs to one run: the input (its path, size, and a hash of all of it up to
//! [`HASH_WHOLE_UP_TO`], else of its first and last 64 KiB; a stream is not read to identify
//! it), the model, the base URL, how prompts and ids are read, the system text and the
//! generation parameters. A command that differs in any of these but the base URL refuses to
//! resume and says what changed; `--fresh` starts over. Concurrency, timeouts and retries may
//! change freely. The base URL says where the model is served, not what it answers: a server
//! restarted on another port, or a replica behind another address, resumes (the run says so,
//! and the new URL is recorded) rather than paying again for every finished record.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use weir_core::{ErrorKind, RecordId};

/// What determines a run's results; stored as `run.json` in the state directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunIdentity {
    /// Format version of this file.
    pub version: u32,
    /// The input: `stdin`, or `path (size bytes, sha256 of head and tail)`.
    pub input: String,
    /// `provider/model`.
    pub model: String,
    /// The field naming each record's own model, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_field: Option<String>,
    /// The base URL, if one was given.
    pub base_url: Option<String>,
    /// `field:NAME` or `template:TEXT`.
    pub prompt: String,
    /// The id field, if any.
    pub id_field: Option<String>,
    /// System text.
    pub system: Option<String>,
    /// Generation parameters, as JSON.
    pub params: Value,
    /// How the model is called, when not the default: `task=embed`, `endpoint_format=chat`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<String>,
    /// Where and how the rows are written besides the output itself: the errors file, and a
    /// table's formats and kept columns. A resume with another errors file read an empty one,
    /// paid again for every record whose row was in the first, and left ids in both files; a
    /// table resumed with other `--keep-columns` or another `--output-format` mixed parts of two
    /// shapes. (Absent from a state written before it was kept: not compared then.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs: Option<String>,
}

impl RunIdentity {
    /// What differs between a stored identity and this one, as `name: old → new`.
    pub fn differences(&self, stored: &RunIdentity) -> Vec<String> {
        let mut d = Vec::new();
        let mut cmp = |name: &str, old: String, new: String| {
            if old != new {
                d.push(format!("{name}: {old} → {new}"));
            }
        };
        let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "(none)".into());
        cmp("input", stored.input.clone(), self.input.clone());
        cmp("model", stored.model.clone(), self.model.clone());
        cmp("model field", opt(&stored.model_field), opt(&self.model_field));
        cmp("prompt", stored.prompt.clone(), self.prompt.clone());
        cmp("id field", opt(&stored.id_field), opt(&self.id_field));
        cmp("system text", opt(&stored.system), opt(&self.system));
        cmp("parameters", stored.params.to_string(), self.params.to_string());
        cmp("call", opt(&stored.call), opt(&self.call));
        if let (Some(old), Some(new)) = (&stored.outputs, &self.outputs) {
            cmp("outputs", old.clone(), new.clone());
        }
        d
    }

    /// The base URL's change from a stored identity, as `old → new`, if it changed: not one of
    /// the [`differences`](Self::differences) that refuse a resume (see the module's docs).
    pub fn moved(&self, stored: &RunIdentity) -> Option<String> {
        base_url_moved(&stored.base_url, &self.base_url)
    }
}

/// A base URL's change from `old` to `new` (`None`: the provider's own), as `old → new`, if it
/// changed: a trailing `/` is the same root.
pub fn base_url_moved(old: &Option<String>, new: &Option<String>) -> Option<String> {
    let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "the provider's own".into());
    let root = |o: &Option<String>| o.as_deref().map(|u| u.trim_end_matches('/').to_string());
    (root(old) != root(new)).then(|| format!("{} → {}", opt(old), opt(new)))
}

/// The base URL the earlier run of `output_name` recorded (`Some(None)`: the provider's own), if
/// a run was recorded: where its provider batch jobs are, which `--fresh` must ask about them.
pub fn recorded_base_url(dir: &Path, output_name: &str) -> Option<Option<String>> {
    let bytes = std::fs::read(dir.join("runs").join(format!("{output_name}.json"))).ok()?;
    serde_json::from_slice::<RunIdentity>(&bytes).ok().map(|i| i.base_url)
}

/// Inputs up to this size are hashed whole; larger ones by their first and last 64 KiB.
pub const HASH_WHOLE_UP_TO: u64 = 128 * 1024 * 1024;

/// Describes an input file tightly: its canonical path, size, and a hash of all of it when it
/// is at most [`HASH_WHOLE_UP_TO`] bytes (a fraction of a second), else of its first and last
/// 64 KiB (hashing all of a very large input would delay every start; a same-size edit in its
/// middle then goes unnoticed, as the README says).
pub fn input_identity(path: &Path) -> io::Result<String> {
    const SPAN: u64 = 64 * 1024;
    let mut f = File::open(path)?;
    let size = f.metadata()?.len();
    let mut h = Sha256::new();
    if size <= HASH_WHOLE_UP_TO {
        io::copy(&mut f, &mut HashWriter(&mut h))?;
    } else {
        let mut buf = vec![0u8; SPAN as usize];
        f.read_exact(&mut buf)?;
        h.update(&buf);
        f.seek(SeekFrom::Start(size - SPAN))?;
        f.read_exact(&mut buf)?;
        h.update(&buf);
    }
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let digest: [u8; 32] = h.finalize().into();
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{} ({size} bytes, {hex})", abs.display()))
}

struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Why the state directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The stored run differs from this command.
    #[error("the state in {dir} belongs to a different run ({changes}); run with --fresh to start over, or use another --output or --state")]
    Mismatch {
        /// The state directory.
        dir: String,
        /// What changed.
        changes: String,
    },
    /// Another weir process holds the lock.
    #[error("another weir run is writing {output} (lock {lock}); wait for it to finish")]
    Locked {
        /// The output file.
        output: String,
        /// The lock file.
        lock: String,
    },
    /// A file could not be read or written.
    #[error("state directory {path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// The error.
        source: io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StateError + '_ {
    move |source| StateError::Io { path: path.display().to_string(), source }
}

/// An open state directory, locked for this run until dropped.
#[derive(Debug)]
pub struct StateDir {
    /// The directory.
    pub dir: PathBuf,
    meta: PathBuf,
    _lock: File,
    moved: Option<String>,
}

impl StateDir {
    /// The base URL's change (`old → new`) when the earlier run resumed used another one: the
    /// run says so and records the new one ([`StateDir::record`]) once nothing refuses it.
    pub fn moved(&self) -> Option<&str> {
        self.moved.as_deref()
    }

    /// A file of this output's run beside its record (`runs/<output>.<ext>`): its time series
    /// (`series.json`) and the like.
    pub fn file(&self, ext: &str) -> PathBuf {
        self.meta.with_extension(ext)
    }

    /// Notes the size and edges of this run's output files as it ends (see `stamp`), so that the
    /// next run of the command can tell whether another run wrote them since
    /// ([`StateDir::written_since`]). Best effort: a note that cannot be written checks nothing.
    pub fn note_closed(&self, files: &[&Path]) {
        let text: String = files.iter().map(|f| stamp(f) + "\n").collect();
        let _ = write_atomic(&self.file("closed"), text.as_bytes());
    }

    /// Drops the note of [`StateDir::note_closed`]: a run that writes the files now and is
    /// killed leaves them other than noted.
    pub fn forget_closed(&self) {
        let _ = std::fs::remove_file(self.file("closed"));
    }

    /// Which of `files` (as noted when the last run of this command ended) has another size or
    /// other first or last 64 KiB now: another run wrote it since (one from another directory, with
    /// `--overwrite`), and what it holds is not what the earlier run finished. `None` when all
    /// are as noted, or nothing was noted (that run was killed, or ran before notes were kept).
    pub fn written_since(&self, files: &[&Path]) -> Option<PathBuf> {
        let noted = std::fs::read_to_string(self.file("closed")).ok()?;
        let noted: Vec<&str> = noted.lines().collect();
        if noted.len() != files.len() {
            return None;
        }
        files.iter().zip(noted).find(|(f, n)| stamp(f) != *n).map(|(f, _)| f.to_path_buf())
    }

    /// Records `identity` as this output's run. Called once the run is sure to start (after
    /// every check), so a refused command leaves no state that a later run would resume.
    pub fn record(&self, identity: &RunIdentity) -> Result<(), StateError> {
        let bytes = serde_json::to_vec_pretty(identity)
            .map_err(|e| StateError::Io { path: self.meta.display().to_string(), source: io::Error::other(e) })?;
        write_atomic(&self.meta, &bytes).map_err(io_err(&self.meta))
    }
}

/// What `note_closed` keeps of a file: its size and a digest of its first and last 64 KiB
/// (rows another run wrote differ there), not its time, which `touch` or a copy changes with
/// nothing else. A file that is missing or empty is `0` alike (an empty errors file removed).
fn stamp(f: &Path) -> String {
    const EDGE: u64 = 64 << 10;
    let edges = || -> io::Result<Option<String>> {
        let mut file = File::open(f)?;
        let len = file.metadata()?.len();
        if len == 0 {
            return Ok(None);
        }
        // The head, then the tail past it (all of a file under twice the edge).
        let (head, tail) = (EDGE.min(len), (len - EDGE.min(len)).min(EDGE));
        let mut bytes = vec![0u8; (head + tail) as usize];
        file.read_exact(&mut bytes[..head as usize])?;
        file.seek(SeekFrom::Start(len - tail))?;
        file.read_exact(&mut bytes[head as usize..])?;
        let d: [u8; 32] = Sha256::digest(&bytes).into();
        Ok(Some(format!("{len} {:032x}", u128::from_le_bytes(d[..16].try_into().expect("16 bytes")))))
    };
    edges().ok().flatten().unwrap_or_else(|| "0".into())
}

/// An exact key: 128 bits of SHA-256. Unlike a 64-bit hash, no two ids of a realistic dataset
/// share one (a collision would silently skip a record).
pub type Key = u128;

fn digest(parts: &[&[u8]]) -> Key {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let d: [u8; 32] = h.finalize().into();
    u128::from_le_bytes(d[..16].try_into().expect("16 bytes"))
}

/// The key under which a finished record is remembered: its id (if known, with its JSON type)
/// and its line.
pub fn finished_key(id: Option<&RecordId>, line: u64) -> Key {
    let id = id.map(RecordId::key_bytes).unwrap_or_default();
    digest(&[&id, &line.to_le_bytes()])
}

/// What an `invalid_input` error row for a repeated id says, and how it is known: its id is the
/// earlier line's record's, so it finishes no id of its own.
pub const DUPLICATE_ID: &str = "duplicate id '";

/// The key of an id alone, for the duplicate check.
pub fn id_key(id: &RecordId) -> Key {
    digest(&[&id.key_bytes()])
}

/// What an earlier run left.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Finished records, by [`finished_key`].
    pub finished: crate::KeySet,
    /// Finished ids, by [`id_key`]: what `--resume-stream` with `--id-field` goes by, where
    /// the same records may come in another order. An id's "duplicate id" error row does not
    /// finish it (the first line with the id may be unfinished).
    pub finished_ids: crate::KeySet,
    /// Result rows kept.
    pub results: u64,
    /// Error rows kept.
    pub errors: u64,
    /// Error rows removed so their records run again.
    pub requeued: u64,
    /// Error rows kept whose failure may pass on another try (a rate limit, a server error):
    /// what `--retry-errors` would run again, for the resumed run to say so.
    pub retryable: u64,
    /// Bytes of torn tails cut off.
    pub torn_bytes: u64,
}

impl Recovered {
    /// Finished records in all.
    pub fn finished_count(&self) -> u64 {
        self.results + self.errors
    }
}

/// Opens (creating) the state directory for `output_name`, locks it, and checks the stored
/// identity against `identity`; returns whether an earlier run of this command is resumed. With
/// `fresh`, a stored identity is ignored. Nothing is recorded until [`StateDir::record`].
pub fn open(
    dir: &Path,
    output_name: &str,
    identity: &RunIdentity,
    fresh: bool,
) -> Result<(StateDir, bool), StateError> {
    let runs = dir.join("runs");
    std::fs::create_dir_all(&runs).map_err(io_err(&runs))?;
    let lock_path = runs.join(format!("{output_name}.lock"));
    let lock =
        OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(io_err(&lock_path))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(StateError::Locked { output: output_name.into(), lock: lock_path.display().to_string() })
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(StateError::Io { path: lock_path.display().to_string(), source: e })
        }
    }
    let meta = runs.join(format!("{output_name}.json"));
    let mut resuming = false;
    let mut moved = None;
    if !fresh {
        match std::fs::read(&meta) {
            Ok(bytes) => {
                let stored: Option<RunIdentity> = serde_json::from_slice(&bytes).ok();
                match stored {
                    Some(stored) => {
                        let diffs = identity.differences(&stored);
                        if !diffs.is_empty() {
                            return Err(StateError::Mismatch {
                                dir: dir.display().to_string(),
                                changes: diffs.join("; "),
                            });
                        }
                        resuming = true;
                        // Recorded by the caller ([`StateDir::record`]) once nothing else
                        // refuses the run.
                        moved = identity.moved(&stored);
                    }
                    None => {
                        return Err(StateError::Mismatch {
                            dir: dir.display().to_string(),
                            changes: format!("{} is unreadable", meta.display()),
                        })
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(StateError::Io { path: meta.display().to_string(), source: e }),
        }
    }
    Ok((StateDir { dir: dir.to_path_buf(), meta, _lock: lock, moved }, resuming))
}

/// Writes a file so that a crash leaves the old content or the new, never a mix.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// The state directory of an output when none is given: `.weir/` beside it.
pub fn default_dir(output: &Path) -> PathBuf {
    crate::paths::parent_dir(output).join(".weir")
}

/// The name of a file output's state in state directory `dir`: its file name in the default
/// `.weir/` beside it, where that is unique; in a directory shared by outputs of several
/// directories (`--state`), which must tell `a/r.jsonl` from `b/r.jsonl`, with a digest of the
/// output's full path ([`shared_name`]).
pub fn output_state_name(output: &Path, dir: &Path) -> String {
    let base = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "output".into());
    let beside = default_dir(output);
    if crate::paths::file_id(&beside).ok() != crate::paths::file_id(dir).ok() {
        shared_name(output, &base)
    } else {
        base
    }
}

/// The name of an output's state in a state directory shared by outputs of several
/// directories: its file name and a digest of its full path (`r.jsonl-3f2a9c1b7d04`).
pub fn shared_name(output: &Path, base: &str) -> String {
    use sha2::{Digest, Sha256};
    let parent = crate::paths::parent_dir(output);
    let full = std::fs::canonicalize(parent).unwrap_or_else(|_| parent.to_path_buf()).join(base);
    let digest = Sha256::digest(full.to_string_lossy().as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("{base}-{hex}")
}

/// Parses a row enough to know whose it is: `(id, line, kind)`.
fn row_identity(line: &[u8]) -> Option<(Option<RecordId>, u64, Option<String>)> {
    #[derive(Deserialize)]
    struct Row {
        id: Option<Value>,
        line: u64,
        kind: Option<String>,
    }
    let r: Row = serde_json::from_slice(line).ok()?;
    Some((r.id.as_ref().and_then(RecordId::from_value), r.line, r.kind))
}

/// Scans a JSONL file of rows: calls `keep` for each complete, parseable row, cuts a torn tail.
/// Returns the bytes cut.
fn scan(path: &Path, mut keep: impl FnMut(&[u8], Option<RecordId>, u64, Option<String>)) -> io::Result<u64> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    let mut reader = BufReader::with_capacity(256 * 1024, file);
    let mut offset = 0u64;
    let mut buf = Vec::new();
    let mut number = 0u64;
    loop {
        buf.clear();
        let n = reader.read_until(b'\n', &mut buf)?;
        if n == 0 {
            break;
        }
        number += 1;
        if buf.last() != Some(&b'\n') {
            // The last line, unfinished: the write it belongs to was cut. Only this is cut.
            break;
        }
        match row_identity(&buf[..n - 1]) {
            Some((id, line, kind)) => {
                keep(&buf[..n], id, line, kind);
                offset += n as u64;
            }
            None if buf[..n - 1].iter().all(|b| *b == 0 || b.is_ascii_whitespace()) && is_rest_blank(&mut reader)? => {
                // Zeros or blanks to the end: what a power loss leaves after the last write.
                break;
            }
            None => {
                // A whole line that is not a row weir wrote (edited by hand, or another file):
                // never cut rows that may follow it.
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "line {number} of {} is not a result row weir wrote; weir only cuts an unfinished last line, \
                         so fix or remove that line, or start over with --fresh",
                        path.display()
                    ),
                ));
            }
        }
    }
    if offset < len {
        let f = OpenOptions::new().write(true).open(path)?;
        f.set_len(offset)?;
        f.sync_all()?;
    }
    Ok(len - offset)
}

/// True when nothing but zeros and whitespace is left to read.
fn is_rest_blank(reader: &mut impl BufRead) -> io::Result<bool> {
    loop {
        let chunk = reader.fill_buf()?;
        if chunk.is_empty() {
            return Ok(true);
        }
        if !chunk.iter().all(|b| *b == 0 || b.is_ascii_whitespace()) {
            return Ok(false);
        }
        let n = chunk.len();
        reader.consume(n);
    }
}

/// Recovers the finished records from the results and errors files of an earlier run, cutting
/// torn tails and requeueing error rows whose records should run again.
pub fn recover(results: &Path, errors: &Path, retry_errors: bool) -> io::Result<Recovered> {
    let mut r = Recovered::default();
    r.torn_bytes += scan(results, |_, id, line, _| {
        r.finished.insert(finished_key(id.as_ref(), line));
        if let Some(id) = &id {
            r.finished_ids.insert(id_key(id));
        }
        r.results += 1;
    })?;
    let mut kept = Vec::new();
    let mut requeued = 0;
    let mut retryable = 0;
    let mut finished = Vec::new();
    let torn = scan(errors, |bytes, id, line, kind| {
        let kind = kind.unwrap_or_default();
        let parsed = ErrorKind::parse(&kind);
        let rerun = parsed.is_some_and(|k| k.is_about_the_run() || (retry_errors && k.is_retryable()));
        if rerun {
            requeued += 1;
        } else {
            if parsed.is_some_and(|k| k.is_retryable()) {
                retryable += 1;
            }
            kept.extend_from_slice(bytes);
            let duplicate =
                kind == "invalid_input" && bytes.windows(DUPLICATE_ID.len()).any(|w| w == DUPLICATE_ID.as_bytes());
            finished.push((id, line, duplicate));
        }
    })?;
    r.torn_bytes += torn;
    if requeued > 0 {
        write_atomic(errors, &kept)?;
    }
    for (id, line, duplicate) in finished {
        r.finished.insert(finished_key(id.as_ref(), line));
        if let (Some(id), false) = (&id, duplicate) {
            r.finished_ids.insert(id_key(id));
        }
        r.errors += 1;
    }
    r.requeued = requeued;
    r.retryable = retryable;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("weir-state-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn identity(model: &str) -> RunIdentity {
        RunIdentity {
            version: 1,
            input: "in.jsonl (10 bytes, ab)".into(),
            model: model.into(),
            model_field: None,
            base_url: None,
            prompt: "field:prompt".into(),
            id_field: None,
            system: None,
            params: serde_json::json!({"temperature": 0.5}),
            call: None,
            outputs: None,
        }
    }

    #[test]
    fn a_changed_run_refuses_to_resume_and_fresh_starts_over() {
        let d = tmpdir("identity");
        let (s, resuming) = open(&d, "out.jsonl", &identity("sim/a"), false).unwrap();
        assert!(!resuming);
        drop(s);
        // Nothing was recorded: still a new run.
        let (s, resuming) = open(&d, "out.jsonl", &identity("sim/a"), false).unwrap();
        assert!(!resuming);
        s.record(&identity("sim/a")).unwrap();
        drop(s);
        let (s, resuming) = open(&d, "out.jsonl", &identity("sim/a"), false).unwrap();
        assert!(resuming);
        // Locked while held.
        assert!(matches!(open(&d, "out.jsonl", &identity("sim/a"), false), Err(StateError::Locked { .. })));
        drop(s);
        let e = open(&d, "out.jsonl", &identity("sim/b"), false).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("model: sim/a → sim/b") && msg.contains("--fresh"), "{msg}");
        let (_s, resuming) = open(&d, "out.jsonl", &identity("sim/b"), true).unwrap();
        assert!(!resuming);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn another_base_url_resumes_and_is_recorded() {
        let d = tmpdir("moved");
        let at = |url: &str| RunIdentity { base_url: Some(url.into()), ..identity("sim/a") };
        let (s, _) = open(&d, "out.jsonl", &at("http://127.0.0.1:8000/v1"), false).unwrap();
        s.record(&at("http://127.0.0.1:8000/v1")).unwrap();
        drop(s);
        let (s, resuming) = open(&d, "out.jsonl", &at("http://127.0.0.1:8001/v1"), false).unwrap();
        assert!(resuming);
        assert_eq!(s.moved(), Some("http://127.0.0.1:8000/v1 → http://127.0.0.1:8001/v1"));
        drop(s);
        // Not recorded until the caller says: said again.
        let (s, _) = open(&d, "out.jsonl", &at("http://127.0.0.1:8001/v1/"), false).unwrap();
        assert!(s.moved().is_some());
        s.record(&at("http://127.0.0.1:8001/v1")).unwrap();
        drop(s);
        // The new URL was recorded: the next run with it (a trailing `/` or not) has nothing to say.
        let (s, _) = open(&d, "out.jsonl", &at("http://127.0.0.1:8001/v1/"), false).unwrap();
        assert!(s.moved().is_none());
        drop(s);
        let (s, resuming) = open(&d, "out.jsonl", &at("http://127.0.0.1:8001/v1"), false).unwrap();
        assert!(resuming && s.moved().is_none());
        drop(s);
        // Another change with it still refuses.
        let other = RunIdentity { model: "sim/b".into(), ..at("http://127.0.0.1:8002/v1") };
        let msg = open(&d, "out.jsonl", &other, false).unwrap_err().to_string();
        assert!(msg.contains("model: sim/a → sim/b") && !msg.contains("base URL"), "{msg}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn torn_tails_are_cut_and_unfinished_errors_requeued() {
        let d = tmpdir("recover");
        let res = d.join("r.jsonl");
        let err = d.join("e.jsonl");
        std::fs::write(&res, b"{\"id\":\"a\",\"line\":1,\"response\":\"x\"}\n{\"id\":\"b\",\"line\":2,\"response\":\"y\"}\n{\"id\":\"c\",\"li").unwrap();
        std::fs::write(
            &err,
            b"{\"id\":\"d\",\"line\":4,\"kind\":\"blocked\"}\n{\"id\":\"e\",\"line\":5,\"kind\":\"aborted\"}\n{\"id\":null,\"line\":6,\"kind\":\"invalid_input\"}\n{\"id\":\"f\",\"line\":7,\"kind\":\"server\"}\n",
        )
        .unwrap();
        let r = recover(&res, &err, false).unwrap();
        assert_eq!((r.results, r.errors, r.requeued), (2, 3, 1));
        assert!(r.torn_bytes > 0);
        assert_eq!(std::fs::read(&res).unwrap().iter().filter(|b| **b == b'\n').count(), 2);
        assert!(std::fs::read(&res).unwrap().ends_with(b"}\n"));
        let id = |s: &str| RecordId::from(s);
        assert!(r.finished.contains(&finished_key(Some(&id("a")), 1)));
        assert!(r.finished.contains(&finished_key(None, 6)));
        assert!(!r.finished.contains(&finished_key(Some(&id("e")), 5)));
        assert!(!String::from_utf8(std::fs::read(&err).unwrap()).unwrap().contains("aborted"));
        // --retry-errors also requeues retryable failures.
        let r = recover(&res, &err, true).unwrap();
        assert_eq!((r.errors, r.requeued), (2, 1));
        assert!(!r.finished.contains(&finished_key(Some(&id("f")), 7)));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_whole_line_that_is_not_a_row_is_never_cut_nor_what_follows() {
        let d = tmpdir("not-a-row");
        let res = d.join("r.jsonl");
        let err = d.join("e.jsonl");
        let rows = b"{\"id\":\"a\",\"line\":1}\ngarbage line\n{\"id\":\"b\",\"line\":2}\n{\"note\":\"mine\"}\n";
        std::fs::write(&res, rows).unwrap();
        let e = recover(&res, &err, false).unwrap_err().to_string();
        assert!(e.contains("line 2 of") && e.contains("--fresh"), "{e}");
        assert_eq!(std::fs::read(&res).unwrap(), rows, "nothing was cut");
        // A row-shaped JSON line that is not a row is refused the same way.
        std::fs::write(&res, b"{\"id\":\"a\",\"line\":1}\n{\"note\":\"mine\"}\n").unwrap();
        assert!(recover(&res, &err, false).is_err());
        // Zeros to the end (a power loss) are cut.
        let mut z = b"{\"id\":\"a\",\"line\":1}\n".to_vec();
        z.extend_from_slice(&[0u8; 100]);
        z.push(b'\n');
        z.extend_from_slice(&[0u8; 50]);
        std::fs::write(&res, &z).unwrap();
        let r = recover(&res, &err, false).unwrap();
        assert_eq!((r.results, r.torn_bytes), (1, 151));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
