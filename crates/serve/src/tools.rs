//! Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): the request's tools
//! checked, the chat template given them, the answer's constraint when a call is forced, and
//! the model's text turned back into `tool_calls` — whole or as it streams.
//!
//! A model writes calls in the format it was trained on, which its chat template shows:
//! - [`Style::Hermes`] (Qwen 2.5/3, Hermes, SmolLM3): `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`;
//! - [`Style::Llama3`] (Llama 3.1–3.3): the whole answer is `{"name": …, "parameters": …}`;
//! - [`Style::Mistral`]: `[TOOL_CALLS][{"name": …, "arguments": …}, …]`;
//! - [`Style::Generic`], for a template that does not render tools: the tools are described in
//!   a system message and the answer is one JSON object, `{"tool_calls": [...]}` or
//!   `{"response": "…"}`, enforced by the grammar engine (as llama.cpp's generic format).
//!
//! `tool_choice` `required` or a named function constrains the answer to calls (to that
//! function) whose arguments follow the function's parameter schema; `auto` leaves the model
//! free in the native styles (a call is recognised in its text) and lets the generic style
//! choose between its two shapes; `none` renders no tools.

use crate::error::ApiError;
use brigade_format::Tokenizer;
use brigade_grammar::Format;
use serde_json::{json, Map, Value};

/// How a model writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Hermes,
    Llama3,
    Mistral,
    Generic,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_MARK: &str = "[TOOL_CALLS]";
const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";
/// The name of the tool rendered to see whether a template shows tools at all.
const PROBE: &str = "brigade_probe_tool_7f3a";

