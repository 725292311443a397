//! `brigade bench`: llama-bench's interface and table, plus the memory-bandwidth bound of decode,
//! the cost model's prediction for each placement (measured beside predicted: the calibration
//! check of the planner on this box) and the knee of an `-ngl` sweep.
//!
//! `-t 1,2` sweeps thread counts as llama-bench does; candle sizes its thread pools once per
//! process, so each count runs in a child process of this binary (`-o json`), and the rows are
//! merged here. Reporting is in `bench_report`.

use crate::bench_report::{BandwidthAt, BenchOut, DeviceBytes, Knee, OutFormat, Row};
use crate::common::{check_cpu_memory, detect_gpus, gpu_free, open_model, place, GpuLayers, MoeLayers};
use crate::machine::{predict, Machine};
use anyhow::{bail, Context, Result};
use brigade_core::{DeviceId, Inventory, ModelProfile, Stage};
use brigade_model::device::{activation_dtype, Accelerators};
use brigade_model::devices::CudaInfo;
use brigade_model::measure::Effort;
use brigade_model::weights::StoredType;
use brigade_model::{bandwidth, predict_split_bytes, Logits, ModelFiles, Pipeline};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;

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
    /// Context depths to run every test at, comma separated (llama-bench's `-d`): each test
    /// first reads that many tokens, untimed, so a `tg128 @ d4096` row is decode 4096 tokens in.
    #[arg(short = 'd', long = "n-depth", default_value = "0", value_delimiter = ',')]
    pub n_depth: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    pub reps: usize,
    /// Compute thread counts to test, comma separated (0 or less: every logical CPU; default: the
    /// physical cores). Each count runs in its own process.
    #[arg(short = 't', long = "threads", value_delimiter = ',', allow_negative_numbers = true)]
    pub threads: Vec<i64>,
    /// GPU layer counts to sweep, comma separated (`all` and `auto` allowed). Also `-ngl`.
    #[arg(long = "n-gpu-layers", default_value = "0", value_delimiter = ',')]
    pub ngl: Vec<GpuLayers>,
    /// Share of free GPU memory `auto` leaves unused.
    #[arg(long = "headroom", default_value_t = 0.10)]
    pub headroom: f64,
    /// Split layers to sweep with each `-ngl`, comma separated: the routed experts of the first
    /// N layers in RAM, computed by the CPU (`all`: llama.cpp's `--cpu-moe`). Default: none, or
    /// with `-ngl auto` what the planner chooses.
    #[arg(long = "n-cpu-moe", value_delimiter = ',')]
    pub n_cpu_moe: Vec<MoeLayers>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutFormat::Md)]
    pub output: OutFormat,
    /// Skip the memory bandwidth probe (and the bound it gives).
    #[arg(long = "no-bandwidth")]
    pub no_bandwidth: bool,
    /// Skip the untimed run of each prompt test before its repetitions (llama-bench's
    /// `--no-warmup`): without it the first repetition also pays for first use (buffers' pages,
    /// the AMX tile state).
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
    /// How this machine is measured for the predictions the first time (cached after): `full`
    /// or `quick`.
    #[arg(long = "measure", default_value = "full")]
    pub measure: Effort,
    /// Benchmark a deployment of a cluster instead (`-m` names the deployment).
    #[command(flatten)]
    pub connect: crate::cluster::Connect,
    /// A running OpenAI-compatible server to benchmark instead (`--url`).
    #[command(flatten)]
    pub http: crate::http_bench::HttpArgs,
    /// Concurrent clients to test, comma separated: through a cluster (`--coordinator`), a
    /// server (`--url`), or on a model file (`brigade serve` on it, started for the run).
    #[arg(long = "concurrency", default_value = "1", value_delimiter = ',')]
    pub concurrency: Vec<usize>,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    let served = a.http.url.is_some()
        || a.connect.coordinator.is_some()
        || a.concurrency.iter().any(|&c| c != 1)
        || a.http.asked().is_some();
    if served && a.n_depth.iter().any(|&d| d > 0) {
        bail!("-d (context depth) is a test of a model file in this process: not with --url, --coordinator, --concurrency or an HTTP test's flag");
    }
    if let Some(url) = a.http.url.clone() {
        return crate::http_bench::bench(crate::http_bench::HttpBench {
            url,
            model: a.model.map(|m| m.display().to_string()),
            api_key: a.connect.api_key,
            n_gen: a.n_gen.first().copied().unwrap_or(64).max(1),
            reps: a.reps.max(1),
            concurrency: a.concurrency,
            long_prompt: a.http.long_prompt,
            prompt: a.http.prompt(),
            json: a.output == OutFormat::Json,
        });
    }
    if a.connect.coordinator.is_some() {
        if let Some(flag) = a.http.asked() {
            bail!("{flag} is a test of an HTTP server: with --url, or --concurrency on a model file");
        }
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
    // a flag of the HTTP tests serves the file even for one client
    if a.concurrency.iter().any(|&c| c != 1) || a.http.asked().is_some() {
        return bench_served(a);
    }
    let out = if a.threads.len() > 1 { sweep(&a)? } else { bench_here(&a)? };
    crate::bench_report::print(&out, a.output)
}

