//! What this node computes with, measured: the CPU's read bandwidth and, for each weight type a
//! model may come in, the speed of brigade's own kernels — a one-row matrix-vector product (decode)
//! and a 64-row matrix product (prompt) over a weight too large for the caches. A generic f32
//! matmul probe would overstate a 2-core CPU's Q4_K decode rate by 2–3×; the planner's predictions
//! are only as good as these numbers.
//!
//! Measuring takes a few seconds, so the figures are kept in the data dir and reused while the
//! CPU, the thread count and brigade's version are the same.

use crate::WorkerError;
use brigade_core::cluster::{DeviceFigures, KernelFigures};
use brigade_core::DeviceKind;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How thoroughly to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Effort {
    /// Every weight type, weights of 32–64 MiB, ~60 ms per kernel: what placement should use.
    Full,
    /// The common types on small weights, a few ms each: for tests and demos.
    Quick,
}

impl std::str::FromStr for Effort {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "full" => Ok(Effort::Full),
            "quick" => Ok(Effort::Quick),
            o => Err(format!("unknown measurement effort `{o}` (full, quick)")),
        }
    }
}

const FULL_TYPES: [GgmlDType; 13] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];
const QUICK_TYPES: [GgmlDType; 5] = [GgmlDType::F32, GgmlDType::F16, GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K];

/// brigade's name of a ggml type, as model files and manifests print it.
pub fn type_name(t: GgmlDType) -> &'static str {
    brigade_model::weights::ggml_type(t).name()
}

#[derive(Serialize, Deserialize)]
struct Cached {
    key: String,
    device: DeviceFigures,
}

fn cache_key(cpu: &str, threads: usize, effort: Effort) -> String {
    format!(
        "{}|{threads}|{effort:?}|{}|{}",
        cpu,
        env!("CARGO_PKG_VERSION"),
        std::env::var("BRIGADE_CPU_KERNELS").unwrap_or_default()
    )
}

