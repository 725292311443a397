//! The fuzz target's seed: a whole (tiny) model, so that mutations reach the configuration,
//! tokenizer, tensor checks and manifest rather than stopping at the header. The file in
//! `fuzz/seeds/gguf/` is what [`tiny_gguf`] writes (regenerate with `BRIGADE_BLESS=1`).
#![allow(clippy::unwrap_used)]
mod common;

use brigade_core::LayerRange;
use brigade_format::{Manifest, ModelIndex};
use common::*;

#[test]
fn the_fuzz_seed_is_a_whole_model() {
    let bytes = tiny_gguf(2, 4, 8);
    let m = ModelIndex::from_gguf_vec(bytes.clone(), "tiny.gguf").unwrap();
    assert_eq!((m.config().n_layers, m.config().head_dim), (2, 4));
    assert_eq!(m.tokenizer().encode("a ab", true).unwrap(), [1, 6, 6, 5]);
    let man = Manifest::build(&m);
    assert_eq!(man.slice_ranges(&m, LayerRange::new(1, 2).unwrap()).unwrap().len(), 1 + 9 + 2);
    let path = repo_root().join("fuzz/seeds/gguf/tiny.gguf");
    if std::env::var_os("BRIGADE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &bytes).unwrap();
    }
    assert_eq!(std::fs::read(&path).ok(), Some(bytes), "{} is stale: rerun with BRIGADE_BLESS=1", path.display());
}

#[test]
fn large_models_hash_in_parallel_to_the_same_digests() {
    // 2 × 70000 × 64 f32: 36 MB, above the size hashed on one thread
    let m = ModelIndex::from_gguf_vec(tiny_gguf(2, 64, 70_000), "big.gguf").unwrap();
    let man = Manifest::build(&m);
    assert!(man.files()[0].1 > 32 << 20);
    for r in man.ranges() {
        let f = &m.files()[0].bytes()[r.offset as usize..(r.offset + r.length) as usize];
        assert_eq!(brigade_format::manifest::sha256_hex(f), r.sha256, "{}", r.tensor);
    }
}
