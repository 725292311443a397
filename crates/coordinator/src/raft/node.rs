//! The task that drives a replica's raft ([`Replica`], sans IO) in production. Every interaction
//! is a message on its channel; the task ticks the replica from a tokio interval, steps messages
//! from peers, makes requests, and carries out the effects of each `ready`: gRPC sends, answers
//! to the callers waiting on them, the published status.

use super::replica::{Answer, Effect, Replica, Ticket};
use super::storage::AppliedState;
use super::transport::Peers;
use crate::CoordError;
use brigade_core::cluster::{Applied, ClusterState, Command};
use raft::eraftpb::{ConfChangeType, Message};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

/// How long a proposal may take to commit before its caller gets an error.
const PROPOSE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct RaftOptions {
    pub id: u64,
    /// The replicas to bootstrap a fresh group with (`id → address`), this one included; empty
    /// for a replica that joins a running group.
    pub peers: BTreeMap<u64, String>,
    /// Addresses of replicas known from the command line or a join (the log's configuration
    /// decides who votes; this only says where to send).
    pub known: BTreeMap<u64, String>,
    pub data_dir: PathBuf,
    /// One raft tick; elections take 10–20 ticks, heartbeats 2.
    pub tick: Duration,
    /// Bootstrap a new log even where [`INITIALISED_FILE`] says this data dir held one.
    pub force_new_cluster: bool,
}

/// Written beside the CA once this data dir's raft log holds something: a later start that
/// finds the log empty or gone refuses to begin a new cluster (which would lose every
/// deployment, and in a group could vote twice in a term) unless told `--force-new-cluster`.
pub const INITIALISED_FILE: &str = "initialised";

/// What the raft node says about itself and (as leader) the others.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RaftStatusView {
    pub id: u64,
    pub role: String,
    pub term: u64,
    pub leader: u64,
    pub commit: u64,
    pub applied: u64,
    /// Leader only: (replica, match index, progress state).
    pub progress: Vec<(u64, u64, String)>,
    pub voters: Vec<u64>,
    /// Replicas that receive the log but do not vote yet (joined, not caught up).
    pub learners: Vec<u64>,
}

enum Req {
    /// (boxed: a command carries a model's profile, far larger than the other requests)
    Propose(Box<Command>, oneshot::Sender<Result<Applied, CoordError>>),
    Read(oneshot::Sender<Result<(), CoordError>>),
    Conf(ConfChangeType, u64, String, oneshot::Sender<Result<(), CoordError>>),
    Step(Message),
}

/// A replica's handle on its raft node (cheap to clone).
#[derive(Clone)]
pub struct RaftHandle {
    tx: mpsc::Sender<Req>,
    applied: AppliedState,
    status: watch::Receiver<RaftStatusView>,
    changed: watch::Receiver<u64>,
    peers: Arc<Peers>,
}

impl RaftHandle {
    /// The applied state (possibly behind the leader's; see [`RaftHandle::read_barrier`]): the
    /// published value itself, shared, not a copy. It does not change under the caller; a later
    /// call sees later commands.
    pub fn state(&self) -> Arc<ClusterState> {
        match self.applied.read() {
            Ok(a) => a.1.clone(),
            Err(p) => p.into_inner().1.clone(),
        }
    }

    pub fn status(&self) -> RaftStatusView {
        self.status.borrow().clone()
    }

    pub fn is_leader(&self) -> bool {
        self.status.borrow().role == "leader"
    }

    /// The leader's id and address, when one is known.
    pub fn leader(&self) -> Option<(u64, String)> {
        let s = self.status.borrow().clone();
        if s.leader == 0 {
            return None;
        }
        let addr =
            if s.leader == s.id { self.state().replicas.get(&s.id).cloned() } else { self.peers.address(s.leader) };
        addr.or_else(|| self.state().replicas.get(&s.leader).cloned()).map(|a| (s.leader, a))
    }

