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
//! - [`stop`]: when a generation ends (why, the rules, stop strings), one definition for every
//!   engine and API.
//! - [`admission`]: how many connections a listener holds at once, overall and per address.
//! - [`cluster`]: the replicated cluster state (nodes, links, models, deployments) and its pure
//!   `apply(command)`.
//!
//! This crate is pure on purpose: no async runtime, no I/O, no clock, no tensor library.
//! The planner and the replicated cluster state build on it and stay testable exhaustively.
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]
#![warn(missing_docs)]

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
pub use profile::{bits_per_weight, LlamaShape, ModelProfile, MoeProfile, MoeShape};
pub use sampling::{Constraint, SamplingError, SamplingParams, TokenConstraint, TokenLogprob, MAX_TOP_LOGPROBS};

/// Errors of the vocabulary types: all of them are about parsing or validating user input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A device name other than `cpu` or `cudaN`, as given.
    #[error("unknown device `{0}`: expected `cpu` or `cudaN` (for example `cuda0`)")]
    UnknownDevice(String),
    /// A layer range with `start >= end`.
    #[error("invalid layer range [{start}, {end}): start must be below end")]
    EmptyRange {
        /// The first layer asked for.
        start: usize,
        /// The end asked for (exclusive).
        end: usize,
    },
    /// A `--device-map` entry that is not `DEVICE:LAYERS` with a known device and a nonzero count.
    #[error("invalid device map entry `{entry}`: {why}")]
    BadDeviceMapEntry {
        /// The entry as written (`cpu:0`, `tpu:3`, …).
        entry: String,
        /// What is wrong with it, for the user.
        why: String,
    },
    /// A device map whose counts do not add up to the model's layers.
    #[error("device map places {placed} layers but the model has {n_layers}")]
    LayerCountMismatch {
        /// Layers the map's counts sum to.
        placed: usize,
        /// Layers of the model.
        n_layers: usize,
    },
    /// A device map with no entries.
    #[error("device map is empty")]
    EmptyDeviceMap,
}
