//! The tensor table of an opened model: what `check_tensors` accepts, what a slice reads, and
//! the bytes a device will hold.
#![allow(clippy::unwrap_used)]
mod common;

use brigade_core::LayerRange;
use brigade_format::tensors::{slice_tensors, OUTPUT, TOKEN_EMBD};
use brigade_format::{FormatError, GgmlType, ModelIndex, StoredType};
use common::*;
use std::collections::HashSet;

fn range(a: usize, b: usize) -> LayerRange {
    LayerRange::new(a, b).unwrap()
}

#[test]
fn the_embedded_model_opens() {
    let m = ModelIndex::embedded().unwrap();
    let c = m.config();
    assert_eq!((c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.vocab), (5, 64, 8, 4, 512));
    assert_eq!(m.tensor_names().count(), 48);
    assert_eq!(m.files().len(), 1);
    assert_eq!(m.files()[0].name(), "stories260K.gguf");
    assert_eq!(m.files()[0].header_len(), m.gguf().map(|g| g.data_start));
    assert_eq!(m.dense_type(), Some(GgmlType::F32));
    for (name, t) in m.tensor_names() {
        assert_eq!(m.tensor_data(name).unwrap().len() as u64, t.n_bytes(), "{name}");
        assert_eq!(t.n_elements() * 4, t.n_bytes(), "{name} is f32");
    }
    assert!(matches!(m.tensor_data("blk.9.attn_q.weight"), Err(FormatError::MissingTensor(_))));
    // an untied model's profile accounts for every tensor once
    let p = m.profile(4);
    assert!(!p.tied);
    assert_eq!(p.layer_bytes.iter().sum::<u64>() + p.head_bytes + p.embed_bytes, m.total_bytes());
    assert_eq!(p.kv_bytes_per_token, 2 * 4 * 8 * 4);
    assert_eq!(
        m.weight_types(),
        vec![(StoredType::Ggml(GgmlType::F32), 5 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 172) * 4)]
    );
}

#[test]
fn slices_read_each_tensor_once() {
    let m = ModelIndex::embedded().unwrap();
    let all: HashSet<String> = m.tensor_names().map(|(n, _)| n.clone()).collect();
    for cut in 1..5 {
        let a = slice_tensors(&m, range(0, cut)).unwrap();
        let b = slice_tensors(&m, range(cut, 5)).unwrap();
        let (sa, sb): (HashSet<_>, HashSet<_>) = (a.iter().cloned().collect(), b.iter().cloned().collect());
        assert_eq!(sa.len(), a.len(), "a name twice in {a:?}");
        assert!(sa.is_disjoint(&sb), "cut {cut}");
        assert_eq!(&sa | &sb, all, "cut {cut}");
    }
    let middle = slice_tensors(&m, range(1, 3)).unwrap();
    assert_eq!(middle.len(), 18);
    assert!(middle.iter().all(|n| n.starts_with("blk.1.") || n.starts_with("blk.2.")));
    assert!(matches!(slice_tensors(&m, range(3, 6)), Err(FormatError::BadSlice(_))));
}

#[test]
fn heads_are_tied_as_the_configuration_says() {
    let dir = tempfile::tempdir().unwrap();
    let open = |name: &str, tie: Option<bool>, lm_head: bool| {
        let mut c = tiny_config();
        if let Some(t) = tie {
            c["tie_word_embeddings"] = t.into();
        }
        let p = dir.path().join(name);
        write_hf_dir(&p, &c, 1, &[], |n| !n.contains("bias") && (lm_head || n != "lm_head.weight"));
        ModelIndex::open(&p)
    };
    // no head stored: tied
    let m = open("tied", None, false).unwrap();
    assert!(m.tied_head() && m.profile(4).tied);
    assert_eq!(slice_tensors(&m, range(2, 3)).unwrap().iter().filter(|n| *n == TOKEN_EMBD).count(), 1);
    // tie_word_embeddings wins over a stored copy of the head, as in transformers
    let m = open("tied-with-copy", Some(true), true).unwrap();
    assert!(m.tied_head() && m.tensor_info(OUTPUT).is_none());
    // an untied model without its head is an error, not a silent tie
    let e = open("untied-without-head", Some(false), false).err();
    assert!(matches!(e, Some(FormatError::MissingTensor(ref n)) if n == OUTPUT), "{e:?}");
    let m = open("untied", Some(false), true).unwrap();
    assert!(!m.tied_head());
    assert!(slice_tensors(&m, range(2, 3)).unwrap().contains(&OUTPUT.to_string()));
}

#[test]
fn biases_are_where_the_configuration_says() {
    let dir = tempfile::tempdir().unwrap();
    // a Llama without attention biases whose layer 1 stores one: nothing would read it
    let p = dir.path().join("stray-bias");
    write_hf_dir(&p, &tiny_config(), 1, &[], |n| !n.contains("bias") || n == "model.layers.1.self_attn.k_proj.bias");
    let e = ModelIndex::open(&p).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("blk.1.attn_k.bias") && e.contains("no q/k/v biases"), "{e}");
    // Qwen2 needs them all
    let mut qwen = tiny_config();
    qwen["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    let p = dir.path().join("qwen-without");
    write_hf_dir(&p, &qwen, 1, &[], |n| !n.contains("bias"));
    assert!(matches!(ModelIndex::open(&p), Err(FormatError::MissingTensor(ref n)) if n == "blk.0.attn_q.bias"));
    let p = dir.path().join("qwen");
    write_hf_dir(&p, &qwen, 1, &[], |_| true);
    let m = ModelIndex::open(&p).unwrap();
    assert_eq!(slice_tensors(&m, range(1, 2)).unwrap().len(), 12);
    // buffers of old checkpoints that brigade does not read are left out of the table
    let p = dir.path().join("rotary");
    write_hf_dir(&p, &tiny_config(), 1, &[("model.layers.0.self_attn.rotary_emb.inv_freq", vec![8])], |n| {
        !n.contains("bias")
    });
    let m = ModelIndex::open(&p).unwrap();
    assert_eq!(m.tensor_names().count(), 3 + 3 * 9);
}