    /// Wakes on every applied change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.clone()
    }

    pub fn status_watch(&self) -> watch::Receiver<RaftStatusView> {
        self.status.clone()
    }

    /// Proposes a command; the result once it is committed and applied on this replica.
    pub async fn propose(&self, cmd: Command) -> Result<Applied, CoordError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Req::Propose(Box::new(cmd), tx))
            .await
            .map_err(|_| CoordError::Internal("the raft task stopped".into()))?;
        match tokio::time::timeout(PROPOSE_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(CoordError::Unavailable("the proposal was dropped (the leader changed); retry".into())),
            Err(_) => Err(CoordError::Unavailable(format!(
                "not committed in {}s: no quorum of coordinator replicas (leader {:?})",
                PROPOSE_TIMEOUT.as_secs(),
                self.leader().map(|l| l.1)
            ))),
        }
    }

    /// Returns once this replica has applied everything committed when it was called (raft's
    /// read index, confirmed by a quorum): a read after it is not stale.
    pub async fn read_barrier(&self) -> Result<(), CoordError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Req::Read(tx)).await.map_err(|_| CoordError::Internal("the raft task stopped".into()))?;
        match tokio::time::timeout(PROPOSE_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            _ => Err(CoordError::Unavailable("no quorum of coordinator replicas confirms a read".into())),
        }
    }

    /// Adds (`Some(address)`) or removes a replica; returns once the change is applied here.
    pub async fn change_replicas(&self, id: u64, address: Option<String>) -> Result<(), CoordError> {
        match address {
            Some(a) => self.conf_change(ConfChangeType::AddNode, id, a).await,
            None => self.conf_change(ConfChangeType::RemoveNode, id, String::new()).await,
        }
    }

    /// Adds a replica as a learner: it receives the log but does not vote until the leader
    /// promotes it, once it has caught up.
    pub async fn add_learner(&self, id: u64, address: String) -> Result<(), CoordError> {
        self.conf_change(ConfChangeType::AddLearnerNode, id, address).await
    }

    async fn conf_change(&self, t: ConfChangeType, id: u64, a: String) -> Result<(), CoordError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Req::Conf(t, id, a, tx))
            .await
            .map_err(|_| CoordError::Internal("the raft task stopped".into()))?;
        match tokio::time::timeout(PROPOSE_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            _ => Err(CoordError::Unavailable("the configuration change did not commit".into())),
        }
    }

    /// A raft message from a peer.
    pub fn step(&self, msg: Message) {
        let _ = self.tx.try_send(Req::Step(msg));
    }
}

/// Starts the raft node of this replica. `identity`/`ca_pem` authenticate it to its peers. The
/// task runs until `stop` is cancelled; when it cannot write its log it cancels `stop` itself
/// (the whole replica stops: it must not go on as if the entry were durable) and its handle
/// returns the error. Either way the log is closed when the handle resolves.
pub fn start(
    opts: RaftOptions,
    identity: brigade_transport::Identity,
    ca_pem: String,
    stop: CancellationToken,
) -> Result<(RaftHandle, tokio::task::JoinHandle<Result<(), CoordError>>), CoordError> {
    let replica = Replica::open(&opts, rand::random::<u32>() as u64)?;
    let applied = replica.published();
    let peers = Peers::new(opts.id, identity, ca_pem);
    let (tx, rx) = mpsc::channel(4096);
    let (status_tx, status_rx) = watch::channel(RaftStatusView { id: opts.id, ..Default::default() });
    let (changed_tx, changed_rx) = watch::channel(0u64);
    let task = Task { replica, peers: peers.clone(), replies: HashMap::new(), status: status_tx, changed: changed_tx };
    let done = tokio::spawn(task.run(rx, opts.tick, stop));
    Ok((RaftHandle { tx, applied, status: status_rx, changed: changed_rx, peers }, done))
}

/// Where a request's answer goes.
enum Reply {
    Proposed(oneshot::Sender<Result<Applied, CoordError>>),
    Read(oneshot::Sender<Result<(), CoordError>>),
    Changed(oneshot::Sender<Result<(), CoordError>>),
}

impl Reply {
    fn is_closed(&self) -> bool {
        match self {
            Reply::Proposed(r) => r.is_closed(),
            Reply::Read(r) | Reply::Changed(r) => r.is_closed(),
        }
    }
}

/// The driver of a [`Replica`]: ticks it, feeds it requests and peers' messages, and carries
/// out its effects (gRPC sends, answers, published status).
struct Task {
    replica: Replica,
    peers: Arc<Peers>,
    replies: HashMap<Ticket, Reply>,
    status: watch::Sender<RaftStatusView>,
    changed: watch::Sender<u64>,
}

