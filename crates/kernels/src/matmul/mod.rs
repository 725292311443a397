//! brigade's CPU matrix multiply by a ggml weight (quantized, f16, bf16 or f32), as a candle
//! custom op, always over the weight's own blocks.
//!
//! Why not candle's own `QTensor` op: on x86 it keeps a second, repacked copy of Q4_K weights
//! (and of Q6_K/Q8_0 where it repacks) for every matmul, so a model takes up to 2.3× its file size
//! in memory and a decode step reads 6 bits per Q4_K weight instead of 4.5. Here every weight
//! holds its file's bytes, once:
//! - On AVX-512, Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (every Q4_K_M and Q5_K_M
//!   file's types, and the 32-weight ones) are repacked when the model loads, on AVX2 and
//!   AVX-VNNI all but Q6_K and Q8_0 ([`Packed`], `packed`; [`packs_on`] says why): the same bytes regrouped into records of 32 output columns, so
//!   that one vector load serves 16 (or 8) columns and each activation row is broadcast. One
//!   kernel then serves every number of rows — decode of one session, of several at once, and
//!   prompts — with each row's arithmetic its own (batch invariance at any batch size, and a
//!   prompt row gets a decode row's numbers). `BRIGADE_CPU_PACK=off` keeps the file's layout.
//! - The packed types where packing is off or this instruction set does not pack them go
//!   through int8 kernels on the file's blocks, as llama.cpp
//!   computes them (activations quantized to int8 per 32 or per 256, integer dot products, one
//!   float scale per block). Up to [`DECODE_ROWS`] activation rows are vec-dots per weight row
//!   straight from the blocks, each block unpacked once for all the rows, each row quantized
//!   and computed exactly as it would be alone (batch invariance); more rows (prompts) run over
//!   a panel of 32 (AVX-512) or 8 weight columns unpacked once per matmul, the columns in vector
//!   lanes and each row's activations broadcast (see `lanes`: with VNNI one `vpdpbusd` per
//!   weight and row, no horizontal sums).
//! - Prompts (32 rows or more) on packed Q4_K and Q6_K go through Intel AMX where the CPU has it and
//!   Linux grants it (`amx`: the same numbers, the integer sums from the tile unit);
//!   `BRIGADE_CPU_AMX=off` keeps them on AVX-512.
//! - The instruction set is chosen at run time ([`Isa`]): AVX-512 VNNI (`vpdpbusd` on zmm),
//!   AVX-VNNI (ymm), AVX2, or none; `BRIGADE_CPU_KERNELS=avx512|avxvnni|avx2|portable` picks a
//!   lesser one, to measure it.
//! - the rest (Q2_K, Q3_K, floats), and every type where there is no AVX2: candle's vec-dots on
//!   the weight's own blocks for up to [`DECODE_ROWS`] rows, else the weight dequantized a band of
//!   rows at a time into a reused buffer and multiplied with the `gemm` crate (memory bounded by
//!   one band).
//!
//! The kernels are hand-written because no crate computes on ggml blocks in place.
//!
//! # Layout
//! - this file: the op, the kernel choice ([`Kernel`], [`Isa`]) and [`matmul`], the one safe
//!   entry: it checks the CPU's instructions and every length before a kernel runs;
//! - [`blocks`]: ggml's block layouts and the checked cast of bytes to blocks;
//! - `acts`: activations quantized to int8 (per 32, or per 256 for the K-quants);
//! - `simd` (x86_64): the vector operations of each instruction set behind one trait, whose
//!   values prove the CPU has it; `unpack`: each type's blocks to bytes; `tiles`: the decode
//!   vec-dots written once over `simd`, and the drivers of both kinds on candle's thread pool;
//!   `lanes`: the prompt kernels (columns in lanes, their panel), also over `simd`; `packed`:
//!   the load-time repacking and its kernels;
//! - `tests`: every kernel on every instruction set this CPU has, against a scalar reference.
//!
//! Deliberately absent: a second copy of any weight (the packed layout replaces the file's, it
//! is not kept beside it: a tied output head is packed and its embedding's lookups dequantize
//! rows from the packed records, [`Packed::dequantize_row`]), and int8 kernels for Q2_K/Q3_K
//! (rare in practice).

