//! brigade's CPU matrix multiply by a ggml weight (quantized, f16, bf16 or f32), as a candle
//! custom op.
//!
//! Why not candle's own `QTensor` op: on x86 it keeps a second, repacked copy of Q4_K weights
//! (and of Q6_K/Q8_0 where it repacks) for every matmul, so a model takes up to 2.3× its file size
//! in memory and a decode step reads 6 bits per Q4_K weight instead of 4.5. Here:
//! - decode (a few rows): candle's `k_quants::matmul` on the weight's own blocks — the same
//!   vec-dot kernels without the copy (measured 1.37× faster per Q4_K matvec on this project's
//!   2-core machines);
//! - prompts (more rows): the weight is dequantized a band of rows at a time into a reused
//!   scratch buffer and multiplied with the `gemm` crate, so every type is batched and memory
//!   stays at the file's size plus one band;
//! - Q4_1 (candle has only a scalar dot product) and Q8_0 (candle's is slow on AVX2) get the
//!   kernels in [`avx2`].

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0,
    BlockQ8_1, GgmlType,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, Layout, Shape};
use rayon::prelude::*;
use std::sync::Arc;

/// Rows of activations up to which a matmul runs as vec-dots over the quantized blocks.
pub const DECODE_ROWS: usize = 4;
/// Elements of dequantized weight per band (16 MiB of f32).
const BAND_ELEMS: usize = 4 << 20;

/// `x @ wᵀ` for a weight `w: [n, k]` held as ggml blocks on the CPU.
pub struct CpuMatMul(pub Arc<QTensor>);

macro_rules! with_block {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            GgmlDType::F32 => {
                type $T = f32;
                $body
            }
            GgmlDType::F16 => {
                type $T = half::f16;
                $body
            }
            GgmlDType::BF16 => {
                type $T = half::bf16;
                $body
            }
            GgmlDType::Q4_0 => {
                type $T = BlockQ4_0;
                $body
            }
            GgmlDType::Q4_1 => {
                type $T = BlockQ4_1;
                $body
            }
            GgmlDType::Q5_0 => {
                type $T = BlockQ5_0;
                $body
            }
            GgmlDType::Q5_1 => {
                type $T = BlockQ5_1;
                $body
            }
            GgmlDType::Q8_0 => {
                type $T = BlockQ8_0;
                $body
            }
            GgmlDType::Q8_1 => {
                type $T = BlockQ8_1;
                $body
            }
            GgmlDType::Q2K => {
                type $T = BlockQ2K;
                $body
            }
            GgmlDType::Q3K => {
                type $T = BlockQ3K;
                $body
            }
            GgmlDType::Q4K => {
                type $T = BlockQ4K;
                $body
            }
            GgmlDType::Q5K => {
                type $T = BlockQ5K;
                $body
            }
            GgmlDType::Q6K => {
                type $T = BlockQ6K;
                $body
            }
            GgmlDType::Q8K => {
                type $T = BlockQ8K;
                $body
            }
        }
    };
}

/// The weight's blocks as a typed slice (candle keeps CPU storage as a `Vec` of blocks, so the
/// bytes are aligned and whole).
fn blocks<T>(bytes: &[u8]) -> candle_core::Result<&[T]> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        candle_core::bail!("weight storage of {} bytes is not whole aligned blocks of {size}", bytes.len());
    }
    // SAFETY: length and alignment checked; the ggml block types are plain old data.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) })
}

