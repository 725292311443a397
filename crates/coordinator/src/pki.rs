//! The cluster's secrets in the data dir: the CA (certificate and key), the join token, and the
//! coordinator's own certificate — every private file 0600. Created on first start; the token is
//! printed then and never again.

use crate::CoordError;
use brigade_proto::v1::{JoinRequest, JoinResponse};
use brigade_transport::tls::{self, ClusterCa, Role};
use brigade_transport::{join, Identity};
use std::path::Path;

/// The name in the coordinator's certificate (workers let only it drive sessions).
pub const COORDINATOR_CN: &str = "coordinator";

pub struct Pki {
    ca: ClusterCa,
    token: String,
    /// The coordinator's certificate and key: server for workers and clients, client towards
    /// workers' `Stage` services.
    pub identity: Identity,
    /// DER of the coordinator's leaf certificate (the join proofs are bound to it).
    leaf_der: Vec<u8>,
}

/// What `load_or_create` did, for the operator.
pub struct Opened {
    pub pki: Pki,
    /// The token, when it was created now (print it once).
    pub new_token: Option<String>,
}

fn read(p: &Path) -> Result<String, CoordError> {
    std::fs::read_to_string(p).map_err(|e| CoordError::io(p, e))
}

impl Pki {
    /// Opens the secrets in `dir`, creating what is missing. `token` sets the join token (on
    /// first start, or to rotate it); `sans` are extra names or IPs for the coordinator's
    /// certificate (tools that check names: `grpcurl -cacert`).
    ///
    /// `shared`: several replicas, which must all hold the same CA — it is never created here then
    /// (`brigade coordinator init` creates one to copy; a joining replica receives it).
    pub fn load_or_create(
        dir: &Path,
        token: Option<&str>,
        sans: &[String],
        shared: bool,
    ) -> Result<Opened, CoordError> {
        std::fs::create_dir_all(dir).map_err(|e| CoordError::io(dir, e))?;
        let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
        let ca = if ca_pem.exists() && ca_key.exists() {
            ClusterCa::from_pem(&read(&ca_pem)?, &read(&ca_key)?)
                .map_err(|e| CoordError::Corrupt(format!("cluster CA: {e}")))?
        } else if shared {
            return Err(CoordError::FailedPrecondition(format!(
                "{} has no cluster CA: the replicas of a group share one; create it once with `brigade coordinator init --data-dir DIR` and copy ca.pem, ca.key and token into every replica's data dir",
                dir.display()
            )));
        } else {
            let ca = ClusterCa::generate("brigade").map_err(|e| CoordError::Tls(e.to_string()))?;
            write_secret(&ca_key, ca.key_pem().as_bytes())?;
            std::fs::write(&ca_pem, ca.cert_pem()).map_err(|e| CoordError::io(&ca_pem, e))?;
            ca
        };
        let token_path = dir.join("token");
        let mut new_token = None;
        let token = match (token, token_path.exists()) {
            (Some(t), _) => {
                check_token(t)?;
                let old = if token_path.exists() { Some(read(&token_path)?) } else { None };
                if old.as_deref().map(str::trim) != Some(t) {
                    write_secret(&token_path, t.as_bytes())?;
                    if old.is_some() {
                        tracing::warn!("the join token was replaced: nodes that join from now on need the new one");
                    }
                }
                t.to_string()
            }
            (None, true) => read(&token_path)?.trim().to_string(),
            (None, false) => {
                let t = join::new_join_token();
                write_secret(&token_path, t.as_bytes())?;
                new_token = Some(t.clone());
                t
            }
        };
        // the coordinator's own certificate is re-issued on every start: its names may change
        let identity = ca
            .new_identity(COORDINATOR_CN, Role::Coordinator { extra_sans: sans.to_vec() })
            .map_err(|e| CoordError::Tls(e.to_string()))?;
        write_secret(&dir.join("coordinator.key"), identity.key_pem.as_bytes())?;
        let cert_path = dir.join("coordinator.pem");
        std::fs::write(&cert_path, &identity.cert_chain_pem).map_err(|e| CoordError::io(&cert_path, e))?;
        let leaf_der = tls::leaf_der_from_pem(&identity.cert_chain_pem).map_err(|e| CoordError::Tls(e.to_string()))?;
        Ok(Opened { pki: Pki { ca, token, identity, leaf_der }, new_token })
    }

