//! Writing results and errors as tables: parts of a bounded size in a directory or prefix,
//! local or in an object store, committed with the journal at checkpoints.
//!
//! Rows are written on a thread of their own (with its own small runtime for the uploads), fed
//! by a bounded channel, so encoding Parquet and uploading never hold up calls in flight. Each
//! part is written as it fills — by multipart upload in an object store, to a temporary file
//! locally — and appears under its name only when completed. A checkpoint (every
//! `checkpoint` interval, when a part reaches `part_bytes`, and at the end) completes the open
//! parts and then records them and their records' keys in the journal; see [`crate::journal`].

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use object_store::buffered::BufWriter;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::async_writer::AsyncArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use weir_core::{Failure, Success};
use weir_io::state::{finished_key, id_key, Key};
use weir_io::writer::report;
use weir_io::{ErrorRow, ResultRow, Row, RowWriter, WriterThread};

use crate::journal::{self, Journal, Part, Table};
use crate::location::Location;
use crate::schema::{Inference, OutputColumns, Task};
use crate::{Format, TableError};

/// Where and how the tables are written.
pub struct TableSettings {
    /// The results directory or prefix.
    pub results: Location,
    /// Its format.
    pub results_format: Format,
    /// The errors directory or prefix.
    pub errors: Location,
    /// Its format.
    pub errors_format: Format,
    /// The input's columns, when known before the first row (else inferred from the first rows).
    pub input_schema: Option<SchemaRef>,
    /// Input columns to carry through (all when `None`).
    pub keep: Option<Vec<String>>,
    /// What the run computes.
    pub task: Task,
    /// The id field: written as text when the columns are inferred from a stream's first rows
    /// (an id that is a number there may be text later, and must never be left out).
    pub id_field: Option<String>,
    /// A part is completed once it holds about this many bytes.
    pub part_bytes: u64,
    /// Parts are completed and recorded at least this often.
    pub checkpoint: Duration,
    /// Environment variables for the stores' credentials.
    pub env: HashMap<String, String>,
    /// Called about once a second (to make the response cache durable).
    pub on_tick: Option<Box<dyn Fn() + Send + Sync>>,
}

/// Rows written in all: (results, errors).
pub type Counts = (u64, u64);

/// Rows waiting to be written at most.
const QUEUE: usize = 1024;
/// Rows encoded into one Arrow batch, at most.
const CHUNK_ROWS: usize = 4096;
/// JSON bytes encoded into one Arrow batch, at most: long rows make smaller batches, so
/// memory does not grow with the length of answers or input columns.
const CHUNK_BYTES: usize = 2 << 20;
/// Rows of a stream input seen before its columns are inferred.
const INFER_ROWS: usize = 1000;
/// Rows per Parquet row group: small enough that a writer's buffers stay small.
const ROW_GROUP: usize = 16 * 1024;
/// Encoded bytes at which a Parquet row group is flushed whatever its rows (long answers).
const ROW_GROUP_BYTES: usize = 4 << 20;
/// Bytes buffered before a part is written out, to a local file and to an object store.
const LOCAL_BUFFER: usize = 1 << 20;
const REMOTE_BUFFER: usize = 8 << 20;

