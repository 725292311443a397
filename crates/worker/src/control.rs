//! The worker's side of the control plane: register what this node has and measured, send
//! heartbeats, follow the assignments the coordinator streams, report readiness and links — and
//! when the coordinator goes away, keep what is loaded, keep serving, and reconnect.

use crate::identity::Creds;
use crate::node::{Loaded, Node};
use crate::router::Peer;
use crate::WorkerError;
use brigade_core::cluster::DeviceFigures;
use brigade_proto::v1::control_client::ControlClient;
use brigade_proto::v1::{
    Assignments, FetchRangeRequest, FileRange, HeartbeatRequest, LinkFigures, LinksReport, ReadyReport,
    RegisterRequest, StageState, WatchRequest,
};
use brigade_proto::VersionInterceptor;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

pub type Control = ControlClient<InterceptedService<Channel, VersionInterceptor>>;

/// Links are measured again after this long.
const REMEASURE: Duration = Duration::from_secs(600);

pub async fn connect(coordinator: &str, tls: &Creds) -> Result<Control, WorkerError> {
    let ch =
        brigade_transport::grpc::coordinator_channel(&format!("https://{coordinator}"), &tls.identity, &tls.ca_pem)
            .await
            .map_err(|e| WorkerError::Control(format!("{coordinator}: {e}")))?;
    Ok(ControlClient::with_interceptor(ch, VersionInterceptor).max_decoding_message_size(64 << 20))
}

/// A failed control call; a replica that is not the leader names the one that is.
fn control_error(what: &str, e: tonic::Status) -> WorkerError {
    if e.code() == tonic::Code::Unavailable {
        if let Some(l) = e.metadata().get("brigade-leader").and_then(|v| v.to_str().ok()) {
            return WorkerError::NotLeader(Some(l.to_string()));
        }
    }
    WorkerError::Control(format!("{what}: {}", e.message()))
}

/// Bytes of one range from the coordinator.
pub async fn fetch_range(client: &mut Control, model_id: &str, r: &FileRange) -> Result<Vec<u8>, WorkerError> {
    let req =
        FetchRangeRequest { model_id: model_id.to_string(), file: r.file.clone(), offset: r.offset, length: r.length };
    let mut s = client.fetch_range(req).await.map_err(|e| WorkerError::Fetch(e.message().to_string()))?.into_inner();
    let mut out = Vec::with_capacity(r.length.min(1 << 30) as usize);
    while let Some(c) = s.message().await.map_err(|e| WorkerError::Fetch(e.message().to_string()))? {
        if out.len() as u64 + c.data.len() as u64 > r.length {
            return Err(WorkerError::Fetch(format!("the source sent more than the {} bytes asked for", r.length)));
        }
        out.extend_from_slice(&c.data);
    }
    Ok(out)
}

/// The links this node measured, by peer: when, and what (every report carries all of them: the
/// coordinator replaces a node's links with each report).
type Measured = Arc<tokio::sync::Mutex<HashMap<String, (Instant, LinkFigures)>>>;

pub struct ControlLoop {
    pub node: Arc<Node>,
    pub coordinator: String,
    pub tls: Creds,
    pub devices: Vec<DeviceFigures>,
    pub advertise: String,
}

