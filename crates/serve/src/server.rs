//! The axum application: routes, API keys, body limits, and the two completion endpoints in
//! one flow — parse, check, tokenize, [`Backend::complete`], then the backend's token ids
//! turned into text (UTF-8 held back until whole, stop strings held back until they cannot
//! match) sent as one JSON answer or as server-sent events.

use crate::backend::{Backend, EngineEvent, EngineRequest, Finish, ModelInfo};
use crate::error::ApiError;
use crate::keys::{ApiKeys, KeyError};
use crate::metrics::{RecentRequest, ServerMetrics};
use crate::openai::{ChatRequest, CompletionRequest, Prompt, Settings};
use crate::tools::{Choice, Delta, Style, ToolCall, ToolParser, Tools};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use brigade_core::admission::{Admission, Caps};
use brigade_core::Constraint;
use brigade_format::Tokenizer;
use brigade_grammar::{Format, Vocabulary};
use futures_util::{stream, StreamExt};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// The chat template of a model that has none: ChatML, as llama-server falls back to.
pub const FALLBACK_CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
    message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Connections the HTTP API holds at once.
pub const HTTP_CAPS: Caps = Caps { total: 1024, per_ip: 256 };
/// A request's head (request line and headers) must arrive within this.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// A request's body must arrive within this.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Bytes of a body past the limit that are read and dropped before the 413 is sent, so that a
/// client still sending gets the answer instead of a reset connection.
const DRAIN_MAX: usize = 64 << 20;

#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Keys accepted as `Authorization: Bearer KEY` on `/v1/*` (either tier); none: no key needed.
    pub keys: ApiKeys,
    /// Also require a key for the dashboard (`/`) and `/metrics` (`/health` stays open for probes).
    pub protect_metrics: bool,
    /// Largest request body (413 past it).
    pub max_body_bytes: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig { keys: ApiKeys::default(), protect_metrics: false, max_body_bytes: 8 << 20 }
    }
}

struct App<B> {
    backend: Arc<B>,
    cfg: ServeConfig,
    requests: AtomicU64,
    metrics: Arc<ServerMetrics>,
    /// Each model's vocabulary for the grammar engine, built at its first constrained request.
    vocabularies: std::sync::Mutex<std::collections::HashMap<String, Arc<Vocabulary>>>,
}

/// Serves the API on `listener` until `shutdown` completes; requests in flight then finish.
///
/// Connections are admitted under [`HTTP_CAPS`] (one over a cap is closed at once); a request's
/// head must arrive within [`HEADER_TIMEOUT`] and its body within [`BODY_TIMEOUT`], so a
/// slowloris client holds one connection for seconds, not for ever. hyper serves each
/// connection (axum's `serve` has neither the caps nor the header timeout).
pub async fn serve<B: Backend>(
    listener: TcpListener,
    backend: Arc<B>,
    cfg: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(backend, cfg);
    let admission = Admission::new(HTTP_CAPS);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // out of file descriptors, most likely: pause rather than spin
                tracing::warn!("accepting an HTTP connection: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let ticket = match admission.admit(remote.ip()) {
            Ok(ticket) => ticket,
            Err(refused) => {
                tracing::debug!("closed an HTTP connection from {remote}: {refused}");
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("HTTP connection from {remote}: {e}");
            }
            drop(ticket);
        });
    }
    graceful.shutdown().await;
    Ok(())
}

/// The routes: `/health`, and `/v1/models`, `/v1/completions`, `/v1/chat/completions` behind the
/// API keys.
pub fn router<B: Backend>(backend: Arc<B>, cfg: ServeConfig) -> Router {
    let keys = Arc::new(cfg.keys.clone());
    let protect_metrics = cfg.protect_metrics;
    let metrics = Arc::new(ServerMetrics::default());
    let app = Arc::new(App {
        backend,
        cfg,
        requests: AtomicU64::new(0),
        metrics: metrics.clone(),
        vocabularies: Default::default(),
    });
    let v1 = Router::new()
        .route("/v1/models", get(models::<B>))
        .route("/v1/models/{id}", get(model::<B>))
        .route("/v1/completions", post(completions::<B>))
        .route("/v1/chat/completions", post(chat::<B>))
        .route_layer(axum::middleware::from_fn_with_state(keys.clone(), auth));
    let mut views = Router::new().route("/metrics", get(metrics_text::<B>)).route("/", get(dashboard::<B>));
    if protect_metrics {
        views = views.route_layer(axum::middleware::from_fn_with_state(keys, auth));
    }
    Router::new()
        .route("/health", get(health::<B>))
        .merge(views)
        .merge(v1)
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .layer(axum::middleware::from_fn_with_state(metrics, count))
        .with_state(app)
}

