//! The runtime: one connection and one throttle per endpoint for the whole process, and a driver
//! per request for answers (a batch of rows from SQL, a list from Python), so a stop — a dead
//! endpoint, failing credentials, a spent daily quota — ends that request's rows without leaving
//! the process unable to answer later ones.

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use weir_core::{
    is_deterministic, Driver, DriverSettings, ErrorKind, Failure, GenParams, ModelError, ModelHandler, Outcome, Record,
    RecordId, ResponseCache, RunMetrics, StopReason, Throttle, ThrottleSettings,
};
use weir_providers::{Endpoint, ModelSpec, ProviderError, ProviderOptions, Task};

/// How the runtime reaches its endpoints, validated by the front end (`weir sql`, an executor,
/// the Python package): the same settings as `weir run`'s.
#[derive(Clone, Default)]
pub struct RuntimeSettings {
    /// Base URL, project, location (the task is set per request).
    pub provider: ProviderOptions,
    /// Concurrency and rate limits, per endpoint.
    pub throttle: ThrottleSettings,
    /// Timeout, retries, and when to stop trying (system text and parameters come per row).
    pub driver: DriverSettings,
    /// Answers already paid for, reused under the cache's rule (see `weir_core::cache`): rows
    /// with an id reuse their own answer; rows without one only a deterministic request's.
    pub cache: Option<Arc<dyn ResponseCache>>,
    /// The endpoints every model is called at, each with what differs from `provider` and
    /// `throttle` (see [`crate::endpoints`]); empty: the one endpoint `provider` names.
    pub pool: Vec<crate::EndpointEntry>,
}

impl std::fmt::Debug for RuntimeSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeSettings")
            .field("provider", &self.provider)
            .field("throttle", &self.throttle)
            .field("driver", &self.driver)
            .field("cache", &self.cache.is_some())
            .field("pool", &self.pool)
            .finish()
    }
}

/// The system text and generation parameters of a row's request. Rows that share one (the
/// same `Arc`) go through one driver together.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Call {
    /// System instructions.
    pub system: Option<Arc<str>>,
    /// Generation parameters.
    pub params: Arc<GenParams>,
}

/// One row to answer.
#[derive(Debug, Clone)]
pub struct Row {
    /// `provider/model`; `None` (SQL NULL) gives [`RowResult::Null`].
    pub model: Option<String>,
    /// The prompt, or the text to embed; `None` gives [`RowResult::Null`].
    pub prompt: Option<String>,
    /// The row's own id, under which its answer is cached (a sampled answer is reused only for
    /// the same id); `None` when the caller has none.
    pub id: Option<RecordId>,
    /// System text and parameters.
    pub call: Arc<Call>,
    /// Media sent after the prompt, in order (a SQL media argument, Python's `media_fields`).
    pub media: Vec<weir_core::media::MediaRef>,
}

/// Sets up the client of a model. The default is [`crate::connect`]: `weir_providers`' clients
/// and the connectors registered with it (`sim/`, and `local/` where the program links a local
/// runtime); tests pass their own.
pub type Connector =
    Arc<dyn Fn(ModelSpec, ProviderOptions) -> BoxFuture<'static, Result<Endpoint, ProviderError>> + Send + Sync>;

/// One model's endpoints (one, or a pool): their clients, throttles, health and counters.
struct Site {
    /// The first endpoint's client and throttle.
    handler: Arc<dyn ModelHandler>,
    throttle: Arc<Throttle>,
    /// Every endpoint's client, in the pool's order.
    handlers: Vec<Arc<dyn ModelHandler>>,
    /// Every endpoint's throttle and health, shared by every driver of the model.
    pool: Arc<weir_core::Pool>,
    metrics: Arc<RunMetrics>,
    /// The last request found nothing answering at the endpoint: the next one asks once and
    /// stops at once if that fails too (see `Driver::presumed_unreachable`).
    unreachable: std::sync::atomic::AtomicBool,
}

