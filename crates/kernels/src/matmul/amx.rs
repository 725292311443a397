//! Prompts on packed Q4_K and Q6_K weights through Intel AMX, the tile unit of Xeons since
//! Sapphire Rapids: one `tdpbssd` multiplies 16 activation rows by 16 weight columns over 64
//! weights (16 384 products, ~5 ns on the 2-vCPU Xeon this was written on), where AVX-512 VNNI
//! does 64 per `vpdpbusd`.
//!
//! The numbers are the AVX-512 packed kernels' (`packed::tile_q4k`, `tile_q6k`), bit for bit:
//! the tile unit only replaces the integer part, a super-block's `Σ_t sc_t · Σ q·x` of a row and
//! a column, which is exact in i32 either way (see [`rows`] for how the scales get into the
//! tiles); the mins or offsets and every float step are those kernels'
//! operations in their order (shared helpers: `packed::q4k_step`, `q6k_step`). So a prompt row
//! still gets a decode row's numbers, and a row's result does not depend on how many rows there
//! are (batch invariance): tested against the AVX-512 kernels.
//!
//! Per column block (32 columns) the weights are unpacked once into B tiles (`unpack`,
//! `unpack_q6k`), each group of 16 activation rows is regrouped once per matmul into A tiles
//! ([`APanel`]), and a super-block of a group is 16 `tdpbssd` (Q4_K; 32 for Q6_K) then one pass
//! of AVX-512 over the C tiles. Rows past the last whole group of 16 take the AVX-512 kernel.
//! One thread, `cpu_kernels TYPE 256 2048 16384 avx512` with `BRIGADE_CPU_AMX=off` and on:
//! Q4_K 180 → 323 GMAC/s, Q6_K 118 → 195. A first version with one `tdpbssd` per sub-block of
//! 32 and the scales applied after each (`vpmulld`, as the AVX-512 kernel does) reached
//! 185–205 on Q4_K: the stores and reloads of a C tile per sub-block cost more than the tile
//! unit's work. Written with inline assembly because stable Rust has no AMX intrinsics; the
//! tile registers are no one else's in this process.
//!
//! Linux grants a process the tile registers' state only when it asks (`arch_prctl`
//! `ARCH_REQ_XCOMP_PERM`); [`available`] asks once, and says no where the CPU lacks AMX-INT8,
//! the kernel refuses, or `BRIGADE_CPU_AMX=off`.

use super::acts::Q8KRows;
use super::packed::{q4k_mins, q4k_step, q6k_step, Kind, Packed, COLS};
use super::simd::{Simd, Zmm};
use super::tiles::Out;
use std::arch::asm;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Rows of activations per A tile (and of a C tile): the tile unit's maximum.
pub const ROWS: usize = 16;

/// Rows from which a matmul takes the tile unit: with one group of 16 the weights' unpacking
/// (once per column block) is not paid back (one thread, `cpu_kernels q4_k M 2048 16384
/// avx512`: 16 rows 169 GMAC/s with AMX against 175 without, 32 rows 242 against 185).
pub const MIN_ROWS: usize = 2 * ROWS;

/// Whether this process may run AMX-INT8 (see the module documentation). Decided once.
pub fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if super::switched_off("BRIGADE_CPU_AMX") || Zmm::new().is_none() || !cpu_has_amx_int8() {
            return false;
        }
        // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the tile data is then saved and restored
        // with every thread's state; process-wide
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a syscall with two integer arguments, no memory
        let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
        if r != 0 {
            tracing::info!(
                "AMX: the kernel refused the tile state ({}); AVX-512 kernels instead",
                std::io::Error::last_os_error()
            );
        }
        r == 0
    })
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25), and the OS saving the tile state
/// (XCR0 bits 17 and 18, through OSXSAVE).
fn cpu_has_amx_int8() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    let (max, l1, l7) = (__cpuid(0).eax, __cpuid(1), __cpuid_count(7, 0));
    if max < 7 || l7.edx & (1 << 24) == 0 || l7.edx & (1 << 25) == 0 || l1.ecx & (1 << 27) == 0 {
        return false;
    }
    // SAFETY: OSXSAVE (checked above) makes XGETBV with ECX = 0 valid
    let xcr0 = unsafe { std::arch::x86_64::_xgetbv(0) };
    xcr0 & (0b11 << 17) == 0b11 << 17
}

