//! The cost model, in one place: every number the planner optimises and reports comes from here
//! (the brute-force oracle in the tests evaluates plans with the same functions).
//!
//! A stage is one device holding layers `[a, b)`. Per decoded token:
//! - compute: `Σ_l max(w_l / mem_bandwidth, f_l / flops)`, plus the head on the last stage;
//! - a hop between stages carries `hidden × 4` bytes: another node → `latency + bytes /
//!   bandwidth` of the link; the same node → the CUDA device's host link (both for cuda→cuda);
//! - the driver sends token ids to the first stage and receives the sampled id from the last:
//!   the link's latency (0 on the same node);
//! - decode latency `T = Σ stages + Σ hops + driver legs`; throughput with `S` sessions
//!   `min(S / T, 1 / max(max stage, max hop))`;
//! - prefill of `P` tokens: `P × f_l` compute (weights read once), `P × act` on hops, the head
//!   once (only the last position's logits are computed);
//! - memory: `Σ w_l + kv × Σ_l positions_l(ctx) × sessions` (plus the embedding on the first
//!   stage and the head on the last; a tied head shares the embedding's copy) `≤ (1 − headroom)
//!   × memory`, with `kv` of the device's kind (a CPU may keep its cache in f32 where GPUs keep
//!   bf16) and `positions_l` the context, or a sliding-window layer's window plus one pass.
//!
//! **Split layers** (a mixture of experts, llama.cpp's `--n-cpu-moe N`): the routed experts of
//! layers `[0, N)` live in the RAM of the node that holds the layer and run on its CPU (the
//! layer's *host*), the rest of those layers on whichever device holds them. A split layer on a
//! GPU costs its dense part there, its experts on the host (`max(e_l × share / cpu_bw, f_e /
//! cpu_flops)`, `share` the expected part of the experts the pass reads:
//! [`ModelProfile::expert_read_bytes`]) and the rows to the host and back (`2 × host_link(act)`).
//! Memory: a node's CPU holds its own stage plus the experts of its GPUs' split layers. On one
//! node every layer is on that node, so the CPU's budget is reduced by all of `[0, N)`'s experts
//! and every stage holds its layers less those: exact, whatever the assignment. Across nodes a
//! node's share depends on which layers land there, which the programs cannot follow; there the
//! search reserves each host's share from the plans it finds and tries again until a plan fits
//! ([`crate::search::solve`], reported as not exact), and [`Problem::evaluate`] checks every
//! node's RAM exactly. Energy counts a split stage's expert seconds at the host's watts, the rest
//! at its device's; for throughput a host is busy with its own stage and its split layers'
//! experts (`Problem::stage_load`).

use crate::{PlanError, Policy};
use brigade_core::{DeviceKind, Inventory, Link, ModelProfile};
use std::collections::HashMap;

/// A device of the problem, flattened out of its node.
#[derive(Debug, Clone)]
pub struct Dev {
    /// The index of its node in the inventory's `nodes`.
    pub node: usize,
    /// Its node's name.
    pub node_name: String,
    /// Its name within the node (`cpu`, `cuda0`, …).
    pub name: String,
    /// CPU or CUDA: picks the KV cache's type and whether the host link applies.
    pub kind: DeviceKind,
    /// Bytes of memory the inventory gives it.
    pub memory: u64,
    /// Bytes a plan may use on it: `(1 − headroom) × memory`, less the policy's reservations.
    pub budget: u64,
    /// Memory read bandwidth, bytes/s.
    pub bw: f64,
    /// Compute rate, flop/s.
    pub flops: f64,
    /// Power drawn while computing, watts, if known.
    pub watts: Option<f64>,
    /// The path to its node's CPU (PCIe); CUDA devices only.
    pub host_link: Option<Link>,
}

impl Dev {
    /// `node/device`, as plans and errors name a device.
    pub fn label(&self) -> String {
        format!("{}/{}", self.node_name, self.name)
    }
}

