//! The resume stage of `weir run`: the output files claimed (locked against other runs, never
//! truncated before the run is sure to start), the state directory opened (an earlier run of
//! another command refused, one of the same command resumed), and what that earlier run
//! finished recovered; a refusal leaves nothing behind.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use weir_core::PromptSource;
use weir_io::state::{self, RunIdentity};
use weir_io::{DiskCache, InputPath, OutputPath};

use crate::input::Input;
use crate::pipeline::{table_error, EventsTo, RunError, RunSettings, StateMode};

/// Output files this run created, each with a handle that keeps its lock: removed on drop
/// unless the run started (then it clears them), so a refused command leaves nothing behind.
/// Only a file this run made and still holds is removed; a file another run made or holds is
/// never touched, even when both started at the same moment.
#[derive(Default)]
pub(crate) struct Created(pub(crate) Vec<(PathBuf, std::fs::File)>);

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

/// Opens an output that is not a table: a file (locked, never truncated here, and noted in
/// `created` if this run made it), or a FIFO (locked too) or a device, written to as it is
/// (never truncated or read back); `None` for stdout.
pub(crate) async fn claim_path(
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
pub(crate) fn open_fifo_if_read(path: &std::path::Path) -> std::io::Result<Option<std::fs::File>> {
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
pub(crate) async fn wait_until<T>(
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
pub(crate) async fn wait_for_first_line(
    path: &std::path::Path,
    interrupts: &watch::Receiver<u32>,
) -> Result<String, RunError> {
    let what = format!("the first line of {} (a followed file is known by it)", path.display());
    wait_until(interrupts, Duration::from_millis(50), &what, || {
        weir_io::source::followed_identity(path)
            .map_err(|e| RunError::Usage(format!("cannot read --follow {}: {e}", path.display())))
    })
    .await
}

/// Refuses to replace files that hold rows this run did not write (a file weir is resuming is
/// its own; `--fresh` and `--overwrite` say replacing is wanted). Empty files are fair game.
pub(crate) fn check_not_foreign(
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

/// `p` made absolute with its directory's links resolved (the file itself may not exist yet),
/// so that two spellings of one errors file are one identity.
fn resolved(p: &std::path::Path) -> std::path::PathBuf {
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    match (abs.parent().and_then(|d| std::fs::canonicalize(d).ok()), abs.file_name()) {
        (Some(dir), Some(name)) => dir.join(name),
        _ => abs,
    }
}

pub(crate) fn identity(
    settings: &RunSettings,
    input_file: Option<&std::path::Path>,
    table: Option<&weir_tables::TableInput>,
    followed: Option<&str>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
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
        // A pool's first endpoint names the run, however the pool was given.
        // Or the one the provider's client takes from the environment (`OPENAI_BASE_URL`).
        base_url: settings
            .pool
            .first()
            .and_then(|e| e.base_url.clone())
            .or_else(|| settings.provider.base_url.clone())
            .or_else(|| weir_providers::base_url_from_env(settings.model.provider, env)),
        prompt: match &settings.records.prompt {
            PromptSource::Field(f) => format!("field:{f}"),
            PromptSource::Template(t) => format!("template:{}", t.source()),
            PromptSource::Unused => "none".to_string(),
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
            // Records sent with other media are other requests: a run with other
            // `--media-field`s is another run, not one to resume.
            if !settings.records.media_fields.is_empty() {
                let fields: Vec<String> = settings
                    .records
                    .media_fields
                    .iter()
                    .map(|(f, mime)| mime.as_ref().map_or(f.clone(), |m| format!("{f}:{m}")))
                    .collect();
                call.push(format!("media={}", fields.join(",")));
            }
            // An http/ model is its description in the models file: a run resumed after it was
            // edited would mix the old answers with the new ones.
            let model = settings.model.to_string();
            let http = match (model.strip_prefix("http/"), &settings.model_field) {
                (_, Some(_)) => Some(None),
                (Some(name), None) => Some(Some(vec![name])),
                (None, None) => None,
            };
            if let Some(names) = http {
                let shapes =
                    weir_providers::webapi::shapes(names.as_deref(), settings.provider.http_models.as_deref(), env);
                if !shapes.is_empty() {
                    call.push(format!("http={}", shapes.join(",")));
                }
            }
            (!call.is_empty()).then(|| call.join(" "))
        },
        outputs: Some(match &settings.table_output {
            // Where the errors table is, however the command spelled it (`./t/e.parquet`, from
            // another directory): its store, bucket and absolute path.
            Some(t) => format!(
                "{} table, errors {:?}:{}/{} ({}), columns {}",
                t.results_format,
                t.errors.scheme,
                t.errors.bucket,
                t.errors.path,
                t.errors_format,
                settings.keep_columns.as_ref().map_or("all".to_string(), |c| c.join(","))
            ),
            None => match &settings.errors {
                OutputPath::File(p) => format!("errors {}", resolved(p).display()),
                OutputPath::Stream(p) => format!("errors {}", p.display()),
                OutputPath::Stdout => "errors -".to_string(),
            },
        }),
    })
}

/// The files the resume stage claimed.
#[derive(Default)]
pub(crate) struct Claimed {
    pub(crate) out_file: Option<(PathBuf, std::fs::File)>,
    pub(crate) err_file: Option<(PathBuf, std::fs::File)>,
    pub(crate) events_file: Option<(PathBuf, std::fs::File)>,
    /// Files this run made, removed again if it is refused before it starts.
    pub(crate) created: Created,
}

/// What the resume stage hands on: the output files claimed (locked, not yet truncated), and
/// what an earlier run of the same command left — its finished records, its cache, its jobs.
pub(crate) struct Resumed {
    pub(crate) files: Claimed,
    pub(crate) state_dir: Option<state::StateDir>,
    pub(crate) recovered: state::Recovered,
    pub(crate) cache: Option<Arc<DiskCache>>,
    /// An earlier run's state is resumed.
    pub(crate) resuming: bool,
    pub(crate) table_journal: Option<weir_tables::Journal>,
    pub(crate) table_locks: Vec<TableLock>,
    pub(crate) next_part: u32,
    pub(crate) jobs_ledger: Option<PathBuf>,
    /// The run is resumable (it keeps a journal of what it finished).
    pub(crate) resumable: bool,
    /// The number of records, when it was counted.
    pub(crate) total: Option<u64>,
}

/// Claims the output files and opens the state directory: the identity check (an earlier run
/// of another command is refused), the lock, and the recovery of what an earlier run of this
/// one finished. A refusal leaves nothing behind.
pub(crate) async fn resume(
    settings: &RunSettings,
    input: &Input,
    jobs_api: Option<&Arc<weir_jobs::Sites>>,
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
    let resumable = match (&settings.state, &settings.output, &settings.errors) {
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
                let id = identity(settings, None, input.table.as_ref(), followed.as_deref(), env)?;
                let ledger = weir_jobs::Ledger::path_in(dir, &name);
                let recorded = state::recorded_base_url(dir, &name);
                guard_jobs(&ledger, jobs_api, settings, &t.results.display, recorded, &id).await?;
                let (sd, resume) =
                    state::open(dir, &name, &id, settings.fresh).map_err(|e| refused_with_jobs(e, &ledger))?;
                resuming = resume;
                if resuming && live_input && !settings.follow && !settings.resume_stream {
                    return Err(stream_resume_refused(&t.results.display, input_name));
                }
                moved_without_jobs(&sd, &ledger)?;
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
                // Recorded (and a new base URL said) only now that nothing refuses the run.
                if let (Some(sd), Some(id)) = (&state_dir, &run_id) {
                    if !resuming || sd.moved().is_some() {
                        announce_moved(sd);
                        sd.record(id).map_err(|e| RunError::Usage(e.to_string()))?;
                    }
                }
                next_part = committed.next_part();
                recovered.results = committed.rows(weir_tables::journal::Table::Results);
                recovered.errors = committed.rows(weir_tables::journal::Table::Errors);
                recovered.finished = committed.finished;
                recovered.finished_ids = committed.finished_ids;
                if resuming {
                    if total.is_none() {
                        total = input.count()?;
                    }
                    announce_resume(&recovered, total, false);
                }
                if let (true, StateMode::Dir(dir)) = (settings.cache, state_mode) {
                    cache = open_cache(dir)?;
                }
            }
            journaled
        }
        (StateMode::Dir(dir), OutputPath::File(out), OutputPath::File(errs)) => {
            let name = state::output_state_name(out, dir);
            let id = identity(settings, input_file.as_deref(), input.table.as_ref(), followed.as_deref(), env)?;
            let ledger = weir_jobs::Ledger::path_in(dir, &name);
            let recorded = state::recorded_base_url(dir, &name);
            guard_jobs(&ledger, jobs_api, settings, &out.display().to_string(), recorded, &id).await?;
            let (sd, resume) =
                state::open(dir, &name, &id, settings.fresh).map_err(|e| refused_with_jobs(e, &ledger))?;
            resuming = resume;
            if resuming && live_input && !settings.follow && !settings.resume_stream {
                return Err(stream_resume_refused(&out.display().to_string(), input_name));
            }
            moved_without_jobs(&sd, &ledger)?;
            jobs_ledger = Some(ledger);
            check_not_foreign(
                &[&out_file, &err_file, &events_file],
                resuming || settings.fresh || settings.overwrite,
                false,
            )?;
            // Recorded (and a new base URL said) only now that nothing refuses the run.
            if !resuming || sd.moved().is_some() {
                announce_moved(&sd);
                sd.record(&id).map_err(|e| RunError::Usage(e.to_string()))?;
            }
            if resuming {
                if let Some(changed) = sd.written_since(&[out, errs]) {
                    if !changed.exists() {
                        return Err(RunError::Usage(format!(
                            "{}: gone since this command's last run ended, with the rows it finished; start over \
                             with --fresh (answers in the response cache are not paid for again)",
                            changed.display()
                        )));
                    }
                    return Err(RunError::Usage(format!(
                        "{}: changed since this command's last run ended (its size or its first or last rows differ: \
                         another run wrote it, or an edit), so what it holds may not be what that run finished; start over with --fresh \
                         (answers in the response cache are not paid for again)",
                        changed.display()
                    )));
                }
            }
            // Written from now on: a kill would leave the files other than noted at the end.
            sd.forget_closed();
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
                announce_resume(&recovered, total, !settings.retry_errors);
            } else if settings.retry_errors {
                return Err(RunError::Usage(
                    "--retry-errors needs the state of an earlier run of the same command (none found)".into(),
                ));
            }
            if settings.cache {
                cache = open_cache(dir)?;
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
        resumable,
        total,
    })
}

