//! The executor: takes one call to a result through admission, a hard timeout and retries.
//!
//! A *call* is whatever a provider sends in one request: one prompt, or a batch of items (Vertex
//! `:predict` instances, an embedding batch). The executor knows nothing of records, files or
//! runs: the caller hands it a closure that makes the call, a [`Weight`], and a cancellation
//! token it owns. For each attempt the [`Throttle`] admits the call, the closure's future runs
//! under the timeout (dropped when time is up, which cancels the request), the throttle learns
//! from the result, and the [`RetryPolicy`] decides what happens next — deciding to retry is the
//! policy's business, doing it is the executor's.
//!
//! Nothing is sticky. An error that says retrying cannot help ([`RetryHint::Never`]) or that no
//! other call will fare better either ([`RetryHint::StopRun`], a spent per-day quota) ends the
//! call and goes back to the caller, who decides what it means for everything else (`weir run`
//! stops; a long-lived worker may wait until tomorrow). Cancelling the token ends every call
//! that uses it at its next wait.
//!
//! A batched call has one outcome per item. A whole-call failure (429, 503, timeout) retries the
//! call; an item that failed on its own is retried alone in a later call with the other failed
//! items, never with the items that already succeeded.

use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{ErrorKind, ModelError, RetryHint};
use crate::handler::{Delta, DeltaStream};
use crate::metrics::RunMetrics;
use crate::outcome::{LimitInfo, ModelResponse, Usage};
use crate::pool::{Absorbed, Pool};
use crate::retry::{Decision, RetryPolicy};
use crate::throttle::{Throttle, Weight};

/// What an answer tells the throttle: the usage it counted and any rate-limit headers.
pub trait Metered {
    /// Tokens the endpoint counted for this answer.
    fn usage(&self) -> Usage;
    /// Rate limits the answer's headers reported.
    fn limits(&self) -> Option<LimitInfo> {
        None
    }
    /// For a streamed answer, the time from sending to its first text: the latency the
    /// adaptive concurrency limit learns from instead of the whole call's.
    fn first_token(&self) -> Option<Duration> {
        None
    }
    /// Why the answer, although the endpoint gave it (and billed it), is not one to keep: it
    /// does not match the run's response schema. The attempt is then a failure of kind
    /// [`ErrorKind::InvalidOutput`], retried apart from the others.
    fn invalid(&self) -> Option<ModelError> {
        None
    }
}

impl Metered for ModelResponse {
    fn usage(&self) -> Usage {
        self.usage
    }
    fn limits(&self) -> Option<LimitInfo> {
        self.limits
    }
}

/// A finished call.
#[derive(Debug, Clone)]
pub struct Done<T> {
    /// The answer.
    pub value: T,
    /// Attempts made, the successful one included.
    pub attempts: u32,
    /// From the first admission request to the answer, waits and backoff included.
    pub latency: Duration,
}

/// A call that ended without an answer.
#[derive(Debug, Clone)]
pub struct Failed {
    /// The last error; `aborted` when the call was cancelled before any attempt.
    pub error: ModelError,
    /// Attempts made.
    pub attempts: u32,
    /// True when the caller's token ended it.
    pub cancelled: bool,
}

/// Something that watches every attempt's error (e.g. a front end's rule for stopping a run
/// when credentials are rejected or nothing can be reached).
pub trait Observer: Send + Sync {
    /// Called after each failed attempt, with the attempts made so far.
    fn failed_attempt(&self, error: &ModelError, attempts: u32);
    /// Called after each answered attempt.
    fn answered(&self) {}
}

/// An observer that does nothing.
pub struct NoObserver;

impl Observer for NoObserver {
    fn failed_attempt(&self, _error: &ModelError, _attempts: u32) {}
}

/// Runs calls against one endpoint's [`Throttle`], or a [`Pool`] of endpoints (each attempt at
/// the one that admits it first).
pub struct Executor {
    pool: Arc<Pool>,
    policy: RetryPolicy,
    timeout: Duration,
    metrics: Arc<RunMetrics>,
    seed: AtomicU64,
    observer: Arc<dyn Observer>,
    /// Calls answered so far: a batched call that fails whole again while others were answered
    /// meanwhile fails for what it holds, not for the endpoint (see [`Executor::run_batch_at`]).
    answered: AtomicU64,
}

impl Executor {
    /// An executor over `throttle`: every attempt is cut at `timeout`, and retried as `policy`
    /// decides. Counts calls, retries and rate-limit refusals into `metrics`.
    pub fn new(throttle: Arc<Throttle>, policy: RetryPolicy, timeout: Duration, metrics: Arc<RunMetrics>) -> Self {
        Self::pooled(Arc::new(Pool::single(throttle)), policy, timeout, metrics)
    }

    /// An executor over a pool of endpoints: each attempt goes to the endpoint that admits it
    /// first, and the call is told which (see [`Executor::run_at`]).
    pub fn pooled(pool: Arc<Pool>, policy: RetryPolicy, timeout: Duration, metrics: Arc<RunMetrics>) -> Self {
        Self {
            pool,
            policy,
            timeout,
            metrics,
            seed: AtomicU64::new(0x5eed),
            observer: Arc::new(NoObserver),
            answered: AtomicU64::new(0),
        }
    }

    /// Reports every attempt to `observer`.
    pub fn with_observer(mut self, observer: Arc<dyn Observer>) -> Self {
        self.observer = observer;
        self
    }

    /// The throttle calls are admitted by (a pool's first endpoint's).
    pub fn throttle(&self) -> &Arc<Throttle> {
        self.pool.first()
    }

