//! `brigade run`: llama.cpp's `llama-cli -no-cnv` for one prompt, on this box.

use crate::common::{
    check_cpu_memory, gpu_free, human_bytes, load_with_retry, n_predict, GpuLayers, ModelArgs, Placed, Placement,
    SamplingArgs, SpecArgs,
};
use anyhow::{Context, Result};
use brigade_core::{DeviceId, Stage};
use brigade_model::device::Accelerators;
use brigade_model::devices::CudaInfo;
use brigade_model::speculative::Drafter;
use brigade_model::{
    predict_split_bytes, GenerationStats, ModelFiles, Pipeline, Sampler, SamplingParams, SliceBytes, Tokenizer,
};
use clap::Args;
use serde::Serialize;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub common: ModelArgs,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt", default_value = "")]
    pub prompt: String,
    /// Tokens to generate; -1: until an end of text or a full context.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128, allow_negative_numbers = true)]
    pub n_predict: i64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Treat the prompt as a user message and render the model's chat template.
    #[arg(long = "chat")]
    pub chat: bool,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long = "json")]
    pub json: bool,
}

#[derive(Serialize)]
struct DeviceOut {
    name: String,
    layers: (usize, usize),
    bytes: u64,
    weight_bytes: u64,
    kv_bytes: u64,
    /// What brigade predicted before loading.
    predicted_bytes: u64,
    /// Split layers: the stage's routed experts held in RAM apart from the device, as held and
    /// as predicted (0 with whole layers).
    host_expert_bytes: u64,
    predicted_host_expert_bytes: u64,
    /// CUDA only: free memory before the load minus free memory at the end (all stages on the
    /// device together).
    #[serde(skip_serializing_if = "Option::is_none")]
    measured_bytes: Option<u64>,
}

#[derive(Serialize)]
struct Timings {
    load_ms: f64,
    prompt_tokens: usize,
    prompt_ms: f64,
    prompt_tokens_per_s: f64,
    generated_tokens: usize,
    generation_ms: f64,
    generation_tokens_per_s: f64,
    /// Decode passes (one token each without speculative decoding).
    decode_passes: usize,
    /// Speculative decoding: drafted tokens fed, and of them taken.
    drafted_tokens: usize,
    accepted_tokens: usize,
}

#[derive(Serialize)]
struct RunOut {
    model: String,
    text: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    stop: brigade_model::pipeline::StopReason,
    seed: u64,
    n_ctx: usize,
    /// Split layers: the routed experts of layers `[0, n_cpu_moe)` were held in RAM (given, or
    /// what `-ngl auto` chose); 0: whole layers.
    n_cpu_moe: usize,
    gpus: Vec<brigade_model::devices::CudaInfo>,
    timings: Timings,
    devices: Vec<DeviceOut>,
}

/// What `run` decided before loading anything.
struct Prepared {
    files: ModelFiles,
    n_ctx: usize,
    n_predict: usize,
    placement: Placement,
    prompt_ids: Vec<u32>,
    sampler: SamplingParams,
    gpus: Vec<CudaInfo>,
}

pub fn run(a: RunArgs) -> Result<()> {
    let t_load = Instant::now();
    let prep = prepare(&a)?;
    let json = a.json;
    let out = brigade_model::threads::with_compute_pool(move || generate(a, prep, t_load))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        report(&out);
    }
    Ok(())
}

/// The model, the context, the placement, the prompt's tokens and the sampler.
fn prepare(a: &RunArgs) -> Result<Prepared> {
    let n_predict = n_predict(a.n_predict)?;
    let Placed { files, n_ctx, gpus, placement } = a.common.open_and_place()?;
    check_cpu_memory(&files, &placement.stages, n_ctx, placement.cpu_moe)?;
    let tk = &files.tokenizer;
    let prompt_ids = if a.chat {
        let rendered = tk.apply_chat_template(&[("user".to_string(), a.prompt.clone())])?;
        tk.encode_chat(&rendered)?
    } else {
        tk.encode(&a.prompt, true)?
    };
    if prompt_ids.is_empty() {
        anyhow::bail!("the prompt is empty and this model adds no BOS token: give a prompt with -p");
    }
    if n_predict != usize::MAX && prompt_ids.len().saturating_add(n_predict) > n_ctx {
        eprintln!(
            "note: prompt ({} tokens) + {n_predict} to generate exceed the context of {n_ctx}; generation stops when it is full",
            prompt_ids.len(),
        );
    }
    let sampler = a.sampling.params()?;
    Ok(Prepared { files, n_ctx, n_predict, placement, prompt_ids, sampler, gpus })
}

