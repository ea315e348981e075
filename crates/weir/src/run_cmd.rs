//! `weir run`: flags → validated settings → the pipeline → an exit status.

use clap::{Args, ValueEnum};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use weir::{RunError, RunSettings, StateMode, TableIn, TableOut};
use weir_core::{DriverSettings, GenParams, PromptSource, RecordSpec, Template};
use weir_io::{default_errors_path, InputPath, OutputPath};
use weir_providers::{ModelSpec, ProviderOptions};
use weir_sim::SimConfig;
use weir_tables::{Format, Location};

use crate::UsageError;
use weir_runtime::{ConcurrencyMode, EndpointArgs};

/// When to draw a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProgressMode {
    /// When stderr is a terminal.
    Auto,
    /// Always.
    Always,
    /// Never.
    Never,
}

/// How records are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// One call per record (or per batch of records), answered in seconds.
    Online,
    /// The provider's batch-prediction jobs: about half the price, answered within hours.
    Batch,
    /// Batch jobs when the input has at least --auto-min-records records and the provider has
    /// them (you accept the delay), online otherwise.
    Auto,
}

/// What happens to records no batch job answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FallbackArg {
    /// Error rows (retryable ones may be run again later).
    None,
    /// Online calls, at the online price.
    Online,
}

/// What to ask the model for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TaskArg {
    /// Text.
    Generate,
    /// An embedding vector.
    Embed,
}

