//! Mixtures of experts on random-weight Mixtral-shaped models written by `synth` (the llama.cpp
//! and transformers references are in `families.rs`): split invariance, a prompt read in one
//! pass (tokens grouped by expert) against the same tokens read one at a time, memory as
//! predicted, and malformed expert metadata refused with the field named.
#![allow(clippy::unwrap_used)]

mod common;

use brigade_core::{DeviceMap, LayerRange};
use brigade_model::gguf::{Gguf, TensorSpec, Value};
use brigade_model::synth::{write_gguf_with, Shape, SynthMoe, SynthMoeFamily, SynthType};
use brigade_model::{
    ExpertShard, ExpertSplit, ExpertsCall, Logits, MatMul, ModelError, ModelFiles, Pipeline, RemoteExperts, Slice,
    StageInput,
};
use candle_core::{DType, Device, Tensor};
use common::{all_logits, max_abs_diff, pipeline};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn shape() -> Shape {
    Shape { layers: 3, hidden: 256, ffn: 128, heads: 4, kv_heads: 2, vocab: 300, context: 512, rope_theta: 1e4 }
}

const MOE: SynthMoe = SynthMoe { experts: 8, used: 2, family: SynthMoeFamily::Mixtral };

fn synth(dir: &Path, ty: SynthType) -> PathBuf {
    let path = dir.join(format!("moe-{ty:?}.gguf"));
    write_gguf_with(&path, &shape(), Some(MOE), ty, 3, |_, _| {}).unwrap();
    path
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 37 + 11) % 290).collect()
}

#[test]
fn experts_are_read_from_the_file_and_split_invariant() {
    let dir = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&synth(dir.path(), SynthType::F32)).unwrap();
    let m = files.config.moe.unwrap();
    assert_eq!((m.experts, m.used, m.ffn, m.norm_topk, m.shared_ffn), (8, 2, 128, true, None));
    let ids = prompt(40);
    let whole = all_logits(&pipeline(&files, "cpu:3", 128), &ids);
    assert!(whole.iter().flatten().any(|x| x.abs() > 1e-3), "logits all near 0");
    for map in ["cpu:1,cpu:2", "cpu:1,cpu:1,cpu:1"] {
        let split = all_logits(&pipeline(&files, map, 128), &ids);
        let d = max_abs_diff(&whole, &split);
        assert!(d <= 1e-5, "{map}: max |Δ| {d}");
    }
}

/// A prompt read in one pass sends each expert all the tokens that chose it at once; read one
/// token at a time, each token goes alone. The logits agree (to the attention's rounding:
/// a chunk's and a decode step's attention are different code).
#[test]
fn a_prompt_grouped_by_expert_computes_what_its_tokens_do_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    for ty in [SynthType::F32, SynthType::Q4K] {
        let files = ModelFiles::open(&synth(dir.path(), ty)).unwrap();
        let p = pipeline(&files, "cpu:3", 128);
        let ids = prompt(24);
        let chunk = all_logits(&p, &ids);
        let mut s = p.new_session().unwrap();
        let one_by_one: Vec<Vec<f32>> = ids
            .iter()
            .map(|&t| p.forward(&mut s, &[t], Logits::Last).unwrap().get(0).unwrap().to_vec1().unwrap())
            .collect();
        let d = max_abs_diff(&chunk, &one_by_one);
        let scale = chunk.iter().flatten().fold(0f32, |a, x| a.max(x.abs()));
        assert!(d <= 1e-4 * scale.max(1.0), "{ty:?}: max |Δ| {d} of logits up to {scale}");
    }
}

