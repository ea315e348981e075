//! Ctrl-C and SIGTERM: every command stops the same way on either (a service manager, `timeout`
//! and Kubernetes send SIGTERM), and says by its exit status which one it was.

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Which signal asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Ctrl-C (SIGINT).
    Interrupt,
    /// SIGTERM.
    Terminate,
}

impl Stop {
    /// 128 + the signal's number, as shells and service managers expect.
    pub fn exit_status(self) -> u8 {
        match self {
            Stop::Interrupt => 130,
            Stop::Terminate => 143,
        }
    }
}

/// Ctrl-C and SIGTERM as one stream of requests to stop. SIGTERM's handler is installed when
/// this is made, so a SIGTERM from then on is caught, not fatal.
pub struct StopSignals {
    term: Signal,
}

impl StopSignals {
    /// Installs the SIGTERM handler.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self { term: signal(SignalKind::terminate())? })
    }

    /// The next request to stop; `None` when signals can no longer be received.
    pub async fn next(&mut self) -> Option<Stop> {
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.ok().map(|()| Stop::Interrupt),
            r = self.term.recv() => r.map(|()| Stop::Terminate),
        }
    }
}
