//! weir-sim: a simulated LLM endpoint for tests, benchmarks and weir's no-key first run.
//!
//! It speaks the real wire formats of the Gemini API, Gemini on Vertex AI, Vertex AI endpoints
//! (`:predict`) and OpenAI-compatible servers, streaming included; it enforces quotas the way the
//! providers do (sliding windows per key, per-day quotas, the providers' own 429 bodies and
//! headers); it hides a concurrency cap; and it injects faults at configured rates. `GET /stats`
//! reports what it saw, so callers can check their own account against the server's.
//!
//! Start one in-process on port 0 with [`SimServer::start`], read [`SimServer::addr`], and stop
//! it with [`SimServer::shutdown`].

#![warn(missing_docs)]

pub mod auth;
pub mod config;
pub mod gcs;
pub mod gen;
pub mod jobs;
pub mod proto;
pub mod quota;
mod serve;
mod server;
pub mod stats;

pub use config::{
    AuthConfig, BatchJobConfig, ConfigError, EmbeddingConfig, OverloadMode, PredictConfig, SimConfig, WindowKind,
};
pub use gcs::GcsServer;
pub use server::{Captured, SimServer, StartError, StreamTiming};
pub use stats::StatsSnapshot;
