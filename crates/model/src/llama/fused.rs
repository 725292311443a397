//! A decode step on the CPU in f32 without a tensor per op: one token for each of `n` sessions
//! through every block of a slice, on slices of f32 held across the step.
//!
//! Through candle a decode step of one layer is some twenty ops (norm, matmul, three narrows and
//! copies, two RoPEs, two cache writes, attention, reshapes, add, norm, matmul, SiLU, mul,
//! matmul, add), each allocating its output, and the ones that are not matmuls run on the
//! calling thread while the compute pool's other threads spin. Profiled on llama-1b Q4_K
//! (2 threads, Intel Xeon AVX-512): 20% of a decode step was outside the matmuls, the second
//! thread idle for half of it. Here the step runs on buffers allocated once per step; attention
//! (each session's kv heads) and SiLU·up run on every thread of the pool, and the matmuls call
//! the CPU kernels on slices ([`Linear::cpu_rows`]).
//!
//! **The numbers are the op path's, bit for bit**: the norm, RoPE and additions are candle's
//! loops for f32 written out in the same order of operations (Rust does not contract a·b + c
//! into an FMA), SiLU·up and GeLU·up are the prompt path's own op's functions (`silu::silu_mul`,
//! `silu::gelu_mul`), Gemma's post-norms the same norm loop as every other norm, the matmuls
//! are the same kernels with the same grouping of rows, and attention is [`decode_attn`]'s. So
//! a session decodes to the same logits with this path on or off (`BRIGADE_CPU_FUSED=off` turns
//! it off, to measure it), and a row's numbers still do not depend on the rows beside it (batch
//! invariance). Tested against the tensor path on every weight layout the CPU kernels have.

use super::moe::ExpertJob;
use super::{decode_attn, Block, Ffn, GatedFfn, MatMul, Proj, Slice, SliceCache};
use crate::config::first_key;
use crate::config::{ModelConfig, RopeStyle};
use crate::threads::par_units;
use crate::weights::{Linear, View};
use crate::ModelError;
use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};
use std::ops::Range;

/// Writes one position's keys (or values) of every kv head, `row` (`kv heads × head_dim`), into
/// a cache `(1, kv heads, n_ctx, head_dim)` at position `pos`: `slice_set`'s copy, in place.
struct PutRow<'a> {
    pos: usize,
    row: &'a [f32],
}

impl InplaceOp1 for PutRow<'_> {
    fn name(&self) -> &'static str {
        "put-cache-row"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = storage else { candle_core::bail!("the cache is not f32") };
        let (b, nkv, n_ctx, hd) = layout.shape().dims4()?;
        let Some((o1, o2)) = layout.contiguous_offsets() else { candle_core::bail!("the cache is not contiguous") };
        if b != 1 || self.pos >= n_ctx || self.row.len() != nkv * hd {
            candle_core::bail!(
                "a row of {} values at position {} of a cache {:?}",
                self.row.len(),
                self.pos,
                layout.shape().dims()
            )
        }
        let v = &mut v[o1..o2];
        for (h, src) in self.row.chunks_exact(hd).enumerate() {
            v[(h * n_ctx + self.pos) * hd..][..hd].copy_from_slice(src);
        }
        Ok(())
    }
}

/// Columns of SiLU·up per unit of work on the pool.
const ACT_CHUNK: usize = 1024;

/// `candle_nn::ops::rms_norm` of each row of `x` (rows of `w.len()`), as candle's CPU loop
/// computes it for f32.
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (src, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum2 = src.iter().map(|&v| v * v).sum::<f32>();
        let m = (sum2 / n as f32 + eps).sqrt();
        for ((d, s), a) in dst.iter_mut().zip(src).zip(w) {
            *d = *s / m * *a
        }
    }
}

/// candle's `rope_i` (pairs 2i, 2i+1) or `rope` (pairs i, i + d/2) of one position, `src` as
/// heads of `d`, with that position's `cos` and `sin` (`d / 2` each): candle's loops for one
/// position in f32.
fn rope(style: RopeStyle, src: &[f32], (cos, sin): (&[f32], &[f32]), d: usize, dst: &mut [f32]) {
    for (s, o) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
        match style {
            RopeStyle::Interleaved => {
                for i in 0..d / 2 {
                    let (a, b) = (s[2 * i], s[2 * i + 1]);
                    o[2 * i] = a * cos[i] - b * sin[i];
                    o[2 * i + 1] = a * sin[i] + b * cos[i];
                }
            }
            RopeStyle::Halves => {
                for i in 0..d / 2 {
                    let (a, b) = (s[i], s[i + d / 2]);
                    o[i] = a * cos[i] - b * sin[i];
                    o[i + d / 2] = a * sin[i] + b * cos[i];
                }
            }
        }
    }
}

