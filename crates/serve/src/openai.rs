//! The request bodies of OpenAI's API as the official clients send them (fields brigade does not
//! use are ignored), llama.cpp's sampling extras, and their checks.

use crate::error::ApiError;
use brigade_core::SamplingParams;
use brigade_grammar::Format;
use serde::Deserialize;
use serde_json::Value;

/// `prompt` of `/v1/completions`: text, or token ids, or a list of one of those.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// The fields both endpoints share.
#[derive(Debug, Deserialize, Default)]
pub struct Params {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    // llama.cpp's extras
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub ignore_eos: Option<bool>,
    /// OpenAI's structured output: `{"type": "text" | "json_object" | "json_schema", …}`.
    pub response_format: Option<serde_json::Value>,
    /// llama.cpp's extras: a JSON schema, or a grammar (llguidance's Lark syntax after a
    /// `%llguidance` line, as llama.cpp's llguidance builds take it).
    pub json_schema: Option<serde_json::Value>,
    pub grammar: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Optional when the server serves one model (as llama-server: curl examples leave it out).
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub params: Params,
    pub echo: Option<bool>,
    pub logprobs: Option<serde_json::Value>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
}

/// A chat message's content: text, or parts of which the text ones count.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's earlier calls: `{"id", "type": "function", "function": {"name", "arguments"}}`.
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message's answer to this call.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// Optional when the server serves one model.
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub params: Params,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Functions the model may call (see [`crate::tools`]).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
}

/// A request's checked settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `max_tokens`; `None`: until the context is full.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    /// What the answer must be, and the request field that said so (for errors).
    pub format: Option<(Format, &'static str)>,
    /// Report each token's log-probability and this many alternatives (set by the endpoint:
    /// chat's `logprobs` / `top_logprobs`, completions' `logprobs`).
    pub logprobs: Option<usize>,
}

fn in_range(param: &str, v: Option<f32>, lo: f32, hi: f32, default: f32) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x),
        Some(x) => Err(ApiError::bad_param(param, format!("`{param}` must be between {lo} and {hi}, got {x}"))),
    }
}

fn count(param: &str, v: Option<i64>, min: i64, default: usize) -> Result<usize, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x >= min => {
            usize::try_from(x).map_err(|_| ApiError::bad_param(param, format!("`{param}` is too large: {x}")))
        }
        Some(x) => Err(ApiError::bad_param(param, format!("`{param}` must be at least {min}, got {x}"))),
    }
}

impl Params {
    /// Checks the fields; unspecified sampling fields take llama.cpp's defaults (as
    /// llama-server does), `seed` defaults to `random_seed`.
    pub fn settings(&self, random_seed: u64) -> Result<Settings, ApiError> {
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::bad_param("n", format!("only n = 1 is supported, got {n}")));
        }
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => Some(count("max_completion_tokens", Some(m), 1, 0)?),
            (None, Some(m)) => Some(count("max_tokens", Some(m), 1, 0)?),
            (None, None) => None,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        brigade_core::stop::check_stops(&stop).map_err(|e| ApiError::bad_param("stop", e.to_string()))?;
        // unspecified fields take llama.cpp's defaults; OpenAI's ranges are checked here, what
        // the sampler itself cannot use by `validate`
        let d = SamplingParams::default();
        let sampling = SamplingParams {
            temperature: in_range("temperature", self.temperature, 0.0, 2.0, d.temperature)?,
            top_k: count("top_k", self.top_k, 0, d.top_k)?,
            top_p: in_range("top_p", self.top_p, 0.0, 1.0, d.top_p)?,
            min_p: in_range("min_p", self.min_p, 0.0, 1.0, d.min_p)?,
            repeat_penalty: in_range("repeat_penalty", self.repeat_penalty, 0.0, 10.0, d.repeat_penalty)?,
            repeat_last_n: count("repeat_last_n", self.repeat_last_n, 0, d.repeat_last_n)?,
            frequency_penalty: in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, d.frequency_penalty)?,
            presence_penalty: in_range("presence_penalty", self.presence_penalty, -2.0, 2.0, d.presence_penalty)?,
            // OpenAI's seed is any integer: its bits are the generator's seed
            seed: self.seed.map(|s| s as u64).unwrap_or(random_seed),
        };
        sampling.validate().map_err(|e| ApiError::bad_param(e.field, e.to_string()))?;
        let stream = self.stream.unwrap_or(false);
        let include_usage = self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
        let format = self.format()?;
        Ok(Settings {
            max_tokens,
            sampling,
            stop,
            stream,
            include_usage,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            format,
            logprobs: None,
        })
    }

    /// What the answer must be: at most one of `response_format`, `json_schema` and `grammar`.
    fn format(&self) -> Result<Option<(Format, &'static str)>, ApiError> {
        let mut found = Vec::new();
        if let Some(rf) = &self.response_format {
            if let Some(f) = response_format(rf)? {
                found.push((f, "response_format"));
            }
        }
        if let Some(schema) = &self.json_schema {
            found.push((Format::JsonSchema(schema.clone()), "json_schema"));
        }
        if let Some(g) = &self.grammar {
            let lark = g.trim_start().strip_prefix("%llguidance").ok_or_else(|| {
                ApiError::bad_param(
                    "grammar",
                    "GBNF grammars are not supported: send llguidance's Lark syntax after a `%llguidance` line, \
                     or `response_format` with a JSON schema",
                )
            })?;
            // the rest of the `%llguidance` line (options llama.cpp ignores too) is skipped
            let body = lark.split_once('\n').map_or("", |(_, b)| b);
            found.push((Format::Lark(body.to_string()), "grammar"));
        }
        match found.len() {
            0 | 1 => Ok(found.pop()),
            _ => Err(ApiError::bad_param(
                found[1].1,
                format!("`{}` and `{}` both constrain the answer: send one", found[0].1, found[1].1),
            )),
        }
    }
}

