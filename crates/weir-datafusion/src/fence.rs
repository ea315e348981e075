//! The places a cluster executor lets a query read and write.
//!
//! A query's plan names the files it reads (a scan's file groups) and the location it writes (a
//! sink's table paths), and on a cluster it is written by whoever can reach the scheduler. An
//! executor of weir's therefore checks every task's plan before running it: a file outside its
//! allowed prefixes (`weir cluster executor --allow-path`, `--allow-url`) fails the task before
//! any row is read or any model called, with a message naming the place. Writes of a kind the
//! check cannot see into (anything but DataFusion's Parquet, CSV and JSON sinks) are refused.

use datafusion::common::{DataFusionError, Result};
use datafusion::datasource::file_format::csv::CsvSink;
use datafusion::datasource::file_format::json::JsonSink;
use datafusion::datasource::file_format::parquet::ParquetSink;
use datafusion::datasource::memory::DataSourceExec;
use datafusion::datasource::physical_plan::{FileScanConfig, FileSink};
use datafusion::datasource::sink::DataSinkExec;
use datafusion::physical_plan::ExecutionPlan;
use object_store::path::Path as ObjPath;
use object_store::ObjectStore;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where an executor's queries may read and write.
#[derive(Debug, Clone, Default)]
pub struct Allowed {
    /// Local directories (absolute, with symbolic links resolved).
    dirs: Vec<PathBuf>,
    /// Object store prefixes, `s3://bucket/prefix` or `gs://bucket/prefix`.
    urls: Vec<String>,
}

impl Allowed {
    /// Local directories and object store prefixes; a directory must exist (it is resolved, so
    /// that a link inside it cannot lead out), a URL must name a bucket.
    pub fn new(dirs: &[PathBuf], urls: &[String]) -> std::result::Result<Self, String> {
        let mut resolved = Vec::new();
        for d in dirs {
            let r = d.canonicalize().map_err(|e| format!("--allow-path {}: {e}", d.display()))?;
            if !r.is_dir() {
                return Err(format!("--allow-path {}: not a directory", d.display()));
            }
            resolved.push(r);
        }
        let mut prefixes = Vec::new();
        for u in urls {
            let ok = ["s3://", "gs://"]
                .iter()
                .any(|s| u.strip_prefix(s).is_some_and(|rest| !rest.starts_with('/') && !rest.is_empty()));
            if !ok {
                return Err(format!("--allow-url {u}: expected s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX]"));
            }
            prefixes.push(u.trim_end_matches('/').to_string());
        }
        Ok(Self { dirs: resolved, urls: prefixes })
    }

    /// Whether `place` (a local path or an object store URL) is inside an allowed prefix.
    pub fn permits(&self, place: &str) -> bool {
        if let Some(rest) = place.strip_prefix("file://") {
            return self.permits_file(Path::new(rest));
        }
        if place.starts_with('/') {
            return self.permits_file(Path::new(place));
        }
        self.urls.iter().any(|p| place == p || place.starts_with(&format!("{p}/")))
    }

    /// A local path: resolved as far as it exists (a file not yet written, under a directory
    /// that is), so that links and `..` cannot lead out of an allowed directory.
    fn permits_file(&self, path: &Path) -> bool {
        let mut existing = path.to_path_buf();
        let mut rest = Vec::new();
        let resolved = loop {
            match existing.canonicalize() {
                Ok(r) => break r,
                Err(_) => match (existing.parent(), existing.file_name()) {
                    (Some(parent), Some(name)) => {
                        rest.push(name.to_owned());
                        existing = parent.to_path_buf();
                    }
                    _ => return false,
                },
            }
        };
        if rest.iter().any(|n| n == "..") {
            return false;
        }
        let full = rest.iter().rev().fold(resolved, |p, n| p.join(n));
        self.dirs.iter().any(|d| full.starts_with(d))
    }

    /// What is allowed, for messages.
    pub(crate) fn describe(&self) -> String {
        let all: Vec<String> =
            self.dirs.iter().map(|d| d.display().to_string()).chain(self.urls.iter().cloned()).collect();
        if all.is_empty() {
            "nothing".into()
        } else {
            all.join(", ")
        }
    }

    /// Checks every file `plan` reads or writes; the first one outside is the error.
    pub fn check(&self, plan: &dyn ExecutionPlan) -> Result<()> {
        for place in places(plan)? {
            if !self.permits(&place) {
                return Err(DataFusionError::Plan(format!(
                    "this executor may not read or write {place}: it allows {} (weir cluster executor --allow-path \
                     DIR / --allow-url s3://BUCKET/PREFIX); no row was read and no model called",
                    self.describe()
                )));
            }
        }
        Ok(())
    }
}

/// The files `plan` reads and the locations it writes, as paths or URLs.
fn places(plan: &dyn ExecutionPlan) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack: Vec<&dyn ExecutionPlan> = vec![plan];
    while let Some(node) = stack.pop() {
        if let Some(scan) = node.downcast_ref::<DataSourceExec>() {
            if let Some(files) = scan.data_source().downcast_ref::<FileScanConfig>() {
                for group in &files.file_groups {
                    for f in group.files() {
                        out.push(place(&files.object_store_url, f.object_meta.location.as_ref()));
                    }
                }
            }
        }
        if let Some(sink) = node.downcast_ref::<DataSinkExec>() {
            let any = sink.sink();
            let config = if let Some(s) = any.downcast_ref::<ParquetSink>() {
                s.config()
            } else if let Some(s) = any.downcast_ref::<CsvSink>() {
                s.config()
            } else if let Some(s) = any.downcast_ref::<JsonSink>() {
                s.config()
            } else {
                return Err(DataFusionError::Plan(format!(
                    "this executor does not run writes of this kind ({}); write Parquet, CSV or JSON lines",
                    DisplayName(sink)
                )));
            };
            for t in &config.table_paths {
                out.push(place(&config.object_store_url, t.prefix().as_ref()));
            }
        }
        stack.extend(node.children().into_iter().map(|c| c.as_ref()));
    }
    Ok(out)
}

