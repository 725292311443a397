//! Which devices the dynamic programs see, and how each objective uses them.
//!
//! Up to [`EXACT_MAX`] devices the programs run over all of them: the result is the optimum of
//! the cost model. Beyond, a heuristic:
//! 1. score each device by its per-layer decode time plus the hop to and from the driver's node
//!    amortised over the layers it can hold, and keep the best [`CANDIDATES`] (the driver's own
//!    devices always among them);
//! 2. latency: [`dp::beam_latency`] over those candidates, which keeps the [`BEAM`] best partial
//!    chains with distinct device sets per (last device, layers placed) instead of all of them,
//!    extending the [`BEAM_SOURCES`] best of them;
//! 3. the other objectives: the exact programs on [`EXACT_MAX`] devices: those the latency beam
//!    used, then the best-scored others.
//!
//! The gap to the exact optimum is measured by `cargo bench -p brigade-planner` on random
//! clusters of 9–12 devices.

use crate::across;
use crate::cost::{Metrics, Problem};
use crate::dp::{self, Second, Stages};
use crate::{Objective, PlanError, Policy};

/// Devices up to which every chain is searched.
pub const EXACT_MAX: usize = 8;
/// Devices the heuristic considers at all.
pub const CANDIDATES: usize = 32;
/// Partial chains kept per cell by the beam search.
pub const BEAM: usize = 16;
/// Partial chains per cell the beam search extends to each next device.
pub const BEAM_SOURCES: usize = 2;

/// A solved placement.
pub struct Solution {
    /// The chain: (device, first layer, end layer) in pipeline order.
    pub stages: Stages,
    /// The cost model's numbers for it.
    pub metrics: Metrics,
    /// Context tokens per session it was planned for.
    pub ctx: u64,
    /// False when the heuristic chose the devices or a Pareto front was thinned.
    pub exact: bool,
    /// For the energy objective: the latency-optimal decode seconds the slack applies to.
    pub latency_bound_s: Option<f64>,
}

/// The objective value of metrics, as a number to minimise (throughput negated).
pub fn objective_value(obj: Objective, m: &Metrics) -> f64 {
    match obj {
        Objective::Latency | Objective::MaxContext => m.decode_s,
        Objective::Throughput => -m.throughput,
        Objective::Energy => m.energy_j.unwrap_or(f64::INFINITY),
    }
}

fn score(p: &Problem, d: usize) -> f64 {
    let l = p.n_layers as f64;
    let per_layer = p.layer_t[d][p.n_layers] / l;
    let avg_layer_bytes = (p.profile.layer_bytes.iter().sum::<u64>() as f64 / l) + p.kv_layer_avg();
    let holds = (p.devs[d].budget as f64 / avg_layer_bytes).clamp(1.0, l);
    // a device with no direct link to the driver can still sit mid-chain: charge it the slowest
    // hop of the cluster each way instead of excluding it
    let legs = match (p.drv_in[d], p.drv_out[d], p.hop_bytes_from_driver(d)) {
        (Some(i), Some(o), Some(h)) => i + o + 2.0 * h,
        _ => 4.0 * p.hop.iter().flatten().flatten().fold(0.0f64, |m, &x| m.max(x)),
    };
    per_layer + legs / holds
}

/// The best-scored devices, the driver's own first.
fn candidates(p: &Problem, ranked: &[usize], n: usize) -> Vec<usize> {
    let mut s: Vec<usize> = ranked.iter().copied().filter(|&d| p.devs[d].node == p.driver).take(n).collect();
    for &d in ranked {
        if s.len() >= n {
            break;
        }
        if !s.contains(&d) {
            s.push(d);
        }
    }
    s
}

fn ranked(p: &Problem) -> Vec<usize> {
    let mut v: Vec<usize> = (0..p.devs.len()).collect();
    v.sort_by(|&a, &b| score(p, a).total_cmp(&score(p, b)).then(a.cmp(&b)));
    v
}

