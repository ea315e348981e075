//! weir's functions on an Apache DataFusion Ballista cluster: a scheduler that can plan queries
//! using them, executors that run them, and a client session that submits queries.
//!
//! Plans name the functions only; each process brings its own implementation. The scheduler's
//! copy plans and is never called. Each executor's copy calls the endpoints with that
//! executor's settings and credentials (keys never travel in plans), and all the tasks an
//! executor runs share one throttle per endpoint, and the executors share one per endpoint and
//! key that the scheduler keeps (see [`crate::quota`]), so that together they keep to the quota.

use ballista::prelude::SessionContextExt;
use ballista_core::registry::BallistaFunctionRegistry;
use ballista_core::serde::protobuf::ShuffleWritePartition;
use ballista_core::JobId;
use ballista_executor::execution_engine::{DefaultExecutionEngine, ExecutionEngine, QueryStageExecutor};
use ballista_executor::executor_process::{start_executor_process, ExecutorProcessConfig};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::{SchedulerConfig, TaskDistributionPolicy};
use ballista_scheduler::scheduler_process::start_server;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::metrics::MetricsSet;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use std::net::SocketAddr;
use std::sync::Arc;

use crate::tables::Stores;
use weir_runtime::Runtime;

/// Seconds without a heartbeat after which the scheduler takes an executor for lost.
const EXECUTOR_TIMEOUT_SECS: u64 = 30;

/// A runtime whose object stores are found as `weir sql` finds them (`s3://`, `gs://`), checking
/// every path against `allowed` when given (a scheduler's and executors': the scheduler lists
/// and reads files while it plans, before any executor sees the plan).
fn runtime(allowed: Option<&crate::fence::Allowed>) -> datafusion::common::Result<Arc<RuntimeEnv>> {
    let stores = match allowed {
        Some(a) => Stores::fenced(a.clone()),
        None => Stores::new(),
    };
    RuntimeEnvBuilder::new().with_object_store_registry(Arc::new(stores)).build_arc()
}

/// Runs a scheduler on `bind` until it fails. `functions` only plans (a scheduler makes no
/// calls), so its settings do not matter.
pub async fn scheduler(
    bind: SocketAddr,
    functions: Arc<Runtime>,
    allowed: crate::fence::Allowed,
    page: Arc<weir_runtime::gather::Gathered>,
) -> Result<(), String> {
    let udfs = crate::udf::all(&functions);
    let builder = Arc::new(move |config: SessionConfig| {
        let mut state = SessionStateBuilder::new()
            .with_config(config)
            .with_runtime_env(runtime(Some(&allowed))?)
            .with_default_features()
            .with_optimizer_rules(crate::optimizer_rules())
            .build();
        for udf in &udfs {
            datafusion::execution::FunctionRegistry::register_udf(&mut state, Arc::new(udf.clone()))?;
        }
        Ok(state)
    });
    // With credentials, Ballista listens on 127.0.0.1 and weir's guard on the address given.
    let creds = crate::guard::installed();
    let inner = if creds.is_some() { SocketAddr::from(([127, 0, 0, 1], bind.port())) } else { bind };
    let config = SchedulerConfig {
        bind_host: inner.ip().to_string(),
        bind_port: bind.port(),
        external_host: bind.ip().to_string(),
        override_create_grpc_client_endpoint: creds.as_ref().map(|c| c.endpoint_override()),
        // One task per executor in turn: model calls wait on the network, not the CPU, so a
        // query's partitions are better spread over every executor (and its throttle) than
        // packed into the first one's slots.
        task_distribution: TaskDistributionPolicy::RoundRobin,
        // A lost executor is noticed within half a minute (executors beat every 10 s), and its
        // tasks go to the others; Ballista's 3 minutes would stall a query that long.
        executor_timeout_seconds: EXECUTOR_TIMEOUT_SECS,
        expire_dead_executor_interval_seconds: 5,
        no_executors_grace_period_seconds: EXECUTOR_TIMEOUT_SECS,
        ..SchedulerConfig::default()
    }
    .with_override_session_builder(builder);
    let cluster = BallistaCluster::new_from_config(&config).await.map_err(|e| e.to_string())?;
    let quota_addr = crate::quota::service_addr(bind).ok_or_else(|| format!("{bind}: the port must be at least 2"))?;
    let quota_listener =
        tokio::net::TcpListener::bind(quota_addr).await.map_err(|e| format!("{quota_addr} (quota service): {e}"))?;
    let quotas = crate::quota::serve(quota_listener, creds.clone(), page);
    let server = async { start_server(cluster, inner, Arc::new(config)).await.map_err(|e| e.to_string()) };
    match creds {
        None => tokio::select! {
            r = server => r,
            r = quotas => r,
        },
        Some(creds) => {
            let listener = tokio::net::TcpListener::bind(bind).await.map_err(|e| format!("{bind}: {e}"))?;
            tokio::select! {
                r = server => r,
                r = quotas => r,
                r = crate::guard::serve(creds, listener, inner) => r,
            }
        }
    }
}

