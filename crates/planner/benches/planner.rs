//! `cargo bench -p brigade-planner`: planning time on the 100-node cluster with 128 layers, the
//! heuristic's gap to the exact optimum on random clusters of 9–12 devices, and planning time
//! for split layers across nodes (the exact program of `across.rs`) on two to four GPU boxes.
#![allow(clippy::unwrap_used)]

use brigade_core::{
    bits_per_weight, DeviceKind, DeviceSpec, Inventory, Link, LinkSpec, LlamaShape, ModelProfile, MoeShape, NodeSpec,
};
use brigade_planner::cost::Problem;
use brigade_planner::search::{objective_value, reserve_heuristic, solve, solve_exhaustive};
use brigade_planner::{parse_cluster, plan, Objective, Policy};
use std::time::Instant;

fn model_128() -> ModelProfile {
    let mut m = ModelProfile::from_shape(
        "llama-70b f16 ×128 layers",
        &LlamaShape::preset("llama-70b").unwrap(),
        bits_per_weight("f16").unwrap(),
        2,
    );
    m.layer_bytes = (0..128).map(|i| m.layer_bytes[i % 80]).collect();
    m.layer_flops = (0..128).map(|i| m.layer_flops[i % 80]).collect();
    m
}

fn timing() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/clusters/hundred-nodes.toml"))
            .unwrap();
    let inv = parse_cluster(&text).unwrap();
    let m = model_128();
    for obj in [Objective::Latency, Objective::Throughput] {
        let policy = Policy { objective: obj, sessions: 4, ..Policy::default() };
        let _ = plan(&inv, &m, &policy).unwrap();
        let n = 5;
        let t0 = Instant::now();
        for _ in 0..n {
            std::hint::black_box(plan(&inv, &m, &policy).unwrap());
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / n as f64;
        println!(
            "plan: 100 nodes / {} devices, 128 layers, objective {obj}: {ms:.1} ms per plan (mean of {n})",
            inv.n_devices()
        );
    }
}

