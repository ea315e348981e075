//! Providers served by code this library does not hold: `sim/` (weir's simulator, started in
//! the process) and `local/` (models run in the process). A program that links one registers
//! it ([`register`]), and [`crate::connect`] uses it; so a client build (the Python wheel, a
//! library user) carries neither a test server nor a model runtime it does not ask for.

use async_trait::async_trait;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use crate::{Endpoint, ModelSpec, Provider, ProviderError, ProviderOptions};

/// Sets up a client for a registered provider's model.
#[async_trait]
pub trait Connect: Send + Sync {
    /// The endpoint for `spec`, as [`crate::connect`] would make it.
    async fn connect(
        &self,
        spec: &ModelSpec,
        options: &ProviderOptions,
        env: &(dyn for<'s> Fn(&'s str) -> Option<String> + Sync),
    ) -> Result<Endpoint, ProviderError>;
}

/// The registered connectors, by provider (a handful at most: a list).
static REGISTRY: Mutex<Vec<(Provider, Arc<dyn Connect>)>> = Mutex::new(Vec::new());

/// Serves `provider`'s models with `connector` from now on, in this whole process (replacing
/// one registered before).
pub fn register(provider: Provider, connector: Arc<dyn Connect>) {
    let mut registry = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    registry.retain(|(p, _)| *p != provider);
    registry.push((provider, connector));
}

/// Serves `provider`'s models with the connector `make` builds, unless one is registered
/// already (a program's own, such as a `--sim-config` scenario): checked and registered under
/// one lock, so that a default never replaces a connector registered at the same moment.
pub fn register_default(provider: Provider, make: impl FnOnce() -> Arc<dyn Connect>) {
    let mut registry = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    if !registry.iter().any(|(p, _)| *p == provider) {
        registry.push((provider, make()));
    }
}

/// The connector of `provider`, if one is registered.
pub(crate) fn find(provider: Provider) -> Option<Arc<dyn Connect>> {
    let registry = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    registry.iter().find(|(p, _)| *p == provider).map(|(_, c)| c.clone())
}

/// Why `spec` cannot be served by this program.
pub(crate) fn missing(spec: &ModelSpec) -> ProviderError {
    ProviderError::Config(match spec.provider {
        Provider::Local => format!(
            "{spec}: local models run inside the weir binary built with its `local` feature \
             (cargo build --release -p weir --features local)"
        ),
        _ => format!("{spec}: this program was built without weir's simulator, which serves sim/ models"),
    })
}

/// Something an endpoint runs in this process (the simulator's server) and how to stop it:
/// awaiting [`Resident::shutdown`] stops it cleanly; dropping it stops it abruptly.
pub struct Resident(Pin<Box<dyn Future<Output = ()> + Send>>);

impl Resident {
    /// A resident stopped by running `stop`.
    pub fn new(stop: impl Future<Output = ()> + Send + 'static) -> Self {
        Self(Box::pin(stop))
    }

    /// Stops it.
    pub async fn shutdown(self) {
        self.0.await
    }
}

impl std::fmt::Debug for Resident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resident")
    }
}
