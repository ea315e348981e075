//! Quota enforcement, as providers do it: requests and tokens over a sliding or a fixed
//! window, and a per-day request count, all per API key.
//!
//! The logic is pure (time is passed in) so it can be driven step by step in tests and reused by
//! deterministic scenario simulations that never open a socket.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use tokio::time::Instant;

use crate::config::{QuotaConfig, WindowKind};

/// Which quota refused a request; it decides the error body (`quotaId`) and the advised delay.
#[derive(Debug, Clone, PartialEq)]
pub enum Rejection {
    /// Too many requests in the window.
    Requests {
        /// The limit per window.
        limit: u64,
        /// When a slot frees up.
        retry_after: Duration,
    },
    /// Too many tokens in the window.
    Tokens {
        /// The limit per window.
        limit: u64,
        /// Tokens already counted in the window.
        used: u64,
        /// Tokens this request would add.
        requested: u64,
        /// When enough tokens free up.
        retry_after: Duration,
    },
    /// The request alone is larger than the token quota: it can never succeed.
    TooLarge {
        /// The limit per window.
        limit: u64,
        /// Tokens this request would add.
        requested: u64,
    },
    /// The per-day quota is spent.
    Daily {
        /// The limit per day.
        limit: u64,
        /// When the day ends.
        retry_after: Duration,
    },
}

/// What the rate-limit headers of a response report.
#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    /// Requests per window, if limited.
    pub request_limit: u64,
    /// Requests left in the window.
    pub requests_remaining: u64,
    /// Time until the request window is back to its initial state.
    pub requests_reset: Duration,
    /// Tokens per window, if limited.
    pub token_limit: u64,
    /// Tokens left in the window.
    pub tokens_remaining: u64,
    /// Time until the token window is back to its initial state.
    pub tokens_reset: Duration,
}

#[derive(Debug, Default)]
struct KeyState {
    /// Admitted requests in the window: (time, tokens).
    events: VecDeque<(Instant, u64)>,
    tokens: u64,
    day_start: Option<Instant>,
    day_count: u64,
}

/// Per-key window quotas.
#[derive(Debug)]
pub struct Quotas {
    config: QuotaConfig,
    window: Duration,
    keys: HashMap<String, KeyState>,
    /// Where fixed windows are counted from (the first request seen).
    origin: Option<Instant>,
}

impl Quotas {
    /// Quotas as configured.
    pub fn new(config: QuotaConfig) -> Self {
        let window = Duration::from_secs_f64(config.window_secs);
        Self { config, window, keys: HashMap::new(), origin: None }
    }

    /// Changes the per-window limits from now on (what was admitted stays counted), as when a
    /// provider lowers a project's quota mid-run.
    pub fn set_limits(&mut self, requests_per_window: u64, tokens_per_window: u64) {
        self.config.requests_per_window = requests_per_window;
        self.config.tokens_per_window = tokens_per_window;
    }

    /// True when no quota is configured, so callers may skip the bookkeeping entirely.
    pub fn unlimited(&self) -> bool {
        self.config.requests_per_window == 0 && self.config.tokens_per_window == 0 && self.config.requests_per_day == 0
    }

    /// Tries to admit a request of `tokens` for `key` at `now`. On success the request is counted.
    /// With `round_advice`, a rejection's advised delay is rounded up to whole seconds.
    pub fn admit(&mut self, key: &str, tokens: u64, now: Instant) -> Result<Usage, Rejection> {
        let mut r = self.admit_exact(key, tokens, now);
        if self.config.round_advice {
            if let Err(
                Rejection::Requests { retry_after, .. }
                | Rejection::Tokens { retry_after, .. }
                | Rejection::Daily { retry_after, .. },
            ) = &mut r
            {
                *retry_after = Duration::from_secs(retry_after.as_secs_f64().ceil().max(1.0) as u64);
            }
        }
        r
    }

