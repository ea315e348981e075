//! Watching a run: its counters sampled once a second into a bounded time series, served as a
//! live page while it runs (`--ui`) and written as a self-contained HTML report when it ends.
//!
//! Built here, in the runtime, so every front end that runs records through it (`weir run`,
//! `weir sql`, a cluster executor) shows the same figures. The page and its charting library
//! ([uPlot](https://github.com/leeoniya/uPlot), MIT, embedded as an asset) are in the binary:
//! nothing is fetched from elsewhere, so the page and the report work offline.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::time::Instant;
use weir_core::{ErrorKind, RunMetrics};

use crate::{EndpointState, Runtime};

/// The page, with marks where the charting library and (in a report) the run's data go.
const PAGE: &str = include_str!("../assets/dashboard.html");
/// uPlot 1.6.32 (MIT; its license is beside it in `assets/uplot/`).
const UPLOT_JS: &str = include_str!("../assets/uplot/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/uplot/uPlot.min.css");

/// The series' columns: seconds since the start, then the run's counters (cumulative: the page
/// draws their rates) and gauges (as they stood), `null` where there was nothing to measure.
pub const COLUMNS: [&str; 19] = [
    "t",
    "done",
    "succeeded",
    "failed",
    "calls",
    "rate_limited",
    "server_errors",
    "other_errors",
    "cache_hits",
    "tokens_in",
    "tokens_out",
    "cost",
    "concurrency",
    "limit_rps",
    "lat_p50",
    "lat_p95",
    "lat_p99",
    "ttft_p50",
    "ttft_p95",
];

/// The most points kept. Past it every other point is dropped and the step between points
/// doubles, so memory stays bounded (2,048 points of 19 values, about 600 KB at most) and a
/// run of any length is seen whole, at a resolution that its length allows.
pub const MAX_POINTS: usize = 2048;

/// A time series of [`COLUMNS`], at most [`MAX_POINTS`] long.
#[derive(Debug)]
pub struct Series {
    inner: Mutex<Points>,
}

#[derive(Debug)]
struct Points {
    /// Seconds between kept points (1 at first, doubled at each thinning).
    step: f64,
    /// How many times the points were thinned: a page that has points of an earlier
    /// generation starts over.
    generation: u64,
    cols: Vec<Vec<Option<f64>>>,
}

impl Default for Series {
    fn default() -> Self {
        Self::new()
    }
}

impl Series {
    /// An empty series, one point a second to begin with.
    pub fn new() -> Self {
        Self { inner: Mutex::new(Points { step: 1.0, generation: 0, cols: vec![Vec::new(); COLUMNS.len()] }) }
    }

    fn points(&self) -> std::sync::MutexGuard<'_, Points> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a point (its first value is its time) if a step has passed since the last one, or
    /// in place of the last one when `last` (the run's end must be in the series).
    pub fn push(&self, point: [Option<f64>; COLUMNS.len()], last: bool) {
        let mut p = self.points();
        let mut point = point;
        let t = point[0].unwrap_or(0.0);
        let previous = p.cols[0].last().copied().flatten();
        match previous {
            Some(before) if t - before < p.step * 0.999 => {
                if !last {
                    // Too soon for a point of its own; what it alone measured (the latencies of
                    // calls since the last sample, taken by it) goes to the newest one.
                    for (c, v) in p.cols.iter_mut().zip(point) {
                        if let (Some(slot @ None), Some(v)) = (c.last_mut(), v) {
                            *slot = Some(v);
                        }
                    }
                    return;
                }
                // The end replaces a point newer than a step (kept: the series stays even),
                // keeping what only the replaced one measured: the time to first token of a
                // short streamed run was all in it, and the report's plot of it was empty.
                if p.cols[0].len() > 1 {
                    for (c, v) in p.cols.iter_mut().zip(point.iter_mut()) {
                        let replaced = c.pop().flatten();
                        if v.is_none() {
                            *v = replaced;
                        }
                    }
                }
            }
            _ => {}
        }
        for (c, v) in p.cols.iter_mut().zip(point) {
            c.push(v);
        }
        if p.cols[0].len() >= MAX_POINTS {
            // Every other point, and the newest.
            for c in p.cols.iter_mut() {
                let newest = c.last().copied().flatten();
                let mut kept: Vec<Option<f64>> = c.iter().step_by(2).copied().collect();
                if c.len() % 2 == 0 {
                    kept.push(newest);
                }
                *c = kept;
            }
            p.step *= 2.0;
            p.generation += 1;
        }
    }

    /// The newest point, if there is one.
    pub fn last_point(&self) -> Option<Vec<Option<f64>>> {
        let p = self.points();
        p.cols[0].last()?;
        Some(p.cols.iter().map(|c| c.last().copied().flatten()).collect())
    }

    /// How many points there are.
    pub fn len(&self) -> usize {
        self.points().cols[0].len()
    }

