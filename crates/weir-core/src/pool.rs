//! A pool of endpoints that serve one model: regions, projects, keys or replicas, each with its
//! own [`Throttle`] (its own quota, learned or told, and its own capacity) and its own health.
//!
//! Every attempt of a call goes to the endpoint that admits it first: the call waits on every
//! usable endpoint's throttle at once and takes the first admission, dropping the other waits
//! (admission is cancel-safe). So calls go where there is spare rate budget and concurrency, not
//! round-robin, and a retry may go to another endpoint than the attempt before. Endpoints that
//! could admit at once are tried in a random order weighted by their weights.
//!
//! An endpoint that stops answering — connections refused, a run of server errors or timeouts,
//! rejected credentials, a spent daily quota — is cooled down: no calls for a while, then it is
//! tried again (a failure then cools it down for longer). While another endpoint is usable, the
//! failure of a call at a cooled endpoint is not the run's business: the call is retried at once
//! elsewhere, and the run's stop rules never see it. Only when no other endpoint is usable does
//! the error count as it does for a single endpoint, so a run stops only when every endpoint is
//! unusable.
//!
//! A pool of one endpoint is exactly the single endpoint: no health is kept, no error rewritten.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{ErrorKind, ModelError, RetryHint};
use crate::throttle::{Admitted, RateSnapshot, Sharing, Throttle, Weight};

/// Server errors, timeouts and broken connections in a row after which an endpoint is cooled
/// down: one such failure is noise; five with no answer between them is an endpoint in trouble.
pub const FAILURES_TO_COOL: u32 = 5;

/// The first cool-down of an endpoint that refuses connections or fails in a row; each further
/// cool-down without an answer between doubles it, up to [`LONGEST_COOL`].
pub const FIRST_COOL: Duration = Duration::from_secs(5);

/// The longest cool-down of an endpoint that may come back by itself (a restarted replica).
pub const LONGEST_COOL: Duration = Duration::from_secs(120);

/// How long an endpoint whose credentials were rejected or whose daily quota is spent waits
/// before it is tried again: these do not come back within seconds, but may within a run of
/// hours (a key re-enabled, a quota raised).
pub const DEAD_FOR: Duration = Duration::from_secs(600);

/// Why an endpoint is cooled down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// Connections refused: nothing listens there.
    Unreachable,
    /// A run of server errors, timeouts or broken connections.
    Failing,
    /// Credentials rejected.
    Auth,
    /// A quota that does not come back soon is spent.
    Spent,
}

impl Cause {
    /// What the summary and messages say of it.
    fn says(self) -> &'static str {
        match self {
            Cause::Unreachable => "connections refused",
            Cause::Failing => "failing",
            Cause::Auth => "credentials rejected",
            Cause::Spent => "quota spent",
        }
    }
}

/// An endpoint's state, as the summary and `/metrics` show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointHealth {
    /// Taking calls.
    Active,
    /// Taking no calls for a while (refused connections, a run of failures); tried again after.
    CoolingDown,
    /// Its credentials were rejected or its daily quota is spent: tried again only after
    /// [`DEAD_FOR`].
    Dead,
}

impl EndpointHealth {
    /// The name shown.
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointHealth::Active => "active",
            EndpointHealth::CoolingDown => "cooling down",
            EndpointHealth::Dead => "dead",
        }
    }
}

#[derive(Debug, Default)]
struct Health {
    /// Cooled down until then, and why.
    cooling: Option<(Instant, Cause)>,
    /// Cool-downs since the last answer (each doubles the next).
    strikes: u32,
    /// Server errors, timeouts and broken connections since the last answer.
    failures_in_a_row: u32,
}

impl Health {
    /// The cool-down in force at `now`, if any (one that has run out is none: the endpoint is
    /// tried again).
    fn cooled(&self, now: Instant) -> Option<(Instant, Cause)> {
        self.cooling.filter(|&(until, _)| until > now)
    }
}

/// One endpoint of a pool.
struct Lane {
    throttle: Arc<Throttle>,
    endpoint: String,
    weight: f64,
    health: Mutex<Health>,
    calls: AtomicU64,
    rate_limited: AtomicU64,
    failed: AtomicU64,
}

