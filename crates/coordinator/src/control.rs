//! The `Control` service: what workers call. Every call but `Join` must come with the node's
//! certificate (issued by the cluster CA at `Join`, and still the one on record for that name),
//! and may only speak for the node the certificate names.

use crate::assign;
use crate::shared::Shared;
use crate::CoordError;
use brigade_core::cluster::{ClusterState, Command, LinkRecord, NodeRecord, NodeState, StageState};
use brigade_core::Link;
use brigade_proto::convert::{device_from_proto, stage_state_from_proto, unix_ms};
use brigade_proto::v1::control_server::Control;
use brigade_proto::v1::{
    Assignments, Chunk, FetchRangeRequest, HeartbeatRequest, HeartbeatResponse, JoinRequest, JoinResponse, LinksAck,
    LinksReport, ReadyAck, ReadyReport, RegisterRequest, RegisterResponse, WatchRequest,
};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

pub struct ControlService {
    pub shared: Arc<Shared>,
}

impl ControlService {
    /// The node the request's certificate speaks for, checked against the admitted certificate.
    fn node<T>(&self, req: &Request<T>, claimed: &str) -> Result<String, Status> {
        let certs = req
            .peer_certs()
            .ok_or_else(|| CoordError::Unauthenticated("no client certificate: join the cluster first".into()))?;
        let leaf = certs.first().ok_or_else(|| CoordError::Unauthenticated("no client certificate".into()))?;
        let name = brigade_transport::tls::peer_name_from_cert(leaf.as_ref())
            .ok_or_else(|| CoordError::Unauthenticated("the client certificate names no node".into()))?;
        if name != claimed {
            return Err(CoordError::PermissionDenied(format!(
                "a certificate of `{name}` cannot speak for `{claimed}`"
            ))
            .into());
        }
        let fp = brigade_transport::tls::fingerprint(leaf.as_ref());
        let state = self.shared.state();
        match state.admitted.get(&name) {
            Some(a) if a.fingerprint == fp => Ok(name),
            Some(_) => Err(CoordError::PermissionDenied(format!(
                "this certificate of `{name}` was replaced by a later join: use the newer one or join again"
            ))
            .into()),
            None => Err(CoordError::PermissionDenied(format!("`{name}` has not joined this cluster")).into()),
        }
    }
}

