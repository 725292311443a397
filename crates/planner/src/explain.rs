//! The plan as the user sees it: stages with predicted memory and time, hops, the bottleneck, a
//! reason for every stage, and the alternatives rejected with their numbers; and its text form.

use crate::cost::{Metrics, Problem};
use crate::dp;
use crate::search::{self, Solution};
use crate::{CpuMoe, Inventory, ModelProfile, Objective, PlanError, Policy, Reservation};
use brigade_core::DeviceKind;
use serde::Serialize;

/// One stage of a plan: a device, its layers, and its predicted memory and time.
#[derive(Debug, Clone, Serialize)]
pub struct StagePlan {
    /// The node's name.
    pub node: String,
    /// The device's name on that node.
    pub device: String,
    /// CPU or CUDA.
    pub kind: DeviceKind,
    /// The layers it holds, `(start, end)` half-open.
    pub layers: (usize, usize),
    /// Bytes of weights, with the embedding on the first stage and the head on the last.
    pub weight_bytes: u64,
    /// Bytes of KV cache for `ctx` × `sessions`, in the device's KV type.
    pub kv_bytes: u64,
    /// All bytes the stage holds: weights, KV cache and rotary tables.
    pub memory_bytes: u64,
    /// Bytes the device may hold: its memory after headroom and reservations (on the CPU of a
    /// plan with split layers, also less the other stages' experts it holds).
    pub budget_bytes: u64,
    /// Split layers: the layers `(start, end)` whose routed experts this stage leaves in its
    /// node's RAM, computed by the node's CPU; `None`: it holds its layers whole.
    pub host_layers: Option<(usize, usize)>,
    /// Bytes of those experts (on the host, not in [`StagePlan::memory_bytes`]).
    pub host_expert_bytes: u64,
    /// The device whose RAM holds those experts (`node/cpu`), when any.
    pub host_device: Option<String>,
    /// Milliseconds per decoded token of the stage's layers (and the head on the last).
    pub compute_ms: f64,
    /// Milliseconds of the stage's share of a 512-token prompt.
    pub prefill_ms_512: f64,
    /// Why the stage is as it is: `; `-separated clauses (time per layer, share of its budget,
    /// embedding or head, distance from the driver).
    pub reason: String,
}

/// One hop of a plan: hidden states between consecutive stages, or a driver's leg.
#[derive(Debug, Clone, Serialize)]
pub struct HopPlan {
    /// The sending end: a device's `node/device` label, or `driver NODE`.
    pub from: String,
    /// The receiving end, labelled as `from`.
    pub to: String,
    /// Milliseconds per decoded token.
    pub ms: f64,
    /// Milliseconds to carry a 512-token prompt's share (NaN where there is no path).
    pub prefill_ms_512: f64,
}

/// A placement the planner considered and did not choose, with why.
#[derive(Debug, Clone, Serialize)]
pub struct Rejected {
    /// What it was: `all on node/device`, or `only NODE's devices`.
    pub alternative: String,
    /// Why it lost, with its number (tokens/s, J/token, watts, or the bytes it is short).
    pub reason: String,
    /// Its rate in tokens/s (all sessions' for the throughput objective, one session's
    /// otherwise); `None` when it does not fit.
    pub tokens_per_s: Option<f64>,
    /// Bytes it is short of, when it does not fit.
    pub shortfall_bytes: Option<u64>,
}

/// A placement with its predicted numbers, the reasons for it and the alternatives rejected:
/// what [`plan`] returns and [`Plan::to_text`] renders.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// The model's name ([`ModelProfile::name`]).
    pub model: String,
    /// The objective it was planned for.
    pub objective: Objective,
    /// Context tokens per session it holds (for max-context: the largest that fits).
    pub ctx: u64,
    /// Concurrent sessions every stage holds a KV cache for.
    pub sessions: u64,
    /// Share of each device's memory left free.
    pub headroom: f64,
    /// The driver's node name.
    pub driver: String,
    /// The optimum of the cost model (false: chosen by the heuristic for large clusters).
    pub exact: bool,
    /// What a heuristic chose when the plan is not exact: `device choice` (large clusters), or
    /// `split layers' RAM across nodes` (each node's share of split experts).
    pub heuristic: Option<String>,
    /// The stages in pipeline order; together they hold every layer once.
    pub stages: Vec<StagePlan>,
    /// Between consecutive stages, then the driver's legs (`driver → first`, `last → driver`).
    pub hops: Vec<HopPlan>,
    /// Milliseconds per decoded token of one session: stages, hops and driver legs.
    pub decode_ms_per_token: f64,
    /// One session's decode rate.
    pub tokens_per_s: f64,
    /// All sessions together.
    pub throughput_tokens_per_s: f64,
    /// Milliseconds to prefill a 512-token prompt through the pipeline.
    pub prefill_ms_512: f64,
    /// Prompt tokens per second of that prefill.
    pub prefill_tokens_per_s: f64,
    /// Joules per decoded token, when every device used has watts.
    pub energy_j_per_token: Option<f64>,
    /// Average power while decoding, in watts, when every device used has watts.
    pub avg_watts: Option<f64>,
    /// The slowest stage or hop and its share of a token's time (for throughput: the rate it
    /// caps the pipeline at).
    pub bottleneck: String,
    /// Split layers: the experts of layers `[0, cpu_moe)` are in the node's RAM (0: whole
    /// layers; a layer on the CPU holds its experts there anyway).
    pub cpu_moe: usize,
    /// The device whose RAM holds the split layers' experts (`node/cpu`), when any; across
    /// nodes each node's CPU holds its own layers' (the stages' `host_device`), listed here
    /// `, `-separated.
    pub host_device: Option<String>,
    /// Bytes of experts the hosts hold for the other devices' split layers.
    pub host_expert_bytes: u64,
    /// Single-device placements, and the driver's node alone, with why each lost.
    pub rejected: Vec<Rejected>,
    /// Memory other models hold, as the policy gave it.
    pub reserved: Vec<Reservation>,
}

