//! The OpenAI-compatible HTTP API on the coordinator (`brigade coordinator --http ADDR`):
//! `brigade-serve`'s server — the same parsing, chat templates, stop strings, usage, streaming and
//! API keys as `brigade serve` — over a backend that runs each completion as a session of its
//! deployment, relayed from the deployment's driver exactly as the gRPC `Generate` is (and resumed
//! on a new placement when a node dies under it). Every deployment is a model of the API.

use crate::client::start_session;
use crate::models::EMBEDDED;
use crate::shared::Shared;
use brigade_core::cluster::ModelRecord;
use brigade_core::stop::StopReason;
use brigade_core::{DeviceKind, TokenLogprob};
use brigade_format::{ModelIndex, Tokenizer};
use brigade_planner::{HopPlan, Objective, Plan, StagePlan};
use brigade_proto::convert::{deployment_state_name, node_state_name, sampling_to_proto, stage_state_name};
use brigade_proto::v1::{generate_event, DriveRequest};
use brigade_serve::{
    ApiError, Backend, DeploymentView, DeviceView, EngineEvent, EngineRequest, Finish, LinkView, ModelInfo, NodeView,
    Overview, StageView,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// The cluster as a `brigade-serve` backend.
pub struct ClusterBackend {
    shared: Arc<Shared>,
    /// Tokenizers by model id, read once from the model's file on this machine.
    tokenizers: Mutex<HashMap<String, Arc<Tokenizer>>>,
}

impl ClusterBackend {
    pub fn new(shared: Arc<Shared>) -> Self {
        ClusterBackend { shared, tokenizers: Mutex::new(HashMap::new()) }
    }

    /// The model's tokenizer (the server tokenizes; the driver takes the ids as they are).
    fn tokenizer(&self, m: &ModelRecord) -> Option<Arc<Tokenizer>> {
        if let Some(t) = self.tokenizers.lock().ok()?.get(&m.id) {
            return Some(t.clone());
        }
        let index = if m.source == EMBEDDED { ModelIndex::embedded() } else { ModelIndex::open(Path::new(&m.source)) };
        match index {
            Ok(i) => {
                let t = i.tokenizer().clone();
                self.tokenizers.lock().ok()?.insert(m.id.clone(), t.clone());
                Some(t)
            }
            Err(e) => {
                tracing::warn!("model {} ({}): no tokenizer for the HTTP API: {e}", m.name, m.source);
                None
            }
        }
    }
}

impl Backend for ClusterBackend {
    fn models(&self) -> Vec<ModelInfo> {
        let state = self.shared.state();
        state
            .deployments
            .values()
            .filter_map(|d| {
                let m = state.models.get(&d.model_id)?;
                Some(ModelInfo {
                    id: d.name.clone(),
                    n_ctx: d.n_ctx,
                    tokenizer: self.tokenizer(m)?,
                    created: d.created_ms / 1000,
                    owned_by: "brigade".into(),
                })
            })
            .collect()
    }

    /// A deployment's last stage constrains its sampling to the request's format and scores
    /// its tokens (the format and the count travel in `DriveRequest`).
    fn constrains(&self) -> bool {
        true
    }

    fn scores(&self) -> bool {
        true
    }

    async fn complete(&self, req: EngineRequest) -> Result<mpsc::UnboundedReceiver<EngineEvent>, ApiError> {
        let drive = DriveRequest {
            prompt_ids: req.prompt,
            use_prompt_ids: true,
            max_tokens: u32::try_from(req.max_tokens).unwrap_or(u32::MAX),
            sampling: Some(sampling_to_proto(&req.sampling)),
            ignore_eos: req.ignore_eos,
            // the driver ends the session at the stop itself (reason `stop`), one token sooner
            // than the server's drop of the stream would
            stop: req.stop,
            // the format as sent: the deployment's last stage compiles it against its vocabulary
            format: match &req.format {
                Some(f) => serde_json::to_string(f).map_err(|e| ApiError::internal(format!("the format: {e}")))?,
                None => String::new(),
            },
            logprobs: req.logprobs.map(|n| n as u32),
            ..Default::default()
        };
        let mut upstream = start_session(&self.shared, &req.model, drive).await.map_err(|e| api_error(&e))?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let ev = tokio::select! {
                    ev = upstream.recv() => ev,
                    // the HTTP client went: dropping `upstream` ends the session on the driver
                    _ = tx.closed() => return,
                };
                let out = match ev {
                    Some(Ok(e)) => match e.event {
                        Some(generate_event::Event::Token(t)) => {
                            let scores = t.logprob.map(|logprob| TokenLogprob {
                                logprob,
                                top: t.top_logprobs.iter().map(|x| (x.id, x.logprob)).collect(),
                            });
                            EngineEvent::Token(t.id, scores)
                        }
                        Some(generate_event::Event::Done(d)) => {
                            // (an unknown reason is a length: the answer was cut, not finished)
                            let stop = brigade_proto::convert::stop_from_proto(d.stop).unwrap_or(StopReason::Length);
                            EngineEvent::Done(Finish::of(stop))
                        }
                        Some(generate_event::Event::Prompt(_)) | None => continue,
                    },
                    Some(Err(e)) => EngineEvent::Error(e.message().to_string()),
                    None => EngineEvent::Error("the session's stream ended without a final event".into()),
                };
                let last = !matches!(out, EngineEvent::Token(..));
                if tx.send(out).is_err() || last {
                    return;
                }
            }
        });
        Ok(rx)
    }

    async fn overview(&self) -> Option<Overview> {
        Some(self.overview_now())
    }
}