impl ControlLoop {
    /// Runs until `shutdown` turns true. The coordinator may be several replicas (`A,B,C`): the
    /// session is with the leader; a replica that is not says which is, and the next attempt goes
    /// there; a replica that does not answer is passed over for the next.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut delay = Duration::from_millis(100);
        let measured: Measured = Default::default();
        let addrs: Vec<String> =
            self.coordinator.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
        let mut at = 0usize;
        let mut hint: Option<String> = None;
        loop {
            let started = Instant::now();
            let addr = hint.take().unwrap_or_else(|| addrs[at % addrs.len().max(1)].clone());
            tokio::select! {
                r = self.clone().session(&addr, measured.clone()) => {
                    match r {
                        Ok(()) => {}
                        Err(WorkerError::NotLeader(Some(leader))) => {
                            tracing::info!("coordinator {addr} is not the leader; following {leader}");
                            hint = Some(leader);
                            delay = Duration::from_millis(50);
                        }
                        Err(e) => {
                            tracing::warn!("coordinator {addr}: {e}; reconnecting");
                            at += 1;
                        }
                    }
                }
                _ = shutdown.changed() => return,
            }
            if started.elapsed() > Duration::from_secs(10) {
                delay = Duration::from_millis(100);
            }
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.changed() => return,
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    async fn session(self: Arc<Self>, addr: &str, measured: Measured) -> Result<(), WorkerError> {
        let mut client = connect(addr, &self.tls).await?;
        let reg = RegisterRequest {
            protocol: brigade_proto::PROTOCOL_VERSION,
            name: self.node.cfg.name.clone(),
            advertise: self.advertise.clone(),
            devices: self.devices.iter().map(brigade_proto::convert::device_to_proto).collect(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let resp = client.register(reg).await.map_err(|e| control_error("register", e))?.into_inner();
        let interval = Duration::from_millis(u64::from(resp.heartbeat_interval_ms.clamp(100, 10_000)));
        tracing::info!("registered with the coordinator at {addr}");
        let mut stream = client
            .watch(WatchRequest { name: self.node.cfg.name.clone() })
            .await
            .map_err(|e| control_error("watch", e))?
            .into_inner();
        let (loaded_tx, mut loaded_rx) = mpsc::unbounded_channel::<Loaded>();
        let mut hb = client.clone();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                msg = stream.message() => {
                    match msg.map_err(|e| control_error("watch", e))? {
                        Some(a) => self.assigned(a, &client, &loaded_tx, &measured),
                        None => return Err(WorkerError::Control("the assignment stream ended".into())),
                    }
                }
                Some(l) = loaded_rx.recv() => {
                    let (state, error, w, kv, fetched, load_s) = match l.result {
                        Ok((w, kv, f, s)) => (StageState::Ready, String::new(), w, kv, f, s),
                        Err(e) => (StageState::Failed, e, 0, 0, 0, 0.0),
                    };
                    let r = ReadyReport {
                        name: self.node.cfg.name.clone(),
                        deployment: l.deployment,
                        generation: l.generation,
                        stage: l.stage,
                        state: state.into(),
                        error,
                        weight_bytes: w,
                        kv_bytes: kv,
                        fetched_bytes: fetched,
                        load_s,
                        out_of_memory: l.out_of_memory.is_some(),
                        device_free: l.out_of_memory.unwrap_or(0),
                    };
                    if let Err(e) = client.report_ready(r).await {
                        tracing::debug!("report ready: {}", e.message());
                    }
                }
                _ = tick.tick() => {
                    let req = HeartbeatRequest { name: self.node.cfg.name.clone(), slices: self.node.statuses(), memory_free: 0 };
                    let r = hb.heartbeat(req).await.map_err(|e| control_error("heartbeat", e))?;
                    if let Ok(mut t) = self.node.last_heartbeat.lock() {
                        *t = Some(std::time::Instant::now());
                    }
                    if r.into_inner().reregister {
                        return Err(WorkerError::Control("the coordinator asks this node to register again".into()));
                    }
                }
            }
        }
    }

    fn assigned(
        self: &Arc<Self>,
        a: Assignments,
        client: &Control,
        loaded: &mpsc::UnboundedSender<Loaded>,
        measured: &Measured,
    ) {
        self.node.router.set_admitted(a.admitted.iter().map(|c| (c.node.clone(), c.fingerprint.clone())).collect());
        let to_load = self.node.reconcile(&a.stages);
        for s in to_load {
            let node = self.node.clone();
            let mut c = client.clone();
            let tx = loaded.clone();
            let rt = tokio::runtime::Handle::current();
            tokio::task::spawn_blocking(move || {
                let model_id = s.manifest.as_ref().map(|m| m.model_id.clone()).unwrap_or_default();
                let l = node.load(&s, |r| rt.block_on(fetch_range(&mut c, &model_id, r)));
                let _ = tx.send(l);
            });
        }
        let peers: Vec<Peer> = a
            .peers
            .iter()
            .filter(|p| p.node != self.node.cfg.name)
            .map(|p| Peer { node: p.node.clone(), address: p.address.clone() })
            .collect();
        if peers.is_empty() {
            return;
        }
        let me = self.clone();
        let mut c = client.clone();
        let measured = measured.clone();
        tokio::spawn(async move {
            // one measurement at a time: concurrent bulk transfers would measure each other
            let mut m = measured.lock().await;
            let mut fresh = false;
            for p in peers {
                if m.get(&p.node).is_some_and(|(t, _)| t.elapsed() < REMEASURE) {
                    continue;
                }
                match tokio::time::timeout(Duration::from_secs(20), me.node.router.measure(&p)).await {
                    Ok(Ok(f)) => {
                        tracing::info!(
                            "link to {}: {:.3} ms, {:.1} MB/s",
                            p.node,
                            f.latency_s * 1e3,
                            f.bandwidth_bps / 1e6
                        );
                        let l = LinkFigures {
                            from: me.node.cfg.name.clone(),
                            to: p.node.clone(),
                            latency_s: f.latency_s,
                            bandwidth: f.bandwidth_bps,
                            measured_at_ms: brigade_proto::convert::unix_ms(),
                        };
                        m.insert(p.node.clone(), (Instant::now(), l));
                        fresh = true;
                    }
                    Ok(Err(e)) => tracing::warn!("measuring the link to {}: {e}", p.node),
                    Err(_) => tracing::warn!("measuring the link to {} timed out", p.node),
                }
            }
            if fresh {
                let links = m.values().map(|(_, l)| l.clone()).collect();
                let r = LinksReport { name: me.node.cfg.name.clone(), links };
                if let Err(e) = c.report_links(r).await {
                    tracing::warn!("report links: {}", e.message());
                }
            }
        });
    }
}
