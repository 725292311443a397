//! Weights repacked once at load for the int8 kernels, and the kernels that read them: one
//! kernel for every number of rows, decode and prompt alike.
//!
//! A ggml file keeps each weight row's blocks together, so a kernel that wants 16 or 32 output
//! columns in the lanes of a vector (`lanes`) must gather them: the prompt kernels unpack a
//! panel per matmul, which only pays from about 12 rows, and decode stays on vec-dots whose
//! per-row epilogue (a float step and a horizontal sum per column) makes 8 rows cost ~4.4× one.
//! Here the gathering is done once, when the model loads, into records of [`COLS`] columns by
//! one block of `k` (256 weights for Q4_K/Q6_K, 32 for Q8_0), each exactly the bytes the file
//! has for them (the same memory, the nibbles still packed):
//!
//! - Q4_K (144 bytes per column and super-block): 32 units of 8 weights, unit `u` of column `c`
//!   at `(32u + c)·4`, byte `j` holding weight `8u + j` in its low nibble and `8u + 4 + j` in
//!   its high one; the 12 scale bytes as three words per column (word `w` of column `c` at
//!   `4096 + (32w + c)·4`, ggml's bit layout, unpacked in lanes by the kernel); `d` and `dmin`
//!   as f16 per column at 4480 and 4544.
//! - Q5_K (176): a Q4_K record, then per 32 weights `t` the fifth bits as one word per column
//!   (`fifth_word`, as Q5_0's) at `4608 + (32t + c)·4`.
//! - Q6_K (210): the low nibbles as Q4_K's units; the high two bits per 16 weights `t` as one
//!   word per column, byte `j` holding those of weights `16t + 4s + j` at bits `2s, 2s + 1`;
//!   the 16 scales (i8); per 32 weights those four units, two words and 64 scale bytes are 832
//!   bytes in a row (`q6_unit`, `q6_high`, `q6_scale`: read in order — three regions read
//!   in step were 0.6× the vec-dots' speed from memory); `d` at 6656.
//! - Q8_0 (34): 8 units of 4 weights at `(32u + c)·4`; `d` at 1024.
//! - Q4_0 (18) and Q4_1 (20): Q4_K's units, four per block of 32 weights; `d` as f16 per column
//!   at 512, Q4_1's `m` at 576.
//! - Q5_0 (22) and Q5_1 (24): Q4_0's units for the low four bits, the fifth bits as one 32-bit
//!   word per column at 512, the file's `qh` regrouped (`fifth_word`) so that one shift and one
//!   mask put a unit's bits at bit 4 of its bytes; `d` at 640, Q5_1's `m` at 704.
//!
//! A unit load is then 16 (zmm) or 8 (ymm) columns × 8 weights; each row's activation bytes
//! are broadcast and one `vpdpbusd` advances every column of the vector by four weights. The
//! sub-block scales multiply i32 lane sums (`vpmulld`, exact), the Q4_K mins are `vpmaddwd`s of
//! the mins against the row's sums per 32, so a column's integer sums are exact and its float
//! steps (one per super-block, or per block of 32) are in a fixed order: a row's result never
//! depends on the rows beside it or on how many there are (batch invariance, tested), and a
//! prompt row gets the numbers a decode row gets.
//!
//! Other types keep the file's layout (`tiles`, `lanes`).

use super::acts::{Q8KRows, Q8Rows};
use super::blocks::{self, Q4K, Q5K, Q6K, Q8_0};
use super::simd::Simd;
use super::tiles::Out;
use super::KernelError;
use candle_core::quantized::GgmlDType;
use rayon::prelude::*;

/// Columns per record.
pub const COLS: usize = 32;

/// One cache line: records are whole lines, so the buffer's alignment is every record's.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// The packed types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Q4K,
    Q5K,
    Q6K,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
}

impl Kind {
    fn of(dt: GgmlDType) -> Option<Kind> {
        match dt {
            GgmlDType::Q4K => Some(Kind::Q4K),
            GgmlDType::Q5K => Some(Kind::Q5K),
            GgmlDType::Q6K => Some(Kind::Q6K),
            GgmlDType::Q8_0 => Some(Kind::Q8_0),
            GgmlDType::Q4_0 => Some(Kind::Q4_0),
            GgmlDType::Q4_1 => Some(Kind::Q4_1),
            GgmlDType::Q5_0 => Some(Kind::Q5_0),
            GgmlDType::Q5_1 => Some(Kind::Q5_1),
            _ => None,
        }
    }

    /// Weights of `k` per block.
    fn block(self) -> usize {
        match self {
            Kind::Q4K | Kind::Q5K | Kind::Q6K => 256,
            Kind::Q8_0 | Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q5_1 => 32,
        }
    }

    /// Bytes per column and block (the file's block size).
    fn bytes(self) -> usize {
        match self {
            Kind::Q4K => 144,
            Kind::Q5K => 176,
            Kind::Q6K => 210,
            Kind::Q8_0 => 34,
            Kind::Q4_0 => 18,
            Kind::Q4_1 => 20,
            Kind::Q5_0 => 22,
            Kind::Q5_1 => 24,
        }
    }

    /// Bytes per record.
    fn record(self) -> usize {
        self.bytes() * COLS
    }

    /// Of the 32-weight nibble types (Q4_0, Q4_1, Q5_0, Q5_1): whether a block has a min `m`.
    fn has_min(self) -> bool {
        matches!(self, Kind::Q4_1 | Kind::Q5_1)
    }

    /// Of the 32-weight nibble types: whether a block has fifth bits `qh`.
    fn has_fifth(self) -> bool {
        matches!(self, Kind::Q5_0 | Kind::Q5_1)
    }

    /// Where a nibble type's record keeps its columns' `d` (f16 each).
    fn d_at(self) -> usize {
        if self.has_fifth() {
            Q5_D
        } else {
            Q4_D
        }
    }

    /// Where a Q4_1 or Q5_1 record keeps its columns' `m`.
    fn m_at(self) -> usize {
        if self.has_fifth() {
            Q5_M
        } else {
            Q4_M
        }
    }
}

/// Whether weights of type `dt` are packed (on a CPU with int8 kernels).
pub fn packs(dt: GgmlDType) -> bool {
    Kind::of(dt).is_some()
}

/// A weight `[n, k]` repacked for the int8 kernels (see the module documentation).
pub struct Packed {
    pub(super) kind: Kind,
    dt: GgmlDType,
    n: usize,
    k: usize,
    lines: Vec<Line>,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed({:?}, [{}, {}])", self.dt, self.n, self.k)
    }
}

