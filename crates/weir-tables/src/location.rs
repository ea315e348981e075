//! Where tables live: local paths, `s3://bucket/key` and `gs://bucket/key`, one object store
//! each, with credentials found the way each cloud's own tools find them.
//!
//! - S3: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, else the profile
//!   `AWS_PROFILE` (or `default`) of `~/.aws/credentials` (`AWS_SHARED_CREDENTIALS_FILE`), else
//!   the instance's role; region from `AWS_REGION`, `AWS_DEFAULT_REGION` or the profile in
//!   `~/.aws/config`; `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) for S3-compatible stores.
//! - GCS: `GOOGLE_APPLICATION_CREDENTIALS` (a service account or an authorized-user file), else
//!   gcloud's application-default credentials, else the metadata server: the same Application
//!   Default Credentials as Vertex AI. `STORAGE_EMULATOR_HOST` points at an emulator (no auth).
//!
//! Plain `http://` endpoints are accepted only on loopback: anything else must use TLS.

use object_store::aws::AmazonS3Builder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::TableError;

/// How long the first request to a bucket may go unanswered. object_store retries an endpoint
/// that takes connections and never answers for three minutes, without a word; the first
/// request comes before any model call, so stopping sooner and saying why loses nothing.
pub const FIRST_ANSWER: std::time::Duration = std::time::Duration::from_secs(20);

/// The environment variables the stores' credentials and endpoints come from.
pub const ENV_VARS: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "HOME",
];

/// Reads an environment variable (the caller's view of the environment, so tests can pass one).
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Which kind of store a location is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// The local file system.
    Local,
    /// Amazon S3 or an S3-compatible store.
    S3,
    /// Google Cloud Storage.
    Gcs,
}

/// A place in a store: a file or object, or a directory or prefix.
#[derive(Debug, Clone)]
pub struct Location {
    /// The kind of store.
    pub scheme: Scheme,
    /// The bucket (empty for local paths).
    pub bucket: String,
    /// The path inside the store: for local paths, the absolute path without its leading `/`.
    pub path: ObjectPath,
    /// How the user wrote it, for messages.
    pub display: String,
}

impl Location {
    /// Parses `s3://bucket/key`, `gs://bucket/key` or a local path (made absolute).
    pub fn parse(s: &str) -> Result<Self, TableError> {
        let remote = |scheme, rest: &str| -> Result<Self, TableError> {
            let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                let scheme = s.split("://").next().unwrap_or("s3");
                return Err(TableError::Usage(format!("{s}: no bucket name (write it as {scheme}://BUCKET/path)")));
            }
            let path = ObjectPath::parse(key.trim_end_matches('/'))
                .map_err(|e| TableError::Usage(format!("{s}: not a valid object path: {e}")))?;
            Ok(Self { scheme, bucket: bucket.to_string(), path, display: s.to_string() })
        };
        if let Some(rest) = s.strip_prefix("s3://") {
            return remote(Scheme::S3, rest);
        }
        if let Some(rest) = s.strip_prefix("gs://") {
            return remote(Scheme::Gcs, rest);
        }
        if let Some((scheme, _)) = s.split_once("://") {
            return Err(TableError::Usage(format!(
                "{s}: weir reads and writes local paths, s3:// and gs://, not {scheme}://"
            )));
        }
        let abs = absolute(Path::new(s))?;
        let path = ObjectPath::from_filesystem_path(&abs)
            .or_else(|_| ObjectPath::parse(abs.to_string_lossy().trim_start_matches('/')))
            .map_err(|e| TableError::Usage(format!("{s}: {e}")))?;
        Ok(Self { scheme: Scheme::Local, bucket: String::new(), path, display: s.to_string() })
    }

    /// True for `s3://` and `gs://` locations.
    pub fn is_remote(&self) -> bool {
        self.scheme != Scheme::Local
    }

    /// The local file system path of a local location.
    pub fn local_path(&self) -> Option<PathBuf> {
        (self.scheme == Scheme::Local).then(|| PathBuf::from(format!("/{}", self.path)))
    }

    /// The same store, another path in it.
    pub fn with_path(&self, path: ObjectPath) -> Self {
        let display = match self.scheme {
            Scheme::Local => format!("/{path}"),
            Scheme::S3 => format!("s3://{}/{path}", self.bucket),
            Scheme::Gcs => format!("gs://{}/{path}", self.bucket),
        };
        Self { scheme: self.scheme, bucket: self.bucket.clone(), path, display }
    }

    /// The full name of an object in this location's store, for messages and identities.
    pub fn url_of(&self, path: &ObjectPath) -> String {
        self.with_path(path.clone()).display
    }

    /// Awaits `request`, the first one to this location's store, for at most [`FIRST_ANSWER`]
    /// (a local path waits as long as it takes).
    pub async fn first_answer<T>(&self, request: impl std::future::Future<Output = T>) -> Result<T, TableError> {
        if self.scheme == Scheme::Local {
            return Ok(request.await);
        }
        let endpoint = match self.scheme {
            Scheme::Gcs => "STORAGE_EMULATOR_HOST or the network",
            _ => "AWS_ENDPOINT_URL or the network",
        };
        tokio::time::timeout(FIRST_ANSWER, request).await.map_err(|_| {
            TableError::Unavailable(format!(
                "{}: the store did not answer within {} s (is the service up? check {endpoint})",
                self.display.trim_end_matches('/'),
                FIRST_ANSWER.as_secs()
            ))
        })
    }

    /// Connects to the store this location is in.
    pub fn store(&self, env: Env) -> Result<Arc<dyn ObjectStore>, TableError> {
        match self.scheme {
            Scheme::Local => Ok(Arc::new(LocalFileSystem::new())),
            Scheme::S3 => {
                let mut given = Vec::new();
                let store = s3(&self.bucket, env, &mut given)?;
                Ok(crate::masked::Masked::wrap(store, given))
            }
            Scheme::Gcs => Ok(crate::masked::Masked::wrap(gcs(&self.bucket, env)?, Vec::new())),
        }
    }
}

