//! The ledger of a run's jobs (`jobs.jsonl` in the run's state), written before anything is
//! waited on: a chunk's keys and name before it is submitted, the provider's job id as soon as
//! the provider gives it. A resumed run reads it back and re-attaches to its jobs; a chunk
//! recorded without an id is looked up at the provider by its name before anything is
//! submitted again, so a run killed at any moment never pays twice for a request.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use weir_core::JobRef;

/// One line of the ledger.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum Entry {
    /// A chunk's requests, before it is submitted, and the endpoint of a pool it goes to
    /// (absent for a run's only endpoint, so ledgers of runs before pools read the same).
    Planned {
        chunk: u32,
        round: u32,
        name: String,
        /// The keys of a chunk planned by a weir before spools (its records were in memory).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        keys: Vec<String>,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        site: String,
        /// The spool that holds its records (see [`crate::spool`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        spool: Option<u32>,
        /// The input lines it was cut from (a first-round chunk): the first and the last.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lines: Option<(u64, u64)>,
        /// Its requests.
        #[serde(default)]
        count: u64,
        /// When it was planned, in seconds since the Unix epoch (absent in older ledgers).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at: Option<u64>,
    },
    /// The job the provider made of a chunk.
    Submitted { chunk: u32, job: JobRef },
    /// A chunk its endpoint refused in a way that proves it made no job (its records are
    /// planned again, elsewhere): a resumed run neither looks it up nor waits on it.
    Refused { chunk: u32, refused: String },
}

/// A chunk of requests sent (or about to be sent) as one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Its number in the run.
    pub number: u32,
    /// 0 for the first attempt at its records, 1 for their first follow-up job, …
    pub round: u32,
    /// The name it is submitted under (unique to the run and the chunk).
    pub name: String,
    /// The keys of its requests, for a chunk planned by a weir before spools (empty otherwise:
    /// its spool holds them).
    pub keys: Vec<String>,
    /// The spool that holds its records: a refused chunk's spool is planned again as another
    /// chunk, so several chunks may name one spool; the latest is its owner.
    pub spool: Option<u32>,
    /// The input lines a first-round chunk was cut from (the first and the last): a resumed
    /// run leaves the input's records within them to the spool.
    pub lines: Option<(u64, u64)>,
    /// Its requests.
    pub count: u64,
    /// Whether its spool is still there (it is removed when the run has written every row);
    /// always for a chunk before spools.
    pub held: bool,
    /// The endpoint it went to, as [`crate::Site::name`] names it (empty: the only one).
    pub site: String,
    /// The provider's job, once submitted.
    pub job: Option<JobRef>,
    /// Why its endpoint refused it, proving no job was made (its records went elsewhere).
    pub refused: Option<String>,
    /// When it was planned (seconds since the Unix epoch), if recorded: a job made of it was
    /// created after.
    pub planned_at: Option<u64>,
}

impl Chunk {
    /// What a provider is told to find this chunk's job by, when its id was not recorded:
    /// its name, size and time, and the ids of the run's other jobs (`chunks`), which are not it.
    pub fn sought<'a>(&self, chunks: impl IntoIterator<Item = &'a Chunk>) -> weir_core::Sought {
        weir_core::Sought {
            name: self.name.clone(),
            count: self.count,
            since: self.planned_at,
            known: chunks.into_iter().filter_map(|c| c.job.as_ref().map(|j| j.id.clone())).collect(),
        }
    }
}

/// Why the ledger cannot be read or written.
#[derive(Debug, thiserror::Error)]
#[error("batch job ledger {path}: {message}")]
pub struct LedgerError {
    /// The file.
    pub path: String,
    /// What failed.
    pub message: String,
}

/// A chunk about to be submitted, as [`Ledger::plan`] records it.
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    /// 0 for its records' first job, 1 for their first follow-up, …
    pub round: u32,
    /// The name it is submitted under.
    pub name: String,
    /// Its endpoint's name (empty: the run's only one).
    pub site: &'a str,
    /// The spool that holds its records.
    pub spool: u32,
    /// The input lines it was cut from (a first round).
    pub lines: Option<(u64, u64)>,
    /// Its requests.
    pub count: u64,
}

