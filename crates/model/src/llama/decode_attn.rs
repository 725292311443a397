//! One decode step's attention on the CPU in f32: each query head against the keys and values of
//! its kv head read straight from the session's cache.
//!
//! Through candle this step is two `gemm` calls per kv head (8 query rows × a few hundred keys
//! × 64), and `gemm` copies the keys (and then the values) into its packed panels on every call:
//! the whole cache read and written again per layer and token, which profiled at 13% of a
//! decode step's main thread on llama-1b. Here each key and each value row is read once, from
//! the cache, for all the query heads that share it. Written by hand because the shape (a few
//! rows against a strided cache, in place) is no BLAS call's.
//!
//! A prompt chunk's rows take the same loops ([`PromptAttention`]), one row at a time as decode
//! steps, on the compute threads: a row's numbers are then the same whatever chunk it came in
//! (with `gemm`, whose sums run in another order and block by the chunk's length, they differed
//! in the last bits, which a near tie turns into another token — so a session resumed after a
//! failover, or read in other chunks on a cluster, could go on with other text). It cost about
//! 7% of prompt speed on a 1.5B Q4_K model at 512 tokens (against `gemm`, AMD EPYC, 2 threads)
//! until the scores were added up 16 keys at a time (`attention_head`'s `dots16_zmm` /
//! `dots8_ymm`, the same bits), which made prompts 1.10–1.12× faster on that model and
//! 1.16–1.23× on SmolLM2-135M. Every session's decode has the same numbers alone or batched.
//! The loops are `brigade_kernels::vector::attention_head`; its `exp` is the prompt softmax's
//! (the same bits at every vector width).

pub(super) use brigade_kernels::vector::attention_head as head;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape};

/// Attention of one query position: `q` `(1, heads, 1, d)` against positions `from..seen` of
/// the caches `(1, kv heads, n_ctx, d)` (`from` > 0 in a sliding window); returns `(1, heads,
/// 1, d)`.
pub(super) struct DecodeAttention {
    pub from: usize,
    pub seen: usize,
    pub scale: f32,
    /// Scores soft-capped as `c · tanh(s / c)` after the scale (Gemma 2).
    pub cap: Option<f32>,
}