    /// True before the first point.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The points from `since` on, by column, and the series' generation; all of them when the
    /// caller's `generation` is another (the points were thinned since it last asked).
    pub(crate) fn since(
        &self,
        since: usize,
        generation: Option<u64>,
    ) -> (BTreeMap<&'static str, Vec<Option<f64>>>, u64, bool) {
        let p = self.points();
        let reset = generation != Some(p.generation);
        let from = if reset { 0 } else { since.min(p.cols[0].len()) };
        let cols = COLUMNS.iter().zip(&p.cols).map(|(name, c)| (*name, c[from..].to_vec())).collect();
        (cols, p.generation, reset)
    }

    /// The value of column `name` at the newest point and at the oldest point at most `span`
    /// seconds before it (the one before the newest, if none is that close), and the seconds
    /// between them. By time, not by a count of points: points are a second apart or more,
    /// and further apart once the series has thinned.
    pub(crate) fn recent(&self, name: &str, span: f64) -> Option<(f64, f64, f64)> {
        let i = COLUMNS.iter().position(|c| *c == name)?;
        let p = self.points();
        let n = p.cols[0].len();
        if n < 2 {
            return None;
        }
        let t1 = p.cols[0][n - 1]?;
        let j = p.cols[0][..n - 1].iter().position(|t| t.is_some_and(|t| t1 - t <= span + 1e-6)).unwrap_or(n - 2);
        let t0 = p.cols[0][j]?;
        Some((p.cols[i][j].unwrap_or(0.0), p.cols[i][n - 1].unwrap_or(0.0), t1 - t0))
    }
}

/// Seconds without a record done after which a run's time left is not guessed ("–").
const STALLED_AFTER: f64 = 15.0;

/// The column `name`'s place in a point.
pub(crate) fn column(name: &str) -> usize {
    COLUMNS.iter().position(|c| *c == name).expect("a column of the series")
}

/// Seconds left for `remaining` records at `per_s` records a second (over the last minute),
/// or `None` when there is no honest guess: nothing done lately, or the run `stalled` (its
/// endpoint not answering, a stop under way), where the last minute's rate would only make the
/// guess grow. A run that called faster than its learned or told limit (`limit_rps`; the
/// first window's burst, before the limit was learned) cannot keep that pace: its rate is
/// scaled down to what the limit allows.
fn time_left(
    remaining: u64,
    per_s: Option<f64>,
    calls_per_s: Option<f64>,
    limit_rps: Option<f64>,
    stalled: bool,
) -> Option<f64> {
    if remaining == 0 {
        return Some(0.0);
    }
    let r = per_s.filter(|r| *r > 0.0 && !stalled)?;
    let over = match (calls_per_s, limit_rps) {
        (Some(c), Some(l)) if l > 0.0 && c > l => l / c,
        _ => 1.0,
    };
    Some(remaining as f64 / (r * over))
}

/// A run's rows at its end, as its summary counts them.
#[derive(Debug, Clone, Default)]
pub struct EndRows {
    /// Records with a row.
    pub done: u64,
    /// Of them, results.
    pub succeeded: u64,
    /// Of them, errors.
    pub failed: u64,
    /// Records without a row, left to a resume (`None`: a stream, which cannot be counted).
    pub unfinished: Option<u64>,
    /// Error rows by kind (`rate_limited`, …).
    pub failures: BTreeMap<String, u64>,
}

/// Where a run's provider batch jobs stand, as the page shows them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JobsView {
    /// Jobs by state (`running`, `succeeded`, …).
    pub states: Vec<(String, u64)>,
    /// Requests the provider reports answered in the jobs not yet collected.
    pub answered: u64,
    /// Requests in those jobs.
    pub total: u64,
    /// Records whose outcome is known.
    pub settled: u64,
}

/// What a run's cost is, given its endpoints (`None`: a model without a known price). The
/// front end's: prices are its table.
pub type CostOf = Arc<dyn Fn(&[EndpointState]) -> Option<f64> + Send + Sync>;

/// One run watched: its series, sampled from `runtime`, and what the page says beside it.
pub struct Watch {
    runtime: Arc<Runtime>,
    series: Series,
    title: String,
    started: Instant,
    started_at: SystemTime,
    total: Mutex<Option<u64>>,
    cost: Option<CostOf>,
    jobs: Mutex<Option<JobsView>>,
    /// How the run ended (`finished`, `interrupted`, …), once it has.
    ended: Mutex<Option<String>>,
    /// The last summary sampled (the page's figures agree with the chart's last point).
    last: Mutex<Value>,
    /// Records an earlier run of this output finished (a resumed run's page counts this run's
    /// records against what was left, and says how many were done before).
    resumed: std::sync::atomic::AtomicU64,
    /// Why the front end is stopping the run, if it is (see [`Watch::stops_by`]).
    stop_of: Mutex<Option<StopOf>>,
}

/// Why a front end is stopping its run (Ctrl-C, a rejected key), while it is: the runtime does
/// not know of an interrupt the front end took.
pub type StopOf = Box<dyn Fn() -> Option<weir_core::StopReason> + Send + Sync>;

