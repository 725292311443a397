//! The names and shapes of a Llama-family model's tensors, in llama.cpp's GGUF spelling
//! (`blk.3.attn_q.weight`), and which of them a slice of layers reads.
//!
//! [`LayerTensor`] is the one table of a transformer layer's tensors: checking a file, loading a
//! block, predicting a slice's memory, the planner's profile and the manifest's slice ranges all
//! read it, so a tensor added here is seen by all of them.

use crate::config::ModelConfig;
use crate::index::ModelIndex;
use crate::FormatError;
use brigade_core::LayerRange;

pub const TOKEN_EMBD: &str = "token_embd.weight";
pub const OUTPUT_NORM: &str = "output_norm.weight";
pub const OUTPUT: &str = "output.weight";
/// Llama 3.1's per-frequency RoPE divisors (GGUF only): read into the configuration when a model
/// is opened, so every slice needs it.
pub const ROPE_FREQS: &str = "rope_freqs.weight";
/// The tensors outside the layers that every slice reads, whichever layers it holds.
pub const SHARED_TENSORS: [&str; 1] = [ROPE_FREQS];

/// The non-layer tensors' Hugging Face names.
const HF_NAMES: [(&str, &str); 3] =
    [(TOKEN_EMBD, "model.embed_tokens.weight"), (OUTPUT_NORM, "model.norm.weight"), (OUTPUT, "lm_head.weight")];

/// A dimension of a tensor's shape, as the configuration gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Hidden,
    Ffn,
    Vocab,
    /// `n_heads × head_dim`.
    QWidth,
    /// `n_kv_heads × head_dim`.
    KvWidth,
    /// `head_dim`.
    HeadDim,
    /// The q norm's weights: `head_dim`, or `n_heads × head_dim` where q is normed whole
    /// ([`crate::config::LayerSpec::qk_norm_whole`]).
    QNorm,
    /// The k norm's weights: `head_dim`, or `n_kv_heads × head_dim` where k is normed whole.
    KNorm,
    /// `(n_heads + 2 n_kv_heads) × head_dim`: q, k and v in one matrix.
    QkvWidth,
    /// The up projection's rows: `ffn`, or `2 × ffn` where gate and up are one matrix.
    UpRows,
    /// A MoE layer's experts ([`crate::config::Moe::experts`]).
    Experts,
    /// Each expert's feed-forward size.
    ExpertFfn,
    /// The shared expert's feed-forward size (Qwen2-MoE).
    SharedFfn,
}

impl Dim {
    /// The size in `c`; `None` when a product overflows (never for a validated configuration).
    pub fn size(self, c: &ModelConfig) -> Option<usize> {
        match self {
            Dim::Hidden => Some(c.hidden),
            Dim::Ffn => Some(c.ffn),
            Dim::Vocab => Some(c.vocab),
            Dim::QWidth => c.q_width(),
            Dim::KvWidth => c.kv_width(),
            Dim::HeadDim => Some(c.head_dim),
            Dim::QNorm if c.layer.qk_norm_whole => c.q_width(),
            Dim::KNorm if c.layer.qk_norm_whole => c.kv_width(),
            Dim::QNorm | Dim::KNorm => Some(c.head_dim),
            Dim::QkvWidth => c.q_width()?.checked_add(c.kv_width()?.checked_mul(2)?),
            Dim::UpRows => c.ffn.checked_mul(if c.layer.fused_gate_up { 2 } else { 1 }),
            Dim::Experts => c.moe.map(|m| m.experts),
            Dim::ExpertFfn => c.moe.map(|m| m.ffn),
            Dim::SharedFfn => c.moe.and_then(|m| m.shared_ffn),
        }
    }
}

/// The shape `dims` gives in `c` (candle order: outermost first).
pub fn shape_of(dims: &[Dim], c: &ModelConfig) -> Result<Vec<usize>, FormatError> {
    dims.iter()
        .map(|d| d.size(c).ok_or_else(|| FormatError::BadConfig(format!("the {d:?} dimension overflows or is absent"))))
        .collect()
}

