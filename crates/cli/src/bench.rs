//! `brigade bench`: llama-bench's interface and table, plus the memory-bandwidth bound of decode
//! and the knee of an `-ngl` sweep.

use crate::common::{detect_gpus, gpu_free, human_bytes, open_model, place, GpuLayers};
use anyhow::{bail, Context, Result};
use brigade_core::{DeviceId, Stage};
use brigade_model::pipeline::activation_dtype;
use brigade_model::weights::StoredType;
use brigade_model::{bandwidth, predict_slice_bytes, ModelFiles, Pipeline};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum OutFormat {
    Md,
    Csv,
    Json,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model (default: the small model built into brigade).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Prompt lengths to test (pp), comma separated; 0 skips.
    #[arg(short = 'p', long = "n-prompt", default_value = "512", value_delimiter = ',')]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (tg), comma separated; 0 skips.
    #[arg(short = 'n', long = "n-gen", default_value = "128", value_delimiter = ',')]
    pub n_gen: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    pub reps: usize,
    /// Compute threads.
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// GPU layer counts to sweep, comma separated (`all` and `auto` allowed). Also `-ngl`.
    #[arg(long = "n-gpu-layers", default_value = "0", value_delimiter = ',')]
    pub ngl: Vec<GpuLayers>,
    /// Share of free GPU memory `auto` leaves unused.
    #[arg(long = "headroom", default_value_t = 0.10)]
    pub headroom: f64,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutFormat::Md)]
    pub output: OutFormat,
    /// Skip the memory bandwidth probe (and the bound it gives).
    #[arg(long = "no-bandwidth")]
    pub no_bandwidth: bool,
    /// Benchmark a deployment of a cluster instead (`-m` names the deployment).
    #[command(flatten)]
    pub connect: crate::cluster::Connect,
    /// A running OpenAI-compatible server to benchmark instead (`--url`).
    #[command(flatten)]
    pub http: crate::http_bench::HttpArgs,
    /// Concurrent clients to test, comma separated (cluster and `--url` benchmarks).
    #[arg(long = "concurrency", default_value = "1", value_delimiter = ',')]
    pub concurrency: Vec<usize>,
}

#[derive(Serialize, Clone)]
struct DeviceBytes {
    name: String,
    layers: (usize, usize),
    bytes: u64,
}

#[derive(Serialize, Clone)]
struct Row {
    ngl: String,
    /// GPU layers actually used.
    n_gpu_layers: usize,
    test: String,
    n_prompt: usize,
    n_gen: usize,
    avg_ts: f64,
    stddev_ts: f64,
    samples_ts: Vec<f64>,
    load_ms: f64,
    devices: Vec<DeviceBytes>,
    /// Weight bytes read per generated token (the whole model but the embedding table).
    read_bytes_per_token: u64,
    /// The read bandwidth the bound uses (the best measured around this test).
    bandwidth_bytes_per_s: Option<f64>,
    bound_ts: Option<f64>,
    fraction_of_bound: Option<f64>,
    /// CUDA: bytes predicted on the GPU(s) before loading, and measured (free memory before the
    /// load minus free memory after a warm-up with one session alive).
    gpu_predicted_bytes: Option<u64>,
    gpu_measured_bytes: Option<u64>,
}

#[derive(Serialize)]
struct Knee {
    ngl: String,
    n_gpu_layers: usize,
    tg_ts: f64,
    best_ts: f64,
}

