//! Prompts (more rows than `DECODE_ROWS`): output columns in vector lanes.
//!
//! Register tiles that give each (row, column) pair a vector of its own and add up its lanes at
//! the end (what brigade had before, and what the decode vec-dots still do) end every
//! super-block with a float step per pair (convert, scale, add) and every tile with a
//! horizontal sum and scattered writes. Here a block of `W/4` (or `W/2` on 512-bit registers)
//! weight columns is unpacked into a panel where lane `c` of each
//! vector holds four consecutive quants of column `c`; each row's four activation bytes are
//! broadcast to every lane, and one `vpdpbusd` advances `W/4` columns of one row by four
//! weights. A super-block's float step is then one per row and vector of columns, a row's
//! results are whole vectors written in place, and the min terms are `W/4` columns at a time.
//!
//! With VNNI a weight costs one `vpdpbusd` per row (without, `vpmaddubsw` + `vpmaddwd`): the
//! K-quants' sub-block sums are multiplied by their scales in i32 lanes once per 32 or 16
//! weights (`vpmulld`, exact); the 32-weight types' float step is per block of 32 (Q8_0's
//! signed quants are made unsigned by 128, taken away again with the min terms). The panel of
//! a block of columns serves every row of the matmul.

use super::acts::{Q8KRows, Q8Rows};
use super::simd::Simd;
use super::tiles::q0_offset;
use super::tiles::Out;
use super::unpack::KUnpack;
use super::unpack::Q0Unpack;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Activation rows per tile (the quantized rows are padded to a multiple).
pub const ROWS: usize = 4;

/// Vectors of columns per tile: two on 512-bit registers (32 columns; 24 accumulators and 5
/// operands fit the 32 registers), one on 256-bit ones (8 columns; 16 registers).
pub const fn vectors<S: Simd>() -> usize {
    if S::W == 64 {
        2
    } else {
        1
    }
}

/// Columns per block: the panel's width.
pub const fn block_cols<S: Simd>() -> usize {
    vectors::<S>() * S::W / 4
}

/// A block of weight columns unpacked for [`k_block`] (one per worker thread, reused).
#[derive(Default)]
pub struct LanePanel {
    /// The quants: four-byte group `u` (weights `4u..4u + 4` of the row) of column `c` at byte
    /// `(u·cols + c)·4`.
    lo: Vec<u8>,
    /// K-quants: the scale of sub-block `t` of super-block `b` (32 weights for Q4_K/Q5_K, 16
    /// for Q6_K), column `c` at `(16b + t)·cols + c`, i32.
    sc: Vec<i32>,
    /// `d` of super-block `b`, column `c` at `b·cols + c`.
    d: Vec<f32>,
    /// `−dmin · m` of sub-block `s` (of 32 weights), column `c` at `s·cols + c`.
    mins: Vec<f32>,
}

thread_local! {
    static PANEL: RefCell<LanePanel> = RefCell::new(LanePanel::default());
}

/// Runs `block((c0, cols), panel)` over every block of `nc` columns, split across candle's pool.
pub fn each_block(n: usize, nc: usize, block: impl Fn((usize, usize), &mut LanePanel) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(nc), |blocks| {
        PANEL.with(|p| {
            let p = &mut p.borrow_mut();
            for b in blocks {
                let c0 = b * nc;
                block((c0, (n - c0).min(nc)), p);
            }
        })
    });
}

