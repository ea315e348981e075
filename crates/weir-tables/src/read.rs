//! Reading a table — one file, a glob, or a directory (prefix) of files, local or in an
//! object store — as a stream of JSON-object lines, in constant memory.
//!
//! Every format becomes what weir's pipeline already reads: one JSON object per record, with a
//! 1-based position. JSONL lines pass through as they are (a line that is not JSON becomes an
//! error row there, as for a local file); a CSV record becomes an object of its header's names,
//! its values typed as the whole input's columns are (integers, floats, booleans, else text); a
//! Parquet row becomes the object `arrow-json` writes for it (lists and structs nested). Files
//! are read one after another in name order, and positions continue from one to the next, so a
//! record's position is the same in every run over the same input (it is the record's id when
//! there is no `--id-field`). In a CSV file, positions are line numbers (the header is line 1);
//! in a Parquet file, row numbers from 1.
//!
//! What cannot be read becomes error rows, not a crash: a CSV line with the wrong number of
//! fields, or each row of a Parquet row group that cannot be decoded, naming the file and where
//! in it.

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Schema, SchemaRef};
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use futures::FutureExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::arrow::async_reader::{AsyncFileReader, ParquetRecordBatchStream, ParquetRecordBatchStreamBuilder};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weir_io::RawLine;

use crate::location::{Env, Location};
use crate::{Format, TableError};

/// One input file.
#[derive(Debug, Clone)]
pub struct InputFile {
    /// Where it is.
    pub path: ObjectPath,
    /// Its size in bytes.
    pub size: u64,
    /// Its ETag or version, when the store reports one.
    pub version: Option<String>,
}

/// A table to read: its files, their format and the store they are in.
pub struct TableInput {
    /// Where the user said it is.
    pub location: Location,
    /// The files, in the order they are read.
    pub files: Vec<InputFile>,
    /// Their format.
    pub format: Format,
    store: Arc<dyn ObjectStore>,
    /// CSV inputs: the columns' types, inferred from every file.
    csv_schema: Option<SchemaRef>,
    /// CSV inputs: the byte between fields (`,` unless told).
    delimiter: u8,
}

/// The rows of a CSV file, its header included: lines that are not blank, where a newline
/// inside a quoted field does not end one (counted by lines, a file whose prompts held
/// newlines said "3,000 of 3,018 finished" when every record was).
fn csv_rows(path: &std::path::Path) -> io::Result<u64> {
    use std::io::BufRead;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path)?);
    let (mut rows, mut quoted, mut content) = (0u64, false, false);
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        for &b in buf {
            match b {
                // A doubled quote inside a quoted field toggles twice: still quoted.
                b'"' => {
                    quoted = !quoted;
                    content = true;
                }
                b'\n' if !quoted => {
                    rows += u64::from(content);
                    content = false;
                }
                b'\r' | b' ' | b'\t' => {}
                _ => content = true,
            }
        }
        let n = buf.len();
        reader.consume(n);
    }
    Ok(rows + u64::from(content))
}

