//! `weir cluster scheduler|executor`: the processes of a Ballista cluster with weir's SQL
//! functions in them. `weir sql --cluster df://HOST:PORT` submits queries to the scheduler.

use clap::{Args, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;
use weir_datafusion::cluster::ExecutorPlace;
use weir_datafusion::{Runtime, RuntimeSettings};

use crate::UsageError;
use weir_runtime::EndpointArgs;

/// Options of `weir cluster`.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    command: ClusterCommand,
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// The scheduler: takes queries from `weir sql --cluster df://HOST:PORT` and hands their
    /// tasks to executors.
    Scheduler(SchedulerArgs),
    /// An executor: runs tasks, calling the model endpoints with its own flags and keys (the
    /// same as weir run's); its tasks share one throttle per endpoint.
    Executor(Box<ExecutorArgs>),
    /// Makes the cluster's certificate authority (once) and a certificate and key for each
    /// --name, for mutual TLS (--tls-ca, --tls-cert, --tls-key on every cluster process).
    Certs(CertsArgs),
    /// Makes a shared token for the cluster: a file (mode 0600) to give every process with
    /// --token-file, or whose contents to put in WEIR_CLUSTER_TOKEN.
    Token(TokenArgs),
}

/// Options of `weir cluster token`.
#[derive(Debug, Args)]
struct TokenArgs {
    /// The file to write (refused if it exists: a cluster's token is replaced on purpose only,
    /// by removing the file first).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
}

/// Options of `weir cluster certs`.
#[derive(Debug, Args)]
struct CertsArgs {
    /// The directory to write into: ca.pem (give it to every process), ca.key (keep it here,
    /// to make more certificates later), NAME.pem and NAME.key for each name.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// A process to make a certificate for, e.g. scheduler, executor-1, alice (repeatable).
    #[arg(long = "name", value_name = "NAME", required = true)]
    names: Vec<String>,
}

/// The places a cluster process lets queries read and write (see `weir_datafusion::fence`).
#[derive(Debug, Args)]
struct PlaceArgs {
    /// A directory queries may read and write files under (repeatable) [default: the directory
    /// the process is started in]. A query naming any other file fails before a model is called.
    #[arg(long, value_name = "DIR")]
    allow_path: Vec<PathBuf>,
    /// An object store prefix queries may read and write under, s3://BUCKET[/PREFIX] or
    /// gs://BUCKET[/PREFIX] (repeatable) [default: none].
    #[arg(long, value_name = "URL")]
    allow_url: Vec<String>,
}

impl PlaceArgs {
    /// The places, checked (directories must exist).
    fn allowed(&self) -> anyhow::Result<weir_datafusion::fence::Allowed> {
        let dirs = if self.allow_path.is_empty() { vec![std::env::current_dir()?] } else { self.allow_path.clone() };
        Ok(weir_datafusion::fence::Allowed::new(&dirs, &self.allow_url).map_err(UsageError)?)
    }
}

/// Options of `weir cluster scheduler`.
#[derive(Debug, Args)]
struct SchedulerArgs {
    /// Where to listen for clients and executors.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:50050")]
    bind: SocketAddr,
    /// Planning lists a table's files and reads their footers here: give the scheduler the same
    /// places as the executors.
    #[command(flatten)]
    places: PlaceArgs,
    /// Listen on an address other machines can reach without TLS (see the README's cluster
    /// section).
    #[arg(long)]
    insecure: bool,
    #[command(flatten)]
    credentials: crate::credential_args::CredentialArgs,
    /// Serve a live page of the whole cluster's model calls at http://ADDR/: what every
    /// executor's calls add up to over time (throughput against the limit, refusals, latency,
    /// cost), and each executor as a row. On loopback only; without ADDR, 127.0.0.1 and a free
    /// port (said on stderr).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0", value_parser = weir::metrics_server::listen_addr)]
    ui: Option<SocketAddr>,
}

