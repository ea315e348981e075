//! Records to outcomes: each record routed to its model's driver, gathered into batches (by
//! length, with linger) for endpoints that take many records per call, streamed when the
//! caller takes events, and called at most `width` calls' worth at a time. `weir run` hands
//! it its input; SQL and Python a request's rows.

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use std::sync::Arc;
use tokio::time::Instant;
use weir_core::{Driver, ErrorKind, Failure, ModelError, Outcome, Record, RecordId, StreamEvent};
use weir_io::{EventRow, EventSender};

use crate::Router;

/// One item of work: a record to call for, a line that is already a failure (it did not
/// parse, its id is a duplicate), or an input that could not be read on.
pub enum Work {
    /// A record to call the model for.
    Call(Record),
    /// An input line that ended without a call.
    Done(Box<Failure>),
    /// The input could not be read on.
    ReadError(std::io::Error),
}

/// How records are gathered and how many are worked on at once.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// How records are gathered into calls for endpoints that take many per call (the item
    /// limit comes from the endpoint).
    pub batch: weir_core::BatchSettings,
    /// Batches (or single records) worked on at once: beyond the throttle's concurrency, the
    /// rest are sleeping in backoff; this bounds memory, not the rate.
    pub width: usize,
}

/// A [`Work`] item with its endpoint's driver found (and when, to time its wait for a batch).
enum Routed {
    Call(Arc<Driver>, Box<Record>, Instant),
    Done(Box<Failure>),
    ReadError(std::io::Error),
}

/// The outcomes of `work`, as they finish (not in input order). With `events`, each record's
/// answer is also sent as events: piece by piece from an endpoint that streams, whole from one
/// that answers batches. `Err` is an input that could not be read on.
pub fn outcomes<'a>(
    work: impl Stream<Item = Work> + Send + 'a,
    router: Arc<Router>,
    settings: DispatchSettings,
    events: Option<EventSender>,
) -> BoxStream<'a, Result<Outcome, std::io::Error>> {
    let routed = work.then({
        let router = router.clone();
        move |w| {
            let router = router.clone();
            async move {
                match w {
                    Work::Call(record) => match router.driver_for(&record).await {
                        Ok(d) => Routed::Call(d, Box::new(record), Instant::now()),
                        Err(msg) => Routed::Done(Box::new(Failure::of(
                            record,
                            ModelError::new(ErrorKind::InvalidInput, msg),
                            0,
                        ))),
                    },
                    Work::Done(failure) => Routed::Done(failure),
                    Work::ReadError(e) => Routed::ReadError(e),
                }
            }
        }
    });
    let mut batch_settings = settings.batch;
    batch_settings.max_items = router.default_driver().max_batch();
    let batched = weir_core::batches(
        Box::pin(routed),
        batch_settings,
        |r: &Routed| match r {
            Routed::Call(d, record, _) => d.estimate(record),
            _ => 0,
        },
        |r: &Routed| match r {
            // One batch per endpoint; an endpoint that takes one record per call is not batched.
            Routed::Call(d, _, _) if d.max_batch() > 1 => Some(Arc::as_ptr(d) as usize),
            _ => None,
        },
    );
    batched
        .map(move |batch| {
            // Sent now: how long each record waited for its batch.
            for r in &batch {
                if let Routed::Call(d, _, arrived) = r {
                    if d.max_batch() > 1 {
                        d.metrics().record_batch_wait(arrived.elapsed());
                    }
                }
            }
            answer(batch, router.clone(), events.clone())
        })
        .buffer_unordered(settings.width.max(1))
        .flat_map(futures::stream::iter)
        .boxed()
}

/// The outcomes of one batch (or one record, or one line that needs no call).
async fn answer(
    mut batch: Vec<Routed>,
    router: Arc<Router>,
    events: Option<EventSender>,
) -> Vec<Result<Outcome, std::io::Error>> {
    match batch.first() {
        // A batch for an endpoint that takes many records per call (perhaps of one).
        Some(Routed::Call(d, _, _)) if d.max_batch() > 1 => {
            let d = d.clone();
            let records = batch
                .into_iter()
                .filter_map(|r| match r {
                    Routed::Call(_, record, _) => Some(*record),
                    _ => None,
                })
                .collect();
            let outcomes = d.run_batch(records).await;
            // An endpoint that answers many records per call cannot stream: each answer is one
            // piece.
            if let Some(tx) = &events {
                for o in &outcomes {
                    match o {
                        Outcome::Success(s) => StreamTo::new(tx.clone(), &s.record.id).whole(&s.response.text).await,
                        Outcome::Failure(f) => {
                            if let Some(id) = &f.id {
                                StreamTo::new(tx.clone(), id).failed(&f.error).await
                            }
                        }
                    }
                }
            }
            outcomes.into_iter().map(Ok).collect()
        }
        // Anything else comes alone.
        _ => match batch.pop() {
            Some(Routed::Call(d, record, _)) => match events {
                Some(tx) => {
                    let to = StreamTo::new(tx, &record.id);
                    let outcome = d.run_streamed(*record, to.consumer()).await;
                    if let Outcome::Failure(f) = &outcome {
                        to.failed(&f.error).await;
                    }
                    vec![Ok(outcome)]
                }
                None => vec![Ok(d.run(*record).await)],
            },
            Some(Routed::Done(failure)) => vec![Ok(router.reject(failure))],
            Some(Routed::ReadError(e)) => vec![Err(e)],
            None => Vec::new(),
        },
    }
}

/// A boxed future of a stream event's delivery.
type Delivery = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// One record's events: each piece of its streamed call becomes an event row, numbered from 0
/// in the order the writer receives them; a record that fails ends with an `error` event.
#[derive(Clone)]
struct StreamTo {
    tx: EventSender,
    id: RecordId,
    seq: Arc<std::sync::atomic::AtomicU64>,
}

impl StreamTo {
    fn new(tx: EventSender, id: &RecordId) -> Self {
        Self { tx, id: id.clone(), seq: Default::default() }
    }

    fn row(&self, delta: Option<String>, restart: bool, error: Option<weir_io::EventError>) -> EventRow {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        EventRow { id: self.id.clone(), seq, delta, restart, error }
    }

    /// The consumer of the record's streamed call.
    fn consumer(&self) -> impl FnMut(StreamEvent) -> Delivery {
        let me = self.clone();
        move |event| {
            let row = match event {
                StreamEvent::Text(t) => me.row(Some(t), false, None),
                StreamEvent::Restart => me.row(None, true, None),
            };
            let tx = me.tx.clone();
            Box::pin(async move { tx.send(row).await })
        }
    }

    /// The whole answer of a call that did not stream, as one event.
    async fn whole(&self, text: &str) {
        self.tx.send(self.row(Some(text.to_string()), false, None)).await;
    }

    /// Ends the events of a record that failed. Not for one a stop cut off (`aborted`): it is
    /// not finished (a resume does it, and a run without state says so with its row), and error
    /// events for 30 such records told a consumer of the events alone they had failed.
    async fn failed(&self, error: &ModelError) {
        if error.kind == weir_core::ErrorKind::Aborted {
            return;
        }
        let e = weir_io::EventError { kind: error.kind.as_str().to_string(), message: error.message.clone() };
        self.tx.send(self.row(None, false, Some(e))).await;
    }
}
