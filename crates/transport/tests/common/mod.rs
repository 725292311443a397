//! A cluster CA with node identities, bounded waits, and a `Stage` service that only accepts
//! links, for the transport's tests and the throughput example.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

use brigade_proto::v1::stage_server::Stage;
use brigade_proto::v1::{Chunk, DriveRequest, FetchRangeRequest, FrameBytes, GenerateEvent};
use brigade_transport::grpc::{link_from_stream, peer_node_name, FrameStream};
use brigade_transport::{ClusterCa, Identity, Link, Role};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

pub const WAIT: Duration = Duration::from_secs(20);

pub struct Cluster {
    pub ca: ClusterCa,
}

impl Cluster {
    pub fn new(name: &str) -> Self {
        match ClusterCa::generate(name) {
            Ok(ca) => Self { ca },
            Err(e) => panic!("cluster CA: {e}"),
        }
    }

    pub fn node(&self, name: &str) -> Identity {
        match self.ca.new_identity(name, Role::Node) {
            Ok(identity) => identity,
            Err(e) => panic!("identity for {name}: {e}"),
        }
    }

    pub fn ca_pem(&self) -> &str {
        self.ca.cert_pem()
    }
}

/// Awaits `work` for at most [`WAIT`]; a hang fails the test naming `what`.
pub async fn bounded<T>(what: &str, work: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, work).await {
        Ok(value) => value,
        Err(_) => panic!("{what} did not finish within {WAIT:?}"),
    }
}

/// A worker's `Stage` as far as links go: accepted links are handed over `links`.
pub struct LinkStage {
    pub name: String,
    pub links: mpsc::Sender<Link>,
}

#[tonic::async_trait]
impl Stage for LinkStage {
    type DriveStream = ReceiverStream<Result<GenerateEvent, Status>>;
    type ActivationsStream = FrameStream;
    type FetchRangeStream = ReceiverStream<Result<Chunk, Status>>;

    async fn drive(&self, _: Request<DriveRequest>) -> Result<Response<Self::DriveStream>, Status> {
        Err(Status::unimplemented("drive"))
    }

    async fn activations(&self, request: Request<Streaming<FrameBytes>>) -> Result<Response<FrameStream>, Status> {
        let peer = peer_node_name(&request).ok_or_else(|| Status::unauthenticated("no node certificate"))?;
        let (link, stream) = link_from_stream(&self.name, &peer, request.into_inner()).await?;
        self.links.send(link).await.map_err(|_| Status::unavailable("stopping"))?;
        Ok(Response::new(stream))
    }

    async fn fetch_range(&self, _: Request<FetchRangeRequest>) -> Result<Response<Self::FetchRangeStream>, Status> {
        Err(Status::unimplemented("fetch_range"))
    }
}
