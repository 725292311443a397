//! The element-wise f32 loops of a forward pass, vectorized: `SiLU(gate) · up` and Gemma's
//! `GeLU(gate) · up`, a causal softmax row, and one decode step's attention of a kv head, all on
//! one `exp` that vectorizes.
//!
//! candle's SiLU calls libm's `expf` once per value (scalar), then a second op multiplies by
//! `up`: on a 512-token prompt of llama-1b that is 67 M `expf` calls, with the op loops 9% of
//! the prompt's time once the matmuls ran on AMX. Here one pass computes `g / (1 + exp(−g)) · u`
//! with [`exp`], a Cody–Waite reduction and a degree-6 polynomial (Cephes' `expf`
//! coefficients, within 2 ulp of libm over the range a SiLU needs) written in plain f32
//! operations — `mul_add` for every step, the rounding and the power of two on the bits — that
//! the compiler turns into vector code (AVX-512 or AVX2 where the CPU has them, each a
//! compilation of the same function: [`Width`]). Every instruction set computes the same
//! operations per value, so the numbers do not depend on the vector width, the thread count or
//! the rows beside a value.
//!
//! A decode step's attention ([`attention_head`]) reads each key and value row once, from the
//! cache, for all the query heads that share it: through candle it is two `gemm` calls per kv
//! head, and `gemm` copies the keys (then the values) into its packed panels on every call.
//! Written by hand because the shape (a few rows against a strided cache, in place) is no BLAS
//! call's. Its scores are added up 16 keys at a time, the keys' lane sums transposed (AVX-512,
//! AVX2 intrinsics: the one place here that is not plain Rust, because the compiler turned the
//! plain transpose into gathers), in the order one key at a time adds them.

use candle_core::cpu::kernels::VecOps;
use std::sync::OnceLock;

/// `e^x`: within 2 ulp of libm's for `x` in −87.3..=88.3, 0 below (where libm's are subnormal
/// or 0: a softmax's far keys weigh nothing), `e^88.3` above, NaN for NaN. `x = n·ln 2 + r`,
/// `|r| ≤ ln 2 / 2`, `e^r` by Cephes' polynomial, `2^n` on the exponent bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
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

/// An output value a loop stores (never reads): an `f32`, or one not yet initialized.
trait Put {
    fn put(&mut self, v: f32);
}

impl Put for f32 {
    #[inline(always)]
    fn put(&mut self, v: f32) {
        *self = v;
    }
}

impl Put for std::mem::MaybeUninit<f32> {
    #[inline(always)]
    fn put(&mut self, v: f32) {
        self.write(v);
    }
}

/// `out[i] = SiLU(gate[i]) · up[i]`.
#[inline(always)]
fn body<O: Put>(gate: &[f32], up: &[f32], out: &mut [O]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        o.put(g / (1.0 + exp(-g)) * u);
    }
}

/// `√(2/π)`, GeLU's tanh approximation's scale.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// `out[i] = GeLU(gate[i]) · up[i]`, GeLU the tanh approximation (transformers'
/// `gelu_pytorch_tanh`, llama.cpp's GELU): `½g(1 + tanh y)` with `y = √(2/π)(g + 0.044715g³)`,
/// computed as `g / (1 + e^(−2y))` (the same value, `½(1 + tanh y)` being the logistic of `2y`),
/// so that it is [`exp`]'s vector code and loses no digits where `tanh y` is near −1.
#[inline(always)]
fn gelu_body<O: Put>(gate: &[f32], up: &[f32], out: &mut [O]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let y = SQRT_2_OVER_PI * (0.044_715 * g * g).mul_add(g, g);
        o.put(g / (1.0 + exp(-2.0 * y)) * u);
    }
}

/// A compilation of the loops here ([`exp`] and those that use it) that this CPU runs: a value
/// of it is proof that the CPU has its instructions, so the functions taking one are safe.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Width(W);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum W {
    Avx512,
    Avx2,
    Scalar,
}

