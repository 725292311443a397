//! What the coordinator's services and background tasks share: its configuration, the raft
//! handle (the replicated state), what it heard from the workers (soft state), measured figures,
//! and the channels to the workers. Every service module and the leader's loop depend on this
//! one; it depends on none of them (`server` wires them together), so no module of the
//! coordinator imports one that imports it back.

use crate::models::Models;
use crate::pki::Pki;
use crate::raft::RaftHandle;
use crate::CoordError;
use brigade_core::cluster::{Applied, ClusterState, Command};
use brigade_proto::v1::stage_client::StageClient;
use brigade_proto::v1::SliceStatus;
use brigade_proto::VersionInterceptor;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
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
    /// What a replica shares once its raft node, PKI and models are open (`address`: where it
    /// serves).
    pub fn new(cfg: CoordinatorConfig, raft: RaftHandle, pki: Pki, models: Models, address: String) -> Shared {
        Shared {
            cfg,
            raft,
            pki,
            models,
            live: Mutex::new(HashMap::new()),
            stats: Mutex::new(HashMap::new()),
            workers: tokio::sync::Mutex::new(HashMap::new()),
            leader_since: Mutex::new(None),
            address,
        }
    }

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
    pub fn require_leader(&self) -> Result<(), CoordError> {
        if self.raft.is_leader() {
            return Ok(());
        }
        Err(CoordError::NotLeader { leader: self.raft.leader() })
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