/// Options of `weir cluster executor`.
#[derive(Debug, Args)]
struct ExecutorArgs {
    /// The scheduler's address.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:50050")]
    scheduler: SocketAddr,
    /// The host this executor listens on and is reached at.
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    host: String,
    /// Its Arrow Flight port (results and shuffles).
    #[arg(long, value_name = "PORT", default_value_t = 50051)]
    port: u16,
    /// Its gRPC port (tasks from the scheduler).
    #[arg(long, value_name = "PORT", default_value_t = 50052)]
    grpc_port: u16,
    /// Tasks run at once [default: the number of cores].
    #[arg(long, value_name = "N")]
    slots: Option<usize>,
    /// Where shuffle files and results go: a private directory (mode 0700) is made inside it,
    /// and removed when the executor stops [default: the system's temporary directory].
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
    #[command(flatten)]
    places: PlaceArgs,
    /// Listen on an address other machines can reach without TLS (see the README's cluster
    /// section).
    #[arg(long)]
    insecure: bool,
    #[command(flatten)]
    credentials: crate::credential_args::CredentialArgs,
    /// Serve this executor's counters (calls, 429s, tokens, latency) in the Prometheus text
    /// format at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR", value_parser = weir::metrics_server::listen_addr)]
    metrics_listen: Option<SocketAddr>,
    /// Serve a live page of this executor's model calls at http://ADDR/ (throughput against the
    /// limit, refusals, latency, cost; see `weir run --ui`). On loopback only; without ADDR,
    /// 127.0.0.1 and a free port (said on stderr).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0", value_parser = weir::metrics_server::listen_addr)]
    ui: Option<SocketAddr>,
    #[command(flatten)]
    endpoint: EndpointArgs,
    /// Scenario (TOML, as for `weir sim --config`) of the built-in simulator behind sim/ models.
    #[arg(long, value_name = "FILE")]
    sim_config: Option<PathBuf>,
}

/// Runs `weir cluster …`; the exit status.
pub async fn run(args: ClusterArgs) -> anyhow::Result<u8> {
    match args.command {
        ClusterCommand::Certs(a) => {
            let written = weir_datafusion::tls::make_certificates(&a.out, &a.names).map_err(UsageError)?;
            for f in &written {
                eprintln!("weir: wrote {}", f.display());
            }
            eprintln!(
                "weir: give each process ca.pem and its NAME.pem and NAME.key (--tls-ca, --tls-cert, --tls-key); \
                 keep ca.key where you make certificates"
            );
            Ok(0)
        }
        ClusterCommand::Token(a) => {
            let token = weir_datafusion::guard::Token::generate().map_err(|e| anyhow::anyhow!(e))?;
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            let mut file = options.open(&a.out).map_err(|e| UsageError(format!("--out {}: {e}", a.out.display())))?;
            std::io::Write::write_all(&mut file, format!("{token}\n").as_bytes())?;
            eprintln!(
                "weir: wrote {} (readable by you only); give it to every process of the cluster with --token-file, \
                 or put its contents in WEIR_CLUSTER_TOKEN",
                a.out.display()
            );
            Ok(0)
        }
        ClusterCommand::Scheduler(a) => {
            let guarded = a.credentials.install()?;
            exposed("--bind", &a.bind.ip().to_string(), a.insecure, guarded)?;
            let allowed = a.places.allowed()?;
            free_port("--bind", &a.bind.ip().to_string(), a.bind.port(), guarded)?;
            // The quota service the executors share their endpoints' quotas through.
            let quota = weir_datafusion::quota::service_addr(a.bind)
                .ok_or_else(|| UsageError(format!("--bind {}: the port must be at least 2", a.bind)))?;
            if let Err(e) = std::net::TcpListener::bind(quota) {
                return Err(UsageError(format!(
                    "--bind {}: the quota service needs the port below the scheduler's, {quota}, and it is taken ({e}); \
                     pick another scheduler port",
                    a.bind
                ))
                .into());
            }
            // The scheduler plans only: its functions are never called.
            let functions = Runtime::new(RuntimeSettings::default());
            // The executors' calls, as they report them: the cluster's page.
            let page = weir_runtime::gather::Gathered::new(format!("cluster at {}", a.bind));
            let _page = match a.ui {
                Some(addr) => {
                    let (bound, server) = weir_runtime::dash::serve(addr, page.clone()).await.map_err(UsageError)?;
                    eprintln!("weir cluster scheduler: live page of the cluster on http://{bound}/");
                    Some((server, page.start()))
                }
                None => None,
            };
            let scheme = if guarded.tls { "dfs" } else { "df" };
            eprintln!("weir: scheduler listening on {} (clients: weir sql --cluster {scheme}://{})", a.bind, a.bind);
            weir_datafusion::cluster::scheduler(a.bind, functions, allowed, page)
                .await
                .map_err(|e| anyhow::anyhow!(e))?;
            Ok(0)
        }
        ClusterCommand::Executor(a) => executor(*a).await,
    }
}

