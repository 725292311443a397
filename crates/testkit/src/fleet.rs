//! The cluster around the replicas: worker nodes that register, heartbeat and report their
//! stages ready, the leader's recovery loop (the production [`Reconciler`], stepped as
//! `recover::leader_tasks` steps it), and the records they start from (nodes with one CPU each,
//! a small model, a deployment the planner places over several of them).

use brigade_coordinator::placement::{self, PlacementRequest};
use brigade_coordinator::raft::Ticket;
use brigade_coordinator::reconcile::{Liveness, ReconcileConfig, Reconciler};
use brigade_core::cluster::{
    ActDtype, CarrierKind, ClusterState, Command, Deployment, DeviceFigures, LinkRecord, ModelRecord, NodeRecord,
    NodeState, StageState,
};
use brigade_core::{DeviceKind, Link, LlamaShape, ModelProfile};
use brigade_planner::Objective;
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// One tick of the virtual clock in the coordinator's time (raft ticks of 100 ms).
pub const TICK: Duration = Duration::from_millis(100);
/// A worker heartbeats every this many ticks (the coordinator's default: 500 ms).
pub const HEARTBEAT_EVERY: u64 = 5;
/// The leader's recovery loop steps every this many ticks.
pub const RECONCILE_EVERY: u64 = 3;
/// A worker looks at its assignments every this many ticks.
pub const WATCH_EVERY: u64 = 10;
/// The deployment every run places and keeps placed.
pub const DEPLOYMENT: &str = "d";
const MODEL: &str = "m";
const MIB: u64 = 1 << 20;

/// The reconciler's settings in ticks: a node silent 3 s is down.
pub fn reconcile_config() -> ReconcileConfig {
    ReconcileConfig { node_timeout: TICK * 30, rebalance_gain: 0.25, rebalance_every: TICK * 50 }
}

/// The name of worker `i`.
pub fn worker_name(i: usize) -> String {
    format!("w{i}")
}

/// What worker `name` registers: one CPU with room for about two of the model's four layers.
pub fn node_record(name: &str) -> NodeRecord {
    let cpu = DeviceFigures {
        name: "cpu".into(),
        kind: DeviceKind::Cpu,
        model: "test cpu".into(),
        memory_total: 30 * MIB,
        memory_free: 30 * MIB,
        mem_bandwidth: 20e9,
        flops: 1e11,
        kernels: vec![],
        threads: 4,
        features: String::new(),
        host_link: None,
    };
    NodeRecord {
        name: name.into(),
        address: format!("{name}:7000"),
        devices: vec![cpu],
        version: "testkit".into(),
        state: NodeState::Up,
        registered_ms: 1,
        lowered: Default::default(),
    }
}

fn model_record() -> ModelRecord {
    let shape = LlamaShape { layers: 4, hidden: 512, ffn: 1536, heads: 8, kv_heads: 8, vocab: 8000, tied: false };
    ModelRecord {
        id: MODEL.into(),
        name: "tiny".into(),
        source: "tiny.gguf".into(),
        files: vec![],
        ranges: vec![],
        n_layers: 4,
        context_length: 512,
        profile: ModelProfile::from_shape("tiny", &shape, 16.0, 4),
        weight_types: vec![],
        experts: 0,
    }
}

fn request() -> PlacementRequest {
    PlacementRequest {
        objective: Objective::Latency,
        ctx: 256,
        sessions: 1,
        headroom: 0.10,
        driver: None,
        device_map: String::new(),
        cpu_moe: brigade_planner::CpuMoe::Layers(0),
    }
}

/// Whether the planner finds a placement for the deployment on the nodes of `state` that are up.
pub fn placeable(state: &ClusterState) -> bool {
    state.models.get(MODEL).is_some_and(|m| placement::place(state, m, &request()).is_ok())
}

