//! A slice of a Llama-family model: transformer layers `[a, b)` on one device, plus the token
//! embedding when `a == 0` and the final norm and output head when `b == n_layers`.
//!
//! Shaped like candle-transformers' `models/llama.rs`: private `Block` with `load` and `forward`,
//! a tracing span per module. Unlike it, the KV cache is not inside the model but in a
//! [`SliceCache`] per session, preallocated for the context length and written in place, so one
//! loaded slice serves many sessions and a decode step appends without concatenating.

use crate::config::{first_key, ModelConfig, RopeStyle};
use crate::weights::{Embedding, Linear, ModelFiles};
use crate::ModelError;
use brigade_core::{DeviceId, LayerRange};
use brigade_format::tensors::{slice_tensors, LayerTensor, OUTPUT, OUTPUT_NORM, SHARED_TENSORS, TOKEN_EMBD};
use candle_core::{DType, Device, Tensor, D};
use std::sync::Arc;

mod decode_attn;
mod fused;
mod moe;
mod rows;
mod silu;
mod softmax;
pub use moe::{ExpertShard, ExpertSplit, ExpertsCall, RemoteExperts};

/// The vector code the element-wise CPU loops run (SiLU·up, the softmaxes, a decode step's
/// attention): `avx512`, `avx2` or `scalar` (this CPU's widest, no wider than
/// `BRIGADE_CPU_KERNELS` asks), for `brigade doctor`.
pub fn vector_loops() -> &'static str {
    brigade_kernels::vector::Width::detect().name()
}

/// What a stage receives: token ids (first stage) or the previous stage's hidden state.
pub enum StageInput<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a Tensor),
}

/// Which positions the last stage computes logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (generation).
    Last,
    /// Every position of the chunk (reference checks).
    All,
}

/// Which matmul a pass runs a layer's weights with: [`Linear::forward`] for one session's
/// tokens (`Batch`), [`Linear::forward_rows`] for the decode rows of several sessions (`Rows`,
/// see [`rows`]). Experts computed on another node are computed with the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatMul {
    Batch,
    Rows,
}

impl MatMul {
    fn run(self, l: &Linear, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            MatMul::Batch => l.forward(x),
            MatMul::Rows => l.forward_rows(x),
        }
    }
}

/// Matmuls that share their input, stacked into one when the file's types allow it.
enum Proj {
    Stacked(Linear, Vec<usize>),
    Separate(Vec<Linear>),
}

impl Proj {
    fn load(
        files: &ModelFiles,
        names: &[String],
        biases: Option<Vec<String>>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let n: Vec<&str> = names.iter().map(String::as_str).collect();
        let b: Option<Vec<&str>> = biases.as_ref().map(|v| v.iter().map(String::as_str).collect());
        if let Some(l) = files.linear_stacked(&n, b.as_deref(), device, dtype)? {
            let sizes = n.iter().map(|x| files.tensor_info(x).map(|t| t.shape()[0]).unwrap_or(0)).collect();
            return Ok(Proj::Stacked(l, sizes));
        }
        let parts = n
            .iter()
            .enumerate()
            .map(|(i, name)| files.linear(name, b.as_ref().map(|b| b[i]), device, dtype))
            .collect::<Result<_, _>>()?;
        Ok(Proj::Separate(parts))
    }

    fn forward(&self, x: &Tensor, mm: MatMul) -> candle_core::Result<Vec<Tensor>> {
        match self {
            Proj::Stacked(l, sizes) => {
                let y = mm.run(l, x)?;
                let mut out = Vec::with_capacity(sizes.len());
                let mut at = 0;
                for &n in sizes {
                    out.push(y.narrow(D::Minus1, at, n)?);
                    at += n;
                }
                Ok(out)
            }
            Proj::Separate(ls) => ls.iter().map(|l| mm.run(l, x)).collect(),
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Proj::Stacked(l, _) => l.storage_bytes(),
            Proj::Separate(ls) => ls.iter().map(Linear::storage_bytes).sum(),
        }
    }

    fn rows_independent(&self) -> bool {
        match self {
            Proj::Stacked(l, _) => l.rows_independent(),
            Proj::Separate(ls) => ls.iter().all(Linear::rows_independent),
        }
    }
}

struct Block {
    attn_norm: Tensor,
    /// The norms after attention and after the feed-forward block
    /// ([`brigade_format::config::LayerSpec::post_norms`]).
    post_norms: Option<(Tensor, Tensor)>,
    /// GeLU-tanh instead of SiLU gating the feed-forward block.
    gelu: bool,
    /// The layer's sliding window ([`ModelConfig::window`]).
    window: Option<usize>,
    /// Whether RoPE uses the windowed layers' own base ([`ModelConfig::local_rope_theta`]).
    local_rope: bool,
    /// The per-head norms of q and k (`head_dim` weights each) where the layer has them
    /// ([`brigade_format::config::LayerSpec::qk_norm`]).
    qk_norm: Option<(Tensor, Tensor)>,
    ffn_norm: Tensor,
    /// q, k, v
    qkv: Proj,
    wo: Linear,
    ffn: Ffn,
    span: tracing::Span,
}

/// A gated feed-forward block: SiLU (or GeLU) of the gate times up, then down. A dense layer's,
/// or one expert of a mixture.
struct GatedFfn {
    /// gate, up
    gate_up: Proj,
    down: Linear,
}

impl GatedFfn {
    fn bytes(&self) -> u64 {
        self.gate_up.bytes() + self.down.storage_bytes()
    }

    fn rows_independent(&self) -> bool {
        self.gate_up.rows_independent() && self.down.rows_independent()
    }

    /// `x: (b, t, hidden)` through the block with candle's ops.
    fn forward(&self, x: &Tensor, mm: MatMul, gelu: bool) -> candle_core::Result<Tensor> {
        let gu = self.gate_up.forward(x, mm)?;
        mm.run(&self.down, &gated(gelu, &gu[0], &gu[1])?)
    }
}

/// A layer's feed-forward half.
enum Ffn {
    Dense(GatedFfn),
    /// Experts in place of the dense block ([`ModelConfig::moe`]).
    Moe(Box<moe::MoeFfn>),
}

impl Ffn {
    fn bytes(&self) -> u64 {
        match self {
            Ffn::Dense(f) => f.bytes(),
            Ffn::Moe(m) => m.bytes(),
        }
    }

    fn rows_independent(&self) -> bool {
        match self {
            Ffn::Dense(f) => f.rows_independent(),
            Ffn::Moe(m) => m.rows_independent(),
        }
    }
}

