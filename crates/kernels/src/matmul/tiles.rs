//! The int8 kernels, generic over the instruction set ([`Simd`]), and the drivers that run them
//! over a matmul on candle's thread pool.
//!
//! - Decode rows (up to `DECODE_ROWS`, one per session) are vec-dots per weight row straight
//!   from ggml's blocks ([`q0_dot_rows`], [`k_dot_rows`]), each weight block unpacked once for up
//!   to [`DOT_ROWS`] rows and each row's arithmetic exactly that of the row alone (batch
//!   invariance). Alone, a row reads every weight byte once, so unpacking in place costs next to
//!   nothing where the memory read bounds it; where it does not (Q4_K on few cores), rows
//!   sharing the unpacking is what makes a batch cheaper than its rows one by one.
//! - More rows (prompts) run in [`super::lanes`], output columns in vector lanes over a panel
//!   of weight columns unpacked once for every row.
//!
//! No function here takes a closure into a kernel: a closure is compiled without the kernel's
//! target features, so its intrinsics would become calls (see [`Simd::join`]).

use super::acts::{Q8KRows, Q8Rows};
use super::blocks::Q0Block;
use super::lanes;
use super::packed::{fetch_mode, Fetch, AHEAD};
use super::simd::{f16_table, F16Table, Simd};
use super::unpack::{KUnpack, Q0Unpack};
use super::DECODE_ROWS;
use half::f16;
use std::arch::x86_64::*;

/// Asks for `lines` cache lines from `p` on, ahead of the block in use, as `mode` says: by
/// default [`AHEAD`] (16 KiB) ahead into L2, as the packed kernels; `near`: 1 KiB ahead into L1,
/// what the vec-dots did before. One row × 2048 × 200000 from memory, 2 threads, `cpu_kernels`,
/// Ice Lake Xeon, best of 3 interleaved, far against near: AVX2 Q6_K 1.17×, Q8_0 1.10×, Q5_K
/// 1.16×, AVX-512 Q4_0 1.10×, Q8_0 1.16× (4 KiB into L2: 0.86–0.98× of 16; 32 KiB level); in
/// cache level. On the model-167 Xeon (AMX) requests like these made the vec-dots slower (Q4_K
/// 44.6 → 37.8, Q8_0 25.6 → 20.5 GMAC/s, then against near): `BRIGADE_CPU_PREFETCH=near|off`
/// measures it on another machine.
///
/// The vec-dots' loops are compiled twice ([`dot_columns!`]): with `mode` the constant default,
/// which folds this `match` away, and with the mode read once per call, because LLVM kept that
/// `match` in the loop: two compare-and-branches a block (llvm-mca, the AVX2 Q8_0 loop: 22 → 19
/// uops a block).
#[inline(always)]
fn prefetch<T>(mode: Fetch, p: *const T, lines: usize) {
    let p = p.cast::<i8>();
    for l in 0..lines {
        // SAFETY: a prefetch does not fault; the address is computed without dereferencing
        unsafe {
            match mode {
                Fetch::Far => _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(AHEAD + 64 * l)),
                Fetch::Near => _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(1024 + 64 * l)),
                Fetch::Off => {}
            }
        }
    }
}

