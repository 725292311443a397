//! The fused CPU decode step (`llama::fused`) against the same step as candle ops: the same
//! logits, bit for bit, for one session and for several decoded together, on every weight layout
//! the CPU kernels have (packed, the file's blocks, floats; stacked and separate projections),
//! both RoPE layouts, q/k/v biases, and a model cut into stages.
#![allow(clippy::unwrap_used)]

mod common;

use brigade_model::synth::{write_gguf, write_safetensors_dir, Shape, SynthType};
use brigade_model::{Logits, ModelFiles, Pipeline, Sampler, SamplingParams, Session};
use common::{pipeline, retyped};
use std::path::Path;

fn shape() -> Shape {
    Shape { layers: 3, hidden: 256, ffn: 512, heads: 4, kv_heads: 2, vocab: 300, context: 512, rope_theta: 1e4 }
}

fn argmax(l: &[f32]) -> u32 {
    Sampler::new(SamplingParams::greedy()).sample(l, &[])
}

fn bits(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter().flatten().map(|x| x.to_bits()).collect()
}

fn prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 31 + salt * 17) % (vocab - 3)).collect()
}

/// A 12-token prompt, then 6 greedy steps one token at a time: the decode steps' logits.
fn one_session(p: &Pipeline, vocab: u32) -> Vec<Vec<f32>> {
    let mut s = p.new_session().unwrap();
    let mut l = p.prefill(&mut s, &prompt(12, 1, vocab), 512).unwrap();
    let mut out = Vec::new();
    for _ in 0..6 {
        l = p.forward(&mut s, &[argmax(&l)], Logits::Last).unwrap().get(0).unwrap().to_vec1().unwrap();
        out.push(l.clone());
    }
    assert_eq!(s.cache_lens(), vec![18; p.stages().count()]);
    out
}

/// Three sessions with prompts of 3, 17 and 8 tokens decoded together for 5 steps: every row's
/// logits at every step.
fn three_rows(p: &Pipeline, vocab: u32) -> Vec<Vec<f32>> {
    let mut sessions: Vec<(Session, Vec<f32>)> = [3, 17, 8]
        .iter()
        .enumerate()
        .map(|(k, &len)| {
            let mut s = p.new_session().unwrap();
            let l = p.prefill(&mut s, &prompt(len, k as u32 + 2, vocab), 512).unwrap();
            (s, l)
        })
        .collect();
    let mut out = Vec::new();
    for _ in 0..5 {
        let tokens: Vec<u32> = sessions.iter().map(|s| argmax(&s.1)).collect();
        let mut batch: Vec<&mut Session> = sessions.iter_mut().map(|s| &mut s.0).collect();
        let rows = p.forward_rows(&mut batch, &tokens).unwrap();
        for (s, l) in sessions.iter_mut().zip(rows) {
            out.push(l.clone());
            s.1 = l;
        }
    }
    out
}

/// The fused step runs on every stage of `map` and gives, bit for bit, the logits of candle's ops.
fn check(what: &str, files: &ModelFiles, map: &str) {
    let vocab = files.config.vocab as u32;
    let mut fused = pipeline(files, map, 128);
    let stages = fused.stages().count();
    assert_eq!(fused.set_fused_decode(true), stages, "{what}: the fused step does not run on every stage");
    let mut ops = pipeline(files, map, 128);
    assert_eq!(ops.set_fused_decode(false), 0);
    let (a, b) = (one_session(&fused, vocab), one_session(&ops, vocab));
    assert!(
        bits(&a) == bits(&b),
        "{what} {map}: one session's logits differ (max |Δ| {})",
        common::max_abs_diff(&a, &b)
    );
    let (a, b) = (three_rows(&fused, vocab), three_rows(&ops, vocab));
    assert!(bits(&a) == bits(&b), "{what} {map}: batched rows differ (max |Δ| {})", common::max_abs_diff(&a, &b));
    // and the logits are a model's, not zeros
    assert!(a.iter().flatten().any(|x| x.abs() > 1e-3), "{what}: logits all near 0");
}

fn synth(dir: &Path, ty: SynthType) -> ModelFiles {
    let path = dir.join(format!("{ty:?}.gguf"));
    write_gguf(&path, &shape(), ty, 11, |_, _| {}).unwrap();
    ModelFiles::open(&path).unwrap()
}

#[test]
fn fused_decode_equals_candle_ops_on_every_weight_layout() {
    let dir = tempfile::tempdir().unwrap();
    // Q4_K: packed where the CPU has int8 kernels; Q8_0: packed on AVX-512, the file's blocks
    // elsewhere; Q4_0: the file's blocks (int8 vec-dots); F32 and F16: candle's vec-dots
    for ty in [SynthType::Q4K, SynthType::Q8_0, SynthType::Q4_0, SynthType::F32, SynthType::F16] {
        let files = synth(dir.path(), ty);
        check(&format!("{ty:?}"), &files, "cpu:3");
        check(&format!("{ty:?}"), &files, "cpu:1,cpu:2");
    }
    // separate projections: v and up in f32 beside Q4_K q, k and gate
    let q4k = dir.path().join("Q4K.gguf");
    let mixed =
        retyped(&q4k, &dir.path().join("mixed.gguf"), |n| n.ends_with("attn_v.weight") || n.ends_with("ffn_up.weight"));
    check("Q4_K with f32 v and up", &mixed, "cpu:3");
}

