//! The replicated state of a cluster: nodes and what they measured, the links between them,
//! the models the coordinator can serve, and the deployments placed on the nodes.
//!
//! [`ClusterState::apply`] is the only way to change it: a pure function of the state and a
//! [`Command`], deterministic (no clock, no randomness — times arrive inside commands), so a raft
//! log of commands replayed on any replica gives the same state. A command that does not apply
//! returns an error and changes nothing.
//!
//! What is deliberately not here: liveness (heartbeat ages are soft state of the coordinator that
//! observes them; declaring a node down is a command), secrets (the cluster CA's key and the join
//! token live in the coordinator's data dir), and sessions (they live on the workers).

use crate::{LayerRange, Link};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// Maximum lengths of names that arrive from outside (node and deployment names).
pub const MAX_NAME_LEN: usize = 64;

/// A node's name becomes a DNS label in its certificate (`<name>.node.brigade`): 1–63 lower-case
/// letters, digits and `-`, not starting or ending with `-`.
pub fn check_node_name(name: &str) -> Result<(), StateError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && !name.ends_with('-')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(StateError::BadName { what: "node".into(), name: name.chars().take(80).collect() })
    }
}

/// A name for a node or a deployment: 1–64 characters of `[A-Za-z0-9._-]`, starting with an
/// alphanumeric (it appears in certificate names, file names and URLs).
pub fn check_name(what: &str, name: &str) -> Result<(), StateError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(StateError::BadName { what: what.to_string(), name: name.chars().take(80).collect() })
    }
}

/// How fast one of brigade's kernels runs on a device for one weight type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelFigures {
    /// The weight type as brigade names it (`q4_k`, `q8_0`, `f16`, `f32`, …).
    pub weight_type: String,
    /// Weight bytes per second of a one-token matrix-vector product.
    pub decode_bytes_per_s: f64,
    /// Flop/s of a prompt matrix-matrix product.
    pub prompt_flops: f64,
}

/// A device of a node as its worker measured it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceFigures {
    /// Unique within its node: `cpu`, `cuda0`, ….
    pub name: String,
    /// CPU or CUDA.
    pub kind: crate::DeviceKind,
    /// The hardware's human-readable name (`AMD EPYC …`, `NVIDIA H200`).
    pub model: String,
    /// Bytes of memory the device has in all.
    pub memory_total: u64,
    /// Bytes that may hold weights and KV caches now: what the worker offers, lowered by
    /// [`Command::LowerDeviceMemory`] after an out-of-memory load.
    pub memory_free: u64,
    /// Measured streaming read bandwidth, bytes/s.
    pub mem_bandwidth: f64,
    /// Measured compute rate, flop/s (the best prompt kernel's on a CPU).
    pub flops: f64,
    /// brigade's kernel rates by weight type (measured on CPUs; empty on CUDA devices).
    pub kernels: Vec<KernelFigures>,
    /// Threads brigade runs on this device (CPU; 0 on CUDA devices).
    pub threads: u32,
    /// Space-separated instruction sets that picked the CPU kernels (`avx2 fma f16c …`);
    /// empty on CUDA devices.
    pub features: String,
    /// The path to the node's CPU (PCIe); CUDA devices only.
    pub host_link: Option<Link>,
}

impl DeviceFigures {
    /// The measured rates for a weight type, if the worker measured it.
    pub fn kernel(&self, weight_type: &str) -> Option<&KernelFigures> {
        self.kernels.iter().find(|k| k.weight_type == weight_type)
    }
}

/// Whether a node takes stages: set by registration and by the coordinator's commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Registered and taken to be running: placements may use it.
    Up,
    /// Declared down: no new stages go there and its deployments are degraded.
    Down,
}

impl NodeState {
    /// The state's lower-case name, as the APIs show it (`up`, `down`).
    pub fn name(self) -> &'static str {
        match self {
            NodeState::Up => "up",
            NodeState::Down => "down",
        }
    }
}

/// A registered node: where its worker listens and what it measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's name, a DNS label ([`check_node_name`]).
    pub name: String,
    /// `host:port` where the worker takes QUIC and gRPC from peers and the coordinator.
    pub address: String,
    /// Its devices as the worker measured them.
    pub devices: Vec<DeviceFigures>,
    /// brigade's version string the worker reported (informational).
    pub version: String,
    /// Up on every registration; down only by [`Command::SetNodeState`].
    pub state: NodeState,
    /// Unix milliseconds of the last registration.
    pub registered_ms: u64,
    /// Devices whose memory was lowered after a stage ran out of memory loading there: by
    /// device, the free memory the node registered it with and the figure it was lowered to.
    /// A registration with the same figure (a reconnect resends what the worker measured at
    /// start) keeps the lowering; new figures (a restart measures afresh) end it.
    #[serde(default)]
    pub lowered: BTreeMap<String, (u64, u64)>,
}

/// A node's admission to the cluster: the certificate that alone speaks for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// sha256 (hex) of the DER of the certificate issued to the node.
    pub fingerprint: String,
    /// Unix milliseconds of the admission.
    pub admitted_ms: u64,
}

/// A link measured from one node to another (directed: each end measures its own sending side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkRecord {
    /// The node that measured it, the sending side.
    pub from: String,
    /// The receiving node.
    pub to: String,
    /// Throughput of a bulk transfer (bytes/s) and one-way latency (seconds, half a round trip).
    pub link: Link,
    /// Unix milliseconds of the measurement.
    pub measured_ms: u64,
}

/// One byte range of a model file, with its checksum.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeRecord {
    /// The file's path relative to the model, as in [`ModelRecord::files`].
    pub file: String,
    /// Byte offset of the range from the start of the file.
    pub offset: u64,
    /// Bytes in the range.
    pub length: u64,
    /// sha256 (hex) of the range's bytes.
    pub sha256: String,
    /// The tensor the range holds; empty for headers and whole small files.
    pub tensor: String,
}

/// A model the coordinator can serve: where it is on the coordinator's machine and the checksummed
/// ranges of its files (every header and every tensor).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRecord {
    /// Content id: `embedded` or a hash of the files' sizes and range checksums.
    pub id: String,
    /// The model's display name.
    pub name: String,
    /// Path on the coordinator's machine (`embedded` for the model in the binary).
    pub source: String,
    /// File paths relative to the model, with sizes.
    pub files: Vec<(String, u64)>,
    /// Every header and tensor of the files, checksummed: what workers fetch and verify.
    pub ranges: Vec<RangeRecord>,
    /// Transformer layers of the model.
    pub n_layers: usize,
    /// The context the model was trained for, in tokens (from its config).
    pub context_length: usize,
    /// What the planner needs of the model (weights as a CPU stage holds them; the KV cache in
    /// f32 on CPUs and in a GPU's type on GPUs), so re-planning never reopens the file.
    pub profile: crate::ModelProfile,
    /// Bytes of the layers' matrices by stored type (`q4_k`, `q6_k`, …): how a device's measured
    /// kernel rates combine into its speed on this model.
    pub weight_types: Vec<(String, u64)>,
    /// Routed experts per layer of a mixture-of-experts model (0: dense).
    #[serde(default)]
    pub experts: usize,
}

