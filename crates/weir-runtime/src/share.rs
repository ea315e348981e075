//! Many processes, one quota: the processes of one user on one machine that call the same
//! endpoint with the same key share one throttle, and so behave as one client.
//!
//! A quota belongs to a key, not to a process: two `weir run`s, the workers of a Beam
//! pipeline or the executors of a cluster on one machine that each learned the quota alone
//! would together send more than it allows, be refused, and split it unfairly. Here the first
//! process to call an endpoint takes a lock file named by a digest of the model, the endpoint
//! and the key (never the key itself) in a private runtime directory, and serves its throttle
//! on a Unix socket beside it: it *holds* the quota. Every other process connects, asks the
//! holder to admit each of its calls and reports each call's result, so the holder's throttle
//! learns the quota, the concurrency the endpoint takes and the pauses the server advises from
//! every process's calls, and admits them together as one client's (told limits too: four
//! processes told `--rpm 100` send 100 a minute together).
//!
//! Nothing is left behind to block a run: the lock is the kernel's (`flock`), released when
//! the holder's process ends however it ends. Then one of the others takes it and serves, its
//! throttle seeded with the limits the holder last wrote down, so the quota is not learned
//! again from a burst of refusals. A process that ends while it is served gives its calls'
//! slots back as the holder's throttle frees them (one window after they were sent). A process
//! that cannot reach the holder decides alone until it can.

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use weir_core::{
    Delegate, ErrorKind, Grant, LimitInfo, ModelError, QuotaScope, RateSettings, RateSnapshot, RetryHint, Throttle,
    ThrottleSettings, Usage, Weight,
};

/// A connection that carries the protocol: a Unix socket between the processes of one machine,
/// or a connection to a cluster's scheduler (TLS or TCP, as the cluster's credentials say).
pub trait Link: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Link for T {}

/// The environment variable that names the directory where processes meet (default: the
/// user's runtime directory, `$XDG_RUNTIME_DIR/weir`, else `/tmp/weir-<uid>`).
pub const DIR_VAR: &str = "WEIR_QUOTA_DIR";

/// The version of what processes say to each other where they meet (the lines on the socket
/// and the state file). It is part of every quota's name, so that processes of weir versions
/// that speak differently meet in different places — each then decides alone, as processes
/// that cannot reach each other do — instead of misreading each other's lines. Raise it with
/// any change to [`Ask`], [`Answer`] or [`Written`] that an older process would misread.
const PROTOCOL: &str = "weir-quota-1";

/// The name under which processes share the quota of `model` at `endpoint` called with
/// `credential`: a digest, so that neither the key nor the URL can be read from it.
pub fn quota_name(model: &str, endpoint: &str, credential: Option<&str>) -> String {
    let mut h = Sha256::new();
    for part in [PROTOCOL, model, endpoint, credential.unwrap_or("")] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize()[..12].iter().map(|b| format!("{b:02x}")).collect()
}

/// The directory where processes meet, made private to this user if new. `Err` says why it
/// cannot be used (then each process keeps the quota alone).
fn meeting_dir() -> Result<PathBuf, String> {
    let uid = uid();
    // Empty is unset. Only the meeting directory itself is made, never its parents: a
    // mistyped path must not grow a tree of directories from the root.
    let dir = match std::env::var_os(DIR_VAR) {
        // Relative to the working directory when it was read (sockets are bound and met by
        // the path as written, so processes started in one directory meet there).
        Some(d) if !d.is_empty() => std::path::absolute(PathBuf::from(d)).map_err(|e| format!("{DIR_VAR}: {e}"))?,
        // A runtime directory that is not there (set by a session that ended) is no place to
        // meet: the temporary directory is.
        _ => match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
            Some(d) if !d.as_os_str().is_empty() && d.is_dir() => d.join("weir"),
            _ => std::env::temp_dir().join(format!("weir-{uid}")),
        },
    };
    private_dir(&dir)?;
    Ok(dir)
}

/// Makes `dir` (not its parents) private to this user if it is not there; `Err` says why it
/// cannot be where processes meet.
fn private_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let uid = uid();
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot make {}: {e}", dir.display())),
    }
    // Another user's directory (made first, in a shared /tmp) must not be trusted: whoever
    // owns it could answer for the holder.
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let wrong = if meta.file_type().is_symlink() {
        Some("is a symbolic link (processes meet only in a real directory)".to_string())
    } else if !meta.is_dir() {
        Some("is not a directory".to_string())
    } else if meta.uid() != uid {
        Some(format!("belongs to another user (uid {})", meta.uid()))
    } else if meta.permissions().mode() & 0o077 != 0 {
        Some(format!("is open to other users (mode {:o}; chmod 700 it)", meta.permissions().mode() & 0o777))
    } else {
        None
    };
    if let Some(wrong) = wrong {
        return Err(format!("{} {wrong}; set {DIR_VAR} to a directory of this user's alone (mode 700)", dir.display()));
    }
    Ok(())
}

/// Joins the processes that share `throttle`'s quota under `name`: from now on, while another
/// process holds the quota, `throttle` defers to it; otherwise this process holds it and serves
/// the others. Does nothing outside a tokio runtime or when the meeting directory cannot be
/// used (said once, as a warning).
pub fn join(throttle: &Arc<Throttle>, name: String) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
    let dir = match meeting_dir() {
        Ok(d) => d,
        Err(why) => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Relaxed) {
                tracing::warn!("the quota is not shared with other processes on this machine: {why}");
            }
            throttle.set_unshared(why);
            return;
        }
    };
    let place = match Place::in_dir(&dir, &name) {
        Ok(p) => p,
        Err(why) => return not_shared(throttle, why),
    };
    throttle.await_delegate();
    handle.spawn(supervise(Arc::downgrade(throttle), place, true, CancellationToken::new(), false));
}

#[cfg(feature = "redis")]
/// Sharing through this machine for a while: see [`fall_back`].
pub(crate) struct Fallback {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    throttle: Weak<Throttle>,
    place: Place,
}

#[cfg(feature = "redis")]
impl Fallback {
    /// Ends it: this process holds or follows the quota on this machine no more (the processes
    /// it served are let go), and its calls wait for whoever decides next. Returns, when
    /// another process held the quota here, what that one last wrote down (and how long ago):
    /// a process that takes the quota over through the store next, and finds nothing written
    /// there (a Redis server restarted empty), starts from it rather than from nothing, which
    /// sent a whole told limit beside what the machine had sent in the window. `Err(())` when
    /// this process held it: then its budgets know what the machine sent.
    pub(crate) async fn end(self) -> Result<Option<(Handed, Duration)>, ()> {
        let held_here = held().lock().unwrap_or_else(|e| e.into_inner()).iter().any(|(_, p)| *p == self.place.state);
        self.stop.cancel();
        let _ = self.task.await;
        if let Some(t) = self.throttle.upgrade() {
            t.set_machine_only(false);
        }
        if held_here {
            return Err(());
        }
        Ok(last_written(&self.place).filter(|(h, age)| *age < h.current_for() + STATE_GRACE))
    }
}

/// Shares `throttle`'s quota under `name` with the processes on this machine (as
/// `--quota-store local` does, but apart from it) while the store they all named cannot be
/// reached, until [`Fallback::end`]. A Redis server stopped mid-run left each process deciding
/// alone, the one that held the quota with the whole of it and the others with nothing: a
/// helper saw 11-13 % of calls refused, and one process starve. Processes on other machines
/// may be deciding alone meanwhile, so the quota is not taken as this machine's alone (its
/// refusals may be theirs). `None` where the meeting directory cannot be used.
///
/// `held`: this process held the quota through the store. Its budgets know the quota, so it
/// writes them down for whoever holds the quota here, and the others wait [`HOLDER_FIRST`]
/// before they try to, so that it usually does itself (else one that knows nothing of the
/// quota would learn it again from 429s). `hung`: the store was found hung rather than down;
/// the others wait [`HOLDER_FIRST_HUNG`] instead.
#[cfg(feature = "redis")]
pub(crate) fn fall_back(throttle: &Arc<Throttle>, name: &str, held: bool, hung: bool) -> Option<Fallback> {
    let place = Place::in_dir(&meeting_dir().ok()?, &format!("{name}-fallback")).ok()?;
    throttle.set_sole(false);
    throttle.set_machine_only(true);
    throttle.await_delegate();
    if held {
        write_state(throttle, &place.state);
    }
    let stop = CancellationToken::new();
    let (weak, until, at) = (Arc::downgrade(throttle), stop.clone(), place.clone());
    let task = tokio::spawn(async move {
        if !held {
            pause(if hung { HOLDER_FIRST_HUNG } else { HOLDER_FIRST }, &until).await;
        }
        supervise(weak, at, false, until, held).await;
    });
    Some(Fallback { stop, task, throttle: Arc::downgrade(throttle), place })
}

