//! The exact program for split layers across nodes (up to [`crate::search::EXACT_MAX`] devices).
//!
//! Across nodes a node's CPU holds its own stage and the routed experts of its other devices'
//! split layers: a share that depends on which layers land on which of the node's devices, so
//! the one-number cells of [`crate::dp`] cannot hold it. Here a cell (devices used, last device,
//! layers placed) holds labels instead: the partial chain's seconds, and per host CPU the bytes
//! it holds so far (its own stage and its node's split experts) and, for throughput, the
//! seconds it computes; plus the objective's second quantity (energy, or the slack under a
//! watts cap) and the slowest stage or hop so far. A label is dropped when another in its cell
//! is no worse in every one of these (dominance), so the labels left cover every chain that can
//! still win: the program is exact. A host's numbers stop mattering once nothing more can land
//! on it (its own stage placed, or never to be, and its node's splitting devices used or past
//! the split layers); they are then folded away, which is what keeps the cells small.
//!
//! A plan the caller already has (the reservation heuristic's) bounds the search: a partial
//! chain that, with a lower bound on the seconds still to come (each layer left on the fastest
//! unused device for it), is already slower, or (throughput) has a stage slower than that plan's
//! bottleneck allows, cannot beat it. The program gives up past its [`Budget`] ([`TooLarge`]); the caller then
//! keeps the heuristic's plan.

use crate::cost::{Metrics, Problem};
use crate::dp::Stages;
use crate::{Objective, Policy};

/// Labels the program may create before it gives up (40 bytes each and 16 per host: with four
/// hosts 100 MB, twice that while the vectors grow).
pub const MAX_LABELS: usize = 1_000_000;

/// Comparisons of a candidate with a cell's labels the program may make before it gives up
/// (a second or so here).
pub const MAX_COMPARED: usize = 300_000_000;

/// Largest `2^n · n² · (L + 1)²` (`n` devices, `L` layers: the transitions the program may
/// visit) it takes on: two GPU boxes with a 94-layer model (2.3 M) plan in 5–70 ms per split
/// here, three (20 M) in about a second, too slow to search every split
/// (`cargo bench -p brigade-planner`). Larger problems keep the reservation heuristic's plan.
pub const MAX_WORK: usize = 4_000_000;

/// Whether [`solve`] takes on `p` ([`MAX_WORK`]).
pub fn within_reach(p: &Problem) -> bool {
    within_reach_of(p.devs.len(), p.n_layers)
}

/// Whether [`solve`] takes on a problem of `n` devices and `layers` layers ([`MAX_WORK`]).
pub fn within_reach_of(n: usize, layers: usize) -> bool {
    let l1 = layers.saturating_add(1);
    n <= crate::search::EXACT_MAX
        && (1usize << n).saturating_mul(n * n).saturating_mul(l1.saturating_mul(l1)) <= MAX_WORK
}

/// How much the program may do before it gives up ([`TooLarge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Labels created.
    pub labels: usize,
    /// Comparisons of a candidate with a cell's labels.
    pub compared: usize,
}

impl Budget {
    /// [`MAX_LABELS`] and [`MAX_COMPARED`].
    pub const DEFAULT: Budget = Budget { labels: MAX_LABELS, compared: MAX_COMPARED };
}

/// The program would need more than its [`Budget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge;

/// What a stage adds: seconds, the second quantity, its seconds as a non-host stage for the
/// slowest-stage number, and (host, bytes, seconds) of its host's share.
type Added = (f64, f64, f64, Option<(usize, u64, f64)>);

/// What a device's stage adds to its host's share.
#[derive(Clone, Copy)]
enum Role {
    /// Neither holds split experts nor is a host.
    Plain,
    /// A host CPU (index into the hosts): its own stage's bytes and seconds.
    Own(usize),
    /// A device whose split layers' experts its host (index) holds and computes.
    Split(usize),
}

