//! Raft messages between replicas: one queue and one task per peer, which keeps a gRPC channel
//! (mutual TLS with the coordinator's certificate) and sends each message as an opaque
//! `RaftEnvelope`. A message that cannot be sent is dropped: raft retransmits what matters.

use brigade_proto::v1::raft_client::RaftClient;
use brigade_proto::v1::RaftEnvelope;
use brigade_transport::Identity;
use protobuf::Message as _;
use raft::eraftpb::Message;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Messages queued to one peer before new ones are dropped.
const QUEUE: usize = 1024;

pub struct Peers {
    me: u64,
    identity: Identity,
    ca_pem: String,
    senders: Mutex<HashMap<u64, (String, mpsc::Sender<Message>)>>,
}

impl Peers {
    pub fn new(me: u64, identity: Identity, ca_pem: String) -> Arc<Peers> {
        Arc::new(Peers { me, identity, ca_pem, senders: Mutex::new(HashMap::new()) })
    }

    /// Sets the address of a peer (starting its sender, or restarting it on a new address).
    pub fn set(self: &Arc<Self>, id: u64, address: &str) {
        if id == self.me {
            return;
        }
        let mut m = match self.senders.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        if m.get(&id).is_some_and(|(a, _)| a == address) {
            return;
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        m.insert(id, (address.to_string(), tx));
        tokio::spawn(sender(self.clone(), id, address.to_string(), rx));
    }

    pub fn remove(&self, id: u64) {
        if let Ok(mut m) = self.senders.lock() {
            m.remove(&id);
        }
    }

    pub fn address(&self, id: u64) -> Option<String> {
        self.senders.lock().ok().and_then(|m| m.get(&id).map(|(a, _)| a.clone()))
    }

    pub fn send(&self, msgs: Vec<Message>) {
        let Ok(m) = self.senders.lock() else { return };
        for msg in msgs {
            match m.get(&msg.to) {
                Some((_, tx)) => {
                    if tx.try_send(msg).is_err() {
                        tracing::debug!("raft queue to a peer is full; a message was dropped");
                    }
                }
                None => tracing::debug!(to = msg.to, "raft message to an unknown peer"),
            }
        }
    }
}

async fn sender(peers: Arc<Peers>, id: u64, address: String, mut rx: mpsc::Receiver<Message>) {
    let mut client: Option<
        RaftClient<tonic::codegen::InterceptedService<tonic::transport::Channel, brigade_proto::VersionInterceptor>>,
    > = None;
    let mut backoff = Duration::from_millis(50);
    while let Some(msg) = rx.recv().await {
        // this sender was replaced (address change) or removed
        if peers.address(id).as_deref() != Some(address.as_str()) {
            return;
        }
        if client.is_none() {
            match brigade_transport::grpc::coordinator_channel(
                &format!("https://{address}"),
                &peers.identity,
                &peers.ca_pem,
            )
            .await
            {
                Ok(ch) => {
                    client = Some(
                        RaftClient::with_interceptor(ch, brigade_proto::VersionInterceptor)
                            .max_decoding_message_size(256 << 20)
                            .max_encoding_message_size(256 << 20),
                    );
                    backoff = Duration::from_millis(50);
                }
                Err(e) => {
                    tracing::debug!("raft peer {id} at {address}: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    // drop what queued up while the peer was unreachable: raft resends
                    while rx.try_recv().is_ok() {}
                    continue;
                }
            }
        }
        let Ok(bytes) = msg.write_to_bytes() else { continue };
        let env = RaftEnvelope { protocol: brigade_proto::PROTOCOL_VERSION, from: peers.me, message: bytes };
        if let Some(c) = client.as_mut() {
            if let Err(e) = c.step(env).await {
                tracing::debug!("raft peer {id}: {}", e.message());
                client = None;
            }
        }
    }
}