/// A model on an inventory under a policy, with everything precomputed that the search reads.
#[derive(Clone)]
pub struct Problem<'a> {
    /// The model to place.
    pub profile: &'a ModelProfile,
    /// The cluster to place it on.
    pub inv: &'a Inventory,
    /// Every device of every node in inventory order; stages name devices by index here.
    pub devs: Vec<Dev>,
    /// Transformer layers of the model.
    pub n_layers: usize,
    /// The index in the inventory's `nodes` of the driver's node (the first node by default).
    pub driver: usize,
    /// Decode seconds of layers `[0, l)` on each device.
    pub layer_t: Vec<Vec<f64>>,
    /// Of [`Problem::layer_t`], the seconds the host's CPU computes split layers' experts.
    host_t: Vec<Vec<f64>>,
    /// Per device, seconds per token a host is taken by split experts beside its own layers:
    /// on one node the experts of every split layer, wherever the layer is, `X = Σ_{l<N} x_l`;
    /// across nodes the search's reservation for the other devices' split layers. 0 elsewhere.
    host_load: Vec<f64>,
    /// Per host device, prefix sums of what a layer on it adds to its load beyond
    /// [`Problem::host_load`]: its time, less on one node `x_l` for a layer below N (which `X`
    /// counts already). Empty for other devices.
    load_t: Vec<Vec<f64>>,
    /// Decode seconds of the head on each device.
    pub head_t: Vec<f64>,
    w_prefix: Vec<u64>,
    /// Links by (node, node) index, as [`node_links`].
    links: HashMap<(usize, usize), Link>,
    /// KV positions layers `[0, l)` hold for `ctx` tokens of each of `sessions` sessions (a
    /// sliding-window layer fewer than `ctx`: [`ModelProfile::kv_positions`]).
    kv_prefix: Vec<u128>,
    /// KV bytes per position and layer on each device (a CPU may keep its cache in another type).
    kv_token_dev: Vec<u64>,
    /// Hop seconds per decoded token between two devices; `None` when they cannot be neighbours.
    pub hop: Vec<Vec<Option<f64>>>,
    /// Seconds per decoded token for the token id from the driver to each device: the link's
    /// latency (0 on the driver's node); `None` when the nodes have no link.
    pub drv_in: Vec<Option<f64>>,
    /// Seconds per decoded token for the sampled id from each device back to the driver, as
    /// [`Problem::drv_in`].
    pub drv_out: Vec<Option<f64>>,
    /// Context tokens per session the KV cache and rotary tables are sized for.
    pub ctx: u64,
    /// Concurrent sessions every stage holds a KV cache for.
    pub sessions: u64,
    /// Split layers: the experts of layers `[0, cpu_moe)` are in their hosts' RAM (0: whole
    /// layers only).
    pub cpu_moe: usize,
    /// On one node, the device index of its CPU, which holds the experts of `[0, cpu_moe)`
    /// (with `cpu_moe > 0`); `None` across nodes, where each node's CPU holds its own layers'
    /// ([`Problem::host_of`]).
    pub host: Option<usize>,
    /// Per device, with split layers: the CPU of its node (a CPU is its own); `None` without
    /// split layers or on a node without a CPU (whose devices hold whole layers).
    hosts: Vec<Option<usize>>,
    /// Per device, its budget before a reservation for split experts.
    host_budget: Vec<u64>,
    /// Across nodes, per device: at most how many bytes of split experts a stage on it may
    /// leave in its host's RAM (the search's share; the host's whole budget at first).
    host_room: Vec<u64>,
    /// On one node, bytes of the experts of `[0, cpu_moe)` and the host's budget before them
    /// (more than the budget: no assignment fits).
    host_need: (u64, u64),
    /// Made by [`Problem::reserving`]: [`Problem::evaluate`] judges by the reservation, as the
    /// programs do, not by each node's share.
    reserved: bool,
    /// Split layers across nodes with a device that leaves experts in its host's RAM
    /// ([`Problem::across_nodes`]).
    across: bool,
}

/// What a host CPU holds and computes in an assignment across nodes ([`Problem::host_usage`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostUse {
    /// The host's device index.
    pub host: usize,
    /// Bytes of its own stage, if it holds one (its layers' experts included).
    pub own_bytes: u64,
    /// Bytes of the split experts it holds for the GPU stages of its node.
    pub expert_bytes: u64,
    /// Its budget.
    pub budget: u64,
    /// Seconds per token of its own stage.
    pub own_s: f64,
    /// Seconds per token it computes those split experts.
    pub expert_s: f64,
}

impl HostUse {
    /// Seconds per token the host is busy.
    pub fn load(&self) -> f64 {
        self.own_s + self.expert_s
    }

    /// Whether its RAM holds all of it.
    pub fn fits(&self) -> bool {
        self.own_bytes.saturating_add(self.expert_bytes) <= self.budget
    }
}

/// The links between nodes by node index, both directions: one lookup per device pair instead of
/// a scan of the cluster's links by name (102² pairs × 198 links was 10 ms of a 100-node plan).
pub fn node_links(inv: &Inventory) -> HashMap<(usize, usize), Link> {
    let index: HashMap<&str, usize> = inv.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
    let mut out = HashMap::new();
    for l in &inv.links {
        if let (Some(&a), Some(&b)) = (index.get(l.a.as_str()), index.get(l.b.as_str())) {
            out.entry((a, b)).or_insert(l.link);
            out.entry((b, a)).or_insert(l.link);
        }
    }
    out
}

/// The path between two devices; `None` when their nodes have no link.
pub fn path(links: &HashMap<(usize, usize), Link>, a: &Dev, b: &Dev) -> Option<Vec<Link>> {
    if a.node == b.node {
        let hosts: Vec<Link> =
            [a, b].iter().filter_map(|d| if d.kind == DeviceKind::Cuda { d.host_link } else { None }).collect();
        Some(hosts)
    } else {
        links.get(&(a.node, b.node)).map(|&l| vec![l])
    }
}

fn path_time(links: &[Link], bytes: f64) -> f64 {
    links.iter().map(|l| l.time(bytes)).sum()
}