/// Where an executor listens and which scheduler it serves.
#[derive(Debug, Clone)]
pub struct ExecutorPlace {
    /// The scheduler's address.
    pub scheduler: SocketAddr,
    /// The host the executor binds and is reached at.
    pub host: String,
    /// Its Arrow Flight port (results and shuffles).
    pub port: u16,
    /// Its gRPC port (tasks from the scheduler).
    pub grpc_port: u16,
    /// Tasks run at once [default: the cores].
    pub slots: Option<usize>,
    /// Where shuffle files go [default: a temporary directory].
    pub work_dir: Option<String>,
    /// Where its queries may read and write files.
    pub allowed: crate::fence::Allowed,
    /// Its model calls, watched: told to the scheduler for the cluster's page.
    pub watch: Option<Arc<weir_runtime::dash::Watch>>,
}

/// Ballista's execution engine with each task's plan checked against the places the executor
/// allows (see [`crate::fence`]) before it runs, and each task tagged so that its model calls
/// stop when the task is cancelled (see [`crate::cancel`]).
struct CancellableEngine {
    inner: Arc<dyn ExecutionEngine>,
    allowed: crate::fence::Allowed,
}

impl ExecutionEngine for CancellableEngine {
    fn create_query_stage_exec(
        &self,
        job_id: JobId,
        stage_id: usize,
        task_id: usize,
        global_output_partition_ids: Vec<usize>,
        plan: Arc<dyn ExecutionPlan>,
        work_dir: &str,
        config: &SessionConfig,
    ) -> datafusion::common::Result<Arc<dyn QueryStageExecutor>> {
        self.allowed.check(plan.as_ref())?;
        let stage = self.inner.create_query_stage_exec(
            job_id,
            stage_id,
            task_id,
            global_output_partition_ids,
            plan,
            work_dir,
            config,
        )?;
        Ok(Arc::new(CancellableStage { inner: stage, task_id, rows: Arc::default() }))
    }
}

/// A query stage (one task of it) whose model calls stop when its execution is dropped, and
/// whose metrics say which task it was and how many rows it called (see [`rows_called_again`]).
#[derive(Debug)]
struct CancellableStage {
    inner: Arc<dyn QueryStageExecutor>,
    /// The task's number in its stage.
    task_id: usize,
    /// Rows the task's calls were made for.
    rows: Arc<std::sync::atomic::AtomicU64>,
}

/// The metric naming the task that produced a partition's output.
const TASK_METRIC: &str = "weir_task";
/// The metric counting the rows a task called models for.
const ROWS_METRIC: &str = "weir_rows_called";

impl std::fmt::Display for CancellableStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

#[async_trait::async_trait]
impl QueryStageExecutor for CancellableStage {
    async fn execute_query_stage(
        &self,
        task_id: usize,
        context: Arc<TaskContext>,
    ) -> datafusion::common::Result<Vec<ShuffleWritePartition>> {
        let task = crate::cancel::Task::start(self.rows.clone());
        let mut config = context.session_config().clone();
        config.options_mut().extensions.insert(task.tag.clone());
        let tagged = Arc::new(TaskContext::new(
            context.task_id(),
            context.session_id(),
            config,
            context.scalar_functions().clone(),
            context.higher_order_functions().clone(),
            context.aggregate_functions().clone(),
            context.window_functions().clone(),
            context.runtime_env(),
        ));
        let written = self.inner.execute_query_stage(task_id, tagged).await;
        drop(task);
        written
    }

