//! Errors of a model call, classified once, where the provider's answer is understood.
//!
//! Every failure carries a [`ErrorKind`] (what went wrong, written to the errors file) and a
//! [`RetryHint`] (what the provider's answer says about trying again, including any delay it
//! advised). The retry policy reads the hint; it never re-parses status codes or bodies.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// What went wrong with a record. The snake-case name is what the errors file shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The input row cannot be turned into a request (bad JSON, missing field, duplicate id).
    InvalidInput,
    /// The provider's safety system blocked the prompt or the answer.
    Blocked,
    /// Too many requests or tokens (HTTP 429), or an overloaded server asked to slow down.
    RateLimited,
    /// A quota that will not come back soon (per-day, or billing) is spent.
    QuotaExhausted,
    /// The server failed (HTTP 5xx).
    Server,
    /// No answer within the request timeout.
    Timeout,
    /// The connection failed or broke (refused, reset, stream cut short).
    Transport,
    /// The answer could not be understood.
    MalformedResponse,
    /// The answer is not JSON matching the run's response schema (tried again up to
    /// `--max-invalid-retries` times, apart from the other retries).
    InvalidOutput,
    /// The provider rejected the request as invalid (HTTP 400, 422).
    BadRequest,
    /// The endpoint is not where the run was told (HTTP 404 or 405 for a model or route, a
    /// redirect): every record would fail alike. The run's failure, not the record's, so a
    /// resumed run tries the record again once the address is put right.
    Endpoint,
    /// Credentials missing or rejected (HTTP 401, 403).
    Auth,
    /// The run stopped before this record was tried (after a fatal error or an interrupt).
    Aborted,
}

impl ErrorKind {
    /// The name used in the errors file and the summary.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::Blocked => "blocked",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::QuotaExhausted => "quota_exhausted",
            ErrorKind::Server => "server",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Transport => "transport",
            ErrorKind::MalformedResponse => "malformed_response",
            ErrorKind::InvalidOutput => "invalid_output",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::Endpoint => "endpoint",
            ErrorKind::Auth => "auth",
            ErrorKind::Aborted => "aborted",
        }
    }

    /// Every kind, in the order of the enum.
    pub const ALL: [ErrorKind; 13] = [
        ErrorKind::InvalidInput,
        ErrorKind::Blocked,
        ErrorKind::RateLimited,
        ErrorKind::QuotaExhausted,
        ErrorKind::Server,
        ErrorKind::Timeout,
        ErrorKind::Transport,
        ErrorKind::MalformedResponse,
        ErrorKind::InvalidOutput,
        ErrorKind::BadRequest,
        ErrorKind::Endpoint,
        ErrorKind::Auth,
        ErrorKind::Aborted,
    ];

    /// The kind named `s` (as in the errors file).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The one definition of what is retried: the failure says nothing against the request, so
    /// the same request may succeed later. The executor retries these within a run (with
    /// backoff, or after the advised delay), and `--retry-errors` runs their rows again.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::RateLimited
                | ErrorKind::Server
                | ErrorKind::Timeout
                | ErrorKind::Transport
                | ErrorKind::MalformedResponse
                | ErrorKind::InvalidOutput
        )
    }

    /// The failure belongs to the run, not to the record (not tried, a spent daily quota,
    /// rejected credentials): its row does not finish the record, and a resumed run tries it.
    pub fn is_about_the_run(self) -> bool {
        matches!(self, ErrorKind::Aborted | ErrorKind::QuotaExhausted | ErrorKind::Auth | ErrorKind::Endpoint)
    }

    /// Whether a later run may succeed where this one failed (the `retryable` column of the
    /// errors file): a retryable failure, or one that belongs to the run.
    pub fn may_succeed_later(self) -> bool {
        self.is_retryable() || self.is_about_the_run()
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the provider's answer says about trying again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RetryHint {
    /// A transient failure: retry with exponential backoff.
    Backoff,
    /// The server asked to slow down; retry no sooner than the advised delay, when it gave one.
    Later(Option<Duration>),
    /// Retrying the same request cannot help.
    Never,
    /// Retrying cannot help and no other record will fare better: stop the run.
    StopRun,
}

/// A failed model call.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct ModelError {
    /// What went wrong.
    pub kind: ErrorKind,
    /// What the answer says about retrying.
    pub hint: RetryHint,
    /// A human-readable explanation (never containing secrets).
    pub message: String,
    /// The HTTP status, when there was one.
    pub status: Option<u16>,
    /// For a rate-limit error: which quota refused the call, when the answer says.
    pub quota: Option<QuotaScope>,
    /// No connection could be made: nothing listened, or the host could not be reached. Unlike
    /// a reset or a timeout, this says the request never reached a server.
    pub unreachable: bool,
}

/// Which quota a rate-limit error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuotaScope {
    /// Requests per window.
    Requests,
    /// Tokens per window.
    Tokens,
}