/// Where one stage of a deployment is, as its worker reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "state", content = "error")]
pub enum StageState {
    /// Placed; its worker has not reported on it yet.
    Pending,
    /// Its worker is fetching and loading the slice.
    Loading,
    /// Loaded and serving.
    Ready,
    /// The load failed, with the error (starting with [`OUT_OF_MEMORY`] when the device ran out).
    Failed(String),
}

impl StageState {
    /// The state's lower-case name, as the APIs show it (`pending`, `loading`, `ready`, `failed`).
    pub fn name(&self) -> &'static str {
        match self {
            StageState::Pending => "pending",
            StageState::Loading => "loading",
            StageState::Ready => "ready",
            StageState::Failed(_) => "failed",
        }
    }
}

/// One stage of a deployment: a device of a node and the layers it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageRecord {
    /// The node that runs the stage.
    pub node: String,
    /// The device on that node ([`DeviceFigures::name`]).
    pub device: String,
    /// The layers `[start, end)` the stage holds.
    pub layers: LayerRange,
    /// What its worker last reported (pending on every placement).
    pub state: StageState,
    /// Bytes of weights: the planner's figure at placement, then what the worker reports loading.
    pub weight_bytes: u64,
    /// Bytes of KV cache: the planner's figure at placement, then what the worker reports.
    pub kv_bytes: u64,
    /// Bytes the worker fetched from sources to load the slice (0 when all was cached; reset to 0
    /// on every placement).
    pub fetched_bytes: u64,
    /// The planner's decode seconds per token for this stage (its hop to the next included).
    pub predicted_s: f64,
    /// On an expert stage ([`Deployment::expert_stages`]): the routed experts of `layers` it
    /// holds, and nothing else of them. `None` on the pipeline's stages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertIds>,
}

/// Routed experts `[start, end)` of a mixture-of-experts layer, by id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertIds {
    /// The first id held.
    pub start: u32,
    /// One past the last id held.
    pub end: u32,
}

impl ExpertIds {
    /// Whether the two share an id.
    pub fn overlaps(&self, other: &ExpertIds) -> bool {
        self.start < other.end && other.start < self.end
    }

    /// The ids as a range.
    pub fn range(&self) -> std::ops::Range<u32> {
        self.start..self.end
    }
}

impl std::fmt::Display for ExpertIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// Element type of hidden states between stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActDtype {
    /// 32-bit IEEE floats.
    F32,
    /// 16-bit IEEE floats.
    F16,
    /// bfloat16.
    Bf16,
}

impl ActDtype {
    /// Bytes per element.
    pub fn size(&self) -> usize {
        match self {
            ActDtype::F32 => 4,
            ActDtype::F16 | ActDtype::Bf16 => 2,
        }
    }
}

/// Which carrier moves activations between consecutive stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CarrierKind {
    /// QUIC streams, the default.
    Quic,
    /// gRPC bidirectional streams over TCP, for networks that block UDP.
    Grpc,
}

/// A model placed on the nodes under a name, the name clients ask for as `model`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deployment {
    /// The deployment's name ([`check_name`]), unique in the cluster.
    pub name: String,
    /// The [`ModelRecord::id`] of the model it serves.
    pub model_id: String,
    /// Bumped on every placement: workers refuse frames of another generation.
    pub generation: u64,
    /// Transformer layers of the model; the stages cover `[0, n_layers)`.
    pub n_layers: usize,
    /// Context length in tokens each session's KV cache holds.
    pub n_ctx: usize,
    /// Concurrent sessions every stage provisions KV caches for.
    pub sessions: usize,
    /// The planner objective it was placed for (`latency`, `throughput`, `max-context`,
    /// `energy`).
    pub objective: String,
    /// Element type of the hidden states sent between stages.
    pub act_dtype: ActDtype,
    /// How hidden states travel between stages.
    pub carrier: CarrierKind,
    /// The node that drives sessions (receives the sampled ids).
    pub driver: String,
    /// The stages in pipeline order, covering the layers once each.
    pub stages: Vec<StageRecord>,
    /// The planner's decode seconds per token of the whole pipeline.
    pub predicted_decode_s: f64,
    /// The placement as the planner explained it (or as placed by hand), for display.
    pub plan_text: String,
    /// Unix milliseconds of the deploy request.
    pub created_ms: u64,
    /// Prompt tokens per chunk into the first stage (0: brigade's choice by the stage count).
    #[serde(default)]
    pub ubatch: usize,
    /// Times the deployment was re-placed (a node died, or a better placement appeared).
    #[serde(default)]
    pub replacements: u32,
    /// Why the deployment cannot serve (empty while it can): e.g. the shortfall when the model
    /// no longer fits on the nodes that are up.
    #[serde(default)]
    pub note: String,
    /// Split layers: the routed experts of layers `[0, cpu_moe)` are held in the RAM of the node
    /// that holds each layer, computed by its CPU (0: whole layers).
    #[serde(default)]
    pub cpu_moe: usize,
    /// The split was searched (`deploy` without `--n-cpu-moe`): a re-placement searches it
    /// again, and may change [`Deployment::cpu_moe`].
    #[serde(default)]
    pub cpu_moe_auto: bool,
    /// Placed by a hand-given map: never moved for a faster placement (only when a node dies).
    #[serde(default)]
    pub by_hand: bool,
    /// Stages that hold only routed experts of a mixture ([`StageRecord::experts`]), called by
    /// the pipeline's stages of their layers; numbered after the pipeline's stages.
    #[serde(default)]
    pub expert_stages: Vec<StageRecord>,
}

impl Deployment {
    /// Stage `i`: the pipeline's stages, then the expert stages.
    pub fn stage(&self, i: usize) -> Option<&StageRecord> {
        self.stages.get(i).or_else(|| self.expert_stages.get(i.checked_sub(self.stages.len())?))
    }

    fn stage_mut(&mut self, i: usize) -> Option<&mut StageRecord> {
        let n = self.stages.len();
        match i.checked_sub(n) {
            None => self.stages.get_mut(i),
            Some(j) => self.expert_stages.get_mut(j),
        }
    }

    /// Every stage, the pipeline's then the expert stages, in [`Deployment::stage`]'s numbering.
    pub fn every_stage(&self) -> impl Iterator<Item = &StageRecord> {
        self.stages.iter().chain(&self.expert_stages)
    }
}

/// What a deployment as a whole is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeploymentState {
    /// Some stage has not reported yet.
    Loading,
    /// Placed again (after a node died or for a better placement): stages are loading.
    Replacing,
    /// Every stage is loaded and serving.
    Ready,
    /// A stage failed to load.
    Failed,
    /// A stage's node is down.
    Degraded,
}

impl DeploymentState {
    /// The state's name as the APIs show it (`loading`, `re-placing`, `ready`, `failed`,
    /// `degraded`).
    pub fn name(&self) -> &'static str {
        match self {
            DeploymentState::Loading => "loading",
            DeploymentState::Replacing => "re-placing",
            DeploymentState::Ready => "ready",
            DeploymentState::Failed => "failed",
            DeploymentState::Degraded => "degraded",
        }
    }
}