impl Lane {
    /// Where the endpoint stands at `now`, and why it takes no calls when it does not.
    fn standing(&self, now: Instant) -> (EndpointHealth, Option<&'static str>) {
        match self.health.lock().unwrap_or_else(|e| e.into_inner()).cooled(now) {
            Some((_, c @ (Cause::Auth | Cause::Spent))) => (EndpointHealth::Dead, Some(c.says())),
            Some((_, c)) => (EndpointHealth::CoolingDown, Some(c.says())),
            None => (EndpointHealth::Active, None),
        }
    }
}

/// One endpoint of a pool as it stands, for the summary and `/metrics`.
#[derive(Debug, Clone)]
pub struct EndpointStatus {
    /// Where it is served.
    pub endpoint: String,
    /// Whether it takes calls.
    pub health: EndpointHealth,
    /// Why it does not, when it does not ("connections refused", "credentials rejected", …).
    pub why: Option<&'static str>,
    /// Attempts sent there.
    pub calls: u64,
    /// Of those, refused for rate (429 and the like).
    pub rate_limited: u64,
    /// Of those, failed otherwise.
    pub failed: u64,
    /// Calls its throttle allows in flight now.
    pub concurrency: usize,
    /// Its rate limits, told or learned.
    pub rates: RateSnapshot,
    /// How its quota is shared with other processes.
    pub sharing: Sharing,
}

/// What a pool made of an attempt's error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Absorbed {
    /// The run's business, as at a single endpoint.
    No,
    /// This endpoint's refusal or failure (a 429, a 5xx): tried again at once elsewhere, counted
    /// as one of the record's retries.
    Elsewhere,
    /// The endpoint was left for it (refused connections, a rejected key, a spent quota, a run
    /// of failures): tried again at once elsewhere, not counted against the record's retries —
    /// the record did nothing wrong, and a dead endpoint would otherwise use up the retries of
    /// every record that met it.
    Left,
    /// Refused for rate again, and the endpoint admitted none of this process's calls since
    /// the record's last refusal (a quota of zero): the run's trouble, not the record's, so
    /// not counted against its retries; the run stops after 10 minutes of it (see
    /// [`Throttle::judge`](crate::throttle::Throttle::judge)). On a quota of zero whose 429s
    /// advised 10 s, every record used up its retries in about 5 minutes and ended as a
    /// `rate_limited` row, which a plain resume does not run again. (Decided by the executor,
    /// which knows the record's last refusal.)
    Held,
}

/// An endpoint of a pool, as the runtime hands it over.
#[derive(Clone)]
pub struct PoolMember {
    /// Its throttle (this process's one for that endpoint).
    pub throttle: Arc<Throttle>,
    /// Where it is served (for the summary; never a key).
    pub endpoint: String,
    /// Its share of the calls when several could take one at once (1 by default).
    pub weight: f64,
}

/// The endpoints that serve one model, each with its throttle and health.
pub struct Pool {
    lanes: Vec<Lane>,
    /// Said when an endpoint is cooled down, so calls waiting on it choose again.
    changed: tokio::sync::Notify,
    seed: AtomicU64,
    /// Calls waiting out the backoff after a refusal for rate, or for a cooled-down endpoint
    /// to take calls again: held for the quota too, outside any throttle (see [`Pool::held`]).
    backing_off: std::sync::atomic::AtomicUsize,
    /// The run's calls in flight at all the endpoints together, at most (`--max-concurrency`),
    /// with the slots that count them: each endpoint's throttle bounds its own calls only, and
    /// a run told 4 had 8 in flight at two endpoints.
    total: Option<(usize, Arc<tokio::sync::Semaphore>)>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.lanes.iter().map(|l| &l.endpoint)).finish()
    }
}

impl Pool {
    /// A pool of one endpoint.
    pub fn single(throttle: Arc<Throttle>) -> Self {
        Self::new(vec![PoolMember { throttle, endpoint: String::new(), weight: 1.0 }])
    }

    /// A pool of `members` (at least one).
    pub fn new(members: Vec<PoolMember>) -> Self {
        assert!(!members.is_empty(), "a pool has at least one endpoint");
        let lanes = members
            .into_iter()
            .map(|m| Lane {
                throttle: m.throttle,
                endpoint: m.endpoint,
                weight: if m.weight.is_finite() && m.weight > 0.0 { m.weight } else { 1.0 },
                health: Mutex::new(Health::default()),
                calls: AtomicU64::new(0),
                rate_limited: AtomicU64::new(0),
                failed: AtomicU64::new(0),
            })
            .collect();
        Self {
            lanes,
            changed: tokio::sync::Notify::new(),
            seed: AtomicU64::new(0x9001),
            backing_off: std::sync::atomic::AtomicUsize::new(0),
            total: None,
        }
    }