/// Each thread count of `-t` in a child process of this binary; their rows together.
fn sweep(a: &BenchArgs) -> Result<BenchOut> {
    let exe = std::env::current_exe().context("finding the brigade binary")?;
    let join = |v: Vec<String>| std::ffi::OsString::from(v.join(","));
    let mut merged: Option<BenchOut> = None;
    for &t in &a.threads {
        let n = brigade_model::threads::resolve(Some(t))?;
        let mut args: Vec<std::ffi::OsString> =
            vec!["bench".into(), "-o".into(), "json".into(), "-t".into(), n.to_string().into()];
        if let Some(m) = &a.model {
            args.extend(["-m".into(), m.into()]);
        }
        args.extend(["-p".into(), join(a.n_prompt.iter().map(|x| x.to_string()).collect())]);
        args.extend(["-n".into(), join(a.n_gen.iter().map(|x| x.to_string()).collect())]);
        args.extend(["-d".into(), join(a.n_depth.iter().map(|x| x.to_string()).collect())]);
        args.extend(["-r".into(), a.reps.to_string().into()]);
        args.extend(["--n-gpu-layers".into(), join(a.ngl.iter().map(|g| g.to_string()).collect())]);
        args.extend(["--headroom".into(), a.headroom.to_string().into()]);
        if !a.n_cpu_moe.is_empty() {
            args.extend(["--n-cpu-moe".into(), join(a.n_cpu_moe.iter().map(|n| n.to_string()).collect())]);
        }
        args.extend(["--measure".into(), format!("{:?}", a.measure).to_lowercase().into()]);
        if a.no_bandwidth {
            args.push("--no-bandwidth".into());
        }
        if a.no_warmup {
            args.push("--no-warmup".into());
        }
        let out = std::process::Command::new(&exe)
            .args(&args)
            .envs(brigade_model::threads::child_env(n))
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("running the -t {n} benchmark"))?;
        if !out.status.success() {
            bail!("the -t {n} benchmark failed ({})", out.status);
        }
        let part: BenchOut =
            serde_json::from_slice(&out.stdout).with_context(|| format!("reading the -t {n} benchmark's report"))?;
        merged = Some(match merged {
            None => part,
            Some(m) => m.merge(part),
        });
    }
    merged.context("no thread counts")
}

/// What every placement of a benchmark shares.
struct Setup<'a> {
    files: &'a ModelFiles,
    args: &'a BenchArgs,
    threads: usize,
    gpus: Vec<CudaInfo>,
    n_ctx: usize,
    accelerators: Accelerators,
    bandwidth: Option<f64>,
    gpu_bandwidth: Option<f64>,
    /// This box measured, and the planner's view of the model on it (None if measuring failed).
    machine: Option<(Machine, Inventory, ModelProfile)>,
}