/// Every endpoint's throttle in this process, by the model and where it is served, with the
/// settings it was made with: runtimes made with other settings (two Python engines, a SQL
/// session and a Beam worker's handler) that call one endpoint share its quota, instead of
/// each learning it alone and together sending more than it allows.
type Throttles = HashMap<String, (std::sync::Weak<Throttle>, ThrottleSettings)>;

fn throttles() -> &'static Mutex<Throttles> {
    static THROTTLES: std::sync::OnceLock<Mutex<Throttles>> = std::sync::OnceLock::new();
    THROTTLES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The throttle of `handler`'s endpoint: the one already in use in this process, or a new one
/// with `settings`. The first settings made it; later ones that differ are said to be unused.
fn shared_throttle(handler: &dyn ModelHandler, settings: &ThrottleSettings) -> Arc<Throttle> {
    // The credential too: one server called with two keys (two endpoints of a pool) is two quotas.
    let key =
        format!("{}\u{0}{}\u{0}{}", handler.model_id(), handler.endpoint(), handler.quota_credential().unwrap_or(""));
    let mut all = throttles().lock().unwrap_or_else(|e| e.into_inner());
    if let Some((weak, made_with)) = all.get(&key) {
        if let Some(throttle) = weak.upgrade() {
            if made_with != settings {
                tracing::warn!(
                    "{}: this process already calls this endpoint with other limits; the first ones stay in force \
                     (one throttle per endpoint, so that both stay within its quota together)",
                    handler.model_id()
                );
            }
            return throttle;
        }
    }
    let throttle = Arc::new(Throttle::new(settings));
    let name = || crate::share::quota_name(handler.model_id(), handler.endpoint(), handler.quota_credential());
    match &settings.store {
        weir_core::QuotaStore::Local => crate::share::join(&throttle, name()),
        weir_core::QuotaStore::Cluster => crate::share::follow_hub(&throttle, name(), settings),
        #[cfg(feature = "redis")]
        weir_core::QuotaStore::Redis(url) => crate::share_redis::join(&throttle, name(), url.as_str()),
        #[cfg(not(feature = "redis"))]
        weir_core::QuotaStore::Redis(_) => {
            tracing::warn!("the quota is not shared: this build of weir has no Redis client (feature `redis`)")
        }
        weir_core::QuotaStore::Off => {}
    }
    all.retain(|_, (w, _)| w.strong_count() > 0);
    all.insert(key, (Arc::downgrade(&throttle), settings.clone()));
    throttle
}

/// One endpoint as a summary or `/metrics` shows it.
#[derive(Debug, Clone)]
pub struct EndpointState {
    /// `provider/model`.
    pub model: String,
    /// Where it is served (a URL or a local path).
    pub endpoint: String,
    /// Calls its throttle allows in flight now.
    pub concurrency: usize,
    /// This process's calls its throttle holds for the quota now (see
    /// [`weir_core::Throttle::held_now`]).
    pub held: usize,
    /// Its rate limits, told or learned, if any.
    pub rate: Option<weir_core::RateSnapshot>,
    /// How its quota was shared with this machine's other processes.
    pub sharing: weir_core::Sharing,
    /// Its counters.
    pub metrics: Arc<RunMetrics>,
    /// A pool's endpoints, each as it stands (empty for a model called at one endpoint).
    pub pool: Vec<weir_core::EndpointStatus>,
    /// Why its quota could not be shared with other processes, if it could not.
    pub unshared: Option<String>,
}

/// Rows that go through one driver: a model, the call they share, and whether they have ids.
type Group = (String, Arc<Call>, bool);

/// A group's rows: their places in the request, prompts and ids.
type Members = Vec<Member>;

/// What became of one row.
#[derive(Debug)]
pub enum RowResult {
    /// A NULL model or prompt: no call, a NULL result.
    Null,
    /// The row's outcome, and the `provider/model` that was asked.
    Done(Box<Outcome>, Arc<str>),
}

