//! The first stage of `weir run`: the input opened (a JSONL file or stdin, a followed file, a
//! table through weir-tables), counted when something shows the count, and read as
//! [`Work`] — records to call for, and lines that are already failures — with what an earlier
//! run finished skipped.

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use std::path::PathBuf;
use weir_core::{ErrorKind, Failure, ModelError, PromptSource, RecordSpec};
use weir_io::source::RawLine;
use weir_io::state::{finished_key, id_key};
use weir_io::InputPath;
use weir_runtime::Work;

use crate::pipeline::{own_paths, table_error, text_columns, RunError, RunSettings, StateMode};

/// The run's input, opened.
pub(crate) struct Input {
    /// As the summary and messages name it (`-` for stdin).
    pub name: String,
    /// The input when it is a table.
    pub table: Option<weir_tables::TableInput>,
    /// The input when it is a local file that can be read twice (to be identified, counted).
    pub file: Option<PathBuf>,
    /// An input that may never end (stdin, a FIFO, a followed file): every row is handed on as
    /// soon as it is known, not when a buffer fills.
    pub live: bool,
    source: BoxStream<'static, std::io::Result<RawLine>>,
    /// A table's number of records, counted once at opening if anything may show it.
    table_count: Option<u64>,
    /// A local file's size when it was opened: a file that changes while it is read is another
    /// input to the next run.
    opened_size: Option<u64>,
}

/// What an earlier run finished, skipped when read again.
pub(crate) struct Skip {
    /// Records finished, by id and line (shared with the batch jobs, which skip them too).
    pub finished: std::sync::Arc<weir_io::KeySet>,
    /// Ids finished, for an input fed again in another order (`--resume-stream --id-field`).
    pub finished_ids: weir_io::KeySet,
    /// Whether the id alone says a record is finished.
    pub by_id: bool,
}

/// A CSV or Parquet input whose columns (its header, its footer: known before any row is read)
/// lack the prompt field or the id field is a usage error: every row would have become an
/// `invalid_input` row, a million of them for a million-row file. (JSONL names its fields line
/// by line, and a field may be missing from some: there each line says so.)
async fn check_columns(input: &weir_tables::TableInput, settings: &RunSettings) -> Result<(), RunError> {
    if input.format == weir_tables::Format::Jsonl || input.files.is_empty() {
        return Ok(());
    }
    let schema = input.schema().await.map_err(table_error)?;
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    if names.is_empty() {
        return Ok(());
    }
    let missing = |field: &str, flag: &str| {
        RunError::Usage(format!(
            "--input {}: has no column {field:?} ({flag}); its columns are {}",
            input.location.display,
            names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")
        ))
    };
    match &settings.records.prompt {
        PromptSource::Field(f) if !names.contains(&f.as_str()) => {
            return Err(missing(f, "the prompt: name the column with --prompt-field, or give --template"));
        }
        PromptSource::Field(f) => {
            // A prompt column that holds no text (numbers in a Parquet file) failed every row
            // with "not a string"; a template writes any value as text.
            if let Some(ty) =
                schema.field_with_name(f).ok().map(|c| c.data_type()).filter(|t| !weir_tables::holds_text(t))
            {
                return Err(RunError::Usage(format!(
                    "--input {}: the prompt column {f:?} holds {ty}, not text; name a text column with \
                     --prompt-field, or write its values into a prompt with --template '{{{f}}}'",
                    input.location.display,
                )));
            }
        }
        PromptSource::Template(t) => {
            if let Some(f) = t.fields().find(|f| !names.contains(f)) {
                return Err(missing(f, "named in --template"));
            }
        }
        _ => {}
    }
    if let Some(id) = &settings.records.id_field {
        if !names.contains(&id.as_str()) {
            return Err(missing(id, "--id-field"));
        }
    }
    Ok(())
}

/// Why the local file `p` is plainly not JSON Lines ([`weir_io::source::not_jsonl`]), from its
/// first 4 KiB; nothing when it cannot be read (opening it says why).
fn not_jsonl(p: &std::path::Path) -> Option<&'static str> {
    use std::io::Read;
    let mut head = Vec::with_capacity(4096);
    std::fs::File::open(p).ok()?.take(4096).read_to_end(&mut head).ok()?;
    weir_io::source::not_jsonl(&head)
}

