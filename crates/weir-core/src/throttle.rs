//! The throttle of one endpoint: everything that decides *when* a call may start, shared by every
//! task that calls the same endpoint with the same key.
//!
//! In the order a call meets them: the [`Gate`] (a pause the server asked for), the concurrency
//! limit (fixed or adaptive, see [`crate::limit`]), the optional SRE client-side throttler
//! ([`SreThrottler`], Beam's `AdaptiveThrottler` with a window that remembers), and the rate
//! budgets ([`RateLimiter`], requests and tokens per window, given or learned).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{ErrorKind, ModelError, QuotaScope, RetryHint};
use crate::limit::{Adaptive, AdaptiveLimit, CallResult, ConcurrencyLimit, FixedLimit, Gate, Permit};
use crate::outcome::{LimitInfo, ModelResponse, Usage};
use crate::rate::{Budget, Mode};

/// How an endpoint's [`Throttle`] is set up.
#[derive(Debug, Clone, PartialEq)]
pub struct ThrottleSettings {
    /// Most calls in flight.
    pub max_concurrency: usize,
    /// Find the concurrency the endpoint takes (else always `max_concurrency`).
    pub adaptive: bool,
    /// Rate budgets: given limits, and whether to learn them.
    pub rate: RateSettings,
    /// Beam's SRE client-side throttler with this overload ratio, when wanted.
    pub sre_k: Option<f64>,
    /// Where the throttle meets the other processes that call the same endpoint with the same
    /// key, so that together they keep to its quota.
    pub store: QuotaStore,
}

impl Default for ThrottleSettings {
    fn default() -> Self {
        Self {
            max_concurrency: 64,
            adaptive: true,
            rate: RateSettings::default(),
            sre_k: None,
            store: QuotaStore::Local,
        }
    }
}

/// Where processes that share an endpoint's quota coordinate (`--quota-store`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum QuotaStore {
    /// Through this machine alone: the processes of this user that call the same endpoint with
    /// the same key share one throttle, held by one of them (see weir-runtime's `share`).
    #[default]
    Local,
    /// Through a weir cluster's scheduler: every executor of the cluster that calls the same
    /// endpoint with the same key, on whichever machine, shares one throttle the scheduler
    /// keeps (executors only; see weir-runtime's `share`).
    Cluster,
    /// Through the Redis server at this URL (`redis://` on this machine, `rediss://` elsewhere):
    /// processes on any machine that name it and call the same endpoint with the same key share
    /// one throttle, held by one of them.
    Redis(String),
    /// No coordination: this process learns and keeps the quota alone.
    Off,
}

/// A call admitted by a shared throttle in another process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    /// The admission's number, to report the call's result with.
    pub id: u64,
    /// How long the shared throttle held the call.
    pub waited: Duration,
    /// The shared throttle's concurrency limit.
    pub concurrency: usize,
    /// The shared throttle's rate limits.
    pub rates: RateSnapshot,
    /// Processes sharing it now, its holder included.
    pub processes: usize,
}

/// How an endpoint's quota was shared with other processes, as seen from this one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sharing {
    /// The most processes that shared the quota at once (1: this one alone).
    pub processes: usize,
    /// This process was deciding alone when asked, having lost the others (its quota store
    /// could not be reached, or the holder stopped answering).
    pub alone_now: bool,
    /// At the end, the quota store could not be reached and only the processes on this machine
    /// shared the quota (they meet through it meanwhile; see `--quota-store`).
    pub machine_only: bool,
}

/// A throttle that another process holds for this one: when several processes call one
/// endpoint with one key, one of them keeps the endpoint's throttle and the others ask it
/// for every call, so that together they behave as one client (one learned quota, one
/// concurrency limit, one advised pause). The transport is the runtime's business.
pub trait Delegate: Send + Sync {
    /// Waits until the shared throttle admits a call of `weight`. `None`: it is gone (its
    /// process ended), and this process's own throttle decides.
    fn admit(&self, weight: Weight) -> futures::future::BoxFuture<'static, Option<Grant>>;
    /// Reports how an admitted call went, and how long it took (to first token, when streamed).
    fn finish(&self, grant: u64, result: Result<(Usage, Option<LimitInfo>), &ModelError>, latency: Duration);
    /// An admitted call ended unreported (cancelled): the shared throttle keeps it counted.
    fn abandon(&self, grant: u64);
    /// Whether the shared throttle can still be asked (its process and the way to it live).
    fn is_open(&self) -> bool;
    /// Tells the shared throttle that `n` calls of this process, admitted by one that went
    /// away, are still in flight: it counts them against its concurrency until each
    /// [`Delegate::landed`].
    fn carry(&self, n: usize);
    /// One of the calls [`Delegate::carry`] told of ended.
    fn landed(&self);
}

/// The admission control of one endpoint (one URL and key), shared through an `Arc` by every
/// task, record, batch or front end that calls it, so that together they stay within what the
/// endpoint allows.
///
/// A call is admitted in this order: the server-advised pause ([`Gate`]), the SRE throttler,
/// the rate budgets (requests and estimated tokens), and last a concurrency slot — so a call
/// waiting for budget holds no slot, and the concurrency in force is the number of calls
/// really on the wire. The throttle knows nothing of records, files or runs.
pub struct Throttle {
    gate: Gate,
    limit: Arc<dyn ConcurrencyLimit>,
    rate: RateLimiter,
    sre: Option<Mutex<SreThrottler>>,
    throttled_micros: AtomicU64,
    /// Time the call holding the turn spent held by the pause and the budgets, summed (one
    /// call holds the turn at a time, so this is wall time): a call waiting for its turn was
    /// held for the part of its wait this grew by.
    turn_held_micros: AtomicU64,
    /// Where admissions are decided: here, or by a shared throttle another process holds.
    route: std::sync::RwLock<Route>,
    /// Told whenever the route changes.
    delegate_changed: Notify,
    /// Calls wait for the budgets one at a time, taking turns: in the order they came within
    /// one process, and round the processes this throttle serves, so that processes sharing a
    /// quota share it evenly whichever asked first.
    turns: Mutex<Turns>,
    /// The shared throttle's limits, as its last grant told them.
    shared_view: Mutex<Option<(usize, RateSnapshot)>>,
    /// Calls this throttle admitted (for processes it serves as well as its own).
    admitted: AtomicU64,
    /// Calls this throttle admitted that are in flight (its process's and those it serves).
    in_flight: std::sync::atomic::AtomicUsize,
    /// Slots set aside when this throttle took a shared quota over, for calls the last holder
    /// admitted that are still in flight, until their processes say how many are theirs
    /// ([`Throttle::borrow_slots`]) or a grace period ends.
    unclaimed: Mutex<usize>,
    /// The most processes seen sharing the quota at once.
    most_processes: std::sync::atomic::AtomicUsize,
    /// The processes sharing the quota through this throttle or the one it asks, as last seen.
    processes_now: std::sync::atomic::AtomicUsize,
    /// The processes this throttle decides for, itself included, while the quota store cannot
    /// be reached (see [`Throttle::store_lost`]).
    served: std::sync::atomic::AtomicUsize,
    /// This process's calls that another process's throttle admitted within the told window,
    /// when they went and their tokens (kept only under a told limit): counted against this
    /// one's part when it comes to decide on it.
    sent_elsewhere: Mutex<std::collections::VecDeque<(Instant, u64)>>,
    /// How many processes shared the quota through the quota store when it was last lost, until
    /// the whole told limit is back (0: the store works, or was never reached). See
    /// [`Throttle::store_lost`].
    shared_among: std::sync::atomic::AtomicUsize,
    /// The quota store is lost now (see [`Throttle::store_lost`]).
    lost: std::sync::atomic::AtomicBool,
    /// Deciding alone because the quota store failed (see [`Throttle::set_sole`]).
    alone: std::sync::atomic::AtomicBool,
    /// See [`Sharing::machine_only`].
    machine_only: std::sync::atomic::AtomicBool,
    /// Why the quota could not be shared with the other processes that call the endpoint (a
    /// meeting directory weir cannot use, a store it cannot reach), for the summary.
    unshared: Mutex<Option<String>>,
    /// Calls of this process in flight that a shared throttle admitted, by a number of their
    /// own, with the throttle that admitted them.
    remote_calls: Mutex<RemoteCalls>,
    /// Calls in flight whose shared throttle went away, as counted by whoever decides now: set
    /// aside here (`None`) or told to the shared throttle followed now.
    carried: Mutex<(usize, Option<Arc<dyn Delegate>>)>,
    /// Set once this process has said that the shared throttle keeps other limits than it was
    /// told.
    warned_limits: std::sync::atomic::AtomicBool,
    /// This process's calls held now by the pause, the SRE throttler or the budgets, or waiting
    /// at another process's shared throttle (see [`Throttle::held_now`]).
    held: std::sync::atomic::AtomicUsize,
    /// The call holding the turn is held by the budgets: the calls queued behind it are too.
    turn_held: std::sync::atomic::AtomicBool,
}

/// Counts a call in a gauge while it lives (a call cancelled while held is counted out too).
pub(crate) struct Counted<'a>(Option<&'a std::sync::atomic::AtomicUsize>);

impl<'a> Counted<'a> {
    /// Counts in `gauge`, or nowhere when `count` is false.
    pub(crate) fn new(gauge: &'a std::sync::atomic::AtomicUsize, count: bool) -> Self {
        if count {
            gauge.fetch_add(1, Relaxed);
        }
        Self(count.then_some(gauge))
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.0 {
            g.fetch_sub(1, Relaxed);
        }
    }
}

/// Calls in flight that a shared throttle admitted: the last number given, and each call's
/// throttle by its number.
type RemoteCalls = (u64, HashMap<u64, Arc<dyn Delegate>>);

/// Where a throttle's admissions are decided.
#[derive(Clone)]
enum Route {
    /// By this throttle.
    Here,
    /// The runtime is looking for the shared throttle (since then: at start, or after its
    /// holder went); calls wait for it rather than go alone.
    Finding(Instant),
    /// By the shared throttle another process holds.
    There(Arc<dyn Delegate>),
}

/// Calls waiting their turn for the budgets, by process.
#[derive(Debug, Default)]
struct Turns {
    /// A call holds the turn.
    busy: bool,
    /// The process whose call had the turn last.
    last: u64,
    /// Each process's calls waiting, in the order they came.
    queues: std::collections::BTreeMap<u64, std::collections::VecDeque<tokio::sync::oneshot::Sender<()>>>,
}

/// The turn to wait for the budgets; passed on when dropped.
struct Turn<'a>(&'a Throttle);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.pass_turn();
    }
}