#[test]
fn memory_of_a_slice_of_experts_is_what_was_predicted() {
    let dir = tempfile::tempdir().unwrap();
    for ty in [SynthType::F16, SynthType::Q4K] {
        let path = synth(dir.path(), ty);
        let files = ModelFiles::open(&path).unwrap();
        let stages = DeviceMap::parse("cpu:1,cpu:2").unwrap().stages(3).unwrap();
        let p = Pipeline::load(&files, &stages, 64, |_, _| {}).unwrap();
        let mut total = 0;
        for (r, st) in p.report().iter().zip(&stages) {
            let want = brigade_model::predict_slice_bytes(&files, st.layers, st.device, 64);
            assert_eq!(r.weight_bytes, want.weights, "{ty:?} {st:?}");
            total += r.weight_bytes;
        }
        // the experts are most of it, and held once: about the file's size
        let file = std::fs::metadata(&path).unwrap().len();
        assert!(total <= file && total * 10 >= file * 9, "{ty:?}: {total} bytes held for a file of {file}");
        // the profile counts every expert's bytes, and a token's flops through `used` of them
        let prof = files.profile(2);
        let experts_bytes: u64 = files
            .index()
            .tensor_names()
            .filter(|(n, _)| n.starts_with("blk.0.") && n.contains("_exps"))
            .map(|(_, t)| t.n_bytes())
            .sum();
        assert!(prof.layer_bytes[0] > experts_bytes);
        let dense_flops = 2.0 * (3 * 256 * 128) as f64 * 2.0;
        let attn_flops = 2.0 * (2 * 256 * 256 + 2 * 256 * 128) as f64;
        let router = 2.0 * (8 * 256) as f64;
        let want = attn_flops + dense_flops + router;
        assert!((prof.layer_flops[0] - want).abs() < 1.0, "{ty:?}: {} flops, want {want}", prof.layer_flops[0]);
    }
}

/// Split layers (llama.cpp's `--n-cpu-moe N`): the routed experts of layers `[0, N)` held in
/// host RAM by each stage's shard, the rest of those layers on the stage's device. The logits are
/// the same bits as with every expert in its layer, prompt and batched decode steps alike, and
/// each stage holds what `predict_split_bytes` said, on its device and in host RAM.
#[test]
fn split_layers_give_the_same_bits_and_the_predicted_memory() {
    let dir = tempfile::tempdir().unwrap();
    for ty in [SynthType::F16, SynthType::Q4K] {
        let files = ModelFiles::open(&synth(dir.path(), ty)).unwrap();
        let stages = DeviceMap::parse("cpu:1,cpu:2").unwrap().stages(3).unwrap();
        let run = |p: &Pipeline| {
            let (mut a, mut b) = (p.new_session().unwrap(), p.new_session().unwrap());
            let mut out = all_logits_of(p, &mut a, &prompt(30));
            p.forward(&mut b, &prompt(7), Logits::Last).unwrap();
            for step in 0..3u32 {
                let rows = p.forward_rows(&mut [&mut a, &mut b], &[5 + step, 40 + step]).unwrap();
                out.extend(rows);
            }
            // two prompts' chunks in one pass (the batch engine's prompt path, where each row's
            // experts compute it alone), then a run each
            let (mut c, mut d) = (p.new_session().unwrap(), p.new_session().unwrap());
            let chunks = [&prompt(11)[..], &prompt(4)[..]];
            if p.reads_prompts_together() {
                out.extend(p.forward_ragged(&mut [&mut c, &mut d], &chunks).unwrap());
            } else {
                out.extend(
                    chunks.iter().zip([&mut c, &mut d]).map(|(ch, s)| {
                        p.forward(s, ch, Logits::Last).unwrap().get(0).unwrap().to_vec1::<f32>().unwrap()
                    }),
                );
            }
            out.extend(p.forward_runs(&mut [&mut c, &mut d, &mut a], &[&[9, 10][..], &[3][..], &[77][..]]).unwrap());
            out
        };
        let whole = Pipeline::load(&files, &stages, 64, |_, _| {}).unwrap();
        let want = run(&whole);
        let unsplit: u64 = whole.report().iter().map(|r| r.weight_bytes).sum();
        for n in [1, 2, 3, 100] {
            let p = Pipeline::load_cpu_moe(&files, &stages, 64, n, |_, _| {}).unwrap();
            let got = run(&p);
            // experts in RAM read prompts together exactly where experts in place do (packed
            // Q4_K: each row alone; F16 through candle's matmul: not)
            assert_eq!(p.reads_prompts_together(), whole.reads_prompts_together(), "{ty:?} --n-cpu-moe {n}");
            assert_eq!(whole.reads_prompts_together(), ty == SynthType::Q4K && files.experts_pack_here());
            let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&got) == bits(&want), "{ty:?} --n-cpu-moe {n}: max |Δ| {}", max_abs_diff(&want, &got));
            let mut held = 0;
            for (r, st) in p.report().iter().zip(&stages) {
                let want = brigade_model::predict_split_bytes(&files, st.layers, st.device, 64, n);
                assert_eq!(
                    (r.weight_bytes, r.host_expert_bytes),
                    (want.weights, want.host_experts),
                    "{ty:?} {n} {st:?}"
                );
                assert_eq!(r.host_expert_bytes > 0, st.layers.start() < n, "{ty:?} {n} {st:?}");
                held += r.weight_bytes + r.host_expert_bytes;
            }
            // nothing held twice, nothing lost: the experts moved, the rest stayed
            assert_eq!(held, unsplit, "{ty:?} --n-cpu-moe {n}");
        }
    }
    // a dense model has no experts to keep in host memory
    let dense = dir.path().join("dense.gguf");
    write_gguf_with(&dense, &shape(), None, SynthType::F32, 3, |_, _| {}).unwrap();
    let files = ModelFiles::open(&dense).unwrap();
    let stages = DeviceMap::parse("cpu:3").unwrap().stages(3).unwrap();
    let err = Pipeline::load_cpu_moe(&files, &stages, 64, 2, |_, _| {}).err().unwrap().to_string();
    assert!(err.contains("no experts"), "{err}");
    assert!(Pipeline::load_cpu_moe(&files, &stages, 64, 0, |_, _| {}).is_ok());
}

