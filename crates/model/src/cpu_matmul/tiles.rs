//! The int8 kernels, generic over the instruction set ([`Simd`]), and the drivers that run them
//! over a matmul on candle's thread pool.
//!
//! - Decode rows (up to `DECODE_ROWS`, one per session) are vec-dots per weight row straight
//!   from ggml's blocks ([`q0_dot_rows`], [`k_dot_rows`]), each weight block unpacked once for up
//!   to [`DOT_ROWS`] rows and each row's arithmetic exactly that of the row alone (batch
//!   invariance). Alone, a row reads every weight byte once, so unpacking in place costs next to
//!   nothing where the memory read bounds it; where it does not (Q4_K on few cores), rows
//!   sharing the unpacking is what makes a batch cheaper than its rows one by one.
//! - More rows (prompts) run, with VNNI, in [`super::lanes`]; without it (AVX2), in `4 × C`
//!   register tiles. Each weight block is then used by every
//!   row, so the `C` weight columns of a tile are first unpacked into a [`Panel`] (quants as
//!   bytes, scales as the vectors the kernel multiplies by) and the tile kernels ([`q0_tile`],
//!   [`k_tile`]) only load, multiply and add; a panel serves the [`PROMPT_ROWS`] activation rows
//!   of a group. The min terms (Q4_1, Q5_1, Q4_K, Q5_K) are added once per group as a small
//!   f32 product over the per-32 sums ([`min_terms`]), cheaper than in every tile.
//!
//! No function here takes a closure into a kernel: a closure is compiled without the kernel's
//! target features, so its intrinsics would become calls (see [`Simd::join`]).

use super::acts::{transposed_groups, Q8KRows, Q8Rows};
use super::blocks::Q0Block;
use super::lanes;
use super::simd::Simd;
use super::unpack::{KScales, KUnpack, Q0Unpack};
use super::DECODE_ROWS;
use half::f16;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// How far ahead of the block in use the kernels ask for weight bytes: 1 KiB was the best of
/// 512/1024/2048 for Q8_0 decode in `brigade bench` on a 2-core VM, though within its noise.
const PREFETCH: usize = 1024;

#[inline(always)]
fn prefetch<T>(p: *const T, lines: usize) {
    for l in 0..lines {
        // SAFETY: a prefetch does not fault; the address is computed without dereferencing
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().wrapping_add(PREFETCH + 64 * l)) };
    }
}

/// Activation rows per group: a group's quantized rows stay in cache while every weight panel
/// passes over them (64 rows of k = 2048 are 128 KiB of int8), and each panel serves the group.
const PROMPT_ROWS: usize = 64;
/// Activation rows per tile (the quantized rows are padded to a multiple).
const TILE_ROWS: usize = 4;