#[tonic::async_trait]
impl Control for ControlService {
    type WatchStream = BoxStream<Assignments>;
    type FetchRangeStream = BoxStream<Chunk>;

    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinResponse>, Status> {
        let req = req.into_inner();
        brigade_proto::check_protocol(req.protocol)?;
        let (resp, fingerprint) = match self.shared.pki.join(&req) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("join of `{}` refused: {e}", req.name.chars().take(64).collect::<String>());
                return Err(e.into());
            }
        };
        self.shared.apply(Command::AdmitNode { name: req.name.clone(), fingerprint, admitted_ms: unix_ms() }).await?;
        tracing::info!("node `{}` joined", req.name);
        Ok(Response::new(resp))
    }

    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterResponse>, Status> {
        self.shared.require_leader()?;
        let name = self.node(&req, &req.get_ref().name)?;
        let r = req.into_inner();
        brigade_proto::check_protocol(r.protocol)?;
        let devices = r
            .devices
            .iter()
            .map(device_from_proto)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CoordError::BadRequest(format!("node `{name}`: {e}")))?;
        if devices.is_empty() {
            return Err(CoordError::BadRequest(format!("node `{name}` registered no devices")).into());
        }
        if r.advertise.parse::<std::net::SocketAddr>().is_err() && !r.advertise.contains(':') {
            return Err(CoordError::BadRequest(format!("node `{name}`: `{}` is not host:port", r.advertise)).into());
        }
        let node = NodeRecord {
            name: name.clone(),
            address: r.advertise,
            devices,
            version: r.version,
            state: NodeState::Up,
            registered_ms: unix_ms(),
            lowered: Default::default(),
        };
        self.shared.heartbeat(&name, Vec::new());
        self.shared.apply(Command::RegisterNode { node }).await?;
        tracing::info!("node `{name}` registered");
        Ok(Response::new(RegisterResponse {
            heartbeat_interval_ms: self.shared.cfg.heartbeat_interval.as_millis() as u32,
        }))
    }

    async fn heartbeat(&self, req: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        self.shared.require_leader()?;
        let name = self.node(&req, &req.get_ref().name)?;
        let r = req.into_inner();
        let state = self.shared.state();
        let known_up = state.nodes.get(&name).is_some_and(|n| n.state == NodeState::Up);
        self.shared.heartbeat(&name, r.slices);
        Ok(Response::new(HeartbeatResponse { reregister: !known_up }))
    }

    async fn watch(&self, req: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        self.shared.require_leader()?;
        let name = self.node(&req, &req.get_ref().name)?;
        let shared = self.shared.clone();
        let mut changed = shared.subscribe();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut last: Option<Assignments> = None;
            loop {
                let a = assign::for_node(&shared.state(), &name);
                if last.as_ref() != Some(&a) {
                    if tx.send(Ok(a.clone())).await.is_err() {
                        return;
                    }
                    last = Some(a);
                }
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    _ = tx.closed() => return,
                }
                if !shared.raft.is_leader() {
                    // the node must follow the new leader: end the stream with where it is
                    let why = shared.require_leader().err();
                    let why = why.unwrap_or_else(|| CoordError::Unavailable("leader changed".into()));
                    let _ = tx.send(Err(why.into())).await;
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn report_ready(&self, req: Request<ReadyReport>) -> Result<Response<ReadyAck>, Status> {
        self.shared.require_leader()?;
        let name = self.node(&req, &req.get_ref().name)?;
        let r = req.into_inner();
        let error: String = r.error.chars().take(2000).collect();
        let state = match stage_state_from_proto(r.state, &error) {
            Ok(s @ (StageState::Ready | StageState::Failed(_) | StageState::Loading)) => s,
            Ok(s) => return Err(CoordError::BadRequest(format!("a worker reports a stage {}", s.name())).into()),
            Err(n) => return Err(CoordError::BadRequest(format!("stage state {n}")).into()),
        };
        if let StageState::Failed(e) = &state {
            tracing::warn!("stage {} of {} on {name} failed: {e}", r.stage, r.deployment);
        }
        if r.out_of_memory && matches!(state, StageState::Failed(_)) {
            // the device holds less than the plan counted on: lower it before the failure is
            // recorded, so the re-placement the failure starts plans with the lower figure
            if let Some(cmd) = lower_after_oom(&self.shared.state(), &name, &r) {
                tracing::warn!("{cmd:?}");
                // the failure is recorded even if the lowering is not (the worker does not
                // report twice): the stage must not stay pending
                if let Err(e) = self.shared.apply(cmd).await {
                    tracing::warn!("lowering the memory of {name} after stage {} ran out: {e}", r.stage);
                }
            }
        }
        let cmd = Command::StageReport {
            deployment: r.deployment,
            generation: r.generation,
            stage: r.stage as usize,
            node: name,
            state,
            weight_bytes: r.weight_bytes,
            kv_bytes: r.kv_bytes,
            fetched_bytes: r.fetched_bytes,
        };
        self.shared.apply(cmd).await?;
        Ok(Response::new(ReadyAck {}))
    }

    async fn report_links(&self, req: Request<LinksReport>) -> Result<Response<LinksAck>, Status> {
        self.shared.require_leader()?;
        let name = self.node(&req, &req.get_ref().name)?;
        let r = req.into_inner();
        let now = unix_ms();
        let links = r
            .links
            .into_iter()
            .map(|l| LinkRecord {
                from: l.from,
                to: l.to,
                link: Link { bandwidth: l.bandwidth, latency: l.latency_s },
                measured_ms: if l.measured_at_ms == 0 { now } else { l.measured_at_ms },
            })
            .collect();
        self.shared.apply(Command::SetLinks { from: name, links }).await?;
        Ok(Response::new(LinksAck {}))
    }

    async fn fetch_range(&self, req: Request<FetchRangeRequest>) -> Result<Response<Self::FetchRangeStream>, Status> {
        let certs =
            req.peer_certs().ok_or_else(|| CoordError::Unauthenticated("fetching needs a node certificate".into()))?;
        let named = certs
            .first()
            .and_then(|c| brigade_transport::tls::peer_name_from_cert(c.as_ref()))
            .ok_or_else(|| CoordError::Unauthenticated("the client certificate names no node".into()))?;
        // the certificate the node holds now: a replaced (revoked) one fetches nothing
        let who = self.node(&req, &named)?;
        let r = req.into_inner();
        let model = self
            .shared
            .state()
            .models
            .get(&r.model_id)
            .cloned()
            .ok_or_else(|| CoordError::NotFound(format!("unknown model {}", r.model_id)))?;
        let shared = self.shared.clone();
        let t0 = Instant::now();
        let data = tokio::task::spawn_blocking(move || shared.models.read(&model, &r.file, r.offset, r.length))
            .await
            .map_err(|e| CoordError::Internal(e.to_string()))??;
        tracing::debug!("{who} fetched {} bytes in {:?}", data.len(), t0.elapsed());
        let chunks: Vec<Result<Chunk, Status>> = data.chunks(1 << 20).map(|c| Ok(Chunk { data: c.to_vec() })).collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }
}

/// The memory a device is taken to have after stage `r.stage` ran out of it while loading there:
/// at most what the worker saw free after the attempt, and at most 7/8 of what the stage was
/// predicted to need (the load needed more than that, or other users hold memory the plan did
/// not see). Each failure lowers the figure, so re-placing converges: fewer layers there, at
/// last none. `None` for a stale report (another generation, or a stage not on this node).
pub fn lower_after_oom(state: &ClusterState, node: &str, r: &ReadyReport) -> Option<Command> {
    let d = state.deployments.get(&r.deployment).filter(|d| d.generation == r.generation)?;
    let s = d.stage(r.stage as usize).filter(|s| s.node == node)?;
    let current = state.nodes.get(node)?.devices.iter().find(|x| x.name == s.device)?.memory_free;
    let mut lowered = current.min((s.weight_bytes + s.kv_bytes) / 8 * 7);
    if r.device_free > 0 {
        lowered = lowered.min(r.device_free);
    }
    Some(Command::LowerDeviceMemory { node: node.to_string(), device: s.device.clone(), memory_free: lowered })
}
