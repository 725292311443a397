//! Fixtures of the format crate's tests: a tiny Hugging Face directory written from the layer
//! table, and sparse copies of a model written from its manifest.
#![allow(dead_code, clippy::unwrap_used)]

use brigade_core::cluster::RangeRecord;
use brigade_format::config::ModelConfig;
use brigade_format::tensors::{gguf_to_hf_name, LayerTensor, OUTPUT, OUTPUT_NORM, TOKEN_EMBD};
use brigade_format::tokenizer::synthetic_tokenizer_json;
use brigade_format::{Format, Manifest, ModelIndex};
use serde_json::{json, Value};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A Llama `config.json` of 3 layers, hidden 64, 4 heads over 2 kv heads, ffn 96, vocab 300.
pub fn tiny_config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "torch_dtype": "float32"
    })
}

/// Writes a Hugging Face directory for `config`: `config.json`, `tokenizer.json`, and f32 weights
/// for every tensor the layer table gives (plus `extra` tensors, less those `keep` refuses),
/// split over `shards` safetensors files by layer. Each tensor's values differ.
pub fn write_hf_dir(
    dir: &Path,
    config: &Value,
    shards: usize,
    extra: &[(&str, Vec<usize>)],
    keep: impl Fn(&str) -> bool,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap() as usize;
    std::fs::write(dir.join("tokenizer.json"), synthetic_tokenizer_json(vocab).unwrap()).unwrap();
    let mut c: ModelConfig = ModelConfig::from_hf_json(&config.to_string()).unwrap();
    c.layer.qkv_bias = true; // every bias of the table; `keep` drops what a case does not want (q/k norms as the family has them)
    let mut tensors: Vec<(String, Vec<usize>, usize)> = vec![
        (TOKEN_EMBD.into(), vec![c.vocab, c.hidden], 0),
        (OUTPUT_NORM.into(), vec![c.hidden], shards - 1),
        (OUTPUT.into(), vec![c.vocab, c.hidden], shards - 1),
    ];
    for i in 0..c.n_layers {
        for t in LayerTensor::required_in(&c) {
            tensors.push((t.name(i), t.shape(&c).unwrap(), i * shards / c.n_layers));
        }
    }
    tensors.extend(extra.iter().map(|(n, s)| (n.to_string(), s.clone(), 0)));
    for shard in 0..shards {
        let owned: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .enumerate()
            .filter(|(_, (_, _, s))| *s == shard)
            .map(|(k, (name, shape, _))| (gguf_to_hf_name(name).unwrap_or(name.clone()), shape, k))
            .filter(|(hf, _, _)| keep(hf))
            .map(|(hf, shape, k)| {
                let n: usize = shape.iter().product();
                let bytes = (0..n).flat_map(|j| (((j * 7 + k * 13) % 29) as f32 / 29.0 - 0.5).to_le_bytes()).collect();
                (hf, shape.clone(), bytes)
            })
            .collect();
        let views: Vec<_> = owned
            .iter()
            .map(|(n, s, b)| {
                (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
            })
            .collect();
        let name = format!("model-{:05}-of-{shards:05}.safetensors", shard + 1);
        safetensors::serialize_to_file(views, None, &dir.join(name)).unwrap();
    }
}

/// Writes the files of `manifest` into `dir` at their full sizes, holding only `ranges` (copied
/// from `src`); the rest stays zero (holes). Returns the path to open.
pub fn write_sparse(src: &ModelIndex, manifest: &Manifest, ranges: &[RangeRecord], dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for (name, size) in manifest.files() {
        std::fs::File::create(dir.join(name)).unwrap().set_len(*size).unwrap();
    }
    for r in ranges {
        let file = src.files().iter().find(|f| f.name() == r.file).unwrap();
        let bytes = &file.bytes()[r.offset as usize..(r.offset + r.length) as usize];
        let mut f = std::fs::OpenOptions::new().write(true).open(dir.join(&r.file)).unwrap();
        f.seek(SeekFrom::Start(r.offset)).unwrap();
        f.write_all(bytes).unwrap();
    }
    match src.format() {
        Format::Gguf => dir.join(&manifest.files()[0].0),
        Format::Safetensors => dir.to_path_buf(),
    }
}

/// A GGUF Llama of `layers` layers, hidden size `hidden` (heads of 4), ffn `2 × hidden`, a
/// vocabulary of `vocab` rows and an 8-token SentencePiece tokenizer; f32 weights.
pub fn tiny_gguf(layers: usize, hidden: usize, vocab: usize) -> Vec<u8> {
    use brigade_format::gguf::{write_gguf, GgmlType, TensorSpec, Value};
    let u = |k: &str, v: usize| (k.to_string(), Value::U32(v as u32));
    let tokens = ["<unk>", "<s>", "</s>", "\u{2581}", "a", "b", "\u{2581}a", "ab"];
    let md = vec![
        ("general.architecture".to_string(), Value::String("llama".into())),
        u("llama.block_count", layers),
        u("llama.embedding_length", hidden),
        u("llama.feed_forward_length", 2 * hidden),
        u("llama.attention.head_count", hidden / 4),
        u("llama.attention.head_count_kv", 1),
        u("llama.context_length", 64),
        u("llama.vocab_size", vocab),
        ("tokenizer.ggml.model".to_string(), Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(tokens.iter().map(|t| Value::String(t.to_string())).collect()),
        ),
        ("tokenizer.ggml.scores".to_string(), Value::Array((0..8).map(|i| Value::F32(-(i as f32))).collect())),
        ("tokenizer.ggml.token_type".to_string(), Value::Array([2, 3, 3, 1, 1, 1, 1, 1].map(Value::I32).to_vec())),
        u("tokenizer.ggml.bos_token_id", 1),
        u("tokenizer.ggml.eos_token_id", 2),
    ];
    let g = brigade_format::gguf::Gguf::parse(&{
        let mut b = Vec::new();
        write_gguf(&mut b, &md, &[], |_, _| Ok(())).unwrap();
        b
    })
    .unwrap();
    // the configuration the metadata gives, for the table's shapes
    let mut c = ModelConfig::from_gguf(&g, None).unwrap();
    c.layer.qkv_bias = false;
    let mut shapes = vec![(TOKEN_EMBD.to_string(), vec![vocab, hidden])];
    for i in 0..layers {
        shapes.extend(LayerTensor::required_in(&c).map(|t| (t.name(i), t.shape(&c).unwrap())));
    }
    shapes.push((OUTPUT_NORM.into(), vec![hidden]));
    shapes.push((OUTPUT.into(), vec![vocab, hidden]));
    let specs: Vec<TensorSpec> = shapes
        .iter()
        .map(|(name, s)| TensorSpec {
            name: name.clone(),
            dims: s.iter().rev().map(|&d| d as u64).collect(),
            dtype: GgmlType::F32,
        })
        .collect();
    let mut out = Vec::new();
    write_gguf(&mut out, &md, &specs, |i, buf| {
        let n = specs[i].n_bytes() as usize / 4;
        buf.extend((0..n).flat_map(|j| (((i * 31 + j * 7) % 17) as f32 / 17.0).to_le_bytes()));
        Ok(())
    })
    .unwrap();
    out
}
