//! `weir run` as a composition of stages, each in a module of its own:
//!
//! input (`input`: lines read, parsed into records, what an earlier run finished skipped) →
//! resume (`resume`: output files claimed, the state directory opened, an earlier run's rows
//! recovered) → runtime (`weir_runtime`: each record routed to its model's endpoint, batched
//! by length for endpoints that take many per call, through the cache, the throttle and the
//! executor; or provider jobs, `jobs`) → drain (`drain`: outcomes to rows until the
//! input ends or the run is stopped) → output (`output`: the writer threads, JSONL files or a
//! table's parts) → the summary (`report`).
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
use weir_core::{DriverSettings, ErrorKind, Outcome, RateSettings, RecordSpec, ThrottleSettings};
use weir_io::{InputPath, OutputPath};
use weir_providers::{ModelSpec, ProviderError, ProviderOptions};

use crate::drain::{drain, Drained, Stops};
use crate::input::Input;
use crate::output::start_writers;
use crate::report::{Progress, RunReport};
use crate::resume::{has_jobs, resume, Resumed};
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
    /// Where this process shares the endpoint's quota with others.
    pub store: weir_core::QuotaStore,
    /// Serve Prometheus metrics on this address during the run.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Serve the live page on this (loopback) address during the run.
    pub ui: Option<std::net::SocketAddr>,
    /// Write the HTML report here at the end.
    pub report: Option<PathBuf>,
    /// The endpoints the model is called at (empty: the one `provider` names).
    pub pool: Vec<weir_runtime::EndpointEntry>,
    /// The input, when it is a table (then `input` only names it).
    pub table_input: Option<TableIn>,
    /// The outputs, when they are tables (then `output` and `errors` only name them).
    pub table_output: Option<TableOut>,
    /// Input columns to carry to the output (all when `None`).
    pub keep_columns: Option<Vec<String>>,
    /// Answer the records through the provider's batch jobs instead of online calls.
    pub jobs: Option<crate::jobs::JobsMode>,
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

