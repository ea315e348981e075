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
//!   hands back nothing, so a quota that shrinks is followed within one window; a window with
//!   no refusal while sends are waiting mints one probe credit, and an admitted probe mints two
//!   more while sends still wait (doubling every round trip until a refusal; credits that no send
//!   waits for prove nothing and are not minted), so a quota that grows, or that another
//!   process stopped using, is taken up within a window or two. Beside other processes that
//!   decide alone (no shared throttle), a probe whose round is refused doubles the windows to
//!   the next one, up to two: their probes take each other's slots.
//!   The window's length comes from the first 429's advised delay (the oldest admitted send
//!   plus the window is when the server said to come back) and is refined by later ones.
//!   Advice in whole seconds (`retry-after: 5`, rounded up) leaves a second open; quota windows
//!   advised that way are whole seconds themselves (a second, a minute), so the window is the
//!   one whole second in what is open. A fixed window — counts start again at set times, and a
//!   refusal advises the time to the window's end — looks shorter than it is from a send made
//!   after it started; credits then come back before the server's window ends, the burst they
//!   fund is refused, and that refusal says how much longer the window is (from the last
//!   advised time that passed): the window is lengthened, in whole seconds, and the credits in
//!   hand are held until the server said to come back.
//!   So that such a round costs one refusal rather than every call it funds, a budget sends a
//!   *scout* ahead of the first credits that come back after the window was learned from
//!   whole-second advice (the only client of a quota, see [`Budget::sole`], also after it
//!   changed), until scouts of two rounds in a row are admitted: the other sends wait for its answer, and a refused scout holds every send until
//!   the advised time. The window opens anew then (it is fixed), with nothing of ours sent
//!   since the scout, so the next refusal measures both the window and what it admits. A
//!   window learned across a reset (from sends of the window before, too long and too large)
//!   is found by a refusal that advises a later end than a sliding window of that length
//!   would, and is shortened to what the last reset allows.
//!   Scouts prove a window only when a round's sends go out together: spread over the window
//!   (fewer calls out than the quota's rate needs), they find it open while it is still taken a
//!   second or three too long. What settles it is where the server's windows end: each refusal
//!   in whole seconds brackets an end within a second, and refused and admitted sends around it
//!   narrow the bracket; a fixed window's ends fall on a lattice of its period, so once three
//!   ends agree on one (`Budget::lattice`), the window is taken as that period, its
//!   capacity as what we sent in the window that refused, and no other rule changes it after.
//!   Probes for more grow by one each there, not doubling: a fixed window admits every probe
//!   sent soon after it opens, full or not. Beside other processes that decide alone, the ends
//!   only ever lengthen the window (a sliding window's ends bunch up where everyone's sends
//!   are, and a shorter lattice fits them), to the shortest period they allow. A period is
//!   taken only when the ends are known closely enough to tell it (one of a second fits any
//!   ends), and never as less than half the window in force (a window measured across a reset
//!   is at most twice the server's). A window learned short while other traffic filled part of
//!   it (a run started just after another) is found by its cost: when a quarter of what the
//!   budget holds is refused within one window, on sends made on that window and no probes,
//!   the window is a second longer. Beside other processes that decide alone, whose probes
//!   also refuse sends of ours, such a burst instead holds the credits until the advised time
//!   and sends a scout ahead of the next round; a window known only as at least the longest
//!   wait advised is a second longer when that scout is refused too.
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
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
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

/// What a probe send was for, kept until its answer says how it went.
#[derive(Debug, Clone, Copy)]
enum Probe {
    /// More capacity: admitted, it keeps its credit and mints two more probes (so probing
    /// doubles every round trip until a refusal), unless a refusal came since (`epoch`).
    Capacity { epoch: u64 },
}

/// Whether credits that come back on the budget's own schedule are trusted to find the server's
/// window open. A window learned from advice in whole seconds may be too short (a fixed window
/// entered late looks shorter than it is): until sends funded by returning credits have been
/// admitted in two rounds in a row, the first such send of a round goes alone — a scout — and
/// the others wait for its answer, so a window measured short costs one refusal instead of
/// every call its early credits fund.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Scout {
    /// Scouts of two rounds in a row were admitted since the window was last learned or
    /// changed. (One proves nothing: the first credits back after learning come back when the
    /// server's window, measured up to its end, starts again — whatever its length.)
    Trusted,
    /// The first send at or after this moment scouts.
    After(Instant),
    /// The scout of this id, sent at this moment, is out: other sends wait for its answer.
    Out(u64, Instant),
}

/// A fixed window's opening, bracketed by a refused scout and the end of the hold that followed
/// (the server's advised time): nothing of ours was sent in between.
#[derive(Debug, Clone)]
struct Opened {
    /// When the scout was refused: the window had not opened anew yet.
    earliest: Instant,
    /// When the hold ended: the window had opened anew.
    latest: Instant,
    /// What we sent before the scout and the server counted: `before[k]` is the weight of the
    /// sends made from `k + 1` seconds before `latest` on, which the window before held in full
    /// if it was `k + 1` seconds long (it ended after `earliest` and no later than `latest`).
    before: Vec<f64>,
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
    /// While unlimited: a refusal came with no send of ours admitted or out, so other traffic
    /// filled the window; the advised time passing says nothing of our own sends then.
    others_filled: bool,
    last_probe: Option<Instant>,
    /// Windows between capacity probes: one, or, while probes keep meeting refusals, up to
    /// [`MAX_SOLE_PROBE_GAP`] (up to [`MAX_PROBE_GAP`] beside other processes deciding alone;
    /// see [`Budget::refused`]).
    probe_gap: u32,
    probe: f64,
    /// Probe credits minted and not yet spent, and what the sends that spend them are for.
    unspent_probe: (f64, Option<Probe>),
    /// Probe sends in flight.
    probes: HashMap<u64, Probe>,
    /// Counts refusals, so a probe admitted after a refusal mints nothing.
    epoch: u64,
    /// When the last refusal advised to come back.
    come_back: Option<Instant>,
    /// When the last capacity probe was sent that the server admitted with no refusal since:
    /// refusals soon after it are the capacity's, not the window's.
    grew_at: Option<Instant>,
    /// The last time a refusal advised to come back that has passed: on a fixed window, within
    /// a second of the start of the window that followed.
    reset_at: Option<Instant>,
    /// The only client of its quota this process knows of (see [`Budget::sole`]).
    sole: bool,
    /// The capacity is one this process was told (`--rpm`, `--tpm`), not one an endpoint's
    /// headers gave: a run not told it does not take it from a state written down.
    told: bool,
    /// Until when refusals are of the burst that showed the window too short.
    short_until: Option<Instant>,
    /// Sends of ours that are no probes refused since the moment kept, within a window of it
    /// (see [`Budget::refused`]).
    lost: (Option<Instant>, f64),
    /// Beside other processes: when a quarter of a round our credits funded was refused at
    /// once (see [`Budget::refused`]).
    round_refused: Option<Instant>,
    /// The window is known only to be at least this long: taken from the longest wait a
    /// refusal advised, beside other processes, not from the server's ends.
    window_at_least: bool,
    /// When the window was last learned or changed by a refusal.
    changed_at: Option<Instant>,
    /// Credits held back until the server has room for them: when, and how much.
    deferred: Vec<(Instant, f64)>,
    /// The credits held back on resuming from a stop (an entry of `deferred`, by when it comes
    /// back) for what the others sent meanwhile: their sends, once told, take its place.
    reserved: Option<Instant>,
    /// Whether returning credits are trusted yet, or a scout goes first (see [`Scout`]).
    scout: Scout,
    /// Scouts admitted since the window was last learned or changed.
    scouts_admitted: u8,
    /// No send before then: a scout was refused, and the server's window is not open again
    /// until the time it advised.
    hold_until: Option<Instant>,
    /// A hold that followed a refused scout (see [`Opened`]): the server's window opened anew
    /// or a little before (a fixed window), and nothing of ours was sent in between, so the
    /// next refusal in that window measures both its length and its capacity.
    opened: Option<Opened>,
    /// The ends of the server's window that refusals advised in whole seconds, a few windows
    /// back, oldest first: each is a bracket `(lo, hi]` around one end (see [`Budget::lattice`]).
    ends: VecDeque<(Instant, Instant)>,
    /// A fixed window's period, found from the lattice its ends fall on: while it holds, no
    /// other rule changes the window.
    period: Option<Duration>,
    refusals: u64,
    /// The window assumed when a refusal does not say when to come back.
    default_window: Duration,
    /// The part of a static capacity in force (see [`Budget::set_part`]).
    part: f64,
    /// Refusals that advised no wait with nothing to go by: nothing learned yet, or every credit
    /// lost to refusals (see [`Budget::refused_blind`]).
    blind: Option<Blind>,
    /// The window in force is the default one, assumed when refusals advised no wait (see
    /// [`Budget::with_default_window`]), not one a server's advice measured.
    window_assumed: bool,
}

/// Refusals that advised no wait, while no send of ours was admitted since the first: another
/// run (or process) filled the window, and the server does not say for how long. Every call is
/// held, and one scout goes at a time, at waits that double up to [`BLIND_LONGEST`]: a run
/// started just after another on a per-minute quota whose 429s advise nothing (Vertex AI's)
/// sent 450 requests in the minute the window stayed full, all refused, and every one of its
/// 50 records failed once its retries ran out. The same once refusals with no advice took a
/// learned budget's every credit (its quota fell to nothing). After 10 minutes of it the run
/// stops (see [`crate::throttle::Throttle::judge`]).
#[derive(Debug, Clone, Copy)]
struct Blind {
    /// Rounds refused in a row: the first refusal's, then each scout's.
    rounds: u32,
    /// When the last round's hold began: refusals of sends made before then are of that round.
    since: Instant,
    /// When the first round began: nothing admitted since.
    first: Instant,
}

/// What a budget knew, handed from a process that held a shared quota to the one that takes
/// it over.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Seed {
    mode: Mode,
    window: Option<Duration>,
    probe: f64,
    capacity: f64,
    /// Each send of the last window: seconds before the export, and its weight.
    sends: Vec<(f64, f64)>,
    /// The window is a fixed window's period, found from the ends of its refusals (absent from
    /// what older versions wrote).
    #[serde(default)]
    fixed: bool,
    /// Where the budget was in learning the window (absent from what older versions wrote).
    #[serde(default)]
    learning: Option<Learning>,
    /// The capacity was told to the process that wrote this, not learned (absent from what
    /// older versions wrote).
    #[serde(default)]
    told: bool,
    /// The window was the writer's default (`--limit-window`), assumed because refusals advised
    /// no wait: a run given another takes its own (absent from what older versions wrote).
    #[serde(default)]
    assumed: bool,
    /// The writer's calls were held after refusals that advised no wait, none admitted since
    /// (see [`Blind`]): its rounds, and when the last and the first round began (absent from
    /// what older versions wrote).
    #[serde(default)]
    blind: Option<(u32, f64, f64)>,
    /// Since when every call the writer's throttle saw answered was refused for rate, none
    /// admitted (the requests budget's seed only; see [`Seed::with_refused_since`]).
    #[serde(default)]
    refused: Option<f64>,
}

impl Seed {
    /// This seed, saying that every call answered since `since` was refused and none admitted:
    /// a process taking a shared quota over counts the time toward the stop that a quota of
    /// zero makes (see [`crate::throttle::Throttle::judge`]) from there, not from its own
    /// first refusal. Processes sharing a quota of zero stopped after 12.5 and 16.5 minutes,
    /// not 10, as each began counting afresh when it took the quota over.
    pub fn with_refused_since(mut self, since: Option<Instant>, now: Instant) -> Seed {
        self.refused = since.map(|t| offset(t, now));
        self
    }

    /// Since when every call the writer saw answered was refused, as a moment here, the seed
    /// having been written at `written`.
    pub fn refused_since(&self, written: Instant) -> Option<Instant> {
        at_offset(written, self.refused?)
    }

    /// This seed as one share of `n` processes': a process that decides alone beside others
    /// that do too (the process holding their shared quota went silent) starts from what the
    /// holder knew rather than from nothing, which sent a burst the quota refused, and takes its
    /// part rather than the whole. The sends of the last window count at their share too.
    pub fn share(&self, n: usize) -> Seed {
        let part = 1.0 / n.max(1) as f64;
        let mut s = self.clone();
        s.capacity *= part;
        for send in &mut s.sends {
            send.1 *= part;
        }
        if let Some(l) = &mut s.learning {
            l.credits *= part;
            for d in &mut l.deferred {
                d.1 *= part;
            }
        }
        s
    }
}

/// What a learned budget knew of the server's window besides its length and capacity, for the
/// process that takes the quota over to go on from there rather than start learning afresh: a
/// holder killed before it knew a fixed window's period had, say, taken it as 4 s for 5, and
/// without its scouts and the ends it had seen, the next holder trusted its credits back after
/// 4 s and sent half a window into the last second of the server's. Moments are in seconds
/// from the export (negative: before it).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Learning {
    /// Credits free at the export (the rest are in `deferred` or with the sends).
    credits: f64,
    /// Credits held back until the server has room, and when they come back.
    deferred: Vec<(f64, f64)>,
    /// The brackets around the ends of the server's window (see [`Budget::lattice`]).
    ends: Vec<(f64, f64)>,
    /// `None` when credits coming back are trusted; else the moment from which a send scouts.
    scout: Option<f64>,
    scouts_admitted: u8,
    last_refusal: Option<f64>,
    last_probe: Option<f64>,
    come_back: Option<f64>,
    reset_at: Option<f64>,
    hold_until: Option<f64>,
    short_until: Option<f64>,
    grew_at: Option<f64>,
    refusals: u64,
    /// A refused scout's hold (see [`Opened`]): its earliest and latest moments, and `before`.
    opened: Option<(f64, f64, Vec<f64>)>,
    /// A fixed window's period, in seconds, once found.
    period: Option<f64>,
}

/// `t` as seconds from `now` (negative before it).
fn offset(t: Instant, now: Instant) -> f64 {
    if t >= now {
        (t - now).as_secs_f64()
    } else {
        -(now - t).as_secs_f64()
    }
}

/// The moment `secs` from `base` (see [`offset`]).
fn at_offset(base: Instant, secs: f64) -> Option<Instant> {
    if secs >= 0.0 {
        Some(base + Duration::from_secs_f64(secs))
    } else {
        base.checked_sub(Duration::from_secs_f64(-secs))
    }
}

impl Seed {
    /// The window the budget counted over, if it knew one.
    pub fn window(&self) -> Option<Duration> {
        (self.mode != Mode::Unlimited).then_some(self.window).flatten()
    }

    /// How long after it was written this seed still tells the next process something true:
    /// a window, the calls sent in it; calls held after refusals with no advice, as long as a
    /// round of that hold lasts (the writer sends a scout and writes again at least that often).
    /// A holder of a quota of zero killed up to 5 s after its last write otherwise handed on
    /// nothing, and the others began counting the 10 minutes to the stop afresh.
    pub fn current_for(&self) -> Duration {
        let held = if self.blind.is_some() { BLIND_LONGEST } else { Duration::ZERO };
        self.window().unwrap_or_default().max(held)
    }
}

/// True for advice in whole seconds (`retry-after: 2`, `retryDelay: "13s"`): rounded up, so the
/// real delay may be up to a second shorter.
fn is_coarse(d: Duration) -> bool {
    d.subsec_nanos() == 0 && d >= Duration::from_secs(1)
}

/// The shortest whole number of seconds longer than `lo`: a quota window counted in whole
/// seconds and known to be longer than `lo` (advice rounded up to `d` seconds means more than
/// `d - 1` are left).
fn whole_seconds(lo: Duration) -> Duration {
    Duration::from_secs(lo.as_secs() + 1)
}

/// The part of an advised delay during which the server surely refuses: all of exact advice,
/// a second less of advice in whole seconds (rounded up, so the slot may free up to a second
/// sooner).
pub fn surely_busy(d: Duration) -> Duration {
    if is_coarse(d) {
        d - Duration::from_secs(1)
    } else {
        d
    }
}

