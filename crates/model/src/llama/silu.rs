//! `SiLU(gate) · up` (and Gemma's `GeLU(gate) · up`) on the CPU in f32 as a candle op, over
//! the vectorized loops of `brigade_kernels::vector` (one pass instead of candle's scalar libm
//! `expf` per value and a second op for the product; the same bits at every vector width). The
//! prompt path (this op) and the fused decode step (`fused`, the same [`silu_mul`]) give the same
//! numbers for a row.

use brigade_kernels::vector::{gated_rows, Width};
pub(super) use brigade_kernels::vector::{gelu_mul, silu_mul};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape};

/// `SiLU(gate) · up`, or with `gelu` `GeLU(gate) · up`, of two tensors of one
/// shape (the halves of a stacked gate/up output may be strided views: each is read as its runs
/// of contiguous values).
pub(super) struct GatedMul {
    pub(super) gelu: bool,
}

impl CustomOp2 for GatedMul {
    fn name(&self) -> &'static str {
        if self.gelu {
            "gelu-mul"
        } else {
            "silu-mul"
        }
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        u: &CpuStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(g), CpuStorage::F32(u)) = (g, u) else {
            candle_core::bail!("silu-mul takes f32, not {:?} and {:?}", g.dtype(), u.dtype())
        };
        if lg.shape() != lu.shape() {
            candle_core::bail!("silu-mul of shapes {:?} and {:?}", lg.shape().dims(), lu.shape().dims())
        }
        let dims = lg.shape().dims();
        let cols = dims.last().copied().unwrap_or(1);
        let n = lg.shape().elem_count();
        // where each row of `cols` values starts in each operand (a narrow of the last
        // dimension keeps its rows contiguous)
        let rows = |l: &Layout| -> candle_core::Result<Vec<usize>> {
            let (dims, stride) = (l.dims(), l.stride());
            if cols > 1 && stride.last() != Some(&1) {
                candle_core::bail!("silu-mul takes rows of contiguous values, strides {stride:?}")
            }
            let lead = &dims[..dims.len().saturating_sub(1)];
            Ok((0..n / cols.max(1))
                .map(|r| {
                    let (mut rest, mut at) = (r, l.start_offset());
                    for (d, s) in lead.iter().zip(stride).rev() {
                        at += (rest % d) * s;
                        rest /= d;
                    }
                    at
                })
                .collect())
        };
        let (rg, ru) = (rows(lg)?, rows(lu)?);
        // every row's start lies inside its storage with `cols` values after it (the layouts are
        // the tensors' own), so `gated_rows` gets whole rows
        let out = gated_rows(Width::detect(), self.gelu, rg.len(), cols, |r| (&g[rg[r]..], &u[ru[r]..]));
        Ok((CpuStorage::F32(out), lg.shape().clone()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use brigade_kernels::vector::{gelu_mul_on, silu_mul_on};
    use candle_core::{Device, Tensor};

    type BodyOn = fn(Width, &[f32], &[f32], &mut [f32]);

    /// 10 000 gates spread over ±10005 / `scale` and ups over ±5; the scalar body's output, checked
    /// bit for bit against every width this CPU has and against the op on strided halves of a
    /// stacked tensor (as a gate/up projection's output is read).
    fn same_bits_everywhere(scale: f32, on: BodyOn, op: GatedMul) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let n = 10_000;
        let gate: Vec<f32> = (0..n).map(|i| ((i * 7919 % 20011) as f32 - 10005.0) / scale).collect();
        let up: Vec<f32> = (0..n).map(|i| ((i * 104_729 % 997) as f32 - 498.0) / 100.0).collect();
        let mut scalar = vec![0f32; n];
        on(Width::scalar(), &gate, &up, &mut scalar);
        let same = |a: &[f32]| a.iter().zip(&scalar).all(|(a, b)| a.to_bits() == b.to_bits());
        for w in Width::available() {
            let mut got = vec![0f32; n];
            on(w, &gate, &up, &mut got);
            assert!(same(&got), "{w:?} differs from scalar");
        }
        let g = Tensor::from_vec(gate.clone(), (100, 100), &Device::Cpu).unwrap();
        let u = Tensor::from_vec(up.clone(), (100, 100), &Device::Cpu).unwrap();
        let stacked = Tensor::cat(&[g, u], 1).unwrap();
        let (gh, uh) = (stacked.narrow(1, 0, 100).unwrap(), stacked.narrow(1, 100, 100).unwrap());
        let got = gh.apply_op2_no_bwd(&uh, &op).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(same(&got), "the op on strided halves differs");
        let e = gh.apply_op2_no_bwd(&uh.narrow(1, 0, 50).unwrap(), &op).unwrap_err().to_string();
        assert!(e.contains("[100, 100]") && e.contains("[100, 50]"), "{e}");
        (gate, up, scalar)
    }

    /// candle's `f` of the gates times the ups.
    fn candle(gate: &[f32], up: &[f32], f: impl Fn(&Tensor) -> Tensor) -> Vec<f32> {
        let g = Tensor::from_slice(gate, gate.len(), &Device::Cpu).unwrap();
        let u = Tensor::from_slice(up, up.len(), &Device::Cpu).unwrap();
        (f(&g) * &u).unwrap().to_vec1::<f32>().unwrap()
    }

    /// GeLU·up: the same bits at every width and from the op, within 8 ulp of the exact value
    /// (f64; times `1 + |2y|` in the tail, the conditioning of `e^(−2y)`), and near candle's GeLU
    /// (libm's tanh), whose `½g(1 + tanh y)` loses digits as `tanh y → −1` where
    /// `g / (1 + e^(−2y))` keeps them.
    #[test]
    fn gelu_mul_gives_the_same_bits_at_every_width_and_agrees_with_candle() {
        let (gate, up, scalar) = same_bits_everywhere(1000.0, gelu_mul_on, GatedMul { gelu: true });
        let want = candle(&gate, &up, |g| g.gelu().unwrap());
        for (((a, b), &x), &up) in scalar.iter().zip(&want).zip(&gate).zip(&up) {
            // the exact value, in f64 (½x(1 + tanh y) as the logistic, which f64 too needs in
            // the tail)
            let (x64, up64) = (x as f64, up as f64);
            let y = (2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64 * x64 * x64);
            let exact = x64 / (1.0 + (-2.0 * y).exp()) * up64;
            // in the negative tail the value's relative error is about |2y| times y's own (its
            // f32 rounding), whoever computes it
            let ulp = (exact.abs() * f32::EPSILON as f64).max(1e-37) * (1.0 + (2.0 * y).abs());
            assert!((*a as f64 - exact).abs() <= 8.0 * ulp, "gelu·up at {x}: {a} vs {exact}");
            // candle's, as near as its own rounding lets it be: below −1 its 1 + tanh y loses
            // digits, and only the absolute difference stays small
            let near = if x > -1.0 { 8.0 * f32::EPSILON * b.abs().max(1e-30) } else { 1e-6 * up.abs().max(1.0) };
            assert!((a - b).abs() <= near, "gelu·up at {x}: {a} vs candle's {b}");
        }
    }

    #[test]
    fn every_width_gives_the_same_bits_and_silu_agrees_with_candle() {
        let (gate, up, scalar) = same_bits_everywhere(400.0, silu_mul_on, GatedMul { gelu: false });
        // candle's SiLU (libm) times up: within a few ulp
        let want = candle(&gate, &up, |g| candle_nn::ops::silu(g).unwrap());
        for ((a, b), x) in scalar.iter().zip(&want).zip(&gate) {
            assert!((a - b).abs() <= 4.0 * f32::EPSILON * b.abs().max(1e-30), "silu·up at {x}: {a} vs {b}");
        }
    }
}
