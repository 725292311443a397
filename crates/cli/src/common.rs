//! What `run` and `bench` share: opening a model (the embedded one by default), turning
//! `-ngl` / `--device-map` into stages, llama.cpp's `-c` and `-n`, and printing sizes.

use crate::machine::Machine;
use anyhow::{bail, Context, Result};
use brigade_core::{DeviceId, DeviceMap, LayerRange, SamplingParams, Stage};
use brigade_model::devices::{cuda_devices, CudaInfo};
use brigade_model::{predict_split_bytes, ModelFiles};
use brigade_planner::{CpuMoe, Policy};
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

/// `--n-cpu-moe` in a `bench` sweep: a layer count or `all` (llama.cpp's `--cpu-moe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeLayers(pub usize);

impl FromStr for MoeLayers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "all" => Ok(MoeLayers(usize::MAX)),
            n => n.parse().map(MoeLayers).map_err(|_| format!("`{s}` is not a layer count or `all`")),
        }
    }
}

impl std::fmt::Display for MoeLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            usize::MAX => f.write_str("all"),
            n => write!(f, "{n}"),
        }
    }
}

pub fn open_model(path: Option<&Path>) -> Result<ModelFiles> {
    match path {
        None => Ok(ModelFiles::from_static_gguf(brigade_model::embedded_model(), brigade_model::EMBEDDED_MODEL_NAME)?),
        Some(p) => ModelFiles::open(p).with_context(|| format!("cannot load model {}", p.display())),
    }
}

/// The context length: `-c N` if given, `-c 0` the model's trained context (llama.cpp's
/// meaning), none the model's capped at 4096 (llama.cpp's default).
pub fn context_len(files: &ModelFiles, requested: Option<usize>) -> Result<usize> {
    let trained = files.config.context_length.max(1);
    match requested {
        Some(0) => Ok(trained),
        Some(c) => Ok(c),
        None => Ok(trained.min(4096)),
    }
}

/// llama.cpp's `-n`: a token count, or -1 for no limit (until an end of text or a full context).
pub fn n_predict(n: i64) -> Result<usize> {
    match n {
        -1 => Ok(usize::MAX),
        n => usize::try_from(n).map_err(|_| anyhow::anyhow!("-n {n}: a token count, or -1 for no limit")),
    }
}

/// Refuses a placement whose CPU stages would allocate more than the memory available now
/// (a context as large as `-c 0` gives can need tens of GiB of f32 KV cache): an error naming
/// the sizes instead of an allocation failure part-way through loading.
///
/// Split layers' experts (`cpu_moe`) count wherever their layers are: they live in RAM.
pub fn check_cpu_memory(files: &ModelFiles, stages: &[Stage], n_ctx: usize, cpu_moe: usize) -> Result<()> {
    let (weights, kv) = cpu_bytes(files, stages, n_ctx, cpu_moe);
    let available = brigade_model::devices::cpu_info().memory_available;
    if available > 0 && weights.saturating_add(kv) > available {
        bail!(
            "the CPU's layers need {} (weights {}, KV cache {} for {n_ctx} tokens in f32) and {} of memory is available: lower -c",
            human_bytes(weights.saturating_add(kv)),
            human_bytes(weights),
            human_bytes(kv),
            human_bytes(available)
        );
    }
    Ok(())
}

/// Bytes of RAM a placement takes: (weights of the CPU's stages and every split layer's experts,
/// the CPU's KV cache for `n_ctx` tokens).
fn cpu_bytes(files: &ModelFiles, stages: &[Stage], n_ctx: usize, cpu_moe: usize) -> (u64, u64) {
    let (mut weights, mut kv) = (0u64, 0u64);
    for s in stages {
        let b = predict_split_bytes(files, s.layers, s.device, n_ctx, cpu_moe);
        weights = weights.saturating_add(b.host_experts);
        if s.device == DeviceId::Cpu {
            weights = weights.saturating_add(b.weights);
            kv = kv.saturating_add(b.kv);
        }
    }
    (weights, kv)
}

