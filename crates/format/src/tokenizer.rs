//! Tokenizers, as llama.cpp reads them from GGUF metadata and as Hugging Face ships them in
//! `tokenizer.json`, with special-token splitting, streaming decode and chat templates.
//!
//! - `llama` (SentencePiece) vocabularies merge adjacent symbols by vocabulary *score*, with byte
//!   fallback. No model of the `tokenizers` crate merges by score the way llama.cpp's SPM
//!   tokenizer does, and brigade has to produce exactly llama.cpp's ids, so that tokenizer is
//!   written here (`Spm`, about a hundred lines).
//! - `gpt2` byte-level BPE vocabularies are built into a `tokenizers` BPE model from the GGUF
//!   tokens and merges, behind the pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre`.
//! - `tokenizer.json` is loaded by the `tokenizers` crate as it is.

use crate::gguf::{Gguf, Value};
use crate::FormatError;
use brigade_core::stop::StopMatcher;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

mod synthetic;
pub use synthetic::{synthetic_bpe_vocab, synthetic_tokenizer_json, CHATML_TEMPLATE};

const SPM_SPACE: &str = "\u{2581}";

// GGUF token types (llama.cpp `llama_token_type`).
const TT_NORMAL: i32 = 1;
const TT_UNKNOWN: i32 = 2;
const TT_CONTROL: i32 = 3;
const TT_USER_DEFINED: i32 = 4;
const TT_UNUSED: i32 = 5;
const TT_BYTE: i32 = 6;

/// SentencePiece-style tokenizer over a vocabulary with scores (llama.cpp's `llm_tokenizer_spm`).
#[derive(Clone)]
struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    byte_ids: [Option<u32>; 256],
    unk: u32,
}

#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    // Max-heap: the highest score first; among equal scores, the leftmost pair.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then_with(|| o.left.cmp(&self.left))
    }
}

struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, ch)) in text.char_indices().enumerate() {
            syms.push(Symbol { start, len: ch.len_utf8(), prev: i.checked_sub(1), next: Some(i + 1) });
        }
        if let Some(last) = syms.last_mut() {
            last.next = None;
        }
        let mut heap = BinaryHeap::new();
        let try_add = |syms: &Vec<Symbol>, heap: &mut BinaryHeap<Bigram>, l: Option<usize>, r: Option<usize>| {
            let (Some(l), Some(r)) = (l, r) else { return };
            let s = &text[syms[l].start..syms[r].start + syms[r].len];
            if let Some(&id) = self.ids.get(s) {
                heap.push(Bigram { score: self.scores[id as usize], left: l, right: r, len: s.len() });
            }
        };
        for i in 1..syms.len() {
            try_add(&syms, &mut heap, Some(i - 1), Some(i));
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (b.left, b.right);
            // Skip stale pairs: one side was merged away or grew since this pair was queued.
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.len {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            syms[l].next = syms[r].next;
            if let Some(n) = syms[r].next {
                syms[n].prev = Some(l);
            }
            let (p, n) = (syms[l].prev, syms[l].next);
            try_add(&syms, &mut heap, p, Some(l));
            try_add(&syms, &mut heap, Some(l), n);
        }
        // A merged symbol is always a token (pairs are only queued when their text is one), so a
        // final symbol is either a token or a single character that falls back to its bytes.
        let mut i = if syms.is_empty() { None } else { Some(0) };
        while let Some(s) = i {
            let piece = &text[syms[s].start..syms[s].start + syms[s].len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().map(|b| self.byte_ids[b as usize].unwrap_or(self.unk))),
            }
            i = syms[s].next;
        }
    }
}

#[derive(Clone)]
enum Inner {
    Spm(Box<Spm>),
    /// Byte-level BPE: a `tokenizers` pipeline without normalizer or post-processor.
    Bpe(Box<tokenizers::Tokenizer>),
    /// A complete `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>),
}

/// A tokenizer with llama.cpp's conventions: special-token splitting, BOS as the file says,
/// per-token byte pieces for streaming, end-of-generation ids and the chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Inner,
    /// The bytes each id prints as (empty for control tokens).
    pieces: Vec<Vec<u8>>,
    /// Control and user-defined tokens, longest first, split out of text before encoding.
    specials: Vec<(String, u32)>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    eog: HashSet<u32>,
    pub add_bos: bool,
    add_space_prefix: bool,
    pub chat_template: Option<String>,
    vocab_size: usize,
}

