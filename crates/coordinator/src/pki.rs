//! The cluster's secrets in the data dir: the CA (certificate and key), the workers' join token,
//! the replicas' own secret (`replica-token`: what a new coordinator replica proves to receive
//! the CA key — the join token, which every worker holds, never opens it), and the coordinator's
//! own certificate — every private file 0600, each written durably (fsync of file and
//! directory). Created on first start; the join token is printed then and never again.

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
    /// The group's replica secret; `None` in a group whose data dirs were made before there was
    /// one (joining at run time is refused then, with what to copy).
    replica_secret: Option<String>,
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
    /// Whether the replica secret was created now (its file is named, never its value).
    pub new_replica_secret: bool,
}

/// The file holding the replica secret in a data dir.
pub const REPLICA_SECRET_FILE: &str = "replica-token";

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
        // a bad token changes nothing: checked before any file is written
        if let Some(t) = token {
            check_token(t)?;
        }
        std::fs::create_dir_all(dir).map_err(|e| CoordError::io(dir, e))?;
        let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
        let mut new_replica_secret = false;
        let ca = match (ca_pem.exists(), ca_key.exists()) {
            (true, true) => ClusterCa::from_pem(&read(&ca_pem)?, &read(&ca_key)?)
                .map_err(|e| CoordError::Corrupt(format!("cluster CA: {e}")))?,
            (true, false) | (false, true) => {
                // never a new CA beside half of an old one: the nodes hold certificates of it
                let (has, lacks) = if ca_pem.exists() { ("ca.pem", "ca.key") } else { ("ca.key", "ca.pem") };
                return Err(CoordError::Corrupt(format!(
                    "{} holds {has} but not {lacks}: half a cluster CA. Restore {lacks} from a replica or a backup; only if no node of this cluster remains, delete {has} to start a new cluster",
                    dir.display()
                )));
            }
            (false, false) if shared => {
                return Err(CoordError::FailedPrecondition(format!(
                    "{} has no cluster CA: the replicas of a group share one; create it once with `brigade coordinator init --data-dir DIR` and copy ca.pem, ca.key, token and {REPLICA_SECRET_FILE} into every replica's data dir",
                    dir.display()
                )));
            }
            (false, false) => {
                let ca = ClusterCa::generate("brigade").map_err(|e| CoordError::Tls(e.to_string()))?;
                // the key first: a crash between the two leaves a half pair, which is refused
                write_secret(&ca_key, ca.key_pem().as_bytes())?;
                brigade_transport::tls::write_durable(&ca_pem, ca.cert_pem().as_bytes(), 0o644)
                    .map_err(|e| CoordError::io(&ca_pem, e))?;
                ca
            }
        };
        let secret_path = dir.join(REPLICA_SECRET_FILE);
        let replica_secret = if secret_path.exists() {
            Some(read(&secret_path)?.trim().to_string())
        } else if !shared {
            // a cluster's first replica (or one made before there was a replica secret)
            let s = join::new_join_token();
            write_secret(&secret_path, s.as_bytes())?;
            new_replica_secret = true;
            Some(s)
        } else {
            tracing::warn!(
                "{} has no {REPLICA_SECRET_FILE}: replicas cannot join this group at run time until it is copied from the replica that made the CA",
                dir.display()
            );
            None
        };
        let token_path = dir.join("token");
        let mut new_token = None;
        let token = match (token, token_path.exists()) {
            (Some(t), _) => {
                let old = if token_path.exists() { Some(read(&token_path)?) } else { None };
                if old.as_deref().map(str::trim) != Some(t) {
                    write_secret(&token_path, t.as_bytes())?;
                    if old.is_some() {
                        tracing::warn!("the join token was replaced: nodes that join from now on need the new one");
                    }
                }
                t.to_string()
            }
            (None, true) => {
                let t = read(&token_path)?.trim().to_string();
                if let Err(e) = join::check_token(&t) {
                    tracing::warn!("the join token in {}: {e} (set a new one with --join-token)", token_path.display());
                }
                t
            }
            (None, false) => {
                let t = join::new_join_token();
                write_secret(&token_path, t.as_bytes())?;
                new_token = Some(t.clone());
                t
            }
        };
        if replica_secret.as_deref() == Some(token.as_str()) {
            return Err(CoordError::BadRequest(format!(
                "{REPLICA_SECRET_FILE} equals the join token: the replica secret must be one the workers do not hold"
            )));
        }
        // the coordinator's own certificate is re-issued on every start: its names may change
        let identity = ca
            .new_identity(COORDINATOR_CN, Role::Coordinator { extra_sans: sans.to_vec() })
            .map_err(|e| CoordError::Tls(e.to_string()))?;
        write_secret(&dir.join("coordinator.key"), identity.key_pem.as_bytes())?;
        let cert_path = dir.join("coordinator.pem");
        std::fs::write(&cert_path, &identity.cert_chain_pem).map_err(|e| CoordError::io(&cert_path, e))?;
        let leaf_der = tls::leaf_der_from_pem(&identity.cert_chain_pem).map_err(|e| CoordError::Tls(e.to_string()))?;
        Ok(Opened { pki: Pki { ca, token, replica_secret, identity, leaf_der }, new_token, new_replica_secret })
    }

    pub fn ca_pem(&self) -> &str {
        self.ca.cert_pem()
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    fn replica_secret(&self) -> Result<&str, CoordError> {
        self.replica_secret.as_deref().ok_or_else(|| {
            CoordError::FailedPrecondition(format!(
                "this replica has no {REPLICA_SECRET_FILE} in its data dir, so it admits no new replica; copy it from the replica that made the CA"
            ))
        })
    }

    /// Checks a joining replica's proof: it must know the replica secret (the workers' join
    /// token is not enough). Returns the nonce to answer with.
    pub fn check_replica_proof(&self, id: u64, nonce: &[u8], proof: &[u8]) -> Result<join::Nonce, CoordError> {
        let nonce = join::nonce_from_slice(nonce).map_err(|e| CoordError::BadRequest(e.to_string()))?;
        let secret = self.replica_secret()?;
        join::verify_replica_proof(secret, &self.leaf_der, &nonce, id, proof).map_err(|_| {
            CoordError::PermissionDenied(format!(
                "replica {id} did not present this group's replica secret ({REPLICA_SECRET_FILE}; the workers' join token does not admit replicas)"
            ))
        })?;
        Ok(nonce)
    }

    /// What a replica that proved the replica secret receives: the CA, its key and the join
    /// token, with the group's proof over the three.
    pub fn group_answer(&self, nonce: &join::Nonce) -> Result<(String, String, String, Vec<u8>), CoordError> {
        let secret = self.replica_secret()?;
        let (ca, key, token) = (self.ca.cert_pem(), self.ca.key_pem(), self.token.as_str());
        let proof = join::group_proof(secret, &self.leaf_der, nonce, &[ca, key, token]);
        Ok((ca.to_string(), key.to_string(), token.to_string(), proof))
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

/// A join token given on the command line must be a real one ([`join::check_token`]).
fn check_token(t: &str) -> Result<(), CoordError> {
    join::check_token(t).map_err(|e| CoordError::BadRequest(format!("--join-token: {e}")))
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
        assert!(first.new_replica_secret);
        for f in ["token", "ca.key", "coordinator.key", REPLICA_SECRET_FILE] {
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

    #[test]
    fn only_the_replica_secret_opens_the_ca_key() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), None, &[], false).unwrap().pki;
        let secret = std::fs::read_to_string(dir.path().join(REPLICA_SECRET_FILE)).unwrap();
        assert_ne!(secret, pki.token());
        let nonce = join::new_nonce();
        // what a worker (or anyone holding the join token) can compute
        let with_token = join::replica_proof(pki.token(), &pki.leaf_der, &nonce, 4);
        let as_worker = join::worker_proof(pki.token(), &pki.leaf_der, &nonce, "replica-4");
        for p in [&with_token, &as_worker] {
            assert!(matches!(pki.check_replica_proof(4, &nonce, p), Err(CoordError::PermissionDenied(_))));
        }
        let good = join::replica_proof(&secret, &pki.leaf_der, &nonce, 4);
        assert!(pki.check_replica_proof(5, &nonce, &good).is_err());
        let n = pki.check_replica_proof(4, &nonce, &good).unwrap();
        let (ca, key, token, proof) = pki.group_answer(&n).unwrap();
        assert!(join::verify_group_proof(&secret, &pki.leaf_der, &n, &[&ca, &key, &token], &proof).is_ok());
        // a group whose data dir lacks the secret admits nobody
        let shared = tempfile::tempdir().unwrap();
        for f in ["ca.pem", "ca.key", "token"] {
            std::fs::copy(dir.path().join(f), shared.path().join(f)).unwrap();
        }
        let without = Pki::load_or_create(shared.path(), None, &[], true).unwrap().pki;
        assert!(matches!(without.check_replica_proof(4, &nonce, &good), Err(CoordError::FailedPrecondition(_))));
        // half a CA pair is refused, and no new CA is made beside it
        std::fs::remove_file(shared.path().join("ca.key")).unwrap();
        assert!(matches!(Pki::load_or_create(shared.path(), None, &[], false), Err(CoordError::Corrupt(_))));
        assert!(!shared.path().join("ca.key").exists());
    }
}
