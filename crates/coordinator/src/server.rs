//! The coordinator process: shared state over the raft node, the gRPC server (mutual TLS for
//! workers and replicas, TLS for clients; reflection and the standard health service for tools
//! and load balancers), and the leader's background tasks (liveness, recovery, rebalancing).

use crate::models::Models;
use crate::pki::Pki;
use crate::raft::{RaftHandle, RaftOptions};
use crate::CoordError;
use brigade_core::cluster::{Applied, ClusterState, Command};
use brigade_proto::v1::stage_client::StageClient;
use brigade_proto::v1::SliceStatus;
use brigade_proto::VersionInterceptor;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

/// The metadata key a replica that is not the leader names the leader's address in.
pub const LEADER_METADATA_KEY: &str = "brigade-leader";

#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    pub data_dir: PathBuf,
    pub join_token: Option<String>,
    /// Extra names and IPs for the coordinator's certificate.
    pub sans: Vec<String>,
    pub heartbeat_interval: Duration,
    /// A node silent this long is marked down (and its deployments re-placed).
    pub node_timeout: Duration,
    /// API keys clients must present (`authorization: Bearer KEY`), in their two tiers: admin
    /// keys also deploy, undeploy, plan and remove replicas. None: no key needed.
    pub keys: brigade_serve::ApiKeys,
    /// The HTTP dashboard and `/metrics` need a key too.
    pub protect_metrics: bool,
    /// `deploy -m` may name only files under this directory (`None`: any file this process can
    /// read — for a coordinator whose deploy callers are trusted).
    pub models_dir: Option<PathBuf>,
    /// This replica's raft id.
    pub id: u64,
    /// The replicas of a group bootstrapped together, this one included (empty: a group of one,
    /// this replica at `advertise`).
    pub peers: BTreeMap<u64, String>,
    /// The address other replicas and workers reach this one at (default: the listen address).
    pub advertise: Option<String>,
    /// Join a running group through this replica instead of bootstrapping one.
    pub join: Option<String>,
    /// The group's replica secret, for `join` (a replica's `replica-token` file).
    pub replica_secret: Option<String>,
    /// Start a new cluster even though this data dir has held a raft log (which is gone now).
    pub force_new_cluster: bool,
    /// One raft tick (elections take 10–20).
    pub raft_tick: Duration,
    /// Re-place a deployment when a placement this much faster appears (0.25 = 25%).
    pub rebalance_gain: f64,
    /// Serve the OpenAI-compatible HTTP API here too (port 0: a free one, written to
    /// `coordinator.http.addr` in the data dir); the same API keys as the gRPC client API.
    pub http: Option<SocketAddr>,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            data_dir: PathBuf::from("brigade-coordinator"),
            join_token: None,
            sans: Vec::new(),
            heartbeat_interval: Duration::from_millis(1000),
            node_timeout: Duration::from_secs(3),
            keys: brigade_serve::ApiKeys::default(),
            protect_metrics: false,
            models_dir: None,
            id: 1,
            peers: BTreeMap::new(),
            advertise: None,
            join: None,
            replica_secret: None,
            force_new_cluster: false,
            raft_tick: Duration::from_millis(100),
            rebalance_gain: 0.25,
            http: None,
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
    /// Per stage: bytes sent to the next stage, summed over decode steps.
    pub stage_bytes: Vec<f64>,
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
    pub raft: RaftHandle,
    pub pki: Pki,
    pub models: Models,
    pub live: Mutex<HashMap<String, Live>>,
    pub stats: Mutex<HashMap<String, DeployStats>>,
    workers: tokio::sync::Mutex<HashMap<String, (String, StageRpc)>>,
    /// When this replica last became the leader (heartbeat ages count from there at most).
    pub leader_since: Mutex<Option<Instant>>,
    /// This replica's address.
    pub address: String,
}

impl Shared {
    /// This replica's applied state (see [`Shared::current_state`] for a read that is not stale).
    pub fn state(&self) -> Arc<ClusterState> {
        self.raft.state()
    }

    /// The state after a read barrier: everything committed before the call is in it.
    pub async fn current_state(&self) -> Result<Arc<ClusterState>, CoordError> {
        self.raft.read_barrier().await?;
        Ok(self.raft.state())
    }