/// How long the processes that followed a quota's holder through a store wait, when the store
/// cannot be reached, before they try to hold the quota on this machine (see [`fall_back`]).
#[cfg(feature = "redis")]
const HOLDER_FIRST: Duration = Duration::from_millis(300);

/// As [`HOLDER_FIRST`], when the store was found hung by a time-out rather than refusing: each
/// process finds that when its own command times out, and the holder's pops block a second
/// longer than a follower's. Under [`weir_core::throttle::DECIDING_AT_MOST`], the 2 s calls
/// wait for a throttle before going alone.
#[cfg(feature = "redis")]
const HOLDER_FIRST_HUNG: Duration = Duration::from_millis(1500);

/// Says, now and in the summary, that `throttle`'s quota is not shared with other processes.
fn not_shared(throttle: &Throttle, why: String) {
    tracing::warn!("the quota is not shared with other processes: {why}");
    throttle.set_unshared(why);
}

/// Where the processes sharing one quota meet.
#[derive(Debug, Clone)]
struct Place {
    lock: PathBuf,
    socket: PathBuf,
    /// What the holder's budgets know, written down as it goes, for the next holder.
    state: PathBuf,
}

/// How long after its window what a holder wrote down is still taken over: long enough for the
/// next holder to take it (it tries every 50 ms), short enough that a run started later, or a
/// new server on the same port, learns its quota afresh.
pub(crate) const STATE_GRACE: Duration = Duration::from_secs(2);
/// How often, at most, the holder writes down what its budgets know (when it admitted calls
/// since).
const STATE_EVERY: Duration = Duration::from_millis(20);

impl Place {
    /// The files of the quota `name` in the meeting directory `dir`; `Err` says why they cannot
    /// be used.
    fn in_dir(dir: &std::path::Path, name: &str) -> Result<Place, String> {
        let place = Place {
            lock: dir.join(format!("{name}.lock")),
            socket: dir.join(format!("{name}.sock")),
            state: dir.join(format!("{name}.state")),
        };
        // A Unix socket's path is limited to 107 bytes.
        if place.socket.as_os_str().len() > 100 {
            return Err(format!(
                "{} is too long a path for a socket; set {DIR_VAR} to a shorter one",
                place.socket.display()
            ));
        }
        Ok(place)
    }
}

/// What a holder hands to the next (written down as it goes, wherever the processes meet).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Handed {
    budgets: (weir_core::rate::Seed, weir_core::rate::Seed),
    /// The concurrency limit and the ceiling it found (adaptive concurrency only).
    #[serde(default)]
    concurrency: Option<(usize, Option<usize>)>,
    /// Calls in flight that the holder admitted.
    #[serde(default)]
    in_flight: usize,
}

impl Handed {
    /// What `t` knows now.
    pub(crate) fn of(t: &Throttle) -> Self {
        Handed { budgets: t.rate_limiter().export(), concurrency: t.export_concurrency(), in_flight: t.in_flight() }
    }

    /// How long after it was written this still tells the next holder something true (see
    /// [`weir_core::rate::Seed::current_for`]).
    pub(crate) fn current_for(&self) -> Duration {
        self.budgets.0.current_for().max(self.budgets.1.current_for())
    }

    /// One share of `n` processes' (see [`weir_core::rate::Seed::share`]): the calls in flight
    /// are the holder's to count, not the share's.
    fn share(&self, n: usize) -> Handed {
        let part = |x: usize| (x / n.max(1)).max(1);
        Handed {
            budgets: (self.budgets.0.share(n), self.budgets.1.share(n)),
            concurrency: self.concurrency.map(|(limit, ceiling)| (part(limit), ceiling.map(part))),
            in_flight: 0,
        }
    }

    /// Makes `throttle` go on from here, `age` after it was written down.
    pub(crate) fn take_over(&self, throttle: &Arc<Throttle>, age: Duration) {
        throttle.rate_limiter().seed(&self.budgets, age);
        if let Some((limit, ceiling)) = self.concurrency {
            throttle.seed_concurrency(limit, ceiling);
        }
        throttle.take_over_in_flight(self.in_flight, CLAIM_WITHIN);
        tracing::debug!(age = ?age, "took over the limits the last holder knew");
    }
}

/// What a holder wrote down in the meeting directory.
#[derive(Debug, Serialize, Deserialize)]
struct Written {
    /// When, in seconds since the Unix epoch.
    at: f64,
    handed: Handed,
}

/// How long a new holder keeps slots aside for the calls its predecessor admitted, waiting for
/// their processes to reconnect and say how many are theirs.
pub(crate) const CLAIM_WITHIN: Duration = Duration::from_secs(2);

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// What the last holder wrote down at `place`, and how long ago: `None` when there is nothing
/// readable.
fn last_written(place: &Place) -> Option<(Handed, Duration)> {
    let bytes = std::fs::read(&place.state).ok()?;
    let w = serde_json::from_slice::<Written>(&bytes).ok()?;
    Some((w.handed, Duration::from_secs_f64((unix_now() - w.at).max(0.0))))
}

/// Seeds `throttle` with what the last holder wrote down, if it is recent.
fn take_over(throttle: &Arc<Throttle>, place: &Place) {
    if let Some((handed, age)) = last_written(place).filter(|(h, age)| *age < h.current_for() + STATE_GRACE) {
        handed.take_over(throttle, age);
    }
}

/// How old what a silent holder last wrote down may be for a process going alone beside it to
/// start from its share (the quota learned then is still the best guess there is).
const SHARE_WITHIN: Duration = Duration::from_secs(600);

/// Seeds `throttle`, about to decide alone while the process holding its quota is silent, with
/// its share of what that process last wrote down: starting from nothing, each process going
/// alone sent a burst the quota refused (a helper saw 95–121 429s in a second after a holder
/// was stopped). The processes are counted as the most that shared the quota, at least two.
fn share_of_silent_holder(throttle: &Arc<Throttle>, place: &Place) {
    if let Some((handed, age)) = last_written(place).filter(|(_, age)| *age < SHARE_WITHIN) {
        let n = throttle.sharing().processes.max(2);
        handed.share(n).take_over(throttle, age);
    }
}

/// Writes down what the holder's budgets know whenever it admitted calls since last time: every
/// 20 ms, or less often when writing takes long (a window of many calls), and once more when
/// the task ends with the process (a normal exit hands over everything; a kill, all but the
/// last few milliseconds).
async fn write_down(throttle: Weak<Throttle>, path: PathBuf, holding: CancellationToken) {
    struct Last(Weak<Throttle>, PathBuf);
    impl Drop for Last {
        fn drop(&mut self) {
            if let Some(t) = self.0.upgrade() {
                write_state(&t, &self.1);
            }
        }
    }
    let mut written = Last(throttle.clone(), path.clone());
    let mut last = u64::MAX;
    let mut every = STATE_EVERY;
    loop {
        pause(every, &holding).await;
        if holding.is_cancelled() {
            // Another process holds the quota and writes down what it knows from now on.
            written.0 = Weak::new();
            return;
        }
        let Some(t) = throttle.upgrade() else { return };
        let admitted = t.admitted();
        if admitted == last {
            continue;
        }
        last = admitted;
        let took = std::time::Instant::now();
        write_state(&t, &path);
        every = STATE_EVERY.max(took.elapsed() * 20);
    }
}

/// A quota this process holds on this machine, and the file it writes down what its budgets
/// know in.
type Held = (Weak<Throttle>, PathBuf);

/// The quotas this process holds on this machine.
fn held() -> &'static Mutex<Vec<Held>> {
    static HELD: OnceLock<Mutex<Vec<Held>>> = OnceLock::new();
    HELD.get_or_init(Mutex::default)
}

