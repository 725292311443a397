//! The QUIC carrier (quinn): one UDP socket per node serves and dials links; each link is one
//! connection with one bidirectional stream, mutual TLS with cluster certificates, ALPN
//! `brigade/<PROTOCOL_VERSION>`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use brigade_core::admission::{Admission, Caps};
use brigade_proto::PROTOCOL_VERSION;
use bytes::BytesMut;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, IdleTimeout, MtuDiscoveryConfig, RecvStream, SendStream, TransportConfig, VarInt};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::error::{Result, TransportError};
use crate::frame::{encode_head, Decoder, Frame, Limits};
use crate::link::{accept_handshake, connect_handshake, Link, HANDSHAKE_TIMEOUT, LINK_CAPACITY};
use crate::tls::{self, node_dns_name, peer_name_from_cert, Identity};

/// Application close codes.
const CLOSE_DONE: u32 = 0;
const CLOSE_BAD_FRAME: u32 = 1;
/// How long a dropped link waits for the peer to read what was sent before closing.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// A 9000-byte jumbo frame less the IPv4 and UDP headers.
const JUMBO_UDP_PAYLOAD: u16 = 8972;
/// Largest chunk read from a stream at once.
const READ_CHUNK: usize = 1 << 20;

/// The ALPN protocol of brigade's QUIC links: `brigade/<PROTOCOL_VERSION>`.
pub fn alpn() -> Vec<u8> {
    format!("brigade/{PROTOCOL_VERSION}").into_bytes()
}

/// quinn tuned for activation traffic: receive windows of several MiB so one 8 MiB prompt
/// chunk is not throttled by flow control on fat links, path MTU discovery up to jumbo frames
/// (datacenter links; quinn falls back on paths that drop them), keep-alives well inside the
/// idle timeout. quinn sends stream data as soon as it is written (there is no Nagle-like delay).
fn transport_config() -> Arc<TransportConfig> {
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(JUMBO_UDP_PAYLOAD);
    let mut config = TransportConfig::default();
    config
        .stream_receive_window(VarInt::from_u32(16 << 20))
        .receive_window(VarInt::from_u32(32 << 20))
        .send_window(32 << 20)
        .max_concurrent_bidi_streams(VarInt::from_u32(4))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .keep_alive_interval(Some(Duration::from_secs(1)))
        .max_idle_timeout(Some(IdleTimeout::from(VarInt::from_u32(6_000))))
        .mtu_discovery_config(Some(mtu));
    Arc::new(config)
}

/// Handshakes in flight at once on one endpoint; an Initial beyond them is refused (the peer
/// retries), so strangers can hold at most this many slots and never the accept loop itself.
pub const MAX_HANDSHAKES: usize = 256;
/// Handshakes in flight at once from one IP address.
pub const MAX_HANDSHAKES_PER_IP: usize = 32;
/// Finished handshakes waiting for `accept`.
const ACCEPTED_BACKLOG: usize = 16;

/// A node's QUIC endpoint: accepts links from its peers and dials links to them, on one socket.
///
/// Accepting runs in a background task: an Initial from an address not yet validated gets a
/// Retry (a spoofed source never costs a handshake), and each handshake runs in its own task
/// under [`MAX_HANDSHAKES`] / [`MAX_HANDSHAKES_PER_IP`], bounded by the handshake timeout, so a
/// peer that stalls mid-handshake delays nobody else.
#[derive(Debug)]
pub struct QuicEndpoint {
    endpoint: quinn::Endpoint,
    name: String,
    limits: Limits,
    accepted: tokio::sync::Mutex<mpsc::Receiver<Result<Link>>>,
}

impl QuicEndpoint {
    /// Binds `addr` (port 0 for any) with the node's identity; peers must hold certificates of
    /// the CA in `ca_pem`. Must be called inside a tokio runtime.
    pub fn bind(addr: SocketAddr, identity: &Identity, ca_pem: &str) -> Result<Self> {
        let name = identity.name()?;
        let mut server_tls = tls::server_config(identity, ca_pem)?;
        server_tls.alpn_protocols = vec![alpn()];
        let server_tls = QuicServerConfig::try_from(server_tls).map_err(|e| TransportError::Quic(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_tls));
        server.transport_config(transport_config());

        let mut client_tls = tls::client_config(identity, ca_pem)?;
        client_tls.alpn_protocols = vec![alpn()];
        let client_tls = QuicClientConfig::try_from(client_tls).map_err(|e| TransportError::Quic(e.to_string()))?;
        let mut client = quinn::ClientConfig::new(Arc::new(client_tls));
        client.transport_config(transport_config());

        let mut endpoint = quinn::Endpoint::server(server, addr)?;
        endpoint.set_default_client_config(client);
        let limits = Limits::default();
        let (tx, rx) = mpsc::channel(ACCEPTED_BACKLOG);
        tokio::spawn(accept_loop(endpoint.clone(), name.clone(), limits, tx));
        Ok(Self { endpoint, name, limits, accepted: tokio::sync::Mutex::new(rx) })
    }

