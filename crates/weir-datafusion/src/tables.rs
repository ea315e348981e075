//! Tables for `weir sql`: `--table NAME=PATH` registers a JSONL, CSV or Parquet file, glob or
//! directory, local or in `s3://` and `gs://`, and any `s3://` or `gs://` URL a query names
//! (`COPY … TO 's3://…'`) reaches its store with the credentials `weir run` would use.

use datafusion::catalog::Session;
use datafusion::common::{DataFusionError, GetExt, Result};
use datafusion::datasource::file_format::json::JsonFormatFactory;
use datafusion::datasource::file_format::options::{CsvReadOptions, JsonReadOptions, ParquetReadOptions, ReadOptions};
use datafusion::datasource::file_format::{FileFormat, FileFormatFactory};
use datafusion::datasource::listing::{ListingTable, ListingTableConfig, ListingTableUrl};
use datafusion::execution::object_store::{DefaultObjectStoreRegistry, ObjectStoreRegistry};
use datafusion::prelude::SessionContext;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use weir_tables::{Format, Location};

/// Object stores found on demand: a URL's bucket is connected the first time a query reads or
/// writes it, as `weir run` connects its tables (credentials and emulator endpoints from the
/// environment).
#[derive(Debug, Default)]
pub struct Stores {
    known: DefaultObjectStoreRegistry,
    /// On a cluster's processes, the places their stores may touch (see `crate::fence`).
    #[cfg(feature = "cluster")]
    fence: Option<crate::fence::Allowed>,
}

impl Stores {
    /// A registry that knows the local file system and finds `s3://` and `gs://` buckets.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same, with every store it gives out checking each path against `allowed`.
    #[cfg(feature = "cluster")]
    pub fn fenced(allowed: crate::fence::Allowed) -> Self {
        Self { fence: Some(allowed), ..Self::default() }
    }

    /// `store`, fenced when this registry is.
    fn give(&self, url: &url::Url, store: Arc<dyn object_store::ObjectStore>) -> Arc<dyn object_store::ObjectStore> {
        #[cfg(feature = "cluster")]
        if let Some(allowed) = &self.fence {
            return Arc::new(crate::fence::FencedStore::new(store, url, allowed.clone()));
        }
        let _ = url;
        store
    }
}

impl ObjectStoreRegistry for Stores {
    fn register_store(
        &self,
        url: &url::Url,
        store: Arc<dyn object_store::ObjectStore>,
    ) -> Option<Arc<dyn object_store::ObjectStore>> {
        self.known.register_store(url, store)
    }

    fn deregister_store(&self, url: &url::Url) -> Result<Arc<dyn object_store::ObjectStore>> {
        self.known.deregister_store(url)
    }

    fn get_store(&self, url: &url::Url) -> Result<Arc<dyn object_store::ObjectStore>> {
        if let Ok(store) = self.known.get_store(url) {
            return Ok(self.give(url, store));
        }
        if !matches!(url.scheme(), "s3" | "gs") {
            return Err(DataFusionError::Configuration(format!(
                "{url}: weir reads and writes local paths, s3:// and gs://, not {}://",
                url.scheme()
            )));
        }
        let bucket = url.host_str().unwrap_or_default();
        let location = Location::parse(&format!("{}://{bucket}", url.scheme()))
            .map_err(|e| DataFusionError::Configuration(e.to_string()))?;
        let store =
            location.store(&|k| std::env::var(k).ok()).map_err(|e| DataFusionError::Configuration(e.to_string()))?;
        self.known.register_store(url, store.clone());
        Ok(self.give(url, store))
    }
}

