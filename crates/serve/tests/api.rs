//! The HTTP API against a scripted backend, through the router (no sockets): answers, streams,
//! stop strings, usage, cancellation and every error's status and shape.
#![allow(clippy::unwrap_used)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use brigade_format::{ModelIndex, Tokenizer};
use brigade_serve::{
    router, ApiError, Backend, DeploymentView, DeviceView, EngineEvent, EngineRequest, Finish, Load, ModelInfo,
    NodeView, Overview, ServeConfig, StageView,
};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tower::ServiceExt;

/// Answers every request with the ids of `script` (then `finish`), one by one; remembers the
/// requests and the senders (to see them closed).
struct Scripted {
    tk: Arc<Tokenizer>,
    script: Vec<u32>,
    finish: Finish,
    busy: bool,
    seen: Mutex<Vec<EngineRequest>>,
    senders: Mutex<Vec<mpsc::UnboundedSender<EngineEvent>>>,
    /// Send the whole script at once (else: only the first token, the rest never comes).
    complete: bool,
    /// What `overview` answers.
    overview: Option<Overview>,
    /// Prompt tokens the backend says it kept (a `Started` event first).
    cached: Option<usize>,
    /// The models it serves, all with the same tokenizer.
    models: Vec<&'static str>,
    /// Their context.
    n_ctx: usize,
}

fn tokenizer() -> Arc<Tokenizer> {
    let idx = ModelIndex::from_static_gguf(brigade_format::embedded_model(), "stories").unwrap();
    idx.tokenizer().clone()
}

fn scripted(text: &str, finish: Finish) -> Scripted {
    let tk = tokenizer();
    let script = tk.encode(text, false).unwrap();
    Scripted {
        tk,
        script,
        finish,
        busy: false,
        seen: Mutex::default(),
        senders: Mutex::default(),
        complete: true,
        overview: None,
        cached: None,
        models: vec!["tiny"],
        n_ctx: 64,
    }
}

impl Backend for Scripted {
    fn models(&self) -> Vec<ModelInfo> {
        self.models
            .iter()
            .map(|id| ModelInfo {
                id: id.to_string(),
                n_ctx: self.n_ctx,
                tokenizer: self.tk.clone(),
                created: 1,
                owned_by: "test".into(),
            })
            .collect()
    }