/// Options of `weir run`.
#[derive(Debug, Args)]
#[command(
    after_help = "Models: sim/<name> (built-in simulator, no key), openai/<model> (any OpenAI-compatible server; \
--base-url or OPENAI_BASE_URL, key from OPENAI_API_KEY), gemini/<model> (key from GEMINI_API_KEY or GOOGLE_API_KEY), \
vertex_ai/<model> (Gemini on Vertex AI) and vertex_endpoint/<endpoint-id> (a model deployed to a Vertex AI endpoint), both \
with Google Application Default Credentials and --project/--location, anthropic/<model> (key from \
ANTHROPIC_API_KEY), http/<name> (any HTTP API, described in --http-models), local/<model> (in this process, when \
built with them).\n\n\
Exit status: 0 all records succeeded; 1 some records are in the errors file; 2 usage or configuration error; \
3 fatal error (e.g. credentials rejected, daily quota spent); 130 interrupted by Ctrl-C, 143 by SIGTERM; 141 the \
output's reader went away."
)]
pub struct RunArgs {
    /// What to ask the model for: `generate` (text) or `embed` (a vector per prompt, from an
    /// embedding model; many prompts per call).
    #[arg(long, value_enum, default_value_t = TaskArg::Generate)]
    task: TaskArg,
    /// The model, as provider/model: sim/demo, openai/gpt-4o-mini, gemini/gemini-2.5-flash.
    #[arg(long, value_name = "MODEL")]
    model: String,
    /// The field naming each record's own model (provider/model, e.g. to compare models in one
    /// run); records without it use --model. Each model gets a throttle of its own.
    #[arg(long, value_name = "FIELD")]
    model_field: Option<String>,
    /// The input: a JSONL, CSV or Parquet file, a glob or a directory of them, local or
    /// s3://BUCKET/… or gs://BUCKET/…; - reads JSONL from stdin (records are answered as they
    /// arrive, for as long as the pipe stays open).
    #[arg(long, value_name = "PATH", required_unless_present = "follow")]
    input: Option<String>,
    /// Instead of --input: a local JSONL file that keeps growing, followed as `tail -f` does —
    /// records are answered as lines are appended, until Ctrl-C (or SIGTERM) drains and stops
    /// the run; the same command resumes where it stopped.
    #[arg(long, value_name = "PATH", conflicts_with = "input")]
    follow: Option<String>,
    /// Stream each answer as it is generated: its pieces are written as events
    /// ({"id","seq","delta"}; {"id","seq","restart":true} when a cut call is made again) to
    /// --events, or between the rows with --output -, each record's events before its row.
    #[arg(long)]
    stream: bool,
    /// Where --stream writes its events: a JSONL file, or - for stdout [default: between the
    /// rows, when --output is -]. Implies --stream.
    #[arg(long, value_name = "PATH")]
    events: Option<String>,
    /// The input's format when its name does not say (jsonl, csv, parquet).
    #[arg(long, value_name = "FORMAT")]
    input_format: Option<String>,
    /// Where result rows go: a JSONL file (- writes stdout), or a table — a name ending in
    /// .parquet or .csv, a directory, or s3://… or gs://… — written as a directory of parts.
    #[arg(long, value_name = "PATH")]
    output: String,
    /// The output's format when its name does not say (jsonl, csv, parquet).
    #[arg(long, value_name = "FORMAT")]
    output_format: Option<String>,
    /// Where error rows go [default: beside the output, results.jsonl → results.errors.jsonl,
    /// s3://b/out.parquet → s3://b/out.errors.parquet]. Beside a table output (Parquet, CSV, a
    /// bucket) the errors are a table too: a directory of part files, `e.jsonl/part-00000.jsonl`,
    /// whatever the name.
    #[arg(long, value_name = "PATH")]
    errors: Option<String>,
    /// Input columns carried to the output, comma-separated [default: all of them]. The id
    /// field is always kept.
    #[arg(long, value_name = "A,B", value_delimiter = ',')]
    keep_columns: Option<Vec<String>>,
    /// CSV inputs: the character between fields (`;` for many European spreadsheets, `\t` for
    /// a tab).
    #[arg(long, value_name = "CHAR", default_value = ",")]
    csv_delimiter: String,
    /// Table outputs: a part is completed once it holds about this many MiB.
    #[arg(long, value_name = "MIB", default_value_t = 128)]
    part_mib: u64,
    /// Table outputs: completed parts are recorded (and a killed run resumes from them) at
    /// least this often, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    checkpoint_secs: f64,
    /// The field holding each record's id [default: the line number].
    #[arg(long, value_name = "FIELD")]
    id_field: Option<String>,
    /// The field holding the prompt.
    #[arg(long, value_name = "FIELD", default_value = "prompt", conflicts_with = "template")]
    prompt_field: String,
    /// Build the prompt from fields: "Summarise: {text}" ({{ and }} are literal braces).
    #[arg(long, value_name = "TEMPLATE")]
    template: Option<String>,
    /// System instructions sent with every prompt.
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// A generation parameter, KEY=VALUE (repeatable): temperature, top_p, top_k, max_tokens,
    /// seed, stop, presence_penalty, frequency_penalty, response_schema (JSON or @FILE),
    /// response_mime_type.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    params: Vec<String>,
    /// A string field holding each record's own system instructions (used instead of
    /// --system where the field is set).
    #[arg(long, value_name = "FIELD")]
    system_field: Option<String>,
    /// An object field holding each record's own parameters, e.g. {"temperature": 0.9}, laid
    /// over the --param values where the field is set.
    #[arg(long, value_name = "FIELD")]
    params_field: Option<String>,
    /// A field naming an image, audio, video or document to send after the prompt: a file
    /// path, an https:// URL, a gs:// or s3:// object, or the bytes (a Parquet binary column)
    /// (repeat for several parts, sent in this order). Its type comes from the content;
    /// FIELD:TYPE gives it (scan:application/pdf). Read when the record is sent; a part that
    /// cannot be read or sent is that record's error, before any call.
    #[arg(long = "media-field", value_name = "FIELD[:TYPE]")]
    media_fields: Vec<String>,
    #[command(flatten)]
    pub(crate) endpoint: EndpointArgs,
    /// How vertex_endpoint/ models are called: `raw` (:predict with Model Garden vLLM prompt
    /// instances, many records per call), `chat` (:predict with one chatCompletions instance per
    /// call), `openai` (the endpoint's OpenAI-compatible chat/completions route), `rawpredict`
    /// (:rawPredict with an OpenAI chat body).
    #[arg(long, value_name = "FORMAT", default_value = "raw")]
    endpoint_format: String,
    /// Records per call at most, for endpoints that take many: --task embed (default: OpenAI
    /// 128, Gemini 100, Vertex AI 64, local 32) and vertex_endpoint/ raw :predict (default 16).
    #[arg(long, value_name = "N")]
    batch_size: Option<usize>,
    /// Estimated tokens per batched call at most (a record heavier than this goes alone).
    #[arg(long, value_name = "N")]
    batch_tokens: Option<u64>,
    /// The longest a record waits for others to fill its batch, in milliseconds.
    /// [default: 20]
    #[arg(long, value_name = "MS")]
    batch_linger_ms: Option<u64>,
    /// Group records of like length before cutting batches, so a batch computed together
    /// wastes little on padding: `auto` (buckets that double, ≤8, 9–16, 17–32, … tokens: the
    /// longest of a bucket at most twice its shortest); `auto:N` (N buckets at quantiles of the
    /// lengths seen so far); upper bounds in estimated tokens, e.g. 16,32,64,128,256,512; or
    /// `off` (arrival order). Applies only where records are batched [default: auto].
    #[arg(long, value_name = "SPEC")]
    buckets: Option<String>,
    /// Instead of buckets: collect N records (many times --batch-size), sort them by length,
    /// then cut batches.
    #[arg(long, value_name = "N", conflicts_with = "buckets")]
    sort_window: Option<usize>,
    /// Progress bar on stderr.
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    progress: ProgressMode,
    /// The state directory that makes the run resumable and holds the response cache
    /// [default: .weir/ beside the output].
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// Keep no state: no resume, no cache (rows are then written in large buffered blocks).
    #[arg(long, conflicts_with_all = ["state", "fresh", "retry_errors"])]
    no_state: bool,
    /// Start over: discard an earlier run's state and outputs (the response cache is kept).
    #[arg(long)]
    fresh: bool,
    /// Replace --output and --errors files that already hold rows this run did not write
    /// (weir refuses otherwise).
    #[arg(long)]
    overwrite: bool,
    /// Resume from a stream (stdin, a pipe) although weir cannot check that it carries the same
    /// data as the earlier run: with --id-field, records whose id is finished are skipped in any
    /// order; without it, those whose line is.
    #[arg(long, conflicts_with = "fresh")]
    resume_stream: bool,
    /// Do not use the response cache.
    #[arg(long)]
    no_cache: bool,
    /// Run again the records whose error rows are of a retryable kind (rate_limited, server,
    /// timeout, transport, malformed_response, invalid_output); those that succeed move to the output.
    #[arg(long, conflicts_with = "fresh")]
    retry_errors: bool,
    /// Serve the run's counters in the Prometheus text format at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR", value_parser = weir::metrics_server::listen_addr)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Serve a live page of the run at http://ADDR/: progress and time left, throughput
    /// against the endpoint's limit, refusals, concurrency, latency, tokens and cost, failures
    /// with examples. On this machine's loopback only; without ADDR, 127.0.0.1 and a free port
    /// (said on stderr).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0", value_parser = weir::metrics_server::listen_addr)]
    ui: Option<std::net::SocketAddr>,
    /// Where to write the run's report: the live page's plots and the summary, one HTML file
    /// that opens offline. Default: beside the output (OUTPUT.report.html); none when the
    /// output is stdout or in an object store, unless this is given.
    #[arg(long, value_name = "PATH", conflicts_with = "no_report")]
    report: Option<PathBuf>,
    /// Write no HTML report.
    #[arg(long)]
    no_report: bool,
    /// Scenario (TOML, as for `weir sim --config`) of the built-in simulator behind sim/ models.
    #[arg(long, value_name = "FILE")]
    sim_config: Option<PathBuf>,
    /// `batch`: answer through the provider's batch jobs (openai/, gemini/, vertex_ai/ and
    /// anthropic/ models) at about half the price; a stopped run re-attaches to its jobs.
    #[arg(long, value_enum, default_value_t = ModeArg::Online)]
    mode: ModeArg,
    /// With --mode auto: the fewest records that go to batch jobs.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    auto_min_records: u64,
    /// With --mode batch: what to do with records no job answered after every round.
    #[arg(long, value_enum, default_value_t = FallbackArg::None)]
    fallback: FallbackArg,
    /// With --mode batch: jobs per record at most (the first and its follow-ups).
    #[arg(long, value_name = "N", default_value_t = 3)]
    job_rounds: u32,
    /// With --mode batch: requests per job at most [default: the provider's limit, 50,000].
    #[arg(long, value_name = "N")]
    job_max_requests: Option<usize>,
    /// With --mode batch: jobs at the provider at once at most, per endpoint (providers limit
    /// the batch jobs running at once: Vertex AI per region); the other records wait here,
    /// queued, and go out as jobs end [default: no limit].
    #[arg(long, value_name = "N")]
    max_jobs: Option<usize>,
    /// With --mode batch: seconds before the first poll of a job; the interval doubles up to
    /// 60 s.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    poll_secs: f64,
    /// With --mode batch and a vertex_ai/ model: the Cloud Storage prefix (gs://BUCKET/PREFIX)
    /// where each job's input is written and Vertex AI writes its output. With several
    /// --location, one prefix for each, comma-separated in the same order (a bucket in each
    /// region), or one for all; an --endpoints entry may give its own (job_bucket).
    #[arg(long, value_name = "URL")]
    job_bucket: Option<String>,
}

