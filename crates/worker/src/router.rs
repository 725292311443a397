//! Where frames go. Every frame names its deployment and the stage it is for; the router hands it
//! to the stage hosted here, to the session's driver waiting here (frames for the stage after the
//! last), or over a link to the node that hosts it.
//!
//! Links to other nodes are made on first use, one per (peer, carrier), and re-made when they
//! break; a frame to this node itself never touches a socket. Links other nodes open to this one
//! are read the same way. Link-measurement frames (PING, BULK) are answered on the link they came
//! in on.
//!
//! Expert calls (EXPERTS frames, [`crate::experts`]) go to the expert stage they name, are
//! computed off the link's task and answered on the link they came in on; their answers go to
//! the call waiting for them here, by the call's id.

use crate::identity::Creds;
use crate::WorkerError;
use brigade_core::cluster::CarrierKind;
use brigade_model::MatMul;
use brigade_proto::v1::FrameKind;
use brigade_transport::frame::Frame;
use brigade_transport::Link;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;

/// Frames queued towards one peer before senders wait.
const QUEUE: usize = 4096;
/// How long a link is retried before the frames queued for it are dropped (their sessions fail).
const CONNECT_GIVE_UP: Duration = Duration::from_secs(10);

/// A node and the address its worker listens on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Peer {
    pub node: String,
    pub address: String,
}

type StageKey = (String, u32);

/// A stage hosted here: where its frames go, and the one node that may send them (the node of
/// the stage before, or the driver for the first stage).
struct HostedStage {
    input: crate::stage::StageInbox,
    from: String,
}

/// An expert stage hosted here: its experts, its generation and the nodes that may call it (the
/// nodes of its deployment's pipeline).
#[derive(Clone)]
struct HostedShard {
    shard: Arc<brigade_model::ExpertShard>,
    generation: u64,
    callers: Arc<Vec<String>>,
}

/// Where an expert call's answer goes: back on the link the call came in on, or to this node.
enum Reply {
    Link(mpsc::Sender<Frame>),
    Here,
}

/// Call ids have the top bit set. A session's id is random and may have it too: an ERROR frame
/// is an expert call's answer only when its id is that of a call waiting here.
const CALL_BIT: u64 = 1 << 63;

/// A session this node drives: where its frames go, and the nodes that may send them.
type DrivenSession = (mpsc::UnboundedSender<Frame>, Arc<Vec<String>>);

/// The certificate each admitted node holds now, by node (from the coordinator's Watch).
type AdmittedCerts = HashMap<String, String>;

pub struct Router {
    me: String,
    tls: Creds,
    quic: brigade_transport::quic::QuicEndpoint,
    /// By (node, address, carrier): a node that comes back on another address gets a new link.
    outbound: Mutex<HashMap<(String, String, CarrierKind), mpsc::Sender<Frame>>>,
    stages: RwLock<HashMap<StageKey, HostedStage>>,
    /// The sessions this node drives: where their frames go, and the nodes that may send them.
    drivers: Mutex<HashMap<u64, DrivenSession>>,
    shards: RwLock<HashMap<StageKey, HostedShard>>,
    /// Expert calls of this node's stages waiting for their answers, by call id: the node
    /// called (the only one whose answer is taken) and where the answer goes.
    calls: Mutex<HashMap<u64, (String, std::sync::mpsc::SyncSender<Frame>)>>,
    /// `None` until the coordinator first said (nothing is hosted before then either).
    admitted: RwLock<Option<AdmittedCerts>>,
    /// Bumped when `admitted` changes: open links look again.
    admitted_changed: tokio::sync::watch::Sender<u64>,
    rt: tokio::runtime::Handle,
}

impl Router {
    pub fn new(me: String, tls: Creds, quic: brigade_transport::quic::QuicEndpoint) -> Arc<Router> {
        Arc::new(Router {
            me,
            tls,
            quic,
            outbound: Mutex::new(HashMap::new()),
            stages: RwLock::new(HashMap::new()),
            drivers: Mutex::new(HashMap::new()),
            shards: RwLock::new(HashMap::new()),
            calls: Mutex::new(HashMap::new()),
            admitted: RwLock::new(None),
            admitted_changed: tokio::sync::watch::Sender::new(0),
            rt: tokio::runtime::Handle::current(),
        })
    }