    fn admit_exact(&mut self, key: &str, tokens: u64, now: Instant) -> Result<Usage, Rejection> {
        let c = &self.config;
        let window = self.window;
        let day = Duration::from_secs_f64(c.day_secs);
        // A fixed window: the one `now` is in, and requests before it no longer count.
        let fixed = (c.window == WindowKind::Fixed).then(|| {
            let origin = *self.origin.get_or_insert(now);
            let n = (now.duration_since(origin).as_secs_f64() / window.as_secs_f64()).floor();
            origin + window.mul_f64(n)
        });
        let state = self.keys.entry(key.to_string()).or_default();
        while let Some(&(t, n)) = state.events.front() {
            let gone = match fixed {
                Some(start) => t < start,
                None => now.duration_since(t) >= window,
            };
            if gone {
                state.events.pop_front();
                state.tokens -= n;
            } else {
                break;
            }
        }
        // When what is in the window now leaves it: the sliding window's oldest request's
        // expiry, or the fixed window's end.
        let leaves = |t: Instant| match fixed {
            Some(start) => start + window,
            None => t + window,
        };
        if c.requests_per_day > 0 {
            let start = *state.day_start.get_or_insert(now);
            if now.duration_since(start) >= day {
                state.day_start = Some(now);
                state.day_count = 0;
            }
            if state.day_count >= c.requests_per_day {
                let end = state.day_start.unwrap_or(now) + day;
                return Err(Rejection::Daily { limit: c.requests_per_day, retry_after: end - now });
            }
        }
        if c.tokens_per_window > 0 && tokens > c.tokens_per_window {
            return Err(Rejection::TooLarge { limit: c.tokens_per_window, requested: tokens });
        }
        if c.requests_per_window > 0 && state.events.len() as u64 >= c.requests_per_window {
            let oldest = state.events.front().map(|e| e.0).unwrap_or(now);
            return Err(Rejection::Requests { limit: c.requests_per_window, retry_after: leaves(oldest) - now });
        }
        if c.tokens_per_window > 0 && state.tokens + tokens > c.tokens_per_window {
            // Walk forward until enough tokens have expired.
            let mut freed = 0;
            let need = state.tokens + tokens - c.tokens_per_window;
            let mut at = now;
            for &(t, n) in &state.events {
                freed += n;
                at = leaves(t);
                if freed >= need {
                    break;
                }
            }
            return Err(Rejection::Tokens {
                limit: c.tokens_per_window,
                used: state.tokens,
                requested: tokens,
                retry_after: at - now,
            });
        }
        state.events.push_back((now, tokens));
        state.tokens += tokens;
        state.day_count += 1;
        let newest_reset = state.events.back().map(|e| leaves(e.0) - now).unwrap_or_default();
        Ok(Usage {
            request_limit: c.requests_per_window,
            requests_remaining: c.requests_per_window.saturating_sub(state.events.len() as u64),
            requests_reset: newest_reset,
            token_limit: c.tokens_per_window,
            tokens_remaining: c.tokens_per_window.saturating_sub(state.tokens),
            tokens_reset: newest_reset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(rpw: u64, tpw: u64, window: f64) -> QuotaConfig {
        QuotaConfig { requests_per_window: rpw, tokens_per_window: tpw, window_secs: window, ..QuotaConfig::default() }
    }

    /// A fixed window counts from its start: R requests in it, whenever they came, then
    /// refusals advising the time to the window's end; the next window starts empty.
    #[test]
    fn a_fixed_window_starts_again_at_its_end() {
        let mut q = Quotas::new(QuotaConfig { window: WindowKind::Fixed, ..cfg(5, 0, 1.0) });
        let t0 = Instant::now();
        assert!(q.admit("k", 1, t0).is_ok());
        let late = t0 + Duration::from_millis(900);
        let admitted = (0..10).filter(|_| q.admit("k", 1, late).is_ok()).count();
        assert_eq!(admitted, 4);
        match q.admit("k", 1, late) {
            Err(Rejection::Requests { retry_after, .. }) => assert_eq!(retry_after, Duration::from_millis(100)),
            other => panic!("{other:?}"),
        }
        // 1.0 s: a new window, although the four late ones came 100 ms ago (a sliding window
        // would still hold them).
        let next = t0 + Duration::from_millis(1000);
        assert_eq!((0..10).filter(|_| q.admit("k", 1, next).is_ok()).count(), 5);
    }

    #[test]
    fn exactly_r_requests_per_sliding_window() {
        let mut q = Quotas::new(cfg(5, 0, 1.0));
        let t0 = Instant::now();
        // 20 attempts spread over the first window: exactly 5 admitted.
        let admitted = (0..20).filter(|i| q.admit("k", 1, t0 + Duration::from_millis(i * 40)).is_ok()).count();
        assert_eq!(admitted, 5);
        // The sixth is told to come back when the oldest leaves the window.
        match q.admit("k", 1, t0 + Duration::from_millis(500)) {
            Err(Rejection::Requests { limit: 5, retry_after }) => assert_eq!(retry_after, Duration::from_millis(500)),
            other => panic!("{other:?}"),
        }
        // Once the window has slid past the first request, one more is admitted.
        assert!(q.admit("k", 1, t0 + Duration::from_millis(1000)).is_ok());
        // Keys are independent.
        assert!(q.admit("other", 1, t0).is_ok());
    }

    #[test]
    fn tokens_are_counted_and_freed() {
        let mut q = Quotas::new(cfg(0, 100, 1.0));
        let t0 = Instant::now();
        assert!(q.admit("k", 60, t0).is_ok());
        assert!(q.admit("k", 30, t0 + Duration::from_millis(100)).is_ok());
        match q.admit("k", 20, t0 + Duration::from_millis(200)) {
            Err(Rejection::Tokens { used: 90, requested: 20, retry_after, .. }) => {
                assert_eq!(retry_after, Duration::from_millis(800))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(q.admit("k", 101, t0), Err(Rejection::TooLarge { .. })));
        assert!(q.admit("k", 20, t0 + Duration::from_millis(1000)).is_ok());
    }

    #[test]
    fn daily_quota_stays_spent() {
        let mut q = Quotas::new(QuotaConfig { requests_per_day: 3, day_secs: 100.0, ..QuotaConfig::default() });
        let t0 = Instant::now();
        for i in 0..3 {
            assert!(q.admit("k", 1, t0 + Duration::from_secs(i)).is_ok());
        }
        for i in 3..50 {
            assert!(matches!(q.admit("k", 1, t0 + Duration::from_secs(i)), Err(Rejection::Daily { limit: 3, .. })));
        }
        assert!(q.admit("k", 1, t0 + Duration::from_secs(100)).is_ok());
    }
}