/// The commands that set a cluster up: `workers` nodes admitted and registered, the links each
/// measured to the others, the model, and the deployment as the planner places it on them.
pub fn setup(workers: usize) -> Result<Vec<Command>, String> {
    let mut state = ClusterState::new();
    let mut out = Vec::new();
    for i in 0..workers {
        let name = worker_name(i);
        out.push(Command::AdmitNode { name: name.clone(), fingerprint: "ab".repeat(32), admitted_ms: 1 });
        out.push(Command::RegisterNode { node: node_record(&name) });
    }
    for i in 0..workers {
        let links = (0..workers)
            .filter(|j| *j != i)
            .map(|j| LinkRecord {
                from: worker_name(i),
                to: worker_name(j),
                link: Link { bandwidth: 1e9, latency: 1e-4 },
                measured_ms: 1,
            })
            .collect();
        out.push(Command::SetLinks { from: worker_name(i), links });
    }
    out.push(Command::AddModel { model: model_record() });
    for c in &out {
        state.apply(c.clone()).map_err(|e| format!("setting up: {e}"))?;
    }
    let p = placement::place(&state, &state.models[MODEL], &request()).map_err(|e| format!("first placement: {e}"))?;
    let deployment = Deployment {
        name: DEPLOYMENT.into(),
        model_id: MODEL.into(),
        generation: 0,
        n_layers: 4,
        n_ctx: 256,
        sessions: 1,
        objective: "latency".into(),
        act_dtype: ActDtype::F32,
        carrier: CarrierKind::Quic,
        driver: p.driver,
        stages: p.stages,
        expert_stages: p.expert_stages,
        predicted_decode_s: p.predicted_decode_s,
        plan_text: p.plan_text,
        created_ms: 1,
        ubatch: 0,
        replacements: 0,
        note: String::new(),
        by_hand: false,
        cpu_moe: 0,
        cpu_moe_auto: false,
    };
    out.push(Command::CreateDeployment { deployment });
    Ok(out)
}

/// A request in flight: the replica it was made at, its ticket, the tick it was made.
pub type InFlight = (u64, Ticket, u64);

/// A worker node as the control plane sees it.
#[derive(Debug)]
pub struct Worker {
    pub name: String,
    pub up: bool,
    /// Its registration since it (re)started was acknowledged.
    pub registered: bool,
    pub waiting: Option<InFlight>,
}

impl Worker {
    pub fn new(i: usize) -> Worker {
        // set-up registered every worker
        Worker { name: worker_name(i), up: true, registered: true, waiting: None }
    }

    /// The first stage of the deployment on this worker that is not ready yet, as a report that
    /// it is (the worker loaded it).
    pub fn report(&self, state: &ClusterState) -> Option<Command> {
        let d = state.deployments.get(DEPLOYMENT)?;
        let (i, _) = d.stages.iter().enumerate().find(|(_, s)| s.node == self.name && s.state != StageState::Ready)?;
        Some(Command::StageReport {
            deployment: d.name.clone(),
            generation: d.generation,
            stage: i,
            node: self.name.clone(),
            state: StageState::Ready,
            weight_bytes: 1,
            kv_bytes: 1,
            fetched_bytes: 0,
        })
    }
}

/// The leader's recovery loop on one replica, from the tick it became leader.
#[derive(Debug)]
pub struct LeaderTask {
    pub since: u64,
    pub reconciler: Reconciler,
    /// The step's commands not yet replicated, in order.
    pub queue: VecDeque<Command>,
    pub waiting: Option<InFlight>,
    pub last_step: u64,
}

impl LeaderTask {
    pub fn new(now: u64) -> LeaderTask {
        LeaderTask {
            since: now,
            reconciler: Reconciler::new(reconcile_config()),
            queue: VecDeque::new(),
            waiting: None,
            last_step: now,
        }
    }

    /// A command was not replicated: the rest of the step assumed it.
    pub fn failed(&mut self) {
        self.reconciler.not_applied();
        self.queue.clear();
        self.waiting = None;
    }
}

/// What a replica heard from the workers, as the reconciler asks it.
pub struct Heard<'a> {
    pub now: u64,
    pub since: u64,
    pub heartbeats: &'a BTreeMap<String, u64>,
}

impl Liveness for Heard<'_> {
    fn leader_for(&self) -> Duration {
        TICK * (self.now - self.since) as u32
    }
    fn heartbeat_age(&self, node: &str) -> Duration {
        // a node not heard from since this replica leads counts from then
        let last = self.heartbeats.get(node).copied().unwrap_or(0).max(self.since);
        TICK * (self.now - last) as u32
    }
    fn active_sessions(&self, _: &str) -> u32 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_up_deployment_spans_several_workers_and_survives_losing_one() {
        let mut s = ClusterState::new();
        for c in setup(4).unwrap() {
            s.apply(c).unwrap();
        }
        let d = &s.deployments[DEPLOYMENT];
        assert!(d.stages.len() >= 2, "one worker holds the whole model: {:?}", d.stages);
        assert!(placeable(&s));
        s.apply(Command::SetNodeState { name: d.stages[0].node.clone(), state: NodeState::Down }).unwrap();
        assert!(placeable(&s), "three workers hold the model");
        for i in 0..3 {
            let _ = s.apply(Command::SetNodeState { name: worker_name(i), state: NodeState::Down });
        }
        assert!(!placeable(&s), "one worker holds the model");
    }
}