/// A path in an object store as a local path (`/a/b`) or a URL (`s3://bucket/a/b`).
fn place(store: &datafusion::execution::object_store::ObjectStoreUrl, path: &str) -> String {
    let base = store.as_str().trim_end_matches('/');
    if base == "file:" {
        format!("/{path}")
    } else {
        format!("{base}/{path}")
    }
}

/// A sink's one-line description.
struct DisplayName<'a>(&'a DataSinkExec);

impl std::fmt::Display for DisplayName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        datafusion::physical_plan::DisplayAs::fmt_as(self.0, datafusion::physical_plan::DisplayFormatType::Default, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_places_under_an_allowed_prefix_pass() {
        let dir = std::env::temp_dir().join(format!("weir-fence-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let outside = std::env::temp_dir().join(format!("weir-fence-out-{}", std::process::id()));
        std::fs::create_dir_all(&outside).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(&outside, dir.join("data/link")).unwrap();
        let a = Allowed::new(&[dir.join("data")], &["s3://b/in".into()]).unwrap();
        let d = dir.join("data").canonicalize().unwrap();
        assert!(a.permits(&format!("file://{}/x.parquet", d.display())));
        assert!(a.permits(&format!("{}/new/dir/x.parquet", d.display())), "not yet written");
        assert!(!a.permits(&format!("{}/../secret", d.display())));
        assert!(!a.permits(&format!("{}/link/x", d.display())), "a link leading out");
        assert!(!a.permits("/etc/hostname"));
        assert!(!a.permits(&format!("{}-other/x", d.display())), "a sibling sharing the prefix");
        assert!(a.permits("s3://b/in/x.parquet") && a.permits("s3://b/in"));
        assert!(!a.permits("s3://b/inside/x") && !a.permits("s3://c/in/x") && !a.permits("gs://b/in/x"));
        assert!(!Allowed::default().permits(&format!("{}/x", d.display())));
        assert!(Allowed::new(&[], &["http://x".into()]).is_err());
        assert!(Allowed::new(&[dir.join("nope")], &[]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&outside).unwrap();
    }
}

/// An object store whose every read, listing and write is checked against the places allowed,
/// for the processes that plan a cluster's queries (the scheduler lists a table's files and may
/// read their footers while planning, before any executor sees the plan).
#[derive(Debug)]
pub struct FencedStore {
    inner: Arc<dyn ObjectStore>,
    /// `file:` or `s3://bucket`: what a path in this store is under.
    base: String,
    allowed: Allowed,
}

impl std::fmt::Display for FencedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fenced {}", self.inner)
    }
}

impl FencedStore {
    /// `inner` serves `url`'s scheme and bucket; its paths are checked against `allowed`.
    pub fn new(inner: Arc<dyn ObjectStore>, url: &url::Url, allowed: Allowed) -> Self {
        let base = match url.scheme() {
            "file" => "file:".to_string(),
            s => format!("{s}://{}", url.host_str().unwrap_or_default()),
        };
        Self { inner, base, allowed }
    }

    fn check(&self, path: &ObjPath) -> object_store::Result<()> {
        let place = if self.base == "file:" { format!("/{path}") } else { format!("{}/{path}", self.base) };
        if self.allowed.permits(&place) {
            return Ok(());
        }
        Err(object_store::Error::PermissionDenied {
            path: place,
            source: format!("this cluster may not read or write here; it allows {}", self.allowed.describe()).into(),
        })
    }

    fn check_prefix(&self, prefix: Option<&ObjPath>) -> object_store::Result<()> {
        self.check(prefix.unwrap_or(&ObjPath::from("")))
    }
}

#[async_trait::async_trait]
impl ObjectStore for FencedStore {
    async fn put_opts(
        &self,
        location: &ObjPath,
        payload: object_store::PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.check(location)?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjPath,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.check(location)?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjPath,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        self.check(location)?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &ObjPath,
        ranges: &[std::ops::Range<u64>],
    ) -> object_store::Result<Vec<bytes::Bytes>> {
        self.check(location)?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<'static, object_store::Result<ObjPath>>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<ObjPath>> {
        use futures::StreamExt;
        let me = (self.base.clone(), self.allowed.clone(), self.inner.clone());
        let checked = locations.map(move |p| {
            let p = p?;
            let store = FencedStore { inner: me.2.clone(), base: me.0.clone(), allowed: me.1.clone() };
            store.check(&p)?;
            Ok(p)
        });
        self.inner.delete_stream(checked.boxed())
    }

    fn list(
        &self,
        prefix: Option<&ObjPath>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        use futures::StreamExt;
        match self.check_prefix(prefix) {
            Ok(()) => self.inner.list(prefix),
            Err(e) => futures::stream::once(async move { Err(e) }).boxed(),
        }
    }

    async fn list_with_delimiter(&self, prefix: Option<&ObjPath>) -> object_store::Result<object_store::ListResult> {
        self.check_prefix(prefix)?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjPath,
        to: &ObjPath,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.check(from)?;
        self.check(to)?;
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &ObjPath,
        to: &ObjPath,
        options: object_store::RenameOptions,
    ) -> object_store::Result<()> {
        self.check(from)?;
        self.check(to)?;
        self.inner.rename_opts(from, to, options).await
    }
}