struct Head {
    norm: Tensor,
    out: Linear,
}

/// The K and V cache of one session for the layers of one slice, preallocated: per layer
/// `(1, n_kv_heads, positions, head_dim)`, where a layer's positions are
/// [`ModelConfig::kv_positions`]: the context, or for a sliding-window layer its window plus one
/// forward pass.
///
/// A windowed layer's storage holds positions `base..len` from slot 0; when a pass would run
/// past its end, the keys the next query still sees (the last `window - 1`) move to the front
/// ([`SliceCache::make_room`]), once a pass ([`ModelConfig::pass`]): the attention code reads
/// one contiguous run of keys as it does for a global layer, at slot `pos - base`.
pub struct SliceCache {
    kv: Vec<(Tensor, Tensor)>,
    /// Whether each layer's storage is window-sized.
    windowed: Vec<bool>,
    window: Option<usize>,
    /// The position a windowed layer's slot 0 holds (0 for every other layer).
    base: usize,
    len: usize,
    n_ctx: usize,
}

impl SliceCache {
    /// Tokens held so far.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The longest prefix of at most `n` tokens this cache can go back to: `n` itself, unless a
    /// windowed layer has already let go of keys a query at position `n` would see; then 0
    /// (the session starts over).
    pub fn keepable(&self, n: usize) -> usize {
        let n = n.min(self.len);
        if self.base == 0 || first_key(self.window, n) >= self.base {
            n
        } else {
            0
        }
    }
    /// Forgets everything after the first [`SliceCache::keepable`]`(n)` tokens and returns how
    /// many are kept (the storage stays allocated).
    pub fn truncate(&mut self, n: usize) -> usize {
        let n = self.keepable(n);
        self.len = n;
        if n == 0 {
            self.base = 0;
        }
        n
    }
    pub fn bytes(&self) -> u64 {
        self.kv.iter().map(|(k, v)| ((k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes()) as u64).sum()
    }

    /// The position slot 0 of layer `l`'s storage holds: where a pass writes and reads it.
    fn base_of(&self, l: usize) -> usize {
        if self.windowed.get(l).copied().unwrap_or(false) {
            self.base
        } else {
            0
        }
    }

    /// Makes room for `t` more tokens in the windowed layers: where they would run past the
    /// storage, the keys a query at the next position still sees move to slot 0.
    fn make_room(&mut self, t: usize) -> Result<(), ModelError> {
        let (Some(w), Some(l)) = (self.window, self.windowed.iter().position(|&w| w)) else {
            return Ok(());
        };
        let cap = self.kv[l].0.dim(2)?;
        if self.len + t - self.base <= cap {
            return Ok(());
        }
        let keep = first_key(Some(w), self.len).max(self.base);
        if self.len + t - keep > cap {
            return Err(ModelError::BadInput(format!(
                "{t} tokens in one pass into a sliding-window cache of {cap} positions (window {w})"
            )));
        }
        if let Err(e) = self.move_keys(keep) {
            // some layers may have moved and others not: the cache holds nothing true now
            self.len = 0;
            self.base = 0;
            return Err(e);
        }
        self.base = keep;
        Ok(())
    }

    /// Copies positions `keep..len` of every windowed layer to slot 0.
    fn move_keys(&self, keep: usize) -> Result<(), ModelError> {
        let (from, n) = (keep - self.base, self.len - keep);
        if n == 0 {
            return Ok(());
        }
        for (k, v) in self.kv.iter().zip(&self.windowed).filter(|(_, w)| **w).map(|(kv, _)| kv) {
            for c in [k, v] {
                // a copy first: candle writes no tensor from its own storage
                c.slice_set(&c.narrow(2, from, n)?.force_contiguous()?, 2, 0)?;
            }
        }
        Ok(())
    }
}

/// Zeros, on the CPU with every page already mapped: candle's zeros are `calloc`ed, so the
/// kernel maps and clears a cache's pages when a session first writes them — with transparent
/// huge pages 2 MiB per head and layer as soon as a prompt's first token lands there, which was
/// a quarter of the time of a new session's first 150-token prompt in `brigade serve` (0.3 s of
/// 1.2 s). Touching them at allocation also makes the memory a session was promised really
/// its own from the start.
fn resident_zeros(shape: (usize, usize, usize, usize), dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    if !device.is_cpu() || dtype != DType::F32 {
        return Tensor::zeros(shape, dtype, device);
    }
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let mut v = vec![0f32; n];
    // one store per 4 KiB page; `black_box` keeps the compiler from dropping a store of zero
    // into memory it knows is zero
    v.iter_mut().step_by(1024).for_each(|x| *x = std::hint::black_box(0.0));
    Tensor::from_vec(v, shape, device)
}

pub struct Slice {
    cfg: Arc<ModelConfig>,
    layers: LayerRange,
    device: Device,
    dtype: DType,
    embed: Option<Embedding>,
    blocks: Vec<Block>,
    head: Option<Head>,
    cos: Tensor,
    sin: Tensor,
    /// The rotary tables of the windowed layers' own base, where the slice has such layers.
    local_rope: Option<(Tensor, Tensor)>,
    n_ctx: usize,
    weight_bytes: u64,
    /// Whether decode steps take the fused CPU path (`fused`): where the slice can
    /// ([`Slice::decodes_on_slices`]) unless `BRIGADE_CPU_FUSED=off` or
    /// [`Slice::set_fused_decode`] says otherwise.
    fused: bool,
    span: tracing::Span,
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    candle_nn::ops::rms_norm(x, w, eps as f32)
}

impl Block {
    /// Loads layer `i`: every tensor [`LayerTensor`] says the configuration has.
    fn load(
        files: &ModelFiles,
        i: usize,
        device: &Device,
        dtype: DType,
        split: Option<&moe::ExpertSplit>,
    ) -> Result<Self, ModelError> {
        use LayerTensor as T;
        let cfg = files.config();
        let n = |t: T| t.name(i);
        let qkv_bias = T::AttnQBias.required(cfg).then(|| vec![n(T::AttnQBias), n(T::AttnKBias), n(T::AttnVBias)]);
        let norm = |t: T| files.norm(&n(t), device, dtype);
        let qk_norm = if cfg.layer.qk_norm { Some((norm(T::AttnQNorm)?, norm(T::AttnKNorm)?)) } else { None };
        let post_norms =
            if cfg.layer.post_norms { Some((norm(T::AttnPostNorm)?, norm(T::FfnPostNorm)?)) } else { None };
        Ok(Block {
            attn_norm: norm(T::AttnNorm)?,
            post_norms,
            gelu: cfg.layer.gelu,
            window: cfg.window(i),
            local_rope: cfg.local_rope_theta(i).is_some(),
            qk_norm,
            ffn_norm: norm(T::FfnNorm)?,
            qkv: if cfg.layer.fused_qkv {
                let (q, kv) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
                Proj::Stacked(files.linear(&n(T::AttnQkv), None, device, dtype)?, vec![q, kv, kv])
            } else {
                Proj::load(files, &[n(T::AttnQ), n(T::AttnK), n(T::AttnV)], qkv_bias, device, dtype)?
            },
            wo: files.linear(&n(T::AttnOutput), None, device, dtype)?,
            ffn: match cfg.moe {
                Some(m) => Ffn::Moe(Box::new(moe::MoeFfn::load(files, i, m, device, dtype, split)?)),
                None => Ffn::Dense(GatedFfn {
                    gate_up: if cfg.layer.fused_gate_up {
                        Proj::Stacked(files.linear(&n(T::FfnUp), None, device, dtype)?, vec![cfg.ffn, cfg.ffn])
                    } else {
                        Proj::load(files, &[n(T::FfnGate), n(T::FfnUp)], None, device, dtype)?
                    },
                    down: files.linear(&n(T::FfnDown), None, device, dtype)?,
                }),
            },
            span: tracing::trace_span!("block", layer = i),
        })
    }

