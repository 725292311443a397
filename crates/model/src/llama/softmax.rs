//! Attention scores to weights in one pass per row on the CPU: scale, causal mask and softmax.
//!
//! The composition it replaces — `scores * scale`, `+ mask` (0 or −∞), `softmax_last_dim` —
//! allocates three score-sized tensors and computes `exp` for every position, the masked ones
//! included (`exp(−∞) = 0`). A prompt of 512 tokens on a 1B model has 32 MB of scores a layer;
//! about half of them are masked. Here each row reads its scores once, and only the positions
//! the query may see are scaled and exponentiated.
//!
//! The numbers are those of the composition but for `exp`: the same f32 products by the scale,
//! the maximum (order does not change it), the same `vec_reduce_sum` of candle over the whole row
//! (whose masked tail is 0 in both), the same division; `exp(x − max)` is `brigade_kernels::vector::exp` (within
//! 2 ulp of libm's, which candle calls once per value, scalar, down to `x − max = −87.3`; 0
//! below, where libm's is subnormal or 0), compiled for the widest vectors
//! the CPU has — the same bits at every width, so a row's weights do not depend on the CPU's
//! vector width or on which thread ran it. Written by hand because no candle op masks by
//! position.

use crate::config::first_key;
use brigade_kernels::vector::{softmax_row_on, Width};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use rayon::prelude::*;

/// Scores below this many are done on the calling thread: a decode step's (one query per head,
/// a few hundred keys) take microseconds, less than waking the pool's threads costs.
const SERIAL_BELOW: usize = 1 << 17;

