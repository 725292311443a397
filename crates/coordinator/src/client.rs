//! The `Client` service: deploy and undeploy, plan, status, and sessions — each relayed from the
//! worker that drives it (the coordinator forwards events as they come and is never on the token
//! loop between the stages).

use crate::placement::{self, PlacementRequest};
use crate::server::{DeployStats, Shared};
use crate::CoordError;
use brigade_core::cluster::{
    ActDtype, CarrierKind, ClusterState, Command, Deployment, DeploymentState, NodeState, StageState,
};
use brigade_planner::Objective;
use brigade_proto::convert::{device_to_proto, unix_ms};
use brigade_proto::v1::client_server::Client;
use brigade_proto::v1::{
    generate_event, Carrier, ChatMessageRef, ChatRequest, ClusterStatusRequest, ClusterStatusResponse, DeployRequest,
    DeployResponse, DeploymentInfo, DriveRequest, GenerateEvent, GenerateOptions, GenerateRequest, LinkFigures,
    ListModelsRequest, ListModelsResponse, ModelInfo, NodeInfo, PlanResponse, StageInfo, UndeployRequest,
    UndeployResponse, WireDtype,
};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

pub struct ClientService {
    pub shared: Arc<Shared>,
}

/// How long a deploy waits for every node's links to be measured before it plans without them.
const LINK_WAIT: Duration = Duration::from_secs(15);

fn act_dtype(d: i32) -> Result<ActDtype, CoordError> {
    match WireDtype::try_from(d) {
        Ok(WireDtype::Unspecified) | Ok(WireDtype::F32) => Ok(ActDtype::F32),
        Ok(WireDtype::F16) => Ok(ActDtype::F16),
        Ok(WireDtype::Bf16) => Ok(ActDtype::Bf16),
        _ => Err(CoordError::BadRequest(format!("activation dtype {d}: f32, f16 or bf16"))),
    }
}

fn carrier(c: i32) -> Result<CarrierKind, CoordError> {
    match Carrier::try_from(c) {
        Ok(Carrier::Unspecified) | Ok(Carrier::Quic) => Ok(CarrierKind::Quic),
        Ok(Carrier::Grpc) => Ok(CarrierKind::Grpc),
        _ => Err(CoordError::BadRequest(format!("carrier {c}: quic or grpc"))),
    }
}

