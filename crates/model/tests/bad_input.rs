//! Hostile and broken model files: each is a clear error, never a panic, never a huge allocation.

#![allow(clippy::unwrap_used)]
mod common;
use brigade_model::gguf::{self, Gguf, GgufError, TensorSpec, Value};
use brigade_model::{ModelError, ModelFiles};
use std::path::Path;

/// A GGUF header written field by field, so any field can be a lie.
struct Raw(Vec<u8>);
impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut v = b"GGUF".to_vec();
        v.extend(version.to_le_bytes());
        v.extend(n_tensors.to_le_bytes());
        v.extend(n_kv.to_le_bytes());
        Raw(v)
    }
    fn str(mut self, s: &str) -> Raw {
        self.0.extend((s.len() as u64).to_le_bytes());
        self.0.extend(s.as_bytes());
        self
    }
    fn u32(mut self, x: u32) -> Raw {
        self.0.extend(x.to_le_bytes());
        self
    }
    fn u64(mut self, x: u64) -> Raw {
        self.0.extend(x.to_le_bytes());
        self
    }
    fn pad(mut self, n: usize) -> Raw {
        self.0.extend(vec![0u8; n]);
        self
    }
}

fn open_bytes(bytes: &[u8]) -> Result<ModelFiles, ModelError> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, bytes).unwrap();
    ModelFiles::open(&p)
}

fn stories_bytes() -> Vec<u8> {
    brigade_model::embedded_model().to_vec()
}

#[test]
fn truncated_files_are_errors() {
    let full = stories_bytes();
    let g = Gguf::parse(&full).unwrap();
    let data_end = g.tensors.iter().map(|t| t.offset + t.n_bytes).max().unwrap() as usize;
    let cuts: Vec<usize> =
        (0..4096).chain((4096..full.len()).step_by(997)).chain([data_end - 1, full.len() - 1]).collect();
    for n in cuts {
        match Gguf::parse(&full[..n]) {
            Ok(_) => assert!(n >= data_end, "a file cut at {n} of {} parsed", full.len()),
            Err(e) => assert!(
                matches!(
                    e,
                    GgufError::Truncated { .. }
                        | GgufError::DataPastEnd { .. }
                        | GgufError::AbsurdCount { .. }
                        | GgufError::BadMagic { .. }
                ),
                "cut at {n}: {e}"
            ),
        }
    }
    let err = open_bytes(&full[..full.len() / 2]).err().unwrap();
    assert!(err.to_string().contains("past the end"), "{err}");
}

#[test]
fn wrong_magic_and_version() {
    let mut b = stories_bytes();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(Gguf::parse(&b), Err(GgufError::BadMagic { .. })));
    let e = open_bytes(b"this is a text file, not a model\n").err().unwrap();
    assert!(e.to_string().contains("not a GGUF file"), "{e}");
    let e = open_bytes(b"").err().unwrap().to_string();
    assert!(e.contains("truncated: magic needs 4 bytes at offset 0, the file has 0"), "{e}");
    let mut b = stories_bytes();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(Gguf::parse(&b), Err(GgufError::UnsupportedVersion(1))));
}

#[test]
fn absurd_counts_and_lengths() {
    // tensor and kv counts far beyond what the file could hold
    assert!(matches!(Gguf::parse(&Raw::new(3, u64::MAX, 0).pad(64).0), Err(GgufError::AbsurdCount { .. })));
    assert!(matches!(Gguf::parse(&Raw::new(3, 0, 1 << 50).pad(64).0), Err(GgufError::AbsurdCount { .. })));
    // a key whose length is 2^63
    let r = Raw::new(3, 0, 1).u64(1 << 63).pad(32);
    assert!(matches!(Gguf::parse(&r.0), Err(GgufError::Truncated { .. })));
    // a string value claiming 1 TiB
    let r = Raw::new(3, 0, 1).str("general.name").u32(8).u64(1 << 40).pad(32);
    assert!(matches!(Gguf::parse(&r.0), Err(GgufError::Truncated { .. })));
    // an array claiming 2^60 u32 elements
    let r = Raw::new(3, 0, 1).str("a").u32(9).u32(4).u64(1 << 60).pad(32);
    assert!(matches!(Gguf::parse(&r.0), Err(GgufError::AbsurdCount { .. })));
    // an unknown value type
    let r = Raw::new(3, 0, 1).str("a").u32(77).pad(32);
    assert!(matches!(Gguf::parse(&r.0), Err(GgufError::UnknownValueType { .. })));
    // arrays of arrays of arrays
    let r = Raw::new(3, 0, 1).str("a").u32(9).u32(9).u64(1).u32(9).u64(1).u32(9).u64(1).pad(64);
    assert!(matches!(Gguf::parse(&r.0), Err(GgufError::TooDeep { .. })));
}