/// How layers were placed, for the report.
pub struct Placement {
    pub stages: Vec<Stage>,
    /// Split layers: the routed experts of layers `[0, cpu_moe)` in host RAM, computed by the
    /// CPU (`--n-cpu-moe`, `--cpu-moe`, or what `-ngl auto` chose); 0: whole layers.
    pub cpu_moe: usize,
    /// A line for stderr when the choice deserves one (auto fallbacks, fits).
    pub notice: Option<String>,
}

/// `-ngl auto`: the planner's latency-optimal placement on this box, with this box's measured
/// figures ([`Machine`]) and the bytes each device will allocate (the GPU's KV cache and dense
/// weights in its activation type, the CPU's KV cache in f32) against free memory less the
/// headroom.
fn auto_place(
    files: &ModelFiles,
    n_ctx: usize,
    headroom: f64,
    cpu_moe: Option<usize>,
    machine: &Machine,
) -> Result<Placement> {
    let inv = machine.inventory(&crate::machine::weight_types(files));
    let profile = crate::machine::profile(files);
    let cpu_moe = cpu_moe.map_or(CpuMoe::Auto, CpuMoe::Layers);
    let policy = Policy { ctx: n_ctx as u64, headroom, cpu_moe, ..Policy::default() };
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
    let split: Vec<String> = plan
        .stages
        .iter()
        .filter_map(|s| s.host_layers.map(|(a, b)| format!("{a}–{} of {}", b - 1, s.device)))
        .collect();
    let split = match split.is_empty() {
        true => String::new(),
        false => format!(
            ", the experts of layers {} in RAM ({}, --n-cpu-moe {})",
            split.join(", "),
            human_bytes(plan.host_expert_bytes),
            plan.cpu_moe
        ),
    };
    let notice = format!(
        "-ngl auto: {on_gpu} of {n_layers} layers on the GPU{}{}{split} (free memory less {:.0}% headroom); predicted {:.1} tokens/s",
        if gpu.is_empty() { "" } else { ": " },
        gpu.join(", "),
        headroom * 100.0,
        plan.tokens_per_s
    );
    Ok(Placement { stages, cpu_moe: plan.cpu_moe, notice: Some(notice) })
}

fn no_cuda_reason() -> &'static str {
    if cfg!(feature = "cuda") {
        "no CUDA device was found"
    } else {
        "this brigade was built without CUDA (build with --features cuda, see scripts/build-cuda.sh)"
    }
}

/// Resolves `-ngl` / `--device-map` into stages for a model of `n_layers`. `machine` gives this
/// box's measured figures; it is called only for `-ngl auto` with a GPU.
// (each argument is one of the user's choices or this box's facts; the tests call it directly)
#[allow(clippy::too_many_arguments)]
pub fn place(
    files: &ModelFiles,
    ngl: Option<GpuLayers>,
    device_map: Option<&str>,
    cpu_moe: Option<usize>,
    n_ctx: usize,
    headroom: f64,
    gpus: &[CudaInfo],
    machine: impl FnOnce() -> Result<Machine>,
) -> Result<Placement> {
    let n_layers = files.config.n_layers;
    if !(0.0..1.0).contains(&headroom) {
        bail!("--headroom {headroom}: must be in [0, 1)");
    }
    if let Some(n) = cpu_moe.filter(|&n| n > 0) {
        if files.config.moe.is_none() {
            bail!("--n-cpu-moe {n} keeps experts in RAM, but this model ({:?}) has no experts", files.config.arch);
        }
    }
    let cpu_moe_n = cpu_moe.unwrap_or(0).min(n_layers);
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
        return Ok(Placement { stages, cpu_moe: cpu_moe_n, notice: None });
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
        GpuLayers::Auto => return auto_place(files, n_ctx, headroom, cpu_moe, &machine()?),
    };
    let stages = DeviceMap::n_gpu_layers(n_layers, n_gpu, gpu)?.stages(n_layers)?;
    Ok(Placement { stages, cpu_moe: cpu_moe_n, notice })
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

