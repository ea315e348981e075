//! `weir run --mode batch`: the same records, outputs, journal and cache as an online run, but
//! answered by the provider's batch-prediction jobs (about half the price, hours of latency).
//!
//! The input is read whole first (records the cache can answer are answered at once), then
//! [`weir_jobs::run`] splits, submits, records, waits and collects; each settled record
//! becomes the same outcome an online call would give, written by the same writer. What no
//! job answered goes online with `--fallback online`, or is written as an error row.

use futures::stream::BoxStream;
use futures::StreamExt;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use weir_core::{Driver, ErrorKind, Failure, ModelError, Outcome, Record, StopReason};
use weir_jobs::{BatchError, Item, Ledger};

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
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("~{hex}")
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
}

/// The outcomes of `work`'s records, answered by batch jobs.
pub(crate) fn outcomes(
    work: impl futures::Stream<Item = Work> + Send + 'static,
    run: JobsRun,
) -> BoxStream<'static, Result<Outcome, std::io::Error>> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(drive(work, run, tx));
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

type Tx = mpsc::UnboundedSender<Result<Outcome, std::io::Error>>;

async fn drive(work: impl futures::Stream<Item = Work> + Send + 'static, run: JobsRun, tx: Tx) {
    let JobsRun { driver, sites, ledger, fresh, mode, interrupts, progress, max_concurrency, tally } = run;
    let cancel = CancellationToken::new();
    {
        let (cancel, mut interrupts) = (cancel.clone(), interrupts);
        tokio::spawn(async move {
            if interrupts.wait_for(|n| *n >= 1).await.is_ok() {
                cancel.cancel();
            }
        });
    }
    // The whole input first: jobs are cut from all of it.
    let mut records: HashMap<String, Record> = HashMap::new();
    let mut items = Vec::new();
    futures::pin_mut!(work);
    while let Some(w) = work.next().await {
        match w {
            Work::Done(f) => {
                let _ = tx.send(Ok(driver.reject(f)));
            }
            Work::ReadError(e) => {
                let _ = tx.send(Err(e));
                return;
            }
            Work::Call(record) => match driver.answer_from_cache(&record) {
                Some(outcome) => {
                    let _ = tx.send(Ok(outcome));
                }
                None => {
                    let key = job_key(&record);
                    items.push(Item { key: key.clone(), request: driver.request_for(&record) });
                    records.insert(key, record);
                }
            },
        }
    }
    if items.is_empty() {
        return;
    }
    let stop = |records: &mut HashMap<String, Record>, kind: ErrorKind, message: String| {
        driver.stop(StopReason { kind, message: message.clone() });
        for (_, record) in records.drain() {
            let e = ModelError::new(ErrorKind::Aborted, format!("not finished: {message}"));
            let _ = tx.send(Ok(Outcome::Failure(Box::new(Failure::of(record, e, 0)))));
        }
    };
    let mut ledger = match Ledger::open(&ledger, fresh) {
        Ok(l) => l,
        Err(e) => return stop(&mut records, ErrorKind::Server, e.to_string()),
    };
    // A new run sends its first record online before any job: a job is checked by the provider
    // hours later, and a request it refuses (an unknown model, a bad parameter, a rejected key)
    // would fail every record then. Its answer is that record's, so nothing is paid twice.
    if ledger.chunks().next().is_none() {
        if let Some(first) = items.first().cloned() {
            let record = records.remove(&first.key).expect("every item has its record");
            match driver.run(record).await {
                Outcome::Failure(f) if matches!(f.error.kind, ErrorKind::BadRequest | ErrorKind::Auth) => {
                    let message = format!(
                        "the endpoint refused the first request online, so no job was submitted: {}",
                        f.error.message
                    );
                    driver.stop(StopReason { kind: f.error.kind, message: message.clone() });
                    let _ = tx.send(Ok(Outcome::Failure(f)));
                    return stop(&mut records, ErrorKind::Aborted, message);
                }
                // Nothing can be reached, or the driver stopped the run for another reason.
                outcome if driver.is_stopped() => {
                    let reason = driver.stop_reason();
                    let kind = reason.as_ref().map_or(ErrorKind::Aborted, |r| r.kind);
                    let message = reason.map(|r| r.message).unwrap_or_default();
                    let _ = tx.send(Ok(outcome));
                    return stop(&mut records, kind, format!("no job was submitted: {message}"));
                }
                outcome => {
                    items.remove(0);
                    tally.lock().unwrap_or_else(|e| e.into_inner()).online += 1;
                    let _ = tx.send(Ok(outcome));
                }
            }
        }
    }
    let since = Instant::now();
    let first_new = ledger.next_number();
    let result = {
        let mut last = (String::new(), Instant::now() - Duration::from_secs(3600));
        let mut on_progress = |p: &weir_jobs::Progress| {
            if !progress || p.jobs.is_empty() {
                return;
            }
            let states: Vec<String> = p.jobs.iter().map(|(s, n)| format!("{n} {s}")).collect();
            let line = format!(
                "weir: batch jobs: {}; {} of {} requests answered so far; {} records settled{}",
                if states.is_empty() { "none waiting".to_string() } else { states.join(", ") },
                thousands(p.completed),
                thousands(p.total),
                thousands(p.settled),
                if p.queued > 0 {
                    format!("; {} queued for a job (--max-jobs)", thousands(p.queued))
                } else {
                    String::new()
                }
            );
            if line != last.0 && last.1.elapsed() >= Duration::from_secs(2) {
                eprintln!("{line}");
                last = (line, Instant::now());
            }
        };
        let mut deliver = |item: Item, result: Result<weir_core::ModelResponse, ModelError>| {
            if let Some(record) = records.remove(&item.key) {
                let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
                t.settled += 1;
                if let Ok(r) = &result {
                    t.tokens.0 += r.usage.prompt_tokens;
                    t.tokens.1 += r.usage.output_tokens;
                }
                drop(t);
                let _ = tx.send(Ok(driver.settle_answer(record, result, since)));
            }
        };
        weir_jobs::run(&sites, &mut ledger, items, &mode.jobs, &cancel, &mut on_progress, &mut deliver).await
    };
    let result = result.map(|f| {
        let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
        t.jobs = f.submitted + f.reattached;
        t.submitted_now = f.submitted;
        t.sites = f.sites;
        f.leftovers
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
        Ok(leftovers) if mode.fallback_online && !leftovers.is_empty() => {
            if progress {
                eprintln!(
                    "weir: {} records had no answer from the batch jobs; sending them online (--fallback online)",
                    thousands(leftovers.len() as u64)
                );
            }
            let left: Vec<Record> = leftovers.into_iter().filter_map(|(item, _)| records.remove(&item.key)).collect();
            tally.lock().unwrap_or_else(|e| e.into_inner()).online += left.len() as u64;
            let mut online = futures::stream::iter(left)
                .map(|r| {
                    let d = driver.clone();
                    async move { d.run(r).await }
                })
                .buffer_unordered(max_concurrency.max(1));
            while let Some(o) = online.next().await {
                let _ = tx.send(Ok(o));
            }
        }
        Ok(leftovers) => {
            for (item, e) in leftovers {
                if let Some(record) = records.remove(&item.key) {
                    let _ = tx.send(Ok(driver.settle_answer(record, Err(e), since)));
                }
            }
        }
        Err(BatchError::Cancelled) => {
            jobs_left("interrupted");
            stop(&mut records, ErrorKind::Aborted, "interrupted".into())
        }
        // The first record went online, so the model is there: a 404 now is a job route the
        // endpoint lacks (vLLM's and llama.cpp's OpenAI-compatible servers have none).
        Err(BatchError::Api(e)) if matches!(e.status, Some(404 | 405)) => stop(
            &mut records,
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
            stop(&mut records, e.kind, format!("batch jobs: {}{hint}", e.message))
        }
        Err(e @ BatchError::Site(_)) => stop(&mut records, ErrorKind::BadRequest, e.to_string()),
        Err(e @ BatchError::Ledger(_)) => {
            jobs_left("stopped");
            stop(&mut records, ErrorKind::Server, e.to_string())
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
}