    /// Replicates a command and returns its result once applied here.
    pub async fn apply(&self, cmd: Command) -> Result<Applied, CoordError> {
        self.raft.propose(cmd).await
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.raft.subscribe()
    }

    /// Refuses a call that only the leader serves, naming the leader for the caller to follow.
    pub fn require_leader(&self) -> Result<(), tonic::Status> {
        if self.raft.is_leader() {
            return Ok(());
        }
        let mut st = match self.raft.leader() {
            Some((id, addr)) => {
                let mut s = tonic::Status::unavailable(format!("not the leader; the leader is replica {id} at {addr}"));
                if let Ok(v) = addr.parse() {
                    s.metadata_mut().insert(LEADER_METADATA_KEY, v);
                }
                s
            }
            None => tonic::Status::unavailable("no coordinator leader yet; retry"),
        };
        st.metadata_mut().insert("retry-after-ms", tonic::metadata::MetadataValue::from(200u32));
        Err(st)
    }

    pub fn heartbeat(&self, node: &str, slices: Vec<SliceStatus>) {
        if let Ok(mut l) = self.live.lock() {
            l.insert(node.to_string(), Live { last: Instant::now(), slices });
        }
    }

    /// Time since the node was last heard: since this replica became the leader at most (a new
    /// leader gives every node a full timeout to find it).
    pub fn heartbeat_age(&self, node: &str) -> Duration {
        let since = self.leader_since.lock().ok().and_then(|l| *l).unwrap_or(Instant::now());
        let last = self.live.lock().ok().and_then(|l| l.get(node).map(|x| x.last));
        match last {
            Some(t) if t > since => t.elapsed(),
            _ => since.elapsed(),
        }
    }

    /// Sessions the workers report active on a deployment's stages (from heartbeats).
    pub fn active_sessions(&self, deployment: &str) -> u32 {
        let Ok(l) = self.live.lock() else { return 0 };
        l.values()
            .flat_map(|x| x.slices.iter())
            .filter(|s| s.deployment == deployment)
            .map(|s| s.active_sessions)
            .max()
            .unwrap_or(0)
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

/// Largest request body from a caller without a cluster certificate (a worker's `Join`, an SDK's
/// calls): such callers are anyone, so none may make this process buffer more per stream.
pub const CERTLESS_BODY: usize = 1 << 20;

/// Caps the body of each request that came without a client certificate at [`CERTLESS_BODY`]
/// (tonic's limits are per service, not per caller). A tower layer, as tonic applies it inside
/// the connection's TLS info, which is how it knows.
#[derive(Clone)]
struct CertlessLimit<S> {
    inner: S,
}

impl<S> tower::Service<tonic::codegen::http::Request<tonic::body::Body>> for CertlessLimit<S>
where
    S: tower::Service<tonic::codegen::http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<tonic::body::Body>) -> S::Future {
        use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
        let certified = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>().and_then(|i| i.peer_certs()).is_some();
        let req = if certified {
            req
        } else {
            req.map(|body| tonic::body::Body::new(http_body_util::Limited::new(body, CERTLESS_BODY)))
        };
        self.inner.call(req)
    }
}

/// The client API's interceptor: the protocol version, and the caller's key, whose tier travels
/// to the handlers in the request's extensions ([`require_admin`]).
fn api_key_check(
    keys: brigade_serve::ApiKeys,
) -> impl Fn(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |mut req: tonic::Request<()>| {
        brigade_proto::check_version(&req)?;
        let given = brigade_serve::ApiKeys::bearer(req.metadata().get("authorization").and_then(|v| v.to_str().ok()));
        let tier = keys.check(given).map_err(|e| match e {
            brigade_serve::KeyError::Invalid => tonic::Status::unauthenticated("invalid API key"),
            brigade_serve::KeyError::Missing => {
                tonic::Status::unauthenticated("an API key is required: metadata `authorization: Bearer KEY`")
            }
        })?;
        req.extensions_mut().insert(tier);
        Ok(req)
    }
}

