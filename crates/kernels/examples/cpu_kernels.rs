//! Times brigade's CPU matmul kernels on one weight shape, per instruction set this CPU has:
//! `cargo run --release -p brigade-kernels --example cpu_kernels -- [q4_k|q6_k|q8_0|…] [m] [k] [n]
//! [avx512|avxvnni|avx2|portable]`. Prints GMAC/s (multiply-adds per second) for each, best of
//! several runs, by the wall clock and by this thread's time on a CPU (`/proc/thread-self/schedstat`,
//! which holds on a busy machine where wall times do not, with `RAYON_NUM_THREADS=1`) and by the
//! fastest single call (what a harness timing each call and keeping the best reports); with one
//! instruction set named, only that one. Types packed at load (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0,
//! Q5_1) are timed both ways: on the file's layout and packed (`packed`).

use brigade_kernels::matmul::{matmul, matmul_packed, packs_on, Isa, Packed};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::time::Instant;

fn dtype(name: &str) -> Option<GgmlDType> {
    Some(match name {
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q5_1" => GgmlDType::Q5_1,
        "q8_0" => GgmlDType::Q8_0,
        "q4_k" => GgmlDType::Q4K,
        "q5_k" => GgmlDType::Q5K,
        "q6_k" => GgmlDType::Q6K,
        "f16" => GgmlDType::F16,
        _ => return None,
    })
}

/// Nanoseconds this thread has run on a CPU.
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dt = dtype(args.first().map_or("q4_k", String::as_str)).ok_or("unknown type")?;
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (m, k, n) = (num(1, 128), num(2, 2048), num(3, 8192));
    let w = QTensor::quantize(&Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?, dt)?;
    let data = w.data()?;
    let lhs: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
    let mut dst = vec![0f32; m * n];
    let reps = (2e10 / (m * k * n) as f64).clamp(3.0, 2000.0) as usize;
    println!("{dt:?} m={m} k={k} n={n}, {reps} reps per run, {} threads", candle_core::utils::get_num_threads());
    let only = match args.get(4) {
        Some(name) => Some(Isa::parse(name)?.ok_or("name an instruction set")?),
        None => None,
    };
    // packed kernels are timed on every instruction set that has them, chosen or not
    let packed = if packs_on(dt, Isa::Avx512Vnni) { Some(Packed::new(dt, &data, (n, k))?) } else { None };
    let runs = Isa::ALL.into_iter().flat_map(|i| [(i, false), (i, true)]);
    let with = |i: Isa, p: bool| {
        i.available() && only.is_none_or(|o| o == i) && (!p || (packed.is_some() && i != Isa::Portable))
    };
    for (isa, pack) in runs.filter(|&(i, p)| with(i, p)) {
        let (mut best, mut best_cpu, mut best_call) = (f64::MAX, f64::MAX, f64::MAX);
        let mut kernel = None;
        for _ in 0..5 {
            let (t, c) = (Instant::now(), cpu_ns());
            for _ in 0..reps {
                let call = Instant::now();
                kernel = Some(match (&packed, pack) {
                    (Some(p), true) => matmul_packed(p, m, &lhs, &mut dst, isa)?,
                    _ => matmul(dt, &data, (m, k, n), &lhs, &mut dst, isa)?,
                });
                best_call = best_call.min(call.elapsed().as_secs_f64());
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            best_cpu = best_cpu.min((cpu_ns() - c) as f64 * 1e-9 / reps as f64);
        }
        let macs = (m * k * n) as f64;
        println!(
            "{:>14}: {:8.1} GMAC/s wall {:8.1} GMAC/s on CPU {:8.1} GMAC/s best call  {:8.3} ms  {kernel:?}",
            isa.name(),
            macs / best / 1e9,
            macs / best_cpu / 1e9,
            macs / best_call / 1e9,
            best * 1e3
        );
    }
    Ok(())
}
