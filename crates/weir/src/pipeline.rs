//! `weir run` as one stream chain:
//!
//! source lines → parse (bad rows become `invalid_input` failures) → skip what an earlier run
//! finished → duplicate-id check → driver (cache → gate → concurrency → timeout → provider call,
//! retried per record) → outcome → sink (results / errors, one `write` per row when resumable).
//!
//! At most `max_concurrency` calls are in flight; at most `4 × max_concurrency` records are
//! between the source and the sinks (the rest are sleeping in backoff), so memory does not grow
//! with the input. The state directory (see `weir_io::state`) makes a run resumable.

use futures::StreamExt;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use weir_core::{
    DriverSettings, ErrorKind, Outcome, PromptSource, RateSettings, RecordSpec, StopReason, ThrottleSettings,
};
use weir_io::state::{self, RunIdentity};
use weir_io::{DiskCache, InputPath, JsonlWriter, OutputPath};
use weir_providers::{ModelSpec, ProviderError, ProviderOptions};

use crate::input::Input;
use crate::report::{Progress, RunReport};
use weir_runtime::Router;

/// Where a run keeps what makes it resumable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateMode {
    /// No journal and no cache (also the case when the output is stdout).
    Off,
    /// The state directory; by default `.weir/` beside the output.
    Dir(PathBuf),
}

/// A table to read: anything but a local JSONL file or stdin (CSV, Parquet, a directory or
/// glob of files, an object in s3:// or gs://).
#[derive(Debug, Clone)]
pub struct TableIn {
    /// As the user wrote it.
    pub spec: String,
    /// The format, when given (else from the names).
    pub format: Option<weir_tables::Format>,
    /// A CSV input's field separator.
    pub csv_delimiter: u8,
}

/// Tables to write results and errors to, as parts committed with a journal.
#[derive(Debug, Clone)]
pub struct TableOut {
    /// The results directory or prefix.
    pub results: weir_tables::Location,
    /// Its format.
    pub results_format: weir_tables::Format,
    /// The errors directory or prefix.
    pub errors: weir_tables::Location,
    /// Its format.
    pub errors_format: weir_tables::Format,
    /// A part is completed once it holds about this many bytes.
    pub part_bytes: u64,
    /// Parts are completed and recorded at least this often.
    pub checkpoint: Duration,
}

/// Everything `weir run` needs, validated.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// The model to call (for records whose `model_field` is absent).
    pub model: ModelSpec,
    /// A field naming each record's own model (`provider/model`); one throttle per model.
    pub model_field: Option<String>,
    /// Provider options (base URL, project, location, task).
    pub provider: ProviderOptions,
    /// The scenario of the simulator behind `sim/` models (`--sim-config`).
    pub sim_config: Option<weir_sim::SimConfig>,
    /// Input JSONL.
    pub input: InputPath,
    /// Result rows.
    pub output: OutputPath,
    /// Error rows.
    pub errors: OutputPath,
    /// How rows become records.
    pub records: RecordSpec,
    /// Timeout, retries, system text and parameters.
    pub driver: DriverSettings,
    /// How records are gathered into calls, for endpoints that take many per call (the item
    /// limit comes from each endpoint).
    pub batch: weir_core::BatchSettings,
    /// Calls in flight at most.
    pub max_concurrency: usize,
    /// Show a progress bar on stderr.
    pub progress: bool,
    /// The state directory.
    pub state: StateMode,
    /// Discard an earlier run's state and outputs.
    pub fresh: bool,
    /// Replace output files that hold rows this run did not write.
    pub overwrite: bool,
    /// Resume from a stream input without being able to identify it.
    pub resume_stream: bool,
    /// Use the response cache (in the state directory).
    pub cache: bool,
    /// Run again the records whose error rows are of a retryable kind.
    pub retry_errors: bool,
    /// After the first interrupt, how long calls in flight may take to finish.
    pub drain: Duration,
    /// Static rate limits and whether to learn them.
    pub rate: RateSettings,
    /// Adaptive concurrency (else fixed at `max_concurrency`).
    pub adaptive: bool,
    /// Beam's SRE throttler with this overload ratio.
    pub sre_k: Option<f64>,
    /// Serve Prometheus metrics on this address during the run.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// The input, when it is a table (then `input` only names it).
    pub table_input: Option<TableIn>,
    /// The outputs, when they are tables (then `output` and `errors` only name them).
    pub table_output: Option<TableOut>,
    /// Input columns to carry to the output (all when `None`).
    pub keep_columns: Option<Vec<String>>,
    /// Answer the records through the provider's batch jobs instead of online calls.
    pub batch_mode: Option<crate::batch_front::BatchMode>,
    /// Stream the answers, writing their pieces as events here.
    pub stream: Option<EventsTo>,
    /// The input is a file that keeps growing: follow it (`tail -f`) until interrupted.
    pub follow: bool,
}

/// Where a streaming run writes its events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventsTo {
    /// Between the result rows on stdout (`--output -`).
    WithResults,
    /// A file (or stdout, a FIFO) of their own (`--events`).
    Path(OutputPath),
}

/// Why a run could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The command must change (bad model, missing key, unreadable input): exit 2.
    #[error("{0}")]
    Usage(String),
    /// Something failed while running (cannot write output, input read error): exit 3.
    #[error("{0}")]
    Fatal(String),
    /// Interrupted before the run began (waiting for a FIFO's reader, a followed file's first
    /// line): nothing was done.
    #[error("{0}")]
    Interrupted(String),
}

impl From<ProviderError> for RunError {
    fn from(e: ProviderError) -> Self {
        match e {
            ProviderError::Config(m) => RunError::Usage(m),
            ProviderError::Start(m) => RunError::Fatal(m),
        }
    }
}

/// Output files this run created, each with a handle that keeps its lock: removed on drop
/// unless the run started (then it clears them), so a refused command leaves nothing behind.
/// Only a file this run made and still holds is removed; a file another run made or holds is
/// never touched, even when both started at the same moment.
#[derive(Default)]
struct Created(Vec<(PathBuf, std::fs::File)>);

impl Created {
    /// Keeps `file` (at `path`) for removal, with a handle that holds its lock.
    fn note(&mut self, path: &std::path::Path, file: &std::fs::File) -> Result<(), RunError> {
        let held = file.try_clone().map_err(|e| RunError::Fatal(format!("{}: {e}", path.display())))?;
        self.0.push((path.to_path_buf(), held));
        Ok(())
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        for (path, file) in &self.0 {
            weir_io::sink::remove_if_unused(path, file);
        }
    }
}

/// Starts a run's drain, wherever it is waiting (for an outcome, on a blocked writer, for the
/// writer to finish): no new calls, for `why` (the stop reason the report tells it by), and
/// the calls in flight get `drain` more time.
fn start_drain(router: &Router, deadline: std::pin::Pin<&mut tokio::time::Sleep>, drain: Duration, why: &str) {
    router.stop(StopReason { kind: ErrorKind::Aborted, message: why.into() });
    deadline.reset(Instant::now() + drain);
}

/// The end of an interrupted resumable run whose output's (or events') reader stopped reading:
/// the rows still queued for it are not written, and their records are not finished.
fn reader_not_reading() -> RunError {
    RunError::Interrupted(
        "stopped: a reader (of the output or of --events) did not take the rows still queued; their records are \
         not finished. Run the same command again to resume"
            .into(),
    )
}

pub use crate::report::OUTPUT_CLOSED;

