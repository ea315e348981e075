//! The journal of a table output: which records are finished, and which output parts hold
//! them, kept in the local state directory whatever the output's format and location.
//!
//! A Parquet file cannot be appended to, and an object in S3 or GCS appears whole or not at
//! all, so a table output cannot be its own journal the way a JSONL file is. Instead rows go to
//! parts (`part-00000.parquet`, …), and at each checkpoint the parts being written are
//! completed (the multipart upload is finished, the local file renamed into place) and only then
//! recorded here, with the keys of their records, in one append and one `fdatasync`:
//!
//! ```text
//! k 3f2a…(32 hex digits)     a finished record's key
//! i 9c04…(32 hex digits)     a finished record's id (with `--id-field`), for a stream fed again
//!                            in another order (`--resume-stream`)
//! p r part-00003.parquet 812 40960   a results part, its rows and its size in bytes
//! p e part-00003.parquet 4 2048      an errors part, its rows and its size
//! C                          the checkpoint is complete
//! ```
//!
//! On resume only what precedes the last `C` counts; a torn tail after it is cut. A part that
//! exists but is not recorded (the process died between completing it and recording it) is
//! deleted, and its records are run again — from the response cache, which made their answers
//! durable within a second of their arrival, so no call is paid for twice.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use weir_io::state::Key;
use weir_io::KeySet;

/// Which table a part belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// Result rows.
    Results,
    /// Error rows.
    Errors,
}

impl Table {
    fn letter(self) -> char {
        match self {
            Table::Results => 'r',
            Table::Errors => 'e',
        }
    }
}

/// A committed part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Results or errors.
    pub table: Table,
    /// Its file name (`part-00003.parquet`).
    pub name: String,
    /// Rows in it.
    pub rows: u64,
    /// Its size in bytes once complete (journals written before sizes were kept have none): a
    /// part of that name with another size was written by another run since.
    pub bytes: Option<u64>,
}

/// What the journal says an earlier run finished.
#[derive(Debug, Default)]
pub struct Committed {
    /// Finished records' keys.
    pub finished: KeySet,
    /// Finished records' ids (by `weir_io::state::id_key`), when the run had `--id-field`
    /// (journals written before ids were kept have none).
    pub finished_ids: KeySet,
    /// The committed parts.
    pub parts: Vec<Part>,
}

impl Committed {
    /// Rows in committed parts of `table`.
    pub fn rows(&self, table: Table) -> u64 {
        self.parts.iter().filter(|p| p.table == table).map(|p| p.rows).sum()
    }

    /// The number the next part takes: one more than any committed part's.
    pub fn next_part(&self) -> u32 {
        self.parts.iter().filter_map(|p| part_number(&p.name)).max().map_or(0, |n| n + 1)
    }
}

/// The number in a part's name (`part-00003.parquet` → 3), if it is one of weir's.
pub fn part_number(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("part-")?;
    let (digits, ext) = rest.split_once('.')?;
    (digits.len() == 5 && matches!(ext, "jsonl" | "csv" | "parquet")).then(|| digits.parse().ok()).flatten()
}

/// The name a local part is written under until it is complete (`.part-00000.parquet.partial`):
/// hidden, so that readers of the directory (pyarrow, pandas, Spark, DuckDB skip names that
/// start with a dot) never see a part half written, nor the store's own staging files for it
/// (`….partial#1`), and renamed to its own name once complete.
pub fn staging_name(name: &str) -> String {
    format!(".{name}.partial")
}