mod acts;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) mod amx;
pub mod blocks;
#[cfg(target_arch = "x86_64")]
mod lanes;
#[cfg(target_arch = "x86_64")]
mod packed;
#[cfg(target_arch = "x86_64")]
mod simd;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod tiles;
#[cfg(target_arch = "x86_64")]
mod unpack;

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0,
    BlockQ8_1, GgmlType,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, Layout, Shape};
use rayon::prelude::*;
use std::sync::{Arc, OnceLock};

/// Rows of activations up to which each row is computed as a vec-dot of its own on a weight in
/// the file's layout (brigade's int8 kernels, sharing the unpacking of each weight block, or
/// candle's where those do not run): a row's result does not depend on the rows beside it.
/// (Packed weights compute every row as alone at any number of rows.) 8: `brigade serve`'s batches of up to 8
/// sessions read each weight once per step, and on Q4_K the vec-dots beat the prompt kernel
/// there (67 GMAC/s at 8 rows against 54 at 9, AVX-512, one thread, `cpu_kernels`), whose
/// panel pays off from about 12 rows.
pub const DECODE_ROWS: usize = 8;
/// Elements of dequantized weight per band (16 MiB of f32).
const BAND_ELEMS: usize = 4 << 20;

/// Every weight type candle quantizes to (what a full measurement times).
pub const WEIGHT_TYPES: [GgmlDType; 13] = [
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
];

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("weight storage of {bytes} bytes is not whole blocks of {block} bytes aligned to {align}")]
    Storage { bytes: usize, block: usize, align: usize },
    #[error("k = {k} is not a multiple of the weight's block of {block}")]
    BlockSize { k: usize, block: usize },
    #[error("{what} holds {len} values, a ({m}, {k}) × ({n}, {k})ᵀ matmul needs {want}")]
    Shape { what: &'static str, len: usize, want: usize, m: usize, k: usize, n: usize },
    #[error("row {row} of a weight of {rows} rows × {k} (into {len} values)")]
    Row { row: usize, rows: usize, k: usize, len: usize },
    #[error("this CPU lacks the {0} instructions")]
    Unavailable(&'static str),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The instruction sets the int8 kernels are built for, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F/BW/VL + VNNI: `vpdpbusd`/`vpdpwssd` on 512-bit registers.
    Avx512Vnni,
    /// AVX-VNNI: `vpdpbusd`/`vpdpwssd` on 256-bit registers (VEX-encoded; Alder Lake, Zen 5).
    AvxVnni,
    /// AVX2 + FMA + F16C: `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// No int8 kernels of ours: candle's vec-dots and dequantize + gemm.
    Portable,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2, Isa::Portable];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Vnni => "AVX-512 VNNI",
            Isa::AvxVnni => "AVX-VNNI",
            Isa::Avx2 => "AVX2",
            Isa::Portable => "portable",
        }
    }

    /// Whether this CPU has the instructions.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Isa::Avx512Vnni => simd::Zmm::new().is_some(),
                Isa::AvxVnni => simd::AvxVnni::new().is_some(),
                Isa::Avx2 => simd::Avx2::new().is_some(),
                Isa::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Portable
        }
    }

    /// The best instruction set this CPU has.
    pub fn best() -> Isa {
        Isa::ALL.into_iter().find(|i| i.available()).unwrap_or(Isa::Portable)
    }

    /// What `BRIGADE_CPU_KERNELS` asks for: `None` for automatic (unset, empty or `auto`),
    /// `Err` for a name it does not know.
    pub fn parse(v: &str) -> Result<Option<Isa>, String> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(None),
            "avx512" | "avx-512" | "avx512vnni" => Ok(Some(Isa::Avx512Vnni)),
            "avxvnni" | "avx-vnni" => Ok(Some(Isa::AvxVnni)),
            "avx2" => Ok(Some(Isa::Avx2)),
            "portable" | "none" => Ok(Some(Isa::Portable)),
            other => Err(format!("BRIGADE_CPU_KERNELS={other}: expected auto, avx512, avxvnni, avx2 or portable")),
        }
    }

    /// The instruction set `BRIGADE_CPU_KERNELS` names, where this CPU has it (`None`: unset,
    /// unknown, or not on this CPU).
    pub fn asked() -> Option<Isa> {
        match Isa::parse(&std::env::var("BRIGADE_CPU_KERNELS").unwrap_or_default()) {
            Ok(Some(isa)) if isa.available() => Some(isa),
            _ => None,
        }
    }

    /// The instruction set the op uses: [`Isa::best`], or `BRIGADE_CPU_KERNELS` where this CPU
    /// has it. Decided once per process.
    pub fn selected() -> Isa {
        static SELECTED: OnceLock<Isa> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            if let Some(isa) = Isa::asked() {
                return isa;
            }
            // unset, or a request this CPU cannot honour: say which
            let best = Isa::best();
            let asked = std::env::var("BRIGADE_CPU_KERNELS").unwrap_or_default();
            match Isa::parse(&asked) {
                Ok(None) => {}
                Ok(Some(isa)) => {
                    tracing::warn!("BRIGADE_CPU_KERNELS={asked}: this CPU lacks {}, using {}", isa.name(), best.name())
                }
                Err(e) => tracing::warn!("{e}; using {}", best.name()),
            }
            best
        })
    }
}