/// Checks an output location before a run writes there, and clears what it must: parts an
/// earlier run completed but never recorded (their records run again). A new run refuses a
/// location that holds files (unless `overwrite`, which deletes weir's parts there); a resumed
/// run requires every recorded part to be there still.
pub async fn prepare(
    location: &Location,
    table: Table,
    committed: &journal::Committed,
    resuming: bool,
    overwrite: bool,
    env: crate::location::Env<'_>,
) -> Result<(), TableError> {
    use futures::StreamExt;
    if let Some(p) = location.local_path() {
        if p.is_file() {
            return Err(TableError::Usage(format!(
                "{}: is a file; weir writes a table as a directory of parts (part-00000…) there. Choose another path",
                location.display
            )));
        }
    }
    if let Some(dir) = location.local_path() {
        // Left half written by a run that was stopped (the caller holds the table's lock, so
        // no run writes them now). Listed by the file system: the store's listing leaves its
        // own staging files (`NAME#1`) out.
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for name in entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()) {
                if journal::is_staging(&name) {
                    std::fs::remove_file(dir.join(&name))
                        .map_err(|e| TableError::Usage(format!("cannot delete {}: {e}", dir.join(&name).display())))?;
                }
            }
        }
    }
    let store = location.store(env)?;
    if location.local_path().is_none() {
        // An object at the table's own name (an older single-file output): readers of that
        // name would get it, not the parts under it. Refused as a local file there is.
        if location.first_answer(store.head(&location.path)).await?.is_ok() {
            return Err(TableError::Usage(format!(
                "{}: is an object; weir writes a table as a prefix of parts (part-00000…) under that name, and \
                 readers of the name would get the object. Choose another name, or delete the object",
                location.display.trim_end_matches('/')
            )));
        }
    }
    let mine: Vec<&journal::Part> = committed.parts.iter().filter(|p| p.table == table).collect();
    let mut seen = Vec::new();
    let mut foreign = Vec::new();
    let mut stale = Vec::new();
    let mut listing = store.list(Some(&location.path));
    while let Some(m) = listing.next().await {
        let m = m.map_err(|e| TableError::listing(&format!("cannot list {}", location.display), e))?;
        let rel = m
            .location
            .prefix_match(&location.path)
            .map(|parts| parts.map(|p| p.as_ref().to_string()).collect::<Vec<_>>());
        let name = match rel.as_deref() {
            Some([one]) => one.clone(),
            // A folder's marker (`out.parquet/`, empty, as consoles make them): nothing to read.
            Some([]) if m.size == 0 => continue,
            _ => {
                foreign.push(m.location);
                continue;
            }
        };
        if let Some(part) = mine.iter().find(|p| resuming && p.name == name) {
            if part.bytes.is_some_and(|b| b != m.size) {
                return Err(TableError::Usage(format!(
                    "{}: the earlier run's part {name} was replaced since it was written ({} bytes, was {}): another \
                     run wrote there, so what the earlier run finished is not what the table holds; start over with \
                     --fresh",
                    location.display,
                    m.size,
                    part.bytes.unwrap_or_default()
                )));
            }
            seen.push(name);
        } else if journal::part_number(&name).is_some() && (resuming || overwrite) {
            stale.push(m.location);
        } else if !name.starts_with('.') {
            foreign.push(m.location);
        }
    }
    if let Some(missing) = mine.iter().map(|p| &p.name).find(|n| !seen.iter().any(|s| s == *n)) {
        return Err(TableError::Usage(format!(
            "{}: the earlier run's part {missing} is gone, so the records it held would be lost; start over with --fresh",
            location.display
        )));
    }
    if !foreign.is_empty() && !overwrite {
        return Err(TableError::Usage(format!(
            "{} already holds files no earlier run of this command wrote (such as {}); weir will not mix its parts \
             with them. Choose an empty location, or pass --overwrite to replace weir's parts there (other files \
             are left alone). A run of this command from another directory keeps its state there (.weir, or its \
             --state): to resume it, run it there",
            location.display,
            location.url_of(&foreign[0])
        )));
    }
    for p in stale {
        store.delete(&p).await.map_err(|e| TableError::Usage(format!("cannot delete {}: {e}", location.url_of(&p))))?;
    }
    Ok(())
}

/// Starts the thread that writes tables, with its own small runtime for the uploads; parts are
/// numbered from `next_part` and recorded in `journal` (none for a run without state: its parts
/// are completed but nothing can resume from them). Rows go through the returned handle.
pub fn spawn(settings: TableSettings, journal: Option<Journal>, next_part: u32) -> io::Result<RowWriter> {
    RowWriter::start("weir-tables", QUEUE, move |given| {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => return ((0, 0), Err(e)),
        };
        rt.block_on(write_loop(settings, journal, next_part, given))
    })
}

/// One part being written.
enum Encoder {
    Parquet(Box<AsyncArrowWriter<BufWriter>>),
    Text { out: Box<BufWriter>, header_done: bool },
}