    fn bytes(&self) -> u64 {
        let qk = self.qk_norm.as_ref().map_or(0, |(q, k)| q.elem_count() + k.elem_count());
        let post = self.post_norms.as_ref().map_or(0, |(a, f)| a.elem_count() + f.elem_count());
        let norms = ((self.attn_norm.elem_count() + self.ffn_norm.elem_count() + qk + post)
            * self.attn_norm.dtype().size_in_bytes()) as u64;
        norms + self.qkv.bytes() + self.wo.storage_bytes() + self.ffn.bytes()
    }

    /// Every weight of the block computes each row as alone at any number of rows.
    fn rows_independent(&self) -> bool {
        self.qkv.rows_independent() && self.wo.rows_independent() && self.ffn.rows_independent()
    }

    /// One session's chunk of `t` tokens: `x` is `(1, t, hidden)`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        cfg: &ModelConfig,
        x: &Tensor,
        kv: &mut (Tensor, Tensor),
        pos: usize,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let _g = self.span.enter();
        let (q, k, v) = self.qkv(cfg, x, MatMul::Batch)?;
        let y = attend(cfg, self.window, (&q, &k, &v), kv, pos, (cos, sin), mask)?;
        self.output(cfg, x, &y, MatMul::Batch)
    }

    /// The attention norm and the q, k, v projections of `x: (b, t, hidden)`: q as
    /// `(b, heads, t, head_dim)`, k and v as `(b, kv_heads, t, head_dim)`, before RoPE (q and k
    /// normed per head, or whole, where the layer says so).
    fn qkv(&self, cfg: &ModelConfig, x: &Tensor, mm: MatMul) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let h = rms_norm(x, &self.attn_norm, cfg.rms_eps)?;
        let qkv = self.qkv.forward(&h, mm)?;
        let (q, k) = (qkv[0].contiguous()?, qkv[1].contiguous()?);
        // q and k normed whole (OLMoE: norms of their widths) before the heads split, or each head
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) if cfg.layer.qk_norm_whole => (
                rms_norm(&q, qn, cfg.rms_eps)?.reshape((b, t, nh, hd))?,
                rms_norm(&k, kn, cfg.rms_eps)?.reshape((b, t, nkv, hd))?,
            ),
            Some((qn, kn)) => (
                rms_norm(&q.reshape((b, t, nh, hd))?, qn, cfg.rms_eps)?,
                rms_norm(&k.reshape((b, t, nkv, hd))?, kn, cfg.rms_eps)?,
            ),
            None => (q.reshape((b, t, nh, hd))?, k.reshape((b, t, nkv, hd))?),
        };
        let q = q.transpose(1, 2)?.contiguous()?;
        let k = k.transpose(1, 2)?.contiguous()?;
        let v = qkv[2].contiguous()?.reshape((b, t, nkv, hd))?.transpose(1, 2)?.contiguous()?;
        Ok((q, k, v))
    }

    /// The attention output `y: (b, t, heads × head_dim)` projected and added to `x`, then the
    /// feed-forward half of the block.
    fn output(&self, cfg: &ModelConfig, x: &Tensor, y: &Tensor, mm: MatMul) -> candle_core::Result<Tensor> {
        let (post_attn, post_ffn) = match &self.post_norms {
            Some((a, f)) => (Some(a), Some(f)),
            None => (None, None),
        };
        let post = |t: Tensor, norm: Option<&Tensor>| match norm {
            Some(n) => rms_norm(&t, n, cfg.rms_eps),
            None => Ok(t),
        };
        let x = (x + post(mm.run(&self.wo, y)?, post_attn)?)?;
        let h = rms_norm(&x, &self.ffn_norm, cfg.rms_eps)?;
        let f = match &self.ffn {
            Ffn::Dense(f) => f.forward(&h, mm, self.gelu)?,
            Ffn::Moe(m) => m.forward(&h, mm, self.gelu)?,
        };
        x + post(f, post_ffn)?
    }
}

/// The gated activation of a feed-forward block: GeLU-tanh or SiLU of `gate`, times `up`.
fn gated(gelu: bool, gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    if own_cpu_attention(gate.device(), gate.dtype()) {
        // one pass with an exp that vectorizes (candle's GeLU and SiLU call libm per value);
        // SiLU's numbers are the fused decode step's
        gate.apply_op2_no_bwd(up, &silu::GatedMul { gelu })
    } else if gelu {
        // transformers' gelu_pytorch_tanh, llama.cpp's GELU
        gate.gelu()? * up
    } else {
        candle_nn::ops::silu(gate)? * up
    }
}