/// Writes a report to stdout; a closed stdout (`| head`) ends it quietly, as it ends `run`.
pub fn print_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// A parameter count as llama-bench prints it: billions (`7.99 B`), or millions below one
/// billion (`134.52 M`), thousands below one million (`260.10 K`).
pub fn human_params(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2} M", n / 1e6)
    } else {
        format!("{:.2} K", n / 1e3)
    }
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
    use crate::machine::tests::fake_machine;

    fn fake_gpu(free: u64) -> Vec<CudaInfo> {
        vec![CudaInfo { ordinal: 0, name: "test".into(), memory_total: free, memory_free: free }]
    }

    /// Parameter counts in llama-bench's units: a 135M model is not "0.14 B", a 260K one not 0.
    #[test]
    fn parameter_counts_read_in_their_own_unit() {
        assert_eq!(human_params(7_990_000_000), "7.99 B");
        assert_eq!(human_params(1_000_000_000), "1.00 B");
        assert_eq!(human_params(134_515_008), "134.52 M");
        assert_eq!(human_params(260_100), "260.10 K");
        assert_eq!(human_params(0), "0.00 K");
    }

    #[test]
    fn out_of_memory_retries_with_fewer_gpu_layers() {
        let oom = || {
            brigade_model::ModelError::NoDevice(
                "cuda0: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
            )
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
        let e = load_with_retry(32, start.clone(), false, |_| -> Result<(), _> { Err(oom()) }).err().unwrap();
        assert!(e.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
        let mut n = 0;
        let e = load_with_retry(32, start, true, |_| -> Result<(), _> {
            n += 1;
            Err(brigade_model::ModelError::BadInput("x".into()))
        })
        .err()
        .unwrap();
        assert_eq!(e.to_string(), "invalid input: x");
        assert_eq!(n, 1);
    }

    fn no_machine() -> Result<Machine> {
        bail!("measured without a GPU")
    }

    #[test]
    fn llama_cpp_context_and_count_flags() {
        let files = open_model(None).unwrap();
        // the embedded model was trained at 2048 (its header says so)
        assert_eq!(context_len(&files, Some(0)).unwrap(), files.config.context_length);
        assert_eq!(context_len(&files, Some(100)).unwrap(), 100);
        assert_eq!(context_len(&files, None).unwrap(), files.config.context_length.min(4096));
        assert_eq!(n_predict(-1).unwrap(), usize::MAX);
        assert_eq!(n_predict(7).unwrap(), 7);
        let e = n_predict(-2).unwrap_err().to_string();
        assert!(e.contains("-n -2") && e.contains("-1 for no limit"), "{e}");
        let all = [Stage { device: DeviceId::Cpu, layers: LayerRange::new(0, files.config.n_layers).unwrap() }];
        assert!(check_cpu_memory(&files, &all, 64, 0).is_ok());
        // 2^40 tokens of f32 KV cache is more memory than any machine this runs on
        let e = check_cpu_memory(&files, &all, 1 << 40, 0).unwrap_err().to_string();
        assert!(e.contains("KV cache") && e.contains("lower -c"), "{e}");
    }

    #[test]
    fn placement_rules() {
        let files = open_model(None).unwrap();
        let n = files.config.n_layers;
        // no GPU: -ngl N is an error, auto falls back with a notice, the default is the CPU
        let err = |r: Result<Placement>| r.err().map(|e| format!("{e:#}")).unwrap_or_default();
        let e = err(place(&files, Some(GpuLayers::N(2)), None, None, 64, 0.1, &[], no_machine));
        assert!(e.contains("-ngl 2 asks for GPU layers, but "), "{e}");
        let p = place(&files, Some(GpuLayers::Auto), None, None, 64, 0.1, &[], no_machine).unwrap();
        assert_eq!(p.stages.len(), 1);
        assert!(p.notice.unwrap().contains("CPU"));
        assert_eq!(place(&files, None, None, None, 64, 0.1, &[], no_machine).unwrap().stages[0].layers.len(), n);
        let e = err(place(&files, Some(GpuLayers::N(1)), Some("cpu:5"), None, 64, 0.1, &[], no_machine));
        assert!(e.contains("either -ngl or --device-map"), "{e}");
        let e = err(place(&files, None, Some("cpu:2,cuda0:3"), None, 64, 0.1, &[], no_machine));
        assert!(e.contains("--device-map places layers on cuda0, but "), "{e}");
        // room for everything: the whole model on the GPU
        let p = place(&files, Some(GpuLayers::Auto), None, None, 64, 0.1, &fake_gpu(1 << 30), || {
            Ok(fake_machine(&[1 << 30]))
        })
        .unwrap();
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
            let need =
                brigade_model::predict_slice_bytes(&files, LayerRange::new(n - k, n).unwrap(), DeviceId::Cuda(0), 64)
                    .total();
            let free = (need as f64 / 0.9).ceil() as u64 + 1;
            let p = place(&files, Some(GpuLayers::Auto), None, None, 64, 0.1, &fake_gpu(free), || {
                Ok(fake_machine(&[free]))
            })
            .unwrap();
            let gpu: Vec<&Stage> = p.stages.iter().filter(|s| s.device != DeviceId::Cpu).collect();
            let on_gpu: usize = gpu.iter().map(|s| s.layers.len()).sum();
            assert!(on_gpu >= k, "free {free}: {on_gpu} < {k}: {:?}", p.stages);
            for s in gpu {
                assert!(
                    brigade_model::predict_slice_bytes(&files, s.layers, s.device, 64).total() as f64
                        <= free as f64 * 0.9
                );
            }
            assert!(p.notice.as_ref().unwrap().contains("-ngl auto"));
        }
        let p =
            place(&files, Some(GpuLayers::Auto), None, None, 64, 0.1, &fake_gpu(1000), || Ok(fake_machine(&[1000])))
                .unwrap();
        assert!(p.stages.iter().all(|s| s.device == DeviceId::Cpu));
    }

    /// `-ngl auto` on a mixture whose layers do not fit the GPU whole but whose dense parts do:
    /// the planner keeps every layer's attention on the GPU and the experts in RAM (split
    /// layers), within the GPU's budget by the bytes the runtime will allocate; `--n-cpu-moe 0`
    /// keeps layers whole, and a dense model refuses the flag.
    #[test]
    fn auto_splits_a_mixture_that_does_not_fit_whole() {
        use brigade_model::synth::{write_gguf_with, Shape, SynthMoe, SynthMoeFamily, SynthType};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moe.gguf");
        let shape = Shape {
            layers: 4,
            hidden: 256,
            ffn: 256,
            heads: 4,
            kv_heads: 2,
            vocab: 300,
            context: 256,
            rope_theta: 1e4,
        };
        let moe = SynthMoe { experts: 8, used: 2, family: SynthMoeFamily::Mixtral };
        write_gguf_with(&path, &shape, Some(moe), SynthType::F32, 1, |_, _| {}).unwrap();
        let files = open_model(Some(&path)).unwrap();
        let all = LayerRange::new(0, 4).unwrap();
        let whole = brigade_model::predict_slice_bytes(&files, all, DeviceId::Cuda(0), 64).total();
        let split = predict_split_bytes(&files, all, DeviceId::Cuda(0), 64, 4);
        assert!(split.total() * 3 < whole && split.host_experts > 0, "{split:?} of {whole}");
        // room for every dense part, a third of the whole model
        let free = (split.total() as f64 / 0.9).ceil() as u64 + 4096;
        let auto = |cpu_moe| {
            place(&files, Some(GpuLayers::Auto), None, cpu_moe, 64, 0.1, &fake_gpu(free), || Ok(fake_machine(&[free])))
                .unwrap()
        };
        let p = auto(None);
        assert!(p.cpu_moe > 0, "{:?}: {:?}", p.stages, p.notice);
        let on_gpu: usize = p.stages.iter().filter(|s| s.device != DeviceId::Cpu).map(|s| s.layers.len()).sum();
        assert_eq!(on_gpu, 4, "{:?}", p.stages);
        for s in p.stages.iter().filter(|s| s.device != DeviceId::Cpu) {
            let b = predict_split_bytes(&files, s.layers, s.device, 64, p.cpu_moe);
            assert!(b.total() as f64 <= free as f64 * 0.9, "{b:?} of {free}");
        }
        let notice = p.notice.unwrap();
        assert!(notice.contains("--n-cpu-moe") && notice.contains("in RAM"), "{notice}");
        // whole layers asked for: fewer of them on the GPU
        let p = auto(Some(0));
        assert_eq!(p.cpu_moe, 0);
        let on_gpu: usize = p.stages.iter().filter(|s| s.device != DeviceId::Cpu).map(|s| s.layers.len()).sum();
        assert!(on_gpu < 4, "{:?}", p.stages);
        // a given split is kept, clamped to the model's layers, with or without a GPU
        assert_eq!(auto(Some(usize::MAX)).cpu_moe, 4);
        let p = place(&files, None, None, Some(3), 64, 0.1, &[], no_machine).unwrap();
        assert_eq!((p.cpu_moe, p.stages.len()), (3, 1));
        // experts in RAM count against RAM, wherever their layers are
        let gpu = [Stage { device: DeviceId::Cuda(0), layers: all }];
        let held: u64 = (1..=4).map(|n| predict_split_bytes(&files, all, DeviceId::Cuda(0), 64, n).host_experts).sum();
        assert_eq!(cpu_bytes(&files, &gpu, 64, 0), (0, 0));
        let (w, kv) = cpu_bytes(&files, &gpu, 64, 4);
        assert_eq!((w, kv), (split.host_experts, 0));
        assert!(held > 0 && cpu_bytes(&files, &gpu, 64, 2).0 < w);
        let whole_cpu = cpu_bytes(&files, &p.stages, 64, 0);
        assert_eq!(cpu_bytes(&files, &p.stages, 64, 3), whole_cpu, "a CPU stage holds its experts either way");
        // a dense model has no experts to keep anywhere
        let dense = open_model(None).unwrap();
        let e = place(&dense, None, None, Some(2), 64, 0.1, &[], no_machine).err().unwrap().to_string();
        assert!(e.contains("--n-cpu-moe 2") && e.contains("no experts"), "{e}");
    }
}

