//! The `Raft` service between coordinator replicas: raft messages in, and new replicas joining
//! the group (`brigade coordinator --join ADDR`): the joiner proves it knows the join token (the
//! same channel-bound HMAC as a worker's join), the group adds it, and it receives the cluster's
//! secrets — the CA, its key and the token — which only the replicas hold.

use crate::pki::write_secret;
use crate::server::Shared;
use crate::CoordError;
use brigade_proto::v1::raft_client::RaftClient;
use brigade_proto::v1::raft_server::Raft;
use brigade_proto::v1::{RaftAck, RaftEnvelope, ReplicaJoinRequest, ReplicaJoinResponse};
use protobuf::Message as _;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct RaftService {
    pub shared: Arc<Shared>,
}

/// The join name of replica `id` (what its proof is bound to).
fn replica_name(id: u64) -> String {
    format!("replica-{id}")
}

#[tonic::async_trait]
impl Raft for RaftService {
    async fn step(&self, req: Request<RaftEnvelope>) -> Result<Response<RaftAck>, Status> {
        let who = brigade_transport::grpc::peer_node_name(&req);
        if who.as_deref() != Some(crate::pki::COORDINATOR_CN) {
            return Err(Status::permission_denied("raft messages are taken from coordinator replicas only"));
        }
        let env = req.into_inner();
        brigade_proto::check_protocol(env.protocol)?;
        let msg = raft::eraftpb::Message::parse_from_bytes(&env.message)
            .map_err(|e| Status::invalid_argument(format!("not a raft message: {e}")))?;
        if msg.from != env.from || msg.to != self.shared.cfg.id {
            return Err(Status::invalid_argument(format!(
                "a raft message from {} to {} in an envelope from {} (this is replica {})",
                msg.from, msg.to, env.from, self.shared.cfg.id
            )));
        }
        self.shared.raft.step(msg);
        Ok(Response::new(RaftAck {}))
    }

    async fn join_replica(&self, req: Request<ReplicaJoinRequest>) -> Result<Response<ReplicaJoinResponse>, Status> {
        let r = req.into_inner();
        brigade_proto::check_protocol(r.protocol)?;
        if r.id == 0 {
            return Err(Status::invalid_argument("replica id 0 is not an id"));
        }
        if !r.address.contains(':') || r.address.len() > 256 {
            return Err(Status::invalid_argument(format!("`{}` is not host:port", r.address)));
        }
        let nonce = self.shared.pki.check_proof(&replica_name(r.id), &r.nonce, &r.proof)?;
        let state = self.shared.current_state().await?;
        if state.replicas.get(&r.id) != Some(&r.address) {
            if state.replicas.contains_key(&r.id) {
                return Err(Status::already_exists(format!(
                    "replica {} is in the group at {}; remove it first (`brigade coordinator leave`)",
                    r.id, state.replicas[&r.id]
                )));
            }
            self.shared.raft.change_replicas(r.id, Some(r.address.clone())).await?;
            tracing::info!("replica {} at {} joined the group", r.id, r.address);
        }
        let peers = self.shared.state().replicas.iter().map(|(id, a)| format!("{id}={a}")).collect();
        let (ca_pem, ca_key_pem) = (self.shared.pki.ca_pem().to_string(), self.shared.pki.ca_key_pem().to_string());
        let proof = self.shared.pki.group_proof(&nonce, &ca_pem, &ca_key_pem);
        Ok(Response::new(ReplicaJoinResponse {
            ca_pem,
            ca_key_pem,
            token: self.shared.pki.token().to_string(),
            peers,
            proof,
        }))
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

/// A new replica joins the group through `via`: returns the group's members. Restarting a
/// replica that joined before reads them from its data dir.
pub async fn join_group(
    via: &str,
    id: u64,
    address: &str,
    token: Option<&str>,
    dir: &Path,
) -> Result<BTreeMap<u64, String>, CoordError> {
    std::fs::create_dir_all(dir).map_err(|e| CoordError::io(dir, e))?;
    let peers_file = dir.join("peers");
    if dir.join("ca.key").exists() && peers_file.exists() {
        let text = std::fs::read_to_string(&peers_file).map_err(|e| CoordError::io(&peers_file, e))?;
        return parse_peers(text.trim());
    }
    let token = token.ok_or_else(|| CoordError::BadRequest("joining a group needs --join-token".into()))?;
    let (channel, seen) = brigade_transport::grpc::join_channel(&format!("https://{via}"))
        .await
        .map_err(|e| CoordError::Unavailable(format!("{via}: {e}")))?;
    let leaf = seen
        .seen_leaf()
        .ok_or_else(|| CoordError::Unavailable(format!("{via}: no certificate in the TLS handshake")))?;
    let nonce = brigade_transport::join::new_nonce();
    let proof = brigade_transport::join::worker_proof(token, &leaf, &nonce, &replica_name(id));
    let mut client = RaftClient::with_interceptor(channel, brigade_proto::VersionInterceptor);
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
    // the group proves it knows the token too, over what it sent
    if brigade_transport::join::verify_coordinator_proof(
        token,
        &leaf,
        &nonce,
        &resp.ca_pem,
        &resp.ca_key_pem,
        &resp.proof,
    )
    .is_err()
        || resp.token != token
    {
        return Err(CoordError::PermissionDenied(format!(
            "{via} could not prove it knows the join token: not joining (a wrong address, or someone in between)"
        )));
    }
    brigade_transport::ClusterCa::from_pem(&resp.ca_pem, &resp.ca_key_pem)
        .map_err(|e| CoordError::Tls(e.to_string()))?;
    write_secret(&dir.join("ca.key"), resp.ca_key_pem.as_bytes())?;
    let ca_path = dir.join("ca.pem");
    std::fs::write(&ca_path, &resp.ca_pem).map_err(|e| CoordError::io(&ca_path, e))?;
    write_secret(&dir.join("token"), resp.token.as_bytes())?;
    let peers = resp.peers.join(",");
    std::fs::write(&peers_file, &peers).map_err(|e| CoordError::io(&peers_file, e))?;
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