fn str_array(g: &Gguf, key: &str) -> Result<Vec<String>, FormatError> {
    let arr = g.get(key).and_then(Value::as_array).ok_or_else(|| FormatError::MissingMetadata(key.to_string()))?;
    arr.iter()
        .map(|v| v.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| FormatError::BadMetadata { key: key.to_string(), why: "not an array of strings".into() })
}

/// The per-token array `key` of a vocabulary of `n` tokens, `default` for each when absent.
fn per_token<T: Clone>(
    g: &Gguf,
    key: &str,
    n: usize,
    default: T,
    each: impl Fn(&Value) -> T,
) -> Result<Vec<T>, FormatError> {
    match g.get(key).and_then(Value::as_array) {
        Some(a) if a.len() == n => Ok(a.iter().map(each).collect()),
        Some(a) => {
            Err(FormatError::BadMetadata { key: key.into(), why: format!("{} entries for {n} tokens", a.len()) })
        }
        None => Ok(vec![default; n]),
    }
}

fn opt_id(g: &Gguf, key: &str, n: usize) -> Option<u32> {
    g.get(key).and_then(Value::as_u64).filter(|&v| (v as usize) < n).map(|v| v as u32)
}

/// GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to U+0100 onwards.
fn gpt2_byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('?')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('?')
        };
    }
    table
}

fn byte_level_decode(token: &str, rev: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.len());
    for c in token.chars() {
        match rev.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

fn spm_piece(token: &str) -> Vec<u8> {
    if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')) {
        if hex.len() == 2 {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return vec![b];
            }
        }
    }
    token.replace(SPM_SPACE, " ").into_bytes()
}

/// The regexes llama.cpp splits text with before byte-level BPE, by `tokenizer.ggml.pre`.
fn bpe_pre_regexes(pre: &str) -> Vec<&'static str> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => vec![LLAMA3],
        "qwen2" | "stablelm2" | "deepseek-r1-qwen" => vec![QWEN2],
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            vec![r"\p{N}", GPT2]
        }
        "gpt2" | "gpt-2" | "mpt" | "olmo" | "jais" => vec![GPT2],
        // llama.cpp's fallback for unknown pre-tokenizers
        _ => vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    }
}

/// The special tokens that end a turn in the chat formats brigade's models use (Llama 3's
/// end-of-turn and end-of-message, ChatML, Phi, Gemma, GPT-2's end of text), whichever file
/// format the vocabulary came in; the ids the metadata names as EOS/EOT/EOM come on top.
pub const EOG_TOKENS: [&str; 6] =
    ["<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"];

fn is_eog_text(token: &str) -> bool {
    EOG_TOKENS.contains(&token)
}