    pub fn me(&self) -> &str {
        &self.me
    }

    pub fn quic(&self) -> &brigade_transport::quic::QuicEndpoint {
        &self.quic
    }

    /// Frames for stage `stage` of `deployment` go to `input` from now on, taken from the node
    /// `from` only.
    pub fn add_stage(&self, deployment: &str, stage: u32, input: crate::stage::StageInbox, from: &str) {
        if let Ok(mut m) = self.stages.write() {
            m.insert((deployment.to_string(), stage), HostedStage { input, from: from.to_string() });
        }
    }

    /// The certificates of the admitted nodes, as the coordinator says now; links from any other
    /// certificate (a revoked one) are closed.
    pub fn set_admitted(&self, certs: AdmittedCerts) {
        let mut current = self.admitted.write().unwrap_or_else(|p| p.into_inner());
        if current.as_ref() != Some(&certs) {
            *current = Some(certs);
            drop(current);
            self.admitted_changed.send_modify(|v| *v += 1);
        }
    }

    /// Whether `peer`, holding the certificate `fingerprint`, may speak to this node now. A link
    /// whose carrier does not know the certificate (a dialed gRPC link: the server was checked
    /// by name) is not refused.
    pub fn admits(&self, peer: &str, fingerprint: Option<&str>) -> bool {
        let admitted = self.admitted.read().unwrap_or_else(|p| p.into_inner());
        match (admitted.as_ref(), fingerprint) {
            (Some(certs), Some(fp)) => certs.get(peer).is_some_and(|held| held == fp),
            _ => true,
        }
    }

    pub fn remove_stage(&self, deployment: &str, stage: u32) {
        if let Ok(mut m) = self.stages.write() {
            m.remove(&(deployment.to_string(), stage));
        }
        if let Ok(mut m) = self.shards.write() {
            m.remove(&(deployment.to_string(), stage));
        }
    }

    /// Expert calls for stage `stage` of `deployment` (generation `generation`) are computed by
    /// `shard` from now on, taken from the nodes `callers` only.
    pub fn add_shard(
        &self,
        deployment: &str,
        stage: u32,
        generation: u64,
        shard: Arc<brigade_model::ExpertShard>,
        callers: Vec<String>,
    ) {
        if let Ok(mut m) = self.shards.write() {
            let hosted = HostedShard { shard, generation, callers: Arc::new(callers) };
            m.insert((deployment.to_string(), stage), hosted);
        }
    }