impl Packed {
    /// Repacks `w`, the file's bytes of a `[n, k]` weight of type `dt` (any alignment).
    pub fn new(dt: GgmlDType, w: &[u8], (n, k): (usize, usize)) -> Result<Packed, KernelError> {
        let Some(kind) = Kind::of(dt) else {
            return Err(KernelError::Candle(candle_core::Error::Msg(format!("{dt:?} weights are not packed"))));
        };
        let block = kind.block();
        if !k.is_multiple_of(block) {
            return Err(KernelError::BlockSize { k, block });
        }
        let bpr = k / block;
        let want = bpr.checked_mul(n).and_then(|b| b.checked_mul(kind.bytes())).unwrap_or(usize::MAX);
        if w.len() != want {
            return Err(KernelError::Shape { what: "the weight's storage (bytes)", len: w.len(), want, m: 0, k, n });
        }
        let rec = kind.record();
        let lines_per_block = (bpr * rec) / 64;
        let mut lines = vec![Line([0; 64]); n.div_ceil(COLS) * lines_per_block];
        let row_bytes = bpr * kind.bytes();
        lines.par_chunks_mut(lines_per_block.max(1)).enumerate().for_each(|(cb, out)| {
            // SAFETY: `Line` is 64 plain bytes
            let out = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 64) };
            for c in 0..COLS.min(n - cb * COLS) {
                let row = &w[(cb * COLS + c) * row_bytes..][..row_bytes];
                for (b, blk) in row.chunks_exact(kind.bytes()).enumerate() {
                    let rec = &mut out[b * rec..][..rec];
                    match kind {
                        Kind::Q4K => pack_q4k(&read::<Q4K>(blk), c, rec),
                        Kind::Q5K => pack_q5k(&read::<Q5K>(blk), c, rec),
                        Kind::Q6K => pack_q6k(&read::<Q6K>(blk), c, rec),
                        Kind::Q8_0 => pack_q8_0(&read::<Q8_0>(blk), c, rec),
                        Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q5_1 => pack_nibbles(kind, blk, c, rec),
                    }
                }
            }
        });
        Ok(Packed { kind, dt, n, k, lines })
    }

    pub fn dtype(&self) -> GgmlDType {
        self.dt
    }

    /// `(n, k)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held: the file's for this weight, columns rounded up to `COLS` (32).
    pub fn storage_bytes(&self) -> usize {
        self.lines.len() * 64
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is 64 plain bytes
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.lines.len() * 64) }
    }

    /// Blocks of `k` per column.
    pub(super) fn bpr(&self) -> usize {
        self.k / self.kind.block()
    }

    /// Where column block `cb`'s records start.
    pub(super) fn column_block(&self, cb: usize) -> *const u8 {
        self.bytes()[cb * self.bpr() * self.kind.record()..].as_ptr()
    }

    /// Column blocks.
    fn blocks(&self) -> usize {
        self.n.div_ceil(COLS)
    }

    /// Row `r` of the weight (an output column of the matmul) as f32 values, each block
    /// dequantized as ggml (candle) dequantizes the file's block: what a tied output head's
    /// embedding looks up, so that the head can be packed without a second copy of the table.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), KernelError> {
        use candle_core::quantized::k_quants::{
            BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0,
        };
        if r >= self.n || out.len() != self.k {
            return Err(KernelError::Row { row: r, rows: self.n, k: self.k, len: out.len() });
        }
        let (kind, c, block) = (self.kind, r % COLS, self.kind.block());
        let p = self.column_block(r / COLS);
        for (b, out) in out.chunks_exact_mut(block).enumerate() {
            // SAFETY: block b of the column block's `bpr` records, inside `lines`
            let rec = unsafe { std::slice::from_raw_parts(p.add(b * kind.record()), kind.record()) };
            match kind {
                Kind::Q4K => dequantize::<BlockQ4K>(|f| unpack_q4k(rec, c, f), out),
                Kind::Q5K => dequantize::<BlockQ5K>(|f| unpack_q5k(rec, c, f), out),
                Kind::Q6K => dequantize::<BlockQ6K>(|f| unpack_q6k(rec, c, f), out),
                Kind::Q8_0 => dequantize::<BlockQ8_0>(|f| unpack_q8_0(rec, c, f), out),
                Kind::Q4_0 => dequantize::<BlockQ4_0>(|f| unpack_nibbles(kind, rec, c, f), out),
                Kind::Q4_1 => dequantize::<BlockQ4_1>(|f| unpack_nibbles(kind, rec, c, f), out),
                Kind::Q5_0 => dequantize::<BlockQ5_0>(|f| unpack_nibbles(kind, rec, c, f), out),
                Kind::Q5_1 => dequantize::<BlockQ5_1>(|f| unpack_nibbles(kind, rec, c, f), out),
            }
        }
        Ok(())
    }
}

/// One block of type `T` written by `fill` (the file's bytes of it), dequantized into `out`.
fn dequantize<T: candle_core::quantized::k_quants::GgmlType + blocks::Block>(
    fill: impl FnOnce(&mut [u8]),
    out: &mut [f32],
) {
    let mut b = [T::zeros()];
    fill(blocks::as_bytes_mut(&mut b));
    T::to_float(&b, out);
}

/// The quants of column `c`'s `units` units from `at(u)` ([`put_unit`]'s inverse): weight
/// `8u + j` in the low nibble of byte `j`, `8u + 4 + j` in its high one.
fn get_units(rec: &[u8], units: usize, at: impl Fn(usize) -> usize, q: &mut [u8]) {
    for u in 0..units {
        for j in 0..4 {
            let byte = rec[at(u) + j];
            (q[8 * u + j], q[8 * u + 4 + j]) = (byte & 15, byte >> 4);
        }
    }
}

/// Column `c`'s Q4_K block as the file has it (`pack_q4k`'s inverse).
fn unpack_q4k(rec: &[u8], c: usize, f: &mut [u8]) {
    let mut q = [0u8; 256];
    get_units(rec, 32, |u| (32 * u + c) * 4, &mut q);
    f[..2].copy_from_slice(&rec[4480 + 2 * c..][..2]);
    f[2..4].copy_from_slice(&rec[4544 + 2 * c..][..2]);
    for w in 0..3 {
        f[4 + 4 * w..][..4].copy_from_slice(&rec[4096 + (32 * w + c) * 4..][..4]);
    }
    for j in 0..4 {
        for i in 0..32 {
            f[16 + 32 * j + i] = q[64 * j + i] | q[64 * j + 32 + i] << 4;
        }
    }
}

/// Column `c`'s Q5_K block as the file has it: Q4_K's fields with `qh` between the scales and
/// the quants.
fn unpack_q5k(rec: &[u8], c: usize, f: &mut [u8]) {
    let mut q4 = [0u8; 144];
    unpack_q4k(rec, c, &mut q4);
    f[..16].copy_from_slice(&q4[..16]);
    f[48..].copy_from_slice(&q4[16..]);
    f[16..48].fill(0);
    for t in 0..8 {
        let w = u32::from_le_bytes(file_qh(read_word(rec, q5k_fifth(t, c))));
        for l in 0..32 {
            f[16 + l] |= (((w >> l) & 1) as u8) << t;
        }
    }
}

/// Column `c`'s Q6_K block as the file has it (`pack_q6k`'s inverse): `ql`, `qh`, the scales, `d`.
fn unpack_q6k(rec: &[u8], c: usize, f: &mut [u8]) {
    let mut q = [0u8; 256];
    get_units(rec, 32, |u| q6_unit(u, c), &mut q);
    for t in 0..16 {
        for j in 0..4 {
            let h = rec[q6_high(t, c) + j];
            for s in 0..4 {
                q[16 * t + 4 * s + j] |= ((h >> (2 * s)) & 3) << 4;
            }
        }
        f[192 + t] = rec[q6_scale(t, c)];
    }
    for n in 0..2 {
        let y = &q[128 * n..];
        for l in 0..32 {
            f[64 * n + l] = (y[l] & 15) | (y[l + 64] & 15) << 4;
            f[64 * n + l + 32] = (y[l + 32] & 15) | (y[l + 96] & 15) << 4;
            f[128 + 32 * n + l] = (y[l] >> 4) | (y[l + 32] >> 4) << 2 | (y[l + 64] >> 4) << 4 | (y[l + 96] >> 4) << 6;
        }
    }
    f[208..210].copy_from_slice(&rec[q6_d(c)..][..2]);
}

/// Column `c`'s Q8_0 block as the file has it (`pack_q8_0`'s inverse).
fn unpack_q8_0(rec: &[u8], c: usize, f: &mut [u8]) {
    f[..2].copy_from_slice(&rec[1024 + 2 * c..][..2]);
    for u in 0..8 {
        f[2 + 4 * u..][..4].copy_from_slice(&rec[(32 * u + c) * 4..][..4]);
    }
}

/// Column `c`'s block of a 32-weight nibble type as the file has it ([`pack_nibbles`]'s inverse).
fn unpack_nibbles(kind: Kind, rec: &[u8], c: usize, f: &mut [u8]) {
    let (d, m, qh, qs) = nibble_fields(kind);
    let mut q = [0u8; 32];
    get_units(rec, 4, |u| (32 * u + c) * 4, &mut q);
    f[d..d + 2].copy_from_slice(&rec[kind.d_at() + 2 * c..][..2]);
    if let Some(m) = m {
        f[m..m + 2].copy_from_slice(&rec[kind.m_at() + 2 * c..][..2]);
    }
    if let Some(qh) = qh {
        f[qh..qh + 4].copy_from_slice(&file_qh(read_word(rec, Q5_H + 4 * c)));
    }
    for i in 0..16 {
        f[qs + i] = q[i] | q[i + 16] << 4;
    }
}

