//! `weir sql`: SQL over tables with `llm_generate` and `llm_embed`, in DataFusion on this
//! machine (or on a Ballista cluster with the `cluster` feature), then the run's summary.

use anyhow::Context;
use clap::{Args, ValueEnum};
use futures::StreamExt;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;
use weir::report::thousands;
use weir_datafusion::datafusion;
use weir_datafusion::{Runtime, RuntimeSettings};

use datafusion::common::DataFusionError;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::UsageError;
use weir_runtime::EndpointArgs;

/// How result rows are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ResultFormat {
    /// An aligned text table.
    Table,
    /// One JSON object per row.
    Jsonl,
    /// Comma-separated values with a header.
    Csv,
}

/// Options of `weir sql`.
#[derive(Debug, Args)]
#[command(after_help = "Functions: llm_generate(model, prompt [, options]) → text, NULL when the call failed; \
llm_generate_result(model, prompt [, options]) → struct {response, finish_reason, error_kind, error_message, attempts, \
prompt_tokens, output_tokens, model}; llm_embed(model, text [, options]) → list of floats; llm_embed_result(…) → \
the same struct with embedding in place of response and finish_reason. options is a JSON object: the --param keys of \
weir run, system, and fail_on_error (true fails the query on the first failed row). A call written twice with the \
same arguments in one SELECT (or in a SELECT and its WHERE) is made once per row.\n\n\
Models and keys as for weir run: sim/<name>, openai/<model> (OPENAI_BASE_URL or --base-url, OPENAI_API_KEY), \
gemini/<model> (GEMINI_API_KEY), vertex_ai/<model> (--project/--location, Application Default Credentials).\n\n\
Exit status: 0 every call succeeded; 1 some rows' calls failed (their value is NULL); 2 a problem with the query or \
the flags; 3 the query failed while running; 130 interrupted (Ctrl-C; on a cluster the job is cancelled). On a \
cluster, 0 means the query finished: the executors make the calls, and their summaries and /metrics count the rows \
that failed (NULL in the result).")]
pub struct SqlArgs {
    /// The SQL to run (several statements separated by ';'); - reads it from stdin.
    #[arg(value_name = "SQL")]
    query: String,
    /// A table for the query, NAME=PATH (repeatable): a JSONL, CSV or Parquet file, a glob such
    /// as dir/*.parquet or a directory, local or s3://BUCKET/… or gs://BUCKET/….
    #[arg(long = "table", value_name = "NAME=PATH")]
    tables: Vec<String>,
    /// How result rows are printed on stdout (write files with COPY (SELECT …) TO 'PATH').
    #[arg(long, value_enum, default_value_t = ResultFormat::Table)]
    format: ResultFormat,
    /// Partitions a query runs in [default: the number of cores]; every partition's calls
    /// share one throttle per endpoint.
    #[arg(long, value_name = "N")]
    partitions: Option<usize>,
    /// Run the query on a Ballista cluster: the scheduler's address, df://HOST:PORT, or
    /// dfs://HOST:PORT to require mutual TLS (start it and its executors with weir cluster
    /// scheduler|executor; the executors call the models with their own flags and keys, so the
    /// endpoint flags here do not apply).
    #[arg(long, value_name = "URL")]
    cluster: Option<String>,
    #[command(flatten)]
    credentials: crate::credential_args::CredentialArgs,
    #[command(flatten)]
    endpoint: EndpointArgs,
    /// Scenario (TOML, as for `weir sim --config`) of the built-in simulator behind sim/ models.
    #[arg(long, value_name = "FILE")]
    sim_config: Option<PathBuf>,
    /// Where the response cache is kept [default: .weir/ in the working directory]. Answers of
    /// deterministic calls (temperature 0 or a seed, and embeddings' options alike) are reused
    /// by later queries instead of paid for again.
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// Do not use the response cache.
    #[arg(long)]
    no_cache: bool,
    /// Serve a live page of the query's model calls at http://ADDR/ (progress, throughput
    /// against the limit, refusals, latency, cost; see `weir run --ui`). On loopback only;
    /// without ADDR, 127.0.0.1 and a free port (said on stderr).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0", value_parser = weir::metrics_server::listen_addr)]
    ui: Option<std::net::SocketAddr>,
    /// Write a report of the query's model calls (plots over time and the summary, one HTML
    /// file that opens offline) to PATH.
    #[arg(long, value_name = "PATH")]
    report: Option<PathBuf>,
}

