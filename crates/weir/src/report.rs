//! What a run tells its user: a progress bar while it runs, a summary when it ends.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use weir_core::{ErrorKind, Percentiles, RateSnapshot, RunMetrics, StopReason};

/// The end of a run, in numbers.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// Records finished by this run.
    pub records: u64,
    /// Result rows written by this run.
    pub succeeded: u64,
    /// Error rows written by this run.
    pub failed: u64,
    /// Result and error rows an earlier run had written (when resuming).
    pub earlier: (u64, u64),
    /// Records not finished (the run stopped or was interrupted; a resume does them); `None`
    /// when the input is a stream, which cannot be counted.
    pub unfinished: Option<u64>,
    /// Failed records by kind, this run.
    pub failures: BTreeMap<ErrorKind, u64>,
    /// Calls made.
    pub calls: u64,
    /// Calls beyond each record's first.
    pub retries: u64,
    /// Calls refused with a rate-limit error.
    pub rate_limited: u64,
    /// Answers that did not match the response schema.
    pub invalid_outputs: u64,
    /// Records answered from the response cache.
    pub cache_hits: u64,
    /// Seconds calls were held by server-advised pauses (summed over calls).
    pub throttled_secs: f64,
    /// Prompt tokens.
    pub tokens_in: u64,
    /// Output tokens.
    pub tokens_out: u64,
    /// Wall-clock time.
    pub elapsed: Duration,
    /// Why the run stopped early, if it did.
    pub stopped: Option<StopReason>,
    /// Where results went.
    pub output: String,
    /// Where errors went.
    pub errors: String,
    /// The state directory, when the run is resumable.
    pub state: Option<String>,
    /// The concurrency limit at the end.
    pub concurrency: usize,
    /// The rate limits in force at the end.
    pub rates: Option<RateSnapshot>,
    /// How the endpoint's quota was shared with other processes, and where they met.
    pub sharing: weir_core::Sharing,
    /// Where: a summary of `--quota-store`.
    pub shared_through: String,
    /// The same for each other model's endpoint (`--model-field`), by model.
    pub other_limits: Vec<(String, usize, Option<RateSnapshot>)>,
    /// Each endpoint of the model's pool, when it has more than one.
    pub pool: Vec<weir_core::EndpointStatus>,
    /// Why the quota was not shared with other processes (`--quota-store` not off), if so.
    pub unshared: Option<String>,
    /// Batching, when the endpoint takes many records per call.
    pub batching: Option<BatchReport>,
    /// What provider batch jobs did (`--mode batch`).
    pub jobs: Option<JobsTally>,
    /// Where the HTML report was written, if it was.
    pub html: Option<String>,
    /// Estimated cost of the tokens this run paid for, one per model that has a price (several
    /// with `--model-field`).
    pub costs: Vec<crate::cost::Cost>,
    /// Streamed calls: time from sending to the first text.
    pub first_token: Option<Percentiles>,
    /// Streamed calls: time between pieces of text.
    pub inter_token: Option<Percentiles>,
    /// The input was a followed file (a resume goes on from where it stopped).
    pub followed: bool,
    /// The input was a stream (stdin, a FIFO): read once, so resumed with `--resume-stream`.
    pub stream: bool,
}

/// How records were gathered into calls.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchReport {
    /// Batched calls sent (retries and the halves of split calls included).
    pub calls: u64,
    /// Records per call, on average.
    pub mean_fill: f64,
    /// Estimated tokens a padded batch computes ÷ the records' own tokens (1.0: no padding).
    pub padding: f64,
    /// 95th percentile of the time records waited for their batch: the bound of its bucket in
    /// milliseconds (`None`: above the last bucket).
    pub wait_p95_ms: Option<u64>,
}