/// A deployment as clients see it.
pub fn deployment_info(state: &ClusterState, d: &Deployment, stats: Option<&DeployStats>) -> DeploymentInfo {
    let st = state.deployment_state(d);
    let source = state.models.get(&d.model_id).map(|m| m.source.clone()).unwrap_or_default();
    let steps = stats.map(|s| s.decode_steps).unwrap_or(0).max(1) as f64;
    DeploymentInfo {
        name: d.name.clone(),
        source,
        model_id: d.model_id.clone(),
        generation: d.generation,
        state: st.name().into(),
        stages: d
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| StageInfo {
                index: i as u32,
                node: s.node.clone(),
                device: s.device.clone(),
                layer_start: s.layers.start() as u32,
                layer_end: s.layers.end() as u32,
                state: s.state.name().into(),
                error: match &s.state {
                    StageState::Failed(e) => e.clone(),
                    _ => String::new(),
                },
                weight_bytes: s.weight_bytes,
                kv_bytes: s.kv_bytes,
                fetched_bytes: s.fetched_bytes,
                predicted_s: s.predicted_s,
                measured_s: stats
                    .map(|x| {
                        (x.stage_compute_s.get(i).copied().unwrap_or(0.0)
                            + x.stage_transfer_s.get(i).copied().unwrap_or(0.0))
                            / steps
                    })
                    .unwrap_or(0.0),
                address: state.nodes.get(&s.node).map(|n| n.address.clone()).unwrap_or_default(),
            })
            .collect(),
        n_layers: d.n_layers as u32,
        n_ctx: d.n_ctx as u32,
        sessions: d.sessions as u32,
        activation_dtype: crate::assign::wire_dtype(d.act_dtype) as i32,
        carrier: crate::assign::carrier(d.carrier) as i32,
        objective: d.objective.clone(),
        predicted_decode_s: d.predicted_decode_s,
        measured_decode_s: stats.map(|s| s.decode_s_per_token()).unwrap_or(0.0),
        tokens_generated: stats.map(|s| s.tokens).unwrap_or(0),
        driver: d.driver.clone(),
        plan_text: d.plan_text.clone(),
        error: match st {
            DeploymentState::Failed => d
                .stages
                .iter()
                .filter_map(|s| match &s.state {
                    StageState::Failed(e) => Some(format!("{}: {e}", s.node)),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("; "),
            DeploymentState::Degraded => format!(
                "node(s) down: {}",
                d.stages
                    .iter()
                    .filter(|s| state.nodes.get(&s.node).is_none_or(|n| n.state == NodeState::Down))
                    .map(|s| s.node.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            _ => String::new(),
        },
    }
}

impl ClientService {
    fn stats(&self, name: &str) -> Option<DeployStats> {
        self.shared.stats.lock().ok().and_then(|s| s.get(name).cloned())
    }

    /// Waits (bounded) until every pair of up nodes has a measured link, so the planner sees them.
    async fn wait_for_links(&self) {
        let deadline = tokio::time::Instant::now() + LINK_WAIT;
        let mut changed = self.shared.subscribe();
        loop {
            let s = self.shared.state();
            let up: Vec<&str> =
                s.nodes.values().filter(|n| n.state == NodeState::Up).map(|n| n.name.as_str()).collect();
            let measured = |a: &str, b: &str| {
                s.links.get(a).is_some_and(|m| m.contains_key(b)) || s.links.get(b).is_some_and(|m| m.contains_key(a))
            };
            let missing = up.iter().enumerate().any(|(i, a)| up[i + 1..].iter().any(|b| !measured(a, b)));
            if !missing {
                return;
            }
            if tokio::time::timeout_at(deadline, changed.changed()).await.is_err() {
                return;
            }
        }
    }

    /// The placement a deploy request asks for, with the model's record.
    async fn placement(
        &self,
        r: &DeployRequest,
    ) -> Result<(brigade_core::cluster::ModelRecord, placement::Placement, usize, usize), CoordError> {
        brigade_core::cluster::check_name("deployment", &r.name)?;
        let shared = self.shared.clone();
        let m = r.model.clone();
        let model = tokio::task::spawn_blocking(move || shared.models.resolve(&m))
            .await
            .map_err(|e| CoordError::Internal(e.to_string()))??;
        let objective: Objective = if r.objective.is_empty() {
            Objective::Latency
        } else {
            r.objective.parse().map_err(CoordError::BadRequest)?
        };
        let ctx = if r.ctx == 0 { model.context_length.clamp(1, 4096) } else { r.ctx as usize };
        if ctx > 1 << 20 {
            return Err(CoordError::BadRequest(format!("--ctx {ctx}: at most {} tokens", 1 << 20)));
        }
        let sessions = if r.sessions == 0 { 4 } else { r.sessions as usize };
        if sessions > 4096 {
            return Err(CoordError::BadRequest(format!("--sessions {sessions}: at most 4096")));
        }
        let headroom = if r.headroom == 0.0 { 0.10 } else { r.headroom };
        self.wait_for_links().await;
        let req = PlacementRequest {
            objective,
            ctx,
            sessions,
            headroom,
            driver: (!r.driver.is_empty()).then(|| r.driver.clone()),
            device_map: r.device_map.clone(),
        };
        let p = placement::place(&self.shared.state(), &model, &req)?;
        Ok((model, p, ctx, sessions))
    }

    async fn relay(&self, model: &str, drive: DriveRequest) -> Result<Response<BoxStream<GenerateEvent>>, Status> {
        let state = self.shared.state();
        let d =
            state.deployments.get(model).cloned().ok_or_else(|| {
                Status::not_found(format!("no deployment named `{model}` (brigade status lists them)"))
            })?;
        match state.deployment_state(&d) {
            DeploymentState::Ready => {}
            other => {
                let info = deployment_info(&state, &d, None);
                return Err(Status::unavailable(format!(
                    "deployment `{model}` is {}{}",
                    other.name(),
                    if info.error.is_empty() { String::new() } else { format!(": {}", info.error) }
                )));
            }
        }
        let mut worker = self.shared.worker(&d.driver).await?;
        let drive = DriveRequest { deployment: d.name.clone(), generation: d.generation, ..drive };
        let mut upstream = match worker.drive(drive).await {
            Ok(s) => s.into_inner(),
            Err(e) => {
                if e.code() == tonic::Code::Unavailable {
                    self.shared.forget_worker(&d.driver).await;
                }
                return Err(e);
            }
        };
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    m = upstream.message() => m,
                    _ = tx.closed() => return,
                };
                match msg {
                    Ok(Some(mut ev)) => {
                        if let Some(generate_event::Event::Done(done)) = &mut ev.event {
                            if let Some(t) = &mut done.timings {
                                for h in &mut t.hops {
                                    if let Some(s) = d.stages.get(h.stage as usize) {
                                        h.node = s.node.clone();
                                        h.device = s.device.clone();
                                    }
                                }
                                record(&shared, &d.name, t);
                            }
                        }
                        if tx.send(Ok(ev)).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

fn record(shared: &Shared, name: &str, t: &brigade_proto::v1::Timings) {
    let Ok(mut all) = shared.stats.lock() else { return };
    let s = all.entry(name.to_string()).or_default();
    s.tokens += u64::from(t.generated_tokens);
    let steps = u64::from(t.generated_tokens.saturating_sub(1));
    if steps > 0 && t.generate_s > 0.0 {
        s.decode_steps += steps;
        s.decode_s += t.generate_s;
        if s.stage_compute_s.len() < t.hops.len() {
            s.stage_compute_s.resize(t.hops.len(), 0.0);
            s.stage_transfer_s.resize(t.hops.len(), 0.0);
        }
        for (i, h) in t.hops.iter().enumerate() {
            s.stage_compute_s[i] += h.compute_s * steps as f64;
            s.stage_transfer_s[i] += h.transfer_s * steps as f64;
        }
    }
}

fn drive_options(o: Option<GenerateOptions>) -> Result<DriveRequest, Status> {
    let o = o.unwrap_or_default();
    if o.resume_ids.len() > 1 << 20 {
        return Err(Status::invalid_argument("too many resume ids"));
    }
    Ok(DriveRequest {
        max_tokens: o.max_tokens,
        sampling: o.sampling,
        ignore_eos: o.ignore_eos,
        resume_ids: o.resume_ids,
        ..Default::default()
    })
}

#[tonic::async_trait]
impl Client for ClientService {
    type GenerateStream = BoxStream<GenerateEvent>;
    type ChatStream = BoxStream<GenerateEvent>;

    async fn generate(&self, req: Request<GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let r = req.into_inner();
        if r.prompt.len() > 16 << 20 || r.prompt_ids.len() > 1 << 20 {
            return Err(Status::invalid_argument("the prompt is larger than 16 MiB"));
        }
        let use_ids = !r.prompt_ids.is_empty();
        let d = DriveRequest {
            prompt: r.prompt,
            prompt_ids: r.prompt_ids,
            use_prompt_ids: use_ids,
            ..drive_options(r.options)?
        };
        self.relay(&r.model, d).await
    }

    async fn chat(&self, req: Request<ChatRequest>) -> Result<Response<Self::ChatStream>, Status> {
        let r = req.into_inner();
        if r.messages.is_empty() {
            return Err(Status::invalid_argument("a chat needs at least one message"));
        }
        let size: usize = r.messages.iter().map(|m| m.content.len() + m.role.len()).sum();
        if size > 16 << 20 {
            return Err(Status::invalid_argument("the messages are larger than 16 MiB"));
        }
        let chat = r.messages.into_iter().map(|m| ChatMessageRef { role: m.role, content: m.content }).collect();
        let d = DriveRequest { chat, ..drive_options(r.options)? };
        self.relay(&r.model, d).await
    }

    async fn list_models(&self, _req: Request<ListModelsRequest>) -> Result<Response<ListModelsResponse>, Status> {
        let s = self.shared.state();
        let models = s
            .deployments
            .values()
            .map(|d| ModelInfo {
                name: d.name.clone(),
                source: s.models.get(&d.model_id).map(|m| m.source.clone()).unwrap_or_default(),
                state: s.deployment_state(d).name().into(),
                n_layers: d.n_layers as u32,
                n_ctx: d.n_ctx as u32,
                created_ms: d.created_ms,
            })
            .collect();
        Ok(Response::new(ListModelsResponse { models }))
    }

    async fn deploy(&self, req: Request<DeployRequest>) -> Result<Response<DeployResponse>, Status> {
        let r = req.into_inner();
        if self.shared.state().deployments.contains_key(&r.name) {
            return Err(CoordError::State(brigade_core::cluster::StateError::DeploymentExists(r.name)).into());
        }
        let (model, p, ctx, sessions) = self.placement(&r).await?;
        let objective = if r.objective.is_empty() { "latency".to_string() } else { r.objective.clone() };
        let dep = Deployment {
            name: r.name.clone(),
            model_id: model.id.clone(),
            generation: 0,
            n_layers: model.n_layers,
            n_ctx: ctx,
            sessions,
            objective,
            act_dtype: act_dtype(r.activation_dtype)?,
            carrier: carrier(r.carrier)?,
            driver: p.driver.clone(),
            stages: p.stages,
            predicted_decode_s: p.predicted_decode_s,
            plan_text: p.plan_text,
            created_ms: unix_ms(),
            ubatch: r.ubatch as usize,
        };
        let known = self.shared.state().models.get(&model.id) == Some(&model);
        if !known {
            self.shared.apply(Command::AddModel { model })?;
        }
        self.shared.apply(Command::CreateDeployment { deployment: dep })?;
        tracing::info!("deployed `{}`", r.name);
        if r.wait_s > 0 {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(u64::from(r.wait_s.min(3600)));
            let mut changed = self.shared.subscribe();
            loop {
                let s = self.shared.state();
                let Some(d) = s.deployments.get(&r.name) else { break };
                if !matches!(s.deployment_state(d), DeploymentState::Loading) {
                    break;
                }
                if tokio::time::timeout_at(deadline, changed.changed()).await.is_err() {
                    break;
                }
            }
        }
        let s = self.shared.state();
        let d = s.deployments.get(&r.name).ok_or_else(|| Status::aborted("the deployment was removed meanwhile"))?;
        Ok(Response::new(DeployResponse { deployment: Some(deployment_info(&s, d, None)) }))
    }

    async fn undeploy(&self, req: Request<UndeployRequest>) -> Result<Response<UndeployResponse>, Status> {
        let name = req.into_inner().name;
        self.shared.apply(Command::RemoveDeployment { name: name.clone() })?;
        if let Ok(mut s) = self.shared.stats.lock() {
            s.remove(&name);
        }
        tracing::info!("undeployed `{name}`");
        Ok(Response::new(UndeployResponse {}))
    }

    async fn cluster_status(
        &self,
        _req: Request<ClusterStatusRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        let s = self.shared.state();
        let nodes = s
            .nodes
            .values()
            .map(|n| NodeInfo {
                name: n.name.clone(),
                address: n.address.clone(),
                state: match n.state {
                    NodeState::Up => "up".into(),
                    NodeState::Down => "down".into(),
                },
                devices: n.devices.iter().map(device_to_proto).collect(),
                heartbeat_age_ms: self.shared.heartbeat_age(&n.name).as_millis() as u64,
                version: n.version.clone(),
            })
            .collect();
        let links = s
            .all_links()
            .map(|l| LinkFigures {
                from: l.from.clone(),
                to: l.to.clone(),
                latency_s: l.link.latency,
                bandwidth: l.link.bandwidth,
                measured_at_ms: l.measured_ms,
            })
            .collect();
        let deployments =
            s.deployments.values().map(|d| deployment_info(&s, d, self.stats(&d.name).as_ref())).collect();
        Ok(Response::new(ClusterStatusResponse {
            protocol: brigade_proto::PROTOCOL_VERSION,
            version: env!("CARGO_PKG_VERSION").into(),
            nodes,
            links,
            deployments,
        }))
    }

    async fn plan(&self, req: Request<DeployRequest>) -> Result<Response<PlanResponse>, Status> {
        let r = req.into_inner();
        let (_, p, _, _) = self.placement(&r).await?;
        Ok(Response::new(PlanResponse { plan_text: p.plan_text, plan_json: p.plan_json }))
    }
}