/// How a stage's failure says that its device ran out of memory while loading (the start of its
/// [`StageState::Failed`] text): the leader lowers that device's memory and re-places.
pub const OUT_OF_MEMORY: &str = "out of memory";

/// A change to the cluster state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// A node proved it knows the join token and got a certificate (sha256 fingerprint of its
    /// DER): from now on only that certificate speaks for the node; an earlier one is revoked.
    AdmitNode {
        /// The node's name ([`check_node_name`]).
        name: String,
        /// sha256 of the certificate's DER, 64 hex digits.
        fingerprint: String,
        /// Unix milliseconds of the admission.
        admitted_ms: u64,
    },
    /// A node (re-)registers with its address and measured devices; it is up.
    RegisterNode {
        /// The record; its `state` and `lowered` are set by [`ClusterState::apply`].
        node: NodeRecord,
    },
    /// The coordinator declares a node up or down (liveness is observed outside the state).
    SetNodeState {
        /// The node's name.
        name: String,
        /// Its new state.
        state: NodeState,
    },
    /// A device of a node has less memory than it registered with: a stage ran out of memory
    /// loading there (the node's next registration measures it afresh).
    LowerDeviceMemory {
        /// The node's name.
        node: String,
        /// The device's name on that node.
        device: String,
        /// Bytes the device has free at most from now on (a higher figure changes nothing).
        memory_free: u64,
    },
    /// Forgets a node and the links to and from it; refused while it holds a deployment's stage.
    RemoveNode {
        /// The node's name.
        name: String,
    },
    /// The links a node measured from itself (replacing what it reported before).
    SetLinks {
        /// The measuring node: every link's `from`.
        from: String,
        /// One per other node it reached (positive bandwidth, non-negative latency).
        links: Vec<LinkRecord>,
    },
    /// A model the coordinator can serve (replaces a record of the same id).
    AddModel {
        /// The model's record, keyed by its id.
        model: ModelRecord,
    },
    /// A new deployment; its generation is assigned by [`ClusterState::apply`].
    CreateDeployment {
        /// The deployment; its `generation` is ignored and its stages start pending.
        deployment: Deployment,
    },
    /// Removes a deployment (undeploy); its workers drop their stages.
    RemoveDeployment {
        /// The deployment's name.
        name: String,
    },
    /// A new placement of an existing deployment (a node died, or a better one appeared): new
    /// stages and driver, the next generation; the note is cleared.
    ReplaceStages {
        /// The deployment's name.
        deployment: String,
        /// The new stages in pipeline order (they start pending).
        stages: Vec<StageRecord>,
        /// The new expert stages ([`Deployment::expert_stages`]).
        #[serde(default)]
        expert_stages: Vec<StageRecord>,
        /// The node that drives sessions from now on; it must hold a stage.
        driver: String,
        /// The planner's decode seconds per token of the new placement.
        predicted_decode_s: f64,
        /// The new placement as the planner explained it.
        plan_text: String,
        /// The new placement's split layers ([`Deployment::cpu_moe`]); `None`: unchanged.
        #[serde(default)]
        cpu_moe: Option<usize>,
    },
    /// Why a deployment cannot serve now (empty clears it).
    SetNote {
        /// The deployment's name.
        deployment: String,
        /// The reason, kept to its first 4000 characters.
        note: String,
    },
    /// A coordinator replica joined (`Some(address)`) or left (`None`) the raft group. Applied
    /// from the group's configuration changes, so every replica applies it at the same index.
    SetReplica {
        /// The replica's raft id.
        id: u64,
        /// Where it serves; `None` when it left.
        address: Option<String>,
    },
    /// A worker reports the state of one of its stages.
    StageReport {
        /// The deployment's name.
        deployment: String,
        /// The generation the report is for; a report of another generation is refused as stale.
        generation: u64,
        /// The stage's index in pipeline order, from 0.
        stage: usize,
        /// The reporting node, which must hold the stage.
        node: String,
        /// The stage's new state.
        state: StageState,
        /// Bytes of weights the worker loaded.
        weight_bytes: u64,
        /// Bytes of KV cache the worker allocated.
        kv_bytes: u64,
        /// Bytes the worker fetched from sources for the slice (0 when all was cached).
        fetched_bytes: u64,
    },
}

/// What an applied command did, for the caller's reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Applied {
    /// The command applied; nothing more to say.
    Done,
    /// The deployment was created with this generation.
    Deployed {
        /// The generation its (new) placement got; workers refuse frames of any other.
        generation: u64,
    },
}

/// Why a command did not apply (the state is unchanged).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum StateError {
    /// A node or deployment name outside its alphabet or length, or a malformed certificate
    /// fingerprint.
    #[error("invalid {what} name `{name}`: use 1-64 characters of letters, digits, `.`, `_`, `-`, starting with a letter or digit (node names: 1-63 lower-case letters, digits and `-`)")]
    BadName {
        /// What the name is for: `node`, `deployment`, `certificate fingerprint`.
        what: String,
        /// The name as given (a node or deployment name cut to 80 characters).
        name: String,
    },
    /// No node of this name is registered.
    #[error("unknown node `{0}`")]
    UnknownNode(String),
    /// A node registered without being admitted with the join token first.
    #[error("node `{0}` has not joined the cluster (it needs the join token first)")]
    NotAdmitted(String),
    /// The node has no device of this name (or registered one with an empty or too long name).
    #[error("node `{node}` has no device `{device}`")]
    UnknownDevice {
        /// The node's name.
        node: String,
        /// The device's name as given.
        device: String,
    },
    /// A placement uses a node that is not up.
    #[error("node `{0}` is down")]
    NodeDown(String),
    /// No deployment of this name.
    #[error("unknown deployment `{0}`")]
    UnknownDeployment(String),
    /// A deployment of this name exists already.
    #[error("a deployment named `{0}` exists already (undeploy it first)")]
    DeploymentExists(String),
    /// No model of this id (or a model record without an id or layers).
    #[error("unknown model `{0}`")]
    UnknownModel(String),
    /// A node to remove still holds stages.
    #[error("node `{node}` still holds stages of deployment(s) {deployments}")]
    NodeInUse {
        /// The node's name.
        node: String,
        /// The deployments holding stages there, comma-separated.
        deployments: String,
    },
    /// A deployment's stages do not cover its model's layers in order on existing devices, its
    /// context or sessions are 0, or its driver holds no stage.
    #[error("deployment `{name}`: {why}")]
    BadPlacement {
        /// The deployment's name.
        name: String,
        /// What is wrong with the placement.
        why: String,
    },
    /// A stage report for a placement that has since been replaced.
    #[error("deployment `{deployment}` is at generation {current}, the report is for {reported}")]
    StaleGeneration {
        /// The deployment's name.
        deployment: String,
        /// The deployment's generation now.
        current: u64,
        /// The generation the report was for.
        reported: u64,
    },
    /// A stage report for a stage index the deployment does not have.
    #[error("deployment `{deployment}` has {n} stages, no stage {stage}")]
    UnknownStage {
        /// The deployment's name.
        deployment: String,
        /// The stage index reported.
        stage: usize,
        /// Stages the deployment has.
        n: usize,
    },
    /// A stage report from a node that does not hold the stage.
    #[error("stage {stage} of `{deployment}` is on node `{owner}`, not `{node}`")]
    NotStageOwner {
        /// The deployment's name.
        deployment: String,
        /// The stage index reported.
        stage: usize,
        /// The node that holds the stage.
        owner: String,
        /// The node that reported.
        node: String,
    },
    /// A measured link a node may not report: from another node, to itself, or with a bandwidth
    /// that is not positive or a latency that is negative.
    #[error("invalid link from `{from}` to `{to}`: {why}")]
    BadLink {
        /// The link's sending node.
        from: String,
        /// The link's receiving node.
        to: String,
        /// What is wrong with it.
        why: String,
    },
}