/// Whether a window of `shorter` may be the server's while `w` is in force. A window taken too
/// long was measured across a reset, from a send of the window before, so it is less than twice
/// the server's: anything shorter than half of it is no fixed window found but a sliding
/// window's refusals, which advise a second or so at any time (with other traffic on the key
/// before the run, one was taken as 1 s and refused down to a few sends a second).
fn may_shorten_to(shorter: Duration, w: Duration) -> bool {
    shorter * 2 >= w
}

/// How many ends of the server's window a budget keeps to find a fixed window's period.
const ENDS_KEPT: usize = 6;

/// How long a request or a refusal may take on the way, for placing the server's window ends:
/// the server counts a request a little after it was sent, and its refusal comes back a little
/// after the server advised from its own clock.
const END_MARGIN: Duration = Duration::from_millis(100);

/// Windows without a refusal, while sends wait, before a capacity probe.
const PROBE_AFTER_WINDOWS: u32 = 1;

/// Most windows between capacity probes beside other processes that decide alone: their
/// probes take the slots ours would, so a probe every window costs each of them a refusal a
/// window (with four processes, 5 % of a quota of 100 per 5 s); probing every other window
/// after a probe's round was refused halves that. Four windows cut it further but left a
/// share another process gave up untaken for too long (84.8–92.5 % of the ideal time).
const MAX_PROBE_GAP: u32 = 2;

/// Most windows between capacity probes of a quota's sole client (this process alone, or the
/// holder deciding for every process of the machine) whose probes keep being refused: each
/// refused probe costs a 429, which is 1 % of a quota of 100 a window but 5 % of a quota of
/// 20 (the small endpoint of a pool). A fixed window whose period is known, and that does not
/// grow, is probed every fourth window; one that admits a probe is probed every window again.
/// (Before the period is known, refused probes help find it: every window.)
const MAX_SOLE_PROBE_GAP: u32 = 4;

/// The longest advised wait taken as a lower bound on the window (beside other processes that
/// decide alone): a minute, the longest window of the rate quotas weir learns; longer advice is
/// for another quota (a day's) or a penalty.
const LONGEST_ADVISED_WINDOW: Duration = Duration::from_secs(60);

/// The default window when a refusal does not say when to come back.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(60);

/// The first hold after a refusal that advised no wait and taught nothing (see [`Blind`]).
const BLIND_FIRST: Duration = Duration::from_millis(500);

/// The longest hold between scouts while refusals advise no wait (see [`Blind`]): a window
/// another run filled is found open at most this late (a twelfth of a minute's window), for
/// about a dozen refusals over that minute.
const BLIND_LONGEST: Duration = Duration::from_secs(5);

/// How long every call is held after the `rounds`-th refusal in a row (see [`Blind`]).
fn blind_hold(rounds: u32) -> Duration {
    BLIND_FIRST.saturating_mul(1 << rounds.saturating_sub(1).min(16)).min(BLIND_LONGEST)
}

impl Budget {
    /// A budget with no limit known.
    pub fn unlimited() -> Self {
        Self::with_mode(Mode::Unlimited, None)
    }

