//! Deciding whether and when to retry, kept apart from doing it.
//!
//! The policy is a pure function of the attempt number, the error's retry hint and a random
//! draw, so every path is unit-tested without sleeping. Backoff is exponential with full jitter
//! (a uniform draw in `[0, min(cap, base·2^n)]`), which spreads retries of many records that
//! failed together; a delay the server advised is a floor, never shortened.

use rand::Rng;
use std::time::Duration;

use crate::error::{ModelError, RetryHint};

/// The retry policy of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (so `max_retries + 1` attempts at most).
    pub max_retries: u32,
    /// First backoff ceiling.
    pub base: Duration,
    /// Largest backoff ceiling.
    pub cap: Duration,
    /// Retries of answers that do not match the response schema, counted apart from the
    /// others (an invalid answer says nothing about the endpoint's load, and is retried at once).
    pub max_invalid_retries: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { max_retries: 8, base: Duration::from_millis(250), cap: Duration::from_secs(30), max_invalid_retries: 2 }
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Try again after this delay.
    Retry(Duration),
    /// Stop; the error is the record's outcome.
    GiveUp,
}

impl RetryPolicy {
    /// The ceiling of the backoff after `attempts` failed attempts.
    pub fn ceiling(&self, attempts: u32) -> Duration {
        let exp = attempts.saturating_sub(1).min(30);
        self.base.saturating_mul(1u32 << exp).min(self.cap)
    }

    /// Decides after the `invalid`-th answer (≥ 1) that did not match the response schema,
    /// `error`: one that says asking again is in vain (an answer cut at the token limit) is not
    /// asked for again.
    pub fn decide_invalid(&self, invalid: u32, error: &ModelError) -> Decision {
        match invalid > self.max_invalid_retries || error.hint == RetryHint::Never {
            true => Decision::GiveUp,
            false => Decision::Retry(Duration::ZERO),
        }
    }

    /// Decides after `attempts` attempts (≥ 1) have failed, the last with `error`.
    pub fn decide(&self, attempts: u32, error: &ModelError, rng: &mut impl Rng) -> Decision {
        if attempts > self.max_retries {
            return Decision::GiveUp;
        }
        let mut jitter = |ceiling: Duration| Duration::from_secs_f64(rng.gen_range(0.0..=ceiling.as_secs_f64()));
        match error.hint {
            RetryHint::Never | RetryHint::StopRun => Decision::GiveUp,
            RetryHint::Backoff | RetryHint::Later(None) => Decision::Retry(jitter(self.ceiling(attempts))),
            // The advised delay is a floor; a little jitter on top keeps the records that were
            // refused together from coming back together.
            RetryHint::Later(Some(advised)) => {
                Decision::Retry(advised + jitter(self.base.min(advised / 10 + self.base / 4)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn permanent_errors_are_not_retried() {
        let p = RetryPolicy::default();
        let mut rng = SmallRng::seed_from_u64(1);
        for kind in [
            ErrorKind::Blocked,
            ErrorKind::BadRequest,
            ErrorKind::Auth,
            ErrorKind::InvalidInput,
            ErrorKind::QuotaExhausted,
        ] {
            assert_eq!(p.decide(1, &ModelError::new(kind, "x"), &mut rng), Decision::GiveUp, "{kind}");
        }
    }

    #[test]
    fn backoff_is_exponential_full_jitter_and_capped() {
        let p = RetryPolicy {
            max_retries: 20,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(2),
            ..Default::default()
        };
        assert_eq!(p.ceiling(1), Duration::from_millis(100));
        assert_eq!(p.ceiling(3), Duration::from_millis(400));
        assert_eq!(p.ceiling(10), Duration::from_secs(2));
        let mut rng = SmallRng::seed_from_u64(2);
        let e = ModelError::new(ErrorKind::Server, "500");
        let delays: Vec<Duration> = (0..1000)
            .map(|_| match p.decide(3, &e, &mut rng) {
                Decision::Retry(d) => d,
                Decision::GiveUp => panic!(),
            })
            .collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(400)));
        // Full jitter: the draws cover the whole range.
        assert!(delays.iter().any(|d| *d < Duration::from_millis(40)));
        assert!(delays.iter().any(|d| *d > Duration::from_millis(360)));
    }

    #[test]
    fn advised_delay_is_a_floor() {
        let p = RetryPolicy::default();
        let mut rng = SmallRng::seed_from_u64(3);
        let e =
            ModelError::new(ErrorKind::RateLimited, "429").with_hint(RetryHint::Later(Some(Duration::from_secs(26))));
        for _ in 0..100 {
            match p.decide(1, &e, &mut rng) {
                Decision::Retry(d) => assert!(d >= Duration::from_secs(26) && d <= Duration::from_secs(27), "{d:?}"),
                Decision::GiveUp => panic!(),
            }
        }
    }

    #[test]
    fn gives_up_after_max_retries() {
        let p = RetryPolicy { max_retries: 2, ..RetryPolicy::default() };
        let mut rng = SmallRng::seed_from_u64(4);
        let e = ModelError::new(ErrorKind::Timeout, "t");
        assert!(matches!(p.decide(2, &e, &mut rng), Decision::Retry(_)));
        assert_eq!(p.decide(3, &e, &mut rng), Decision::GiveUp);
    }
}