/// Counts every answered request by endpoint and status.
async fn count(State(m): State<Arc<ServerMetrics>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    m.request(&path, resp.status().as_u16());
    resp
}

/// `/metrics`: Prometheus' text format, from the same figures as the dashboard.
async fn metrics_text<B: Backend>(State(app): State<Arc<App<B>>>) -> Result<Response, ApiError> {
    let ov = app.backend.overview().await;
    let text = app
        .metrics
        .encode(app.backend.load(), ov.as_ref())
        .map_err(|e| ApiError::internal(format!("encoding the metrics: {e}")))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response())
}

/// `/`: the dashboard.
async fn dashboard<B: Backend>(State(app): State<Arc<App<B>>>) -> Response {
    let ov = app.backend.overview().await;
    let models: Vec<String> = app.backend.models().into_iter().map(|m| m.id).collect();
    let page = crate::dashboard::render(ov.as_ref(), app.backend.load(), &app.metrics.recent(), &models);
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], page).into_response()
}

/// Every route of this API is inference (or a view of it): either tier's key lets it through.
async fn auth(State(keys): State<Arc<ApiKeys>>, req: Request, next: Next) -> Response {
    let given = ApiKeys::bearer(req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()));
    match keys.check(given) {
        Ok(_) => next.run(req).await,
        Err(KeyError::Invalid) => ApiError::unauthorized("invalid API key").into_response(),
        Err(KeyError::Missing) => {
            ApiError::unauthorized("an API key is required: header `Authorization: Bearer KEY`").into_response()
        }
    }
}

async fn health<B: Backend>(State(app): State<Arc<App<B>>>) -> Json<Value> {
    let mut j = json!({"status": "ok"});
    if let Some(l) = app.backend.load() {
        j["slots_idle"] = json!(l.slots.saturating_sub(l.processing));
        j["slots_processing"] = json!(l.processing);
        j["requests_waiting"] = json!(l.waiting);
    }
    Json(j)
}

fn card(m: &ModelInfo) -> Value {
    // `meta` as llama-server gives it (a benchmark picks valid token ids by `n_vocab`)
    json!({"id": m.id, "object": "model", "created": m.created, "owned_by": m.owned_by,
           "meta": {"n_ctx": m.n_ctx, "n_vocab": m.tokenizer.vocab_size()}})
}

async fn models<B: Backend>(State(app): State<Arc<App<B>>>) -> Json<Value> {
    let data: Vec<Value> = app.backend.models().iter().map(card).collect();
    Json(json!({"object": "list", "data": data}))
}

async fn model<B: Backend>(State(app): State<Arc<App<B>>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    Ok(Json(card(&app.find(Some(&id))?)))
}

impl<B: Backend> App<B> {
    /// The model a request names; a request that names none gets the one model served (a
    /// 400 naming them when there are several).
    fn find(&self, id: Option<&str>) -> Result<ModelInfo, ApiError> {
        let mut all = self.backend.models();
        let ids = || all.iter().map(|m| m.id.clone()).collect::<Vec<String>>();
        match id {
            None if all.len() == 1 => Ok(all.remove(0)),
            None if all.is_empty() => Err(ApiError::model_not_found("", &[])),
            None => {
                Err(ApiError::bad_param("model", format!("`model` is required: this server has {}", ids().join(", "))))
            }
            Some(id) => all.iter().find(|m| m.id == id).cloned().ok_or_else(|| ApiError::model_not_found(id, &ids())),
        }
    }

