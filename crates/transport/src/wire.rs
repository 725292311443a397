//! Activation values to and from wire bytes, little-endian, so that no stage hand-rolls byte
//! order: f32 rows as f32, f16 or bf16 (the `half` crate), token ids as u32.

use brigade_proto::v1::WireDtype;
use bytes::{BufMut, Bytes, BytesMut};
use half::{bf16, f16};

use crate::frame::FrameError;

/// Bytes per element of a wire dtype; `None` for UNSPECIFIED.
pub fn dtype_size(dtype: WireDtype) -> Option<usize> {
    match dtype {
        WireDtype::F32 | WireDtype::U32 => Some(4),
        WireDtype::F16 | WireDtype::Bf16 => Some(2),
        WireDtype::Unspecified => None,
    }
}

fn float_dtype(dtype: WireDtype) -> Result<usize, FrameError> {
    match dtype {
        WireDtype::F32 => Ok(4),
        WireDtype::F16 | WireDtype::Bf16 => Ok(2),
        WireDtype::U32 | WireDtype::Unspecified => {
            Err(FrameError::BadDtype { kind: "HIDDEN", dtype: dtype as i32, expected: "F32, F16 or BF16" })
        }
    }
}

/// f32 values as wire bytes of `dtype` (F32, F16 or BF16; rounding to nearest for the halves).
pub fn f32_to_wire(values: &[f32], dtype: WireDtype) -> Result<Bytes, FrameError> {
    let size = float_dtype(dtype)?;
    let mut out = BytesMut::with_capacity(values.len() * size);
    match dtype {
        WireDtype::F32 => values.iter().for_each(|v| out.put_f32_le(*v)),
        WireDtype::F16 => values.iter().for_each(|v| out.put_u16_le(f16::from_f32(*v).to_bits())),
        _ => values.iter().for_each(|v| out.put_u16_le(bf16::from_f32(*v).to_bits())),
    }
    Ok(out.freeze())
}

/// Wire bytes of `dtype` (F32, F16 or BF16) as f32 values.
pub fn f32_from_wire(bytes: &[u8], dtype: WireDtype) -> Result<Vec<f32>, FrameError> {
    let size = float_dtype(dtype)?;
    whole(bytes, size, dtype)?;
    let values = match dtype {
        WireDtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        WireDtype::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        _ => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
    };
    Ok(values)
}

/// Token ids as u32 little-endian bytes.
pub fn u32_to_wire(ids: &[u32]) -> Bytes {
    let mut out = BytesMut::with_capacity(ids.len() * 4);
    ids.iter().for_each(|id| out.put_u32_le(*id));
    out.freeze()
}

/// u32 little-endian bytes as token ids.
pub fn u32_from_wire(bytes: &[u8]) -> Result<Vec<u32>, FrameError> {
    whole(bytes, 4, WireDtype::U32)?;
    Ok(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

fn whole(bytes: &[u8], size: usize, dtype: WireDtype) -> Result<(), FrameError> {
    if bytes.len().is_multiple_of(size) {
        Ok(())
    } else {
        Err(FrameError::Ragged { len: bytes.len(), size, dtype: dtype.as_str_name() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_round_trip_within_each_dtype_precision() {
        let values = [0.0f32, 1.0, -2.5, 3.25, 65504.0, -1e-3];
        for (dtype, tolerance) in [(WireDtype::F32, 0.0), (WireDtype::F16, 1e-3), (WireDtype::Bf16, 1e-2)] {
            let bytes = f32_to_wire(&values, dtype);
            let back = bytes.and_then(|b| f32_from_wire(&b, dtype));
            let Ok(back) = back else {
                panic!("{dtype:?}: {back:?}");
            };
            assert_eq!(back.len(), values.len());
            for (a, b) in values.iter().zip(&back) {
                assert!((a - b).abs() <= tolerance * a.abs().max(1.0), "{dtype:?}: {a} -> {b}");
            }
        }
        // the layout is little-endian
        assert_eq!(f32_to_wire(&[1.0], WireDtype::F16).ok().as_deref(), Some(&[0x00, 0x3c][..]));
    }

    #[test]
    fn ids_round_trip_and_ragged_bytes_are_refused() {
        let ids = [0u32, 1, 128_000, u32::MAX];
        assert_eq!(u32_from_wire(&u32_to_wire(&ids)), Ok(ids.to_vec()));
        assert_eq!(&u32_to_wire(&[1])[..], &[1, 0, 0, 0]);
        assert_eq!(u32_from_wire(&[1, 2, 3]), Err(FrameError::Ragged { len: 3, size: 4, dtype: "WIRE_DTYPE_U32" }));
        assert!(f32_from_wire(&[0; 4], WireDtype::U32).is_err());
        assert!(f32_to_wire(&[1.0], WireDtype::Unspecified).is_err());
    }
}
