//! The coordinator process: [`Shared`] over the raft node, the gRPC server (mutual TLS for
//! workers and replicas, TLS for clients; reflection and the standard health service for tools
//! and load balancers), and the leader's background tasks (liveness, recovery, rebalancing).

use crate::models::Models;
use crate::pki::Pki;
use crate::raft::RaftOptions;
use crate::shared::{CoordinatorConfig, Shared};
use crate::CoordError;
use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tonic::codegen::InterceptedService;

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
            brigade_serve::KeyError::Invalid => CoordError::Unauthenticated("invalid API key".into()),
            brigade_serve::KeyError::Missing => {
                CoordError::Unauthenticated("an API key is required: metadata `authorization: Bearer KEY`".into())
            }
        })?;
        req.extensions_mut().insert(tier);
        Ok(req)
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
        let shared = Arc::new(Shared::new(
            cfg.clone(),
            raft,
            opened.pki,
            Models::new(cfg.models_dir.as_deref())?,
            address.clone(),
        ));
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
