//! A cluster's page: the scheduler gathers what each executor's [`Watch`] samples, so that one
//! page (`weir cluster scheduler --ui`) shows the whole cluster's model calls — the sum of the
//! executors' counters over time, and each executor as a row — with the page `weir run --ui`
//! serves.
//!
//! Each executor tells the scheduler its newest point and summary every [`REPORT_EVERY`] over
//! the connection it keeps to the scheduler's quota service (past the cluster's guard: TLS or
//! the token). The scheduler keeps the latest of each, bounded in number and size, and samples
//! their sum once a second into a series of its own.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::time::Instant;

use crate::dash::{column, Series, Updates, Watch, COLUMNS};
use crate::share::Hub;

/// How often an executor tells the scheduler where it stands.
pub const REPORT_EVERY: Duration = Duration::from_secs(2);

/// The longest report line taken (a summary holds at most a few failure examples per kind and a
/// row per endpoint): a longer one closes the connection.
const MAX_LINE: usize = 256 * 1024;

/// The most executors kept (those gone included, so that their calls stay in the sums).
const MAX_EXECUTORS: usize = 256;

/// An executor not heard from for this long is shown as such.
const SILENT_AFTER: Duration = Duration::from_secs(10);

/// The first line of an executor's connection that reports to the page (the quota service
/// tells it from a quota's hello by its key).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The executor, as the scheduler knows it (`host:port`).
    pub watch: String,
    /// When its process started: an executor started again at the same address is another.
    pub started: String,
}

/// What one executor said last.
struct Heard {
    /// Its newest point ([`COLUMNS`]; counters cumulative since it started).
    point: Vec<Option<f64>>,
    summary: Value,
    at: Instant,
}

/// The scheduler's gathering of its executors' figures, served as a live page.
pub struct Gathered {
    title: String,
    started: Instant,
    started_at: SystemTime,
    series: Series,
    /// By executor and process start.
    heard: Mutex<BTreeMap<(String, String), Heard>>,
    last: Mutex<Value>,
}

