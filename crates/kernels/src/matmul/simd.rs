//! The vector operations the int8 kernels are written in, one implementation per instruction
//! set: [`Ymm`] (AVX2, AVX-VNNI, and AVX-512 VNNI on 256-bit registers) and [`Zmm`] (AVX-512
//! VNNI on 512-bit registers).
//!
//! A value of an implementing type is proof that the CPU has its instructions (the only way to
//! get one is `new()`, which checks), so the arithmetic methods are safe. They are
//! `#[inline(always)]` and are only fast inside a function compiled with the same features: the
//! kernels are generic over [`Simd`] and each instruction set enters them through its own
//! `#[target_feature]` functions ([`Simd::q0_columns`], [`Simd::k_group`], …).

use super::acts::{Q8KRows, Q8Rows};
use super::lanes::{self, LanePanel};
use super::packed::{self, Acts, Packed};
use super::tiles::{self, Out};
use super::unpack::{KUnpack, Q0Unpack};
use half::f16;
use std::arch::x86_64::*;

/// Every f16 as f32, indexed by its bits (256 KiB; ggml's x86 dot products read such a table).
pub struct F16Table([f32; 1 << 16]);

impl F16Table {
    #[inline(always)]
    fn get(&self, v: f16) -> &f32 {
        &self.0[usize::from(v.to_bits())]
    }
}

/// The one [`F16Table`] (built on first use).
pub fn f16_table() -> &'static F16Table {
    static TABLE: std::sync::OnceLock<Box<F16Table>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new(F16Table([0.0; 1 << 16]));
        for (bits, v) in (0..=u16::MAX).zip(t.0.iter_mut()) {
            *v = f16::from_bits(bits).to_f32();
        }
        t
    })
}

