//! Writing outcomes off the async path.
//!
//! Serialising rows, writing them and `fdatasync`ing the files once a second are blocking work;
//! done on the task that drives the calls, they would hold back every call in flight while the
//! disk is slow. So outcomes go over a bounded channel to a thread of their own, which owns both
//! files. The channel's bound is the back-pressure: a disk that cannot keep up slows the reading
//! of input, never the calls already made.
//!
//! The once-a-second `fdatasync` (and the response cache's durable commit after it) runs on a
//! third thread with its own handles on the files: a sync can take hundreds of milliseconds,
//! and the writer waiting for it would fill the channel and stall the whole run once a second.
//! With a journal, the writer hands rows to the kernel as soon as no other row is waiting (so a
//! killed process loses only rows still queued or buffered, which resume asks for again); the
//! sync only guards against losing the machine, and covers every row handed over before it began.
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

use crate::sink::{ErrorRow, EventRow, JsonlWriter, ResultRow};

/// How the thread is set up.
#[derive(Default)]
pub struct WriterSettings {
    /// Make rows durable about once a second (`fdatasync`), for a resumable run.
    pub resumable: bool,
    /// Called after each durable sync (e.g. to make the response cache durable too).
    pub on_sync: Option<Box<dyn Fn() + Send + Sync>>,
    /// Hand rows to the kernel as soon as no other row is waiting, also without a journal: a
    /// consumer is reading them as they come (a stream input that may never end, streamed
    /// answers), so a row must not wait in a buffer for the next one.
    pub flush_when_idle: bool,
    /// Where stream events go, if the run streams.
    pub events: Option<Events>,
}

/// Where a writer thread writes stream events.
pub enum Events {
    /// A file of their own.
    File(JsonlWriter),
    /// Between the result rows (`--output -`): each record's events come before its row.
    WithResults,
}

/// An outcome on its way to a writer thread.
pub enum Row {
    /// A result row.
    Success(Box<Success>),
    /// An error row.
    Failure(Box<Failure>),
    /// A piece of a streamed answer (not a row of either file: never counted or journaled).
    Event(Box<EventRow>),
}

/// Rows written in all: (results, errors).
pub type Counts = (u64, u64);

/// The handle of a thread that writes rows (JSONL files here, tables in `weir-tables`): it
/// sends rows over a bounded channel and learns of the thread's first write error at its next
/// send.
pub struct RowWriter {
    tx: Option<mpsc::Sender<Row>>,
    failed: Arc<Mutex<Option<String>>>,
    closed: tokio::sync::watch::Receiver<bool>,
    thread: Option<JoinHandle<(Counts, io::Result<()>)>>,
}

/// Sends stream events to a writer thread, from any task. It does not keep the thread alive:
/// once the writer is finished, events are dropped (no call is streaming by then).
#[derive(Clone)]
pub struct EventSender {
    tx: mpsc::WeakSender<Row>,
}

impl EventSender {
    /// Queues an event, waiting while the queue is full (a slow disk slows the stream).
    pub async fn send(&self, event: EventRow) {
        if let Some(tx) = self.tx.upgrade() {
            let _ = tx.send(Row::Event(Box::new(event))).await;
        }
    }
}

/// What a writer thread is given: its end of the channel, and where to report its first error.
pub struct WriterThread {
    /// Rows to write, until every sender is gone.
    pub rows: mpsc::Receiver<Row>,
    /// Set it (with [`report`]) when writing fails; senders see it at their next send.
    pub failed: Arc<Mutex<Option<String>>>,
    /// Set to true when the results' reader went away (a closed pipe): not a failure to
    /// write, but the end of the run, as an interrupt is.
    pub closed: tokio::sync::watch::Sender<bool>,
}

/// Rows waiting to be written at most. Small: a killed process loses the queued rows (their
/// records are requested again on resume), so the queue only smooths out a slow write.
const QUEUE: usize = 256;
/// Rows written at most before they are handed to the kernel, however busy the queue.
const FLUSH_EVERY: usize = 256;

/// How long a writer thread waits for the next row before it parks. Rows arrive one at a
/// time, often less than this apart; a thread parked on the channel must be woken by the
/// sender (a `futex` call on the run's driving thread for every row, about 2 % of its time at
/// zero latency), while a thread that sleeps this long looks again by itself.
const LINGER: Duration = Duration::from_micros(200);

/// The next row, or `None` when every sender is gone. When none is waiting, it runs `idle`,
/// looks again after [`LINGER`], and only then parks until one comes.
fn next_row(rx: &mut mpsc::Receiver<Row>, idle: impl FnOnce()) -> Option<Row> {
    use mpsc::error::TryRecvError;
    match rx.try_recv() {
        Ok(row) => return Some(row),
        Err(TryRecvError::Disconnected) => return None,
        Err(TryRecvError::Empty) => {
            idle();
            std::thread::sleep(LINGER);
        }
    }
    match rx.try_recv() {
        Err(TryRecvError::Empty) => rx.blocking_recv(),
        Ok(row) => Some(row),
        Err(TryRecvError::Disconnected) => None,
    }
}

