//! One test body per compiled device (candle's `test_device!` pattern): the CPU always, CUDA in
//! a `--features cuda` build. Each compares a placement that uses the GPU with the CPU in f32.
//!
//! On the CPU (every build, so CI) the body runs the GPU's numbers on the CPU: each stage the map
//! gives `cuda0` computes on the CPU in the activation type a GPU would use
//! (`activation_dtype(cuda0)`: bf16 for quantized files, the file's own type for f16/bf16 files),
//! with its KV cache, rotary tables, norms and attention in that type. What stays GPU-only is
//! the kernels themselves (cuBLAS, candle's quantized CUDA kernels). Cases whose GPU type is
//! f32 would compare the CPU's f32 path with itself; they are left to the CUDA build (and to
//! reference.rs for the CPU).
//!
//! Tolerances (max |Δlogit| ÷ max |logit| over every position of a 24-token prompt and 8 decode
//! steps, and the argmax, flips allowed only between near-ties):
//! - f32 model on a GPU: 1e-3 — the same math in f32; only summation order differs.
//! - bf16 models, and quantized ones (bf16 activations): activations carry 8 significant bits
//!   against f32's 24; over four layers, relative errors of 2^-8 per op add up to a few percent:
//!   5e-2. f16 models: 11 bits, eight times finer: 1e-2. Measured on the CPU (these synthetic
//!   4-layer models, 2-3 cases): f16 1.1e-3, bf16 1.1e-2, q8_0 1.6e-2, q4_k 1.9e-2 relative;
//!   q4_k split across the CPU (f32) and the GPU's type 1.5e-2 to 1.8e-2.
//! - split placements where every stage computes in f32 (the CPU run of an f32 model): 1e-6, the
//!   split invariance of slices.rs.
#![allow(clippy::unwrap_used)]

mod common;
use brigade_core::{DeviceId, DeviceMap, Stage};
use brigade_model::device::activation_dtype;
use brigade_model::synth::{write_gguf, Shape, SynthType};
use brigade_model::{Logits, ModelFiles, Pipeline, Slice};
use candle_core::{DType, Device};
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

/// The GPU's activation type for a model.
fn gpu_dtype(files: &ModelFiles) -> DType {
    activation_dtype(DeviceId::Cuda(0), files)
}

/// `map`'s stages (which may name `cuda0`): loaded on their devices when `dev` is a GPU; on the
/// CPU, each `cuda0` stage computing in the GPU's activation type.
fn load(files: &ModelFiles, map: &str, dev: DeviceId) -> Pipeline {
    let stages: Vec<Stage> = DeviceMap::parse(map).unwrap().stages(files.config.n_layers).unwrap();
    if dev != DeviceId::Cpu {
        return Pipeline::load(files, &stages, 64, |_, _| {}).unwrap();
    }
    let slices = stages
        .iter()
        .map(|s| {
            let dtype = if s.device == DeviceId::Cpu { DType::F32 } else { gpu_dtype(files) };
            (DeviceId::Cpu, Slice::load(files, s.layers, &Device::Cpu, dtype, 64).unwrap())
        })
        .collect();
    Pipeline::from_slices(slices).unwrap()
}

/// Logits of a 24-token prompt (every position) and 8 greedy decode steps, on `map`'s stages.
fn trace(files: &ModelFiles, map: &str, dev: DeviceId) -> Vec<Vec<f32>> {
    let p = load(files, map, dev);
    let mut s = p.new_session().unwrap();
    let prompt: Vec<u32> = (0..24).map(|i| (i * 53 + 7) % files.config.vocab as u32).collect();
    let mut rows = p.forward(&mut s, &prompt, Logits::All).unwrap().to_vec2::<f32>().unwrap();
    for _ in 0..8 {
        // feed the f32 CPU's choice everywhere, so the traces stay comparable
        let next = argmax(rows.last().unwrap());
        rows.extend(p.forward(&mut s, &[next], Logits::Last).unwrap().to_vec2::<f32>().unwrap());
    }
    rows
}