/// The tile configuration (palette 1): every tile 16 rows × 64 bytes. tmm0–tmm3 = C (16 rows ×
/// 16 i32: the products, see [`rows`]), tmm4 = A (16 activation rows × 64
/// weights), tmm5–tmm7 = B (16 rows of 4 weights × 16 columns).
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: Config = {
    let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    let mut t = 0;
    while t < 8 {
        c.colsb[t] = 64;
        c.rows[t] = ROWS as u8;
        t += 1;
    }
    c
};

/// The tiles configured on this thread for as long as it lives (not `Send`: released on the
/// thread that configured them).
pub struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    /// # Safety
    /// [`available`] said yes.
    pub unsafe fn configure() -> Tiles {
        // SAFETY: AMX is available (the caller's contract); the configuration is 64 valid bytes
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const Config, options(nostack, readonly)) };
        Tiles(std::marker::PhantomData)
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: configured by `configure`, so AMX is available
        unsafe { asm!("tilerelease", options(nostack, nomem)) }
    }
}

/// One cache line: a tile row.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Lines per tile.
const TILE: usize = ROWS;

/// The activations of the whole groups of 16 rows as A tiles: tile `(g, blk, s)` (group,
/// super-block, step of 64 weights) at line `((g·bpr + blk)·4 + s)·16`, row `i` its line `i`.
/// Read straight from [`Q8KRows`] a tile's rows are `k` bytes apart, the same few cache sets
/// for every row (`k` a multiple of 2048), and the loads were a third of the kernel's time.
pub struct APanel {
    lines: Vec<Line>,
    bpr: usize,
}

impl APanel {
    /// The first `rows` (a multiple of [`ROWS`]) rows of `x`, of `bpr` super-blocks; groups of
    /// rows on candle's pool.
    pub fn new(x: &Q8KRows, rows: usize, bpr: usize) -> APanel {
        let per_group = bpr * 4 * TILE;
        let mut lines = vec![Line([0; 64]); rows / ROWS * per_group];
        crate::threads::par_units(lines.chunks_mut(per_group.max(1)).enumerate().collect(), |(g, dst)| {
            for (l, line) in dst.iter_mut().enumerate() {
                let (blk, s, i) = (l / (4 * TILE), l / TILE % 4, l % TILE);
                let src = &x.qs[((*g * ROWS + i) * bpr + blk) * 256 + 64 * s..][..64];
                for (d, q) in line.0.iter_mut().zip(src) {
                    *d = *q as u8;
                }
            }
        });
        APanel { lines, bpr }
    }

    /// Group `g`'s four A tiles of super-block `blk`.
    fn tiles(&self, g: usize, blk: usize) -> *const Line {
        self.lines[(g * self.bpr + blk) * 4 * TILE..][..4 * TILE].as_ptr()
    }
}

thread_local! {
    /// A column block's B tiles (see [`unpack`]).
    static B_TILES: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// What a group of 16 rows of one column block reads: the block's records `p` (`bpr` of them),
/// its B tiles `b`, the activations `x` and their A tiles `a`.
#[derive(Clone, Copy)]
struct Group<'a> {
    p: *const u8,
    b: &'a [Line],
    x: &'a Q8KRows,
    a: &'a APanel,
    bpr: usize,
}

/// Lines of B tiles per super-block of a column block: 2 halves × 2 parts × 4 steps × 16 rows
/// (Q4_K).
const B_LINES: usize = 2 * 2 * 4 * TILE;

/// Lines of Q6_K B tiles per super-block of a column block: 2 halves × 4 parts × 4 steps × 16.
const B_LINES6: usize = 2 * 4 * 4 * TILE;