impl Watch {
    /// Watches `runtime`'s run named `title` (its output), of `total` records when known.
    pub fn new(runtime: Arc<Runtime>, title: impl Into<String>, total: Option<u64>, cost: Option<CostOf>) -> Arc<Self> {
        Arc::new(Self {
            runtime,
            series: Series::new(),
            title: title.into(),
            started: Instant::now(),
            started_at: SystemTime::now(),
            total: Mutex::new(total),
            cost,
            jobs: Mutex::new(None),
            ended: Mutex::new(None),
            last: Mutex::new(Value::Null),
            resumed: Default::default(),
            stop_of: Mutex::new(None),
        })
    }

    /// Asks `stop` why the run is stopping: after Ctrl-C the page said "running", gave a time
    /// left and counted the records the stop cut off as failed, for the seconds the calls in
    /// flight took to finish.
    pub fn stops_by(&self, stop: StopOf) {
        *self.stop_of.lock().unwrap_or_else(|e| e.into_inner()) = Some(stop);
    }

    /// Why the run is stopping early, if it is.
    fn stopping(&self) -> Option<weir_core::StopReason> {
        self.runtime.stop_reason().or_else(|| self.stop_of.lock().unwrap_or_else(|e| e.into_inner()).as_ref()?())
    }

    /// Says that an earlier run of this output had finished `records` (this run resumes it).
    pub fn set_resumed(&self, records: u64) {
        self.resumed.store(records, std::sync::atomic::Ordering::Relaxed);
    }

    /// The series kept so far.
    pub fn series(&self) -> &Series {
        &self.series
    }

    /// Where the run's provider jobs stand now.
    pub fn set_jobs(&self, jobs: JobsView) {
        *self.jobs.lock().unwrap_or_else(|e| e.into_inner()) = Some(jobs);
    }

