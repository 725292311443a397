//! QUIC links on loopback between endpoints holding certificates of one CA.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use brigade_proto::v1::{FrameKind, WireDtype};
use brigade_transport::frame::{encode, Decoder, Limits, MAGIC};
use brigade_transport::probe::{measure, unix_now_us, Responder};
use brigade_transport::quic::alpn;
use brigade_transport::tls::client_config;
use brigade_transport::{Frame, Identity, Link, QuicEndpoint, TransportError};
use bytes::{BufMut, BytesMut};
use common::{bounded, Cluster};
use prost::Message;
use quinn::crypto::rustls::QuicClientConfig;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn endpoint(identity: &Identity, ca_pem: &str) -> QuicEndpoint {
    match QuicEndpoint::bind(loopback(), identity, ca_pem) {
        Ok(endpoint) => endpoint,
        Err(e) => panic!("bind: {e}"),
    }
}

fn addr(endpoint: &QuicEndpoint) -> SocketAddr {
    match endpoint.local_addr() {
        Ok(addr) => addr,
        Err(e) => panic!("local_addr: {e}"),
    }
}

/// `a` connects to `b`; both links.
async fn linked(a: &QuicEndpoint, b: &QuicEndpoint) -> (Link, Link) {
    let (dialed, accepted) =
        bounded("connect and accept", async { tokio::join!(a.connect(addr(b), b.name()), b.accept()) }).await;
    match (dialed, accepted) {
        (Ok(dialed), Some(Ok(accepted))) => (dialed, accepted),
        (d, a) => panic!("link: {:?} / {:?}", d.err(), a.map(|r| r.err())),
    }
}

fn test_frames() -> Vec<Frame> {
    let one: Vec<f32> = (0..2048).map(|i| (i as f32).sin()).collect();
    let many: Vec<f32> = (0..512 * 2048).map(|i| (i % 977) as f32 * 0.25).collect();
    let frames = [
        Frame::hidden_f32(1, 7, 1, 2048, &one, WireDtype::F32),
        Frame::hidden_f32(0, 0, 512, 2048, &many, WireDtype::F32),
        Frame::hidden_f32(2, 8, 1, 2048, &one, WireDtype::Bf16),
    ];
    let mut out: Vec<Frame> = frames
        .into_iter()
        .map(|f| match f {
            Ok(f) => f.in_session("llama", 3, 99),
            Err(e) => panic!("frame: {e}"),
        })
        .collect();
    out.push(Frame::tokens(0, 0, &[1, 15043, 3186, 128_000]).in_session("llama", 3, 99));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_round_trip_both_ways() {
    let cluster = Cluster::new("test");
    let a = endpoint(&cluster.node("alpha"), cluster.ca_pem());
    let b = endpoint(&cluster.node("beta"), cluster.ca_pem());
    let (mut ab, mut ba) = linked(&a, &b).await;
    assert_eq!(ab.peer, "beta");
    assert_eq!(ba.peer, "alpha");
    for frame in test_frames() {
        bounded("send", ab.send(frame.clone())).await.ok();
        let got = bounded("receive", ba.recv()).await;
        assert_eq!(got.as_ref(), Some(&frame));
        bounded("send back", ba.send(frame.clone())).await.ok();
        let back = bounded("receive back", ab.recv()).await;
        assert_eq!(back, Some(frame));
    }
    // the payload survives as values
    let tokens = test_frames().pop().map(|f| f.token_ids());
    assert_eq!(tokens, Some(Ok(vec![1, 15043, 3186, 128_000])));

    // dropping one end closes the other
    drop(ab);
    assert_eq!(bounded("close", ba.recv()).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_another_ca_is_refused_both_ways() {
    let ours = Cluster::new("ours");
    let theirs = Cluster::new("theirs");
    let beta = endpoint(&ours.node("beta"), ours.ca_pem());
    // an intruder whose certificate another CA issued dials us (trusting our CA)
    let intruder = endpoint(&theirs.node("alpha"), ours.ca_pem());
    let (dialed, accepted) =
        bounded("intruder dials", async { tokio::join!(intruder.connect(addr(&beta), "beta"), beta.accept()) }).await;
    assert!(dialed.is_err(), "intruder got a link");
    assert!(matches!(accepted, Some(Err(_))), "beta accepted the intruder");

    // we dial an impostor whose certificate another CA issued
    let alpha = endpoint(&ours.node("alpha"), ours.ca_pem());
    let impostor = endpoint(&theirs.node("beta"), theirs.ca_pem());
    let (dialed, accepted) =
        bounded("dial the impostor", async { tokio::join!(alpha.connect(addr(&impostor), "beta"), impostor.accept()) })
            .await;
    let dialed = dialed.map(|_| ()).map_err(|e| e.to_string());
    assert!(dialed.as_ref().is_err_and(|e| e.contains("certificate")), "{dialed:?}");
    assert!(matches!(accepted, Some(Err(_))));

    // and a node of our CA that is not the one asked for
    let (dialed, _accepted) =
        bounded("dial the wrong node", async { tokio::join!(alpha.connect(addr(&beta), "gamma"), beta.accept()) })
            .await;
    assert!(dialed.is_err());
}

/// A quinn client endpoint holding `identity`, below the Link layer.
fn raw_client(identity: &Identity, ca_pem: &str) -> quinn::Endpoint {
    let mut tls = match client_config(identity, ca_pem) {
        Ok(tls) => tls,
        Err(e) => panic!("client config: {e}"),
    };
    tls.alpn_protocols = vec![alpn()];
    let Ok(quic_tls) = QuicClientConfig::try_from(tls) else {
        panic!("quic client config");
    };
    let Ok(mut client) = quinn::Endpoint::client(loopback()) else {
        panic!("client endpoint");
    };
    client.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic_tls)));
    client
}

