//! The task that owns the raft node. Every interaction is a message on its channel; the task
//! ticks raft, steps messages from peers, and handles each `Ready` in the order raft-rs
//! documents: send messages, apply a snapshot, apply committed entries, persist entries and hard
//! state (redb commits are durable when they return), send the persisted messages only then,
//! advance, and handle what the light ready holds.

use super::storage::{AppliedState, DiskStorage, COMPACT_EVERY};
use super::transport::Peers;
use crate::CoordError;
use brigade_core::cluster::{Applied, ClusterState, Command};
use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeType, Entry, EntryType, Message};
use raft::{RawNode, StateRole};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
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

fn role_name(r: StateRole) -> &'static str {
    match r {
        StateRole::Leader => "leader",
        StateRole::Follower => "follower",
        StateRole::Candidate => "candidate",
        StateRole::PreCandidate => "pre-candidate",
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
    let applied: AppliedState = Arc::new(RwLock::new((0, Arc::new(ClusterState::new()))));
    let marker = opts.data_dir.join(INITIALISED_FILE);
    let marked = marker.exists();
    if marked && !opts.force_new_cluster && !DiskStorage::holds_log(&opts.data_dir)? {
        return Err(CoordError::FailedPrecondition(format!(
            "{} held this replica's raft log, and the log is empty or gone now: starting would begin a new cluster and lose every node, model and deployment. Restore raft.redb from a backup, or let the replica rejoin its group (`brigade coordinator join` after `brigade coordinator leave --id {}`), or pass --force-new-cluster to start over",
            opts.data_dir.display(),
            opts.id
        )));
    }
    let opened = DiskStorage::open(&opts.data_dir, &opts.peers, applied.clone())?;
    let mut state = opened.state;
    if opened.snapshot_index == 0 {
        // the members' addresses before the leader's snapshot arrives: what a joining replica
        // was told when it joined (a bootstrapping one has them in its first snapshot; a log
        // bootstrapped before there was one holds the bootstrap configuration beside it)
        state.replicas = if opts.peers.is_empty() { opts.known.clone() } else { opts.peers.clone() };
    }
    let voters = opened.storage.conf_state().voters;
    if let (true, Some(addr)) = (voters == [opts.id], opts.peers.get(&opts.id)) {
        // a group of one restarted at another address: nobody else holds its state to disagree
        if state.replicas.get(&opts.id) != Some(addr) {
            tracing::info!("replica {} now listens at {addr}", opts.id);
            state.replicas.insert(opts.id, addr.clone());
        }
    }
    if let Ok(mut a) = applied.write() {
        *a = (opened.snapshot_index, Arc::new(state.clone()));
    }
    let cfg = raft::Config {
        id: opts.id,
        election_tick: 10,
        heartbeat_tick: 2,
        applied: opened.snapshot_index,
        max_size_per_msg: 4 << 20,
        max_inflight_msgs: 256,
        check_quorum: true,
        pre_vote: true,
        read_only_option: raft::ReadOnlyOption::Safe,
        ..Default::default()
    };
    cfg.validate().map_err(|e| CoordError::Internal(format!("raft config: {e}")))?;
    let mut node =
        RawNode::new(&cfg, opened.storage, &super::logger()).map_err(|e| CoordError::Internal(format!("raft: {e}")))?;
    // a group of one has nobody to wait for
    let voters_now: Vec<u64> = node.raft.prs().conf().voters().ids().iter().collect();
    if voters_now == [opts.id] {
        let _ = node.campaign();
    }
    let peers = Peers::new(opts.id, identity, ca_pem);
    for (id, addr) in opts.known.iter().chain(state.replicas.iter()) {
        peers.set(*id, addr);
    }
    let (tx, rx) = mpsc::channel(4096);
    let (status_tx, status_rx) = watch::channel(RaftStatusView { id: opts.id, ..Default::default() });
    let (changed_tx, changed_rx) = watch::channel(0u64);
    let task = Task {
        node,
        id: opts.id,
        state,
        applied: applied.clone(),
        peers: peers.clone(),
        pending: HashMap::new(),
        pending_conf: HashMap::new(),
        reads: Vec::new(),
        deferred: Vec::new(),
        compact_now: false,
        marked,
        marker,
        next: rand::random::<u32>() as u64,
        status: status_tx,
        changed: changed_tx,
    };
    let done = tokio::spawn(task.run(rx, opts.tick, stop));
    Ok((RaftHandle { tx, applied, status: status_rx, changed: changed_rx, peers }, done))
}