/// The little-endian word at `at`.
fn read_word(rec: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([0, 1, 2, 3].map(|i| rec[at + i]))
}

/// A block read from unaligned bytes.
fn read<T: blocks::Block + Copy>(b: &[u8]) -> T {
    debug_assert_eq!(b.len(), std::mem::size_of::<T>());
    // SAFETY: `b` holds size_of::<T>() bytes (chunks of the type's size), and any bytes are a
    // valid `T` (`Block`'s contract)
    unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) }
}

/// Eight weights' quants (each below 16 after masking) as unit bytes at `at`: low nibble
/// `q[j]`, high `q[4 + j]`.
fn put_unit(q: &[u8], u: usize, rec: &mut [u8], at: usize) {
    for j in 0..4 {
        rec[at + j] = (q[8 * u + j] & 15) | (q[8 * u + 4 + j] & 15) << 4;
    }
}

/// Where a Q6_K record keeps column `c`'s unit `u` (weights `8u..8u + 8`): per 32 weights `g`,
/// 832 bytes in the order they are read — four units, two words of high bits, 64 scale bytes.
pub(super) const fn q6_unit(u: usize, c: usize) -> usize {
    832 * (u / 4) + 128 * (u % 4) + 4 * c
}

/// Where a Q6_K record keeps column `c`'s high bits of weights `16t..16t + 16`.
pub(super) const fn q6_high(t: usize, c: usize) -> usize {
    832 * (t / 2) + 512 + 128 * (t % 2) + 4 * c
}

/// Where a Q6_K record keeps column `c`'s scale of weights `16t..16t + 16`.
pub(super) const fn q6_scale(t: usize, c: usize) -> usize {
    832 * (t / 2) + 768 + 32 * (t % 2) + c
}

/// Where a Q6_K record keeps column `c`'s `d`.
pub(super) const fn q6_d(c: usize) -> usize {
    6656 + 2 * c
}

fn pack_q4k(b: &Q4K, c: usize, rec: &mut [u8]) {
    let mut q = [0u8; 256];
    for j in 0..4 {
        for i in 0..32 {
            q[64 * j + i] = b.qs[32 * j + i] & 15;
            q[64 * j + 32 + i] = b.qs[32 * j + i] >> 4;
        }
    }
    for u in 0..32 {
        put_unit(&q, u, rec, (32 * u + c) * 4);
    }
    for w in 0..3 {
        rec[4096 + (32 * w + c) * 4..][..4].copy_from_slice(&b.scales[4 * w..4 * w + 4]);
    }
    rec[4480 + 2 * c..][..2].copy_from_slice(&b.d.to_le_bytes());
    rec[4544 + 2 * c..][..2].copy_from_slice(&b.dmin.to_le_bytes());
}

/// Where a Q5_K record keeps column `c`'s fifth bits of weights `32t..32t + 32`.
const fn q5k_fifth(t: usize, c: usize) -> usize {
    4608 + (32 * t + c) * 4
}

/// ggml's Q5_K fifth bits in weight order: weight `64j + l` (`l < 32`) has bit `2j` of `qh[l]`,
/// weight `64j + 32 + l` bit `2j + 1`; so word `t` (weights `32t..32t + 32`, bit `i` weight
/// `32t + i`'s) is bit `t` of each `qh[l]`.
fn q5k_words(qh: &[u8; 32]) -> [u32; 8] {
    std::array::from_fn(|t| (0..32).fold(0u32, |w, l| w | (((qh[l] >> t) & 1) as u32) << l))
}

fn pack_q5k(b: &Q5K, c: usize, rec: &mut [u8]) {
    pack_q4k(&Q4K { d: b.d, dmin: b.dmin, scales: b.scales, qs: b.qs }, c, rec);
    for (t, w) in q5k_words(&b.qh).into_iter().enumerate() {
        rec[q5k_fifth(t, c)..][..4].copy_from_slice(&fifth_word(w.to_le_bytes()).to_le_bytes());
    }
}

fn pack_q6k(b: &Q6K, c: usize, rec: &mut [u8]) {
    // ggml's arrangement: per half of 128 weights, ql's 64 bytes hold weights l and l + 32 (low
    // nibbles) and l + 64, l + 96 (high), qh's 32 bytes their two high bits at 0, 2, 4, 6
    let mut q = [0u8; 256];
    for n in 0..2 {
        let (ql, qh) = (&b.ql[64 * n..], &b.qh[32 * n..]);
        for l in 0..32 {
            let y = &mut q[128 * n..];
            y[l] = (ql[l] & 15) | (qh[l] & 3) << 4;
            y[l + 32] = (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4;
            y[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
            y[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
        }
    }
    for u in 0..32 {
        put_unit(&q, u, rec, q6_unit(u, c));
    }
    for t in 0..16 {
        for j in 0..4 {
            let mut h = 0u8;
            for s in 0..4 {
                h |= (q[16 * t + 4 * s + j] >> 4) << (2 * s);
            }
            rec[q6_high(t, c) + j] = h;
        }
        rec[q6_scale(t, c)] = b.scales[t] as u8;
    }
    rec[q6_d(c)..][..2].copy_from_slice(&b.d.to_le_bytes());
}

fn pack_q8_0(b: &Q8_0, c: usize, rec: &mut [u8]) {
    for u in 0..8 {
        for j in 0..4 {
            rec[(32 * u + c) * 4 + j] = b.qs[4 * u + j] as u8;
        }
    }
    rec[1024 + 2 * c..][..2].copy_from_slice(&b.d.to_le_bytes());
}

/// Where a Q4_0 or Q4_1 record keeps its columns' `d` (f16 each), after the four units.
const Q4_D: usize = 512;
/// Where a Q4_1 record keeps its columns' `m`.
const Q4_M: usize = 576;
/// A Q5 block's fifth bits (`qh`, bit `i` weight `i`'s) regrouped for the units: byte `j` bit
/// `2u + p` holds weight `8u + 4p + j`'s (unit `u`'s byte `j`, low nibble `p = 0` or high `p =
/// 1`), so that shifting the word by `4 − (2u + p)` and masking `0x10101010` puts each at bit 4
/// of the byte its nibble is in.
pub(super) fn fifth_word(qh: [u8; 4]) -> u32 {
    let qh = u32::from_le_bytes(qh);
    let mut w = 0u32;
    for u in 0..4 {
        for p in 0..2 {
            for j in 0..4 {
                w |= ((qh >> (8 * u + 4 * p + j)) & 1) << (8 * j + 2 * u + p);
            }
        }
    }
    w
}

/// [`fifth_word`]'s inverse: the file's `qh`.
pub(super) fn file_qh(w: u32) -> [u8; 4] {
    let mut qh = 0u32;
    for u in 0..4 {
        for p in 0..2 {
            for j in 0..4 {
                qh |= ((w >> (8 * j + 2 * u + p)) & 1) << (8 * u + 4 * p + j);
            }
        }
    }
    qh.to_le_bytes()
}

/// Where a Q5_0 or Q5_1 record keeps its columns' fifth bits ([`fifth_word`], one word each).
const Q5_H: usize = 512;
/// Where a Q5_0 or Q5_1 record keeps its columns' `d`.
const Q5_D: usize = 640;
/// Where a Q5_1 record keeps its columns' `m`.
const Q5_M: usize = 704;

/// Where a block of a 32-weight nibble type keeps its fields in the file (ggml's layouts): `d`,
/// `m` (Q4_1, Q5_1), `qh` (Q5_0, Q5_1) and the 16 bytes of nibbles.
fn nibble_fields(kind: Kind) -> (usize, Option<usize>, Option<usize>, usize) {
    let m = kind.has_min().then_some(2);
    let qh = kind.has_fifth().then_some(2 + 2 * usize::from(kind.has_min()));
    (0, m, qh, kind.bytes() - 16)
}

/// Column `c`'s block `blk` (the file's bytes) of a 32-weight nibble type into record `rec`: the
/// nibbles (ggml's order: weight `j` in the low nibble of byte `j`, `j + 16` in its high one) as
/// four units, `d` and `m` as they are, `qh` as its [`fifth_word`].
fn pack_nibbles(kind: Kind, blk: &[u8], c: usize, rec: &mut [u8]) {
    let (d, m, qh, qs) = nibble_fields(kind);
    let q: [u8; 32] = std::array::from_fn(|i| if i < 16 { blk[qs + i] & 15 } else { blk[qs + i - 16] >> 4 });
    for u in 0..4 {
        put_unit(&q, u, rec, (32 * u + c) * 4);
    }
    rec[kind.d_at() + 2 * c..][..2].copy_from_slice(&blk[d..d + 2]);
    if let Some(m) = m {
        rec[kind.m_at() + 2 * c..][..2].copy_from_slice(&blk[m..m + 2]);
    }
    if let Some(qh) = qh {
        let word = fifth_word([0, 1, 2, 3].map(|i| blk[qh + i]));
        rec[Q5_H + 4 * c..][..4].copy_from_slice(&word.to_le_bytes());
    }
}

/// The quantized activations of a packed matmul.
#[derive(Clone, Copy)]
pub enum Acts<'a> {
    /// Per 256 (Q4_K, Q6_K).
    K(&'a Q8KRows),
    /// Per 32, no offset (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).
    Q0(&'a Q8Rows),
}

/// How far ahead of what a kernel reads it asks for the weights: records are read once per
/// token in decode, straight from memory, and the hardware's own prefetcher keeps too few lines
/// in flight for a kernel that also computes. From memory (one row × 2048 × 600000 Q4_K,
/// 691 MB; 2 threads, `cpu_kernels`, a 2-vCPU Intel Xeon with AVX-512 whose reader gets
/// 26 GB/s), AVX2 packed went from 22 to 37–41 GMAC/s and AVX-512 from 35 to 45 with requests
/// 1–8 records ahead into L2 (`_MM_HINT_T1`); into L1 (`T0`) the fill buffers ran out first
/// (AVX2 32–37, AVX-512 35–39).
pub(super) const AHEAD: usize = 16 << 10;

/// Asks for the cache lines `lines` (counted from `p`) `AHEAD` bytes further on, into L2.
/// Kernels call it as they read, a share at a time, so the requests are spread over the time
/// the reading takes.
#[inline(always)]
fn fetch_ahead(p: *const u8, lines: std::ops::Range<usize>) {
    for line in lines {
        // SAFETY: a prefetch never faults, whatever the address (past the weight's end it
        // fetches nothing useful); the address is computed without `add`'s in-bounds promise
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                p.wrapping_add(AHEAD + 64 * line).cast(),
            )
        }
    }
}

/// How the kernels ask for their weights ahead: `BRIGADE_CPU_PREFETCH=off` makes no requests,
/// `near` has the vec-dots ask 1 KiB ahead into L1 (what they did before the 16 KiB into L2 of
/// [`fetch_ahead`], to measure one against the other on a machine); the packed kernels ask
/// unless `off`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Fetch {
    Off,
    Near,
    Far,
}

pub(super) fn fetch_mode() -> Fetch {
    static MODE: std::sync::OnceLock<Fetch> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| {
        if super::switched_off("BRIGADE_CPU_PREFETCH") {
            Fetch::Off
        } else if std::env::var("BRIGADE_CPU_PREFETCH").is_ok_and(|v| v.trim() == "near") {
            Fetch::Near
        } else {
            Fetch::Far
        }
    })
}