thread_local! {
    static BAND: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `dst[m, n] = lhs[m, k] @ dequant(w)[n, k]ᵀ`, a band of weight rows at a time.
fn dequant_gemm<T: GgmlType>(w: &[T], (m, k, n): (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
    let bpr = k / T::BLCK_SIZE;
    let band_rows = (BAND_ELEMS / k).clamp(1, n);
    let threads = candle_core::utils::get_num_threads();
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    BAND.with(|b| {
        let mut band = b.borrow_mut();
        if band.len() < band_rows * k {
            band.resize(band_rows * k, 0.0);
        }
        let mut r0 = 0;
        while r0 < n {
            let rows = band_rows.min(n - r0);
            band[..rows * k].par_chunks_mut(k).enumerate().for_each(|(i, row)| {
                let r = r0 + i;
                T::to_float(&w[r * bpr..(r + 1) * bpr], row);
            });
            // SAFETY: dst is m × n row-major; this writes columns r0..r0+rows of every row.
            // lhs is m × k row-major; the band is rows × k row-major, read as its transpose.
            unsafe {
                gemm::gemm(
                    m,
                    rows,
                    k,
                    dst.as_mut_ptr().add(r0),
                    1,
                    n as isize,
                    false,
                    lhs.as_ptr(),
                    1,
                    k as isize,
                    band.as_ptr(),
                    k as isize,
                    1,
                    0.0f32,
                    1.0f32,
                    false,
                    false,
                    false,
                    par,
                );
            }
            r0 += rows;
        }
    });
}

impl candle_core::CustomOp1 for CpuMatMul {
    fn name(&self) -> &'static str {
        "brigade-cpu-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, k) = self.0.shape().dims2()?;
        let dims = layout.shape().dims();
        let Some((&lk, batch)) = dims.split_last() else { candle_core::bail!("matmul input has no dimensions") };
        if lk != k {
            candle_core::bail!("matmul input {dims:?} does not match weight ({n}, {k})");
        }
        let m: usize = batch.iter().product();
        let (o1, o2) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("matmul input must be contiguous".into()))?;
        let lhs = &storage.as_slice::<f32>()?[o1..o2];
        let mut dst = vec![0f32; m * n];
        let data = self.0.data()?;
        let dt = self.0.dtype();
        match Kernel::choose(dt, m) {
            Kernel::Q4_1Avx2 => avx2::matmul_q4_1(blocks::<avx2::Q4_1>(&data)?, (m, k, n), lhs, &mut dst),
            Kernel::Q8_0Avx2 => avx2::matmul_q8_0(blocks::<avx2::Q8_0>(&data)?, (m, k, n), lhs, &mut dst),
            Kernel::CandleVecDot => {
                with_block!(dt, T => candle_core::quantized::k_quants::matmul::<T>((m, k, n), lhs, blocks::<T>(&data)?, &mut dst)?)
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Q8_0Tiles => avx2::matmul_q8_0_prompt(blocks::<avx2::Q8_0>(&data)?, (m, k, n), lhs, &mut dst),
            #[cfg(target_arch = "x86_64")]
            Kernel::Q4KTiles => avx2::matmul_q4k_prompt(blocks::<avx2::Q4K>(&data)?, (m, k, n), lhs, &mut dst),
            Kernel::DequantGemm => {
                with_block!(dt, T => dequant_gemm::<T>(blocks::<T>(&data)?, (m, k, n), lhs, &mut dst))
            }
        }
        let mut out = batch.to_vec();
        out.push(n);
        Ok((CpuStorage::F32(dst), Shape::from(out)))
    }
}

/// The CPU kernel for one matmul: chosen by [`Kernel::choose`] for the op and for reports alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Q4_1Avx2,
    Q8_0Avx2,
    CandleVecDot,
    #[cfg(target_arch = "x86_64")]
    Q8_0Tiles,
    #[cfg(target_arch = "x86_64")]
    Q4KTiles,
    DequantGemm,
}

impl Kernel {
    /// The kernel for `m` activation rows times a weight of type `dt`.
    fn choose(dt: GgmlDType, m: usize) -> Kernel {
        let avx2 = avx2::available();
        match (m <= DECODE_ROWS, dt) {
            (true, GgmlDType::Q4_1) if avx2 => Kernel::Q4_1Avx2,
            (true, GgmlDType::Q8_0) if avx2 => Kernel::Q8_0Avx2,
            (true, _) => Kernel::CandleVecDot,
            #[cfg(target_arch = "x86_64")]
            (false, GgmlDType::Q8_0) if avx2 => Kernel::Q8_0Tiles,
            #[cfg(target_arch = "x86_64")]
            (false, GgmlDType::Q4K) if avx2 => Kernel::Q4KTiles,
            (false, _) => Kernel::DequantGemm,
        }
    }

    fn describe(self, dt: GgmlDType) -> &'static str {
        let float = matches!(dt, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        match self {
            Kernel::Q4_1Avx2 | Kernel::Q8_0Avx2 => "brigade AVX2 int8 vec-dot",
            Kernel::CandleVecDot if float => "candle vec-dot (float)",
            Kernel::CandleVecDot => "candle int8 vec-dot",
            #[cfg(target_arch = "x86_64")]
            Kernel::Q8_0Tiles => "brigade AVX2 int8 4x2 tiles",
            #[cfg(target_arch = "x86_64")]
            Kernel::Q4KTiles => "brigade AVX2 int8 4x1 tiles (Q8_K activations)",
            Kernel::DequantGemm if float => "f32 band + gemm",
            Kernel::DequantGemm => "dequantize band + f32 gemm",
        }
    }
}

/// Which kernels the CPU runs for a weight type: (decode, prompt), for reports.
pub fn kernels(dt: GgmlDType) -> (&'static str, &'static str) {
    (Kernel::choose(dt, 1).describe(dt), Kernel::choose(dt, DECODE_ROWS + 1).describe(dt))
}

/// AVX2 vec-dot kernels for the types where candle's are slow on AVX2-only CPUs: Q4_1 (candle
/// has only scalar code) and Q8_0 (measured 0.64× llama.cpp's decode). The block fields of
/// candle's types are private, hence the mirrored layouts (ggml's, checked by size).
pub mod avx2 {
    use half::f16;

