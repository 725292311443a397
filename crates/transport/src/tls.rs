//! The cluster's PKI: a CA on the coordinator issues every node's certificate from a CSR, and
//! links use mutual TLS where both ends hold CA-issued certificates.
//!
//! Names: a node's certificate has CN = its node name and the DNS SAN `<name>.node.brigade`;
//! the coordinator's has `coordinator.brigade` plus the hostnames and IPs it is reached at. Every
//! certificate is good for server and client authentication. The crypto provider is ring, the
//! only one compiled in; configs name it explicitly, and [`install_default_provider`] makes it
//! the process default for libraries (tonic's server) that ask rustls for the default.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use time::OffsetDateTime;
use x509_parser::extensions::GeneralName;

use crate::error::{Result, TransportError};

/// Nodes are `<name>.node.brigade` in their certificates.
pub const NODE_DOMAIN: &str = "node.brigade";
/// The coordinator's DNS name in its certificate.
pub const COORDINATOR_NAME: &str = "coordinator.brigade";

/// Certificates (the CA's and the nodes') are valid for about ten years. A cluster has no
/// rotation machinery yet and an expiry in the middle of a deployment would stop it; the CA key
/// never leaves the coordinator, and a node is shut out by the coordinator forgetting it (it can
/// no longer register), not by its certificate expiring.
const VALIDITY: Duration = Duration::from_secs(3653 * 24 * 3600);
/// Certificates start an hour in the past so that a peer whose clock is a little behind accepts
/// them at once.
const BACKDATE: Duration = Duration::from_secs(3600);

/// Who a certificate is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// A worker node: DNS SAN `<name>.node.brigade`.
    Node,
    /// The coordinator: DNS SAN `coordinator.brigade` plus `extra_sans`, the hostnames and IP
    /// addresses clients and workers reach it at.
    Coordinator { extra_sans: Vec<String> },
}

/// ring, brigade's one rustls crypto provider.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring the process-wide default provider (for libraries that build their own rustls
/// configs, like tonic's server). Harmless when a default is already installed.
pub fn install_default_provider() {
    // Err only means a default is already installed, which is what we want
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Checks that `name` can be a DNS label, as it becomes `<name>.node.brigade` (the cluster
/// state's rule for node names, [`brigade_core::cluster::check_node_name`]).
pub fn validate_node_name(name: &str) -> Result<()> {
    brigade_core::cluster::check_node_name(name).map_err(|_| TransportError::BadNodeName { name: name.to_owned() })
}

/// Writes a file readable by its owner only (0600 from creation, never wider), durably
/// (temporary file, fsync, rename, fsync of the directory): private keys and tokens.
pub fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    write_durable(path, bytes, 0o600)
}

/// Writes a file atomically and durably with `mode`: a temporary file beside it, fsynced,
/// renamed over `path`, and the directory fsynced, so that after a crash the file is either
/// the old one or the whole new one, and the rename itself survives.
pub fn write_durable(path: &std::path::Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// The DNS name a node's certificate carries: `<name>.node.brigade`.
pub fn node_dns_name(name: &str) -> String {
    format!("{name}.{NODE_DOMAIN}")
}

/// The cluster's certificate authority (held by the coordinator).
pub struct ClusterCa {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for ClusterCa {
    // the key stays out of logs
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// A new CA with a fresh P-256 key, CN `brigade cluster <cluster_name>`.
    pub fn generate(cluster_name: &str) -> Result<Self> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, format!("brigade cluster {cluster_name}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        set_validity(&mut params);
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key)?;
        Ok(Self { cert_pem: cert.pem(), key_pem: key.serialize_pem(), issuer: Issuer::new(params, key) })
    }

    /// The CA as stored: its certificate and its key, both PEM. The key must match the
    /// certificate.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(key_pem)?;
        let der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| TransportError::Pem { what: "cluster CA certificate", reason: e.to_string() })?;
        let (_, cert) = x509_parser::parse_x509_certificate(&der)
            .map_err(|e| TransportError::Pem { what: "cluster CA certificate", reason: e.to_string() })?;
        if cert.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(TransportError::CaKeyMismatch);
        }
        let issuer = Issuer::from_ca_cert_der(&der, key)?;
        Ok(Self { cert_pem: cert_pem.to_owned(), key_pem: key_pem.to_owned(), issuer })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Issues a certificate (PEM) for the key of a CSR. The CSR's signature must verify and its
    /// CN must be `node_name`; the names, usages and validity come from here, never from the CSR
    /// (a CSR asking for another subject alternative name is refused).
    pub fn issue(&self, csr_pem: &str, node_name: &str, role: Role) -> Result<String> {
        validate_node_name(node_name)?;
        let csr = CertificateSigningRequestParams::from_pem(csr_pem)?;
        let cn = common_name(&csr.params.distinguished_name);
        if cn.as_deref() != Some(node_name) {
            return Err(TransportError::CsrNameMismatch {
                csr: cn.unwrap_or_default(),
                expected: node_name.to_owned(),
            });
        }
        let sans = sans_for(node_name, &role)?;
        if let Some(extra) = csr.params.subject_alt_names.iter().find(|san| !sans.contains(san)) {
            return Err(TransportError::CsrSanRefused { name: node_name.to_owned(), san: format!("{extra:?}") });
        }
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, node_name);
        params.subject_alt_names = sans;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params);
        params.serial_number = Some(random_serial());
        Ok(params.signed_by(&csr.public_key, &self.issuer)?.pem())
    }

    /// A key and a certificate for `node_name` in one step (the coordinator's own identity,
    /// tests); the chain is the leaf alone, as peers hold the CA.
    pub fn new_identity(&self, node_name: &str, role: Role) -> Result<Identity> {
        let (key_pem, csr_pem) = Identity::generate_csr(node_name)?;
        let cert_chain_pem = self.issue(&csr_pem, node_name, role)?;
        Ok(Identity { cert_chain_pem, key_pem })
    }
}

