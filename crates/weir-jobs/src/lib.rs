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

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use weir_core::{ErrorKind, JobApi, JobRef, JobState, JobStatus, ModelError, ModelRequest, ModelResponse};

pub use ledger::{open_chunks, Chunk, Ledger, LedgerError};

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
    /// Jobs not yet collected at one endpoint at most (providers limit the jobs running at
    /// once: Vertex AI per region); records beyond wait here, queued, until one ends.
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
    /// What to ask.
    pub request: ModelRequest,
}

/// Where the jobs stand, for a progress display.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Jobs submitted or re-attached, by state.
    pub jobs: BTreeMap<&'static str, u32>,
    /// Requests the provider reports answered in the jobs not yet collected.
    pub completed: u64,
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

/// What became of the records: those settled were handed to `deliver`; these were not
/// answered after every round, each with its last error.
pub type Leftovers = Vec<(Item, ModelError)>;

/// The end of [`run`].
#[derive(Debug)]
pub struct Finished {
    /// Records no job answered, with their last error.
    pub leftovers: Leftovers,
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
    chunk: u32,
    /// The index of its endpoint.
    site: usize,
    job: JobRef,
    keys: Vec<String>,
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
    let policy =
        weir_core::RetryPolicy { max_retries: tries.max(1) - 1, base: JOB_API_BACKOFF.0, cap: JOB_API_BACKOFF.1 };
    let mut rng = rand::rngs::SmallRng::from_entropy();
    let mut attempts = 0;
    loop {
        attempts += 1;
        let e = match f().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
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

/// Runs `items` through the jobs of `sites`. Each settled record (an answer, or an error that
/// another try would not change) goes to `deliver` once; `progress` is called after every poll.
pub async fn run(
    sites: &Sites,
    ledger: &mut Ledger,
    items: Vec<Item>,
    settings: &JobSettings,
    cancel: &CancellationToken,
    progress: &mut (dyn FnMut(&Progress) + Send),
    deliver: &mut (dyn FnMut(Item, Result<ModelResponse, ModelError>) + Send),
) -> Result<Finished, BatchError> {
    let mut pending: HashMap<String, Item> = items.into_iter().map(|i| (i.key.clone(), i)).collect();
    let mut settled = 0u64;
    let mut leftovers: Leftovers = Vec::new();
    let (mut submitted, mut reattached) = (0u64, 0u64);
    // Per endpoint: the jobs submitted there, and why it refused one for good (it gets no more
    // in this run).
    let mut at_site: Vec<(u64, Option<String>)> = vec![(0, None); sites.0.len()];
    // Re-attach: each pending key to the latest chunk that holds it.
    let mut attached: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let mut fresh: Vec<String> = Vec::new();
    for key in pending.keys() {
        match ledger.latest_chunk(key) {
            Some(c) => attached.entry(c.number).or_default().push(key.clone()),
            None => fresh.push(key.clone()),
        }
    }
    // Every chunk's endpoint known before anything is asked (said for all that are not).
    let missing: Vec<&Chunk> = attached
        .keys()
        .map(|n| ledger.chunk(*n).expect("a chunk the ledger named"))
        .filter(|c| c.refused.is_none() && sites.index_of(c).is_none())
        .collect();
    if !missing.is_empty() {
        return Err(missing_sites(&missing));
    }
    let mut active: Vec<Active> = Vec::new();
    let mut next_round: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    if !fresh.is_empty() {
        next_round.insert(0, fresh);
    }
    for (number, keys) in attached {
        let chunk = ledger.chunk(number).cloned().expect("a chunk the ledger named");
        if chunk.refused.is_some() {
            // Its endpoint made no job: its records are planned again.
            next_round.entry(0).or_default().extend(keys);
            continue;
        }
        let site = sites.index_of(&chunk).expect("checked above");
        let api = &sites.0[site].api;
        let job = match chunk.job.clone() {
            Some(job) => Some(job),
            // Recorded, but the run stopped before the id was: the provider may have it.
            None => match with_tries(settings.api_tries, cancel, || api.find(&chunk.name)).await? {
                Some(job) => {
                    ledger.submitted(number, job.clone())?;
                    Some(job)
                }
                None => None,
            },
        };
        match job {
            // Rounds count from this call: records an earlier job left unanswered (or that
            // `--retry-errors` brings back) get follow-up jobs again.
            Some(job) => {
                tracing::info!("re-attached to job {} ({} records still open)", job.id, keys.len());
                reattached += 1;
                active.push(Active { chunk: number, site, job, keys, round: 0, status: None });
            }
            None => next_round.entry(0).or_default().extend(keys),
        }
    }
    let mut report = |active: &[Active], settled: u64, queued: &BTreeMap<u32, Vec<String>>| {
        let queued = queued.values().map(|k| k.len() as u64).sum();
        let mut p = Progress { settled, queued, ..Default::default() };
        for a in active {
            let state = a.status.as_ref().map_or(JobState::Pending, |s| s.state);
            *p.jobs.entry(state.as_str()).or_default() += 1;
            if let Some(s) = &a.status {
                p.completed += s.completed + s.failed;
                p.total += s.total.max(a.keys.len() as u64);
            } else {
                p.total += a.keys.len() as u64;
            }
        }
        progress(&p);
    };
    loop {
        // Submit what waits for a job, in chunks within the provider's limits, each to the
        // endpoint with the fewest records waiting in its jobs for its weight.
        for (round, keys) in std::mem::take(&mut next_round) {
            if round >= settings.rounds.max(1) {
                for k in keys {
                    if let Some(item) = pending.remove(&k) {
                        let e = ModelError::new(ErrorKind::Server, "no answer after every batch job round");
                        leftovers.push((item, e));
                    }
                }
                continue;
            }
            // One chunk's lines at a time: a job's input is up to 1 GB (Vertex AI), and a run
            // may need many jobs.
            let mut chunks = Chunker::new(keys);
            loop {
                let Some(site) = least_loaded(sites, &at_site, &active, settings.max_jobs) else {
                    // Every endpoint has its most jobs: the rest wait here for one to end.
                    let rest = chunks.rest();
                    if !rest.is_empty() {
                        next_round.entry(round).or_default().extend(rest);
                    }
                    break;
                };
                let api = &sites.0[site].api;
                let Some(chunk_keys) = chunks.next(&**api, &pending)? else { break };
                let (keys, lines): (Vec<String>, Vec<Vec<u8>>) = chunk_keys.into_iter().unzip();
                let count = keys.len();
                // Nothing more is submitted once the caller has stopped (a first Ctrl-C).
                if cancel.is_cancelled() {
                    return Err(BatchError::Cancelled);
                }
                let name = format!("{}-c{}", settings.name_prefix, ledger.next_number());
                let chunk = ledger.plan(round, name.clone(), sites.recorded(site), keys.clone())?;
                let body = lines.concat();
                // In a pool, an endpoint that plainly refuses (a closed port, a rejected key) is
                // left at its first refusal, not after the tries that may pass elsewhere.
                let others = at_site.iter().filter(|(_, refused)| refused.is_none()).count() > 1;
                let first = if others { Some(api.submit(&name, body.clone(), count).await) } else { None };
                // A try after one that failed may follow a job the provider made but whose answer
                // was lost (a connection cut after the request went out): it is looked up by its
                // name before it is made again (found by an outside tester: the same records
                // were paid for three times).
                let tried = std::sync::atomic::AtomicBool::new(first.is_some());
                let submit = || async {
                    if tried.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        if let Some(job) = api.find(&name).await? {
                            tracing::info!("job {} was made by a try whose answer was lost", job.id);
                            return Ok(job);
                        }
                    }
                    api.submit(&name, body.clone(), count).await
                };
                let result = match first {
                    Some(Ok(job)) => Ok(job),
                    Some(Err(e)) if made_no_job(&e) => Err(BatchError::Api(e)),
                    _ => with_tries(settings.api_tries, cancel, submit).await,
                };
                let job = match result {
                    Ok(job) => job,
                    // The endpoint made no job and another may: its records go there.
                    Err(BatchError::Api(e)) if made_no_job(&e) && others => {
                        tracing::warn!(
                            "batch jobs: endpoint {} refused a job ({e}); it gets no more jobs in this run, and its \
                             {count} records go to the others",
                            sites.0[site].label
                        );
                        ledger.refused(chunk.number, &e.to_string())?;
                        at_site[site].1 = Some(e.message.clone());
                        next_round.entry(round).or_default().extend(keys);
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                ledger.submitted(chunk.number, job.clone())?;
                submitted += 1;
                at_site[site].0 += 1;
                let at = if sites.0.len() > 1 { format!(" at {}", sites.0[site].label) } else { String::new() };
                tracing::info!("submitted job {}{at} ({count} records, round {round})", job.id);
                active.push(Active { chunk: chunk.number, site, job, keys, round, status: None });
            }
        }
        let room = least_loaded(sites, &at_site, &active, settings.max_jobs).is_some();
        if !next_round.is_empty() && room {
            // Records an endpoint refused, for the others.
            continue;
        }
        if active.is_empty() {
            let sites = match sites.0.len() {
                1 => Vec::new(),
                _ => sites.0.iter().zip(at_site).map(|(s, (n, why))| (s.label.clone(), n, why)).collect(),
            };
            return Ok(Finished { leftovers, submitted, reattached, sites });
        }
        report(&active, settled, &next_round);
        // Wait for every job to end, polling with a growing interval.
        let mut wait = settings.poll_first;
        while !active.is_empty() {
            for a in active.iter_mut() {
                let api = &sites.0[a.site].api;
                a.status = match reading(settings.api_tries, cancel, || api.status(&a.job)).await {
                    // A job the provider does not know (any more): gone, with nothing answered;
                    // its records go to a follow-up job.
                    Err(BatchError::Api(e)) if e.kind == ErrorKind::BadRequest => {
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
            let mut i = 0;
            while i < active.len() {
                let done = active[i].status.as_ref().is_some_and(|s| s.state.is_terminal());
                if !done {
                    i += 1;
                    continue;
                }
                let a = active.swap_remove(i);
                let api = &sites.0[a.site].api;
                let status = a.status.clone().expect("polled");
                let results = if status.total == 0 && status.state == JobState::Failed {
                    Vec::new()
                } else {
                    reading(settings.api_tries, cancel, || api.results(&a.job, &status)).await?
                };
                let mut answered: HashMap<String, Result<ModelResponse, ModelError>> = results.into_iter().collect();
                for key in a.keys {
                    // A record finished by a later job, or not open in this run, is left alone.
                    if ledger.latest_chunk(&key).map(|c| c.number) != Some(a.chunk) || !pending.contains_key(&key) {
                        continue;
                    }
                    match answered.remove(&key) {
                        Some(r)
                            if r.as_ref()
                                .map_or_else(|e| !e.kind.is_retryable() && e.kind != ErrorKind::Aborted, |_| true) =>
                        {
                            let item = pending.remove(&key).expect("pending");
                            settled += 1;
                            deliver(item, r);
                        }
                        other => {
                            if a.round + 1 >= settings.rounds.max(1) {
                                let e = match other {
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
                                if let Some(item) = pending.remove(&key) {
                                    leftovers.push((item, e));
                                }
                            } else {
                                next_round.entry(a.round + 1).or_default().push(key);
                            }
                        }
                    }
                }
                api.clean_up(&a.job).await;
                tracing::info!("job {} ended {}", a.job.id, status.state.as_str());
            }
            report(&active, settled, &next_round);
            if !next_round.is_empty() && least_loaded(sites, &at_site, &active, settings.max_jobs).is_some() {
                // Follow-ups and queued records go out while the other jobs run.
                break;
            }
            if active.is_empty() {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = cancel.cancelled() => return Err(BatchError::Cancelled),
            }
            wait = (wait * 2).min(settings.poll_max);
        }
    }
}

/// The endpoint the next chunk goes to: of those that refused no job (`at_site`, as [`run`]
/// keeps it) and below `max_jobs`, the one with
/// the fewest records in jobs not yet collected for its weight (the first of equals, so that a
/// run of one endpoint, or a pool's first chunks, go in the pool's order); `None` when every
/// one has its most jobs.
fn least_loaded(
    sites: &Sites,
    at_site: &[(u64, Option<String>)],
    active: &[Active],
    max_jobs: Option<usize>,
) -> Option<usize> {
    let (mut load, mut jobs) = (vec![0usize; sites.0.len()], vec![0usize; sites.0.len()]);
    for a in active {
        load[a.site] += a.keys.len();
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

/// `keys` as chunks of (key, line) within the provider's limits, in key order, one chunk at
/// a time (the lines of later chunks are not built until they are asked for).
struct Chunker {
    keys: std::vec::IntoIter<String>,
    /// The line that did not fit the last chunk: the first of the next.
    carry: Option<(String, Vec<u8>)>,
}

impl Chunker {
    fn new(mut keys: Vec<String>) -> Self {
        keys.sort();
        Self { keys: keys.into_iter(), carry: None }
    }

    /// The keys not yet in a chunk.
    fn rest(self) -> Vec<String> {
        self.carry.map(|(k, _)| k).into_iter().chain(self.keys).collect()
    }

    /// The next chunk; `None` when every key is in one. Keys no longer pending are skipped.
    #[allow(clippy::type_complexity)]
    fn next(
        &mut self,
        api: &dyn JobApi,
        pending: &HashMap<String, Item>,
    ) -> Result<Option<Vec<(String, Vec<u8>)>>, BatchError> {
        let limits = api.limits();
        let mut chunk: Vec<(String, Vec<u8>)> = self.carry.take().into_iter().collect();
        let mut bytes: usize = chunk.iter().map(|(_, l)| l.len()).sum();
        for key in self.keys.by_ref() {
            let Some(item) = pending.get(&key) else { continue };
            let line = api.line(&key, &item.request).map_err(BatchError::Api)?;
            // A line over the byte limit alone still goes, in a job of its own (the provider
            // says what is wrong with it).
            if !chunk.is_empty() && (chunk.len() >= limits.max_lines || bytes + line.len() > limits.max_bytes) {
                self.carry = Some((key, line));
                break;
            }
            bytes += line.len();
            chunk.push((key, line));
        }
        Ok((!chunk.is_empty()).then_some(chunk))
    }
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

    /// A provider whose lines are the key and a newline, with small limits.
    struct Small;

    #[async_trait::async_trait]
    impl JobApi for Small {
        fn model_id(&self) -> &str {
            "test/small"
        }
        fn limits(&self) -> JobLimits {
            JobLimits { max_lines: 3, max_bytes: 12 }
        }
        fn line(&self, key: &str, _: &ModelRequest) -> Result<Vec<u8>, ModelError> {
            Ok(format!("{key}\n").into_bytes())
        }
        async fn submit(&self, _: &str, _: Vec<u8>, _: usize) -> Result<JobRef, ModelError> {
            unreachable!("not submitted in this test")
        }
        async fn find(&self, _: &str) -> Result<Option<JobRef>, ModelError> {
            unreachable!()
        }
        async fn status(&self, _: &JobRef) -> Result<JobStatus, ModelError> {
            unreachable!()
        }
        async fn results(&self, _: &JobRef, _: &JobStatus) -> Result<Vec<JobResult>, ModelError> {
            unreachable!()
        }
        async fn cancel(&self, _: &JobRef) -> Result<(), ModelError> {
            unreachable!()
        }
    }

    /// A provider whose jobs end at once, answering every line; one that `refuses` rejects
    /// the key of every submission.
    struct Instant {
        refuses: bool,
        /// Submissions whose job is made but whose answer is lost (a cut connection), left.
        lose_replies: std::sync::atomic::AtomicU32,
        /// Jobs made.
        made: std::sync::atomic::AtomicU32,
        jobs: std::sync::Mutex<HashMap<String, Vec<String>>>,
        /// Jobs submitted and not yet collected, now and at most.
        outstanding: std::sync::Mutex<(usize, usize)>,
    }

    impl Instant {
        fn new(refuses: bool) -> Arc<Self> {
            Arc::new(Self {
                refuses,
                lose_replies: Default::default(),
                made: Default::default(),
                jobs: Default::default(),
                outstanding: Default::default(),
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
            JobLimits { max_lines: 10, max_bytes: 1 << 20 }
        }
        fn line(&self, key: &str, _: &ModelRequest) -> Result<Vec<u8>, ModelError> {
            Ok(format!("{key}\n").into_bytes())
        }
        async fn submit(&self, name: &str, body: Vec<u8>, _: usize) -> Result<JobRef, ModelError> {
            if self.refuses {
                return Err(ModelError::new(ErrorKind::Auth, "API key not valid"));
            }
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
        async fn find(&self, name: &str) -> Result<Option<JobRef>, ModelError> {
            Ok(self.jobs.lock().unwrap().contains_key(name).then(|| JobRef { id: name.to_string(), file: None }))
        }
        async fn status(&self, job: &JobRef) -> Result<JobStatus, ModelError> {
            let n = self.jobs.lock().unwrap()[&job.id].len() as u64;
            Ok(JobStatus {
                state: JobState::Succeeded,
                total: n,
                completed: n,
                failed: 0,
                message: None,
                described: None,
            })
        }
        async fn results(&self, job: &JobRef, _: &JobStatus) -> Result<Vec<JobResult>, ModelError> {
            self.outstanding.lock().unwrap().0 -= 1;
            let keys = self.jobs.lock().unwrap()[&job.id].clone();
            Ok(keys
                .into_iter()
                .map(|k| {
                    let r = ModelResponse {
                        text: k.clone(),
                        embedding: None,
                        finish_reason: "stop".into(),
                        usage: Default::default(),
                        model_version: None,
                        limits: None,
                    };
                    (k, Ok(r))
                })
                .collect())
        }
        async fn cancel(&self, _: &JobRef) -> Result<(), ModelError> {
            Ok(())
        }
    }

    fn items(n: usize) -> Vec<Item> {
        (0..n)
            .map(|i| Item {
                key: format!("k{i:03}"),
                request: ModelRequest { prompt: String::new(), system: None, params: Default::default() },
            })
            .collect()
    }

    /// Issue #33: a pool's chunks go to the endpoint with the fewest records waiting for its
    /// weight, each recorded with its endpoint; an endpoint that rejects the key gets no more
    /// jobs and its chunk goes to another; every record settles once.
    #[tokio::test(start_paused = true)]
    async fn a_pool_spreads_chunks_by_weight_and_moves_a_refused_chunk_elsewhere() {
        let dir = std::env::temp_dir().join(format!("weir-jobs-pool-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (a, b, dead) = (Instant::new(false), Instant::new(false), Instant::new(true));
        let site = |name: &str, api: &Arc<Instant>, weight: f64| Site {
            name: name.into(),
            label: name.into(),
            api: api.clone() as Arc<dyn JobApi>,
            weight,
        };
        let sites = Sites::pool(vec![site("dead", &dead, 1.0), site("a", &a, 2.0), site("b", &b, 1.0)]);
        let mut ledger = Ledger::open(&dir.join("jobs.jsonl"), true).unwrap();
        let settings = JobSettings { poll_first: Duration::from_millis(10), ..JobSettings::default() };
        let mut seen = Vec::new();
        let finished =
            run(&sites, &mut ledger, items(120), &settings, &CancellationToken::new(), &mut |_| {}, &mut |item, r| {
                seen.push((item.key, r.unwrap().text))
            })
            .await
            .unwrap();
        assert!(finished.leftovers.is_empty());
        // What the summary says per endpoint: jobs submitted, and why one refused them.
        let dead_line = &finished.sites[0];
        assert_eq!((dead_line.0.as_str(), dead_line.1), ("dead", 0));
        assert!(dead_line.2.as_deref().is_some_and(|w| w.contains("API key not valid")));
        assert_eq!((finished.sites[1].1, finished.sites[2].1), (8, 4));
        seen.sort();
        assert_eq!(seen.len(), 120);
        assert!(seen.iter().all(|(k, t)| k == t));
        seen.dedup();
        assert_eq!(seen.len(), 120, "a record settled twice");
        // Twelve jobs of ten: none at the dead endpoint, the rest two to one by weight.
        assert_eq!((dead.submitted(), a.submitted(), b.submitted()), (0, 8, 4));
        let by_site = |name: &str| ledger.chunks().filter(|c| c.site == name && c.job.is_some()).count();
        assert_eq!((by_site("dead"), by_site("a"), by_site("b")), (0, 8, 4));
        // The chunk the dead endpoint refused is in the ledger without a job, and none of its
        // keys point at it any more.
        let refused: Vec<_> = ledger.chunks().filter(|c| c.site == "dead").collect();
        assert_eq!(refused.len(), 1);
        assert!(refused[0].refused.as_deref().is_some_and(|r| r.contains("API key not valid")));
        assert!(refused[0].keys.iter().all(|k| ledger.latest_chunk(k).unwrap().site != "dead"));
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
            let dir = std::env::temp_dir().join(format!("weir-jobs-lost-{}-{pool}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
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
            let mut ledger = Ledger::open(&dir.join("jobs.jsonl"), true).unwrap();
            let settings = JobSettings { poll_first: Duration::from_millis(10), ..JobSettings::default() };
            let mut n = 0;
            let finished =
                run(&sites, &mut ledger, items(30), &settings, &CancellationToken::new(), &mut |_| {}, &mut |_, r| {
                    r.unwrap();
                    n += 1
                })
                .await
                .unwrap();
            assert_eq!((n, finished.submitted), (30, 3), "pool: {pool}");
            let made = a.made.load(Relaxed) + b.made.load(Relaxed);
            assert_eq!(made, 3, "pool: {pool}: a job made twice for one chunk");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Issue #34: with `max_jobs`, no endpoint has more jobs than that at once; the records
    /// beyond wait here (reported as queued) and go out as jobs end; every one settles once.
    #[tokio::test(start_paused = true)]
    async fn no_endpoint_has_more_than_max_jobs_and_the_rest_wait_queued() {
        let dir = std::env::temp_dir().join(format!("weir-jobs-cap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (a, b) = (Instant::new(false), Instant::new(false));
        let sites = Sites::pool(vec![
            Site { name: "a".into(), label: "a".into(), api: a.clone(), weight: 1.0 },
            Site { name: "b".into(), label: "b".into(), api: b.clone(), weight: 1.0 },
        ]);
        let mut ledger = Ledger::open(&dir.join("jobs.jsonl"), true).unwrap();
        let settings =
            JobSettings { poll_first: Duration::from_millis(10), max_jobs: Some(2), ..JobSettings::default() };
        let (mut n, mut most_queued) = (0, 0);
        let finished = run(
            &sites,
            &mut ledger,
            items(200),
            &settings,
            &CancellationToken::new(),
            &mut |p| most_queued = most_queued.max(p.queued),
            &mut |_, r| {
                r.unwrap();
                n += 1
            },
        )
        .await
        .unwrap();
        assert_eq!((n, finished.leftovers.len(), finished.submitted), (200, 0, 20));
        assert_eq!((a.peak(), b.peak()), (2, 2), "at most two jobs at each endpoint at once");
        assert_eq!(most_queued, 160, "four jobs of ten out, the other 160 records queued");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Found by an outside tester: a run killed after an endpoint refused a chunk but before
    /// its records were planned elsewhere could not be resumed (the chunk was looked up at the
    /// refusing endpoint, or its endpoint was missing from the pool). The refusal is in the
    /// ledger: a resumed run plans those records again, without asking that endpoint.
    #[tokio::test(start_paused = true)]
    async fn a_chunk_its_endpoint_refused_is_planned_again_on_resume_without_that_endpoint() {
        let dir = std::env::temp_dir().join(format!("weir-jobs-refused-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("jobs.jsonl");
        {
            let mut l = Ledger::open(&path, true).unwrap();
            let keys: Vec<String> = items(15).into_iter().map(|i| i.key).collect();
            let c = l.plan(0, "run-c0".into(), "gone", keys).unwrap();
            l.refused(c.number, "connection refused").unwrap();
        }
        assert!(open_chunks(&Ledger::read(&path).unwrap()).is_empty(), "a refused chunk holds no records");
        let a = Instant::new(false);
        let sites = Sites::pool(vec![
            Site { name: "a".into(), label: "a".into(), api: a.clone(), weight: 1.0 },
            Site { name: "b".into(), label: "b".into(), api: Instant::new(false), weight: 1.0 },
        ]);
        let mut ledger = Ledger::open(&path, false).unwrap();
        let settings = JobSettings { poll_first: Duration::from_millis(10), ..JobSettings::default() };
        let mut n = 0;
        let finished =
            run(&sites, &mut ledger, items(15), &settings, &CancellationToken::new(), &mut |_| {}, &mut |_, r| {
                r.unwrap();
                n += 1
            })
            .await
            .unwrap();
        assert_eq!((n, finished.leftovers.len(), finished.reattached), (15, 0, 0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn chunks_keep_to_both_limits_and_take_every_pending_key_once() {
        let keys = ["a", "b", "c", "d", "eeeeeeeeeeeeeeee", "f", "ggg", "hhh", "iii", "gone"];
        let mut pending: HashMap<String, Item> = keys
            .iter()
            .map(|k| {
                (
                    k.to_string(),
                    Item {
                        key: k.to_string(),
                        request: ModelRequest { prompt: String::new(), system: None, params: Default::default() },
                    },
                )
            })
            .collect();
        pending.remove("gone");
        let mut chunker = Chunker::new(keys.iter().rev().map(|k| k.to_string()).collect());
        let mut chunks = Vec::new();
        while let Some(c) = chunker.next(&Small, &pending).unwrap() {
            chunks.push(c.into_iter().map(|(k, _)| k).collect::<Vec<_>>().join(","));
        }
        // Three lines at most, twelve bytes at most unless one line alone is longer; in key
        // order; the key no longer pending left out.
        assert_eq!(chunks, ["a,b,c", "d", "eeeeeeeeeeeeeeee", "f,ggg,hhh", "iii"]);
    }
}