fn absolute(p: &Path) -> Result<PathBuf, TableError> {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().map_err(|e| TableError::Usage(format!("the working directory: {e}")))?.join(p)
    };
    // Resolve `.` and `..` lexically, after the longest existing prefix is made canonical
    // (so `./a` and `a` and a symlinked directory name one place).
    let mut out = PathBuf::new();
    for c in abs.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    let mut existing = out.clone();
    let mut rest = Vec::new();
    while !existing.exists() {
        match (existing.file_name().map(|n| n.to_os_string()), existing.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name);
                existing = parent.to_path_buf();
            }
            _ => return Ok(out),
        }
    }
    let mut canonical = std::fs::canonicalize(&existing).unwrap_or(existing);
    for name in rest.into_iter().rev() {
        canonical.push(name);
    }
    Ok(canonical)
}

/// An endpoint override: `https://` anywhere, `http://` only on loopback (the host parsed as
/// a URL, so `http://127.0.0.1@elsewhere` is elsewhere). Credentials never go in it, and the
/// value is not repeated in errors in case it holds some.
fn endpoint(var: &str, value: &str) -> Result<(String, bool), TableError> {
    let value = value.trim().trim_end_matches('/');
    let with_scheme = if value.contains("://") { value.to_string() } else { format!("http://{value}") };
    let bad = |why: &str| TableError::Usage(format!("{var}: {why}"));
    let url = url::Url::parse(&with_scheme).map_err(|e| bad(&format!("not a URL ({e})")))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("holds a user name or password; give credentials in AWS_ACCESS_KEY_ID and the like"));
    }
    match url.scheme() {
        "https" => Ok((with_scheme, false)),
        "http" => {
            let loopback = match url.host() {
                Some(url::Host::Domain(d)) => d == "localhost",
                Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
                Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
                None => false,
            };
            if !loopback {
                return Err(bad("plain http is allowed only on loopback (an emulator on this machine); use https"));
            }
            Ok((with_scheme, true))
        }
        other => Err(bad(&format!("{other}:// is not http or https"))),
    }
}