impl std::fmt::Debug for Width {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name())
    }
}

impl Width {
    /// The widest compilation this CPU runs, no wider than what `BRIGADE_CPU_KERNELS` asks for
    /// ([`capped`]).
    pub fn detect() -> Width {
        static DETECTED: OnceLock<Width> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                use crate::matmul::Isa;
                // AVX2 and FMA as the int8 kernels want them; AVX-512 F on top
                let cpu = if !Isa::Avx2.available() {
                    W::Scalar
                } else if std::arch::is_x86_feature_detected!("avx512f") {
                    W::Avx512
                } else {
                    W::Avx2
                };
                // only an explicit request caps it: a CPU with AVX-512 F but not VNNI
                // (Skylake-SP) runs AVX2 int8 kernels and AVX-512 vector loops
                Width(Isa::asked().map_or(cpu, |isa| capped(cpu, isa)))
            }
            #[cfg(not(target_arch = "x86_64"))]
            Width(W::Scalar)
        })
    }

    /// The baseline compilation, which every CPU runs.
    pub fn scalar() -> Width {
        Width(W::Scalar)
    }

    /// Every width up to [`Width::detect`]'s, narrowest first (what tests compare; under
    /// `BRIGADE_CPU_KERNELS=avx2` the AVX-512 compilation is left out).
    pub fn available() -> Vec<Width> {
        let all = [W::Scalar, W::Avx2, W::Avx512];
        let here = all.iter().position(|&w| w == Width::detect().0).unwrap_or(0);
        all[..=here].iter().map(|&w| Width(w)).collect()
    }

    /// `avx512`, `avx2` or `scalar`.
    pub fn name(self) -> &'static str {
        match self.0 {
            W::Avx512 => "avx512",
            W::Avx2 => "avx2",
            W::Scalar => "scalar",
        }
    }
}

/// The CPU's width `cpu` no wider than the instruction set `isa` that `BRIGADE_CPU_KERNELS`
/// asks for: a lesser one holds for these loops too, so that `=avx2` measures what a CPU
/// without AVX-512 runs (bar the `gemm` crate's own choice for the prompt's attention).
#[cfg(target_arch = "x86_64")]
fn capped(cpu: W, isa: crate::matmul::Isa) -> W {
    use crate::matmul::Isa;
    match isa {
        Isa::Avx512Vnni => cpu,
        Isa::AvxVnni | Isa::Avx2 if cpu == W::Avx512 => W::Avx2,
        Isa::AvxVnni | Isa::Avx2 => cpu,
        Isa::Portable => W::Scalar,
    }
}