/// The model and how it is split on this box: the options `run` and `serve` share.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// Model: a GGUF file or a Hugging Face directory. Default: the small model built into brigade.
    #[arg(short = 'm', long = "model")]
    pub model: Option<std::path::PathBuf>,
    /// Context size in tokens (each session's, for `serve`); 0: the model's trained context
    /// (default: the model's, at most 4096).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx: Option<usize>,
    /// Compute threads; 0 or less: every logical CPU (default: the physical cores).
    #[arg(short = 't', long = "threads", allow_negative_numbers = true)]
    pub threads: Option<i64>,
    /// Layers on the GPU: a count (the last N layers and the head, as llama.cpp), `all`, or `auto`
    /// (as many as fit). Also spelled `-ngl`.
    #[arg(long = "n-gpu-layers")]
    pub ngl: Option<GpuLayers>,
    /// Consecutive layer counts per device, in order: `cpu:3,cpu:2` or `cpu:10,cuda0:22`.
    #[arg(long = "device-map")]
    pub device_map: Option<String>,
    /// Share of free GPU memory `-ngl auto` leaves unused.
    #[arg(long = "headroom", default_value_t = 0.10)]
    pub headroom: f64,
    #[command(flatten)]
    pub split: SplitArgs,
    /// How `-ngl auto` measures this machine the first time (cached after): `full` or `quick`.
    #[arg(long = "measure", default_value = "full")]
    pub measure: brigade_model::measure::Effort,
}

