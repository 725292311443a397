//! [`Link`]: an ordered, bounded channel of frames to one peer stage, whatever carries it.
//!
//! A carrier (QUIC, gRPC) spawns two pump tasks per link, one moving frames from the link to
//! the wire and one from the wire to the link, and runs the HELLO exchange over them before it
//! hands the link out: the first frame each way is HELLO with the sender's node name and
//! protocol version. Dropping the link ends the pumps, which close the connection.

use std::time::Duration;

use brigade_proto::v1::FrameKind;
use brigade_proto::PROTOCOL_VERSION;
use tokio::sync::mpsc;

use crate::error::{Result, TransportError};
use crate::frame::Frame;

/// Frames buffered each way per link. Frames may be megabytes (a 512-row prompt chunk of a
/// 4096-wide model in f32 is 8 MiB), so the bound is small; senders wait when it is full.
pub const LINK_CAPACITY: usize = 16;
/// How long a carrier waits for the TLS handshake and the peer's HELLO.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// An ordered frame channel to the stage `peer`.
///
/// `peer` is the node name verified from the peer's certificate (and repeated in its HELLO);
/// HELLO frames are exchanged before the link is handed out and never appear on `rx`. `rx`
/// yields `None` once the connection is gone (the peer dropped its link, the network failed, or
/// the peer sent bytes that are not a valid frame: the reason is logged). Dropping the link
/// closes the connection after the frames already sent are delivered.
#[derive(Debug)]
pub struct Link {
    pub peer: String,
    /// sha256 (lower-case hex) of the peer's leaf certificate, where the carrier knows it (QUIC
    /// both ways; a gRPC server learns it from its request): what revocation is checked against.
    pub fingerprint: Option<String>,
    pub tx: mpsc::Sender<Frame>,
    pub rx: mpsc::Receiver<Frame>,
}

impl Link {
    /// Two links joined in memory, `a`'s peer named `b` and `b`'s peer named `a` (tests, and
    /// stages that share a process).
    pub fn pair(a: &str, b: &str) -> (Link, Link) {
        let (a_tx, b_rx) = mpsc::channel(LINK_CAPACITY);
        let (b_tx, a_rx) = mpsc::channel(LINK_CAPACITY);
        (
            Link { peer: b.to_owned(), fingerprint: None, tx: a_tx, rx: a_rx },
            Link { peer: a.to_owned(), fingerprint: None, tx: b_tx, rx: b_rx },
        )
    }

    /// Sends a frame, waiting while the link is full.
    /// Sends a frame; one that cannot be encoded is refused here with the reason (the link
    /// stays up for the other sessions on it).
    pub async fn send(&self, frame: Frame) -> Result<()> {
        crate::frame::check_encodable(&frame)?;
        self.tx.send(frame).await.map_err(|_| self.closed())
    }

    /// The next frame, `None` once the link is closed.
    pub async fn recv(&mut self) -> Option<Frame> {
        self.rx.recv().await
    }

    /// The next frame within `timeout`; a closed link or the timeout is an error.
    pub async fn recv_within(&mut self, timeout: Duration, what: &'static str) -> Result<Frame> {
        match tokio::time::timeout(timeout, self.rx.recv()).await {
            Ok(Some(frame)) => Ok(frame),
            Ok(None) => Err(self.closed()),
            Err(_) => Err(TransportError::Timeout { what, ms: timeout.as_millis() }),
        }
    }

    fn closed(&self) -> TransportError {
        TransportError::Closed { peer: self.peer.clone() }
    }
}

/// The connecting side's half: say HELLO, then wait for the peer's HELLO (it accepted) or ERROR
/// (it refused, saying why).
pub(crate) async fn connect_handshake(link: &mut Link, own_name: &str) -> Result<()> {
    send_hello(link, own_name).await?;
    expect_hello(link).await
}

/// The accepting side's half: check the connecting peer's HELLO first, and only then say HELLO,
/// so that the connecting side learns of a refusal before it uses the link.
pub(crate) async fn accept_handshake(link: &mut Link, own_name: &str) -> Result<()> {
    expect_hello(link).await?;
    send_hello(link, own_name).await
}

/// Queues this node's HELLO. The gRPC carrier sends it before it waits for the call to be
/// accepted, as the server answers only after it.
pub(crate) async fn send_hello(link: &Link, own_name: &str) -> Result<()> {
    link.send(Frame::hello(own_name)).await
}

/// Waits for the peer's HELLO and checks it: this protocol version and the certificate's name.
/// A mismatch is answered with an ERROR frame saying why, then refused; an ERROR from the peer
/// is its refusal.
pub(crate) async fn expect_hello(link: &mut Link) -> Result<()> {
    let first = link.recv_within(HANDSHAKE_TIMEOUT, "the peer's hello").await?;
    let refusal = match first.kind() {
        Some(FrameKind::Hello) if first.header.protocol != PROTOCOL_VERSION => TransportError::VersionMismatch {
            peer: link.peer.clone(),
            theirs: first.header.protocol,
            ours: PROTOCOL_VERSION,
        },
        Some(FrameKind::Hello) if first.header.text != link.peer => {
            TransportError::NameMismatch { cert: link.peer.clone(), hello: first.header.text.clone() }
        }
        Some(FrameKind::Hello) => return Ok(()),
        Some(FrameKind::Error) => {
            return Err(TransportError::Refused { peer: link.peer.clone(), reason: first.header.text })
        }
        _ => TransportError::UnexpectedFrame {
            peer: link.peer.clone(),
            expected: "HELLO",
            got: format!("kind {}", first.header.kind),
        },
    };
    // the peer may already be gone; the refusal stands either way
    let _ = link.send(Frame::error(&refusal.to_string())).await;
    Err(refusal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hellos_are_exchanged_and_not_delivered() {
        let (mut a, mut b) = Link::pair("a", "b");
        let (ra, rb) = tokio::join!(connect_handshake(&mut a, "a"), accept_handshake(&mut b, "b"));
        assert!(ra.is_ok() && rb.is_ok(), "{ra:?} {rb:?}");
        assert!(a.send(Frame::close()).await.is_ok());
        let got = b.recv_within(Duration::from_secs(5), "close").await;
        assert!(got.is_ok_and(|f| f.kind() == Some(FrameKind::Close)));
    }

    #[tokio::test]
    async fn another_version_is_refused_naming_both() {
        let (mut a, mut b) = Link::pair("a", "b");
        let mut newer = Frame::hello("a");
        newer.header.protocol = PROTOCOL_VERSION + 1;
        assert!(a.send(newer).await.is_ok());
        let refused = accept_handshake(&mut b, "b").await;
        let text = refused.map_err(|e| e.to_string()).err().unwrap_or_default();
        assert_eq!(text, "protocol version mismatch: `a` speaks 3, this node speaks 2");
        // `a` hears no hello, only the error naming both versions
        let error = a.recv_within(Duration::from_secs(5), "error").await;
        assert!(error.is_ok_and(|f| f.kind() == Some(FrameKind::Error) && f.header.text == text));
    }

    #[tokio::test]
    async fn a_hello_naming_another_node_is_refused_and_the_connector_hears_why() {
        let (mut a, mut b) = Link::pair("a", "b");
        let (ra, rb) = tokio::join!(connect_handshake(&mut a, "mallory"), accept_handshake(&mut b, "b"));
        assert!(
            matches!(rb, Err(TransportError::NameMismatch { ref cert, ref hello }) if cert == "a" && hello == "mallory")
        );
        assert!(
            matches!(ra, Err(TransportError::Refused { ref peer, ref reason }) if peer == "b" && reason.contains("mallory"))
        );
    }
}
