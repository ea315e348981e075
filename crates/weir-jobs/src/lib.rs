//! weir-jobs: runs records through a provider's batch-prediction jobs.
//!
//! The requests are split into chunks within the provider's limits ([`JobLimits`]); each
//! chunk is recorded in the [`Ledger`] before it is submitted and its job id as soon as the
//! provider gives it; the jobs are polled with a growing interval; a terminal job's results
//! are matched to their records by key (never by order) and handed to the caller. Requests a
//! job left unanswered (an expired, failed or cancelled job, a retryable error of one request)
//! go into a follow-up job, up to [`JobSettings::rounds`]; what is left after that goes back
//! to the caller, who writes it as errors or sends it online. A resumed run re-attaches to the
//! jobs of its ledger and submits only what no job holds.
//!
//! A pool of endpoints ([`Sites`]: regions, keys, replicas of one model) shares the jobs: each
//! chunk goes to the endpoint with the fewest records waiting in its jobs for its weight, and
//! the ledger records which, so that a resumed run asks that endpoint about it. An endpoint
//! that refuses a submission in a way that proves the job was not made (a rejected key, a
//! spent quota, a refused connection) is left for the rest of the run, and its chunk goes to
//! another.

#![warn(missing_docs)]

pub mod ledger;
pub mod spool;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use weir_core::{ErrorKind, JobApi, JobRef, JobResult, JobState, JobStatus, ModelError, ModelRequest, ModelResponse};

pub use ledger::{open_chunks, Chunk, Ledger, LedgerError, Plan};
pub use spool::{Spool, SpoolError};

/// A caller's record as the jobs carry it: JSON they keep in a spool and hand back untouched.
pub type Record = Box<serde_json::value::RawValue>;

/// How jobs are run.
#[derive(Debug, Clone)]
pub struct JobSettings {
    /// Jobs made of one record at most: the first and the follow-ups (at least 1).
    pub rounds: u32,
    /// The first wait between two polls of a job; it doubles up to `poll_max`.
    pub poll_first: Duration,
    /// The longest wait between two polls.
    pub poll_max: Duration,
    /// Jobs are named `{prefix}-c{chunk}` (the run's identity, so names are unique to it).
    pub name_prefix: String,
    /// Tries of a job API call that failed in a way that may pass (a 429, a 503, a reset).
    pub api_tries: u32,
    /// Jobs running at one endpoint at most (providers limit the jobs running at once: Vertex
    /// AI per region); records beyond wait here, in spools, until one ends.
    pub max_jobs: Option<usize>,
}

impl Default for JobSettings {
    fn default() -> Self {
        Self {
            rounds: 3,
            poll_first: Duration::from_secs(5),
            poll_max: Duration::from_secs(60),
            name_prefix: "weir".into(),
            api_tries: 5,
            max_jobs: None,
        }
    }
}

/// One request to run, keyed (the key comes back with its result).
#[derive(Debug, Clone)]
pub struct Item {
    /// Unique within the run.
    pub key: String,
    /// Its line in the input.
    pub line: u64,
    /// What to ask.
    pub request: ModelRequest,
    /// The caller's record, kept in the spool and handed back with its answer.
    pub record: Record,
}

/// What the caller hands the jobs as it reads its input, in input order.
#[derive(Debug)]
pub enum Incoming {
    /// A record for a job.
    Job(Item),
    /// A record the caller answered itself (from its cache): spooled all the same, so that a
    /// chunk's spool accounts for every record of its input lines (see [`Claims`]).
    Answered {
        /// Its key.
        key: String,
        /// Its line in the input.
        line: u64,
        /// The caller's record.
        record: Record,
    },
}

/// What the jobs ask of the caller, who owns the records, their rows and their cache. Handing
/// over a settled record may wait (the rows' writer is behind): a job's answers are then held,
/// not piled up.
#[async_trait::async_trait]
pub trait Host: Send {
    /// Whether a spooled record already has its row (an earlier run wrote it): it is left alone.
    fn finished(&self, record: &Record) -> bool;
    /// A spooled record an earlier run answered from the cache without writing its row: true
    /// when the caller has answered it again, false when it must go to a job.
    async fn answer_again(&mut self, record: &Record) -> bool;
    /// The request of a spooled record (for a follow-up job), or why it has none.
    async fn rebuild(&mut self, key: String, record: Record) -> Result<Item, (Record, ModelError)>;
    /// Why a job's answer for `record` is not one to keep (it does not match the response
    /// schema): it is then tried again like a request that failed alone. `None` keeps it.
    fn check(&self, _record: &Record, _response: &ModelResponse) -> Option<ModelError> {
        None
    }
    /// A record settled by a job: its answer, or an error another try would not change.
    async fn deliver(&mut self, record: Record, result: Result<ModelResponse, ModelError>);
    /// A record no job answered after every round, with its last error.
    async fn leftover(&mut self, record: Record, error: ModelError);
    /// Where the jobs stand, after every poll.
    fn progress(&mut self, progress: &Progress);
}

/// The input lines whose records a resumed run leaves to the spools of the ledger's chunks:
/// the lines each first-round chunk was cut from, while its spool is kept. The caller drops a
/// record read within them (it would otherwise be sent twice); a record the input gives as an
/// error row is not in a spool and is written as before.
#[derive(Debug, Clone, Default)]
pub struct Claims(Vec<(u64, u64)>);

impl Claims {
    /// The lines the held chunks of `ledger` were cut from.
    pub fn of(ledger: &Ledger) -> Self {
        let mut ranges: Vec<(u64, u64)> = ledger.chunks().filter(|c| c.held).filter_map(|c| c.lines).collect();
        ranges.sort_unstable();
        ranges.dedup();
        Self(ranges)
    }

    /// Whether a spool holds the record of input line `line`.
    pub fn holds(&self, line: u64) -> bool {
        let i = self.0.partition_point(|(first, _)| *first <= line);
        i > 0 && self.0[i - 1].1 >= line
    }

    /// Whether no line is held.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Where the jobs stand, for a progress display.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Jobs submitted or re-attached, by state.
    pub jobs: BTreeMap<&'static str, u32>,
    /// Requests the provider reports answered in the jobs not yet collected.
    pub completed: u64,
    /// Requests the provider reports failed in those jobs (an expired job's unanswered ones):
    /// counted with the answered ones, an expired job's progress said every request was answered.
    pub failed: u64,
    /// Requests in the jobs not yet collected.
    pub total: u64,
    /// Records whose outcome is known.
    pub settled: u64,
    /// Records waiting here for a job (every endpoint at its `max_jobs`).
    pub queued: u64,
}

/// One endpoint's batch-job API, in a run whose jobs may go to several.
pub struct Site {
    /// How the ledger names it: stable from run to run and free of secrets (where it is and
    /// the name of its key's variable). A run of one endpoint writes no name (its ledger reads
    /// as before pools), but has one, so that it finds its own jobs in a pool's ledger.
    pub name: String,
    /// How messages name it (the pool entry's name, else where it is).
    pub label: String,
    /// Its job API.
    pub api: Arc<dyn JobApi>,
    /// Its share of the records (default 1).
    pub weight: f64,
}

/// The endpoints a run's jobs go to: one, or a pool.
pub struct Sites(Vec<Site>);

impl Sites {
    /// A run's only endpoint, named `name` (see [`Site::name`]).
    pub fn one(api: Arc<dyn JobApi>, name: String) -> Self {
        Self(vec![Site { label: name.clone(), name, api, weight: 1.0 }])
    }

    /// A pool (at least one site; names unique).
    pub fn pool(sites: Vec<Site>) -> Self {
        assert!(!sites.is_empty(), "a pool of no endpoint");
        Self(sites)
    }

    /// The name the ledger records for a chunk sent to site `i`: none for a run's only one.
    fn recorded(&self, i: usize) -> &str {
        if self.0.len() > 1 {
            &self.0[i].name
        } else {
            ""
        }
    }

    /// The first endpoint's API (the one asked whether jobs exist at all).
    pub fn first(&self) -> &Arc<dyn JobApi> {
        &self.0[0].api
    }

