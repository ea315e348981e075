//! How many calls may be in flight, and when calls may start.
//!
//! [`ConcurrencyLimit`] is the seam for adaptive concurrency: the driver acquires a permit per
//! attempt (not per record, so records sleeping in backoff hold none) and reports each call's
//! latency and outcome back. [`FixedLimit`] is a plain semaphore and ignores the feedback.
//!
//! [`Gate`] holds every new call to an endpoint until a moment the server named (a 429 with
//! `retry-after` or `RetryInfo`), so one advised pause is honoured by all workers at once,
//! and no longer than advised.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// What a finished call tells the limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    /// The call got an answer.
    Ok,
    /// The server pushed back (429, 503, overload).
    Backpressure,
    /// Some other failure, not a signal about load.
    Other,
}

/// A permit to make one call; dropping it frees the slot.
pub type Permit = Box<dyn Send + Sync>;

/// Limits calls in flight.
#[async_trait::async_trait]
pub trait ConcurrencyLimit: Send + Sync {
    /// Waits for a slot; also returns the number of calls in flight including this one.
    async fn acquire(&self) -> (Permit, usize);
    /// Reports a finished call that was sent when `level` calls were in flight.
    fn feedback(&self, level: usize, latency: Duration, result: CallResult);
    /// The current limit.
    fn current(&self) -> usize;
    /// Sets `n` slots aside for calls in flight that this limit did not admit (calls a shared
    /// throttle that went away admitted): as far as the limit goes they are in flight until
    /// [`ConcurrencyLimit::repay`]. Returns how many were set aside (no more than the limit).
    fn borrow(&self, n: usize) -> usize;
    /// Gives back `n` slots set aside by [`ConcurrencyLimit::borrow`].
    fn repay(&self, n: usize);
    /// What the limit learned, to hand to the process that takes a shared throttle over: the
    /// limit and the ceiling found (none for a fixed limit).
    fn export(&self) -> Option<(usize, Option<usize>)> {
        None
    }
    /// Goes on from what another process's limit learned (see [`ConcurrencyLimit::export`]).
    fn seed(&self, _limit: usize, _ceiling: Option<usize>) {}
}

/// A fixed number of calls in flight.
#[derive(Debug)]
pub struct FixedLimit {
    sem: Arc<Semaphore>,
    limit: usize,
}

impl FixedLimit {
    /// Allows `limit` calls in flight (at least one).
    pub fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self { sem: Arc::new(Semaphore::new(limit)), limit }
    }
}

#[async_trait::async_trait]
impl ConcurrencyLimit for FixedLimit {
    async fn acquire(&self) -> (Permit, usize) {
        let permit: OwnedSemaphorePermit =
            self.sem.clone().acquire_owned().await.expect("the semaphore is never closed");
        let level = self.limit - self.sem.available_permits();
        (Box::new(permit), level)
    }

    fn feedback(&self, _level: usize, _latency: Duration, _result: CallResult) {}

    fn current(&self) -> usize {
        self.limit
    }

    fn borrow(&self, n: usize) -> usize {
        // Only slots free now (calls admitted here and in flight keep theirs).
        self.sem.forget_permits(n.min(self.limit))
    }

    fn repay(&self, n: usize) {
        self.sem.add_permits(n);
    }
}