fn has_glob(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

fn read_err(what: &str, e: impl std::fmt::Display) -> TableError {
    TableError::Usage(format!("cannot read --input {what}: {e}"))
}

impl TableInput {
    /// Finds the files `spec` names: one file, a glob (`s3://b/in/*.parquet`), or a directory or
    /// prefix (every file in it with a table extension, or of `format` when given, recursively;
    /// names starting with `.` or `_` are skipped, as Spark's `_SUCCESS` files are).
    /// `text` names columns a CSV input keeps as text whatever they look like (the id field:
    /// `007` and `7` are different ids). `delimiter` separates a CSV input's fields.
    pub async fn open(
        spec: &str,
        format: Option<Format>,
        text: &[String],
        delimiter: u8,
        env: Env<'_>,
    ) -> Result<Self, TableError> {
        let location = Location::parse(spec)?;
        let store = location.store(env)?;
        let mut files = Vec::new();
        // Hidden names (`.weir/`, `.git`) and Spark's `_SUCCESS` and `_temporary/`, anywhere
        // below what the user named, are not data.
        let base = location.path.clone();
        let wanted = |p: &ObjectPath| {
            let name = p.filename().unwrap_or_default();
            let hidden = p
                .prefix_match(&base)
                .map(|mut parts| parts.any(|c| c.as_ref().starts_with('.') || c.as_ref().starts_with('_')))
                .unwrap_or(false);
            !hidden
                && match format {
                    Some(f) => Format::from_name(name).is_none_or(|g| g == f),
                    None => Format::from_name(name).is_some(),
                }
        };
        let as_file = |m: ObjectMeta| InputFile { path: m.location, size: m.size, version: m.e_tag.or(m.version) };
        let exists = location.local_path().is_some_and(|p| p.exists());
        if has_glob(spec) && !exists {
            let full = location.path.as_ref().to_string();
            let pattern =
                glob::Pattern::new(&full).map_err(|e| TableError::Usage(format!("--input {spec}: bad glob: {e}")))?;
            let fixed: Vec<&str> = full.split('/').take_while(|part| !has_glob(part)).collect();
            let prefix = ObjectPath::from_iter(fixed.iter().copied());
            // Below the fixed part, hidden names are skipped as in a directory (`out.parquet/*`
            // read weir's own `.weir.lock`), unless the pattern itself starts that name with
            // the same `.` or `_` (`data/_extra*.csv` asks for them).
            let parts: Vec<&str> = full.split('/').collect();
            let unasked_hidden = |p: &ObjectPath| {
                p.parts().enumerate().skip(fixed.len()).any(|(i, c)| {
                    let c = c.as_ref();
                    c.chars()
                        .next()
                        .is_some_and(|h| (h == '.' || h == '_') && !parts.get(i).is_some_and(|q| q.starts_with(h)))
                })
            };
            let mut listing = store.list(Some(&prefix)).peekable();
            location.first_answer(std::pin::Pin::new(&mut listing).peek()).await?;
            while let Some(m) = listing.next().await {
                let m = m.map_err(|e| TableError::listing(&format!("cannot read --input {spec}"), e))?;
                let whole_names = glob::MatchOptions { require_literal_separator: true, ..Default::default() };
                if pattern.matches_with(m.location.as_ref(), whole_names)
                    && wanted(&m.location)
                    && !unasked_hidden(&m.location)
                {
                    files.push(as_file(m));
                }
            }
        } else {
            match location.first_answer(store.head(&location.path)).await? {
                Ok(m) => files.push(as_file(m)),
                Err(_) => {
                    let mut listing = store.list(Some(&location.path));
                    while let Some(m) = listing.next().await {
                        let m = m.map_err(|e| TableError::listing(&format!("cannot read --input {spec}"), e))?;
                        if wanted(&m.location) {
                            files.push(as_file(m));
                        }
                    }
                }
            }
        }
        files.sort_by(|a, b| a.path.as_ref().cmp(b.path.as_ref()));
        if files.is_empty() {
            return Err(TableError::Usage(format!(
                "--input {spec}: no such file, and no {} files under it",
                format.map(|f| f.to_string()).unwrap_or_else(|| "jsonl, csv or parquet".into())
            )));
        }
        let format = match format {
            Some(f) => f,
            None => {
                let first = Format::from_name(files[0].path.as_ref()).ok_or_else(|| {
                    TableError::Usage(format!(
                        "--input {spec}: cannot tell the format from the name; pass --input-format jsonl|csv|parquet"
                    ))
                })?;
                if let Some(other) = files.iter().find(|f| Format::from_name(f.path.as_ref()) != Some(first)) {
                    return Err(TableError::Usage(format!(
                        "--input {spec}: holds files of more than one format ({} and {}); pass --input-format or a glob",
                        location.url_of(&files[0].path),
                        location.url_of(&other.path)
                    )));
                }
                first
            }
        };
        let mut input = Self { location, files, format, store, csv_schema: None, delimiter };
        // A text format named for a file that is not text (`--input-format jsonl` on a Parquet
        // file, a compressed one): said once, not as an error row per line of bytes.
        // Every file of a local directory or glob (a read of its first KiB each); in a bucket,
        // the first only (a request per object before any row would slow a start over
        // thousands of them).
        if format != Format::Parquet {
            let local = input.location.local_path().is_some();
            for f in input.files.iter().take(if local { usize::MAX } else { 1 }) {
                let url = input.location.url_of(&f.path);
                let head = input.head_bytes(f, 4096).await.map_err(|e| read_err(&url, e))?;
                let why = match format {
                    Format::Jsonl => weir_io::source::not_jsonl(&head),
                    _ => weir_io::source::not_text(&head),
                };
                if let Some(why) = why {
                    return Err(TableError::Usage(format!("--input {url}: {why}")));
                }
            }
        }
        if format == Format::Csv {
            input.csv_schema = Some(input.infer_csv(text).await?);
        }
        Ok(input)
    }

    /// Leaves out files for which `keep` is false (given each file's full name): a run's own
    /// outputs and state when they are inside the input directory.
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) -> Result<(), TableError> {
        let location = self.location.clone();
        self.files.retain(|f| keep(&location.url_of(&f.path)));
        if self.files.is_empty() {
            return Err(TableError::Usage(format!(
                "--input {}: every file it names is where this run writes (its --output, --errors or state); an \
                 output cannot be the input or hold it: choose another --output",
                self.location.display
            )));
        }
        Ok(())
    }

    /// What identifies this input for resume: every file's name, size and ETag (object
    /// stores) or content digest (local files).
    pub fn identity(&self) -> Result<String, TableError> {
        let mut parts = Vec::new();
        for f in &self.files {
            let url = self.location.url_of(&f.path);
            let part = match self.location.local_path() {
                Some(_) => weir_io::state::input_identity(std::path::Path::new(&format!("/{}", f.path)))
                    .map_err(|e| read_err(&url, e))?,
                None => format!("{url} ({} bytes, {})", f.size, f.version.as_deref().unwrap_or("no etag")),
            };
            parts.push(part);
        }
        if parts.len() <= 3 {
            return Ok(parts.join("; "));
        }
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(parts.join("\n").as_bytes());
        let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        Ok(format!("{} ({} files, {hex})", self.location.display, parts.len()))
    }

    /// The number of records, when it is cheap to know: Parquet row counts from the footers, and
    /// the lines of local JSONL and CSV files.
    pub async fn count(&self) -> Option<u64> {
        let mut total = 0u64;
        for f in &self.files {
            total += match self.format {
                Format::Parquet => self.parquet_builder(f).await.ok()?.metadata().file_metadata().num_rows() as u64,
                Format::Jsonl => {
                    self.location.local_path()?;
                    weir_io::count_records(std::path::Path::new(&format!("/{}", f.path))).ok()?
                }
                Format::Csv => {
                    self.location.local_path()?;
                    csv_rows(std::path::Path::new(&format!("/{}", f.path))).ok()?.saturating_sub(1)
                }
            };
        }
        Some(total)
    }

    /// The columns of the input as Arrow sees them, for a table output that carries them
    /// through: from the Parquet footer, the CSV inference, or inferred over every JSONL line.
    pub async fn schema(&self) -> Result<SchemaRef, TableError> {
        match self.format {
            Format::Parquet => {
                // Merged file by file, so that columns that disagree are named with the files.
                let mut merged: Option<(Schema, String)> = None;
                for f in &self.files {
                    let url = self.location.url_of(&f.path);
                    let b = self.parquet_builder(f).await.map_err(|e| read_err(&url, e))?;
                    let schema = plain(b.schema());
                    merged = Some(match merged {
                        None => (schema, url),
                        Some((so_far, first)) => {
                            let m = merge(vec![so_far, schema], &self.location.display)
                                .map_err(|e| TableError::Usage(format!("{e} ({first} and {url} differ)")))?;
                            (m.as_ref().clone(), first)
                        }
                    });
                }
                let (schema, _) = merged.unwrap_or_else(|| (Schema::empty(), String::new()));
                Ok(Arc::new(schema))
            }
            Format::Csv => Ok(self.csv_schema.clone().expect("inferred when opened")),
            Format::Jsonl => {
                let mut values = crate::schema::Inference::default();
                let mut lines = self.lines();
                while let Some(line) = lines.next().await {
                    let line = line.map_err(|e| read_err(&self.location.display, e))?;
                    if let Ok(serde_json::Value::Object(m)) = serde_json::from_slice::<serde_json::Value>(&line.bytes) {
                        values.add(&m);
                    }
                }
                values.schema().map_err(|e| read_err(&self.location.display, e))
            }
        }
    }

    async fn parquet_builder(
        &self,
        f: &InputFile,
    ) -> Result<ParquetRecordBatchStreamBuilder<ObjectReader>, parquet::errors::ParquetError> {
        let reader = ObjectReader::new(self.store.clone(), f.path.clone()).with_file_size(f.size);
        ParquetRecordBatchStreamBuilder::new(reader).await
    }

    async fn infer_csv(&self, text: &[String]) -> Result<SchemaRef, TableError> {
        let mut schemas = Vec::new();
        let delimiter = self.delimiter;
        for f in &self.files {
            let url = self.location.url_of(&f.path);
            let head = self.head_bytes(f, 64 << 10).await.map_err(|e| read_err(&url, e))?;
            if head.starts_with(&[0xFF, 0xFE]) || head.starts_with(&[0xFE, 0xFF]) {
                return Err(TableError::Usage(format!(
                    "--input {url}: is UTF-16 text (its byte-order mark says so); weir reads UTF-8. Save it as UTF-8 \
                     (in Excel: CSV UTF-8), or convert it: iconv -f UTF-16 -t UTF-8"
                )));
            }
            let reader = self.sync_reader(f).await.map_err(|e| read_err(&url, e))?;
            let inferred = tokio::task::spawn_blocking(move || {
                arrow_csv::reader::Format::default()
                    .with_header(true)
                    .with_truncated_rows(true)
                    .with_delimiter(delimiter)
                    .infer_schema(reader, None)
            })
            .await
            .map_err(|e| read_err(&url, e))?;
            let schema = match inferred {
                Ok((schema, _)) => schema,
                // A byte that is not UTF-8 somewhere: the columns are named by the header and
                // read as text; the records with such bytes become error rows as they are read.
                Err(e) if e.to_string().to_ascii_lowercase().contains("utf") => header_as_text(&head, delimiter)
                    .ok_or_else(|| read_err(&url, format!("{e}; the header line itself is not UTF-8")))?,
                Err(e) => return Err(read_err(&url, e)),
            };
            if let [only] = schema.fields().iter().collect::<Vec<_>>()[..] {
                if let Some(sep) =
                    [b';', b'\t', b'|'].into_iter().find(|&b| b != delimiter && only.name().as_bytes().contains(&b))
                {
                    let shown = if sep == b'\t' { "tab".to_string() } else { (sep as char).to_string() };
                    let flag = if sep == b'\t' { "'\\t'".to_string() } else { format!("'{}'", sep as char) };
                    return Err(TableError::Usage(format!(
                        "--input {url}: the header is one column ('{}'); its fields seem separated by {shown}, not \
                         '{}'. Pass --csv-delimiter {flag}",
                        only.name(),
                        delimiter as char
                    )));
                }
            }
            let mut names = std::collections::HashSet::new();
            if let Some(dup) = schema.fields().iter().find(|f| !names.insert(f.name().clone())) {
                return Err(TableError::Usage(format!(
                    "--input {url}: the header names the column '{}' twice; rename one",
                    dup.name()
                )));
            }
            schemas.push(schema);
        }
        // Columns by name over every file; a column whose type differs between files, or that
        // must stay text, is text.
        let mut fields: Vec<arrow_schema::Field> = Vec::new();
        for schema in schemas {
            for f in schema.fields() {
                match fields.iter_mut().find(|g| g.name() == f.name()) {
                    Some(g) if g.data_type() == f.data_type() || f.data_type() == &DataType::Null => {}
                    Some(g) if g.data_type() == &DataType::Null => *g = f.as_ref().clone(),
                    Some(g) => *g = arrow_schema::Field::new(g.name(), DataType::Utf8, true),
                    None => fields.push(f.as_ref().clone()),
                }
            }
        }
        for f in &mut fields {
            if text.contains(f.name()) {
                *f = arrow_schema::Field::new(f.name(), DataType::Utf8, true);
            }
        }
        Ok(Arc::new(Schema::new(fields)))
    }

    /// The first `most` bytes of a file (or all of a smaller one).
    async fn head_bytes(&self, f: &InputFile, most: u64) -> io::Result<Vec<u8>> {
        let end = f.size.min(most);
        if end == 0 {
            return Ok(Vec::new());
        }
        Ok(self.store.get_range(&f.path, 0..end).await.map_err(io::Error::other)?.to_vec())
    }

    /// A blocking reader over a file's bytes (for the CSV parser), to be used off the runtime.
    async fn sync_reader(&self, f: &InputFile) -> io::Result<Box<dyn io::Read + Send>> {
        let stream = self.store.get(&f.path).await.map_err(io::Error::other)?.into_stream().map_err(io::Error::other);
        let reader = tokio_util::io::StreamReader::new(stream);
        Ok(Box::new(tokio_util::io::SyncIoBridge::new(reader)))
    }

    /// The records of every file, in order, as JSON-object lines.
    pub fn lines(&self) -> BoxStream<'static, io::Result<RawLine>> {
        let last = Arc::new(AtomicU64::new(0));
        let store = self.store.clone();
        let location = self.location.clone();
        let format = self.format;
        let csv_schema = self.csv_schema.clone();
        let delimiter = self.delimiter;
        let many = self.files.len() > 1;
        futures::stream::iter(self.files.clone())
            .then(move |f| {
                let (store, location, last, csv_schema) =
                    (store.clone(), location.clone(), last.clone(), csv_schema.clone());
                async move {
                    let base = last.load(Ordering::Relaxed);
                    let url = location.url_of(&f.path);
                    // Of many JSONL files, each line says which file it is in (CSV's and
                    // Parquet's messages name it already).
                    let origin: Option<Arc<str>> = (format == Format::Jsonl && many).then(|| url.as_str().into());
                    let lines: BoxStream<'static, io::Result<RawLine>> = match format {
                        Format::Jsonl => jsonl_lines(store, f).await,
                        Format::Csv => {
                            csv_lines(store, f, url, csv_schema.expect("inferred when opened"), delimiter).await
                        }
                        Format::Parquet => parquet_lines(store, f, url).await,
                    };
                    lines
                        .map(move |l| {
                            l.map(|mut l| {
                                l.origin = origin.clone().map(|file| (file, base));
                                l.line += base;
                                last.fetch_max(l.line, Ordering::Relaxed);
                                l
                            })
                        })
                        .boxed()
                }
            })
            .flatten()
            .boxed()
    }
}