/// The queries and the caches of an attention op as f32 slices (`what` names the op in the
/// error where they are another type or not contiguous).
fn f32_inputs<'a>(
    what: &str,
    (q, lq): (&'a CpuStorage, &Layout),
    (k, lk): (&'a CpuStorage, &Layout),
    (v, lv): (&'a CpuStorage, &Layout),
) -> candle_core::Result<(&'a [f32], &'a [f32], &'a [f32])> {
    let (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) = (q, k, v) else {
        candle_core::bail!("{what} takes f32, not {:?}/{:?}/{:?}", q.dtype(), k.dtype(), v.dtype())
    };
    let (Some((q0, q1)), Some((k0, k1)), Some((v0, v1))) =
        (lq.contiguous_offsets(), lk.contiguous_offsets(), lv.contiguous_offsets())
    else {
        candle_core::bail!("{what} takes contiguous queries and caches")
    };
    Ok((&q[q0..q1], &k[k0..k1], &v[v0..v1]))
}

/// An attention op's shapes `(query heads, query rows, head size, kv heads, cache positions)`,
/// checked: one sequence, keys and values alike, whole groups of query heads per kv head, and the
/// op's own `fits(query rows, cache positions)`; else an error naming `what`, the shapes and
/// `at()` (the op's positions).
fn shapes(
    what: &str,
    (lq, lk, lv): (&Layout, &Layout, &Layout),
    fits: impl FnOnce(usize, usize) -> bool,
    at: impl FnOnce() -> String,
) -> candle_core::Result<(usize, usize, usize, usize, usize)> {
    let (qb, nh, t, hd) = lq.shape().dims4()?;
    let (kb, nkv, n_ctx, khd) = lk.shape().dims4()?;
    if qb != 1 || kb != 1 || khd != hd || lv.shape() != lk.shape() || nkv == 0 || nh % nkv != 0 || !fits(t, n_ctx) {
        candle_core::bail!(
            "{what}: queries {:?}, keys {:?}, values {:?}, {}",
            lq.shape().dims(),
            lk.shape().dims(),
            lv.shape().dims(),
            at()
        )
    }
    Ok((nh, t, hd, nkv, n_ctx))
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let what = "decode attention";
        let (q, k, v) = f32_inputs(what, (q, lq), (k, lk), (v, lv))?;
        let fits = |t, n_ctx| t == 1 && self.from < self.seen && self.seen <= n_ctx;
        let at = || format!("positions {}..{} seen", self.from, self.seen);
        let (nh, _, hd, nkv, n_ctx) = shapes(what, (lq, lk, lv), fits, at)?;
        let (g, n) = (nh / nkv, self.seen - self.from);
        let mut out = vec![0f32; nh * hd];
        let mut w = vec![0f32; g * n];
        for h in 0..nkv {
            let keys = &k[(h * n_ctx + self.from) * hd..][..n * hd];
            let values = &v[(h * n_ctx + self.from) * hd..][..n * hd];
            let qh = &q[h * g * hd..][..g * hd];
            let oh = &mut out[h * g * hd..][..g * hd];
            head(qh, keys, values, (self.scale, self.cap), hd, &mut w, oh);
        }
        Ok((CpuStorage::F32(out), Shape::from_dims(&[1, nh, 1, hd])))
    }
}

/// Attention of a prompt chunk's `t` query positions `pos..pos + t`, each row exactly as a
/// decode step at its position computes it ([`DecodeAttention`]: the same loops over the same
/// keys in the same order), so a row's numbers do not depend on the chunk it came in — a session
/// resumed after a failover, whose ids are read again as a prompt, goes on as the uninterrupted
/// one. `q` `(1, heads, t, d)` against the caches `(1, kv heads, n_ctx, d)` (a sliding `window`
/// hides the keys before it); returns `(1, t, heads × d)`. Rows run on the compute threads,
/// paired first with last so that each unit of work holds the same number of keys.
pub(super) struct PromptAttention {
    pub pos: usize,
    pub window: Option<usize>,
    pub scale: f32,
    pub cap: Option<f32>,
}

impl CustomOp3 for PromptAttention {
    fn name(&self) -> &'static str {
        "prompt-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let what = "prompt attention";
        let (q, k, v) = f32_inputs(what, (q, lq), (k, lk), (v, lv))?;
        let fits = |t, n_ctx| t > 0 && self.pos + t <= n_ctx;
        let (nh, t, hd, nkv, n_ctx) = shapes(what, (lq, lk, lv), fits, || format!("at position {}", self.pos))?;
        let g = nh / nkv;
        let mut out = vec![0f32; t * nh * hd];
        let mut rows: std::collections::VecDeque<(usize, &mut [f32])> = out.chunks_mut(nh * hd).enumerate().collect();
        let mut units = Vec::with_capacity(t.div_ceil(2));
        while let Some(first) = rows.pop_front() {
            let mut unit = vec![first];
            unit.extend(rows.pop_back());
            units.push(unit);
        }
        crate::threads::par_units(units, |unit| {
            let (mut qh, mut w) = (vec![0f32; g * hd], Vec::new());
            for (i, o) in unit.iter_mut() {
                let seen = self.pos + *i + 1;
                let from = crate::config::first_key(self.window, self.pos + *i);
                let n = seen - from;
                for h in 0..nkv {
                    // the query heads of kv head `h` at row `i`, side by side as a decode step has them
                    for j in 0..g {
                        qh[j * hd..][..hd].copy_from_slice(&q[((h * g + j) * t + *i) * hd..][..hd]);
                    }
                    let keys = &k[(h * n_ctx + from) * hd..][..n * hd];
                    let values = &v[(h * n_ctx + from) * hd..][..n * hd];
                    w.clear();
                    w.resize(g * n, 0.0);
                    head(&qh, keys, values, (self.scale, self.cap), hd, &mut w, &mut o[h * g * hd..][..g * hd]);
                }
            }
        });
        Ok((CpuStorage::F32(out), Shape::from_dims(&[1, t, nh * hd])))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::llama::tests::filled;
    use candle_core::Tensor;

    #[test]
    fn agrees_with_softmax_of_matmuls() {
        for (nh, nkv, hd, n_ctx, from, seen) in [
            (8, 2, 16, 40, 0, 1),
            (32, 4, 64, 300, 0, 257),
            (4, 4, 24, 10, 0, 10),
            (6, 3, 8, 9, 0, 5),
            (8, 2, 16, 40, 13, 29),
            (4, 2, 16, 40, 39, 40),
        ] {
            let q = filled((1, nh, 1, hd), 1);
            let (k, v) = (filled((1, nkv, n_ctx, hd), 2), filled((1, nkv, n_ctx, hd), 3));
            let scale = 1.0 / (hd as f32).sqrt();
            let got = q.apply_op3_no_bwd(&k, &v, &DecodeAttention { from, seen, scale, cap: None }).unwrap();
            assert_eq!(got.dims(), [1, nh, 1, hd]);
            // the composition: per kv head, (g × d)·(d × seen), softmax, (g × seen)·(seen × d)
            let g = nh / nkv;
            let qg = q.reshape((1, nkv, g, hd)).unwrap();
            let (ks, vs) = (k.narrow(2, from, seen - from).unwrap(), v.narrow(2, from, seen - from).unwrap());
            let att = (qg.matmul(&ks.t().unwrap()).unwrap() * scale as f64).unwrap();
            let att = candle_nn::ops::softmax_last_dim(&att).unwrap();
            let want = att.matmul(&vs.contiguous().unwrap()).unwrap().reshape((1, nh, 1, hd)).unwrap();
            let d = (&got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "heads {nh}/{nkv}, d {hd}, {from}..{seen} seen: differs by {d}");
            // soft-capped scores (a cap of 1.5 bends scores of a few units hard)
            let capped = q.apply_op3_no_bwd(&k, &v, &DecodeAttention { from, seen, scale, cap: Some(1.5) }).unwrap();
            let att = (qg.matmul(&ks.t().unwrap()).unwrap() * scale as f64).unwrap();
            let att = ((att / 1.5).unwrap().tanh().unwrap() * 1.5).unwrap();
            let att = candle_nn::ops::softmax_last_dim(&att).unwrap();
            let want_capped = att.matmul(&vs.contiguous().unwrap()).unwrap().reshape((1, nh, 1, hd)).unwrap();
            let d = (&capped - &want_capped).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "heads {nh}/{nkv}, d {hd}, capped: differs by {d}");
            // and the positions outside `from..seen` are not read: changing them changes nothing
            let k2 = (k.clone() + 1000.0).unwrap();
            let k2 = Tensor::cat(
                &[
                    k2.narrow(2, 0, from).unwrap(),
                    k.narrow(2, from, seen - from).unwrap(),
                    k2.narrow(2, seen, n_ctx - seen).unwrap(),
                ],
                2,
            )
            .unwrap();
            let again = q.apply_op3_no_bwd(&k2, &v, &DecodeAttention { from, seen, scale, cap: None }).unwrap();
            let same = (&again - &got).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(same, 0.0, "a key outside positions {from}..{seen} was read");
        }
    }

    #[test]
    fn every_width_gives_the_same_bits() {
        // d = 40 reaches `dot`'s tail past its 16 lanes
        for (g, hd, seen) in [(4, 64, 300), (3, 40, 17)] {
            let f = |n: usize, seed: usize| -> Vec<f32> {
                (0..n).map(|i| ((i * 7919 + seed * 104_729) % 2003) as f32 / 400.0 - 2.5).collect()
            };
            let (q, keys, values) = (f(g * hd, 1), f(seen * hd, 2), f(seen * hd, 3));
            let mut want = None;
            for on in brigade_kernels::vector::Width::available() {
                let (mut w, mut out) = (vec![0f32; g * seen], vec![0f32; g * hd]);
                brigade_kernels::vector::attention_head_on(
                    on,
                    &q,
                    &keys,
                    &values,
                    (0.125, Some(3.0)),
                    hd,
                    &mut w,
                    &mut out,
                );
                let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                match &want {
                    None => want = Some(bits),
                    Some(want) => assert!(&bits == want, "d {hd}: {on:?} differs from the scalar compilation"),
                }
            }
        }
    }

    #[test]
    fn refuses_what_it_does_not_describe() {
        let (q, k) = (filled((1, 8, 1, 16), 1), filled((1, 3, 40, 16), 2));
        let e = q
            .apply_op3_no_bwd(&k, &k, &DecodeAttention { from: 0, seen: 4, scale: 1.0, cap: None })
            .unwrap_err()
            .to_string();
        assert!(e.contains("[1, 8, 1, 16]") && e.contains("[1, 3, 40, 16]"), "{e}");
        let k = filled((1, 2, 40, 16), 2);
        let e = q
            .apply_op3_no_bwd(&k, &k, &DecodeAttention { from: 0, seen: 41, scale: 1.0, cap: None })
            .unwrap_err()
            .to_string();
        assert!(e.contains("positions 0..41"), "{e}");
        let e = q
            .apply_op3_no_bwd(&k, &k, &DecodeAttention { from: 4, seen: 4, scale: 1.0, cap: None })
            .unwrap_err()
            .to_string();
        assert!(e.contains("positions 4..4"), "{e}");
        let e = q
            .apply_op3_no_bwd(&k.t().unwrap(), &k, &DecodeAttention { from: 0, seen: 4, scale: 1.0, cap: None })
            .unwrap_err()
            .to_string();
        assert!(e.contains("contiguous"), "{e}");
    }

    /// A prompt chunk's rows are, bit for bit, the decode steps at their positions: with a
    /// sliding window, a soft cap, odd head groupings and chunks at every offset.
    #[test]
    fn prompt_rows_are_decode_steps_bit_for_bit() {
        for (nh, nkv, hd, n_ctx, pos, t, window, cap) in [
            (8, 2, 16, 64, 0, 9, None, None),
            (6, 3, 8, 40, 5, 17, None, Some(1.5)),
            (4, 4, 24, 80, 30, 33, Some(20), None),
            (4, 1, 32, 16, 0, 1, None, None),
        ] {
            let q = filled((1, nh, t, hd), 7);
            let (k, v) = (filled((1, nkv, n_ctx, hd), 8), filled((1, nkv, n_ctx, hd), 9));
            let scale = 1.0 / (hd as f32).sqrt();
            let got = q.apply_op3_no_bwd(&k, &v, &PromptAttention { pos, window, scale, cap }).unwrap();
            assert_eq!(got.dims(), [1, t, nh * hd]);
            let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
            for i in 0..t {
                let from = crate::config::first_key(window, pos + i);
                let op = DecodeAttention { from, seen: pos + i + 1, scale, cap };
                let qi = q.narrow(2, i, 1).unwrap().contiguous().unwrap();
                let want: Vec<f32> =
                    qi.apply_op3_no_bwd(&k, &v, &op).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let row = &got[i * nh * hd..][..nh * hd];
                let same = row.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "heads {nh}/{nkv}, row {i} at {}: not the decode step's bits", pos + i);
            }
        }
        let bad = filled((1, 4, 3, 8), 1).apply_op3_no_bwd(
            &filled((1, 2, 4, 8), 2),
            &filled((1, 2, 4, 8), 3),
            &PromptAttention { pos: 2, window: None, scale: 1.0, cap: None },
        );
        assert!(bad.is_err(), "three rows after position 2 do not fit a cache of 4");
    }
}