/// Split layers of a mixture of experts, with llama.cpp's flags: the options `run`, `serve`,
/// `plan` and `deploy` share.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct SplitArgs {
    /// Keep the routed experts of every layer in RAM, computed by the CPU, while the rest of
    /// each layer runs where it is placed (llama.cpp's `--cpu-moe`) …
    #[arg(long = "cpu-moe", conflicts_with = "n_cpu_moe")]
    pub cpu_moe: bool,
    /// … or of the first N layers (llama.cpp's `--n-cpu-moe`). Default: whole layers, or where
    /// the planner searches (`-ngl auto`, `plan`, `deploy` without a device map) the split it
    /// finds fastest within memory. On a cluster each node's RAM holds the experts of the layers
    /// on that node.
    #[arg(long = "n-cpu-moe")]
    pub n_cpu_moe: Option<usize>,
}

impl SplitArgs {
    /// `--cpu-moe` (every layer: `usize::MAX`) or `--n-cpu-moe N`; `None` when neither is given.
    pub fn layers(&self) -> Option<usize> {
        if self.cpu_moe {
            Some(usize::MAX)
        } else {
            self.n_cpu_moe
        }
    }
}

/// A model opened and placed on this box.
pub struct Placed {
    pub files: ModelFiles,
    pub n_ctx: usize,
    pub gpus: Vec<CudaInfo>,
    pub placement: Placement,
}