struct OpenPart {
    name: String,
    /// Where a local part is written until complete (renamed to its name then).
    staging: Option<ObjectPath>,
    enc: Encoder,
    rows: u64,
    bytes: u64,
}

/// The results or the errors table.
struct Sink {
    table: Table,
    store: Arc<dyn ObjectStore>,
    dir: ObjectPath,
    format: Format,
    /// Rows encoded as JSON lines, waiting to become a batch.
    chunk: Vec<u8>,
    chunk_rows: usize,
    open: Option<OpenPart>,
    /// A local directory: parts are written under a hidden staging name and renamed.
    local: bool,
    written: u64,
    /// Rows whose input columns did not fit their types (written without them).
    misfits: u64,
}

fn io_other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl Sink {
    fn schema<'a>(&self, columns: &'a OutputColumns) -> &'a SchemaRef {
        match self.table {
            Table::Results => &columns.results,
            Table::Errors => &columns.errors,
        }
    }

    fn push_line(&mut self, line: &[u8]) {
        self.chunk.extend_from_slice(line);
        self.chunk.push(b'\n');
        self.chunk_rows += 1;
    }

    async fn open_part(&mut self, number: u32, columns: Option<&OutputColumns>) -> io::Result<()> {
        if self.open.is_some() {
            return Ok(());
        }
        let name = journal::part_name(number, self.format.extension());
        // An object store shows an object only once its upload completes; a local directory
        // would show the file (and the store's `NAME#N` staging file for it) while written.
        let staging = self.local.then(|| self.dir.clone().join(journal::staging_name(&name).as_str()));
        let path = staging.clone().unwrap_or_else(|| self.dir.clone().join(name.as_str()));
        // Buffered up to a multipart upload's part: S3 needs 5 MiB at least; a local file
        // takes any size, so little is held in memory there.
        let buffered = |path| {
            let w = BufWriter::with_capacity(
                self.store.clone(),
                path,
                if self.local { LOCAL_BUFFER } else { REMOTE_BUFFER },
            );
            w.with_max_concurrency(2)
        };
        let enc = match (self.format, columns) {
            (Format::Parquet, Some(c)) => {
                let props = WriterProperties::builder()
                    .set_compression(Compression::SNAPPY)
                    .set_max_row_group_row_count(Some(ROW_GROUP))
                    .build();
                let w =
                    AsyncArrowWriter::try_new(buffered(path), self.schema(c).clone(), Some(props)).map_err(io_other)?;
                Encoder::Parquet(Box::new(w))
            }
            _ => Encoder::Text { out: Box::new(buffered(path)), header_done: false },
        };
        self.open = Some(OpenPart { name, staging, enc, rows: 0, bytes: 0 });
        Ok(())
    }

    /// Encodes the waiting rows into the open part (opening one as part `number`).
    async fn flush_chunk(&mut self, number: u32, columns: Option<&OutputColumns>) -> io::Result<()> {
        if self.chunk_rows == 0 {
            return Ok(());
        }
        self.open_part(number, columns).await?;
        let rows = std::mem::take(&mut self.chunk_rows) as u64;
        let chunk = std::mem::take(&mut self.chunk);
        let schema = columns.map(|c| self.schema(c).clone());
        let part = self.open.as_mut().expect("opened above");
        match (&mut part.enc, self.format) {
            (Encoder::Text { out, .. }, Format::Jsonl) => {
                out.write_all(&chunk).await?;
                part.bytes += chunk.len() as u64;
            }
            (Encoder::Text { out, header_done }, _) => {
                let schema = schema.ok_or_else(|| io_other("no columns for a CSV part"))?;
                let (batch, misfits) = decode(&chunk, &schema, columns.expect("with the schema"))?;
                self.misfits += misfits;
                let mut bytes = Vec::new();
                let mut w = arrow_csv::WriterBuilder::new().with_header(!*header_done).build(&mut bytes);
                w.write(&batch).map_err(io_other)?;
                drop(w);
                *header_done = true;
                out.write_all(&bytes).await?;
                part.bytes += bytes.len() as u64;
            }
            (Encoder::Parquet(w), _) => {
                let schema = schema.ok_or_else(|| io_other("no columns for a Parquet part"))?;
                let (batch, misfits) = decode(&chunk, &schema, columns.expect("with the schema"))?;
                self.misfits += misfits;
                w.write(&batch).await.map_err(io_other)?;
                // A row group is held in memory until flushed: flush by size too, not only
                // by rows, so long answers do not make the writer hold a large part.
                if w.in_progress_size() >= ROW_GROUP_BYTES {
                    w.flush().await.map_err(io_other)?;
                }
                part.bytes = (w.bytes_written() + w.in_progress_size()) as u64;
            }
        }
        part.rows += rows;
        Ok(())
    }

    /// Completes the open part, if any: after this it exists under its name.
    async fn complete(&mut self) -> io::Result<Option<Part>> {
        let Some(part) = self.open.take() else { return Ok(None) };
        match part.enc {
            Encoder::Parquet(w) => {
                w.close().await.map_err(io_other)?;
            }
            Encoder::Text { mut out, .. } => out.shutdown().await?,
        }
        let to = self.dir.clone().join(part.name.as_str());
        if let Some(staging) = &part.staging {
            self.store.rename(staging, &to).await.map_err(io_other)?;
        }
        // Its size as the store has it, for a resume to tell it from a part of the same name
        // another run wrote since.
        let bytes = self.store.head(&to).await.map_err(io_other)?.size;
        self.written += part.rows;
        Ok(Some(Part { table: self.table, name: part.name, rows: part.rows, bytes: Some(bytes) }))
    }
}

