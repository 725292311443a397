//! The planner against brute force on random small clusters: the same objective value (to 1e-9
//! relative), no stage over its budget, every layer placed once, contiguously, in order.
#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

use brigade_core::{DeviceKind, DeviceSpec, Inventory, Link, LinkSpec, ModelProfile, NodeSpec};
use brigade_planner::cost::{Metrics, Problem};
use brigade_planner::{plan, Objective, PlanError, Policy};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[derive(Debug, Clone)]
struct Case {
    inv: Inventory,
    profile: ModelProfile,
    policy: Policy,
}

fn device(i: usize, cuda: bool, mem: u64, bw: f64, fl: f64, watts: f64) -> DeviceSpec {
    DeviceSpec {
        name: if cuda { format!("cuda{i}") } else { "cpu".into() },
        kind: if cuda { DeviceKind::Cuda } else { DeviceKind::Cpu },
        memory: mem,
        mem_bandwidth: bw,
        flops: fl,
        watts: Some(watts),
        host_link: cuda.then_some(Link { bandwidth: 2e9 + i as f64 * 1e9, latency: 1e-5 * (1 + i) as f64 }),
    }
}

prop_compose! {
    fn a_case()(
        n_nodes in 1usize..=3,
        gpus in proptest::collection::vec(0usize..=2, 3),
        layers in 1usize..=7,
        seed in any::<u64>(),
        obj in 0usize..5,
        sessions in 1u64..=4,
        missing_link in any::<bool>(),
    ) -> Case {
        let mut r = seed;
        let mut next = move || { r ^= r << 13; r ^= r >> 7; r ^= r << 17; (r >> 11) as f64 / (1u64 << 53) as f64 };
        let mut nodes = Vec::new();
        // at most EXACT_MAX (8) devices: the range where the planner claims the optimum
        let mut total = 0;
        for n in 0..n_nodes {
            let mut devs = vec![device(0, false, (200.0 + 900.0 * next()) as u64, 1e3 * (1.0 + 9.0 * next()), 1e4 * (1.0 + 9.0 * next()), 50.0 + 100.0 * next())];
            let room = brigade_planner::search::EXACT_MAX - total - (n_nodes - n);
            for g in 0..gpus[n].min(room) {
                devs.push(device(g, true, (100.0 + 600.0 * next()) as u64, 1e4 * (1.0 + 9.0 * next()), 1e5 * (1.0 + 9.0 * next()), 100.0 + 300.0 * next()));
            }
            total += devs.len();
            nodes.push(NodeSpec { name: format!("n{n}"), devices: devs });
        }
        let mut links = Vec::new();
        for a in 0..n_nodes {
            for b in a + 1..n_nodes {
                if missing_link && a == 0 && b == n_nodes - 1 && n_nodes == 3 {
                    continue;
                }
                links.push(LinkSpec { a: format!("n{a}"), b: format!("n{b}"), link: Link { bandwidth: 50.0 + 500.0 * next(), latency: 0.01 * next() } });
            }
        }
        let layer_bytes: Vec<u64> = (0..layers).map(|_| (20.0 + 120.0 * next()) as u64).collect();
        let layer_flops: Vec<f64> = (0..layers).map(|_| 100.0 + 2000.0 * next()).collect();
        let tied = next() < 0.3;
        let embed = (10.0 + 60.0 * next()) as u64;
        let profile = ModelProfile {
            name: "random".into(),
            layer_bytes,
            layer_flops,
            head_bytes: if tied { embed } else { (10.0 + 60.0 * next()) as u64 },
            head_flops: 500.0 * next(),
            embed_bytes: embed,
            tied,
            kv_bytes_per_token: 1 + (3.0 * next()) as u64,
            cpu_kv_bytes_per_token: (next() < 0.5).then(|| 1 + (6.0 * next()) as u64),
            // some layers with a sliding window shorter than some contexts
            kv_positions_max: (0..layers).map(|_| (next() < 0.3).then(|| 1 + (5.0 * next()) as u64)).collect(),
            rope_bytes_per_position: (3.0 * next()) as u64,
            // a trained context the max-context objective stops at, or none
            context_length: (next() < 0.5).then(|| 1 + (12.0 * next()) as u64),
            hidden: 1 + (20.0 * next()) as usize,
            vocab: 100,
            // some models of experts: a share of each layer's bytes read per token
            moe: (next() < 0.3).then(|| brigade_core::MoeProfile {
                expert_bytes: (0..layers).map(|_| (15.0 * next()) as u64).collect(),
                experts: 8,
                used: 1 + (3.0 * next()) as usize,
                expert_flops: (0..layers).map(|_| 50.0 * next()).collect(),
            }),
        };
        let mut policy = Policy { ctx: 1 + (8.0 * next()) as u64, sessions, headroom: 0.1, driver: Some(format!("n{}", (next() * n_nodes as f64) as usize % n_nodes)), ..Policy::default() };
        match obj {
            0 => policy.objective = Objective::Latency,
            1 => policy.objective = Objective::Throughput,
            2 => policy.objective = Objective::Energy,
            3 => { policy.objective = Objective::Latency; policy.max_watts = Some(80.0 + 200.0 * next()); }
            _ => policy.objective = Objective::MaxContext,
        }
        Case { inv: Inventory { nodes, links }, profile, policy }
    }
}