/// `x += y`, candle's `x + y`.
fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(x, y)| *x += *y);
}

/// The outputs of a [`Proj`] for `m` rows: part `p` (q, k, v or gate, up) of row `r`.
enum ProjRows {
    /// One buffer of rows of `width`, part `p` at `parts[p]` within each.
    Stacked { y: Vec<f32>, width: usize, parts: Vec<Range<usize>> },
    /// A buffer per part.
    Separate(Vec<(Vec<f32>, usize)>),
}

impl ProjRows {
    fn part(&self, p: usize, r: usize) -> &[f32] {
        match self {
            ProjRows::Stacked { y, width, parts } => &y[r * width..][parts[p].clone()],
            ProjRows::Separate(v) => &v[p].0[r * v[p].1..][..v[p].1],
        }
    }
}

impl Proj {
    /// The widths of the parts.
    fn sizes(&self) -> Vec<usize> {
        match self {
            Proj::Stacked(_, sizes) => sizes.clone(),
            Proj::Separate(ls) => ls.iter().map(Linear::out_features).collect(),
        }
    }

    fn runs_on_slices(&self) -> bool {
        match self {
            Proj::Stacked(l, _) => l.runs_on_slices(),
            Proj::Separate(ls) => ls.iter().all(Linear::runs_on_slices),
        }
    }

    /// [`Proj::forward`] of `m` rows on slices.
    fn rows(&self, m: usize, lhs: &[f32]) -> candle_core::Result<ProjRows> {
        Ok(match self {
            Proj::Stacked(l, sizes) => {
                let width: usize = sizes.iter().sum();
                let mut y = vec![0f32; m * width];
                l.cpu_rows(m, lhs, &mut y)?;
                let mut at = 0;
                let parts = sizes
                    .iter()
                    .map(|&n| {
                        at += n;
                        at - n..at
                    })
                    .collect();
                ProjRows::Stacked { y, width, parts }
            }
            Proj::Separate(ls) => ProjRows::Separate(
                ls.iter()
                    .map(|l| {
                        let n = l.out_features();
                        let mut y = vec![0f32; m * n];
                        l.cpu_rows(m, lhs, &mut y)?;
                        Ok((y, n))
                    })
                    .collect::<candle_core::Result<_>>()?,
            ),
        })
    }
}

fn is_cpu_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == candle_core::DType::F32
}

impl Block {
    /// Whether [`Block::decode`] can run this block: every matmul by the CPU's kernels, the
    /// norms f32 on the CPU, and every width the configuration's (the loader checks them; a
    /// block that disagrees keeps candle's ops, which return errors instead of slicing short).
    pub(super) fn runs_on_slices(&self, cfg: &ModelConfig) -> bool {
        let (q, kv) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
        self.qkv.runs_on_slices()
            && self.wo.runs_on_slices()
            && match &self.ffn {
                Ffn::Dense(f) => {
                    f.runs_on_slices() && f.gate_up.sizes() == [cfg.ffn, cfg.ffn] && f.down.out_features() == cfg.hidden
                }
                Ffn::Moe(m) => m.runs_on_slices(),
            }
            && is_cpu_f32(&self.attn_norm)
            && is_cpu_f32(&self.ffn_norm)
            // Gemma's norms after attention and the feed-forward block, of the hidden width
            && self.post_norms.as_ref().is_none_or(|(a, f)| {
                is_cpu_f32(a) && is_cpu_f32(f) && a.elem_count() == cfg.hidden && f.elem_count() == cfg.hidden
            })
            // a row of q and of k normed per head, or whole (the norm's width says which)
            && self.qk_norm.as_ref().is_none_or(|(qn, kn)| {
                let (qw, kw) = if cfg.layer.qk_norm_whole { (q, kv) } else { (cfg.head_dim, cfg.head_dim) };
                is_cpu_f32(qn) && is_cpu_f32(kn) && qn.elem_count() == qw && kn.elem_count() == kw
            })
            && self.attn_norm.elem_count() == cfg.hidden
            && self.ffn_norm.elem_count() == cfg.hidden
            && self.qkv.sizes() == [q, kv, kv]
            && self.wo.out_features() == cfg.hidden
            && q > 0
            && kv > 0
    }