/// One session's attention over its own cache: RoPE at positions `pos..pos + t`, k and v written
/// into the cache there, then grouped-query attention over the `pos + t` cached positions.
/// Returns `(1, t, heads × head_dim)`.
#[allow(clippy::too_many_arguments)]
fn attend(
    cfg: &ModelConfig,
    window: Option<usize>,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    kv: &mut (Tensor, Tensor),
    pos: usize,
    (cos, sin): (&Tensor, &Tensor),
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let (b, _, t, _) = q.dims4()?;
    let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    let (q, k) = match cfg.rope_style {
        RopeStyle::Interleaved => {
            (candle_nn::rotary_emb::rope_i(q, cos, sin)?, candle_nn::rotary_emb::rope_i(k, cos, sin)?)
        }
        RopeStyle::Halves => (candle_nn::rotary_emb::rope(q, cos, sin)?, candle_nn::rotary_emb::rope(k, cos, sin)?),
    };
    kv.0.slice_set(&k, 2, pos)?;
    kv.1.slice_set(v, 2, pos)?;
    let l = pos + t;
    let scale = cfg.attention_scale();
    if t == 1 {
        let from = first_key(window, pos);
        if b == 1 && own_cpu_attention(q.device(), q.dtype()) {
            // a decode step reads the cache in place (see `decode_attn`)
            let op = decode_attn::DecodeAttention { from, seen: l, scale: scale as f32, cap: cfg.attn_softcap };
            let y = q.apply_op3_no_bwd(&kv.0, &kv.1, &op)?;
            return y.reshape((b, t, nh * hd));
        }
        // one query: the keys of its window are all it sees, and no mask is needed
        let (keys, values) = (kv.0.narrow(2, from, l - from)?, kv.1.narrow(2, from, l - from)?);
        let scores = Scores { scale, window: None, cap: cfg.attn_softcap };
        let y = grouped_attention(&q, (&keys, &values), nkv, l - from - 1, scores, None, QUERY_BLOCK)?;
        return y.transpose(1, 2)?.reshape((b, t, nh * hd));
    }
    if b == 1 && own_cpu_attention(q.device(), q.dtype()) {
        // each query row as a decode step computes it: a prompt row's numbers do not depend on
        // how the prompt was cut into chunks (see `decode_attn::PromptAttention`)
        let op = decode_attn::PromptAttention { pos, window, scale: scale as f32, cap: cfg.attn_softcap };
        return q.contiguous()?.apply_op3_no_bwd(&kv.0, &kv.1, &op);
    }
    let keys = kv.0.narrow(2, 0, l)?;
    let values = kv.1.narrow(2, 0, l)?;
    let scores = Scores { scale, window, cap: cfg.attn_softcap };
    let y = grouped_attention(&q, (&keys, &values), nkv, pos, scores, mask, QUERY_BLOCK)?;
    y.transpose(1, 2)?.reshape((b, t, nh * hd))
}

/// How attention scores become weights: scaled by `scale`, and seen only within `window`.
#[derive(Clone, Copy)]
struct Scores {
    scale: f64,
    window: Option<usize>,
    /// Soft cap of the scaled scores (Gemma 2).
    cap: Option<f32>,
}

/// `c · tanh(x / c)`: Gemma 2's soft cap of scores and logits as candle ops (brigade's own CPU
/// attention caps its scores with `brigade_kernels::vector::soft_cap`, the same formula).
fn soft_cap(x: &Tensor, c: f32) -> candle_core::Result<Tensor> {
    (x / c as f64)?.tanh()? * c as f64
}

/// Queries per block of a prompt chunk's attention on the CPU (see [`grouped_attention`]).
const QUERY_BLOCK: usize = 128;

/// Whether attention runs brigade's own CPU ops ([`grouped_attention`], `decode_attn`), which
/// apply the causal mask by position, or candle's composition, which adds [`causal_mask`].
fn own_cpu_attention(device: &Device, dtype: DType) -> bool {
    device.is_cpu() && dtype == DType::F32
}

/// The causal mask of `t` queries at positions `pos..pos + t` over `pos + t` keys: 0 where a
/// query sees the key, −∞ where the key is after it (or, with a sliding `window`, `window` or
/// more positions before it).
fn causal_mask(
    t: usize,
    pos: usize,
    window: Option<usize>,
    device: &Device,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let l = pos + t;
    let hidden = move |i: usize, j: usize| j > pos + i || window.is_some_and(|w| pos + i >= j + w);
    let m: Vec<f32> =
        (0..t).flat_map(|i| (0..l).map(move |j| if hidden(i, j) { f32::NEG_INFINITY } else { 0.0 })).collect();
    Tensor::from_vec(m, (t, l), device)?.to_dtype(dtype)
}

/// Grouped-query attention of `q` `(b, heads, t, d)` at positions `pos..pos + t` over `keys`
/// and `values` `(b, kv heads, pos + t, d)`, without repeating K/V: the query heads that share
/// a kv head are stacked as rows of one matrix, `(b, kv, groups × t, d)`. Returns `(b, heads,
/// t, d)`.
///
/// `mask` is the [`causal_mask`] of a chunk (`None` for one query), which candle's composition
/// adds; brigade's own CPU ops ([`own_cpu_attention`]) apply it by position instead, with the
/// sliding window of `scores` if the layer has one.
///
/// On the CPU in f32 the scores become weights in one op ([`softmax::CausalSoftmax`]), and a
/// chunk longer than `block` runs its queries `block` at a time, each block against the keys
/// it may see (`0..pos + i0 + block`): the masked half of the scores of a chunk read from
/// scratch is not computed (for 512 queries in blocks of 128, 62.5% of the products). The
/// products are the same as one block's (a masked key's weight is 0 and adds nothing); gemm's
/// own blocking of the shorter matrices can round a sum differently in the last bits, as a
/// chunk of another length does today.
fn grouped_attention(
    q: &Tensor,
    (keys, values): (&Tensor, &Tensor),
    nkv: usize,
    pos: usize,
    Scores { scale, window, cap }: Scores,
    mask: Option<&Tensor>,
    block: usize,
) -> candle_core::Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let (g, l) = (nh / nkv, pos + t);
    if own_cpu_attention(q.device(), q.dtype()) {
        let q5 = q.reshape((b, nkv, g, t, hd))?;
        let mut ys = Vec::with_capacity(t.div_ceil(block.max(1)));
        for i0 in (0..t).step_by(block.max(1)) {
            let tb = block.max(1).min(t - i0);
            let seen = pos + i0 + tb;
            // keys before the block's first window are seen by none of its queries
            let from = first_key(window, pos + i0);
            let qb = if tb == t { q5.clone() } else { q5.narrow(3, i0, tb)?.contiguous()? };
            let qb = qb.reshape((b, nkv, g * tb, hd))?;
            let att = qb.matmul(&keys.narrow(2, from, seen - from)?.t()?)?;
            let op = softmax::CausalSoftmax { scale: scale as f32, t: tb, pos: pos + i0 - from, window, cap };
            let att = att.apply_op1_no_bwd(&op)?;
            ys.push(att.matmul(&values.narrow(2, from, seen - from)?)?.reshape((b, nkv, g, tb, hd))?);
        }
        let y = if ys.len() == 1 { ys.remove(0) } else { Tensor::cat(&ys, 3)? };
        return y.reshape((b, nh, t, hd));
    }
    let qg = q.reshape((b, nkv, g * t, hd))?;
    let mut att = (qg.matmul(&keys.t()?)? * scale)?;
    if let Some(c) = cap {
        att = soft_cap(&att, c)?;
    }
    if let Some(m) = mask {
        att = att.reshape((b, nkv, g, t, l))?.broadcast_add(m)?.reshape((b, nkv, g * t, l))?;
    }
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    att.matmul(values)?.reshape((b, nh, t, hd))
}

