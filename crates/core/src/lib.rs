//! brigade's vocabulary, shared by every other crate.
//!
//! # Layout
//! - [`LayerRange`]: a contiguous half-open range `[start, end)` of transformer layers.
//! - [`DeviceId`]: a compute device of one host (`cpu`, `cuda0`, …).
//! - [`DeviceMap`]: consecutive layer ranges placed on devices in order (`cpu:10,cuda0:22`),
//!   the single-box form of a placement.
//! - [`Inventory`] ([`NodeSpec`], [`DeviceSpec`], [`LinkSpec`]): the devices of a cluster and the
//!   links between its nodes, in base units.
//! - [`SamplingParams`]: how the next token is drawn, one definition for every entry point.
//! - [`ModelProfile`]: what placement needs to know of a model (bytes and flops per layer).
//! - [`stop`]: stop strings over streamed text, one rule for every API.
//! - [`admission`]: how many connections a listener holds at once, overall and per address.
//! - [`cluster`]: the replicated cluster state (nodes, links, models, deployments) and its pure
//!   `apply(command)`.
//!
//! This crate is pure on purpose: no async runtime, no I/O, no clock, no tensor library.
//! The planner and the replicated cluster state build on it and stay testable exhaustively.
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

pub mod admission;
pub mod cluster;
mod device;
mod inventory;
mod layers;
mod profile;
mod sampling;
pub mod stop;

pub use device::{DeviceId, DeviceKind};
pub use inventory::{DeviceSpec, Inventory, Link, LinkSpec, NodeSpec};
pub use layers::{DeviceMap, LayerRange, Stage};
pub use profile::{bits_per_weight, LlamaShape, ModelProfile, MoeProfile};
pub use sampling::{Constraint, SamplingError, SamplingParams, TokenConstraint, TokenLogprob, MAX_TOP_LOGPROBS};

/// Errors of the vocabulary types: all of them are about parsing or validating user input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("unknown device `{0}`: expected `cpu` or `cudaN` (for example `cuda0`)")]
    UnknownDevice(String),
    #[error("invalid layer range [{start}, {end}): start must be below end")]
    EmptyRange { start: usize, end: usize },
    #[error("invalid device map entry `{entry}`: {why}")]
    BadDeviceMapEntry { entry: String, why: String },
    #[error("device map places {placed} layers but the model has {n_layers}")]
    LayerCountMismatch { placed: usize, n_layers: usize },
    #[error("device map is empty")]
    EmptyDeviceMap,
}