/// Opens an output that is not a table: a file (locked, never truncated here, and noted in
/// `created` if this run made it), or a FIFO (locked too) or a device, written to as it is
/// (never truncated or read back); `None` for stdout.
async fn claim_path(
    p: &OutputPath,
    flag: &str,
    interrupts: &watch::Receiver<u32>,
    created: &mut Created,
) -> Result<Option<(PathBuf, std::fs::File)>, RunError> {
    use std::os::unix::fs::FileTypeExt;
    let usage = |path: &std::path::Path, e: std::io::Error| RunError::Usage(format!("{flag} {}: {e}", path.display()));
    match p {
        OutputPath::Stdout => Ok(None),
        OutputPath::File(path) => {
            let claimed = weir_io::sink::claim(path).map_err(|e| usage(path, e))?;
            if claimed.created {
                created.note(path, &claimed.file)?;
            }
            Ok(Some((path.clone(), claimed.file)))
        }
        // Opening a FIFO for writing blocks until something reads it: say so, and give up
        // when interrupted, rather than hang in silence.
        OutputPath::Stream(path) if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo()) => {
            let what = format!("something to read the FIFO {flag} {}", path.display());
            let fifo = wait_until(interrupts, Duration::from_millis(100), &what, || {
                open_fifo_if_read(path).map_err(|e| usage(path, e))
            })
            .await?;
            // Two runs writing one FIFO would interleave their rows (a row over the pipe's
            // atomic size is cut in two): held with the same advisory lock as a file.
            match fifo.try_lock() {
                Ok(()) => Ok(Some((path.clone(), fifo))),
                Err(std::fs::TryLockError::WouldBlock) => Err(RunError::Usage(format!(
                    "{flag} {}: another weir run is writing this FIFO; wait for it to finish or choose another path",
                    path.display()
                ))),
                Err(std::fs::TryLockError::Error(e)) => Err(usage(path, e)),
            }
        }
        OutputPath::Stream(path) => std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map(|f| Some((path.clone(), f)))
            .map_err(|e| usage(path, e)),
    }
}

/// The FIFO at `path` opened for writing if something reads it; `None` if nothing does yet.
/// The handle is the one to write to (closing it and opening again would hand the reader an
/// end of file); its writes block as usual.
fn open_fifo_if_read(path: &std::path::Path) -> std::io::Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let fifo = match std::fs::OpenOptions::new().append(true).custom_flags(libc::O_NONBLOCK).open(path) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Ok(None),
        Err(e) => return Err(e),
    };
    let fd = fifo.as_raw_fd();
    // SAFETY: fcntl on a descriptor owned by `fifo`, with integer arguments.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Some(fifo))
}

/// Asks `ready` every `every` until it has something: says once what the run is waiting for,
/// and gives up, having done nothing, when interrupted.
async fn wait_until<T>(
    interrupts: &watch::Receiver<u32>,
    every: Duration,
    waiting_for: &str,
    mut ready: impl FnMut() -> Result<Option<T>, RunError>,
) -> Result<T, RunError> {
    let mut said = false;
    loop {
        if let Some(v) = ready()? {
            return Ok(v);
        }
        if !said {
            eprintln!("weir: waiting for {waiting_for} …");
            said = true;
        }
        if *interrupts.borrow() >= 1 {
            return Err(RunError::Interrupted(format!(
                "interrupted while waiting for {waiting_for}; nothing was done"
            )));
        }
        tokio::time::sleep(every).await;
    }
}

/// The identity of a followed file, once it has a whole first line.
async fn wait_for_first_line(path: &std::path::Path, interrupts: &watch::Receiver<u32>) -> Result<String, RunError> {
    let what = format!("the first line of {} (a followed file is known by it)", path.display());
    wait_until(interrupts, Duration::from_millis(50), &what, || {
        weir_io::source::followed_identity(path)
            .map_err(|e| RunError::Usage(format!("cannot read --follow {}: {e}", path.display())))
    })
    .await
}

/// Refuses to replace files that hold rows this run did not write (a file weir is resuming is
/// its own; `--fresh` and `--overwrite` say replacing is wanted). Empty files are fair game.
fn check_not_foreign(
    files: &[&Option<(PathBuf, std::fs::File)>],
    allowed: bool,
    stateless: bool,
) -> Result<(), RunError> {
    if allowed {
        return Ok(());
    }
    for (path, f) in files.iter().filter_map(|c| c.as_ref()) {
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if len > 0 {
            // Without a state directory weir cannot know who wrote it, not even a run of this
            // very command.
            let why = if stateless {
                "this run keeps no state (--output - or --no-state), so it cannot tell whose rows those are; weir \
                 will not overwrite them. Pass --overwrite to replace it, or --errors/--output to write elsewhere"
            } else {
                "no earlier run of this command wrote it; weir will not overwrite it. Pass --overwrite to replace \
                 it (or --fresh to start this run over), or choose another path"
            };
            return Err(RunError::Usage(format!("{} already exists ({len} bytes) and {why}", path.display())));
        }
    }
    Ok(())
}

fn identity(
    settings: &RunSettings,
    input_file: Option<&std::path::Path>,
    table: Option<&weir_tables::TableInput>,
    followed: Option<&str>,
) -> Result<RunIdentity, RunError> {
    let input = match (input_file, &settings.input) {
        _ if table.is_some() => table.map(|t| t.identity()).transpose().map_err(table_error)?.unwrap_or_default(),
        // A followed file grows between runs: it is known by where and which file it is and by
        // its first line, not by all it holds.
        _ if followed.is_some() => followed.unwrap_or_default().to_string(),
        (Some(p), _) => state::input_identity(p)
            .map_err(|e| RunError::Usage(format!("cannot read --input {}: {e}", p.display())))?,
        (None, InputPath::Stdin) => "stdin (a stream)".to_string(),
        (None, InputPath::File(p)) => format!("{} (a stream)", p.display()),
    };
    Ok(RunIdentity {
        version: 1,
        input,
        model: settings.model.to_string(),
        model_field: settings.model_field.clone(),
        base_url: settings.provider.base_url.clone(),
        prompt: match &settings.records.prompt {
            PromptSource::Field(f) => format!("field:{f}"),
            PromptSource::Template(t) => format!("template:{}", t.source()),
        },
        id_field: settings.records.id_field.clone(),
        system: settings.driver.system.as_deref().map(str::to_string),
        params: serde_json::to_value(&*settings.driver.params).unwrap_or_default(),
        call: {
            let mut call = Vec::new();
            if settings.provider.task == weir_providers::Task::Embed {
                call.push("task=embed".to_string());
            }
            if settings.provider.endpoint_format != weir_providers::EndpointFormat::default() {
                call.push(format!("endpoint_format={:?}", settings.provider.endpoint_format).to_lowercase());
            }
            (!call.is_empty()).then(|| call.join(" "))
        },
    })
}

