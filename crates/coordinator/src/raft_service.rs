//! The `Raft` service between coordinator replicas: raft messages in, and new replicas joining
//! the group (`brigade coordinator join --via ADDR`): the joiner proves it knows the group's
//! replica secret (a channel-bound HMAC like a worker's join, under its own label and key — the
//! workers' join token admits no replica), the group adds it as a raft **learner**, and it
//! receives the cluster's secrets — the CA, its key and the join token — which only the replicas
//! hold. The leader promotes a learner to voter once it has caught up with the log
//! (`raft::node`), so a joiner that never answers never counts towards the quorum.

use crate::pki::write_secret;
use crate::shared::Shared;
use crate::CoordError;
use brigade_proto::v1::raft_server::Raft;
use brigade_proto::v1::replica_join_client::ReplicaJoinClient;
use brigade_proto::v1::replica_join_server::ReplicaJoin;
use brigade_proto::v1::{RaftAck, RaftEnvelope, ReplicaJoinRequest, ReplicaJoinResponse};
use protobuf::Message as _;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct RaftService {
    pub shared: Arc<Shared>,
}

#[tonic::async_trait]
impl Raft for RaftService {
    async fn step(&self, req: Request<RaftEnvelope>) -> Result<Response<RaftAck>, Status> {
        // `raft_gate` refused callers without the coordinator certificate before the body was read
        let env = req.into_inner();
        brigade_proto::check_protocol(env.protocol)?;
        let msg = raft::eraftpb::Message::parse_from_bytes(&env.message)
            .map_err(|e| CoordError::BadRequest(format!("not a raft message: {e}")))?;
        if msg.from != env.from || msg.to != self.shared.cfg.id {
            return Err(CoordError::BadRequest(format!(
                "a raft message from {} to {} in an envelope from {} (this is replica {})",
                msg.from, msg.to, env.from, self.shared.cfg.id
            ))
            .into());
        }
        self.shared.raft.step(msg);
        Ok(Response::new(RaftAck {}))
    }
}

/// The `Raft` service's interceptor: the protocol version, and the coordinator certificate —
/// checked on the request's head, before tonic reads (and buffers) a body of up to 256 MiB.
pub fn raft_gate(req: Request<()>) -> Result<Request<()>, Status> {
    let req = brigade_proto::require_version(req)?;
    if brigade_transport::grpc::peer_node_name(&req).as_deref() != Some(crate::pki::COORDINATOR_CN) {
        return Err(
            CoordError::PermissionDenied("raft messages are taken from coordinator replicas only".into()).into()
        );
    }
    Ok(req)
}

/// Largest `JoinReplica` request: an id, an address, a nonce and a proof.
pub const MAX_JOIN_REQUEST: usize = 4 << 10;

pub struct ReplicaJoinService {
    pub shared: Arc<Shared>,
}

#[tonic::async_trait]
impl ReplicaJoin for ReplicaJoinService {
    async fn join_replica(&self, req: Request<ReplicaJoinRequest>) -> Result<Response<ReplicaJoinResponse>, Status> {
        let r = req.into_inner();
        brigade_proto::check_protocol(r.protocol)?;
        if r.id == 0 {
            return Err(CoordError::BadRequest("replica id 0 is not an id".into()).into());
        }
        if !r.address.contains(':') || r.address.len() > 256 {
            return Err(CoordError::BadRequest(format!("`{}` is not host:port", r.address)).into());
        }
        let nonce = self.shared.pki.check_replica_proof(r.id, &r.nonce, &r.proof)?;
        let state = self.shared.current_state().await?;
        if state.replicas.get(&r.id) != Some(&r.address) {
            if state.replicas.contains_key(&r.id) {
                return Err(CoordError::AlreadyExists(format!(
                    "replica {} is in the group at {}; remove it first (`brigade coordinator leave`)",
                    r.id, state.replicas[&r.id]
                ))
                .into());
            }
            self.shared.raft.add_learner(r.id, r.address.clone()).await?;
            tracing::info!("replica {} at {} joined the group as a learner", r.id, r.address);
        }
        let peers = self.shared.state().replicas.iter().map(|(id, a)| format!("{id}={a}")).collect();
        let (ca_pem, ca_key_pem, token, proof) = self.shared.pki.group_answer(&nonce)?;
        Ok(Response::new(ReplicaJoinResponse { ca_pem, ca_key_pem, token, peers, proof }))
    }
}