/// Writes down, once more and as of now, what every quota this process holds knows. Called when
/// a run ends: the last periodic write may be up to 20 ms old and miss the last burst of sends,
/// and the write a task makes when it is dropped does not happen when the process exits with
/// its tasks still running. The process that takes over next then counts every send of ours.
pub fn leave_all() {
    let held: Vec<_> = held().lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
    for (throttle, path) in held {
        if let Some(t) = throttle.upgrade() {
            write_state(&t, &path);
        }
    }
}

/// Replaced whole (a new file renamed over the old), so a reader never sees half of it; not
/// synced to disk as `weir_io::state::write_atomic` does: it is only for the process that takes
/// over next, seconds from now, and an fsync every 20 ms would cost more than it is worth.
fn write_state(t: &Throttle, path: &std::path::Path) {
    let w = Written { at: unix_now(), handed: Handed::of(t) };
    let bytes = serde_json::to_vec(&w).expect("the budgets serialise");
    let tmp = path.with_extension("state.tmp");
    if std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path)).is_err() {
        tracing::debug!("could not write down the shared quota's limits");
    }
}

/// How long calls wait for a process that holds a quota's lock to listen on its socket before
/// this process decides alone (a holder that never listens is stuck, not starting).
const HOLDER_STARTS_WITHIN: Duration = Duration::from_secs(10);

/// Holds the quota when no one else does, else follows the holder; again whenever the holder
/// goes away; until `stop`. `whole`: every process on the quota meets at `place` (not so when
/// it is a [`fall_back`]), so the holder's throttle may read refusals as the quota's own.
///
/// `own_state`: what is written down at `place` is this process's own (see [`fall_back`]): it
/// does not take it over again itself, which would count its sends and calls in flight twice.
async fn supervise(throttle: Weak<Throttle>, place: Place, whole: bool, stop: CancellationToken, mut own_state: bool) {
    let mut quiet = false;
    // The holder has not answered (this process deciding alone meanwhile), said once.
    let mut silent = false;
    // Since when a holder has had the lock but no socket yet.
    let mut starting_since: Option<tokio::time::Instant> = None;
    // This process held the quota until another took it (here, or through the store it falls
    // back from): the holder is to count what it sent.
    let mut displaced = own_state;
    loop {
        if stop.is_cancelled() {
            return;
        }
        let Some(t) = throttle.upgrade() else { return };
        let tried = try_hold(&place);
        if !matches!(tried, Ok(Some(_))) {
            own_state = false;
        }
        match tried {
            Ok(Some((lock, listener))) => {
                // Seeded first: calls waiting for a decision go as soon as it is made.
                if !std::mem::take(&mut own_state) {
                    take_over(&t, &place);
                }
                // Every process of this machine on the quota goes through this one now.
                t.set_sole(whole);
                t.delegate_to(None);
                tracing::debug!(socket = %place.socket.display(), "holding the shared quota");
                if let Some(dir) = place.lock.parent().map(|d| d.to_path_buf()) {
                    tokio::task::spawn_blocking(move || sweep(&dir, std::time::SystemTime::now()));
                }
                let holding = stop.child_token();
                held().lock().unwrap_or_else(|e| e.into_inner()).push((Arc::downgrade(&t), place.state.clone()));
                tokio::spawn(write_down(Arc::downgrade(&t), place.state.clone(), holding.clone()));
                serve(t, listener, lock, &place, &holding).await;
                // Only when another process took the quota (its files were removed meanwhile):
                // this one follows it from now on.
                holding.cancel();
                held().lock().unwrap_or_else(|e| e.into_inner()).retain(|(_, path)| *path != place.state);
                if stop.is_cancelled() {
                    return;
                }
                displaced = true;
                continue;
            }
            Ok(None) => {}
            // The meeting directory was removed (with the holder gone, nobody made it again):
            // made again here, and the quota held or followed as before.
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && place.lock.parent().is_some_and(|dir| private_dir(dir).is_ok()) =>
            {
                remade(format_args!(
                    "the directory where processes share the quota was removed ({})",
                    place.lock.parent().unwrap_or(&place.lock).display()
                ));
                continue;
            }
            Err(e) => {
                let dir = place.lock.parent().unwrap_or(&place.lock).display().to_string();
                not_shared(&t, format!("cannot use {dir} ({e}); set {DIR_VAR} to a directory of this user's"));
                t.delegate_to(None);
                return;
            }
        }
        match UnixStream::connect(&place.socket).await {
            Ok(stream) => {
                starting_since = None;
                let ended = Arc::new(tokio::sync::Notify::new());
                let peer = Peer::start(stream, ended.clone());
                let notified = ended.notified();
                drop(t);
                match peer.answers().await {
                    Answered::Yes => {}
                    // Ending: whoever holds the quota next is found at once.
                    Answered::Closed => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Answered::Silent => {
                        let Some(t) = throttle.upgrade() else { return };
                        alone_beside_a_silent_holder(&t, &place, &mut silent);
                        drop(t);
                        pause(HOLDER_SILENT, &stop).await;
                        continue;
                    }
                }
                let Some(t) = throttle.upgrade() else { return };
                let was_silent = std::mem::take(&mut silent);
                if was_silent || std::mem::take(&mut displaced) {
                    // What this process sent alone (or as the holder) is in the server's
                    // window: the holder counts it (before any call of this process asks it).
                    peer.tell_sent(t.rate_limiter().export());
                }
                if was_silent {
                    tracing::warn!("the process holding the shared quota answers again; sharing the quota");
                }
                t.set_sole(whole);
                t.delegate_to(Some(peer.clone()));
                // The holder and this one, at least (its grants tell how many more).
                t.set_processes(2);
                tracing::debug!(socket = %place.socket.display(), "sharing the quota held by another process");
                drop(t);
                tokio::select! {
                    () = notified => {}
                    () = stop.cancelled() => {
                        peer.close();
                        return;
                    }
                }
                if let Some(t) = throttle.upgrade() {
                    if peer.went_silent() {
                        alone_beside_a_silent_holder(&t, &place, &mut silent);
                    } else {
                        t.await_delegate();
                    }
                }
                quiet = false;
            }
            Err(e) => {
                // The holder is starting (it has the lock, not yet the socket), or just ended.
                if !quiet {
                    tracing::debug!("no holder to share the quota with yet: {e}");
                    quiet = true;
                }
                // A live process holds the lock: this one's calls wait for it (on a loaded
                // machine it can take longer than `DECIDING_AT_MOST` to listen) rather than
                // go alone beside it, for up to `HOLDER_STARTS_WITHIN`.
                let since = *starting_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() < HOLDER_STARTS_WITHIN {
                    t.await_delegate();
                }
                drop(t);
                pause(Duration::from_millis(50), &stop).await;
            }
        }
    }
}

/// Sleeps for `d`, or until `stop`.
async fn pause(d: Duration, stop: &CancellationToken) {
    tokio::select! {
        () = tokio::time::sleep(d) => {}
        () = stop.cancelled() => {}
    }
}

/// Whether `file` is the file at `path` now (not one removed since it was opened).
fn same_file(file: &std::fs::File, path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// How long a quota's files stay in the meeting directory after their last use.
const STALE: Duration = Duration::from_secs(7 * 24 * 3600);

/// Removes the files of quotas no process has used for [`STALE`] (each endpoint, key and model
/// leaves a lock, a socket and a state file, and a run against a simulator on a random port is
/// a new endpoint each time). A quota's files are removed only under its lock, and a process
/// that opened the lock file before it was removed sees so once it has the lock (see
/// [`try_hold`]), so a sweep never lets two processes hold one quota.
fn sweep(dir: &std::path::Path, now: std::time::SystemTime) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().is_none_or(|x| x != "lock") {
            continue;
        }
        let files = [path.clone(), path.with_extension("sock"), path.with_extension("state")];
        let used = files.iter().filter_map(|f| std::fs::symlink_metadata(f).ok()?.modified().ok()).max();
        if used.is_none_or(|t| now.duration_since(t).unwrap_or_default() < STALE) {
            continue;
        }
        let Ok(lock) = std::fs::OpenOptions::new().write(true).open(&path) else { continue };
        if lock.try_lock().is_err() || !same_file(&lock, &path) {
            continue;
        }
        for f in files.iter().rev() {
            let _ = std::fs::remove_file(f);
        }
        removed += 1;
    }
    removed
}

