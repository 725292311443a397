//! ggml's element types as GGUF files name them: brigade's own list, so that reading a file needs
//! no tensor library. The model crate maps them to candle's `GgmlDType` one to one.

use serde::{Deserialize, Serialize};

/// A ggml element type: a float type (block of 1) or a quantized block layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
}

impl GgmlType {
    /// Every type brigade reads.
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
    ];

    /// The type id of the GGUF tensor table (ggml.h `enum ggml_type`); `None` for types brigade
    /// does not read.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Q8K => 15,
            GgmlType::BF16 => 30,
        }
    }

    /// The name llama.cpp prints for the type.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::BF16 => "bf16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q8_1 => "q8_1",
            GgmlType::Q2K => "q2_k",
            GgmlType::Q3K => "q3_k",
            GgmlType::Q4K => "q4_k",
            GgmlType::Q5K => "q5_k",
            GgmlType::Q6K => "q6_k",
            GgmlType::Q8K => "q8_k",
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 | GgmlType::Q8_1 => 32,
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::Q8K => 256,
        }
    }

    /// Bytes per block (ggml's `block_q*` structs: f16 scales, packed quants).
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
            GgmlType::Q8K => 292,
        }
    }

    /// Whether the type is a plain float type (one element per block).
    pub fn is_float(self) -> bool {
        self.block_size() == 1
    }

    /// Bytes of `n_elements` in rows of `row_len` elements; `None` when a row is not a whole
    /// number of blocks or the size overflows.
    pub fn bytes(self, row_len: u64, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !row_len.is_multiple_of(bs) || !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_distinct() {
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len());
        // ids ggml retired (Q4_2, Q4_3) or brigade does not read (IQ*, TQ*)
        for id in [4, 5, 16, 29, 31, 1000] {
            assert_eq!(GgmlType::from_id(id), None, "{id}");
        }
    }

    #[test]
    fn sizes_follow_ggml_blocks() {
        // a row of 256 elements in each type (ggml's type_traits: 256 / blck_size * type_size)
        let row = |t: GgmlType| t.bytes(256, 256);
        assert_eq!(row(GgmlType::F32), Some(1024));
        assert_eq!(row(GgmlType::BF16), Some(512));
        assert_eq!(row(GgmlType::Q4_0), Some(8 * 18));
        assert_eq!(row(GgmlType::Q8_0), Some(8 * 34));
        assert_eq!(row(GgmlType::Q4K), Some(144));
        assert_eq!(row(GgmlType::Q6K), Some(210));
        // partial blocks and overflow
        assert_eq!(GgmlType::Q4_0.bytes(33, 66), None);
        assert_eq!(GgmlType::F32.bytes(1, u64::MAX), None);
        assert!(GgmlType::F16.is_float() && !GgmlType::Q8_0.is_float());
    }
}
