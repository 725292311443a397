//! The leader's recovery decisions, pure: [`Reconciler::step`] turns the cluster state, what
//! this replica knows of its nodes' liveness and a clock reading into the commands to replicate.
//! No I/O, no clock of its own, no raft: `recover::leader_tasks` drives it (reads the state,
//! proposes the commands, logs), and the unit tests drive it with hand-made states and times.
//!
//! - **liveness**: a node silent past `node_timeout` is marked down (a replica that has led for
//!   less than two timeouts first gives every node the time to find it);
//! - **recovery**: a deployment with a stage on a node that is down is re-placed on the nodes
//!   that are up; if the model no longer fits, its note says why (once), and it is tried again
//!   whenever the set of nodes that are up changes;
//! - **memory**: a deployment placed by the planner whose stage ran out of device memory while
//!   loading (the report lowered that device's figure) is placed again with the lower figure;
//! - **rebalancing**: every `rebalance_every`, a ready deployment placed by the planner is
//!   re-placed when a placement at least `rebalance_gain` faster exists — once its sessions have
//!   drained, never under them.

use crate::placement::{self, PlacementRequest};
use brigade_core::cluster::{ClusterState, Command, Deployment, DeploymentState, NodeState, StageState, OUT_OF_MEMORY};
use brigade_planner::Objective;
use std::collections::HashMap;
use std::time::Duration;

/// The reconciler's settings (the coordinator's `node_timeout` and `rebalance_gain`).
#[derive(Debug, Clone)]
pub struct ReconcileConfig {
    pub node_timeout: Duration,
    /// Re-place for a placement this much faster (0.25 = 25%).
    pub rebalance_gain: f64,
    pub rebalance_every: Duration,
}

/// What this replica knows of the nodes and sessions beyond the replicated state, asked only
/// for what a step looks at.
pub trait Liveness {
    /// How long this replica has been the leader.
    fn leader_for(&self) -> Duration;
    /// Time since `node`'s last heartbeat here (at most [`Liveness::leader_for`]: a node not
    /// heard from since this replica leads counts from then).
    fn heartbeat_age(&self, node: &str) -> Duration;
    /// Sessions running on `deployment`.
    fn active_sessions(&self, deployment: &str) -> u32;
}

/// One thing the driver does, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Replicate `command`; once applied, log `done` (a warning) and, for a node marked down,
    /// drop the connection to its worker (`forget`).
    Apply { command: Box<Command>, done: String, forget: Option<String> },
    /// Log a decision not to act (yet).
    Note(String),
}

/// The recovery loop's memory between steps.
#[derive(Debug)]
pub struct Reconciler {
    cfg: ReconcileConfig,
    /// The set of nodes that were up when each lost deployment was last tried.
    tried: HashMap<String, Vec<String>>,
    last_rebalance: Option<Duration>,
}

fn request(d: &Deployment) -> PlacementRequest {
    PlacementRequest {
        objective: d.objective.parse().unwrap_or(Objective::Latency),
        ctx: d.n_ctx,
        sessions: d.sessions,
        headroom: 0.10,
        driver: None,
        device_map: String::new(),
        // the split asked for, or searched again
        cpu_moe: match d.cpu_moe_auto {
            true => brigade_planner::CpuMoe::Auto,
            false => brigade_planner::CpuMoe::Layers(d.cpu_moe),
        },
    }
}

impl Reconciler {
    pub fn new(cfg: ReconcileConfig) -> Self {
        Reconciler { cfg, tried: HashMap::new(), last_rebalance: None }
    }

    /// An action of the last step was not replicated (and the driver skipped the rest): forget
    /// which deployments were tried, so the next step decides them again from the state.
    pub fn not_applied(&mut self) {
        self.tried.clear();
    }