/// The 8 × 8 i32 matrix `v` transposed: lane `j` of `v[i]` to lane `i` of `v[j]`.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn transpose8(v: &mut [__m256i; 8]) {
    // SAFETY: AVX2 (the caller's contract), on registers only
    unsafe {
        let t0 = _mm256_unpacklo_epi32(v[0], v[1]);
        let t1 = _mm256_unpackhi_epi32(v[0], v[1]);
        let t2 = _mm256_unpacklo_epi32(v[2], v[3]);
        let t3 = _mm256_unpackhi_epi32(v[2], v[3]);
        let t4 = _mm256_unpacklo_epi32(v[4], v[5]);
        let t5 = _mm256_unpackhi_epi32(v[4], v[5]);
        let t6 = _mm256_unpacklo_epi32(v[6], v[7]);
        let t7 = _mm256_unpackhi_epi32(v[6], v[7]);
        let u0 = _mm256_unpacklo_epi64(t0, t2);
        let u1 = _mm256_unpackhi_epi64(t0, t2);
        let u2 = _mm256_unpacklo_epi64(t1, t3);
        let u3 = _mm256_unpackhi_epi64(t1, t3);
        let u4 = _mm256_unpacklo_epi64(t4, t6);
        let u5 = _mm256_unpackhi_epi64(t4, t6);
        let u6 = _mm256_unpacklo_epi64(t5, t7);
        let u7 = _mm256_unpackhi_epi64(t5, t7);
        v[0] = _mm256_permute2x128_si256::<0x20>(u0, u4);
        v[1] = _mm256_permute2x128_si256::<0x20>(u1, u5);
        v[2] = _mm256_permute2x128_si256::<0x20>(u2, u6);
        v[3] = _mm256_permute2x128_si256::<0x20>(u3, u7);
        v[4] = _mm256_permute2x128_si256::<0x31>(u0, u4);
        v[5] = _mm256_permute2x128_si256::<0x31>(u1, u5);
        v[6] = _mm256_permute2x128_si256::<0x31>(u2, u6);
        v[7] = _mm256_permute2x128_si256::<0x31>(u3, u7);
    }
}

/// Unpacks columns `c0..c0 + cols` (at most [`block_cols`]) of a K-quant weight into `p`,
/// columns past `cols` zero.
///
/// # Safety
/// `w` holds those columns of `bpr` super-blocks each.
#[inline(always)]
unsafe fn fill<T: KUnpack, S: Simd>(s: S, w: &[T], bpr: usize, (c0, cols): (usize, usize), p: &mut LanePanel) {
    let a2 = s.avx2();
    let nc = block_cols::<S>();
    p.lo.clear();
    p.lo.resize(256 * bpr * nc, 0);
    p.sc.clear();
    p.sc.resize(16 * bpr * nc, 0);
    p.d.clear();
    p.d.resize(bpr * nc, 0.0);
    p.mins.clear();
    p.mins.resize(8 * bpr * nc, 0.0);
    for g in (0..cols).step_by(8) {
        for b in 0..bpr {
            for j in 0..8.min(cols - g) {
                let c = g + j;
                // SAFETY: column c0 + c < c0 + cols, super-block b is in `w`
                let blk = unsafe { w.get_unchecked((c0 + c) * bpr + b) };
                let ks = blk.scales(a2);
                let (mut corr, mut sc) = ([0i16; 16], [0i8; 16]);
                // SAFETY: AVX2 (the token); 16 i16 and 16 i8 on the stack
                unsafe {
                    a2.store(corr.as_mut_ptr().cast(), ks.corr);
                    _mm_storeu_si128(sc.as_mut_ptr().cast(), ks.sc);
                }
                let (d, dmin) = (ks.d.to_f32(), ks.dmin.to_f32());
                p.d[b * nc + c] = d;
                if T::HAS_MIN {
                    for t in 0..8 {
                        p.sc[(b * 16 + t) * nc + c] = sc[2 * t] as i32;
                        p.mins[(b * 8 + t) * nc + c] = -dmin * corr[2 * t] as f32;
                    }
                } else {
                    for (t, sc) in sc.iter().enumerate() {
                        p.sc[(b * 16 + t) * nc + c] = *sc as i32;
                    }
                }
            }
            for t in 0..8 {
                let mut q = [a2.zero(); 8];
                for (j, q) in q.iter_mut().enumerate().take(cols - g) {
                    // SAFETY: as above
                    *q = unsafe { w.get_unchecked((c0 + g + j) * bpr + b) }.chunk(a2, t);
                }
                // lane j of vector i: group i of sub-block t of column g + j
                // SAFETY: AVX2 (the token); groups b·64 + 8t + i, columns g..g + 8 ≤ nc, inside
                // the panel sized above
                unsafe {
                    transpose8(&mut q);
                    for (i, v) in q.iter().enumerate() {
                        a2.store(p.lo.as_mut_ptr().add(((b * 64 + 8 * t + i) * nc + g) * 4), *v);
                    }
                }
            }
        }
    }
}