impl<'a> Problem<'a> {
    /// Precomputes the problem for a context of `ctx` tokens (not the policy's `ctx`, so the
    /// max-context search can try others). Errors on a profile without consistent layers, a
    /// cluster without devices, or a driver that names no node.
    pub fn new(inv: &'a Inventory, profile: &'a ModelProfile, policy: &Policy, ctx: u64) -> Result<Self, PlanError> {
        let cpu_moe = match policy.cpu_moe {
            crate::CpuMoe::Layers(n) => n,
            crate::CpuMoe::Auto => 0,
        };
        Self::with_cpu_moe(inv, profile, policy, ctx, cpu_moe)
    }

    /// [`Problem::new`] with the experts of layers `[0, cpu_moe)` in their hosts' RAM (split
    /// layers; `cpu_moe` past the last layer is every layer). Errors when the model has no
    /// experts, or no node that could hold them has a CPU device.
    pub fn with_cpu_moe(
        inv: &'a Inventory,
        profile: &'a ModelProfile,
        policy: &Policy,
        ctx: u64,
        cpu_moe: usize,
    ) -> Result<Self, PlanError> {
        let n_layers = profile.n_layers();
        let cpu_moe = cpu_moe.min(n_layers);
        if n_layers == 0 || profile.layer_flops.len() != n_layers {
            return Err(PlanError::BadModel(format!(
                "{} layer sizes and {} layer flop counts",
                n_layers,
                profile.layer_flops.len()
            )));
        }
        let mut devs = Vec::new();
        for (ni, n) in inv.nodes.iter().enumerate() {
            for d in &n.devices {
                let reserved: u64 =
                    policy.reserved.iter().filter(|r| r.node == n.name && r.device == d.name).map(|r| r.bytes).sum();
                devs.push(Dev {
                    node: ni,
                    node_name: n.name.clone(),
                    name: d.name.clone(),
                    kind: d.kind,
                    memory: d.memory,
                    budget: (((1.0 - policy.headroom) * d.memory as f64).floor() as u64).saturating_sub(reserved),
                    bw: d.mem_bandwidth,
                    flops: d.flops,
                    watts: d.watts,
                    host_link: d.host_link,
                });
            }
        }
        if devs.is_empty() {
            return Err(PlanError::BadCluster("the cluster has no devices".into()));
        }
        let driver = match &policy.driver {
            None => 0,
            Some(name) => inv.node_index(name).ok_or_else(|| PlanError::UnknownDriver(name.clone()))?,
        };
        let hosts = match cpu_moe {
            0 => vec![None; devs.len()],
            n => split_hosts(inv, profile, &devs, n)?,
        };
        // one node: its CPU holds every split layer's experts, whichever device holds the layer
        let host = match inv.nodes.len() {
            1 => hosts[0],
            _ => None,
        };
        let host_budget: Vec<u64> = devs.iter().map(|d| d.budget).collect();
        let host_bytes: u64 = (0..cpu_moe).map(|l| profile.expert_bytes(l)).fold(0, u64::saturating_add);
        let mut host_need = (0, 0);
        if let Some(h) = host {
            host_need = (host_bytes, devs[h].budget);
            devs[h].budget = devs[h].budget.saturating_sub(host_bytes);
        }
        let act = profile.act_bytes() as f64;
        let (mut layer_t, mut host_t) = (Vec::with_capacity(devs.len()), Vec::with_capacity(devs.len()));
        for (d, host_d) in hosts.iter().enumerate() {
            let (mut t, mut h) = (vec![0.0; n_layers + 1], vec![0.0; n_layers + 1]);
            for l in 0..n_layers {
                let (lt, lh) = layer_time(profile, &devs, d, host_d.filter(|_| l < cpu_moe), l, 1.0, act);
                t[l + 1] = t[l] + lt;
                h[l + 1] = h[l] + lh;
            }
            layer_t.push(t);
            host_t.push(h);
        }
        // a host's load per token: on one node every split layer's experts, then what its own
        // layers add; across nodes its own layers (the search reserves the others' experts)
        let (mut host_load, mut load_t) = (vec![0.0; devs.len()], vec![Vec::new(); devs.len()]);
        for h in (0..devs.len()).filter(|&d| hosts[d] == Some(d)) {
            let mut t = vec![0.0; n_layers + 1];
            for l in 0..n_layers {
                let x = match host {
                    Some(_) if l < cpu_moe => expert_time(profile, &devs[h], l, 1.0),
                    _ => 0.0,
                };
                host_load[h] += x;
                t[l + 1] = t[l] + (layer_t[h][l + 1] - layer_t[h][l] - x).max(0.0);
            }
            load_t[h] = t;
        }
        let stage_time = |bytes: f64, flops: f64, d: &Dev| (bytes / d.bw).max(flops / d.flops);
        let head_t = devs.iter().map(|d| stage_time(profile.head_bytes as f64, profile.head_flops, d)).collect();
        let mut w_prefix = vec![0u64; n_layers + 1];
        for l in 0..n_layers {
            let away = if l < cpu_moe { profile.expert_bytes(l) } else { 0 };
            w_prefix[l + 1] = w_prefix[l] + profile.layer_bytes[l] - away;
        }
        let links = node_links(inv);
        let hop = devs
            .iter()
            .enumerate()
            .map(|(i, a)| {
                devs.iter()
                    .enumerate()
                    .map(|(j, b)| if i == j { None } else { path(&links, a, b).map(|p| path_time(&p, act)) })
                    .collect()
            })
            .collect();
        let leg = |d: &Dev| -> Option<f64> {
            if d.node == driver {
                Some(0.0)
            } else {
                links.get(&(driver, d.node)).map(|l| l.latency)
            }
        };
        let drv_in = devs.iter().map(leg).collect();
        let drv_out = devs.iter().map(leg).collect();
        Ok(Problem {
            profile,
            inv,
            n_layers,
            driver,
            layer_t,
            host_t,
            host_load,
            load_t,
            head_t,
            w_prefix,
            links,
            // (u128: a sum of u64 products that cannot saturate, so differences stay exact)
            kv_prefix: std::iter::once(0)
                .chain((0..n_layers).scan(0u128, |sum, l| {
                    *sum += profile.kv_positions(l, ctx) as u128 * policy.sessions as u128;
                    Some(*sum)
                }))
                .collect(),
            kv_token_dev: devs.iter().map(|d| profile.kv_bytes_per_token_on(d.kind)).collect(),
            hop,
            drv_in,
            drv_out,
            ctx,
            sessions: policy.sessions,
            cpu_moe,
            host,
            host_room: hosts.iter().map(|h| h.map_or(0, |h| host_budget[h])).collect(),
            host_budget,
            host_need,
            reserved: false,
            across: host.is_none() && (0..devs.len()).any(|d| hosts[d].is_some_and(|h| h != d)),
            hosts,
            devs,
        })
    }

