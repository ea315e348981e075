//! `weir batch status|cancel|fetch`: the jobs of `weir run --mode batch` runs, as their
//! ledgers in the state directory record them, or one job by its id.

use anyhow::Context;
use clap::{Args, Subcommand};
use std::path::PathBuf;
use weir_core::JobRef;
use weir_providers::{ModelSpec, ProviderOptions};

use crate::UsageError;

/// Jobs in flight: where they stand, cancel them, read one's results.
#[derive(Debug, Args)]
pub struct BatchArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Where each job of a batch run stands (asks the provider).
    Status(Target),
    /// Cancels the jobs of a batch run that have not ended; records they did not answer stay
    /// unfinished (a resumed run sends them again).
    Cancel(Target),
    /// Prints one job's results as JSONL on stdout: {"key", "text", "usage"} or {"key", "error"}.
    Fetch(FetchArgs),
}

/// Which provider: the same flags as the run's.
#[derive(Debug, Clone, Args)]
struct Site {
    /// The model of the run, as given to `weir run` (openai/…, gemini/…, vertex_ai/…, anthropic/…).
    #[arg(long, value_name = "MODEL")]
    model: String,
    /// The base URL given to `weir run`, if any (every one, for a pool of replicas).
    #[arg(long, value_name = "URL")]
    base_url: Vec<String>,
    /// Vertex AI: the project given to `weir run`, if any [default: GOOGLE_CLOUD_PROJECT].
    #[arg(long, value_name = "ID")]
    project: Option<String>,
    /// Vertex AI: the location given to `weir run`, if any [default: GOOGLE_CLOUD_LOCATION]
    /// (comma-separated, for a pool of locations).
    #[arg(long, value_name = "REGION")]
    location: Option<String>,
    /// The --endpoints file given to `weir run`, if any.
    #[arg(long, value_name = "FILE")]
    endpoints: Option<String>,
    /// Vertex AI: the --job-bucket given to `weir run` (where the jobs' output is read).
    #[arg(long, value_name = "URL")]
    job_bucket: Option<String>,
    /// The --task given to `weir run` (embedding jobs' results are read as vectors).
    #[arg(long, value_enum, default_value_t = crate::run_cmd::TaskArg::Generate)]
    task: crate::run_cmd::TaskArg,
}

