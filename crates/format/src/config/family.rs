//! The model families brigade runs, one row each: the names a family goes by in GGUF
//! (`general.architecture`) and in a Hugging Face `config.json` (`architectures`, `model_type`),
//! and the layer it builds ([`LayerSpec`]). Both configuration readers take a family's layer from
//! here, so a Llama-shaped family whose differences the layer description covers is one row.
//!
//! What the layer description cannot say yet (partial rotary, LongRoPE, Qwen's windows from
//! `max_window_layers` on, other activations) is refused by the readers with the field that asks for
//! it, never ignored.

use super::{Arch, RopeStyle};
use serde::{Deserialize, Serialize};

/// How one transformer layer computes, beyond the Llama block every family shares (pre-norm
/// RMSNorm, grouped-query attention with RoPE, SiLU-gated feed-forward, residual adds). The
/// model runtime reads only this, never the family's name: the op path, the fused CPU decode
/// and the batched rows path all follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct LayerSpec {
    /// Biases on the q, k and v projections (Qwen2; `attention_bias` in a `config.json`).
    #[serde(default)]
    pub qkv_bias: bool,
    /// An RMSNorm over each head of q and of k (weights of `head_dim`), after the projection and
    /// before RoPE (Qwen3, Gemma 3); over the whole of q and of k with
    /// [`LayerSpec::qk_norm_whole`].
    #[serde(default)]
    pub qk_norm: bool,
    /// The q and k norms over the whole projection instead of each head (weights of
    /// `heads × head_dim` and `kv_heads × head_dim`: OLMoE), with [`LayerSpec::qk_norm`].
    #[serde(default)]
    pub qk_norm_whole: bool,
    /// q, k and v as one stored matrix (`attn_qkv`, `qkv_proj`: Phi-3), rows in that order.
    #[serde(default)]
    pub fused_qkv: bool,
    /// The gate and up projections as one stored matrix of `2 × ffn` rows, gate first (Phi-3's
    /// `ffn_up`, `gate_up_proj`).
    #[serde(default)]
    pub fused_gate_up: bool,
    /// RMSNorms after attention and after the feed-forward block too, before each residual add
    /// (Gemma 2 and 3: `post_attention_norm`, `post_ffw_norm`).
    #[serde(default)]
    pub post_norms: bool,
    /// GeLU (tanh approximation) gating the feed-forward block instead of SiLU (Gemma).
    #[serde(default)]
    pub gelu: bool,
}

/// One family.
pub struct Family {
    pub arch: Arch,
    /// `general.architecture` in GGUF (and the prefix of its keys).
    pub gguf: &'static str,
    /// `architectures[0]` or `model_type` in a `config.json`.
    pub hf: &'static [&'static str],
    /// How GGUF files of the family store q and k for RoPE (llama.cpp's converter permutes Llama
    /// and Mistral rows for its "normal" rope; NEOX families keep the checkpoint's halves).
    /// Hugging Face checkpoints always rotate halves.
    pub gguf_rope: RopeStyle,
    /// The layer every file of the family has (a `config.json` may add q/k/v biases to any).
    pub layer: LayerSpec,
    /// The embedding scaled by √hidden (Gemma).
    pub scaled_embedding: bool,
    /// What a checkpoint's RMSNorm weights are stored without: Gemma computes `x̂ · (1 + w)`,
    /// and llama.cpp's converter adds the 1 to the GGUF's weights, so brigade adds it to a
    /// checkpoint's when it loads them.
    pub hf_norm_offset: f32,
    /// Every file of the family has experts ([`super::Moe`]); a Llama may have them (Mixtral
    /// in GGUF).
    pub moe: bool,
    /// Whether the chosen experts' weights are renormalised when a file does not say
    /// (`expert_weights_norm`, `norm_topk_prob`): llama.cpp's choice per architecture.
    pub norm_topk: bool,
}

const LLAMA_LAYER: LayerSpec = LayerSpec {
    qkv_bias: false,
    qk_norm: false,
    qk_norm_whole: false,
    fused_qkv: false,
    fused_gate_up: false,
    post_norms: false,
    gelu: false,
};