    /// The endpoints calls go to.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<RunMetrics> {
        &self.metrics
    }

    fn rng(&self) -> SmallRng {
        SmallRng::seed_from_u64(self.seed.fetch_add(1, Relaxed))
    }

    /// One attempt: admission at an endpoint of the pool, then `call` (told which endpoint)
    /// under the timeout. `None` when cancelled while waiting for admission. An error that
    /// the pool takes as one endpoint's trouble while another takes calls comes back as one
    /// to try again at once, and the observer does not see it.
    async fn attempt<T: Metered, Fut>(
        &self,
        weight: Weight,
        cancel: &CancellationToken,
        attempts: u32,
        held: &Held,
        refused_before: Option<Instant>,
        call: impl FnOnce(usize) -> Fut,
    ) -> Option<(Result<T, ModelError>, bool)>
    where
        Fut: Future<Output = Result<T, ModelError>>,
    {
        let (lane, admitted) = self.pool.admit(weight, cancel).await?;
        if !admitted.waited.is_zero() {
            self.metrics.add_throttled(admitted.waited);
        }
        self.metrics.record_call(attempts > 0);
        let sent = Instant::now();
        // A call on the wire is not cancelled: the endpoint may already have counted (and
        // billed) it, so its answer is worth waiting for. Cancellation ends calls at their
        // next wait; a caller that cannot wait drops the future.
        let result = cut(self.timeout, held, call(lane)).await.map_err(ModelError::within_reason);
        self.metrics.record_latency(sent.elapsed());
        let first_token = result.as_ref().ok().and_then(Metered::first_token);
        admitted.finish_timed(result.as_ref().map(|v| (v.usage(), v.limits())), first_token);
        match result {
            Ok(v) => {
                self.pool.learn(lane, Ok(()));
                self.answered.fetch_add(1, Relaxed);
                self.observer.answered();
                // Paid for and counted above, but not an answer to keep.
                if let Some(e) = v.invalid() {
                    let u = v.usage();
                    self.metrics.record_invalid_output(u.prompt_tokens, u.output_tokens);
                    self.observer.failed_attempt(&e, attempts + 1);
                    return Some((Err(e), true));
                }
                Some((Ok(v), false))
            }
            Err(e) => {
                if e.kind == ErrorKind::RateLimited {
                    self.metrics.record_rate_limited();
                }
                self.metrics.record_call_error(e.kind);
                let (e, mut absorbed) = self.pool.learn(lane, Err(&e)).unwrap_or((e, Absorbed::No));
                if absorbed == Absorbed::No
                    && e.kind == ErrorKind::RateLimited
                    && refused_before
                        .is_some_and(|before| self.pool.refused_since(lane).is_some_and(|since| since <= before))
                {
                    absorbed = Absorbed::Held;
                }
                if matches!(absorbed, Absorbed::No | Absorbed::Held) {
                    self.observer.failed_attempt(&e, attempts + 1);
                }
                // (The second: not one of the record's retries; see `Absorbed::Left` and
                // `Absorbed::Held`.)
                Some((Err(e), matches!(absorbed, Absorbed::Left | Absorbed::Held)))
            }
        }
    }

    /// Sleeps `d`, or less if `cancel` fires; false when cancelled. `for_quota`: the wait
    /// follows a refusal for rate, and the call counts as held for the quota meanwhile (see
    /// [`Pool::held`]): a run whose every call waits out a 429's advice does not look idle.
    /// Such a wait counts as throttled time too, ended or cut short: a batched call on a quota
    /// of zero waits out one 429's advice after another, and a run stopped after 10 minutes of
    /// that said "0.0 s throttled".
    async fn backoff(&self, d: Duration, cancel: &CancellationToken, for_quota: bool) -> bool {
        let _held = crate::throttle::Counted::new(self.pool.backing_off(), for_quota);
        let start = Instant::now();
        let slept = tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = cancel.cancelled() => false,
        };
        if for_quota {
            self.metrics.add_throttled(start.elapsed());
        }
        slept
    }

    fn cancelled(attempts: u32, last: Option<ModelError>) -> Failed {
        let error = match last {
            Some(e) if attempts > 0 => ModelError::new(ErrorKind::Aborted, format!("cancelled after: {e}")),
            _ => ModelError::new(ErrorKind::Aborted, "cancelled before it was tried"),
        };
        Failed { error, attempts, cancelled: true }
    }

    /// Takes one call to its result: `call` makes the request (once per attempt).
    pub async fn run<T, F, Fut>(
        &self,
        weight: Weight,
        cancel: &CancellationToken,
        mut call: F,
    ) -> Result<Done<T>, Failed>
    where
        T: Metered,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ModelError>>,
    {
        self.run_held(weight, cancel, &Held::default(), |_| call()).await
    }

    /// [`Executor::run`] over a pool: `call` gets the index of the endpoint (in the pool's
    /// order) that admitted the attempt.
    pub async fn run_at<T, F, Fut>(
        &self,
        weight: Weight,
        cancel: &CancellationToken,
        call: F,
    ) -> Result<Done<T>, Failed>
    where
        T: Metered,
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, ModelError>>,
    {
        self.run_held(weight, cancel, &Held::default(), call).await
    }

    /// [`Executor::run`], where each attempt's timeout leaves out the time `held` says the
    /// attempt spent waiting on its caller.
    async fn run_held<T, F, Fut>(
        &self,
        weight: Weight,
        cancel: &CancellationToken,
        held: &Held,
        mut call: F,
    ) -> Result<Done<T>, Failed>
    where
        T: Metered,
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, ModelError>>,
    {
        let start = Instant::now();
        let mut rng = self.rng();
        let mut attempts = 0u32;
        // Attempts that count against the retries (not those at an endpoint the pool left).
        let mut charged = 0u32;
        let mut invalid = 0u32;
        let mut last = None;
        // When the last attempt was refused for rate (see `Absorbed::Held`).
        let mut refused_at = None;
        loop {
            if cancel.is_cancelled() {
                return Err(Self::cancelled(attempts, last));
            }
            let Some((result, free)) = self.attempt(weight, cancel, attempts, held, refused_at, &mut call).await else {
                return Err(Self::cancelled(attempts, last));
            };
            refused_at = matches!(&result, Err(e) if e.kind == ErrorKind::RateLimited).then(Instant::now);
            attempts += 1;
            if !free {
                charged += 1;
            }
            let decided = match &result {
                Err(error) if error.kind == ErrorKind::InvalidOutput => {
                    invalid += 1;
                    Some(self.policy.decide_invalid(invalid, error))
                }
                _ => None,
            };
            match result {
                Ok(value) => return Ok(Done { value, attempts, latency: start.elapsed() }),
                Err(error) => match decided.unwrap_or_else(|| self.policy.decide(charged, &error, &mut rng)) {
                    Decision::GiveUp => return Err(Failed { error, attempts, cancelled: false }),
                    Decision::Retry(delay) => {
                        tracing::debug!(attempts, ?delay, "retrying: {error}");
                        let for_quota = error.kind == ErrorKind::RateLimited;
                        last = Some(error);
                        if !self.backoff(delay, cancel, for_quota).await {
                            return Err(Self::cancelled(attempts, last));
                        }
                    }
                },
            }
        }
    }

    /// Takes a batched call of `items` items to one outcome per item. `call` gets the indices
    /// of the items to send and answers one result per index, in order; `weight` gives the
    /// weight of a set of items. A whole-call error retries the call; items that failed alone
    /// are retried together, without the ones that succeeded.
    pub async fn run_batch<T, F, Fut, W>(
        &self,
        items: usize,
        weight: W,
        cancel: &CancellationToken,
        mut call: F,
    ) -> Vec<Result<Done<T>, Failed>>
    where
        T: Metered,
        W: Fn(&[usize]) -> Weight,
        F: FnMut(Vec<usize>) -> Fut,
        Fut: Future<Output = Result<Vec<Result<T, ModelError>>, ModelError>>,
    {
        self.run_batch_at(items, weight, cancel, |_, items| call(items)).await
    }

    /// [`Executor::run_batch`] over a pool: `call` gets the index of the endpoint that
    /// admitted the attempt, and the items.
    pub async fn run_batch_at<T, F, Fut, W>(
        &self,
        items: usize,
        weight: W,
        cancel: &CancellationToken,
        mut call: F,
    ) -> Vec<Result<Done<T>, Failed>>
    where
        T: Metered,
        W: Fn(&[usize]) -> Weight,
        F: FnMut(usize, Vec<usize>) -> Fut,
        Fut: Future<Output = Result<Vec<Result<T, ModelError>>, ModelError>>,
    {
        let start = Instant::now();
        let mut rng = self.rng();
        let mut out: Vec<Option<Result<Done<T>, Failed>>> = (0..items).map(|_| None).collect();
        let mut attempts = vec![0u32; items];
        // Attempts that count against each item's retries (not those at an endpoint the pool
        // left, as in `run_held`).
        let mut charged = vec![0u32; items];
        let mut last: Vec<Option<ModelError>> = vec![None; items];
        // When each item was last refused for rate (see `Absorbed::Held`).
        let mut refused_at: Vec<Option<Instant>> = vec![None; items];
        // Groups of items to send, each as one call; items to send again after a backoff.
        let mut queue: std::collections::VecDeque<Vec<usize>> =
            std::collections::VecDeque::from([(0..items).collect()]);
        let mut again: Vec<usize> = Vec::new();
        // Halves of calls split after failing whole again (see below), each sent as one call.
        let mut again_apart: Vec<Vec<usize>> = Vec::new();
        // Calls answered (by this executor) when each item's call last failed whole.
        let mut failed_whole_at: Vec<Option<u64>> = vec![None; items];
        let mut delay = Duration::ZERO;
        // Whether an item to send again was refused for rate (see `Executor::backoff`).
        let mut for_quota = false;
        loop {
            let group = match queue.pop_front() {
                Some(g) => g,
                None if again.is_empty() && again_apart.is_empty() => break,
                None => {
                    if !self.backoff(std::mem::take(&mut delay), cancel, std::mem::take(&mut for_quota)).await {
                        // (The items stay unsent: they end as cancelled, below.)
                        break;
                    }
                    if !again.is_empty() {
                        queue.push_back(std::mem::take(&mut again));
                    }
                    queue.extend(again_apart.drain(..));
                    continue;
                }
            };
            if cancel.is_cancelled() {
                queue.push_front(group);
                break;
            }
            let batch = Batch(group);
            let w = weight(&batch.0);
            let n = batch.0.len();
            // A refusal of the call spends no retry only if every item in it was refused before
            // and nothing was admitted since: since the earliest of those refusals, then. (`None`
            // orders before any time, so an item never refused makes the minimum `None`.)
            let before = batch.0.iter().map(|&i| refused_at[i]).min().flatten();
            let result = self
                .attempt(w, cancel, attempts[batch.0[0]], &Held::default(), before, |lane| {
                    Batch::call(&batch, lane, &mut call)
                })
                .await;
            let Some((result, free)) = result else {
                queue.push_front(batch.0);
                break;
            };
            for &i in &batch.0 {
                attempts[i] += 1;
                charged[i] += u32::from(!free);
            }
            // A refusal of the whole call that no retry can change may be the fault of one item
            // (a blocked prompt, an item the endpoint cannot take, too many items): the call is
            // split in halves and each sent alone, so only the culprit fails.
            if let Err(e) = &result {
                let one_items_fault =
                    matches!(e.kind, ErrorKind::BadRequest | ErrorKind::InvalidInput | ErrorKind::Blocked)
                        && e.hint == RetryHint::Never;
                if n > 1 && one_items_fault {
                    // Not a failure of these items (yet): the split does not use up their retries.
                    for &i in &batch.0 {
                        attempts[i] -= 1;
                        charged[i] -= u32::from(!free);
                    }
                    let (a, b) = batch.0.split_at(n / 2);
                    queue.push_front(b.to_vec());
                    queue.push_front(a.to_vec());
                    continue;
                }
            }
            // A call that fails whole again, for a reason a retry may change but not a rate
            // limit, may fail for one of its items (a text the server cannot take, answered with
            // a 500 or a reset each time): sent again as it was, the same call failed every time,
            // and all 128 items of an embedding call failed with the one. It is split in halves
            // when calls were answered since its items' last such failure (the endpoint is
            // up, so it is this call), or from its third failure on (no other call to tell by).
            // A first failure is retried whole: most are the endpoint's, and halves cost calls.
            let answered = self.answered.load(Relaxed);
            let whole = matches!(&result, Err(e) if e.kind != ErrorKind::RateLimited);
            let apart = whole
                && n > 1
                && batch.0.iter().all(|&i| {
                    failed_whole_at[i].is_some_and(|at| answered > at)
                        || (failed_whole_at[i].is_some() && charged[i] >= 3)
                });
            for &i in &batch.0 {
                failed_whole_at[i] = whole.then_some(answered);
            }
            let mut retried = Vec::new();
            // Item-level outcomes; a whole-call failure applies to every item of the call.
            let per_item: Vec<Result<T, ModelError>> = match result {
                Ok(BatchReply(v)) if v.len() == n => v,
                Ok(BatchReply(v)) => {
                    let msg = format!("the batch answer has {} items for {n} sent", v.len());
                    (0..n).map(|_| Err(ModelError::new(ErrorKind::MalformedResponse, msg.clone()))).collect()
                }
                Err(e) => (0..n).map(|_| Err(e.clone())).collect(),
            };
            let now = Instant::now();
            for (i, r) in batch.0.iter().copied().zip(per_item) {
                refused_at[i] = matches!(&r, Err(e) if e.kind == ErrorKind::RateLimited).then_some(now);
                match r {
                    Ok(value) => out[i] = Some(Ok(Done { value, attempts: attempts[i], latency: start.elapsed() })),
                    Err(error) => match self.policy.decide(charged[i], &error, &mut rng) {
                        Decision::GiveUp => {
                            out[i] = Some(Err(Failed { error, attempts: attempts[i], cancelled: false }));
                        }
                        Decision::Retry(d) => {
                            delay = delay.max(d);
                            for_quota |= error.kind == ErrorKind::RateLimited;
                            last[i] = Some(error);
                            retried.push(i);
                        }
                    },
                }
            }
            if apart && retried.len() > 1 {
                let b = retried.split_off(retried.len() / 2);
                again_apart.push(retried);
                again_apart.push(b);
            } else {
                again.extend(retried);
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(i, o)| o.unwrap_or_else(|| Err(Self::cancelled(attempts[i], last[i].take()))))
            .collect()
    }
}