/// Max |Δ| ÷ max |logit| of `dev` against `cpu`, checked against `tol`; argmax flips only between
/// near-ties.
fn compare(what: &str, cpu: &[Vec<f32>], dev: &[Vec<f32>], tol: f32) -> f32 {
    let scale = cpu.iter().flatten().fold(1f32, |m, x| m.max(x.abs()));
    let d = max_abs_diff(cpu, dev);
    assert!(
        d.is_finite() && d / scale <= tol,
        "{what}: max |Δ| {d} on logits up to {scale} (tolerance {tol} relative)"
    );
    for (pos, (a, b)) in cpu.iter().zip(dev).enumerate() {
        let (ia, ib) = (argmax(a) as usize, argmax(b) as usize);
        if ia != ib {
            assert!((a[ia] - a[ib]).abs() <= tol * scale, "{what}: argmax {ia} vs {ib} at position {pos}");
        }
    }
    eprintln!("{what}: max |Δlogit| {d:.3e} of {scale:.2} ({:.1e} relative)", d / scale);
    d / scale
}

fn logits_match_cpu(dev: DeviceId) {
    let dir = tempfile::tempdir().unwrap();
    let mut cases = vec![("stories260K f32".to_string(), stories_f32(), 1e-3)];
    for (ty, tol) in [
        (SynthType::F32, 1e-3),
        (SynthType::BF16, 5e-2),
        (SynthType::F16, 1e-2),
        (SynthType::Q8_0, 5e-2),
        (SynthType::Q4K, 5e-2),
    ] {
        cases.push((format!("synth {ty:?}"), synth(dir.path(), ty), tol));
    }
    let mut compared = 0;
    for (name, files, tol) in cases {
        let n = files.config.n_layers;
        if dev == DeviceId::Cpu && gpu_dtype(&files) == DType::F32 {
            eprintln!("{name}: a GPU computes it in f32, the CPU's own path: left to the CUDA build");
            continue;
        }
        let rel = compare(
            &format!("{name} as on {}", DeviceId::Cuda(0)),
            &trace(&files, &format!("cpu:{n}"), DeviceId::Cpu),
            &trace(&files, &format!("cuda0:{n}"), dev),
            tol,
        );
        // a 16-bit run that matched f32 exactly would mean it never left f32
        if gpu_dtype(&files) != DType::F32 {
            assert!(rel > 0.0, "{name}: no difference from f32 at all");
        }
        compared += 1;
    }
    assert!(compared >= 4, "only {compared} cases compared");
}
test_device!(logits_match_cpu, logits_match_cpu_on_cpu, logits_match_cpu_on_cuda);

fn split_matches_unsplit(dev: DeviceId) {
    let dir = tempfile::tempdir().unwrap();
    for ty in [SynthType::F32, SynthType::Q4K] {
        let f = synth(dir.path(), ty);
        let whole = trace(&f, "cpu:4", DeviceId::Cpu);
        let tol = match (gpu_dtype(&f), dev) {
            (DType::F32, DeviceId::Cpu) => 1e-6,
            (DType::F32, _) => 1e-3,
            _ => 5e-2,
        };
        // llama.cpp's -ngl layout (GPU last) and the reverse
        compare(&format!("{ty:?} cpu:1,cuda0:3"), &whole, &trace(&f, "cpu:1,cuda0:3", dev), tol);
        compare(&format!("{ty:?} cuda0:2,cpu:2"), &whole, &trace(&f, "cuda0:2,cpu:2", dev), tol);
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
        for ((r, st), (_, slice)) in p.report().iter().zip(&stages).zip(p.stages()) {
            let want = brigade_model::predict_slice_bytes(&f, st.layers, st.device, 64);
            assert_eq!(r.weight_bytes, want.weights, "{ty:?} {:?}", st);
            assert_eq!(r.kv_bytes, want.kv, "{ty:?} {:?}", st);
            assert_eq!(slice.table_bytes(), want.tables, "{ty:?} {:?}", st);
            assert!(want.tables > 0);
        }
    }
}
test_device!(predicted_bytes_are_the_loaded_bytes, predicted_bytes_on_cpu, predicted_bytes_on_cuda);