impl Style {
    /// The style `template` trains its model to (the generic one when it renders no tools).
    pub fn of(tk: &Tokenizer, template: &str) -> Style {
        let native = if template.contains(HERMES_OPEN) {
            Style::Hermes
        } else if template.contains(MISTRAL_MARK) {
            Style::Mistral
        } else if template.contains("<|start_header_id|>") && template.contains("ipython") {
            Style::Llama3
        } else {
            return Style::Generic;
        };
        let probe = json!([{"type": "function", "function": {"name": PROBE, "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}]);
        let msgs = [json!({"role": "user", "content": "hi"})];
        match tk.render_chat(template, &msgs, Some(&probe)) {
            Ok(text) if text.contains(PROBE) => native,
            _ => Style::Generic,
        }
    }

    /// The text that opens a call (held back while it may be forming).
    fn marker(self) -> Option<&'static str> {
        match self {
            Style::Hermes => Some(HERMES_OPEN),
            Style::Mistral => Some(MISTRAL_MARK),
            Style::Llama3 => Some(LLAMA_PYTHON_TAG),
            Style::Generic => None,
        }
    }

    /// Control tokens the answer's text must show (a parser has to see them).
    pub fn shown_ids(self, tk: &Tokenizer) -> Vec<u32> {
        match self {
            Style::Hermes => [HERMES_OPEN, HERMES_CLOSE].iter().filter_map(|t| tk.special_id(t)).collect(),
            Style::Mistral => tk.special_id(MISTRAL_MARK).into_iter().collect(),
            Style::Llama3 => tk.special_id(LLAMA_PYTHON_TAG).into_iter().collect(),
            Style::Generic => Vec::new(),
        }
    }

    /// A call id as the model's template accepts it in the history (Mistral's: 9 letters and
    /// digits).
    pub fn call_id(self, seed: u64, index: usize) -> String {
        let mut x = seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut next = || {
            x ^= x >> 30;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 27;
            const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
            ALNUM[(x % ALNUM.len() as u64) as usize] as char
        };
        match self {
            Style::Mistral => (0..9).map(|_| next()).collect(),
            _ => format!("call_{}", (0..24).map(|_| next()).collect::<String>()),
        }
    }
}

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    /// Its parameters' JSON schema (an object schema; `{"type": "object"}` when not given).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub functions: Vec<Function>,
    /// The `tools` array as sent (what the template renders).
    pub raw: Value,
    pub choice: Choice,
    /// More than one call per answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// A tool name as OpenAI accepts it: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Tools {
    /// Checks `tools`, `tool_choice` and `parallel_tool_calls`. `None`: no tools in play (none
    /// given, or `tool_choice: "none"`).
    pub fn parse(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Tools>, ApiError> {
        let list = match tools {
            None | Some(Value::Null) => &[][..],
            Some(Value::Array(a)) => a.as_slice(),
            Some(other) => return Err(ApiError::bad_param("tools", format!("`tools` is a list, not {other}"))),
        };
        let mut functions: Vec<Function> = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let bad = |why: String| ApiError::bad_param("tools", format!("tools[{i}]: {why}"));
            let kind = t.get("type").and_then(Value::as_str).unwrap_or("");
            if kind != "function" {
                return Err(bad(format!("`type` must be \"function\", got {:?}", t.get("type"))));
            }
            let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| bad("`function` is missing".into()))?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| bad("`function.name` is missing".into()))?;
            if !valid_name(name) {
                return Err(bad(format!("the name {name:?} is not 1 to 64 letters, digits, `_` or `-`")));
            }
            if functions.iter().any(|g| g.name == name) {
                return Err(bad(format!("a second function named {name:?}")));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(other) => return Err(bad(format!("`parameters` must be a JSON schema object, got {other}"))),
            };
            functions.push(Function { name: name.to_string(), parameters });
        }
        let choice = match choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(ApiError::bad_param(
                        "tool_choice",
                        format!("`tool_choice` {other:?} is not one of none, auto, required or a function"),
                    ))
                }
            },
            Some(v) => {
                let name = v
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        ApiError::bad_param(
                            "tool_choice",
                            format!("`tool_choice` must be a string or {{\"type\": \"function\", \"function\": {{\"name\": …}}}}, got {v}"),
                        )
                    })?;
                if !functions.iter().any(|f| f.name == name) {
                    return Err(ApiError::bad_param(
                        "tool_choice",
                        format!("`tool_choice` names {name:?}, which is not among the tools"),
                    ));
                }
                Choice::Named(name.to_string())
            }
        };
        if functions.is_empty() {
            return match choice {
                Choice::Required | Choice::Named(_) => {
                    Err(ApiError::bad_param("tool_choice", "`tool_choice` asks for a call but `tools` is empty"))
                }
                _ => Ok(None),
            };
        }
        if choice == Choice::None {
            return Ok(None);
        }
        let raw = Value::Array(list.to_vec());
        Ok(Some(Tools { functions, raw, choice, parallel: parallel.unwrap_or(true) }))
    }

    /// Whether the answer must be calls.
    pub fn forced(&self) -> bool {
        matches!(self.choice, Choice::Required | Choice::Named(_))
    }

    /// The functions the answer may call.
    fn callable(&self) -> impl Iterator<Item = &Function> {
        self.functions.iter().filter(move |f| match &self.choice {
            Choice::Named(n) => &f.name == n,
            _ => true,
        })
    }

    /// One call's schema: `{"name": NAME, ARGS_KEY: PARAMETERS}`, for any callable function.
    fn call_schema(&self, args_key: &str) -> Value {
        let calls: Vec<Value> = self
            .callable()
            .map(|f| {
                json!({"type": "object", "properties": {"name": {"const": f.name}, args_key: f.parameters},
                       "required": ["name", args_key], "additionalProperties": false})
            })
            .collect();
        if calls.len() == 1 {
            calls.into_iter().next().unwrap_or(Value::Null)
        } else {
            json!({"anyOf": calls})
        }
    }

    fn calls_array(&self) -> Value {
        let mut a = json!({"type": "array", "items": self.call_schema("arguments"), "minItems": 1});
        if !self.parallel {
            a["maxItems"] = json!(1);
        }
        a
    }

    /// The generic style's answer: calls, or (unless forced) a response to the user.
    fn generic_schema(&self) -> Value {
        let calls = json!({"type": "object", "properties": {"tool_calls": self.calls_array()},
                           "required": ["tool_calls"], "additionalProperties": false});
        if self.forced() {
            return calls;
        }
        json!({"anyOf": [calls, {"type": "object", "properties": {"response": {"type": "string"}},
                                  "required": ["response"], "additionalProperties": false}]})
    }

    /// What the answer must be in `style`: `None` when the model is free (`auto` in a native
    /// style). A control token is named by id (`<[ID]>`), text by its spelling.
    pub fn format(&self, style: Style, tk: &Tokenizer) -> Option<Format> {
        if style == Style::Generic {
            return Some(Format::JsonSchema(self.generic_schema()));
        }
        if !self.forced() {
            return None;
        }
        let lit = |text: &str| match tk.special_id(text) {
            Some(id) => format!("<[{id}]>"),
            None => serde_json::to_string(text).unwrap_or_default(),
        };
        let json_of = |v: &Value| format!("%json {v}");
        Some(match style {
            Style::Hermes => {
                let call = format!(
                    "call: {} \"\\n\" {} \"\\n\" {}\n",
                    lit(HERMES_OPEN),
                    json_of(&compact_schema(self.call_schema("arguments"))),
                    lit(HERMES_CLOSE)
                );
                let start = if self.parallel { "start: call (\"\\n\" call)*\n" } else { "start: call\n" };
                Format::Lark(format!("{start}{call}"))
            }
            Style::Mistral => {
                Format::Lark(format!("start: {} {}\n", lit(MISTRAL_MARK), json_of(&compact_schema(self.calls_array()))))
            }
            Style::Llama3 => Format::JsonSchema(self.call_schema("parameters")),
            Style::Generic => Format::JsonSchema(self.generic_schema()),
        })
    }

    /// The system message that describes the tools to a model whose template cannot.
    pub fn generic_prompt(&self) -> String {
        let description = |name: &str| {
            self.raw.as_array().into_iter().flatten().filter_map(|t| t.get("function")).find_map(|f| {
                (f.get("name").and_then(Value::as_str) == Some(name)).then(|| f.get("description").cloned()).flatten()
            })
        };
        let list: Vec<Value> = self
            .callable()
            .map(|f| {
                let mut short = json!({"name": f.name, "parameters": f.parameters});
                if let Some(d) = description(&f.name) {
                    short["description"] = d;
                }
                short
            })
            .collect();
        let tools = serde_json::to_string_pretty(&list).unwrap_or_default();
        let mut p = format!(
            "You can call these tools (JSON schemas of their arguments):\n{tools}\n\nAnswer with one JSON object: \
             {{\"tool_calls\": [{{\"name\": \"<tool name>\", \"arguments\": {{<arguments>}}}}]}} to call tools"
        );
        if !self.forced() {
            p.push_str(", or {\"response\": \"<text>\"} to answer directly");
        }
        p.push('.');
        p
    }
}