/// The CPU kernel of one matmul, chosen by [`Kernel::choose`] for the op and for reports alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// brigade's int8 kernel, one activation row: a vec-dot per weight row.
    VecDot(Isa),
    /// brigade's int8 prompt kernels, several activation rows (columns in vector lanes).
    Lanes(Isa),
    /// brigade's int8 kernels on a weight packed at load ([`Packed`]), any number of rows.
    Packed(Isa),
    CandleVecDot,
    DequantGemm,
}

/// The weight types of brigade's int8 kernels; `Some(true)` for the 256-weight K-quants.
fn int8_family(dt: GgmlDType) -> Option<bool> {
    match dt {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 | GgmlDType::Q8_0 => Some(false),
        GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => Some(true),
        _ => None,
    }
}

impl Kernel {
    /// The kernel for `m` activation rows times a weight of type `dt`, on [`Isa::selected`].
    pub fn choose(dt: GgmlDType, m: usize) -> Kernel {
        Kernel::choose_for(dt, m, Isa::selected())
    }

    /// The kernel for `m` activation rows times a weight of type `dt` on `isa`.
    pub fn choose_for(dt: GgmlDType, m: usize, isa: Isa) -> Kernel {
        match (isa, int8_family(dt)) {
            (Isa::Portable, _) | (_, None) if m <= DECODE_ROWS => Kernel::CandleVecDot,
            (Isa::Portable, _) | (_, None) => Kernel::DequantGemm,
            _ if m <= DECODE_ROWS => Kernel::VecDot(isa),
            _ => Kernel::Lanes(isa),
        }
    }

