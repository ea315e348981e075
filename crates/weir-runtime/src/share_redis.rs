//! `--quota-store redis://HOST:PORT` (or `rediss://` with TLS): processes on machines that share
//! nothing else — a Beam pipeline's workers, `weir run`s on several hosts — share one quota
//! through a Redis server the user already runs.
//!
//! It is the same sharing as on one machine ([`crate::share`]): one of the processes holds the
//! quota's throttle and the others ask it to admit each call and report each result. Redis
//! only elects the holder and carries the lines:
//! - the holder is whoever set `weir:quota:<name>:holder` (`SET NX` with a 3-second lease it
//!   renews every second): a holder that dies is replaced within the lease;
//! - a process asks by pushing `{"from": its id, "line": …}` to `…:in:<holder>`, and reads the
//!   holder's answers from `…:out:<its id>`; it says it is alive every second, and the holder
//!   drops (and frees the calls of) a process it has not heard from for 5 s;
//! - the holder writes down what its budgets know under `…:state`, with an expiry of its window
//!   plus 2 s, so that the next holder goes on from there rather than relearning the quota.
//!
//! Every list expires on its own (10 s after the last push), so nothing outlives the processes.
//! The quota's name is a digest of model, endpoint and key: neither the key nor the endpoint is
//! written to Redis.

use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use weir_core::Throttle;

use crate::share::{serve_peer, Handed, LetGo, Peer, STATE_GRACE};

/// How long a holder's lease lasts without renewal.
const LEASE: Duration = Duration::from_secs(3);
/// How often the holder renews its lease.
const RENEW_EVERY: Duration = Duration::from_secs(1);
/// How often a process says it is alive, and checks that its holder still holds the quota.
const BEAT_EVERY: Duration = Duration::from_millis(500);
/// Silence after which the holder drops a process.
const SILENT_FOR: Duration = Duration::from_secs(5);
/// Lists expire this long after their last push.
const LIST_TTL_MS: i64 = 10_000;
/// How long a process goes without any answer from its holder (which echoes every "alive")
/// before it leaves it for another.
const UNANSWERED_FOR: Duration = Duration::from_secs(5);
/// How recently a holder whose lease is gone must have answered for its followers to wait for
/// it to take the lease again (it renews every [`RENEW_EVERY`]) rather than take it themselves.
const STILL_THERE: Duration = Duration::from_millis(1500);
/// The holder's answer to a process's "alive": not a line of the protocol.
const ECHO: &str = "alive";
/// How often, at most, the holder writes down its budgets.
const STATE_EVERY: Duration = Duration::from_millis(250);
/// How long a command may go unanswered before Redis is taken as unreachable. A server that
/// hangs (stopped, or a network that drops its packets rather than refusing them) answers no
/// error: with the 5-s time-outs this replaced, the processes found it after 10 s, while their
/// calls waited on a holder that could not hear them and then went alone, in a burst over the
/// told limit. Redis answers in a millisecond or so; 2 s is a hang, not a busy server.
const HUNG_AFTER: Duration = Duration::from_secs(2);

/// A message on a holder's list.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Note {
    /// The sending process's id for this holder.
    from: String,
    /// A line of the protocol; none: it is alive.
    line: Option<String>,
    /// The process is leaving: it is counted no more (rather than for [`SILENT_FOR`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    bye: bool,
}

/// What a process that holds or follows a quota through Redis does when its run ends cleanly,
/// so that the next run started at once neither waits out a lease nobody renews (up to
/// [`LEASE`]) nor counts a process that has gone (for [`SILENT_FOR`]).
enum Leaving {
    /// Give up the lease, if it is still this process's.
    Holder {
        conn: redis::aio::MultiplexedConnection,
        holder_key: String,
        me: String,
        state_key: String,
        throttle: Weak<Throttle>,
    },
    /// Tell the holder this process has gone.
    Follower { conn: redis::aio::MultiplexedConnection, inbox: String, me: String },
}