/// Solves `obj` exactly on one subset of devices.
fn solve_subset(p: &Problem, subset: &[usize], policy: &Policy, obj: Objective) -> Option<(Stages, bool, Option<f64>)> {
    match obj {
        Objective::Latency | Objective::MaxContext => match policy.max_watts {
            None => dp::min_latency(p, subset, None).map(|(_, s)| (s, true, None)),
            Some(cap) => {
                // average power ≤ cap  ⇔  Σ (watts − cap)·t_stage − cap·(hops + legs) ≤ 0
                let coef: Vec<f64> = p.devs.iter().map(|d| d.watts.unwrap_or(0.0) - cap).collect();
                let (front, exact) = dp::pareto(p, subset, &Second { coef: &coef, hop_coef: -cap });
                front.into_iter().find(|(_, z, _)| *z <= 1e-12).map(|(_, _, s)| (s, exact, None))
            }
        },
        Objective::Throughput => throughput(p, subset).map(|s| (s, true, None)),
        Objective::Energy => {
            let (t_lat, _) = dp::min_latency(p, subset, None)?;
            let coef: Vec<f64> = p.devs.iter().map(|d| d.watts.unwrap_or(0.0)).collect();
            let (front, exact) = dp::pareto(p, subset, &Second { coef: &coef, hop_coef: 0.0 });
            let limit = t_lat * policy.slack * (1.0 + 1e-12);
            front
                .into_iter()
                .filter(|(t, _, _)| *t <= limit)
                .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.total_cmp(&b.0)))
                .map(|(_, _, s)| (s, exact, Some(t_lat)))
        }
    }
}

/// Maximum throughput: the best solution is the latency-optimal one under some cap on every
/// stage's load ([`Problem::stage_load`]) and hop; the cap is one of the finitely many loads or
/// hop times, and the objective
/// `min(S / T(cap), 1 / cap)` rises then falls along the sorted caps, so a search for where
/// `S / T(cap)` first reaches `1 / cap` finds it. The search probes two caps at a time on two
/// threads (thirds of the range per round instead of halves: 6–7 rounds instead of 10 on the
/// 100-node benchmark, each probe a full program over 8 devices).
fn throughput(p: &Problem, subset: &[usize]) -> Option<Stages> {
    let l = p.n_layers;
    let mut caps: Vec<f64> = Vec::new();
    for &d in subset {
        for a in 0..l {
            for b in a + 1..=l {
                if !p.fits(d, a, b) {
                    break;
                }
                caps.push(p.stage_load(d, a, b));
            }
        }
        for &e in subset {
            if let Some(h) = p.hop[d][e] {
                caps.push(h);
            }
        }
    }
    // split layers: the host's experts alone can be the slowest part
    caps.push(p.host_floor());
    caps.sort_by(f64::total_cmp);
    caps.dedup();
    let s = p.sessions as f64;
    let eval = |cap: f64| dp::min_latency(p, subset, Some(cap));
    // T(cap) >= T(∞), so no cap below T(∞) / S qualifies; and the cap of the unconstrained
    // optimum's slowest stage or hop, M, has T(M) = T(∞), so it qualifies if M >= T(∞) / S
    let (t_free, free) = eval(f64::INFINITY)?;
    let slowest = p.evaluate(&free).map(|m| m.bottleneck_s).unwrap_or(f64::INFINITY);
    let mut hi = if slowest >= t_free / s { caps.partition_point(|&c| c < slowest) } else { caps.len() };
    let mut lo = caps.partition_point(|&c| c < t_free / s * (1.0 - 1e-12)).min(hi);
    // does cap i qualify (S / T <= 1 / cap ⇔ T <= S × cap)? The plan when it does.
    let qualifies = |i: usize| -> Option<Stages> {
        let cap = caps[i];
        dp::min_latency_within(p, subset, Some(cap), s * cap * (1.0 + 1e-12))
            .filter(|(t, _)| s / t >= 1.0 / cap)
            .map(|(_, st)| st)
    };
    let mut at_lo: Option<Stages> = None;
    while lo < hi {
        let (m1, m2) = (lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3);
        let (r1, r2) = if m1 == m2 {
            (qualifies(m1), None)
        } else {
            std::thread::scope(|sc| {
                let h = sc.spawn(|| qualifies(m2));
                let r1 = qualifies(m1);
                (r1, h.join().ok().flatten())
            })
        };
        if r1.is_some() {
            hi = m1;
            at_lo = r1;
        } else if m1 != m2 && r2.is_some() {
            (lo, hi) = (m1 + 1, m2);
            at_lo = r2;
        } else {
            lo = m1.max(m2) + 1;
        }
    }
    // the answer is lo (qualifies: throughput 1 / bottleneck) or lo − 1 (does not: S / T)
    let mut best: Option<(f64, Stages)> = None;
    let before = lo.checked_sub(1).and_then(|i| caps.get(i)).and_then(|&c| eval(c)).map(|(_, st)| st);
    let at = at_lo.or_else(|| caps.get(lo).and_then(|&c| eval(c)).map(|(_, st)| st));
    for st in [before, at].into_iter().flatten() {
        if let Some(m) = p.evaluate(&st) {
            if best.as_ref().is_none_or(|(v, _)| m.throughput > *v) {
                best = Some((m.throughput, st));
            }
        }
    }
    best.map(|(_, s)| s).or(Some(free))
}