#[test]
fn absurd_tensor_infos() {
    let tensor = |n_dims: u32, dims: &[u64], ty: u32, offset: u64| {
        let mut r = Raw::new(3, 1, 0).str("blk.0.attn_q.weight").u32(n_dims);
        for d in dims {
            r = r.u64(*d);
        }
        r.u32(ty).u64(offset).pad(512)
    };
    assert!(matches!(Gguf::parse(&tensor(9, &[1; 9], 0, 0).0), Err(GgufError::TooManyDims { .. })));
    assert!(matches!(Gguf::parse(&tensor(0, &[], 0, 0).0), Err(GgufError::TooManyDims { .. })));
    assert!(matches!(Gguf::parse(&tensor(2, &[1 << 40, 1 << 40], 0, 0).0), Err(GgufError::BadDims { .. })));
    assert!(matches!(Gguf::parse(&tensor(2, &[0, 4], 0, 0).0), Err(GgufError::BadDims { .. })));
    // q4_0 rows must be whole 32-element blocks
    assert!(matches!(Gguf::parse(&tensor(2, &[33, 2], 2, 0).0), Err(GgufError::BadDims { .. })));
    let e = Gguf::parse(&tensor(2, &[32, 2], 99, 0).0).err().unwrap();
    assert!(matches!(e, GgufError::UnknownTensorType { type_id: 99, .. }));
    assert!(e.to_string().contains("blk.0.attn_q.weight"));
    // data past the end of the file, and an offset that overflows
    assert!(matches!(Gguf::parse(&tensor(2, &[32, 2], 0, 1 << 20).0), Err(GgufError::DataPastEnd { .. })));
    assert!(matches!(
        Gguf::parse(&tensor(2, &[32, 2], 0, u64::MAX - 31).0),
        Err(GgufError::DataPastEnd { .. }) | Err(GgufError::Misaligned { .. })
    ));
    assert!(matches!(Gguf::parse(&tensor(2, &[32, 2], 0, 3).0), Err(GgufError::Misaligned { .. })));
    // a correct one parses
    assert!(Gguf::parse(&tensor(2, &[32, 2], 0, 0).0).is_ok());
}

/// Rewrites the stories file with `edit` applied to its metadata and tensor list.
fn rewrite(edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>)) -> Vec<u8> {
    let full = stories_bytes();
    let g = Gguf::parse(&full).unwrap();
    let mut md: Vec<(String, Value)> = g.keys.iter().map(|k| (k.clone(), g.metadata[k].clone())).collect();
    let mut specs: Vec<TensorSpec> =
        g.tensors.iter().map(|t| TensorSpec { name: t.name.clone(), dims: t.dims.clone(), dtype: t.dtype }).collect();
    edit(&mut md, &mut specs);
    let mut out = Vec::new();
    gguf::write_gguf(&mut out, &md, &specs, |i, buf| {
        match g.tensor(&specs[i].name) {
            Some(t) if t.dims == specs[i].dims && t.dtype == specs[i].dtype => {
                buf.extend_from_slice(g.tensor_data(&full, t))
            }
            _ => buf.resize(specs[i].n_bytes() as usize, 0),
        }
        Ok(())
    })
    .unwrap();
    out
}

#[test]
fn rewritten_file_still_loads() {
    let b = rewrite(|_, _| {});
    assert!(open_bytes(&b).is_ok());
}

#[test]
fn missing_and_misshapen_tensors() {
    let b = rewrite(|_, t| t.retain(|s| s.name != "blk.3.ffn_up.weight"));
    let e = open_bytes(&b).err().unwrap();
    assert!(matches!(e, ModelError::MissingTensor(ref n) if n == "blk.3.ffn_up.weight"), "{e}");
    let b = rewrite(|_, t| {
        for s in t.iter_mut().filter(|s| s.name == "blk.1.attn_k.weight") {
            s.dims = vec![64, 64];
        }
    });
    let e = open_bytes(&b).err().unwrap();
    assert!(e.to_string().contains("blk.1.attn_k.weight") && e.to_string().contains("shape"), "{e}");
}

