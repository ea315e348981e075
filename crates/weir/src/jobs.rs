//! `weir run --mode batch`: the same records, outputs, journal and cache as an online run, but
//! answered by the provider's batch-prediction jobs (about half the price, hours of latency).
//!
//! The input is read while the jobs run (records the cache can answer are answered at once):
//! [`weir_jobs::run`] spools the records to the state directory, cuts and submits jobs as the
//! spools fill, records, waits and collects; each settled record becomes the same outcome an
//! online call would give, written by the same writer. What no job answered goes online with
//! `--fallback online`, or is written as an error row. Memory holds the chunk being cut and
//! the job being collected, not the input.

use futures::stream::BoxStream;
use futures::StreamExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use weir_core::{Driver, ErrorKind, ModelError, Outcome, Record, StopReason};
use weir_jobs::{BatchError, Incoming, Item, Ledger};

use crate::report::thousands;
use weir_runtime::Work;

/// How a batch run goes.
#[derive(Debug, Clone)]
pub struct JobsMode {
    /// Records no job answered are sent online instead of written as errors.
    pub fallback_online: bool,
    /// Rounds, polling, names.
    pub jobs: weir_jobs::JobSettings,
    /// Requests per job at most (the provider's limit when `None`).
    pub max_requests: Option<usize>,
    /// Where a Vertex AI model's jobs are staged (`gs://BUCKET/PREFIX`).
    pub job_bucket: Option<String>,
    /// `--mode auto`: jobs only for an input of at least this many records (counted before the
    /// run), of a provider that has them; online otherwise.
    pub auto_min_records: Option<u64>,
}

pub use crate::report::JobsTally;