/// The whole replicated state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    /// Nodes admitted with the join token, and the certificate each holds.
    pub admitted: BTreeMap<String, Admission>,
    /// Registered nodes by name.
    pub nodes: BTreeMap<String, NodeRecord>,
    /// Keyed by `from`, then `to`.
    pub links: BTreeMap<String, BTreeMap<String, LinkRecord>>,
    /// Models the coordinator can serve, by [`ModelRecord::id`].
    pub models: BTreeMap<String, ModelRecord>,
    /// Deployments by name.
    pub deployments: BTreeMap<String, Deployment>,
    /// The generation the next placement gets.
    pub next_generation: u64,
    /// Commands applied so far (a raft log index where raft drives it).
    pub applied: u64,
    /// The coordinator replicas (raft ids) and the addresses they serve on.
    #[serde(default)]
    pub replicas: BTreeMap<u64, String>,
    /// The last [`PROPOSALS_REMEMBERED`] proposals applied from each replica, by the replica's
    /// raft id: a proposal the network delivered twice is in the log twice and applies once,
    /// and a replica that caught up from a snapshot still answers its own proposals.
    #[serde(default)]
    pub proposals: BTreeMap<u64, VecDeque<Proposal>>,
}

/// How many of each replica's latest proposals [`ClusterState::apply_proposal`] remembers.
pub const PROPOSALS_REMEMBERED: usize = 256;

/// A proposal applied, and its result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    /// The proposing replica's number for it.
    pub ticket: u64,
    /// What [`ClusterState::apply`] returned.
    pub result: Result<Applied, StateError>,
}

impl ClusterState {
    /// An empty state; its first placement gets generation 1.
    pub fn new() -> Self {
        ClusterState { next_generation: 1, ..Default::default() }
    }

    /// Applies proposal `ticket` of replica `replica`: its result, or `None` for a copy of one
    /// among that replica's last [`PROPOSALS_REMEMBERED`], which changes nothing.
    pub fn apply_proposal(&mut self, replica: u64, ticket: u64, cmd: Command) -> Option<Result<Applied, StateError>> {
        if self.proposal(replica, ticket).is_some() {
            return None;
        }
        let result = self.apply(cmd);
        let seen = self.proposals.entry(replica).or_default();
        if seen.len() == PROPOSALS_REMEMBERED {
            seen.pop_front();
        }
        seen.push_back(Proposal { ticket, result: result.clone() });
        Some(result)
    }

    /// The result of proposal `ticket` of replica `replica`, while it is remembered.
    pub fn proposal(&self, replica: u64, ticket: u64) -> Option<&Result<Applied, StateError>> {
        self.proposals.get(&replica)?.iter().find(|p| p.ticket == ticket).map(|p| &p.result)
    }