/// A partial chain. Its hosts' numbers are in [`Labels::bytes`] / [`Labels::secs`] at
/// `index × hosts`.
#[derive(Clone, Copy)]
struct Label {
    /// Decode seconds so far (the driver's leg in included).
    t: f64,
    /// The second quantity: joules, or the watts cap's slack (0 for the other objectives).
    x: f64,
    /// Throughput: the slowest stage (not a host's) or hop so far, and hosts that are done.
    m: f64,
    /// The label this one extends (`u32::MAX`: none).
    prev: u32,
    /// Its last stage: device (index into `p.devs`), first layer, end layer.
    stage: (u8, u16, u16),
}

struct Labels {
    budget: Budget,
    /// Labels compared with a candidate so far (the program's work).
    compared: usize,
    all: Vec<Label>,
    bytes: Vec<u64>,
    secs: Vec<f64>,
    hosts: usize,
}

impl Labels {
    fn push(&mut self, l: Label, bytes: &[u64], secs: &[f64]) -> Result<u32, TooLarge> {
        if self.all.len() >= self.budget.labels || self.compared > self.budget.compared {
            return Err(TooLarge);
        }
        self.all.push(l);
        self.bytes.extend_from_slice(bytes);
        self.secs.extend_from_slice(secs);
        Ok((self.all.len() - 1) as u32)
    }

    fn bytes(&self, i: u32) -> &[u64] {
        &self.bytes[i as usize * self.hosts..(i as usize + 1) * self.hosts]
    }

    fn secs(&self, i: u32) -> &[f64] {
        &self.secs[i as usize * self.hosts..(i as usize + 1) * self.hosts]
    }

    /// Label `i`'s numbers.
    fn numbers(&self, i: u32) -> Numbers<'_> {
        let l = &self.all[i as usize];
        Numbers { t: l.t, x: l.x, m: l.m, bytes: self.bytes(i), secs: self.secs(i) }
    }
}

/// What dominance compares: a label's numbers, or a candidate's.
struct Numbers<'a> {
    t: f64,
    x: f64,
    m: f64,
    bytes: &'a [u64],
    secs: &'a [f64],
}

impl Numbers<'_> {
    /// Whether these are no worse than `o`'s in every number.
    fn no_worse(&self, o: &Numbers) -> bool {
        self.t <= o.t
            && self.x <= o.x
            && self.m <= o.m
            && self.bytes.iter().zip(o.bytes).all(|(a, b)| a <= b)
            && self.secs.iter().zip(o.secs).all(|(a, b)| a <= b)
    }
}

/// What the objective asks of the labels.
#[derive(Clone, Copy)]
struct Goal {
    /// Per-second weight of each device for `x` (watts, or watts minus the cap), and of hops and
    /// driver legs; `None`: no second quantity.
    second: Option<f64>,
    /// Whether the throughput numbers (slowest stage, hosts' seconds) are kept.
    loads: bool,
    /// Partial chains slower than this cannot win.
    t_max: f64,
    /// Throughput: a stage, hop or host busier than this cannot win.
    load_max: f64,
}