/// `pub fn $on(on: Width, args…)`: the `#[inline(always)]` function `$body` compiled for each
/// [`Width`] (AVX-512, AVX2 — both with FMA — and the baseline), run for `on`. The compiler
/// vectorizes `$body` inside each `#[target_feature]` copy, and since every copy does the same
/// operations per value (`mul_add` is fused in each, without FMA by libm's `fmaf`), the numbers
/// do not depend on the width. Safe: a `Width` exists only for instructions the CPU has.
macro_rules! per_width {
    ($(#[$m:meta])* $vis:vis fn $on:ident = $body:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)?) => {
        $(#[$m])*
        $vis fn $on(on: Width, $($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            fn avx512($($a: $t),*) $(-> $r)? {
                $body($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($a: $t),*) $(-> $r)? {
                $body($($a),*)
            }
            match on.0 {
                // SAFETY: a `Width` of AVX-512 is made only where `detect` found the instructions
                #[cfg(target_arch = "x86_64")]
                W::Avx512 => unsafe { avx512($($a),*) },
                // SAFETY: as above
                #[cfg(target_arch = "x86_64")]
                W::Avx2 => unsafe { avx2($($a),*) },
                _ => $body($($a),*),
            }
        }
    };
}

per_width!(
    /// `out[i] = SiLU(gate[i]) · up[i]` over the shortest of the three, compiled for `on`.
    pub fn silu_mul_on = body(gate: &[f32], up: &[f32], out: &mut [f32])
);

per_width!(
    /// `out[i] = GeLU(gate[i]) · up[i]` ([`gelu_body`]) over the shortest of the three, compiled
    /// for `on`.
    pub fn gelu_mul_on = gelu_body(gate: &[f32], up: &[f32], out: &mut [f32])
);

per_width!(
    /// [`silu_mul_on`] into values not yet initialized.
    fn silu_mul_uninit_on = body(gate: &[f32], up: &[f32], out: &mut [std::mem::MaybeUninit<f32>])
);

per_width!(
    /// [`gelu_mul_on`] into values not yet initialized.
    fn gelu_mul_uninit_on = gelu_body(gate: &[f32], up: &[f32], out: &mut [std::mem::MaybeUninit<f32>])
);

/// Values from which [`gated_rows`] computes its rows on candle's pool, fewer in this thread.
const SERIAL_BELOW: usize = 1 << 16;

/// `rows` rows of `cols` values, row `r` being `act(gate) · up` of `row(r) = (gate, up)` (GeLU
/// with `gelu`, else SiLU: [`gelu_mul_on`]'s and [`silu_mul_on`]'s numbers, bit for bit), into a
/// new vector that is not zeroed first: every value is stored (a prompt's are megabytes; zeroing
/// them was 1.2% of a 500-token prompt, llama-1b q4_k, `perf`). Panics where a row's gate or up
/// is shorter than `cols`, before anything is computed.
pub fn gated_rows<'a>(
    on: Width,
    gelu: bool,
    rows: usize,
    cols: usize,
    row: impl Fn(usize) -> (&'a [f32], &'a [f32]) + Sync,
) -> Vec<f32> {
    let n = rows.checked_mul(cols).expect("gated rows' size overflows usize");
    // each row's gate and up cut to `cols` once: the lengths the loops below store by
    let pairs: Vec<(&[f32], &[f32])> = (0..rows)
        .map(|r| {
            let (g, u) = row(r);
            assert!(g.len() >= cols && u.len() >= cols, "gated row {r}: {} and {} values for {cols}", g.len(), u.len());
            (&g[..cols], &u[..cols])
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    let f = if gelu { gelu_mul_uninit_on } else { silu_mul_uninit_on };
    let work = |r: usize, o: &mut [std::mem::MaybeUninit<f32>]| f(on, pairs[r].0, pairs[r].1, o);
    if cols > 0 {
        let spare = &mut out.spare_capacity_mut()[..n];
        if n < SERIAL_BELOW {
            for (r, o) in spare.chunks_mut(cols).enumerate() {
                work(r, o);
            }
        } else {
            crate::threads::par_units(spare.chunks_mut(cols).enumerate().collect(), |(r, o)| work(*r, o));
        }
    }
    // SAFETY: every row's gate and up are `cols` values (cut above), so each row's loop stored
    // all `cols` of its outputs, and the rows cover the `n` values
    unsafe { out.set_len(n) };
    out
}

/// `out[i] = SiLU(gate[i]) · up[i]` over the shortest of the three.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_on(Width::detect(), gate, up, out)
}

/// `out[i] = GeLU(gate[i]) · up[i]` ([`gelu_body`]) over the shortest of the three.
pub fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gelu_mul_on(Width::detect(), gate, up, out)
}

/// Soft-caps scaled scores in place: `c · tanh(s / c)`.
pub fn soft_cap(scores: &mut [f32], cap: Option<f32>) {
    if let Some(c) = cap {
        for s in scores {
            *s = c * (*s / c).tanh();
        }
    }
}

/// One row: `s[from..seen]` scaled, to weights in `d` (whose head before `from` and tail stay 0).
#[inline(always)]
fn row(s: &[f32], d: &mut [f32], from: usize, seen: usize, (scale, cap): (f32, Option<f32>)) {
    let keys = d.len();
    let (s, w) = (&s[from..seen], &mut d[from..seen]);
    for (x, y) in s.iter().zip(w.iter_mut()) {
        *y = *x * scale;
    }
    soft_cap(w, cap);
    let max = w.iter().copied().fold(w[0], f32::max);
    for y in w.iter_mut() {
        *y = exp(*y - max);
    }
    let mut sum = 0f32;
    // SAFETY: `d` holds `keys` floats and `sum` is one
    unsafe { f32::vec_reduce_sum(d.as_ptr(), &mut sum, keys) };
    for y in d[from..seen].iter_mut() {
        *y /= sum;
    }
}

per_width!(
    /// One causal softmax row compiled for `on`: `s[from..seen]` times `scale.0` (soft-capped
    /// by `scale.1`), to weights in `d`, whose head before `from` and tail from `seen` stay 0;
    /// the sum is candle's `vec_reduce_sum` over the whole row.
    pub fn softmax_row_on = row(s: &[f32], d: &mut [f32], from: usize, seen: usize, scale: (f32, Option<f32>))
);

/// One kv head of a decode step: `g` query rows `q` (`g × d`) against `seen` key and value rows;
/// `w` is scratch of `g × seen`, `out` (`g × d`) receives the weighted values. `scale` is the
/// scores' scale and their soft cap ([`soft_cap`]). The lanes are summed in the same order at
/// each width, so the numbers are the same.
pub fn attention_head(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scale: (f32, Option<f32>),
    hd: usize,
    w: &mut [f32],
    out: &mut [f32],
) {
    attention_head_on(Width::detect(), q, keys, values, scale, hd, w, out)
}

/// [`attention_head`] compiled for `on`, as [`per_width!`] compiles the other loops; on AVX-512
/// and AVX2 the scores of 16 keys are added up at once ([`dots16_zmm`], [`dots8_ymm`]), with
/// the same numbers.
#[allow(clippy::too_many_arguments)]
pub fn attention_head_on(
    on: Width,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scale: (f32, Option<f32>),
    hd: usize,
    w: &mut [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn avx512(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        scale: (f32, Option<f32>),
        hd: usize,
        w: &mut [f32],
        out: &mut [f32],
    ) {
        head_body::<Zmm>(q, keys, values, scale, hd, w, out)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn avx2(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        scale: (f32, Option<f32>),
        hd: usize,
        w: &mut [f32],
        out: &mut [f32],
    ) {
        head_body::<Ymm>(q, keys, values, scale, hd, w, out)
    }
    match on.0 {
        // SAFETY: a `Width` of AVX-512 is made only where `detect` found the instructions
        #[cfg(target_arch = "x86_64")]
        W::Avx512 => unsafe { avx512(q, keys, values, scale, hd, w, out) },
        // SAFETY: as above
        #[cfg(target_arch = "x86_64")]
        W::Avx2 => unsafe { avx2(q, keys, values, scale, hd, w, out) },
        _ => head_body::<KeyByKey>(q, keys, values, scale, hd, w, out),
    }
}

/// How a kv head's scores of 16 keys are computed, all with [`dot`]'s numbers.
trait Scores {
    /// `dot(q, key)` for each of the 16 rows of `keys`.
    ///
    /// # Safety
    /// The CPU has the instructions the implementation uses.
    unsafe fn block(q: &[f32], keys: &[f32]) -> [f32; 16];
}

/// One key at a time: [`dot`] itself.
struct KeyByKey;

impl Scores for KeyByKey {
    #[inline(always)]
    unsafe fn block(q: &[f32], keys: &[f32]) -> [f32; 16] {
        let mut s = [0f32; 16];
        for (s, key) in s.iter_mut().zip(keys.chunks_exact(q.len())) {
            *s = dot(q, key);
        }
        s
    }
}

/// 16 keys at once on AVX-512 ([`dots16_zmm`]).
#[cfg(target_arch = "x86_64")]
struct Zmm;

#[cfg(target_arch = "x86_64")]
impl Scores for Zmm {
    #[inline(always)]
    unsafe fn block(q: &[f32], keys: &[f32]) -> [f32; 16] {
        // SAFETY: the caller's contract (AVX-512 F)
        unsafe { dots16_zmm(q, keys) }
    }
}

/// Adds to each key's score `out[j]` the products past the first `full` dimensions ([`dot`]'s
/// tail, added last as `dot` adds it).
#[inline(always)]
fn add_tails(out: &mut [f32], q: &[f32], keys: &[f32], full: usize) {
    let hd = q.len();
    if full < hd {
        for (o, key) in out.iter_mut().zip(keys.chunks_exact(hd)) {
            let tail: f32 = q[full..].iter().zip(&key[full..]).map(|(x, y)| x * y).sum();
            *o += tail;
        }
    }
}

/// 16 keys at once on AVX2 ([`dots8_ymm`] twice).
#[cfg(target_arch = "x86_64")]
struct Ymm;

#[cfg(target_arch = "x86_64")]
impl Scores for Ymm {
    #[inline(always)]
    unsafe fn block(q: &[f32], keys: &[f32]) -> [f32; 16] {
        let mut out = [0f32; 16];
        // SAFETY: the caller's contract (AVX2); rows 0..8 and 8..16 of `keys`
        unsafe {
            out[..8].copy_from_slice(&dots8_ymm(q, keys));
            out[8..].copy_from_slice(&dots8_ymm(q, &keys[8 * q.len()..]));
        }
        out
    }
}

/// [`dot`] of `q` with each of the 8 rows of `keys`, bit for bit, on AVX2: [`dots16_zmm`]'s way
/// with each key's 16 lanes in two registers (lanes 0..8, 8..16), each half transposed 8 × 8.
///
/// # Safety
/// The CPU has AVX2; `keys` holds 8 rows of `q.len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dots8_ymm(q: &[f32], keys: &[f32]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let hd = q.len();
    let full = hd / 16 * 16;
    debug_assert!(keys.len() >= 8 * hd);
    // the 8 × 8 transpose of `r`: lane l of rows 0..8 in vector l, row j in lane j
    #[inline(always)]
    unsafe fn transpose(r: [__m256; 8]) -> [__m256; 8] {
        // SAFETY: the caller has AVX2
        unsafe {
            let mut t = [_mm256_setzero_ps(); 8];
            for i in 0..4 {
                t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            // u[4g + m], 128-bit block k: lane 4k + m of rows 4g..4g + 4
            let mut u = [_mm256_setzero_ps(); 8];
            for g in 0..2 {
                let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
                u[4 * g] = _mm256_shuffle_ps::<0x44>(a, c);
                u[4 * g + 1] = _mm256_shuffle_ps::<0xee>(a, c);
                u[4 * g + 2] = _mm256_shuffle_ps::<0x44>(b, d);
                u[4 * g + 3] = _mm256_shuffle_ps::<0xee>(b, d);
            }
            let mut lanes = [_mm256_setzero_ps(); 8];
            for m in 0..4 {
                lanes[m] = _mm256_permute2f128_ps::<0x20>(u[m], u[4 + m]);
                lanes[4 + m] = _mm256_permute2f128_ps::<0x31>(u[m], u[4 + m]);
            }
            lanes
        }
    }
    // SAFETY: every load is inside `q` or one of the 8 rows of `keys`; AVX2 by contract
    unsafe {
        let (mut lo, mut hi) = ([_mm256_setzero_ps(); 8], [_mm256_setzero_ps(); 8]);
        for j in 0..8 {
            let key = keys.as_ptr().add(j * hd);
            for c in (0..full).step_by(16) {
                let (x0, x1) = (_mm256_loadu_ps(q.as_ptr().add(c)), _mm256_loadu_ps(q.as_ptr().add(c + 8)));
                let (y0, y1) = (_mm256_loadu_ps(key.add(c)), _mm256_loadu_ps(key.add(c + 8)));
                lo[j] = _mm256_fmadd_ps(x0, y0, lo[j]);
                hi[j] = _mm256_fmadd_ps(x1, y1, hi[j]);
            }
        }
        let (lo, hi) = (transpose(lo), transpose(hi));
        let mut sum = lo[0];
        for l in lo[1..].iter().chain(&hi) {
            sum = _mm256_add_ps(sum, *l);
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), sum);
        add_tails(&mut out, q, keys, full);
        out
    }
}

/// [`dot`] of `q` with each of the 16 rows of `keys`, bit for bit, on AVX-512: each key's 16
/// lane sums are `dot`'s (a fused multiply-add per 16 dimensions, in order), then the 16 keys' lane
/// vectors are transposed so that lane `l` of every key is one vector, and the keys' sums are
/// 15 vector adds in `dot`'s order (lane 0, then 1, …) — where `dot` adds each key's lanes in a
/// chain of shuffles and scalar adds, which was most of the attention's time.
///
/// # Safety
/// The CPU has AVX-512 F; `keys` holds 16 rows of `q.len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dots16_zmm(q: &[f32], keys: &[f32]) -> [f32; 16] {
    use std::arch::x86_64::*;
    let hd = q.len();
    let full = hd / 16 * 16;
    debug_assert!(keys.len() >= 16 * hd);
    // SAFETY: every load is inside `q` or one of the 16 rows of `keys`; AVX-512 F by contract
    unsafe {
        let mut r = [_mm512_setzero_ps(); 16];
        for (j, r) in r.iter_mut().enumerate() {
            let key = keys.as_ptr().add(j * hd);
            for c in (0..full).step_by(16) {
                let x = _mm512_loadu_ps(q.as_ptr().add(c));
                let y = _mm512_loadu_ps(key.add(c));
                // fused, as `dot`'s `mul_add`
                *r = _mm512_fmadd_ps(x, y, *r);
            }
        }
        // the transpose: t[l] holds lane l of keys 0..16, key j in lane j
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // u[4g + m], 128-bit block k: lane 4k + m of keys 4g..4g + 4
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            let pd = _mm512_castps_pd;
            let ps = _mm512_castpd_ps;
            u[4 * g] = ps(_mm512_unpacklo_pd(pd(a), pd(c)));
            u[4 * g + 1] = ps(_mm512_unpackhi_pd(pd(a), pd(c)));
            u[4 * g + 2] = ps(_mm512_unpacklo_pd(pd(b), pd(d)));
            u[4 * g + 3] = ps(_mm512_unpackhi_pd(pd(b), pd(d)));
        }
        let mut lanes = [_mm512_setzero_ps(); 16];
        for m in 0..4 {
            let (a, b, c, d) = (u[m], u[4 + m], u[8 + m], u[12 + m]);
            let v0 = _mm512_shuffle_f32x4::<0x88>(a, b);
            let v1 = _mm512_shuffle_f32x4::<0xdd>(a, b);
            let w0 = _mm512_shuffle_f32x4::<0x88>(c, d);
            let w1 = _mm512_shuffle_f32x4::<0xdd>(c, d);
            lanes[m] = _mm512_shuffle_f32x4::<0x88>(v0, w0);
            lanes[4 + m] = _mm512_shuffle_f32x4::<0x88>(v1, w1);
            lanes[8 + m] = _mm512_shuffle_f32x4::<0xdd>(v0, w0);
            lanes[12 + m] = _mm512_shuffle_f32x4::<0xdd>(v1, w1);
        }
        let mut sum = lanes[0];
        for l in &lanes[1..] {
            sum = _mm512_add_ps(sum, *l);
        }
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), sum);
        add_tails(&mut out, q, keys, full);
        out
    }
}