/// Whether a layer tensor must be in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Always,
    /// When the configuration has q/k/v biases (Qwen2, `attention_bias`).
    QkvBias,
    /// When each head of q and k is normed ([`crate::config::LayerSpec::qk_norm`]: Qwen3).
    QkNorm,
    /// When q, k and v are separate matrices (not [`crate::config::LayerSpec::fused_qkv`]).
    SeparateQkv,
    /// When q, k and v are one matrix (Phi-3).
    FusedQkv,
    /// When the gate is its own matrix (not [`crate::config::LayerSpec::fused_gate_up`]) of a
    /// dense feed-forward block.
    SeparateGate,
    /// When the feed-forward block is dense (no [`crate::config::Moe`]).
    Dense,
    /// When the layer has experts.
    Moe,
    /// When the experts have a shared one beside them (Qwen2-MoE).
    SharedExpert,
    /// When the layer norms after attention and the feed-forward block too (Gemma).
    PostNorms,
}

/// One tensor of a transformer layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnQkv,
    AttnOutput,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnQNorm,
    AttnKNorm,
    AttnPostNorm,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    FfnPostNorm,
    /// The router: one row of scores per expert.
    FfnGateInp,
    /// Every expert's gate, up and down matrices stacked, expert-major (llama.cpp's
    /// `ffn_*_exps`); a checkpoint stores each expert's alone ([`LayerTensor::piece_name`]).
    FfnGateExps,
    FfnUpExps,
    FfnDownExps,
    /// The shared expert's gate (one row: its sigmoid weighs the shared expert's output).
    FfnGateInpShexp,
    FfnGateShexp,
    FfnUpShexp,
    FfnDownShexp,
}

impl LayerTensor {
    pub const ALL: [LayerTensor; 25] = [
        LayerTensor::AttnNorm,
        LayerTensor::AttnQ,
        LayerTensor::AttnK,
        LayerTensor::AttnV,
        LayerTensor::AttnQkv,
        LayerTensor::AttnOutput,
        LayerTensor::AttnQBias,
        LayerTensor::AttnKBias,
        LayerTensor::AttnVBias,
        LayerTensor::AttnQNorm,
        LayerTensor::AttnKNorm,
        LayerTensor::AttnPostNorm,
        LayerTensor::FfnNorm,
        LayerTensor::FfnGate,
        LayerTensor::FfnUp,
        LayerTensor::FfnDown,
        LayerTensor::FfnPostNorm,
        LayerTensor::FfnGateInp,
        LayerTensor::FfnGateExps,
        LayerTensor::FfnUpExps,
        LayerTensor::FfnDownExps,
        LayerTensor::FfnGateInpShexp,
        LayerTensor::FfnGateShexp,
        LayerTensor::FfnUpShexp,
        LayerTensor::FfnDownShexp,
    ];