/// Every ordered chain of distinct devices with every split of the layers.
fn all_assignments(n_dev: usize, l: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let mut out = Vec::new();
    fn chains(n: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if !cur.is_empty() {
            out.push(cur.clone());
        }
        for d in 0..n {
            if !cur.contains(&d) {
                cur.push(d);
                chains(n, cur, out);
                cur.pop();
            }
        }
    }
    let mut cs = Vec::new();
    chains(n_dev, &mut Vec::new(), &mut cs);
    for c in cs {
        let m = c.len();
        if m > l {
            continue;
        }
        // choose m-1 cut points in 1..l
        let mut cuts = Vec::new();
        fn comb(start: usize, l: usize, left: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
            if left == 0 {
                out.push(cur.clone());
                return;
            }
            for c in start..l {
                cur.push(c);
                comb(c + 1, l, left - 1, cur, out);
                cur.pop();
            }
        }
        comb(1, l, m - 1, &mut Vec::new(), &mut cuts);
        for cut in cuts {
            let mut bounds = vec![0];
            bounds.extend(cut);
            bounds.push(l);
            out.push(c.iter().enumerate().map(|(i, &d)| (d, bounds[i], bounds[i + 1])).collect());
        }
    }
    out
}

fn all_metrics(p: &Problem) -> Vec<Metrics> {
    all_assignments(p.devs.len(), p.n_layers).iter().filter_map(|a| p.evaluate(a)).collect()
}

/// The best objective value; for energy, among the assignments within `slack × t_lat`.
fn brute_within(p: &Problem, policy: &Policy, t_lat: f64) -> Option<f64> {
    best_among(&all_metrics(p), policy, t_lat)
}

/// [`brute_within`] among the metrics of `all`.
fn best_among(all: &[Metrics], policy: &Policy, t_lat: f64) -> Option<f64> {
    match policy.objective {
        Objective::Latency | Objective::MaxContext => {
            let ok = |m: &&Metrics| policy.max_watts.is_none_or(|cap| m.avg_watts().unwrap() <= cap * (1.0 + 1e-12));
            all.iter().filter(ok).map(|m| m.decode_s).min_by(f64::total_cmp)
        }
        Objective::Throughput => all.iter().map(|m| m.throughput).max_by(f64::total_cmp).map(|x| -x),
        Objective::Energy => all
            .iter()
            .filter(|m| m.decode_s <= t_lat * policy.slack * (1.0 + 1e-12))
            .map(|m| m.energy_j.unwrap())
            .min_by(f64::total_cmp),
    }
}

fn value_of(plan: &brigade_planner::Plan, obj: Objective) -> f64 {
    match obj {
        Objective::Latency | Objective::MaxContext => plan.decode_ms_per_token / 1e3,
        Objective::Throughput => -plan.throughput_tokens_per_s,
        Objective::Energy => plan.energy_j_per_token.unwrap(),
    }
}

fn max_ctx_brute(c: &Case) -> Option<u64> {
    splits(c).into_iter().filter_map(|n| max_ctx_brute_at(c, n)).max()
}

