//! The axum application: routes, API keys, body limits, and the two completion endpoints in
//! one flow — parse, check, tokenize, [`Backend::complete`], then the backend's token ids
//! turned into text (UTF-8 held back until whole, stop strings held back until they cannot
//! match) sent as one JSON answer or as server-sent events.

use crate::backend::{Backend, EngineEvent, EngineRequest, Finish, ModelInfo};
use crate::error::ApiError;
use crate::keys::{ApiKeys, KeyError};
use crate::metrics::{RecentRequest, ServerMetrics};
use crate::openai::{ChatRequest, CompletionRequest, Prompt, Settings};
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
use std::sync::atomic::{AtomicU64, Ordering};
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
    tokio::task::spawn_blocking(move || f(&tk))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))?
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

async fn completions<B: Backend>(State(app): State<Arc<App<B>>>, body: Body) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let req: CompletionRequest = parse(&read_body(body, app.cfg.max_body_bytes).await?)?;
    req.check_unsupported()?;
    let info = app.find(req.model.as_deref())?;
    let (id, seed) = app.next_id();
    let settings = req.params.settings(seed)?;
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
    run(&app, &info, prompt, settings, kind, t0).await
}

async fn chat<B: Backend>(State(app): State<Arc<App<B>>>, body: Body) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let req: ChatRequest = parse(&read_body(body, app.cfg.max_body_bytes).await?)?;
    req.check_unsupported()?;
    let info = app.find(req.model.as_deref())?;
    let (id, seed) = app.next_id();
    let settings = req.params.settings(seed)?;
    let turns = req.turns()?;
    let prompt = tokenize(info.tokenizer.clone(), move |tk| {
        let template = tk.chat_template.as_deref().unwrap_or(FALLBACK_CHAT_TEMPLATE);
        tk.encode_chat(&tk.render_chat_template(template, &turns)?)
    })
    .await?;
    run(&app, &info, prompt, settings, Kind::Chat { id: format!("chatcmpl-{id}") }, t0).await
}

/// Which endpoint's JSON to write.
#[derive(Clone)]
enum Kind {
    Completion { id: String },
    Chat { id: String },
}

/// What the pump sends the responder.
enum Chunk {
    Text(String),
    /// `tokens` generated; `cached` prompt tokens the backend kept from an earlier request.
    End {
        finish: Finish,
        tokens: usize,
        cached: usize,
    },
    Error(String),
}

async fn run<B: Backend>(
    app: &App<B>,
    info: &ModelInfo,
    prompt: Vec<u32>,
    s: Settings,
    kind: Kind,
    t0: Instant,
) -> Result<Response, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt is empty and this model adds no BOS token"));
    }
    if prompt.len() >= info.n_ctx {
        return Err(ApiError::context_exceeded(prompt.len(), info.n_ctx));
    }
    let room = info.n_ctx - prompt.len();
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
    tokio::spawn(pump(events, info.tokenizer.clone(), prev, s.stop.clone(), tx, record));
    let answer = Answer { kind, model: info.id.clone(), created: now(), n_prompt, include_usage: s.include_usage };
    if s.stream {
        let head = answer.head();
        let body = tokio_stream::wrappers::ReceiverStream::new(rx).flat_map(move |c| stream::iter(answer.events(c)));
        let events = stream::iter(head).chain(body).map(Ok::<Event, Infallible>);
        return Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response());
    }
    let mut text = String::new();
    while let Some(c) = rx.recv().await {
        match c {
            Chunk::Text(t) => text.push_str(&t),
            Chunk::End { finish, tokens, cached } => {
                return Ok(Json(answer.whole(&text, finish, (tokens, cached))).into_response())
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
        return Err(ApiError::bad_param(
            field,
            format!("`{field}` is not supported by this server yet (a cluster samples on its last worker)"),
        ));
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
    out: mpsc::Sender<Chunk>,
    record: Record,
) {
    let mut timing = Timing { first: None, last: None, tokens: 0 };
    let outcome = pump_events(events, tk, prev, stops, out, &record, &mut timing).await;
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
async fn pump_events(
    mut events: mpsc::UnboundedReceiver<EngineEvent>,
    tk: Arc<Tokenizer>,
    prev: Option<u32>,
    stops: Vec<String>,
    out: mpsc::Sender<Chunk>,
    record: &Record,
    timing: &mut Timing,
) -> String {
    let gone = || "client gone".to_string();
    let mut text = tk.answer(prev, stops);
    let (mut tokens, mut cached) = (0usize, 0usize);
    loop {
        let ev = tokio::select! {
            _ = out.closed() => return gone(),
            ev = events.recv() => ev,
        };
        let (piece, end) = match ev {
            Some(EngineEvent::Token(id)) => {
                timing.token(record);
                tokens += 1;
                let piece = text.push(id);
                (piece, text.stopped().then_some(Chunk::End { finish: Finish::Stop, tokens, cached }))
            }
            Some(EngineEvent::Started { cached_tokens }) => {
                cached = cached_tokens;
                continue;
            }
            Some(EngineEvent::Done(finish)) => {
                let piece = text.finish();
                let finish = if text.stopped() { Finish::Stop } else { finish };
                (piece, Some(Chunk::End { finish, tokens, cached }))
            }
            Some(EngineEvent::Error(e)) => (String::new(), Some(Chunk::Error(e))),
            None => (String::new(), Some(Chunk::Error("the backend dropped the request".into()))),
        };
        if !piece.is_empty() && out.send(Chunk::Text(piece)).await.is_err() {
            return gone();
        }
        if let Some(end) = end {
            let outcome = match &end {
                Chunk::End { finish, .. } => finish.as_str().to_string(),
                Chunk::Error(e) => format!("error: {e}"),
                Chunk::Text(_) => String::new(),
            };
            let _ = out.send(end).await;
            return outcome;
        }
    }
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
}

impl Answer {
    /// OpenAI's `usage`: `tokens` generated, `cached` of the prompt's tokens not read again.
    fn usage(&self, (tokens, cached): (usize, usize)) -> Value {
        json!({"prompt_tokens": self.n_prompt, "completion_tokens": tokens, "total_tokens": self.n_prompt + tokens,
               "prompt_tokens_details": {"cached_tokens": cached}})
    }

    /// The non-streamed answer.
    fn whole(&self, text: &str, finish: Finish, counts: (usize, usize)) -> Value {
        let (id, object, choice) = match &self.kind {
            Kind::Completion { id } => (
                id,
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str()}),
            ),
            Kind::Chat { id } => (
                id,
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null,
                       "finish_reason": finish.as_str()}),
            ),
        };
        json!({"id": id, "object": object, "created": self.created, "model": self.model, "choices": [choice],
               "usage": self.usage(counts)})
    }

    /// A streamed chunk with one choice: `text` (or, for chat, a delta) and a finish reason.
    fn chunk(&self, text: Option<&str>, finish: Option<Finish>, role: bool) -> Value {
        let finish = finish.map(Finish::as_str);
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
            Chunk::Text(t) => vec![Self::data(&self.chunk(Some(&t), None, false))],
            Chunk::End { finish, tokens, cached } => {
                let text = match self.kind {
                    Kind::Chat { .. } => None,
                    Kind::Completion { .. } => Some(""),
                };
                let mut v = vec![Self::data(&self.chunk(text, Some(finish), false))];
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