    /// What the kernel is, in words (for `brigade bench`).
    pub fn describe(self, dt: GgmlDType) -> &'static str {
        let float = matches!(dt, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        let k = int8_family(dt) == Some(true);
        // the prompt shapes are `lanes::ROWS` × `lanes::block_cols` of each instruction set
        match (self, k) {
            (Kernel::VecDot(Isa::Avx512Vnni), false) => "brigade AVX-512 VNNI int8 vec-dot (activations int8 per 32)",
            (Kernel::VecDot(Isa::Avx512Vnni), true) => "brigade AVX-512 VNNI int8 vec-dot (activations int8 per 256)",
            (Kernel::VecDot(Isa::AvxVnni), false) => "brigade AVX-VNNI int8 vec-dot (activations int8 per 32)",
            (Kernel::VecDot(Isa::AvxVnni), true) => "brigade AVX-VNNI int8 vec-dot (activations int8 per 256)",
            (Kernel::VecDot(_), false) => "brigade AVX2 int8 vec-dot (activations int8 per 32)",
            (Kernel::VecDot(_), true) => "brigade AVX2 int8 vec-dot (activations int8 per 256)",
            (Kernel::Lanes(Isa::Avx512Vnni), false) => {
                "brigade AVX-512 VNNI int8, 4 rows × 32 columns in lanes (activations int8 per 32)"
            }
            (Kernel::Lanes(Isa::Avx512Vnni), true) => {
                "brigade AVX-512 VNNI int8, 4 rows × 32 columns in lanes (activations int8 per 256)"
            }
            (Kernel::Lanes(Isa::AvxVnni), false) => {
                "brigade AVX-VNNI int8, 4 rows × 8 columns in lanes (activations int8 per 32)"
            }
            (Kernel::Lanes(Isa::AvxVnni), true) => {
                "brigade AVX-VNNI int8, 4 rows × 8 columns in lanes (activations int8 per 256)"
            }
            (Kernel::Lanes(_), false) => "brigade AVX2 int8, 4 rows × 8 columns in lanes (activations int8 per 32)",
            (Kernel::Lanes(_), true) => "brigade AVX2 int8, 4 rows × 8 columns in lanes (activations int8 per 256)",
            (Kernel::Packed(Isa::Avx512Vnni), false) => {
                "brigade AVX-512 VNNI int8, weights packed at load, 4 rows × 32 columns in lanes (activations int8 per 32)"
            }
            (Kernel::Packed(Isa::Avx512Vnni), true) => {
                "brigade AVX-512 VNNI int8, weights packed at load, 4 rows × 32 columns in lanes (activations int8 per 256)"
            }
            (Kernel::Packed(Isa::AvxVnni), false) => {
                "brigade AVX-VNNI int8, weights packed at load, 4 rows × 8 columns in lanes (activations int8 per 32)"
            }
            (Kernel::Packed(Isa::AvxVnni), true) => {
                "brigade AVX-VNNI int8, weights packed at load, 4 rows × 8 columns in lanes (activations int8 per 256)"
            }
            (Kernel::Packed(_), false) => {
                "brigade AVX2 int8, weights packed at load, 4 rows × 8 columns in lanes (activations int8 per 32)"
            }
            (Kernel::Packed(_), true) => {
                "brigade AVX2 int8, weights packed at load, 4 rows × 8 columns in lanes (activations int8 per 256)"
            }
            (Kernel::CandleVecDot, _) if float => "candle vec-dot (float)",
            (Kernel::CandleVecDot, _) => "candle int8 vec-dot",
            (Kernel::DequantGemm, _) if float => "f32 band + gemm",
            (Kernel::DequantGemm, _) => "dequantize band + f32 gemm",
        }
    }
}

/// Which kernels the CPU runs for a weight type: (decode, prompt), for reports.
pub fn kernels(dt: GgmlDType) -> (&'static str, &'static str) {
    let isa = Isa::selected();
    if packs_on(dt, isa) {
        let k = Kernel::Packed(isa).describe(dt);
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if matches!(dt, GgmlDType::Q4K | GgmlDType::Q6K) && isa == Isa::Avx512Vnni && amx::available() {
            return (k, "brigade AMX int8 tiles, 16 rows × 16 columns from 32 rows (fewer: AVX-512 VNNI), weights packed at load (activations int8 per 256)");
        }
        return (k, k);
    }
    (Kernel::choose(dt, 1).describe(dt), Kernel::choose(dt, DECODE_ROWS + 1).describe(dt))
}

