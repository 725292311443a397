//! `brigade synth`: random-weight models of any Llama shape, for benchmarks and tests.

use crate::common::{human_bytes, human_params};
use anyhow::{bail, Result};
use brigade_model::synth::{write_gguf_with, write_safetensors_dir, Shape, SynthMoe, SynthMoeFamily, SynthType};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SynthFormat {
    Gguf,
    Safetensors,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Output: a .gguf file, or a directory for safetensors.
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// A real model's shape: llama-1b, llama-8b, llama-70b (Llama 3.x). Flags below override it.
    #[arg(long)]
    pub preset: Option<String>,
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub hidden: Option<usize>,
    #[arg(long)]
    pub ffn: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    #[arg(long = "kv-heads")]
    pub kv_heads: Option<usize>,
    #[arg(long)]
    pub vocab: Option<usize>,
    /// The context length the file declares.
    #[arg(long)]
    pub context: Option<usize>,
    /// Experts per layer in place of the dense feed-forward block (each expert of `--ffn`,
    /// softmax routing to the `--experts-used` best, in the layout of `--moe-family`). GGUF only.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts each token goes through (with --experts; default 2).
    #[arg(long = "experts-used", default_value_t = 2)]
    pub experts_used: usize,
    /// The experts' family (with --experts): mixtral (a `llama` GGUF, the chosen weights
    /// renormalised), qwen3moe (per-head q/k norms, renormalised) or olmoe (q and k normed whole,
    /// not renormalised).
    #[arg(long = "moe-family", default_value = "mixtral")]
    pub moe_family: SynthMoeFamily,
    /// Weight type: f32, f16, bf16, q8_0, q4_0, q4_k, q6_k (safetensors: f32, f16, bf16).
    #[arg(long = "type", default_value = "f16")]
    pub ty: SynthType,
    #[arg(long, value_enum, default_value_t = SynthFormat::Gguf)]
    pub format: SynthFormat,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn synth(a: SynthArgs) -> Result<()> {
    let mut shape = match &a.preset {
        Some(p) => Shape::preset(p).ok_or_else(|| {
            anyhow::anyhow!("unknown preset `{p}` ({})", brigade_core::LlamaShape::PRESETS.join(", "))
        })?,
        None => {
            let (Some(layers), Some(hidden), Some(heads)) = (a.layers, a.hidden, a.heads) else {
                bail!("give --preset, or at least --layers, --hidden and --heads");
            };
            Shape {
                layers,
                hidden,
                ffn: hidden * 4,
                heads,
                kv_heads: heads,
                vocab: 32000,
                context: 4096,
                rope_theta: 10000.0,
            }
        }
    };
    if let Some(v) = a.layers {
        shape.layers = v;
    }
    if let Some(v) = a.hidden {
        shape.hidden = v;
    }
    if let Some(v) = a.ffn {
        shape.ffn = v;
    }
    if let Some(v) = a.heads {
        shape.heads = v;
    }
    if let Some(v) = a.kv_heads {
        shape.kv_heads = v;
    }
    if let Some(v) = a.vocab {
        shape.vocab = v;
    }
    if let Some(v) = a.context {
        shape.context = v;
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("writing {bar:30} {pos}/{len} tensors")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let progress = |i: usize, n: usize| {
        bar.set_length(n as u64);
        bar.set_position(i as u64);
    };
    let moe = a.experts.map(|experts| SynthMoe { experts, used: a.experts_used, family: a.moe_family });
    let t0 = std::time::Instant::now();
    let bytes = match a.format {
        SynthFormat::Gguf => write_gguf_with(&a.output, &shape, moe, a.ty, a.seed, progress)?,
        SynthFormat::Safetensors if moe.is_some() => bail!("--experts: synth writes experts as GGUF only"),
        SynthFormat::Safetensors => write_safetensors_dir(&a.output, &shape, a.ty, a.seed, progress)?,
    };
    bar.finish_and_clear();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"output": a.output, "bytes": bytes, "params": shape.params_with(moe), "shape": shape, "experts": moe, "seconds": t0.elapsed().as_secs_f64()})
        );
    } else {
        eprintln!(
            "wrote {} ({}, {} params, {} layers, hidden {}, ffn {}, {}/{} heads, vocab {}) in {:.1} s",
            a.output.display(),
            human_bytes(bytes),
            human_params(shape.params_with(moe)),
            shape.layers,
            shape.hidden,
            shape.ffn,
            shape.heads,
            shape.kv_heads,
            shape.vocab,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
