//! ggml's blocks unpacked to bytes by AVX2 code, which every instruction set here has: the
//! one place that knows where each type keeps its quants and scales.

use super::blocks::{KBlock, Q0Block, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};
use super::simd::Avx2;
use half::f16;
use std::arch::x86_64::*;

/// A 32-weight block's weights as bytes.
pub trait Q0Unpack: Q0Block {
    /// The 32 `q`s in order: unsigned (Q4_*: 0..16, Q5_*: 0..32), or Q8_0's signed bytes.
    fn unpack(&self, a: Avx2) -> __m256i;
}

/// A 256-weight super-block's weights as bytes, and its scales.
pub trait KUnpack: KBlock {
    /// The `q`s of weights `32t..32t + 32` (`t` is taken mod 8), unsigned, below 64.
    fn chunk(&self, a: Avx2, t: usize) -> __m256i;
    fn scales(&self, a: Avx2) -> KScales;
}

/// What the K kernels need of a super-block besides its quants.
#[derive(Clone, Copy)]
pub struct KScales {
    /// The scale of each 16 weights, i8.
    pub sc: __m128i,
    /// Per 16 weights, i16: Q4_K/Q5_K's min (times `dmin`), Q6_K's `−32·sc` (times `d`).
    pub corr: __m256i,
    /// Kept as f16 for the kernels to broadcast and convert whole vectors: a scalar conversion
    /// of one loaded half compiles to a `vpinsrw` that merges into whatever register is free,
    /// the accumulator included, a false dependency chaining each block to the last.
    pub d: f16,
    pub dmin: f16,
}

/// Q4_K/Q5_K's 12 scale bytes as 8 six-bit scales and 8 mins (ggml's arrangement: scales 0..4
/// and mins 0..4 in the low 6 bits of bytes 0..4 and 4..8, the rest's low 4 bits in bytes 8..12
/// and high 2 bits on top of bytes 0..8), each over its 32 weights' two 16s.
#[inline(always)]
fn k4_scales(_: Avx2, (d, dmin): (f16, f16), q: &[u8; 12]) -> KScales {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let sc_lo = u0 & LOW6;
    let sc_hi = (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4);
    let m_lo = u1 & LOW6;
    let m_hi = ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4);
    unsafe {
        let v = _mm_set_epi32(m_hi as i32, m_lo as i32, sc_hi as i32, sc_lo as i32);
        let pairs = _mm_set_epi64x(0x0707_0606_0505_0404, 0x0303_0202_0101_0000);
        let sc = _mm_shuffle_epi8(v, pairs);
        let mins = _mm_shuffle_epi8(v, _mm_add_epi8(pairs, _mm_set1_epi8(8)));
        KScales { sc, corr: _mm256_cvtepu8_epi16(mins), d, dmin }
    }
}

// The unpackers run AVX2 instructions, which the `Avx2` token proves the CPU has, on loads
// inside the block they are given: that is each `unsafe` block's justification.

#[inline(always)]
fn nibbles(_: Avx2, qs: &[u8; 16]) -> __m256i {
    unsafe {
        let q = _mm_loadu_si128(qs.as_ptr().cast());
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), _mm256_set1_epi8(0xF))
    }
}

/// Bit `i` of `qh` as `0x10` in byte `i`.
#[inline(always)]
fn fifth_bits(_: Avx2, qh: &[u8; 4]) -> __m256i {
    unsafe {
        let v = _mm256_set1_epi32(i32::from_le_bytes(*qh));
        // byte i takes qh's byte i / 8, then every bit but i % 8 is set: all ones where bit i is
        let spread = _mm256_shuffle_epi8(
            v,
            _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0),
        );
        let ones = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
        _mm256_and_si256(_mm256_cmpeq_epi8(ones, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10))
    }
}

impl Q0Unpack for Q4_0 {
    #[inline(always)]
    fn unpack(&self, a: Avx2) -> __m256i {
        nibbles(a, &self.qs)
    }
}

impl Q0Unpack for Q4_1 {
    #[inline(always)]
    fn unpack(&self, a: Avx2) -> __m256i {
        nibbles(a, &self.qs)
    }
}

impl Q0Unpack for Q5_0 {
    #[inline(always)]
    fn unpack(&self, a: Avx2) -> __m256i {
        unsafe { _mm256_or_si256(nibbles(a, &self.qs), fifth_bits(a, &self.qh)) }
    }
}

impl Q0Unpack for Q5_1 {
    #[inline(always)]
    fn unpack(&self, a: Avx2) -> __m256i {
        unsafe { _mm256_or_si256(nibbles(a, &self.qs), fifth_bits(a, &self.qh)) }
    }
}

impl Q0Unpack for Q8_0 {
    #[inline(always)]
    fn unpack(&self, _: Avx2) -> __m256i {
        unsafe { _mm256_loadu_si256(self.qs.as_ptr().cast()) }
    }
}

/// The nibbles of `qs[32h..32h + 32]`, low (`t` even) or high (`t` odd): weights `32t..`.
#[inline(always)]
fn k4_nibbles(_: Avx2, qs: &[u8; 128], t: usize) -> __m256i {
    let h = (t / 2) % 4;
    unsafe {
        let q = _mm256_loadu_si256(qs.as_ptr().add(32 * h).cast());
        let shift = _mm_cvtsi32_si128(4 * (t & 1) as i32);
        _mm256_and_si256(_mm256_srl_epi16(q, shift), _mm256_set1_epi8(0xF))
    }
}

impl KUnpack for Q4K {
    #[inline(always)]
    fn chunk(&self, a: Avx2, t: usize) -> __m256i {
        k4_nibbles(a, &self.qs, t)
    }
    #[inline(always)]
    fn scales(&self, a: Avx2) -> KScales {
        k4_scales(a, (self.d, self.dmin), &self.scales)
    }
}

impl KUnpack for Q5K {
    #[inline(always)]
    fn chunk(&self, a: Avx2, t: usize) -> __m256i {
        unsafe {
            let qh = _mm256_loadu_si256(self.qh.as_ptr().cast());
            // bit t of each byte to 0x10 (16-bit shifts carry bits across bytes; the mask drops them)
            let bit = _mm256_slli_epi16::<4>(_mm256_srl_epi16(qh, _mm_cvtsi32_si128((t % 8) as i32)));
            _mm256_or_si256(k4_nibbles(a, &self.qs, t), _mm256_and_si256(bit, _mm256_set1_epi8(0x10)))
        }
    }
    #[inline(always)]
    fn scales(&self, a: Avx2) -> KScales {
        k4_scales(a, (self.d, self.dmin), &self.scales)
    }
}

impl KUnpack for Q6K {
    #[inline(always)]
    fn chunk(&self, _: Avx2, t: usize) -> __m256i {
        let (n, r) = ((t / 4) % 2, t % 4);
        unsafe {
            let ql = _mm256_loadu_si256(self.ql.as_ptr().add(64 * n + 32 * (r & 1)).cast());
            let qh = _mm256_loadu_si256(self.qh.as_ptr().add(32 * n).cast());
            let low =
                _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (r >> 1) as i32)), _mm256_set1_epi8(0xF));
            let high = _mm256_slli_epi16::<4>(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r as i32)));
            _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)))
        }
    }
    #[inline(always)]
    fn scales(&self, _: Avx2) -> KScales {
        unsafe {
            let sc = _mm_loadu_si128(self.scales.as_ptr().cast());
            let corr = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16::<5>(_mm256_cvtepi8_epi16(sc)));
            KScales { sc, corr, d: self.d, dmin: f16::ZERO }
        }
    }
}
