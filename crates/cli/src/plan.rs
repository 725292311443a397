//! `brigade plan`: where each layer range would go on a cluster, or on this box, and why (no
//! model is loaded: only its header is read). This box is its measured figures
//! ([`crate::machine::Machine`]), its KV caches in the types the runtime allocates them in.

use anyhow::{bail, Context, Result};
use brigade_core::{bits_per_weight, Inventory, LlamaShape, ModelProfile, MoeShape};
use brigade_model::measure::Effort;
use brigade_model::ModelFiles;
use brigade_planner::{parse_cluster, plan, plan_with_second, svg, CpuMoe, Objective, PlanError, Policy};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum KvType {
    F16,
    F32,
}

impl KvType {
    fn bytes(self) -> u64 {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Model file (GGUF or a Hugging Face directory): only its header is read.
    #[arg(short = 'm', long = "model", conflicts_with_all = ["shape", "quant"])]
    pub model: Option<PathBuf>,
    /// A model shape instead of a file: llama-1b, llama-8b, llama-70b, qwen3-30b-a3b,
    /// qwen3-235b-a22b, mixtral-8x7b.
    #[arg(long, requires = "quant")]
    pub shape: Option<String>,
    /// The shape's quantization: f16, q8_0, q6_k, q4_k, q4_0.
    #[arg(long)]
    pub quant: Option<String>,
    /// The cluster file (TOML; see examples/clusters/). Default: this box, measured.
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// How this box is measured the first time (cached after), without --cluster: `full` or `quick`.
    #[arg(long = "measure", default_value = "full")]
    pub measure: Effort,
    #[arg(long, default_value = "latency")]
    pub objective: Objective,
    /// Context length in tokens.
    #[arg(long, default_value_t = 4096)]
    pub ctx: u64,
    /// Concurrent sessions.
    #[arg(long, default_value_t = 1)]
    pub sessions: u64,
    /// Share of each device's memory left free.
    #[arg(long, default_value_t = 0.10)]
    pub headroom: f64,
    /// The node where requests arrive (default: the first node).
    #[arg(long)]
    pub driver: Option<String>,
    /// Energy objective: allowed decode time as a multiple of the best latency.
    #[arg(long, default_value_t = 1.5)]
    pub slack: f64,
    /// Cap on the average power while decoding, in watts.
    #[arg(long = "max-watts")]
    pub max_watts: Option<f64>,
    /// KV cache element type (default: f16 on a cluster file; on this box, what the runtime
    /// allocates: f32 on the CPU, the activation type on a GPU).
    #[arg(long = "kv-type", value_enum)]
    pub kv_type: Option<KvType>,
    /// A second model kept whole on one device (file) …
    #[arg(long = "also-model", conflicts_with = "also_shape")]
    pub also_model: Option<PathBuf>,
    /// … or by shape.
    #[arg(long = "also-shape", requires = "also_quant")]
    pub also_shape: Option<String>,
    #[arg(long = "also-quant")]
    pub also_quant: Option<String>,
    #[command(flatten)]
    pub split: crate::common::SplitArgs,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Also write a picture of the plan.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

fn profile(model: Option<&PathBuf>, shape: Option<&String>, quant: Option<&String>, kv: u64) -> Result<ModelProfile> {
    match (model, shape, quant) {
        (Some(p), _, _) => Ok(open(p)?.profile(kv)),
        (None, Some(s), Some(q)) => {
            let bits = bits_per_weight(q)
                .with_context(|| format!("unknown quantization `{q}` (f16, q8_0, q6_k, q4_k, q4_0)"))?;
            let name = format!("{s} {q}");
            if let Some(moe) = MoeShape::preset(s) {
                return Ok(ModelProfile::from_moe_shape(&name, &moe, bits, kv));
            }
            let shape = LlamaShape::preset(s).with_context(|| {
                format!("unknown shape `{s}` ({}, {})", LlamaShape::PRESETS.join(", "), MoeShape::PRESETS.join(", "))
            })?;
            Ok(ModelProfile::from_shape(&name, &shape, bits, kv))
        }
        _ => bail!("give a model: -m FILE, or --shape and --quant"),
    }
}

fn open(p: &std::path::Path) -> Result<ModelFiles> {
    ModelFiles::open(p).with_context(|| format!("{} is not a model brigade can read", p.display()))
}

/// The inventory and the model's profile on it: a cluster file's devices, or this box measured.
fn inventory_and_profile(a: &PlanArgs) -> Result<(Inventory, ModelProfile)> {
    let kv = a.kv_type.unwrap_or(KvType::F16).bytes();
    if let Some(path) = &a.cluster {
        let main = profile(a.model.as_ref(), a.shape.as_ref(), a.quant.as_ref(), kv)?;
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let inv = parse_cluster(&text).with_context(|| format!("in {}", path.display()))?;
        return Ok((inv, main));
    }
    let machine = crate::machine::Machine::measure(&crate::common::detect_gpus(), a.measure)?;
    let (main, types) = match &a.model {
        Some(p) => {
            let files = open(p)?;
            let mut prof = crate::machine::profile(&files);
            if let Some(k) = a.kv_type {
                prof.kv_bytes_per_token = files.config.kv_bytes_per_token_layer(k.bytes());
                prof.cpu_kv_bytes_per_token = None;
            }
            (prof, crate::machine::weight_types(&files))
        }
        None => {
            // a GPU keeps a shape's cache in 16 bits (bf16, or f16 for f16 weights), the CPU in f32
            let mut prof = profile(None, a.shape.as_ref(), a.quant.as_ref(), kv)?;
            if a.kv_type.is_none() {
                prof.cpu_kv_bytes_per_token = Some(prof.kv_bytes_per_token * 2);
            }
            // the measured kernel of the shape's type (llama.cpp's Q4_K_M/S are mostly Q4_K)
            let q = a.quant.as_deref().unwrap_or_default().to_ascii_lowercase();
            let name = if q.starts_with("q4_k") { "q4_k".to_string() } else { q };
            let bytes = prof.total_weight_bytes();
            (prof, vec![(name, bytes)])
        }
    };
    Ok((machine.inventory(&types), main))
}

pub fn run_plan(a: PlanArgs) -> Result<()> {
    let (inv, main) = inventory_and_profile(&a)?;
    let kv = a.kv_type.unwrap_or(KvType::F16).bytes();
    let second = match (&a.also_model, &a.also_shape) {
        (None, None) => None,
        (m, s) => Some(profile(m.as_ref(), s.as_ref(), a.also_quant.as_ref(), kv)?),
    };
    let policy = Policy {
        objective: a.objective,
        ctx: a.ctx,
        sessions: a.sessions,
        headroom: a.headroom,
        driver: a.driver.clone(),
        slack: a.slack,
        max_watts: a.max_watts,
        reserved: Vec::new(),
        cpu_moe: a.split.layers().map_or(CpuMoe::Auto, CpuMoe::Layers),
    };
    let result = match &second {
        None => plan(&inv, &main, &policy).map(|p| (p, None)),
        Some(s) => plan_with_second(&inv, &main, s, &policy).map(|(p, q)| (p, Some(q))),
    };
    let (p, also) = match result {
        Ok(r) => r,
        Err(e) => {
            if a.json {
                let short = match &e {
                    PlanError::Infeasible { shortfall_bytes, .. } => Some(*shortfall_bytes),
                    _ => None,
                };
                println!("{}", serde_json::json!({"error": e.to_string(), "shortfall_bytes": short}));
                std::process::exit(1);
            }
            return Err(e.into());
        }
    };
    if let Some(path) = &a.svg {
        std::fs::write(path, svg::render(&p)).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if a.json {
        let mut v = serde_json::to_value(&p)?;
        if let (Some(obj), Some(q)) = (v.as_object_mut(), &also) {
            obj.insert("also_plan".into(), serde_json::to_value(q)?);
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", p.to_text());
        if let Some(q) = also {
            println!();
            print!("{}", q.to_text());
        }
    }
    Ok(())
}