fn tk_err(e: impl std::fmt::Display) -> FormatError {
    FormatError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes (`tokenizer.ggml.*`).
    pub fn from_gguf(g: &Gguf) -> Result<Self, FormatError> {
        let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("llama").to_string();
        let tokens = str_array(g, "tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 {
            return Err(FormatError::Tokenizer("the vocabulary is empty".into()));
        }
        let types = per_token(g, "tokenizer.ggml.token_type", n, TT_NORMAL, |v| v.as_i64().unwrap_or(1) as i32)?;
        let is_special = |t: i32| t == TT_CONTROL || t == TT_USER_DEFINED;
        let mut specials: Vec<(String, u32)> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (tok, &t))| is_special(t) && !tok.is_empty())
            .map(|(i, (tok, _))| (tok.clone(), i as u32))
            .collect();
        specials.sort_by_key(|s| std::cmp::Reverse(s.0.len()));

        let bos = opt_id(g, "tokenizer.ggml.bos_token_id", n);
        let eos = opt_id(g, "tokenizer.ggml.eos_token_id", n);
        let mut eog: HashSet<u32> = eos.into_iter().collect();
        for k in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            eog.extend(opt_id(g, k, n));
        }
        for (tok, id) in &specials {
            if is_eog_text(tok) {
                eog.insert(*id);
            }
        }
        let chat_template = g.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_string);
        let flag = |k: &str| g.get(k).and_then(Value::as_bool);

        let (inner, pieces, add_bos, add_space_prefix) = match model.as_str() {
            "llama" | "replit" => {
                let scores = per_token(g, "tokenizer.ggml.scores", n, 0.0, |v| v.as_f64().unwrap_or(0.0) as f32)?;
                let mut ids = HashMap::with_capacity(n);
                let mut byte_ids = [None; 256];
                for (i, (tok, &t)) in tokens.iter().zip(&types).enumerate() {
                    if t == TT_BYTE {
                        if let [b] = spm_piece(tok)[..] {
                            byte_ids[b as usize] = Some(i as u32);
                        }
                    }
                    ids.entry(tok.clone()).or_insert(i as u32);
                }
                let unk = opt_id(g, "tokenizer.ggml.unknown_token_id", n).unwrap_or(0);
                let pieces = tokens
                    .iter()
                    .zip(&types)
                    .map(|(tok, &t)| match t {
                        TT_CONTROL | TT_UNUSED => Vec::new(),
                        TT_UNKNOWN => "\u{2585}".as_bytes().to_vec(),
                        TT_USER_DEFINED => tok.as_bytes().to_vec(),
                        _ => spm_piece(tok),
                    })
                    .collect();
                let spm = Spm { ids, scores, byte_ids, unk };
                (
                    Inner::Spm(Box::new(spm)),
                    pieces,
                    flag("tokenizer.ggml.add_bos_token").unwrap_or(true),
                    flag("tokenizer.ggml.add_space_prefix").unwrap_or(true),
                )
            }
            "gpt2" => {
                let merges = str_array(g, "tokenizer.ggml.merges")?;
                let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default").to_string();
                let vocab: tokenizers::models::bpe::Vocab =
                    tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
                let merges: Vec<(String, String)> = merges
                    .iter()
                    .map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
                    .collect::<Option<_>>()
                    .ok_or_else(|| FormatError::BadMetadata {
                        key: "tokenizer.ggml.merges".into(),
                        why: "an entry is not `a b`".into(),
                    })?;
                let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tk_err)?;
                let mut pre_toks: Vec<PreTokenizerWrapper> = Vec::new();
                for re in bpe_pre_regexes(&pre) {
                    let pattern = SplitPattern::Regex(re.to_string());
                    pre_toks.push(Split::new(pattern, SplitDelimiterBehavior::Isolated, false).map_err(tk_err)?.into());
                }
                pre_toks.push(ByteLevel::new(false, false, false).into());
                let mut tk = tokenizers::Tokenizer::new(bpe);
                tk.with_pre_tokenizer(Some(Sequence::new(pre_toks)));
                let chars = gpt2_byte_chars();
                let rev: HashMap<char, u8> = chars.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
                let pieces = tokens
                    .iter()
                    .zip(&types)
                    .map(|(tok, &t)| match t {
                        TT_CONTROL | TT_UNUSED => Vec::new(),
                        TT_USER_DEFINED => tok.as_bytes().to_vec(),
                        _ => byte_level_decode(tok, &rev),
                    })
                    .collect();
                (Inner::Bpe(Box::new(tk)), pieces, flag("tokenizer.ggml.add_bos_token").unwrap_or(false), false)
            }
            other => {
                return Err(FormatError::Tokenizer(format!(
                    "tokenizer model `{other}` is not supported (llama, gpt2 are)"
                )))
            }
        };
        Ok(Tokenizer {
            inner,
            pieces,
            specials,
            bos,
            eos,
            eog,
            add_bos,
            add_space_prefix,
            chat_template,
            vocab_size: n,
        })
    }

    /// Loads a Hugging Face `tokenizer.json`; `tokenizer_config` is the text of
    /// `tokenizer_config.json` when present (chat template, BOS policy), `config` the model's
    /// `config.json` (BOS/EOS ids).
    pub fn from_hf(
        tokenizer_json: &[u8],
        tokenizer_config: Option<&str>,
        config: Option<&str>,
    ) -> Result<Self, FormatError> {
        let tk = tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(tk_err)?;
        let n = tk.get_vocab_size(true);
        let tc: serde_json::Value = tokenizer_config.and_then(|t| serde_json::from_str(t).ok()).unwrap_or_default();
        let cfg: serde_json::Value = config.and_then(|t| serde_json::from_str(t).ok()).unwrap_or_default();
        let token_text = |v: &serde_json::Value| -> Option<String> {
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
                _ => None,
            }
        };
        let id_of = |field: &str| -> Vec<u32> {
            let mut ids = Vec::new();
            if let Some(t) = tc.get(format!("{field}_token").as_str()).and_then(token_text) {
                ids.extend(tk.token_to_id(&t));
            }
            match cfg.get(format!("{field}_token_id").as_str()) {
                Some(serde_json::Value::Number(x)) => ids.extend(x.as_u64().map(|v| v as u32)),
                Some(serde_json::Value::Array(a)) => ids.extend(a.iter().filter_map(|x| x.as_u64()).map(|v| v as u32)),
                _ => {}
            }
            ids.retain(|&i| (i as usize) < n);
            ids
        };
        let bos = id_of("bos").first().copied();
        let eos_ids = id_of("eos");
        let eos = eos_ids.first().copied();
        let mut eog: HashSet<u32> = eos_ids.into_iter().collect();
        let added = tk.get_added_tokens_decoder();
        let mut specials = Vec::new();
        for (&id, t) in &added {
            if t.special {
                specials.push((t.content.clone(), id));
                if is_eog_text(&t.content) {
                    eog.insert(id);
                }
            }
        }
        specials.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        let vocab = tk.get_vocab(true);
        let mut by_id = vec![String::new(); n];
        for (t, &i) in &vocab {
            if let Some(slot) = by_id.get_mut(i as usize) {
                *slot = t.clone();
            }
        }
        let spm_style = vocab.contains_key("<0x00>") || vocab.keys().any(|t| t.starts_with(SPM_SPACE));
        let chars = gpt2_byte_chars();
        let rev: HashMap<char, u8> = chars.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let special_ids: HashSet<u32> = specials.iter().map(|s| s.1).collect();
        let pieces = by_id
            .iter()
            .enumerate()
            .map(|(i, tok)| {
                if special_ids.contains(&(i as u32)) {
                    Vec::new()
                } else if added.contains_key(&(i as u32)) {
                    tok.as_bytes().to_vec()
                } else if spm_style {
                    spm_piece(tok)
                } else {
                    byte_level_decode(tok, &rev)
                }
            })
            .collect();
        let chat_template = match tc.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(|x| x.as_str()) == Some("default"))
                .or_else(|| a.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        };
        let add_bos = tc.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
        Ok(Tokenizer {
            inner: Inner::Hf(Box::new(tk)),
            pieces,
            specials,
            bos,
            eos,
            eog,
            add_bos,
            add_space_prefix: spm_style,
            chat_template,
            vocab_size: n,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether `id` ends generation (EOS, EOT and friends).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Encodes `text`. With `add_special`, a BOS is prepended when the model asks for one.
    /// Control and user-defined tokens written in the text become their ids, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, FormatError> {
        let mut out = Vec::new();
        if let Inner::Hf(tk) = &self.inner {
            // tokenizer.json carries its own special-token handling and BOS post-processor.
            let enc = tk.encode(text, add_special).map_err(tk_err)?;
            out.extend_from_slice(enc.get_ids());
            return Ok(out);
        }
        if add_special && self.add_bos {
            if let Some(b) = self.bos {
                out.push(b);
            }
        }
        let mut prev_special = true;
        let mut rest = text;
        while !rest.is_empty() {
            // the earliest special token in the rest (longest at that position)
            let mut found: Option<(usize, &str, u32)> = None;
            for (s, id) in &self.specials {
                if let Some(p) = rest.find(s.as_str()) {
                    if found.is_none_or(|(fp, fs, _)| p < fp || (p == fp && s.len() > fs.len())) {
                        found = Some((p, s.as_str(), *id));
                    }
                }
            }
            let (text_part, special) = match found {
                Some((p, s, id)) => (&rest[..p], Some((s, id))),
                None => (rest, None),
            };
            if !text_part.is_empty() {
                // after a text fragment comes either a special token or the end
                self.encode_fragment(text_part, prev_special, &mut out)?;
            }
            match special {
                Some((s, id)) => {
                    out.push(id);
                    prev_special = true;
                    rest = &rest[text_part.len() + s.len()..];
                }
                None => break,
            }
        }
        Ok(out)
    }

    fn encode_fragment(&self, text: &str, prev_special: bool, out: &mut Vec<u32>) -> Result<(), FormatError> {
        match &self.inner {
            Inner::Spm(spm) => {
                let mut t = String::with_capacity(text.len() + 3);
                if self.add_space_prefix && prev_special {
                    t.push(' ');
                }
                t.push_str(text);
                let t = t.replace(' ', SPM_SPACE);
                spm.encode(&t, out);
            }
            Inner::Bpe(tk) | Inner::Hf(tk) => {
                let enc = tk.encode(text, false).map_err(tk_err)?;
                out.extend_from_slice(enc.get_ids());
            }
        }
        Ok(())
    }

    /// The bytes token `id` prints as; empty for control tokens and unknown ids.
    pub fn piece(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The control and user-defined tokens split out of text before encoding: their text and id.
    pub fn specials(&self) -> impl Iterator<Item = (&str, u32)> {
        self.specials.iter().map(|(t, id)| (t.as_str(), *id))
    }

    /// Decodes ids to text as a stream would print them (see [`TextStream`]).
    pub fn decode(&self, ids: &[u32], prev: Option<u32>) -> String {
        let mut s = self.stream(prev);
        let mut out = String::new();
        for &id in ids {
            out.push_str(&s.push(id));
        }
        out.push_str(&s.finish());
        out
    }

    /// A streaming decoder; `prev` is the token before the first one it will see (to apply
    /// SentencePiece's rule that a word-initial space right after BOS is not printed).
    pub fn stream(&self, prev: Option<u32>) -> TextStream<'_> {
        TextStream { tk: self, pending: Vec::new(), prev, shown: Vec::new() }
    }

    /// An answer's text as every API sends it: [`Tokenizer::stream`] cut at the earliest of
    /// `stops` (see [`StopMatcher`]).
    pub fn answer(&self, prev: Option<u32>, stops: Vec<String>) -> AnswerText<'_> {
        AnswerText { text: self.stream(prev), stop: StopMatcher::new(stops) }
    }

    /// [`Tokenizer::answer`] that also prints the control tokens `shown` as their text (a
    /// tool-call marker such as Mistral's `[TOOL_CALLS]`, which a parser must see).
    pub fn answer_showing(&self, prev: Option<u32>, stops: Vec<String>, shown: Vec<u32>) -> AnswerText<'_> {
        AnswerText { text: TextStream { tk: self, pending: Vec::new(), prev, shown }, stop: StopMatcher::new(stops) }
    }

    /// Renders the model's chat template for `(role, content)` messages and a generation prompt.
    pub fn apply_chat_template(&self, messages: &[(String, String)]) -> Result<String, FormatError> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            FormatError::Tokenizer("this model has no chat template (tokenizer.chat_template)".into())
        })?;
        self.render_chat_template(template, messages)
    }

    /// Renders `template` (a Jinja chat template) for `(role, content)` messages and a
    /// generation prompt, with this model's BOS and EOS texts.
    pub fn render_chat_template(&self, template: &str, messages: &[(String, String)]) -> Result<String, FormatError> {
        let msgs: Vec<serde_json::Value> =
            messages.iter().map(|(role, content)| serde_json::json!({"role": role, "content": content})).collect();
        self.render_chat(template, &msgs, None)
    }

    /// Renders `template` for `messages` as OpenAI's API has them (objects with `role`,
    /// `content`, `tool_calls`, `tool_call_id`, ...) and, when given, the `tools` list the
    /// template describes to the model; then a generation prompt. Jinja's `tojson` writes JSON
    /// as Python's `json.dumps` does (`", "` and `": "`, `indent=`), as transformers renders
    /// templates, so a prompt here is the prompt the model was trained on.
    pub fn render_chat(
        &self,
        template: &str,
        messages: &[serde_json::Value],
        tools: Option<&serde_json::Value>,
    ) -> Result<String, FormatError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", python_tojson);
        env.add_template("chat", template).map_err(|e| FormatError::Tokenizer(format!("chat template: {e}")))?;
        let tok_text = |id: Option<u32>| -> String {
            id.map(|i| String::from_utf8_lossy(&self.raw_token(i)).into_owned()).unwrap_or_default()
        };
        let ctx = minijinja::context! {
            messages => minijinja::Value::from_serialize(messages),
            tools => tools.map(minijinja::Value::from_serialize),
            add_generation_prompt => true,
            bos_token => tok_text(self.bos),
            eos_token => tok_text(self.eos),
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| FormatError::Tokenizer(format!("chat template: {e}")))
    }

    /// The id of the control or user-defined token spelled `text`.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.specials.iter().find(|(t, _)| t == text).map(|(_, id)| *id)
    }

    /// The literal text of a special token (for templates), which `piece` hides.
    fn raw_token(&self, id: u32) -> Vec<u8> {
        self.specials
            .iter()
            .find(|(_, i)| *i == id)
            .map(|(s, _)| s.as_bytes().to_vec())
            .unwrap_or_else(|| self.piece(id).to_vec())
    }

    /// Tokenizes a rendered chat prompt: special tokens are parsed, and a BOS is added only
    /// when the template did not write one.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, FormatError> {
        let bos_text = self.bos.map(|b| String::from_utf8_lossy(&self.raw_token(b)).into_owned());
        let has_bos = bos_text.is_some_and(|t| !t.is_empty() && rendered.starts_with(&t));
        self.encode(rendered, !has_bos)
    }
}