/// Adaptive concurrency: finds how many calls the endpoint takes at once, with nothing told.
///
/// It starts at `initial` and grows by one with each success while it is used, so doubling
/// every round trip (slow start), until the server pushes back. Push-back (HTTP 503, or a 429
/// that names no quota and no delay) is judged once per round trip, when every call of the
/// round has reported, because only then is it known whether calls at the same levels
/// succeeded:
///
/// - **A capacity signal** is push-back *above every level that succeeded* in this round and the
///   last: a hidden cap refuses every call above it and none below. Two such refusals in a
///   round — or one in each of two rounds running — set the limit to just below the lowest
///   refused level, and that value is remembered as the ceiling. A single one is only suspect:
///   a random fault lands on the top level now and then, and must not set a ceiling.
/// - **Random faults** — push-back scattered among successes at the same levels — do not track
///   load, and lowering the limit would not reduce them; they are tolerated. Only a round whose
///   push-back share is both above 10 % and more than twice the long-run share (at least three
///   calls) lowers the limit, by 10 %, without touching the ceiling.
///
/// Below the ceiling the limit grows by one per round trip in which it was fully used; at the
/// ceiling it probes one step higher after 20 round trips, and twice as long after each probe
/// that finds the ceiling where it was (up to 320), so a steady endpoint sees few refusals; a
/// probe that goes through a whole round trip without push-back clears the ceiling (and probing
/// is frequent again).
/// An endpoint that slows down instead of refusing is caught by latency: a round trip whose median
/// latency (of successful calls) is twice the best seen, and 5 ms more, lowers the limit by 10 %.
/// A latency that cuts in a row did not bring down by two fifths, with half as many calls out,
/// is not load (queueing halves with the calls out; noise does not fall that far): it becomes
/// the best seen, and the limit goes back to where the cuts began.
#[derive(Debug)]
pub struct AdaptiveLimit {
    sem: Arc<Semaphore>,
    max: usize,
    ctl: Mutex<Control>,
}

#[derive(Debug)]
struct Control {
    limit: usize,
    debt: usize,
    in_flight: usize,
    slow_start: bool,
    /// The limit when the round began: a round is that many calls answered (slow start grows
    /// the limit during it, by at most as much again).
    round_limit: usize,
    ceiling: Option<usize>,
    rounds_at_ceiling: u32,
    done_in_round: usize,
    /// This round's successful calls.
    rtts: Vec<Sample>,
    bound: bool,
    best_rtt: Option<f64>,
    ok_level_cur: usize,
    ok_level_prev: usize,
    /// Levels of this round's push-back.
    refused: Vec<usize>,
    /// The last round had one refusal above every success (a capacity signal if repeated).
    suspect: bool,
    /// Long-run share of calls pushed back (exponentially weighted over rounds).
    pushback_share: f64,
    /// Rounds at the ceiling between probes above it: doubled each time a probe finds the same
    /// ceiling, back to the first when one finds it gone.
    probe_every: u32,
    /// The limit is one above the ceiling, probing.
    probing: bool,
    /// Rounds running that were slower than the best and cut the limit: the calls the first
    /// allowed out, and the latencies and levels of the calls answered since.
    slow_cuts: Option<(usize, Vec<Sample>)>,
}

/// A successful call: its latency in seconds, and the level it was sent at.
type Sample = (f64, usize);

/// The most answers kept while cuts for latency are judged.
const SLOW_SAMPLES_KEPT: usize = 4096;

/// Rounds at the ceiling before the first probe above it.
const FIRST_PROBE_AFTER: u32 = 20;
/// The most rounds between probes (about half a minute at a tenth of a second per round).
const MOST_PROBE_AFTER: u32 = 320;

struct AdaptivePermit {
    limit: Arc<AdaptiveLimit>,
    permit: Option<OwnedSemaphorePermit>,
}

impl Drop for AdaptivePermit {
    fn drop(&mut self) {
        let mut c = self.limit.ctl.lock().unwrap_or_else(|e| e.into_inner());
        c.in_flight = c.in_flight.saturating_sub(1);
        if let Some(p) = self.permit.take() {
            if c.debt > 0 {
                c.debt -= 1;
                p.forget();
            }
        }
    }
}

impl AdaptiveLimit {
    /// A limit between 1 and `max`, starting at `initial`.
    pub fn new(initial: usize, max: usize) -> Arc<Self> {
        let max = max.max(1);
        let initial = initial.clamp(1, max);
        Arc::new(Self {
            sem: Arc::new(Semaphore::new(initial)),
            max,
            ctl: Mutex::new(Control {
                limit: initial,
                debt: 0,
                in_flight: 0,
                slow_start: true,
                round_limit: initial,
                ceiling: None,
                rounds_at_ceiling: 0,
                done_in_round: 0,
                rtts: Vec::new(),
                bound: false,
                best_rtt: None,
                ok_level_cur: 0,
                ok_level_prev: 0,
                refused: Vec::new(),
                suspect: false,
                pushback_share: 0.0,
                probe_every: FIRST_PROBE_AFTER,
                probing: false,
                slow_cuts: None,
            }),
        })
    }

