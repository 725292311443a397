//! This node's place in the cluster's PKI: its key, the certificate the coordinator issued it, and
//! the cluster CA — in the data dir, the key readable by its owner only.
//!
//! First start: the worker makes a key and a signing request, proves to the coordinator that it
//! knows the join token (without sending it: an HMAC bound to the TLS certificate the coordinator
//! presented), and checks the coordinator's proof in the answer before it trusts the CA it was
//! sent. Later starts reuse what is on disk; `rejoin` replaces it (the token is needed again).

use crate::WorkerError;
use brigade_proto::v1::control_client::ControlClient;
use brigade_proto::v1::JoinRequest;
use brigade_transport::{join, Identity};
use std::path::{Path, PathBuf};

/// This node's identity and the CA it trusts: what every TLS connection of the node needs.
#[derive(Clone, Debug)]
pub struct Creds {
    pub identity: Identity,
    pub ca_pem: String,
}

pub struct Credentials {
    pub tls: Creds,
    pub dir: PathBuf,
}

fn paths(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    (dir.join("node.key"), dir.join("node.pem"), dir.join("ca.pem"))
}

/// The credentials on disk, if this node joined before.
pub fn load(dir: &Path) -> Result<Option<Credentials>, WorkerError> {
    let (k, c, ca) = paths(dir);
    if !(k.exists() && c.exists() && ca.exists()) {
        return Ok(None);
    }
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| WorkerError::io(p, e));
    let identity = Identity { cert_chain_pem: read(&c)?, key_pem: read(&k)? };
    identity.name().map_err(|e| WorkerError::Tls(format!("{}: {e}", c.display())))?;
    let tls = Creds { identity, ca_pem: read(&ca)? };
    Ok(Some(Credentials { tls, dir: dir.to_path_buf() }))
}

fn write_private(path: &Path, text: &str) -> Result<(), WorkerError> {
    brigade_transport::tls::write_private(path, text.as_bytes()).map_err(|e| WorkerError::io(path, e))
}

/// Joins the cluster at `coordinator` (`host:port`) as `name` with the join token.
pub async fn join(coordinator: &str, name: &str, token: &str, dir: &Path) -> Result<Credentials, WorkerError> {
    std::fs::create_dir_all(dir).map_err(|e| WorkerError::io(dir, e))?;
    let (key_pem, csr_pem) = Identity::generate_csr(name).map_err(|e| WorkerError::Tls(e.to_string()))?;
    // the channel connects (and shakes hands) before it is returned: the verifier has seen the
    // coordinator's certificate, which the proof is bound to
    let (channel, seen) = brigade_transport::grpc::join_channel(&format!("https://{coordinator}"))
        .await
        .map_err(|e| WorkerError::Control(format!("{coordinator}: {e}")))?;
    let leaf = seen
        .seen_leaf()
        .ok_or_else(|| WorkerError::Control(format!("{coordinator}: the TLS handshake showed no certificate")))?;
    let mut client = ControlClient::with_interceptor(channel, brigade_proto::VersionInterceptor);
    let nonce = join::new_nonce();
    let proof = join::worker_proof(token, &leaf, &nonce, name);
    let req = JoinRequest {
        protocol: brigade_proto::PROTOCOL_VERSION,
        name: name.to_string(),
        nonce: nonce.to_vec(),
        proof,
        csr_pem,
    };
    let resp = client.join(req).await.map_err(|s| WorkerError::Join(s.message().to_string()))?.into_inner();
    if join::verify_coordinator_proof(token, &leaf, &nonce, &resp.ca_pem, &resp.cert_pem, &resp.proof).is_err() {
        return Err(WorkerError::Join(
            "the coordinator could not prove it knows the join token: not joining (a wrong address, or someone in between)".into(),
        ));
    }
    let (k, c, ca) = paths(dir);
    write_private(&k, &key_pem)?;
    std::fs::write(&c, &resp.cert_pem).map_err(|e| WorkerError::io(&c, e))?;
    std::fs::write(&ca, &resp.ca_pem).map_err(|e| WorkerError::io(&ca, e))?;
    let tls = Creds { identity: Identity { cert_chain_pem: resp.cert_pem, key_pem }, ca_pem: resp.ca_pem };
    tracing::info!("joined the cluster at {coordinator} as {name}");
    Ok(Credentials { tls, dir: dir.to_path_buf() })
}