/// An S3 store for `bucket`; the credentials it was given are added to `given` (to be masked in
/// its errors).
fn s3(bucket: &str, env: Env, given: &mut Vec<String>) -> Result<Arc<dyn ObjectStore>, TableError> {
    let mut b = AmazonS3Builder::new().with_bucket_name(bucket);
    let key = env("AWS_ACCESS_KEY_ID").filter(|v| !v.is_empty());
    let secret = env("AWS_SECRET_ACCESS_KEY").filter(|v| !v.is_empty());
    let profile_name = env("AWS_PROFILE").filter(|v| !v.is_empty()).unwrap_or_else(|| "default".into());
    let home = env("HOME").map(PathBuf::from);
    match (key, secret) {
        (Some(k), Some(s)) => {
            given.extend([k.clone(), s.clone()]);
            b = b.with_access_key_id(k).with_secret_access_key(s);
            if let Some(t) = env("AWS_SESSION_TOKEN").filter(|v| !v.is_empty()) {
                given.push(t.clone());
                b = b.with_token(t);
            }
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err(TableError::Usage(
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together (or neither, to use a profile)"
                    .into(),
            ))
        }
        (None, None) => {
            // A profile's keys, from the credentials file or (as the AWS CLI also takes them)
            // the config file's `[profile NAME]` (`[default]` for the default profile).
            let creds_file = env("AWS_SHARED_CREDENTIALS_FILE")
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join(".aws/credentials")));
            let config_file =
                env("AWS_CONFIG_FILE").map(PathBuf::from).or_else(|| home.as_ref().map(|h| h.join(".aws/config")));
            let config_section =
                if profile_name == "default" { "default".to_string() } else { format!("profile {profile_name}") };
            let sections = [
                creds_file.as_ref().and_then(|f| ini_section(f, &profile_name)),
                config_file.as_ref().and_then(|f| ini_section(f, &config_section)),
            ];
            for section in sections.iter().flatten() {
                let get = |k: &str| section.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
                match (get("aws_access_key_id"), get("aws_secret_access_key")) {
                    (Some(k), Some(s)) => {
                        given.extend([k.clone(), s.clone()]);
                        b = b.with_access_key_id(k).with_secret_access_key(s);
                        if let Some(t) = get("aws_session_token") {
                            given.push(t.clone());
                            b = b.with_token(t);
                        }
                        return finish_s3(b, bucket, env, &profile_name, home.as_deref());
                    }
                    (None, None) => {}
                    _ => {
                        return Err(TableError::Usage(format!(
                            "s3://{bucket}: AWS profile {profile_name} has only one of aws_access_key_id and \
                             aws_secret_access_key; give it both"
                        )))
                    }
                }
            }
            let shown = |f: &Option<PathBuf>| f.as_ref().map(|f| f.display().to_string()).unwrap_or_default();
            // A profile asked for by name must exist, as the AWS tools insist (else a machine's
            // role would be used in its place, without a word).
            if env("AWS_PROFILE").is_some_and(|v| !v.is_empty()) && sections.iter().all(Option::is_none) {
                return Err(TableError::Usage(format!(
                    "s3://{bucket}: AWS_PROFILE={profile_name}, but neither {} nor {} has that profile",
                    shown(&creds_file),
                    shown(&config_file)
                )));
            }
            let profile_tried = match (&sections[0], &sections[1]) {
                (None, None) => {
                    format!("profile {profile_name} (not in {} or {})", shown(&creds_file), shown(&config_file))
                }
                _ => format!("profile {profile_name} (no keys in it)"),
            };
            // Else a container's or web identity's role, or the instance's, which object_store
            // finds itself; with none of them it would ask the instance metadata service ten
            // times over three minutes and fail naming an address, not credentials.
            let mut role = false;
            for var in [
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                "AWS_WEB_IDENTITY_TOKEN_FILE",
                "AWS_ROLE_ARN",
                "AWS_ROLE_SESSION_NAME",
                "AWS_ENDPOINT_URL_STS",
            ] {
                if let Some(v) = env(var).filter(|v| !v.is_empty()) {
                    let key: object_store::aws::AmazonS3ConfigKey =
                        var.to_ascii_lowercase().parse().expect("object_store knows the AWS variables");
                    b = b.with_config(key, v);
                    role |= var != "AWS_ROLE_SESSION_NAME" && var != "AWS_ENDPOINT_URL_STS";
                }
            }
            if !role {
                let metadata = env("AWS_EC2_METADATA_SERVICE_ENDPOINT")
                    .filter(|v| !v.is_empty())
                    .unwrap_or_else(|| "http://169.254.169.254".into());
                let disabled = env("AWS_EC2_METADATA_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"));
                if disabled || !metadata_answers(&metadata) {
                    let instance = if disabled {
                        "the instance's role (AWS_EC2_METADATA_DISABLED is set)".to_string()
                    } else {
                        format!("the instance's role (no metadata service answers at {metadata}: not on EC2?)")
                    };
                    return Err(TableError::Usage(format!(
                        "s3://{bucket}: no AWS credentials found. Tried: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
                         (not set); {profile_tried}; a container or web-identity role (none configured); {instance}. \
                         Set the two variables, or AWS_PROFILE to a profile with keys"
                    )));
                }
                b = b.with_metadata_endpoint(metadata);
            }
        }
    }
    finish_s3(b, bucket, env, &profile_name, home.as_deref())
}