    fn set_limit(&self, c: &mut Control, new: usize) {
        let new = new.clamp(1, self.max);
        if new > c.limit {
            let mut add = new - c.limit;
            let repaid = add.min(c.debt);
            c.debt -= repaid;
            add -= repaid;
            if add > 0 {
                self.sem.add_permits(add);
            }
        } else if new < c.limit {
            let remove = c.limit - new;
            let forgotten = self.sem.forget_permits(remove);
            c.debt += remove - forgotten;
        }
        c.limit = new;
    }
}

/// The median of `values`, if any.
fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return None;
    }
    let mid = v.len() / 2;
    Some(*v.select_nth_unstable_by(mid, f64::total_cmp).1)
}

/// The capacity a round's refusals reveal at once: at least three refusals above every level
/// that succeeded, two of them at one level — the mark of a cap (every call above it refused,
/// and the freed slot refused again), which random faults scattered over levels almost never
/// leave. The capacity is just below the lowest level refused twice.
fn repeated_refusal(refused: &[usize], ok_level: usize) -> Option<usize> {
    let mut above: Vec<usize> = refused.iter().copied().filter(|l| *l > ok_level).collect();
    if above.len() < 3 {
        return None;
    }
    above.sort_unstable();
    above.windows(2).find(|w| w[0] == w[1]).map(|w| w[0].saturating_sub(1).max(ok_level))
}

impl AdaptiveLimit {
    /// Sets the limit to `cap` (never raising it) and remembers it as the ceiling; a new round
    /// starts, so the refusals that revealed it are not counted again.
    fn set_ceiling(&self, c: &mut Control, cap: usize) {
        let cap = cap.max(1).min(c.limit);
        // A probe that found the cap where it was: probe half as often (each costs a refusal or
        // two), so that a steady cap costs a few refusals a minute, not one every two seconds.
        if std::mem::take(&mut c.probing) && c.ceiling == Some(cap) {
            c.probe_every = (c.probe_every * 2).min(MOST_PROBE_AFTER);
        }
        self.set_limit(c, cap);
        c.ceiling = Some(c.limit);
        c.slow_start = false;
        c.rounds_at_ceiling = 0;
        c.suspect = false;
        c.refused.clear();
        c.rtts.clear();
        c.done_in_round = 0;
        c.bound = false;
    }
}

/// The adaptive limit behind an `Arc`, as the driver holds it.
#[derive(Debug, Clone)]
pub struct Adaptive(pub Arc<AdaptiveLimit>);

#[async_trait::async_trait]
impl ConcurrencyLimit for Adaptive {
    async fn acquire(&self) -> (Permit, usize) {
        let permit = self.0.sem.clone().acquire_owned().await.expect("the semaphore is never closed");
        let mut c = self.0.ctl.lock().unwrap_or_else(|e| e.into_inner());
        c.in_flight += 1;
        if c.in_flight >= c.limit {
            c.bound = true;
        }
        let level = c.in_flight;
        drop(c);
        (Box::new(AdaptivePermit { limit: self.0.clone(), permit: Some(permit) }), level)
    }

