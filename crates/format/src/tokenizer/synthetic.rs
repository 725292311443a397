//! Synthetic byte-level BPE vocabularies for random-weight models, as GGUF metadata and as a
//! `tokenizer.json`.

use super::{gpt2_byte_chars, tk_err, TT_CONTROL, TT_NORMAL};
use crate::FormatError;
use std::collections::HashSet;

/// Builds the metadata of a byte-level BPE vocabulary (GPT-2 style) for synthetic models:
/// 256 byte tokens, merges up to `vocab - n_special` tokens, then `<|begin_of_text|>`,
/// `<|end_of_text|>`, `<|im_start|>`, `<|im_end|>`. Returns (tokens, types, merges).
pub fn synthetic_bpe_vocab(vocab: usize) -> (Vec<String>, Vec<i32>, Vec<String>) {
    const SPECIALS: [&str; 4] = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"];
    let chars = gpt2_byte_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let mut seen: HashSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::new();
    let target = vocab.saturating_sub(SPECIALS.len()).max(256);
    // Deterministic pairs: common letters first (so text tokenizes into multi-byte tokens),
    // then combinations of earlier tokens.
    let alpha: Vec<String> = "etaoinshrdlucmfwypvbgkjqxz".chars().map(|c| c.to_string()).collect();
    let space = chars[b' ' as usize].to_string();
    let mut candidates: Vec<(String, String)> = Vec::new();
    for a in &alpha {
        candidates.push((space.clone(), a.clone()));
    }
    for a in &alpha {
        for b in &alpha {
            candidates.push((a.clone(), b.clone()));
        }
    }
    let mut ci = 0usize;
    let mut k = 0u64;
    while tokens.len() < target {
        let (a, b) = if ci < candidates.len() {
            ci += 1;
            candidates[ci - 1].clone()
        } else {
            // a cheap deterministic walk over earlier tokens
            k = k.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let n = tokens.len() as u64;
            let i = ((k >> 33) % n) as usize;
            let j = ((k >> 13) % n.min(4096)) as usize;
            (tokens[i].clone(), tokens[j].clone())
        };
        let joined = format!("{a}{b}");
        if joined.chars().count() > 16 || !seen.insert(joined.clone()) {
            continue;
        }
        merges.push(format!("{a} {b}"));
        tokens.push(joined);
    }
    let mut types = vec![TT_NORMAL; tokens.len()];
    for s in SPECIALS {
        tokens.push(s.to_string());
        types.push(TT_CONTROL);
    }
    (tokens, types, merges)
}

/// The ChatML template brigade writes into synthetic models.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A `tokenizer.json` equal to [`synthetic_bpe_vocab`] (for safetensors directories).
pub fn synthetic_tokenizer_json(vocab: usize) -> Result<String, FormatError> {
    let (tokens, types, merges) = synthetic_bpe_vocab(vocab);
    let mut v = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        v.insert(t.clone(), serde_json::json!(i));
    }
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &t))| t == TT_CONTROL)
        .map(|(i, (t, _))| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let j = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": v, "merges": merges}
    });
    serde_json::to_string(&j).map_err(tk_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_vocab_has_requested_size() {
        let (t, ty, m) = synthetic_bpe_vocab(1000);
        assert_eq!(t.len(), 1000);
        assert_eq!(ty.len(), 1000);
        assert_eq!(m.len(), 1000 - 256 - 4);
        let uniq: HashSet<&String> = t.iter().collect();
        assert_eq!(uniq.len(), 1000);
    }
}