    /// Starts sampling once a second until the returned task is aborted, saving what it has
    /// to `save` every 10 s when given (so a run killed outright still leaves its series for
    /// `weir report`).
    pub fn start(self: &Arc<Self>, save: Option<std::path::PathBuf>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for n in 0u64.. {
                tick.tick().await;
                me.sample(false).await;
                // The first second's point saved at once (a run killed early still leaves its
                // series), then every 10 s.
                if let (Some(path), true) = (&save, n % 10 == 0) {
                    if let Err(e) = me.save(path) {
                        tracing::warn!("could not save the run's series to {}: {e}", path.display());
                    }
                }
            }
        })
    }

    /// Writes the series and the summary to `path` (whole or not at all), for `weir report`.
    pub fn save(&self, path: &std::path::Path) -> std::io::Result<()> {
        weir_io::state::write_atomic(path, self.update(0, None, false).to_string().as_bytes())
    }

    /// The run's own word at its end: its summary as printed, its cost as the summary counts
    /// it (batch prices included) in place of the estimate made while it ran, and its rows
    /// (`rows`) in place of the outcomes its calls settled: a stopped run leaves the records it
    /// did not finish to a resume, without rows, and they are neither done nor failed.
    pub fn finish(&self, summary: &str, cost: Option<f64>, rows: Option<&EndRows>) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let Value::Object(s) = &mut *last else { return };
        s.insert("summary_text".into(), Value::String(summary.to_string()));
        if cost.is_some() {
            s.insert("cost_usd".into(), cost.into());
        }
        let Some(r) = rows else { return };
        s.insert("done".into(), r.done.into());
        s.insert("succeeded".into(), r.succeeded.into());
        s.insert("failed".into(), r.failed.into());
        let elapsed = s.get("elapsed_secs").and_then(Value::as_f64).unwrap_or(0.0);
        s.insert("records_per_s".into(), (elapsed > 0.0).then(|| r.done as f64 / elapsed).into());
        s.insert("total".into(), r.unfinished.map(|u| r.done + u).into());
        s.insert("eta_secs".into(), Value::Null);
        let mut failures: Vec<Value> = s
            .get("failures")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|f| {
                let n = *r.failures.get(f.get("kind")?.as_str()?)?;
                let mut f = f.clone();
                f["records"] = n.into();
                Some(f)
            })
            .collect();
        // Kinds the page did not list while the run went (`aborted`: rows of records a stop cut
        // off, in a run that keeps no state).
        for (kind, n) in &r.failures {
            if !failures.iter().any(|f| f.get("kind").and_then(Value::as_str) == Some(kind)) {
                failures.push(serde_json::json!({ "kind": kind, "records": n, "examples": [] }));
            }
        }
        s.insert("failures".into(), Value::Array(failures));
        let unfinished = r.unfinished.unwrap_or(0);
        if unfinished > 0 && s.get("alert").is_none_or(Value::is_null) {
            let msg =
                format!("Not finished: {unfinished} records have no row yet; run the same command again to resume.");
            s.insert("alert".into(), Value::String(msg));
        }
        // A run that keeps no state writes the records a stop cut off as `aborted` rows.
        let cut = r.failures.get("aborted").copied().unwrap_or(0);
        if cut > 0 && s.get("alert").is_none_or(Value::is_null) {
            let msg = format!("Stopped early: {cut} records were cut off and have `aborted` error rows.");
            s.insert("alert".into(), Value::String(msg));
        }
    }

    /// Marks the run ended (`how`: finished, interrupted, stopped) and takes its last point.
    pub async fn end(&self, how: &str) {
        *self.ended.lock().unwrap_or_else(|e| e.into_inner()) = Some(how.to_string());
        self.sample(true).await;
    }

    /// Takes a point now (in place of the newest when `last`), and the summary beside it.
    pub async fn sample(&self, last: bool) {
        let endpoints = self.runtime.endpoints().await;
        let m = self.runtime.totals();
        let get = |c: &std::sync::atomic::AtomicU64| RunMetrics::get(c) as f64;
        let errors = m.call_errors_by_kind();
        let server: u64 = errors.iter().filter(|(k, _)| **k == ErrorKind::Server).map(|(_, n)| n).sum();
        let other: u64 = errors
            .iter()
            .filter(|(k, _)| !matches!(k, ErrorKind::Server | ErrorKind::RateLimited))
            .map(|(_, n)| n)
            .sum();
        let (latency, first_token) = m.take_recent_latencies();
        let secs = |d: Duration| Some(d.as_secs_f64());
        let cost = self.cost.as_ref().and_then(|c| c(&endpoints));
        let concurrency: usize = endpoints.iter().map(|e| e.concurrency).sum();
        let limit: Option<f64> = endpoints
            .iter()
            .filter_map(|e| e.rate.as_ref()?.requests.map(|(n, w, _)| n / w.as_secs_f64().max(1e-9)))
            .reduce(|a, b| a + b);
        let t = self.started.elapsed().as_secs_f64();
        let (done, failed) = m.done_and_failed();
        let point = [
            Some(t),
            Some(done as f64),
            Some(get(&m.succeeded)),
            Some(failed as f64),
            Some(get(&m.calls)),
            Some(get(&m.rate_limited)),
            Some(server as f64),
            Some(other as f64),
            Some(get(&m.cache_hits)),
            Some(get(&m.tokens_in)),
            Some(get(&m.tokens_out)),
            cost,
            (!endpoints.is_empty()).then_some(concurrency as f64),
            limit,
            latency.and_then(|p| secs(p.p50)),
            latency.and_then(|p| secs(p.p95)),
            latency.and_then(|p| secs(p.p99)),
            first_token.and_then(|p| secs(p.p50)),
            first_token.and_then(|p| secs(p.p95)),
        ];
        self.series.push(point, last);
        let summary = self.summarize(&endpoints, t, cost, server);
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = summary;
    }

    /// The figures beside the charts.
    fn summarize(&self, endpoints: &[EndpointState], elapsed: f64, cost: Option<f64>, server: u64) -> Value {
        let m = self.runtime.totals();
        let get = |c: &std::sync::atomic::AtomicU64| RunMetrics::get(c);
        let (done, failed) = m.done_and_failed();
        let total = *self.total.lock().unwrap_or_else(|e| e.into_inner());
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let stop = self.stopping();
        // Records a second over the last minute (or what there is of it).
        let per_s = self.series.recent("done", 60.0).map(|(a, b, dt)| (b - a) / dt.max(1e-9));
        let calls_per_s = self.series.recent("calls", 60.0).map(|(a, b, dt)| (b - a) / dt.max(1e-9));
        let limit_rps = self.series.last_point().and_then(|p| p[column("limit_rps")]);
        let failing = self.failing(endpoints);
        let stalled = failing.is_some()
            || stop.is_some()
            || self.series.recent("done", STALLED_AFTER).is_some_and(|(a, b, dt)| b == a && dt >= STALLED_AFTER - 1.0);
        let eta = total.and_then(|t| time_left(t.saturating_sub(done), per_s, calls_per_s, limit_rps, stalled));
        let state = match (&ended, &stop) {
            (Some(how), _) => how.clone(),
            (None, Some(s)) => format!("stopping: {}", s.message),
            (None, None) => "running".into(),
        };
        let alert = match (&stop, &ended) {
            (Some(s), None) if s.kind == ErrorKind::Aborted => Some(format!(
                "Stopping ({}): the calls in flight finish; records not finished are left to a resume (or get rows if the run keeps no state)",
                s.message
            )),
            (Some(s), _) => Some(format!("Stopped: {}", s.message)),
            // The front end's word (a run's driver stopped, not the runtime's).
            (None, Some(how)) => how.strip_prefix("stopped: ").map(|why| format!("Stopped: {why}")),
            (None, None) => failing,
        };
        let failures: Vec<Value> = m
            .failures_by_kind()
            .into_iter()
            // Records a stop cut off are not failures (see `RunMetrics::cut_off`).
            .filter(|(kind, _)| *kind != ErrorKind::Aborted)
            .map(|(kind, n)| {
                let examples: Vec<Value> = m
                    .failure_examples(kind)
                    .into_iter()
                    .map(|(id, message)| serde_json::json!({ "id": id, "message": message }))
                    .collect();
                serde_json::json!({ "kind": kind.as_str(), "records": n, "examples": examples })
            })
            .collect();
        let endpoints_held: usize = endpoints.iter().map(|e| e.held).sum();
        let endpoints: Vec<Value> = endpoints
            .iter()
            .flat_map(|e| {
                let limit = |r: &weir_core::RateSnapshot| {
                    r.requests.map(|(n, w, learned)| {
                        format!("{n:.0} per {:.0} s ({})", w.as_secs_f64(), if learned { "learned" } else { "told" })
                    })
                };
                let row = |endpoint: &str, state: String, concurrency: usize, limit: Option<String>, calls, refused| {
                    serde_json::json!({
                        "model": e.model, "endpoint": endpoint, "state": state, "concurrency": concurrency,
                        "limit": limit, "calls": calls, "rate_limited": refused,
                    })
                };
                if e.pool.is_empty() {
                    let state = match self.failing(std::slice::from_ref(e)) {
                        Some(_) => "not answering".to_string(),
                        None => "up".to_string(),
                    };
                    vec![row(
                        &e.endpoint,
                        state,
                        e.concurrency,
                        e.rate.as_ref().and_then(limit),
                        get(&e.metrics.calls),
                        get(&e.metrics.rate_limited),
                    )]
                } else {
                    e.pool
                        .iter()
                        .map(|p| {
                            let state = match p.why {
                                Some(why) => format!("{:?}: {why}", p.health).to_lowercase(),
                                None => format!("{:?}", p.health).to_lowercase(),
                            };
                            row(&p.endpoint, state, p.concurrency, limit(&p.rates), p.calls, p.rate_limited)
                        })
                        .collect()
                }
            })
            .collect();
        let started = humantime_utc(self.started_at);
        serde_json::json!({
            "title": self.title,
            "state": state,
            "alert": alert,
            "started": started,
            "elapsed_secs": elapsed,
            "total": total,
            "done": done,
            "resumed": self.resumed.load(std::sync::atomic::Ordering::Relaxed),
            "succeeded": get(&m.succeeded),
            "failed": failed,
            "records_per_s": per_s,
            "eta_secs": eta,
            "calls": get(&m.calls),
            "rate_limited": get(&m.rate_limited),
            "server_errors": server,
            "cache_hits": get(&m.cache_hits),
            "tokens_in": get(&m.tokens_in),
            "tokens_out": get(&m.tokens_out),
            "cost_usd": cost,
            // Calls the quota holds now: a run waiting out a full window is not stalled.
            "held": if ended.is_none() { endpoints_held } else { 0 },
            "endpoints": endpoints,
            "failures": failures,
            "jobs": self.jobs.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|j| serde_json::json!({
                "states": j.states.iter().map(|(s, n)| serde_json::json!({ "state": s, "jobs": n })).collect::<Vec<_>>(),
                "answered": j.answered, "total": j.total, "settled": j.settled,
            })),
        })
    }

    /// Why the endpoints look dead, if they do: calls made in the last 5 s and none answered,
    /// with failures of the kinds a dead endpoint gives (refused or cut connections, timeouts).
    fn failing(&self, endpoints: &[EndpointState]) -> Option<String> {
        let (c0, c1, _) = self.series.recent("calls", 5.0)?;
        let (s0, s1, _) = self.series.recent("succeeded", 5.0)?;
        let (e0, e1, _) = self.series.recent("other_errors", 5.0)?;
        if c1 > c0 && s1 == s0 && e1 > e0 {
            let names: Vec<&str> = endpoints.iter().map(|e| e.endpoint.as_str()).collect();
            Some(format!("The endpoint is not answering: no call answered in the last 5 s ({})", names.join(", ")))
        } else {
            None
        }
    }

    /// What a page that has `since` points of `generation` needs to be up to date.
    pub fn update(&self, since: usize, generation: Option<u64>, live: bool) -> Value {
        let (columns, generation, reset) = self.series.since(since, generation);
        let mut summary = self.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Value::Object(s) = &mut summary {
            s.insert("live".into(), Value::Bool(live));
            if !live {
                s.insert("written".into(), Value::String(humantime_utc(SystemTime::now())));
            }
        }
        serde_json::json!({ "step": generation, "reset": reset, "columns": columns, "summary": summary })
    }

    /// The report: the page with the whole series and the summary in it.
    pub fn report(&self) -> String {
        page(Some(&self.update(0, None, false)))
    }

    /// What a cluster executor tells its scheduler's page (see [`crate::gather`]): its newest
    /// point and summary, once it has sampled.
    pub fn latest(&self) -> Option<Value> {
        let point = self.series.last_point()?;
        let summary = self.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Some(serde_json::json!({ "point": point, "summary": summary }))
    }
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch").field("title", &self.title).finish_non_exhaustive()
    }
}