/// Rows `r0..r0 + R` of `x` times `w[c]` for a 32-weight type: per block `Σ q·x` in i32 lanes
/// (starting from the activations' `fill`, which takes away the weights' offset), times
/// `d_w·d_x`, plus Q4_1/Q5_1's `m · d_x·Σx`. The second half of each 512-bit step is under
/// `S::W == 64`, which the compiler folds away for 256-bit vectors.
///
/// Each weight block is unpacked once for the `R` rows; each row then runs the same operations
/// in the same order into accumulators of its own, so a row's result is, bit for bit, the one it
/// has with `R = 1` (batch invariance; tested).
///
/// `FAR`: the default prefetch compiled in (see [`prefetch`]); else the mode is read once.
///
/// # Safety
/// `w` holds row `c` of `bpr` blocks; `x` holds rows `r0..r0 + R` of
/// `bpr.next_multiple_of(S::W / 32)` blocks, quantized with the offset 128 for Q8_0 on VNNI and
/// `T::OFFSET` otherwise.
#[inline(always)]
pub unsafe fn q0_dot_rows<T: Q0Unpack, S: Simd, const R: usize, const FAR: bool>(
    s: S,
    w: &[T],
    bpr: usize,
    c: usize,
    x: &Q8Rows,
    r0: usize,
    f16s: &F16Table,
) -> [f32; R] {
    debug_assert!((c + 1) * bpr <= w.len() && x.blocks == bpr.next_multiple_of(S::W / 32));
    debug_assert!((r0 + R) * x.blocks <= x.d.len());
    let a2 = s.avx2();
    let two = S::W == 64;
    let flip = T::SIGNED && S::VNNI;
    let fill = q0_offset::<T, S>() != 0;
    let fetch = if FAR { Fetch::Far } else { fetch_mode() };
    let mut acc = [s.zero_f(); R];
    let mut b0 = 0;
    while b0 < x.blocks {
        // SAFETY: row c is in `w`, block b0 < bpr (x.blocks rounds bpr up by less than a step)
        let (b, next) = unsafe {
            let row = w.as_ptr().add(c * bpr);
            (&*row.add(b0), if two && b0 + 1 < bpr { Some(&*row.add(b0 + 1)) } else { None })
        };
        prefetch(fetch, b, 1);
        let (q1, d1, m1) = match next {
            Some(n) => (n.unpack(a2), n.d(), n.m()),
            None => (a2.zero(), f16::ZERO, f16::ZERO),
        };
        let mut wv = s.join(b.unpack(a2), q1);
        if flip {
            wv = s.flip(wv);
        }
        let dw = s.per_block_f16_in(f16s, [b.d(), d1]);
        let mw = if T::HAS_MIN { s.mul(s.per_block_f16_in(f16s, [b.m(), m1]), s.set1(0.125)) } else { s.zero_f() };
        for (i, acc) in acc.iter_mut().enumerate() {
            let (at, t1) = ((r0 + i) * x.blocks + b0, if two { 1 } else { 0 });
            // SAFETY: blocks b0..b0 + W/32 of row r0 + i are in `x`
            let (xv, dx, init, sx) = unsafe {
                (
                    s.load(x.qs.as_ptr().add(32 * at)),
                    s.per_block([*x.d.get_unchecked(at), *x.d.get_unchecked(at + t1)]),
                    if fill {
                        s.per_block_i32([*x.fill.get_unchecked(at), *x.fill.get_unchecked(at + t1)])
                    } else {
                        s.zero()
                    },
                    s.per_block([*x.s.get_unchecked(at), *x.s.get_unchecked(at + t1)]),
                )
            };
            let p = if T::SIGNED && !S::VNNI { s.dot_s8(init, wv, xv) } else { s.dot_u8(init, wv, xv) };
            *acc = s.fmadd(s.mul(dw, dx), s.cvt(p), *acc);
            if T::HAS_MIN {
                // each block's 8 lanes add up to m · d_x·Σx
                *acc = s.fmadd(mw, sx, *acc);
            }
        }
        b0 += S::W / 32;
    }
    let mut out = [0f32; R];
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = s.hsum(*a);
    }
    out
}

/// Rows `r0..r0 + R` of `x` times `w[c]` for a 256-weight type: per super-block the quants'
/// products times their sub-block scales summed in i32 lanes (`dot_scaled`), Q6_K's −32 added
/// in integers (`Σ corr · bsums`), times `d_w·d_x`, less Q4_K/Q5_K's `dmin · Σ m · bsums`.
///
/// Each super-block's scales and quants are unpacked once for the `R` rows (most of the work
/// where decode is not bound by memory); each row then runs the same operations in the same
/// order into accumulators of its own, so a row's result is, bit for bit, the one it has with
/// `R = 1` (batch invariance; tested).
///
/// `FAR`: the default prefetch compiled in (see [`prefetch`]); else the mode is read once.
///
/// # Safety
/// `w` holds row `c` of `bpr` super-blocks; `x` holds rows `r0..r0 + R` of `bpr` super-blocks.
#[inline(always)]
pub unsafe fn k_dot_rows<T: KUnpack, S: Simd, const R: usize, const FAR: bool>(
    s: S,
    w: &[T],
    bpr: usize,
    c: usize,
    x: &Q8KRows,
    r0: usize,
) -> [f32; R] {
    debug_assert!((c + 1) * bpr <= w.len() && (r0 + R) * bpr <= x.d.len());
    let a2 = s.avx2();
    let fetch = if FAR { Fetch::Far } else { fetch_mode() };
    let mut acc = [s.zero_f(); R];
    let mut accm = [a2.zero_f(); R];
    for b in 0..bpr {
        // SAFETY: row c, super-block b is in `w`
        let blk = unsafe { w.get_unchecked(c * bpr + b) };
        prefetch(fetch, blk, std::mem::size_of::<T>().div_ceil(64));
        let ks = blk.scales(a2);
        let mut isum = [s.zero(); R];
        for st in 0..256 / S::W {
            let t = st * (S::W / 32);
            let hi = if S::W == 64 { blk.chunk(a2, t + 1) } else { a2.zero() };
            let (wv, sc) = (s.join(blk.chunk(a2, t), hi), s.scales(ks.sc, st));
            for (i, isum) in isum.iter_mut().enumerate() {
                // SAFETY: bytes st·W.. of super-block b of row r0 + i
                let xv = unsafe { s.load(x.qs.as_ptr().add(((r0 + i) * bpr + b) * 256 + st * S::W)) };
                *isum = s.dot_scaled(*isum, wv, xv, sc);
            }
        }
        let (dw, dmin) = (s.per_block_f16([ks.d; 2]), a2.per_block_f16([ks.dmin; 2]));
        for (i, (acc, accm)) in acc.iter_mut().zip(accm.iter_mut()).enumerate() {
            let at = (r0 + i) * bpr + b;
            // SAFETY: super-block b of row r0 + i
            let (dx, bs) = unsafe { (*x.d.get_unchecked(at), a2.load(x.bsums.as_ptr().add(16 * at).cast())) };
            let corr = a2.madd(bs, ks.corr);
            let mut t = isum[i];
            if T::HAS_MIN {
                *accm = a2.fmadd(a2.mul(dmin, a2.set1(dx)), a2.cvt(corr), *accm);
            } else {
                t = s.add32(t, s.widen(corr));
            }
            *acc = s.fmadd(s.mul(dw, s.set1(dx)), s.cvt(t), *acc);
        }
    }
    let mut out = [0f32; R];
    for (o, (a, am)) in out.iter_mut().zip(acc.iter().zip(&accm)) {
        *o = s.hsum(*a) - if T::HAS_MIN { a2.hsum(*am) } else { 0.0 };
    }
    out
}