impl SqlArgs {
    /// The functions' settings from the flags.
    fn settings(&self) -> Result<RuntimeSettings, UsageError> {
        self.endpoint.check()?;
        if self.partitions == Some(0) {
            return Err(UsageError("--partitions must be at least 1".into()));
        }
        let provider = self.endpoint.provider();
        if let Some(path) = &self.sim_config {
            weir_runtime::sim::install(Some(
                weir_sim::SimConfig::from_file(path).map_err(|e| UsageError(e.to_string()))?,
            ));
        }
        Ok(RuntimeSettings {
            provider,
            throttle: self.endpoint.throttle(),
            driver: self.endpoint.driver(),
            cache: None,
            pool: self.endpoint.pool()?,
        })
    }

    /// The SQL text, from the argument or stdin.
    fn sql(&self) -> Result<String, UsageError> {
        let sql = if self.query == "-" {
            std::io::read_to_string(std::io::stdin()).map_err(|e| UsageError(format!("reading SQL from stdin: {e}")))?
        } else {
            self.query.clone()
        };
        if sql.trim().trim_matches(';').trim().is_empty() {
            return Err(UsageError("no SQL given: weir sql \"SELECT …\"".into()));
        }
        Ok(sql)
    }
}

/// Sets up this process's credentials for the cluster (TLS, token) when they are given; whether
/// TLS is on.
#[cfg(feature = "cluster")]
fn cluster_tls(credentials: &crate::credential_args::CredentialArgs) -> Result<bool, UsageError> {
    Ok(credentials.install()?.tls)
}

/// This build has no cluster, and so no credentials for one.
#[cfg(not(feature = "cluster"))]
fn cluster_tls(_credentials: &crate::credential_args::CredentialArgs) -> Result<bool, UsageError> {
    Ok(false)
}

/// A session on the cluster at `url`.
#[cfg(feature = "cluster")]
async fn cluster_session(url: &str, config: SessionConfig, functions: &Arc<Runtime>) -> anyhow::Result<SessionContext> {
    let port = weir_datafusion::scheduler_address(url).and_then(|rest| rest.rsplit_once(':')).map(|(_, port)| port);
    if port.is_none_or(|p| p.parse::<u16>().is_err()) {
        return Err(UsageError(format!(
            "--cluster {url}: expected the scheduler as df://HOST:PORT (the port is its --bind port, 50050 unless set)"
        ))
        .into());
    }
    match weir_datafusion::cluster::probe(url).await {
        Ok(()) => {}
        Err(
            e @ (weir_datafusion::cluster::ReachError::NotAScheduler { .. }
            | weir_datafusion::cluster::ReachError::Refused { .. }),
        ) => return Err(UsageError(e.to_string()).into()),
        Err(e) => return Err(anyhow::anyhow!(e)),
    }
    Ok(weir_datafusion::cluster::connect(url, config, functions)
        .await
        .map_err(|e| UsageError(format!("--cluster {e}")))?)
}

/// This build has no cluster support.
#[cfg(not(feature = "cluster"))]
async fn cluster_session(
    url: &str,
    _config: SessionConfig,
    _functions: &Arc<Runtime>,
) -> anyhow::Result<SessionContext> {
    Err(UsageError(format!(
        "--cluster {url}: this weir was built without the cluster; build it with: cargo build --release -p weir --features cluster"
    ))
    .into())
}

/// The plan of the statement running now, for [`waiting_notice`] to find its cluster job.
static RUNNING: std::sync::Mutex<Option<Arc<dyn datafusion::physical_plan::ExecutionPlan>>> =
    std::sync::Mutex::new(None);