fn ms(s: f64) -> f64 {
    s * 1e3
}

/// Bytes in the largest binary unit that keeps the number at or above 1.
pub fn human(b: u64) -> String {
    let f = b as f64;
    const K: f64 = 1024.0;
    if f >= K * K * K {
        format!("{:.2} GiB", f / (K * K * K))
    } else if f >= K * K {
        format!("{:.1} MiB", f / (K * K))
    } else if f >= K {
        format!("{:.1} KiB", f / K)
    } else {
        format!("{b} B")
    }
}

fn check_watts(p: &Problem, policy: &Policy) -> Result<(), PlanError> {
    if policy.objective == Objective::Energy || policy.max_watts.is_some() {
        let missing: Vec<String> = p.devs.iter().filter(|d| d.watts.is_none()).map(|d| d.label()).collect();
        if !missing.is_empty() {
            return Err(PlanError::MissingWatts(missing.join(", ")));
        }
    }
    Ok(())
}

/// Why nothing fits: the whole model against all the memory there is.
fn infeasible(p: &Problem, what: &str) -> PlanError {
    if let Some((need, have)) = p.host_shortfall() {
        return PlanError::Infeasible {
            shortfall_bytes: need - have,
            detail: format!(
                "the experts of layers 0–{} need {} in RAM, the CPU has {} after headroom",
                p.cpu_moe - 1,
                human(need),
                human(have)
            ),
        };
    }
    let need = p.whole_model_mem().total();
    let have: u64 = p.devs.iter().map(|d| d.budget).sum();
    let biggest_layer = (0..p.n_layers).map(|l| p.stage_mem(l, l + 1).total()).max().unwrap_or(0);
    let roomiest = p.devs.iter().map(|d| d.budget).max().unwrap_or(0);
    if need > have {
        PlanError::Infeasible {
            shortfall_bytes: need - have,
            detail: format!("{what} needs {} (weights + KV cache for {} tokens × {} sessions), all devices together have {} after headroom", human(need), p.ctx, p.sessions, human(have)),
        }
    } else if biggest_layer > roomiest {
        PlanError::Infeasible {
            shortfall_bytes: biggest_layer - roomiest,
            detail: format!(
                "one layer with its KV cache needs {}, the roomiest device has {}",
                human(biggest_layer),
                human(roomiest)
            ),
        }
    } else {
        PlanError::Infeasible {
            shortfall_bytes: 0,
            detail: format!("{what} fits in total memory ({} of {}), but no chain of linked devices reachable from the driver holds it", human(need), human(have)),
        }
    }
}