    /// A budget of `capacity` per `window`.
    pub fn fixed(capacity: f64, window: Duration) -> Self {
        Self { told: true, ..Self::with_mode(Mode::Static { capacity }, Some(window)) }
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
            probe_gap: 1,
            probe: 1.0,
            unspent_probe: (0.0, None),
            probes: HashMap::new(),
            epoch: 0,
            come_back: None,
            refusals: 0,
            default_window: DEFAULT_WINDOW,
            grew_at: None,
            reset_at: None,
            short_until: None,
            lost: (None, 0.0),
            round_refused: None,
            window_at_least: false,
            changed_at: None,
            sole: false,
            deferred: Vec::new(),
            reserved: None,
            scout: Scout::Trusted,
            scouts_admitted: 0,
            told: false,
            hold_until: None,
            opened: None,
            ends: VecDeque::new(),
            period: None,
            others_filled: false,
            part: 1.0,
            blind: None,
            window_assumed: false,
        }
    }

    /// Marks the budget as the only client of its quota that this process knows of: the
    /// processes on this machine that call the endpoint with the key go through it (a quota
    /// store is on). Only then does a refusal lengthen a window learned from whole-second
    /// advice (see [`Budget::refused`]): where other processes take slots unseen, the server's
    /// window looks longer than it is, seen from this one's sends.
    pub fn sole(mut self, sole: bool) -> Self {
        self.sole = sole;
        self
    }

    /// Says, after the fact, whether the budget is its quota's only client here (see
    /// [`Budget::sole`]): a process that loses its quota store decides alone beside others
    /// that may too, and is no longer the only one.
    pub fn set_sole(&mut self, sole: bool) {
        self.sole = sole;
        if !sole {
            self.scout = Scout::Trusted;
        }
    }

    /// Keeps `part` (0 to 1) of a static capacity: the told limit is the key's, and while the
    /// processes that shared it through a store cannot reach it, each keeps its part rather than
    /// the whole (three processes on three machines, each told 60 per 5 s, sent 100 a window
    /// between them while Redis was down). Not written to a [`Seed`]: the process handed it
    /// keeps its own part.
    pub fn set_part(&mut self, part: f64) {
        self.part = part.clamp(0.0, 1.0);
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
            // Whole: the part kept is this process's for a while (see `set_part`), not the
            // limit it was told, which the summary and a process handed it show.
            Mode::Static { capacity } => Some(capacity),
            Mode::Learned => Some(
                self.credits.max(0.0)
                    + self.log.iter().map(|e| e.weight).sum::<f64>()
                    + self.deferred.iter().map(|d| d.1).sum::<f64>()
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
                let credits = &mut self.credits;
                self.deferred.retain(|&(at, weight)| {
                    let due = at <= now;
                    if due {
                        *credits += weight;
                    }
                    !due
                });
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
        // In every mode: held after a refused scout, or after refusals that advised no wait
        // (see `Blind`), and behind a scout out, whose answer wakes the waiting sends.
        if let Some(until) = self.hold_until.filter(|&until| now < until) {
            return Err(Some(until));
        }
        if matches!(self.scout, Scout::Out(..)) {
            return Err(None);
        }
        let ok = match self.mode {
            Mode::Unlimited => true,
            Mode::Static { capacity } => self.in_window + weight <= capacity * self.part || self.log.is_empty(),
            Mode::Learned => {
                if self.credits < weight {
                    self.maybe_probe(now);
                }
                // Nothing will ever come back when nothing is out: let one through, once the
                // last refusal's advised delay has passed (all of it: a lone send refused at
                // once would be let through again at once).
                self.credits >= weight || self.lone_send_at(now).is_some_and(|at| at <= now)
            }
        };
        if ok {
            match self.mode {
                Mode::Static { .. } => self.in_window += weight,
                Mode::Learned => {
                    // Let through with nothing out (and no credit), a send still comes back as a
                    // credit, but the budget does not go into debt for it.
                    self.credits = if self.credits >= weight { self.credits - weight } else { self.credits.min(0.0) };
                    if self.unspent_probe.0 > 0.0 {
                        self.unspent_probe.0 -= weight;
                        if let Some(kind) = self.unspent_probe.1 {
                            self.probes.insert(id, kind);
                        }
                    }
                }
                Mode::Unlimited => {}
            }
            // (A told limit scouts only while held after refusals that advised no wait.)
            if (!matches!(self.mode, Mode::Static { .. }) || self.blind.is_some())
                && matches!(self.scout, Scout::After(from) if from <= now)
            {
                self.scout = Scout::Out(id, now);
            }
            self.log.push_back(Entry { id, at: now, weight, state: State::Pending });
            return Ok(());
        }
        let w = self.window.unwrap_or(DEFAULT_WINDOW);
        let span = w + Self::margin(w);
        Err(match self.mode {
            Mode::Static { capacity } => {
                let mut freed = 0.0;
                let need = self.in_window + weight - capacity * self.part;
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
                // The earliest of: a credit coming back, a probe falling due, a lone send. Only
                // moments still ahead count (one already past did not let this send through, and
                // waking for it again would spin); with none, a completing send wakes it.
                [Some(self.probe_due(now)), self.next_credit_at(), self.lone_send_at(now)]
                    .into_iter()
                    .flatten()
                    .filter(|&at| at > now)
                    .min()
            }
            Mode::Unlimited => None,
        })
    }

    /// When the oldest admitted send in the log hands back its credit.
    fn next_credit_at(&self) -> Option<Instant> {
        let w = self.window.unwrap_or(DEFAULT_WINDOW);
        let logged = self.log.iter().find(|e| e.state == State::Ok).map(|e| e.at + w + Self::margin(w));
        logged.into_iter().chain(self.deferred.iter().map(|d| d.0)).min()
    }

    /// When a capacity probe falls due: windows after the last refusal or probe.
    fn probe_due(&self, now: Instant) -> Instant {
        let w = self.window.unwrap_or(DEFAULT_WINDOW);
        self.last_refusal.max(self.last_probe).unwrap_or(now) + w * PROBE_AFTER_WINDOWS * self.probe_gap
    }

    /// When a send may go with no credit, if nothing is out to bring one back.
    fn lone_send_at(&self, now: Instant) -> Option<Instant> {
        self.nothing_out().then(|| self.come_back.unwrap_or(now).max(now))
    }

    /// No send is out or held back to bring a credit back.
    fn nothing_out(&self) -> bool {
        self.log.is_empty() && self.overdue.is_empty() && self.deferred.is_empty()
    }

    /// Called while sends wait for a credit: mints a capacity probe after two windows without a
    /// refusal.
    fn maybe_probe(&mut self, now: Instant) {
        if self.unspent_probe.0 > 0.0 {
            return;
        }
        let w = self.window.unwrap_or(DEFAULT_WINDOW);
        // Not just before credits come back: the server freed their slots a little earlier
        // (the margin), and a probe there would take a slot our own sends are about to need.
        if self.next_credit_at().is_some_and(|at| at <= now + Self::margin(w) * 2) {
            return;
        }
        if now >= self.probe_due(now) {
            self.mint(now, self.probe, Probe::Capacity { epoch: self.epoch });
        }
    }

    fn mint(&mut self, now: Instant, amount: f64, kind: Probe) {
        self.credits += amount;
        self.unspent_probe = (self.unspent_probe.0 + amount, Some(kind));
        self.last_probe = Some(now);
        tracing::debug!(credits = self.credits, window = ?self.window, ?kind, "budget probes");
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
        self.blind = None;
        if let Scout::Out(scout, at) = self.scout {
            if scout == id {
                self.scouts_admitted += 1;
                // The next round's scout: the first send funded by a credit back from this round.
                self.scout = match self.window {
                    Some(w) if self.scouts_admitted < 2 => Scout::After(at + w),
                    _ => Scout::Trusted,
                };
            }
        }
        if let Some(Probe::Capacity { epoch }) = self.probes.remove(&id) {
            if epoch == self.epoch && self.mode == Mode::Learned {
                self.grew_at = self.position(id).map(|i| self.log[i].at).or(self.grew_at);
                self.probe_gap = 1;
                // No refusal since: the window has room to spare, so probe twice as hard. But
                // not in a fixed window of a known period: it admits every probe sent soon
                // after it opens, full or not (our sends are spread over it), and doubling
                // would fill it with probes before the first refusal; one more each time.
                let more = if self.period.is_some() { 1.0 } else { 2.0 } * self.probe;
                // Only while sends wait for credits: with fewer calls out than the budget allows,
                // every send would take probe credits, and each admitted one would mint two
                // more, without bound. Not while the probe credits minted before are still
                // unspent, nor while a quarter of the budget's own credits are.
                let idle = self.credits - self.unspent_probe.0;
                if self.unspent_probe.0 <= more * (self.probes.len() + 1) as f64
                    && idle < (self.effective_capacity().unwrap_or(0.0) / 4.0).max(more)
                {
                    self.credits += more;
                    self.unspent_probe = (self.unspent_probe.0 + more, Some(Probe::Capacity { epoch }));
                }
            }
        }
        if let Some(i) = self.position(id) {
            let e = &mut self.log[i];
            if let Some(last) = self.ends.back_mut() {
                // Sent after the last refused send of that window and admitted: the window had
                // ended when it arrived, at most the margin after it was sent.
                let arrived = e.at + END_MARGIN;
                if e.at > last.0 && arrived < last.1 {
                    last.1 = arrived;
                }
            }
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
        let window_before = self.window;
        if let Some(c) = self.come_back.filter(|&c| c <= now) {
            self.reset_at = Some(c);
        }
        if let Some(d) = delay {
            let fresh = now + d;
            self.come_back = Some(match self.come_back {
                // Still ahead, and within the second that advice in whole seconds leaves open:
                // the same end of the server's window, known more closely than either says.
                Some(c) if c > now && is_coarse(d) && c < fresh && c + Duration::from_secs(1) > fresh => c,
                _ => fresh,
            });
        }
        let coarse = delay.filter(|&d| is_coarse(d));
        let new_end = coarse.is_some_and(|d| self.note_end(now + d));
        let removed = self.position(id).map(|i| self.log.remove(i).expect("index is valid"));
        if let (Some(_), Some(e), Some(last)) = (coarse, &removed, self.ends.back_mut()) {
            // Refused when it arrived, a little after it was sent: the window had not ended.
            if e.at > last.0 && e.at < last.1 {
                last.0 = e.at;
            }
        }
        self.overdue.remove(&id);
        let probe = self.probes.remove(&id);
        match self.mode {
            Mode::Static { .. } => {
                if delay.is_none() {
                    // A told limit above the server's, whose refusals advise no wait (Vertex
                    // AI's): nothing else holds the calls, and each went again after its own
                    // backoff: told 20 per minute where 10 are admitted, 360 refusals in 52 s
                    // and 40 of 50 records failed. Held as before anything is learned (see
                    // `Blind`), with one scout at a time until one is admitted.
                    self.refused_blind(now, removed.as_ref().map(|e| e.at));
                }
                if let Some(e) = &removed {
                    self.in_window -= e.weight;
                }
            }
            Mode::Unlimited => {
                // The window is full. It frees its oldest slot when the server said to come back;
                // our oldest admitted send is that slot.
                let ours_admitted = self.log.iter().any(|e| e.state == State::Ok);
                let oldest = match self.reset_at.filter(|_| !self.others_filled) {
                    // A wave of ours filled the window and more (a first wave bigger than the
                    // quota): its refusals came back before any of its answers, taught nothing,
                    // and the server's advised time has passed since. Sends made before that
                    // time were in a window that has reset or slid on: measured from them, a
                    // sliding window of 5 s read as 10. Measure from the sends made since.
                    Some(reset) => self
                        .log
                        .iter()
                        .filter(|e| e.at >= reset)
                        .find(|e| e.state == State::Ok)
                        .or_else(|| self.log.iter().find(|e| e.at >= reset))
                        .or_else(|| self.log.iter().find(|e| e.state == State::Ok)),
                    None => self.log.iter().find(|e| e.state == State::Ok),
                }
                .filter(|_| ours_admitted)
                .map(|e| e.at);
                if oldest.is_none() && self.log.is_empty() {
                    // Every send of ours refused, none admitted or out: someone else filled
                    // the window (another process on the key, a run just before this one).
                    self.others_filled = true;
                    if let Some(d) = delay {
                        // Or nobody: the quota is zero. Once the advised pause is over, one
                        // scout goes and the other sends wait for its answer. Every send went
                        // at once before: on a quota of zero whose 429s advised 10 s, a run of
                        // 50 records had up to 16 refused every 10 s for 10 minutes.
                        self.distrust(now + d);
                    }
                }
                if oldest.is_none() {
                    // Refused before any send of ours was admitted: the refusal is fast and
                    // overtakes the answers, so whose requests fill the window cannot be told.
                    // Another run's (one that ended just before this one, on a sliding window)
                    // would be taken for ours: measured from our sends still in flight, a run
                    // learned "84 per 4 s" for 100 per 5 s and had a third of its sends refused.
                    // The server's advised pause holds the calls; learn from a refusal that
                    // comes once the window holds sends of ours.
                    // With no advice, nothing holds them but this budget (see `Blind`).
                    if delay.is_none() {
                        self.refused_blind(now, removed.as_ref().map(|e| e.at));
                    }
                    self.last_refusal = Some(now);
                    return;
                }
                self.window = Some(match (delay, oldest) {
                    (Some(d), Some(at)) => {
                        (now + d).duration_since(at).clamp(Duration::from_millis(500), Duration::from_secs(3600))
                    }
                    _ => self.default_window,
                });
                self.window_assumed = delay.is_none();
                // Advice in whole seconds was rounded up by up to a second: the window is at
                // most this long and at least a second shorter. Quota windows given in whole
                // seconds are themselves whole seconds (a second, a minute): the one whole
                // second in that range is the window, where a sliding window is counted from our
                // oldest send. A fixed window (counts start again at set times) is shorter seen
                // from a send made after it started: later refusals lengthen it (below).
                if let (Some(d), Some(w)) = (delay, self.window) {
                    if is_coarse(d) {
                        self.window = Some(whole_seconds(w.saturating_sub(Duration::from_secs(1))));
                    }
                }
                self.mode = Mode::Learned;
                self.changed_at = Some(now);
                self.credits = 0.0;
                if matches!(self.scout, Scout::Out(scout, _) if scout == id) {
                    // The scout of a hold after refusals that taught nothing (see `Blind`),
                    // refused once sends of ours were admitted: it teaches, and is answered.
                    // Left out, every send waited for its answer, which had come: the run
                    // sent nothing again.
                    self.scout = Scout::Trusted;
                }
                if delay.is_some_and(is_coarse) {
                    // Measured from our oldest send, which may be well after a fixed window
                    // started: the first credits that come back send a scout ahead. Beside
                    // other processes that decide alone too: their sends make a scout's answer
                    // say less of the window, but without one each process sends its whole
                    // round into the window's last second, and loses those credits.
                    self.distrust(now);
                }
                let admitted: Vec<f64> = self.log.iter().filter(|e| e.state == State::Ok).map(|e| e.weight).collect();
                if !admitted.is_empty() {
                    self.probe = (admitted.iter().sum::<f64>() / admitted.len() as f64).max(1.0);
                }
                self.expire(now);
            }
            Mode::Learned => {
                // A refused send spent a credit and gets none back: the budget shrinks by it.
                // Probe credits not yet spent are withdrawn, and probes still out mint no more.
                self.epoch += 1;
                let w = self.window.unwrap_or(DEFAULT_WINDOW);
                // A probe's round was refused: beside others, probe less often; alone, once the
                // window's period is known (before, probes help find it).
                let most = match (self.sole, self.period.is_some()) {
                    (false, _) => MAX_PROBE_GAP,
                    (true, true) => MAX_SOLE_PROBE_GAP,
                    (true, false) => 1,
                };
                if self.last_probe.is_some_and(|p| now < p + w) {
                    self.probe_gap = (self.probe_gap * 2).min(most);
                }
                self.credits -= self.unspent_probe.0.clamp(0.0, self.credits.max(0.0));
                self.unspent_probe = (0.0, None);
                let scouted = matches!(self.scout, Scout::Out(scout, _) if scout == id);
                if let (Some(d), Some(w)) = (delay, self.window) {
                    if is_coarse(d) {
                        let weight = removed.as_ref().map_or(0.0, |e| e.weight);
                        if !self.sole && d > w && d <= (w * 2).max(LONGEST_ADVISED_WINDOW) {
                            // The server's window is at least as long as it tells a refused send
                            // to wait (a fixed window's time to its end, a sliding window's to its
                            // oldest request's expiry; rounded up, the wait was more than `d` less
                            // a second, and the window is whole seconds). Of what a refusal says,
                            // it is the one bound other processes' sends cannot fake. Beside them,
                            // a window taken short from the first refusal (a fixed window entered
                            // late: 1 s for 5) was lengthened only once three ends agreed on the
                            // period, and until then each round its credits funded early was
                            // refused whole (in a paused-time model of four runs of 500 sends,
                            // 7.6-10.2 % refused, now 3.3-5.0 %). Longer advice is not this
                            // window's (a day's quota, a penalty).
                            self.change_window(d, now, d);
                            self.window_at_least = true;
                            // The refused send's slot is back when the server said, too.
                            self.deferred.push((now + d, weight));
                            tracing::debug!(window = ?self.window, "window lengthened to the advised wait");
                        } else if new_end && self.settle_period(id, now, d, w, scouted) {
                            // The window changed to a fixed window's period; the refusal shrank
                            // its capacity (measured from what it admitted).
                        } else if self.lengthen_whole(id, now, d, w, probe, scouted) {
                            // Refused for the window, not the capacity: its slot is back when
                            // the server said.
                            self.deferred.push((now + d, weight));
                        } else if probe.is_none()
                            && !scouted
                            && self.period.is_none()
                            && self.short_until.is_none_or(|until| now >= until)
                        {
                            // Sends our credits funded, and no probe's, refused: a quarter of
                            // what the budget holds within one window says the window is too
                            // short, not the capacity too high (that costs the overshoot of a
                            // probe's round). A window learned while other traffic on the key
                            // filled part of it (a run started just after another) was taken as
                            // 2 s for 5, scouts found room while that traffic's slots freed, and
                            // the run lost 40 of 100 sends a window to refusals.
                            // Only sends made on the window in force count: those out when it
                            // was learned or changed were funded on another.
                            let on_this = removed.as_ref().is_some_and(|e| self.changed_at.is_none_or(|c| e.at >= c));
                            let weight = if on_this { weight } else { 0.0 };
                            let (from, lost) = match self.lost {
                                (Some(from), lost) if now < from + w => (from, lost + weight),
                                _ => (now, weight),
                            };
                            self.lost = (Some(from), lost);
                            if lost >= (self.effective_capacity().unwrap_or(0.0) * 0.25).max(4.0) {
                                self.lost = (None, 0.0);
                                if self.sole {
                                    self.window = Some(w + Duration::from_secs(1));
                                    self.short_until = Some(now + d);
                                    self.changed_at = Some(now);
                                    tracing::debug!(window = ?self.window, "window lengthened: refusals of its sends");
                                } else {
                                    // Beside other processes, their probes' rounds also refuse
                                    // sends of ours, so this alone does not lengthen the window
                                    // (it took 5 s for 7-11). But every refused send costs its
                                    // credit: a window learned a second short (four runs started
                                    // 4 s after another on a sliding 5 s: 4 s, from the waits
                                    // advised) had each round refused whole, and each run's
                                    // capacity fell to nothing in one burst. The credits in hand
                                    // and the rest of this burst's wait for the advised time, a
                                    // scout goes ahead of the next round, and if it is refused
                                    // too, the window is lengthened (below).
                                    self.change_window(w, now, d);
                                    self.distrust(now);
                                    self.round_refused = Some(now);
                                    tracing::debug!(window = ?self.window, "a round refused: credits held, scouting");
                                }
                            }
                        }
                    } else if let Some(e) = self.log.iter().find(|e| e.state == State::Ok) {
                        let predicted =
                            (e.at + w).duration_since(now).as_secs_f64() - now.duration_since(e.at + w).as_secs_f64();
                        let err = d.as_secs_f64() - predicted;
                        if err != 0.0 && err.abs() < w.as_secs_f64() / 2.0 {
                            let w = Duration::from_secs_f64((w.as_secs_f64() + err / 2.0).max(0.5));
                            self.window = Some(w);
                        }
                    }
                }
                if let (true, Some(w), Some(d)) = (scouted && !self.sole && self.window_at_least, self.window, delay) {
                    if self.round_refused.take().is_some_and(|at| now < at + w * 3) && w < LONGEST_ADVISED_WINDOW {
                        // A round of ours refused, then the scout that went ahead of the next:
                        // the window, known only to be at least the longest wait advised, is
                        // longer. (A window measured from the server's ends is not changed so.)
                        self.change_window(w + Duration::from_secs(1), now, d);
                        tracing::debug!(window = ?self.window, "window lengthened: a round and its scout refused");
                    }
                }
                if scouted {
                    // The credits came back before the server's window opened again: every
                    // send waits until the time it advised, and the credits that come back a
                    // window after that burst send a scout ahead again.
                    match (self.come_back.filter(|&c| c > now), self.window) {
                        (Some(until), Some(w)) => {
                            self.hold_until = Some(until);
                            // Refused now, the window had not opened anew yet.
                            let before = (1..=w.as_secs() as u32 + 2)
                                .map(|k| {
                                    let from = until.checked_sub(Duration::from_secs(k.into()));
                                    self.log.iter().filter(|e| from.is_none_or(|f| e.at >= f)).map(|e| e.weight).sum()
                                })
                                .collect();
                            self.opened = Some(Opened { earliest: now, latest: until, before });
                            self.distrust(until + w);
                        }
                        _ => self.distrust(now),
                    }
                }
                if delay.is_none() && self.credits < 1.0 && self.nothing_out() {
                    // Refusals with no advice took every credit, and nothing out brings one
                    // back: the lone send that follows would go at once, and again at once when
                    // refused (a quota that fell to zero under a run that had learned it). Held
                    // as before anything was learned (see `Blind`).
                    self.refused_blind(now, removed.as_ref().map(|e| e.at));
                }
            }
        }
        if delay.is_some() && self.window != window_before {
            // Measured from the server's advice now.
            self.window_assumed = false;
        }
        self.last_refusal = Some(now);
        tracing::debug!(
            mode = ?self.mode,
            window = ?self.window,
            credits = self.credits,
            capacity = ?self.effective_capacity(),
            advised = ?delay,
            id,
            probe = probe.is_some(),
            scout = ?match self.scout {
                Scout::Trusted => None,
                Scout::After(at) => Some(at.saturating_duration_since(now).as_secs_f64()),
                Scout::Out(..) => Some(0.0),
            },
            hold = ?self.hold_until.map(|h| h.saturating_duration_since(now).as_secs_f64()),
            reset_ago = ?self.reset_at.map(|r| now.saturating_duration_since(r).as_secs_f64()),
            come_back = ?self.come_back.map(|c| c.saturating_duration_since(now).as_secs_f64()),
            "budget refused"
        );
    }

    /// A send made at `sent` was refused at `now`, advising no wait, and taught nothing (no send
    /// of ours admitted yet, or none since refusals took every credit): every call is held, for
    /// twice as long as the last round's hold (from [`BLIND_FIRST`] up to [`BLIND_LONGEST`]),
    /// then one scout goes (see [`Blind`]).
    /// Refusals of sends made before the last hold began are of that round and change nothing.
    /// Also for refusals it does not learn from (see [`Budget::refused_not_learned`]).
    fn refused_blind(&mut self, now: Instant, sent: Option<Instant>) {
        let (rounds, first) = match self.blind {
            Some(b) if sent.is_none_or(|at| at < b.since) => return,
            Some(b) => (b.rounds + 1, b.first),
            None => (1, now),
        };
        let hold = blind_hold(rounds);
        self.blind = Some(Blind { rounds, since: now, first });
        self.hold_until = Some(now + hold);
        self.distrust(now + hold);
        tracing::debug!(rounds, ?hold, "refused with no advice and nothing to go by: holding, then a scout");
    }

    /// Goes on holding the calls where the writer of `seed` (`age` ago) held them after
    /// refusals that advised no wait (see [`Blind`]), unless this budget has been held for
    /// longer: its next scout goes when the writer's would have, and the 10 minutes to the
    /// stop count from the writer's first refusal. A process taking over a quota of zero
    /// otherwise sent every call it held at once, all refused, and began counting afresh.
    fn take_blind(&mut self, seed: &Seed, age: Duration, now: Instant) {
        let Some((rounds, since, first)) = seed.blind else { return };
        let Some(base) = now.checked_sub(age) else { return };
        let (Some(since), Some(first)) = (at_offset(base, since), at_offset(base, first)) else { return };
        if self.blind.is_some_and(|b| b.first <= first) {
            return;
        }
        let until = since + blind_hold(rounds);
        self.blind = Some(Blind { rounds, since, first });
        self.hold_until = self.hold_until.max(Some(until));
        self.distrust(until);
    }

    /// Since when every send has been refused with no advice and none admitted, with nothing to
    /// go by (see [`Blind`]).
    pub fn refused_blind_since(&self) -> Option<Instant> {
        self.blind.map(|b| b.first)
    }

    /// The send of `id` was refused at `now`, advising no wait, by a quota this budget does not
    /// learn from (the refusal names none, as an OpenAI-compatible server's bare 429, or
    /// learning is off): while no limit is learned (none known, or one told that the server
    /// does not keep), calls are held as after a refusal that advises nothing and teaches
    /// nothing (see [`Blind`]) until one is admitted. The send is kept, as for
    /// [`Budget::failed`].
    pub fn refused_not_learned(&mut self, id: u64, now: Instant) {
        if self.mode != Mode::Learned {
            let sent = self.position(id).map(|i| self.log[i].at);
            self.refused_blind(now, sent);
        }
        self.failed(id);
    }

    /// A send our credits let through was refused, told `d` in whole seconds, with the window
    /// taken as `w` whole seconds: the window is longer than that, unless the refusal is a
    /// capacity probe's or follows one (then the capacity was too high, and the refusal already
    /// took it back). This is how a fixed window first measured from a send well after its
    /// start (so too short) is found: it is longer than from the last advised time that has
    /// passed to the second before `d`. It only ever lengthens, to whole seconds, so it never
    /// goes past a whole-second window; a window long enough refuses nothing of ours but probes.
    ///
    /// Returns true when the refusal was the window's: it lengthened the window, or came in the
    /// same burst as the refusal that did. The credits in hand then came back too early: they
    /// are held until the server's advised time, when its window has room for them.
    fn lengthen_whole(
        &mut self,
        id: u64,
        now: Instant,
        d: Duration,
        w: Duration,
        probe: Option<Probe>,
        scouted: bool,
    ) -> bool {
        if self.short_until.is_some_and(|until| now < until) {
            return true;
        }
        if self.period == Some(w) {
            // A fixed window of a known period: a refusal is the capacity's.
            return false;
        }
        if let Some(opened) = self.opened.take_if(|o| now < o.latest + w + Self::margin(w)) {
            if self.sole && probe.is_none() && !scouted && self.reset_at == Some(opened.latest) {
                return self.measure_opened(opened, id, now, d, w);
            }
            self.opened = Some(opened);
        }
        if self.sole && probe.is_none() && !scouted {
            if let Some(shorter) = self.fixed_and_shorter(id, now, d, w) {
                // The window that refused started after the second before the last reset.
                let since = self.reset_at.and_then(|r| r.checked_sub(Duration::from_secs(1)));
                let admitted: f64 =
                    self.log.iter().filter(|e| e.id < id && since.is_none_or(|s| e.at >= s)).map(|e| e.weight).sum();
                self.settle_fixed(shorter, admitted, id, now, d);
                self.distrust(now);
                return false;
            }
        }
        // A scout went alone, funded by the first credits back from sends the server admitted
        // since the last reset: refused, the window that admitted them has not ended, whatever
        // probes did before it.
        if !self.sole || (!scouted && (probe.is_some() || self.grew_at.is_some_and(|at| now < at + w * 2))) {
            return false;
        }
        // The last advised time that has passed is no earlier than the start of the window it
        // advised (the advice was rounded up), and that window ends more than `d - 1` from
        // now, if it is still the server's current one: if our sends since then are no more
        // than one window admits.
        let Some(since) = self.reset_at else { return false };
        let since_then: f64 = self.log.iter().filter(|e| e.state == State::Ok && e.at >= since).map(|e| e.weight).sum();
        if !scouted && self.effective_capacity().is_none_or(|c| since_then > c) {
            return false;
        }
        let longer = whole_seconds((now + d).saturating_duration_since(since + Duration::from_secs(1))).min(w * 2);
        if longer <= w {
            return false;
        }
        self.change_window(longer, now, d);
        // Not trusted until a scout finds the lengthened window open: the next send, funded
        // by a credit back on the new schedule or held back until the advised time, goes alone.
        if self.sole && !matches!(self.scout, Scout::Out(..)) {
            self.distrust(now);
        }
        tracing::debug!(window = ?self.window, advised = ?d, "whole-second window lengthened");
        true
    }

    /// A send that is no probe was refused in a fixed window that opened between the two
    /// moments of `opened` (see [`Opened`]), nothing of ours sent in between. The window admits
    /// what we sent since, before this send. It is longer than from its latest opening to the
    /// second before the advised end, shorter than from its earliest opening to the advised
    /// end, and — its capacity being the same each time — not so long that the window before
    /// held more of our sends than that (a window measured across a reset, from sends of the
    /// window before, was taken too long and too large). `w` is kept if it fits; otherwise the
    /// shortest whole second that fits is taken (a scout finds a window too short at the cost
    /// of one refusal, while one too long lets probes grow the budget past the quota). The
    /// credits in hand wait for the advised end, and the refusals of the sends still out are
    /// the window's.
    fn measure_opened(&mut self, opened: Opened, id: u64, now: Instant, d: Duration, w: Duration) -> bool {
        let Opened { earliest, latest, before } = opened;
        let admitted: f64 = self.log.iter().filter(|e| e.at >= latest && e.id < id).map(|e| e.weight).sum();
        let longer_than = whole_seconds((now + d).saturating_duration_since(latest + Duration::from_secs(1)));
        let shorter_than = (now + d).saturating_duration_since(earliest);
        let fits = |window: Duration| {
            window >= longer_than
                && window < shorter_than
                && before.get(window.as_secs() as usize - 1).is_none_or(|&sent| sent <= admitted * 1.02 + 1.0)
        };
        let window = if fits(w) {
            w
        } else {
            let found = (longer_than.as_secs()..shorter_than.as_secs_f64().ceil() as u64)
                .map(Duration::from_secs)
                .find(|&c| fits(c) && may_shorten_to(c, w));
            match found.or(Some(longer_than).filter(|&c| may_shorten_to(c, w))) {
                Some(window) => window,
                None => return false,
            }
        };
        self.settle_fixed(window, admitted, id, now, d);
        self.distrust(latest + window);
        false
    }

    /// A refusal of a send `id` that is no probe says the window is too long, if the quota is
    /// counted in fixed windows and `w` is: the end it advises is later than a sliding window
    /// of `w` over our oldest send still counted would free a slot (so the window is fixed, or
    /// sliding and longer than learned — which the first refusal ruled out, counting from our
    /// first send), and the window that refused started after the second before the last
    /// advised time that passed (the end of the window before), so it is shorter than from then
    /// to the advised end. Returns the longest whole second shorter than that.
    fn fixed_and_shorter(&self, id: u64, now: Instant, d: Duration, w: Duration) -> Option<Duration> {
        let reset = self.reset_at?;
        let oldest = self.log.iter().find(|e| e.id < id)?.at;
        let end_lo = (now + d).checked_sub(Duration::from_secs(1))?;
        if end_lo <= oldest + w + Self::margin(w) * 2 {
            return None;
        }
        let below = (now + d + Duration::from_secs(1)).saturating_duration_since(reset);
        let above = end_lo.saturating_duration_since(reset);
        let shorter = Duration::from_secs((below.as_secs_f64().ceil() as u64).saturating_sub(1));
        (w >= below && shorter > above && shorter >= Duration::from_secs(1) && may_shorten_to(shorter, w))
            .then_some(shorter)
    }

    /// Takes the quota as `window` long, admitting `admitted` (what we sent in it before the
    /// refused send `id`) and the sends still out after it; the credits in hand wait for the
    /// advised end (`now + d`), and the refusals of the sends still out are the window's.
    fn settle_fixed(&mut self, window: Duration, admitted: f64, id: u64, now: Instant, d: Duration) {
        let after: f64 = self.log.iter().filter(|e| e.id > id).map(|e| e.weight).sum();
        if let Some(capacity) = self.effective_capacity() {
            self.credits -= (capacity - admitted - after).max(0.0);
        }
        self.change_window(window, now, d);
        tracing::debug!(window = ?self.window, capacity = ?self.effective_capacity(), "fixed window measured");
    }

    /// Takes the window as `window`, on a refusal at `now` that advised `d`: the credits in hand
    /// came back on the old schedule, too early, and wait for the advised time; until then,
    /// refusals of the same burst are the window's, not the capacity's.
    fn change_window(&mut self, window: Duration, now: Instant, d: Duration) {
        self.window = Some(window);
        self.changed_at = Some(now);
        self.short_until = Some(now + d);
        self.deferred.push((now + d, self.credits.max(0.0)));
        self.credits = self.credits.min(0.0);
    }

    /// A refusal of send `id`, told `d` in whole seconds with the window taken as `w`, started a
    /// new bracket of ends (see [`Budget::note_end`]): if the ends kept agree with `w`, it is
    /// kept as a fixed window's period, probed for more one at a time; if they show another
    /// period that `w` does not fit, the window becomes that period, admitting what we sent in
    /// the window that refused. Returns true when the window changed.
    ///
    /// Beside other processes on the key that decide alone (not [`Budget::sole`]), the ends
    /// are still the server's, but a sliding window's can bunch up (their sends place them),
    /// and a lattice of a shorter period would fit them: there the window is only lengthened
    /// (a fixed window entered late was taken too short, and every round its credits came
    /// back a second early was refused), never shortened, and not taken as a period (probes
    /// keep doubling, so a share another process gave up is taken back quickly). `scouted`:
    /// the refused send was the scout.
    fn settle_period(&mut self, id: u64, now: Instant, d: Duration, w: Duration, scouted: bool) -> bool {
        let found = self.lattice(w);
        if self.sole && found == Some((w, true)) && self.period.is_none() {
            // The window was right (learned, or handed over by a process before).
            self.period = Some(w);
            tracing::debug!(window = ?w, "window's ends agree with it");
        }
        // Not while `w` fits the ends too (they do not tell the two apart yet).
        let Some((period, _)) = found.filter(|&(p, fits)| p != w && !fits) else { return false };
        // The window that refused started a period before its end: placed by every end kept,
        // each a whole number of periods before it.
        let start = self.phase(period).and_then(|end| end.checked_sub(period));
        let admitted: f64 =
            self.log.iter().filter(|e| e.id < id && start.is_none_or(|s| e.at >= s)).map(|e| e.weight).sum();
        if !self.sole && scouted {
            // A scout goes first, so what we sent in the window that refused it is nothing or
            // next to nothing: beside other processes, it was their sends that filled it, and
            // says nothing of our share. Taken as our capacity, three of four processes fell to
            // 1 per window while the fourth took 97, and ended 60 s after it. The capacity is
            // kept; the scout's refusal already took its credit.
            self.change_window(period, now, d);
        } else {
            self.settle_fixed(period, admitted, id, now, d);
        }
        self.window_at_least = false;
        if self.sole {
            self.period = Some(period);
            self.distrust(now);
        }
        tracing::debug!(window = ?period, "fixed window's period found from its ends");
        true
    }

    /// Notes the end of the server's window that a refusal advised in whole seconds: `end` is
    /// now plus the advice, which was rounded up, so the end is in `(end - 1 s, end]` (a little
    /// earlier still, by the time the refusal took to come back). Refusals in one server window
    /// narrow one bracket; returns true when this one starts a new bracket.
    fn note_end(&mut self, end: Instant) -> bool {
        let lo = end.checked_sub(Duration::from_secs(1) + END_MARGIN).unwrap_or(end);
        if let Some(last) = self.ends.back_mut() {
            if lo < last.1 && end > last.0 {
                *last = (last.0.max(lo), last.1.min(end));
                return false;
            }
        }
        self.ends.push_back((lo, end));
        if self.ends.len() > ENDS_KEPT {
            self.ends.pop_front();
        }
        true
    }

    /// The period of a fixed window, if the ends that refusals advised fall on one: a fixed
    /// window's ends are whole periods apart, so the gap between any two brackets holds a
    /// multiple of it (refusals in at least one window out of four between). Three ends at least,
    /// and the longest whole second that fits every gap: a shorter one fits too (any does, a
    /// second long), but a window taken too short sends more than the quota, where one taken a
    /// multiple too long is refused within a window and its ends show the shorter period.
    /// A sliding window's ends are not bound to a lattice, but the sends of a budget that
    /// keeps to it repeat with its period, and so do the ends of its refusals. Also says
    /// whether `w`, the window in force, fits the ends too: then they do not tell the two apart.
    /// A budget that is not the quota's sole client takes the shortest period longer than `w`
    /// that fits instead (none if no longer one fits), as it only ever lengthens on this
    /// evidence.
    fn lattice(&self, w: Duration) -> Option<(Duration, bool)> {
        if self.ends.len() < 3 {
            return None;
        }
        // Between each two ends, how far apart they may be, and how many periods at most.
        let mut gaps = Vec::new();
        for (i, a) in self.ends.iter().enumerate() {
            for (j, b) in self.ends.iter().enumerate().skip(i + 1) {
                let gap = (b.0.saturating_duration_since(a.1).as_secs_f64(), b.1.duration_since(a.0).as_secs_f64());
                gaps.push((gap, 4 * (j - i) as u64));
            }
        }
        let fits = |p: Duration| {
            let p = p.as_secs_f64();
            gaps.iter().all(|&((lo, hi), most)| (1..=most).any(|k| (lo..=hi).contains(&(k as f64 * p))))
        };
        // A period not much longer than what the ends leave open fits them by chance (a second
        // fits any ends of refusals advised in whole seconds): a sliding window's ends, where
        // refusals fell, fitted one of 1 s where 5 s did not, and a budget that took its quota
        // as 23 per second was refused down to 3 per second. A period tells only when every
        // gap between two ends is known to within half of it.
        let tells = |p: Duration| gaps.iter().all(|&((lo, hi), _)| hi - lo < p.as_secs_f64() / 2.0);
        // The shortest gap is between two ends in a row (zero if any two are out of order).
        let shortest_gap = gaps.iter().map(|g| g.0 .1).fold(f64::INFINITY, f64::min);
        let mut fitting = (1..=shortest_gap.floor() as u64).map(Duration::from_secs).filter(|&p| fits(p) && tells(p));
        let period = if self.sole {
            fitting.rfind(|&p| may_shorten_to(p, w))?
        } else {
            // Beside others, a window too long is never shortened again (see
            // `Budget::settle_period`): the least lengthening the ends allow, or none.
            fitting.find(|&p| p > w)?
        };
        Some((period, fits(w)))
    }

    /// The last end kept, placed as closely as every end kept allows with a fixed window of
    /// `period` (each a whole number of periods before it): the middle of what is left open.
    fn phase(&self, period: Duration) -> Option<Instant> {
        let &(mut lo, mut hi) = self.ends.back()?;
        for &(a, b) in &self.ends {
            let k = (lo.duration_since(a).as_secs_f64() / period.as_secs_f64()).round();
            let shift = period.mul_f64(k);
            lo = lo.max(a + shift);
            hi = hi.min(b + shift);
        }
        Some(if lo < hi { lo + (hi - lo) / 2 } else { hi })
    }

    /// The send failed for another reason; the server may have counted it, so keep it.
    pub fn failed(&mut self, id: u64) {
        self.probes.remove(&id);
        self.scout_gone(id);
        if let Some(i) = self.position(id) {
            self.log[i].state = State::Ok;
        } else if let Some(w) = self.overdue.remove(&id) {
            self.credits += w;
        }
    }

    /// Scouts go ahead again from `from` on: the window was learned or changed, or a scout was
    /// refused.
    fn distrust(&mut self, from: Instant) {
        self.scout = Scout::After(from);
        self.scouts_admitted = 0;
    }

    /// The send of `id` says nothing about the window (it failed otherwise, or did not happen):
    /// if it was the scout, the next send scouts instead.
    fn scout_gone(&mut self, id: u64) {
        if let Scout::Out(scout, at) = self.scout {
            if scout == id {
                self.scout = Scout::After(at);
            }
        }
    }

    /// Removes a send that did not happen or was not counted by this quota.
    pub(crate) fn forget(&mut self, id: u64) {
        self.probes.remove(&id);
        self.scout_gone(id);
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

    /// What this budget knows, to hand to another process that takes over the quota: its mode,
    /// window and capacity, and the sends of the last window (as ages at `now`).
    pub fn export(&mut self, now: Instant) -> Seed {
        self.expire(now);
        let ago = |e: &Entry| (now.saturating_duration_since(e.at).as_secs_f64(), e.weight);
        let sends = match self.mode {
            // Nothing learned yet: the sends of the last minute, which the first refusal will
            // measure the window and its capacity from.
            Mode::Unlimited => {
                self.log.iter().filter(|e| now.saturating_duration_since(e.at) <= DEFAULT_WINDOW).map(ago).collect()
            }
            _ => self.log.iter().map(ago).collect(),
        };
        let off = |t: Option<Instant>| t.map(|t| offset(t, now));
        let learning = (self.mode == Mode::Learned).then(|| Learning {
            // Sends whose answers are overdue: the server's window no longer holds them.
            credits: self.credits.max(0.0) + self.overdue.values().sum::<f64>(),
            deferred: self.deferred.iter().map(|&(at, w)| (offset(at, now), w)).collect(),
            ends: self.ends.iter().map(|&(lo, hi)| (offset(lo, now), offset(hi, now))).collect(),
            scout: match self.scout {
                Scout::Trusted => None,
                Scout::After(at) => Some(offset(at, now)),
                // Its answer will come to this process, not the next: the next scouts again.
                Scout::Out(..) => Some(0.0),
            },
            scouts_admitted: self.scouts_admitted,
            last_refusal: off(self.last_refusal),
            last_probe: off(self.last_probe),
            come_back: off(self.come_back),
            reset_at: off(self.reset_at),
            hold_until: off(self.hold_until),
            short_until: off(self.short_until),
            grew_at: off(self.grew_at),
            refusals: self.refusals,
            opened: self.opened.as_ref().map(|o| (offset(o.earliest, now), offset(o.latest, now), o.before.clone())),
            period: self.period.map(|p| p.as_secs_f64()),
        });
        Seed {
            mode: self.mode,
            window: self.window,
            probe: self.probe,
            capacity: self.effective_capacity().unwrap_or(0.0),
            sends,
            fixed: self.period.is_some() && self.period == self.window,
            learning,
            told: self.told && matches!(self.mode, Mode::Static { .. }),
            assumed: self.window_assumed && self.mode == Mode::Learned,
            blind: self.blind.map(|b| (b.rounds, offset(b.since, now), offset(b.first, now))),
            refused: None,
        }
    }

    /// Counts a send of this process's that another process's throttle admitted at `at`, as if
    /// this budget had: a told limit only (see [`Budget::set_part`]), when this process starts
    /// deciding on its part of it, for the sends it made in the window to count against that.
    pub fn note_sent(&mut self, id: u64, at: Instant, weight: f64) {
        if let Mode::Static { .. } = self.mode {
            let at_place = self.log.partition_point(|e| e.at <= at);
            self.log.insert(at_place, Entry { id, at, weight, state: State::Ok });
            self.in_window += weight;
        }
    }

    /// Counts the sends of `seed` (another process's, made while it decided alone beside this
    /// budget's process, which was stopped; see [`Budget::export`]) as if this budget had
    /// admitted them: they are in the server's window, and a budget that did not count them
    /// spends their slots again and meets refusals. Their credits come back when they leave
    /// the window, as this budget's own do.
    pub fn count_sends(&mut self, seed: &Seed, now: Instant, ids: &mut dyn FnMut() -> u64) {
        if self.mode == Mode::Unlimited {
            return;
        }
        for &(ago, weight) in &seed.sends {
            let Some(at) = now.checked_sub(Duration::from_secs_f64(ago.max(0.0))) else { continue };
            let at_place = self.log.partition_point(|e| e.at <= at);
            self.log.insert(at_place, Entry { id: ids(), at, weight, state: State::Ok });
            match self.mode {
                Mode::Static { .. } => self.in_window += weight,
                Mode::Learned => {
                    // Held back for these very sends on resuming: they take its place.
                    let reserved = self.reserved.and_then(|at| self.deferred.iter_mut().find(|d| d.0 == at));
                    let covered = reserved.map_or(0.0, |d| {
                        let c = d.1.min(weight);
                        d.1 -= c;
                        c
                    });
                    self.credits -= weight - covered;
                }
                Mode::Unlimited => {}
            }
        }
        self.deferred.retain(|d| d.1 > 0.0);
        self.expire(now);
    }

    /// This budget's process was stopped (Ctrl-Z, SIGSTOP) while it held a quota `n` processes
    /// shared, and resumes: the others decided alone meanwhile, each on its share, and filled
    /// the server's window without this budget knowing. It keeps its own share of its credits
    /// now and gets the rest back a window later, or, as the others join again and say what they
    /// sent ([`Budget::count_sends`]), as those sends leave the window. Spending all its credits at once met a
    /// full window: a burst of 429s, and a capacity learned from it a tenth of the quota.
    pub fn resumed(&mut self, n: usize, now: Instant) {
        if self.mode != Mode::Learned || n < 2 {
            return;
        }
        self.expire(now);
        let Some(capacity) = self.effective_capacity() else { return };
        let excess = self.credits - capacity / n as f64;
        let back = now + self.window.unwrap_or(DEFAULT_WINDOW);
        if excess > 0.0 {
            self.credits -= excess;
            self.deferred.push((back, excess));
            self.reserved = Some(back);
        }
        // Refusals in the window after the stop are of the others' sends this budget did not
        // count, not of a smaller quota: their slots come back when the server says.
        self.short_until = Some(back);
    }

    /// Takes over what another process's budget knew (see [`Budget::export`]), `age` after it
    /// was exported: its sends still count against the window here, and a learned quota is not
    /// learned again. `ids` gives each of those sends an id older than any to come. A budget
    /// given a limit keeps its own; one that learned something itself keeps what it learned.
    pub fn seed(&mut self, seed: &Seed, age: Duration, now: Instant, ids: &mut dyn FnMut() -> u64) {
        self.take_blind(seed, age, now);
        if self.mode == Mode::Learned || (seed.mode == Mode::Unlimited && self.mode != Mode::Unlimited) {
            return;
        }
        let mut sends: Vec<Instant> = seed
            .sends
            .iter()
            .filter_map(|&(ago, _)| now.checked_sub(age + Duration::from_secs_f64(ago.max(0.0))))
            .collect();
        sends.sort();
        let weights = seed.sends.iter().map(|s| s.1);
        match (self.mode, seed.mode) {
            // Limits another run was told (`--rpm`) are not this one's: a run that ended would
            // hold every later run to them, silently. Its sends are in the server's window.
            // Nor is a window another run assumed with another default (`--limit-window`), its
            // server's refusals advising no wait: a run given `--limit-window 5` after one that
            // assumed a minute waited a minute at every full window.
            (Mode::Unlimited, Mode::Unlimited)
            | (Mode::Unlimited, Mode::Static { .. })
            | (Mode::Unlimited, Mode::Learned)
                if seed.mode == Mode::Unlimited
                    || seed.told
                    || (seed.mode == Mode::Learned && seed.assumed && seed.window != Some(self.default_window)) =>
            {
                // Nothing learned on either side: the other's sends are in the server's window,
                // and the first refusal here measures from them too.
                self.log.clear();
                for (at, weight) in sends.into_iter().zip(weights) {
                    self.log.push_back(Entry { id: ids(), at, weight, state: State::Ok });
                }
            }
            (Mode::Static { .. }, _) => {
                for (at, weight) in sends.into_iter().zip(weights) {
                    self.log.push_back(Entry { id: ids(), at, weight, state: State::Ok });
                    self.in_window += weight;
                }
            }
            (Mode::Unlimited, Mode::Static { capacity }) => {
                self.mode = Mode::Static { capacity };
                self.window = seed.window;
                self.in_window = 0.0;
                self.log.clear();
                for (at, weight) in sends.into_iter().zip(weights) {
                    self.log.push_back(Entry { id: ids(), at, weight, state: State::Ok });
                    self.in_window += weight;
                }
            }
            (Mode::Unlimited, Mode::Learned) => {
                self.mode = Mode::Learned;
                self.window = seed.window;
                self.window_assumed = seed.assumed;
                self.probe = seed.probe;
                self.log.clear();
                self.overdue.clear();
                let mut out = 0.0;
                for (at, weight) in sends.into_iter().zip(weights) {
                    self.log.push_back(Entry { id: ids(), at, weight, state: State::Ok });
                    out += weight;
                }
                self.credits = (seed.capacity - out).max(0.0);
                if seed.fixed {
                    self.period = seed.window;
                }
                // Probing starts afresh from here, not from a refusal the other process saw.
                self.last_refusal = Some(now);
                if let (Some(l), Some(base)) = (&seed.learning, now.checked_sub(age)) {
                    let at = |secs: Option<f64>| secs.and_then(|s| at_offset(base, s));
                    self.credits = l.credits;
                    self.deferred = l.deferred.iter().filter_map(|&(s, w)| Some((at_offset(base, s)?, w))).collect();
                    self.ends = l
                        .ends
                        .iter()
                        .filter_map(|&(lo, hi)| Some((at_offset(base, lo)?, at_offset(base, hi)?)))
                        .collect();
                    self.scout = match at(l.scout) {
                        None if l.scout.is_none() => Scout::Trusted,
                        Some(from) => Scout::After(from),
                        None => Scout::After(now),
                    };
                    self.scouts_admitted = l.scouts_admitted;
                    self.last_refusal = at(l.last_refusal).or(self.last_refusal);
                    self.last_probe = at(l.last_probe);
                    self.come_back = at(l.come_back);
                    self.reset_at = at(l.reset_at);
                    self.hold_until = at(l.hold_until);
                    self.short_until = at(l.short_until);
                    self.grew_at = at(l.grew_at);
                    self.refusals = l.refusals;
                    self.opened = l.opened.as_ref().and_then(|(earliest, latest, before)| {
                        Some(Opened {
                            earliest: at_offset(base, *earliest)?,
                            latest: at_offset(base, *latest)?,
                            before: before.clone(),
                        })
                    });
                    self.period = l.period.map(Duration::from_secs_f64).or(self.period);
                }
            }
            _ => {}
        }
        self.expire(now);
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
            self.told = false;
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
        // A refused send gives its slot back at once (the server's advised pause holds the
        // calls, in the throttle's gate).
        b.refused(3, again, Some(ms(100)));
        assert!(b.try_take(4, 1.0, again).is_ok());
        // Refused with no advice, the calls are held, then one goes alone (see `Blind`).
        b.refused(4, again, None);
        assert_eq!(b.try_take(5, 1.0, again), Err(Some(again + BLIND_FIRST)));
        assert!(b.try_take(5, 1.0, again + BLIND_FIRST).is_ok());
        assert_eq!(b.try_take(6, 1.0, again + BLIND_FIRST), Err(None), "behind the scout");
        b.admitted(5, 1.0);
        assert!(b.try_take(6, 1.0, again + BLIND_FIRST).is_ok());
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
        // The five credits come back one window after their sends, and go out again.
        let mut sent = 1;
        let mut t = next;
        let mut id = 7;
        while t < t0 + ms(1060) {
            t += ms(5);
            if b.try_take(id, 1.0, t).is_ok() {
                b.admitted(id, 1.0);
                sent += 1;
                id += 1;
            }
        }
        assert_eq!(sent, 5);
        // A window without a refusal since, and no credit due back soon: a probe for more.
        assert!(b.try_take(id, 1.0, t + ms(5)).is_ok());
        assert!(b.try_take(id + 1, 1.0, t + ms(5)).is_err());
    }

    /// A budget that sent four at `t0`, all admitted, and had a fifth refused with exact advice
    /// (not whole seconds, so the window is taken as told): four per 999 ms, learned.
    fn learned_four(t0: Instant) -> Budget {
        let mut b = Budget::unlimited();
        for id in 0..4u64 {
            b.try_take(id, 1.0, t0).unwrap();
            b.admitted(id, 1.0);
        }
        b.try_take(4, 1.0, t0).unwrap();
        b.refused(4, t0, Some(ms(999)));
        b
    }

    #[tokio::test(start_paused = true)]
    async fn a_learned_quota_that_falls_to_nothing_with_no_advice_is_scouted_not_stormed() {
        // Four per ~1 s learned; then the quota refuses everything, advising no wait. Each
        // refusal takes a credit; once none is left and nothing is out, the lone send that
        // follows went at once, and again at once: a send every step, all refused.
        let t0 = Instant::now();
        let mut b = learned_four(t0);
        let (mut sent, mut t, mut id) = (0, t0 + Duration::from_secs(2), 10u64);
        while t < t0 + Duration::from_secs(62) {
            if b.try_take(id, 1.0, t).is_ok() {
                sent += 1;
                b.refused(id, t + ms(2), None);
                id += 1;
            }
            t += ms(10);
        }
        // The four credits, then a scout after holds of 0.5, 1, 2, 4 s and every 5 s after.
        assert!(sent <= 4 + 16, "{sent} sent in a minute, all refused");
        assert!(b.refused_blind_since().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_shrinking_quota_is_followed_and_a_growing_one_probed() {
        let t0 = Instant::now();
        let mut b = learned_four(t0);
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
        // Quiet for a window while sends wait: one probe credit.
        let t2 = t1 + Duration::from_millis(2100);
        let taken: Vec<u64> = (9..20u64).filter(|&id| b.try_take(id, 1.0, t2).is_ok()).collect();
        assert_eq!(taken.len(), 4, "three credits back and one probe");
        // The probe is admitted: two more, and when those are admitted, four more.
        for &id in &taken {
            b.admitted(id, 1.0);
        }
        let second: Vec<u64> = (20..40u64).filter(|&id| b.try_take(id, 1.0, t2).is_ok()).collect();
        assert_eq!(second.len(), 2);
        for &id in &second {
            b.admitted(id, 1.0);
        }
        let third: Vec<u64> = (40..60u64).filter(|&id| b.try_take(id, 1.0, t2).is_ok()).collect();
        assert_eq!(third.len(), 4);
        // A refusal stops the doubling: probes still out mint nothing more when admitted.
        b.refused(third[0], t2, Some(ms(999)));
        for &id in &third[1..] {
            b.admitted(id, 1.0);
        }
        assert!(b.try_take(60, 1.0, t2).is_err());
        assert_eq!(b.effective_capacity(), Some(3.0 + 1.0 + 2.0 + 3.0));
    }

    /// A provider's sliding window, for driving a budget send by send: `capacity` requests per
    /// `window`, a refusal advising when the oldest slot frees (rounded up to whole seconds when
    /// `coarse`).
    struct Server {
        capacity: usize,
        window: Duration,
        coarse: bool,
        log: VecDeque<Instant>,
        /// A fixed window instead: counts start again at every multiple of the window from the
        /// first request (this is its start), and a refusal advises the time to the window's end.
        fixed: Option<Instant>,
    }

    impl Server {
        fn sliding(capacity: usize, window: Duration) -> Self {
            Server { capacity, window, coarse: true, log: VecDeque::new(), fixed: None }
        }

        fn admit(&mut self, now: Instant) -> Result<(), Duration> {
            if let Some(origin) = self.fixed {
                let n = (now.duration_since(origin).as_secs_f64() / self.window.as_secs_f64()).floor();
                let start = origin + self.window.mul_f64(n);
                self.log.retain(|&t| t >= start);
                if self.log.len() < self.capacity {
                    self.log.push_back(now);
                    return Ok(());
                }
                let d = start + self.window - now;
                return Err(if self.coarse { Duration::from_secs(d.as_secs_f64().ceil().max(1.0) as u64) } else { d });
            }
            while self.log.front().is_some_and(|&t| now.duration_since(t) >= self.window) {
                self.log.pop_front();
            }
            if self.log.len() < self.capacity {
                self.log.push_back(now);
                return Ok(());
            }
            let d = self.log[0] + self.window - now;
            Err(if self.coarse { Duration::from_secs(d.as_secs_f64().ceil().max(1.0) as u64) } else { d })
        }
    }

    /// Drives clients (each a budget with an endless queue) against one server for `secs`, in
    /// steps of `step`; sends are answered at once. Returns the admitted sends per window of the
    /// last `tail` windows, and the refusals over the whole run.
    fn drive(
        budgets: &mut [Budget],
        server: &mut Server,
        t0: Instant,
        secs: u64,
        tail: u64,
        step: Duration,
    ) -> (Vec<usize>, u64) {
        // Ids go on from any the budgets already logged (a log is kept in id order).
        let mut id = budgets.iter().filter_map(|b| b.log.back().map(|e| e.id + 1)).max().unwrap_or(0);
        let mut admitted = Vec::new();
        let mut refusals = 0;
        let mut t = t0;
        // Each client's pause, as the throttle's gate holds calls after a refusal.
        let mut hold = vec![t0; budgets.len()];
        while t < t0 + Duration::from_secs(secs) {
            for (b, hold) in budgets.iter_mut().zip(&mut hold) {
                while *hold <= t && b.try_take(id, 1.0, t).is_ok() {
                    match server.admit(t) {
                        Ok(()) => {
                            b.admitted(id, 1.0);
                            admitted.push(t);
                        }
                        Err(d) => {
                            b.refused(id, t, Some(d));
                            refusals += 1;
                            *hold = t + if b.mode() == Mode::Learned { surely_busy(d) } else { d };
                        }
                    }
                    id += 1;
                }
            }
            t += step;
        }
        let w = server.window;
        let start = t0 + Duration::from_secs(secs) - w * tail as u32;
        let per_window = (0..tail as u32)
            .map(|i| admitted.iter().filter(|&&a| a >= start + w * i && a < start + w * (i + 1)).count())
            .collect();
        (per_window, refusals)
    }

    /// Drives one client against `server` for `secs` as a run does (see [`drive_latent_many`]).
    /// Returns the sends admitted and refused.
    fn drive_latent(
        b: &mut Budget,
        server: &mut Server,
        t0: Instant,
        secs: u64,
        latency: Duration,
        in_flight: usize,
    ) -> (u64, u64) {
        let (admitted, refusals) = drive_latent_many(std::slice::from_mut(b), server, t0, secs, latency, in_flight);
        (admitted.len() as u64, refusals[0].len() as u64)
    }

    /// Drives clients (processes on one key, each deciding alone) against `server` for `secs`
    /// as runs do: each has at most `in_flight` calls out, an admitted call is answered
    /// `latency` after it was sent, a refusal at once (the server counted nothing). Returns
    /// when each admitted send was sent (of those answered), and when each client's were refused.
    fn drive_latent_many(
        budgets: &mut [Budget],
        server: &mut Server,
        t0: Instant,
        secs: u64,
        latency: Duration,
        in_flight: usize,
    ) -> (Vec<Instant>, Vec<Vec<Instant>>) {
        let mut id = budgets.iter().filter_map(|b| b.log.back().map(|e| e.id + 1)).max().unwrap_or(0);
        let mut admitted = Vec::new();
        let mut refusals = vec![Vec::new(); budgets.len()];
        // Per client, the calls out: when their answer comes, their id, and the refusal's
        // advice if refused (else when it was sent); and until when the client's gate holds
        // its calls.
        type Out = (Instant, u64, Result<Instant, Duration>);
        let mut out: Vec<Vec<Out>> = vec![Vec::new(); budgets.len()];
        let mut hold = vec![t0; budgets.len()];
        let mut t = t0;
        let step = ms(1);
        while t < t0 + Duration::from_secs(secs) {
            for (i, b) in budgets.iter_mut().enumerate() {
                let out = &mut out[i];
                out.sort_by_key(|o| std::cmp::Reverse(o.0));
                while out.last().is_some_and(|o| o.0 <= t) {
                    let (_, done, refused) = out.pop().expect("not empty");
                    match refused {
                        Ok(sent) => {
                            b.admitted(done, 1.0);
                            admitted.push(sent);
                        }
                        Err(d) => {
                            b.refused(done, t, Some(d));
                            refusals[i].push(t);
                            hold[i] = hold[i].max(t + if b.mode() == Mode::Learned { surely_busy(d) } else { d });
                        }
                    }
                }
                while hold[i] <= t && out.len() < in_flight && b.try_take(id, 1.0, t).is_ok() {
                    match server.admit(t) {
                        Ok(()) => out.push((t + latency, id, Ok(t))),
                        Err(d) => out.push((t + ms(2), id, Err(d))),
                    }
                    id += 1;
                }
            }
            t += step;
        }
        (admitted, refusals)
    }

    #[tokio::test(start_paused = true)]
    async fn probes_do_not_grow_a_budget_that_calls_out_leave_unspent() {
        // A run with few calls out (`--max-concurrency 4`) learned a quota, then sent no faster
        // than its calls came back: its probes were admitted, each minted two more credits that
        // no send waited for, and the summary said "1,165 requests per 1.0 s" learned. Credits
        // nothing waits for prove nothing: the budget grows only by what its sends take.
        let t0 = Instant::now();
        let mut server = Server::sliding(20, Duration::from_secs(5));
        let mut b = Budget::unlimited();
        drive_latent(&mut b, &mut server, t0, 30, ms(300), 64);
        assert_eq!(b.window(), Some(Duration::from_secs(5)));
        server.capacity = 10_000;
        // Two calls out, 0.3 s each: at most 34 sends per 5 s window.
        let (admitted, refusals) = drive_latent(&mut b, &mut server, t0 + Duration::from_secs(30), 120, ms(300), 2);
        let capacity = b.effective_capacity().unwrap();
        assert!(admitted >= 750 && refusals == 0, "{admitted} admitted, {refusals} refused");
        assert!(capacity <= 2.0 * 34.0, "capacity {capacity} per {:?}", b.window());
    }

    /// Runs `records` sends through each of `budgets` (processes deciding alone, answers in
    /// 290-310 ms, slow start from 16 calls out to `in_flight`) against `server`, each starting
    /// `starts[i]` ms after `t0` (processes a shell starts one after another): when each
    /// finished, the refusals, and the refusals per 5 s.
    fn drive_runs(
        budgets: &mut [Budget],
        server: &mut Server,
        t0: Instant,
        records: usize,
        in_flight: usize,
        starts: &[u64],
    ) -> (Vec<f64>, usize, Vec<usize>) {
        type Out = (Instant, u64, Result<Instant, Duration>);
        let n_b = budgets.len();
        assert_eq!(starts.len(), n_b, "one start per run");
        let mut out: Vec<Vec<Out>> = vec![Vec::new(); n_b];
        let mut hold: Vec<Instant> = starts.iter().map(|&s| t0 + ms(s)).collect();
        let mut done = vec![0usize; n_b];
        let mut sent_ok = vec![0usize; n_b];
        let mut ended = vec![0.0; n_b];
        let mut limit = vec![16usize.min(in_flight); n_b];
        let mut per_window = vec![0usize; 90];
        let (mut id, mut refused) = (0u64, 0usize);
        let mut t = t0;
        while ended.contains(&0.0) && t < t0 + Duration::from_secs(400) {
            let first = (t.duration_since(t0).as_millis() as usize) % n_b;
            for k in 0..n_b {
                let i = (first + k) % n_b;
                let b = &mut budgets[i];
                let out = &mut out[i];
                out.sort_by_key(|o| std::cmp::Reverse(o.0));
                while out.last().is_some_and(|o| o.0 <= t) {
                    let (_, n, r) = out.pop().expect("not empty");
                    match r {
                        Ok(_) => {
                            b.admitted(n, 1.0);
                            done[i] += 1;
                            limit[i] = (limit[i] + 1).min(in_flight);
                        }
                        Err(d) => {
                            b.refused(n, t, Some(d));
                            refused += 1;
                            per_window[(t.duration_since(t0).as_secs() / 5) as usize] += 1;
                            sent_ok[i] -= 1;
                            hold[i] = hold[i].max(t + if b.mode() == Mode::Learned { surely_busy(d) } else { d });
                        }
                    }
                }
                if done[i] == records && ended[i] == 0.0 {
                    ended[i] = t.duration_since(t0).as_secs_f64();
                }
                while sent_ok[i] < records && hold[i] <= t && out.len() < limit[i] && b.try_take(id, 1.0, t).is_ok() {
                    sent_ok[i] += 1;
                    match server.admit(t) {
                        Ok(()) => out.push((t + ms(290 + (id * 7919) % 21), id, Ok(t))),
                        Err(d) => out.push((t + ms(2), id, Err(d))),
                    }
                    id += 1;
                }
            }
            t += ms(1);
        }
        while per_window.last() == Some(&0) {
            per_window.pop();
        }
        (ended, refused, per_window)
    }

    /// Four runs of 500 deciding alone (see [`drive_runs`]) on a fixed window of 100 per 5 s
    /// entered `late` ms after it started, each starting `starts[i]` ms in.
    fn four_runs_entered_late(late: u64, starts: &[u64]) -> (Vec<f64>, usize, Vec<usize>) {
        let t0 = Instant::now();
        let mut server = Server { fixed: Some(t0 - ms(late)), ..Server::sliding(100, Duration::from_secs(5)) };
        let mut b = [Budget::unlimited(), Budget::unlimited(), Budget::unlimited(), Budget::unlimited()];
        drive_runs(&mut b, &mut server, t0, 500, 64, starts)
    }

    #[tokio::test(start_paused = true)]
    async fn four_runs_deciding_alone_on_a_fixed_window_entered_late_refuse_few() {
        // #32's row with no coordination: four runs of 500 records on one key that cannot reach
        // each other, a fixed window of 100 per 5 s entered anywhere in it, answers in 0.3 s.
        // Each takes the window short from its first refusal (1 s for 5, entered 4 s late);
        // before, only three ends agreeing on the period lengthened it, and each round that
        // early credits funded until then was refused whole: 7.6-10.2 % refused entered 1 to
        // 4.5 s late. The advised wait bounds the window from below whoever else sends.
        let mut seen = Vec::new();
        let mut refused_all = Vec::new();
        for late in [0u64, 500, 1000, 1500, 2000, 2500, 3000, 3500, 4000, 4500] {
            let (ended, refused, per_window) = four_runs_entered_late(late, &[0; 4]);
            let last = ended.iter().copied().fold(0.0, f64::max);
            refused_all.push(refused);
            // The ideal is 95.3 s (every window full from the start); the unluckiest run sets
            // the end (the share is not fair: a run that took more at the start ends first).
            if refused > 120 || last > 115.0 {
                seen.push(format!("late {late} ms: {refused} refused {per_window:?}, ended {ended:.1?}"));
            }
        }
        refused_all.sort_unstable();
        assert!(seen.is_empty() && refused_all[5] <= 100, "{refused_all:?} {seen:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn four_runs_started_apart_on_a_fixed_window_all_finish_with_few_refusals() {
        // #32's row with no coordination as a shell starts it: four runs of 500 on one key, one
        // after another 50 ms apart, a fixed window of 100 per 5 s entered anywhere in it. This
        // is what reproduces the independent server's runs (one process ending at 50 s, the last
        // at 100-105 s): the run started first ramps up first and takes about half of the first
        // window, and credits replay that share after (started together, the model's runs ended
        // within 20-25 s of each other, which no real run did). The shares are not fair yet
        // (#32); what is kept is that every run finishes close to the ideal (95.3 s) and the
        // refusals stay few: 69-303, median about 100, the last run ending at 99-106 s.
        let mut refused_all = Vec::new();
        let mut seen = Vec::new();
        for late in [0u64, 600, 1200, 1800, 2400, 3000, 3600, 4200] {
            let (ended, refused, per_window) = four_runs_entered_late(late, &[0, 50, 100, 150]);
            let last = ended.iter().copied().fold(0.0, f64::max);
            refused_all.push(refused);
            if refused > 350 || last > 112.0 {
                seen.push(format!("late {late} ms: {refused} refused {per_window:?}, ended {ended:.1?}"));
            }
        }
        refused_all.sort_unstable();
        assert!(seen.is_empty() && refused_all[4] <= 160, "{refused_all:?} {seen:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn processes_deciding_alone_keep_their_shares_when_a_scout_finds_the_window_full() {
        // Four runs of 500 on a fixed window of 100 per 5 s, entered 1.8-3.6 s late: each first
        // takes the window as 3-4 s, and its ends later show the 5-s period. The refusal that
        // shows it is a scout's, sent alone while the others' sends had filled the window; taken
        // as what the window admits of ours (nothing), three of the four fell to 1 per window
        // while the fourth took 97: it ended at 39-41 s, the others at 93-104 s (at 1.8 s late,
        // 75 s and 110 s). Now no run ends later than 1.35 times the first.
        let mut seen = Vec::new();
        for late in [1800u64, 2400, 3600] {
            let (ended, refused, _) = four_runs_entered_late(late, &[0; 4]);
            let first = ended.iter().copied().fold(f64::MAX, f64::min);
            let last = ended.iter().copied().fold(0.0, f64::max);
            if last > first * 1.35 || refused > 160 {
                seen.push(format!("late {late} ms: ended {ended:.1?}, {refused} refused"));
            }
        }
        assert!(seen.is_empty(), "{seen:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn four_runs_deciding_alone_after_other_traffic_on_a_sliding_window_keep_their_credits() {
        // Four runs of 500 (`--quota-store off`) started when a few of a sliding window's 100
        // slots per 5 s still hold another run's requests, expiring 0.5-1.3 s in (on weir sim,
        // four runs started 4.2 s after another: 33-36 % of requests refused, 150-157 s). Each
        // first learns the window as 1 s from the other traffic's expiry, then 4 s from the
        // waits advised, never 5: each round's credits came back a second early and the round
        // was refused whole, each refusal taking its credit, so capacities fell to nothing in a
        // burst. Before: 862-1,042 refused, the last ending at 131-166 s (ideal about 100).
        let mut seen = Vec::new();
        for k in 1..=3u64 {
            let t0 = Instant::now();
            let mut server = Server::sliding(100, Duration::from_secs(5));
            server.log = (0..k * 3).map(|i| t0 - ms(4500) + ms(100 * i)).collect();
            let mut b = [Budget::unlimited(), Budget::unlimited(), Budget::unlimited(), Budget::unlimited()];
            let (ended, refused, per_window) = drive_runs(&mut b, &mut server, t0, 500, 64, &[0; 4]);
            let last = ended.iter().copied().fold(0.0, f64::max);
            if refused > 450 || last > 115.0 {
                seen.push(format!("{} slots taken: {refused} refused {per_window:?}, ended {ended:.1?}", k * 3));
            }
        }
        assert!(seen.is_empty(), "{seen:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_started_while_another_runs_requests_fill_a_sliding_window_waits_for_its_own() {
        // A run deciding alone (`--quota-store off`) started 0-3 s after another ended, on 100
        // per sliding 5 s with whole-second advice: the window still holds the other run's last
        // round. Its first refusals come back before any answer of its own. Learning from them
        // took the window from its own sends still in flight: 4 s with a capacity of 81, and
        // 200-204 of its 300 sends refused, ending at 32-34 s (on weir sim, "84 per 4 s" and a
        // third refused). Learning once the window holds sends of ours, 96-102 are refused and
        // it ends by 26 s. Not yet well: the other run's slots free while ours are admitted, so
        // the window is still taken as 3-4 s, not 5 (the ideal end is about 15 s).
        let mut seen = Vec::new();
        for gap in [0u64, 500, 1000, 1500, 2000, 2500, 3000] {
            let t0 = Instant::now();
            let mut server = Server::sliding(100, Duration::from_secs(5));
            // The other run's last round: 100 sends in 1.5 s as its credits came back (a run
            // sends each window's round as its first did), answered 0.3 s after the last.
            server.log = (0..100).map(|i| t0 - ms(gap) - ms(1800) + ms(15 * i)).collect();
            let mut b = [Budget::unlimited()];
            let (ended, refused, per_window) = drive_runs(&mut b, &mut server, t0, 300, 64, &[0]);
            if refused > 130 || ended[0] > 28.0 {
                seen.push(format!("gap {gap} ms: {refused} refused {per_window:?}, ended {:.1} s", ended[0]));
            }
        }
        assert!(seen.is_empty(), "{seen:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_wave_bigger_than_the_quota_is_measured_from_the_sends_after_it() {
        // 64 calls out at once into 20 per sliding 5 s: 44 refused before any answer, which
        // teaches nothing (whose requests fill the window cannot be told yet). Learned at the
        // next refusal from our oldest admitted send, the window read 10 s (that send's slot
        // had freed when the advised time came); measured from the sends made since, 5 s.
        for fixed in [false, true] {
            let t0 = Instant::now();
            let mut server = Server { fixed: fixed.then_some(t0), ..Server::sliding(20, Duration::from_secs(5)) };
            let mut b = Budget::unlimited();
            drive_latent(&mut b, &mut server, t0, 30, ms(300), 64);
            assert_eq!(b.window(), Some(Duration::from_secs(5)), "fixed: {fixed}");
            assert!(b.effective_capacity().is_some_and(|c| c <= 24.0), "{:?}", b.effective_capacity());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_window_entered_late_with_slow_answers_is_found_with_few_refusals() {
        // As a run meets it: 100 per 5 s in fixed windows, whole-second advice, answers 0.3 s
        // after the send, 8, 16 or 32 calls out. Entered late, the first refusal measures the
        // window from a send made after the window started (too short), or across a reset, from
        // sends of the window before (too long and too large). Before scouts, the sends that
        // early credits funded were refused round after round (743 refused entered 0.5 s late,
        // 562 entered 4.4 s late, the window left at 6 s, with 16 out). With 8 out, the calls
        // of a round are spread over the window, scouts found it open while it was taken 6 to
        // 8 s long, and 258-374 were refused (a round's worth at a time) until the period was
        // found from the lattice the ends of its refusals fall on. Now the window is found
        // within a few windows, for the first burst's refusals (up to the calls out) and about
        // one a window (a probe for more).
        let mut bad = Vec::new();
        for in_flight in [8, 16, 32] {
            for late in [500u64, 1300, 2200, 3000, 3700, 4400] {
                let t0 = Instant::now();
                let mut server = Server { fixed: Some(t0 - ms(late)), ..Server::sliding(100, Duration::from_secs(5)) };
                let mut b = Budget::unlimited().sole(true);
                let (admitted, refusals) = drive_latent(&mut b, &mut server, t0, 75, ms(300), in_flight);
                let seen = format!(
                    "{in_flight} out, late {late} ms: {admitted} admitted, {refusals} refused, window {:?}",
                    b.window()
                );
                let most = 40 + 2 * in_flight as u64;
                bad.extend(
                    (admitted < 1450 || refusals > most || b.window() != Some(Duration::from_secs(5))).then_some(seen),
                );
            }
        }
        assert!(bad.is_empty(), "{bad:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_process_taking_a_fixed_window_over_goes_on_learning_where_the_other_left_off() {
        // The holder of a shared quota is killed 2 to 8 s into a run that entered a fixed
        // window late (100 per 5 s, whole-second advice, answers in 0.3 s), often before it
        // knew the window (entered 1 s late, it had taken it as 4 s). The process that took
        // over got only the window, its capacity and the sends: it trusted its credits back
        // after 4 s and sent half a window into the last second of the server's (48 refused in
        // one second by bench/fixed-late.py), and here refused 37 to 251 in the minute after,
        // against 12 to 45 in the whole run with no kill. Handed where the other was in
        // learning (the window's ends, its scouts, holds and deferred credits) and, before any
        // refusal, the sends the first refusal measures from, it refuses and admits about as
        // the holder would have.
        let mut bad = Vec::new();
        for in_flight in [16, 32] {
            for late in [500u64, 1000, 2200, 3700] {
                for killed in 2..9u64 {
                    let t0 = Instant::now();
                    let mut server =
                        Server { fixed: Some(t0 - ms(late)), ..Server::sliding(100, Duration::from_secs(5)) };
                    let mut a = Budget::unlimited().sole(true);
                    let (first, before) = drive_latent(&mut a, &mut server, t0, killed, ms(300), in_flight);
                    let at = t0 + Duration::from_secs(killed);
                    let seed = a.export(at);
                    let mut b = Budget::unlimited().sole(true);
                    let mut next = 1_000_000;
                    b.seed(&seed, ms(20), at + ms(20), &mut || {
                        next += 1;
                        next
                    });
                    let (admitted, refusals) = drive_latent(&mut b, &mut server, at + ms(20), 60, ms(300), in_flight);
                    // The same run with no kill.
                    let mut server =
                        Server { fixed: Some(t0 - ms(late)), ..Server::sliding(100, Duration::from_secs(5)) };
                    let mut a = Budget::unlimited().sole(true);
                    let whole = drive_latent(&mut a, &mut server, t0, killed + 60, ms(300), in_flight);
                    let seen = format!(
                        "{in_flight} out, late {late} ms, killed at {killed} s: {before} refused before, then \
                         {admitted} admitted, {refusals} refused, window {:?}; no kill: {whole:?}",
                        b.window()
                    );
                    // The calls the killed process had out were counted by the server and never
                    // answered.
                    let lost = in_flight as u64;
                    bad.extend(
                        (first + admitted + lost + 10 < whole.0 || before + refusals > whole.1 + 10).then_some(seen),
                    );
                }
            }
        }
        assert!(bad.is_empty(), "{bad:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn whole_second_advice_is_taken_as_a_whole_second_window() {
        // 50 per 5 s, advice in whole seconds: the first refusal leaves the window between
        // 4.x and 5.x s, and the window is the whole second in that range.
        let mut server = Server::sliding(50, Duration::from_secs(5));
        let mut b = [Budget::unlimited()];
        let (per_window, refusals) = drive(&mut b, &mut server, Instant::now(), 200, 10, ms(1));
        let w = b[0].window().unwrap();
        assert_eq!(w, Duration::from_secs(5));
        // Every window full; about one refusal per window (the probe for more capacity), and
        // the few of the first window.
        assert!(per_window.iter().all(|&n| n >= 49), "{per_window:?}");
        assert!(refusals <= 40 + 5, "{refusals} refusals");
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_window_is_kept_full_with_few_refusals() {
        // 50 per 5 s, counted in fixed windows (all slots free at the window's end), advice in
        // whole seconds, answers at once: every window full, about one refusal each.
        let t0 = Instant::now();
        let mut server = Server { fixed: Some(t0), ..Server::sliding(50, Duration::from_secs(5)) };
        let mut b = [Budget::unlimited()];
        let (per_window, refusals) = drive(&mut b, &mut server, t0, 300, 20, ms(1));
        assert!(per_window.iter().all(|&n| n >= 49), "{per_window:?}");
        // About one a window (the probe for more), and the first window's few.
        assert!(refusals <= 60 + 15, "{refusals} refusals");
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_window_entered_late_is_kept_full_with_few_refusals() {
        // 50 per 5 s in fixed windows, advice in whole seconds; the client starts 0.5 .. 4.7 s
        // into a window, so its first refusal measures the window from its own first send,
        // which is that much after the window's start: too short. The burst its early credits
        // fund is refused, and says how much longer the window is.
        for late in [500u64, 1200, 1700, 2300, 2900, 3500, 4100, 4700] {
            let t0 = Instant::now();
            let mut server = Server { fixed: Some(t0 - ms(late)), ..Server::sliding(50, Duration::from_secs(5)) };
            let mut b = [Budget::unlimited().sole(true)];
            let (per_window, refusals) = drive(&mut b, &mut server, t0, 300, 50, ms(1));
            // Counted in windows of the client's clock, not the server's: the total is what counts.
            let total: usize = per_window.iter().sum();
            assert!(
                total >= 50 * 49,
                "late {late} ms: {total} in 50 windows, window {:?} refusals {refusals}",
                b[0].window()
            );
            // About one a window (the probe for more), and a few while the window is found.
            assert_eq!(b[0].window(), Some(Duration::from_secs(5)), "late {late} ms");
            assert!(refusals <= 60 + 10, "late {late} ms: {refusals} refusals, window {:?}", b[0].window());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_window_is_kept_full_for_long_with_slow_answers() {
        // 100 per 5 s in fixed windows for six minutes, entered late, answers 0.3 s after the
        // send. Once the window is found, about one refusal a window (a probe for more) and the
        // windows full. Before its period was found from its ends, a budget with 8 calls out
        // (a round's calls spread over the window) was refused 1,269 and 2,908 times entered
        // 3.7 and 2.2 s late; with 16 or 32 out, doubling probes cost 2.7-3.2 a window.
        let mut bad = Vec::new();
        for in_flight in [8, 16, 32] {
            for late in [500u64, 2200, 3700] {
                let t0 = Instant::now();
                let mut server = Server { fixed: Some(t0 - ms(late)), ..Server::sliding(100, Duration::from_secs(5)) };
                let mut b = Budget::unlimited().sole(true);
                let (admitted, refusals) = drive_latent(&mut b, &mut server, t0, 360, ms(300), in_flight);
                let seen = format!("{in_flight} out, late {late} ms: {admitted} admitted, {refusals} refused");
                bad.extend((admitted < 7100 || refusals > 3 * 72).then_some(seen));
            }
        }
        assert!(bad.is_empty(), "{bad:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_sliding_window_with_whole_second_advice_is_not_taken_for_a_shorter_fixed_one() {
        // 100 per 5 s in a sliding window, advice in whole seconds, answers 0.3 s after the
        // send, as `weir sim --rpm 100 --window-secs 5 --round-advice --latency-ms 300` serves.
        // An outside tester saw a run's learned quota fall from 100 per 5 s to 23 per 1 s, then
        // 3 per 1 s. It is met when the run starts just after another on the key (the window
        // still holds the other's sends, here `offset` of them): the first refusal measures the
        // window short, scouts find room while the other's slots free, and then the ends of the
        // refusals (where its sends fell, each advised "1s") fitted a 1-s period, which fits any
        // whole-second ends, or a refused scout's hold was taken for a fixed window's opening.
        // Now a period must be told apart by the ends, no window is taken as less than half the
        // one in force, and a quarter of the budget refused within a window lengthens it.
        let (mut bad, mut short) = (Vec::new(), Vec::new());
        for in_flight in [8, 16, 32, 64] {
            for offset in [0u64, 700, 1900, 3100] {
                let t0 = Instant::now();
                let mut server = Server::sliding(100, Duration::from_secs(5));
                // Other traffic on the key before the run: the first window is partly taken.
                for i in 0..offset / 100 {
                    server.log.push_back(t0 - ms(offset) + ms(i * 100));
                }
                let mut b = Budget::unlimited().sole(true);
                let (admitted, refusals) = drive_latent(&mut b, &mut server, t0, 300, ms(300), in_flight);
                let seen = format!(
                    "{in_flight} out, {offset} ms taken: {admitted} admitted, {refusals} refused, window {:?}, \
                     capacity {:?}",
                    b.window(),
                    b.effective_capacity()
                );
                // Sixty windows: all but the first two full, a refusal or two a window.
                let strict = admitted >= 5800
                    && refusals <= 3 * 60 + in_flight as u64
                    && b.window() == Some(Duration::from_secs(5));
                // Never a collapse: before, every case with other traffic first took the window as
                // 1 to 3 s, refused 294 to 4,463 and admitted 4,208 to 5,502. One case still
                // takes it 2 s too long (8 out, 700 ms taken: 4,559 admitted, window 7 s).
                let fair = admitted >= 4500
                    && refusals <= 300
                    && b.window().is_some_and(|w| w >= Duration::from_secs(5) && w <= Duration::from_secs(7));
                if !fair {
                    bad.push(seen);
                } else if !strict {
                    short.push(seen);
                }
            }
        }
        assert!(bad.is_empty() && short.len() <= 2, "{bad:#?} {short:#?}");
    }

    #[tokio::test(start_paused = true)]
    async fn whole_second_advice_gives_the_window_at_once() {
        // 50 per 5 s; the window fills at t0 and the next send, 0.3 s later, is refused with
        // "5s" (4.7 s rounded up): the window is longer than 4.3 s and at most 5.3 s, so 5 s,
        // and the second window opens on time with no probing.
        let mut server = Server::sliding(50, Duration::from_secs(5));
        let mut b = Budget::unlimited();
        let t0 = Instant::now();
        for id in 0..50u64 {
            b.try_take(id, 1.0, t0).unwrap();
            server.admit(t0).unwrap();
            b.admitted(id, 1.0);
        }
        let t = t0 + ms(300);
        b.try_take(50, 1.0, t).unwrap();
        let d = server.admit(t).unwrap_err();
        assert_eq!(d, Duration::from_secs(5));
        b.refused(50, t, Some(d));
        assert_eq!(b.window, Some(Duration::from_secs(5)));
        let mut b = [b];
        // The rest of the first window and the start of the second.
        let (_, refusals) = drive(&mut b, &mut server, t, 5, 0, ms(1));
        assert_eq!(b[0].window(), Some(Duration::from_secs(5)));
        assert!(refusals <= 1, "{refusals} refusals");
        let second = server.log.iter().filter(|&&a| a >= t0 + Duration::from_secs(5)).count();
        assert!(second >= 49, "{second} sends in the second window");
    }

    #[tokio::test(start_paused = true)]
    async fn two_clients_with_whole_second_advice_share_the_window() {
        // Two budgets on one key, starting together: the window stays full with few refusals,
        // and neither takes the window too short (before, a client measured it from the other's
        // sends, sent early, lost its credits to refusals and crawled at one send per window).
        // How the quota is split between them is not fair: here the first to send each step
        // wins freed slots; what is kept is the total, and a client left alone takes it all
        // (the next test).
        let mut server = Server::sliding(60, Duration::from_secs(5));
        let mut b = [Budget::unlimited(), Budget::unlimited()];
        let (per_window, refusals) = drive(&mut b, &mut server, Instant::now(), 300, 10, ms(1));
        assert!(
            per_window.iter().all(|&n| n >= 58),
            "{per_window:?} windows {:?} {:?} refusals {refusals}",
            b[0].window(),
            b[1].window()
        );
        for (i, b) in b.iter().enumerate() {
            let w = b.window().unwrap();
            assert!(w >= ms(4950), "client {i} window {w:?}");
        }
        // About four per window: each client's probe for more, and the replay it displaced.
        assert!(refusals < 300 / 5 * 9 / 2, "{refusals} refusals");
    }

    #[tokio::test(start_paused = true)]
    async fn four_processes_deciding_alone_probe_less_often_after_refusals() {
        // Four processes on one key that cannot reach each other, 100 per 5 s: each probing for
        // more every window cost about one refusal per process and window (5 % of calls in the
        // bench); probing less often after refusals keeps the window full with fewer.
        for fixed in [false, true] {
            let t0 = Instant::now();
            let mut server = Server::sliding(100, Duration::from_secs(5));
            if fixed {
                server.fixed = Some(t0);
            }
            let mut b = [Budget::unlimited(), Budget::unlimited(), Budget::unlimited(), Budget::unlimited()];
            let (per_window, refusals) = drive(&mut b, &mut server, t0, 300, 50, ms(1));
            assert!(per_window.iter().all(|&n| n >= 98), "fixed {fixed}: {per_window:?}");
            // Sends answered at once and held only for what advice in whole seconds surely
            // covers refuse far more here than calls of 0.3 s do; probing every window refused
            // 6,081 on both windows.
            assert!(refusals < 3_600, "fixed {fixed}: {refusals} refusals");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn processes_deciding_alone_lengthen_a_fixed_window_entered_late_from_its_ends() {
        // Two processes on one key that cannot reach each other (no quota store), entering a
        // fixed window of 100 per 5 s late: each takes it too short from its first refusal,
        // and neither may lengthen it by the rules of the sole client (the other's sends make
        // a refusal look like a longer window). Before, one kept 4 s or 3 s for 5 and each round
        // its credits came back early was refused. The ends of the refusals are the server's
        // whoever sent: they give the 5 s. (Entered 3.7 s late, one takes 2 s, and ends a
        // second wide cannot tell 2 s from 5 s: that one is not found this way.)
        for late in [100, 1300, 2300] {
            let t0 = Instant::now();
            let mut server = Server { fixed: Some(t0 - ms(late)), ..Server::sliding(100, Duration::from_secs(5)) };
            let mut b = [Budget::unlimited(), Budget::unlimited()];
            let (_, early) = drive(&mut b, &mut server, t0, 60, 1, ms(1));
            let (per_window, later) = drive(&mut b, &mut server, t0 + Duration::from_secs(60), 60, 12, ms(1));
            for (i, b) in b.iter().enumerate() {
                assert_eq!(b.window(), Some(Duration::from_secs(5)), "late {late} ms: client {i}");
            }
            assert!(later <= 12 * 3, "late {late} ms: {later} refused in the last minute ({early} before)");
            assert!(per_window.iter().sum::<usize>() >= 1100, "late {late} ms: {per_window:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn processes_deciding_alone_scout_a_fixed_window_entered_late() {
        // Four processes on one key that cannot reach each other, entering a fixed window of
        // 100 per 5 s late, answers in 0.3 s, 16 calls out each (as against the independent
        // quota server of `bench/refserver.py`). Each takes the window short from its first
        // refusal, so the credits of its first sends came back before the window ended: every
        // process sent its whole round into it, all were refused and those credits lost, and
        // the window after was left almost empty (here 8 and 14 admitted entered 1 s and 2.2 s
        // late, 1,797 refused over the six entries; in the bench 100 refused, then 2-6
        // admitted). Scouting those rounds costs a refusal per process and keeps the credits.
        let (mut refused, mut emptiest, mut seen) = (0, usize::MAX, Vec::new());
        for late in [500u64, 1000, 1500, 2200, 3000, 3700] {
            let t0 = Instant::now();
            let mut server = Server { fixed: Some(t0 - ms(late)), ..Server::sliding(100, Duration::from_secs(5)) };
            let mut b = [Budget::unlimited(), Budget::unlimited(), Budget::unlimited(), Budget::unlimited()];
            let (admitted, refusals) = drive_latent_many(&mut b, &mut server, t0, 40, ms(300), 16);
            // Admitted per window of the server's, from the one the clients entered.
            let mut sent = [0; 8];
            for t in admitted {
                if let Some(n) = sent.get_mut((t.duration_since(t0 - ms(late)).as_secs() / 5) as usize) {
                    *n += 1;
                }
            }
            refused += refusals.iter().map(Vec::len).sum::<usize>();
            emptiest = emptiest.min(sent[1..].iter().copied().min().unwrap_or(0));
            seen.push((late, sent));
        }
        assert!(refused < 1_400 && emptiest >= 30, "{refused} refused; {seen:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_left_alone_claims_the_whole_quota_quickly() {
        // Two clients share 60 per 5 s; then one stops. The other's probes are admitted and
        // double each round trip, so it holds the whole quota within a few windows.
        let mut server = Server::sliding(60, Duration::from_secs(5));
        let mut both = [Budget::unlimited(), Budget::unlimited()];
        let t0 = Instant::now();
        drive(&mut both, &mut server, t0, 100, 1, ms(1));
        let [a, _] = both;
        let before = a.effective_capacity().unwrap();
        assert!(before < 55.0, "{before}");
        let mut alone = [a];
        let (per_window, _) = drive(&mut alone, &mut server, t0 + Duration::from_secs(100), 40, 4, ms(1));
        assert!(per_window.iter().all(|&n| n >= 57), "{per_window:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_send_with_no_credit_puts_the_budget_in_no_debt() {
        let mut b = Budget::unlimited();
        let t0 = Instant::now();
        b.try_take(0, 1.0, t0).unwrap();
        b.admitted(0, 1.0);
        b.try_take(1, 1.0, t0).unwrap();
        b.refused(1, t0, Some(ms(999)));
        // Nothing out, no credit: one send goes anyway, many times over; each is refused.
        let mut t = t0 + ms(1100);
        for id in 2..50u64 {
            b.try_take(id, 1.0, t).unwrap();
            b.refused(id, t, Some(ms(10)));
            t += ms(1100);
        }
        assert!(b.credits >= 0.0, "credits {}", b.credits);
    }

    #[tokio::test(start_paused = true)]
    async fn whole_second_advice_does_not_stretch_the_window() {
        let mut b = Budget::unlimited();
        let t0 = Instant::now();
        for id in 0..2u64 {
            b.try_take(id, 1.0, t0).unwrap();
            b.admitted(id, 1.0);
        }
        b.try_take(2, 1.0, t0 + ms(200)).unwrap();
        b.refused(2, t0 + ms(200), Some(Duration::from_secs(5)));
        // Refused at 200 ms with "retry-after: 5": the window is longer than 4.2 s and at most
        // 5.2 s; counted in whole seconds, 5 s.
        assert_eq!(b.window(), Some(Duration::from_secs(5)));
        // The next window: a send refused 0.6 s before our oldest credit returns, told "1 s"
        // (rounded up from anything in 0..1 s): consistent, so the window stays.
        let t1 = t0 + ms(5300);
        assert!(b.try_take(3, 1.0, t1).is_ok());
        b.admitted(3, 1.0);
        assert!(b.try_take(4, 1.0, t1).is_ok());
        b.refused(4, t1 + ms(4600), Some(Duration::from_secs(1)));
        assert_eq!(b.window(), Some(Duration::from_secs(5)));
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

    /// Drives one client with 16 calls out against `server` from `t0` for `secs`, as a run
    /// does against a server whose refusals advise no wait (answers in 0.3 s, refusals at
    /// once). Returns when each admitted send went, and how many were refused.
    fn drive_unadvised(b: &mut Budget, server: &mut Server, t0: Instant, secs: u64) -> (Vec<Instant>, usize) {
        let (mut admitted, mut refused) = (Vec::new(), 0);
        let mut out: Vec<(Instant, u64, bool)> = Vec::new();
        let (mut t, mut id) = (t0, 0);
        while t < t0 + Duration::from_secs(secs) {
            out.sort_by_key(|o| std::cmp::Reverse(o.0));
            while out.last().is_some_and(|o| o.0 <= t) {
                let (_, done, ok) = out.pop().expect("not empty");
                if ok {
                    b.admitted(done, 1.0);
                } else {
                    b.refused(done, t, None);
                    refused += 1;
                }
            }
            while out.len() < 16 && b.try_take(id, 1.0, t).is_ok() {
                let ok = server.admit(t).is_ok();
                if ok {
                    admitted.push(t);
                }
                out.push((t + if ok { ms(300) } else { ms(2) }, id, ok));
                id += 1;
            }
            t += ms(1);
        }
        (admitted, refused)
    }

    #[tokio::test(start_paused = true)]
    async fn a_quota_of_zero_whose_refusals_advise_a_wait_is_scouted_not_stormed() {
        // Every send refused, each advising 10 s, none ever admitted: after each pause every
        // waiting send went at once (up to 16 refused every 10 s, for 10 minutes).
        let t0 = Instant::now();
        let d = Duration::from_secs(10);
        let mut b = Budget::unlimited();
        for id in 0..10 {
            b.try_take(id, 1.0, t0).unwrap();
        }
        for id in 0..10 {
            b.refused(id, t0 + ms(5), Some(d));
        }
        // Once the pause is over: one scout, and the others wait for its answer.
        let t1 = t0 + ms(5) + d;
        assert_eq!(b.try_take(10, 1.0, t1), Ok(()));
        assert_eq!(b.try_take(11, 1.0, t1), Err(None));
        // Refused too: one again after the next pause.
        b.refused(10, t1 + ms(5), Some(d));
        let t2 = t1 + ms(5) + d;
        assert_eq!(b.try_take(12, 1.0, t2), Ok(()));
        assert_eq!(b.try_take(13, 1.0, t2), Err(None));
        // Admitted: the quota is back, and the others go.
        b.admitted(12, 1.0);
        for id in 14..24 {
            assert_eq!(b.try_take(id, 1.0, t2 + ms(300)), Ok(()));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_window_filled_by_others_with_no_advice_is_scouted_not_stormed() {
        // A per-minute fixed window (100 a minute) another run filled just before this one
        // started, and refusals that advise no wait, as Vertex AI's: the window stays full for
        // 58 s. Each call refused went again after its retry's backoff: 450 refusals in that
        // minute, and every record failed. Held, with one scout at a time, the run is refused a
        // few times and finds the window open within the longest hold of its opening.
        let t0 = Instant::now();
        let mut server =
            Server { fixed: Some(t0 - Duration::from_secs(2)), ..Server::sliding(100, Duration::from_secs(60)) };
        server.log.extend(std::iter::repeat_n(t0 - Duration::from_secs(1), 100));
        let mut b = Budget::unlimited();
        let (admitted, refused) = drive_unadvised(&mut b, &mut server, t0, 70);
        let opened = t0 + Duration::from_secs(58);
        let first = admitted.first().copied().expect("admitted once the window opened");
        assert!(
            first >= opened && first <= opened + BLIND_LONGEST + ms(10),
            "first admitted {:?} after it opened",
            first - opened
        );
        // 16 refused at once, then a scout about every 5 s; then, once our own 100 filled the
        // next window, the refusal that teaches (sends in flight then are refused too).
        assert!(refused <= 16 + 16 + 16, "{refused} refused");
        assert_eq!(admitted.len(), 100, "the next window's capacity");
        assert_eq!(b.mode(), Mode::Learned, "learned from the refusal after our own sends");
    }

    #[tokio::test(start_paused = true)]
    async fn a_scout_refused_once_own_sends_were_admitted_learns_and_does_not_stall() {
        // 10 per fixed 5 s, refusals that advise no wait. The first 16 go at once: the 6
        // refused come back before any of the 10 admitted is answered, so they teach nothing
        // and hold the calls behind a scout. Refused once the 10 were answered, the scout
        // teaches a quota of 10 per minute (the window assumed). It used to stay the scout
        // out, waited for after it was answered: no call went again, ever.
        let t0 = Instant::now();
        let mut server = Server { fixed: Some(t0), ..Server::sliding(10, Duration::from_secs(5)) };
        let mut b = Budget::unlimited();
        let (admitted, refused) = drive_unadvised(&mut b, &mut server, t0, 130);
        assert_eq!(b.mode(), Mode::Learned);
        // The window assumed frees its 10 after a minute, and again after two.
        let late = admitted.iter().filter(|&&at| at >= t0 + Duration::from_secs(60)).count();
        assert!(admitted.len() >= 30 && late >= 20, "{} admitted, {late} after a minute", admitted.len());
        assert!(refused <= 6 + 1 + 2 * 2, "{refused} refused");
    }

    #[tokio::test(start_paused = true)]
    async fn a_told_limit_above_the_servers_with_no_advice_is_scouted_not_stormed() {
        // Told 20 a minute where the server admits 10 (per fixed minute), refusals advising no
        // wait: each refused send went again at once, as the told limit still had room.
        let t0 = Instant::now();
        let mut server = Server { fixed: Some(t0), ..Server::sliding(10, Duration::from_secs(60)) };
        let mut b = Budget::fixed(20.0, Duration::from_secs(60));
        let (admitted, refused) = drive_unadvised(&mut b, &mut server, t0, 125);
        // 10 in each of the three minutes begun.
        assert_eq!(admitted.len(), 30, "{admitted:?}");
        // Each minute: what the told limit lets out beyond the server's 10, then a scout about
        // every 5 s while the window stays full (12 a minute at most).
        assert!(refused <= 3 * (10 + 12), "{refused} refused");
    }

    #[tokio::test(start_paused = true)]
    async fn a_window_assumed_with_another_default_is_not_taken_over() {
        // A run learned 10 per minute from refusals that advised no wait (the minute assumed).
        let t0 = Instant::now();
        let mut server = Server { fixed: Some(t0), ..Server::sliding(10, Duration::from_secs(5)) };
        let mut a = Budget::unlimited();
        drive_unadvised(&mut a, &mut server, t0, 10);
        assert_eq!((a.mode(), a.window()), (Mode::Learned, Some(DEFAULT_WINDOW)));
        let now = t0 + Duration::from_secs(10);
        let seed = a.export(now);
        let mut next = 1000;
        let mut ids = || {
            next += 1;
            next
        };
        // The next run, given `--limit-window 5`, learns its own window.
        let mut b = Budget::unlimited().with_default_window(Duration::from_secs(5));
        b.seed(&seed, ms(50), now, &mut ids);
        assert_eq!(b.mode(), Mode::Unlimited);
        // One with the same default goes on from it.
        let mut c = Budget::unlimited();
        c.seed(&seed, ms(50), now, &mut ids);
        assert_eq!((c.mode(), c.window()), (Mode::Learned, Some(DEFAULT_WINDOW)));
        // A window the server's advice measured is taken over whatever the default.
        let mut d = Budget::unlimited();
        for id in 0..3 {
            d.try_take(id, 1.0, t0).unwrap();
            d.admitted(id, 1.0);
        }
        d.try_take(3, 1.0, t0).unwrap();
        d.refused(3, t0 + ms(10), Some(ms(4990)));
        let mut e = Budget::unlimited().with_default_window(Duration::from_secs(5));
        e.seed(&d.export(t0 + ms(20)), ms(50), t0 + ms(20), &mut ids);
        assert_eq!(e.mode(), Mode::Learned);
    }

    /// A budget that took over `seed` 50 ms after it was exported, at `t0 + 150 ms`.
    fn seeded(seed: &Seed, t0: Instant) -> Budget {
        let mut b = Budget::unlimited();
        let mut next = 100;
        b.seed(seed, ms(50), t0 + ms(150), &mut || {
            next += 1;
            next
        });
        b
    }

    #[tokio::test(start_paused = true)]
    async fn a_share_of_a_seed_is_that_part_of_the_quota() {
        // Two processes go alone beside a silent holder that had learned 4 per ~1 s: each starts
        // from half of it, not from nothing (a burst the quota refuses) nor from all of it.
        let t0 = Instant::now();
        let mut a = learned_four(t0);
        let seed = a.export(t0 + ms(100)).share(2);
        let mut b = seeded(&seed, t0);
        assert_eq!((b.mode(), b.window()), (Mode::Learned, a.window()));
        assert_eq!(b.effective_capacity(), Some(2.0));
        let later = t0 + ms(999) + ms(30);
        let went = (200..210u64).filter(|&id| b.try_take(id, 1.0, later).is_ok()).count();
        assert!((2..=3).contains(&went), "{went}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_holder_resumed_from_a_stop_keeps_its_share_and_counts_what_the_others_sent() {
        // A holder that learned 4 per ~1 s for two processes was stopped; the other went alone.
        // Resumed, the holder sends its share (2), not all 4. The other joins again 0.5 s later
        // and says it sent 4 just before: those hold the window until they leave it, although
        // the holder's held-back credits and its own sends' have come back by then.
        let t0 = Instant::now();
        let mut a = learned_four(t0);
        let resume = t0 + ms(5000);
        a.resumed(2, resume);
        assert_eq!(a.effective_capacity(), Some(4.0), "the quota it learned is kept");
        let went: Vec<u64> = (200..210u64).filter(|&id| a.try_take(id, 1.0, resume).is_ok()).collect();
        // Its share, and a probe for more: not all four.
        assert!((2..=3).contains(&went.len()), "{} went", went.len());
        // (The probe's answer is not in yet: an admitted probe would mint more.)
        for &id in &went[..2] {
            a.admitted(id, 1.0);
        }
        let theirs = learned_four(t0).export(t0 + ms(100));
        let mut next = 300;
        a.count_sends(&theirs, resume + ms(500), &mut || {
            next += 1;
            next
        });
        let held = (400..410u64).filter(|&id| a.try_take(id, 1.0, resume + ms(1250)).is_ok()).count();
        assert!(held <= 1, "the other's sends still hold the window: {held} went");
        let later = (500..510u64).filter(|&id| a.try_take(id, 1.0, resume + ms(1800)).is_ok()).count();
        assert!(later + held >= 4, "{held} then {later}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_seeded_budget_goes_on_where_the_other_left_off() {
        // One process learned 4 per ~1 s and sent 4; the process that takes the quota over
        // neither learns it again (no burst of refusals) nor sends while those 4 hold it.
        let t0 = Instant::now();
        let mut a = learned_four(t0);
        let seed = a.export(t0 + ms(100));
        let mut b = seeded(&seed, t0);
        assert_eq!((b.mode(), b.window()), (Mode::Learned, a.window()));
        assert!(b.try_take(200, 1.0, t0 + ms(200)).is_err(), "the other's sends still hold the window");
        let later = t0 + ms(999) + ms(30);
        let went = (200..210u64).filter(|&id| b.try_take(id, 1.0, later).is_ok()).count();
        // As many as the other would have sent then (its 4 back, and a probe for more).
        assert_eq!(went, (200..210u64).filter(|&id| a.try_take(id, 1.0, later).is_ok()).count());
        assert!((4..=5).contains(&went), "{went}");
        // A told limit stays, with the other's sends counted against it.
        let mut told = Budget::fixed(5.0, Duration::from_secs(1));
        let mut next = 150;
        told.seed(&seed, ms(50), t0 + ms(150), &mut || {
            next += 1;
            next
        });
        assert_eq!(told.mode(), Mode::Static { capacity: 5.0 });
        assert_eq!((300..310u64).filter(|&id| told.try_take(id, 1.0, t0 + ms(200)).is_ok()).count(), 1);
    }

    /// A limit another run was told (`--rpm 2`) is not taken from its state by a run told
    /// nothing (it held later runs to 2 a minute, silently; found by an outside tester); one an
    /// endpoint's headers gave is.
    #[tokio::test(start_paused = true)]
    async fn a_told_limit_is_not_handed_to_a_run_told_nothing() {
        let t0 = Instant::now();
        let mut told = Budget::fixed(2.0, Duration::from_secs(60));
        assert!(told.try_take(1, 1.0, t0).is_ok());
        let mut next = 10;
        let mut ids = || {
            next += 1;
            next
        };
        let mut untold = Budget::unlimited();
        untold.seed(&told.export(t0 + ms(10)), ms(0), t0 + ms(10), &mut ids);
        assert_eq!(untold.mode(), Mode::Unlimited);
        assert_eq!((100..110u64).filter(|&id| untold.try_take(id, 1.0, t0 + ms(20)).is_ok()).count(), 10);
        let mut headers = Budget::unlimited();
        headers.learn_capacity(2, Some(Duration::from_secs(60)));
        let mut taker = Budget::unlimited();
        taker.seed(&headers.export(t0), ms(0), t0, &mut ids);
        assert_eq!(taker.mode(), Mode::Static { capacity: 2.0 });
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