impl ModelArgs {
    /// Opens the model, resolves the context and places the layers (measuring this machine for
    /// `-ngl auto` the first time); prints the placement's notice.
    pub fn open_and_place(&self) -> Result<Placed> {
        let files = open_model(self.model.as_deref())?;
        let n_ctx = context_len(&files, self.ctx)?;
        let gpus = detect_gpus();
        let placement = place(
            &files,
            self.ngl,
            self.device_map.as_deref(),
            self.split.layers(),
            n_ctx,
            self.headroom,
            &gpus,
            || Machine::measure(&gpus, self.measure),
        )?;
        if let Some(n) = &placement.notice {
            eprintln!("{n}");
        }
        Ok(Placed { files, n_ctx, gpus, placement })
    }
}

/// How the next token is drawn, with llama.cpp's flag names and defaults: the options `run` and
/// `cluster generate` share.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Random seed (default: a random one, printed in the report).
    #[arg(short = 's', long = "seed")]
    pub seed: Option<u64>,
    /// Keep the k most likely tokens; 0 keeps all.
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities add up to p; 1 keeps all.
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than p × the most likely one; 0 keeps all.
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Divide the logits of recently seen tokens by this; 1 disables.
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// How many of the last tokens the penalties look at; 0 disables them.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Subtract this from a seen token's logit once (OpenAI's presence_penalty).
    #[arg(long = "presence-penalty", default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract this from a token's logit per time it was seen (OpenAI's frequency_penalty).
    #[arg(long = "frequency-penalty", default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
}

impl SamplingArgs {
    /// The settings, with a random seed where none was given; what the sampler cannot use is
    /// refused with the flag's value.
    pub fn params(&self) -> Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed.unwrap_or_else(rand::random),
        };
        p.validate()?;
        Ok(p)
    }
}

