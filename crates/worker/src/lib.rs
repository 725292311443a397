//! brigade's worker: one per node. It joins the cluster, measures what the node computes with,
//! hosts the slices the coordinator assigns it, and passes activations to the next stage.
//!
//! # Layout
//! - [`identity`]: joining the cluster (token proof, certificate) and the credentials on disk.
//! - [`devices`]: the devices this node offers (every one it has, or `--devices`), measured.
//! - [`measure`]: the measured speed of brigade's kernels (the model crate's measurement).
//! - [`control`]: register, heartbeat, follow assignments, report readiness and links; reconnect.
//! - [`node`]: the hosted stages kept equal to the assignments; loading a slice.
//! - [`fetch`]: a slice's bytes checked against the manifest, fetched where missing, cached.
//! - [`stage`]: one hosted slice: its thread, its sessions' KV caches, frame processing.
//! - [`driver`]: running a session from this node around the ring of stages.
//! - [`router`]: where frames go: local stages, waiting drivers, links to other nodes.
//! - [`server`]: the `Stage` gRPC service and the QUIC accept loop.
//! - [`metrics`]: `--metrics ADDR`, the node's `/metrics` (per stage compute, hop bytes and send
//!   time, sessions, KV cache and weight bytes, heartbeat age).
//!
//! Deliberately lacking: raft (a worker follows one coordinator address at a time), placement
//! decisions (it loads what it is told), and any client API (clients talk to the coordinator).

#![forbid(unsafe_code)]

pub mod control;
pub mod devices;
pub mod driver;
mod error;
pub mod experts;
#[cfg(test)]
mod faults;
pub mod fetch;
pub mod identity;
pub mod measure;
pub mod metrics;
pub mod node;
pub mod router;
pub mod server;
pub mod stage;

pub use error::WorkerError;

/// The name in the coordinator's certificate (what a worker's `Stage` service lets drive sessions).
pub const COORDINATOR_CN: &str = "coordinator";

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// This node's name in the cluster (its certificate's name).
    pub name: String,
    /// The coordinator, `host:port`.
    pub coordinator: String,
    /// Where to take QUIC (UDP) and gRPC (TCP) from peers; port 0 picks a free port.
    pub listen: SocketAddr,
    /// The `host:port` peers reach this node at (default: the listen address).
    pub advertise: Option<String>,
    pub join_token: Option<String>,
    pub models_dir: PathBuf,
    pub data_dir: PathBuf,
    pub threads: usize,
    /// Memory offered for slices, bytes (0: what the OS says is available).
    pub memory: u64,
    /// The devices to offer (`None`: every device this node has).
    pub devices: Option<Vec<brigade_core::DeviceId>>,
    /// Memory offered on each GPU, bytes (0: what the GPU has free).
    pub gpu_memory: u64,
    pub measure: measure::Effort,
    /// Serve `/metrics` (Prometheus' text format) on this address.
    pub metrics: Option<SocketAddr>,
    /// A stage session that receives no frame this long is ended (its KV cache freed, its driver
    /// told): a driver that went away holds no slot for ever.
    pub session_idle: std::time::Duration,
    /// Speculative decoding of the sessions this node drives (prompt lookup only: a draft
    /// model would have to be loaded on the driver), `None`: no drafts.
    pub drafting: Option<Arc<brigade_model::speculative::Speculation>>,
}

/// Binds UDP and TCP on one port: the port QUIC got, or both again on another free port.
fn bind(
    listen: SocketAddr,
    tls: &identity::Creds,
) -> Result<(brigade_transport::quic::QuicEndpoint, std::net::TcpListener), WorkerError> {
    let mut last = String::new();
    for _ in 0..20 {
        let quic = brigade_transport::quic::QuicEndpoint::bind(listen, &tls.identity, &tls.ca_pem)
            .map_err(|e| WorkerError::Link(format!("bind {listen}/udp: {e}")))?;
        let addr = quic.local_addr().map_err(|e| WorkerError::Link(format!("bind {listen}/udp: {e}")))?;
        match std::net::TcpListener::bind(addr) {
            Ok(t) => return Ok((quic, t)),
            Err(e) if listen.port() == 0 => last = e.to_string(),
            Err(e) => return Err(WorkerError::Link(format!("bind {addr}/tcp: {e}"))),
        }
    }
    Err(WorkerError::Link(format!("no port free for both UDP and TCP: {last}")))
}