    /// One token per row through the block: `x` is `n × hidden`, updated in place; `kv[i]` is
    /// row `i`'s session's cache of this layer, whose slot 0 holds position `base[i]`, written
    /// at position `pos[i]` (rows of one session share a cache: every row's keys are written
    /// before any row reads, and a row reads only up to its own position); `rope` the rotary
    /// tables `(n_ctx, head_dim / 2)`.
    fn decode(
        &self,
        cfg: &ModelConfig,
        x: &mut [f32],
        kv: &[&(Tensor, Tensor)],
        (pos, base): (&[usize], &[usize]),
        (cos, sin): (&[f32], &[f32]),
    ) -> candle_core::Result<()> {
        let n = pos.len();
        let (hidden, nh, nkv, hd) = (cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let (qd, kd, half, g) = (nh * hd, nkv * hd, hd / 2, nh / nkv);
        let eps = cfg.rms_eps as f32;
        let mut h = vec![0f32; n * hidden];
        rms_norm_rows(x, View::of(&self.attn_norm)?.get(), eps, &mut h);
        let qkv = self.qkv.rows(n, &h)?;
        let (mut q, mut k) = (vec![0f32; n * qd], vec![0f32; kd]);
        let qk_norm = match &self.qk_norm {
            Some((qn, kn)) => Some((View::of(qn)?, View::of(kn)?)),
            None => None,
        };
        // q and k of one row normed per head (rows of `head_dim`) or whole (rows of their
        // widths: the norms' lengths), as the op path's rms_norm
        let (mut qh, mut kh) = (vec![0f32; if qk_norm.is_some() { qd } else { 0 }], vec![0f32; kd]);
        for (i, (&p, (k_cache, v_cache))) in pos.iter().zip(kv.iter().map(|c| (&c.0, &c.1))).enumerate() {
            let cs = (&cos[p * half..][..half], &sin[p * half..][..half]);
            let (qi, ki) = match &qk_norm {
                Some((qn, kn)) => {
                    rms_norm_rows(qkv.part(0, i), qn.get(), eps, &mut qh);
                    rms_norm_rows(qkv.part(1, i), kn.get(), eps, &mut kh);
                    (&qh[..], &kh[..])
                }
                None => (qkv.part(0, i), qkv.part(1, i)),
            };
            rope(cfg.rope_style, qi, cs, hd, &mut q[i * qd..][..qd]);
            rope(cfg.rope_style, ki, cs, hd, &mut k);
            k_cache.inplace_op1(&PutRow { pos: p - base[i], row: &k })?;
            v_cache.inplace_op1(&PutRow { pos: p - base[i], row: qkv.part(2, i) })?;
        }
        drop(qkv);
        // attention: one unit per session and kv head, each writing its g query heads' output
        let mut y = vec![0f32; n * qd];
        {
            let caches = kv
                .iter()
                .map(|c| Ok((View::of(&c.0)?, View::of(&c.1)?, c.0.dim(2)?)))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let scale = cfg.attention_scale() as f32;
            par_units(y.chunks_mut(g * hd).enumerate().collect(), |(u, out)| {
                let (i, head) = (*u / nkv, *u % nkv);
                let (kc, vc, n_ctx) = &caches[i];
                let (from, seen) = (first_key(self.window, pos[i]) - base[i], pos[i] + 1 - base[i]);
                let keys = &kc.get()[(head * n_ctx + from) * hd..][..(seen - from) * hd];
                let values = &vc.get()[(head * n_ctx + from) * hd..][..(seen - from) * hd];
                let mut w = vec![0f32; g * (seen - from)];
                let scale = (scale, cfg.attn_softcap);
                decode_attn::head(&q[i * qd + head * g * hd..][..g * hd], keys, values, scale, hd, &mut w, out);
            });
        }
        let mut o = vec![0f32; n * hidden];
        self.wo.cpu_rows(n, &y, &mut o)?;
        // the op path's `post`: each half's output normed before its residual add (Gemma)
        let post = match &self.post_norms {
            Some((a, f)) => Some((View::of(a)?, View::of(f)?)),
            None => None,
        };
        let mut normed = vec![0f32; if post.is_some() { n * hidden } else { 0 }];
        let mut add_out = |x: &mut [f32], o: &[f32], norm: Option<&View>| match norm {
            Some(w) => {
                rms_norm_rows(o, w.get(), eps, &mut normed);
                add(x, &normed)
            }
            None => add(x, o),
        };
        add_out(x, &o, post.as_ref().map(|p| &p.0));
        rms_norm_rows(x, View::of(&self.ffn_norm)?.get(), eps, &mut h);
        match &self.ffn {
            Ffn::Dense(f) => f.rows(n, &h, &mut o, self.gelu)?,
            Ffn::Moe(m) => {
                m.combine(n, &h, &mut o, MatMul::Rows, |jobs, outs| GatedFfn::rows_many(jobs, outs, self.gelu))?
            }
        }
        add_out(x, &o, post.as_ref().map(|p| &p.1));
        Ok(())
    }
}

impl GatedFfn {
    /// Whether [`GatedFfn::rows`] can run it: both matmuls by the CPU's kernels.
    pub(super) fn runs_on_slices(&self) -> bool {
        self.gate_up.runs_on_slices() && self.down.runs_on_slices()
    }