    async fn complete(&self, req: EngineRequest) -> Result<mpsc::UnboundedReceiver<EngineEvent>, ApiError> {
        if self.busy {
            return Err(ApiError::busy("all 1 slots are busy"));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let n = self.script.len().min(req.max_tokens);
        if let Some(cached_tokens) = self.cached {
            let _ = tx.send(EngineEvent::Started { cached_tokens });
        }
        if self.complete {
            for &t in &self.script[..n] {
                let _ = tx.send(EngineEvent::Token(t, None));
            }
            let finish = if n < self.script.len() { Finish::Length } else { self.finish };
            let _ = tx.send(EngineEvent::Done(finish));
        } else {
            let _ = tx.send(EngineEvent::Token(self.script[0], None));
        }
        self.seen.lock().unwrap().push(req);
        self.senders.lock().unwrap().push(tx);
        Ok(rx)
    }

    fn load(&self) -> Option<Load> {
        Some(Load { slots: 4, processing: 1, waiting: 2 })
    }

    async fn overview(&self) -> Option<Overview> {
        self.overview.clone()
    }
}

async fn call(
    app: axum::Router,
    method: &str,
    path: &str,
    body: Option<Value>,
    key: Option<&str>,
) -> (StatusCode, Vec<u8>) {
    let mut b = Request::builder().method(method).uri(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    let body = body.map(|v| Body::from(v.to_string())).unwrap_or_else(Body::empty);
    let resp = app.oneshot(b.body(body).unwrap()).await.unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes().to_vec())
}

fn json_of(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
}

fn app(b: Scripted) -> (axum::Router, Arc<Scripted>) {
    let b = Arc::new(b);
    (router(b.clone(), ServeConfig::default()), b)
}

const TEXT: &str = "Once upon a time there was a cat. END of story";

#[tokio::test]
async fn completions_and_chat_answer_with_usage() {
    let (app, b) = app(scripted(TEXT, Finish::Stop));
    let (st, body) = call(
        app.clone(),
        "POST",
        "/v1/completions",
        Some(json!({"model": "tiny", "prompt": "Hi", "temperature": 0})),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let j = json_of(&body);
    assert_eq!(j["object"], "text_completion");
    assert_eq!(j["choices"][0]["text"], b.tk.decode(&b.script, b.tk.encode("Hi", true).unwrap().last().copied()));
    assert_eq!(j["choices"][0]["finish_reason"], "stop");
    let n_prompt = b.tk.encode("Hi", true).unwrap().len();
    assert_eq!(
        j["usage"],
        json!({"prompt_tokens": n_prompt, "completion_tokens": b.script.len(), "total_tokens": n_prompt + b.script.len(),
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    {
        let seen = b.seen.lock().unwrap();
        assert_eq!(seen[0].prompt, b.tk.encode("Hi", true).unwrap());
        assert_eq!(seen[0].sampling.temperature, 0.0);
        // no max_tokens: up to the context
        assert_eq!(seen[0].max_tokens, 64 - n_prompt);
    }
    let (st, body) = call(
        app.clone(),
        "POST",
        "/v1/chat/completions",
        Some(json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let j = json_of(&body);
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["choices"][0]["message"]["role"], "assistant");
    assert_eq!(j["choices"][0]["finish_reason"], "length");
    assert_eq!(j["usage"]["completion_tokens"], 3);
    // the model has no template: ChatML renders the turn
    let want = b.tk.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", true).unwrap();
    assert_eq!(b.seen.lock().unwrap()[1].prompt, want);
    let (st, body) = call(app.clone(), "GET", "/v1/models", None, None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(json_of(&body)["data"][0]["id"], "tiny");
    assert_eq!(json_of(&body)["data"][0]["meta"]["n_vocab"], b.tk.vocab_size());
    let (_, body) = call(app.clone(), "GET", "/health", None, None).await;
    assert_eq!(json_of(&body), json!({"status": "ok", "slots_idle": 3, "slots_processing": 1, "requests_waiting": 2}));
}

#[tokio::test]
async fn a_stop_string_ends_the_answer_and_the_job() {
    let (app, b) = app(scripted(TEXT, Finish::Length));
    let (st, body) = call(
        app,
        "POST",
        "/v1/completions",
        Some(json!({"model": "tiny", "prompt": "Hi", "stop": ["END", "zzz"]})),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let j = json_of(&body);
    let text = j["choices"][0]["text"].as_str().unwrap();
    assert!(text.ends_with("cat. "), "{text:?}");
    assert!(!text.contains("END"));
    assert_eq!(j["choices"][0]["finish_reason"], "stop");
    // the tokens up to the one that completed the stop string count
    let used = j["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert!(used < b.script.len() && used > 5, "{used}");
    // and the backend's receiver is gone; the backend was told the stops too
    assert!(b.senders.lock().unwrap()[0].is_closed());
    assert_eq!(b.seen.lock().unwrap()[0].stop, ["END", "zzz"]);
}

/// The data lines of an SSE body.
fn sse(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body).lines().filter_map(|l| l.strip_prefix("data: ").map(str::to_string)).collect()
}

#[tokio::test]
async fn streams_end_with_done_and_usage_when_asked() {
    // a backend that kept 2 of the prompt's tokens from an earlier request says so first
    let (app, b) = app(Scripted { cached: Some(2), ..scripted(TEXT, Finish::Stop) });
    let req = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": true,
                     "stream_options": {"include_usage": true}});
    let (st, body) = call(app.clone(), "POST", "/v1/chat/completions", Some(req), None).await;
    assert_eq!(st, StatusCode::OK);
    let data = sse(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    let prev = b.seen.lock().unwrap()[0].prompt.last().copied();
    assert_eq!(text, b.tk.decode(&b.script, prev));
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], b.script.len());
    assert_eq!(usage["usage"]["prompt_tokens_details"], json!({"cached_tokens": 2}));
    assert!(chunks[1]["usage"].is_null());
    // completions stream: text chunks, no usage unless asked
    let (_, body) = call(
        app,
        "POST",
        "/v1/completions",
        Some(json!({"model": "tiny", "prompt": [1, 2], "stream": true, "max_tokens": 4})),
        None,
    )
    .await;
    let data = sse(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion" && c.get("usage").is_none()));
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn a_client_gone_mid_stream_cancels_the_job() {
    let mut s = scripted(TEXT, Finish::Stop);
    s.complete = false;
    let (app, b) = app(s);
    let req = Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .body(Body::from(json!({"model": "tiny", "prompt": "Hi", "stream": true}).to_string()))
        .unwrap();
    let resp = app.oneshot(req).await.unwrap();
    let mut body = resp.into_body();
    // the first token arrives
    let frame = body.frame().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(frame.data_ref().unwrap()).contains("text_completion"));
    assert!(!b.senders.lock().unwrap()[0].is_closed());
    drop(body);
    let t0 = std::time::Instant::now();
    while !b.senders.lock().unwrap()[0].is_closed() {
        assert!(t0.elapsed().as_secs() < 5, "the job was never cancelled");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Asserts an OpenAI-shaped error with this status, and returns its message.
fn error(st: StatusCode, body: &[u8], want: StatusCode) -> String {
    assert_eq!(st, want, "{}", String::from_utf8_lossy(body));
    let j = json_of(body);
    let e = &j["error"];
    assert!(e["type"].is_string() && e.get("code").is_some() && e.get("param").is_some(), "{j}");
    e["message"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn model_may_be_left_out_when_one_is_served() {
    let (one, b) = app(scripted(TEXT, Finish::Stop));
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "Hi", "temperature": 0})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0})),
    ] {
        let (st, out) = call(one.clone(), "POST", path, Some(body), None).await;
        assert_eq!(st, StatusCode::OK, "{path}: {}", String::from_utf8_lossy(&out));
        assert_eq!(json_of(&out)["model"], "tiny", "{path}: the answer names the model it used");
    }
    assert_eq!(b.seen.lock().unwrap().iter().map(|r| r.model.as_str()).collect::<Vec<_>>(), ["tiny", "tiny"]);

    let mut two = scripted(TEXT, Finish::Stop);
    two.models = vec!["tiny", "small"];
    let (two, b) = app(two);
    let (st, out) = call(two.clone(), "POST", "/v1/completions", Some(json!({"prompt": "Hi"})), None).await;
    let m = error(st, &out, StatusCode::BAD_REQUEST);
    assert!(m.contains("`model` is required") && m.contains("tiny, small"), "{m}");
    assert_eq!(json_of(&out)["error"]["param"], "model");
    let body = json!({"model": "small", "prompt": "Hi", "max_tokens": 2});
    let (st, _) = call(two, "POST", "/v1/completions", Some(body), None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(b.seen.lock().unwrap().len(), 1, "the refused request reached the backend");

    let mut none = scripted(TEXT, Finish::Stop);
    none.models = vec![];
    let (none, _) = app(none);
    let (st, out) = call(none, "POST", "/v1/completions", Some(json!({"prompt": "Hi"})), None).await;
    assert_eq!(error(st, &out, StatusCode::NOT_FOUND), "this server has no model yet");
}

#[tokio::test]
async fn bad_requests_get_their_status_in_openais_shape() {
    let (app, _) = app(scripted(TEXT, Finish::Stop));
    let post = |path: &'static str, body: Body| {
        let app = app.clone();
        async move {
            let resp = app.oneshot(Request::builder().method("POST").uri(path).body(body).unwrap()).await.unwrap();
            let st = resp.status();
            (st, resp.into_body().collect().await.unwrap().to_bytes().to_vec())
        }
    };
    let (st, b) = post("/v1/completions", Body::from("{\"model\": \"tiny\", \"prompt\": ")).await;
    assert!(error(st, &b, StatusCode::BAD_REQUEST).contains("invalid request body"));
    let (st, b) = post("/v1/completions", Body::from(r#"{"model": "tiny", "prompt": "x", "max_tokens": "ten"}"#)).await;
    error(st, &b, StatusCode::BAD_REQUEST);
    let (st, b) = post("/v1/completions", Body::from(r#"{"model": "tiny", "prompt": "x", "max_tokens": -3}"#)).await;
    assert!(error(st, &b, StatusCode::BAD_REQUEST).contains("-3"));
    let (st, b) =
        post("/v1/chat/completions", Body::from(r#"{"model": "big", "messages": [{"role": "user", "content": "x"}]}"#))
            .await;
    assert!(error(st, &b, StatusCode::NOT_FOUND).contains("tiny"));
    let long = "a b c d e f g h i j ".repeat(20);
    let (st, b) = post("/v1/completions", Body::from(json!({"model": "tiny", "prompt": long}).to_string())).await;
    let m = error(st, &b, StatusCode::BAD_REQUEST);
    assert!(m.contains("64") && m.contains("tokens"), "{m}");
    let (st, b) = post("/v1/completions", Body::from(json!({"model": "tiny", "prompt": [5000000]}).to_string())).await;
    error(st, &b, StatusCode::BAD_REQUEST);
    let (st, b) = post("/v1/completions", Body::from(vec![b' '; 9 << 20])).await;
    error(st, &b, StatusCode::PAYLOAD_TOO_LARGE);
    let (st, b) = post("/v1/nothing", Body::empty()).await;
    error(st, &b, StatusCode::NOT_FOUND);
    let (st, b) =
        post("/v1/completions", Body::from(json!({"model": "tiny", "prompt": "x", "n": 3}).to_string())).await;
    error(st, &b, StatusCode::BAD_REQUEST);

    let mut busy = scripted(TEXT, Finish::Stop);
    busy.busy = true;
    let (busy, _) = app_with(busy, ServeConfig::default());
    let (st, b) = call(busy, "POST", "/v1/completions", Some(json!({"model": "tiny", "prompt": "x"})), None).await;
    error(st, &b, StatusCode::SERVICE_UNAVAILABLE);
}

fn app_with(b: Scripted, cfg: ServeConfig) -> (axum::Router, Arc<Scripted>) {
    let b = Arc::new(b);
    (router(b.clone(), cfg), b)
}

#[tokio::test]
async fn api_keys_guard_v1_but_not_health() {
    let cfg = ServeConfig { keys: brigade_serve::ApiKeys::new(&["sekrit"], &[]), ..Default::default() };
    let (app, _) = app_with(scripted(TEXT, Finish::Stop), cfg);
    let req = Some(json!({"model": "tiny", "prompt": "x", "max_tokens": 2}));
    let (st, b) = call(app.clone(), "POST", "/v1/completions", req.clone(), None).await;
    assert!(error(st, &b, StatusCode::UNAUTHORIZED).contains("required"));
    let (st, b) = call(app.clone(), "POST", "/v1/completions", req.clone(), Some("wrong")).await;
    error(st, &b, StatusCode::UNAUTHORIZED);
    let (st, b) = call(app.clone(), "GET", "/v1/models", None, None).await;
    error(st, &b, StatusCode::UNAUTHORIZED);
    let (st, _) = call(app.clone(), "POST", "/v1/completions", req, Some("sekrit")).await;
    assert_eq!(st, StatusCode::OK);
    let (st, _) = call(app, "GET", "/health", None, None).await;
    assert_eq!(st, StatusCode::OK);
}

#[tokio::test]
async fn the_dashboard_and_metrics_can_be_put_behind_the_keys() {
    let keys = brigade_serve::ApiKeys::new(&["infer"], &["admin"]);
    let cfg = ServeConfig { keys, protect_metrics: true, ..Default::default() };
    let (app, _) = app_with(scripted(TEXT, Finish::Stop), cfg);
    for path in ["/", "/metrics"] {
        let (st, b) = call(app.clone(), "GET", path, None, None).await;
        assert!(error(st, &b, StatusCode::UNAUTHORIZED).contains("required"), "{path}");
        let (st, b) = call(app.clone(), "GET", path, None, Some("guess")).await;
        error(st, &b, StatusCode::UNAUTHORIZED);
        for key in ["infer", "admin"] {
            let (st, _) = call(app.clone(), "GET", path, None, Some(key)).await;
            assert_eq!(st, StatusCode::OK, "{path} with {key}");
        }
    }
    let (st, _) = call(app.clone(), "GET", "/health", None, None).await;
    assert_eq!(st, StatusCode::OK);
    // without the option they stay open, as before
    let cfg = ServeConfig { keys: brigade_serve::ApiKeys::new(&["infer"], &[]), ..Default::default() };
    let (app, _) = app_with(scripted(TEXT, Finish::Stop), cfg);
    let (st, _) = call(app, "GET", "/metrics", None, None).await;
    assert_eq!(st, StatusCode::OK);
}

/// A body that stops arriving is answered 408 once the 30 s body deadline passes (on tokio's
/// paused clock: the test takes no real time), naming the bytes that came.
#[tokio::test(start_paused = true)]
async fn a_body_that_stops_arriving_is_answered_408_at_the_deadline() {
    let (app, _) = app(scripted(TEXT, Finish::Stop));
    let first: Result<axum::body::Bytes, std::io::Error> = Ok(axum::body::Bytes::from_static(b"{\"model\": \"ti"));
    let trickle = futures_util::StreamExt::chain(futures_util::stream::iter([first]), futures_util::stream::pending());
    let req = Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from_stream(trickle))
        .unwrap();
    let t0 = tokio::time::Instant::now();
    let resp = app.oneshot(req).await.unwrap();
    let waited = t0.elapsed();
    let status = resp.status();
    let b = resp.into_body().collect().await.unwrap().to_bytes().to_vec();
    let message = error(status, &b, StatusCode::REQUEST_TIMEOUT);
    assert!(message.contains("30 s") && message.contains("13 bytes"), "{message}");
    assert!(waited >= brigade_serve::server::BODY_TIMEOUT && waited < brigade_serve::server::BODY_TIMEOUT * 2);
}

/// A two-stage deployment on two nodes, 10 decode steps measured.
fn two_stages() -> Overview {
    let stage = |i: usize, node: &str| StageView {
        index: i,
        node: node.into(),
        device: "cpu".into(),
        layers: (3 * i as u32, 3 * i as u32 + 3),
        state: "ready".into(),
        weight_bytes: 1000 + i as u64,
        kv_bytes: 500,
        predicted_s: 0.004,
        compute_s_total: 0.05 * (i + 1) as f64,
        hop_s_total: 0.01,
        hop_bytes_total: 40960.0,
    };
    Overview {
        source: "test".into(),
        nodes: ["n1", "n2<b>"]
            .iter()
            .map(|n| NodeView {
                name: n.to_string(),
                address: "10.0.0.1:7071".into(),
                state: "up".into(),
                heartbeat_age_s: 0.5,
                devices: vec![DeviceView { name: "cpu".into(), memory_total: 1 << 30, ..Default::default() }],
            })
            .map(|mut n| {
                // n1 is a GPU gateway: its GPU beside its CPU, with the measured host link
                if n.name == "n1" {
                    n.devices.push(DeviceView {
                        name: "cuda0".into(),
                        model: "NVIDIA H200".into(),
                        kind: "cuda".into(),
                        memory_total: 141 << 30,
                        host_link_bandwidth: 25.5e9,
                        ..Default::default()
                    });
                }
                n
            })
            .collect(),
        links: Vec::new(),
        deployments: vec![DeploymentView {
            name: "tiny".into(),
            state: "ready".into(),
            predicted_decode_s: 0.008,
            measured_decode_s: 0.02,
            tokens_generated: 10,
            decode_steps: 10,
            drafted_tokens: 12,
            accepted_tokens: 7,
            stages: vec![stage(0, "n1"), stage(1, "n2<b>")],
            svg: "<svg xmlns=\"http://www.w3.org/2000/svg\"><text>plan</text></svg>".into(),
            error: String::new(),
        }],
    }
}

fn sample(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample `{name_and_labels}` in:\n{text}"))
}

#[tokio::test]
async fn metrics_count_requests_and_show_the_overview() {
    let mut b = scripted(TEXT, Finish::Stop);
    b.overview = Some(two_stages());
    let (app, _) = app(b);
    let (st, _) =
        call(app.clone(), "POST", "/v1/completions", Some(json!({"model": "tiny", "prompt": "Once"})), None).await;
    assert_eq!(st, StatusCode::OK);
    let (st, _) =
        call(app.clone(), "POST", "/v1/completions", Some(json!({"model": "nope", "prompt": "x"})), None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, body) = call(app.clone(), "GET", "/metrics", None, None).await;
    assert_eq!(st, StatusCode::OK);
    let m = String::from_utf8(body).unwrap();
    assert_eq!(sample(&m, "brigade_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"), 1.0);
    assert_eq!(sample(&m, "brigade_requests_total{endpoint=\"/v1/completions\",status=\"404\"}"), 1.0);
    let n_tokens = tokenizer().encode(TEXT, false).unwrap().len() as f64;
    assert_eq!(sample(&m, "brigade_generated_tokens_total"), n_tokens);
    assert_eq!(sample(&m, "brigade_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(sample(&m, "brigade_inter_token_seconds_count"), n_tokens - 1.0);
    assert_eq!(sample(&m, "brigade_sessions_active"), 1.0);
    assert_eq!(sample(&m, "brigade_requests_waiting"), 2.0);
    let stage1 = "{deployment=\"tiny\",stage=\"1\",node=\"n2<b>\",device=\"cpu\"}";
    assert!((sample(&m, &format!("brigade_stage_compute_seconds_total{stage1}")) - 0.1).abs() < 1e-9, "{m}");
    let hop0 = "{deployment=\"tiny\",stage=\"0\",from=\"n1\",to=\"n2<b>\"}";
    assert_eq!(sample(&m, &format!("brigade_hop_transfer_bytes_total{hop0}")), 40960.0);
    assert_eq!(sample(&m, "brigade_deployment_predicted_decode_seconds_per_token{deployment=\"tiny\"}"), 0.008);
    assert_eq!(sample(&m, "brigade_deployment_draft_tokens_total{deployment=\"tiny\"}"), 12.0);
    assert_eq!(sample(&m, "brigade_deployment_draft_tokens_accepted_total{deployment=\"tiny\"}"), 7.0);
    assert_eq!(sample(&m, "brigade_deployment_measured_decode_seconds_per_token{deployment=\"tiny\"}"), 0.02);
    assert_eq!(sample(&m, "brigade_device_weight_bytes{node=\"n2<b>\",device=\"cpu\"}"), 1001.0);
    assert_eq!(sample(&m, "brigade_node_heartbeat_age_seconds{node=\"n1\"}"), 0.5);

    // the dashboard: the same figures, escaped, the planner's SVG inline, no script
    let (st, body) = call(app.clone(), "GET", "/", None, None).await;
    assert_eq!(st, StatusCode::OK);
    let page = String::from_utf8(body).unwrap();
    assert!(page.contains("n2&lt;b&gt;") && !page.contains("n2<b>"), "names are escaped");
    assert!(page.contains("<text>plan</text>"), "the plan's SVG is inline");
    assert!(page.contains("data-tokens-per-s=\"50.000\""), "1 / 0.02 s tokens/s: {page}");
    // stage 1: 0.1 s over 10 steps = 10 ms/token = 100 tokens/s
    assert!(page.contains("class=\"n stage-tps\" data-tokens-per-s=\"100.000\""), "{page}");
    assert!(page.contains("<td>3–5</td>"), "inclusive layer range");
    assert!(page.contains("cuda0 <span class=\"muted\">NVIDIA H200</span>"), "a gateway's GPU is listed: {page}");
    assert!(page.contains("host link 25.5 GB/s"), "with its measured host link: {page}");
    assert!(page.contains("rowspan=\"2\">n1</td>"), "the node's row spans its two devices: {page}");
    assert!(page.contains("http-equiv=\"refresh\"") && !page.contains("<script"));
    assert!(page.contains("/v1/completions") && page.contains("stop"), "the finished request is listed");
}

#[tokio::test]
async fn metrics_without_an_overview_have_the_servers_own() {
    let (app, _) = app(scripted(TEXT, Finish::Stop));
    let (st, body) = call(app.clone(), "GET", "/metrics", None, None).await;
    assert_eq!(st, StatusCode::OK);
    let m = String::from_utf8(body).unwrap();
    assert!(m.contains("# TYPE brigade_generated_tokens counter") && m.ends_with("# EOF\n"), "{m}");
    assert!(!m.contains("brigade_stage_compute_seconds"), "{m}");
    let (st, body) = call(app, "GET", "/", None, None).await;
    assert_eq!(st, StatusCode::OK);
    assert!(String::from_utf8(body).unwrap().contains("none yet"));
}

/// A backend that cannot constrain its sampling (a cluster, today) gets no request that asks
/// for a format: the server answers 400 naming the field, and the backend sees nothing.
#[tokio::test]
async fn a_format_the_backend_cannot_apply_is_refused_by_name() {
    let (app, b) = app(scripted(TEXT, Finish::Stop));
    for (body, field) in [
        (json!({"model": "tiny", "prompt": "Hi", "response_format": {"type": "json_object"}}), "response_format"),
        (json!({"model": "tiny", "prompt": "Hi", "json_schema": {"type": "object"}}), "json_schema"),
        (json!({"model": "tiny", "prompt": "Hi", "grammar": "%llguidance {}\nstart: \"a\""}), "grammar"),
        (json!({"model": "tiny", "prompt": "Hi", "logprobs": 1}), "logprobs"),
    ] {
        let (st, out) = call(app.clone(), "POST", "/v1/completions", Some(body), None).await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
        let j = json_of(&out);
        assert_eq!(j["error"]["param"], field, "{j}");
        assert!(j["error"]["message"].as_str().unwrap().contains("not supported"), "{j}");
    }
    // `text` asks for nothing
    let body = json!({"model": "tiny", "prompt": "Hi", "response_format": {"type": "text"}});
    let (st, _) = call(app, "POST", "/v1/completions", Some(body), None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(b.seen.lock().unwrap().len(), 1);
    assert!(b.seen.lock().unwrap()[0].constraint.is_none());
}

/// A backend that samples freely (it cannot constrain, as a cluster today) still gets tool
/// calls in `auto`: the model's `<tool_call>` blocks, in a Hermes-style template, are turned
/// into `tool_calls`, whole and streamed; a forced call it could not guarantee is refused.
#[tokio::test]
async fn hermes_calls_in_the_text_become_tool_calls() {
    let answer =
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let mut tk = (*tokenizer()).clone();
    tk.chat_template =
        Some(std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/serve/hermes.jinja")).unwrap());
    let tk = Arc::new(tk);
    let script = tk.encode(answer, false).unwrap();
    let (app, b) = app(Scripted { tk, script, n_ctx: 4096, ..scripted(TEXT, Finish::Stop) });
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let req = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools});
    let (st, body) = call(app.clone(), "POST", "/v1/chat/completions", Some(req.clone()), None).await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let j = json_of(&body);
    let choice = &j["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    // (the SentencePiece tokenizer's word-initial space is the text's)
    assert_eq!(choice["message"]["content"], " Let me check.\n");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"], json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}));
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    // the template showed the tools to the model
    let seen = b.seen.lock().unwrap()[0].prompt.clone();
    let prompt = b.tk.decode(&seen, None);
    assert!(prompt.contains("<tools>") && prompt.contains("\"name\": \"get_weather\""), "{prompt}");
    assert!(b.seen.lock().unwrap()[0].constraint.is_none());

    // streamed: the text before the call as content, then the call with its index
    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let (st, body) = call(app.clone(), "POST", "/v1/chat/completions", Some(streamed), None).await;
    assert_eq!(st, StatusCode::OK);
    let data = sse(&body);
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, " Let me check.\n");
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("tool_calls")).collect();
    assert_eq!(deltas.len(), 1);
    assert_eq!(deltas[0][0]["index"], 0);
    assert_eq!(deltas[0][0]["function"]["arguments"], "{\"city\":\"Paris\"}");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

    // a history of a call and its result renders; a forced call is refused here
    let history = json!({"messages": [{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}], "tools": tools});
    let (st, _) = call(app.clone(), "POST", "/v1/chat/completions", Some(history), None).await;
    assert_eq!(st, StatusCode::OK);
    let seen = b.seen.lock().unwrap().last().unwrap().prompt.clone();
    let prompt = b.tk.decode(&seen, None);
    assert!(prompt.contains("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"), "{prompt}");
    assert!(prompt.contains("<tool_response>\ncold\n</tool_response>"), "{prompt}");
    let mut forced = req;
    forced["tool_choice"] = json!("required");
    let (st, body) = call(app, "POST", "/v1/chat/completions", Some(forced), None).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(json_of(&body)["error"]["param"], "tool_choice");
    assert_eq!(b.seen.lock().unwrap().len(), 3);
}
