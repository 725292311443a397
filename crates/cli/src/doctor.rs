//! `brigade doctor [--json]`: this machine as brigade sees it — the build, the CPU and its
//! instruction sets, the kernel each weight type goes through, memory, the measured read
//! bandwidth, GPUs with their free memory, and the CUDA libraries found or missing and why: what
//! a bug report needs.
//!
//! CUDA libraries are looked for by name in the directories the dynamic loader would search
//! (`LD_LIBRARY_PATH`, the `ldconfig` cache, the usual CUDA folders) rather than loaded: loading
//! a driver library runs its initialisers, and a report should change nothing.

use anyhow::Result;
use brigade_model::{bandwidth, cpu_matmul, devices, measure, threads};
use clap::Args;
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Threads of the bandwidth probe; 0 or less: every logical CPU (default: the physical cores).
    #[arg(short = 't', long = "threads", allow_negative_numbers = true)]
    pub threads: Option<i64>,
}

#[derive(Serialize)]
struct Build {
    version: &'static str,
    /// Cargo features compiled in (`cuda`).
    features: Vec<&'static str>,
    target: String,
    debug_assertions: bool,
}

#[derive(Serialize)]
struct Cpu {
    model: String,
    logical_cpus: usize,
    /// What `-t` defaults to (candle's count of physical cores, or RAYON_NUM_THREADS).
    default_threads: usize,
    instruction_sets: Vec<&'static str>,
    last_level_cache_bytes: Option<usize>,
}

#[derive(Serialize)]
struct Kernels {
    /// `BRIGADE_CPU_KERNELS` as set (empty: the best this CPU has).
    asked: String,
    /// What the element-wise loops (SiLU·up, softmaxes, a decode step's attention) are
    /// compiled for: avx512, avx2 or scalar.
    vector_loops: &'static str,
    weights: Vec<KernelChoice>,
}

#[derive(Serialize)]
struct KernelChoice {
    weight_type: &'static str,
    decode: &'static str,
    prompt: &'static str,
}

#[derive(Serialize)]
struct Memory {
    total_bytes: u64,
    available_bytes: u64,
}

#[derive(Serialize)]
struct Bandwidth {
    read_bytes_per_s: f64,
    threads: usize,
    /// The loads the probe reads with (avx512, avx2, portable).
    reader: &'static str,
    buffer_bytes: usize,
}

#[derive(Serialize)]
struct Gpu {
    ordinal: u32,
    name: String,
    memory_total_bytes: u64,
    memory_free_bytes: u64,
}

#[derive(Serialize, Debug)]
struct Library {
    name: &'static str,
    /// What brigade's CUDA build needs it for.
    role: &'static str,
    path: Option<PathBuf>,
    /// Why it is missing, or where it was found.
    why: String,
}

#[derive(Serialize)]
struct Report {
    brigade: Build,
    cpu: Cpu,
    kernels: Kernels,
    memory: Memory,
    bandwidth: Bandwidth,
    gpus: Vec<Gpu>,
    /// NVIDIA GPUs the kernel driver lists (/proc/driver/nvidia), whether or not this build uses them.
    nvidia_driver_gpus: Vec<String>,
    /// The folders CUDA libraries were looked for in, in order.
    library_search_path: Vec<PathBuf>,
    cuda_libraries: Vec<Library>,
    notes: Vec<String>,
}

/// The libraries candle's CUDA backend links (cudarc with dynamic linking), by name and role.
const CUDA_LIBRARIES: [(&str, &str); 5] = [
    ("libcuda.so.1", "the NVIDIA driver, behind every CUDA call"),
    ("libcublas.so", "cuBLAS: dense matrix products"),
    ("libcublasLt.so", "cuBLASLt: cuBLAS's matmul engine"),
    ("libcurand.so", "cuRAND: linked by candle"),
    ("libnvrtc.so", "NVRTC: linked by candle"),
];

pub fn doctor(a: DoctorArgs) -> Result<()> {
    let r = report();
    if a.json {
        crate::common::print_stdout(&format!("{}\n", serde_json::to_string_pretty(&r)?))
    } else {
        crate::common::print_stdout(&text(&r))
    }
}

