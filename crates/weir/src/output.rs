//! The output stage of `weir run`: the writer threads that make rows durable, into JSONL files
//! (results, errors, events) or into a table's parts.

use crate::pipeline::{table_error, EventsTo, RunError, RunSettings, TableOut};
use crate::resume::{Claimed, Resumed};
use std::path::PathBuf;
use weir_io::JsonlWriter;

use crate::input::Input;

/// Starts the writer threads: the rows to the claimed files (truncated now, unless resumed) or
/// to a table's parts, and the events to a writer of their own where they are not lines of
/// the results. From here on, a table directory the run made stays.
pub(crate) async fn start_writers(
    settings: &RunSettings,
    input: &Input,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    resumed: &mut Resumed,
) -> Result<(weir_io::RowWriter, Option<weir_io::RowWriter>), RunError> {
    let tables_out = &settings.table_output;
    let Claimed { mut out_file, mut err_file, mut events_file, mut created } = std::mem::take(&mut resumed.files);
    let (resuming, resumable, live_input) = (resumed.resuming, resumed.resumable, input.live);
    let open = |claimed: &mut Option<(PathBuf, std::fs::File)>| match claimed.take() {
        None => Ok(JsonlWriter::stdout()),
        Some((path, f)) => {
            let regular = f.metadata().map(|m| m.is_file()).unwrap_or(false);
            let truncated = if resuming || !regular { Ok(()) } else { f.set_len(0) };
            truncated
                .and_then(|_| JsonlWriter::to_file(f, &path.display().to_string()))
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
                resumable,
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

/// What a table output's result columns hold: text or vectors.
pub(crate) fn table_task(settings: &RunSettings) -> weir_tables::Task {
    if settings.provider.task == weir_providers::Task::Embed {
        weir_tables::Task::Embed
    } else if let (Some(schema), None) = (&settings.driver.params.response_schema, &settings.records.params_field) {
        // Answers checked against a response schema: a column of its type. Not when records
        // may bring their own schemas (`--params-field`): an answer of another shape would
        // not fit the column and be lost, so the answers are kept as text.
        weir_tables::Task::Shaped(weir_tables::schema::arrow_type_of(schema))
    } else {
        weir_tables::Task::Generate
    }
}

/// The input columns a table output carries: known from a table input or a local JSONL file
/// before the first row (and checked against --keep-columns now, so a wrong name is a usage
/// error); `None` for a stream, whose columns are inferred from its first rows.
pub(crate) async fn table_columns(
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
        &table_task(settings),
        out.results_format == Format::Csv,
    )
    .map_err(RunError::Usage)?;
    Ok(Some(schema))
}