    /// Every endpoint, in the pool's order.
    pub fn iter(&self) -> impl Iterator<Item = &Site> {
        self.0.iter()
    }

    /// The index of the endpoint a recorded chunk went to: by its name, or the first for a
    /// chunk that names none (a run of one endpoint); `None` when the pool lacks it.
    pub fn index_of(&self, chunk: &Chunk) -> Option<usize> {
        if chunk.site.is_empty() {
            return Some(0);
        }
        self.0.iter().position(|s| s.name == chunk.site)
    }

    /// The API of the endpoint a recorded chunk went to, or why there is none.
    pub fn api_of(&self, chunk: &Chunk) -> Result<&Arc<dyn JobApi>, BatchError> {
        self.index_of(chunk).map(|i| &self.0[i].api).ok_or_else(|| missing_sites(&[chunk]))
    }
}

/// The refusal of a run whose pool lacks the endpoints of `chunks` (which hold its records).
pub fn missing_sites(chunks: &[&Chunk]) -> BatchError {
    let mut by_site: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for c in chunks {
        let what = match &c.job {
            Some(j) => format!("job {}", j.id),
            None => format!("{} (submitted or not: looked up by name)", c.name),
        };
        by_site.entry(&c.site).or_default().push(what);
    }
    let each: Vec<String> = by_site.iter().map(|(site, jobs)| format!("\"{site}\": {}", jobs.join(", "))).collect();
    BatchError::Site(format!(
        "this run's pool does not list the endpoints of some of the earlier run's jobs, which hold its records: {}. \
         Give the same endpoints as the run that submitted them (their jobs are asked there)",
        each.join("; ")
    ))
}

/// Why the jobs cannot go on (the records not settled stay unfinished; a resumed run picks
/// them up from the ledger).
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// The ledger cannot be written: nothing is submitted without it.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// A spool cannot be written or read.
    #[error(transparent)]
    Spool(#[from] SpoolError),
    /// The provider refused a job API call in a way that will not pass by waiting.
    #[error("batch job API: {0}")]
    Api(ModelError),
    /// The caller cancelled (an interrupt); the jobs go on at the provider.
    #[error("interrupted; the jobs go on at the provider, and a resumed run re-attaches to them")]
    Cancelled,
    /// A job of the ledger went to an endpoint the run does not have.
    #[error("{0}")]
    Site(String),
}

/// The end of [`run`].
#[derive(Debug)]
pub struct Finished {
    /// Records no job answered (each handed to [`Host::leftover`]).
    pub leftovers: u64,
    /// Jobs this call submitted.
    pub submitted: u64,
    /// Jobs of an earlier run this call re-attached to (found by name included).
    pub reattached: u64,
    /// In a pool, for each endpoint (its label): the jobs this call submitted there, and why
    /// it refused jobs, if it did (none for a run of one endpoint).
    pub sites: Vec<(String, u64, Option<String>)>,
}

/// A job being waited on.
struct Active {
    /// The index of its endpoint.
    site: usize,
    job: JobRef,
    spool: u32,
    count: u64,
    round: u32,
    status: Option<JobStatus>,
}

/// Calls `f` until it succeeds, fails in a way waiting cannot help, or `tries` are spent.
async fn with_tries<T, F, Fut>(tries: u32, cancel: &CancellationToken, f: F) -> Result<T, BatchError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ModelError>>,
{
    tries_while(tries, cancel, false, f).await
}

/// [`with_tries`] for asking about jobs already submitted (their state, their results), which
/// costs nothing: a refused credential (a token refresh that failed once) is tried again too,
/// rather than ending a run whose jobs go on at the provider.
async fn reading<T, F, Fut>(tries: u32, cancel: &CancellationToken, f: F) -> Result<T, BatchError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ModelError>>,
{
    tries_while(tries, cancel, true, f).await
}

/// How job API calls are retried: the same policy as model calls (what the error's hint says,
/// the server's advised delay as a floor, jittered backoff), with a longer first wait — a job
/// API refusing is seldom fixed in a quarter of a second.
const JOB_API_BACKOFF: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(60));

/// How long asking about jobs already submitted (their state, their results) is tried again
/// before the run stops: the jobs go on at the provider meanwhile, and a run of hours should
/// ride out a network or API outage of minutes (an outage of 7 s once stopped one).
const READ_PATIENCE: Duration = Duration::from_secs(600);

async fn tries_while<T, F, Fut>(
    tries: u32,
    cancel: &CancellationToken,
    auth_again: bool,
    mut f: F,
) -> Result<T, BatchError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ModelError>>,
{
    use rand::SeedableRng;
    let policy = weir_core::RetryPolicy {
        // Asking about jobs goes on for READ_PATIENCE whatever the count.
        max_retries: if auth_again { u32::MAX } else { tries.max(1) - 1 },
        base: JOB_API_BACKOFF.0,
        cap: JOB_API_BACKOFF.1,
        ..Default::default()
    };
    let mut rng = rand::rngs::SmallRng::from_entropy();
    let mut attempts = 0;
    let started = tokio::time::Instant::now();
    loop {
        attempts += 1;
        let e = match f().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if auth_again && attempts >= tries && started.elapsed() >= READ_PATIENCE {
            return Err(BatchError::Api(e));
        }
        let judged = if auth_again && e.kind == ErrorKind::Auth {
            ModelError { hint: weir_core::RetryHint::Backoff, ..e.clone() }
        } else {
            e.clone()
        };
        match policy.decide(attempts, &judged, &mut rng) {
            weir_core::Decision::Retry(wait) => {
                tracing::warn!("batch job API call failed ({e}); trying again in {:.1} s", wait.as_secs_f64());
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = cancel.cancelled() => return Err(BatchError::Cancelled),
                }
            }
            weir_core::Decision::GiveUp => return Err(BatchError::Api(e)),
        }
    }
}

/// Whether a refused submission proves the endpoint made no job (so its records may go to
/// another endpoint without being paid twice): a rejected credential, a spent quota, a
/// connection that was refused.
fn made_no_job(e: &ModelError) -> bool {
    e.unreachable || matches!(e.kind, ErrorKind::Auth | ErrorKind::QuotaExhausted)
}

/// Runs the records `incoming` brings, and those of the ledger's chunks an earlier run left
/// open, through the jobs of `sites`. Jobs are cut and submitted while the input is still
/// being read: a chunk's records go to a spool on the disk, and only the chunk being cut and
/// the job being collected are held in memory. Each settled record goes to the host once.
pub async fn run(
    sites: &Sites,
    ledger: &mut Ledger,
    spool: &mut Spool,
    incoming: &mut tokio::sync::mpsc::Receiver<Incoming>,
    settings: &JobSettings,
    cancel: &CancellationToken,
    host: &mut (dyn Host + Send),
) -> Result<Finished, BatchError> {
    let mut run = Run {
        sites,
        ledger,
        spool,
        settings,
        cancel,
        host,
        active: Vec::new(),
        ended: VecDeque::new(),
        queue: VecDeque::new(),
        input: None,
        owner: HashMap::new(),
        at_site: vec![(0, None); sites.0.len()],
        submitted: 0,
        reattached: 0,
        settled: 0,
        leftovers: 0,
        submitted_now: false,
    };
    run.attach().await?;
    let mut input_open = true;
    let mut wait = settings.poll_first;
    let poll = tokio::time::sleep(wait);
    tokio::pin!(poll);
    loop {
        run.submit_ready().await?;
        if std::mem::take(&mut run.submitted_now) {
            // A new job is asked about soon, however long the waits have grown.
            wait = settings.poll_first;
            let soon = tokio::time::Instant::now() + wait;
            if poll.deadline() > soon {
                poll.as_mut().reset(soon);
            }
        }
        if !input_open && run.active.is_empty() && run.queue.is_empty() && run.ended.is_empty() {
            break;
        }
        // In this order: asking about jobs (cheap, and it frees room under --max-jobs), then the
        // input (cut and submitted as soon as it is read: the jobs then run at the provider
        // while the rest is read), then collecting an ended job whenever no record is waiting.
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(BatchError::Cancelled),
            _ = &mut poll, if !run.active.is_empty() => {
                run.poll().await?;
                wait = (wait * 2).min(settings.poll_max);
                poll.as_mut().reset(tokio::time::Instant::now() + wait);
            }
            next = incoming.recv(), if input_open => match next {
                Some(Incoming::Job(item)) => run.add_input(item).await?,
                Some(Incoming::Answered { key, line, record }) => {
                    let entry = spool::Entry { key, line, record, answered: true, answer: None };
                    run.input_writer()?.add(&entry, None)?;
                }
                None => {
                    input_open = false;
                    run.cut_input()?;
                    run.report();
                }
            },
            _ = std::future::ready(()), if !run.ended.is_empty() => {
                let a = run.ended.pop_front().expect("not empty");
                run.collect(a).await?;
                run.report();
            }
        }
    }
    let sites = match sites.0.len() {
        1 => Vec::new(),
        _ => sites.0.iter().zip(run.at_site).map(|(s, (n, why))| (s.label.clone(), n, why)).collect(),
    };
    Ok(Finished { leftovers: run.leftovers, submitted: run.submitted, reattached: run.reattached, sites })
}