/// Plans `profile` on `inv` under `policy`. With [`CpuMoe::Auto`] and a mixture of experts on a
/// cluster where a node has a CPU and another device, every number of split layers is planned
/// (across nodes beyond the exact program's reach, [`SPLIT_GRID`] of them, then those between
/// the best one's neighbours, except for energy) and the best for the objective kept (a larger
/// context first for max-context; ties to fewer split layers). For latency and throughput each
/// split after the first is asked only for a plan better than the best so far
/// ([`search::solve_beating`]), so every split is tried grid first, then nearest the best.
pub fn plan(inv: &Inventory, profile: &ModelProfile, policy: &Policy) -> Result<Plan, PlanError> {
    policy.validate()?;
    let splits = splits_searched(inv, profile, policy);
    // the energy objective's slack applies to the best latency over every split: each split's
    // own best latency (infinite where nothing fits), then the best of them
    let own: Vec<f64> = match (policy.objective, splits.len()) {
        (Objective::Energy, 2..) => splits
            .iter()
            .map(|&n| {
                let p = Problem::with_cpu_moe(inv, profile, policy, policy.ctx, n).ok();
                p.and_then(|p| search::solve(&p, policy, Objective::Latency))
                    .map_or(f64::INFINITY, |s| s.metrics.decode_s)
            })
            .collect(),
        _ => Vec::new(),
    };
    let t_best = own.iter().copied().min_by(f64::total_cmp).filter(|t| t.is_finite());
    let mut best: Option<(Problem, Policy, Solution)> = None;
    let mut first_err = None;
    let mut whole = None;
    // latency and throughput: each split is asked only for a plan better than the best so far
    // (the exact program across nodes then prunes by it), so the splits go grid first, every
    // ⌈(L+1)/SPLIT_GRID⌉-th, then the rest nearest the best first: a good bar early
    let bars = matches!(policy.objective, Objective::Latency | Objective::Throughput);
    // the splits' step: 1, or beyond the exact program's reach the grid's, whose best one's
    // neighbours are tried after it (not for energy, whose slack applies to the best latency
    // over the splits searched, all known in advance)
    let step = splits.get(1).map_or(1, |s| s - splits[0]);
    let stride = match bars && step == 1 {
        true => splits.len().div_ceil(SPLIT_GRID).max(1),
        false => 1,
    };
    // (popped from the end: the fewest split layers first)
    let mut todo: Vec<(usize, Option<(f64, f64)>)> = splits
        .iter()
        .enumerate()
        .rev()
        .filter(|(k, _)| k % stride == 0)
        .map(|(k, &n)| (n, t_best.map(|tb| (tb, own[k]))))
        .collect();
    let mut later: Vec<usize> = splits.iter().enumerate().filter(|(k, _)| k % stride != 0).map(|(_, &n)| n).collect();
    let mut refined = (step <= 1 && later.is_empty()) || policy.objective == Objective::Energy;
    while let Some((n, bound)) = todo.pop() {
        let bar = best.as_ref().filter(|_| bars).map(|(_, _, b)| &b.metrics);
        match plan_at(inv, profile, policy, n, bound, bar) {
            // no plan better than the best so far
            Ok(None) => {}
            Ok(Some((p, pol, sol))) => {
                let better = best.as_ref().is_none_or(|(bp, _, b)| {
                    let (v, w) = (
                        search::objective_value(policy.objective, &sol.metrics),
                        search::objective_value(policy.objective, &b.metrics),
                    );
                    // ties to fewer split layers
                    sol.ctx > b.ctx || (sol.ctx == b.ctx && (v < w || (v == w && p.cpu_moe < bp.cpu_moe)))
                });
                if n == 0 && splits.len() > 1 {
                    whole = Some(Ok(sol.metrics.clone()));
                }
                if better {
                    best = Some((p, pol, sol));
                }
            }
            Err(e) => {
                if n == 0 && splits.len() > 1 {
                    whole = Some(Err(()));
                }
                first_err.get_or_insert(e);
            }
        }
        if todo.is_empty() && !refined {
            refined = true;
            let c = best.as_ref().map(|(p, _, _)| p.cpu_moe);
            if step > 1 {
                // beyond reach: the splits between the best one's neighbours on the grid
                if let Some(c) = c {
                    let near = c.saturating_sub(step - 1)..=(c + step - 1).min(profile.n_layers());
                    todo.extend(near.rev().filter(|n| !splits.contains(n)).map(|n| (n, None)));
                }
            } else {
                // the rest, nearest the best first (popped from the end: sorted farthest first)
                let c = c.unwrap_or(0);
                later.sort_by_key(|&n| std::cmp::Reverse((n.abs_diff(c), n)));
                todo.extend(later.drain(..).map(|n| (n, None)));
            }
        }
    }
    let Some((p, pol, sol)) = best else {
        return Err(first_err.unwrap_or_else(|| PlanError::BadModel("no placement was searched".into())));
    };
    let mut plan = build(&p, &pol, &sol);
    // the split chosen against whole layers, with numbers
    if p.cpu_moe > 0 {
        let r = match whole {
            Some(Ok(m)) => Some(Rejected {
                alternative: "whole layers (no experts in RAM)".into(),
                reason: format!("{:.2} tokens/s", rate(policy.objective, &m)),
                tokens_per_s: Some(rate(policy.objective, &m)),
                shortfall_bytes: None,
            }),
            Some(Err(())) => {
                let q = Problem::with_cpu_moe(inv, profile, &pol, pol.ctx, 0)?;
                match infeasible(&q, &profile.name) {
                    PlanError::Infeasible { shortfall_bytes, detail } => Some(Rejected {
                        alternative: "whole layers (no experts in RAM)".into(),
                        reason: detail,
                        tokens_per_s: None,
                        shortfall_bytes: Some(shortfall_bytes),
                    }),
                    _ => None,
                }
            }
            None => None,
        };
        plan.rejected.extend(r);
    }
    Ok(plan)
}