/// Decodes JSON lines into one batch of `schema`. Rows whose input columns do not fit their
/// types are decoded again without those columns, so their results are never lost; returns
/// how many rows that was.
fn decode(lines: &[u8], schema: &SchemaRef, columns: &OutputColumns) -> io::Result<(RecordBatch, u64)> {
    let build = || {
        arrow_json::ReaderBuilder::new(schema.clone())
            .with_coerce_primitive(true)
            .with_batch_size(CHUNK_ROWS + 1)
            .build_decoder()
            .map_err(io_other)
    };
    let mut decoder = build()?;
    let whole = decoder.decode(lines).and_then(|_| decoder.flush());
    if let Ok(Some(batch)) = whole {
        return Ok((batch, 0));
    }
    // Row by row: find the rows that do not fit.
    let mut fixed = Vec::with_capacity(lines.len());
    let mut misfits = 0;
    for line in lines.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let mut one = build()?;
        let fits = one.decode(line).and_then(|_| one.flush()).is_ok();
        if fits {
            fixed.extend_from_slice(line);
        } else {
            // Leave out only the input columns that do not fit, one by one; weir's own always do.
            misfits += 1;
            let mut row: Map<String, Value> = serde_json::from_slice(line).map_err(io_other)?;
            let kept: Map<String, Value> =
                columns.kept.iter().filter_map(|f| row.remove_entry(f.name().as_str())).collect();
            for (name, value) in kept {
                let mut trial = row.clone();
                trial.insert(name.clone(), value.clone());
                let bytes = serde_json::to_vec(&trial).map_err(io_other)?;
                let mut one = build()?;
                if one.decode(&bytes).and_then(|_| one.flush()).is_ok() {
                    row.insert(name, value);
                }
            }
            serde_json::to_writer(&mut fixed, &row).map_err(io_other)?;
        }
        fixed.push(b'\n');
    }
    let mut decoder = build()?;
    decoder.decode(&fixed).map_err(io_other)?;
    let batch = decoder.flush().map_err(io_other)?.ok_or_else(|| io_other("no rows decoded"))?;
    Ok((batch, misfits))
}

