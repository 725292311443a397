//! Exact search over device chains and cut points for a subset of devices.
//!
//! The state is (devices used so far as a bit set, the last device, layers placed): a
//! Held–Karp-style dynamic program, so every order of every subset of devices is considered
//! and each device holds at most one contiguous range. Costs are additive along the chain (stage
//! times, hops, driver legs), which is what makes the program exact.
//!
//! [`min_latency`] minimises decode seconds, optionally with every stage and hop capped at `cap`
//! seconds (the throughput search). For a fixed (state, next device), the feasible previous cut
//! points for each next cut form a window that only moves forward (memory and the cap are both
//! monotone in the range), so a monotone deque gives each transition in O(L): the whole program is
//! O(2^k · k² · L).
//!
//! [`pareto`] keeps, per state, the Pareto front of (decode seconds, a second additive quantity):
//! energy for the energy objective, or the average-power slack for a watts cap. It is O(L²) per
//! transition; fronts are exact unless they outgrow [`MAX_FRONT`], when they are thinned (reported
//! as not exact).

use crate::cost::Problem;
use std::collections::VecDeque;

/// A chain: (device, first layer, end layer) in pipeline order.
pub type Stages = Vec<(usize, usize, usize)>;

const NONE: u8 = u8::MAX;
/// Largest subset the dynamic programs take (the tables have 2^k rows).
pub const MAX_SUBSET: usize = 14;
/// Front size above which [`pareto`] thins its fronts.
pub const MAX_FRONT: usize = 96;

struct Table {
    k: usize,
    l1: usize,
    val: Vec<f64>,
    back: Vec<(u8, u16)>,
}

type Storage = (Vec<f64>, Vec<(u8, u16)>);

thread_local! {
    static SPARE: std::cell::RefCell<Option<Storage>> = const { std::cell::RefCell::new(None) };
}

impl Drop for Table {
    fn drop(&mut self) {
        let storage = (std::mem::take(&mut self.val), std::mem::take(&mut self.back));
        SPARE.with(|s| *s.borrow_mut() = Some(storage));
    }
}

impl Table {
    /// A table of infinities, in the storage the thread's previous table left (the throughput
    /// search builds a few dozen 3 MB tables per plan; fresh ones cost a page fault per 4 KiB).
    fn new(k: usize, l: usize) -> Self {
        let n = (1usize << k) * k * (l + 1);
        let (mut val, mut back) = SPARE.with(|s| s.borrow_mut().take()).unwrap_or_default();
        val.clear();
        val.resize(n, f64::INFINITY);
        back.clear();
        back.resize(n, (NONE, 0));
        Table { k, l1: l + 1, val, back }
    }
    #[inline]
    fn idx(&self, mask: usize, last: usize, l: usize) -> usize {
        (mask * self.k + last) * self.l1 + l
    }
    #[inline]
    fn relax(&mut self, mask: usize, last: usize, l: usize, v: f64, back: (u8, u16)) {
        let i = self.idx(mask, last, l);
        if v < self.val[i] {
            self.val[i] = v;
            self.back[i] = back;
        }
    }
}

/// Minimum decode seconds over all chains of devices from `subset` (indices into `p.devs`), each
/// stage and hop at most `cap` seconds if given. Returns the seconds and the stages.
pub fn min_latency(p: &Problem, subset: &[usize], cap: Option<f64>) -> Option<(f64, Stages)> {
    min_latency_within(p, subset, cap, f64::INFINITY)
}