/// Makes `throttle` decide alone while the process holding its quota says nothing (stopped or
/// hung, with the lock still held): its calls go on beside it instead of waiting for it, as
/// when processes share nothing. Seeded and said once per silent stretch, until the holder
/// answers again: the supervisor asks again every few seconds, and seeding each time set the
/// concurrency back to the share, undoing what this process learned alone in between.
fn alone_beside_a_silent_holder(throttle: &Arc<Throttle>, place: &Place, said: &mut bool) {
    throttle.set_sole(false);
    if !*said {
        share_of_silent_holder(throttle, place);
    }
    throttle.delegate_to(None);
    if !std::mem::replace(said, true) {
        tracing::warn!(
            "the process holding the shared quota has not answered for {} s (stopped, or hung?); this process \
             decides alone until it answers",
            HOLDER_SILENT.as_secs()
        );
    }
}

/// Takes the lock and the socket if no process holds the quota: `None` when one does.
fn try_hold(place: &Place) -> std::io::Result<Option<(std::fs::File, UnixListener)>> {
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&place.lock)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
        Err(std::fs::TryLockError::Error(e)) => return Err(e),
    }
    // A sweep (below) removed the file between its opening and its locking: this lock is on a
    // file no other process will open. Not held; the next try opens the file now there.
    if !same_file(&lock, &place.lock) {
        return Ok(None);
    }
    // A socket left by a holder that ended: nobody listens on it, and the lock says nobody will.
    match std::fs::remove_file(&place.socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(&place.socket)?;
    Ok(Some((lock, listener)))
}

/// What a process asks of the holder.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Ask {
    /// Admit call `id` of `tokens` estimated tokens.
    Admit { id: u64, tokens: u64 },
    /// Call `id` went this way.
    Finish { id: u64, latency_us: u64, result: Reported },
    /// Call `id` is no longer wanted (it was cancelled), admitted or not.
    Abandon { id: u64 },
    /// `n` calls of this process, admitted by a holder that went away, are still in flight:
    /// count them against the concurrency until each lands.
    Carry { n: usize },
    /// One of the carried calls ended.
    Landed,
    /// What this process sent while it decided alone beside the holder (which was silent):
    /// its budgets' sends of the last window, for the holder to count.
    Sent { budgets: Box<(weir_core::rate::Seed, weir_core::rate::Seed)> },
    /// The process is alive (every [`HEARTBEAT`]): a process stopped with Ctrl-Z keeps its
    /// connection open, and the calls the holder granted it would hold their slots until it
    /// resumed, stopping every other process (see [`serve_peer`]).
    Alive,
}

/// What the holder answers.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Answer {
    /// Call `id` may go.
    Granted { id: u64, waited_us: u64, concurrency: usize, rates: RateSnapshot, processes: usize },
    /// The holder is alive: sent on connecting and every [`HEARTBEAT`], so that a process
    /// waiting for a grant tells a holder that has nothing to grant yet (its window is full)
    /// from one that no longer answers (stopped with Ctrl-Z or SIGSTOP, or hung).
    Alive,
}

/// How often the holder says it is alive to each process it serves.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// How long a holder may say nothing before the processes it serves decide alone (and try it
/// again later): five heartbeats, so that a holder slowed down by a busy machine is not left.
pub(crate) const HOLDER_SILENT: Duration = Duration::from_secs(5);

/// The next line, or `Err` when the other side said nothing for `silent`. A process that was
/// itself stopped finds its timers run out the moment it resumes, possibly before it sees the
/// lines that came meanwhile: a short second look tells that from silence.
async fn next_line_within<R: AsyncBufRead + Unpin>(
    lines: &mut tokio::io::Lines<R>,
    silent: Duration,
) -> Result<Option<String>, ()> {
    match tokio::time::timeout(silent, lines.next_line()).await {
        Ok(l) => Ok(l.ok().flatten()),
        Err(_) => match tokio::time::timeout(Duration::from_millis(200), lines.next_line()).await {
            Ok(l) => Ok(l.ok().flatten()),
            Err(_) => Err(()),
        },
    }
}

/// A call's result, as the throttle learns from it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reported {
    Ok { usage: Usage, limits: Option<LimitInfo> },
    Err { kind: ErrorKind, hint: RetryHint, status: Option<u16>, quota: Option<QuotaScope>, unreachable: bool },
}

impl Reported {
    fn of(result: Result<(Usage, Option<LimitInfo>), &ModelError>) -> Self {
        match result {
            Ok((usage, limits)) => Reported::Ok { usage, limits },
            Err(e) => Reported::Err {
                kind: e.kind,
                hint: e.hint,
                status: e.status,
                quota: e.quota,
                unreachable: e.unreachable,
            },
        }
    }

    fn teach(self, admitted: weir_core::Admitted<'_>, latency: Duration) {
        match self {
            Reported::Ok { usage, limits } => admitted.finish_timed(Ok((usage, limits)), Some(latency)),
            Reported::Err { kind, hint, status, quota, unreachable } => {
                let e = ModelError {
                    kind,
                    hint,
                    message: "reported by a process sharing the quota".into(),
                    status,
                    quota,
                    unreachable,
                };
                admitted.finish_timed(Err(&e), Some(latency));
            }
        }
    }
}

fn line<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut l = serde_json::to_vec(msg).expect("messages serialise");
    l.push(b'\n');
    l
}

/// How often the holder checks that its lock file and socket are still where processes meet.
const CHECK_PLACE_EVERY: Duration = Duration::from_millis(500);

/// Serves the throttle to the processes that share its quota, for as long as this process
/// lives (the lock is held as long as `lock` is open), or until another process holds the
/// quota: then the processes it served are let go (to find that one), and `holding` cancelled.
///
/// The meeting directory can be removed under a holder (a cleaner of `/tmp`, a user's
/// `rm -rf`): its lock and socket go with it, and a process started next would make a new lock,
/// hold that, and keep a throttle of its own beside this one. So every [`CHECK_PLACE_EVERY`] the
/// holder makes its files again if they went; only a process started in that half second can
/// take the quota, and then this one gives way to it.
async fn serve(
    throttle: Arc<Throttle>,
    mut listener: UnixListener,
    mut lock: std::fs::File,
    place: &Place,
    holding: &CancellationToken,
) {
    let peers = Arc::new(AtomicUsize::new(0));
    tokio::spawn(watch_for_a_stop(Arc::downgrade(&throttle), holding.clone()));
    // Each served process's number for the throttle's turns (this one is 0).
    let mut member = 0u64;
    let mut socket = file_id(&place.socket);
    let mut check = tokio::time::interval(CHECK_PLACE_EVERY);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            // Stopped sharing through this machine (see [`fall_back`]).
            () = holding.cancelled() => return,
            _ = check.tick() => {
                match keep_place(place, &mut lock, &mut listener, &mut socket) {
                    Holding::Yes => continue,
                    Holding::Another => {
                        tracing::warn!(
                            "the files where processes share the quota ({}) were removed, and another process holds the \
                             quota now; this one shares it with that one",
                            place.lock.parent().unwrap_or(&place.lock).display()
                        );
                        holding.cancel();
                        return;
                    }
                }
            }
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::debug!("shared quota: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Only this user's processes may share (the directory is private; this checks anyway).
        if !same_user(&stream) {
            continue;
        }
        member += 1;
        let (throttle, peers) = (throttle.clone(), peers.clone());
        let let_go = LetGo { silent_after: Some(HOLDER_SILENT), stop: holding.clone() };
        tokio::spawn(async move {
            let (read, write) = tokio::io::split(stream);
            serve_peer(&throttle, BufReader::new(read).lines(), write, &peers, member, 1, let_go).await;
        });
    }
}

/// The device and inode of the file at `path`, if there is one.
fn file_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Whether the holder still holds the quota where processes meet.
enum Holding {
    /// Yes: its files are there (made again if they had gone).
    Yes,
    /// Another process holds the lock at the quota's path now.
    Another,
}

