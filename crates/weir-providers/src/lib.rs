//! weir-providers: clients of the model endpoints weir talks to.
//!
//! A model is named `provider/model`, the convention of LiteLLM:
//! - `openai/<model>`: any OpenAI-compatible server (`--base-url` or `OPENAI_BASE_URL`; key from
//!   `OPENAI_API_KEY`, optional for local servers);
//! - `gemini/<model>`: the Gemini API (key from `GEMINI_API_KEY` or `GOOGLE_API_KEY`;
//!   `--base-url` replaces the host);
//! - `vertex_ai/<model>`: Gemini on Vertex AI, with Google credentials found as Google's SDKs
//!   find them (see [`google_auth`]); project and location from the options or
//!   `GOOGLE_CLOUD_PROJECT` / `GOOGLE_CLOUD_LOCATION` (default `us-central1`);
//! - `vertex_endpoint/<endpoint-id>`: a model deployed to a Vertex AI endpoint (Gemma, Llama,
//!   any Model Garden or custom container), same credentials, project and location; called
//!   through `:predict` with many records per request (see [`vertex_endpoint`]), or through the
//!   endpoint's OpenAI-compatible route or `:rawPredict` ([`EndpointFormat`]);
//! - `http/<name>`: any JSON-over-HTTP API, described in a small TOML file (see [`webapi`]);
//! - `sim/<name>`: a simulator started in-process on loopback; no key, no network;
//! - `local/<model>`: a model run in the process.
//!
//! `sim/` and `local/` are served by connectors that the program linking them registers
//! ([`connectors`]): this library holds neither.
//!
//! Each client classifies its provider's errors once, into `weir_core::ModelError`s with a kind
//! and a retry hint; the engine never looks at a status code.

#![warn(missing_docs)]

pub mod anthropic;
pub mod connectors;
pub mod embed;
pub mod gemini;
pub mod google_auth;
pub mod http;
pub mod jobs;
pub mod openai;
pub mod vertex_endpoint;
pub mod webapi;

use std::str::FromStr;
use std::sync::Arc;
use weir_core::ModelHandler;

pub use connectors::{Connect, Resident};
pub use gemini::GeminiHandler;
pub use http::Secret;
pub use openai::OpenAiHandler;

/// Every environment variable a provider may read (captured once by a front end that connects
/// models lazily, e.g. per record).
pub const ENV_VARS: &[&str] = &[
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "GOOGLE_CLOUD_PROJECT",
    "GOOGLE_CLOUD_LOCATION",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "CLOUDSDK_CONFIG",
    "HOME",
    "GCE_METADATA_HOST",
    "WEIR_MODELS",
    webapi::MODELS_VAR,
];

/// A provider that cannot be set up as asked; the message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The model name, base URL or credentials are wrong or missing (a usage error).
    #[error("{0}")]
    Config(String),
    /// The in-process simulator could not start.
    #[error("cannot start the simulator: {0}")]
    Start(String),
}

/// The base URL a provider's client takes from the environment when `--base-url` is not given
/// (`OPENAI_BASE_URL`, `ANTHROPIC_BASE_URL`), if it takes one and it is set: where a run's calls
/// and batch jobs go, which a run records as its own. (Recorded as the provider's own, a run
/// resumed with the variable pointed elsewhere submitted its records again there.)
pub fn base_url_from_env(provider: Provider, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Option<String> {
    let var = match provider {
        Provider::OpenAi => "OPENAI_BASE_URL",
        Provider::Anthropic => "ANTHROPIC_BASE_URL",
        _ => return None,
    };
    env(var).filter(|v| !v.trim().is_empty())
}

/// Which provider a model id names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// Any OpenAI-compatible server.
    OpenAi,
    /// Anthropic's Messages API (Claude).
    Anthropic,
    /// The Gemini API.
    Gemini,
    /// Gemini on Vertex AI.
    Vertex,
    /// A model deployed to a Vertex AI endpoint.
    VertexEndpoint,
    /// Any JSON-over-HTTP API, as a models file describes it.
    Http,
    /// The in-process simulator.
    Sim,
    /// A model run inside weir's process (the `local` feature of the `weir` binary).
    Local,
}

/// A parsed `provider/model`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// The provider.
    pub provider: Provider,
    /// The model name as the provider knows it (may contain `/`).
    pub model: String,
}

impl ModelSpec {
    /// Whether calls for this model carry many records each (so that batching flags apply):
    /// embeddings (`task` embed), and `vertex_endpoint/` models called through `:predict` with
    /// raw instances. The providers know this, not the front ends.
    pub fn takes_batches(&self, task: Task, format: EndpointFormat) -> bool {
        task == Task::Embed || (self.provider == Provider::VertexEndpoint && format == EndpointFormat::Raw)
    }