/// A raw quinn client holding `identity`: the stream to `server`, below the Link layer.
async fn raw_stream(
    identity: &Identity,
    ca_pem: &str,
    server: SocketAddr,
    server_name: &str,
) -> (quinn::Endpoint, quinn::Connection, quinn::SendStream, quinn::RecvStream) {
    let client = raw_client(identity, ca_pem);
    let conn = match client.connect(server, &format!("{server_name}.node.brigade")) {
        Ok(connecting) => bounded("raw connect", connecting).await,
        Err(e) => panic!("connect: {e}"),
    };
    let Ok(conn) = conn else {
        panic!("raw connect failed");
    };
    let Ok((send, recv)) = bounded("open stream", conn.open_bi()).await else {
        panic!("open stream");
    };
    (client, conn, send, recv)
}

async fn write_frame(send: &mut quinn::SendStream, frame: &Frame) {
    let mut buf = BytesMut::new();
    assert_eq!(encode(frame, &mut buf), Ok(()));
    assert!(send.write_all(&buf).await.is_ok());
}

async fn read_frame(recv: &mut quinn::RecvStream, decoder: &mut Decoder) -> Option<Frame> {
    loop {
        if let Ok(Some(frame)) = decoder.poll() {
            return Some(frame);
        }
        let chunk = bounded("raw read", recv.read_chunk(1 << 16, true)).await;
        match chunk {
            Ok(Some(chunk)) => decoder.push(&chunk.bytes),
            _ => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_of_another_protocol_version_is_refused_naming_both() {
    let cluster = Cluster::new("test");
    let alpha = cluster.node("alpha");
    let beta = endpoint(&cluster.node("beta"), cluster.ca_pem());
    let accepting = async { beta.accept().await };
    let dialing = async {
        let (_client, _conn, mut send, mut recv) = raw_stream(&alpha, cluster.ca_pem(), addr(&beta), "beta").await;
        let mut hello = Frame::hello("alpha");
        hello.header.protocol = 1;
        write_frame(&mut send, &hello).await;
        let mut decoder = Decoder::new(Limits::default());
        read_frame(&mut recv, &mut decoder).await
    };
    let (accepted, answer) = bounded("version mismatch", async { tokio::join!(accepting, dialing) }).await;
    let accepted = accepted.map(|r| r.map(|_| ()).map_err(|e| e.to_string()));
    assert_eq!(accepted, Some(Err("protocol version mismatch: `alpha` speaks 1, this node speaks 2".to_owned())));
    let answer = answer.map(|f| (f.kind(), f.header.text));
    assert_eq!(
        answer,
        Some((Some(FrameKind::Error), "protocol version mismatch: `alpha` speaks 1, this node speaks 2".to_owned()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_whose_lengths_lie_drops_the_link_with_the_error() {
    let cluster = Cluster::new("test");
    let alpha = cluster.node("alpha");
    let beta = endpoint(&cluster.node("beta"), cluster.ca_pem());
    let accepting = async { beta.accept().await };
    let dialing = async {
        let (client, conn, mut send, mut recv) = raw_stream(&alpha, cluster.ca_pem(), addr(&beta), "beta").await;
        write_frame(&mut send, &Frame::hello("alpha")).await;
        let mut decoder = Decoder::new(Limits::default());
        let hello = read_frame(&mut recv, &mut decoder).await;
        assert_eq!(hello.and_then(|f| f.kind()), Some(FrameKind::Hello));
        (client, conn, send)
    };
    let (accepted, (_client, conn, mut send)) = bounded("handshake", async { tokio::join!(accepting, dialing) }).await;
    let Some(Ok(mut link)) = accepted else {
        panic!("accept failed");
    };
    // a HIDDEN frame of shape [1, 2048] f32 whose payload_len says 100
    let mut lying = Frame::tokens(0, 0, &[]);
    lying.header.kind = FrameKind::Hidden as i32;
    lying.header.dtype = WireDtype::F32 as i32;
    lying.header.rows = 1;
    lying.header.shape = vec![1, 2048];
    lying.header.payload_len = 100;
    let mut raw = BytesMut::new();
    raw.put_slice(&MAGIC);
    raw.put_u32_le(lying.header.encoded_len() as u32);
    assert!(lying.header.encode(&mut raw).is_ok());
    raw.put_slice(&[0u8; 100]);
    assert!(send.write_all(&raw).await.is_ok());

    assert_eq!(bounded("link drops", link.recv()).await, None);
    let reason = bounded("connection closes", conn.closed()).await.to_string();
    assert!(reason.contains("payload_len 100") && reason.contains("8192"), "close reason: {reason}");
    assert!(matches!(link.send(Frame::close()).await, Err(TransportError::Closed { .. }) | Ok(())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_returns_plausible_numbers_on_loopback() {
    let cluster = Cluster::new("test");
    let a = endpoint(&cluster.node("alpha"), cluster.ca_pem());
    let b = endpoint(&cluster.node("beta"), cluster.ca_pem());
    let (mut ab, mut ba) = linked(&a, &b).await;
    let responder = tokio::spawn(async move {
        let mut responder = Responder::default();
        while let Some(frame) = ba.recv().await {
            if let Some(reply) = responder.respond(&frame, unix_now_us()) {
                if ba.send(reply).await.is_err() {
                    break;
                }
            }
        }
    });
    let figures = bounded("measure", measure(&mut ab)).await;
    let Ok(figures) = figures else {
        panic!("measure: {figures:?}");
    };
    assert!(figures.latency_s > 0.0 && figures.latency_s < 0.05, "{figures:?}");
    assert!(figures.bandwidth_bps > 10e6, "{figures:?}");
    assert!(figures.clock_offset_us.abs() < 50_000, "{figures:?}");
    drop(ab);
    assert!(bounded("responder ends", responder).await.is_ok());
}

/// A frame whose header outgrows the limit (a trace list appended to by a hostile or broken
/// peer) is refused to its sender, and the link goes on carrying the other sessions' frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_header_fails_its_frame_and_never_the_link() {
    use brigade_proto::v1::StageTrace;
    let cluster = Cluster::new("test");
    let a = endpoint(&cluster.node("alpha"), cluster.ca_pem());
    let b = endpoint(&cluster.node("beta"), cluster.ca_pem());
    let (ab, mut ba) = linked(&a, &b).await;
    let mut bomb = Frame::tokens(0, 0, &[1, 2, 3]).in_session("llama", 3, 7);
    for i in 0..400 {
        bomb = bomb.with_trace(StageTrace { stage: i, received_us: u64::MAX, sent_us: u64::MAX, compute_us: u64::MAX });
    }
    match bounded("send the bomb", ab.send(bomb)).await {
        Err(TransportError::Frame(e)) => assert!(e.to_string().contains("4096"), "{e}"),
        other => panic!("an oversized header was sent: {other:?}"),
    }
    let good = Frame::tokens(0, 0, &[4, 5]).in_session("llama", 3, 8);
    bounded("send after it", ab.send(good.clone())).await.ok();
    assert_eq!(bounded("receive after it", ba.recv()).await, Some(good));
}

/// The first datagram a real QUIC client sends: an Initial carrying a ClientHello, caught on a
/// plain UDP socket so it can be replayed by a sender that never answers.
async fn caught_initial(identity: &Identity, ca_pem: &str) -> Vec<u8> {
    let Ok(catcher) = tokio::net::UdpSocket::bind(loopback()).await else {
        panic!("bind a catcher");
    };
    let Ok(target) = catcher.local_addr() else {
        panic!("catcher address");
    };
    let client = raw_client(identity, ca_pem);
    let Ok(connecting) = client.connect(target, "beta.node.brigade") else {
        panic!("connect");
    };
    let mut buf = vec![0u8; 2048];
    let Ok((n, _)) = bounded("catch an initial", catcher.recv_from(&mut buf)).await else {
        panic!("recv");
    };
    drop(connecting);
    client.close(0u32.into(), b"");
    buf.truncate(n);
    buf
}

/// Strangers that start a handshake and go silent: sixteen raw Initials (no certificate behind
/// them, each from its own port) and two certified peers that finish TLS but never open their
/// stream. Before accepting ran handshakes concurrently, each of them held the one accept loop
/// for up to the 6 s idle timeout (10 s for the certified ones), so a real stage link waited
/// minutes. Bound: the real link opens within 3 s while all eighteen are still in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_never_hold_up_a_real_link() {
    let cluster = Cluster::new("test");
    let alpha_id = cluster.node("alpha");
    let beta = Arc::new(endpoint(&cluster.node("beta"), cluster.ca_pem()));
    let alpha = endpoint(&alpha_id, cluster.ca_pem());
    let (links_tx, mut links_rx) = tokio::sync::mpsc::channel(4);
    let acceptor = {
        let beta = beta.clone();
        tokio::spawn(async move {
            while let Some(attempt) = beta.accept().await {
                if let Ok(link) = attempt {
                    if links_tx.send(link).await.is_err() {
                        break;
                    }
                }
            }
        })
    };

    let mut silent = Vec::new();
    for _ in 0..16 {
        let initial = caught_initial(&alpha_id, cluster.ca_pem()).await;
        let Ok(socket) = tokio::net::UdpSocket::bind(loopback()).await else {
            panic!("bind a stranger");
        };
        assert!(socket.send_to(&initial, addr(&beta)).await.is_ok());
        silent.push(socket);
    }
    let mut certified = Vec::new();
    for _ in 0..2 {
        let client = raw_client(&alpha_id, cluster.ca_pem());
        let Ok(connecting) = client.connect(addr(&beta), "beta.node.brigade") else {
            panic!("connect");
        };
        let conn = bounded("a certified staller connects", connecting).await;
        assert!(conn.is_ok(), "certified staller: {:?}", conn.err());
        certified.push((client, conn));
    }

    let started = std::time::Instant::now();
    let dialed = bounded("the real link", alpha.connect(addr(&beta), "beta")).await;
    let accepted = bounded("the real link is accepted", links_rx.recv()).await;
    let took = started.elapsed();
    assert!(dialed.is_ok(), "dial: {:?}", dialed.err());
    assert!(accepted.is_some_and(|link| link.peer == "alpha"));
    assert!(took < std::time::Duration::from_secs(3), "the real link took {took:?} behind stalled handshakes");
    drop((silent, certified));
    beta.close();
    assert!(bounded("the acceptor ends", acceptor).await.is_ok());
}