/// Refuses an address other machines can reach unless the cluster's credentials are set (TLS or
/// a token) or `insecure` is given: without them anyone reaching it could spend the executors'
/// keys, read and write the files they allow, and join executors of their own. With
/// credentials, weir's guard takes the address and the Ballista server behind it listens on
/// 127.0.0.1 at the same port, so the address must be another one (and not every address,
/// 0.0.0.0, which includes 127.0.0.1).
fn exposed(flag: &str, host: &str, insecure: bool, guarded: crate::credential_args::Guarded) -> Result<(), UsageError> {
    // (Both callers give an IP address: --bind is one, and an executor's --host is checked.)
    let ip = host.parse::<std::net::IpAddr>().ok();
    let loopback = ip.is_some_and(|ip| ip.is_loopback());
    if guarded.any() {
        let taken = ip.is_some_and(|ip| ip.is_unspecified() || ip == std::net::IpAddr::from([127, 0, 0, 1]));
        if taken {
            return Err(UsageError(format!(
                "{flag} {host}: with TLS or a token, give this machine's own address (the plain server behind \
                 weir's guard uses 127.0.0.1 at the same port); to try it on one machine, use 127.0.0.2"
            )));
        }
        if !guarded.tls && !loopback && !insecure {
            eprintln!(
                "weir: warning: {flag} {host}: the cluster token crosses the network in the clear without TLS; \
                 anyone who can watch the network can take it (use mutual TLS too: weir cluster certs)"
            );
        }
        return Ok(());
    }
    if loopback || insecure {
        return Ok(());
    }
    Err(UsageError(format!(
        "{flag} {host}: other machines could reach this without TLS or a token: anyone who can connect could run \
         queries with the executors' API keys, read and write the files they allow, and join executors of their \
         own. Use mutual TLS (weir cluster certs, then --tls-ca/--tls-cert/--tls-key on every process) and/or a \
         shared token (weir cluster token, then WEIR_CLUSTER_TOKEN or --token-file on every process), or \
         127.0.0.1, or pass --insecure on a network only you use"
    )))
}

/// Refuses a `port` another program holds, on `host` and, when weir's guards stand in front of
/// the server, on 127.0.0.1 where the server itself listens.
fn free_port(flag: &str, host: &str, port: u16, guarded: crate::credential_args::Guarded) -> Result<(), UsageError> {
    let mut hosts = vec![host];
    if guarded.any() {
        hosts.push("127.0.0.1");
    }
    for h in hosts {
        if let Err(e) = std::net::TcpListener::bind((h, port)) {
            return Err(UsageError(format!(
                "{flag} {port}: cannot listen on {h}:{port} ({e}); another scheduler, executor or program uses it, \
                 pick another port"
            )));
        }
    }
    Ok(())
}

