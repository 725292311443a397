//! The SDK's results as plain Rust types, converted from the wire in one place (`From` the
//! prost messages): callers never touch generated protobuf types, and a number the wire may carry
//! that this SDK does not know (a newer server's stop reason) is kept, not lost. The fields and
//! names follow the Python SDK's `brigade_client.types`.

pub use brigade_core::cluster::{ActDtype, CarrierKind};
use brigade_proto::convert::{act_dtype_to_proto, carrier_to_proto};
use brigade_proto::v1;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` reached.
    Length,
    /// An end-of-generation token.
    Eos,
    /// The context is full.
    Context,
    /// The caller went away.
    Cancelled,
    /// One of the request's stop strings.
    Stop,
    /// A reason this SDK does not know (its wire number).
    Other(i32),
}

impl StopReason {
    /// The name `brigade generate --json` uses (`length`, `eos`, `context`, `caller`, `stop`;
    /// the Python SDK says `cancelled` for `caller`).
    pub fn name(self) -> &'static str {
        match self {
            StopReason::Length => "length",
            StopReason::Eos => "eos",
            StopReason::Context => "context",
            StopReason::Cancelled => "caller",
            StopReason::Stop => "stop",
            StopReason::Other(_) => "unknown",
        }
    }
}

impl From<i32> for StopReason {
    fn from(n: i32) -> Self {
        match v1::StopReason::try_from(n) {
            Ok(v1::StopReason::Length) => StopReason::Length,
            Ok(v1::StopReason::Eos) => StopReason::Eos,
            Ok(v1::StopReason::Context) => StopReason::Context,
            Ok(v1::StopReason::Cancelled) => StopReason::Cancelled,
            Ok(v1::StopReason::Stop) => StopReason::Stop,
            _ => StopReason::Other(n),
        }
    }
}

/// A node's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    /// Registered and taken to be running: placements may use it.
    Up,
    /// Declared down: no new stages go there, its deployments are degraded.
    Down,
    /// A state this SDK does not know (its wire number).
    Other(i32),
}

/// A stage's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageState {
    /// Placed; its worker has not reported on it yet.
    Pending,
    /// Its worker is fetching and loading the slice.
    Loading,
    /// Loaded and serving.
    Ready,
    /// The load failed ([`Stage::error`] says why).
    Failed,
    /// A state this SDK does not know (its wire number).
    Other(i32),
}

/// A deployment's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeploymentState {
    /// Some stage has not reported yet.
    Loading,
    /// Placed again (a node died, or a better placement appeared): stages are loading.
    Replacing,
    /// Every stage is loaded and serving.
    Ready,
    /// A stage failed to load.
    Failed,
    /// A stage's node is down.
    Degraded,
    /// A state this SDK does not know (its wire number).
    Other(i32),
}

impl NodeState {
    /// The name the CLI and the Python SDK use: `up`, `down` (`unknown` for [`NodeState::Other`]).
    pub fn name(self) -> &'static str {
        match self {
            NodeState::Up => "up",
            NodeState::Down => "down",
            NodeState::Other(_) => "unknown",
        }
    }
}

impl StageState {
    /// The name the CLI and the Python SDK use: `pending`, `loading`, `ready`, `failed`
    /// (`unknown` for [`StageState::Other`]).
    pub fn name(self) -> &'static str {
        match self {
            StageState::Pending => "pending",
            StageState::Loading => "loading",
            StageState::Ready => "ready",
            StageState::Failed => "failed",
            StageState::Other(_) => "unknown",
        }
    }
}

impl DeploymentState {
    /// The name the CLI and the Python SDK use: `loading`, `re-placing`, `ready`, `failed`,
    /// `degraded` (`unknown` for [`DeploymentState::Other`]).
    pub fn name(self) -> &'static str {
        match self {
            DeploymentState::Loading => "loading",
            DeploymentState::Replacing => "re-placing",
            DeploymentState::Ready => "ready",
            DeploymentState::Failed => "failed",
            DeploymentState::Degraded => "degraded",
            DeploymentState::Other(_) => "unknown",
        }
    }
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for StageState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for DeploymentState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl From<i32> for NodeState {
    fn from(n: i32) -> Self {
        match v1::NodeState::try_from(n) {
            Ok(v1::NodeState::Up) => NodeState::Up,
            Ok(v1::NodeState::Down) => NodeState::Down,
            _ => NodeState::Other(n),
        }
    }
}

impl From<i32> for StageState {
    fn from(n: i32) -> Self {
        match v1::StageState::try_from(n) {
            Ok(v1::StageState::Pending) => StageState::Pending,
            Ok(v1::StageState::Loading) => StageState::Loading,
            Ok(v1::StageState::Ready) => StageState::Ready,
            Ok(v1::StageState::Failed) => StageState::Failed,
            _ => StageState::Other(n),
        }
    }
}

impl From<i32> for DeploymentState {
    fn from(n: i32) -> Self {
        match v1::DeploymentState::try_from(n) {
            Ok(v1::DeploymentState::Loading) => DeploymentState::Loading,
            Ok(v1::DeploymentState::Replacing) => DeploymentState::Replacing,
            Ok(v1::DeploymentState::Ready) => DeploymentState::Ready,
            Ok(v1::DeploymentState::Failed) => DeploymentState::Failed,
            Ok(v1::DeploymentState::Degraded) => DeploymentState::Degraded,
            _ => DeploymentState::Other(n),
        }
    }
}

/// One stage's share of a decoded token.
#[derive(Debug, Clone, PartialEq)]
pub struct HopTiming {
    /// Stage index, from 0.
    pub stage: u32,
    /// The node the stage runs on.
    pub node: String,
    /// The device of that node the stage runs on.
    pub device: String,
    /// Mean compute seconds per decoded token in this stage.
    pub compute_s: f64,
    /// Mean seconds per decoded token from this stage to the next (the last: to the driver).
    pub transfer_s: f64,
    /// Bytes sent over this stage's hop per decoded token.
    pub bytes_per_token: u64,
}

/// A generation's figures.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Timings {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated and streamed.
    pub generated_tokens: u32,
    /// Seconds from the start until the first token (the prompt's processing).
    pub prompt_s: f64,
    /// Seconds from the first token to the last.
    pub generate_s: f64,
    /// Prompt tokens processed per second, up to the first token.
    pub prompt_tokens_per_s: f64,
    /// Tokens per second after the first token (0 with none): one per decode pass, or with
    /// speculative decoding every token a pass's draws took.
    pub generate_tokens_per_s: f64,
    /// Time to first token, seconds.
    pub ttft_s: f64,
    /// Per stage: where a decoded token's time went.
    pub hops: Vec<HopTiming>,
    /// Trips round the stages after the first token.
    pub decode_passes: u32,
    /// Speculative decoding: drafted tokens sent through the stages.
    pub drafted_tokens: u32,
    /// Speculative decoding: drafted tokens the last stage's draws took.
    pub accepted_tokens: u32,
}

impl From<v1::Timings> for Timings {
    fn from(t: v1::Timings) -> Self {
        Timings {
            prompt_tokens: t.prompt_tokens,
            generated_tokens: t.generated_tokens,
            prompt_s: t.prompt_s,
            generate_s: t.generate_s,
            prompt_tokens_per_s: t.prompt_tokens_per_s,
            generate_tokens_per_s: t.generate_tokens_per_s,
            ttft_s: t.ttft_s,
            decode_passes: t.decode_passes,
            drafted_tokens: t.drafted_tokens,
            accepted_tokens: t.accepted_tokens,
            hops: t
                .hops
                .into_iter()
                .map(|h| HopTiming {
                    stage: h.stage,
                    node: h.node,
                    device: h.device,
                    compute_s: h.compute_s,
                    transfer_s: h.transfer_s,
                    bytes_per_token: h.bytes_per_token,
                })
                .collect(),
        }
    }
}

/// The end of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Done {
    /// Why the generation ended.
    pub stop: StopReason,
    /// `None` when the server sent none.
    pub timings: Option<Timings>,
    /// Text still held back at the end (an incomplete character; text that could have begun a
    /// stop string and did not).
    pub text_tail: String,
}

impl From<v1::Done> for Done {
    fn from(d: v1::Done) -> Self {
        Done { stop: d.stop.into(), timings: d.timings.map(Into::into), text_tail: d.text_tail }
    }
}

/// A kernel's measured rates on a device for one weight type.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelRate {
    /// The ggml weight type as brigade prints it: `q4_k`, `q8_0`, `f16`, `f32`, …
    pub weight_type: String,
    /// One-token matrix-vector product: weight bytes read per second.
    pub decode_bytes_per_s: f64,
    /// Prompt matrix-matrix product: floating-point operations per second.
    pub prompt_flops: f64,
}

/// A device of a node, as its worker measured it.
#[derive(Debug, Clone, PartialEq)]
pub struct Device {
    /// `cpu`, `cuda0`, …
    pub name: String,
    /// `cpu` or `cuda`.
    pub kind: String,
    /// Human-readable model name, e.g. `AMD EPYC` or `NVIDIA H200`.
    pub model: String,
    /// Total memory, bytes.
    pub memory_total: u64,
    /// Bytes that may hold weights and KV caches now.
    pub memory_free: u64,
    /// Measured streaming read bandwidth, bytes/s.
    pub mem_bandwidth: f64,
    /// Measured generic compute rate, flop/s (the best prompt kernel's rate).
    pub flops: f64,
    /// Threads brigade uses on this device (CPU; 0 for a GPU).
    pub threads: u32,
    /// Instruction sets that picked the kernels (CPU), e.g. `avx2 fma f16c`; empty for a GPU.
    pub features: String,
    /// Measured rates of brigade's kernels, one per weight type.
    pub kernels: Vec<KernelRate>,
    /// Bandwidth of the device's link to its host CPU (PCIe), bytes/s; 0 for a CPU.
    pub host_link_bandwidth: f64,
    /// Latency of the link to the host CPU, seconds; 0 for a CPU.
    pub host_link_latency_s: f64,
}

impl From<v1::Device> for Device {
    fn from(d: v1::Device) -> Self {
        let kind = match v1::DeviceKind::try_from(d.kind) {
            Ok(v1::DeviceKind::Cpu) => "cpu",
            Ok(v1::DeviceKind::Cuda) => "cuda",
            _ => "unknown",
        };
        Device {
            name: d.name,
            kind: kind.into(),
            model: d.model,
            memory_total: d.memory_total,
            memory_free: d.memory_free,
            mem_bandwidth: d.mem_bandwidth,
            flops: d.flops,
            threads: d.threads,
            features: d.features,
            host_link_bandwidth: d.host_link_bandwidth,
            host_link_latency_s: d.host_link_latency_s,
            kernels: d
                .kernels
                .into_iter()
                .map(|k| KernelRate {
                    weight_type: k.weight_type,
                    decode_bytes_per_s: k.decode_bytes_per_s,
                    prompt_flops: k.prompt_flops,
                })
                .collect(),
        }
    }
}

/// A measured link from one node to another.
#[derive(Debug, Clone, PartialEq)]
pub struct Link {
    /// The node that measured the link (the sending end).
    pub from: String,
    /// The node at the other end.
    pub to: String,
    /// One-way latency (half the measured round trip), seconds.
    pub latency_s: f64,
    /// Measured throughput of a bulk transfer, bytes/s.
    pub bandwidth: f64,
    /// When it was measured, Unix ms.
    pub measured_at_ms: u64,
}

/// A worker node.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The node's name.
    pub name: String,
    /// `host:port` where the node's worker takes QUIC and gRPC from peers and the coordinator.
    pub address: String,
    /// Up or down.
    pub state: NodeState,
    /// The node's devices, as its worker measured them.
    pub devices: Vec<Device>,
    /// Milliseconds since the node's last heartbeat (0 if never).
    pub heartbeat_age_ms: u64,
    /// The brigade version the node's worker registered with.
    pub version: String,
}

/// One stage of a deployment: a layer range on a device of a node.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    /// Stage index, from 0.
    pub index: u32,
    /// The node the stage runs on.
    pub node: String,
    /// The device of that node the stage runs on.
    pub device: String,
    /// The first layer of the stage.
    pub layer_start: u32,
    /// One past the last layer of the stage (`layer_start..layer_end`).
    pub layer_end: u32,
    /// Pending, loading, ready or failed.
    pub state: StageState,
    /// Why the stage failed; empty unless it failed.
    pub error: String,
    /// Bytes of weights the stage holds (the plan's figure until its worker reports).
    pub weight_bytes: u64,
    /// Bytes of KV cache the stage holds (the plan's figure until its worker reports).
    pub kv_bytes: u64,
    /// Bytes the stage's worker fetched to load it (0 when everything was cached).
    pub fetched_bytes: u64,
    /// The planner's seconds per decoded token for this stage.
    pub predicted_s: f64,
    /// Measured mean seconds per decoded token for this stage (compute and transfer); 0 before any.
    pub measured_s: f64,
    /// The stage node's `host:port`.
    pub address: String,
    /// An expert stage's routed experts `start..end` (of every layer it covers); `None` on the
    /// pipeline's stages.
    pub experts: Option<(u32, u32)>,
}

impl From<v1::StageInfo> for Stage {
    fn from(s: v1::StageInfo) -> Self {
        Stage {
            index: s.index,
            node: s.node,
            device: s.device,
            layer_start: s.layer_start,
            layer_end: s.layer_end,
            state: s.state.into(),
            error: s.error,
            weight_bytes: s.weight_bytes,
            kv_bytes: s.kv_bytes,
            fetched_bytes: s.fetched_bytes,
            predicted_s: s.predicted_s,
            measured_s: s.measured_s,
            address: s.address,
            experts: (s.expert_end > s.expert_start).then_some((s.expert_start, s.expert_end)),
        }
    }
}

/// A deployment: a model placed on the cluster under a name.
#[derive(Debug, Clone, PartialEq)]
pub struct Deployment {
    /// The name clients give as `model`.
    pub name: String,
    /// The model's path on the coordinator's machine, or `embedded`.
    pub source: String,
    /// The model's content id: `embedded` or a hash of its files' sizes and checksums.
    pub model_id: String,
    /// Bumped on every placement: workers refuse frames of another generation.
    pub generation: u64,
    /// Loading, re-placing, ready, degraded or failed.
    pub state: DeploymentState,
    /// The stages, in pipeline order.
    pub stages: Vec<Stage>,
    /// Stages that hold only routed experts of a mixture, called by the pipeline's stages.
    pub expert_stages: Vec<Stage>,
    /// Layers of the model.
    pub n_layers: u32,
    /// Context length, tokens.
    pub n_ctx: u32,
    /// Concurrent sessions each stage provisions.
    pub sessions: u32,
    /// `f32`, `f16` or `bf16`.
    pub activation_dtype: String,
    /// `quic` or `grpc`.
    pub carrier: String,
    /// What the planner placed for: `latency`, `throughput`, `max-context` or `energy`.
    pub objective: String,
    /// The planner's predicted decode seconds per token.
    pub predicted_decode_s: f64,
    /// The measured mean decode seconds per token (0 before any token).
    pub measured_decode_s: f64,
    /// Tokens generated so far, as the answering coordinator counted them.
    pub tokens_generated: u64,
    /// The node that drives sessions (receives the sampled ids).
    pub driver: String,
    /// The plan as the planner explained it.
    pub plan_text: String,
    /// Why the deployment cannot serve (failed stages, nodes down); empty while it can.
    pub error: String,
}

/// The wire's activation type as `deploy --activation-dtype` spells it.
pub fn activation_dtype_name(n: i32) -> &'static str {
    match v1::WireDtype::try_from(n) {
        Ok(v1::WireDtype::F32) => "f32",
        Ok(v1::WireDtype::F16) => "f16",
        Ok(v1::WireDtype::Bf16) => "bf16",
        _ => "unspecified",
    }
}

/// The wire's carrier as `deploy --carrier` spells it.
pub fn carrier_name(n: i32) -> &'static str {
    match v1::Carrier::try_from(n) {
        Ok(v1::Carrier::Quic) => "quic",
        Ok(v1::Carrier::Grpc) => "grpc",
        _ => "unspecified",
    }
}

impl From<v1::DeploymentInfo> for Deployment {
    fn from(d: v1::DeploymentInfo) -> Self {
        Deployment {
            activation_dtype: activation_dtype_name(d.activation_dtype).into(),
            carrier: carrier_name(d.carrier).into(),
            name: d.name,
            source: d.source,
            model_id: d.model_id,
            generation: d.generation,
            state: d.state.into(),
            stages: d.stages.into_iter().map(Stage::from).collect(),
            expert_stages: d.expert_stages.into_iter().map(Stage::from).collect(),
            n_layers: d.n_layers,
            n_ctx: d.n_ctx,
            sessions: d.sessions,
            objective: d.objective,
            predicted_decode_s: d.predicted_decode_s,
            measured_decode_s: d.measured_decode_s,
            tokens_generated: d.tokens_generated,
            driver: d.driver,
            plan_text: d.plan_text,
            error: d.error,
        }
    }
}

/// A coordinator replica as the answering replica sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    /// The replica's raft id.
    pub id: u64,
    /// The address the replica serves on.
    pub address: String,
    /// `leader`, `follower`, `learner`, …
    pub role: String,
    /// The highest log index known to be on the replica (the leader's view); the answering
    /// replica's own applied index for itself.
    pub match_index: u64,
    /// Whether this is the replica that answered.
    pub is_self: bool,
}

/// The raft group as the answering replica sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct RaftStatus {
    /// The answering replica's raft id.
    pub id: u64,
    /// The current raft term.
    pub term: u64,
    /// The leader's raft id; 0 when none is known.
    pub leader: u64,
    /// The leader's address; empty when none is known.
    pub leader_address: String,
    /// The highest log index known to be committed.
    pub commit_index: u64,
    /// The highest log index applied on the answering replica.
    pub applied_index: u64,
    /// The answering replica's role: `leader`, `follower`, `candidate` or `pre-candidate`.
    pub role: String,
    /// Every coordinator replica of the group.
    pub replicas: Vec<Replica>,
    /// Raft ids of the voters in the answering replica's configuration.
    pub voters: Vec<u64>,
}

/// The whole cluster: `brigade status`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterStatus {
    /// The answering coordinator's protocol version.
    pub protocol: u32,
    /// The answering coordinator's brigade version.
    pub version: String,
    /// The worker nodes.
    pub nodes: Vec<Node>,
    /// The measured links between nodes.
    pub links: Vec<Link>,
    /// The deployments.
    pub deployments: Vec<Deployment>,
    /// The coordinator replicas; `None` when the server sent none.
    pub raft: Option<RaftStatus>,
}

impl From<v1::ClusterStatusResponse> for ClusterStatus {
    fn from(s: v1::ClusterStatusResponse) -> Self {
        ClusterStatus {
            protocol: s.protocol,
            version: s.version,
            nodes: s
                .nodes
                .into_iter()
                .map(|n| Node {
                    name: n.name,
                    address: n.address,
                    state: n.state.into(),
                    devices: n.devices.into_iter().map(Into::into).collect(),
                    heartbeat_age_ms: n.heartbeat_age_ms,
                    version: n.version,
                })
                .collect(),
            links: s
                .links
                .into_iter()
                .map(|l| Link {
                    from: l.from,
                    to: l.to,
                    latency_s: l.latency_s,
                    bandwidth: l.bandwidth,
                    measured_at_ms: l.measured_at_ms,
                })
                .collect(),
            deployments: s.deployments.into_iter().map(Into::into).collect(),
            raft: s.raft.map(|r| RaftStatus {
                id: r.id,
                term: r.term,
                leader: r.leader,
                leader_address: r.leader_address,
                commit_index: r.commit_index,
                applied_index: r.applied_index,
                role: r.role,
                replicas: r
                    .replicas
                    .into_iter()
                    .map(|x| Replica {
                        id: x.id,
                        address: x.address,
                        role: x.role,
                        match_index: x.match_index,
                        is_self: x.is_self,
                    })
                    .collect(),
                voters: r.voters,
            }),
        }
    }
}

/// A model the coordinator knows.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// The deployment's name, which clients give as `model`.
    pub name: String,
    /// The model's path on the coordinator's machine, or `embedded`.
    pub source: String,
    /// The deployment's state, as [`Deployment::state`].
    pub state: DeploymentState,
    /// Layers of the model.
    pub n_layers: u32,
    /// Context length, tokens.
    pub n_ctx: u32,
    /// When the deployment was made, Unix ms.
    pub created_ms: u64,
}

impl From<v1::ModelInfo> for ModelInfo {
    fn from(m: v1::ModelInfo) -> Self {
        ModelInfo {
            name: m.name,
            source: m.source,
            state: m.state.into(),
            n_layers: m.n_layers,
            n_ctx: m.n_ctx,
            created_ms: m.created_ms,
        }
    }
}

/// A deployment to make (or to plan): `brigade deploy`'s options.
#[derive(Debug, Clone, PartialEq)]
pub struct DeployParams {
    /// The name clients give as `model`.
    pub name: String,
    /// A path on the coordinator's machine, or `embedded`.
    pub model: String,
    /// `latency`, `throughput`, `max-context` or `energy`.
    pub objective: String,
    /// Context length; 0: the model's, capped at 4096.
    pub ctx: u32,
    /// `NODE:DEVICE:N,…` to place by hand; empty: the planner places.
    pub device_map: String,
    /// Concurrent sessions each stage provisions.
    pub sessions: u32,
    /// The type of the hidden states between stages.
    pub activation_dtype: ActDtype,
    /// What carries frames between stages (gRPC over TCP for networks that block UDP).
    pub carrier: CarrierKind,
    /// The node that drives sessions; empty: the first stage's.
    pub driver: String,
    /// Wait until every stage is ready (or failed), at most this many seconds; 0: do not wait.
    pub wait_s: u32,
    /// Memory fraction kept free on every device.
    pub headroom: f64,
    /// Prompt tokens per chunk into the first stage; 0: brigade's choice.
    pub ubatch: u32,
    /// Split layers: the routed experts of the first N layers in the RAM of the node that holds
    /// each layer, computed by its CPU (llama.cpp's `--n-cpu-moe`); 0: whole layers.
    pub cpu_moe: u32,
    /// Search the split instead, as `brigade plan` does; `cpu_moe` is then not read.
    pub cpu_moe_auto: bool,
}

impl DeployParams {
    /// `model` deployed as `name`, placed by the planner for latency (a mixture's split layers
    /// searched, as `brigade deploy` does), waiting up to 600 s.
    pub fn new(name: &str, model: &str) -> Self {
        DeployParams {
            name: name.into(),
            model: model.into(),
            objective: "latency".into(),
            ctx: 0,
            device_map: String::new(),
            sessions: 0,
            activation_dtype: ActDtype::F32,
            carrier: CarrierKind::Quic,
            driver: String::new(),
            wait_s: 600,
            headroom: 0.10,
            ubatch: 0,
            cpu_moe: 0,
            cpu_moe_auto: true,
        }
    }

    pub(crate) fn to_proto(&self) -> v1::DeployRequest {
        v1::DeployRequest {
            name: self.name.clone(),
            model: self.model.clone(),
            objective: self.objective.clone(),
            ctx: self.ctx,
            device_map: self.device_map.clone(),
            sessions: self.sessions,
            activation_dtype: act_dtype_to_proto(self.activation_dtype) as i32,
            carrier: carrier_to_proto(self.carrier) as i32,
            driver: self.driver.clone(),
            wait_s: self.wait_s,
            headroom: self.headroom,
            ubatch: self.ubatch,
            cpu_moe: self.cpu_moe,
            cpu_moe_auto: self.cpu_moe_auto,
        }
    }
}

/// What a deployment would be: the planner's text and its JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The plan as the planner explained it.
    pub text: String,
    /// The planner's JSON output, as text.
    pub json: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_reasons_and_enums_keep_what_they_do_not_know() {
        assert_eq!(StopReason::from(v1::StopReason::Stop as i32), StopReason::Stop);
        assert_eq!(StopReason::from(99), StopReason::Other(99));
        assert_eq!(StopReason::from(99).name(), "unknown");
        assert_eq!(StopReason::Cancelled.name(), "caller");
        assert_eq!(NodeState::from(v1::NodeState::Down as i32), NodeState::Down);
        assert_eq!((NodeState::from(0), NodeState::from(0).name()), (NodeState::Other(0), "unknown"));
        assert_eq!(StageState::from(v1::StageState::Failed as i32).to_string(), "failed");
        assert_eq!(StageState::from(17), StageState::Other(17));
        let replacing = DeploymentState::from(v1::DeploymentState::Replacing as i32);
        assert_eq!((replacing, replacing.to_string()), (DeploymentState::Replacing, "re-placing".to_string()));
        assert_eq!(DeploymentState::from(-1), DeploymentState::Other(-1));
        assert_eq!(activation_dtype_name(v1::WireDtype::Bf16 as i32), "bf16");
        assert_eq!(carrier_name(42), "unspecified");
        let d = Device::from(v1::Device { name: "cuda0".into(), kind: 77, ..Default::default() });
        assert_eq!((d.name.as_str(), d.kind.as_str()), ("cuda0", "unknown"));
        let r = DeployParams {
            activation_dtype: ActDtype::Bf16,
            carrier: CarrierKind::Grpc,
            cpu_moe: 7,
            cpu_moe_auto: true,
            ..DeployParams::new("a", "b")
        };
        let p = r.to_proto();
        assert_eq!(
            (p.activation_dtype, p.carrier, p.wait_s, p.cpu_moe, p.cpu_moe_auto),
            (v1::WireDtype::Bf16 as i32, v1::Carrier::Grpc as i32, 600, 7, true)
        );
        // the SDK searches the split unless told, as the CLI does (the wire's default, false,
        // keeps older clients on whole layers)
        let plain = DeployParams::new("a", "b").to_proto();
        assert_eq!((plain.cpu_moe, plain.cpu_moe_auto), (0, true));
        assert!(!v1::DeployRequest::default().cpu_moe_auto);
        assert_eq!(activation_dtype_name(p.activation_dtype), "bf16");
        let done = Done::from(v1::Done { stop: 5, timings: None, text_tail: "x".into() });
        assert_eq!(done, Done { stop: StopReason::Stop, timings: None, text_tail: "x".into() });
    }
}