    fn collect_plan_metrics(&self) -> Vec<MetricsSet> {
        use datafusion::physical_plan::metrics::{Count, Metric, MetricValue};
        let mut sets = self.inner.collect_plan_metrics();
        // Added to the stage root's set (the scheduler expects one set per operator), on the
        // task's own partition, which the scheduler keeps per partition from the task that
        // last produced it.
        if let Some(root) = sets.first_mut() {
            let count = |name: &'static str, n: usize| {
                let c = Count::new();
                c.add(n);
                Arc::new(Metric::new(MetricValue::Count { name: name.into(), count: c }, Some(0)))
            };
            root.push(count(TASK_METRIC, self.task_id));
            root.push(count(ROWS_METRIC, self.rows.load(std::sync::atomic::Ordering::Relaxed) as usize));
        }
        sets
    }

    fn collect_runtime_stats_reports(&self) -> Vec<ballista_core::serde::protobuf::RuntimeStatsReport> {
        self.inner.collect_runtime_stats_reports()
    }

    fn collect_window_state_reports(
        &self,
    ) -> datafusion::common::Result<Vec<ballista_core::serde::protobuf::WindowStateReport>> {
        self.inner.collect_window_state_reports()
    }

    fn collect_column_stats(&self) -> Vec<ballista_core::serde::protobuf::TaskColumnStats> {
        self.inner.collect_column_stats()
    }
}

/// Runs an executor until it stops; its tasks call the endpoints through `functions`.
pub async fn executor(place: ExecutorPlace, functions: Arc<Runtime>) -> Result<(), String> {
    let mut registry = BallistaFunctionRegistry::default();
    // Ballista's registry holds DataFusion's core functions only; the array functions
    // (`array_length`, `make_array`, `unnest`'s helpers, `v[1]`) are what embeddings need.
    for f in datafusion::functions_nested::all_default_nested_functions() {
        registry.scalar_functions.insert(f.name().to_string(), f);
    }
    for udf in crate::udf::all(&functions) {
        registry.scalar_functions.insert(udf.name().to_string(), Arc::new(udf));
    }
    let defaults = ExecutorProcessConfig::default();
    // With credentials, Ballista listens on 127.0.0.1 and weir's guards on the host given, at
    // the same ports (which is what the executor tells the scheduler); its clients, its tasks'
    // too (reading other executors' shuffle files), connect with the credentials.
    let creds = crate::guard::installed();
    // Calls of every executor that share an endpoint and key are admitted by one throttle, the
    // scheduler's (see crate::quota).
    if let Some(hub) = crate::quota::SchedulerHub::new(place.scheduler, creds.clone()) {
        let hub: Arc<dyn weir_runtime::share::Hub> = Arc::new(hub);
        weir_runtime::share::use_hub(hub.clone());
        // Its calls on the scheduler's page, through the same service.
        if let Some(watch) = place.watch.clone() {
            let who = format!("{}:{}", place.host, place.port);
            tokio::spawn(weir_runtime::gather::report_to(hub, watch, who));
        }
    }
    let bind_host = if creds.is_some() { "127.0.0.1".to_string() } else { place.host.clone() };
    let producer: Option<ballista_core::ConfigProducer> = creds.as_ref().map(|c| {
        let endpoint = c.endpoint_override();
        let tls = c.tls_on();
        Arc::new(move || {
            use ballista_core::extension::SessionConfigExt;
            SessionConfig::new_with_ballista()
                .with_ballista_override_create_grpc_client_endpoint(endpoint.clone())
                .with_ballista_use_tls(tls)
        }) as ballista_core::ConfigProducer
    });
    let config = ExecutorProcessConfig {
        bind_host,
        override_create_grpc_client_endpoint: creds.as_ref().map(|c| c.endpoint_override()),
        override_config_producer: producer,
        external_host: Some(place.host.clone()),
        port: place.port,
        grpc_port: place.grpc_port,
        scheduler_host: place.scheduler.ip().to_string(),
        scheduler_port: place.scheduler.port(),
        vcores: place.slots.unwrap_or(defaults.vcores),
        work_dir: place.work_dir.clone(),
        special_mod_log_level: "WARN".into(),
        executor_heartbeat_interval_seconds: 10,
        print_thread_info: false,
        override_function_registry: Some(Arc::new(registry)),
        // (Without Ballista's pool of clients for reading other executors' shuffle files, which
        // it does not export; queries of weir's are mostly one stage.)
        override_execution_engine: Some(Arc::new(CancellableEngine {
            inner: Arc::new(DefaultExecutionEngine::new()),
            allowed: place.allowed.clone(),
        })),
        // Ballista's Flight service, serving only job ids the scheduler could have made.
        override_arrow_flight_service: Some(crate::flight_guard::provider(
            defaults.grpc_max_encoding_message_size.max(defaults.grpc_max_decoding_message_size) as usize,
        )),
        override_runtime_producer: {
            let allowed = place.allowed.clone();
            Some(Arc::new(move |_: &SessionConfig| runtime(Some(&allowed))))
        },
        ..defaults
    };
    let proxies = async {
        let Some(creds) = creds else { return std::future::pending().await };
        let mut serving = Vec::new();
        for port in [place.port, place.grpc_port] {
            let listen = format!("{}:{port}", place.host);
            let listener = tokio::net::TcpListener::bind(&listen).await.map_err(|e| format!("{listen}: {e}"))?;
            serving.push(Box::pin(crate::guard::serve(
                creds.clone(),
                listener,
                SocketAddr::from(([127, 0, 0, 1], port)),
            )));
        }
        futures::future::select_all(serving).await.0
    };
    tokio::select! {
        r = start_executor_process(Arc::new(config)) => r.map_err(|e| e.to_string()),
        never = watch_scheduler(place.scheduler) => match never {},
        r = proxies => r,
    }
}

