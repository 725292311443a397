//! brigade's data-plane transport: activation frames between pipeline stages, over QUIC or gRPC,
//! with the cluster's PKI. It knows no tensors (payloads are bytes with a shape) and no raft.
//!
//! # Layout
//! - [`frame`]: the sans-IO frame codec (`BRGF` | u32 LE header length | `FrameHeader` |
//!   payload): [`Frame`] and its constructors, [`encode`], [`Decoder`] with [`Limits`]. Every
//!   length is checked before it is trusted.
//! - [`wire`]: f32 rows to and from f32/f16/bf16 wire bytes, token ids to and from u32 LE.
//! - [`tls`]: the cluster CA ([`ClusterCa`]), node identities ([`Identity`]), names from
//!   certificates, rustls configs for mutual TLS with cluster certificates (ring provider).
//! - [`join`]: the join handshake's HMAC proofs, join tokens, and the join connection's
//!   certificate verifier.
//! - [`link`]: [`Link`], an ordered bounded frame channel to one peer stage, whatever carries
//!   it; the HELLO exchange every carrier runs before handing a link out.
//! - [`quic`]: [`QuicEndpoint`] (quinn), one UDP socket that accepts and dials links.
//! - [`grpc`]: the same links over `Stage.Activations` ([`connect_grpc`],
//!   [`link_from_stream`]), tonic's TLS configs, the join and coordinator channels.
//! - [`probe`]: link latency, bandwidth and clock offset ([`measure`], [`Responder`]).
//!
//! Deliberately lacking: tensors (the worker converts with [`wire`]), sessions and their state,
//! retries and reconnection (a dropped link is reported, the caller decides), raft, and any
//! discovery of peers (addresses come from the coordinator's assignments).

#![forbid(unsafe_code)]

pub mod error;
pub mod frame;
pub mod grpc;
pub mod join;
pub mod link;
pub mod probe;
pub mod quic;
pub mod tls;
pub mod wire;

pub use error::{Result, TransportError};
pub use frame::{encode, Decoder, Frame, FrameError, Limits};
pub use grpc::{connect_grpc, link_from_stream};
pub use link::Link;
pub use probe::{measure, LinkFigures, Responder};
pub use quic::QuicEndpoint;
pub use tls::{ClusterCa, Identity, Role};
