//! Random-weight models of any Llama shape, written as GGUF (loadable by brigade and llama.cpp)
//! or as a Hugging Face safetensors directory. The same seed gives the same weights in both
//! formats (GGUF's Q and K rows permuted for its interleaved rotary layout, as llama.cpp's
//! converter does), so the two can be checked against each other.

use crate::config::{Arch, ModelConfig, RopeScaling, RopeStyle};
use crate::gguf::{self, TensorSpec, Value};
use crate::tokenizer::{synthetic_bpe_vocab, synthetic_tokenizer_json, CHATML_TEMPLATE};
use crate::weights::gguf_to_hf_name;
use crate::ModelError;
use brigade_format::tensors::{shape_of, Dim, LayerTensor, OUTPUT, OUTPUT_NORM, TOKEN_EMBD};
use brigade_format::GgmlType;
use candle_core::quantized::k_quants::{self, BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8_0};
use rayon::prelude::*;
use serde::Serialize;
use std::io::{BufWriter, Write};
use std::path::Path;

/// A Llama shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Shape {
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_theta: f32,
}

impl Shape {
    /// The shapes of Llama 3.2 1B, Llama 3.1 8B and Llama 3.1 70B (the planner's presets,
    /// [`brigade_core::LlamaShape::preset`]), with their context and rope theta. Synth always
    /// writes an untied head.
    pub fn preset(name: &str) -> Option<Shape> {
        let s = brigade_core::LlamaShape::preset(name)?;
        Some(Shape {
            layers: s.layers,
            hidden: s.hidden,
            ffn: s.ffn,
            heads: s.heads,
            kv_heads: s.kv_heads,
            vocab: s.vocab,
            context: 131_072,
            rope_theta: 500_000.0,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |w: String| Err(ModelError::BadConfig(w));
        if self.layers == 0 || self.hidden == 0 || self.ffn == 0 || self.heads == 0 || self.kv_heads == 0 {
            return bad("every dimension must be nonzero".into());
        }
        if !self.hidden.is_multiple_of(self.heads)
            || !self.heads.is_multiple_of(self.kv_heads)
            || !self.head_dim().is_multiple_of(2)
        {
            return bad(format!(
                "hidden {} over {} heads over {} kv heads does not give an even head size",
                self.hidden, self.heads, self.kv_heads
            ));
        }
        if self.vocab < 260 {
            return bad(format!("vocab {} is below the 256 byte tokens + 4 specials a tokenizer needs", self.vocab));
        }
        if !self.hidden.is_multiple_of(32) || !self.ffn.is_multiple_of(32) {
            return bad(format!("hidden {} and ffn {} must be multiples of 32", self.hidden, self.ffn));
        }
        Ok(())
    }

    /// The configuration a model of this shape declares (untied head, no biases), with `moe`'s
    /// experts in place of the dense feed-forward blocks.
    fn config_with(&self, moe: Option<SynthMoe>) -> ModelConfig {
        let family = moe.map_or(Arch::Llama, |m| m.family.arch()).family();
        ModelConfig {
            arch: family.arch,
            n_layers: self.layers,
            hidden: self.hidden,
            ffn: self.ffn,
            n_heads: self.heads,
            n_kv_heads: self.kv_heads,
            head_dim: self.head_dim(),
            vocab: self.vocab,
            rope_theta: self.rope_theta,
            rope_style: family.gguf_rope,
            rope_scaling: RopeScaling::None,
            rms_eps: 1e-5,
            context_length: self.context,
            layer: family.layer,
            sliding_window: None,
            swa_layers: None,
            window_pass: None,
            rope_theta_local: None,
            embed_scale: None,
            norm_offset: 0.0,
            query_pre_attn_scalar: None,
            attn_softcap: None,
            final_softcap: None,
            tie_word_embeddings: Some(false),
            dtype: None,
            moe: moe.map(|m| brigade_format::config::Moe {
                experts: m.experts,
                used: m.used,
                ffn: self.ffn,
                norm_topk: family.norm_topk,
                shared_ffn: None,
            }),
        }
    }

    /// Parameters (weights) of the model, embedding and head included (untied).
    pub fn params(&self) -> u64 {
        self.params_with(None)
    }

    /// Parameters with `moe`'s experts (each of `ffn`) and routers: the elements of every
    /// tensor synth writes for them (0 for a shape it refuses).
    pub fn params_with(&self, moe: Option<SynthMoe>) -> u64 {
        tensor_list(self, moe).map_or(0, |t| t.iter().map(|(_, rows, cols, _)| (rows * cols) as u64).sum())
    }
}

/// Experts in place of every layer's dense feed-forward block, each of the shape's `ffn`, in
/// the layout of `family`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SynthMoe {
    pub experts: usize,
    pub used: usize,
    pub family: SynthMoeFamily,
}

/// The mixture-of-experts families synth writes, as llama.cpp's converter writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SynthMoeFamily {
    /// Mixtral: a `llama` GGUF with `expert_count`, q and k rows permuted for llama.cpp's rope,
    /// the `used` best weights renormalised.
    Mixtral,
    /// Qwen3-MoE (`qwen3moe`): per-head q/k norms, NEOX rope, renormalised.
    Qwen3Moe,
    /// OLMoE (`olmoe`): q and k normed whole, NEOX rope, not renormalised.
    Olmoe,
}