/// A result row for a table: the kept input columns, then weir's.
fn result_row(s: &Success, c: &OutputColumns, text_only: bool) -> Map<String, Value> {
    let mut row = Map::new();
    c.carry(Some(&s.record.input), &mut row);
    let mut put = |name: &str, v: Value| {
        row.insert(c.name(name).to_string(), v);
    };
    put("line", s.record.line.into());
    match &s.response.embedding {
        Some(v) => {
            let vector: Value = v.iter().map(|x| Value::from(*x as f64)).collect::<Vec<_>>().into();
            put("embedding", if text_only { Value::String(vector.to_string()) } else { vector });
            put("dimensions", (v.len() as u64).into());
        }
        None => {
            // A typed response column (a response schema's) takes the answer's JSON, fitted.
            let typed = c.results.field_with_name(c.name("response")).ok().map(|f| f.data_type().clone());
            let value = match typed {
                Some(t) if t != arrow_schema::DataType::Utf8 => {
                    match serde_json::from_str::<Value>(weir_core::schema::strip_fence(&s.response.text)) {
                        Ok(v) => crate::schema::fit(&v, &t),
                        Err(_) => Value::Null,
                    }
                }
                // A string schema's answer is a JSON string: its text, without the quotes.
                _ if c.shaped => {
                    match serde_json::from_str::<Value>(weir_core::schema::strip_fence(&s.response.text)) {
                        Ok(Value::String(text)) => text.into(),
                        _ => s.response.text.clone().into(),
                    }
                }
                _ => s.response.text.clone().into(),
            };
            put("response", value)
        }
    }
    put("finish_reason", s.response.finish_reason.clone().into());
    put("prompt_tokens", s.response.usage.prompt_tokens.into());
    put("output_tokens", s.response.usage.output_tokens.into());
    put("total_tokens", s.response.usage.total_tokens.into());
    put("model", s.model.to_string().into());
    put("model_version", s.response.model_version.clone().map_or(Value::Null, Value::String));
    put("attempts", s.attempts.into());
    put("latency_ms", (s.latency.as_millis() as u64).into());
    row
}

/// An error row for a table.
fn error_row(f: &Failure, c: &OutputColumns) -> Map<String, Value> {
    let mut row = Map::new();
    c.carry(f.input.as_ref(), &mut row);
    let e = ErrorRow::of(f);
    let mut put = |name: &str, v: Value| {
        row.insert(c.name(name).to_string(), v);
    };
    put("line", e.line.into());
    put("kind", serde_json::to_value(e.kind).unwrap_or(Value::Null));
    put("message", e.message.into());
    put("status", e.status.map_or(Value::Null, Value::from));
    put("attempts", e.attempts.into());
    put("retryable", e.retryable.into());
    put("raw", e.raw.map_or(Value::Null, |r| Value::String(r.to_string())));
    row
}

/// The id of a row's record as the journal keeps it (see [`journal::Committed::finished_ids`]);
/// not a duplicate's, whose id is the earlier line's.
fn id_of(row: &Row) -> Option<Key> {
    match row {
        Row::Success(s) => Some(id_key(&s.record.id)),
        Row::Failure(f) if f.error.message.contains(weir_io::state::DUPLICATE_ID) => None,
        Row::Failure(f) => f.id.as_ref().map(id_key),
        Row::Event(_) => None,
    }
}

fn key_of(row: &Row) -> Option<Key> {
    match row {
        Row::Success(s) => Some(finished_key(Some(&s.record.id), s.record.line)),
        Row::Failure(f) => Some(finished_key(f.id.as_ref(), f.line)),
        Row::Event(_) => None,
    }
}

struct State {
    results: Sink,
    errors: Sink,
    columns: Option<OutputColumns>,
    journal: Option<Journal>,
    next_part: u32,
    keys: Vec<Key>,
    /// The ids of the records of `keys`, with `--id-field`.
    ids: Vec<Key>,
    settings_task: Task,
    keep: Option<Vec<String>>,
    id_field: Option<String>,
    /// Rows held back until a stream input's columns are known.
    early: Vec<Row>,
    /// For columns inferred from a stream's first rows: rows with input columns the table has
    /// not (first seen later), and the first such column, to say so at the end. `None` when
    /// the columns came from the whole input.
    unseen: Option<(u64, Option<String>)>,
}

impl State {
    fn needs_columns(&self) -> bool {
        self.results.format != Format::Jsonl || self.errors.format != Format::Jsonl
    }