impl Slice {
    /// Loads layers `layers` of the model onto `device`, with rotary tables and caches sized for
    /// `n_ctx` tokens. Activations and dense weights use `dtype` (f32 on the CPU).
    pub fn load(
        files: &ModelFiles,
        layers: LayerRange,
        device: &Device,
        dtype: DType,
        n_ctx: usize,
    ) -> Result<Self, ModelError> {
        Self::load_split(files, layers, device, dtype, n_ctx, None)
    }

    /// [`Slice::load`], leaving the routed experts `split` names to its remote (a mixture whose
    /// experts are spread over nodes): the slice holds the rest of its layers.
    pub fn load_split(
        files: &ModelFiles,
        layers: LayerRange,
        device: &Device,
        dtype: DType,
        n_ctx: usize,
        split: Option<ExpertSplit>,
    ) -> Result<Self, ModelError> {
        let cfg = files.config().clone();
        if split.is_some() && cfg.moe.is_none() {
            return Err(ModelError::BadSlice(format!("{:?} has no experts to leave elsewhere", cfg.arch)));
        }
        if layers.end() > cfg.n_layers {
            return Err(ModelError::BadSlice(format!("layers {layers} of a model with {} layers", cfg.n_layers)));
        }
        if n_ctx == 0 {
            return Err(ModelError::BadSlice("context length 0".into()));
        }
        let span = tracing::debug_span!("slice", start = layers.start(), end = layers.end(), device = ?device);
        let _g = span.enter();
        let mut weight_bytes = 0u64;
        let embed = if layers.is_first() {
            let e = files.embedding(TOKEN_EMBD, device, dtype)?;
            weight_bytes += e.storage_bytes();
            Some(e)
        } else {
            None
        };
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.iter() {
            let b = Block::load(files, i, device, dtype, split.as_ref())?;
            weight_bytes += b.bytes();
            blocks.push(b);
        }
        let head = if layers.is_last(cfg.n_layers) {
            let norm = files.norm(OUTPUT_NORM, device, dtype)?;
            weight_bytes += (norm.elem_count() * norm.dtype().size_in_bytes()) as u64;
            let out = if !files.tied_head() {
                let l = files.linear(OUTPUT, None, device, dtype)?;
                weight_bytes += l.storage_bytes();
                l
            } else if let Some(e) = &embed {
                // tied head sharing the embedding already loaded on this device
                Linear::from_embedding(e)
            } else {
                let e = files.embedding(TOKEN_EMBD, device, dtype)?;
                weight_bytes += e.storage_bytes();
                Linear::from_embedding(&e)
            };
            Some(Head { norm, out })
        } else {
            None
        };
        let (cos, sin) = rope_tables(&cfg.rope_inv_freq(), n_ctx, device, dtype)?;
        let local_rope = match cfg.rope_theta_local {
            Some(theta) if blocks.iter().any(|b| b.local_rope) => {
                Some(rope_tables(&cfg.rope_inv_freq_at(theta), n_ctx, device, dtype)?)
            }
            _ => None,
        };
        drop(_g);
        let mut slice = Slice {
            cfg,
            layers,
            device: device.clone(),
            dtype,
            embed,
            blocks,
            head,
            cos,
            sin,
            local_rope,
            n_ctx,
            weight_bytes,
            fused: false,
            span,
        };
        slice.set_fused_decode(!crate::cpu_matmul::switched_off("BRIGADE_CPU_FUSED"));
        Ok(slice)
    }

    /// Turns the fused CPU decode step on or off (on by default where the slice can take it;
    /// the numbers are the same either way, see `fused`); returns whether it is on.
    pub fn set_fused_decode(&mut self, on: bool) -> bool {
        self.fused = on && self.decodes_on_slices();
        self.fused
    }