/// Reads a Parquet file's byte ranges from its store (its size is known, so the footer is one
/// ranged read).
#[derive(Clone)]
struct ObjectReader {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    size: u64,
}

impl ObjectReader {
    fn new(store: Arc<dyn ObjectStore>, path: ObjectPath) -> Self {
        Self { store, path, size: 0 }
    }

    fn with_file_size(self, size: u64) -> Self {
        Self { size, ..self }
    }
}

fn parquet_err(e: object_store::Error) -> parquet::errors::ParquetError {
    parquet::errors::ParquetError::External(Box::new(e))
}

impl AsyncFileReader for ObjectReader {
    fn get_bytes(
        &mut self,
        range: std::ops::Range<u64>,
    ) -> futures::future::BoxFuture<'_, parquet::errors::Result<bytes::Bytes>> {
        async move { self.store.get_range(&self.path, range).await.map_err(parquet_err) }.boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<std::ops::Range<u64>>,
    ) -> futures::future::BoxFuture<'_, parquet::errors::Result<Vec<bytes::Bytes>>> {
        async move { self.store.get_ranges(&self.path, &ranges).await.map_err(parquet_err) }.boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> futures::future::BoxFuture<'a, parquet::errors::Result<Arc<parquet::file::metadata::ParquetMetaData>>> {
        async move {
            let size = self.size;
            let meta = parquet::file::metadata::ParquetMetaDataReader::new()
                .with_arrow_reader_options(options)
                .load_and_finish(self, size)
                .await?;
            Ok(Arc::new(meta))
        }
        .boxed()
    }
}