    /// Split layers across nodes (each node's CPU the host of its own layers' experts) with a
    /// device that can leave experts in its host's RAM: the programs hold only the search's
    /// reservation ([`Problem::reserving`]), not each node's share, and [`Problem::evaluate`]
    /// checks every node's RAM.
    pub fn across_nodes(&self) -> bool {
        self.across
    }

    /// Split layers on a cluster of several nodes: a stage that splits no layer holds its
    /// layers' experts itself (on one node the host's budget is reduced by them instead).
    pub fn experts_held_whole(&self, d: usize) -> bool {
        self.cpu_moe > 0 && self.host.is_none() && !self.splits_on(d)
    }

    /// Whether device `d` may hold a stage over `[a, b)`: with split layers across nodes, a
    /// device on a node without a CPU cannot take a layer below `cpu_moe`, whose experts the
    /// workers keep in their node's RAM.
    fn may_hold(&self, d: usize, a: usize) -> bool {
        !(self.cpu_moe > 0 && self.hosts[d].is_none() && a < self.cpu_moe)
    }

    /// The CPU whose RAM holds the experts of device `d`'s split layers: `d`'s node's (`d`
    /// itself for a CPU); `None` without split layers or on a node without a CPU.
    pub fn host_of(&self, d: usize) -> Option<usize> {
        self.hosts[d]
    }

    /// Device `d`'s budget before any reservation for split experts.
    pub fn host_budget(&self, d: usize) -> u64 {
        self.host_budget[d]
    }

    /// Across nodes, the room device `d`'s stage starts with for split experts: its host's
    /// budget.
    pub fn host_room(&self, d: usize) -> u64 {
        self.host_room[d]
    }