/// Rows `0..rows` (a multiple of [`ROWS`]) of `out` at the columns of block `cb` of the packed
/// Q4_K or Q6_K weight `w` (any other type: nothing).
///
/// The sub-block scales go into the weights, so that a super-block is four `tdpbssd` of 64
/// weights per product with no step between sub-blocks. Q4_K: a weight times its sub-block's
/// scale (`q·sc`, up to 15·63) does not fit a byte, but with `sc = sa + 8·sb` (each below 8)
/// both `q·sa` and `q·sb` do (at most 105), and `Σ q·sc·x = Σ (q·sa)·x + 8·Σ (q·sb)·x` exactly:
/// the integer `tile_q4k` gets from its per-sub-block products and `vpmulld`s. Q6_K: its scales
/// are signed and its quants reach 63, so neither `q·sc` nor a split of `sc` in two fits a
/// byte: `sc = d0 + 4·d1 + 16·d2 + 64·d3` with every digit in −2..=2 (`digits`), each `q·d` a
/// byte, four products per half and `Σ q·sc·x = Σ_p 4^p·Σ (q·d_p)·x`; its quants' offset
/// (`−32·Σ_t sc_t·Σx` over the 16 sub-blocks of 16) comes from the row's sums per 16
/// (`vpmaddwd`). The integers are `tile_q6k`'s, and so are the float steps.
///
/// # Safety
/// [`Tiles::configure`] ran on this thread; `cb` is a column block of `w`; `x` holds at least
/// `rows ≤ out.m` rows quantized from `w.k` columns and `a` its first `rows`; only this call
/// writes those columns of those rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows(s: Zmm, w: &Packed, cb: usize, x: &Q8KRows, a: &APanel, out: Out, rows: usize) {
    debug_assert!(rows.is_multiple_of(ROWS) && rows <= out.m);
    let lines = match w.kind {
        Kind::Q4K => B_LINES,
        Kind::Q6K => B_LINES6,
        // `packed::matmul` sends only Q4_K and Q6_K here
        Kind::Q5K | Kind::Q8_0 | Kind::Q4_0 | Kind::Q4_1 | Kind::Q5_0 | Kind::Q5_1 => {
            debug_assert!(false, "only Q4_K and Q6_K have an AMX kernel");
            return;
        }
    };
    let bpr = w.bpr();
    let p = w.column_block(cb);
    B_TILES.with(|b| {
        let mut b = b.borrow_mut();
        if b.len() < bpr * lines {
            b.resize(bpr * lines, Line([0; 64]));
        }
        // SAFETY: the records of the column block (the caller's contract); `b` holds
        // bpr × lines lines
        unsafe {
            if w.kind == Kind::Q4K {
                unpack(p, bpr, &mut b);
            } else {
                unpack_q6k(p, bpr, &mut b);
            }
            let g = Group { p, b: &b, x, a, bpr };
            // the C tiles' stores, rewritten whole by every super-block
            let mut c = [Line([0; 64]); 4 * TILE];
            for r0 in (0..rows).step_by(ROWS) {
                let acc = if w.kind == Kind::Q4K { group(s, &g, r0, &mut c) } else { group_q6k(s, &g, r0, &mut c) };
                for (half, acc) in acc.iter().enumerate() {
                    put(s, acc, r0, cb * COLS + 16 * half, out);
                }
            }
        }
    })
}

/// The digits of signed scales `sc` (i32 lanes, −128..=127): `sc = d0 + 4·d1 + 16·d2 + 64·d3`,
/// `d0..d2` in −2..=1 and `d3` in −2..=2.
///
/// # Safety
/// Inlined into a function with AVX-512.
#[inline(always)]
unsafe fn digits(sc: std::arch::x86_64::__m512i) -> [std::arch::x86_64::__m512i; 4] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's target features
    unsafe {
        let (two, three) = (_mm512_set1_epi32(2), _mm512_set1_epi32(3));
        let digit = |v: __m512i| _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, two), three), two);
        let d0 = digit(sc);
        let v1 = _mm512_srai_epi32(_mm512_sub_epi32(sc, d0), 2);
        let d1 = digit(v1);
        let v2 = _mm512_srai_epi32(_mm512_sub_epi32(v1, d1), 2);
        let d2 = digit(v2);
        [d0, d1, d2, _mm512_srai_epi32(_mm512_sub_epi32(v2, d2), 2)]
    }
}

