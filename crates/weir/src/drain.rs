//! The drain stage of `weir run`: outcomes become rows and go to the writer until the input
//! ends or the run is stopped (Ctrl-C, the output's reader gone); an interrupt lets the calls
//! in flight finish for `--drain` at most.

use futures::StreamExt;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use weir_core::{ErrorKind, Outcome, StopReason};

use crate::pipeline::{RunError, RunSettings, OUTPUT_CLOSED};
use crate::report::Progress;
use weir_runtime::Router;

/// Starts a run's drain, wherever it is waiting (for an outcome, on a blocked writer, for the
/// writer to finish): no new calls, for `why` (the stop reason the report tells it by), and
/// the calls in flight get `drain` more time.
pub(crate) fn start_drain(
    router: &Router,
    deadline: std::pin::Pin<&mut tokio::time::Sleep>,
    drain: Duration,
    why: &str,
) {
    router.stop(StopReason { kind: ErrorKind::Aborted, message: why.into() });
    deadline.reset(Instant::now() + drain);
}

/// The run's end when its rows could not be written (a full disk, `--output /dev/full`): what
/// failed, and what the records not written come to.
pub(crate) fn write_failed(e: &dyn std::fmt::Display, resumable: bool) -> String {
    if resumable {
        format!(
            "writing rows failed: {e}. The rows written are kept: mend the cause (free some space) and run the \
             same command again to resume"
        )
    } else {
        format!(
            "writing rows failed: {e}. This run keeps no state (--no-state, or nowhere beside the output to keep \
             it), so the records whose rows were not written have none: run it again once the cause is mended"
        )
    }
}

/// The end of an interrupted resumable run whose output's (or events') reader stopped reading:
/// the rows still queued for it are not written, and their records are not finished.
pub(crate) fn reader_not_reading() -> RunError {
    RunError::Interrupted(
        "stopped: a reader (of the output or of --events) did not take the rows still queued; their records are \
         not finished. Run the same command again to resume"
            .into(),
    )
}

/// What the drain stage hands on: the rows written, and how the run ended.
pub(crate) struct Drained {
    /// Result rows and error rows written by this run.
    pub(crate) rows: (u64, u64),
    /// Whether every row was made durable.
    pub(crate) flushed: std::io::Result<()>,
    /// The run was interrupted (Ctrl-C, or the output's reader went away).
    pub(crate) interrupted: bool,
    /// Records with no row, when the run keeps no journal (they are counted as unfinished).
    pub(crate) not_written: u64,
    /// Why the run failed, if it did (the input could not be read, rows could not be written).
    pub(crate) fatal: Option<String>,
}

/// What can stop the drain stage: an interrupt, the output's reader going away, and what it
/// stops (the router's calls; the progress bar it speaks over).
pub(crate) struct Stops<'a> {
    pub(crate) interrupts: watch::Receiver<u32>,
    pub(crate) output_closed: watch::Receiver<bool>,
    pub(crate) router: &'a Router,
    pub(crate) progress: &'a Progress,
    /// The run is resumable: records it stops on are simply not finished.
    pub(crate) resumable: bool,
}

/// Set in the count of requests to stop (the `interrupts` a run is given) when the first came
/// as SIGTERM rather than Ctrl-C: a run stopped by a service manager or `timeout` says so, and
/// does not tell whoever reads its log to press a key.
pub const BY_SIGTERM: u32 = 1 << 31;

/// How the stop was asked, and how to ask again to stop at once, from the count of requests.
fn asked(n: u32) -> (&'static str, &'static str) {
    if n & BY_SIGTERM != 0 {
        ("terminated (SIGTERM)", "Send SIGTERM again or press Ctrl-C")
    } else {
        ("interrupted", "Press Ctrl-C again")
    }
}

/// Takes outcomes to rows and hands them to the writer until the outcomes end, or the run
/// stops (an interrupt drains the calls in flight for `--drain` at most); then finishes the
/// writer. A reader that stops reading still lets Ctrl-C be heard.
pub(crate) async fn drain(
    // Boxed, so it can be dropped before the writer finishes: a call it still holds may hold a
    // sender of stream events, and the writer ends only when every sender is gone.
    mut outcomes: futures::stream::LocalBoxStream<'_, Result<Outcome, std::io::Error>>,
    writer: weir_io::RowWriter,
    stops: Stops<'_>,
    settings: &RunSettings,
) -> Result<Drained, RunError> {
    let Stops { mut interrupts, mut output_closed, router, progress, resumable } = stops;
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
                    let (what, again) = asked(*interrupts.borrow());
                    progress.suspend(|| eprintln!(
                        "weir: {what}; letting calls in flight finish (up to {} s). {again} to stop at once.",
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
            _ = &mut drain_deadline, if resumable => {
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
                if resumable
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
                        let (what, again) = asked(*interrupts.borrow());
                        if resumable {
                            progress.suspend(|| eprintln!(
                                "weir: {what} while a reader (of the output or of --events) is not reading; \
                                 waiting for it up to {} s. {again} to stop at once.",
                                settings.drain.as_secs()
                            ));
                        } else {
                            progress.suspend(|| eprintln!(
                                "weir: {what} while a reader (of the output or of --events) is not reading; \
                                 waiting for it: without a state directory, the rows it has not taken would be lost. \
                                 {again} to stop at once (they are lost then)."
                            ));
                        }
                        start_drain(router, drain_deadline.as_mut(), settings.drain, "interrupted");
                    }
                }
                // Only a resumable run gives up on a reader: its unwritten records are simply
                // not finished. Without a journal they would have no row at all.
                _ = &mut drain_deadline, if resumable => break None,
            }
        };
        match written {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                fatal = Some(write_failed(&e, resumable));
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
        // Said as it is said mid-run (a followed file's run ends its input at once, and
        // SIGTERM was then told only as "interrupted").
        let (what, _) = asked(*interrupts.borrow());
        progress.suspend(|| eprintln!("weir: {what}"));
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
                if interrupted && resumable => return Err(reader_not_reading()),
        }
    };
    Ok(Drained { rows: (result_rows, error_rows), flushed, interrupted, not_written, fatal })
}