/// What a 32-weight type's unsigned quants are offset by: Q4_0's 8, Q5_0's 16, and on VNNI the
/// 128 that makes Q8_0's signed bytes unsigned (AVX2 multiplies those by their sign instead).
pub(super) const fn q0_offset<T: Q0Block, S: Simd>() -> i32 {
    if T::SIGNED && S::VNNI {
        128
    } else {
        T::OFFSET
    }
}

/// Where a group writes: the `m × n` output.
#[derive(Clone, Copy)]
pub struct Out {
    pub(super) ptr: usize,
    pub(super) m: usize,
    pub(super) n: usize,
}

impl Out {
    /// Writes `t` at rows `r0..r0 + R` of column `c`.
    ///
    /// # Safety
    /// Only this work item writes those elements; `r0 + R ≤ m`, `c < n`.
    #[inline(always)]
    unsafe fn put_column<const R: usize>(self, t: [f32; R], r0: usize, c: usize) {
        for (i, v) in t.iter().enumerate() {
            // SAFETY: (r0 + i, c) is inside the output (caller's contract)
            unsafe { *(self.ptr as *mut f32).add((r0 + i) * self.n + c) = *v };
        }
    }
}

/// Activation rows per multi-row vec-dot ([`q0_dot_rows`], [`k_dot_rows`]): the rows of a group
/// share each weight block's unpacking, and a column's groups find its blocks in L1. 8 rather
/// than 4 took Q4_K k = 2048 from 61 to 65 GMAC/s at 8 rows on AVX-512 (49 to 57 on AVX2, its
/// accumulators spilling) in the `cpu_kernels` example, one thread.
const DOT_ROWS: usize = 8;
const _: () = assert!(DOT_ROWS <= 8, "with_rows! goes up to 8");

/// `$body` with the constant `$r` set to `$rows`, from 1 to 8 (more is 8).
macro_rules! with_rows {
    ($rows:expr, $r:ident => $body:expr) => {
        match $rows {
            1 => {
                const $r: usize = 1;
                $body
            }
            2 => {
                const $r: usize = 2;
                $body
            }
            3 => {
                const $r: usize = 3;
                $body
            }
            4 => {
                const $r: usize = 4;
                $body
            }
            5 => {
                const $r: usize = 5;
                $body
            }
            6 => {
                const $r: usize = 6;
                $body
            }
            7 => {
                const $r: usize = 7;
                $body
            }
            _ => {
                const $r: usize = 8;
                $body
            }
        }
    };
}

/// Every column of `$cols` for every row of `$out`, `$dot` giving rows `$r0..$r0 + $R` of
/// column `$c` (`$R` up to [`DOT_ROWS`]). Compiled twice, `$far` true for the default prefetch
/// and false for a mode read per block (see [`prefetch`]).
macro_rules! dot_columns {
    ($out:expr, $cols:expr, |$c:ident, $r0:ident, $R:ident, $far:ident| $dot:expr) => {{
        let (c0, c1) = $cols;
        if fetch_mode() == Fetch::Far {
            const $far: bool = true;
            dot_columns!(@each $out, c0, c1, $c, $r0, $R, $dot)
        } else {
            const $far: bool = false;
            dot_columns!(@each $out, c0, c1, $c, $r0, $R, $dot)
        }
    }};
    (@each $out:expr, $c0:expr, $c1:expr, $c:ident, $r0:ident, $R:ident, $dot:expr) => {
        for $c in $c0..$c1 {
            for $r0 in (0..$out.m).step_by(DOT_ROWS) {
                with_rows!(($out.m - $r0).min(DOT_ROWS), $R => $out.put_column($dot, $r0, $c))
            }
        }
    };
}