/// OpenAI's `response_format` (and llama.cpp's `{"type": "json_object", "schema": …}`).
fn response_format(rf: &Value) -> Result<Option<Format>, ApiError> {
    let bad = |why: String| ApiError::bad_param("response_format", why);
    let kind = rf.get("type").and_then(Value::as_str).ok_or_else(|| bad("`response_format.type` is missing".into()))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(match rf.get("schema") {
            Some(s) => Format::JsonSchema(s.clone()),
            None => Format::JsonObject,
        })),
        "json_schema" => {
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| bad("`response_format.json_schema.schema` is missing".into()))?;
            Ok(Some(Format::JsonSchema(schema.clone())))
        }
        other => Err(bad(format!("`response_format.type` `{other}` is not one of text, json_object, json_schema"))),
    }
}

impl CompletionRequest {
    /// Refuses what brigade does not do (rather than silently ignoring it).
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::bad_param("echo", "`echo` is not supported"));
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(ApiError::bad_param("best_of", "only best_of = 1 is supported"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::bad_param("suffix", "`suffix` is not supported"));
        }
        Ok(())
    }
}

impl CompletionRequest {
    /// `logprobs`: an integer, the alternatives per token (0 to 5, as OpenAI's); `true` is 0.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
            Some(Value::Bool(true)) => Ok(Some(0)),
            Some(v) => match v.as_u64() {
                Some(n) if n <= 5 => Ok(Some(n as usize)),
                _ => {
                    Err(ApiError::bad_param("logprobs", format!("`logprobs` must be an integer from 0 to 5, got {v}")))
                }
            },
        }
    }
}

impl ChatRequest {
    /// `logprobs` and `top_logprobs` (0 to 20, and only with `logprobs: true`).
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        let max = brigade_core::MAX_TOP_LOGPROBS as i64;
        let top = match self.top_logprobs {
            None => None,
            Some(n) if (0..=max).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ApiError::bad_param(
                    "top_logprobs",
                    format!("`top_logprobs` must be from 0 to {max}, got {n}"),
                ))
            }
        };
        match (self.logprobs.unwrap_or(false), top) {
            (true, top) => Ok(Some(top.unwrap_or(0))),
            (false, Some(_)) => Err(ApiError::bad_param("top_logprobs", "`top_logprobs` needs `logprobs: true`")),
            (false, None) => Ok(None),
        }
    }

    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_param("messages", "`messages` is empty"));
        }
        Ok(())
    }

    /// The messages for the chat template, as objects: text parts joined (other parts
    /// refused), `developer` as `system`, earlier calls' `arguments` as JSON values (what
    /// templates write with `tojson`), a tool's answer with its `tool_call_id`.
    pub fn template_messages(&self) -> Result<Vec<Value>, ApiError> {
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let text = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut t = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(s)) => t.push_str(s),
                                (kind, _) => {
                                    return Err(ApiError::bad_param(
                                        "messages",
                                        format!("content parts of type `{kind}` are not supported (only text)"),
                                    ))
                                }
                            }
                        }
                        t
                    }
                };
                let role = if m.role == "developer" { "system" } else { m.role.as_str() };
                let mut msg = serde_json::json!({"role": role, "content": text});
                if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                    let calls = calls
                        .iter()
                        .enumerate()
                        .map(|(j, c)| {
                            template_call(c).map_err(|why| {
                                ApiError::bad_param("messages", format!("messages[{i}].tool_calls[{j}]: {why}"))
                            })
                        })
                        .collect::<Result<Vec<Value>, ApiError>>()?;
                    msg["tool_calls"] = Value::Array(calls);
                }
                if let Some(id) = &m.tool_call_id {
                    msg["tool_call_id"] = serde_json::json!(id);
                }
                if let Some(name) = &m.name {
                    msg["name"] = serde_json::json!(name);
                }
                Ok(msg)
            })
            .collect()
    }
}

