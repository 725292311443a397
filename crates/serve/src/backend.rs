//! What the HTTP API asks of whatever computes completions: the one-box batch engine (in the
//! CLI) or a cluster's coordinator. The server does everything else — parsing, chat templates,
//! tokenizing, detokenizing, stop strings, usage, streaming — so every backend answers alike.

use crate::error::ApiError;
use crate::overview::Overview;
use brigade_core::stop::StopReason;
use brigade_core::{Constraint, SamplingParams, TokenLogprob};
use brigade_format::Tokenizer;
use brigade_grammar::Format;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::mpsc;

/// A model as the API lists it.
#[derive(Clone)]
pub struct ModelInfo {
    /// The name clients give as `model`.
    pub id: String,
    /// Tokens a session holds (prompt and answer).
    pub n_ctx: usize,
    /// The model's tokenizer and chat template (`brigade-format`'s: no tensor library needed).
    pub tokenizer: Arc<Tokenizer>,
    /// Unix seconds, for `created`.
    pub created: u64,
    pub owned_by: String,
}

/// One completion for a backend to compute.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// A model id from [`Backend::models`].
    pub model: String,
    /// Prompt token ids: not empty, fewer than the model's context.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
    /// The request's stop strings (checked). The server cuts the text at them whatever the
    /// backend does; a backend that sees text (the cluster's driver) may end the job there too,
    /// instead of when the server drops the receiver.
    pub stop: Vec<String>,
    /// What the answer must spell (`response_format`, `grammar`), compiled against the model's
    /// vocabulary: the backend masks each step's logits with it. Only sent to a backend that
    /// [`Backend::constrains`].
    pub constraint: Option<Constraint>,
    /// The format `constraint` was compiled from, for a backend that compiles it where it
    /// samples (a cluster's last stage).
    pub format: Option<Format>,
    /// Send each token's log-probability and this many alternatives (only to a backend that
    /// [`Backend::scores`]).
    pub logprobs: Option<usize>,
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token (not sent), or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
}

impl Finish {
    /// OpenAI's reason for brigade's: an end-of-generation id or a stop string is `stop`, the
    /// rest (`max_tokens`, a full context, a caller's end) `length`.
    pub fn of(stop: StopReason) -> Finish {
        match stop {
            StopReason::Eos | StopReason::Stop => Finish::Stop,
            StopReason::Length | StopReason::Context | StopReason::Caller => Finish::Length,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a backend sends for a request, in order: `Started` (optional: a backend that keeps
/// prompt caches says how many prompt tokens it did not read again), tokens, then one `Done`
/// or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Started {
        cached_tokens: usize,
    },
    /// A generated id, with its log-probabilities when the request asked for them.
    Token(u32, Option<TokenLogprob>),
    Done(Finish),
    Error(String),
}

/// How busy a backend is, for `GET /health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    pub slots: usize,
    pub processing: usize,
    pub waiting: usize,
}

/// A completion engine behind the API.
pub trait Backend: Send + Sync + 'static {
    /// The models served.
    fn models(&self) -> Vec<ModelInfo>;

    /// Starts a completion. Its events arrive on the receiver; dropping the receiver cancels it
    /// (the backend frees its resources as soon as it notices: at once, or at its next step).
    /// Fails with [`ApiError::busy`] (503) when it takes no more work now.
    fn complete(
        &self,
        req: EngineRequest,
    ) -> impl Future<Output = Result<mpsc::UnboundedReceiver<EngineEvent>, ApiError>> + Send;

    /// Whether the backend applies [`EngineRequest::constraint`] (the server refuses a request
    /// that asks for a format otherwise, rather than ignore it).
    fn constrains(&self) -> bool {
        false
    }

    /// Whether the backend sends [`EngineRequest::logprobs`] (the server refuses `logprobs`
    /// otherwise).
    fn scores(&self) -> bool {
        false
    }

    /// Slots and queue, when the backend has them.
    fn load(&self) -> Option<Load> {
        None
    }

    /// The machines, links and deployments behind the API: the one source of `/metrics`' figures
    /// beyond the server's own and of the dashboard at `/` (`None`: the server's own only).
    fn overview(&self) -> impl Future<Output = Option<Overview>> + Send {
        std::future::ready(None)
    }
}