/// Every position's logits of `ids` fed to `s` in one pass.
fn all_logits_of(p: &Pipeline, s: &mut brigade_model::Session, ids: &[u32]) -> Vec<Vec<f32>> {
    p.forward(s, ids, Logits::All).unwrap().to_vec2().unwrap()
}

/// The GGUF at `path` rewritten with `edit` applied to its metadata and tensor specs (the bytes
/// of a tensor whose spec changes are zeros of the new size).
fn rewritten(path: &Path, out: &Path, edit: impl Fn(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>)) -> PathBuf {
    let bytes = std::fs::read(path).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let mut md: Vec<(String, Value)> = g.keys.iter().map(|k| (k.clone(), g.metadata[k].clone())).collect();
    let orig: Vec<TensorSpec> =
        g.tensors.iter().map(|t| TensorSpec { name: t.name.clone(), dims: t.dims.clone(), dtype: t.dtype }).collect();
    let mut specs = orig.clone();
    edit(&mut md, &mut specs);
    let mut buf = Vec::new();
    brigade_model::gguf::write_gguf(&mut buf, &md, &specs, |i, b| {
        match g.tensors.iter().find(|t| t.name == specs[i].name) {
            Some(t) if t.dims == specs[i].dims => b.extend_from_slice(g.tensor_data(&bytes, t)),
            _ => b.resize(specs[i].n_bytes() as usize, 0),
        }
        Ok(())
    })
    .unwrap();
    std::fs::write(out, buf).unwrap();
    out.to_path_buf()
}

/// A change to a file's metadata and tensor specs.
type Edit = Box<dyn Fn(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>)>;

fn set(md: &mut [(String, Value)], key: &str, v: u32) {
    md.iter_mut().find(|(k, _)| k == key).unwrap().1 = Value::U32(v);
}