/// Parses `1=host:port,2=host:port`.
pub fn parse_peers(s: &str) -> Result<BTreeMap<u64, String>, CoordError> {
    let mut out = BTreeMap::new();
    for p in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = p
            .split_once('=')
            .ok_or_else(|| CoordError::BadRequest(format!("--peers entry `{p}`: expected ID=HOST:PORT")))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| CoordError::BadRequest(format!("--peers entry `{p}`: `{id}` is not a replica id")))?;
        if id == 0 || !addr.contains(':') {
            return Err(CoordError::BadRequest(format!(
                "--peers entry `{p}`: ids start at 1, addresses are host:port"
            )));
        }
        if out.insert(id, addr.trim().to_string()).is_some() {
            return Err(CoordError::BadRequest(format!("--peers names replica {id} twice")));
        }
    }
    Ok(out)
}

/// A new replica joins the group through `via` with the group's replica secret: returns the
/// group's members. Restarting a replica that joined before reads them from its data dir.
pub async fn join_group(
    via: &str,
    id: u64,
    address: &str,
    secret: Option<&str>,
    dir: &Path,
) -> Result<BTreeMap<u64, String>, CoordError> {
    std::fs::create_dir_all(dir).map_err(|e| CoordError::io(dir, e))?;
    let peers_file = dir.join("peers");
    if dir.join("ca.key").exists() && peers_file.exists() {
        let text = std::fs::read_to_string(&peers_file).map_err(|e| CoordError::io(&peers_file, e))?;
        return parse_peers(text.trim());
    }
    let secret = secret.ok_or_else(|| {
        CoordError::BadRequest(format!(
            "joining a group needs its replica secret: --replica-token-file (the {} file of a replica's data dir)",
            crate::pki::REPLICA_SECRET_FILE
        ))
    })?;
    let (channel, seen) = brigade_transport::grpc::join_channel(&format!("https://{via}"))
        .await
        .map_err(|e| CoordError::Unavailable(format!("{via}: {e}")))?;
    let leaf = seen
        .seen_leaf()
        .ok_or_else(|| CoordError::Unavailable(format!("{via}: no certificate in the TLS handshake")))?;
    let nonce = brigade_transport::join::new_nonce();
    let proof = brigade_transport::join::replica_proof(secret, &leaf, &nonce, id);
    let mut client = ReplicaJoinClient::with_interceptor(channel, brigade_proto::VersionInterceptor);
    let resp = client
        .join_replica(ReplicaJoinRequest {
            protocol: brigade_proto::PROTOCOL_VERSION,
            id,
            address: address.to_string(),
            nonce: nonce.to_vec(),
            proof,
        })
        .await
        .map_err(|s| CoordError::PermissionDenied(format!("joining through {via}: {}", s.message())))?
        .into_inner();
    // the group proves it knows the secret too, over what it sent
    let sent = [resp.ca_pem.as_str(), resp.ca_key_pem.as_str(), resp.token.as_str()];
    if brigade_transport::join::verify_group_proof(secret, &leaf, &nonce, &sent, &resp.proof).is_err() {
        return Err(CoordError::PermissionDenied(format!(
            "{via} could not prove it knows the replica secret: not joining (a wrong address, or someone in between)"
        )));
    }
    brigade_transport::ClusterCa::from_pem(&resp.ca_pem, &resp.ca_key_pem)
        .map_err(|e| CoordError::Tls(e.to_string()))?;
    write_secret(&dir.join("ca.key"), resp.ca_key_pem.as_bytes())?;
    let ca_path = dir.join("ca.pem");
    brigade_transport::tls::write_durable(&ca_path, resp.ca_pem.as_bytes(), 0o644)
        .map_err(|e| CoordError::io(&ca_path, e))?;
    write_secret(&dir.join("token"), resp.token.as_bytes())?;
    write_secret(&dir.join(crate::pki::REPLICA_SECRET_FILE), secret.as_bytes())?;
    let peers = resp.peers.join(",");
    brigade_transport::tls::write_durable(&peers_file, peers.as_bytes(), 0o644)
        .map_err(|e| CoordError::io(&peers_file, e))?;
    tracing::info!("joined the coordinator group through {via}: {peers}");
    parse_peers(&peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_and_refuse_nonsense() {
        let p = parse_peers("1=a:1, 2=b:2,3=c:3").unwrap_or_default();
        assert_eq!(p.len(), 3);
        assert_eq!(p.get(&2).map(String::as_str), Some("b:2"));
        for bad in ["1=a", "0=a:1", "x=a:1", "1=a:1,1=b:2", "a:1"] {
            assert!(parse_peers(bad).is_err(), "{bad}");
        }
    }
}