/// The numbers of split layers the planner searches for the case: every one for a mixture on
/// one node with a CPU and a GPU, else none (the cases across nodes ask for whole layers).
fn splits(c: &Case) -> Vec<usize> {
    let devs: Vec<&DeviceSpec> = c.inv.nodes.iter().flat_map(|n| &n.devices).collect();
    let one_box = c.inv.nodes.len() == 1
        && devs.iter().any(|d| d.kind == DeviceKind::Cpu)
        && devs.iter().any(|d| d.kind == DeviceKind::Cuda);
    if c.profile.moe.is_some() && one_box {
        (0..=c.profile.n_layers()).collect()
    } else {
        vec![0]
    }
}

/// The best objective value over every split for a context of `ctx` (energy: within the slack
/// of the best latency over every split).
fn brute_all(c: &Case, ctx: u64) -> Option<f64> {
    let problems: Vec<Problem> =
        splits(c).into_iter().map(|n| Problem::with_cpu_moe(&c.inv, &c.profile, &c.policy, ctx, n).unwrap()).collect();
    let t_lat = problems.iter().flat_map(|p| all_metrics(p).into_iter().map(|m| m.decode_s)).min_by(f64::total_cmp)?;
    problems.iter().filter_map(|p| brute_within(p, &c.policy, t_lat)).min_by(f64::total_cmp)
}