/// Loads the stages (with fewer GPU layers on an out-of-memory under `-ngl auto`), with a
/// progress bar; returns the pipeline, the stages loaded and the bytes predicted for each.
fn load(prep: &Prepared, retry: bool) -> Result<(Pipeline, Vec<SliceBytes>)> {
    let bar = indicatif::ProgressBar::new(prep.placement.stages.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:30} {pos}/{len} stages {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let files = &prep.files;
    let (pipeline, stages, notes) =
        load_with_retry(files.config.n_layers, prep.placement.stages.clone(), retry, |st| {
            bar.set_length(st.len() as u64);
            bar.set_position(0);
            Pipeline::load_cpu_moe(files, st, prep.n_ctx, prep.placement.cpu_moe, |_, s| {
                bar.set_message(format!("{} on {}", s.layers, s.device));
                bar.inc(1);
            })
        })
        .context("loading the model")?;
    bar.finish_and_clear();
    for n in &notes {
        eprintln!("{n}");
    }
    let cpu_moe = prep.placement.cpu_moe;
    let predicted =
        stages.iter().map(|s: &Stage| predict_split_bytes(files, s.layers, s.device, prep.n_ctx, cpu_moe)).collect();
    Ok((pipeline, predicted))
}

/// Loads, generates (streaming the text unless `--json`), and gathers the report.
fn generate(a: RunArgs, prep: Prepared, t_load: Instant) -> Result<RunOut> {
    // Open the CUDA devices first, so free memory measured around the load sees only what the
    // load allocates.
    let ordinals: Vec<u32> = prep.gpus.iter().map(|g| g.ordinal).collect();
    let _accelerators = Accelerators::open(&ordinals)?;
    let free_before = gpu_free();
    let (pipeline, predicted) = load(&prep, a.common.ngl == Some(GpuLayers::Auto))?;
    let n_cpu_moe = prep.placement.cpu_moe;
    let Prepared { files, n_ctx, n_predict, prompt_ids, sampler, gpus, .. } = prep;
    let tk: Arc<Tokenizer> = files.tokenizer.clone();
    // The slices own their weights now; unmapping the file keeps the process's resident memory
    // equal to what the report says it holds.
    let source = files.source.clone();
    drop(files);
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    let seed = sampler.seed;
    let mut session = pipeline.new_session()?;
    let mut generated = Vec::new();
    let prev = prompt_ids.last().copied();
    let mut stream = tk.stream(prev);
    let mut stdout = std::io::stdout().lock();
    if !a.json && !a.chat {
        let _ = write!(stdout, "{}", a.prompt);
        let _ = stdout.flush();
    }
    let spec = a.spec.speculation(&tk, n_ctx)?;
    let mut drafter = spec.map(|s| Drafter::new(s, pipeline.vocab())).transpose()?;
    let stats = pipeline.generate_with(
        &mut session,
        &prompt_ids,
        n_predict,
        &mut Sampler::new(sampler),
        |id| tk.is_eog(id),
        a.ignore_eos,
        drafter.as_mut(),
        |id| {
            generated.push(id);
            if !a.json {
                let s = stream.push(id);
                // a closed stdout (`| head`) ends generation instead of failing it
                if write!(stdout, "{s}").and_then(|_| stdout.flush()).is_err() {
                    return false;
                }
            }
            true
        },
    )?;
    if !a.json {
        let _ = writeln!(stdout, "{}", stream.finish());
    }
    let text = tk.decode(&generated, prev);
    let devices = device_report(&pipeline, &predicted, &free_before);
    Ok(RunOut {
        model: source,
        text,
        prompt_ids,
        generated_ids: generated,
        stop: stats.stop,
        seed,
        n_ctx,
        n_cpu_moe,
        gpus,
        timings: timings(load_ms, &stats),
        devices,
    })
}

fn timings(load_ms: f64, stats: &GenerationStats) -> Timings {
    Timings {
        load_ms,
        prompt_tokens: stats.prompt_tokens,
        prompt_ms: stats.prompt_time.as_secs_f64() * 1e3,
        prompt_tokens_per_s: stats.prompt_tps(),
        generated_tokens: stats.generated,
        generation_ms: stats.gen_time.as_secs_f64() * 1e3,
        generation_tokens_per_s: stats.gen_tps(),
        decode_passes: stats.decode_steps,
        drafted_tokens: stats.drafted,
        accepted_tokens: stats.accepted,
    }
}

/// Each stage's bytes, as held, as predicted and (CUDA) as measured: what each GPU lost to this
/// process since before the load (weights, caches, scratch).
fn device_report(pipeline: &Pipeline, predicted: &[SliceBytes], free_before: &[(u32, u64)]) -> Vec<DeviceOut> {
    let free_after = gpu_free();
    let measured = |d: DeviceId| -> Option<u64> {
        let DeviceId::Cuda(i) = d else { return None };
        let before = free_before.iter().find(|g| g.0 == i)?.1;
        let after = free_after.iter().find(|g| g.0 == i)?.1;
        Some(before.saturating_sub(after))
    };
    pipeline
        .report()
        .into_iter()
        .zip(predicted)
        .map(|(r, p)| DeviceOut {
            name: r.device.to_string(),
            layers: r.layers,
            bytes: r.weight_bytes + r.kv_bytes,
            weight_bytes: r.weight_bytes,
            kv_bytes: r.kv_bytes,
            predicted_bytes: p.total(),
            host_expert_bytes: r.host_expert_bytes,
            predicted_host_expert_bytes: p.host_experts,
            measured_bytes: measured(r.device),
        })
        .collect()
}

/// llama.cpp's timing lines and brigade's device lines, on stderr.
fn report(out: &RunOut) {
    let t = &out.timings;
    eprintln!();
    eprintln!("model       : {} (ctx {}, seed {})", out.model, out.n_ctx, out.seed);
    eprintln!("load time   : {:10.2} ms", t.load_ms);
    eprintln!(
        "prompt eval : {:10.2} ms / {:5} tokens ({:8.2} tokens/s)",
        t.prompt_ms, t.prompt_tokens, t.prompt_tokens_per_s
    );
    eprintln!(
        "generation  : {:10.2} ms / {:5} tokens ({:8.2} tokens/s)",
        t.generation_ms, t.generated_tokens, t.generation_tokens_per_s
    );
    if t.drafted_tokens > 0 {
        eprintln!(
            "drafts      : {} of {} drafted tokens taken, {} decode passes",
            t.accepted_tokens, t.drafted_tokens, t.decode_passes
        );
    }
    for g in &out.gpus {
        eprintln!(
            "gpu cuda{}   : {}, {} total, {} free at start",
            g.ordinal,
            g.name,
            human_bytes(g.memory_total),
            human_bytes(g.memory_free)
        );
    }
    for d in &out.devices {
        let measured = d
            .measured_bytes
            .map(|m| {
                format!("; predicted {}, measured {} on the device", human_bytes(d.predicted_bytes), human_bytes(m))
            })
            .unwrap_or_default();
        let host = match d.host_expert_bytes {
            0 => String::new(),
            b => format!(
                "; experts in RAM {} (predicted {})",
                human_bytes(b),
                human_bytes(d.predicted_host_expert_bytes)
            ),
        };
        eprintln!(
            "device {:6}: layers [{}, {}) holds {} (weights {}, KV cache {}){measured}{host}",
            d.name,
            d.layers.0,
            d.layers.1,
            human_bytes(d.bytes),
            human_bytes(d.weight_bytes),
            human_bytes(d.kv_bytes)
        );
    }
}