/// On a cluster, says once after a while that the query is still running, and — when none of
/// its stages has finished — what it needs if no executor has joined; never ends (it is raced
/// against the query).
async fn waiting_notice(cluster: Option<&str>) {
    if let Some(url) = cluster {
        tokio::time::sleep(std::time::Duration::from_secs(20)).await;
        let host = weir_datafusion::scheduler_address(url).unwrap_or(url);
        let plan = RUNNING.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let job = plan.as_ref().and_then(weir_datafusion_job);
        let done = match &job {
            Some(job) => finished_stages(url, job).await,
            None => 0,
        };
        let which = job.map(|j| format!("job {j} ")).unwrap_or_default();
        if done > 0 {
            eprintln!("weir sql: {which}still running after 20 s on {url} ({done} of its stages finished)");
        } else {
            eprintln!(
                "weir sql: {which}still running after 20 s on {url}, none of its stages finished yet (if no \
                 executor has joined the scheduler, the query waits for one: weir cluster executor --scheduler \
                 {host})"
            );
        }
    }
    std::future::pending::<()>().await
}

/// The cluster job behind a running plan.
#[cfg(feature = "cluster")]
fn weir_datafusion_job(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> Option<String> {
    weir_datafusion::cluster::job_id(plan)
}

/// Without the cluster feature there is no job.
#[cfg(not(feature = "cluster"))]
fn weir_datafusion_job(_plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> Option<String> {
    None
}

/// The stages of a cluster job that finished (0 when the scheduler cannot say).
#[cfg(feature = "cluster")]
async fn finished_stages(url: &str, job: &str) -> usize {
    weir_datafusion::cluster::finished_stages(url, job).await.unwrap_or(0)
}

/// Without the cluster feature there is no job.
#[cfg(not(feature = "cluster"))]
async fn finished_stages(_url: &str, _job: &str) -> usize {
    0
}

/// DataFusion computes async functions (weir's calls) only in a projection or a filter; in a
/// window function or an ORDER BY it fails with an internal error that asks for a bug report,
/// before any call is made. Said as what to change instead (a usage error, exit 2).
fn where_calls_cannot_go(e: DataFusionError) -> DataFusionError {
    if e.to_string().contains("async functions should not be called directly") {
        DataFusionError::Plan(
            "llm_generate and llm_embed cannot be computed inside a window function (OVER …), an ORDER BY or a \
             join condition; compute the call in a subquery or a WITH clause and use its column there, e.g. WITH a \
             AS (SELECT *, llm_generate(…) AS answer FROM t) SELECT … FROM a ORDER BY answer (no model was called)"
                .into(),
        )
    } else {
        e
    }
}

/// An executor's planning error inside a failed cluster job: Ballista hands it back as the
/// text of its debug form (`…Plan("llm_generate options …: unknown parameter 'bogus'…")…`),
/// which `find_root` cannot open. Its message, unquoted.
fn cluster_plan_error(e: &DataFusionError) -> Option<String> {
    let text = e.to_string();
    let (_, rest) = text.split_once("Plan(\"")?;
    let mut out = String::new();
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// True for errors in the query or its inputs (exit status 2), not in running it.
fn is_usage(e: &DataFusionError) -> bool {
    // A cluster wraps the executor's planning error in layers find_root does not open.
    e.to_string().contains("Error during planning")
        || cluster_plan_error(e).is_some()
        || matches!(
            e.find_root(),
            DataFusionError::SQL(..)
                | DataFusionError::Plan(_)
                | DataFusionError::SchemaError(..)
                | DataFusionError::Configuration(_)
                | DataFusionError::NotImplemented(_)
        )
}

/// A usage error's message, with DataFusion's words for a call of weir's functions with
/// arguments of the wrong type (an "internal error" that asks for a bug report) replaced.
fn explain_usage(e: &DataFusionError) -> String {
    if let Some(message) = cluster_plan_error(e) {
        return message;
    }
    let text = e.to_string();
    let marker = "No function matches the given name and argument types '";
    if let Some(call) = text.split_once(marker).and_then(|(_, rest)| rest.split_once('\'')).map(|(call, _)| call) {
        if call.starts_with("llm_") {
            // Arguments: the types between the outer parentheses, split at commas outside
            // nested ones (a struct's fields).
            let inner = call.split_once('(').map_or("", |(_, r)| r.strip_suffix(')').unwrap_or(r));
            let (mut depth, mut n) = (0i32, usize::from(!inner.trim().is_empty()));
            for c in inner.chars() {
                match c {
                    '(' | '[' | '<' => depth += 1,
                    ')' | ']' | '>' => depth -= 1,
                    ',' if depth == 0 => n += 1,
                    _ => {}
                }
            }
            let name = call.split('(').next().unwrap_or(call);
            let most = weir_datafusion::MAX_MEDIA;
            let embed = name.starts_with("llm_embed");
            if embed && !(2..=3).contains(&n) {
                return format!(
                    "{name}: takes the model and the text, then optionally the options ({name}(model, text [, \
                     options])); it was given {n} argument{}",
                    if n == 1 { "" } else { "s" }
                );
            }
            if !(2..=3 + most).contains(&n) {
                return format!(
                    "{name}: takes the model and the prompt (or text), then optionally the options and up to \
                     {most} media ({name}(model, prompt [, options [, media …]])); it was given {n} argument{}",
                    if n == 1 { "" } else { "s" }
                );
            }
            return format!(
                "{call}: the model, the prompt (or text) and the options must be text (numbers, dates and times \
                 are cast); pick a field of a struct (r['response']) or cast the value: CAST(x AS VARCHAR)"
            );
        }
    }
    text
}

/// The response cache in `state` (default `.weir/` in the working directory). One process
/// holds a cache at a time: a second `weir sql` started beside a running one goes on without it,
/// and says so, rather than refusing to run.
fn open_cache(state: Option<&std::path::Path>) -> Result<Option<Arc<weir_io::DiskCache>>, UsageError> {
    let dir = state.map(PathBuf::from).unwrap_or_else(|| PathBuf::from(".weir"));
    let flag = if state.is_some() { "--state" } else { "the default state directory" };
    std::fs::create_dir_all(&dir).map_err(|e| UsageError(format!("{flag} {}: {e}", dir.display())))?;
    match weir_runtime::open_cache(&dir.join("cache")) {
        Ok(c) => Ok(Some(c)),
        Err(e) if e.in_use => {
            eprintln!(
                "weir sql: the response cache in {} is in use by another weir process; this query runs without it",
                dir.display()
            );
            Ok(None)
        }
        Err(e) => Err(UsageError(format!("{e}; or run with --no-cache"))),
    }
}

/// The error a statement stopped by Ctrl-C or SIGTERM ends with: the signal, so that the exit
/// status says which one it was.
#[derive(Debug)]
struct Stopped(crate::signals::Stop);

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            crate::signals::Stop::Interrupt => "interrupted",
            crate::signals::Stop::Terminate => "terminated",
        })
    }
}