/// `schema` with brigade-grammar's JSON options (no free whitespace), for a `%json` inside a
/// Lark grammar (the whole-schema path adds them itself).
fn compact_schema(mut schema: Value) -> Value {
    if let Value::Object(m) = &mut schema {
        m.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// The chat messages for the template, given `style`: in the generic style the tools are a
/// system message and earlier calls and results are plain text the template can show.
pub fn messages_for(mut messages: Vec<Value>, tools: Option<&Tools>, style: Style) -> Vec<Value> {
    if style != Style::Generic {
        return messages;
    }
    for m in &mut messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("").to_string();
        if let Some(calls) = m.get("tool_calls").and_then(Value::as_array).filter(|c| !c.is_empty()) {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let f = c.get("function").cloned().unwrap_or(Value::Null);
                    json!({"name": f.get("name"), "arguments": f.get("arguments")})
                })
                .collect();
            *m = json!({"role": "assistant", "content": json!({"tool_calls": calls}).to_string()});
        } else if role == "tool" {
            let content = m.get("content").cloned().unwrap_or(Value::Null);
            let mut r = Map::new();
            if let Some(id) = m.get("tool_call_id") {
                r.insert("tool_call_id".into(), id.clone());
            }
            r.insert("content".into(), content);
            *m = json!({"role": "user", "content": json!({"tool_response": r}).to_string()});
        }
    }
    if let Some(t) = tools {
        let prompt = t.generic_prompt();
        match messages.first_mut() {
            Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => {
                let old = first.get("content").and_then(Value::as_str).unwrap_or("").to_string();
                first["content"] = json!(if old.is_empty() { prompt } else { format!("{old}\n\n{prompt}") });
            }
            _ => messages.insert(0, json!({"role": "system", "content": prompt})),
        }
    }
    messages
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// Its arguments as a JSON text (compact), as OpenAI sends them.
    pub arguments: String,
}

/// What the answer's text turns into.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    Call(ToolCall),
}

/// Where [`ToolParser`] is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Nothing but blanks yet: the answer may still turn out to be a call.
    Start,
    /// Plain text (markers still recognised).
    Text,
    /// Inside a call, up to its end (or the answer's).
    Call,
    /// The generic style's `{"response": "…`: the string's characters are the content.
    Response,
    /// The generic style's `{"tool_calls": [`: each call is sent when its object closes.
    Calls,
    /// After the response's closing quote or the calls' `]`: the rest (`}`) says nothing.
    Done,
}

/// Turns an answer's text into content and calls as it arrives: text that may be the start of
/// a call is held back until it is known not to be one; a call is sent whole when it ends. A
/// call that does not parse, or names a function that is not among the tools, stays text.
pub struct ToolParser {
    style: Style,
    names: Vec<String>,
    /// Calls an answer may make (1 without `parallel_tool_calls`): more are dropped.
    max_calls: usize,
    mode: Mode,
    buf: String,
    /// Blanks held back before any text or after a call (dropped if only blanks follow).
    blanks: String,
    /// Text other than blanks was sent.
    said: bool,
    calls: usize,
}

const RESPONSE_HEAD: &str = "{\"response\": \"";
const CALLS_HEAD: &str = "{\"tool_calls\": [";

impl ToolParser {
    pub fn new(style: Style, tools: &Tools) -> Self {
        let names = tools.functions.iter().map(|f| f.name.clone()).collect();
        let max_calls = if tools.parallel { usize::MAX } else { 1 };
        ToolParser {
            style,
            names,
            max_calls,
            mode: Mode::Start,
            buf: String::new(),
            blanks: String::new(),
            said: false,
            calls: 0,
        }
    }