/// The longest calls wait for the runtime to find an endpoint's shared throttle before this
/// process's own decides.
pub const DECIDING_AT_MOST: Duration = Duration::from_secs(2);

/// How long a call rejected by the SRE throttler waits before asking again.
const SRE_DELAY: Duration = Duration::from_millis(500);

/// A call's cost to the endpoint: one request, and an estimate of the tokens it will count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Weight {
    /// Estimated tokens (prompt plus expected output), corrected by the answer's usage.
    pub tokens: u64,
}

/// Push-back that says the endpoint is over capacity (for the concurrency limit), as opposed to a
/// quota (for the rate budgets): a 503, or a 429 that names no quota and advises no delay.
pub fn is_pushback(e: &ModelError) -> bool {
    e.status == Some(503) || (e.kind == ErrorKind::RateLimited && e.quota.is_none() && e.retry_after().is_none())
}

/// A call admitted by a [`Throttle`]: it holds a concurrency slot and a place in the budgets
/// until [`Admitted::finish`] reports how the call went (dropping it unreported frees both, as
/// a call that failed without an answer).
pub struct Admitted<'a> {
    throttle: &'a Throttle,
    permit: Option<Permit>,
    level: usize,
    ticket: Option<Ticket>,
    /// Admitted by a shared throttle in another process: where to report, the grant's number
    /// there, and the call's number here (in `Throttle::remote_calls`).
    remote: Option<(Arc<dyn Delegate>, u64, u64)>,
    sent: Instant,
    /// Time the call was held by a server-advised pause, the SRE throttler and the budgets
    /// (not counting the wait for a concurrency slot).
    pub waited: Duration,
    /// A slot of a pool's cap on the run's calls in flight at all its endpoints together
    /// (see [`Pool`](crate::Pool)), freed with the call.
    run_slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Throttle {
    /// A throttle with the given settings.
    pub fn new(settings: &ThrottleSettings) -> Self {
        let limit: Arc<dyn ConcurrencyLimit> = if settings.adaptive {
            Arc::new(Adaptive(AdaptiveLimit::new(16, settings.max_concurrency)))
        } else {
            Arc::new(FixedLimit::new(settings.max_concurrency))
        };
        Self {
            gate: Gate::default(),
            limit,
            // With a quota store on, every process here that shares the quota goes through one
            // throttle.
            rate: RateLimiter::with_clients(settings.rate.clone(), settings.store != QuotaStore::Off),
            sre: settings.sre_k.map(|k| Mutex::new(SreThrottler::new(k, settings.rate.window, 0x5e))),
            throttled_micros: AtomicU64::new(0),
            turn_held_micros: AtomicU64::new(0),
            route: std::sync::RwLock::new(Route::Here),
            delegate_changed: Notify::new(),
            turns: Mutex::new(Turns::default()),
            shared_view: Mutex::new(None),
            admitted: AtomicU64::new(0),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            unclaimed: Mutex::new(0),
            most_processes: std::sync::atomic::AtomicUsize::new(1),
            processes_now: std::sync::atomic::AtomicUsize::new(1),
            served: std::sync::atomic::AtomicUsize::new(1),
            sent_elsewhere: Mutex::default(),
            shared_among: std::sync::atomic::AtomicUsize::new(0),
            lost: std::sync::atomic::AtomicBool::new(false),
            alone: std::sync::atomic::AtomicBool::new(false),
            machine_only: std::sync::atomic::AtomicBool::new(false),
            unshared: Mutex::new(None),
            remote_calls: Mutex::default(),
            warned_limits: std::sync::atomic::AtomicBool::new(false),
            carried: Mutex::new((0, None)),
            held: std::sync::atomic::AtomicUsize::new(0),
            turn_held: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// This process's calls held for the quota now: by a pause the server advised, the SRE
    /// throttler or the budgets (queued behind a call the budgets hold included), or waiting at
    /// the shared throttle of another process. A wait for a concurrency slot is not counted:
    /// that is the endpoint's pace. What the progress line and `/metrics` show, so that a run
    /// whose calls the quota holds (a full per-minute window, a scout's wait) does not look hung.
    pub fn held_now(&self) -> usize {
        let queued = if self.turn_held.load(Relaxed) {
            self.turns.lock().unwrap_or_else(|e| e.into_inner()).queues.get(&0).map_or(0, |q| q.len())
        } else {
            0
        };
        self.held.load(Relaxed) + queued
    }

    /// Says whether every process here that shares this quota goes through this throttle: true
    /// while its quota store works (it holds the quota, or has it held for it), false while the
    /// store cannot be reached and the processes each decide alone. Only a throttle every call
    /// goes through may read a refusal as the quota's own window (see [`crate::rate::Budget::sole`]).
    pub fn set_sole(&self, sole: bool) {
        self.rate.set_sole(sole);
        self.alone.store(!sole, Relaxed);
    }

    /// Says whether only the processes on this machine share the quota now, its store not
    /// reached (see [`Sharing::machine_only`]).
    pub fn set_machine_only(&self, yes: bool) {
        self.machine_only.store(yes, Relaxed);
    }

    /// Says the quota cannot be shared with other processes, and why: this process decides
    /// alone, and its summary says so (a warning at the start scrolls away).
    pub fn set_unshared(&self, why: String) {
        self.set_sole(false);
        *self.unshared.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    /// Why the quota could not be shared, if it could not.
    pub fn unshared(&self) -> Option<String> {
        self.unshared.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Says how many processes this throttle serves, itself included (set by the process that
    /// holds an endpoint's shared throttle, as others join and leave).
    pub fn set_processes(&self, n: usize) {
        self.most_processes.fetch_max(n, Relaxed);
        self.processes_now.store(n, Relaxed);
    }

    /// Says how many processes this throttle decides for now, itself included (set by the
    /// process that holds the quota, as others join and leave): while the quota store cannot
    /// be reached, its part of a told limit (see [`Throttle::store_lost`]).
    pub fn set_served(&self, n: usize) {
        self.set_processes(n);
        self.served.store(n.max(1), Relaxed);
        self.apply_part();
    }

    /// Says the quota store has just been lost: of a told limit, this throttle keeps the part
    /// of the processes that shared the quota through the store that it decides for (itself, or
    /// the processes of this machine while it holds the quota here). The told limit is the
    /// key's, and processes on other machines keep their parts meanwhile (three runs on three
    /// machines, each told 60 per 5 s, sent 100 a window between them, the server's cap, while
    /// Redis was down). Said again while lost, it changes nothing.
    pub fn store_lost(&self) {
        if !self.lost.swap(true, Relaxed) {
            // From now on, itself and whoever it comes to serve here. (Only those: a process
            // that follows a holder again when the store is back keeps its part, or the calls
            // still deciding here as it does would take the rest at once.)
            self.served.store(1, Relaxed);
            // At least as many as when it was lost before, unless the whole came back since: a
            // store back for a moment (a hung Redis killed, answering what it held first) left
            // a process that had just taken its lease counting only itself, and it kept the
            // whole told limit beside the others' parts (100 in 5 s for 60).
            let before = self.shared_among.load(Relaxed);
            self.shared_among.store(self.processes_now.load(Relaxed).max(before).max(1), Relaxed);
            // What the holder admitted of this process's calls is in the window: against its
            // part (else three runs apart, each with a third of 60 free, sent 40 beside the 31
            // the holder had let out).
            let sent: Vec<_> = self.sent_elsewhere.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
            self.rate.note_sent(&sent);
            self.apply_part();
        }
    }

    /// Says the quota store can be reached again: the part grows as the processes join the
    /// holder (see [`Throttle::set_served`]) until [`Throttle::whole_again`]. Returns whether
    /// it was lost.
    pub fn store_back(&self) -> bool {
        self.lost.swap(false, Relaxed)
    }

    /// The whole told limit again, once the sends made apart while the store was lost have left
    /// its window (unless it was lost again since). Giving it back as soon as the store was back
    /// sent 118 in one second for a told 60 per 5 s: each process's calls still deciding for
    /// themselves took the rest.
    pub fn whole_again(&self) {
        if !self.lost.load(Relaxed) {
            self.shared_among.store(0, Relaxed);
            self.apply_part();
        }
    }

    /// Keeps a call another process's throttle admitted now, under a told limit, for the told
    /// window (see [`Throttle::store_lost`]).
    fn note_sent_elsewhere(&self, weight: Weight) {
        let told = self.rate.told();
        if told.requests.is_none() && told.tokens.is_none() {
            return;
        }
        let now = Instant::now();
        let mut sent = self.sent_elsewhere.lock().unwrap_or_else(|e| e.into_inner());
        while sent.front().is_some_and(|&(at, _)| now.duration_since(at) > told.window * 2) {
            sent.pop_front();
        }
        sent.push_back((now, weight.tokens));
    }

    /// Gives the rate limiter its part (see [`Throttle::store_lost`]).
    fn apply_part(&self) {
        let among = self.shared_among.load(Relaxed);
        let part = if among == 0 { 1.0 } else { self.served.load(Relaxed) as f64 / among as f64 };
        self.rate.set_part(part.min(1.0));
    }

    /// Calls this throttle has admitted in all (its own process's and, when it serves others,
    /// theirs).
    pub fn admitted(&self) -> u64 {
        self.admitted.load(Relaxed)
    }

    /// How the quota was shared, as this process saw it.
    pub fn sharing(&self) -> Sharing {
        Sharing {
            processes: self.most_processes.load(Relaxed),
            alone_now: self.alone.load(Relaxed),
            machine_only: self.machine_only.load(Relaxed),
        }
    }

    /// Defers every admission to `delegate` (a shared throttle another process holds), or, with
    /// `None`, decides here again.
    pub fn delegate_to(&self, delegate: Option<Arc<dyn Delegate>>) {
        // This process's calls still in flight that a shared throttle now gone admitted count
        // against whoever decides from now on, until they end: else a throttle taking over
        // would admit a full limit of new calls beside them, and a hidden cap refuse the excess.
        let orphans = self.orphans();
        {
            let mut carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
            *carried = match &delegate {
                _ if orphans == 0 => (0, None),
                Some(d) => {
                    d.carry(orphans);
                    (orphans, Some(d.clone()))
                }
                None => (self.limit.borrow(orphans), None),
            };
        }
        let route = match delegate {
            Some(d) => Route::There(d),
            None => {
                *self.shared_view.lock().unwrap_or_else(|e| e.into_inner()) = None;
                // Deciding here from now on: what this one is handed counts those calls.
                self.sent_elsewhere.lock().unwrap_or_else(|e| e.into_inner()).clear();
                Route::Here
            }
        };
        self.reroute(route);
    }

    /// This process's calls in flight whose shared throttle went away.
    fn orphans(&self) -> usize {
        let calls = self.remote_calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.1.values().filter(|d| !d.is_open()).count()
    }

    /// A call admitted by a shared throttle ended: if that throttle went away meanwhile, the
    /// one deciding now no longer counts it.
    fn remote_ended(&self, call: u64) {
        let Some(d) = self.remote_calls.lock().unwrap_or_else(|e| e.into_inner()).1.remove(&call) else { return };
        if d.is_open() {
            return;
        }
        let mut carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        if carried.0 == 0 {
            return;
        }
        carried.0 -= 1;
        match &carried.1 {
            Some(now) => now.landed(),
            None => self.limit.repay(1),
        }
    }

    /// Sets `n` concurrency slots aside for calls in flight that another process's shared
    /// throttle admitted before it went (that process now asks this one); returns how many.
    pub fn borrow_slots(&self, n: usize) -> usize {
        let claimed = {
            let mut unclaimed = self.unclaimed.lock().unwrap_or_else(|e| e.into_inner());
            let c = n.min(*unclaimed);
            *unclaimed -= c;
            c
        };
        claimed + self.limit.borrow(n - claimed)
    }

    /// Calls in flight as far as this throttle's concurrency goes: those it admitted, and those
    /// it set slots aside for (to write down for the next holder).
    pub fn in_flight(&self) -> usize {
        let carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        let set_aside = if carried.1.is_none() { carried.0 } else { 0 };
        self.in_flight.load(Relaxed) + set_aside + *self.unclaimed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Taking a shared quota over from a holder that had `in_flight` calls in flight: the ones
    /// that are not this process's own are set aside at once (their processes reconnect and
    /// claim theirs with [`Throttle::borrow_slots`] a moment later, while this one's waiting
    /// calls would go at once); what is unclaimed after `grace` is given back.
    pub fn take_over_in_flight(self: &Arc<Self>, in_flight: usize, grace: Duration) {
        let own = self.orphans();
        let others = in_flight.saturating_sub(own);
        if others == 0 {
            return;
        }
        let set_aside = self.limit.borrow(others);
        *self.unclaimed.lock().unwrap_or_else(|e| e.into_inner()) += set_aside;
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            if let Some(t) = me.upgrade() {
                let left = std::mem::take(&mut *t.unclaimed.lock().unwrap_or_else(|e| e.into_inner()));
                t.repay_slots(left);
            }
        });
    }

    /// Gives back slots set aside by [`Throttle::borrow_slots`].
    pub fn repay_slots(&self, n: usize) {
        if n > 0 {
            self.limit.repay(n);
        }
    }

    /// What the concurrency limit learned (see [`ConcurrencyLimit::export`]).
    pub fn export_concurrency(&self) -> Option<(usize, Option<usize>)> {
        self.limit.export()
    }

    /// Goes on from a concurrency limit another process learned.
    pub fn seed_concurrency(&self, limit: usize, ceiling: Option<usize>) {
        self.limit.seed(limit, ceiling);
    }

    fn reroute(&self, route: Route) {
        *self.route.write().unwrap_or_else(|e| e.into_inner()) = route;
        self.delegate_changed.notify_waiters();
    }

    /// Says the runtime is looking for the shared throttle (at start, or after its holder
    /// went): calls wait, up to [`DECIDING_AT_MOST`], until [`Throttle::delegate_to`] says
    /// where they are decided, instead of each going alone in a burst the quota would refuse.
    pub fn await_delegate(&self) {
        self.reroute(Route::Finding(Instant::now()));
    }

    /// Estimates the tokens of a call with `prompt_chars` characters of input.
    pub fn estimate(&self, prompt_chars: usize, max_output: Option<u32>) -> Weight {
        Weight { tokens: self.rate.estimate(prompt_chars, max_output) }
    }

    /// The tokens of a call whose input is known to be `prompt_tokens` (counted by the model's
    /// tokenizer), plus its expected output.
    pub fn estimate_counted(&self, prompt_tokens: u64, max_output: Option<u32>) -> Weight {
        Weight { tokens: prompt_tokens + self.rate.estimate(0, max_output) }
    }

    /// Waits until a call of `weight` may start; `None` if `cancel` fires first.
    pub async fn admit(&self, weight: Weight, cancel: &CancellationToken) -> Option<Admitted<'_>> {
        self.admit_for(0, weight, cancel).await
    }

    /// As [`Throttle::admit`], for a call of process `member` (0: this one; the runtime numbers
    /// the processes this throttle serves): processes with calls waiting take turns.
    pub async fn admit_for(&self, member: u64, weight: Weight, cancel: &CancellationToken) -> Option<Admitted<'_>> {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            a = self.admit_inner(member, weight) => Some(a),
        }
    }

    /// Waits for `member`'s turn to wait for the budgets.
    async fn turn(&self, member: u64) -> Turn<'_> {
        let rx = {
            let mut t = self.turns.lock().unwrap_or_else(|e| e.into_inner());
            if !t.busy {
                t.busy = true;
                t.last = member;
                return Turn(self);
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            t.queues.entry(member).or_default().push_back(tx);
            rx
        };
        // A call cancelled while it waits must not take a turn handed to it along: it passes it
        // on.
        struct Waiting<'a>(Option<tokio::sync::oneshot::Receiver<()>>, &'a Throttle);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                if let Some(mut rx) = self.0.take() {
                    rx.close();
                    if rx.try_recv().is_ok() {
                        self.1.pass_turn();
                    }
                }
            }
        }
        let mut waiting = Waiting(Some(rx), self);
        // Handed the turn by the call before (a dropped sender means the throttle is gone,
        // which cannot happen while `self` is borrowed).
        let _ = waiting.0.as_mut().expect("set above").await;
        waiting.0 = None;
        Turn(self)
    }

    /// Passes the turn on: to the next process after the last one served that has a call
    /// waiting, round the processes.
    fn pass_turn(&self) {
        // The next call has not met the budgets yet (one cancelled while held left this set).
        self.turn_held.store(false, Relaxed);
        let mut t = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let next = t
                .queues
                .range(t.last + 1..)
                .chain(t.queues.range(..=t.last))
                .find(|(_, q)| !q.is_empty())
                .map(|(&m, _)| m);
            let Some(member) = next else {
                t.busy = false;
                t.queues.clear();
                return;
            };
            let q = t.queues.get_mut(&member).expect("found above");
            let tx = q.pop_front().expect("not empty");
            if q.is_empty() {
                t.queues.remove(&member);
            }
            // A call that stopped waiting (cancelled) passes its turn on at once — to its own
            // process's next call: the turn is the process's, not the call's. (Moving on to the
            // next process here, a follower whose 200 waiting calls were cancelled when the
            // holder it asked changed lost 200 turns, and no call of its went for 10 s.)
            if tx.send(()).is_ok() {
                t.last = member;
                return;
            }
        }
    }

    /// Warns, once, when this process was told limits (`--rpm`, `--tpm`, `--limit-window`) that
    /// the shared throttle admitting its calls does not keep: the process that holds a shared
    /// quota decides with the limits it was told, and a user who gave this one others should
    /// know which are in force.
    fn check_told(&self, shared: &RateSnapshot) {
        // Every admitted call of a follower comes here: once said, nothing more to compare.
        if self.warned_limits.load(Relaxed) {
            return;
        }
        let told = self.rate.told();
        let differs = |mine: Option<u64>, theirs: Option<(f64, Duration, bool)>| match (mine, theirs) {
            (None, _) => false,
            (Some(n), Some((c, w, false))) => n as f64 != c || w != told.window,
            (Some(_), _) => true,
        };
        if (differs(told.requests, shared.requests) || differs(told.tokens, shared.tokens))
            && !self.warned_limits.swap(true, Relaxed)
        {
            let show = |l: Option<(f64, Duration, bool)>, what: &str| match l {
                Some((c, w, learned)) => {
                    format!("{c:.0} {what} per {:.0} s{}", w.as_secs_f64(), if learned { " (learned)" } else { "" })
                }
                None => format!("no {what} limit"),
            };
            let mine = |n: Option<u64>| n.map(|n| (n as f64, told.window, false));
            tracing::warn!(
                "this process was told {} and {}, but the process holding the shared quota keeps {} and {}: \
                 those are in force for every process that shares it while it holds the quota (a process that takes \
                 the quota over when it ends keeps its own). Give them all the same --rpm/--tpm/--limit-window, \
                 or --quota-store off to keep this one apart",
                show(mine(told.requests), "requests"),
                show(mine(told.tokens), "tokens"),
                show(shared.requests, "requests"),
                show(shared.tokens, "tokens"),
            );
        }
    }

    async fn admit_inner(&self, member: u64, weight: Weight) -> Admitted<'_> {
        let start = Instant::now();
        // When the shared throttle this call last asked was found gone, and which it was.
        let mut lost: Option<(Instant, Arc<dyn Delegate>)> = None;
        loop {
            let changed = self.delegate_changed.notified();
            let route = self.route.read().unwrap_or_else(|e| e.into_inner()).clone();
            let d = match route {
                Route::Here => break,
                Route::Finding(since) if since.elapsed() >= DECIDING_AT_MOST => break,
                Route::Finding(_) => {
                    let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
                    continue;
                }
                Route::There(d) => d,
            };
            let waiting = Counted::new(&self.held, member == 0);
            let granted = d.admit(weight).await;
            drop(waiting);
            if let Some(g) = granted {
                self.note_sent_elsewhere(weight);
                self.check_told(&g.rates);
                *self.shared_view.lock().unwrap_or_else(|e| e.into_inner()) = Some((g.concurrency, g.rates));
                self.most_processes.fetch_max(g.processes, Relaxed);
                self.processes_now.store(g.processes, Relaxed);
                self.throttled_micros.fetch_add(g.waited.as_micros() as u64, Relaxed);
                let call = {
                    let mut calls = self.remote_calls.lock().unwrap_or_else(|e| e.into_inner());
                    calls.0 += 1;
                    let n = calls.0;
                    calls.1.insert(n, d.clone());
                    n
                };
                return Admitted {
                    throttle: self,
                    permit: None,
                    level: 0,
                    ticket: None,
                    remote: Some((d, g.id, call)),
                    sent: Instant::now(),
                    waited: g.waited,
                    run_slot: None,
                };
            }
            // The shared throttle is gone: ask the next one the runtime finds (or this one, if
            // it takes the quota over) — unless none is found in time (the runtime that looked
            // for it has ended): then this process decides alone.
            // Timed from when this one was found gone, not from an earlier loss: a call that
            // waited its turn at the next throttle for longer than that went alone at once
            // when that one went too (the quota's holder on this machine, handing it back to
            // Redis: 16 calls beside the 60 the holder had let out).
            let since = match &lost {
                Some((at, gone)) if Arc::ptr_eq(gone, &d) => *at,
                _ => Instant::now(),
            };
            lost = Some((since, d));
            if since.elapsed() >= DECIDING_AT_MOST {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
        }
        // Decided here — unless, while the call waits, another process's throttle comes to
        // decide for this one (it holds the quota now, or answers again): then the call asks
        // that one, instead of going out beside every call it admits.
        tokio::select! {
            a = self.admit_here(member, weight, start) => a,
            () = self.routed_elsewhere() => Box::pin(self.admit_inner(member, weight)).await,
        }
    }

    /// Returns once another process's throttle decides this one's calls.
    async fn routed_elsewhere(&self) {
        loop {
            let changed = self.delegate_changed.notified();
            if matches!(*self.route.read().unwrap_or_else(|e| e.into_inner()), Route::There(_)) {
                return;
            }
            changed.await;
        }
    }

    /// Admits a call of `member`'s by this throttle's own limits (`start`: when it asked).
    async fn admit_here(&self, member: u64, weight: Weight, start: Instant) -> Admitted<'_> {
        let own = member == 0;
        {
            let _held = Counted::new(&self.held, own);
            self.gate.wait().await;
            if let Some(sre) = &self.sre {
                while sre.lock().unwrap_or_else(|e| e.into_inner()).throttle(Instant::now()) {
                    tokio::time::sleep(SRE_DELAY).await;
                }
            }
        }
        let sre_held = start.elapsed();
        // A slot first, then the budgets — but a call the budgets turn away gives its slot back
        // while it waits, so waiting for budget never holds a slot, and the budgets count a
        // send only at the moment it really goes out.
        let mut held = Duration::ZERO;
        let before = self.turn_held_micros.load(Relaxed);
        let asked = Instant::now();
        let turn = self.turn(member).await;
        // Calls queued for their turn behind one the budgets held were held too (without this,
        // a process whose calls the holder of a shared quota admitted in turns with its own
        // saw none of its time throttled).
        // (A wait that began before this call came counts whole: no more than its own wait.)
        let queued =
            Duration::from_micros(self.turn_held_micros.load(Relaxed).saturating_sub(before)).min(asked.elapsed());
        let (permit, level, ticket) = loop {
            let (permit, level) = self.limit.acquire().await;
            // A pause the server asked for while this call waited for its slot holds it too.
            let t = Instant::now();
            let gated = Counted::new(&self.held, own);
            self.gate.wait().await;
            drop(gated);
            let changed = self.rate.changed.notified();
            match self.rate.try_acquire(weight.tokens) {
                Ok(ticket) => {
                    self.turn_held.store(false, Relaxed);
                    held += t.elapsed();
                    self.turn_held_micros.fetch_add(t.elapsed().as_micros() as u64, Relaxed);
                    break (permit, level, ticket);
                }
                Err(wake) => {
                    drop(permit);
                    let _held = Counted::new(&self.held, own);
                    self.turn_held.store(true, Relaxed);
                    tokio::select! {
                        _ = async {
                            match wake {
                                Some(at) => tokio::time::sleep_until(at).await,
                                None => std::future::pending().await,
                            }
                        } => {}
                        _ = changed => {}
                    }
                    held += t.elapsed();
                    self.turn_held_micros.fetch_add(t.elapsed().as_micros() as u64, Relaxed);
                }
            }
        };
        drop(turn);
        // Throttled time is what the pause, the SRE throttler and the budgets held the call; a
        // wait for a concurrency slot is the endpoint's pace, not throttling.
        let waited = held + sre_held + queued;
        self.throttled_micros.fetch_add(waited.as_micros() as u64, Relaxed);
        self.admitted.fetch_add(1, Relaxed);
        self.in_flight.fetch_add(1, Relaxed);
        Admitted {
            throttle: self,
            permit: Some(permit),
            level,
            ticket: Some(ticket),
            remote: None,
            sent: Instant::now(),
            waited,
            run_slot: None,
        }
    }

    /// The error to act on instead of `e`, if any: a 429, once every call for longer than
    /// [`crate::error::LONGEST_ADVISED_WAIT`] was refused and none admitted, stops the run (see
    /// [`ModelError::never_admitted`]). Until then the budget holds the calls and sends one
    /// scout at a time (no advice), or the server's short pauses do (advice): a quota of zero
    /// would hold them all in silence. (Refusals advising a few seconds each, on a quota that
    /// fell to zero, held a run 22 minutes until it was killed.)
    pub fn judge(&self, e: &ModelError) -> Option<ModelError> {
        if e.kind != ErrorKind::RateLimited {
            return None;
        }
        let advised = e.retry_after().is_some();
        let since = if advised { self.rate.refused_since() } else { self.rate.refused_blind_since() };
        let refused_for = since?.elapsed();
        (refused_for > crate::error::LONGEST_ADVISED_WAIT).then(|| e.clone().never_admitted(refused_for, advised))
    }

    /// Holds every new call for `delay` (a server-advised pause; never shortens one in force).
    pub fn hold(&self, delay: Duration) {
        self.gate.hold(delay);
    }

    /// The concurrency limit in force (the shared throttle's, while deferring to one).
    pub fn concurrency(&self) -> usize {
        match *self.shared_view.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((c, _)) => c,
            None => self.limit.current(),
        }
    }

    /// The rate limits in force (the shared throttle's, while deferring to one).
    pub fn rates(&self) -> RateSnapshot {
        match *self.shared_view.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((_, r)) => r,
            None => self.rate.snapshot(),
        }
    }

    /// The rate budgets, to hand over or take over a shared quota.
    pub fn rate_limiter(&self) -> &RateLimiter {
        &self.rate
    }

    /// Total time calls waited to be admitted (Beam's `cumulativeThrottlingSeconds`).
    pub fn throttled(&self) -> Duration {
        Duration::from_micros(self.throttled_micros.load(Relaxed))
    }
}

