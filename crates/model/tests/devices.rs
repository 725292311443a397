//! One test body per compiled device (candle's `test_device!` pattern): the CPU always, CUDA in
//! a `--features cuda` build. Each compares the device against the CPU in f32, so on the CPU the
//! bodies check the harness itself (exact equality), and on a GPU the device's numbers.
//!
//! Tolerances (max |Δlogit| ÷ max |logit| over every position of a 24-token prompt and 8 decode
//! steps, and the argmax):
//! - f32 model: 1e-3 — the same math in f32; only summation order differs (cuBLAS, reductions).
//! - f16 / bf16 models: the GPU computes in the model's 16-bit type, so activations carry 11 / 8
//!   significant bits against the CPU's 24; after a few layers relative errors of 2^-8 per op add
//!   up to a few percent: 5e-2, and the argmax may only flip where the top two logits are within
//!   that margin.
//! - q8_0 / q4_k models: both devices quantize activations to 8 bits before the integer dot
//!   products (CPU: q8_0 / q8_K blocks from f32; GPU: q8_1 blocks from bf16), so the two round
//!   differently: 5e-2 as for bf16.
#![allow(clippy::unwrap_used)]

mod common;
use brigade_core::{DeviceId, DeviceMap};
use brigade_model::synth::{write_gguf, Shape, SynthType};
use brigade_model::{Logits, ModelFiles, Pipeline};
use common::*;

macro_rules! test_device {
    ($body:ident, $cpu:ident, $cuda:ident) => {
        #[test]
        fn $cpu() {
            $body(DeviceId::Cpu);
        }
        #[cfg(feature = "cuda")]
        #[test]
        fn $cuda() {
            $body(DeviceId::Cuda(0));
        }
    };
}

fn shape() -> Shape {
    Shape { layers: 4, hidden: 256, ffn: 512, heads: 8, kv_heads: 4, vocab: 512, context: 512, rope_theta: 10000.0 }
}

fn synth(dir: &std::path::Path, ty: SynthType) -> ModelFiles {
    let p = dir.join(format!("{ty:?}.gguf"));
    write_gguf(&p, &shape(), ty, 17, |_, _| {}).unwrap();
    ModelFiles::open(&p).unwrap()
}

/// Logits of a 24-token prompt (every position) and 8 greedy decode steps, on `map`'s stages.
fn trace(files: &ModelFiles, map: &str) -> Vec<Vec<f32>> {
    let n = files.config.n_layers;
    let stages = DeviceMap::parse(map).unwrap().stages(n).unwrap();
    let p = Pipeline::load(files, &stages, 64, |_, _| {}).unwrap();
    let mut s = p.new_session().unwrap();
    let prompt: Vec<u32> = (0..24).map(|i| (i * 53 + 7) % files.config.vocab as u32).collect();
    let mut rows = p.forward(&mut s, &prompt, Logits::All).unwrap().to_vec2::<f32>().unwrap();
    for _ in 0..8 {
        // feed the CPU's choice on every device, so the traces stay comparable
        let next = argmax(rows.last().unwrap());
        rows.extend(p.forward(&mut s, &[next], Logits::Last).unwrap().to_vec2::<f32>().unwrap());
    }
    rows
}

fn compare(what: &str, cpu: &[Vec<f32>], dev: &[Vec<f32>], tol: f32, exact_argmax: bool) {
    let scale = cpu.iter().flatten().fold(1f32, |m, x| m.max(x.abs()));
    let d = max_abs_diff(cpu, dev);
    assert!(
        d.is_finite() && d / scale <= tol,
        "{what}: max |Δ| {d} on logits up to {scale} (tolerance {tol} relative)"
    );
    for (pos, (a, b)) in cpu.iter().zip(dev).enumerate() {
        let (ia, ib) = (argmax(a) as usize, argmax(b) as usize);
        if ia != ib {
            // a flip is allowed only between near-ties
            assert!(
                !exact_argmax && (a[ia] - a[ib]).abs() <= tol * scale,
                "{what}: argmax {ia} vs {ib} at position {pos}"
            );
        }
    }
    eprintln!("{what}: max |Δlogit| {d:.3e} of {scale:.2}");
}

fn device_map(dev: DeviceId, n: usize) -> String {
    format!("{dev}:{n}")
}

fn logits_match_cpu(dev: DeviceId) {
    let dir = tempfile::tempdir().unwrap();
    let stories = stories_f32();
    let n = stories.config.n_layers;
    compare(
        "stories260K f32",
        &trace(&stories, &format!("cpu:{n}")),
        &trace(&stories, &device_map(dev, n)),
        1e-3,
        dev == DeviceId::Cpu,
    );
    for (ty, tol) in [
        (SynthType::F32, 1e-3),
        (SynthType::BF16, 5e-2),
        (SynthType::F16, 5e-2),
        (SynthType::Q8_0, 5e-2),
        (SynthType::Q4K, 5e-2),
    ] {
        let f = synth(dir.path(), ty);
        let exact = dev == DeviceId::Cpu;
        compare(
            &format!("synth {ty:?} on {dev}"),
            &trace(&f, "cpu:4"),
            &trace(&f, &device_map(dev, 4)),
            if exact { 0.0 } else { tol },
            exact,
        );
    }
}
test_device!(logits_match_cpu, logits_match_cpu_on_cpu, logits_match_cpu_on_cuda);

fn split_matches_unsplit(dev: DeviceId) {
    let dir = tempfile::tempdir().unwrap();
    for (ty, tol) in [(SynthType::F32, 1e-3), (SynthType::Q4K, 5e-2)] {
        let f = synth(dir.path(), ty);
        let whole = trace(&f, "cpu:4");
        let exact = dev == DeviceId::Cpu;
        let tol = if exact { 1e-6 } else { tol };
        // llama.cpp's -ngl layout (GPU last) and the reverse
        compare(&format!("{ty:?} cpu:1,{dev}:3"), &whole, &trace(&f, &format!("cpu:1,{dev}:3")), tol, exact);
        compare(&format!("{ty:?} {dev}:2,cpu:2"), &whole, &trace(&f, &format!("{dev}:2,cpu:2")), tol, exact);
    }
}
test_device!(split_matches_unsplit, split_matches_unsplit_on_cpu, split_matches_unsplit_on_cuda);

/// What a slice allocates on its device is what `predict_slice_bytes` said it would.
fn predicted_bytes_are_the_loaded_bytes(dev: DeviceId) {
    let dir = tempfile::tempdir().unwrap();
    for ty in [SynthType::F16, SynthType::Q4K] {
        let f = synth(dir.path(), ty);
        let stages = DeviceMap::parse(&format!("cpu:1,{dev}:3")).unwrap().stages(4).unwrap();
        let p = Pipeline::load(&f, &stages, 64, |_, _| {}).unwrap();
        for (r, st) in p.report().iter().zip(&stages) {
            let want = brigade_model::predict_slice_bytes(&f, st.layers, st.device, 64);
            assert_eq!(r.weight_bytes, want.weights, "{ty:?} {:?}", st);
            assert_eq!(r.kv_bytes, want.kv, "{ty:?} {:?}", st);
        }
    }
}
test_device!(predicted_bytes_are_the_loaded_bytes, predicted_bytes_on_cpu, predicted_bytes_on_cuda);
