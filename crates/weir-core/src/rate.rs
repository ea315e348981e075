//! Client-side rate budgets: requests and tokens per window, given or learned.
//!
//! Providers count admitted requests (and their tokens) over a sliding window per key and refuse
//! the rest with 429. The physical limit is to send exactly what the window admits, as soon as
//! it admits it. A [`Budget`] mirrors the provider's window on the client side, in one of three
//! modes:
//!
//! - **Unlimited** — nothing is known; every send is logged (for learning) and allowed.
//! - **Static** — the capacity is known (`--rpm`/`--tpm`, or `x-ratelimit-limit-*` headers): a
//!   send is allowed when the weights logged in the last window plus its own fit the capacity.
//! - **Learned** — a 429 said the window is full, but not how big it is. From then on every
//!   admitted request hands back its weight as a *credit* exactly one window after it was sent,
//!   which is when the provider's window frees its slot; sends spend credits. A refused request
//!   hands back nothing, so a quota that shrinks is followed within one window; two windows with
//!   no refusal while sends are waiting mint one probe credit, so a quota that grows is found.
//!   The window's length comes from the first 429's advised delay (the oldest admitted send
//!   plus the window is when the server said to come back) and is refined by later ones.
//!
//! Weights are 1 per request for the request budget, and counted tokens for the token budget:
//! an estimate at send time, replaced by the usage the answer reports. Time comes from
//! `tokio::time`, so every path is tested under paused time.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use tokio::time::Instant;

/// Most sends remembered while nothing is known: bounds memory (about 2 MB) at high rates. A
/// window holding more sends than this is learned too short at first, and refined by later 429s.
const MAX_LOG: usize = 50_000;
/// How long sends are remembered while nothing is known.
const HORIZON: Duration = Duration::from_secs(3600);

/// How a budget decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// No limit known.
    Unlimited,
    /// A known capacity per window.
    Static {
        /// Weight admitted per window.
        capacity: f64,
    },
    /// Capacity learned from refusals.
    Learned,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Pending,
    Ok,
}

#[derive(Debug, Clone)]
struct Entry {
    id: u64,
    at: Instant,
    weight: f64,
    state: State,
}

/// One dimension (requests or tokens) of a rate budget.
#[derive(Debug)]
pub struct Budget {
    mode: Mode,
    window: Option<Duration>,
    log: VecDeque<Entry>,
    in_window: f64,
    credits: f64,
    overdue: HashMap<u64, f64>,
    last_refusal: Option<Instant>,
    last_probe: Option<Instant>,
    probe: f64,
    refusals: u64,
    /// The window assumed when a refusal does not say when to come back.
    default_window: Duration,
}

/// True for advice in whole seconds (`retry-after: 2`, `retryDelay: "13s"`): rounded up, so the
/// real delay may be up to a second shorter.
fn is_coarse(d: Duration) -> bool {
    d.subsec_nanos() == 0 && d >= Duration::from_secs(1)
}

/// The default window when a refusal does not say when to come back.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(60);

impl Budget {
    /// A budget with no limit known.
    pub fn unlimited() -> Self {
        Self::with_mode(Mode::Unlimited, None)
    }

    /// A budget of `capacity` per `window`.
    pub fn fixed(capacity: f64, window: Duration) -> Self {
        Self::with_mode(Mode::Static { capacity }, Some(window))
    }

    fn with_mode(mode: Mode, window: Option<Duration>) -> Self {
        Self {
            mode,
            window,
            log: VecDeque::new(),
            in_window: 0.0,
            credits: 0.0,
            overdue: HashMap::new(),
            last_refusal: None,
            last_probe: None,
            probe: 1.0,
            refusals: 0,
            default_window: DEFAULT_WINDOW,
        }
    }