#[test]
fn absurd_hyperparameters() {
    for (key, v, want) in [
        ("llama.block_count", Value::U32(1 << 30), "implausible shape: 1073741824 layers"),
        ("llama.attention.head_count", Value::U32(0), "zero attention heads"),
        ("llama.attention.head_count_kv", Value::U32(3), "8 attention heads cannot be grouped over 3 kv heads"),
        (
            "llama.embedding_length",
            Value::String("big".into()),
            "`llama.embedding_length` is invalid: String(\"big\") is not a count",
        ),
        ("general.architecture", Value::String("gpt-j".into()), "architecture `gpt-j` is not supported"),
        ("tokenizer.ggml.model", Value::String("wordpiece".into()), "tokenizer model `wordpiece` is not supported"),
    ] {
        let b = rewrite(|md, _| {
            for e in md.iter_mut().filter(|e| e.0 == key) {
                e.1 = v.clone();
            }
        });
        let e = open_bytes(&b).err().unwrap_or_else(|| panic!("{key} = {v:?} was accepted"));
        assert!(e.to_string().contains(want), "{key} = {v:?}: `{e}` lacks `{want}`");
    }
    let b = rewrite(|md, _| md.retain(|e| e.0 != "llama.block_count"));
    assert!(matches!(open_bytes(&b), Err(ModelError::MissingMetadata(ref k)) if k == "llama.block_count"));
}

fn write_small_hf(dir: &Path) {
    use brigade_model::synth::{write_safetensors_dir, Shape, SynthType};
    let shape =
        Shape { layers: 2, hidden: 64, ffn: 128, heads: 4, kv_heads: 2, vocab: 300, context: 256, rope_theta: 1e4 };
    write_safetensors_dir(dir, &shape, SynthType::F16, 1, |_, _| {}).unwrap();
}

#[test]
fn safetensors_headers_that_lie() {
    let dir = tempfile::tempdir().unwrap();
    write_small_hf(dir.path());
    assert!(ModelFiles::open(dir.path()).is_ok());
    let st = dir.path().join("model.safetensors");
    let good = std::fs::read(&st).unwrap();
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(good[8..8 + n].to_vec()).unwrap();

    let try_with = |bytes: Vec<u8>| -> String {
        std::fs::write(&st, bytes).unwrap();
        let e = ModelFiles::open(dir.path()).err().expect("a lying header was accepted").to_string();
        assert!(e.starts_with("invalid model file: ") && e.contains("model.safetensors: "), "{e}");
        e
    };
    // header length beyond the file
    let mut b = good.clone();
    b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(try_with(b).contains("header too large"));
    // offsets that point past the data
    let lie = header.replacen("\"data_offsets\":[0,", "\"data_offsets\":[0,9", 1);
    let mut b = (lie.len() as u64).to_le_bytes().to_vec();
    b.extend(lie.as_bytes());
    b.extend(&good[8 + n..]);
    assert!(try_with(b).contains("invalid shape, data type, or offset"));
    // a shape that does not match the bytes
    let lie = header.replacen("[64]", "[65]", 1);
    let mut b = (lie.len() as u64).to_le_bytes().to_vec();
    b.extend(lie.as_bytes());
    b.extend(&good[8 + n..]);
    assert!(try_with(b).contains("invalid shape, data type, or offset"));
    // not JSON at all
    let mut b = 16u64.to_le_bytes().to_vec();
    b.extend(b"{{{{{{{{{{{{{{{{");
    assert!(try_with(b).contains("invalid JSON in header"));
    // truncated data
    assert!(try_with(good[..good.len() - 10].to_vec()).contains("incomplete metadata, file not fully covered"));
    std::fs::write(&st, &good).unwrap();
    assert!(ModelFiles::open(dir.path()).is_ok());
    // no config.json
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let e = ModelFiles::open(dir.path()).err().unwrap().to_string();
    assert!(e.contains("config.json"), "{e}");
}