/// DataFusion's JSON-lines format under another extension (it knows `.json` only).
#[derive(Debug, Default)]
struct JsonLines(JsonFormatFactory, &'static str);

impl GetExt for JsonLines {
    fn get_ext(&self) -> String {
        self.1.to_string()
    }
}

impl FileFormatFactory for JsonLines {
    fn create(&self, state: &dyn Session, options: &HashMap<String, String>) -> Result<Arc<dyn FileFormat>> {
        self.0.create(state, options)
    }

    fn default(&self) -> Arc<dyn FileFormat> {
        self.0.default()
    }
}

/// Lets queries name `.jsonl` and `.ndjson` files as they name `.json` ones: `SELECT * FROM
/// 'in.jsonl'`, `COPY … TO 'out.jsonl'` (weir's own results are `.jsonl`).
pub fn register_formats(ctx: &SessionContext) -> Result<()> {
    let state = ctx.state_ref();
    let mut state = state.write();
    for ext in ["jsonl", "ndjson"] {
        state.register_file_format(Arc::new(JsonLines(JsonFormatFactory::new(), ext)), true)?;
    }
    Ok(())
}

/// Splits `NAME=PATH`, checking the name is a plain SQL identifier.
pub fn parse_table_arg(arg: &str) -> std::result::Result<(String, String), String> {
    let (name, path) = arg
        .split_once('=')
        .ok_or_else(|| format!("--table {arg}: expected NAME=PATH, e.g. reviews=data/reviews.parquet"))?;
    let name = name.trim();
    let plain = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !plain {
        return Err(format!(
            "--table {arg}: the name '{name}' must be letters, digits and '_', not starting with a digit"
        ));
    }
    if path.trim().is_empty() {
        return Err(format!("--table {arg}: no path after '='"));
    }
    Ok((name.to_string(), path.trim().to_string()))
}

/// The format of a table's files, from the extension of its path (a file or a glob such as
/// `dir/*.parquet`), or of the files in a local directory.
fn format_of(path: &str) -> std::result::Result<(Format, String), String> {
    let by_name = |name: &str| {
        let ext = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase())?;
        let format = Format::from_name(name)?;
        Some((format, format!(".{ext}")))
    };
    if let Some(found) = by_name(path.trim_end_matches('/')) {
        return Ok(found);
    }
    if !path.contains("://") && Path::new(path).is_dir() {
        let mut found: Vec<(Format, String)> = std::fs::read_dir(path)
            .map_err(|e| format!("{path}: {e}"))?
            .filter_map(|e| e.ok())
            .filter_map(|e| by_name(&e.file_name().to_string_lossy()))
            .collect();
        found.sort_by(|a, b| a.1.cmp(&b.1));
        found.dedup_by(|a, b| a.1 == b.1);
        return match found.len() {
            1 => Ok(found.remove(0)),
            0 => Err(format!("{path}: no .jsonl, .csv or .parquet files in this directory")),
            _ => Err(format!(
                "{path}: files of several formats ({}); name one, e.g. {path}/*{}",
                found.iter().map(|f| f.1.as_str()).collect::<Vec<_>>().join(", "),
                found[0].1
            )),
        };
    }
    Err(format!(
        "{path}: cannot tell the format; name the files with their extension, e.g. {}/*.parquet",
        path.trim_end_matches('/')
    ))
}

/// The listing URL of `path`. DataFusion expands globs in local paths only; in `s3://` and
/// `gs://` URLs the glob is split off here (`s3://b/in/*.parquet` → the prefix `s3://b/in/`
/// and the pattern `*.parquet`).
fn table_url(path: &str) -> std::result::Result<ListingTableUrl, String> {
    let bad = |e: &dyn std::fmt::Display| format!("{path}: {e}");
    if !path.contains("://") {
        let path = if Path::new(path).is_dir() { format!("{}/", path.trim_end_matches('/')) } else { path.into() };
        return ListingTableUrl::parse(&path).map_err(|e| bad(&e));
    }
    let globbed = |seg: &str| seg.contains(['*', '?', '[']);
    let (scheme, rest) = path.split_once("://").unwrap_or(("", path));
    let segments: Vec<&str> = rest.split('/').collect();
    match segments.iter().position(|s| globbed(s)) {
        Some(0) => Err(format!("{path}: a bucket name cannot be a pattern")),
        Some(i) => {
            let prefix = format!("{scheme}://{}/", segments[..i].join("/"));
            let pattern = glob::Pattern::new(&segments[i..].join("/")).map_err(|e| bad(&e))?;
            let url = url::Url::parse(&prefix).map_err(|e| bad(&e))?;
            ListingTableUrl::try_new(url, Some(pattern)).map_err(|e| bad(&e))
        }
        None => ListingTableUrl::parse(path).map_err(|e| bad(&e)),
    }
}