    /// A response id and seed unique to this request.
    fn next_id(&self) -> (String, u64) {
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        let mixed = (t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        (format!("{mixed:016x}"), mixed)
    }
}

/// The body, at most `limit` bytes; past it, the rest is read and dropped (up to [`DRAIN_MAX`])
/// and the answer is 413. The whole body must arrive within [`BODY_TIMEOUT`] (408 otherwise), so
/// a client trickling bytes holds its connection that long at most.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let mut frames = body.into_data_stream();
    let mut buf = Vec::new();
    let mut over = 0usize;
    let deadline = tokio::time::Instant::now() + BODY_TIMEOUT;
    loop {
        let next = tokio::time::timeout_at(deadline, frames.next()).await;
        let Ok(next) = next else {
            return Err(ApiError::body_timeout(BODY_TIMEOUT.as_secs(), buf.len() + over));
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the request body: {e}")))?;
        if over > 0 || buf.len() + chunk.len() > limit {
            over += chunk.len();
            buf = Vec::new();
            if over > DRAIN_MAX {
                break;
            }
            continue;
        }
        buf.extend_from_slice(&chunk);
    }
    if over > 0 {
        return Err(ApiError::too_large(limit));
    }
    Ok(Bytes::from(buf))
}

fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// Tokenizing is CPU work (a long prompt takes a while): off the async threads.
async fn tokenize(
    tk: Arc<Tokenizer>,
    f: impl FnOnce(&Tokenizer) -> Result<Vec<u32>, brigade_format::FormatError> + Send + 'static,
) -> Result<Vec<u32>, ApiError> {
    tokenize_with(tk, f).await
}

async fn completions<B: Backend>(State(app): State<Arc<App<B>>>, body: Body) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let req: CompletionRequest = parse(&read_body(body, app.cfg.max_body_bytes).await?)?;
    req.check_unsupported()?;
    let info = app.find(req.model.as_deref())?;
    let (id, seed) = app.next_id();
    let mut settings = req.params.settings(seed)?;
    settings.logprobs = req.logprobs()?;
    let vocab = info.tokenizer.vocab_size();
    let prompt = match req.prompt {
        Prompt::Text(t) => tokenize(info.tokenizer.clone(), move |tk| tk.encode(&t, true)).await?,
        Prompt::Texts(mut v) if v.len() == 1 => {
            let t = v.remove(0);
            tokenize(info.tokenizer.clone(), move |tk| tk.encode(&t, true)).await?
        }
        Prompt::Ids(ids) => ids,
        Prompt::IdLists(mut v) if v.len() == 1 => v.remove(0),
        Prompt::Texts(_) | Prompt::IdLists(_) => {
            return Err(ApiError::bad_param("prompt", "one prompt per request (a list of exactly one)"))
        }
    };
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_param("prompt", format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    let kind = Kind::Completion { id: format!("cmpl-{id}") };
    run(&app, &info, prompt, settings, kind, t0, None).await
}

async fn chat<B: Backend>(State(app): State<Arc<App<B>>>, body: Body) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let req: ChatRequest = parse(&read_body(body, app.cfg.max_body_bytes).await?)?;
    req.check_unsupported()?;
    let info = app.find(req.model.as_deref())?;
    let (id, seed) = app.next_id();
    let mut settings = req.params.settings(seed)?;
    settings.logprobs = req.logprobs()?;
    let tools = Tools::parse(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    if let (Some(_), Some((_, field))) = (&tools, &settings.format) {
        return Err(ApiError::bad_param(field, format!("`{field}` and `tools` both constrain the answer: send one")));
    }
    let messages = req.template_messages()?;
    let in_play = tools.clone();
    let (prompt, style) = tokenize_with(info.tokenizer.clone(), move |tk| {
        let template = tk.chat_template.as_deref().unwrap_or(FALLBACK_CHAT_TEMPLATE);
        let Some(tools) = &in_play else {
            // no tools now, but earlier calls and results in the history: a template that knows
            // no tools gets them as text (as when tools are in play)
            let history = messages.iter().any(|m| m.get("tool_calls").is_some() || m["role"] == "tool");
            let messages = if history && Style::of(tk, template) == Style::Generic {
                crate::tools::messages_for(messages, None, Style::Generic)
            } else {
                messages
            };
            return Ok((tk.encode_chat(&tk.render_chat(template, &messages, None)?)?, Style::Generic));
        };
        let style = Style::of(tk, template);
        let messages = crate::tools::messages_for(messages, Some(tools), style);
        let native = (style != Style::Generic).then_some(&tools.raw);
        Ok((tk.encode_chat(&tk.render_chat(template, &messages, native)?)?, style))
    })
    .await?;
    let tool_setup = match tools {
        None => None,
        Some(tools) => {
            let constrains = app.backend.constrains();
            match tools.format(style, &info.tokenizer) {
                Some(format) if constrains => settings.format = Some((format, "tools")),
                Some(_) if tools.forced() => {
                    return Err(ApiError::bad_param(
                        "tool_choice",
                        "a forced tool call (`required` or a named function) is not supported by this backend",
                    ))
                }
                // the model is free: its calls are recognised in its text
                _ if constrains => {
                    // the parameter schemas are still checked, as a forced call would compile them
                    let check = Tools { choice: Choice::Required, ..tools.clone() };
                    if let Some(f) = check.format(style, &info.tokenizer) {
                        constraint(&app, &info, &f, "tools").await?;
                    }
                }
                _ => {}
            }
            let shown = style.shown_ids(&info.tokenizer);
            Some(ToolSetup { parser: ToolParser::new(style, &tools), shown, style, seed })
        }
    };
    run(&app, &info, prompt, settings, Kind::Chat { id: format!("chatcmpl-{id}") }, t0, tool_setup).await
}

/// Tokenizing (and rendering a template) is CPU work: off the async threads.
async fn tokenize_with<T: Send + 'static>(
    tk: Arc<Tokenizer>,
    f: impl FnOnce(&Tokenizer) -> Result<T, brigade_format::FormatError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(move || f(&tk))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))?
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