/// The quotas this process holds or follows through Redis now, by a number of their own.
fn leaving() -> &'static std::sync::Mutex<HashMap<u64, Leaving>> {
    static LEAVING: std::sync::OnceLock<std::sync::Mutex<HashMap<u64, Leaving>>> = std::sync::OnceLock::new();
    LEAVING.get_or_init(Default::default)
}

/// Set once this process has left its quotas: it takes no lease again.
static LEFT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// An entry of [`leaving`], removed when the holding or following it stands for ends.
struct Registered(u64);

impl Registered {
    fn new(l: Leaving) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        leaving().lock().unwrap_or_else(|e| e.into_inner()).insert(n, l);
        Registered(n)
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        leaving().lock().unwrap_or_else(|e| e.into_inner()).remove(&self.0);
    }
}

/// The script that gives up a lease (`KEYS[1]`) if it is still `ARGV[1]`'s.
fn release() -> redis::Script {
    redis::Script::new(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end",
    )
}

/// Leaves every quota this process shares through Redis: gives up the leases it holds and says
/// goodbye to the holders it follows. Called when a run ends; a second of Redis at most.
pub async fn leave_all() {
    LEFT.store(true, std::sync::atomic::Ordering::SeqCst);
    let all: Vec<Leaving> = leaving().lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, l)| l).collect();
    let release = release();
    let each = all.into_iter().map(|l| {
        let release = &release;
        async move {
            match l {
                Leaving::Holder { mut conn, holder_key, me, state_key, throttle } => {
                    // What the budgets know as of now (the last write may be 250 ms old), so
                    // that the next holder, taking over at once, counts every send of ours.
                    if let Some(t) = throttle.upgrade() {
                        write_state(&t, &mut conn, &state_key).await;
                    }
                    let _: redis::RedisResult<i64> = release.key(&holder_key).arg(&me).invoke_async(&mut conn).await;
                }
                Leaving::Follower { mut conn, inbox, me } => {
                    let note =
                        serde_json::to_string(&Note { from: me, line: None, bye: true }).expect("a note serialises");
                    let _ = push(&mut conn, &inbox, &note).await;
                }
            }
        }
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), futures::future::join_all(each)).await;
}

/// What the holder writes down, and how long it was to live (its age is that less what is left).
#[derive(Debug, Serialize, Deserialize)]
struct Written {
    ttl_ms: u64,
    handed: Handed,
}

/// The host and port of `url`, for messages (never its password).
pub fn describe(url: &str) -> String {
    match redis::Client::open(url) {
        Ok(c) => match c.get_connection_info().addr() {
            redis::ConnectionAddr::Tcp(h, p) => format!("redis://{}:{p}", bracketed(h)),
            redis::ConnectionAddr::TcpTls { host, port, .. } => format!("rediss://{}:{port}", bracketed(host)),
            other => other.to_string(),
        },
        Err(_) => "the Redis server".into(),
    }
}

/// A host as a URL writes it: an IPv6 address in brackets.
fn bracketed(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// Checks a `--quota-store` Redis URL: one the client takes, and TLS (`rediss://`) unless the
/// server is on this machine (127.0.0.1, ::1 or localhost).
pub fn check_url(url: &str) -> Result<(), String> {
    let client = redis::Client::open(url).map_err(|e| {
        format!("--quota-store: not a Redis URL ({:?}); say redis://HOST:PORT or rediss://HOST:PORT", e.kind())
    })?;
    match client.get_connection_info().addr() {
        redis::ConnectionAddr::Tcp(host, _) => {
            let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                return Err(format!(
                    "--quota-store {}: a Redis server on another machine is reached with TLS: say rediss://",
                    describe(url)
                ));
            }
            Ok(())
        }
        redis::ConnectionAddr::TcpTls { .. } => Ok(()),
        _ => Err("--quota-store: say redis://HOST:PORT or rediss://HOST:PORT".into()),
    }
}

