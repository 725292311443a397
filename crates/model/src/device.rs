//! Devices as the runtime uses them: brigade's [`DeviceId`] to a candle device, the activation
//! type brigade computes in on each, and the handles a caller keeps while it measures memory or
//! times work ([`Accelerators`]). The lowest module of the runtime: `llama` and `pipeline` both
//! read it, it reads neither.

use crate::weights::ModelFiles;
use crate::ModelError;
use brigade_core::DeviceId;
use candle_core::{DType, Device};

/// The candle device for a brigade device id.
pub fn candle_device(id: DeviceId) -> Result<Device, ModelError> {
    match id {
        DeviceId::Cpu => Ok(Device::Cpu),
        DeviceId::Cuda(i) => {
            if !candle_core::utils::cuda_is_available() {
                return Err(ModelError::NoDevice(format!(
                    "{id}: this brigade was built without CUDA (rebuild with --features cuda; see scripts/build-cuda.sh)"
                )));
            }
            Device::new_cuda(i as usize).map_err(|e| ModelError::NoDevice(format!("{id}: {e}")))
        }
    }
}

/// The activation dtype brigade uses on a device for a model: f32 on the CPU (exact against the
/// references). On a GPU, the model's own float type, so dense weights stay as compact as the
/// file has them (f16 files compute in f16, bf16 in bf16, f32 in f32); quantized files compute in
/// bf16 (candle's quantized CUDA kernels take it, and the KV cache is half the size of f32).
pub fn activation_dtype(id: DeviceId, files: &ModelFiles) -> DType {
    match id {
        DeviceId::Cpu => DType::F32,
        DeviceId::Cuda(_) => files.dense_dtype().unwrap_or(DType::BF16),
    }
}

/// Bytes of one KV cache element on a device for a model (the activation dtype's: 4 on the CPU).
pub fn kv_elem_bytes(id: DeviceId, files: &ModelFiles) -> u64 {
    activation_dtype(id, files).size_in_bytes() as u64
}

/// Whether an error is a device running out of memory (CUDA reports it in its message).
pub fn is_out_of_memory(e: &ModelError) -> bool {
    let s = e.to_string();
    s.contains("OUT_OF_MEMORY") || s.contains("out of memory")
}

/// The CUDA devices a caller holds open while it works: created before a load, so that free
/// memory measured around the load sees only what the load allocates (a device's context takes
/// a few hundred MiB of its own), and synchronised before a timer is read.
pub struct Accelerators {
    devices: Vec<Device>,
}

impl Accelerators {
    /// Opens each CUDA device of `ordinals`.
    pub fn open(ordinals: &[u32]) -> Result<Self, ModelError> {
        let devices = ordinals.iter().map(|&i| candle_device(DeviceId::Cuda(i))).collect::<Result<_, _>>()?;
        Ok(Accelerators { devices })
    }

    /// Waits until every queued operation on every device has finished.
    pub fn synchronize(&self) {
        for d in &self.devices {
            if let Err(e) = d.synchronize() {
                tracing::warn!("synchronizing {d:?}: {e}");
            }
        }
    }

    /// The first device's memory bandwidth (timed device-to-device copies); `None` without one.
    pub fn copy_bandwidth(&self) -> Option<f64> {
        self.devices.first().and_then(crate::bandwidth::device_bandwidth)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn cpu_computes_in_f32_and_cuda_is_refused_without_it() {
        let files = ModelFiles::from_static_gguf(crate::embedded_model(), crate::EMBEDDED_MODEL_NAME).unwrap();
        assert_eq!(activation_dtype(DeviceId::Cpu, &files), DType::F32);
        assert_eq!(kv_elem_bytes(DeviceId::Cpu, &files), 4);
        // the embedded model is f32: a GPU would compute it in f32 too
        assert_eq!(activation_dtype(DeviceId::Cuda(0), &files), DType::F32);
        assert!(matches!(candle_device(DeviceId::Cpu), Ok(Device::Cpu)));
        if !cfg!(feature = "cuda") {
            let e = candle_device(DeviceId::Cuda(0)).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("cuda0") && e.contains("without CUDA"), "{e}");
            assert!(Accelerators::open(&[0]).err().is_some_and(|e| e.to_string().contains("without CUDA")));
        }
        let none = Accelerators::open(&[]).unwrap();
        none.synchronize();
        assert!(none.copy_bandwidth().is_none());
        assert!(is_out_of_memory(&ModelError::NoDevice("cuda0: CUDA_ERROR_OUT_OF_MEMORY".into())));
        assert!(!is_out_of_memory(&ModelError::BadInput("no tokens".into())));
    }
}
