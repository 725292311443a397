//! brigade's model runtime: Llama-family layer slices in candle.
//!
//! # Layout
//! - [`weights`]: [`ModelFiles`], an opened model ([`brigade_format::ModelIndex`]) that builds the
//!   candle tensors a slice asks for, and nothing else; ggml type conversions to candle's.
//! - [`gguf`], [`config`], [`tokenizer`]: re-exported from `brigade-format`, which reads model
//!   files without a tensor library.
//! - [`device`]: brigade's device ids as candle devices, the activation type on each, the CUDA
//!   devices a caller holds open ([`device::Accelerators`]). The lowest module: `llama` and
//!   `pipeline` read it, it reads neither.
//! - [`llama`]: a [`llama::Slice`] is layers `[a, b)` on one device (+ embedding when first,
//!   + norm and head when last); each session's KV cache is a [`llama::SliceCache`].
//! - [`pipeline`]: several slices in one process, prefill / decode / generate; a [`Session`]'s
//!   tokens are exactly what its caches hold, also after a failed forward pass.
//! - [`batch`]: continuous batching of concurrent sessions on one pipeline (one decode pass for
//!   all, batch-invariant), and the [`batch::Engine`] thread that serves it.
//! - [`cpu_matmul`], [`threads`], [`bandwidth`]: re-exported from `brigade-kernels`, the crate
//!   that holds every `unsafe` line of the runtime: the CPU matmul by a ggml weight in place (int8
//!   kernels per instruction set), the vectorized element-wise loops (`llama`'s SiLU, softmax and
//!   decode attention ops call them), the compute threads and the bandwidth probe. This crate
//!   forbids `unsafe`.
//! - [`generation`]: one generation's decisions without IO (the ids the stop rules take, the
//!   next run with its draft), the same for `Pipeline::generate`, the batch and a cluster's
//!   session driver.
//! - [`speculative`]: drafts (prompt lookup, a draft model) verified in one pass, the text
//!   unchanged.
//! - [`sampler`], [`synth`] (random-weight models of any Llama shape).
//! - [`devices`], [`measure`]: what the host has, and this machine measured (kernels per weight
//!   type, GPUs), shared by workers and the CLI.
//!
//! The crate knows nothing of sockets, raft or placement: it computes what it is told to, and
//! measures what it is asked to; deciding where layers go is the planner's.

#![forbid(unsafe_code)]

pub mod batch;
pub mod device;
pub mod devices;
pub mod generation;
pub mod llama;
pub mod measure;
pub mod pipeline;
pub mod rows;
pub mod sampler;
pub mod speculative;
pub mod synth;
pub mod weights;

/// brigade's CPU kernels, from their own crate: the int8 matmuls on ggml blocks (`cpu_matmul`),
/// the memory bandwidth probe and the compute threads.
pub use brigade_kernels::{bandwidth, matmul as cpu_matmul, threads};

pub use brigade_format::{config, gguf, tokenizer};
pub use brigade_format::{embedded_model, FormatError, EMBEDDED_MODEL_NAME};
pub use config::ModelConfig;
pub use llama::{
    predict_slice_bytes, predict_split_bytes, ExpertShard, ExpertSplit, ExpertsCall, Logits, MatMul, RemoteExperts,
    Slice, SliceBytes, SliceCache, StageInput,
};
pub use pipeline::{GenerationStats, Pipeline, Session};
pub use sampler::{Sampler, SamplingParams};
pub use tokenizer::Tokenizer;
pub use weights::ModelFiles;

use std::path::PathBuf;

/// The errors of the model runtime. Reading files fails with a [`FormatError`], which converts
/// into the variant of the same name and message here, so callers match one enum.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("invalid model file: {0}")]
    Format(String),
    #[error("model metadata is missing `{0}`")]
    MissingMetadata(String),
    #[error("model metadata `{key}` is invalid: {why}")]
    BadMetadata { key: String, why: String },
    #[error("architecture `{0}` is not supported ({known} are)", known = crate::config::family::names())]
    UnsupportedArch(String),
    #[error("invalid model configuration: {0}")]
    BadConfig(String),
    #[error("the model has no tensor `{0}`")]
    MissingTensor(String),
    #[error("tensor `{name}`: {why}")]
    BadTensor { name: String, why: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("invalid slice: {0}")]
    BadSlice(String),
    #[error("invalid input: {0}")]
    BadInput(String),
    #[error("context is full: {need} tokens needed, the context holds {n_ctx} (raise -c)")]
    ContextFull { need: usize, n_ctx: usize },
    #[error("device unavailable: {0}")]
    NoDevice(String),
    #[error("experts held elsewhere: {0}")]
    Remote(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl From<FormatError> for ModelError {
    fn from(e: FormatError) -> Self {
        match e {
            FormatError::Gguf(e) => ModelError::Gguf(e),
            FormatError::Io(p, e) => ModelError::Io(p, e),
            FormatError::Invalid(why) => ModelError::Format(why),
            FormatError::MissingMetadata(k) => ModelError::MissingMetadata(k),
            FormatError::BadMetadata { key, why } => ModelError::BadMetadata { key, why },
            FormatError::UnsupportedArch(a) => ModelError::UnsupportedArch(a),
            FormatError::BadConfig(why) => ModelError::BadConfig(why),
            FormatError::MissingTensor(n) => ModelError::MissingTensor(n),
            FormatError::BadTensor { name, why } => ModelError::BadTensor { name, why },
            FormatError::Tokenizer(why) => ModelError::Tokenizer(why),
            FormatError::BadSlice(why) => ModelError::BadSlice(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_errors_keep_their_variant_and_message() {
        let s = || "x".to_string();
        let io = || std::io::Error::other("gone");
        for e in [
            FormatError::Gguf(gguf::GgufError::BadAlignment(3)),
            FormatError::Io(PathBuf::from("m.gguf"), io()),
            FormatError::Invalid(s()),
            FormatError::MissingMetadata(s()),
            FormatError::BadMetadata { key: s(), why: s() },
            FormatError::UnsupportedArch(s()),
            FormatError::BadConfig(s()),
            FormatError::MissingTensor(s()),
            FormatError::BadTensor { name: s(), why: s() },
            FormatError::Tokenizer(s()),
            FormatError::BadSlice(s()),
        ] {
            let (text, variant) = (e.to_string(), format!("{e:?}"));
            let m = ModelError::from(e);
            assert_eq!(m.to_string(), text);
            // the same variant name, but for the one renamed (Invalid is ModelError::Format)
            let name = |d: &str| d.split(['(', ' ']).next().unwrap_or_default().to_string();
            let want = if name(&variant) == "Invalid" { "Format".to_string() } else { name(&variant) };
            assert_eq!(name(&format!("{m:?}")), want);
        }
    }
}