impl std::error::Error for Stopped {}

/// The signal that stopped the statement that failed with `e`, if one did.
fn stopped_by(e: &DataFusionError) -> Option<crate::signals::Stop> {
    match e.find_root() {
        DataFusionError::External(inner) => inner.downcast_ref::<Stopped>().map(|s| s.0),
        _ => None,
    }
}

/// Ctrl-C or SIGTERM (`timeout`, a service manager, Kubernetes): either stops the statement the
/// same way — on a cluster, by cancelling its job, so that the executors stop calling models.
async fn stop_signal() -> crate::signals::Stop {
    match crate::signals::StopSignals::new() {
        Ok(mut s) => match s.next().await {
            Some(stop) => stop,
            None => std::future::pending().await,
        },
        Err(_) => std::future::pending().await,
    }
}

/// Runs `weir sql`; the exit status.
pub async fn run(mut args: SqlArgs) -> anyhow::Result<u8> {
    let settings = args.settings()?;
    let sql = args.sql()?;
    // dfs:// asks for mutual TLS; the flags (or their variables) give it, to df:// too.
    if let Some(url) = args.cluster.take() {
        let wants = url.starts_with("dfs://");
        let on = cluster_tls(&args.credentials)?;
        if wants && !on {
            return Err(UsageError(format!(
                "--cluster {url}: dfs:// is mutual TLS: give --tls-ca, --tls-cert and --tls-key (made with weir \
                 cluster certs)"
            ))
            .into());
        }
        // Kept as given, so that messages name it so (the connections read dfs:// as df://).
        args.cluster = Some(url);
    } else if args.credentials.given() {
        return Err(UsageError("--tls-ca, --tls-cert, --tls-key and --token-file are for --cluster".into()).into());
    }
    let mut config = SessionConfig::new().with_information_schema(true);
    if let Some(n) = args.partitions {
        config = config.with_target_partitions(n);
    }
    // The cluster's executors make the calls there (each with its own flags): no cache here.
    let cache = match (&args.cluster, args.no_cache) {
        (None, false) => open_cache(args.state.as_deref())?,
        (Some(_), _) | (None, true) => {
            if args.state.is_some() && args.cluster.is_some() {
                return Err(UsageError(
                    "--state is for queries run here; with --cluster the executors call the models".into(),
                )
                .into());
            }
            None
        }
    };
    if args.cluster.is_some() && (args.ui.is_some() || args.report.is_some()) {
        return Err(UsageError(
            "--ui and --report are for queries run here; with --cluster the executors call the models (each serves its counters with --metrics-listen)".into(),
        )
        .into());
    }
    if let Some(addr) = args.ui {
        weir_runtime::dash::check_listen(addr).map_err(UsageError)?;
    }
    if let Some(path) = &args.report {
        weir_runtime::dash::check_report_path(path, &table_paths(&args.tables)).map_err(UsageError)?;
    }
    let settings = RuntimeSettings { cache: cache.clone().map(|c| c as Arc<dyn weir_core::ResponseCache>), ..settings };
    let functions = Runtime::new(settings);
    // The query's calls watched: a live page (--ui) and a report (--report).
    let cost = Some(weir::pipeline::live_cost(None));
    let (watch, tasks) = match args.ui {
        Some(addr) => {
            let (w, tasks) = weir_runtime::dash::watch_and_serve(functions.clone(), "weir sql", cost, addr, "weir sql")
                .await
                .map_err(UsageError)?;
            (Some(w), tasks.into_iter().collect())
        }
        None if args.report.is_some() => {
            let w = weir_runtime::dash::Watch::new(functions.clone(), "weir sql", None, cost);
            let sampler = w.start(None);
            (Some(w), vec![sampler])
        }
        None => (None, Vec::new()),
    };
    weir::pipeline::media_from_buckets(&functions);
    let ctx = match &args.cluster {
        None => {
            let runtime = RuntimeEnvBuilder::new()
                .with_object_store_registry(Arc::new(weir_datafusion::tables::Stores::new()))
                .build_arc()
                .context("setting up DataFusion")?;
            let ctx = SessionContext::new_with_config_rt(config, runtime);
            weir_datafusion::register(&ctx, &functions);
            ctx
        }
        Some(url) => {
            if !args.endpoint.base_url.is_empty() || args.endpoint.endpoints.is_some() {
                eprintln!(
                    "weir sql: --base-url and --endpoints are not used with --cluster: the executors call the models with their own flags"
                );
            }
            cluster_session(url, config, &functions).await?
        }
    };
    // Files can be queried by name too: SELECT * FROM 'out.parquet'.
    let ctx = ctx.enable_url_table();
    weir_datafusion::tables::register_formats(&ctx).context("setting up DataFusion")?;
    for t in &args.tables {
        let (name, path) = weir_datafusion::tables::parse_table_arg(t).map_err(UsageError)?;
        weir_datafusion::tables::register_table(&ctx, &name, &path).await.map_err(UsageError)?;
    }
    let started = Instant::now();
    let result = tokio::select! {
        r = run_statements(&ctx, &sql, args.format, args.cluster.as_deref()) => r,
        // A cluster with no executor takes the query and waits for one, silently.
        _ = waiting_notice(args.cluster.as_deref()) => unreachable!("the notice never ends"),
    };
    if let Some(w) = &watch {
        let how = match &result {
            Ok(()) => "finished".to_string(),
            Err(e) if stopped_by(e).is_some() => "interrupted".to_string(),
            Err(_) => "failed".to_string(),
        };
        w.end(&how).await;
    }
    for task in tasks {
        task.abort();
    }
    match &args.cluster {
        None => {
            let text = summary(&functions, started.elapsed(), "weir sql").await;
            eprint!("{text}");
            if let (Some(w), Some(path)) = (&watch, &args.report) {
                w.finish(&text, None, None);
                match weir_runtime::dash::write_report(path, &w.report(), &table_paths(&args.tables)) {
                    Ok(()) => eprintln!("  report:  {}", path.display()),
                    Err(e) => eprintln!("weir sql: the report was not written: {e}"),
                }
            }
        }
        Some(_) if result.is_ok() => eprintln!(
            "weir sql: {:.2} s; the model calls ran on the cluster's executors (each prints its summary when \
             stopped and serves its counters with --metrics-listen; failed rows are NULL and counted there)",
            started.elapsed().as_secs_f64()
        ),
        Some(_) => {}
    }
    functions.shutdown().await;
    let failed: u64 = functions.metrics_by_model().values().map(|m| m.failed.load(Relaxed)).sum();
    // The cache's last answers reach the disk before the process ends: nothing may still hold
    // the engine (the functions in the session and the last plan) when the cache is dropped.
    *RUNNING.lock().unwrap_or_else(|e| e.into_inner()) = None;
    drop(ctx);
    drop(functions);
    drop(cache);
    match result {
        Ok(()) => Ok(if failed > 0 { 1 } else { 0 }),
        Err(e) if stopped_by(&e).is_some() => {
            eprintln!(
                "weir sql: interrupted; the statement did not finish (a COPY to a directory may have left some files)"
            );
            Ok(stopped_by(&e).map_or(130, crate::signals::Stop::exit_status))
        }
        Err(e) if is_usage(&e) => Err(UsageError(explain_usage(&e)).into()),
        Err(e) => Err(anyhow::anyhow!("the query failed: {e}")),
    }
}