/// Makes the holder's lock file and socket again if they are no longer at `place` (removed with
/// the meeting directory, or on their own). `socket` is the socket file this holder bound.
fn keep_place(
    place: &Place,
    lock: &mut std::fs::File,
    listener: &mut UnixListener,
    socket: &mut Option<(u64, u64)>,
) -> Holding {
    let lock_kept = same_file(lock, &place.lock);
    if lock_kept && socket.is_some() && file_id(&place.socket) == *socket {
        return Holding::Yes;
    }
    let dir = place.lock.parent().unwrap_or(&place.lock);
    if let Err(why) = private_dir(dir) {
        tracing::debug!("cannot make the meeting directory again: {why}");
        return Holding::Yes;
    }
    let made = if lock_kept {
        // Only the socket went: bound again (this process still holds the lock).
        let _ = std::fs::remove_file(&place.socket);
        UnixListener::bind(&place.socket).map(|l| *listener = l)
    } else {
        match try_hold(place) {
            Ok(Some((l, li))) => {
                *lock = l;
                *listener = li;
                Ok(())
            }
            Ok(None) => return Holding::Another,
            Err(e) => Err(e),
        }
    };
    match made {
        Ok(()) => {
            *socket = file_id(&place.socket);
            remade(format_args!("the files where processes share the quota were removed from {}", dir.display()));
        }
        Err(e) => tracing::debug!("cannot make the shared quota's files again: {e}"),
    }
    Holding::Yes
}

/// Says that the meeting place was removed and made again: a warning the first time, then in
/// the debug log only (a directory deleted 30 times in 11 s gave 22 warnings, the same each).
fn remade(what: std::fmt::Arguments<'_>) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::debug!("{what}; made again");
    } else {
        tracing::warn!("{what}; made again (said once: later removals are in the debug log)");
    }
}

/// Notices this process resuming after it was stopped (Ctrl-Z, SIGSTOP) while it held the
/// quota: its clock jumped by more than the others wait before they decide alone, so they did,
/// and its budgets keep only their share until they hear what the others sent (see
/// [`weir_core::rate::Budget::resumed`]).
async fn watch_for_a_stop(throttle: Weak<Throttle>, holding: CancellationToken) {
    const TICK: Duration = Duration::from_millis(250);
    loop {
        let before = tokio::time::Instant::now();
        pause(TICK, &holding).await;
        if holding.is_cancelled() {
            return;
        }
        let Some(t) = throttle.upgrade() else { return };
        if before.elapsed() >= HOLDER_SILENT + TICK {
            let n = t.sharing().processes.max(2);
            tracing::debug!(stopped = ?before.elapsed(), "resumed after a stop; keeping a share of the quota until the others join again");
            t.rate_limiter().resumed(n);
        }
    }
}

fn same_user(stream: &UnixStream) -> bool {
    stream.peer_cred().map(|c| c.uid() == uid()).unwrap_or(false)
}

/// This process's user.
fn uid() -> u32 {
    // SAFETY: getuid cannot fail and touches no memory.
    unsafe { libc::getuid() }
}

/// Writes the lines sent to the returned channel to `write`, in order, until the channel
/// closes or the connection breaks.
fn writer(
    mut write: impl AsyncWrite + Send + Unpin + 'static,
) -> (mpsc::UnboundedSender<Vec<u8>>, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let task = tokio::spawn(async move {
        while let Some(l) = rx.recv().await {
            if write.write_all(&l).await.is_err() {
                break;
            }
        }
    });
    (tx, task)
}

/// A call of a served process: how to cancel it while it waits, and where its result goes once
/// it is admitted.
struct Served {
    cancel: CancellationToken,
    result: oneshot::Sender<(Reported, Duration)>,
}

/// When a holder lets a process it serves go, besides the process closing its connection.
pub(crate) struct LetGo {
    /// After this long without a line from it (none: never for silence).
    pub(crate) silent_after: Option<Duration>,
    /// When this is cancelled.
    pub(crate) stop: CancellationToken,
}

/// Admits one process's calls until it goes. Calls it leaves admitted and unreported stay
/// counted (they may have been sent), and free their slots as the throttle frees them.
/// `others`: the processes sharing the quota besides those served (1 when the holder calls the
/// endpoint too, 0 for a scheduler's).
pub(crate) async fn serve_peer(
    throttle: &Arc<Throttle>,
    mut lines: tokio::io::Lines<impl AsyncBufRead + Unpin>,
    write: impl AsyncWrite + Send + Unpin + 'static,
    peers: &Arc<AtomicUsize>,
    member: u64,
    others: usize,
    let_go: LetGo,
) {
    let LetGo { silent_after, stop } = let_go;
    let (tx, writer) = writer(write);
    let gone = CancellationToken::new();
    {
        let (tx, gone) = (tx.clone(), gone.clone());
        tokio::spawn(async move {
            while tx.send(line(&Answer::Alive)).is_ok() {
                tokio::select! {
                    () = gone.cancelled() => return,
                    () = tokio::time::sleep(HEARTBEAT) => {}
                }
            }
        });
    }
    let calls: Arc<Mutex<HashMap<u64, Served>>> = Arc::default();
    // Slots set aside for the process's calls that the last holder admitted.
    let mut carried = 0usize;
    // A process counts as sharing the quota from its first call (a connection that asks
    // nothing — a port check, a stranger — is no process sharing it).
    let mut counted = false;
    loop {
        // A process that says nothing for `silent_after` (stopped with Ctrl-Z, hung) is let go:
        // the calls it was granted and has not reported free their slots, instead of holding
        // every other process's calls until it resumes (then it finds the connection closed,
        // and joins again).
        let next = tokio::select! {
            next = async {
                match silent_after {
                    Some(d) => next_line_within(&mut lines, d).await,
                    None => Ok(lines.next_line().await.ok().flatten()),
                }
            } => next,
            // The holder gives way to another: the process finds that one.
            () = stop.cancelled() => Ok(None),
        };
        let l = match next {
            Ok(Some(l)) => l,
            Ok(None) => break,
            Err(()) => {
                tracing::debug!("shared quota: a process said nothing for {silent_after:?}; letting it go");
                break;
            }
        };
        let ask = match serde_json::from_str::<Ask>(&l) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("shared quota: a process sent what this one cannot read ({e}); dropping it");
                break;
            }
        };
        if !counted && matches!(ask, Ask::Admit { .. }) {
            counted = true;
            let n = peers.fetch_add(1, Relaxed) + 1;
            throttle.set_served(n + others);
        }
        match ask {
            Ask::Admit { id, tokens } => {
                let cancel = gone.child_token();
                let (result_tx, result_rx) = oneshot::channel();
                calls
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id, Served { cancel: cancel.clone(), result: result_tx });
                let (throttle, tx, peers) = (throttle.clone(), tx.clone(), peers.clone());
                tokio::spawn(async move {
                    let Some(admitted) = throttle.admit_for(member, Weight { tokens }, &cancel).await else { return };
                    let granted = Answer::Granted {
                        id,
                        waited_us: admitted.waited.as_micros() as u64,
                        concurrency: throttle.concurrency(),
                        rates: throttle.rates(),
                        processes: peers.load(Relaxed) + others,
                    };
                    if tx.send(line(&granted)).is_err() {
                        return;
                    }
                    // Dropped unreported (the process went, or abandoned it): kept counted.
                    if let Ok((reported, latency)) = result_rx.await {
                        reported.teach(admitted, latency);
                    }
                });
            }
            Ask::Finish { id, latency_us, result } => {
                let served = calls.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                if let Some(s) = served {
                    let _ = s.result.send((result, Duration::from_micros(latency_us)));
                }
            }
            Ask::Abandon { id } => {
                if let Some(s) = calls.lock().unwrap_or_else(|e| e.into_inner()).remove(&id) {
                    s.cancel.cancel();
                }
            }
            Ask::Carry { n } => carried += throttle.borrow_slots(n.min(100_000)),
            Ask::Landed => {
                if carried > 0 {
                    carried -= 1;
                    throttle.repay_slots(1);
                }
            }
            Ask::Alive => {}
            Ask::Sent { budgets } => throttle.rate_limiter().count_sends(&budgets),
        }
    }
    throttle.repay_slots(carried);
    if counted {
        // Counted for the summary, not for a part of a told limit: a serving that ends as the
        // store is lost must not make the count of those that shared it smaller, and a process
        // that left while it was lost has ended (its part unspent is no excess).
        let n = peers.fetch_sub(1, Relaxed) - 1;
        throttle.set_processes(n + others);
    }
    gone.cancel();
    calls.lock().unwrap_or_else(|e| e.into_inner()).clear();
    writer.abort();
}