/// Runs the whole job and reports what happened. `env` reads environment variables;
/// `interrupts` counts Ctrl-C presses (the first one drains and stops).
pub async fn run(
    settings: RunSettings,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    interrupts: watch::Receiver<u32>,
) -> Result<RunReport, RunError> {
    // Everything that can be wrong with the command is checked before any file is written.
    let mut input = Input::open(&settings, env).await?;
    let live_input = input.live;
    let total = if settings.progress { input.count()? } else { None };
    weir_runtime::sim::install(settings.sim_config.clone());
    // The process's endpoints (their throttles, health and counters), with the run's limits;
    // the run's model is connected now, so that a bad model or a missing key is said before
    // any file is written.
    let runtime = runtime_for(&settings, env);
    let embed = settings.provider.task == weir_providers::Task::Embed;
    runtime.connect_spec(&settings.model, embed).await?;
    let jobs_api = jobs_api(&settings, env)?;

    // The output files claimed and the state directory opened: what an earlier run finished.
    let mut resumed = resume(&settings, &input, jobs_api.as_ref(), &interrupts, env, total).await?;
    // The writers: rows to files, or to a table's parts; events beside them.
    let (writer, events_writer) = start_writers(&settings, &input, env, &mut resumed).await?;
    // The table locks are held (and the state directory's lock) until the run ends.
    let Resumed {
        mut state_dir, mut recovered, cache, resuming, jobs_ledger, journal, total, table_locks: _locks, ..
    } = resumed;
    let events = match (&settings.stream, &events_writer) {
        (None, _) => None,
        (Some(_), Some(w)) => w.events(),
        (Some(_), None) => writer.events(),
    };

    let metrics = runtime.totals().clone();
    let router = Arc::new(
        Router::new(
            runtime.clone(),
            &settings.model,
            settings.model_field.clone(),
            embed,
            cache.clone().map(|c| c as Arc<dyn weir_core::ResponseCache>),
        )
        .await?,
    );
    let driver = router.default_driver().clone();
    let metrics_task = match settings.metrics_listen {
        Some(addr) => {
            let task = crate::metrics_server::serve(addr, runtime.clone())
                .map_err(|e| RunError::Usage(format!("--metrics-listen {addr}: {e}")))?;
            tracing::info!("metrics on http://{addr}/metrics");
            Some(task)
        }
        None => None,
    };
    let remaining = total.map(|t| t.saturating_sub(recovered.finished_count()));
    let progress = Progress::start(settings.progress, remaining, metrics.clone());
    let started = Instant::now();

    // Fed again with --resume-stream, the same records may come in another order or with
    // others between them: with --id-field, the id alone says a record is finished.
    let skip = crate::input::Skip {
        finished: std::mem::take(&mut recovered.finished),
        finished_ids: std::mem::take(&mut recovered.finished_ids),
        by_id: settings.resume_stream && settings.records.id_field.is_some(),
    };
    let mut first_interrupt = interrupts.clone();
    // The results' reader going away (`--output - | head`) ends the run as an interrupt does.
    let output_closed = writer.output_closed();
    let mut closed_input = output_closed.clone();
    // With a journal, an interrupted run stops reading: what it did not read, the next run does.
    // Without one, it reads on, and every record left gets an `aborted` row, so none is dropped
    // — unless the input may never end (an open pipe, a followed file): then it stops reading
    // too, and what it did not read stays unread, as with any consumer of a pipe that stops.
    let input_stop = async move {
        if journal || live_input {
            tokio::select! {
                _ = first_interrupt.wait_for(|n| *n >= 1) => {}
                _ = closed_input.wait_for(|c| *c) => {}
            }
        } else {
            std::future::pending::<()>().await;
        }
    };
    let work = input.records(settings.records.clone(), skip, input_stop);
    let tally = Arc::new(std::sync::Mutex::new(crate::batch_front::JobsTally::default()));
    // --mode auto: jobs for a large input (or to re-attach to an earlier run's jobs), else online.
    let jobs_api =
        choose_jobs(&settings, jobs_api, &input, total, resuming && jobs_ledger.as_deref().is_some_and(has_jobs))
            .await?;
    let used_jobs = jobs_api.is_some();
    let outcomes: futures::stream::LocalBoxStream<'_, Result<Outcome, std::io::Error>> =
        match (jobs_api, &settings.batch_mode, jobs_ledger.clone()) {
            (Some(api), Some(mode), Some(ledger)) => crate::batch_front::outcomes(
                work,
                crate::batch_front::JobsRun {
                    driver: driver.clone(),
                    api,
                    ledger,
                    fresh: !resuming,
                    mode: mode.clone(),
                    interrupts: interrupts.clone(),
                    progress: settings.progress,
                    max_concurrency: settings.max_concurrency,
                    tally: tally.clone(),
                },
            )
            .boxed_local(),
            // Each record to its model's driver, gathered into batches for endpoints that take
            // many records per call; everything else alone.
            _ => weir_runtime::dispatch::outcomes(
                work,
                router.clone(),
                weir_runtime::DispatchSettings {
                    batch: settings.batch.clone(),
                    width: settings.max_concurrency.max(1) * 4,
                },
                events.clone(),
            ),
        };

    // Outcomes to rows, until the input ends or the run is stopped, and the writers finished.
    let Drained { rows: (result_rows, error_rows), flushed, interrupted, not_written, mut fatal } = drain(
        outcomes,
        writer,
        Stops { interrupts, output_closed, router: &router, progress: &progress, journal },
        &settings,
    )
    .await?;
    let flushed = match events_writer {
        Some(w) => flushed.and(w.finish().await.1),
        None => flushed,
    };
    progress.finish();
    if let Some(task) = metrics_task {
        task.abort();
    }
    runtime.shutdown().await;
    drop(cache);
    let state_path = state_dir.take().map(|s| s.dir.display().to_string());
    if let Err(e) = flushed {
        fatal.get_or_insert(format!("writing rows failed: {e}"));
    }
    if let Some(msg) = fatal {
        return Err(RunError::Fatal(msg));
    }
    // What a resume has left to do: every record of the input not in either file. Counted from
    // the input when it is a file; a stream cannot be counted again.
    let stopped = interrupted || router.stop_reason().is_some();
    let unfinished = if !stopped {
        Some(0)
    } else if journal {
        let done = recovered.results + recovered.errors + result_rows + error_rows;
        input.count()?.map(|t| t.saturating_sub(done))
    } else {
        Some(not_written)
    };
    let mut report = RunReport::new(
        &metrics,
        started.elapsed().max(Duration::from_micros(1)),
        router.stop_reason(),
        report_places(&settings),
        (result_rows, error_rows),
        (recovered.results, recovered.errors),
        unfinished,
        state_path,
        driver.concurrency(),
        driver.rate_snapshot(),
    );
    // Answers written as error rows once the output's reader went away are not failures the
    // calls counted: counted here, so the summary's kinds add up to its failed records.
    if report.output_closed() {
        let counted: u64 = report.failures.values().sum();
        if report.failed > counted {
            *report.failures.entry(ErrorKind::Aborted).or_default() += report.failed - counted;
        }
    }
    // Shown when records went to jobs (not when the cache answered them all).
    let jobs = used_jobs
        .then(|| tally.lock().unwrap_or_else(|e| e.into_inner()).clone())
        .filter(|t| *t != crate::batch_front::JobsTally::default());
    let batch_tokens = jobs.as_ref().map_or((0, 0), |j| j.tokens);
    // Tokens paid for by this run: not those of answers from the cache.
    let paid = metrics.paid_tokens();
    let online = (paid.0.saturating_sub(batch_tokens.0), paid.1.saturating_sub(batch_tokens.1));
    // Every model's endpoint but the run's own, and what each model's tokens cost.
    let endpoints = runtime.endpoints().await;
    report.other_limits = endpoints
        .iter()
        .filter(|e| e.model != settings.model.to_string())
        .map(|e| (e.model.clone(), e.concurrency, e.rate))
        .collect();
    report.costs = match settings.model_field {
        // Records go to several models (never to jobs): each model's tokens at its price.
        Some(_) => endpoints
            .iter()
            .filter_map(|e| crate::cost::Cost::estimate(&e.model, e.metrics.paid_tokens(), (0, 0)))
            .collect(),
        None => crate::cost::Cost::estimate(&settings.model.to_string(), online, batch_tokens).into_iter().collect(),
    };
    report.jobs = jobs;
    Ok(report)
}

