//! brigade's model runtime: Llama-family layer slices in candle.
//!
//! # Layout
//! - [`gguf`]: a checked GGUF header reader and a writer.
//! - [`weights`]: an opened model (GGUF file or safetensors directory), memory-mapped; builds the
//!   weights a slice asks for, and nothing else.
//! - [`config`]: hyper-parameters from GGUF metadata or `config.json`.
//! - [`llama`]: a [`llama::Slice`] is layers `[a, b)` on one device (+ embedding when first,
//!   + norm and head when last); each session's KV cache is a [`llama::SliceCache`].
//! - [`pipeline`]: several slices in one process, prefill / decode / generate.
//! - [`tokenizer`], [`sampler`], [`synth`] (random-weight models of any Llama shape).
//! - [`cpu_matmul`]: the CPU matmul by a ggml weight in place (int8 kernels per instruction set).
//! - [`bandwidth`]: the memory read bandwidth probe behind `brigade bench`'s bound.
//!
//! The crate knows nothing of sockets, raft or placement: it computes what it is told to.

pub mod bandwidth;
pub mod config;
pub mod cpu_matmul;
pub mod devices;
pub mod gguf;
pub mod llama;
pub mod pipeline;
pub mod sampler;
pub mod synth;
pub mod tokenizer;
pub mod weights;

pub use config::ModelConfig;
pub use llama::{predict_slice_bytes, Logits, Slice, SliceBytes, SliceCache, StageInput};
pub use pipeline::{GenerationStats, Pipeline, Session};
pub use sampler::{Sampler, SamplerConfig};
pub use tokenizer::Tokenizer;
pub use weights::ModelFiles;

use std::path::PathBuf;

/// The model compiled into the binary: llama2.c's stories260K (TinyStories), as llama.cpp's CI uses.
pub const EMBEDDED_MODEL_NAME: &str = "stories260K.gguf (embedded)";

#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);
static EMBEDDED: &Aligned<[u8]> = &Aligned(*include_bytes!("../assets/stories260K.gguf"));

/// The bytes of the embedded model (64-byte aligned).
pub fn embedded_model() -> &'static [u8] {
    &EMBEDDED.0
}

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
    #[error("architecture `{0}` is not supported (llama, mistral, qwen2 are)")]
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
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
