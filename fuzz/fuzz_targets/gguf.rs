//! Feeds arbitrary bytes to the GGUF reader and, when a header parses, to everything that reads
//! it: configuration, tokenizer, tensor checks. Nothing may panic or allocate without bound.
#![no_main]

use brigade_model::gguf::Gguf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = Gguf::parse(data) {
        for t in &g.tensors {
            let _ = g.tensor_data(data, t);
        }
        let _ = brigade_model::ModelConfig::from_gguf(&g, None);
        if let Ok(tk) = brigade_model::Tokenizer::from_gguf(&g) {
            let ids = tk.encode("Hello <s> world ✓", true).unwrap_or_default();
            let _ = tk.decode(&ids, None);
        }
    }
});
