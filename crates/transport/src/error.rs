use crate::frame::FrameError;

/// Errors of brigade's transport: PKI, the join handshake, links and their carriers.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("node name `{name}` is not a DNS label (1 to 63 of a-z, 0-9 and `-`, not starting or ending with `-`)")]
    BadNodeName { name: String },
    #[error("{what}: {reason}")]
    Pem { what: &'static str, reason: String },
    #[error("certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("the cluster CA key does not match its certificate")]
    CaKeyMismatch,
    #[error("certificate request names `{csr}`, expected `{expected}`")]
    CsrNameMismatch { csr: String, expected: String },
    #[error("certificate request for `{name}` asks for subject alternative name {san}, which is not issued to it")]
    CsrSanRefused { name: String, san: String },
    #[error("bad extra subject alternative name `{0}` for the coordinator")]
    BadSan(String),
    #[error("certificate names no node")]
    NoPeerName,
    #[error("tls: {0}")]
    Tls(#[from] rustls::Error),
    #[error("tls client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("quic: {0}")]
    Quic(String),
    #[error("grpc: {0}")]
    Grpc(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("join nonce of {len} bytes, expected {expected}")]
    BadNonce { len: usize, expected: usize },
    #[error("join proof does not verify")]
    BadProof,
    #[error("protocol version mismatch: `{peer}` speaks {theirs}, this node speaks {ours}")]
    VersionMismatch { peer: String, theirs: u32, ours: u32 },
    #[error("peer's certificate names `{cert}` but its hello says `{hello}`")]
    NameMismatch { cert: String, hello: String },
    #[error("`{peer}` refused the link: {reason}")]
    Refused { peer: String, reason: String },
    #[error("link to `{peer}`: expected {expected}, got {got}")]
    UnexpectedFrame { peer: String, expected: &'static str, got: String },
    #[error("link to `{peer}` closed")]
    Closed { peer: String },
    #[error("{what} took longer than {ms} ms")]
    Timeout { what: &'static str, ms: u128 },
    #[error("link probe: {0}")]
    Probe(String),
}

pub type Result<T, E = TransportError> = std::result::Result<T, E>;