/// Whether the packed kernels ask for their records ahead ([`fetch_ahead`]).
fn fetches() -> bool {
    fetch_mode() != Fetch::Off
}

/// Share `slot` of `slots` of the lines of a record of `bytes` (whole lines).
#[inline(always)]
fn share(bytes: usize, slot: usize, slots: usize) -> std::ops::Range<usize> {
    let lines = bytes / 64;
    slot * lines / slots..(slot + 1) * lines / slots
}

/// Rows per tile, on every instruction set: three accumulators per row and vector, 24 of the 32
/// zmm registers (2 vectors) or 12 of the 16 ymm ones (1 vector). On AVX2, 4 rows instead of 2
/// together with `dot_u8_pair` took Q4_K k = 2048 from 68 to 85 GMAC/s at 8 rows and Q6_K
/// from 47 to 62 (`cpu_kernels`, one thread, AMD EPYC forced to AVX2).
const ROWS: usize = 4;

/// A Q4_K record's mins (words 1 and 2 of its columns) as i16 pairs for `vpmaddwd`: mins 0..4
/// are the low 6 bits of word 1; 4..8 the high nibbles of word 2 and the top 2 bits of word 1's
/// bytes; pairs (0, 2), (1, 3), (4, 6), (5, 7), as `Q8KRows::bs32` orders the row's sums.
#[inline(always)]
pub(super) fn q4k_mins<S: Simd>(s: S, w1: S::I, w2: S::I) -> [S::I; 4] {
    let (low4, low6, hi2) = (s.set1_i32(0x0f0f_0f0f), s.set1_i32(0x3f3f_3f3f), s.set1_i32(0x3030_3030));
    let pairs = s.set1_i32(0x00ff_00ff);
    let m_lo = s.and(w1, low6);
    let m_hi = s.or(s.and(s.shr32(w2, 4), low4), s.and(s.shr32(w1, 2), hi2));
    [s.and(m_lo, pairs), s.and(s.shr32(m_lo, 8), pairs), s.and(m_hi, pairs), s.and(s.shr32(m_hi, 8), pairs)]
}

/// `acc` plus one super-block of Q4_K for activation row and super-block `at` of `x`: `isum`
/// (`Σ_t sc_t·Σ q·x` per column) times `d·d_x`, less `dmin·d_x·Σ m·Σx` (the mins `m` of
/// [`q4k_mins`] against the row's sums per 32). The float steps of every Q4_K packed kernel
/// (AVX-512 and AMX alike), so that they give the same numbers.
///
/// # Safety
/// `at` is a row and super-block of `x`.
#[inline(always)]
pub(super) unsafe fn q4k_step<S: Simd>(
    s: S,
    acc: S::F,
    isum: S::I,
    m: &[S::I; 4],
    (d, dmin): (S::F, S::F),
    x: &Q8KRows,
    at: usize,
) -> S::F {
    // SAFETY: the caller's contract: 8 sums at 8·at, a scale at `at`
    unsafe {
        let bs = x.bs32.as_ptr().add(8 * at).cast::<i8>();
        let mut mm = s.madd(m[0], s.bcast32(bs));
        for (j, m) in m.iter().enumerate().skip(1) {
            mm = s.add32(mm, s.madd(*m, s.bcast32(bs.add(4 * j))));
        }
        let dx = *x.d.get_unchecked(at);
        let acc = s.fmadd(s.cvt(isum), s.mul(d, s.set1(dx)), acc);
        s.fmadd(s.cvt(mm), s.mul(dmin, s.set1(-dx)), acc)
    }
}

/// `acc` plus one super-block of Q6_K for activation row and super-block `at` of `x`: `isum`
/// (`Σ_t sc_t·(Σ q·x − 32·Σx)` per column) times `d·d_x`. The float step of every Q6_K packed
/// kernel (AVX-512 and AMX alike).
///
/// # Safety
/// `at` is a row and super-block of `x`.
#[inline(always)]
pub(super) unsafe fn q6k_step<S: Simd>(s: S, acc: S::F, isum: S::I, d: S::F, x: &Q8KRows, at: usize) -> S::F {
    // SAFETY: the caller's contract
    let dx = unsafe { *x.d.get_unchecked(at) };
    s.fmadd(s.cvt(isum), s.mul(d, s.set1(dx)), acc)
}