/// True for a file a run left half written in a local table: a staging name, the object
/// store's staging file for one (`NAME#N`), or such a file beside a part's own name (written
/// by weir before parts were staged). Only a run that holds the table's lock may remove them.
pub fn is_staging(name: &str) -> bool {
    let staged = |n: &str| {
        n.strip_prefix('.').and_then(|n| n.strip_suffix(".partial")).is_some_and(|n| part_number(n).is_some())
    };
    match name.split_once('#') {
        Some((base, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            staged(base) || part_number(base).is_some()
        }
        Some(_) => false,
        None => staged(name),
    }
}

/// The name of part `n` in `ext` format.
pub fn part_name(n: u32, ext: &str) -> String {
    format!("part-{n:05}.{ext}")
}

/// The journal file, open for appending.
#[derive(Debug)]
pub struct Journal {
    file: File,
    path: PathBuf,
}

impl Journal {
    /// Opens the journal at `path`: with `fresh`, empty; else reads what it committed and cuts
    /// anything after its last complete checkpoint.
    pub fn open(path: &Path, fresh: bool) -> io::Result<(Self, Committed)> {
        if fresh {
            let _ = std::fs::remove_file(path);
        }
        let mut committed = Committed::default();
        let mut good = 0u64;
        if let Ok(f) = File::open(path) {
            let mut reader = BufReader::new(f);
            let mut line = String::new();
            let mut offset = 0u64;
            let mut keys: Vec<Key> = Vec::new();
            let mut ids: Vec<Key> = Vec::new();
            let mut parts: Vec<Part> = Vec::new();
            loop {
                line.clear();
                let n = reader.read_line(&mut line)?;
                if n == 0 || !line.ends_with('\n') {
                    break;
                }
                offset += n as u64;
                let text = line.trim_end();
                let mut fields = text.split(' ');
                match fields.next() {
                    Some(kind @ ("k" | "i")) => match fields.next().and_then(|h| u128::from_str_radix(h, 16).ok()) {
                        Some(k) if kind == "k" => keys.push(k),
                        Some(k) => ids.push(k),
                        None => break,
                    },
                    Some("p") => {
                        let table = match fields.next() {
                            Some("r") => Table::Results,
                            Some("e") => Table::Errors,
                            _ => break,
                        };
                        let (Some(name), Some(rows)) = (fields.next(), fields.next().and_then(|r| r.parse().ok()))
                        else {
                            break;
                        };
                        let bytes = fields.next().and_then(|b| b.parse().ok());
                        parts.push(Part { table, name: name.to_string(), rows, bytes });
                    }
                    Some("C") => {
                        for k in keys.drain(..) {
                            committed.finished.insert(k);
                        }
                        for k in ids.drain(..) {
                            committed.finished_ids.insert(k);
                        }
                        committed.parts.append(&mut parts);
                        good = offset;
                    }
                    _ => break,
                }
            }
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        if file.metadata()?.len() > good {
            file.set_len(good)?;
            file.sync_all()?;
        }
        Ok((Self { file, path: path.to_path_buf() }, committed))
    }

    /// Records one checkpoint: the keys of the records now finished, their ids, and the parts
    /// that hold them, made durable before returning.
    pub fn commit(&mut self, keys: &[Key], ids: &[Key], parts: &[Part]) -> io::Result<()> {
        let mut text = String::with_capacity((keys.len() + ids.len()) * 35 + parts.len() * 40 + 2);
        for k in keys {
            text.push_str(&format!("k {k:032x}\n"));
        }
        for k in ids {
            text.push_str(&format!("i {k:032x}\n"));
        }
        for p in parts {
            match p.bytes {
                Some(b) => text.push_str(&format!("p {} {} {} {b}\n", p.table.letter(), p.name, p.rows)),
                None => text.push_str(&format!("p {} {} {}\n", p.table.letter(), p.name, p.rows)),
            }
        }
        text.push_str("C\n");
        self.file.write_all(text.as_bytes())?;
        self.file.sync_data()
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_complete_checkpoints_count_and_a_torn_tail_is_cut() {
        let p = std::env::temp_dir().join(format!("weir-journal-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let (mut j, c) = Journal::open(&p, false).unwrap();
        assert_eq!((c.finished.len(), c.next_part()), (0, 0));
        let part = |t, n: u32, rows| Part { table: t, name: part_name(n, "parquet"), rows, bytes: Some(rows * 100) };
        j.commit(&[1, 2], &[7], &[part(Table::Results, 0, 2)]).unwrap();
        j.commit(&[3], &[], &[part(Table::Errors, 1, 1)]).unwrap();
        drop(j);
        // A checkpoint cut short: its keys are not finished.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"k 00000000000000000000000000000004\np r part-00002.parquet 1\nk 0000").unwrap();
        drop(f);
        let (j, c) = Journal::open(&p, false).unwrap();
        assert_eq!(c.finished.len(), 3);
        assert!(c.finished.contains(&3) && !c.finished.contains(&4));
        assert!(c.finished_ids.contains(&7) && c.finished_ids.len() == 1);
        assert_eq!((c.rows(Table::Results), c.rows(Table::Errors), c.next_part()), (2, 1, 2));
        assert!(std::fs::read_to_string(j.path()).unwrap().ends_with("C\n"));
        let (_j, c) = Journal::open(&p, true).unwrap();
        assert_eq!(c.parts.len(), 0);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn part_names() {
        assert_eq!(part_name(3, "csv"), "part-00003.csv");
        assert_eq!(part_number("part-00003.csv"), Some(3));
        assert_eq!(part_number("part-3.csv"), None);
        assert_eq!(part_number("mine.csv"), None);
    }

    #[test]
    fn staging_names_are_told_from_parts_and_foreign_files() {
        assert_eq!(staging_name("part-00003.csv"), ".part-00003.csv.partial");
        for name in [".part-00003.csv.partial", ".part-00003.csv.partial#1", "part-00000.parquet#12"] {
            assert!(is_staging(name), "{name}");
        }
        for name in ["part-00003.csv", ".part-00003.csv", "notes#1", "part-00000.parquet#", ".x.partial", ".weir.lock"]
        {
            assert!(!is_staging(name), "{name}");
        }
    }
}
