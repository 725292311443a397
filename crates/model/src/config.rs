//! The hyper-parameters of a Llama-family model, read from GGUF metadata or a Hugging Face
//! `config.json`.

use crate::gguf::{Gguf, Value};
use crate::ModelError;
use serde::{Deserialize, Serialize};

/// Architectures brigade runs. Mistral and SmolLM/TinyLlama are Llama-shaped; Qwen2 adds q/k/v
/// biases and rotates halves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
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
    pub qkv_bias: bool,
}

impl ModelConfig {
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |why: String| Err(ModelError::BadConfig(why));
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
        // Generous sanity bounds: they only stop absurd values from sizing allocations.
        if self.n_layers > 1024 || self.hidden > 1 << 17 || self.ffn > 1 << 19 || self.vocab > 1 << 22 {
            return bad(format!(
                "implausible shape: {} layers, hidden {}, ffn {}, vocab {}",
                self.n_layers, self.hidden, self.ffn, self.vocab
            ));
        }
        if self.n_heads * self.head_dim > 1 << 17 {
            return bad(format!("implausible attention width {} x {}", self.n_heads, self.head_dim));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope theta {} must be positive", self.rope_theta));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad(format!("rms eps {} must be positive", self.rms_eps));
        }
        if let RopeScaling::FreqFactors(f) = &self.rope_scaling {
            if f.len() != self.head_dim / 2 {
                return bad(format!(
                    "rope_freqs has {} factors, expected head_dim / 2 = {}",
                    f.len(),
                    self.head_dim / 2
                ));
            }
        }
        Ok(())
    }

    /// Inverse frequencies of the rotary embedding, one per pair of dimensions, scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> =
            (0..d / 2).map(|i| 1.0 / (self.rope_theta as f64).powf(2.0 * i as f64 / d as f64) as f32).collect();
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

    /// Bytes of K and V cache per token per layer at `dtype_bytes` per element.
    pub fn kv_bytes_per_token_layer(&self, dtype_bytes: usize) -> u64 {
        (2 * self.n_kv_heads * self.head_dim * dtype_bytes) as u64
    }

    /// Reads the configuration from GGUF metadata (`{arch}.block_count` and friends).
    /// `rope_freqs` is the content of a `rope_freqs.weight` tensor when the file has one.
    pub fn from_gguf(g: &Gguf, rope_freqs: Option<Vec<f32>>) -> Result<Self, ModelError> {
        let arch_name = g
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::MissingMetadata("general.architecture".into()))?
            .to_string();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            other => return Err(ModelError::UnsupportedArch(other.to_string())),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let req_u = |k: &str| -> Result<usize, ModelError> {
            let full = key(k);
            let v = g.get(&full).ok_or_else(|| ModelError::MissingMetadata(full.clone()))?;
            v.as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| ModelError::BadMetadata { key: full, why: format!("{v:?} is not a count") })
        };
        let opt_f = |k: &str| g.get(&key(k)).and_then(Value::as_f64);
        let n_layers = req_u("block_count")?;
        let hidden = req_u("embedding_length")?;
        let n_heads = req_u("attention.head_count")?;
        let n_kv_heads = match g.get(&key("attention.head_count_kv")) {
            None => n_heads,
            Some(_) => req_u("attention.head_count_kv")?,
        };
        if n_heads == 0 {
            return Err(ModelError::BadConfig("zero attention heads".into()));
        }
        let head_dim = match g.get(&key("attention.key_length")) {
            Some(_) => req_u("attention.key_length")?,
            None => hidden / n_heads,
        };
        let rope_dim = match g.get(&key("rope.dimension_count")) {
            Some(_) => req_u("rope.dimension_count")?,
            None => head_dim,
        };
        if rope_dim != head_dim {
            return Err(ModelError::BadConfig(format!(
                "partial rotary embeddings (rope over {rope_dim} of {head_dim} head dims) are not supported"
            )));
        }
        let vocab = match g.get(&key("vocab_size")) {
            Some(_) => req_u("vocab_size")?,
            None => g
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(<[Value]>::len)
                .or_else(|| g.tensor("token_embd.weight").map(|t| t.dims.get(1).copied().unwrap_or(0) as usize))
                .ok_or_else(|| ModelError::MissingMetadata("tokenizer.ggml.tokens".into()))?,
        };
        let ffn = req_u("feed_forward_length")?;
        let context_length = match g.get(&key("context_length")) {
            Some(_) => req_u("context_length")?,
            None => 2048,
        };
        let rope_scaling = if let Some(f) = rope_freqs {
            RopeScaling::FreqFactors(f)
        } else {
            match g.get(&key("rope.scaling.type")).and_then(Value::as_str) {
                Some("linear") => RopeScaling::Linear { factor: opt_f("rope.scaling.factor").unwrap_or(1.0) as f32 },
                Some("none") | None => RopeScaling::None,
                Some(other) => return Err(ModelError::BadConfig(format!("rope scaling `{other}` is not supported"))),
            }
        };
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
            rope_style: if arch == Arch::Qwen2 { RopeStyle::Halves } else { RopeStyle::Interleaved },
            rope_scaling,
            rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            context_length,
            qkv_bias: g.tensor("blk.0.attn_q.bias").is_some(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let hf: HfConfig =
            serde_json::from_str(text).map_err(|e| ModelError::BadConfig(format!("config.json: {e}")))?;
        let arch_name = hf.architectures.first().cloned().or(hf.model_type.clone()).unwrap_or_default();
        let arch = match arch_name.as_str() {
            "LlamaForCausalLM" | "llama" => Arch::Llama,
            "MistralForCausalLM" | "mistral" => Arch::Mistral,
            "Qwen2ForCausalLM" | "qwen2" => Arch::Qwen2,
            other => return Err(ModelError::UnsupportedArch(other.to_string())),
        };
        if hf.num_attention_heads == 0 {
            return Err(ModelError::BadConfig("zero attention heads".into()));
        }
        let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads);
        let rope_scaling = match hf.rope_scaling {
            None => RopeScaling::None,
            Some(s) => match s.rope_type.as_deref().or(s.kind.as_deref()) {
                Some("llama3") => RopeScaling::Llama3 {
                    factor: s.factor.unwrap_or(1.0),
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_max_position: s.original_max_position_embeddings.unwrap_or(8192),
                },
                Some("linear") => RopeScaling::Linear { factor: s.factor.unwrap_or(1.0) },
                Some("default") | None => RopeScaling::None,
                Some(other) => return Err(ModelError::BadConfig(format!("rope scaling `{other}` is not supported"))),
            },
        };
        let cfg = ModelConfig {
            arch,
            n_layers: hf.num_hidden_layers,
            hidden: hf.hidden_size,
            ffn: hf.intermediate_size,
            n_heads: hf.num_attention_heads,
            n_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim,
            vocab: hf.vocab_size,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rope_style: RopeStyle::Halves,
            rope_scaling,
            rms_eps: hf.rms_norm_eps.unwrap_or(1e-5),
            context_length: hf.max_position_embeddings.unwrap_or(2048),
            qkv_bias: arch == Arch::Qwen2 || hf.attention_bias.unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
}