    /// Why `params` cannot be sent to this model, found before any call (sent, every request
    /// would be refused): a parameter Anthropic's Messages API has no place for, or any
    /// parameter for an `http/` model, whose body the models file writes.
    pub fn refused_params(&self, params: &weir_core::GenParams) -> Option<String> {
        if self.provider == Provider::Http && *params != weir_core::GenParams::default() {
            return Some(format!(
                "--param does not apply to {self}: an http/ model's request is its body in the models file; write the \
                 API's own parameters there"
            ));
        }
        let claude = self.is_claude();
        let unknown = [
            ("seed", params.seed.is_some()),
            ("presence_penalty", params.presence_penalty.is_some()),
            ("frequency_penalty", params.frequency_penalty.is_some()),
        ];
        match unknown.iter().find(|(_, set)| *set) {
            Some((name, _)) if claude => {
                Some(format!("--param {name}: Anthropic's Messages API (Claude) has no such parameter; leave it out"))
            }
            _ => None,
        }
    }

    /// Claude, called through Anthropic's Messages API (its own, or Vertex AI's publisher
    /// `anthropic` model), whose parameters and media types are the API's.
    fn is_claude(&self) -> bool {
        self.provider == Provider::Anthropic || (self.provider == Provider::Vertex && self.model.starts_with("claude"))
    }

    /// Why a part of media type `mime` cannot go to this model, found before any call: Claude
    /// (Anthropic's Messages API, also on Vertex AI) takes images and PDF or plain-text
    /// documents only. Other providers' refusals come from the server.
    pub fn refused_media_type(&self, mime: &str) -> Option<String> {
        (self.is_claude() && !anthropic::takes_media_type(mime)).then(|| {
            format!(
                "{mime} is not a type Anthropic's Messages API (Claude) takes (images: JPEG, PNG, GIF, WebP; \
                 documents: PDF, plain text)"
            )
        })
    }

    /// Whether a request for this model can carry a response schema or MIME type: not a
    /// `vertex_endpoint/` `:predict` instance (raw or chat), whose body has no place for one.
    pub fn takes_response_schema(&self, format: EndpointFormat) -> bool {
        !(self.provider == Provider::VertexEndpoint && matches!(format, EndpointFormat::Raw | EndpointFormat::Chat))
    }
}

impl FromStr for ModelSpec {
    type Err = ProviderError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let usage = || {
            ProviderError::Config(format!(
                "--model {s}: expected provider/model, e.g. sim/demo, openai/gpt-4o-mini, gemini/gemini-2.5-flash"
            ))
        };
        let (provider, model) = s.split_once('/').ok_or_else(usage)?;
        let (provider, model) = (provider.trim(), model.trim());
        if model.trim().is_empty() {
            return Err(usage());
        }
        let provider = match provider {
            "openai" => Provider::OpenAi,
            "anthropic" => Provider::Anthropic,
            "gemini" => Provider::Gemini,
            "vertex_ai" => Provider::Vertex,
            "vertex_endpoint" => Provider::VertexEndpoint,
            "http" => Provider::Http,
            "sim" => Provider::Sim,
            "local" => Provider::Local,
            other => {
                return Err(ProviderError::Config(format!(
                    "--model {s}: unknown provider '{other}'; known providers: openai, anthropic, gemini, vertex_ai, vertex_endpoint, http, sim, local"
                )))
            }
        };
        if provider == Provider::VertexEndpoint && model.contains('/') {
            return Err(ProviderError::Config(format!(
                "--model {s}: name the endpoint by its id alone (the number in …/endpoints/ID), e.g. \
                 vertex_endpoint/1234567890; the project and location come from --project and --location"
            )));
        }
        // Model names go into URLs (Gemini, Vertex AI): a name must not be able to walk to
        // another path on the provider's host with the caller's key (`%2e%2e`, `..`), or cut
        // the URL short (`?`, `#`).
        let walks = model.split('/').any(|seg| seg.is_empty() || seg == "." || seg == "..");
        if walks || model.chars().any(|c| c.is_whitespace() || c.is_control() || "%?#\\".contains(c)) {
            return Err(ProviderError::Config(format!(
                "--model {s}: a model name may not hold '%', '?', '#', '\\', spaces, empty, '.' or '..' parts"
            )));
        }
        if provider == Provider::Http && !model.chars().all(|c| c.is_ascii_alphanumeric() || "-_".contains(c)) {
            return Err(ProviderError::Config(format!(
                "--model {s}: an http model is named by its [models.NAME] table: letters, digits, '-' and '_'"
            )));
        }
        if provider == Provider::Sim && model.contains('/') {
            return Err(ProviderError::Config(format!(
                "--model {s}: a simulator model is one name without '/', e.g. sim/demo"
            )));
        }
        Ok(Self { provider, model: model.to_string() })
    }
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = match self.provider {
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
            Provider::Gemini => "gemini",
            Provider::Vertex => "vertex_ai",
            Provider::VertexEndpoint => "vertex_endpoint",
            Provider::Http => "http",
            Provider::Sim => "sim",
            Provider::Local => "local",
        };
        write!(f, "{p}/{}", self.model)
    }
}