/// A refused session in OpenAI's shape: the deployment not serving now is a 503 (retry), the
/// caller's mistakes are 400s.
fn api_error(e: &tonic::Status) -> ApiError {
    use tonic::Code;
    match e.code() {
        Code::Unavailable | Code::ResourceExhausted => ApiError::busy(e.message()),
        Code::InvalidArgument | Code::FailedPrecondition | Code::NotFound => ApiError::bad_request(e.message()),
        _ => ApiError::internal(e.message()),
    }
}

impl ClusterBackend {
    /// The dashboard's and `/metrics`' figures: [`crate::client::status_snapshot`] (what `brigade
    /// status` prints) of this replica's applied state, with the sums behind its means.
    pub fn overview_now(&self) -> Overview {
        let state = self.shared.state();
        let snap = crate::client::status_snapshot(&self.shared, &state);
        let role = snap.raft.as_ref().map(|r| r.role.clone()).unwrap_or_default();
        let nodes: Vec<NodeView> = snap
            .nodes
            .iter()
            .map(|n| NodeView {
                name: n.name.clone(),
                address: n.address.clone(),
                state: node_state_name(n.state).into(),
                heartbeat_age_s: n.heartbeat_age_ms as f64 / 1e3,
                devices: n
                    .devices
                    .iter()
                    .map(|d| DeviceView {
                        name: d.name.clone(),
                        model: d.model.clone(),
                        memory_total: d.memory_total,
                        memory_free: d.memory_free,
                        mem_bandwidth: d.mem_bandwidth,
                        flops: d.flops,
                        features: d.features.clone(),
                        kind: if d.kind == brigade_proto::v1::DeviceKind::Cuda as i32 { "cuda" } else { "cpu" }.into(),
                        host_link_bandwidth: d.host_link_bandwidth,
                    })
                    .collect(),
            })
            .collect();
        let deployments = snap
            .deployments
            .iter()
            .map(|d| {
                let stats = crate::client::stats_of(&self.shared, &d.name).unwrap_or_default();
                let at = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);
                let stages: Vec<StageView> = d
                    .stages
                    .iter()
                    .enumerate()
                    .map(|(i, s)| StageView {
                        index: s.index as usize,
                        node: s.node.clone(),
                        device: s.device.clone(),
                        layers: (s.layer_start, s.layer_end),
                        state: stage_state_name(s.state).into(),
                        weight_bytes: s.weight_bytes,
                        kv_bytes: s.kv_bytes,
                        predicted_s: s.predicted_s,
                        compute_s_total: at(&stats.stage_compute_s, i),
                        hop_s_total: at(&stats.stage_transfer_s, i),
                        hop_bytes_total: at(&stats.stage_bytes, i),
                    })
                    .collect();
                let mut view = DeploymentView {
                    name: d.name.clone(),
                    state: deployment_state_name(d.state).into(),
                    predicted_decode_s: d.predicted_decode_s,
                    measured_decode_s: d.measured_decode_s,
                    tokens_generated: d.tokens_generated,
                    decode_steps: stats.decode_steps,
                    stages,
                    svg: String::new(),
                    error: d.error.clone(),
                    // (the cluster does not draft yet)
                    ..Default::default()
                };
                view.svg = plan_svg(&view, d, &nodes);
                view
            })
            .collect();
        Overview {
            source: format!("coordinator replica {} ({role}), version {}", self.shared.cfg.id, snap.version),
            nodes,
            links: snap
                .links
                .iter()
                .map(|l| LinkView {
                    from: l.from.clone(),
                    to: l.to.clone(),
                    latency_s: l.latency_s,
                    bandwidth: l.bandwidth,
                })
                .collect(),
            deployments,
        }
    }
}

