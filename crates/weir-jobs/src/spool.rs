//! Spools: the records of a run's chunks, on disk beside the ledger, so that a batch run holds
//! in memory only the chunk being cut and the job being collected, whatever its input's size.
//!
//! A spool is two files: `s{N}.records`, one line per record (its key, its input line, the
//! caller's record to hand back with its answer, and whether the caller answered it itself
//! from its cache), and `s{N}.body`, the job's input exactly as it is uploaded. Both are on the
//! disk before the ledger names the spool; the body is removed once the provider has the job,
//! the records when the run has written every row. A spool no chunk of the ledger names (cut
//! but not planned when a run stopped) is removed when the next run opens the spools: its
//! records were never claimed from the input, which that run reads again.

use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::ledger::Ledger;

/// One record of a spool.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// The key its request carries through the job.
    #[serde(rename = "k")]
    pub key: String,
    /// Its line in the input.
    #[serde(rename = "l")]
    pub line: u64,
    /// The caller's record, handed back with its answer.
    #[serde(rename = "r")]
    pub record: crate::Record,
    /// Answered by the caller itself (from its cache), so not in the job: it is in the spool
    /// only so that the spool accounts for every record of its input lines.
    #[serde(rename = "a", default, skip_serializing_if = "std::ops::Not::not")]
    pub answered: bool,
    /// The key its result comes back under, when the provider does not echo `key`
    /// ([`weir_core::JobApi::answer_key`]).
    #[serde(rename = "m", default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
}

/// A spool file that cannot be read or written.
#[derive(Debug, thiserror::Error)]
#[error("batch job spool {path}: {message}")]
pub struct SpoolError {
    /// The file.
    pub path: String,
    /// What failed.
    pub message: String,
}

fn err(path: &Path, e: impl std::fmt::Display) -> SpoolError {
    SpoolError { path: path.display().to_string(), message: e.to_string() }
}

/// The spools of one run.
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    next: u32,
}

impl Spool {
    /// The records file of spool `id` in `dir`.
    pub fn records_path(dir: &Path, id: u32) -> PathBuf {
        dir.join(format!("s{id}.records"))
    }