impl Admitted<'_> {
    /// The call also holds `slot` until it ends (a pool's cap on the run's calls in flight).
    pub(crate) fn holding(mut self, slot: Option<tokio::sync::OwnedSemaphorePermit>) -> Self {
        self.run_slot = slot;
        self
    }

    /// Reports how the call went (usage and rate-limit headers of an answer, or the error):
    /// frees the slot, corrects the budgets, and teaches the limits.
    pub fn finish(self, result: Result<(Usage, Option<LimitInfo>), &ModelError>) {
        self.finish_timed(result, None)
    }

    /// As [`finish`](Self::finish), teaching the concurrency limit `latency` instead of the
    /// time since admission: a streamed call reports its time to first token, which tracks the
    /// endpoint's load, where the whole call's time mostly tracks the answer's length.
    pub fn finish_timed(mut self, result: Result<(Usage, Option<LimitInfo>), &ModelError>, latency: Option<Duration>) {
        let latency = latency.unwrap_or_else(|| self.sent.elapsed());
        if let Some((d, id, call)) = self.remote.take() {
            // Another process's throttle keeps the budgets; whether this process's calls are
            // all refused is this one's to know (see `RateLimiter::refused_since`).
            self.throttle.rate.answered(result);
            d.finish(id, result, latency);
            self.throttle.remote_ended(call);
            return;
        }
        if self.permit.take().is_some() {
            self.throttle.in_flight.fetch_sub(1, Relaxed);
        }
        let t = self.throttle;
        if let Some(ticket) = self.ticket.take() {
            t.rate.complete_with(ticket, result);
        }
        let class = match result {
            Ok(_) => CallResult::Ok,
            Err(e) if is_pushback(e) => CallResult::Backpressure,
            Err(_) => CallResult::Other,
        };
        if let Some(sre) = &t.sre {
            if class != CallResult::Backpressure && !matches!(result, Err(e) if e.kind == ErrorKind::RateLimited) {
                sre.lock().unwrap_or_else(|e| e.into_inner()).accepted(Instant::now());
            }
        }
        t.limit.feedback(self.level, latency, class);
        if let Err(e) = result {
            // A server-advised pause holds every call.
            if let RetryHint::Later(Some(advised)) = e.hint {
                t.gate.hold(t.rate.pause_for(e, advised));
            }
        }
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        // Not reported (the call was cancelled): the server may have counted it, so the budgets
        // keep it; the slot is freed without teaching the concurrency limit anything.
        if let Some((d, id, call)) = self.remote.take() {
            d.abandon(id);
            self.throttle.remote_ended(call);
        }
        if self.permit.take().is_some() {
            self.throttle.in_flight.fetch_sub(1, Relaxed);
        }
        if let Some(ticket) = self.ticket.take() {
            let e = ModelError::new(ErrorKind::Aborted, "cancelled");
            self.throttle.rate.complete_with(ticket, Err(&e));
        }
    }
}

