//! The join handshake (control.proto's `Join`): a worker that knows the join token proves it
//! without sending it, bound to the TLS certificate it saw, and the coordinator proves it back.
//!
//! - worker: `proof = HMAC-SHA256(token, "brigade-join-worker" | sha256(coordinator leaf DER) | nonce | name)`
//! - coordinator: `proof = HMAC-SHA256(token, "brigade-join-coordinator" | sha256(leaf DER) | nonce | sha256(ca_pem) | sha256(cert_pem))`
//!
//! `|` is concatenation; the key is the token's text (with its `brg1-` prefix). The nonce has a
//! fixed length ([`NONCE_LEN`]) so that the concatenation is unambiguous. The join connection
//! cannot verify the coordinator against a CA the worker does not have yet, so
//! [`JoinVerifier`] accepts any certificate, verifies the handshake signature (the server holds
//! that certificate's key) and records the leaf: a relay in the middle presents another leaf,
//! and the coordinator refuses a proof bound to it.

use std::sync::{Arc, Mutex};

use data_encoding::BASE32_NOPAD;
use hmac::{Hmac, KeyInit, Mac};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::error::{Result, TransportError};
use crate::tls::provider;

/// Bytes of a join nonce.
pub const NONCE_LEN: usize = 32;
/// A join nonce: fresh random bytes per join attempt.
pub type Nonce = [u8; NONCE_LEN];
/// Prefix of join tokens (the format's version).
pub const TOKEN_PREFIX: &str = "brg1-";

type HmacSha256 = Hmac<Sha256>;

/// A new join token: 32 random bytes, printable as `brg1-` + lower-case base32.
pub fn new_join_token() -> String {
    let bytes: [u8; 32] = rand::random();
    format!("{TOKEN_PREFIX}{}", BASE32_NOPAD.encode(&bytes).to_ascii_lowercase())
}

/// A fresh nonce for one join attempt.
pub fn new_nonce() -> Nonce {
    rand::random()
}

/// Reads a nonce from the wire, refusing any other length.
pub fn nonce_from_slice(bytes: &[u8]) -> Result<Nonce> {
    bytes.try_into().map_err(|_| TransportError::BadNonce { len: bytes.len(), expected: NONCE_LEN })
}

fn mac(token: &str, label: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; this cannot fail
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(token.as_bytes())
        .unwrap_or_else(|_| unreachable!("hmac accepts keys of every length"));
    mac.update(label);
    mac
}

fn worker_mac(token: &str, coordinator_leaf_der: &[u8], nonce: &Nonce, name: &str) -> HmacSha256 {
    let mut mac = mac(token, b"brigade-join-worker");
    mac.update(&Sha256::digest(coordinator_leaf_der));
    mac.update(nonce);
    mac.update(name.as_bytes());
    mac
}

fn coordinator_mac(token: &str, leaf_der: &[u8], nonce: &Nonce, ca_pem: &str, cert_pem: &str) -> HmacSha256 {
    let mut mac = mac(token, b"brigade-join-coordinator");
    mac.update(&Sha256::digest(leaf_der));
    mac.update(nonce);
    mac.update(&Sha256::digest(ca_pem.as_bytes()));
    mac.update(&Sha256::digest(cert_pem.as_bytes()));
    mac
}

/// The worker's proof that it knows `token`, bound to the coordinator certificate it saw.
pub fn worker_proof(token: &str, coordinator_leaf_der: &[u8], nonce: &Nonce, name: &str) -> Vec<u8> {
    worker_mac(token, coordinator_leaf_der, nonce, name).finalize().into_bytes().to_vec()
}

/// Checks a worker's proof in constant time, against the coordinator's own leaf certificate.
pub fn verify_worker_proof(
    token: &str,
    coordinator_leaf_der: &[u8],
    nonce: &Nonce,
    name: &str,
    proof: &[u8],
) -> Result<()> {
    worker_mac(token, coordinator_leaf_der, nonce, name).verify_slice(proof).map_err(|_| TransportError::BadProof)
}

/// The coordinator's proof that it knows `token` too, over the CA and the certificate it issued.
pub fn coordinator_proof(token: &str, leaf_der: &[u8], nonce: &Nonce, ca_pem: &str, cert_pem: &str) -> Vec<u8> {
    coordinator_mac(token, leaf_der, nonce, ca_pem, cert_pem).finalize().into_bytes().to_vec()
}

