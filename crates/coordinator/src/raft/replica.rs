//! One coordinator replica's raft, sans IO (quinn-proto's style): the `RawNode`, its durable log
//! and the state machine, driven by calls — `tick`, `step` a peer's message, `propose`, `read`,
//! `change` the group — and answering with [`Effect`]s from [`Replica::ready`]: messages to
//! send, peer addresses learnt, entries applied, requests answered. No clock, no socket, no
//! task: the production driver ([`super::node`]) ticks it from a tokio interval and sends its
//! messages over gRPC; brigade's test kit drives several on a virtual clock over a seeded,
//! faulty network, and kills and reopens them from their logs.
//!
//! `ready` handles raft-rs's `Ready` in the order raft-rs documents: send messages, apply a
//! snapshot, apply committed entries, persist entries and hard state (redb commits are durable
//! when they return), send the persisted messages only then, advance, and handle what the light
//! ready holds.

use super::node::{RaftOptions, RaftStatusView, INITIALISED_FILE};
use super::storage::{AppliedState, DiskStorage, COMPACT_EVERY};
use crate::CoordError;
use brigade_core::cluster::{Applied, ClusterState, Command};
use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeType, Entry, EntryType, Message, MessageType};
use raft::{RawNode, SnapshotStatus, StateRole};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

/// Names one request to a replica; its answer carries it back. Unique per replica incarnation:
/// the first is chosen by the caller (at random in production, so that a restarted replica does
/// not mistake its previous incarnation's entries for its own proposals).
pub type Ticket = u64;

/// A request that waits for a leader before it is made.
enum Request {
    /// (boxed: a command carries a model's profile, far larger than the other requests)
    Propose(Box<Command>),
    Read,
    Change(ConfChangeType, u64, String),
}

/// The answer to a request.
#[derive(Debug)]
pub enum Answer {
    /// The proposed command's result, once it is committed and applied here.
    Proposed(Result<Applied, CoordError>),
    /// Everything committed when the read was asked is applied here: a read now is not stale.
    Read(Result<(), CoordError>),
    /// The configuration change is applied here.
    Changed(Result<(), CoordError>),
}

/// What the driver must do after a [`Replica::ready`], in this order.
#[derive(Debug)]
pub enum Effect {
    /// Raft messages to deliver to their `to` replicas (lost or late ones are raft's problem).
    Send(Vec<Message>),
    /// Where a replica listens now (`None`: it left the group).
    Peer { id: u64, address: Option<String> },
    /// The log entry at `index` is applied here; `by` names its proposal (the proposing
    /// replica and its ticket), absent for a leader's empty entry and for a second copy of a
    /// proposal (which changes nothing).
    Applied { index: u64, by: Option<(u64, Ticket)> },
    /// The applied state changed (readers of [`Replica::published`] see it now).
    Published,
    /// A request's answer.
    Answer { ticket: Ticket, answer: Answer },
}

/// How a replica is opened beyond its [`RaftOptions`].
#[derive(Debug, Clone)]
pub struct Tuning {
    /// A snapshot every this many applied entries (tests make them frequent, so that replicas
    /// catch up from snapshots as well as from entries).
    pub compact_every: u64,
    /// Ticks without a leader before an election: `None` draws them from 10..20 at every
    /// election (raft-rs's own generator); a test kit fixes them, from its seed, so that a run
    /// is a function of its seed.
    pub election_ticks: Option<usize>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning { compact_every: COMPACT_EVERY, election_ticks: None }
    }
}

