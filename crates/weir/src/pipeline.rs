//! `weir run` as one stream chain:
//!
//! source lines → parse (bad rows become `invalid_input` failures) → duplicate-id check →
//! driver (gate → concurrency → timeout → provider call, retried per record) → outcome →
//! sink (results / errors).
//!
//! At most `max_concurrency` calls are in flight; at most `4 × max_concurrency` records are
//! between the source and the sinks (the rest are sleeping in backoff), so memory does not grow
//! with the input.

use futures::StreamExt;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use weir_core::{
    Driver, DriverSettings, ErrorKind, Failure, FixedLimit, ModelError, Outcome, Record, RecordSpec, RunMetrics,
};
use weir_io::{ErrorRow, InputPath, JsonlWriter, OutputPath, ResultRow};
use weir_providers::{ModelSpec, ProviderError, ProviderOptions};

use crate::report::{Progress, RunReport};

/// Everything `weir run` needs, validated.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// The model to call.
    pub model: ModelSpec,
    /// Provider options (base URL, simulator scenario).
    pub provider: ProviderOptions,
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
    /// Calls in flight at most.
    pub max_concurrency: usize,
    /// Show a progress bar on stderr.
    pub progress: bool,
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
}

impl From<ProviderError> for RunError {
    fn from(e: ProviderError) -> Self {
        match e {
            ProviderError::Config(m) => RunError::Usage(m),
            ProviderError::Start(m) => RunError::Fatal(m),
        }
    }
}

enum Work {
    Call(Record),
    Done(Box<Failure>),
    ReadError(std::io::Error),
}

fn fingerprint(id: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    h.finish()
}

/// Runs the whole job and reports what happened. `env` reads environment variables.
pub async fn run(settings: RunSettings, env: &dyn Fn(&str) -> Option<String>) -> Result<RunReport, RunError> {
    // Everything that can be wrong with the command is checked before any file is written.
    let total = match &settings.input {
        InputPath::File(p) => Some(
            weir_io::count_records(p)
                .map_err(|e| RunError::Usage(format!("cannot read --input {}: {e}", p.display())))?,
        ),
        InputPath::Stdin => None,
    };
    let reader = weir_io::source::open(&settings.input)
        .await
        .map_err(|e| RunError::Usage(format!("cannot open --input: {e}")))?;
    let endpoint = weir_providers::connect(&settings.model, &settings.provider, env).await?;
    let model_id = endpoint.handler.model_id().to_string();
    let open = |p: &OutputPath| {
        JsonlWriter::create(p).map_err(|e| RunError::Usage(format!("cannot create {}: {e}", p.display())))
    };
    let mut results = open(&settings.output)?;
    let mut errors = open(&settings.errors)?;

    let metrics = Arc::new(RunMetrics::default());
    let limit = Arc::new(FixedLimit::new(settings.max_concurrency));
    let driver = Arc::new(Driver::new(endpoint.handler.clone(), limit, settings.driver.clone(), metrics.clone()));
    let progress = Progress::start(settings.progress, total, metrics.clone());
    let started = Instant::now();

    let spec = settings.records.clone();
    let check_duplicates = spec.id_field.is_some();
    let mut seen: HashSet<u64> = HashSet::new();
    let work = weir_io::source::lines(reader).map(move |line| match line {
        Err(e) => Work::ReadError(e),
        Ok(raw) => match spec.parse(raw.line, &raw.bytes) {
            Err(failure) => Work::Done(failure),
            Ok(record) => {
                if check_duplicates && !seen.insert(fingerprint(&record.id)) {
                    let msg = format!("line {}: duplicate id '{}' (an earlier line has it)", record.line, record.id);
                    Work::Done(Box::new(Failure::of(record, ModelError::new(ErrorKind::InvalidInput, msg), 0)))
                } else {
                    Work::Call(record)
                }
            }
        },
    });
    let width = settings.max_concurrency.max(1) * 4;
    let outcomes = work
        .map(|w| {
            let driver = driver.clone();
            async move {
                match w {
                    Work::Call(record) => Ok(driver.run(record).await),
                    Work::Done(failure) => Ok(driver.reject(failure)),
                    Work::ReadError(e) => Err(e),
                }
            }
        })
        .buffer_unordered(width);
    tokio::pin!(outcomes);

    let mut fatal = None;
    while let Some(outcome) = outcomes.next().await {
        let written = match outcome {
            Ok(Outcome::Success(s)) => results.write(&ResultRow::of(&s, &model_id)),
            Ok(Outcome::Failure(f)) => errors.write(&ErrorRow::of(&f)),
            Err(e) => {
                fatal = Some(format!("reading the input failed: {e}"));
                break;
            }
        };
        if let Err(e) = written {
            fatal = Some(format!("writing rows failed: {e}"));
            break;
        }
        progress.tick();
    }
    let flushed = results.flush().and_then(|_| errors.flush());
    progress.finish();
    if let Some(sim) = endpoint.sim {
        sim.shutdown().await;
    }
    if let Err(e) = flushed {
        fatal.get_or_insert(format!("writing rows failed: {e}"));
    }
    if let Some(msg) = fatal {
        return Err(RunError::Fatal(msg));
    }
    Ok(RunReport::new(
        &metrics,
        started.elapsed().max(Duration::from_micros(1)),
        driver.stop_reason(),
        &settings,
        results.rows(),
        errors.rows(),
    ))
}