/// Static limits and options, from the command line.
#[derive(Debug, Clone, PartialEq)]
pub struct RateSettings {
    /// Requests per window, when known.
    pub requests: Option<u64>,
    /// Tokens per window, when known.
    pub tokens: Option<u64>,
    /// The window the limits are counted over (60 s for per-minute quotas).
    pub window: Duration,
    /// Learn limits from 429s and headers when none is given.
    pub learn: bool,
}

impl Default for RateSettings {
    fn default() -> Self {
        Self { requests: None, tokens: None, window: Duration::from_secs(60), learn: true }
    }
}

/// A send's place in the budgets; hand it back with the call's result.
#[derive(Debug)]
pub struct Ticket {
    id: u64,
    tokens: f64,
    /// Time spent waiting for the budgets.
    pub waited: Duration,
}

/// Requests and tokens per window.
#[derive(Debug)]
pub struct RateLimiter {
    state: Mutex<(Budget, Budget)>,
    settings: RateSettings,
    changed: Notify,
    next_id: AtomicU64,
    /// Mean output tokens of answers so far (to estimate a request's tokens before it is sent).
    mean_output: Mutex<(f64, u64)>,
    /// Set once a quota was learned from 429s that advised no wait, and the window assumed
    /// said (see [`RateLimiter::complete_with`]).
    said_window: std::sync::atomic::AtomicBool,
    /// Since when every call answered was refused for rate, none admitted (see
    /// [`Throttle::judge`]).
    refused_since: Mutex<Option<Instant>>,
}