/// Where a proposal's result goes.
type Reply = oneshot::Sender<Result<Applied, CoordError>>;

/// A read waiting for its read index: (context, the index once known, the reply).
type PendingRead = (u64, Option<u64>, oneshot::Sender<Result<(), CoordError>>);

struct Task {
    node: RawNode<DiskStorage>,
    id: u64,
    state: ClusterState,
    applied: AppliedState,
    peers: Arc<Peers>,
    pending: HashMap<u64, oneshot::Sender<Result<Applied, CoordError>>>,
    pending_conf: HashMap<u64, oneshot::Sender<Result<(), CoordError>>>,
    /// Reads waiting for their read index: (context, index once known, reply).
    reads: Vec<PendingRead>,
    /// Requests made while no leader was known: made again once one is.
    deferred: Vec<Req>,
    /// Compact at the end of this ready (a replica joined a log that starts at index 1).
    compact_now: bool,
    /// [`INITIALISED_FILE`], and whether it is written.
    marker: PathBuf,
    marked: bool,
    next: u64,
    status: watch::Sender<RaftStatusView>,
    changed: watch::Sender<u64>,
}

/// A proposal's context: the proposing replica and its proposal number.
fn context(replica: u64, id: u64) -> Vec<u8> {
    let mut c = replica.to_le_bytes().to_vec();
    c.extend_from_slice(&id.to_le_bytes());
    c
}

