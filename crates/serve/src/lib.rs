//! brigade's OpenAI-compatible HTTP API, over any [`Backend`]: the one-box batch engine
//! (`brigade serve`) or a cluster's coordinator (`brigade coordinator --http`), which then answer
//! alike.
//!
//! # Layout
//! - [`backend`]: the [`Backend`] trait — models with their tokenizers, and `complete`, which
//!   streams token ids and a finish reason; dropping the receiver cancels.
//! - [`server`]: the axum routes (`/health`, `/v1/models`, `/v1/completions`,
//!   `/v1/chat/completions`), API keys, the body limit, chat templates, tokenizing, stop strings,
//!   usage, server-sent events; [`serve`] runs it on a listener until a shutdown future completes.
//! - [`openai`]: the request bodies and their checks (llama.cpp's defaults for what is left out).
//! - [`stop`]: stop strings over streamed text (pure).
//! - [`error`]: [`ApiError`], every error in OpenAI's JSON shape with its status.
//!
//! Deliberately lacks: any tensor library (checked by `tests/architecture.rs`: the coordinator
//! links this crate), `n > 1`, logprobs, tools and images, embeddings, TLS (put a proxy in front).

pub mod backend;
pub mod error;
pub mod openai;
pub mod server;
pub mod stop;

pub use backend::{Backend, EngineEvent, EngineRequest, Finish, Load, ModelInfo, Sampling};
pub use error::ApiError;
pub use server::{router, serve, ServeConfig};