/// The best chain for `obj` over every device of `p` (split layers across nodes: `p` is not a
/// [`Problem::reserving`] one), with, for energy, the best latency the slack applied to; `None`
/// when no chain fits. `known`: the metrics of a plan that fits, which bound the search (for
/// energy the fastest plan known, whose latency bounds the slack's); `allowed`: how much it may
/// do.
pub fn solve(
    p: &Problem,
    policy: &Policy,
    obj: Objective,
    known: Option<&Metrics>,
    allowed: Budget,
) -> Result<Option<(Stages, Option<f64>)>, TooLarge> {
    let n = p.devs.len();
    let l = p.n_layers;
    // (device and layer indices are kept as u8 and u16)
    if !within_reach(p) || l > u16::MAX as usize {
        return Err(TooLarge);
    }
    let slack = policy.slack * (1.0 + 1e-12);
    let margin = 1.0 + 1e-9;
    let coef = |cap: f64| -> Vec<f64> { p.devs.iter().map(|d| d.watts.unwrap_or(0.0) - cap).collect() };
    let (goal, weights) = match (obj, policy.max_watts) {
        (Objective::Latency | Objective::MaxContext, None) => {
            let t_max = known.map_or(f64::INFINITY, |m| m.decode_s * margin);
            (Goal { second: None, loads: false, t_max, load_max: f64::INFINITY }, coef(0.0))
        }
        (Objective::Latency | Objective::MaxContext, Some(cap)) => {
            let t_max = known.map_or(f64::INFINITY, |m| m.decode_s * margin);
            (Goal { second: Some(-cap), loads: false, t_max, load_max: f64::INFINITY }, coef(cap))
        }
        (Objective::Throughput, _) => {
            // a better plan has S / T and 1 / bottleneck both above the known throughput
            let (t_max, load_max) = match known {
                Some(m) if m.throughput > 0.0 => (p.sessions as f64 / m.throughput * margin, margin / m.throughput),
                _ => (f64::INFINITY, f64::INFINITY),
            };
            (Goal { second: None, loads: true, t_max, load_max }, coef(0.0))
        }
        (Objective::Energy, _) => {
            let t_max = known.map_or(f64::INFINITY, |m| m.decode_s * slack * margin);
            (Goal { second: Some(0.0), loads: false, t_max, load_max: f64::INFINITY }, coef(0.0))
        }
    };
    let hosts: Vec<usize> = (0..n).filter(|&d| p.host_of(d) == Some(d)).collect();
    let hi = |h: usize| hosts.iter().position(|&x| x == h);
    let role: Vec<Role> = (0..n)
        .map(|d| match p.host_of(d) {
            Some(h) if h == d => hi(h).map_or(Role::Plain, Role::Own),
            Some(h) if p.splits_on(d) => hi(h).map_or(Role::Plain, Role::Split),
            _ => Role::Plain,
        })
        .collect();
    let budget: Vec<u64> = hosts.iter().map(|&h| p.host_budget(h)).collect();
    let nh = hosts.len();
    // live[(mask, a)][h]: whether host h's share can still grow in a cell with devices `mask`
    // used and `a` layers placed: its own stage is still to come, or a splitting device of its
    // node is unused while layers below the split remain
    let live = |mask: usize, a: usize, h: usize| -> bool {
        (a < l && mask & (1 << hosts[h]) == 0)
            || (a < p.cpu_moe && (0..n).any(|d| mask & (1 << d) == 0 && matches!(role[d], Role::Split(x) if x == h)))
    };
    let l1 = l + 1;
    let idx = |mask: usize, i: usize, b: usize| (mask * n + i) * l1 + b;
    let mut cells: Vec<Vec<u32>> = vec![Vec::new(); (1usize << n) * n * l1];
    let mut labels =
        Labels { budget: allowed, compared: 0, all: Vec::new(), bytes: Vec::new(), secs: Vec::new(), hosts: nh };
    let (mut nb, mut ns) = (vec![0u64; nh], vec![0f64; nh]);

    // what stage (d, a, b) adds: seconds, second quantity, its own time for `m` (not a host's),
    // and its host's bytes and seconds; None when it cannot fit whatever came before
    let stage = |d: usize, a: usize, b: usize| -> Option<Added> {
        let st = p.stage_time(d, a, b);
        let x = p.stage_amount(|i| weights[i], d, a, b);
        match role[d] {
            Role::Plain => p.fits_device(d, a, b).then_some((st, x, st, None)),
            Role::Split(h) => {
                let e = p.host_expert_bytes(a, b);
                (p.fits_device(d, a, b) && e <= budget[h])
                    .then(|| (st, x, st, Some((h, e, p.stage_host_time(d, a, b)))))
            }
            Role::Own(h) => {
                let own = p.stage_mem_on(d, a, b).total();
                (own <= budget[h]).then_some((st, x, 0.0, Some((h, own, st))))
            }
        }
    };
    // every stage once (the program asks for each 2^(n-1)·n times): per device and first layer,
    // the stages that fit, by end layer (memory only grows with the end)
    let stages: Vec<Vec<Vec<Added>>> =
        (0..n).map(|d| (0..l).map(|a| (a + 1..=l).map_while(|b| stage(d, a, b)).collect()).collect()).collect();
    // how much more each host may still be asked to hold from layer b on, at most: its own
    // stage over all of them (whose bytes cover the split experts of any of them too)
    let rest: Vec<Vec<u64>> = hosts
        .iter()
        .map(|&h| (0..=l).map(|b| if b < l { p.stage_mem_on(h, b, l).total() } else { 0 }).collect())
        .collect();

    // at least how many seconds a chain still takes after a cell with devices `mask` used and
    // `b` layers placed: each layer left on the fastest unused device for it, the head on the
    // fastest, the driver's return leg from the nearest (at L: the last device's own leg)
    let ahead: Vec<Vec<f64>> = (0..1usize << n)
        .map(|mask| {
            let free: Vec<usize> = (0..n).filter(|d| mask & (1 << d) == 0).collect();
            let least = |f: &dyn Fn(usize) -> f64| free.iter().map(|&d| f(d)).fold(f64::INFINITY, f64::min);
            let tail = least(&|d| p.head_t[d]) + least(&|d| p.drv_out[d].unwrap_or(f64::INFINITY));
            let mut v = vec![0.0; l + 1];
            let mut sum = 0.0;
            for b in (0..l).rev() {
                sum += least(&|d| p.layer_t[d][b + 1] - p.layer_t[d][b]);
                v[b] = sum + tail;
            }
            v
        })
        .collect();
    let ahead = |mask: usize, last: usize, b: usize| -> f64 {
        if b == l {
            p.drv_out[last].unwrap_or(f64::INFINITY)
        } else {
            ahead[mask][b]
        }
    };

    // one candidate into a cell: kept unless a label there dominates it; drops those it dominates
    fn offer(labels: &mut Labels, cell: &mut Vec<u32>, l: Label, bytes: &[u64], secs: &[f64]) -> Result<(), TooLarge> {
        labels.compared += cell.len();
        let c = Numbers { t: l.t, x: l.x, m: l.m, bytes, secs };
        if cell.iter().any(|&q| labels.numbers(q).no_worse(&c)) {
            return Ok(());
        }
        cell.retain(|&q| !c.no_worse(&labels.numbers(q)));
        let i = labels.push(l, bytes, secs)?;
        cell.push(i);
        Ok(())
    }

    // folds away the hosts that can no longer grow in cell (mask, b); false if over a bound
    let settle = |mask: usize, b: usize, m: &mut f64, bytes: &mut [u64], secs: &mut [f64]| -> bool {
        for h in 0..nh {
            if !live(mask, b, h) {
                bytes[h] = 0;
                *m = m.max(secs[h]);
                secs[h] = 0.0;
            } else if bytes[h].saturating_add(rest[h][b]) <= budget[h] {
                // whatever comes, it fits: its bytes can no longer tell labels apart
                bytes[h] = 0;
            }
        }
        *m <= goal.load_max && secs.iter().all(|&s| s <= goal.load_max)
    };

    for d in 0..n {
        let Some(din) = p.drv_in[d] else { continue };
        for (b, &(st, x, own_m, share)) in (1..=l).zip(&stages[d][0]) {
            let t = din + st;
            if t + ahead(1 << d, d, b) > goal.t_max {
                continue;
            }
            nb.fill(0);
            ns.fill(0.0);
            if let Some((h, by, s)) = share {
                nb[h] = by;
                ns[h] = if goal.loads { s } else { 0.0 };
            }
            let mut m = if goal.loads { own_m } else { 0.0 };
            if !settle(1 << d, b, &mut m, &mut nb, &mut ns) {
                continue;
            }
            let x = goal.second.map_or(0.0, |hc| x + hc * din);
            let lab = Label { t, x, m, prev: u32::MAX, stage: (d as u8, 0, b as u16) };
            offer(&mut labels, &mut cells[idx(1 << d, d, b)], lab, &nb, &ns)?;
        }
    }
    for mask in 1..(1usize << n) {
        for i in (0..n).filter(|i| mask & (1 << i) != 0) {
            for a in 1..l {
                let src = std::mem::take(&mut cells[idx(mask, i, a)]);
                if src.is_empty() {
                    continue;
                }
                for j in (0..n).filter(|j| mask & (1 << j) == 0) {
                    let Some(hop) = p.hop[i][j] else { continue };
                    if goal.loads && hop > goal.load_max {
                        continue;
                    }
                    let nmask = mask | (1 << j);
                    for (b, &(st, x, own_m, share)) in (a + 1..=l).zip(&stages[j][a]) {
                        let mut dst = std::mem::take(&mut cells[idx(nmask, j, b)]);
                        for &q in &src {
                            let from = labels.all[q as usize];
                            let t = from.t + hop + st;
                            if t + ahead(nmask, j, b) > goal.t_max {
                                continue;
                            }
                            nb.copy_from_slice(labels.bytes(q));
                            ns.copy_from_slice(labels.secs(q));
                            if let Some((h, by, s)) = share {
                                nb[h] = nb[h].saturating_add(by);
                                if nb[h] > budget[h] {
                                    continue;
                                }
                                if goal.loads {
                                    ns[h] += s;
                                }
                            }
                            let mut m = if goal.loads { from.m.max(hop).max(own_m) } else { 0.0 };
                            if !settle(nmask, b, &mut m, &mut nb, &mut ns) {
                                continue;
                            }
                            let x = goal.second.map_or(0.0, |hc| from.x + x + hc * hop);
                            let lab = Label { t, x, m, prev: q, stage: (j as u8, a as u16, b as u16) };
                            offer(&mut labels, &mut dst, lab, &nb, &ns)?;
                        }
                        cells[idx(nmask, j, b)] = dst;
                    }
                }
                cells[idx(mask, i, a)] = src;
            }
        }
    }

    // complete chains: at L, with the driver's return leg
    let mut ends: Vec<(f64, f64, f64, u32)> = Vec::new();
    for mask in 1..(1usize << n) {
        for d in (0..n).filter(|d| mask & (1 << d) != 0) {
            let Some(out) = p.drv_out[d] else { continue };
            for &q in &cells[idx(mask, d, l)] {
                let lab = labels.all[q as usize];
                let bottleneck = labels.secs(q).iter().fold(lab.m, |a, &b| a.max(b));
                ends.push((lab.t + out, goal.second.map_or(0.0, |hc| lab.x + hc * out), bottleneck, q));
            }
        }
    }
    let t_lat = ends.iter().map(|e| e.0).min_by(f64::total_cmp);
    let best = match (obj, policy.max_watts) {
        (Objective::Latency | Objective::MaxContext, None) => ends.iter().min_by(|a, b| a.0.total_cmp(&b.0)),
        (Objective::Latency | Objective::MaxContext, Some(_)) => {
            ends.iter().filter(|e| e.1 <= 1e-12).min_by(|a, b| a.0.total_cmp(&b.0))
        }
        (Objective::Throughput, _) => {
            let s = p.sessions as f64;
            let thr = |e: &(f64, f64, f64, u32)| (s / e.0).min(1.0 / e.2);
            ends.iter().max_by(|a, b| thr(a).total_cmp(&thr(b)))
        }
        (Objective::Energy, _) => {
            let limit = t_lat.unwrap_or(f64::INFINITY) * slack;
            ends.iter().filter(|e| e.0 <= limit).min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.total_cmp(&b.0)))
        }
    };
    let Some(&(_, _, _, mut q)) = best else { return Ok(None) };
    let mut stages: Stages = Vec::new();
    while q != u32::MAX {
        let lab = labels.all[q as usize];
        stages.push((lab.stage.0 as usize, lab.stage.1 as usize, lab.stage.2 as usize));
        q = lab.prev;
    }
    stages.reverse();
    Ok(Some((stages, (obj == Objective::Energy).then_some(t_lat).flatten())))
}