/// Jinja's `tojson` as transformers defines it for chat templates: Python's
/// `json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)` — `", "` and `": "` between items, or one item per line under `indent`
/// (then `","`), `ensure_ascii=True` writing `\uXXXX` for what is not ASCII. minijinja's own
/// writes compact, HTML-escaped JSON, which would change the prompt; serde_json has no option
/// for Python's separators or ASCII escaping, hence this small writer.
fn python_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let bad = |why: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {why}"));
    let indent: Option<minijinja::Value> = kwargs.get("indent")?;
    // Python: an int is that many spaces, a string is itself, None is one line
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_usize(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.min(64))),
            (None, Some(s)) => Some(s.to_string()),
            _ => return Err(bad(format!("indent must be a number or a string, not {v}"))),
        },
    };
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some([i, k]) => (i.clone(), k.clone()),
        Some(other) => return Err(bad(format!("separators must be two strings, got {}", other.len()))),
    };
    let json = serde_json::to_value(&value).map_err(|e| bad(e.to_string()))?;
    let w = PyJson { indent, item, key, ascii: ensure_ascii.unwrap_or(false), sort: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    w.write(&json, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

/// Python's `json.dumps` settings.
struct PyJson {
    indent: Option<String>,
    item: String,
    key: String,
    ascii: bool,
    sort: bool,
}

impl PyJson {
    fn string(&self, s: &str, out: &mut String) {
        // serde_json escapes as Python does (`\n`, `\u001f`, ...); ASCII mode escapes the rest
        let quoted = serde_json::Value::String(s.to_string()).to_string();
        if !self.ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }

    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::String(s) => self.string(s, out),
            J::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            J::Object(m) if !m.is_empty() => {
                let mut entries: Vec<(&String, &serde_json::Value)> = m.iter().collect();
                if self.sort {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
            // numbers, booleans, null, and empty containers as serde_json writes them
            other => out.push_str(&other.to_string()),
        }
    }
}

/// Turns token ids into printable text as they arrive: bytes of a character split over several
/// tokens are held back until the character is complete.
pub struct TextStream<'a> {
    tk: &'a Tokenizer,
    pending: Vec<u8>,
    prev: Option<u32>,
    /// Control tokens printed as their text.
    shown: Vec<u32>,
}

impl TextStream<'_> {
    pub fn push(&mut self, id: u32) -> String {
        if self.shown.contains(&id) {
            self.prev = Some(id);
            let mut out = self.finish();
            out.push_str(&String::from_utf8_lossy(&self.tk.raw_token(id)));
            return out;
        }
        let mut piece = self.tk.piece(id);
        if self.tk.add_space_prefix && self.prev.is_some() && self.prev == self.tk.bos && piece.first() == Some(&b' ') {
            piece = &piece[1..];
        }
        self.prev = Some(id);
        self.pending.extend_from_slice(piece);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let s = s.to_string();
                self.pending.clear();
                s
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // an invalid sequence (not just an incomplete one) is printed lossily now
                let cut = if e.error_len().is_some() { self.pending.len() } else { valid };
                let out = String::from_utf8_lossy(&self.pending[..cut]).into_owned();
                self.pending.drain(..cut);
                out
            }
        }
    }

    /// Whatever is still held back, lossily.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Generated ids to the text an API sends: characters whole, nothing of a stop string and