impl SynthMoeFamily {
    /// The family's row in brigade's table (Mixtral's files are `llama` ones).
    fn arch(self) -> Arch {
        match self {
            SynthMoeFamily::Mixtral => Arch::Llama,
            SynthMoeFamily::Qwen3Moe => Arch::Qwen3Moe,
            SynthMoeFamily::Olmoe => Arch::Olmoe,
        }
    }
}

impl std::str::FromStr for SynthMoeFamily {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "mixtral" => SynthMoeFamily::Mixtral,
            "qwen3moe" | "qwen3-moe" => SynthMoeFamily::Qwen3Moe,
            "olmoe" => SynthMoeFamily::Olmoe,
            other => return Err(format!("unknown MoE family `{other}` (mixtral, qwen3moe, olmoe)")),
        })
    }
}

/// The element types synth writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4K,
    Q6K,
}

impl std::str::FromStr for SynthType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => SynthType::F32,
            "f16" => SynthType::F16,
            "bf16" => SynthType::BF16,
            "q8_0" => SynthType::Q8_0,
            "q4_0" => SynthType::Q4_0,
            "q4_k" | "q4_k_s" | "q4_k_m" => SynthType::Q4K,
            "q6_k" => SynthType::Q6K,
            other => return Err(format!("unknown type `{other}` (f32, f16, bf16, q8_0, q4_0, q4_k, q6_k)")),
        })
    }
}

impl SynthType {
    fn ggml(self) -> GgmlType {
        match self {
            SynthType::F32 => GgmlType::F32,
            SynthType::F16 => GgmlType::F16,
            SynthType::BF16 => GgmlType::BF16,
            SynthType::Q8_0 => GgmlType::Q8_0,
            SynthType::Q4_0 => GgmlType::Q4_0,
            SynthType::Q4K => GgmlType::Q4K,
            SynthType::Q6K => GgmlType::Q6K,
        }
    }

    /// llama.cpp's `general.file_type` for a file of this type.
    fn file_type(self) -> u32 {
        match self {
            SynthType::F32 => 0,
            SynthType::F16 => 1,
            SynthType::Q4_0 => 2,
            SynthType::Q8_0 => 7,
            SynthType::Q4K => 14,
            SynthType::Q6K => 18,
            SynthType::BF16 => 32,
        }
    }
}

/// A row of `len` elements can be stored as `dt` (whole blocks), else llama.cpp's fallback.
fn type_for_row(dt: GgmlType, len: usize) -> GgmlType {
    if len.is_multiple_of(dt.block_size()) {
        dt
    } else if len.is_multiple_of(32) {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    }
}