/// Runs a worker until `shutdown` completes.
pub async fn run(cfg: WorkerConfig, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), WorkerError> {
    brigade_core::cluster::check_node_name(&cfg.name).map_err(|e| WorkerError::BadRequest(e.to_string()))?;
    // what to offer first: a device this node cannot offer stops the worker before it joins
    let gpus = brigade_model::devices::cuda_devices();
    let offered = devices::select(cfg.devices.as_deref(), &gpus, candle_core::utils::cuda_is_available())?;
    std::fs::create_dir_all(&cfg.data_dir).map_err(|e| WorkerError::io(&cfg.data_dir, e))?;
    std::fs::create_dir_all(&cfg.models_dir).map_err(|e| WorkerError::io(&cfg.models_dir, e))?;
    let creds = match identity::load(&cfg.data_dir)? {
        Some(c) => c,
        None => {
            let token = cfg.join_token.as_deref().ok_or_else(|| {
                WorkerError::Join(format!(
                    "{} has no credentials yet: give --join-token (the coordinator printed it on its first start)",
                    cfg.data_dir.display()
                ))
            })?;
            // any replica admits a node; the first that answers
            let mut last = WorkerError::Join("no coordinator address".into());
            let mut joined = None;
            for addr in cfg.coordinator.split(',').map(str::trim).filter(|a| !a.is_empty()) {
                match identity::join(addr, &cfg.name, token, &cfg.data_dir).await {
                    Ok(c) => {
                        joined = Some(c);
                        break;
                    }
                    Err(e @ WorkerError::Join(_)) => return Err(e),
                    Err(e) => last = e,
                }
            }
            joined.ok_or(last)?
        }
    };
    let limits = devices::Limits { memory: cfg.memory, gpu_memory: cfg.gpu_memory };
    let (threads, effort, dir, strict) = (cfg.threads, cfg.measure, cfg.data_dir.clone(), cfg.devices.is_some());
    let (offered, figures) =
        tokio::task::spawn_blocking(move || devices::measure(&offered, strict, threads, effort, limits, Some(&dir)))
            .await
            .map_err(|e| WorkerError::Internal(e.to_string()))??;
    tracing::info!("offering {}", offered.names());
    let (quic, tcp) = bind(cfg.listen, &creds.tls)?;
    let local = quic.local_addr().map_err(|e| WorkerError::Link(e.to_string()))?;
    let advertise = match &cfg.advertise {
        Some(a) => a.clone(),
        None if local.ip().is_unspecified() => {
            return Err(WorkerError::BadRequest(format!(
                "listening on {local}: give --advertise HOST:PORT, the address peers reach this node at"
            )))
        }
        None => local.to_string(),
    };
    let router = router::Router::new(cfg.name.clone(), creds.tls.clone(), quic);
    let node = node::Node::new(cfg.clone(), offered, router);
    tokio::spawn(server::accept_quic(node.clone()));
    tcp.set_nonblocking(true).map_err(|e| WorkerError::io(std::path::Path::new("tcp"), e))?;
    let tcp = tokio::net::TcpListener::from_std(tcp).map_err(|e| WorkerError::Link(e.to_string()))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let grpc = {
        let mut builder = brigade_transport::grpc::server(&creds.tls.identity, &creds.tls.ca_pem)
            .map_err(|e| WorkerError::Tls(e.to_string()))?;
        let svc = server::stage_server(node.clone());
        let (health, health_svc) = tonic_health::server::health_reporter();
        health.set_serving::<brigade_proto::v1::stage_server::StageServer<server::StageService>>().await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(brigade_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(|e| WorkerError::Internal(e.to_string()))?;
        let mut rx = stop_rx.clone();
        tokio::spawn(async move {
            let r = builder
                .add_service(health_svc)
                .add_service(reflection)
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    brigade_transport::grpc::incoming(tcp, brigade_transport::grpc::GRPC_CAPS),
                    async move {
                        let _ = rx.changed().await;
                    },
                )
                .await;
            r.map_err(|e| WorkerError::Link(format!("grpc server: {e}")))
        })
    };
    eprintln!("worker {} listening on {advertise} (QUIC/UDP and gRPC/TCP)", cfg.name);
    let ctl = Arc::new(control::ControlLoop {
        node: node.clone(),
        coordinator: cfg.coordinator.clone(),
        tls: creds.tls.clone(),
        devices: figures,
        advertise,
    });
    let ctl_task = tokio::spawn(ctl.run(stop_rx.clone()));
    if let Some(addr) = cfg.metrics {
        metrics::serve(node.clone(), addr, stop_rx.clone()).await?;
    }
    shutdown.await;
    let _ = stop_tx.send(true);
    let _ = ctl_task.await;
    let _ = grpc.await;
    node.router.quic().close();
    Ok(())
}