/// An earlier call as templates read it: `arguments` sent as JSON text become the value.
fn template_call(c: &Value) -> Result<Value, String> {
    let f = c.get("function").filter(|f| f.is_object()).ok_or("`function` is missing")?;
    let name = f.get("name").and_then(Value::as_str).ok_or("`function.name` is missing")?;
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => serde_json::json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        Some(v) => v.clone(),
    };
    let mut out = serde_json::json!({"type": "function", "function": {"name": name, "arguments": arguments}});
    if let Some(id) = c.get("id") {
        out["id"] = id.clone();
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn params(j: serde_json::Value) -> Result<Settings, ApiError> {
        serde_json::from_value::<Params>(j).unwrap().settings(7)
    }

    #[test]
    fn defaults_are_llama_cpps_and_fields_are_checked() {
        let s = params(serde_json::json!({})).unwrap();
        assert_eq!((s.max_tokens, s.sampling.temperature, s.sampling.top_k, s.sampling.seed), (None, 0.8, 40, 7));
        let s = params(serde_json::json!({"max_tokens": 5, "max_completion_tokens": 9, "temperature": 0, "seed": -1,
            "stop": "x", "stream": true, "stream_options": {"include_usage": true}, "presence_penalty": 1.5}))
        .unwrap();
        assert_eq!(s.max_tokens, Some(9));
        assert_eq!(s.sampling.seed, u64::MAX);
        assert_eq!(s.stop, ["x"]);
        assert!(s.stream && s.include_usage);
        assert_eq!(s.sampling.presence_penalty, 1.5);
        for (bad, param) in [
            (serde_json::json!({"max_tokens": -1}), "max_tokens"),
            (serde_json::json!({"max_tokens": 0}), "max_tokens"),
            (serde_json::json!({"n": 2}), "n"),
            (serde_json::json!({"temperature": 3}), "temperature"),
            (serde_json::json!({"top_p": -0.1}), "top_p"),
            (serde_json::json!({"frequency_penalty": 2.5}), "frequency_penalty"),
            (serde_json::json!({"stop": vec!["a"; 17]}), "stop"),
            (serde_json::json!({"repeat_penalty": 0}), "repeat_penalty"),
        ] {
            let e = params(bad.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{bad}");
            assert_eq!(e.param.as_deref(), Some(param), "{bad}");
        }
    }

    #[test]
    fn prompts_and_contents_of_every_shape() {
        let r: CompletionRequest = serde_json::from_str(r#"{"model": "m", "prompt": [1, 2]}"#).unwrap();
        assert!(matches!(r.prompt, Prompt::Ids(ref v) if v == &[1, 2]));
        let r: CompletionRequest = serde_json::from_str(r#"{"model": "m", "prompt": ["a"]}"#).unwrap();
        assert!(matches!(r.prompt, Prompt::Texts(_)));
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"model": "m", "prompt": 5}"#).is_err());
        let r: ChatRequest = serde_json::from_str(
            r#"{"model": "m", "messages": [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.template_messages().unwrap(),
            [
                serde_json::json!({"role": "system", "content": "s"}),
                serde_json::json!({"role": "user", "content": "ab"}),
                serde_json::json!({"role": "assistant", "content": ""})
            ]
        );
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "developer", "content": "d"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                  "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]}"#,
        )
        .unwrap();
        let m = r.template_messages().unwrap();
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m[1]["tool_calls"][0]["function"]["arguments"], serde_json::json!({"x": 1}));
        assert_eq!(m[1]["tool_calls"][0]["id"], "call_1");
        assert_eq!(m[2], serde_json::json!({"role": "tool", "content": "42", "tool_call_id": "call_1"}));
        let r: ChatRequest = serde_json::from_str(
            r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.template_messages().unwrap_err().status, 400);
    }
}