/// Which provider and which run.
#[derive(Debug, Args)]
struct Target {
    #[command(flatten)]
    site: Site,
    /// The run's --output; its jobs are in the state directory beside it.
    #[arg(long, value_name = "PATH", required_unless_present = "state")]
    output: Option<String>,
    /// The run's state directory, if `weir run` was given --state (every run in it when
    /// --output is not given).
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct FetchArgs {
    #[command(flatten)]
    site: Site,
    /// The job's id, as `weir batch status` shows it.
    #[arg(long, value_name = "ID")]
    job: String,
}

/// The job APIs of the run's endpoints (one, or each of its pool's), as `weir run` made them.
fn connect(site: &Site) -> anyhow::Result<weir_jobs::Sites> {
    let spec: ModelSpec = site.model.parse().map_err(|e: weir_providers::ProviderError| UsageError(e.to_string()))?;
    let pool = weir_runtime::declared_pool(&site.base_url, site.location.as_deref(), site.endpoints.as_deref())
        .map_err(|e| UsageError(e.to_string()))?;
    let options = ProviderOptions {
        base_url: site.base_url.first().cloned(),
        project: site.project.clone(),
        location: if pool.is_empty() { site.location.clone() } else { None },
        task: match site.task {
            crate::run_cmd::TaskArg::Embed => weir_providers::Task::Embed,
            crate::run_cmd::TaskArg::Generate => weir_providers::Task::Generate,
        },
        ..Default::default()
    };
    let env = |k: &str| std::env::var(k).ok();
    match weir::pipeline::job_sites(&spec, &options, &pool, site.job_bucket.as_deref(), None, &env) {
        Ok(Ok(sites)) => Ok(sites),
        Ok(Err(e)) => Err(UsageError(e.to_string()).into()),
        Err(e) => Err(UsageError(e.to_string()).into()),
    }
}

/// The ledgers of the runs `t` names: the one of its `--output` (named as `weir run` names it,
/// for a file or a table output), or every one in the state directory.
fn ledgers(t: &Target) -> anyhow::Result<Vec<PathBuf>> {
    let dir = match (&t.state, &t.output) {
        (Some(d), _) => d.clone(),
        (None, Some(o)) if o.contains("://") => PathBuf::from(".weir"),
        (None, Some(o)) => weir_io::state::default_dir(std::path::Path::new(o.trim_end_matches('/'))),
        (None, None) => unreachable!("clap requires one"),
    };
    let runs = dir.join("runs");
    if !runs.is_dir() {
        return Err(UsageError(format!(
            "no batch runs in {} (give the run's --output, and --state if the run had one)",
            dir.display()
        ))
        .into());
    }
    let found: Vec<PathBuf> = match &t.output {
        Some(o) => {
            let path = std::path::Path::new(o.trim_end_matches('/'));
            let mut names = vec![weir_io::state::output_state_name(path, &dir)];
            if let Ok(location) = weir_tables::Location::parse(o) {
                names.push(weir::pipeline::table_state_name(&location));
            }
            names.iter().map(|n| weir_jobs::Ledger::path_in(&dir, n)).filter(|p| p.is_file()).collect()
        }
        None => {
            let mut all: Vec<PathBuf> = std::fs::read_dir(&runs)
                .with_context(|| format!("cannot read {}", runs.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.to_string_lossy().ends_with(".jobs.jsonl"))
                .collect();
            all.sort();
            all
        }
    };
    if found.is_empty() {
        return Err(UsageError(format!(
            "no batch jobs recorded in {} for {}; was the run made with --mode batch?",
            runs.display(),
            t.output.as_deref().unwrap_or("any output")
        ))
        .into());
    }
    Ok(found)
}

/// Runs the subcommand.
pub async fn run(args: BatchArgs) -> anyhow::Result<u8> {
    match args.action {
        Action::Status(t) => each_job(&t, false).await,
        Action::Cancel(t) => each_job(&t, true).await,
        Action::Fetch(f) => {
            let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ':');
            if f.job.is_empty() || f.job.contains("..") || !f.job.chars().all(plain) {
                return Err(UsageError(format!(
                    "--job '{}': not a job id (as `weir batch status` shows them: batch_…, batches/…, msgbatch_…)",
                    f.job
                ))
                .into());
            }
            let sites = connect(&f.site)?;
            let job = JobRef { id: f.job.clone(), file: None };
            // In a pool, the endpoint that knows the job (the first one's error, if none does).
            let (mut found, mut first_error) = (None, None);
            for site in sites.iter() {
                match site.api.status(&job).await {
                    Ok(s) => {
                        found = Some((site.api.clone(), s));
                        break;
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
            let (api, status) = found.ok_or_else(|| {
                anyhow::anyhow!("job {}: {}", f.job, first_error.map(|e| e.to_string()).unwrap_or_default())
            })?;
            if !status.state.is_terminal() {
                eprintln!("weir: job {} is {}; it has no results yet", f.job, status.state.as_str());
                return Ok(1);
            }
            // Each result printed as it is read; a write that fails ends the printing (`| head`:
            // the reader has what it wanted, and a broken pipe is no error).
            let mut out = std::io::stdout();
            let mut failed: Option<std::io::Error> = None;
            let mut printed = 0u64;
            let mut print = |(key, result): weir_core::JobResult| {
                if failed.is_some() {
                    return;
                }
                printed += 1;
                let line = match result {
                    Ok(r) if r.embedding.is_some() => serde_json::json!({"key": key, "embedding": r.embedding,
                        "usage": {"prompt_tokens": r.usage.prompt_tokens}}),
                    Ok(r) => serde_json::json!({"key": key, "text": r.text, "finish_reason": r.finish_reason,
                        "usage": {"prompt_tokens": r.usage.prompt_tokens, "output_tokens": r.usage.output_tokens}}),
                    Err(e) => serde_json::json!({"key": key, "error": {"kind": e.kind.as_str(), "message": e.message}}),
                };
                use std::io::Write;
                if let Err(e) = writeln!(out, "{line}") {
                    failed = Some(e);
                }
            };
            api.results(&job, &status, &mut print).await.map_err(|e| anyhow::anyhow!("job {}: {e}", f.job))?;
            if printed == 0 && status.completed > 0 {
                eprintln!(
                    "weir: job {} answered {} requests, but none of its results could be read{}",
                    f.job,
                    status.completed,
                    if f.site.task == crate::run_cmd::TaskArg::Generate {
                        " (an embedding job? give --task embed)"
                    } else {
                        ""
                    }
                );
                return Ok(1);
            }
            match failed {
                Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
                _ => Ok(0),
            }
        }
    }
}

/// Status (and cancel) of each job; exit 1 when the provider could not be asked about one.
async fn each_job(t: &Target, cancel: bool) -> anyhow::Result<u8> {
    let mut connected: Option<(Vec<String>, weir_jobs::Sites)> = None;
    let mut failed = false;
    for path in ledgers(t)? {
        // The run's jobs are at its model's provider: asked with another --model, another API
        // would be asked about ids it never made.
        let identity =
            path.to_str().and_then(|p| p.strip_suffix(".jobs.jsonl")).map(|p| PathBuf::from(format!("{p}.json")));
        let stored = identity
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice::<weir_io::state::RunIdentity>(&b).ok());
        let provider = |m: &str| m.split('/').next().unwrap_or_default().to_string();
        if let Some(stored) = stored.as_ref().filter(|s| provider(&s.model) != provider(&t.site.model)) {
            return Err(UsageError(format!(
                "{}: that run's jobs are {}'s (it ran --model {}): give --model {}",
                path.display(),
                stored.model.split('/').next().unwrap_or_default(),
                stored.model,
                stored.model
            ))
            .into());
        }
        // The run's jobs are at the base URL it recorded: without --base-url, that one (not the
        // provider's own, which a user in a hurry reached); with another, a job of the same id
        // there would be taken for this run's.
        let recorded = stored.as_ref().and_then(|s| s.base_url.clone()).filter(|_| t.site.endpoints.is_none());
        let base_url = match (&recorded, t.site.base_url.first()) {
            (Some(r), None) => vec![r.clone()],
            (Some(r), Some(given))
                if t.site.base_url.len() == 1
                    && weir_io::state::base_url_moved(&recorded, &Some(given.clone())).is_some() =>
            {
                return Err(UsageError(format!(
                    "{}: that run's jobs were submitted at --base-url {} (not {}): give that one",
                    path.display(),
                    weir_providers::http::shown_url(r),
                    weir_providers::http::shown_url(given)
                ))
                .into());
            }
            _ => t.site.base_url.clone(),
        };
        if connected.as_ref().is_none_or(|(b, _)| *b != base_url) {
            connected = Some((base_url.clone(), connect(&Site { base_url: base_url.clone(), ..t.site.clone() })?));
        }
        let sites = &connected.as_ref().expect("connected above").1;
        // Read only: the run may be appending to it.
        let chunks = weir_jobs::Ledger::read(&path).map_err(|e| anyhow::anyhow!(e))?;
        if !say(&format!("{}:", path.display()))? {
            return Ok(u8::from(failed));
        }
        for chunk in &chunks {
            let line = match job_line(sites, chunk, &chunks, cancel).await {
                Ok(line) => line,
                Err(line) => {
                    failed = true;
                    line
                }
            };
            if !say(&line)? {
                return Ok(u8::from(failed));
            }
        }
        let (spools, records) = weir_jobs::Spool::queued(&path, &chunks);
        if records > 0 {
            let line = format!(
                "  queued: {records} records in {spools} spool(s) waiting for a job (held back by --max-jobs, or \
                 still being read and cut)"
            );
            if !say(&line)? {
                return Ok(u8::from(failed));
            }
        }
    }
    Ok(u8::from(failed))
}

/// Prints `line` on stdout; false when the reader has gone (`| head`): it has what it wanted.
fn say(line: &str) -> anyhow::Result<bool> {
    use std::io::Write;
    match writeln!(std::io::stdout().lock(), "{line}") {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        r => r.map(|()| true).map_err(Into::into),
    }
}

/// One chunk's line of `weir batch status` (cancelling its job if `cancel`); an error line
/// when the provider could not be asked or the cancel failed.
async fn job_line(
    sites: &weir_jobs::Sites,
    chunk: &weir_jobs::Chunk,
    chunks: &[weir_jobs::Chunk],
    cancel: bool,
) -> Result<String, String> {
    let at = if chunk.site.is_empty() { String::new() } else { format!(" at {}", chunk.site) };
    if let Some(why) = &chunk.refused {
        return Ok(format!(
            "  chunk {}: {} records, refused{at} ({why}); no job was made and its records went to another endpoint",
            chunk.number, chunk.count
        ));
    }
    let api = sites.api_of(chunk).map_err(|e| format!("  chunk {}: cannot ask the provider: {e}", chunk.number))?;
    let (job, found) = match &chunk.job {
        Some(job) => (job.clone(), ""),
        // The run stopped while submitting it: the provider may have it under its name.
        None => match api.find(&chunk.sought(chunks)).await {
            Ok(Some(job)) => (job, " (not recorded as submitted; found at the provider)"),
            Ok(None) => {
                return Ok(format!(
                    "  chunk {}: {} records, not submitted{at} (name {}); a resumed run sends them",
                    chunk.number, chunk.count, chunk.name
                ))
            }
            Err(e) => {
                return Err(format!(
                    "  chunk {}: {} records, not recorded as submitted{at} (name {}); cannot ask the provider: {e}",
                    chunk.number, chunk.count, chunk.name
                ))
            }
        },
    };
    let status = api.status(&job).await.map_err(|e| format!("  {}: cannot ask the provider: {e}", job.id))?;
    let mut line = format!(
        "  {}: {} — {} of {} answered, {} failed ({} records, round {}{at}){found}",
        job.id,
        status.state.as_str(),
        status.completed,
        status.total,
        status.failed,
        chunk.count,
        chunk.round + 1
    );
    if let Some(m) = &status.message {
        line.push_str(&format!(": {m}"));
    }
    if cancel && !status.state.is_terminal() {
        match api.cancel(&job).await {
            Ok(()) => line.push_str(" — cancel requested"),
            Err(e) => return Err(format!("{line} — cancel failed: {e}")),
        }
    }
    Ok(line)
}
