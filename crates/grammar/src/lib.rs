//! Constrained decoding: what an answer must spell — any JSON object, a JSON schema, a Lark
//! grammar — compiled against a model's vocabulary and enforced token by token.
//!
//! The engine is llguidance (the one llama.cpp's LLGUIDANCE builds and vLLM use): it keeps an
//! Earley parser over the grammar and a trie of the vocabulary's byte strings, and computes
//! the set of ids that may come next in tens of microseconds for a 100k-token vocabulary. Not
//! written by hand: a schema compiler and a token-level parser of this quality are years of
//! work, and the crate is maintained.
//!
//! - [`Vocabulary`]: a model's tokens as llguidance sees them (built once per model).
//! - [`Vocabulary::compile`]: a [`Format`] to a [`Grammar`], whose errors name what is wrong.
//! - [`Grammar`] implements [`brigade_core::TokenConstraint`]: the sampler masks the logits with
//!   it and tells it each id drawn.
//!
//! JSON is compiled without free whitespace (`", "` and `": "` between items), so an answer
//! cannot run on in blanks: with a schema whose strings and arrays are bounded, every answer
//! ends, whatever the model and the temperature.
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

use brigade_core::TokenConstraint;
use brigade_format::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;

/// What an answer must be. Its JSON form (serde's) is what a cluster's driver sends its last
/// stage: `"JsonObject"`, `{"JsonSchema": …}`, `{"Lark": "…"}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Format {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A value valid under this JSON schema (`{"type": "json_schema", "json_schema": {"schema": …}}`).
    JsonSchema(Value),
    /// Text of a grammar in llguidance's Lark syntax.
    Lark(String),
}

/// Why a format cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The schema or grammar does not compile; the text is llguidance's (it names the part).
    #[error("{0}")]
    Compile(String),
    /// The model's vocabulary cannot be used (no end-of-generation token, or llguidance refused it).
    #[error("the model's vocabulary cannot be constrained: {0}")]
    Vocabulary(String),
}

/// A model's vocabulary as the grammar engine reads it: each id's bytes, the special tokens
/// marked as llguidance expects, the end-of-generation id. Build once per model (a large
/// vocabulary takes a fraction of a second) and compile every request's format against it.
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
}

impl Vocabulary {
    /// The vocabulary of `tok` (a model may have more logits than its tokenizer has tokens:
    /// those ids are never allowed).
    pub fn new(tok: &Tokenizer) -> Result<Self, GrammarError> {
        let n = tok.vocab_size();
        let eos = tok.eos.ok_or_else(|| GrammarError::Vocabulary("it names no end-of-sequence token".into()))?;
        let mut words: Vec<Vec<u8>> = (0..n as u32).map(|id| tok.piece(id).to_vec()).collect();
        // special tokens are 0xFF + their text for llguidance (a grammar names them so, and
        // never spells them from bytes)
        for (text, id) in tok.specials() {
            if let Some(w) = words.get_mut(id as usize) {
                *w = [&[TokTrie::SPECIAL_TOKEN_MARKER][..], text.as_bytes()].concat();
            }
        }
        let info = TokRxInfo { tok_bos: tok.bos, ..TokRxInfo::new(n as u32, eos) };
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        // llguidance's own logging to stderr off: its errors come back as values
        factory.set_stderr_log_level(0);
        Ok(Vocabulary { factory: Arc::new(factory) })
    }

    /// Compiles `format` for one answer.
    pub fn compile(&self, format: &Format) -> Result<Grammar, GrammarError> {
        let top = match format {
            Format::JsonObject => TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))),
            Format::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError::Compile(format!("a JSON schema is an object, not {schema}")));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Format::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(|e| GrammarError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(Grammar { matcher })
    }
}

/// `schema` with llguidance's JSON options: no free whitespace, `", "` and `": "` between items
/// (as models write JSON). A schema's own `x-guidance` options win.
fn compact(mut schema: Value) -> Value {
    let ours = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    if let Value::Object(m) = &mut schema {
        let entry = m.entry("x-guidance").or_insert_with(|| json!({}));
        if let (Value::Object(theirs), Value::Object(ours)) = (entry, ours) {
            for (k, v) in ours {
                theirs.entry(k).or_insert(v);
            }
        }
    }
    schema
}

/// One answer's constraint: where it is in the grammar.
pub struct Grammar {
    matcher: Matcher,
}

impl Grammar {
    /// The ids allowed next, as a list (tests and reports; the sampler uses [`TokenConstraint::mask`]).
    pub fn allowed(&mut self) -> Result<Vec<u32>, String> {
        let mask = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        let mut ids = Vec::new();
        mask.iter_set_entries(|i| ids.push(i as u32));
        Ok(ids)
    }
}

impl TokenConstraint for Grammar {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let mask = self.matcher.compute_mask().map_err(|e| format!("the grammar: {e}"))?;
        if mask.is_zero() {
            return Err("the grammar allows no token here".into());
        }
        // (ids past the tokenizer's vocabulary, a model's padding rows, are never allowed)
        for (i, l) in logits.iter_mut().enumerate() {
            if i >= mask.len() || !mask.get(i) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn commit(&mut self, id: u32) -> Result<(), String> {
        self.matcher.consume_token(id).map_err(|e| format!("the grammar refused token {id}: {e}"))
    }

    fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn boxed_clone(&self) -> Box<dyn TokenConstraint> {
        Box::new(Grammar { matcher: self.matcher.deep_clone() })
    }
}