    /// At most `calls` of the run in flight at all the endpoints together (a pool of one
    /// endpoint has its throttle's bound already).
    pub fn with_most_in_flight(mut self, calls: usize) -> Self {
        if self.lanes.len() > 1 {
            self.total = Some((calls.max(1), Arc::new(tokio::sync::Semaphore::new(calls.max(1)))));
        }
        self
    }

    /// How many endpoints.
    pub fn len(&self) -> usize {
        self.lanes.len()
    }

    /// Never: a pool has at least one endpoint.
    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// The first endpoint's throttle (a pool of one: its only one).
    pub fn first(&self) -> &Arc<Throttle> {
        &self.lanes[0].throttle
    }

    /// Calls all the endpoints allow in flight now.
    pub fn concurrency(&self) -> usize {
        let sum = self.lanes.iter().map(|l| l.throttle.concurrency()).sum();
        self.total.as_ref().map_or(sum, |&(most, _)| sum.min(most))
    }

    /// This process's calls held for the quota now: by the endpoints' throttles (see
    /// [`Throttle::held_now`]), in the backoff after a 429, or waiting for a cooled-down
    /// endpoint. A call waits at every endpoint of a pool at once, so a pool's count is its
    /// endpoints' largest, not their sum (which counted one call once per endpoint).
    pub fn held(&self) -> usize {
        let at_endpoints = self.lanes.iter().map(|l| l.throttle.held_now()).max().unwrap_or(0);
        at_endpoints + self.backing_off.load(Relaxed)
    }

    /// The gauge of calls held outside the throttles (see [`Pool::held`]).
    pub(crate) fn backing_off(&self) -> &std::sync::atomic::AtomicUsize {
        &self.backing_off
    }

    /// Every endpoint as it stands.
    pub fn status(&self) -> Vec<EndpointStatus> {
        let now = Instant::now();
        self.lanes
            .iter()
            .map(|l| (l, l.standing(now)))
            .map(|(l, (health, why))| EndpointStatus {
                endpoint: l.endpoint.clone(),
                health,
                why,
                calls: l.calls.load(Relaxed),
                rate_limited: l.rate_limited.load(Relaxed),
                failed: l.failed.load(Relaxed),
                concurrency: l.throttle.concurrency(),
                rates: l.throttle.rates(),
                sharing: l.throttle.sharing(),
            })
            .collect()
    }

    /// The endpoints that take calls now, in a random order weighted by their weights (the
    /// first admits a call when several could at once); or, when every one is cooled down,
    /// when the first comes back.
    fn usable(&self) -> Result<Vec<usize>, Instant> {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(self.seed.fetch_add(1, Relaxed));
        let mut keyed: Vec<(f64, usize)> = Vec::with_capacity(self.lanes.len());
        let mut back = None::<Instant>;
        for (i, l) in self.lanes.iter().enumerate() {
            match l.health.lock().unwrap_or_else(|e| e.into_inner()).cooled(now) {
                Some((until, _)) => back = Some(back.map_or(until, |b| b.min(until))),
                None => {
                    // A weighted random order: the largest u^(1/w) first.
                    let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
                    keyed.push((u.powf(1.0 / l.weight), i));
                }
            }
        }
        if keyed.is_empty() {
            return Err(back.unwrap_or(now));
        }
        keyed.sort_by(|a, b| b.0.total_cmp(&a.0));
        Ok(keyed.into_iter().map(|(_, i)| i).collect())
    }