/// Plans and runs each statement of `sql`, printing the rows of those that return some. A
/// statement interrupted by Ctrl-C or SIGTERM ends with [`Stopped`] (on a cluster, after asking the
/// scheduler to cancel its job); a COPY that did not finish leaves its target as it was.
async fn run_statements(
    ctx: &SessionContext,
    sql: &str,
    format: ResultFormat,
    cluster: Option<&str>,
) -> Result<(), DataFusionError> {
    let statements = datafusion::sql::parser::DFParser::parse_sql(sql)?;
    let many = statements.len() > 1;
    for (i, statement) in statements.into_iter().enumerate() {
        // With several statements, an error says which one (those before it have run).
        let which = |e: DataFusionError| if many { e.context(format!("statement {}", i + 1)) } else { e };
        run_statement(ctx, statement, format, cluster).await.map_err(where_calls_cannot_go).map_err(which)?;
    }
    Ok(())
}

/// Plans and runs one statement (see [`run_statements`]).
async fn run_statement(
    ctx: &SessionContext,
    mut statement: datafusion::sql::parser::Statement,
    format: ResultFormat,
    cluster: Option<&str>,
) -> Result<(), DataFusionError> {
    if cluster.is_some() {
        weir_datafusion::tables::alias_path_tables(&mut statement);
    }
    {
        let (plan, staged) = weir_datafusion::copy::prepare(ctx.state().statement_to_plan(statement).await?)?;
        if let Some(staged) = &staged {
            staged.preflight(ctx).await?;
        }
        let ran = async {
            let frame = ctx.execute_logical_plan(plan).await?;
            if format == ResultFormat::Csv {
                weir_datafusion::copy::check_csv(frame.schema(), "--format csv")?;
            }
            let task = Arc::new(frame.task_ctx());
            let physical = frame.create_physical_plan().await?;
            *RUNNING.lock().unwrap_or_else(|e| e.into_inner()) = Some(physical.clone());
            tokio::select! {
                r = async { print_rows(datafusion::physical_plan::execute_stream(physical.clone(), task)?, format).await } => {
                    if let (Ok(()), Some(url)) = (&r, cluster) {
                        tell_repeated_calls(url, &physical).await;
                    }
                    r
                }
                stop = stop_signal() => {
                    if let Some(url) = cluster {
                        cancel_on_cluster(url, &physical).await;
                    }
                    Err(DataFusionError::External(Box::new(Stopped(stop))))
                }
            }
        }
        .await;
        // Only a query the scheduler had taken (its job known) can have executors calling for it.
        let started =
            RUNNING.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(weir_datafusion_job).is_some();
        if let (Err(e), Some(url), true) = (&ran, cluster, started) {
            let text = e.to_string();
            // Killed mid-stream, the scheduler's connection can also end as a cancelled call
            // whose source is the closed connection (seen in CI).
            if ["tcp connect error", "Connection refused", "transport error", "connection reset", "connection closed"]
                .iter()
                .any(|t| text.contains(t))
            {
                eprintln!(
                    "weir sql: the scheduler at {url} stopped answering during the query; its executors stop the \
                     calls of the query's running tasks within about 15 s (their summaries count what was paid)"
                );
            }
        }
        match (ran, staged) {
            (Ok(()), Some(staged)) => staged.commit(ctx, cluster.is_some()).await?,
            (Ok(()), None) => {}
            (Err(e), Some(staged)) => {
                eprintln!("weir sql: the COPY did not finish; {} is as it was", staged.target());
                staged.abandon(ctx, cluster.map(|_| std::time::Duration::from_secs(2))).await;
                return Err(e);
            }
            (Err(e), None) => return Err(e),
        }
    }
    Ok(())
}