/// Whether weights of type `dt` are packed at load for `isa` (see [`Packed`]): Q4_K, Q5_K, Q6_K,
/// Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 on AVX-512; all but Q6_K and Q8_0 on 256-bit registers (AVX2,
/// AVX-VNNI). The 4- and 5-bit types' packed records are faster there (`cpu_kernels TYPE 1 2048
/// 200000 avx2`, 2 threads, a 2-vCPU AMD EPYC, from memory: Q4_0 58–85 GMAC/s packed against 49,
/// Q4_1 52 against 29, Q5_0 42 against 32, Q5_1 41 against 28; 64 rows × 2048 × 16384: Q4_0 165
/// against 142, Q4_1 169 against 147, Q5_0 152 against 145, Q5_1 149 against 142; on AVX-512 Q5_0
/// 42 against 36 and 277 against 216, Q5_1 40 against 32 and 287 against 218; 2026-12-06).
/// Q5_K is packed everywhere since 2026-12-07 (its packed kernel is Q4_K's plus the fifth bits
/// in i32 lanes). It had been left out on a measurement of 0.91× the vec-dots from memory
/// (44.5 against 49 GMAC/s, AVX-512); on the AMD EPYC of 2026-12-07, with the records asked for
/// ahead, `cpu_kernels q5_k M 2048 N`, 2 threads, packed against the file's layout: one row ×
/// 200000 from memory, AVX-512 41.8 / 48.3 / 47.0 against 43.8 / 43.1 / 40.8, AVX2 59.5 / 55.8
/// against 41.0 / 40.3; 8 rows × 50000 AVX-512 220 against 101, AVX2 95 against 51; 64 rows ×
/// 16384 AVX-512 259 against 212 (lanes), AVX2 122 against 116. Whole models (`brigade bench`,
/// 2 threads, alternated): SmolLM2-135M requantized to Q5_K_M pp512 900 against 839 and tg32
/// 177 against 156 t/s; the synthetic 1.5B as Q5_K_M on AVX-512 even (pp512 210 / 216 against
/// 202 / 224, tg32 29.0 / 28.7 / 28.8 against 29.1 / 27.6 / 27.1), on AVX2 pp256 0.93–0.96× (95
/// / 109 against 102 / 113) for tg32 1.06–1.4× (29.3 / 39.0 against 27.8 / 27.5): packed, a
/// prompt row also reads the same in any chunk.
/// For Q6_K and Q8_0 the packed kernels
/// read a record as four chunks of 8 columns, which memory serves slower than the vec-dots'
/// one stream for Q6_K and Q8_0 (one row × 2048 × 32000 from memory, AVX2, one thread on a
/// 2-vCPU AMD EPYC: Q6_K 17 GMAC/s packed against 27, Q8_0 9 against 22), while Q4_K's packed
/// records are faster at every row count (36 against 31 GMAC/s from memory; in cache 57
/// against 31 for one row, 95 against 59 for 8, 92 against 83 for 128). AVX-VNNI reads
/// memory as AVX2 does and follows it. On a 2-vCPU Intel Xeon, with the packed kernels asking
/// for their records ahead (`packed::AHEAD`), from memory (`cpu_kernels TYPE 1 2048 400000`,
/// 2 threads, AVX2): Q6_K 26.6 packed against 30.4, Q8_0 26.2 against 24.9 — no reason to move
/// either (on the AMD EPYC on 2026-12-06: Q6_K 34–37 against 39–60, Q8_0 29–31 against 30–46).
/// The kernels not chosen are
/// tested and timed (`cpu_kernels`) all the same. `BRIGADE_CPU_PACK=off` keeps every weight in
/// the file's layout (to measure the difference).
pub fn packs_on(dt: GgmlDType, isa: Isa) -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| switched_off("BRIGADE_CPU_PACK"));
    #[cfg(target_arch = "x86_64")]
    {
        !off && packed::packs(dt)
            && match isa {
                Isa::Avx512Vnni => true,
                Isa::AvxVnni | Isa::Avx2 => !matches!(dt, GgmlDType::Q6K | GgmlDType::Q8_0),
                Isa::Portable => false,
            }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dt, isa, off);
        false
    }
}

/// Whether this process may use Intel AMX's tile unit (the CPU has it and Linux granted it).
pub fn amx_available() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return amx::available();
    #[allow(unreachable_code)]
    false
}

/// Whether the environment variable `var` turns a kernel feature off (`off`, `0` or `no`), for
/// measuring what the feature gives.
pub fn switched_off(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| matches!(v.trim(), "off" | "0" | "no"))
}

/// The weight `w` (a `[n, k]` weight of type `dt` as the file stores it) packed for this CPU's
/// kernels ([`Isa::selected`]), or `None` where it keeps the file's layout.
pub fn pack(dt: GgmlDType, w: &[u8], nk: (usize, usize)) -> Result<Option<Packed>, KernelError> {
    if !packs_on(dt, Isa::selected()) {
        return Ok(None);
    }
    #[cfg(target_arch = "x86_64")]
    {
        Packed::new(dt, w, nk).map(Some)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, nk);
        Ok(None)
    }
}

#[cfg(target_arch = "x86_64")]
pub use packed::Packed;

/// Packed weights exist on x86-64 only (where the int8 kernels are).
#[cfg(not(target_arch = "x86_64"))]
#[derive(Debug)]
pub enum Packed {}

#[cfg(not(target_arch = "x86_64"))]
impl Packed {
    pub fn dtype(&self) -> GgmlDType {
        match *self {}
    }
    pub fn shape(&self) -> (usize, usize) {
        match *self {}
    }
    pub fn storage_bytes(&self) -> usize {
        match *self {}
    }
}