/// The key a record's request carries through a job: its id when that is short and plain, else
/// `~` and a digest of it (`~` is not in the plain alphabet, so the two never meet).
/// A number id is `#` and its digits (the text id "7" and the number 7 are two records).
pub fn job_key(record: &Record) -> String {
    let id = record.id.as_str();
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
    if !id.is_empty() && id.len() <= 64 && id.chars().all(plain) {
        return match record.id {
            weir_core::RecordId::Number(_) => format!("#{id}"),
            weir_core::RecordId::Text(_) => id.to_string(),
        };
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(record.id.key_bytes());
    format!("~{}", hex::encode(&digest[..16]))
}

/// What a resumed run knows is finished, to leave spooled records alone that have their rows.
#[derive(Clone, Default)]
pub(crate) struct Finished {
    /// Records finished, by id and line.
    pub finished: Arc<weir_io::KeySet>,
}

/// Everything the jobs need besides the records.
pub(crate) struct JobsRun {
    pub driver: Arc<Driver>,
    pub sites: Arc<weir_jobs::Sites>,
    pub ledger: PathBuf,
    pub fresh: bool,
    pub mode: JobsMode,
    pub interrupts: watch::Receiver<u32>,
    pub progress: bool,
    pub max_concurrency: usize,
    pub tally: Arc<Mutex<JobsTally>>,
    pub finished: Finished,
    /// The run's page and report, told where the jobs stand.
    pub watch: Option<Arc<weir_runtime::dash::Watch>>,
}

/// The outcomes of `work`'s records, answered by batch jobs.
pub(crate) fn outcomes(
    work: impl futures::Stream<Item = Work> + Send + 'static,
    run: JobsRun,
) -> BoxStream<'static, Result<Outcome, std::io::Error>> {
    // Bounded: a job's answers wait for the rows' writer rather than pile up in memory.
    let (tx, mut rx) = mpsc::channel(1024);
    tokio::spawn(drive(work, run, tx));
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

type Tx = mpsc::Sender<Result<Outcome, std::io::Error>>;

/// A record as a spool keeps it: everything its row and its request are made of.
#[derive(serde::Serialize, serde::Deserialize)]
struct Spooled {
    /// `s` for a text id, `n` for a number (kept as written).
    t: char,
    id: String,
    line: u64,
    prompt: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    system: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    params: Option<weir_core::GenParams>,
    input: serde_json::Map<String, serde_json::Value>,
    /// The fields holding its media, in order, as `--media-field` gave them (`FIELD` or
    /// `FIELD:TYPE`); what they hold is in `input`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    media: Vec<String>,
    /// What each of those fields named, whole, where `input` (as rows echo it) shows a URL
    /// without its query or password: the job is built from it after a restart too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    sources: Vec<Option<String>>,
    /// The digests of its media parts as read for its job (hex): they key its answer in the
    /// cache, and a follow-up job whose media changed since is caught by them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    digests: Vec<String>,
}

fn to_spool(record: &Record) -> weir_jobs::Record {
    let (t, id) = match &record.id {
        weir_core::RecordId::Text(s) => ('s', s.clone()),
        weir_core::RecordId::Number(s) => ('n', s.clone()),
    };
    let spooled = Spooled {
        t,
        id,
        line: record.line,
        prompt: record.prompt.clone(),
        system: record.system.as_deref().map(str::to_string),
        params: record.params.as_deref().cloned(),
        input: record.input.clone(),
        media: record
            .media
            .iter()
            .map(|m| match &m.mime {
                Some(mime) => format!("{}:{mime}", m.field),
                None => m.field.clone(),
            })
            .collect(),
        sources: record
            .media
            .iter()
            .map(|m| match &m.source {
                weir_core::media::MediaSource::Named(name)
                    if record.input.get(&m.field).and_then(|v| v.as_str()) != Some(name.as_str()) =>
                {
                    Some(name.clone())
                }
                _ => None,
            })
            .collect(),
        digests: record.media_digests.iter().map(hex::encode).collect(),
    };
    serde_json::value::to_raw_value(&spooled).expect("a record is JSON")
}

fn from_spool(value: &weir_jobs::Record) -> Result<Record, ModelError> {
    let s: Spooled = serde_json::from_str(value.get())
        .map_err(|e| ModelError::new(ErrorKind::Server, format!("a batch job spool's record cannot be read: {e}")))?;
    let id = match s.t {
        'n' => weir_core::RecordId::Number(s.id),
        _ => weir_core::RecordId::Text(s.id),
    };
    let unreadable = |what: &str| ModelError::new(ErrorKind::Server, format!("a batch job spool's record: {what}"));
    let mut media = Vec::with_capacity(s.media.len());
    for (i, spec) in s.media.iter().enumerate() {
        let (field, mime) = weir_core::media::field_spec(spec).map_err(|e| unreadable(&e))?;
        let source = match s.sources.get(i) {
            Some(Some(whole)) => Some(weir_core::media::MediaSource::Named(whole.clone())),
            _ => weir_core::media::source_of(s.input.get(&field)).map_err(unreadable)?,
        };
        if let Some(source) = source {
            media.push(weir_core::media::MediaRef { field, source, mime });
        }
    }
    let mut record = Record::new(id, s.line, s.prompt, s.input);
    record.system = s.system.map(Arc::from);
    record.params = s.params.map(Box::new);
    record.media = media;
    for d in &s.digests {
        let mut digest = [0u8; 32];
        hex::decode_to_slice(d, &mut digest).map_err(|_| unreadable("a bad media digest"))?;
        record.media_digests.push(digest);
    }
    Ok(record)
}

/// The run's side of the jobs: rows, the cache, the summary's tally and the progress line.
struct Rows {
    driver: Arc<Driver>,
    tx: Tx,
    since: Instant,
    tally: Arc<Mutex<JobsTally>>,
    finished: Finished,
    /// Records no job answered, to be sent online (`--fallback online`).
    fallback: Option<mpsc::UnboundedSender<Record>>,
    progress: bool,
    last: (String, Instant),
    watch: Option<Arc<weir_runtime::dash::Watch>>,
}

impl Rows {
    fn tally(&self) -> std::sync::MutexGuard<'_, JobsTally> {
        self.tally.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait::async_trait]
impl weir_jobs::Host for Rows {
    fn finished(&self, record: &weir_jobs::Record) -> bool {
        if self.finished.finished.is_empty() {
            return false;
        }
        #[derive(serde::Deserialize)]
        struct Which {
            t: char,
            id: String,
            line: u64,
        }
        let Ok(w) = serde_json::from_str::<Which>(record.get()) else { return false };
        let id = match w.t {
            'n' => weir_core::RecordId::Number(w.id),
            _ => weir_core::RecordId::Text(w.id),
        };
        self.finished.finished.contains(&weir_io::state::finished_key(Some(&id), w.line))
    }

    fn check(&self, record: &weir_jobs::Record, response: &weir_core::ModelResponse) -> Option<ModelError> {
        let record = from_spool(record).ok()?;
        self.driver.check_answer(&record, response)
    }

    async fn answer_again(&mut self, record: &weir_jobs::Record) -> bool {
        let Ok(record) = from_spool(record) else { return false };
        match self.driver.answer_from_cache(&record) {
            Some(outcome) => {
                let _ = self.tx.send(Ok(outcome)).await;
                true
            }
            None => false,
        }
    }

    async fn rebuild(
        &mut self,
        key: String,
        value: weir_jobs::Record,
    ) -> Result<Item, (weir_jobs::Record, ModelError)> {
        let mut record = match from_spool(&value) {
            Ok(record) => record,
            Err(e) => return Err((value, e)),
        };
        if record.media.is_empty() {
            return Ok(Item { key, line: record.line, request: self.driver.request_for(&record), record: value });
        }
        // Its media read again for the follow-up job: what it holds now is what is sent and
        // what keys the answer.
        match self.driver.request_with_media(&mut record).await {
            Ok(request) => Ok(Item { key, line: record.line, request, record: to_spool(&record) }),
            Err(e) => Err((value, e)),
        }
    }

    async fn deliver(&mut self, value: weir_jobs::Record, result: Result<weir_core::ModelResponse, ModelError>) {
        let record = match from_spool(&value) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("{e}");
                return;
            }
        };
        {
            let mut t = self.tally();
            t.settled += 1;
            if let Ok(r) = &result {
                t.tokens.0 += r.usage.prompt_tokens;
                t.tokens.1 += r.usage.output_tokens;
            }
        }
        let outcome = self.driver.settle_answer(record, result, self.since);
        let _ = self.tx.send(Ok(outcome)).await;
    }

    async fn leftover(&mut self, value: weir_jobs::Record, error: ModelError) {
        let Some(fallback) = &self.fallback else { return self.deliver(value, Err(error)).await };
        let record = match from_spool(&value) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("{e}");
                return;
            }
        };
        let first = {
            let mut t = self.tally();
            t.online += 1;
            t.online == 1
        };
        if first && self.progress {
            eprintln!("weir: records the batch jobs left unanswered are sent online (--fallback online)");
        }
        let _ = fallback.send(record);
    }

    fn progress(&mut self, p: &weir_jobs::Progress) {
        if let Some(w) = &self.watch {
            w.set_jobs(weir_runtime::dash::JobsView {
                states: p.jobs.iter().map(|(s, n)| (s.to_string(), u64::from(*n))).collect(),
                answered: p.completed,
                total: p.total,
                settled: p.settled,
            });
        }
        if !self.progress || p.jobs.is_empty() {
            return;
        }
        let states: Vec<String> = p.jobs.iter().map(|(s, n)| format!("{n} {s}")).collect();
        let line = format!(
            "weir: batch jobs: {}; {} of {} requests answered so far{}; {} records settled{}",
            states.join(", "),
            thousands(p.completed),
            thousands(p.total),
            if p.failed > 0 { format!(", {} failed", thousands(p.failed)) } else { String::new() },
            thousands(p.settled),
            if p.queued > 0 { format!("; {} queued for a job", thousands(p.queued)) } else { String::new() }
        );
        if line != self.last.0 && self.last.1.elapsed() >= Duration::from_secs(2) {
            eprintln!("{line}");
            self.last = (line, Instant::now());
        }
    }
}