    /// The table: GGUF name after `blk.N.`, Hugging Face name after `model.layers.N.`, shape
    /// (outermost first) and when the tensor is required.
    const fn spec(self) -> (&'static str, &'static str, &'static [Dim], Need) {
        use Dim::*;
        use Need::*;
        match self {
            LayerTensor::AttnNorm => ("attn_norm.weight", "input_layernorm.weight", &[Hidden], Always),
            LayerTensor::AttnQ => ("attn_q.weight", "self_attn.q_proj.weight", &[QWidth, Hidden], SeparateQkv),
            LayerTensor::AttnK => ("attn_k.weight", "self_attn.k_proj.weight", &[KvWidth, Hidden], SeparateQkv),
            LayerTensor::AttnV => ("attn_v.weight", "self_attn.v_proj.weight", &[KvWidth, Hidden], SeparateQkv),
            LayerTensor::AttnQkv => ("attn_qkv.weight", "self_attn.qkv_proj.weight", &[QkvWidth, Hidden], FusedQkv),
            LayerTensor::AttnOutput => ("attn_output.weight", "self_attn.o_proj.weight", &[Hidden, QWidth], Always),
            LayerTensor::AttnQBias => ("attn_q.bias", "self_attn.q_proj.bias", &[QWidth], QkvBias),
            LayerTensor::AttnKBias => ("attn_k.bias", "self_attn.k_proj.bias", &[KvWidth], QkvBias),
            LayerTensor::AttnVBias => ("attn_v.bias", "self_attn.v_proj.bias", &[KvWidth], QkvBias),
            LayerTensor::AttnQNorm => ("attn_q_norm.weight", "self_attn.q_norm.weight", &[QNorm], QkNorm),
            LayerTensor::AttnKNorm => ("attn_k_norm.weight", "self_attn.k_norm.weight", &[KNorm], QkNorm),
            // Gemma's checkpoints name the norms around the feed-forward block otherwise, and
            // call this one what a Llama calls `FfnNorm`: `hf_to_gguf_name_in` reads them by
            // `GEMMA_NORMS`, and the name here is only what `gguf_to_hf_name` writes
            LayerTensor::AttnPostNorm => ("post_attention_norm.weight", "post_attn_norm.weight", &[Hidden], PostNorms),
            LayerTensor::FfnNorm => ("ffn_norm.weight", "post_attention_layernorm.weight", &[Hidden], Always),
            LayerTensor::FfnGate => ("ffn_gate.weight", "mlp.gate_proj.weight", &[Ffn, Hidden], SeparateGate),
            // gate and up in one matrix where the family stores them so (`gate_up_proj` in a
            // checkpoint, see `HF_ALIASES`)
            LayerTensor::FfnUp => ("ffn_up.weight", "mlp.up_proj.weight", &[UpRows, Hidden], Dense),
            LayerTensor::FfnDown => ("ffn_down.weight", "mlp.down_proj.weight", &[Hidden, Ffn], Dense),
            // (Mixtral's checkpoints call the router `block_sparse_moe.gate`: `HF_ALIASES`)
            LayerTensor::FfnGateInp => ("ffn_gate_inp.weight", "mlp.gate.weight", &[Experts, Hidden], Moe),
            // no name in a checkpoint, which stores each expert alone (`piece_name`)
            LayerTensor::FfnGateExps => ("ffn_gate_exps.weight", "", &[Experts, ExpertFfn, Hidden], Moe),
            LayerTensor::FfnUpExps => ("ffn_up_exps.weight", "", &[Experts, ExpertFfn, Hidden], Moe),
            LayerTensor::FfnDownExps => ("ffn_down_exps.weight", "", &[Experts, Hidden, ExpertFfn], Moe),
            LayerTensor::FfnGateInpShexp => {
                ("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight", &[Hidden], SharedExpert)
            }
            LayerTensor::FfnGateShexp => {
                ("ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight", &[SharedFfn, Hidden], SharedExpert)
            }
            LayerTensor::FfnUpShexp => {
                ("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight", &[SharedFfn, Hidden], SharedExpert)
            }
            LayerTensor::FfnDownShexp => {
                ("ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight", &[Hidden, SharedFfn], SharedExpert)
            }
            LayerTensor::FfnPostNorm => {
                ("post_ffw_norm.weight", "post_feedforward_layernorm.weight", &[Hidden], PostNorms)
            }
        }
    }

