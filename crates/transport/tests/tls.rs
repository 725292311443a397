//! The cluster PKI: issuing, names, mutual TLS between CA-issued certificates (in memory, no
//! sockets), and the join proofs.

mod common;

use std::sync::Arc;

use brigade_transport::join::{
    coordinator_proof, join_client_config, new_join_token, new_nonce, nonce_from_slice, verify_coordinator_proof,
    verify_worker_proof, worker_proof, JoinVerifier, NONCE_LEN,
};
use brigade_transport::tls::{client_config, peer_name_from_cert, provider, server_config};
use brigade_transport::{ClusterCa, Identity, Role, TransportError};
use common::Cluster;
use rustls::pki_types::ServerName;
use rustls::{ClientConnection, ServerConnection};

/// Runs a TLS handshake between two configs over memory buffers.
fn handshake(client: rustls::ClientConfig, server: rustls::ServerConfig, server_name: &str) -> Result<(), String> {
    let name = ServerName::try_from(server_name.to_owned()).map_err(|e| e.to_string())?;
    let mut c = ClientConnection::new(Arc::new(client), name).map_err(|e| e.to_string())?;
    let mut s = ServerConnection::new(Arc::new(server)).map_err(|e| e.to_string())?;
    for _ in 0..10 {
        let mut buf = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut buf).map_err(|e| e.to_string())?;
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            s.read_tls(&mut rd).map_err(|e| e.to_string())?;
            s.process_new_packets().map_err(|e| format!("server: {e}"))?;
        }
        let mut buf = Vec::new();
        while s.wants_write() {
            s.write_tls(&mut buf).map_err(|e| e.to_string())?;
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            c.read_tls(&mut rd).map_err(|e| e.to_string())?;
            c.process_new_packets().map_err(|e| format!("client: {e}"))?;
        }
        if !c.is_handshaking() && !s.is_handshaking() && !c.wants_write() {
            return Ok(());
        }
    }
    Err("handshake did not finish".to_owned())
}

fn configs(
    client: &Identity,
    client_ca: &str,
    server: &Identity,
    server_ca: &str,
) -> (rustls::ClientConfig, rustls::ServerConfig) {
    let c = client_config(client, client_ca);
    let s = server_config(server, server_ca);
    match (c, s) {
        (Ok(c), Ok(s)) => (c, s),
        (c, s) => panic!("configs: {:?} {:?}", c.err(), s.err()),
    }
}

fn leaf_der(identity: &Identity) -> Vec<u8> {
    match identity.cert_chain() {
        Ok(chain) if !chain.is_empty() => chain[0].to_vec(),
        other => panic!("chain: {other:?}"),
    }
}

#[test]
fn issued_certificates_name_their_node() {
    let cluster = Cluster::new("test");
    let alpha = cluster.node("alpha");
    assert_eq!(alpha.name().ok().as_deref(), Some("alpha"));
    assert_eq!(peer_name_from_cert(&leaf_der(&alpha)).as_deref(), Some("alpha"));
    let coordinator = cluster.ca.new_identity(
        "coordinator",
        Role::Coordinator { extra_sans: vec!["10.1.2.3".to_owned(), "brigade.example.org".to_owned()] },
    );
    let coordinator = coordinator.map(|c| c.name().ok());
    assert_eq!(coordinator.ok().flatten().as_deref(), Some("coordinator"));
    assert_eq!(peer_name_from_cert(b"not a certificate"), None);
}

#[test]
fn a_csr_for_another_name_is_refused() {
    let cluster = Cluster::new("test");
    let Ok((_key, csr)) = Identity::generate_csr("alpha") else {
        panic!("csr");
    };
    let refused = cluster.ca.issue(&csr, "beta", Role::Node);
    assert!(
        matches!(refused, Err(TransportError::CsrNameMismatch { ref csr, ref expected }) if csr == "alpha" && expected == "beta"),
        "{refused:?}"
    );
    assert!(cluster.ca.issue(&csr, "alpha", Role::Node).is_ok());
    assert!(cluster.ca.issue("garbage", "alpha", Role::Node).is_err());
    assert!(matches!(Identity::generate_csr("Not.A-Label"), Err(TransportError::BadNodeName { .. })));
}

