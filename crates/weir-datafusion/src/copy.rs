//! `COPY (SELECT …) TO 'out.parquet'` that either writes the whole result or leaves what was
//! there.
//!
//! DataFusion writes a COPY's file as rows arrive and finishes it even when the query fails, so
//! a query that failed half-way (a failed row with `fail_on_error`, Ctrl-C, a lost executor)
//! replaced a complete earlier result with a short one — after the model calls of the lost
//! rows were paid for twice. A single-file COPY here writes to a hidden file beside the target
//! (readers of the directory skip names starting with `.`) and renames it over the target only
//! when the statement succeeded; otherwise the hidden file is deleted. A COPY to a directory
//! adds new files under fresh names and never replaces one, so it is left as DataFusion does it.

use datafusion::common::{DataFusionError, Result};
use datafusion::datasource::listing::ListingTableUrl;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use object_store::path::Path;
use object_store::ObjectStoreExt;

/// A COPY being written to a staging file.
#[derive(Debug)]
pub struct StagedCopy {
    /// Where the result goes when the statement succeeds.
    target: ListingTableUrl,
    /// Where it is written meanwhile.
    staging: ListingTableUrl,
}

/// `plan` made ready to run: a relative COPY target made absolute (on a cluster the executors
/// would otherwise resolve it from their own working directories) and a single-file COPY sent
/// to a staging file, returned with it to [`StagedCopy::commit`] or [`StagedCopy::abandon`].
/// A COPY to CSV of a column CSV cannot hold (a `_result` struct, an embedding) is refused
/// here, before any model is called, rather than failing once the rows are paid for.
///
/// `EXPLAIN ANALYZE COPY …` runs the COPY too, so it is staged the same way.
pub fn prepare(plan: LogicalPlan) -> Result<(LogicalPlan, Option<StagedCopy>)> {
    match plan {
        LogicalPlan::Analyze(mut analyze) => {
            let (input, staged) = prepare(std::sync::Arc::unwrap_or_clone(analyze.input))?;
            analyze.input = std::sync::Arc::new(input);
            Ok((LogicalPlan::Analyze(analyze), staged))
        }
        LogicalPlan::Copy(copy) => prepare_copy(copy),
        other => Ok((other, None)),
    }
}

fn prepare_copy(mut copy: datafusion::logical_expr::dml::CopyTo) -> Result<(LogicalPlan, Option<StagedCopy>)> {
    if copy.file_type.get_ext().eq_ignore_ascii_case("csv") {
        check_csv(copy.input.schema(), &format!("COPY … TO '{}'", copy.output_url))?;
    }
    if !copy.output_url.contains("://") && !copy.output_url.starts_with('/') {
        let cwd = std::env::current_dir()?;
        copy.output_url = cwd.join(&copy.output_url).to_string_lossy().into_owned();
    }
    let target = ListingTableUrl::parse(&copy.output_url)?;
    let single = match copy.options.get("single_file_output").map(|v| v.trim()) {
        Some("true") => true,
        Some(_) => false,
        None => copy.partition_by.is_empty() && !target.is_collection() && target.file_extension().is_some(),
    };
    if !single {
        return Ok((LogicalPlan::Copy(copy), None));
    }
    let Some((dir, name)) = copy.output_url.rsplit_once('/') else {
        return Ok((LogicalPlan::Copy(copy), None));
    };
    let staging_url = format!("{dir}/.{name}.weir-partial-{}", std::process::id());
    let staging = ListingTableUrl::parse(&staging_url)?;
    copy.output_url = staging_url;
    // The staging name's own extension must not decide the output mode.
    copy.options.insert("single_file_output".into(), "true".into());
    // JSON lines by `.jsonl`/`.ndjson` are DataFusion's JSON writer under weir's names, which
    // a cluster cannot ship in a plan; the file is named by the target anyway.
    if matches!(copy.file_type.get_ext().to_ascii_lowercase().as_str(), "jsonl" | "ndjson") {
        copy.file_type = datafusion::datasource::file_format::format_as_file_type(std::sync::Arc::new(
            datafusion::datasource::file_format::json::JsonFormatFactory::new(),
        ));
    }
    Ok((LogicalPlan::Copy(copy), Some(StagedCopy { target, staging })))
}

