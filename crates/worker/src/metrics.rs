//! The worker's `/metrics` (`--metrics ADDR`), in Prometheus' text format through
//! `prometheus-client`: for each hosted stage its compute seconds and rows, the bytes it handed
//! to the next hop and the seconds that took, its sessions, KV cache and weight bytes; and the
//! age of the node's last heartbeat answered by the coordinator. Plain HTTP, no key: bind it to
//! an address only your scraper reaches.

use crate::node::{Load, Node};
use crate::WorkerError;
use axum::http::header;
use axum::response::IntoResponse;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabels {
    deployment: String,
    stage: String,
    /// Where the stage's output goes: the next stage's node, or "driver".
    next: String,
}

type FGauge = Gauge<f64, AtomicU64>;
type FCounter = Counter<f64, AtomicU64>;

/// The node's figures now, in Prometheus' text format.
pub fn encode(node: &Node) -> Result<String, std::fmt::Error> {
    let compute = Family::<StageLabels, FCounter>::default();
    let rows = Family::<StageLabels, Counter>::default();
    let batched = Family::<StageLabels, Counter>::default();
    let prompts = Family::<StageLabels, Counter>::default();
    let frames = Family::<StageLabels, Counter>::default();
    let sent = Family::<StageLabels, FCounter>::default();
    let send_s = Family::<StageLabels, FCounter>::default();
    let handed = Family::<StageLabels, Counter>::default();
    let sessions = Family::<StageLabels, FGauge>::default();
    let kv = Family::<StageLabels, FGauge>::default();
    let weights = Family::<StageLabels, FGauge>::default();
    let ready = Family::<StageLabels, FGauge>::default();
    if let Ok(hosted) = node.hosted.lock() {
        for ((deployment, stage), h) in hosted.iter() {
            let Some(handle) = &h.handle else {
                continue;
            };
            let p = &handle.place;
            let l = StageLabels {
                deployment: deployment.clone(),
                stage: stage.to_string(),
                next: p.next.as_ref().map_or_else(|| "driver".to_string(), |n| n.node.clone()),
            };
            let c = &handle.counters;
            compute.get_or_create(&l).inc_by(c.compute_ns.load(Ordering::Relaxed) as f64 / 1e9);
            rows.get_or_create(&l).inc_by(c.rows.load(Ordering::Relaxed));
            batched.get_or_create(&l).inc_by(c.batched_rows.load(Ordering::Relaxed));
            prompts.get_or_create(&l).inc_by(c.prompt_rows_together.load(Ordering::Relaxed));
            frames.get_or_create(&l).inc_by(c.frames.load(Ordering::Relaxed));
            sent.get_or_create(&l).inc_by(c.sent_bytes.load(Ordering::Relaxed) as f64);
            send_s.get_or_create(&l).inc_by(c.send_ns.load(Ordering::Relaxed) as f64 / 1e9);
            handed.get_or_create(&l).inc_by(c.handed_over.load(Ordering::Relaxed));
            let active = handle.active.load(Ordering::Relaxed);
            sessions.get_or_create(&l).set(f64::from(active));
            kv.get_or_create(&l).set(handle.kv_bytes_held() as f64);
            weights.get_or_create(&l).set(handle.weight_bytes as f64);
            ready.get_or_create(&l).set(if matches!(h.load, Load::Ready) { 1.0 } else { 0.0 });
        }
    }
    let heartbeat: FGauge = Gauge::default();
    let age = node.last_heartbeat.lock().ok().and_then(|t| *t).map(|t| t.elapsed().as_secs_f64());
    // never answered yet: -1
    heartbeat.set(age.unwrap_or(-1.0));
    let mut reg = Registry::with_prefix("brigade_worker");
    reg.register("stage_compute_seconds", "Seconds a stage computed (forward passes, sampling)", compute);
    reg.register("stage_rows", "Rows (tokens) a stage computed", rows);
    reg.register(
        "stage_batched_rows",
        "Rows computed in passes of several sessions' decode steps (the weights read once for all)",
        batched,
    );
    reg.register(
        "stage_prompt_rows_together",
        "Prompt rows read in passes of several sessions' prompt chunks (the weights read once for all)",
        prompts,
    );
    reg.register("stage_frames", "Frames a stage computed", frames);
    reg.register(
        "hop_sent_bytes",
        "Bytes a stage sent over a link to its next hop (none for a hop inside this node)",
        sent,
    );
    reg.register("hop_send_seconds", "Seconds a stage spent handing frames to its next hop", send_s);
    reg.register(
        "hop_handed_over",
        "Hidden states a stage handed to the next stage on this node as tensors (no bytes sent)",
        handed,
    );
    reg.register("stage_sessions", "Sessions a stage holds now", sessions);
    reg.register(
        "stage_kv_cache_bytes",
        "KV cache bytes a stage holds now (its sessions' and those pooled for the next)",
        kv,
    );
    reg.register("stage_weight_bytes", "Weight bytes a stage holds", weights);
    reg.register("stage_ready", "1 when a stage is loaded and serving", ready);
    reg.register(
        "heartbeat_age_seconds",
        "Seconds since the coordinator last answered this node's heartbeat (-1: never)",
        heartbeat,
    );
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg)?;
    Ok(out)
}

/// Serves `/metrics` on `addr` until `stop` changes; returns once it listens (the address it
/// got is printed: port 0 picks one).
pub async fn serve(
    node: Arc<Node>,
    addr: SocketAddr,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), WorkerError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| WorkerError::Link(format!("bind --metrics {addr}: {e}")))?;
    let local = listener.local_addr().map_err(|e| WorkerError::Link(e.to_string()))?;
    eprintln!("worker {} metrics on http://{local}/metrics", node.cfg.name);
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let node = node.clone();
            async move {
                match encode(&node) {
                    Ok(text) => {
                        ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
                    }
                    Err(e) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the metrics: {e}"))
                        .into_response(),
                }
            }
        }),
    );
    tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.changed().await;
            })
            .await;
        if let Err(e) = r {
            tracing::warn!("the metrics server stopped: {e}");
        }
    });
    Ok(())
}