/// Connects once to a `--quota-store` Redis server before any call, so that settings that
/// cannot work are said at once, as a usage error, rather than as a warning in a run that then
/// keeps its quota alone: a password refused or missing, a database number the server does not
/// have, TLS (`rediss://`) to a server that speaks none. A server that cannot be reached now
/// (down, or not started yet) is no usage error: the run keeps the quota alone until it can.
pub async fn check_server(url: &str) -> Result<(), String> {
    let Ok(client) = redis::Client::open(url) else { return Ok(()) };
    let tls = matches!(client.get_connection_info().addr(), redis::ConnectionAddr::TcpTls { .. });
    let attempt = async {
        let mut conn = connect(&client).await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    let e = match tokio::time::timeout(Duration::from_secs(3), attempt).await {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(e)) if !(tls && e.is_timeout()) => e,
        // Nothing came back (within the connection's own wait, or this one): TLS spoken to a
        // plain server waits for an answer that never comes.
        _ if tls => {
            return Err(format!(
                "--quota-store {}: no TLS answer in {} s; if the server speaks plain Redis (only on this machine), \
                 say redis://",
                describe(url),
                HUNG_AFTER.as_secs()
            ))
        }
        _ => return Ok(()),
    };
    let text = e.to_string();
    let usage = match (e.kind(), e.code()) {
        (redis::ErrorKind::AuthenticationFailed, _) | (_, Some("NOAUTH" | "WRONGPASS")) => Some(
            "the server refused the password (or wants one): put it in the URL, rediss://:PASSWORD@HOST:PORT"
                .to_string(),
        ),
        _ if text.contains("DB index") => Some("the server has no database of that number".to_string()),
        _ if tls && (text.contains("corrupt message") || text.contains("InvalidContentType")) => {
            Some("the server does not speak TLS; if it is on this machine, say redis://".to_string())
        }
        // Something answered (after the TLS case, whose hint says more), but not a Redis server (a web
        // server on that port, say): that port cannot work, whenever the run tries it.
        (redis::ErrorKind::Parse, _) => {
            Some("the server there answered, but not in Redis's protocol: is that a Redis server's port?".to_string())
        }
        _ => None,
    };
    match usage {
        Some(why) => Err(format!("--quota-store {}: {why}", describe(url))),
        None => Ok(()),
    }
}

/// Shares `throttle`'s quota under `name` with every process that names the same Redis server
/// and calls the same endpoint with the same key.
pub fn join(throttle: &Arc<Throttle>, name: String, url: &str) {
    if tokio::runtime::Handle::try_current().is_err() {
        return;
    }
    let client = match redis::Client::open(url) {
        Ok(c) => c,
        Err(e) => {
            let why = format!("{} ({:?})", describe(url), e.kind());
            tracing::warn!("the quota is not shared: {why}");
            throttle.set_unshared(why);
            return;
        }
    };
    throttle.await_delegate();
    tokio::spawn(supervise(Arc::downgrade(throttle), client, name, describe(url)));
}

/// A follower's id for one holder: this process's id, a dash, and a number of its own. A
/// holder that hears from a new session of a process it serves lets the old one go at once:
/// with Redis stopped 2.3 s in every 3.3 s, each process came back as a new follower while the
/// holder still counted the old one (for 5 s), and three processes were counted as seven.
fn follower_id() -> String {
    static PROCESS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    static SESSION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SESSION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{}-{n}", PROCESS.get_or_init(random_id))
}

/// The process part of a [`follower_id`] (all of an id without a dash, as older versions wrote).
fn process_of(id: &str) -> &str {
    id.split_once('-').map_or(id, |(p, _)| p)
}

fn random_id() -> String {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        // Unique enough without the generator: the time and the process.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        b = (t.as_nanos() as u64 ^ u64::from(std::process::id()) << 32).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A connection whose commands are answered within [`HUNG_AFTER`], or fail.
async fn connect(client: &redis::Client) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    connect_for(client, Duration::ZERO).await
}

/// A connection for pops that block up to `blocking`: answered within that and [`HUNG_AFTER`].
async fn connect_for(
    client: &redis::Client,
    blocking: Duration,
) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(HUNG_AFTER))
        .set_response_timeout(Some(blocking + HUNG_AFTER));
    client.get_multiplexed_async_connection_with_config(&config).await
}