fn parse_context(c: &[u8]) -> Option<(u64, u64)> {
    let (a, b) = c.split_at_checked(8)?;
    Some((u64::from_le_bytes(a.try_into().ok()?), u64::from_le_bytes(b.try_into().ok()?)))
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
        loop {
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = ticker.tick() => {
                    self.node.tick();
                }
                r = rx.recv() => match r {
                    Some(r) => self.handle(r),
                    None => return Ok(()),
                },
            }
            // take what else is waiting before handling the ready: one fsync for a batch
            while let Ok(r) = rx.try_recv() {
                self.handle(r);
            }
            self.on_ready()?;
            if self.node.raft.leader_id != 0 && !self.deferred.is_empty() {
                for r in std::mem::take(&mut self.deferred) {
                    self.handle(r);
                }
                self.on_ready()?;
            }
            self.promote_learners();
            self.publish();
        }
    }

    /// The leader makes a learner a voter once it holds the whole committed log and answers:
    /// a replica that joined but never came up (or cannot be reached) never counts towards the
    /// quorum. One configuration change at a time (raft-rs drops a second while one is pending).
    fn promote_learners(&mut self) {
        let r = &self.node.raft;
        if r.state != StateRole::Leader || r.has_pending_conf() || !self.pending_conf.is_empty() {
            return;
        }
        let committed = r.raft_log.committed;
        let ready =
            r.prs().conf().to_conf_state().learners.into_iter().find(|id| {
                r.prs().get(*id).is_some_and(|p| p.recent_active && p.matched >= committed && p.matched > 0)
            });
        let Some(id) = ready else { return };
        let Some(address) = self.state.replicas.get(&id).cloned() else { return };
        match self.propose_conf(ConfChangeType::AddNode, id, address.clone()) {
            Ok(_) => tracing::info!("replica {id} at {address} caught up: promoted to voter"),
            Err(e) => tracing::debug!("promoting replica {id}: {e}"),
        }
        // the next turn of the loop (a tick at most) sends it
    }

    fn handle(&mut self, r: Req) {
        let no_leader = self.node.raft.leader_id == 0;
        match r {
            // the caller's timeout bounds the wait; a closed caller is forgotten
            Req::Propose(cmd, reply) if no_leader => {
                if !reply.is_closed() {
                    self.deferred.push(Req::Propose(cmd, reply));
                }
            }
            Req::Conf(t, id, a, reply) if no_leader => {
                if !reply.is_closed() {
                    self.deferred.push(Req::Conf(t, id, a, reply));
                }
            }
            Req::Read(reply) if no_leader => {
                if !reply.is_closed() {
                    self.deferred.push(Req::Read(reply));
                }
            }
            Req::Step(m) => {
                if let Err(e) = self.node.step(m) {
                    tracing::debug!("raft step: {e}");
                }
            }
            Req::Propose(cmd, reply) => {
                let data = match serde_json::to_vec(&cmd) {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = reply.send(Err(CoordError::Internal(e.to_string())));
                        return;
                    }
                };
                self.next += 1;
                let n = self.next;
                match self.node.propose(context(self.id, n), data) {
                    Ok(()) => {
                        self.pending.insert(n, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(CoordError::Unavailable(format!(
                            "no coordinator leader to take the change: {e}"
                        ))));
                    }
                }
            }
            Req::Read(reply) => {
                self.next += 1;
                let n = self.next;
                self.node.read_index(n.to_le_bytes().to_vec());
                self.reads.push((n, None, reply));
            }
            Req::Conf(t, id, addr, reply) => match self.propose_conf(t, id, addr) {
                Ok(n) => {
                    self.pending_conf.insert(n, reply);
                }
                Err(e) => {
                    let _ =
                        reply.send(Err(CoordError::Unavailable(format!("the configuration change was refused: {e}"))));
                }
            },
        }
    }

    /// Proposes a configuration change (the address in its context); returns the proposal's
    /// number.
    fn propose_conf(&mut self, t: ConfChangeType, id: u64, address: String) -> Result<u64, raft::Error> {
        let mut cc = ConfChange::default();
        cc.set_change_type(t);
        cc.node_id = id;
        cc.context = address.into_bytes().into();
        self.next += 1;
        let n = self.next;
        self.node.propose_conf_change(context(self.id, n), cc).map(|()| n)
    }

    fn on_ready(&mut self) -> Result<(), CoordError> {
        if !self.node.has_ready() {
            self.answer_reads();
            return Ok(());
        }
        let mut ready = self.node.ready();
        // 1. messages that need no persistence (a leader's appends go out while it writes)
        self.peers.send(ready.take_messages());
        // 2. a snapshot from the leader replaces the state
        if !ready.snapshot().is_empty() {
            let s = ready.snapshot().clone();
            let state: ClusterState = serde_json::from_slice(&s.data)
                .map_err(|e| CoordError::Corrupt(format!("a snapshot from the leader: {e}")))?;
            let index = s.get_metadata().index;
            self.node.mut_store().apply_snapshot(s)?;
            self.state = state;
            for (id, addr) in &self.state.replicas {
                self.peers.set(*id, addr);
            }
            self.set_applied(index);
        }
        // 3. committed entries
        self.apply_entries(ready.take_committed_entries())?;
        // 4. new entries, 5. hard state: durable before anything that depends on them is sent
        if !ready.entries().is_empty() {
            self.node.mut_store().append(ready.entries())?;
        }
        if let Some(hs) = ready.hs() {
            self.node.mut_store().set_hardstate(hs.clone())?;
        }
        for rs in ready.take_read_states() {
            let ctx = u64::from_le_bytes(rs.request_ctx.get(..8).and_then(|b| b.try_into().ok()).unwrap_or([0; 8]));
            if let Some(r) = self.reads.iter_mut().find(|r| r.0 == ctx) {
                r.1 = Some(rs.index);
            }
        }
        // 6. messages that had to wait for the writes
        self.peers.send(ready.take_persisted_messages());
        // 7. advance, and what the light ready holds
        let mut light = self.node.advance(ready);
        if let Some(c) = light.commit_index() {
            self.node.mut_store().set_commit(c)?;
        }
        self.peers.send(light.take_messages());
        self.apply_entries(light.take_committed_entries())?;
        self.node.advance_apply();
        self.answer_reads();
        let applied = self.applied_index();
        if std::mem::take(&mut self.compact_now) || applied >= self.node.store().first_index() + COMPACT_EVERY {
            let at = self.node.mut_store().compact()?;
            tracing::debug!("raft log compacted at {at}");
        }
        if !self.marked && (self.node.raft.term > 0 || applied > 0) {
            let text =
                format!("raft replica {} of a brigade cluster; its log is raft.redb beside this file\n", self.id);
            brigade_transport::tls::write_durable(&self.marker, text.as_bytes(), 0o644)
                .map_err(|e| CoordError::io(&self.marker, e))?;
            self.marked = true;
        }
        Ok(())
    }

    fn applied_index(&self) -> u64 {
        self.applied.read().map(|a| a.0).unwrap_or(0)
    }

    fn set_applied(&mut self, index: u64) {
        // one copy per applied batch, shared by every reader until the next
        let published = Arc::new(self.state.clone());
        if let Ok(mut a) = self.applied.write() {
            *a = (index, published);
        }
        self.changed.send_modify(|v| *v += 1);
    }

    fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<(), CoordError> {
        if entries.is_empty() {
            return Ok(());
        }
        // answered once the state is published, so a proposer that reads after its reply sees
        // its own command; on an error the entries applied before it are published and
        // answered all the same
        let mut replies = Vec::new();
        let mut conf_replies = Vec::new();
        let mut last = 0;
        let result = self.apply_each(entries, &mut last, &mut replies, &mut conf_replies);
        if last > 0 {
            self.set_applied(last);
        }
        for (reply, result) in replies {
            let _ = reply.send(result);
        }
        for reply in conf_replies {
            let _ = reply.send(Ok(()));
        }
        result
    }

    fn apply_each(
        &mut self,
        entries: Vec<Entry>,
        last: &mut u64,
        replies: &mut Vec<(Reply, Result<Applied, CoordError>)>,
        conf_replies: &mut Vec<oneshot::Sender<Result<(), CoordError>>>,
    ) -> Result<(), CoordError> {
        for e in entries {
            if e.data.is_empty() {
                *last = e.index;
                continue; // a new leader's empty entry
            }
            let ours = parse_context(&e.context).filter(|(r, _)| *r == self.id).map(|(_, n)| n);
            match e.get_entry_type() {
                EntryType::EntryNormal => {
                    let result = match serde_json::from_slice::<Command>(&e.data) {
                        Ok(cmd) => self.state.apply(cmd).map_err(CoordError::from),
                        Err(err) => Err(CoordError::Corrupt(format!("raft entry {}: {err}", e.index))),
                    };
                    if let Some(reply) = ours.and_then(|n| self.pending.remove(&n)) {
                        replies.push((reply, result));
                    }
                }
                EntryType::EntryConfChange => {
                    let cc = ConfChange::parse_from_bytes(&e.data)
                        .map_err(|err| CoordError::Corrupt(format!("raft entry {}: {err}", e.index)))?;
                    let cs = self
                        .node
                        .apply_conf_change(&cc)
                        .map_err(|err| CoordError::Internal(format!("conf change: {err}")))?;
                    self.node.mut_store().set_conf_state(cs)?;
                    let address = String::from_utf8_lossy(&cc.context).into_owned();
                    let add = matches!(cc.get_change_type(), ConfChangeType::AddNode | ConfChangeType::AddLearnerNode);
                    if add {
                        self.peers.set(cc.node_id, &address);
                    } else {
                        self.peers.remove(cc.node_id);
                    }
                    let _ = self.state.apply(Command::SetReplica { id: cc.node_id, address: add.then_some(address) });
                    if let Some(reply) = ours.and_then(|n| self.pending_conf.remove(&n)) {
                        conf_replies.push(reply);
                    }
                    if !add && cc.node_id == self.id {
                        tracing::warn!("this replica was removed from the coordinator group");
                    }
                    if add && self.node.store().first_index() <= 1 {
                        // a log bootstrapped by an older build, whose members are not in it
                        // (see `DiskStorage::open`): compacted before the newcomer's first reply
                        // can ask for entries, so that the leader sends it a snapshot instead
                        self.compact_now = true;
                    }
                }
                EntryType::EntryConfChangeV2 => {
                    tracing::warn!("raft entry {}: configuration changes v2 are not used by brigade", e.index);
                }
            }
            *last = e.index;
        }
        Ok(())
    }

    fn answer_reads(&mut self) {
        let applied = self.applied_index();
        let mut i = 0;
        while i < self.reads.len() {
            if self.reads[i].1.is_some_and(|idx| idx <= applied) || self.reads[i].2.is_closed() {
                let (_, _, reply) = self.reads.swap_remove(i);
                let _ = reply.send(Ok(()));
            } else {
                i += 1;
            }
        }
    }

    fn publish(&mut self) {
        let r = &self.node.raft;
        let mut progress = Vec::new();
        if r.state == StateRole::Leader {
            for (id, p) in r.prs().iter() {
                progress.push((*id, p.matched, format!("{:?}", p.state).to_lowercase()));
            }
            progress.sort();
        }
        let mut voters: Vec<u64> = r.prs().conf().voters().ids().iter().collect();
        voters.sort_unstable();
        let mut learners: Vec<u64> = r.prs().conf().to_conf_state().learners;
        learners.sort_unstable();
        let view = RaftStatusView {
            id: self.id,
            role: role_name(r.state).into(),
            term: r.term,
            leader: r.leader_id,
            commit: r.raft_log.committed,
            applied: r.raft_log.applied,
            progress,
            voters,
            learners,
        };
        self.status.send_if_modified(|s| {
            if *s != view {
                *s = view;
                true
            } else {
                false
            }
        });
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
