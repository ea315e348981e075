//! `local/…` models — sentence embeddings run in this process with candle (the `local`
//! feature) — registered with the providers' connectors the first time [`crate::connect`] runs,
//! so that every front end that links them serves them: `weir run`, `weir sql`, cluster
//! executors and Python alike.

use async_trait::async_trait;
use std::sync::Arc;
use weir_providers::{Connect, Endpoint, ModelSpec, Provider, ProviderError, ProviderOptions, Task};

/// Loads a local model for each `local/` model connected.
struct LocalConnector;

#[async_trait]
impl Connect for LocalConnector {
    async fn connect(
        &self,
        spec: &ModelSpec,
        options: &ProviderOptions,
        env: &(dyn for<'s> Fn(&'s str) -> Option<String> + Sync),
    ) -> Result<Endpoint, ProviderError> {
        if options.task != Task::Embed {
            return Err(ProviderError::Config(format!(
                "{spec} is a sentence-embedding model: run it with --task embed (in SQL, llm_embed)"
            )));
        }
        let handler = weir_local::connect(&spec.model, options.max_batch, env)
            .map_err(|e| ProviderError::Config(e.to_string()))?;
        Ok(Endpoint { handler, resident: None })
    }
}

/// Serves `local/` models in this process, unless something else already does.
pub(crate) fn ensure() {
    weir_providers::connectors::register_default(Provider::Local, || Arc::new(LocalConnector));
}