/// Why holding or following a quota through Redis ended.
enum Ended {
    /// The lease changed hands, or the holder went quiet: look for the holder again.
    Lease,
    /// Redis failed or did not answer: share through this machine at once, rather than try a
    /// server that has just failed (a hung one would take [`HUNG_AFTER`] more to fail again).
    Unreachable(redis::RedisError),
}

/// The error for an attempt that Redis left unanswered.
fn hung() -> redis::RedisError {
    std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer in {} s", HUNG_AFTER.as_secs())).into()
}

/// Holds the quota when nobody does, else follows the holder; again whenever that changes. While
/// Redis cannot be reached, this process shares the quota with the processes on this machine
/// that named the same store (see [`crate::share::fall_back`]), else decides alone.
async fn supervise(throttle: Weak<Throttle>, client: redis::Client, name: String, place: String) {
    let key = format!("weir:quota:{name}");
    // What kind of failure was last said (a Redis back with a password the runs do not know
    // is said again: no longer down, but refusing them).
    let mut said: Option<redis::ErrorKind> = None;
    // Sharing through this machine while Redis cannot be reached.
    let mut fallback: Option<crate::share::Fallback> = None;
    // This process held the quota through Redis last.
    let mut held = false;
    // Redis failed just now, while this process held or followed the quota through it.
    let mut failed: Option<redis::RedisError> = None;
    // The lease this process held when Redis hung: the renewal it had sent then may run when
    // Redis wakes, and take the lease again for a holding that has ended (the others would
    // follow a holder that reads nothing). Given up when seen.
    let mut stale: Option<String> = None;
    // Gives the whole told limit back a window after Redis is reached again, unless it fails
    // again first (dropped then).
    let mut _regained: Option<tokio_util::sync::DropGuard> = None;
    loop {
        if LEFT.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let stale_now = stale.clone();
        let attempt = async {
            let mut conn = connect(&client).await?;
            let me = random_id();
            let took: bool = redis::cmd("SET")
                .arg(format!("{key}:holder"))
                .arg(&me)
                .arg("NX")
                .arg("PX")
                .arg(LEASE.as_millis() as u64)
                .query_async::<Option<String>>(&mut conn)
                .await?
                .is_some();
            if took {
                return Ok::<_, redis::RedisError>(Some((conn, me, true)));
            }
            let holder: Option<String> = conn.get(format!("{key}:holder")).await?;
            if let Some(old) = holder.as_ref().filter(|h| stale_now.as_ref() == Some(*h)) {
                let _: i64 = release().key(format!("{key}:holder")).arg(old).invoke_async(&mut conn).await?;
                return Ok(None);
            }
            Ok(holder.map(|h| (conn, h, false)))
        };
        let result = match failed.take() {
            Some(e) => Err(e),
            None => tokio::time::timeout(HUNG_AFTER, attempt).await.unwrap_or_else(|_| Err(hung())),
        };
        // What the process holding the quota on this machine meanwhile last wrote down (`Err`:
        // this process held it).
        let mut local = Ok(None);
        if result.as_ref().is_ok_and(|r| r.is_some()) {
            if let Some(f) = fallback.take() {
                local = f.end().await;
                tracing::warn!("{place} can be reached again; sharing the quota through it");
            }
            if throttle.upgrade().is_some_and(|t| t.store_back()) {
                // The whole told limit again once the sends made apart have left its window;
                // meanwhile the part grows as the processes join the holder and say what they
                // sent (all three at once, each with its part spent, sent 118 in a second).
                let regain = tokio_util::sync::CancellationToken::new();
                let (weak, until) = (throttle.clone(), regain.clone());
                tokio::spawn(async move {
                    let Some(window) = weak.upgrade().map(|t| t.rate_limiter().told().window) else { return };
                    tokio::select! {
                        () = tokio::time::sleep(window) => {}
                        () = until.cancelled() => return,
                    }
                    if let Some(t) = weak.upgrade() {
                        t.whole_again();
                    }
                });
                _regained = Some(regain.drop_guard());
            }
        }
        let Some(t) = throttle.upgrade() else { return };
        match result {
            Ok(Some((conn, me, true))) => {
                said = None;
                held = true;
                stale = None;
                // What the machine's holder wrote while Redis could not be reached is newer than
                // anything in Redis (where a write sent as Redis hung may have run as it woke,
                // looking fresh).
                match local {
                    Ok(Some((handed, age))) => handed.take_over(&t, age),
                    _ => take_over(&t, conn.clone(), &key).await,
                }
                t.set_sole(true);
                t.delegate_to(None);
                tracing::debug!("holding the quota shared through {place}");
                drop(t);
                if let Ended::Unreachable(e) = hold(&throttle, &client, conn, &key, &me).await {
                    failed = Some(e);
                    stale = Some(me);
                }
            }
            Ok(Some((conn, holder, false))) => {
                said = None;
                held = false;
                // One throttle for all again (after Redis could not be reached, say).
                t.set_sole(true);
                // Having held the quota on this machine, it tells the holder what the machine
                // sent in the window (the holder took the lease before this process saw Redis
                // again, and may have admitted calls beside those).
                let sent = local.is_err().then(|| t.rate_limiter().export());
                drop(t);
                if let Ended::Unreachable(e) = follow(&throttle, &client, conn, &key, &holder, &place, sent).await {
                    failed = Some(e);
                }
            }
            // The holder's lease just ended: try again at once.
            Ok(None) => continue,
            Err(e) => {
                // Others may be deciding alone too: their sends make the window look longer.
                t.set_sole(false);
                _regained = None;
                t.store_lost();
                if fallback.is_none() {
                    // Found hung, by a time-out: the holder finds it by one too, up to a second
                    // later than a follower (its pops block longer), so a follower gives it the
                    // longer while to hold the quota here first with what it knows.
                    fallback = crate::share::fall_back(&t, &name, held, e.is_timeout());
                    if fallback.is_none() {
                        t.delegate_to(None);
                    }
                }
                if said != Some(e.kind()) {
                    tracing::warn!(
                        "cannot reach {place} to share the quota ({}); this process shares it with the processes on \
                         this machine that name it too, and with no others, until it can",
                        why(&e)
                    );
                    said = Some(e.kind());
                }
                drop(t);
                // Sharing through this machine meanwhile, Redis is tried often: the first process
                // to see it again takes the quota there while the others still share here, and
                // both decide until they see it too.
                let again = if fallback.is_some() { Duration::from_millis(200) } else { Duration::from_secs(1) };
                tokio::time::sleep(again).await;
                continue;
            }
        }
        if let Some(t) = throttle.upgrade() {
            t.await_delegate();
        }
    }
}

