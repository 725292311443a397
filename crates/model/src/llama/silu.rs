//! `SiLU(gate) · up` (and Gemma's `GeLU(gate) · up`) on the CPU in f32, with an `exp` that
//! vectorizes.
//!
//! candle's SiLU calls libm's `expf` once per value (scalar), then a second op multiplies by
//! `up`: on a 512-token prompt of llama-1b that is 67 M `expf` calls, with the op loops 9% of
//! the prompt's time once the matmuls ran on AMX. Here one pass computes `g / (1 + exp(−g)) · u`
//! with [`exp`], a Cody–Waite reduction and a degree-6 polynomial (Cephes' `expf`
//! coefficients, within 2 ulp of libm over the range a SiLU needs) written in plain f32
//! operations — `mul_add` for every step, the rounding and the power of two on the bits — that
//! the compiler turns into vector code (AVX-512 or AVX2 where the CPU has them, each a
//! compilation of the same function). Every instruction set computes the same operations per
//! value, so the numbers do not depend on the vector width, the thread count or the rows
//! beside a value; the prompt path (this op) and the fused decode step (`fused`, the same
//! [`silu_mul`]) give the same numbers for a row. The attention softmaxes (`softmax`,
//! `decode_attn`) use the same [`exp`].

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape};
use std::sync::OnceLock;

/// `e^x`: within 2 ulp of libm's for `x` in −87.3..=88.3, 0 below (where libm's are subnormal
/// or 0: a softmax's far keys weigh nothing), `e^88.3` above, NaN for NaN. `x = n·ln 2 + r`,
/// `|r| ≤ ln 2 / 2`, `e^r` by Cephes' polynomial, `2^n` on the exponent bits.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer in the low bits
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let low = x < -87.3;
    let x = x.clamp(-87.3, 88.3);
    let t = x.mul_add(LOG2E, MAGIC);
    let n = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let p = 1.987_569_2e-4f32;
    let p = p.mul_add(r, 1.398_2e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 0.5); // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let y = p.mul_add(r * r, r) + 1.0;
    // 2^n for n in −126..=127
    let e = y * f32::from_bits((ni.wrapping_add(127) << 23) as u32);
    // a select, not a branch: the loops around stay vector code
    if low {
        0.0
    } else {
        e
    }
}

/// `out[i] = SiLU(gate[i]) · up[i]`.
#[inline(always)]
fn body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

/// `√(2/π)`, GeLU's tanh approximation's scale.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// `out[i] = GeLU(gate[i]) · up[i]`, GeLU the tanh approximation (transformers'
/// `gelu_pytorch_tanh`, llama.cpp's GELU): `½g(1 + tanh y)` with `y = √(2/π)(g + 0.044715g³)`,
/// computed as `g / (1 + e^(−2y))` (the same value, `½(1 + tanh y)` being the logistic of `2y`),
/// so that it is [`exp`]'s vector code and loses no digits where `tanh y` is near −1.
#[inline(always)]
fn gelu_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let y = SQRT_2_OVER_PI * (0.044_715 * g * g).mul_add(g, g);
        *o = g / (1.0 + exp(-2.0 * y)) * u;
    }
}

/// The widest compilation of [`body`] (and of the softmax rows and decode head that use [`exp`])
/// this CPU runs, no wider than what `BRIGADE_CPU_KERNELS` asks for ([`capped`]).
#[derive(Clone, Copy, PartialEq, Debug)]
pub(super) enum Width {
    Avx512,
    Avx2,
    Scalar,
}

pub(super) fn width() -> Width {
    static W: OnceLock<Width> = OnceLock::new();
    *W.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::cpu_matmul::Isa;
            // AVX2 and FMA as the int8 kernels want them; AVX-512 F on top
            let cpu = if !Isa::Avx2.available() {
                Width::Scalar
            } else if std::arch::is_x86_feature_detected!("avx512f") {
                Width::Avx512
            } else {
                Width::Avx2
            };
            // only an explicit request caps it: a CPU with AVX-512 F but not VNNI (Skylake-SP)
            // runs AVX2 int8 kernels and AVX-512 vector loops
            Isa::asked().map_or(cpu, |isa| capped(cpu, isa))
        }
        #[cfg(not(target_arch = "x86_64"))]
        Width::Scalar
    })
}