/// What the jobs did, for the summary.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobsTally {
    /// Jobs that answered this run's records (an earlier, stopped run's it re-attached to
    /// included).
    pub jobs: u64,
    /// Of them, submitted by this process.
    pub submitted_now: u64,
    /// Records answered (or failed for good) by jobs.
    pub settled: u64,
    /// Prompt and output tokens of the answers jobs gave.
    pub tokens: (u64, u64),
    /// Records sent online: the first of a new run (checking the request before any job), and
    /// those no job answered with `--fallback online`.
    pub online: u64,
    /// In a pool, per endpoint: jobs this run submitted there, and why it refused jobs.
    pub sites: Vec<(String, u64, Option<String>)>,
}

/// An endpoint's limits at the end, as the summary says them.
fn limits_text(concurrency: usize, rates: Option<&RateSnapshot>) -> String {
    let mut limits = vec![format!("concurrency {concurrency}")];
    if let Some(r) = rates {
        for (what, v) in [("requests", r.requests), ("tokens", r.tokens)] {
            match v {
                // Learned as nothing (a quota of zero): the window it was learned over says
                // nothing, and "0 per 14.0 s" against a 10-s window puzzled a user.
                Some((cap, _, true)) if cap < 0.5 => limits.push(format!("{what}: none admitted at the end (learned)")),
                Some((cap, window, learned)) => limits.push(format!(
                    "{} {what} per {:.1} s{}",
                    thousands(cap.round() as u64),
                    window.as_secs_f64(),
                    if learned { " (learned)" } else { "" }
                )),
                None => {}
            }
        }
    }
    limits.join(", ")
}

/// Why a run whose results' reader went away stopped (its report tells it by this message).
pub const OUTPUT_CLOSED: &str = "the output was closed (its reader went away)";

/// Where a run's rows went, as its summary names them.
#[derive(Debug, Clone)]
pub struct Places {
    /// The results: a file, `-`, or a table's directory or prefix.
    pub output: String,
    /// The error rows.
    pub errors: String,
    /// Whether the input was followed (`--follow`).
    pub followed: bool,
    /// Whether the input was a stream (stdin, a FIFO).
    pub stream: bool,
}