    pub fn ca_pem(&self) -> &str {
        self.ca.cert_pem()
    }

    pub fn ca_key_pem(&self) -> &str {
        self.ca.key_pem()
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    /// The answer's proof to a replica that joins (the same HMAC as a worker's, over the CA key).
    pub fn group_proof(&self, nonce: &join::Nonce, ca_pem: &str, ca_key_pem: &str) -> Vec<u8> {
        join::coordinator_proof(&self.token, &self.leaf_der, nonce, ca_pem, ca_key_pem)
    }

    /// Checks a join proof for `name` (a node, or `replica-<id>` for a coordinator replica).
    pub fn check_proof(&self, name: &str, nonce: &[u8], proof: &[u8]) -> Result<join::Nonce, CoordError> {
        let nonce = join::nonce_from_slice(nonce).map_err(|e| CoordError::BadRequest(e.to_string()))?;
        join::verify_worker_proof(&self.token, &self.leaf_der, &nonce, name, proof)
            .map_err(|_| CoordError::PermissionDenied(format!("`{name}` did not present this cluster's join token")))?;
        Ok(nonce)
    }

    /// Admits a node that proves it knows the token: issues it a certificate for its name.
    pub fn join(&self, req: &JoinRequest) -> Result<(JoinResponse, String), CoordError> {
        brigade_core::cluster::check_node_name(&req.name)?;
        if req.name == COORDINATOR_CN {
            return Err(CoordError::BadRequest(format!("`{}` is the coordinator's own name", req.name)));
        }
        let nonce = self.check_proof(&req.name, &req.nonce, &req.proof)?;
        let cert_pem = self
            .ca
            .issue(&req.csr_pem, &req.name, Role::Node)
            .map_err(|e| CoordError::BadRequest(format!("certificate request of `{}`: {e}", req.name)))?;
        let ca_pem = self.ca.cert_pem().to_string();
        let proof = join::coordinator_proof(&self.token, &self.leaf_der, &nonce, &ca_pem, &cert_pem);
        let der = tls::leaf_der_from_pem(&cert_pem).map_err(|e| CoordError::Tls(e.to_string()))?;
        let fingerprint = tls::fingerprint(&der);
        Ok((JoinResponse { cert_pem, ca_pem, proof }, fingerprint))
    }
}

/// Writes a secret file readable by its owner only (0600 from creation, never wider).
pub fn write_secret(path: &Path, bytes: &[u8]) -> Result<(), CoordError> {
    brigade_transport::tls::write_private(path, bytes).map_err(|e| CoordError::io(path, e))
}

/// A join token must be long enough that guessing it is hopeless.
fn check_token(t: &str) -> Result<(), CoordError> {
    if t.len() < 16 || t.len() > 256 || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(CoordError::BadRequest(format!(
            "a join token needs 16–256 printable characters without spaces (this one has {})",
            t.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_owner_only_and_a_shared_group_never_makes_its_own_ca() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(Pki::load_or_create(dir.path(), None, &[], true), Err(CoordError::FailedPrecondition(_))));
        let first = Pki::load_or_create(dir.path(), None, &[], false).unwrap();
        let token = first.new_token.unwrap();
        for f in ["token", "ca.key", "coordinator.key"] {
            let mode = std::fs::metadata(dir.path().join(f)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{f}");
        }
        // reopened: the same CA and token, nothing printed again
        let again = Pki::load_or_create(dir.path(), None, &[], true).unwrap();
        assert!(again.new_token.is_none());
        assert_eq!(again.pki.ca_pem(), first.pki.ca_pem());
        assert_eq!(again.pki.token(), token);
        assert!(Pki::load_or_create(dir.path(), Some("short"), &[], false).is_err());
    }
}
