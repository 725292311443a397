//! The `Client` service: deploy and undeploy, plan, status, and sessions — each relayed from the
//! worker that drives it (the coordinator forwards events as they come and is never on the token
//! loop between the stages).

use crate::placement::{self, PlacementRequest};
use crate::shared::{DeployStats, Shared};
use crate::CoordError;
use brigade_core::cluster::{
    ActDtype, CarrierKind, ClusterState, Command, Deployment, DeploymentState, NodeState, StageRecord, StageState,
};
use brigade_planner::Objective;
use brigade_proto::convert::{
    act_dtype_from_proto, act_dtype_to_proto, carrier_from_proto, carrier_to_proto, deployment_state_to_proto,
    device_to_proto, node_state_to_proto, sampling_from_proto, sampling_to_proto, stage_state_to_proto, unix_ms,
};
use brigade_proto::relay::{resumable, Failed, Relay, Relayed};
use brigade_proto::v1::client_server::Client;
use brigade_proto::v1::{
    generate_event, ChatMessageRef, ChatRequest, ClusterStatusRequest, ClusterStatusResponse, DeployRequest,
    DeployResponse, DeploymentInfo, DriveRequest, GenerateEvent, GenerateOptions, GenerateRequest, LinkFigures,
    ListModelsRequest, ListModelsResponse, ModelInfo, NodeInfo, PlanResponse, RaftStatus, RemoveReplicaRequest,
    RemoveReplicaResponse, ReplicaInfo, StageInfo, UndeployRequest, UndeployResponse,
};
use brigade_serve::Format;
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
    act_dtype_from_proto(d).map_err(|d| CoordError::BadRequest(format!("activation dtype {d}: f32, f16 or bf16")))
}