/// The Q6_K B tiles of a column block: for super-block `blk`, half `h`, part `p` (`q·d_p`) and
/// step `st`, the tile at line `(((blk·2 + h)·4 + p)·4 + st)·16`, rows as in [`unpack`].
///
/// # Safety
/// `p` is a Q6_K column block of `bpr` records; `b` holds `bpr · B_LINES6` lines.
#[inline(always)]
unsafe fn unpack_q6k(p: *const u8, bpr: usize, b: &mut [Line]) {
    use super::packed::{q6_high, q6_scale, q6_unit};
    use std::arch::x86_64::*;
    // SAFETY: AVX-512 BW (the caller's target features); every address inside the record or `b`
    unsafe {
        let (low4, hi2) = (_mm512_set1_epi32(0x0f0f_0f0f), _mm512_set1_epi32(0x3030_3030));
        for blk in 0..bpr {
            let rec = p.add(blk * 6720);
            for h in 0..2 {
                let tiles = &mut b[(blk * 2 + h) * 4 * 4 * TILE..][..4 * 4 * TILE];
                for t in 0..16 {
                    let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(rec.add(q6_scale(t, 16 * h)).cast()));
                    let d = digits(sc);
                    let hb = _mm512_loadu_si512(rec.add(q6_high(t, 16 * h)).cast());
                    for u in 2 * t..2 * t + 2 {
                        // the quants of unit u as `tile_q6k` builds them: low nibbles and two
                        // high bits per weight
                        let w = _mm512_loadu_si512(rec.add(q6_unit(u, 16 * h)).cast());
                        let (h0, h1) = if u == 2 * t {
                            (_mm512_slli_epi32(hb, 4), _mm512_slli_epi32(hb, 2))
                        } else {
                            (hb, _mm512_srli_epi32(hb, 2))
                        };
                        let lo = _mm512_or_si512(_mm512_and_si512(w, low4), _mm512_and_si512(h0, hi2));
                        let hi =
                            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w, 4), low4), _mm512_and_si512(h1, hi2));
                        let (st, r) = (u / 8, (2 * u) % 16);
                        for (part, dp) in d.iter().enumerate() {
                            let at = (part * 4 + st) * TILE + r;
                            _mm512_storeu_si512(tiles[at].0.as_mut_ptr().cast(), times(lo, *dp));
                            _mm512_storeu_si512(tiles[at + 1].0.as_mut_ptr().cast(), times(hi, *dp));
                        }
                    }
                }
            }
        }
    }
}