    /// Infers the columns from the rows held back (a stream input).
    fn infer(&mut self) -> io::Result<()> {
        self.unseen = Some((0, None));
        let mut inf = Inference::default();
        for r in &self.early {
            match r {
                Row::Success(s) => inf.add(&s.record.input),
                Row::Failure(f) => {
                    if let Some(i) = &f.input {
                        inf.add(i)
                    }
                }
                Row::Event(_) => {}
            }
        }
        let mut schema = inf.schema().map_err(io_other)?;
        if let Some(id) = &self.id_field {
            let fields = schema
                .fields()
                .iter()
                .map(|f| {
                    if f.name() == id {
                        Arc::new(f.as_ref().clone().with_data_type(arrow_schema::DataType::Utf8))
                    } else {
                        f.clone()
                    }
                })
                .collect::<Vec<_>>();
            schema = Arc::new(arrow_schema::Schema::new(fields));
        }
        self.set_columns(&schema)
    }

    fn set_columns(&mut self, schema: &SchemaRef) -> io::Result<()> {
        let text_only = self.results.format == Format::Csv;
        let c = OutputColumns::new(schema, self.keep.as_deref(), &self.settings_task, text_only).map_err(io_other)?;
        self.columns = Some(c);
        Ok(())
    }

    async fn add(&mut self, row: Row) -> io::Result<()> {
        // Stream events are written by a thread of their own beside this one.
        if let Row::Event(_) = row {
            return Ok(());
        }
        if self.columns.is_none() && self.needs_columns() {
            self.early.push(row);
            if self.early.len() >= INFER_ROWS {
                self.release().await?;
            }
            return Ok(());
        }
        if self.journal.is_some() {
            self.keys.extend(key_of(&row));
            if self.id_field.is_some() {
                self.ids.extend(id_of(&row));
            }
        }
        if let (Some(c), None, Some((rows, first))) = (&self.columns, &self.keep, &mut self.unseen) {
            let input = match &row {
                Row::Success(s) => Some(&s.record.input),
                Row::Failure(f) => f.input.as_ref(),
                Row::Event(_) => None,
            };
            if let Some(name) = input.and_then(|i| i.keys().find(|k| !c.kept.iter().any(|f| f.name() == *k))) {
                *rows += 1;
                first.get_or_insert_with(|| name.clone());
            }
        }
        let c = self.columns.as_ref();
        match &row {
            Row::Success(s) => {
                let line = match (self.results.format, c) {
                    (Format::Jsonl, _) | (_, None) => serde_json::to_vec(&ResultRow::of(s)),
                    (f, Some(c)) => serde_json::to_vec(&result_row(s, c, f == Format::Csv)),
                }
                .map_err(io_other)?;
                self.results.push_line(&line);
                if self.results.chunk_rows >= CHUNK_ROWS || self.results.chunk.len() >= CHUNK_BYTES {
                    self.results.flush_chunk(self.next_part, self.columns.as_ref()).await?;
                }
            }
            Row::Failure(f) => {
                let line = match (self.errors.format, c) {
                    (Format::Jsonl, _) | (_, None) => serde_json::to_vec(&ErrorRow::of(f)),
                    (_, Some(c)) => serde_json::to_vec(&error_row(f, c)),
                }
                .map_err(io_other)?;
                self.errors.push_line(&line);
                if self.errors.chunk_rows >= CHUNK_ROWS || self.errors.chunk.len() >= CHUNK_BYTES {
                    self.errors.flush_chunk(self.next_part, self.columns.as_ref()).await?;
                }
            }
            Row::Event(_) => {}
        }
        Ok(())
    }

    /// Infers the columns from the rows held back and writes them.
    async fn release(&mut self) -> io::Result<()> {
        if self.columns.is_some() || self.early.is_empty() {
            return Ok(());
        }
        self.infer()?;
        for row in std::mem::take(&mut self.early) {
            Box::pin(self.add(row)).await?;
        }
        Ok(())
    }

    fn part_full(&self, limit: u64) -> bool {
        [&self.results, &self.errors].iter().any(|s| s.open.as_ref().is_some_and(|p| p.bytes >= limit))
    }

    fn pending(&self) -> bool {
        !self.early.is_empty() || [&self.results, &self.errors].iter().any(|s| s.chunk_rows > 0 || s.open.is_some())
    }