/// Speculative decoding by prompt lookup, with llama.cpp's flags: `run`, `serve` and `worker`
/// (for the sessions it drives) take them.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LookupArgs {
    /// Draft by prompt lookup: `ngram-simple` (the text's own repeats), or `none`.
    #[arg(long = "spec-type", value_parser = ["none", "ngram-simple"])]
    pub spec_type: Option<String>,
    /// Tokens a draft holds at most (drafts grow to this while they are taken).
    #[arg(long = "spec-draft-n-max", default_value_t = 8)]
    pub n_max: usize,
    /// Prompt lookup matches the text's last N tokens, for the longest N up to this that
    /// occurred before (down to 1).
    #[arg(long = "spec-ngram-simple-size-n", default_value_t = 3)]
    pub ngram: usize,
}

impl LookupArgs {
    fn check(&self) -> Result<()> {
        if self.n_max == 0 || self.n_max > 64 {
            bail!("--spec-draft-n-max {}: 1 to 64 tokens", self.n_max);
        }
        if self.ngram == 0 || self.ngram > 64 {
            bail!("--spec-ngram-simple-size-n {}: 1 to 64 tokens", self.ngram);
        }
        Ok(())
    }

    /// Prompt lookup where `--spec-type ngram-simple` asks for it.
    pub fn lookup(&self) -> Result<Option<std::sync::Arc<brigade_model::speculative::Speculation>>> {
        use brigade_model::speculative::{DraftSource, Speculation};
        self.check()?;
        Ok((self.spec_type.as_deref() == Some("ngram-simple")).then(|| {
            std::sync::Arc::new(Speculation {
                source: DraftSource::Lookup { ngram: (1, self.ngram) },
                n_max: self.n_max,
            })
        }))
    }
}

/// Speculative decoding on this box: prompt lookup or a draft model (`--model-draft`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SpecArgs {
    #[command(flatten)]
    pub lookup: LookupArgs,
    /// A draft model of the same vocabulary (GGUF or a Hugging Face directory), run on the CPU.
    #[arg(long = "model-draft", visible_alias = "spec-draft-model")]
    pub model_draft: Option<std::path::PathBuf>,
}

impl SpecArgs {
    /// The settings, loading the draft model (on the CPU, for `n_ctx` tokens) where one is
    /// named; `None` when nothing drafts. A draft model of another vocabulary is refused with
    /// the first id whose text differs.
    pub fn speculation(
        &self,
        target_tokens: &brigade_model::Tokenizer,
        n_ctx: usize,
    ) -> Result<Option<std::sync::Arc<brigade_model::speculative::Speculation>>> {
        use brigade_model::speculative::{DraftSource, Speculation};
        let lookup = self.lookup.lookup()?;
        let Some(path) = &self.model_draft else { return Ok(lookup) };
        if lookup.is_some() {
            bail!("--model-draft and --spec-type ngram-simple: one source of drafts at a time");
        }
        let files = ModelFiles::open(path).with_context(|| format!("cannot load draft model {}", path.display()))?;
        let (a, b) = (&*files.tokenizer, target_tokens);
        if a.vocab_size() != b.vocab_size() {
            bail!(
                "the draft model {} has {} tokens, the model {}: drafts must share the vocabulary",
                path.display(),
                a.vocab_size(),
                b.vocab_size()
            );
        }
        if let Some(id) = (0..a.vocab_size() as u32).find(|&i| a.piece(i) != b.piece(i)) {
            bail!(
                "the draft model {} spells token {id} {:?}, the model {:?}: drafts must share the vocabulary",
                path.display(),
                String::from_utf8_lossy(a.piece(id)),
                String::from_utf8_lossy(b.piece(id))
            );
        }
        let n = files.config.n_layers;
        let stages = [Stage { device: DeviceId::Cpu, layers: LayerRange::new(0, n)? }];
        let draft = brigade_model::Pipeline::load(&files, &stages, n_ctx, |_, _| {})
            .with_context(|| format!("loading the draft model {}", path.display()))?;
        // (the drafters check it against the model: `Drafter::new`)
        let spec = Speculation { source: DraftSource::Model(std::sync::Arc::new(draft)), n_max: self.lookup.n_max };
        Ok(Some(std::sync::Arc::new(spec)))
    }
}