    /// The address the socket is bound to (the port the OS chose for port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.endpoint.local_addr()?)
    }

    /// This node's name, from its certificate.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Opens a link to the node `peer` at `addr`. The server's certificate must chain to the
    /// cluster CA and be for `<peer>.node.brigade`; the peer's HELLO must say `peer` and this
    /// protocol version.
    pub async fn connect(&self, addr: SocketAddr, peer: &str) -> Result<Link> {
        tls::validate_node_name(peer)?;
        let dialing = async {
            let connecting = self
                .endpoint
                .connect(addr, &node_dns_name(peer))
                .map_err(|e| TransportError::Quic(format!("connect to `{peer}` at {addr}: {e}")))?;
            let conn =
                connecting.await.map_err(|e| TransportError::Quic(format!("connect to `{peer}` at {addr}: {e}")))?;
            let (named, fingerprint) = peer_name(&conn)?;
            if named != peer {
                return Err(TransportError::NameMismatch { cert: named, hello: peer.to_owned() });
            }
            let (send, recv) =
                conn.open_bi().await.map_err(|e| TransportError::Quic(format!("open a stream to `{peer}`: {e}")))?;
            let mut link = spawn_pumps(conn.clone(), send, recv, (named, fingerprint), self.limits);
            connect_handshake(&mut link, &self.name).await.map_err(|e| closed_reason(&conn, e))?;
            Ok(link)
        };
        within(dialing, "a quic connect").await
    }

    /// The next link a peer opened: `None` once the endpoint is closed, `Err` for an attempt that
    /// failed (bad certificate, bad HELLO, timeout); keep accepting after an `Err`. Attempts run
    /// concurrently in the background (see the type's docs), each bounded by the handshake timeout.
    pub async fn accept(&self) -> Option<Result<Link>> {
        self.accepted.lock().await.recv().await
    }

    /// Closes every connection and stops accepting.
    pub fn close(&self) {
        self.endpoint.close(VarInt::from_u32(CLOSE_DONE), b"endpoint closed");
    }
}

/// Takes Initials off the endpoint and runs each handshake in its own task; ends when the
/// endpoint closes (or nobody holds the `QuicEndpoint` any more).
async fn accept_loop(endpoint: quinn::Endpoint, name: String, limits: Limits, tx: mpsc::Sender<Result<Link>>) {
    let handshakes = Admission::new(Caps { total: MAX_HANDSHAKES, per_ip: MAX_HANDSHAKES_PER_IP });
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => incoming,
            // The `QuicEndpoint` was dropped: let go of the socket.
            () = tx.closed() => None,
        };
        let Some(incoming) = incoming else { break };
        let remote = incoming.remote_address();
        if !incoming.remote_address_validated() && incoming.may_retry() {
            // Address validation: the peer must echo the Retry token from its real address.
            let _ = incoming.retry();
            continue;
        }
        let ticket = match handshakes.admit(remote.ip()) {
            Ok(ticket) => ticket,
            Err(refused) => {
                debug!("refused a QUIC handshake from {remote}: {refused}");
                incoming.refuse();
                continue;
            }
        };
        let (name, tx) = (name.clone(), tx.clone());
        tokio::spawn(async move {
            let accepting = async {
                let conn = incoming.await.map_err(|e| TransportError::Quic(format!("accept from {remote}: {e}")))?;
                let peer = peer_name(&conn)?;
                let (send, recv) = conn
                    .accept_bi()
                    .await
                    .map_err(|e| TransportError::Quic(format!("accept a stream from `{}`: {e}", peer.0)))?;
                let mut link = spawn_pumps(conn.clone(), send, recv, peer, limits);
                accept_handshake(&mut link, &name).await.map_err(|e| closed_reason(&conn, e))?;
                Ok(link)
            };
            let result = within(accepting, "a quic accept").await;
            drop(ticket);
            let _ = tx.send(result).await;
        });
    }
}