/// Cancels the cluster job of an interrupted statement, so its executors stop calling models.
#[cfg(feature = "cluster")]
async fn cancel_on_cluster(url: &str, plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) {
    match weir_datafusion::cluster::job_id(plan) {
        Some(job) => match weir_datafusion::cluster::cancel_job(url, &job).await {
            Ok(()) => eprintln!("weir sql: cancelled job {job} on {url}"),
            Err(e) => eprintln!("weir sql: could not cancel job {job} on {url} ({e}); its executors may go on calling"),
        },
        None => eprintln!("weir sql: the scheduler had not yet accepted the query; nothing to cancel"),
    }
}

/// Says how many rows of a finished cluster query were called again by tasks that ran twice (an
/// executor lost, a task failed): at most that many were paid for twice.
#[cfg(feature = "cluster")]
async fn tell_repeated_calls(url: &str, plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) {
    let Some(job) = weir_datafusion::cluster::job_id(plan) else { return };
    match weir_datafusion::cluster::rows_called_again(url, &job).await {
        Ok(0) => {}
        Ok(n) => eprintln!(
            "weir sql: up to {n} rows of job {job} were paid for twice: tasks covering {n} rows ran again (an \
             executor was lost, or a task failed or could not be started), and the rows their first attempt had \
             already called, between none and all of them, were called again (each executor's summary counts \
             its calls)"
        ),
        Err(e) => eprintln!("weir sql: could not ask {url} whether any task of job {job} ran twice ({e})"),
    }
}