/// `schema` with dictionary-encoded columns (every pandas `category`) as their values' type:
/// rows travel as JSON, where a dictionary is just its values, and an output table is written
/// with plain columns.
fn plain(schema: &Schema) -> Schema {
    fn field(f: &arrow_schema::Field) -> arrow_schema::Field {
        f.clone().with_data_type(ty(f.data_type()))
    }
    fn ty(t: &DataType) -> DataType {
        match t {
            DataType::Dictionary(_, values) => ty(values),
            // Rows carry bytes as text (see `bytes_value`; a column of bytes is written back
            // as bytes, below), durations as a count of their unit (kept in the column's
            // name, `dur` → an Int64 of microseconds for duration[us]), and dates as dates (a
            // Date64 would be written as a bare Int64 of milliseconds).
            t if is_binary(t) => DataType::Utf8,
            DataType::Duration(_) => DataType::Int64,
            DataType::Date64 => DataType::Date32,
            DataType::List(f) => DataType::List(Arc::new(field(f))),
            DataType::LargeList(f) => DataType::LargeList(Arc::new(field(f))),
            DataType::FixedSizeList(f, n) => DataType::FixedSizeList(Arc::new(field(f)), *n),
            DataType::Struct(fs) => DataType::Struct(fs.iter().map(|f| Arc::new(field(f))).collect()),
            other => other.clone(),
        }
    }
    // A column of bytes (a photo dataset's images) is written back as bytes
    // (`OutputColumns::carry`); bytes nested in lists and structs as text.
    let top = |f: &arrow_schema::Field| match is_binary(f.data_type()) {
        true => f.clone().with_data_type(DataType::Binary),
        false => field(f),
    };
    Schema::new_with_metadata(
        schema.fields().iter().map(|f| Arc::new(top(f))).collect::<Vec<_>>(),
        schema.metadata().clone(),
    )
}

