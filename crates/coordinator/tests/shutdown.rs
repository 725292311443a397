//! Shutdown ends the whole replica: one cancellation stops the gRPC server, the raft task, the
//! leader tasks and the HTTP API, and `run` returns only once the raft log is closed — so the
//! same data directory opens again in the same process (redb refuses a file still open).
#![allow(clippy::unwrap_used)]

use brigade_coordinator::{run, CoordinatorConfig};
use std::time::{Duration, Instant};

async fn wait_file(path: &std::path::Path) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if !s.trim().is_empty() {
                return s.trim().to_string();
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{} was not written within 20 s", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_every_task_and_the_data_dir_opens_again() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..2 {
        let http_file = dir.path().join("coordinator.http.addr");
        let _ = std::fs::remove_file(&http_file);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc = listener.local_addr().unwrap();
        let cfg = CoordinatorConfig {
            data_dir: dir.path().to_path_buf(),
            http: Some("127.0.0.1:0".parse().unwrap()),
            raft_tick: Duration::from_millis(20),
            ..Default::default()
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let replica = tokio::spawn(run(cfg, listener, async move {
            let _ = rx.await;
        }));
        let http = wait_file(&http_file).await;
        assert!(tokio::net::TcpStream::connect(&http).await.is_ok(), "round {round}: the HTTP API is not up");
        tx.send(()).unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(20), replica).await;
        let result = ended.unwrap_or_else(|_| panic!("round {round}: run did not return within 20 s of shutdown"));
        result.unwrap().unwrap_or_else(|e| panic!("round {round}: {e}"));
        // nothing listens any more: neither the gRPC port nor the HTTP API
        for addr in [grpc.to_string(), http] {
            let c = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(&addr)).await;
            assert!(!matches!(c, Ok(Ok(_))), "round {round}: {addr} still accepts after shutdown");
        }
    }
}