/// Checks the coordinator's proof in constant time (the worker, with the leaf it recorded).
pub fn verify_coordinator_proof(
    token: &str,
    leaf_der: &[u8],
    nonce: &Nonce,
    ca_pem: &str,
    cert_pem: &str,
    proof: &[u8],
) -> Result<()> {
    coordinator_mac(token, leaf_der, nonce, ca_pem, cert_pem).verify_slice(proof).map_err(|_| TransportError::BadProof)
}

/// Why a token (join token or replica secret) is refused: it must be `brg1-` and at least 128
/// bits of random-looking lower-case base32 or hex, not a placeholder someone forgot to replace.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("a token starts with `{TOKEN_PREFIX}` (this one starts with `{0}`); `brigade coordinator init` makes one, or use `brg1-$(openssl rand -hex 24)`")]
    Prefix(String),
    #[error("a token is `{TOKEN_PREFIX}` and lower-case letters and digits only (found {0:?})")]
    Charset(char),
    #[error(
        "a token holds at least {min} bits after `{TOKEN_PREFIX}`; this one holds about {bits} ({len} characters)"
    )]
    Short { bits: usize, min: usize, len: usize },
    #[error("this token looks like a placeholder ({0}): replace it with a random one")]
    Placeholder(&'static str),
}

/// Bits a token must carry at least (by its length and alphabet).
pub const TOKEN_MIN_BITS: usize = 128;

/// Checks a token's form and (roughly) its entropy: `brg1-` then lower-case hex (4 bits a
/// character) or base32 (5 bits), at least [`TOKEN_MIN_BITS`], at most 256 characters, with
/// enough distinct characters that it is not a pattern, and none of the words templates use.
pub fn check_token(t: &str) -> std::result::Result<(), TokenError> {
    let Some(body) = t.strip_prefix(TOKEN_PREFIX) else {
        let shown: String = t.chars().take(TOKEN_PREFIX.len()).collect();
        return Err(TokenError::Prefix(shown));
    };
    let lower = t.to_ascii_lowercase();
    for word in ["replace", "placeholder", "example", "change", "secret", "token", "xxxx"] {
        if lower.contains(word) {
            return Err(TokenError::Placeholder(word));
        }
    }
    if let Some(c) = body.chars().find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit())) {
        return Err(TokenError::Charset(c));
    }
    let hex = body.chars().all(|c| c.is_ascii_hexdigit());
    let bits = body.len() * if hex { 4 } else { 5 };
    if bits < TOKEN_MIN_BITS || t.len() > 256 {
        return Err(TokenError::Short { bits, min: TOKEN_MIN_BITS, len: body.len() });
    }
    let distinct = body.chars().collect::<std::collections::BTreeSet<_>>().len();
    if distinct < 10 {
        return Err(TokenError::Placeholder("fewer than 10 distinct characters"));
    }
    Ok(())
}

fn replica_mac(secret: &str, leader_leaf_der: &[u8], nonce: &Nonce, id: u64) -> HmacSha256 {
    let mut mac = mac(secret, b"brigade-join-replica");
    mac.update(&Sha256::digest(leader_leaf_der));
    mac.update(nonce);
    mac.update(&id.to_be_bytes());
    mac
}

fn group_mac(secret: &str, leaf_der: &[u8], nonce: &Nonce, secrets: &[&str]) -> HmacSha256 {
    let mut mac = mac(secret, b"brigade-join-group");
    mac.update(&Sha256::digest(leaf_der));
    mac.update(nonce);
    for s in secrets {
        mac.update(&Sha256::digest(s.as_bytes()));
    }
    mac
}

/// A new coordinator replica's proof that it knows the group's replica secret (not the workers'
/// join token: the answer holds the CA key), bound to the replica's certificate it saw.
pub fn replica_proof(secret: &str, leader_leaf_der: &[u8], nonce: &Nonce, id: u64) -> Vec<u8> {
    replica_mac(secret, leader_leaf_der, nonce, id).finalize().into_bytes().to_vec()
}

/// Checks a joining replica's proof in constant time.
pub fn verify_replica_proof(secret: &str, leader_leaf_der: &[u8], nonce: &Nonce, id: u64, proof: &[u8]) -> Result<()> {
    replica_mac(secret, leader_leaf_der, nonce, id).verify_slice(proof).map_err(|_| TransportError::BadProof)
}