/// The benchmark in this process, with its thread count.
fn bench_here(a: &BenchArgs) -> Result<BenchOut> {
    let files = open_model(a.model.as_deref())?;
    let threads = brigade_model::threads::current();
    let gpus = detect_gpus();
    let longest = |v: &[usize]| v.iter().max().copied().unwrap_or(0);
    let n_ctx = longest(&a.n_depth) + longest(&a.n_prompt) + longest(&a.n_gen) + 16;
    let mut notes = kernel_notes(&files);
    let bandwidth = (!a.no_bandwidth).then(|| bandwidth::read_bandwidth(bandwidth::probe_bytes(), threads, 3));
    // CUDA devices opened first (free memory measured around each load sees only the load)
    let accelerators = Accelerators::open(&gpus.iter().map(|g| g.ordinal).collect::<Vec<_>>())?;
    let gpu_bandwidth = if a.no_bandwidth { None } else { accelerators.copy_bandwidth() };
    let machine = match Machine::measure(&gpus, a.measure) {
        Ok(m) => {
            let inv = m.inventory(&crate::machine::weight_types(&files));
            Some((m, inv, crate::machine::profile(&files)))
        }
        Err(e) => {
            notes.push(format!("no predictions: {e:#}"));
            None
        }
    };
    let setup = Setup { files: &files, args: a, threads, gpus, n_ctx, accelerators, bandwidth, gpu_bandwidth, machine };
    let rows = brigade_model::threads::with_compute_pool(|| -> Result<Vec<Row>> {
        let mut rows = Vec::new();
        let splits: Vec<Option<usize>> = match a.n_cpu_moe.is_empty() {
            true => vec![None],
            false => a.n_cpu_moe.iter().map(|n| Some(n.0)).collect(),
        };
        for &ngl in &a.ngl {
            for &n in &splits {
                rows.extend(bench_placement(&setup, ngl, n)?);
            }
        }
        Ok(rows)
    })?;
    Ok(BenchOut {
        model: files.source.clone(),
        model_bytes: files.total_bytes(),
        params: files.n_params(),
        cpu: brigade_model::devices::cpu_info().name,
        bandwidth: bandwidth.map(|b| BandwidthAt { threads, bytes_per_s: b }).into_iter().collect(),
        gpu_bandwidth_bytes_per_s: gpu_bandwidth,
        // (the knee of an -ngl sweep: with split layers swept too, rows of one -ngl differ)
        knees: if a.n_cpu_moe.len() > 1 { Vec::new() } else { knees(&rows, a.ngl.len()) },
        rows,
        notes,
    })
}

/// Which kernels this file's layer matrices go through on the CPU.
fn kernel_notes(files: &ModelFiles) -> Vec<String> {
    files
        .weight_types()
        .into_iter()
        .map(|(ty, bytes)| {
            let (decode, prompt) = match ty {
                StoredType::Ggml(d) => brigade_model::cpu_matmul::kernels(brigade_model::weights::ggml_dtype(d)),
                _ => ("candle matmul (dense)", "candle matmul (dense)"),
            };
            format!(
                "CPU kernels for {} ({}): decode {decode}, prompt {prompt}",
                ty.name(),
                crate::common::human_bytes(bytes)
            )
        })
        .collect()
}

/// Weight bytes one decode step reads on each device: every stage's weights except the
/// embedding table, of which a step reads one row (unless the head is tied to it); split
/// layers' experts (`cpu_moe`) on the CPU, where they are held.
fn read_bytes(files: &ModelFiles, stages: &[Stage], n_ctx: usize, cpu_moe: usize) -> Vec<(DeviceId, u64)> {
    let mut out = Vec::new();
    for s in stages {
        let b = predict_split_bytes(files, s.layers, s.device, n_ctx, cpu_moe);
        let embed = if s.layers.is_first() {
            files.device_bytes("token_embd.weight", s.device == DeviceId::Cpu, activation_dtype(s.device, files))
        } else {
            0
        };
        let tied_here = s.layers.is_last(files.config.n_layers) && files.tensor_info("output.weight").is_none();
        out.push((s.device, if tied_here { b.weights } else { b.weights.saturating_sub(embed) }));
        if b.host_experts > 0 {
            out.push((DeviceId::Cpu, b.host_experts));
        }
    }
    out
}

