//! What `run` and `bench` share: opening a model (the embedded one by default), turning
//! `-ngl` / `--device-map` into stages, and printing sizes.

use anyhow::{bail, Context, Result};
use brigade_core::{DeviceId, DeviceKind, DeviceMap, DeviceSpec, Inventory, LayerRange, NodeSpec, Stage};
use brigade_model::device::activation_dtype;
use brigade_model::devices::{cuda_devices, CudaInfo};
use brigade_model::ModelFiles;
use brigade_planner::Policy;
use std::path::Path;
use std::str::FromStr;

/// `-ngl`: a layer count, `all`, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    N(usize),
    All,
    Auto,
}

impl FromStr for GpuLayers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(GpuLayers::Auto),
            "all" | "max" => Ok(GpuLayers::All),
            n => n.parse().map(GpuLayers::N).map_err(|_| format!("`{s}` is not a layer count, `all` or `auto`")),
        }
    }
}

impl std::fmt::Display for GpuLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuLayers::N(n) => write!(f, "{n}"),
            GpuLayers::All => f.write_str("all"),
            GpuLayers::Auto => f.write_str("auto"),
        }
    }
}

pub fn open_model(path: Option<&Path>) -> Result<ModelFiles> {
    match path {
        None => Ok(ModelFiles::from_static_gguf(brigade_model::embedded_model(), brigade_model::EMBEDDED_MODEL_NAME)?),
        Some(p) => ModelFiles::open(p).with_context(|| format!("cannot load model {}", p.display())),
    }
}

/// The context length: `-c` if given, else the model's, capped at 4096 (llama.cpp's habit).
pub fn context_len(files: &ModelFiles, requested: Option<usize>) -> Result<usize> {
    match requested {
        Some(0) => bail!("-c 0: the context must hold at least one token"),
        Some(c) => Ok(c),
        None => Ok(files.config.context_length.clamp(1, 4096)),
    }
}

/// How layers were placed, for the report.
pub struct Placement {
    pub stages: Vec<Stage>,
    /// A line for stderr when the choice deserves one (auto fallbacks, fits).
    pub notice: Option<String>,
}

/// This box as the planner sees it: the CPU with the memory available now, and each CUDA device
/// with its free memory. Bandwidth and compute are nominal figures (a desktop CPU, a current GPU):
/// placing layers on one box only needs the GPU to be the faster device, which it is.
pub fn local_inventory(gpus: &[CudaInfo]) -> Inventory {
    let cpu = brigade_model::devices::cpu_info();
    let mut devices = vec![DeviceSpec {
        name: "cpu".into(),
        kind: DeviceKind::Cpu,
        memory: cpu.memory_available.max(1),
        mem_bandwidth: 40e9,
        flops: 50e9 * cpu.threads as f64,
        watts: None,
        host_link: None,
    }];
    for g in gpus {
        devices.push(DeviceSpec {
            name: format!("cuda{}", g.ordinal),
            kind: DeviceKind::Cuda,
            memory: g.memory_free.max(1),
            mem_bandwidth: 900e9,
            flops: 50e12,
            watts: None,
            host_link: Some(brigade_planner::cluster::DEFAULT_HOST_LINK),
        });
    }
    Inventory { nodes: vec![NodeSpec { name: "local".into(), devices }], links: Vec::new() }
}

/// Bytes per KV cache element on a device for a model (the activation dtype's).
pub fn kv_elem_bytes(files: &ModelFiles, device: DeviceId) -> u64 {
    activation_dtype(device, files).size_in_bytes() as u64
}

/// `-ngl auto`: the planner's latency-optimal placement on this box, with the bytes the GPU
/// will allocate (its KV cache and dense weight types; the CPU, which computes in f32, has memory
/// to spare) against free memory less the headroom.
fn auto_place(files: &ModelFiles, n_ctx: usize, headroom: f64, gpus: &[CudaInfo]) -> Result<Placement> {
    let inv = local_inventory(gpus);
    let profile = files.device_profile(
        kv_elem_bytes(files, DeviceId::Cuda(0)),
        false,
        activation_dtype(DeviceId::Cuda(0), files),
    );
    let policy = Policy { ctx: n_ctx as u64, headroom, ..Policy::default() };
    let plan = brigade_planner::plan(&inv, &profile, &policy).context("-ngl auto: the planner found no placement")?;
    let mut stages = Vec::new();
    for s in &plan.stages {
        stages.push(Stage { device: s.device.parse()?, layers: LayerRange::new(s.layers.0, s.layers.1)? });
    }
    let n_layers = files.config.n_layers;
    let gpu: Vec<String> = plan
        .stages
        .iter()
        .filter(|s| s.device != "cpu")
        .map(|s| {
            format!(
                "{} layers {}–{} ({} of {} budget)",
                s.device,
                s.layers.0,
                s.layers.1 - 1,
                human_bytes(s.memory_bytes),
                human_bytes(s.budget_bytes)
            )
        })
        .collect();
    let on_gpu: usize = plan.stages.iter().filter(|s| s.device != "cpu").map(|s| s.layers.1 - s.layers.0).sum();
    let notice = format!(
        "-ngl auto: {on_gpu} of {n_layers} layers on the GPU{}{} (free memory less {:.0}% headroom); predicted {:.1} tokens/s",
        if gpu.is_empty() { "" } else { ": " },
        gpu.join(", "),
        headroom * 100.0,
        plan.tokens_per_s
    );
    Ok(Placement { stages, notice: Some(notice) })
}