    /// ggml's `block_q4_1`: 32 weights `d × q + m`, `q` in 0..16 as nibbles (low halves first).
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct Q4_1 {
        pub d: f16,
        pub m: f16,
        pub qs: [u8; 16],
    }
    const _: () = assert!(std::mem::size_of::<Q4_1>() == 20);

    /// ggml's `block_q8_0`: 32 values `d × q`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct Q8_0 {
        pub d: f16,
        pub qs: [i8; 32],
    }
    const _: () = assert!(std::mem::size_of::<Q8_0>() == 34);

    /// ggml's `block_q8_1`: 32 activations `d × q`, with `s = d × Σq`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct Q8_1 {
        pub d: f16,
        pub s: f16,
        pub qs: [i8; 32],
    }

    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Quantizes 32 activations to 8 bits as ggml does; returns (scale, Σq).
    fn quantize_block(blk: &[f32], qs: &mut [i8; 32]) -> (f32, i32) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in qs.iter_mut().zip(blk) {
            let r = (v * id).round() as i32;
            *q = r as i8;
            sum += r;
        }
        (d, sum)
    }

    pub fn quantize_q8_1(x: &[f32], out: &mut [Q8_1]) {
        for (blk, o) in x.chunks_exact(32).zip(out.iter_mut()) {
            let (d, sum) = quantize_block(blk, &mut o.qs);
            o.d = f16::from_f32(d);
            o.s = f16::from_f32(d * sum as f32);
        }
    }

    pub fn quantize_q8_0(x: &[f32], out: &mut [Q8_0]) {
        for (blk, o) in x.chunks_exact(32).zip(out.iter_mut()) {
            let (d, _) = quantize_block(blk, &mut o.qs);
            o.d = f16::from_f32(d);
        }
    }

    /// Q4_1 · Q8_1, portable (the reference for the SIMD one).
    pub fn dot_q4_1_scalar(w: &[Q4_1], x: &[Q8_1]) -> f32 {
        let mut acc = 0f32;
        for (b, y) in w.iter().zip(x) {
            let mut s = 0i32;
            for j in 0..16 {
                s += (b.qs[j] & 0x0F) as i32 * y.qs[j] as i32 + (b.qs[j] >> 4) as i32 * y.qs[j + 16] as i32;
            }
            acc += b.d.to_f32() * y.d.to_f32() * s as f32 + b.m.to_f32() * y.s.to_f32();
        }
        acc
    }

    /// Q8_0 · Q8_0, portable.
    pub fn dot_q8_0_scalar(w: &[Q8_0], x: &[Q8_0]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, y)| {
                b.d.to_f32()
                    * y.d.to_f32()
                    * b.qs.iter().zip(&y.qs).map(|(&p, &q)| p as i32 * q as i32).sum::<i32>() as f32
            })
            .sum()
    }

    /// One f16 broadcast to eight f32 lanes by the F16C instruction, inlined. `half`'s conversion
    /// is an out-of-line call that made the compiler spill the accumulator every block, and a
    /// scalar `cvtph2ps` of `_mm_cvtsi32_si128` compiled to a `vpinsrw` that merged into the
    /// accumulator's register, a false dependency chaining every block to the last one's FMA
    /// (together: 0.6× llama.cpp's Q8_0 decode). A broadcast from a general register has neither.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn splat(x: f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_set1_epi16(x.to_bits() as i16))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(acc: std::arch::x86_64::__m256) -> f32 {
        use std::arch::x86_64::*;
        let hi = _mm256_extractf128_ps(acc, 1);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(acc), hi);
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q4_1(w: &[Q4_1], x: &[Q8_1]) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = _mm256_setzero_ps();
        let mut summs = _mm256_setzero_ps();
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        for (b, y) in w.iter().zip(x) {
            // low nibbles are weights 0..16, high nibbles 16..32
            // SAFETY: 16 and 32 bytes inside the blocks
            let (q, xq) = unsafe {
                (_mm_loadu_si128(b.qs.as_ptr() as *const __m128i), _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i))
            };
            let wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low);
            // u8 × i8 pairs → i16 (at most 2 × 15 × 128: no saturation), pairs → i32
            let p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones);
            acc = _mm256_fmadd_ps(_mm256_mul_ps(splat(b.d), splat(y.d)), _mm256_cvtepi32_ps(p32), acc);
            summs = _mm256_fmadd_ps(splat(b.m), splat(y.s), summs);
        }
        // every lane of `summs` holds the same sum
        hsum(acc) + _mm256_cvtss_f32(summs)
    }

    /// How far ahead of the block in use `dot_q8_0` asks for weight bytes: 1 KiB (30 blocks) was
    /// the best of 512/1024/2048 in `brigade bench` on the 2-core VM, though within its noise.
    #[cfg(target_arch = "x86_64")]
    const PREFETCH: usize = 1024;

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8_0(w: &[Q8_0], x: &[Q8_0]) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = _mm256_setzero_ps();
        let ones = _mm256_set1_epi16(1);
        for (b, y) in w.iter().zip(x) {
            _mm_prefetch::<_MM_HINT_T0>((b as *const Q8_0 as *const i8).wrapping_add(PREFETCH));
            // SAFETY: 32 bytes inside each block
            let (wq, xq) = unsafe {
                (
                    _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i),
                    _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i),
                )
            };
            // maddubs wants u8 × i8: |w| × (x with w's sign); at most 2 × 128 × 127, no saturation
            let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
            let p32 = _mm256_madd_epi16(p16, ones);
            acc = _mm256_fmadd_ps(_mm256_mul_ps(splat(b.d), splat(y.d)), _mm256_cvtepi32_ps(p32), acc);
        }
        hsum(acc)
    }

    /// `dst[m, n] = Σ dot(w row c, x row r)`: weight rows split across candle's thread pool.
    fn matvec<W: Sync, X: Sync>(
        w: &[W],
        xq: &[X],
        bpr: usize,
        (m, n): (usize, usize),
        dst: &mut [f32],
        dot: impl Fn(&[W], &[X]) -> f32 + Sync,
    ) {
        let dst_ptr = dst.as_mut_ptr() as usize;
        candle_core::utils::barrier_pool().execute_chunked(n, |cols| {
            for c in cols {
                let wr = &w[c * bpr..(c + 1) * bpr];
                for r in 0..m {
                    let v = dot(wr, &xq[r * bpr..(r + 1) * bpr]);
                    // SAFETY: each (r, c) is written by exactly one work item.
                    unsafe { *(dst_ptr as *mut f32).add(r * n + c) = v };
                }
            }
        });
    }

    /// Quantizes each of the `m` activation rows of length `k` into blocks of 32.
    fn quantize_rows<X: Clone>(lhs: &[f32], (m, k): (usize, usize), zero: X, quantize: fn(&[f32], &mut [X])) -> Vec<X> {
        let bpr = k / 32;
        let mut xq = vec![zero; m * bpr];
        for r in 0..m {
            quantize(&lhs[r * k..(r + 1) * k], &mut xq[r * bpr..(r + 1) * bpr]);
        }
        xq
    }

    /// `dst[m, n] = lhs[m, k] @ w[n, k]ᵀ` for Q4_1 weights (callers check [`available`]).
    pub fn matmul_q4_1(w: &[Q4_1], (m, k, n): (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
        let bpr = k / 32;
        let xq = quantize_rows(lhs, (m, k), Q8_1 { d: f16::ZERO, s: f16::ZERO, qs: [0; 32] }, quantize_q8_1);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers check `available()` (AVX2 + FMA + F16C).
        matvec(w, &xq, bpr, (m, n), dst, |a, b| unsafe { dot_q4_1(a, b) });
        #[cfg(not(target_arch = "x86_64"))]
        matvec(w, &xq, bpr, (m, n), dst, dot_q4_1_scalar);
    }

    /// `dst[m, n] = lhs[m, k] @ w[n, k]ᵀ` for Q8_0 weights (callers check [`available`]).
    pub fn matmul_q8_0(w: &[Q8_0], (m, k, n): (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
        let bpr = k / 32;
        let xq = quantize_rows(lhs, (m, k), Q8_0 { d: f16::ZERO, qs: [0; 32] }, quantize_q8_0);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers check `available()` (AVX2 + FMA + F16C).
        matvec(w, &xq, bpr, (m, n), dst, |a, b| unsafe { dot_q8_0(a, b) });
        #[cfg(not(target_arch = "x86_64"))]
        matvec(w, &xq, bpr, (m, n), dst, dot_q8_0_scalar);
    }

    /// Activation rows a prompt tile group holds in cache while every weight row passes over
    /// them (64 rows of k = 2048 are 139 KB of Q8_0 blocks).
    #[cfg(target_arch = "x86_64")]
    const PROMPT_ROWS: usize = 64;

    /// `R` activation rows × `C` weight rows of Q8_0 int8 dot products, accumulated in
    /// registers over all of `k` (each weight block loaded once for `R` rows, each activation
    /// block once for `C`). Returns `out[i][j] = x row r0+i · w row c0+j`.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `w` holds rows `c0..c0+C` and `xq`/`dx` rows `r0..r0+R` of `bpr`
    /// blocks each.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q8_0<const R: usize, const C: usize>(
        w: &[Q8_0],
        xq: &[Q8_0],
        dx: &[f32],
        bpr: usize,
        (r0, c0): (usize, usize),
    ) -> [[f32; C]; R] {
        use std::arch::x86_64::*;
        debug_assert!((c0 + C) * bpr <= w.len() && (r0 + R) * bpr <= xq.len() && xq.len() == dx.len());
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for b in 0..bpr {
            let mut wq = [_mm256_setzero_si256(); C];
            let mut dw = [_mm256_setzero_ps(); C];
            for j in 0..C {
                // SAFETY: in bounds by the function's contract
                let blk = unsafe { w.get_unchecked((c0 + j) * bpr + b) };
                wq[j] = unsafe { _mm256_loadu_si256(blk.qs.as_ptr() as *const __m256i) };
                dw[j] = splat(blk.d);
            }
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let at = (r0 + i) * bpr + b;
                // SAFETY: in bounds by the function's contract
                let (xv, d) = unsafe {
                    (_mm256_loadu_si256(xq.get_unchecked(at).qs.as_ptr() as *const __m256i), *dx.get_unchecked(at))
                };
                let dv = _mm256_set1_ps(d);
                // |x| × (w with x's sign): the absolute value taken once per activation block
                let xa = _mm256_sign_epi8(xv, xv);
                for (a, (&wj, &dj)) in acc_i.iter_mut().zip(wq.iter().zip(&dw)) {
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(wj, xv)), ones);
                    *a = _mm256_fmadd_ps(_mm256_mul_ps(dj, dv), _mm256_cvtepi32_ps(p), *a);
                }
            }
        }
        let mut out = [[0f32; C]; R];
        for i in 0..R {
            for j in 0..C {
                out[i][j] = hsum(acc[i][j]);
            }
        }
        out
    }

    /// `dst[m, n] = lhs[m, k] @ w[n, k]ᵀ` for Q8_0 weights and prompts: the activations quantized
    /// to Q8_0 as llama.cpp does, then int8 dot products in 4 × 2 register tiles (32
    /// multiply-adds per `maddubs` against 8 per f32 FMA). On llama-1b Q8_0, 2 threads: pp128
    /// 1.3× the dequantize + f32 gemm path, pp512 equal (measured in one run each). Callers
    /// check [`available`].
    #[cfg(target_arch = "x86_64")]
    pub fn matmul_q8_0_prompt(w: &[Q8_0], (m, k, n): (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
        let bpr = k / 32;
        assert!(w.len() >= n * bpr && lhs.len() >= m * k && dst.len() >= m * n, "matmul_q8_0_prompt sizes");
        let xq = quantize_rows(lhs, (m, k), Q8_0 { d: f16::ZERO, qs: [0; 32] }, quantize_q8_0);
        let dx: Vec<f32> = xq.iter().map(|b| b.d.to_f32()).collect();
        macro_rules! tile {
            ($r:literal, $c:literal, $r0:expr, $c0:expr) => {
                // SAFETY: available() checked by the caller; the driver passes rows in bounds
                flat(unsafe { tile_q8_0::<$r, $c>(w, &xq, &dx, bpr, ($r0, $c0)) })
            };
        }
        drive_tiles((m, n), (4, 2), dst, |r0, rows, c0, cols| match (rows, cols) {
            (4, 2) => tile!(4, 2, r0, c0),
            (3, 2) => tile!(3, 2, r0, c0),
            (2, 2) => tile!(2, 2, r0, c0),
            (1, 2) => tile!(1, 2, r0, c0),
            (4, _) => tile!(4, 1, r0, c0),
            (3, _) => tile!(3, 1, r0, c0),
            (2, _) => tile!(2, 1, r0, c0),
            _ => tile!(1, 1, r0, c0),
        });
    }

    /// The most outputs one tile computes.
    #[cfg(target_arch = "x86_64")]
    const TILE_MAX: usize = 8;

    /// A tile's `R × C` results, row-major, in a fixed array (no allocation per tile).
    #[cfg(target_arch = "x86_64")]
    fn flat<const R: usize, const C: usize>(t: [[f32; C]; R]) -> [f32; TILE_MAX] {
        let mut out = [0f32; TILE_MAX];
        for (i, row) in t.iter().enumerate() {
            out[i * C..(i + 1) * C].copy_from_slice(row);
        }
        out
    }

    /// Runs `tile(r0, rows, c0, cols) -> out[rows × cols]` over the `m × n` output: activation
    /// rows in groups of [`PROMPT_ROWS`] (kept in cache), weight rows split across candle's pool,
    /// tiles of up to `tr × tc`.
    #[cfg(target_arch = "x86_64")]
    fn drive_tiles(
        (m, n): (usize, usize),
        (tr, tc): (usize, usize),
        dst: &mut [f32],
        tile: impl Fn(usize, usize, usize, usize) -> [f32; TILE_MAX] + Sync,
    ) {
        assert!(dst.len() >= m * n);
        let dst_ptr = dst.as_mut_ptr() as usize;
        for g0 in (0..m).step_by(PROMPT_ROWS) {
            let g1 = (g0 + PROMPT_ROWS).min(m);
            candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(tc), |groups| {
                for g in groups {
                    let c0 = g * tc;
                    let cols = (n - c0).min(tc);
                    let mut r0 = g0;
                    while r0 < g1 {
                        let rows = (g1 - r0).min(tr);
                        let out = tile(r0, rows, c0, cols);
                        for i in 0..rows {
                            for j in 0..cols {
                                // SAFETY: (r0 + i, c0 + j) is inside dst and written by this item only
                                unsafe { *(dst_ptr as *mut f32).add((r0 + i) * n + c0 + j) = out[i * cols + j] };
                            }
                        }
                        r0 += rows;
                    }
                }
            });
        }
    }

    /// ggml's `block_q4_K`: 256 weights in 8 sub-blocks of 32, weight = `d·sc·q − dmin·m` with
    /// 6-bit `sc`, `m` per sub-block packed in `scales` and 4-bit `q`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct Q4K {
        pub d: f16,
        pub dmin: f16,
        pub scales: [u8; 12],
        pub qs: [u8; 128],
    }
    const _: () = assert!(std::mem::size_of::<Q4K>() == 144);

    impl Q4K {
        /// (scale, min) of sub-block `j` (ggml's `get_scale_min_k4`).
        pub fn scale_min(&self, j: usize) -> (u8, u8) {
            let q = &self.scales;
            if j < 4 {
                (q[j] & 63, q[j + 4] & 63)
            } else {
                ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
            }
        }
    }

    /// Activations for Q4_K: one scale per 256 (ggml's Q8_K), so that a super-block's eight
    /// sub-block sums combine in integers.
    #[derive(Clone, Copy)]
    pub struct Q8K {
        pub d: f32,
        pub qs: [i8; 256],
    }

    /// `R` activation rows × `C` Q4_K weight rows: per super-block, Σ_j sc_j · (q · x)_j in
    /// int32 lanes (`maddubs` of the unsigned nibbles, `madd` by the broadcast scale), then one
    /// FMA by `d · dx`. The mins are left to the caller.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `w` holds rows `c0..c0+C`, `xq` rows `r0..r0+R` of `bpr`
    /// super-blocks each, `sc` `8 × bpr` scales per weight row.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q4k<const R: usize, const C: usize>(
        w: &[Q4K],
        xq: &[Q8K],
        sc: &[u8],
        bpr: usize,
        (r0, c0): (usize, usize),
    ) -> [[f32; C]; R] {
        use std::arch::x86_64::*;
        debug_assert!((c0 + C) * bpr <= w.len() && (r0 + R) * bpr <= xq.len() && sc.len() >= w.len() * 8);
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for b in 0..bpr {
            let mut isum = [[_mm256_setzero_si256(); C]; R];
            for h in 0..4 {
                let mut lo = [_mm256_setzero_si256(); C];
                let mut hi = [_mm256_setzero_si256(); C];
                let mut s1 = [_mm256_setzero_si256(); C];
                let mut s2 = [_mm256_setzero_si256(); C];
                for j in 0..C {
                    let at = (c0 + j) * bpr + b;
                    // SAFETY: in bounds by the function's contract
                    let (q, (a, z)) = unsafe {
                        (
                            _mm256_loadu_si256(w.get_unchecked(at).qs.as_ptr().add(32 * h) as *const __m256i),
                            (*sc.get_unchecked(at * 8 + 2 * h), *sc.get_unchecked(at * 8 + 2 * h + 1)),
                        )
                    };
                    lo[j] = _mm256_and_si256(q, low);
                    hi[j] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                    s1[j] = _mm256_set1_epi16(a as i16);
                    s2[j] = _mm256_set1_epi16(z as i16);
                }
                for (i, isum_i) in isum.iter_mut().enumerate() {
                    // SAFETY: in bounds by the function's contract
                    let (x1, x2) = unsafe {
                        let x = xq.get_unchecked((r0 + i) * bpr + b).qs.as_ptr().add(64 * h);
                        (_mm256_loadu_si256(x as *const __m256i), _mm256_loadu_si256(x.add(32) as *const __m256i))
                    };
                    for (j, t) in isum_i.iter_mut().enumerate() {
                        // nibble × i8 pairs ≤ 2·15·127, × scale ≤ 63 in pairs: no overflow
                        let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[j], x1), s1[j]);
                        let p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[j], x2), s2[j]);
                        *t = _mm256_add_epi32(*t, _mm256_add_epi32(p1, p2));
                    }
                }
            }
            for (i, (acc_i, isum_i)) in acc.iter_mut().zip(&isum).enumerate() {
                // SAFETY: in bounds by the function's contract
                let dx = unsafe { xq.get_unchecked((r0 + i) * bpr + b).d };
                for (j, (a, t)) in acc_i.iter_mut().zip(isum_i).enumerate() {
                    // SAFETY: in bounds by the function's contract
                    let d = splat(unsafe { w.get_unchecked((c0 + j) * bpr + b).d });
                    *a = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(*t), *a);
                }
            }
        }
        let mut out = [[0f32; C]; R];
        for (o, a) in out.iter_mut().zip(&acc) {
            for (v, x) in o.iter_mut().zip(a) {
                *v = hsum(*x);
            }
        }
        out
    }

    /// `dst[m, n] = lhs[m, k] @ w[n, k]ᵀ` for Q4_K weights and prompts, as llama.cpp computes
    /// it: activations quantized per 256 (Q8_K), the scaled nibble products in int8 tiles
    /// ([`tile_q4k`]), and the mins' term `Σ dmin·m_j · dx·Σx_j` as a small f32 gemm over the
    /// `k / 32` sub-block sums, subtracted. Callers check [`available`].
    #[cfg(target_arch = "x86_64")]
    pub fn matmul_q4k_prompt(w: &[Q4K], (m, k, n): (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
        let bpr = k / 256;
        let kk = k / 32;
        assert!(w.len() >= n * bpr && lhs.len() >= m * k && dst.len() >= m * n, "matmul_q4k_prompt sizes");
        // activations: Q8_K blocks and d·Σq per sub-block
        let mut xq = vec![Q8K { d: 0.0, qs: [0; 256] }; m * bpr];
        let mut xs = vec![0f32; m * kk];
        for ((x, q), sums) in lhs.chunks_exact(256).zip(xq.iter_mut()).zip(xs.chunks_exact_mut(8)) {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            q.d = amax / 127.0;
            let id = if q.d > 0.0 { 1.0 / q.d } else { 0.0 };
            for (sub, (qq, xx)) in q.qs.chunks_exact_mut(32).zip(x.chunks_exact(32)).enumerate() {
                let mut sum = 0i32;
                for (o, v) in qq.iter_mut().zip(xx) {
                    let r = (v * id).round() as i32;
                    *o = r as i8;
                    sum += r;
                }
                sums[sub] = q.d * sum as f32;
            }
        }
        // weights: the scales unpacked, and dmin·m per sub-block
        let mut sc = vec![0u8; n * bpr * 8];
        let mut mins = vec![0f32; n * kk];
        for ((blk, s8), m8) in w[..n * bpr].iter().zip(sc.chunks_exact_mut(8)).zip(mins.chunks_exact_mut(8)) {
            let dmin = blk.dmin.to_f32();
            for j in 0..8 {
                let (a, z) = blk.scale_min(j);
                s8[j] = a;
                m8[j] = dmin * z as f32;
            }
        }
        macro_rules! tile {
            ($r:literal, $c:literal, $r0:expr, $c0:expr) => {
                // SAFETY: available() checked by the caller; the driver passes rows in bounds
                flat(unsafe { tile_q4k::<$r, $c>(w, &xq, &sc, bpr, ($r0, $c0)) })
            };
        }
        drive_tiles((m, n), (4, 1), dst, |r0, rows, c0, _| match rows {
            4 => tile!(4, 1, r0, c0),
            3 => tile!(3, 1, r0, c0),
            2 => tile!(2, 1, r0, c0),
            _ => tile!(1, 1, r0, c0),
        });
        let threads = candle_core::utils::get_num_threads();
        let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
        // SAFETY: dst is m × n row-major, xs m × kk row-major, mins n × kk read as its transpose
        unsafe {
            gemm::gemm(
                m,
                n,
                kk,
                dst.as_mut_ptr(),
                1,
                n as isize,
                true,
                xs.as_ptr(),
                1,
                kk as isize,
                mins.as_ptr(),
                kk as isize,
                1,
                1.0f32,
                -1.0f32,
                false,
                false,
                false,
                par,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Every type, decode and prompt paths, against a dense f32 matmul of the dequantized weight.
    #[test]
    fn matches_dequantized_matmul() {
        let (n, k) = (72usize, 512usize);
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        for dt in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::BF16,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let q = Arc::new(QTensor::quantize(&w, dt).unwrap());
            let wd = q.dequantize(&Device::Cpu).unwrap();
            for m in [1usize, 3, 4, 5, 37, 67, 70] {
                let x = Tensor::randn(0f32, 1.0, (1, m, k), &Device::Cpu).unwrap();
                let want = x.broadcast_matmul(&wd.t().unwrap()).unwrap();
                let got = x.apply_op1_no_bwd(&CpuMatMul(q.clone())).unwrap();
                assert_eq!(got.dims(), &[1, m, n]);
                let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let d = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                // vec-dots quantize the activations to 8 bits (16 for f16/bf16); gemm is exact f32
                let exact_f32 = Kernel::choose(dt, m) == Kernel::DequantGemm;
                let tol = if exact_f32 || dt == GgmlDType::F32 { 1e-4 } else { 3e-2 };
                assert!(d <= tol * scale, "{dt:?} m={m}: {d} of {scale}");
            }
        }
    }

    #[test]
    fn avx2_kernels_equal_scalar() {
        if !avx2::available() {
            return;
        }
        let k = 256;
        let w = Tensor::randn(0f32, 1.0, (3, k), &Device::Cpu).unwrap();
        let x: Vec<f32> = (0..k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let mut dst = vec![0f32; 3];
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let data = q.data().unwrap();
        let wb = blocks::<avx2::Q4_1>(&data).unwrap();
        let mut xq = vec![avx2::Q8_1 { d: half::f16::ZERO, s: half::f16::ZERO, qs: [0; 32] }; k / 32];
        avx2::quantize_q8_1(&x, &mut xq);
        avx2::matmul_q4_1(wb, (1, k, 3), &x, &mut dst);
        for r in 0..3 {
            let s = avx2::dot_q4_1_scalar(&wb[r * 8..(r + 1) * 8], &xq);
            assert!((dst[r] - s).abs() <= 1e-3 * s.abs().max(1.0), "q4_1 {} vs {s}", dst[r]);
        }
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let data = q.data().unwrap();
        let wb = blocks::<avx2::Q8_0>(&data).unwrap();
        let mut xq = vec![avx2::Q8_0 { d: half::f16::ZERO, qs: [0; 32] }; k / 32];
        avx2::quantize_q8_0(&x, &mut xq);
        avx2::matmul_q8_0(wb, (1, k, 3), &x, &mut dst);
        for r in 0..3 {
            let s = avx2::dot_q8_0_scalar(&wb[r * 8..(r + 1) * 8], &xq);
            assert!((dst[r] - s).abs() <= 1e-3 * s.abs().max(1.0), "q8_0 {} vs {s}", dst[r]);
        }
    }

    fn random_weight((n, k): (usize, usize), dt: GgmlDType) -> QTensor {
        QTensor::quantize(&Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap(), dt).unwrap()
    }

    /// Deterministic activations in about ±7.
    fn ramp(len: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect()
    }

    /// The tiled prompt kernel against the one-row vec-dots, on every tile shape and edge: both
    /// quantize the activations the same way, so they agree to float rounding.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q8_0_prompt_tiles_equal_vec_dots() {
        if !avx2::available() {
            return;
        }
        let (n, k) = (7usize, 96usize);
        let q = random_weight((n, k), GgmlDType::Q8_0);
        let data = q.data().unwrap();
        let wb = blocks::<avx2::Q8_0>(&data).unwrap();
        for m in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 67, 130] {
            let x = ramp(m * k);
            let (mut tiled, mut rows) = (vec![0f32; m * n], vec![0f32; m * n]);
            avx2::matmul_q8_0_prompt(wb, (m, k, n), &x, &mut tiled);
            avx2::matmul_q8_0(wb, (m, k, n), &x, &mut rows);
            for (i, (a, b)) in tiled.iter().zip(&rows).enumerate() {
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "m={m} at {i}: {a} vs {b}");
            }
        }
    }

    /// The Q4_K prompt kernel against the exact product of the dequantized weight and the
    /// activations as the kernel quantizes them (per 256, to ±127): only float rounding differs,
    /// so scales, mins and nibble order must all be right.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q4k_prompt_equals_dequantized_product() {
        if !avx2::available() {
            return;
        }
        let (n, k) = (5usize, 512usize);
        let q = random_weight((n, k), GgmlDType::Q4K);
        let wd: Vec<f32> = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let data = q.data().unwrap();
        let wb = blocks::<avx2::Q4K>(&data).unwrap();
        for m in [1usize, 2, 3, 4, 7] {
            let x = ramp(m * k);
            let xd: Vec<f32> = x
                .chunks_exact(256)
                .flat_map(|b| {
                    let d = b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                    b.iter().map(move |v| if d > 0.0 { (v / d).round() * d } else { 0.0 }).collect::<Vec<_>>()
                })
                .collect();
            let mut got = vec![0f32; m * n];
            avx2::matmul_q4k_prompt(wb, (m, k, n), &x, &mut got);
            for r in 0..m {
                for c in 0..n {
                    let want: f32 = (0..k).map(|i| xd[r * k + i] * wd[c * k + i]).sum();
                    let g = got[r * n + c];
                    assert!((g - want).abs() <= 1e-4 * want.abs().max(10.0), "m={m} ({r},{c}): {g} vs {want}");
                }
            }
        }
    }
}