/// The fields of a Hugging Face `config.json` that brigade reads.
#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    pub rope_theta: Option<f32>,
    pub rms_norm_eps: Option<f64>,
    pub max_position_embeddings: Option<usize>,
    pub rope_scaling: Option<HfRopeScaling>,
    pub attention_bias: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA31: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#;

    #[test]
    fn llama3_rope_scaling_matches_transformers() {
        let c = ModelConfig::from_hf_json(LLAMA31).unwrap();
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.rope_style, RopeStyle::Halves);
        let f = c.rope_inv_freq();
        // transformers' _compute_llama3_parameters for this config
        let want = [
            (0, 1.0),
            (10, 0.12868737343265052),
            (20, 0.016560440080994446),
            (30, 0.0013718935677611381),
            (40, 3.428102195952591e-05),
            (50, 4.411534674558404e-06),
            (63, 3.068925988914511e-07),
        ];
        for (i, w) in want {
            assert!((f[i] as f64 - w).abs() <= 1e-6 * w, "inv_freq[{i}] = {} vs {w}", f[i]);
        }
    }

    #[test]
    fn qwen2_has_biases_and_rotates_halves() {
        let j = r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768}"#;
        let c = ModelConfig::from_hf_json(j).unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.qkv_bias);
        assert_eq!(c.rope_style, RopeStyle::Halves);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.kv_bytes_per_token_layer(2), 2 * 2 * 64 * 2);
    }

    #[test]
    fn rejects_bad_configs() {
        for bad in [
            LLAMA31.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 7"),
            LLAMA31.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": 0"),
            LLAMA31.replace("\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\""),
            LLAMA31.replace("LlamaForCausalLM", "GPTNeoXForCausalLM"),
            LLAMA31.replace("\"hidden_size\": 4096", "\"hidden_size\": 40960000000"),
            "{}".to_string(),
        ] {
            assert!(ModelConfig::from_hf_json(&bad).is_err(), "{bad}");
        }
    }
}
