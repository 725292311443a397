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
}