fn random_cluster(seed: u64, n_dev: usize) -> Inventory {
    let mut r = seed;
    let mut next = move || {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        (r >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut nodes = Vec::new();
    let mut left = n_dev;
    let mut i = 0;
    while left > 0 {
        let gpus = ((next() * 3.0) as usize).min(left - 1);
        let mut devs = vec![DeviceSpec {
            name: "cpu".into(),
            kind: DeviceKind::Cpu,
            memory: ((8.0 + 56.0 * next()) * 1e9) as u64,
            mem_bandwidth: (20.0 + 60.0 * next()) * 1e9,
            flops: (0.3 + 2.0 * next()) * 1e12,
            watts: Some(100.0),
            host_link: None,
        }];
        for g in 0..gpus {
            devs.push(DeviceSpec {
                name: format!("cuda{g}"),
                kind: DeviceKind::Cuda,
                memory: ((4.0 + 44.0 * next()) * 1e9) as u64,
                mem_bandwidth: (200.0 + 2000.0 * next()) * 1e9,
                flops: (10.0 + 200.0 * next()) * 1e12,
                watts: Some(300.0),
                host_link: Some(Link { bandwidth: 25e9, latency: 1e-5 }),
            });
        }
        left -= devs.len();
        nodes.push(NodeSpec { name: format!("n{i}"), devices: devs });
        i += 1;
    }
    let mut links = Vec::new();
    for a in 0..nodes.len() {
        for b in a + 1..nodes.len() {
            if next() < 0.7 {
                links.push(LinkSpec {
                    a: format!("n{a}"),
                    b: format!("n{b}"),
                    link: Link { bandwidth: (0.05 + 2.0 * next()) * 1e9, latency: 1e-4 + 2e-3 * next() },
                });
            }
        }
    }
    Inventory { nodes, links }
}

fn gap() {
    let m = ModelProfile::from_shape("llama-70b q4_k", &LlamaShape::preset("llama-70b").unwrap(), 4.5, 2);
    for obj in [Objective::Latency, Objective::Throughput] {
        for n_dev in 9..=12 {
            let (mut worst, mut sum, mut count, mut optimal, mut t_h, mut t_e) = (0.0f64, 0.0, 0, 0, 0.0, 0.0);
            for seed in 1..=20u64 {
                let inv = random_cluster(seed * 7919 + n_dev as u64, n_dev);
                let policy = Policy { objective: obj, sessions: 4, ..Policy::default() };
                let p = Problem::new(&inv, &m, &policy, policy.ctx).unwrap();
                let t0 = Instant::now();
                let h = solve(&p, &policy, obj);
                t_h += t0.elapsed().as_secs_f64();
                let t0 = Instant::now();
                let e = solve_exhaustive(&p, &policy, obj);
                t_e += t0.elapsed().as_secs_f64();
                let (Some(h), Some(e)) = (h, e) else { continue };
                let (hv, ev) = (objective_value(obj, &h.metrics), objective_value(obj, &e.metrics));
                let g = (hv - ev).abs() / ev.abs();
                worst = worst.max(g);
                sum += g;
                count += 1;
                if g < 1e-9 {
                    optimal += 1;
                }
            }
            println!(
                "heuristic gap, {obj}, {n_dev} devices: mean {:.2}%, worst {:.2}%, optimal in {optimal}/{count}; time heuristic {:.1} ms, exact {:.1} ms per plan",
                100.0 * sum / count.max(1) as f64,
                100.0 * worst,
                1e3 * t_h / 20.0,
                1e3 * t_e / 20.0
            );
        }
    }
}

/// `boxes` copies of `examples/clusters/two-gpu-boxes.toml`'s box (an RTX 4090 and 96 GiB of
/// RAM), every pair linked at 10 Gbit/s.
fn gpu_boxes(boxes: usize) -> Inventory {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/clusters/two-gpu-boxes.toml"))
            .unwrap();
    let two = parse_cluster(&text).unwrap();
    let nodes: Vec<NodeSpec> =
        (0..boxes).map(|i| NodeSpec { name: format!("box-{i}"), devices: two.nodes[0].devices.clone() }).collect();
    let mut links = Vec::new();
    for a in 0..boxes {
        for b in a + 1..boxes {
            links.push(LinkSpec { a: format!("box-{a}"), b: format!("box-{b}"), link: two.links[0].link });
        }
    }
    Inventory { nodes, links }
}

fn across() {
    let shape = MoeShape::preset("qwen3-235b-a22b").unwrap();
    let m = ModelProfile::from_moe_shape("qwen3-235b-a22b q4_k", &shape, bits_per_weight("q4_k").unwrap(), 2);
    for boxes in [2, 3, 4] {
        let inv = gpu_boxes(boxes);
        for obj in [Objective::Latency, Objective::Throughput, Objective::Energy] {
            for cpu_moe in [brigade_planner::CpuMoe::Layers(40), brigade_planner::CpuMoe::Auto] {
                let policy = Policy { objective: obj, sessions: 4, cpu_moe, ..Policy::default() };
                let t0 = Instant::now();
                let r = plan(&inv, &m, &policy);
                let s = t0.elapsed().as_secs_f64();
                let what = match &r {
                    Ok(p) => format!(
                        "--n-cpu-moe {}, {:.2} tokens/s, {}",
                        p.cpu_moe,
                        match obj {
                            Objective::Throughput => p.throughput_tokens_per_s,
                            _ => 1e3 / p.decode_ms_per_token,
                        },
                        if p.exact { "exact".to_string() } else { format!("heuristic {:?}", p.heuristic) }
                    ),
                    Err(e) => format!("{e}"),
                };
                // the reservation heuristic alone, on the same split
                let heuristic = match (&r, cpu_moe) {
                    (Ok(pl), brigade_planner::CpuMoe::Layers(n)) => {
                        let p = Problem::with_cpu_moe(&inv, &m, &policy, policy.ctx, n).unwrap();
                        let t0 = Instant::now();
                        let h = reserve_heuristic(&p, &policy, obj);
                        let hs = t0.elapsed().as_secs_f64();
                        let v = h.map(|h| objective_value(obj, &h.metrics));
                        let want = match obj {
                            Objective::Throughput => -pl.throughput_tokens_per_s,
                            Objective::Energy => pl.energy_j_per_token.unwrap_or(f64::NAN),
                            _ => pl.decode_ms_per_token / 1e3,
                        };
                        format!("; the heuristic alone {hs:.2} s, objective {v:?} against the plan's {want:.6}")
                    }
                    _ => String::new(),
                };
                println!("split layers across {boxes} GPU boxes, {obj}, {cpu_moe:?}: {s:.2} s ({what}){heuristic}");
            }
        }
    }
}

fn main() {
    across();
    timing();
    gap();
}