#[test]
fn malformed_expert_metadata_is_refused_with_the_field_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = synth(dir.path(), SynthType::Q8_0);
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("no experts", Box::new(|md, _| set(md, "llama.expert_count", 0)), "expert_count"),
        (
            "top-k above experts",
            Box::new(|md, _| set(md, "llama.expert_used_count", 9)),
            "expert_used_count (num_experts_per_tok) 9",
        ),
        (
            "no top-k",
            Box::new(|md, _| set(md, "llama.expert_used_count", 0)),
            "expert_used_count (num_experts_per_tok) 0",
        ),
        ("absurd expert count", Box::new(|md, _| set(md, "llama.expert_count", u32::MAX)), "expert_count"),
        (
            // (each token's rows are held once per expert it uses: the bound sizes a pass)
            "absurd top-k",
            Box::new(|md, _| {
                set(md, "llama.expert_count", 128);
                set(md, "llama.expert_used_count", 65);
            }),
            "expert_used_count (num_experts_per_tok) 65 with 128 experts: each token uses 1 to 64",
        ),
        (
            "a dense gate in a mixture's layer",
            Box::new(|_, specs| {
                let up = specs.iter().find(|t| t.name == "blk.0.ffn_gate_inp.weight").unwrap().clone();
                specs.push(TensorSpec { name: "blk.0.ffn_gate.weight".into(), dims: vec![256, 128], ..up });
            }),
            "tensor `blk.0.ffn_gate.weight`: present, but the layer's feed-forward block is a mixture of experts",
        ),
        (
            "a stacked tensor of 7 experts",
            Box::new(|_, specs| {
                let t = specs.iter_mut().find(|t| t.name == "blk.1.ffn_up_exps.weight").unwrap();
                t.dims[2] = 7;
            }),
            "blk.1.ffn_up_exps.weight",
        ),
        (
            "a stacked tensor of the wrong expert size",
            Box::new(|_, specs| {
                let t = specs.iter_mut().find(|t| t.name == "blk.0.ffn_down_exps.weight").unwrap();
                t.dims[0] = 96;
            }),
            "blk.0.ffn_down_exps.weight",
        ),
        (
            "no router",
            Box::new(|_, specs| specs.retain(|t| t.name != "blk.2.ffn_gate_inp.weight")),
            "blk.2.ffn_gate_inp.weight",
        ),
        (
            "experts in a dense model",
            Box::new(|md, _| md.retain(|(k, _)| k != "llama.expert_count" && k != "llama.expert_used_count")),
            "llama.expert_count",
        ),
    ];
    for (what, edit, want) in cases {
        let path = rewritten(&good, &dir.path().join("bad.gguf"), edit);
        let e = match ModelFiles::open(&path) {
            Ok(_) => panic!("{what}: opened"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "{what}: {e}");
    }
    // and the good file opens
    assert!(ModelFiles::open(&good).is_ok());
}

