//! Which driver answers a record: the run's model, or the model a record names in its model
//! field, each through this process's one endpoint for that model (its throttle, health and
//! counters live in the [`Runtime`]).

use std::collections::HashMap;
use std::sync::Arc;
use weir_core::{Driver, ErrorKind, Failure, Outcome, Record, ResponseCache, StopReason};
use weir_providers::{ModelSpec, ProviderError};

use crate::Runtime;

/// Routes records to drivers. A run has one driver per model, made the first time a record asks
/// for that model, so its stop rules (an interrupt, a dead endpoint) hold for the whole run.
pub struct Router {
    runtime: Option<Arc<Runtime>>,
    default: Arc<Driver>,
    /// The record field naming a record's own model (`--model-field`).
    field: Option<String>,
    embed: bool,
    /// The response cache every driver uses.
    cache: Option<Arc<dyn ResponseCache>>,
    others: tokio::sync::Mutex<HashMap<String, Arc<Driver>>>,
}

impl Router {
    /// Every record to `driver` (a request of rows that all share a model and call).
    pub fn fixed(driver: Arc<Driver>) -> Self {
        Self { runtime: None, default: driver, field: None, embed: false, cache: None, others: Default::default() }
    }

    /// Records to `model`, or to the model their `field` names, through `runtime` (with its
    /// driver settings), answered from `cache` where it can. Connects `model` now: `Err` says
    /// why it cannot be used, before any record is read.
    pub async fn new(
        runtime: Arc<Runtime>,
        model: &ModelSpec,
        field: Option<String>,
        embed: bool,
        cache: Option<Arc<dyn ResponseCache>>,
    ) -> Result<Self, ProviderError> {
        let driver = runtime.driver(model, embed, runtime.settings().driver.clone(), cache.clone()).await?;
        Ok(Self { runtime: Some(runtime), default: Arc::new(driver), field, embed, cache, others: Default::default() })
    }

    /// The driver of the run's own model.
    pub fn default_driver(&self) -> &Arc<Driver> {
        &self.default
    }

    /// The driver for `record`, or why its model field cannot be used.
    pub async fn driver_for(&self, record: &Record) -> Result<Arc<Driver>, String> {
        let (Some(field), Some(runtime)) = (&self.field, &self.runtime) else { return Ok(self.default.clone()) };
        let name = match record.input.get(field) {
            None | Some(serde_json::Value::Null) => return Ok(self.default.clone()),
            Some(serde_json::Value::String(s)) => s.trim().to_string(),
            Some(_) => return Err(format!("line {}: model field '{field}' is not a string", record.line)),
        };
        let spec: ModelSpec = name.parse().map_err(|e: ProviderError| {
            format!("line {}: model field '{field}': {}", record.line, e.to_string().replacen("--model ", "", 1))
        })?;
        if spec.to_string() == self.default.model_id() {
            return Ok(self.default.clone());
        }
        // Parameters the run was given that this model has no place for: the record's error,
        // not parameters dropped in silence (an `http/` model takes none).
        if let Some(why) = spec.refused_params(&runtime.settings().driver.params) {
            return Err(format!("line {}: model field '{field}': {why}", record.line));
        }
        let mut others = self.others.lock().await;
        if let Some(d) = others.get(&spec.to_string()) {
            return Ok(d.clone());
        }
        let driver = runtime
            .driver(&spec, self.embed, runtime.settings().driver.clone(), self.cache.clone())
            .await
            .map_err(|e| format!("line {}: model field '{field}': {e}", record.line))?;
        if self.default.is_stopped() {
            // Interrupted before this model was first needed.
            driver.stop(
                self.default
                    .stop_reason()
                    .unwrap_or(StopReason { kind: ErrorKind::Aborted, message: "stopped".into() }),
            );
        }
        let driver = Arc::new(driver);
        others.insert(spec.to_string(), driver.clone());
        Ok(driver)
    }

    /// The outcome of a record that ends without a call (a line that did not parse, a model
    /// field naming no usable model): counted as a failure of no model (`model="none"` at
    /// `/metrics`), not of the run's model, and in the run's totals.
    pub fn reject(&self, failure: Box<Failure>) -> Outcome {
        match &self.runtime {
            Some(runtime) => {
                runtime.unrouted().record_rejected(&failure);
                Outcome::Failure(failure)
            }
            None => self.default.reject(failure),
        }
    }

    /// Stops every model's driver (an interrupt): no new calls.
    pub fn stop(&self, reason: StopReason) {
        self.default.stop(reason.clone());
        if let Ok(others) = self.others.try_lock() {
            for d in others.values() {
                d.stop(reason.clone());
            }
        }
    }

    /// Why some model's driver stopped, if one did.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.default
            .stop_reason()
            .or_else(|| self.others.try_lock().ok().and_then(|o| o.values().find_map(|d| d.stop_reason())))
    }
}
