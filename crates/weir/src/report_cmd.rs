//! `weir report`: a run's HTML report rebuilt from the time series its state directory keeps
//! (after a run killed before it could write one, or to write it elsewhere).

use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

use crate::UsageError;

/// `weir report`'s arguments.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The run's --output; its series is in the state directory beside it.
    #[arg(long, value_name = "PATH")]
    output: String,
    /// The run's state directory, if `weir run` was given --state.
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// Where to write the report (default: beside the output, OUTPUT.report.html).
    #[arg(long, value_name = "PATH")]
    report: Option<PathBuf>,
}

/// Writes the report of the run `args` names.
pub async fn run(args: ReportArgs) -> anyhow::Result<u8> {
    let to = rebuild(&args.output, args.state, args.report, false)?;
    eprintln!("weir: report written to {}", to.display());
    Ok(0)
}

/// Writes the report of the run with `--output` `output` (and `--state` `state`) from the series
/// its state directory keeps, to `report` (default: beside the output); where it went. `ending`:
/// the run itself asks, as it stops at once (it holds its output's lock, and is not going on).
pub fn rebuild(output: &str, state: Option<PathBuf>, report: Option<PathBuf>, ending: bool) -> anyhow::Result<PathBuf> {
    let trimmed = output.trim_end_matches('/');
    let output_arg = output;
    let output = std::path::Path::new(trimmed);
    let dir = match (&state, trimmed.contains("://")) {
        (Some(d), _) => d.clone(),
        (None, true) => PathBuf::from(".weir"),
        (None, false) => weir_io::state::default_dir(output),
    };
    // Named as `weir run` names the output's state: a file's, or a table's.
    let mut names = vec![weir_io::state::output_state_name(output, &dir)];
    if let Ok(location) = weir_tables::Location::parse(output_arg) {
        names.push(weir::pipeline::table_state_name(&location));
    }
    let series = names.iter().map(|n| dir.join("runs").join(format!("{n}.series.json"))).find(|p| p.is_file());
    let Some(series) = series else {
        return Err(UsageError(format!(
            "no saved series of a run with --output {} in {} (a run keeps one in its state directory unless it had --no-state or --no-report, or was killed in its first second; give --state if the run had one)",
            output_arg,
            dir.display()
        ))
        .into());
    };
    let saved = std::fs::read_to_string(&series).with_context(|| format!("cannot read {}", series.display()))?;
    // A run still going holds its output's lock (a file's own, a table's `.weir.lock`).
    let running = !ending && [output.to_path_buf(), output.join(".weir.lock")].iter().any(|p| held_by_a_run(p));
    if running {
        // Its own report comes at its end, where the earlier run's is now: not written over.
        if report.is_none() {
            return Err(UsageError(format!(
                "the run of {output_arg} is still going, and writes its report at its end; for one as of its last \
                 save now, give --report PATH"
            ))
            .into());
        }
        eprintln!("weir: the run of {output_arg} is still going; the report shows it as of its last save");
    }
    let html =
        weir_runtime::dash::report_of(&saved, running).map_err(|e| UsageError(format!("{}: {e}", series.display())))?;
    let to = match report {
        Some(p) => p,
        None if trimmed.contains("://") => {
            return Err(UsageError("the output is in an object store: give --report PATH".into()).into())
        }
        None => PathBuf::from(format!("{trimmed}.report.html")),
    };
    let own = [output, series.as_path()];
    weir_runtime::dash::write_report(&to, &html, &own).map_err(UsageError)?;
    Ok(to)
}

/// Whether a run holds the lock of `path` (a run's output file, or a table's lock file): it is
/// still going. Before, `weir report` said a run it was asked about mid-way had been killed.
fn held_by_a_run(path: &std::path::Path) -> bool {
    let Ok(file) = std::fs::File::open(path) else { return false };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return false;
    }
    matches!(file.try_lock_shared(), Err(std::fs::TryLockError::WouldBlock))
}