    fn body_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!("s{id}.body"))
    }

    /// Opens the spools of `ledger`'s run, removing every spool its chunks do not name.
    pub fn open(ledger: &Ledger) -> Result<Self, SpoolError> {
        let dir = Ledger::spool_dir_of(ledger.path());
        std::fs::create_dir_all(&dir).map_err(|e| err(&dir, e))?;
        let named: std::collections::HashSet<u32> = ledger.chunks().filter_map(|c| c.spool).collect();
        let mut next = named.iter().max().map_or(0, |m| m + 1);
        // A spool's body is removed only once its job is made (recorded in the ledger first):
        // an unnamed spool with records and no body had a job, which the ledger lost (cut or
        // changed by hand). Its records would be sent and paid for again: said, not done.
        let exists = |p: PathBuf| p.exists();
        for entry in std::fs::read_dir(&dir).map_err(|e| err(&dir, e))? {
            let path = entry.map_err(|e| err(&dir, e))?.path();
            let id = path.file_stem().and_then(|s| s.to_str()).and_then(|s| s.strip_prefix('s'));
            let Some(id) = id.and_then(|n| n.parse::<u32>().ok()) else { continue };
            let records = path.extension().is_some_and(|e| e == "records");
            if records && !named.contains(&id) && !exists(dir.join(format!("s{id}.body"))) {
                return Err(err(
                    ledger.path(),
                    format!(
                        "spool {id} was submitted as a job, but the ledger does not name it (the ledger was cut \
                         or changed by hand): its records would be paid for again. Restore the ledger, or \
                         start over with --fresh once its jobs have ended"
                    ),
                ));
            }
        }
        for entry in std::fs::read_dir(&dir).map_err(|e| err(&dir, e))? {
            let path = entry.map_err(|e| err(&dir, e))?.path();
            let id = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.strip_prefix('s'))
                .and_then(|n| n.parse::<u32>().ok());
            match id {
                Some(id) if named.contains(&id) => {}
                _ => {
                    if let Some(id) = id {
                        next = next.max(id + 1);
                    }
                    std::fs::remove_file(&path).map_err(|e| err(&path, e))?;
                }
            }
        }
        Ok(Self { dir, next })
    }

    /// A new spool to write.
    pub fn writer(&mut self, round: u32, from_input: bool) -> Result<SpoolWriter, SpoolError> {
        let id = self.next;
        self.next += 1;
        let create = |p: PathBuf| File::create(&p).map(BufWriter::new).map_err(|e| err(&p, e));
        Ok(SpoolWriter {
            id,
            round,
            from_input,
            records: create(Self::records_path(&self.dir, id))?,
            body: create(self.body_path(id))?,
            count: 0,
            bytes: 0,
            lines: None,
            dir: self.dir.clone(),
        })
    }

    /// The records of spool `id`, in the order they were written.
    pub fn entries(&self, id: u32) -> Result<impl Iterator<Item = Result<Entry, SpoolError>>, SpoolError> {
        let path = Self::records_path(&self.dir, id);
        let f = File::open(&path).map_err(|e| err(&path, e))?;
        Ok(BufReader::new(f).lines().map(move |line| {
            let line = line.map_err(|e| err(&path, e))?;
            serde_json::from_str(&line).map_err(|e| err(&path, e))
        }))
    }

    /// The job input of spool `id`, of `count` requests, to be streamed from the disk; `None`
    /// once its job is made.
    pub fn body(&self, id: u32, count: u64) -> Result<Option<weir_core::JobInput>, SpoolError> {
        let path = self.body_path(id);
        match std::fs::metadata(&path) {
            Ok(m) => Ok(Some(weir_core::JobInput { path, len: m.len(), count: count as usize })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(err(&path, e)),
        }
    }

    /// Removes spool `id`'s job input (the provider has its job).
    pub fn drop_body(&self, id: u32) {
        let _ = std::fs::remove_file(self.body_path(id));
    }

    /// Removes spool `id` altogether (cut, but it holds no request for a job).
    pub fn discard(&self, id: u32) {
        // The records first: a body left alone is taken for a spool never planned.
        let _ = std::fs::remove_file(Self::records_path(&self.dir, id));
        self.drop_body(id);
    }

    /// Records waiting for a job in the run whose ledger is at `ledger` and whose chunks are
    /// `chunks` (as [`Ledger::read`] gives them): the spools cut from its input, or being cut,
    /// that no chunk names yet (`--max-jobs` holds them back, or the run is still reading),
    /// counted without writing anything. Spools and records.
    pub fn queued(ledger: &Path, chunks: &[crate::Chunk]) -> (u64, u64) {
        let named: std::collections::HashSet<u32> = chunks.iter().filter_map(|c| c.spool).collect();
        let Ok(entries) = std::fs::read_dir(Ledger::spool_dir_of(ledger)) else { return (0, 0) };
        let (mut spools, mut records) = (0, 0);
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_prefix('s')?.strip_suffix(".records")?.parse().ok())
            else {
                continue;
            };
            if named.contains(&id) {
                continue;
            }
            let Ok(f) = File::open(e.path()) else { continue };
            let n = BufReader::new(f).lines().map_while(Result::ok).filter(|l| !l.ends_with(",\"a\":true}")).count();
            spools += 1;
            records += n as u64;
        }
        (spools, records)
    }

    /// Removes every spool of the run whose ledger is at `ledger`: called once every row of the
    /// run is written, when no record needs them.
    /// The ledger then notes the last chunk whose spool is gone on purpose: a spool missing
    /// for a later chunk was removed by hand, and a resumed run says so.
    pub fn remove_all(ledger: &Path) -> std::io::Result<()> {
        let chunks = Ledger::read(ledger).map_err(|e| std::io::Error::other(e.to_string()))?;
        if let Some(last) = chunks.iter().map(|c| c.number).max() {
            std::fs::write(Ledger::settled_path_of(ledger), format!("{last}\n"))?;
        }
        match std::fs::remove_dir_all(Ledger::spool_dir_of(ledger)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// A spool being written: records for one chunk.
#[derive(Debug)]
pub struct SpoolWriter {
    id: u32,
    round: u32,
    from_input: bool,
    records: BufWriter<File>,
    body: BufWriter<File>,
    /// Requests in the body.
    pub count: u64,
    /// Bytes of the body.
    pub bytes: u64,
    lines: Option<(u64, u64)>,
    dir: PathBuf,
}

/// A spool written and on the disk, waiting for its job.
#[derive(Debug, Clone)]
pub struct Cut {
    /// The spool.
    pub spool: u32,
    /// Its records' round.
    pub round: u32,
    /// Its requests.
    pub count: u64,
    /// The input lines it was cut from (a first round read from the input).
    pub lines: Option<(u64, u64)>,
}

impl SpoolWriter {
    /// Its spool's number.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Whether it is cut from the input (its records' lines are claimed).
    pub fn from_input(&self) -> bool {
        self.from_input
    }

    /// Adds a record; `body_line` is its request's line of the job input (none for a record
    /// the caller answered).
    pub fn add(&mut self, entry: &Entry, body_line: Option<&[u8]>) -> Result<(), SpoolError> {
        let path = Spool::records_path(&self.dir, self.id);
        serde_json::to_writer(&mut self.records, entry).map_err(|e| err(&path, e))?;
        self.records.write_all(b"\n").map_err(|e| err(&path, e))?;
        if let Some(line) = body_line {
            self.body.write_all(line).map_err(|e| err(&path, e))?;
            self.count += 1;
            self.bytes += line.len() as u64;
        }
        if self.from_input {
            let (first, _) = self.lines.unwrap_or((entry.line, entry.line));
            self.lines = Some((first, entry.line));
        }
        Ok(())
    }

    /// Both files flushed to the disk: the spool as a chunk may name it.
    pub fn finish(self) -> Result<Cut, SpoolError> {
        let path = Spool::records_path(&self.dir, self.id);
        for w in [self.records, self.body] {
            let f = w.into_inner().map_err(|e| err(&path, e.error()))?;
            f.sync_data().map_err(|e| err(&path, e))?;
        }
        Ok(Cut { spool: self.id, round: self.round, count: self.count, lines: self.lines })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `weir batch status` counts the records of spools no chunk names (queued), not those of
    /// planned chunks nor records the run answered from its cache.
    #[test]
    fn queued_records_are_those_of_spools_no_chunk_names() {
        let dir = std::env::temp_dir().join(format!("weir-spool-queued-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("jobs.jsonl");
        let mut ledger = Ledger::open(&path, true).unwrap();
        let mut spool = Spool::open(&ledger).unwrap();
        let record = |k: &str| serde_json::value::to_raw_value(&serde_json::json!({"id": k, "a": true})).unwrap();
        let mut cut = |keys: &[&str], answered: &[&str]| {
            let mut w = spool.writer(0, true).unwrap();
            for (i, k) in keys.iter().enumerate() {
                let e =
                    Entry { key: k.to_string(), line: i as u64 + 1, record: record(k), answered: false, answer: None };
                w.add(&e, Some(b"x\n")).unwrap();
            }
            for k in answered {
                let e = Entry { key: k.to_string(), line: 9, record: record(k), answered: true, answer: None };
                w.add(&e, None).unwrap();
            }
            w.finish().unwrap()
        };
        let planned = cut(&["a", "b"], &[]);
        cut(&["c", "d", "e"], &["f"]);
        let plan = crate::Plan { round: 0, name: "r-c0".into(), site: "", spool: planned.spool, lines: None, count: 2 };
        ledger.plan(plan).unwrap();
        assert_eq!(Spool::queued(&path, &Ledger::read(&path).unwrap()), (1, 3));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