/// The run's chunks and jobs, in memory and on disk.
#[derive(Debug)]
pub struct Ledger {
    path: PathBuf,
    file: File,
    chunks: BTreeMap<u32, Chunk>,
}

impl Ledger {
    /// Where the ledger of the run named `run` (its state's name) is in state directory `dir`:
    /// `weir run` writes it there and `weir batch` reads it there.
    pub fn path_in(dir: &Path, run: &str) -> PathBuf {
        dir.join("runs").join(format!("{run}.jobs.jsonl"))
    }

    /// Reads the ledger at `path` without writing to it (another process may be appending): its
    /// chunks, in order; none when there is no ledger.
    pub fn read(path: &Path) -> Result<Vec<Chunk>, LedgerError> {
        let err = |e: &dyn std::fmt::Display| LedgerError { path: path.display().to_string(), message: e.to_string() };
        let f = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(err(&e)),
        };
        let (mut chunks, _) = Self::parse(BufReader::new(f)).map_err(|e| err(&e))?;
        Self::mark_held(path, &mut chunks);
        Ok(chunks.into_values().collect())
    }

    /// The chunks of a ledger's whole lines and the length of those lines (a torn last line is
    /// left out).
    fn parse(mut reader: impl BufRead) -> std::io::Result<(BTreeMap<u32, Chunk>, u64)> {
        let mut chunks = BTreeMap::new();
        let mut good_len = 0u64;
        let mut line = String::new();
        loop {
            line.clear();
            let n = reader.read_line(&mut line)?;
            if n == 0 || !line.ends_with('\n') {
                break;
            }
            let Ok(entry) = serde_json::from_str::<Entry>(&line) else { break };
            good_len += n as u64;
            match entry {
                Entry::Planned { chunk, round, name, keys, site, spool, lines, count, at } => {
                    let count = if spool.is_some() { count } else { keys.len() as u64 };
                    let (job, refused, held, planned_at) = (None, None, true, at);
                    let c = Chunk {
                        number: chunk,
                        round,
                        name,
                        keys,
                        site,
                        spool,
                        lines,
                        count,
                        held,
                        job,
                        refused,
                        planned_at,
                    };
                    chunks.insert(chunk, c);
                }
                Entry::Submitted { chunk, job } => {
                    if let Some(c) = chunks.get_mut(&chunk) {
                        c.job = Some(job);
                    }
                }
                Entry::Refused { chunk, refused } => {
                    if let Some(c) = chunks.get_mut(&chunk) {
                        c.refused = Some(refused);
                    }
                }
            }
        }
        Ok((chunks, good_len))
    }

    /// Where the spools of the ledger at `path` are.
    pub fn spool_dir_of(path: &Path) -> PathBuf {
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(".spool");
        path.with_file_name(name)
    }

    /// Where a run that wrote every row notes the last chunk whose spool it removed.
    pub fn settled_path_of(path: &Path) -> PathBuf {
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(".settled");
        path.with_file_name(name)
    }

    /// The last chunk whose spool was removed because every row was written (none: -1).
    pub fn settled_through(&self) -> i64 {
        std::fs::read_to_string(Self::settled_path_of(&self.path))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(-1)
    }

    fn mark_held(path: &Path, chunks: &mut BTreeMap<u32, Chunk>) {
        let dir = Self::spool_dir_of(path);
        for c in chunks.values_mut() {
            if let Some(s) = c.spool {
                c.held = crate::spool::Spool::records_path(&dir, s).exists();
            }
        }
    }

    /// Opens (or creates) the ledger at `path`, cutting a torn last line; `fresh` empties it
    /// first (a new run, whose keys may name other requests than an earlier run's).
    pub fn open(path: &Path, fresh: bool) -> Result<Self, LedgerError> {
        let err = |e: &dyn std::fmt::Display| LedgerError { path: path.display().to_string(), message: e.to_string() };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
        }
        if fresh {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(&e)),
                _ => {}
            }
            for stale in [Self::spool_dir_of(path), Self::settled_path_of(path)] {
                let gone = if stale.is_dir() { std::fs::remove_dir_all(&stale) } else { std::fs::remove_file(&stale) };
                match gone {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(&e)),
                    _ => {}
                }
            }
        }
        let (mut chunks, good_len) = match File::open(path) {
            Ok(f) => Self::parse(BufReader::new(f)).map_err(|e| err(&e))?,
            // No ledger, but spools of jobs: it was removed by hand, and those jobs (paid for)
            // would be forgotten and their records sent again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let spools = Self::spool_dir_of(path);
                let held = std::fs::read_dir(&spools)
                    .is_ok_and(|d| d.flatten().any(|e| e.file_name().to_string_lossy().ends_with(".records")));
                if held {
                    return Err(err(&format!(
                        "missing, but {} holds records of its jobs: restore the ledger, or run with --fresh to start \
                         over (their jobs' records are then paid for again)",
                        spools.display()
                    )));
                }
                Default::default()
            }
            Err(e) => return Err(err(&e)),
        };
        let file = OpenOptions::new().create(true).append(true).open(path).map_err(|e| err(&e))?;
        file.set_len(good_len).map_err(|e| err(&e))?;
        Self::mark_held(path, &mut chunks);
        Ok(Self { path: path.to_path_buf(), file, chunks })
    }

    fn append(&mut self, entry: &Entry) -> Result<(), LedgerError> {
        let err =
            |e: &dyn std::fmt::Display| LedgerError { path: self.path.display().to_string(), message: e.to_string() };
        let mut line = serde_json::to_vec(entry).map_err(|e| err(&e))?;
        line.push(b'\n');
        self.file.write_all(&line).map_err(|e| err(&e))?;
        // On the disk before the provider is asked anything that costs money.
        self.file.sync_data().map_err(|e| err(&e))
    }

    /// The number the next chunk planned will have.
    pub fn next_number(&self) -> u32 {
        self.chunks.keys().next_back().map_or(0, |n| n + 1)
    }

    /// Records a chunk before it is submitted to `site` (empty for a run's only endpoint): its
    /// records are in spool `spool`, `count` of them, cut from input `lines` (a first round).
    pub fn plan(&mut self, plan: Plan<'_>) -> Result<Chunk, LedgerError> {
        let number = self.next_number();
        let Plan { round, name, site, spool, lines, count } = plan;
        let site = site.to_string();
        let planned_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs());
        self.append(&Entry::Planned {
            chunk: number,
            round,
            name: name.clone(),
            keys: Vec::new(),
            site: site.clone(),
            spool: Some(spool),
            lines,
            count,
            at: planned_at,
        })?;
        let (keys, job, refused, held, spool) = (Vec::new(), None, None, true, Some(spool));
        let chunk = Chunk { number, round, name, keys, site, spool, lines, count, held, job, refused, planned_at };
        self.chunks.insert(number, chunk.clone());
        Ok(chunk)
    }

    /// Records the job the provider made of chunk `number`.
    pub fn submitted(&mut self, number: u32, job: JobRef) -> Result<(), LedgerError> {
        self.append(&Entry::Submitted { chunk: number, job: job.clone() })?;
        if let Some(c) = self.chunks.get_mut(&number) {
            c.job = Some(job);
        }
        Ok(())
    }

    /// Records that chunk `number`'s endpoint refused it, proving no job was made.
    pub fn refused(&mut self, number: u32, why: &str) -> Result<(), LedgerError> {
        self.append(&Entry::Refused { chunk: number, refused: why.to_string() })?;
        if let Some(c) = self.chunks.get_mut(&number) {
            c.refused = Some(why.to_string());
        }
        Ok(())
    }

    /// Every chunk, in order.
    pub fn chunks(&self) -> impl Iterator<Item = &Chunk> {
        self.chunks.values()
    }

    /// Chunk `number`.
    pub fn chunk(&self, number: u32) -> Option<&Chunk> {
        self.chunks.get(&number)
    }

    /// Where the ledger is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Of a ledger's `chunks` (as [`Ledger::read`] gives them), those that may hold records a