/// One unit of nibbles (8 weights of `V·W/4` columns from `w`, as [`put_unit`] lays them out)
/// against bytes `at..at + 8` of each row `xs`, into `sum`: with `PART` as a sub-block's partial
/// ([`Simd::dot_u4_part`]), else in i32 lanes ([`Simd::dot_u8_pair`]). With `FIFTH`, each
/// weight's fifth bit (from its column's [`fifth_word`] in `qh`, Q5_0/Q5_1) is added as 16.
///
/// # Safety
/// `w` is a unit of a record with `V·W/4` columns from it; each row has bytes `at..at + 8`.
#[inline(always)]
unsafe fn nibble_unit<S: Simd, const V: usize, const R: usize, const PART: bool, const FIFTH: bool>(
    s: S,
    w: *const u8,
    qh: &[S::I; V],
    xs: &[*const i8; R],
    at: usize,
    sum: &mut [[S::I; V]; R],
) {
    let (l, low4) = (S::W / 4, s.set1_i32(0x0f0f_0f0f));
    let mut lo = [s.zero(); V];
    let mut hi = [s.zero(); V];
    // SAFETY: the caller's contract
    unsafe {
        for v in 0..V {
            let q = s.load(w.add(v * l * 4).cast());
            lo[v] = s.and(q, low4);
            hi[v] = s.and(s.shr32(q, 4), low4);
            if FIFTH {
                // unit u's bits of nibble half p are at bit 2u + p of each byte: moved to bit 4
                let (u, bit4) = ((at % 32) / 8, s.set1_i32(0x1010_1010));
                let fifth = |p: usize| {
                    let at = (2 * u + p) as i32;
                    let w = if at <= 4 { s.shl32(qh[v], 4 - at) } else { s.shr32(qh[v], at - 4) };
                    s.and(w, bit4)
                };
                lo[v] = s.or(lo[v], fifth(0));
                hi[v] = s.or(hi[v], fifth(1));
            }
        }
        for (i, sum) in sum.iter_mut().enumerate() {
            let (xa, xb) = (s.bcast32(xs[i].add(at)), s.bcast32(xs[i].add(at + 4)));
            for v in 0..V {
                sum[v] = if PART {
                    s.dot_u4_part(sum[v], lo[v], xa, hi[v], xb)
                } else {
                    s.dot_u8_pair(sum[v], lo[v], xa, hi[v], xb)
                };
            }
        }
    }
}

/// Sub-block `t` (weights `32t..32t + 32`) of a pass of [`tile_q4k`] over columns `h` of
/// record `rec` (pass `hh`): each row's `Σ q·x` over the sub-block, times the sub-block's scale,
/// into `isum`. `(rec, h, hh, t)` in one tuple: the caller writes the eight calls out.
///
/// # Safety
/// As [`tile_q4k`]: `rec` is a record, `xs` the rows' super-blocks, `h + V·W/4 ≤ COLS`, `t < 8`.
#[inline(always)]
unsafe fn q4k_sub<S: Simd, const V: usize, const H: usize, const R: usize, const FIFTH: bool>(
    s: S,
    (rec, h, hh, t): (*const u8, usize, usize, usize),
    xs: &[*const i8; R],
    fetch: bool,
    isum: &mut [[S::I; V]; R],
) {
    let l = S::W / 4;
    let kind = if FIFTH { Kind::Q5K } else { Kind::Q4K };
    let (low4, low6, hi2) = (s.set1_i32(0x0f0f_0f0f), s.set1_i32(0x3f3f_3f3f), s.set1_i32(0x3030_3030));
    // SAFETY: the caller's contract; every offset is inside the record's 4608 (Q5_K: 5632) bytes
    unsafe {
        let word = |w: usize, v: usize| rec.add(4096 + (32 * w + h + v * l) * 4).cast::<i8>();
        if fetch {
            fetch_ahead(rec, share(kind.record(), hh * 8 + t, H * 8));
        }
        let mut sum = [[s.zero(); V]; R];
        let mut qh = [s.zero(); V];
        if FIFTH {
            for (v, qh) in qh.iter_mut().enumerate() {
                *qh = s.load(rec.add(q5k_fifth(t, h + v * l)).cast());
            }
        }
        for u in 4 * t..4 * t + 4 {
            // 5-bit quants in i32 lanes (`dot_u4_part`'s i16 partials hold 4-bit ones only)
            if FIFTH {
                nibble_unit::<S, V, R, false, true>(s, rec.add((32 * u + h) * 4), &qh, xs, 8 * u, &mut sum);
            } else {
                nibble_unit::<S, V, R, true, false>(s, rec.add((32 * u + h) * 4), &qh, xs, 8 * u, &mut sum);
            }
        }
        for v in 0..V {
            // scales 0..4: low 6 bits of word 0; 4..8: low nibbles of word 2 and the top 2 bits
            // of word 0's bytes
            let bytes = if t < 4 {
                s.and(s.load(word(0, v)), low6)
            } else {
                s.or(s.and(s.load(word(2, v)), low4), s.and(s.shr32(s.load(word(0, v)), 2), hi2))
            };
            if FIFTH {
                let sc = s.and(s.shr32(bytes, 8 * (t % 4) as i32), s.set1_i32(0xff));
                for (isum, sum) in isum.iter_mut().zip(&sum) {
                    isum[v] = s.add32(isum[v], s.mullo32(sum[v], sc));
                }
            } else {
                let sc = s.part_scale(bytes, t % 4);
                for (isum, sum) in isum.iter_mut().zip(&sum) {
                    isum[v] = s.scale_part(isum[v], sum[v], sc);
                }
            }
        }
    }
}

/// `T` tiles of rows `first + R·j..first + R·j + R` × columns `h..h + V·W/4` of a column
/// block of Q4_K: per sub-block of 32 `Σ q·x` in i32 lanes times its scale, per super-block
/// that sum times `d·d_x`, less `dmin·d_x · Σ m·Σx` (`vpmaddwd` of the mins against the row's
/// sums per 32). Every tile takes a record before the next record is read (see
/// [`rows_of`]). With `fetch` the first tile asks for the records [`AHEAD`] as it reads them
/// (see [`fetch_ahead`]).
///
/// # Safety
/// `p` is the column block's first record of `bpr`; `x` holds rows `first..first + T·R`; `h + V·W/4 ≤
/// COLS`.
#[inline(always)]
unsafe fn tile_q4k<S: Simd, const V: usize, const H: usize, const R: usize, const T: usize, const FIFTH: bool>(
    s: S,
    p: *const u8,
    bpr: usize,
    x: &Q8KRows,
    first: usize,
    fetch: bool,
) -> [[[[S::F; V]; R]; H]; T] {
    let l = S::W / 4;
    let mut all = [[[[s.zero_f(); V]; R]; H]; T];
    for b in 0..bpr {
        // SAFETY: record b of the column block (the caller's contract); every offset below is
        // inside its 4608 bytes, every row's bytes inside `x`
        unsafe {
            let rec = p.add(b * if FIFTH { Kind::Q5K.record() } else { Kind::Q4K.record() });
            // the record is read for every tile of rows and vector of columns (one pass on
            // zmm, four on ymm) while it is in L1
            for (j, tile) in all.iter_mut().enumerate() {
                let (r0, fetch) = (first + j * R, fetch && j == 0);
                for (hh, acc) in tile.iter_mut().enumerate() {
                    let h = hh * V * l;
                    let xs: [*const i8; R] = std::array::from_fn(|i| x.qs.as_ptr().add(((r0 + i) * bpr + b) * 256));
                    let mut isum = [[s.zero(); V]; R];
                    let sub = |t: usize| (rec, h, hh, t);
                    if S::W == 32 {
                        // on ymm the eight sub-blocks written out, each with its `t` a constant:
                        // immediate shifts, the scale's byte picked by a constant, the prefetch's
                        // lines known. As a loop LLVM kept `t` in a register, and one row ran at
                        // half this speed (`cpu_kernels q4_k 1 2048 1024 avx2`, one thread, Ice
                        // Lake Xeon: 28 → 55 GMAC/s); on zmm the loop is faster (0.8× written out)
                        q4k_sub::<S, V, H, R, FIFTH>(s, sub(0), &xs, fetch, &mut isum);
                        q4k_sub::<S, V, H, R, FIFTH>(s, sub(1), &xs, fetch, &mut isum);
                        q4k_sub::<S, V, H, R, FIFTH>(s, sub(2), &xs, fetch, &mut isum);
                        q4k_sub::<S, V, H, R, FIFTH>(s, sub(3), &xs, fetch, &mut isum);
                        q4k_sub::<S, V, H, R, FIFTH>(s, sub(4), &xs, fetch, &mut isum);
                        q4k_sub::<S, V, H, R, FIFTH>(s, sub(5), &xs, fetch, &mut isum);
                        q4k_sub::<S, V, H, R, FIFTH>(s, sub(6), &xs, fetch, &mut isum);
                        q4k_sub::<S, V, H, R, FIFTH>(s, sub(7), &xs, fetch, &mut isum);
                    } else {
                        for t in 0..8 {
                            q4k_sub::<S, V, H, R, FIFTH>(s, sub(t), &xs, fetch, &mut isum);
                        }
                    }
                    let word = |w: usize, v: usize| rec.add(4096 + (32 * w + h + v * l) * 4).cast::<i8>();
                    for v in 0..V {
                        let m = q4k_mins(s, s.load(word(1, v)), s.load(word(2, v)));
                        let d = s.load_f16(rec.add(4480 + 2 * (h + v * l)));
                        let dmin = s.load_f16(rec.add(4544 + 2 * (h + v * l)));
                        for (i, acc) in acc.iter_mut().enumerate() {
                            let at = (r0 + i) * bpr + b;
                            acc[v] = q4k_step(s, acc[v], isum[i][v], &m, (d, dmin), x, at);
                        }
                    }
                }
            }
        }
    }
    all
}

