//! Activations quantized to int8 as the kernels read them (ggml's arithmetic: a scale
//! `d = max|x| / 127` per block, `q = round(x / d)` in −127..=127, never −128).
//!
//! Rows are padded with zero rows to whole tiles, and Q8 rows with zero blocks to whole vectors,
//! so that no kernel reads past a row or needs an edge case: a zero row quantizes to `d = 0`.

/// `x` to the nearest integer, ties to even, clamped to −127..=127 (NaN to −127): adding
/// 1.5 × 2^23 to a value that small leaves an f32 whose low mantissa bits are the integer
/// (offset by the constant's bits). `f32::round` is a `roundf` call on baseline x86_64 (no
/// SSE4.1), and `as i32`'s saturating conversion keeps the loop from vectorizing; integer
/// arithmetic on the bits does neither.
#[inline(always)]
fn rint(x: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    // max and min, not clamp: clamp keeps a NaN
    #[allow(clippy::manual_clamp)]
    let x = x.max(-127.0).min(127.0);
    (x + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32
}

/// Quantizes `x` into `q`; returns `(d, Σq)`.
#[inline(always)]
fn quantize(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    // in 8 lanes, so that it vectorizes: a max is exact in any order (NaNs are passed over
    // either way)
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(0f32, |m, v| m.max(v.abs()));
    for c in chunks {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    let amax = lanes.iter().fold(tail, |m, v| m.max(*v));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0;
    for (o, v) in q.iter_mut().zip(x) {
        let r = rint(v * id);
        *o = r as i8;
        sum += r;
    }
    (d, sum)
}

/// A buffer of rows `len` long that the pool's workers fill, each row by one worker.
struct Rows<T> {
    ptr: *mut T,
    len: usize,
    rows: usize,
}

// SAFETY: workers take disjoint rows (the contract of `row`)
unsafe impl<T: Send> Sync for Rows<T> {}

impl<T> Rows<T> {
    fn new(v: &mut [T], len: usize) -> Self {
        Rows { ptr: v.as_mut_ptr(), len, rows: v.len() / len.max(1) }
    }

    /// # Safety
    /// No other reference to row `r` exists while this one lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, r: usize) -> &mut [T] {
        assert!(r < self.rows);
        // SAFETY: inside the buffer (asserted); exclusive by the contract
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r * self.len), self.len) }
    }
}

/// `f(r)` for rows `0..m`, split across candle's pool when there are several.
fn each_row(m: usize, f: impl Fn(usize) + Sync) {
    if m > 1 {
        candle_core::utils::barrier_pool().execute_chunked(m, |rows| rows.for_each(&f));
    } else {
        (0..m).for_each(f);
    }
}

/// Activation rows quantized per 32: the operand of the Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
/// kernels. Row `r`, block `b` is `qs[r·kp + 32b..]`, `d[r·blocks + b]`, ….
pub struct Q8Rows {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    /// `−Σq · offset / 8` per block: eight i32 lanes starting from it subtract `offset · Σq`
    /// from their sum (the weights' offset, Q4_0's 8 or Q5_0's 16, or the 128 that makes Q8_0's
    /// signed weights unsigned for VNNI).
    pub fill: Vec<i32>,
    /// `d · Σq` per block (the min term of Q4_1/Q5_1: `m · d · Σq`).
    pub s: Vec<f32>,
    /// `Σq` per block.
    pub sums: Vec<i32>,

    /// Blocks per row (padded), `kp = 32 · blocks`.
    pub blocks: usize,
    pub kp: usize,
}

impl Q8Rows {
    /// `rows ≥ m` rows of `blocks ≥ k/32` blocks from `lhs[m, k]`; `offset` as for [`Self::fill`].
    pub fn new(lhs: &[f32], (m, k): (usize, usize), rows: usize, blocks: usize, offset: i32) -> Q8Rows {
        let kp = 32 * blocks;
        let mut x = Q8Rows {
            qs: vec![0; rows * kp],
            d: vec![0.0; rows * blocks],
            fill: vec![0; rows * blocks],
            s: vec![0.0; rows * blocks],
            sums: vec![0; rows * blocks],
            blocks,
            kp,
        };
        let (qs, d, fill, s, sums) = (
            Rows::new(&mut x.qs, kp),
            Rows::new(&mut x.d, blocks),
            Rows::new(&mut x.fill, blocks),
            Rows::new(&mut x.s, blocks),
            Rows::new(&mut x.sums, blocks),
        );
        each_row(m, |r| {
            // SAFETY: row r is taken by this call only
            let (qs, d, fill, s, sums) = unsafe { (qs.row(r), d.row(r), fill.row(r), s.row(r), sums.row(r)) };
            let xs = lhs[r * k..(r + 1) * k].chunks_exact(32);
            for (b, (xb, qb)) in xs.zip(qs.chunks_exact_mut(32)).enumerate() {
                let (db, sum) = quantize(xb, qb);
                d[b] = db;
                fill[b] = -sum * (offset / 8);
                s[b] = db * sum as f32;
                sums[b] = sum;
            }
        });
        x
    }

    /// The dequantized activations `d·q` of row `r` (the scalar reference's operand).
    #[cfg(test)]
    pub fn dequant_row(&self, r: usize, k: usize) -> Vec<f32> {
        (0..k).map(|i| self.d[r * self.blocks + i / 32] * self.qs[r * self.kp + i] as f32).collect()
    }
}

/// One row's share of [`Q8KRows`].
struct K8Row<'a> {
    qs: &'a mut [i8],
    d: &'a mut [f32],
    bsums: &'a mut [i16],
    s32: &'a mut [f32],
    bs32: &'a mut [i16],
}