    pub fn layers(&self) -> LayerRange {
        self.layers
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    pub fn is_first(&self) -> bool {
        self.embed.is_some()
    }
    pub fn is_last(&self) -> bool {
        self.head.is_some()
    }
    /// The final logits soft-capped as `c · tanh(l / c)` where the model says so (Gemma 2).
    fn soft_cap_logits(&self, logits: Tensor) -> candle_core::Result<Tensor> {
        match self.cfg.final_softcap {
            Some(c) => soft_cap(&logits, c),
            None => Ok(logits),
        }
    }

    /// Bytes of weights this slice holds on its device.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }
    /// Bytes of the rotary tables this slice holds on its device (the context's positions).
    pub fn table_bytes(&self) -> u64 {
        let t = |x: &Tensor| (x.elem_count() * x.dtype().size_in_bytes()) as u64;
        let local = self.local_rope.as_ref().map_or(0, |(c, s)| t(c) + t(s));
        t(&self.cos) + t(&self.sin) + local
    }

    /// Bytes one session's KV cache takes on this slice's device.
    pub fn kv_bytes(&self) -> u64 {
        kv_bytes(&self.cfg, self.layers, self.n_ctx, self.dtype)
    }

    /// Allocates an empty cache for one session: each layer's [`ModelConfig::kv_positions`].
    pub fn new_cache(&self) -> Result<SliceCache, ModelError> {
        let positions: Vec<usize> = self.layers.iter().map(|i| self.cfg.kv_positions(i, self.n_ctx)).collect();
        let kv = positions
            .iter()
            .map(|&p| {
                let shape = (1, self.cfg.n_kv_heads, p, self.cfg.head_dim);
                Ok((resident_zeros(shape, self.dtype, &self.device)?, resident_zeros(shape, self.dtype, &self.device)?))
            })
            .collect::<Result<Vec<_>, candle_core::Error>>()?;
        // a windowed layer whose window covers the context is stored as a global one
        let windowed = positions.iter().map(|&p| p < self.n_ctx).collect();
        Ok(SliceCache { kv, windowed, window: self.cfg.sliding_window, base: 0, len: 0, n_ctx: self.n_ctx })
    }

    /// The stage's input as activations `(batch, seq, hidden)` in the slice's dtype: token ids
    /// (`batch × seq` of them, row-major) embedded on the first slice, the previous stage's hidden
    /// state on the others.
    fn input(&self, input: StageInput<'_>, batch: usize) -> Result<Tensor, ModelError> {
        Ok(match (input, &self.embed) {
            (StageInput::Tokens(ids), Some(e)) => {
                if ids.is_empty() {
                    return Err(ModelError::BadInput("no tokens".into()));
                }
                if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.cfg.vocab) {
                    return Err(ModelError::BadInput(format!(
                        "token id {bad} is outside the vocabulary of {}",
                        self.cfg.vocab
                    )));
                }
                if !ids.len().is_multiple_of(batch) {
                    return Err(ModelError::BadInput(format!("{} token ids for {batch} rows", ids.len())));
                }
                let ids = Tensor::new(ids, &self.device)?.reshape((batch, ids.len() / batch))?;
                let x = e.forward(&ids)?.to_dtype(self.dtype)?;
                match self.cfg.embed_scale {
                    Some(s) => (x * s as f64)?,
                    None => x,
                }
            }
            (StageInput::Hidden(h), None) => {
                let (b, _, hid) = h.dims3()?;
                if b != batch || hid != self.cfg.hidden {
                    return Err(ModelError::BadInput(format!(
                        "hidden state of shape {:?}, expected ({batch}, seq, {})",
                        h.dims(),
                        self.cfg.hidden
                    )));
                }
                h.to_device(&self.device)?.to_dtype(self.dtype)?
            }
            (StageInput::Tokens(_), None) => {
                return Err(ModelError::BadInput(format!("slice {} takes a hidden state, not tokens", self.layers)))
            }
            (StageInput::Hidden(_), Some(_)) => {
                return Err(ModelError::BadInput(format!("slice {} takes tokens, not a hidden state", self.layers)))
            }
        })
    }

    /// Runs the slice over a chunk of tokens for one session and appends to its cache. Returns
    /// the hidden state `(1, seq, hidden)` for the next stage, or, on the last slice, logits
    /// `(1, seq or 1, vocab)` in f32.
    pub fn forward(&self, cache: &mut SliceCache, input: StageInput<'_>, logits: Logits) -> Result<Tensor, ModelError> {
        let _g = self.span.enter();
        let pos = cache.len;
        let x = self.input(input, 1)?;
        let t = x.dim(1)?;
        if pos + t > self.n_ctx.min(cache.n_ctx) {
            return Err(ModelError::ContextFull { need: pos + t, n_ctx: self.n_ctx });
        }
        // a model with windowed layers reads a long chunk in passes (see `WINDOW_CHUNK`)
        let pass = self.cfg.pass().unwrap_or(t).max(1);
        let x = if t <= pass {
            self.blocks_forward(cache, x)?
        } else {
            let mut ys = Vec::with_capacity(t.div_ceil(pass));
            for at in (0..t).step_by(pass) {
                let part = x.narrow(1, at, pass.min(t - at))?;
                let last = at + pass >= t;
                if self.head.is_some() && matches!(logits, Logits::Last) && !last {
                    // only the last position's logits are asked for: the rest feed the cache
                    self.blocks_forward(cache, part)?;
                } else {
                    ys.push(self.blocks_forward(cache, part)?);
                }
            }
            if ys.len() == 1 {
                ys.remove(0)
            } else {
                Tensor::cat(&ys, 1)?
            }
        };
        match &self.head {
            None => Ok(x),
            Some(head) => {
                let n = x.dim(1)?;
                let x = match logits {
                    Logits::Last if n > 1 => x.narrow(1, n - 1, 1)?.contiguous()?,
                    _ => x,
                };
                let x = rms_norm(&x, &head.norm, self.cfg.rms_eps)?;
                Ok(self.soft_cap_logits(head.out.forward(&x)?.to_dtype(DType::F32)?)?)
            }
        }
    }

    /// Whether [`Slice::forward_ragged`] gives each session, bit for bit, the numbers it gets
    /// alone: f32 on the CPU (brigade's own attention, no masks), every block weight computing
    /// its rows independently (packed), no windowed layers read in passes.
    pub fn reads_prompts_together(&self) -> bool {
        own_cpu_attention(&self.device, self.dtype)
            && self.cfg.pass().is_none()
            && self.blocks.iter().all(Block::rows_independent)
    }