    /// Admits a call of `weight` at the endpoint that can take it first: its index and the
    /// admission. `None` when `cancel` fired first.
    pub async fn admit(&self, weight: Weight, cancel: &CancellationToken) -> Option<(usize, Admitted<'_>)> {
        if self.lanes.len() == 1 {
            return self.lanes[0].throttle.admit(weight, cancel).await.map(|a| (0, a));
        }
        // The run's slot first (waiting for it is cancel-safe), then the endpoints' admissions.
        let mut slot = match &self.total {
            Some((_, slots)) => tokio::select! {
                s = slots.clone().acquire_owned() => Some(s.expect("the pool never closes its slots")),
                _ = cancel.cancelled() => return None,
            },
            None => None,
        };
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.usable() {
                Ok(order) => {
                    let waits = order
                        .into_iter()
                        .map(|i| Box::pin(async move { (i, self.lanes[i].throttle.admit(weight, cancel).await) }));
                    tokio::select! {
                        ((i, admitted), _, _) = futures::future::select_all(waits) => {
                            return admitted.map(|a| (i, a.holding(slot.take())));
                        }
                        _ = &mut changed => continue,
                    }
                }
                Err(back) => {
                    let _held = crate::throttle::Counted::new(&self.backing_off, true);
                    tokio::select! {
                        _ = tokio::time::sleep_until(back) => {}
                        _ = &mut changed => {}
                        _ = cancel.cancelled() => return None,
                    }
                }
            }
        }
    }

    /// Since when every call of this process's that endpoint `lane` answered was refused for
    /// rate, none admitted (see [`RateLimiter::refused_since`](crate::throttle::RateLimiter::refused_since)).
    pub fn refused_since(&self, lane: usize) -> Option<Instant> {
        self.lanes[lane].throttle.rate_limiter().refused_since()
    }

    /// Learns from an attempt's result at endpoint `lane`. For an error, answers the error
    /// the caller should act on: the same one, or — when it is this endpoint's trouble and
    /// another endpoint takes calls — one that says to try again at once (elsewhere), with
    /// how (see [`Absorbed`]).
    pub fn learn(&self, lane: usize, result: Result<(), &ModelError>) -> Option<(ModelError, Absorbed)> {
        let l = &self.lanes[lane];
        l.calls.fetch_add(1, Relaxed);
        let e = match result {
            Ok(()) => {
                if self.lanes.len() > 1 {
                    let mut h = l.health.lock().unwrap_or_else(|e| e.into_inner());
                    if h.strikes > 0 {
                        tracing::warn!(endpoint = %l.endpoint, "endpoint {} answers again", l.endpoint);
                    }
                    *h = Health::default();
                }
                return None;
            }
            Err(e) => e,
        };
        if e.kind == ErrorKind::RateLimited {
            l.rate_limited.fetch_add(1, Relaxed);
        } else {
            l.failed.fetch_add(1, Relaxed);
        }
        // Refused with no advice for longer than weir waits: the run stops (or the pool leaves
        // this endpoint).
        let judged = l.throttle.judge(e);
        let e = judged.as_ref().unwrap_or(e);
        if self.lanes.len() == 1 {
            return Some((e.clone(), Absorbed::No));
        }
        let now = Instant::now();
        // What this error says about the endpoint (not about the request).
        let cause = if e.unreachable {
            Some(Cause::Unreachable)
        } else if e.kind == ErrorKind::Auth {
            Some(Cause::Auth)
        } else if e.kind == ErrorKind::QuotaExhausted || e.hint == RetryHint::StopRun {
            Some(Cause::Spent)
        } else if matches!(e.kind, ErrorKind::Server | ErrorKind::Timeout | ErrorKind::Transport) {
            // Cooled down so that others take its calls: with every other endpoint dead, a
            // cool-down would only hold the records (doubling to two minutes each time), and
            // its failures are the records' as at a lone endpoint (a tester's pool of one
            // hanging endpoint and one with a rejected key wrote no row in 200 s).
            let others_alive =
                self.lanes.iter().enumerate().any(|(i, o)| i != lane && o.standing(now).0 != EndpointHealth::Dead);
            let mut h = l.health.lock().unwrap_or_else(|e| e.into_inner());
            h.failures_in_a_row += 1;
            (h.failures_in_a_row >= FAILURES_TO_COOL && others_alive).then_some(Cause::Failing)
        } else {
            None
        };
        if let Some(cause) = cause {
            let mut h = l.health.lock().unwrap_or_else(|e| e.into_inner());
            // Calls in flight when it was cooled down fail too: they do not lengthen it.
            if h.cooled(now).is_none() {
                let cool = match cause {
                    Cause::Auth | Cause::Spent => DEAD_FOR,
                    Cause::Unreachable | Cause::Failing => {
                        FIRST_COOL.saturating_mul(1u32 << h.strikes.min(10)).min(LONGEST_COOL)
                    }
                };
                h.strikes += 1;
                h.failures_in_a_row = 0;
                h.cooling = Some((now + cool, cause));
                tracing::warn!(
                    endpoint = %l.endpoint,
                    "endpoint {} {} for {} s: {}",
                    l.endpoint,
                    match cause {
                        Cause::Auth | Cause::Spent => "is dead; tried again",
                        _ => "cools down; tried again",
                    },
                    cool.as_secs(),
                    e.message
                );
                drop(h);
                self.changed.notify_waiters();
            } else if cause == Cause::Unreachable {
                // Cooled down for failing (its calls broke when it was stopped), and now nothing
                // listens there: said as such, for the same time.
                if let Some((_, why @ Cause::Failing)) = h.cooling.as_mut() {
                    *why = Cause::Unreachable;
                }
            }
        }
        // The endpoint's trouble (or a refusal its throttle now holds it back for): tried again
        // at once elsewhere, while another endpoint takes calls.
        let endpoints_fault = cause.is_some()
            || matches!(e.kind, ErrorKind::RateLimited | ErrorKind::Server | ErrorKind::Timeout | ErrorKind::Transport);
        let other_usable = self
            .lanes
            .iter()
            .enumerate()
            .any(|(i, o)| i != lane && o.health.lock().unwrap_or_else(|e| e.into_inner()).cooled(now).is_none());
        if endpoints_fault && other_usable {
            let mut again = e.clone();
            again.hint = RetryHint::Later(Some(Duration::ZERO));
            // Where, not what follows: whether it is tried again is the retry policy's to say
            // (with `--max-retries 0`, a row said "tried again at another endpoint" with one
            // attempt).
            again.message = format!("{} (at {})", e.message, l.endpoint);
            return Some((again, if cause.is_some() { Absorbed::Left } else { Absorbed::Elsewhere }));
        }
        // No endpoint is left: the run's stop rules see the error, told where every one stands.
        let mut e = e.clone();
        if endpoints_fault && cause.is_some() {
            let each: Vec<String> = self
                .lanes
                .iter()
                .map(|o| match o.standing(now) {
                    (health, Some(why)) => format!("{}: {}: {why}", o.endpoint, health.as_str()),
                    (health, None) => format!("{}: {}", o.endpoint, health.as_str()),
                })
                .collect();
            e.message = format!("{} (no endpoint of the pool is usable: {})", e.message, each.join("; "));
            // Every one dead (a rejected key, a spent quota: ten minutes each), not cooling:
            // waiting for one would hold the record for those minutes; the run stops as it
            // would at one endpoint (a token that could not be fetched was tried again).
            if self.lanes.iter().all(|o| o.standing(now).0 == EndpointHealth::Dead) {
                e.hint = RetryHint::StopRun;
            }
        }
        Some((e, Absorbed::No))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::throttle::{RateSettings, ThrottleSettings};

    fn throttle(requests: Option<u64>) -> Arc<Throttle> {
        Arc::new(Throttle::new(&ThrottleSettings {
            rate: RateSettings { requests, window: Duration::from_secs(10), learn: false, ..RateSettings::default() },
            adaptive: false,
            max_concurrency: 64,
            ..ThrottleSettings::default()
        }))
    }

    fn pool(quotas: &[u64]) -> Pool {
        Pool::new(
            quotas
                .iter()
                .enumerate()
                .map(|(i, &q)| PoolMember { throttle: throttle(Some(q)), endpoint: format!("e{i}"), weight: 1.0 })
                .collect(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn calls_go_where_there_is_budget_and_together_get_the_sum() {
        // Quotas of 10, 5 and 2 per 10 s: within one window the pool admits 17, each endpoint
        // no more than its quota.
        let p = pool(&[10, 5, 2]);
        let never = CancellationToken::new();
        let mut at = [0usize; 3];
        let start = Instant::now();
        for _ in 0..17 {
            let (i, a) = p.admit(Weight::default(), &never).await.unwrap();
            a.finish(Ok(Default::default()));
            at[i] += 1;
        }
        assert!(start.elapsed() < Duration::from_secs(1), "took {:?}", start.elapsed());
        assert_eq!(at, [10, 5, 2]);
        // The 18th waits for a window to open.
        let (_, a) = p.admit(Weight::default(), &never).await.unwrap();
        a.finish(Ok(Default::default()));
        assert!(start.elapsed() >= Duration::from_secs(9), "took {:?}", start.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn the_runs_most_calls_in_flight_bound_the_pool_as_a_whole() {
        // `--max-concurrency 4` at two endpoints that each allow 64: four calls in flight, not
        // eight (an outside tester saw eight); the fifth goes when one of them ends.
        let p = pool(&[1000, 1000]).with_most_in_flight(4);
        let never = CancellationToken::new();
        let mut out = Vec::new();
        for _ in 0..4 {
            out.push(p.admit(Weight::default(), &never).await.unwrap());
        }
        assert_eq!(p.concurrency(), 4);
        let fifth = tokio::time::timeout(Duration::from_secs(30), p.admit(Weight::default(), &never)).await;
        assert!(fifth.is_err(), "a fifth call was admitted with four in flight");
        let (_, a) = out.pop().unwrap();
        a.finish(Ok(Default::default()));
        let (_, fifth) = tokio::time::timeout(Duration::from_secs(1), p.admit(Weight::default(), &never))
            .await
            .expect("a slot was freed")
            .unwrap();
        // Calls dropped unreported (cancelled) free their slots too.
        drop(fifth);
        drop(out);
        let mut again = Vec::new();
        for _ in 0..4 {
            again.push(
                tokio::time::timeout(Duration::from_secs(1), p.admit(Weight::default(), &never))
                    .await
                    .expect("every slot is free again")
                    .unwrap(),
            );
        }
        // A call waiting for a slot is given up when its run is cancelled.
        let cancel = CancellationToken::new();
        let waiting = p.admit(Weight::default(), &cancel);
        cancel.cancel();
        assert!(waiting.await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn an_endpoint_that_refuses_connections_cools_down_and_its_calls_go_elsewhere() {
        let p = pool(&[100, 100]);
        let never = CancellationToken::new();
        let refused = ModelError { unreachable: true, ..ModelError::new(ErrorKind::Transport, "connection refused") };
        let (again, absorbed) = p.learn(0, Err(&refused)).unwrap();
        assert_eq!(absorbed, Absorbed::Left);
        assert_eq!(again.hint, RetryHint::Later(Some(Duration::ZERO)));
        assert_eq!(p.status()[0].health, EndpointHealth::CoolingDown);
        for _ in 0..20 {
            let (i, a) = p.admit(Weight::default(), &never).await.unwrap();
            a.finish(Ok(Default::default()));
            assert_eq!(i, 1, "a cooled endpoint takes no calls");
        }
        // Tried again after the cool-down.
        tokio::time::advance(FIRST_COOL).await;
        assert_eq!(p.status()[0].health, EndpointHealth::Active);
        let mut seen = [false; 2];
        for _ in 0..40 {
            let (i, a) = p.admit(Weight::default(), &never).await.unwrap();
            a.finish(Ok(Default::default()));
            seen[i] = true;
        }
        assert_eq!(seen, [true, true]);
        // Refused again without an answer between: cooled twice as long.
        p.learn(0, Err(&refused));
        p.learn(0, Err(&refused));
        tokio::time::advance(FIRST_COOL).await;
        assert_eq!(p.status()[0].health, EndpointHealth::CoolingDown);
        tokio::time::advance(FIRST_COOL).await;
        assert_eq!(p.status()[0].health, EndpointHealth::Active);
    }

    #[tokio::test(start_paused = true)]
    async fn an_endpoint_stopped_mid_call_is_said_to_refuse_connections_once_it_does() {
        // Its calls broke when it was stopped (five in a row: failing), then the next found
        // nothing listening: the summary says so, and the cool-down is not lengthened.
        let p = pool(&[100, 100]);
        let broken = ModelError::new(ErrorKind::Transport, "connection reset");
        for _ in 0..FAILURES_TO_COOL {
            p.learn(0, Err(&broken));
        }
        assert_eq!(p.status()[0].why, Some("failing"));
        let refused = ModelError { unreachable: true, ..ModelError::new(ErrorKind::Transport, "connection refused") };
        p.learn(0, Err(&refused));
        assert_eq!(p.status()[0].why, Some("connections refused"));
        tokio::time::advance(FIRST_COOL).await;
        assert_eq!(p.status()[0].health, EndpointHealth::Active);
        let message = p.learn(0, Err(&broken)).unwrap().0.message;
        assert_eq!(message, "connection reset (at e0)");
    }

    #[tokio::test(start_paused = true)]
    async fn the_run_sees_an_endpoints_failure_only_when_no_other_takes_calls() {
        let p = pool(&[100, 100]);
        let rejected = ModelError::new(ErrorKind::Auth, "API key not valid");
        let (_, absorbed) = p.learn(0, Err(&rejected)).unwrap();
        assert_eq!(absorbed, Absorbed::Left, "the other endpoint takes calls");
        assert_eq!(p.status()[0].health, EndpointHealth::Dead);
        let (e, absorbed) = p.learn(1, Err(&rejected)).unwrap();
        assert_eq!(absorbed, Absorbed::No, "no endpoint is left: the run's stop rules decide");
        assert_eq!(e.kind, ErrorKind::Auth);
        // Said for every endpoint, not the last alone; and final, even for an error that one
        // endpoint would try again (a token that could not be fetched): found by an outside
        // tester, a batch run's first record waited ten minutes for a dead pool.
        assert!(e.message.contains("e0: dead: credentials rejected; e1: dead: credentials rejected"), "{}", e.message);
        assert_eq!(e.hint, RetryHint::StopRun);
        let t = pool(&[100, 100]);
        let token = ModelError::new(ErrorKind::Auth, "no credentials").with_hint(RetryHint::Backoff);
        t.learn(0, Err(&token));
        assert_eq!(t.learn(1, Err(&token)).unwrap().0.hint, RetryHint::StopRun);
        // A request's own fault is never absorbed.
        let q = pool(&[100, 100]);
        let bad = ModelError::new(ErrorKind::BadRequest, "bad");
        assert_eq!(q.learn(0, Err(&bad)).unwrap().1, Absorbed::No);
        // Server errors cool an endpoint after a run of them, not after one.
        let server = ModelError::new(ErrorKind::Server, "500");
        for _ in 1..FAILURES_TO_COOL {
            assert_eq!(q.learn(0, Err(&server)).unwrap().1, Absorbed::Elsewhere);
            assert_eq!(q.status()[0].health, EndpointHealth::Active);
        }
        q.learn(0, Err(&server));
        assert_eq!(q.status()[0].health, EndpointHealth::CoolingDown);
        // Beside endpoints that are all dead, failures do not cool one: they are the records'
        // errors, tried again after their backoff as at a lone endpoint.
        let r = pool(&[100, 100]);
        r.learn(1, Err(&rejected));
        let timeout = ModelError::new(ErrorKind::Timeout, "no answer in 5 s");
        for _ in 0..FAILURES_TO_COOL * 2 {
            let (e, absorbed) = r.learn(0, Err(&timeout)).unwrap();
            assert_eq!((absorbed, e.kind, e.hint), (Absorbed::No, ErrorKind::Timeout, timeout.hint));
        }
        assert_eq!(r.status()[0].health, EndpointHealth::Active);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_waiting_on_an_endpoint_that_cools_down_choose_again() {
        // Both endpoints' windows are full; a call waits on both. The first is cooled down: the
        // call is admitted by the second when its window opens, not by the first.
        let p = Arc::new(Pool::new(vec![
            PoolMember { throttle: throttle(Some(1)), endpoint: "a".into(), weight: 1.0 },
            PoolMember { throttle: throttle(Some(1)), endpoint: "b".into(), weight: 1.0 },
        ]));
        let never = CancellationToken::new();
        for _ in 0..2 {
            p.admit(Weight::default(), &never).await.unwrap().1.finish(Ok(Default::default()));
        }
        let waiting = tokio::spawn({
            let p = p.clone();
            async move {
                let never = CancellationToken::new();
                let (i, a) = p.admit(Weight::default(), &never).await.unwrap();
                a.finish(Ok(Default::default()));
                i
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        p.learn(0, Err(&ModelError::new(ErrorKind::Auth, "key revoked")));
        assert_eq!(waiting.await.unwrap(), 1);
    }
}