    /// The GGUF name after `blk.N.` (`attn_q.weight`).
    pub fn suffix(self) -> &'static str {
        self.spec().0
    }

    /// The Hugging Face name after `model.layers.N.` (`self_attn.q_proj.weight`).
    pub fn hf_suffix(self) -> &'static str {
        self.spec().1
    }

    /// The tensor's GGUF name in layer `layer`.
    pub fn name(self, layer: usize) -> String {
        format!("blk.{layer}.{}", self.suffix())
    }

    /// The shape the configuration implies (outermost first).
    pub fn shape(self, c: &ModelConfig) -> Result<Vec<usize>, FormatError> {
        shape_of(self.spec().2, c)
    }

    /// Whether a model of configuration `c` must have the tensor (and may not have it otherwise).
    pub fn required(self, c: &ModelConfig) -> bool {
        match self.spec().3 {
            Need::Always => true,
            Need::QkvBias => c.layer.qkv_bias,
            Need::QkNorm => c.layer.qk_norm,
            Need::SeparateQkv => !c.layer.fused_qkv,
            Need::FusedQkv => c.layer.fused_qkv,
            Need::SeparateGate => !c.layer.fused_gate_up && c.moe.is_none(),
            Need::PostNorms => c.layer.post_norms,
            Need::Dense => c.moe.is_none(),
            Need::Moe => c.moe.is_some(),
            Need::SharedExpert => c.moe.is_some_and(|m| m.shared_ffn.is_some()),
        }
    }

    /// Why a model of configuration `c` may not store the tensor when `c` does not ask for it.
    pub fn unwanted_because(self, c: &ModelConfig) -> &'static str {
        match self.spec().3 {
            // (a mixture's layer has no dense gate whatever the family stores)
            Need::SeparateGate if c.moe.is_some() => {
                "present, but the layer's feed-forward block is a mixture of experts"
            }
            Need::Always => "",
            Need::QkvBias => "present, but the configuration has no q/k/v biases",
            Need::QkNorm => "present, but the configuration's family has no q/k norms",
            Need::SeparateQkv => "present, but the family stores q, k and v as one matrix (attn_qkv)",
            Need::FusedQkv => "present, but the family stores q, k and v as separate matrices",
            Need::SeparateGate => "present, but the family stores gate and up as one matrix (ffn_up)",
            Need::PostNorms => "present, but the family has no norms after attention and the feed-forward block",
            Need::Dense => "present, but the layer's feed-forward block is a mixture of experts",
            Need::Moe => "present, but the configuration has no experts (expert_count)",
            Need::SharedExpert => {
                "present, but the configuration has no shared expert (no expert_shared_feed_forward_length, \
                 shared_expert_intermediate_size)"
            }
        }
    }

    /// The tensors of a layer that a model of configuration `c` has, in table order.
    pub fn required_in(c: &ModelConfig) -> impl Iterator<Item = LayerTensor> + '_ {
        LayerTensor::ALL.into_iter().filter(|t| t.required(c))
    }

    /// RMS norm weights: always dense in the activation type on a device.
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            LayerTensor::AttnNorm
                | LayerTensor::FfnNorm
                | LayerTensor::AttnQNorm
                | LayerTensor::AttnKNorm
                | LayerTensor::AttnPostNorm
                | LayerTensor::FfnPostNorm
        )
    }

    /// `blk.N.<suffix>` as (N, tensor).
    pub fn parse(name: &str) -> Option<(usize, LayerTensor)> {
        let (i, rest) = name.strip_prefix("blk.")?.split_once('.')?;
        let t = LayerTensor::ALL.into_iter().find(|t| t.suffix() == rest)?;
        Some((i.parse().ok()?, t))
    }

    /// Whether the tensor stacks every expert's matrix (`ffn_*_exps`).
    pub fn is_experts(self) -> bool {
        STACKED.contains(&self)
    }

    /// Expert `e`'s own matrix of a stacked tensor, as a checkpoint (and llama.cpp's first MoE
    /// files) store it: `blk.N.ffn_gate.E.weight`. `None` for a tensor that is not stacked.
    pub fn piece_name(self, layer: usize, e: usize) -> Option<String> {
        let base = PIECES[STACKED.iter().position(|s| *s == self)?];
        Some(format!("blk.{layer}.{base}.{e}.weight"))
    }

    /// `blk.N.ffn_gate.E.weight` as (N, the stacked tensor, E).
    pub fn parse_piece(name: &str) -> Option<(usize, LayerTensor, usize)> {
        let (i, rest) = name.strip_prefix("blk.")?.split_once('.')?;
        let (base, rest) = rest.split_once('.')?;
        let e = rest.strip_suffix(".weight")?;
        let t = STACKED[PIECES.iter().position(|p| *p == base)?];
        Some((i.parse().ok()?, t, e.parse().ok()?))
    }

    /// The shape of one expert's matrix of a stacked tensor (the stacked shape less its first
    /// dimension).
    pub fn piece_shape(self, c: &ModelConfig) -> Result<Vec<usize>, FormatError> {
        Ok(self.shape(c)?.split_off(1))
    }

    /// The names under which layer `layer`'s tensor is stored in a model whose tensor table
    /// `has`: itself, or for experts that are stored one by one, each expert's piece.
    pub fn stored_names(self, layer: usize, c: &ModelConfig, has: impl Fn(&str) -> bool) -> Vec<String> {
        let name = self.name(layer);
        match c.moe {
            Some(m) if self.is_experts() && !has(&name) => {
                (0..m.experts).filter_map(|e| self.piece_name(layer, e)).collect()
            }
            _ => vec![name],
        }
    }
}

/// The layer a layer tensor (or an expert's piece of one) belongs to.
pub fn layer_of(name: &str) -> Option<usize> {
    LayerTensor::parse(name).map(|(i, _)| i).or_else(|| LayerTensor::parse_piece(name).map(|(i, _, _)| i))
}

/// Whether a tensor is an RMS norm weight (of a layer, or the final one).
pub fn is_norm(name: &str) -> bool {
    name == OUTPUT_NORM || LayerTensor::parse(name).is_some_and(|(_, t)| t.is_norm())
}