/// A chat answer's tools: the parser of the model's text, the control tokens it must see, and
/// what call ids are made of.
struct ToolSetup {
    parser: ToolParser,
    shown: Vec<u32>,
    style: Style,
    seed: u64,
}

/// Which endpoint's JSON to write.
#[derive(Clone)]
enum Kind {
    Completion { id: String },
    Chat { id: String },
}

/// What the pump sends the responder.
enum Chunk {
    /// Text, and the log-probabilities of the tokens generated since the last chunk (when asked).
    Text(String, Vec<Scored>),
    /// The answer's `index`th tool call, with its id.
    Call(usize, String, ToolCall),
    /// `tokens` generated; `cached` prompt tokens the backend kept from an earlier request;
    /// `calls`: the answer made tool calls (its finish reason is then `tool_calls`).
    End {
        finish: Finish,
        tokens: usize,
        cached: usize,
        calls: bool,
    },
    Error(String),
}

/// One generated token's log-probabilities, as the API shows them.
#[derive(Debug, Clone)]
struct Scored {
    token: String,
    bytes: Vec<u8>,
    logprob: f32,
    /// The most likely alternatives: (token, bytes, logprob).
    top: Vec<(String, Vec<u8>, f32)>,
}

impl Scored {
    fn new(tk: &Tokenizer, id: u32, lp: &brigade_core::TokenLogprob) -> Self {
        let text = |id: u32| {
            let b = tk.piece(id).to_vec();
            (String::from_utf8_lossy(&b).into_owned(), b)
        };
        let (token, bytes) = text(id);
        let top = lp.top.iter().map(|&(i, l)| {
            let (t, b) = text(i);
            (t, b, l)
        });
        Scored { token, bytes, logprob: lp.logprob, top: top.collect() }
    }

    /// Chat's entry: `{"token", "logprob", "bytes", "top_logprobs": [...]}`.
    fn chat_json(&self) -> Value {
        let top: Vec<Value> =
            self.top.iter().map(|(t, b, l)| json!({"token": t, "logprob": finite(*l), "bytes": b})).collect();
        json!({"token": self.token, "logprob": finite(self.logprob), "bytes": self.bytes, "top_logprobs": top})
    }
}