    /// Across nodes: this problem with `reserve[h]` (bytes, seconds per token) of each host
    /// `h`'s budget and time set aside for the split experts of its node's other devices, and
    /// the split experts of a stage on device `d` held to `room[d]` bytes (the search's guesses, which
    /// [`crate::search::solve`] revises from the plans they give). Its [`Problem::evaluate`]
    /// judges by them, as the programs do; this problem's judges by each node's share.
    pub fn reserving(&self, reserve: &[(u64, f64)], room: &[u64]) -> Problem<'a> {
        let mut q = self.clone();
        q.reserved = true;
        if q.across_nodes() {
            for h in (0..q.devs.len()).filter(|&d| q.hosts[d] == Some(d)) {
                q.devs[h].budget = q.host_budget[h].saturating_sub(reserve[h].0);
                q.host_load[h] = reserve[h].1;
            }
            q.host_room = room.to_vec();
        }
        q
    }

    /// Across nodes, every host CPU's share of `stages` (in pipeline order): its own stage and
    /// the split experts of its node's other stages, bytes and seconds. Empty on one node (where
    /// the budget is reserved in advance) and without split layers.
    pub fn host_usage(&self, stages: &[(usize, usize, usize)]) -> Vec<HostUse> {
        if !self.across_nodes() {
            return Vec::new();
        }
        let mut out: Vec<HostUse> = Vec::new();
        for &(d, a, b) in stages {
            let Some(h) = self.hosts[d] else { continue };
            let at = match out.iter().position(|u| u.host == h) {
                Some(i) => i,
                None => {
                    let budget = self.host_budget[h];
                    out.push(HostUse { host: h, own_bytes: 0, expert_bytes: 0, budget, own_s: 0.0, expert_s: 0.0 });
                    out.len() - 1
                }
            };
            let u = &mut out[at];
            if h == d {
                u.own_bytes = u.own_bytes.saturating_add(self.stage_mem_on(d, a, b).total());
                u.own_s += self.stage_time(d, a, b);
            } else {
                u.expert_bytes = u.expert_bytes.saturating_add(self.host_expert_bytes(a, b));
                u.expert_s += self.stage_host_time(d, a, b);
            }
        }
        out
    }

    /// Bytes of the routed experts of layers `[a, b) ∩ [0, cpu_moe)`: what a stage over `[a, b)`
    /// leaves in the host's RAM.
    pub fn host_expert_bytes(&self, a: usize, b: usize) -> u64 {
        (a..b.min(self.cpu_moe)).map(|l| self.profile.expert_bytes(l)).fold(0, u64::saturating_add)
    }

    /// When the host's RAM cannot hold the experts of `[0, cpu_moe)`: (their bytes, the host's
    /// budget).
    pub fn host_shortfall(&self) -> Option<(u64, u64)> {
        (self.host_need.0 > self.host_need.1).then_some(self.host_need)
    }

    /// Whether device `d` runs split layers (a device other than its host, with experts in the
    /// host's RAM).
    pub fn splits_on(&self, d: usize) -> bool {
        self.cpu_moe > 0 && self.hosts[d].is_some_and(|h| h != d)
    }

    /// KV bytes layers `[a, b)` hold for `ctx × sessions` tokens at `per_token` bytes per
    /// position and layer.
    fn kv_bytes(&self, a: usize, b: usize, per_token: u64) -> u64 {
        let bytes = (self.kv_prefix[b] - self.kv_prefix[a]).saturating_mul(per_token as u128);
        u64::try_from(bytes).unwrap_or(u64::MAX)
    }

    /// KV bytes of an average layer on a device of the profile's default KV type.
    pub fn kv_layer_avg(&self) -> f64 {
        self.kv_bytes(0, self.n_layers, self.profile.kv_bytes_per_token) as f64 / self.n_layers as f64
    }

    /// Bytes a stage `[a, b)` holds on device `d`: [`Problem::stage_mem`] with the device's KV
    /// cache type.
    pub fn stage_mem_on(&self, d: usize, a: usize, b: usize) -> StageMem {
        let mut m = self.stage_mem(a, b);
        // across nodes a stage that runs no split layer holds its layers' experts itself (on one
        // node the host's budget is reduced by them instead)
        if self.experts_held_whole(d) {
            m.weights = m.weights.saturating_add(self.host_expert_bytes(a, b));
        }
        let per_token = self.kv_token_dev.get(d).copied().unwrap_or(self.profile.kv_bytes_per_token);
        StageMem { kv: self.kv_bytes(a, b, per_token), ..m }
    }

    /// Bytes a stage `[a, b)` holds: weights, KV cache (of the profile's default type),
    /// embedding if first, head if last, and the rotary tables over the context.
    pub fn stage_mem(&self, a: usize, b: usize) -> StageMem {
        let l = self.n_layers;
        let p = self.profile;
        let weights = self.w_prefix[b] - self.w_prefix[a];
        let mut extra = 0;
        if a == 0 {
            extra += p.embed_bytes;
        }
        if b == l {
            extra += p.head_bytes;
            if a == 0 && p.tied {
                extra -= p.embed_bytes.min(p.head_bytes);
            }
        }
        StageMem {
            weights: weights + extra,
            kv: self.kv_bytes(a, b, p.kv_bytes_per_token),
            tables: p.rope_bytes_per_position.saturating_mul(self.ctx),
        }
    }

    /// Whether stage `[a, b)` fits within device `d`'s budget (with the device's KV type) and,
    /// across nodes, its split experts within the room the search gives them on its host.
    pub fn fits(&self, d: usize, a: usize, b: usize) -> bool {
        self.fits_device(d, a, b)
            && (!self.across_nodes() || !self.splits_on(d) || self.host_expert_bytes(a, b) <= self.host_room[d])
    }

    /// [`Problem::fits`] without the search's room for split experts: the device's own budget.
    pub(crate) fn fits_device(&self, d: usize, a: usize, b: usize) -> bool {
        self.may_hold(d, a) && self.stage_mem_on(d, a, b).total() <= self.devs[d].budget
    }

    /// Of [`Problem::stage_time`], the seconds the host's CPU computes the experts of stage
    /// `[a, b)` on device `d` (split layers; 0 otherwise).
    pub fn stage_host_time(&self, d: usize, a: usize, b: usize) -> f64 {
        self.host_t[d][b] - self.host_t[d][a]
    }

    /// What a stage adds to a per-second quantity of each device (`coef`: watts for energy):
    /// the stage's seconds at its device's rate, its experts' seconds on the host at the host's.
    pub fn stage_amount(&self, coef: impl Fn(usize) -> f64, d: usize, a: usize, b: usize) -> f64 {
        let t = self.stage_time(d, a, b);
        match self.hosts[d].filter(|&h| h != d) {
            Some(h) => {
                let x = self.stage_host_time(d, a, b);
                coef(d) * (t - x) + coef(h) * x
            }
            None => coef(d) * t,
        }
    }

    /// How long device `d` is busy per token holding stage `[a, b)`, what a throughput cap
    /// bounds: the stage's time, except on a host of split layers, which also computes split
    /// layers' experts ([`Problem::host_load`] plus what its own layers add).
    pub fn stage_load(&self, d: usize, a: usize, b: usize) -> f64 {
        match self.hosts[d].filter(|&h| h == d && self.cpu_moe > 0) {
            Some(_) => {
                let head = if b == self.n_layers { self.head_t[d] } else { 0.0 };
                self.host_load[d] + self.load_t[d][b] - self.load_t[d][a] + head
            }
            None => self.stage_time(d, a, b),
        }
    }

    /// Seconds per token a host's CPU computes split layers' experts, whether or not it holds a
    /// stage: no pipeline with split layers runs faster than one token per this (on one node
    /// exactly; across nodes the search's reservation).
    pub fn host_floor(&self) -> f64 {
        self.host_load.iter().copied().fold(0.0, f64::max)
    }

    /// Decode seconds per token of stage `[a, b)` on device `d`.
    pub fn stage_time(&self, d: usize, a: usize, b: usize) -> f64 {
        self.layer_t[d][b] - self.layer_t[d][a] + if b == self.n_layers { self.head_t[d] } else { 0.0 }
    }

    /// Prefill seconds of `p` tokens for stage `[a, b)` on device `d`.
    pub fn stage_prefill(&self, d: usize, a: usize, b: usize, p: f64) -> f64 {
        let act = self.profile.act_bytes() as f64;
        let mut t: f64 = (a..b)
            .map(|l| layer_time(self.profile, &self.devs, d, self.hosts[d].filter(|_| l < self.cpu_moe), l, p, act).0)
            .sum();
        if b == self.n_layers {
            t += self.head_t[d];
        }
        t
    }

    /// Hop seconds for `bytes` between two devices (prefill moves `P × act`).
    pub fn hop_bytes(&self, i: usize, j: usize, bytes: f64) -> Option<f64> {
        path(&self.links, &self.devs[i], &self.devs[j]).map(|p| path_time(&p, bytes))
    }

    /// Driver leg seconds for `bytes` to or from device `d`.
    pub fn driver_leg(&self, d: usize, bytes: f64) -> Option<f64> {
        let dev = &self.devs[d];
        if dev.node == self.driver {
            Some(0.0)
        } else {
            self.links.get(&(self.driver, dev.node)).map(|l| l.time(bytes))
        }
    }

    /// Seconds to move one token's hidden state between the driver's node and device `d`.
    pub fn hop_bytes_from_driver(&self, d: usize) -> Option<f64> {
        self.driver_leg(d, self.profile.act_bytes() as f64)
    }

    /// Evaluates a complete assignment (stages in pipeline order, covering `[0, L)`).
    pub fn evaluate(&self, stages: &[(usize, usize, usize)]) -> Option<Metrics> {
        let (first, last) = (stages.first()?, stages.last()?);
        if first.1 != 0 || last.2 != self.n_layers || self.host_shortfall().is_some() {
            return None;
        }
        let across = self.across_nodes() && !self.reserved;
        let mut stage_t = Vec::with_capacity(stages.len());
        let mut energy = 0.0;
        let mut has_watts = true;
        for (i, &(d, a, b)) in stages.iter().enumerate() {
            // across nodes a host's RAM is checked with its node's split experts below, and the
            // search's reservation and room do not count
            let fits = match across {
                true if self.hosts[d] == Some(d) => true,
                true => self.fits_device(d, a, b),
                false => self.fits(d, a, b),
            };
            if a >= b || (i > 0 && stages[i - 1].2 != a) || !fits {
                return None;
            }
            let t = self.stage_time(d, a, b);
            // joules need the watts of the device and, where it computes experts, the host's
            let host_w =
                self.hosts[d].filter(|&h| h != d && self.stage_host_time(d, a, b) > 0.0).map(|h| self.devs[h].watts);
            if self.devs[d].watts.is_some() && host_w.is_none_or(|w| w.is_some()) {
                energy += self.stage_amount(|i| self.devs[i].watts.unwrap_or(0.0), d, a, b);
            } else {
                has_watts = false;
            }
            stage_t.push(t);
        }
        let mut hops = Vec::with_capacity(stages.len().saturating_sub(1));
        for w in stages.windows(2) {
            if w[0].0 == w[1].0 {
                return None;
            }
            hops.push(self.hop[w[0].0][w[1].0]?);
        }
        let d_in = self.drv_in[first.0]?;
        let d_out = self.drv_out[last.0]?;
        let total = d_in + d_out + stage_t.iter().sum::<f64>() + hops.iter().sum::<f64>();
        // each device's busy time (a host's with its split layers' experts), each hop
        let bottleneck = if across {
            let hosts = self.host_usage(stages);
            if !hosts.iter().all(HostUse::fits) {
                return None;
            }
            let others =
                stages.iter().filter(|s| self.hosts[s.0] != Some(s.0)).map(|&(d, a, b)| self.stage_time(d, a, b));
            others.chain(hosts.iter().map(HostUse::load)).chain(hops.iter().copied()).fold(0.0, f64::max)
        } else {
            let loads = stages.iter().map(|&(d, a, b)| self.stage_load(d, a, b));
            loads.chain(hops.iter().copied()).fold(self.host_floor(), f64::max)
        };
        let throughput = (self.sessions as f64 / total).min(1.0 / bottleneck);
        Some(Metrics {
            decode_s: total,
            stage_s: stage_t,
            hop_s: hops,
            driver_in_s: d_in,
            driver_out_s: d_out,
            bottleneck_s: bottleneck,
            throughput,
            energy_j: has_watts.then_some(energy),
        })
    }

    /// Prefill seconds of `p` tokens for an assignment.
    pub fn prefill(&self, stages: &[(usize, usize, usize)], p: usize) -> Option<f64> {
        let pf = p as f64;
        let act = self.profile.act_bytes() as f64 * pf;
        let mut t = self.driver_leg(stages.first()?.0, 4.0 * pf)? + self.driver_leg(stages.last()?.0, 4.0)?;
        for &(d, a, b) in stages {
            t += self.stage_prefill(d, a, b, pf);
        }
        for w in stages.windows(2) {
            t += self.hop_bytes(w[0].0, w[1].0, act)?;
        }
        Some(t)
    }

    /// Every device's bytes in one place for the whole model (for "does not fit by" lines).
    pub fn whole_model_mem(&self) -> StageMem {
        let mut m = self.stage_mem(0, self.n_layers);
        if self.cpu_moe > 0 && self.host.is_none() {
            // the split experts are in some node's RAM
            m.weights = m.weights.saturating_add(self.host_expert_bytes(0, self.n_layers));
        }
        m
    }
}