#[test]
fn phi3_projections_are_one_matrix_each() {
    let dir = tempfile::tempdir().unwrap();
    let mut phi3 = tiny_config();
    phi3["architectures"] = serde_json::json!(["Phi3ForCausalLM"]);
    // the checkpoint's gate_up_proj is llama.cpp's ffn_up (the fixture of crates/model/tests
    // reads a real one)
    let name = brigade_format::tensors::hf_to_gguf_name("model.layers.3.mlp.gate_up_proj.weight");
    assert_eq!(name.as_deref(), Some("blk.3.ffn_up.weight"));
    let p = dir.path().join("phi3");
    write_hf_dir(&p, &phi3, 1, &[], |n| !n.contains("bias"));
    let m = ModelIndex::open(&p).unwrap();
    let c = m.config();
    assert!(c.layer.fused_qkv && c.layer.fused_gate_up);
    assert_eq!(m.tensor_info("blk.2.attn_qkv.weight").unwrap().shape(), &[64 + 2 * 32, 64]);
    assert_eq!(m.tensor_info("blk.2.ffn_up.weight").unwrap().shape(), &[2 * 96, 64]);
    assert!(m.tensor_info("blk.2.ffn_gate.weight").is_none() && m.tensor_info("blk.2.attn_q.weight").is_none());
    // a separate q beside the fused matrix: nothing would read it
    let p = dir.path().join("phi3-with-q");
    write_hf_dir(&p, &phi3, 1, &[("model.layers.0.self_attn.q_proj.weight", vec![64, 64])], |n| !n.contains("bias"));
    let e = ModelIndex::open(&p).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("blk.0.attn_q.weight") && e.contains("one matrix"), "{e}");
}

#[test]
fn qk_norms_are_where_the_family_says() {
    let dir = tempfile::tempdir().unwrap();
    let mut qwen3 = tiny_config();
    qwen3["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
    qwen3["head_dim"] = 32.into(); // explicit, not hidden / heads (16)
                                   // Qwen3 has a q and a k norm of head_dim weights in every layer
    let p = dir.path().join("qwen3");
    write_hf_dir(&p, &qwen3, 1, &[], |n| !n.contains("bias"));
    let m = ModelIndex::open(&p).unwrap();
    assert!(m.config().layer.qk_norm);
    assert_eq!(m.tensor_info("blk.1.attn_k_norm.weight").unwrap().shape(), &[32]);
    assert_eq!(m.tensor_info("blk.1.attn_q.weight").unwrap().shape(), &[4 * 32, 64]);
    let p = dir.path().join("qwen3-without");
    write_hf_dir(&p, &qwen3, 1, &[], |n| !n.contains("bias") && n != "model.layers.1.self_attn.k_norm.weight");
    let e = ModelIndex::open(&p).err();
    assert!(matches!(e, Some(FormatError::MissingTensor(ref n)) if n == "blk.1.attn_k_norm.weight"), "{e:?}");
    // a Llama that stores a q norm: nothing would apply it
    let p = dir.path().join("llama-with-norm");
    write_hf_dir(&p, &tiny_config(), 1, &[("model.layers.0.self_attn.q_norm.weight", vec![8])], |n| {
        !n.contains("bias")
    });
    let e = ModelIndex::open(&p).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("blk.0.attn_q_norm.weight") && e.contains("no q/k norms"), "{e}");
}

#[test]
fn device_bytes_follow_the_stored_form() {
    let f32 = ModelIndex::embedded().unwrap();
    let q8 = ModelIndex::open(&repo_root().join("tests/fixtures/stories260K-Q8_0.gguf")).unwrap();
    let (q, norm) = ("blk.0.attn_q.weight", "blk.0.attn_norm.weight");
    // the CPU keeps every stored form; norms are dense in the activation type everywhere
    assert_eq!(f32.device_bytes(q, true, 4), 64 * 64 * 4);
    assert_eq!(q8.device_bytes(q, true, 4), 64 * 64 / 32 * 34);
    assert_eq!(q8.device_bytes(norm, true, 4), 64 * 4);
    // a GPU computing in bf16: float weights become bf16, quantized ones stay
    assert_eq!(f32.device_bytes(q, false, 2), 64 * 64 * 2);
    assert_eq!(q8.device_bytes(q, false, 2), 64 * 64 / 32 * 34);
    assert_eq!(q8.device_bytes(norm, false, 2), 64 * 2);
    assert_eq!(q8.device_bytes("no.such.tensor", false, 2), 0);
    assert_eq!(q8.dense_type(), None);
    let p = f32.device_profile(2, false, 2);
    assert_eq!(p.layer_bytes.iter().sum::<u64>() + p.head_bytes + p.embed_bytes, f32.total_bytes() / 2);
}
