//! How many MB/s of 512×2048-f32 HIDDEN frames (4 MiB each) QUIC and gRPC carry on loopback.
//! A measurement to read, not a test: `cargo run -p brigade-transport --example throughput`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use brigade_proto::v1::WireDtype;
use brigade_transport::grpc::{connect_grpc, server, stage_service};
use brigade_transport::{ClusterCa, Frame, Link, QuicEndpoint, Role};
use common::LinkStage;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::TcpListenerStream;

const RUN: Duration = Duration::from_secs(3);

/// Sends frames over `tx` for [`RUN`] while `rx` drains them; MB/s received.
async fn pump(tx: Link, mut rx: Link, frame: Frame) -> anyhow::Result<f64> {
    let bytes = frame.payload.len() as f64;
    let start = Instant::now();
    let sender = tokio::spawn(async move {
        let mut sent = 0u64;
        while start.elapsed() < RUN {
            if tx.send(frame.clone()).await.is_err() {
                break;
            }
            sent += 1;
        }
        sent
    });
    let mut received = 0u64;
    while received == 0 || start.elapsed() < RUN {
        match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
            Ok(Some(_)) => received += 1,
            _ => break,
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let sent = sender.await?;
    println!("  {received} of {sent} frames in {elapsed:.2} s");
    Ok(received as f64 * bytes / elapsed / 1e6)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let ca = ClusterCa::generate("bench")?;
    let alpha = ca.new_identity("alpha", Role::Node)?;
    let beta = ca.new_identity("beta", Role::Node)?;
    let values: Vec<f32> = (0..512 * 2048).map(|i| (i % 1000) as f32).collect();
    let frame = Frame::hidden_f32(0, 0, 512, 2048, &values, WireDtype::F32)?;
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));

    let a = QuicEndpoint::bind(loopback, &alpha, ca.cert_pem())?;
    let b = QuicEndpoint::bind(loopback, &beta, ca.cert_pem())?;
    let (dialed, accepted) = tokio::join!(a.connect(b.local_addr()?, "beta"), b.accept());
    let accepted = accepted.ok_or_else(|| anyhow!("endpoint closed"))??;
    println!("quic:");
    let quic = pump(dialed?, accepted, frame.clone()).await?;
    println!("  {quic:.0} MB/s");

    let listener = TcpListener::bind(loopback).await?;
    let uri = format!("https://{}", listener.local_addr()?);
    let (links_tx, mut links) = mpsc::channel(1);
    let router =
        server(&beta, ca.cert_pem())?.add_service(stage_service(LinkStage { name: "beta".into(), links: links_tx }));
    tokio::spawn(router.serve_with_incoming(TcpListenerStream::new(listener)));
    let dialed = connect_grpc(&uri, &alpha, ca.cert_pem(), "beta").await?;
    let accepted = links.recv().await.context("no grpc link")?;
    println!("grpc:");
    let grpc = pump(dialed, accepted, frame).await?;
    println!("  {grpc:.0} MB/s");
    Ok(())
}