/// The line of the record an outcome is about (its row's place in the request, from 1).
fn outcome_line(o: &Outcome) -> u64 {
    match o {
        Outcome::Success(s) => s.record.line,
        Outcome::Failure(f) => f.line,
    }
}

/// The record of the row at `i` (its id, else its place).
fn record_of((i, prompt, id, media): Member) -> (usize, Record) {
    let line = i as u64 + 1;
    let mut record =
        Record::new(id.unwrap_or_else(|| RecordId::Text(line.to_string())), line, prompt, Default::default());
    record.media = media;
    (i, record)
}

/// A row of a request on its way to a driver: its place, prompt, id and media.
type Member = (usize, String, Option<RecordId>, Vec<weir_core::media::MediaRef>);

/// The process's endpoints, shared by every caller (every partition and query of SQL, every
/// thread of a Python process).
pub struct Runtime {
    settings: RuntimeSettings,
    connector: Connector,
    sites: tokio::sync::Mutex<HashMap<(bool, String), Arc<Site>>>,
    /// What every endpoint's counters count too: the process's (or run's) totals.
    totals: Arc<RunMetrics>,
    /// The counters of records that reach no model.
    unrouted: std::sync::OnceLock<Arc<RunMetrics>>,
    /// Every endpoint's counters, by model, for the summary and its cost.
    by_model: Mutex<BTreeMap<String, Arc<RunMetrics>>>,
    /// Servers run in this process behind `sim/` models, kept alive while the runtime is.
    residents: Mutex<Vec<weir_providers::Resident>>,
    /// Why a call of a function stopped early (the most recent reason).
    stopped: Mutex<Option<StopReason>>,
    /// Reads records' media, when a front end gave one that reads more than files and URLs.
    media: std::sync::OnceLock<Arc<dyn weir_core::media::MediaLoader>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// Connects with [`crate::connect`], reading keys from the process's environment.
fn default_connector() -> Connector {
    Arc::new(|spec, options| async move { crate::connect(&spec, &options, &|k| std::env::var(k).ok()).await }.boxed())
}

impl Runtime {
    /// A runtime that connects with [`crate::connect`] and reads keys from the environment.
    pub fn new(settings: RuntimeSettings) -> Arc<Self> {
        Self::with_connector(settings, default_connector())
    }

    /// A runtime that connects with `connector`.
    pub fn with_connector(settings: RuntimeSettings, connector: Connector) -> Arc<Self> {
        Arc::new(Self {
            settings,
            connector,
            sites: tokio::sync::Mutex::new(HashMap::new()),
            totals: Arc::new(RunMetrics::default()),
            unrouted: std::sync::OnceLock::new(),
            by_model: Mutex::new(BTreeMap::new()),
            residents: Mutex::new(Vec::new()),
            stopped: Mutex::new(None),
            media: std::sync::OnceLock::new(),
        })
    }

    /// Reads records' media with `loader` (a front end's, that also reads buckets) in place of
    /// [`crate::media::Loader::shared`]; only before the first driver is made.
    pub fn set_media(&self, loader: Arc<dyn weir_core::media::MediaLoader>) {
        let _ = self.media.set(loader);
    }