/// What a live page asks for: a run's [`Watch`], or a cluster scheduler's gathering of its
/// executors' ([`crate::gather::Gathered`]). One page serves both.
pub trait Updates: Send + Sync {
    /// What a page that has `since` points of `generation` needs to be up to date.
    fn update(&self, since: usize, generation: Option<u64>, live: bool) -> Value;
}

impl Updates for Watch {
    fn update(&self, since: usize, generation: Option<u64>, live: bool) -> Value {
        Watch::update(self, since, generation, live)
    }
}

/// The page: live (it asks the run for its data) when `data` is `None`, else a report of it.
pub fn page(data: Option<&Value>) -> String {
    // `</` in the data would end its script element.
    let data = data.map_or("null".to_string(), |d| d.to_string().replace("</", "<\\/"));
    let title = data_title(&data);
    PAGE.replacen("/*UPLOT_CSS*/", UPLOT_CSS, 1)
        .replacen("/*UPLOT_JS*/", UPLOT_JS, 1)
        .replacen("/*DATA*/null", &data, 1)
        .replacen("__TITLE__", &title, 1)
}

/// The run's title for the page's `<title>`, escaped for HTML.
fn data_title(data: &str) -> String {
    let v: Value = serde_json::from_str(&data.replace("<\\/", "</")).unwrap_or(Value::Null);
    let t = v.pointer("/summary/title").and_then(Value::as_str).unwrap_or("run");
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// How a report weir wrote begins: a file that does not is not replaced by one.
const REPORT_MARK: &str = "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">";

/// Why a report cannot be written at `path`, if it cannot: it must be a regular file (or not
/// exist yet) in an existing directory, not one of the run's own files (`own`: its input,
/// outputs, events), not under /dev, /proc or /sys, and, if it exists, a report weir wrote
/// (anything else there, another run's results for one, is not replaced).
pub fn check_report_path(path: &std::path::Path, own: &[&std::path::Path]) -> Result<(), String> {
    let shown = path.display();
    let parent = match path.parent() {
        Some(p) if p.as_os_str().is_empty() => std::path::Path::new("."),
        Some(p) => p,
        None => return Err(format!("--report {shown}: not a file path")),
    };
    let dir = std::fs::canonicalize(parent)
        .map_err(|_| format!("--report {shown}: no directory {} to write it in", parent.display()))?;
    if ["/dev", "/proc", "/sys"].iter().any(|d| dir.starts_with(d)) {
        return Err(format!("--report {shown}: a report is a file, not a device or a file of the system"));
    }
    let full = dir.join(path.file_name().ok_or_else(|| format!("--report {shown}: not a file path"))?);
    for o in own {
        // Compared by directory and name: an own file not written yet (the errors file before
        // the first error) is the same path all the same.
        let o_full =
            o.file_name().and_then(|name| Some(std::fs::canonicalize(weir_io::paths::parent_dir(o)).ok()?.join(name)));
        let same = std::fs::canonicalize(o).map(|c| c == full).unwrap_or(false)
            || o_full.is_some_and(|c| c == full)
            || *o == path;
        if same {
            return Err(format!(
                "--report {shown}: is one of the run's own files ({}); give another path",
                o.display()
            ));
        }
    }
    match std::fs::metadata(path) {
        // Found before the run, not after it: the directory takes a new file.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let probe = dir.join(format!(".weir-report-probe-{}", std::process::id()));
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
                Ok(_) => {
                    let _ = std::fs::remove_file(&probe);
                    Ok(())
                }
                Err(e) => Err(format!("--report {shown}: cannot write in {}: {e}", dir.display())),
            }
        }
        Err(e) => Err(format!("--report {shown}: {e}")),
        Ok(m) if !m.is_file() => Err(format!("--report {shown}: exists and is not a regular file; give a file path")),
        Ok(_) => {
            let mut head = [0u8; REPORT_MARK.len()];
            let ours = std::fs::File::open(path)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
                .map(|_| head == REPORT_MARK.as_bytes())
                .unwrap_or(false);
            match ours {
                true => Ok(()),
                false => Err(format!(
                    "--report {shown}: exists and is not a report weir wrote; weir does not replace it (give another path, or remove it)"
                )),
            }
        }
    }
}

