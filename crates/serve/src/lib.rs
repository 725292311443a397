//! brigade's OpenAI-compatible HTTP API, over any [`Backend`]: the one-box batch engine
//! (`brigade serve`) or a cluster's coordinator (`brigade coordinator --http`), which then answer
//! alike.
//!
//! # Layout
//! - [`backend`]: the [`Backend`] trait — models with their tokenizers, and `complete`, which
//!   streams token ids and a finish reason; dropping the receiver cancels.
//! - [`server`]: the axum routes (`/health`, `/v1/models`, `/v1/completions`,
//!   `/v1/chat/completions`), API keys, the body limit, chat templates, tokenizing, stop strings,
//!   usage, server-sent events; [`serve`] runs it on a listener until a shutdown future completes,
//!   with connection caps and header and body timeouts.
//! - [`keys`]: API keys in an inference and an admin tier, compared hashed in constant time.
//! - [`openai`]: the request bodies and their checks (llama.cpp's defaults for what is left out).
//! - [`error`]: [`ApiError`], every error in OpenAI's JSON shape with its status.
//! - [`overview`]: what a backend runs (nodes, devices, links, deployments, stages), as plain
//!   data: the one source of [`metrics`] (`/metrics`, Prometheus' text format through
//!   `prometheus-client`, with the server's own request figures) and of [`dashboard`] (`/`, one
//!   server-rendered page that reloads itself: no script, no external resource).
//!
//! - [`tools`]: tool calls — the request's tools, the call format the chat template shows, a
//!   forced call's grammar, and the parser that turns an answer's text into `tool_calls`.
//!
//! Deliberately lacks: any tensor library (checked by `tests/architecture.rs`: the coordinator
//! links this crate), `n > 1`, images, embeddings, TLS (put a proxy in front).
//! Structured output (`response_format`, `json_schema`, `grammar`) is compiled here by
//! `brigade-grammar` and applied by a backend that [`Backend::constrains`]; `logprobs` are sent
//! by a backend that [`Backend::scores`].

#![forbid(unsafe_code)]

pub mod backend;
pub mod dashboard;
pub mod error;
pub mod keys;
pub mod metrics;
pub mod openai;
pub mod overview;
pub mod server;
pub mod tools;

pub use backend::{Backend, EngineEvent, EngineRequest, Finish, Load, ModelInfo};
pub use brigade_core::SamplingParams;
pub use brigade_grammar::Format;
pub use error::ApiError;
pub use keys::{ApiKeys, KeyError, Tier};
pub use overview::{DeploymentView, DeviceView, LinkView, NodeView, Overview, StageView};
pub use server::{router, serve, ServeConfig};