/// Rows `r0..r0 + ROWS` × the panel's `V` vectors of columns: per sub-block `Σ q·x` in i32
/// lanes (Q6_K: less `32·Σx`, its quants' offset) times the sub-block's scale (`vpmulld`,
/// exact: at most 8 · 32·31·127·63 or 16 · 16·63·127·128, below 2³¹), per super-block that
/// sum times `d_w·d_x`, plus Q4_K/Q5_K's min terms `Σ −dmin·m · d_x·Σx`.
///
/// # Safety
/// The panel is filled for `bpr` super-blocks; `x` holds rows `r0..r0 + ROWS`.
#[inline(always)]
unsafe fn tile<T: KUnpack, S: Simd, const V: usize>(
    s: S,
    p: &LanePanel,
    bpr: usize,
    x: &Q8KRows,
    r0: usize,
) -> [[S::F; V]; ROWS] {
    let (lanes, nc) = (S::W / 4, block_cols::<S>());
    // four-byte groups per sub-block: 32 weights (Q4_K/Q5_K) or 16 (Q6_K)
    let per = if T::HAS_MIN { 8 } else { 4 };
    let mut acc = [[s.zero_f(); V]; ROWS];
    for b in 0..bpr {
        let mut isum = [[s.zero(); V]; ROWS];
        for t in 0..64 / per {
            let mut sum = [[s.zero(); V]; ROWS];
            for u in per * t..per * t + per {
                let at = ((b * 64 + u) * nc) * 4;
                let mut wv = [s.zero(); V];
                for (v, wv) in wv.iter_mut().enumerate() {
                    // SAFETY: group b·64 + u of the panel, columns v·lanes.. of nc
                    *wv = unsafe { s.load(p.lo.as_ptr().add(at + v * S::W).cast()) };
                }
                for (i, sum) in sum.iter_mut().enumerate() {
                    // SAFETY: bytes 4u..4u + 4 of super-block b of row r0 + i
                    let xb = unsafe { s.bcast32(x.qs.as_ptr().add(((r0 + i) * bpr + b) * 256 + 4 * u)) };
                    for v in 0..V {
                        sum[v] = s.dot_u8(sum[v], wv[v], xb);
                    }
                }
            }
            if !T::HAS_MIN {
                for (i, sum) in sum.iter_mut().enumerate() {
                    // SAFETY: the sum of 16 t of super-block b of row r0 + i
                    let bs = unsafe { *x.bsums.get_unchecked(((r0 + i) * bpr + b) * 16 + t) } as i32;
                    let off = s.per_block_i32([-32 * bs; 2]);
                    for v in sum.iter_mut() {
                        *v = s.add32(*v, off);
                    }
                }
            }
            for v in 0..V {
                // SAFETY: the scales of sub-block t of super-block b, columns v·lanes..
                let sc = unsafe { s.load(p.sc.as_ptr().add((b * 16 + t) * nc + v * lanes).cast()) };
                for (isum, sum) in isum.iter_mut().zip(&sum) {
                    isum[v] = s.add32(isum[v], s.mullo32(sum[v], sc));
                }
            }
        }
        for (i, (acc, isum)) in acc.iter_mut().zip(&isum).enumerate() {
            let at = (r0 + i) * bpr + b;
            // SAFETY: super-block b of row r0 + i and its 8 sums per 32; d and mins of
            // super-block b, columns v·lanes.. of the panel
            unsafe {
                let dx = s.set1(*x.d.get_unchecked(at));
                for v in 0..V {
                    let dw = s.load_f(p.d.as_ptr().add(b * nc + v * lanes));
                    acc[v] = s.fmadd(s.cvt(isum[v]), s.mul(dx, dw), acc[v]);
                    if T::HAS_MIN {
                        for sb in 0..8 {
                            let m = s.load_f(p.mins.as_ptr().add((b * 8 + sb) * nc + v * lanes));
                            acc[v] = s.fmadd(s.set1(*x.s32.get_unchecked(at * 8 + sb)), m, acc[v]);
                        }
                    }
                }
            }
        }
    }
    acc
}