    /// The actions for the state as it is at `now` (any monotonic clock: only differences count).
    /// Later decisions of one step see the earlier ones applied (a deployment is re-placed off a
    /// node this very step marks down).
    pub fn step(&mut self, now: Duration, state: &ClusterState, live: &impl Liveness) -> Vec<Action> {
        let mut out = Vec::new();
        let mut projected: Option<ClusterState> = None;
        if live.leader_for() > self.cfg.node_timeout * 2 {
            for n in state.nodes.values().filter(|n| n.state == NodeState::Up) {
                let age = live.heartbeat_age(&n.name);
                if age > self.cfg.node_timeout {
                    let command = Command::SetNodeState { name: n.name.clone(), state: NodeState::Down };
                    let _ = projected.get_or_insert_with(|| state.clone()).apply(command.clone());
                    out.push(Action::Apply {
                        command: Box::new(command),
                        done: format!("node `{}` silent for {:.1}s: marked down", n.name, age.as_secs_f64()),
                        forget: Some(n.name.clone()),
                    });
                }
            }
        }
        let state = projected.as_ref().unwrap_or(state);
        let up: Vec<String> =
            state.nodes.values().filter(|n| n.state == NodeState::Up).map(|n| n.name.clone()).collect();
        self.tried.retain(|name, _| state.deployments.contains_key(name));
        for d in state.deployments.values() {
            let lost = d.every_stage().any(|s| state.nodes.get(&s.node).is_none_or(|n| n.state != NodeState::Up));
            if !lost {
                self.tried.remove(&d.name);
                // a stage that did not fit on its device (whose figure the report lowered; where
                // the lowering did not land, the same plan would fail again: left failed):
                // placed again, once per failed generation (the re-placement is the next one)
                let oom = d.stages.iter().find(|s| {
                    matches!(&s.state, StageState::Failed(e) if e.starts_with(OUT_OF_MEMORY))
                        && state.nodes.get(&s.node).is_some_and(|n| n.lowered.contains_key(&s.device))
                });
                if let (Some(s), false) = (oom, d.by_hand) {
                    let why = format!("{}/{} ran out of memory loading layers {}", s.node, s.device, s.layers);
                    out.extend(replace(state, d, &why));
                }
                continue;
            }
            if self.tried.get(&d.name) == Some(&up) {
                continue;
            }
            self.tried.insert(d.name.clone(), up.clone());
            out.extend(replace(state, d, "a node it used is down"));
        }
        // the first check one period after the first step (a fresh leader lets nodes report)
        let last = *self.last_rebalance.get_or_insert(now);
        if now.saturating_sub(last) >= self.cfg.rebalance_every {
            self.last_rebalance = Some(now);
            for d in state.deployments.values() {
                if d.by_hand || state.deployment_state(d) != DeploymentState::Ready {
                    continue;
                }
                out.extend(self.rebalance(state, d, live));
            }
        }
        out
    }

    fn rebalance(&self, state: &ClusterState, d: &Deployment, live: &impl Liveness) -> Option<Action> {
        let model = state.models.get(&d.model_id)?;
        // a mixture's split is planned as placed (every split searched again every few seconds
        // would hold the leader: 0.5–6 s per driver on two GPU boxes, where the program across
        // nodes is exact), and on a large cluster for the current driver only (a grid of
        // heuristic splits per driver); a move it finds is then placed with every driver tried
        let mut req = request(d);
        let devices: usize = state.nodes.values().filter(|n| n.state == NodeState::Up).map(|n| n.devices.len()).sum();
        let split = model.profile.moe.is_some() && (d.cpu_moe_auto || d.cpu_moe > 0);
        if split {
            req.cpu_moe = brigade_planner::CpuMoe::Layers(d.cpu_moe);
        }
        if split && devices > brigade_planner::search::EXACT_MAX {
            req.driver = Some(d.driver.clone());
        }
        let p = placement::place(state, model, &req).ok()?;
        let same = p.stages.len() == d.stages.len()
            && p.stages
                .iter()
                .zip(&d.stages)
                .all(|(a, b)| a.node == b.node && a.device == b.device && a.layers == b.layers);
        if same || p.predicted_decode_s >= d.predicted_decode_s * (1.0 - self.cfg.rebalance_gain) {
            return None;
        }
        let active = live.active_sessions(&d.name);
        if active > 0 {
            return Some(Action::Note(format!(
                "deployment `{}`: a placement {:.0}% faster exists; waiting for {active} session(s) to finish",
                d.name,
                (1.0 - p.predicted_decode_s / d.predicted_decode_s.max(1e-12)) * 100.0
            )));
        }
        // placed as found: with the split placed (a search now could pick a slower one, for
        // throughput or energy)
        replace_by(state, d, &PlacementRequest { driver: None, ..req }, "a faster placement appeared")
    }
}