/// Most numbers of split layers [`CpuMoe::Auto`] tries first across nodes beyond the exact
/// program's reach (every one elsewhere).
const SPLIT_GRID: usize = 16;

/// The numbers of split layers [`plan`] tries first: the one asked for; with [`CpuMoe::Auto`]
/// where a node has a CPU and another device, every one — except across nodes beyond the exact
/// program's reach ([`crate::across::within_reach_of`]), where each is the reservation
/// heuristic's many programs (95 splits of a 94-layer model on 100 nodes took 13 s, on four GPU
/// boxes 150 s for energy): every ⌈(L+1)/[`SPLIT_GRID`]⌉-th, and all of them, [`plan`] then
/// trying those between the best one's neighbours; else none.
pub fn splits_searched(inv: &Inventory, profile: &ModelProfile, policy: &Policy) -> Vec<usize> {
    match policy.cpu_moe {
        CpuMoe::Layers(n) => vec![n],
        CpuMoe::Auto if splits_possible(inv, profile) => {
            let l = profile.n_layers();
            let step = match inv.nodes.len() > 1 && !crate::across::within_reach_of(inv.n_devices(), l) {
                true => (l + 1).div_ceil(SPLIT_GRID),
                false => 1,
            };
            let mut all: Vec<usize> = (0..=l).step_by(step).collect();
            if all.last() != Some(&l) {
                all.push(l);
            }
            all
        }
        CpuMoe::Auto => vec![0],
    }
}

/// Whether [`CpuMoe::Auto`] searches split layers: a mixture of experts on a cluster where
/// some node has a CPU and another device (across nodes each split is planned by
/// [`search::solve`]: the exact program of [`crate::across`] where it is within reach, else the
/// reservation heuristic).
fn splits_possible(inv: &Inventory, profile: &ModelProfile) -> bool {
    let both = |n: &brigade_core::NodeSpec| {
        n.devices.iter().any(|d| d.kind == DeviceKind::Cpu) && n.devices.iter().any(|d| d.kind != DeviceKind::Cpu)
    };
    profile.moe.is_some() && inv.nodes.iter().any(both)
}

/// The plan with the experts of layers `[0, n)` in RAM: the problem, the policy (with the
/// context max-context found) and the solution. `bound`: for the energy objective, the best
/// decode latency over every split, which the slack applies to, and this split's own.
fn plan_at<'a>(
    inv: &'a Inventory,
    profile: &'a ModelProfile,
    policy: &Policy,
    n: usize,
    bound: Option<(f64, f64)>,
    bar: Option<&Metrics>,
) -> Result<Option<(Problem<'a>, Policy, Solution)>, PlanError> {
    let mut policy = Policy { cpu_moe: CpuMoe::Layers(n), ..policy.clone() };
    if policy.objective == Objective::MaxContext {
        let build = |ctx: u64| Problem::with_cpu_moe(inv, profile, &policy, ctx, n);
        match search::max_context(&build, &policy, profile.context_length)? {
            Some(ctx) => policy.ctx = ctx,
            None => return Err(infeasible(&Problem::with_cpu_moe(inv, profile, &policy, 1, n)?, &profile.name)),
        }
    }
    let p = Problem::with_cpu_moe(inv, profile, &policy, policy.ctx, n)?;
    check_watts(&p, &policy)?;
    let mut search_policy = policy.clone();
    if let (Objective::Energy, Some((tb, own))) = (policy.objective, bound) {
        // slack × this split's best latency = slack × the best over every split
        search_policy.slack = policy.slack * tb / own;
    }
    let found = search::solve_beating(&p, &search_policy, policy.objective, bar);
    if found.is_none() && bar.is_some() {
        return Ok(None);
    }
    let mut sol = found.ok_or_else(|| {
        if policy.max_watts.is_some()
            && search::solve(&p, &Policy { max_watts: None, ..policy.clone() }, Objective::Latency).is_some()
        {
            PlanError::BadValue {
                what: "--max-watts".into(),
                value: format!("{}", policy.max_watts.unwrap_or(0.0)),
                why: "is below the average power of every placement that fits".into(),
            }
        } else {
            infeasible(&p, &profile.name)
        }
    })?;
    if let (Objective::Energy, Some((tb, _))) = (policy.objective, bound) {
        sol.latency_bound_s = Some(tb);
    }
    Ok(Some((p, policy, sol)))
}