/// The tensors of a model of `shape` (the layers' from [`LayerTensor`]'s table): (GGUF name,
/// rows, cols, kind). Stacked experts `[experts, out, in]` are `experts × out` rows of `in`.
fn tensor_list(shape: &Shape, moe: Option<SynthMoe>) -> Result<Vec<(String, usize, usize, Init)>, ModelError> {
    let cfg = shape.config_with(moe);
    let entry = |name: String, dims: Vec<usize>| {
        let init = if dims.len() == 1 { Init::Norm } else { Init::Weight };
        let (rows, cols) = match dims[..] {
            [cols] => (1, cols),
            [rows, cols] => (rows, cols),
            [experts, rows, cols] => (experts * rows, cols),
            _ => (0, 0),
        };
        (name, rows, cols, init)
    };
    let global = |name: &str, dims: &[Dim]| Ok::<_, ModelError>(entry(name.to_string(), shape_of(dims, &cfg)?));
    let mut t = vec![global(TOKEN_EMBD, &[Dim::Vocab, Dim::Hidden])?];
    for i in 0..shape.layers {
        for lt in LayerTensor::required_in(&cfg) {
            t.push(entry(lt.name(i), lt.shape(&cfg)?));
        }
    }
    t.push(global(OUTPUT_NORM, &[Dim::Hidden])?);
    t.push(global(OUTPUT, &[Dim::Vocab, Dim::Hidden])?);
    Ok(t)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Init {
    Weight,
    Norm,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

const ROWS_PER_CHUNK: usize = 16;

/// The values of one tensor in Hugging Face orientation `[rows, cols]`, deterministic in
/// (seed, name) and independent of the thread count.
fn values(seed: u64, name: &str, rows: usize, cols: usize, init: Init) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    let base = splitmix(seed ^ name_hash(name));
    // uniform on [-a, a] with standard deviation 0.02, as a freshly initialised Llama
    let a = 0.02f32 * 3f32.sqrt();
    out.par_chunks_mut(ROWS_PER_CHUNK * cols).enumerate().for_each(|(ci, chunk)| {
        let mut s = splitmix(base ^ (ci as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        for x in chunk.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            *x = match init {
                Init::Weight => (2.0 * u - 1.0) * a,
                Init::Norm => 1.0 + (u - 0.5) * 0.2,
            };
        }
    });
    out
}

/// HF's Q/K row order to llama.cpp's: within each head, row `j * d/2 + i` moves to `2i + j`.
fn permute_rows_for_gguf(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let d = rows / n_head;
    let mut out = vec![0f32; w.len()];
    out.par_chunks_mut(cols).enumerate().for_each(|(r, dst)| {
        let (h, rem) = (r / d, r % d);
        let (i, j) = (rem / 2, rem % 2);
        let src = h * d + j * (d / 2) + i;
        dst.copy_from_slice(&w[src * cols..(src + 1) * cols]);
    });
    out
}

/// Rounds values as a checkpoint of type `ty` would hold them (16-bit types only).
fn round_through(xs: &mut [f32], ty: SynthType) {
    match ty {
        SynthType::F16 => xs.iter_mut().for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
        SynthType::BF16 => xs.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
        _ => {}
    }
}

fn quantize<T: k_quants::GgmlType + crate::cpu_matmul::blocks::Block + Send + Sync>(
    xs: &[f32],
    cols: usize,
) -> Vec<u8> {
    let blocks_per_row = cols / T::BLCK_SIZE;
    let rows = xs.len() / cols;
    let mut blocks = vec![T::zeros(); rows * blocks_per_row];
    blocks.par_chunks_mut(blocks_per_row * ROWS_PER_CHUNK).zip(xs.par_chunks(cols * ROWS_PER_CHUNK)).for_each(
        |(dst, src)| {
            T::from_float(src, dst);
        },
    );
    crate::cpu_matmul::blocks::as_bytes(&blocks).to_vec()
}

fn encode(xs: &[f32], cols: usize, dt: GgmlType, out: &mut Vec<u8>) {
    match dt {
        GgmlType::F32 => out.extend(xs.iter().flat_map(|x| x.to_le_bytes())),
        GgmlType::F16 => out.extend(xs.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes())),
        GgmlType::BF16 => out.extend(xs.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())),
        GgmlType::Q8_0 => out.extend(quantize::<BlockQ8_0>(xs, cols)),
        GgmlType::Q4_0 => out.extend(quantize::<BlockQ4_0>(xs, cols)),
        GgmlType::Q4K => out.extend(quantize::<BlockQ4K>(xs, cols)),
        GgmlType::Q6K => out.extend(quantize::<BlockQ6K>(xs, cols)),
        _ => unreachable!("synth writes only the types of SynthType"),
    }
}