/// The token fed at position `i` of a benchmark (spread over the vocabulary).
fn token(vocab: usize, i: usize) -> u32 {
    ((i as u32).wrapping_mul(2_654_435_761) >> 7) % (vocab.max(1) as u32)
}

/// Loads one `-ngl` placement (with the experts of the first `cpu_moe` layers in RAM) and
/// times its prompt and generation tests.
fn bench_placement(s: &Setup, ngl: GpuLayers, cpu_moe: Option<usize>) -> Result<Vec<Row>> {
    let (files, a) = (s.files, s.args);
    s.accelerators.synchronize();
    let free_before = gpu_free();
    let placement = place(files, Some(ngl), None, cpu_moe, s.n_ctx, a.headroom, &s.gpus, || {
        s.machine.as_ref().map(|m| m.0.clone()).context("-ngl auto needs this machine's figures")
    })?;
    if let Some(n) = &placement.notice {
        eprintln!("{n}");
    }
    let stages = &placement.stages;
    let n_gpu: usize = stages.iter().filter(|s| s.device != DeviceId::Cpu).map(|s| s.layers.len()).sum();
    let split = placement.cpu_moe;
    check_cpu_memory(files, stages, s.n_ctx, split)?;
    let t0 = Instant::now();
    let pipeline = Pipeline::load_cpu_moe(files, stages, s.n_ctx, split, |_, _| {})
        .with_context(|| format!("loading for -ngl {ngl} --n-cpu-moe {split}"))?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let devices: Vec<DeviceBytes> = pipeline
        .report()
        .iter()
        .map(|r| DeviceBytes {
            name: r.device.to_string(),
            layers: r.layers,
            bytes: r.weight_bytes + r.kv_bytes,
            host_expert_bytes: r.host_expert_bytes,
        })
        .collect();
    let reads = read_bytes(files, stages, s.n_ctx, split);
    let read_total: u64 = reads.iter().map(|r| r.1).sum();
    let cpu_read: u64 = reads.iter().filter(|r| r.0 == DeviceId::Cpu).map(|r| r.1).sum();
    let (gpu_predicted, gpu_measured) = warm_up(s, &pipeline, stages, split, &free_before)?;
    let predicted =
        |p: Option<usize>| s.machine.as_ref().and_then(|(_, inv, prof)| predict(inv, prof, stages, s.n_ctx, split, p));
    let row = |test: String, n_prompt: usize, n_gen: usize, n_depth: usize, samples: Vec<f64>| {
        let (avg_ts, stddev_ts) = mean_std(&samples);
        // (as llama-bench names a test at a depth)
        let test = if n_depth > 0 { format!("{test} @ d{n_depth}") } else { test };
        Row {
            threads: s.threads,
            ngl: ngl.to_string(),
            n_gpu_layers: n_gpu,
            n_cpu_moe: split,
            test,
            n_prompt,
            n_gen,
            n_depth,
            avg_ts,
            stddev_ts,
            samples_ts: samples,
            load_ms,
            devices: devices.clone(),
            read_bytes_per_token: read_total,
            bandwidth_bytes_per_s: None,
            bound_ts: None,
            fraction_of_bound: None,
            predicted_ts: None,
            gpu_predicted_bytes: gpu_predicted,
            gpu_measured_bytes: gpu_measured,
        }
    };
    let mut rows = Vec::new();
    for &d in &a.n_depth {
        // (the cost model and the bound count weights, not a deep cache: at depth 0 only)
        let shallow = d == 0;
        for &p in a.n_prompt.iter().filter(|&&p| p > 0) {
            let samples = time_prompt(s, &pipeline, p, d)?;
            let predicted_ts = predicted(Some(p)).and_then(|x| x.prefill_tps).filter(|_| shallow);
            rows.push(Row { predicted_ts, ..row(format!("pp{p}"), p, 0, d, samples) });
        }
        for &n in a.n_gen.iter().filter(|&&n| n > 0) {
            let (samples, bw) = time_decode(s, &pipeline, n, d)?;
            let r = row(format!("tg{n}"), 0, n, d, samples);
            // floor: CPU-resident bytes at CPU bandwidth plus GPU-resident bytes at GPU bandwidth
            let gpu_read = read_total - cpu_read;
            let bound = match (bw, s.gpu_bandwidth, gpu_read) {
                (Some(bw), _, 0) => Some(bw / cpu_read.max(1) as f64),
                (Some(bw), Some(g), _) => Some(1.0 / (cpu_read as f64 / bw + gpu_read as f64 / g)),
                (None, Some(g), _) if cpu_read == 0 => Some(g / gpu_read as f64),
                _ => None,
            }
            .filter(|_| shallow);
            let predicted_ts = predicted(None).map(|x| x.decode_tps).filter(|_| shallow);
            rows.push(Row {
                bandwidth_bytes_per_s: bw,
                bound_ts: bound,
                fraction_of_bound: bound.map(|b| r.avg_ts / b),
                predicted_ts,
                ..r
            });
        }
    }
    Ok(rows)
}