/// Rows `r0..r0 + R` of `x` times `w[c]` for a 32-weight type: per block `Σ q·x` in i32 lanes
/// (starting from the activations' `fill`, which takes away the weights' offset), times
/// `d_w·d_x`, plus Q4_1/Q5_1's `m · d_x·Σx`. The second half of each 512-bit step is under
/// `S::W == 64`, which the compiler folds away for 256-bit vectors.
///
/// Each weight block is unpacked once for the `R` rows; each row then runs the same operations
/// in the same order into accumulators of its own, so a row's result is, bit for bit, the one it
/// has with `R = 1` (batch invariance; tested).
///
/// # Safety
/// `w` holds row `c` of `bpr` blocks; `x` holds rows `r0..r0 + R` of
/// `bpr.next_multiple_of(S::W / 32)` blocks, quantized with the offset 128 for Q8_0 on VNNI and
/// `T::OFFSET` otherwise.
#[inline(always)]
pub unsafe fn q0_dot_rows<T: Q0Unpack, S: Simd, const R: usize>(
    s: S,
    w: &[T],
    bpr: usize,
    c: usize,
    x: &Q8Rows,
    r0: usize,
) -> [f32; R] {
    debug_assert!((c + 1) * bpr <= w.len() && x.blocks == bpr.next_multiple_of(S::W / 32));
    debug_assert!((r0 + R) * x.blocks <= x.d.len());
    let a2 = s.avx2();
    let two = S::W == 64;
    let flip = T::SIGNED && S::VNNI;
    let fill = q0_offset::<T, S>() != 0;
    let mut acc = [s.zero_f(); R];
    let mut b0 = 0;
    while b0 < x.blocks {
        // SAFETY: row c is in `w`, block b0 < bpr (x.blocks rounds bpr up by less than a step)
        let (b, next) = unsafe {
            let row = w.as_ptr().add(c * bpr);
            (&*row.add(b0), if two && b0 + 1 < bpr { Some(&*row.add(b0 + 1)) } else { None })
        };
        prefetch(b, 1);
        let (q1, d1, m1) = match next {
            Some(n) => (n.unpack(a2), n.d(), n.m()),
            None => (a2.zero(), f16::ZERO, f16::ZERO),
        };
        let mut wv = s.join(b.unpack(a2), q1);
        if flip {
            wv = s.flip(wv);
        }
        let dw = s.per_block_f16([b.d(), d1]);
        let mw = if T::HAS_MIN { s.mul(s.per_block_f16([b.m(), m1]), s.set1(0.125)) } else { s.zero_f() };
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
/// # Safety
/// `w` holds row `c` of `bpr` super-blocks; `x` holds rows `r0..r0 + R` of `bpr` super-blocks.
#[inline(always)]
pub unsafe fn k_dot_rows<T: KUnpack, S: Simd, const R: usize>(
    s: S,
    w: &[T],
    bpr: usize,
    c: usize,
    x: &Q8KRows,
    r0: usize,
) -> [f32; R] {
    debug_assert!((c + 1) * bpr <= w.len() && (r0 + R) * bpr <= x.d.len());
    let a2 = s.avx2();
    let mut acc = [s.zero_f(); R];
    let mut accm = [a2.zero_f(); R];
    for b in 0..bpr {
        // SAFETY: row c, super-block b is in `w`
        let blk = unsafe { w.get_unchecked(c * bpr + b) };
        prefetch(blk, std::mem::size_of::<T>().div_ceil(64));
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

/// Up to [`PANEL_COLS`] weight columns unpacked for the prompt tiles, every block of `k` (one per worker
/// thread, reused). Column `j` is at `q[j·kq..]`, `sc[j·kq/2..]`, ….
#[derive(Default)]
pub struct Panel {
    /// The quants as bytes (Q8_0 on VNNI: flipped to unsigned), in order.
    q: Vec<u8>,
    /// K-quants: the i16 scale vector of each `W` bytes of `q`, as the kernel multiplies.
    sc: Vec<i16>,
    /// K-quants: `d` per super-block; 32-weight types: `d` over each block's 8 i32 lanes.
    d: Vec<f32>,
    /// Q6_K: `−32·sc` per 16 weights.
    corr: Vec<i16>,
    /// Q4_K/Q5_K with VNNI: `q` holds `q · (sc mod 8)` and this `q · (sc div 8)` (see [`k_tile`]).
    hi: Vec<u8>,
    /// The min terms' weights, per 32 weights: Q4_1/Q5_1's `m`, Q4_K/Q5_K's `−dmin·m`.
    mins: Vec<f32>,
    /// Bytes of `q` per column.
    kq: usize,
}

thread_local! {
    static PANEL: RefCell<Panel> = RefCell::new(Panel::default());
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

/// Whether a 32-weight type has a term per block besides `d_w·d_x·Σ q·x`: the min (Q4_1,
/// Q5_1, `m · d_x·Σx`) or the offset (`−offset·d_w · d_x·Σx`). Prompts add it once per group
/// ([`min_terms`]); decode starts each block's integer sum from the activations' `fill`.
const fn q0_has_terms<T: Q0Block, S: Simd>() -> bool {
    T::HAS_MIN || q0_offset::<T, S>() != 0
}

/// Unpacks columns `c0..c0 + cols` of a 32-weight type into `p`, blocks padded with zeros to
/// `blocks`.
///
/// # Safety
/// `w` holds those columns of `bpr` blocks each; `blocks ≥ bpr`.
#[inline(always)]
unsafe fn fill_q0<T: Q0Unpack, S: Simd>(
    s: S,
    w: &[T],
    (bpr, blocks): (usize, usize),
    (c0, cols): (usize, usize),
    p: &mut Panel,
) {
    let a2 = s.avx2();
    p.kq = 32 * blocks;
    p.q.resize(cols * p.kq, 0);
    p.d.resize(cols * blocks * 8, 0.0);
    p.mins.resize(if q0_has_terms::<T, S>() { cols * bpr } else { 0 }, 0.0);
    for j in 0..cols {
        for b in 0..blocks {
            let at = j * blocks + b;
            let (mut v, d) = if b < bpr {
                // SAFETY: column c0 + j, block b < bpr is in `w`
                let blk = unsafe { w.get_unchecked((c0 + j) * bpr + b) };
                if b % 2 == 0 {
                    prefetch(blk, 1);
                }
                if q0_has_terms::<T, S>() {
                    p.mins[j * bpr + b] =
                        if T::HAS_MIN { blk.m().to_f32() } else { -q0_offset::<T, S>() as f32 * blk.d().to_f32() };
                }
                (blk.unpack(a2), blk.d().to_f32())
            } else {
                (a2.zero(), 0.0)
            };
            if T::SIGNED && S::VNNI {
                v = a2.flip(v);
            }
            // SAFETY: 32 bytes and 8 floats inside the panel, sized above
            unsafe {
                a2.store(p.q.as_mut_ptr().add(32 * at), v);
                a2.store_f(p.d.as_mut_ptr().add(8 * at), a2.set1(d));
            }
        }
    }
}

/// Unpacks columns `c0..c0 + cols` of a 256-weight type into `p`.
///
/// # Safety
/// `w` holds those columns of `bpr` super-blocks each.
#[inline(always)]
unsafe fn fill_k<T: KUnpack, S: Simd>(s: S, w: &[T], bpr: usize, (c0, cols): (usize, usize), p: &mut Panel) {
    let a2 = s.avx2();
    p.kq = 256 * bpr;
    p.q.resize(cols * p.kq, 0);
    p.sc.resize(if S::VNNI && T::HAS_MIN { 0 } else { cols * p.kq / 2 }, 0);
    // d_w four times per column and super-block, columns side by side (`k_tile` multiplies
    // them by four rows' d_x at once), padded to whole pairs of columns
    p.d.resize(bpr * PANEL_COLS * TILE_ROWS, 0.0);
    p.corr.resize(cols * bpr * 16, 0);
    p.mins.resize(if T::HAS_MIN { cols * bpr * 8 } else { 0 }, 0.0);
    let split = S::VNNI && T::HAS_MIN;
    p.hi.resize(if split { cols * p.kq } else { 0 }, 0);
    for j in 0..cols {
        for b in 0..bpr {
            let at = j * bpr + b;
            // SAFETY: column c0 + j, super-block b is in `w`
            let blk = unsafe { w.get_unchecked((c0 + j) * bpr + b) };
            // the weights stream from memory (columns are contiguous): ask ahead
            prefetch(blk, std::mem::size_of::<T>().div_ceil(64));
            let ks: KScales = blk.scales(a2);
            let d = a2.first(a2.per_block_f16([ks.d; 2]));
            p.d[(b * PANEL_COLS + j) * TILE_ROWS..][..TILE_ROWS].fill(d);
            let (mut corr, mut sc) = ([0i16; 16], [0i8; 16]);
            // SAFETY: 16 i16 inside the panel and on the stack, 16 i8 on the stack
            unsafe {
                a2.store(p.corr.as_mut_ptr().add(16 * at).cast(), ks.corr);
                a2.store(corr.as_mut_ptr().cast(), ks.corr);
                _mm_storeu_si128(sc.as_mut_ptr().cast(), ks.sc);
            }
            if split {
                // q · (sc mod 8) and q · (sc div 8), each below 256: a 16-bit multiply of the
                // byte pairs keeps them apart
                for t in 0..8 {
                    let q = blk.chunk(a2, t);
                    // SAFETY: AVX2 (the token); 32 bytes inside `q` and `hi`, sized above
                    unsafe {
                        let (lo, hi) =
                            (_mm256_set1_epi16((sc[2 * t] & 7) as i16), _mm256_set1_epi16((sc[2 * t] >> 3) as i16));
                        a2.store(p.q.as_mut_ptr().add(256 * at + 32 * t), _mm256_mullo_epi16(q, lo));
                        a2.store(p.hi.as_mut_ptr().add(256 * at + 32 * t), _mm256_mullo_epi16(q, hi));
                    }
                }
            } else {
                for st in 0..256 / S::W {
                    let t = st * (S::W / 32);
                    let hi = if S::W == 64 { blk.chunk(a2, t + 1) } else { a2.zero() };
                    // SAFETY: W bytes of `q` and W/2 i16 of `sc` inside the panel, sized above
                    unsafe {
                        s.store(p.q.as_mut_ptr().add(256 * at + st * S::W), s.join(blk.chunk(a2, t), hi));
                        s.store(p.sc.as_mut_ptr().add(128 * at + st * S::W / 2).cast(), s.scales(ks.sc, st));
                    }
                }
            }
            if T::HAS_MIN {
                let dmin = a2.first(a2.per_block_f16([ks.dmin; 2]));
                for (jj, m) in corr.iter().step_by(2).enumerate() {
                    p.mins[(j * bpr + b) * 8 + jj] = -dmin * *m as f32;
                }
            }
        }
    }
}

/// Most panel columns of a prompt group: `S::Q0_C` and `S::K_C` are at most this.
const PANEL_COLS: usize = 2;

/// The min terms of a group's rows, per panel column: `terms[j][i]` for row `g0 + i`.
type Terms = [[f32; PROMPT_ROWS]; PANEL_COLS];

/// The min terms `Σ_b mins[j][b] · xs[r][b]` of the panel's columns for rows `g0..g1`: a small
/// f32 product (`kk` terms against the tiles' `32·kk` or `256·kk`), run down the group's rows
/// in vector lanes from `st`, the group's `xs` transposed (`kk` rows of [`PROMPT_ROWS`]; see
/// `acts::transposed_groups`), so that no term needs a horizontal sum. The tiles add them as
/// they write ([`Out::put`]): the output's rows are `n` floats apart, and a second pass over
/// them costs more than the product (cache sets, `n` a multiple of 1024).
///
/// # Safety
/// `st` holds `kk × PROMPT_ROWS` values; the panel `cols × kk` mins; `g1 - g0 ≤ PROMPT_ROWS`.
#[inline(always)]
unsafe fn min_terms<S: Simd>(s: S, p: &Panel, cols: usize, kk: usize, st: &[f32], (g0, g1): (usize, usize)) -> Terms {
    let mut terms = [[0f32; PROMPT_ROWS]; PANEL_COLS];
    debug_assert!(g1 - g0 <= PROMPT_ROWS && st.len() >= kk * PROMPT_ROWS && p.mins.len() >= cols * kk);
    // SAFETY: the caller's contract; `N` vectors of rows cover `g1 - g0` and stay in the group
    unsafe {
        match (g1 - g0).div_ceil(S::W / 4) {
            0 => {}
            1 => min_terms_n::<S, 1>(s, p, cols, kk, st, &mut terms),
            2 => min_terms_n::<S, 2>(s, p, cols, kk, st, &mut terms),
            3 | 4 => min_terms_n::<S, 4>(s, p, cols, kk, st, &mut terms),
            _ => min_terms_n::<S, 8>(s, p, cols, kk, st, &mut terms),
        }
    }
    terms
}

/// [`min_terms`] over `N` vectors of rows.
///
/// # Safety
/// As [`min_terms`]; `N · S::W/4 ≤ PROMPT_ROWS`.
#[inline(always)]
unsafe fn min_terms_n<S: Simd, const N: usize>(s: S, p: &Panel, cols: usize, kk: usize, st: &[f32], terms: &mut Terms) {
    let lanes = S::W / 4;
    debug_assert!(N * lanes <= PROMPT_ROWS && cols <= PANEL_COLS);
    for (j, t) in terms.iter_mut().enumerate().take(cols) {
        let mut acc = [s.zero_f(); N];
        for b in 0..kk {
            // SAFETY: value b of column j of the panel's mins; row b of `st`, lanes below
            // N · lanes ≤ PROMPT_ROWS
            unsafe {
                let m = s.set1(*p.mins.get_unchecked(j * kk + b));
                for (v, a) in acc.iter_mut().enumerate() {
                    *a = s.fmadd(m, s.load_f(st.as_ptr().add(b * PROMPT_ROWS + v * lanes)), *a);
                }
            }
        }
        for (v, a) in acc.iter().enumerate() {
            // SAFETY: N · lanes ≤ PROMPT_ROWS floats of the column's terms
            unsafe { s.store_f(t.as_mut_ptr().add(v * lanes), *a) };
        }
    }
}

/// Activation rows `r0..r0 + 4` × panel columns `j0..j0 + C` of a 32-weight type: per step
/// `Σ q·x` times `d_w·d_x`; the min or offset terms are the caller's ([`q0_has_terms`]).
///
/// # Safety
/// The panel holds columns `j0..j0 + C` of `x.blocks` blocks; `x` holds rows `r0..r0 + 4`.
#[inline(always)]
unsafe fn q0_tile<T: Q0Unpack, S: Simd, const C: usize>(
    s: S,
    p: &Panel,
    j0: usize,
    x: &Q8Rows,
    r0: usize,
) -> [[f32; C]; 4] {
    let mut acc = [[s.zero_f(); C]; 4];
    let mut b0 = 0;
    while b0 < x.blocks {
        let mut wv = [s.zero(); C];
        let mut dw = [s.zero_f(); C];
        for j in 0..C {
            // SAFETY: column j0 + j, blocks b0.. of the panel
            unsafe {
                wv[j] = s.load(p.q.as_ptr().add((j0 + j) * p.kq + 32 * b0).cast());
                dw[j] = s.load_f(p.d.as_ptr().add(((j0 + j) * x.blocks + b0) * 8));
            }
        }
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let at = (r0 + i) * x.blocks + b0;
            // SAFETY: row r0 + i, blocks b0..b0 + W/32 of `x`
            let (xv, dx) =
                unsafe { (s.load(x.qs.as_ptr().add((r0 + i) * x.kp + 32 * b0)), s.per_block_at(x.d.as_ptr().add(at))) };
            for (a, j) in acc_i.iter_mut().zip(0..C) {
                let q =
                    if T::SIGNED && !S::VNNI { s.dot_s8(s.zero(), wv[j], xv) } else { s.dot_u8(s.zero(), wv[j], xv) };
                *a = s.fmadd(s.mul(dw[j], dx), s.cvt(q), *a);
            }
        }
        b0 += S::W / 32;
    }
    let mut out = [[0f32; C]; 4];
    for (o, a) in out.iter_mut().zip(&acc) {
        for (v, x) in o.iter_mut().zip(a) {
            *v = s.hsum(*x);
        }
    }
    out
}

/// Activation rows `r0..r0 + R` × panel columns `j0..j0 + C` of a 256-weight type: per
/// super-block `Σ sc · q·x` in i32 lanes (plus Q6_K's −32 in integers), times `d_w·d_x`.
/// Q4_K/Q5_K's mins are the caller's.
///
/// With VNNI, Q4_K/Q5_K's 6-bit scales are split as `sc = 8·(sc div 8) + sc mod 8` and each
/// half multiplied into the quants when the panel is filled (`q · 7 < 256`): two `vpdpbusd` per
/// 64 weights and no scale vectors, against `vpmaddubsw` + `vpdpwssd` (which LLVM splits into
/// `vpmaddwd` + `vpaddd` where it tunes for a generic CPU).
///
/// # Safety
/// The panel holds columns `j0..j0 + C` of `bpr` super-blocks; `x` holds rows `r0..r0 + 4`.
#[inline(always)]
unsafe fn k_tile<T: KUnpack, S: Simd, const R: usize, const C: usize>(
    s: S,
    p: &Panel,
    j0: usize,
    bpr: usize,
    x: &Q8KRows,
    r0: usize,
) -> [[f32; C]; R] {
    const { assert!(R == TILE_ROWS && C <= PANEL_COLS, "the scales' layout is for tiles of TILE_ROWS × PANEL_COLS") };
    let a2 = s.avx2();
    let split = S::VNNI && T::HAS_MIN;
    let mut acc = [[s.zero_f(); C]; R];
    for b in 0..bpr {
        let mut isum = [[s.zero(); C]; R];
        let mut ihi = [[s.zero(); C]; R];
        for st in 0..256 / S::W {
            let mut wv = [s.zero(); C];
            let mut sc = [s.zero(); C];
            for j in 0..C {
                let at = ((j0 + j) * bpr + b) * 256 + st * S::W;
                // SAFETY: column j0 + j, super-block b, step st of the panel
                unsafe {
                    wv[j] = s.load(p.q.as_ptr().add(at).cast());
                    sc[j] = if split {
                        s.load(p.hi.as_ptr().add(at).cast())
                    } else {
                        s.load(p.sc.as_ptr().add(at / 2).cast())
                    };
                }
            }
            for (i, (isum_i, ihi_i)) in isum.iter_mut().zip(ihi.iter_mut()).enumerate() {
                // SAFETY: row r0 + i, super-block b, bytes st·W.. of its 256
                let xv = unsafe { s.load(x.qs.as_ptr().add(((r0 + i) * bpr + b) * 256 + st * S::W)) };
                for j in 0..C {
                    if split {
                        isum_i[j] = s.dot_u8(isum_i[j], wv[j], xv);
                        ihi_i[j] = s.dot_u8(ihi_i[j], sc[j], xv);
                    } else {
                        isum_i[j] = s.dot_scaled(isum_i[j], wv[j], xv, sc[j]);
                    }
                }
            }
        }
        // d_x·d_w of the tile's R × C pairs in one multiply: the rows' four d_x (transposed
        // per tile, `Q8KRows::dt`) twice, times each column's d_w four times (the panel's `d`),
        // then broadcast from memory into the arithmetic
        let mut dd = [0f32; 8];
        // SAFETY: AVX (the token); four d_x of tile r0 / 4 at super-block b; eight d_w of the
        // panel from column j0 at super-block b (the panel pads them); eight floats on the stack
        unsafe {
            let dx = _mm256_broadcast_ps(&*x.dt.as_ptr().add((r0 / TILE_ROWS * bpr + b) * TILE_ROWS).cast::<__m128>());
            let dw = _mm256_loadu_ps(p.d.as_ptr().add((b * PANEL_COLS + j0) * TILE_ROWS));
            _mm256_storeu_ps(dd.as_mut_ptr(), _mm256_mul_ps(dx, dw));
        }
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let at = (r0 + i) * bpr + b;
            for (j, acc) in acc_i.iter_mut().enumerate() {
                let mut t = isum[i][j];
                if split {
                    t = s.add32(t, s.times8(ihi[i][j]));
                }
                if !T::HAS_MIN {
                    // SAFETY: row r0 + i, super-block b; column j0 + j, super-block b of the panel
                    let (bs, corr) = unsafe {
                        (
                            a2.load(x.bsums.as_ptr().add(16 * at).cast()),
                            a2.load(p.corr.as_ptr().add(16 * ((j0 + j) * bpr + b)).cast()),
                        )
                    };
                    t = s.add32(t, s.widen(a2.madd(bs, corr)));
                }
                *acc = s.fmadd(s.cvt(t), s.set1(dd[j * TILE_ROWS + i]), *acc);
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for (o, a) in out.iter_mut().zip(&acc) {
        for (v, x) in o.iter_mut().zip(a) {
            *v = s.hsum(*x);
        }
    }
    out
}

/// Where a group writes: the `m × n` output.
#[derive(Clone, Copy)]
pub struct Out {
    pub(super) ptr: usize,
    pub(super) m: usize,
    pub(super) n: usize,
}

impl Out {
    /// Writes `t` plus the group's min terms (`terms[jt + j][r0 - g0 + i]`, where there are
    /// any) at rows `r0..` (those below `g1` and `m`), columns `c0..c0 + C`.
    ///
    /// # Safety
    /// Only this work item writes those elements; `c0 + C ≤ n`; `jt + C ≤ PANEL_COLS`.
    #[inline(always)]
    unsafe fn put<const R: usize, const C: usize>(
        self,
        t: [[f32; C]; R],
        (g0, r0, g1): (usize, usize, usize),
        c0: usize,
        (terms, jt): (Option<&Terms>, usize),
    ) {
        for (i, row) in t.iter().enumerate().take(g1.min(self.m).saturating_sub(r0)) {
            for (j, v) in row.iter().enumerate() {
                let add = terms.map_or(0.0, |m| m[jt + j][r0 - g0 + i]);
                // SAFETY: (r0 + i, c0 + j) is inside the output (caller's contract)
                unsafe { *(self.ptr as *mut f32).add((r0 + i) * self.n + c0 + j) = *v + add };
            }
        }
    }

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
    for c in c0..c1 {
        for r0 in (0..out.m).step_by(DOT_ROWS) {
            // SAFETY: the caller's contract; rows r0..r0 + R are below out.m
            unsafe {
                with_rows!((out.m - r0).min(DOT_ROWS), R => out.put_column(q0_dot_rows::<T, S, R>(s, w, bpr, c, x, r0), r0, c))
            }
        }
    }
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
    for c in c0..c1 {
        for r0 in (0..out.m).step_by(DOT_ROWS) {
            // SAFETY: the caller's contract; rows r0..r0 + R are below out.m
            unsafe {
                with_rows!((out.m - r0).min(DOT_ROWS), R => out.put_column(k_dot_rows::<T, S, R>(s, w, bpr, c, x, r0), r0, c))
            }
        }
    }
}

/// Columns `c0..c0 + cols` (at most `S::Q0_C`) of activation rows `g0..g1` of a 32-weight type.
///
/// # Safety
/// As [`fill_q0`], [`q0_tile`] and [`min_terms`] for those columns and rows; only this call
/// writes them.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn q0_group<T: Q0Unpack, S: Simd>(
    s: S,
    w: &[T],
    bpr: usize,
    (c0, cols): (usize, usize),
    x: &Q8Rows,
    (g0, g1): (usize, usize),
    out: Out,
    p: &mut Panel,
) {
    // SAFETY: the caller's contract
    unsafe {
        fill_q0::<T, S>(s, w, (bpr, x.blocks), (c0, cols), p);
        let terms = q0_has_terms::<T, S>()
            .then(|| min_terms(s, p, cols, bpr, &x.st[(g0 / PROMPT_ROWS) * bpr * PROMPT_ROWS..], (g0, g1)));
        for r0 in (g0..g1).step_by(TILE_ROWS) {
            if S::Q0_C == 2 && cols == 2 {
                out.put(q0_tile::<T, S, 2>(s, p, 0, x, r0), (g0, r0, g1), c0, (terms.as_ref(), 0));
            } else {
                for j in 0..cols {
                    out.put(q0_tile::<T, S, 1>(s, p, j, x, r0), (g0, r0, g1), c0 + j, (terms.as_ref(), j));
                }
            }
        }
    }
}

/// Columns `c0..c0 + cols` (at most `S::K_C`) of activation rows `g0..g1` of a 256-weight type.
///
/// # Safety
/// As [`fill_k`], [`k_tile`] and [`min_terms`] for those columns and rows; only this call writes
/// them.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn k_group<T: KUnpack, S: Simd>(
    s: S,
    w: &[T],
    bpr: usize,
    (c0, cols): (usize, usize),
    x: &Q8KRows,
    (g0, g1): (usize, usize),
    out: Out,
    p: &mut Panel,
) {
    // SAFETY: the caller's contract
    unsafe {
        fill_k::<T, S>(s, w, bpr, (c0, cols), p);
        let kk = 8 * bpr;
        let terms =
            T::HAS_MIN.then(|| min_terms(s, p, cols, kk, &x.st[(g0 / PROMPT_ROWS) * kk * PROMPT_ROWS..], (g0, g1)));
        for r0 in (g0..g1).step_by(TILE_ROWS) {
            if S::K_C == 2 && cols == 2 {
                out.put(k_tile::<T, S, 4, 2>(s, p, 0, bpr, x, r0), (g0, r0, g1), c0, (terms.as_ref(), 0));
            } else {
                for j in 0..cols {
                    out.put(k_tile::<T, S, 4, 1>(s, p, j, bpr, x, r0), (g0, r0, g1), c0 + j, (terms.as_ref(), j));
                }
            }
        }
    }
}

/// Runs `columns((c0, c1))` over every column, ranges of columns split across candle's pool.
fn each_column_range(n: usize, columns: impl Fn((usize, usize)) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(n, |cols| columns((cols.start, cols.end)));
}

/// Runs `group((c0, cols), panel)` over every group of up to `tc` columns, split across
/// candle's pool.
fn each_column_group(n: usize, tc: usize, group: impl Fn((usize, usize), &mut Panel) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(tc), |groups| {
        PANEL.with(|p| {
            let p = &mut p.borrow_mut();
            for g in groups {
                let c0 = g * tc;
                group((c0, (n - c0).min(tc)), p);
            }
        })
    });
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
    if S::VNNI {
        // the min or offset terms come from `x.s`, so the rows are quantized with no offset
        let x = Q8Rows::new(lhs, (m, k), m.next_multiple_of(TILE_ROWS), blocks, 0);
        // SAFETY: each block writes its own columns of every row; rows are padded to tiles
        lanes::each_block(n, lanes::block_cols::<S>(), |cols, p| unsafe { s.q0_lanes(w, bpr, cols, &x, out, p) });
        return;
    }
    let mut x = Q8Rows::new(lhs, (m, k), m.next_multiple_of(TILE_ROWS), blocks, offset);
    if q0_has_terms::<T, S>() {
        x.st = transposed_groups(&x.s, (x.blocks, bpr), m, PROMPT_ROWS);
    }
    for g0 in (0..m).step_by(PROMPT_ROWS) {
        let rows = (g0, (g0 + PROMPT_ROWS).min(m));
        // SAFETY: each group writes its own columns of these rows; rows are padded to tiles
        each_column_group(n, S::Q0_C, |cols, p| unsafe { s.q0_group(w, bpr, cols, &x, rows, out, p) });
    }
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
    if S::VNNI {
        let x = Q8KRows::new(lhs, (m, k), m.next_multiple_of(TILE_ROWS));
        // SAFETY: each block writes its own columns of every row; rows are padded to tiles
        lanes::each_block(n, lanes::block_cols::<S>(), |cols, p| unsafe { s.k_lanes(w, bpr, cols, &x, out, p) });
        return;
    }
    let mut x = Q8KRows::new(lhs, (m, k), m.next_multiple_of(TILE_ROWS));
    x.dt = x.tile_scales(TILE_ROWS, bpr);
    if T::HAS_MIN {
        x.st = transposed_groups(&x.s32, (8 * bpr, 8 * bpr), m, PROMPT_ROWS);
    }
    for g0 in (0..m).step_by(PROMPT_ROWS) {
        let rows = (g0, (g0 + PROMPT_ROWS).min(m));
        // SAFETY: each group writes its own columns of these rows; rows are padded to tiles
        each_column_group(n, S::K_C, |cols, p| unsafe { s.k_group(w, bpr, cols, &x, rows, out, p) });
    }
}