/// Writes `html` (a report) to `path` whole or not at all, after [`check_report_path`] (again:
/// the file may have appeared since the run began).
pub fn write_report(path: &std::path::Path, html: &str, own: &[&std::path::Path]) -> Result<(), String> {
    check_report_path(path, own)?;
    weir_io::state::write_atomic(path, html.as_bytes())
        .map_err(|e| format!("could not write the report {}: {e}", path.display()))
}

/// A report rebuilt from the data a run saved ([`Watch::update`] with everything); `running`:
/// the run still holds its output (it is going on, and the figures are as of its last save).
pub fn report_of(saved: &str, running: bool) -> Result<String, String> {
    let v: Value = serde_json::from_str(saved).map_err(|e| format!("not a run's saved series: {e}"))?;
    if v.get("columns").and_then(Value::as_object).is_none() {
        return Err("not a run's saved series (no columns)".into());
    }
    let mut v = v;
    if let Some(s) = v.get_mut("summary").and_then(Value::as_object_mut) {
        s.insert("live".into(), Value::Bool(false));
        s.insert("written".into(), Value::String(humantime_utc(SystemTime::now())));
        let unended =
            s.get("state").and_then(Value::as_str).is_some_and(|st| st == "running" || st.starts_with("stopping"));
        if unended && running {
            s.insert("eta_secs".into(), Value::Null);
            s.insert(
                "alert".into(),
                "The run is still going: these figures are as of its last save (every 10 s); its own report comes at its end.".into(),
            );
        }
        // Saved while it ran, never at its end: it was killed (or its machine stopped).
        if unended && !running {
            s.insert("state".into(), "ended without a word (killed?)".into());
            s.insert("eta_secs".into(), Value::Null);
            s.insert(
                "alert".into(),
                "The run did not end normally (killed, or its machine stopped): these figures are as of its last save, up to 10 s before; its output holds what it wrote.".into(),
            );
        }
    }
    Ok(page(Some(&v)))
}