/// Hands what is buffered to the kernel: the events file first, so that a record's events
/// are out before its row.
fn flush_all(events: &mut Option<JsonlWriter>, results: &mut JsonlWriter, errors: &mut JsonlWriter) -> io::Result<()> {
    if let Some(f) = events.as_mut() {
        f.flush().map_err(events_error)?;
    }
    results.flush().and_then(|()| errors.flush())
}

/// An error writing the events file, saying so (a reader of the events that went away is not
/// a failure to write rows).
fn events_error(e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("writing the stream events (--events): {e}"))
}

/// The error row of a record answered after the results' reader went away.
fn undelivered(s: &Success) -> Failure {
    let e = weir_core::ModelError::new(
        weir_core::ErrorKind::Aborted,
        "answered, but the output was closed before this row could be written (run this record again)",
    );
    Failure::of(s.record.clone(), e, s.attempts)
}

/// Tells senders that writing has failed (they see it at their next send).
pub fn report(failed: &Mutex<Option<String>>, e: &io::Error) {
    *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
}

/// What the thread that makes rows durable runs after each sync.
type OnSync = Arc<Box<dyn Fn() + Send + Sync>>;

/// The thread that `fdatasync`s the output files when asked, while the writer goes on writing.
struct Syncer {
    wake: std::sync::mpsc::SyncSender<()>,
    thread: JoinHandle<io::Result<()>>,
}

impl Syncer {
    fn spawn(
        results: &JsonlWriter,
        errors: &JsonlWriter,
        on_sync: Option<OnSync>,
        failed: Arc<Mutex<Option<String>>>,
    ) -> io::Result<Self> {
        let files: Vec<std::fs::File> = [results.sync_handle()?, errors.sync_handle()?].into_iter().flatten().collect();
        // One request waiting at most: a sync covers every row written before it starts, so
        // requests made while one runs are served by the next.
        let (wake, asked) = std::sync::mpsc::sync_channel::<()>(1);
        let thread = std::thread::Builder::new().name("weir-sync".into()).spawn(move || {
            while asked.recv().is_ok() {
                let synced = files.iter().try_for_each(std::fs::File::sync_data);
                if let Err(e) = synced {
                    report(&failed, &e);
                    return Err(e);
                }
                if let Some(f) = &on_sync {
                    f();
                }
            }
            Ok(())
        })?;
        Ok(Self { wake, thread })
    }

    /// Asks for a sync; does nothing when one is already asked for.
    fn request(&self) {
        let _ = self.wake.try_send(());
    }

    /// Waits for the sync under way, and returns the first error.
    fn finish(self) -> io::Result<()> {
        drop(self.wake);
        self.thread.join().unwrap_or_else(|_| Err(io::Error::other("the sync thread panicked")))
    }
}

/// Says that the reader of `--events` went away (`--events - | head`, a FIFO closed): the events
/// after that were dropped, while every row was written. Before, nothing said so.
fn say_events_dropped(events: &JsonlWriter) {
    if events.reader_gone() {
        tracing::warn!(
            "the reader of --events went away before the run ended: the events after that were dropped (every \
             record's row is written)"
        );
    }
}

impl RowWriter {
    /// Starts a writer thread named `name` running `write` with a channel of `queue` rows; the
    /// thread returns the rows it wrote and its first error.
    pub fn start(
        name: &str,
        queue: usize,
        write: impl FnOnce(WriterThread) -> (Counts, io::Result<()>) + Send + 'static,
    ) -> io::Result<Self> {
        let (tx, rows) = mpsc::channel::<Row>(queue);
        let failed = Arc::new(Mutex::new(None));
        let (closed_tx, closed) = tokio::sync::watch::channel(false);
        let given = WriterThread { rows, failed: failed.clone(), closed: closed_tx };
        let thread = std::thread::Builder::new().name(name.into()).spawn(move || write(given))?;
        Ok(Self { tx: Some(tx), failed, closed, thread: Some(thread) })
    }

    /// Starts a thread that writes only stream events, to `events` (beside a writer of tables,
    /// whose rows are not lines of a file).
    pub fn spawn_events(mut events: JsonlWriter) -> io::Result<Self> {
        Self::start("weir-events", QUEUE, move |WriterThread { rows: mut rx, failed, .. }| {
            let mut end = Ok(());
            while let Some(row) = next_row(&mut rx, || {
                if end.is_ok() {
                    end = events.flush().map_err(events_error);
                }
            }) {
                if let (Row::Event(e), Ok(())) = (row, &end) {
                    end = events.write_line(&*e).map_err(events_error);
                }
                if let Err(e) = &end {
                    report(&failed, e);
                }
            }
            let end = end.and_then(|()| events.flush().map_err(events_error));
            say_events_dropped(&events);
            ((0, 0), end)
        })
    }