/// As [`group`] for Q6_K.
///
/// # Safety
/// As [`rows`], for Q6_K; `b` unpacked from `p`.
#[inline(always)]
unsafe fn group_q6k(s: Zmm, g: &Group<'_>, r0: usize, c: &mut [Line; 4 * TILE]) -> [[__m512; ROWS]; 2] {
    use super::packed::{q6_d, q6_scale};
    let Group { p, b, x, a, bpr } = *g;
    let mut acc = [[s.zero_f(); ROWS]; 2];
    let (low16, minus32) = (s.set1_i32(0xffff), s.set1_i32(-32));
    for blk in 0..bpr {
        // SAFETY: record `blk` of the column block; rows r0..r0 + 16 of `x` and `a`; the lines
        // of `b`
        unsafe {
            let rec = p.add(blk * 6720);
            for (h, acc) in acc.iter_mut().enumerate() {
                products(a.tiles(r0 / ROWS, blk), b[blk * B_LINES6 + h * 4 * 4 * TILE..].as_ptr(), c.as_mut_ptr());
                // the scales of sub-blocks 2j and 2j + 1 as i16 pairs, against the row's sums
                // (loops, not closures: a closure would not inherit the target features)
                let mut pairs = [s.zero(); 8];
                for (j, pair) in pairs.iter_mut().enumerate() {
                    let a = s.load_i8_i32(rec.add(q6_scale(2 * j, 16 * h)));
                    let b = s.load_i8_i32(rec.add(q6_scale(2 * j + 1, 16 * h)));
                    *pair = s.or(s.and(a, low16), s.shl32(b, 16));
                }
                let d = s.load_f16(rec.add(q6_d(16 * h)));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let at = (r0 + i) * bpr + blk;
                    let mut part = [s.zero(); 4];
                    for (p, v) in part.iter_mut().enumerate() {
                        *v = s.load(c[p * TILE + i].0.as_ptr().cast());
                    }
                    let qx = s.add32(
                        s.add32(part[0], s.shl32(part[1], 2)),
                        s.add32(s.shl32(part[2], 4), s.shl32(part[3], 6)),
                    );
                    let bs = x.bsums.as_ptr().add(16 * at).cast::<i8>();
                    let mut off = s.madd(pairs[0], s.bcast32(bs));
                    for (j, pair) in pairs.iter().enumerate().skip(1) {
                        off = s.add32(off, s.madd(*pair, s.bcast32(bs.add(4 * j))));
                    }
                    let isum = s.add32(qx, s.mullo32(off, minus32));
                    *acc = q6k_step(s, *acc, isum, d, x, at);
                }
            }
        }
    }
    acc
}

/// The B tiles of a column block: for super-block `blk`, half `h` (16 columns), part `q` (`q·sa`
/// or `q·sb`) and step `st` (weights `64st..64st + 64`), the tile at line
/// `(((blk·2 + h)·2 + q)·4 + st)·16`, its row `r` holding weights `64st + 4r..+4` of each column
/// (4 bytes per column).
///
/// # Safety
/// `p` is a Q4_K column block of `bpr` records; `b` holds `bpr · B_LINES` lines.
#[inline(always)]
unsafe fn unpack(p: *const u8, bpr: usize, b: &mut [Line]) {
    use std::arch::x86_64::*;
    // SAFETY: AVX-512 BW (the caller's target features); every address inside the record or `b`
    unsafe {
        let (low4, low6, hi2, ff) = (
            _mm512_set1_epi32(0x0f0f_0f0f),
            _mm512_set1_epi32(0x3f3f_3f3f),
            _mm512_set1_epi32(0x3030_3030),
            _mm512_set1_epi32(0xff),
        );
        for blk in 0..bpr {
            let rec = p.add(blk * 4608);
            for h in 0..2 {
                let word = |w: usize| rec.add(4096 + (32 * w + 16 * h) * 4).cast::<__m512i>();
                let (w0, w2) = (_mm512_loadu_si512(word(0)), _mm512_loadu_si512(word(2)));
                let lo_sc = _mm512_and_si512(w0, low6);
                let hi_sc =
                    _mm512_or_si512(_mm512_and_si512(w2, low4), _mm512_and_si512(_mm512_srli_epi32(w0, 2), hi2));
                let tiles = &mut b[(blk * 2 + h) * 2 * 4 * TILE..][..2 * 4 * TILE];
                for u in 0..32 {
                    let t = u / 4;
                    // the scale of sub-block t, as `tile_q4k` unpacks it
                    let bytes = if t < 4 { lo_sc } else { hi_sc };
                    let sc = _mm512_and_si512(_mm512_srlv_epi32(bytes, _mm512_set1_epi32(8 * (t as i32 % 4))), ff);
                    let (sa, sb) = (_mm512_and_si512(sc, _mm512_set1_epi32(7)), _mm512_srli_epi32(sc, 3));
                    let q = _mm512_loadu_si512(rec.add((32 * u + 16 * h) * 4).cast());
                    // unit u holds weights 8u..8u + 4 (low nibbles) and 8u + 4..8u + 8 (high):
                    // groups of 4 weights 2u and 2u + 1, step (2u) / 16, rows (2u) % 16 and next
                    let (lo, hi) = (_mm512_and_si512(q, low4), _mm512_and_si512(_mm512_srli_epi32(q, 4), low4));
                    let (st, r) = (u / 8, (2 * u) % 16);
                    for (part, sx) in [sa, sb].into_iter().enumerate() {
                        let at = (part * 4 + st) * TILE + r;
                        _mm512_storeu_si512(tiles[at].0.as_mut_ptr().cast(), times(lo, sx));
                        _mm512_storeu_si512(tiles[at + 1].0.as_mut_ptr().cast(), times(hi, sx));
                    }
                }
            }
        }
    }
}