/// The process's endpoints (`weir_runtime`), with the run's limits and timeouts, connecting
/// with the keys `env` holds.
fn runtime_for(settings: &RunSettings, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Arc<weir_runtime::Runtime> {
    let env: HashMap<String, String> =
        weir_providers::ENV_VARS.iter().filter_map(|k| env(k).map(|v| (k.to_string(), v))).collect();
    let connector: weir_runtime::Connector = Arc::new(move |spec, options| {
        let env = env.clone();
        Box::pin(async move { weir_runtime::connect(&spec, &options, &|k| env.get(k).cloned()).await })
    });
    let throttle = ThrottleSettings {
        max_concurrency: settings.max_concurrency,
        adaptive: settings.adaptive,
        rate: settings.rate.clone(),
        sre_k: settings.sre_k,
    };
    let runtime_settings = weir_runtime::RuntimeSettings {
        provider: settings.provider.clone(),
        throttle,
        driver: settings.driver.clone(),
        cache: None,
    };
    weir_runtime::Runtime::with_connector(runtime_settings, connector)
}

/// The provider's batch-job API when the run asks for jobs (`--mode batch`, or `--mode auto`
/// where jobs are possible), after checking the command can use them.
fn jobs_api(
    settings: &RunSettings,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Option<Arc<dyn weir_core::JobApi>>, RunError> {
    Ok(match &settings.batch_mode {
        // --mode auto runs online what cannot go to jobs.
        Some(b)
            if b.auto_min_records.is_some() && (settings.model_field.is_some() || settings.state == StateMode::Off) =>
        {
            // Said, not silent: online calls cost twice what a job would.
            let why = if settings.model_field.is_some() {
                "--model-field sends records to several models, and a batch job runs one"
            } else {
                "batch jobs are recorded in a state directory, and this run keeps none (--output - or --no-state)"
            };
            eprintln!("weir: --mode auto: online calls at the full price: {why}");
            None
        }
        Some(b) => {
            if settings.model_field.is_some() {
                return Err(RunError::Usage("--mode batch runs one model; drop --model-field".into()));
            }
            if settings.state == StateMode::Off {
                return Err(RunError::Usage(
                    "--mode batch records its jobs in the state directory, so that a stopped run re-attaches to them \
                     instead of paying twice: it needs --output to a file (not -) and no --no-state"
                        .into(),
                ));
            }
            let staging = job_staging(&settings.model, b.job_bucket.as_deref(), env).map_err(RunError::Usage)?;
            match weir_providers::connect_jobs(&settings.model, &settings.provider, env, b.max_requests, staging) {
                Ok(api) => Some(api),
                // --mode auto: a provider without jobs runs online.
                Err(e) if b.auto_min_records.is_some() => {
                    eprintln!("weir: --mode auto: online calls: no batch jobs for {} ({e})", settings.model);
                    None
                }
                Err(e) => return Err(e.into()),
            }
        }
        None => None,
    })
}

/// `--mode auto`: jobs for a large input (or to re-attach to an earlier run's jobs), else
/// online calls; without `--mode`, a run whose earlier run left jobs is refused (they hold its
/// records).
async fn choose_jobs(
    settings: &RunSettings,
    jobs_api: Option<Arc<dyn weir_core::JobApi>>,
    input: &Input,
    total: Option<u64>,
    earlier_jobs: bool,
) -> Result<Option<Arc<dyn weir_core::JobApi>>, RunError> {
    Ok(match (&settings.batch_mode, jobs_api) {
        (Some(b), Some(api)) if b.auto_min_records.is_some() => {
            let min = b.auto_min_records.unwrap_or(0);
            let known = if total.is_none() { input.count()? } else { total };
            // A server without the Batch API (vLLM's OpenAI server, say) answers its routes 404.
            let available = match api.find("weir-probe").await {
                Err(e) if e.kind == ErrorKind::BadRequest => {
                    tracing::info!("--mode auto: no batch jobs at this endpoint ({e})");
                    false
                }
                _ => true,
            };
            let large = available && known.is_some_and(|n| n >= min);
            {
                let how = if large || earlier_jobs { "batch jobs" } else { "online calls" };
                let n = known.map_or("a stream of".to_string(), crate::report::thousands);
                eprintln!(
                    "weir: --mode auto: {n} records → {how}{} (batch jobs from {} records)",
                    if large || earlier_jobs { "" } else { " at the full price" },
                    crate::report::thousands(min)
                );
            }
            (large || earlier_jobs).then_some(api)
        }
        (None, _) if earlier_jobs => {
            return Err(RunError::Usage(
                "an earlier run of this command submitted batch jobs, which hold its records: resume with \
                 --mode batch (it re-attaches to them), or start over with --fresh (and `weir batch cancel` the \
                 old jobs)"
                    .into(),
            ))
        }
        (_, api) => api,
    })
}

/// The files the resume stage claimed.
#[derive(Default)]
struct Claimed {
    out_file: Option<(PathBuf, std::fs::File)>,
    err_file: Option<(PathBuf, std::fs::File)>,
    events_file: Option<(PathBuf, std::fs::File)>,
    /// Files this run made, removed again if it is refused before it starts.
    created: Created,
}

/// Starts the writer threads: the rows to the claimed files (truncated now, unless resumed) or
/// to a table's parts, and the events to a writer of their own where they are not lines of
/// the results. From here on, a table directory the run made stays.
async fn start_writers(
    settings: &RunSettings,
    input: &Input,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    resumed: &mut Resumed,
) -> Result<(weir_io::RowWriter, Option<weir_io::RowWriter>), RunError> {
    let tables_out = &settings.table_output;
    let Claimed { mut out_file, mut err_file, mut events_file, mut created } = std::mem::take(&mut resumed.files);
    let (resuming, journal, live_input) = (resumed.resuming, resumed.journal, input.live);
    let open = |claimed: &mut Option<(PathBuf, std::fs::File)>| match claimed.take() {
        None => Ok(JsonlWriter::stdout()),
        Some((path, f)) => {
            let regular = f.metadata().map(|m| m.is_file()).unwrap_or(false);
            let truncated = if resuming || !regular { Ok(()) } else { f.set_len(0) };
            truncated
                .and_then(|_| JsonlWriter::to_file(f))
                .map_err(|e| RunError::Usage(format!("cannot write {}: {e}", path.display())))
        }
    };
    let on_sync: Option<Box<dyn Fn() + Send + Sync>> =
        resumed.cache.clone().map(|c| Box::new(move || c.checkpoint()) as _);
    // A table's rows are not lines of a file: its events get a writer thread of their own.
    let mut events_writer = None;
    let writer = match &tables_out {
        None => {
            let results = open(&mut out_file)?;
            let errors = open(&mut err_file)?;
            let events = match &settings.stream {
                Some(EventsTo::WithResults) => Some(weir_io::Events::WithResults),
                Some(EventsTo::Path(_)) => Some(weir_io::Events::File(open(&mut events_file)?)),
                None => None,
            };
            created.0.clear();
            let writer_settings = weir_io::WriterSettings {
                journal,
                on_sync,
                // A reader of a pipe or a terminal gets each row as soon as it is known (and a
                // reader that went away is noticed while there are rows left to account for).
                flush_when_idle: live_input || settings.stream.is_some() || !settings.output.is_file(),
                events,
            };
            weir_io::RowWriter::spawn(results, errors, writer_settings)
                .map_err(|e| RunError::Fatal(format!("cannot start the writer thread: {e}")))?
        }
        Some(t) => {
            let input_schema = table_columns(settings, t, input.table.as_ref(), input.file.as_deref(), env).await?;
            let table_settings = weir_tables::TableSettings {
                results: t.results.clone(),
                results_format: t.results_format,
                errors: t.errors.clone(),
                errors_format: t.errors_format,
                input_schema,
                keep: settings.keep_columns.clone(),
                id_field: settings.records.id_field.clone(),
                task: table_task(settings),
                part_bytes: t.part_bytes,
                checkpoint: t.checkpoint,
                env: weir_tables::location::ENV_VARS
                    .iter()
                    .filter_map(|k| env(k).map(|v| (k.to_string(), v)))
                    .collect(),
                on_tick: on_sync,
            };
            if settings.stream.is_some() {
                let file = open(&mut events_file)?;
                created.0.clear();
                events_writer = Some(
                    weir_io::RowWriter::spawn_events(file)
                        .map_err(|e| RunError::Fatal(format!("cannot start the events writer: {e}")))?,
                );
            }
            weir_tables::spawn(table_settings, resumed.table_journal.take(), resumed.next_part)
                .map_err(|e| RunError::Fatal(format!("cannot start the table writer: {e}")))?
        }
    };
    // From here on the run writes: a table directory it made stays. (A usage error found
    // while setting up the writer, such as a --keep-columns the input lacks, leaves nothing.)
    for l in &mut resumed.table_locks {
        l.started = true;
    }
    Ok((writer, events_writer))
}

/// What the drain stage hands on: the rows written, and how the run ended.
struct Drained {
    /// Result rows and error rows written by this run.
    rows: (u64, u64),
    /// Whether every row was made durable.
    flushed: std::io::Result<()>,
    /// The run was interrupted (Ctrl-C, or the output's reader went away).
    interrupted: bool,
    /// Records with no row, when the run keeps no journal (they are counted as unfinished).
    not_written: u64,
    /// Why the run failed, if it did (the input could not be read, rows could not be written).
    fatal: Option<String>,
}

/// What can stop the drain stage: an interrupt, the output's reader going away, and what it
/// stops (the router's calls; the progress bar it speaks over).
struct Stops<'a> {
    interrupts: watch::Receiver<u32>,
    output_closed: watch::Receiver<bool>,
    router: &'a Router,
    progress: &'a Progress,
    /// The run is resumable: records it stops on are simply not finished.
    journal: bool,
}

/// Takes outcomes to rows and hands them to the writer until the outcomes end, or the run
/// stops (an interrupt drains the calls in flight for `--drain` at most); then finishes the
/// writer. A reader that stops reading still lets Ctrl-C be heard.
async fn drain(
    // Boxed, so it can be dropped before the writer finishes: a call it still holds may hold a
    // sender of stream events, and the writer ends only when every sender is gone.
    mut outcomes: futures::stream::LocalBoxStream<'_, Result<Outcome, std::io::Error>>,
    writer: weir_io::RowWriter,
    stops: Stops<'_>,
    settings: &RunSettings,
) -> Result<Drained, RunError> {
    let Stops { mut interrupts, mut output_closed, router, progress, journal } = stops;
    let tables_out = &settings.table_output;
    let mut fatal = None;
    let mut interrupted = false;
    let far = Instant::now() + Duration::from_secs(86_400 * 365);
    let drain_deadline = tokio::time::sleep_until(far);
    tokio::pin!(drain_deadline);
    let mut not_written = 0u64;
    // --keep-columns not yet found in any row (a table output checks them up front; JSONL rows
    // have no columns until they are read): any left at the end are named.
    let mut kept_seen: Vec<String> = settings.keep_columns.clone().unwrap_or_default();
    let mut rows_with_input = 0u64;
    loop {
        let outcome = tokio::select! {
            o = outcomes.next() => match o {
                Some(o) => o,
                None => break,
            },
            changed = interrupts.changed(), if !interrupted => {
                if changed.is_ok() && *interrupts.borrow() >= 1 {
                    interrupted = true;
                    progress.suspend(|| eprintln!(
                        "weir: interrupted; letting calls in flight finish (up to {} s). Press Ctrl-C again to stop at once.",
                        settings.drain.as_secs()
                    ));
                    start_drain(router, drain_deadline.as_mut(), settings.drain, "interrupted");
                }
                continue;
            }
            _ = output_closed.wait_for(|c| *c), if !interrupted => {
                interrupted = true;
                progress.suspend(|| eprintln!(
                    "weir: {OUTPUT_CLOSED}; letting calls in flight finish (up to {} s). Records from here on go to \
                     the errors file as not finished.",
                    settings.drain.as_secs()
                ));
                start_drain(router, drain_deadline.as_mut(), settings.drain, OUTPUT_CLOSED);
                continue;
            }
            // Only a resumable run cuts calls still in flight at the drain deadline (their
            // records are simply not finished); without a journal each must end in a row, and
            // the calls end by their own timeout at the latest.
            _ = &mut drain_deadline, if journal => {
                tracing::warn!("calls still in flight after the drain deadline were cancelled");
                break;
            }
        };
        // Rows are written (and made durable) by the writer thread, off this task.
        let row = match outcome {
            Ok(Outcome::Success(mut s)) => {
                if let Some(keep) = &settings.keep_columns {
                    rows_with_input += 1;
                    kept_seen.retain(|k| !s.record.input.contains_key(k));
                    s.record.input.retain(|k, _| keep.contains(k));
                }
                weir_io::Row::Success(s)
            }
            // With a journal, a record the run never tried is simply not finished: the next run
            // does it. Without one, it gets an error row so that nothing is silently dropped. A
            // table's parts cannot be rewritten on resume, so there the other errors that are
            // about the run (a spent quota, rejected credentials) are not written either.
            Ok(Outcome::Failure(f))
                if journal
                    && (f.error.kind == ErrorKind::Aborted
                        || (tables_out.is_some() && f.error.kind.is_about_the_run())) =>
            {
                not_written += 1;
                continue;
            }
            Ok(Outcome::Failure(mut f)) => {
                if let (Some(keep), Some(input)) = (&settings.keep_columns, f.input.as_mut()) {
                    rows_with_input += 1;
                    kept_seen.retain(|k| !input.contains_key(k));
                    input.retain(|k, _| keep.contains(k));
                }
                weir_io::Row::Failure(f)
            }
            Err(e) => {
                fatal = Some(format!("reading the input failed: {e}"));
                break;
            }
        };
        // A reader that stopped reading (a pager, a paused pipe) blocks the writer and so this
        // send: Ctrl-C is still heard, and the drain deadline still ends the wait.
        let send = writer.row(row);
        tokio::pin!(send);
        let written = loop {
            tokio::select! {
                w = &mut send => break Some(w),
                changed = interrupts.changed(), if !interrupted => {
                    if changed.is_ok() && *interrupts.borrow() >= 1 {
                        interrupted = true;
                        if journal {
                            progress.suspend(|| eprintln!(
                                "weir: interrupted while a reader (of the output or of --events) is not reading; \
                                 waiting for it up to {} s. Press Ctrl-C again to stop at once.",
                                settings.drain.as_secs()
                            ));
                        } else {
                            progress.suspend(|| eprintln!(
                                "weir: interrupted while a reader (of the output or of --events) is not reading; \
                                 waiting for it: without a state directory, the rows it has not taken would be lost. \
                                 Press Ctrl-C again to stop at once (they are lost then)."
                            ));
                        }
                        start_drain(router, drain_deadline.as_mut(), settings.drain, "interrupted");
                    }
                }
                // Only a resumable run gives up on a reader: its unwritten records are simply
                // not finished. Without a journal they would have no row at all.
                _ = &mut drain_deadline, if journal => break None,
            }
        };
        match written {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                fatal = Some(format!("writing rows failed: {e}"));
                break;
            }
            None => return Err(reader_not_reading()),
        }
        progress.tick();
    }
    // The input may have ended because of the interrupt (a journaled run stops reading at
    // once) before the loop saw it: the run was interrupted all the same.
    if !interrupted && *interrupts.borrow() >= 1 {
        interrupted = true;
        router.stop(StopReason { kind: ErrorKind::Aborted, message: "interrupted".into() });
    }
    drop(outcomes);
    if !kept_seen.is_empty() && rows_with_input > 0 {
        tracing::warn!(
            "--keep-columns: no input row had {} (misspelt?); the rows keep only the other columns named",
            kept_seen.iter().map(|k| format!("'{k}'")).collect::<Vec<_>>().join(", ")
        );
    }
    // Rows still queued wait for a slow reader, unless the run was interrupted: then for the
    // rest of the drain time at most.
    let finish = writer.finish();
    tokio::pin!(finish);
    let ((result_rows, error_rows), flushed) = loop {
        tokio::select! {
            done = &mut finish => break done,
            changed = interrupts.changed(), if !interrupted => {
                if changed.is_ok() && *interrupts.borrow() >= 1 {
                    interrupted = true;
                    start_drain(router, drain_deadline.as_mut(), settings.drain, "interrupted");
                }
            }
            // A deadline already past (calls that outlived it) still leaves the writer a moment.
            _ = tokio::time::sleep_until(drain_deadline.deadline().max(Instant::now() + Duration::from_secs(1))),
                if interrupted && journal => return Err(reader_not_reading()),
        }
    };
    Ok(Drained { rows: (result_rows, error_rows), flushed, interrupted, not_written, fatal })
}