/// Seconds of layer `l` on device `d` for a pass of `rows` tokens: the whole layer there, or
/// with `host` (a split layer on another device than the host CPU) its dense part there, its
/// experts on the host and the rows to the host and back over `d`'s host link.
/// The second number is the part of it the host's CPU computes (0 for a whole layer).
fn layer_time(
    p: &ModelProfile,
    devs: &[Dev],
    d: usize,
    host: Option<usize>,
    l: usize,
    rows: f64,
    act: f64,
) -> (f64, f64) {
    let dev = &devs[d];
    let (bytes, flops) = (p.layer_read_bytes(l, rows), rows * p.layer_flops[l]);
    match host.filter(|&h| h != d) {
        None => ((bytes / dev.bw).max(flops / dev.flops), 0.0),
        Some(h) => {
            let (eb, ef) = (p.expert_read_bytes(l, rows), rows * p.expert_flops(l));
            let dense = ((bytes - eb).max(0.0) / dev.bw).max((flops - ef).max(0.0) / dev.flops);
            let experts = expert_time(p, &devs[h], l, rows);
            let hops = 2.0 * dev.host_link.map_or(0.0, |link| link.time(rows * act));
            (dense + experts + hops, experts)
        }
    }
}

/// Seconds the host `host` computes layer `l`'s routed experts for a pass of `rows` tokens.
fn expert_time(p: &ModelProfile, host: &Dev, l: usize, rows: f64) -> f64 {
    (p.expert_read_bytes(l, rows) / host.bw).max(rows * p.expert_flops(l) / host.flops)
}

