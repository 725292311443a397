//! What the worker serves: the `Stage` gRPC service (sessions driven from here, the gRPC carrier of
//! activation frames, model bytes for peers) over TCP, and QUIC links from other stages over UDP,
//! on the same port number. Both take only peers holding certificates of the cluster's CA.

use crate::driver::{drive, prompt_ids};
use crate::node::Node;
use crate::WorkerError;
use brigade_proto::v1::stage_server::{Stage, StageServer};
use brigade_proto::v1::{Chunk, DriveRequest, FetchRangeRequest, FrameBytes, GenerateEvent};
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

pub struct StageService {
    pub node: Arc<Node>,
}

fn peer_name<T>(req: &Request<T>) -> Result<String, Status> {
    brigade_transport::grpc::peer_node_name(req)
        .ok_or_else(|| WorkerError::Unauthenticated("no cluster certificate".into()).into())
}

/// The node a request's certificate names and the certificate's fingerprint, refused when it is
/// not the certificate that node was admitted with (a revoked one).
fn admitted_peer<T>(node: &Node, req: &Request<T>) -> Result<(String, String), Status> {
    let who = peer_name(req)?;
    let leaf = req.peer_certs().and_then(|c| c.first().map(|l| brigade_transport::tls::fingerprint(l.as_ref())));
    let fingerprint = leaf.ok_or_else(|| WorkerError::Unauthenticated("no cluster certificate".into()))?;
    if !node.router.admits(&who, Some(&fingerprint)) {
        return Err(WorkerError::PermissionDenied(format!(
            "this certificate of `{who}` is not the one it was admitted with (revoked)"
        ))
        .into());
    }
    Ok((who, fingerprint))
}

#[tonic::async_trait]
impl Stage for StageService {
    type DriveStream = BoxStream<GenerateEvent>;
    type ActivationsStream = brigade_transport::grpc::FrameStream;
    type FetchRangeStream = BoxStream<Chunk>;

    async fn drive(&self, req: Request<DriveRequest>) -> Result<Response<Self::DriveStream>, Status> {
        let who = peer_name(&req)?;
        if who != crate::COORDINATOR_CN {
            return Err(
                WorkerError::PermissionDenied(format!("only the coordinator drives sessions, not {who}")).into()
            );
        }
        let req = req.into_inner();
        let target =
            self.node.drive.lock().ok().and_then(|d| d.get(&req.deployment).map(|(t, _)| t.clone())).ok_or_else(
                || WorkerError::Unavailable(format!("{} is not ready on {}", req.deployment, self.node.cfg.name)),
            )?;
        if req.generation != 0 && req.generation != target.generation {
            return Err(WorkerError::Unavailable(format!(
                "{} is at generation {} here, the request is for {}",
                req.deployment, target.generation, req.generation
            ))
            .into());
        }
        // refuse a bad prompt before the stream starts, so the client sees a plain error
        prompt_ids(&target, &req).map_err(Status::from)?;
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let hidden_bytes = target.hidden_bytes;
        tokio::spawn(drive(self.node.router.clone(), target, req, hidden_bytes, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn activations(
        &self,
        req: Request<Streaming<FrameBytes>>,
    ) -> Result<Response<Self::ActivationsStream>, Status> {
        let (who, fingerprint) = admitted_peer(&self.node, &req)?;
        let (link, out) =
            brigade_transport::grpc::link_from_stream(&self.node.cfg.name, &who, req.into_inner()).await?;
        let router = self.node.router.clone();
        tokio::spawn(async move {
            let brigade_transport::Link { tx, rx, .. } = link;
            router.read_link(who, Some(fingerprint), rx, tx).await;
        });
        Ok(Response::new(out))
    }

    async fn fetch_range(&self, req: Request<FetchRangeRequest>) -> Result<Response<Self::FetchRangeStream>, Status> {
        admitted_peer(&self.node, &req)?;
        let r = req.into_inner();
        let data = read_cached(&self.node.cfg.models_dir, &r).map_err(Status::from)?;
        let chunks: Vec<Result<Chunk, Status>> = data.chunks(1 << 20).map(|c| Ok(Chunk { data: c.to_vec() })).collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }
}

/// Bytes of a model file this node caches, for a peer (the peer checks them against the manifest).
fn read_cached(models_dir: &std::path::Path, r: &FetchRangeRequest) -> Result<Vec<u8>, WorkerError> {
    use std::os::unix::fs::FileExt;
    let plain = |s: &str| !s.is_empty() && !s.starts_with('.') && !s.contains(['/', '\\', '\0']);
    if !plain(&r.model_id) || !plain(&r.file) {
        return Err(WorkerError::BadRequest("model id and file must be plain names".into()));
    }
    if r.length > 1 << 30 {
        return Err(WorkerError::BadRequest(format!("{} bytes is more than one range holds", r.length)));
    }
    let p = models_dir.join(&r.model_id).join(&r.file);
    let f =
        std::fs::File::open(&p).map_err(|_| WorkerError::BadRequest(format!("this node does not hold {}", r.file)))?;
    let len = f.metadata().map_err(|e| WorkerError::io(&p, e))?.len();
    if r.offset.checked_add(r.length).is_none_or(|e| e > len) {
        return Err(WorkerError::BadRequest(format!(
            "range {}+{} is outside the {len} bytes of {}",
            r.offset, r.length, r.file
        )));
    }
    let mut buf = vec![0u8; r.length as usize];
    f.read_exact_at(&mut buf, r.offset).map_err(|e| WorkerError::io(&p, e))?;
    Ok(buf)
}

pub fn stage_server(
    node: Arc<Node>,
) -> tonic::service::interceptor::InterceptedService<StageServer<StageService>, brigade_transport::grpc::VersionCheck> {
    brigade_transport::grpc::stage_service(StageService { node })
}

/// Accepts QUIC links from other stages until the endpoint closes.
pub async fn accept_quic(node: Arc<Node>) {
    while let Some(incoming) = node.router.quic().accept().await {
        let router = node.router.clone();
        tokio::spawn(async move {
            match incoming {
                Ok(link) => {
                    let brigade_transport::Link { tx, rx, peer, fingerprint } = link;
                    tracing::debug!("link from {peer}");
                    router.read_link(peer, fingerprint, rx, tx).await;
                }
                Err(e) => tracing::warn!("refused a QUIC link: {e}"),
            }
        });
    }
}