/// Whether [`Q8KRows::new`] runs its loops compiled for AVX2 and FMA (the same operations on
/// 256-bit registers: they were scalar SSE code, 6% of a prompt's time with AMX matmuls).
fn wide_loops() -> bool {
    super::Isa::Avx2.available()
}

/// [`q8k_row`] compiled for AVX2 and FMA.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8k_row_avx2(x: &[f32], row: K8Row<'_>) {
    q8k_row(x, row)
}

/// Quantizes one row `x` (whole super-blocks of 256) into `row`.
#[inline(always)]
fn q8k_row(x: &[f32], row: K8Row<'_>) {
    let K8Row { qs, d, bsums, s32, bs32 } = row;
    for (b, xb) in x.chunks_exact(256).enumerate() {
        let q = &mut qs[b * 256..(b + 1) * 256];
        let (db, _) = quantize(xb, q);
        d[b] = db;
        for (j, q16) in q.chunks_exact(16).enumerate() {
            // 16 × 127 fits i16
            bsums[b * 16 + j] = q16.iter().map(|&v| v as i16).sum();
        }
        for j in 0..8 {
            s32[b * 8 + j] = db * (bsums[b * 16 + 2 * j] as f32 + bsums[b * 16 + 2 * j + 1] as f32);
            // 32 × 127 fits i16
            let pos = [0, 2, 1, 3, 4, 6, 5, 7][j];
            bs32[b * 8 + pos] = bsums[b * 16 + 2 * j] + bsums[b * 16 + 2 * j + 1];
        }
    }
}

/// Activation rows quantized per 256 (ggml's Q8_K): the operand of the Q4_K, Q5_K and Q6_K
/// kernels, whose sub-block scales then combine in integers. Row `r`, super-block `b` is
/// `qs[(r·bpr + b)·256..]`, `d[r·bpr + b]`, `bsums[(r·bpr + b)·16..]`.
pub struct Q8KRows {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    /// `Σq` per 16.
    pub bsums: Vec<i16>,
    /// `d · Σq` per 32 (the mins' term of prompts as a matrix, `rows × k/32`).
    pub s32: Vec<f32>,
    /// `Σq` per 32, eight per super-block in the order 0, 2, 1, 3, 4, 6, 5, 7: i16 pairs for
    /// `vpmaddwd` against the packed Q4_K mins (see `packed`).
    pub bs32: Vec<i16>,
}

impl Q8KRows {
    pub fn new(lhs: &[f32], (m, k): (usize, usize), rows: usize) -> Q8KRows {
        let bpr = k / 256;
        let mut x = Q8KRows {
            qs: vec![0; rows * k],
            d: vec![0.0; rows * bpr],
            bsums: vec![0; rows * bpr * 16],
            s32: vec![0.0; rows * k / 32],
            bs32: vec![0; rows * k / 32],
        };
        let (qs, d, bsums, s32, bs32) = (
            Rows::new(&mut x.qs, k),
            Rows::new(&mut x.d, bpr),
            Rows::new(&mut x.bsums, 16 * bpr),
            Rows::new(&mut x.s32, 8 * bpr),
            Rows::new(&mut x.bs32, 8 * bpr),
        );
        let wide = wide_loops();
        each_row(m, |r| {
            // SAFETY: row r is taken by this call only
            let row = unsafe {
                K8Row { qs: qs.row(r), d: d.row(r), bsums: bsums.row(r), s32: s32.row(r), bs32: bs32.row(r) }
            };
            let x = &lhs[r * k..(r + 1) * k];
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: `wide_loops` checked the instructions
                return unsafe { q8k_row_avx2(x, row) };
            }
            let _ = wide;
            q8k_row(x, row)
        });
        x
    }

    #[cfg(test)]
    pub fn dequant_row(&self, r: usize, k: usize) -> Vec<f32> {
        let bpr = k / 256;
        (0..k).map(|i| self.d[r * bpr + i / 256] * self.qs[r * k + i] as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rint_rounds_to_nearest_even() {
        for (x, want) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.6, 127),
            (-127.0, -127),
            (0.49, 0),
            (300.0, 127),
            (-1e30, -127),
            (f32::NAN, -127),
            (-0.0, 0),
        ] {
            assert_eq!(rint(x), want, "{x}");
        }
    }

    #[test]
    fn quantized_rows_round_trip_within_half_a_step() {
        let (m, k) = (3usize, 512usize);
        let lhs: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1001) as f32 / 100.0 - 5.0).collect();
        let a = Q8Rows::new(&lhs, (m, k), 4, 18, 8);
        let b = Q8KRows::new(&lhs, (m, k), 4);
        for r in 0..m {
            let (da, db) = (a.dequant_row(r, k), b.dequant_row(r, k));
            for i in 0..k {
                let x = lhs[r * k + i];
                assert!((da[i] - x).abs() <= 0.5 * a.d[r * a.blocks + i / 32] + 1e-6, "q8 {r},{i}");
                assert!((db[i] - x).abs() <= 0.5 * b.d[r * (k / 256) + i / 256] + 1e-6, "q8k {r},{i}");
            }
            let sum: i32 = a.qs[r * a.kp..r * a.kp + 32].iter().map(|&q| q as i32).sum();
            assert_eq!(a.fill[r * a.blocks], -sum);
        }
        // padding rows and blocks are zero
        assert!(a.qs[3 * a.kp..].iter().all(|&q| q == 0) && a.qs[k..a.kp].iter().all(|&q| q == 0));
        assert!(b.d[3 * (k / 256)..].iter().all(|&d| d == 0.0));
    }
}