/// `dst[m, n] = lhs[m, k] @ w[n, k]ᵀ` for a packed weight on `isa`; checks that this CPU has
/// `isa` and every length first.
pub fn matmul_packed(w: &Packed, m: usize, lhs: &[f32], dst: &mut [f32], isa: Isa) -> Result<Kernel, KernelError> {
    let (n, k) = w.shape();
    if Some(dst.len()) != m.checked_mul(n) {
        return Err(KernelError::Shape { what: "the output", len: dst.len(), want: m.saturating_mul(n), m, k, n });
    }
    // SAFETY: `dst` is the m × n values, borrowed mutably for the call
    unsafe { packed_into(w, m, lhs, dst.as_mut_ptr(), isa) }
}

/// [`matmul_packed`] into a new `m × n` vector, which is not zeroed first: the packed kernels
/// store every value of their output (a prompt's outputs are megabytes; zeroing them was 2.4% of
/// a 500-token prompt's time, llama-1b q4_k with AMX, `perf`).
pub fn matmul_packed_new(w: &Packed, m: usize, lhs: &[f32], isa: Isa) -> Result<Vec<f32>, KernelError> {
    let (n, k) = w.shape();
    let len = m.checked_mul(n).ok_or(KernelError::Shape { what: "the output", len: 0, want: usize::MAX, m, k, n })?;
    let mut dst = Vec::with_capacity(len);
    // SAFETY: the vector's buffer has room for `len` values and is this call's alone
    unsafe { packed_into(w, m, lhs, dst.as_mut_ptr(), isa)? };
    // SAFETY: `packed_into` returned Ok, so the kernels stored every one of the `len` values
    unsafe { dst.set_len(len) };
    Ok(dst)
}

/// The packed matmul into `dst` after checking `isa` and the input's length.
///
/// # Safety
/// `dst` points to `m · n` writable `f32` (initialized or not) that nothing else reads or
/// writes during the call; on `Ok` every one of them has been stored.
unsafe fn packed_into(w: &Packed, m: usize, lhs: &[f32], dst: *mut f32, isa: Isa) -> Result<Kernel, KernelError> {
    if !isa.available() || isa == Isa::Portable {
        return Err(KernelError::Unavailable(isa.name()));
    }
    let (n, k) = w.shape();
    if Some(lhs.len()) != m.checked_mul(k) {
        return Err(KernelError::Shape { what: "the input", len: lhs.len(), want: m.saturating_mul(k), m, k, n });
    }
    #[cfg(target_arch = "x86_64")]
    {
        let unavailable = KernelError::Unavailable(isa.name());
        let out = tiles::Out { ptr: dst as usize, m, n };
        // SAFETY: the input's length is checked above, the output's is the caller's contract;
        // the tokens check the instructions
        unsafe {
            match isa {
                Isa::Avx512Vnni => packed::matmul(simd::Zmm::new().ok_or(unavailable)?, w, m, lhs, out),
                Isa::AvxVnni => packed::matmul(simd::AvxVnni::new().ok_or(unavailable)?, w, m, lhs, out),
                Isa::Avx2 => packed::matmul(simd::Avx2::new().ok_or(unavailable)?, w, m, lhs, out),
                Isa::Portable => return Err(unavailable),
            }
        }
        Ok(Kernel::Packed(isa))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = dst;
        match *w {}
    }
}

/// One matmul of [`matmul_packed_group`]: `lhs (m × k) @ wᵀ` into `dst (m × n)`.
pub struct PackedJob<'a> {
    pub w: &'a Packed,
    pub m: usize,
    pub lhs: &'a [f32],
    pub dst: &'a mut [f32],
}