/// Plans a second, smaller model first, kept whole on the one device where it decodes fastest,
/// then `main` on the memory left. Returns (main plan, second plan).
pub fn plan_with_second(
    inv: &Inventory,
    main: &ModelProfile,
    second: &ModelProfile,
    policy: &Policy,
) -> Result<(Plan, Plan), PlanError> {
    policy.validate()?;
    // the second model is kept whole on one device: no split layers
    let p2 = Problem::new(inv, second, &Policy { cpu_moe: CpuMoe::Layers(0), ..policy.clone() }, policy.ctx)?;
    // the device where the second model alone decodes fastest
    let best = (0..p2.devs.len())
        .filter_map(|d| p2.evaluate(&[(d, 0, p2.n_layers)]).map(|m| (d, m)))
        .min_by(|a, b| a.1.decode_s.total_cmp(&b.1.decode_s).then(a.0.cmp(&b.0)));
    let Some((d, m)) = best else {
        return Err(match infeasible(&p2, &second.name) {
            PlanError::Infeasible { shortfall_bytes, detail } => PlanError::Infeasible {
                shortfall_bytes,
                detail: format!("the second model must fit whole on one device: {detail}"),
            },
            e => e,
        });
    };
    let sol2 =
        Solution { stages: vec![(d, 0, p2.n_layers)], metrics: m, ctx: policy.ctx, exact: true, latency_bound_s: None };
    let mut second_policy = policy.clone();
    second_policy.objective = Objective::Latency;
    let plan2 = build(&p2, &second_policy, &sol2);
    let dev = &p2.devs[d];
    let mut policy1 = policy.clone();
    policy1.reserved.push(Reservation {
        node: dev.node_name.clone(),
        device: dev.name.clone(),
        bytes: p2.stage_mem(0, p2.n_layers).total(),
        by: second.name.clone(),
    });
    let plan1 = plan(inv, main, &policy1)?;
    Ok((plan1, plan2))
}

fn stage_label(p: &Problem, d: usize, a: usize, b: usize) -> String {
    format!("{} (layers {a}–{})", p.devs[d].label(), b - 1)
}