/// Time an attempt has spent waiting on its own caller (a streamed call's consumer), which its
/// timeout does not count.
#[derive(Default)]
struct Held(std::sync::Mutex<(Duration, Option<Instant>)>);

/// Counts the time until dropped as held.
struct Holding<'a>(&'a Held);

impl Held {
    fn hold(&self) -> Holding<'_> {
        self.0.lock().expect("never poisoned").1 = Some(Instant::now());
        Holding(self)
    }

    /// The time held so far, and whether it is being held now.
    fn held(&self) -> (Duration, bool) {
        let (total, since) = *self.0.lock().expect("never poisoned");
        (total + since.map_or(Duration::ZERO, |s| s.elapsed()), since.is_some())
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        let mut h = self.0 .0.lock().expect("never poisoned");
        if let Some(since) = h.1.take() {
            h.0 += since.elapsed();
        }
    }
}

/// `call` cut at `timeout`, not counting the time `held` says it waited on its caller.
async fn cut<T>(
    timeout: Duration,
    held: &Held,
    call: impl Future<Output = Result<T, ModelError>>,
) -> Result<T, ModelError> {
    let start = Instant::now();
    tokio::pin!(call);
    loop {
        let (waited, holding) = held.held();
        let mut deadline = start + timeout + waited;
        if holding {
            // The deadline moves on while the caller is held: look again a little later.
            deadline = deadline.max(Instant::now() + Duration::from_millis(50));
        }
        tokio::select! {
            r = &mut call => return r,
            _ = tokio::time::sleep_until(deadline) => {
                let (waited, holding) = held.held();
                if !holding && Instant::now() >= start + timeout + waited {
                    return Err(ModelError::new(ErrorKind::Timeout, format!("no answer within {timeout:?}")));
                }
            }
        }
    }
}