/// Vector arithmetic of one instruction set (see the module documentation).
pub trait Simd: Copy + Send + Sync + 'static {
    /// Bytes per integer vector (32 or 64).
    const W: usize;
    /// Whether `dot_u8` is one `vpdpbusd` (any u8 × i8, no intermediate saturation).
    const VNNI: bool;
    type I: Copy;
    type F: Copy;

    /// The AVX2 token every implementation implies (the weight unpackers are AVX2 code).
    fn avx2(self) -> Avx2;
    fn zero(self) -> Self::I;
    fn zero_f(self) -> Self::F;
    /// # Safety
    /// `p` points to `W` readable bytes.
    unsafe fn load(self, p: *const i8) -> Self::I;
    /// # Safety
    /// `p` points to `W` writable bytes.
    unsafe fn store(self, p: *mut u8, v: Self::I);
    /// # Safety
    /// `p` points to `W / 4` readable floats.
    unsafe fn load_f(self, p: *const f32) -> Self::F;
    /// # Safety
    /// `p` points to `W / 4` writable floats.
    unsafe fn store_f(self, p: *mut f32, v: Self::F);
    /// One vector from 256-bit parts, the lowest first (`hi` is ignored where `W` is 32).
    ///
    /// No method takes a closure: a closure is a function of its own, compiled without the
    /// kernel's target features, and its intrinsics would become calls.
    fn join(self, lo: __m256i, hi: __m256i) -> Self::I;
    /// A 256-bit vector in the low half, zeros above.
    fn widen(self, v: __m256i) -> Self::I;
    fn add32(self, a: Self::I, b: Self::I) -> Self::I;
    /// `x ^ 0x80` per byte: a signed byte as `x + 128`, unsigned.
    fn flip(self, a: Self::I) -> Self::I;
    /// `acc + Σ u·x` over each 4 bytes into i32 lanes (`u` unsigned, `x` signed). Without VNNI the
    /// pairs go through i16: `u` must be below 128.
    fn dot_u8(self, acc: Self::I, u: Self::I, x: Self::I) -> Self::I;
    /// `dot_u8(dot_u8(acc, u1, x1), u2, x2)`, the same integers. Without VNNI the two products
    /// are added as i16 before widening: `u1`, `u2` must be below 64.
    #[inline(always)]
    fn dot_u8_pair(self, acc: Self::I, u1: Self::I, x1: Self::I, u2: Self::I, x2: Self::I) -> Self::I {
        self.dot_u8(self.dot_u8(acc, u1, x1), u2, x2)
    }
    /// `part + Σ u1·x1 + Σ u2·x2`, a sub-block's partial sum before its scale (see
    /// [`Simd::scale_part`]): with VNNI the i32 lanes of [`Simd::dot_u8_pair`]; without, i16
    /// pairs, widened only by `scale_part`, so `u1`, `u2` must be below 16 and a partial take at
    /// most four calls (8 pair sums of at most 2·15·128 per i16: 30 720).
    #[inline(always)]
    fn dot_u4_part(self, part: Self::I, u1: Self::I, x1: Self::I, u2: Self::I, x2: Self::I) -> Self::I {
        self.dot_u8_pair(part, u1, x1, u2, x2)
    }
    /// Byte `j` (0..4) of each i32 lane of `bytes` (each below 64) as the scales
    /// [`Simd::scale_part`] takes: the byte in i32 lanes; without VNNI the byte in both i16
    /// halves of its lane (one `vpshufb`, where a shift, a mask and two more steps did it).
    #[inline(always)]
    fn part_scale(self, bytes: Self::I, j: usize) -> Self::I {
        self.and(self.shr32(bytes, 8 * j as i32), self.set1_i32(0xff))
    }
    /// `acc + part · sc` in i32 lanes, for a partial of [`Simd::dot_u4_part`] and scales of
    /// [`Simd::part_scale`]. The same integers either way.
    #[inline(always)]
    fn scale_part(self, acc: Self::I, part: Self::I, sc: Self::I) -> Self::I {
        self.add32(acc, self.mullo32(part, sc))
    }
    /// `acc + Σ w·x` for signed `w` (−128 included) and `x` in −127..=127: `|w| · (x with w's
    /// sign)`, ggml's arrangement (`|−128|` is 128 as an unsigned byte).
    fn dot_s8(self, acc: Self::I, w: Self::I, x: Self::I) -> Self::I;
    /// `acc + Σ (u·x pairs as i16) · sc` over i16 lane pairs: sub-block sums times their scales.
    /// `u` below 64 so that a pair fits i16.
    fn dot_scaled(self, acc: Self::I, u: Self::I, x: Self::I, sc: Self::I) -> Self::I;
    /// i16 pairs multiplied and summed into i32 lanes.
    fn madd(self, a: Self::I, b: Self::I) -> Self::I;
    /// The i16 lanes of step `step` of a super-block: each of the `W / 16` scales
    /// `sc[step·W/16..]` (i8, sign-extended) over 8 lanes (the 16 bytes they scale).
    fn scales(self, sc: __m128i, step: usize) -> Self::I;
    fn cvt(self, a: Self::I) -> Self::F;
    fn fmadd(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    fn set1(self, v: f32) -> Self::F;
    fn hsum(self, a: Self::F) -> f32;
    /// `v[t]` over the 8 lanes of 32-byte block `t`, for each of the `W / 32` blocks.
    fn per_block(self, v: [f32; 2]) -> Self::F;
    fn per_block_f16(self, v: [f16; 2]) -> Self::F;
    /// [`Simd::per_block_f16`], the same floats, where looking them up in `table` is fewer
    /// instructions than converting them.
    #[inline(always)]
    fn per_block_f16_in(self, table: &F16Table, v: [f16; 2]) -> Self::F {
        let _ = table;
        self.per_block_f16(v)
    }
    fn per_block_i32(self, v: [i32; 2]) -> Self::I;

    /// `a · b` in i32 lanes (the low 32 bits).
    fn mullo32(self, a: Self::I, b: Self::I) -> Self::I;
    /// The four bytes at `p` in every i32 lane.
    ///
    /// # Safety
    /// `p` points to 4 readable bytes.
    unsafe fn bcast32(self, p: *const i8) -> Self::I;
    fn and(self, a: Self::I, b: Self::I) -> Self::I;
    fn or(self, a: Self::I, b: Self::I) -> Self::I;
    /// Each i32 lane shifted right (logical) by `n` bits.
    fn shr32(self, a: Self::I, n: i32) -> Self::I;
    /// Each i32 lane shifted left by `n` bits.
    fn shl32(self, a: Self::I, n: i32) -> Self::I;
    fn set1_i32(self, v: i32) -> Self::I;
    /// `W / 4` f16 as f32 lanes.
    ///
    /// # Safety
    /// `p` points to `W / 2` readable bytes.
    unsafe fn load_f16(self, p: *const u8) -> Self::F;
    /// `W / 4` i8, sign-extended, as i32 lanes.
    ///
    /// # Safety
    /// `p` points to `W / 4` readable bytes.
    unsafe fn load_i8_i32(self, p: *const u8) -> Self::I;

    /// [`packed::column_block`] compiled for this instruction set.
    ///
    /// # Safety
    /// As [`packed::column_block`].
    unsafe fn packed_block(self, w: &Packed, cb: usize, x: Acts<'_>, out: Out, from: usize);

    /// [`lanes::q0_block`] compiled for this instruction set.
    ///
    /// # Safety
    /// As [`lanes::q0_block`].
    unsafe fn q0_lanes<T: Q0Unpack>(
        self,
        w: &[T],
        bpr: usize,
        cols: (usize, usize),
        x: &Q8Rows,
        out: Out,
        p: &mut LanePanel,
    );

    /// [`lanes::k_block`] compiled for this instruction set.
    ///
    /// # Safety
    /// As [`lanes::k_block`].
    unsafe fn k_lanes<T: KUnpack>(
        self,
        w: &[T],
        bpr: usize,
        cols: (usize, usize),
        x: &Q8KRows,
        out: Out,
        p: &mut LanePanel,
    );

    /// [`tiles::q0_columns`] compiled for this instruction set.
    ///
    /// # Safety
    /// As [`tiles::q0_columns`].
    unsafe fn q0_columns<T: Q0Unpack>(self, w: &[T], bpr: usize, cols: (usize, usize), x: &Q8Rows, out: Out);

    /// [`tiles::k_columns`] compiled for this instruction set.
    ///
    /// # Safety
    /// As [`tiles::k_columns`].
    unsafe fn k_columns<T: KUnpack>(self, w: &[T], bpr: usize, cols: (usize, usize), x: &Q8KRows, out: Out);
}

/// The instruction sets of a [`Ymm`].
pub const AVX2: u8 = 0;
pub const AVX_VNNI: u8 = 1;
pub const AVX512_YMM: u8 = 2;

/// 256-bit vectors: `V` = [`AVX2`] (`vpmaddubsw` + `vpmaddwd`), [`AVX_VNNI`] (`vpdpbusd` with a
/// VEX encoding, Alder Lake and later) or [`AVX512_YMM`] (`vpdpbusd` with an EVEX encoding, on
/// AVX-512 VNNI CPUs: the same kernels as AVX-VNNI, which this lets tests run where AVX-VNNI is
/// missing).
#[derive(Clone, Copy, Debug)]
pub struct Ymm<const V: u8>(());

pub type Avx2 = Ymm<AVX2>;
pub type AvxVnni = Ymm<AVX_VNNI>;

fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

impl<const V: u8> Ymm<V> {
    /// The token, where the CPU has the instruction set.
    pub fn new() -> Option<Self> {
        let ok = match V {
            AVX2 => has_avx2(),
            AVX_VNNI => has_avx2() && is_x86_feature_detected!("avxvnni"),
            _ => has_avx512(),
        };
        ok.then_some(Ymm(()))
    }
}

/// 512-bit vectors with AVX-512 F/BW/VL and VNNI (`vpdpbusd`, `vpdpwssd` on zmm).
#[derive(Clone, Copy, Debug)]
pub struct Zmm(());

impl Zmm {
    pub fn new() -> Option<Self> {
        has_avx512().then_some(Zmm(()))
    }
}

// The target-feature entry points, one set per instruction set: everything they call is
// `#[inline(always)]`, so it is compiled with their features.
macro_rules! entry_points {
    ($module:ident, $isa:ty, $features:literal) => {
        mod $module {
            use super::*;

            #[target_feature(enable = $features)]
            pub unsafe fn q0_columns<T: Q0Unpack>(
                s: $isa,
                w: &[T],
                bpr: usize,
                cols: (usize, usize),
                x: &Q8Rows,
                out: Out,
            ) {
                // SAFETY: the caller's contract
                unsafe { tiles::q0_columns::<T, $isa>(s, w, bpr, cols, x, out) }
            }

            #[target_feature(enable = $features)]
            pub unsafe fn k_columns<T: KUnpack>(
                s: $isa,
                w: &[T],
                bpr: usize,
                cols: (usize, usize),
                x: &Q8KRows,
                out: Out,
            ) {
                // SAFETY: the caller's contract
                unsafe { tiles::k_columns::<T, $isa>(s, w, bpr, cols, x, out) }
            }

            #[target_feature(enable = $features)]
            pub unsafe fn q0_lanes<T: Q0Unpack>(
                s: $isa,
                w: &[T],
                bpr: usize,
                cols: (usize, usize),
                x: &Q8Rows,
                out: Out,
                p: &mut LanePanel,
            ) {
                // SAFETY: the caller's contract
                unsafe { lanes::q0_block::<T, $isa>(s, w, bpr, cols, x, out, p) }
            }

            #[target_feature(enable = $features)]
            pub unsafe fn k_lanes<T: KUnpack>(
                s: $isa,
                w: &[T],
                bpr: usize,
                cols: (usize, usize),
                x: &Q8KRows,
                out: Out,
                p: &mut LanePanel,
            ) {
                // SAFETY: the caller's contract
                unsafe { lanes::k_block::<T, $isa>(s, w, bpr, cols, x, out, p) }
            }

            #[target_feature(enable = $features)]
            pub unsafe fn packed_block(s: $isa, w: &Packed, cb: usize, x: Acts<'_>, out: Out, from: usize) {
                // SAFETY: the caller's contract
                unsafe { packed::column_block::<$isa>(s, w, cb, x, out, from) }
            }
        }
    };
}

entry_points!(avx2_entry, Avx2, "avx2,fma,f16c");
entry_points!(avxvnni_entry, AvxVnni, "avx2,fma,f16c,avxvnni");
entry_points!(avx512ymm_entry, Ymm<AVX512_YMM>, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");
entry_points!(zmm_entry, Zmm, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");

// The trait's entry methods: each forwards to the entry point of the token's instruction set,
// `$module($token)` as the match on the instruction set picks it.
macro_rules! forward_entries {
    ($s:ident, $on:expr; $($p:pat => $module:ident($token:expr)),+ $(,)?) => {
        unsafe fn q0_columns<T: Q0Unpack>(self, w: &[T], bpr: usize, cols: (usize, usize), x: &Q8Rows, out: Out) {
            let $s = self;
            // SAFETY: the token proves the features; the rest is the caller's contract
            unsafe { match $on { $($p => $module::q0_columns($token, w, bpr, cols, x, out)),+ } }
        }

        unsafe fn k_columns<T: KUnpack>(self, w: &[T], bpr: usize, cols: (usize, usize), x: &Q8KRows, out: Out) {
            let $s = self;
            // SAFETY: as above
            unsafe { match $on { $($p => $module::k_columns($token, w, bpr, cols, x, out)),+ } }
        }

        unsafe fn q0_lanes<T: Q0Unpack>(
            self,
            w: &[T],
            bpr: usize,
            cols: (usize, usize),
            x: &Q8Rows,
            out: Out,
            p: &mut LanePanel,
        ) {
            let $s = self;
            // SAFETY: as above
            unsafe { match $on { $($p => $module::q0_lanes($token, w, bpr, cols, x, out, p)),+ } }
        }

        unsafe fn k_lanes<T: KUnpack>(
            self,
            w: &[T],
            bpr: usize,
            cols: (usize, usize),
            x: &Q8KRows,
            out: Out,
            p: &mut LanePanel,
        ) {
            let $s = self;
            // SAFETY: as above
            unsafe { match $on { $($p => $module::k_lanes($token, w, bpr, cols, x, out, p)),+ } }
        }

        unsafe fn packed_block(self, w: &Packed, cb: usize, x: Acts<'_>, out: Out, from: usize) {
            let $s = self;
            // SAFETY: as above
            unsafe { match $on { $($p => $module::packed_block($token, w, cb, x, out, from)),+ } }
        }

    };
}

// Every method below runs intrinsics of the token's instruction set; `self` proves the CPU has
// them, which is each `unsafe` block's justification.
impl<const V: u8> Simd for Ymm<V> {
    const W: usize = 32;
    const VNNI: bool = V != AVX2;
    type I = __m256i;
    type F = __m256;

    #[inline(always)]
    fn avx2(self) -> Avx2 {
        Ymm(())
    }
    #[inline(always)]
    fn zero(self) -> __m256i {
        unsafe { _mm256_setzero_si256() }
    }
    #[inline(always)]
    fn zero_f(self) -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const i8) -> __m256i {
        unsafe { _mm256_loadu_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8, v: __m256i) {
        unsafe { _mm256_storeu_si256(p.cast(), v) }
    }
    #[inline(always)]
    unsafe fn load_f(self, p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store_f(self, p: *mut f32, v: __m256) {
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    fn join(self, lo: __m256i, _: __m256i) -> __m256i {
        lo
    }
    #[inline(always)]
    fn widen(self, v: __m256i) -> __m256i {
        v
    }
    #[inline(always)]
    fn add32(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_add_epi32(a, b) }
    }
    #[inline(always)]
    fn flip(self, a: __m256i) -> __m256i {
        unsafe { _mm256_xor_si256(a, _mm256_set1_epi8(-128)) }
    }
    #[inline(always)]
    fn dot_u8(self, acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
        unsafe {
            match V {
                AVX2 => _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))),
                AVX_VNNI => _mm256_dpbusd_avx_epi32(acc, u, x),
                _ => _mm256_dpbusd_epi32(acc, u, x),
            }
        }
    }
    #[inline(always)]
    fn dot_u8_pair(self, acc: __m256i, u1: __m256i, x1: __m256i, u2: __m256i, x2: __m256i) -> __m256i {
        unsafe {
            match V {
                // each pair of products at most 2·63·127, two of them 32004: fits i16
                AVX2 => {
                    let p = _mm256_add_epi16(_mm256_maddubs_epi16(u1, x1), _mm256_maddubs_epi16(u2, x2));
                    _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
                }
                _ => self.dot_u8(self.dot_u8(acc, u1, x1), u2, x2),
            }
        }
    }
    #[inline(always)]
    fn dot_u4_part(self, part: __m256i, u1: __m256i, x1: __m256i, u2: __m256i, x2: __m256i) -> __m256i {
        unsafe {
            match V {
                // i16 sums of 4-bit × i8 pairs: four calls add at most 8·3840 = 30720
                AVX2 => {
                    _mm256_add_epi16(part, _mm256_add_epi16(_mm256_maddubs_epi16(u1, x1), _mm256_maddubs_epi16(u2, x2)))
                }
                _ => self.dot_u8_pair(part, u1, x1, u2, x2),
            }
        }
    }
    #[inline(always)]
    fn part_scale(self, bytes: __m256i, j: usize) -> __m256i {
        unsafe {
            match V {
                // byte j of each lane to bytes 0 and 2 of the lane, zeros (index bit 7) in 1 and 3
                AVX2 => {
                    let j = j as i32;
                    let pick = |lane: i32| (lane * 4 + j) | (0x80 << 8) | ((lane * 4 + j) << 16) | (0x80 << 24);
                    let c = _mm256_setr_epi32(pick(0), pick(1), pick(2), pick(3), pick(0), pick(1), pick(2), pick(3));
                    _mm256_shuffle_epi8(bytes, c)
                }
                _ => {
                    _mm256_and_si256(_mm256_srl_epi32(bytes, _mm_cvtsi32_si128(8 * j as i32)), _mm256_set1_epi32(0xff))
                }
            }
        }
    }
    #[inline(always)]
    fn scale_part(self, acc: __m256i, part: __m256i, sc: __m256i) -> __m256i {
        unsafe {
            match V {
                // the scale in both i16 halves of its lane (`part_scale`): one vpmaddwd widens and
                // scales the partial (a lane's two i16 sums times the scale, added), no vpmulld
                AVX2 => _mm256_add_epi32(acc, _mm256_madd_epi16(part, sc)),
                _ => _mm256_add_epi32(acc, _mm256_mullo_epi32(part, sc)),
            }
        }
    }
    #[inline(always)]
    fn dot_s8(self, acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        unsafe {
            let (u, s) = (_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            match V {
                // |w| ≤ 128, |x| ≤ 127: a pair is at most 32512, no saturation
                AVX2 => _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))),
                _ => self.dot_u8(acc, u, s),
            }
        }
    }
    #[inline(always)]
    fn dot_scaled(self, acc: __m256i, u: __m256i, x: __m256i, sc: __m256i) -> __m256i {
        unsafe {
            let p = _mm256_maddubs_epi16(u, x);
            match V {
                AVX2 => _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc)),
                AVX_VNNI => _mm256_dpwssd_avx_epi32(acc, p, sc),
                _ => _mm256_dpwssd_epi32(acc, p, sc),
            }
        }
    }
    #[inline(always)]
    fn madd(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_madd_epi16(a, b) }
    }
    #[inline(always)]
    fn scales(self, sc: __m128i, step: usize) -> __m256i {
        // Steps 0–3 take their scales from one vector of the even scales' i16 pairs in the low
        // half and the odd ones' in the high (4–7 from another), then one `vpshufd` a step: the
        // two vectors are the same for every step of a super-block (computed once where the steps
        // are unrolled). Picking the bytes by a `vpshufb` per step, LLVM rewrote each into an
        // unpack, two word shuffles and the sign extension: 27 shuffles and sign extensions a
        // Q6_K super-block (broadcasts not counted), where ggml's AVX2 code has 17; now 13.
        unsafe {
            let pairs = |first: i64| {
                // bytes 2j, 2j, 2j+2, 2j+2, … then 2j+1, 2j+1, …, from scale `first` on
                let even = first | first << 8 | (first + 2) << 16 | (first + 2) << 24;
                let even = even | (even + 0x0404_0404) << 32;
                _mm_set_epi64x(even + 0x0101_0101_0101_0101, even)
            };
            let half = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pairs(if step < 4 { 0 } else { 8 })));
            match step % 4 {
                0 => _mm256_shuffle_epi32::<0x00>(half),
                1 => _mm256_shuffle_epi32::<0x55>(half),
                2 => _mm256_shuffle_epi32::<0xAA>(half),
                _ => _mm256_shuffle_epi32::<0xFF>(half),
            }
        }
    }
    #[inline(always)]
    fn cvt(self, a: __m256i) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(a) }
    }
    #[inline(always)]
    fn fmadd(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn set1(self, v: f32) -> __m256 {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    fn hsum(self, a: __m256) -> f32 {
        unsafe {
            let s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
        }
    }
    #[inline(always)]
    fn per_block(self, v: [f32; 2]) -> __m256 {
        unsafe { _mm256_set1_ps(v[0]) }
    }
    /// An f16 broadcast to eight f32 lanes by F16C from a general register: `half`'s conversion
    /// is an out-of-line call, and a scalar `cvtph2ps` of `_mm_cvtsi32_si128` compiled to a
    /// `vpinsrw` merging into the accumulator's register, a false dependency from block to block
    /// (together 0.6× llama.cpp's Q8_0 decode).
    #[inline(always)]
    fn per_block_f16(self, v: [f16; 2]) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_set1_epi16(v[0].to_bits() as i16)) }
    }
    /// A scale of a 32-weight block, the Q8_0 and Q4_0 decode loops' (one a block): a load and a
    /// broadcast from memory, where `vpbroadcastw` + `vcvtph2ps` are four uops, one on the FMA
    /// ports. llvm-mca, the AVX2 Q8_0 loop: 19 → 18 uops a block, throughput bound 4.0 → 3.5
    /// cycles on Skylake and Ice Lake, 4.8 → 4.5 on Zen 2, 3.0 → 2.8 on Zen 3 (ggml's loop: 16
    /// uops; 3.5, 4.0, 2.5). Measured (`cpu_kernels`, one thread, k 2048, in cache, best call):
    /// together with the unswitched prefetch Q8_0 1.06×, Q4_0 1.21×.
    #[inline(always)]
    fn per_block_f16_in(self, table: &F16Table, v: [f16; 2]) -> __m256 {
        unsafe { _mm256_broadcast_ss(table.get(v[0])) }
    }
    #[inline(always)]
    fn per_block_i32(self, v: [i32; 2]) -> __m256i {
        unsafe { _mm256_set1_epi32(v[0]) }
    }
    #[inline(always)]
    fn mullo32(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_mullo_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn bcast32(self, p: *const i8) -> __m256i {
        unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p.cast::<i32>())) }
    }
    #[inline(always)]
    fn and(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_and_si256(a, b) }
    }
    #[inline(always)]
    fn or(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_or_si256(a, b) }
    }
    #[inline(always)]
    fn shr32(self, a: __m256i, n: i32) -> __m256i {
        unsafe { _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)) }
    }
    #[inline(always)]
    fn shl32(self, a: __m256i, n: i32) -> __m256i {
        unsafe { _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)) }
    }
    #[inline(always)]
    fn set1_i32(self, v: i32) -> __m256i {
        unsafe { _mm256_set1_epi32(v) }
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u8) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_i8_i32(self, p: *const u8) -> __m256i {
        unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())) }
    }

    forward_entries!(_s, V;
        AVX2 => avx2_entry(Ymm(())),
        AVX_VNNI => avxvnni_entry(Ymm(())),
        _ => avx512ymm_entry(Ymm(())),
    );
}