/// What the rate limiter knows, for the summary.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RateSnapshot {
    /// Requests per window in force, if any, and whether it was learned.
    pub requests: Option<(f64, Duration, bool)>,
    /// Tokens per window in force, if any, and whether it was learned.
    pub tokens: Option<(f64, Duration, bool)>,
}

impl RateLimiter {
    /// The limits this limiter was told.
    pub fn told(&self) -> &RateSettings {
        &self.settings
    }

    /// A limiter with the given static limits.
    pub fn new(settings: RateSettings) -> Self {
        Self::with_clients(settings, false)
    }

    /// A limiter with the given static limits; `sole` when it is the only client of its quota
    /// that this process knows of (see [`Budget::sole`]).
    pub fn with_clients(settings: RateSettings, sole: bool) -> Self {
        let unlimited = || Budget::unlimited().with_default_window(settings.window).sole(sole);
        let req = settings.requests.map_or_else(unlimited, |r| Budget::fixed(r as f64, settings.window));
        let tok = settings.tokens.map_or_else(unlimited, |t| Budget::fixed(t as f64, settings.window));
        Self {
            state: Mutex::new((req, tok)),
            settings,
            changed: Notify::new(),
            next_id: AtomicU64::new(0),
            mean_output: Mutex::new((0.0, 0)),
            said_window: std::sync::atomic::AtomicBool::new(false),
            refused_since: Mutex::new(None),
        }
    }

    /// Counts sends of this process's that another process's throttle admitted, each at its
    /// moment with its tokens (see [`Budget::note_sent`]).
    pub fn note_sent(&self, sent: &[(Instant, u64)]) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for &(at, tokens) in sent {
            let id = self.next_id.fetch_add(1, Relaxed);
            s.0.note_sent(id, at, 1.0);
            s.1.note_sent(id, at, tokens as f64);
        }
    }

    /// Keeps `part` of each told limit (see [`Budget::set_part`]).
    pub fn set_part(&self, part: f64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0.set_part(part);
        s.1.set_part(part);
        drop(s);
        // Calls waiting may go, or wait longer.
        self.changed.notify_waiters();
    }

    /// Says whether this limiter is its quota's only client here (see [`Budget::sole`]).
    pub fn set_sole(&self, sole: bool) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0.set_sole(sole);
        s.1.set_sole(sole);
    }

    /// Estimates the tokens a request will be counted for: about four characters a token for the
    /// prompt, plus the output limit when one is set, else the mean output so far.
    pub fn estimate(&self, prompt_chars: usize, max_output: Option<u32>) -> u64 {
        let prompt = (prompt_chars as u64).div_ceil(4);
        let out = match max_output {
            Some(m) => u64::from(m),
            None => self.mean_output.lock().unwrap_or_else(|e| e.into_inner()).0.ceil() as u64,
        };
        prompt + out
    }

    /// Takes a place for a send of `tokens` now, if both budgets admit it; otherwise says when
    /// to try again (`None`: when some send completes).
    pub fn try_acquire(&self, tokens: u64) -> Result<Ticket, Option<Instant>> {
        let weight = tokens as f64;
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // Ids are taken under the lock, so each budget's log stays sorted by id.
        let id = self.next_id.fetch_add(1, Relaxed);
        match s.0.try_take(id, 1.0, now) {
            Ok(()) => match s.1.try_take(id, weight, now) {
                Ok(()) => Ok(Ticket { id, tokens: weight, waited: Duration::ZERO }),
                Err(wake) => {
                    // The token budget said no: the send does not happen.
                    s.0.forget(id);
                    Err(wake)
                }
            },
            Err(wake) => Err(wake),
        }
    }

    /// Waits until `wake` (or, with `None`, until some send completes), or until the budgets
    /// change, whichever comes first.
    pub async fn wait(&self, wake: Option<Instant>) {
        let changed = self.changed.notified();
        match wake {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = changed => {}
                }
            }
            None => changed.await,
        }
    }

    /// Waits until both budgets admit a send of `tokens`.
    pub async fn acquire(&self, tokens: u64) -> Ticket {
        let start = Instant::now();
        loop {
            // Registered before trying, so a change between the try and the wait is not missed.
            let changed = self.changed.notified();
            let wake = match self.try_acquire(tokens) {
                Ok(mut t) => {
                    t.waited = start.elapsed();
                    return t;
                }
                Err(wake) => wake,
            };
            match wake {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }

    /// Reports how the call went.
    pub fn complete(&self, ticket: Ticket, result: &Result<ModelResponse, ModelError>) {
        self.complete_with(ticket, result.as_ref().map(|r| (r.usage, r.limits)));
    }

    /// Marks the moment the call of `ticket` is really sent (after waiting for a concurrency
    /// slot), so the budgets free its slot one window after the server counted it, not earlier.
    pub fn sent(&self, ticket: &Ticket) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        s.0.restamp(ticket.id, now);
        s.1.restamp(ticket.id, now);
    }

    /// Reports how the call went: the usage and rate-limit headers of an answer, or the error.
    pub fn complete_with(&self, ticket: Ticket, result: Result<(Usage, Option<LimitInfo>), &ModelError>) {
        self.answered(result);
        {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            match result {
                Ok((usage, limits)) => {
                    let counted = if usage.total_tokens > 0 {
                        usage.total_tokens
                    } else {
                        usage.prompt_tokens + usage.output_tokens
                    };
                    s.0.admitted(ticket.id, 1.0);
                    s.1.admitted(ticket.id, if counted > 0 { counted as f64 } else { ticket.tokens });
                    if self.settings.learn {
                        if let Some(l) = limits {
                            if self.settings.requests.is_none() {
                                if let Some(n) = l.requests {
                                    s.0.learn_capacity(n, l.requests_reset);
                                }
                            }
                            if self.settings.tokens.is_none() {
                                if let Some(n) = l.tokens {
                                    s.1.learn_capacity(n, l.tokens_reset);
                                }
                            }
                        }
                    }
                    let mut m = self.mean_output.lock().unwrap_or_else(|e| e.into_inner());
                    m.1 += 1;
                    m.0 += (usage.output_tokens as f64 - m.0) / m.1 as f64;
                }
                Err(e)
                    if e.kind == ErrorKind::RateLimited
                        && (matches!(e.hint, RetryHint::Later(Some(_))) || e.quota.is_some()) =>
                {
                    let delay = e.retry_after();
                    let (requests, tokens) = &mut *s;
                    let (refusing, other) = match e.quota {
                        Some(QuotaScope::Tokens) => (tokens, requests),
                        _ => (requests, tokens),
                    };
                    // The other quota did not count the send either.
                    other.forget(ticket.id);
                    if self.settings.learn || refusing.mode() != Mode::Unlimited {
                        let was = refusing.mode();
                        refusing.refused(ticket.id, now, delay);
                        if delay.is_none()
                            && was == Mode::Unlimited
                            && refusing.mode() == Mode::Learned
                            && !self.said_window.swap(true, Relaxed)
                        {
                            // Nothing in the refusals says how long the quota's window is: the
                            // one assumed decides how long a full window holds every call, and
                            // a user whose quota is counted per second would otherwise see a
                            // run wait a minute at a time with nothing saying why.
                            tracing::warn!(
                                "the endpoint's 429s do not say when to come back: its quota is taken as counted \
                                 over {} s (--limit-window); if it is counted over a shorter window, set \
                                 --limit-window to it, or each full window holds the calls for {} s",
                                self.settings.window.as_secs_f64(),
                                self.settings.window.as_secs_f64(),
                            );
                        }
                    } else if delay.is_none() {
                        refusing.refused_not_learned(ticket.id, now);
                    } else {
                        refusing.failed(ticket.id);
                    }
                }
                // Nothing listened: the request reached no server, which counted nothing. Kept
                // as a send, a storm of refused connections would look like a window that takes
                // far more than the quota, and be learned as one when the server came back.
                Err(e) if e.unreachable => {
                    s.0.forget(ticket.id);
                    s.1.forget(ticket.id);
                }
                // A refusal that names no quota and advises no wait.
                Err(e) if e.kind == ErrorKind::RateLimited && e.retry_after().is_none() => {
                    s.0.refused_not_learned(ticket.id, now);
                    s.1.failed(ticket.id);
                }
                Err(_) => {
                    s.0.failed(ticket.id);
                    s.1.failed(ticket.id);
                }
            }
        }
        self.changed.notify_waiters();
    }

    /// Since when every send has been refused with no advice and none admitted, with no request
    /// limit or credit to go by (see [`crate::rate::Budget::refused_blind_since`]).
    pub fn refused_blind_since(&self) -> Option<Instant> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0.refused_blind_since()
    }

    /// Notes how a call of this process's was answered, for [`RateLimiter::refused_since`].
    fn answered(&self, result: Result<(Usage, Option<LimitInfo>), &ModelError>) {
        let mut since = self.refused_since.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(_) => *since = None,
            Err(e) if e.kind == ErrorKind::RateLimited => {
                since.get_or_insert_with(Instant::now);
            }
            Err(_) => {}
        }
    }

    /// Since when every call answered was refused for rate, with or without advice, and none
    /// admitted.
    pub fn refused_since(&self) -> Option<Instant> {
        *self.refused_since.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long a refusal advising `advised` holds every call. When the quota that refused is
    /// learned, its credits already keep sends back until slots free, so advice in whole seconds
    /// holds calls only for the part that is sure (a second less): holding them the whole
    /// rounded-up delay would leave up to a second of every window unused.
    pub fn pause_for(&self, e: &ModelError, advised: Duration) -> Duration {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let refusing = match e.quota {
            Some(QuotaScope::Tokens) => &s.1,
            _ => &s.0,
        };
        if e.kind == ErrorKind::RateLimited && refusing.mode() == Mode::Learned {
            crate::rate::surely_busy(advised)
        } else {
            advised
        }
    }

    /// What both budgets know, for a process taking the quota over (see [`Budget::seed`]).
    pub fn export(&self) -> (crate::rate::Seed, crate::rate::Seed) {
        let since = self.refused_since();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        (s.0.export(now).with_refused_since(since, now), s.1.export(now))
    }

    /// Counts another process's sends as admitted here (see [`crate::rate::Budget::count_sends`]).
    pub fn count_sends(&self, seeds: &(crate::rate::Seed, crate::rate::Seed)) {
        self.apply_seeds(seeds, |b, seed, now, ids| b.count_sends(seed, now, ids));
    }

    /// Applies `f` to each budget with its seed of `seeds`, the time, and fresh ids for the
    /// sends it logs; then wakes the calls waiting for the budgets.
    fn apply_seeds(
        &self,
        seeds: &(crate::rate::Seed, crate::rate::Seed),
        f: impl Fn(&mut Budget, &crate::rate::Seed, Instant, &mut dyn FnMut() -> u64),
    ) {
        {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let mut ids = || self.next_id.fetch_add(1, Relaxed);
            f(&mut s.0, &seeds.0, now, &mut ids);
            f(&mut s.1, &seeds.1, now, &mut ids);
        }
        self.changed.notify_waiters();
    }

    /// This process resumes after being stopped while it held a quota `n` processes shared
    /// (see [`crate::rate::Budget::resumed`]).
    pub fn resumed(&self, n: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        s.0.resumed(n, now);
        s.1.resumed(n, now);
    }

    /// Takes over what another process's budgets knew, `age` after they were exported.
    pub fn seed(&self, seeds: &(crate::rate::Seed, crate::rate::Seed), age: Duration) {
        self.apply_seeds(seeds, |b, seed, now, ids| b.seed(seed, age, now, ids));
        if let Some(theirs) = Instant::now().checked_sub(age).and_then(|at| seeds.0.refused_since(at)) {
            let mut since = self.refused_since.lock().unwrap_or_else(|e| e.into_inner());
            *since = Some(since.map_or(theirs, |ours| ours.min(theirs)));
        }
    }

    /// The limits in force.
    pub fn snapshot(&self) -> RateSnapshot {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let view = |b: &Budget| {
            b.effective_capacity().map(|c| (c, b.window().unwrap_or(self.settings.window), b.mode() == Mode::Learned))
        };
        RateSnapshot { requests: view(&s.0), tokens: view(&s.1) }
    }
}