/// A Qwen2-MoE GGUF without its experts' widths (early Qwen1.5-MoE files) takes llama.cpp's:
/// each expert the feed-forward length over the experts a token uses, the shared expert all of
/// it; where those do not match the tensors, the message says where the width came from.
#[test]
fn qwen_moe_widths_left_out_are_llama_cpps() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = common::family_file("qwen2moe", "qwen2moe-tiny-F16.gguf");
    let m = ModelFiles::open(&fixture).unwrap().config.moe.unwrap();
    assert_eq!((m.ffn, m.used, m.shared_ffn), (128, 2, Some(256)));
    let without = |ffn: u32| {
        move |md: &mut Vec<(String, Value)>, _: &mut Vec<TensorSpec>| {
            md.retain(|(k, _)| {
                k != "qwen2moe.expert_feed_forward_length" && k != "qwen2moe.expert_shared_feed_forward_length"
            });
            set(md, "qwen2moe.feed_forward_length", ffn);
        }
    };
    let path = rewritten(&fixture, &dir.path().join("early.gguf"), without(256));
    let files = ModelFiles::open(&path).unwrap();
    let m = files.config.moe.unwrap();
    assert_eq!((m.ffn, m.shared_ffn), (128, Some(256)));
    // the same numbers as the file that names its widths
    let ids = prompt(12);
    let map = format!("cpu:{}", files.config.n_layers);
    let want = all_logits(&pipeline(&ModelFiles::open(&fixture).unwrap(), &map, 64), &ids);
    assert_eq!(all_logits(&pipeline(&files, &map, 64), &ids), want);
    let path = rewritten(&fixture, &dir.path().join("wrong.gguf"), without(300));
    let e = ModelFiles::open(&path).err().unwrap().to_string();
    assert!(e.contains("each expert's width 150: expert_feed_forward_length"), "{e}");
    let path = rewritten(&fixture, &dir.path().join("zero.gguf"), without(1));
    let e = ModelFiles::open(&path).err().unwrap().to_string();
    assert!(e.contains("feed_forward_length 1 over expert_used_count 2 gives experts of width 0"), "{e}");
}

/// A [`RemoteExperts`] that counts the rows it is sent, in front of a shard.
struct Counted(ExpertShard, AtomicUsize);

impl RemoteExperts for Counted {
    fn call(&self, layer: usize, calls: &[(u32, usize)], xs: &[f32], mm: MatMul) -> Result<ExpertsCall, ModelError> {
        self.1.fetch_add(calls.iter().map(|c| c.1).sum(), Ordering::Relaxed);
        // answered later, as a node elsewhere does
        let ys = self.0.compute(layer, calls, xs, mm)?;
        Ok(ExpertsCall::later(move || Ok(ys)))
    }

    fn rows_independent(&self) -> bool {
        self.0.rows_independent()
    }
}