impl Input {
    /// Opens the input `settings` name. A stream (stdin, a FIFO, `<(cmd)`, /dev/stdin) can be
    /// read only once: it is never read to be identified or counted.
    pub async fn open(settings: &RunSettings, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Result<Self, RunError> {
        let name = match &settings.input {
            InputPath::File(p) => p.display().to_string(),
            InputPath::Stdin => "-".to_string(),
        };
        let table = match &settings.table_input {
            Some(t) => {
                let mut input =
                    weir_tables::TableInput::open(&t.spec, t.format, &text_columns(settings), t.csv_delimiter, env)
                        .await
                        .map_err(table_error)?;
                // A directory or glob may hold this run's own outputs and state (`--input data/
                // --output data/results.jsonl`): they are never read as input, or a resumed run
                // would read its own results.
                let own = own_paths(settings);
                let inside =
                    |url: &str, o: &String| url == o || url.starts_with(&format!("{}/", o.trim_end_matches('/')));
                input.retain(|url| !own.iter().any(|o| inside(url, o))).map_err(table_error)?;
                check_columns(&input, settings).await?;
                Some(input)
            }
            None => None,
        };
        let file = match &settings.input {
            InputPath::File(p) if table.is_none() && !settings.follow && !weir_io::paths::is_stream(p) => {
                Some(p.clone())
            }
            _ => None,
        };
        if let Some(why) = file.as_deref().and_then(not_jsonl) {
            return Err(RunError::Usage(format!("--input {name}: {why}")));
        }
        let live = table.is_none() && file.is_none();
        let source = match (&table, &settings.input) {
            (Some(t), _) => t.lines(),
            (None, InputPath::File(p)) if settings.follow => {
                weir_io::source::follow(p.clone(), weir_io::source::FOLLOW_POLL).boxed()
            }
            (None, _) => weir_io::source::lines(
                weir_io::source::open(&settings.input)
                    .await
                    .map_err(|e| RunError::Usage(format!("cannot read --input {name}: {e}")))?,
            )
            .boxed(),
        };
        // The number of records is an extra pass over the input: made only when something
        // shows it (the progress bar, the resume message, an interrupted run's summary). A
        // table's is counted once, here, if anything may show it (Parquet footers say it at once).
        let table_count = match &table {
            Some(t) if settings.progress || settings.state != StateMode::Off => t.count().await,
            _ => None,
        };
        let opened_size = file.as_deref().and_then(|p| std::fs::metadata(p).ok()).map(|m| m.len());
        Ok(Self { name, table, file, live, source, table_count, opened_size })
    }

    /// What to tell the user when the input file changed size while it was read (lines
    /// appended as it ran): the run read them, but a later run of the command is refused as
    /// over another input. None when it did not.
    pub fn changed_while_read(&self) -> Option<String> {
        let (p, before) = (self.file.as_deref()?, self.opened_size?);
        let now = std::fs::metadata(p).ok()?.len();
        (now != before).then(|| {
            format!(
                "--input {} changed while it was read ({before} bytes, now {now}): a run of this command again \
                 will take it for another input. For a file that grows, use --follow",
                self.name
            )
        })
    }

    /// The number of records, when the input can be counted (a file read again, a table).
    pub fn count(&self) -> Result<Option<u64>, RunError> {
        match &self.file {
            Some(p) => weir_io::count_records(p)
                .map(Some)
                .map_err(|e| RunError::Usage(format!("cannot read --input {}: {e}", p.display()))),
            None => Ok(self.table_count),
        }
    }

    /// The input read as work until `stop`: each line parsed into a record by `spec` (a line
    /// that does not parse, a record whose id an earlier line has, becomes a failure naming
    /// its line), without what `skip` says is finished.
    pub fn records(
        &mut self,
        spec: RecordSpec,
        skip: Skip,
        stop: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> impl Stream<Item = Work> + Send + 'static {
        let source = std::mem::replace(&mut self.source, futures::stream::empty().boxed());
        let check_duplicates = spec.id_field.is_some();
        // Ids are registered in input order, finished lines included, so "an earlier line has
        // it" is true of the input whatever order the rows were written in (a first occurrence
        // that an interruption left unfinished is still the first).
        let mut seen = weir_io::SpillSet::in_temp();
        let Skip { finished, finished_ids, by_id } = skip;
        source.take_until(stop).filter_map(move |line| {
            let item = match line {
                Err(e) => Some(Work::ReadError(e)),
                // A record that could not be read (a CSV line of the wrong width, an unreadable
                // Parquet row group) is an error row naming where it was.
                Ok(raw) if raw.malformed.is_some() => (!finished.contains(&finished_key(None, raw.line))).then(|| {
                    Work::Done(Box::new(Failure {
                        id: None,
                        line: raw.line,
                        input: None,
                        raw: (!raw.bytes.is_empty()).then(|| String::from_utf8_lossy(&raw.bytes).into_owned()),
                        error: ModelError::new(
                            ErrorKind::InvalidInput,
                            raw.located(raw.malformed.clone().unwrap_or_default()),
                        ),
                        attempts: 0,
                    }))
                }),
                Ok(raw) => match spec.parse(raw.line, &raw.bytes) {
                    Err(mut failure) => {
                        (!finished.contains(&finished_key(failure.id.as_ref(), failure.line))).then(|| {
                            failure.error.message = raw.located(std::mem::take(&mut failure.error.message));
                            Work::Done(failure)
                        })
                    }
                    Ok(record) => {
                        let first = match check_duplicates {
                            false => true,
                            true => match seen.insert(id_key(&record.id)) {
                                Ok(first) => first,
                                Err(e) => {
                                    let e = std::io::Error::new(e.kind(), format!("checking ids for duplicates: {e}"));
                                    return futures::future::ready(Some(Work::ReadError(e)));
                                }
                            },
                        };
                        if finished.contains(&finished_key(Some(&record.id), record.line))
                            || (by_id && finished_ids.contains(&id_key(&record.id)))
                        {
                            None
                        } else if !first {
                            let msg = raw.located(format!(
                                "line {}: {}{}' (an earlier line has it)",
                                record.line,
                                weir_io::state::DUPLICATE_ID,
                                record.id
                            ));
                            Some(Work::Done(Box::new(Failure::of(
                                record,
                                ModelError::new(ErrorKind::InvalidInput, msg),
                                0,
                            ))))
                        } else {
                            Some(Work::Call(record))
                        }
                    }
                },
            };
            futures::future::ready(item)
        })
    }
}