    /// SiLU(gate)·up (GeLU with `gelu`) then down of `n` rows `h` into `o`, on slices.
    pub(super) fn rows(&self, n: usize, h: &[f32], o: &mut [f32], gelu: bool) -> candle_core::Result<()> {
        let gu = self.gate_up.rows(n, h)?;
        let ffn = self.down_inputs();
        let mut act = vec![0f32; n * ffn];
        let units = act
            .chunks_mut(ffn.max(1))
            .enumerate()
            .flat_map(|(r, row)| row.chunks_mut(ACT_CHUNK).enumerate().map(move |(j, a)| (r, j * ACT_CHUNK, a)))
            .collect();
        par_units(units, |(r, c0, out)| {
            // the prompt path's SiLU·up or GeLU·up (`silu`), so the numbers are its
            let (g, u) = (&gu.part(0, *r)[*c0..], &gu.part(1, *r)[*c0..]);
            if gelu {
                super::silu::gelu_mul(g, u, out)
            } else {
                super::silu::silu_mul(g, u, out)
            }
        });
        self.down.cpu_rows(n, &act, o)
    }

    /// [`GatedFfn::rows`] of several blocks (the experts a pass computes): job `j` is block
    /// `jobs[j].0` on the `jobs[j].1` rows `jobs[j].2`, into `outs[j]`. Where every block's
    /// gate·up is one packed matmul and its down another, the gate·ups of all run in one
    /// dispatch of the thread pool, then the downs in one (`matmul_packed_group`): the same
    /// numbers as one block at a time, with two barriers instead of two per block.
    pub(super) fn rows_many(jobs: &[ExpertJob<'_>], outs: &mut [Vec<f32>], gelu: bool) -> candle_core::Result<()> {
        use crate::cpu_matmul::{matmul_packed_group, Isa, PackedJob};
        let packed: Option<Vec<_>> = jobs
            .iter()
            .map(|(f, _, _)| match &f.gate_up {
                Proj::Stacked(l, sizes) if sizes.len() == 2 && sizes[0] == sizes[1] => {
                    Some((l.packed()?, f.down.packed()?))
                }
                _ => None,
            })
            .collect();
        let Some(packed) = packed else {
            return jobs.iter().zip(outs).try_for_each(|((f, m, xs), o)| f.rows(*m, xs, o, gelu));
        };
        if jobs.len() != outs.len() {
            candle_core::bail!("{} expert jobs for {} outputs", jobs.len(), outs.len())
        }
        let ffn: Vec<usize> = packed.iter().map(|(g, _)| g.shape().0 / 2).collect();
        let mut gu: Vec<Vec<f32>> = jobs.iter().zip(&ffn).map(|((_, m, _), f)| vec![0f32; m * 2 * f]).collect();
        let mut group: Vec<PackedJob<'_>> = jobs
            .iter()
            .zip(&packed)
            .zip(gu.iter_mut())
            .map(|(((_, m, xs), (g, _)), dst)| PackedJob { w: g, m: *m, lhs: xs, dst })
            .collect();
        matmul_packed_group(&mut group, Isa::selected()).map_err(candle_core::Error::wrap)?;
        // SiLU(gate)·up (GeLU with `gelu`) of every job's rows, in `rows`' chunks: the same numbers
        let mut acts: Vec<Vec<f32>> = jobs.iter().zip(&ffn).map(|((_, m, _), f)| vec![0f32; m * f]).collect();
        let units = acts
            .iter_mut()
            .zip(&gu)
            .zip(&ffn)
            .flat_map(|((a, g), &f)| {
                a.chunks_mut(f.max(1)).enumerate().flat_map(move |(r, row)| {
                    let (gate, up) = g[r * 2 * f..(r + 1) * 2 * f].split_at(f);
                    row.chunks_mut(ACT_CHUNK)
                        .enumerate()
                        .map(move |(j, a)| (&gate[j * ACT_CHUNK..], &up[j * ACT_CHUNK..], a))
                })
            })
            .collect();
        par_units(
            units,
            |(g, u, out)| {
                if gelu {
                    super::silu::gelu_mul(g, u, out)
                } else {
                    super::silu::silu_mul(g, u, out)
                }
            },
        );
        let mut group: Vec<PackedJob<'_>> = jobs
            .iter()
            .zip(&packed)
            .zip(&acts)
            .zip(outs.iter_mut())
            .map(|((((_, m, _), (_, down)), lhs), dst)| PackedJob { w: down, m: *m, lhs, dst })
            .collect();
        matmul_packed_group(&mut group, Isa::selected()).map_err(candle_core::Error::wrap)?;
        Ok(())
    }

    /// The feed-forward width (the down projection's input).
    fn down_inputs(&self) -> usize {
        match &self.gate_up {
            Proj::Stacked(_, sizes) => sizes.get(1).copied().unwrap_or(0),
            Proj::Separate(ls) => ls.get(1).map_or(0, Linear::out_features),
        }
    }
}

impl Slice {
    /// Whether this slice can take the fused decode step: f32 on the CPU (where attention is
    /// brigade's own), every block's matmuls by the CPU's kernels, rotary tables of half a head.
    pub(super) fn decodes_on_slices(&self) -> bool {
        super::own_cpu_attention(&self.device, self.dtype)
            && self.blocks.iter().all(|b| b.runs_on_slices(&self.cfg))
            && self.cos.dims() == [self.n_ctx, self.cfg.head_dim / 2]
            // the local layers' own tables (Gemma 3), of the same shape
            && self.local_rope.as_ref().is_none_or(|(c, s)| c.dims() == self.cos.dims() && s.dims() == self.cos.dims())
            && self.blocks.iter().all(|b| !b.local_rope || self.local_rope.is_some())
            && self.cfg.head_dim.is_multiple_of(2)
            && self.cfg.n_kv_heads > 0
            && self.cfg.n_heads.is_multiple_of(self.cfg.n_kv_heads)
    }