/// What the consumer of a streamed call sees while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// More text of the answer, in order.
    Text(String),
    /// The call is being made again from the start: discard the text seen so far.
    Restart,
}

/// A streamed call's answer with its time to first token, which the throttle learns from.
struct Streamed {
    response: ModelResponse,
    first_token: Option<Duration>,
    invalid: Option<ModelError>,
}

/// Checks a whole answer: why it is not one to keep (see [`Metered::invalid`]).
pub type Check<'a> = &'a (dyn Fn(&ModelResponse) -> Option<ModelError> + Sync);

/// An answer with the verdict of a [`Check`], metered as the answer.
pub struct Checked {
    /// The answer.
    pub response: ModelResponse,
    /// Why it is not one to keep.
    pub invalid: Option<ModelError>,
}

impl Metered for Checked {
    fn usage(&self) -> Usage {
        self.response.usage
    }
    fn limits(&self) -> Option<LimitInfo> {
        self.response.limits
    }
    fn invalid(&self) -> Option<ModelError> {
        self.invalid.clone()
    }
}

impl Metered for Streamed {
    fn usage(&self) -> Usage {
        self.response.usage
    }
    fn limits(&self) -> Option<LimitInfo> {
        self.response.limits
    }
    fn first_token(&self) -> Option<Duration> {
        self.first_token
    }
    fn invalid(&self) -> Option<ModelError> {
        self.invalid.clone()
    }
}

impl Executor {
    /// Takes one streamed call to its whole answer, handing each piece of text to `on_event`
    /// as it arrives (and waiting for it: a slow consumer slows the stream, never loses
    /// text). `open` makes the request (once per attempt) and answers the stream. The time
    /// from sending to the first text is recorded as time to first token, the gaps between
    /// pieces as inter-token latency, and the adaptive concurrency limit learns from the time
    /// to first token. A stream that fails or is cut part-way is retried from the start like
    /// any failed call; a consumer that was given text for it gets [`StreamEvent::Restart`]
    /// first. The answer returned has the whole text, so it can be written and cached as if it
    /// had not been streamed.
    pub async fn run_stream<F, Fut, E, EFut>(
        &self,
        weight: Weight,
        cancel: &CancellationToken,
        mut open: F,
        on_event: E,
    ) -> Result<Done<ModelResponse>, Failed>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<DeltaStream, ModelError>>,
        E: FnMut(StreamEvent) -> EFut,
        EFut: Future<Output = ()>,
    {
        self.run_stream_at(weight, cancel, |_| open(), on_event, None).await
    }