/// Checks every few seconds that the scheduler still takes connections; once it has not for
/// [`SCHEDULER_GONE`], stops the calls of every running task. Ballista's executor goes on
/// running a task to its end without its scheduler, and every call it makes is paid for while
/// nobody can collect the results (a client whose scheduler died was told the query failed).
async fn watch_scheduler(scheduler: SocketAddr) -> std::convert::Infallible {
    let every = std::time::Duration::from_secs(5);
    let mut missed = 0u32;
    loop {
        tokio::time::sleep(every).await;
        let reached = tokio::time::timeout(every, tokio::net::TcpStream::connect(scheduler)).await;
        if matches!(reached, Ok(Ok(_))) {
            missed = 0;
            continue;
        }
        missed += 1;
        if every * missed == SCHEDULER_GONE {
            let stopped = crate::cancel::cancel_all();
            if stopped > 0 {
                // Not eprintln!: it panics when stderr's reader has gone away.
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "weir: the scheduler at {scheduler} has not answered for {} s; stopped the calls of the {stopped} \
                     task(s) running here (nobody could collect their results)",
                    SCHEDULER_GONE.as_secs()
                );
            }
        }
    }
}

/// How long an executor goes without reaching its scheduler before it stops its tasks' calls.
const SCHEDULER_GONE: std::time::Duration = std::time::Duration::from_secs(15);

/// A session whose queries run on the cluster behind `url` (`df://HOST:PORT`), with weir's
/// functions known for planning. They are registered after connecting: setting up a Ballista
/// session starts from a fresh function registry.
pub async fn connect(url: &str, config: SessionConfig, functions: &Arc<Runtime>) -> Result<SessionContext, String> {
    let config = match crate::guard::installed() {
        Some(creds) => {
            use ballista_core::extension::SessionConfigExt;
            config
                .with_ballista_override_create_grpc_client_endpoint(creds.endpoint_override())
                .with_ballista_use_tls(creds.tls_on())
        }
        None => config,
    };
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(runtime(None).map_err(|e| e.to_string())?)
        .with_default_features()
        .build();
    // `dfs://` (mutual TLS, installed with the credentials) is `df://` to Ballista.
    let wire = format!("df://{}", crate::scheduler_address(url).unwrap_or(url));
    let ctx = SessionContext::remote_with_state(&wire, state).await.map_err(|e| format!("{url}: {e}"))?;
    let settings = [
        // The client asks for the job's status rather than waiting for the scheduler to push
        // it: pushed, the job's id arrives only when a stage ends, too late to cancel the job
        // when the user stops the query.
        (ballista_core::config::BALLISTA_CLIENT_PULL, "true"),
        // One partition per task: tasks run again are then known by their number (see
        // rows_called_again).
        (ballista_core::config::BALLISTA_SCHEDULER_MAX_PARTITIONS_PER_TASK, "1"),
        // Ballista's static planner, not its adaptive one (new in 55): a two-stage query whose
        // executor was lost hung in the adaptive planner's bookkeeping ("Can't find active
        // stage to update stage outputs") after paying for its first stage again.
        (ballista_core::config::BALLISTA_ADAPTIVE_PLANNER_ENABLED, "false"),
    ];
    {
        let state = ctx.state_ref();
        let mut state = state.write();
        for (key, value) in settings {
            state.config_mut().options_mut().set(key, value).map_err(|e| e.to_string())?;
        }
    }
    crate::register(&ctx, functions);
    Ok(ctx)
}