#[test]
fn a_ca_reloaded_from_pem_issues_certificates_that_chain() {
    let cluster = Cluster::new("test");
    let Ok(reloaded) = ClusterCa::from_pem(cluster.ca.cert_pem(), cluster.ca.key_pem()) else {
        panic!("reload");
    };
    let Ok(beta) = reloaded.new_identity("beta", Role::Node) else {
        panic!("issue");
    };
    let alpha = cluster.node("alpha");
    let (c, s) = configs(&alpha, cluster.ca_pem(), &beta, cluster.ca_pem());
    assert_eq!(handshake(c, s, "beta.node.brigade"), Ok(()));

    let other = Cluster::new("other");
    assert!(matches!(
        ClusterCa::from_pem(cluster.ca.cert_pem(), other.ca.key_pem()),
        Err(TransportError::CaKeyMismatch)
    ));
}

#[test]
fn mutual_tls_refuses_a_certificate_of_another_ca_both_ways() {
    let ours = Cluster::new("ours");
    let theirs = Cluster::new("theirs");
    let alpha = ours.node("alpha");
    let beta = ours.node("beta");
    let intruder = theirs.node("beta");

    // a client of another CA, though it trusts our CA, is refused by our server
    let (c, s) = configs(&intruder, ours.ca_pem(), &beta, ours.ca_pem());
    let refused = handshake(c, s, "beta.node.brigade");
    assert!(refused.as_ref().is_err_and(|e| e.starts_with("server:")), "{refused:?}");

    // our client refuses a server of another CA
    let (c, s) = configs(&alpha, ours.ca_pem(), &intruder, theirs.ca_pem());
    let refused = handshake(c, s, "beta.node.brigade");
    assert!(refused.as_ref().is_err_and(|e| e.starts_with("client:")), "{refused:?}");

    // and a server of our CA that is not the node asked for
    let (c, s) = configs(&alpha, ours.ca_pem(), &beta, ours.ca_pem());
    let refused = handshake(c, s, "gamma.node.brigade");
    assert!(refused.as_ref().is_err_and(|e| e.starts_with("client:")), "{refused:?}");
}

#[test]
fn join_proofs_bind_token_certificate_nonce_and_name() {
    let token = new_join_token();
    assert!(token.starts_with("brg1-") && token.len() == 5 + 52, "{token}");
    assert_ne!(token, new_join_token());
    let leaf = b"coordinator leaf".to_vec();
    let nonce = new_nonce();
    let proof = worker_proof(&token, &leaf, &nonce, "alpha");
    assert_eq!(proof.len(), 32);
    assert!(verify_worker_proof(&token, &leaf, &nonce, "alpha", &proof).is_ok());
    let other_token = new_join_token();
    assert!(verify_worker_proof(&other_token, &leaf, &nonce, "alpha", &proof).is_err());
    assert!(verify_worker_proof(&token, b"relay leaf", &nonce, "alpha", &proof).is_err());
    assert!(verify_worker_proof(&token, &leaf, &new_nonce(), "alpha", &proof).is_err());
    assert!(verify_worker_proof(&token, &leaf, &nonce, "beta", &proof).is_err());
    assert!(verify_worker_proof(&token, &leaf, &nonce, "alpha", &proof[..31]).is_err());

    let back = coordinator_proof(&token, &leaf, &nonce, "ca pem", "cert pem");
    assert!(verify_coordinator_proof(&token, &leaf, &nonce, "ca pem", "cert pem", &back).is_ok());
    assert!(verify_coordinator_proof(&token, &leaf, &nonce, "other ca", "cert pem", &back).is_err());
    assert_ne!(back, proof);

    assert!(nonce_from_slice(&[0; NONCE_LEN]).is_ok());
    assert!(matches!(nonce_from_slice(&[0; 31]), Err(TransportError::BadNonce { len: 31, expected: 32 })));
}

#[test]
fn the_join_verifier_accepts_any_server_and_records_its_leaf() {
    let stranger = Cluster::new("stranger");
    let coordinator = stranger.node("coordinator");
    let Ok(server) = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map(|b| b.with_no_client_auth())
        .and_then(|b| {
            let key = coordinator.private_key().map_err(|e| rustls::Error::General(e.to_string()))?;
            let chain = coordinator.cert_chain().map_err(|e| rustls::Error::General(e.to_string()))?;
            b.with_single_cert(chain, key)
        })
    else {
        panic!("server config");
    };
    let verifier = JoinVerifier::new();
    let Ok(client) = join_client_config(verifier.clone()) else {
        panic!("join config");
    };
    assert_eq!(verifier.seen_leaf(), None);
    assert_eq!(handshake(client, server, "coordinator.brigade"), Ok(()));
    assert_eq!(verifier.seen_leaf(), Some(leaf_der(&coordinator)));
}