/// The columns a CSV header names, all as text; `None` if its first line is not UTF-8 or the
/// file holds no whole first line in `head`.
fn header_as_text(head: &[u8], delimiter: u8) -> Option<Schema> {
    let head = head.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(head);
    let mut csv = csv::ReaderBuilder::new().has_headers(true).delimiter(delimiter).from_reader(head);
    let names = csv.headers().ok()?.clone();
    Some(Schema::new(names.iter().map(|n| arrow_schema::Field::new(n, DataType::Utf8, true)).collect::<Vec<_>>()))
}

/// One schema for several files: equal columns, or the error that says which differ.
fn merge(schemas: Vec<Schema>, what: &str) -> Result<SchemaRef, TableError> {
    Schema::try_merge(schemas)
        .map(Arc::new)
        .map_err(|e| TableError::Usage(format!("--input {what}: its files' columns do not agree: {e}")))
}

fn one_error(e: io::Error) -> BoxStream<'static, io::Result<RawLine>> {
    futures::stream::iter([Err(e)]).boxed()
}

async fn jsonl_lines(store: Arc<dyn ObjectStore>, f: InputFile) -> BoxStream<'static, io::Result<RawLine>> {
    match store.get(&f.path).await {
        Ok(got) => {
            let reader = tokio_util::io::StreamReader::new(got.into_stream().map_err(io::Error::other));
            weir_io::source::lines(Box::new(reader)).boxed()
        }
        Err(e) => one_error(io::Error::other(e)),
    }
}

/// Rows handed from the CSV thread at a time.
const CSV_CHUNK: usize = 512;

async fn csv_lines(
    store: Arc<dyn ObjectStore>,
    f: InputFile,
    url: String,
    schema: SchemaRef,
    delimiter: u8,
) -> BoxStream<'static, io::Result<RawLine>> {
    let got = match store.get(&f.path).await {
        Ok(g) => g,
        Err(e) => return one_error(io::Error::other(e)),
    };
    let reader = Newlines {
        inner: tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(
            got.into_stream().map_err(io::Error::other),
        )),
        at: 0,
        runs: std::collections::VecDeque::new(),
        before: 0,
        last: 0,
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Vec<RawLine>>>(4);
    tokio::task::spawn_blocking(move || {
        let mut csv =
            csv::ReaderBuilder::new().has_headers(true).flexible(true).delimiter(delimiter).from_reader(reader);
        let headers = match csv.headers() {
            Ok(h) => h.clone(),
            Err(e) => {
                let _ = tx.blocking_send(Err(io::Error::other(format!("{url}: {e}"))));
                return;
            }
        };
        let mut chunk = Vec::with_capacity(CSV_CHUNK + 1);
        let mut record = csv::StringRecord::new();
        // Whether the last record's last field spans lines: with a file that does not end in a
        // quote, that field's quote was never closed and swallowed the rest of the file.
        let mut spans_lines = false;
        loop {
            let item = match csv.read_record(&mut record) {
                Ok(false) => break,
                Ok(true) => {
                    let line = record.position().map_or(0, |p| csv.get_mut().line_at(p.byte()));
                    spans_lines = record.iter().next_back().is_some_and(|f| f.contains('\n'));
                    csv_row(&headers, &record, &schema, line, &url)
                }
                Err(e) => {
                    let line = e.position().map_or(0, |p| csv.get_mut().line_at(p.byte()));
                    match e.kind() {
                        // Bad UTF-8 in one record: that record is an error row, the rest go on.
                        csv::ErrorKind::Utf8 { .. } => RawLine {
                            line,
                            bytes: Vec::new(),
                            malformed: Some(format!("{url} line {line}: not valid UTF-8 ({e})")),
                            origin: None,
                        },
                        _ => {
                            let _ = tx.blocking_send(Err(io::Error::other(format!("{url}: {e}"))));
                            return;
                        }
                    }
                }
            };
            chunk.push(item);
            // The last record is held back until the end is known (see `spans_lines`).
            if chunk.len() > CSV_CHUNK {
                let last = chunk.pop().expect("full");
                if tx.blocking_send(Ok(std::mem::replace(&mut chunk, vec![last]))).is_err() {
                    return;
                }
            }
        }
        if spans_lines && csv.get_ref().last != b'"' {
            if let Some(last) = chunk.last_mut() {
                last.malformed = Some(format!(
                    "{url} line {}: a quote opened on this line is never closed, so the rest of the file (from line \
                     {} on) was read as one value; close the quote (or double it: \"\") and run again",
                    last.line,
                    last.line + 1
                ));
            }
        }
        if !chunk.is_empty() {
            let _ = tx.blocking_send(Ok(chunk));
        }
    });
    tokio_stream_of(rx)
}

/// The CSV parser's reader, noting the runs of line breaks (`\r` and `\n` bytes) it passes on
/// — where each starts and ends and how many newlines it holds — for records' line numbers.
struct Newlines<R> {
    inner: R,
    at: u64,
    /// Runs read ahead of the last record asked about: (start, end, newlines).
    runs: std::collections::VecDeque<(u64, u64, u64)>,
    /// Newlines in the runs already passed.
    before: u64,
    /// The last byte read that is not a line break.
    last: u8,
}

