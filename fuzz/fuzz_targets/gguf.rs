//! Feeds arbitrary bytes to the GGUF reader and, when a header parses, to everything that reads
//! it: configuration, tokenizer; then opens them as a model (tensor checks) and builds its
//! manifest, profile and every slice's ranges. Nothing may panic or allocate without bound.
//!
//! `cargo fuzz run gguf fuzz/corpus/gguf fuzz/seeds/gguf`: the seed is a whole tiny model
//! (written by crates/format/tests/fuzz_seed.rs), so mutations start past the header.
#![no_main]

use brigade_core::LayerRange;
use brigade_format::gguf::Gguf;
use brigade_format::{Manifest, ModelConfig, ModelIndex, Tokenizer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = Gguf::parse(data) {
        for t in &g.tensors {
            let _ = g.tensor_data(data, t);
        }
        let _ = ModelConfig::from_gguf(&g, None);
        if let Ok(tk) = Tokenizer::from_gguf(&g) {
            let ids = tk.encode("Hello <s> world ✓", true).unwrap_or_default();
            let _ = tk.decode(&ids, None);
        }
    }
    let Ok(m) = ModelIndex::from_gguf_vec(data.to_vec(), "fuzz.gguf") else {
        return;
    };
    assert!(m.check_tensors().is_ok(), "an opened model passed its checks");
    let man = Manifest::build(&m);
    let _ = man.id();
    let n = m.config().n_layers;
    let _ = (m.profile(2), m.device_profile(2, false, 2), m.total_bytes(), m.n_params(), m.weight_types());
    for (a, b) in [(0, n), (0, 1), (n - 1, n), (n / 2, n), (1, n + 1)] {
        if let Ok(layers) = LayerRange::new(a, b) {
            let _ = man.slice_ranges(&m, layers);
        }
    }
});