/// The deployment drawn by the planner's own SVG renderer, with the measured figures in place of
/// the predicted ones once there are any (the prediction is in the bottleneck line).
fn plan_svg(v: &DeploymentView, d: &brigade_proto::v1::DeploymentInfo, nodes: &[NodeView]) -> String {
    let measured = v.decode_steps > 0;
    let budget = |node: &str, device: &str| {
        nodes
            .iter()
            .find(|n| n.name == node)
            .and_then(|n| n.devices.iter().find(|x| x.name == device))
            .map_or(0, |x| x.memory_total)
    };
    let stages = v
        .stages
        .iter()
        .map(|s| {
            let compute = if measured { s.compute_s_per_token(v.decode_steps) } else { s.predicted_s };
            StagePlan {
                node: s.node.clone(),
                device: s.device.clone(),
                kind: if s.device.starts_with("cuda") { DeviceKind::Cuda } else { DeviceKind::Cpu },
                layers: (s.layers.0 as usize, s.layers.1 as usize),
                weight_bytes: s.weight_bytes,
                kv_bytes: s.kv_bytes,
                memory_bytes: s.weight_bytes + s.kv_bytes,
                budget_bytes: budget(&s.node, &s.device).max(s.weight_bytes + s.kv_bytes),
                host_layers: None,
                host_expert_bytes: 0,
                host_device: None,
                compute_ms: compute * 1e3,
                prefill_ms_512: 0.0,
                reason: String::new(),
            }
        })
        .collect();
    let hops = v
        .stages
        .iter()
        .enumerate()
        .map(|(i, s)| HopPlan {
            from: s.node.clone(),
            to: v.stages.get(i + 1).map_or_else(|| d.driver.clone(), |n| n.node.clone()),
            ms: s.hop_s_per_token(v.decode_steps) * 1e3,
            prefill_ms_512: 0.0,
        })
        .collect();
    let decode_s = if measured { v.measured_decode_s } else { v.predicted_decode_s };
    let per_s = |s: f64| if s > 0.0 { 1.0 / s } else { 0.0 };
    let plan = Plan {
        model: format!("{} ({})", v.name, if measured { "measured" } else { "predicted, nothing measured yet" }),
        objective: d.objective.parse().unwrap_or(Objective::Latency),
        ctx: u64::from(d.n_ctx),
        sessions: u64::from(d.sessions),
        headroom: 0.0,
        driver: d.driver.clone(),
        exact: false,
        heuristic: None,
        stages,
        hops,
        decode_ms_per_token: decode_s * 1e3,
        tokens_per_s: per_s(decode_s),
        throughput_tokens_per_s: per_s(decode_s),
        prefill_ms_512: 0.0,
        prefill_tokens_per_s: 0.0,
        energy_j_per_token: None,
        avg_watts: None,
        bottleneck: format!(
            "planner's prediction {:.3} ms/token ({:.1} tokens/s); measured {:.3} ms/token over {} steps",
            v.predicted_decode_s * 1e3,
            per_s(v.predicted_decode_s),
            v.measured_decode_s * 1e3,
            v.decode_steps
        ),
        rejected: Vec::new(),
        reserved: Vec::new(),
        cpu_moe: 0,
        host_device: None,
        host_expert_bytes: 0,
    };
    brigade_planner::svg::render(&plan)
}