pub use crate::report::OUTPUT_CLOSED;
pub use crate::resume::table_state_name;

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
    // Said before anything is written (--mode batch; --mode auto runs a stream online).
    if live_input && settings.jobs.as_ref().is_some_and(|m| m.auto_min_records.is_none()) {
        return Err(stream_refused_for_jobs());
    }
    // Counted for the progress bar and the live page (their time left).
    let total = if settings.progress || settings.ui.is_some() { input.count()? } else { None };
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
        mut state_dir,
        mut recovered,
        cache,
        resuming,
        jobs_ledger,
        resumable,
        total,
        table_locks: _locks,
        ..
    } = resumed;
    // Counted also for a resumed run's report: one with nothing left keeps the earlier report.
    let total = match total {
        None if resuming && settings.report.is_some() && !input.live => input.count()?,
        total => total,
    };
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
            Some(task)
        }
        None => None,
    };
    let remaining = total.map(|t| t.saturating_sub(recovered.finished_count()));
    // The run watched: sampled into a time series (saved in the state directory), shown live
    // with --ui, and written as a report at the end.
    // A re-run with nothing left to do keeps the earlier run's series and report: written over,
    // the plots of the run that did the work were gone.
    let nothing_left = resuming && remaining == Some(0);
    let series_file = state_dir.as_ref().map(|s| s.file("series.json"));
    let series_path = series_file.clone().filter(|_| !nothing_left);
    // What batch jobs settled, as they settle (the live cost prices their tokens at the batch
    // share; the summary reads it at the end).
    let tally = Arc::new(std::sync::Mutex::new(crate::jobs::JobsTally::default()));
    let watch = (settings.ui.is_some() || settings.report.is_some()).then(|| {
        let cost = live_cost(Some(tally.clone()));
        let w = weir_runtime::dash::Watch::new(runtime.clone(), settings.output.display(), remaining, Some(cost));
        w.set_resumed(recovered.finished_count());
        let router = router.clone();
        w.stops_by(Box::new(move || router.stop_reason()));
        w
    });
    let sampler = watch.as_ref().map(|w| w.start(series_path.clone()));
    let ui_task = match (&watch, settings.ui) {
        (Some(w), Some(addr)) => {
            let (bound, task) = weir_runtime::dash::serve(addr, w.clone()).await.map_err(RunError::Usage)?;
            eprintln!("weir: live page on http://{bound}/");
            Some(task)
        }
        _ => None,
    };
    let progress = Progress::start(settings.progress, remaining, metrics.clone(), runtime.clone());
    let started = Instant::now();

    // Fed again with --resume-stream, the same records may come in another order or with
    // others between them: with --id-field, the id alone says a record is finished.
    let finished = Arc::new(std::mem::take(&mut recovered.finished));
    let skip = crate::input::Skip {
        finished: finished.clone(),
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
        if resumable || live_input {
            tokio::select! {
                _ = first_interrupt.wait_for(|n| *n >= 1) => {}
                _ = closed_input.wait_for(|c| *c) => {}
            }
        } else {
            std::future::pending::<()>().await;
        }
    };
    let work = input.records(settings.records.clone(), skip, input_stop);
    // --mode auto: jobs for a large input (or to re-attach to an earlier run's jobs), else online.
    let jobs_api =
        choose_jobs(&settings, jobs_api, &input, total, resuming && jobs_ledger.as_deref().is_some_and(has_jobs))
            .await?;
    let used_jobs = jobs_api.is_some();
    if used_jobs && settings.resume_stream {
        return Err(RunError::Usage(
            "--resume-stream cannot be used with batch jobs: a resumed batch run finds the records its jobs hold by \
             their input lines, which a stream fed again does not keep; run online (--mode online), or feed a file"
                .into(),
        ));
    }
    // A stream can be read only once: a batch run stopped part-way could not be resumed (its
    // records' lines cannot be read again), and a pipe left open would never end a job.
    if used_jobs && live_input {
        return Err(stream_refused_for_jobs());
    }
    let outcomes: futures::stream::LocalBoxStream<'_, Result<Outcome, std::io::Error>> =
        match (jobs_api, &settings.jobs, jobs_ledger.clone()) {
            (Some(sites), Some(mode), Some(ledger)) => crate::jobs::outcomes(
                work,
                crate::jobs::JobsRun {
                    driver: driver.clone(),
                    sites,
                    ledger,
                    fresh: !resuming,
                    mode: mode.clone(),
                    interrupts: interrupts.clone(),
                    progress: settings.progress,
                    max_concurrency: settings.max_concurrency,
                    tally: tally.clone(),
                    finished: crate::jobs::Finished { finished },
                    watch: watch.clone(),
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
        Stops { interrupts, output_closed, router: &router, progress: &progress, resumable },
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
    if let Some(task) = sampler {
        // Waited for, not only aborted: a save of the series it is making would race the
        // final one below (two writers of one temporary file; one failed with a warning).
        task.abort();
        let _ = task.await;
    }
    if let Some(w) = &watch {
        let how = match router.stop_reason() {
            _ if interrupted => "interrupted".to_string(),
            Some(r) => format!("stopped: {}", r.message),
            None => "finished".to_string(),
        };
        w.end(&how).await;
    }
    if let Some(task) = ui_task {
        task.abort();
    }
    runtime.shutdown().await;
    drop(cache);
    // A JSONL run's files as it leaves them, for the next run to see whether another run wrote
    // them since (see `StateDir::written_since`).
    if let (Some(sd), None, OutputPath::File(out), OutputPath::File(errs), true) =
        (&state_dir, &settings.table_output, &settings.output, &settings.errors, flushed.is_ok())
    {
        sd.note_closed(&[out, errs]);
    }
    let state_path = state_dir.take().map(|s| s.dir.display().to_string());
    if let Err(e) = flushed {
        fatal.get_or_insert(crate::drain::write_failed(&e, resumable));
    }
    if let Some(msg) = fatal {
        return Err(RunError::Fatal(msg));
    }
    if let Some(changed) = input.changed_while_read() {
        tracing::warn!("{changed}");
    }
    // What a resume has left to do: every record of the input not in either file. Counted from
    // the input when it is a file; a stream cannot be counted again.
    let stopped = interrupted || router.stop_reason().is_some();
    let unfinished = if !stopped {
        Some(0)
    } else if resumable {
        let done = recovered.results + recovered.errors + result_rows + error_rows;
        input.count()?.map(|t| t.saturating_sub(done))
    } else {
        Some(not_written)
    };
    // Every row written: the jobs' spools hold nothing a resumed run needs.
    if let (true, Some(0), 0, Some(ledger)) = (used_jobs, unfinished, not_written, &jobs_ledger) {
        if let Err(e) = weir_jobs::Spool::remove_all(ledger) {
            tracing::warn!("could not remove the batch job spools of {}: {e}", ledger.display());
        }
    }
    // An interrupt that came once every record had its row (Ctrl-C while the last calls of
    // a batch run's online fallback finished) stopped nothing: the run is finished, not one to
    // resume (it exited 130 saying "0 records not finished; run the same command again").
    let cut_off = metrics.cut_off();
    // (Not over a stream: what it did not read is not counted.)
    let stop_reason = router.stop_reason().filter(|r| {
        !(r.kind == ErrorKind::Aborted
            && !live_input
            && r.message != OUTPUT_CLOSED
            && unfinished == Some(0)
            && not_written == 0
            && cut_off == 0)
    });
    let mut report = RunReport::new(
        &metrics,
        started.elapsed().max(Duration::from_micros(1)),
        stop_reason,
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
        .filter(|t| *t != crate::jobs::JobsTally::default());
    let batch_tokens = jobs.as_ref().map_or((0, 0), |j| j.tokens);
    // Tokens paid for by this run: not those of answers from the cache.
    let paid = metrics.paid_tokens();
    let online = (paid.0.saturating_sub(batch_tokens.0), paid.1.saturating_sub(batch_tokens.1));
    // Every model's endpoint but the run's own, and what each model's tokens cost.
    let endpoints = runtime.endpoints().await;
    if let Some(own) = endpoints.iter().find(|e| e.model == settings.model.to_string()) {
        report.sharing = own.sharing;
        report.shared_through = crate::report::shared_through(&settings.store);
        report.pool = own.pool.clone();
        report.unshared = own.unshared.clone();
    }
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
    if let Some(w) = &watch {
        let cost = (!report.costs.is_empty()).then(|| report.costs.iter().map(|c| c.usd).sum());
        let rows = weir_runtime::dash::EndRows {
            done: report.records,
            succeeded: report.succeeded,
            failed: report.failed,
            unfinished: report.unfinished,
            failures: report.failures.iter().map(|(k, n)| (k.as_str().to_string(), *n)).collect(),
        };
        w.finish(&report.summary(), cost, Some(&rows));
        if let Some(path) = &series_path {
            if let Err(e) = w.save(path) {
                tracing::warn!("could not save the run's series to {}: {e}", path.display());
            }
        }
        // With nothing left, a report asked at a new path is the earlier run's, from its series.
        let earlier = series_file
            .as_ref()
            .filter(|_| nothing_left)
            .and_then(|f| std::fs::read_to_string(f).ok())
            .and_then(|saved| weir_runtime::dash::report_of(&saved, false).ok());
        if let Some(path) = settings.report.as_ref().filter(|p| !(nothing_left && (p.exists() || earlier.is_none()))) {
            let input = match &settings.input {
                weir_io::InputPath::File(p) => Some(p.as_path()),
                weir_io::InputPath::Stdin => None,
            };
            let file = |o: &'_ OutputPath| match o {
                OutputPath::File(p) => Some(p.clone()),
                _ => None,
            };
            let outputs: Vec<PathBuf> =
                [file(&settings.output), file(&settings.errors)].into_iter().flatten().collect();
            let own: Vec<&std::path::Path> = input.into_iter().chain(outputs.iter().map(PathBuf::as_path)).collect();
            let html = earlier.unwrap_or_else(|| w.report());
            match weir_runtime::dash::write_report(path, &html, &own) {
                Ok(()) => report.html = Some(path.display().to_string()),
                Err(e) => eprintln!("weir: the report was not written: {e}"),
            }
        }
    }
    Ok(report)
}

/// The cost of the tokens paid for so far, each model's at its price and those `jobs` settled
/// at the batch share (`None`: no model of the run has a known price), for the live page.
pub fn live_cost(jobs: Option<Arc<std::sync::Mutex<crate::jobs::JobsTally>>>) -> weir_runtime::dash::CostOf {
    Arc::new(move |endpoints: &[weir_runtime::EndpointState]| {
        // Tokens of answers batch jobs settled are in their endpoint's counts too; they cost
        // the batch share (a run with jobs has one model).
        let mut batch = jobs.as_ref().map_or((0, 0), |t| t.lock().unwrap_or_else(|e| e.into_inner()).tokens);
        let costs: Vec<f64> = endpoints
            .iter()
            .filter_map(|e| {
                let paid = e.metrics.paid_tokens();
                let by_jobs = (batch.0.min(paid.0), batch.1.min(paid.1));
                batch = (batch.0 - by_jobs.0, batch.1 - by_jobs.1);
                let online = (paid.0 - by_jobs.0, paid.1 - by_jobs.1);
                crate::cost::Cost::estimate(&e.model, online, by_jobs).map(|c| c.usd)
            })
            .collect();
        (!costs.is_empty()).then(|| costs.iter().sum())
    })
}

/// A stream can be read only once: a batch run stopped part-way could not be resumed (its
/// records' lines cannot be read again), and a pipe left open would never fill a job.
fn stream_refused_for_jobs() -> RunError {
    RunError::Usage(
        "batch jobs need an input file: a stream (stdin, a pipe) cannot be read again to resume a stopped run, and a \
         job is cut only when its records are read; write the stream to a file and give --input FILE, or run online \
         (--mode online)"
            .into(),
    )
}

/// The process's endpoints (`weir_runtime`), with the run's limits and timeouts, connecting
/// with the keys `env` holds.
fn runtime_for(settings: &RunSettings, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Arc<weir_runtime::Runtime> {
    // The pool's own key variables too, and those an http/ models file reads.
    let http = weir_providers::webapi::variables(settings.provider.http_models.as_deref(), env);
    let names = weir_providers::ENV_VARS
        .iter()
        .copied()
        .chain(settings.pool.iter().filter_map(|e| e.key_env.as_deref()))
        .chain(http.iter().map(String::as_str));
    let env: HashMap<String, String> = names.filter_map(|k| env(k).map(|v| (k.to_string(), v))).collect();
    let connector: weir_runtime::Connector = Arc::new(move |spec, options| {
        let env = env.clone();
        Box::pin(async move { weir_runtime::connect(&spec, &options, &|k| env.get(k).cloned()).await })
    });
    let throttle = ThrottleSettings {
        max_concurrency: settings.max_concurrency,
        adaptive: settings.adaptive,
        rate: settings.rate.clone(),
        sre_k: settings.sre_k,
        store: settings.store.clone(),
    };
    let runtime_settings = weir_runtime::RuntimeSettings {
        provider: settings.provider.clone(),
        throttle,
        driver: settings.driver.clone(),
        cache: None,
        pool: settings.pool.clone(),
    };
    let runtime = weir_runtime::Runtime::with_connector(runtime_settings, connector);
    media_from_buckets(&runtime);
    runtime
}

/// Lets `runtime` read media in `gs://` and `s3://` buckets, through the tables' store clients
/// (their credentials and emulators), besides files and URLs: for `weir run`, `weir sql` and
/// cluster executors alike.
pub fn media_from_buckets(runtime: &weir_runtime::Runtime) {
    let buckets = weir_tables::BucketMedia::new(Arc::new(|k: &str| std::env::var(k).ok()));
    runtime.set_media(Arc::new(weir_runtime::media::Loader::new(Some(Arc::new(buckets)))));
}

/// The endpoints' batch-job APIs when the run asks for jobs (`--mode batch`, or `--mode auto`
/// where jobs are possible), after checking the command can use them.
fn jobs_api(
    settings: &RunSettings,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Option<Arc<weir_jobs::Sites>>, RunError> {
    Ok(match &settings.jobs {
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
            match job_sites(
                &settings.model,
                &settings.provider,
                &settings.pool,
                b.job_bucket.as_deref(),
                b.max_requests,
                env,
            )? {
                Ok(sites) => Some(Arc::new(sites)),
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
    jobs_api: Option<Arc<weir_jobs::Sites>>,
    input: &Input,
    total: Option<u64>,
    earlier_jobs: bool,
) -> Result<Option<Arc<weir_jobs::Sites>>, RunError> {
    Ok(match (&settings.jobs, jobs_api) {
        (Some(b), Some(api)) if b.auto_min_records.is_some() => {
            let min = b.auto_min_records.unwrap_or(0);
            let known = if total.is_none() { input.count()? } else { total };
            // A server without the Batch API (vLLM's OpenAI server, say) answers its routes 404.
            let available = match api.first().find(&weir_core::Sought::named("weir-probe")).await {
                Err(e) if matches!(e.kind, ErrorKind::BadRequest | ErrorKind::Endpoint) => {
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
                 --mode batch (it re-attaches to them), or `weir batch cancel` them and then start over with \
                 --fresh"
                    .into(),
            ))
        }
        (_, api) => api,
    })
}

/// Where the run's rows went, as its summary says it. A table output is a directory (or
/// prefix) of part files, the errors' too, whatever their names say: said, so that
/// `--errors e.jsonl` is not looked for as a file.
fn report_places(settings: &RunSettings) -> crate::report::Places {
    // One slash after the directory, however it was given (`s3://b/out.parquet/` said `…//`).
    let dir = |p: String| format!("{}/", p.trim_end_matches('/'));
    let (output, errors) = match &settings.table_output {
        Some(t) => (
            format!("{} (a table: {} part files)", dir(settings.output.display()), t.results_format.extension()),
            format!("{} (a table: {} part files)", dir(settings.errors.display()), t.errors_format.extension()),
        ),
        None => (settings.output.display(), settings.errors.display()),
    };
    let stream = settings.table_input.is_none()
        && match &settings.input {
            weir_io::InputPath::Stdin => true,
            weir_io::InputPath::File(p) => !settings.follow && weir_io::paths::is_stream(p),
        };
    crate::report::Places { output, errors, followed: settings.follow, stream }
}

/// Columns a CSV input keeps as text: the id field (`007` and `7` are different ids), and the
/// prompt and system fields (a prompt column whose values look like numbers is still text,
/// sent as written).
pub(crate) fn text_columns(settings: &RunSettings) -> Vec<String> {
    let prompt = match &settings.records.prompt {
        weir_core::record::PromptSource::Field(f) => Some(f.clone()),
        weir_core::record::PromptSource::Template(_) | weir_core::record::PromptSource::Unused => None,
    };
    settings.records.id_field.iter().cloned().chain(prompt).chain(settings.records.system_field.clone()).collect()
}

pub(crate) fn table_error(e: weir_tables::TableError) -> RunError {
    match e {
        weir_tables::TableError::Usage(m) => RunError::Usage(m),
        weir_tables::TableError::Unavailable(m) => RunError::Fatal(m),
    }
}

/// The batch-job APIs of `model`'s endpoints: the run's only one, or each of its pool's, with
/// the bucket each stages its jobs in (an entry's own, else the `--job-bucket` item in the
/// same place of a comma-separated list, else the one `--job-bucket`). The outer error is a
/// usage error; the inner one, that the provider has no jobs (which `--mode auto` survives).
pub fn job_sites(
    model: &ModelSpec,
    provider: &weir_providers::ProviderOptions,
    pool: &[weir_runtime::EndpointEntry],
    job_bucket: Option<&str>,
    max_requests: Option<usize>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Result<weir_jobs::Sites, weir_providers::ProviderError>, RunError> {
    let buckets: Vec<String> = job_bucket
        .map(|b| b.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect())
        .unwrap_or_default();
    let n = pool.len().max(1);
    if buckets.len() > 1 && buckets.len() != n {
        return Err(RunError::Usage(format!(
            "--job-bucket: {} prefixes for {n} endpoint(s); give one for each --location, in the same order, or one \
             for all",
            buckets.len()
        )));
    }
    let bucket_of = |i: usize, own: Option<&str>| -> Option<String> {
        own.map(str::to_string).or_else(|| buckets.get(if buckets.len() > 1 { i } else { 0 }).cloned())
    };
    if pool.is_empty() {
        let staging = job_staging(model, bucket_of(0, None).as_deref(), env).map_err(RunError::Usage)?;
        return Ok(weir_providers::connect_jobs(model, provider, env, max_requests, staging)
            .map(|api| weir_jobs::Sites::one(api, weir_runtime::endpoints::site_name(provider))));
    }
    let mut sites = Vec::new();
    for (i, entry) in pool.iter().enumerate() {
        let staging = job_staging(model, bucket_of(i, entry.job_bucket.as_deref()).as_deref(), env)
            .map_err(|e| RunError::Usage(format!("{}: {e}", entry.label(i))))?;
        match weir_providers::connect_jobs(model, &entry.provider(provider), env, max_requests, staging) {
            Ok(api) => sites.push(weir_jobs::Site {
                name: entry.site(provider),
                label: entry.label(i),
                api,
                weight: entry.weight.unwrap_or(1.0),
            }),
            Err(weir_providers::ProviderError::Config(m)) => {
                return Ok(Err(weir_providers::ProviderError::Config(format!("{}: {m}", entry.label(i)))))
            }
            Err(e) => return Ok(Err(e)),
        }
    }
    Ok(Ok(weir_jobs::Sites::pool(sites)))
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
    let bucket = url.strip_prefix("gs://").map(|rest| rest.split('/').next().unwrap_or(""));
    if bucket.is_none_or(str::is_empty) {
        return Err(format!("--job-bucket {url}: Vertex AI reads jobs from Cloud Storage; give gs://BUCKET/PREFIX"));
    }
    let staging = weir_tables::BucketStaging::open(url, env).map_err(|e| format!("--job-bucket {url}: {e}"))?;
    Ok(Some(Arc::new(staging)))
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