fn report() -> Report {
    let cpu = devices::cpu_info();
    let n = threads::current();
    let buffer = bandwidth::probe_bytes();
    let read = bandwidth::read_bandwidth(buffer, n, 3);
    let gpus: Vec<Gpu> = devices::cuda_devices()
        .into_iter()
        .map(|g| Gpu {
            ordinal: g.ordinal,
            name: g.name,
            memory_total_bytes: g.memory_total,
            memory_free_bytes: g.memory_free,
        })
        .collect();
    let cuda_build = cfg!(feature = "cuda");
    let dirs = search_dirs();
    let mut notes = Vec::new();
    if !cuda_build {
        notes.push(
            "this build has no CUDA: GPUs are not used (build with --features cuda, see scripts/build-cuda.sh)".into(),
        );
    } else if gpus.is_empty() {
        notes.push("a CUDA build, but no CUDA device answered (driver missing or no GPU)".into());
    }
    Report {
        brigade: Build {
            version: env!("CARGO_PKG_VERSION"),
            features: if cuda_build { vec!["cuda"] } else { Vec::new() },
            target: format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS),
            debug_assertions: cfg!(debug_assertions),
        },
        cpu: Cpu {
            model: cpu.name,
            logical_cpus: threads::logical_cpus(),
            default_threads: threads::resolve(None).unwrap_or(n),
            instruction_sets: measure::instruction_sets(),
            last_level_cache_bytes: bandwidth::last_level_cache(),
        },
        kernels: Kernels {
            asked: std::env::var("BRIGADE_CPU_KERNELS").unwrap_or_default(),
            vector_loops: brigade_model::llama::vector_loops(),
            weights: measure::weight_types()
                .iter()
                .map(|&t| {
                    let (decode, prompt) = cpu_matmul::kernels(t);
                    KernelChoice { weight_type: measure::type_name(t), decode, prompt }
                })
                .collect(),
        },
        memory: Memory { total_bytes: cpu.memory_total, available_bytes: cpu.memory_available },
        bandwidth: Bandwidth { read_bytes_per_s: read, threads: n, reader: bandwidth::reader(), buffer_bytes: buffer },
        gpus,
        nvidia_driver_gpus: nvidia_driver_gpus(Path::new("/proc/driver/nvidia/gpus")),
        library_search_path: dirs.iter().map(|(d, _)| d.clone()).collect(),
        cuda_libraries: cuda_libraries(&dirs, cuda_build),
        notes,
    }
}

/// The GPUs the NVIDIA kernel driver lists: one folder per PCI address, with the model name in
/// its `information` file.
fn nvidia_driver_gpus(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| {
            let info = std::fs::read_to_string(e.path().join("information")).unwrap_or_default();
            let model = info
                .lines()
                .find_map(|l| l.strip_prefix("Model:"))
                .map(|m| m.trim().to_string())
                .unwrap_or_else(|| "unknown model".into());
            format!("{} {model}", e.file_name().to_string_lossy())
        })
        .collect();
    out.sort();
    out
}

/// Where the dynamic loader would look, in its order, each with where the folder came from.
fn search_dirs() -> Vec<(PathBuf, &'static str)> {
    let mut dirs: Vec<(PathBuf, &'static str)> = Vec::new();
    if let Some(p) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&p).filter(|d| !d.as_os_str().is_empty()).map(|d| (d, "LD_LIBRARY_PATH")));
    }
    for exe in ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"] {
        if let Ok(out) = std::process::Command::new(exe).arg("-p").output() {
            let text = String::from_utf8_lossy(&out.stdout);
            for path in text.lines().filter_map(|l| l.split_once("=> ").map(|(_, p)| PathBuf::from(p.trim()))) {
                if let Some(parent) = path.parent() {
                    if !dirs.iter().any(|(d, _)| d == parent) {
                        dirs.push((parent.to_path_buf(), "the ldconfig cache"));
                    }
                }
            }
            break;
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
    ] {
        let d = PathBuf::from(d);
        if !dirs.iter().any(|(x, _)| *x == d) {
            dirs.push((d, "the usual CUDA folders"));
        }
    }
    dirs
}