impl RunArgs {
    /// Raw flags → validated settings; every problem is a usage error naming the flag.
    pub fn settings(&self) -> Result<RunSettings, UsageError> {
        let model: ModelSpec =
            self.model.parse().map_err(|e: weir_providers::ProviderError| UsageError(e.to_string()))?;
        let params =
            GenParams::from_specs(self.params.iter().map(String::as_str)).map_err(|e| UsageError(e.to_string()))?;
        if let Some(why) = model.refused_params(&params) {
            return Err(UsageError(why));
        }
        let mut prompt = match &self.template {
            Some(t) => PromptSource::Template(Template::parse(t).map_err(|e| UsageError(e.to_string()))?),
            None => PromptSource::Field(self.prompt_field.clone()),
        };
        if model.provider == weir_providers::Provider::Http {
            prompt = self.http_prompt(&model, prompt)?;
        }
        if self.mode == ModeArg::Online
            && (self.fallback != FallbackArg::None
                || self.job_max_requests.is_some()
                || self.max_jobs.is_some()
                || self.job_rounds != 3
                || self.job_bucket.is_some())
        {
            return Err(UsageError(
                "--fallback, --job-rounds, --job-max-requests, --max-jobs and --job-bucket apply to --mode batch; add \
                 --mode batch"
                    .into(),
            ));
        }
        if self.job_rounds == 0 || self.job_max_requests == Some(0) || self.max_jobs == Some(0) {
            return Err(UsageError("--job-rounds, --job-max-requests and --max-jobs must be at least 1".into()));
        }
        self.endpoint.check()?;
        if !(self.poll_secs.is_finite() && self.poll_secs > 0.0 && self.poll_secs <= 3600.0) {
            return Err(UsageError(format!(
                "--poll-secs {}: must be a number of seconds above 0 and at most 3600",
                self.poll_secs
            )));
        }
        for (flag, field) in [
            ("--id-field", self.id_field.as_ref()),
            ("--prompt-field", Some(&self.prompt_field)),
            ("--system-field", self.system_field.as_ref()),
            ("--params-field", self.params_field.as_ref()),
            ("--model-field", self.model_field.as_ref()),
        ] {
            if field.is_some_and(|f| f.trim().is_empty()) {
                return Err(UsageError(format!("{flag} needs a field name")));
            }
        }
        for f in &self.media_fields {
            let (_, mime) = weir_core::media::field_spec(f).map_err(|e| UsageError(format!("--media-field: {e}")))?;
            if let Some(why) = mime.and_then(|m| model.refused_media_type(&m)) {
                return Err(UsageError(format!("--media-field {f}: {why}")));
            }
        }
        if !self.media_fields.is_empty() {
            if self.task == TaskArg::Embed {
                return Err(UsageError("--media-field does not apply to --task embed (text embeddings only)".into()));
            }
            if model.provider == weir_providers::Provider::VertexEndpoint {
                return Err(UsageError(
                    "--media-field: vertex_endpoint/ models take text only; use gemini/, vertex_ai/ or openai/ models"
                        .into(),
                ));
            }
        }
        if let Some(addr) = self.ui {
            weir_runtime::dash::check_listen(addr).map_err(UsageError)?;
        }
        if let Some(path) = &self.report {
            // The errors file is the run's own too, also by default (beside the output).
            let errors = match &self.errors {
                Some(e) => OutputPath::parse(e),
                None => default_errors_path(&OutputPath::parse(&self.output)),
            };
            let errors = match &errors {
                OutputPath::File(p) => Some(p.as_path()),
                _ => None,
            };
            let own: Vec<&std::path::Path> = [Some(self.input()), Some(self.output.as_str()), self.events.as_deref()]
                .into_iter()
                .flatten()
                .map(std::path::Path::new)
                .chain(errors)
                .collect();
            weir_runtime::dash::check_report_path(path, &own).map_err(UsageError)?;
        }
        if let (Some(ui), Some(m)) = (self.ui, self.metrics_listen) {
            // Each is free alone; together they cannot both listen (found out after the run had
            // created its files, which a re-run then took for a run to resume).
            if ui.port() != 0
                && ui.port() == m.port()
                && (ui.ip() == m.ip() || ui.ip().is_unspecified() || m.ip().is_unspecified())
            {
                return Err(UsageError(format!(
                    "--ui {ui} and --metrics-listen {m}: the same address; give them different ports"
                )));
            }
        }
        if let Some(addr) = self.metrics_listen {
            // Found out before any file is created (the exporter binds it again later).
            std::net::TcpListener::bind(addr)
                .map_err(|e| UsageError(format!("--metrics-listen {addr}: cannot listen there ({e})")))?;
        }
        let endpoint_format: weir_providers::EndpointFormat =
            self.endpoint_format.parse().map_err(|e: weir_providers::ProviderError| UsageError(e.to_string()))?;
        if self.endpoint_format != "raw" && model.provider != weir_providers::Provider::VertexEndpoint {
            return Err(UsageError("--endpoint-format only applies to vertex_endpoint/ models".into()));
        }
        let embed = self.task == TaskArg::Embed;
        let task = if embed { weir_providers::Task::Embed } else { weir_providers::Task::Generate };
        let batchable = model.takes_batches(task, endpoint_format);
        if embed {
            for (flag, given) in [
                ("--param", !self.params.is_empty()),
                ("--system", self.system.is_some()),
                ("--system-field", self.system_field.is_some()),
                ("--params-field", self.params_field.is_some()),
            ] {
                if given {
                    return Err(UsageError(format!(
                        "{flag} does not apply to --task embed (an embedding takes the prompt text only)"
                    )));
                }
            }
        }
        if self.batch_size == Some(0) {
            return Err(UsageError("--batch-size must be at least 1".into()));
        }
        let bucketing = match (self.sort_window, parse_buckets(self.buckets.as_deref().unwrap_or("auto"))?) {
            (Some(0), _) => return Err(UsageError("--sort-window must be at least 1".into())),
            (Some(n), _) => weir_core::Bucketing::SortWindow(n),
            (None, b) => b,
        };
        if !batchable && self.model_field.is_none() {
            for (flag, given) in [
                ("--batch-size", self.batch_size.is_some_and(|n| n > 1)),
                ("--batch-tokens", self.batch_tokens.is_some()),
                ("--batch-linger-ms", self.batch_linger_ms.is_some()),
                ("--sort-window", self.sort_window.is_some()),
            ] {
                if given {
                    return Err(UsageError(format!(
                        "{flag}: {model} takes one record per call; batching applies to --task embed and to \
                         vertex_endpoint/ models called through :predict (--endpoint-format raw)"
                    )));
                }
            }
        }
        if !model.takes_response_schema(endpoint_format)
            && (params.response_schema.is_some() || params.response_mime_type.is_some())
        {
            return Err(UsageError(
                "--param response_schema / response_mime_type cannot be sent in a :predict instance; leave them out \
                 or call the endpoint's OpenAI-compatible route (--endpoint-format openai)"
                    .into(),
            ));
        }
        if self.batch_tokens == Some(0) {
            return Err(UsageError("--batch-tokens must be at least 1".into()));
        }
        let sim_config = match &self.sim_config {
            Some(path) => {
                if !self.model.starts_with("sim/") {
                    return Err(UsageError("--sim-config only applies to sim/ models".into()));
                }
                Some(SimConfig::from_file(path).map_err(|e| UsageError(e.to_string()))?)
            }
            None => None,
        };
        self.check_stream_and_follow(embed)?;
        let tables = self.tables()?;
        if tables.1.is_some() {
            let parts = self.table_parts(tables)?;
            return Ok(self.assemble(parts, model, params, prompt, sim_config, endpoint_format, embed, bucketing));
        }
        let output = OutputPath::parse(&self.output);
        let errors = match &self.errors {
            Some(e) => OutputPath::parse(e),
            None => default_errors_path(&output),
        };
        if errors == OutputPath::Stdout && output == OutputPath::Stdout {
            return Err(UsageError("--output and --errors cannot both be stdout".into()));
        }
        let input = InputPath::parse(self.input());
        check_distinct_files(&input, &output, &errors, self.errors.is_some(), self.events_path(&output).as_ref())?;
        let progress = self.progress();
        let state = if self.no_state {
            StateMode::Off
        } else {
            match (&self.state, &output) {
                (Some(_), OutputPath::Stdout | OutputPath::Stream(_)) => {
                    return Err(UsageError(
                        "--state needs --output to be a regular file (a resumed run appends to it)".into(),
                    ))
                }
                (Some(dir), _) => StateMode::Dir(dir.clone()),
                (None, OutputPath::File(p)) => StateMode::Dir(weir_io::state::default_dir(p)),
                (None, OutputPath::Stdout | OutputPath::Stream(_)) => {
                    if self.fresh || self.retry_errors {
                        return Err(UsageError("--fresh and --retry-errors need --output to be a regular file".into()));
                    }
                    StateMode::Off
                }
            }
        };
        if let StateMode::Dir(dir) = &state {
            // An output inside the state directory could overwrite a run's state or the cache.
            let inside = |p: &std::path::Path| match (
                std::fs::canonicalize(weir_io::paths::parent_dir(p)),
                std::fs::canonicalize(dir),
            ) {
                (Ok(parent), Ok(d)) => parent.starts_with(d),
                _ => false,
            };
            let report = self.report.as_ref().map(|p| OutputPath::File(p.clone()));
            for (flag, p) in [("--output", Some(&output)), ("--errors", Some(&errors)), ("--report", report.as_ref())] {
                if let Some(OutputPath::File(p)) = p {
                    if inside(p) {
                        return Err(UsageError(format!(
                            "{flag} {}: is inside the state directory {}; choose a path outside it",
                            p.display(),
                            dir.display()
                        )));
                    }
                }
            }
        }
        if state != StateMode::Off && !errors.is_file() {
            return Err(UsageError("a resumable run needs --errors to be a regular file (or use --no-state)".into()));
        }
        let parts = Parts { input, output, errors, state, tables, progress };
        Ok(self.assemble(parts, model, params, prompt, sim_config, endpoint_format, embed, bucketing))
    }