/// Hugging Face Llama/Mistral/Qwen2/Qwen3 tensor names to llama.cpp's GGUF names; `None` for tensors
/// brigade does not read (rotary buffers of old checkpoints, for example).
pub fn hf_to_gguf_name(name: &str) -> Option<String> {
    hf_name(name, false)
}

/// [`hf_to_gguf_name`] for a model of configuration `c`: Gemma's checkpoints (post-norms) call
/// the norm after attention `post_attention_layernorm` — a Llama's name for the norm before the
/// feed-forward block, which Gemma calls `pre_feedforward_layernorm`.
pub fn hf_to_gguf_name_in(name: &str, c: &ModelConfig) -> Option<String> {
    hf_name(name, c.layer.post_norms)
}

/// A checkpoint name's GGUF name: Gemma's norm names first where `gemma_norms`, then the
/// aliases, then the layer table.
fn hf_name(name: &str, gemma_norms: bool) -> Option<String> {
    if let Some((g, _)) = HF_NAMES.iter().find(|(_, h)| *h == name) {
        return Some(g.to_string());
    }
    let (i, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let named = |table: &[(&str, LayerTensor)]| table.iter().find(|(h, _)| *h == rest).map(|(_, t)| *t);
    if let Some(piece) = hf_piece(rest) {
        return piece.0.piece_name(i, piece.1);
    }
    let gemma = if gemma_norms { named(&GEMMA_NORMS) } else { None };
    gemma
        .or_else(|| named(&HF_ALIASES))
        .or_else(|| LayerTensor::ALL.into_iter().find(|t| t.hf_suffix() == rest))
        .map(|t| t.name(i))
}

/// Gemma's checkpoint names of the norms around its feed-forward block.
const GEMMA_NORMS: [(&str, LayerTensor); 3] = [
    ("post_attention_layernorm.weight", LayerTensor::AttnPostNorm),
    ("pre_feedforward_layernorm.weight", LayerTensor::FfnNorm),
    ("post_feedforward_layernorm.weight", LayerTensor::FfnPostNorm),
];

/// Checkpoint names of layer tensors that GGUF stores under another tensor's name: Phi-3's
/// `gate_up_proj` is llama.cpp's `ffn_up` of `2 × ffn` rows ([`Dim::UpRows`]); Mixtral's
/// router.
const HF_ALIASES: [(&str, LayerTensor); 2] =
    [("mlp.gate_up_proj.weight", LayerTensor::FfnUp), ("block_sparse_moe.gate.weight", LayerTensor::FfnGateInp)];

/// An expert's matrices in a checkpoint, after `model.layers.N.` and before `E.`: the gate's,
/// the up projection's and the down projection's names. Qwen's MoE families (and OLMoE) first,
/// the names brigade writes; then Mixtral's (w1 gate, w3 up, w2 down).
const HF_EXPERTS: [(&str, [&str; 3]); 2] = [
    ("mlp.experts.", ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]),
    ("block_sparse_moe.experts.", ["w1.weight", "w3.weight", "w2.weight"]),
];

/// The GGUF names of one expert's pieces of the stacked tensors (`blk.N.ffn_gate.E.weight`), in
/// the order of [`STACKED`].
const PIECES: [&str; 3] = ["ffn_gate", "ffn_up", "ffn_down"];

/// The stacked tensors in the order of [`HF_EXPERTS`]' names.
const STACKED: [LayerTensor; 3] = [LayerTensor::FfnGateExps, LayerTensor::FfnUpExps, LayerTensor::FfnDownExps];

/// An expert's matrix in a checkpoint (after `model.layers.N.`) as the stacked tensor it is a
/// piece of and the expert's number.
fn hf_piece(rest: &str) -> Option<(LayerTensor, usize)> {
    HF_EXPERTS.iter().find_map(|(prefix, names)| {
        let (e, w) = rest.strip_prefix(prefix)?.split_once('.')?;
        let k = names.iter().position(|n| *n == w)?;
        Some((STACKED[k], e.parse().ok()?))
    })
}

/// llama.cpp's GGUF names to Hugging Face names (for writing safetensors).
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    if let Some((_, h)) = HF_NAMES.iter().find(|(g, _)| *g == name) {
        return Some(h.to_string());
    }
    if let Some((i, t, e)) = LayerTensor::parse_piece(name) {
        let (prefix, names) = HF_EXPERTS[0];
        let w = names[STACKED.iter().position(|s| *s == t)?];
        return Some(format!("model.layers.{i}.{prefix}{e}.{w}"));
    }
    let (i, t) = LayerTensor::parse(name)?;
    if t.hf_suffix().is_empty() {
        // stacked experts: a checkpoint holds them one by one
        return None;
    }
    Some(format!("model.layers.{i}.{}", t.hf_suffix()))
}