/// Refuses a call whose key is of the inference tier (admin calls: deploy, undeploy, plan,
/// remove a replica).
pub(crate) fn require_admin<T>(req: &tonic::Request<T>, what: &str) -> Result<(), tonic::Status> {
    match req.extensions().get::<brigade_serve::Tier>() {
        Some(brigade_serve::Tier::Admin) => Ok(()),
        _ => Err(tonic::Status::permission_denied(format!(
            "{what} needs an admin key (--admin-key); this key may only run inference"
        ))),
    }
}

/// Starts the OpenAI-compatible HTTP API on `addr`, in the background until `stop` is cancelled.
async fn serve_http(
    shared: &Arc<Shared>,
    addr: SocketAddr,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, CoordError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CoordError::Internal(format!("binding --http {addr}: {e}")))?;
    let local = listener.local_addr().map_err(|e| CoordError::Internal(e.to_string()))?;
    let file = shared.cfg.data_dir.join("coordinator.http.addr");
    std::fs::write(&file, local.to_string()).map_err(|e| CoordError::io(&file, e))?;
    eprintln!("OpenAI-compatible HTTP API on http://{local}/v1");
    let backend = Arc::new(crate::http::ClusterBackend::new(shared.clone()));
    let cfg = brigade_serve::ServeConfig {
        keys: shared.cfg.keys.clone(),
        protect_metrics: shared.cfg.protect_metrics,
        ..Default::default()
    };
    Ok(tokio::spawn(async move {
        if let Err(e) = brigade_serve::serve(listener, backend, cfg, stop.cancelled_owned()).await {
            tracing::error!("the HTTP API stopped: {e}");
        }
    }))
}

/// How long shutdown waits for the raft task, the leader tasks and the HTTP API to end.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(10);

/// Runs the coordinator on `listener` until `shutdown` completes, or until this replica cannot
/// go on (its raft log cannot be written: that error is returned). One cancellation token stops
/// the gRPC server, the raft task, the leader tasks and the HTTP API; when this returns, each
/// has ended (or been given [`SHUTDOWN_WAIT`]) and the raft log is closed.
pub async fn run(
    cfg: CoordinatorConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), CoordError> {
    brigade_transport::tls::install_default_provider();
    let local: SocketAddr = listener.local_addr().map_err(|e| CoordError::Internal(e.to_string()))?;
    let address = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
    let mut sans = cfg.sans.clone();
    sans.push("localhost".into());
    sans.push("127.0.0.1".into());
    if !local.ip().is_unspecified() {
        sans.push(local.ip().to_string());
    }
    if let Some(host) = address.rsplit_once(':').map(|(h, _)| h.trim_matches(['[', ']']).to_string()) {
        if !sans.contains(&host) {
            sans.push(host);
        }
    }
    let mut peers = cfg.peers.clone();
    if let Some(join) = &cfg.join {
        // a new replica: the cluster's secrets and the group's members from a running replica
        let got = crate::raft_service::join_group(join, cfg.id, &address, cfg.replica_secret.as_deref(), &cfg.data_dir)
            .await?;
        peers = got;
    }
    let opened =
        Pki::load_or_create(&cfg.data_dir, cfg.join_token.as_deref(), &sans, peers.len() > 1 || cfg.join.is_some())?;
    if let Some(t) = &opened.new_token {
        eprintln!(
            "new cluster in {}; join token (shown once, kept in {}):\n\n    {t}\n",
            cfg.data_dir.display(),
            cfg.data_dir.join("token").display()
        );
    }
    if opened.new_replica_secret {
        eprintln!(
            "the replica secret new replicas join with (`brigade coordinator join --replica-token-file`) is in {}; workers never need it",
            cfg.data_dir.join(crate::pki::REPLICA_SECRET_FILE).display()
        );
    }
    let bootstrap = cfg.join.is_none();
    if peers.is_empty() {
        peers.insert(cfg.id, address.clone());
    }
    if !peers.contains_key(&cfg.id) {
        return Err(CoordError::BadRequest(format!("--peers does not name this replica's id {}", cfg.id)));
    }
    let stop = CancellationToken::new();
    let (raft, raft_task) = crate::raft::node::start(
        RaftOptions {
            id: cfg.id,
            peers: if bootstrap { peers.clone() } else { BTreeMap::new() },
            known: peers.clone(),
            data_dir: cfg.data_dir.clone(),
            tick: cfg.raft_tick,
            force_new_cluster: cfg.force_new_cluster,
        },
        opened.pki.identity.clone(),
        opened.pki.ca_pem().to_string(),
        stop.clone(),
    )?;
    let mut tasks = Vec::new();
    // from here every way out (an error included) goes through the teardown below, which
    // stops the raft task and waits for it: the log is closed when `run` returns
    let served = async {
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            raft,
            pki: opened.pki,
            models: Models::new(cfg.models_dir.as_deref())?,
            live: Mutex::new(HashMap::new()),
            stats: Mutex::new(HashMap::new()),
            workers: tokio::sync::Mutex::new(HashMap::new()),
            leader_since: Mutex::new(None),
            address: address.clone(),
        });
        let addr_file = cfg.data_dir.join("coordinator.addr");
        std::fs::write(&addr_file, local.to_string()).map_err(|e| CoordError::io(&addr_file, e))?;
        {
            let s = shared.state();
            eprintln!(
                "coordinator replica {} listening on {local} ({} replicas, {} nodes, {} deployments known)",
                cfg.id,
                peers.len(),
                s.nodes.len(),
                s.deployments.len()
            );
        }
        tasks.push(tokio::spawn(crate::recover::leader_tasks(shared.clone(), stop.clone())));
        if let Some(addr) = cfg.http {
            tasks.push(serve_http(&shared, addr, stop.clone()).await?);
        }
        serve_grpc(&shared, listener, stop.clone(), shutdown).await
    }
    .await;
    // whatever ended the gRPC server ends the rest
    stop.cancel();
    let raft_result = match tokio::time::timeout(SHUTDOWN_WAIT, raft_task).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(CoordError::Internal(format!("the raft task failed: {e}"))),
        Err(_) => Err(CoordError::Internal(format!("the raft task did not stop within {}s", SHUTDOWN_WAIT.as_secs()))),
    };
    for t in tasks {
        if tokio::time::timeout(SHUTDOWN_WAIT, t).await.is_err() {
            tracing::warn!("a coordinator task did not stop within {}s", SHUTDOWN_WAIT.as_secs());
        }
    }
    raft_result.and(served)
}