    fn feedback(&self, level: usize, latency: Duration, result: CallResult) {
        let me = &self.0;
        let mut c = me.ctl.lock().unwrap_or_else(|e| e.into_inner());
        if c.done_in_round == 0 && c.refused.is_empty() {
            // A round begins.
            c.round_limit = c.limit;
        }
        match result {
            CallResult::Backpressure => {
                c.refused.push(level);
                if let Some(cap) = repeated_refusal(&c.refused, c.ok_level_cur.max(c.ok_level_prev)) {
                    // A cap refuses every call above it, again and again, and refusals come
                    // back at once: waiting for the round's end would let a storm through.
                    me.set_ceiling(&mut c, cap);
                    return;
                }
            }
            CallResult::Ok => {
                c.ok_level_cur = c.ok_level_cur.max(level);
                // Slow start grows by one per success while the limit is used: it doubles every
                // round trip, but a step at a time, so calls above a cap are refused one or two
                // at a time as it reaches it, where doubling at the round's end sent a whole
                // limit's worth above it at once.
                if c.slow_start && c.bound && c.limit < 2 * c.round_limit {
                    let grown = c.limit + 1;
                    me.set_limit(&mut c, grown);
                }
            }
            CallResult::Other => {}
        }
        if result != CallResult::Backpressure {
            c.done_in_round += 1;
        }
        if result == CallResult::Ok {
            c.rtts.push((latency.as_secs_f64(), level));
        }
        // A round trip: as many calls answered as the limit allows in flight. Refusals come back
        // at once and would fill a round before any answer does, so they do not count towards
        // it — unless nothing else comes back (an outage), when twice the limit of them ends it.
        if c.done_in_round < c.round_limit && c.refused.len() < 2 * c.round_limit {
            return;
        }
        // The median of the round's successful calls: a few hung or timed-out calls are not load.
        let samples = std::mem::take(&mut c.rtts);
        let mean = median(samples.iter().map(|(rtt, _)| *rtt));
        let best = match (c.best_rtt, mean) {
            (Some(b), Some(m)) => Some(b.min(m)),
            (b, m) => b.or(m),
        };
        c.best_rtt = best;
        let slower = matches!((mean, best), (Some(m), Some(b)) if m > 2.0 * b && m - b > 0.005);
        let (bound, limit) = (c.bound, c.limit);
        let done = c.done_in_round + c.refused.len();
        let ok_level = c.ok_level_cur.max(c.ok_level_prev);
        let refused = std::mem::take(&mut c.refused);
        c.done_in_round = 0;
        c.bound = false;
        c.ok_level_prev = c.ok_level_cur;
        c.ok_level_cur = 0;
        let share = refused.len() as f64 / done.max(1) as f64;
        let baseline = c.pushback_share;
        c.pushback_share = 0.9 * baseline + 0.1 * share;
        // Push-back above every level that succeeded: the capacity is below it.
        // With no success at all (an outage, not a cap), nothing is learned about capacity.
        let above: Vec<usize> =
            if ok_level == 0 { Vec::new() } else { refused.iter().copied().filter(|l| *l > ok_level).collect() };
        let suspect = std::mem::replace(&mut c.suspect, above.len() == 1);
        if above.len() >= 2 || (above.len() == 1 && suspect) {
            let lowest = above.iter().copied().min().unwrap_or(limit + 1);
            me.set_ceiling(&mut c, lowest.saturating_sub(1).max(ok_level));
            return;
        }
        if above.len() == 1 {
            // One refusal at the top: wait for the next round to tell a cap from a fault.
            return;
        }
        if refused.len() >= 3 && share > 0.1 && share > 2.0 * baseline {
            c.slow_start = false;
            me.set_limit(&mut c, ((limit as f64) * 0.9).floor() as usize);
            return;
        }
        // While cuts for latency are judged, every round's answers are evidence.
        if let Some((_, seen)) = &mut c.slow_cuts {
            seen.extend(samples.iter().copied());
            let excess = seen.len().saturating_sub(SLOW_SAMPLES_KEPT);
            seen.drain(..excess);
        }
        if slower {
            c.slow_start = false;
            // Latency that comes from load falls when fewer calls are out. Once the cuts have
            // halved the calls out, the calls sent with at most half as many out are compared
            // with those sent with more, over the same cuts: not two fifths faster, the latency
            // is the endpoint's own (a server that answers in 43 ms at any load, after a few
            // fast first answers; or answers at random), it becomes the best, and the cuts are
            // undone. A tester's healthy server ran at 1 call out, 28 answers a second, against
            // 1,078 at 64. (Measured against one slow round instead, chance alone made the
            // rounds after it look faster, and random latencies walked the limit down.)
            let round_limit = c.round_limit;
            let (at, seen) = c.slow_cuts.get_or_insert_with(|| (round_limit, samples.clone()));
            let at = *at;
            let half = at as f64 / 2.0;
            let (fewer, more): (Vec<Sample>, Vec<Sample>) = seen.iter().partition(|(_, level)| *level as f64 <= half);
            let judged = |part: &[Sample]| median(part.iter().map(|(rtt, _)| *rtt)).filter(|_| part.len() >= 3);
            if let (true, Some(low), Some(high)) = (round_limit as f64 <= half, judged(&fewer), judged(&more)) {
                if low >= 0.6 * high {
                    c.best_rtt = Some(low);
                    c.slow_cuts = None;
                    me.set_limit(&mut c, at);
                    return;
                }
                // Faster with fewer out: load. Judged again from here.
                c.slow_cuts = Some((round_limit, samples));
            }
            me.set_limit(&mut c, ((limit as f64) * 0.9).floor() as usize);
            return;
        }
        // Grown back to where the cuts began: nothing left to judge.
        if c.slow_cuts.as_ref().is_some_and(|(at, _)| limit >= *at) {
            c.slow_cuts = None;
        }
        if !bound {
            return;
        }
        if c.ceiling.is_some_and(|ceiling| limit > ceiling) {
            // A probe above the ceiling went through a whole round: the ceiling is stale.
            c.ceiling = None;
            c.probing = false;
            c.probe_every = FIRST_PROBE_AFTER;
        }
        if c.slow_start {
            // Grown with each success (above).
        } else if c.ceiling.is_none_or(|ceiling| limit < ceiling) {
            me.set_limit(&mut c, limit + 1);
        } else {
            c.rounds_at_ceiling += 1;
            if c.rounds_at_ceiling >= c.probe_every {
                c.rounds_at_ceiling = 0;
                c.probing = true;
                me.set_limit(&mut c, limit + 1);
            }
        }
    }

