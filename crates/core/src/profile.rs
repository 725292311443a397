use serde::{Deserialize, Serialize};

/// What the planner knows of a model: per-layer weight bytes and flops per token, the head and
/// the embedding, and the KV cache's bytes per token per layer. Read from a model file's header
/// (exact bytes from its tensor table) or built from a [`LlamaShape`] and a bits-per-weight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    /// The model's name, as plans and errors show it.
    pub name: String,
    /// Weight bytes of each transformer layer.
    pub layer_bytes: Vec<u64>,
    /// Floating-point operations per token of each layer (2 × parameters).
    pub layer_flops: Vec<f64>,
    /// The output head (+ final norm): bytes and flops per token (2 × hidden × vocab).
    pub head_bytes: u64,
    /// Floating-point operations per token of the output head (2 × hidden × vocab).
    pub head_flops: f64,
    /// The token embedding: memory only (a token reads one row).
    pub embed_bytes: u64,
    /// The head is the embedding matrix (tied weights): a stage holding both keeps one copy.
    pub tied: bool,
    /// K and V bytes per token per layer.
    pub kv_bytes_per_token: u64,
    /// K and V bytes per token per layer on a CPU device, where the runtime keeps the CPU's cache
    /// in another type than the other devices' (brigade's CPU stages hold it in f32, GPUs in
    /// bf16/f16); `None`: [`ModelProfile::kv_bytes_per_token`] on every device.
    #[serde(default)]
    pub cpu_kv_bytes_per_token: Option<u64>,
    /// The most positions each layer's KV cache holds, whatever the context: a sliding-window
    /// layer's window plus one forward pass (the runtime sizes its cache so); `None`, or a
    /// profile without the list, the whole context.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_positions_max: Vec<Option<u64>>,
    /// Bytes of a stage's rotary tables per context position (cosine and sine of each rotated
    /// pair, f32; twice where windowed layers have their own base): every stage holds its own
    /// over the whole context. 0 in a profile stored before it was counted.
    #[serde(default)]
    pub rope_bytes_per_position: u64,
    /// The context the model was trained for (GGUF `context_length`, `max_position_embeddings`):
    /// the max-context objective goes no further. `None`: unknown (a shape's profile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u64>,
    /// Elements of one token's hidden state, what passes between stages
    /// ([`ModelProfile::act_bytes`]).
    pub hidden: usize,
    /// Tokens in the vocabulary (the head's output width).
    pub vocab: usize,
    /// Mixture-of-experts layers: what of each layer's bytes are its routed experts, of which a
    /// token reads only the ones it chose. `None`: dense layers, every byte read per pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeProfile>,
}

/// The routed experts of a MoE model's layers, for the cost model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeProfile {
    /// Bytes of each layer's routed experts (within [`ModelProfile::layer_bytes`]; a shared
    /// expert is always read and not counted here).
    pub expert_bytes: Vec<u64>,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts each token goes through.
    pub used: usize,
    /// Floating-point operations per token of each layer's routed experts (within
    /// [`ModelProfile::layer_flops`]: `used` experts' matrices, 2 × their parameters). Empty in a
    /// profile stored before it was counted (then 0: split layers cost only the experts' bytes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expert_flops: Vec<f64>,
}

impl MoeProfile {
    /// The expected share of a layer's experts that `rows` tokens routed independently and
    /// uniformly read: `1 − (1 − used/experts)^rows` (one token: `used / experts`; a long
    /// prompt: nearly all).
    pub fn read_share(&self, rows: f64) -> f64 {
        if self.experts == 0 {
            return 1.0;
        }
        let k = (self.used as f64 / self.experts as f64).clamp(0.0, 1.0);
        1.0 - (1.0 - k).powf(rows.max(1.0))
    }
}

impl ModelProfile {
    /// Bytes layer `l` reads from memory for a pass of `rows` tokens: every byte of a dense
    /// layer; a MoE layer's always-read part plus the expected share of its experts
    /// ([`MoeProfile::read_share`]).
    pub fn layer_read_bytes(&self, l: usize, rows: f64) -> f64 {
        let all = self.layer_bytes.get(l).copied().unwrap_or(0) as f64;
        match &self.moe {
            Some(m) => {
                let e = (m.expert_bytes.get(l).copied().unwrap_or(0) as f64).min(all);
                all - e + e * m.read_share(rows)
            }
            None => all,
        }
    }