/// The gRPC services on `listener` until `shutdown` completes or `stop` is cancelled.
async fn serve_grpc(
    shared: &Arc<Shared>,
    listener: tokio::net::TcpListener,
    stop: CancellationToken,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), CoordError> {
    let cfg = &shared.cfg;
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
        api_key_check(cfg.keys.clone()),
    );
    let raft_svc = InterceptedService::new(
        brigade_proto::v1::raft_server::RaftServer::new(crate::raft_service::RaftService { shared: shared.clone() })
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20),
        crate::raft_service::raft_gate,
    );
    let join_svc = InterceptedService::new(
        brigade_proto::v1::replica_join_server::ReplicaJoinServer::new(crate::raft_service::ReplicaJoinService {
            shared: shared.clone(),
        })
        .max_decoding_message_size(crate::raft_service::MAX_JOIN_REQUEST)
        .max_encoding_message_size(1 << 20),
        brigade_proto::require_version,
    );
    let tls = brigade_transport::grpc::coordinator_tls_config(&shared.pki.identity, shared.pki.ca_pem());
    brigade_transport::grpc::bounded_server(tonic::transport::Server::builder())
        .tls_config(tls)
        .map_err(|e| CoordError::Tls(e.to_string()))?
        .layer(tower::layer::layer_fn(|inner| CertlessLimit { inner }))
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(raft_svc)
        .add_service(join_svc)
        .add_service(control)
        .add_service(client)
        .serve_with_incoming_shutdown(
            brigade_transport::grpc::incoming(listener, brigade_transport::grpc::GRPC_CAPS),
            async move {
                tokio::select! {
                    _ = shutdown => {}
                    _ = stop.cancelled() => {}
                }
                // at once, not after the drain: a worker's Watch stream ends only when the raft
                // task does, and the graceful shutdown waits for every stream
                stop.cancel();
            },
        )
        .await
        .map_err(|e| CoordError::Internal(format!("grpc server: {e}")))
}