#[derive(Serialize)]
struct BenchOut {
    model: String,
    model_bytes: u64,
    params: u64,
    threads: usize,
    bandwidth_bytes_per_s: Option<f64>,
    gpu_bandwidth_bytes_per_s: Option<f64>,
    rows: Vec<Row>,
    knee: Option<Knee>,
    notes: Vec<String>,
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n;
    let v = if xs.len() > 1 { xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (m, v.sqrt())
}

/// Weight bytes one decode step reads on each device: every stage's weights except the
/// embedding table, of which a step reads one row (unless the head is tied to it).
fn read_bytes(files: &ModelFiles, stages: &[Stage], n_ctx: usize) -> Vec<(DeviceId, u64)> {
    stages
        .iter()
        .map(|s| {
            let w = predict_slice_bytes(files, s.layers, s.device, n_ctx).weights;
            let embed = if s.layers.is_first() {
                files.device_bytes("token_embd.weight", s.device == DeviceId::Cpu, activation_dtype(s.device, files))
            } else {
                0
            };
            let tied_here = s.layers.is_last(files.config.n_layers) && files.tensor_info("output.weight").is_none();
            (s.device, if tied_here { w } else { w - embed })
        })
        .collect()
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if let Some(url) = a.http.url.clone() {
        return crate::http_bench::bench(crate::http_bench::HttpBench {
            url,
            model: a.model.map(|m| m.display().to_string()),
            api_key: a.connect.api_key,
            n_gen: a.n_gen.first().copied().unwrap_or(64).max(1),
            reps: a.reps.max(1),
            concurrency: a.concurrency,
            long_prompt: a.http.long_prompt,
            json: a.output == OutFormat::Json,
        });
    }
    if a.connect.coordinator.is_some() {
        let Some(model) = a.model.as_ref().map(|m| m.display().to_string()) else {
            bail!("with --coordinator, -m names the deployment to benchmark");
        };
        if a.concurrency.iter().any(|&c| c == 0 || c > 1024) {
            bail!("--concurrency: 1 to 1024 clients");
        }
        return crate::cluster_bench::bench(crate::cluster_bench::ClusterBench {
            connect: a.connect,
            model,
            n_prompt: a.n_prompt,
            n_gen: a.n_gen,
            reps: a.reps.max(1),
            concurrency: a.concurrency,
            json: a.output == OutFormat::Json,
        });
    }
    if a.reps == 0 {
        bail!("-r 0: at least one repetition");
    }
    let files = open_model(a.model.as_deref())?;
    let threads = candle_core::utils::get_num_threads();
    let gpus = detect_gpus();
    let n_ctx = a.n_prompt.iter().max().copied().unwrap_or(0) + a.n_gen.iter().max().copied().unwrap_or(0) + 16;
    let mut notes = Vec::new();
    // every type is batched for prompts (candle's own op batches only Q4_K/Q6_K/Q8_0); say
    // which kernels this file's layer matrices go through on the CPU
    for (ty, bytes) in files.weight_types() {
        let (decode, prompt) = match ty {
            StoredType::Ggml(d) => brigade_model::cpu_matmul::kernels(brigade_model::weights::ggml_dtype(d)),
            _ => ("candle matmul (dense)", "candle matmul (dense)"),
        };
        notes.push(format!("CPU kernels for {} ({}): decode {decode}, prompt {prompt}", ty.name(), human_bytes(bytes)));
    }
    let bw = if a.no_bandwidth { None } else { Some(bandwidth::read_bandwidth(512 << 20, threads, 3)) };

    let label = files.source.rsplit('/').next().unwrap_or(&files.source).to_string();

    // CUDA contexts first (free memory measured around each load sees only the load), and the
    // GPUs' copy bandwidth for the bound
    let contexts: Vec<candle_core::Device> = gpus
        .iter()
        .map(|g| brigade_model::pipeline::candle_device(DeviceId::Cuda(g.ordinal)))
        .collect::<Result<_, _>>()?;
    let gpu_bw = if a.no_bandwidth { None } else { contexts.first().and_then(bandwidth::device_bandwidth) };
    let sync = || {
        for c in &contexts {
            let _ = c.synchronize();
        }
    };
    let device = candle_core::Device::Cpu;
    let rows = device.with_context(|| -> Result<Vec<Row>> {
        let mut rows = Vec::new();
        for ngl in &a.ngl {
            sync();
            let free_before = gpu_free();
            let placement = place(&files, Some(*ngl), None, n_ctx, a.headroom, &gpus)?;
            if let Some(n) = &placement.notice {
                eprintln!("{n}");
            }
            let n_gpu: usize =
                placement.stages.iter().filter(|s| s.device != DeviceId::Cpu).map(|s| s.layers.len()).sum();
            let t0 = Instant::now();
            let pipeline = Pipeline::load(&files, &placement.stages, n_ctx, |_, _| {})
                .with_context(|| format!("loading for -ngl {ngl}"))?;
            let load_ms = t0.elapsed().as_secs_f64() * 1e3;
            let devices: Vec<DeviceBytes> = pipeline
                .report()
                .iter()
                .map(|r| DeviceBytes {
                    name: r.device.to_string(),
                    layers: r.layers,
                    bytes: r.weight_bytes + r.kv_bytes,
                })
                .collect();
            let reads = read_bytes(&files, &placement.stages, n_ctx);
            let read_total: u64 = reads.iter().map(|r| r.1).sum();
            let cpu_read: u64 = reads.iter().filter(|r| r.0 == DeviceId::Cpu).map(|r| r.1).sum();
            let vocab = files.config.vocab as u32;
            let token = |i: usize| ((i as u32).wrapping_mul(2_654_435_761) >> 7) % vocab;
            // warm-up: first use of every kernel (and repacking of quantized weights); GPU memory
            // measured with its session (KV cache) alive
            let (gpu_predicted, gpu_measured) = {
                let mut s = pipeline.new_session()?;
                let w: Vec<u32> = (0..8).map(token).collect();
                pipeline.prefill(&mut s, &w, 512)?;
                pipeline.forward(&mut s, &[token(9)], brigade_model::Logits::Last)?;
                sync();
                let free_after = gpu_free();
                let measured: u64 = free_before
                    .iter()
                    .filter_map(|(i, b)| free_after.iter().find(|x| x.0 == *i).map(|x| b.saturating_sub(x.1)))
                    .sum();
                let predicted: u64 = placement
                    .stages
                    .iter()
                    .filter(|st| st.device != DeviceId::Cpu)
                    .map(|st| predict_slice_bytes(&files, st.layers, st.device, n_ctx).total())
                    .sum();
                if gpus.is_empty() {
                    (None, None)
                } else {
                    (Some(predicted), Some(measured))
                }
            };
            let gpu_read = read_total - cpu_read;
            for &p in a.n_prompt.iter().filter(|&&p| p > 0) {
                let prompt: Vec<u32> = (0..p).map(token).collect();
                let mut samples = Vec::new();
                for _ in 0..a.reps {
                    let mut s = pipeline.new_session()?;
                    let t = Instant::now();
                    pipeline.prefill(&mut s, &prompt, 512)?;
                    samples.push(p as f64 / t.elapsed().as_secs_f64());
                }
                let (m, sd) = mean_std(&samples);
                rows.push(Row {
                    ngl: ngl.to_string(),
                    n_gpu_layers: n_gpu,
                    test: format!("pp{p}"),
                    n_prompt: p,
                    n_gen: 0,
                    avg_ts: m,
                    stddev_ts: sd,
                    samples_ts: samples,
                    load_ms,
                    devices: devices.clone(),
                    read_bytes_per_token: read_total,
                    bandwidth_bytes_per_s: None,
                    bound_ts: None,
                    fraction_of_bound: None,
                    gpu_predicted_bytes: gpu_predicted,
                    gpu_measured_bytes: gpu_measured,
                });
            }
            for &n in a.n_gen.iter().filter(|&&n| n > 0) {
                let mut samples = Vec::new();
                // This machine's bandwidth drifts (shared hosts): the bound uses the best read
                // bandwidth measured right before and right after each repetition.
                let mut row_bw = bw;
                for _ in 0..a.reps {
                    let mut s = pipeline.new_session()?;
                    if bw.is_some() {
                        row_bw = row_bw.map(|b| b.max(bandwidth::read_bandwidth(256 << 20, threads, 2)));
                    }
                    let t = Instant::now();
                    for i in 0..n {
                        pipeline.forward(&mut s, &[token(i + 1)], brigade_model::Logits::Last)?;
                    }
                    samples.push(n as f64 / t.elapsed().as_secs_f64());
                    if bw.is_some() {
                        row_bw = row_bw.map(|b| b.max(bandwidth::read_bandwidth(256 << 20, threads, 2)));
                    }
                }
                let bw = row_bw;
                let (m, sd) = mean_std(&samples);
                // floor: CPU-resident bytes at CPU bandwidth plus GPU-resident bytes at GPU bandwidth
                let bound = match (bw, gpu_bw, gpu_read) {
                    (Some(bw), _, 0) => Some(1.0 / (cpu_read as f64 / bw)),
                    (Some(bw), Some(g), _) => Some(1.0 / (cpu_read as f64 / bw + gpu_read as f64 / g)),
                    (None, Some(g), _) if cpu_read == 0 => Some(g / gpu_read as f64),
                    _ => None,
                };
                rows.push(Row {
                    ngl: ngl.to_string(),
                    n_gpu_layers: n_gpu,
                    test: format!("tg{n}"),
                    n_prompt: 0,
                    n_gen: n,
                    avg_ts: m,
                    stddev_ts: sd,
                    samples_ts: samples,
                    load_ms,
                    devices: devices.clone(),
                    read_bytes_per_token: read_total,
                    bandwidth_bytes_per_s: bw,
                    bound_ts: bound,
                    fraction_of_bound: bound.map(|b| m / b),
                    gpu_predicted_bytes: gpu_predicted,
                    gpu_measured_bytes: gpu_measured,
                });
            }
        }
        Ok(rows)
    })?;

    // the knee: the smallest -ngl whose tg reaches 90% of the best tg
    let tg: Vec<&Row> = rows.iter().filter(|r| r.n_gen > 0).collect();
    let knee = if a.ngl.len() > 1 && !tg.is_empty() {
        let best = tg.iter().map(|r| r.avg_ts).fold(0.0, f64::max);
        tg.iter().filter(|r| r.avg_ts >= 0.9 * best).min_by_key(|r| r.n_gpu_layers).map(|r| Knee {
            ngl: r.ngl.clone(),
            n_gpu_layers: r.n_gpu_layers,
            tg_ts: r.avg_ts,
            best_ts: best,
        })
    } else {
        None
    };
    let out = BenchOut {
        model: files.source.clone(),
        model_bytes: files.total_bytes(),
        params: files.n_params(),
        threads,
        bandwidth_bytes_per_s: bw,
        gpu_bandwidth_bytes_per_s: gpu_bw,
        rows,
        knee,
        notes,
    };
    match a.output {
        OutFormat::Json => println!("{}", serde_json::to_string_pretty(&out)?),
        OutFormat::Csv => print_csv(&out),
        OutFormat::Md => print_md(&out, &label),
    }
    Ok(())
}

fn device_cols(r: &Row) -> String {
    r.devices
        .iter()
        .map(|d| format!("{} [{},{}) {}", d.name, d.layers.0, d.layers.1, human_bytes(d.bytes)))
        .collect::<Vec<_>>()
        .join("; ")
}

fn print_csv(o: &BenchOut) {
    println!("model,model_bytes,params,threads,ngl,n_gpu_layers,test,n_prompt,n_gen,avg_ts,stddev_ts,devices,read_bytes_per_token,bound_ts,fraction_of_bound,gpu_predicted_bytes,gpu_measured_bytes");
    for r in &o.rows {
        println!(
            "\"{}\",{},{},{},{},{},{},{},{},{:.3},{:.3},\"{}\",{},{},{},{},{}",
            o.model,
            o.model_bytes,
            o.params,
            o.threads,
            r.ngl,
            r.n_gpu_layers,
            r.test,
            r.n_prompt,
            r.n_gen,
            r.avg_ts,
            r.stddev_ts,
            device_cols(r),
            r.read_bytes_per_token,
            r.bound_ts.map(|b| format!("{b:.3}")).unwrap_or_default(),
            r.fraction_of_bound.map(|b| format!("{b:.3}")).unwrap_or_default(),
            r.gpu_predicted_bytes.map(|b| b.to_string()).unwrap_or_default(),
            r.gpu_measured_bytes.map(|b| b.to_string()).unwrap_or_default()
        );
    }
}

fn print_md(o: &BenchOut, label: &str) {
    println!("| model | size | params | threads | ngl | test | t/s | devices |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for r in &o.rows {
        println!(
            "| {} | {} | {:.2} B | {} | {} | {} | {:.2} ± {:.2} | {} |",
            label,
            human_bytes(o.model_bytes),
            o.params as f64 / 1e9,
            o.threads,
            if r.ngl == r.n_gpu_layers.to_string() { r.ngl.clone() } else { format!("{} ({})", r.ngl, r.n_gpu_layers) },
            r.test,
            r.avg_ts,
            r.stddev_ts,
            device_cols(r)
        );
    }
    println!();
    if let Some(bw) = o.bandwidth_bytes_per_s {
        println!("memory read bandwidth ({} threads): {:.1} GB/s", o.threads, bw / 1e9);
    }
    if let Some(bw) = o.gpu_bandwidth_bytes_per_s {
        println!("GPU memory bandwidth (device copy): {:.1} GB/s", bw / 1e9);
    }
    for r in o.rows.iter().filter(|r| r.n_gen > 0) {
        if let (Some(p), Some(m)) = (r.gpu_predicted_bytes, r.gpu_measured_bytes) {
            println!(
                "-ngl {}: GPU bytes predicted {}, measured {} ({:+.1}%)",
                r.ngl,
                human_bytes(p),
                human_bytes(m),
                100.0 * (m as f64 - p as f64) / (p as f64).max(1.0)
            );
        }
    }
    for r in o.rows.iter().filter(|r| r.bound_ts.is_some()) {
        if let (Some(b), Some(f)) = (r.bound_ts, r.fraction_of_bound) {
            println!(
                "{} at -ngl {}: {} of weights read per token at {:.1} GB/s -> bound {:.2} t/s; achieved {:.2} t/s = {:.2} of the bound",
                r.test,
                r.ngl,
                human_bytes(r.read_bytes_per_token),
                r.bandwidth_bytes_per_s.unwrap_or(0.0) / 1e9,
                b,
                r.avg_ts,
                f
            );
        }
    }
    if let Some(k) = &o.knee {
        println!(
            "knee: -ngl {} ({} GPU layers) is the smallest reaching 90% of the best tg ({:.2} of {:.2} t/s)",
            k.ngl, k.n_gpu_layers, k.tg_ts, k.best_ts
        );
    }
    for n in &o.notes {
        println!("note: {n}");
    }
}
