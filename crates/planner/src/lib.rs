//! brigade's placement planner: which contiguous layer ranges go on which devices, and why.
//!
//! `plan(&Inventory, &ModelProfile, &Policy) -> Result<Plan, PlanError>` is pure: it never
//! queries a device or reads a file (the caller parses cluster files with [`parse_cluster`] and
//! reads model headers elsewhere). The result is optimal for the cost model in [`cost`] (exact up
//! to [`search::EXACT_MAX`] devices, a measured heuristic beyond), with a predicted memory and
//! time for every stage and hop, the bottleneck, a reason per stage, and the alternatives it
//! rejected, with numbers.
//!
//! # Layout
//! - [`units`], [`cluster`]: cluster files in human units → [`Inventory`].
//! - [`cost`]: the cost model ([`cost::Problem`]); the only place numbers come from.
//! - [`dp`]: the exact dynamic programs over (devices used, last device, layers placed).
//! - [`across`]: the exact program for split layers across nodes (labels per cell).
//! - [`search`]: objectives on top of the programs; the heuristic for large clusters.
//! - [`explain`]: the [`Plan`] with reasons and rejected alternatives; text rendering.
//! - [`svg`]: a picture of a plan.
//!
//! Deliberately absent: tokio, tonic, candle, raft (a test checks `cargo tree`).
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]
#![warn(missing_docs)]

pub mod across;
pub mod cluster;
pub mod cost;
pub mod dp;
pub mod explain;
pub mod search;
pub mod svg;
pub mod units;

pub use brigade_core::{Inventory, ModelProfile};
pub use cluster::parse_cluster;
pub use explain::{plan, plan_with_second, HopPlan, Plan, Rejected, StagePlan};

use serde::{Deserialize, Serialize};

/// What the planner optimises (`--objective`: `latency`, `throughput`, `max-context`, `energy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Objective {
    /// One stream: minimum seconds per token.
    Latency,
    /// Many streams: maximum tokens per second over all sessions.
    Throughput,
    /// The largest context that fits, planned for latency.
    MaxContext,
    /// Minimum joules per token within `slack` × the best latency.
    Energy,
}

impl std::str::FromStr for Objective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "latency" => Ok(Objective::Latency),
            "throughput" => Ok(Objective::Throughput),
            "max-context" => Ok(Objective::MaxContext),
            "energy" => Ok(Objective::Energy),
            o => Err(format!("unknown objective `{o}` (latency, throughput, max-context, energy)")),
        }
    }
}

impl std::fmt::Display for Objective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Objective::Latency => "latency",
            Objective::Throughput => "throughput",
            Objective::MaxContext => "max-context",
            Objective::Energy => "energy",
        })
    }
}

/// Split layers of a mixture of experts: attention, norms, router and shared expert on the
/// layer's device, the routed experts in the RAM of the layer's node, computed by its CPU
/// (llama.cpp's `--cpu-moe` / `--n-cpu-moe N`). Exact on one node and, within
/// [`across::MAX_WORK`], across nodes ([`across`]); a reservation heuristic beyond ([`cost`],
/// [`search`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpuMoe {
    /// The planner chooses: for a mixture on a cluster where a node has a CPU and another
    /// device, every `N` in `0..=layers` (a grid of them on large clusters across nodes:
    /// [`explain::splits_searched`]) is searched with the cut points, and the best for the
    /// objective kept (ties to the fewest split layers); otherwise whole layers.
    #[default]
    Auto,
    /// The experts of the first `N` layers in RAM (0: whole layers; `--cpu-moe`: all layers).
    Layers(usize),
}

/// Memory another model already holds on a device (`--also-model`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reservation {
    /// The node's name.
    pub node: String,
    /// The device's name on that node.
    pub device: String,
    /// Bytes held, taken off the device's budget.
    pub bytes: u64,
    /// The name of the model that holds them.
    pub by: String,
}

/// What to plan for: the objective, the context and sessions to hold, and the limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    /// What to optimise.
    pub objective: Objective,
    /// Context length in tokens (KV cache per session).
    pub ctx: u64,
    /// Concurrent sessions.
    pub sessions: u64,
    /// Share of each device's memory left free.
    pub headroom: f64,
    /// The node where requests arrive (default: the first node).
    pub driver: Option<String>,
    /// Energy objective: allowed decode time as a multiple of the best latency.
    pub slack: f64,
    /// A cap on the average power drawn while decoding (watts), for any objective but energy.
    pub max_watts: Option<f64>,
    /// Memory other models already hold, taken off the devices' budgets.
    pub reserved: Vec<Reservation>,
    /// Split layers: chosen by the planner or as given.
    #[serde(default)]
    pub cpu_moe: CpuMoe,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            objective: Objective::Latency,
            ctx: 4096,
            sessions: 1,
            headroom: 0.10,
            driver: None,
            slack: 1.5,
            max_watts: None,
            reserved: Vec::new(),
            cpu_moe: CpuMoe::Auto,
        }
    }
}

impl Policy {
    /// Refuses what the planner cannot use, naming the flag: `--headroom` outside [0, 1),
    /// `--ctx` or `--sessions` of 0, `--slack` below 1, a `--max-watts` that is not positive.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |what: &str, value: String, why: &str| {
            Err(PlanError::BadValue { what: what.into(), value, why: why.into() })
        };
        if !(0.0..1.0).contains(&self.headroom) {
            return bad("--headroom", self.headroom.to_string(), "must be in [0, 1)");
        }
        if self.ctx == 0 {
            return bad("--ctx", "0".into(), "must be at least 1");
        }
        if self.sessions == 0 {
            return bad("--sessions", "0".into(), "must be at least 1");
        }
        if !(self.slack.is_finite() && self.slack >= 1.0) {
            return bad("--slack", self.slack.to_string(), "must be at least 1");
        }
        if let Some(w) = self.max_watts {
            if !(w.is_finite() && w > 0.0) {
                return bad("--max-watts", w.to_string(), "must be positive");
            }
        }
        Ok(())
    }
}

/// Why there is no plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A value in human units ([`units`]) that does not parse.
    #[error("{what}: `{value}` is not {expected}")]
    BadUnit {
        /// The field it was given for (a device's `memory`, a link's `latency`, …).
        what: String,
        /// The text as given.
        value: String,
        /// The kind of value expected, with examples.
        expected: String,
    },
    /// A value that parses but cannot be used (out of range, not positive, implausible).
    #[error("{what}: `{value}` {why}")]
    BadValue {
        /// The field or flag it was given for (`--headroom`, …).
        what: String,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// A cluster file that is not valid TOML of the expected shape, or names a node, device or
    /// link twice, or a link to an unknown node; or a cluster without devices.
    #[error("invalid cluster: {0}")]
    BadCluster(String),
    /// A model profile without layers, or whose per-layer lists disagree in length.
    #[error("invalid model profile: {0}")]
    BadModel(String),
    /// The policy's driver names no node of the cluster.
    #[error("driver node `{0}` is not in the cluster")]
    UnknownDriver(String),
    /// No placement fits the model with its KV cache in the devices' budgets.
    #[error("the model does not fit: {detail} (short by {shortfall_bytes} bytes)")]
    Infeasible {
        /// Bytes missing; 0 when there is memory enough in all but no chain of linked devices
        /// reachable from the driver holds the model.
        shortfall_bytes: u64,
        /// What needs how much against what there is, for the user.
        detail: String,
    },
    /// The energy objective or a watts cap, with devices that lack `watts`: their labels
    /// (`node/device`), comma-separated.
    #[error("the energy objective needs `watts` on every device; missing on {0}")]
    MissingWatts(String),
}
