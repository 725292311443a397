//! A memory read bandwidth probe: the denominator of the decode bound (weight bytes read per
//! token ÷ read bandwidth) that `brigade bench` reports, and the CPU's bandwidth in the planner's
//! figures for this machine.
//!
//! It reads as a streaming reader in C does (scripts/read-bandwidth.c, compared by
//! scripts/compare-bandwidth.sh): each thread sums its share of a buffer far larger than the
//! last-level cache with the widest vector loads the CPU has (AVX-512, else AVX2, chosen at run
//! time; the loop is portable code that the compiler vectorises for the enabled instruction set)
//! into 64 independent 64-bit lanes, so the loop is bound by loads, not by adds. Reading 8 bytes
//! at a time with 4 scalar accumulators, the probe it replaces, reported 0.6× what the C reader
//! gets on a 2-vCPU AVX-512 VM.

use std::time::Instant;

/// Lanes summed independently: eight 512-bit (or sixteen 256-bit) registers' worth.
const LANES: usize = 64;

/// Sums `c` into [`LANES`] wrapping accumulators (the loads are the point, not the sum).
#[inline(always)]
fn sum_lanes(c: &[u64]) -> u64 {
    let mut acc = [0u64; LANES];
    let mut blocks = c.chunks_exact(LANES);
    for q in &mut blocks {
        for (a, x) in acc.iter_mut().zip(q) {
            *a = a.wrapping_add(*x);
        }
    }
    let tail = blocks.remainder().iter().fold(0u64, |s, x| s.wrapping_add(*x));
    acc.iter().fold(tail, |s, x| s.wrapping_add(*x))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_avx512(c: &[u64]) -> u64 {
    sum_lanes(c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_avx2(c: &[u64]) -> u64 {
    sum_lanes(c)
}

/// The vector width the probe reads with on this CPU, for reports.
pub fn reader() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512";
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return "avx2";
        }
    }
    "portable"
}

/// Sums `c` with the widest loads this CPU has.
fn sum(c: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked on the line above).
            return unsafe { sum_avx512(c) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked on the line above).
            return unsafe { sum_avx2(c) };
        }
    }
    sum_lanes(c)
}

/// Bytes the probe reads: 8 times the last-level cache (so that at most an eighth of a pass can
/// hit it), at least 256 MiB and at most 1 GiB (a worker measures beside the models it holds).
pub fn probe_bytes() -> usize {
    let llc = last_level_cache().unwrap_or(0);
    llc.saturating_mul(8).clamp(256 << 20, 1 << 30)
}

/// The size of the largest cache of CPU 0, from sysfs (Linux); `None` elsewhere.
pub fn last_level_cache() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
        .filter_map(|s| parse_cache_size(s.trim()))
        .max()
}

/// `32768K`, `32M`, `1024` (bytes) as sysfs writes cache sizes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let (num, mult) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1usize << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

/// Measures DRAM read bandwidth in bytes per second with `threads` threads reading a buffer of
/// `bytes` (see [`probe_bytes`]). The best of `reps` passes is returned.
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let threads = threads.max(1);
    // whole blocks of lanes per thread, so that every thread reads at full width
    let per = (bytes / 8 / threads).max(LANES * 64) / LANES * LANES;
    let n = per * threads;
    let buf: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let mut best = 0.0f64;
    let mut sink = 0u64;
    for _ in 0..reps.max(1) {
        // each thread times its own read, from a common start: a pass is from the first start
        // to the last end (a timer on the spawning thread would also count its own scheduling)
        let start = std::sync::Barrier::new(threads);
        let runs: Vec<(u64, Instant, Instant)> = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(per)
                .map(|c| {
                    let start = &start;
                    s.spawn(move || {
                        start.wait();
                        let t0 = Instant::now();
                        let x = sum(c);
                        (x, t0, Instant::now())
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        let (Some(first), Some(last)) = (runs.iter().map(|r| r.1).min(), runs.iter().map(|r| r.2).max()) else {
            continue;
        };
        sink = runs.iter().fold(sink, |a, r| a.wrapping_add(r.0));
        best = best.max((n * 8) as f64 / (last - first).as_secs_f64().max(1e-9));
    }
    std::hint::black_box(sink);
    best
}

/// Memory bandwidth of a GPU in bytes per second, from timed device-to-device copies of a
/// 1 GiB buffer (read + write bytes counted); `None` on the CPU.
pub fn device_bandwidth(device: &candle_core::Device) -> Option<f64> {
    if device.is_cpu() {
        return None;
    }
    let n = 256usize << 20; // f32 elements: 1 GiB
    let t = candle_core::Tensor::zeros(n, candle_core::DType::F32, device).ok()?;
    let mut best = 0.0f64;
    for _ in 0..4 {
        device.synchronize().ok()?;
        let t0 = Instant::now();
        let c = t.copy().ok()?;
        device.synchronize().ok()?;
        let dt = t0.elapsed().as_secs_f64();
        drop(c);
        best = best.max(2.0 * (n * 4) as f64 / dt);
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_something_plausible() {
        let bw = read_bandwidth(64 << 20, 1, 2);
        // between 100 MB/s and 10 TB/s on any machine this runs on
        assert!(bw > 1e8 && bw < 1e13, "{bw}");
        assert!(device_bandwidth(&candle_core::Device::Cpu).is_none());
        assert!((256 << 20..=1 << 30).contains(&probe_bytes()));
        if cfg!(target_os = "linux") && std::path::Path::new("/sys/devices/system/cpu/cpu0/cache").exists() {
            assert!(last_level_cache().is_some_and(|c| c >= 1 << 10));
        }
    }

    #[test]
    fn every_reader_sums_the_same() {
        let v: Vec<u64> = (0..LANES as u64 * 7 + 5).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
        let want = v.iter().fold(0u64, |s, x| s.wrapping_add(*x));
        assert_eq!(sum_lanes(&v), want);
        assert_eq!(sum(&v), want, "{}", reader());
        assert_eq!(sum(&[]), 0);
    }

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_cache_size("32768K"), Some(32 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("lots"), None);
        assert_eq!(parse_cache_size(""), None);
    }
}