/// The CPU's width `cpu` no wider than the instruction set `isa` that `BRIGADE_CPU_KERNELS`
/// asks for: a lesser one holds for these loops too, so that `=avx2` measures what a
/// CPU without AVX-512 runs (bar the `gemm` crate's own choice for the prompt's attention).
#[cfg(target_arch = "x86_64")]
fn capped(cpu: Width, isa: crate::cpu_matmul::Isa) -> Width {
    use crate::cpu_matmul::Isa;
    match isa {
        Isa::Avx512Vnni => cpu,
        Isa::AvxVnni | Isa::Avx2 if cpu == Width::Avx512 => Width::Avx2,
        Isa::AvxVnni | Isa::Avx2 => cpu,
        Isa::Portable => Width::Scalar,
    }
}

/// Every width up to [`width`]'s, narrowest first (what the tests compare; under
/// `BRIGADE_CPU_KERNELS=avx2` the AVX-512 compilation is left out).
#[cfg(test)]
pub(super) fn widths() -> Vec<Width> {
    let all = [Width::Scalar, Width::Avx2, Width::Avx512];
    let here = all.iter().position(|&w| w == width()).unwrap_or(0);
    all[..=here].to_vec()
}

/// `unsafe fn $on(on: Width, args…)`: the `#[inline(always)]` function `$body` compiled for each
/// [`Width`] (AVX-512, AVX2 — both with FMA — and the baseline), run for `w`. The one place the
/// element-wise loops (SiLU, the softmaxes and their `exp`) get their vector code: the compiler
/// vectorizes `$body` inside each `#[target_feature]` copy, and since every copy does the same
/// operations per value (`mul_add` is fused in each, without FMA by libm's `fmaf`), the numbers
/// do not depend on the width. The generated function's safety contract: `on` is [`width`]'s
/// answer or a narrower width.
macro_rules! per_width {
    ($(#[$m:meta])* $vis:vis unsafe fn $on:ident = $body:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)?) => {
        $(#[$m])*
        /// # Safety
        /// `on` is [`crate::llama::silu::width`]'s answer or a narrower width.
        $vis unsafe fn $on(on: $crate::llama::silu::Width, $($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512($($a: $t),*) $(-> $r)? {
                $body($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($a: $t),*) $(-> $r)? {
                $body($($a),*)
            }
            match on {
                // SAFETY: the caller's contract: `width` found the instructions
                #[cfg(target_arch = "x86_64")]
                $crate::llama::silu::Width::Avx512 => unsafe { avx512($($a),*) },
                // SAFETY: as above
                #[cfg(target_arch = "x86_64")]
                $crate::llama::silu::Width::Avx2 => unsafe { avx2($($a),*) },
                _ => $body($($a),*),
            }
        }
    };
}
pub(super) use per_width;

per_width!(
    /// [`body`] compiled for `on`.
    unsafe fn body_on = body(gate: &[f32], up: &[f32], out: &mut [f32])
);

per_width!(
    /// [`gelu_body`] compiled for `on`.
    unsafe fn gelu_body_on = gelu_body(gate: &[f32], up: &[f32], out: &mut [f32])
);

/// `out[i] = SiLU(gate[i]) · up[i]` over the shortest of the three.
pub(super) fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY: this CPU's width
    unsafe { body_on(width(), gate, up, out) }
}

/// `out[i] = GeLU(gate[i]) · up[i]` ([`gelu_body`]) over the shortest of the three.
pub(super) fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY: this CPU's width
    unsafe { gelu_body_on(width(), gate, up, out) }
}

/// Values below which the op runs on the calling thread (a decode step's row).
const SERIAL_BELOW: usize = 1 << 16;

/// `SiLU(gate) · up`, or with `gelu` `GeLU(gate) · up` ([`gelu_body`]), of two tensors of one
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
        let mut out = vec![0f32; n];
        let w = width();
        // SAFETY: this CPU's width
        let f = if self.gelu { gelu_body_on } else { body_on };
        let work = |r: usize, o: &mut [f32]| unsafe { f(w, &g[rg[r]..][..cols], &u[ru[r]..][..cols], o) };
        if n < SERIAL_BELOW {
            for (r, o) in out.chunks_mut(cols.max(1)).enumerate() {
                work(r, o);
            }
        } else {
            crate::threads::par_units(out.chunks_mut(cols.max(1)).enumerate().collect(), |(r, o)| work(*r, o));
        }
        Ok((CpuStorage::F32(out), lg.shape().clone()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0f64;
        for i in 0..200_000 {
            let x = -87.0 + 175.0 * (i as f32 / 200_000.0);
            let (got, want) = (exp(x) as f64, x.exp() as f64);
            let ulp = (want.abs() * f32::EPSILON as f64).max(f32::MIN_POSITIVE as f64);
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "exp is {worst} ulp from libm's");
        assert_eq!(exp(0.0), 1.0);
        // past the ends: 0 below (libm: subnormal, then 0), e^88.3 above, NaN kept
        for x in [-87.31, -100.0, -1e30, f32::NEG_INFINITY] {
            assert_eq!(exp(x), 0.0, "{x}");
        }
        assert_eq!(exp(f32::INFINITY), exp(88.3));
        assert!(exp(88.3).is_finite() && exp(88.3) > 1e38);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn brigade_cpu_kernels_caps_the_width() {
        use crate::cpu_matmul::Isa;
        assert_eq!(capped(Width::Avx512, Isa::Avx512Vnni), Width::Avx512);
        assert_eq!(capped(Width::Avx512, Isa::Avx2), Width::Avx2);
        assert_eq!(capped(Width::Avx512, Isa::AvxVnni), Width::Avx2);
        assert_eq!(capped(Width::Avx2, Isa::AvxVnni), Width::Avx2);
        assert_eq!(capped(Width::Avx512, Isa::Portable), Width::Scalar);
        assert_eq!(capped(Width::Scalar, Isa::Portable), Width::Scalar);
    }

    type BodyOn = unsafe fn(Width, &[f32], &[f32], &mut [f32]);

    /// 10 000 gates spread over ±10005 / `scale` and ups over ±5; the scalar body's output, checked
    /// bit for bit against every width this CPU has and against the op on strided halves of a
    /// stacked tensor (as a gate/up projection's output is read).
    fn same_bits_everywhere(scale: f32, on: BodyOn, op: GatedMul) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let n = 10_000;
        let gate: Vec<f32> = (0..n).map(|i| ((i * 7919 % 20011) as f32 - 10005.0) / scale).collect();
        let up: Vec<f32> = (0..n).map(|i| ((i * 104_729 % 997) as f32 - 498.0) / 100.0).collect();
        let mut scalar = vec![0f32; n];
        // SAFETY: the scalar width runs everywhere
        unsafe { on(Width::Scalar, &gate, &up, &mut scalar) };
        let same = |a: &[f32]| a.iter().zip(&scalar).all(|(a, b)| a.to_bits() == b.to_bits());
        for w in widths() {
            let mut got = vec![0f32; n];
            // SAFETY: a width this CPU has
            unsafe { on(w, &gate, &up, &mut got) };
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
        let (gate, up, scalar) = same_bits_everywhere(1000.0, gelu_body_on, GatedMul { gelu: true });
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
        let (gate, up, scalar) = same_bits_everywhere(400.0, body_on, GatedMul { gelu: false });
        // candle's SiLU (libm) times up: within a few ulp
        let want = candle(&gate, &up, |g| candle_nn::ops::silu(g).unwrap());
        for ((a, b), x) in scalar.iter().zip(&want).zip(&gate) {
            assert!((a - b).abs() <= 4.0 * f32::EPSILON * b.abs().max(1e-30), "silu·up at {x}: {a} vs {b}");
        }
    }
}