/// This process's side of a shared quota: asks the holder to admit each call.
pub(crate) struct Peer {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    waiting: Mutex<HashMap<u64, oneshot::Sender<Grant>>>,
    next: AtomicU64,
    open: AtomicBool,
    /// The holder has said something since the connection opened.
    heard: AtomicBool,
    /// The connection was left because the holder said nothing for [`HOLDER_SILENT`].
    silent: AtomicBool,
    /// Notified when the holder is first heard, or the connection ends.
    first: tokio::sync::Notify,
    /// Cancelled when this process leaves the holder (see [`Peer::close`]).
    closed: CancellationToken,
}

impl Peer {
    /// Starts talking to the holder over `stream`; `ended` is notified when the connection ends:
    /// closed, or silent for [`HOLDER_SILENT`].
    pub(crate) fn start(link: impl Link, ended: Arc<tokio::sync::Notify>) -> Arc<Self> {
        let (read, write) = tokio::io::split(link);
        let (tx, _) = writer(write);
        let peer = Arc::new(Peer {
            tx,
            waiting: Mutex::default(),
            next: AtomicU64::new(0),
            open: AtomicBool::new(true),
            heard: AtomicBool::new(false),
            silent: AtomicBool::new(false),
            first: tokio::sync::Notify::new(),
            closed: CancellationToken::new(),
        });
        let beating = Arc::downgrade(&peer);
        tokio::spawn(async move {
            while let Some(p) = beating.upgrade().filter(|p| p.open.load(Relaxed)) {
                if p.tx.send(line(&Ask::Alive)).is_err() {
                    return;
                }
                drop(p);
                tokio::time::sleep(HEARTBEAT).await;
            }
        });
        let reader = peer.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(read).lines();
            loop {
                let next = tokio::select! {
                    next = next_line_within(&mut lines, HOLDER_SILENT) => next,
                    () = reader.closed.cancelled() => break,
                };
                let l = match next {
                    Ok(Some(l)) => l,
                    Ok(None) => break,
                    Err(()) => {
                        reader.silent.store(true, Relaxed);
                        break;
                    }
                };
                if !reader.heard.swap(true, Relaxed) {
                    reader.first.notify_waiters();
                }
                let (id, waited_us, concurrency, rates, processes) = match serde_json::from_str::<Answer>(&l) {
                    Ok(Answer::Granted { id, waited_us, concurrency, rates, processes }) => {
                        (id, waited_us, concurrency, rates, processes)
                    }
                    Ok(Answer::Alive) => continue,
                    Err(_) => {
                        tracing::warn!("shared quota: the holder sent what this process cannot read; deciding alone");
                        break;
                    }
                };
                let grant = Grant { id, waited: Duration::from_micros(waited_us), concurrency, rates, processes };
                let waiter = reader.waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                if let Some(Err(_)) = waiter.map(|w| w.send(grant)) {
                    // Nobody waits for it any more (cancelled as it was granted).
                    let _ = reader.tx.send(line(&Ask::Abandon { id }));
                }
            }
            // The holder went: calls still waiting decide alone (their senders are dropped).
            reader.open.store(false, Relaxed);
            reader.waiting.lock().unwrap_or_else(|e| e.into_inner()).clear();
            reader.first.notify_waiters();
            ended.notify_one();
        });
        peer
    }

    /// Whether the holder says anything within [`HOLDER_SILENT`] of connecting (it says it is
    /// alive at once): a stopped holder's socket still takes connections (the system queues
    /// them), and following it would hold every call.
    pub(crate) async fn answers(&self) -> Answered {
        let first = self.first.notified();
        if !self.heard.load(Relaxed) && self.open.load(Relaxed) {
            let _ = tokio::time::timeout(HOLDER_SILENT, first).await;
        }
        if self.heard.load(Relaxed) {
            Answered::Yes
        } else if self.open.load(Relaxed) || self.silent.load(Relaxed) {
            Answered::Silent
        } else {
            Answered::Closed
        }
    }

    /// Tells the holder what this process sent while it decided alone (see [`Ask::Sent`]).
    pub(crate) fn tell_sent(&self, budgets: (weir_core::rate::Seed, weir_core::rate::Seed)) {
        let _ = self.tx.send(line(&Ask::Sent { budgets: Box::new(budgets) }));
    }

    /// Leaves the holder: its calls still waiting decide elsewhere, and the holder, hearing
    /// nothing more, lets this process go.
    pub(crate) fn close(&self) {
        self.closed.cancel();
    }

    /// Whether the connection was left because the holder went silent.
    pub(crate) fn went_silent(&self) -> bool {
        self.silent.load(Relaxed)
    }
}

/// How a holder met a new connection (see [`Peer::answers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answered {
    /// It said it is alive.
    Yes,
    /// It said nothing for [`HOLDER_SILENT`]: stopped or hung, with its lock held.
    Silent,
    /// The connection closed before it said anything: it was ending (a killed holder's socket
    /// can take a connection while its process is torn down).
    Closed,
}

/// Abandons a call whose admission is no longer awaited (the caller was cancelled).
struct Awaiting {
    id: u64,
    tx: mpsc::UnboundedSender<Vec<u8>>,
    done: bool,
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(line(&Ask::Abandon { id: self.id }));
        }
    }
}

impl Delegate for Peer {
    fn admit(&self, weight: Weight) -> BoxFuture<'static, Option<Grant>> {
        if !self.open.load(Relaxed) {
            return Box::pin(async { None });
        }
        let id = self.next.fetch_add(1, Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).insert(id, tx);
        if self.tx.send(line(&Ask::Admit { id, tokens: weight.tokens })).is_err() {
            self.waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            return Box::pin(async { None });
        }
        let awaiting = Awaiting { id, tx: self.tx.clone(), done: false };
        Box::pin(async move {
            // The whole guard moves in (not just its field), so it is dropped with the future.
            let mut awaiting = awaiting;
            let grant = rx.await.ok();
            awaiting.done = true;
            grant
        })
    }

    fn finish(&self, grant: u64, result: Result<(Usage, Option<LimitInfo>), &ModelError>, latency: Duration) {
        let ask = Ask::Finish { id: grant, latency_us: latency.as_micros() as u64, result: Reported::of(result) };
        let _ = self.tx.send(line(&ask));
    }

    fn abandon(&self, grant: u64) {
        let _ = self.tx.send(line(&Ask::Abandon { id: grant }));
    }

    fn is_open(&self) -> bool {
        self.open.load(Relaxed)
    }

    fn carry(&self, n: usize) {
        let _ = self.tx.send(line(&Ask::Carry { n }));
    }

    fn landed(&self) {
        let _ = self.tx.send(line(&Ask::Landed));
    }
}

/// How an executor reaches the throttles its cluster's scheduler keeps: a connection made with
/// the cluster's credentials (weir-datafusion's, installed with [`use_hub`]).
pub trait Hub: Send + Sync {
    /// A new connection to the scheduler's quota service, already past its guard.
    fn connect(&self) -> BoxFuture<'static, std::io::Result<Box<dyn Link>>>;
    /// Where it is, for messages.
    fn describe(&self) -> String;
}

static HUB: OnceLock<Arc<dyn Hub>> = OnceLock::new();

/// Makes this process's endpoints with [`weir_core::QuotaStore::Cluster`] share their quota
/// through `hub` (set once, when an executor starts; a process belongs to one cluster).
pub fn use_hub(hub: Arc<dyn Hub>) {
    let _ = HUB.set(hub);
}

/// The limits a process was told, as it tells the scheduler with its first line, so that the
/// throttle kept there is made as the process would have made its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Told {
    max_concurrency: usize,
    adaptive: bool,
    requests: Option<u64>,
    tokens: Option<u64>,
    window_ms: u64,
    learn: bool,
    sre_k: Option<f64>,
}

impl Told {
    fn of(s: &ThrottleSettings) -> Self {
        Told {
            max_concurrency: s.max_concurrency,
            adaptive: s.adaptive,
            requests: s.rate.requests,
            tokens: s.rate.tokens,
            window_ms: s.rate.window.as_millis() as u64,
            learn: s.rate.learn,
            sre_k: s.sre_k,
        }
    }