    /// Counters of every model called so far, by `provider/model`.
    pub fn metrics_by_model(&self) -> BTreeMap<String, Arc<RunMetrics>> {
        self.by_model.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The counters of records that end without reaching any model (a line that did not
    /// parse, a model field naming no usable model): labelled `model="none"`.
    pub fn unrouted(&self) -> Arc<RunMetrics> {
        self.unrouted.get_or_init(|| Arc::new(RunMetrics::of_endpoint(Some(self.totals.clone()), "none", ""))).clone()
    }

    /// Every model's counters together (what a run's progress bar and summary show).
    pub fn totals(&self) -> &Arc<RunMetrics> {
        &self.totals
    }

    /// The counters of `model` at `endpoint` (made on first use), counting into the totals.
    fn metrics_of(&self, model: &str, endpoint: &str) -> Arc<RunMetrics> {
        let mut by_model = self.by_model.lock().unwrap_or_else(|e| e.into_inner());
        by_model
            .entry(model.to_string())
            .or_insert_with(|| Arc::new(RunMetrics::of_endpoint(Some(self.totals.clone()), model, endpoint)))
            .clone()
    }

    /// Every endpoint connected so far: its model, where it is, the concurrency its throttle
    /// allows now and its rate limits (told or learned), for summaries and `/metrics`.
    pub async fn endpoints(&self) -> Vec<EndpointState> {
        let sites = self.sites.lock().await;
        let mut all: Vec<EndpointState> = sites
            .iter()
            .map(|((_, model), s)| EndpointState {
                model: model.clone(),
                endpoint: s.handler.endpoint().to_string(),
                concurrency: s.pool.concurrency(),
                held: s.pool.held(),
                rate: Some(s.throttle.rates()),
                sharing: s.throttle.sharing(),
                metrics: s.metrics.clone(),
                pool: if s.pool.len() > 1 { s.pool.status() } else { Vec::new() },
                unshared: s.throttle.unshared(),
            })
            .collect();
        all.sort_by(|a, b| a.model.cmp(&b.model));
        all
    }

    /// The most recent reason a request for answers stopped early (its remaining rows failed).
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stopped.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The throttle of `model`'s endpoint, once connected (shared with every runtime of this
    /// process that calls the same endpoint).
    pub async fn throttle(&self, model: &str, embed: bool) -> Option<Arc<Throttle>> {
        let spec: ModelSpec = model.trim().parse().ok()?;
        self.sites.lock().await.get(&(embed, spec.to_string())).map(|s| s.throttle.clone())
    }

    /// Stops what its endpoints run in this process (the simulators behind `sim/` models), writes
    /// down what the quotas it holds on this machine know for the process that takes over, and
    /// leaves the quotas it shares through Redis (for a run that is ending: the process's last
    /// runtime), so that a run started next does not wait for its lease to run out.
    pub async fn shutdown(&self) {
        let residents = std::mem::take(&mut *self.residents.lock().unwrap_or_else(|e| e.into_inner()));
        for r in residents {
            r.shutdown().await;
        }
        crate::share::leave_all();
        #[cfg(feature = "redis")]
        crate::share_redis::leave_all().await;
    }

    /// Connects to `model`'s endpoint now (it is otherwise connected on first use), so that a
    /// front end can report an unknown model or a missing key before any row.
    pub async fn connect(&self, model: &str, embed: bool) -> Result<(), String> {
        self.site(model, embed).await.map(|_| ())
    }

    /// The endpoint of `model` (connected on first use).
    async fn site(&self, model: &str, embed: bool) -> Result<Arc<Site>, String> {
        let spec: ModelSpec =
            model.trim().parse().map_err(|e: ProviderError| e.to_string().replacen("--model ", "", 1))?;
        self.site_of(&spec, embed).await.map_err(|e| format!("{spec}: {e}"))
    }

    /// A driver for `spec`'s endpoint: its client, its throttle (this process's one), its
    /// counters; with `settings` (timeout, retries, system text, parameters), and the response
    /// cache when `cached`. `Err` says why the model cannot be used (a usage error: an unknown
    /// model, a missing key; or a failure to start what serves it).
    pub async fn driver(
        &self,
        spec: &ModelSpec,
        embed: bool,
        settings: DriverSettings,
        cache: Option<Arc<dyn ResponseCache>>,
    ) -> Result<Driver, ProviderError> {
        let site = self.site_of(spec, embed).await?;
        Ok(self.driver_at(&site, settings, cache))
    }

    /// Connects `spec`'s endpoint now (it is otherwise connected on first use): `Err` says why
    /// the model cannot be used, before anything else is done.
    pub async fn connect_spec(&self, spec: &ModelSpec, embed: bool) -> Result<(), ProviderError> {
        self.site_of(spec, embed).await.map(|_| ())
    }

    /// A driver at `site` (see [`Runtime::driver`]).
    fn driver_at(&self, site: &Site, settings: DriverSettings, cache: Option<Arc<dyn ResponseCache>>) -> Driver {
        let media = self.media.get().cloned().unwrap_or_else(|| crate::media::Loader::shared());
        let mut driver =
            Driver::pooled(site.handlers.clone(), site.pool.clone(), settings, site.metrics.clone()).with_media(media);
        if site.unreachable.load(std::sync::atomic::Ordering::Relaxed) {
            driver = driver.presumed_unreachable();
        }
        if let Some(cache) = cache {
            driver = driver.with_cache(cache);
        }
        driver
    }

    /// The settings every driver starts from.
    pub fn settings(&self) -> &RuntimeSettings {
        &self.settings
    }

    /// The endpoint of `spec` (connected on first use).
    async fn site_of(&self, spec: &ModelSpec, embed: bool) -> Result<Arc<Site>, ProviderError> {
        let key = (embed, spec.to_string());
        let mut sites = self.sites.lock().await;
        if let Some(s) = sites.get(&key) {
            return Ok(s.clone());
        }
        let mut options = self.settings.provider.clone();
        options.task = if embed { Task::Embed } else { Task::Generate };
        let single = [crate::EndpointEntry::default()];
        let entries: &[crate::EndpointEntry] =
            if self.settings.pool.is_empty() { &single } else { &self.settings.pool };
        let pooled = entries.len() > 1;
        let vertex =
            matches!(spec.provider, weir_providers::Provider::Vertex | weir_providers::Provider::VertexEndpoint);
        let mut handlers = Vec::with_capacity(entries.len());
        let mut members = Vec::with_capacity(entries.len());
        for (i, entry) in entries.iter().enumerate() {
            let named = |e: ProviderError| match e {
                ProviderError::Config(m) if pooled => ProviderError::Config(format!("{}: {m}", entry.label(i))),
                e => e,
            };
            if !vertex && (entry.project.is_some() || entry.location.is_some()) {
                return Err(named(ProviderError::Config(format!(
                    "a project or location is for vertex_ai/ models, not {spec}: this endpoint is of another provider"
                ))));
            }
            let endpoint = (self.connector)(spec.clone(), entry.provider(&options)).await.map_err(named)?;
            #[cfg(feature = "redis")]
            if let (weir_core::QuotaStore::Redis(url), None) = (&self.settings.throttle.store, &endpoint.resident) {
                crate::share_redis::check_server(url).await.map_err(ProviderError::Config)?;
            }
            let told = entry.throttle(&self.settings.throttle);
            // A server of this runtime's own (the simulator) is nobody else's endpoint.
            let throttle = match endpoint.resident {
                Some(_) => Arc::new(Throttle::new(&told)),
                None => shared_throttle(endpoint.handler.as_ref(), &told),
            };
            if let Some(r) = endpoint.resident {
                self.residents.lock().unwrap_or_else(|e| e.into_inner()).push(r);
            }
            let at = endpoint.handler.endpoint().to_string();
            members.push(weir_core::PoolMember {
                throttle,
                endpoint: entry.name.clone().unwrap_or(at),
                weight: entry.weight.unwrap_or(1.0),
            });
            handlers.push(endpoint.handler);
        }
        let handler = handlers[0].clone();
        let throttle = members[0].throttle.clone();
        let metrics = self.metrics_of(&spec.to_string(), handler.endpoint());
        metrics.announce();
        let site = Arc::new(Site {
            handler,
            throttle,
            handlers,
            pool: Arc::new(weir_core::Pool::new(members).with_most_in_flight(self.settings.throttle.max_concurrency)),
            metrics,
            unreachable: std::sync::atomic::AtomicBool::new(false),
        });
        sites.insert(key, site.clone());
        Ok(site)
    }

    /// Answers rows. Rows of one model and call go through one driver, all at once (the
    /// throttle admits them); an endpoint that takes many records per call gets them in
    /// batches. Results come back in the order of `rows`. `Err` is a problem with the request
    /// itself (an unknown model, a missing key), not with a row.
    pub async fn answer(&self, rows: Vec<Row>, embed: bool) -> Result<Vec<RowResult>, String> {
        self.answer_or_stop(rows, embed).await.map(|(results, _)| results).map_err(|e| e.to_string())
    }

    /// As [`Runtime::answer`], and says whether a model's calls stopped early during this
    /// request (a rejected key, a spent daily quota, an endpoint that stopped answering): the
    /// rows left then failed without being tried, and a front end that writes all rows at once
    /// (a SQL `COPY`) should fail rather than write them.
    pub async fn answer_or_stop(
        &self,
        rows: Vec<Row>,
        embed: bool,
    ) -> Result<(Vec<RowResult>, Option<StopReason>), String> {
        let mut out: Vec<RowResult> = (0..rows.len()).map(|_| RowResult::Null).collect();
        // Groups of rows that share a model and call, in the order first seen.
        let mut groups: Vec<(Group, Members)> = Vec::new();
        let mut index: HashMap<(String, usize, bool), usize> = HashMap::new();
        for (i, row) in rows.into_iter().enumerate() {
            let (Some(model), Some(prompt)) = (row.model, row.prompt) else { continue };
            let keyed = row.id.is_some();
            let key = (model.clone(), Arc::as_ptr(&row.call) as usize, keyed);
            let g = *index.entry(key).or_insert_with(|| {
                groups.push(((model, row.call, keyed), Vec::new()));
                groups.len() - 1
            });
            groups[g].1.push((i, prompt, row.id, row.media));
        }
        // Every model is connected before any call is made: a row naming a model that cannot be
        // used (unknown, no key) fails alone, and never after its request-mates were paid for
        // and their answers thrown away. When no model of the request can be used, the request
        // itself is wrong (a misspelt model, a missing key): that is the caller's error.
        let mut sites: HashMap<String, Result<Arc<Site>, String>> = HashMap::new();
        for ((model, _, _), _) in &groups {
            if !sites.contains_key(model) {
                let site = self.site(model, embed).await;
                sites.insert(model.clone(), site);
            }
        }
        if sites.values().all(|s| s.is_err()) {
            if let Some(Err(e)) = sites.values().next() {
                return Err(e.clone());
            }
        }
        let sites = &sites;
        let stopped_now: Mutex<Option<StopReason>> = Mutex::new(None);
        let stopped_now = &stopped_now;
        let calls = groups.into_iter().map(|((model, call, keyed), members)| async move {
            let site = match &sites[&model] {
                Ok(site) => site.clone(),
                Err(message) => {
                    let error = ModelError::new(ErrorKind::InvalidInput, message.clone());
                    // Counted under the name as given, so a summary shows the rows a misspelt
                    // model failed.
                    let metrics = self.metrics_of(&model, "");
                    for _ in 0..members.len() {
                        metrics.record_failure(ErrorKind::InvalidInput);
                    }
                    let (slots, outcomes): (Vec<usize>, Vec<Outcome>) = members
                        .into_iter()
                        .map(|m| {
                            let (i, record) = record_of(m);
                            (i, Outcome::Failure(Box::new(Failure::of(record, error.clone(), 0))))
                        })
                        .unzip();
                    return (slots, outcomes, Arc::from(model.as_str()));
                }
            };
            let settings = DriverSettings {
                system: call.system.clone(),
                params: call.params.clone(),
                ..self.settings.driver.clone()
            };
            // Without ids, a sampled answer belongs to no one: only deterministic requests are
            // cached (stored and reused).
            // An embedding is the same whenever it is asked: always reused.
            let cache = self.settings.cache.clone().filter(|_| keyed || embed || is_deterministic(&call.params));
            let driver = Arc::new(self.driver_at(&site, settings, cache));
            let model_id: Arc<str> = Arc::from(driver.model_id());
            // An empty prompt asks nothing: it fails alone, without a call (a model would
            // answer it with something, and that would be paid for).
            let (empty, members): (Vec<_>, Vec<_>) = members.into_iter().partition(|(_, p, _, _)| p.trim().is_empty());
            let refused: Vec<(usize, Outcome)> = empty
                .into_iter()
                .map(|m| {
                    let error = ModelError::new(ErrorKind::InvalidInput, "empty prompt: nothing to ask the model");
                    site.metrics.record_failure(error.kind);
                    let (i, record) = record_of(m);
                    (i, Outcome::Failure(Box::new(Failure::of(record, error, 0))))
                })
                .collect();
            let (slots, records): (Vec<usize>, Vec<Record>) = members.into_iter().map(record_of).unzip();
            // The request's rows through the same dispatch as `weir run`'s records: batches of
            // like length (buckets that double) for an endpoint that takes many per call, every
            // row at once (the throttle decides how many are in flight). Every row of the
            // request is here, so nothing lingers: the stage flushes at the end of its input.
            // Outcomes come back as they finish, and are put back in the rows' order.
            let dispatch = crate::dispatch::DispatchSettings {
                batch: weir_core::BatchSettings { bucketing: weir_core::Bucketing::Doubling, ..Default::default() },
                width: records.len().max(1),
            };
            let work = futures::stream::iter(records.into_iter().map(crate::Work::Call));
            let mut outcomes: Vec<Outcome> =
                crate::dispatch::outcomes(work, Arc::new(crate::Router::fixed(driver.clone())), dispatch, None)
                    .filter_map(|o| futures::future::ready(o.ok()))
                    .collect()
                    .await;
            outcomes.sort_by_key(outcome_line);
            // Nothing answered and connecting failed: the next request finds out at its first
            // call. An answer of any kind clears it.
            let dead = driver.stop_reason().is_some_and(|r| r.kind == ErrorKind::Transport);
            site.unreachable.store(dead, std::sync::atomic::Ordering::Relaxed);
            match driver.stop_reason() {
                // A model the endpoint does not have (404: a misspelt name in a column) is that
                // model's rows' error, each failed with the reason: the other models' rows of
                // the request are answered, and the request is not failed after paying for them.
                Some(reason) if matches!(reason.kind, ErrorKind::BadRequest | ErrorKind::Endpoint) => {}
                Some(reason) => {
                    *self.stopped.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.clone());
                    *stopped_now.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
                }
                None => {}
            }
            let (mut slots, mut outcomes) = (slots, outcomes);
            for (i, o) in refused {
                slots.push(i);
                outcomes.push(o);
            }
            (slots, outcomes, model_id)
        });
        for (slots, outcomes, model_id) in futures::future::join_all(calls).await {
            for (slot, outcome) in slots.into_iter().zip(outcomes) {
                out[slot] = RowResult::Done(Box::new(outcome), model_id.clone());
            }
        }
        let stopped = stopped_now.lock().unwrap_or_else(|e| e.into_inner()).take();
        Ok((out, stopped))
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;

    /// Two runtimes with different limits that call one endpoint share its throttle; a third on
    /// another endpoint has its own.
    #[tokio::test]
    async fn runtimes_calling_one_endpoint_share_its_throttle() {
        let sim = weir_sim::SimServer::start(Default::default(), ([127, 0, 0, 1], 0).into()).await.unwrap();
        let other = weir_sim::SimServer::start(Default::default(), ([127, 0, 0, 1], 0).into()).await.unwrap();
        let runtime = |url: String, concurrency: usize| {
            Runtime::new(RuntimeSettings {
                provider: ProviderOptions { base_url: Some(url), ..Default::default() },
                throttle: ThrottleSettings { max_concurrency: concurrency, ..Default::default() },
                ..Default::default()
            })
        };
        let (a, b, c) = (runtime(sim.url(), 8), runtime(sim.url(), 16), runtime(other.url(), 8));
        let model = "gemini/gemini-2.5-flash";
        for e in [&a, &b, &c] {
            e.connect(model, false).await.unwrap();
        }
        let (ta, tb, tc) = (
            a.throttle(model, false).await.unwrap(),
            b.throttle(model, false).await.unwrap(),
            c.throttle(model, false).await.unwrap(),
        );
        assert!(Arc::ptr_eq(&ta, &tb), "one endpoint, two throttles");
        assert!(!Arc::ptr_eq(&ta, &tc), "two endpoints, one throttle");
        sim.shutdown().await;
        other.shutdown().await;
    }

    /// Rows for an endpoint that takes many per call are batched by length, as `weir run` does:
    /// mixed short and long texts no longer pad the short ones to the long ones' length.
    #[tokio::test]
    async fn batched_rows_are_cut_by_length_and_come_back_in_order() {
        let sim = weir_sim::SimServer::start(Default::default(), ([127, 0, 0, 1], 0).into()).await.unwrap();
        let runtime = Runtime::new(RuntimeSettings {
            provider: ProviderOptions { base_url: Some(sim.url()), ..Default::default() },
            ..Default::default()
        });
        let long = "word ".repeat(200);
        // Rows of one call share it (as a SQL query's rows with the same options do).
        let call = Arc::new(Call::default());
        let rows: Vec<Row> = (0..40)
            .map(|i| Row {
                model: Some("gemini/gemini-embedding-001".into()),
                prompt: Some(if i % 2 == 0 { format!("short {i}") } else { format!("{long} {i}") }),
                id: None,
                call: call.clone(),
                media: Vec::new(),
            })
            .collect();
        let prompts: Vec<String> = rows.iter().map(|r| r.prompt.clone().unwrap()).collect();
        let results = runtime.answer(rows, true).await.unwrap();
        for (i, r) in results.iter().enumerate() {
            let RowResult::Done(o, _) = r else { panic!("row {i}: no result") };
            let Outcome::Success(s) = o.as_ref() else { panic!("row {i}: {o:?}") };
            assert_eq!(s.record.prompt, prompts[i], "row {i} got another row's answer");
            assert!(s.response.embedding.is_some());
        }
        let m = &runtime.metrics_by_model()["gemini/gemini-embedding-001"];
        let real = m.batch_tokens.load(std::sync::atomic::Ordering::Relaxed) as f64;
        let padded = m.batch_padded_tokens.load(std::sync::atomic::Ordering::Relaxed) as f64;
        assert!(real > 0.0 && padded / real < 1.2, "padding {:.2}× (real {real}, padded {padded})", padded / real);
        sim.shutdown().await;
    }

    /// A dead endpoint is found once: the first request waits out the detection window, the
    /// next (a SQL query's next batch) stops at its first call instead of waiting again.
    #[tokio::test(start_paused = true)]
    async fn a_dead_endpoint_is_found_once_not_once_per_request() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let runtime = Runtime::new(RuntimeSettings {
            provider: ProviderOptions { base_url: Some(url), ..Default::default() },
            ..Default::default()
        });
        let rows = || -> Vec<Row> {
            (0..4)
                .map(|i| Row {
                    model: Some("gemini/gemini-2.5-flash".into()),
                    prompt: Some(format!("p{i}")),
                    id: None,
                    call: Arc::new(Call::default()),
                    media: Vec::new(),
                })
                .collect()
        };
        let mut took = Vec::new();
        for _ in 0..2 {
            let start = tokio::time::Instant::now();
            let (_, stop) = runtime.answer_or_stop(rows(), false).await.unwrap();
            assert!(stop.is_some_and(|s| s.kind == ErrorKind::Transport));
            took.push(start.elapsed());
        }
        assert!(took[0] >= std::time::Duration::from_secs(5), "{took:?}");
        assert!(took[1] < std::time::Duration::from_secs(1), "the window was waited out again: {took:?}");
    }
}
