//! What this machine computes with, measured: the CPU's read bandwidth and, for each weight type a
//! model may come in, the speed of brigade's own kernels — a one-row matrix-vector product
//! (decode) and a 64-row matrix product (prompt) over a weight too large for the caches; a GPU's
//! copy bandwidth and matmul rate. A generic f32 matmul probe would overstate a 2-core CPU's
//! Q4_K decode rate by 2–3×; the planner's predictions are only as good as these numbers.
//!
//! Workers (for the coordinator's placements) and the CLI (`-ngl auto`, `plan` for this box,
//! `bench`'s predictions, `doctor`) share this measurement. Measuring takes a few seconds, so the
//! figures are kept in a `figures.json` (a worker's data dir, or [`default_cache_dir`]) and reused
//! while the device, the thread count, the effort and brigade's version are the same.

use crate::ModelError;
use brigade_core::cluster::{DeviceFigures, KernelFigures};
use brigade_core::DeviceKind;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
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

const QUICK_TYPES: [GgmlDType; 5] = [GgmlDType::F32, GgmlDType::F16, GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K];

/// The weight types a model's layers may come in, as [`measure_cpu`] measures them at full effort.
pub fn weight_types() -> &'static [GgmlDType] {
    &crate::cpu_matmul::WEIGHT_TYPES
}

/// brigade's name of a ggml type, as model files and manifests print it.
pub fn type_name(t: GgmlDType) -> &'static str {
    crate::weights::ggml_type(t).name()
}

/// The instruction sets this CPU has, of those that choose brigade's kernels (and candle's).
pub fn instruction_sets() -> Vec<&'static str> {
    let mut f = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        for (name, on) in [
            ("sse4.2", std::arch::is_x86_feature_detected!("sse4.2")),
            ("avx", std::arch::is_x86_feature_detected!("avx")),
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("f16c", std::arch::is_x86_feature_detected!("f16c")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
            ("avx512bw", std::arch::is_x86_feature_detected!("avx512bw")),
            ("avx512vl", std::arch::is_x86_feature_detected!("avx512vl")),
            ("avx512vnni", std::arch::is_x86_feature_detected!("avx512vnni")),
            ("avx512bf16", std::arch::is_x86_feature_detected!("avx512bf16")),
            ("avxvnni", std::arch::is_x86_feature_detected!("avxvnni")),
        ] {
            if on {
                f.push(name);
            }
        }
        // the tile unit, where this process may use it (the CPU has it and Linux granted it)
        if crate::cpu_matmul::amx_available() {
            f.push("amx-int8");
        }
    }
    #[cfg(target_arch = "aarch64")]
    f.push("neon");
    f
}

/// [`instruction_sets`], space separated (as device figures carry them).
pub fn cpu_features() -> String {
    instruction_sets().join(" ")
}

/// Where the CLI keeps measured figures: `$XDG_CACHE_HOME/brigade`, else `~/.cache/brigade`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("brigade"))
}

/// The figures file: the last [`CACHE_ENTRIES`] measurements, by key.
#[derive(Serialize, Deserialize, Default)]
struct CacheFile {
    entries: Vec<Cached>,
}

#[derive(Serialize, Deserialize)]
struct Cached {
    key: String,
    device: DeviceFigures,
}

const CACHE_ENTRIES: usize = 16;
const CACHE_FILE: &str = "figures.json";

/// What cached figures hold for: the device, the threads, the effort, the build, the kernel
/// switches in the environment, and a marker renamed when the kernels' speed changes.
fn cache_key(kind: &str, device: &str, threads: usize, effort: Effort) -> String {
    format!(
        "{kind}|{device}|{threads}|{effort:?}|{}|{}|{}|{}|{}|packed-q4k-256-ahead-amx-ymm-sub-vecdot-l2-kscales-f16table-hostlink",
        env!("CARGO_PKG_VERSION"),
        std::env::var("BRIGADE_CPU_KERNELS").unwrap_or_default(),
        std::env::var("BRIGADE_CPU_PACK").unwrap_or_default(),
        std::env::var("BRIGADE_CPU_PREFETCH").unwrap_or_default(),
        std::env::var("BRIGADE_CPU_AMX").unwrap_or_default()
    )
}

fn cache_read(dir: &Path, key: &str) -> Option<DeviceFigures> {
    let p = dir.join(CACHE_FILE);
    let text = std::fs::read_to_string(&p).ok()?;
    let file: CacheFile = serde_json::from_str(&text).ok()?;
    let hit = file.entries.into_iter().find(|c| c.key == key)?;
    tracing::info!("device figures for {} from {}", hit.device.name, p.display());
    Some(hit.device)
}