    /// [`Executor::run_stream`] over a pool: `open` gets the index of the endpoint that
    /// admitted the attempt. A whole answer that `check` finds invalid is an attempt that
    /// failed: the consumer gets [`StreamEvent::Restart`] before the next one's text.
    pub async fn run_stream_at<F, Fut, E, EFut>(
        &self,
        weight: Weight,
        cancel: &CancellationToken,
        mut open: F,
        on_event: E,
        check: Option<Check<'_>>,
    ) -> Result<Done<ModelResponse>, Failed>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<DeltaStream, ModelError>>,
        E: FnMut(StreamEvent) -> EFut,
        EFut: Future<Output = ()>,
    {
        use futures::StreamExt;
        // (consumer, whether it holds text of an attempt that did not finish). Attempts run
        // one after another, so the lock is never contended; it only lets each attempt's
        // future borrow the consumer.
        let consumer = tokio::sync::Mutex::new((on_event, false));
        let consumer = &consumer;
        let metrics = &self.metrics;
        // Time blocked on the consumer (a pager, a slow pipe) is not the endpoint's time: it
        // does not count against the timeout, or a paused reader would cut calls in flight
        // and pay for them again.
        let held = &Held::default();
        let done = self
            .run_held(weight, cancel, held, move |lane| {
                let opened = open(lane);
                async move {
                    let sent = Instant::now();
                    {
                        let mut c = consumer.lock().await;
                        if c.1 {
                            c.1 = false;
                            let _held = held.hold();
                            (c.0)(StreamEvent::Restart).await;
                        }
                    }
                    let mut stream = opened.await?;
                    let mut text = String::new();
                    let mut first_token = None;
                    let mut last_piece = sent;
                    while let Some(item) = stream.next().await {
                        match item? {
                            Delta::Text(t) if t.is_empty() => {}
                            Delta::Text(t) => {
                                let now = Instant::now();
                                match first_token {
                                    None => {
                                        let ttft = now.duration_since(sent);
                                        metrics.record_first_token(ttft);
                                        first_token = Some(ttft);
                                    }
                                    Some(_) => metrics.record_inter_token(now.duration_since(last_piece)),
                                }
                                last_piece = now;
                                text.push_str(&t);
                                let mut c = consumer.lock().await;
                                c.1 = true;
                                let _held = held.hold();
                                (c.0)(StreamEvent::Text(t)).await;
                            }
                            Delta::End(mut whole) => {
                                whole.text = text;
                                let invalid = check.and_then(|c| c(&whole));
                                // The text of an answer not kept is taken back before the next.
                                consumer.lock().await.1 = invalid.is_some();
                                return Ok(Streamed { response: whole, first_token, invalid });
                            }
                        }
                    }
                    Err(ModelError::new(ErrorKind::Transport, "the streamed answer was cut before its end"))
                }
            })
            .await?;
        Ok(Done { value: done.value.response, attempts: done.attempts, latency: done.latency })
    }
}

/// The indices of one batched attempt.
struct Batch(Vec<usize>);

/// The answer of a batched attempt, metered as the sum of its items.
struct BatchReply<T>(Vec<Result<T, ModelError>>);

impl<T: Metered> Metered for BatchReply<T> {
    fn usage(&self) -> Usage {
        let mut u = Usage::default();
        for r in self.0.iter().flatten() {
            let x = r.usage();
            u.prompt_tokens += x.prompt_tokens;
            u.output_tokens += x.output_tokens;
            u.total_tokens += x.total_tokens;
        }
        u
    }
    fn limits(&self) -> Option<LimitInfo> {
        self.0.iter().flatten().find_map(|r| r.limits())
    }
}