/// The scheduler's job behind a running cluster query's `plan` (once the scheduler accepted
/// it), to cancel it: a client that stops reading a query's results does not stop the query,
/// and its executors would go on calling (and paying for) models.
pub fn job_id(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> Option<String> {
    type Distributed =
        ballista_core::execution_plans::DistributedQueryExec<datafusion_proto::protobuf::LogicalPlanNode>;
    if let Some(d) = plan.downcast_ref::<Distributed>() {
        return d.job_id().map(|j| j.to_string());
    }
    plan.children().into_iter().find_map(job_id)
}

/// Rows of a finished `job` whose model calls were made again, by tasks that ran a second time
/// (Ballista runs a lost executor's tasks again, the finished ones too when the next stage
/// still needed their output, and any task that failed): their earlier calls were most likely
/// paid for too, and the client is told, since the executors that made them cannot know.
///
/// Tasks carry one partition each (see [`connect`]), so the first run of a stage of `n`
/// partitions is its tasks `0..n`; the scheduler keeps each partition's metrics from the task
/// that last produced it, and a task numbered `n` or above ran a partition again. (A partition
/// run three times counts once: this is a lower bound.)
pub async fn rows_called_again(url: &str, job: &str) -> Result<u64, String> {
    use ballista_core::serde::protobuf::operator_metric::Metric;
    let mut again = 0;
    for stage in finished(url, job).await? {
        // Per partition: the task that produced it, and the rows it called.
        let mut parts: std::collections::HashMap<u32, (u64, u64)> = Default::default();
        for op in stage.operators.iter().filter(|o| o.depth == 0) {
            for m in &op.metrics {
                if let (Some(p), Some(Metric::Count(c))) = (m.partition, &m.metric) {
                    let entry = parts.entry(p).or_default();
                    match c.name.as_str() {
                        TASK_METRIC => entry.0 = c.value,
                        ROWS_METRIC => entry.1 = c.value,
                        _ => {}
                    }
                }
            }
        }
        again +=
            parts.values().filter(|(task, _)| *task >= u64::from(stage.partitions)).map(|(_, rows)| rows).sum::<u64>();
    }
    Ok(again)
}

/// The finished stages of `job`, with their metrics.
async fn finished(url: &str, job: &str) -> Result<Vec<ballista_core::serde::protobuf::JobStageMetrics>, String> {
    use ballista_core::serde::protobuf::GetJobMetricsParams;
    let mut client = crate::guard::scheduler_client(url).await.map_err(|e| e.to_string())?;
    let answer = client.get_job_metrics(GetJobMetricsParams { job_id: job.to_string() }).await;
    Ok(answer.map_err(|e| e.message().to_string())?.into_inner().stages)
}

/// How many stages of a running `job` have finished (to tell a query waiting for executors from
/// one they are busy with).
pub async fn finished_stages(url: &str, job: &str) -> Result<usize, String> {
    Ok(finished(url, job).await?.len())
}

/// Asks the scheduler behind `url` (`df://HOST:PORT`) to cancel `job`: its tasks stop on every
/// executor.
pub async fn cancel_job(url: &str, job: &str) -> Result<(), String> {
    use ballista_core::serde::protobuf::CancelJobParams;
    let mut client = crate::guard::scheduler_client(url).await.map_err(|e| e.to_string())?;
    let answer =
        client.cancel_job(CancelJobParams { job_id: job.to_string() }).await.map_err(|e| e.message().to_string())?;
    if answer.into_inner().cancelled {
        Ok(())
    } else {
        Err(format!("the scheduler did not cancel job {job}"))
    }
}

/// What is wrong with a `--cluster` address.
#[derive(Debug, thiserror::Error)]
pub enum ReachError {
    /// Nothing answers there (not started, or another host or port).
    #[error("cannot reach the scheduler at {url}: start it with weir cluster scheduler --bind HOST:PORT ({reason})")]
    Unreachable {
        /// The address given.
        url: String,
        /// The connection's error.
        reason: String,
    },
    /// The scheduler wants the cluster's token, and this client has none or another.
    #[error(
        "the scheduler at {url} refused this client: the cluster takes only holders of its token; give the same \
         token as the scheduler's (WEIR_CLUSTER_TOKEN or --token-file)"
    )]
    Refused {
        /// The address given.
        url: String,
    },
    /// Something answers that is not a scheduler.
    #[error(
        "{url} is not a cluster scheduler, or refused this client (an executor's port, or another server? \
         executors use --port and --grpc-port; the scheduler is at its --bind address, 127.0.0.1:50050 unless set. \
         A cluster with mutual TLS takes dfs://HOST:PORT with --tls-ca, --tls-cert and --tls-key, and refuses a \
         certificate its own authority did not sign; a TLS client is refused by a cluster without TLS; a cluster with \
         a token takes the same token, from --token-file or WEIR_CLUSTER_TOKEN)"
    )]
    NotAScheduler {
        /// The address given.
        url: String,
    },
}