async fn within<T>(work: impl std::future::Future<Output = Result<T>>, what: &'static str) -> Result<T> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, work)
        .await
        .unwrap_or(Err(TransportError::Timeout { what, ms: HANDSHAKE_TIMEOUT.as_millis() }))
}

/// A handshake that failed because the connection went away reports why it went away (the TLS
/// alert of a refused certificate, the peer's close reason).
fn closed_reason(conn: &Connection, error: TransportError) -> TransportError {
    match (&error, conn.close_reason()) {
        (TransportError::Closed { peer }, Some(reason)) => {
            TransportError::Quic(format!("link to `{peer}` closed: {reason}"))
        }
        _ => error,
    }
}

/// The node name of the peer's verified certificate.
/// The node the peer's certificate names, and the certificate's fingerprint.
fn peer_name(conn: &Connection) -> Result<(String, String)> {
    let certs = conn
        .peer_identity()
        .and_then(|identity| identity.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or(TransportError::NoPeerName)?;
    let leaf = certs.first().ok_or(TransportError::NoPeerName)?;
    let name = peer_name_from_cert(leaf).ok_or(TransportError::NoPeerName)?;
    Ok((name, tls::fingerprint(leaf)))
}

fn spawn_pumps(
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
    (peer, fingerprint): (String, String),
    limits: Limits,
) -> Link {
    let (out_tx, out_rx) = mpsc::channel(LINK_CAPACITY);
    let (in_tx, in_rx) = mpsc::channel(LINK_CAPACITY);
    tokio::spawn(write_frames(conn.clone(), send, out_rx, peer.clone()));
    tokio::spawn(read_frames(conn, recv, in_tx, limits, peer.clone()));
    Link { peer, fingerprint: Some(fingerprint), tx: out_tx, rx: in_rx }
}

/// Link → stream. Each frame's head and payload go out as two chunks (the payload uncopied).
/// When the link is dropped: finish the stream, give the peer a moment to read it, close.
async fn write_frames(conn: Connection, mut send: SendStream, mut frames: mpsc::Receiver<Frame>, peer: String) {
    let mut head = BytesMut::new();
    loop {
        let frame = tokio::select! {
            frame = frames.recv() => frame,
            reason = conn.closed() => {
                debug!(%peer, %reason, "quic link closed");
                return;
            }
        };
        let Some(frame) = frame else { break };
        if let Err(error) = encode_head(&frame, &mut head) {
            // senders check first (`Link::send`); one that did not loses this frame, and the
            // other sessions on the link keep it
            head.clear();
            warn!(%peer, %error, session = frame.header.session, "dropping a frame that cannot be encoded");
            continue;
        }
        let mut chunks = [head.split().freeze(), frame.payload];
        if let Err(error) = send.write_all_chunks(&mut chunks).await {
            debug!(%peer, %error, "quic link write failed");
            return;
        }
    }
    let _ = send.finish();
    let _ = tokio::time::timeout(CLOSE_GRACE, send.stopped()).await;
    conn.close(VarInt::from_u32(CLOSE_DONE), b"link dropped");
}

/// Stream → link. Bytes that are not a valid frame close the connection with the reason.
async fn read_frames(
    conn: Connection,
    mut recv: RecvStream,
    frames: mpsc::Sender<Frame>,
    limits: Limits,
    peer: String,
) {
    let mut decoder = Decoder::new(limits);
    loop {
        match recv.read_chunk(READ_CHUNK, true).await {
            Ok(Some(chunk)) => decoder.push(&chunk.bytes),
            Ok(None) => {
                debug!(%peer, "quic link finished by the peer");
                return;
            }
            Err(error) => {
                debug!(%peer, %error, "quic link read failed");
                return;
            }
        }
        loop {
            match decoder.poll() {
                Ok(Some(frame)) => {
                    if frames.send(frame).await.is_err() {
                        // the link's receiver is gone: nothing will read further frames
                        let _ = recv.stop(VarInt::from_u32(CLOSE_DONE));
                        return;
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    warn!(%peer, %error, "invalid frame from peer; dropping the link");
                    conn.close(VarInt::from_u32(CLOSE_BAD_FRAME), error.to_string().as_bytes());
                    return;
                }
            }
        }
    }
}