/// What the resume stage hands on: the output files claimed (locked, not yet truncated), and
/// what an earlier run of the same command left — its finished records, its cache, its jobs.
struct Resumed {
    files: Claimed,
    state_dir: Option<state::StateDir>,
    recovered: state::Recovered,
    cache: Option<Arc<DiskCache>>,
    /// An earlier run's state is resumed.
    resuming: bool,
    table_journal: Option<weir_tables::Journal>,
    table_locks: Vec<TableLock>,
    next_part: u32,
    jobs_ledger: Option<PathBuf>,
    /// The run is resumable (it keeps a journal of what it finished).
    journal: bool,
    /// The number of records, when it was counted.
    total: Option<u64>,
}

/// Claims the output files and opens the state directory: the identity check (an earlier run
/// of another command is refused), the lock, and the recovery of what an earlier run of this
/// one finished. A refusal leaves nothing behind.
async fn resume(
    settings: &RunSettings,
    input: &Input,
    jobs_api: Option<&Arc<dyn weir_core::JobApi>>,
    interrupts: &watch::Receiver<u32>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    mut total: Option<u64>,
) -> Result<Resumed, RunError> {
    let (input_file, live_input, input_name) = (&input.file, input.live, &input.name);
    // The output files, opened (never truncated yet) and locked against other weir processes.
    let tables_out = settings.table_output.clone();
    // A followed file that a resumable run will know again: by its first line, so an empty one
    // is waited on until that line is written.
    let followed = match &settings.input {
        InputPath::File(p) if settings.follow && settings.state != StateMode::Off => {
            Some(wait_for_first_line(p, interrupts).await?)
        }
        _ => None,
    };
    let events_path = match &settings.stream {
        Some(EventsTo::Path(p)) => Some(p.clone()),
        _ => None,
    };
    // Files this run creates are removed again if the command is refused before it starts, so
    // that a refused command leaves nothing behind.
    let mut created = Created::default();
    // A table output is written through weir-tables, not opened here.
    let (out_file, mut err_file) = match &tables_out {
        Some(_) => (None, None),
        None => (
            claim_path(&settings.output, "--output", interrupts, &mut created).await?,
            claim_path(&settings.errors, "--errors", interrupts, &mut created).await?,
        ),
    };
    let events_file = match &events_path {
        Some(p) => claim_path(p, "--events", interrupts, &mut created).await?,
        None => None,
    };

    // The state directory: identity check, lock, recovery of an earlier run's outputs.
    let mut state_dir = None;
    let mut recovered = state::Recovered::default();
    let mut cache = None;
    let mut resuming = false;
    let mut table_journal = None;
    let mut table_locks: Vec<TableLock> = Vec::new();
    let mut next_part = 0;
    let mut jobs_ledger: Option<PathBuf> = None;
    let journal = match (&settings.state, &settings.output, &settings.errors) {
        (state_mode, _, _) if tables_out.is_some() => {
            let t = tables_out.as_ref().expect("a table output");
            // The errors table too: another run's output or errors table named as this run's
            // errors is refused, not cleared and overwritten.
            for (location, flag) in [(&t.results, "--output"), (&t.errors, "--errors")] {
                table_locks.extend(TableLock::take(location, flag)?);
            }
            let mut committed = weir_tables::Committed::default();
            let mut run_id = None;
            let journaled = if let StateMode::Dir(dir) = state_mode {
                let name = table_state_name(&t.results);
                let id = identity(settings, None, input.table.as_ref(), followed.as_deref())?;
                let ledger = weir_batch::Ledger::path_in(dir, &name);
                guard_jobs(&ledger, jobs_api, settings, &t.results.display).await?;
                let (sd, resume) =
                    state::open(dir, &name, &id, settings.fresh).map_err(|e| refused_with_jobs(e, &ledger))?;
                resuming = resume;
                if resuming && live_input && !settings.follow && !settings.resume_stream {
                    return Err(stream_resume_refused(&t.results.display, input_name));
                }
                jobs_ledger = Some(ledger);
                let path = dir.join("runs").join(format!("{name}.journal"));
                let (j, c) = weir_tables::Journal::open(&path, !resuming)
                    .map_err(|e| RunError::Fatal(format!("the journal {}: {e}", path.display())))?;
                committed = c;
                table_journal = Some(j);
                state_dir = Some(sd);
                run_id = Some(id);
                true
            } else {
                false
            };
            let replace = settings.overwrite || settings.fresh;
            for (location, table) in
                [(&t.results, weir_tables::journal::Table::Results), (&t.errors, weir_tables::journal::Table::Errors)]
            {
                weir_tables::prepare(location, table, &committed, resuming, replace, env).await.map_err(table_error)?;
            }
            if journaled {
                if let (false, Some(sd), Some(id)) = (resuming, &state_dir, &run_id) {
                    sd.record(id).map_err(|e| RunError::Usage(e.to_string()))?;
                }
                next_part = committed.next_part();
                recovered.results = committed.rows(weir_tables::journal::Table::Results);
                recovered.errors = committed.rows(weir_tables::journal::Table::Errors);
                recovered.finished = committed.finished;
                if resuming {
                    if total.is_none() {
                        total = input.count()?;
                    }
                    announce_resume(&recovered, total);
                }
                if let (true, StateMode::Dir(dir)) = (settings.cache, state_mode) {
                    cache = Some(open_cache(dir)?);
                }
            }
            journaled
        }
        (StateMode::Dir(dir), OutputPath::File(out), OutputPath::File(errs)) => {
            let name = state::output_state_name(out, dir);
            let id = identity(settings, input_file.as_deref(), input.table.as_ref(), followed.as_deref())?;
            let ledger = weir_batch::Ledger::path_in(dir, &name);
            guard_jobs(&ledger, jobs_api, settings, &out.display().to_string()).await?;
            let (sd, resume) =
                state::open(dir, &name, &id, settings.fresh).map_err(|e| refused_with_jobs(e, &ledger))?;
            resuming = resume;
            jobs_ledger = Some(ledger);
            if resuming && live_input && !settings.follow && !settings.resume_stream {
                return Err(stream_resume_refused(&out.display().to_string(), input_name));
            }
            check_not_foreign(
                &[&out_file, &err_file, &events_file],
                resuming || settings.fresh || settings.overwrite,
                false,
            )?;
            if !resuming {
                sd.record(&id).map_err(|e| RunError::Usage(e.to_string()))?;
            }
            if resuming {
                recovered = state::recover(out, errs, settings.retry_errors).map_err(|e| {
                    let msg = format!("recovering the earlier run's outputs: {e}");
                    // A line that is not a row is the user's to fix; other failures are I/O.
                    if e.kind() == std::io::ErrorKind::InvalidData {
                        RunError::Usage(msg)
                    } else {
                        RunError::Fatal(msg)
                    }
                })?;
                if recovered.requeued > 0 {
                    // The errors file was replaced by a rewritten one: write (and lock) that one.
                    err_file = claim_path(&settings.errors, "--errors", interrupts, &mut created).await?;
                }
                if total.is_none() {
                    total = input.count()?;
                }
                announce_resume(&recovered, total);
            } else if settings.retry_errors {
                return Err(RunError::Usage(
                    "--retry-errors needs the state of an earlier run of the same command (none found)".into(),
                ));
            }
            if settings.cache {
                cache = Some(open_cache(dir)?);
            }
            state_dir = Some(sd);
            true
        }
        _ => {
            check_not_foreign(&[&out_file, &err_file, &events_file], settings.overwrite, true)?;
            false
        }
    };
    if tables_out.is_some() {
        check_not_foreign(&[&events_file], resuming || settings.fresh || settings.overwrite, false)?;
    }
    Ok(Resumed {
        files: Claimed { out_file, err_file, events_file, created },
        state_dir,
        recovered,
        cache,
        resuming,
        table_journal,
        table_locks,
        next_part,
        jobs_ledger,
        journal,
        total,
    })
}