/// Adds an entry (replacing one of the same key, dropping the oldest past [`CACHE_ENTRIES`]),
/// written to a temporary file and renamed over the old one, so that concurrent writers (a bench
/// sweep's processes) never leave half a file. A cache that cannot be written costs a later
/// measurement, nothing else.
fn cache_write(dir: &Path, key: String, device: &DeviceFigures) {
    let p = dir.join(CACHE_FILE);
    let mut file: CacheFile =
        std::fs::read_to_string(&p).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    file.entries.retain(|c| c.key != key);
    file.entries.push(Cached { key, device: device.clone() });
    let excess = file.entries.len().saturating_sub(CACHE_ENTRIES);
    file.entries.drain(..excess);
    let tmp = dir.join(format!("{CACHE_FILE}.{}.tmp", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|_| serde_json::to_string_pretty(&file).map_err(std::io::Error::other))
        .and_then(|text| std::fs::write(&tmp, text))
        .and_then(|_| std::fs::rename(&tmp, &p));
    if let Err(e) = written {
        tracing::warn!("cannot keep measured figures in {}: {e}", p.display());
        let _ = std::fs::remove_file(&tmp);
    }
}

/// A random weight of `n × k` in type `t`: `rows` rows quantized, repeated to fill `n` (quantizing
/// all of it would take longer than timing it).
fn weight(t: GgmlDType, n: usize, k: usize) -> Result<Arc<QTensor>, ModelError> {
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
fn time(budget: Duration, mut f: impl FnMut() -> Result<(), ModelError>) -> Result<f64, ModelError> {
    f()?;
    let t0 = Instant::now();
    let mut n = 0u32;
    while n < 2 || t0.elapsed() < budget {
        f()?;
        n += 1;
    }
    Ok(t0.elapsed().as_secs_f64() / f64::from(n))
}

/// Rows of the prompt matmul the kernels are timed on.
const PROMPT_ROWS: usize = 64;

/// brigade's CPU kernels for weight type `t`: decode bytes/s and prompt flop/s.
pub fn kernel_rates(t: GgmlDType, effort: Effort) -> Result<KernelFigures, ModelError> {
    let (n, k, budget) = match (effort, t) {
        (Effort::Quick, _) => (1024, 1024, Duration::from_millis(5)),
        (Effort::Full, GgmlDType::F32) => (2048, 4096, Duration::from_millis(60)),
        (Effort::Full, _) => (4096, 4096, Duration::from_millis(60)),
    };
    let w = weight(t, n, k)?;
    let bytes = w.storage_size_in_bytes() as f64;
    let n = w.shape().dims()[0];
    // the kernels a model's weight of this type runs: packed at load where the CPU's are
    let packed = crate::cpu_matmul::pack(t, &w.data()?, (n, k)).map_err(candle_core::Error::wrap)?;
    let (packed, file) = match packed {
        Some(p) => (Some(crate::cpu_matmul::PackedMatMul(Arc::new(p))), None),
        None => (None, Some(crate::cpu_matmul::CpuMatMul(w))),
    };
    let apply = |x: &Tensor| -> Result<(), ModelError> {
        match (&packed, &file) {
            (Some(op), _) => x.apply_op1_no_bwd(op)?,
            (None, Some(op)) => x.apply_op1_no_bwd(op)?,
            (None, None) => return Err(ModelError::BadInput("no matmul to time".into())),
        };
        Ok(())
    };
    let x1 = Tensor::randn(0f32, 1f32, (1, k), &Device::Cpu)?;
    let decode = time(budget, || apply(&x1))?;
    let xp = Tensor::randn(0f32, 1f32, (PROMPT_ROWS, k), &Device::Cpu)?;
    let prompt = time(budget, || apply(&xp))?;
    Ok(KernelFigures {
        weight_type: type_name(t).to_string(),
        decode_bytes_per_s: bytes / decode,
        prompt_flops: 2.0 * (PROMPT_ROWS * n * k) as f64 / prompt,
    })
}

/// Measures the CPU with `threads` threads (or reads the figures measured before from
/// `cache_dir`). `memory_cap` limits the memory offered (0 = what the OS says is available);
/// memory is never cached.
/// Held while this process measures the CPU: brigade processes on one host (the workers of a
/// cluster tried on one machine, a worker and `brigade doctor`) measure one at a time — at once,
/// each would measure a fraction of the CPU and the planner would plan on it. An advisory lock
/// (std's `File::lock`) on a file in the temp dir; without it (no temp dir, no locks) measuring
/// goes on unserialized.
pub fn host_measure_lock() -> Option<std::fs::File> {
    let path = std::env::temp_dir().join("brigade-measure.lock");
    let f = std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(path).ok()?;
    f.lock().ok()?;
    Some(f)
}

pub fn measure_cpu(
    threads: usize,
    effort: Effort,
    memory_cap: u64,
    cache_dir: Option<&Path>,
) -> Result<DeviceFigures, ModelError> {
    let info = crate::devices::cpu_info();
    let key = cache_key("cpu", &info.name, threads, effort);
    let offered = if memory_cap > 0 { memory_cap.min(info.memory_available) } else { info.memory_available };
    if let Some(hit) = cache_dir.and_then(|d| cache_read(d, &key)) {
        return Ok(DeviceFigures { memory_free: offered, memory_total: info.memory_total, ..hit });
    }
    let _host = host_measure_lock();
    let t0 = Instant::now();
    let bw_bytes = match effort {
        Effort::Full => crate::bandwidth::probe_bytes(),
        Effort::Quick => 64 << 20,
    };
    let mem_bandwidth = crate::bandwidth::read_bandwidth(bw_bytes, threads, 3);
    let types: &[GgmlDType] = match effort {
        Effort::Full => &crate::cpu_matmul::WEIGHT_TYPES,
        Effort::Quick => &QUICK_TYPES,
    };
    let kernels = types.iter().map(|&t| kernel_rates(t, effort)).collect::<Result<Vec<_>, _>>()?;
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
        threads: u32::try_from(threads).unwrap_or(u32::MAX),
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
    if let Some(d) = cache_dir {
        cache_write(d, key, &dev);
    }
    Ok(dev)
}

/// A device's memory bandwidth (timed device-to-device copies; on the CPU, the read probe) and
/// dense matmul rate in `dtype` (flop/s of a square product, the prompt's kind of work).
pub fn device_rates(device: &Device, dtype: DType, effort: Effort) -> Result<(f64, f64), ModelError> {
    let (n, budget) = match effort {
        Effort::Full => (4096, Duration::from_millis(200)),
        Effort::Quick => (512, Duration::from_millis(10)),
    };
    let bandwidth = match crate::bandwidth::device_bandwidth(device) {
        Some(b) => b,
        None => crate::bandwidth::read_bandwidth(64 << 20, crate::threads::current(), 2),
    };
    let a = Tensor::randn(0f32, 1f32, (n, n), device)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1f32, (n, n), device)?.to_dtype(dtype)?;
    let secs = time(budget, || {
        a.matmul(&b)?;
        device.synchronize()?;
        Ok(())
    })?;
    Ok((bandwidth, 2.0 * (n * n * n) as f64 / secs))
}

/// The link between the host and `device`, as a stage hop across it sees it: bandwidth from
/// timed copies of a large f32 block to the device and back (bytes moved / seconds), latency from
/// round trips of one hidden state's worth (16 KiB) less the time its bytes take at that
/// bandwidth, halved (one way). On the CPU both copies are in-process: the figures are a copy's.
pub fn host_link_rates(device: &Device, effort: Effort) -> Result<brigade_core::Link, ModelError> {
    let (big, budget) = match effort {
        Effort::Full => (64usize << 20, Duration::from_millis(200)),
        Effort::Quick => (4usize << 20, Duration::from_millis(10)),
    };
    let host = Tensor::zeros(big / 4, DType::F32, &Device::Cpu)?;
    let secs = time(budget, || {
        let there = host.to_device(device)?;
        device.synchronize()?;
        let back = there.to_device(&Device::Cpu)?;
        drop(back);
        Ok(())
    })?;
    let bandwidth = 2.0 * big as f64 / secs.max(1e-9);
    let small = Tensor::zeros(4096, DType::F32, &Device::Cpu)?;
    let round_trip = time(budget, || {
        let there = small.to_device(device)?;
        device.synchronize()?;
        drop(there.to_device(&Device::Cpu)?);
        Ok(())
    })?;
    let latency = ((round_trip - 2.0 * 16384.0 / bandwidth) / 2.0).max(1e-7);
    Ok(brigade_core::Link { bandwidth, latency })
}

/// Measures CUDA device `ordinal` (or reads its figures from `cache_dir`): copy bandwidth and a
/// bf16 matmul's rate; its free memory now.
pub fn measure_cuda(ordinal: u32, effort: Effort, cache_dir: Option<&Path>) -> Result<DeviceFigures, ModelError> {
    let info = crate::devices::cuda_devices()
        .into_iter()
        .find(|d| d.ordinal == ordinal)
        .ok_or_else(|| ModelError::NoDevice(format!("cuda{ordinal}: no such CUDA device")))?;
    let key = cache_key("cuda", &format!("{ordinal} {}", info.name), 0, effort);
    let fresh =
        |d: DeviceFigures| DeviceFigures { memory_free: info.memory_free, memory_total: info.memory_total, ..d };
    if let Some(hit) = cache_dir.and_then(|d| cache_read(d, &key)) {
        return Ok(fresh(hit));
    }
    let device = crate::device::candle_device(brigade_core::DeviceId::Cuda(ordinal))?;
    let (mem_bandwidth, flops) = device_rates(&device, DType::BF16, effort)?;
    let host_link = host_link_rates(&device, effort)?;
    let dev = DeviceFigures {
        name: format!("cuda{ordinal}"),
        kind: DeviceKind::Cuda,
        model: info.name.clone(),
        memory_total: info.memory_total,
        memory_free: info.memory_free,
        mem_bandwidth,
        flops,
        kernels: Vec::new(),
        threads: 0,
        features: String::new(),
        host_link: Some(host_link),
    };
    if let Some(d) = cache_dir {
        cache_write(d, key, &dev);
    }
    Ok(fresh(dev))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn quick_measurement_is_plausible_and_cached() {
        let dir = tempfile::tempdir().unwrap();
        let d = measure_cpu(1, Effort::Quick, 1 << 30, Some(dir.path())).unwrap();
        assert_eq!(d.memory_free, (1u64 << 30).min(crate::devices::cpu_info().memory_available));
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
        assert_eq!(again.memory_free, (2u64 << 30).min(crate::devices::cpu_info().memory_available));
        // another thread count is another entry; both stay
        let two = measure_cpu(2, Effort::Quick, 0, Some(dir.path())).unwrap();
        assert_eq!(two.threads, 2);
        let file: CacheFile =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(CACHE_FILE)).unwrap()).unwrap();
        assert_eq!(file.entries.len(), 2);
        // a file of another format is measured over, not an error
        std::fs::write(dir.path().join(CACHE_FILE), "{\"key\": 1}").unwrap();
        assert!(measure_cpu(1, Effort::Quick, 0, Some(dir.path())).is_ok());
    }

    #[test]
    fn a_host_link_is_measured_as_a_copy() {
        // on the CPU both copies stay in this process: a positive, finite figure is all there is
        // to check here (the CUDA path is timed by scripts/gpu-check.sh on a GPU machine)
        let l = host_link_rates(&Device::Cpu, Effort::Quick).unwrap();
        assert!(l.bandwidth.is_finite() && l.bandwidth > 1e6, "{l:?}");
        assert!(l.latency.is_finite() && l.latency > 0.0 && l.latency < 0.1, "{l:?}");
    }

    #[test]
    fn cache_keeps_the_last_entries() {
        let dir = tempfile::tempdir().unwrap();
        let fig = |i: usize| DeviceFigures {
            name: format!("d{i}"),
            kind: DeviceKind::Cpu,
            model: String::new(),
            memory_total: 0,
            memory_free: 0,
            mem_bandwidth: i as f64,
            flops: 1.0,
            kernels: Vec::new(),
            threads: 1,
            features: String::new(),
            host_link: None,
        };
        for i in 0..CACHE_ENTRIES + 3 {
            cache_write(dir.path(), format!("k{i}"), &fig(i));
        }
        assert!(cache_read(dir.path(), "k0").is_none());
        assert_eq!(cache_read(dir.path(), "k3").map(|d| d.mem_bandwidth), Some(3.0));
        let last = CACHE_ENTRIES + 2;
        assert_eq!(cache_read(dir.path(), &format!("k{last}")).map(|d| d.name), Some(format!("d{last}")));
        // rewriting a key replaces it
        cache_write(dir.path(), "k3".into(), &fig(99));
        assert_eq!(cache_read(dir.path(), "k3").map(|d| d.mem_bandwidth), Some(99.0));
        assert!(!dir.path().read_dir().unwrap().any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".tmp")));
    }

    #[test]
    fn device_rates_on_the_cpu() {
        // the code path a GPU takes, on the CPU (f32: candle's CPU matmul has no bf16)
        let (bw, flops) = device_rates(&Device::Cpu, DType::F32, Effort::Quick).unwrap();
        assert!(bw > 1e8 && bw < 1e13, "{bw}");
        assert!(flops > 1e7 && flops < 1e14, "{flops}");
        assert!(default_cache_dir().is_some_and(|d| d.ends_with("brigade")));
        if !cfg!(feature = "cuda") {
            let e = measure_cuda(0, Effort::Quick, None).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("cuda0: no such CUDA device"), "{e}");
        }
    }

    #[test]
    fn measurements_on_one_host_take_turns() {
        let held = host_measure_lock().expect("a lock file in the temp dir");
        let t0 = Instant::now();
        let waiter = std::thread::spawn(move || {
            let _l = host_measure_lock();
            t0.elapsed()
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
        let waited = waiter.join().unwrap_or_default();
        assert!(waited >= std::time::Duration::from_millis(250), "the second measurement did not wait: {waited:?}");
    }
}