/// Columns `c0..c0 + cols` (at most [`block_cols`]) of every row of `out` for a K-quant
/// weight: the panel filled once, then every tile of rows.
///
/// # Safety
/// `w` holds those columns of `bpr` super-blocks; `x` holds `out.m` rows padded to a multiple
/// of 4; only this call writes those columns.
#[inline(always)]
pub unsafe fn k_block<T: KUnpack, S: Simd>(
    s: S,
    w: &[T],
    bpr: usize,
    (c0, cols): (usize, usize),
    x: &Q8KRows,
    out: Out,
    p: &mut LanePanel,
) {
    debug_assert!(cols <= block_cols::<S>());
    // SAFETY: the caller's contract
    unsafe { fill::<T, S>(s, w, bpr, (c0, cols), p) };
    for r0 in (0..out.m).step_by(ROWS) {
        // SAFETY: the caller's contract: rows r0..r0 + 4 are in `x`
        let t = unsafe {
            if vectors::<S>() == 2 {
                tile_rows(s, tile::<T, S, 2>(s, p, bpr, x, r0))
            } else {
                tile_rows(s, tile::<T, S, 1>(s, p, bpr, x, r0))
            }
        };
        // SAFETY: the caller's contract
        unsafe { put_rows(s, t, r0, (c0, cols), out) };
    }
}

/// A tile's rows as arrays of two vectors (the second unused where there is one).
#[inline(always)]
fn tile_rows<S: Simd, const V: usize>(s: S, t: [[S::F; V]; ROWS]) -> [[S::F; 2]; ROWS] {
    let mut r = [[s.zero_f(); 2]; ROWS];
    for (o, i) in r.iter_mut().zip(&t) {
        o[..V].copy_from_slice(i);
    }
    r
}

/// Unpacks columns `c0..c0 + cols` (at most [`block_cols`]) of a 32-weight type into `p`
/// (quants in `lo`, `d` per block, the min or offset term's weight per block in `mins`),
/// columns past `cols` zero.
///
/// # Safety
/// `w` holds those columns of `bpr` blocks each.
#[inline(always)]
unsafe fn fill_q0<T: Q0Unpack, S: Simd>(s: S, w: &[T], bpr: usize, (c0, cols): (usize, usize), p: &mut LanePanel) {
    let a2 = s.avx2();
    let nc = block_cols::<S>();
    p.lo.clear();
    p.lo.resize(32 * bpr * nc, 0);
    p.d.clear();
    p.d.resize(bpr * nc, 0.0);
    p.mins.clear();
    p.mins.resize(bpr * nc, 0.0);
    let offset = q0_offset::<T, S>();
    for g in (0..cols).step_by(8) {
        for b in 0..bpr {
            let mut q = [a2.zero(); 8];
            for (j, q) in q.iter_mut().enumerate().take(cols - g) {
                let c = g + j;
                // SAFETY: column c0 + c < c0 + cols, block b is in `w`
                let blk = unsafe { w.get_unchecked((c0 + c) * bpr + b) };
                let d = blk.d().to_f32();
                p.d[b * nc + c] = d;
                p.mins[b * nc + c] = if T::HAS_MIN { blk.m().to_f32() } else { -offset as f32 * d };
                *q = blk.unpack(a2);
                if T::SIGNED && S::VNNI {
                    *q = a2.flip(*q);
                }
            }
            // lane j of vector i: group i of block b of column g + j
            // SAFETY: AVX2 (the token); groups b·8 + i, columns g..g + 8 ≤ nc, inside the panel
            unsafe {
                transpose8(&mut q);
                for (i, v) in q.iter().enumerate() {
                    a2.store(p.lo.as_mut_ptr().add(((b * 8 + i) * nc + g) * 4), *v);
                }
            }
        }
    }
}

