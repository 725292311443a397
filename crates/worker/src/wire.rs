//! Tensors and token ids in and out of frame payloads, with every length checked against the
//! header and the model before anything is allocated.

use crate::WorkerError;
use brigade_core::cluster::ActDtype;
use brigade_proto::convert::act_dtype_to_proto;
use brigade_proto::v1::{FrameHeader, WireDtype};
use brigade_transport::wire as tw;
use candle_core::{Device, Tensor};

/// The ids of a TOKENS frame (the codec checked that the payload is `rows` u32s).
pub fn ids_from_frame(h: &FrameHeader, payload: &[u8]) -> Result<Vec<u32>, WorkerError> {
    if h.dtype != WireDtype::U32 as i32 || payload.len() != h.rows as usize * 4 || h.rows == 0 {
        return Err(WorkerError::Frame(format!(
            "TOKENS frame of {} rows with {} payload bytes and dtype {}",
            h.rows,
            payload.len(),
            h.dtype
        )));
    }
    tw::u32_from_wire(payload).map_err(|e| WorkerError::Frame(e.to_string()))
}

/// The hidden state of a HIDDEN frame as a `(1, rows, hidden)` f32 tensor on `device`.
pub fn hidden_from_frame(
    h: &FrameHeader,
    payload: &[u8],
    hidden: usize,
    device: &Device,
) -> Result<Tensor, WorkerError> {
    let rows = h.rows as usize;
    let dtype = WireDtype::try_from(h.dtype).unwrap_or(WireDtype::Unspecified);
    let size = match dtype {
        WireDtype::F32 => 4,
        WireDtype::F16 | WireDtype::Bf16 => 2,
        other => return Err(WorkerError::Frame(format!("HIDDEN frame of dtype {other:?}"))),
    };
    if rows == 0 || h.shape != [rows as u64, hidden as u64] || payload.len() != rows * hidden * size {
        return Err(WorkerError::Frame(format!(
            "HIDDEN frame of shape {:?} with {} payload bytes; this model's hidden size is {hidden}",
            h.shape,
            payload.len()
        )));
    }
    let v = tw::f32_from_wire(payload, dtype).map_err(|e| WorkerError::Frame(e.to_string()))?;
    Ok(brigade_model::rows::hidden_from_rows(v, rows, hidden, device)?)
}

/// A stage's output `(1, rows, hidden)` as payload bytes in `dtype`.
pub fn hidden_to_bytes(t: &Tensor, dtype: ActDtype) -> Result<bytes::Bytes, WorkerError> {
    let v = brigade_model::rows::hidden_to_rows(t)?;
    tw::f32_to_wire(&v, act_dtype_to_proto(dtype)).map_err(|e| WorkerError::Frame(e.to_string()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use brigade_core::LayerRange;
    use brigade_model::{Logits, ModelFiles, Slice, StageInput};

    /// Hidden states crossing a stage boundary as f16 or bf16 instead of f32, against the f32
    /// path, on a random-weight model (the worst case: trained models' hidden states are smoother).
    ///
    /// The tolerance: rounding a hidden state to f16 (11 significant bits) perturbs each element
    /// by at most 2^-11 ≈ 4.9e-4 of its size, bf16 (8 bits) by 2^-8 ≈ 3.9e-3. The next stage
    /// starts with an RMS norm (scale-free) and the layers after are smooth maps, so the logits
    /// move by about that relative amount times the amplification of the remaining layers; we
    /// allow 20× the rounding (1e-2 of the largest logit for f16, 8e-2 for bf16) and measured
    /// well under that (the test prints the figures).
    #[test]
    fn half_precision_activations_stay_close_to_f32() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let shape = brigade_model::synth::Shape {
            layers: 4,
            hidden: 256,
            ffn: 512,
            heads: 8,
            kv_heads: 4,
            vocab: 512,
            context: 128,
            rope_theta: 1e4,
        };
        brigade_model::synth::write_gguf(&path, &shape, brigade_model::synth::SynthType::F32, 7, |_, _| {}).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let cpu = Device::Cpu;
        let a = Slice::load(&files, LayerRange::new(0, 2).unwrap(), &cpu, candle_core::DType::F32, 64).unwrap();
        let b = Slice::load(&files, LayerRange::new(2, 4).unwrap(), &cpu, candle_core::DType::F32, 64).unwrap();
        let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 512).collect();
        let mut ca = a.new_cache().unwrap();
        let h = a.forward(&mut ca, StageInput::Tokens(&ids), Logits::All).unwrap();
        let logits = |dtype: ActDtype| -> Vec<f32> {
            let bytes = hidden_to_bytes(&h, dtype).unwrap();
            let frame =
                brigade_transport::Frame::hidden(0, 0, ids.len() as u32, 256, act_dtype_to_proto(dtype), bytes.clone())
                    .unwrap();
            let back = hidden_from_frame(&frame.header, &bytes, 256, &cpu).unwrap();
            let mut cb = b.new_cache().unwrap();
            b.forward(&mut cb, StageInput::Hidden(&back), Logits::All)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let exact = logits(ActDtype::F32);
        let scale = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
        // f32 on the wire is exact
        let direct: Vec<f32> = {
            let mut cb = b.new_cache().unwrap();
            b.forward(&mut cb, StageInput::Hidden(&h), Logits::All).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        assert_eq!(exact, direct);
        for (dtype, tol) in [(ActDtype::F16, 1e-2f32), (ActDtype::Bf16, 8e-2)] {
            let got = logits(dtype);
            let worst = exact.iter().zip(&got).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale;
            let argmax = |v: &[f32]| -> Vec<usize> {
                v.chunks(512)
                    .map(|r| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap_or(0))
                    .collect()
            };
            let same = argmax(&exact).iter().zip(argmax(&got)).filter(|(x, y)| **x == *y).count();
            eprintln!("{dtype:?}: largest logit error {worst:.2e} of the largest logit; argmax equal at {same} of {} positions", ids.len());
            assert!(worst < tol, "{dtype:?}: {worst} of the largest logit (allowed {tol})");
        }
    }
}