/// Whether an instance metadata service answers at `url` within a second: asked for a session
/// token (IMDSv2) over plain HTTP, as object_store would. On EC2 it answers at once; elsewhere
/// nothing listens, or a proxy refuses, or a server takes the connection and says nothing — and
/// object_store would retry that for three minutes.
fn metadata_answers(url: &str) -> bool {
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;
    let Ok(u) = url::Url::parse(url) else { return false };
    let (Some(host), Some(port)) = (u.host_str(), u.port_or_known_default()) else { return false };
    let Ok(addrs) = (host, port).to_socket_addrs() else { return false };
    let second = std::time::Duration::from_secs(1);
    addrs.into_iter().any(|a| {
        let Ok(mut conn) = std::net::TcpStream::connect_timeout(&a, second) else { return false };
        let _ = conn.set_read_timeout(Some(second));
        let _ = conn.set_write_timeout(Some(second));
        let ask = format!(
            "PUT /latest/api/token HTTP/1.1\r\nHost: {host}\r\nX-aws-ec2-metadata-token-ttl-seconds: 60\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let mut head = [0u8; 12];
        conn.write_all(ask.as_bytes()).is_ok()
            && conn.read_exact(&mut head).is_ok()
            && head.starts_with(b"HTTP/1.")
            && &head[9..12] == b"200"
    })
}

/// The region and endpoint of an S3 store whose credentials are settled.
fn finish_s3(
    mut b: AmazonS3Builder,
    bucket: &str,
    env: Env,
    profile_name: &str,
    home: Option<&Path>,
) -> Result<Arc<dyn ObjectStore>, TableError> {
    let region = env("AWS_REGION").or_else(|| env("AWS_DEFAULT_REGION")).filter(|v| !v.is_empty()).or_else(|| {
        let file = env("AWS_CONFIG_FILE").map(PathBuf::from).or_else(|| home.map(|h| h.join(".aws/config")));
        let section = if profile_name == "default" { "default".to_string() } else { format!("profile {profile_name}") };
        file.and_then(|f| ini_section(&f, &section))
            .and_then(|s| s.into_iter().find(|(n, _)| n == "region").map(|(_, v)| v))
    });
    b = b.with_region(region.unwrap_or_else(|| "us-east-1".into()));
    for var in ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"] {
        if let Some(v) = env(var).filter(|v| !v.is_empty()) {
            let (url, http) = endpoint(var, &v)?;
            b = b.with_endpoint(url).with_allow_http(http).with_virtual_hosted_style_request(false);
            break;
        }
    }
    b.build().map(|s| Arc::new(s) as _).map_err(|e| TableError::Usage(format!("s3://{bucket}: {e}")))
}

/// The `name = value` pairs of one `[section]` of an INI file (AWS's credentials and config).
fn ini_section(file: &Path, section: &str) -> Option<Vec<(String, String)>> {
    let text = std::fs::read_to_string(file).ok()?;
    let mut inside = false;
    let mut found = None;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            if inside {
                found.get_or_insert_with(Vec::new);
            }
            continue;
        }
        if inside {
            if let Some((k, v)) = line.split_once('=') {
                found.get_or_insert_with(Vec::new).push((k.trim().to_string(), v.trim().to_string()));
            }
        }
    }
    found
}