impl Batch {
    fn call<T, F, Fut>(&self, lane: usize, call: &mut F) -> impl Future<Output = Result<BatchReply<T>, ModelError>>
    where
        F: FnMut(usize, Vec<usize>) -> Fut,
        Fut: Future<Output = Result<Vec<Result<T, ModelError>>, ModelError>>,
    {
        let fut = call(lane, self.0.clone());
        async move { fut.await.map(BatchReply) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RetryHint;
    use crate::throttle::ThrottleSettings;
    use std::sync::Mutex;

    fn answer(text: &str) -> ModelResponse {
        ModelResponse {
            text: text.into(),
            finish_reason: "stop".into(),
            usage: Usage { prompt_tokens: 1, output_tokens: 1, total_tokens: 2 },
            model_version: None,
            limits: None,
            embedding: None,
        }
    }

    fn executor(max_retries: u32) -> Executor {
        let t = Arc::new(Throttle::new(&ThrottleSettings { adaptive: false, ..ThrottleSettings::default() }));
        let policy = RetryPolicy { max_retries, ..RetryPolicy::default() };
        Executor::new(t, policy, Duration::from_secs(5), Arc::new(RunMetrics::default()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_is_retried_until_it_succeeds_and_a_hang_is_cut() {
        let ex = executor(5);
        let n = Mutex::new(0);
        let cancel = CancellationToken::new();
        let done = ex
            .run(Weight::default(), &cancel, || {
                let k = {
                    let mut n = n.lock().unwrap();
                    *n += 1;
                    *n
                };
                async move {
                    match k {
                        1 => Err(ModelError::new(ErrorKind::Server, "500")),
                        2 => {
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                            Ok(answer("late"))
                        }
                        _ => Ok(answer("ok")),
                    }
                }
            })
            .await
            .unwrap();
        assert_eq!((done.value.text.as_str(), done.attempts), ("ok", 3));
        assert!(done.latency >= Duration::from_secs(5), "the hang was cut at the timeout");
        assert_eq!(ex.metrics().calls.load(Relaxed), 3);
    }

    /// An attempt at an endpoint the pool then leaves (here one that rejects the key) is not
    /// one of the record's retries, for single calls and batched ones alike: with no retries
    /// at all, every record is answered by the endpoint left.
    #[tokio::test(start_paused = true)]
    async fn an_attempt_at_an_endpoint_the_pool_leaves_is_not_a_retry_single_or_batched() {
        use crate::pool::{Pool, PoolMember};
        let t = || Arc::new(Throttle::new(&ThrottleSettings { adaptive: false, ..ThrottleSettings::default() }));
        let pool = Pool::new(vec![
            PoolMember { throttle: t(), endpoint: "rejects".into(), weight: 1.0 },
            PoolMember { throttle: t(), endpoint: "answers".into(), weight: 1.0 },
        ]);
        let policy = RetryPolicy { max_retries: 0, ..RetryPolicy::default() };
        let ex = Executor::pooled(Arc::new(pool), policy, Duration::from_secs(5), Arc::new(RunMetrics::default()));
        let cancel = CancellationToken::new();
        let rejected = || ModelError::new(ErrorKind::Auth, "API key not valid");
        let mut results = ex
            .run_batch_at(
                4,
                |_| Weight::default(),
                &cancel,
                |lane, items| async move {
                    match lane {
                        0 => Err(rejected()),
                        _ => Ok(items.iter().map(|i| Ok(answer(&format!("b{i}")))).collect()),
                    }
                },
            )
            .await;
        // The batch may have gone to the answering endpoint first; then the single calls meet
        // the rejecting one until the pool leaves it.
        for _ in 0..8 {
            results.push(
                ex.run_at(Weight::default(), &cancel, |lane| async move {
                    match lane {
                        0 => Err(rejected()),
                        _ => Ok(answer("one")),
                    }
                })
                .await,
            );
        }
        let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).map(|f| f.error.to_string()).collect();
        assert!(failed.is_empty(), "failed: {failed:?}");
    }

    /// A quota of zero whose 429s advise 10 s: no record uses up its retries on refusals while
    /// nothing is admitted; each ends with the run's 10-minute stop (`quota_exhausted`, run
    /// again by a plain resume), not as a `rate_limited` row after its 9 attempts. Once a call
    /// is admitted, refusals count against a record's retries again.
    #[tokio::test(start_paused = true)]
    async fn refusals_while_nothing_is_admitted_are_not_a_records_retries() {
        let ex = Arc::new(executor(8));
        let cancel = CancellationToken::new();
        let refused = || {
            ModelError::new(ErrorKind::RateLimited, "429")
                .with_status(429)
                .with_hint(RetryHint::Later(Some(Duration::from_secs(10))))
        };
        let start = Instant::now();
        let records: Vec<_> = (0..4)
            .map(|_| {
                let ex = ex.clone();
                let cancel = cancel.clone();
                tokio::spawn(async move {
                    ex.run(Weight::default(), &cancel, || async { Err::<ModelResponse, _>(refused()) }).await
                })
            })
            .collect();
        for r in records {
            let failed = r.await.unwrap().unwrap_err();
            assert_eq!(failed.error.kind, ErrorKind::QuotaExhausted, "{}", failed.error);
            assert!(failed.attempts > 9, "{} attempts", failed.attempts);
        }
        assert!(start.elapsed() >= crate::error::LONGEST_ADVISED_WAIT, "{:?}", start.elapsed());

        // A quota that admits others' calls between a record's refusals: they count, and the
        // record ends as refused after its retries.
        ex.run(Weight::default(), &cancel, || async { Ok(answer("admitted again")) }).await.unwrap();
        let busy = {
            let ex = ex.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                loop {
                    ex.run(Weight::default(), &cancel, || async { Ok(answer("another record's")) }).await.unwrap();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        };
        let start = Instant::now();
        let failed = ex.run(Weight::default(), &cancel, || async { Err::<ModelResponse, _>(refused()) }).await;
        busy.abort();
        let failed = failed.unwrap_err();
        assert_eq!((failed.error.kind, failed.attempts), (ErrorKind::RateLimited, 9), "{}", failed.error);
        assert!(start.elapsed() < Duration::from_secs(200), "{:?}", start.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn batched_refusals_while_nothing_is_admitted_are_not_the_items_retries() {
        // Throttled time is counted from a process-wide epoch, which another test's paused
        // clock may have set minutes ahead of this one's (see metrics.rs).
        tokio::time::sleep(Duration::from_secs(86_400)).await;
        let ex = executor(8);
        let cancel = CancellationToken::new();
        let start = Instant::now();
        let out = ex
            .run_batch(
                3,
                |items| Weight { tokens: items.len() as u64 },
                &cancel,
                |_items: Vec<usize>| async {
                    Err::<Vec<Result<ModelResponse, ModelError>>, _>(
                        ModelError::new(ErrorKind::RateLimited, "429")
                            .with_status(429)
                            .with_hint(RetryHint::Later(Some(Duration::from_secs(10)))),
                    )
                },
            )
            .await;
        for o in &out {
            let failed = o.as_ref().unwrap_err();
            assert_eq!(failed.error.kind, ErrorKind::QuotaExhausted, "{}", failed.error);
            assert!(failed.attempts > 9, "{} attempts", failed.attempts);
        }
        assert!(start.elapsed() >= crate::error::LONGEST_ADVISED_WAIT, "{:?}", start.elapsed());
        // Waiting out the 429s' advice was throttling (the run said "0.0 s throttled").
        let throttled = Duration::from_micros(ex.metrics().throttled_wall_micros.load(Relaxed));
        assert!(throttled >= crate::error::LONGEST_ADVISED_WAIT - Duration::from_secs(10), "{throttled:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_batched_call_that_keeps_failing_whole_is_split_until_its_culprit_fails_alone() {
        // One item makes every call that holds it fail with a 500 (a text the server cannot
        // take): sent again as it was, the call failed every time, and every item in it with it.
        let ex = executor(8);
        let cancel = CancellationToken::new();
        let calls = Arc::new(AtomicU64::new(0));
        let c = calls.clone();
        let out = ex
            .run_batch(
                16,
                |items| Weight { tokens: items.len() as u64 },
                &cancel,
                move |items: Vec<usize>| {
                    c.fetch_add(1, Relaxed);
                    async move {
                        if items.contains(&5) {
                            return Err(ModelError::new(ErrorKind::Server, "500").with_status(500));
                        }
                        Ok(items.iter().map(|i| Ok(answer(&i.to_string()))).collect())
                    }
                },
            )
            .await;
        for (i, o) in out.iter().enumerate() {
            assert_eq!(o.is_ok(), i != 5, "item {i}: {:?}", o.as_ref().err().map(|f| &f.error));
        }
        assert_eq!(out[5].as_ref().unwrap_err().error.kind, ErrorKind::Server);
        // Whole twice, then halves: 16, 16, 8 + 8, 4 + 4, 2 + 2, 1 + 1, then the culprit alone
        // until its retries are spent.
        assert!(calls.load(Relaxed) <= 16, "{} calls", calls.load(Relaxed));

        // A failure that every call meets (the endpoint down) is retried whole: no halves.
        let calls = Arc::new(AtomicU64::new(0));
        let c = calls.clone();
        let out = ex
            .run_batch(
                16,
                |items| Weight { tokens: items.len() as u64 },
                &cancel,
                move |items: Vec<usize>| {
                    let n = c.fetch_add(1, Relaxed);
                    async move {
                        if n < 2 {
                            return Err(ModelError::new(ErrorKind::Transport, "connection refused"));
                        }
                        Ok(items.iter().map(|i| Ok(answer(&i.to_string()))).collect())
                    }
                },
            )
            .await;
        assert!(out.iter().all(Result::is_ok));
        assert_eq!(calls.load(Relaxed), 3, "two whole failures, then one whole call");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_error_goes_back_to_the_caller_and_nothing_is_sticky() {
        let ex = executor(5);
        let cancel = CancellationToken::new();
        let e = ex
            .run(Weight::default(), &cancel, || async {
                Err::<ModelResponse, _>(ModelError::new(ErrorKind::QuotaExhausted, "per day"))
            })
            .await
            .unwrap_err();
        assert_eq!((e.error.kind, e.attempts, e.cancelled), (ErrorKind::QuotaExhausted, 1, false));
        // The next call is made as usual: the caller decides what a spent quota means.
        let ok = ex.run(Weight::default(), &cancel, || async { Ok(answer("x")) }).await.unwrap();
        assert_eq!(ok.attempts, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn cancelling_ends_calls_in_backoff_and_before_admission() {
        let ex = Arc::new(executor(50));
        let cancel = CancellationToken::new();
        let c = cancel.clone();
        let ex2 = ex.clone();
        let task = tokio::spawn(async move {
            ex2.run(Weight::default(), &c, || async {
                Err::<ModelResponse, _>(
                    ModelError::new(ErrorKind::RateLimited, "429")
                        .with_hint(RetryHint::Later(Some(Duration::from_secs(60)))),
                )
            })
            .await
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Waiting out the 429's advice, the call is held for the quota.
        assert_eq!(ex.pool().held(), 1);
        cancel.cancel();
        let e = task.await.unwrap().unwrap_err();
        assert!(e.cancelled);
        assert_eq!(e.error.kind, ErrorKind::Aborted);
        assert_eq!(ex.pool().held(), 0);
        let e = ex.run(Weight::default(), &cancel, || async { Ok(answer("never")) }).await.unwrap_err();
        assert_eq!((e.attempts, e.cancelled), (0, true));
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_retries_only_the_items_that_failed() {
        let ex = executor(5);
        let cancel = CancellationToken::new();
        let sent: Mutex<Vec<Vec<usize>>> = Mutex::new(Vec::new());
        let out = ex
            .run_batch(
                5,
                |items| Weight { tokens: items.len() as u64 },
                &cancel,
                |items: Vec<usize>| {
                    let round = {
                        let mut s = sent.lock().unwrap();
                        s.push(items.clone());
                        s.len()
                    };
                    async move {
                        match round {
                            // The whole call is refused: every item goes again.
                            1 => Err(ModelError::new(ErrorKind::Server, "503").with_status(503)),
                            // Items 1 and 3 fail alone (3 for good), the rest succeed.
                            _ => Ok(items
                                .iter()
                                .map(|&i| match (round, i) {
                                    (2, 1) => Err(ModelError::new(ErrorKind::Server, "item 1 flaked")),
                                    (_, 3) => Err(ModelError::new(ErrorKind::BadRequest, "item 3 is invalid")),
                                    _ => Ok(answer(&format!("a{i}"))),
                                })
                                .collect()),
                        }
                    }
                },
            )
            .await;
        let sent = sent.into_inner().unwrap();
        assert_eq!(sent, vec![vec![0, 1, 2, 3, 4], vec![0, 1, 2, 3, 4], vec![1]]);
        for i in [0, 1, 2, 4] {
            assert_eq!(out[i].as_ref().unwrap().value.text, format!("a{i}"));
        }
        assert_eq!(out[1].as_ref().unwrap().attempts, 3);
        assert_eq!(out[3].as_ref().unwrap_err().error.kind, ErrorKind::BadRequest);
        assert_eq!(ex.metrics().calls.load(Relaxed), 3, "three requests for five items");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_refused_for_one_items_fault_is_split_until_only_that_item_fails() {
        let ex = executor(5);
        let cancel = CancellationToken::new();
        let sent: Mutex<Vec<Vec<usize>>> = Mutex::new(Vec::new());
        let out = ex
            .run_batch(
                8,
                |items| Weight { tokens: items.len() as u64 },
                &cancel,
                |items: Vec<usize>| {
                    sent.lock().unwrap().push(items.clone());
                    async move {
                        // The endpoint refuses any call that carries item 5 (a blocked prompt).
                        if items.contains(&5) {
                            Err(ModelError::new(ErrorKind::BadRequest, "item 5 is refused"))
                        } else {
                            Ok(items.iter().map(|&i| Ok(answer(&format!("a{i}")))).collect())
                        }
                    }
                },
            )
            .await;
        for (i, o) in out.iter().enumerate() {
            match (i, o) {
                (5, Err(f)) => assert_eq!(f.error.kind, ErrorKind::BadRequest),
                (5, Ok(_)) => panic!("item 5 answered"),
                (i, o) => assert_eq!(o.as_ref().unwrap().value.text, format!("a{i}")),
            }
        }
        let sent = sent.into_inner().unwrap();
        // Halves: [0..8] refused, [0..4] ok, [4..8] refused, [4,5] refused, [4] ok, [5] refused, [6,7] ok.
        assert_eq!(sent.len(), 7, "{sent:?}");
        assert_eq!(sent[5], vec![5]);
        // A split is not a retry: every item was tried once.
        assert!(out.iter().all(|o| match o {
            Ok(d) => d.attempts == 1,
            Err(f) => f.attempts == 1,
        }));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_cut_part_way_restarts_and_answers_once() {
        use crate::handler::{Delta, DeltaStream};
        let ex = executor(5);
        let cancel = CancellationToken::new();
        let opened = Mutex::new(0);
        let events = Mutex::new(Vec::new());
        let done = ex
            .run_stream(
                Weight::default(),
                &cancel,
                || {
                    let k = {
                        let mut n = opened.lock().unwrap();
                        *n += 1;
                        *n
                    };
                    async move {
                        let text = |t: &str| Ok(Delta::Text(t.to_string()));
                        let items = match k {
                            // Cut before any text: retried without a restart.
                            1 => vec![Err(ModelError::new(ErrorKind::Transport, "reset"))],
                            // Cut after some text: the consumer is told to start over.
                            2 => vec![text(""), text("a"), text("b")],
                            _ => vec![text("a"), text("b"), text("c"), Ok(Delta::End(answer("")))],
                        };
                        Ok(Box::pin(futures::stream::iter(items)) as DeltaStream)
                    }
                },
                |e| {
                    events.lock().unwrap().push(match e {
                        StreamEvent::Text(t) => t,
                        StreamEvent::Restart => "<restart>".to_string(),
                    });
                    std::future::ready(())
                },
            )
            .await
            .unwrap();
        assert_eq!(done.value.text, "abc");
        assert_eq!(done.attempts, 3);
        assert_eq!(events.into_inner().unwrap(), ["a", "b", "<restart>", "a", "b", "c"]);
    }

    /// Issue #29, item 8: a consumer that blocks (a pager, a paused pipe) for longer than the
    /// timeout does not cut the call: that time is not the endpoint's, and cutting would pay
    /// for the call again. The endpoint's own silence is still cut.
    #[tokio::test(start_paused = true)]
    async fn a_slow_consumer_does_not_time_the_stream_out() {
        use crate::handler::{Delta, DeltaStream};
        let ex = executor(5);
        let cancel = CancellationToken::new();
        let opened = Mutex::new(0);
        let pieces = |gap: u64| {
            futures::stream::unfold(0u32, move |i| async move {
                tokio::time::sleep(Duration::from_millis(gap)).await;
                match i {
                    0..=2 => Some((Ok(Delta::Text(format!("{i}"))), i + 1)),
                    3 => Some((Ok(Delta::End(answer(""))), i + 1)),
                    _ => None,
                }
            })
        };
        let open = || {
            *opened.lock().unwrap() += 1;
            async move { Ok(Box::pin(pieces(1_000)) as DeltaStream) }
        };
        let started = Instant::now();
        let done = ex
            .run_stream(Weight::default(), &cancel, open, |_| tokio::time::sleep(Duration::from_secs(20)))
            .await
            .unwrap();
        assert_eq!((done.value.text.as_str(), done.attempts, *opened.lock().unwrap()), ("012", 1, 1));
        assert!(started.elapsed() >= Duration::from_secs(60));
        // Three seconds of the endpoint's own time between pieces add up past the timeout of
        // a call whose consumer is quick: cut, as before.
        let slow = || async move { Ok(Box::pin(pieces(3_000)) as DeltaStream) };
        let failed = ex.run_stream(Weight::default(), &cancel, slow, |_| std::future::ready(())).await.unwrap_err();
        assert_eq!(failed.error.kind, ErrorKind::Timeout);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_measures_first_token_and_the_gaps_between_pieces() {
        use crate::handler::{Delta, DeltaStream};
        let ex = executor(0);
        let cancel = CancellationToken::new();
        // First text after 100 ms, then a piece every 10 ms, then the end after 50 ms more.
        let open = || async {
            let pieces = futures::stream::unfold(0u32, |i| async move {
                let (wait, item) = match i {
                    0 => (100, Delta::Text("a".into())),
                    1..=3 => (10, Delta::Text("b".into())),
                    4 => (50, Delta::End(answer(""))),
                    _ => return None,
                };
                tokio::time::sleep(Duration::from_millis(wait)).await;
                Some((Ok(item), i + 1))
            });
            Ok(Box::pin(pieces) as DeltaStream)
        };
        let seen = Mutex::new(Vec::new());
        let done = ex
            .run_stream(Weight::default(), &cancel, open, |e| {
                seen.lock().unwrap().push((tokio::time::Instant::now(), e));
                std::future::ready(())
            })
            .await
            .unwrap();
        assert_eq!(done.value.text, "abbb");
        // Each piece reached the consumer when it arrived, not at the end.
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 4);
        assert_eq!(seen[1].0 - seen[0].0, Duration::from_millis(10));
        let near = |d: Duration, ms: f64| (d.as_secs_f64() * 1000.0 - ms).abs() <= ms * 0.02;
        let ttft = ex.metrics().first_token().unwrap();
        assert_eq!(ttft.count, 1);
        assert!(near(ttft.p50, 100.0), "{ttft:?}");
        let gaps = ex.metrics().inter_token().unwrap();
        assert_eq!(gaps.count, 3);
        assert!(near(gaps.p99, 10.0), "{gaps:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_adaptive_limit_learns_from_first_tokens_not_from_answer_lengths() {
        use crate::handler::{Delta, DeltaStream};
        use futures::StreamExt;
        // Streamed answers that get ever longer (whole calls from 0.1 s to 6 s) while the
        // endpoint's time to first token stays at 50 ms: nothing says the endpoint is loaded.
        // Judged by whole-call latency, the limit would have been cut again and again.
        let settings = ThrottleSettings { adaptive: true, max_concurrency: 64, ..ThrottleSettings::default() };
        let ex = Arc::new(Executor::new(
            Arc::new(Throttle::new(&settings)),
            RetryPolicy::default(),
            Duration::from_secs(60),
            Arc::new(RunMetrics::default()),
        ));
        let cancel = CancellationToken::new();
        let calls = (0..400u64).map(|i| {
            let (ex, cancel) = (ex.clone(), cancel.clone());
            async move {
                let open = move || async move {
                    let pieces = futures::stream::unfold(0u64, move |k| async move {
                        let (wait, item) = match k {
                            0 => (50, Delta::Text("a".into())),
                            1 => (50 + i * 15, Delta::End(answer(""))),
                            _ => return None,
                        };
                        tokio::time::sleep(Duration::from_millis(wait)).await;
                        Some((Ok(item), k + 1))
                    });
                    Ok(Box::pin(pieces) as DeltaStream)
                };
                ex.run_stream(Weight::default(), &cancel, open, |_| std::future::ready(())).await.unwrap();
            }
        });
        futures::stream::iter(calls).buffer_unordered(64).collect::<Vec<_>>().await;
        let limit = ex.throttle().concurrency();
        assert!(limit >= 32, "the limit fell to {limit}");
    }

    #[tokio::test]
    async fn a_handler_that_takes_one_request_per_call_answers_a_batch_of_one() {
        use crate::handler::{ModelHandler, ModelRequest};
        struct One;
        #[async_trait::async_trait]
        impl ModelHandler for One {
            async fn generate(&self, r: &ModelRequest) -> Result<ModelResponse, ModelError> {
                Ok(answer(&r.prompt))
            }
            fn model_id(&self) -> &str {
                "test/one"
            }
        }
        let req = |p: &str| ModelRequest {
            prompt: p.into(),
            system: None,
            params: Default::default(),
            media: Default::default(),
            fields: None,
        };
        let one = One.generate_batch(&[req("x")]).await.unwrap();
        assert_eq!(one[0].as_ref().unwrap().text, "x");
        assert_eq!(One.generate_batch(&[req("x"), req("y")]).await.unwrap_err().kind, ErrorKind::BadRequest);
        let streamed = One.generate_stream(&req("whole")).await.unwrap();
        let items: Vec<_> = futures::StreamExt::collect(streamed).await;
        assert_eq!(items.len(), 2, "the whole text, then the end");
    }
}