/// Where the run's rows went, as its summary says it. A table output is a directory (or
/// prefix) of part files, the errors' too, whatever their names say: said, so that
/// `--errors e.jsonl` is not looked for as a file.
fn report_places(settings: &RunSettings) -> crate::report::Places {
    let (output, errors) = match &settings.table_output {
        Some(t) => (
            format!("{}/ (a table: {} part files)", settings.output.display(), t.results_format.extension()),
            format!("{}/ (a table: {} part files)", settings.errors.display(), t.errors_format.extension()),
        ),
        None => (settings.output.display(), settings.errors.display()),
    };
    crate::report::Places { output, errors, followed: settings.follow }
}

/// A lock on a local table output (`.weir.lock` in its directory, which readers skip as a
/// hidden file), held for the whole run, so two weir processes never write one table whatever
/// their state directories. A run refused before it starts removes what it created. (An
/// object store has no such lock: see the README.)
struct TableLock {
    _file: std::fs::File,
    path: PathBuf,
    created: Option<PathBuf>,
    started: bool,
}

impl TableLock {
    fn take(results: &weir_tables::Location, flag: &str) -> Result<Option<Self>, RunError> {
        let Some(dir) = results.local_path() else { return Ok(None) };
        let usage = |e: std::io::Error| RunError::Usage(format!("{flag} {}: {e}", results.display));
        if dir.is_file() {
            // Refused by `weir_tables::prepare`, which says why for results and errors alike.
            return Ok(None);
        }
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(usage)?;
        }
        if std::fs::symlink_metadata(&dir).is_ok_and(|m| m.file_type().is_symlink()) && !dir.exists() {
            let to = std::fs::read_link(&dir).map(|t| t.display().to_string()).unwrap_or_default();
            return Err(RunError::Usage(format!(
                "{flag} {}: is a symlink to {to}, which does not exist; make that directory (mkdir -p), or name a \
                 directory itself",
                results.display
            )));
        }
        // Made by this run only if this run's own create did it: two runs started together
        // both see no directory, and the refused one must not remove the other's.
        let made = match std::fs::create_dir(&dir) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(usage(e)),
        };
        let path = dir.join(".weir.lock");
        match weir_io::sink::lock_path(&path, |o| o.truncate(false)).map_err(usage)? {
            Some(held) => Ok(Some(TableLock { _file: held.file, path, created: made.then_some(dir), started: false })),
            None => Err(RunError::Usage(format!(
                "another weir run is writing {}; wait for it to finish or choose another path",
                results.display
            ))),
        }
    }
}