/// `q·sc` per byte for bytes `q` below 64 and `sc` in each i32 lane (the column's scale, or a
/// digit of it) with `|q·sc|` below 128: i16 products of the even and the odd bytes, back into
/// bytes (two's complement).
///
/// # Safety
/// Inlined into a function with AVX-512 BW.
#[inline(always)]
unsafe fn times(q: std::arch::x86_64::__m512i, sc: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    // SAFETY: the caller's target features
    unsafe {
        let evens = _mm512_set1_epi32(0x00ff_00ff);
        let sc16 = _mm512_or_si512(_mm512_and_si512(sc, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(sc, 16));
        let even = _mm512_mullo_epi16(_mm512_and_si512(q, evens), sc16);
        let odd = _mm512_mullo_epi16(_mm512_and_si512(_mm512_srli_epi32(q, 8), evens), sc16);
        _mm512_or_si512(_mm512_and_si512(even, evens), _mm512_slli_epi16(odd, 8))
    }
}

/// Four C tiles for one super-block of 16 rows: C tile `j` at line `16j` of `c` (a row's 16
/// i32 per line) = Σ over the 4 steps `st` of A tile `st` (`a`) × B tile `4j + st` (`b`). For
/// Q4_K the four are both halves' two products (`j = 2h + q`, as [`unpack`] lays them out); for
/// Q6_K one half's four digit products (`unpack_q6k`).
///
/// # Safety
/// [`Tiles::configure`] ran on this thread; `a` holds 4 tiles, `b` 16, `c` 64 writable lines.
#[inline(always)]
unsafe fn products(a: *const Line, b: *const Line, c: *mut Line) {
    // SAFETY: the caller's contract
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tileloadd tmm4, [{a} + {s}*1 + 0]",
            "tileloadd tmm5, [{b} + {s}*1 + 0]",
            "tdpbssd tmm0, tmm4, tmm5",
            "tileloadd tmm6, [{b} + {s}*1 + 4096]",
            "tdpbssd tmm1, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {s}*1 + 8192]",
            "tdpbssd tmm2, tmm4, tmm7",
            "tileloadd tmm5, [{b} + {s}*1 + 12288]",
            "tdpbssd tmm3, tmm4, tmm5",
            "tileloadd tmm4, [{a} + {s}*1 + 1024]",
            "tileloadd tmm5, [{b} + {s}*1 + 1024]",
            "tdpbssd tmm0, tmm4, tmm5",
            "tileloadd tmm6, [{b} + {s}*1 + 5120]",
            "tdpbssd tmm1, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {s}*1 + 9216]",
            "tdpbssd tmm2, tmm4, tmm7",
            "tileloadd tmm5, [{b} + {s}*1 + 13312]",
            "tdpbssd tmm3, tmm4, tmm5",
            "tileloadd tmm4, [{a} + {s}*1 + 2048]",
            "tileloadd tmm5, [{b} + {s}*1 + 2048]",
            "tdpbssd tmm0, tmm4, tmm5",
            "tileloadd tmm6, [{b} + {s}*1 + 6144]",
            "tdpbssd tmm1, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {s}*1 + 10240]",
            "tdpbssd tmm2, tmm4, tmm7",
            "tileloadd tmm5, [{b} + {s}*1 + 14336]",
            "tdpbssd tmm3, tmm4, tmm5",
            "tileloadd tmm4, [{a} + {s}*1 + 3072]",
            "tileloadd tmm5, [{b} + {s}*1 + 3072]",
            "tdpbssd tmm0, tmm4, tmm5",
            "tileloadd tmm6, [{b} + {s}*1 + 7168]",
            "tdpbssd tmm1, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {s}*1 + 11264]",
            "tdpbssd tmm2, tmm4, tmm7",
            "tileloadd tmm5, [{b} + {s}*1 + 15360]",
            "tdpbssd tmm3, tmm4, tmm5",
            "tilestored [{c} + {s}*1], tmm0",
            "tilestored [{c} + {s}*1 + 1024], tmm1",
            "tilestored [{c} + {s}*1 + 2048], tmm2",
            "tilestored [{c} + {s}*1 + 3072], tmm3",
            a = in(reg) a,
            b = in(reg) b,
            c = in(reg) c,
            s = in(reg) 64usize,
            options(nostack),
        )
    }
}