/// nothing after it. One definition for `serve`, the coordinator's HTTP API and the cluster's
/// driver (gRPC), so a stop string cuts the same text wherever it is given.
pub struct AnswerText<'a> {
    text: TextStream<'a>,
    stop: StopMatcher,
}

impl AnswerText<'_> {
    /// The text id `id` releases (empty while held back, and after a stop string).
    pub fn push(&mut self, id: u32) -> String {
        let piece = self.text.push(id);
        self.stop.push(&piece)
    }

    /// Pushes ids whose text was already sent (a session resumed after a failover): afterwards
    /// the state is as if they had just been pushed, and what they released is dropped.
    pub fn replay(&mut self, ids: &[u32]) {
        for &id in ids {
            self.push(id);
        }
    }

    /// Whether a stop string was found.
    pub fn stopped(&self) -> bool {
        self.stop.stopped()
    }

    /// The end of the answer: whatever is still held back (an incomplete character, lossily;
    /// text that began no stop string after all).
    pub fn finish(&mut self) -> String {
        let tail = self.text.finish();
        let mut out = self.stop.push(&tail);
        out.push_str(&self.stop.finish());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection() {
        let t = gpt2_byte_chars();
        let set: HashSet<char> = t.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[b' ' as usize], '\u{120}');
    }

    #[test]
    fn spm_pieces() {
        assert_eq!(spm_piece("<0x0A>"), b"\n");
        assert_eq!(spm_piece("\u{2581}Once"), b" Once");
        assert_eq!(spm_piece("<0xZZ>"), b"<0xZZ>");
    }

    #[test]
    fn one_list_of_end_of_generation_tokens() {
        // a vocabulary with Llama 3's end-of-message token, as tokenizer.json and as GGUF metadata
        let mut j: serde_json::Value = serde_json::from_str(&synthetic_tokenizer_json(300).unwrap()).unwrap();
        let added = serde_json::json!({"id": 300, "content": "<|eom_id|>", "single_word": false, "lstrip": false,
                                       "rstrip": false, "normalized": false, "special": true});
        j["added_tokens"].as_array_mut().unwrap().push(added);
        j["model"]["vocab"]["<|eom_id|>"] = serde_json::json!(300);
        let hf = Tokenizer::from_hf(j.to_string().as_bytes(), None, None).unwrap();

        let (mut tokens, mut types, merges) = synthetic_bpe_vocab(300);
        tokens.push("<|eom_id|>".into());
        types.push(TT_CONTROL);
        let strings =
            |v: Vec<String>| crate::gguf::Value::Array(v.into_iter().map(crate::gguf::Value::String).collect());
        let md = vec![
            ("tokenizer.ggml.model".to_string(), crate::gguf::Value::String("gpt2".into())),
            ("tokenizer.ggml.tokens".to_string(), strings(tokens)),
            (
                "tokenizer.ggml.token_type".to_string(),
                crate::gguf::Value::Array(types.into_iter().map(crate::gguf::Value::I32).collect()),
            ),
            ("tokenizer.ggml.merges".to_string(), strings(merges)),
        ];
        let mut bytes = Vec::new();
        crate::gguf::write_gguf(&mut bytes, &md, &[], |_, _| Ok(())).unwrap();
        let gguf = Tokenizer::from_gguf(&Gguf::parse(&bytes).unwrap()).unwrap();

        assert!(hf.is_eog(300) && gguf.is_eog(300), "<|eom_id|> ends generation");
        assert!(hf.is_eog(299) && !hf.is_eog(298), "<|im_end|> does, <|im_start|> does not");
        for id in 0..=300 {
            assert_eq!(hf.is_eog(id), gguf.is_eog(id), "token {id}");
        }
    }

    #[test]
    fn templates_get_tools_and_pythons_tojson() {
        let g = Gguf::parse(crate::embedded_model()).unwrap();
        let tk = Tokenizer::from_gguf(&g).unwrap();
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "b": [1, 2], "a": "é<&>"}}]);
        let msgs = [
            serde_json::json!({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {"x": 1}}}]}),
        ];
        let t = "{{ tools | tojson }}|{{ messages[0].tool_calls[0].function.arguments | tojson(indent=2) }}|{{ messages[0].role }}";
        // insertion order kept, Python's separators, nothing HTML-escaped, `indent=`
        assert_eq!(
            tk.render_chat(t, &msgs, Some(&tools)).unwrap(),
            "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"b\": [1, 2], \"a\": \"é<&>\"}}]|{\n  \"x\": 1\n}|assistant"
        );
        // transformers' other arguments: ASCII escaping, sorted keys, separators
        let t = "{{ tools | tojson(ensure_ascii=True, sort_keys=True) }}|{{ tools[0].function | tojson(separators=(',', ':')) }}";
        assert_eq!(
            tk.render_chat(t, &msgs, Some(&tools)).unwrap(),
            "[{\"function\": {\"a\": \"\\u00e9<&>\", \"b\": [1, 2], \"name\": \"f\"}, \"type\": \"function\"}]|{\"name\":\"f\",\"b\":[1,2],\"a\":\"é<&>\"}"
        );
        assert!(tk.render_chat("{{ tools | tojson(colour=1) }}", &msgs, Some(&tools)).is_err());
        // no tools: the template sees none
        assert_eq!(
            tk.render_chat("{{ tools is none }}{{ tools | length if tools else 0 }}", &msgs, None).unwrap(),
            "True0"
        );
        assert_eq!(tk.special_id("<s>"), tk.bos);
    }

    #[test]
    fn an_answer_is_cut_at_its_stop_and_a_replayed_answer_goes_on_alike() {
        let g = Gguf::parse(crate::embedded_model()).unwrap();
        let tk = Tokenizer::from_gguf(&g).unwrap();
        let prompt = tk.encode("Once upon a time", true).unwrap();
        let ids = tk.encode(" there was a little girl named Lily. She loved to play outside.", false).unwrap();
        let prev = prompt.last().copied();
        let whole = tk.decode(&ids, prev);
        // a stop that begins inside one token and ends inside another
        let at = whole.find("girl").unwrap() + 2;
        let stop = whole[at..at + 6].to_string();
        let run = |skip: usize| -> (String, bool) {
            let mut a = tk.answer(prev, vec![stop.clone()]);
            a.replay(&ids[..skip]);
            let mut out: String = ids[skip..].iter().map(|&id| a.push(id)).collect();
            out.push_str(&a.finish());
            (out, a.stopped())
        };
        let (cut, stopped) = run(0);
        assert!(stopped);
        assert_eq!(cut, whole[..at], "the text before the stop, nothing of it");
        // resumed after k ids: what the first answer sent after its k-th id, exactly
        for k in 0..ids.len() {
            let mut a = tk.answer(prev, vec![stop.clone()]);
            let sent_before: String = ids[..k].iter().map(|&id| a.push(id)).collect();
            let (rest, stopped) = run(k);
            assert_eq!(format!("{sent_before}{rest}"), cut, "resumed after {k} ids");
            assert!(stopped, "after {k}");
        }
        let mut free = tk.answer(prev, vec!["zebra".into()]);
        let mut text: String = ids.iter().map(|&id| free.push(id)).collect();
        text.push_str(&free.finish());
        assert_eq!((text, free.stopped()), (whole, false));
    }
}