/// One replica: its raft node, log and state machine.
pub struct Replica {
    node: RawNode<DiskStorage>,
    id: u64,
    state: ClusterState,
    applied: AppliedState,
    /// Proposals and configuration changes made here and not yet applied.
    pending: HashSet<Ticket>,
    pending_conf: HashSet<Ticket>,
    /// Reads waiting for their read index: (ticket, the index once known).
    reads: Vec<(Ticket, Option<u64>)>,
    /// Requests made while no leader was known: made once one is.
    deferred: Vec<(Ticket, Request)>,
    /// Followers sent a snapshot in this ready.
    snapshots_sent: Vec<u64>,
    /// Compact at the end of this ready (a replica joined a log that starts at index 1).
    compact_now: bool,
    compact_every: u64,
    /// [`INITIALISED_FILE`], and whether it is written.
    marker: PathBuf,
    marked: bool,
    next: Ticket,
    effects: Vec<Effect>,
}

/// A proposal's context: the proposing replica and its ticket.
fn context(replica: u64, ticket: Ticket) -> Vec<u8> {
    let mut c = replica.to_le_bytes().to_vec();
    c.extend_from_slice(&ticket.to_le_bytes());
    c
}

fn parse_context(c: &[u8]) -> Option<(u64, Ticket)> {
    let (a, b) = c.split_at_checked(8)?;
    Some((u64::from_le_bytes(a.try_into().ok()?), u64::from_le_bytes(b.try_into().ok()?)))
}

fn role_name(r: StateRole) -> &'static str {
    match r {
        StateRole::Leader => "leader",
        StateRole::Follower => "follower",
        StateRole::Candidate => "candidate",
        StateRole::PreCandidate => "pre-candidate",
    }
}

impl Replica {
    /// Opens the replica's log in `opts.data_dir` (bootstrapping a fresh one from
    /// `opts.peers`); `first_ticket` numbers its requests.
    pub fn open(opts: &RaftOptions, first_ticket: Ticket) -> Result<Replica, CoordError> {
        Self::open_tuned(opts, first_ticket, &Tuning::default())
    }