/// Columns `c0..c1` of every decode row (`out.m ≤ DECODE_ROWS`) of a 32-weight type: per
/// column, the rows in groups of up to [`DOT_ROWS`] through [`q0_dot_rows`], so that each
/// row's result is the one it has alone.
///
/// # Safety
/// As [`q0_dot_rows`] for those columns and rows `0..out.m` of `x`; only this call writes those
/// columns.
#[inline(always)]
pub unsafe fn q0_columns<T: Q0Unpack, S: Simd>(
    s: S,
    w: &[T],
    bpr: usize,
    (c0, c1): (usize, usize),
    x: &Q8Rows,
    out: Out,
) {
    let f16s = f16_table();
    // SAFETY: the caller's contract; rows r0..r0 + R are below out.m
    unsafe { dot_columns!(out, (c0, c1), |c, r0, R, FAR| q0_dot_rows::<T, S, R, FAR>(s, w, bpr, c, x, r0, f16s)) }
}

/// Columns `c0..c1` of every decode row (`out.m ≤ DECODE_ROWS`) of a 256-weight type, as
/// [`q0_columns`] through [`k_dot_rows`].
///
/// # Safety
/// As [`k_dot_rows`] for those columns and rows `0..out.m` of `x`; only this call writes those
/// columns.
#[inline(always)]
pub unsafe fn k_columns<T: KUnpack, S: Simd>(
    s: S,
    w: &[T],
    bpr: usize,
    (c0, c1): (usize, usize),
    x: &Q8KRows,
    out: Out,
) {
    // SAFETY: the caller's contract; rows r0..r0 + R are below out.m
    unsafe { dot_columns!(out, (c0, c1), |c, r0, R, FAR| k_dot_rows::<T, S, R, FAR>(s, w, bpr, c, x, r0)) }
}

/// Runs `columns((c0, c1))` over every column, ranges of columns split across candle's pool.
fn each_column_range(n: usize, columns: impl Fn((usize, usize)) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(n, |cols| columns((cols.start, cols.end)));
}

/// `dst[m, n] = lhs[m, k] @ w[n, k]ᵀ` for a 32-weight block type.
///
/// # Safety
/// `k` is a multiple of 32, `w` holds `n · k/32` blocks, `lhs` `m · k` values, `dst` `m · n`.
pub unsafe fn matmul_q0<T: Q0Unpack, S: Simd>(
    s: S,
    w: &[T],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let bpr = k / 32;
    let blocks = bpr.next_multiple_of(S::W / 32);
    let offset = q0_offset::<T, S>();
    let out = Out { ptr: dst.as_mut_ptr() as usize, m, n };
    if m <= DECODE_ROWS {
        // each row quantized as alone (per row) and dotted as alone: its result is the one it
        // has alone
        let x = Q8Rows::new(lhs, (m, k), m, blocks, offset);
        // SAFETY: each range writes its own columns; every column is in `w`, every row in `x`
        each_column_range(n, |cols| unsafe { s.q0_columns(w, bpr, cols, &x, out) });
        return;
    }
    // the min or offset terms come from `x.s`, so the rows are quantized with no offset
    let x = Q8Rows::new(lhs, (m, k), m.next_multiple_of(lanes::ROWS), blocks, 0);
    // SAFETY: each block writes its own columns of every row; rows are padded to tiles
    lanes::each_block(n, lanes::block_cols::<S>(), |cols, p| unsafe { s.q0_lanes(w, bpr, cols, &x, out, p) });
}

/// `dst[m, n] = lhs[m, k] @ w[n, k]ᵀ` for a 256-weight block type.
///
/// # Safety
/// `k` is a multiple of 256, `w` holds `n · k/256` blocks, `lhs` `m · k` values, `dst` `m · n`.
pub unsafe fn matmul_k<T: KUnpack, S: Simd>(
    s: S,
    w: &[T],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) {
    let bpr = k / 256;
    let out = Out { ptr: dst.as_mut_ptr() as usize, m, n };
    if m <= DECODE_ROWS {
        // as in `matmul_q0`
        let x = Q8KRows::new(lhs, (m, k), m);
        // SAFETY: each range writes its own columns; every column is in `w`, every row in `x`
        each_column_range(n, |cols| unsafe { s.k_columns(w, bpr, cols, &x, out) });
        return;
    }
    let x = Q8KRows::new(lhs, (m, k), m.next_multiple_of(lanes::ROWS));
    // SAFETY: each block writes its own columns of every row; rows are padded to tiles
    lanes::each_block(n, lanes::block_cols::<S>(), |cols, p| unsafe { s.k_lanes(w, bpr, cols, &x, out, p) });
}