    /// Starts the thread that owns the JSONL files `results` and `errors` (and the events
    /// file, when the run streams).
    pub fn spawn(mut results: JsonlWriter, mut errors: JsonlWriter, settings: WriterSettings) -> io::Result<Self> {
        Self::start("weir-writer", QUEUE, move |WriterThread { rows: mut rx, failed: failed_in, closed }| {
            // The results' reader going away (`| head`) is said once; results from then on
            // become error rows.
            let say_closed = |results: &JsonlWriter| {
                if results.reader_gone() {
                    closed.send_if_modified(|c| !std::mem::replace(c, true));
                }
            };
            let mut last_sync = Instant::now();
            let mut unflushed = 0usize;
            let mut error: Option<io::Error> = None;
            let on_sync = settings.on_sync.map(Arc::new);
            let flush_when_idle = settings.resumable || settings.flush_when_idle;
            let (mut events, events_with_results) = match settings.events {
                Some(Events::File(f)) => (Some(f), false),
                Some(Events::WithResults) => (None, true),
                None => (None, false),
            };
            let background = if settings.resumable {
                match Syncer::spawn(&results, &errors, on_sync.clone(), failed_in.clone()) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        report(&failed_in, &e);
                        error = Some(e);
                        None
                    }
                }
            } else {
                None
            };
            let sync = |results: &mut JsonlWriter, errors: &mut JsonlWriter| -> io::Result<()> {
                if settings.resumable {
                    results.sync()?;
                    errors.sync()?;
                    if let Some(f) = &on_sync {
                        f();
                    }
                } else {
                    results.flush()?;
                    errors.flush()?;
                }
                Ok(())
            };
            while let Some(row) = next_row(&mut rx, || {
                // No row is waiting: hand what is buffered to the kernel (with a journal, a
                // row still buffered is as unfinished as one still queued). Events first, so
                // that a record's events are out before its row.
                if flush_when_idle && unflushed > 0 && error.is_none() {
                    unflushed = 0;
                    if let Err(e) = flush_all(&mut events, &mut results, &mut errors) {
                        report(&failed_in, &e);
                        error = Some(e);
                    }
                }
            }) {
                say_closed(&results);
                if error.is_none() {
                    // A failed `fdatasync` on the sync thread stops writing here too: rows after
                    // it could not be made durable, and the run must not report them as written.
                    if let Some(msg) = &*failed_in.lock().unwrap_or_else(|p| p.into_inner()) {
                        error = Some(io::Error::other(msg.clone()));
                    }
                }
                if error.is_some() {
                    continue;
                }
                let gone = results.reader_gone();
                let mut written = match &row {
                    Row::Success(s) if gone => errors.write(&ErrorRow::of(&undelivered(s))),
                    Row::Success(s) => results.write(&ResultRow::of(s)),
                    Row::Failure(f) => errors.write(&ErrorRow::of(f)),
                    Row::Event(_) if gone && events_with_results => Ok(()),
                    Row::Event(e) => match events.as_mut() {
                        Some(file) => file.write_line(e).map_err(events_error),
                        None if events_with_results => results.write_line(e),
                        None => Ok(()),
                    },
                };
                // Rows reach the kernel (where a killed process cannot lose them) as soon as
                // no other row is waiting (in `next_row`'s idle step), or after FLUSH_EVERY
                // rows: one `write` for a burst of rows, not one per row.
                unflushed += 1;
                if flush_when_idle && written.is_ok() && unflushed >= FLUSH_EVERY {
                    unflushed = 0;
                    written = flush_all(&mut events, &mut results, &mut errors);
                }
                if written.is_ok() && last_sync.elapsed() >= Duration::from_secs(1) {
                    last_sync = Instant::now();
                    if let Some(s) = &background {
                        s.request();
                    }
                }
                // What the reader had not read went with it; the results still to come go to
                // the errors file, and the run ends as an interrupted one does.
                say_closed(&results);
                if let Err(e) = written {
                    report(&failed_in, &e);
                    error = Some(e);
                }
            }
            if let Some(s) = background {
                if let Err(e) = s.finish() {
                    error.get_or_insert(e);
                }
            }
            if let Some(f) = &events {
                say_events_dropped(f);
            }
            let end = match error {
                Some(e) => Err(e),
                None => events
                    .as_mut()
                    .map_or(Ok(()), |f| f.flush().map_err(events_error))
                    .and_then(|()| sync(&mut results, &mut errors)),
            };
            ((results.rows(), errors.rows()), end)
        })
    }

    /// Becomes true when the results' reader has gone away (a closed pipe).
    pub fn output_closed(&self) -> tokio::sync::watch::Receiver<bool> {
        self.closed.clone()
    }

    /// A sender of stream events to this writer, for the calls that stream.
    pub fn events(&self) -> Option<EventSender> {
        self.tx.as_ref().map(|tx| EventSender { tx: tx.downgrade() })
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

    /// Queues a row; an error says writing has failed (and stopped).
    pub async fn row(&self, row: Row) -> Result<(), String> {
        self.send(row).await
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