/// As [`tile_q4k`] for Q6_K: per 16 weights `Σ q·x − 32·Σx` (its quants' offset) times the
/// scale, per super-block times `d·d_x`.
///
/// # Safety
/// As [`tile_q4k`].
#[inline(always)]
unsafe fn tile_q6k<S: Simd, const V: usize, const H: usize, const R: usize, const T: usize>(
    s: S,
    p: *const u8,
    bpr: usize,
    x: &Q8KRows,
    first: usize,
    fetch: bool,
) -> [[[[S::F; V]; R]; H]; T] {
    let l = S::W / 4;
    let (low4, hi2) = (s.set1_i32(0x0f0f_0f0f), s.set1_i32(0x3030_3030));
    let mut all = [[[[s.zero_f(); V]; R]; H]; T];
    for b in 0..bpr {
        // SAFETY: as in `tile_q4k`, inside the record's 6720 bytes
        unsafe {
            let rec = p.add(b * 6720);
            // the record is read for every tile of rows and vector of columns (one pass on
            // zmm, four on ymm) while it is in L1
            for (j, tile) in all.iter_mut().enumerate() {
                let (r0, fetch) = (first + j * R, fetch && j == 0);
                for (hh, acc) in tile.iter_mut().enumerate() {
                    let h = hh * V * l;
                    let at: [usize; R] = std::array::from_fn(|i| (r0 + i) * bpr + b);
                    let xs: [*const i8; R] = std::array::from_fn(|i| x.qs.as_ptr().add(at[i] * 256));
                    let mut isum = [[s.zero(); V]; R];
                    for t in 0..16 {
                        if fetch {
                            fetch_ahead(rec, share(Kind::Q6K.record(), hh * 16 + t, H * 16));
                        }
                        let mut sum = [[s.zero(); V]; R];
                        for (i, sum) in sum.iter_mut().enumerate() {
                            let off = s.set1_i32(-32 * *x.bsums.get_unchecked(at[i] * 16 + t) as i32);
                            *sum = [off; V];
                        }
                        let mut hb = [s.zero(); V];
                        for (v, hb) in hb.iter_mut().enumerate() {
                            *hb = s.load(rec.add(q6_high(t, h + v * l)).cast());
                        }
                        for u in 2 * t..2 * t + 2 {
                            // the high bits of this unit's two halves: pairs s = 2(u − 2t) and s + 1
                            let sh = 4 * (u - 2 * t) as i32;
                            let mut lo = [s.zero(); V];
                            let mut hi = [s.zero(); V];
                            for v in 0..V {
                                let w = s.load(rec.add(q6_unit(u, h + v * l)).cast());
                                let (h0, h1) = if sh == 0 {
                                    (s.shl32(hb[v], 4), s.shl32(hb[v], 2))
                                } else {
                                    (hb[v], s.shr32(hb[v], 2))
                                };
                                lo[v] = s.or(s.and(w, low4), s.and(h0, hi2));
                                hi[v] = s.or(s.and(s.shr32(w, 4), low4), s.and(h1, hi2));
                            }
                            for (i, sum) in sum.iter_mut().enumerate() {
                                let (xa, xb) = (s.bcast32(xs[i].add(8 * u)), s.bcast32(xs[i].add(8 * u + 4)));
                                for v in 0..V {
                                    sum[v] = s.dot_u8_pair(sum[v], lo[v], xa, hi[v], xb);
                                }
                            }
                        }
                        for v in 0..V {
                            let sc = s.load_i8_i32(rec.add(q6_scale(t, h + v * l)));
                            for (isum, sum) in isum.iter_mut().zip(&sum) {
                                isum[v] = s.add32(isum[v], s.mullo32(sum[v], sc));
                            }
                        }
                    }
                    for v in 0..V {
                        let d = s.load_f16(rec.add(q6_d(h + v * l)));
                        for (i, acc) in acc.iter_mut().enumerate() {
                            acc[v] = q6k_step(s, acc[v], isum[i][v], d, x, at[i]);
                        }
                    }
                }
            }
        }
    }
    all
}

/// As [`tile_q4k`] for Q8_0: per block `Σ q·x` in i32 lanes (with VNNI the weights made
/// unsigned by 128 and the sum started at `−128·Σx`; AVX2 moves the weight's sign onto `x`)
/// times `d·d_x`.
///
/// # Safety
/// As [`tile_q4k`], `x` quantized per 32 with no offset.
#[inline(always)]
unsafe fn tile_q8_0<S: Simd, const V: usize, const H: usize, const R: usize, const T: usize>(
    s: S,
    p: *const u8,
    bpr: usize,
    x: &Q8Rows,
    first: usize,
    fetch: bool,
) -> [[[[S::F; V]; R]; H]; T] {
    let l = S::W / 4;
    let mut all = [[[[s.zero_f(); V]; R]; H]; T];
    for b in 0..bpr {
        // SAFETY: as in `tile_q4k`, inside the record's 1088 bytes
        unsafe {
            let rec = p.add(b * 1088);
            // the record is read for every tile of rows and vector of columns (one pass on
            // zmm, four on ymm) while it is in L1
            for (j, tile) in all.iter_mut().enumerate() {
                let (r0, fetch) = (first + j * R, fetch && j == 0);
                for (hh, acc) in tile.iter_mut().enumerate() {
                    let h = hh * V * l;
                    let at: [usize; R] = std::array::from_fn(|i| (r0 + i) * x.blocks + b);
                    let mut sum = [[s.zero(); V]; R];
                    if S::VNNI {
                        for (i, sum) in sum.iter_mut().enumerate() {
                            *sum = [s.set1_i32(-128 * *x.sums.get_unchecked(at[i])); V];
                        }
                    }
                    for u in 0..8 {
                        if fetch {
                            fetch_ahead(rec, share(Kind::Q8_0.record(), hh * 8 + u, H * 8));
                        }
                        let mut w = [s.zero(); V];
                        for (v, w) in w.iter_mut().enumerate() {
                            *w = s.load(rec.add((32 * u + h + v * l) * 4).cast());
                            if S::VNNI {
                                *w = s.flip(*w);
                            }
                        }
                        for (i, sum) in sum.iter_mut().enumerate() {
                            let xb = s.bcast32(x.qs.as_ptr().add((r0 + i) * x.kp + 32 * b + 4 * u));
                            for v in 0..V {
                                sum[v] = if S::VNNI { s.dot_u8(sum[v], w[v], xb) } else { s.dot_s8(sum[v], w[v], xb) };
                            }
                        }
                    }
                    q0_step(s, acc, &sum, rec.add(1024 + 2 * h), x, &at);
                }
            }
        }
    }
    all
}