fn gcs(bucket: &str, env: Env) -> Result<Arc<dyn ObjectStore>, TableError> {
    let mut b = GoogleCloudStorageBuilder::new().with_bucket_name(bucket);
    if let Some(host) = env("STORAGE_EMULATOR_HOST").filter(|v| !v.is_empty()) {
        let (url, http) = endpoint("STORAGE_EMULATOR_HOST", &host)?;
        // An emulator takes no credentials: a key that says so, and the emulator's address.
        b = b
            .with_base_url(&url)
            .with_service_account_key(
                r#"{"private_key":"","private_key_id":"","client_email":"","disable_oauth":true}"#,
            )
            .with_client_options(ClientOptions::new().with_allow_http(http));
    } else if let Some(path) = env("GOOGLE_APPLICATION_CREDENTIALS").filter(|v| !v.is_empty()) {
        b = b.with_application_credentials(path);
    } else if let Some(home) = env("HOME") {
        // gcloud's application-default credentials, where `gcloud auth application-default
        // login` writes them (object_store would look there itself; said here so tests can
        // point HOME elsewhere).
        let adc = Path::new(&home).join(".config/gcloud/application_default_credentials.json");
        if adc.exists() {
            b = b.with_application_credentials(adc.to_string_lossy());
        }
    }
    b.build().map(|s| Arc::new(s) as _).map_err(|e| TableError::Usage(format!("gs://{bucket}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_kinds() {
        let l = Location::parse("s3://b/dir/x.parquet").unwrap();
        assert_eq!((l.scheme, l.bucket.as_str(), l.path.as_ref()), (Scheme::S3, "b", "dir/x.parquet"));
        let l = Location::parse("gs://b/out/").unwrap();
        assert_eq!((l.scheme, l.path.as_ref()), (Scheme::Gcs, "out"));
        assert!(Location::parse("s3:///x").is_err());
        assert!(Location::parse("http://x/y").is_err());
        let l = Location::parse("/tmp/../tmp/./x.csv").unwrap();
        assert!(l.local_path().unwrap().ends_with("tmp/x.csv"), "{:?}", l.local_path());
    }

    #[test]
    fn plain_http_only_on_loopback() {
        assert!(endpoint("X", "http://127.0.0.1:9000").unwrap().1);
        assert!(endpoint("X", "localhost:4443").unwrap().1);
        assert!(!endpoint("X", "https://s3.example.com").unwrap().1);
        assert!(endpoint("X", "http://s3.example.com").is_err());
        assert!(endpoint("X", "http://127.0.0.1@example.invalid").is_err());
        assert!(endpoint("X", "http://127.0.0.1.nip.invalid:9000").is_err());
        let e = endpoint("X", "https://user:hunter2@s3.example.com").unwrap_err().to_string();
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn missing_aws_credentials_fail_at_once_naming_what_was_tried() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let home = std::env::temp_dir().join(format!("weir-nohome-{}", std::process::id()));
        let metadata = format!("http://{closed}");
        let vars = |disabled: bool| {
            let (home, metadata) = (home.display().to_string(), metadata.clone());
            move |k: &str| match k {
                "HOME" => Some(home.clone()),
                "AWS_EC2_METADATA_SERVICE_ENDPOINT" => Some(metadata.clone()),
                "AWS_EC2_METADATA_DISABLED" if disabled => Some("true".into()),
                _ => None,
            }
        };
        for disabled in [false, true] {
            let started = std::time::Instant::now();
            let e = s3("b", &vars(disabled), &mut Vec::new()).expect_err("no credentials accepted").to_string();
            assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
            assert!(e.contains("no AWS credentials found") && e.contains("AWS_ACCESS_KEY_ID"), "{e}");
            assert!(e.contains(if disabled { "AWS_EC2_METADATA_DISABLED" } else { closed.to_string().leak() }), "{e}");
        }
        // A server that takes the connection and says nothing, or refuses: no service either.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let silent_url = format!("http://{}", silent.local_addr().unwrap());
        let refusing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let refusing_url = format!("http://{}", refusing.local_addr().unwrap());
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for mut c in refusing.incoming().flatten() {
                let mut buf = [0u8; 512];
                let _ = c.read(&mut buf);
                let _ = c.write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n");
            }
        });
        for url in [&silent_url, &refusing_url] {
            let started = std::time::Instant::now();
            assert!(!metadata_answers(url), "{url}");
            assert!(started.elapsed().as_secs() < 3, "{:?}", started.elapsed());
        }
        let answering = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let answering_url = format!("http://{}", answering.local_addr().unwrap());
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for mut c in answering.incoming().flatten() {
                let mut buf = [0u8; 512];
                let _ = c.read(&mut buf);
                let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\ntoken");
            }
        });
        assert!(metadata_answers(&answering_url));
        drop(silent);
        // A profile named but found nowhere is refused; keys in the config file's profile are taken.
        let named = |k: &str| match k {
            "HOME" => Some(home.display().to_string()),
            "AWS_PROFILE" => Some("nosuch".into()),
            _ => None,
        };
        let e = s3("b", &named, &mut Vec::new()).expect_err("a missing profile").to_string();
        assert!(e.contains("AWS_PROFILE=nosuch") && e.contains("neither"), "{e}");
        let config = std::env::temp_dir().join(format!("weir-awsconfig-{}", std::process::id()));
        std::fs::write(&config, "[profile p1]\naws_access_key_id = A\naws_secret_access_key = B\n").unwrap();
        let (home_s, config_s) = (home.display().to_string(), config.display().to_string());
        let p1 = move |k: &str| match k {
            "HOME" => Some(home_s.clone()),
            "AWS_PROFILE" => Some("p1".into()),
            "AWS_CONFIG_FILE" => Some(config_s.clone()),
            _ => None,
        };
        assert!(s3("b", &p1, &mut Vec::new()).is_ok());
        std::fs::remove_file(&config).unwrap();
        // Keys, or a role configured, are taken without a probe.
        let with = |k: &str| match k {
            "AWS_ACCESS_KEY_ID" | "AWS_SECRET_ACCESS_KEY" => Some("x".into()),
            _ => None,
        };
        assert!(s3("b", &with, &mut Vec::new()).is_ok());
        let role = |k: &str| (k == "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI").then(|| "/v2/creds".to_string());
        assert!(s3("b", &role, &mut Vec::new()).is_ok());
    }

    #[test]
    fn reads_an_ini_section() {
        let f = std::env::temp_dir().join(format!("weir-ini-{}", std::process::id()));
        std::fs::write(&f, "[default]\naws_access_key_id = A\n\n[profile p]\nregion=eu-west-1\n").unwrap();
        assert_eq!(ini_section(&f, "default").unwrap(), vec![("aws_access_key_id".into(), "A".into())]);
        assert_eq!(ini_section(&f, "profile p").unwrap()[0].1, "eu-west-1");
        assert!(ini_section(&f, "other").is_none());
        std::fs::remove_file(&f).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_that_takes_connections_and_never_answers_is_named_at_the_first_request() {
        // object_store retried such an endpoint for three minutes without a word before the
        // run stopped (a tester's S3 emulator that had hung). Now the first request, made
        // before any model call, is given 20 s (of paused time here).
        let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", hung.local_addr().unwrap());
        // Never accepted: the kernel completes the connections into the backlog, and nothing
        // answers them.
        let env = |k: &str| match k {
            "AWS_ACCESS_KEY_ID" => Some("k".to_string()),
            "AWS_SECRET_ACCESS_KEY" => Some("s".to_string()),
            "AWS_ENDPOINT_URL" => Some(endpoint.clone()),
            _ => None,
        };
        let out = Location::parse("s3://bk/out.parquet").unwrap();
        let committed = crate::journal::Committed::default();
        let e = crate::write::prepare(&out, crate::journal::Table::Results, &committed, false, false, &env)
            .await
            .expect_err("no answer");
        assert!(
            matches!(&e, TableError::Unavailable(m) if m.contains("s3://bk/out.parquet: the store did not answer within 20 s")),
            "{e:?}"
        );
        let e =
            crate::read::TableInput::open("s3://bk/in/*.csv", None, &[], b',', &env).await.err().expect("no answer");
        assert!(matches!(&e, TableError::Unavailable(m) if m.contains("did not answer")), "{e:?}");
        drop(hung);
    }
}