    /// Prompt chunks of several sessions in one pass: session `i` (cache `caches[i]`) takes the
    /// next `lens[i]` rows of `input` (their ids on the first slice, else `(1, Σ lens, hidden)`).
    /// The block weights take every row at once; RoPE, the cache write and attention run per
    /// session on its own cache, with the code of the one-session path. Returns the hidden state
    /// `(1, Σ lens, hidden)`, or on the last slice the logits `(sessions, 1, vocab)` of each
    /// session's last row. For a slice that [`Slice::reads_prompts_together`] only, so each
    /// session's numbers are those [`Slice::forward`] gives it alone. On error no cache's length
    /// changes (entries past a cache's length may have been written; they are never read).
    pub fn forward_ragged(
        &self,
        caches: &mut [&mut SliceCache],
        input: StageInput<'_>,
        lens: &[usize],
    ) -> Result<Tensor, ModelError> {
        let _g = self.span.enter();
        if !self.reads_prompts_together() {
            return Err(ModelError::BadInput("this slice reads one session's prompt at a time".into()));
        }
        if caches.len() != lens.len() || lens.is_empty() || lens.contains(&0) {
            return Err(ModelError::BadInput(format!(
                "{} chunks of lengths {lens:?} for {} sessions",
                lens.len(),
                caches.len()
            )));
        }
        for (c, &t) in caches.iter().zip(lens) {
            if c.len + t > self.n_ctx.min(c.n_ctx) {
                return Err(ModelError::ContextFull { need: c.len + t, n_ctx: self.n_ctx });
            }
        }
        let total: usize = lens.iter().sum();
        let mut x = self.input(input, 1)?;
        if x.dim(1)? != total {
            return Err(ModelError::BadInput(format!("{} rows for chunks of {total} tokens", x.dim(1)?)));
        }
        let starts: Vec<usize> = lens
            .iter()
            .scan(0, |at, &t| {
                let s = *at;
                *at += t;
                Some(s)
            })
            .collect();
        for (l, block) in self.blocks.iter().enumerate() {
            let _b = block.span.enter();
            let (q, k, v) = block.qkv(&self.cfg, &x, MatMul::Batch)?;
            let mut ys = Vec::with_capacity(lens.len());
            for ((c, &at), &t) in caches.iter_mut().zip(&starts).zip(lens) {
                let (pos, base) = (c.len, c.base_of(l));
                let (cos, sin) = match (&self.local_rope, block.local_rope) {
                    (Some(lr), true) => (&lr.0, &lr.1),
                    _ => (&self.cos, &self.sin),
                };
                let (cos, sin) = (cos.narrow(0, pos, t)?, sin.narrow(0, pos, t)?);
                let part = |m: &Tensor| m.narrow(2, at, t).and_then(|p| p.contiguous());
                let qkv = (&part(&q)?, &part(&k)?, &part(&v)?);
                ys.push(attend(&self.cfg, block.window, qkv, &mut c.kv[l], pos - base, (&cos, &sin), None)?);
            }
            let y = Tensor::cat(&ys, 1)?;
            x = block.output(&self.cfg, &x, &y, MatMul::Batch)?;
        }
        let out = match &self.head {
            None => x,
            Some(head) => {
                // each session's last row, through the head as a row alone ([`Linear::forward_rows`])
                let last: Vec<Tensor> =
                    starts.iter().zip(lens).map(|(&at, &t)| x.narrow(1, at + t - 1, 1)).collect::<Result<_, _>>()?;
                let rows = Tensor::cat(&last, 0)?;
                let h = rms_norm(&rows, &head.norm, self.cfg.rms_eps)?;
                self.soft_cap_logits(head.out.forward_rows(&h)?.to_dtype(DType::F32)?)?
            }
        };
        for (c, &t) in caches.iter_mut().zip(lens) {
            c.len += t;
        }
        Ok(out)
    }

    /// One pass of `x` `(1, t, hidden)` through every block, written into the cache at its length
    /// (then advanced by `t`).
    fn blocks_forward(&self, cache: &mut SliceCache, mut x: Tensor) -> Result<Tensor, ModelError> {
        let (pos, t) = (cache.len, x.dim(1)?);
        cache.make_room(t)?;
        let tables = |local: bool| -> candle_core::Result<(Tensor, Tensor)> {
            let (cos, sin) = match (&self.local_rope, local) {
                (Some(l), true) => (&l.0, &l.1),
                _ => (&self.cos, &self.sin),
            };
            Ok((cos.narrow(0, pos, t)?, sin.narrow(0, pos, t)?))
        };
        let (global, local) = (tables(false)?, tables(true)?);
        // built once for every layer of each window and base, and only for candle's composition
        let mut masks: Vec<((Option<usize>, usize), Tensor)> = Vec::new();
        if t > 1 && !own_cpu_attention(&self.device, self.dtype) {
            for (l, w) in self.blocks.iter().map(|b| b.window).enumerate() {
                let key = (w, cache.base_of(l));
                if !masks.iter().any(|(m, _)| *m == key) {
                    masks.push((key, causal_mask(t, pos - key.1, w, &self.device, self.dtype)?));
                }
            }
        }
        if t == 1 && self.fused {
            x = self.decode_fused(&[&mut *cache], &[(0, pos)], &x)?;
        } else {
            for (l, block) in self.blocks.iter().enumerate() {
                let (cos, sin) = if block.local_rope { &local } else { &global };
                let base = cache.base_of(l);
                let mask = masks.iter().find(|(k, _)| *k == (block.window, base)).map(|(_, m)| m);
                // positions in the cache's storage: a windowed layer's start at its base
                x = block.forward(&self.cfg, &x, &mut cache.kv[l], pos - base, cos, sin, mask)?;
            }
        }
        cache.len = pos + t;
        Ok(x)
    }
}

/// The rotary tables `(n_ctx, head_dim / 2)` of inverse frequencies `inv`: cos and sin of each
/// position's angles, built on the host whatever the device (a context too large for memory is
/// an error here, not an allocation failure).
fn rope_tables(inv: &[f32], n_ctx: usize, device: &Device, dtype: DType) -> Result<(Tensor, Tensor), ModelError> {
    let half = inv.len();
    let too_large = || ModelError::BadSlice(format!("a context of {n_ctx} tokens does not fit in memory"));
    let mut angles: Vec<f32> = Vec::new();
    angles.try_reserve_exact(n_ctx.checked_mul(half).ok_or_else(too_large)?).map_err(|_| too_large())?;
    for p in 0..n_ctx {
        angles.extend(inv.iter().map(|f| p as f32 * f));
    }
    let angles = Tensor::from_vec(angles, (n_ctx, half), &Device::Cpu)?;
    let cos = angles.cos()?.to_dtype(dtype)?.to_device(device)?;
    let sin = angles.sin()?.to_dtype(dtype)?.to_device(device)?;
    Ok((cos, sin))
}

/// Bytes a slice will hold on its device, predicted from the file before loading anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SliceBytes {
    pub weights: u64,
    pub kv: u64,
    /// The rotary tables over the context ([`ModelConfig::rope_table_bytes`]).
    pub tables: u64,
    /// Routed experts held in host RAM apart from the slice (split layers: not in
    /// [`SliceBytes::total`], which is what the slice's device holds).
    pub host_experts: u64,
}

impl SliceBytes {
    /// Bytes on the slice's device: weights, KV cache and tables.
    pub fn total(&self) -> u64 {
        self.weights.saturating_add(self.kv).saturating_add(self.tables)
    }
}

/// Bytes of one session's KV cache for `layers` and `n_ctx` tokens in `dtype` (saturating):
/// each layer's [`ModelConfig::kv_positions`].
fn kv_bytes(cfg: &ModelConfig, layers: LayerRange, n_ctx: usize, dtype: DType) -> u64 {
    let per_token = cfg.kv_bytes_per_token_layer(dtype.size_in_bytes() as u64);
    let positions = layers.iter().map(|l| cfg.kv_positions(l, n_ctx) as u64).fold(0u64, u64::saturating_add);
    positions.saturating_mul(per_token)
}