/// A lock on a local table output (`.weir.lock` in its directory, which readers skip as a
/// hidden file), held for the whole run, so two weir processes never write one table whatever
/// their state directories. A run refused before it starts removes what it created. (An
/// object store has no such lock: see the README.)
pub(crate) struct TableLock {
    pub(crate) _file: std::fs::File,
    pub(crate) path: PathBuf,
    pub(crate) created: Option<PathBuf>,
    pub(crate) started: bool,
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

/// Why a run over a stream does not resume an earlier run's output on its own.
pub(crate) fn stream_resume_refused(output: &str, input: &str) -> RunError {
    RunError::Usage(format!(
        "{output} holds an earlier run of this command, but the input {input} is a stream, which weir cannot \
         check is the same data. Pass --resume-stream to resume anyway (with --id-field, records whose id is \
         finished are skipped wherever they come; without it, those whose line is), or --fresh to start over"
    ))
}

/// Opens the response cache in the state directory. Runs started side by side in one
/// directory (the common way to split a job over several processes) find it held by the
/// first: they go on without it and say so, as `weir sql` and Python do, rather than refuse
/// to run. Their answers then reach no cache, which costs a later run of the same records its
/// hits, never a record.
pub(crate) fn open_cache(dir: &std::path::Path) -> Result<Option<Arc<DiskCache>>, RunError> {
    match weir_runtime::open_cache(&dir.join("cache")) {
        Ok(c) => Ok(Some(c)),
        Err(e) if e.in_use => {
            eprintln!(
                "weir: the response cache in {} is in use by another weir process; this run goes on without it \
                 (its answers are not cached for later runs: give it its own --state DIR to keep them)",
                dir.display()
            );
            Ok(None)
        }
        Err(e) => Err(RunError::Usage(format!("{e}; or run with --no-cache"))),
    }
}

/// Says, on stderr, that the run resumed goes on at another base URL than the earlier one's
/// (a server restarted on another port): its finished rows are kept.
fn announce_moved(sd: &state::StateDir) {
    if let Some(moved) = sd.moved() {
        eprintln!(
            "weir: the base URL changed since the earlier run ({moved}); its finished rows are kept and the rest go \
             to the new one (--fresh starts over)"
        );
    }
}

/// A run resumed at another base URL while the earlier run's provider jobs are still open is
/// refused: they were submitted at the old address, which the new one does not know, so their
/// records were submitted again at the new one and paid for twice (the old jobs going on).
fn moved_without_jobs(sd: &state::StateDir, ledger: &std::path::Path) -> Result<(), RunError> {
    let Some(moved) = sd.moved() else { return Ok(()) };
    let chunks = weir_jobs::Ledger::read(ledger).unwrap_or_default();
    let open = weir_jobs::open_chunks(&chunks);
    if open.is_empty() {
        return Ok(());
    }
    let jobs: Vec<String> =
        open.iter().map(|c| c.job.as_ref().map_or_else(|| c.name.clone(), |j| j.id.clone())).collect();
    Err(RunError::Usage(format!(
        "the base URL changed since the earlier run ({moved}), but its provider jobs {} are still open at the old \
         one: resume with the old --base-url to collect them, or cancel them there (`weir batch cancel` with the \
         old --base-url) and run --fresh with the old --base-url to start over (their records are paid for again)",
        jobs.join(", ")
    )))
}

/// Says what an earlier run finished, on stderr. Error rows kept are finished records, so a
/// plain re-run skips them; where `--retry-errors` would run some again (`retry_hint`: a JSONL
/// output, without the flag), it is named, since a user whose run ended in errors that may pass
/// (a quota of zero with `--max-retries 0`, say) re-runs expecting them to be tried again.
pub(crate) fn announce_resume(recovered: &state::Recovered, total: Option<u64>, retry_hint: bool) {
    let of = total.map(|t| format!(" of {}", crate::report::thousands(t))).unwrap_or_default();
    eprintln!(
        "Resuming: {}{of} finished ({} results, {} errors){}{}",
        crate::report::thousands(recovered.finished_count()),
        crate::report::thousands(recovered.results),
        crate::report::thousands(recovered.errors),
        if recovered.requeued > 0 {
            // Not among the finished errors before it: "0 errors; 104 error rows to run again"
            // read as a contradiction.
            format!("; {} more error rows are to run again", recovered.requeued)
        } else {
            String::new()
        },
        if recovered.torn_bytes > 0 {
            format!("; cut a torn tail of {} bytes", recovered.torn_bytes)
        } else {
            String::new()
        },
    );
    if retry_hint && recovered.retryable > 0 {
        eprintln!(
            "  error rows count as finished and are not run again; {} of them failed for a reason that may pass \
             on another try (a rate limit, a server error, a timeout, a bad answer): add --retry-errors to run those \
             again",
            crate::report::thousands(recovered.retryable)
        );
    }
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

/// Keeps an earlier run's provider jobs in sight. `--fresh` forgets the job ledger, so it is
/// refused while any job there is still pending or running: those jobs go on being charged,
/// `weir batch status` and `cancel` would no longer see them, and their records would be paid
/// for again. A refusal to resume a changed command names the jobs too, since its advice is
/// `--fresh`.
pub(crate) async fn guard_jobs(
    ledger: &std::path::Path,
    api: Option<&Arc<weir_jobs::Sites>>,
    settings: &RunSettings,
    output: &str,
    recorded: Option<Option<String>>,
    id: &state::RunIdentity,
) -> Result<(), RunError> {
    let chunks = match weir_jobs::Ledger::read(ledger) {
        Ok(chunks) => chunks,
        Err(e) if settings.fresh => {
            return Err(RunError::Usage(format!("{e}; remove it only after checking its jobs")))
        }
        // Said by the run when it opens the ledger.
        Err(_) => return Ok(()),
    };
    // Chunks that may hold records: the latest of some key, not refused by their endpoint
    // (whether their job id was recorded or the run stopped before it was).
    let open = weir_jobs::open_chunks(&chunks);
    // A resumed run asks each job's endpoint about it: one the pool no longer lists is said
    // before any call (its records are in that job).
    if let (false, Some(sites)) = (settings.fresh, api) {
        let missing: Vec<&weir_jobs::Chunk> = open.iter().copied().filter(|c| sites.index_of(c).is_none()).collect();
        if !missing.is_empty() {
            return Err(RunError::Usage(weir_jobs::missing_sites(&missing).to_string()));
        }
    }
    if !settings.fresh || open.is_empty() {
        return Ok(());
    }
    // The jobs are at the address the earlier run used: asked at another, a job of the same id
    // there (another run's) was taken for this run's, and a real one still running at the old
    // address would have been forgotten.
    if let Some(moved) = recorded.and_then(|old| state::base_url_moved(&old, &id.base_url)) {
        return Err(RunError::Usage(format!(
            "--fresh asks the provider whether the earlier run's {} batch job(s) ended, and they were submitted at \
             another base URL ({moved}): run --fresh with the earlier --base-url, or cancel them there with `weir \
             batch cancel`",
            open.len()
        )));
    }
    let cancel = format!(
        "`weir batch cancel --model {} --output {output}` (with this run's --base-url, --endpoints, --project, \
         --location, --job-bucket and --state, if given)",
        settings.model
    );
    let Some(api) = api else {
        return Err(RunError::Usage(format!(
            "an earlier run of this command submitted {} batch job(s), which may still be running and charged; --fresh \
             would forget them. Run --fresh with --mode batch (weir then asks the provider whether they ended), or \
             cancel them first with {cancel}",
            open.len()
        )));
    };
    let (mut live, mut uncollected) = (Vec::new(), Vec::new());
    for chunk in open {
        let api = match api.api_of(chunk) {
            Ok(api) => api,
            Err(_) => {
                let what = chunk.job.as_ref().map_or(chunk.name.as_str(), |j| j.id.as_str());
                live.push(format!("{what} (at endpoint \"{}\", which this run's pool does not list)", chunk.site));
                continue;
            }
        };
        // A chunk whose job id was never recorded (the run stopped while submitting it) may
        // still be a job: asked by its name.
        let job = match &chunk.job {
            Some(job) => job.clone(),
            None => match api.find(&chunk.sought(&chunks)).await {
                Ok(Some(job)) => job,
                Ok(None) => continue,
                Err(e) => {
                    live.push(format!("{} (perhaps submitted; the provider could not be asked: {e})", chunk.name));
                    continue;
                }
            },
        };
        match api.status(&job).await {
            // Ended with answers this command has not written yet (its spool is still there):
            // paid for, and --fresh would pay for them again.
            // (A job cancelled on purpose is given up with its answers.)
            Ok(s)
                if s.state.is_terminal()
                    && s.state != weir_core::JobState::Cancelled
                    && chunk.spool.is_some()
                    && s.completed > 0 =>
            {
                uncollected.push(format!("{} ({}, {} answered)", job.id, s.state.as_str(), s.completed))
            }
            Ok(s) if s.state.is_terminal() => {}
            Ok(s) => live.push(format!("{} ({})", job.id, s.state.as_str())),
            Err(e) => live.push(format!("{} (the provider could not be asked: {e})", job.id)),
        }
    }
    if live.is_empty() && !uncollected.is_empty() {
        return Err(RunError::Usage(format!(
            "--fresh would throw away the answers of {} batch job(s) of the earlier run that ended but whose rows were \
             not written yet: {}. They are paid for, and their records would be paid for again. Run without --fresh to \
             write them (with the input the earlier run read); to discard them anyway, delete {} and {}",
            uncollected.len(),
            uncollected.join(", "),
            ledger.display(),
            weir_jobs::Ledger::spool_dir_of(ledger).display()
        )));
    }
    if live.is_empty() {
        return Ok(());
    }
    Err(RunError::Usage(format!(
        "--fresh would forget {} batch job(s) of the earlier run that are still live at the provider and charged: {}. \
         Their records would be paid for again. Run without --fresh to collect their answers, or cancel them with \
         {cancel} and then run --fresh (what they answered before the cancel is then given up)",
        live.len(),
        live.join(", ")
    )))
}

/// A refusal of the state directory; one that advises `--fresh` says that jobs the earlier run
/// submitted stand in its way until they end or are cancelled.
pub(crate) fn refused_with_jobs(e: state::StateError, ledger: &std::path::Path) -> RunError {
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
pub(crate) fn has_jobs(path: &std::path::Path) -> bool {
    // A chunk recorded without its job id may be a job too (the run stopped while submitting).
    weir_jobs::Ledger::read(path).is_ok_and(|chunks| !weir_jobs::open_chunks(&chunks).is_empty())
}
