//! What a backend is and does, as plain data: the one source of `/metrics` and of the dashboard
//! at `/`. The coordinator builds it from the same status snapshot `brigade status` prints; the
//! one-box server from its pipeline and batch engine.

use serde::Serialize;

/// The machines, their links and the deployments a backend runs.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Overview {
    /// Where the figures come from, e.g. "coordinator replica 1 (leader)" or "brigade serve".
    pub source: String,
    pub nodes: Vec<NodeView>,
    pub links: Vec<LinkView>,
    pub deployments: Vec<DeploymentView>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeView {
    pub name: String,
    pub address: String,
    /// "up" or "down".
    pub state: String,
    /// Seconds since the node's last heartbeat (0 for this process itself).
    pub heartbeat_age_s: f64,
    pub devices: Vec<DeviceView>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct DeviceView {
    /// "cpu", "cuda0", …
    pub name: String,
    /// The hardware's name, e.g. "AMD EPYC".
    pub model: String,
    pub memory_total: u64,
    pub memory_free: u64,
    /// Measured read bandwidth, bytes/s (0: not measured).
    pub mem_bandwidth: f64,
    /// Measured compute rate, flop/s (0: not measured).
    pub flops: f64,
    /// Instruction sets or kernels, in words.
    pub features: String,
    /// "cpu" or "cuda".
    pub kind: String,
    /// A GPU's measured copy bandwidth to and from host memory, bytes/s (0: a CPU, or not
    /// measured).
    pub host_link_bandwidth: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct LinkView {
    pub from: String,
    pub to: String,
    pub latency_s: f64,
    /// Bytes/s.
    pub bandwidth: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct DeploymentView {
    pub name: String,
    /// "ready", "loading", "degraded", …
    pub state: String,
    /// The planner's predicted decode seconds per token.
    pub predicted_decode_s: f64,
    /// The measured mean over the sessions so far (0 before any).
    pub measured_decode_s: f64,
    pub tokens_generated: u64,
    /// Speculative decoding: drafted tokens fed, and of them those the model's draws took.
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// Decode steps the measured figures sum over.
    pub decode_steps: u64,
    pub stages: Vec<StageView>,
    /// The plan drawn by the planner (an SVG document), with the measured figures in it.
    pub svg: String,
    /// Why it is not ready, when it is not.
    pub error: String,
}

impl DeploymentView {
    /// Measured tokens/s of one session (0 before any token).
    pub fn tokens_per_s(&self) -> f64 {
        if self.measured_decode_s > 0.0 {
            1.0 / self.measured_decode_s
        } else {
            0.0
        }
    }
}

/// One stage and the hop from it to the next stage (the last stage: back to the driver).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageView {
    pub index: usize,
    pub node: String,
    pub device: String,
    /// Layers `[start, end)`.
    pub layers: (u32, u32),
    pub state: String,
    pub weight_bytes: u64,
    /// KV cache bytes the stage holds for its sessions.
    pub kv_bytes: u64,
    /// The planner's predicted seconds per token (compute and the hop after it).
    pub predicted_s: f64,
    /// Compute seconds summed over the measured decode steps.
    pub compute_s_total: f64,
    /// Seconds of the hop after this stage summed over the measured decode steps.
    pub hop_s_total: f64,
    /// Bytes sent over the hop after this stage, summed over the measured decode steps.
    pub hop_bytes_total: f64,
}

impl StageView {
    /// Mean compute seconds per decoded token (0 before any).
    pub fn compute_s_per_token(&self, steps: u64) -> f64 {
        if steps == 0 {
            0.0
        } else {
            self.compute_s_total / steps as f64
        }
    }

    /// Mean seconds per decoded token of the hop after this stage (0 before any).
    pub fn hop_s_per_token(&self, steps: u64) -> f64 {
        if steps == 0 {
            0.0
        } else {
            self.hop_s_total / steps as f64
        }
    }
}