impl Drop for TableLock {
    fn drop(&mut self) {
        // Only a lock taken is ever dropped here, so the lock file is this run's to remove
        // (while held: a run that opened it meanwhile finds it gone and opens it again).
        if !self.started {
            if let Some(dir) = &self.created {
                let _ = std::fs::remove_file(&self.path);
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// What a table output's result columns hold: text or vectors.
fn table_task(settings: &RunSettings) -> weir_tables::Task {
    if settings.provider.task == weir_providers::Task::Embed {
        weir_tables::Task::Embed
    } else {
        weir_tables::Task::Generate
    }
}

/// Columns a CSV input keeps as text: the id field (`007` and `7` are different ids), and the
/// prompt and system fields (a prompt column whose values look like numbers is still text,
/// sent as written).
pub(crate) fn text_columns(settings: &RunSettings) -> Vec<String> {
    let prompt = match &settings.records.prompt {
        weir_core::record::PromptSource::Field(f) => Some(f.clone()),
        weir_core::record::PromptSource::Template(_) => None,
    };
    settings.records.id_field.iter().cloned().chain(prompt).chain(settings.records.system_field.clone()).collect()
}

/// Why a run over a stream does not resume an earlier run's output on its own.
fn stream_resume_refused(output: &str, input: &str) -> RunError {
    RunError::Usage(format!(
        "{output} holds an earlier run of this command, but the input {input} is a stream, which weir cannot \
         check is the same data. Pass --resume-stream to resume anyway (records whose id and line are finished \
         are skipped), or --fresh to start over"
    ))
}

pub(crate) fn table_error(e: weir_tables::TableError) -> RunError {
    match e {
        weir_tables::TableError::Usage(m) => RunError::Usage(m),
        weir_tables::TableError::Unavailable(m) => RunError::Fatal(m),
    }
}

/// Where `model`'s batch jobs are staged: the `--job-bucket` of a Vertex AI model (which reads
/// its jobs' input from Cloud Storage). Other providers take their input in the request or as
/// an uploaded file, and refuse the flag rather than ignore it.
pub fn job_staging(
    model: &ModelSpec,
    bucket: Option<&str>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Option<Arc<dyn weir_core::JobStaging>>, String> {
    let Some(url) = bucket else { return Ok(None) };
    if model.provider != weir_providers::Provider::Vertex {
        return Err(format!(
            "--job-bucket is where vertex_ai/ batch jobs are staged; {model} takes its jobs' input directly (drop it)"
        ));
    }
    if !url.starts_with("gs://") {
        return Err(format!("--job-bucket {url}: Vertex AI reads jobs from Cloud Storage; give gs://BUCKET/PREFIX"));
    }
    let staging = weir_tables::BucketStaging::open(url, env).map_err(|e| format!("--job-bucket {url}: {e}"))?;
    Ok(Some(Arc::new(staging)))
}

/// Opens the response cache in the state directory.
fn open_cache(dir: &std::path::Path) -> Result<Arc<DiskCache>, RunError> {
    DiskCache::open(&dir.join("cache"))
        .map(Arc::new)
        .map_err(|e| RunError::Usage(format!("{e}; or run with --no-cache")))
}

/// Says what an earlier run finished, on stderr.
fn announce_resume(recovered: &state::Recovered, total: Option<u64>) {
    let of = total.map(|t| format!(" of {}", crate::report::thousands(t))).unwrap_or_default();
    eprintln!(
        "Resuming: {}{of} finished ({} results, {} errors){}{}",
        crate::report::thousands(recovered.finished_count()),
        crate::report::thousands(recovered.results),
        crate::report::thousands(recovered.errors),
        if recovered.requeued > 0 {
            format!("; {} error rows to run again", recovered.requeued)
        } else {
            String::new()
        },
        if recovered.torn_bytes > 0 {
            format!("; cut a torn tail of {} bytes", recovered.torn_bytes)
        } else {
            String::new()
        },
    );
}

/// The name of a table output's state: its last path component and a digest of where it is
/// (the store, the bucket and the absolute path, however the command spelled it).
pub fn table_state_name(results: &weir_tables::Location) -> String {
    use sha2::{Digest, Sha256};
    let base = results.path.filename().unwrap_or("output").to_string();
    let digest = Sha256::digest(format!("{:?}\n{}\n{}", results.scheme, results.bucket, results.path).as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("{base}-{hex}")
}

/// The input columns a table output carries: known from a table input or a local JSONL file
/// before the first row (and checked against --keep-columns now, so a wrong name is a usage
/// error); `None` for a stream, whose columns are inferred from its first rows.
async fn table_columns(
    settings: &RunSettings,
    out: &TableOut,
    table: Option<&weir_tables::TableInput>,
    input_file: Option<&std::path::Path>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Option<weir_tables::SchemaRef>, RunError> {
    use weir_tables::Format;
    if out.results_format == Format::Jsonl && out.errors_format == Format::Jsonl {
        return Ok(None);
    }
    let schema = match (table, input_file) {
        (Some(t), _) => t.schema().await.map_err(table_error)?,
        (None, Some(p)) => weir_tables::TableInput::open(&p.to_string_lossy(), Some(Format::Jsonl), &[], b',', env)
            .await
            .map_err(table_error)?
            .schema()
            .await
            .map_err(table_error)?,
        (None, None) => return Ok(None),
    };
    weir_tables::OutputColumns::new(
        &schema,
        settings.keep_columns.as_deref(),
        table_task(settings),
        out.results_format == Format::Csv,
    )
    .map_err(RunError::Usage)?;
    Ok(Some(schema))
}

/// Where a run writes (outputs, errors, and a local state directory), as the full names a
/// table input lists its files by (`/abs/path`, `s3://bucket/key`), to keep them out of a
/// directory or prefix input.
pub(crate) fn own_paths(settings: &RunSettings) -> Vec<String> {
    let full = |p: &str| weir_tables::Location::parse(p).ok().map(|l| l.with_path(l.path.clone()).display);
    let mut own: Vec<String> = match &settings.table_output {
        Some(t) => [&t.results, &t.errors].iter().map(|l| l.with_path(l.path.clone()).display).collect(),
        None => [&settings.output, &settings.errors]
            .iter()
            .filter_map(|o| match o {
                OutputPath::File(p) => full(&p.to_string_lossy()),
                _ => None,
            })
            .collect(),
    };
    if let StateMode::Dir(d) = &settings.state {
        own.extend(full(&d.to_string_lossy()));
    }
    own
}

/// Keeps an earlier run's provider jobs in sight. `--fresh` forgets the job ledger, so it is
/// refused while any job there is still pending or running: those jobs go on being charged,
/// `weir batch status` and `cancel` would no longer see them, and their records would be paid
/// for again. A refusal to resume a changed command names the jobs too, since its advice is
/// `--fresh`.
async fn guard_jobs(
    ledger: &std::path::Path,
    api: Option<&Arc<dyn weir_core::JobApi>>,
    settings: &RunSettings,
    output: &str,
) -> Result<(), RunError> {
    if !settings.fresh {
        return Ok(());
    }
    let jobs: Vec<weir_core::JobRef> = match weir_batch::Ledger::read(ledger) {
        Ok(chunks) => chunks.into_iter().filter_map(|c| c.job).collect(),
        Err(e) => return Err(RunError::Usage(format!("{e}; remove it only after checking its jobs"))),
    };
    if jobs.is_empty() {
        return Ok(());
    }
    let cancel = format!(
        "`weir batch cancel --model {} --output {output}` (with this run's --base-url, --project, --location, \
         --job-bucket and --state, if given)",
        settings.model
    );
    let Some(api) = api else {
        return Err(RunError::Usage(format!(
            "an earlier run of this command submitted {} batch job(s), which may still be running and charged; --fresh \
             would forget them. Run --fresh with --mode batch (weir then asks the provider whether they ended), or \
             cancel them first with {cancel}",
            jobs.len()
        )));
    };
    let mut live = Vec::new();
    for job in &jobs {
        match api.status(job).await {
            Ok(s) if s.state.is_terminal() => {}
            Ok(s) => live.push(format!("{} ({})", job.id, s.state.as_str())),
            Err(e) => live.push(format!("{} (the provider could not be asked: {e})", job.id)),
        }
    }
    if live.is_empty() {
        return Ok(());
    }
    Err(RunError::Usage(format!(
        "--fresh would forget {} batch job(s) of the earlier run that are still live at the provider and charged: {}. \
         Their records would be paid for again. Run without --fresh to collect their answers, or cancel them with \
         {cancel} and then run --fresh",
        live.len(),
        live.join(", ")
    )))
}

/// A refusal of the state directory; one that advises `--fresh` says that jobs the earlier run
/// submitted stand in its way until they end or are cancelled.
fn refused_with_jobs(e: state::StateError, ledger: &std::path::Path) -> RunError {
    let mut message = e.to_string();
    if message.contains("--fresh") && has_jobs(ledger) {
        message.push_str(
            ". The earlier run submitted batch jobs: --fresh is refused while they are pending or running (see them \
             with `weir batch status`, cancel them with `weir batch cancel`)",
        );
    }
    RunError::Usage(message)
}

/// Whether the job ledger at `path` records a submitted job.
fn has_jobs(path: &std::path::Path) -> bool {
    weir_batch::Ledger::read(path).is_ok_and(|chunks| chunks.iter().any(|c| c.job.is_some()))
}