/// `d` placed again on the nodes that are up, its split searched again if it was, or the note
/// of why it cannot be (when it changed).
fn replace(state: &ClusterState, d: &Deployment, why: &str) -> Option<Action> {
    replace_by(state, d, &request(d), why)
}

/// [`replace`] by `req`.
fn replace_by(state: &ClusterState, d: &Deployment, req: &PlacementRequest, why: &str) -> Option<Action> {
    let model = state.models.get(&d.model_id)?;
    match placement::place(state, model, req) {
        Ok(p) => {
            let nodes: Vec<String> = p.stages.iter().map(|s| format!("{}:{}", s.node, s.layers)).collect();
            Some(Action::Apply {
                command: Box::new(Command::ReplaceStages {
                    deployment: d.name.clone(),
                    stages: p.stages,
                    expert_stages: p.expert_stages,
                    driver: p.driver,
                    predicted_decode_s: p.predicted_decode_s,
                    plan_text: p.plan_text,
                    cpu_moe: Some(p.cpu_moe),
                }),
                done: format!("deployment `{}` re-placed ({why}): {}", d.name, nodes.join(" ")),
                forget: None,
            })
        }
        Err(e) => {
            let note = format!("cannot be re-placed on the nodes that are up: {e}");
            (d.note != note).then(|| Action::Apply {
                done: format!("deployment `{}` is degraded: {note}", d.name),
                command: Box::new(Command::SetNote { deployment: d.name.clone(), note }),
                forget: None,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use brigade_core::cluster::{ActDtype, CarrierKind, DeviceFigures, ModelRecord, NodeRecord, StageState};
    use brigade_core::{DeviceKind, LlamaShape, ModelProfile};

    const GIB: u64 = 1 << 30;
    const SECOND: Duration = Duration::from_secs(1);

    fn cfg() -> ReconcileConfig {
        ReconcileConfig { node_timeout: 3 * SECOND, rebalance_gain: 0.25, rebalance_every: 5 * SECOND }
    }

    /// Registers node `name` with one CPU of `memory` bytes reading `bandwidth` bytes/s.
    fn add_node(s: &mut ClusterState, name: &str, memory: u64, bandwidth: f64) {
        let fingerprint = "ab".repeat(32);
        s.apply(Command::AdmitNode { name: name.into(), fingerprint, admitted_ms: 1 }).unwrap();
        let cpu = DeviceFigures {
            name: "cpu".into(),
            kind: DeviceKind::Cpu,
            model: "test cpu".into(),
            memory_total: memory,
            memory_free: memory,
            mem_bandwidth: bandwidth,
            flops: 1e11,
            kernels: vec![],
            threads: 4,
            features: String::new(),
            host_link: None,
        };
        let node = NodeRecord {
            name: name.into(),
            address: format!("{name}:7000"),
            devices: vec![cpu],
            version: "test".into(),
            state: NodeState::Up,
            registered_ms: 1,
            lowered: Default::default(),
        };
        s.apply(Command::RegisterNode { node }).unwrap();
    }

    /// A state with nodes `(name, memory, bandwidth)`, a 4-layer model of about 40 MB and the
    /// deployment `d` placed by the planner, every stage ready.
    fn cluster(nodes: &[(&str, u64, f64)]) -> ClusterState {
        let mut s = ClusterState::new();
        for (name, memory, bandwidth) in nodes {
            add_node(&mut s, name, *memory, *bandwidth);
        }
        let shape = LlamaShape { layers: 4, hidden: 512, ffn: 1536, heads: 8, kv_heads: 8, vocab: 8000, tied: false };
        let model = ModelRecord {
            id: "m".into(),
            name: "tiny".into(),
            source: "tiny.gguf".into(),
            files: vec![],
            ranges: vec![],
            n_layers: 4,
            context_length: 512,
            profile: ModelProfile::from_shape("tiny", &shape, 16.0, 4),
            weight_types: vec![],
            experts: 0,
        };
        s.apply(Command::AddModel { model }).unwrap();
        let deployment = Deployment {
            name: "d".into(),
            model_id: "m".into(),
            generation: 0,
            n_layers: 4,
            n_ctx: 256,
            sessions: 1,
            objective: "latency".into(),
            act_dtype: ActDtype::F32,
            carrier: CarrierKind::Quic,
            driver: String::new(),
            stages: vec![],
            expert_stages: vec![],
            predicted_decode_s: 0.0,
            plan_text: String::new(),
            created_ms: 1,
            ubatch: 0,
            replacements: 0,
            note: String::new(),
            by_hand: false,
            cpu_moe: 0,
            cpu_moe_auto: false,
        };
        let p = placement::place(&s, &s.models["m"], &request(&deployment)).unwrap();
        let deployment =
            Deployment { stages: p.stages, driver: p.driver, predicted_decode_s: p.predicted_decode_s, ..deployment };
        s.apply(Command::CreateDeployment { deployment }).unwrap();
        ready(&mut s);
        s
    }

    /// Every stage of `d` reports ready.
    fn ready(s: &mut ClusterState) {
        let d = s.deployments["d"].clone();
        for (i, st) in d.stages.iter().enumerate() {
            let report = Command::StageReport {
                deployment: "d".into(),
                generation: d.generation,
                stage: i,
                node: st.node.clone(),
                state: StageState::Ready,
                weight_bytes: 1,
                kv_bytes: 1,
                fetched_bytes: 0,
            };
            s.apply(report).unwrap();
        }
    }

    fn nodes_of(s: &ClusterState) -> Vec<String> {
        s.deployments["d"].stages.iter().map(|st| st.node.clone()).collect()
    }

    /// Applies the step's commands as the driver would, returning the notes.
    fn apply(s: &mut ClusterState, actions: Vec<Action>) -> Vec<String> {
        let mut notes = vec![];
        for a in actions {
            match a {
                Action::Apply { command, done, .. } => {
                    s.apply(*command).unwrap();
                    notes.push(done);
                }
                Action::Note(n) => notes.push(n),
            }
        }
        notes
    }

    /// Liveness as a test states it.
    struct Known {
        leader_for: Duration,
        heartbeat_age: HashMap<String, Duration>,
        active_sessions: HashMap<String, u32>,
    }

    impl Liveness for Known {
        fn leader_for(&self) -> Duration {
            self.leader_for
        }
        fn heartbeat_age(&self, node: &str) -> Duration {
            self.heartbeat_age.get(node).copied().unwrap_or(self.leader_for)
        }
        fn active_sessions(&self, deployment: &str) -> u32 {
            self.active_sessions.get(deployment).copied().unwrap_or(0)
        }
    }

    /// One step at `now`, its commands applied.
    fn turn(r: &mut Reconciler, now: Duration, s: &mut ClusterState, l: &Known) -> Vec<String> {
        let actions = r.step(now, s, l);
        apply(s, actions)
    }

    fn live(leader_for: Duration, ages: &[(&str, Duration)]) -> Known {
        Known {
            leader_for,
            heartbeat_age: ages.iter().map(|(n, a)| (n.to_string(), *a)).collect(),
            active_sessions: HashMap::new(),
        }
    }

    #[test]
    fn a_silent_node_is_marked_down_and_its_stages_move_in_the_same_step() {
        let mut s = cluster(&[("w1", 8 * GIB, 40e9), ("w2", 8 * GIB, 20e9)]);
        assert_eq!(nodes_of(&s), ["w1"], "the faster node holds the whole model");
        let mut r = Reconciler::new(cfg());
        let fresh = [("w1", SECOND), ("w2", SECOND)];
        assert!(r.step(10 * SECOND, &s, &live(10 * SECOND, &fresh)).is_empty(), "nothing to do");
        // w1 silent past the timeout
        let actions = r.step(11 * SECOND, &s, &live(11 * SECOND, &[("w1", 4 * SECOND), ("w2", SECOND)]));
        assert!(matches!(&actions[0], Action::Apply { forget: Some(n), .. } if n == "w1"), "{actions:?}");
        assert!(
            matches!(&actions[1], Action::Apply { command, .. } if matches!(**command, Command::ReplaceStages { .. })),
            "{actions:?}"
        );
        assert_eq!(actions.len(), 2, "{actions:?}");
        let generation = s.deployments["d"].generation;
        let notes = apply(&mut s, actions);
        assert!(notes[0].starts_with("node `w1` silent for 4.0s"), "{notes:?}");
        assert_eq!(nodes_of(&s), ["w2"]);
        assert!(s.deployments["d"].generation > generation, "a new generation");
        assert!(notes[1].contains("re-placed (a node it used is down): w2:"), "{notes:?}");
    }

    /// Gives node `name` a GPU `cuda0` of `memory` bytes beside its CPU (a re-registration).
    fn add_gpu(s: &mut ClusterState, name: &str, memory: u64) {
        let mut node = s.nodes[name].clone();
        node.devices.push(DeviceFigures {
            name: "cuda0".into(),
            kind: DeviceKind::Cuda,
            model: "test gpu".into(),
            memory_total: memory,
            memory_free: memory,
            mem_bandwidth: 2e12,
            flops: 1e14,
            kernels: vec![],
            threads: 0,
            features: String::new(),
            host_link: Some(brigade_core::Link { bandwidth: 25e9, latency: 10e-6 }),
        });
        s.apply(Command::RegisterNode { node }).unwrap();
    }

    /// A split searched at deploy time is searched again by a re-placement, which records the
    /// split it placed; one asked for is kept.
    #[test]
    fn a_searched_split_is_searched_again_and_recorded() {
        let s = cluster(&[("a", 8 * GIB, 20e9), ("b", 8 * GIB, 20e9)]);
        let d = Deployment { cpu_moe_auto: true, cpu_moe: 3, ..s.deployments["d"].clone() };
        assert_eq!(request(&d).cpu_moe, brigade_planner::CpuMoe::Auto);
        let asked = Deployment { cpu_moe_auto: false, ..d.clone() };
        assert_eq!(request(&asked).cpu_moe, brigade_planner::CpuMoe::Layers(3));
        // a dense model: the search places whole layers, and the command says so
        match replace(&s, &d, "test") {
            Some(Action::Apply { command, .. }) => match *command {
                Command::ReplaceStages { cpu_moe, .. } => assert_eq!(cpu_moe, Some(0)),
                c => panic!("{c:?}"),
            },
            a => panic!("{a:?}"),
        }
    }

    fn layers_on(s: &ClusterState, device: &str) -> usize {
        s.deployments["d"].stages.iter().filter(|x| x.device == device).map(|x| x.layers.len()).sum()
    }

    /// A GPU stage that runs out of memory while loading: the report lowers the GPU's figure and
    /// the deployment is placed again with fewer layers there — each time, until none (never a
    /// loop on one placement, never a silent move: each re-placement says why).
    #[test]
    fn a_gpu_stage_out_of_memory_is_placed_again_with_fewer_layers_there() {
        let mut s = cluster(&[("gw", 8 * GIB, 20e9), ("w2", 8 * GIB, 20e9)]);
        add_gpu(&mut s, "gw", 8 * GIB);
        let mut r = Reconciler::new(cfg());
        let d = s.deployments["d"].clone();
        let first = replace(&s, &d, "test").unwrap();
        apply(&mut s, vec![first]);
        assert_eq!(layers_on(&s, "cuda0"), 4, "the GPU holds the whole model: {:?}", s.deployments["d"].stages);
        let l = live(SECOND, &[]);
        assert!(r.step(SECOND, &s, &l).is_empty(), "nothing to do while it loads");
        let mut on_gpu = 4;
        for round in 0..6 {
            let d = s.deployments["d"].clone();
            let Some(i) = d.stages.iter().position(|x| x.device == "cuda0") else { break };
            // the worker's report: failed, out of memory, with what is free after the attempt
            let report = brigade_proto::v1::ReadyReport {
                name: "gw".into(),
                deployment: "d".into(),
                generation: d.generation,
                stage: i as u32,
                state: brigade_proto::v1::StageState::Failed.into(),
                error: "out of memory on cuda0 (0 bytes free after the attempt): CUDA_ERROR_OUT_OF_MEMORY".into(),
                out_of_memory: true,
                ..Default::default()
            };
            let lower = crate::control::lower_after_oom(&s, "gw", &report).unwrap();
            let need = d.stages[i].weight_bytes + d.stages[i].kv_bytes;
            s.apply(lower).unwrap();
            let free = s.nodes["gw"].devices[1].memory_free;
            assert!(free <= need / 8 * 7, "round {round}: cuda0 offers {free}, the stage needed {need}");
            s.apply(Command::StageReport {
                deployment: "d".into(),
                generation: d.generation,
                stage: i,
                node: "gw".into(),
                state: StageState::Failed(report.error.clone()),
                weight_bytes: 0,
                kv_bytes: 0,
                fetched_bytes: 0,
            })
            .unwrap();
            let notes = turn(&mut r, SECOND * (round + 2), &mut s, &l);
            assert_eq!(notes.len(), 1, "round {round}: {notes:?}");
            assert!(notes[0].contains("gw/cuda0 ran out of memory loading layers"), "{notes:?}");
            assert!(s.deployments["d"].generation > d.generation, "a new generation");
            let now = layers_on(&s, "cuda0");
            assert!(now < on_gpu, "round {round}: {now} layers on cuda0 after {on_gpu}");
            on_gpu = now;
            let mut loaded = s.clone();
            ready(&mut loaded);
            assert!(r.step(SECOND * (round + 2), &loaded, &l).is_empty(), "a re-placement that loads is left alone");
        }
        assert_eq!(on_gpu, 0, "the GPU's figure fell until nothing was placed there");
        assert_eq!(s.deployments["d"].stages.iter().map(|x| x.layers.len()).sum::<usize>(), 4);
        // a stale report (an older generation) lowers nothing
        let stale = brigade_proto::v1::ReadyReport {
            deployment: "d".into(),
            generation: 1,
            out_of_memory: true,
            ..Default::default()
        };
        assert!(crate::control::lower_after_oom(&s, "gw", &stale).is_none());
    }

    #[test]
    fn a_step_whose_commands_were_not_replicated_is_decided_again() {
        let s = cluster(&[("w1", 8 * GIB, 40e9), ("w2", 8 * GIB, 20e9)]);
        let mut r = Reconciler::new(cfg());
        let silent = live(11 * SECOND, &[("w1", 4 * SECOND), ("w2", SECOND)]);
        assert_eq!(r.step(11 * SECOND, &s, &silent).len(), 2);
        // marking w1 down failed (no quorum): nothing changed, and the driver says so
        r.not_applied();
        let again = r.step(12 * SECOND, &s, &silent);
        assert_eq!(again.len(), 2, "the re-placement is decided again: {again:?}");
        // without the call, the memo would have kept it from being tried on the same nodes
        let mut stuck = Reconciler::new(cfg());
        stuck.step(11 * SECOND, &s, &silent);
        assert_eq!(stuck.step(12 * SECOND, &s, &silent).len(), 1, "only the mark-down");
    }

    #[test]
    fn a_new_leader_gives_nodes_two_timeouts_before_marking_any_down() {
        let s = cluster(&[("w1", 8 * GIB, 40e9)]);
        let mut r = Reconciler::new(cfg());
        // never heard from since this replica leads: its age is the leadership's
        assert!(r.step(SECOND, &s, &live(5 * SECOND, &[])).is_empty(), "within two timeouts");
        let actions = r.step(2 * SECOND, &s, &live(7 * SECOND, &[]));
        assert!(
            matches!(&actions[0], Action::Apply { command, .. }
                if **command == Command::SetNodeState { name: "w1".into(), state: NodeState::Down }),
            "{actions:?}"
        );
    }

    #[test]
    fn a_model_that_no_longer_fits_is_noted_once_and_tried_again_when_nodes_change() {
        // the model needs about 50 MB: w2 alone cannot hold it
        let mut s = cluster(&[("w1", 8 * GIB, 40e9), ("w2", 20 << 20, 20e9)]);
        let mut r = Reconciler::new(cfg());
        s.apply(Command::SetNodeState { name: "w1".into(), state: NodeState::Down }).unwrap();
        let l = live(SECOND, &[]);
        let notes = turn(&mut r, SECOND, &mut s, &l);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].starts_with("deployment `d` is degraded: cannot be re-placed"), "{notes:?}");
        assert!(s.deployments["d"].note.contains("cannot be re-placed"));
        // the same nodes: not tried again, not noted again
        assert!(r.step(2 * SECOND, &s, &l).is_empty());
        // a node joins: tried again, and placed
        add_node(&mut s, "w3", 8 * GIB, 30e9);
        let notes = turn(&mut r, 3 * SECOND, &mut s, &l);
        assert_eq!(nodes_of(&s), ["w3"], "{notes:?}");
        assert!(s.deployments["d"].note.is_empty(), "placing clears the note");
    }

    #[test]
    fn a_much_faster_node_takes_the_deployment_once_its_sessions_drain() {
        let mut s = cluster(&[("w1", 8 * GIB, 10e9)]);
        let mut r = Reconciler::new(cfg());
        let mut l = live(SECOND, &[("w1", SECOND)]);
        assert!(r.step(Duration::ZERO, &s, &l).is_empty());
        add_node(&mut s, "w2", 8 * GIB, 40e9);
        l.heartbeat_age.insert("w2".into(), SECOND);
        l.active_sessions.insert("d".into(), 2);
        assert!(r.step(SECOND, &s, &l).is_empty(), "rebalancing waits for its period");
        let notes = turn(&mut r, 5 * SECOND, &mut s, &l);
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("faster exists; waiting for 2 session(s)"), "{notes:?}");
        assert_eq!(nodes_of(&s), ["w1"], "never moved under its sessions");
        l.active_sessions.clear();
        let notes = turn(&mut r, 10 * SECOND, &mut s, &l);
        assert_eq!(nodes_of(&s), ["w2"], "{notes:?}");
        assert!(notes[0].contains("re-placed (a faster placement appeared)"), "{notes:?}");
        // re-placed stages are loading: nothing more until they are ready, and then nothing flaps
        assert!(r.step(15 * SECOND, &s, &l).is_empty());
        ready(&mut s);
        assert!(r.step(20 * SECOND, &s, &l).is_empty(), "the placement it made is not improved on");
    }

    #[test]
    fn a_hand_placed_deployment_is_never_moved_for_speed() {
        let mut s = cluster(&[("w1", 8 * GIB, 10e9)]);
        s.deployments.get_mut("d").unwrap().by_hand = true;
        add_node(&mut s, "w2", 8 * GIB, 40e9);
        let mut r = Reconciler::new(cfg());
        assert!(r.step(Duration::ZERO, &s, &live(SECOND, &[])).is_empty());
        // ...but it is moved when its node dies
        s.apply(Command::SetNodeState { name: "w1".into(), state: NodeState::Down }).unwrap();
        let notes = turn(&mut r, SECOND, &mut s, &live(SECOND, &[]));
        assert_eq!(nodes_of(&s), ["w2"], "{notes:?}");
    }
}