    /// Calls made so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The deltas `text` releases.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.advance(&mut out, false);
        out
    }

    /// The end of the answer: whatever was held back.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        self.advance(&mut out, true);
        match self.mode {
            // calls already sent stand; a call cut off by the end of the answer after them is
            // dropped (the finish reason says `length`)
            Mode::Call if self.calls > 0 => {
                let body = std::mem::take(&mut self.buf);
                if let Some(calls) = self.parse_calls(&body) {
                    for c in calls {
                        self.call(c, &mut out);
                    }
                }
            }
            Mode::Call => {
                let body = std::mem::take(&mut self.buf);
                self.close_call(&body, &mut out, false);
            }
            Mode::Calls if self.calls > 0 => self.buf.clear(),
            Mode::Calls => {
                let body = std::mem::take(&mut self.buf);
                self.close_call(&body, &mut out, false);
            }
            Mode::Done => {}
            Mode::Start | Mode::Text | Mode::Response => {
                let rest = std::mem::take(&mut self.buf);
                self.content(rest, &mut out);
            }
        }
        if self.calls == 0 && !self.blanks.is_empty() {
            out.push(Delta::Content(std::mem::take(&mut self.blanks)));
        }
        out
    }

    fn content(&mut self, text: String, out: &mut Vec<Delta>) {
        if text.is_empty() {
            return;
        }
        if text.trim().is_empty() && (!self.said || self.calls > 0) {
            self.blanks.push_str(&text);
            return;
        }
        self.said = true;
        let mut t = std::mem::take(&mut self.blanks);
        t.push_str(&text);
        match out.last_mut() {
            Some(Delta::Content(c)) => c.push_str(&t),
            _ => out.push(Delta::Content(t)),
        }
    }

    fn advance(&mut self, out: &mut Vec<Delta>, end: bool) {
        loop {
            match self.mode {
                Mode::Start => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        return;
                    }
                    let whole_answer_call = match self.style {
                        Style::Llama3 | Style::Generic => t.starts_with('{'),
                        _ => false,
                    };
                    if whole_answer_call {
                        let t = t.to_string();
                        self.buf = t;
                        let generic = self.style == Style::Generic;
                        if generic && self.buf.starts_with(RESPONSE_HEAD) {
                            self.buf.drain(..RESPONSE_HEAD.len());
                            self.mode = Mode::Response;
                        } else if generic && self.buf.starts_with(CALLS_HEAD) {
                            self.mode = Mode::Calls;
                        } else if generic
                            && !end
                            && (RESPONSE_HEAD.starts_with(self.buf.as_str())
                                || CALLS_HEAD.starts_with(self.buf.as_str()))
                        {
                            return; // may still become one of the two heads
                        } else {
                            self.mode = Mode::Call;
                        }
                        continue;
                    }
                    if !end && self.style.marker().is_some_and(|m| m.starts_with(t) && t.len() < m.len()) {
                        return;
                    }
                    self.mode = Mode::Text;
                }
                Mode::Text => {
                    let Some(marker) = self.style.marker() else {
                        let t = std::mem::take(&mut self.buf);
                        self.content(t, out);
                        return;
                    };
                    if let Some(i) = self.buf.find(marker) {
                        let before = self.buf[..i].to_string();
                        self.content(before, out);
                        self.buf.drain(..i + marker.len());
                        self.mode = Mode::Call;
                        continue;
                    }
                    // keep a tail that may be the start of the marker
                    let keep = if end { 0 } else { held_prefix(&self.buf, marker) };
                    let cut = self.buf.len() - keep;
                    let t: String = self.buf.drain(..cut).collect();
                    self.content(t, out);
                    return;
                }
                Mode::Call => match self.style {
                    Style::Hermes => {
                        let Some(j) = self.buf.find(HERMES_CLOSE) else { return };
                        let body = self.buf[..j].to_string();
                        self.buf.drain(..j + HERMES_CLOSE.len());
                        self.close_call(&body, out, true);
                        self.mode = Mode::Text;
                    }
                    // the call runs to the end of the answer
                    Style::Llama3 | Style::Mistral | Style::Generic => return,
                },
                Mode::Response => {
                    let (text, used, closed) = json_string_prefix(&self.buf);
                    self.buf.drain(..used);
                    self.content(text, out);
                    if closed {
                        self.buf.clear();
                        self.mode = Mode::Done;
                    }
                    return;
                }
                Mode::Calls => {
                    // after the head: objects separated by ", ", then "]}" (the grammar's exact
                    // spelling; anything else is left for the end, parsed whole)
                    let head = self.buf.find('[').map_or(0, |i| i + 1);
                    let rest = self.buf[head..].trim_start_matches([',', ' ']);
                    if rest.starts_with(']') {
                        self.buf.clear();
                        self.mode = Mode::Done;
                        return;
                    }
                    let Some(len) = json_object_len(rest) else { return };
                    let one: Option<ToolCall> =
                        serde_json::from_str::<Value>(&rest[..len]).ok().and_then(|v| self.call_of(&v, &["arguments"]));
                    let Some(call) = one else {
                        self.mode = Mode::Call; // not a call after all: the whole text decides at the end
                        return;
                    };
                    let used = self.buf.len() - rest.len() + len;
                    self.blanks.clear();
                    self.call(call, out);
                    self.buf.replace_range(head..used, "");
                }
                Mode::Done => {
                    self.buf.clear();
                    return;
                }
            }
        }
    }

    /// A call's text ends: its calls, or (not a call after all) its text back as content.
    fn close_call(&mut self, body: &str, out: &mut Vec<Delta>, closed: bool) {
        match self.parse_calls(body) {
            Some(calls) => {
                self.blanks.clear();
                for c in calls {
                    self.call(c, out);
                }
            }
            None => {
                let text = match self.style {
                    Style::Hermes => format!("{HERMES_OPEN}{body}{}", if closed { HERMES_CLOSE } else { "" }),
                    Style::Mistral => format!("{MISTRAL_MARK}{body}"),
                    Style::Llama3 | Style::Generic => body.to_string(),
                };
                self.content(text, out);
            }
        }
    }

    /// A call found: sent, unless the answer has made all it may.
    fn call(&mut self, c: ToolCall, out: &mut Vec<Delta>) {
        if self.calls < self.max_calls {
            self.calls += 1;
            out.push(Delta::Call(c));
        }
    }

    fn call_of(&self, v: &Value, args_keys: &[&str]) -> Option<ToolCall> {
        let name = v.get("name")?.as_str()?;
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let args = args_keys.iter().find_map(|k| v.get(*k)).cloned().unwrap_or_else(|| json!({}));
        // arguments sent as a JSON text inside the JSON are taken as that text's value
        let args = match args {
            Value::String(s) => serde_json::from_str(&s).ok()?,
            a => a,
        };
        if !args.is_object() {
            return None;
        }
        Some(ToolCall { name: name.to_string(), arguments: args.to_string() })
    }

    fn parse_calls(&self, body: &str) -> Option<Vec<ToolCall>> {
        let body = body.trim();
        match self.style {
            Style::Hermes => Some(vec![self.call_of(&serde_json::from_str(body).ok()?, &["arguments", "parameters"])?]),
            Style::Llama3 => {
                let body = body.strip_prefix(LLAMA_PYTHON_TAG).unwrap_or(body).trim();
                Some(vec![self.call_of(&serde_json::from_str(body).ok()?, &["parameters", "arguments"])?])
            }
            Style::Mistral => match serde_json::from_str(body).ok()? {
                Value::Array(items) if !items.is_empty() => {
                    items.iter().map(|v| self.call_of(v, &["arguments", "parameters"])).collect()
                }
                v @ Value::Object(_) => Some(vec![self.call_of(&v, &["arguments", "parameters"])?]),
                _ => None,
            },
            Style::Generic => {
                let v: Value = serde_json::from_str(body).ok()?;
                let calls = v.get("tool_calls")?.as_array()?;
                if calls.is_empty() {
                    return None;
                }
                calls.iter().map(|c| self.call_of(c, &["arguments"])).collect()
            }
        }
    }
}

