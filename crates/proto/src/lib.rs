//! brigade's wire contract as Rust: the code generated from `proto/brigade/v1/*.proto` and the
//! one place where the protocol version is stated and checked.
//!
//! # Layout
//! - [`v1`]: every message, enum, client and server of package `brigade.v1` (tonic + prost),
//!   generated at build time with the vendored `protoc`.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors, for `tonic-reflection`.
//! - [`PROTOCOL_VERSION`], [`with_version`], [`VersionInterceptor`], [`check_version`],
//!   [`require_version`], [`check_protocol`]: the client states its version in the gRPC metadata
//!   key [`PROTOCOL_METADATA_KEY`]; the server refuses another one with `FAILED_PRECONDITION`
//!   naming both versions.
//!
//! - [`convert`]: wire types to and from `brigade-core`'s, with the figures checked.
//! - [`relay`]: a session's relay between a client and its driver without IO (what to forward,
//!   when and how to resume after the pipeline fails), shared by the coordinator and the tests.
//!
//! Deliberately lacking: transport, TLS and any I/O. This crate depends only on brigade-core,
//! tonic, prost and tonic-prost.

#![forbid(unsafe_code)]

pub mod convert;
pub mod relay;

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Package `brigade.v1`: everything `proto/brigade/v1/*.proto` declares.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("brigade.v1");
}

/// The encoded `FileDescriptorSet` of `brigade.v1`, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("brigade_v1_descriptor");

/// The protocol version this build speaks. Peers of another version are refused. 2: decode
/// runs (`FLAG_DRAFT`, `FrameHeader.draft`), which a stage of version 1 would read as a prompt
/// chunk.
pub const PROTOCOL_VERSION: u32 = 2;

/// The gRPC metadata key that carries the caller's protocol version (decimal).
pub const PROTOCOL_METADATA_KEY: &str = "brigade-protocol";

/// Adds this build's protocol version to a request's metadata.
pub fn with_version<T>(mut request: Request<T>) -> Request<T> {
    request.metadata_mut().insert(PROTOCOL_METADATA_KEY, MetadataValue::from(PROTOCOL_VERSION));
    request
}

/// A client interceptor that states [`PROTOCOL_VERSION`] on every call:
/// `ControlClient::with_interceptor(channel, VersionInterceptor)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct VersionInterceptor;

impl Interceptor for VersionInterceptor {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        Ok(with_version(request))
    }
}

/// Checks the protocol version a request states in its metadata.
///
/// A missing or unreadable header is a mismatch too: a client that states nothing is not known
/// to speak this version.
pub fn check_version<T>(request: &Request<T>) -> Result<(), Status> {
    let Some(value) = request.metadata().get(PROTOCOL_METADATA_KEY) else {
        return Err(mismatch("client did not state a protocol version"));
    };
    match value.to_str().ok().and_then(|text| text.trim().parse::<u32>().ok()) {
        Some(stated) => check_stated(stated),
        None => Err(mismatch(&format!("client stated an unreadable protocol version {value:?}"))),
    }
}

/// [`check_version`] in the shape of a server interceptor:
/// `ControlServer::with_interceptor(service, require_version)`.
pub fn require_version(request: Request<()>) -> Result<Request<()>, Status> {
    check_version(&request)?;
    Ok(request)
}

/// Checks a version stated in a message's `protocol` field (`JoinRequest`, `RegisterRequest`,
/// `FrameHeader`), where proto3's default 0 means the sender did not state one.
pub fn check_protocol(stated: u32) -> Result<(), Status> {
    if stated == 0 {
        return Err(mismatch("client did not state a protocol version"));
    }
    check_stated(stated)
}

fn check_stated(stated: u32) -> Result<(), Status> {
    if stated == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(mismatch(&format!("client speaks {stated}")))
    }
}

fn mismatch(what: &str) -> Status {
    Status::failed_precondition(format!("protocol version mismatch: {what}, this server speaks {PROTOCOL_VERSION}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use tonic::Code;

    #[test]
    fn interceptor_states_the_version_and_the_check_accepts_it() {
        let request = VersionInterceptor.call(Request::new(()));
        assert!(request.is_ok_and(|r| check_version(&r).is_ok()));
        assert!(require_version(with_version(Request::new(()))).is_ok());
        assert!(check_protocol(PROTOCOL_VERSION).is_ok());
    }

    #[test]
    fn another_version_is_refused_naming_both() {
        let mut request = Request::new(());
        request.metadata_mut().insert(PROTOCOL_METADATA_KEY, MetadataValue::from(1u32));
        let status = check_version(&request).err();
        assert_eq!(status.as_ref().map(Status::code), Some(Code::FailedPrecondition));
        assert_eq!(
            status.as_ref().map(Status::message),
            Some("protocol version mismatch: client speaks 1, this server speaks 2")
        );
        assert_eq!(
            check_protocol(7).err().map(|s| s.message().to_owned()),
            Some("protocol version mismatch: client speaks 7, this server speaks 2".to_owned())
        );
    }

    #[test]
    fn a_missing_or_unreadable_version_is_a_mismatch() {
        let status = require_version(Request::new(())).err();
        assert_eq!(
            status.as_ref().map(Status::message),
            Some("protocol version mismatch: client did not state a protocol version, this server speaks 2")
        );
        assert_eq!(check_protocol(0).err().map(|s| s.code()), Some(Code::FailedPrecondition));
        let mut request = Request::new(());
        request.metadata_mut().insert(PROTOCOL_METADATA_KEY, MetadataValue::from_static("one"));
        let status = check_version(&request).err();
        assert!(status.is_some_and(|s| s.message().contains("\"one\"") && s.message().contains("speaks 2")));
    }

    #[test]
    fn generated_messages_round_trip_and_descriptors_are_present() {
        let header = v1::FrameHeader {
            protocol: PROTOCOL_VERSION,
            kind: v1::FrameKind::Hidden as i32,
            shape: vec![1, 2048],
            payload_len: 8192,
            ..Default::default()
        };
        let decoded = v1::FrameHeader::decode(header.encode_to_vec().as_slice());
        assert_eq!(decoded.ok(), Some(header));
        let frame = v1::FrameBytes { frame: prost::bytes::Bytes::from_static(b"BRGF") };
        assert_eq!(frame.frame.len(), 4);
        // every .proto file is in the descriptor set under its import path
        for file in ["common", "control", "client", "worker", "frame"] {
            let name = format!("brigade/v1/{file}.proto");
            assert!(
                FILE_DESCRIPTOR_SET.windows(name.len()).any(|w| w == name.as_bytes()),
                "{name} missing from the descriptor set"
            );
        }
    }
}