/// Rows `r0..r0 + ROWS` × the panel's `V` vectors of columns of a 32-weight type: per block
/// `Σ q·x` in i32 lanes times `d_w·d_x`, plus the min or offset term `mins · d_x·Σx`.
///
/// # Safety
/// The panel is filled for `bpr` blocks; `x` holds rows `r0..r0 + ROWS` of at least `bpr`
/// blocks.
#[inline(always)]
unsafe fn tile_q0<T: Q0Unpack, S: Simd, const V: usize>(
    s: S,
    p: &LanePanel,
    bpr: usize,
    x: &Q8Rows,
    r0: usize,
) -> [[S::F; V]; ROWS] {
    let (lanes, nc) = (S::W / 4, block_cols::<S>());
    let terms = T::HAS_MIN || q0_offset::<T, S>() != 0;
    let mut acc = [[s.zero_f(); V]; ROWS];
    for b in 0..bpr {
        let mut sum = [[s.zero(); V]; ROWS];
        for u in 0..8 {
            let at = ((b * 8 + u) * nc) * 4;
            let mut wv = [s.zero(); V];
            for (v, wv) in wv.iter_mut().enumerate() {
                // SAFETY: group b·8 + u of the panel, columns v·lanes.. of nc
                *wv = unsafe { s.load(p.lo.as_ptr().add(at + v * S::W).cast()) };
            }
            for (i, sum) in sum.iter_mut().enumerate() {
                // SAFETY: bytes 4u..4u + 4 of block b of row r0 + i
                let xb = unsafe { s.bcast32(x.qs.as_ptr().add((r0 + i) * x.kp + 32 * b + 4 * u)) };
                for v in 0..V {
                    sum[v] =
                        if T::SIGNED && !S::VNNI { s.dot_s8(sum[v], wv[v], xb) } else { s.dot_u8(sum[v], wv[v], xb) };
                }
            }
        }
        for (i, (acc, sum)) in acc.iter_mut().zip(&sum).enumerate() {
            let at = (r0 + i) * x.blocks + b;
            // SAFETY: block b of row r0 + i; d and mins of block b, columns v·lanes.. of the panel
            unsafe {
                let dx = s.set1(*x.d.get_unchecked(at));
                for v in 0..V {
                    let dw = s.load_f(p.d.as_ptr().add(b * nc + v * lanes));
                    acc[v] = s.fmadd(s.cvt(sum[v]), s.mul(dx, dw), acc[v]);
                    if terms {
                        let m = s.load_f(p.mins.as_ptr().add(b * nc + v * lanes));
                        acc[v] = s.fmadd(s.set1(*x.s.get_unchecked(at)), m, acc[v]);
                    }
                }
            }
        }
    }
    acc
}

/// Columns `c0..c0 + cols` (at most [`block_cols`]) of every row of `out` for a 32-weight type,
/// as [`k_block`].
///
/// # Safety
/// `w` holds those columns of `bpr` blocks; `x` holds `out.m` rows padded to a multiple of 4,
/// quantized with no offset; only this call writes those columns.
#[inline(always)]
pub unsafe fn q0_block<T: Q0Unpack, S: Simd>(
    s: S,
    w: &[T],
    bpr: usize,
    (c0, cols): (usize, usize),
    x: &Q8Rows,
    out: Out,
    p: &mut LanePanel,
) {
    debug_assert!(cols <= block_cols::<S>());
    // SAFETY: the caller's contract
    unsafe { fill_q0::<T, S>(s, w, bpr, (c0, cols), p) };
    for r0 in (0..out.m).step_by(ROWS) {
        // SAFETY: the caller's contract: rows r0..r0 + 4 are in `x`
        let t = unsafe {
            if vectors::<S>() == 2 {
                tile_rows(s, tile_q0::<T, S, 2>(s, p, bpr, x, r0))
            } else {
                tile_rows(s, tile_q0::<T, S, 1>(s, p, bpr, x, r0))
            }
        };
        // SAFETY: the caller's contract
        unsafe { put_rows(s, t, r0, (c0, cols), out) };
    }
}

/// Writes a tile's rows (those below `out.m`) at columns `c0..c0 + cols`.
///
/// # Safety
/// Those elements are inside the output and written by this call only.
#[inline(always)]
unsafe fn put_rows<S: Simd>(s: S, t: [[S::F; 2]; ROWS], r0: usize, (c0, cols): (usize, usize), out: Out) {
    let lanes = S::W / 4;
    for (i, row) in t.iter().enumerate().take(out.m - r0) {
        // SAFETY: row r0 + i < m, columns c0..c0 + cols ≤ n (the caller's contract)
        unsafe {
            let dst = (out.ptr as *mut f32).add((r0 + i) * out.n + c0);
            if cols == block_cols::<S>() {
                for (v, r) in row.iter().enumerate().take(vectors::<S>()) {
                    s.store_f(dst.add(v * lanes), *r);
                }
            } else {
                let mut all = [0f32; 32];
                for (v, r) in row.iter().enumerate().take(vectors::<S>()) {
                    s.store_f(all.as_mut_ptr().add(v * lanes), *r);
                }
                std::ptr::copy_nonoverlapping(all.as_ptr(), dst, cols);
            }
        }
    }
}