/// Scores `(…, rows, pos + t)` of `t` queries at positions `pos..pos + t` against `pos + t`
/// keys, whose rows cycle through the `t` queries (`(batch, kv heads, group × t, keys)`), to
/// attention weights: row `r` sees keys `0..=pos + r % t`, or with a sliding `window` only the
/// last `window` of those.
pub(super) struct CausalSoftmax {
    pub scale: f32,
    pub t: usize,
    pub pos: usize,
    pub window: Option<usize>,
    /// Scaled scores soft-capped as `c · tanh(s / c)` (Gemma 2).
    pub cap: Option<f32>,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(src) = storage else {
            candle_core::bail!("causal softmax takes f32 scores, not {:?}", storage.dtype())
        };
        let Some((o1, o2)) = layout.contiguous_offsets() else {
            candle_core::bail!("causal softmax takes contiguous scores")
        };
        let src = &src[o1..o2];
        let dims = layout.shape().dims();
        let keys = dims.last().copied().unwrap_or(0);
        if self.t == 0 || keys != self.pos + self.t || src.len() % (keys * self.t) != 0 {
            candle_core::bail!(
                "causal softmax: scores {dims:?} are not rows of {} keys cycling through {} queries at position {}",
                self.pos + self.t,
                self.t,
                self.pos
            )
        }
        let (scale, t, pos, window, cap) = (self.scale, self.t, self.pos, self.window, self.cap);
        let mut dst = vec![0f32; src.len()];
        let width = Width::detect();
        let row = |(r, (s, d)): (usize, (&[f32], &mut [f32]))| {
            let query = pos + r % t;
            softmax_row_on(width, s, d, first_key(window, query), query + 1, (scale, cap))
        };
        if src.len() < SERIAL_BELOW {
            src.chunks(keys).zip(dst.chunks_mut(keys)).enumerate().for_each(row);
        } else {
            src.par_chunks(keys).zip(dst.par_chunks_mut(keys)).enumerate().for_each(row);
        }
        Ok((CpuStorage::F32(dst), layout.shape().clone()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The composition `attend` used before: scale, add the causal mask, softmax.
    fn composed(s: &Tensor, scale: f64, t: usize, pos: usize, window: Option<usize>) -> Tensor {
        let (b, kv, rows, l) = s.dims4().unwrap();
        let s = (s * scale).unwrap();
        let s = if t > 1 || window.is_some() {
            let m = crate::llama::causal_mask(t, pos, window, &Device::Cpu, candle_core::DType::F32).unwrap();
            s.reshape((b, kv, rows / t, t, l)).unwrap().broadcast_add(&m).unwrap().reshape((b, kv, rows, l)).unwrap()
        } else {
            s
        };
        candle_nn::ops::softmax_last_dim(&s).unwrap()
    }

    #[test]
    fn agrees_with_scale_mask_and_softmax_and_every_width_gives_the_same_bits() {
        // the last is above SERIAL_BELOW: rows on the pool's threads
        const _: () = assert!(4 * 8 * 64 * 66 >= SERIAL_BELOW);
        for (kv, g, t, pos, spread, window) in [
            (1, 1, 1, 0, 61.0, None),
            (2, 4, 1, 37, 61.0, None),
            (4, 8, 7, 0, 61.0, None),
            (2, 3, 16, 5, 61.0, None),
            (1, 2, 33, 100, 61.0, None),
            (4, 8, 64, 2, 61.0, None),
            // scores ~260 apart after the scale: far keys past the exp's −87.3 weigh 0
            (2, 2, 9, 40, 0.5, None),
            // sliding windows: shorter than the chunk, than the keys before it, one key
            (2, 4, 16, 5, 61.0, Some(6)),
            (1, 2, 33, 100, 61.0, Some(40)),
            (2, 2, 3, 7, 61.0, Some(1)),
            (2, 4, 1, 37, 61.0, Some(8)),
        ] {
            let l = pos + t;
            let n = kv * g * t * l;
            // scores of a few units, as q·k / √d gives, with ties and repeats (or far apart)
            let v: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1013) as f32 - 506.0) / spread).collect();
            let s = Tensor::from_vec(v, (1, kv, g * t, l), &Device::Cpu).unwrap();
            let scale = 1.0 / (64f64).sqrt();
            let want = composed(&s, scale, t, pos, window).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got = s
                .apply_op1_no_bwd(&CausalSoftmax { scale: scale as f32, t, pos, window, cap: None })
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            // exp within 2 ulp of libm's: each weight within a few ulp of the composition's
            let far = want
                .iter()
                .zip(&got)
                .filter(|(a, b)| (*a - *b).abs() > 8.0 * f32::EPSILON * a.abs() + f32::MIN_POSITIVE)
                .count();
            assert_eq!(
                far, 0,
                "kv {kv} g {g} t {t} pos {pos} window {window:?}: {far} of {n} weights differ by more than 8 ulp"
            );
            let first = |seen: usize| first_key(window, seen - 1);
            // the op (pool threads above SERIAL_BELOW) equals the scalar compilation of its rows,
            // and so does every width this CPU has
            let src = s.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for w in Width::available() {
                let mut one = vec![0f32; n];
                for (r, (s, d)) in src.chunks(l).zip(one.chunks_mut(l)).enumerate() {
                    softmax_row_on(w, s, d, first(pos + r % t + 1), pos + r % t + 1, (scale as f32, None));
                }
                let differ = one.iter().zip(&got).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "{w:?}, kv {kv} g {g} t {t} pos {pos}: {differ} of {n} weights differ");
            }
            // and the mask holds: row r sees keys 0..=pos + r % t (the last `window` of them)
            for (r, row) in got.chunks(l).enumerate() {
                let seen = pos + r % t + 1;
                assert!(row[seen..].iter().all(|w| *w == 0.0), "row {r} weighs a future key");
                assert!(row[..first(seen)].iter().all(|w| *w == 0.0), "row {r} weighs a key before its window");
                assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5, "row {r} does not sum to 1");
            }
            // the far-apart case reaches the exp's floor: visible keys that weigh exactly 0
            let floored = got
                .chunks(l)
                .enumerate()
                .map(|(r, row)| row[first(pos + r % t + 1)..pos + r % t + 1].iter().filter(|w| **w == 0.0).count());
            assert_eq!(floored.sum::<usize>() > 0, spread < 1.0, "kv {kv} g {g} t {t} pos {pos}");
        }
    }

    #[test]
    fn refuses_scores_it_does_not_describe() {
        let s = Tensor::zeros((1, 2, 6, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = s
            .apply_op1_no_bwd(&CausalSoftmax { scale: 1.0, t: 4, pos: 0, window: None, cap: None })
            .unwrap_err()
            .to_string();
        assert!(e.contains("[1, 2, 6, 5]") && e.contains("4 keys"), "{e}");
        let e = s
            .to_dtype(candle_core::DType::F16)
            .unwrap()
            .apply_op1_no_bwd(&CausalSoftmax { scale: 1.0, t: 1, pos: 4, window: None, cap: None })
            .unwrap_err()
            .to_string();
        assert!(e.contains("f32"), "{e}");
        let e = s
            .t()
            .unwrap()
            .apply_op1_no_bwd(&CausalSoftmax { scale: 1.0, t: 1, pos: 5, window: None, cap: None })
            .unwrap_err()
            .to_string();
        assert!(e.contains("contiguous"), "{e}");
    }
}