/// Options that shape the connection.
#[derive(Debug, Clone, Default)]
pub struct ProviderOptions {
    /// Replaces the provider's default base URL.
    pub base_url: Option<String>,
    /// Google Cloud project (`vertex_ai/…`); default `GOOGLE_CLOUD_PROJECT`.
    pub project: Option<String>,
    /// Google Cloud location (`vertex_ai/…`); default `GOOGLE_CLOUD_LOCATION`, else `us-central1`.
    pub location: Option<String>,
    /// How `vertex_endpoint/…` models are called.
    pub endpoint_format: EndpointFormat,
    /// What the model is asked for: text, or an embedding of each prompt.
    pub task: Task,
    /// Records per call at most, for endpoints that take many (`vertex_endpoint/…` raw
    /// `:predict`); default [`DEFAULT_PREDICT_BATCH`].
    pub max_batch: Option<usize>,
    /// The environment variable that holds this endpoint's credential instead of the
    /// provider's usual one ([`KEY_VARS`]): one endpoint of a pool called with another key,
    /// or another service account's credentials file for Vertex AI.
    pub key_var: Option<String>,
    /// The file describing `http/<name>` models (`--http-models`; default `WEIR_HTTP_MODELS`).
    pub http_models: Option<String>,
}

/// The environment variables a provider reads its credential from, which
/// [`ProviderOptions::key_var`] stands in for.
pub const KEY_VARS: &[&str] =
    &["GEMINI_API_KEY", "GOOGLE_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GOOGLE_APPLICATION_CREDENTIALS"];

/// What a model is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Task {
    /// Text generated from the prompt.
    #[default]
    Generate,
    /// A vector for each prompt, from an embedding model (many prompts per call).
    Embed,
}

/// Instances per `:predict` call by default: large enough that a requests-per-minute quota
/// goes far, small enough that one slow instance does not hold many others.
pub const DEFAULT_PREDICT_BATCH: usize = 16;

/// How a `vertex_endpoint/…` model is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointFormat {
    /// `:predict` with Model Garden vLLM's raw prompt instances, many per call.
    #[default]
    Raw,
    /// `:predict` with one `@requestFormat: chatCompletions` instance per call.
    Chat,
    /// The endpoint's OpenAI-compatible route, `…/endpoints/ID/chat/completions` (v1beta1).
    OpenAi,
    /// `:rawPredict` with an OpenAI chat-completions body, for containers that take one.
    RawPredict,
}

impl FromStr for EndpointFormat {
    type Err = ProviderError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "raw" => EndpointFormat::Raw,
            "chat" => EndpointFormat::Chat,
            "openai" => EndpointFormat::OpenAi,
            "rawpredict" => EndpointFormat::RawPredict,
            other => {
                return Err(ProviderError::Config(format!(
                    "--endpoint-format {other}: expected raw, chat, openai or rawpredict"
                )))
            }
        })
    }
}

/// A project or location name: letters, digits, `-`, `_` and `.`, as Google's are.
fn check_name(what: &str, v: &str) -> Result<String, ProviderError> {
    let v = v.trim();
    // Dots alone would change the URL's path (`..`), not name anything.
    if v.is_empty()
        || v.chars().all(|c| c == '.')
        || !v.chars().all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
    {
        return Err(ProviderError::Config(format!(
            "{what} '{v}': expected a Google Cloud {what} name (letters, digits, '-', '_', '.', '@')"
        )));
    }
    Ok(v.to_string())
}

/// Where Vertex AI calls go: the project and location, the host, and the credentials.
struct VertexSite {
    project: String,
    location: String,
    base: reqwest::Url,
    tokens: Arc<google_auth::TokenSource>,
}

