//! `sim/` models: weir's simulator started in this process on loopback, answering as the
//! Gemini API does (no key, no network). Registered with `weir_providers`' connectors by
//! [`install`] — or, with the default scenario, the first time [`crate::connect`] runs.

use async_trait::async_trait;
use std::sync::Arc;
use weir_core::ModelHandler;
use weir_providers::embed::EmbedHandler;
use weir_providers::{
    connectors, Connect, Endpoint, GeminiHandler, ModelSpec, Provider, ProviderError, ProviderOptions, Resident,
    Secret, Task,
};
use weir_sim::{SimConfig, SimServer};

/// What the in-process simulator is called in messages (its port changes from run to run).
const NAME: &str = "the in-process simulator";

/// Starts a simulator with one scenario for each `sim/` model connected.
struct SimConnector {
    config: SimConfig,
}

#[async_trait]
impl Connect for SimConnector {
    async fn connect(
        &self,
        spec: &ModelSpec,
        options: &ProviderOptions,
        _env: &(dyn for<'s> Fn(&'s str) -> Option<String> + Sync),
    ) -> Result<Endpoint, ProviderError> {
        if options.base_url.is_some() {
            return Err(ProviderError::Config(
                "--base-url does not apply to sim/ models; to use a running `weir sim`, use gemini/<model> or \
                 openai/<model> with --base-url"
                    .into(),
            ));
        }
        let sim = SimServer::start(self.config.clone(), ([127, 0, 0, 1], 0).into())
            .await
            .map_err(|e| ProviderError::Start(e.to_string()))?;
        let base = reqwest::Url::parse(&sim.url()).map_err(|e| ProviderError::Start(e.to_string()))?;
        let client = weir_providers::http::client()?;
        let key = Secret::new("sim".into());
        let handler: Arc<dyn ModelHandler> = match options.task {
            Task::Embed => {
                Arc::new(EmbedHandler::gemini(client, &base, spec, Some(key), options.max_batch).named(NAME))
            }
            Task::Generate => {
                Arc::new(GeminiHandler::new(client, &base, &spec.model, Some(key), spec.to_string()).named(NAME))
            }
        };
        Ok(Endpoint { handler, resident: Some(Resident::new(async move { sim.shutdown().await })) })
    }
}

/// Serves `sim/` models in this process with `config` (a `--sim-config` scenario), or the
/// default scenario: fast and fault-free.
pub fn install(config: Option<SimConfig>) {
    connectors::register(Provider::Sim, Arc::new(SimConnector { config: config.unwrap_or_default() }));
}

/// Installs the default scenario unless one is installed.
pub(crate) fn ensure() {
    connectors::register_default(Provider::Sim, || Arc::new(SimConnector { config: SimConfig::default() }));
}
