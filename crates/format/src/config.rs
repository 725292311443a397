//! The hyper-parameters of a Llama-family model, read from GGUF metadata or a Hugging Face
//! `config.json` (in `hf`). Every value is outside input: [`ModelConfig::validate`] bounds the
//! shape, computes every product of its fields with checked arithmetic and refuses RoPE settings
//! that would give non-finite frequencies, before anything is sized by them.

pub mod family;
mod hf;

pub use family::{Family, LayerSpec, FAMILIES};

use crate::gguf::{Gguf, Value};
use crate::{FormatError, GgmlType};
use serde::{Deserialize, Serialize};

/// Architectures brigade runs ([`family::FAMILIES`] says how each differs). Mistral and
/// SmolLM/TinyLlama are Llama-shaped; Qwen2 adds q/k/v biases and rotates halves; Qwen3 norms
/// each head of q and k and sizes its heads explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma2,
    Gemma3,
    /// Mixtral's checkpoints (llama.cpp writes them as `llama` with experts).
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    Olmoe,
}

/// A mixture-of-experts feed-forward block in place of the dense one, on every layer: a router
/// (`ffn_gate_inp`) scores `experts` SiLU-gated experts of `ffn` each per token, softmax over all
/// of them, the `used` best are computed and their outputs summed by those weights (renormalised
/// to sum 1 where `norm_topk`). Qwen2-MoE adds a shared expert of `shared_ffn` to every token,
/// gated by a sigmoid of its own router row (`ffn_gate_inp_shexp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moe {
    pub experts: usize,
    pub used: usize,
    /// Each expert's feed-forward size.
    pub ffn: usize,
    /// Whether the chosen experts' weights are divided by their sum (Mixtral, Qwen3-MoE).
    pub norm_topk: bool,
    #[serde(default)]
    pub shared_ffn: Option<usize>,
}

/// Generous bound of a layer's experts (the largest models have 256, one 384).
pub const MAX_EXPERTS: usize = 4096;

/// Generous bound of the experts a token uses (the models of 2026 use 1 to 10): a pass holds
/// every row's inputs and outputs for each of them, so this sizes allocations.
pub const MAX_EXPERTS_USED: usize = 64;