/// The length of the JSON object at the start of `s`, once it is complete.
fn json_object_len(s: &str) -> Option<usize> {
    if !s.starts_with('{') {
        return None;
    }
    let (mut depth, mut in_str, mut esc) = (0usize, false, false);
    for (i, b) in s.bytes().enumerate() {
        if in_str {
            match b {
                _ if esc => esc = false,
                b'\\' => esc = true,
                b'"' => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// The length of the longest tail of `s` that begins `marker` (and is shorter than it).
fn held_prefix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && marker.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

/// The characters of a JSON string's body at the start of `s` (after its opening quote), as
/// far as they are complete: (text, bytes used, whether the closing quote was reached). An
/// escape cut off at the end of `s` waits for the rest.
fn json_string_prefix(s: &str) -> (String, usize, bool) {
    const BAD: char = '\u{FFFD}';
    let b = s.as_bytes();
    // four hex digits at `at`: the value; `None`: cut off by the end of `s` (wait for more);
    // `Some(None)`: not four hex digits
    let hex = |at: usize| -> Option<Option<u16>> {
        let digits = b.get(at..).unwrap_or(&[]);
        let n = digits.iter().take(4).take_while(|d| d.is_ascii_hexdigit()).count();
        match n {
            4 => Some(std::str::from_utf8(&digits[..4]).ok().and_then(|h| u16::from_str_radix(h, 16).ok())),
            n if n == digits.len() => None,
            _ => Some(None),
        }
    };
    let mut out = String::new();
    let mut i = 0;
    // `i` only ever moves past whole characters (an escape's bytes are ASCII), so `s[i..]` is
    // always a character boundary
    while let Some(c) = s[i..].chars().next() {
        match c {
            '"' => return (out, i + 1, true),
            '\\' => {
                let Some(e) = s[i + 1..].chars().next() else { break };
                let simple = match e {
                    '"' => Some('"'),
                    '\\' => Some('\\'),
                    '/' => Some('/'),
                    'b' => Some('\u{8}'),
                    'f' => Some('\u{c}'),
                    'n' => Some('\n'),
                    'r' => Some('\r'),
                    't' => Some('\t'),
                    _ => None,
                };
                if let Some(c) = simple {
                    out.push(c);
                    i += 2;
                    continue;
                }
                if e != 'u' {
                    out.push(BAD);
                    i += 1 + e.len_utf8();
                    continue;
                }
                match hex(i + 2) {
                    None => break,
                    Some(None) => {
                        out.push(BAD);
                        i += 2;
                    }
                    Some(Some(hi)) if (0xD800..0xDC00).contains(&hi) => {
                        // a high surrogate: the low one must follow as `\uXXXX`
                        let rest = b.get(i + 6..).unwrap_or(&[]);
                        if rest.is_empty() || rest == b"\\" {
                            break;
                        }
                        if rest.starts_with(b"\\u") {
                            match hex(i + 8) {
                                None => break,
                                Some(Some(lo)) if (0xDC00..0xE000).contains(&lo) => {
                                    let c = 0x10000 + ((u32::from(hi) - 0xD800) << 10) + (u32::from(lo) - 0xDC00);
                                    out.push(char::from_u32(c).unwrap_or(BAD));
                                    i += 12;
                                    continue;
                                }
                                Some(_) => {}
                            }
                        }
                        out.push(BAD);
                        i += 6;
                    }
                    Some(Some(v)) => {
                        out.push(char::from_u32(u32::from(v)).unwrap_or(BAD));
                        i += 6;
                    }
                }
            }
            c => {
                out.push(c);
                i += c.len_utf8();
            }
        }
    }
    (out, i, false)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Tools {
        let t = json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
        ]);
        Tools::parse(Some(&t), Some(&choice), None).unwrap().unwrap()
    }

    /// Every split of `text` into two pushes gives the same deltas (joined) as one push.
    fn parse_all_splits(style: Style, text: &str) -> (String, Vec<ToolCall>) {
        let t = tools(json!("auto"));
        let join = |ds: Vec<Delta>| {
            let (mut c, mut calls) = (String::new(), Vec::new());
            for d in ds {
                match d {
                    Delta::Content(s) => c.push_str(&s),
                    Delta::Call(k) => calls.push(k),
                }
            }
            (c, calls)
        };
        let mut whole = ToolParser::new(style, &t);
        let mut ds = whole.push(text);
        ds.extend(whole.finish());
        let want = join(ds);
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut p = ToolParser::new(style, &t);
            let mut ds = p.push(&text[..cut]);
            ds.extend(p.push(&text[cut..]));
            ds.extend(p.finish());
            assert_eq!(join(ds), want, "split at {cut} of {text:?}");
        }
        // one character at a time, as tokens arrive
        let mut p = ToolParser::new(style, &t);
        let mut ds: Vec<Delta> = text.chars().flat_map(|c| p.push(&c.to_string())).collect();
        ds.extend(p.finish());
        assert_eq!(join(ds), want, "char by char {text:?}");
        want
    }

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: args.into() }
    }

    #[test]
    fn hermes_calls_are_found_in_text_and_a_broken_one_stays_text() {
        let (c, calls) = parse_all_splits(
            Style::Hermes,
            "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
             <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>",
        );
        assert_eq!(c, "Let me look.\n");
        assert_eq!(calls, [call("get_weather", r#"{"city":"Paris"}"#), call("add", r#"{"a":1,"b":2}"#)]);
        // without parallel_tool_calls, the first call only
        let one = Tools { parallel: false, ..tools(json!("auto")) };
        let mut p = ToolParser::new(Style::Hermes, &one);
        let mut ds = p.push("<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1}}</tool_call>");
        ds.extend(p.finish());
        assert_eq!(ds, [Delta::Call(call("add", "{}"))]);
        // a call cut off after a complete one is dropped
        let (c, calls) = parse_all_splits(
            Style::Hermes,
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"a",
        );
        assert_eq!((c.as_str(), calls), ("", vec![call("add", "{}")]));
        // no closing tag at the end of the answer: still a call
        let (c, calls) =
            parse_all_splits(Style::Hermes, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 5}}\n");
        assert_eq!((c.as_str(), calls), ("", vec![call("add", r#"{"a":5}"#)]));
        // an unknown function or bad JSON: text, as written
        let text = "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call> ok";
        assert_eq!(parse_all_splits(Style::Hermes, text), (text.to_string(), vec![]));
        let text = "<tool_call>{\"name\": \"add\", \"arguments\": {</tool_call>";
        assert_eq!(parse_all_splits(Style::Hermes, text), (text.to_string(), vec![]));
        // text that only looks like the start of a marker is released at the end
        assert_eq!(parse_all_splits(Style::Hermes, "a <tool_c"), ("a <tool_c".to_string(), vec![]));
        assert_eq!(parse_all_splits(Style::Hermes, "plain answer"), ("plain answer".to_string(), vec![]));
    }

    #[test]
    fn llama3_mistral_and_generic_answers() {
        let (c, calls) =
            parse_all_splits(Style::Llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}");
        assert_eq!((c.as_str(), calls), ("", vec![call("get_weather", r#"{"city":"Oslo"}"#)]));
        let (c, calls) =
            parse_all_splits(Style::Llama3, "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1}}");
        assert_eq!((c.as_str(), calls), ("", vec![call("add", r#"{"a":1}"#)]));
        assert_eq!(parse_all_splits(Style::Llama3, "{not json} fine"), ("{not json} fine".to_string(), vec![]));
        let (c, calls) = parse_all_splits(
            Style::Mistral,
            "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}, {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}]",
        );
        assert_eq!(c, "");
        assert_eq!(calls, [call("add", r#"{"a":1,"b":2}"#), call("get_weather", r#"{"city":"Rome"}"#)]);
        let (c, calls) = parse_all_splits(
            Style::Generic,
            "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}]}",
        );
        assert_eq!((c.as_str(), calls), ("", vec![call("get_weather", r#"{"city":"Lima"}"#)]));
        let (c, calls) = parse_all_splits(Style::Generic, r#"{"response": "Hi \"you\"\n\u00e9\ud83d\ude00 done"}"#);
        assert_eq!((c.as_str(), calls), ("Hi \"you\"\n\u{e9}\u{1F600} done", vec![]));
        // calls cut off by max_tokens: the complete ones
        let (c, calls) = parse_all_splits(
            Style::Generic,
            "{\"tool_calls\": [{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"add\", \"argu",
        );
        assert_eq!((c.as_str(), calls), ("", vec![call("add", r#"{"a":1}"#)]));
        let (c, calls) = parse_all_splits(
            Style::Generic,
            "{\"tool_calls\": [{\"name\": \"add\", \"arguments\": {\"a\": \"}{\"}}, {\"name\": \"add\", \"arguments\": {}}]}",
        );
        assert_eq!((c.as_str(), calls), ("", vec![call("add", r#"{"a":"}{"}"#), call("add", "{}")]));
        // escapes a model may write: lone surrogates, a backslash before any character
        for (body, want) in [
            ("\\uD83Dx\u{e9}\u{e9}", "\u{FFFD}x\u{e9}\u{e9}"),
            ("\\uD83D\\u0041z", "\u{FFFD}Az"),
            ("\\\u{e9}t", "\u{FFFD}t"),
            ("\\uDE00\u{4e2d}", "\u{FFFD}\u{4e2d}"),
            ("\\uZZZZ", "\u{FFFD}ZZZZ"),
        ] {
            let text = format!("{{\"response\": \"{body}\"}}");
            assert_eq!(parse_all_splits(Style::Generic, &text), (want.to_string(), vec![]), "{body}");
        }
        // a response cut off by max_tokens: what was written
        assert_eq!(parse_all_splits(Style::Generic, r#"{"response": "Once up"#), ("Once up".to_string(), vec![]));
        // unconstrained (a backend that cannot constrain): plain text stays text
        assert_eq!(parse_all_splits(Style::Generic, "Hello there"), ("Hello there".to_string(), vec![]));
    }

    #[test]
    fn the_response_string_streams_as_it_is_written() {
        let t = tools(json!("auto"));
        let mut p = ToolParser::new(Style::Generic, &t);
        assert!(p.push("{\"resp").is_empty());
        assert_eq!(p.push("onse\": \"Hel"), [Delta::Content("Hel".into())]);
        assert_eq!(p.push("lo\\"), [Delta::Content("lo".into())]);
        assert_eq!(p.push("n!\"}"), [Delta::Content("\n!".into())]);
        assert!(p.finish().is_empty());
        // Hermes text streams up to a possible marker
        let mut p = ToolParser::new(Style::Hermes, &t);
        assert_eq!(p.push("Sure <tool"), [Delta::Content("Sure ".into())]);
        assert_eq!(p.push("box> x"), [Delta::Content("<toolbox> x".into())]);
    }

    #[test]
    fn tools_and_choices_are_checked_by_name() {
        let t = tools(json!({"type": "function", "function": {"name": "add"}}));
        assert_eq!(t.choice, Choice::Named("add".into()));
        assert!(t.forced() && t.parallel);
        assert!(Tools::parse(Some(&json!([])), None, None).unwrap().is_none());
        assert!(Tools::parse(None, Some(&json!("none")), None).unwrap().is_none());
        let one = json!([{"type": "function", "function": {"name": "f"}}]);
        assert!(Tools::parse(Some(&one), Some(&json!("none")), None).unwrap().is_none());
        for (tools, choice, param) in [
            (json!([{"type": "retrieval"}]), json!("auto"), "tools"),
            (json!([{"type": "function", "function": {"name": "bad name"}}]), json!("auto"), "tools"),
            (json!([{"type": "function", "function": {"name": "f", "parameters": []}}]), json!("auto"), "tools"),
            (
                json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
                json!("auto"),
                "tools",
            ),
            (json!({"f": 1}), json!("auto"), "tools"),
            (one.clone(), json!("sometimes"), "tool_choice"),
            (one.clone(), json!({"type": "function", "function": {"name": "g"}}), "tool_choice"),
            (one.clone(), json!({"type": "function"}), "tool_choice"),
            (json!([]), json!("required"), "tool_choice"),
        ] {
            let e = Tools::parse(Some(&tools), Some(&choice), None).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{tools} {choice}: {e}");
        }
    }

    #[test]
    fn forced_formats_name_the_callable_functions() {
        let idx = brigade_format::ModelIndex::from_static_gguf(brigade_format::embedded_model(), "stories").unwrap();
        let tk = idx.tokenizer().clone();
        let t = tools(json!({"type": "function", "function": {"name": "add"}}));
        let Some(Format::Lark(g)) = t.format(Style::Hermes, &tk) else { panic!() };
        assert!(g.contains("\"<tool_call>\"") && g.contains("\"const\":\"add\"") && !g.contains("get_weather"), "{g}");
        let auto = tools(json!("auto"));
        assert!(auto.format(Style::Hermes, &tk).is_none());
        let Some(Format::JsonSchema(s)) = auto.format(Style::Generic, &tk) else { panic!() };
        assert_eq!(s["anyOf"].as_array().unwrap().len(), 2);
        let Some(Format::JsonSchema(s)) = t.format(Style::Llama3, &tk) else { panic!() };
        assert_eq!(s["properties"]["name"]["const"], "add");
        assert!(s["properties"]["parameters"].is_object());
        // the generic prompt describes the callable functions, each with its own description
        let p = t.generic_prompt();
        assert!(
            p.contains("\"name\": \"add\"") && !p.contains("get_weather") && !p.contains("Weather in a city"),
            "{p}"
        );
        let p = auto.generic_prompt();
        assert!(p.contains("Weather in a city") && p.contains("{\"response\""), "{p}");
        assert_eq!(Style::Mistral.call_id(5, 0).len(), 9);
        assert_ne!(Style::Hermes.call_id(5, 0), Style::Hermes.call_id(5, 1));
    }

    /// Each style's forced grammar compiles against a real vocabulary, takes a call written
    /// as the model would, then allows the end; and refuses a call to another function.
    #[test]
    fn forced_grammars_take_the_calls_the_parser_reads() {
        use brigade_core::TokenConstraint;
        let idx = brigade_format::ModelIndex::from_static_gguf(brigade_format::embedded_model(), "stories").unwrap();
        let tk = idx.tokenizer().clone();
        let vocab = brigade_grammar::Vocabulary::new(&tk).unwrap();
        let t = tools(json!({"type": "function", "function": {"name": "get_weather"}}));
        let eos = tk.eos.unwrap();
        for (style, text) in [
            (
                Style::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
            ),
            (Style::Llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}"),
            (Style::Mistral, "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]"),
            (Style::Generic, "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]}"),
        ] {
            // (SentencePiece puts a word-initial space first: a model's answer would not have it)
            let ids = |text: &str| {
                let mut ids = tk.encode(text, false).unwrap();
                if tk.piece(ids[0]) == b" " {
                    ids.remove(0);
                }
                ids
            };
            let format = t.format(style, &tk).unwrap();
            let mut g = vocab.compile(&format).unwrap();
            for id in ids(text) {
                g.commit(id).unwrap_or_else(|e| panic!("{style:?}: {e} in {text:?}"));
            }
            assert!(g.is_done() || g.allowed().unwrap().contains(&eos), "{style:?}: cannot end after {text:?}");
            let mut p = ToolParser::new(style, &t);
            let mut ds = p.push(text);
            ds.extend(p.finish());
            assert_eq!(ds, [Delta::Call(call("get_weather", r#"{"city":"Rome"}"#))], "{style:?}");
            let wrong = text.replace("get_weather", "add");
            let mut g = vocab.compile(&format).unwrap();
            let refused = ids(&wrong).into_iter().try_for_each(|id| g.commit(id)).is_err();
            assert!(refused, "{style:?} took {wrong:?}");
        }
    }

    #[test]
    fn the_style_is_read_from_the_template() {
        let idx = brigade_format::ModelIndex::from_static_gguf(brigade_format::embedded_model(), "stories").unwrap();
        let tk = idx.tokenizer().clone();
        let shows =
            "{% for t in tools %}{{ t.function.name }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}";
        let hides = "{% for m in messages %}{{ m.content }}{% endfor %}";
        for (extra, style) in [
            ("<tool_call>", Style::Hermes),
            ("[TOOL_CALLS]", Style::Mistral),
            ("<|start_header_id|>ipython", Style::Llama3),
            ("", Style::Generic),
        ] {
            assert_eq!(Style::of(&tk, &format!("{{# {extra} #}}{shows}")), style, "{extra}");
            // a template that names the format but never shows the tools cannot be used natively
            assert_eq!(Style::of(&tk, &format!("{{# {extra} #}}{hides}")), Style::Generic, "{extra}");
        }
    }
}