impl VertexSite {
    /// Project and location from the options or the environment (as google-genai finds them),
    /// the regional host (or `--base-url`, which replaces scheme and host for every route), and
    /// Application Default Credentials.
    fn find(options: &ProviderOptions, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Result<Self, ProviderError> {
        let nonempty = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        let project = options.project.clone().or_else(|| nonempty("GOOGLE_CLOUD_PROJECT")).ok_or_else(|| {
            ProviderError::Config(
                "Vertex AI: set --project or GOOGLE_CLOUD_PROJECT to your Google Cloud project".into(),
            )
        })?;
        let project = check_name("project", &project)?;
        let location = options.location.clone().or_else(|| nonempty("GOOGLE_CLOUD_LOCATION"));
        let location = check_name("location", location.as_deref().unwrap_or("us-central1"))?;
        // `global` has no regional host.
        let host = match location.as_str() {
            "global" => "https://aiplatform.googleapis.com".to_string(),
            l => format!("https://{l}-aiplatform.googleapis.com"),
        };
        let base = http::check_base_url(options.base_url.as_deref().unwrap_or(&host))?;
        let (credentials, origin) = google_auth::Credentials::discover(env)?;
        tracing::debug!("Google credentials from {origin}");
        let tokens = Arc::new(google_auth::TokenSource::new(credentials, http::client()?));
        Ok(Self { project, location, base, tokens })
    }

    /// `{base}/{version}/projects/{project}/locations/{location}`.
    fn root(&self, version: &str) -> String {
        format!(
            "{}/{version}/projects/{}/locations/{}",
            self.base.as_str().trim_end_matches('/'),
            self.project,
            self.location
        )
    }
}

/// A connected provider: the handler, and what it runs in this process, if anything.
pub struct Endpoint {
    /// The client.
    pub handler: Arc<dyn ModelHandler>,
    /// A server the endpoint runs in this process (the simulator behind `sim/…` models); shut
    /// it down after the run.
    pub resident: Option<Resident>,
}

/// A TOML file's error as `line N: what is wrong`: the line's number, not the snippet of it the
/// error would show, so that a key written into the file is not repeated on the terminal.
pub fn toml_error(text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(at) => format!("line {}: {}", text[..at.start.min(text.len())].matches('\n').count() + 1, e.message()),
        None => e.message().to_string(),
    }
}

/// The key in the variable `var` of `env`: none when it is unset or blank. Whitespace around
/// it (the newline a key file ends with) is dropped. What is left must be printable ASCII, as
/// every provider's keys are: a space, a control character or a non-ASCII letter inside is a
/// mistake in setting it, refused before any call (each call would otherwise fail alone, or
/// send the text as it is), and the key is not repeated in the message.
fn key_in(env: &(dyn Fn(&str) -> Option<String> + Sync), var: &str) -> Result<Option<Secret>, ProviderError> {
    key_named(env, var, var)
}

/// As [`key_in`], naming the variable `var_shown` in messages (an endpoint's own `key_env`, which
/// `env` reads in place of the provider's variable).
fn key_named(
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    var: &str,
    var_shown: &str,
) -> Result<Option<Secret>, ProviderError> {
    let Some(value) = env(var) else { return Ok(None) };
    let key = value.trim();
    if key.is_empty() {
        return Ok(None);
    }
    if let Some((at, c)) = unprintable(key, false) {
        let what = match c {
            ' ' | '\t' => "a space",
            c if c.is_control() => "a control character",
            _ => "a non-ASCII character",
        };
        return Err(ProviderError::Config(format!(
            "{var_shown} holds {what} at character {at} of {}; a key is printable ASCII: check how the variable was set",
            key.chars().count()
        )));
    }
    Ok(Some(Secret::new(key.to_string())))
}

/// The first character of a credential that is not printable ASCII (spaces allowed when
/// `spaces`), with its place counted from 1, for a message that names where it is rather than
/// what the credential holds.
pub(crate) fn unprintable(text: &str, spaces: bool) -> Option<(usize, char)> {
    text.chars().enumerate().find(|(_, c)| !(c.is_ascii_graphic() || spaces && *c == ' ')).map(|(i, c)| (i + 1, c))
}