impl<R> Newlines<R> {
    /// The physical line a record starting at `byte` is on: one more than the newlines before
    /// it (the parser's own count is one short for CRLF files, so an Excel copy of a file and
    /// a Unix copy would number, and so identify, their records differently). Every run of
    /// line breaks that starts at or before `byte` counts: the parser may put a record's start
    /// inside the run (at the `\n` of a CRLF, or in blank lines before it).
    fn line_at(&mut self, byte: u64) -> u64 {
        while let Some(&(start, _, count)) = self.runs.front() {
            if start > byte {
                break;
            }
            self.runs.pop_front();
            self.before += count;
        }
        self.before + 1
    }
}

impl<R: io::Read> io::Read for Newlines<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(b) = buf[..n].iter().rev().find(|b| !matches!(b, b'\r' | b'\n')) {
            self.last = *b;
        }
        for (i, b) in buf[..n].iter().enumerate() {
            if !matches!(b, b'\r' | b'\n') {
                continue;
            }
            let at = self.at + i as u64;
            let newline = u64::from(*b == b'\n');
            match self.runs.back_mut() {
                Some(run) if run.1 == at => {
                    run.1 += 1;
                    run.2 += newline;
                }
                _ => self.runs.push_back((at, at + 1, newline)),
            }
        }
        self.at += n as u64;
        Ok(n)
    }
}

fn tokio_stream_of(
    rx: tokio::sync::mpsc::Receiver<io::Result<Vec<RawLine>>>,
) -> BoxStream<'static, io::Result<RawLine>> {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|chunk| (chunk, rx)) })
        .flat_map(|chunk| match chunk {
            Ok(lines) => futures::stream::iter(lines.into_iter().map(Ok).collect::<Vec<_>>()),
            Err(e) => futures::stream::iter(vec![Err(e)]),
        })
        .boxed()
}

/// One CSV record as a JSON object line, its values typed by the column's inferred type; a
/// record with the wrong number of fields is an error row that keeps its text.
fn csv_row(headers: &csv::StringRecord, record: &csv::StringRecord, schema: &Schema, line: u64, url: &str) -> RawLine {
    if record.len() != headers.len() {
        let text = record.iter().collect::<Vec<_>>().join(",");
        return RawLine {
            line,
            bytes: text.into_bytes(),
            malformed: Some(format!(
                "{url} line {line}: {} fields where the header has {}",
                record.len(),
                headers.len()
            )),
            origin: None,
        };
    }
    let mut obj = serde_json::Map::with_capacity(headers.len());
    for (name, text) in headers.iter().zip(record.iter()) {
        let ty = schema.field_with_name(name).map(|f| f.data_type().clone()).unwrap_or(DataType::Utf8);
        obj.insert(name.to_string(), csv_value(text, &ty));
    }
    RawLine { line, bytes: serde_json::to_vec(&obj).unwrap_or_default(), malformed: None, origin: None }
}

/// A CSV field as the JSON value of its column's type: empty is null except in a text column
/// (as pyarrow reads CSV); text that does not parse as the type stays text.
fn csv_value(text: &str, ty: &DataType) -> serde_json::Value {
    use serde_json::Value;
    if text.is_empty() {
        return if matches!(ty, DataType::Utf8 | DataType::LargeUtf8) {
            Value::String(String::new())
        } else {
            Value::Null
        };
    }
    let parsed = match ty {
        DataType::Int64 | DataType::Int32 => text.parse::<i64>().ok().map(Value::from),
        DataType::Float64 | DataType::Float32 => {
            text.parse::<f64>().ok().and_then(serde_json::Number::from_f64).map(Value::Number)
        }
        DataType::Boolean => match text.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        DataType::Null => Some(Value::Null),
        _ => None,
    };
    parsed.unwrap_or_else(|| Value::String(text.to_string()))
}

/// Rows decoded at a time from a Parquet row group.
const PARQUET_BATCH: usize = 1024;

async fn parquet_lines(
    store: Arc<dyn ObjectStore>,
    f: InputFile,
    url: String,
) -> BoxStream<'static, io::Result<RawLine>> {
    let mut reader = ObjectReader::new(store.clone(), f.path.clone()).with_file_size(f.size);
    let meta = match ArrowReaderMetadata::load_async(&mut reader, ArrowReaderOptions::default()).await {
        Ok(m) => m,
        Err(e) => return one_error(io::Error::other(format!("{url}: not a readable Parquet file: {e}"))),
    };
    let groups: Vec<u64> = meta.metadata().row_groups().iter().map(|g| g.num_rows().max(0) as u64).collect();
    let mut first = 0u64;
    let mut spans = Vec::with_capacity(groups.len());
    for (i, rows) in groups.into_iter().enumerate() {
        spans.push((i, first, rows));
        first += rows;
    }
    futures::stream::iter(spans)
        .flat_map(move |(group, first, rows)| {
            let open = GroupOpen { store: store.clone(), path: f.path.clone(), size: f.size, meta: meta.clone() };
            row_group_lines(open, group, first, rows, url.clone())
        })
        .boxed()
}

/// What it takes to open one row group of a file whose footer has been read.
struct GroupOpen {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    size: u64,
    meta: ArrowReaderMetadata,
}

