//! The gRPC carrier: a [`Link`] over the `Stage.Activations` bidirectional stream, for networks
//! that block UDP. Each `FrameBytes` message holds exactly one encoded frame. Also the tonic TLS
//! configuration of the cluster (mutual TLS with cluster certificates) and the join channel.
//!
//! The worker's `Stage` service returns [`link_from_stream`]'s stream from `activations`:
//!
//! ```text
//! type ActivationsStream = brigade_transport::grpc::FrameStream;
//! async fn activations(&self, request: Request<Streaming<FrameBytes>>)
//!     -> Result<Response<FrameStream>, Status> {
//!     let peer = peer_node_name(&request).ok_or_else(|| Status::unauthenticated("no node certificate"))?;
//!     let (link, stream) = link_from_stream(&self.name, &peer, request.into_inner()).await?;
//!     self.links.send(link).await.map_err(|_| Status::unavailable("worker is stopping"))?;
//!     Ok(Response::new(stream))
//! }
//! ```

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use brigade_core::admission::{Admission, Caps, Ticket};
use brigade_proto::v1::stage_client::StageClient;
use brigade_proto::v1::stage_server::{Stage, StageServer};
use brigade_proto::v1::FrameBytes;
use brigade_proto::{require_version, VersionInterceptor};
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Server, ServerTlsConfig};
use tonic::{Code, Request, Status, Streaming};
use tracing::{debug, warn};

use crate::error::{Result, TransportError};
use crate::frame::{decode_exact, encode, Frame, Limits, MAX_HEADER, PREFIX_LEN};
use crate::join::JoinVerifier;
use crate::link::{accept_handshake, expect_hello, send_hello, Link, HANDSHAKE_TIMEOUT, LINK_CAPACITY};
use crate::tls::{self, node_dns_name, peer_name_from_cert, Identity, COORDINATOR_NAME};

/// The largest gRPC message either side accepts: one frame of the largest payload.
pub const MAX_MESSAGE: usize = (crate::frame::DEFAULT_MAX_PAYLOAD as usize) + PREFIX_LEN + MAX_HEADER as usize;
/// HTTP/2 flow-control windows: the 64 KiB default would hold a 4 MiB frame to a trickle of
/// round trips.
const STREAM_WINDOW: u32 = 16 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;

/// Connections one gRPC port holds at once (see [`incoming`]).
pub const GRPC_CAPS: Caps = Caps { total: 1024, per_ip: 256 };
/// A TLS handshake not finished by then is dropped (a silent TCP connection, a slow client).
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Streams one HTTP/2 connection may have open at once.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;
/// HTTP/2 keep-alive: a ping every interval; a peer that does not answer within the timeout is
/// dropped with its streams.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// How long accepting pauses after the OS refused a connection (out of file descriptors): long
/// enough that a full table costs no core, short enough that service resumes at once.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The response stream of `Stage.Activations` (the worker's `ActivationsStream`).
pub type FrameStream = ReceiverStream<Result<FrameBytes, Status>>;

/// The version check as a server interceptor function.
pub type VersionCheck = fn(Request<()>) -> Result<Request<()>, Status>;

fn grpc_error(what: &str, error: impl std::fmt::Display) -> TransportError {
    TransportError::Grpc(format!("{what}: {error}"))
}

/// tonic's server TLS: present `identity`, require client certificates of the cluster CA; a
/// handshake takes at most [`TLS_HANDSHAKE_TIMEOUT`].
pub fn server_tls_config(identity: &Identity, ca_pem: &str) -> ServerTlsConfig {
    ServerTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(&identity.cert_chain_pem, &identity.key_pem))
        .client_ca_root(Certificate::from_pem(ca_pem))
        .timeout(TLS_HANDSHAKE_TIMEOUT)
}

/// The limits every brigade gRPC server runs with: streams per connection, HTTP/2 keep-alive
/// (a peer that stops answering pings loses its connection), a bounded header list.
pub fn bounded_server(builder: Server) -> Server {
    builder
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .http2_max_header_list_size(16 << 10)
        .tcp_nodelay(true)
}

/// A TCP connection admitted under [`GRPC_CAPS`]: holds its place in the table while open.
#[derive(Debug)]
pub struct AdmittedTcp {
    stream: TcpStream,
    _ticket: Ticket,
}

