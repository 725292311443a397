//! brigade's CPU kernels, and every `unsafe` line of the runtime: other crates forbid
//! `unsafe_code` (the binary keeps its start-up's, the format crate its one memory map).
//!
//! # Layout
//! - [`matmul`]: the matrix multiply by a ggml weight in place, as a candle op: int8 kernels per
//!   instruction set (AVX-512 VNNI, AVX-VNNI, AVX2; AMX for prompts), weights packed at load for
//!   them where it pays, candle's vec-dots and `gemm` for the rest. Its one safe entry checks the
//!   CPU's instructions and every length before a kernel runs.
//! - [`vector`]: the element-wise f32 loops of a forward pass (SiLU·up, GeLU·up, a causal
//!   softmax row, a decode step's attention of one kv head) on a vectorized `exp`, compiled per
//!   vector width behind a token ([`vector::Width`]) that proves the CPU has it.
//! - [`threads`]: the compute threads (llama.cpp's `-t`, set once per process: candle sizes its
//!   pools once) and the pool the kernels run on.
//! - [`bandwidth`]: the memory read bandwidth probe.
//!
//! Hand-written because no crate computes on ggml blocks in place (see [`matmul`]). The crate
//! knows nothing of models: the model runtime (`brigade-model`) calls it.

pub mod bandwidth;
pub mod matmul;
pub mod threads;
pub mod vector;