/// The tensors a slice holding layers `[a, b)` of the model reads: the tensors every slice needs
/// ([`SHARED_TENSORS`] the model has), the embedding when `a == 0`, the layers' tensors, and the
/// final norm and head when `b == n_layers` (the embedding again when the head is tied to it,
/// named once).
pub fn slice_tensors(index: &ModelIndex, layers: LayerRange) -> Result<Vec<String>, FormatError> {
    let c = index.config();
    if layers.end() > c.n_layers {
        return Err(FormatError::BadSlice(format!("layers {layers} of a model with {} layers", c.n_layers)));
    }
    let mut names: Vec<String> =
        SHARED_TENSORS.iter().filter(|n| index.tensor_info(n).is_some()).map(|n| n.to_string()).collect();
    if layers.is_first() {
        names.push(TOKEN_EMBD.into());
    }
    let has = |n: &str| index.tensor_info(n).is_some();
    for i in layers.iter() {
        names.extend(LayerTensor::required_in(c).flat_map(|t| t.stored_names(i, c, has)));
    }
    if layers.is_last(c.n_layers) {
        names.push(OUTPUT_NORM.into());
        if !index.tied_head() {
            names.push(OUTPUT.into());
        } else if !layers.is_first() {
            names.push(TOKEN_EMBD.into());
        }
    }
    Ok(names)
}

/// [`slice_tensors`] from tensor names alone (the coordinator's view of a model: its manifest):
/// every present tensor of the slice's layers, the shared ones, the embedding when first, the
/// final norm and head when last (the embedding again when there is no separate head).
pub fn slice_tensor_names<'a>(
    names: impl IntoIterator<Item = &'a str>,
    n_layers: usize,
    layers: LayerRange,
) -> Result<Vec<String>, FormatError> {
    if layers.end() > n_layers {
        return Err(FormatError::BadSlice(format!("layers {layers} of a model with {n_layers} layers")));
    }
    let names: Vec<&str> = names.into_iter().collect();
    let has = |n: &str| names.contains(&n);
    let mut out: Vec<String> = SHARED_TENSORS.iter().filter(|n| has(n)).map(|n| n.to_string()).collect();
    if layers.is_first() {
        out.push(TOKEN_EMBD.into());
    }
    out.extend(names.iter().filter(|n| layer_of(n).is_some_and(|i| layers.contains(i))).map(|n| n.to_string()));
    if layers.is_last(n_layers) {
        out.push(OUTPUT_NORM.into());
        if has(OUTPUT) {
            out.push(OUTPUT.into());
        } else if !layers.is_first() {
            out.push(TOKEN_EMBD.into());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in [
            "token_embd.weight",
            "output.weight",
            "blk.12.attn_q.bias",
            "blk.3.ffn_down.weight",
            "blk.2.ffn_up.5.weight",
        ] {
            assert_eq!(hf_to_gguf_name(&gguf_to_hf_name(n).unwrap()).as_deref(), Some(n));
        }
        for t in LayerTensor::ALL {
            assert_eq!(LayerTensor::parse(&t.name(7)), Some((7, t)));
        }
        assert!(hf_to_gguf_name("model.layers.x.mlp.up_proj.weight").is_none());
        // Mixtral's expert names read as the same pieces; a stacked tensor has no checkpoint name
        assert_eq!(
            hf_to_gguf_name("model.layers.1.block_sparse_moe.experts.3.w2.weight").as_deref(),
            Some("blk.1.ffn_down.3.weight")
        );
        assert_eq!(LayerTensor::parse_piece("blk.1.ffn_gate.7.weight"), Some((1, LayerTensor::FfnGateExps, 7)));
        assert!(gguf_to_hf_name("blk.0.ffn_up_exps.weight").is_none());
        assert!(hf_to_gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq").is_none());
        assert!(LayerTensor::parse("blk.1.attn_rot_embd").is_none());
        assert!(is_norm("blk.0.ffn_norm.weight") && is_norm(OUTPUT_NORM) && !is_norm("blk.0.ffn_up.weight"));
    }
}