/// [`matmul_packed`] of several jobs in one dispatch of the thread pool (a token's experts):
/// each job's numbers are, bit for bit, what [`matmul_packed`] gives it alone below the AMX
/// row count — a job at or above it (AMX computes it) runs alone through [`matmul_packed`].
pub fn matmul_packed_group(jobs: &mut [PackedJob<'_>], isa: Isa) -> Result<Kernel, KernelError> {
    if !isa.available() || isa == Isa::Portable {
        return Err(KernelError::Unavailable(isa.name()));
    }
    for j in jobs.iter() {
        let (n, k) = j.w.shape();
        let m = j.m;
        let shape = |what, len, want| KernelError::Shape { what, len, want, m, k, n };
        if Some(j.lhs.len()) != m.checked_mul(k) {
            return Err(shape("the input", j.lhs.len(), m.saturating_mul(k)));
        }
        if Some(j.dst.len()) != m.checked_mul(n) {
            return Err(shape("the output", j.dst.len(), m.saturating_mul(n)));
        }
    }
    if jobs.iter().any(|j| j.m >= amx::MIN_ROWS) {
        for j in jobs.iter_mut() {
            matmul_packed(j.w, j.m, j.lhs, j.dst, isa)?;
        }
        return Ok(Kernel::Packed(isa));
    }
    #[cfg(target_arch = "x86_64")]
    {
        let unavailable = KernelError::Unavailable(isa.name());
        // SAFETY: the lengths are checked above; the tokens check the instructions
        unsafe {
            match isa {
                Isa::Avx512Vnni => packed::matmul_group(simd::Zmm::new().ok_or(unavailable)?, jobs),
                Isa::AvxVnni => packed::matmul_group(simd::AvxVnni::new().ok_or(unavailable)?, jobs),
                Isa::Avx2 => packed::matmul_group(simd::Avx2::new().ok_or(unavailable)?, jobs),
                Isa::Portable => return Err(unavailable),
            }
        }
        Ok(Kernel::Packed(isa))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Err(KernelError::Unavailable(isa.name()))
    }
}

/// `x @ wᵀ` for a weight packed at load ([`Packed`]).
pub struct PackedMatMul(pub Arc<Packed>);

impl candle_core::CustomOp1 for PackedMatMul {
    fn name(&self) -> &'static str {
        "brigade-packed-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, k) = self.0.shape();
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
        let dst = matmul_packed_new(&self.0, m, lhs, Isa::selected()).map_err(candle_core::Error::wrap)?;
        let mut out = batch.to_vec();
        out.push(n);
        Ok((CpuStorage::F32(dst), Shape::from(out)))
    }
}

/// Checks the lengths of a `(m, k) × (n, k)ᵀ` matmul by a `dt` weight held as `w`.
fn check(
    dt: GgmlDType,
    w: &[u8],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    dst: &[f32],
) -> Result<(), KernelError> {
    let block = dt.block_size();
    if !k.is_multiple_of(block) {
        return Err(KernelError::BlockSize { k, block });
    }
    let shape = |what, len, want| KernelError::Shape { what, len, want, m, k, n };
    let want = (k / block).checked_mul(n).and_then(|b| b.checked_mul(dt.type_size())).unwrap_or(usize::MAX);
    if w.len() != want {
        return Err(shape("the weight's storage (bytes)", w.len(), want));
    }
    if Some(lhs.len()) != m.checked_mul(k) {
        return Err(shape("the input", lhs.len(), m.saturating_mul(k)));
    }
    if Some(dst.len()) != m.checked_mul(n) {
        return Err(shape("the output", dst.len(), m.saturating_mul(n)));
    }
    Ok(())
}

/// `dst[m, n] = lhs[m, k] @ w[n, k]ᵀ` for a weight of ggml type `dt` stored as `w` (whole blocks,
/// as candle keeps them), by the kernel [`Kernel::choose_for`] picks on `isa`. Checks that this
/// CPU has `isa` and every length first; returns the kernel it ran.
pub fn matmul(
    dt: GgmlDType,
    w: &[u8],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
    isa: Isa,
) -> Result<Kernel, KernelError> {
    if !isa.available() {
        return Err(KernelError::Unavailable(isa.name()));
    }
    check(dt, w, (m, k, n), lhs, dst)?;
    let kernel = Kernel::choose_for(dt, m, isa);
    match kernel {
        Kernel::VecDot(_) | Kernel::Lanes(_) => int8(dt, w, (m, k, n), lhs, dst, isa)?,
        Kernel::Packed(_) => unreachable!("`choose_for` picks file-layout kernels"),
        Kernel::CandleVecDot => {
            with_block!(dt, T => candle_core::quantized::k_quants::matmul::<T>((m, k, n), lhs, blocks::cast::<T>(w)?, dst)?)
        }
        Kernel::DequantGemm => with_block!(dt, T => dequant_gemm::<T>(blocks::cast::<T>(w)?, (m, k, n), lhs, dst)),
    }
    Ok(kernel)
}

