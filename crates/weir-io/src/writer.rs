//! Writing outcomes off the async path.
//!
//! Serialising rows, writing them and `fdatasync`ing the files once a second are blocking work;
//! done on the task that drives the calls, they would hold back every call in flight while the
//! disk is slow. So outcomes go over a bounded channel to a thread of their own, which owns both
//! files. The channel's bound is the back-pressure: a disk that cannot keep up slows the reading
//! of input, never the calls already made.
//!
//! The first write error stops writing for good (what follows would not be resumable in order);
//! the thread keeps draining the channel so that senders never block on a dead writer, and the
//! error is reported to the sender at its next send and at the end.

use std::io;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use weir_core::{Failure, Success};

use crate::sink::{ErrorRow, JsonlWriter, ResultRow};

/// How the thread is set up.
pub struct WriterSettings {
    /// Make rows durable about once a second (`fdatasync`), for a resumable run.
    pub journal: bool,
    /// Called after each durable sync (e.g. to make the response cache durable too).
    pub on_sync: Option<Box<dyn Fn() + Send>>,
}

enum Row {
    Success(Box<Success>),
    Failure(Box<Failure>),
}

/// Rows written in all: (results, errors).
pub type Counts = (u64, u64);

/// The handle of the writing thread.
pub struct RowWriter {
    tx: Option<mpsc::Sender<Row>>,
    failed: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<(Counts, io::Result<()>)>>,
}

/// Rows waiting to be written at most. Small: a killed process loses the queued rows (their
/// records are requested again on resume), so the queue only smooths out a slow write.
const QUEUE: usize = 256;

impl RowWriter {
    /// Starts the thread that owns `results` and `errors`.
    pub fn spawn(mut results: JsonlWriter, mut errors: JsonlWriter, settings: WriterSettings) -> io::Result<Self> {
        let (tx, mut rx) = mpsc::channel::<Row>(QUEUE);
        let failed = Arc::new(Mutex::new(None));
        let failed_in = failed.clone();
        let thread = std::thread::Builder::new().name("weir-writer".into()).spawn(move || {
            let mut last_sync = Instant::now();
            let mut error: Option<io::Error> = None;
            let sync = |results: &mut JsonlWriter, errors: &mut JsonlWriter| -> io::Result<()> {
                if settings.journal {
                    results.sync()?;
                    errors.sync()?;
                    if let Some(f) = &settings.on_sync {
                        f();
                    }
                } else {
                    results.flush()?;
                    errors.flush()?;
                }
                Ok(())
            };
            while let Some(row) = rx.blocking_recv() {
                if error.is_some() {
                    continue;
                }
                let written = match &row {
                    Row::Success(s) => results.write(&ResultRow::of(s)),
                    Row::Failure(f) => errors.write(&ErrorRow::of(f)),
                };
                let synced = match written {
                    Ok(()) if settings.journal && last_sync.elapsed() >= Duration::from_secs(1) => {
                        last_sync = Instant::now();
                        sync(&mut results, &mut errors)
                    }
                    other => other,
                };
                if let Err(e) = synced {
                    *failed_in.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                    error = Some(e);
                }
            }
            let end = match error {
                Some(e) => Err(e),
                None => sync(&mut results, &mut errors),
            };
            ((results.rows(), errors.rows()), end)
        })?;
        Ok(Self { tx: Some(tx), failed, thread: Some(thread) })
    }

    fn check(&self) -> Result<(), String> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    async fn send(&self, row: Row) -> Result<(), String> {
        self.check()?;
        let tx = self.tx.as_ref().ok_or("the writer has finished")?;
        tx.send(row).await.map_err(|_| "the writer thread has stopped".to_string())
    }

    /// Queues a result row; an error says writing has failed (and stopped).
    pub async fn success(&self, s: Box<Success>) -> Result<(), String> {
        self.send(Row::Success(s)).await
    }

    /// Queues an error row; an error says writing has failed (and stopped).
    pub async fn failure(&self, f: Box<Failure>) -> Result<(), String> {
        self.send(Row::Failure(f)).await
    }

    /// Writes what is queued, makes it durable (or flushes it), and returns the rows written.
    pub async fn finish(mut self) -> (Counts, io::Result<()>) {
        drop(self.tx.take());
        let thread = self.thread.take();
        match thread {
            Some(t) => tokio::task::spawn_blocking(move || t.join())
                .await
                .ok()
                .and_then(|r| r.ok())
                .unwrap_or(((0, 0), Err(io::Error::other("the writer thread panicked")))),
            None => ((0, 0), Ok(())),
        }
    }
}
