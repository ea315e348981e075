//! weir's functions on an Apache DataFusion Ballista cluster: a scheduler that can plan queries
//! using them, executors that run them, and a client session that submits queries.
//!
//! Plans name the functions only; each process brings its own implementation. The scheduler's
//! copy plans and is never called. Each executor's copy calls the endpoints with that
//! executor's settings and credentials (keys never travel in plans), and all the tasks an
//! executor runs share one throttle per endpoint. Executors do not talk to each other about
//! the quota: each learns it from the endpoint's 429s and rate-limit headers, as separate
//! `weir run` processes sharing a key do.

use ballista::prelude::SessionContextExt;
use ballista_core::registry::BallistaFunctionRegistry;
use ballista_executor::executor_process::{start_executor_process, ExecutorProcessConfig};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::{SchedulerConfig, TaskDistributionPolicy};
use ballista_scheduler::scheduler_process::start_server;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use std::net::SocketAddr;
use std::sync::Arc;

use crate::tables::Stores;
use weir_engine::Engine;

/// Seconds without a heartbeat after which the scheduler takes an executor for lost.
const EXECUTOR_TIMEOUT_SECS: u64 = 30;

/// A runtime whose object stores are found as `weir sql` finds them (`s3://`, `gs://`).
fn runtime() -> datafusion::common::Result<Arc<RuntimeEnv>> {
    RuntimeEnvBuilder::new().with_object_store_registry(Arc::new(Stores::new())).build_arc()
}

/// Runs a scheduler on `bind` until it fails. `functions` only plans (a scheduler makes no
/// calls), so its settings do not matter.
pub async fn scheduler(bind: SocketAddr, functions: Arc<Engine>) -> Result<(), String> {
    let udfs = crate::udf::all(&functions);
    let builder = Arc::new(move |config: SessionConfig| {
        let mut state = SessionStateBuilder::new()
            .with_config(config)
            .with_runtime_env(runtime()?)
            .with_default_features()
            .with_optimizer_rule(Arc::new(crate::HoistModelCalls))
            .build();
        for udf in &udfs {
            datafusion::execution::FunctionRegistry::register_udf(&mut state, Arc::new(udf.clone()))?;
        }
        Ok(state)
    });
    let config = SchedulerConfig {
        bind_host: bind.ip().to_string(),
        bind_port: bind.port(),
        external_host: bind.ip().to_string(),
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
    start_server(cluster, bind, Arc::new(config)).await.map_err(|e| e.to_string())
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
}

/// Runs an executor until it stops; its tasks call the endpoints through `functions`.
pub async fn executor(place: ExecutorPlace, functions: Arc<Engine>) -> Result<(), String> {
    let mut registry = BallistaFunctionRegistry::default();
    for udf in crate::udf::all(&functions) {
        registry.scalar_functions.insert(udf.name().to_string(), Arc::new(udf));
    }
    let defaults = ExecutorProcessConfig::default();
    let config = ExecutorProcessConfig {
        bind_host: place.host.clone(),
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
        override_runtime_producer: Some(Arc::new(|_: &SessionConfig| runtime())),
        ..defaults
    };
    start_executor_process(Arc::new(config)).await.map_err(|e| e.to_string())
}

/// A session whose queries run on the cluster behind `url` (`df://HOST:PORT`), with weir's
/// functions known for planning. They are registered after connecting: setting up a Ballista
/// session starts from a fresh function registry.
pub async fn connect(url: &str, config: SessionConfig, functions: &Arc<Engine>) -> Result<SessionContext, String> {
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(runtime().map_err(|e| e.to_string())?)
        .with_default_features()
        .build();
    let ctx = SessionContext::remote_with_state(url, state).await.map_err(|e| format!("{url}: {e}"))?;
    crate::register(&ctx, functions);
    Ok(ctx)
}