/// The int8 kernels on `isa` (lengths checked by the caller).
#[cfg(target_arch = "x86_64")]
fn int8(
    dt: GgmlDType,
    w: &[u8],
    mkn: (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
    isa: Isa,
) -> Result<(), KernelError> {
    let unavailable = KernelError::Unavailable(isa.name());
    match isa {
        Isa::Avx512Vnni => int8_on(simd::Zmm::new().ok_or(unavailable)?, dt, w, mkn, lhs, dst),
        Isa::AvxVnni => int8_on(simd::AvxVnni::new().ok_or(unavailable)?, dt, w, mkn, lhs, dst),
        Isa::Avx2 => int8_on(simd::Avx2::new().ok_or(unavailable)?, dt, w, mkn, lhs, dst),
        Isa::Portable => Err(unavailable),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn int8(
    dt: GgmlDType,
    _: &[u8],
    _: (usize, usize, usize),
    _: &[f32],
    _: &mut [f32],
    isa: Isa,
) -> Result<(), KernelError> {
    let _ = dt;
    Err(KernelError::Unavailable(isa.name()))
}

/// The int8 kernel for `dt` on the instruction set `s` (lengths checked by the caller).
#[cfg(target_arch = "x86_64")]
fn int8_on<S: simd::Simd>(
    s: S,
    dt: GgmlDType,
    w: &[u8],
    mkn: (usize, usize, usize),
    lhs: &[f32],
    dst: &mut [f32],
) -> Result<(), KernelError> {
    use blocks::cast;
    // SAFETY: `check` verified k against the block size and every length
    unsafe {
        match dt {
            GgmlDType::Q4_0 => tiles::matmul_q0(s, cast::<blocks::Q4_0>(w)?, mkn, lhs, dst),
            GgmlDType::Q4_1 => tiles::matmul_q0(s, cast::<blocks::Q4_1>(w)?, mkn, lhs, dst),
            GgmlDType::Q5_0 => tiles::matmul_q0(s, cast::<blocks::Q5_0>(w)?, mkn, lhs, dst),
            GgmlDType::Q5_1 => tiles::matmul_q0(s, cast::<blocks::Q5_1>(w)?, mkn, lhs, dst),
            GgmlDType::Q8_0 => tiles::matmul_q0(s, cast::<blocks::Q8_0>(w)?, mkn, lhs, dst),
            GgmlDType::Q4K => tiles::matmul_k(s, cast::<blocks::Q4K>(w)?, mkn, lhs, dst),
            GgmlDType::Q5K => tiles::matmul_k(s, cast::<blocks::Q5K>(w)?, mkn, lhs, dst),
            GgmlDType::Q6K => tiles::matmul_k(s, cast::<blocks::Q6K>(w)?, mkn, lhs, dst),
            other => return Err(KernelError::Candle(candle_core::Error::Msg(format!("no int8 kernel for {other:?}")))),
        }
    }
    Ok(())
}

/// `x @ wᵀ` for a weight `w: [n, k]` held as ggml blocks on the CPU.
pub struct CpuMatMul(pub Arc<QTensor>);

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
        matmul(self.0.dtype(), &data, (m, k, n), lhs, &mut dst, Isa::selected()).map_err(candle_core::Error::wrap)?;
        let mut out = batch.to_vec();
        out.push(n);
        Ok((CpuStorage::F32(dst), Shape::from(out)))
    }
}

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
use with_block;

thread_local! {
    static BAND: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `dst[m, n] = lhs[m, k] @ dequant(w)[n, k]ᵀ`, a band of weight rows at a time.
fn dequant_gemm<T: GgmlType>(w: &[T], (m, k, n): (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
    let bpr = k / T::BLCK_SIZE;
    let band_rows = (BAND_ELEMS / k.max(1)).clamp(1, n.max(1));
    assert!(w.len() >= n * bpr && lhs.len() >= m * k && dst.len() >= m * n, "dequant_gemm sizes");
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
            // SAFETY: dst is m × n row-major (asserted); this writes columns r0..r0+rows of every
            // row. lhs is m × k row-major; the band is rows × k row-major, read as its transpose.
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