/// Records whose media is read ahead of the one going into a job (their parts held meanwhile:
/// at most this many records' inline media, 15 MB each at most).
const MEDIA_READS_AHEAD: usize = 8;

/// How many of a new run's first records may be refused online (each for what it holds, a
/// 400) before the run stops as misconfigured without submitting a job.
const PROBES: u32 = 3;

/// Reads the input for the jobs: error rows and cache answers written at once, records a
/// spool holds from an earlier run left to it, the rest handed to the jobs in input order. A
/// new run's first record goes online first (see `drive`); false when that stopped the run.
async fn feed(
    work: impl futures::Stream<Item = Work> + Send + 'static,
    driver: Arc<Driver>,
    tx: Tx,
    claims: weir_jobs::Claims,
    probe: bool,
    tally: Arc<Mutex<JobsTally>>,
    jobs: mpsc::Sender<Incoming>,
) {
    // Media is read for several records at once, in input order: a slow or dead URL holds
    // only its own record's read (its tries), not every record behind it.
    let claims = Arc::new(claims);
    let mut probes_left = if probe { PROBES } else { 0 };
    let reading = {
        let (driver, claims) = (driver.clone(), claims.clone());
        move |w: Work| {
            let (driver, claims) = (driver.clone(), claims.clone());
            async move {
                match w {
                    Work::Call(mut record) if !record.media.is_empty() && !claims.holds(record.line) => {
                        let read = driver.request_with_media(&mut record).await;
                        (Work::Call(record), Some(read))
                    }
                    other => (other, None),
                }
            }
        }
    };
    let work = work.map(reading).buffered(MEDIA_READS_AHEAD);
    futures::pin_mut!(work);
    while let Some((w, read)) = work.next().await {
        let record = match w {
            Work::Done(f) => {
                let _ = tx.send(Ok(driver.reject(f))).await;
                continue;
            }
            Work::ReadError(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
            Work::Call(record) => record,
        };
        // Its chunk's spool has it (and writes its row).
        if claims.holds(record.line) {
            continue;
        }
        // Media was read (above) before the cache is asked (the answer is keyed on the parts'
        // bytes) and goes into the job's input; media that cannot be read is the record's
        // error row.
        let request = match read {
            None => None,
            Some(Ok(r)) => Some(r),
            Some(Err(error)) => {
                let _ = tx.send(Ok(driver.reject(Box::new(weir_core::Failure::of(record, error, 0))))).await;
                continue;
            }
        };
        let key = job_key(&record);
        let answered =
            |record: &Record| Incoming::Answered { key: key.clone(), line: record.line, record: to_spool(record) };
        let next = match driver.answer_from_cache(&record) {
            Some(outcome) => {
                let _ = tx.send(Ok(outcome)).await;
                answered(&record)
            }
            // A new run sends its first record online before any job: a job is checked by the
            // provider hours later, and a request it refuses (an unknown model, a bad
            // parameter, a rejected key) would fail every record then. Its answer is that
            // record's, so nothing is paid twice.
            // A request refused for what the record holds (a prompt too long, a bad image)
            // says nothing of the others: up to PROBES records are tried so, and only their
            // refusal together (or a rejected key at once) stops the run.
            None if probes_left > 0 => {
                let outcome = driver.run(record.clone()).await;
                let refused = match &outcome {
                    Outcome::Failure(f)
                        if matches!(f.error.kind, ErrorKind::BadRequest | ErrorKind::Auth | ErrorKind::Endpoint) =>
                    {
                        Some((f.error.kind, f.error.message.clone()))
                    }
                    _ => None,
                };
                // A rejected key, or a model or route not there, is every record's.
                let everyones = |kind| matches!(kind, ErrorKind::Auth | ErrorKind::Endpoint);
                match refused {
                    Some((kind, message)) if everyones(kind) || probes_left == 1 => {
                        let first = if everyones(kind) {
                            "first request".to_string()
                        } else {
                            format!("first {PROBES} requests")
                        };
                        let message =
                            format!("the endpoint refused the {first} online, so no job was submitted: {message}");
                        driver.stop(StopReason { kind, message });
                        let _ = tx.send(Ok(outcome)).await;
                        return;
                    }
                    // Nothing can be reached, or the driver stopped the run for another reason.
                    _ if driver.is_stopped() => {
                        let _ = tx.send(Ok(outcome)).await;
                        return;
                    }
                    refused => {
                        probes_left = if refused.is_some() { probes_left - 1 } else { 0 };
                        tally.lock().unwrap_or_else(|e| e.into_inner()).online += 1;
                        let _ = tx.send(Ok(outcome)).await;
                        answered(&record)
                    }
                }
            }
            None => {
                let request = request.unwrap_or_else(|| driver.request_for(&record));
                Incoming::Job(Item { key, line: record.line, request, record: to_spool(&record) })
            }
        };
        if jobs.send(next).await.is_err() {
            return;
        }
    }
}

async fn drive(work: impl futures::Stream<Item = Work> + Send + 'static, run: JobsRun, tx: Tx) {
    let JobsRun { driver, sites, ledger, fresh, mode, interrupts, progress, max_concurrency, tally, finished, watch } =
        run;
    let cancel = CancellationToken::new();
    {
        let (cancel, mut interrupts) = (cancel.clone(), interrupts);
        tokio::spawn(async move {
            if interrupts.wait_for(|n| *n >= 1).await.is_ok() {
                cancel.cancel();
            }
        });
    }
    let stop = |kind: ErrorKind, message: String| driver.stop(StopReason { kind, message });
    let mut ledger = match Ledger::open(&ledger, fresh) {
        Ok(l) => l,
        Err(e) => return stop(ErrorKind::Server, e.to_string()),
    };
    let mut spool = match weir_jobs::Spool::open(&ledger) {
        Ok(s) => s,
        Err(e) => return stop(ErrorKind::Server, e.to_string()),
    };
    // The input is read while the jobs run: a chunk is submitted as soon as it is cut.
    let (jobs_tx, mut jobs_rx) = mpsc::channel(1024);
    let probe = ledger.chunks().next().is_none();
    let feeder = tokio::spawn(feed(
        work,
        driver.clone(),
        tx.clone(),
        weir_jobs::Claims::of(&ledger),
        probe,
        tally.clone(),
        jobs_tx,
    ));
    // Records no job answered, online (`--fallback online`), as they are found.
    let (fallback, online) = if mode.fallback_online {
        let (ftx, mut frx) = mpsc::unbounded_channel::<Record>();
        let (d, tx) = (driver.clone(), tx.clone());
        let task = tokio::spawn(async move {
            let left = futures::stream::poll_fn(move |cx| frx.poll_recv(cx));
            let mut online = left
                .map(|r| {
                    let d = d.clone();
                    async move { d.run(r).await }
                })
                .buffer_unordered(max_concurrency.max(1));
            while let Some(o) = online.next().await {
                let _ = tx.send(Ok(o)).await;
            }
        });
        (Some(ftx), Some(task))
    } else {
        (None, None)
    };
    let first_new = ledger.next_number();
    let mut rows = Rows {
        driver: driver.clone(),
        tx: tx.clone(),
        since: Instant::now(),
        tally: tally.clone(),
        finished,
        fallback,
        progress,
        last: (String::new(), Instant::now() - Duration::from_secs(3600)),
        watch,
    };
    let result = weir_jobs::run(&sites, &mut ledger, &mut spool, &mut jobs_rx, &mode.jobs, &cancel, &mut rows).await;
    // The reader stops when the jobs do.
    drop(jobs_rx);
    let _ = feeder.await;
    drop(rows);
    if let Some(task) = online {
        let _ = task.await;
    }
    let result = result.map(|f| {
        let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
        t.jobs = f.submitted + f.reattached;
        t.submitted_now = f.submitted;
        t.sites = f.sites;
    });
    // A run that stops with jobs submitted: they go on at the provider, charged. The summary
    // counts them and a notice says what to do, however the run stopped.
    let jobs_left = |why: &str| {
        let running = ledger.chunks().filter(|c| c.job.is_some()).count() as u64;
        let now = ledger.chunks().filter(|c| c.job.is_some() && c.number >= first_new).count() as u64;
        {
            let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
            t.jobs = running;
            t.submitted_now = now;
        }
        if running > 0 {
            eprintln!(
                "weir: {why}; the batch jobs go on at the provider (and are charged): run the same command again to \
                 collect them, or `weir batch cancel` them"
            );
        }
    };
    match result {
        Ok(()) => {}
        Err(BatchError::Cancelled) => {
            jobs_left("interrupted");
            stop(ErrorKind::Aborted, "interrupted".into())
        }
        // The first record went online, so the model is there: a 404 now is a job route the
        // endpoint lacks (vLLM's and llama.cpp's OpenAI-compatible servers have none).
        Err(BatchError::Api(e)) if matches!(e.status, Some(404 | 405)) => stop(
            e.kind,
            format!(
                "batch jobs: this endpoint has no batch-job API, it seems ({}); run online (drop --mode batch), \
                 or use --mode auto, which runs online where there are no jobs",
                e.message
            ),
        ),
        Err(BatchError::Api(e)) => {
            // A job refused for its size fails the same way when run again: say which flag
            // makes jobs smaller.
            let m = e.message.to_ascii_lowercase();
            let hint = if e.status == Some(413)
                || ["too large", "too big", "exceeds", "too many requests in", "maximum number of requests"]
                    .iter()
                    .any(|w| m.contains(w))
            {
                " (make jobs smaller with --job-max-requests, then run the same command again)"
            } else {
                ""
            };
            jobs_left("stopped");
            stop(e.kind, format!("batch jobs: {}{hint}", e.message))
        }
        Err(e @ BatchError::Site(_)) => stop(ErrorKind::BadRequest, e.to_string()),
        Err(e @ (BatchError::Ledger(_) | BatchError::Spool(_))) => {
            jobs_left("stopped");
            stop(ErrorKind::Server, e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_core::RecordId;

    #[test]
    fn keys_are_plain_ids_or_digests() {
        let rec = |id: &str| {
            Record::new(RecordId::from_value(&serde_json::json!(id)).unwrap(), 1, "p".into(), Default::default())
        };
        assert_eq!(job_key(&rec("r-17")), "r-17");
        let long = "x".repeat(65);
        assert!(job_key(&rec(&long)).starts_with('~'));
        assert_ne!(job_key(&rec("a b")), job_key(&rec("a  b")));
        assert!(job_key(&rec("a b")).starts_with('~'));
        let seven =
            Record::new(RecordId::from_value(&serde_json::json!(7)).unwrap(), 1, "p".into(), Default::default());
        assert_ne!(job_key(&seven), job_key(&rec("7")));
    }

    /// A spooled record's media comes back whole (a job built after a restart reads it),
    /// while the input its rows echo keeps the URL shown without its signature.
    #[test]
    fn a_spooled_record_keeps_its_media_source_whole() {
        let mut spec = weir_core::RecordSpec::new(None, weir_core::PromptSource::Field("prompt".into()));
        spec.media_fields = vec![("image".into(), None), ("scan".into(), Some("application/pdf".into()))];
        let line = br#"{"prompt":"p","image":"https://h/a.png?X-Amz-Signature=SECRET","scan":"s.pdf"}"#;
        let record = spec.parse(1, line).unwrap();
        let back = from_spool(&to_spool(&record)).unwrap();
        assert_eq!(back.media, record.media);
        assert_eq!(back.input["image"], "https://h/a.png");
    }
}