/// Seeds `throttle` with what the last holder wrote down, if it has not expired.
async fn take_over(throttle: &Arc<Throttle>, mut conn: redis::aio::MultiplexedConnection, key: &str) {
    let state = format!("{key}:state");
    let got: redis::RedisResult<(Option<String>, i64)> =
        redis::pipe().get(&state).cmd("PTTL").arg(&state).query_async(&mut conn).await;
    let Ok((Some(text), left_ms)) = got else { return };
    let Ok(w) = serde_json::from_str::<Written>(&text) else { return };
    let age = Duration::from_millis(w.ttl_ms.saturating_sub(left_ms.max(0) as u64));
    w.handed.take_over(throttle, age);
}

/// One process the holder serves: where its lines go in, and when it was last heard from.
struct Member {
    feed: tokio::io::DuplexStream,
    seen: tokio::time::Instant,
}

/// How long the holder's pops block.
const HOLDER_POP: Duration = Duration::from_secs(1);

/// Serves the quota to the processes that ask through Redis, for as long as the lease is this
/// process's.
async fn hold(
    throttle: &Weak<Throttle>,
    client: &redis::Client,
    mut conn: redis::aio::MultiplexedConnection,
    key: &str,
    me: &str,
) -> Ended {
    let mut pops = match connect_for(client, HOLDER_POP).await {
        Ok(p) => p,
        Err(e) => return Ended::Unreachable(e),
    };
    let mut ended = Ended::Lease;
    let holder_key = format!("{key}:holder");
    let inbox = format!("{key}:in:{me}");
    let peers = Arc::new(AtomicUsize::new(0));
    let mut members: HashMap<String, Member> = HashMap::new();
    let tasks = Aborting(tokio::spawn(write_down(throttle.clone(), conn.clone(), format!("{key}:state"))));
    // Renewed while it is this process's; taken again when it is nobody's (a FLUSHALL, or a
    // Redis restarted, removed it): the processes this one serves go on with it rather than
    // with a holder that knows nothing of the quota (a helper saw 12 % of calls refused after a
    // FLUSHALL, when a follower took the lease with no state left to start from).
    let renew = redis::Script::new(
        "local v = redis.call('get', KEYS[1]) \
         if v == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) \
         elseif not v then redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 2 \
         else return 0 end",
    );
    let mut next_renewal = tokio::time::Instant::now() + RENEW_EVERY;
    let mut number = 0u64;
    let _leaving = Registered::new(Leaving::Holder {
        conn: conn.clone(),
        holder_key: holder_key.clone(),
        me: me.into(),
        state_key: format!("{key}:state"),
        throttle: throttle.clone(),
    });
    loop {
        if tokio::time::Instant::now() >= next_renewal {
            let renewed: redis::RedisResult<i64> =
                renew.key(&holder_key).arg(me).arg(LEASE.as_millis() as u64).invoke_async(&mut conn).await;
            match renewed {
                Ok(1) => {}
                Ok(2) => {
                    tracing::debug!("took the quota's lease again (its keys were removed)");
                    if let Some(t) = throttle.upgrade() {
                        write_state(&t, &mut conn, &format!("{key}:state")).await;
                    }
                }
                Ok(_) => {
                    tracing::debug!("no longer holding the quota shared through Redis");
                    break;
                }
                Err(e) => {
                    ended = Ended::Unreachable(e);
                    break;
                }
            }
            next_renewal += RENEW_EVERY;
            // Processes not heard from are dropped: their served calls end (kept counted).
            let now = tokio::time::Instant::now();
            members.retain(|_, m| now - m.seen < SILENT_FOR);
        }
        let Some(t) = throttle.upgrade() else { break };
        let popped: redis::RedisResult<Option<(String, String)>> = pops.blpop(&inbox, HOLDER_POP.as_secs_f64()).await;
        let note = match popped {
            Ok(Some((_, text))) => match serde_json::from_str::<Note>(&text) {
                Ok(n) => n,
                Err(_) => continue,
            },
            Ok(None) => continue,
            Err(e) => {
                ended = Ended::Unreachable(e);
                break;
            }
        };
        if note.bye {
            // Its serving ends with its pipe: the calls it had let out are given back.
            members.remove(&note.from);
            continue;
        }
        if !members.contains_key(&note.from) {
            // A new session of a process served already: the old one is over.
            let process = process_of(&note.from);
            members.retain(|from, _| process_of(from) != process);
        }
        let member = members.entry(note.from.clone()).or_insert_with(|| {
            // A process new to this holder: served as a connection of its own.
            number += 1;
            // One pipe each way, so that dropping `feed` (the process went silent, or this one
            // stopped holding) ends the serving: its waiting calls are cancelled and the ones
            // it let out are given back as the throttle frees them. (One two-way pipe split in
            // halves stays open while the half that sends out waits for the serving to end.)
            let (feed, served_in) = tokio::io::duplex(1 << 16);
            let (served_out, from_served) = tokio::io::duplex(1 << 16);
            let (t2, peers2, no) = (t.clone(), peers.clone(), number);
            tokio::spawn(async move {
                // Not let go for silence here: Redis carries the lines late at times, and
                // a member that stops sending is dropped by its own timeout (`seen`).
                let let_go = LetGo { silent_after: None, stop: tokio_util::sync::CancellationToken::new() };
                serve_peer(&t2, BufReader::new(served_in).lines(), served_out, &peers2, no, 1, let_go).await;
            });
            tokio::spawn(send_out(from_served, conn.clone(), format!("{key}:out:{}", note.from)));
            Member { feed, seen: tokio::time::Instant::now() }
        });
        member.seen = tokio::time::Instant::now();
        if note.line.is_none() {
            // Answered, so that the process knows this holder still reads its list.
            let _ = push(&mut conn, &format!("{key}:out:{}", note.from), ECHO).await;
        }
        if let Some(line) = note.line {
            let mut bytes = line.into_bytes();
            bytes.push(b'\n');
            // The served side reads as fast as the lines come; a full pipe would mean it ended.
            let feed = &mut member.feed;
            if tokio::time::timeout(Duration::from_millis(100), feed.write_all(&bytes)).await.is_err() {
                members.remove(&note.from);
            }
        }
    }
    if matches!(ended, Ended::Unreachable(_)) {
        // While the processes served are still counted: their servings end as `members` goes,
        // and a holder that counted after that kept the whole told limit (100 in 0.63 s for a
        // told 60 per 5 s, beside the others' parts).
        if let Some(t) = throttle.upgrade() {
            t.store_lost();
        }
    }
    drop(tasks);
    ended
}