/// Checks that a scheduler answers at `url` (`df://HOST:PORT`) before a query is sent there.
pub async fn probe(url: &str) -> Result<(), ReachError> {
    use ballista_core::serde::protobuf::GetJobStatusParams;
    let unreachable = |reason: String| ReachError::Unreachable { url: url.to_string(), reason };
    let connect = tokio::time::timeout(std::time::Duration::from_secs(10), crate::guard::scheduler_client(url));
    let mut client = match connect.await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => {
            let reason = std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_else(|| e.to_string());
            // The whole chain: the cause that says "refused" is often a few levels down.
            let mut chain = e.to_string();
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                chain.push_str(": ");
                chain.push_str(&c.to_string());
                cause = c.source();
            }
            // Nothing listens there, or the host cannot be reached or found: unreachable. Any
            // other failure to connect (a TLS handshake refused, a TLS client at a plain port)
            // means something answered, and refused this client or is not a cluster's.
            let lower = chain.to_ascii_lowercase();
            let absent = ["refused", "unreachable", "no route", "timed out", "dns", "resolve", "lookup", "not known"]
                .iter()
                .any(|t| lower.contains(t));
            if !absent {
                return Err(ReachError::NotAScheduler { url: url.to_string() });
            }
            return Err(unreachable(reason));
        }
        Err(_) => return Err(unreachable("no answer in 10 s".into())),
    };
    // Any answer but "unimplemented" comes from a scheduler (an unknown job is fine).
    match client.get_job_status(GetJobStatusParams { job_id: "weir-probe".into() }).await {
        Err(status) if status.code() == tonic::Code::Unauthenticated => {
            Err(ReachError::Refused { url: url.to_string() })
        }
        Err(status) if status.code() == tonic::Code::Unimplemented => {
            Err(ReachError::NotAScheduler { url: url.to_string() })
        }
        // A TLS listener closes a plain client's connection: something is there, and refused it.
        Err(status)
            if status.code() == tonic::Code::Unavailable
                && ["broken pipe", "h2 protocol", "connection reset", "FRAME_SIZE"]
                    .iter()
                    .any(|t| format!("{status:?}").to_ascii_lowercase().contains(&t.to_ascii_lowercase())) =>
        {
            Err(ReachError::NotAScheduler { url: url.to_string() })
        }
        Err(status) if status.code() == tonic::Code::Unavailable => Err(unreachable(status.message().to_string())),
        // Not gRPC at all (an HTTP server such as weir sim, a metrics port).
        Err(status) if status.code() == tonic::Code::Unknown => Err(ReachError::NotAScheduler { url: url.to_string() }),
        _ => Ok(()),
    }
}