/// One call of [`run`]: its jobs, its queue and the spool being cut from the input.
struct Run<'a> {
    sites: &'a Sites,
    ledger: &'a mut Ledger,
    spool: &'a mut Spool,
    settings: &'a JobSettings,
    cancel: &'a CancellationToken,
    host: &'a mut (dyn Host + Send),
    active: Vec<Active>,
    /// Jobs that ended, waiting to be collected.
    ended: VecDeque<Active>,
    /// Spools cut and waiting for a job (every endpoint at its `max_jobs`, or not yet sent).
    queue: VecDeque<spool::Cut>,
    /// The spool being cut from the input.
    input: Option<spool::SpoolWriter>,
    /// The keys of follow-up spools, each to the spool that now holds it: the earlier spool
    /// that also has it leaves it alone.
    owner: HashMap<String, u32>,
    /// Per endpoint: the jobs submitted there, and why it refused one for good.
    at_site: Vec<(u64, Option<String>)>,
    submitted: u64,
    reattached: u64,
    settled: u64,
    leftovers: u64,
    /// A job was submitted since the last poll was planned.
    submitted_now: bool,
}

impl Run<'_> {
    /// Takes up the chunks an earlier run left: re-attaches to their jobs, looks up by name
    /// those whose id was not recorded, queues those that were never made, and answers again
    /// (or queues) the records it answered from its cache without writing their rows.
    async fn attach(&mut self) -> Result<(), BatchError> {
        let old: Vec<&Chunk> = open_chunks(&self.ledger.chunks().cloned().collect::<Vec<_>>())
            .into_iter()
            .filter(|c| c.spool.is_none())
            .map(|c| self.ledger.chunk(c.number).expect("listed"))
            .collect();
        if !old.is_empty() {
            return Err(BatchError::Site(format!(
                "this run's job ledger ({}) was written by an earlier version of weir, which kept {} chunk(s) of \
                 records in memory rather than in a spool: collect those jobs with that version, or cancel them \
                 (`weir batch cancel`) and run again with --fresh",
                self.ledger.path().display(),
                old.len()
            )));
        }
        // A chunk's spool missing although its rows were not all written: removed by hand.
        let settled = self.ledger.settled_through();
        let lost: Vec<String> = self
            .ledger
            .chunks()
            .filter(|c| c.spool.is_some() && !c.held && i64::from(c.number) > settled && c.refused.is_none())
            .map(|c| c.job.as_ref().map_or(c.name.clone(), |j| j.id.clone()))
            .collect();
        if !lost.is_empty() {
            return Err(BatchError::Spool(SpoolError {
                path: Ledger::spool_dir_of(self.ledger.path()).display().to_string(),
                message: format!(
                    "the spools of {} job(s) are missing ({}), so their records cannot be matched to their answers; \
                     restore them, or run with --fresh to start over (their records are then paid for again)",
                    lost.len(),
                    lost.join(", ")
                ),
            }));
        }
        // Each held spool's owner: the latest chunk planned from it.
        let mut owners: BTreeMap<u32, Chunk> = BTreeMap::new();
        for c in self.ledger.chunks().filter(|c| c.held) {
            if let Some(s) = c.spool {
                owners.insert(s, c.clone());
            }
        }
        let missing: Vec<&Chunk> =
            owners.values().filter(|c| c.refused.is_none() && self.sites.index_of(c).is_none()).collect();
        if !missing.is_empty() {
            return Err(missing_sites(&missing));
        }
        // Keys that follow-up spools took over (spools are numbered in the order they were cut).
        for (s, c) in &owners {
            if c.round > 0 || c.lines.is_none() {
                for e in self.spool.entries(*s)? {
                    self.owner.insert(e?.key, *s);
                }
            }
        }
        // Every spool as the ledger recorded it (a truncated one would lose records silently).
        for (s, chunk) in &owners {
            let mut n = 0u64;
            for e in self.spool.entries(*s)? {
                n += u64::from(!e?.answered);
            }
            if n != chunk.count {
                return Err(BatchError::Spool(SpoolError {
                    path: spool::Spool::records_path(&Ledger::spool_dir_of(self.ledger.path()), *s)
                        .display()
                        .to_string(),
                    message: format!(
                        "holds {n} requests, but the ledger recorded {} for {}: the file was changed or cut short; \
                         restore it, or run with --fresh to start over (its records are then paid for again)",
                        chunk.count, chunk.name
                    ),
                }));
            }
        }
        let mut again: Option<spool::SpoolWriter> = None;
        for (s, chunk) in owners {
            // Records answered from the cache whose rows were not written.
            if chunk.lines.is_some() {
                for e in self.spool.entries(s)? {
                    let e = e?;
                    if !e.answered || self.host.finished(&e.record) || self.host.answer_again(&e.record).await {
                        continue;
                    }
                    match self.host.rebuild(e.key, e.record).await {
                        Ok(item) => self.add_to(&mut again, 0, item).await?,
                        Err((record, error)) => self.leftover(record, error).await,
                    }
                }
            }
            let cut = spool::Cut { spool: s, round: chunk.round, count: chunk.count, lines: chunk.lines };
            if chunk.refused.is_some() {
                // Its endpoint made no job: planned again, elsewhere.
                self.requeue(cut).await?;
                continue;
            }
            let site = self.sites.index_of(&chunk).expect("checked above");
            let api = &self.sites.0[site].api;
            let job = match chunk.job.clone() {
                Some(job) => Some(job),
                // Recorded, but the run stopped before the id was: the provider may have it.
                None => {
                    let sought = chunk.sought(self.ledger.chunks());
                    let found = with_tries(self.settings.api_tries, self.cancel, || api.find(&sought)).await?;
                    if let Some(job) = &found {
                        self.ledger.submitted(chunk.number, job.clone())?;
                    }
                    found
                }
            };
            match job {
                // Rounds count from this call: records an earlier job left unanswered (or that
                // `--retry-errors` brings back) get follow-up jobs again.
                Some(job) => {
                    tracing::info!("re-attached to job {}", job.id);
                    self.reattached += 1;
                    let count = chunk.count;
                    self.active.push(Active { site, job, spool: s, count, round: 0, status: None });
                }
                None => self.requeue(cut).await?,
            }
        }
        if let Some(w) = again {
            self.queue_cut(w)?;
        }
        Ok(())
    }

    /// A spool an earlier run cut but made no job of, queued again; cut again first when it
    /// is larger than a job may now be (`--job-max-requests` lowered after the provider
    /// refused the job for its size: found by an outside tester, the same refusal came back on
    /// every run). Its records then move to the new spools, which hold them from now on.
    async fn requeue(&mut self, cut: spool::Cut) -> Result<(), BatchError> {
        if cut.count as usize <= self.sites.first().limits().max_lines {
            self.queue.push_back(cut);
            return Ok(());
        }
        let mut w: Option<spool::SpoolWriter> = None;
        for e in self.spool.entries(cut.spool)? {
            let e = e?;
            if !self.is_open(&e, cut.spool) {
                continue;
            }
            match self.host.rebuild(e.key, e.record).await {
                Ok(item) => {
                    let key = item.key.clone();
                    self.add_to(&mut w, cut.round, item).await?;
                    if let Some(w) = &w {
                        self.owner.insert(key, w.id());
                    }
                }
                Err((record, error)) => self.leftover(record, error).await,
            }
        }
        if let Some(w) = w {
            self.queue_cut(w)?;
        }
        Ok(())
    }

    /// The spool being cut from the input, started if there is none.
    fn input_writer(&mut self) -> Result<&mut spool::SpoolWriter, BatchError> {
        if self.input.is_none() {
            self.input = Some(self.spool.writer(0, true)?);
        }
        Ok(self.input.as_mut().expect("just made"))
    }

    /// A record read from the input, into the spool being cut (which is cut first if the
    /// record would take it past the provider's limits).
    async fn add_input(&mut self, item: Item) -> Result<(), BatchError> {
        let mut w = match self.input.take() {
            Some(w) => Some(w),
            None => Some(self.spool.writer(0, true)?),
        };
        let r = self.add_to(&mut w, 0, item).await;
        self.input = w;
        r
    }

    /// `item` into spool `w` of round `round` (started when there is none, and cut first when
    /// the item would take it past the provider's limits).
    async fn add_to(&mut self, w: &mut Option<spool::SpoolWriter>, round: u32, item: Item) -> Result<(), BatchError> {
        let line = match self.sites.first().line(&item.key, &item.request) {
            Ok(line) => line,
            Err(e) => {
                // Its row is written now; in a spool cut from the input it is kept as answered,
                // so that the spool still accounts for every record of its lines.
                if let Some(cur) = w.as_mut().filter(|c| c.from_input()) {
                    let (key, line) = (item.key.clone(), item.line);
                    cur.add(
                        &spool::Entry { key, line, record: item.record.clone(), answered: true, answer: None },
                        None,
                    )?;
                }
                self.host.deliver(item.record, Err(e)).await;
                return Ok(());
            }
        };
        let limits = self.sites.first().limits();
        if let Some(cur) = w.as_ref() {
            // A line over the byte limit alone still goes, in a job of its own (the provider
            // says what is wrong with it).
            let full = cur.count as usize >= limits.max_lines
                || (cur.count > 0 && cur.bytes as usize + line.len() > limits.max_bytes);
            if full {
                let from_input = cur.from_input();
                let cur = w.take().expect("checked");
                self.queue_cut(cur)?;
                *w = Some(self.spool.writer(round, from_input)?);
            }
        } else {
            *w = Some(self.spool.writer(round, false)?);
        }
        let answer = self.sites.first().answer_key(&item.key, &line);
        let entry = spool::Entry { key: item.key, line: item.line, record: item.record, answered: false, answer };
        w.as_mut().expect("made").add(&entry, Some(&line))?;
        Ok(())
    }

    /// The spool being cut from the input, cut (the input has ended).
    fn cut_input(&mut self) -> Result<(), BatchError> {
        match self.input.take() {
            Some(w) => self.queue_cut(w),
            None => Ok(()),
        }
    }

    /// A written spool, on the disk and queued for its job; one with no request for a job is
    /// dropped (its records were answered, and are read again from the input by a resumed run).
    fn queue_cut(&mut self, w: spool::SpoolWriter) -> Result<(), BatchError> {
        let cut = w.finish()?;
        if cut.count == 0 {
            self.spool.discard(cut.spool);
        } else {
            self.queue.push_back(cut);
        }
        Ok(())
    }

    /// Submits queued spools as jobs while an endpoint has room, each to the endpoint with the
    /// fewest records waiting in its jobs for its weight.
    async fn submit_ready(&mut self) -> Result<(), BatchError> {
        while !self.queue.is_empty() {
            let Some(site) = least_loaded(self.sites, &self.at_site, &self.active, self.settings.max_jobs) else {
                return Ok(());
            };
            // Nothing more is submitted once the caller has stopped (a first Ctrl-C).
            if self.cancel.is_cancelled() {
                return Err(BatchError::Cancelled);
            }
            let cut = self.queue.pop_front().expect("not empty");
            let api = &self.sites.0[site].api;
            let Some(body) = self.spool.body(cut.spool, cut.count)? else {
                return Err(BatchError::Spool(SpoolError {
                    path: format!("spool {}", cut.spool),
                    message: "its job input is missing (removed by hand?); run again with --fresh".into(),
                }));
            };
            let name = format!("{}-c{}", self.settings.name_prefix, self.ledger.next_number());
            let chunk = self.ledger.plan(Plan {
                round: cut.round,
                name: name.clone(),
                site: self.sites.recorded(site),
                spool: cut.spool,
                lines: cut.lines,
                count: cut.count,
            })?;
            let count = cut.count as usize;
            // In a pool, an endpoint that plainly refuses (a closed port, a rejected key) is
            // left at its first refusal, not after the tries that may pass elsewhere.
            let others = self.at_site.iter().filter(|(_, refused)| refused.is_none()).count() > 1;
            let first = if others { Some(api.submit(&name, &body).await) } else { None };
            // A try after one that failed may follow a job the provider made but whose answer
            // was lost (a connection cut after the request went out): it is looked up by its
            // name before it is made again (found by an outside tester: the same records were
            // paid for three times).
            let tried = std::sync::atomic::AtomicBool::new(first.is_some());
            let sought = chunk.sought(self.ledger.chunks());
            let submit = || async {
                if tried.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    if let Some(job) = api.find(&sought).await? {
                        tracing::info!("job {} was made by a try whose answer was lost", job.id);
                        return Ok(job);
                    }
                }
                api.submit(&name, &body).await
            };
            let result = match first {
                Some(Ok(job)) => Ok(job),
                Some(Err(e)) if made_no_job(&e) => Err(BatchError::Api(e)),
                _ => with_tries(self.settings.api_tries, self.cancel, submit).await,
            };
            let job = match result {
                Ok(job) => job,
                // The endpoint made no job and another may: its records go there.
                Err(BatchError::Api(e)) if made_no_job(&e) && others => {
                    tracing::warn!(
                        "batch jobs: endpoint {} refused a job ({e}); it gets no more jobs in this run, and its \
                         {count} records go to the others",
                        self.sites.0[site].label
                    );
                    self.ledger.refused(chunk.number, &e.to_string())?;
                    self.at_site[site].1 = Some(e.message.clone());
                    self.queue.push_front(cut);
                    continue;
                }
                Err(e) => return Err(e),
            };
            self.ledger.submitted(chunk.number, job.clone())?;
            self.spool.drop_body(cut.spool);
            self.submitted += 1;
            self.submitted_now = true;
            self.at_site[site].0 += 1;
            let at = if self.sites.0.len() > 1 { format!(" at {}", self.sites.0[site].label) } else { String::new() };
            tracing::info!("submitted job {}{at} ({count} records, round {})", job.id, cut.round);
            let (spool, round, count) = (cut.spool, cut.round, cut.count);
            self.active.push(Active { site, job, spool, count, round, status: None });
        }
        Ok(())
    }

    /// Asks about every job, and collects those that ended.
    async fn poll(&mut self) -> Result<(), BatchError> {
        for a in self.active.iter_mut() {
            let api = &self.sites.0[a.site].api;
            a.status = match reading(self.settings.api_tries, self.cancel, || api.status(&a.job)).await {
                // A job the provider does not know (any more): gone, with nothing answered;
                // its records go to a follow-up job.
                Err(BatchError::Api(e)) if matches!(e.kind, ErrorKind::BadRequest | ErrorKind::Endpoint) => {
                    tracing::warn!("job {} is unknown to the provider ({e}); its records are sent again", a.job.id);
                    Some(JobStatus {
                        state: JobState::Failed,
                        total: 0,
                        completed: 0,
                        failed: 0,
                        message: Some(e.message),
                        described: None,
                    })
                }
                other => Some(other?),
            };
        }
        // Those that ended are collected one at a time between records read from the input
        // (see `run`): collecting many jobs at once held up cutting and submitting the rest.
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].status.as_ref().is_some_and(|s| s.state.is_terminal()) {
                self.ended.push_back(self.active.swap_remove(i));
            } else {
                i += 1;
            }
        }
        self.report();
        Ok(())
    }

    /// A job that ended: its answers matched to its spool's records by key (never by order),
    /// each settled record to the host; the rest to a follow-up spool, or left over after the
    /// last round.
    async fn collect(&mut self, a: Active) -> Result<(), BatchError> {
        let api = &self.sites.0[a.site].api;
        let status = a.status.clone().expect("polled");
        // A job whose records all have their rows (a resumed run's) is not downloaded again.
        if !self.holds_open_records(a.spool)? {
            api.clean_up(&a.job).await;
            tracing::info!("job {} ended {}; every record of it has its row", a.job.id, status.state.as_str());
            return Ok(());
        }
        // Each answer as it is read, by key (a job's results are in no particular order).
        let answered: std::sync::Mutex<HashMap<String, Result<ModelResponse, ModelError>>> = Default::default();
        if status.total > 0 || status.state != JobState::Failed {
            let read = || async {
                let mut keep = |(key, r): JobResult| {
                    answered.lock().unwrap_or_else(|e| e.into_inner()).insert(key, r);
                };
                api.results(&a.job, &status, &mut keep).await
            };
            reading(self.settings.api_tries, self.cancel, read).await?;
        }
        let mut answered = answered.into_inner().unwrap_or_else(|e| e.into_inner());
        let mut follow: Option<spool::SpoolWriter> = None;
        let last_round = a.round + 1 >= self.settings.rounds.max(1);
        // Answer keys that records share (taken, not removed), to tell the answers that
        // matched no record from those that did.
        let mut shared: std::collections::HashSet<String> = std::collections::HashSet::new();
        for e in self.spool.entries(a.spool)? {
            let e = e?;
            // A record answered elsewhere, held by a later spool, or with its row: left alone.
            if !self.is_open(&e, a.spool) {
                match &e.answer {
                    Some(k) if answered.contains_key(k) => drop(shared.insert(k.clone())),
                    Some(_) => {}
                    None => drop(answered.remove(&e.key)),
                }
                continue;
            }
            if let Some(k) = e.answer.as_ref().filter(|k| answered.contains_key(*k)) {
                shared.insert(k.clone());
            }
            // Records sharing an answer key (the same text, where results are keyed by it)
            // share its result.
            let result = match &e.answer {
                Some(k) => answered.get(k).cloned(),
                None => answered.remove(&e.key),
            };
            let result = result.map(|r| {
                r.and_then(|answer| match self.host.check(&e.record, &answer) {
                    Some(invalid) => Err(invalid),
                    None => Ok(answer),
                })
            });
            match result {
                Some(r)
                    if r.as_ref().map_or_else(
                        |e| {
                            (!e.kind.is_retryable() || e.hint == weir_core::RetryHint::Never)
                                && e.kind != ErrorKind::Aborted
                        },
                        |_| true,
                    ) =>
                {
                    self.settled += 1;
                    self.host.deliver(e.record, r).await;
                }
                other if last_round => {
                    let error = match other {
                        Some(Err(e)) => e,
                        _ => ModelError::new(
                            ErrorKind::Server,
                            format!(
                                "the batch job ended {} without an answer for this record{}",
                                status.state.as_str(),
                                status.message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default()
                            ),
                        ),
                    };
                    self.leftover(e.record, error).await;
                }
                _ => match self.host.rebuild(e.key, e.record).await {
                    Ok(item) => {
                        let key = item.key.clone();
                        self.add_to(&mut follow, a.round + 1, item).await?;
                        if let Some(w) = &follow {
                            self.owner.insert(key, w.id());
                        }
                    }
                    Err((record, error)) => self.leftover(record, error).await,
                },
            }
        }
        // Paid-for answers that matched no record of the job: a provider that echoed a key or a
        // text otherwise than it was sent. Their records went to a follow-up or an error row.
        let unmatched = answered.len().saturating_sub(shared.len());
        if unmatched > 0 {
            tracing::warn!(
                "job {}: {unmatched} of its answers matched no record it was sent (the provider echoed a key or \
                 text otherwise than weir sent it?); their records were not answered by it",
                a.job.id
            );
        }
        if let Some(w) = follow {
            self.queue_cut(w)?;
        }
        api.clean_up(&a.job).await;
        tracing::info!("job {} ended {}", a.job.id, status.state.as_str());
        Ok(())
    }

    /// Whether entry `e` of spool `spool` is this spool's to settle: a record for a job, not
    /// taken over by a later spool, and without its row.
    fn is_open(&self, e: &spool::Entry, spool: u32) -> bool {
        !e.answered && self.owner.get(&e.key).is_none_or(|s| *s == spool) && !self.host.finished(&e.record)
    }

    /// Whether spool `spool` holds a record still without its row.
    fn holds_open_records(&self, spool: u32) -> Result<bool, BatchError> {
        for e in self.spool.entries(spool)? {
            let e = e?;
            if self.is_open(&e, spool) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn leftover(&mut self, record: Record, error: ModelError) {
        self.leftovers += 1;
        self.host.leftover(record, error).await;
    }

    /// Where the jobs stand, to the host.
    fn report(&mut self) {
        let queued = self.queue.iter().map(|c| c.count).sum();
        let mut p = Progress { settled: self.settled, queued, ..Default::default() };
        for a in self.active.iter().chain(&self.ended) {
            let state = a.status.as_ref().map_or(JobState::Pending, |s| s.state);
            *p.jobs.entry(state.as_str()).or_default() += 1;
            match &a.status {
                Some(s) => {
                    p.completed += s.completed;
                    p.failed += s.failed;
                    p.total += s.total.max(a.count);
                }
                None => p.total += a.count,
            }
        }
        self.host.progress(&p);
    }
}

/// The endpoint the next chunk goes to: of those that refused no job (`at_site`, as [`run`]
/// keeps it) and below `max_jobs`, the one with the fewest records in jobs not yet collected
/// for its weight (the first of equals, so that a run of one endpoint, or a pool's first
/// chunks, go in the pool's order); `None` when every one has its most jobs.
fn least_loaded(
    sites: &Sites,
    at_site: &[(u64, Option<String>)],
    active: &[Active],
    max_jobs: Option<usize>,
) -> Option<usize> {
    let (mut load, mut jobs) = (vec![0u64; sites.0.len()], vec![0usize; sites.0.len()]);
    for a in active {
        load[a.site] += a.count;
        jobs[a.site] += 1;
    }
    let usable: Vec<usize> = (0..sites.0.len()).filter(|&i| at_site[i].1.is_none()).collect();
    // Were every endpoint left (it cannot be: the last is never), the first would still serve.
    let usable = if usable.is_empty() { vec![0] } else { usable };
    usable.into_iter().filter(|&i| max_jobs.is_none_or(|m| jobs[i] < m.max(1))).min_by(|&a, &b| {
        let w = |i: usize| load[i] as f64 / sites.0[i].weight.max(1e-9);
        w(a).total_cmp(&w(b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;
    use weir_core::{JobLimits, JobResult};

    /// Issue #29, item 17: a token refresh refused once while polling is tried again (the jobs
    /// go on at the provider); a submission refused so is not.
    #[tokio::test(start_paused = true)]
    async fn asking_about_jobs_tries_a_refused_credential_again() {
        let cancel = CancellationToken::new();
        let calls = std::sync::atomic::AtomicU32::new(0);
        let once = || async {
            match calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
                0 => Err(ModelError::new(ErrorKind::Auth, "token refresh failed")),
                _ => Ok(7),
            }
        };
        assert_eq!(reading(5, &cancel, once).await.unwrap(), 7);
        calls.store(0, std::sync::atomic::Ordering::Relaxed);
        assert!(matches!(with_tries(5, &cancel, once).await, Err(BatchError::Api(e)) if e.kind == ErrorKind::Auth));
    }

    /// Asking about submitted jobs rides out an outage of minutes (one of 7 s stopped a run
    /// when it had 5 tries), and gives up after READ_PATIENCE; a submission keeps its count.
    #[tokio::test(start_paused = true)]
    async fn asking_about_jobs_rides_out_an_outage_of_minutes() {
        let cancel = CancellationToken::new();
        let start = tokio::time::Instant::now();
        let down_for = |d: Duration| {
            move || async move {
                match start.elapsed() < d {
                    true => Err(ModelError::new(ErrorKind::Server, "connection reset").with_unreachable()),
                    false => Ok(1),
                }
            }
        };
        assert_eq!(reading(5, &cancel, down_for(Duration::from_secs(300))).await.unwrap(), 1);
        let over = start.elapsed();
        assert!(over >= Duration::from_secs(300) && over < Duration::from_secs(300 + 61), "{over:?}");
        let start = tokio::time::Instant::now();
        assert!(reading(5, &cancel, || async { Err::<u32, _>(ModelError::new(ErrorKind::Server, "down")) })
            .await
            .is_err());
        let gave_up = start.elapsed();
        assert!(gave_up >= READ_PATIENCE && gave_up < READ_PATIENCE + Duration::from_secs(61), "{gave_up:?}");
        let start = tokio::time::Instant::now();
        assert!(with_tries(5, &cancel, down_for(Duration::from_secs(3600))).await.is_err());
        assert!(start.elapsed() < Duration::from_secs(120), "{:?}", start.elapsed());
    }

    /// Job API calls are retried by the same policy as model calls: the server's advised delay
    /// is waited out (not a fixed doubling from one second), and an error retrying cannot
    /// change is not retried.
    #[tokio::test(start_paused = true)]
    async fn job_api_calls_wait_out_the_advised_delay_and_skip_hopeless_retries() {
        let cancel = CancellationToken::new();
        let calls = std::sync::atomic::AtomicU32::new(0);
        let throttled = || async {
            match calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
                0 => Err(ModelError::new(ErrorKind::RateLimited, "429")
                    .with_hint(weir_core::RetryHint::Later(Some(Duration::from_secs(30))))),
                _ => Ok(1),
            }
        };
        let start = tokio::time::Instant::now();
        assert_eq!(with_tries(5, &cancel, throttled).await.unwrap(), 1);
        let waited = start.elapsed();
        assert!(waited >= Duration::from_secs(30) && waited < Duration::from_secs(32), "{waited:?}");
        calls.store(0, std::sync::atomic::Ordering::Relaxed);
        let bad = || async {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err::<u32, _>(ModelError::new(ErrorKind::BadRequest, "400"))
        };
        assert!(
            matches!(with_tries(5, &cancel, bad).await, Err(BatchError::Api(e)) if e.kind == ErrorKind::BadRequest)
        );
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 1, "a 400 was retried");
    }

    /// A provider whose jobs end at once, answering every line; one that `refuses` rejects
    /// the key of every submission.
    struct Instant {
        refuses: bool,
        limits: JobLimits,
        /// Submissions whose job is made but whose answer is lost (a cut connection), left.
        lose_replies: std::sync::atomic::AtomicU32,
        /// Jobs made.
        made: std::sync::atomic::AtomicU32,
        jobs: std::sync::Mutex<BTreeMap<String, Vec<String>>>,
        /// Jobs running, now and at most.
        outstanding: std::sync::Mutex<(usize, usize)>,
        /// Keys it answers with a retryable error, once each.
        flaky: std::sync::Mutex<std::collections::HashSet<String>>,
        /// Jobs it has said ended.
        ended: std::sync::Mutex<std::collections::HashSet<String>>,
        /// Lines are the prompts, and results come back keyed by them (as Vertex AI's batch
        /// embeddings echo the instance, not a key).
        by_prompt: bool,
    }

    impl Instant {
        fn new(refuses: bool) -> Arc<Self> {
            Self::with_limits(refuses, JobLimits { max_lines: 10, max_bytes: 1 << 20 })
        }
        fn with_limits(refuses: bool, limits: JobLimits) -> Arc<Self> {
            Arc::new(Self {
                refuses,
                limits,
                lose_replies: Default::default(),
                made: Default::default(),
                jobs: Default::default(),
                outstanding: Default::default(),
                flaky: Default::default(),
                ended: Default::default(),
                by_prompt: false,
            })
        }
        fn peak(&self) -> usize {
            self.outstanding.lock().unwrap().1
        }
        fn submitted(&self) -> usize {
            self.jobs.lock().unwrap().len()
        }
    }

    #[async_trait::async_trait]
    impl JobApi for Instant {
        fn model_id(&self) -> &str {
            "test/instant"
        }
        fn limits(&self) -> JobLimits {
            self.limits
        }
        fn line(&self, key: &str, request: &ModelRequest) -> Result<Vec<u8>, ModelError> {
            Ok(format!("{}\n", if self.by_prompt { &request.prompt } else { key }).into_bytes())
        }
        fn answer_key(&self, _: &str, line: &[u8]) -> Option<String> {
            self.by_prompt.then(|| String::from_utf8_lossy(line).trim_end().to_string())
        }
        async fn submit(&self, name: &str, input: &weir_core::JobInput) -> Result<JobRef, ModelError> {
            if self.refuses {
                return Err(ModelError::new(ErrorKind::Auth, "API key not valid"));
            }
            let body = input.read().await.unwrap();
            assert_eq!((body.len() as u64, body.iter().filter(|b| **b == b'\n').count()), (input.len, input.count));
            let keys = String::from_utf8(body).unwrap().lines().map(str::to_string).collect();
            self.jobs.lock().unwrap().insert(name.to_string(), keys);
            let mut o = self.outstanding.lock().unwrap();
            o.0 += 1;
            o.1 = o.1.max(o.0);
            drop(o);
            self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let lose = &self.lose_replies;
            if lose.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)).is_ok() {
                return Err(ModelError::new(ErrorKind::Transport, "connection closed before message completed"));
            }
            Ok(JobRef { id: name.to_string(), file: None })
        }
        async fn find(&self, sought: &weir_core::Sought) -> Result<Option<JobRef>, ModelError> {
            let name = &sought.name;
            Ok(self.jobs.lock().unwrap().contains_key(name).then(|| JobRef { id: name.to_string(), file: None }))
        }
        async fn status(&self, job: &JobRef) -> Result<JobStatus, ModelError> {
            let n = self.jobs.lock().unwrap()[&job.id].len() as u64;
            // Running until it is first asked about.
            if self.ended.lock().unwrap().insert(job.id.clone()) {
                self.outstanding.lock().unwrap().0 -= 1;
            }
            Ok(JobStatus {
                state: JobState::Succeeded,
                total: n,
                completed: n,
                failed: 0,
                message: None,
                described: None,
            })
        }
        async fn results(
            &self,
            job: &JobRef,
            _: &JobStatus,
            each: &mut (dyn FnMut(JobResult) + Send),
        ) -> Result<(), ModelError> {
            let keys = self.jobs.lock().unwrap()[&job.id].clone();
            let mut flaky = self.flaky.lock().unwrap();
            for k in keys {
                if flaky.remove(&k) {
                    each((k, Err(ModelError::new(ErrorKind::Server, "try again"))));
                    continue;
                }
                let r = ModelResponse {
                    text: k.clone(),
                    embedding: None,
                    finish_reason: "stop".into(),
                    usage: Default::default(),
                    model_version: None,
                    limits: None,
                };
                each((k, Ok(r)));
            }
            Ok(())
        }
        async fn cancel(&self, _: &JobRef) -> Result<(), ModelError> {
            Ok(())
        }
    }

    fn item(key: &str, line: u64) -> Item {
        Item {
            key: key.to_string(),
            line,
            request: ModelRequest {
                prompt: String::new(),
                system: None,
                params: Default::default(),
                media: Default::default(),
                fields: None,
            },
            record: serde_json::value::to_raw_value(key).unwrap(),
        }
    }

    fn items(n: usize) -> Vec<Item> {
        (0..n).map(|i| item(&format!("k{i:03}"), i as u64 + 1)).collect()
    }

    /// The caller's side in the tests: what was delivered, left over, and most queued.
    #[derive(Default)]
    struct Seen {
        delivered: Vec<(String, String)>,
        leftovers: Vec<String>,
        most_queued: u64,
        finished: std::collections::HashSet<String>,
    }

    #[async_trait::async_trait]
    impl Host for Seen {
        fn finished(&self, record: &Record) -> bool {
            self.finished.contains(&serde_json::from_str::<String>(record.get()).unwrap())
        }
        async fn answer_again(&mut self, _: &Record) -> bool {
            false
        }
        async fn rebuild(&mut self, key: String, record: Record) -> Result<Item, (Record, ModelError)> {
            Ok(Item { record, ..item(&key, 0) })
        }
        async fn deliver(&mut self, record: Record, result: Result<ModelResponse, ModelError>) {
            self.delivered.push((serde_json::from_str(record.get()).unwrap(), result.unwrap().text));
        }
        async fn leftover(&mut self, record: Record, _: ModelError) {
            self.leftovers.push(serde_json::from_str(record.get()).unwrap());
        }
        fn progress(&mut self, p: &Progress) {
            self.most_queued = self.most_queued.max(p.queued);
        }
    }

    /// A spool of `n` records cut from the input beside `ledger` (not yet planned).
    fn spooled(ledger: &Ledger, n: usize) -> spool::Cut {
        let mut w = Spool::open(ledger).unwrap().writer(0, true).unwrap();
        for i in items(n) {
            let e = spool::Entry { key: i.key.clone(), line: i.line, record: i.record, answered: false, answer: None };
            w.add(&e, Some(format!("{}\n", i.key).as_bytes())).unwrap();
        }
        w.finish().unwrap()
    }

    /// Runs `items` through `sites` with ledger `path` (`fresh`: a new one).
    async fn drive(
        sites: &Sites,
        path: &std::path::Path,
        fresh: bool,
        items: Vec<Item>,
        settings: &JobSettings,
        seen: &mut Seen,
    ) -> (Result<Finished, BatchError>, Ledger) {
        let mut ledger = Ledger::open(path, fresh).unwrap();
        let mut spool = Spool::open(&ledger).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let feed = tokio::spawn(async move {
            for i in items {
                tx.send(Incoming::Job(i)).await.unwrap();
            }
        });
        let r = run(sites, &mut ledger, &mut spool, &mut rx, settings, &CancellationToken::new(), seen).await;
        feed.await.unwrap();
        (r, ledger)
    }

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("weir-jobs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn quick() -> JobSettings {
        JobSettings { poll_first: Duration::from_millis(10), ..JobSettings::default() }
    }

    /// Found by an outside tester (issue #34): a ledger cut short forgot submitted jobs, and
    /// their records were paid for again without a word. A spool the ledger does not name is
    /// removed only when it was never submitted (its job input is still there).
    #[test]
    fn a_spool_whose_job_the_ledger_lost_is_said() {
        let dir = temp("ledger-cut");
        let ledger = Ledger::open(&dir.join("jobs.jsonl"), true).unwrap();
        let cut = spooled(&ledger, 3);
        Spool::open(&ledger).expect("a spool cut but never planned is dropped");
        assert!(!Spool::records_path(&Ledger::spool_dir_of(ledger.path()), cut.spool).exists());
        let cut = spooled(&ledger, 3);
        let spools = Ledger::spool_dir_of(ledger.path());
        std::fs::remove_file(spools.join(format!("s{}.body", cut.spool))).unwrap();
        let e = Spool::open(&ledger).unwrap_err();
        assert!(e.to_string().contains("does not name it"), "{e}");
    }

    /// Issue #34: where a provider answers by the request's content (Vertex AI's batch
    /// embeddings echo the instance, not a key), records are matched to answers by it, and
    /// records with the same content in one job each get the one answer.
    #[tokio::test(start_paused = true)]
    async fn answers_keyed_by_content_reach_every_record_with_that_content() {
        let dir = temp("by-content");
        let api = Arc::new(Instant { by_prompt: true, ..Arc::into_inner(Instant::new(false)).unwrap() });
        let sites = Sites::one(api.clone() as Arc<dyn JobApi>, "one".into());
        let items: Vec<Item> = items(35)
            .into_iter()
            .enumerate()
            .map(|(i, mut it)| {
                it.request.prompt = format!("p{}", i % 7);
                it
            })
            .collect();
        let mut seen = Seen::default();
        let (finished, _) = drive(&sites, &dir.join("jobs.jsonl"), true, items, &quick(), &mut seen).await;
        assert_eq!(finished.unwrap().leftovers, 0);
        let mut delivered = seen.delivered.clone();
        delivered.sort();
        assert_eq!(delivered.len(), 35);
        for (key, text) in &delivered {
            let i: usize = key[1..].parse().unwrap();
            assert_eq!(text, &format!("p{}", i % 7), "record {key}");
        }
        assert_eq!(api.submitted(), 4, "jobs of ten lines each");
    }

    /// Issue #33: a pool's chunks go to the endpoint with the fewest records waiting for its
    /// weight, each recorded with its endpoint; an endpoint that rejects the key gets no more
    /// jobs and its chunk goes to another; every record settles once.
    #[tokio::test(start_paused = true)]
    async fn a_pool_spreads_chunks_by_weight_and_moves_a_refused_chunk_elsewhere() {
        let dir = temp("pool");
        let (a, b, dead) = (Instant::new(false), Instant::new(false), Instant::new(true));
        let site = |name: &str, api: &Arc<Instant>, weight: f64| Site {
            name: name.into(),
            label: name.into(),
            api: api.clone() as Arc<dyn JobApi>,
            weight,
        };
        let sites = Sites::pool(vec![site("dead", &dead, 1.0), site("a", &a, 2.0), site("b", &b, 1.0)]);
        // Every chunk cut before the first is submitted, as with a fast input and slow jobs.
        let settings = JobSettings { max_jobs: Some(100), ..quick() };
        let mut seen = Seen::default();
        let (finished, ledger) = drive(&sites, &dir.join("jobs.jsonl"), true, items(120), &settings, &mut seen).await;
        let finished = finished.unwrap();
        assert_eq!(finished.leftovers, 0);
        // What the summary says per endpoint: jobs submitted, and why one refused them.
        let dead_line = &finished.sites[0];
        assert_eq!((dead_line.0.as_str(), dead_line.1), ("dead", 0));
        assert!(dead_line.2.as_deref().is_some_and(|w| w.contains("API key not valid")));
        let mut delivered = seen.delivered.clone();
        delivered.sort();
        assert_eq!(delivered.len(), 120);
        assert!(delivered.iter().all(|(k, t)| k == t));
        delivered.dedup();
        assert_eq!(delivered.len(), 120, "a record settled twice");
        // Twelve jobs of ten, none at the dead endpoint; by weight, a gets more than b.
        assert_eq!(dead.submitted(), 0);
        assert_eq!(a.submitted() + b.submitted(), 12);
        assert!(a.submitted() > b.submitted(), "{} {}", a.submitted(), b.submitted());
        let by_site = |name: &str| ledger.chunks().filter(|c| c.site == name && c.job.is_some()).count();
        assert_eq!((by_site("dead"), by_site("a"), by_site("b")), (0, a.submitted(), b.submitted()));
        // The chunk the dead endpoint refused is in the ledger without a job, and its spool
        // was planned again elsewhere.
        let refused: Vec<_> = ledger.chunks().filter(|c| c.site == "dead").collect();
        assert_eq!(refused.len(), 1);
        assert!(refused[0].refused.as_deref().is_some_and(|r| r.contains("API key not valid")));
        let again = ledger.chunks().filter(|c| c.spool == refused[0].spool && c.job.is_some()).count();
        assert_eq!(again, 1);
        // A resumed run whose pool lacks an endpoint of the ledger's jobs is refused.
        let only_b = Sites::pool(vec![site("b", &b, 1.0), site("dead", &dead, 1.0)]);
        let chunk_at_a = ledger.chunks().find(|c| c.site == "a").unwrap().clone();
        assert!(matches!(only_b.api_of(&chunk_at_a), Err(BatchError::Site(m)) if m.contains("\"a\"")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Found by an outside tester: a submission whose job was made but whose answer was lost
    /// was tried again and made the job again (the same records paid for twice). A try after a
    /// failed one looks the job up by its name first: one job per chunk, in a pool too.
    #[tokio::test(start_paused = true)]
    async fn a_submission_whose_answer_was_lost_is_found_not_made_again() {
        for pool in [false, true] {
            let dir = temp(&format!("lost-{pool}"));
            let (a, b) = (Instant::new(false), Instant::new(false));
            a.lose_replies.store(2, Relaxed);
            b.lose_replies.store(2, Relaxed);
            let sites = if pool {
                Sites::pool(vec![
                    Site { name: "a".into(), label: "a".into(), api: a.clone(), weight: 1.0 },
                    Site { name: "b".into(), label: "b".into(), api: b.clone(), weight: 1.0 },
                ])
            } else {
                Sites::one(a.clone(), String::new())
            };
            let mut seen = Seen::default();
            let (finished, _) = drive(&sites, &dir.join("jobs.jsonl"), true, items(30), &quick(), &mut seen).await;
            assert_eq!((seen.delivered.len(), finished.unwrap().submitted), (30, 3), "pool: {pool}");
            let made = a.made.load(Relaxed) + b.made.load(Relaxed);
            assert_eq!(made, 3, "pool: {pool}: a job made twice for one chunk");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Issue #34: with `max_jobs`, no endpoint has more jobs than that at once; the records
    /// beyond wait in spools (reported as queued) and go out as jobs end; every one settles once.
    #[tokio::test(start_paused = true)]
    async fn no_endpoint_has_more_than_max_jobs_and_the_rest_wait_queued() {
        let dir = temp("cap");
        let (a, b) = (Instant::new(false), Instant::new(false));
        let sites = Sites::pool(vec![
            Site { name: "a".into(), label: "a".into(), api: a.clone(), weight: 1.0 },
            Site { name: "b".into(), label: "b".into(), api: b.clone(), weight: 1.0 },
        ]);
        let settings = JobSettings { max_jobs: Some(2), ..quick() };
        let mut seen = Seen::default();
        let (finished, _) = drive(&sites, &dir.join("jobs.jsonl"), true, items(200), &settings, &mut seen).await;
        let finished = finished.unwrap();
        assert_eq!((seen.delivered.len(), finished.leftovers, finished.submitted), (200, 0, 20));
        assert_eq!((a.peak(), b.peak()), (2, 2), "at most two jobs at each endpoint at once");
        assert!(seen.most_queued >= 100, "records queued while four jobs were out: {}", seen.most_queued);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Found by an outside tester: a run killed after an endpoint refused a chunk but before
    /// its records were planned elsewhere could not be resumed. The refusal is in the ledger:
    /// a resumed run plans the chunk's spool again, without asking that endpoint.
    #[tokio::test(start_paused = true)]
    async fn a_chunk_its_endpoint_refused_is_planned_again_on_resume_without_that_endpoint() {
        let dir = temp("refused");
        let path = dir.join("jobs.jsonl");
        {
            let mut l = Ledger::open(&path, true).unwrap();
            let cut = spooled(&l, 15);
            let plan =
                Plan { round: 0, name: "run-c0".into(), site: "gone", spool: cut.spool, lines: cut.lines, count: 15 };
            let c = l.plan(plan).unwrap();
            l.refused(c.number, "connection refused").unwrap();
        }
        assert!(open_chunks(&Ledger::read(&path).unwrap()).is_empty(), "a refused chunk holds no records");
        assert!(Claims::of(&Ledger::open(&path, false).unwrap()).holds(15), "its lines stay claimed");
        let a = Instant::new(false);
        let sites = Sites::pool(vec![
            Site { name: "a".into(), label: "a".into(), api: a.clone(), weight: 1.0 },
            Site { name: "b".into(), label: "b".into(), api: Instant::new(false), weight: 1.0 },
        ]);
        let mut seen = Seen::default();
        let (finished, _) = drive(&sites, &path, false, Vec::new(), &quick(), &mut seen).await;
        let finished = finished.unwrap();
        assert_eq!((seen.delivered.len(), finished.leftovers, finished.reattached), (15, 0, 0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Found by an outside tester: a chunk cut larger than the provider takes (refused for its
    /// size, so never made) came back whole on every run, whatever --job-max-requests said. A
    /// resumed run cuts it again within the limits now in force.
    #[tokio::test(start_paused = true)]
    async fn a_chunk_larger_than_a_job_may_now_be_is_cut_again_on_resume() {
        let dir = temp("recut");
        let path = dir.join("jobs.jsonl");
        {
            let mut l = Ledger::open(&path, true).unwrap();
            let cut = spooled(&l, 15);
            let plan =
                Plan { round: 0, name: "run-c0".into(), site: "", spool: cut.spool, lines: cut.lines, count: 15 };
            l.plan(plan).unwrap();
        }
        let api = Instant::new(false);
        let sites = Sites::one(api.clone(), String::new());
        let mut seen = Seen::default();
        let (finished, _) = drive(&sites, &path, false, Vec::new(), &quick(), &mut seen).await;
        assert_eq!((finished.unwrap().submitted, seen.delivered.len()), (2, 15));
        let jobs = api.jobs.lock().unwrap();
        assert!(jobs.values().all(|k| k.len() <= 10), "{jobs:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue #34: jobs are cut from the input as it is read, within both of the provider's
    /// limits, in input order; a line over the byte limit alone goes in a job of its own.
    #[tokio::test(start_paused = true)]
    async fn chunks_keep_to_both_limits_in_input_order() {
        let dir = temp("limits");
        let api = Instant::with_limits(false, JobLimits { max_lines: 3, max_bytes: 12 });
        let sites = Sites::one(api.clone(), String::new());
        let keys = ["a", "b", "c", "d", "eeeeeeeeeeeeeeee", "f", "ggg", "hhh", "iii"];
        let input = keys.iter().enumerate().map(|(i, k)| item(k, i as u64 + 1)).collect();
        let mut seen = Seen::default();
        let (finished, ledger) = drive(&sites, &dir.join("jobs.jsonl"), true, input, &quick(), &mut seen).await;
        assert_eq!(finished.unwrap().submitted, 5);
        let jobs = api.jobs.lock().unwrap();
        let chunks: Vec<String> = ledger.chunks().map(|c| jobs[&c.name].join(",")).collect();
        assert_eq!(chunks, ["a,b,c", "d", "eeeeeeeeeeeeeeee", "f,ggg,hhh", "iii"]);
        let lines: Vec<_> = ledger.chunks().map(|c| c.lines.unwrap()).collect();
        assert_eq!(lines, [(1, 3), (4, 4), (5, 5), (6, 8), (9, 9)]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue #34: a record a job answered with a retryable error goes into a follow-up spool
    /// and job; a resumed run reads the follow-up's keys and leaves them to it (the first
    /// job's spool has them too); records with rows are left alone.
    #[tokio::test(start_paused = true)]
    async fn follow_ups_take_their_records_over_and_a_resume_leaves_finished_records_alone() {
        let dir = temp("follow");
        let path = dir.join("jobs.jsonl");
        let api = Instant::new(false);
        api.flaky.lock().unwrap().extend(["k001".to_string(), "k004".to_string()]);
        let sites = Sites::one(api.clone(), String::new());
        let mut seen = Seen::default();
        let (finished, ledger) = drive(&sites, &path, true, items(10), &quick(), &mut seen).await;
        assert_eq!((finished.unwrap().submitted, seen.delivered.len()), (2, 10));
        let follow = ledger.chunks().find(|c| c.round == 1).unwrap();
        assert_eq!((follow.count, follow.lines), (2, None));
        drop(ledger);
        // Resumed with every row written but k004's: only k004 is delivered again, once, from
        // the follow-up job (the first job answered it with an error).
        let finished = (0..10).map(|i| format!("k{i:03}")).filter(|k| k != "k004").collect();
        let mut again = Seen { finished, ..Seen::default() };
        let (finished, _) = drive(&sites, &path, false, Vec::new(), &quick(), &mut again).await;
        assert_eq!(finished.unwrap().reattached, 2);
        assert_eq!(again.delivered, [("k004".to_string(), "k004".to_string())]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