impl Gathered {
    /// Nothing heard yet; `title` names the page.
    pub fn new(title: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            title: title.into(),
            started: Instant::now(),
            started_at: SystemTime::now(),
            series: Series::new(),
            heard: Mutex::new(BTreeMap::new()),
            last: Mutex::new(Value::Null),
        })
    }

    /// Takes what the executor `hello` names said in `line` (a [`Watch::latest`]); a line that is
    /// not one is ignored.
    fn take(&self, hello: &Hello, line: &str) {
        let Ok(v) = serde_json::from_str::<Value>(line) else { return };
        let Some(point) = v.get("point").and_then(Value::as_array) else { return };
        let point: Vec<Option<f64>> = point.iter().map(Value::as_f64).collect();
        if point.len() != COLUMNS.len() {
            return;
        }
        let summary = v.get("summary").cloned().unwrap_or(Value::Null);
        let mut heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        let key = (hello.watch.clone(), hello.started.clone());
        if !heard.contains_key(&key) && heard.len() >= MAX_EXECUTORS {
            // The one heard from longest ago makes room (its calls leave the sums).
            let oldest = heard.iter().min_by_key(|(_, h)| h.at).map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                heard.remove(&k);
            }
        }
        heard.insert(key, Heard { point, summary, at: Instant::now() });
    }

    /// Reads an executor's reports from `lines` (after its hello) until it goes.
    pub async fn serve<R: AsyncRead + Unpin>(&self, hello: Hello, read: R) {
        let mut read = BufReader::new(read);
        let mut line = Vec::new();
        loop {
            line.clear();
            match (&mut read).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => return,
                Ok(n) if n > MAX_LINE => {
                    tracing::warn!("cluster page: executor {} sent a report too long; closed it", hello.watch);
                    return;
                }
                Ok(_) => self.take(&hello, &String::from_utf8_lossy(&line)),
            }
        }
    }

    /// Starts summing what was heard every [`REPORT_EVERY`], until the returned task is aborted.
    /// Sampling as often as executors report: once a second, every other point would hold no
    /// new report and the page's rates would swing between nothing and twice the truth.
    pub fn start(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REPORT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                me.sample();
            }
        })
    }

    /// Sums the executors' newest points into the series, and their summaries into the page's.
    pub fn sample(&self) {
        let heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        let t = self.started.elapsed().as_secs_f64();
        let mut point = [None; COLUMNS.len()];
        point[0] = Some(t);
        for (i, slot) in point.iter_mut().enumerate().skip(1) {
            let values = heard.values().filter_map(|h| h.point[i]);
            // Counters and gauges of the whole add up; a latency is the slowest executor's. A
            // limit is the highest any executor learned or was told: executors calling an
            // endpoint with one key share its quota through the scheduler, and each reports
            // the key's limit, not a part of it.
            *slot = if COLUMNS[i].starts_with("lat_") || COLUMNS[i].starts_with("ttft_") || COLUMNS[i] == "limit_rps" {
                values.reduce(f64::max)
            } else {
                values.reduce(|a, b| a + b)
            };
        }
        self.series.push(point, false);
        let sum = |name: &str| point[column(name)].unwrap_or(0.0);
        // Records a second over the last minute (or what there is of it), as a run's page.
        let per_s = self.series.recent("done", 60.0).map(|(a, b, dt)| (b - a) / dt.max(1e-9));
        let mut endpoints = Vec::new();
        let mut failures: BTreeMap<String, (u64, Vec<Value>)> = BTreeMap::new();
        for ((executor, _), h) in heard.iter() {
            let silent = h.at.elapsed();
            let state = if silent >= SILENT_AFTER {
                format!("not heard from for {} s", silent.as_secs())
            } else {
                h.summary.get("state").and_then(Value::as_str).unwrap_or("up").to_string()
            };
            let rows = h.summary.get("endpoints").and_then(Value::as_array).cloned().unwrap_or_default();
            if rows.is_empty() {
                endpoints.push(serde_json::json!({
                    "model": "", "endpoint": executor, "state": state, "concurrency": 0,
                    "limit": null, "calls": 0, "rate_limited": 0,
                }));
            }
            for mut row in rows {
                let at = row.get("endpoint").and_then(Value::as_str).unwrap_or("").to_string();
                row["endpoint"] = Value::String(format!("{executor}: {at}"));
                if silent >= SILENT_AFTER {
                    row["state"] = Value::String(state.clone());
                }
                endpoints.push(row);
            }
            for f in h.summary.get("failures").and_then(Value::as_array).into_iter().flatten() {
                let Some(kind) = f.get("kind").and_then(Value::as_str) else { continue };
                let entry = failures.entry(kind.to_string()).or_default();
                entry.0 += f.get("records").and_then(Value::as_u64).unwrap_or(0);
                for e in f.get("examples").and_then(Value::as_array).into_iter().flatten() {
                    if entry.1.len() < 3 {
                        entry.1.push(e.clone());
                    }
                }
            }
        }
        let failures: Vec<Value> = failures
            .into_iter()
            .map(|(kind, (n, examples))| serde_json::json!({ "kind": kind, "records": n, "examples": examples }))
            .collect();
        let executors = heard.len();
        let silent = heard.values().filter(|h| h.at.elapsed() >= SILENT_AFTER).count();
        // Calls the quota holds now, in the executors still heard from.
        let held: u64 = heard
            .values()
            .filter(|h| h.at.elapsed() < SILENT_AFTER)
            .filter_map(|h| h.summary.get("held").and_then(Value::as_u64))
            .sum();
        let cost = point[column("cost")];
        let summary = serde_json::json!({
            "title": self.title,
            "state": match silent {
                0 => format!("{executors} executor{} reporting", if executors == 1 { "" } else { "s" }),
                _ => format!("{} of {executors} executors reporting", executors - silent),
            },
            "alert": (silent > 0).then(|| format!("{silent} of {executors} executors not heard from for {} s or more", SILENT_AFTER.as_secs())),
            "started": humantime::format_rfc3339_seconds(self.started_at).to_string(),
            "elapsed_secs": t,
            "total": null,
            "done": sum("done") as u64,
            "succeeded": sum("succeeded") as u64,
            "failed": sum("failed") as u64,
            "records_per_s": per_s,
            "eta_secs": null,
            "calls": sum("calls") as u64,
            "rate_limited": sum("rate_limited") as u64,
            "server_errors": sum("server_errors") as u64,
            "cache_hits": sum("cache_hits") as u64,
            "tokens_in": sum("tokens_in") as u64,
            "tokens_out": sum("tokens_out") as u64,
            "cost_usd": cost,
            "held": held,
            "endpoints": endpoints,
            "failures": failures,
            "jobs": null,
        });
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = summary;
    }

    fn series_update(&self, since: usize, generation: Option<u64>) -> Value {
        let (columns, generation, reset) = self.series.since(since, generation);
        serde_json::json!({ "step": generation, "reset": reset, "columns": columns })
    }
}

impl Updates for Gathered {
    fn update(&self, since: usize, generation: Option<u64>, live: bool) -> Value {
        let mut update = self.series_update(since, generation);
        let mut summary = self.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Value::Object(s) = &mut summary {
            s.insert("live".into(), Value::Bool(live));
        }
        update["summary"] = summary;
        update
    }
}

