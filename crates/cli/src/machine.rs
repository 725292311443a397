//! This box as the planner sees it, measured: the CPU's kernels and read bandwidth with the
//! threads this process computes with, each CUDA device's copy bandwidth and matmul rate (all
//! from `brigade_model::measure`, cached in `~/.cache/brigade/figures.json`), the memory free now.
//! `-ngl auto`, `plan` without `--cluster` and `bench`'s predicted t/s read it; the speed on a
//! model comes from the same rule the coordinator applies to workers' devices
//! ([`brigade_coordinator::placement::device_spec`]).

use anyhow::{Context, Result};
use brigade_coordinator::placement::device_spec;
use brigade_core::cluster::DeviceFigures;
use brigade_core::{DeviceId, Inventory, ModelProfile, NodeSpec, Stage};
use brigade_model::device::kv_elem_bytes;
use brigade_model::devices::CudaInfo;
use brigade_model::measure::{measure_cpu, measure_cuda, Effort};
use brigade_model::ModelFiles;
use brigade_planner::cost::Problem;
use brigade_planner::Policy;

/// The measured devices of this box.
#[derive(Debug, Clone)]
pub struct Machine {
    pub cpu: DeviceFigures,
    pub gpus: Vec<DeviceFigures>,
}

impl Machine {
    /// Measures (or reads from the cache) the CPU with this process's compute threads and each
    /// GPU of `gpus`.
    pub fn measure(gpus: &[CudaInfo], effort: Effort) -> Result<Machine> {
        let cache = brigade_model::measure::default_cache_dir();
        let threads = brigade_model::threads::current();
        let cpu = measure_cpu(threads, effort, 0, cache.as_deref()).context("measuring this machine's CPU")?;
        let gpus = gpus
            .iter()
            .map(|g| measure_cuda(g.ordinal, effort, cache.as_deref()))
            .collect::<Result<_, _>>()
            .context("measuring this machine's GPUs")?;
        Ok(Machine { cpu, gpus })
    }

    /// The planner's inventory for a model of `weight_types` (name, bytes): the CPU at its
    /// kernels' rates on those types and the memory available now; each GPU at its measured copy
    /// bandwidth and matmul rate and its free memory.
    pub fn inventory(&self, weight_types: &[(String, u64)]) -> Inventory {
        let devices = std::iter::once(&self.cpu).chain(&self.gpus).map(|d| device_spec(d, weight_types)).collect();
        Inventory { nodes: vec![NodeSpec { name: "local".into(), devices }], links: Vec::new() }
    }
}

/// A model's weight types by bytes, named as the measured kernels are.
pub fn weight_types(files: &ModelFiles) -> Vec<(String, u64)> {
    files.weight_types().into_iter().map(|(t, b)| (t.name().to_string(), b)).collect()
}

/// The planner's profile of a model on this box: bytes as a GPU holds them (dense weights in its
/// activation type), the KV cache in a GPU's activation type and, on the CPU, in f32, as the
/// runtime allocates them.
pub fn profile(files: &ModelFiles) -> ModelProfile {
    let gpu = DeviceId::Cuda(0);
    let mut p =
        files.device_profile(kv_elem_bytes(gpu, files), false, brigade_model::device::activation_dtype(gpu, files));
    p.cpu_kv_bytes_per_token = Some(files.config.kv_bytes_per_token_layer(kv_elem_bytes(DeviceId::Cpu, files)));
    p
}

/// What the cost model predicts for a placement on this box.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Prediction {
    /// Decoded tokens per second.
    pub decode_tps: f64,
    /// Prompt tokens per second for a prompt of the given length.
    pub prefill_tps: Option<f64>,
}