/// First use of every kernel (and of the GPU's caches); GPU memory measured with one session
/// (its KV cache) alive: (bytes predicted on the GPUs, bytes they lost since before the load).
fn warm_up(
    s: &Setup,
    pipeline: &Pipeline,
    stages: &[Stage],
    cpu_moe: usize,
    free_before: &[(u32, u64)],
) -> Result<(Option<u64>, Option<u64>)> {
    let vocab = s.files.config.vocab;
    let mut session = pipeline.new_session()?;
    let w: Vec<u32> = (0..8).map(|i| token(vocab, i)).collect();
    pipeline.prefill(&mut session, &w, 512)?;
    pipeline.forward(&mut session, &[token(vocab, 9)], Logits::Last)?;
    if s.gpus.is_empty() {
        return Ok((None, None));
    }
    s.accelerators.synchronize();
    let free_after = gpu_free();
    let measured: u64 = free_before
        .iter()
        .filter_map(|(i, b)| free_after.iter().find(|x| x.0 == *i).map(|x| b.saturating_sub(x.1)))
        .sum();
    let predicted: u64 = stages
        .iter()
        .filter(|st| st.device != DeviceId::Cpu)
        .map(|st| predict_split_bytes(s.files, st.layers, st.device, s.n_ctx, cpu_moe).total())
        .sum();
    Ok((Some(predicted), Some(measured)))
}

/// Prompt tokens per second of each repetition of a `p`-token prefill (a fresh session each),
/// after one untimed run of it as llama-bench warms up (unless `--no-warmup`).
fn time_prompt(s: &Setup, pipeline: &Pipeline, p: usize, depth: usize) -> Result<Vec<f64>> {
    let prompt: Vec<u32> = (depth..depth + p).map(|i| token(s.files.config.vocab, i)).collect();
    if !s.args.no_warmup {
        let mut session = at_depth(s, pipeline, depth)?;
        pipeline.prefill(&mut session, &prompt, 512)?;
        s.accelerators.synchronize();
    }
    let mut samples = Vec::with_capacity(s.args.reps);
    for _ in 0..s.args.reps {
        let mut session = at_depth(s, pipeline, depth)?;
        let t = Instant::now();
        pipeline.prefill(&mut session, &prompt, 512)?;
        s.accelerators.synchronize();
        samples.push(p as f64 / t.elapsed().as_secs_f64().max(1e-9));
    }
    Ok(samples)
}