async fn executor(a: ExecutorArgs) -> anyhow::Result<u8> {
    a.endpoint.check().map_err(crate::UsageError::from)?;
    if a.host.parse::<std::net::IpAddr>().is_err() {
        return Err(UsageError(format!(
            "--host {}: give an IP address, e.g. 127.0.0.1 or this machine's address on its network (the scheduler \
             hands it to clients and other executors as it is)",
            a.host
        ))
        .into());
    }
    let guarded = a.credentials.install()?;
    exposed("--host", &a.host, a.insecure, guarded)?;
    let allowed = a.places.allowed()?;
    if a.slots == Some(0) {
        return Err(UsageError("--slots must be at least 1".into()).into());
    }
    if a.port == a.grpc_port {
        return Err(UsageError(format!(
            "--port and --grpc-port are both {}: an executor serves two things (Flight for results, gRPC for \
             tasks), give two ports",
            a.port
        ))
        .into());
    }
    let provider = a.endpoint.provider();
    if let Some(path) = &a.sim_config {
        weir_runtime::sim::install(Some(weir_sim::SimConfig::from_file(path).map_err(|e| UsageError(e.to_string()))?));
    }
    let mut throttle = a.endpoint.throttle();
    // An executor shares its quotas with every executor of the cluster, through the scheduler
    // (those on this machine included).
    if throttle.store == weir_core::QuotaStore::Local {
        throttle.store = weir_core::QuotaStore::Cluster;
    }
    let settings =
        RuntimeSettings { provider, throttle, driver: a.endpoint.driver(), cache: None, pool: a.endpoint.pool()? };
    let functions = Runtime::new(settings);
    weir::pipeline::media_from_buckets(&functions);
    // The gauges (limits in force, processes sharing each quota) of every endpoint the
    // executor's tasks call.
    let _gauges = match a.metrics_listen {
        Some(addr) => Some(
            weir::metrics_server::serve(addr, functions.clone())
                .map_err(|e| UsageError(format!("--metrics-listen {addr}: {e}")))?,
        ),
        None => None,
    };
    let title = format!("executor {}:{}", a.host, a.port);
    // Watched always: the scheduler's page gathers every executor's calls; with --ui this
    // executor serves its own page too.
    let cost = Some(weir::pipeline::live_cost(None));
    let (watch, page) = match a.ui {
        Some(addr) => {
            let (watch, tasks) =
                weir_runtime::dash::watch_and_serve(functions.clone(), &title, cost, addr, "weir cluster executor")
                    .await
                    .map_err(UsageError)?;
            (watch, tasks.into_iter().collect::<Vec<_>>())
        }
        None => {
            let watch = weir_runtime::dash::Watch::new(functions.clone(), &title, None, cost);
            let sampler = watch.start(None);
            (watch, vec![sampler])
        }
    };
    let work = private_work_dir(a.work_dir.as_deref())?;
    let place = ExecutorPlace {
        scheduler: a.scheduler,
        host: a.host.clone(),
        port: a.port,
        grpc_port: a.grpc_port,
        slots: a.slots,
        work_dir: Some(work.path().display().to_string()),
        allowed,
        watch: Some(watch),
    };
    // Ballista reports a port in use only in its log, and may go on without the server. With
    // credentials its servers take 127.0.0.1 at the same ports, behind weir's guards.
    for (flag, port) in [("--port", a.port), ("--grpc-port", a.grpc_port)] {
        free_port(flag, &a.host, port, guarded)?;
    }
    eprintln!("weir: executor on {}:{} serving the scheduler at {}", a.host, a.port, a.scheduler);
    let started = Instant::now();
    let mut signals = crate::signals::StopSignals::new()?;
    let running = weir_datafusion::cluster::executor(place, functions.clone());
    tokio::pin!(running);
    let result = tokio::select! {
        r = &mut running => r,
        _ = signals.next() => {
            // Ballista got the same signal and tells the scheduler that this executor stops:
            // its tasks go to the others now, and no new one comes here. Ended at once, it
            // stayed registered for the scheduler's 30-s timeout, and one started again at its
            // address was handed the old one's tasks, which then ran again (a tester's restart
            // of two executors: 450 calls for 300 rows). Ballista would then wait for its tasks
            // to end, each to its last call, paid for while another executor runs it again;
            // nor are they stopped here: a task stopped before the scheduler heard failed the
            // whole query. So a moment for the telling, then the process ends with its tasks
            // (their calls in flight are made again elsewhere, as after a kill).
            eprintln!("weir: stopping: the scheduler is told, and the tasks running here go to other executors");
            tokio::select! {
                r = tokio::time::timeout(TELL_SCHEDULER, &mut running) => r.unwrap_or(Ok(())),
                _ = signals.next() => Ok(()),
            }
        }
    };
    // A scheduler with TLS closes a plain or unknown executor's connection during the handshake;
    // one with a token answers UNAUTHENTICATED.
    let result = result.map_err(|e| {
        if e.contains("Unauthenticated") || e.contains("cluster's token") {
            format!(
                "{e}\nweir: the scheduler at {} refused this executor: give the cluster's token (WEIR_CLUSTER_TOKEN \
                 or --token-file)",
                a.scheduler
            )
        } else if e.contains("transport error") || e.contains("BrokenPipe") || e.contains("connection reset") {
            format!(
                "{e}\nweir: could not register with the scheduler at {}: if the cluster uses mutual TLS, give \
                 --tls-ca, --tls-cert and --tls-key with a certificate its authority signed",
                a.scheduler
            )
        } else {
            e
        }
    });
    for task in page {
        task.abort();
    }
    // What this executor's calls came to, over its whole life.
    let said = crate::sql_cmd::summary(&functions, started.elapsed(), "weir cluster executor").await;
    if said.is_empty() {
        // Said all the same: `weir sql` tells users that each executor prints its summary.
        eprintln!("weir cluster executor: {:.2} s; no model calls here", started.elapsed().as_secs_f64());
    } else {
        eprint!("{said}");
    }
    functions.shutdown().await;
    // Shuffle files and results go with the executor.
    if let Err(e) = work.close() {
        eprintln!("weir: could not remove the executor's work directory: {e}");
    }
    result.map_err(|e| anyhow::anyhow!(e))?;
    Ok(0)
}