fn build(p: &Problem, policy: &Policy, sol: &Solution) -> Plan {
    let m = &sol.metrics;
    let l = p.n_layers;
    let per_layer: Vec<f64> =
        sol.stages.iter().map(|&(d, a, b)| (p.layer_t[d][b] - p.layer_t[d][a]) / (b - a) as f64).collect();
    let fastest = per_layer.iter().cloned().fold(f64::INFINITY, f64::min);
    let driver_node = p.inv.nodes[p.driver].name.clone();
    let hosts = p.host_usage(&sol.stages);
    let stages: Vec<StagePlan> = sol
        .stages
        .iter()
        .enumerate()
        .map(|(i, &(d, a, b))| {
            let dev = &p.devs[d];
            let mut mem = p.stage_mem_on(d, a, b);
            let mut budget = dev.budget;
            let split = p.splits_on(d) && a < p.cpu_moe;
            if !split && p.host.is_some() {
                // on one node a stage on the host holds its own layers' experts, which the
                // problem counts with the host's share: shown here, with the budget they take
                let own = p.host_expert_bytes(a, b);
                mem.weights += own;
                budget += own;
            }
            let host_use = hosts.iter().find(|u| u.host == d);
            if let Some(u) = host_use {
                // across nodes: the host's budget less the other stages' experts it holds
                budget = u.budget.saturating_sub(u.expert_bytes);
            }
            let host_device = p.host_of(d).filter(|_| split).map(|h| p.devs[h].label());
            let mut why = vec![format!(
                "{} layer{} at {:.3} ms each",
                b - a,
                if b - a == 1 { "" } else { "s" },
                ms(per_layer[i])
            )];
            if sol.stages.len() > 1 && per_layer[i] <= fastest {
                why.push("the fastest device used".into());
            }
            // full: the range cannot grow by one layer at either end
            // (a host across nodes: within its budget less the other stages' experts it holds)
            let grows = |a: usize, b: usize| match host_use {
                Some(u) => p.stage_mem_on(d, a, b).total() + u.expert_bytes <= u.budget,
                None => p.fits(d, a, b),
            };
            let full = (b < l && !grows(a, b + 1)) || (a > 0 && !grows(a - 1, b));
            let pct = 100.0 * mem.total() as f64 / budget.max(1) as f64;
            if full {
                why.push(format!("{pct:.0}% of its budget: one more layer would not fit"));
            } else {
                why.push(format!("{pct:.0}% of its budget"));
            }
            if split {
                why.push(format!(
                    "the experts of layers {a}–{} in {}'s RAM ({})",
                    b.min(p.cpu_moe) - 1,
                    host_device.clone().unwrap_or_default(),
                    human(p.host_expert_bytes(a, b))
                ));
            }
            if a == 0 {
                why.push("holds the embedding".into());
            }
            if b == l {
                why.push("holds the norm and head".into());
            }
            if dev.node != p.driver {
                if let Some(link) = p.inv.link(&driver_node, &dev.node_name) {
                    why.push(format!("{:.3} ms from the driver", ms(link.latency)));
                }
            }
            StagePlan {
                node: dev.node_name.clone(),
                device: dev.name.clone(),
                kind: dev.kind,
                layers: (a, b),
                weight_bytes: mem.weights,
                kv_bytes: mem.kv,
                memory_bytes: mem.total(),
                budget_bytes: budget,
                host_layers: split.then_some((a, b.min(p.cpu_moe))),
                host_expert_bytes: if split { p.host_expert_bytes(a, b) } else { 0 },
                host_device,
                compute_ms: ms(m.stage_s[i]),
                prefill_ms_512: ms(p.stage_prefill(d, a, b, 512.0)),
                reason: why.join("; "),
            }
        })
        .collect();
    let mut hops = Vec::new();
    let act512 = p.profile.act_bytes() as f64 * 512.0;
    for (i, w) in sol.stages.windows(2).enumerate() {
        hops.push(HopPlan {
            from: p.devs[w[0].0].label(),
            to: p.devs[w[1].0].label(),
            ms: ms(m.hop_s[i]),
            prefill_ms_512: ms(p.hop_bytes(w[0].0, w[1].0, act512).unwrap_or(f64::NAN)),
        });
    }
    let (first, last) = (sol.stages[0].0, sol.stages[sol.stages.len() - 1].0);
    hops.push(HopPlan {
        from: format!("driver {driver_node}"),
        to: p.devs[first].label(),
        ms: ms(m.driver_in_s),
        prefill_ms_512: ms(p.driver_leg(first, 4.0 * 512.0).unwrap_or(f64::NAN)),
    });
    hops.push(HopPlan {
        from: p.devs[last].label(),
        to: format!("driver {driver_node}"),
        ms: ms(m.driver_out_s),
        prefill_ms_512: ms(p.driver_leg(last, 4.0).unwrap_or(f64::NAN)),
    });
    let prefill = p.prefill(&sol.stages, 512).unwrap_or(f64::NAN);
    Plan {
        model: p.profile.name.clone(),
        objective: policy.objective,
        ctx: sol.ctx,
        sessions: policy.sessions,
        headroom: policy.headroom,
        driver: driver_node,
        exact: sol.exact,
        heuristic: (!sol.exact).then(|| {
            match p.across_nodes() {
                true => "split layers' RAM across nodes",
                false => "device choice",
            }
            .to_string()
        }),
        bottleneck: bottleneck(p, sol, policy.objective),
        rejected: rejected(p, policy, sol),
        cpu_moe: p.cpu_moe,
        host_device: match p.host {
            Some(h) if p.cpu_moe > 0 => Some(p.devs[h].label()),
            _ => {
                let mut all: Vec<String> = Vec::new();
                for h in stages.iter().filter_map(|s| s.host_device.clone()) {
                    if !all.contains(&h) {
                        all.push(h);
                    }
                }
                (!all.is_empty()).then(|| all.join(", "))
            }
        },
        host_expert_bytes: stages.iter().map(|s| s.host_expert_bytes).sum(),
        stages,
        hops,
        decode_ms_per_token: ms(m.decode_s),
        tokens_per_s: 1.0 / m.decode_s,
        throughput_tokens_per_s: m.throughput,
        prefill_ms_512: ms(prefill),
        prefill_tokens_per_s: 512.0 / prefill,
        energy_j_per_token: m.energy_j,
        avg_watts: m.avg_watts(),
        reserved: policy.reserved.clone(),
    }
}

fn bottleneck(p: &Problem, sol: &Solution, obj: Objective) -> String {
    let m = &sol.metrics;
    let mut parts: Vec<(f64, String)> = sol
        .stages
        .iter()
        .zip(&m.stage_s)
        .map(|(&(d, a, b), &t)| (t, format!("stage {}", stage_label(p, d, a, b))))
        .collect();
    for (w, &t) in sol.stages.windows(2).zip(&m.hop_s) {
        parts.push((t, format!("hop {} → {}", p.devs[w[0].0].label(), p.devs[w[1].0].label())));
    }
    if obj == Objective::Throughput {
        // what caps many sessions is each device's load: the host of split layers also computes
        // the other stages' experts
        for (&(d, a, b), part) in sol.stages.iter().zip(parts.iter_mut()) {
            part.0 = p.stage_load(d, a, b);
        }
        if let Some(h) = p.host.filter(|_| p.cpu_moe > 0 && !sol.stages.iter().any(|s| Some(s.0) == p.host)) {
            parts.push((p.host_floor(), format!("the split layers' experts on {}", p.devs[h].label())));
        }
        // across nodes: each host's own stage and its node's split experts
        for u in p.host_usage(&sol.stages) {
            match sol.stages.iter().position(|s| s.0 == u.host) {
                Some(i) => parts[i].0 = u.load(),
                None => parts.push((u.load(), format!("the split layers' experts on {}", p.devs[u.host].label()))),
            }
        }
    }
    let Some((t, what)) = parts.into_iter().max_by(|a, b| a.0.total_cmp(&b.0)) else {
        return String::new();
    };
    if obj == Objective::Throughput {
        format!("{what}: {:.3} ms per token caps the pipeline at {:.1} tokens/s", ms(t), 1.0 / t)
    } else {
        format!("{what}: {:.3} ms of {:.3} ms per token ({:.0}%)", ms(t), ms(m.decode_s), 100.0 * t / m.decode_s)
    }
}