/// `acc` plus each row's block sums `sum` times `d·d_x`, with `d` the f16 of each column from
/// `d`: the float step of every 32-weight packed kernel.
///
/// # Safety
/// `d` holds `V·W/4` f16; `at` are blocks of `x`.
#[inline(always)]
unsafe fn q0_step<S: Simd, const V: usize, const R: usize>(
    s: S,
    acc: &mut [[S::F; V]; R],
    sum: &[[S::I; V]; R],
    d: *const u8,
    x: &Q8Rows,
    at: &[usize; R],
) {
    for v in 0..V {
        // SAFETY: the caller's contract
        unsafe {
            let d = s.load_f16(d.add(2 * v * (S::W / 4)));
            for (i, acc) in acc.iter_mut().enumerate() {
                let dx = *x.d.get_unchecked(at[i]);
                acc[v] = s.fmadd(s.cvt(sum[i][v]), s.mul(d, s.set1(dx)), acc[v]);
            }
        }
    }
}

/// As [`tile_q8_0`] for Q4_0 and Q4_1 (`MIN`), or with `FIFTH` Q5_0 and Q5_1: per block `Σ q·x`
/// of the four units' nibbles (and fifth bits) in i32 lanes (Q4_0's offset of 8, Q5_0's 16, as
/// the sum's start, `−8·Σx`) times `d·d_x`; the min of Q4_1 and Q5_1 then adds `m · d_x·Σx`, as
/// ggml's Q8_1 dot does, in that order.
///
/// # Safety
/// As [`tile_q8_0`].
#[inline(always)]
unsafe fn tile_q4_0<
    S: Simd,
    const V: usize,
    const H: usize,
    const R: usize,
    const T: usize,
    const MIN: bool,
    const FIFTH: bool,
>(
    s: S,
    p: *const u8,
    bpr: usize,
    x: &Q8Rows,
    first: usize,
    fetch: bool,
) -> [[[[S::F; V]; R]; H]; T] {
    let l = S::W / 4;
    let kind = match (FIFTH, MIN) {
        (false, false) => Kind::Q4_0,
        (false, true) => Kind::Q4_1,
        (true, false) => Kind::Q5_0,
        (true, true) => Kind::Q5_1,
    };
    let mut all = [[[[s.zero_f(); V]; R]; H]; T];
    for b in 0..bpr {
        // SAFETY: as in `tile_q4k`, inside the record's 576, 640, 704 or 768 bytes
        unsafe {
            let rec = p.add(b * kind.record());
            // the record is read for every tile of rows and vector of columns (one pass on
            // zmm, four on ymm) while it is in L1
            for (j, tile) in all.iter_mut().enumerate() {
                let (r0, fetch) = (first + j * R, fetch && j == 0);
                for (hh, acc) in tile.iter_mut().enumerate() {
                    let h = hh * V * l;
                    if fetch {
                        fetch_ahead(rec, share(kind.record(), hh, H));
                    }
                    let at: [usize; R] = std::array::from_fn(|i| (r0 + i) * x.blocks + b);
                    let xs: [*const i8; R] = std::array::from_fn(|i| x.qs.as_ptr().add((r0 + i) * x.kp + 32 * b));
                    let mut sum = [[s.zero(); V]; R];
                    if !MIN {
                        let offset = if FIFTH { -16 } else { -8 };
                        for (i, sum) in sum.iter_mut().enumerate() {
                            *sum = [s.set1_i32(offset * *x.sums.get_unchecked(at[i])); V];
                        }
                    }
                    let mut qh = [s.zero(); V];
                    if FIFTH {
                        for (v, qh) in qh.iter_mut().enumerate() {
                            *qh = s.load(rec.add(Q5_H + 4 * (h + v * l)).cast());
                        }
                    }
                    for u in 0..4 {
                        nibble_unit::<S, V, R, false, FIFTH>(s, rec.add((32 * u + h) * 4), &qh, &xs, 8 * u, &mut sum);
                    }
                    q0_step(s, acc, &sum, rec.add(kind.d_at() + 2 * h), x, &at);
                    if MIN {
                        for v in 0..V {
                            let m = s.load_f16(rec.add(kind.m_at() + 2 * (h + v * l)));
                            for (i, acc) in acc.iter_mut().enumerate() {
                                acc[v] = s.fmadd(m, s.set1(*x.s.get_unchecked(at[i])), acc[v]);
                            }
                        }
                    }
                }
            }
        }
    }
    all
}

/// `T` tiles of `R` rows from `r0` on × the block's `COLS` columns (`H` chunks of `V`
/// vectors), each record read by every tile in turn.
///
/// # Safety
/// As the tiles.
#[inline(always)]
unsafe fn tile<S: Simd, const V: usize, const H: usize, const R: usize, const T: usize>(
    s: S,
    w: &Packed,
    p: *const u8,
    x: Acts<'_>,
    r0: usize,
) -> [[[[S::F; V]; R]; H]; T] {
    let bpr = w.bpr();
    // the tiles from row 0 read each record from memory (the first of them asking ahead);
    // the others find it in cache
    let fetch = r0 == 0 && fetches();
    // SAFETY: the caller's contract
    unsafe {
        match (w.kind, x) {
            (Kind::Q4K, Acts::K(x)) => tile_q4k::<S, V, H, R, T, false>(s, p, bpr, x, r0, fetch),
            (Kind::Q5K, Acts::K(x)) => tile_q4k::<S, V, H, R, T, true>(s, p, bpr, x, r0, fetch),
            (Kind::Q6K, Acts::K(x)) => tile_q6k::<S, V, H, R, T>(s, p, bpr, x, r0, fetch),
            (Kind::Q8_0, Acts::Q0(x)) => tile_q8_0::<S, V, H, R, T>(s, p, bpr, x, r0, fetch),
            (Kind::Q4_0, Acts::Q0(x)) => tile_q4_0::<S, V, H, R, T, false, false>(s, p, bpr, x, r0, fetch),
            (Kind::Q4_1, Acts::Q0(x)) => tile_q4_0::<S, V, H, R, T, true, false>(s, p, bpr, x, r0, fetch),
            (Kind::Q5_0, Acts::Q0(x)) => tile_q4_0::<S, V, H, R, T, false, true>(s, p, bpr, x, r0, fetch),
            (Kind::Q5_1, Acts::Q0(x)) => tile_q4_0::<S, V, H, R, T, true, true>(s, p, bpr, x, r0, fetch),
            _ => unreachable!("activations of the weight's kind (`matmul` quantizes them so)"),
        }
    }
}

/// Writes rows `r0..r0 + R` of a tile at columns `c0..` (those below `out.n`).
///
/// # Safety
/// Rows `r0..r0 + R` are below `out.m`; only this call writes those elements.
#[inline(always)]
unsafe fn put<S: Simd, const V: usize, const H: usize, const R: usize>(
    s: S,
    t: [[[S::F; V]; R]; H],
    r0: usize,
    c0: usize,
    out: Out,
) {
    let l = S::W / 4;
    for (hh, t) in t.iter().enumerate() {
        for (i, row) in t.iter().enumerate() {
            for (v, r) in row.iter().enumerate() {
                let c = c0 + (hh * V + v) * l;
                if c >= out.n {
                    break;
                }
                // SAFETY: (r0 + i, c..c + l) inside the output, or copied only up to n
                unsafe {
                    let dst = (out.ptr as *mut f32).add((r0 + i) * out.n + c);
                    if c + l <= out.n {
                        s.store_f(dst, *r);
                    } else {
                        let mut all = [0f32; 16];
                        s.store_f(all.as_mut_ptr(), *r);
                        std::ptr::copy_nonoverlapping(all.as_ptr(), dst, out.n - c);
                    }
                }
            }
        }
    }
}