fn carrier(c: i32) -> Result<CarrierKind, CoordError> {
    carrier_from_proto(c).map_err(|c| CoordError::BadRequest(format!("carrier {c}: quic or grpc")))
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
        state: deployment_state_to_proto(st).into(),
        stages: d.stages.iter().enumerate().map(|(i, s)| stage_info(state, stats, steps, i, s)).collect(),
        expert_stages: d
            .expert_stages
            .iter()
            .enumerate()
            .map(|(j, s)| stage_info(state, None, steps, d.stages.len() + j, s))
            .collect(),
        n_layers: d.n_layers as u32,
        n_ctx: d.n_ctx as u32,
        sessions: d.sessions as u32,
        activation_dtype: act_dtype_to_proto(d.act_dtype) as i32,
        carrier: carrier_to_proto(d.carrier) as i32,
        objective: d.objective.clone(),
        predicted_decode_s: d.predicted_decode_s,
        measured_decode_s: stats.map(|s| s.decode_s_per_token()).unwrap_or(0.0),
        tokens_generated: stats.map(|s| s.tokens).unwrap_or(0),
        driver: d.driver.clone(),
        plan_text: d.plan_text.clone(),
        error: match st {
            _ if !d.note.is_empty() => d.note.clone(),
            DeploymentState::Failed => d
                .every_stage()
                .filter_map(|s| match &s.state {
                    StageState::Failed(e) => Some(format!("{}: {e}", s.node)),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("; "),
            DeploymentState::Degraded => format!(
                "node(s) down: {}",
                d.every_stage()
                    .filter(|s| state.nodes.get(&s.node).is_none_or(|n| n.state == NodeState::Down))
                    .map(|s| s.node.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            _ => String::new(),
        },
    }
}

/// Stage `i` of a deployment as clients see it (`stats`: the deployment's measured figures, for
/// the pipeline's stages).
fn stage_info(state: &ClusterState, stats: Option<&DeployStats>, steps: f64, i: usize, s: &StageRecord) -> StageInfo {
    StageInfo {
        index: i as u32,
        node: s.node.clone(),
        device: s.device.clone(),
        layer_start: s.layers.start() as u32,
        layer_end: s.layers.end() as u32,
        state: stage_state_to_proto(&s.state).into(),
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
                (x.stage_compute_s.get(i).copied().unwrap_or(0.0) + x.stage_transfer_s.get(i).copied().unwrap_or(0.0))
                    / steps
            })
            .unwrap_or(0.0),
        address: state.nodes.get(&s.node).map(|n| n.address.clone()).unwrap_or_default(),
        expert_start: s.experts.map_or(0, |e| e.start),
        expert_end: s.experts.map_or(0, |e| e.end),
    }
}

/// A deployment's measured figures so far.
pub fn stats_of(shared: &Shared, name: &str) -> Option<DeployStats> {
    shared.stats.lock().ok().and_then(|s| s.get(name).cloned())
}

impl ClientService {
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
            cpu_moe: match r.cpu_moe_auto {
                true => brigade_planner::CpuMoe::Auto,
                false => brigade_planner::CpuMoe::Layers(r.cpu_moe as usize),
            },
        };
        // planning a searched split can take seconds on a large cluster: off the async threads
        let state = self.shared.state();
        let m = model.clone();
        let p = tokio::task::spawn_blocking(move || placement::place(&state, &m, &req))
            .await
            .map_err(|e| CoordError::Internal(e.to_string()))??;
        Ok((model, p, ctx, sessions))
    }

    async fn relay(&self, model: &str, drive: DriveRequest) -> Result<Response<BoxStream<GenerateEvent>>, Status> {
        let rx = start_session(&self.shared, model, drive).await?;
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

/// Starts a session of deployment `model` on its driver and relays its events (resuming on a new
/// placement when the pipeline fails under it); dropping the receiver ends the session. The first
/// attempt answers the call: a bad prompt or an unknown model is the caller's error. Shared by
/// the gRPC `Generate`/`Chat` and the HTTP API.
pub(crate) async fn start_session(
    shared: &Arc<Shared>,
    model: &str,
    drive: DriveRequest,
) -> Result<tokio::sync::mpsc::Receiver<Result<GenerateEvent, Status>>, Status> {
    let (upstream, generation) = open_drive(shared, model, &drive).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    tokio::spawn(relay_session(shared.clone(), model.to_string(), drive, upstream, generation, tx));
    Ok(rx)
}

/// How long a session waits for its deployment to be placed again after a failure.
const RESUME_WAIT: Duration = Duration::from_secs(120);

/// Calls `Drive` on the deployment's driver.
async fn open_drive(
    shared: &Shared,
    model: &str,
    drive: &DriveRequest,
) -> Result<(tonic::Streaming<GenerateEvent>, u64), Status> {
    let state = shared.state();
    let d =
        state.deployments.get(model).cloned().ok_or_else(|| {
            CoordError::NotFound(format!("no deployment named `{model}` (brigade status lists them)"))
        })?;
    match state.deployment_state(&d) {
        DeploymentState::Ready => {}
        other => {
            let info = deployment_info(&state, &d, None);
            let why = if !d.note.is_empty() { d.note.clone() } else { info.error };
            return Err(CoordError::Unavailable(format!(
                "deployment `{model}` is {}{}",
                other.name(),
                if why.is_empty() { String::new() } else { format!(": {why}") }
            ))
            .into());
        }
    }
    let mut worker = shared.worker(&d.driver).await?;
    let req = DriveRequest { deployment: d.name.clone(), generation: d.generation, ..drive.clone() };
    match worker.drive(req).await {
        Ok(s) => Ok((s.into_inner(), d.generation)),
        Err(e) => {
            if matches!(e.code(), tonic::Code::Unavailable | tonic::Code::Unknown) {
                shared.forget_worker(&d.driver).await;
            }
            Err(e)
        }
    }
}

/// Waits until the deployment serves again: a newer placement that is ready, or the same one
/// ready after a few seconds (the failure was not a node's death).
async fn wait_ready(shared: &Shared, model: &str, failed_generation: u64) -> Result<(), Status> {
    let t0 = tokio::time::Instant::now();
    let mut changed = shared.subscribe();
    loop {
        let state = shared.state();
        let d =
            state.deployments.get(model).ok_or_else(|| CoordError::NotFound(format!("`{model}` was undeployed")))?;
        let ready = state.deployment_state(d) == DeploymentState::Ready;
        if ready && (d.generation > failed_generation || t0.elapsed() > Duration::from_secs(5)) {
            return Ok(());
        }
        if t0.elapsed() > RESUME_WAIT {
            return Err(CoordError::Unavailable(format!(
                "deployment `{model}` did not serve again within {}s{}",
                RESUME_WAIT.as_secs(),
                if d.note.is_empty() { String::new() } else { format!(": {}", d.note) }
            ))
            .into());
        }
        let _ = tokio::time::timeout(Duration::from_millis(250), changed.changed()).await;
    }
}

/// Relays a session's events to the client. When the pipeline fails under it (a node died, the
/// deployment was re-placed), the session resumes on the new placement from the ids already
/// sent: the driver replays prompt + those ids to rebuild the KV caches, and the client's stream
/// goes on with no gap and no repeat (greedy output is the same as without the failure). The
/// decisions are [`Relay`]'s; this loop moves the events and waits for the deployment.
async fn relay_session(
    shared: Arc<Shared>,
    model: String,
    drive: DriveRequest,
    mut upstream: tonic::Streaming<GenerateEvent>,
    mut generation: u64,
    tx: tokio::sync::mpsc::Sender<Result<GenerateEvent, Status>>,
) {
    let mut relay = Relay::new(drive);
    loop {
        let msg = tokio::select! {
            m = upstream.message() => m,
            _ = tx.closed() => return,
        };
        let failure = match msg {
            Ok(Some(ev)) => match relay.on_event(ev) {
                Relayed::Skip => continue,
                Relayed::Forward(ev) => {
                    if tx.send(Ok(ev)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Relayed::Done(mut ev) => {
                    if let Some(generate_event::Event::Done(brigade_proto::v1::Done { timings: Some(t), .. })) =
                        &mut ev.event
                    {
                        let state = shared.state();
                        if let Some(d) = state.deployments.get(&model) {
                            for h in &mut t.hops {
                                if let Some(s) = d.stages.get(h.stage as usize) {
                                    h.node = s.node.clone();
                                    h.device = s.device.clone();
                                }
                            }
                        }
                        record(&shared, &model, t);
                    }
                    let _ = tx.send(Ok(ev)).await;
                    return;
                }
            },
            Ok(None) => CoordError::Unavailable("the driver's stream ended without a final event".into()).into(),
            Err(e) => e,
        };
        let message = failure.message().to_string();
        let again = match relay.on_failure(failure) {
            Failed::Fail(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
            Failed::Resume(again) => again,
        };
        tracing::warn!(
            "a session of `{model}` lost its pipeline ({message}); resuming after {} tokens",
            relay.sent().len()
        );
        let resumed_upstream = async {
            loop {
                wait_ready(&shared, &model, generation).await?;
                match open_drive(&shared, &model, &again).await {
                    Ok(x) => return Ok::<_, Status>(x),
                    Err(e) if resumable(&e) => {
                        tokio::time::sleep(Duration::from_millis(250)).await;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let r = tokio::select! {
            r = tokio::time::timeout(RESUME_WAIT, resumed_upstream) => r,
            _ = tx.closed() => return,
        };
        match r {
            Ok(Ok((u, g))) => {
                upstream = u;
                generation = g;
            }
            Ok(Err(e)) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
            Err(_) => {
                let _ = tx
                    .send(Err(CoordError::Unavailable(format!("`{model}` did not serve again in time")).into()))
                    .await;
                return;
            }
        }
    }
}

/// The cluster as `brigade status` shows it, from state `s` as this replica applied it: the one
/// source of the status call, of `/metrics` and of the dashboard.
pub fn status_snapshot(shared: &Shared, s: &ClusterState) -> ClusterStatusResponse {
    let nodes = s
        .nodes
        .values()
        .map(|n| NodeInfo {
            name: n.name.clone(),
            address: n.address.clone(),
            state: node_state_to_proto(n.state).into(),
            devices: n.devices.iter().map(device_to_proto).collect(),
            heartbeat_age_ms: shared.heartbeat_age(&n.name).as_millis() as u64,
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
        s.deployments.values().map(|d| deployment_info(s, d, stats_of(shared, &d.name).as_ref())).collect();
    ClusterStatusResponse {
        protocol: brigade_proto::PROTOCOL_VERSION,
        version: env!("CARGO_PKG_VERSION").into(),
        nodes,
        links,
        deployments,
        raft: Some(raft_status(shared, s)),
    }
}

/// The raft group as this replica sees it (the leader knows every replica's progress).
fn raft_status(shared: &Shared, state: &ClusterState) -> RaftStatus {
    let v = shared.raft.status();
    let replicas = state
        .replicas
        .iter()
        .map(|(id, addr)| {
            let p = v.progress.iter().find(|p| p.0 == *id);
            let role = if v.learners.contains(id) {
                "learner".into()
            } else if *id == v.id {
                v.role.clone()
            } else if *id == v.leader {
                "leader".into()
            } else {
                match p {
                    Some((_, _, s)) if s == "replicate" => "follower".into(),
                    Some((_, _, s)) => s.clone(),
                    None => "follower".into(),
                }
            };
            ReplicaInfo {
                id: *id,
                address: addr.clone(),
                role,
                match_index: if *id == v.id { v.applied } else { p.map(|p| p.1).unwrap_or(0) },
                is_self: *id == v.id,
            }
        })
        .collect();
    RaftStatus {
        id: v.id,
        term: v.term,
        leader: v.leader,
        leader_address: shared.raft.leader().map(|l| l.1).unwrap_or_default(),
        commit_index: v.commit,
        applied_index: v.applied,
        role: v.role,
        replicas,
        voters: v.voters,
    }
}

fn record(shared: &Shared, name: &str, t: &brigade_proto::v1::Timings) {
    let Ok(mut all) = shared.stats.lock() else { return };
    let s = all.entry(name.to_string()).or_default();
    s.tokens += u64::from(t.generated_tokens);
    let steps = (t.generate_tokens_per_s * t.generate_s).round() as u64;
    if steps > 0 && t.generate_s > 0.0 {
        s.decode_steps += steps;
        s.decode_s += t.generate_s;
        if s.stage_compute_s.len() < t.hops.len() {
            s.stage_compute_s.resize(t.hops.len(), 0.0);
            s.stage_transfer_s.resize(t.hops.len(), 0.0);
            s.stage_bytes.resize(t.hops.len(), 0.0);
        }
        for (i, h) in t.hops.iter().enumerate() {
            s.stage_compute_s[i] += h.compute_s * steps as f64;
            s.stage_transfer_s[i] += h.transfer_s * steps as f64;
            s.stage_bytes[i] += h.bytes_per_token as f64 * steps as f64;
        }
    }
}

fn drive_options(o: Option<GenerateOptions>) -> Result<DriveRequest, Status> {
    let o = o.unwrap_or_default();
    if o.resume_ids.len() > 1 << 20 {
        return Err(CoordError::BadRequest("too many resume ids".into()).into());
    }
    // checked here, at the edge, so a bad setting is the caller's error and never reaches a stage
    let sampling = sampling_from_proto(o.sampling.as_ref()).map_err(|e| CoordError::BadRequest(e.to_string()))?;
    brigade_core::stop::check_stops(&o.stop).map_err(|e| CoordError::BadRequest(format!("stop: {e}")))?;
    if let Some(n) = o.logprobs.filter(|&n| n as usize > brigade_core::MAX_TOP_LOGPROBS) {
        return Err(CoordError::BadRequest(format!(
            "logprobs: 0 to {} alternatives per token, got {n}",
            brigade_core::MAX_TOP_LOGPROBS
        ))
        .into());
    }
    // the format is read here; the driver compiles it against the model's vocabulary
    let format = match (o.json_schema.is_empty(), o.grammar.is_empty()) {
        (true, true) => None,
        (false, false) => {
            return Err(
                CoordError::BadRequest("json_schema and grammar both constrain the answer: send one".into()).into()
            )
        }
        (false, true) => {
            let schema: serde_json::Value = serde_json::from_str(&o.json_schema)
                .map_err(|e| CoordError::BadRequest(format!("json_schema is not JSON: {e}")))?;
            Some(Format::JsonSchema(schema))
        }
        (true, false) => {
            let g = o.grammar.trim_start();
            let body = match g.strip_prefix("%llguidance") {
                Some(rest) => rest.split_once('\n').map_or("", |(_, b)| b),
                None => g,
            };
            Some(Format::Lark(body.to_string()))
        }
    };
    let format = match format {
        Some(f) => serde_json::to_string(&f).map_err(|e| CoordError::Internal(format!("the format: {e}")))?,
        None => String::new(),
    };
    Ok(DriveRequest {
        max_tokens: o.max_tokens,
        sampling: Some(sampling_to_proto(&sampling)),
        ignore_eos: o.ignore_eos,
        resume_ids: o.resume_ids,
        stop: o.stop,
        format,
        logprobs: o.logprobs,
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
            return Err(CoordError::BadRequest("the prompt is larger than 16 MiB".into()).into());
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
            return Err(CoordError::BadRequest("a chat needs at least one message".into()).into());
        }
        let size: usize = r.messages.iter().map(|m| m.content.len() + m.role.len()).sum();
        if size > 16 << 20 {
            return Err(CoordError::BadRequest("the messages are larger than 16 MiB".into()).into());
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
                state: deployment_state_to_proto(s.deployment_state(d)).into(),
                n_layers: d.n_layers as u32,
                n_ctx: d.n_ctx as u32,
                created_ms: d.created_ms,
            })
            .collect();
        Ok(Response::new(ListModelsResponse { models }))
    }

    async fn deploy(&self, req: Request<DeployRequest>) -> Result<Response<DeployResponse>, Status> {
        require_admin(&req, "deploying")?;
        let r = req.into_inner();
        // a current read: a stale replica must not refuse a name the group has freed
        if self.shared.current_state().await?.deployments.contains_key(&r.name) {
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
            expert_stages: p.expert_stages,
            predicted_decode_s: p.predicted_decode_s,
            plan_text: p.plan_text,
            created_ms: unix_ms(),
            ubatch: r.ubatch as usize,
            replacements: 0,
            note: String::new(),
            by_hand: !r.device_map.trim().is_empty(),
            cpu_moe: p.cpu_moe.min(model.n_layers),
            cpu_moe_auto: r.cpu_moe_auto,
        };
        let known = self.shared.state().models.get(&model.id) == Some(&model);
        if !known {
            self.shared.apply(Command::AddModel { model }).await?;
        }
        self.shared.apply(Command::CreateDeployment { deployment: dep }).await?;
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
        let d = s
            .deployments
            .get(&r.name)
            .ok_or_else(|| CoordError::Aborted("the deployment was removed meanwhile".into()))?;
        Ok(Response::new(DeployResponse { deployment: Some(deployment_info(&s, d, None)) }))
    }

    async fn undeploy(&self, req: Request<UndeployRequest>) -> Result<Response<UndeployResponse>, Status> {
        require_admin(&req, "undeploying")?;
        let name = req.into_inner().name;
        self.shared.apply(Command::RemoveDeployment { name: name.clone() }).await?;
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
        // a read that promises the current state goes through raft's read index
        let s = self.shared.current_state().await?;
        Ok(Response::new(status_snapshot(&self.shared, &s)))
    }

    async fn remove_replica(
        &self,
        req: Request<RemoveReplicaRequest>,
    ) -> Result<Response<RemoveReplicaResponse>, Status> {
        require_admin(&req, "removing a replica")?;
        let id = req.into_inner().id;
        let state = self.shared.current_state().await?;
        if !state.replicas.contains_key(&id) {
            return Err(CoordError::NotFound(format!(
                "replica {id} is not in the group ({:?})",
                state.replicas.keys().collect::<Vec<_>>()
            ))
            .into());
        }
        if state.replicas.len() == 1 {
            return Err(CoordError::FailedPrecondition("the last replica cannot leave its group".into()).into());
        }
        if id == self.shared.cfg.id {
            // the group stops talking to a replica as soon as its removal commits: this one
            // would never hear that it did
            return Err(CoordError::FailedPrecondition(format!(
                "this is replica {id}: ask another replica of the group to remove it"
            ))
            .into());
        }
        self.shared.raft.change_replicas(id, None).await?;
        tracing::info!("replica {id} left the group");
        let peers = self.shared.state().replicas.iter().map(|(i, a)| format!("{i}={a}")).collect();
        Ok(Response::new(RemoveReplicaResponse { peers }))
    }

    async fn plan(&self, req: Request<DeployRequest>) -> Result<Response<PlanResponse>, Status> {
        require_admin(&req, "planning")?;
        let mut r = req.into_inner();
        // a plan names no deployment (the Python SDK's `plan` sends none): any valid name
        if r.name.is_empty() {
            r.name = "plan".into();
        }
        let (_, p, _, _) = self.placement(&r).await?;
        Ok(Response::new(PlanResponse { plan_text: p.plan_text, plan_json: p.plan_json }))
    }
}

/// Refuses a call whose key is of the inference tier (admin calls: deploy, undeploy, plan,
/// remove a replica).
fn require_admin<T>(req: &tonic::Request<T>, what: &str) -> Result<(), tonic::Status> {
    match req.extensions().get::<brigade_serve::Tier>() {
        Some(brigade_serve::Tier::Admin) => Ok(()),
        _ => Err(CoordError::PermissionDenied(format!(
            "{what} needs an admin key (--admin-key); this key may only run inference"
        ))
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_reach_the_driver_and_too_many_are_the_callers_error() {
        let o = GenerateOptions { stop: vec!["\nUser:".into(), "END".into()], ..Default::default() };
        assert_eq!(drive_options(Some(o)).unwrap().stop, ["\nUser:", "END"]);
        let many = GenerateOptions { stop: vec!["x".into(); 17], ..Default::default() };
        let e = drive_options(Some(many)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), "stop: at most 16 stop strings, got 17");
        let long = GenerateOptions { stop: vec!["y".repeat(300)], ..Default::default() };
        assert!(drive_options(Some(long)).unwrap_err().message().contains("stop string 0 is 300"));
    }
}
