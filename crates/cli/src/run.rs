//! `brigade run`: llama.cpp's `llama-cli -no-cnv` for one prompt, on this box.

use crate::common::{context_len, detect_gpus, gpu_free, human_bytes, load_with_retry, open_model, place, GpuLayers};
use anyhow::{Context, Result};
use brigade_core::DeviceId;
use brigade_model::predict_slice_bytes;
use brigade_model::{Pipeline, Sampler, SamplerConfig};
use clap::Args;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Model: a GGUF file or a Hugging Face directory. Default: the small model built into brigade.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt", default_value = "")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Random seed (default: a random one, printed in the report).
    #[arg(short = 's', long = "seed")]
    pub seed: Option<u64>,
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Context size in tokens (default: the model's, at most 4096).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx: Option<usize>,
    /// Compute threads (default: the physical cores).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
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
    gpus: Vec<brigade_model::devices::CudaInfo>,
    timings: Timings,
    devices: Vec<DeviceOut>,
}

pub fn run(a: RunArgs) -> Result<()> {
    let t_load = Instant::now();
    let files = open_model(a.model.as_deref())?;
    let n_ctx = context_len(&files, a.ctx)?;
    let gpus = detect_gpus();
    let placement = place(&files, a.ngl, a.device_map.as_deref(), n_ctx, a.headroom, &gpus)?;
    if let Some(n) = &placement.notice {
        eprintln!("{n}");
    }
    let tk = files.tokenizer.clone();
    let prompt_ids = if a.chat {
        let rendered = tk.apply_chat_template(&[("user".to_string(), a.prompt.clone())])?;
        tk.encode_chat(&rendered)?
    } else {
        tk.encode(&a.prompt, true)?
    };
    if prompt_ids.is_empty() {
        anyhow::bail!("the prompt is empty and this model adds no BOS token: give a prompt with -p");
    }
    if prompt_ids.len() + a.n_predict > n_ctx {
        eprintln!(
            "note: prompt ({} tokens) + {} to generate exceed the context of {n_ctx}; generation stops when it is full",
            prompt_ids.len(),
            a.n_predict
        );
    }
    let seed = a.seed.unwrap_or_else(rand_seed);
    let sampler_cfg = SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
        seed,
        ..SamplerConfig::default()
    };
    let bar = indicatif::ProgressBar::new(placement.stages.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:30} {pos}/{len} stages {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let device = candle_core::Device::Cpu;
    let json = a.json;
    let n_predict = a.n_predict;
    let ignore_eos = a.ignore_eos;
    // Create the CUDA contexts first, so free memory measured around the load sees only what
    // the load allocates.
    let _contexts: Vec<candle_core::Device> = gpus
        .iter()
        .map(|g| brigade_model::pipeline::candle_device(DeviceId::Cuda(g.ordinal)))
        .collect::<Result<_, _>>()?;
    let free_before = gpu_free();
    let retry = a.ngl == Some(GpuLayers::Auto);
    let gpus_report = gpus.clone();
    let out = device.with_context(move || -> Result<RunOut> {
        let n_layers = files.config.n_layers;
        let (pipeline, stages, notes) = load_with_retry(n_layers, placement.stages.clone(), retry, |st| {
            bar.set_length(st.len() as u64);
            bar.set_position(0);
            Pipeline::load(&files, st, n_ctx, |_, s| {
                bar.set_message(format!("{} on {}", s.layers, s.device));
                bar.inc(1);
            })
        })
        .context("loading the model")?;
        bar.finish_and_clear();
        for n in &notes {
            eprintln!("{n}");
        }
        let predicted: Vec<u64> =
            stages.iter().map(|s| predict_slice_bytes(&files, s.layers, s.device, n_ctx).total()).collect();
        // The slices own their weights now; unmapping the file keeps the process's resident
        // memory equal to what the report below says it holds.
        let source = files.source.clone();
        drop(files);
        let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
        let mut session = pipeline.new_session()?;
        let mut sampler = Sampler::new(sampler_cfg);
        let mut generated = Vec::new();
        let prev = prompt_ids.last().copied();
        let mut stream = tk.stream(prev);
        let mut stdout = std::io::stdout().lock();
        if !json && !a.chat {
            let _ = write!(stdout, "{}", a.prompt);
            let _ = stdout.flush();
        }
        let stats = pipeline.generate(
            &mut session,
            &prompt_ids,
            n_predict,
            &mut sampler,
            |id| tk.is_eog(id),
            ignore_eos,
            |id| {
                generated.push(id);
                if !json {
                    let s = stream.push(id);
                    // a closed stdout (`| head`) ends generation instead of failing it
                    if write!(stdout, "{s}").and_then(|_| stdout.flush()).is_err() {
                        return false;
                    }
                }
                true
            },
        )?;
        if !json {
            let _ = writeln!(stdout, "{}", stream.finish());
        }
        let text = tk.decode(&generated, prev);
        // what each GPU lost to this process since before the load (weights, caches, scratch)
        let free_after = gpu_free();
        let measured = |d: DeviceId| -> Option<u64> {
            let DeviceId::Cuda(i) = d else { return None };
            let before = free_before.iter().find(|g| g.0 == i)?.1;
            let after = free_after.iter().find(|g| g.0 == i)?.1;
            Some(before.saturating_sub(after))
        };
        let devices = pipeline
            .report()
            .into_iter()
            .zip(&predicted)
            .map(|(r, &p)| DeviceOut {
                name: r.device.to_string(),
                layers: r.layers,
                bytes: r.weight_bytes + r.kv_bytes,
                weight_bytes: r.weight_bytes,
                kv_bytes: r.kv_bytes,
                predicted_bytes: p,
                measured_bytes: measured(r.device),
            })
            .collect();
        Ok(RunOut {
            model: source,
            text,
            prompt_ids,
            generated_ids: generated,
            stop: stats.stop,
            seed,
            n_ctx,
            gpus: gpus_report,
            timings: Timings {
                load_ms,
                prompt_tokens: stats.prompt_tokens,
                prompt_ms: stats.prompt_time.as_secs_f64() * 1e3,
                prompt_tokens_per_s: stats.prompt_tps(),
                generated_tokens: stats.generated,
                generation_ms: stats.gen_time.as_secs_f64() * 1e3,
                generation_tokens_per_s: stats.gen_tps(),
            },
            devices,
        })
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
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
        eprintln!(
            "device {:6}: layers [{}, {}) holds {} (weights {}, KV cache {}){measured}",
            d.name,
            d.layers.0,
            d.layers.1,
            human_bytes(d.bytes),
            human_bytes(d.weight_bytes),
            human_bytes(d.kv_bytes)
        );
    }
    Ok(())
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}