impl Moe {
    /// Refuses what would size allocations absurdly or compute nothing, naming the field
    /// (GGUF's key, then `config.json`'s).
    pub fn validate(&self) -> Result<(), FormatError> {
        if self.experts == 0 || self.experts > MAX_EXPERTS {
            return bad(format!(
                "expert_count (num_experts) {}: a mixture of experts has 1 to {MAX_EXPERTS} experts",
                self.experts
            ));
        }
        if self.used == 0 || self.used > self.experts.min(MAX_EXPERTS_USED) {
            return bad(format!(
                "expert_used_count (num_experts_per_tok) {} with {} experts: each token uses 1 to {} of them",
                self.used,
                self.experts,
                self.experts.min(MAX_EXPERTS_USED)
            ));
        }
        if self.ffn == 0 || self.ffn > MAX_FFN {
            return bad(format!(
                "expert_feed_forward_length (moe_intermediate_size) {}: must be 1 to {MAX_FFN}",
                self.ffn
            ));
        }
        if let Some(s) = self.shared_ffn {
            if s == 0 || s > MAX_FFN {
                return bad(format!(
                    "expert_shared_feed_forward_length (shared_expert_intermediate_size) {s}: must be 1 to {MAX_FFN}"
                ));
            }
        }
        Ok(())
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1): llama.cpp's "normal" rope; GGUF llama/mistral files are stored for it.
    Interleaved,
    /// Pairs (i, i + d/2): Hugging Face Llama checkpoints and every Qwen2 file.
    Halves,
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
    /// Per-frequency divisors as stored in a GGUF `rope_freqs.weight` tensor.
    FreqFactors(Vec<f32>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rope_scaling: RopeScaling,
    pub rms_eps: f64,
    /// The context length the model declares (`-c` defaults to at most this).
    pub context_length: usize,
    /// How each layer computes (the family's, plus the q/k/v biases a `config.json` may add).
    #[serde(flatten)]
    pub layer: LayerSpec,
    /// Sliding-window attention (Mistral's and Gemma's `sliding_window`): a query at position
    /// `p` sees the keys at `p − window + 1 ..= p`, as transformers masks them, on the layers
    /// `swa_layers` names (every layer when it is `None`). `None`: all earlier keys.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Which layers the window applies to (Gemma 3: five local layers, then a global one).
    #[serde(default)]
    pub swa_layers: Option<Vec<bool>>,
    /// Tokens one forward pass takes when some layer has a sliding window (`None`:
    /// [`WINDOW_CHUNK`]); a windowed layer's cache holds its window plus one pass
    /// ([`ModelConfig::kv_positions`]). Not read from a file: a runtime choice, as llama.cpp's
    /// micro-batch; a small pass keeps a small cache (and lets a test see the cache wrap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_pass: Option<usize>,
    /// The RoPE base of the windowed layers where it differs from `rope_theta` (Gemma 3's local
    /// layers: 10 000), unscaled.
    #[serde(default)]
    pub rope_theta_local: Option<f32>,
    /// The embedding's output scale (Gemma: √hidden).
    #[serde(default)]
    pub embed_scale: Option<f32>,
    /// Added to every RMSNorm weight when it is loaded ([`family::Family::hf_norm_offset`]).
    #[serde(default)]
    pub norm_offset: f32,
    /// Attention scores are scaled by `1 / √query_pre_attn_scalar` (Gemma), not `1 / √head_dim`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// Scaled attention scores soft-capped as `c · tanh(s / c)` before the softmax (Gemma 2: 50).
    #[serde(default)]
    pub attn_softcap: Option<f32>,
    /// The logits soft-capped the same way (Gemma 2: 30).
    #[serde(default)]
    pub final_softcap: Option<f32>,
    /// `tie_word_embeddings` of a `config.json`: whether the head is the embedding matrix. `None`
    /// (GGUF) means the tensor table decides: no `output.weight`, a tied head.
    pub tie_word_embeddings: Option<bool>,
    /// The float type a `config.json` declares (`dtype`, formerly `torch_dtype`); the stored
    /// tensors' own types are what brigade computes with.
    pub dtype: Option<GgmlType>,
    /// Experts in place of every layer's dense feed-forward block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Moe>,
}

/// Generous sanity bounds: they only stop absurd values from sizing allocations.
const MAX_LAYERS: usize = 1024;
const MAX_HIDDEN: usize = 1 << 17;
const MAX_FFN: usize = 1 << 19;
const MAX_VOCAB: usize = 1 << 22;
/// Bound of `n_heads × head_dim` (the query width), hence of the kv width too.
const MAX_ATTENTION_WIDTH: usize = 1 << 17;

fn bad<T>(why: String) -> Result<T, FormatError> {
    Err(FormatError::BadConfig(why))
}

/// A scaling factor must be a finite positive number, or frequencies become inf or NaN.
fn positive(name: &str, v: f32) -> Result<(), FormatError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        bad(format!("rope scaling {name} {v} must be a finite positive number"))
    }
}