    /// Bytes of layer `l`'s routed experts a pass of `rows` tokens reads (0 for a dense layer):
    /// the part of [`ModelProfile::layer_read_bytes`] a split layer reads from host RAM.
    pub fn expert_read_bytes(&self, l: usize, rows: f64) -> f64 {
        match &self.moe {
            Some(m) => {
                let all = self.layer_bytes.get(l).copied().unwrap_or(0);
                m.expert_bytes.get(l).copied().unwrap_or(0).min(all) as f64 * m.read_share(rows)
            }
            None => 0.0,
        }
    }

    /// Bytes of layer `l`'s routed experts (0 for a dense layer): what a split layer holds in
    /// host RAM.
    pub fn expert_bytes(&self, l: usize) -> u64 {
        let all = self.layer_bytes.get(l).copied().unwrap_or(0);
        self.moe.as_ref().map_or(0, |m| m.expert_bytes.get(l).copied().unwrap_or(0).min(all))
    }

    /// Floating-point operations per token of layer `l`'s routed experts (0 for a dense layer).
    pub fn expert_flops(&self, l: usize) -> f64 {
        let all = self.layer_flops.get(l).copied().unwrap_or(0.0);
        self.moe.as_ref().map_or(0.0, |m| m.expert_flops.get(l).copied().unwrap_or(0.0).min(all))
    }

    /// Transformer layers: the length of [`ModelProfile::layer_bytes`].
    pub fn n_layers(&self) -> usize {
        self.layer_bytes.len()
    }

    /// K and V bytes per token per layer on a device of `kind`.
    pub fn kv_bytes_per_token_on(&self, kind: crate::DeviceKind) -> u64 {
        match (kind, self.cpu_kv_bytes_per_token) {
            (crate::DeviceKind::Cpu, Some(b)) => b,
            _ => self.kv_bytes_per_token,
        }
    }

    /// Positions layer `layer`'s KV cache holds for a context of `ctx` tokens (see
    /// [`ModelProfile::kv_positions_max`]).
    pub fn kv_positions(&self, layer: usize, ctx: u64) -> u64 {
        match self.kv_positions_max.get(layer) {
            Some(Some(max)) => ctx.min(*max),
            _ => ctx,
        }
    }

    /// Bytes of the hidden state of one token between stages (f32 activations).
    pub fn act_bytes(&self) -> u64 {
        self.hidden as u64 * 4
    }

    /// Weights of the whole model in one place (a tied head counted once).
    pub fn total_weight_bytes(&self) -> u64 {
        let embed = if self.tied { 0 } else { self.embed_bytes };
        self.layer_bytes.iter().sum::<u64>() + self.head_bytes + embed
    }

    /// A profile for a Llama shape stored at `bits_per_weight` (embedding and head included), with
    /// a KV cache of `kv_dtype_bytes` per element.
    pub fn from_shape(name: &str, s: &LlamaShape, bits_per_weight: f64, kv_dtype_bytes: u64) -> ModelProfile {
        let bytes = |params: u64| (params as f64 * bits_per_weight / 8.0).round() as u64;
        let hd = s.hidden / s.heads;
        let (h, f, kv) = (s.hidden as u64, s.ffn as u64, (s.kv_heads * hd) as u64);
        // q, o: h×h; k, v: h×kv; gate, up, down: h×f; plus two norms (f32, negligible but counted)
        let layer_params = 2 * h * h + 2 * h * kv + 3 * h * f;
        let layer = bytes(layer_params) + 2 * h * 4;
        let head_params = s.vocab as u64 * h;
        ModelProfile {
            name: name.to_string(),
            layer_bytes: vec![layer; s.layers],
            layer_flops: vec![2.0 * layer_params as f64; s.layers],
            head_bytes: bytes(head_params) + h * 4,
            head_flops: 2.0 * head_params as f64,
            embed_bytes: bytes(head_params),
            tied: s.tied,
            kv_bytes_per_token: 2 * kv * kv_dtype_bytes,
            cpu_kv_bytes_per_token: None,
            kv_positions_max: Vec::new(),
            // cos and sin of hd / 2 angles per position, f32
            rope_bytes_per_position: 2 * (hd as u64 / 2) * 4,
            context_length: None,
            hidden: s.hidden,
            vocab: s.vocab,
            moe: None,
        }
    }
}

