//! Stopping the model calls of a cluster task that its scheduler cancelled.
//!
//! When a client stops a query, the scheduler cancels its job and each executor drops the
//! task's future; but Ballista's shuffle writer runs the plan in a task of its own that nothing
//! stops, so the functions went on calling (and paying for) models until the partition was
//! done. An executor of weir's therefore tags each task's configuration with an id whose
//! cancellation token fires when the task is dropped, and a function call that carries the tag
//! stops with the token.

use datafusion::common::config::{ConfigExtension, ConfigOptions};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use tokio_util::sync::CancellationToken;

datafusion::common::extensions_options! {
    /// The task a function call runs for, set by the executor on the task's configuration.
    pub struct TaskTag {
        /// The task's id in this process (0: none).
        pub id: u64, default = 0
    }
}

impl ConfigExtension for TaskTag {
    const PREFIX: &'static str = "weir_task";
}

/// A live task's token, and the rows it has called.
type Live = (CancellationToken, Arc<AtomicU64>);

/// The live tasks.
static TASKS: LazyLock<Mutex<HashMap<u64, Live>>> = LazyLock::new(Default::default);
static NEXT: AtomicU64 = AtomicU64::new(1);

fn tasks() -> std::sync::MutexGuard<'static, HashMap<u64, Live>> {
    TASKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running task; dropping it (the task ended, or was aborted) stops its calls.
#[derive(Debug)]
pub struct Task {
    /// Its tag.
    pub tag: TaskTag,
    token: CancellationToken,
}

impl Task {
    /// A new task with a fresh tag; the rows its calls are made for are added to `rows`.
    pub fn start(rows: Arc<AtomicU64>) -> Self {
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let token = CancellationToken::new();
        tasks().insert(id, (token.clone(), rows));
        Task { tag: TaskTag { id }, token }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        tasks().remove(&self.tag.id);
        self.token.cancel();
    }
}

/// The token of the task `options` belong to, when it runs under a tag.
pub(crate) fn token_of(options: &ConfigOptions) -> Option<CancellationToken> {
    let id = options.extensions.get::<TaskTag>()?.id;
    // A tag whose task is gone: the task ended; calls made now are stray.
    Some(tasks().get(&id).map(|(t, _)| t.clone()).unwrap_or_else(|| {
        let t = CancellationToken::new();
        t.cancel();
        t
    }))
}

/// Counts `rows` called for the task `options` belong to (when they run under a tag).
pub(crate) fn count_called(options: &ConfigOptions, rows: u64) {
    let Some(tag) = options.extensions.get::<TaskTag>() else { return };
    if let Some((_, called)) = tasks().get(&tag.id) {
        called.fetch_add(rows, Ordering::Relaxed);
    }
}

/// Stops the calls of every live task; how many there were. For an executor whose scheduler is
/// gone: their results could no longer be delivered, and their calls would be paid for nothing.
pub(crate) fn cancel_all() -> usize {
    let live = tasks();
    for (token, _) in live.values() {
        token.cancel();
    }
    live.len()
}
