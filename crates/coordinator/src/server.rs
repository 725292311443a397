//! The coordinator process: shared state, the gRPC server (mutual TLS for workers, TLS for
//! clients; reflection and the standard health service for tools and load balancers), and the
//! background task that notices silent nodes.

use crate::models::Models;
use crate::pki::Pki;
use crate::store::Store;
use crate::CoordError;
use brigade_core::cluster::{Applied, ClusterState, Command, NodeState};
use brigade_proto::v1::stage_client::StageClient;
use brigade_proto::v1::SliceStatus;
use brigade_proto::VersionInterceptor;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    pub data_dir: PathBuf,
    pub join_token: Option<String>,
    /// Extra names and IPs for the coordinator's certificate.
    pub sans: Vec<String>,
    pub heartbeat_interval: Duration,
    /// A node silent this long is marked down.
    pub node_timeout: Duration,
    /// API keys clients must present (`authorization: Bearer KEY`); empty = none needed.
    pub api_keys: Vec<String>,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            data_dir: PathBuf::from("brigade-coordinator"),
            join_token: None,
            sans: Vec::new(),
            heartbeat_interval: Duration::from_millis(1000),
            node_timeout: Duration::from_secs(3),
            api_keys: Vec::new(),
        }
    }
}

/// What the coordinator last heard from a node (soft state: not replicated, not persisted).
pub struct Live {
    pub last: Instant,
    pub slices: Vec<SliceStatus>,
}

/// Measured decode figures of a deployment, from its sessions' final timings.
#[derive(Debug, Clone, Default)]
pub struct DeployStats {
    pub tokens: u64,
    pub decode_steps: u64,
    pub decode_s: f64,
    /// Per stage: compute seconds and transfer seconds summed over decode steps.
    pub stage_compute_s: Vec<f64>,
    pub stage_transfer_s: Vec<f64>,
}

impl DeployStats {
    pub fn decode_s_per_token(&self) -> f64 {
        if self.decode_steps == 0 {
            0.0
        } else {
            self.decode_s / self.decode_steps as f64
        }
    }
}

pub type StageRpc = StageClient<InterceptedService<Channel, VersionInterceptor>>;

pub struct Shared {
    pub cfg: CoordinatorConfig,
    store: Mutex<Store>,
    changed: watch::Sender<u64>,
    pub pki: Pki,
    pub models: Models,
    pub live: Mutex<HashMap<String, Live>>,
    pub stats: Mutex<HashMap<String, DeployStats>>,
    workers: tokio::sync::Mutex<HashMap<String, (String, StageRpc)>>,
    pub started: Instant,
}

impl Shared {
    /// A copy of the current state.
    pub fn state(&self) -> ClusterState {
        match self.store.lock() {
            Ok(s) => s.state().clone(),
            Err(p) => p.into_inner().state().clone(),
        }
    }

    /// Applies a command durably and wakes everyone watching the state.
    pub fn apply(&self, cmd: Command) -> Result<Applied, CoordError> {
        let out = {
            let mut s = match self.store.lock() {
                Ok(s) => s,
                Err(p) => p.into_inner(),
            };
            s.apply(cmd)?
        };
        self.changed.send_modify(|v| *v += 1);
        Ok(out)
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub fn heartbeat(&self, node: &str, slices: Vec<SliceStatus>) {
        if let Ok(mut l) = self.live.lock() {
            l.insert(node.to_string(), Live { last: Instant::now(), slices });
        }
    }

    /// Milliseconds since the node was last heard (since this process started, if never).
    pub fn heartbeat_age(&self, node: &str) -> Duration {
        self.live
            .lock()
            .ok()
            .and_then(|l| l.get(node).map(|x| x.last.elapsed()))
            .unwrap_or_else(|| self.started.elapsed())
    }

    /// A client for a worker's `Stage` service (one channel per node, remade when its address
    /// changes).
    pub async fn worker(&self, node: &str) -> Result<StageRpc, CoordError> {
        let addr = self
            .state()
            .nodes
            .get(node)
            .map(|n| n.address.clone())
            .ok_or_else(|| CoordError::NotFound(format!("unknown node `{node}`")))?;
        let mut w = self.workers.lock().await;
        if let Some((a, c)) = w.get(node) {
            if *a == addr {
                return Ok(c.clone());
            }
        }
        let ch = brigade_transport::grpc::channel(
            &format!("https://{addr}"),
            &self.pki.identity,
            self.pki.ca_pem(),
            &brigade_transport::tls::node_dns_name(node),
        )
        .await
        .map_err(|e| CoordError::Unavailable(format!("node `{node}` at {addr}: {e}")))?;
        let c = StageClient::with_interceptor(ch, VersionInterceptor).max_decoding_message_size(64 << 20);
        w.insert(node.to_string(), (addr, c.clone()));
        Ok(c)
    }

    pub async fn forget_worker(&self, node: &str) {
        self.workers.lock().await.remove(node);
    }
}

/// Marks nodes down when they fall silent, up again is their own doing (they register).
async fn watch_liveness(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let state = shared.state();
        for n in state.nodes.values().filter(|n| n.state == NodeState::Up) {
            let age = shared.heartbeat_age(&n.name);
            if age > shared.cfg.node_timeout {
                tracing::warn!("node `{}` silent for {:.1}s: marked down", n.name, age.as_secs_f64());
                let _ = shared.apply(Command::SetNodeState { name: n.name.clone(), state: NodeState::Down });
                shared.forget_worker(&n.name).await;
            }
        }
    }
}