impl Connected for AdmittedTcp {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for AdmittedTcp {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for AdmittedTcp {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The connections of `listener` for `serve_with_incoming`, admitted under `caps`: one over a
/// cap is closed at once, and an accept the OS refuses (no file descriptors left) pauses
/// accepting for a moment instead of spinning. Ends when the server drops the stream.
pub fn incoming(listener: TcpListener, caps: Caps) -> ReceiverStream<std::io::Result<AdmittedTcp>> {
    let (tx, rx) = mpsc::channel(16);
    let admission = Admission::new(caps);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => break,
            };
            match accepted {
                Ok((stream, remote)) => match admission.admit(remote.ip()) {
                    Ok(ticket) => {
                        let _ = stream.set_nodelay(true);
                        if tx.send(Ok(AdmittedTcp { stream, _ticket: ticket })).await.is_err() {
                            break;
                        }
                    }
                    Err(refused) => debug!("closed a connection from {remote}: {refused}"),
                },
                Err(e) => {
                    warn!("accepting a connection: {e}; pausing {ACCEPT_BACKOFF:?}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// tonic's server TLS for the coordinator's control port: client certificates of the cluster CA
/// are verified when presented but not required, as `Join` comes before the worker has one;
/// every other call checks [`peer_node_name`] itself.
pub fn coordinator_tls_config(identity: &Identity, ca_pem: &str) -> ServerTlsConfig {
    server_tls_config(identity, ca_pem).client_auth_optional(true)
}

/// tonic's client TLS to `server_name` (`<peer>.node.brigade`, `coordinator.brigade`): trust only
/// the cluster CA, present `identity`.
pub fn client_tls_config(identity: &Identity, ca_pem: &str, server_name: &str) -> ClientTlsConfig {
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .identity(tonic::transport::Identity::from_pem(&identity.cert_chain_pem, &identity.key_pem))
        .domain_name(server_name)
}

/// A tonic server builder with the cluster's mutual TLS, windows sized for activation frames and
/// no Nagle delay. Add services and serve as usual.
pub fn server(identity: &Identity, ca_pem: &str) -> Result<Server> {
    tls::install_default_provider();
    Ok(bounded_server(Server::builder())
        .tls_config(server_tls_config(identity, ca_pem))
        .map_err(|e| grpc_error("server tls", e))?
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW))
}

/// The worker's `Stage` service with the protocol version check and message limits that fit
/// the largest frame.
pub fn stage_service<S: Stage>(service: S) -> InterceptedService<StageServer<S>, VersionCheck> {
    let server =
        StageServer::new(service).max_decoding_message_size(MAX_MESSAGE).max_encoding_message_size(MAX_MESSAGE);
    InterceptedService::new(server, require_version as VersionCheck)
}

/// The node name of the verified client certificate of a request (server side).
pub fn peer_node_name<T>(request: &Request<T>) -> Option<String> {
    let certs = request.peer_certs()?;
    certs.first().and_then(|leaf| peer_name_from_cert(leaf))
}

fn endpoint(uri: &str) -> Result<Endpoint> {
    Ok(Endpoint::from_shared(uri.to_owned())
        .map_err(|e| grpc_error(uri, e))?
        .tcp_nodelay(true)
        .connect_timeout(HANDSHAKE_TIMEOUT)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW))
}

/// A channel with the cluster's mutual TLS to `server_name` at `uri` (`https://host:port`).
pub async fn channel(uri: &str, identity: &Identity, ca_pem: &str, server_name: &str) -> Result<Channel> {
    tls::install_default_provider();
    endpoint(uri)?
        .tls_config(client_tls_config(identity, ca_pem, server_name))
        .map_err(|e| grpc_error(uri, e))?
        .connect()
        .await
        .map_err(|e| grpc_error(&format!("connect to {uri}"), error_chain(&e)))
}

/// A channel to the coordinator (`coordinator.brigade`) with a node's cluster identity.
pub async fn coordinator_channel(uri: &str, identity: &Identity, ca_pem: &str) -> Result<Channel> {
    channel(uri, identity, ca_pem, COORDINATOR_NAME).await
}

/// The join connection: no client certificate, the coordinator's certificate accepted as it is
/// and recorded by the returned verifier, whose `seen_leaf()` the worker binds its proof to.
pub async fn join_channel(uri: &str) -> Result<(Channel, Arc<JoinVerifier>)> {
    tls::install_default_provider();
    let verifier = JoinVerifier::new();
    let channel = endpoint(uri)?
        .tls_config_with_verifier(ClientTlsConfig::new().domain_name(COORDINATOR_NAME), verifier.clone())
        .map_err(|e| grpc_error(uri, e))?
        .connect()
        .await
        .map_err(|e| grpc_error(&format!("connect to {uri}"), error_chain(&e)))?;
    Ok((channel, verifier))
}

/// An error with its sources: tonic's transport errors say "transport error" and keep the TLS
/// alert in the source chain.
fn error_chain(error: &dyn std::error::Error) -> String {
    with_sources(error.to_string(), error.source())
}

/// A refused call's message with the causes tonic keeps in its sources.
fn status_reason(status: &Status) -> String {
    with_sources(status.message().to_owned(), std::error::Error::source(status))
}

/// `text` followed by each source that does not repeat what is already said.
fn with_sources(mut text: String, mut source: Option<&dyn std::error::Error>) -> String {
    while let Some(inner) = source {
        let more = inner.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = inner.source();
    }
    text
}

/// Opens a link to the node `peer` over `Stage.Activations` at `uri` (`https://host:port`).
/// The server's certificate must chain to the cluster CA and be for `<peer>.node.brigade`.
pub async fn connect_grpc(uri: &str, identity: &Identity, ca_pem: &str, peer: &str) -> Result<Link> {
    tls::validate_node_name(peer)?;
    let own = identity.name()?;
    let channel = channel(uri, identity, ca_pem, &node_dns_name(peer)).await?;
    let mut client = StageClient::with_interceptor(channel, VersionInterceptor)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);

    let (wire_tx, wire_rx) = mpsc::channel::<FrameBytes>(LINK_CAPACITY);
    let (out_tx, out_rx) = mpsc::channel::<Frame>(LINK_CAPACITY);
    let (in_tx, in_rx) = mpsc::channel::<Frame>(LINK_CAPACITY);
    tokio::spawn(write_frames(out_rx, wire_tx, |m| m, peer.to_owned()));
    let mut link = Link { peer: peer.to_owned(), fingerprint: None, tx: out_tx, rx: in_rx };
    // the server reads our HELLO before it answers the call
    send_hello(&link, &own).await?;
    let call = tokio::time::timeout(HANDSHAKE_TIMEOUT, client.activations(ReceiverStream::new(wire_rx)));
    let response = match call.await {
        Ok(Ok(response)) => response,
        Ok(Err(status)) => {
            return Err(TransportError::Refused { peer: peer.to_owned(), reason: status_reason(&status) })
        }
        Err(_) => return Err(TransportError::Timeout { what: "a grpc link call", ms: HANDSHAKE_TIMEOUT.as_millis() }),
    };
    tokio::spawn(read_frames(response.into_inner(), in_tx, None, peer.to_owned()));
    expect_hello(&mut link).await?;
    Ok(link)
}

/// The server side of `Stage.Activations`: checks the caller's HELLO, answers with this node's,
/// and returns the link and the response stream for the handler to return. `peer` is the
/// verified certificate name ([`peer_node_name`]). A refused HELLO is the call's error status.
pub async fn link_from_stream(
    own_name: &str,
    peer: &str,
    stream: Streaming<FrameBytes>,
) -> Result<(Link, FrameStream), Status> {
    let (wire_tx, wire_rx) = mpsc::channel::<Result<FrameBytes, Status>>(LINK_CAPACITY);
    let (out_tx, out_rx) = mpsc::channel::<Frame>(LINK_CAPACITY);
    let (in_tx, in_rx) = mpsc::channel::<Frame>(LINK_CAPACITY);
    tokio::spawn(write_frames(out_rx, wire_tx.clone(), Ok, peer.to_owned()));
    tokio::spawn(read_frames(stream, in_tx, Some(wire_tx), peer.to_owned()));
    let mut link = Link { peer: peer.to_owned(), fingerprint: None, tx: out_tx, rx: in_rx };
    accept_handshake(&mut link, own_name).await.map_err(|error| {
        let code = match error {
            TransportError::VersionMismatch { .. } => Code::FailedPrecondition,
            TransportError::NameMismatch { .. } => Code::PermissionDenied,
            TransportError::Timeout { .. } => Code::DeadlineExceeded,
            _ => Code::InvalidArgument,
        };
        Status::new(code, error.to_string())
    })?;
    Ok((link, ReceiverStream::new(wire_rx)))
}

/// Link → messages, one encoded frame each.
async fn write_frames<T>(
    mut frames: mpsc::Receiver<Frame>,
    wire: mpsc::Sender<T>,
    wrap: fn(FrameBytes) -> T,
    peer: String,
) {
    let mut buf = BytesMut::new();
    while let Some(frame) = tokio::select! {
        frame = frames.recv() => frame,
        _ = wire.closed() => None,
    } {
        if let Err(error) = encode(&frame, &mut buf) {
            // senders check first (`Link::send`); one that did not loses this frame, and the
            // other sessions on the link keep it
            buf.clear();
            warn!(%peer, %error, session = frame.header.session, "dropping a frame that cannot be encoded");
            continue;
        }
        let message = FrameBytes { frame: buf.split().freeze() };
        if wire.send(wrap(message)).await.is_err() {
            debug!(%peer, "grpc link closed while writing");
            return;
        }
    }
}

/// Messages → link. A message that is not exactly one valid frame ends the link; the server
/// side tells the caller why in the stream's status.
async fn read_frames(
    mut stream: Streaming<FrameBytes>,
    frames: mpsc::Sender<Frame>,
    status_to: Option<mpsc::Sender<Result<FrameBytes, Status>>>,
    peer: String,
) {
    let limits = Limits::default();
    loop {
        let message = tokio::select! {
            message = stream.message() => message,
            _ = frames.closed() => return,
        };
        let bytes = match message {
            Ok(Some(message)) => message.frame,
            Ok(None) => {
                debug!(%peer, "grpc link finished by the peer");
                return;
            }
            Err(status) => {
                debug!(%peer, %status, "grpc link ended");
                return;
            }
        };
        match decode_exact(bytes, &limits) {
            Ok(frame) => {
                if frames.send(frame).await.is_err() {
                    return;
                }
            }
            Err(error) => {
                warn!(%peer, %error, "invalid frame from peer; dropping the link");
                if let Some(status_to) = status_to {
                    let _ = status_to.send(Err(Status::invalid_argument(error.to_string()))).await;
                }
                return;
            }
        }
    }
}