/// A log-probability JSON can carry: OpenAI writes −9999 for an impossible token.
fn finite(l: f32) -> f32 {
    if l.is_finite() {
        l
    } else {
        -9999.0
    }
}

/// Completions' `logprobs`: parallel lists, `text_offset` counting characters from the
/// answer's start (`offset`: the characters of the tokens before these).
fn completion_logprobs(scored: &[Scored], offset: usize) -> Value {
    let mut offset = offset;
    let mut offsets = Vec::with_capacity(scored.len());
    for s in scored {
        offsets.push(offset);
        offset += s.token.chars().count();
    }
    let top: Vec<Value> = scored
        .iter()
        .map(|s| {
            let m: serde_json::Map<String, Value> =
                s.top.iter().map(|(t, _, l)| (t.clone(), json!(finite(*l)))).collect();
            Value::Object(m)
        })
        .collect();
    json!({"tokens": scored.iter().map(|s| s.token.clone()).collect::<Vec<_>>(),
           "token_logprobs": scored.iter().map(|s| finite(s.logprob)).collect::<Vec<_>>(),
           "top_logprobs": top, "text_offset": offsets})
}

/// OpenAI's `finish_reason` (an answer cut off by `max_tokens` says so, calls or not).
fn finish_reason(finish: Finish, calls: bool) -> &'static str {
    if calls && finish != Finish::Length {
        "tool_calls"
    } else {
        finish.as_str()
    }
}

async fn run<B: Backend>(
    app: &App<B>,
    info: &ModelInfo,
    prompt: Vec<u32>,
    s: Settings,
    kind: Kind,
    t0: Instant,
    tools: Option<ToolSetup>,
) -> Result<Response, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt is empty and this model adds no BOS token"));
    }
    if prompt.len() >= info.n_ctx {
        return Err(ApiError::context_exceeded(prompt.len(), info.n_ctx));
    }
    let room = info.n_ctx - prompt.len();
    if s.logprobs.is_some() && !app.backend.scores() {
        return Err(ApiError::bad_param("logprobs", "`logprobs` is not supported by this backend"));
    }
    let constraint = match &s.format {
        Some((format, field)) => Some(constraint(app, info, format, field).await?),
        None => None,
    };
    let req = EngineRequest {
        model: info.id.clone(),
        max_tokens: s.max_tokens.unwrap_or(room),
        prompt,
        sampling: s.sampling.clone(),
        ignore_eos: s.ignore_eos,
        stop: s.stop.clone(),
        constraint,
        format: s.format.as_ref().map(|f| f.0.clone()),
        logprobs: s.logprobs,
    };
    let n_prompt = req.prompt.len();
    let prev = req.prompt.last().copied();
    let events = app.backend.complete(req).await?;
    let (tx, mut rx) = mpsc::channel(64);
    let record = Record {
        metrics: app.metrics.clone(),
        model: info.id.clone(),
        endpoint: match kind {
            Kind::Completion { .. } => "/v1/completions",
            Kind::Chat { .. } => "/v1/chat/completions",
        },
        n_prompt,
        t0,
    };
    tokio::spawn(pump(events, info.tokenizer.clone(), prev, s.stop.clone(), tools, tx, record));
    let answer = Answer {
        kind,
        model: info.id.clone(),
        created: now(),
        n_prompt,
        include_usage: s.include_usage,
        offset: AtomicUsize::new(0),
    };
    if s.stream {
        let head = answer.head();
        let body = tokio_stream::wrappers::ReceiverStream::new(rx).flat_map(move |c| stream::iter(answer.events(c)));
        let events = stream::iter(head).chain(body).map(Ok::<Event, Infallible>);
        return Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response());
    }
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut scored = Vec::new();
    while let Some(c) = rx.recv().await {
        match c {
            Chunk::Text(t, s) => {
                text.push_str(&t);
                scored.extend(s);
            }
            Chunk::Call(index, id, call) => calls.push(call_json(index, &id, &call)),
            Chunk::End { finish, tokens, cached, calls: _ } => {
                let logprobs = s.logprobs.map(|_| scored);
                // (text offsets count from the answer's start)
                return Ok(
                    Json(answer.whole(&text, &calls, logprobs.as_deref(), finish, (tokens, cached))).into_response()
                );
            }
            Chunk::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::internal("the completion ended without an answer"))
}