/// Pushes `line` onto the list `list`, which expires [`LIST_TTL_MS`] after its last push.
async fn push(conn: &mut redis::aio::MultiplexedConnection, list: &str, line: &str) -> redis::RedisResult<()> {
    redis::pipe().rpush(list, line).ignore().pexpire(list, LIST_TTL_MS).ignore().query_async(conn).await
}

/// Pushes every line read from `from` onto the Redis list `to`, until `from` ends.
async fn send_out(from: tokio::io::DuplexStream, mut conn: redis::aio::MultiplexedConnection, to: String) {
    let mut lines = BufReader::new(from).lines();
    while let Ok(Some(l)) = lines.next_line().await {
        if push(&mut conn, &to, &l).await.is_err() {
            return;
        }
    }
}

/// Writes down what the holder's budgets know whenever it admitted calls since.
async fn write_down(throttle: Weak<Throttle>, mut conn: redis::aio::MultiplexedConnection, key: String) {
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(STATE_EVERY).await;
        let Some(t) = throttle.upgrade() else { return };
        let admitted = t.admitted();
        if admitted == last {
            continue;
        }
        last = admitted;
        write_state(&t, &mut conn, &key).await;
    }
}

/// Writes down what `throttle`'s budgets know under `key`, to expire a window after.
async fn write_state(throttle: &Throttle, conn: &mut redis::aio::MultiplexedConnection, key: &str) {
    let handed = Handed::of(throttle);
    let ttl_ms = (handed.current_for() + STATE_GRACE).as_millis() as u64;
    let written = Written { ttl_ms, handed };
    let text = serde_json::to_string(&written).expect("the budgets serialise");
    let _: redis::RedisResult<()> = conn.pset_ex(key, text, ttl_ms).await;
}