/// Without the cluster feature no task runs twice.
#[cfg(not(feature = "cluster"))]
async fn tell_repeated_calls(_url: &str, _plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) {}

/// Without the cluster feature there is no cluster query to cancel.
#[cfg(not(feature = "cluster"))]
async fn cancel_on_cluster(_url: &str, _plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) {}

/// Writes a statement's rows to stdout.
async fn print_rows(
    mut stream: datafusion::execution::SendableRecordBatchStream,
    format: ResultFormat,
) -> Result<(), DataFusionError> {
    let out = std::io::stdout();
    match format {
        ResultFormat::Table => {
            let mut batches = Vec::new();
            while let Some(batch) = stream.next().await {
                batches.push(batch?);
            }
            if batches.is_empty() && !stream.schema().fields().is_empty() {
                // No rows: the header alone says the query ran and found none.
                batches.push(datafusion::arrow::array::RecordBatch::new_empty(stream.schema()));
            }
            if batches.iter().any(|b| b.num_columns() > 0) {
                let table = datafusion::arrow::util::pretty::pretty_format_batches(&batches)?;
                writeln!(out.lock(), "{table}")?;
            }
        }
        ResultFormat::Jsonl => {
            // NULL answers are written as null, not left out: a row's keys are the same every time.
            let mut writer = datafusion::arrow::json::WriterBuilder::new()
                .with_explicit_nulls(true)
                .build::<_, datafusion::arrow::json::writer::LineDelimited>(out.lock());
            while let Some(batch) = stream.next().await {
                writer.write(&batch?)?;
            }
            writer.finish()?;
        }
        ResultFormat::Csv => {
            let mut writer = datafusion::arrow::csv::Writer::new(out.lock());
            while let Some(batch) = stream.next().await {
                writer.write(&batch?)?;
            }
        }
    }
    Ok(())
}