fn rate(obj: Objective, m: &Metrics) -> f64 {
    if obj == Objective::Throughput {
        m.throughput
    } else {
        1.0 / m.decode_s
    }
}

/// Bytes the whole model is short of on device `d` alone: across nodes with split layers, what
/// the device lacks for the dense part plus what its host lacks for the experts.
fn short_alone(p: &Problem, d: usize) -> u64 {
    let l = p.n_layers;
    match p.host_of(d).filter(|_| p.across_nodes() && p.splits_on(d)) {
        Some(h) => {
            p.stage_mem_on(d, 0, l).total().saturating_sub(p.devs[d].budget)
                + p.host_expert_bytes(0, l).saturating_sub(p.host_budget(h))
        }
        None => p.whole_model_mem().total().saturating_sub(p.devs[d].budget),
    }
}

/// Single-device placements and the driver's node alone, with why each lost.
fn rejected(p: &Problem, policy: &Policy, sol: &Solution) -> Vec<Rejected> {
    let l = p.n_layers;
    let chosen = search::objective_value(policy.objective, &sol.metrics);
    let mut out: Vec<(f64, Rejected)> = Vec::new();
    let mut consider: Vec<usize> = (0..p.devs.len()).collect();
    // on large clusters, the driver's devices and the fastest few
    if consider.len() > 8 {
        consider.sort_by(|&a, &b| p.layer_t[a][l].total_cmp(&p.layer_t[b][l]).then(a.cmp(&b)));
        let mut keep: Vec<usize> = consider.iter().copied().filter(|&d| p.devs[d].node == p.driver).collect();
        keep.extend(consider.iter().copied().filter(|&d| p.devs[d].node != p.driver).take(3));
        consider = keep;
    }
    let whole = p.whole_model_mem().total();
    for d in consider {
        let stages = [(d, 0, l)];
        if sol.stages.as_slice() == stages {
            continue;
        }
        let name = match p.cpu_moe {
            n if n > 0 && p.splits_on(d) => {
                format!("all on {} (experts of layers 0–{} in RAM)", p.devs[d].label(), n - 1)
            }
            _ => format!("all on {}", p.devs[d].label()),
        };
        match p.evaluate(&stages) {
            Some(m) => {
                let why = match policy.objective {
                    Objective::Energy => format!("{:.3} J/token", m.energy_j.unwrap_or(f64::NAN)),
                    _ => format!("{:.2} tokens/s", rate(policy.objective, &m)),
                };
                let v = search::objective_value(policy.objective, &m);
                if v >= chosen || policy.max_watts.is_some() {
                    let why = match m.avg_watts() {
                        Some(w) if policy.max_watts.is_some_and(|c| w > c) => {
                            format!("{why}, draws {w:.0} W")
                        }
                        _ => why,
                    };
                    out.push((
                        v,
                        Rejected {
                            alternative: name,
                            reason: why,
                            tokens_per_s: Some(rate(policy.objective, &m)),
                            shortfall_bytes: None,
                        },
                    ));
                }
            }
            None if short_alone(p, d) > 0 => {
                let short = short_alone(p, d);
                out.push((
                    f64::INFINITY,
                    Rejected {
                        alternative: name,
                        reason: format!("does not fit by {}", human(short)),
                        tokens_per_s: None,
                        shortfall_bytes: Some(short),
                    },
                ));
            }
            None => {}
        }
    }
    let driver_devs: Vec<usize> = (0..p.devs.len()).filter(|&d| p.devs[d].node == p.driver).collect();
    let uses_others = sol.stages.iter().any(|s| p.devs[s.0].node != p.driver);
    // (across nodes the device program alone does not hold each node's share of split experts)
    if uses_others && driver_devs.len() > 1 && driver_devs.len() <= dp::MAX_SUBSET && !p.across_nodes() {
        let name = format!("only {}'s devices", p.inv.nodes[p.driver].name);
        match dp::min_latency(p, &driver_devs, None).and_then(|(_, s)| p.evaluate(&s)) {
            Some(m) => out.push((
                search::objective_value(policy.objective, &m),
                Rejected {
                    alternative: name,
                    reason: format!("{:.2} tokens/s", rate(policy.objective, &m)),
                    tokens_per_s: Some(rate(policy.objective, &m)),
                    shortfall_bytes: None,
                },
            )),
            None => {
                let have: u64 = driver_devs.iter().map(|&d| p.devs[d].budget).sum();
                let short = whole.saturating_sub(have);
                out.push((
                    f64::INFINITY,
                    Rejected {
                        alternative: name,
                        reason: format!("does not fit by {}", human(short)),
                        tokens_per_s: None,
                        shortfall_bytes: Some(short),
                    },
                ));
            }
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.alternative.cmp(&b.1.alternative)));
    out.into_iter().map(|(_, r)| r).take(6).collect()
}