/// The CPU bytes of `name`, the output head or a tied head's embedding: packed for the int8
/// kernels where they read its type, which rounds its rows (the vocabulary) up to whole records
/// of 32 columns (`cpu_matmul::Packed`); the file's bytes otherwise.
fn packed_head_bytes(files: &ModelFiles, name: &str) -> u64 {
    use crate::cpu_matmul::{packs_on, Isa};
    let Some(t) = files.tensor_info(name) else { return 0 };
    let rows = t.shape().first().copied().unwrap_or(0) as u64;
    if rows == 0 || t.shape().len() != 2 || !packs_on(crate::weights::ggml_dtype(t.ggml_type()), Isa::selected()) {
        return t.n_bytes();
    }
    rows.div_ceil(32) * 32 * (t.n_bytes() / rows)
}

/// Predicts what [`Slice::load`] will allocate for `layers` (weights as [`Slice::weight_bytes`]
/// counts them: the tensors [`slice_tensors`] names, less those read into the configuration;
/// and one session's KV cache of `n_ctx` tokens). Layers past the model's predict no weights
/// (loading them is an error).
pub fn predict_slice_bytes(files: &ModelFiles, layers: LayerRange, device: DeviceId, n_ctx: usize) -> SliceBytes {
    predict_split_bytes(files, layers, device, n_ctx, 0)
}

/// [`predict_slice_bytes`] for a stage of [`crate::Pipeline::load_cpu_moe`]: the routed
/// experts of layers `[0, cpu_moe)` are counted in [`SliceBytes::host_experts`] (what the
/// stage's [`ExpertShard`] holds, on the CPU in its stored form), not in the slice's weights.
pub fn predict_split_bytes(
    files: &ModelFiles,
    layers: LayerRange,
    device: DeviceId,
    n_ctx: usize,
    cpu_moe: usize,
) -> SliceBytes {
    let dtype = crate::device::activation_dtype(device, files);
    let on_cpu = device == DeviceId::Cpu;
    let names = slice_tensors(files, layers).unwrap_or_default();
    let on_host = |n: &str| {
        let expert_of = |(layer, t): (usize, LayerTensor)| t.is_experts() && layer < cpu_moe;
        files.config().moe.is_some()
            && (LayerTensor::parse(n).is_some_and(expert_of)
                || LayerTensor::parse_piece(n).is_some_and(|(l, t, _)| expert_of((l, t))))
    };
    let (mut weights, mut host_experts) = (0u64, 0u64);
    for n in names.iter().filter(|n| !SHARED_TENSORS.contains(&n.as_str())) {
        if on_host(n) {
            host_experts = host_experts.saturating_add(files.device_bytes(n, true, DType::F32));
            continue;
        }
        let head = n == OUTPUT || (n == TOKEN_EMBD && files.tied_head());
        let b = if on_cpu && head { packed_head_bytes(files, n) } else { files.device_bytes(n, on_cpu, dtype) };
        weights = weights.saturating_add(b);
    }
    let tables = files.config().rope_table_bytes(layers.start()..layers.end(), n_ctx, dtype.size_in_bytes() as u64);
    SliceBytes { weights, kv: kv_bytes(files.config(), layers, n_ctx, dtype), tables, host_experts }
}

/// Softmax-free helper for tests and reports: index of the largest logit of the last position.
pub fn argmax_last(logits: &Tensor) -> Result<u32, ModelError> {
    let last = logits.squeeze(0)?;
    let last = last.get(last.dim(0)? - 1)?;
    Ok(last.argmax(D::Minus1)?.to_scalar::<u32>()?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A tensor of `shape` with values of a few units, distinct per position.
    pub(super) fn filled(shape: (usize, usize, usize, usize), salt: usize) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        let v: Vec<f32> = (0..n).map(|i| (((i + salt) * 7919 % 2003) as f32 - 1001.0) / 301.0).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn query_blocks_give_the_numbers_of_one_block() {
        let (nh, nkv, hd, n_ctx) = (8, 2, 16, 300);
        // a cache larger than what is read, as the real one (strided keys and values)
        let (kc, vc) = (filled((1, nkv, n_ctx, hd), 1), filled((1, nkv, n_ctx, hd), 2));
        for (t, pos, window) in
            [(37, 11, None), (200, 0, None), (129, 40, None), (2, 0, None), (150, 20, Some(40)), (37, 11, Some(1))]
        {
            let q = filled((1, nh, t, hd), 3 + t);
            let l = pos + t;
            let (k, v) = (kc.narrow(2, 0, l).unwrap(), vc.narrow(2, 0, l).unwrap());
            let scores = Scores { scale: 1.0 / (hd as f64).sqrt(), window, cap: None };
            let one = grouped_attention(&q, (&k, &v), nkv, pos, scores, None, t).unwrap();
            for block in [1, 5, 64, 128] {
                let got = grouped_attention(&q, (&k, &v), nkv, pos, scores, None, block).unwrap();
                assert_eq!(got.dims(), [1, nh, t, hd]);
                // the same products; gemm's own blocking of shorter matrices may round a sum
                // differently (seen: 3e-6 at most, values of a few units)
                let d = (&got - &one).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(d < 2e-5, "t {t} pos {pos} window {window:?}: blocks of {block} differ from one block by {d}");
                if block >= t {
                    assert!(bits(&got) == bits(&one), "t {t} pos {pos}: one block of {block} is not one block");
                }
            }
            // and the composition the other devices run (scale, mask, softmax) agrees
            let f16 = grouped_attention(
                &q.to_dtype(DType::F16).unwrap(),
                (&k.to_dtype(DType::F16).unwrap(), &v.to_dtype(DType::F16).unwrap()),
                nkv,
                pos,
                scores,
                Some(&causal_mask(t, pos, window, &Device::Cpu, DType::F16).unwrap()),
                64,
            )
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
            let diff = (f16 - &one).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 0.05, "t {t} pos {pos} window {window:?}: f16 composition differs by {diff}");
            // a window changes what the last query sees once the keys outnumber it
            if let Some(w) = window {
                let full =
                    grouped_attention(&q, (&k, &v), nkv, pos, Scores { window: None, ..scores }, None, t).unwrap();
                let last = |y: &Tensor| y.narrow(2, t - 1, 1).unwrap();
                let d =
                    (last(&full) - last(&one)).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(l > w && d > 1e-3, "window {w} over {l} keys changed the last query by {d}");
            }
        }
    }
}