/// The key of the Gemini API (or `None` on loopback), as the generation client finds it.
fn gemini_key(
    base: &reqwest::Url,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Option<Secret>, ProviderError> {
    let key = match key_in(env, "GEMINI_API_KEY")? {
        Some(k) => Some(k),
        None => key_in(env, "GOOGLE_API_KEY")?,
    };
    if key.is_none() && !http::is_loopback(base) {
        return Err(ProviderError::Config(
            "gemini: set GEMINI_API_KEY (or GOOGLE_API_KEY) to your Gemini API key".into(),
        ));
    }
    Ok(key)
}

/// The base URL and key of an OpenAI-compatible server, as the generation client finds them.
fn openai_site(
    options: &ProviderOptions,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<(reqwest::Url, Option<Secret>), ProviderError> {
    keyed_site(options, env, (Provider::OpenAi, "https://api.openai.com/v1", "OPENAI_API_KEY"), || {
        "openai: set OPENAI_API_KEY, or point --base-url at your OpenAI-compatible server"
    })
}

/// The Messages API's root and key: `--base-url`, else `ANTHROPIC_BASE_URL`, else Anthropic's;
/// `ANTHROPIC_API_KEY`, required for Anthropic's own servers.
fn anthropic_site(
    options: &ProviderOptions,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<(reqwest::Url, Option<Secret>), ProviderError> {
    keyed_site(options, env, (Provider::Anthropic, "https://api.anthropic.com", "ANTHROPIC_API_KEY"), || {
        "anthropic: set ANTHROPIC_API_KEY, or point --base-url at a server that speaks the Messages API"
    })
}

/// A provider's base URL and key: `--base-url`, else the provider's variable
/// ([`base_url_from_env`]), else `default`; the key from `key_var`, required (`missing` says so)
/// when the base is the provider's own host.
fn keyed_site(
    options: &ProviderOptions,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    (provider, default, key_var): (Provider, &str, &str),
    missing: impl Fn() -> &'static str,
) -> Result<(reqwest::Url, Option<Secret>), ProviderError> {
    let base = options.base_url.clone().or_else(|| base_url_from_env(provider, env)).unwrap_or_else(|| default.into());
    let base = http::check_base_url(&base)?;
    let key = key_named(env, key_var, options.key_var.as_deref().unwrap_or(key_var))?;
    let own = reqwest::Url::parse(default).ok().and_then(|u| u.host_str().map(str::to_string));
    if key.is_none() && base.host_str().is_some() && base.host_str() == own.as_deref() {
        return Err(ProviderError::Config(missing().into()));
    }
    Ok((base, key))
}

/// Sets up an embedding client for `spec` (`--task embed`).
async fn connect_embed(
    spec: &ModelSpec,
    options: &ProviderOptions,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    client: reqwest::Client,
) -> Result<Endpoint, ProviderError> {
    use embed::{default_batch, EmbedApi, EmbedHandler};
    let make = |api, url: String, credential| {
        let batch = options.max_batch.unwrap_or_else(|| default_batch(api));
        EmbedHandler::new(client.clone(), api, url, spec.model.clone(), spec.to_string(), credential, batch)
    };
    let trim = |u: &reqwest::Url| u.as_str().trim_end_matches('/').to_string();
    let handler = match spec.provider {
        Provider::OpenAi => {
            let (base, key) = openai_site(options, env)?;
            let credential = key.map_or(http::Credential::None, |k| http::Credential::Key(k, None));
            make(EmbedApi::OpenAi, format!("{}/embeddings", trim(&base)), credential)
        }
        Provider::Gemini => {
            let base = options.base_url.clone().unwrap_or_else(|| "https://generativelanguage.googleapis.com".into());
            let base = http::check_base_url(&base)?;
            EmbedHandler::gemini(client.clone(), &base, spec, gemini_key(&base, env)?, options.max_batch)
        }
        Provider::Vertex => {
            let site = VertexSite::find(options, env)?;
            check_name("model", &spec.model)?;
            let url = format!("{}/publishers/google/models/{}:predict", site.root("v1"), spec.model);
            make(EmbedApi::Vertex, url, http::Credential::Tokens(site.tokens.clone()))
        }
        Provider::Anthropic | Provider::Http => {
            return Err(ProviderError::Config(format!(
                "--task embed: {spec} has no embeddings weir knows how to ask for; use openai/, gemini/, vertex_ai/ or \
                 local/ models"
            )))
        }
        Provider::VertexEndpoint => {
            return Err(ProviderError::Config(format!(
                "--task embed: {spec} is a deployed endpoint; for Vertex AI's embedding models use \
                 vertex_ai/<model> (e.g. vertex_ai/text-embedding-005)"
            )))
        }
        Provider::Local | Provider::Sim => unreachable!("served by registered connectors (see connect)"),
    };
    Ok(Endpoint { handler: Arc::new(handler), resident: None })
}

/// Variable `k` of `env`, where an endpoint with a key of its own (`options.key_var`) reads
/// that in place of the provider's usual key variables.
fn keyed_env(options: &ProviderOptions, env: &(dyn Fn(&str) -> Option<String> + Sync), k: &str) -> Option<String> {
    match &options.key_var {
        Some(var) if KEY_VARS.contains(&k) => env(var),
        _ => env(k),
    }
}

/// Sets up the batch-job client for `spec` (`weir run --mode batch`), with the base URL and
/// key found as for online calls. `max_requests` makes jobs smaller than the provider allows.
pub fn connect_jobs(
    spec: &ModelSpec,
    options: &ProviderOptions,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    max_requests: Option<usize>,
    staging: Option<Arc<dyn weir_core::JobStaging>>,
) -> Result<Arc<dyn weir_core::JobApi>, ProviderError> {
    let keyed = |k: &str| keyed_env(options, env, k);
    let env: &(dyn Fn(&str) -> Option<String> + Sync) = &keyed;
    let client = http::job_client_with(Default::default())?;
    let limit = |mut l: weir_core::JobLimits| {
        // Only ever lower than the provider's own limit.
        if let Some(n) = max_requests {
            l.max_lines = n.clamp(1, l.max_lines);
        }
        l
    };
    if options.task == Task::Embed && !matches!(spec.provider, Provider::OpenAi | Provider::Vertex) {
        return Err(ProviderError::Config(format!(
            "--mode batch with --task embed: embeddings go through batch jobs for openai/ models (the OpenAI Batch \
             API's /v1/embeddings) and vertex_ai/ text-embedding models; {spec} embeds online only"
        )));
    }
    match spec.provider {
        Provider::OpenAi => {
            let (base, key) = openai_site(options, env)?;
            let jobs = jobs::OpenAiJobs::new(client, &base, &spec.model, key).with_limits(limit(jobs::OPENAI_LIMITS));
            Ok(Arc::new(if options.task == Task::Embed { jobs.embeddings() } else { jobs }))
        }
        Provider::Gemini => {
            let base = options.base_url.clone().unwrap_or_else(|| "https://generativelanguage.googleapis.com".into());
            let base = http::check_base_url(&base)?;
            let key = gemini_key(&base, env)?;
            Ok(Arc::new(jobs::GeminiJobs::new(client, &base, &spec.model, key).with_limits(limit(jobs::GEMINI_LIMITS))))
        }
        Provider::Sim => Err(ProviderError::Config(
            "--mode batch: the built-in sim/ model answers online only; start `weir sim` and run gemini/<model> or \
             openai/<model> with --base-url http://127.0.0.1:PORT (its batch APIs are served there)"
                .into(),
        )),
        Provider::Vertex if spec.model.starts_with("claude") => Err(ProviderError::Config(format!(
            "--mode batch: {spec}: weir runs Claude's batches through Anthropic's Message Batches (anthropic/ models); \
             Claude on Vertex AI runs --mode online"
        ))),
        Provider::Vertex => {
            let Some(staging) = staging else {
                return Err(ProviderError::Config(
                    "--mode batch: Vertex AI reads a job's input from Cloud Storage: give --job-bucket \
                     gs://BUCKET/PREFIX (weir writes each job's input there, and Vertex AI its output)"
                        .into(),
                ));
            };
            let site = VertexSite::find(options, env)?;
            check_name("model", &spec.model)?;
            let credential = http::Credential::Tokens(site.tokens.clone());
            let jobs = jobs::VertexJobs::new(client, site.root("v1"), &spec.model, credential, staging);
            Ok(Arc::new(match options.task == Task::Embed {
                true => jobs.embeddings().with_limits(limit(jobs::VERTEX_EMBED_LIMITS)),
                false => jobs.with_limits(limit(jobs::VERTEX_LIMITS)),
            }))
        }
        Provider::Anthropic => {
            let (base, key) = anthropic_site(options, env)?;
            let jobs = jobs::AnthropicJobs::new(anthropic::job_client()?, &base, &spec.model, key);
            Ok(Arc::new(jobs.with_limits(limit(jobs::ANTHROPIC_LIMITS))))
        }
        Provider::VertexEndpoint | Provider::Local | Provider::Http => Err(ProviderError::Config(format!(
            "--mode batch: {spec}: batch jobs are supported for openai/, anthropic/, gemini/ and vertex_ai/ models"
        ))),
    }
}

/// Sets up the client for `spec`. `env` reads environment variables (injected for tests).
pub async fn connect(
    spec: &ModelSpec,
    options: &ProviderOptions,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Endpoint, ProviderError> {
    let keyed = |k: &str| keyed_env(options, env, k);
    let env: &(dyn Fn(&str) -> Option<String> + Sync) = &keyed;
    if matches!(spec.provider, Provider::Sim | Provider::Local) {
        return match connectors::find(spec.provider) {
            Some(c) => c.connect(spec, options, env).await,
            None => Err(connectors::missing(spec)),
        };
    }
    let client = http::client()?;
    if options.task == Task::Embed {
        return connect_embed(spec, options, env, client).await;
    }
    match spec.provider {
        Provider::OpenAi => {
            let (base, key) = openai_site(options, env)?;
            Ok(Endpoint { handler: Arc::new(OpenAiHandler::new(client, &base, &spec.model, key)), resident: None })
        }
        Provider::Anthropic => {
            let (base, key) = anthropic_site(options, env)?;
            let handler = anthropic::AnthropicHandler::new(anthropic::client()?, &base, &spec.model, key);
            Ok(Endpoint { handler: Arc::new(handler), resident: None })
        }
        Provider::Gemini => {
            let base = options.base_url.clone().unwrap_or_else(|| "https://generativelanguage.googleapis.com".into());
            let base = http::check_base_url(&base)?;
            let key = gemini_key(&base, env)?;
            let handler = GeminiHandler::new(client, &base, &spec.model, key, spec.to_string());
            Ok(Endpoint { handler: Arc::new(handler), resident: None })
        }
        // Claude on Vertex AI: Anthropic's publisher models, through `:rawPredict`.
        Provider::Vertex if spec.model.starts_with("claude") => {
            let site = VertexSite::find(options, env)?;
            check_name("model", &spec.model)?;
            let root = format!("{}/publishers/anthropic/models/{}", site.root("v1"), spec.model);
            let credential = http::Credential::Tokens(site.tokens.clone());
            let handler = anthropic::AnthropicHandler::vertex(client, &root, credential, &spec.model, spec.to_string());
            Ok(Endpoint { handler: Arc::new(handler), resident: None })
        }
        Provider::Vertex => {
            let site = VertexSite::find(options, env)?;
            check_name("model", &spec.model)?;
            let root = format!("{}/publishers/google/models/{}", site.root("v1"), spec.model);
            let handler = GeminiHandler::vertex(client, root, site.tokens, spec.to_string());
            Ok(Endpoint { handler: Arc::new(handler), resident: None })
        }
        Provider::VertexEndpoint => {
            let site = VertexSite::find(options, env)?;
            let id = check_name("endpoint id", &spec.model)?;
            let credential = http::Credential::Tokens(site.tokens.clone());
            let handler: Arc<dyn ModelHandler> = match options.endpoint_format {
                f @ (EndpointFormat::Raw | EndpointFormat::Chat) => {
                    let format = match f {
                        EndpointFormat::Chat => vertex_endpoint::InstanceFormat::Chat,
                        _ => vertex_endpoint::InstanceFormat::Raw,
                    };
                    let url = format!("{}/endpoints/{id}:predict", site.root("v1"));
                    let max = options.max_batch.unwrap_or(DEFAULT_PREDICT_BATCH);
                    let model_id = spec.to_string();
                    Arc::new(vertex_endpoint::PredictHandler::new(client, url, model_id, credential, format, max))
                }
                // Google's guidance for the OpenAI-compatible route: the token as the key and
                // an empty model name (the endpoint serves one).
                EndpointFormat::OpenAi => {
                    let url = format!("{}/endpoints/{id}/chat/completions", site.root("v1beta1"));
                    Arc::new(OpenAiHandler::at(client, url, String::new(), spec.to_string(), credential))
                }
                EndpointFormat::RawPredict => {
                    let url = format!("{}/endpoints/{id}:rawPredict", site.root("v1"));
                    let stream_url = format!("{}/endpoints/{id}:streamRawPredict", site.root("v1"));
                    Arc::new(
                        OpenAiHandler::at(client, url, String::new(), spec.to_string(), credential)
                            .with_stream_url(stream_url),
                    )
                }
            };
            Ok(Endpoint { handler, resident: None })
        }
        Provider::Http => {
            let handler = webapi::connect(&spec.model, options.http_models.as_deref(), env)?;
            Ok(Endpoint { handler: Arc::new(handler), resident: None })
        }
        Provider::Local | Provider::Sim => unreachable!("served by registered connectors (see connect)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_specs() {
        let s: ModelSpec = "openai/meta-llama/Llama-3.1-8B".parse().unwrap();
        assert_eq!((s.provider, s.model.as_str()), (Provider::OpenAi, "meta-llama/Llama-3.1-8B"));
        assert_eq!(s.to_string(), "openai/meta-llama/Llama-3.1-8B");
        assert!("gpt-4".parse::<ModelSpec>().is_err());
        assert!("mistral/large".parse::<ModelSpec>().unwrap_err().to_string().contains("unknown provider"));
        assert_eq!("anthropic/claude-haiku-4-5".parse::<ModelSpec>().unwrap().provider, Provider::Anthropic);
        assert!("sim/".parse::<ModelSpec>().is_err());
        assert!("sim/a/b".parse::<ModelSpec>().unwrap_err().to_string().contains("without '/'"));
        for walking in ["gemini/%2e%2e/%2e%2e/x", "gemini/../x", "gemini//x", "gemini/a?b", "gemini/a#b", "openai/a b"]
        {
            assert!(walking.parse::<ModelSpec>().unwrap_err().to_string().contains("may not hold"), "{walking}");
        }
        assert!("openai/meta-llama/Llama-3.1-8B-Instruct".parse::<ModelSpec>().is_ok());
        assert!("vertex_ai/gemini-2.0-flash-001@default".parse::<ModelSpec>().is_ok());
    }

    #[tokio::test]
    async fn credentials_are_required_off_loopback() {
        let none = |_: &str| None;
        let gemini: ModelSpec = "gemini/gemini-2.5-flash".parse().unwrap();
        let e = connect(&gemini, &ProviderOptions::default(), &none).await.err().unwrap();
        assert!(e.to_string().contains("GEMINI_API_KEY"));
        let key = |k: &str| (k == "GOOGLE_API_KEY").then(|| "abc".to_string());
        assert!(connect(&gemini, &ProviderOptions::default(), &key).await.is_ok());
        let openai: ModelSpec = "openai/gpt-4o-mini".parse().unwrap();
        assert!(connect(&openai, &ProviderOptions::default(), &none).await.is_err());
        let local = ProviderOptions { base_url: Some("http://127.0.0.1:9/v1".into()), ..Default::default() };
        assert!(connect(&openai, &local, &none).await.is_ok());
        let remote_http = ProviderOptions { base_url: Some("http://example.com/v1".into()), ..Default::default() };
        assert!(connect(&openai, &remote_http, &none).await.is_err());
    }

    /// A key with a newline, a control character, a space or a non-ASCII letter inside was sent
    /// as it was, or failed every record as a `transport` error (a tester's `$'k\nXYZ'`).
    #[tokio::test]
    async fn a_key_that_is_not_printable_ascii_is_refused_without_being_shown() {
        let openai: ModelSpec = "openai/gpt-4o-mini".parse().unwrap();
        let local = ProviderOptions { base_url: Some("http://127.0.0.1:9/v1".into()), ..Default::default() };
        for (key, what) in [
            ("SECRET-abc\nXYZ", "control character at character 11"),
            ("SECRET-abc XYZ", "a space"),
            ("SECRET-abcXYZ\u{fc}", "non-ASCII"),
            ("SECRET\x01abc", "control"),
        ] {
            let env = |k: &str| (k == "OPENAI_API_KEY").then(|| key.to_string());
            let e = connect(&openai, &local, &env).await.err().expect("refused").to_string();
            assert!(e.contains("OPENAI_API_KEY holds") && e.contains(what) && !e.contains("abc"), "{e}");
        }
        // Around it, whitespace is a file's newline: dropped.
        let env = |k: &str| (k == "GEMINI_API_KEY").then(|| "  SECRET-abc\n".to_string());
        let gemini: ModelSpec = "gemini/gemini-2.5-flash".parse().unwrap();
        assert!(connect(&gemini, &ProviderOptions::default(), &env).await.is_ok());
    }

    /// A tester's `--media-field photo:audio/wav` with a Claude model failed every record at
    /// run time; it is refused before any call.
    #[test]
    fn claude_refuses_media_types_it_does_not_take_before_any_call() {
        for model in ["anthropic/claude-haiku-4-5", "vertex_ai/claude-sonnet-4-5"] {
            let m: ModelSpec = model.parse().unwrap();
            assert!(m.refused_media_type("audio/wav").unwrap().contains("audio/wav"), "{model}");
            assert!(m.refused_media_type("image/png").is_none() && m.refused_media_type("application/pdf").is_none());
        }
        let gemini: ModelSpec = "gemini/gemini-2.5-flash".parse().unwrap();
        assert!(gemini.refused_media_type("audio/wav").is_none());
    }
}