/// The loops, compiled for each vector width by [`attention_head_on`], the scores of each 16
/// keys by `S`.
#[inline(always)]
fn head_body<S: Scores>(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    (scale, cap): (f32, Option<f32>),
    hd: usize,
    w: &mut [f32],
    out: &mut [f32],
) {
    let g = q.len() / hd;
    let seen = keys.len() / hd;
    let w = &mut w[..g * seen];
    // scores: each block of 16 key rows read for the g queries, the keys left one at a time
    let blocked = seen / 16 * 16;
    for j0 in (0..blocked).step_by(16) {
        let block = &keys[j0 * hd..(j0 + 16) * hd];
        for (r, qr) in q.chunks_exact(hd).enumerate() {
            // SAFETY: `attention_head_on` picks `S` for the instructions this CPU has
            let d = unsafe { S::block(qr, block) };
            for (x, y) in w[r * seen + j0..][..16].iter_mut().zip(d) {
                *x = y * scale;
            }
        }
    }
    for (j, key) in keys.chunks_exact(hd).enumerate().skip(blocked) {
        for (r, qr) in q.chunks_exact(hd).enumerate() {
            w[r * seen + j] = dot(qr, key) * scale;
        }
    }
    soft_cap(w, cap);
    // weights, per query: the softmax of its scores
    for row in w.chunks_exact_mut(seen) {
        let max = max_of(row);
        // the exps in vectors (libm's `expf` is a scalar call), then summed in order
        for x in row.iter_mut() {
            *x = exp(*x - max);
        }
        let sum: f32 = row.iter().sum();
        let inv = 1.0 / sum;
        for x in row.iter_mut() {
            *x *= inv;
        }
    }
    // the weighted values: 64 dimensions of a query's output at a time, in registers over every
    // value row (each output the same sum, row after row, as one value row at a time gives)
    out.fill(0.0);
    let wide = hd / 64 * 64;
    for (r, o) in out.chunks_exact_mut(hd).enumerate() {
        let wr = &w[r * seen..][..seen];
        for d0 in (0..wide).step_by(64) {
            let mut acc = [0f32; 64];
            for (&wj, value) in wr.iter().zip(values.chunks_exact(hd)) {
                for (a, x) in acc.iter_mut().zip(&value[d0..d0 + 64]) {
                    *a = wj.mul_add(*x, *a);
                }
            }
            o[d0..d0 + 64].copy_from_slice(&acc);
        }
        for (&wj, value) in wr.iter().zip(values.chunks_exact(hd)) {
            for (o, x) in o[wide..].iter_mut().zip(&value[wide..]) {
                *o = wj.mul_add(*x, *o);
            }
        }
    }
}

