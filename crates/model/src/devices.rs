//! What this host has to compute with: the CPU (cores, memory) and, in a CUDA build, each CUDA
//! device's name, total and free memory (through cudarc, the driver API candle uses).

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct CpuInfo {
    pub name: String,
    /// Logical CPUs this process may use.
    pub threads: usize,
    pub memory_total: u64,
    pub memory_available: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CudaInfo {
    pub ordinal: u32,
    pub name: String,
    pub memory_total: u64,
    pub memory_free: u64,
}

fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The host CPU and its memory (from /proc on Linux; zeros where unknown).
pub fn cpu_info() -> CpuInfo {
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let name = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    CpuInfo {
        name,
        threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        memory_total: meminfo_field(&mem, "MemTotal:").unwrap_or(0),
        memory_available: meminfo_field(&mem, "MemAvailable:").unwrap_or(0),
    }
}

/// The CUDA devices of this host; empty in a build without CUDA or without a driver.
pub fn cuda_devices() -> Vec<CudaInfo> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        let n = match CudaContext::device_count() {
            Ok(n) => n.max(0) as usize,
            Err(e) => {
                tracing::debug!("no CUDA driver: {e}");
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for i in 0..n {
            let Ok(ctx) = CudaContext::new(i) else {
                continue;
            };
            let name = ctx.name().unwrap_or_else(|_| format!("cuda{i}"));
            let (free, total) = ctx.mem_get_info().unwrap_or((0, 0));
            out.push(CudaInfo { ordinal: i as u32, name, memory_total: total as u64, memory_free: free as u64 });
        }
        out
    }
    #[cfg(not(feature = "cuda"))]
    {
        Vec::new()
    }
}

/// Free memory of one CUDA device right now (for measuring what a load allocated).
pub fn cuda_free_memory(ordinal: u32) -> Option<u64> {
    cuda_devices().into_iter().find(|d| d.ordinal == ordinal).map(|d| d.memory_free)
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpu_is_described() {
        let c = super::cpu_info();
        assert!(c.threads >= 1);
        if cfg!(target_os = "linux") {
            assert!(c.memory_total > 0 && c.memory_available <= c.memory_total);
        }
    }
}