    /// An http/ model takes what its models file's templates name and nothing else: flags that
    /// would shape another provider's request are refused rather than ignored, and a model whose
    /// templates name no `{prompt}` needs no prompt field.
    fn http_prompt(&self, model: &ModelSpec, prompt: PromptSource) -> Result<PromptSource, UsageError> {
        let not_here = |flag: &str, instead: &str| {
            let verb = if flag.contains(" and ") { "do" } else { "does" };
            Err(UsageError(format!("{flag} {verb} not apply to {model}: {instead}")))
        };
        let given = |flags: &[(&str, bool)]| {
            let named: Vec<&str> = flags.iter().filter(|f| f.1).map(|f| f.0).collect();
            match named.split_last() {
                Some((last, [])) => Some(last.to_string()),
                Some((last, rest)) => Some(format!("{} and {last}", rest.join(", "))),
                None => None,
            }
        };
        if let Some(flags) = given(&[
            ("--base-url", !self.endpoint.base_url.is_empty()),
            ("--endpoints", self.endpoint.endpoints.is_some()),
            ("--project", self.endpoint.project.is_some()),
            ("--location", self.endpoint.location.is_some()),
        ]) {
            return not_here(&flags, "its url is in the models file");
        }
        if self.streaming() {
            return not_here(
                if self.stream { "--stream" } else { "--events" },
                "an http/ model's answer is read whole",
            );
        }
        if !self.media_fields.is_empty() {
            return not_here("--media-field", "an http/ model's request is the JSON body its template writes");
        }
        if self.task == TaskArg::Embed {
            return not_here("--task embed", "an http/ model's answer is the text at its answer pointer");
        }
        if self.params_field.is_some() {
            return not_here("--params-field", "an http/ model's request is its body in the models file");
        }
        let name = &model.model;
        let Some(names) = weir_providers::webapi::placeholders(name, self.endpoint.http_models.as_deref(), &|k| {
            std::env::var(k).ok()
        }) else {
            // The file is missing or wrong: connecting says what to fix.
            return Ok(prompt);
        };
        if (self.system.is_some() || self.system_field.is_some()) && !names.contains("system") {
            return not_here(
                if self.system.is_some() { "--system" } else { "--system-field" },
                "the model's url and body name no {system}",
            );
        }
        if names.contains("prompt") {
            return Ok(prompt);
        }
        match prompt {
            PromptSource::Template(_) => not_here("--template", "the model's url and body name no {prompt}"),
            PromptSource::Field(f) if f != "prompt" => {
                not_here("--prompt-field", "the model's url and body name no {prompt} (name the record's fields there)")
            }
            _ => Ok(PromptSource::Unused),
        }
    }