/// resumed run waits on: the latest chunk of some key, and not refused by its endpoint.
pub fn open_chunks(chunks: &[Chunk]) -> Vec<&Chunk> {
    let mut latest: HashMap<&str, u32> = HashMap::new();
    // A spool's owner: the latest chunk planned from it.
    let mut owner: HashMap<u32, u32> = HashMap::new();
    for c in chunks {
        for k in &c.keys {
            latest.insert(k, c.number);
        }
        if let Some(s) = c.spool {
            owner.insert(s, c.number);
        }
    }
    let holding: std::collections::HashSet<u32> = latest.into_values().collect();
    chunks
        .iter()
        .filter(|c| {
            c.refused.is_none()
                && match c.spool {
                    Some(s) => c.held && owner.get(&s) == Some(&c.number),
                    None => holding.contains(&c.number),
                }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(l: &mut Ledger, name: &str, site: &str, spool: u32, lines: Option<(u64, u64)>) -> Chunk {
        l.plan(Plan { round: 0, name: name.into(), site, spool, lines, count: 2 }).unwrap()
    }

    #[test]
    fn chunks_and_jobs_survive_reopening_and_a_torn_line_is_cut() {
        let dir = std::env::temp_dir().join(format!("weir-ledger-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("jobs.jsonl");
        {
            let mut l = Ledger::open(&path, true).unwrap();
            let c = plan(&mut l, "run-c0", "", 0, Some((1, 2)));
            l.submitted(c.number, JobRef { id: "batch_1".into(), file: Some("file-1".into()) }).unwrap();
            plan(&mut l, "run-c1", "eu", 1, Some((3, 4)));
            let c2 = plan(&mut l, "run-c2", "", 2, None);
            assert_eq!(c2.number, 2);
        }
        // A torn line at the end (killed while appending).
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"chunk\":3,\"ro").unwrap();
        assert_eq!(Ledger::read(&path).unwrap().len(), 3);
        let l = Ledger::open(&path, false).unwrap();
        let chunks: Vec<&Chunk> = l.chunks().collect();
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0].job.as_ref().unwrap().id, "batch_1");
        assert_eq!(chunks[1].job, None);
        assert_eq!((chunks[1].spool, chunks[1].lines, chunks[1].count), (Some(1), Some((3, 4)), 2));
        // A refused chunk reads back as refused.
        assert!(l.chunks().all(|c| c.refused.is_none()));
        // The endpoint of a pool a chunk went to; none written for a run's only endpoint.
        assert_eq!((chunks[0].site.as_str(), chunks[1].site.as_str()), ("", "eu"));
        assert!(!std::fs::read_to_string(&path).unwrap().lines().next().unwrap().contains("site"));
        // No spool files: nothing is held (a finished run's spools are removed).
        assert!(l.chunks().all(|c| !c.held));
        assert!(open_chunks(&Ledger::read(&path).unwrap()).is_empty());
        drop(l);
        assert!(std::fs::read_to_string(&path).unwrap().ends_with("}\n"));
        assert_eq!(Ledger::open(&path, true).unwrap().chunks().count(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A ledger written before spools (keys in the ledger) still reads, and its chunks count.
    #[test]
    fn a_ledger_from_before_spools_reads() {
        let dir = std::env::temp_dir().join(format!("weir-ledger-old-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("jobs.jsonl");
        std::fs::write(&path, "{\"chunk\":0,\"round\":0,\"name\":\"r-c0\",\"keys\":[\"a\",\"b\"]}\n").unwrap();
        let chunks = Ledger::read(&path).unwrap();
        assert_eq!((chunks[0].count, chunks[0].spool, chunks[0].held), (2, None, true));
        assert_eq!(open_chunks(&chunks).len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