#[test]
fn fused_decode_equals_candle_ops_on_hugging_face_layouts() {
    let dir = tempfile::tempdir().unwrap();
    // RoPE on halves, weights as safetensors floats
    let llama = dir.path().join("llama");
    write_safetensors_dir(&llama, &shape(), SynthType::F32, 5, |_, _| {}).unwrap();
    let files = ModelFiles::open(&llama).unwrap();
    assert_eq!(files.config.rope_style, brigade_model::config::RopeStyle::Halves);
    check("safetensors", &files, "cpu:3");
    // q/k/v biases (Qwen2)
    let qwen = common::qwen2_twin(&llama, &dir.path().join("qwen"), &shape(), 0.5);
    let files = ModelFiles::open(&qwen).unwrap();
    assert!(files.config.layer.qkv_bias);
    check("qwen2 biases", &files, "cpu:2,cpu:1");
}

/// Experts (synth's Mixtral, Qwen3-MoE and OLMoE layouts): the fused step computes them on
/// slices, grouped as the op path groups them.
#[test]
fn fused_decode_equals_candle_ops_with_experts() {
    use brigade_model::config::Arch;
    use brigade_model::synth::{SynthMoe, SynthMoeFamily};
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { ffn: 128, ..shape() };
    let families = [
        (SynthMoeFamily::Mixtral, Arch::Llama),
        (SynthMoeFamily::Qwen3Moe, Arch::Qwen3Moe),
        (SynthMoeFamily::Olmoe, Arch::Olmoe),
    ];
    for (family, arch) in families {
        for ty in [SynthType::Q4K, SynthType::Q4_0, SynthType::F32] {
            let path = dir.path().join(format!("moe-{family:?}-{ty:?}.gguf"));
            let moe = SynthMoe { experts: 8, used: 2, family };
            brigade_model::synth::write_gguf_with(&path, &shape, Some(moe), ty, 4, |_, _| {}).unwrap();
            let files = ModelFiles::open(&path).unwrap();
            let c = &files.config;
            assert_eq!(c.arch, arch);
            assert_eq!(c.layer.qk_norm, family != SynthMoeFamily::Mixtral, "{family:?}");
            assert_eq!(c.layer.qk_norm_whole, family == SynthMoeFamily::Olmoe, "{family:?}");
            assert_eq!(c.moe.unwrap().norm_topk, family != SynthMoeFamily::Olmoe, "{family:?}");
            check(&format!("experts {family:?} {ty:?}"), &files, "cpu:3");
            check(&format!("experts {family:?} {ty:?}"), &files, "cpu:1,cpu:2");
        }
    }
}

/// Qwen3's per-head q/k norms, from the transformers checkpoint and from llama.cpp's Q4_K_M file.
#[test]
fn fused_decode_equals_candle_ops_on_qwen3() {
    for name in ["hf", "qwen3-tiny-Q4_K_M.gguf"] {
        let files = ModelFiles::open(&common::family_file("qwen3", name)).unwrap();
        assert!(files.config.layer.qk_norm, "{name}");
        check(&format!("qwen3 {name}"), &files, "cpu:3");
        check(&format!("qwen3 {name}"), &files, "cpu:1,cpu:2");
    }
}

/// OLMoE's q and k normed whole, from the checkpoint and from llama.cpp's Q4_K_M file.
#[test]
fn fused_decode_equals_candle_ops_on_olmoe() {
    for name in ["hf", "olmoe-tiny-Q4_K_M.gguf"] {
        let files = ModelFiles::open(&common::family_file("olmoe", name)).unwrap();
        assert!(files.config.layer.qk_norm_whole, "{name}");
        check(&format!("olmoe {name}"), &files, "cpu:3");
        check(&format!("olmoe {name}"), &files, "cpu:1,cpu:2");
    }
}

/// Gemma 2 and 3: GeLU, norms after attention and the feed-forward block, windowed layers
/// (Gemma 3's with their own RoPE base), soft-capped attention (Gemma 2), from the checkpoints
/// and from llama.cpp's Q4_K_M files.
#[test]
fn fused_decode_equals_candle_ops_on_gemma() {
    for family in ["gemma2", "gemma3"] {
        for name in ["hf".to_string(), format!("{family}-tiny-Q4_K_M.gguf")] {
            let files = ModelFiles::open(&common::family_file(family, &name)).unwrap();
            assert!(files.config.layer.gelu && files.config.layer.post_norms, "{family} {name}");
            assert_eq!(files.config.rope_theta_local.is_some(), family == "gemma3", "{family} {name}");
            let n = files.config.n_layers;
            check(&format!("{family} {name}"), &files, &format!("cpu:{n}"));
            // the last layer alone (global on both)
            check(&format!("{family} {name}"), &files, &format!("cpu:{},cpu:1", n - 1));
        }
    }
}

