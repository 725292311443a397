//! The compute threads: how many threads candle's pools and brigade's kernels use.
//!
//! candle sizes its pools once, from `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS`, when they are
//! first used (its barrier pool is a process-wide `OnceLock` that cannot be resized), and without
//! `RAYON_NUM_THREADS` it asks for the physical core count on every parallel op, which reads
//! /proc/cpuinfo each time. So a process picks its thread count once, at its start
//! ([`set_for_process`]), and a sweep over thread counts runs each count in its own process
//! ([`child_env`]).

/// The most threads `-t` may ask for.
pub const MAX_THREADS: usize = 1024;

/// A thread count past [`MAX_THREADS`].
#[derive(Debug, thiserror::Error)]
#[error("-t {0}: at most {MAX_THREADS} threads")]
pub struct TooManyThreads(pub i64);

/// The environment variables candle reads its thread counts from.
const VARS: [&str; 2] = ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"];

/// Logical CPUs this process may run on.
pub fn logical_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// The thread count for a request, with llama.cpp's meaning of `-t`: `None` is the default
/// (`RAYON_NUM_THREADS` when set, else the physical cores, as candle counts them); zero or less
/// is every logical CPU (llama.cpp's `std::thread::hardware_concurrency()`); else that many.
pub fn resolve(requested: Option<i64>) -> Result<usize, TooManyThreads> {
    match requested {
        None => Ok(candle_core::utils::get_num_threads().max(1)),
        Some(n) if n <= 0 => Ok(logical_cpus()),
        Some(n) => match usize::try_from(n) {
            Ok(n) if n <= MAX_THREADS => Ok(n),
            _ => Err(TooManyThreads(n)),
        },
    }
}

/// Sets the thread count of this process's compute pools to `n` (at least 1).
///
/// # Safety
/// Call it before any other thread of the process has started (first thing in `main`): it sets
/// environment variables, which is unsound while another thread may read the environment.
pub unsafe fn set_for_process(n: usize) {
    let n = n.max(1).to_string();
    for v in VARS {
        std::env::set_var(v, &n);
    }
}

/// The environment a child process needs to compute with `n` threads.
pub fn child_env(n: usize) -> [(&'static str, String); 2] {
    VARS.map(|v| (v, n.max(1).to_string()))
}

/// The thread count the compute pools of this process use.
pub fn current() -> usize {
    candle_core::utils::get_num_threads().max(1)
}

/// Runs `f` on every unit of work on candle's barrier pool (the threads the CPU matmuls use,
/// spinning between ops), each unit on one thread: the units hold the disjoint parts of an
/// output they write (`chunks_mut` of it, with their indices).
pub fn par_units<T: Send>(units: Vec<T>, f: impl Fn(&mut T) + Sync) {
    let units: Vec<std::sync::Mutex<T>> = units.into_iter().map(std::sync::Mutex::new).collect();
    candle_core::utils::barrier_pool().execute_chunked(units.len(), |range| {
        for i in range {
            // each unit is locked by the one thread that takes it
            if let Ok(mut u) = units[i].lock() {
                f(&mut u)
            }
        }
    });
}

/// Runs `f` with candle's CPU pool installed, so that its worker threads stay warm across the many
/// short parallel sections of a forward pass.
pub fn with_compute_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    candle_core::Device::Cpu.with_context(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_resolve_as_llama_cpp_reads_them() {
        assert!(matches!(resolve(Some(3)), Ok(3)));
        assert_eq!(resolve(Some(0)).ok(), Some(logical_cpus()));
        assert_eq!(resolve(Some(-1)).ok(), Some(logical_cpus()));
        assert!(resolve(None).is_ok_and(|n| n >= 1));
        let e = resolve(Some(5000)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("-t 5000") && e.contains("1024"), "{e}");
        let env = child_env(0);
        assert_eq!(env[0], ("RAYON_NUM_THREADS", "1".to_string()));
        assert_eq!(env[1].0, "CANDLE_NUM_THREADS");
        assert_eq!(with_compute_pool(|| 7), 7);
    }
}