    fn current(&self) -> usize {
        self.0.ctl.lock().unwrap_or_else(|e| e.into_inner()).limit
    }

    fn borrow(&self, n: usize) -> usize {
        let mut c = self.0.ctl.lock().unwrap_or_else(|e| e.into_inner());
        // Slots free now are taken at once; the rest as calls in flight end (the debt).
        let n = n.min(c.limit);
        let taken = self.0.sem.forget_permits(n);
        c.debt += n - taken;
        n
    }

    fn repay(&self, n: usize) {
        let mut c = self.0.ctl.lock().unwrap_or_else(|e| e.into_inner());
        let repaid = n.min(c.debt);
        c.debt -= repaid;
        self.0.sem.add_permits(n - repaid);
    }

    fn export(&self) -> Option<(usize, Option<usize>)> {
        let c = self.0.ctl.lock().unwrap_or_else(|e| e.into_inner());
        Some((c.limit, c.ceiling))
    }

    fn seed(&self, limit: usize, ceiling: Option<usize>) {
        let me = &self.0;
        let mut c = me.ctl.lock().unwrap_or_else(|e| e.into_inner());
        me.set_limit(&mut c, limit);
        c.ceiling = ceiling.map(|x| x.clamp(1, me.max));
        // Found already: no slow start from the beginning (its doubling would overshoot a cap).
        c.slow_start = false;
    }
}

/// Holds new calls until a moment the server named.
#[derive(Debug, Default)]
pub struct Gate {
    until: Mutex<Option<Instant>>,
}

impl Gate {
    /// Holds calls for `delay` from now (extending, never shortening, a hold in force).
    pub fn hold(&self, delay: Duration) {
        let at = Instant::now() + delay;
        let mut until = self.until.lock().unwrap_or_else(|e| e.into_inner());
        if until.is_none_or(|u| u < at) {
            *until = Some(at);
        }
    }