    /// Assumes `window` when a refusal does not say when to come back (a provider whose 429s
    /// advise nothing, such as Vertex AI; `--limit-window` says how long its quota window is).
    pub fn with_default_window(mut self, window: Duration) -> Self {
        self.default_window = window;
        self
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The window, when known.
    pub fn window(&self) -> Option<Duration> {
        self.window
    }

    /// Refusals seen.
    pub fn refusals(&self) -> u64 {
        self.refusals
    }

    /// The weight the budget currently lets through per window: the capacity when static, the
    /// credits in circulation when learned.
    pub fn effective_capacity(&self) -> Option<f64> {
        match self.mode {
            Mode::Unlimited => None,
            Mode::Static { capacity } => Some(capacity),
            Mode::Learned => Some(
                self.credits.max(0.0)
                    + self.log.iter().map(|e| e.weight).sum::<f64>()
                    + self.overdue.values().sum::<f64>(),
            ),
        }
    }

    /// Safety margin added to the window: the server counts a request when it arrives, a little
    /// after the client sent it, so the client frees a slot a little later than the server does.
    fn margin(window: Duration) -> Duration {
        (window / 100).max(Duration::from_millis(20)).min(Duration::from_secs(1))
    }

    fn expire(&mut self, now: Instant) {
        match self.mode {
            Mode::Unlimited => {
                while self.log.len() > MAX_LOG || self.log.front().is_some_and(|e| now.duration_since(e.at) > HORIZON) {
                    self.log.pop_front();
                }
            }
            Mode::Static { .. } => {
                let w = self.window.unwrap_or(DEFAULT_WINDOW);
                let span = w + Self::margin(w);
                while let Some(e) = self.log.front() {
                    if e.at + span > now {
                        break;
                    }
                    self.in_window -= e.weight;
                    self.log.pop_front();
                }
                if self.log.is_empty() {
                    self.in_window = 0.0;
                }
            }
            Mode::Learned => {
                let w = self.window.unwrap_or(DEFAULT_WINDOW);
                let span = w + Self::margin(w);
                while let Some(e) = self.log.front() {
                    if e.at + span > now {
                        break;
                    }
                    let e = self.log.pop_front().expect("front exists");
                    match e.state {
                        State::Ok => self.credits += e.weight,
                        // Its credit comes back when it turns out to have been admitted.
                        State::Pending => {
                            self.overdue.insert(e.id, e.weight);
                        }
                    }
                }
            }
        }
    }

    /// Tries to take `weight` at `now` for send `id`. On refusal, returns when to try again
    /// (`None`: when some send completes).
    pub fn try_take(&mut self, id: u64, weight: f64, now: Instant) -> Result<(), Option<Instant>> {
        self.expire(now);
        let ok = match self.mode {
            Mode::Unlimited => true,
            Mode::Static { capacity } => self.in_window + weight <= capacity || self.log.is_empty(),
            Mode::Learned => {
                let w = self.window.unwrap_or(DEFAULT_WINDOW);
                let quiet_since = self.last_refusal.max(self.last_probe).unwrap_or(now);
                if self.credits < weight && now.duration_since(quiet_since) >= w * 2 {
                    // Two windows without a refusal while sends wait: probe for more.
                    self.credits += self.probe;
                    self.last_probe = Some(now);
                }
                // Nothing will ever come back when nothing is out: let one through.
                self.credits >= weight || (self.log.is_empty() && self.overdue.is_empty())
            }
        };
        if ok {
            match self.mode {
                Mode::Static { .. } => self.in_window += weight,
                Mode::Learned => self.credits -= weight,
                Mode::Unlimited => {}
            }
            self.log.push_back(Entry { id, at: now, weight, state: State::Pending });
            return Ok(());
        }
        let w = self.window.unwrap_or(DEFAULT_WINDOW);
        let span = w + Self::margin(w);
        Err(match self.mode {
            Mode::Static { capacity } => {
                let mut freed = 0.0;
                let need = self.in_window + weight - capacity;
                let mut at = None;
                for e in &self.log {
                    freed += e.weight;
                    at = Some(e.at + span);
                    if freed >= need {
                        break;
                    }
                }
                at
            }
            Mode::Learned => {
                let quiet_since = self.last_refusal.max(self.last_probe).unwrap_or(now);
                let probe_at = quiet_since + w * 2;
                let next_credit = self.log.iter().find(|e| e.state == State::Ok).map(|e| e.at + span);
                Some(next_credit.map_or(probe_at, |c| c.min(probe_at)))
            }
            Mode::Unlimited => None,
        })
    }

    fn position(&self, id: u64) -> Option<usize> {
        self.log.binary_search_by_key(&id, |e| e.id).ok()
    }

    /// The send of `id` really happened at `now` (later than its slot was taken). Its entry keeps
    /// its place in the log; an entry stamped later than the ones behind it only delays their
    /// expiry, which errs on the side of fewer sends, never more.
    pub fn restamp(&mut self, id: u64, now: Instant) {
        if let Some(i) = self.position(id) {
            self.log[i].at = self.log[i].at.max(now);
        }
    }

    /// The send was admitted; its real weight is `weight`.
    pub fn admitted(&mut self, id: u64, weight: f64) {
        if let Some(i) = self.position(id) {
            let e = &mut self.log[i];
            if matches!(self.mode, Mode::Static { .. }) {
                self.in_window += weight - e.weight;
            } else if self.mode == Mode::Learned {
                self.credits += e.weight - weight;
            }
            e.weight = weight;
            e.state = State::Ok;
        } else if self.overdue.remove(&id).is_some() {
            // It outlived the window while pending: its credit comes back now, at its real weight.
            self.credits += weight;
        }
    }

    /// The send was refused by this quota at `now`; the server advised `delay`, if it did.
    pub fn refused(&mut self, id: u64, now: Instant, delay: Option<Duration>) {
        self.refusals += 1;
        let removed = self.position(id).map(|i| self.log.remove(i).expect("index is valid"));
        self.overdue.remove(&id);
        match self.mode {
            Mode::Static { .. } => {
                if let Some(e) = &removed {
                    self.in_window -= e.weight;
                }
            }
            Mode::Unlimited => {
                // The window is full. It frees its oldest slot when the server said to come back;
                // our oldest admitted send is that slot.
                // Sends still in flight count too: a refusal is fast and can overtake the answers
                // of the sends that filled the window.
                let oldest = self.log.iter().find(|e| e.state == State::Ok).or_else(|| self.log.front()).map(|e| e.at);
                if oldest.is_none() {
                    // Refused with no other send of ours admitted or out: someone else filled the
                    // window (another process on the same key), and nothing about its size can
                    // be told from that. The server's advised pause holds the calls; learn from
                    // a refusal that follows sends of our own.
                    self.last_refusal = Some(now);
                    return;
                }
                self.window = Some(match (delay, oldest) {
                    (Some(d), Some(at)) => {
                        (now + d).duration_since(at).clamp(Duration::from_millis(500), Duration::from_secs(3600))
                    }
                    _ => self.default_window,
                });
                self.mode = Mode::Learned;
                self.credits = 0.0;
                let admitted: Vec<f64> = self.log.iter().filter(|e| e.state == State::Ok).map(|e| e.weight).collect();
                if !admitted.is_empty() {
                    self.probe = (admitted.iter().sum::<f64>() / admitted.len() as f64).max(1.0);
                }
                self.expire(now);
            }
            Mode::Learned => {
                // A refused send spent a credit and gets none back: the budget shrinks by it.
                // Refine the window: the server's next free slot should be our oldest credit.
                if let (Some(d), Some(w)) = (delay, self.window) {
                    if let Some(e) = self.log.iter().find(|e| e.state == State::Ok) {
                        let predicted =
                            (e.at + w).duration_since(now).as_secs_f64() - now.duration_since(e.at + w).as_secs_f64();
                        // Advice in whole seconds (`retry-after: 2`) says only that the slot
                        // frees within the second before `d`; a prediction inside that second is
                        // not an error (taking `d` as exact would lengthen the window each time).
                        let hi = d.as_secs_f64();
                        let lo = if is_coarse(d) { (hi - 1.0).max(0.0) } else { hi };
                        let err = if predicted < lo {
                            lo - predicted
                        } else if predicted > hi {
                            hi - predicted
                        } else {
                            0.0
                        };
                        if err != 0.0 && err.abs() < w.as_secs_f64() / 2.0 {
                            self.window = Some(Duration::from_secs_f64((w.as_secs_f64() + err / 2.0).max(0.5)));
                        }
                    }
                }
            }
        }
        self.last_refusal = Some(now);
    }

    /// The send failed for another reason; the server may have counted it, so keep it.
    pub fn failed(&mut self, id: u64) {
        if let Some(i) = self.position(id) {
            self.log[i].state = State::Ok;
        } else if let Some(w) = self.overdue.remove(&id) {
            self.credits += w;
        }
    }

    /// Removes a send that did not happen or was not counted by this quota.
    pub(crate) fn forget(&mut self, id: u64) {
        if let Some(i) = self.position(id) {
            let e = self.log.remove(i).expect("index is valid");
            match self.mode {
                Mode::Static { .. } => self.in_window -= e.weight,
                Mode::Learned => self.credits += e.weight,
                Mode::Unlimited => {}
            }
        } else if let Some(w) = self.overdue.remove(&id) {
            self.credits += w;
        }
    }

    /// Sets a capacity and window learned from response headers (unless the user gave one).
    pub fn learn_capacity(&mut self, capacity: u64, window: Option<Duration>) {
        if capacity == 0 {
            return;
        }
        let window = window.filter(|w| *w >= Duration::from_millis(100)).or(self.window).unwrap_or(DEFAULT_WINDOW);
        let window =
            self.window.map_or(window, |old| if self.mode == Mode::Learned { window } else { old.max(window) });
        if self.mode != (Mode::Static { capacity: capacity as f64 }) || self.window != Some(window) {
            let pending: f64 = self.log.iter().map(|e| e.weight).sum();
            self.mode = Mode::Static { capacity: capacity as f64 };
            self.window = Some(window);
            self.in_window = pending;
            self.overdue.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn static_budget_admits_capacity_per_window() {
        let mut b = Budget::fixed(3.0, Duration::from_secs(1));
        let t0 = Instant::now();
        for id in 0..3 {
            assert!(b.try_take(id, 1.0, t0).is_ok());
        }
        let again = b.try_take(3, 1.0, t0).unwrap_err().unwrap();
        assert_eq!(again, t0 + Duration::from_secs(1) + ms(20));
        assert!(b.try_take(3, 1.0, again).is_ok());
        // A refused send gives its slot back at once.
        b.refused(3, again, None);
        assert!(b.try_take(4, 1.0, again).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn token_weights_are_corrected_by_usage() {
        let mut b = Budget::fixed(100.0, Duration::from_secs(1));
        let t0 = Instant::now();
        assert!(b.try_take(0, 80.0, t0).is_ok());
        assert!(b.try_take(1, 30.0, t0).is_err());
        b.admitted(0, 50.0); // the answer was shorter than estimated
        assert!(b.try_take(1, 30.0, t0).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn first_refusal_learns_the_window_and_credits_replay_it() {
        let mut b = Budget::unlimited();
        let t0 = Instant::now();
        // Five sends admitted at t0..t0+40ms, the sixth refused at 50ms with "come back in 950ms":
        // the window is 1 s.
        for id in 0..5u64 {
            let at = t0 + ms(id * 10);
            b.try_take(id, 1.0, at).unwrap();
            b.admitted(id, 1.0);
        }
        b.try_take(5, 1.0, t0 + ms(50)).unwrap();
        b.refused(5, t0 + ms(50), Some(ms(950)));
        assert_eq!(b.mode(), Mode::Learned);
        assert_eq!(b.window(), Some(Duration::from_secs(1)));
        // No credit until the first admitted send leaves the window.
        let next = b.try_take(6, 1.0, t0 + ms(60)).unwrap_err().unwrap();
        assert_eq!(next, t0 + Duration::from_secs(1) + ms(20));
        assert!(b.try_take(6, 1.0, next).is_ok());
        assert!(b.try_take(7, 1.0, next).is_err(), "one credit per expired send");
        // Over the next window exactly five sends go out.
        let mut sent = 1;
        let mut t = next;
        for id in 7..100 {
            t += ms(5);
            if b.try_take(id, 1.0, t).is_ok() {
                b.admitted(id, 1.0);
                sent += 1;
            }
            if t > t0 + Duration::from_secs(2) {
                break;
            }
        }
        assert_eq!(sent, 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shrinking_quota_is_followed_and_a_growing_one_probed() {
        let mut b = Budget::unlimited();
        let t0 = Instant::now();
        for id in 0..4u64 {
            b.try_take(id, 1.0, t0).unwrap();
            b.admitted(id, 1.0);
        }
        // Exact advice (not whole seconds), so the window is taken as told.
        b.try_take(4, 1.0, t0).unwrap();
        b.refused(4, t0, Some(ms(999)));
        assert_eq!(b.effective_capacity(), Some(4.0));
        // Next window: one of the four is refused (the quota dropped to 3).
        let t1 = t0 + Duration::from_secs(2);
        for id in 5..9u64 {
            b.try_take(id, 1.0, t1).unwrap();
        }
        for id in 5..8u64 {
            b.admitted(id, 1.0);
        }
        b.refused(8, t1, Some(ms(999)));
        assert_eq!(b.effective_capacity(), Some(3.0));
        // Quiet for two windows while sends wait: one probe credit.
        let t2 = t1 + Duration::from_millis(2100);
        let mut n = 0;
        for id in 9..20u64 {
            if b.try_take(id, 1.0, t2).is_ok() {
                b.admitted(id, 1.0);
                n += 1;
            }
        }
        assert_eq!(n, 4, "three credits back and one probe");
    }

    #[tokio::test(start_paused = true)]
    async fn whole_second_advice_does_not_stretch_the_window() {
        let mut b = Budget::unlimited();
        let t0 = Instant::now();
        for id in 0..2u64 {
            b.try_take(id, 1.0, t0).unwrap();
            b.admitted(id, 1.0);
        }
        // Refused at 200 ms with "retry-after: 5": the window looks like 5.2 s.
        b.try_take(2, 1.0, t0 + ms(200)).unwrap();
        b.refused(2, t0 + ms(200), Some(Duration::from_secs(5)));
        assert_eq!(b.window(), Some(ms(5200)));
        // The next window: a send refused 0.6 s before our oldest credit returns, told "1 s"
        // (rounded up from anything in 0..1 s): consistent, so the window stays.
        let t1 = t0 + ms(5300);
        assert!(b.try_take(3, 1.0, t1).is_ok());
        b.admitted(3, 1.0);
        assert!(b.try_take(4, 1.0, t1).is_ok());
        b.refused(4, t1 + ms(4600), Some(Duration::from_secs(1)));
        assert_eq!(b.window(), Some(ms(5200)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_before_any_own_send_was_admitted_teaches_nothing() {
        // Another process filled the window: our very first send is refused.
        let mut b = Budget::unlimited();
        let t0 = Instant::now();
        b.try_take(0, 1.0, t0).unwrap();
        b.refused(0, t0, Some(Duration::from_secs(4)));
        assert_eq!(b.mode(), Mode::Unlimited, "no window of 60 s with no credits");
        // Once the window frees, sends go out as before, and a later refusal teaches.
        let t1 = t0 + Duration::from_secs(4);
        for id in 1..4u64 {
            b.try_take(id, 1.0, t1).unwrap();
            b.admitted(id, 1.0);
        }
        b.try_take(4, 1.0, t1).unwrap();
        b.refused(4, t1, Some(ms(999)));
        assert_eq!((b.mode(), b.window()), (Mode::Learned, Some(ms(999))));
    }

    #[tokio::test(start_paused = true)]
    async fn headers_set_a_static_capacity() {
        let mut b = Budget::unlimited();
        b.learn_capacity(2, Some(Duration::from_secs(5)));
        let t0 = Instant::now();
        assert!(b.try_take(0, 1.0, t0).is_ok());
        assert!(b.try_take(1, 1.0, t0).is_ok());
        assert!(b.try_take(2, 1.0, t0).is_err());
        assert_eq!(b.mode(), Mode::Static { capacity: 2.0 });
    }
}