    /// Rows of tokens through every block, `x` `(n, 1, hidden)`: `rows[r]` is row `r`'s session
    /// (its cache in `caches`) and position, a session's rows in position order; writes each
    /// cache at those positions (the caller advances the lengths). Returns the blocks' output
    /// `(n, 1, hidden)`.
    pub(super) fn decode_fused(
        &self,
        caches: &[&mut SliceCache],
        rows: &[(usize, usize)],
        x: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let n = rows.len();
        if let Some(c) = caches.iter().find(|c| c.kv.len() != self.blocks.len()) {
            return Err(ModelError::BadInput(format!(
                "a cache of {} layers for slice {} of {} layers",
                c.kv.len(),
                self.layers,
                self.blocks.len()
            )));
        }
        if rows.iter().any(|&(i, _)| i >= caches.len()) {
            return Err(ModelError::BadInput(format!("a row of a session past the {} given", caches.len())));
        }
        let mut xs = x.flatten_all()?.to_vec1::<f32>()?;
        if xs.len() != n * self.cfg.hidden {
            return Err(ModelError::BadInput(format!("{} values for {n} rows of {}", xs.len(), self.cfg.hidden)));
        }
        let pos: Vec<usize> = rows.iter().map(|&(_, p)| p).collect();
        let (cos, sin) = (View::of(&self.cos)?, View::of(&self.sin)?);
        let local = match &self.local_rope {
            Some((c, s)) => Some((View::of(c)?, View::of(s)?)),
            None => None,
        };
        for (l, block) in self.blocks.iter().enumerate() {
            let _b = block.span.enter();
            let kv: Vec<&(Tensor, Tensor)> = rows.iter().map(|&(i, _)| &caches[i].kv[l]).collect();
            let base: Vec<usize> = rows.iter().map(|&(i, _)| caches[i].base_of(l)).collect();
            // a local layer's own base where the model has one (`decodes_on_slices` checked it)
            let (c, s) = match (&local, block.local_rope) {
                (Some((c, s)), true) => (c.get(), s.get()),
                _ => (cos.get(), sin.get()),
            };
            block.decode(&self.cfg, &mut xs, &kv, (&pos, &base), (c, s))?;
        }
        Ok(Tensor::from_vec(xs, (n, 1, self.cfg.hidden), &self.device)?)
    }
}
