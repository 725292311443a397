//! The devices this worker offers the cluster: by default every device the node has (the CPU and,
//! in a CUDA build, each CUDA device), or those `--devices` names; each with its measured figures
//! and the memory the operator lets it offer (`--memory` for the CPU, `--gpu-memory` per GPU).
//!
//! Which devices to offer is decided here from data ([`select`]: what was asked, what the node
//! has); measuring them is [`measure`]'s (the model crate's kernels and copies). A stage may only
//! be assigned a device that was offered ([`Offered::check`]).

use crate::WorkerError;
use brigade_core::cluster::DeviceFigures;
use brigade_core::DeviceId;
use brigade_model::devices::CudaInfo;
use brigade_model::measure::{measure_cpu, measure_cuda, Effort};
use std::path::Path;

/// The devices offered, in the order they were registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offered(Vec<DeviceId>);

impl Offered {
    pub fn new(ids: Vec<DeviceId>) -> Offered {
        Offered(ids)
    }

    pub fn ids(&self) -> &[DeviceId] {
        &self.0
    }

    /// The device an assignment names, if this worker offered it; otherwise why not.
    pub fn check(&self, name: &str) -> Result<DeviceId, WorkerError> {
        let id: DeviceId = name.parse().map_err(|_| {
            WorkerError::BadRequest(format!("device `{name}` is not a device name (cpu, cuda0, cuda1, …)"))
        })?;
        if !self.0.contains(&id) {
            let build = match id {
                DeviceId::Cuda(_) if !candle_core::utils::cuda_is_available() => {
                    "; this brigade was built without CUDA"
                }
                _ => "",
            };
            return Err(WorkerError::BadRequest(format!(
                "device {id} is not offered by this worker (it offers {}{build})",
                self.names()
            )));
        }
        Ok(id)
    }

    /// `cpu, cuda0`.
    pub fn names(&self) -> String {
        self.0.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    }
}

/// Parses `--devices`: `all`, or device names separated by commas (`cpu,cuda0`).
pub fn parse_devices(text: &str) -> Result<Option<Vec<DeviceId>>, WorkerError> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("all") {
        return Ok(None);
    }
    let mut out = Vec::new();
    for part in t.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(WorkerError::BadRequest(format!("--devices `{text}`: an empty device name")));
        }
        let id: DeviceId = part.parse().map_err(|_| {
            WorkerError::BadRequest(format!("--devices: `{part}` is not a device (cpu, cuda0, cuda1, … or all)"))
        })?;
        if out.contains(&id) {
            return Err(WorkerError::BadRequest(format!("--devices: {id} is named twice")));
        }
        out.push(id);
    }
    Ok(Some(out))
}

/// The devices to offer: every one the node has when `want` is `None` (the CPU first, then the
/// GPUs by ordinal), or exactly `want`, each checked against what the node has.
pub fn select(want: Option<&[DeviceId]>, gpus: &[CudaInfo], cuda_build: bool) -> Result<Offered, WorkerError> {
    let have: Vec<DeviceId> =
        std::iter::once(DeviceId::Cpu).chain(gpus.iter().map(|g| DeviceId::Cuda(g.ordinal))).collect();
    let Some(want) = want else { return Ok(Offered(have)) };
    if want.is_empty() {
        return Err(WorkerError::BadRequest("--devices names no device".into()));
    }
    for id in want {
        if have.contains(id) {
            continue;
        }
        let why = if !cuda_build {
            "this brigade was built without CUDA (rebuild with --features cuda; see scripts/build-cuda.sh)".to_string()
        } else if gpus.is_empty() {
            "this node has no CUDA device (or no NVIDIA driver)".to_string()
        } else {
            let names: Vec<String> = gpus.iter().map(|g| format!("cuda{}", g.ordinal)).collect();
            format!("this node has no such CUDA device (it has {})", names.join(", "))
        };
        return Err(WorkerError::BadRequest(format!("--devices: {id}: {why}")));
    }
    Ok(Offered(want.to_vec()))
}

/// What the operator lets the devices offer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Limits {
    /// Bytes of host memory for slices (0: what the OS says is available).
    pub memory: u64,
    /// Bytes per GPU for slices (0: what the GPU has free).
    pub gpu_memory: u64,
}