/// A Llama-family shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaShape {
    /// Transformer layers.
    pub layers: usize,
    /// Width of the hidden state (the model dimension).
    pub hidden: usize,
    /// Inner width of the feed-forward block (gate, up and down projections).
    pub ffn: usize,
    /// Attention (query) heads; the head dimension is `hidden / heads`.
    pub heads: usize,
    /// Key/value heads (fewer than `heads` with grouped-query attention).
    pub kv_heads: usize,
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// The output head shares the embedding's weights (Llama 3.2 1B).
    pub tied: bool,
}

impl LlamaShape {
    /// The Llama 3.x shapes: llama-1b (3.2 1B), llama-8b (3.1 8B), llama-70b (3.1 70B).
    pub fn preset(name: &str) -> Option<LlamaShape> {
        let (layers, hidden, ffn, heads, kv_heads, tied) = match name {
            "llama-1b" => (16, 2048, 8192, 32, 8, true),
            "llama-8b" => (32, 4096, 14336, 32, 8, false),
            "llama-70b" => (80, 8192, 28672, 64, 8, false),
            _ => return None,
        };
        Some(LlamaShape { layers, hidden, ffn, heads, kv_heads, vocab: 128_256, tied })
    }

    /// The names [`LlamaShape::preset`] knows.
    pub const PRESETS: [&'static str; 3] = ["llama-1b", "llama-8b", "llama-70b"];
}

/// A mixture-of-experts shape (Qwen3-MoE, Mixtral): attention as Llama's with its own head
/// width, a router, `experts` routed experts of `expert_ffn` of which a token takes `used`, and
/// an optional shared expert.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeShape {
    /// Transformer layers.
    pub layers: usize,
    /// Width of the hidden state.
    pub hidden: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one attention head (Qwen3's 128 is not `hidden / heads`).
    pub head_dim: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts each token goes through.
    pub used: usize,
    /// Inner width of one routed expert.
    pub expert_ffn: usize,
    /// Inner width of the shared expert (0: none).
    pub shared_ffn: usize,
    /// Tokens in the vocabulary.
    pub vocab: usize,
}

impl MoeShape {
    /// Qwen3-30B-A3B, Qwen3-235B-A22B and Mixtral-8x7B by name.
    pub fn preset(name: &str) -> Option<MoeShape> {
        let (layers, hidden, heads, kv_heads, head_dim, experts, used, expert_ffn, vocab) = match name {
            "qwen3-30b-a3b" => (48, 2048, 32, 4, 128, 128, 8, 768, 151_936),
            "qwen3-235b-a22b" => (94, 4096, 64, 4, 128, 128, 8, 1536, 151_936),
            "mixtral-8x7b" => (32, 4096, 32, 8, 128, 8, 2, 14_336, 32_000),
            _ => return None,
        };
        Some(MoeShape { layers, hidden, heads, kv_heads, head_dim, experts, used, expert_ffn, shared_ffn: 0, vocab })
    }