fn max_ctx_brute_at(c: &Case, n: usize) -> Option<u64> {
    let feasible = |ctx: u64| {
        let p = Problem::with_cpu_moe(&c.inv, &c.profile, &c.policy, ctx, n).unwrap();
        all_assignments(p.devs.len(), p.n_layers).iter().any(|a| p.evaluate(a).is_some())
    };
    // feasibility is monotone in ctx: bisect between 1 and one past the planner's cap (the
    // model's trained context, else 2^34 tokens: a model whose every layer has a sliding window
    // holds any context)
    if !feasible(1) {
        return None;
    }
    let cap = c.profile.context_length.unwrap_or(brigade_planner::search::MAX_CONTEXT_CAP);
    let (mut lo, mut hi) = (1u64, cap + 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if feasible(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

/// A case on one node with a CPU and at least one GPU, holding a mixture of experts: where the
/// planner searches split layers.
fn one_box(mut c: Case, expert_share: f64) -> Case {
    c.inv.nodes.truncate(1);
    c.inv.links.clear();
    let node = &mut c.inv.nodes[0];
    if !node.devices.iter().any(|d| d.kind == DeviceKind::Cuda) {
        node.devices.push(device(0, true, 300, 5e4, 5e5, 200.0));
    }
    c.policy.driver = Some(node.name.clone());
    let bytes = c.profile.layer_bytes.clone();
    c.profile.moe = Some(brigade_core::MoeProfile {
        expert_bytes: bytes.iter().map(|&b| (b as f64 * expert_share) as u64).collect(),
        experts: 8,
        used: 2,
        expert_flops: c.profile.layer_flops.iter().map(|f| f * 0.5).collect(),
    });
    c
}

fn check_plan(c: &Case) -> Result<(), TestCaseError> {
    let result = plan(&c.inv, &c.profile, &c.policy);
    let ctx = if c.policy.objective == Objective::MaxContext { max_ctx_brute(c) } else { Some(c.policy.ctx) };
    let want = ctx.and_then(|ctx| brute_all(c, ctx));
    match (result, want) {
        (Ok(plan), Some(want)) => {
            if c.policy.objective == Objective::MaxContext {
                prop_assert_eq!(Some(plan.ctx), ctx);
            }
            let got = value_of(&plan, c.policy.objective);
            prop_assert!((got - want).abs() <= 1e-9 * want.abs().max(1e-12), "planner {got} vs brute force {want}");
            // every layer once, contiguous, in order; no stage over budget
            let mut next = 0;
            for st in &plan.stages {
                prop_assert_eq!(st.layers.0, next);
                prop_assert!(st.layers.1 > st.layers.0);
                prop_assert!(st.memory_bytes <= st.budget_bytes);
                next = st.layers.1;
            }
            prop_assert_eq!(next, c.profile.n_layers());
            let mut devs: Vec<(String, String)> =
                plan.stages.iter().map(|s| (s.node.clone(), s.device.clone())).collect();
            let n = devs.len();
            devs.sort();
            devs.dedup();
            prop_assert_eq!(devs.len(), n, "a device used twice");
            // split layers: the host's RAM holds its own stage and the other stages' experts
            if let Some(host) = &plan.host_device {
                let budget = c.inv.nodes[0].devices.iter().find(|d| d.kind == DeviceKind::Cpu).unwrap().memory;
                let own: u64 = plan.stages.iter().filter(|s| s.device == "cpu").map(|s| s.memory_bytes).sum();
                prop_assert!(
                    (own + plan.host_expert_bytes) as f64 <= budget as f64 * (1.0 - c.policy.headroom) + 1.0,
                    "{host} holds {own} + {} of {budget}",
                    plan.host_expert_bytes
                );
                let experts: u64 = (0..plan.cpu_moe).map(|l| c.profile.expert_bytes(l)).sum();
                let split: u64 = plan.stages.iter().map(|s| s.host_expert_bytes).sum();
                prop_assert_eq!(split, plan.host_expert_bytes);
                prop_assert!(split <= experts);
            }
        }
        (Err(PlanError::Infeasible { .. }), None) => {}
        (Err(PlanError::BadValue { what, .. }), None) if what == "--max-watts" => {}
        (r, w) => prop_assert!(false, "planner {:?} vs brute force {:?}", r.map(|p| p.to_text()), w),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    #[test]
    fn planner_equals_brute_force(mut c in a_case()) {
        // split layers across nodes are tested below (check_across): whole layers here
        if c.inv.nodes.len() > 1 {
            c.policy.cpu_moe = brigade_planner::CpuMoe::Layers(0);
        }
        check_plan(&c)?;
    }

    /// Split layers searched with the cut points: the best over every `--n-cpu-moe` and every
    /// assignment, whichever objective.
    #[test]
    fn split_layers_equal_brute_force(c in a_case(), share in 0.3f64..0.95) {
        check_plan(&one_box(c, share))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, .. ProptestConfig::default() })]

    /// The beam search with room for every device set is the exact program.
    #[test]
    fn wide_beam_equals_exact(c in a_case()) {
        let p = Problem::new(&c.inv, &c.profile, &c.policy, c.policy.ctx).unwrap();
        let all: Vec<usize> = (0..p.devs.len()).collect();
        let exact = brigade_planner::dp::min_latency(&p, &all, None).map(|r| r.0);
        let beam = brigade_planner::dp::beam_latency(&p, &all, 4096, 4096, None).map(|r| r.0);
        match (exact, beam) {
            (Some(e), Some(b)) => prop_assert!((e - b).abs() <= 1e-9 * e),
            (e, b) => prop_assert_eq!(e.is_some(), b.is_some()),
        }
    }
}

/// A case of two or three nodes, each with a CPU and most with a GPU, holding a mixture of
/// experts with `--n-cpu-moe n`: split layers across nodes.
fn across_nodes(mut c: Case, expert_share: f64, n: usize) -> Case {
    c = one_box(c, expert_share);
    let gpu = |i: usize, mem: u64| device(i, true, mem, 5e4, 5e5, 200.0);
    let cpu = |mem: u64| device(0, false, mem, 2e3, 2e4, 80.0);
    c.inv.nodes.push(NodeSpec { name: "m1".into(), devices: vec![cpu(150 + 37 * n as u64 % 500), gpu(0, 120)] });
    if n.is_multiple_of(2) {
        c.inv.nodes.push(NodeSpec { name: "m2".into(), devices: vec![cpu(400), gpu(0, 90), gpu(1, 80)] });
    }
    let names: Vec<String> = c.inv.nodes.iter().map(|n| n.name.clone()).collect();
    for a in 0..names.len() {
        for b in a + 1..names.len() {
            let link = Link { bandwidth: 300.0 + 50.0 * (a + b) as f64, latency: 0.002 * (1 + a) as f64 };
            c.inv.links.push(LinkSpec { a: names[a].clone(), b: names[b].clone(), link });
        }
    }
    // at most EXACT_MAX devices, where the device programs are exact
    let mut total = 0;
    for node in &mut c.inv.nodes {
        let room = brigade_planner::search::EXACT_MAX.saturating_sub(total).max(1);
        node.devices.truncate(room);
        total += node.devices.len();
    }
    c.policy.cpu_moe = brigade_planner::CpuMoe::Layers(n.min(c.profile.n_layers()));
    if c.policy.objective == Objective::MaxContext {
        c.policy.objective = Objective::Latency;
    }
    c
}

/// What the planner answered on a case of split layers across nodes (anything else fails).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Fits {
    /// Brute force's optimum.
    Optimal,
    /// Nothing fits, and the planner says so.
    None,
}

fn check_across(c: &Case) -> Result<Fits, TestCaseError> {
    // every split the planner searches (the one asked for, or all of them)
    let splits = brigade_planner::explain::splits_searched(&c.inv, &c.profile, &c.policy);
    let mut all = Vec::new();
    for &n in &splits {
        let p = Problem::with_cpu_moe(&c.inv, &c.profile, &c.policy, c.policy.ctx, n).unwrap();
        prop_assert!(n == 0 || p.across_nodes());
        all.extend(all_metrics(&p));
    }
    let t_lat = all.iter().map(|m| m.decode_s).min_by(f64::total_cmp);
    let want = t_lat.and_then(|t| best_among(&all, &c.policy, t));
    let result = plan(&c.inv, &c.profile, &c.policy);
    Ok(match (&result, want) {
        (Ok(plan), Some(want)) => {
            // up to EXACT_MAX devices the program across nodes is exact (whole layers under a
            // watts cap may thin their fronts: dp::MAX_FRONT)
            prop_assert_eq!(plan.exact, plan.heuristic.is_none());
            prop_assert!(plan.exact || (plan.cpu_moe == 0 && c.policy.max_watts.is_some()), "{}", plan.to_text());
            if c.policy.objective == Objective::Energy {
                // within the slack of the planner's own best latency
                let fastest = brigade_planner::plan(
                    &c.inv,
                    &c.profile,
                    &Policy { objective: Objective::Latency, ..c.policy.clone() },
                )
                .unwrap();
                let limit = fastest.decode_ms_per_token * c.policy.slack * (1.0 + 1e-9);
                prop_assert!(plan.decode_ms_per_token <= limit, "{} ms, limit {limit}", plan.decode_ms_per_token);
            }
            let got = value_of(plan, c.policy.objective);
            prop_assert!(got >= want - 1e-9 * want.abs().max(1e-12), "planner {got} beats brute force {want}");
            // every byte of the model held once: stages' own bytes and the experts they leave
            // (a tied head is a second copy on a second stage)
            let one_copy = c.profile.tied && plan.stages.len() == 1;
            let total: u64 = c.profile.layer_bytes.iter().sum::<u64>()
                + c.profile.embed_bytes
                + if one_copy { 0 } else { c.profile.head_bytes };
            let kv: u64 = plan.stages.iter().map(|s| s.kv_bytes).sum();
            let held: u64 = plan.stages.iter().map(|s| s.weight_bytes + s.host_expert_bytes).sum();
            prop_assert_eq!(held, total, "{}", plan.to_text());
            prop_assert!(kv <= plan.stages.iter().map(|s| s.memory_bytes).sum::<u64>());
            // each node's CPU holds its own stage and its GPUs' split experts
            for node in &c.inv.nodes {
                let cpu = node.devices.iter().find(|d| d.kind == DeviceKind::Cpu).unwrap();
                let budget = (cpu.memory as f64 * (1.0 - c.policy.headroom)).floor() as u64;
                let on = |s: &&brigade_planner::StagePlan| s.node == node.name;
                let own: u64 =
                    plan.stages.iter().filter(on).filter(|s| s.device == "cpu").map(|s| s.memory_bytes).sum();
                let experts: u64 = plan.stages.iter().filter(on).map(|s| s.host_expert_bytes).sum();
                prop_assert!(
                    own + experts <= budget,
                    "{}: {own} + {experts} of {budget}\n{}",
                    node.name,
                    plan.to_text()
                );
                for s in plan.stages.iter().filter(on) {
                    prop_assert!(s.memory_bytes <= s.budget_bytes);
                    let host = format!("{}/cpu", node.name);
                    prop_assert_eq!(s.host_device.as_deref(), (s.host_expert_bytes > 0).then_some(host.as_str()));
                    prop_assert_eq!(s.host_layers.is_some(), s.device != "cpu" && s.layers.0 < plan.cpu_moe);
                }
            }
            prop_assert!(
                !plan.exact || (got - want).abs() <= 1e-9 * want.abs().max(1e-12),
                "planner {got}, brute force {want}\n{}",
                plan.to_text()
            );
            Fits::Optimal
        }
        (Err(PlanError::Infeasible { .. }), None) => Fits::None,
        (Err(PlanError::BadValue { what, .. }), None) if what == "--max-watts" => Fits::None,
        (r, w) => {
            prop_assert!(false, "planner {:?} vs brute force {:?}", r.as_ref().map(|p| p.to_text()), w);
            unreachable!()
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    /// Split layers across nodes: the planner's plan is brute force's optimum, fits every node's
    /// RAM by the plan's own numbers and holds every byte once; energy stays within the slack.
    #[test]
    fn split_layers_across_nodes_equal_brute_force(
        c in a_case(),
        share in 0.3f64..0.95,
        n in 1usize..=7,
    ) {
        check_across(&across_nodes(c, share, n))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, .. ProptestConfig::default() })]

    /// The same with no split asked for: the planner searches every number of split layers,
    /// brute force tries them all.
    #[test]
    fn searched_split_layers_across_nodes_equal_brute_force(c in a_case(), share in 0.3f64..0.95, n in 1usize..=7) {
        let mut c = across_nodes(c, share, n);
        c.policy.cpu_moe = brigade_planner::CpuMoe::Auto;
        check_across(&c)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, .. ProptestConfig::default() })]

    /// Where the exact program gives up (budgets from none to plenty) the plan still fits and is
    /// never better than brute force, is its optimum where it says exact (always, with budget
    /// to spare), and for energy stays within the slack of a latency no better than the best.
    #[test]
    fn split_layers_across_nodes_when_the_program_gives_up(c in a_case(), share in 0.3f64..0.95, n in 1usize..=7) {
        let c = across_nodes(c, share, n);
        let n = n.min(c.profile.n_layers());
        let p = Problem::with_cpu_moe(&c.inv, &c.profile, &c.policy, c.policy.ctx, n).unwrap();
        let obj = match c.policy.objective {
            Objective::MaxContext => Objective::Latency,
            o => o,
        };
        let all = all_metrics(&p);
        let t_lat = all.iter().map(|m| m.decode_s).min_by(f64::total_cmp);
        let want = t_lat.and_then(|t| best_among(&all, &c.policy, t));
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-12);
        for compared in [0, 10, 100, 1000, 10_000, usize::MAX] {
            let budget = brigade_planner::across::Budget { labels: usize::MAX, compared };
            let found = brigade_planner::search::solve_across_within(&p, &c.policy, obj, budget);
            if compared == usize::MAX {
                prop_assert_eq!(found.is_some(), want.is_some());
            }
            let Some(sol) = found else { continue };
            prop_assert!(p.evaluate(&sol.stages).is_some());
            prop_assert!(sol.exact || compared < usize::MAX);
            let got = brigade_planner::search::objective_value(obj, &sol.metrics);
            if obj == Objective::Energy {
                let (t, bound) = (t_lat.unwrap(), sol.latency_bound_s.unwrap());
                prop_assert!(bound >= t * (1.0 - 1e-9) && sol.metrics.decode_s <= bound * c.policy.slack * (1.0 + 1e-9));
                let floor = best_among(&all, &c.policy, bound).unwrap();
                prop_assert!(got >= floor - 1e-9 * floor.abs(), "{got} below {floor}");
            } else {
                prop_assert!(got >= want.unwrap() - 1e-9 * want.unwrap().abs(), "{got} beats {want:?}");
            }
            prop_assert!(!sol.exact || close(got, want.unwrap()), "{got} against {want:?} at {compared}");
        }
    }
}

/// The same on 400 cases drawn with a fixed seed, most of them with a placement that fits (the
/// reservation heuristic alone, before the exact program: 386 optimal, 7 worse, 1 missed, 6
/// where nothing fits).
#[test]
fn split_layers_across_nodes_optimal_on_400_cases() {
    use proptest::strategy::{Strategy, ValueTree};
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (a_case(), 0.3f64..0.95, 1usize..=7);
    let mut count = std::collections::HashMap::new();
    for _ in 0..400 {
        let (c, share, n) = strategy.new_tree(&mut runner).unwrap().current();
        let c = across_nodes(c, share, n);
        match check_across(&c) {
            Ok(fits) => *count.entry(fits).or_insert(0) += 1,
            Err(e) => panic!("{e}\n{c:?}"),
        }
    }
    eprintln!("across nodes, 400 cases: {count:?}");
    assert!(count.get(&Fits::Optimal).copied().unwrap_or(0) >= 350, "{count:?}");
}