/// Where reading one row group is.
enum Group {
    Start(GroupOpen),
    Reading(ParquetRecordBatchStream<ObjectReader>),
    /// Rows from `next` on could not be read: each becomes an error row.
    Failing(String),
    Done,
}

/// The rows of one row group as lines; if the group cannot be decoded, an error row for each of
/// its rows not yet read, naming the file and the group.
fn row_group_lines(
    open: GroupOpen,
    group: usize,
    first: u64,
    rows: u64,
    url: String,
) -> BoxStream<'static, io::Result<RawLine>> {
    let end = first + rows;
    futures::stream::unfold((Group::Start(open), first), move |(state, next)| {
        let url = url.clone();
        async move {
            let fail = |e: &dyn std::fmt::Display| {
                Group::Failing(format!("{url}: row group {group} (rows {}-{end}) could not be read: {e}", first + 1))
            };
            let mut state = state;
            loop {
                state = match state {
                    Group::Start(o) => {
                        let reader = ObjectReader::new(o.store, o.path).with_file_size(o.size);
                        match ParquetRecordBatchStreamBuilder::new_with_metadata(reader, o.meta)
                            .with_row_groups(vec![group])
                            .with_batch_size(PARQUET_BATCH)
                            .build()
                        {
                            Ok(s) => Group::Reading(s),
                            Err(e) => fail(&e),
                        }
                    }
                    Group::Reading(mut s) => match s.next().await {
                        None => Group::Done,
                        Some(Ok(batch)) => match batch_lines(&batch, next) {
                            Ok(lines) => {
                                let n = lines.len() as u64;
                                return Some((
                                    lines.into_iter().map(Ok).collect::<Vec<_>>(),
                                    (Group::Reading(s), next + n),
                                ));
                            }
                            Err(e) => fail(&e),
                        },
                        Some(Err(e)) => fail(&e),
                    },
                    Group::Failing(msg) => {
                        if next >= end {
                            return None;
                        }
                        let upto = (next + PARQUET_BATCH as u64).min(end);
                        let lines = (next..upto)
                            .map(|i| {
                                Ok(RawLine {
                                    line: i + 1,
                                    bytes: Vec::new(),
                                    malformed: Some(msg.clone()),
                                    origin: None,
                                })
                            })
                            .collect::<Vec<_>>();
                        return Some((lines, (Group::Failing(msg), upto)));
                    }
                    Group::Done => return None,
                };
            }
        }
    })
    .flat_map(futures::stream::iter)
    .boxed()
}

/// True for the column types that hold bytes (Parquet `BYTE_ARRAY` without the UTF-8 mark).
/// A dictionary of bytes (how some writers store a column of repeated images or files) holds
/// bytes too: its values are what a row has.
fn is_binary(t: &DataType) -> bool {
    match t {
        DataType::Dictionary(_, values) => is_binary(values),
        t => {
            matches!(t, DataType::Binary | DataType::LargeBinary | DataType::BinaryView | DataType::FixedSizeBinary(_))
        }
    }
}

/// Bytes as JSON: text when they are UTF-8 (a prompt stored as bytes is still the prompt, not
/// its hex); else `{"base64": …}`, which keeps them and is no string, so a prompt of such bytes
/// is that record's error, found before any call. A PDF is kept as bytes even when all of it
/// is UTF-8 (a small PDF written in ASCII): as text, a media field would take it for a path.
fn bytes_value(written: &str) -> serde_json::Value {
    use base64::Engine;
    match hex::decode(written).ok().map(String::from_utf8) {
        Some(Ok(text)) if text.starts_with("%PDF-") => {
            serde_json::json!({ "base64": base64::engine::general_purpose::STANDARD.encode(text.into_bytes()) })
        }
        Some(Ok(text)) => serde_json::Value::String(text),
        Some(Err(e)) => {
            serde_json::json!({ "base64": base64::engine::general_purpose::STANDARD.encode(e.into_bytes()) })
        }
        None => serde_json::Value::String(written.to_string()),
    }
}

/// The value a column's JSON should have in a row (given the row and what the writer wrote),
/// or `None` to keep what it wrote.
type Patch<'a> = Box<dyn Fn(usize, &serde_json::Value) -> Option<serde_json::Value> + 'a>;