/// `format` compiled against `info`'s vocabulary (built at the model's first constrained
/// request, off the async threads); a format that does not compile is a 400 naming `field`.
async fn constraint<B: Backend>(
    app: &App<B>,
    info: &ModelInfo,
    format: &Format,
    field: &'static str,
) -> Result<Constraint, ApiError> {
    if !app.backend.constrains() {
        return Err(ApiError::bad_param(field, format!("`{field}` is not supported by this backend")));
    }
    let known = app.vocabularies.lock().map_err(|_| ApiError::internal("vocabularies lock"))?.get(&info.id).cloned();
    let vocab = match known {
        Some(v) => v,
        None => {
            let tk = info.tokenizer.clone();
            let v = tokio::task::spawn_blocking(move || Vocabulary::new(&tk))
                .await
                .map_err(|e| ApiError::internal(format!("vocabulary task: {e}")))?
                .map_err(|e| ApiError::bad_param(field, e.to_string()))?;
            let v = Arc::new(v);
            app.vocabularies
                .lock()
                .map_err(|_| ApiError::internal("vocabularies lock"))?
                .insert(info.id.clone(), v.clone());
            v
        }
    };
    let format = format.clone();
    let grammar = tokio::task::spawn_blocking(move || vocab.compile(&format))
        .await
        .map_err(|e| ApiError::internal(format!("grammar task: {e}")))?
        .map_err(|e| ApiError::bad_param(field, format!("`{field}` cannot be used: {e}")))?;
    Ok(Constraint(Box::new(grammar)))
}

/// Turns the backend's events into text chunks: ids decoded as a stream (a character split
/// over tokens waits for its last byte), stop strings applied. Returns when the answer is
/// complete or the responder is gone; dropping `events` then cancels the job in the backend.
async fn pump(
    events: mpsc::UnboundedReceiver<EngineEvent>,
    tk: Arc<Tokenizer>,
    prev: Option<u32>,
    stops: Vec<String>,
    tools: Option<ToolSetup>,
    out: mpsc::Sender<Chunk>,
    record: Record,
) {
    let mut timing = Timing { first: None, last: None, tokens: 0 };
    let outcome = pump_events(events, tk, prev, stops, tools, out, &record, &mut timing).await;
    let r = &record;
    r.metrics.finished(RecentRequest {
        at: now(),
        model: r.model.clone(),
        endpoint: r.endpoint.into(),
        prompt_tokens: r.n_prompt,
        generated: timing.tokens,
        ttft_s: timing.first.map_or(0.0, |f| (f - r.t0).as_secs_f64()),
        duration_s: r.t0.elapsed().as_secs_f64(),
        outcome,
    });
}

/// What a completion's figures are recorded with.
struct Record {
    metrics: Arc<ServerMetrics>,
    model: String,
    endpoint: &'static str,
    n_prompt: usize,
    /// The request's arrival.
    t0: Instant,
}

struct Timing {
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
}

impl Timing {
    fn token(&mut self, r: &Record) {
        let now = Instant::now();
        if self.first.is_none() {
            self.first = Some(now);
            r.metrics.first_token(now - r.t0);
        }
        r.metrics.token(self.last.map(|l| now - l));
        self.last = Some(now);
        self.tokens += 1;
    }
}