fn set_validity(params: &mut CertificateParams) {
    let now = OffsetDateTime::now_utc();
    params.not_before = now - BACKDATE;
    params.not_after = now + VALIDITY;
}

fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    // a positive DER integer without a leading zero byte
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    SerialNumber::from_slice(&bytes)
}

fn common_name(dn: &DistinguishedName) -> Option<String> {
    match dn.get(&DnType::CommonName)? {
        DnValue::Utf8String(s) => Some(s.clone()),
        DnValue::PrintableString(s) => Some(s.as_str().to_owned()),
        DnValue::Ia5String(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn sans_for(node_name: &str, role: &Role) -> Result<Vec<SanType>> {
    let dns = |name: String| name.clone().try_into().map(SanType::DnsName).map_err(|_| TransportError::BadSan(name));
    match role {
        Role::Node => Ok(vec![dns(node_dns_name(node_name))?]),
        Role::Coordinator { extra_sans } => {
            let mut sans = vec![dns(COORDINATOR_NAME.to_owned())?];
            for extra in extra_sans {
                sans.push(match extra.parse::<IpAddr>() {
                    Ok(ip) => SanType::IpAddress(ip),
                    Err(_) => dns(extra.clone())?,
                });
            }
            Ok(sans)
        }
    }
}

/// A node's TLS identity: its certificate chain (leaf first) and its private key, both PEM.
#[derive(Clone)]
pub struct Identity {
    pub cert_chain_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Identity {
    // the key stays out of logs
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").field("name", &self.name().ok()).finish_non_exhaustive()
    }
}

impl Identity {
    /// A fresh P-256 key and a CSR for it with CN = `name` (the CA decides the rest):
    /// `(key_pem, csr_pem)`.
    pub fn generate_csr(name: &str) -> Result<(String, String)> {
        validate_node_name(name)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        let csr = params.serialize_request(&key)?;
        Ok((key.serialize_pem(), csr.pem()?))
    }

    /// The node name the leaf certificate is for.
    pub fn name(&self) -> Result<String> {
        let chain = self.cert_chain()?;
        chain.first().and_then(|leaf| peer_name_from_cert(leaf)).ok_or(TransportError::NoPeerName)
    }

    /// The certificate chain as DER, leaf first.
    pub fn cert_chain(&self) -> Result<Vec<CertificateDer<'static>>> {
        certs_from_pem(&self.cert_chain_pem, "certificate chain")
    }

    /// The private key as DER.
    pub fn private_key(&self) -> Result<PrivateKeyDer<'static>> {
        PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|e| TransportError::Pem { what: "private key", reason: e.to_string() })
    }
}

pub(crate) fn certs_from_pem(pem: &str, what: &'static str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TransportError::Pem { what, reason: e.to_string() })?;
    if certs.is_empty() {
        return Err(TransportError::Pem { what, reason: "no certificate in the PEM".to_owned() });
    }
    Ok(certs)
}

/// The first certificate of a PEM chain, as DER.
pub fn leaf_der_from_pem(pem: &str) -> Result<Vec<u8>> {
    Ok(certs_from_pem(pem, "certificate")?.swap_remove(0).to_vec())
}

/// The sha256 of a certificate's DER, lower-case hex: how the coordinator remembers which
/// certificate speaks for a node.
pub fn fingerprint(der: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(der).iter().map(|b| format!("{b:02x}")).collect()
}

/// The node a certificate is for: the `<name>` of a `<name>.node.brigade` DNS SAN, else the CN.
/// `None` when the DER does not parse or names nothing.
pub fn peer_name_from_cert(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::DNSName(dns) = name {
                let node = dns.strip_suffix(NODE_DOMAIN).and_then(|rest| rest.strip_suffix('.'));
                if let Some(node) = node.filter(|n| validate_node_name(n).is_ok()) {
                    return Some(node.to_owned());
                }
            }
        }
    }
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

fn ca_roots(ca_pem: &str) -> Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    for cert in certs_from_pem(ca_pem, "cluster CA certificate")? {
        roots.add(cert)?;
    }
    Ok(Arc::new(roots))
}

/// A rustls server config (TLS 1.3) presenting `identity` and requiring a client certificate
/// that chains to the cluster CA. No ALPN is set; the carrier sets its own.
pub fn server_config(identity: &Identity, ca_pem: &str) -> Result<rustls::ServerConfig> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(ca_roots(ca_pem)?, provider.clone()).build()?;
    Ok(rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.cert_chain()?, identity.private_key()?)?)
}

/// A rustls client config (TLS 1.3) that trusts only the cluster CA (no public roots) and
/// presents `identity` as its client certificate. The server name it verifies is the one given
/// at connect time (`<peer>.node.brigade`).
pub fn client_config(identity: &Identity, ca_pem: &str) -> Result<rustls::ClientConfig> {
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(ca_roots(ca_pem)?)
        .with_client_auth_cert(identity.cert_chain()?, identity.private_key()?)?)
}