/// Asks the holder `holder` to admit this process's calls, until it no longer holds the quota or
/// Redis cannot be reached.
async fn follow(
    throttle: &Weak<Throttle>,
    client: &redis::Client,
    mut conn: redis::aio::MultiplexedConnection,
    key: &str,
    holder: &str,
    place: &str,
    sent: Option<(weir_core::rate::Seed, weir_core::rate::Seed)>,
) -> Ended {
    let mut pops = match connect_for(client, BEAT_EVERY).await {
        Ok(p) => p,
        Err(e) => return Ended::Unreachable(e),
    };
    let me = follower_id();
    let inbox = format!("{key}:in:{holder}");
    let outbox = format!("{key}:out:{me}");
    let (ours, pump) = tokio::io::duplex(1 << 16);
    let (pump_read, mut feed) = tokio::io::split(pump);
    let ended = Arc::new(tokio::sync::Notify::new());
    let peer = Peer::start(ours, ended.clone());
    if let Some(budgets) = sent {
        peer.tell_sent(budgets);
    }
    let Some(t) = throttle.upgrade() else { return Ended::Lease };
    t.delegate_to(Some(peer));
    // The holder and this one, at least (its grants tell how many more).
    t.set_processes(2);
    drop(t);
    tracing::debug!("sharing the quota held by another process, through {place}");
    // This process's lines to the holder.
    let sending = {
        let (mut conn, inbox, me) = (conn.clone(), inbox.clone(), me.clone());
        Aborting(tokio::spawn(async move {
            let mut lines = BufReader::new(pump_read).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let note = serde_json::to_string(&Note { from: me.clone(), line: Some(l), bye: false })
                    .expect("a note serialises");
                if push(&mut conn, &inbox, &note).await.is_err() {
                    return;
                }
            }
        }))
    };
    let alive = serde_json::to_string(&Note { from: me.clone(), line: None, bye: false }).expect("a note serialises");
    let _leaving = Registered::new(Leaving::Follower { conn: conn.clone(), inbox: inbox.clone(), me: me.clone() });
    let mut next_beat = tokio::time::Instant::now();
    let mut finished = std::pin::pin!(ended.notified());
    let mut last_heard = tokio::time::Instant::now();
    let mut ended = Ended::Lease;
    loop {
        // A holder that has answered nothing for a while although this process has calls
        // waiting (its lists lost — a FLUSHALL — or its process stuck) is left: the calls decide
        // alone, and the holder is looked for again.
        if last_heard.elapsed() > UNANSWERED_FOR {
            tracing::warn!(
                "the process holding the quota shared through {place} has not answered for {} s; looking for another",
                UNANSWERED_FOR.as_secs()
            );
            break;
        }
        if tokio::time::Instant::now() >= next_beat {
            next_beat += BEAT_EVERY;
            let holds: redis::RedisResult<Option<String>> = conn.get(format!("{key}:holder")).await;
            match holds {
                Ok(Some(h)) if h == holder => {}
                // The lease is nobody's, but the holder answered just now: its keys were
                // removed (a FLUSHALL), and it takes the lease again at its next renewal. A
                // holder that died has not answered for as long as its lease ran on.
                Ok(None) if last_heard.elapsed() < STILL_THERE => {}
                Ok(_) => break,
                Err(e) => {
                    ended = Ended::Unreachable(e);
                    break;
                }
            }
            if let Err(e) = push(&mut conn, &inbox, &alive).await {
                ended = Ended::Unreachable(e);
                break;
            }
        }
        let popped = tokio::select! {
            p = pops.blpop::<_, Option<(String, String)>>(&outbox, BEAT_EVERY.as_secs_f64()) => p,
            _ = &mut finished => break,
        };
        match popped {
            Ok(Some((_, mut line))) => {
                last_heard = tokio::time::Instant::now();
                if line == ECHO {
                    continue;
                }
                line.push('\n');
                if feed.write_all(line.as_bytes()).await.is_err() {
                    break;
                }
            }
            Ok(None) => {}
            Err(e) => {
                ended = Ended::Unreachable(e);
                break;
            }
        }
    }
    drop(sending);
    // Ends the holder's side for this process (its waiting calls decide alone until the next
    // holder is found).
    drop(feed);
    ended
}

/// A task stopped when this is dropped.
struct Aborting(tokio::task::JoinHandle<()>);

impl Drop for Aborting {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What went wrong talking to Redis: the I/O error when there was one (a refused connection, a
/// time-out), else the kind of error — never the server's whole message, which could quote a
/// command's arguments.
fn why(e: &redis::RedisError) -> String {
    match (e.kind(), e.code()) {
        (redis::ErrorKind::Io, _) => format!("{e}"),
        (redis::ErrorKind::Parse, _) => "the server does not answer in Redis's protocol".into(),
        (_, Some("NOAUTH")) => "the server wants a password: put it in the URL, rediss://:PASSWORD@HOST:PORT".into(),
        (_, Some(code)) => format!("the server answered {code}"),
        (kind, None) => format!("{kind:?}"),
    }
}