/// [`pump`]'s loop; returns the outcome: the finish reason, the error, or "client gone".
#[allow(clippy::too_many_arguments)]
async fn pump_events(
    mut events: mpsc::UnboundedReceiver<EngineEvent>,
    tk: Arc<Tokenizer>,
    prev: Option<u32>,
    stops: Vec<String>,
    mut tools: Option<ToolSetup>,
    out: mpsc::Sender<Chunk>,
    record: &Record,
    timing: &mut Timing,
) -> String {
    let gone = || "client gone".to_string();
    let shown = tools.as_ref().map(|t| t.shown.clone()).unwrap_or_default();
    let mut text = tk.answer_showing(prev, stops, shown);
    let (mut tokens, mut cached) = (0usize, 0usize);
    // log-probabilities of tokens whose text has not gone out yet
    let mut scored: Vec<Scored> = Vec::new();
    loop {
        let ev = tokio::select! {
            _ = out.closed() => return gone(),
            ev = events.recv() => ev,
        };
        let (piece, end) = match ev {
            Some(EngineEvent::Token(id, lp)) => {
                timing.token(record);
                tokens += 1;
                if let Some(lp) = &lp {
                    scored.push(Scored::new(&tk, id, lp));
                }
                let piece = text.push(id);
                (piece, text.stopped().then_some((Finish::Stop, None)))
            }
            Some(EngineEvent::Started { cached_tokens }) => {
                cached = cached_tokens;
                continue;
            }
            Some(EngineEvent::Done(finish)) => {
                let piece = text.finish();
                let finish = if text.stopped() { Finish::Stop } else { finish };
                (piece, Some((finish, None)))
            }
            Some(EngineEvent::Error(e)) => (String::new(), Some((Finish::Stop, Some(e)))),
            None => (String::new(), Some((Finish::Stop, Some("the backend dropped the request".to_string())))),
        };
        let mut chunks = Vec::new();
        match &mut tools {
            None if !piece.is_empty() => chunks.push(Chunk::Text(piece, Vec::new())),
            None => {}
            Some(t) => {
                let mut index = t.parser.calls();
                let mut deltas = t.parser.push(&piece);
                if end.is_some() {
                    deltas.extend(t.parser.finish());
                }
                for d in deltas {
                    chunks.push(match d {
                        Delta::Content(c) => Chunk::Text(c, Vec::new()),
                        Delta::Call(call) => {
                            index += 1;
                            Chunk::Call(index - 1, t.style.call_id(t.seed, index - 1), call)
                        }
                    });
                }
            }
        }
        // the scores go with the first text that goes out (or alone, at the end)
        if !scored.is_empty() {
            match chunks.iter_mut().find(|c| matches!(c, Chunk::Text(..))) {
                Some(Chunk::Text(_, s)) => s.append(&mut scored),
                _ if end.is_some() => chunks.push(Chunk::Text(String::new(), std::mem::take(&mut scored))),
                _ => {}
            }
        }
        for c in chunks {
            if out.send(c).await.is_err() {
                return gone();
            }
        }
        if let Some((finish, error)) = end {
            let calls = tools.as_ref().is_some_and(|t| t.parser.calls() > 0);
            let (end, outcome) = match error {
                Some(e) => (Chunk::Error(e.clone()), format!("error: {e}")),
                None => (Chunk::End { finish, tokens, cached, calls }, finish_reason(finish, calls).to_string()),
            };
            let _ = out.send(end).await;
            return outcome;
        }
    }
}

/// One tool call as OpenAI writes it (in a message, and in a stream's delta with its index).
fn call_json(index: usize, id: &str, call: &ToolCall) -> Value {
    json!({"index": index, "id": id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}})
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// One response's constant parts and its JSON.
struct Answer {
    kind: Kind,
    model: String,
    created: u64,
    n_prompt: usize,
    include_usage: bool,
    /// Characters of the tokens whose scores were streamed (completions' `text_offset`).
    offset: AtomicUsize,
}

impl Answer {
    /// OpenAI's `usage`: `tokens` generated, `cached` of the prompt's tokens not read again.
    fn usage(&self, (tokens, cached): (usize, usize)) -> Value {
        json!({"prompt_tokens": self.n_prompt, "completion_tokens": tokens, "total_tokens": self.n_prompt + tokens,
               "prompt_tokens_details": {"cached_tokens": cached}})
    }