/// `t` as `2026-11-28T04:30:00Z`.
fn humantime_utc(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Why the page cannot be served at `addr`, if it cannot: it is served on loopback only (it is
/// not encrypted, and says what the run is doing to anyone who asks), and the port must be free.
pub fn check_listen(addr: SocketAddr) -> Result<(), String> {
    if !addr.ip().is_loopback() {
        return Err(format!(
            "--ui {addr}: the page is served on this machine's loopback only (127.0.0.1 or [::1]); to see it from another machine, give a port (--ui 127.0.0.1:{port}) and forward it (ssh -L {port}:127.0.0.1:{port} HOST)",
            port = if addr.port() == 0 { 8765 } else { addr.port() }
        ));
    }
    std::net::TcpListener::bind(addr).map(drop).map_err(|e| format!("--ui {addr}: cannot listen there ({e})"))
}

/// Serves the live page of `watch` on `addr` (loopback only: the page is not encrypted) until
/// the returned task is aborted; the address it listens on (a port of 0 picks a free one).
pub async fn serve(
    addr: SocketAddr,
    watch: Arc<dyn Updates>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), String> {
    use hyper::service::service_fn;
    check_listen(addr)?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("--ui {addr}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let live = Arc::new(page(None));
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let (watch, live) = (watch.clone(), live.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let host = req.headers().get(hyper::header::HOST).and_then(|h| h.to_str().ok());
                    let reply = answer(watch.as_ref(), &live, req.method(), req.uri(), host);
                    async move { Ok::<_, std::convert::Infallible>(reply) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
            });
        }
    });
    Ok((bound, task))
}

/// The answer to one request of the page.
fn answer(
    watch: &dyn Updates,
    live: &str,
    method: &hyper::Method,
    uri: &hyper::Uri,
    host: Option<&str>,
) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
    let reply = |status: u16, kind: &str, body: String| {
        hyper::Response::builder()
            .status(status)
            .header("content-type", kind)
            .header("cache-control", "no-store")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .unwrap_or_default()
    };
    if method != hyper::Method::GET {
        return reply(405, "text/plain", "only GET\n".into());
    }
    // Asked for by this machine's name for itself only: a page elsewhere that renamed its own
    // host to 127.0.0.1 (DNS rebinding) must not read the run's figures.
    if !host.is_some_and(|h| {
        let name =
            h.rsplit_once(':').map_or(h, |(n, port)| if port.chars().all(|c| c.is_ascii_digit()) { n } else { h });
        matches!(name, "localhost" | "127.0.0.1" | "[::1]")
            || name.parse::<std::net::Ipv4Addr>().is_ok_and(|a| a.is_loopback())
    }) {
        return reply(403, "text/plain", "this page answers to localhost, 127.0.0.1 or [::1] only\n".into());
    }
    match uri.path() {
        "/" => reply(200, "text/html; charset=utf-8", live.to_string()),
        "/api/update" => {
            let mut since = 0usize;
            let mut generation = None;
            for pair in uri.query().unwrap_or("").split('&') {
                match pair.split_once('=') {
                    Some(("since", v)) => since = v.parse().unwrap_or(0),
                    Some(("step", v)) => generation = v.parse().ok(),
                    _ => {}
                }
            }
            reply(200, "application/json", watch.update(since, generation, true).to_string())
        }
        _ => reply(404, "text/plain", "not found\n".into()),
    }
}