    /// The settings, if they are ones a process could have been given (an executor's flags are
    /// checked where it starts; this keeps a bad line from making a throttle that cannot work).
    fn settings(&self) -> Option<ThrottleSettings> {
        const WEEK_MS: u64 = 7 * 86_400_000;
        let ok = (1..=1_000_000).contains(&self.max_concurrency)
            && (1..=WEEK_MS).contains(&self.window_ms)
            && self.requests != Some(0)
            && self.tokens != Some(0)
            && self.sre_k.is_none_or(|k| k.is_finite() && k >= 1.0);
        ok.then(|| ThrottleSettings {
            max_concurrency: self.max_concurrency,
            adaptive: self.adaptive,
            rate: RateSettings {
                requests: self.requests,
                tokens: self.tokens,
                window: Duration::from_millis(self.window_ms),
                learn: self.learn,
            },
            sre_k: self.sre_k,
            // The scheduler's throttle is the one every executor goes through (it joins
            // nothing itself: only the runtime's throttles do).
            store: weir_core::QuotaStore::Cluster,
        })
    }
}

/// An executor's first line to its scheduler's quota service: which quota, and its limits.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Hello {
    quota: String,
    told: Told,
}

/// Shares `throttle`'s quota under `name` with every executor of the cluster, through the
/// throttle the scheduler keeps for it; without a hub (not an executor), with this machine's
/// processes instead.
pub fn follow_hub(throttle: &Arc<Throttle>, name: String, settings: &ThrottleSettings) {
    let Some(hub) = HUB.get().cloned() else { return join(throttle, name) };
    if tokio::runtime::Handle::try_current().is_err() {
        return;
    }
    let hello = line(&Hello { quota: name, told: Told::of(settings) });
    throttle.await_delegate();
    tokio::spawn(follow(Arc::downgrade(throttle), hub, hello));
}