fn no_cuda_reason() -> &'static str {
    if cfg!(feature = "cuda") {
        "no CUDA device was found"
    } else {
        "this brigade was built without CUDA (build with --features cuda, see scripts/build-cuda.sh)"
    }
}

/// Resolves `-ngl` / `--device-map` into stages for a model of `n_layers`.
pub fn place(
    files: &ModelFiles,
    ngl: Option<GpuLayers>,
    device_map: Option<&str>,
    n_ctx: usize,
    headroom: f64,
    gpus: &[CudaInfo],
) -> Result<Placement> {
    let n_layers = files.config.n_layers;
    if !(0.0..1.0).contains(&headroom) {
        bail!("--headroom {headroom}: must be in [0, 1)");
    }
    if let Some(map) = device_map {
        if ngl.is_some() {
            bail!("give either -ngl or --device-map, not both");
        }
        let map = DeviceMap::parse(map)?;
        let stages = map.stages(n_layers)?;
        for s in &stages {
            if let DeviceId::Cuda(i) = s.device {
                if !gpus.iter().any(|g| g.ordinal == i) {
                    bail!("--device-map places layers on {}, but {}", s.device, no_cuda_reason());
                }
            }
        }
        return Ok(Placement { stages, notice: None });
    }
    let gpu = DeviceId::Cuda(0);
    let (n_gpu, notice) = match ngl.unwrap_or(GpuLayers::N(0)) {
        GpuLayers::N(0) => (0, None),
        GpuLayers::N(n) if gpus.is_empty() => {
            bail!("-ngl {n} asks for GPU layers, but {}", no_cuda_reason())
        }
        GpuLayers::All if gpus.is_empty() => {
            bail!("-ngl all asks for GPU layers, but {}", no_cuda_reason())
        }
        GpuLayers::N(n) => (n.min(n_layers), None),
        GpuLayers::All => (n_layers, None),
        GpuLayers::Auto if gpus.is_empty() => {
            (0, Some(format!("-ngl auto: {}; running all {n_layers} layers on the CPU", no_cuda_reason())))
        }
        GpuLayers::Auto => return auto_place(files, n_ctx, headroom, gpus),
    };
    let stages = DeviceMap::n_gpu_layers(n_layers, n_gpu, gpu)?.stages(n_layers)?;
    Ok(Placement { stages, notice })
}