    /// Waits until no hold is in force; returns how long it waited.
    pub async fn wait(&self) -> Duration {
        let start = Instant::now();
        loop {
            let until = *self.until.lock().unwrap_or_else(|e| e.into_inner());
            match until {
                Some(u) if u > Instant::now() => tokio::time::sleep_until(u).await,
                _ => return start.elapsed(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn gate_holds_everyone_until_the_advised_moment() {
        let gate = Arc::new(Gate::default());
        assert_eq!(gate.wait().await, Duration::ZERO);
        gate.hold(Duration::from_secs(5));
        gate.hold(Duration::from_secs(2)); // never shortens
        let t0 = Instant::now();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                tokio::spawn({
                    let g = gate.clone();
                    async move { g.wait().await }
                })
            })
            .collect();
        for w in waiters {
            assert_eq!(w.await.unwrap(), Duration::from_secs(5));
        }
        assert_eq!(t0.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_limit_slow_starts_then_drops_to_the_capacity_it_hit() {
        let a = Adaptive(AdaptiveLimit::new(4, 64));
        let round = |a: &Adaptive, result: CallResult| {
            let a = a.clone();
            async move {
                let n = a.current();
                let mut permits = Vec::new();
                for _ in 0..n {
                    permits.push(a.acquire().await);
                }
                for (_, level) in &permits {
                    a.feedback(*level, Duration::from_millis(50), result);
                }
                drop(permits);
            }
        };
        round(&a, CallResult::Ok).await;
        assert_eq!(a.current(), 8);
        round(&a, CallResult::Ok).await;
        assert_eq!(a.current(), 16);
        // A single refusal at level 13 is not yet a cap (a random fault looks the same)...
        let mut permits = Vec::new();
        for _ in 0..13 {
            permits.push(a.acquire().await);
        }
        a.feedback(13, Duration::from_millis(1), CallResult::Backpressure);
        assert_eq!(a.current(), 16);
        // ...but level 13 refused again and again, above every success, is: capacity 12.
        a.feedback(13, Duration::from_millis(1), CallResult::Backpressure);
        a.feedback(13, Duration::from_millis(1), CallResult::Backpressure);
        drop(permits);
        assert_eq!(a.current(), 12);
        // At the ceiling it stays for 20 full rounds, then probes one higher.
        for _ in 0..19 {
            round(&a, CallResult::Ok).await;
            assert_eq!(a.current(), 12);
        }
        round(&a, CallResult::Ok).await;
        assert_eq!(a.current(), 13);
        // Latency doubling lowers it.
        round(&a, CallResult::Ok).await;
        let before = a.current();
        let n = a.current();
        let mut permits = Vec::new();
        for _ in 0..n {
            permits.push(a.acquire().await);
        }
        for (_, level) in &permits {
            a.feedback(*level, Duration::from_millis(200), CallResult::Ok);
        }
        drop(permits);
        assert!(a.current() < before);
    }

    /// Refusals over `calls` calls to an endpoint that refuses a call arriving when `cap` are in
    /// flight, with calls always waiting: the oldest call ends (a refusal at once), and new ones
    /// fill the limit again.
    async fn refusals_under_a_cap(a: &Adaptive, cap: usize, calls: usize) -> usize {
        let mut in_flight = std::collections::VecDeque::new();
        let mut refused = 0;
        for _ in 0..calls {
            while in_flight.len() < a.current() {
                let (permit, level) = a.acquire().await;
                in_flight.push_back((permit, level, level > cap));
            }
            // A refused call comes back first; else the oldest answer.
            let next = in_flight.iter().position(|(_, _, refused)| *refused).unwrap_or(0);
            let (permit, level, was_refused) = in_flight.remove(next).expect("a call in flight");
            let result = if was_refused { CallResult::Backpressure } else { CallResult::Ok };
            refused += usize::from(was_refused);
            a.feedback(level, Duration::from_millis(100), result);
            drop(permit);
        }
        refused
    }

    #[tokio::test(start_paused = true)]
    async fn a_steady_cap_is_probed_less_and_less_often() {
        let a = Adaptive(AdaptiveLimit::new(16, 64));
        // The start finds the cap of 12.
        refusals_under_a_cap(&a, 12, 500).await;
        assert_eq!(a.current(), 12);
        // Probes above it find it again and again, each later than the last: over the next 600
        // round trips (of 12 calls) only a few probes (20, 40, 80, 160, 320 round trips apart),
        // of a few refusals each, refuse anything.
        let later = refusals_under_a_cap(&a, 12, 600 * 12).await;
        assert!(later <= 20, "{later} refusals in 600 round trips at a steady cap");
        assert_eq!(a.current(), 12);
        // A cap that rises is still found: the next probe goes through and the limit climbs.
        refusals_under_a_cap(&a, 20, 400 * 12).await;
        assert!(a.current() >= 19, "limit {} under a cap raised to 20", a.current());
    }

    /// Rounds of `limit` calls, each answered in `latency(level it was sent at)`.
    async fn rounds_at(a: &Adaptive, rounds: usize, latency: impl Fn(usize) -> Duration) {
        for _ in 0..rounds {
            let n = a.current();
            let mut permits = Vec::new();
            for _ in 0..n {
                permits.push(a.acquire().await);
            }
            for (_, level) in &permits {
                a.feedback(*level, latency(*level), CallResult::Ok);
            }
            drop(permits);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_latency_that_fewer_calls_do_not_bring_down_is_not_load() {
        // A tester's server answered its first calls in 1 ms, then in 43 ms at any load (a
        // small server's delayed acknowledgements): every round was "twice the best", and the
        // limit fell to 1 and stayed there. Now cuts that halve the calls out and change
        // nothing are undone.
        let a = Adaptive(AdaptiveLimit::new(16, 64));
        rounds_at(&a, 2, |_| Duration::from_millis(1)).await;
        rounds_at(&a, 200, |_| Duration::from_millis(43)).await;
        assert!(a.current() >= 32, "limit {} at a latency that does not track load", a.current());
        // An endpoint whose latency does track load (a call sent with more than 20 out queues)
        // is still held where the round's median call takes twice the best (half the round
        // is sent below its median level: about 80 out), far below the most allowed.
        let b = Adaptive(AdaptiveLimit::new(16, 256));
        let queueing = |level: usize| Duration::from_millis(40 * (level.max(20) as u64) / 20);
        rounds_at(&b, 300, queueing).await;
        assert!((40..=100).contains(&b.current()), "limit {} where latency doubles at 40 calls out", b.current());
    }

    #[tokio::test(start_paused = true)]
    async fn random_refusals_among_successes_do_not_lower_the_limit() {
        let a = Adaptive(AdaptiveLimit::new(20, 20));
        // 40 rounds in which one call in twenty, at a level that also succeeds, is refused.
        for r in 0..40usize {
            let mut permits = Vec::new();
            for _ in 0..20 {
                permits.push(a.acquire().await);
            }
            for (i, (_, level)) in permits.iter().enumerate() {
                let refused = i == (r * 7) % 20;
                let result = if refused { CallResult::Backpressure } else { CallResult::Ok };
                a.feedback(*level, Duration::from_millis(100), result);
            }
            drop(permits);
        }
        assert_eq!(a.current(), 20);
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_limit_really_limits_after_a_decrease() {
        let a = Adaptive(AdaptiveLimit::new(8, 8));
        let held: Vec<_> = {
            let mut v = Vec::new();
            for _ in 0..8 {
                v.push(a.acquire().await);
            }
            v
        };
        a.feedback(2, Duration::from_millis(1), CallResult::Ok);
        for _ in 0..3 {
            a.feedback(3, Duration::from_millis(1), CallResult::Backpressure);
        }
        assert_eq!(a.current(), 2);
        drop(held);
        let (_p1, _) = a.acquire().await;
        let (_p2, _) = a.acquire().await;
        let a2 = a.clone();
        let third = tokio::spawn(async move { a2.acquire().await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!third.is_finished(), "only two slots after the drop");
        third.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn fixed_limit_bounds_permits() {
        let l = Arc::new(FixedLimit::new(2));
        let (a, _) = l.acquire().await;
        let (_b, level) = l.acquire().await;
        assert_eq!(level, 2);
        let l2 = l.clone();
        let third = tokio::spawn(async move { l2.acquire().await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!third.is_finished());
        drop(a);
        tokio::time::timeout(Duration::from_millis(10), third).await.unwrap().unwrap();
    }
}
