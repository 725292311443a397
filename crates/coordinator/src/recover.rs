//! What the leader does on its own, every quarter second:
//! - **liveness**: a node silent past `node_timeout` is marked down (a new leader first gives every
//!   node two timeouts to find it);
//! - **recovery**: a deployment with a stage on a node that is down is re-placed on the nodes that
//!   are up (the next generation: workers drop the old stages, load the new, and in-flight sessions
//!   resume by replaying their tokens); if the model no longer fits, the deployment is left degraded
//!   with the shortfall in its note, and tried again whenever the nodes change;
//! - **rebalancing**: a ready deployment placed by the planner is re-placed when a placement at least
//!   `rebalance_gain` faster appears (a node came back, a new one joined) — once its sessions have
//!   drained, never under them.

use crate::placement::{self, PlacementRequest};
use crate::server::Shared;
use brigade_core::cluster::{ClusterState, Command, Deployment, DeploymentState, NodeState};
use brigade_planner::Objective;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TICK: Duration = Duration::from_millis(250);
/// How often a ready deployment is checked for a better placement.
const REBALANCE_EVERY: Duration = Duration::from_secs(5);

pub async fn leader_tasks(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_leader = false;
    let mut last_rebalance = Instant::now();
    // the node set a degraded deployment was last planned against (to re-plan when it changes)
    let mut tried: std::collections::HashMap<String, Vec<String>> = Default::default();
    loop {
        tick.tick().await;
        if !shared.raft.is_leader() {
            if was_leader {
                tracing::info!("this replica is no longer the coordinator leader");
                if let Ok(mut l) = shared.leader_since.lock() {
                    *l = None;
                }
            }
            was_leader = false;
            continue;
        }
        if !was_leader {
            let s = shared.raft.status();
            tracing::info!("this replica ({}) is the coordinator leader, term {}", s.id, s.term);
            if let Ok(mut l) = shared.leader_since.lock() {
                *l = Some(Instant::now());
            }
            was_leader = true;
        }
        let since = shared.leader_since.lock().ok().and_then(|l| *l).unwrap_or_else(Instant::now);
        let state = shared.state();
        if since.elapsed() > shared.cfg.node_timeout * 2 {
            for n in state.nodes.values().filter(|n| n.state == NodeState::Up) {
                let age = shared.heartbeat_age(&n.name);
                if age > shared.cfg.node_timeout {
                    tracing::warn!("node `{}` silent for {:.1}s: marked down", n.name, age.as_secs_f64());
                    if shared
                        .apply(Command::SetNodeState { name: n.name.clone(), state: NodeState::Down })
                        .await
                        .is_ok()
                    {
                        shared.forget_worker(&n.name).await;
                    }
                }
            }
        }
        let state = shared.state();
        let up: Vec<String> =
            state.nodes.values().filter(|n| n.state == NodeState::Up).map(|n| n.name.clone()).collect();
        for d in state.deployments.values() {
            let lost = d.stages.iter().any(|s| state.nodes.get(&s.node).is_none_or(|n| n.state != NodeState::Up));
            if !lost {
                tried.remove(&d.name);
                continue;
            }
            if tried.get(&d.name) == Some(&up) {
                continue;
            }
            tried.insert(d.name.clone(), up.clone());
            replace(&shared, &state, d, "a node it used is down").await;
        }
        if last_rebalance.elapsed() >= REBALANCE_EVERY {
            last_rebalance = Instant::now();
            let state = shared.state();
            for d in state.deployments.values() {
                if d.by_hand || state.deployment_state(d) != DeploymentState::Ready {
                    continue;
                }
                rebalance(&shared, &state, d).await;
            }
        }
    }
}

fn request(d: &Deployment) -> PlacementRequest {
    PlacementRequest {
        objective: d.objective.parse().unwrap_or(Objective::Latency),
        ctx: d.n_ctx,
        sessions: d.sessions,
        headroom: 0.10,
        driver: None,
        device_map: String::new(),
    }
}

/// Places `d` again on the nodes that are up, or notes why it cannot be.
async fn replace(shared: &Shared, state: &ClusterState, d: &Deployment, why: &str) {
    let Some(model) = state.models.get(&d.model_id) else { return };
    match placement::place(state, model, &request(d)) {
        Ok(p) => {
            let nodes: Vec<String> = p.stages.iter().map(|s| format!("{}:{}", s.node, s.layers)).collect();
            let cmd = Command::ReplaceStages {
                deployment: d.name.clone(),
                stages: p.stages,
                driver: p.driver,
                predicted_decode_s: p.predicted_decode_s,
                plan_text: p.plan_text,
            };
            match shared.apply(cmd).await {
                Ok(_) => tracing::warn!("deployment `{}` re-placed ({why}): {}", d.name, nodes.join(" ")),
                Err(e) => tracing::warn!("re-placing deployment `{}`: {e}", d.name),
            }
        }
        Err(e) => {
            let note = format!("cannot be re-placed on the nodes that are up: {e}");
            if d.note != note {
                tracing::warn!("deployment `{}` is degraded: {note}", d.name);
                let _ = shared.apply(Command::SetNote { deployment: d.name.clone(), note }).await;
            }
        }
    }
}

async fn rebalance(shared: &Shared, state: &ClusterState, d: &Deployment) {
    let Some(model) = state.models.get(&d.model_id) else { return };
    let Ok(p) = placement::place(state, model, &request(d)) else { return };
    let same = p.stages.len() == d.stages.len()
        && p.stages
            .iter()
            .zip(&d.stages)
            .all(|(a, b)| a.node == b.node && a.device == b.device && a.layers == b.layers);
    if same || p.predicted_decode_s >= d.predicted_decode_s * (1.0 - shared.cfg.rebalance_gain) {
        return;
    }
    let active = shared.active_sessions(&d.name);
    if active > 0 {
        tracing::info!(
            "deployment `{}`: a placement {:.0}% faster exists; waiting for {active} session(s) to finish",
            d.name,
            (1.0 - p.predicted_decode_s / d.predicted_decode_s.max(1e-12)) * 100.0
        );
        return;
    }
    replace(shared, state, d, "a faster placement appeared").await;
}