/// Registers the table at `path` as `name`.
pub async fn register_table(ctx: &SessionContext, name: &str, path: &str) -> std::result::Result<(), String> {
    let (format, ext) = format_of(path)?;
    let url = table_url(path)?;
    let state = ctx.state();
    let (config, table_options) = (state.config(), state.default_table_options());
    let options = match format {
        Format::Parquet => ParquetReadOptions::default().file_extension(&ext).to_listing_options(config, table_options),
        Format::Csv => CsvReadOptions::new().file_extension(&ext).to_listing_options(config, table_options),
        Format::Jsonl => JsonReadOptions::default().file_extension(&ext).to_listing_options(config, table_options),
    };
    let fail = |e: DataFusionError| format!("--table {name}={path}: {e}");
    let schema = options.infer_schema(&state, &url).await.map_err(fail)?;
    let config = ListingTableConfig::new(url).with_listing_options(options).with_schema(schema);
    let table = ListingTable::try_new(config).map_err(fail)?;
    ctx.register_table(name, Arc::new(table)).map_err(fail)?;
    Ok(())
}

/// Gives every table named by its path (`FROM 'data/t.jsonl'`) without an alias one made of the
/// path's letters and digits (`AS "data_t_jsonl"`). A query's columns are qualified by their
/// table's name, and a cluster's plan carries them as text that the scheduler reads back as
/// `schema.table` when the name holds a dot, so such a query failed there ("No field named
/// t.jsonl.id"); an alias without dots travels intact. The query means the same.
pub fn alias_path_tables(statement: &mut datafusion::sql::parser::Statement) {
    use datafusion::sql::parser::{CopyToSource, Statement};
    use datafusion::sql::sqlparser::ast::{Ident, TableAlias, TableFactor, VisitMut, VisitorMut};
    use std::ops::ControlFlow;

    struct Aliaser(usize);
    impl VisitorMut for Aliaser {
        type Break = ();
        fn pre_visit_table_factor(&mut self, factor: &mut TableFactor) -> ControlFlow<()> {
            if let TableFactor::Table { name, alias: alias @ None, args: None, .. } = factor {
                let path = match name.0.as_slice() {
                    [part] => part.as_ident().map(|i| i.value.clone()),
                    _ => None,
                };
                if let Some(path) = path.filter(|p| p.contains(['.', '/'])) {
                    self.0 += 1;
                    let mut made: String = path
                        .chars()
                        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
                        .collect();
                    made = format!("{}_{}", made.trim_matches('_'), self.0);
                    *alias = Some(TableAlias {
                        explicit: true,
                        name: Ident::with_quote('"', made),
                        columns: vec![],
                        at: None,
                    });
                }
            }
            ControlFlow::Continue(())
        }
    }
    let mut aliaser = Aliaser(0);
    match statement {
        Statement::Statement(s) => {
            let _ = s.visit(&mut aliaser);
        }
        Statement::CopyTo(c) => {
            if let CopyToSource::Query(q) = &mut c.source {
                let _ = q.visit(&mut aliaser);
            }
        }
        Statement::Explain(e) => alias_path_tables(&mut e.statement),
        _ => {}
    }
}

#[cfg(test)]
mod alias_tests {
    #[test]
    fn path_tables_get_aliases_without_dots() {
        let sql = "COPY (SELECT id FROM 'data/t.jsonl' JOIN people p ON true WHERE id IN (SELECT id FROM 'x.csv')) TO 'o.jsonl'";
        let mut statements = datafusion::sql::parser::DFParser::parse_sql(sql).unwrap();
        super::alias_path_tables(&mut statements[0]);
        let text = statements[0].to_string();
        assert!(text.contains("'data/t.jsonl' AS \"data_t_jsonl_1\""), "{text}");
        assert!(text.contains("'x.csv' AS \"x_csv_2\""), "{text}");
        assert!(text.contains("people p "), "{text}");
        // An alias given is kept.
        let mut s = datafusion::sql::parser::DFParser::parse_sql("SELECT * FROM 't.jsonl' AS mine").unwrap();
        super::alias_path_tables(&mut s[0]);
        assert!(s[0].to_string().contains("'t.jsonl' AS mine"), "{}", s[0]);
    }
}