/// The group's proof back, over every secret it sends (`secrets`, in a fixed order).
pub fn group_proof(secret: &str, leaf_der: &[u8], nonce: &Nonce, secrets: &[&str]) -> Vec<u8> {
    group_mac(secret, leaf_der, nonce, secrets).finalize().into_bytes().to_vec()
}

/// Checks the group's proof (the joiner, with the leaf it recorded).
pub fn verify_group_proof(secret: &str, leaf_der: &[u8], nonce: &Nonce, secrets: &[&str], proof: &[u8]) -> Result<()> {
    group_mac(secret, leaf_der, nonce, secrets).verify_slice(proof).map_err(|_| TransportError::BadProof)
}

/// The server certificate verifier of the join connection: any certificate is accepted, the
/// handshake signatures are verified with it, and the leaf is recorded for [`worker_proof`].
#[derive(Debug)]
pub struct JoinVerifier {
    provider: Arc<CryptoProvider>,
    seen: Mutex<Option<CertificateDer<'static>>>,
}

impl JoinVerifier {
    pub fn new() -> Arc<Self> {
        Arc::new(Self { provider: provider(), seen: Mutex::new(None) })
    }

    /// The DER of the last server leaf certificate this verifier saw.
    pub fn seen_leaf(&self) -> Option<Vec<u8>> {
        let seen = self.seen.lock().ok()?;
        seen.as_ref().map(|der| der.to_vec())
    }
}

impl ServerCertVerifier for JoinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // Trust comes from the token proofs, not from the chain: record what was presented.
        if let Ok(mut seen) = self.seen.lock() {
            *seen = Some(end_entity.clone().into_owned());
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// A rustls client config for the join connection: no client certificate (the worker has none
/// yet), the server verified by `verifier`. Set ALPN (`h2` for gRPC) as the carrier needs.
pub fn join_client_config(verifier: Arc<JoinVerifier>) -> Result<rustls::ClientConfig> {
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_need_the_prefix_and_entropy_and_placeholders_are_refused() {
        assert_eq!(check_token(&new_join_token()), Ok(()));
        assert_eq!(check_token("brg1-9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822c"), Ok(()));
        // the k8s template's value, as shipped
        assert_eq!(
            check_token("REPLACE-with-brg1-and-48-random-hex-characters"),
            Err(TokenError::Prefix("REPLA".into()))
        );
        assert_eq!(check_token("brg1-replacewithrandomhex0123456789abcdef"), Err(TokenError::Placeholder("replace")));
        assert!(matches!(check_token("brg1-0123456789abcdef"), Err(TokenError::Short { bits: 64, .. })));
        assert!(matches!(
            check_token("brg1-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
            Err(TokenError::Placeholder(_))
        ));
        assert_eq!(check_token("brg1-0123456789ABCDEF0123456789abcdef"), Err(TokenError::Charset('A')));
        assert!(matches!(
            check_token(&format!("brg1-{}", "0123456789abcdef".repeat(16))),
            Err(TokenError::Short { .. })
        ));
        assert!(matches!(check_token("sixteen-chars-ok-before"), Err(TokenError::Prefix(_))));
    }

    #[test]
    fn a_replica_proof_needs_the_replica_secret_and_binds_the_id() {
        let (secret, token) = (new_join_token(), new_join_token());
        let leaf = b"leader leaf";
        let nonce = new_nonce();
        let p = replica_proof(&secret, leaf, &nonce, 4);
        assert!(verify_replica_proof(&secret, leaf, &nonce, 4, &p).is_ok());
        assert!(verify_replica_proof(&secret, leaf, &nonce, 5, &p).is_err());
        assert!(verify_replica_proof(&secret, b"another leaf", &nonce, 4, &p).is_err());
        // the workers' token proves nothing here, under either label
        assert!(verify_replica_proof(&token, leaf, &nonce, 4, &replica_proof(&token, leaf, &nonce, 4)).is_ok());
        assert!(verify_replica_proof(&secret, leaf, &nonce, 4, &replica_proof(&token, leaf, &nonce, 4)).is_err());
        assert!(
            verify_replica_proof(&secret, leaf, &nonce, 4, &worker_proof(&secret, leaf, &nonce, "replica-4")).is_err()
        );
        let g = group_proof(&secret, leaf, &nonce, &["ca", "key", &token]);
        assert!(verify_group_proof(&secret, leaf, &nonce, &["ca", "key", &token], &g).is_ok());
        assert!(verify_group_proof(&secret, leaf, &nonce, &["ca", "other key", &token], &g).is_err());
    }
}