impl Task {
    async fn run(self, rx: mpsc::Receiver<Req>, tick: Duration, stop: CancellationToken) -> Result<(), CoordError> {
        let r = self.turn(rx, tick, &stop).await;
        if let Err(e) = &r {
            // the log could not be written: this replica must not go on as if it had been
            tracing::error!("raft: {e}; this coordinator replica stops");
            stop.cancel();
        }
        r
    }

    async fn turn(
        mut self,
        mut rx: mpsc::Receiver<Req>,
        tick: Duration,
        stop: &CancellationToken,
    ) -> Result<(), CoordError> {
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.carry_out()?;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = ticker.tick() => self.replica.tick(),
                r = rx.recv() => match r {
                    Some(r) => self.handle(r),
                    None => return Ok(()),
                },
            }
            // take what else is waiting before handling the ready: one fsync for a batch
            while let Ok(r) = rx.try_recv() {
                self.handle(r);
            }
            self.carry_out()?;
        }
    }

    fn handle(&mut self, r: Req) {
        match r {
            Req::Step(m) => self.replica.step(m),
            // a closed caller is forgotten (its timeout passed)
            Req::Propose(cmd, reply) if !reply.is_closed() => {
                let t = self.replica.propose(*cmd);
                self.replies.insert(t, Reply::Proposed(reply));
            }
            Req::Read(reply) if !reply.is_closed() => {
                let t = self.replica.read();
                self.replies.insert(t, Reply::Read(reply));
            }
            Req::Conf(kind, id, address, reply) if !reply.is_closed() => {
                let t = self.replica.change(kind, id, address);
                self.replies.insert(t, Reply::Changed(reply));
            }
            Req::Propose(..) | Req::Read(_) | Req::Conf(..) => {}
        }
    }

    /// The replica's ready, its effects carried out, and its status published.
    fn carry_out(&mut self) -> Result<(), CoordError> {
        for effect in self.replica.ready()? {
            match effect {
                Effect::Send(msgs) => self.peers.send(msgs),
                Effect::Peer { id, address: Some(a) } => self.peers.set(id, &a),
                Effect::Peer { id, address: None } => self.peers.remove(id),
                Effect::Applied { .. } => {}
                Effect::Published => self.changed.send_modify(|v| *v += 1),
                Effect::Answer { ticket, answer } => match (self.replies.remove(&ticket), answer) {
                    (Some(Reply::Proposed(r)), Answer::Proposed(a)) => {
                        let _ = r.send(a);
                    }
                    (Some(Reply::Read(r)), Answer::Read(a)) | (Some(Reply::Changed(r)), Answer::Changed(a)) => {
                        let _ = r.send(a);
                    }
                    _ => {}
                },
            }
        }
        let replica = &mut self.replica;
        self.replies.retain(|t, r| {
            let open = !r.is_closed();
            if !open {
                replica.cancel(*t);
            }
            open
        });
        let view = self.replica.status();
        self.status.send_if_modified(|s| {
            if *s != view {
                *s = view;
                true
            } else {
                false
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readers_share_the_published_state_until_a_command_applies() {
        let dir = tempfile::tempdir().unwrap();
        let opened = crate::pki::Pki::load_or_create(dir.path(), None, &["localhost".into()], false).unwrap();
        let me: BTreeMap<u64, String> = [(1, "127.0.0.1:1".to_string())].into();
        let opts = RaftOptions {
            id: 1,
            peers: me.clone(),
            known: me,
            data_dir: dir.path().to_path_buf(),
            tick: Duration::from_millis(10),
            force_new_cluster: false,
        };
        let stop = CancellationToken::new();
        let (h, task) =
            start(opts, opened.pki.identity.clone(), opened.pki.ca_pem().to_string(), stop.clone()).unwrap();
        let t0 = std::time::Instant::now();
        while !h.is_leader() {
            assert!(t0.elapsed() < Duration::from_secs(10), "a group of one elected no leader");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let before = h.state();
        assert!(Arc::ptr_eq(&before, &h.state()), "two reads with nothing applied between share one value");
        h.propose(Command::SetReplica { id: 7, address: Some("10.0.0.7:7070".into()) }).await.unwrap();
        let after = h.state();
        assert!(!Arc::ptr_eq(&before, &after), "the proposer's reply came before its command was readable");
        assert_eq!(after.replicas.get(&7).map(String::as_str), Some("10.0.0.7:7070"));
        assert!(!before.replicas.contains_key(&7), "a value already read never changes under its reader");
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), task).await.unwrap().unwrap().unwrap();
    }
}