/// Equality that takes the same time wherever the inputs differ (API keys).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn api_key_check(
    keys: Vec<String>,
) -> impl Fn(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |req: tonic::Request<()>| {
        brigade_proto::check_version(&req)?;
        if keys.is_empty() {
            return Ok(req);
        }
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match given {
            Some(k) if keys.iter().any(|x| constant_time_eq(x.as_bytes(), k.as_bytes())) => Ok(req),
            Some(_) => Err(tonic::Status::unauthenticated("invalid API key")),
            None => Err(tonic::Status::unauthenticated("an API key is required: metadata `authorization: Bearer KEY`")),
        }
    }
}

/// Runs the coordinator on `listener` until `shutdown` completes.
pub async fn run(
    cfg: CoordinatorConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), CoordError> {
    let local: SocketAddr = listener.local_addr().map_err(|e| CoordError::Internal(e.to_string()))?;
    let mut sans = cfg.sans.clone();
    sans.push("localhost".into());
    sans.push("127.0.0.1".into());
    if !local.ip().is_unspecified() {
        sans.push(local.ip().to_string());
    }
    let opened = Pki::load_or_create(&cfg.data_dir, cfg.join_token.as_deref(), &sans)?;
    if let Some(t) = &opened.new_token {
        eprintln!(
            "new cluster in {}; join token (shown once, kept in {}):\n\n    {t}\n",
            cfg.data_dir.display(),
            cfg.data_dir.join("token").display()
        );
    }
    let store = Store::open(&cfg.data_dir)?;
    let (changed, _) = watch::channel(0u64);
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        store: Mutex::new(store),
        changed,
        pki: opened.pki,
        models: Models::default(),
        live: Mutex::new(HashMap::new()),
        stats: Mutex::new(HashMap::new()),
        workers: tokio::sync::Mutex::new(HashMap::new()),
        started: Instant::now(),
    });
    let addr_file = cfg.data_dir.join("coordinator.addr");
    std::fs::write(&addr_file, local.to_string()).map_err(|e| CoordError::io(&addr_file, e))?;
    {
        let s = shared.state();
        eprintln!("coordinator listening on {local} ({} nodes, {} deployments)", s.nodes.len(), s.deployments.len());
    }
    tokio::spawn(watch_liveness(shared.clone()));

    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<brigade_proto::v1::client_server::ClientServer<crate::client::ClientService>>().await;
    health.set_serving::<brigade_proto::v1::control_server::ControlServer<crate::control::ControlService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(brigade_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| CoordError::Internal(e.to_string()))?;
    let control = InterceptedService::new(
        brigade_proto::v1::control_server::ControlServer::new(crate::control::ControlService {
            shared: shared.clone(),
        })
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(64 << 20),
        brigade_proto::require_version,
    );
    let client = InterceptedService::new(
        brigade_proto::v1::client_server::ClientServer::new(crate::client::ClientService { shared: shared.clone() })
            .max_decoding_message_size(16 << 20),
        api_key_check(cfg.api_keys.clone()),
    );
    brigade_transport::tls::install_default_provider();
    let tls = brigade_transport::grpc::coordinator_tls_config(&shared.pki.identity, shared.pki.ca_pem());
    tonic::transport::Server::builder()
        .tls_config(tls)
        .map_err(|e| CoordError::Tls(e.to_string()))?
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(control)
        .add_service(client)
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), shutdown)
        .await
        .map_err(|e| CoordError::Internal(format!("grpc server: {e}")))
}
