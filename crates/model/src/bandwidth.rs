//! A memory read bandwidth probe: the denominator of the decode bound
//! (weight bytes read per token ÷ read bandwidth) that `brigade bench` reports.

use std::time::Instant;

/// Measures DRAM read bandwidth in bytes per second with `threads` threads reading a buffer of
/// `bytes` (large enough to defeat caches; 512 MiB is plenty on today's machines). The best of
/// `reps` passes is returned.
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let threads = threads.max(1);
    let n = (bytes / 8).max(threads * 1024);
    let buf: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let chunk = n.div_ceil(threads);
    let mut best = 0.0f64;
    let mut sink = 0u64;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(chunk)
                .map(|c| {
                    s.spawn(move || {
                        // Four independent accumulators so the loop is bound by loads, not adds.
                        let mut acc = [0u64; 4];
                        for q in c.chunks_exact(4) {
                            acc[0] = acc[0].wrapping_add(q[0]);
                            acc[1] = acc[1].wrapping_add(q[1]);
                            acc[2] = acc[2].wrapping_add(q[2]);
                            acc[3] = acc[3].wrapping_add(q[3]);
                        }
                        acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        let dt = t0.elapsed().as_secs_f64();
        sink = sums.iter().fold(sink, |a, b| a.wrapping_add(*b));
        best = best.max((n * 8) as f64 / dt);
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
    #[test]
    fn measures_something_plausible() {
        let bw = super::read_bandwidth(64 << 20, 1, 2);
        // between 100 MB/s and 10 TB/s on any machine this runs on
        assert!(bw > 1e8 && bw < 1e13, "{bw}");
        assert!(super::device_bandwidth(&candle_core::Device::Cpu).is_none());
    }
}
