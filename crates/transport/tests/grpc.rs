//! Links over `Stage.Activations` on loopback, and the tonic TLS helpers.

mod common;

use std::net::SocketAddr;

use brigade_proto::v1::WireDtype;
use brigade_transport::grpc::{connect_grpc, coordinator_tls_config, join_channel, server, stage_service};
use brigade_transport::{Frame, Identity, Link};
use common::{bounded, Cluster, LinkStage};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::TcpListenerStream;

struct Serving {
    uri: String,
    links: mpsc::Receiver<Link>,
    _stop: oneshot::Sender<()>,
}

/// Serves `Stage` for `identity` on a loopback port; `optional_client_auth` as the coordinator.
async fn serve(identity: &Identity, ca_pem: &str, optional_client_auth: bool) -> Serving {
    let Ok(listener) = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await else {
        panic!("bind");
    };
    let Ok(addr) = listener.local_addr() else {
        panic!("local_addr");
    };
    let Ok(mut builder) = server(identity, ca_pem) else {
        panic!("server builder");
    };
    if optional_client_auth {
        let Ok(b) = builder.tls_config(coordinator_tls_config(identity, ca_pem)) else {
            panic!("coordinator tls");
        };
        builder = b;
    }
    let (links_tx, links) = mpsc::channel(4);
    let Ok(name) = identity.name() else {
        panic!("name");
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let router = builder.add_service(stage_service(LinkStage { name, links: links_tx }));
    tokio::spawn(router.serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
        let _ = stopped.await;
    }));
    Serving { uri: format!("https://{addr}"), links, _stop: stop }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_round_trip_both_ways_over_grpc() {
    let cluster = Cluster::new("test");
    let alpha = cluster.node("alpha");
    let mut beta = serve(&cluster.node("beta"), cluster.ca_pem(), false).await;
    let dialed = bounded("connect_grpc", connect_grpc(&beta.uri, &alpha, cluster.ca_pem(), "beta")).await;
    let mut ab = match dialed {
        Ok(link) => link,
        Err(e) => panic!("connect_grpc: {e}"),
    };
    let Some(mut ba) = bounded("accepted link", beta.links.recv()).await else {
        panic!("no link accepted");
    };
    assert_eq!(ab.peer, "beta");
    assert_eq!(ba.peer, "alpha", "the server reads the peer's name from its certificate");

    let one: Vec<f32> = (0..2048).map(|i| i as f32).collect();
    let many: Vec<f32> = (0..512 * 2048).map(|i| (i % 31) as f32).collect();
    let frames = [
        Frame::hidden_f32(1, 5, 1, 2048, &one, WireDtype::F32),
        Frame::hidden_f32(0, 0, 512, 2048, &many, WireDtype::F32),
        Frame::hidden_f32(1, 5, 1, 2048, &one, WireDtype::F16),
    ];
    let mut frames: Vec<Frame> = frames.into_iter().filter_map(Result::ok).collect();
    assert_eq!(frames.len(), 3);
    frames.push(Frame::tokens(0, 0, &[1, 2, 3]));
    for frame in frames {
        assert!(bounded("send", ab.send(frame.clone())).await.is_ok());
        assert_eq!(bounded("receive", ba.recv()).await.as_ref(), Some(&frame));
        assert!(bounded("send back", ba.send(frame.clone())).await.is_ok());
        assert_eq!(bounded("receive back", ab.recv()).await, Some(frame));
    }
    drop(ab);
    assert_eq!(bounded("close", ba.recv()).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_another_ca_is_refused_over_grpc() {
    let ours = Cluster::new("ours");
    let theirs = Cluster::new("theirs");
    let mut beta = serve(&ours.node("beta"), ours.ca_pem(), false).await;
    // a client whose certificate another CA issued, trusting our CA
    let intruder = theirs.node("alpha");
    let refused = bounded("intruder", connect_grpc(&beta.uri, &intruder, ours.ca_pem(), "beta")).await;
    // TLS 1.3: the client learns only that the server hung up on it
    assert!(refused.is_err());
    // a client of our CA that does not trust the server's CA
    let alpha = ours.node("alpha");
    let refused = bounded("wrong ca", connect_grpc(&beta.uri, &alpha, theirs.ca_pem(), "beta")).await;
    let refused = refused.map(|_| ()).map_err(|e| e.to_string());
    assert!(refused.as_ref().is_err_and(|e| e.contains("certificate")), "{refused:?}");
    // a server that is not the node asked for
    let refused = bounded("wrong name", connect_grpc(&beta.uri, &alpha, ours.ca_pem(), "gamma")).await;
    assert!(refused.is_err());
    assert!(beta.links.try_recv().is_err(), "no link was accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_join_channel_records_the_coordinators_certificate() {
    let cluster = Cluster::new("test");
    let Ok(coordinator) = cluster
        .ca
        .new_identity("coordinator", brigade_transport::Role::Coordinator { extra_sans: vec!["127.0.0.1".to_owned()] })
    else {
        panic!("coordinator identity");
    };
    let serving = serve(&coordinator, cluster.ca_pem(), true).await;
    let joined = bounded("join channel", join_channel(&serving.uri)).await;
    let Ok((_channel, verifier)) = joined else {
        panic!("join channel: {:?}", joined.err());
    };
    let leaf = coordinator.cert_chain().ok().and_then(|c| c.first().map(|l| l.to_vec()));
    assert!(leaf.is_some());
    assert_eq!(verifier.seen_leaf(), leaf);
}