    /// Whether the run streams its answers.
    fn streaming(&self) -> bool {
        self.stream || self.events.is_some()
    }

    /// Where a streaming run's events go, when they have a path of their own: --events, unless
    /// it is stdout and so are the results (then they go between the rows).
    fn events_path(&self, output: &OutputPath) -> Option<OutputPath> {
        let events = OutputPath::parse(self.events.as_deref()?);
        (!(events == OutputPath::Stdout && *output == OutputPath::Stdout)).then_some(events)
    }

    /// What --stream, --events and --follow need of the other flags.
    fn check_stream_and_follow(&self, embed: bool) -> Result<(), UsageError> {
        if self.streaming() {
            if embed {
                return Err(UsageError(
                    "--stream/--events: an embedding comes whole, not as text; drop --stream and --events".into(),
                ));
            }
            if self.mode == ModeArg::Batch {
                return Err(UsageError(
                    "--stream/--events: batch jobs answer every record at once, hours later; drop --stream and \
                     --events, or --mode batch"
                        .into(),
                ));
            }
            if self.mode == ModeArg::Auto {
                eprintln!("weir: --mode auto with --stream: online calls (batch jobs cannot stream)");
            }
            if self.events.is_none() && OutputPath::parse(&self.output) != OutputPath::Stdout {
                return Err(UsageError(
                    "--stream writes each answer's pieces to --events PATH (or between the rows with --output -); \
                     add --events, e.g. --events events.jsonl"
                        .into(),
                ));
            }
        }
        if let Some(path) = &self.follow {
            let p = std::path::Path::new(path);
            if path.contains("://") {
                return Err(UsageError(format!(
                    "--follow {path}: weir follows a local file as it grows; read objects in a store with --input"
                )));
            }
            if path == "-" || weir_io::paths::is_stream(p) {
                return Err(UsageError(format!(
                    "--follow {path}: a pipe is read as it arrives already; use --input {path}"
                )));
            }
            if !p.is_file() {
                let why = if p.exists() { "is not a file" } else { "does not exist (create it, even empty, first)" };
                return Err(UsageError(format!("--follow {path}: {why}")));
            }
            if self.mode != ModeArg::Online {
                return Err(UsageError(
                    "--follow answers records as they are appended; batch jobs need the whole input (drop --mode)"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// The input as given, by --input or --follow.
    fn input(&self) -> &str {
        self.input.as_deref().or(self.follow.as_deref()).unwrap_or("-")
    }

    /// Whether to draw a progress bar.
    fn progress(&self) -> bool {
        match self.progress {
            ProgressMode::Always => true,
            ProgressMode::Never => false,
            ProgressMode::Auto => std::io::stderr().is_terminal(),
        }
    }

    /// The settings, once the input, outputs and state are decided.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        &self,
        parts: Parts,
        model: ModelSpec,
        params: GenParams,
        prompt: PromptSource,
        sim_config: Option<SimConfig>,
        endpoint_format: weir_providers::EndpointFormat,
        embed: bool,
        bucketing: weir_core::Bucketing,
    ) -> RunSettings {
        let Parts { input, output, errors, state, tables: (table_input, table_output), progress } = parts;
        let output_for_events = if table_output.is_some() { OutputPath::File(PathBuf::new()) } else { output.clone() };
        // The report beside a local output (a file, or a table's directory), unless told.
        let report = match (&self.report, self.no_report) {
            (_, true) => None,
            (Some(p), _) => Some(p.clone()),
            (None, false) => {
                let beside = |p: &std::path::Path| {
                    let mut name = p.as_os_str().to_owned();
                    name.push(".report.html");
                    PathBuf::from(name)
                };
                match (&table_output, &output) {
                    (Some(t), _) => t.results.local_path().map(|p| beside(&p)),
                    (None, OutputPath::File(p)) => Some(beside(p)),
                    (None, _) => None,
                }
            }
        };
        let keep_columns = self.keep_columns.as_ref().map(|cols| {
            let mut cols: Vec<String> = cols.iter().map(|c| c.trim().to_string()).filter(|c| !c.is_empty()).collect();
            if let Some(id) = &self.id_field {
                if !cols.contains(id) {
                    cols.push(id.clone());
                }
            }
            cols
        });
        // Checked with the other flags (`check`): an error here was reported already.
        let pool = self.endpoint.pool().unwrap_or_default();
        RunSettings {
            model,
            model_field: self.model_field.clone(),
            sim_config,
            provider: ProviderOptions {
                endpoint_format,
                max_batch: self.batch_size,
                task: if embed { weir_providers::Task::Embed } else { weir_providers::Task::Generate },
                ..self.endpoint.provider()
            },
            batch: weir_core::BatchSettings {
                max_items: 1,
                max_weight: self.batch_tokens.unwrap_or(u64::MAX),
                linger: Duration::from_millis(self.batch_linger_ms.unwrap_or(20)),
                bucketing,
            },
            input,
            output,
            errors,
            records: RecordSpec {
                system_field: self.system_field.clone(),
                params_field: self.params_field.clone(),
                media_fields: self.media_fields.iter().filter_map(|f| weir_core::media::field_spec(f).ok()).collect(),
                ..RecordSpec::new(self.id_field.clone(), prompt)
            },
            driver: DriverSettings {
                system: self.system.as_deref().map(Arc::from),
                params: Arc::new(params),
                ..self.endpoint.driver()
            },
            max_concurrency: self.endpoint.max_concurrency,
            progress,
            state,
            fresh: self.fresh,
            overwrite: self.overwrite,
            resume_stream: self.resume_stream,
            cache: !self.no_cache,
            retry_errors: self.retry_errors,
            drain: Duration::from_secs_f64(self.endpoint.timeout.min(30.0)),
            rate: self.endpoint.rate(),
            adaptive: self.endpoint.concurrency == ConcurrencyMode::Adaptive,
            sre_k: self.endpoint.sre_throttle,
            store: self.endpoint.throttle().store,
            metrics_listen: self.metrics_listen,
            ui: self.ui,
            report,
            pool: pool.clone(),
            table_input,
            table_output,
            keep_columns,
            stream: self.streaming().then(|| match self.events_path(&output_for_events) {
                Some(path) => weir::EventsTo::Path(path),
                None => weir::EventsTo::WithResults,
            }),
            follow: self.follow.is_some(),
            // --mode auto with --stream: streamed answers are online calls.
            jobs: (self.mode == ModeArg::Batch || (self.mode == ModeArg::Auto && !self.streaming())).then(|| {
                weir::jobs::JobsMode {
                    fallback_online: self.fallback == FallbackArg::Online,
                    jobs: weir_jobs::JobSettings {
                        rounds: self.job_rounds,
                        poll_first: Duration::from_secs_f64(self.poll_secs),
                        poll_max: Duration::from_secs_f64(self.poll_secs.max(60.0)),
                        name_prefix: job_prefix(&self.output),
                        max_jobs: self.max_jobs,
                        ..weir_jobs::JobSettings::default()
                    },
                    max_requests: self.job_max_requests,
                    job_bucket: self.job_bucket.clone(),
                    auto_min_records: (self.mode == ModeArg::Auto).then_some(self.auto_min_records),
                }
            }),
        }
    }

    /// Which of the input and the output are tables (anything but a local JSONL file or a
    /// stream), from their names and the format flags.
    fn tables(&self) -> Result<(Option<TableIn>, Option<TableOut>), UsageError> {
        let parse = |flag: &str, f: &Option<String>| {
            f.as_deref().map(|f| f.parse::<Format>().map_err(|e| UsageError(format!("{flag}: {e}")))).transpose()
        };
        let input_format = parse("--input-format", &self.input_format)?;
        let csv_delimiter = match self.csv_delimiter.as_str() {
            "\\t" | "tab" | "\t" => b'\t',
            d if d.len() == 1 && d.is_ascii() && !matches!(d, "\"" | "\n" | "\r") => d.as_bytes()[0],
            d => {
                return Err(UsageError(format!(
                    "--csv-delimiter '{d}': must be one ASCII character other than a quote or a newline, or '\\t' \
                     for a tab"
                )))
            }
        };
        let output_format = parse("--output-format", &self.output_format)?;
        let remote = |s: &str| s.starts_with("s3://") || s.starts_with("gs://");
        let globbed = |s: &str| s.contains(['*', '?', '[']) && !std::path::Path::new(s).exists();
        let table_in = if self.input() == "-" {
            if input_format.is_some_and(|f| f != Format::Jsonl) {
                return Err(UsageError("--input - reads JSONL; CSV and Parquet must be read from a file".into()));
            }
            None
        } else if remote(self.input())
            || input_format.is_some_and(|f| f != Format::Jsonl)
            || matches!(Format::from_name(self.input()), Some(Format::Csv | Format::Parquet))
            || std::path::Path::new(self.input()).is_dir()
            || globbed(self.input())
        {
            if let Some(path) = &self.follow {
                return Err(UsageError(format!(
                    "--follow {path}: weir follows a local JSONL file as it grows; read a table with --input"
                )));
            }
            // A FIFO or /dev/stdin can be read once, from the start: CSV's header is read twice
            // and Parquet's footer is at the end.
            let path = std::path::Path::new(self.input());
            let stream = !remote(self.input()) && weir_io::paths::is_stream(path) && !path.is_dir();
            if stream && input_format.or(Format::from_name(self.input())).is_some_and(|f| f != Format::Jsonl) {
                return Err(UsageError(format!(
                    "--input {}: is a stream (a pipe or a FIFO), which gives JSONL only; CSV and Parquet must be \
                     read from a file",
                    self.input()
                )));
            }
            Some(TableIn { spec: self.input().to_string(), format: input_format, csv_delimiter })
        } else {
            None
        };
        let named = Format::from_name(&self.output);
        let table_out = self.output != "-"
            && (remote(&self.output)
                || output_format.is_some_and(|f| f != Format::Jsonl)
                || matches!(named, Some(Format::Csv | Format::Parquet))
                || std::path::Path::new(&self.output).is_dir()
                || self.output.ends_with('/'));
        if !table_out {
            if output_format.is_some_and(|f| f != Format::Jsonl) {
                return Err(UsageError("--output - writes JSONL; write CSV or Parquet to a path".into()));
            }
            return Ok((table_in, None));
        }
        let results_format = output_format.or(named).ok_or_else(|| {
            UsageError(format!(
                "--output {}: cannot tell the format from the name; pass --output-format jsonl|csv|parquet",
                self.output
            ))
        })?;
        let results = Location::parse(&self.output).map_err(|e| UsageError(format!("--output {e}")))?;
        let (errors, errors_format) = match &self.errors {
            Some(e) if e == "-" => {
                return Err(UsageError("--errors -: a table output's errors are a table too; give a path".into()))
            }
            Some(e) => (
                Location::parse(e).map_err(|err| UsageError(format!("--errors {err}")))?,
                Format::from_name(e).unwrap_or(results_format),
            ),
            None => (
                Location::parse(&errors_beside(&self.output, results_format))
                    .map_err(|e| UsageError(format!("--errors {e}")))?,
                results_format,
            ),
        };
        if results.is_remote() && results.path.as_ref().is_empty() {
            return Err(UsageError(format!(
                "--output {}: a table is written under a path in the bucket, not at its root (e.g. {}/results.parquet)",
                self.output,
                self.output.trim_end_matches('/')
            )));
        }
        let within = |a: &Location, b: &Location| {
            a.scheme == b.scheme && a.bucket == b.bucket && a.path.prefix_match(&b.path).is_some()
        };
        if within(&errors, &results) || within(&results, &errors) {
            return Err(UsageError(
                "--errors and --output are one location, or one is inside the other (readers of one would read \
                 the other's rows); choose separate locations"
                    .into(),
            ));
        }
        if self.retry_errors {
            return Err(UsageError(
                "--retry-errors works with a JSONL output file; with a table output, run the error rows again as \
                 the input of a new run"
                    .into(),
            ));
        }
        if self.part_mib == 0 {
            return Err(UsageError("--part-mib must be at least 1".into()));
        }
        if !(self.checkpoint_secs.is_finite() && self.checkpoint_secs > 0.0) {
            return Err(UsageError(format!(
                "--checkpoint-secs {}: must be a number of seconds > 0",
                self.checkpoint_secs
            )));
        }
        Ok((
            table_in,
            Some(TableOut {
                results,
                results_format,
                errors,
                errors_format,
                part_bytes: self.part_mib * 1024 * 1024,
                checkpoint: Duration::from_secs_f64(self.checkpoint_secs),
            }),
        ))
    }

    /// The outputs and state of a run whose output is a table.
    fn table_parts(&self, tables: (Option<TableIn>, Option<TableOut>)) -> Result<Parts, UsageError> {
        let out = tables.1.as_ref().expect("a table output");
        let state = match (&self.state, self.no_state) {
            (_, true) => StateMode::Off,
            (Some(dir), _) => StateMode::Dir(dir.clone()),
            // Beside a local output; in the working directory for an object store's.
            (None, _) => match out.results.local_path() {
                Some(p) => StateMode::Dir(weir_io::state::default_dir(&p)),
                None => StateMode::Dir(PathBuf::from(".weir")),
            },
        };
        if let StateMode::Dir(dir) = &state {
            let d = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
            for (flag, l) in [("--output", &out.results), ("--errors", &out.errors)] {
                if l.local_path().is_some_and(|p| p.starts_with(&d)) {
                    return Err(UsageError(format!(
                        "{flag} {}: is inside the state directory {}; choose a path outside it",
                        l.display,
                        dir.display()
                    )));
                }
            }
        }
        Ok(Parts {
            input: InputPath::parse(self.input()),
            output: OutputPath::File(PathBuf::from(&out.results.display)),
            errors: OutputPath::File(PathBuf::from(&out.errors.display)),
            state,
            tables,
            progress: self.progress(),
        })
    }
}

/// What [`RunArgs::assemble`] puts together.
struct Parts {
    input: InputPath,
    output: OutputPath,
    errors: OutputPath,
    state: StateMode,
    tables: (Option<TableIn>, Option<TableOut>),
    progress: bool,
}

/// The prefix of a batch run's job names: weir, the output's name and the time the run
/// started, so that jobs of different runs on one account never share a name.
fn job_prefix(output: &str) -> String {
    let name: String = output
        .rsplit('/')
        .find(|s| !s.is_empty())
        .unwrap_or("out")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' })
        .take(40)
        .collect();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    // A token of this run's own, so that a job looked up by name (after a crash between
    // submitting it and recording its id) is never another run's: two runs writing outputs of
    // one name, started in the same second, had the same names (found by an outside tester:
    // a resumed run took the other's job and wrote its answers).
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    format!("weir-{name}-{}-{:08x}", now.as_secs(), h.finish() as u32)
}

/// The errors table beside a results table: `out.parquet` → `out.errors.parquet`,
/// `s3://b/results/` → `s3://b/results.errors`.
fn errors_beside(output: &str, format: Format) -> String {
    let trimmed = output.trim_end_matches('/');
    match trimmed.rsplit_once('.') {
        // The name's own extension, however it is spelled (`.pq`, `.ndjson`, `.PARQUET`).
        Some((stem, ext))
            if Format::from_name(trimmed) == Some(format) && !stem.ends_with('/') && !ext.contains('/') =>
        {
            format!("{stem}.errors.{ext}")
        }
        _ => format!("{trimmed}.errors"),
    }
}

/// `--buckets`: `off`, `auto`, `auto:N`, or ascending upper bounds in tokens.
fn parse_buckets(spec: &str) -> Result<weir_core::Bucketing, UsageError> {
    let bad = |why: &str| {
        UsageError(format!("--buckets {spec}: {why}; expected off, auto, auto:N or bounds in tokens like 16,64,256"))
    };
    Ok(match spec.trim() {
        "off" => weir_core::Bucketing::Off,
        "auto" => weir_core::Bucketing::Doubling,
        s if s.starts_with("auto:") => match s[5..].parse::<usize>() {
            Ok(n) if (2..=64).contains(&n) => weir_core::Bucketing::Auto(n),
            _ => return Err(bad("N must be a number from 2 to 64")),
        },
        s => {
            let bounds: Vec<u64> = s
                .split(',')
                .map(|b| b.trim().parse::<u64>())
                .collect::<Result<_, _>>()
                .map_err(|_| bad("not a list of numbers"))?;
            if bounds.is_empty() || bounds.contains(&0) || bounds.windows(2).any(|w| w[0] >= w[1]) {
                return Err(bad("bounds must be ascending numbers ≥ 1"));
            }
            weir_core::Bucketing::Fixed(bounds)
        }
    })
}

/// Refuses, before anything is opened for writing, a command in which two of the input, the
/// output and the errors file are one file under different spellings (`p.jsonl`, `./p.jsonl`,
/// a symlink): writing one would destroy or interleave the other.
fn check_distinct_files(
    input: &InputPath,
    output: &OutputPath,
    errors: &OutputPath,
    errors_given: bool,
    events: Option<&OutputPath>,
) -> Result<(), UsageError> {
    let mut files: Vec<(String, &std::path::Path)> = Vec::new();
    match input {
        InputPath::File(p) => files.push((format!("--input {}", p.display()), p)),
        // stdin redirected from a file (`< p.jsonl`) is that file.
        InputPath::Stdin => {
            let dev = std::path::Path::new("/dev/stdin");
            if std::fs::metadata(dev).is_ok_and(|m| m.is_file()) {
                files.push(("--input - (stdin, redirected from a file)".into(), dev));
            }
        }
    }
    match output {
        OutputPath::File(p) | OutputPath::Stream(p) => files.push((format!("--output {}", p.display()), p)),
        // stdout redirected to a file (`>> p.jsonl`) is that file: appending results to the
        // input would feed them back in without end.
        OutputPath::Stdout => {
            let dev = std::path::Path::new("/dev/stdout");
            if std::fs::metadata(dev).is_ok_and(|m| m.is_file()) {
                files.push(("--output - (stdout, redirected to a file)".into(), dev));
            }
        }
    }
    if let OutputPath::File(p) | OutputPath::Stream(p) = errors {
        let name =
            if errors_given { format!("--errors {}", p.display()) } else { format!("the errors file {}", p.display()) };
        files.push((name, p));
    }
    if let Some(OutputPath::File(p) | OutputPath::Stream(p)) = events {
        files.push((format!("--events {}", p.display()), p));
    }
    let ids: Vec<Option<weir_io::paths::FileId>> = files.iter().map(|(_, p)| weir_io::paths::file_id(p).ok()).collect();
    for i in 0..files.len() {
        for j in i + 1..files.len() {
            if ids[i].is_some() && ids[i] == ids[j] {
                return Err(UsageError(format!(
                    "{} and {} are the same file; writing one would destroy the other. Choose another path",
                    files[i].0, files[j].0
                )));
            }
        }
    }
    Ok(())
}

/// Runs the job; the exit status says how it went.
pub async fn run(args: RunArgs) -> anyhow::Result<u8> {
    let settings = args.settings()?;
    let env = |k: &str| std::env::var(k).ok();
    // Ctrl-C: the first press drains and stops (resumable); the second exits at once, which is
    // still resumable because every row already written is a whole line or a torn tail.
    // SIGTERM (a service manager stopping a long-lived run) counts as a press; a run it ends
    // exits 143 where Ctrl-C gives 130.
    let (tx, rx) = tokio::sync::watch::channel(0u32);
    let after_second = if settings.state == weir::StateMode::Off {
        "records in flight and rows not yet written have no row (this run keeps no state to resume from)"
    } else {
        "run the same command again to resume"
    };
    // A run stopped at once still gets its report, from the series saved last (at most 10 s
    // old): the end of the run is not in it.
    // (A table output's is left to `weir report`.)
    let saved_report = match (&settings.report, &settings.state, &settings.table_output) {
        (Some(to), weir::StateMode::Dir(dir), None) => Some((settings.output.display(), dir.clone(), to.clone())),
        _ => None,
    };
    let mut signals = crate::signals::StopSignals::new()?;
    let last = Arc::new(std::sync::Mutex::new(crate::signals::Stop::Interrupt));
    let seen = last.clone();
    let interrupted_status = move || seen.lock().unwrap_or_else(|e| e.into_inner()).exit_status();
    tokio::spawn(async move {
        let mut presses = 0;
        // Whether the first request to stop was SIGTERM (see `weir::BY_SIGTERM`).
        let mut by = 0;
        while let Some(stop) = signals.next().await {
            *last.lock().unwrap_or_else(|e| e.into_inner()) = stop;
            presses += 1;
            if presses == 1 && stop == crate::signals::Stop::Terminate {
                by = weir::BY_SIGTERM;
            }
            if presses >= 2 {
                eprintln!("weir: stopped at once; {after_second}");
                if let Some((output, dir, to)) = &saved_report {
                    match crate::report_cmd::rebuild(output, Some(dir.clone()), Some(to.clone()), true) {
                        Ok(to) => eprintln!(
                            "weir: report written to {} (from the series saved last: its last seconds are not in it)",
                            to.display()
                        ),
                        Err(e) => eprintln!("weir: no report: {e}"),
                    }
                }
                std::process::exit(stop.exit_status().into());
            }
            let _ = tx.send(presses | by);
        }
    });
    let report = match weir::run(settings, &env, rx).await {
        Ok(r) => r,
        Err(RunError::Usage(m)) => return Err(UsageError(m).into()),
        Err(RunError::Fatal(m)) => anyhow::bail!(m),
        Err(RunError::Interrupted(m)) => {
            eprintln!("weir: {m}");
            return Ok(interrupted_status());
        }
    };
    eprint!("{}", report.summary());
    Ok(if report.output_closed() {
        // As a process killed by SIGPIPE would (128 + 13), without losing the rows still due.
        141
    } else if report.interrupted() {
        interrupted_status()
    } else if report.stopped.is_some() {
        crate::exit::FATAL
    } else if report.total_failed() > 0 {
        1
    } else {
        0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two runs writing outputs of one name in the same second name their jobs apart (a job
    /// found by name after a crash must be the run's own).
    #[test]
    fn job_names_are_the_runs_own() {
        let (a, b) = (job_prefix("a/out.jsonl"), job_prefix("b/out.jsonl"));
        assert!(a.starts_with("weir-out-jsonl-") && b.starts_with("weir-out-jsonl-"), "{a} {b}");
        assert_ne!(a, b);
    }

    #[test]
    fn errors_sit_beside_the_results_whatever_the_extension() {
        assert_eq!(errors_beside("out.parquet", Format::Parquet), "out.errors.parquet");
        assert_eq!(errors_beside("out.pq", Format::Parquet), "out.errors.pq");
        assert_eq!(errors_beside("results.pq/", Format::Parquet), "results.errors.pq");
        assert_eq!(errors_beside("s3://b/x.ndjson", Format::Jsonl), "s3://b/x.errors.ndjson");
        assert_eq!(errors_beside("s3://b/results/", Format::Parquet), "s3://b/results.errors");
        assert_eq!(errors_beside("dir.v2/results", Format::Csv), "dir.v2/results.errors");
    }
}