    /// [`Replica::open`] with other [`Tuning`].
    pub fn open_tuned(opts: &RaftOptions, first_ticket: Ticket, tuning: &Tuning) -> Result<Replica, CoordError> {
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
            min_election_tick: tuning.election_ticks.map_or(0, |t| t),
            max_election_tick: tuning.election_ticks.map_or(0, |t| t + 1),
            applied: opened.snapshot_index,
            max_size_per_msg: 4 << 20,
            max_inflight_msgs: 256,
            check_quorum: true,
            pre_vote: true,
            read_only_option: raft::ReadOnlyOption::Safe,
            ..Default::default()
        };
        cfg.validate().map_err(|e| CoordError::Internal(format!("raft config: {e}")))?;
        let mut node = RawNode::new(&cfg, opened.storage, &super::logger())
            .map_err(|e| CoordError::Internal(format!("raft: {e}")))?;
        // a group of one has nobody to wait for
        let voters_now: Vec<u64> = node.raft.prs().conf().voters().ids().iter().collect();
        if voters_now == [opts.id] {
            let _ = node.campaign();
        }
        // the addresses to send to: those known beside the log, then those in it
        let effects = opts
            .known
            .iter()
            .chain(state.replicas.iter())
            .map(|(id, a)| Effect::Peer { id: *id, address: Some(a.clone()) })
            .collect();
        Ok(Replica {
            node,
            id: opts.id,
            state,
            applied,
            pending: HashSet::new(),
            pending_conf: HashSet::new(),
            reads: Vec::new(),
            deferred: Vec::new(),
            snapshots_sent: Vec::new(),
            compact_now: false,
            compact_every: tuning.compact_every.max(1),
            marked,
            marker,
            next: first_ticket,
            effects,
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The applied index and state, as readers share them.
    pub fn published(&self) -> AppliedState {
        self.applied.clone()
    }

    /// The applied state (the last published one).
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    pub fn leader_id(&self) -> u64 {
        self.node.raft.leader_id
    }

    pub fn is_leader(&self) -> bool {
        self.node.raft.state == StateRole::Leader
    }

    /// One raft tick: elections take 10–20, heartbeats 2.
    pub fn tick(&mut self) {
        self.node.tick();
    }

    /// A message from a peer.
    pub fn step(&mut self, m: Message) {
        if let Err(e) = self.node.step(m) {
            tracing::debug!("raft step: {e}");
        }
    }

    fn ticket(&mut self) -> Ticket {
        self.next = self.next.wrapping_add(1);
        self.next
    }

    /// Proposes a command: answered with its result once it is committed and applied here.
    pub fn propose(&mut self, cmd: Command) -> Ticket {
        let t = self.ticket();
        self.request(t, Request::Propose(Box::new(cmd)));
        t
    }

    /// Asks for a read barrier (raft's read index, confirmed by a quorum).
    pub fn read(&mut self) -> Ticket {
        let t = self.ticket();
        self.request(t, Request::Read);
        t
    }

    /// Proposes a configuration change (the replica's address in its context).
    pub fn change(&mut self, kind: ConfChangeType, id: u64, address: String) -> Ticket {
        let t = self.ticket();
        self.request(t, Request::Change(kind, id, address));
        t
    }

    /// Forgets a request whose caller went away: it is never answered.
    pub fn cancel(&mut self, t: Ticket) {
        self.deferred.retain(|(d, _)| *d != t);
        self.reads.retain(|(r, _)| *r != t);
        self.pending.remove(&t);
        self.pending_conf.remove(&t);
    }

    fn answer(&mut self, ticket: Ticket, answer: Answer) {
        self.effects.push(Effect::Answer { ticket, answer });
    }

    fn request(&mut self, t: Ticket, r: Request) {
        if self.node.raft.leader_id == 0 {
            // the caller's timeout bounds the wait
            self.deferred.push((t, r));
            return;
        }
        match r {
            Request::Propose(cmd) => {
                let data = match serde_json::to_vec(&cmd) {
                    Ok(d) => d,
                    Err(e) => return self.answer(t, Answer::Proposed(Err(CoordError::Internal(e.to_string())))),
                };
                match self.node.propose(context(self.id, t), data) {
                    Ok(()) => {
                        self.pending.insert(t);
                    }
                    Err(e) => self.answer(
                        t,
                        Answer::Proposed(Err(CoordError::Unavailable(format!(
                            "no coordinator leader to take the change: {e}"
                        )))),
                    ),
                }
            }
            Request::Read => {
                self.node.read_index(t.to_le_bytes().to_vec());
                self.reads.push((t, None));
            }
            Request::Change(kind, id, address) => match self.propose_conf(t, kind, id, address) {
                Ok(()) => {
                    self.pending_conf.insert(t);
                }
                Err(e) => self.answer(
                    t,
                    Answer::Changed(Err(CoordError::Unavailable(format!("the configuration change was refused: {e}")))),
                ),
            },
        }
    }

    fn propose_conf(&mut self, t: Ticket, kind: ConfChangeType, id: u64, address: String) -> Result<(), raft::Error> {
        let mut cc = ConfChange::default();
        cc.set_change_type(kind);
        cc.node_id = id;
        cc.context = address.into_bytes().into();
        self.node.propose_conf_change(context(self.id, t), cc)
    }

    /// Handles what the calls since the last `ready` made raft do; the effects, in order. An
    /// error means the log could not be written: the replica must stop (it must not go on as if
    /// the entry were durable).
    pub fn ready(&mut self) -> Result<Vec<Effect>, CoordError> {
        self.on_ready()?;
        if self.node.raft.leader_id != 0 && !self.deferred.is_empty() {
            for (t, r) in std::mem::take(&mut self.deferred) {
                self.request(t, r);
            }
            self.on_ready()?;
        }
        self.promote_learners();
        Ok(std::mem::take(&mut self.effects))
    }

    /// The leader makes a learner a voter once it holds the whole committed log and answers:
    /// a replica that joined but never came up (or cannot be reached) never counts towards the
    /// quorum. One configuration change at a time (raft-rs drops a second while one is pending).
    /// The next `ready` sends it.
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
        let t = self.ticket();
        match self.propose_conf(t, ConfChangeType::AddNode, id, address.clone()) {
            Ok(()) => tracing::info!("replica {id} at {address} caught up: promoted to voter"),
            Err(e) => tracing::debug!("promoting replica {id}: {e}"),
        }
    }

    fn on_ready(&mut self) -> Result<(), CoordError> {
        if !self.node.has_ready() {
            self.answer_reads();
            return Ok(());
        }
        let mut ready = self.node.ready();
        // 1. messages that need no persistence (a leader's appends go out while it writes)
        self.send(ready.take_messages());
        // 2. a snapshot from the leader replaces the state
        if !ready.snapshot().is_empty() {
            let s = ready.snapshot().clone();
            let state: ClusterState = serde_json::from_slice(&s.data)
                .map_err(|e| CoordError::Corrupt(format!("a snapshot from the leader: {e}")))?;
            let index = s.get_metadata().index;
            self.node.mut_store().apply_snapshot(s)?;
            self.state = state;
            // proposals of ours that the snapshot holds are answered from its memory
            let done: Vec<(Ticket, Result<Applied, CoordError>)> = self
                .pending
                .iter()
                .filter_map(|t| self.state.proposal(self.id, *t).map(|r| (*t, r.clone().map_err(CoordError::from))))
                .collect();
            for (t, _) in &done {
                self.pending.remove(t);
            }
            let peers: Vec<Effect> =
                self.state.replicas.iter().map(|(id, a)| Effect::Peer { id: *id, address: Some(a.clone()) }).collect();
            self.effects.extend(peers);
            self.set_applied(index);
            for (t, result) in done {
                self.answer(t, Answer::Proposed(result));
            }
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
        self.send(ready.take_persisted_messages());
        // 7. advance, and what the light ready holds
        let mut light = self.node.advance(ready);
        if let Some(c) = light.commit_index() {
            self.node.mut_store().set_commit(c)?;
        }
        self.send(light.take_messages());
        self.apply_entries(light.take_committed_entries())?;
        self.node.advance_apply();
        // a snapshot handed to the transport counts as delivered: raft-rs holds a follower in
        // snapshot state until told, and a lost snapshot (the follower was down, the link cut)
        // would leave it there for as long as this leader lives. Told "finished", the leader
        // probes; a follower without the snapshot rejects the append, and the leader, whose
        // log no longer holds what it needs, sends a fresh snapshot.
        for to in std::mem::take(&mut self.snapshots_sent) {
            self.node.report_snapshot(to, SnapshotStatus::Finish);
        }
        self.answer_reads();
        let applied = self.applied_index();
        if std::mem::take(&mut self.compact_now) || applied >= self.node.store().first_index() + self.compact_every {
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

    fn send(&mut self, msgs: Vec<Message>) {
        let snapshots = msgs.iter().filter(|m| m.get_msg_type() == MessageType::MsgSnapshot).map(|m| m.to);
        self.snapshots_sent.extend(snapshots);
        if !msgs.is_empty() {
            self.effects.push(Effect::Send(msgs));
        }
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
        self.effects.push(Effect::Published);
    }

    fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<(), CoordError> {
        if entries.is_empty() {
            return Ok(());
        }
        // answered once the state is published, so a proposer that reads after its reply sees
        // its own command; on an error the entries applied before it are published and
        // answered all the same
        let mut answers = Vec::new();
        let mut last = 0;
        let result = self.apply_each(entries, &mut last, &mut answers);
        if last > 0 {
            self.set_applied(last);
        }
        for (ticket, answer) in answers {
            self.answer(ticket, answer);
        }
        result
    }

    fn apply_each(
        &mut self,
        entries: Vec<Entry>,
        last: &mut u64,
        answers: &mut Vec<(Ticket, Answer)>,
    ) -> Result<(), CoordError> {
        for e in entries {
            let by = if e.data.is_empty() { None } else { parse_context(&e.context) };
            let ours = by.filter(|(r, _)| *r == self.id).map(|(_, t)| t);
            let applied = match e.get_entry_type() {
                // a new leader's empty entry
                _ if e.data.is_empty() => None,
                EntryType::EntryNormal => self.apply_command(&e, by, ours, answers),
                EntryType::EntryConfChange => {
                    self.apply_conf_change(&e, ours, answers)?;
                    by
                }
                EntryType::EntryConfChangeV2 => {
                    tracing::warn!("raft entry {}: configuration changes v2 are not used by brigade", e.index);
                    by
                }
            };
            self.effects.push(Effect::Applied { index: e.index, by: applied });
            *last = e.index;
        }
        Ok(())
    }

    /// A command entry applied to the state (its result answered if this replica proposed it);
    /// the proposal it applied, `None` for a copy of one applied before (which changes nothing).
    fn apply_command(
        &mut self,
        e: &Entry,
        by: Option<(u64, Ticket)>,
        ours: Option<Ticket>,
        answers: &mut Vec<(Ticket, Answer)>,
    ) -> Option<(u64, Ticket)> {
        let result = match (serde_json::from_slice::<Command>(&e.data), by) {
            (Ok(cmd), Some((r, t))) => self.state.apply_proposal(r, t, cmd)?.map_err(Into::into),
            (Ok(cmd), None) => self.state.apply(cmd).map_err(CoordError::from),
            (Err(err), _) => Err(CoordError::Corrupt(format!("raft entry {}: {err}", e.index))),
        };
        if let Some(t) = ours.filter(|t| self.pending.remove(t)) {
            answers.push((t, Answer::Proposed(result)));
        }
        by
    }

    /// A configuration change applied to raft, the log's configuration and the state's replicas.
    fn apply_conf_change(
        &mut self,
        e: &Entry,
        ours: Option<Ticket>,
        answers: &mut Vec<(Ticket, Answer)>,
    ) -> Result<(), CoordError> {
        let cc = ConfChange::parse_from_bytes(&e.data)
            .map_err(|err| CoordError::Corrupt(format!("raft entry {}: {err}", e.index)))?;
        let cs = self.node.apply_conf_change(&cc).map_err(|err| CoordError::Internal(format!("conf change: {err}")))?;
        self.node.mut_store().set_conf_state(cs)?;
        let address = String::from_utf8_lossy(&cc.context).into_owned();
        let add = matches!(cc.get_change_type(), ConfChangeType::AddNode | ConfChangeType::AddLearnerNode);
        self.effects.push(Effect::Peer { id: cc.node_id, address: add.then(|| address.clone()) });
        let _ = self.state.apply(Command::SetReplica { id: cc.node_id, address: add.then_some(address) });
        if let Some(t) = ours.filter(|t| self.pending_conf.remove(t)) {
            answers.push((t, Answer::Changed(Ok(()))));
        }
        if !add && cc.node_id == self.id {
            tracing::warn!("this replica was removed from the coordinator group");
        }
        if add && self.node.store().first_index() <= 1 {
            // a log bootstrapped by an older build, whose members are not in it (see
            // `DiskStorage::open`): compacted before the newcomer's first reply can ask for
            // entries, so that the leader sends it a snapshot instead
            self.compact_now = true;
        }
        Ok(())
    }

    fn answer_reads(&mut self) {
        let applied = self.applied_index();
        let (done, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.reads).into_iter().partition(|r| r.1.is_some_and(|idx| idx <= applied));
        self.reads = waiting;
        for (t, _) in done {
            self.answer(t, Answer::Read(Ok(())));
        }
    }

    /// What the node says about itself and (as leader) the others.
    pub fn status(&self) -> RaftStatusView {
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
        RaftStatusView {
            id: self.id,
            role: role_name(r.state).into(),
            term: r.term,
            leader: r.leader_id,
            commit: r.raft_log.committed,
            applied: r.raft_log.applied,
            progress,
            voters,
            learners,
        }
    }
}