/// Rows `from..` of `out` at the columns of block `cb`: tiles of [`ROWS`] rows (fewer at the end)
/// × the block's columns, as 2 zmm vectors or 4 chunks of 1 ymm vector, two tiles at a time
/// where there are 2·[`ROWS`] rows left.
///
/// Two tiles take each record in turn (both read it from L1) rather than one tile reading
/// the whole block and the next reading it again: 8 rows (8 decoding sessions) then read
/// the block from memory once, at an even pace, for both tiles' arithmetic. From memory
/// (`cpu_kernels TYPE 8 2048 N`, 2 threads, 2-vCPU Intel Xeon with AVX-512, old and new
/// alternated twice): Q4_K N = 300000 26.1, 24.7 → 23.5, 22.9 ms; Q6_K N = 128256 (a Llama
/// 3 head) 13.6, 15.5 → 12.9, 13.3 ms; Q8_0 N = 200000 21.0, 20.5 → 19.7, 18.4 ms; Q4_0
/// 13.8, 14.0 → 11.1, 12.0 ms; AVX-VNNI Q4_K 34.8, 33.7 → 31.4, 31.5 ms. Each row's
/// arithmetic is unchanged: the same bits (`packed_rows_are_computed_as_alone`).
///
/// # Safety
/// `cb` is a column block of `w`; `x` holds `out.m` rows quantized for `w`'s type; only this
/// call writes those columns.
#[inline(always)]
pub unsafe fn column_block<S: Simd>(s: S, w: &Packed, cb: usize, x: Acts<'_>, out: Out, from: usize) {
    if S::W == 64 {
        // SAFETY: the caller's contract
        unsafe { rows_of::<S, 2, 1, ROWS>(s, w, cb, x, out, from) }
    } else {
        // SAFETY: the caller's contract
        unsafe { rows_of::<S, 1, 4, ROWS>(s, w, cb, x, out, from) }
    }
}

/// [`column_block`] with `H` chunks of `V` vectors and tiles of `R` rows.
///
/// # Safety
/// As [`column_block`].
#[inline(always)]
unsafe fn rows_of<S: Simd, const V: usize, const H: usize, const R: usize>(
    s: S,
    w: &Packed,
    cb: usize,
    x: Acts<'_>,
    out: Out,
    from: usize,
) {
    debug_assert_eq!(H * V * S::W / 4, COLS);
    let p = w.column_block(cb);
    let c0 = cb * COLS;
    let mut r0 = from;
    // SAFETY: the caller's contract; each tile's rows are below out.m
    unsafe {
        while r0 + 2 * R <= out.m {
            let [a, b] = tile::<S, V, H, R, 2>(s, w, p, x, r0);
            put(s, a, r0, c0, out);
            put(s, b, r0 + R, c0, out);
            r0 += 2 * R;
        }
        // fewer than two tiles' rows are left: one whole tile at most
        if r0 + R <= out.m {
            let [t] = tile::<S, V, H, R, 1>(s, w, p, x, r0);
            put(s, t, r0, c0, out);
            r0 += R;
        }
        match out.m - r0 {
            0 => {}
            1 => put(s, tile::<S, V, H, 1, 1>(s, w, p, x, r0)[0], r0, c0, out),
            2 => put(s, tile::<S, V, H, 2, 1>(s, w, p, x, r0)[0], r0, c0, out),
            _ => put(s, tile::<S, V, H, 3, 1>(s, w, p, x, r0)[0], r0, c0, out),
        }
    }
}

/// Several matmuls by packed weights in one dispatch of the thread pool: job `j` is
/// `jobs[j].lhs (m × k) @ jobs[j].w ᵀ` into `jobs[j].dst`, each column block of each job a unit
/// of work, so small matmuls (a token's experts) share one barrier instead of one each. Every
/// column block is computed as [`matmul`] computes it without AMX: the same numbers.
///
/// # Safety
/// The caller checks the lengths (`lhs = m × k`, `dst = m × n` of each job) and that `s` is a
/// token of instructions this CPU has.
pub unsafe fn matmul_group<S: Simd>(s: S, jobs: &mut [super::PackedJob<'_>]) {
    enum Held {
        K(Q8KRows),
        Q0(Q8Rows),
    }
    let acts: Vec<Held> = jobs
        .iter()
        .map(|j| {
            let (m, k) = (j.m, j.w.k);
            if j.w.kind.block() == 32 {
                Held::Q0(Q8Rows::new(j.lhs, (m, k), m, k / 32, 0))
            } else {
                Held::K(Q8KRows::new(j.lhs, (m, k), m))
            }
        })
        .collect();
    let outs: Vec<Out> = jobs.iter_mut().map(|j| Out { ptr: j.dst.as_mut_ptr() as usize, m: j.m, n: j.w.n }).collect();
    // the first flat unit of each job
    let mut starts = Vec::with_capacity(jobs.len() + 1);
    starts.push(0usize);
    for j in jobs.iter() {
        starts.push(starts[starts.len() - 1] + j.w.blocks());
    }
    let total = starts[jobs.len()];
    let jobs = &*jobs;
    candle_core::utils::barrier_pool().execute_chunked(total, |units| {
        for u in units {
            let j = starts.partition_point(|&st| st <= u) - 1;
            let x = match &acts[j] {
                Held::K(x) => Acts::K(x),
                Held::Q0(x) => Acts::Q0(x),
            };
            // SAFETY: each column block writes its own columns of every row of its own job
            unsafe { s.packed_block(jobs[j].w, u - starts[j], x, outs[j], 0) }
        }
    })
}

/// `out[m, n] = lhs[m, k] @ w[n, k]ᵀ` on the instruction set `s`. Every one of the `m · n`
/// values is stored (never read nor added to), so `out` may be memory not yet initialized.
///
/// # Safety
/// `lhs` holds `m · k` values; `out` is `m × n` (`w.n`) writable values no one else touches
/// meanwhile.
pub unsafe fn matmul<S: Simd>(s: S, w: &Packed, m: usize, lhs: &[f32], out: Out) {
    let k = w.k;
    debug_assert!(lhs.len() == m * k && out.m == m && out.n == w.n);
    let run = |x: Acts<'_>| {
        candle_core::utils::barrier_pool().execute_chunked(w.blocks(), |blocks| {
            for cb in blocks {
                // SAFETY: each column block writes its own columns of every row
                unsafe { s.packed_block(w, cb, x, out, 0) }
            }
        })
    };
    if w.kind.block() == 32 {
        return run(Acts::Q0(&Q8Rows::new(lhs, (m, k), m, k / 32, 0)));
    }
    let x = Q8KRows::new(lhs, (m, k), m);
    // `available` implies AVX-512, so the token exists where it says yes
    #[cfg(target_os = "linux")]
    if let (true, Some(z)) = (
        m >= super::amx::MIN_ROWS && S::W == 64 && matches!(w.kind, Kind::Q4K | Kind::Q6K) && super::amx::available(),
        super::simd::Zmm::new(),
    ) {
        let whole = m - m % super::amx::ROWS;
        let a = super::amx::APanel::new(&x, whole, k / 256);
        return candle_core::utils::barrier_pool().execute_chunked(w.blocks(), |blocks| {
            // SAFETY: AMX is available (checked above)
            let _tiles = unsafe { super::amx::Tiles::configure() };
            for cb in blocks {
                // SAFETY: each column block writes its own columns of every row: rows
                // 0..whole through the tile unit, the rest as above (the same numbers)
                unsafe {
                    super::amx::rows(z, w, cb, &x, &a, out, whole);
                    s.packed_block(w, cb, Acts::K(&x), out, whole);
                }
            }
        });
    }
    run(Acts::K(&x))
}