/// Loads with `load`; if the GPU runs out of memory anyway (`retry`: under `-ngl auto`), tries
/// again with fewer GPU layers (an eighth fewer each time, at least one) until it fits or none are
/// left, and says what it did.
pub fn load_with_retry<T>(
    n_layers: usize,
    mut stages: Vec<Stage>,
    retry: bool,
    mut load: impl FnMut(&[Stage]) -> Result<T, brigade_model::ModelError>,
) -> Result<(T, Vec<Stage>, Vec<String>)> {
    let mut notes = Vec::new();
    loop {
        match load(&stages) {
            Ok(t) => return Ok((t, stages, notes)),
            Err(e) if retry && brigade_model::device::is_out_of_memory(&e) => {
                let gpu = stages.iter().find(|s| s.device != DeviceId::Cpu).map(|s| s.device);
                let on_gpu: usize = stages.iter().filter(|s| s.device != DeviceId::Cpu).map(|s| s.layers.len()).sum();
                let Some(gpu) = gpu.filter(|_| on_gpu > 0) else {
                    return Err(anyhow::Error::new(e).context("out of memory with no GPU layers left to move"));
                };
                let fewer = on_gpu - (on_gpu / 8).max(1);
                notes.push(format!("loading {on_gpu} layers on {gpu} ran out of memory ({e}); retrying with {fewer}"));
                stages = DeviceMap::n_gpu_layers(n_layers, fewer, gpu)?.stages(n_layers)?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Free memory of each CUDA device now, by ordinal.
pub fn gpu_free() -> Vec<(u32, u64)> {
    cuda_devices().into_iter().map(|g| (g.ordinal, g.memory_free)).collect()
}

pub fn detect_gpus() -> Vec<CudaInfo> {
    cuda_devices()
}

pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use brigade_model::predict_slice_bytes;

    fn fake_gpu(free: u64) -> Vec<CudaInfo> {
        vec![CudaInfo { ordinal: 0, name: "test".into(), memory_total: free, memory_free: free }]
    }

    #[test]
    fn out_of_memory_retries_with_fewer_gpu_layers() {
        let oom = || {
            brigade_model::ModelError::Candle(candle_core::Error::Msg(
                "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
            ))
        };
        let start = DeviceMap::n_gpu_layers(32, 32, DeviceId::Cuda(0)).unwrap().stages(32).unwrap();
        let mut tried = Vec::new();
        // a GPU that holds at most 20 layers
        let (got, stages, notes) = load_with_retry(32, start.clone(), true, |st| {
            let g: usize = st.iter().filter(|s| s.device != DeviceId::Cpu).map(|s| s.layers.len()).sum();
            tried.push(g);
            if g > 20 {
                Err(oom())
            } else {
                Ok(g)
            }
        })
        .unwrap();
        assert_eq!(tried, vec![32, 28, 25, 22, 20]);
        assert_eq!(got, 20);
        assert_eq!(notes.len(), 4);
        assert!(notes[0].contains("ran out of memory") && notes[0].contains("retrying with 28"));
        assert_eq!(stages.iter().map(|s| s.layers.len()).sum::<usize>(), 32);
        // without -ngl auto, no retry; other errors are not retried either
        assert!(load_with_retry(32, start.clone(), false, |_| -> Result<(), _> { Err(oom()) }).is_err());
        let mut n = 0;
        assert!(load_with_retry(32, start, true, |_| -> Result<(), _> {
            n += 1;
            Err(brigade_model::ModelError::BadInput("x".into()))
        })
        .is_err());
        assert_eq!(n, 1);
    }

    #[test]
    fn placement_rules() {
        let files = open_model(None).unwrap();
        let n = files.config.n_layers;
        // no GPU: -ngl N is an error, auto falls back with a notice, the default is the CPU
        assert!(place(&files, Some(GpuLayers::N(2)), None, 64, 0.1, &[]).is_err());
        let p = place(&files, Some(GpuLayers::Auto), None, 64, 0.1, &[]).unwrap();
        assert_eq!(p.stages.len(), 1);
        assert!(p.notice.unwrap().contains("CPU"));
        assert_eq!(place(&files, None, None, 64, 0.1, &[]).unwrap().stages[0].layers.len(), n);
        assert!(place(&files, Some(GpuLayers::N(1)), Some("cpu:5"), 64, 0.1, &[]).is_err());
        assert!(place(&files, None, Some("cpu:2,cuda0:3"), 64, 0.1, &[]).is_err());
        // room for everything: the whole model on the GPU
        let p = place(&files, Some(GpuLayers::Auto), None, 64, 0.1, &fake_gpu(1 << 30)).unwrap();
        assert_eq!(p.stages.len(), 1);
        assert_eq!(p.stages[0].device, DeviceId::Cuda(0));
        // a model whose layers take real time: auto fills the GPU by predicted bytes; with room for
        // k trailing layers and the head it takes at least k layers and never exceeds its budget
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let shape = brigade_model::synth::Shape {
            layers: 4,
            hidden: 512,
            ffn: 1024,
            heads: 8,
            kv_heads: 8,
            vocab: 512,
            context: 256,
            rope_theta: 1e4,
        };
        brigade_model::synth::write_gguf(&path, &shape, brigade_model::synth::SynthType::F32, 1, |_, _| {}).unwrap();
        let files = open_model(Some(&path)).unwrap();
        let n = 4;
        for k in 1..=n {
            let need = predict_slice_bytes(&files, LayerRange::new(n - k, n).unwrap(), DeviceId::Cuda(0), 64).total();
            let free = (need as f64 / 0.9).ceil() as u64 + 1;
            let p = place(&files, Some(GpuLayers::Auto), None, 64, 0.1, &fake_gpu(free)).unwrap();
            let gpu: Vec<&Stage> = p.stages.iter().filter(|s| s.device != DeviceId::Cpu).collect();
            let on_gpu: usize = gpu.iter().map(|s| s.layers.len()).sum();
            assert!(on_gpu >= k, "free {free}: {on_gpu} < {k}: {:?}", p.stages);
            for s in gpu {
                assert!(predict_slice_bytes(&files, s.layers, s.device, 64).total() as f64 <= free as f64 * 0.9);
            }
            assert!(p.notice.as_ref().unwrap().contains("-ngl auto"));
        }
        let p = place(&files, Some(GpuLayers::Auto), None, 64, 0.1, &fake_gpu(1000)).unwrap();
        assert!(p.stages.iter().all(|s| s.device == DeviceId::Cpu));
    }
}