/// The cost model's figures for `stages` (a placement of this box's devices): decode `1 / T` with
/// `T` the sum of the stages' times and the hops between them, and the prefill rate of a prompt
/// of `prompt` tokens. `None` when a stage names a device the inventory lacks.
pub fn predict(
    inv: &Inventory,
    profile: &ModelProfile,
    stages: &[Stage],
    n_ctx: usize,
    cpu_moe: usize,
    prompt: Option<usize>,
) -> Option<Prediction> {
    let policy = Policy { ctx: n_ctx as u64, headroom: 0.0, ..Policy::default() };
    let problem = Problem::with_cpu_moe(inv, profile, &policy, n_ctx as u64, cpu_moe).ok()?;
    let mut idx = Vec::with_capacity(stages.len());
    for s in stages {
        let name = s.device.to_string();
        let d = problem.devs.iter().position(|x| x.name == name)?;
        idx.push((d, s.layers.start(), s.layers.end()));
    }
    let stage_s: f64 = idx.iter().map(|&(d, a, b)| problem.stage_time(d, a, b)).sum();
    let hop_s: f64 = idx.windows(2).map(|w| problem.hop[w[0].0][w[1].0].unwrap_or(0.0)).sum();
    let prefill_tps = prompt.and_then(|p| Some(p as f64 / problem.prefill(&idx, p)?.max(1e-12)));
    Some(Prediction { decode_tps: 1.0 / (stage_s + hop_s).max(1e-12), prefill_tps })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub mod tests {
    use super::*;
    use brigade_core::cluster::KernelFigures;
    use brigade_core::{DeviceKind, LayerRange};

    /// A machine with made-up figures: a CPU whose f32 kernels decode at 10 GB/s, and GPUs.
    pub fn fake_machine(gpu_free: &[u64]) -> Machine {
        let fig = |name: String, kind, free: u64, bw: f64, flops: f64| DeviceFigures {
            name,
            kind,
            model: "test".into(),
            memory_total: free,
            memory_free: free,
            mem_bandwidth: bw,
            flops,
            kernels: Vec::new(),
            threads: 1,
            features: String::new(),
            host_link: None,
        };
        let mut cpu = fig("cpu".into(), DeviceKind::Cpu, 64 << 30, 20e9, 1e11);
        cpu.kernels.push(KernelFigures { weight_type: "f32".into(), decode_bytes_per_s: 10e9, prompt_flops: 2e11 });
        let gpus = gpu_free
            .iter()
            .enumerate()
            .map(|(i, &f)| fig(format!("cuda{i}"), DeviceKind::Cuda, f, 1e12, 1e14))
            .collect();
        Machine { cpu, gpus }
    }

    #[test]
    fn inventory_and_prediction_use_the_measured_figures() {
        let files = crate::common::open_model(None).unwrap();
        let types = weight_types(&files);
        assert_eq!(types[0].0, "f32", "the embedded model is f32: {types:?}");
        let m = fake_machine(&[1 << 30]);
        let inv = m.inventory(&types);
        let cpu = &inv.nodes[0].devices[0];
        // every weight is f32: the CPU decodes at its f32 kernel's rate, not a constant
        assert!((cpu.mem_bandwidth - 10e9).abs() < 1.0, "{cpu:?}");
        assert!((cpu.flops - 2e11).abs() < 1.0);
        assert_eq!(inv.nodes[0].devices[1].mem_bandwidth, 1e12);
        let p = profile(&files);
        let kv = files.config.kv_bytes_per_token_layer(4);
        assert_eq!(p.cpu_kv_bytes_per_token, Some(kv), "the CPU's cache is f32");
        // one CPU stage: T = Σ max(bytes / 10 GB/s, flops / 200 Gflop/s) over layers and head
        let n = files.config.n_layers;
        let stages = [Stage { device: DeviceId::Cpu, layers: LayerRange::new(0, n).unwrap() }];
        let pred = predict(&inv, &p, &stages, 64, 0, Some(16)).unwrap();
        let t: f64 = (0..n).map(|l| (p.layer_bytes[l] as f64 / 10e9).max(p.layer_flops[l] / 2e11)).sum::<f64>()
            + (p.head_bytes as f64 / 10e9).max(p.head_flops / 2e11);
        assert!((pred.decode_tps * t - 1.0).abs() < 1e-9, "{pred:?} vs {}", 1.0 / t);
        assert!(pred.prefill_tps.unwrap() > 0.0);
        // a GPU stage the inventory lacks predicts nothing
        let on_gpu1 = [Stage { device: DeviceId::Cuda(1), layers: LayerRange::new(0, n).unwrap() }];
        assert!(predict(&inv, &p, &on_gpu1, 64, 0, None).is_none());
    }
}