/// How long a stopping executor gives Ballista to tell the scheduler (two calls to it) before
/// the process ends with its tasks.
const TELL_SCHEDULER: std::time::Duration = std::time::Duration::from_secs(2);

/// The first part of the name of an executor's work directory; the process id follows.
const WORK_PREFIX: &str = "weir-executor-";

/// A work directory only this user can read (mode 0700; Ballista's own is made with the umask's
/// mode, usually world-readable, and left behind), inside `parent` or the temporary directory.
/// Directories that executors killed outright left there are removed first.
fn private_work_dir(parent: Option<&std::path::Path>) -> anyhow::Result<tempfile::TempDir> {
    let parent = parent.map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&parent).map_err(|e| UsageError(format!("--work-dir {}: {e}", parent.display())))?;
    if let Ok(entries) = std::fs::read_dir(&parent) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid =
                name.strip_prefix(WORK_PREFIX).and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok());
            // Signal 0 only asks whether the process exists (EPERM: it does, as another user's).
            let gone = pid.is_some_and(|p| {
                // SAFETY: kill with signal 0 sends nothing; it only checks the process id.
                let failed = unsafe { libc::kill(p as libc::pid_t, 0) } != 0;
                failed && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            });
            if gone && e.metadata().is_ok_and(|m| m.is_dir()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let dir = tempfile::Builder::new()
        .prefix(&format!("{WORK_PREFIX}{}-", std::process::id()))
        .tempdir_in(&parent)
        .map_err(|e| UsageError(format!("--work-dir {}: {e}", parent.display())))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(dir)
}