    /// Applies one command. On error nothing has changed.
    pub fn apply(&mut self, cmd: Command) -> Result<Applied, StateError> {
        let out = match cmd {
            Command::AdmitNode { name, fingerprint, admitted_ms } => {
                check_node_name(&name)?;
                if fingerprint.len() != 64 || !fingerprint.bytes().all(|c| c.is_ascii_hexdigit()) {
                    return Err(StateError::BadName { what: "certificate fingerprint".into(), name: fingerprint });
                }
                self.admitted.insert(name, Admission { fingerprint, admitted_ms });
                Applied::Done
            }
            Command::RegisterNode { node } => {
                check_node_name(&node.name)?;
                if !self.admitted.contains_key(&node.name) {
                    return Err(StateError::NotAdmitted(node.name));
                }
                for d in &node.devices {
                    if d.name.is_empty() || d.name.len() > MAX_NAME_LEN {
                        return Err(StateError::UnknownDevice { node: node.name.clone(), device: d.name.clone() });
                    }
                }
                let mut node = node;
                let before = self.nodes.get(&node.name).map(|n| &n.lowered);
                let mut lowered = BTreeMap::new();
                for d in &mut node.devices {
                    if let Some(&(registered, to)) = before.and_then(|l| l.get(&d.name)) {
                        if registered == d.memory_free {
                            d.memory_free = d.memory_free.min(to);
                            lowered.insert(d.name.clone(), (registered, to));
                        }
                    }
                }
                self.nodes.insert(node.name.clone(), NodeRecord { state: NodeState::Up, lowered, ..node });
                Applied::Done
            }
            Command::SetNodeState { name, state } => {
                let n = self.nodes.get_mut(&name).ok_or(StateError::UnknownNode(name))?;
                n.state = state;
                Applied::Done
            }
            Command::LowerDeviceMemory { node, device, memory_free } => {
                let n = self.nodes.get_mut(&node).ok_or_else(|| StateError::UnknownNode(node.clone()))?;
                let d = n
                    .devices
                    .iter_mut()
                    .find(|d| d.name == device)
                    .ok_or(StateError::UnknownDevice { node, device })?;
                // only ever lower: a late report never raises what a later one lowered
                let registered = n.lowered.get(&d.name).map_or(d.memory_free, |&(r, _)| r);
                d.memory_free = d.memory_free.min(memory_free);
                n.lowered.insert(d.name.clone(), (registered, d.memory_free));
                Applied::Done
            }
            Command::RemoveNode { name } => {
                if !self.nodes.contains_key(&name) {
                    return Err(StateError::UnknownNode(name));
                }
                let users: Vec<&str> = self
                    .deployments
                    .values()
                    .filter(|d| d.every_stage().any(|s| s.node == name))
                    .map(|d| d.name.as_str())
                    .collect();
                if !users.is_empty() {
                    return Err(StateError::NodeInUse { node: name, deployments: users.join(", ") });
                }
                self.nodes.remove(&name);
                self.links.remove(&name);
                for to in self.links.values_mut() {
                    to.remove(&name);
                }
                Applied::Done
            }
            Command::SetLinks { from, links } => {
                if !self.nodes.contains_key(&from) {
                    return Err(StateError::UnknownNode(from));
                }
                let mut map = BTreeMap::new();
                for l in links {
                    let bad =
                        |why: &str| StateError::BadLink { from: l.from.clone(), to: l.to.clone(), why: why.into() };
                    if l.from != from {
                        return Err(bad("reported by another node"));
                    }
                    if !self.nodes.contains_key(&l.to) {
                        return Err(StateError::UnknownNode(l.to));
                    }
                    if l.to == from {
                        return Err(bad("a link to itself"));
                    }
                    if !(l.link.bandwidth.is_finite() && l.link.bandwidth > 0.0) {
                        return Err(bad("bandwidth must be positive"));
                    }
                    if !(l.link.latency.is_finite() && l.link.latency >= 0.0) {
                        return Err(bad("latency must be non-negative"));
                    }
                    map.insert(l.to.clone(), l);
                }
                self.links.insert(from, map);
                Applied::Done
            }
            Command::AddModel { model } => {
                if model.id.is_empty() || model.n_layers == 0 {
                    return Err(StateError::UnknownModel(model.id));
                }
                self.models.insert(model.id.clone(), model);
                Applied::Done
            }
            Command::CreateDeployment { deployment } => {
                let generation = self.next_generation;
                self.check_deployment(&deployment)?;
                let pending = |v: Vec<StageRecord>| -> Vec<StageRecord> {
                    v.into_iter().map(|s| StageRecord { state: StageState::Pending, fetched_bytes: 0, ..s }).collect()
                };
                let d = Deployment {
                    generation,
                    stages: pending(deployment.stages),
                    expert_stages: pending(deployment.expert_stages),
                    ..deployment
                };
                self.deployments.insert(d.name.clone(), d);
                self.next_generation += 1;
                Applied::Deployed { generation }
            }
            Command::ReplaceStages {
                deployment,
                stages,
                expert_stages,
                driver,
                predicted_decode_s,
                plan_text,
                cpu_moe,
            } => {
                let generation = self.next_generation;
                let d = self
                    .deployments
                    .get(&deployment)
                    .ok_or_else(|| StateError::UnknownDeployment(deployment.clone()))?;
                let candidate = Deployment {
                    stages: stages.clone(),
                    expert_stages: expert_stages.clone(),
                    driver: driver.clone(),
                    ..d.clone()
                };
                self.check_placement(&candidate)?;
                let d = self.deployments.get_mut(&deployment).ok_or(StateError::UnknownDeployment(deployment))?;
                let pending = |v: Vec<StageRecord>| -> Vec<StageRecord> {
                    v.into_iter().map(|s| StageRecord { state: StageState::Pending, fetched_bytes: 0, ..s }).collect()
                };
                d.stages = pending(stages);
                d.expert_stages = pending(expert_stages);
                d.driver = driver;
                d.predicted_decode_s = predicted_decode_s;
                d.plan_text = plan_text;
                if let Some(n) = cpu_moe {
                    d.cpu_moe = n;
                }
                d.generation = generation;
                d.replacements += 1;
                d.note.clear();
                self.next_generation += 1;
                Applied::Deployed { generation }
            }
            Command::SetNote { deployment, note } => {
                let d = self.deployments.get_mut(&deployment).ok_or(StateError::UnknownDeployment(deployment))?;
                d.note = note.chars().take(4000).collect();
                Applied::Done
            }
            Command::SetReplica { id, address } => {
                match address {
                    Some(a) => {
                        self.replicas.insert(id, a);
                    }
                    None => {
                        self.replicas.remove(&id);
                    }
                }
                Applied::Done
            }
            Command::RemoveDeployment { name } => {
                self.deployments.remove(&name).ok_or(StateError::UnknownDeployment(name))?;
                Applied::Done
            }
            Command::StageReport {
                deployment,
                generation,
                stage,
                node,
                state,
                weight_bytes,
                kv_bytes,
                fetched_bytes,
            } => {
                let d = self
                    .deployments
                    .get_mut(&deployment)
                    .ok_or_else(|| StateError::UnknownDeployment(deployment.clone()))?;
                if d.generation != generation {
                    return Err(StateError::StaleGeneration {
                        deployment,
                        current: d.generation,
                        reported: generation,
                    });
                }
                let n = d.stages.len() + d.expert_stages.len();
                let s =
                    d.stage_mut(stage).ok_or(StateError::UnknownStage { deployment: deployment.clone(), stage, n })?;
                if s.node != node {
                    return Err(StateError::NotStageOwner { deployment, stage, owner: s.node.clone(), node });
                }
                s.state = state;
                s.weight_bytes = weight_bytes;
                s.kv_bytes = kv_bytes;
                s.fetched_bytes = fetched_bytes;
                Applied::Done
            }
        };
        self.applied += 1;
        Ok(out)
    }

    fn check_deployment(&self, d: &Deployment) -> Result<(), StateError> {
        check_name("deployment", &d.name)?;
        if self.deployments.contains_key(&d.name) {
            return Err(StateError::DeploymentExists(d.name.clone()));
        }
        self.check_placement(d)
    }

    /// The stages of `d` cover its model's layers on devices of nodes that are up.
    fn check_placement(&self, d: &Deployment) -> Result<(), StateError> {
        let model = self.models.get(&d.model_id).ok_or_else(|| StateError::UnknownModel(d.model_id.clone()))?;
        let bad = |why: String| StateError::BadPlacement { name: d.name.clone(), why };
        if d.n_layers != model.n_layers {
            return Err(bad(format!("{} layers, the model has {}", d.n_layers, model.n_layers)));
        }
        if d.stages.is_empty() {
            return Err(bad("no stages".into()));
        }
        if d.n_ctx == 0 || d.sessions == 0 {
            return Err(bad(format!("context {} and sessions {} must be positive", d.n_ctx, d.sessions)));
        }
        let mut next = 0;
        for s in &d.stages {
            if s.layers.start() != next {
                return Err(bad(format!("stage {} does not start where the previous one ended ({next})", s.layers)));
            }
            next = s.layers.end();
            let node = self.nodes.get(&s.node).ok_or_else(|| StateError::UnknownNode(s.node.clone()))?;
            if node.state != NodeState::Up {
                return Err(StateError::NodeDown(s.node.clone()));
            }
            if !node.devices.iter().any(|x| x.name == s.device) {
                return Err(StateError::UnknownDevice { node: s.node.clone(), device: s.device.clone() });
            }
        }
        if next != d.n_layers {
            return Err(bad(format!("stages cover {next} of {} layers", d.n_layers)));
        }
        if let Some(s) = d.stages.iter().find(|s| s.experts.is_some()) {
            return Err(bad(format!("stage {} of the pipeline names experts", s.layers)));
        }
        for (i, s) in d.expert_stages.iter().enumerate() {
            let Some(ids) = s.experts else {
                return Err(bad(format!("expert stage {i} names no experts")));
            };
            if model.experts == 0 {
                return Err(bad(format!("expert stage {i}: the model has no experts")));
            }
            if ids.start >= ids.end || ids.end as usize > model.experts {
                return Err(bad(format!("expert stage {i}: experts {ids} of a model with {}", model.experts)));
            }
            if s.layers.end() > d.n_layers {
                return Err(bad(format!("expert stage {i}: layers {} of {}", s.layers, d.n_layers)));
            }
            let node = self.nodes.get(&s.node).ok_or_else(|| StateError::UnknownNode(s.node.clone()))?;
            if node.state != NodeState::Up {
                return Err(StateError::NodeDown(s.node.clone()));
            }
            if !node.devices.iter().any(|x| x.name == s.device) {
                return Err(StateError::UnknownDevice { node: s.node.clone(), device: s.device.clone() });
            }
            let clash = d.expert_stages[..i].iter().position(|o| {
                o.experts.is_some_and(|e| e.overlaps(&ids))
                    && o.layers.start() < s.layers.end()
                    && s.layers.start() < o.layers.end()
            });
            if let Some(j) = clash {
                return Err(bad(format!("expert stages {j} and {i} both hold experts of the same layer")));
            }
        }
        if !d.stages.iter().any(|s| s.node == d.driver) {
            return Err(StateError::BadPlacement {
                name: d.name.clone(),
                why: format!("the driver `{}` holds no stage", d.driver),
            });
        }
        Ok(())
    }

