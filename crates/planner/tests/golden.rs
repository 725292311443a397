//! Golden plans: the planner's text output for the example clusters, approved and reviewed in
//! diffs. Regenerate with `BRIGADE_BLESS=1 cargo test -p brigade-planner --test golden`.
//! The scenario tests below check the same plans' substance, not just their text.
#![allow(clippy::unwrap_used)]

use brigade_core::{bits_per_weight, LlamaShape, ModelProfile, MoeShape};
use brigade_planner::{parse_cluster, plan, plan_with_second, CpuMoe, Inventory, Objective, Plan, Policy};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cluster(name: &str) -> Inventory {
    let text = std::fs::read_to_string(root().join("examples/clusters").join(format!("{name}.toml"))).unwrap();
    parse_cluster(&text).unwrap()
}

fn model(shape: &str, quant: &str) -> ModelProfile {
    if let Some(moe) = MoeShape::preset(shape) {
        return ModelProfile::from_moe_shape(&format!("{shape} {quant}"), &moe, bits_per_weight(quant).unwrap(), 2);
    }
    ModelProfile::from_shape(
        &format!("{shape} {quant}"),
        &LlamaShape::preset(shape).unwrap(),
        bits_per_weight(quant).unwrap(),
        2,
    )
}

struct Case {
    name: &'static str,
    cluster: &'static str,
    shape: &'static str,
    quant: &'static str,
    flags: &'static str,
    policy: Policy,
    also: Option<(&'static str, &'static str)>,
}

fn cases() -> Vec<Case> {
    let p = Policy::default;
    let c =
        |name, cluster, shape, quant, flags, policy, also| Case { name, cluster, shape, quant, flags, policy, also };
    vec![
        c("fits-in-vram", "single-box", "llama-8b", "q4_k", "", p(), None),
        c("moe-split-layers", "single-box", "qwen3-30b-a3b", "q8_0", "", p(), None),
        c("larger-than-vram", "single-box", "llama-70b", "q4_k", "", p(), None),
        c("small-vram", "small-vram", "llama-8b", "q4_k", "", p(), None),
        c("tiny-vram", "tiny-vram", "llama-70b", "q4_k", "", p(), None),
        c("two-gpus-unequal", "two-gpus-unequal", "llama-70b", "q4_k", "", p(), None),
        c("gateway-edges", "gateway-edges", "llama-70b", "q4_k", "", p(), None),
        c(
            "gateway-edges-throughput",
            "gateway-edges",
            "llama-70b",
            "q4_k",
            "--objective throughput --sessions 8",
            Policy { objective: Objective::Throughput, sessions: 8, ..p() },
            None,
        ),
        c(
            "moe-split-across-nodes",
            "two-gpu-boxes",
            "qwen3-235b-a22b",
            "q4_k",
            "--n-cpu-moe 40",
            Policy { cpu_moe: CpuMoe::Layers(40), ..p() },
            None,
        ),
        c("moe-split-across-nodes-searched", "two-gpu-boxes", "qwen3-235b-a22b", "q4_k", "", p(), None),
        c("wifi-avoided", "wifi", "llama-8b", "q4_k", "", p(), None),
        c("fast-behind-slow-link", "fast-behind-slow-link", "llama-70b", "q4_k", "", p(), None),
        c("hundred-nodes", "hundred-nodes", "llama-70b", "f16", "", p(), None),
        c(
            "energy-cap",
            "single-box",
            "llama-8b",
            "q4_k",
            "--max-watts 250",
            Policy { max_watts: Some(250.0), ..p() },
            None,
        ),
        c(
            "energy-objective",
            "gateway-edges",
            "llama-70b",
            "q4_k",
            "--objective energy",
            Policy { objective: Objective::Energy, ..p() },
            None,
        ),
        c(
            "max-context",
            "single-box",
            "llama-8b",
            "f16",
            "--objective max-context",
            Policy { objective: Objective::MaxContext, ..p() },
            None,
        ),
        c(
            "two-models",
            "single-box",
            "llama-70b",
            "q4_k",
            "--also-shape llama-1b --also-quant q8_0",
            p(),
            Some(("llama-1b", "q8_0")),
        ),
    ]
}