/// The longest wait a server may advise (`Retry-After` and the like) that weir waits out; see
/// [`ModelError::within_reason`]. Per-minute quotas advise seconds; a longer wait is a quota of a
/// day or an hour spent.
pub const LONGEST_ADVISED_WAIT: Duration = Duration::from_secs(600);

/// `d` as a person reads it: `3 h 20 min`, `12 min`, `45 s`.
fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        7200..=172_799 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} days", s / 86_400),
    }
}

impl ModelError {
    /// An error of `kind` with the hint that kind usually implies.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        let hint = match kind {
            ErrorKind::RateLimited => RetryHint::Later(None),
            ErrorKind::QuotaExhausted => RetryHint::StopRun,
            k if k.is_retryable() => RetryHint::Backoff,
            _ => RetryHint::Never,
        };
        Self { kind, hint, message: message.into(), status: None, quota: None, unreachable: false }
    }

    /// Sets the HTTP status.
    pub fn with_status(mut self, status: u16) -> Self {
        self.status = Some(status);
        self
    }

    /// Says which quota refused the call.
    pub fn with_quota(mut self, quota: QuotaScope) -> Self {
        self.quota = Some(quota);
        self
    }

    /// Marks a failure to connect at all (see [`ModelError::unreachable`]).
    pub fn with_unreachable(mut self) -> Self {
        self.unreachable = true;
        self
    }

    /// Replaces the retry hint.
    pub fn with_hint(mut self, hint: RetryHint) -> Self {
        self.hint = hint;
        self
    }

    /// This refusal as the one that stops the run: every call for `refused_for` (longer than
    /// [`LONGEST_ADVISED_WAIT`]) was refused for rate (`advised`: each told to wait a little)
    /// and none admitted, so the quota is not a window that frees (a quota of zero, one spent
    /// for the day) and holding calls for it would go on in silence. Resumable, as
    /// [`ModelError::within_reason`]'s stop.
    pub fn never_admitted(self, refused_for: Duration, advised: bool) -> Self {
        let how = if advised { "refused (each told to come back soon)" } else { "refused with no advised wait" };
        let why = format!("every call for {} was {how}, and none admitted", human(refused_for));
        self.stops_run(why, "the quota may be zero or spent for now; ", "")
    }

    /// This error as the one that stops the run, `why` (a wait longer than weir waits out),
    /// with `note` before the stop and `again` after "run again": the one wording of both stops.
    fn stops_run(self, why: String, note: &str, again: &str) -> Self {
        Self {
            kind: ErrorKind::QuotaExhausted,
            hint: RetryHint::StopRun,
            message: format!(
                "{why} (weir waits out at most {} min): {note}the run stops here, and the same command can be run again{again}: {}",
                LONGEST_ADVISED_WAIT.as_secs() / 60,
                self.message
            ),
            ..self
        }
    }

    /// This error, unless the server advised a wait longer than [`LONGEST_ADVISED_WAIT`] (a
    /// `Retry-After` of a day, or a date years away): then the quota is spent for now, and the
    /// run stops saying so and resumes when run again. Waiting it out would hold every call in
    /// silence (and, through a shared quota directory, every later run too).
    pub fn within_reason(self) -> Self {
        match self.hint {
            RetryHint::Later(Some(advised)) if advised > LONGEST_ADVISED_WAIT => {
                let why = format!("the endpoint asks to wait {} before the next call", human(advised));
                self.stops_run(why, "", " after then")
            }
            _ => self,
        }
    }

    /// The delay the server advised, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.hint {
            RetryHint::Later(d) => d,
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_of_hours_stops_the_run_saying_so() {
        let later = |s: u64| {
            ModelError::new(ErrorKind::RateLimited, "429").with_hint(RetryHint::Later(Some(Duration::from_secs(s))))
        };
        for s in [60, 600] {
            assert_eq!(later(s).within_reason().hint, later(s).hint);
        }
        let e = later(86_400).within_reason();
        assert_eq!((e.kind, e.hint), (ErrorKind::QuotaExhausted, RetryHint::StopRun));
        assert!(e.message.contains("wait 24 h 0 min") && e.message.ends_with(": 429"), "{}", e.message);
        assert!(later(2_000_000_000).within_reason().message.contains("23148 days"));
    }

    #[test]
    fn one_definition_of_what_is_retried() {
        for k in ErrorKind::ALL {
            assert_eq!(ErrorKind::parse(k.as_str()), Some(k));
            let hint = ModelError::new(k, "x").hint;
            // The executor retries exactly the retryable kinds (given their default hint).
            let retried = matches!(hint, RetryHint::Backoff | RetryHint::Later(_));
            assert_eq!(retried, k.is_retryable(), "{k}");
            assert!(!(k.is_retryable() && k.is_about_the_run()), "{k}");
        }
        assert_eq!(ErrorKind::parse("nope"), None);
    }
}