/// [`min_latency`] among the chains whose decode seconds are at most `limit` (`None` if there
/// is none). Partial chains over the limit are dropped as they appear: every later stage, hop
/// and leg only adds time. The throughput search asks only whether a chain within `S × cap`
/// exists, and this pruning is what keeps its many probes cheap.
pub fn min_latency_within(p: &Problem, subset: &[usize], cap: Option<f64>, limit: f64) -> Option<(f64, Stages)> {
    let k = subset.len();
    assert!(k <= MAX_SUBSET, "subset of {k} devices");
    let l = p.n_layers;
    let cap = cap.unwrap_or(f64::INFINITY);
    if p.host_floor() > cap {
        return None;
    }
    let mut t = Table::new(k, l);
    // bmax[i][a]: the last end b < L that device subset[i] can take from a >= 1
    let bmax: Vec<Vec<usize>> = subset
        .iter()
        .map(|&d| {
            let mut out = vec![0usize; l];
            let mut b = 1;
            for (a, slot) in out.iter_mut().enumerate().skip(1) {
                b = b.max(a);
                while b + 1 < l && p.fits(d, a, b + 1) && p.stage_load(d, a, b + 1) <= cap {
                    b += 1;
                }
                *slot = b;
            }
            out
        })
        .collect();
    for (i, &d) in subset.iter().enumerate() {
        let Some(din) = p.drv_in[d] else { continue };
        for b in 1..=l {
            if !p.fits(d, 0, b) {
                break; // memory only grows with b (the head included)
            }
            let st = p.stage_time(d, 0, b);
            if p.stage_load(d, 0, b) <= cap && din + st <= limit {
                t.relax(1 << i, i, b, din + st, (NONE, 0));
            }
        }
    }
    let mut deque: VecDeque<(usize, f64)> = VecDeque::with_capacity(l);
    for mask in 1..(1usize << k) {
        for i in 0..k {
            if mask & (1 << i) == 0 {
                continue;
            }
            let row = t.idx(mask, i, 0);
            if t.val[row + 1..row + l].iter().all(|v| v.is_infinite()) {
                continue;
            }
            let di = subset[i];
            for (j, &dj) in subset.iter().enumerate() {
                if mask & (1 << j) != 0 {
                    continue;
                }
                let Some(hop) = p.hop[di][dj] else { continue };
                if hop > cap {
                    continue;
                }
                let nmask = mask | (1 << j);
                let pj = &p.layer_t[dj];
                // b < L: sliding-window minimum of val[a] + hop - P_j[a] over a in [amin(b), b)
                deque.clear();
                for b in 2..l {
                    let a = b - 1;
                    let v = t.val[row + a];
                    if v.is_finite() {
                        let key = v + hop - pj[a];
                        while deque.back().is_some_and(|&(_, kb)| kb >= key) {
                            deque.pop_back();
                        }
                        deque.push_back((a, key));
                    }
                    while deque.front().is_some_and(|&(fa, _)| bmax[j][fa] < b) {
                        deque.pop_front();
                    }
                    if let Some(&(fa, key)) = deque.front() {
                        if pj[b] + key <= limit {
                            t.relax(nmask, j, b, pj[b] + key, (i as u8, fa as u16));
                        }
                    }
                }
                // b = L: the head's memory and time break the window; scan
                for a in 1..l {
                    let v = t.val[row + a];
                    if v.is_finite() && p.fits(dj, a, l) {
                        let st = p.stage_time(dj, a, l);
                        if p.stage_load(dj, a, l) <= cap && v + hop + st <= limit {
                            t.relax(nmask, j, l, v + hop + st, (i as u8, a as u16));
                        }
                    }
                }
            }
        }
    }
    let mut best: Option<(f64, usize, usize)> = None;
    for mask in 1..(1usize << k) {
        for (i, &d) in subset.iter().enumerate() {
            let v = t.val[t.idx(mask, i, l)];
            let Some(out) = p.drv_out[d] else { continue };
            if v.is_finite() && v + out <= limit && best.is_none_or(|(bv, _, _)| v + out < bv) {
                best = Some((v + out, mask, i));
            }
        }
    }
    let (total, mask, i) = best?;
    let stages = walk_back(subset, (mask, i, l, 0), |mask, i, b, _| {
        let (prev, a) = t.back[t.idx(mask, i, b)];
        (prev, a, 0)
    });
    Some((total, stages))
}

/// The stages of a chain, from its cell `(mask, last device, end, index in the cell)` back to
/// its first stage; `back` gives a cell's (previous device or [`NONE`], previous end, index
/// in the previous cell).
fn walk_back(
    subset: &[usize],
    (mut mask, mut i, mut b, mut q): (usize, usize, usize, usize),
    back: impl Fn(usize, usize, usize, usize) -> (u8, u16, u32),
) -> Stages {
    let mut stages = Vec::new();
    loop {
        let (prev, a, pq) = back(mask, i, b, q);
        let a = if prev == NONE { 0 } else { a as usize };
        stages.push((subset[i], a, b));
        if prev == NONE {
            break;
        }
        mask &= !(1 << i);
        i = prev as usize;
        b = a;
        q = pq as usize;
    }
    stages.reverse();
    stages
}

/// What [`pareto`] adds up besides decode seconds: `coef[d]` per second of a stage on device
/// `d`, and `hop_coef` per second of hops and driver legs.
pub struct Second<'a> {
    /// Per device of the problem (by index), the quantity per second of a stage on it.
    pub coef: &'a [f64],
    /// The quantity per second of hops and driver legs.
    pub hop_coef: f64,
}