/// Tells the scheduler behind `hub` where this executor (`who`) stands, every
/// [`REPORT_EVERY`], for as long as the process runs: connecting again after a failure.
pub async fn report_to(hub: Arc<dyn Hub>, watch: Arc<Watch>, who: String) {
    let hello = Hello { watch: who, started: humantime::format_rfc3339_nanos(SystemTime::now()).to_string() };
    let hello = format!("{}\n", serde_json::to_string(&hello).unwrap_or_default());
    loop {
        if let Ok(mut link) = hub.connect().await {
            if link.write_all(hello.as_bytes()).await.is_ok() {
                let mut tick = tokio::time::interval(REPORT_EVERY);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let Some(latest) = watch.latest() else { continue };
                    if link.write_all(format!("{latest}\n").as_bytes()).await.is_err() {
                        break;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(done: f64, calls: f64, lat: f64) -> String {
        let mut point = vec![Some(1.0); COLUMNS.len()];
        point[COLUMNS.iter().position(|c| *c == "limit_rps").unwrap()] = Some(20.0);
        point[COLUMNS.iter().position(|c| *c == "done").unwrap()] = Some(done);
        point[COLUMNS.iter().position(|c| *c == "calls").unwrap()] = Some(calls);
        point[COLUMNS.iter().position(|c| *c == "lat_p95").unwrap()] = Some(lat);
        let summary = serde_json::json!({
            "state": "running",
            "endpoints": [{"model": "gemini/x", "endpoint": "http://127.0.0.1:1", "state": "up", "calls": calls}],
            "failures": [{"kind": "server", "records": 2, "examples": [{"id": "a", "message": "m"}]}],
        });
        serde_json::json!({ "point": point, "summary": summary }).to_string()
    }

    /// Executors' counters add up, the slowest latency is the cluster's, each executor is a
    /// row, failures of a kind add up; an executor started again at the same address is another
    /// (its counters start over), and a line that is not a report changes nothing.
    #[tokio::test]
    async fn executors_reports_add_up() {
        let g = Gathered::new("cluster");
        let a = Hello { watch: "10.0.0.1:50051".into(), started: "t1".into() };
        let b = Hello { watch: "10.0.0.2:50051".into(), started: "t1".into() };
        g.take(&a, &line(10.0, 12.0, 0.5));
        g.take(&b, &line(5.0, 6.0, 0.9));
        g.take(&b, "not json");
        g.take(&b, r#"{"point": [1, 2]}"#);
        g.sample();
        let s = g.update(0, None, true)["summary"].clone();
        assert_eq!((s["done"].as_u64(), s["calls"].as_u64()), (Some(15), Some(18)), "{s}");
        assert_eq!(s["endpoints"].as_array().unwrap().len(), 2, "{s}");
        assert!(s["endpoints"][0]["endpoint"].as_str().unwrap().starts_with("10.0.0.1:50051: "), "{s}");
        assert_eq!(s["failures"][0]["records"].as_u64(), Some(4), "{s}");
        let cols = g.update(0, None, true)["columns"].clone();
        assert_eq!(cols["lat_p95"][0].as_f64(), Some(0.9));
        assert_eq!(cols["limit_rps"][0].as_f64(), Some(20.0), "one key's limit, not the sum");
        // Started again: a second process at b's address.
        let b2 = Hello { watch: "10.0.0.2:50051".into(), started: "t2".into() };
        g.take(&b2, &line(1.0, 1.0, 0.1));
        g.sample();
        let s = g.update(0, None, true)["summary"].clone();
        assert_eq!(s["done"].as_u64(), Some(16), "{s}");
        assert_eq!(s["state"], "3 executors reporting");
    }

    /// An executor not heard from is not counted as reporting, and the alert names how many.
    #[tokio::test(start_paused = true)]
    async fn a_silent_executor_is_not_reporting() {
        let g = Gathered::new("cluster");
        let a = Hello { watch: "10.0.0.1:50051".into(), started: "t1".into() };
        let b = Hello { watch: "10.0.0.2:50051".into(), started: "t1".into() };
        g.take(&a, &line(1.0, 1.0, 0.1));
        g.take(&b, &line(1.0, 1.0, 0.1));
        tokio::time::advance(SILENT_AFTER + Duration::from_secs(1)).await;
        g.take(&a, &line(2.0, 2.0, 0.1));
        g.sample();
        let s = g.update(0, None, true)["summary"].clone();
        assert_eq!(s["state"], "1 of 2 executors reporting", "{s}");
        assert!(s["alert"].as_str().unwrap().starts_with("1 of 2 executors not heard from"), "{s}");
    }

    /// A report line longer than the bound closes the connection; the lines before it count.
    #[tokio::test]
    async fn a_report_too_long_ends_the_connection() {
        let g = Gathered::new("cluster");
        let mut input = line(3.0, 3.0, 0.1).into_bytes();
        input.push(b'\n');
        input.extend(std::iter::repeat_n(b'x', MAX_LINE + 10));
        input.extend(b"\n");
        input.extend(line(99.0, 99.0, 0.1).into_bytes());
        input.push(b'\n');
        g.serve(Hello { watch: "e".into(), started: "t".into() }, &input[..]).await;
        g.sample();
        assert_eq!(g.update(0, None, true)["summary"]["done"].as_u64(), Some(3));
    }
}
