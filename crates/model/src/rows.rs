//! A slice's tensors as plain rows of numbers and back: the hidden state that crosses a stage
//! boundary, `(1, rows, hidden)`, and the one row of logits a last stage samples from. Every
//! caller that moves them off the tensor library (the worker's frames, its samplers) converts
//! here, so the shapes are checked in one place.

use crate::ModelError;
use candle_core::{DType, Device, Tensor};

/// A hidden state `(1, rows, hidden)` of any float type, on any device, as `rows × hidden` f32
/// values, row after row.
pub fn hidden_to_rows(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    if t.rank() != 3 || t.dim(0)? != 1 {
        return Err(ModelError::BadInput(format!("a hidden state is (1, rows, hidden), not {:?}", t.dims())));
    }
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// `rows × hidden` f32 values, row after row, as a hidden state `(1, rows, hidden)` on `device`.
pub fn hidden_from_rows(values: Vec<f32>, rows: usize, hidden: usize, device: &Device) -> Result<Tensor, ModelError> {
    if rows == 0 || hidden == 0 || values.len() != rows * hidden {
        return Err(ModelError::BadInput(format!(
            "{} values are not {rows} rows of a hidden size of {hidden}",
            values.len()
        )));
    }
    Ok(Tensor::from_vec(values, (1, rows, hidden), device)?)
}

/// The logits of one position, `(1, 1, vocab)` as a slice's last stage returns them for a
/// single row, as `vocab` f32 values.
pub fn logits_row(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    if t.rank() != 3 || t.dim(0)? != 1 || t.dim(1)? != 1 {
        return Err(ModelError::BadInput(format!("one row of logits is (1, 1, vocab), not {:?}", t.dims())));
    }
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rows_go_out_and_back_unchanged_and_wrong_shapes_are_refused() {
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
        let t = hidden_from_rows(values.clone(), 3, 4, &Device::Cpu).unwrap();
        assert_eq!(t.dims(), [1, 3, 4]);
        assert_eq!(hidden_to_rows(&t).unwrap(), values);
        // another float type comes out as f32 (these values are exact in bf16)
        assert_eq!(hidden_to_rows(&t.to_dtype(DType::BF16).unwrap()).unwrap(), values);
        for (rows, hidden) in [(4, 4), (0, 4), (3, 0), (2, 6)] {
            let e = hidden_from_rows(values.clone(), rows, hidden, &Device::Cpu);
            if rows * hidden == 12 && rows > 0 && hidden > 0 {
                assert!(e.is_ok());
            } else {
                assert!(e.unwrap_err().to_string().contains("12 values are not"), "{rows}×{hidden}");
            }
        }
        let flat = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(hidden_to_rows(&flat).unwrap_err().to_string().contains("(1, rows, hidden)"));
        let one = Tensor::ones((1, 1, 5), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(logits_row(&one).unwrap(), vec![1.0; 5]);
        let two = Tensor::ones((1, 2, 5), DType::F32, &Device::Cpu).unwrap();
        assert!(logits_row(&two).unwrap_err().to_string().contains("(1, 1, vocab)"));
    }
}