    /// A new expert call to `node`: its id (random, so that no other node can guess it), and
    /// where its answer (EXPERTS_OUT or ERROR), taken from `node` only, will arrive.
    pub fn new_call(&self, node: &str) -> (u64, std::sync::mpsc::Receiver<Frame>) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let mut id = CALL_BIT | rand::random::<u64>();
        if let Ok(mut m) = self.calls.lock() {
            while m.contains_key(&id) {
                id = CALL_BIT | rand::random::<u64>();
            }
            m.insert(id, (node.to_string(), tx));
        }
        (id, rx)
    }

    /// Forgets a call that gave up waiting (a late answer is dropped).
    pub fn forget_call(&self, id: u64) {
        if let Ok(mut m) = self.calls.lock() {
            m.remove(&id);
        }
    }

    /// Hands an expert call's answer from the node `from` to the call waiting for it (if it
    /// went to `from`); gives other frames back.
    fn answer_call(&self, frame: Frame, from: &str) -> Option<Frame> {
        let (id, kind) = (frame.header.session, frame.kind());
        if id & CALL_BIT == 0 || !matches!(kind, Some(FrameKind::ExpertsOut | FrameKind::Error)) {
            return Some(frame);
        }
        let waiting = self.calls.lock().ok().and_then(|mut m| match m.get(&id) {
            Some((node, _)) if node != from => Some(Err(node.clone())),
            Some(_) => m.remove(&id).map(|(_, tx)| Ok(tx)),
            None => None,
        });
        match (waiting, kind) {
            (Some(Ok(tx)), _) => {
                let _ = tx.try_send(frame);
                None
            }
            (Some(Err(node)), _) => {
                tracing::warn!(call = id, "an answer to an expert call to {node} came from {from}; dropped");
                None
            }
            // a session's error (its random id has the top bit)
            (None, Some(FrameKind::Error)) => Some(frame),
            (None, _) => {
                tracing::debug!(call = id, "an answer to an expert call nobody waits for; dropped");
                None
            }
        }
    }

    /// Computes an EXPERTS frame from `from` on the expert stage it names, off the caller's task,
    /// and answers it (an ERROR frame when the call cannot be answered: the caller's pass fails,
    /// not this node).
    fn serve_experts(self: &Arc<Self>, frame: Frame, from: &str, reply: Reply) {
        let h = &frame.header;
        let key = (h.deployment.clone(), h.stage);
        let hosted = self.shards.read().ok().and_then(|m| m.get(&key).cloned());
        let shard = match hosted {
            None => Err(format!("no expert stage {} of `{}` here", key.1, key.0)),
            Some(s) if !s.callers.iter().any(|c| c == from) => {
                tracing::warn!(deployment = %key.0, stage = key.1, "an expert call from {from} dropped: not a stage of the deployment");
                return;
            }
            Some(s) if s.generation != h.generation => Err(format!(
                "expert stage {} of `{}` is at generation {}, the call is for {}",
                key.1, key.0, s.generation, h.generation
            )),
            Some(s) => Ok(s.shard),
        };
        let me = self.clone();
        self.rt.spawn_blocking(move || {
            let h = &frame.header;
            let out = shard.and_then(|shard| {
                let hidden = shard.hidden();
                let mm = if frame.has_flag(brigade_transport::frame::FLAG_ROWS) { MatMul::Rows } else { MatMul::Batch };
                let call = frame.expert_calls(hidden).map_err(|e| e.to_string())?;
                let ys = shard.compute(call.layer as usize, &call.calls, &call.rows, mm).map_err(|e| e.to_string())?;
                Frame::experts_out(h.rows, hidden as u64, &ys).map_err(|e| e.to_string())
            });
            let mut out = out.unwrap_or_else(|e| Frame::error(&e)).in_session(&h.deployment, h.generation, h.session);
            // no stage's: an ERROR answer that comes after its call gave up is dropped, never
            // taken for a session's
            out.header.stage = u32::MAX;
            match reply {
                Reply::Link(tx) => {
                    if tx.blocking_send(out).is_err() {
                        tracing::debug!("the link an expert call came in on closed before its answer");
                    }
                }
                Reply::Here => me.deliver(out, &me.me),
            }
        });
    }

    /// A frame this node sends itself: an expert call is served here, anything else delivered.
    fn deliver_here(self: &Arc<Self>, frame: Frame) {
        if frame.kind() == Some(FrameKind::Experts) {
            self.serve_experts(frame, &self.me.clone(), Reply::Here);
        } else {
            self.deliver(frame, &self.me);
        }
    }

    /// Frames for the driver of `session`, from the nodes `senders` (the deployment's stages),
    /// arrive on the returned channel until [`Router::unregister_driver`].
    pub fn register_driver(&self, session: u64, senders: Arc<Vec<String>>) -> mpsc::UnboundedReceiver<Frame> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut m) = self.drivers.lock() {
            m.insert(session, (tx, senders));
        }
        rx
    }

    pub fn unregister_driver(&self, session: u64) {
        if let Ok(mut m) = self.drivers.lock() {
            m.remove(&session);
        }
    }

    /// Hands a frame that arrived from the node `from` (over a link, or this node) to whoever
    /// takes it here. A stage takes frames only from the node assigned to send them.
    pub fn deliver(&self, frame: Frame, from: &str) {
        let Some(frame) = self.answer_call(frame, from) else { return };
        let Some(item) = self.to_stage(frame.into(), from) else { return };
        let frame = item.frame;
        let h = &frame.header;
        let session = h.session;
        let driver = self.drivers.lock().ok().and_then(|m| m.get(&session).cloned());
        match driver {
            Some((_, senders)) if !senders.iter().any(|n| n == from) => {
                tracing::warn!(session, "a frame from {from} dropped: only the deployment's stages send to its driver")
            }
            Some((tx, _)) => {
                let _ = tx.send(frame);
            }
            None => tracing::debug!(
                deployment = %h.deployment,
                stage = h.stage,
                session,
                kind = h.kind,
                "frame for nothing hosted here; dropped"
            ),
        }
    }

    /// Hands rows computed by a stage of this node to the next stage, hosted here too (the hop
    /// inside one node: no socket, no bytes): the same gate as a frame from a link, with this
    /// node as the sender.
    pub fn hand_over(&self, item: crate::stage::Inbound) {
        if let Some(item) = self.to_stage(item, &self.me) {
            let h = &item.frame.header;
            tracing::debug!(deployment = %h.deployment, stage = h.stage, "rows for a stage not hosted here; dropped");
        }
    }

    /// Offers `item` from `from` to the stage it is addressed to, if that stage is hosted here
    /// (dropped, logged, unless `from` is the stage's assigned sender and its input takes it);
    /// gives `item` back when no such stage is hosted here.
    fn to_stage(&self, item: crate::stage::Inbound, from: &str) -> Option<crate::stage::Inbound> {
        let h = &item.frame.header;
        let key = (h.deployment.clone(), h.stage);
        let stage = self.stages.read().ok().and_then(|m| m.get(&key).map(|s| (s.input.clone(), s.from.clone())));
        let Some((input, sender)) = stage else { return Some(item) };
        if sender != from {
            tracing::warn!(deployment = %key.0, stage = key.1, "a frame from {from} dropped: only {sender} sends to this stage");
            return None;
        }
        match input.offer(item) {
            Ok(()) => {}
            Err(crate::stage::InputRefused::Stopped) => {
                tracing::debug!(deployment = %key.0, stage = key.1, "frame for a stage that just stopped")
            }
            // its session fails (its driver times out): the stage is far behind its sender
            Err(full) => tracing::warn!(deployment = %key.0, stage = key.1, "a frame from {from} dropped: {full}"),
        }
        None
    }

    fn queue(self: &Arc<Self>, peer: &Peer, carrier: CarrierKind) -> mpsc::Sender<Frame> {
        let mut m = match self.outbound.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        let key = (peer.node.clone(), peer.address.clone(), carrier);
        if let Some(tx) = m.get(&key) {
            if !tx.is_closed() {
                return tx.clone();
            }
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        m.insert(key, tx.clone());
        let me = self.clone();
        let peer = peer.clone();
        self.rt.spawn(async move { me.outbound_task(peer, carrier, rx).await });
        tx
    }

    /// Sends from a plain thread (a stage's compute thread): waits while the peer's queue is full.
    pub fn send_blocking(self: &Arc<Self>, to: &Peer, carrier: CarrierKind, frame: Frame) -> Result<(), WorkerError> {
        check(&frame)?;
        if to.node == self.me {
            self.deliver_here(frame);
            return Ok(());
        }
        self.queue(to, carrier)
            .blocking_send(frame)
            .map_err(|_| WorkerError::Link(format!("the link to {} is closed", to.node)))
    }

    /// Sends from async code.
    pub async fn send(self: &Arc<Self>, to: &Peer, carrier: CarrierKind, frame: Frame) -> Result<(), WorkerError> {
        check(&frame)?;
        if to.node == self.me {
            self.deliver_here(frame);
            return Ok(());
        }
        self.queue(to, carrier)
            .send(frame)
            .await
            .map_err(|_| WorkerError::Link(format!("the link to {} is closed", to.node)))
    }

    /// Opens a link to `peer` with the given carrier.
    pub async fn connect(&self, peer: &Peer, carrier: CarrierKind) -> Result<Link, WorkerError> {
        let addr = peer.address.clone();
        match carrier {
            CarrierKind::Quic => {
                let sa = tokio::net::lookup_host(&addr)
                    .await
                    .map_err(|e| WorkerError::Link(format!("{}: cannot resolve {addr}: {e}", peer.node)))?
                    .next()
                    .ok_or_else(|| WorkerError::Link(format!("{}: {addr} resolves to nothing", peer.node)))?;
                self.quic.connect(sa, &peer.node).await.map_err(|e| WorkerError::Link(format!("{}: {e}", peer.node)))
            }
            CarrierKind::Grpc => brigade_transport::grpc::connect_grpc(
                &format!("https://{addr}"),
                &self.tls.identity,
                &self.tls.ca_pem,
                &peer.node,
            )
            .await
            .map_err(|e| WorkerError::Link(format!("{} (grpc): {e}", peer.node))),
        }
    }

    async fn outbound_task(self: Arc<Self>, peer: Peer, carrier: CarrierKind, mut rx: mpsc::Receiver<Frame>) {
        let mut pending: Option<Frame> = None;
        'outer: loop {
            let started = tokio::time::Instant::now();
            let mut delay = Duration::from_millis(50);
            let link = loop {
                match self.connect(&peer, carrier).await {
                    Ok(l) => break l,
                    Err(e) if started.elapsed() > CONNECT_GIVE_UP => {
                        tracing::warn!("giving up on {} after {:?}: {e}", peer.node, started.elapsed());
                        break 'outer;
                    }
                    Err(e) => {
                        tracing::debug!("connecting to {}: {e}", peer.node);
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(1));
                    }
                }
            };
            let Link { tx, rx: link_rx, peer: named, fingerprint } = link;
            let reader = tokio::spawn(self.clone().read_link(named, fingerprint, link_rx, tx.clone()));
            loop {
                let frame = match pending.take() {
                    Some(f) => f,
                    None => match rx.recv().await {
                        Some(f) => f,
                        None => {
                            reader.abort();
                            return;
                        }
                    },
                };
                if let Err(e) = tx.send(frame).await {
                    tracing::warn!("link to {} broke; reconnecting", peer.node);
                    pending = Some(e.0);
                    reader.abort();
                    continue 'outer;
                }
            }
        }
        // the peer is gone: drop what was queued; the sessions concerned time out at their drivers
        if let Ok(mut m) = self.outbound.lock() {
            m.remove(&(peer.node.clone(), peer.address.clone(), carrier));
        }
        rx.close();
    }

    /// Reads a link from `peer` (holding the certificate `fingerprint`) until it closes, or
    /// until that certificate is no longer the one `peer` was admitted with: measurement frames
    /// are answered on it, the rest delivered.
    pub async fn read_link(
        self: Arc<Self>,
        peer: String,
        fingerprint: Option<String>,
        mut rx: mpsc::Receiver<Frame>,
        tx: mpsc::Sender<Frame>,
    ) {
        let mut responder = brigade_transport::Responder::default();
        let mut changed = self.admitted_changed.subscribe();
        loop {
            if !self.admits(&peer, fingerprint.as_deref()) {
                tracing::warn!("closing the link from {peer}: its certificate is not the one it was admitted with");
                return;
            }
            let frame = tokio::select! {
                frame = rx.recv() => frame,
                r = changed.changed() => {
                    if r.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let Some(frame) = frame else { return };
            let kind = FrameKind::try_from(frame.header.kind).unwrap_or(FrameKind::Unspecified);
            match kind {
                FrameKind::Ping | FrameKind::Bulk => {
                    if let Some(reply) = responder.respond(&frame, brigade_transport::probe::unix_now_us()) {
                        if tx.send(reply).await.is_err() {
                            return;
                        }
                    }
                }
                FrameKind::Experts => self.serve_experts(frame, &peer, Reply::Link(tx.clone())),
                FrameKind::Hello | FrameKind::Pong | FrameKind::Unspecified => {}
                _ => self.deliver(frame, &peer),
            }
        }
    }

    /// Measures the link to `peer` over QUIC on a link of its own.
    pub async fn measure(&self, peer: &Peer) -> Result<brigade_transport::probe::LinkFigures, WorkerError> {
        let mut link = self.connect(peer, CarrierKind::Quic).await?;
        brigade_transport::probe::measure(&mut link).await.map_err(|e| WorkerError::Link(format!("{}: {e}", peer.node)))
    }
}

/// A frame that cannot be encoded fails its sender (its session), before it reaches the queue of
/// a link other sessions share.
fn check(frame: &Frame) -> Result<(), WorkerError> {
    brigade_transport::frame::check_encodable(frame)
        .map(|_| ())
        .map_err(|e| WorkerError::Frame(format!("session {}: cannot send this frame: {e}", frame.header.session)))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn router(me: &str) -> (Arc<Router>, brigade_transport::ClusterCa) {
        let ca = brigade_transport::ClusterCa::generate("test").unwrap();
        let identity = ca.new_identity(me, brigade_transport::Role::Node).unwrap();
        let quic =
            brigade_transport::QuicEndpoint::bind("127.0.0.1:0".parse().unwrap(), &identity, ca.cert_pem()).unwrap();
        let tls = Creds { identity, ca_pem: ca.cert_pem().to_string() };
        (Router::new(me.to_string(), tls, quic), ca)
    }

    /// The experts `ids` of both layers of a random-weight Mixtral-shaped model (hidden 64, 4
    /// experts, 2 per token) written in `dir`.
    pub(crate) fn tiny_shard(dir: &std::path::Path, ids: std::ops::Range<u32>) -> Arc<brigade_model::ExpertShard> {
        use brigade_model::synth::{write_gguf_with, Shape, SynthMoe, SynthMoeFamily, SynthType};
        let path = dir.join("moe.gguf");
        let shape =
            Shape { layers: 2, hidden: 64, ffn: 32, heads: 2, kv_heads: 1, vocab: 300, context: 64, rope_theta: 1e4 };
        let moe = SynthMoe { experts: 4, used: 2, family: SynthMoeFamily::Mixtral };
        write_gguf_with(&path, &shape, Some(moe), SynthType::Q8_0, 1, |_, _| {}).unwrap();
        let files = brigade_model::ModelFiles::open(&path).unwrap();
        let layers = brigade_core::LayerRange::new(0, 2).unwrap();
        Arc::new(brigade_model::ExpertShard::load(&files, layers, ids).unwrap())
    }

    fn frame(stage: u32, session: u64) -> Frame {
        let mut f = Frame::tokens(0, 0, &[1]).in_session("d", 1, session);
        f.header.stage = stage;
        f
    }

    #[tokio::test]
    async fn frames_reach_a_stage_or_a_driver_only_from_their_assigned_senders() {
        let (r, _) = router("w1");
        let (input, queue) = crate::stage::stage_queue(1 << 20);
        r.add_stage("d", 1, input, "w0");
        r.deliver(frame(1, 7), "w2");
        assert!(queue.try_recv().is_err(), "a frame from a node that is not the stage before");
        r.deliver(frame(1, 7), "w0");
        assert!(queue.try_recv().is_ok());

        let mut driven = r.register_driver(9, Arc::new(vec!["w0".into(), "w1".into()]));
        r.deliver(frame(2, 9), "w5");
        assert!(driven.try_recv().is_err(), "a frame from a node outside the deployment");
        r.deliver(frame(2, 9), "w1");
        assert!(driven.try_recv().is_ok());
        // a session whose random id has the top bit of expert calls' ids: its ERROR still
        // reaches its driver; an expert call's answer reaches its call
        let high = CALL_BIT | 12345;
        let mut driven = r.register_driver(high, Arc::new(vec!["w1".into()]));
        r.deliver(Frame::error("a stage failed").in_session("d", 1, high), "w1");
        assert_eq!(driven.try_recv().unwrap().header.text, "a stage failed");
        let (call, answer) = r.new_call("w1");
        assert!(call & CALL_BIT != 0);
        // an answer from any node but the one called is dropped, and the call still waits
        r.deliver(Frame::error("made up").in_session("d", 1, call), "w5");
        assert!(answer.try_recv().is_err(), "an answer from a node not called");
        r.deliver(Frame::error("no such expert").in_session("d", 1, call), "w1");
        assert_eq!(answer.try_recv().unwrap().header.text, "no such expert");
    }

    #[tokio::test]
    async fn only_the_admitted_certificate_of_a_node_is_admitted() {
        let (r, _) = router("w1");
        // nothing heard from the coordinator yet: no opinion
        assert!(r.admits("w2", Some("aa")));
        r.set_admitted(HashMap::from([("w2".to_string(), "aa".to_string())]));
        assert!(r.admits("w2", Some("aa")));
        assert!(!r.admits("w2", Some("bb")), "a replaced certificate");
        assert!(!r.admits("w3", Some("cc")), "a node that never joined");
        // a dialed gRPC link, whose server was checked by name only
        assert!(r.admits("w3", None));
    }

    /// An expert stage answers the deployment's nodes (the experts' outputs, or an ERROR naming
    /// what is wrong: another generation, a malformed call, an expert it does not hold), and
    /// drops calls from any other node.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_expert_stage_answers_its_deployment_and_refuses_what_it_cannot() {
        let dir = tempfile::tempdir().unwrap();
        let shard = tiny_shard(dir.path(), 1..3);
        let (r, _) = router("w2");
        r.add_shard("d", 3, 7, shard.clone(), vec!["w2".into()]);
        let row: Vec<f32> = (0..64).map(|i| i as f32 / 64.0).collect();
        let (r2, row2) = (r.clone(), row.clone());
        let call = move |generation: u64, stage: u32, experts: &[(u32, usize)], edit: fn(&mut Frame)| {
            let (r, row) = (&r2, &row2);
            let mut f = Frame::experts(1, experts, row, 64, true).unwrap();
            let (id, rx) = r.new_call("w2");
            f = f.in_session("d", generation, id);
            f.header.stage = stage;
            edit(&mut f);
            r.send_blocking(&Peer { node: "w2".into(), address: String::new() }, CarrierKind::Quic, f).unwrap();
            rx.recv_timeout(Duration::from_secs(10))
        };
        let row2 = row.clone();
        tokio::task::spawn_blocking(move || {
            let row = row2;
            let ok = call(7, 3, &[(2, 1)], |_| {}).unwrap();
            let want = shard.compute(1, &[(2, 1)], &row, brigade_model::MatMul::Rows).unwrap();
            assert_eq!(ok.expert_outputs(64).unwrap(), want);
            let text = |f: Frame| {
                assert_eq!(f.kind(), Some(FrameKind::Error));
                f.header.text
            };
            assert!(text(call(6, 3, &[(2, 1)], |_| {}).unwrap()).contains("generation 7, the call is for 6"));
            assert!(text(call(7, 4, &[(2, 1)], |_| {}).unwrap()).contains("no expert stage 4"));
            assert!(text(call(7, 3, &[(3, 1)], |_| {}).unwrap()).contains("expert 3"));
            let bad_pairs = call(7, 3, &[(2, 1)], |f| f.header.expert_rows.push(9)).unwrap();
            assert!(text(bad_pairs).contains("expert_rows"));
        })
        .await
        .unwrap();
        // a node outside the deployment gets no answer at all
        let mut f = Frame::experts(1, &[(2, 1)], &row, 64, true).unwrap();
        let (id, rx) = r.new_call("w9");
        f = f.in_session("d", 7, id);
        f.header.stage = 3;
        r.serve_experts(f, "w9", Reply::Here);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(rx.try_recv().is_err());
    }
}