/// The client-side throttler of Google's SRE book that Beam uses (`AdaptiveThrottler`): over a
/// sliding window, reject locally with probability `max(0, (requests − K·accepts) / (requests + 1))`.
/// Unlike Beam's default (a one-second window that wipes itself every second), the window here is
/// made of buckets that expire one by one, so failures are remembered for the whole window.
#[derive(Debug)]
pub struct SreThrottler {
    k: f64,
    bucket: Duration,
    requests: Ring,
    accepts: Ring,
    rng: SmallRng,
}

#[derive(Debug)]
struct Ring {
    counts: Vec<u64>,
    /// Index of the bucket that `start` falls in, and that bucket's start time.
    head: usize,
    head_start: Option<Instant>,
    bucket: Duration,
}

impl Ring {
    fn new(buckets: usize, bucket: Duration) -> Self {
        Self { counts: vec![0; buckets], head: 0, head_start: None, bucket }
    }

    fn advance(&mut self, now: Instant) {
        let start = *self.head_start.get_or_insert(now);
        let elapsed = now.saturating_duration_since(start);
        let steps = (elapsed.as_nanos() / self.bucket.as_nanos().max(1)) as usize;
        if steps == 0 {
            return;
        }
        for i in 1..=steps.min(self.counts.len()) {
            let idx = (self.head + i) % self.counts.len();
            self.counts[idx] = 0;
        }
        self.head = (self.head + steps) % self.counts.len();
        self.head_start = Some(start + self.bucket * steps as u32);
    }

    fn add(&mut self, now: Instant) {
        self.advance(now);
        self.counts[self.head] += 1;
    }

    fn sum(&mut self, now: Instant) -> u64 {
        self.advance(now);
        self.counts.iter().sum()
    }
}