    /// Completes the open parts and records them and their records in the journal.
    async fn checkpoint(&mut self) -> io::Result<()> {
        self.release().await?;
        let columns = self.columns.as_ref();
        self.results.flush_chunk(self.next_part, columns).await?;
        self.errors.flush_chunk(self.next_part, columns).await?;
        let mut parts = Vec::new();
        parts.extend(self.results.complete().await?);
        parts.extend(self.errors.complete().await?);
        if parts.is_empty() && self.keys.is_empty() {
            return Ok(());
        }
        if let Some(j) = &mut self.journal {
            j.commit(&self.keys, &self.ids, &parts)?;
        }
        self.keys.clear();
        self.ids.clear();
        if !parts.is_empty() {
            self.next_part += 1;
        }
        Ok(())
    }
}

async fn write_loop(
    settings: TableSettings,
    journal: Option<Journal>,
    next_part: u32,
    given: WriterThread,
) -> (Counts, io::Result<()>) {
    let WriterThread { rows: mut rx, failed, .. } = given;
    let env = settings.env.clone();
    let store = |l: &Location| l.store(&|k: &str| env.get(k).cloned()).map_err(io_other);
    let (rs, es) = match (store(&settings.results), store(&settings.errors)) {
        (Ok(r), Ok(e)) => (r, e),
        (Err(e), _) | (_, Err(e)) => {
            report(&failed, &e);
            while rx.recv().await.is_some() {}
            return ((0, 0), Err(e));
        }
    };
    let sink = |table, store, dir: &Location, format| Sink {
        table,
        store,
        dir: dir.path.clone(),
        format,
        chunk: Vec::new(),
        chunk_rows: 0,
        open: None,
        local: dir.local_path().is_some(),
        written: 0,
        misfits: 0,
    };
    let mut state = State {
        results: sink(Table::Results, rs, &settings.results, settings.results_format),
        errors: sink(Table::Errors, es, &settings.errors, settings.errors_format),
        columns: None,
        journal,
        next_part,
        keys: Vec::new(),
        ids: Vec::new(),
        settings_task: settings.task.clone(),
        keep: settings.keep.clone(),
        id_field: settings.id_field.clone(),
        early: Vec::new(),
        unseen: None,
    };
    let mut error: Option<io::Error> = None;
    if let Some(schema) = &settings.input_schema {
        if let Err(e) = state.set_columns(schema) {
            report(&failed, &e);
            error = Some(e);
        }
    }
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_checkpoint = tokio::time::Instant::now();
    loop {
        tokio::select! {
            row = rx.recv() => {
                let Some(row) = row else { break };
                if error.is_some() {
                    continue;
                }
                let mut done = state.add(row).await;
                if done.is_ok() && state.part_full(settings.part_bytes) {
                    done = state.checkpoint().await;
                    last_checkpoint = tokio::time::Instant::now();
                }
                if let Err(e) = done {
                    report(&failed, &e);
                    error = Some(e);
                }
            }
            _ = tick.tick() => {
                if let Some(f) = &settings.on_tick {
                    f();
                }
                if error.is_none() && state.pending() && last_checkpoint.elapsed() >= settings.checkpoint {
                    last_checkpoint = tokio::time::Instant::now();
                    if let Err(e) = state.checkpoint().await {
                        report(&failed, &e);
                        error = Some(e);
                    }
                }
            }
        }
    }
    let end = match error {
        Some(e) => Err(e),
        None => state.checkpoint().await,
    };
    if let Some(f) = &settings.on_tick {
        f();
    }
    if let Some((n, Some(name))) = &state.unseen {
        tracing::warn!(
            "{n} rows had input columns the table does not have (such as '{name}': a column first seen after the \
             first {INFER_ROWS} rows of a stream, which the table's columns were taken from); those values were \
             left out. Write JSONL (which keeps every field), or give such a column a value in the first rows"
        );
    }
    let misfits = state.results.misfits + state.errors.misfits;
    if misfits > 0 {
        tracing::warn!(
            "{misfits} rows were written without their input columns, whose values did not fit the columns' types"
        );
    }
    ((state.results.written, state.errors.written), end)
}