impl ModelConfig {
    pub fn validate(&self) -> Result<(), FormatError> {
        if self.n_layers == 0 || self.hidden == 0 || self.ffn == 0 || self.vocab == 0 {
            return bad(format!(
                "layers {}, hidden {}, ffn {}, vocab {}: none may be zero",
                self.n_layers, self.hidden, self.ffn, self.vocab
            ));
        }
        if self.n_heads == 0 || self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} attention heads cannot be grouped over {} kv heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dim {} must be even and nonzero", self.head_dim));
        }
        if self.n_layers > MAX_LAYERS || self.hidden > MAX_HIDDEN || self.ffn > MAX_FFN || self.vocab > MAX_VOCAB {
            return bad(format!(
                "implausible shape: {} layers, hidden {}, ffn {}, vocab {}",
                self.n_layers, self.hidden, self.ffn, self.vocab
            ));
        }
        // n_kv_heads divides n_heads, so the kv width is at most the query width
        if self.q_width().is_none_or(|w| w > MAX_ATTENTION_WIDTH) {
            return bad(format!("implausible attention width {} x {}", self.n_heads, self.head_dim));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope theta {} must be positive", self.rope_theta));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad(format!("rms eps {} must be positive", self.rms_eps));
        }
        if let Some(m) = &self.moe {
            m.validate()?;
            if self.layer.fused_gate_up {
                return bad("experts with gate and up stored as one matrix are not supported".into());
            }
        }
        if self.layer.fused_qkv && self.layer.qkv_bias {
            return bad("attention_bias: biases on a fused q/k/v matrix are not supported".into());
        }
        if self.sliding_window == Some(0) {
            return bad("sliding window 0: a query would see no key, not even its own".into());
        }
        if let Some(l) = &self.swa_layers {
            if l.len() != self.n_layers {
                return bad(format!("{} sliding-window layer flags for {} layers", l.len(), self.n_layers));
            }
            if self.sliding_window.is_none() && l.iter().any(|w| *w) {
                return bad("sliding-window layers without a sliding_window".into());
            }
        }
        for (what, v) in [
            ("query_pre_attn_scalar", self.query_pre_attn_scalar.unwrap_or(1.0)),
            ("embedding scale", self.embed_scale.unwrap_or(1.0) as f64),
            ("local rope theta", self.rope_theta_local.unwrap_or(1.0) as f64),
            ("attn_logit_softcapping", self.attn_softcap.unwrap_or(1.0) as f64),
            ("final_logit_softcapping", self.final_softcap.unwrap_or(1.0) as f64),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{what} {v} must be a finite positive number"));
            }
        }
        self.validate_rope_scaling()
    }

    fn validate_rope_scaling(&self) -> Result<(), FormatError> {
        match &self.rope_scaling {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("factor", *factor),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                positive("factor", *factor)?;
                positive("low_freq_factor", *low_freq_factor)?;
                positive("high_freq_factor", *high_freq_factor)?;
                // the smoothing between the two wavelengths divides by their difference
                if low_freq_factor >= high_freq_factor {
                    return bad(format!(
                        "llama3 rope scaling needs low_freq_factor {low_freq_factor} below high_freq_factor \
                         {high_freq_factor}"
                    ));
                }
                if *original_max_position == 0 {
                    return bad("llama3 rope scaling with original_max_position_embeddings 0".into());
                }
                Ok(())
            }
            RopeScaling::FreqFactors(f) => {
                if f.len() != self.head_dim / 2 {
                    return bad(format!(
                        "rope_freqs has {} factors, expected head_dim / 2 = {}",
                        f.len(),
                        self.head_dim / 2
                    ));
                }
                match f.iter().position(|v| !(v.is_finite() && *v > 0.0)) {
                    Some(i) => bad(format!("rope_freqs factor {i} is {}: it must be finite and positive", f[i])),
                    None => Ok(()),
                }
            }
        }
    }

    /// The sliding window of layer `layer`, if it has one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match &self.swa_layers {
            Some(l) if !l.get(layer).copied().unwrap_or(false) => None,
            _ => self.sliding_window,
        }
    }

    /// The most tokens one forward pass takes: [`ModelConfig::window_pass`] when some layer has
    /// a sliding window (see [`ModelConfig::kv_positions`]), else no bound.
    pub fn pass(&self) -> Option<usize> {
        (0..self.n_layers).any(|l| self.window(l).is_some()).then(|| self.window_pass.unwrap_or(WINDOW_CHUNK).max(1))
    }

    /// Positions layer `layer`'s KV cache holds for a context of `n_ctx` tokens: all of them,
    /// or, for a sliding-window layer, its window less one (the keys the next query sees
    /// besides itself) plus one [`ModelConfig::pass`], where that is fewer. Both the runtime's
    /// allocation and every memory prediction (the planner's, `-ngl auto`'s) use this.
    pub fn kv_positions(&self, layer: usize, n_ctx: usize) -> usize {
        match (self.window(layer), self.pass()) {
            (Some(w), Some(pass)) => n_ctx.min(w.saturating_sub(1).saturating_add(pass)),
            _ => n_ctx,
        }
    }

    /// The RoPE base of layer `layer` where it is not `rope_theta` (a windowed layer's own).
    pub fn local_rope_theta(&self, layer: usize) -> Option<f32> {
        self.rope_theta_local.filter(|_| self.window(layer).is_some())
    }

    /// The scale of attention scores: `1 / √query_pre_attn_scalar`, or `1 / √head_dim`.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self.query_pre_attn_scalar.unwrap_or(self.head_dim as f64).sqrt()
    }

    /// `n_heads × head_dim`: the rows of the query projection; `None` on overflow (a validated
    /// configuration never overflows).
    pub fn q_width(&self) -> Option<usize> {
        self.n_heads.checked_mul(self.head_dim)
    }

    /// `n_kv_heads × head_dim`: the rows of the key and value projections.
    pub fn kv_width(&self) -> Option<usize> {
        self.n_kv_heads.checked_mul(self.head_dim)
    }

    /// Bytes of a slice's rotary tables over `n_ctx` positions in elements of `elem_bytes`: the
    /// cosine and sine of each position's angles (one per pair of rotated dimensions), once for
    /// the model's base and once more for the windowed layers' own base when `layers` hold such
    /// a layer (as the runtime builds them). Saturating.
    pub fn rope_table_bytes(&self, layers: std::ops::Range<usize>, n_ctx: usize, elem_bytes: u64) -> u64 {
        let tables = 1 + u64::from(layers.into_iter().any(|l| self.local_rope_theta(l).is_some()));
        let pairs = self.rope_inv_freq().len() as u64;
        [2, n_ctx as u64, pairs, elem_bytes].iter().fold(tables, |acc, &x| acc.saturating_mul(x))
    }

    /// Inverse frequencies of the rotary embedding of a windowed layer with its own base
    /// ([`ModelConfig::rope_theta_local`]): unscaled.
    pub fn rope_inv_freq_at(&self, theta: f32) -> Vec<f32> {
        let d = self.head_dim;
        (0..d / 2).map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / d as f64) as f32).collect()
    }

    /// Inverse frequencies of the rotary embedding, one per pair of dimensions, scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let base = self.rope_inv_freq_at(self.rope_theta);
        match &self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::FreqFactors(ff) => base.iter().zip(ff).map(|(f, s)| f / s).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                let old = *original_max_position as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Bytes of K and V cache per token per layer at `elem_bytes` per element. Saturates instead
    /// of wrapping for a configuration that was never validated (a validated one is far below).
    pub fn kv_bytes_per_token_layer(&self, elem_bytes: u64) -> u64 {
        [self.n_kv_heads as u64, self.head_dim as u64, elem_bytes].iter().fold(2u64, |b, &x| b.saturating_mul(x))
    }

    /// Reads the configuration from GGUF metadata (`{arch}.block_count` and friends).
    /// `rope_freqs` is the content of a `rope_freqs.weight` tensor when the file has one.
    pub fn from_gguf(g: &Gguf, rope_freqs: Option<Vec<f32>>) -> Result<Self, FormatError> {
        let arch_name = g
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| FormatError::MissingMetadata("general.architecture".into()))?
            .to_string();
        let family = family::by_gguf(&arch_name).ok_or_else(|| FormatError::UnsupportedArch(arch_name.clone()))?;
        let arch = family.arch;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req_u = |k: &str| -> Result<usize, FormatError> {
            let full = key(k);
            let v = g.get(&full).ok_or_else(|| FormatError::MissingMetadata(full.clone()))?;
            v.as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| FormatError::BadMetadata { key: full, why: format!("{} is not a count", v.brief()) })
        };
        let opt_u = |k: &str, default: usize| match g.get(&key(k)) {
            Some(_) => req_u(k),
            None => Ok(default),
        };
        let opt_f = |k: &str| g.get(&key(k)).and_then(Value::as_f64);
        let n_layers = req_u("block_count")?;
        let hidden = req_u("embedding_length")?;
        let n_heads = req_u("attention.head_count")?;
        let n_kv_heads = opt_u("attention.head_count_kv", n_heads)?;
        if n_heads == 0 {
            return bad("zero attention heads".into());
        }
        let head_dim = match g.get(&key("attention.key_length")) {
            Some(_) => req_u("attention.key_length")?,
            None => derived_head_dim(hidden, n_heads)?,
        };
        let value_dim = opt_u("attention.value_length", head_dim)?;
        if value_dim != head_dim {
            return bad(format!("value heads of {value_dim} dims and key heads of {head_dim} are not supported"));
        }
        let rope_dim = opt_u("rope.dimension_count", head_dim)?;
        if rope_dim != head_dim {
            return bad(format!(
                "partial rotary embeddings (rope over {rope_dim} of {head_dim} head dims) are not supported"
            ));
        }
        let vocab = match g.get(&key("vocab_size")) {
            Some(_) => req_u("vocab_size")?,
            None => g
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(<[Value]>::len)
                .or_else(|| g.tensor("token_embd.weight").map(|t| t.dims.get(1).copied().unwrap_or(0) as usize))
                .ok_or_else(|| FormatError::MissingMetadata("tokenizer.ggml.tokens".into()))?,
        };
        let ffn = req_u("feed_forward_length")?;
        // 0 is llama.cpp's "none"
        let cap = |k: &str| opt_f(k).filter(|c| *c != 0.0).map(|c| c as f32);
        let (attn_softcap, final_softcap) = match arch {
            Arch::Gemma2 => (cap("attn_logit_softcapping"), cap("final_logit_softcapping")),
            _ => (None, cap("final_logit_softcapping")),
        };
        // llama.cpp runs Llama-shaped GGUF files with full attention whatever
        // `attention.sliding_window` says (its converter writes none for Mistral, and it turns
        // Phi-3's off): so does brigade, to give llama.cpp's numbers. Gemma's local layers are
        // windowed, five in six (Gemma 3) or every other (Gemma 2) unless the file says
        // otherwise, as llama.cpp reads them.
        let (windows, rope_theta_local, query_pre_attn_scalar) = if matches!(arch, Arch::Gemma2 | Arch::Gemma3) {
            let (pattern, default_window, big) = if arch == Arch::Gemma2 { (2, 4096, 46) } else { (6, 0, 62) };
            let window = opt_u("attention.sliding_window", default_window)?;
            let windows = if window == 0 {
                None
            } else {
                let pattern_key = key("attention.sliding_window_pattern");
                let flags = match g.get(&pattern_key) {
                    None => swa_pattern(n_layers, pattern),
                    Some(Value::Array(a)) => {
                        a.iter().map(|v| v.as_bool()).collect::<Option<Vec<bool>>>().ok_or_else(|| {
                            FormatError::BadMetadata { key: pattern_key.clone(), why: "not booleans".into() }
                        })?
                    }
                    Some(_) => swa_pattern(n_layers, req_u("attention.sliding_window_pattern")?),
                };
                Some((window, flags))
            };
            // Gemma 2's local layers share the global base unless the file gives one
            let default_local = if arch == Arch::Gemma2 { None } else { Some(10_000.0) };
            let local = windows.as_ref().and_then(|_| opt_f("rope.freq_base_swa").or(default_local)).map(|t| t as f32);
            // llama.cpp scales scores by 1/√head_dim, and by 1/√(hidden/heads) on the 27B
            let scalar = if n_layers == big { hidden / n_heads } else { head_dim };
            (windows, local, Some(scalar as f64))
        } else {
            (None, None, None)
        };
        // Phi-3's 128k models: per-frequency factors that change with the context length
        if g.tensor("rope_factors_long.weight").is_some() || g.get(&key("rope.scaling.attn_factor")).is_some() {
            return bad("rope_factors_long: LongRoPE scaling (Phi-3 128k) is not supported".into());
        }
        let context_length = opt_u("context_length", 2048)?;
        let rope_scaling = match rope_freqs {
            Some(f) => RopeScaling::FreqFactors(f),
            None => gguf_rope_scaling(g, &key("rope.scaling.type"), opt_f("rope.scaling.factor"))?,
        };
        let moe = match g.get(&key("expert_count")) {
            None => None,
            Some(_) => {
                let experts = req_u("expert_count")?;
                let norm_key = key("expert_weights_norm");
                let norm_topk = match g.get(&norm_key) {
                    None => family.norm_topk,
                    Some(v) => v.as_bool().ok_or_else(|| FormatError::BadMetadata {
                        key: norm_key,
                        why: format!("{} is not a bool", v.brief()),
                    })?,
                };
                if let Some(v) = g.get(&key("expert_gating_func")) {
                    // llama.cpp: 1 softmax, 2 sigmoid
                    if v.as_u64() != Some(1) {
                        return bad(format!(
                            "{}: expert gating {} is not supported (softmax, 1, is)",
                            key("expert_gating_func"),
                            v.brief()
                        ));
                    }
                }
                let used = req_u("expert_used_count")?;
                // where the file leaves them out, llama.cpp's widths: a Qwen MoE's experts
                // share the feed-forward length among the experts a token uses, and
                // Qwen2-MoE's shared expert has all of it (early Qwen1.5-MoE files)
                let qwen = matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe);
                let expert_ffn = if qwen { ffn.checked_div(used).unwrap_or(0) } else { ffn };
                if expert_ffn == 0 && g.get(&key("expert_feed_forward_length")).is_none() {
                    return bad(format!(
                        "{} is missing, and feed_forward_length {ffn} over expert_used_count {used} gives experts \
                         of width 0",
                        key("expert_feed_forward_length")
                    ));
                }
                Some(Moe {
                    experts,
                    used,
                    ffn: opt_u("expert_feed_forward_length", expert_ffn)?,
                    norm_topk,
                    shared_ffn: match g.get(&key("expert_shared_feed_forward_length")) {
                        Some(_) => Some(req_u("expert_shared_feed_forward_length")?),
                        None if arch == Arch::Qwen2Moe => Some(ffn),
                        None => None,
                    },
                })
            }
        };
        if moe.is_none() && (family.moe || g.tensor("blk.0.ffn_gate_inp.weight").is_some()) {
            // a router in the file, and nothing saying how many experts it routes to
            return Err(FormatError::MissingMetadata(key("expert_count")));
        }
        let cfg = ModelConfig {
            arch,
            n_layers,
            hidden,
            ffn,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            rope_theta: opt_f("rope.freq_base").unwrap_or(10_000.0) as f32,
            rope_style: family.gguf_rope,
            rope_scaling,
            rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            context_length,
            layer: LayerSpec {
                qkv_bias: family.layer.qkv_bias || g.tensor("blk.0.attn_q.bias").is_some(),
                ..family.layer
            },
            sliding_window: windows.as_ref().map(|w| w.0),
            swa_layers: windows.map(|w| w.1),
            window_pass: None,
            rope_theta_local,
            embed_scale: family.scaled_embedding.then(|| (hidden as f32).sqrt()),
            // llama.cpp's converter adds Gemma's 1 to the stored norms
            norm_offset: 0.0,
            query_pre_attn_scalar,
            attn_softcap,
            final_softcap,
            tie_word_embeddings: None,
            dtype: None,
            moe,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a Hugging Face `config.json`, in the layout of transformers 4 (`rope_theta`,
    /// `rope_scaling`, `torch_dtype`) or 5 (`rope_parameters`, `dtype`).
    pub fn from_hf_json(text: &str) -> Result<Self, FormatError> {
        hf::from_json(text)
    }
}

/// Which of `n_layers` layers are windowed when `n - 1` local layers precede each global one
/// (Gemma 3: 6, Gemma 2: 2; 0: every layer), as transformers and llama.cpp fill it in.
pub(super) fn swa_pattern(n_layers: usize, n: usize) -> Vec<bool> {
    (0..n_layers).map(|i| n == 0 || i % n < n - 1).collect()
}

/// The most tokens one forward pass of a model with sliding-window layers takes: a longer chunk
/// is read in passes of this many, so a windowed layer's cache needs room for its window and one
/// pass only, never for the whole context (llama.cpp sizes its SWA cache the same way: window
/// plus one micro-batch). Every slice of such a model splits the same way, whether or not it
/// holds a windowed layer, so a split model computes what one slice does.
pub const WINDOW_CHUNK: usize = 512;

/// The first key position a query at position `pos` sees under a sliding `window`: 0 without
/// one.
pub fn first_key(window: Option<usize>, pos: usize) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// `hidden / n_heads` when a file gives no head size: it must divide evenly.
fn derived_head_dim(hidden: usize, n_heads: usize) -> Result<usize, FormatError> {
    if n_heads == 0 || !hidden.is_multiple_of(n_heads) {
        return bad(format!(
            "hidden size {hidden} is not a whole number of {n_heads} heads (and no head size is given)"
        ));
    }
    Ok(hidden / n_heads)
}

/// `{arch}.rope.scaling.type`, as llama.cpp reads it: a missing or zero factor means 1.
fn gguf_rope_scaling(g: &Gguf, type_key: &str, factor: Option<f64>) -> Result<RopeScaling, FormatError> {
    let Some(v) = g.get(type_key) else {
        return Ok(RopeScaling::None);
    };
    match v.as_str() {
        Some("none") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear { factor: factor.filter(|&f| f != 0.0).unwrap_or(1.0) as f32 }),
        Some(other) => bad(format!("rope scaling `{other}` is not supported (none, linear are)")),
        None => {
            Err(FormatError::BadMetadata { key: type_key.to_string(), why: format!("{} is not a string", v.brief()) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            n_layers: 2,
            hidden: 64,
            ffn: 128,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            vocab: 300,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::Interleaved,
            rope_scaling: RopeScaling::None,
            rms_eps: 1e-5,
            context_length: 512,
            layer: LayerSpec::default(),
            sliding_window: None,
            swa_layers: None,
            window_pass: None,
            rope_theta_local: None,
            embed_scale: None,
            norm_offset: 0.0,
            query_pre_attn_scalar: None,
            attn_softcap: None,
            final_softcap: None,
            tie_word_embeddings: None,
            dtype: None,
            moe: None,
        }
    }

    #[test]
    fn products_of_header_fields_are_checked() {
        assert!(small().validate().is_ok());
        // 2^32 heads of 2^32 dims: the product wraps to 0 in unchecked arithmetic
        let wide = ModelConfig { n_heads: 1 << 32, n_kv_heads: 1 << 32, head_dim: 1 << 32, ..small() };
        let e = wide.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("attention width"), "{e}");
        // KV bytes of a configuration nobody validated saturate instead of wrapping
        let huge = ModelConfig { n_kv_heads: usize::MAX / 2, head_dim: 1 << 20, ..small() };
        assert_eq!(huge.kv_bytes_per_token_layer(4), u64::MAX);
        assert_eq!(small().kv_bytes_per_token_layer(4), 2 * 2 * 16 * 4);
    }

    #[test]
    fn every_rope_scaling_is_finite() {
        let with = |s: RopeScaling| ModelConfig { rope_scaling: s, ..small() };
        let llama3 = |factor, low, high| RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position: 8192,
        };
        assert!(with(llama3(8.0, 1.0, 4.0)).validate().is_ok());
        for s in [
            llama3(8.0, 2.0, 2.0),
            llama3(0.0, 1.0, 4.0),
            llama3(f32::NAN, 1.0, 4.0),
            llama3(8.0, -1.0, 4.0),
            llama3(8.0, 1.0, f32::INFINITY),
            RopeScaling::Linear { factor: 0.0 },
            RopeScaling::Linear { factor: f32::NEG_INFINITY },
            RopeScaling::FreqFactors(vec![1.0; 7]),
            RopeScaling::FreqFactors([vec![1.0; 7], vec![0.0]].concat()),
        ] {
            let c = with(s.clone());
            assert!(c.validate().is_err(), "{s:?} was accepted");
        }
    }
}
