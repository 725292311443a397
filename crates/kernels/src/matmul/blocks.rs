//! ggml's block layouts as the kernels read them, and the one place where a weight's bytes become
//! typed blocks.
//!
//! candle's block types keep their fields private, hence the mirrors here (ggml's C layouts,
//! checked by size at compile time). `bytemuck` would do the cast, but its `Pod` cannot be
//! implemented for candle's types (they are foreign), so the marker trait is our own and sealed.

use super::KernelError;
use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0,
    BlockQ8_1,
};
use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
}

/// A type any `size_of::<Self>()` bytes of which are a valid value: ggml's blocks (`repr(C)`,
/// no padding, integer and f16/f32 fields only) and the float element types. Sealed: it is
/// implemented in this module only, each with a compile-time size check.
///
/// ```compile_fail
/// // `bool` has invalid bit patterns: it is not a Block, so this does not compile
/// brigade_kernels::matmul::blocks::cast::<bool>(&[2u8]);
/// ```
///
/// # Safety
/// Implementors have no padding and no invalid bit patterns.
pub unsafe trait Block: sealed::Sealed + Sized + 'static {
    /// Bytes per block in a ggml file.
    const BYTES: usize;
}

macro_rules! blocks {
    ($($t:ty = $bytes:expr),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        // SAFETY: repr(C) (or primitive) types of integer / f16 / f32 fields whose size is the sum
        // of their fields' (asserted below): no padding, every bit pattern valid.
        unsafe impl Block for $t {
            const BYTES: usize = $bytes;
        }
        const _: () = assert!(std::mem::size_of::<$t>() == $bytes);
    )*};
}

blocks! {
    f32 = 4, f16 = 2, bf16 = 2,
    BlockQ4_0 = 18, BlockQ4_1 = 20, BlockQ5_0 = 22, BlockQ5_1 = 24, BlockQ8_0 = 34, BlockQ8_1 = 36,
    BlockQ2K = 84, BlockQ3K = 110, BlockQ4K = 144, BlockQ5K = 176, BlockQ6K = 210, BlockQ8K = 292,
    Q4_0 = 18, Q4_1 = 20, Q5_0 = 22, Q5_1 = 24, Q8_0 = 34, Q4K = 144, Q5K = 176, Q6K = 210,
}

/// The bytes as a slice of whole, aligned blocks (candle keeps CPU weights as a `Vec` of blocks,
/// so its bytes always are).
pub fn cast<T: Block>(bytes: &[u8]) -> Result<&[T], KernelError> {
    let size = std::mem::size_of::<T>();
    let align = std::mem::align_of::<T>();
    if !bytes.len().is_multiple_of(size) || !(bytes.as_ptr() as usize).is_multiple_of(align) {
        return Err(KernelError::Storage { bytes: bytes.len(), block: size, align });
    }
    // SAFETY: length and alignment checked; `T: Block` has no invalid bit patterns.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}

/// The blocks' bytes (a `Block` has no padding, so every byte is initialised).
pub fn as_bytes<T: Block>(blocks: &[T]) -> &[u8] {
    // SAFETY: `T: Block` has no padding; the length is the slice's size in bytes
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks)) }
}

/// The blocks' bytes, writable (any bytes are a valid `Block`).
pub fn as_bytes_mut<T: Block>(blocks: &mut [T]) -> &mut [u8] {
    // SAFETY: as `as_bytes`, and `T: Block` has no invalid bit patterns, so any write leaves valid values
    unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(blocks)) }
}

/// ggml's `block_q4_0`: 32 weights `d × (q − 8)`, `q` in 0..16 as nibbles (low halves first).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

/// ggml's `block_q4_1`: 32 weights `d × q + m`, `q` in 0..16 as nibbles (low halves first).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}

/// ggml's `block_q5_0`: 32 weights `d × (q − 16)`, `q` in 0..32: nibbles as Q4_0, bit `i` of
/// the little-endian `qh` is weight `i`'s fifth bit.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// ggml's `block_q5_1`: 32 weights `d × q + m`, `q` in 0..32 packed as Q5_0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// ggml's `block_q8_0`: 32 weights `d × q`, `q` any i8 (−128 included).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}

/// ggml's `block_q4_K`: 256 weights in 8 sub-blocks of 32, weight = `d·sc·q − dmin·m` with
/// 6-bit `sc`, `m` per sub-block packed in `scales` and 4-bit `q`: bytes `32h..32h+32` of `qs`
/// hold sub-block `2h` in their low nibbles and `2h + 1` in their high ones.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

/// ggml's `block_q5_K`: Q4_K plus a fifth bit per weight: bit `j` of `qh[l]` belongs to
/// weight `32j + l`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

/// ggml's `block_q6_K`: 256 weights `d·sc·(q − 32)`, `q` in 0..64 (low 4 bits in `ql`, high 2 in
/// `qh`), an i8 scale per 16 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: f16,
}

/// The 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as integers: `w = d × (q − offset) + m`.
pub trait Q0Block: Block + Copy + Sync {
    /// Subtracted from every `q` (8 for Q4_0, 16 for Q5_0, 0 otherwise).
    const OFFSET: i32;
    /// Whether the block has a min `m` (Q4_1, Q5_1).
    const HAS_MIN: bool;
    /// Whether `q` is signed (Q8_0) rather than in `0..2^bits`.
    const SIGNED: bool;
    fn d(&self) -> f16;
    fn m(&self) -> f16 {
        f16::ZERO
    }
}

macro_rules! q0_block {
    ($t:ty, offset $offset:expr, signed $signed:expr) => {
        impl Q0Block for $t {
            const OFFSET: i32 = $offset;
            const HAS_MIN: bool = false;
            const SIGNED: bool = $signed;
            fn d(&self) -> f16 {
                self.d
            }
        }
    };
    ($t:ty, with min) => {
        impl Q0Block for $t {
            const OFFSET: i32 = 0;
            const HAS_MIN: bool = true;
            const SIGNED: bool = false;
            fn d(&self) -> f16 {
                self.d
            }
            fn m(&self) -> f16 {
                self.m
            }
        }
    };
}

q0_block!(Q4_0, offset 8, signed false);
q0_block!(Q5_0, offset 16, signed false);
q0_block!(Q8_0, offset 0, signed true);
q0_block!(Q4_1, with min);
q0_block!(Q5_1, with min);

/// The 256-weight super-blocks (Q4_K, Q5_K, Q6_K): `w = d·sc·q − dmin·m` per sub-block, with
/// `q` unsigned (Q6_K's −32 is an offset of `32·sc`, handled as Q4_K's mins are but scaled by `d`).
pub trait KBlock: Block + Copy + Sync {
    /// Whether the block has mins scaled by `dmin` (Q4_K, Q5_K) rather than an offset (Q6_K).
    const HAS_MIN: bool;
}

impl KBlock for Q4K {
    const HAS_MIN: bool = true;
}
impl KBlock for Q5K {
    const HAS_MIN: bool = true;
}
impl KBlock for Q6K {
    const HAS_MIN: bool = false;
}