    /// The names [`MoeShape::preset`] knows.
    pub const PRESETS: [&'static str; 3] = ["qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"];
}

impl ModelProfile {
    /// A profile for a mixture-of-experts shape stored at `bits_per_weight` (the router in f32,
    /// as brigade holds it), with a KV cache of `kv_dtype_bytes` per element.
    pub fn from_moe_shape(name: &str, s: &MoeShape, bits_per_weight: f64, kv_dtype_bytes: u64) -> ModelProfile {
        let bytes = |params: u64| (params as f64 * bits_per_weight / 8.0).round() as u64;
        let (h, q, kv) = (s.hidden as u64, (s.heads * s.head_dim) as u64, (s.kv_heads * s.head_dim) as u64);
        let attn = 2 * h * q + 2 * h * kv;
        let expert = 3 * h * s.expert_ffn as u64;
        let shared = 3 * h * s.shared_ffn as u64;
        let router = h * s.experts as u64;
        let experts = expert * s.experts as u64;
        let layer = bytes(attn + shared) + bytes(experts) + router * 4 + 2 * h * 4;
        let active = attn + shared + router + expert * s.used as u64;
        let head_params = s.vocab as u64 * h;
        ModelProfile {
            name: name.to_string(),
            layer_bytes: vec![layer; s.layers],
            layer_flops: vec![2.0 * active as f64; s.layers],
            head_bytes: bytes(head_params) + h * 4,
            head_flops: 2.0 * head_params as f64,
            embed_bytes: bytes(head_params),
            tied: false,
            kv_bytes_per_token: 2 * kv * kv_dtype_bytes,
            cpu_kv_bytes_per_token: None,
            kv_positions_max: Vec::new(),
            rope_bytes_per_position: 2 * (s.head_dim as u64 / 2) * 4,
            context_length: None,
            hidden: s.hidden,
            vocab: s.vocab,
            moe: Some(MoeProfile {
                expert_bytes: vec![bytes(experts); s.layers],
                experts: s.experts,
                used: s.used,
                expert_flops: vec![2.0 * (expert * s.used as u64) as f64; s.layers],
            }),
        }
    }
}

/// Bits per weight of the quantization names `--quant` takes (llama.cpp's block sizes).
pub fn bits_per_weight(quant: &str) -> Option<f64> {
    Some(match quant.to_ascii_lowercase().as_str() {
        "f32" => 32.0,
        "f16" | "bf16" => 16.0,
        "q8_0" => 8.5,
        "q6_k" => 6.5625,
        "q5_k" => 5.5,
        "q4_k" | "q4_k_m" | "q4_k_s" => 4.5,
        "q4_0" => 4.5,
        "q4_1" => 5.0,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eight_b_at_q4_k_is_about_4_5_gb() {
        let s = LlamaShape::preset("llama-8b").unwrap();
        let p = ModelProfile::from_shape("8b", &s, 4.5, 2);
        let total = p.total_weight_bytes() as f64;
        // 8.03 B parameters at 4.5 bits
        assert!((total / 1e9 - 4.52).abs() < 0.05, "{total}");
        assert_eq!(p.kv_bytes_per_token, 2 * 8 * 128 * 2);
        assert_eq!(p.n_layers(), 32);
        assert_eq!(bits_per_weight("Q6_K"), Some(6.5625));
        assert_eq!(bits_per_weight("q3"), None);
    }

    /// Qwen3-30B-A3B: 30.5 B parameters, 3.3 B of them active per token (the model card's
    /// figures; the card counts the embedding among the active ones).
    #[test]
    fn a_mixture_shape_counts_all_experts_and_reads_the_used_ones() {
        let s = MoeShape::preset("qwen3-30b-a3b").unwrap();
        let p = ModelProfile::from_moe_shape("30b", &s, 16.0, 2);
        let total = p.total_weight_bytes() as f64 / 2.0;
        assert!((total / 1e9 - 30.5).abs() < 0.3, "{total}");
        let active = p.layer_flops.iter().sum::<f64>() / 2.0 + p.head_flops / 2.0 + p.embed_bytes as f64 / 2.0;
        assert!((active / 1e9 - 3.3).abs() < 0.15, "{active}");
        let m = p.moe.as_ref().unwrap();
        assert!(m.expert_bytes[0] as f64 > 0.9 * p.layer_bytes[0] as f64);
        // a token reads 8 of 128 experts: about a sixteenth of them, and the dense part
        let read = p.layer_read_bytes(0, 1.0);
        let dense = (p.layer_bytes[0] - m.expert_bytes[0]) as f64;
        assert!((read - dense - m.expert_bytes[0] as f64 / 16.0).abs() < 1.0);
        assert_eq!(p.expert_bytes(0), m.expert_bytes[0]);
        assert!((p.expert_read_bytes(0, 1.0) - m.expert_bytes[0] as f64 / 16.0).abs() < 1.0);
        assert!(p.expert_flops(0) > 0.0 && p.expert_flops(0) < p.layer_flops[0]);
        assert!(MoeShape::preset("qwen3-31b").is_none());
    }
}