/// Per device, the CPU device that holds its split layers' experts: its node's first CPU (a
/// CPU its own; `None` on a node without one, whose devices then take no layer below N).
/// Refuses a model without experts and a cluster without a CPU.
fn split_hosts(
    inv: &Inventory,
    profile: &ModelProfile,
    devs: &[Dev],
    n: usize,
) -> Result<Vec<Option<usize>>, PlanError> {
    let bad = |why: String| PlanError::BadValue { what: "--n-cpu-moe".into(), value: n.to_string(), why };
    if profile.moe.is_none() {
        return Err(bad(format!("asks for split layers, but {} has no experts", profile.name)));
    }
    let cpu_of = |node: usize| devs.iter().position(|d| d.node == node && d.kind == DeviceKind::Cpu);
    let hosts: Vec<Option<usize>> = devs.iter().map(|d| cpu_of(d.node)).collect();
    if hosts.iter().all(Option::is_none) {
        return Err(bad(match inv.nodes.as_slice() {
            [one] => format!("asks for experts in host RAM, but {} has no CPU device", one.name),
            all => format!("asks for experts in host RAM, but none of the {} nodes has a CPU device", all.len()),
        }));
    }
    Ok(hosts)
}

/// Bytes a stage holds, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageMem {
    /// The layers' weights, plus the embedding on the first stage and the head on the last (a
    /// tied pair counted once).
    pub weights: u64,
    /// The KV cache for `ctx` positions (fewer in sliding-window layers) of every session.
    pub kv: u64,
    /// The rotary tables over the context (every stage holds its own).
    pub tables: u64,
}