/// Every family brigade runs.
pub static FAMILIES: [Family; 11] = [
    Family {
        arch: Arch::Llama,
        gguf: "llama",
        hf: &["LlamaForCausalLM", "llama"],
        gguf_rope: RopeStyle::Interleaved,
        layer: LLAMA_LAYER,
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: false,
        norm_topk: true,
    },
    Family {
        arch: Arch::Mistral,
        gguf: "mistral",
        hf: &["MistralForCausalLM", "mistral"],
        gguf_rope: RopeStyle::Interleaved,
        layer: LLAMA_LAYER,
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: false,
        norm_topk: true,
    },
    Family {
        arch: Arch::Qwen2,
        gguf: "qwen2",
        hf: &["Qwen2ForCausalLM", "qwen2"],
        gguf_rope: RopeStyle::Halves,
        layer: LayerSpec { qkv_bias: true, ..LLAMA_LAYER },
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: false,
        norm_topk: true,
    },
    Family {
        arch: Arch::Qwen3,
        gguf: "qwen3",
        hf: &["Qwen3ForCausalLM", "qwen3"],
        gguf_rope: RopeStyle::Halves,
        layer: LayerSpec { qk_norm: true, ..LLAMA_LAYER },
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: false,
        norm_topk: true,
    },
    Family {
        arch: Arch::Phi3,
        gguf: "phi3",
        hf: &["Phi3ForCausalLM", "phi3"],
        gguf_rope: RopeStyle::Halves,
        layer: LayerSpec { fused_qkv: true, fused_gate_up: true, ..LLAMA_LAYER },
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: false,
        norm_topk: true,
    },
    Family {
        arch: Arch::Gemma2,
        gguf: "gemma2",
        hf: &["Gemma2ForCausalLM", "gemma2"],
        gguf_rope: RopeStyle::Halves,
        layer: LayerSpec { post_norms: true, gelu: true, ..LLAMA_LAYER },
        scaled_embedding: true,
        hf_norm_offset: 1.0,
        moe: false,
        norm_topk: true,
    },
    Family {
        arch: Arch::Gemma3,
        gguf: "gemma3",
        hf: &["Gemma3ForCausalLM", "gemma3_text"],
        gguf_rope: RopeStyle::Halves,
        layer: LayerSpec { qk_norm: true, post_norms: true, gelu: true, ..LLAMA_LAYER },
        scaled_embedding: true,
        hf_norm_offset: 1.0,
        moe: false,
        norm_topk: true,
    },
    // llama.cpp's converter writes Mixtral as `llama` with experts (and permutes q and k as
    // for a Llama); `mixtral` names only the checkpoints' family
    Family {
        arch: Arch::Mixtral,
        gguf: "mixtral",
        hf: &["MixtralForCausalLM", "mixtral"],
        gguf_rope: RopeStyle::Interleaved,
        layer: LLAMA_LAYER,
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: true,
        norm_topk: true,
    },
    Family {
        arch: Arch::Qwen2Moe,
        gguf: "qwen2moe",
        hf: &["Qwen2MoeForCausalLM", "qwen2_moe"],
        gguf_rope: RopeStyle::Halves,
        layer: LayerSpec { qkv_bias: true, ..LLAMA_LAYER },
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: true,
        norm_topk: false,
    },
    Family {
        arch: Arch::Qwen3Moe,
        gguf: "qwen3moe",
        hf: &["Qwen3MoeForCausalLM", "qwen3_moe"],
        gguf_rope: RopeStyle::Halves,
        layer: LayerSpec { qk_norm: true, ..LLAMA_LAYER },
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: true,
        norm_topk: true,
    },
    // llama.cpp's OLMoE: q and k normed whole before the heads split, softmax then top-k without
    // renormalising (transformers' `norm_topk_prob`, false in the released config)
    Family {
        arch: Arch::Olmoe,
        gguf: "olmoe",
        hf: &["OlmoeForCausalLM", "olmoe"],
        gguf_rope: RopeStyle::Halves,
        layer: LayerSpec { qk_norm: true, qk_norm_whole: true, ..LLAMA_LAYER },
        scaled_embedding: false,
        hf_norm_offset: 0.0,
        moe: true,
        norm_topk: false,
    },
];

/// The family of a GGUF `general.architecture`.
pub fn by_gguf(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.gguf == name)
}

/// The family of a `config.json`'s `architectures[0]` or `model_type`.
pub fn by_hf(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.hf.contains(&name))
}

/// The GGUF names of every family, for error messages (`llama, mistral, qwen2, qwen3`).
pub fn names() -> String {
    FAMILIES.iter().map(|f| f.gguf).collect::<Vec<_>>().join(", ")
}

impl Arch {
    /// The family's row.
    pub fn family(self) -> &'static Family {
        // every Arch has exactly one row (tested)
        FAMILIES.iter().find(|f| f.arch == self).unwrap_or(&FAMILIES[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arch_has_one_row_and_names_are_unique() {
        for f in &FAMILIES {
            assert_eq!(FAMILIES.iter().filter(|g| g.arch == f.arch).count(), 1);
            assert!(std::ptr::eq(f.arch.family(), f));
            assert!(std::ptr::eq(by_gguf(f.gguf).unwrap(), f));
            for h in f.hf {
                assert!(std::ptr::eq(by_hf(h).unwrap(), f), "{h}");
            }
        }
        assert!(by_gguf("gemma").is_none() && by_hf("GemmaForCausalLM").is_none());
        assert_eq!(names(), "llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, mixtral, qwen2moe, qwen3moe, olmoe");
    }
}