/// Rows `r0..r0 + 16` × the 32 columns: `tile_q4k`'s arithmetic, its integer sums from the tile
/// unit. Returns each half's 16 rows.
///
/// # Safety
/// As [`rows`]; `b` unpacked from `p`.
#[inline(always)]
unsafe fn group(s: Zmm, g: &Group<'_>, r0: usize, c: &mut [Line; 4 * TILE]) -> [[__m512; ROWS]; 2] {
    let Group { p, b, x, a, bpr } = *g;
    let mut acc = [[s.zero_f(); ROWS]; 2];
    for blk in 0..bpr {
        // SAFETY: record `blk` of the column block; rows r0..r0 + 16 of `x` and `a`; the lines
        // of `b`
        unsafe {
            products(a.tiles(r0 / ROWS, blk), b[blk * B_LINES..].as_ptr(), c.as_mut_ptr());
            let rec = p.add(blk * 4608);
            for (h, acc) in acc.iter_mut().enumerate() {
                let word = |w: usize| rec.add(4096 + (32 * w + 16 * h) * 4).cast::<i8>();
                let m = q4k_mins(s, s.load(word(1)), s.load(word(2)));
                let d = s.load_f16(rec.add(4480 + 2 * 16 * h));
                let dmin = s.load_f16(rec.add(4544 + 2 * 16 * h));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let ca = s.load(c[(2 * h) * TILE + i].0.as_ptr().cast());
                    let cb = s.load(c[(2 * h + 1) * TILE + i].0.as_ptr().cast());
                    let isum = s.add32(ca, s.shl32(cb, 3));
                    *acc = q4k_step(s, *acc, isum, &m, (d, dmin), x, (r0 + i) * bpr + blk);
                }
            }
        }
    }
    acc
}

use std::arch::x86_64::__m512;

/// Writes rows `r0..r0 + 16` at columns `c0..c0 + 16` (those below `out.n`).
///
/// # Safety
/// The rows are below `out.m`; only this call writes those elements.
#[inline(always)]
unsafe fn put(s: Zmm, acc: &[__m512; ROWS], r0: usize, c0: usize, out: Out) {
    if c0 >= out.n {
        return;
    }
    for (i, r) in acc.iter().enumerate() {
        // SAFETY: (r0 + i, c0..) inside the output, 16 values or up to n
        unsafe {
            let dst = (out.ptr as *mut f32).add((r0 + i) * out.n + c0);
            if c0 + 16 <= out.n {
                s.store_f(dst, *r);
            } else {
                let mut all = [0f32; 16];
                s.store_f(all.as_mut_ptr(), *r);
                std::ptr::copy_nonoverlapping(all.as_ptr(), dst, out.n - c0);
            }
        }
    }
}