/// Solves `obj` over every device, whatever their number (up to [`dp::MAX_SUBSET`]): the
/// reference the heuristic is measured against.
pub fn solve_exhaustive(p: &Problem, policy: &Policy, obj: Objective) -> Option<Solution> {
    let all: Vec<usize> = (0..p.devs.len()).collect();
    let (stages, exact, lat) = solve_subset(p, &all, policy, obj)?;
    let metrics = p.evaluate(&stages)?;
    Some(Solution { stages, metrics, ctx: p.ctx, exact, latency_bound_s: lat })
}

/// Solves `obj` on the problem: exactly when small, by the heuristic otherwise; split layers
/// across nodes by [`solve_across`].
pub fn solve(p: &Problem, policy: &Policy, obj: Objective) -> Option<Solution> {
    if p.across_nodes() {
        return solve_across(p, policy, obj);
    }
    solve_fixed(p, policy, obj)
}

/// The exact program's chain `stages` as a solution, `None` if it is not a plan that fits.
fn exact_solution(p: &Problem, stages: Stages, latency_bound_s: Option<f64>) -> Option<Solution> {
    let metrics = p.evaluate(&stages)?;
    Some(Solution { stages, metrics, ctx: p.ctx, exact: true, latency_bound_s })
}

/// [`solve`] where only a plan better than `bar` (another problem's, for `obj`) matters: `None`
/// where the exact program across nodes finds none better, without the reservation heuristic's
/// plan it would otherwise be bounded by (latency and throughput, the objectives whose goal is
/// one number). Elsewhere [`solve`]'s plan, better than `bar` or not. What
/// [`crate::plan`]'s search over the numbers of split layers asks with the best plan so far.
/// (A bar tighter than the heuristic's plan prunes more, so the program may finish, exact,
/// where bounded by that plan it gave up and kept it: never a worse plan.)
pub fn solve_beating(p: &Problem, policy: &Policy, obj: Objective, bar: Option<&Metrics>) -> Option<Solution> {
    let one_number = matches!(obj, Objective::Latency | Objective::Throughput);
    match bar {
        Some(bar) if one_number && p.across_nodes() && across::within_reach(p) => {
            match across::solve(p, policy, obj, Some(bar), across::Budget::DEFAULT) {
                Ok(None) => None,
                // (the program's chain not a plan that fits: what [`solve`] finds instead)
                Ok(Some((stages, _))) => exact_solution(p, stages, None).or_else(|| solve(p, policy, obj)),
                Err(across::TooLarge) => solve(p, policy, obj),
            }
        }
        _ => solve(p, policy, obj),
    }
}

/// Split layers across nodes: the exact program of [`across`] where it is within reach
/// ([`across::within_reach`]), bounded by the reservation heuristic's plan
/// ([`reserve_heuristic`]); that plan where the program gives up ([`across::TooLarge`]) and on
/// larger problems.
fn solve_across(p: &Problem, policy: &Policy, obj: Objective) -> Option<Solution> {
    solve_across_within(p, policy, obj, across::Budget::DEFAULT)
}

/// [`solve_across`] with the exact program held to `budget` (public for tests of what happens
/// when it gives up).
pub fn solve_across_within(p: &Problem, policy: &Policy, obj: Objective, budget: across::Budget) -> Option<Solution> {
    if !across::within_reach(p) {
        return reserve_heuristic(p, policy, obj);
    }
    // energy: the fastest plan known bounds the slack's latency
    let known = reserve_heuristic(p, policy, if obj == Objective::Energy { Objective::Latency } else { obj });
    let exact = |obj: Objective| -> Result<Option<Solution>, across::TooLarge> {
        let found = across::solve(p, policy, obj, known.as_ref().map(|s| &s.metrics), budget)?;
        Ok(found.and_then(|(stages, latency_bound_s)| exact_solution(p, stages, latency_bound_s)))
    };
    match exact(obj) {
        // energy: none within the slack (`known` is the fastest plan, perhaps outside it)
        Ok(found) if obj == Objective::Energy => found,
        // (the program finds every plan the heuristic does: `known` only if it did not)
        Ok(found) => found.or(known),
        Err(across::TooLarge) if obj == Objective::Energy => {
            // the slack applies to the best latency, whichever finds the plan: the exact one if
            // the program finds it, the heuristic's energy plan within it, else the fastest
            let own = known.as_ref().map(|k| k.metrics.decode_s);
            let fastest = match exact(Objective::Latency) {
                Ok(f) => f.or(known),
                Err(across::TooLarge) => return reserve_heuristic(p, policy, obj),
            }?;
            let t = fastest.metrics.decode_s;
            let own = own.unwrap_or(t);
            let scaled = Policy { slack: policy.slack * t / own, ..policy.clone() };
            let limit = t * policy.slack * (1.0 + 1e-12);
            let within = reserve_heuristic(p, &scaled, obj).filter(|s| s.metrics.decode_s <= limit);
            let fastest = Some(Solution { exact: false, ..fastest }).filter(|s| s.metrics.decode_s <= limit);
            let sol = within.or(fastest)?;
            Some(Solution { latency_bound_s: Some(t), ..sol })
        }
        Err(across::TooLarge) => known,
    }
}

