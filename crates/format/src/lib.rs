//! brigade's model files without a tensor library: what a coordinator needs to plan placements and
//! to hand out byte ranges of a model, and what the model runtime reads before it builds tensors.
//!
//! # Layout
//! - [`gguf`]: a checked GGUF header reader and a writer; [`GgmlType`] (in [`ggml`]) names the
//!   element types.
//! - [`config`]: hyper-parameters from GGUF metadata or a Hugging Face `config.json`.
//! - [`tokenizer`]: SentencePiece and byte-level BPE vocabularies, `tokenizer.json`, chat templates.
//! - [`tensors`]: the one table of a layer's tensors (name, shape from the configuration, required
//!   or optional), GGUF ↔ Hugging Face names, and [`slice_tensors`]: what a slice of layers reads.
//! - [`index`]: [`ModelIndex`], an opened model (a GGUF file, GGUF bytes, or a safetensors
//!   directory, memory-mapped): configuration, tokenizer, the checked tensor table, per-device
//!   byte accounting and the planner's profile.
//! - [`manifest`]: [`Manifest`], the files of a model with checksummed byte ranges (headers,
//!   small files, one per tensor), a content id, and the ranges one slice needs.
//!
//! Deliberately absent: tensors and any tensor library (no candle), async runtimes and RPC (no
//! tokio, tonic), placement decisions. Every count and length read from a file is checked against
//! the bytes that hold it before anything is allocated; every failure is a [`FormatError`].

#![deny(unsafe_code)]

pub mod config;
pub mod ggml;
pub mod gguf;
pub mod index;
pub mod manifest;
pub mod tensors;
pub mod tokenizer;

pub use config::ModelConfig;
pub use ggml::GgmlType;
pub use index::{Format, ModelIndex, StoredTensor, StoredType};
pub use manifest::Manifest;
pub use tensors::{slice_tensor_names, slice_tensors, LayerTensor};
pub use tokenizer::Tokenizer;

use std::path::PathBuf;

/// The model compiled into the binary: llama2.c's stories260K (TinyStories), as llama.cpp's CI uses.
pub const EMBEDDED_MODEL_NAME: &str = "stories260K.gguf (embedded)";
/// The embedded model's file name in its [`Manifest`].
pub const EMBEDDED_FILE_NAME: &str = "stories260K.gguf";

#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);
static EMBEDDED: &Aligned<[u8]> = &Aligned(*include_bytes!("../assets/stories260K.gguf"));

/// The bytes of the embedded model (64-byte aligned).
pub fn embedded_model() -> &'static [u8] {
    &EMBEDDED.0
}

/// Why a model's files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("invalid model file: {0}")]
    Invalid(String),
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
}