/// A batch of rows as JSON-object lines numbered from `first + 1`.
///
/// What JSON cannot say as the JSON writer says it is put right, so that values reach every
/// output as they were: bytes (hex from the writer) as text or base64; NaN and ±infinity (null
/// from the writer) as the strings `NaN`, `Infinity`, `-Infinity`, which a float column of a
/// table output reads back as the numbers; durations (ISO text from the writer, which no
/// reader takes back) as their count of the column's unit.
pub(crate) fn batch_lines(batch: &RecordBatch, first: u64) -> Result<Vec<RawLine>, arrow_schema::ArrowError> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{
        DurationMicrosecondType, DurationMillisecondType, DurationNanosecondType, DurationSecondType, Float32Type,
        Float64Type,
    };
    use arrow_array::Array;
    use arrow_schema::TimeUnit;
    let schema = batch.schema();
    // Per column to patch: the value of each row, or None to leave the row's value as written.
    let mut patches: Vec<(String, Patch<'_>)> = Vec::new();
    for (i, f) in schema.fields().iter().enumerate() {
        let col = batch.column(i);
        let t = f.data_type();
        if is_binary(t) {
            patches.push((f.name().clone(), Box::new(|_, v| v.as_str().map(bytes_value))));
        } else if matches!(t, DataType::Float64 | DataType::Float32) {
            let value = move |row: usize| -> Option<f64> {
                match t {
                    DataType::Float64 => Some(col.as_primitive::<Float64Type>().value(row)),
                    _ => Some(col.as_primitive::<Float32Type>().value(row) as f64),
                }
            };
            let any = (0..col.len()).any(|r| col.is_valid(r) && value(r).is_some_and(|x| !x.is_finite()));
            if any {
                patches.push((
                    f.name().clone(),
                    Box::new(move |row, _| {
                        let x = value(row).filter(|x| col.is_valid(row) && !x.is_finite())?;
                        let text = if x.is_nan() {
                            "NaN"
                        } else if x > 0.0 {
                            "Infinity"
                        } else {
                            "-Infinity"
                        };
                        Some(serde_json::Value::String(text.into()))
                    }),
                ));
            }
        } else if let DataType::Duration(unit) = t {
            let unit = *unit;
            patches.push((
                f.name().clone(),
                Box::new(move |row, _| {
                    if !col.is_valid(row) {
                        return None;
                    }
                    let n = match unit {
                        TimeUnit::Second => col.as_primitive::<DurationSecondType>().value(row),
                        TimeUnit::Millisecond => col.as_primitive::<DurationMillisecondType>().value(row),
                        TimeUnit::Microsecond => col.as_primitive::<DurationMicrosecondType>().value(row),
                        TimeUnit::Nanosecond => col.as_primitive::<DurationNanosecondType>().value(row),
                    };
                    Some(serde_json::Value::from(n))
                }),
            ));
        }
    }
    let lines = json_lines(batch, first)?;
    if patches.is_empty() {
        return Ok(lines);
    }
    Ok(lines
        .into_iter()
        .enumerate()
        .map(|(row, mut l)| {
            if let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_slice::<serde_json::Value>(&l.bytes) {
                for (name, patch) in &patches {
                    let now = obj.get(name).cloned().unwrap_or(serde_json::Value::Null);
                    if let Some(v) = patch(row, &now) {
                        obj.insert(name.clone(), v);
                    }
                }
                l.bytes = serde_json::to_vec(&obj).unwrap_or(l.bytes);
            }
            l
        })
        .collect())
}

fn json_lines(batch: &RecordBatch, first: u64) -> Result<Vec<RawLine>, arrow_schema::ArrowError> {
    let mut w = arrow_json::WriterBuilder::new()
        .with_explicit_nulls(true)
        .build::<_, arrow_json::writer::LineDelimited>(Vec::new());
    w.write(batch)?;
    w.finish()?;
    let bytes = w.into_inner();
    Ok(bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .enumerate()
        .map(|(i, l)| RawLine { line: first + i as u64 + 1, bytes: l.to_vec(), malformed: None, origin: None })
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn csv_rows_count_records_not_lines() {
        let path = std::env::temp_dir().join(format!("weir-csv-rows-{}.csv", std::process::id()));
        let text = "id,prompt\n1,\"two\nlines\"\n\n2,\"a \"\"quoted\"\"\nword\"\r\n3,plain\n4,last without newline";
        std::fs::write(&path, text).unwrap();
        assert_eq!(super::csv_rows(&path).unwrap(), 5, "the header and four records");
        std::fs::remove_file(&path).unwrap();
    }

    use super::*;
    use arrow_array::{BinaryArray, DictionaryArray, Int32Array};

    fn row(batch: &RecordBatch) -> serde_json::Value {
        let lines = batch_lines(batch, 0).unwrap();
        serde_json::from_slice(&lines[0].bytes).unwrap()
    }

    #[test]
    fn bytes_reach_rows_as_base64_plain_or_dictionary_encoded() {
        use base64::Engine;
        let png: &[u8] = b"\x89PNG\r\n\x1a\n\x00\xff";
        let b64 = base64::engine::general_purpose::STANDARD.encode(png);
        let flat = BinaryArray::from(vec![png]);
        let dict = DictionaryArray::new(Int32Array::from(vec![0]), Arc::new(BinaryArray::from(vec![png])));
        for col in [Arc::new(flat) as arrow_array::ArrayRef, Arc::new(dict)] {
            let schema = Schema::new(vec![arrow_schema::Field::new("img", col.data_type().clone(), true)]);
            let batch = RecordBatch::try_new(Arc::new(schema.clone()), vec![col]).unwrap();
            assert_eq!(row(&batch)["img"], serde_json::json!({ "base64": b64 }), "{:?}", schema.field(0));
            assert_eq!(plain(&schema).field(0).data_type(), &DataType::Binary, "written back as bytes");
        }
        // A PDF all in ASCII stays bytes (as text, a media field took it for a path); other
        // UTF-8 bytes are text.
        let pdf: &[u8] = b"%PDF-1.4\n%fake";
        let col = Arc::new(BinaryArray::from(vec![pdf, b"a prompt".as_slice()])) as arrow_array::ArrayRef;
        let schema = Schema::new(vec![arrow_schema::Field::new("doc", col.data_type().clone(), true)]);
        let batch = RecordBatch::try_new(Arc::new(schema), vec![col]).unwrap();
        let b64 = base64::engine::general_purpose::STANDARD.encode(pdf);
        assert_eq!(row(&batch)["doc"], serde_json::json!({ "base64": b64 }));
        let lines = batch_lines(&batch, 0).unwrap();
        let second: serde_json::Value = serde_json::from_slice(&lines[1].bytes).unwrap();
        assert_eq!(second["doc"], "a prompt");
    }
}