#[derive(Clone)]
struct Point {
    t: f64,
    z: f64,
    /// (previous device index in subset, previous end, index in that cell's front)
    back: (u8, u16, u32),
}

/// The Pareto front of (decode seconds, second quantity) over complete chains of `subset`, each
/// point with its stages. `exact` is false if a front had to be thinned.
pub fn pareto(p: &Problem, subset: &[usize], second: &Second) -> (Vec<(f64, f64, Stages)>, bool) {
    let k = subset.len();
    assert!(k <= MAX_SUBSET, "subset of {k} devices");
    let l = p.n_layers;
    let l1 = l + 1;
    let mut cells: Vec<Vec<Point>> = vec![Vec::new(); (1usize << k) * k * l1];
    let idx = |mask: usize, i: usize, b: usize| (mask * k + i) * l1 + b;
    let mut exact = true;
    for (i, &d) in subset.iter().enumerate() {
        let Some(din) = p.drv_in[d] else { continue };
        for b in 1..=l {
            if !p.fits(d, 0, b) {
                break;
            }
            let st = p.stage_time(d, 0, b);
            cells[idx(1 << i, i, b)].push(Point {
                t: din + st,
                z: second.hop_coef * din + p.stage_amount(|i| second.coef[i], d, 0, b),
                back: (NONE, 0, 0),
            });
        }
    }
    for mask in 1..(1usize << k) {
        for i in 0..k {
            if mask & (1 << i) == 0 {
                continue;
            }
            // finalize every cell of this (mask, i) before extending from it
            for b in 1..=l {
                let c = &mut cells[idx(mask, i, b)];
                exact &= prune(c);
            }
            let di = subset[i];
            for (j, &dj) in subset.iter().enumerate() {
                if mask & (1 << j) != 0 {
                    continue;
                }
                let Some(hop) = p.hop[di][dj] else { continue };
                let nmask = mask | (1 << j);
                for a in 1..l {
                    if cells[idx(mask, i, a)].is_empty() {
                        continue;
                    }
                    for b in a + 1..=l {
                        if !p.fits(dj, a, b) {
                            break; // memory only grows with b (the head included)
                        }
                        let st = p.stage_time(dj, a, b);
                        let add_t = hop + st;
                        let add_z = second.hop_coef * hop + p.stage_amount(|i| second.coef[i], dj, a, b);
                        let src = idx(mask, i, a);
                        let dst = idx(nmask, j, b);
                        let n = cells[src].len();
                        for q in 0..n {
                            let pt = &cells[src][q];
                            let np = Point { t: pt.t + add_t, z: pt.z + add_z, back: (i as u8, a as u16, q as u32) };
                            cells[dst].push(np);
                        }
                    }
                }
            }
        }
    }
    // complete chains: end at L, add the driver's return leg; keep them with their origin
    let mut ends: Vec<(f64, f64, usize, usize, usize)> = Vec::new();
    for mask in 1..(1usize << k) {
        for (i, &d) in subset.iter().enumerate() {
            let Some(out) = p.drv_out[d] else { continue };
            let c = &cells[idx(mask, i, l)];
            for (q, pt) in c.iter().enumerate() {
                ends.push((pt.t + out, pt.z + second.hop_coef * out, mask, i, q));
            }
        }
    }
    ends.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut front = Vec::new();
    let mut best_z = f64::INFINITY;
    for (t, z, mask, i, q) in ends {
        if z < best_z {
            best_z = z;
            front.push((t, z, walk_back(subset, (mask, i, l, q), |mask, i, b, q| cells[idx(mask, i, b)][q].back)));
        }
    }
    (front, exact)
}

/// Reduces a cell to its Pareto front (sorted by time, strictly falling second quantity), thinned
/// to [`MAX_FRONT`] points if larger. Returns false if it thinned.
fn prune(c: &mut Vec<Point>) -> bool {
    if c.len() <= 1 {
        return true;
    }
    c.sort_by(|a, b| a.t.total_cmp(&b.t).then(a.z.total_cmp(&b.z)));
    let mut out: Vec<Point> = Vec::with_capacity(c.len());
    for pt in c.drain(..) {
        if out.last().is_none_or(|last| pt.z < last.z) {
            out.push(pt);
        }
    }
    let exact = out.len() <= MAX_FRONT;
    if !exact {
        // keep the extremes and evenly spaced points between them
        let n = out.len();
        let keep: Vec<Point> = (0..MAX_FRONT).map(|s| out[s * (n - 1) / (MAX_FRONT - 1)].clone()).collect();
        out = keep;
    }
    *c = out;
    exact
}