/// The instruction sets that choose brigade's CPU kernels.
pub fn cpu_features() -> String {
    let mut f = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        for (name, on) in [
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("f16c", std::arch::is_x86_feature_detected!("f16c")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
            ("avx512bw", std::arch::is_x86_feature_detected!("avx512bw")),
            ("avx512vnni", std::arch::is_x86_feature_detected!("avx512vnni")),
            ("avxvnni", std::arch::is_x86_feature_detected!("avxvnni")),
        ] {
            if on {
                f.push(name);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    f.push("neon");
    f.join(" ")
}

/// A random weight of `n × k` in type `t`: `rows` rows quantized, repeated to fill `n` (quantizing
/// all of it would take longer than timing it).
fn weight(t: GgmlDType, n: usize, k: usize) -> Result<Arc<QTensor>, WorkerError> {
    let rows = n.min(256);
    let src = Tensor::randn(0f32, 1f32, (rows, k), &Device::Cpu)?;
    let q = QTensor::quantize(&src, t)?;
    let block = q.data()?;
    let mut bytes = Vec::with_capacity(block.len() * n.div_ceil(rows));
    while bytes.len() < block.len() * (n / rows) {
        bytes.extend_from_slice(&block);
    }
    let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, t)?;
    Ok(Arc::new(QTensor::new(storage, (rows * (n / rows), k))?))
}

/// Mean seconds of `f` over repetitions filling at least `budget` (after one warm-up run).
fn time(budget: Duration, mut f: impl FnMut() -> Result<(), WorkerError>) -> Result<f64, WorkerError> {
    f()?;
    let t0 = Instant::now();
    let mut n = 0u32;
    while n < 2 || t0.elapsed() < budget {
        f()?;
        n += 1;
    }
    Ok(t0.elapsed().as_secs_f64() / f64::from(n))
}

fn kernel_rates(t: GgmlDType, effort: Effort) -> Result<KernelFigures, WorkerError> {
    let (n, k, budget) = match (effort, t) {
        (Effort::Quick, _) => (1024, 1024, Duration::from_millis(5)),
        (Effort::Full, GgmlDType::F32) => (2048, 4096, Duration::from_millis(60)),
        (Effort::Full, _) => (4096, 4096, Duration::from_millis(60)),
    };
    let w = weight(t, n, k)?;
    let bytes = w.storage_size_in_bytes() as f64;
    let n = w.shape().dims()[0];
    let op = brigade_model::cpu_matmul::CpuMatMul(w);
    let x1 = Tensor::randn(0f32, 1f32, (1, k), &Device::Cpu)?;
    let decode = time(budget, || {
        x1.apply_op1_no_bwd(&op)?;
        Ok(())
    })?;
    let rows = 64;
    let xp = Tensor::randn(0f32, 1f32, (rows, k), &Device::Cpu)?;
    let prompt = time(budget, || {
        xp.apply_op1_no_bwd(&op)?;
        Ok(())
    })?;
    Ok(KernelFigures {
        weight_type: type_name(t).to_string(),
        decode_bytes_per_s: bytes / decode,
        prompt_flops: 2.0 * (rows * n * k) as f64 / prompt,
    })
}

/// Measures the CPU (or reads the figures measured before from `cache_dir`). `memory_cap` limits
/// the memory this node offers (0 = what the OS says is available).
pub fn measure_cpu(
    threads: usize,
    effort: Effort,
    memory_cap: u64,
    cache_dir: Option<&Path>,
) -> Result<DeviceFigures, WorkerError> {
    let info = brigade_model::devices::cpu_info();
    let key = cache_key(&info.name, threads, effort);
    let cache = cache_dir.map(|d| d.join("figures.json"));
    let offered = if memory_cap > 0 { memory_cap.min(info.memory_available) } else { info.memory_available };
    if let Some(p) = &cache {
        if let Ok(text) = std::fs::read_to_string(p) {
            if let Ok(c) = serde_json::from_str::<Cached>(&text) {
                if c.key == key {
                    tracing::info!("device figures from {}", p.display());
                    return Ok(DeviceFigures { memory_free: offered, memory_total: info.memory_total, ..c.device });
                }
            }
        }
    }
    let t0 = Instant::now();
    let bw_bytes = match effort {
        Effort::Full => 256 << 20,
        Effort::Quick => 32 << 20,
    };
    let mem_bandwidth = brigade_model::bandwidth::read_bandwidth(bw_bytes, threads, 3);
    let types: &[GgmlDType] = match effort {
        Effort::Full => &FULL_TYPES,
        Effort::Quick => &QUICK_TYPES,
    };
    let mut kernels = Vec::with_capacity(types.len());
    for &t in types {
        kernels.push(kernel_rates(t, effort)?);
    }
    let flops = kernels.iter().map(|k| k.prompt_flops).fold(0.0, f64::max);
    let dev = DeviceFigures {
        name: "cpu".into(),
        kind: DeviceKind::Cpu,
        model: info.name.clone(),
        memory_total: info.memory_total,
        memory_free: offered,
        mem_bandwidth,
        flops,
        kernels,
        threads: threads as u32,
        features: cpu_features(),
        host_link: None,
    };
    tracing::info!(
        "measured the CPU in {:.1}s: read {:.1} GB/s, {}",
        t0.elapsed().as_secs_f64(),
        mem_bandwidth / 1e9,
        dev.kernels
            .iter()
            .map(|k| format!("{} {:.1} GB/s", k.weight_type, k.decode_bytes_per_s / 1e9))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(p) = &cache {
        let c = Cached { key, device: dev.clone() };
        if let Ok(text) = serde_json::to_string_pretty(&c) {
            let _ = std::fs::write(p, text);
        }
    }
    Ok(dev)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn quick_measurement_is_plausible_and_cached() {
        let dir = tempfile::tempdir().unwrap();
        let d = measure_cpu(1, Effort::Quick, 1 << 30, Some(dir.path())).unwrap();
        assert_eq!(d.memory_free, 1 << 30);
        assert_eq!(d.kernels.len(), QUICK_TYPES.len());
        for k in &d.kernels {
            // anything between 10 MB/s and 1 TB/s is a measurement; zero or inf is a bug
            assert!(k.decode_bytes_per_s > 1e7 && k.decode_bytes_per_s < 1e12, "{k:?}");
            assert!(k.prompt_flops > 1e7 && k.prompt_flops < 1e13, "{k:?}");
        }
        assert!(d.mem_bandwidth > 1e8);
        let again = measure_cpu(1, Effort::Quick, 2 << 30, Some(dir.path())).unwrap();
        // read back from the cache (JSON keeps the numbers to their last digit or so)
        assert_eq!(again.kernels.len(), d.kernels.len());
        for (a, b) in again.kernels.iter().zip(&d.kernels) {
            assert_eq!(a.weight_type, b.weight_type);
            assert!((a.decode_bytes_per_s / b.decode_bytes_per_s - 1.0).abs() < 1e-9, "{a:?} {b:?}");
        }
        assert_eq!(again.memory_free, 2 << 30, "memory is never cached");
    }
}