impl Simd for Zmm {
    const W: usize = 64;
    const VNNI: bool = true;
    type I = __m512i;
    type F = __m512;

    #[inline(always)]
    fn avx2(self) -> Avx2 {
        Ymm(())
    }
    #[inline(always)]
    fn zero(self) -> __m512i {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    fn zero_f(self) -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const i8) -> __m512i {
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8, v: __m512i) {
        unsafe { _mm512_storeu_si512(p.cast(), v) }
    }
    #[inline(always)]
    unsafe fn load_f(self, p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store_f(self, p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    fn join(self, lo: __m256i, hi: __m256i) -> __m512i {
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi) }
    }
    #[inline(always)]
    fn widen(self, v: __m256i) -> __m512i {
        unsafe { _mm512_zextsi256_si512(v) }
    }
    #[inline(always)]
    fn add32(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    fn flip(self, a: __m512i) -> __m512i {
        unsafe { _mm512_xor_si512(a, _mm512_set1_epi8(-128)) }
    }
    #[inline(always)]
    fn dot_u8(self, acc: __m512i, u: __m512i, x: __m512i) -> __m512i {
        unsafe { _mm512_dpbusd_epi32(acc, u, x) }
    }
    #[inline(always)]
    fn dot_s8(self, acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
        // no vpsignb on zmm: negate x where w < 0 (where w = 0 the product is 0 either way)
        unsafe {
            let neg = _mm512_movepi8_mask(w);
            _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x))
        }
    }
    #[inline(always)]
    fn dot_scaled(self, acc: __m512i, u: __m512i, x: __m512i, sc: __m512i) -> __m512i {
        unsafe { _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(u, x), sc) }
    }
    #[inline(always)]
    fn madd(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_madd_epi16(a, b) }
    }
    #[inline(always)]
    fn scales(self, sc: __m128i, step: usize) -> __m512i {
        unsafe {
            let base = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
            let pick = _mm256_add_epi8(base, _mm256_set1_epi8(4 * step as i8));
            _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(sc), pick))
        }
    }
    #[inline(always)]
    fn cvt(self, a: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    fn fmadd(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn set1(self, v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    fn hsum(self, a: __m512) -> f32 {
        unsafe { _mm512_reduce_add_ps(a) }
    }
    #[inline(always)]
    fn per_block(self, [a, b]: [f32; 2]) -> __m512 {
        unsafe {
            let lo = _mm512_castps_pd(_mm512_castps256_ps512(_mm256_set1_ps(a)));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo, _mm256_castps_pd(_mm256_set1_ps(b))))
        }
    }
    #[inline(always)]
    fn per_block_f16(self, v: [f16; 2]) -> __m512 {
        let (a, b) = (v[0].to_bits() as i16, v[1].to_bits() as i16);
        unsafe { _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a))) }
    }
    /// Two blocks' scales: two broadcasts from memory and one insert, where the conversion is
    /// two word broadcasts, an insert and `vcvtph2ps`, four of them on the shuffle port.
    #[inline(always)]
    fn per_block_f16_in(self, table: &F16Table, [a, b]: [f16; 2]) -> __m512 {
        self.per_block([*table.get(a), *table.get(b)])
    }
    #[inline(always)]
    fn per_block_i32(self, [a, b]: [i32; 2]) -> __m512i {
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_set1_epi32(a)), _mm256_set1_epi32(b)) }
    }
    #[inline(always)]
    fn mullo32(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_mullo_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn bcast32(self, p: *const i8) -> __m512i {
        unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p.cast::<i32>())) }
    }
    #[inline(always)]
    fn and(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    fn or(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    fn shr32(self, a: __m512i, n: i32) -> __m512i {
        unsafe { _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)) }
    }
    #[inline(always)]
    fn shl32(self, a: __m512i, n: i32) -> __m512i {
        unsafe { _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)) }
    }
    #[inline(always)]
    fn set1_i32(self, v: i32) -> __m512i {
        unsafe { _mm512_set1_epi32(v) }
    }
    #[inline(always)]
    unsafe fn load_f16(self, p: *const u8) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_i8_i32(self, p: *const u8) -> __m512i {
        unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())) }
    }

    forward_entries!(s, (); () => zmm_entry(s));
}