/// Device sets as bits (the beam search takes at most 128 candidate devices).
type Mask = u128;

#[derive(Clone, Copy)]
struct BeamEntry {
    val: f64,
    mask: Mask,
    /// (previous device index in `cands`, previous end, entry index there); `u16::MAX` = start
    back: (u16, u16, u16),
}

/// A beam-limited version of [`min_latency`] for clusters too large for 2^k states: per (last
/// device, layers placed) it keeps only the `width` best partial chains with distinct device sets,
/// and extends only the `sources` best of them that have not used the next device. Exact when
/// `width` and `sources` exceed the number of device sets a cell can see; otherwise a heuristic.
pub fn beam_latency(
    p: &Problem,
    cands: &[usize],
    width: usize,
    sources: usize,
    cap: Option<f64>,
) -> Option<(f64, Stages)> {
    let k = cands.len();
    assert!(k <= 128, "beam over {k} devices");
    let l = p.n_layers;
    let cap = cap.unwrap_or(f64::INFINITY);
    if p.host_floor() > cap {
        return None;
    }
    let mut cells: Vec<Vec<BeamEntry>> = vec![Vec::new(); k * (l + 1)];
    let at = |i: usize, b: usize| i * (l + 1) + b;
    let insert = |cell: &mut Vec<BeamEntry>, e: BeamEntry| {
        if let Some(pos) = cell.iter().position(|x| x.mask == e.mask) {
            if e.val < cell[pos].val {
                cell[pos] = e;
            }
            return;
        }
        if cell.len() < width {
            cell.push(e);
        } else if let Some((worst, _)) = cell.iter().enumerate().max_by(|a, b| a.1.val.total_cmp(&b.1.val)) {
            if e.val < cell[worst].val {
                cell[worst] = e;
            }
        }
    };
    for (i, &d) in cands.iter().enumerate() {
        let Some(din) = p.drv_in[d] else { continue };
        for b in 1..=l {
            if !p.fits(d, 0, b) {
                break;
            }
            let st = p.stage_time(d, 0, b);
            if p.stage_load(d, 0, b) <= cap {
                insert(&mut cells[at(i, b)], BeamEntry { val: din + st, mask: 1 << i, back: (u16::MAX, 0, 0) });
            }
        }
    }
    for a in 1..l {
        for i in 0..k {
            let c = at(i, a);
            if cells[c].is_empty() {
                continue;
            }
            cells[c].sort_by(|x, y| x.val.total_cmp(&y.val));
            let di = cands[i];
            for (j, &dj) in cands.iter().enumerate() {
                let Some(hop) = p.hop[di][dj] else { continue };
                if hop > cap {
                    continue;
                }
                // the best partial chains here that have not used device j yet
                let srcs: Vec<(usize, BeamEntry)> = cells[c]
                    .iter()
                    .copied()
                    .enumerate()
                    .filter(|(_, e)| e.mask & (1 << j) == 0)
                    .take(sources)
                    .collect();
                for (q, src) in srcs {
                    for b in a + 1..=l {
                        if !p.fits(dj, a, b) {
                            break;
                        }
                        let st = p.stage_time(dj, a, b);
                        if p.stage_load(dj, a, b) > cap {
                            if b < l {
                                break;
                            }
                            continue;
                        }
                        let e = BeamEntry {
                            val: src.val + hop + st,
                            mask: src.mask | (1 << j),
                            back: (i as u16, a as u16, q as u16),
                        };
                        insert(&mut cells[at(j, b)], e);
                    }
                }
            }
        }
    }
    let mut best: Option<(f64, usize, usize)> = None;
    for (i, &d) in cands.iter().enumerate() {
        let Some(out) = p.drv_out[d] else { continue };
        for (q, e) in cells[at(i, l)].iter().enumerate() {
            if best.is_none_or(|(v, _, _)| e.val + out < v) {
                best = Some((e.val + out, i, q));
            }
        }
    }
    let (total, mut i, mut q) = best?;
    let mut b = l;
    let mut stages = Vec::new();
    loop {
        let e = cells[at(i, b)][q];
        let (pi, pa, pq) = e.back;
        if pi == u16::MAX {
            stages.push((cands[i], 0, b));
            break;
        }
        stages.push((cands[i], pa as usize, b));
        i = pi as usize;
        b = pa as usize;
        q = pq as usize;
    }
    stages.reverse();
    Some((total, stages))
}
