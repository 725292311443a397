//! A memory read bandwidth probe: the denominator of the decode bound
//! (weight bytes read per token ÷ read bandwidth) that `brigade bench` reports.

use std::time::Instant;

/// Measures DRAM read bandwidth in bytes per second with `threads` threads reading a buffer of
/// `bytes` (large enough to defeat caches; 512 MiB is plenty on today's machines). The best of
/// `reps` passes is returned.
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let threads = threads.max(1);
    let n = (bytes / 8).max(threads * 1024);
    let buf: Vec<u64> = (0..n as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
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

#[cfg(test)]
mod tests {
    #[test]
    fn measures_something_plausible() {
        let bw = super::read_bandwidth(64 << 20, 1, 2);
        // between 100 MB/s and 10 TB/s on any machine this runs on
        assert!(bw > 1e8 && bw < 1e13, "{bw}");
    }
}