    /// The non-streamed answer.
    fn whole(
        &self,
        text: &str,
        calls: &[Value],
        logprobs: Option<&[Scored]>,
        finish: Finish,
        counts: (usize, usize),
    ) -> Value {
        let (id, object, choice) = match &self.kind {
            Kind::Completion { id } => (
                id,
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": logprobs.map(|l| completion_logprobs(l, 0)),
                       "finish_reason": finish.as_str()}),
            ),
            Kind::Chat { id } => {
                let mut message = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    // as OpenAI: no `index` inside a message, and no content but the calls'
                    let calls: Vec<Value> = calls
                        .iter()
                        .map(|c| {
                            let mut c = c.clone();
                            if let Value::Object(m) = &mut c {
                                m.shift_remove("index");
                            }
                            c
                        })
                        .collect();
                    message["tool_calls"] = Value::Array(calls);
                    if text.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                (
                    id,
                    "chat.completion",
                    json!({"index": 0, "message": message,
                           "logprobs": logprobs.map(|l| json!({"content": l.iter().map(Scored::chat_json).collect::<Vec<_>>(),
                                                              "refusal": null})),
                           "finish_reason": finish_reason(finish, !calls.is_empty())}),
                )
            }
        };
        json!({"id": id, "object": object, "created": self.created, "model": self.model, "choices": [choice],
               "usage": self.usage(counts)})
    }

    /// A streamed chunk with one choice: `text` (or, for chat, a delta) and a finish reason.
    fn chunk(&self, text: Option<&str>, finish: Option<&str>, role: bool) -> Value {
        let (id, object, choice) = match &self.kind {
            Kind::Completion { id } => (
                id,
                "text_completion",
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}),
            ),
            Kind::Chat { id } => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t);
                }
                (
                    id,
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
                )
            }
        };
        let mut j =
            json!({"id": id, "object": object, "created": self.created, "model": self.model, "choices": [choice]});
        if self.include_usage {
            j["usage"] = Value::Null;
        }
        j
    }

    fn data(v: &Value) -> Event {
        Event::default().data(v.to_string())
    }

    /// What goes before the first token: for chat, the assistant's role.
    fn head(&self) -> Vec<Event> {
        match self.kind {
            Kind::Chat { .. } => vec![Self::data(&self.chunk(Some(""), None, true))],
            Kind::Completion { .. } => Vec::new(),
        }
    }

    fn events(&self, c: Chunk) -> Vec<Event> {
        match c {
            Chunk::Text(t, scored) => {
                let mut j = self.chunk(Some(&t), None, false);
                if !scored.is_empty() {
                    j["choices"][0]["logprobs"] = match self.kind {
                        Kind::Chat { .. } => {
                            json!({"content": scored.iter().map(Scored::chat_json).collect::<Vec<_>>(),
                                   "refusal": null})
                        }
                        Kind::Completion { .. } => {
                            let chars = scored.iter().map(|s| s.token.chars().count()).sum();
                            completion_logprobs(&scored, self.offset.fetch_add(chars, Ordering::Relaxed))
                        }
                    };
                }
                vec![Self::data(&j)]
            }
            Chunk::Call(index, id, call) => {
                let mut j = self.chunk(None, None, false);
                j["choices"][0]["delta"]["tool_calls"] = json!([call_json(index, &id, &call)]);
                vec![Self::data(&j)]
            }
            Chunk::End { finish, tokens, cached, calls } => {
                let text = match self.kind {
                    Kind::Chat { .. } => None,
                    Kind::Completion { .. } => Some(""),
                };
                let mut v = vec![Self::data(&self.chunk(text, Some(finish_reason(finish, calls)), false))];
                if self.include_usage {
                    let (id, object) = match &self.kind {
                        Kind::Completion { id } => (id, "text_completion"),
                        Kind::Chat { id } => (id, "chat.completion.chunk"),
                    };
                    let u = json!({"id": id, "object": object, "created": self.created, "model": self.model,
                                   "choices": [], "usage": self.usage((tokens, cached))});
                    v.push(Self::data(&u));
                }
                v.push(Event::default().data("[DONE]"));
                v
            }
            Chunk::Error(e) => vec![Self::data(&ApiError::internal(e).body())],
        }
    }
}