fn gguf_metadata(shape: &Shape, ty: SynthType, name: &str, arch: &str) -> Vec<(String, Value)> {
    let (tokens, types, merges) = synthetic_bpe_vocab(shape.vocab);
    let n = tokens.len() as u32;
    let s = |k: &str, v: &str| (k.to_string(), Value::String(v.to_string()));
    // the architecture's own keys, `{arch}.{key}`
    let u = |k: &str, v: usize| (format!("{arch}.{k}"), Value::U32(v as u32));
    let f = |k: &str, v: f32| (format!("{arch}.{k}"), Value::F32(v));
    vec![
        s("general.architecture", arch),
        s("general.name", name),
        ("general.file_type".into(), Value::U32(ty.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        u("context_length", shape.context),
        u("embedding_length", shape.hidden),
        u("block_count", shape.layers),
        u("feed_forward_length", shape.ffn),
        u("rope.dimension_count", shape.head_dim()),
        u("attention.head_count", shape.heads),
        u("attention.head_count_kv", shape.kv_heads),
        f("attention.layer_norm_rms_epsilon", 1e-5),
        f("rope.freq_base", shape.rope_theta),
        u("vocab_size", shape.vocab),
        s("tokenizer.ggml.model", "gpt2"),
        s("tokenizer.ggml.pre", "gpt-2"),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.merges".into(), Value::Array(merges.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(n - 4)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(n - 3)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        s("tokenizer.chat_template", CHATML_TEMPLATE),
    ]
}

/// Writes a GGUF model of `shape` with weights of type `ty`; returns the file size. Matrices
/// whose rows are not whole blocks of `ty` fall back to q8_0 or f16 (as llama.cpp does), and
/// with q4_k the output head is q6_k (llama.cpp's Q4_K layout).
pub fn write_gguf(
    path: &Path,
    shape: &Shape,
    ty: SynthType,
    seed: u64,
    progress: impl FnMut(usize, usize),
) -> Result<u64, ModelError> {
    write_gguf_with(path, shape, None, ty, seed, progress)
}

/// [`write_gguf`] of a model with `moe`'s experts: the experts of a layer stacked in
/// `ffn_{gate,up,down}_exps` (expert-major, llama.cpp's layout), the router `ffn_gate_inp` in
/// f32 (llama.cpp keeps it so), `llama.expert_count` and `llama.expert_used_count` set.
pub fn write_gguf_with(
    path: &Path,
    shape: &Shape,
    moe: Option<SynthMoe>,
    ty: SynthType,
    seed: u64,
    mut progress: impl FnMut(usize, usize),
) -> Result<u64, ModelError> {
    shape.validate()?;
    if let Some(m) = moe {
        shape.config_with(moe).validate()?;
        if m.experts > 256 {
            return Err(ModelError::BadConfig(format!("{} experts: synth writes at most 256", m.experts)));
        }
    }
    let list = tensor_list(shape, moe)?;
    let specs: Vec<TensorSpec> = list
        .iter()
        .map(|(name, rows, cols, init)| {
            let router = name.ends_with(LayerTensor::FfnGateInp.suffix());
            let dtype = match init {
                Init::Norm => GgmlType::F32,
                Init::Weight if router => GgmlType::F32,
                Init::Weight if ty == SynthType::Q4K && name == OUTPUT => type_for_row(GgmlType::Q6K, *cols),
                Init::Weight => type_for_row(ty.ggml(), *cols),
            };
            let stacked = LayerTensor::parse(name).is_some_and(|(_, t)| t.is_experts());
            let dims = match (moe, stacked) {
                (Some(m), true) => vec![*cols as u64, (*rows / m.experts) as u64, m.experts as u64],
                _ if *rows == 1 => vec![*cols as u64],
                _ => vec![*cols as u64, *rows as u64],
            };
            TensorSpec { name: name.clone(), dims, dtype }
        })
        .collect();
    let cfg = shape.config_with(moe);
    let arch = cfg.arch.family().gguf;
    let mut md = gguf_metadata(shape, ty, &format!("brigade-synth-{}L-{}h", shape.layers, shape.hidden), arch);
    if let Some(m) = moe {
        md.push((format!("{arch}.expert_count"), Value::U32(m.experts as u32)));
        md.push((format!("{arch}.expert_used_count"), Value::U32(m.used as u32)));
        if m.family != SynthMoeFamily::Mixtral {
            // llama.cpp's Qwen MoE loaders take the experts' size from here (without it,
            // `feed_forward_length / expert_used_count`)
            md.push((format!("{arch}.expert_feed_forward_length"), Value::U32(shape.ffn as u32)));
        }
    }
    let f = std::fs::File::create(path).map_err(|e| ModelError::Io(path.to_path_buf(), e))?;
    let mut w = BufWriter::with_capacity(8 << 20, f);
    let total = specs.len();
    gguf::write_gguf(&mut w, &md, &specs, |i, buf| {
        let (name, rows, cols, init) = &list[i];
        let mut xs = values(seed, name, *rows, *cols, *init);
        if *init == Init::Norm {
            // llama.cpp's converter stores norms as f32, exactly as the 16-bit checkpoint had them
            round_through(&mut xs, ty);
        }
        // llama.cpp's converter permutes q and k of the families it runs with "normal" rope
        let permuted = cfg.rope_style == RopeStyle::Interleaved;
        if permuted && name.ends_with("attn_q.weight") {
            xs = permute_rows_for_gguf(&xs, *rows, *cols, shape.heads);
        } else if permuted && name.ends_with("attn_k.weight") {
            xs = permute_rows_for_gguf(&xs, *rows, *cols, shape.kv_heads);
        }
        buf.reserve(specs[i].n_bytes() as usize);
        encode(&xs, *cols, specs[i].dtype, buf);
        progress(i + 1, total);
        Ok(())
    })?;
    w.flush().map_err(|e| ModelError::Io(path.to_path_buf(), e))?;
    let len = std::fs::metadata(path).map_err(|e| ModelError::Io(path.to_path_buf(), e))?.len();
    Ok(len)
}

/// Writes a Hugging Face directory (`config.json`, `tokenizer.json`, `tokenizer_config.json`,
/// `model.safetensors`) with the same weights [`write_gguf`] writes for the same seed.
pub fn write_safetensors_dir(
    dir: &Path,
    shape: &Shape,
    ty: SynthType,
    seed: u64,
    mut progress: impl FnMut(usize, usize),
) -> Result<u64, ModelError> {
    shape.validate()?;
    let (st_dtype, size) = match ty {
        SynthType::F32 => (safetensors::Dtype::F32, 4),
        SynthType::F16 => (safetensors::Dtype::F16, 2),
        SynthType::BF16 => (safetensors::Dtype::BF16, 2),
        other => return Err(ModelError::BadConfig(format!("safetensors holds f32, f16 or bf16, not {other:?}"))),
    };
    std::fs::create_dir_all(dir).map_err(|e| ModelError::Io(dir.to_path_buf(), e))?;
    let io = |p: &Path, e| ModelError::Io(p.to_path_buf(), e);
    let n_vocab_tokens = synthetic_bpe_vocab(shape.vocab).0.len();
    let (bos, eos) = (n_vocab_tokens - 4, n_vocab_tokens - 3);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim(),
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.context,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": match ty { SynthType::F16 => "float16", SynthType::BF16 => "bfloat16", _ => "float32" },
    });
    let p = dir.join("config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&config).unwrap_or_default()).map_err(|e| io(&p, e))?;
    let tok = synthetic_tokenizer_json(shape.vocab)?;
    // BOS is added by a template post-processor, as Llama 3's tokenizer.json does.
    let mut tok: serde_json::Value = serde_json::from_str(&tok).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    tok["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos], "tokens": ["<|begin_of_text|>"]}}
    });
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, tok.to_string()).map_err(|e| io(&p, e))?;
    let tc = serde_json::json!({
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "add_bos_token": true,
        "chat_template": CHATML_TEMPLATE,
    });
    let p = dir.join("tokenizer_config.json");
    std::fs::write(&p, tc.to_string()).map_err(|e| io(&p, e))?;

    let list = tensor_list(shape, None)?;
    let total = list.len();
    let mut datas: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(total);
    for (i, (name, rows, cols, init)) in list.iter().enumerate() {
        let xs = values(seed, name, *rows, *cols, *init);
        let mut bytes = Vec::with_capacity(xs.len() * size);
        let dt = match ty {
            SynthType::F16 => GgmlType::F16,
            SynthType::BF16 => GgmlType::BF16,
            _ => GgmlType::F32,
        };
        encode(&xs, *cols, dt, &mut bytes);
        let hf = gguf_to_hf_name(name).unwrap_or_else(|| name.clone());
        let shape_v = if *rows == 1 { vec![*cols] } else { vec![*rows, *cols] };
        datas.push((hf, shape_v, bytes));
        progress(i + 1, total);
    }
    let views = datas
        .iter()
        .map(|(n, s, b)| safetensors::tensor::TensorView::new(st_dtype, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ModelError::Format(e.to_string()))?;
    let p = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &p).map_err(|e| ModelError::Format(format!("{}: {e}", p.display())))?;
    let len = std::fs::metadata(&p).map_err(|e| io(&p, e))?.len();
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_row_shuffle_per_head() {
        let rows = 8;
        let cols = 2;
        let w: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let p = permute_rows_for_gguf(&w, rows, cols, 2);
        // head size 4: HF rows [0,1 | 2,3] become [0,2,1,3]
        let row = |v: &Vec<f32>, r: usize| v[r * cols];
        assert_eq!((0..rows).map(|r| row(&p, r)).collect::<Vec<_>>(), vec![0., 4., 2., 6., 8., 12., 10., 14.]);
    }

    #[test]
    fn values_are_deterministic() {
        let a = values(7, "x", 40, 64, Init::Weight);
        assert_eq!(a, values(7, "x", 40, 64, Init::Weight));
        assert_ne!(a, values(8, "x", 40, 64, Init::Weight));
        assert!(a.iter().all(|v| v.abs() <= 0.035));
    }
}