/// Watches `runtime`'s calls under `title` and serves the page at `addr`, saying where on
/// stderr (as `who`); the sampler and the server, to abort when the process ends. For front ends
/// without a run of their own (SQL, a cluster executor).
pub async fn watch_and_serve(
    runtime: Arc<Runtime>,
    title: &str,
    cost: Option<CostOf>,
    addr: SocketAddr,
    who: &str,
) -> Result<(Arc<Watch>, [tokio::task::JoinHandle<()>; 2]), String> {
    let watch = Watch::new(runtime, title, None, cost);
    let (bound, server) = serve(addr, watch.clone()).await?;
    // Not eprintln!: it panics when stderr's reader has gone away.
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{who}: live page on http://{bound}/");
    let sampler = watch.start(None);
    Ok((watch, [sampler, server]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(t: f64) -> [Option<f64>; COLUMNS.len()] {
        let mut p = [None; COLUMNS.len()];
        p[0] = Some(t);
        p[1] = Some(t * 10.0);
        p
    }

    #[test]
    fn the_series_stays_bounded_and_whole() {
        let s = Series::new();
        // A week of seconds.
        for i in 0..604_800 {
            s.push(point(i as f64), false);
        }
        s.push(point(604_800.5), true);
        let n = s.len();
        assert!((MAX_POINTS / 2..=MAX_POINTS).contains(&n), "{n} points");
        let (cols, generation, _) = s.since(0, None);
        assert!(generation > 0);
        assert_eq!(cols["t"][0], Some(0.0), "the start is kept");
        assert_eq!(cols["t"][n - 1], Some(604_800.5), "the end is kept");
        assert_eq!(cols["done"][n - 1], Some(6_048_005.0));
        let t: Vec<f64> = cols["t"].iter().map(|x| x.unwrap()).collect();
        assert!(t.windows(2).all(|w| w[1] > w[0]), "in order");
    }

    /// Time left: none when stalled or nothing is done lately; the pace of a run that called
    /// faster than its limit is scaled down to the limit's.
    #[test]
    fn time_left_is_not_guessed_when_stalled_and_keeps_to_the_limit() {
        assert_eq!(time_left(100, Some(10.0), Some(10.0), None, false), Some(10.0));
        assert_eq!(time_left(100, Some(10.0), Some(10.0), None, true), None, "endpoint dead");
        assert_eq!(time_left(100, Some(0.0), Some(3.0), None, false), None, "nothing done lately");
        assert_eq!(time_left(100, None, None, None, false), None);
        assert_eq!(time_left(0, None, None, None, true), Some(0.0), "nothing left");
        // The first window's burst: 40 calls/s against a learned 20/s.
        assert_eq!(time_left(100, Some(40.0), Some(40.0), Some(20.0), false), Some(5.0));
        // Under the limit: the rate as it is.
        assert_eq!(time_left(100, Some(10.0), Some(10.0), Some(20.0), false), Some(10.0));
    }

    /// A rate over the last minute spans a minute whatever the points' spacing: a cluster's
    /// page samples every 2 s, and a long run's series thins to wider steps.
    #[test]
    fn recent_figures_span_a_time_not_a_count_of_points() {
        let s = Series::new();
        for i in 0..100 {
            s.push(point(2.0 * i as f64), false);
        }
        assert_eq!(s.recent("done", 60.0), Some((1380.0, 1980.0, 60.0)));
        let thinned = Series::new();
        for i in 0..5_000 {
            thinned.push(point(i as f64), false);
        }
        let (a, b, dt) = thinned.recent("done", 60.0).unwrap();
        assert!((56.0..=60.0).contains(&dt), "{dt}");
        assert_eq!(b - a, dt * 10.0);
        // Fewer seconds than asked: what there is, and never nothing.
        assert_eq!(s.recent("done", 0.5), Some((1960.0, 1980.0, 2.0)));
    }

    #[test]
    fn a_page_gets_the_new_points_or_all_after_a_thinning() {
        let s = Series::new();
        for i in 0..10 {
            s.push(point(i as f64), false);
        }
        let (cols, generation, reset) = s.since(7, Some(0));
        assert!(!reset && generation == 0);
        assert_eq!(cols["t"], vec![Some(7.0), Some(8.0), Some(9.0)]);
        let (cols, _, reset) = s.since(7, Some(5));
        assert!(reset);
        assert_eq!(cols["t"].len(), 10);
        // Less than a step later: not kept, unless it is the end.
        s.push(point(9.5), false);
        assert_eq!(s.len(), 10);
        s.push(point(9.6), true);
        assert_eq!(s.len(), 10);
        assert_eq!(s.since(9, Some(0)).0["t"], vec![Some(9.6)]);
    }

    #[test]
    fn what_only_a_point_not_kept_measured_goes_to_the_newest() {
        // The time to first token of a short streamed run was all in a point the end replaced
        // (or one too soon to keep), and the report's plot of it was empty.
        let s = Series::new();
        let ttft = column("ttft_p50");
        let with_ttft = |t: f64, v: f64| {
            let mut p = point(t);
            p[ttft] = Some(v);
            p
        };
        s.push(point(0.0), false);
        s.push(point(1.0), false);
        s.push(with_ttft(1.5, 0.2), false);
        assert_eq!(s.since(1, Some(0)).0["ttft_p50"], vec![Some(0.2)], "kept in the newest point");
        s.push(with_ttft(2.0, 0.3), false);
        s.push(point(2.4), true);
        let cols = s.since(2, Some(0)).0;
        assert_eq!((cols["t"].clone(), cols["ttft_p50"].clone()), (vec![Some(2.4)], vec![Some(0.3)]));
    }

    #[test]
    fn data_cannot_end_the_script_it_is_in() {
        let v = serde_json::json!({ "columns": {}, "summary": { "title": "</script><b>x" } });
        let html = page(Some(&v));
        assert!(!html.contains("</script><b>"), "escaped in the data and the title");
        assert!(html.contains("<title>weir: &lt;/script&gt;&lt;b&gt;x</title>"));
        assert!(html.contains("uPlot"), "the library is in the page");
        assert!(!html.contains("/*DATA*/"));
        assert!(html.starts_with(REPORT_MARK), "a report says it is one");
    }
}
