//! Manifests: checksummed ranges that cover a model, a stable content id, and sparse copies
//! (headers + one slice's tensors) that open like the model and hold that slice exactly.
#![allow(clippy::unwrap_used)]
mod common;

use brigade_core::LayerRange;
use brigade_format::manifest::{range_matches, sha256_hex};
use brigade_format::tensors::slice_tensors;
use brigade_format::{FormatError, Manifest, ModelIndex};
use common::*;

fn range(a: usize, b: usize) -> LayerRange {
    LayerRange::new(a, b).unwrap()
}

#[test]
fn sha256_is_sha256() {
    // FIPS 180-2's "abc"
    assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

#[test]
fn the_embedded_manifest_covers_the_file() {
    let m = ModelIndex::embedded().unwrap();
    let man = Manifest::build(&m);
    let len = m.files()[0].len();
    assert_eq!(man.files(), &[("stories260K.gguf".to_string(), len)]);
    assert_eq!(man.ranges().len(), 1 + 48);
    let header = &man.ranges()[0];
    assert_eq!((header.offset, header.tensor.as_str()), (0, ""));
    assert_eq!(Some(header.length), m.gguf().map(|g| g.data_start));
    assert!(range_matches(header, &m.files()[0].bytes()[..header.length as usize]));
    // tensors by offset, each range its tensor's bytes, no two overlapping
    let mut end = header.length;
    for r in &man.ranges()[1..] {
        let t = m.tensor_info(&r.tensor).unwrap();
        assert_eq!((r.offset, r.length), (t.start(), t.n_bytes()), "{}", r.tensor);
        assert!(r.offset >= end, "{} overlaps the range before it", r.tensor);
        end = r.offset + r.length;
        assert!(range_matches(r, m.tensor_data(&r.tensor).unwrap()));
        assert!(!range_matches(r, &m.tensor_data(&r.tensor).unwrap()[1..]));
    }
    assert!(end <= len);
    // the same bytes give the same manifest and id, whatever the label
    let again =
        Manifest::build(&ModelIndex::from_gguf_vec(m.files()[0].bytes().to_vec(), "x/stories260K.gguf").unwrap());
    assert_eq!(again, man);
    assert_eq!(again.id(), man.id());
    assert_eq!(man.id().len(), 64);
    let json = serde_json::to_string(&man).unwrap();
    assert_eq!(serde_json::from_str::<Manifest>(&json).unwrap(), man);
}

#[test]
fn one_changed_byte_changes_one_range_and_the_id() {
    let m = ModelIndex::embedded().unwrap();
    let man = Manifest::build(&m);
    let t = m.tensor_info("blk.2.ffn_up.weight").unwrap();
    let mut bytes = m.files()[0].bytes().to_vec();
    bytes[t.start() as usize + 5] ^= 1;
    let changed = Manifest::build(&ModelIndex::from_gguf_vec(bytes, "stories260K.gguf").unwrap());
    let differ: Vec<&str> =
        man.ranges().iter().zip(changed.ranges()).filter(|(a, b)| a != b).map(|(a, _)| a.tensor.as_str()).collect();
    assert_eq!(differ, ["blk.2.ffn_up.weight"]);
    assert_ne!(changed.id(), man.id());
}

#[test]
fn slice_ranges_are_headers_and_the_slice() {
    let m = ModelIndex::embedded().unwrap();
    let man = Manifest::build(&m);
    let r = man.slice_ranges(&m, range(1, 3)).unwrap();
    assert_eq!(r.len(), 1 + 18);
    assert!(r[0].tensor.is_empty());
    let names: Vec<String> = r[1..].iter().map(|r| r.tensor.clone()).collect();
    let mut want = slice_tensors(&m, range(1, 3)).unwrap();
    want.sort();
    let mut got = names.clone();
    got.sort();
    assert_eq!(got, want);
    assert!(matches!(man.ranges_for(&["blk.9.attn_q.weight".to_string()]), Err(FormatError::MissingTensor(_))));
    assert!(matches!(man.slice_ranges(&m, range(4, 6)), Err(FormatError::BadSlice(_))));
}

/// Writes the sparse copy of `layers`, opens it, and checks it holds the slice's tensors exactly
/// and the other tensors not at all.
fn check_sparse_copy(m: &ModelIndex, layers: LayerRange, dir: &std::path::Path) {
    let man = Manifest::build(m);
    let ranges = man.slice_ranges(m, layers).unwrap();
    let path = write_sparse(m, &man, &ranges, dir);
    let copy = ModelIndex::open(&path).unwrap_or_else(|e| panic!("the sparse copy of {layers} does not open: {e}"));
    assert_eq!(copy.config(), m.config());
    assert_eq!(Manifest::build(&copy).files(), man.files());
    let slice = slice_tensors(m, layers).unwrap();
    for r in man.ranges().iter().filter(|r| !r.tensor.is_empty()) {
        let held = range_matches(r, copy.tensor_data(&r.tensor).unwrap());
        assert_eq!(held, slice.contains(&r.tensor), "{layers}: {}", r.tensor);
    }
    assert_eq!(
        copy.tokenizer().encode("Once upon a time", true).unwrap(),
        m.tokenizer().encode("Once upon a time", true).unwrap()
    );
}

#[test]
fn sparse_gguf_copies_open_and_hold_their_slice() {
    let m = ModelIndex::embedded().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (a, b) in [(0, 2), (2, 4), (4, 5), (0, 5)] {
        check_sparse_copy(&m, range(a, b), &dir.path().join(format!("{a}-{b}")));
    }
}

#[test]
fn sparse_safetensors_copies_open_and_hold_their_slice() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("model");
    let mut c = tiny_config();
    c["tie_word_embeddings"] = true.into();
    write_hf_dir(&src, &c, 2, &[], |n| !n.contains("bias") && n != "lm_head.weight");
    let m = ModelIndex::open(&src).unwrap();
    let man = Manifest::build(&m);
    let names: Vec<&str> = man.files().iter().map(|f| f.0.as_str()).collect();
    assert_eq!(
        names,
        ["config.json", "tokenizer.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    );
    // the JSON files whole, each safetensors header, then its tensors
    for f in ["config.json", "tokenizer.json"] {
        let r: Vec<_> = man.ranges().iter().filter(|r| r.file == f).collect();
        assert_eq!((r.len(), r[0].offset, r[0].length), (1, 0, std::fs::metadata(src.join(f)).unwrap().len()));
    }
    let shard = &man.ranges().iter().find(|r| r.file == names[2]).unwrap();
    let st = std::fs::read(src.join(names[2])).unwrap();
    assert_eq!(shard.length, 8 + u64::from_le_bytes(st[..8].try_into().unwrap()));
    for (a, b) in [(0, 1), (1, 2), (2, 3)] {
        check_sparse_copy(&m, range(a, b), &dir.path().join(format!("{a}-{b}")));
    }
}

/// A stacked expert tensor is one range per expert (llama.cpp's OLMoE file): each range is that
/// expert's bytes, named `tensor#E`; asking for the tensor gives all of them; a sparse copy of
/// some experts holds exactly those. A checkpoint's experts are tensors of their own already.
#[test]
fn stacked_experts_are_a_range_each() {
    use brigade_format::manifest::{expert_of_range, range_tensor};
    use brigade_format::LayerTensor as T;
    let path = repo_root().join("tests/fixtures/families/olmoe/olmoe-tiny-Q4_K_M.gguf");
    let m = ModelIndex::open(&path).unwrap();
    let experts = m.config().moe.unwrap().experts;
    let man = Manifest::build(&m);
    let name = T::FfnUpExps.name(1);
    let pieces: Vec<_> = man.ranges().iter().filter(|r| range_tensor(&r.tensor) == name).collect();
    assert_eq!(pieces.len(), experts);
    let whole = m.tensor_info(&name).unwrap();
    assert_eq!(pieces[0].offset, whole.start());
    assert_eq!(pieces.iter().map(|r| r.length).sum::<u64>(), whole.n_bytes());
    for (e, r) in pieces.iter().enumerate() {
        assert_eq!(r.tensor, format!("{name}#{e}"));
        assert_eq!(expert_of_range(&r.tensor), Some((1, e as u32)));
        assert!(range_matches(r, m.expert_data(1, T::FfnUpExps, e).unwrap().2), "{}", r.tensor);
    }
    assert_eq!(expert_of_range(&T::AttnQ.name(1)), None);
    assert_eq!(expert_of_range("blk.2.ffn_up.5.weight"), Some((2, 5)));
    assert_eq!(expert_of_range("blk.2.attn_q.weight#5"), None, "only stacked tensors are cut by expert");
    assert_eq!(man.ranges_for(std::slice::from_ref(&name)).unwrap().len(), 1 + experts);
    // a copy of experts 2..5 of layer 1: those read back, the others do not
    let ranges: Vec<_> = man
        .ranges()
        .iter()
        .filter(|r| {
            r.tensor.is_empty() || expert_of_range(&r.tensor).is_some_and(|(l, e)| l == 1 && (2..5).contains(&e))
        })
        .cloned()
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let copy = ModelIndex::open(&write_sparse(&m, &man, &ranges, dir.path())).unwrap();
    for t in [T::FfnGateExps, T::FfnUpExps, T::FfnDownExps] {
        for e in 0..experts {
            let r = man.ranges().iter().find(|r| r.tensor == format!("{}#{e}", t.name(1))).unwrap();
            let held = range_matches(r, copy.expert_data(1, t, e).unwrap().2);
            assert_eq!(held, (2..5).contains(&e), "{}", r.tensor);
        }
    }
}