/// Refuses (as a planning error) columns that CSV cannot hold: structs, lists, maps.
pub fn check_csv(schema: &datafusion::common::DFSchema, what: &str) -> Result<()> {
    use datafusion::arrow::datatypes::DataType;
    for field in schema.fields() {
        let kind = match field.data_type() {
            DataType::Struct(_) => "a struct",
            DataType::List(_) | DataType::LargeList(_) | DataType::FixedSizeList(..) => "a list",
            DataType::Map(..) => "a map",
            DataType::Union(..) => "a union",
            _ => continue,
        };
        let name = field.name();
        let instead = if kind == "a struct" {
            format!("select its fields ({name}['response'], {name}['error_kind'], …)")
        } else {
            format!("turn it into text (array_to_string({name}, ' ')) or leave it out")
        };
        return datafusion::common::plan_err!(
            "{what}: CSV cannot hold column {name} ({kind}); {instead}, or write JSON lines or Parquet instead"
        );
    }
    Ok(())
}

impl StagedCopy {
    /// Creates the (empty) staging file, so that a target that cannot be written (no such
    /// directory and none can be made, no permission, a read-only file system) fails the
    /// statement before any model is called rather than after every call was paid for.
    pub async fn preflight(&self, ctx: &SessionContext) -> Result<()> {
        let cannot = |e: &dyn std::fmt::Display| {
            DataFusionError::Plan(format!("COPY … TO '{}': cannot write there ({e})", self.target))
        };
        if let Some(path) = self.local_path() {
            // A local path: checked with the file system itself (object_store's local store
            // retries a failed create by making the parent directory, without end where the
            // parent exists but cannot hold files, as under /proc).
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| cannot(&e))?;
            }
            std::fs::File::create(&path).map_err(|e| cannot(&e))?;
            return Ok(());
        }
        let (store, staging, _) = self.parts(ctx)?;
        store.put(&staging, object_store::PutPayload::new()).await.map_err(|e| cannot(&e))?;
        Ok(())
    }

    /// The staging file's path, if it is on a local disk.
    fn local_path(&self) -> Option<std::path::PathBuf> {
        url::Url::parse(self.staging.as_str()).ok()?.to_file_path().ok()
    }

    /// The object store and the two paths in it.
    fn parts(&self, ctx: &SessionContext) -> Result<(std::sync::Arc<dyn object_store::ObjectStore>, Path, Path)> {
        let store = ctx.runtime_env().object_store(self.target.object_store())?;
        Ok((store, self.staging.prefix().clone(), self.target.prefix().clone()))
    }

    /// Puts the finished result in place of the target (a rename on a local disk; a copy and a
    /// delete on an object store, where a reader sees either the old object or the new one).
    ///
    /// On a cluster, the executors write a local path on their own machines: if the staging
    /// file here is still the empty one [`StagedCopy::preflight`] made, they wrote it elsewhere,
    /// and renaming it would replace the target with nothing.
    pub async fn commit(self, ctx: &SessionContext, on_cluster: bool) -> Result<()> {
        let (store, staging, target) = self.parts(ctx)?;
        if on_cluster && self.local_path().is_some_and(|p| std::fs::metadata(p).is_ok_and(|m| m.len() == 0)) {
            let _ = store.delete(&staging).await;
            return Err(DataFusionError::Execution(format!(
                "the cluster's executors wrote the COPY's result on their own machines (as {}), not on this one, \
                 so {} is as it was. On a cluster, COPY to a path every machine shares (a network file system) \
                 or to an object store (s3://, gs://)",
                self.staging, self.target
            )));
        }
        store.rename(&staging, &target).await.map_err(|e| {
            DataFusionError::Execution(format!(
                "the COPY's result is complete in {} but could not be moved to {}: {e}",
                self.staging, self.target
            ))
        })
    }

    /// Deletes what the failed statement wrote; the target is as it was. `settle`: how long
    /// writers elsewhere may go on after the statement ended (a cluster's executors finish the
    /// file they were writing after their task is cancelled), after which it is deleted again.
    pub async fn abandon(self, ctx: &SessionContext, settle: Option<std::time::Duration>) {
        let Ok((store, staging, _)) = self.parts(ctx) else { return };
        let delete = || async {
            match store.delete(&staging).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => tracing::warn!("could not delete the unfinished COPY output {}: {e}", self.staging),
            }
        };
        delete().await;
        if let Some(settle) = settle {
            tokio::time::sleep(settle).await;
            delete().await;
        }
    }

    /// The target, for messages.
    pub fn target(&self) -> &str {
        self.target.as_str()
    }
}