/// Follows the scheduler's throttle for as long as it can be reached; decides alone while it
/// cannot, and tries again every second.
async fn follow(throttle: Weak<Throttle>, hub: Arc<dyn Hub>, hello: Vec<u8>) {
    let mut said = false;
    loop {
        let connected = hub.connect().await;
        let Some(t) = throttle.upgrade() else { return };
        let link = match connected {
            Ok(mut link) => match link.write_all(&hello).await {
                Ok(()) => Ok(link),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match link {
            Ok(link) => {
                let ended = Arc::new(tokio::sync::Notify::new());
                let peer = Peer::start(link, ended.clone());
                let notified = ended.notified();
                drop(t);
                let answered = peer.answers().await;
                let Some(t) = throttle.upgrade() else { return };
                if answered != Answered::Yes {
                    t.set_sole(false);
                    t.delegate_to(None);
                    if !said {
                        tracing::warn!(
                            "the scheduler's quota service at {} {}; this executor keeps the quota alone until it \
                             answers",
                            hub.describe(),
                            if answered == Answered::Closed { "closed the connection" } else { "does not answer" }
                        );
                        said = true;
                    }
                    drop(t);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                t.set_sole(true);
                t.delegate_to(Some(peer.clone()));
                tracing::debug!("sharing the quota kept by the scheduler at {}", hub.describe());
                if said {
                    tracing::warn!(
                        "reached the scheduler's quota service at {} again; sharing the quota",
                        hub.describe()
                    );
                    said = false;
                }
                drop(t);
                notified.await;
                // Its calls decide alone until it is reached again (or for at most 2 s; at once
                // when it went silent).
                if let Some(t) = throttle.upgrade() {
                    if peer.went_silent() {
                        t.set_sole(false);
                        t.delegate_to(None);
                        tracing::warn!(
                            "the scheduler's quota service at {} has not answered for {} s; this executor keeps the \
                             quota alone until it does",
                            hub.describe(),
                            HOLDER_SILENT.as_secs()
                        );
                        said = true;
                    } else {
                        t.await_delegate();
                    }
                }
            }
            Err(e) => {
                t.set_sole(false);
                t.delegate_to(None);
                if !said {
                    tracing::warn!(
                        "cannot reach the scheduler's quota service at {} ({e}); this executor keeps the quota alone \
                         until it can",
                        hub.describe()
                    );
                    said = true;
                }
                drop(t);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The throttles a cluster's scheduler keeps for its executors, one per quota (endpoint and
/// key), each learned from every executor's calls and admitting them together as one client's.
/// The scheduler makes no calls itself.
#[derive(Default)]
pub struct Keeper {
    quotas: Mutex<HashMap<String, Kept>>,
}

/// One quota a [`Keeper`] keeps.
struct Kept {
    throttle: Arc<Throttle>,
    peers: Arc<AtomicUsize>,
    members: u64,
    told: Told,
    /// Executors connected to it now, whether or not they have called yet.
    linked: usize,
}

/// How long the scheduler keeps a quota's throttle after its last executor left: an executor
/// that reconnects, or the next query's, finds what was learned; a run started much later
/// learns afresh.
const KEEP_AFTER_LAST: Duration = Duration::from_secs(60);

impl Keeper {
    /// A keeper with no quotas yet.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Serves one executor's connection (already past the cluster's guard) until it ends;
    /// `first` is its first line, which the service read to tell a quota's hello from another
    /// service's (and which it had to send within the time the service allows).
    pub async fn serve(self: &Arc<Self>, first: &str, link: impl Link) {
        let Ok(hello) = serde_json::from_str::<Hello>(first) else {
            // Said at most every 10 s: a stranger's flood of connections must not flood the log.
            static LAST: Mutex<Option<std::time::Instant>> = Mutex::new(None);
            let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                *last = Some(std::time::Instant::now());
                tracing::warn!(
                    "quota service: a connection did not say which quota it shares; closed it (said once in 10 s)"
                );
            }
            return;
        };
        let valid_name = hello.quota.len() == 24 && hello.quota.bytes().all(|b| b.is_ascii_hexdigit());
        let (Some(settings), true) = (hello.told.settings(), valid_name) else {
            tracing::warn!("quota service: a connection named a quota or limits no executor could have; closed it");
            return;
        };
        let (throttle, peers, member) = {
            let mut all = self.quotas.lock().unwrap_or_else(|e| e.into_inner());
            let kept = all.entry(hello.quota.clone()).or_insert_with(|| Kept {
                throttle: Arc::new(Throttle::new(&settings)),
                peers: Arc::default(),
                members: 0,
                told: hello.told.clone(),
                linked: 0,
            });
            if kept.told != hello.told && kept.linked == 0 {
                // Every executor told the first limits has left (the throttle is kept a while
                // for the next query's): the limits this one was told are the quota's now. A
                // tester's executors started again with `--rpm 100` ran at the 40 of the ones
                // before them, and others told 40 burst at what the ones before had learned.
                tracing::info!("quota service: an executor was told other limits for a quota no executor uses now; they replace the earlier ones");
                *kept = Kept {
                    throttle: Arc::new(Throttle::new(&settings)),
                    peers: Arc::default(),
                    members: 0,
                    told: hello.told.clone(),
                    linked: 0,
                };
            } else if kept.told != hello.told {
                tracing::warn!(
                    "quota service: an executor was told other limits for a quota than the first one; the first ones \
                     stay in force for every executor (one throttle per quota)"
                );
            }
            kept.members += 1;
            kept.linked += 1;
            (kept.throttle.clone(), kept.peers.clone(), kept.members)
        };
        let (read, write) = tokio::io::split(link);
        let let_go = LetGo { silent_after: Some(HOLDER_SILENT), stop: CancellationToken::new() };
        serve_peer(&throttle, BufReader::new(read).lines(), write, &peers, member, 0, let_go).await;
        if let Some(k) = self.quotas.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&hello.quota) {
            // (Not a throttle made anew since this executor came: that one counts its own.)
            if Arc::ptr_eq(&k.throttle, &throttle) {
                k.linked = k.linked.saturating_sub(1);
            }
        }
        if peers.load(Relaxed) == 0 {
            let me = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(KEEP_AFTER_LAST).await;
                let mut all = me.quotas.lock().unwrap_or_else(|e| e.into_inner());
                if all.get(&hello.quota).is_some_and(|k| k.peers.load(Relaxed) == 0) {
                    all.remove(&hello.quota);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_core::QuotaStore;

    /// A quota held in `meet` (made): its place, lock, listener and socket file.
    fn held_in(meet: &std::path::Path) -> (Place, std::fs::File, UnixListener, Option<(u64, u64)>) {
        private_dir(meet).unwrap();
        let place = Place { lock: meet.join("q.lock"), socket: meet.join("q.sock"), state: meet.join("q.state") };
        let (lock, listener) = try_hold(&place).unwrap().unwrap();
        let socket = file_id(&place.socket);
        (place, lock, listener, socket)
    }

    #[tokio::test]
    async fn a_holder_whose_files_were_removed_makes_them_again() {
        let dir = tempfile::tempdir().unwrap();
        let meet = dir.path().join("meet");
        let (place, mut lock, mut listener, mut socket) = held_in(&meet);
        assert!(matches!(keep_place(&place, &mut lock, &mut listener, &mut socket), Holding::Yes));
        std::fs::remove_dir_all(&meet).unwrap();
        assert!(matches!(keep_place(&place, &mut lock, &mut listener, &mut socket), Holding::Yes));
        // The lock at the path is this holder's (no one else can take it), and its socket answers.
        assert!(try_hold(&place).unwrap().is_none());
        assert!(same_file(&lock, &place.lock));
        UnixStream::connect(&place.socket).await.unwrap();
        // Only the socket removed: bound again.
        std::fs::remove_file(&place.socket).unwrap();
        assert!(matches!(keep_place(&place, &mut lock, &mut listener, &mut socket), Holding::Yes));
        UnixStream::connect(&place.socket).await.unwrap();
    }

    #[tokio::test]
    async fn a_holder_gives_way_to_one_that_took_the_quota_while_its_files_were_gone() {
        let dir = tempfile::tempdir().unwrap();
        let meet = dir.path().join("meet");
        let (place, mut lock, mut listener, mut socket) = held_in(&meet);
        std::fs::remove_dir_all(&meet).unwrap();
        // A process started in between made the directory and holds the new lock.
        private_dir(&meet).unwrap();
        let (_their_lock, _their_listener) = try_hold(&place).unwrap().unwrap();
        assert!(matches!(keep_place(&place, &mut lock, &mut listener, &mut socket), Holding::Another));
    }

    fn told(requests: u64) -> Arc<Throttle> {
        Arc::new(Throttle::new(&ThrottleSettings {
            rate: RateSettings { requests: Some(requests), window: Duration::from_secs(60), ..RateSettings::default() },
            adaptive: false,
            store: QuotaStore::Off,
            ..ThrottleSettings::default()
        }))
    }

    /// The scheduler keeps a quota's throttle a minute after its last executor left. A
    /// tester's executors started again with `--rpm 100` within it ran at the 40 of the ones
    /// before: limits told anew, while no executor is connected, replace the kept ones; while
    /// one is, the first ones stay.
    #[tokio::test]
    async fn limits_told_anew_once_every_executor_left_replace_the_kept_ones() {
        let keeper = Keeper::new();
        let told = |rpm: u64| {
            Told::of(&ThrottleSettings {
                rate: RateSettings { requests: Some(rpm), window: Duration::from_secs(5), ..RateSettings::default() },
                ..ThrottleSettings::default()
            })
        };
        let quota = "0123456789abcdef01234567".to_string();
        let hello = |rpm| serde_json::to_string(&Hello { quota: quota.clone(), told: told(rpm) }).unwrap();
        let kept = |k: &Keeper| k.quotas.lock().unwrap()[&quota].told.requests;
        // An executor told 40 connects and stays; one told 100 beside it gets the 40.
        let (first, far) = tokio::io::duplex(4096);
        let k = keeper.clone();
        let h = hello(40);
        let serving = tokio::spawn(async move { k.serve(&h, far).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (second, far) = tokio::io::duplex(4096);
        drop(second);
        keeper.serve(&hello(100), far).await;
        assert_eq!(kept(&keeper), Some(40), "the first executor is still connected");
        // It leaves; the next one told 100 sets the quota's limits.
        drop(first);
        serving.await.unwrap();
        let (third, far) = tokio::io::duplex(4096);
        drop(third);
        keeper.serve(&hello(100), far).await;
        assert_eq!(kept(&keeper), Some(100));
    }

    #[test]
    fn a_sweep_removes_the_files_of_quotas_unused_for_a_week_and_no_others() {
        let dir = std::env::temp_dir().join(format!("weir-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["old", "held", "recent"] {
            for ext in ["lock", "state"] {
                std::fs::write(dir.join(format!("{name}.{ext}")), b"").unwrap();
            }
        }
        // A lock held by a live process is kept, however old.
        let held = std::fs::OpenOptions::new().write(true).open(dir.join("held.lock")).unwrap();
        held.lock().unwrap();
        let now = std::time::SystemTime::now();
        let week_on = now + STALE + Duration::from_secs(60);
        // A week on, "recent" was used since (its state written a minute ago).
        let recent = std::fs::File::options().write(true).open(dir.join("recent.state")).unwrap();
        recent.set_modified(week_on - Duration::from_secs(60)).unwrap();
        assert_eq!(sweep(&dir, now), 0, "nothing is a week old yet");
        assert_eq!(sweep(&dir, week_on), 1);
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, ["held.lock", "held.state", "recent.lock", "recent.state"]);
        // A lock whose file was removed after it was opened is not a hold.
        let place = Place { lock: dir.join("gone.lock"), socket: dir.join("gone.sock"), state: dir.join("gone.state") };
        let opened = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&place.lock).unwrap();
        std::fs::remove_file(&place.lock).unwrap();
        std::fs::write(&place.lock, b"").unwrap();
        assert!(!same_file(&opened, &place.lock));
        drop((held, opened));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_run_that_ends_writes_down_its_last_sends_for_the_next_holder() {
        // A holder admits four calls of its ten a minute and its run ends before the periodic
        // write saw them: the process taking over must count them, and admit six, not ten.
        let dir = std::env::temp_dir().join(format!("weir-leave-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("q.state");
        let holder = told(10);
        held().lock().unwrap().push((Arc::downgrade(&holder), state.clone()));
        let never = CancellationToken::new();
        for _ in 0..4 {
            holder.admit(Weight::default(), &never).await.unwrap().finish(Ok(Default::default()));
        }
        assert!(!state.exists());
        leave_all();
        let next = told(10);
        next.await_delegate();
        take_over(&next, &Place { lock: dir.join("q.lock"), socket: dir.join("q.sock"), state: state.clone() });
        next.delegate_to(None);
        let mut admitted = 0;
        while tokio::time::timeout(Duration::from_millis(50), next.admit(Weight::default(), &never)).await.is_ok() {
            admitted += 1;
        }
        assert_eq!(admitted, 6);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_process_going_alone_beside_a_silent_holder_takes_its_share_once_per_silence() {
        // The holder wrote down 16 calls out at most; two processes shared the quota. Going
        // alone, this one starts from half of that; what it learns alone afterwards (here: 3)
        // is not set back to the share when the supervisor finds the holder still silent.
        let dir = std::env::temp_dir().join(format!("weir-silent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let place = Place { lock: dir.join("q.lock"), socket: dir.join("q.sock"), state: dir.join("q.state") };
        let learning = || {
            Arc::new(Throttle::new(&ThrottleSettings {
                adaptive: true,
                store: QuotaStore::Off,
                ..ThrottleSettings::default()
            }))
        };
        let holder = learning();
        holder.seed_concurrency(16, Some(64));
        write_state(&holder, &place.state);
        let alone = learning();
        let mut said = false;
        alone_beside_a_silent_holder(&alone, &place, &mut said);
        assert_eq!(alone.concurrency(), 8);
        alone.seed_concurrency(3, Some(32));
        alone_beside_a_silent_holder(&alone, &place, &mut said);
        assert_eq!(alone.concurrency(), 3, "still silent: the share is not taken again");
        // The holder answered in between (the supervisor clears `said`): a new silence starts
        // from the share again.
        said = false;
        alone_beside_a_silent_holder(&alone, &place, &mut said);
        assert_eq!(alone.concurrency(), 8);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
