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
    /// Waits for a slot.
    async fn acquire(&self) -> Permit;
    /// Reports a finished call.
    fn feedback(&self, latency: Duration, result: CallResult);
    /// The current limit.
    fn current(&self) -> usize;
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
    async fn acquire(&self) -> Permit {
        let permit: OwnedSemaphorePermit =
            self.sem.clone().acquire_owned().await.expect("the semaphore is never closed");
        Box::new(permit)
    }

    fn feedback(&self, _latency: Duration, _result: CallResult) {}

    fn current(&self) -> usize {
        self.limit
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
    async fn fixed_limit_bounds_permits() {
        let l = Arc::new(FixedLimit::new(2));
        let a = l.acquire().await;
        let _b = l.acquire().await;
        let l2 = l.clone();
        let third = tokio::spawn(async move { l2.acquire().await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!third.is_finished());
        drop(a);
        tokio::time::timeout(Duration::from_millis(10), third).await.unwrap().unwrap();
    }
}