impl Plan {
    /// The plan as text: the stage table, hops, predictions, bottleneck, reasons, alternatives.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let w = |s: &mut String, line: String| {
            s.push_str(&line);
            s.push('\n');
        };
        w(
            &mut s,
            format!(
                "plan for {} — objective {}, ctx {}, {} session{}, headroom {:.0}%, driver {}{}",
                self.model,
                self.objective,
                self.ctx,
                self.sessions,
                if self.sessions == 1 { "" } else { "s" },
                self.headroom * 100.0,
                self.driver,
                self.heuristic.as_ref().map_or(String::new(), |h| format!(" (heuristic {h})"))
            ),
        );
        for r in &self.reserved {
            w(&mut s, format!("reserved: {} on {}/{} for {}", human(r.bytes), r.node, r.device, r.by));
        }
        if let Some(host) = self.host_device.as_ref().filter(|_| self.host_expert_bytes > 0) {
            // one host: the stages' layers, then where; several (across nodes): each stage's
            let one = !host.contains(", ");
            let nodes = self.stages.iter().any(|st| st.node != self.stages[0].node);
            let split: Vec<String> = self
                .stages
                .iter()
                .filter_map(|st| {
                    let (a, b) = st.host_layers?;
                    Some(match (one, &st.host_device) {
                        (false, Some(h)) => format!("{}–{} of {}/{} in {h}'s RAM", a, b - 1, st.node, st.device),
                        _ if nodes => format!("{}–{} of {}/{}", a, b - 1, st.node, st.device),
                        _ => format!("{}–{} of {}", a, b - 1, st.device),
                    })
                })
                .collect();
            let whose = if one { format!(" in {host}'s RAM") } else { String::new() };
            w(
                &mut s,
                format!(
                    "split layers (--n-cpu-moe {}): experts of layers {}{whose}, {}",
                    self.cpu_moe,
                    split.join(", "),
                    human(self.host_expert_bytes)
                ),
            );
        }
        w(
            &mut s,
            format!(
                "{:>2}  {:<22} {:>9}  {:>10}  {:>10}  {:>23}  {:>9}",
                "#", "device", "layers", "weights", "KV cache", "memory / budget", "ms/token"
            ),
        );
        for (i, st) in self.stages.iter().enumerate() {
            w(
                &mut s,
                format!(
                    "{:>2}  {:<22} {:>9}  {:>10}  {:>10}  {:>23}  {:>9.3}",
                    i + 1,
                    format!("{}/{}", st.node, st.device),
                    format!("{}–{}", st.layers.0, st.layers.1 - 1),
                    human(st.weight_bytes),
                    human(st.kv_bytes),
                    format!("{} / {}", human(st.memory_bytes), human(st.budget_bytes)),
                    st.compute_ms
                ),
            );
        }
        let hops: Vec<String> = self.hops.iter().map(|h| format!("{} → {} {:.3} ms", h.from, h.to, h.ms)).collect();
        w(&mut s, format!("hops: {}", hops.join("; ")));
        w(
            &mut s,
            format!(
                "decode: {:.3} ms/token = {:.2} tokens/s per session, {:.2} tokens/s for {} session{}",
                self.decode_ms_per_token,
                self.tokens_per_s,
                self.throughput_tokens_per_s,
                self.sessions,
                if self.sessions == 1 { "" } else { "s" }
            ),
        );
        w(
            &mut s,
            format!("prefill: 512 tokens in {:.1} ms = {:.1} tokens/s", self.prefill_ms_512, self.prefill_tokens_per_s),
        );
        if let (Some(e), Some(wt)) = (self.energy_j_per_token, self.avg_watts) {
            w(&mut s, format!("energy: {e:.3} J/token, {wt:.0} W average while decoding"));
        }
        w(&mut s, format!("bottleneck: {}", self.bottleneck));
        w(&mut s, "why:".into());
        for (i, st) in self.stages.iter().enumerate() {
            w(&mut s, format!("  {} {}/{}: {}", i + 1, st.node, st.device, st.reason));
        }
        if !self.rejected.is_empty() {
            w(&mut s, "rejected:".into());
            for r in &self.rejected {
                w(&mut s, format!("  {}: {}", r.alternative, r.reason));
            }
        }
        s
    }
}