fn run(case: &Case) -> (Plan, Option<Plan>) {
    let inv = cluster(case.cluster);
    let main = model(case.shape, case.quant);
    match case.also {
        None => (plan(&inv, &main, &case.policy).unwrap(), None),
        Some((s, q)) => {
            let (a, b) = plan_with_second(&inv, &main, &model(s, q), &case.policy).unwrap();
            (a, Some(b))
        }
    }
}

#[test]
fn golden_plans() {
    let bless = std::env::var_os("BRIGADE_BLESS").is_some();
    let mut failures = Vec::new();
    for case in cases() {
        let (main, second) = run(&case);
        let mut text = format!(
            "# brigade plan --shape {} --quant {} --cluster examples/clusters/{}.toml {}\n",
            case.shape, case.quant, case.cluster, case.flags
        );
        text.push_str(&main.to_text());
        if let Some(s) = second {
            text.push('\n');
            text.push_str(&s.to_text());
        }
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(format!("{}.txt", case.name));
        if bless {
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(want) if want == text => {}
            Ok(want) => failures.push(format!("{}: differs\n--- approved\n{want}\n--- now\n{text}", case.name)),
            Err(_) => {
                failures.push(format!("{}: no approved file {} (run with BRIGADE_BLESS=1)", case.name, path.display()))
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn gpu_layers(p: &Plan) -> usize {
    p.stages.iter().filter(|s| s.device.starts_with("cuda")).map(|s| s.layers.1 - s.layers.0).sum()
}

#[test]
fn scenario_model_fits_in_vram_runs_all_on_the_gpu() {
    let (p, _) = run(&cases().into_iter().find(|c| c.name == "fits-in-vram").unwrap());
    assert_eq!(p.stages.len(), 1);
    assert_eq!(p.stages[0].device, "cuda0");
    assert!(p.rejected.iter().any(|r| r.alternative == "all on box/cpu"));
}

#[test]
fn scenario_model_larger_than_vram_is_hybrid() {
    let (p, _) = run(&cases().into_iter().find(|c| c.name == "larger-than-vram").unwrap());
    assert_eq!(p.stages.len(), 2);
    let gpu = p.stages.iter().find(|s| s.device == "cuda0").unwrap();
    // the GPU is filled: one more layer would not fit
    assert!(gpu.reason.contains("would not fit"), "{}", gpu.reason);
    assert!(p.stages.iter().any(|s| s.device == "cpu"));
    let r = p.rejected.iter().find(|r| r.alternative == "all on box/cuda0").unwrap();
    assert!(r.shortfall_bytes.unwrap() > 10 << 30, "{r:?}");
}

#[test]
fn scenario_very_little_vram_runs_on_the_cpu() {
    let (p, _) = run(&cases().into_iter().find(|c| c.name == "tiny-vram").unwrap());
    assert_eq!(gpu_layers(&p), 0);
    assert_eq!(p.stages.len(), 1);
}

#[test]
fn scenario_two_models_share_the_gpu() {
    let (big, small) = run(&cases().into_iter().find(|c| c.name == "two-models").unwrap());
    let small = small.unwrap();
    assert_eq!(small.stages.len(), 1);
    assert_eq!(small.stages[0].device, "cuda0");
    assert_eq!(big.reserved.len(), 1);
    let reserved = big.reserved[0].bytes;
    assert_eq!(reserved, small.stages[0].memory_bytes);
    let gpu = big.stages.iter().find(|s| s.device == "cuda0").unwrap();
    // both models' memory counted on the GPU
    assert!(gpu.memory_bytes + reserved <= (24u64 << 30) * 9 / 10);
    let (alone, _) = run(&cases().into_iter().find(|c| c.name == "larger-than-vram").unwrap());
    assert!(gpu_layers(&big) < gpu_layers(&alone));
}

#[test]
fn scenario_energy_cap_gives_a_conservative_hybrid() {
    let (capped, _) = run(&cases().into_iter().find(|c| c.name == "energy-cap").unwrap());
    let (free, _) = run(&cases().into_iter().find(|c| c.name == "fits-in-vram").unwrap());
    assert!(capped.avg_watts.unwrap() <= 250.0 + 1e-9);
    assert!(free.avg_watts.unwrap() > 250.0);
    assert!(
        gpu_layers(&capped) > 0 && gpu_layers(&capped) < gpu_layers(&free),
        "{} vs {}",
        gpu_layers(&capped),
        gpu_layers(&free)
    );
}

#[test]
fn scenario_slow_wifi_is_avoided() {
    let (p, _) = run(&cases().into_iter().find(|c| c.name == "wifi-avoided").unwrap());
    assert!(p.stages.iter().all(|s| s.node != "den"), "{}", p.to_text());
}

#[test]
fn throughput_balances_the_pipeline() {
    let (t, _) = run(&cases().into_iter().find(|c| c.name == "gateway-edges-throughput").unwrap());
    let (l, _) = run(&cases().into_iter().find(|c| c.name == "gateway-edges").unwrap());
    assert!(t.throughput_tokens_per_s >= l.throughput_tokens_per_s * (1.0 - 1e-12));
}

#[test]
fn hundred_nodes_plan_fast() {
    let inv = cluster("hundred-nodes");
    assert_eq!(inv.nodes.len(), 100);
    // 128 layers: a 70B-sized layer stack stretched to the size
    let mut m = model("llama-70b", "f16");
    m.layer_bytes = (0..128).map(|i| m.layer_bytes[i % 80]).collect();
    m.layer_flops = (0..128).map(|i| m.layer_flops[i % 80]).collect();
    let t0 = std::time::Instant::now();
    let p = plan(&inv, &m, &Policy::default()).unwrap();
    let dt = t0.elapsed();
    assert!(!p.exact);
    assert_eq!(p.stages.last().unwrap().layers.1, 128);
    // generous here (debug build, shared CI machine); `cargo bench -p brigade-planner` reports release timings
    assert!(dt.as_secs_f64() < 5.0, "{dt:?}");
}

/// Qwen3-30B-A3B at Q8_0 (32 GB) on a 24 GB GPU: whole layers leave 14 of 48 on the CPU; split
/// layers keep every layer's attention on the GPU with the experts of the first N in RAM, and
/// are faster. A split layer's time is, by hand from the cluster file: its dense part at the
/// GPU's bandwidth, the 8 of 128 experts a token reads at the CPU's, and the hidden row to the
/// host and back over the 25 GB/s, 10 µs link.
#[test]
fn scenario_a_mixture_keeps_its_experts_in_ram() {
    let (p, _) = run(&cases().into_iter().find(|c| c.name == "moe-split-layers").unwrap());
    let inv = cluster("single-box");
    let m = model("qwen3-30b-a3b", "q8_0");
    let whole = plan(&inv, &m, &Policy { cpu_moe: brigade_planner::CpuMoe::Layers(0), ..Policy::default() }).unwrap();
    assert!(p.cpu_moe > 0 && whole.cpu_moe == 0);
    assert!(p.tokens_per_s > whole.tokens_per_s * 1.1, "{} vs {}", p.tokens_per_s, whole.tokens_per_s);
    let gpu_layers =
        |q: &Plan| -> usize { q.stages.iter().filter(|s| s.device == "cuda0").map(|s| s.layers.1 - s.layers.0).sum() };
    assert!(gpu_layers(&p) > gpu_layers(&whole) + 10, "{}\n{}", p.to_text(), whole.to_text());
    for s in &p.stages {
        assert!(s.memory_bytes <= s.budget_bytes, "{}", p.to_text());
    }
    // the GPU's budget would not hold its layers with their experts
    let gpu = p.stages.iter().find(|s| s.device == "cuda0").unwrap();
    assert!(gpu.memory_bytes + gpu.host_expert_bytes > gpu.budget_bytes);
    // one split layer by hand
    let pr = brigade_planner::cost::Problem::with_cpu_moe(&inv, &m, &Policy::default(), 4096, 48).unwrap();
    let cuda = pr.devs.iter().position(|d| d.name == "cuda0").unwrap();
    let e = m.moe.as_ref().unwrap().expert_bytes[0] as f64;
    let dense = m.layer_bytes[0] as f64 - e;
    let want = (dense / 1008e9).max((m.layer_flops[0] - m.expert_flops(0)) / 82e12)
        + (e * 8.0 / 128.0 / 60e9).max(m.expert_flops(0) / 2e12)
        + 2.0 * (10e-6 + 2048.0 * 4.0 / 25e9);
    let got = pr.layer_t[cuda][1] - pr.layer_t[cuda][0];
    assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
    // energy: the GPU's watts while it computes, the CPU's (170 W) while it computes the experts
    let pr15 = brigade_planner::cost::Problem::with_cpu_moe(&inv, &m, &Policy::default(), 4096, 15).unwrap();
    let cpu = pr15.devs.iter().position(|d| d.name == "cpu").unwrap();
    let experts_s = 14.0 * (e * 8.0 / 128.0 / 60e9).max(m.expert_flops(0) / 2e12);
    let t = pr15.stage_time(cuda, 1, 48);
    let metrics = pr15.evaluate(&[(cpu, 0, 1), (cuda, 1, 48)]).unwrap();
    let want = 170.0 * pr15.stage_time(cpu, 0, 1) + 450.0 * (t - experts_s) + 170.0 * experts_s;
    assert!((metrics.energy_j.unwrap() - want).abs() < 1e-9 * want, "{:?} vs {want}", metrics.energy_j);
    // many sessions: the CPU computes its own layer and all 15 split layers' experts per token
    let x = experts_s / 14.0;
    let cpu_load = 15.0 * x + (pr15.stage_time(cpu, 0, 1) - x);
    assert!((pr15.stage_load(cpu, 0, 1) - cpu_load).abs() < 1e-12);
    assert_eq!(pr15.stage_load(cuda, 1, 48), t);
    assert_eq!(metrics.bottleneck_s, t.max(cpu_load).max(metrics.hop_s[0]));
    let only_gpu = pr15.evaluate(&[(cuda, 0, 48)]);
    assert!(only_gpu.is_none_or(|m| m.bottleneck_s >= 15.0 * x));
    // RAM too small for the experts asked for: refused with the experts' bytes against the RAM
    let mut small = inv.clone();
    small.nodes[0].devices.iter_mut().filter(|d| d.name == "cpu").for_each(|d| d.memory = 8 << 30);
    let all_in_ram = Policy { cpu_moe: brigade_planner::CpuMoe::Layers(48), ..Policy::default() };
    match plan(&small, &m, &all_in_ram) {
        Err(brigade_planner::PlanError::Infeasible { shortfall_bytes, detail }) => {
            assert!(detail.contains("the experts of layers 0–47 need") && detail.contains("in RAM"), "{detail}");
            let experts: u64 = (0..48).map(|l| m.expert_bytes(l)).sum();
            assert_eq!(shortfall_bytes, experts - (0.9 * (8u64 << 30) as f64).floor() as u64);
        }
        r => panic!("{:?}", r.map(|p| p.to_text())),
    }
    // whole layers: the GPU reads the layer's dense part and its chosen experts
    let pw = brigade_planner::cost::Problem::with_cpu_moe(&inv, &m, &Policy::default(), 4096, 0).unwrap();
    let want = ((dense + e * 8.0 / 128.0) / 1008e9).max(m.layer_flops[0] / 82e12);
    assert!((pw.layer_t[cuda][1] - want).abs() < 1e-9 * want);
}

/// Qwen3-235B-A22B at Q4_K (133 GB) on two boxes, each a 24 GiB GPU and 96 GiB of RAM: with the
/// experts of the first 40 layers in RAM, each box's RAM holds the experts of the layers on its
/// own GPU beside its CPU's own stage, and the pipeline decodes faster than whole layers. Every
/// node's RAM is checked exactly: a GPU whose split layers leave more experts than its box holds
/// does not fit, whatever the other box has free. A third box puts the exact program out of
/// reach: the reservation heuristic plans, and the plan says so.
#[test]
fn scenario_split_layers_across_two_boxes() {
    let (p, _) = run(&cases().into_iter().find(|c| c.name == "moe-split-across-nodes").unwrap());
    let inv = cluster("two-gpu-boxes");
    let m = model("qwen3-235b-a22b", "q4_k");
    assert_eq!(p.cpu_moe, 40);
    // two boxes: the exact program across nodes (brute force checks it in tests/exact.rs)
    assert!(p.exact && p.heuristic.is_none(), "{}", p.to_text());
    let budget = (0.9 * (96u64 << 30) as f64).floor() as u64;
    let mut split = 0;
    for node in ["box-a", "box-b"] {
        let on: Vec<_> = p.stages.iter().filter(|s| s.node == node).collect();
        let own: u64 = on.iter().filter(|s| s.device == "cpu").map(|s| s.memory_bytes).sum();
        let experts: u64 = on.iter().map(|s| s.host_expert_bytes).sum();
        assert!(own + experts <= budget, "{node}: {own} + {experts} of {budget}\n{}", p.to_text());
        for s in on.iter().filter(|s| s.host_layers.is_some()) {
            assert_eq!(s.host_device.as_deref(), Some(format!("{node}/cpu").as_str()));
            let (a, b) = s.host_layers.unwrap();
            assert_eq!(s.host_expert_bytes, (a..b).map(|l| m.expert_bytes(l)).sum::<u64>());
            split += b - a;
        }
    }
    assert!(split > 0, "{}", p.to_text());
    let whole = plan(&inv, &m, &Policy { cpu_moe: CpuMoe::Layers(0), ..Policy::default() }).unwrap();
    assert!(p.tokens_per_s > whole.tokens_per_s * 1.1, "{} vs {}", p.tokens_per_s, whole.tokens_per_s);
    // by hand: every layer split; one GPU alone would leave 119 GiB of experts in its 86.4 GiB
    let pr = brigade_planner::cost::Problem::with_cpu_moe(&inv, &m, &Policy::default(), 4096, 94).unwrap();
    let dev = |node: &str, name: &str| pr.devs.iter().position(|d| d.node_name == node && d.name == name).unwrap();
    let (ga, gb, ca) = (dev("box-a", "cuda0"), dev("box-b", "cuda0"), dev("box-a", "cpu"));
    assert!(pr.across_nodes() && pr.host_of(ga) == Some(ca) && pr.host_of(ca) == Some(ca));
    assert!(pr.evaluate(&[(ga, 0, 94)]).is_none());
    let halves = [(gb, 0, 47), (ga, 47, 94)];
    let metrics = pr.evaluate(&halves).unwrap();
    let uses = pr.host_usage(&halves);
    assert_eq!(uses.len(), 2);
    for u in &uses {
        assert_eq!(u.own_bytes, 0);
        assert!(u.fits() && u.expert_bytes > 50 << 30, "{u:?}");
    }
    // each box's CPU computes its own GPU's experts: the busiest is the slower of the GPU
    // stages (which wait for them) and the two CPUs
    let busiest = uses.iter().map(|u| u.expert_s).fold(0.0, f64::max);
    assert_eq!(metrics.bottleneck_s, busiest.max(metrics.stage_s[0]).max(metrics.stage_s[1]).max(metrics.hop_s[0]));
    assert_eq!(uses.iter().find(|u| u.host == ca).unwrap().expert_s, pr.stage_host_time(ga, 47, 94));
    assert!(brigade_planner::across::within_reach(&pr));
    let three = three_boxes(0);
    let policy = Policy { cpu_moe: CpuMoe::Layers(40), ..Policy::default() };
    let p3 = brigade_planner::cost::Problem::with_cpu_moe(&three, &m, &policy, 4096, 40).unwrap();
    assert!(p3.across_nodes() && !brigade_planner::across::within_reach(&p3));
    let p = plan(&three, &m, &policy).unwrap();
    assert!(!p.exact && p.heuristic.as_deref() == Some("split layers' RAM across nodes"), "{}", p.to_text());
    assert!(p.decode_ms_per_token < 1e3 / 12.0, "three boxes beat two: {}", p.to_text());
}

/// `two-gpu-boxes` with a third box like box-b, each box with `more` GPUs more like its first.
fn three_boxes(more: usize) -> Inventory {
    let mut inv = cluster("two-gpu-boxes");
    let mut c = inv.nodes[1].clone();
    c.name = "box-c".into();
    inv.nodes.push(c);
    for n in &mut inv.nodes {
        for i in 1..=more {
            let mut gpu = n.devices[0].clone();
            gpu.name = format!("cuda{i}");
            n.devices.push(gpu);
        }
    }
    let link = inv.links[0].link;
    for a in ["box-a", "box-b"] {
        inv.links.push(brigade_core::LinkSpec { a: a.into(), b: "box-c".into(), link });
    }
    inv
}

/// Across nodes beyond the exact program's reach, `CpuMoe::Auto` tries every ⌈(L+1)/16⌉-th
/// number of split layers (each costs the heuristic's programs), then those between the best
/// one's neighbours: the plan is at least as good as every grid point's, and near the best.
#[test]
fn a_large_cluster_searches_split_layers_on_a_grid() {
    let mut inv = three_boxes(1);
    assert_eq!(inv.n_devices(), 9);
    let m = model("qwen3-30b-a3b", "q8_0");
    // 48 layers: every 4th of 0..=48
    let grid = brigade_planner::explain::splits_searched(&inv, &m, &Policy::default());
    assert_eq!(grid, (0..=48).step_by(4).collect::<Vec<_>>());
    let p = plan(&inv, &m, &Policy::default()).unwrap();
    assert!(!p.exact, "{}", p.to_text());
    let at = |n: usize| plan(&inv, &m, &Policy { cpu_moe: CpuMoe::Layers(n), ..Policy::default() }).ok();
    let on_grid: Vec<(usize, f64)> = grid.iter().filter_map(|&n| at(n).map(|q| (n, q.decode_ms_per_token))).collect();
    let (best_n, best_ms) = on_grid.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    assert!(p.decode_ms_per_token <= best_ms, "{} ms against the grid's {best_ms}", p.decode_ms_per_token);
    assert!(p.cpu_moe.abs_diff(best_n) < 4, "{} near {best_n}", p.cpu_moe);
    let between =
        (best_n.saturating_sub(3)..=(best_n + 3).min(48)).filter_map(|n| at(n).map(|q| q.decode_ms_per_token));
    assert_eq!(p.decode_ms_per_token, between.fold(f64::INFINITY, f64::min));
    // eight devices across nodes with 48 layers are out of reach too; two boxes are not: every
    // split; asked for: that one
    inv.nodes[2].devices.pop();
    assert_eq!(brigade_planner::explain::splits_searched(&inv, &m, &Policy::default()), grid);
    let two = cluster("two-gpu-boxes");
    assert_eq!(brigade_planner::explain::splits_searched(&two, &m, &Policy::default()), (0..=48).collect::<Vec<_>>());
    let asked = Policy { cpu_moe: CpuMoe::Layers(7), ..Policy::default() };
    assert_eq!(brigade_planner::explain::splits_searched(&inv, &m, &asked), [7]);
}