    /// A deployment's overall state, from its stages and their nodes.
    pub fn deployment_state(&self, d: &Deployment) -> DeploymentState {
        if d.every_stage().any(|s| self.nodes.get(&s.node).is_none_or(|n| n.state == NodeState::Down)) {
            return DeploymentState::Degraded;
        }
        if d.every_stage().any(|s| matches!(s.state, StageState::Failed(_))) {
            return DeploymentState::Failed;
        }
        if d.every_stage().all(|s| s.state == StageState::Ready) {
            return DeploymentState::Ready;
        }
        if d.replacements > 0 {
            DeploymentState::Replacing
        } else {
            DeploymentState::Loading
        }
    }

    /// The stages a node holds, expert stages included: (deployment, [`Deployment::stage`] index).
    pub fn stages_of<'a>(&'a self, node: &'a str) -> impl Iterator<Item = (&'a Deployment, usize)> + 'a {
        self.deployments.values().flat_map(move |d| {
            d.every_stage().enumerate().filter(move |(_, s)| s.node == node).map(move |(i, _)| (d, i))
        })
    }

    /// Every measured link, both directions.
    pub fn all_links(&self) -> impl Iterator<Item = &LinkRecord> {
        self.links.values().flat_map(|m| m.values())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::DeviceKind;

    fn node(name: &str) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            address: format!("{name}:1"),
            devices: vec![DeviceFigures {
                name: "cpu".into(),
                kind: DeviceKind::Cpu,
                model: "test".into(),
                memory_total: 1 << 30,
                memory_free: 1 << 30,
                mem_bandwidth: 1e10,
                flops: 1e11,
                kernels: vec![],
                threads: 1,
                features: String::new(),
                host_link: None,
            }],
            version: "t".into(),
            state: NodeState::Up,
            registered_ms: 0,
            lowered: Default::default(),
        }
    }

    fn model() -> ModelRecord {
        ModelRecord {
            id: "m1".into(),
            name: "m".into(),
            source: "embedded".into(),
            files: vec![],
            ranges: vec![],
            n_layers: 5,
            context_length: 512,
            profile: crate::ModelProfile::from_shape("m", &crate::LlamaShape::preset("llama-1b").unwrap(), 4.5, 4),
            weight_types: vec![("q4_k".into(), 100)],
            experts: 0,
        }
    }

    fn stage(node: &str, a: usize, b: usize) -> StageRecord {
        StageRecord {
            node: node.into(),
            device: "cpu".into(),
            layers: LayerRange::new(a, b).unwrap(),
            state: StageState::Ready,
            weight_bytes: 0,
            kv_bytes: 0,
            fetched_bytes: 7,
            predicted_s: 0.0,
            experts: None,
        }
    }

    fn deployment(name: &str, stages: Vec<StageRecord>) -> Deployment {
        Deployment {
            name: name.into(),
            model_id: "m1".into(),
            generation: 0,
            n_layers: 5,
            n_ctx: 64,
            sessions: 4,
            objective: "latency".into(),
            act_dtype: ActDtype::F32,
            carrier: CarrierKind::Quic,
            driver: stages[0].node.clone(),
            stages,
            predicted_decode_s: 0.0,
            plan_text: String::new(),
            created_ms: 0,
            ubatch: 0,
            replacements: 0,
            note: String::new(),
            by_hand: false,
            cpu_moe: 0,
            cpu_moe_auto: false,
            expert_stages: vec![],
        }
    }

    fn admit(name: &str) -> Command {
        Command::AdmitNode { name: name.into(), fingerprint: "ab".repeat(32), admitted_ms: 1 }
    }

    #[test]
    fn a_proposal_applies_once_however_often_the_log_holds_it() {
        let mut s = ClusterState::new();
        assert_eq!(s.apply_proposal(1, 10, admit("a")), Some(Ok(Applied::Done)));
        let refused = s.apply_proposal(2, 10, Command::RegisterNode { node: node("b") });
        assert_eq!(refused, Some(Err(StateError::NotAdmitted("b".into()))), "another replica's ticket 10");
        let before = s.clone();
        assert_eq!(s.apply_proposal(1, 10, Command::RemoveNode { name: "a".into() }), None, "a copy");
        assert_eq!(s, before, "a copy changes nothing");
        assert_eq!(s.proposal(2, 10), Some(&Err(StateError::NotAdmitted("b".into()))), "results are kept");
        for t in 11..11 + PROPOSALS_REMEMBERED as u64 {
            assert!(s.apply_proposal(1, t, admit("a")).is_some());
        }
        assert_eq!(s.proposals[&1].len(), PROPOSALS_REMEMBERED, "the memory is bounded");
        assert_eq!(s.proposal(1, 10), None, "forgotten once {PROPOSALS_REMEMBERED} newer ones applied");
        let back: ClusterState = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s, "snapshots carry the memory, so every replica decides alike");
    }

    fn cluster() -> ClusterState {
        let mut s = ClusterState::new();
        for n in ["a", "b", "c"] {
            s.apply(admit(n)).unwrap();
            s.apply(Command::RegisterNode { node: node(n) }).unwrap();
        }
        s.apply(Command::AddModel { model: model() }).unwrap();
        s
    }

    #[test]
    fn expert_stages_are_checked_numbered_after_the_pipeline_and_reported_on() {
        let mut s = cluster();
        s.apply(Command::AddModel { model: ModelRecord { id: "moe".into(), experts: 8, ..model() } }).unwrap();
        let experts = |node: &str, a: u32, b: u32, layers: (usize, usize)| StageRecord {
            experts: Some(ExpertIds { start: a, end: b }),
            state: StageState::Pending,
            ..stage(node, layers.0, layers.1)
        };
        let with = |model: &str, e: Vec<StageRecord>| Deployment {
            model_id: model.into(),
            expert_stages: e,
            ..deployment("d", vec![stage("a", 0, 3), stage("b", 3, 5)])
        };
        let refused = |s: &mut ClusterState, d: Deployment| {
            let before = s.clone();
            let e = s.apply(Command::CreateDeployment { deployment: d }).unwrap_err().to_string();
            assert_eq!(*s, before, "a refused deployment changes nothing");
            e
        };
        assert!(refused(&mut s, with("m1", vec![experts("c", 0, 4, (0, 5))])).contains("has no experts"));
        assert!(
            refused(&mut s, with("moe", vec![experts("c", 4, 9, (0, 5))])).contains("experts 4..9 of a model with 8")
        );
        let e = refused(&mut s, with("moe", vec![experts("c", 0, 4, (0, 5)), experts("b", 3, 6, (2, 3))]));
        assert!(e.contains("expert stages 0 and 1"), "{e}");
        let e = refused(&mut s, with("moe", vec![StageRecord { experts: None, ..experts("c", 0, 4, (0, 5)) }]));
        assert!(e.contains("names no experts"), "{e}");
        // disjoint ids, or the same ids of other layers: accepted
        let d = with("moe", vec![experts("c", 0, 4, (0, 5)), experts("b", 4, 8, (0, 2)), experts("a", 4, 8, (2, 5))]);
        let generation = match s.apply(Command::CreateDeployment { deployment: d }).unwrap() {
            Applied::Deployed { generation } => generation,
            other => panic!("{other:?}"),
        };
        let got = &s.deployments["d"];
        assert_eq!(got.stage(2).unwrap().node, "c");
        assert_eq!(got.stage(4).unwrap().node, "a");
        assert!(got.stage(5).is_none());
        assert_eq!(s.stages_of("c").map(|(_, i)| i).collect::<Vec<_>>(), vec![2]);
        assert_eq!(s.stages_of("a").map(|(_, i)| i).collect::<Vec<_>>(), vec![0, 4]);
        let report = |stage: usize, node: &str| Command::StageReport {
            deployment: "d".into(),
            generation,
            stage,
            node: node.into(),
            state: StageState::Ready,
            weight_bytes: 9,
            kv_bytes: 0,
            fetched_bytes: 1,
        };
        for (i, n) in [(0, "a"), (1, "b"), (2, "c"), (3, "b")] {
            s.apply(report(i, n)).unwrap();
        }
        assert_eq!(s.deployment_state(&s.deployments["d"]), DeploymentState::Loading, "an expert stage still loads");
        assert!(matches!(s.apply(report(4, "b")), Err(StateError::NotStageOwner { .. })));
        assert!(matches!(s.apply(report(5, "a")), Err(StateError::UnknownStage { n: 5, .. })));
        s.apply(report(4, "a")).unwrap();
        assert_eq!(s.deployment_state(&s.deployments["d"]), DeploymentState::Ready);
        assert_eq!(s.deployments["d"].expert_stages[2].weight_bytes, 9);
        s.apply(Command::SetNodeState { name: "c".into(), state: NodeState::Down }).unwrap();
        assert_eq!(s.deployment_state(&s.deployments["d"]), DeploymentState::Degraded, "an expert node is down");
        let e = s.apply(Command::RemoveNode { name: "c".into() }).unwrap_err();
        assert!(matches!(e, StateError::NodeInUse { .. }), "{e}");
    }

    #[test]
    fn a_device_that_ran_out_of_memory_offers_less_and_never_more() {
        let mut s = cluster();
        let before = s.nodes["a"].devices[0].memory_free;
        let lower = |memory_free| Command::LowerDeviceMemory { node: "a".into(), device: "cpu".into(), memory_free };
        s.apply(lower(before / 2)).unwrap();
        assert_eq!(s.nodes["a"].devices[0].memory_free, before / 2);
        // a late report of more memory lowers nothing
        s.apply(lower(before)).unwrap();
        assert_eq!(s.nodes["a"].devices[0].memory_free, before / 2);
        let e = s
            .apply(Command::LowerDeviceMemory { node: "a".into(), device: "cuda0".into(), memory_free: 1 })
            .unwrap_err();
        assert_eq!(e.to_string(), "node `a` has no device `cuda0`");
        let e = s.apply(Command::LowerDeviceMemory { node: "z".into(), device: "cpu".into(), memory_free: 1 });
        assert!(matches!(e, Err(StateError::UnknownNode(_))));
        // a failed command changed nothing
        assert_eq!(s.nodes["a"].devices[0].memory_free, before / 2);

        // a reconnect resends the figures measured at start: the lowering stays
        s.apply(Command::RegisterNode { node: node("a") }).unwrap();
        assert_eq!(s.nodes["a"].devices[0].memory_free, before / 2);
        s.apply(lower(before / 4)).unwrap();
        s.apply(Command::RegisterNode { node: node("a") }).unwrap();
        assert_eq!(s.nodes["a"].devices[0].memory_free, before / 4, "lowered twice, still from the first figure");
        // a restart measures afresh: new figures end the lowering
        let mut restarted = node("a");
        restarted.devices[0].memory_free = before - 1;
        s.apply(Command::RegisterNode { node: restarted.clone() }).unwrap();
        assert_eq!(s.nodes["a"].devices[0].memory_free, before - 1);
        assert!(s.nodes["a"].lowered.is_empty());
        s.apply(Command::RegisterNode { node: node("a") }).unwrap();
        assert_eq!(s.nodes["a"].devices[0].memory_free, before);
    }

    #[test]
    fn deploy_report_and_undeploy() {
        let mut s = cluster();
        let d = deployment("d", vec![stage("a", 0, 2), stage("b", 2, 5)]);
        assert_eq!(
            s.apply(Command::CreateDeployment { deployment: d.clone() }).unwrap(),
            Applied::Deployed { generation: 1 }
        );
        let got = &s.deployments["d"];
        // stage states and fetched bytes come from the workers, never from the request
        assert!(got.stages.iter().all(|x| x.state == StageState::Pending && x.fetched_bytes == 0));
        assert_eq!(s.deployment_state(got), DeploymentState::Loading);
        let report = |stage: usize, node: &str, generation: u64| Command::StageReport {
            deployment: "d".into(),
            generation,
            stage,
            node: node.into(),
            state: StageState::Ready,
            weight_bytes: 10,
            kv_bytes: 2,
            fetched_bytes: 3,
        };
        assert!(matches!(s.apply(report(0, "a", 9)), Err(StateError::StaleGeneration { current: 1, reported: 9, .. })));
        assert!(matches!(s.apply(report(0, "b", 1)), Err(StateError::NotStageOwner { .. })));
        assert!(matches!(s.apply(report(2, "a", 1)), Err(StateError::UnknownStage { n: 2, .. })));
        s.apply(report(0, "a", 1)).unwrap();
        s.apply(report(1, "b", 1)).unwrap();
        assert_eq!(s.deployment_state(&s.deployments["d"]), DeploymentState::Ready);
        // a node that holds stages cannot be removed; a down node degrades the deployment
        assert!(matches!(s.apply(Command::RemoveNode { name: "a".into() }), Err(StateError::NodeInUse { .. })));
        s.apply(Command::SetNodeState { name: "b".into(), state: NodeState::Down }).unwrap();
        assert_eq!(s.deployment_state(&s.deployments["d"]), DeploymentState::Degraded);
        // the next deployment gets the next generation
        assert!(matches!(
            s.apply(Command::CreateDeployment { deployment: d.clone() }),
            Err(StateError::DeploymentExists(_))
        ));
        s.apply(Command::RemoveDeployment { name: "d".into() }).unwrap();
        s.apply(Command::SetNodeState { name: "b".into(), state: NodeState::Up }).unwrap();
        assert_eq!(s.apply(Command::CreateDeployment { deployment: d }).unwrap(), Applied::Deployed { generation: 2 });
    }

    #[test]
    fn replacement_bumps_the_generation_and_checks_the_new_stages() {
        let mut s = cluster();
        s.apply(Command::CreateDeployment { deployment: deployment("d", vec![stage("a", 0, 2), stage("b", 2, 5)]) })
            .unwrap();
        s.apply(Command::SetNodeState { name: "b".into(), state: NodeState::Down }).unwrap();
        assert_eq!(s.deployment_state(&s.deployments["d"]), DeploymentState::Degraded);
        let replace = |stages: Vec<StageRecord>, driver: &str| Command::ReplaceStages {
            deployment: "d".into(),
            stages,
            expert_stages: vec![],
            driver: driver.into(),
            predicted_decode_s: 1.0,
            plan_text: "p".into(),
            cpu_moe: None,
        };
        // onto the node that is down, or with a driver that holds no stage: refused
        let before = s.clone();
        assert!(matches!(s.apply(replace(vec![stage("b", 0, 5)], "b")), Err(StateError::NodeDown(_))));
        assert!(matches!(s.apply(replace(vec![stage("a", 0, 5)], "c")), Err(StateError::BadPlacement { .. })));
        assert_eq!(s, before);
        s.apply(Command::SetNote { deployment: "d".into(), note: "short by 3 bytes".into() }).unwrap();
        assert_eq!(
            s.apply(replace(vec![stage("a", 0, 3), stage("c", 3, 5)], "a")).unwrap(),
            Applied::Deployed { generation: 2 }
        );
        let d = &s.deployments["d"];
        assert_eq!((d.generation, d.replacements, d.note.as_str(), d.cpu_moe), (2, 1, "", 0));
        assert_eq!(s.deployment_state(d), DeploymentState::Replacing);
        // a re-placement that searched the split again records the one placed
        let resplit = Command::ReplaceStages {
            deployment: "d".into(),
            stages: vec![stage("a", 0, 5)],
            expert_stages: vec![],
            driver: "a".into(),
            predicted_decode_s: 1.0,
            plan_text: "p".into(),
            cpu_moe: Some(3),
        };
        s.apply(resplit).unwrap();
        assert_eq!(s.deployments["d"].cpu_moe, 3);
        s.apply(Command::SetReplica { id: 2, address: Some("x:1".into()) }).unwrap();
        s.apply(Command::SetReplica { id: 2, address: None }).unwrap();
        assert!(s.replicas.is_empty());
    }

    #[test]
    fn bad_commands_change_nothing() {
        let s0 = cluster();
        let bad = vec![
            Command::CreateDeployment { deployment: deployment("gap", vec![stage("a", 0, 2), stage("b", 3, 5)]) },
            Command::CreateDeployment { deployment: deployment("short", vec![stage("a", 0, 4)]) },
            Command::CreateDeployment { deployment: deployment("ghost", vec![stage("zz", 0, 5)]) },
            Command::CreateDeployment { deployment: deployment("bad name!", vec![stage("a", 0, 5)]) },
            Command::CreateDeployment {
                deployment: Deployment { model_id: "nope".into(), ..deployment("m", vec![stage("a", 0, 5)]) },
            },
            Command::CreateDeployment {
                deployment: {
                    let mut d = deployment("dev", vec![stage("a", 0, 5)]);
                    d.stages[0].device = "cuda7".into();
                    d
                },
            },
            Command::RemoveDeployment { name: "none".into() },
            Command::SetNodeState { name: "zz".into(), state: NodeState::Down },
            Command::RegisterNode { node: node("") },
            Command::RegisterNode { node: node("never-admitted") },
            Command::AdmitNode { name: "d".into(), fingerprint: "not hex".into(), admitted_ms: 0 },
            Command::RegisterNode { node: node(&"x".repeat(65)) },
            Command::SetLinks {
                from: "a".into(),
                links: vec![LinkRecord {
                    from: "a".into(),
                    to: "b".into(),
                    link: Link { bandwidth: f64::NAN, latency: 0.0 },
                    measured_ms: 0,
                }],
            },
            Command::SetLinks {
                from: "a".into(),
                links: vec![LinkRecord {
                    from: "b".into(),
                    to: "c".into(),
                    link: Link { bandwidth: 1.0, latency: 0.0 },
                    measured_ms: 0,
                }],
            },
        ];
        for cmd in bad {
            let mut s = s0.clone();
            assert!(s.apply(cmd.clone()).is_err(), "{cmd:?} applied");
            assert_eq!(s, s0, "{cmd:?} changed the state");
        }
    }

    #[test]
    fn replay_gives_the_same_state() {
        // the raft property: the same log applied anywhere gives the same state
        let log = vec![
            admit("a"),
            admit("b"),
            Command::RegisterNode { node: node("a") },
            Command::RegisterNode { node: node("b") },
            Command::AddModel { model: model() },
            Command::SetLinks {
                from: "a".into(),
                links: vec![LinkRecord {
                    from: "a".into(),
                    to: "b".into(),
                    link: Link { bandwidth: 1e9, latency: 1e-4 },
                    measured_ms: 5,
                }],
            },
            Command::CreateDeployment { deployment: deployment("d", vec![stage("a", 0, 1), stage("b", 1, 5)]) },
            Command::RemoveDeployment { name: "nope".into() },
        ];
        let run = || {
            let mut s = ClusterState::new();
            for c in log.clone() {
                let _ = s.apply(c);
            }
            s
        };
        let (x, y) = (run(), run());
        assert_eq!(x, y);
        assert_eq!(x.applied, 7, "the failed command is not counted");
        let json = serde_json::to_string(&x).unwrap();
        assert_eq!(serde_json::from_str::<ClusterState>(&json).unwrap(), x);
        assert_eq!(x.all_links().count(), 1);
        assert_eq!(x.stages_of("b").map(|(d, i)| (d.name.as_str(), i)).collect::<Vec<_>>(), vec![("d", 1)]);
    }

    #[test]
    fn names() {
        assert!(check_node_name("w-1").is_ok());
        for bad in ["W1", "w.1", "-w", "w-", "w_1", ""] {
            assert!(check_node_name(bad).is_err(), "{bad}");
        }
        assert!(check_name("deployment", "w-1.local_x").is_ok());
        for bad in ["", "-a", "a b", "a/b", "ä"] {
            assert!(check_name("node", bad).is_err(), "{bad}");
        }
    }
}