/// The local files `--table NAME=PATH` names (a report must not be written over one).
fn table_paths(tables: &[String]) -> Vec<&std::path::Path> {
    tables.iter().filter_map(|t| t.split_once('=')).map(|(_, p)| std::path::Path::new(p)).collect()
}

/// The summary on stderr: per model, calls, refusals, tokens and cost.
pub(crate) async fn summary(functions: &Runtime, elapsed: std::time::Duration, who: &str) -> String {
    let models = functions.metrics_by_model();
    let endpoints = functions.endpoints().await;
    if models.is_empty() {
        return String::new();
    }
    let get = |f: fn(&weir_core::RunMetrics) -> u64| models.values().map(|m| f(m)).sum::<u64>();
    let (ok, failed) = (get(|m| m.succeeded.load(Relaxed)), get(|m| m.failed.load(Relaxed)));
    let mut s = format!(
        "{who}: {:.2} s; model calls for {} row{}: {} succeeded, {} failed\n",
        elapsed.as_secs_f64(),
        thousands(ok + failed),
        if ok + failed == 1 { "" } else { "s" },
        thousands(ok),
        thousands(failed)
    );
    for (model, m) in &models {
        // Tokens paid for: not those of answers from the cache.
        let (tin, tout) = m.paid_tokens();
        let hits = m.cache_hits.load(Relaxed);
        s.push_str(&format!(
            "  {model}: calls {} ({} retries, {} rate-limited, {:.1} s throttled); tokens {} in, {} out{}\n",
            thousands(m.calls.load(Relaxed)),
            thousands(m.retries.load(Relaxed)),
            thousands(m.rate_limited.load(Relaxed)),
            m.throttled_wall_micros.load(Relaxed) as f64 / 1e6,
            thousands(tin),
            thousands(tout),
            if hits > 0 { format!("; {} rows answered from the cache", thousands(hits)) } else { String::new() },
        ));
        if let Some(c) = weir::cost::Cost::estimate(model, (tin, tout), (0, 0)) {
            s.push_str(&c.line());
        }
        for e in endpoints.iter().filter(|e| &e.model == model) {
            s.push_str(&weir::report::pool_lines(&e.pool));
        }
        let kinds: Vec<String> = m.failures_by_kind().iter().map(|(k, n)| format!("{k} {}", thousands(*n))).collect();
        if !kinds.is_empty() {
            s.push_str(&format!(
                "  failed rows by kind: {} (llm_generate_result or llm_embed_result says why per row)\n",
                kinds.join(", ")
            ));
        }
    }
    if let Some(stop) = functions.stop_reason() {
        s.push_str(&format!("  stopped early ({}): {}\n", stop.kind, stop.message));
        // The stop's words are the runtime's, for a run that resumes; a statement does not.
        if stop.kind == weir_core::ErrorKind::QuotaExhausted {
            s.push_str(
                "  (a statement has no resume: run again, it calls again for every row whose answer is not in the \
                 response cache, which keeps those asked with temperature 0 or a seed; `weir run` resumes)\n",
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_executors_planning_error_is_a_usage_error_with_its_own_words() {
        // As a cluster's failed job gives it back (an unknown option key: exit 2, as on one
        // machine, not 3).
        let e = DataFusionError::Execution(
            "Job 038HW5SR5M000 failed: Job failed due to stage 1 failed: Task failed due to runtime execution \
             error: DataFusionError(Shared(External(DataFusionError(Plan(\"llm_generate options {\\\"bogus\\\": 1}: \
             unknown parameter 'bogus'\")))))"
                .into(),
        );
        assert!(is_usage(&e));
        assert_eq!(explain_usage(&e), "llm_generate options {\"bogus\": 1}: unknown parameter 'bogus'");
        let failed = DataFusionError::Execution("Job 1 failed: the endpoint refused the key".into());
        assert!(!is_usage(&failed));
    }
}