impl RunReport {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        m: &RunMetrics,
        elapsed: Duration,
        stopped: Option<StopReason>,
        places: Places,
        rows: (u64, u64),
        earlier: (u64, u64),
        unfinished: Option<u64>,
        state: Option<String>,
        concurrency: usize,
        rates: Option<RateSnapshot>,
    ) -> Self {
        Self {
            records: rows.0 + rows.1,
            succeeded: rows.0,
            failed: rows.1,
            earlier,
            unfinished,
            failures: m
                .failures_by_kind()
                .into_iter()
                .filter(|(k, _)| state.is_none() || *k != ErrorKind::Aborted)
                .collect(),
            calls: m.calls.load(Relaxed),
            retries: m.retries.load(Relaxed),
            rate_limited: m.rate_limited.load(Relaxed),
            invalid_outputs: m.invalid_outputs.load(Relaxed),
            cache_hits: m.cache_hits.load(Relaxed),
            throttled_secs: m.throttled_wall_micros.load(Relaxed) as f64 / 1e6,
            tokens_in: m.tokens_in.load(Relaxed),
            tokens_out: m.tokens_out.load(Relaxed),
            elapsed,
            stopped,
            output: places.output,
            errors: places.errors,
            state,
            concurrency,
            rates,
            batching: m.batch_wait_p95_ms().map(|wait_p95_ms| {
                let calls = m.batches.load(Relaxed).max(1);
                let real = m.batch_tokens.load(Relaxed).max(1);
                BatchReport {
                    calls: m.batches.load(Relaxed),
                    mean_fill: m.batch_items.load(Relaxed) as f64 / calls as f64,
                    padding: m.batch_padded_tokens.load(Relaxed) as f64 / real as f64,
                    wait_p95_ms,
                }
            }),
            jobs: None,
            html: None,
            costs: Vec::new(),
            other_limits: Vec::new(),
            pool: Vec::new(),
            unshared: None,
            sharing: weir_core::Sharing::default(),
            shared_through: String::new(),
            first_token: m.first_token(),
            inter_token: m.inter_token(),
            followed: places.followed,
            stream: places.stream,
        }
    }

    /// Records per second.
    pub fn rate(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64()
    }

    /// Error rows in the errors file, this run's and earlier ones'.
    pub fn total_failed(&self) -> u64 {
        self.failed + self.earlier.1
    }

    /// True when the run was interrupted by the user.
    pub fn interrupted(&self) -> bool {
        self.stopped.as_ref().is_some_and(|s| s.kind == ErrorKind::Aborted)
    }

    /// True if the run ended because its results' reader went away (`| head`).
    pub fn output_closed(&self) -> bool {
        self.stopped.as_ref().is_some_and(|s| s.kind == ErrorKind::Aborted && s.message == OUTPUT_CLOSED)
    }

    /// The summary printed at the end of a run.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "weir: {} record{} in {:.2} s ({}/s): {} succeeded, {} failed\n",
            thousands(self.records),
            if self.records == 1 { "" } else { "s" },
            self.elapsed.as_secs_f64(),
            pace(self.rate()),
            thousands(self.succeeded),
            thousands(self.failed),
        );
        if self.earlier != (0, 0) {
            s.push_str(&format!(
                "  earlier runs: {} succeeded, {} failed\n",
                thousands(self.earlier.0),
                thousands(self.earlier.1)
            ));
        }
        s.push_str(&format!(
            "  calls {} ({} retries, {} rate-limited, {:.1} s throttled); {} from cache; tokens {} in, {} out\n",
            thousands(self.calls),
            thousands(self.retries),
            thousands(self.rate_limited),
            self.throttled_secs,
            thousands(self.cache_hits),
            thousands(self.tokens_in),
            thousands(self.tokens_out),
        ));
        if self.invalid_outputs > 0 {
            s.push_str(&format!(
                "  invalid_output: {} answers did not match the response schema (paid for; each tried again up to \
                 --max-invalid-retries)\n",
                thousands(self.invalid_outputs)
            ));
        }
        let limits = match self.pool.len() {
            0 => limits_text(self.concurrency, self.rates.as_ref()),
            n => format!("a pool of {n} endpoints, concurrency {} in all (each endpoint's below)", self.concurrency),
        };
        s.push_str(&format!(
            "  limits: {limits}; {}/s succeeded\n",
            pace(self.succeeded as f64 / self.elapsed.as_secs_f64())
        ));
        if self.sharing.processes > 1 && self.sharing.machine_only {
            s.push_str(&format!(
                "  quota shared by {} processes at most; at the end the store where processes share it ({}) could not \
                 be reached, and only processes on this machine could share it (see the warning above)\n",
                self.sharing.processes, self.shared_through
            ));
        } else if self.sharing.processes > 1 {
            s.push_str(&format!("  {}\n", sharing_text(&self.sharing, &self.shared_through)));
        } else if let Some(why) = &self.unshared {
            s.push_str(&format!("  quota not shared with other processes: {why}\n"));
        } else if self.sharing.alone_now {
            // The store was named but never reached (a Redis server down, a holder silent from
            // the start): the warning scrolled away, and a run that shared nothing must not
            // look like one that had no one to share with.
            s.push_str(&format!(
                "  quota not shared: the store where processes share it ({}) could not be reached (see the warning \
                 above), and this process kept the quota alone\n",
                self.shared_through
            ));
        }
        s.push_str(&pool_lines(&self.pool));
        for (model, concurrency, rates) in &self.other_limits {
            s.push_str(&format!("  limits of {model}: {}\n", limits_text(*concurrency, rates.as_ref())));
        }
        if let Some(b) = &self.batching {
            s.push_str(&format!(
                "  batches: {} calls, {:.1} records per call, padding {:.2}× (padded ÷ real tokens), read-to-sent p95 {}\n",
                thousands(b.calls),
                b.mean_fill,
                b.padding,
                b.wait_p95_ms.map_or("over 5 s".to_string(), |ms| format!("under {ms} ms")),
            ));
        }
        if let Some(t) = &self.first_token {
            let mut line = format!("  streams: {} with text; time to first token {}", thousands(t.count), ms3(t));
            if let Some(g) = &self.inter_token {
                line.push_str(&format!("; between pieces {}", ms3(g)));
            }
            s.push_str(&line);
            s.push('\n');
        }
        if let Some(j) = &self.jobs {
            s.push_str(&format!(
                "  batch jobs: {} ({} submitted by this run); {} records settled by them{}\n",
                thousands(j.jobs),
                thousands(j.submitted_now),
                thousands(j.settled),
                if j.online > 0 { format!(", {} online", thousands(j.online)) } else { String::new() },
            ));
            for (label, n, refused) in &j.sites {
                match refused {
                    Some(why) => s.push_str(&format!(
                        "    jobs at {label}: {} submitted; it refused one ({why}) and got no more\n",
                        thousands(*n)
                    )),
                    None => s.push_str(&format!("    jobs at {label}: {} submitted\n", thousands(*n))),
                }
            }
        }
        for c in &self.costs {
            s.push_str(&c.line());
        }
        if self.costs.len() > 1 {
            let total: f64 = self.costs.iter().map(|c| c.usd).sum();
            s.push_str(&format!("  cost in all: about ${}\n", crate::cost::dollars(total)));
        }
        s.push_str(&format!("  results: {}\n", self.output));
        if let Some(html) = &self.html {
            s.push_str(&format!("  report:  {html}\n"));
        }
        if self.failed > 0 {
            let kinds: Vec<String> = self.failures.iter().map(|(k, n)| format!("{k} {}", thousands(*n))).collect();
            s.push_str(&format!("  errors:  {} ({})\n", self.errors, kinds.join(", ")));
        }
        if let Some(stop) = &self.stopped {
            if self.output_closed() {
                s.push_str(&format!(
                    "  stopped: {}; every record not written there has an error row (kind aborted) in the errors \
                     file, with its input\n",
                    stop.message
                ));
            } else if self.interrupted() {
                // Without a state directory, every record the stop cut off has an error row, and
                // counts among the failed: say that they were not run rather than that they
                // failed.
                match self.failures.get(&ErrorKind::Aborted).filter(|_| self.state.is_none()) {
                    Some(&n) => s.push_str(&format!(
                        "  interrupted: {} of the failed records were not run or were cut off; each has an error row \
                         (kind aborted) with its input in the errors file (no state directory to resume from)\n",
                        thousands(n)
                    )),
                    None => s.push_str("  interrupted\n"),
                }
            } else {
                s.push_str(&format!("  stopped early ({}): {}\n", stop.kind, stop.message));
            }
        }
        if self.unfinished != Some(0) || self.stopped.is_some() {
            if let Some(state) = &self.state {
                match self.unfinished {
                    Some(n) => {
                        // Error rows about the run (a spent quota, a rejected key, a stop) are
                        // run again by a resume too: said, so the count is the whole of it.
                        let again: u64 =
                            self.failures.iter().filter(|(k, _)| k.is_about_the_run()).map(|(_, n)| n).sum();
                        let rows = match again {
                            0 => String::new(),
                            a => {
                                format!(" (and {} error rows of the run's own trouble, tried again too)", thousands(a))
                            }
                        };
                        s.push_str(&format!(
                            "  {} records not finished{rows}; run the same command again to resume (state in {state})\n",
                            thousands(n)
                        ))
                    }
                    None if self.followed => s.push_str(&format!(
                        "  stopped following; run the same command again to go on from where it stopped (state in \
                         {state})\n"
                    )),
                    None if self.stream => s.push_str(&format!(
                        "  the rest of the input (a stream, not counted) is not finished; feed the same data to the \
                         same command with --resume-stream to resume (state in {state})\n"
                    )),
                    // A table not counted (a CSV in a bucket): read again by the same command.
                    None => s.push_str(&format!(
                        "  the rest of the input (not counted) is not finished; run the same command again to resume \
                         (state in {state})\n"
                    )),
                }
            }
        }
        s
    }
}

