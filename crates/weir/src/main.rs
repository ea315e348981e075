//! The `weir` binary: parses the command line, wires the library crates together and maps the
//! outcome to an exit status. Everything that does work lives in the library crates.

// Before the other modules, so that its `eprintln!` and `eprint!` are theirs.
#[macro_use]
mod stderr_lines;
mod batch_cmd;
#[cfg(feature = "cluster")]
mod cluster_cmd;
#[cfg(feature = "sql")]
mod credential_args;
mod report_cmd;
mod run_cmd;
mod signals;
mod sim_cmd;
#[cfg(feature = "sql")]
mod sql_cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// mimalloc, not the system allocator: glibc keeps a 64 MB arena per thread that allocated and
/// returns little of it, and a batch run's answers are parsed on one thread and freed on
/// another: at 10^7 records, three such arenas were most of its peak memory.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Run LLM inference over datasets at the endpoint's quota, never losing a record.
#[derive(Debug, Parser)]
#[command(name = "weir", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a model over every record of a dataset (JSONL, CSV or Parquet, local or in S3 or GCS); one result or error row per record.
    Run(Box<run_cmd::RunArgs>),
    /// Serve a simulated LLM endpoint (Gemini, Vertex AI, OpenAI and Anthropic wire formats) with quotas,
    /// latency and injected faults.
    Sim(Box<sim_cmd::SimArgs>),
    /// The provider batch jobs of `weir run --mode batch` runs: status, cancel, fetch.
    Batch(Box<batch_cmd::BatchArgs>),
    /// A run's HTML report (plots over time and the summary), rebuilt from its state directory.
    Report(Box<report_cmd::ReportArgs>),
    /// SQL over tables with llm_generate and llm_embed (Apache DataFusion).
    #[cfg(feature = "sql")]
    Sql(Box<sql_cmd::SqlArgs>),
    /// A Ballista cluster's scheduler and executors with weir's SQL functions.
    #[cfg(feature = "cluster")]
    Cluster(Box<cluster_cmd::ClusterArgs>),
    /// SQL over tables (this build has no SQL: build weir with --features sql).
    #[cfg(not(feature = "sql"))]
    #[command(disable_help_flag = true)]
    Sql {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
}

/// Exit statuses: 0 success, 1 some records failed, 2 usage or configuration error, 3 fatal.
pub(crate) mod exit {
    pub const USAGE: u8 = 2;
    pub const FATAL: u8 = 3;
}

/// An error that maps to exit status 2: the user must change the command or the config.
#[derive(Debug)]
pub(crate) struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

impl From<weir_runtime::SettingsError> for UsageError {
    fn from(e: weir_runtime::SettingsError) -> Self {
        Self(e.0)
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { exit::USAGE } else { 0 });
        }
    };
    init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weir: cannot start the async runtime: {e}");
            return ExitCode::from(exit::FATAL);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run_cmd::run(*args).await,
            Command::Sim(args) => sim_cmd::run(*args).await,
            Command::Batch(args) => batch_cmd::run(*args).await,
            Command::Report(args) => report_cmd::run(*args).await,
            #[cfg(feature = "sql")]
            Command::Sql(args) => sql_cmd::run(*args).await,
            #[cfg(feature = "cluster")]
            Command::Cluster(args) => cluster_cmd::run(*args).await,
            #[cfg(not(feature = "sql"))]
            Command::Sql { .. } => Err(UsageError(
                "this weir was built without SQL; build it with: cargo build --release -p weir --features sql".into(),
            )
            .into()),
        }
    });
    // Everything the command does has finished; what may remain is a read of stdin, which
    // tokio does on a blocking thread that cannot be cancelled: waiting for it would hang an
    // interrupted run over a pipe that stays open until the next line comes.
    runtime.shutdown_background();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            let usage = err.downcast_ref::<UsageError>().is_some();
            eprintln!("weir: error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::from(if usage { exit::USAGE } else { exit::FATAL })
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WEIR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colour codes only for a terminal: in a log file they are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A log line stderr could not take is lost, not said on stderr again: that second
        // write panicked when stderr's reader had gone away (exit 101, records unwritten).
        .log_internal_errors(false)
        .with_ansi(ansi)
        .with_target(false)
        .init();
}