/// Phi-3's fused q/k/v and gate/up matrices, from the checkpoint and from llama.cpp's Q4_K_M.
#[test]
fn fused_decode_equals_candle_ops_on_phi3() {
    for name in ["hf", "phi3-tiny-Q4_K_M.gguf"] {
        let files = ModelFiles::open(&common::family_file("phi3", name)).unwrap();
        assert!(files.config.layer.fused_qkv && files.config.layer.fused_gate_up, "{name}");
        check(&format!("phi3 {name}"), &files, "cpu:3");
        check(&format!("phi3 {name}"), &files, "cpu:2,cpu:1");
    }
}

/// Mistral's 16-position sliding window: the sessions' decode steps cross it.
#[test]
fn fused_decode_equals_candle_ops_in_a_sliding_window() {
    let files = ModelFiles::open(&common::family_file("mistral", "hf")).unwrap();
    assert_eq!(files.config.sliding_window, Some(16));
    check("mistral", &files, "cpu:3");
    check("mistral", &files, "cpu:2,cpu:1");
    // caches of the window plus passes of 2 tokens (17 positions), moved to the front every few
    // steps: in the one session of 18 tokens, and at other times in each of the three decoded
    // together
    let mut files = files;
    files.set_window_pass(Some(2));
    check("mistral, window-sized caches", &files, "cpu:3");
    check("mistral, window-sized caches", &files, "cpu:2,cpu:1");
}

/// The composition of candle ops a GPU runs (masks added to the scores, here in bf16 on the CPU)
/// reads window-sized caches as the f32 path does: a 40-token prompt in passes of 3 and 10
/// decode steps part from the f32 path's logits by no more than bf16's rounding does with
/// context-sized caches (a mask misplaced by the cache's move would part by units: the logits
/// here are up to 9). Mistral (window 16 on every layer: caches of 18 positions) and Gemma 3
/// (window 8 on five layers of six: the global layer's mask and the local layers' are two).
#[test]
fn candle_composition_reads_window_sized_caches() {
    use brigade_core::LayerRange;
    use brigade_model::Slice;
    use candle_core::DType;
    // (family, file, layers, positions of a windowed layer's cache, per-token elements of a layer)
    for (family, file, n, windowed, cap, per_token) in
        [("mistral", "hf", 3, 3, 18, 2 * 2 * 32), ("gemma3", "gemma3-tiny-F16.gguf", 6, 5, 10, 2 * 2 * 64)]
    {
        let run = |pass: Option<usize>, dtype: DType| -> Vec<Vec<f32>> {
            let mut files = ModelFiles::open(&common::family_file(family, file)).unwrap();
            files.set_window_pass(pass);
            let layers = LayerRange::new(0, n).unwrap();
            let s = Slice::load(&files, layers, &candle_core::Device::Cpu, dtype, 128).unwrap();
            let mut c = s.new_cache().unwrap();
            let positions = if pass.is_some() { windowed * cap + (n - windowed) * 128 } else { n * 128 };
            assert_eq!(c.bytes(), (positions * per_token * dtype.size_in_bytes()) as u64, "{family}");
            // the same tokens for both types (greedy ids could part on a near tie)
            let steps = prompt(10, 9, 512);
            let mut out = Vec::new();
            for ids in std::iter::once(prompt(40, 5, 512)).chain(steps.iter().map(|&t| vec![t])) {
                let l = s.forward(&mut c, brigade_model::StageInput::Tokens(&ids), Logits::Last).unwrap();
                out.push(l.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap());
            }
            assert_eq!(c.len(), 50);
            out
        };
        let windowed = common::max_abs_diff(&run(Some(3), DType::F32), &run(Some(3), DType::BF16));
        let whole = common::max_abs_diff(&run(None, DType::F32), &run(None, DType::BF16));
        assert!(
            windowed < 1.5 * whole && windowed < 1.5,
            "{family}: bf16's composition parts from f32 by {windowed} on window-sized caches, {whole} on whole ones"
        );
    }
}

#[test]
fn the_embedded_model_decodes_fused() {
    check("stories260K", &common::stories_f32(), "cpu:5");
}

/// A GPU's activation type run on the CPU (bf16) does not take the fused step (it is f32 only)
/// and still decodes.
#[test]
fn other_activation_types_keep_candle_ops() {
    use brigade_core::LayerRange;
    use brigade_model::Slice;
    let files = common::stories_f32();
    let n = files.config.n_layers;
    let mut s =
        Slice::load(&files, LayerRange::new(0, n).unwrap(), &candle_core::Device::Cpu, candle_core::DType::BF16, 32)
            .unwrap();
    assert!(!s.set_fused_decode(true));
    let mut c = s.new_cache().unwrap();
    let l = s.forward(&mut c, brigade_model::StageInput::Tokens(&[1, 5, 9]), Logits::Last).unwrap();
    let l = s
        .forward(
            &mut c,
            brigade_model::StageInput::Tokens(&[argmax(&l.flatten_all().unwrap().to_vec1().unwrap())]),
            Logits::Last,
        )
        .unwrap();
    assert_eq!(c.len(), 4);
    assert!(l.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|x| x.is_finite()));
}