fn logits(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Experts held by a shard elsewhere (here, in process, as a worker holds them for a node
/// elsewhere) give the same bits as the slice holding them all: a prompt, decode steps fused and
/// on candle's ops, and several sessions' decode rows at once.
#[test]
fn experts_held_elsewhere_give_the_numbers_of_experts_held_here() {
    let dir = tempfile::tempdir().unwrap();
    for (ty, family) in [
        (SynthType::Q4K, SynthMoeFamily::Mixtral),
        (SynthType::F32, SynthMoeFamily::Qwen3Moe),
        (SynthType::Q8_0, SynthMoeFamily::Olmoe),
    ] {
        let path = dir.path().join(format!("moe-{ty:?}-{family:?}.gguf"));
        write_gguf_with(&path, &shape(), Some(SynthMoe { family, ..MOE }), ty, 3, |_, _| {}).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let all = LayerRange::new(0, 3).unwrap();
        let whole = Slice::load(&files, all, &Device::Cpu, DType::F32, 128).unwrap();
        let shard = ExpertShard::load(&files, LayerRange::new(1, 3).unwrap(), 2..6).unwrap();
        assert!(shard.weight_bytes() > 0);
        let remote = Arc::new(Counted(shard, AtomicUsize::new(0)));
        let split = ExpertSplit { elsewhere: vec![(LayerRange::new(1, 3).unwrap(), 2..6)], remote: remote.clone() };
        let mut held = Slice::load_split(&files, all, &Device::Cpu, DType::F32, 128, Some(split)).unwrap();
        assert!(held.weight_bytes() < whole.weight_bytes(), "{ty:?}: the experts elsewhere are not held here");
        let ids = prompt(20);
        for fused in [true, false] {
            held.set_fused_decode(fused);
            let (mut a, mut b) = (whole.new_cache().unwrap(), held.new_cache().unwrap());
            let want = logits(&whole.forward(&mut a, StageInput::Tokens(&ids), Logits::All).unwrap());
            let sent = remote.1.load(Ordering::Relaxed);
            let got = logits(&held.forward(&mut b, StageInput::Tokens(&ids), Logits::All).unwrap());
            assert!(remote.1.load(Ordering::Relaxed) > sent, "{ty:?}: no row went to the experts elsewhere");
            assert_eq!(want, got, "{ty:?}: a prompt");
            for &t in &ids[..6] {
                let want = logits(&whole.forward(&mut a, StageInput::Tokens(&[t]), Logits::Last).unwrap());
                let got = logits(&held.forward(&mut b, StageInput::Tokens(&[t]), Logits::Last).unwrap());
                assert_eq!(want, got, "{ty:?}: a decode step, fused {fused}");
            }
        }
        // three sessions' decode rows in one pass
        let mut caches: Vec<_> = (0..3).map(|_| (whole.new_cache().unwrap(), held.new_cache().unwrap())).collect();
        for (i, (a, b)) in caches.iter_mut().enumerate() {
            let p = &ids[..5 + 3 * i];
            whole.forward(a, StageInput::Tokens(p), Logits::Last).unwrap();
            held.forward(b, StageInput::Tokens(p), Logits::Last).unwrap();
        }
        let step = [7u32, 8, 9];
        let (mut wa, mut hb): (Vec<_>, Vec<_>) = caches.iter_mut().map(|(a, b)| (a, b)).unzip();
        let want = logits(&whole.forward_rows(&mut wa, StageInput::Tokens(&step)).unwrap());
        let got = logits(&held.forward_rows(&mut hb, StageInput::Tokens(&step)).unwrap());
        assert_eq!(want, got, "{ty:?}: decode rows of three sessions");
    }
}

/// A call a shard cannot answer is refused whole, with the numbers: a layer or an expert it
/// does not hold, a row count that does not match the values, no rows; and a shard of experts
/// the model does not have is not loaded.
#[test]
fn a_shard_refuses_calls_it_cannot_answer() {
    let dir = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&synth(dir.path(), SynthType::Q4K)).unwrap();
    let layers = LayerRange::new(1, 3).unwrap();
    let shard = ExpertShard::load(&files, layers, 2..6).unwrap();
    let d = shard.hidden();
    let row = vec![0.5f32; d];
    assert_eq!(shard.compute(1, &[(2, 1)], &row, MatMul::Rows).unwrap().len(), d);
    let refused = |layer, calls: &[(u32, usize)], xs: &[f32]| {
        shard.compute(layer, calls, xs, MatMul::Rows).unwrap_err().to_string()
    };
    assert!(refused(0, &[(2, 1)], &row).contains("layer 0"));
    assert!(refused(1, &[(6, 1)], &row).contains("expert 6"));
    assert!(refused(1, &[(2, 2)], &row).contains(&format!("{d} values for 2 rows")));
    assert!(refused(1, &[(2, 0)], &[]).contains("no rows"));
    assert!(refused(1, &[(2, usize::MAX), (3, 2)], &row).contains("values"));
    for ids in [3..3, 6..9] {
        let e = ExpertShard::load(&files, layers, ids.clone()).err().unwrap().to_string();
        assert!(e.contains("of a model with 8 experts"), "{ids:?}: {e}");
    }
    // a dense model has no experts to hold
    let dense = dir.path().join("dense.gguf");
    write_gguf_with(&dense, &shape(), None, SynthType::Q8_0, 3, |_, _| {}).unwrap();
    let dense = ModelFiles::open(&dense).unwrap();
    assert!(ExpertShard::load(&dense, layers, 0..1).is_err());
    let split = ExpertSplit { elsewhere: vec![(layers, 2..6)], remote: Arc::new(shard) };
    let e = Slice::load_split(&dense, layers, &Device::Cpu, DType::F32, 64, Some(split)).err().unwrap();
    assert!(e.to_string().contains("no experts"), "{e}");
}