/// Measures (or reads the cached figures of) every offered device: the CPU's kernels and read
/// bandwidth with `threads` threads, each GPU's copy bandwidth, matmul rate and host link. Free
/// memory is what the device has now, capped by `limits`. A GPU that cannot be measured stops
/// the worker when the operator named it (`strict`); offered by default (`--devices all`), it is
/// left out with a warning and the other devices are offered. Returns what is offered.
pub fn measure(
    offered: &Offered,
    strict: bool,
    threads: usize,
    effort: Effort,
    limits: Limits,
    cache_dir: Option<&Path>,
) -> Result<(Offered, Vec<DeviceFigures>), WorkerError> {
    let mut ids = Vec::with_capacity(offered.0.len());
    let mut out = Vec::with_capacity(offered.0.len());
    for id in &offered.0 {
        let figures = match id {
            DeviceId::Cpu => measure_cpu(threads, effort, limits.memory, cache_dir)?,
            DeviceId::Cuda(i) => match measure_cuda(*i, effort, cache_dir) {
                Ok(f) => cap_gpu(f, limits.gpu_memory),
                Err(e) if !strict => {
                    tracing::warn!("{id} is not offered: measuring it failed: {e}");
                    continue;
                }
                Err(e) => return Err(e.into()),
            },
        };
        ids.push(*id);
        out.push(figures);
    }
    Ok((Offered(ids), out))
}

/// A GPU's figures with its offered memory capped at `cap` bytes (0: no cap).
pub fn cap_gpu(mut d: DeviceFigures, cap: u64) -> DeviceFigures {
    if cap > 0 {
        d.memory_free = d.memory_free.min(cap);
    }
    d
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn gpu(ordinal: u32) -> CudaInfo {
        CudaInfo { ordinal, name: "NVIDIA H200".into(), memory_total: 141 << 30, memory_free: 140 << 30 }
    }

    #[test]
    fn every_device_is_offered_unless_the_operator_names_some() {
        let two = [gpu(0), gpu(1)];
        let all = select(None, &two, true).unwrap();
        assert_eq!(all.ids(), &[DeviceId::Cpu, DeviceId::Cuda(0), DeviceId::Cuda(1)]);
        assert_eq!(all.names(), "cpu, cuda0, cuda1");
        // a CPU-only node (or build) offers its CPU
        assert_eq!(select(None, &[], false).unwrap().ids(), &[DeviceId::Cpu]);
        let want = parse_devices("cuda1, cpu").unwrap().unwrap();
        assert_eq!(select(Some(&want), &two, true).unwrap().ids(), &[DeviceId::Cuda(1), DeviceId::Cpu]);
        // a GPU gateway may keep its CPU for itself
        let gpu_only = parse_devices("cuda0").unwrap().unwrap();
        assert_eq!(select(Some(&gpu_only), &two, true).unwrap().ids(), &[DeviceId::Cuda(0)]);
        assert_eq!(parse_devices("all").unwrap(), None);
    }

    #[test]
    fn devices_the_node_lacks_are_refused_with_the_reason() {
        let cuda0 = [DeviceId::Cuda(0)];
        let e = select(Some(&cuda0), &[], false).unwrap_err().to_string();
        assert!(e.contains("cuda0") && e.contains("built without CUDA"), "{e}");
        let e = select(Some(&cuda0), &[], true).unwrap_err().to_string();
        assert!(e.contains("no CUDA device"), "{e}");
        let e = select(Some(&[DeviceId::Cuda(3)]), &[gpu(0), gpu(1)], true).unwrap_err().to_string();
        assert!(e.contains("cuda3") && e.contains("it has cuda0, cuda1"), "{e}");
        assert!(select(Some(&[]), &[], false).unwrap_err().to_string().contains("no device"));
        for (text, needle) in [("cpu,cpu", "named twice"), ("tpu0", "`tpu0` is not a device"), ("cpu,", "empty")] {
            let e = parse_devices(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn an_assignment_may_name_only_an_offered_device() {
        let offered = Offered::new(vec![DeviceId::Cpu]);
        assert_eq!(offered.check("cpu").unwrap(), DeviceId::Cpu);
        let e = offered.check("cuda0").unwrap_err().to_string();
        assert!(e.contains("cuda0 is not offered by this worker (it offers cpu"), "{e}");
        if !candle_core::utils::cuda_is_available() {
            assert!(e.contains("built without CUDA"), "{e}");
        }
        let e = offered.check("gpu7").unwrap_err().to_string();
        assert!(e.contains("`gpu7` is not a device name"), "{e}");
    }

    #[test]
    fn gpu_memory_caps_what_a_gpu_offers() {
        let d = DeviceFigures {
            name: "cuda0".into(),
            kind: brigade_core::DeviceKind::Cuda,
            model: "NVIDIA H200".into(),
            memory_total: 141 << 30,
            memory_free: 140 << 30,
            mem_bandwidth: 4e12,
            flops: 7e14,
            kernels: Vec::new(),
            threads: 0,
            features: String::new(),
            host_link: None,
        };
        assert_eq!(cap_gpu(d.clone(), 24 << 30).memory_free, 24 << 30);
        assert_eq!(cap_gpu(d.clone(), 0).memory_free, 140 << 30);
        assert_eq!(cap_gpu(d, 200 << 30).memory_free, 140 << 30);
    }
}