/// Each CUDA library: the first file in `dirs` named it or a versioned form of it
/// (`libcublas.so.13`), or why none was found.
fn cuda_libraries(dirs: &[(PathBuf, &'static str)], cuda_build: bool) -> Vec<Library> {
    CUDA_LIBRARIES
        .iter()
        .map(|&(name, role)| {
            let found = dirs.iter().find_map(|(d, from)| {
                let entries = std::fs::read_dir(d).ok()?;
                let mut hits: Vec<PathBuf> = entries
                    .filter_map(|e| e.ok())
                    .filter(|e| {
                        let f = e.file_name();
                        let f = f.to_string_lossy();
                        f == name || f.strip_prefix(name).is_some_and(|rest| rest.starts_with('.'))
                    })
                    .map(|e| e.path())
                    .collect();
                hits.sort();
                hits.into_iter().next().map(|p| (p, *from))
            });
            match found {
                Some((path, from)) => Library { name, role, why: format!("found through {from}"), path: Some(path) },
                None => {
                    let consequence = if !cuda_build {
                        "not needed by this build (no CUDA)"
                    } else if name == "libcuda.so.1" {
                        "no NVIDIA driver is installed: CUDA cannot start"
                    } else {
                        "this CUDA build does not start without it: add its folder to LD_LIBRARY_PATH"
                    };
                    Library {
                        name,
                        role,
                        path: None,
                        why: format!("not in any of the {} folders searched; {consequence}", dirs.len()),
                    }
                }
            }
        })
        .collect()
}

fn text(r: &Report) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut s = String::new();
    let b = &r.brigade;
    s.push_str(&format!(
        "brigade {} ({}; features: {}{})\n",
        b.version,
        b.target,
        if b.features.is_empty() { "none".to_string() } else { b.features.join(", ") },
        if b.debug_assertions { "; debug build" } else { "" }
    ));
    let c = &r.cpu;
    s.push_str(&format!(
        "cpu: {} — {} logical CPUs, -t defaults to {}, last-level cache {}\n",
        c.model,
        c.logical_cpus,
        c.default_threads,
        c.last_level_cache_bytes.map(|b| format!("{} MiB", b >> 20)).unwrap_or_else(|| "unknown".into())
    ));
    s.push_str(&format!("instruction sets: {}\n", c.instruction_sets.join(" ")));
    let asked =
        if r.kernels.asked.is_empty() { String::new() } else { format!(" (BRIGADE_CPU_KERNELS={})", r.kernels.asked) };
    s.push_str(&format!("kernels (decode / prompt){asked}:\n"));
    for k in &r.kernels.weights {
        s.push_str(&format!("  {:5} {} / {}\n", k.weight_type, k.decode, k.prompt));
    }
    s.push_str(&format!("  vector loops (SiLU·up, softmaxes, decode attention): {}\n", r.kernels.vector_loops));
    s.push_str(&format!(
        "memory: {:.1} GiB, {:.1} GiB available\n",
        gib(r.memory.total_bytes),
        gib(r.memory.available_bytes)
    ));
    let bw = &r.bandwidth;
    s.push_str(&format!(
        "read bandwidth: {:.1} GB/s ({} threads, {} loads, {} MiB buffer)\n",
        bw.read_bytes_per_s / 1e9,
        bw.threads,
        bw.reader,
        bw.buffer_bytes >> 20
    ));
    if r.gpus.is_empty() {
        s.push_str("gpus: none in use\n");
    }
    for g in &r.gpus {
        s.push_str(&format!(
            "gpu cuda{}: {}, {:.1} GiB free of {:.1} GiB\n",
            g.ordinal,
            g.name,
            gib(g.memory_free_bytes),
            gib(g.memory_total_bytes)
        ));
    }
    for g in &r.nvidia_driver_gpus {
        s.push_str(&format!("nvidia driver lists: {g}\n"));
    }
    let path: Vec<String> = r.library_search_path.iter().map(|d| d.display().to_string()).collect();
    s.push_str(&format!("cuda libraries (searched {}):\n", path.join(":")));
    for l in &r.cuda_libraries {
        match &l.path {
            Some(p) => s.push_str(&format!("  {:16} {} ({})\n", l.name, p.display(), l.why)),
            None => s.push_str(&format!("  {:16} missing: {}\n", l.name, l.why)),
        }
    }
    for n in &r.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn libraries_are_found_by_name_or_version_and_missing_ones_say_why() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        std::fs::write(b.path().join("libcublas.so.13"), b"").unwrap();
        std::fs::write(b.path().join("libcublasLt.so.13.1.0"), b"").unwrap();
        std::fs::write(a.path().join("libcurand.so"), b"").unwrap();
        // a longer name that only starts like one is not it
        std::fs::write(a.path().join("libcuda.so.1x"), b"").unwrap();
        let dirs = vec![(a.path().to_path_buf(), "LD_LIBRARY_PATH"), (b.path().to_path_buf(), "the ldconfig cache")];
        let libs = cuda_libraries(&dirs, true);
        let get = |n: &str| libs.iter().find(|l| l.name == n).unwrap();
        assert_eq!(get("libcublas.so").path.as_deref(), Some(b.path().join("libcublas.so.13").as_path()));
        assert!(get("libcublas.so").why.contains("ldconfig"));
        assert!(get("libcublasLt.so").path.is_some(), "cublasLt is not cublas: {:?}", get("libcublasLt.so"));
        assert_eq!(get("libcurand.so").why, "found through LD_LIBRARY_PATH");
        let cuda = get("libcuda.so.1");
        assert!(
            cuda.path.is_none()
                && cuda.why.contains("no NVIDIA driver")
                && cuda.why.contains("not in any of the 2 folders searched"),
            "{cuda:?}"
        );
        assert!(get("libnvrtc.so").why.contains("LD_LIBRARY_PATH"));
        let cpu_only = cuda_libraries(&dirs, false);
        assert!(cpu_only.iter().find(|l| l.name == "libnvrtc.so").unwrap().why.contains("not needed by this build"));
    }

    #[test]
    fn nvidia_gpus_from_the_driver_folder() {
        let d = tempfile::tempdir().unwrap();
        assert!(nvidia_driver_gpus(&d.path().join("none")).is_empty());
        let g = d.path().join("0000:01:00.0");
        std::fs::create_dir(&g).unwrap();
        std::fs::write(g.join("information"), "Model: \t NVIDIA H200\nIRQ: 1\n").unwrap();
        assert_eq!(nvidia_driver_gpus(d.path()), ["0000:01:00.0 NVIDIA H200"]);
    }
}