/// Decoded tokens per second of each repetition of `n` one-token steps, and the read bandwidth
/// the bound uses: this machine's bandwidth drifts (shared hosts), so the best measured before
/// the benchmark and right before and after each repetition.
fn time_decode(s: &Setup, pipeline: &Pipeline, n: usize, depth: usize) -> Result<(Vec<f64>, Option<f64>)> {
    let mut samples = Vec::with_capacity(s.args.reps);
    let mut bw = s.bandwidth;
    let probe = |bw: Option<f64>| bw.map(|b| b.max(bandwidth::read_bandwidth(bandwidth::probe_bytes(), s.threads, 2)));
    for _ in 0..s.args.reps {
        let mut session = at_depth(s, pipeline, depth)?;
        bw = probe(bw);
        let t = Instant::now();
        for i in 0..n {
            pipeline.forward(&mut session, &[token(s.files.config.vocab, depth + i + 1)], Logits::Last)?;
        }
        s.accelerators.synchronize();
        samples.push(n as f64 / t.elapsed().as_secs_f64().max(1e-9));
        bw = probe(bw);
    }
    Ok((samples, bw))
}

/// A new session that has read `depth` tokens (in the benchmark's prompt chunks), untimed.
fn at_depth(s: &Setup, pipeline: &Pipeline, depth: usize) -> Result<brigade_model::Session> {
    let mut session = pipeline.new_session()?;
    if depth > 0 {
        let context: Vec<u32> = (0..depth).map(|i| token(s.files.config.vocab, i)).collect();
        pipeline.prefill(&mut session, &context, 512)?;
        s.accelerators.synchronize();
    }
    Ok(session)
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n.max(1.0);
    let v = if xs.len() > 1 { xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (m, v.sqrt())
}

/// The knee of each thread count's `-ngl` sweep: the smallest GPU layer count whose tg reaches
/// 90% of the best tg.
pub fn knees(rows: &[Row], n_ngl: usize) -> Vec<Knee> {
    if n_ngl < 2 {
        return Vec::new();
    }
    let mut threads: Vec<usize> = rows.iter().map(|r| r.threads).collect();
    threads.dedup();
    threads
        .into_iter()
        .filter_map(|t| {
            let tg: Vec<&Row> = rows.iter().filter(|r| r.n_gen > 0 && r.threads == t).collect();
            let best = tg.iter().map(|r| r.avg_ts).fold(0.0, f64::max);
            tg.iter().filter(|r| r.avg_ts >= 0.9 * best).min_by_key(|r| r.n_gpu_layers).map(|r| Knee {
                threads: t,
                ngl: r.ngl.clone(),
                n_gpu_layers: r.n_gpu_layers,
                tg_ts: r.avg_ts,
                best_ts: best,
            })
        })
        .collect()
}

/// `--concurrency` on a model file: `brigade serve` on it (a child of this binary on a free
/// port, `--parallel` the largest level), measured through its HTTP API as `--url` measures any
/// server, then stopped.
fn bench_served(a: BenchArgs) -> Result<()> {
    use std::io::BufRead;
    let most = a.concurrency.iter().copied().max().unwrap_or(1);
    if a.concurrency.iter().any(|&c| c == 0 || c > 256) {
        bail!("--concurrency: 1 to 256 sessions on one box");
    }
    if a.threads.len() > 1 {
        bail!("-t: one thread count with --concurrency");
    }
    let exe = std::env::current_exe().context("finding the brigade binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["serve", "--port", "0", "--parallel", &most.to_string()]);
    if let Some(m) = &a.model {
        cmd.arg("-m").arg(m);
    }
    if let Some(t) = a.threads.first() {
        cmd.args(["-t", &t.to_string()]);
    }
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .context("starting brigade serve")?;
    // the child dies with this function, however it returns
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().context("the server's stdout")?;
    let _guard = Kill(child);
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).context("reading the server's address")?;
    let url = line
        .split("listening on ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .with_context(|| format!("brigade serve did not start: {line:?}"))?
        .to_string();
    crate::http_bench::bench(crate::http_bench::HttpBench {
        url,
        model: None,
        api_key: None,
        n_gen: a.n_gen.first().copied().unwrap_or(64).max(1),
        reps: a.reps.max(1),
        concurrency: a.concurrency,
        long_prompt: a.http.long_prompt,
        prompt: a.http.prompt(),
        json: a.output == OutFormat::Json,
    })
}