/// The largest of `xs` (−∞ for none), in 16 lanes and then across them: a maximum does not
/// depend on the order it is taken in (but for NaNs, which no score is, and the sign of a zero,
/// which `x − max` does not see), so this is the chain of one lane at a time's value without
/// its chain of dependent instructions.
#[inline(always)]
fn max_of(xs: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let chunks = xs.chunks_exact(16);
    let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for l in 0..16 {
            m[l] = m[l].max(c[l]);
        }
    }
    m.iter().copied().fold(tail, f32::max)
}

/// `Σ a·b` in 16 lanes (what one zmm or two ymm registers hold), each product added fused
/// (`mul_add`: one rounding, one instruction where the CPU has FMA), then the lanes added.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gated_rows` (a new vector, not zeroed) gives each row the bits of `silu_mul_on` /
    /// `gelu_mul_on` into a zeroed one, at every width, for rows taken at strided offsets, below
    /// and above the size it computes on the pool from; a short row is refused before anything.
    #[test]
    fn gated_rows_are_the_gated_products_bit_for_bit() {
        let data: Vec<f32> = (0..300_000usize).map(|i| ((i * 7919 % 20011) as f32 - 10005.0) / 2000.0).collect();
        for w in Width::available() {
            for (rows, cols) in [(3usize, 40usize), (70, 1100)] {
                for gelu in [false, true] {
                    // row r's gate at 2r·cols + 5, its up right after it (as two halves of one tensor)
                    let at = |r: usize| 2 * r * cols + 5;
                    let got = gated_rows(w, gelu, rows, cols, |r| (&data[at(r)..], &data[at(r) + cols..]));
                    assert_eq!(got.len(), rows * cols);
                    let on = if gelu { gelu_mul_on } else { silu_mul_on };
                    for r in 0..rows {
                        let mut want = vec![0f32; cols];
                        on(w, &data[at(r)..][..cols], &data[at(r) + cols..][..cols], &mut want);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got[r * cols..][..cols]), bits(&want), "{w:?} gelu {gelu} row {r} of {rows}");
                    }
                }
            }
        }
        let short =
            std::panic::catch_unwind(|| gated_rows(Width::detect(), false, 2, 10, |r| (&data[..10 + r], &data[..5])));
        assert!(short.is_err());
    }

    /// The attention of one kv head with every score from [`dot`] one key at a time (the loops
    /// before the scores were blocked by 16 keys).
    fn head_one_key_at_a_time(q: &[f32], keys: &[f32], values: &[f32], hd: usize, out: &mut [f32]) {
        let (g, seen) = (q.len() / hd, keys.len() / hd);
        let mut w = vec![0f32; g * seen];
        for (j, key) in keys.chunks_exact(hd).enumerate() {
            for (r, qr) in q.chunks_exact(hd).enumerate() {
                w[r * seen + j] = dot(qr, key) * 0.125;
            }
        }
        for row in w.chunks_exact_mut(seen) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for x in row.iter_mut() {
                *x = exp(*x - max);
            }
            let inv = 1.0 / row.iter().sum::<f32>();
            row.iter_mut().for_each(|x| *x *= inv);
        }
        out.fill(0.0);
        for (j, value) in values.chunks_exact(hd).enumerate() {
            for (r, o) in out.chunks_exact_mut(hd).enumerate() {
                for (o, x) in o.iter_mut().zip(value) {
                    *o = w[r * seen + j].mul_add(*x, *o);
                }
            }
        }
    }

    /// Scores blocked by 16 keys are `dot`'s bit for bit, at every width, for head sizes with
    /// and without a tail past the last 16 and key counts around the blocks.
    #[test]
    fn blocked_scores_are_dots_bit_for_bit() {
        let mut x = 0x9e37_79b9u32;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32 - 0.5) * 4.0
        };
        for (hd, g) in [(64, 3), (72, 2), (128, 4), (256, 1), (8, 2)] {
            for seen in [1, 15, 16, 17, 33, 100] {
                let q: Vec<f32> = (0..g * hd).map(|_| rnd()).collect();
                let keys: Vec<f32> = (0..seen * hd).map(|_| rnd()).collect();
                let values: Vec<f32> = (0..seen * hd).map(|_| rnd()).collect();
                let mut want = vec![0f32; g * hd];
                head_one_key_at_a_time(&q, &keys, &values, hd, &mut want);
                for w in Width::available() {
                    let (mut got, mut scratch) = (vec![0f32; g * hd], vec![0f32; g * seen]);
                    attention_head_on(w, &q, &keys, &values, (0.125, None), hd, &mut scratch, &mut got);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{w:?}, head size {hd}, {seen} keys: {got:?} against {want:?}");
                }
            }
        }
    }

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
        use crate::matmul::Isa;
        assert_eq!(capped(W::Avx512, Isa::Avx512Vnni), W::Avx512);
        assert_eq!(capped(W::Avx512, Isa::Avx2), W::Avx2);
        assert_eq!(capped(W::Avx512, Isa::AvxVnni), W::Avx2);
        assert_eq!(capped(W::Avx2, Isa::AvxVnni), W::Avx2);
        assert_eq!(capped(W::Avx512, Isa::Portable), W::Scalar);
        assert_eq!(capped(W::Scalar, Isa::Portable), W::Scalar);
    }
}