impl StageMem {
    /// All of it, weights, KV cache and tables (saturating).
    pub fn total(&self) -> u64 {
        self.weights.saturating_add(self.kv).saturating_add(self.tables)
    }
}

/// The predicted numbers of an assignment.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Seconds per decoded token of one session: stages, hops and both driver legs.
    pub decode_s: f64,
    /// Decode seconds per token of each stage, in pipeline order.
    pub stage_s: Vec<f64>,
    /// Seconds per token of each hop between consecutive stages.
    pub hop_s: Vec<f64>,
    /// Seconds per token from the driver to the first stage.
    pub driver_in_s: f64,
    /// Seconds per token from the last stage back to the driver.
    pub driver_out_s: f64,
    /// Seconds per token of the slowest stage or hop.
    pub bottleneck_s: f64,
    /// Tokens per second over all sessions: `min(sessions / decode_s, 1 / bottleneck_s)`.
    pub throughput: f64,
    /// Joules per token, when every used device has watts.
    pub energy_j: Option<f64>,
}

impl Metrics {
    /// Average power while decoding (J per token ÷ seconds per token).
    pub fn avg_watts(&self) -> Option<f64> {
        self.energy_j.map(|e| e / self.decode_s)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use brigade_core::{DeviceSpec, NodeSpec};

    /// A CPU that keeps its KV cache in f32 holds fewer layers than the bf16 size says.
    #[test]
    fn a_cpu_counts_its_own_kv_type() {
        let dev = |name: &str, kind| DeviceSpec {
            name: name.into(),
            kind,
            memory: 1000,
            mem_bandwidth: 1e9,
            flops: 1e12,
            watts: None,
            host_link: None,
        };
        let inv = Inventory {
            nodes: vec![NodeSpec {
                name: "box".into(),
                devices: vec![dev("cpu", DeviceKind::Cpu), dev("cuda0", DeviceKind::Cuda)],
            }],
            links: Vec::new(),
        };
        let mut profile = ModelProfile {
            name: "m".into(),
            layer_bytes: vec![100; 4],
            layer_flops: vec![1.0; 4],
            head_bytes: 0,
            head_flops: 0.0,
            embed_bytes: 0,
            tied: false,
            kv_bytes_per_token: 2,
            cpu_kv_bytes_per_token: None,
            kv_positions_max: Vec::new(),
            rope_bytes_per_position: 0,
            context_length: None,
            hidden: 1,
            vocab: 1,
            moe: None,
        };
        let policy = Policy { headroom: 0.0, ..Policy::default() };
        // 100 tokens: a layer is 100 + 200 bytes in bf16, 100 + 400 in f32
        let p = Problem::new(&inv, &profile, &policy, 100).unwrap();
        assert_eq!(p.stage_mem_on(0, 0, 3).total(), 900);
        assert!(p.fits(0, 0, 3) && p.fits(1, 0, 3));
        profile.cpu_kv_bytes_per_token = Some(4);
        let p = Problem::new(&inv, &profile, &policy, 100).unwrap();
        assert_eq!(p.stage_mem_on(0, 0, 3).total(), 1500);
        assert_eq!(p.stage_mem_on(1, 0, 3).total(), 900, "the GPU keeps the default type");
        assert!(!p.fits(0, 0, 3) && p.fits(0, 0, 2) && p.fits(1, 0, 3));
        assert_eq!(p.stage_mem_on(0, 1, 2).kv, 400);
        assert_eq!(p.stage_mem_on(1, 1, 2).kv, 200);
        // layers 1 and 3 with a sliding window of 10 positions: they hold 10, not 100
        profile.kv_positions_max = vec![None, Some(10), None, Some(10)];
        let p = Problem::new(&inv, &profile, &policy, 100).unwrap();
        assert_eq!(p.stage_mem_on(0, 0, 4).kv, (100 + 10 + 100 + 10) * 4);
        assert_eq!(p.stage_mem_on(1, 1, 2).kv, 10 * 2);
        assert_eq!(p.stage_mem(0, 4).kv, 220 * 2);
        assert_eq!(p.kv_layer_avg(), 220.0 * 2.0 / 4.0);
        // a context shorter than the window: all of it
        let p = Problem::new(&inv, &profile, &policy, 8).unwrap();
        assert_eq!(p.stage_mem_on(1, 0, 4).kv, 4 * 8 * 2);
        // every stage holds the rotary tables of the whole context, whatever its layers
        profile.rope_bytes_per_position = 3;
        let p = Problem::new(&inv, &profile, &policy, 100).unwrap();
        for (a, b) in [(0, 1), (1, 3), (0, 4)] {
            let m = p.stage_mem_on(1, a, b);
            assert_eq!(m.tables, 300);
            assert_eq!(m.total(), m.weights + m.kv + 300);
        }
    }
}