/// `p50 X ms, p95 Y ms, p99 Z ms`.
fn ms3(p: &Percentiles) -> String {
    let ms = |d: std::time::Duration| {
        let v = d.as_secs_f64() * 1000.0;
        if v < 10.0 {
            format!("{v:.2}")
        } else {
            format!("{v:.0}")
        }
    };
    format!("p50 {} ms, p95 {} ms, p99 {} ms", ms(p.p50), ms(p.p95), ms(p.p99))
}

/// Formats a count with thousands separators.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// How often progress is printed as a line when stderr is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// The progress bar: records done of total, rate, ETA, and a message with errors and tokens.
pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

impl Progress {
    /// Shows progress on stderr, when `enabled`, read from `metrics` and from `runtime`'s
    /// throttles (calls they hold for the quota).
    pub(crate) fn start(
        enabled: bool,
        total: Option<u64>,
        metrics: Arc<RunMetrics>,
        runtime: Arc<weir_runtime::Runtime>,
    ) -> Self {
        if !enabled {
            return Self { bar: None, ticker: None };
        }
        if !std::io::stderr().is_terminal() {
            // A log file or a pipe cannot redraw a bar: a line every few seconds instead.
            let ticker = tokio::spawn(async move {
                let start = tokio::time::Instant::now();
                loop {
                    tokio::time::sleep(LINE_EVERY).await;
                    let (done, failed) = metrics.done_and_failed();
                    let of = total.map(|t| format!(" of {}", thousands(t))).unwrap_or_default();
                    eprintln!(
                        "weir: {}{of} records in {:.0} s ({}/s), {} errors{}",
                        thousands(done),
                        start.elapsed().as_secs_f64(),
                        thousands((done as f64 / start.elapsed().as_secs_f64()).round() as u64),
                        thousands(failed),
                        held_text(&runtime, ", ").await,
                    );
                }
            });
            return Self { bar: None, ticker: Some(ticker) };
        }
        let bar = match total {
            Some(t) => ProgressBar::with_draw_target(Some(t), ProgressDrawTarget::stderr()).with_style(
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {human_pos}/{human_len} ETA {eta} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            ),
            None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()).with_style(
                ProgressStyle::with_template("{elapsed_precise} {spinner} {human_pos} records {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            ),
        };
        let b = bar.clone();
        let ticker = tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let (done, failed) = metrics.done_and_failed();
                let rate = done as f64 / start.elapsed().as_secs_f64();
                b.set_message(format!(
                    "| {}/s | {} errors | {} tok in, {} out{}",
                    thousands(rate.round() as u64),
                    thousands(failed),
                    thousands(metrics.tokens_in.load(Relaxed)),
                    thousands(metrics.tokens_out.load(Relaxed)),
                    held_text(&runtime, " | ").await,
                ));
            }
        });
        Self { bar: Some(bar), ticker: Some(ticker) }
    }

    /// Prints a line without tearing the bar.
    pub(crate) fn suspend(&self, f: impl FnOnce()) {
        match &self.bar {
            Some(b) => b.suspend(f),
            None => f(),
        }
    }

    pub(crate) fn tick(&self) {
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }

    pub(crate) fn finish(&self) {
        if let Some(t) = &self.ticker {
            t.abort();
        }
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// A pace per second as the summary says it: a slow run's to a tenth (4 records in 9.9 s said
/// "0/s").
fn pace(r: f64) -> String {
    if r > 0.0 && r < 10.0 {
        format!("{r:.1}")
    } else {
        thousands(r.round() as u64)
    }
}

/// The calls the quota holds now, after `sep`, for the progress line (nothing when none are):
/// a run held for a full per-minute window, or behind a scout, otherwise looks hung.
async fn held_text(runtime: &weir_runtime::Runtime, sep: &str) -> String {
    match runtime.endpoints().await.iter().map(|e| e.held).sum::<usize>() {
        0 => String::new(),
        1 => format!("{sep}1 call held for the quota"),
        n => format!("{sep}{} calls held for the quota", thousands(n as u64)),
    }
}

/// How a quota was shared: with how many processes, met where (this one's calls are on the
/// line above).
fn sharing_text(sharing: &weir_core::Sharing, through: &str) -> String {
    if sharing.alone_now {
        format!(
            "quota shared by {} processes {through} for part of the run: the others were lost (see the warning above), \
             and this process kept the quota alone at the end",
            sharing.processes
        )
    } else {
        format!(
            "quota shared by {} processes {through} (one throttle for all, calls admitted in turn)",
            sharing.processes
        )
    }
}

/// Where processes met to share a quota, as the summary says it.
pub fn shared_through(store: &weir_core::QuotaStore) -> String {
    match store {
        weir_core::QuotaStore::Local => "on this machine (--quota-store local)".into(),
        weir_core::QuotaStore::Cluster => "through the cluster's scheduler".into(),
        weir_core::QuotaStore::Redis(url) => format!("through {}", weir_runtime::share_redis::describe(url)),
        weir_core::QuotaStore::Off => "(--quota-store off)".into(),
    }
}

/// A pool's lines of a summary: each endpoint's state, calls, refusals and limits (nothing for
/// a single endpoint). `weir run`, `weir sql` and executors print them alike.
pub fn pool_lines(pool: &[weir_core::EndpointStatus]) -> String {
    pool.iter()
        .map(|e| {
            format!(
                "  endpoint {}: {}{}; {} calls, {} rate-limited, {} failed; {}\n",
                e.endpoint,
                e.health.as_str(),
                e.why.map(|w| format!(" ({w})")).unwrap_or_default(),
                thousands(e.calls),
                thousands(e.rate_limited),
                thousands(e.failed),
                limits_text(e.concurrency, Some(&e.rates)),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn thousands_separators() {
        assert_eq!(super::thousands(0), "0");
        assert_eq!(super::thousands(999), "999");
        assert_eq!(super::thousands(1000), "1,000");
        assert_eq!(super::thousands(1234567), "1,234,567");
    }

    #[test]
    fn a_stopped_run_over_an_input_not_counted_says_how_to_resume_it() {
        use std::time::Duration;
        // A table in a bucket is not counted: it is read again by the same command. Only a
        // stream is fed again with --resume-stream (an S3 CSV's stop said "a stream" before).
        let stop = weir_core::StopReason { kind: weir_core::ErrorKind::Aborted, message: "interrupted".into() };
        let report = |stream| {
            let places = super::Places { output: "o".into(), errors: "e".into(), followed: false, stream };
            let m = weir_core::RunMetrics::default();
            super::RunReport::new(
                &m,
                Duration::from_secs(1),
                Some(stop.clone()),
                places,
                (1, 0),
                (0, 0),
                None,
                Some("st".into()),
                4,
                None,
            )
            .summary()
        };
        let table = report(false);
        assert!(
            table.contains("not counted) is not finished; run the same command again")
                && !table.contains("--resume-stream"),
            "{table}"
        );
        assert!(report(true).contains("--resume-stream"));
    }

    #[test]
    fn a_quota_learned_as_nothing_names_no_window() {
        use std::time::Duration;
        let rates = weir_core::RateSnapshot {
            requests: Some((0.0, Duration::from_secs(14), true)),
            tokens: Some((1_000.0, Duration::from_secs(60), false)),
        };
        assert_eq!(
            super::limits_text(4, Some(&rates)),
            "concurrency 4, requests: none admitted at the end (learned), 1,000 tokens per 60.0 s"
        );
    }
}