/// [`reserve_heuristic`]'s reservation per host (bytes, seconds per token) and room per device.
type Guesses = (Vec<(u64, f64)>, Vec<u64>);

/// Most rounds of [`reserve_heuristic`].
const RESERVE_ROUNDS: usize = 24;

/// Split layers across nodes. A node's CPU holds its own stage and the experts of its other
/// devices' split layers, a share that depends on where the layers land, which the programs
/// cannot follow. So: solve with a reservation on each host (bytes of its budget and seconds of
/// its time set aside for those experts; none at first) and a room per device for its stage's
/// split experts (its host's budget at first), judge the plan by each node's actual share
/// ([`Problem::evaluate`]), and revise from it: a host short of RAM reserves what the plan's
/// other stages left there, or, when those alone overflow it, takes the overflow off the rooms
/// of the stages that left the most; a host's time reserves what they asked of it. Every plan
/// that fits is a candidate and the best is kept, until a round changes nothing. Reported as
/// not exact: a reservation larger than a plan needs can hide a better one.
pub fn reserve_heuristic(p: &Problem, policy: &Policy, obj: Objective) -> Option<Solution> {
    // energy: the slack applies to the best latency a plan that fits has, not to each round's
    // reservation (whose programs' optimum rises as reservations grow)
    let bound = match obj {
        Objective::Energy => Some(reserve_heuristic(p, policy, Objective::Latency)?.metrics.decode_s),
        _ => None,
    };
    let n = p.devs.len();
    let mut reserve = vec![(0u64, 0.0f64); n];
    let mut room: Vec<u64> = (0..n).map(|d| p.host_room(d)).collect();
    let mut best: Option<Solution> = None;
    // what to try instead when a round's reservations leave no plan: the rooms cut instead
    let mut instead: Option<Guesses> = None;
    for _ in 0..RESERVE_ROUNDS {
        let q = p.reserving(&reserve, &room);
        let round = match bound {
            Some(t) => solve_fixed(&q, policy, Objective::Latency).and_then(|l| {
                // this round's slack, so that its limit is `slack × t`
                let slack = policy.slack * t / l.metrics.decode_s;
                solve_fixed(&q, &Policy { slack, ..policy.clone() }, obj)
            }),
            None => solve_fixed(&q, policy, obj),
        };
        let Some(sol) = round else {
            match instead.take() {
                Some((r, m)) => {
                    (reserve, room) = (r, m);
                    continue;
                }
                None => break,
            }
        };
        let within = |m: &Metrics| bound.is_none_or(|t| m.decode_s <= t * policy.slack * (1.0 + 1e-12));
        if let Some(metrics) = p.evaluate(&sol.stages).filter(within) {
            let v = objective_value(obj, &metrics);
            if best.as_ref().is_none_or(|b| v < objective_value(obj, &b.metrics)) {
                best = Some(Solution {
                    stages: sol.stages.clone(),
                    metrics,
                    ctx: sol.ctx,
                    exact: false,
                    latency_bound_s: bound.or(sol.latency_bound_s),
                });
            }
        }
        let (before, mut alt_room) = (reserve.clone(), room.clone());
        let (mut changed, mut alternative) = (false, false);
        for u in p.host_usage(&sol.stages) {
            let h = u.host;
            if u.expert_s > reserve[h].1 * (1.0 + 1e-12) {
                reserve[h].1 = u.expert_s;
                changed = true;
            }
            if u.fits() {
                continue;
            }
            if u.expert_bytes <= u.budget {
                // the host's own stage makes room (or, if that leaves no plan, the others)
                if u.expert_bytes > reserve[h].0 {
                    reserve[h].0 = u.expert_bytes;
                    changed = true;
                }
                let over = (u.own_bytes + u.expert_bytes) - u.budget;
                alternative |= cut_rooms(p, &sol.stages, h, over, &mut alt_room);
            } else {
                // the other stages' experts alone overflow it: in both
                let over = u.expert_bytes - u.budget;
                changed |= cut_rooms(p, &sol.stages, h, over, &mut room);
                cut_rooms(p, &sol.stages, h, over, &mut alt_room);
            }
        }
        instead = alternative.then(|| {
            let mut r = before;
            for (r, now) in r.iter_mut().zip(&reserve) {
                r.1 = now.1;
            }
            (r, alt_room)
        });
        if !changed {
            break;
        }
    }
    best
}