impl SreThrottler {
    /// A throttler with overload ratio `k` over `window`, in one-second buckets (finer for short
    /// windows).
    pub fn new(k: f64, window: Duration, seed: u64) -> Self {
        let bucket = (window / 60).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let n = (window.as_nanos() / bucket.as_nanos()).max(1) as usize;
        Self {
            k,
            bucket,
            requests: Ring::new(n, bucket),
            accepts: Ring::new(n, bucket),
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// The probability of a local rejection now.
    pub fn probability(&mut self, now: Instant) -> f64 {
        let all = self.requests.sum(now) as f64;
        let acc = self.accepts.sum(now) as f64;
        ((all - self.k * acc) / (all + 1.0)).max(0.0)
    }

    /// Decides whether to reject a request locally; every request counts, rejected or not.
    pub fn throttle(&mut self, now: Instant) -> bool {
        let p = self.probability(now);
        self.requests.add(now);
        self.rng.gen::<f64>() < p
    }

    /// Counts a request the backend accepted.
    pub fn accepted(&mut self, now: Instant) {
        self.accepts.add(now);
    }

    /// The bucket length.
    pub fn bucket(&self) -> Duration {
        self.bucket
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::Usage;

    fn ok(total: u64) -> Result<ModelResponse, ModelError> {
        Ok(ModelResponse {
            text: String::new(),
            finish_reason: "stop".into(),
            usage: Usage { prompt_tokens: total / 2, output_tokens: total - total / 2, total_tokens: total },
            model_version: None,
            limits: None,
            embedding: None,
        })
    }

    fn quota_429(delay: Duration) -> Result<ModelResponse, ModelError> {
        Err(ModelError::new(ErrorKind::RateLimited, "429")
            .with_hint(RetryHint::Later(Some(delay)))
            .with_quota(QuotaScope::Requests))
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_queued_behind_one_the_budget_holds_counts_its_wait_as_throttled() {
        // One call a second; a second call waits a second for the budget, and a third (another
        // process's, taking turns with this one) waits behind it for its turn, then a second
        // more: two seconds held by the quota, not one.
        let t = Arc::new(Throttle::new(&ThrottleSettings {
            rate: RateSettings {
                requests: Some(1),
                window: Duration::from_secs(1),
                learn: false,
                ..Default::default()
            },
            adaptive: false,
            ..ThrottleSettings::default()
        }));
        let never = CancellationToken::new();
        t.admit(Weight::default(), &never).await.unwrap().finish(Ok(Default::default()));
        let second = tokio::spawn({
            let t = t.clone();
            async move {
                let never = CancellationToken::new();
                let a = t.admit_for(0, Weight::default(), &never).await.unwrap();
                let w = a.waited;
                a.finish(Ok(Default::default()));
                w
            }
        });
        tokio::task::yield_now().await;
        let third = tokio::spawn({
            let t = t.clone();
            async move {
                let never = CancellationToken::new();
                let a = t.admit_for(1, Weight::default(), &never).await.unwrap();
                let w = a.waited;
                a.finish(Ok(Default::default()));
                w
            }
        });
        let (second, third) = (second.await.unwrap(), third.await.unwrap());
        assert!(second >= Duration::from_millis(900), "{second:?}");
        assert!(third >= Duration::from_millis(1900), "{third:?}");
    }

    /// A shared throttle in another process that admits every call at once, until it is
    /// closed (its process ended).
    #[derive(Default)]
    struct Elsewhere {
        open: std::sync::atomic::AtomicBool,
        next: AtomicU64,
        carried: std::sync::atomic::AtomicUsize,
    }

    impl Delegate for Elsewhere {
        fn admit(&self, _weight: Weight) -> futures::future::BoxFuture<'static, Option<Grant>> {
            let id = self.next.fetch_add(1, Relaxed);
            let open = self.open.load(Relaxed);
            Box::pin(async move {
                open.then_some(Grant {
                    id,
                    waited: Duration::ZERO,
                    concurrency: 4,
                    rates: RateSnapshot { requests: None, tokens: None },
                    processes: 2,
                })
            })
        }
        fn finish(&self, _: u64, _: Result<(Usage, Option<LimitInfo>), &ModelError>, _: Duration) {}
        fn abandon(&self, _: u64) {}
        fn is_open(&self) -> bool {
            self.open.load(Relaxed)
        }
        fn carry(&self, n: usize) {
            self.carried.fetch_add(n, Relaxed);
        }
        fn landed(&self) {
            self.carried.fetch_sub(1, Relaxed);
        }
    }

    /// A throttle told `requests` per `window`, deciding alone, with a fixed concurrency.
    fn told(requests: u64, window: Duration) -> Throttle {
        Throttle::new(&ThrottleSettings {
            rate: RateSettings { requests: Some(requests), window, ..RateSettings::default() },
            adaptive: false,
            store: QuotaStore::Off,
            ..ThrottleSettings::default()
        })
    }

    #[tokio::test(start_paused = true)]
    async fn calls_held_for_the_quota_are_counted_and_a_wait_for_a_slot_is_not() {
        // Two per minute, told: two calls go, the next five are held by the budget (one at
        // the turn, four queued behind it).
        let t = Arc::new(told(2, Duration::from_secs(60)));
        let first: Vec<_> = (0..2).map(|_| call_asking(&t)).collect();
        let cancel = CancellationToken::new();
        let cancelled = {
            let (t, cancel) = (t.clone(), cancel.clone());
            tokio::spawn(async move { t.admit(Weight::default(), &cancel).await.is_none() })
        };
        let rest: Vec<_> = (0..4).map(|_| call_asking(&t)).collect();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(t.held_now(), 5);
        // One cancelled while held is counted out.
        cancel.cancel();
        assert!(cancelled.await.unwrap());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(t.held_now(), 4);
        // The next window admits two of the four; two are still held.
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert_eq!(t.held_now(), 2);
        for c in first {
            assert_eq!(c.await.unwrap(), Some(false));
        }
        drop(rest);

        // A wait for a concurrency slot is the endpoint's pace, not the quota's.
        let t = Arc::new(Throttle::new(&ThrottleSettings {
            adaptive: false,
            max_concurrency: 1,
            store: QuotaStore::Off,
            ..ThrottleSettings::default()
        }));
        let never = CancellationToken::new();
        let on_the_wire = t.admit(Weight::default(), &never).await.unwrap();
        let waiting: Vec<_> = (0..3).map(|_| call_asking(&t)).collect();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(t.held_now(), 0);
        on_the_wire.finish(Ok((Usage::default(), None)));
        drop(waiting);
    }

    /// How many calls `t` admits now, one after another, each finished at once.
    async fn admitted_now(t: &Throttle) -> usize {
        let never = CancellationToken::new();
        let mut n = 0;
        while let Ok(a) = tokio::time::timeout(Duration::from_millis(10), t.admit(Weight::default(), &never)).await {
            a.unwrap().finish(Ok((Usage::default(), None)));
            n += 1;
        }
        n
    }

    /// A call asking `t` in the background: whether another process's throttle admitted it.
    fn call_asking(t: &Arc<Throttle>) -> tokio::task::JoinHandle<Option<bool>> {
        let t = t.clone();
        tokio::spawn(
            async move { t.admit(Weight::default(), &CancellationToken::new()).await.map(|a| a.remote.is_some()) },
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_throttle_keeps_its_part_of_a_told_limit_while_the_quota_store_is_lost() {
        let t = told(6, Duration::from_secs(60));
        // Three processes shared the quota when the store was lost: this one keeps a third.
        t.set_processes(3);
        t.store_lost();
        assert_eq!(admitted_now(&t).await, 2);
        // Another process of this machine comes to share through this one: two thirds.
        t.set_served(2);
        assert_eq!(admitted_now(&t).await, 2);
        // Said lost again while still lost: the count of those that shared it stands.
        t.store_lost();
        assert_eq!(admitted_now(&t).await, 0);
        // The store is back: the part grows as processes join, and the whole comes back later.
        t.store_back();
        t.set_served(3);
        assert_eq!(admitted_now(&t).await, 2);
        // Lost again before the whole came back: counted afresh, from the three just seen.
        t.store_lost();
        t.whole_again();
        assert_eq!(admitted_now(&t).await, 0, "a third of 6, spent");
        t.store_back();
        t.whole_again();
        assert_eq!(admitted_now(&t).await, 0, "6, spent");
    }

    #[tokio::test(start_paused = true)]
    async fn calls_another_throttle_admitted_count_against_the_part_kept() {
        // Following a holder when the store was lost, this process's calls it admitted are in
        // the told window: they count against this one's part as it comes to decide.
        let t = told(6, Duration::from_secs(60));
        let never = CancellationToken::new();
        let holder = Arc::new(Elsewhere::default());
        holder.open.store(true, Relaxed);
        t.delegate_to(Some(holder.clone()));
        for _ in 0..2 {
            let a = t.admit(Weight::default(), &never).await.unwrap();
            assert!(a.remote.is_some());
            a.finish(Ok((Usage::default(), None)));
        }
        // The holder's grants said two processes shared the quota: this one keeps 3 of 6.
        holder.open.store(false, Relaxed);
        t.store_lost();
        t.delegate_to(None);
        assert_eq!(admitted_now(&t).await, 1, "3 kept, 2 sent through the holder");
    }

    /// A shared throttle in another process at which calls wait their turn until it goes (its
    /// process hands the quota on).
    #[derive(Default)]
    struct Queued {
        gone: CancellationToken,
    }

    impl Delegate for Queued {
        fn admit(&self, _weight: Weight) -> futures::future::BoxFuture<'static, Option<Grant>> {
            let gone = self.gone.clone();
            Box::pin(async move {
                gone.cancelled().await;
                None
            })
        }
        fn finish(&self, _: u64, _: Result<(Usage, Option<LimitInfo>), &ModelError>, _: Duration) {}
        fn abandon(&self, _: u64) {}
        fn is_open(&self) -> bool {
            !self.gone.is_cancelled()
        }
        fn carry(&self, _: usize) {}
        fn landed(&self) {}
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_waited_long_at_a_shared_throttle_that_goes_waits_for_the_next() {
        // Redis hung: the call's shared throttle (the holder through Redis) went, and the call
        // waited its turn at the next (the holder on this machine) for longer than calls wait
        // for a throttle. When that one went too (Redis was back), the call went alone at
        // once, timed from the first loss: with 15 others, beside the 60 the machine had sent.
        let t = Arc::new(told(60, Duration::from_secs(5)));
        let (first, second) = (Arc::new(Queued::default()), Arc::new(Queued::default()));
        t.delegate_to(Some(first.clone()));
        let call = call_asking(&t);
        tokio::time::sleep(Duration::from_secs(1)).await;
        first.gone.cancel();
        t.await_delegate();
        tokio::time::sleep(Duration::from_secs(1)).await;
        t.delegate_to(Some(second.clone()));
        tokio::time::sleep(DECIDING_AT_MOST + Duration::from_secs(1)).await;
        assert!(!call.is_finished(), "waiting its turn at the second");
        second.gone.cancel();
        t.await_delegate();
        tokio::time::sleep(DECIDING_AT_MOST / 2).await;
        assert!(!call.is_finished(), "went alone as the second throttle went");
        let third = Arc::new(Elsewhere::default());
        third.open.store(true, Relaxed);
        t.delegate_to(Some(third));
        let remote = tokio::time::timeout(Duration::from_secs(1), call).await.expect("admitted").unwrap();
        assert_eq!(remote, Some(true), "admitted by the third");
    }

    #[tokio::test(start_paused = true)]
    async fn calls_a_gone_holder_admitted_count_against_whoever_decides_next() {
        let t = Throttle::new(&ThrottleSettings {
            max_concurrency: 4,
            adaptive: false,
            store: QuotaStore::Off,
            ..ThrottleSettings::default()
        });
        let never = CancellationToken::new();
        let old = Arc::new(Elsewhere::default());
        old.open.store(true, Relaxed);
        t.delegate_to(Some(old.clone()));
        let mut flying = Vec::new();
        for _ in 0..3 {
            flying.push(t.admit(Weight::default(), &never).await.unwrap());
        }
        // The holder's process ends with three of this process's calls in flight; this one
        // takes the quota over: one slot of four is free until they land.
        old.open.store(false, Relaxed);
        t.delegate_to(None);
        let mine = t.admit(Weight::default(), &never).await.unwrap();
        let second = tokio::time::timeout(Duration::from_secs(1), t.admit(Weight::default(), &never)).await;
        assert!(second.is_err(), "a fifth call in flight");
        flying.pop().unwrap().finish(Ok((Usage::default(), None)));
        let second = tokio::time::timeout(Duration::from_secs(1), t.admit(Weight::default(), &never)).await;
        assert!(second.is_ok(), "a landed call's slot was not given back");
        drop((mine, second));
        // Following another holder instead, the calls still in flight are told to it, and each
        // that lands is told too.
        let next = Arc::new(Elsewhere::default());
        next.open.store(true, Relaxed);
        t.delegate_to(Some(next.clone()));
        assert_eq!(next.carried.load(Relaxed), 2);
        flying.pop().unwrap().finish(Ok((Usage::default(), None)));
        assert_eq!(next.carried.load(Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_waiting_here_go_to_a_throttle_that_comes_to_decide_for_this_one() {
        // Told one call a minute: the second waits here. Another process's throttle comes to
        // decide for this one (this process gave way to it): the waiting call asks that one at
        // once, instead of going out at this one's pace beside every call that one admits.
        let t = Arc::new(told(1, Duration::from_secs(60)));
        let never = CancellationToken::new();
        let first = t.admit(Weight::default(), &never).await.unwrap();
        let waiting = call_asking(&t);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "a second call within the minute");
        let there = Arc::new(Elsewhere::default());
        there.open.store(true, Relaxed);
        t.delegate_to(Some(there.clone()));
        let remote = tokio::time::timeout(Duration::from_secs(1), waiting).await.expect("still waiting here").unwrap();
        assert_eq!(remote, Some(true), "admitted here, not by the throttle deciding now");
        drop(first);
    }

    /// Asks a throttle of two calls a second to admit a call of each `(member, cancel)`, in
    /// order (each asks before the next), then cancels `gone`; the members in the order their
    /// calls were admitted.
    async fn admitted_in_turn(calls: Vec<(u64, CancellationToken)>, gone: &CancellationToken) -> Vec<u64> {
        let throttle = Arc::new(told(2, Duration::from_secs(1)));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (member, cancel) in calls {
            let (throttle, order) = (throttle.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                if let Some(a) = throttle.admit_for(member, Weight::default(), &cancel).await {
                    order.lock().unwrap().push(member);
                    a.finish(Ok((Usage::default(), None)));
                }
            }));
            tokio::task::yield_now().await;
        }
        gone.cancel();
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        order
    }

    #[tokio::test(start_paused = true)]
    async fn processes_take_turns_whichever_asked_first() {
        // Two per second. Process 1's twenty calls all ask before process 0's; still, from the
        // first grant on, the two alternate (fairness by process, not by arrival), and a call
        // cancelled while it waits passes its turn on.
        let (keep, gone) = (CancellationToken::new(), CancellationToken::new());
        let calls = [1u64, 0]
            .into_iter()
            .flat_map(|m| (0..20).map(move |i| (m, i)))
            .map(|(m, i)| (m, if m == 1 && i == 5 { gone.clone() } else { keep.clone() }))
            .collect();
        let order = admitted_in_turn(calls, &gone).await;
        assert_eq!(order.len(), 39, "the cancelled call is not admitted, and nothing is stuck");
        // Once both have calls waiting (after process 1's first few), they alternate: never
        // three in a row from one (two where the cancelled call passed its turn on), even
        // shares.
        let both = &order[3..31];
        assert!(both.windows(3).all(|w| !(w[0] == w[1] && w[1] == w[2])), "{order:?}");
        let zeros = both.iter().filter(|&&m| m == 0).count();
        assert!(zeros.abs_diff(both.len() - zeros) <= 2, "{order:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_process_whose_waiting_calls_were_cancelled_keeps_its_turns() {
        // Two per second. Process 1's first twenty calls are cancelled while they wait (their
        // process left, or asked elsewhere); its next ten still alternate with process 0's.
        let (keep, gone) = (CancellationToken::new(), CancellationToken::new());
        let calls = [(0u64, 20, &keep), (1, 20, &gone), (1, 10, &keep)]
            .into_iter()
            .flat_map(|(m, n, c)| (0..n).map(move |_| (m, c.clone())))
            .collect();
        let order = admitted_in_turn(calls, &gone).await;
        assert_eq!(order.len(), 30, "{order:?}");
        // Process 1's ten go among the first twenty-two, not after all of process 0's.
        let ones = order[..22].iter().filter(|&&m| m == 1).count();
        assert!(ones >= 9, "{order:?}");
    }

    #[test]
    fn a_process_told_other_limits_than_the_shared_throttle_keeps_is_warned_once() {
        let told = |requests| ThrottleSettings {
            rate: RateSettings { requests, window: Duration::from_secs(60), ..RateSettings::default() },
            ..ThrottleSettings::default()
        };
        let keeps = |requests| RateSnapshot { requests, tokens: None };
        let minute = Duration::from_secs(60);
        // Told the limit the holder keeps, or nothing: no warning.
        let t = Throttle::new(&told(Some(100)));
        t.check_told(&keeps(Some((100.0, minute, false))));
        assert!(!t.warned_limits.load(Relaxed));
        let t = Throttle::new(&told(None));
        t.check_told(&keeps(Some((100.0, minute, false))));
        assert!(!t.warned_limits.load(Relaxed));
        // Told 50 a minute while the holder keeps 100, or 100 over another window, or learns.
        for kept in [
            Some((100.0, minute, false)),
            Some((50.0, Duration::from_secs(5), false)),
            Some((48.0, minute, true)),
            None,
        ] {
            let t = Throttle::new(&told(Some(50)));
            t.check_told(&keeps(kept));
            assert!(t.warned_limits.load(Relaxed), "{kept:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn static_rpm_spaces_sends_over_the_window() {
        let rl = std::sync::Arc::new(RateLimiter::new(RateSettings {
            requests: Some(10),
            window: Duration::from_secs(1),
            ..RateSettings::default()
        }));
        let t0 = Instant::now();
        let mut times = Vec::new();
        for _ in 0..25 {
            let t = rl.acquire(1).await;
            times.push(t0.elapsed());
            rl.complete(t, &ok(2));
        }
        // 10 at once, 10 more after a window (plus margin), 5 after another.
        assert!(times[9] < Duration::from_millis(1));
        assert!(times[10] >= Duration::from_secs(1) && times[10] < Duration::from_millis(1100));
        assert!(times[20] >= Duration::from_secs(2) && times[20] < Duration::from_millis(2200));
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_with_no_advice_and_nothing_admitted_for_ten_minutes_stop_the_run() {
        // A quota of zero (a model with no quota in a region) refuses every call, advising no
        // wait: the calls are held, one scout at a time, and once none was admitted for longer
        // than weir waits out, the refusal becomes one that stops the run (resumable).
        for quota in [Some(QuotaScope::Requests), None] {
            let t = Throttle::new(&ThrottleSettings { store: QuotaStore::Off, ..ThrottleSettings::default() });
            let never = CancellationToken::new();
            let mut refused = ModelError::new(ErrorKind::RateLimited, "429").with_status(429);
            refused.quota = quota;
            let start = Instant::now();
            let mut scouts = 0;
            let stop = loop {
                let a = t.admit(t.estimate(10, None), &never).await.expect("not cancelled");
                a.finish(Err(&refused));
                scouts += 1;
                if let Some(stop) = t.judge(&refused) {
                    break stop;
                }
                assert!(start.elapsed() <= crate::error::LONGEST_ADVISED_WAIT, "{quota:?}: not stopped in time");
            };
            assert_eq!((stop.kind, stop.hint), (ErrorKind::QuotaExhausted, RetryHint::StopRun), "{quota:?}");
            assert!(stop.message.contains("no advised wait"), "{}", stop.message);
            let elapsed = start.elapsed();
            assert!(elapsed < crate::error::LONGEST_ADVISED_WAIT + Duration::from_secs(6), "{quota:?}: {elapsed:?}");
            // A scout every 5 s once the holds have grown: 10 minutes' worth, and no storm.
            assert!((110..=130).contains(&scouts), "{quota:?}: {scouts} scouts");
            // One call admitted clears it.
            let a = t.admit(t.estimate(10, None), &never).await.expect("not cancelled");
            a.finish(Ok((Usage::default(), None)));
            assert!(t.judge(&refused).is_none(), "{quota:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_advising_short_waits_and_nothing_admitted_for_ten_minutes_stop_the_run() {
        // A quota that fell to zero, each refusal advising a few seconds: the pauses hold the
        // calls, and without this the run went on being refused for as long as it was left.
        let t = Throttle::new(&ThrottleSettings { store: QuotaStore::Off, ..ThrottleSettings::default() });
        let never = CancellationToken::new();
        let refused = ModelError::new(ErrorKind::RateLimited, "429")
            .with_status(429)
            .with_hint(RetryHint::Later(Some(Duration::from_secs(3))));
        let start = Instant::now();
        let stop = loop {
            let a = t.admit(t.estimate(10, None), &never).await.expect("not cancelled");
            a.finish(Err(&refused));
            if let Some(stop) = t.judge(&refused) {
                break stop;
            }
            assert!(start.elapsed() <= crate::error::LONGEST_ADVISED_WAIT + Duration::from_secs(4), "not stopped");
            // As the retry's backoff does.
            tokio::time::sleep(Duration::from_secs(3)).await;
        };
        assert_eq!((stop.kind, stop.hint), (ErrorKind::QuotaExhausted, RetryHint::StopRun));
        assert!(stop.message.contains("each told to come back soon"), "{}", stop.message);
        // One call admitted clears it.
        let a = t.admit(t.estimate(10, None), &never).await.expect("not cancelled");
        a.finish(Ok((Usage::default(), None)));
        assert!(t.judge(&refused).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_process_taking_over_a_quota_refused_throughout_counts_from_the_first_refusal() {
        // The holder of a shared quota of zero, its 429s advising nothing, stops after 10
        // minutes; the process that takes the quota over goes on holding and stops at its next
        // refusal, instead of sending all it held and counting 10 minutes afresh.
        let settings = ThrottleSettings { store: QuotaStore::Off, ..ThrottleSettings::default() };
        let holder = Throttle::new(&settings);
        let never = CancellationToken::new();
        let bare = ModelError::new(ErrorKind::RateLimited, "429").with_status(429);
        let start = Instant::now();
        while holder.judge(&bare).is_none() {
            let a = holder.admit(holder.estimate(10, None), &never).await.expect("not cancelled");
            a.finish(Err(&bare));
            assert!(start.elapsed() <= crate::error::LONGEST_ADVISED_WAIT + Duration::from_secs(6), "not stopped");
        }
        let handed = holder.rate_limiter().export();
        // Taken over for as long as a round of the hold lasts: the holder writes it down at
        // each scout, up to 5 s apart.
        assert_eq!(handed.0.current_for(), Duration::from_secs(5));
        let age = Duration::from_millis(300);
        tokio::time::advance(age).await;

        let next = Throttle::new(&settings);
        next.rate_limiter().seed(&handed, age);
        let blind = next.rate_limiter().refused_blind_since().expect("held as the holder was");
        assert_eq!(Some(blind), holder.rate_limiter().refused_blind_since());
        assert_eq!(next.rate_limiter().refused_since(), holder.rate_limiter().refused_since());
        // Held: nothing goes until the holder's next scout was due.
        let t = Instant::now();
        let a = next.admit(next.estimate(10, None), &never).await.expect("not cancelled");
        assert!(t.elapsed() >= Duration::from_secs(4), "sent after {:?}", t.elapsed());
        a.finish(Err(&bare));
        let stop = next.judge(&bare).expect("stops at its first refusal");
        assert_eq!(stop.kind, ErrorKind::QuotaExhausted);

        // Advised waits are counted from the holder's first refusal too.
        let advised = ModelError::new(ErrorKind::RateLimited, "429")
            .with_status(429)
            .with_hint(RetryHint::Later(Some(Duration::from_secs(3))));
        let fresh = Throttle::new(&settings);
        let before = fresh.rate_limiter().export();
        tokio::time::advance(crate::error::LONGEST_ADVISED_WAIT).await;
        fresh.rate_limiter().seed(&handed, Duration::ZERO);
        let a = fresh.admit(fresh.estimate(10, None), &never).await.expect("not cancelled");
        a.finish(Err(&advised));
        assert!(fresh.judge(&advised).is_some(), "refused since the holder's first refusal");
        // A holder refused nothing hands nothing of the kind on.
        assert_eq!(before.0.current_for(), Duration::ZERO);
        let other = Throttle::new(&settings);
        other.rate_limiter().seed(&before, Duration::ZERO);
        assert_eq!(other.rate_limiter().refused_since(), None);
        assert_eq!(other.rate_limiter().refused_blind_since(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn learns_from_a_quota_429() {
        let rl = RateLimiter::new(RateSettings::default());
        let mut tickets = Vec::new();
        for _ in 0..6 {
            tickets.push(rl.acquire(1).await);
        }
        let last = tickets.pop().unwrap();
        for t in tickets {
            rl.complete(t, &ok(2));
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        rl.complete(last, &quota_429(Duration::from_millis(1900)));
        let snap = rl.snapshot();
        let (cap, window, learned) = snap.requests.unwrap();
        assert!(learned);
        assert_eq!(cap, 5.0);
        assert_eq!(window, Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn sends_that_reached_no_server_teach_no_quota() {
        let rl = RateLimiter::new(RateSettings::default());
        let mut tickets = Vec::new();
        for _ in 0..11 {
            tickets.push(rl.acquire(1).await);
        }
        let last = tickets.pop().unwrap();
        for (i, t) in tickets.into_iter().enumerate() {
            if i % 2 == 0 {
                let mut refused = ModelError::new(ErrorKind::Transport, "connection refused");
                refused.unreachable = true;
                rl.complete(t, &Err(refused));
            } else {
                rl.complete(t, &ok(2));
            }
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        rl.complete(last, &quota_429(Duration::from_millis(1900)));
        let (cap, _, learned) = rl.snapshot().requests.unwrap();
        assert!(learned);
        assert_eq!(cap, 5.0, "the five answered sends, not the five refused connections");
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_are_estimated_then_corrected() {
        let rl = RateLimiter::new(RateSettings {
            tokens: Some(100),
            window: Duration::from_secs(1),
            ..RateSettings::default()
        });
        assert_eq!(rl.estimate(40, Some(20)), 30);
        let a = rl.acquire(60).await;
        rl.complete(a, &ok(30));
        let b = rl.acquire(60).await; // fits only because the first was corrected to 30
        assert!(b.waited.is_zero());
        assert_eq!(rl.estimate(4, None), 1 + 15);
    }

    #[tokio::test(start_paused = true)]
    async fn sre_window_remembers_failures_for_the_whole_window() {
        let mut t = SreThrottler::new(2.0, Duration::from_secs(60), 1);
        let t0 = Instant::now();
        assert_eq!(t.probability(t0), 0.0);
        // 100 requests, 10 accepted: p = (100 - 20) / 101.
        for i in 0..100 {
            let now = t0 + Duration::from_millis(i * 10);
            t.throttle(now);
            if i % 10 == 0 {
                t.accepted(now);
            }
        }
        let p = t.probability(t0 + Duration::from_secs(1));
        assert!((p - 80.0 / 101.0).abs() < 1e-9, "{p}");
        // Thirty seconds later the failures still count (Beam's default window forgets after 1 s).
        assert!((t.probability(t0 + Duration::from_secs(30)) - 80.0 / 101.0).abs() < 1e-9);
        // After the window, they are gone.
        assert_eq!(t.probability(t0 + Duration::from_secs(62)), 0.0);
        // With all requests accepted, nothing is throttled.
        let mut t = SreThrottler::new(2.0, Duration::from_secs(60), 1);
        for i in 0..1000 {
            let now = t0 + Duration::from_millis(i);
            assert!(!t.throttle(now));
            t.accepted(now);
        }
    }
}
