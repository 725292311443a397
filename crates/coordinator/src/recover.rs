//! What the leader does on its own, every quarter second: the thin driver of
//! [`crate::reconcile::Reconciler`] (liveness, recovery, rebalancing — its module says what each
//! decides). This loop reads the state and what the heartbeats told this replica, replicates the
//! reconciler's commands in order and logs them.

use crate::reconcile::{Action, Liveness, ReconcileConfig, Reconciler};
use crate::shared::Shared;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TICK: Duration = Duration::from_millis(250);
/// How often a ready deployment is checked for a better placement.
const REBALANCE_EVERY: Duration = Duration::from_secs(5);

/// What the heartbeats told this replica, asked by the reconciler as it needs it.
struct Observed<'a> {
    shared: &'a Shared,
    leader_for: Duration,
}

impl Liveness for Observed<'_> {
    fn leader_for(&self) -> Duration {
        self.leader_for
    }
    fn heartbeat_age(&self, node: &str) -> Duration {
        self.shared.heartbeat_age(node)
    }
    fn active_sessions(&self, deployment: &str) -> u32 {
        self.shared.active_sessions(deployment)
    }
}

fn config(shared: &Shared) -> ReconcileConfig {
    ReconcileConfig {
        node_timeout: shared.cfg.node_timeout,
        rebalance_gain: shared.cfg.rebalance_gain,
        rebalance_every: REBALANCE_EVERY,
    }
}

pub async fn leader_tasks(shared: Arc<Shared>, stop: tokio_util::sync::CancellationToken) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_leader = false;
    let clock = Instant::now();
    let mut reconciler = Reconciler::new(config(&shared));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
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
        // off the async threads: a re-placement plans, which on a large cluster with a searched
        // split takes seconds
        let (at, leader_for, on) = (clock.elapsed(), since.elapsed(), shared.clone());
        let stepped = tokio::task::spawn_blocking(move || {
            let actions = reconciler.step(at, &state, &Observed { shared: &on, leader_for });
            (reconciler, actions)
        })
        .await;
        let actions = match stepped {
            Ok((r, actions)) => {
                reconciler = r;
                actions
            }
            Err(e) => {
                tracing::error!("the reconciler's step failed: {e}");
                reconciler = Reconciler::new(config(&shared));
                Vec::new()
            }
        };
        for action in actions {
            match action {
                Action::Apply { command, done, forget } => match shared.apply(*command).await {
                    Ok(_) => {
                        tracing::warn!("{done}");
                        if let Some(node) = forget {
                            shared.forget_worker(&node).await;
                        }
                    }
                    Err(e) => {
                        // the rest of this step assumed it: decide again from the state next tick
                        tracing::warn!("{done}: not replicated: {e}");
                        reconciler.not_applied();
                        break;
                    }
                },
                Action::Note(note) => tracing::info!("{note}"),
            }
        }
    }
}