/// Takes `over` bytes off the rooms of the stages of `stages` that leave the most split experts
/// on host `h` (the largest first); whether a room changed.
fn cut_rooms(p: &Problem, stages: &Stages, h: usize, mut over: u64, room: &mut [u64]) -> bool {
    let mut split: Vec<(u64, usize)> = stages
        .iter()
        .filter(|s| s.0 != h && p.host_of(s.0) == Some(h))
        .map(|&(d, a, b)| (p.host_expert_bytes(a, b), d))
        .collect();
    split.sort_by(|x, y| y.cmp(x));
    let mut changed = false;
    for (bytes, d) in split {
        if over == 0 {
            break;
        }
        let cut = bytes.min(over);
        changed |= bytes - cut < room[d];
        room[d] = room[d].min(bytes - cut);
        over -= cut;
    }
    changed
}

/// [`solve`] for a problem whose programs hold every constraint.
fn solve_fixed(p: &Problem, policy: &Policy, obj: Objective) -> Option<Solution> {
    let finish = |(stages, exact, lat): (Stages, bool, Option<f64>), exact_devices: bool| -> Option<Solution> {
        let metrics = p.evaluate(&stages)?;
        Some(Solution { stages, metrics, ctx: p.ctx, exact: exact && exact_devices, latency_bound_s: lat })
    };
    let n = p.devs.len();
    if n <= EXACT_MAX {
        let all: Vec<usize> = (0..n).collect();
        return solve_subset(p, &all, policy, obj).and_then(|r| finish(r, true));
    }
    let ranked = ranked(p);
    let cands = candidates(p, &ranked, CANDIDATES);
    let beam = dp::beam_latency(p, &cands, BEAM, BEAM_SOURCES, None);
    // exact on the devices the latency beam chose, topped up by score; for latency, the better
    // of this and the beam
    let mut subset: Vec<usize> = Vec::new();
    if let Some((_, st)) = &beam {
        subset.extend(st.iter().map(|s| s.0));
    }
    for &d in &cands {
        if subset.len() >= EXACT_MAX {
            break;
        }
        if !subset.contains(&d) {
            subset.push(d);
        }
    }
    subset.truncate(EXACT_MAX.max(beam.as_ref().map(|b| b.1.len()).unwrap_or(0)).min(dp::MAX_SUBSET));
    let refined = solve_subset(p, &subset, policy, obj).and_then(|r| finish(r, false));
    if matches!(obj, Objective::Latency | Objective::MaxContext) && policy.max_watts.is_none() {
        let from_beam = beam.map(|(_, s)| (s, true, None)).and_then(|r| finish(r, false));
        return match (from_beam, refined) {
            (Some(a), Some(b)) => Some(if b.metrics.decode_s < a.metrics.decode_s { b } else { a }),
            (a, b) => a.or(b),
        };
    }
    refined
}

/// Contexts the max-context objective tries at most when the model does not say (2^34 tokens):
/// a model whose every layer has a sliding window holds any context.
pub const MAX_CONTEXT_CAP: u64 = 1 << 34;

/// The largest context (tokens) any placement can hold, at most `cap` (the model's trained
/// context; [`MAX_CONTEXT_CAP`] when unknown), by bisection over feasibility.
pub fn max_context<'a>(
    build: &dyn Fn(u64) -> Result<Problem<'a>, PlanError>,
    policy: &Policy,
    cap: Option<u64>,
) -> Result<Option<u64>, PlanError> {
    let feasible = |ctx: u64| -> Result<bool, PlanError> {
        let p = build(ctx)?;
        Ok(solve(&p, policy, Objective::Latency).is_some())
    };
    let cap = cap.unwrap_or(MAX_CONTEXT_CAP).clamp(1, MAX_CONTEXT_CAP);
    if !feasible(1)? {
        return Ok(None);
    }
    if feasible(cap)? {
        return Ok(Some(cap));
    }
    // feasible(lo), not feasible(hi)
    let (mut lo, mut hi) = (1u64, 2u64.min(cap));
    while hi < cap && feasible(hi)? {
        lo = hi;
        hi = (hi * 2).min(cap);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if feasible(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}
