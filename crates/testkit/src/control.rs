//! The coordinator's control plane under faults. A group of raft replicas — the production
//! [`Replica`], each with its redb log in its own directory — runs on a virtual clock over a
//! [`Net`]. Clients write and read registers (`AdmitNode` commands: the node name is the key,
//! the certificate fingerprint the value) at any replica, while a schedule drawn from one seed
//! kills and restarts replicas (a restart reopens the log from disk), pauses them, partitions
//! the network (both ways and one way), and changes its weather (loss, duplication, delay).
//! Around them run worker nodes ([`fleet`](crate::fleet)): they register, heartbeat the leader,
//! re-register when it says so, and report the stages placed on them ready, while the leader's
//! recovery loop (the production `Reconciler`) marks silent nodes down and places the
//! deployment again; the schedule kills and restarts workers too, and partitions cut them off.
//! Then the network heals, every replica and some of the workers come back, and the group must
//! elect a leader, take a write at every replica, converge on one state, know which workers are
//! up, and serve the deployment from workers that are up (or say why it cannot). The
//! [`History`] of what clients saw must be linearizable throughout, and no replica may ever see
//! the deployment's generation go back.

use crate::fleet::{self, Heard, LeaderTask, Worker, DEPLOYMENT};
use crate::history::{History, Kind, Outcome};
use crate::net::{Net, Weather};
use brigade_coordinator::raft::{Answer, Effect, Message, RaftOptions, Replica, Ticket, Tuning};
use brigade_core::cluster::{ClusterState, Command, DeploymentState, NodeState};
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::time::Duration;

/// The shape of a run.
#[derive(Debug, Clone)]
pub struct Config {
    pub replicas: u64,
    /// Ticks of faults (an election takes 10–20 ticks).
    pub chaos_ticks: u64,
    /// Ticks the healed group has to elect a leader, take the final writes and converge.
    pub calm_ticks: u64,
    /// A snapshot every this many applied entries (small, so that restarted replicas catch up
    /// from snapshots as well as from entries).
    pub compact_every: u64,
    /// The chance a client operation starts in a tick.
    pub op_rate: f64,
    /// Worker nodes (0: replicas and clients only).
    pub workers: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config { replicas: 3, chaos_ticks: 300, calm_ticks: 400, compact_every: 16, op_rate: 0.3, workers: 4 }
    }
}

/// What a run did (to see that the faults happened).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Report {
    pub writes_acked: u64,
    pub reads_answered: u64,
    pub unanswered: u64,
    pub refused: u64,
    pub kills: u64,
    pub pauses: u64,
    pub partitions: u64,
    /// The highest raft term any replica reached (each election raises it).
    pub max_term: u64,
    pub last_index: u64,
    pub messages_lost: u64,
    pub worker_kills: u64,
    /// Workers down at the end, and the deployment's generation then (each placement is one).
    pub workers_down: u64,
    pub generation: u64,
    /// The deployment could not be placed on the workers left, and said so.
    pub degraded: bool,
}

/// What travels between the group's members and the workers.
#[derive(Debug, Clone)]
enum Wire {
    Raft(Message),
    /// A worker's heartbeat (to every replica; the leader takes it).
    Heartbeat(usize),
    /// The leader's answer: whether the worker must register again (it was marked down).
    Reregister(bool),
}

/// Workers' addresses on the network: this plus their index.
const WORKER_BASE: u64 = 1000;

/// Who waits for a request's answer besides the clients.
#[derive(Debug, Clone, Copy)]
enum Owner {
    Setup,
    Leader,
    Register(usize),
    Report(usize),
}

struct Member {
    opts: RaftOptions,
    replica: Option<Replica>,
    paused_until: u64,
    /// Its election timeout, in ticks: fixed (raft-rs would draw it from an unseeded generator)
    /// and different from every other replica's, so that two candidates cannot keep splitting
    /// the vote in step.
    election_ticks: usize,
    /// Messages that arrived while it was paused (its socket's buffer).
    backlog: Vec<Wire>,
    /// Soft state of this incarnation: the tick each worker's heartbeat last arrived while this
    /// replica led, and its recovery loop while it leads.
    heartbeats: BTreeMap<String, u64>,
    leader: Option<LeaderTask>,
    /// The deployment's generation this incarnation last published.
    generation: u64,
    /// The applied index this incarnation last published, and its state's digest.
    published: Option<(u64, u64)>,
}

struct Group {
    cfg: Config,
    rng: ChaCha8Rng,
    now: u64,
    net: Net<Wire>,
    members: BTreeMap<u64, Member>,
    workers: Vec<Worker>,
    owners: HashMap<(u64, Ticket), Owner>,
    /// The set-up command in flight, and the first refusal of one.
    setup: Option<(u64, Ticket)>,
    setup_failed: Option<String>,
    history: History,
    report: Report,
    next_value: u64,
    /// Kept for its `Drop`: the replicas' data dirs.
    _dir: tempfile::TempDir,
}

const KEYS: [&str; 3] = ["k0", "k1", "k2"];

/// Ticks a client waits for an answer before it tries again (a production caller waits 10 s,
/// 1000 ticks of 10 ms; the test kit's calm network answers within a few).
const RETRY: u64 = 40;

/// A scratch directory on tmpfs where there is one: the logs fsync on every write.
fn scratch() -> std::io::Result<tempfile::TempDir> {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        if let Ok(d) = tempfile::Builder::new().prefix("brigade-testkit").tempdir_in(&shm) {
            return Ok(d);
        }
    }
    tempfile::Builder::new().prefix("brigade-testkit").tempdir()
}

fn digest(state: &brigade_core::cluster::ClusterState) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_vec(state).unwrap_or_default().hash(&mut h);
    h.finish()
}

impl Group {
    fn new(seed: u64, cfg: Config) -> Result<Group, String> {
        let cfg_workers = cfg.workers;
        let dir = scratch().map_err(|e| format!("scratch dir: {e}"))?;
        let peers: BTreeMap<u64, String> = (1..=cfg.replicas).map(|id| (id, format!("replica-{id}"))).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut timeouts: Vec<usize> = (10..20).collect();
        timeouts.shuffle(&mut rng);
        let mut members = BTreeMap::new();
        for id in 1..=cfg.replicas {
            let data_dir = dir.path().join(format!("r{id}"));
            std::fs::create_dir_all(&data_dir).map_err(|e| format!("{}: {e}", data_dir.display()))?;
            let opts = RaftOptions {
                id,
                peers: peers.clone(),
                known: peers.clone(),
                data_dir,
                tick: Duration::from_millis(1),
                force_new_cluster: false,
            };
            let election_ticks = timeouts[(id as usize - 1) % timeouts.len()];
            members.insert(
                id,
                Member {
                    opts,
                    replica: None,
                    paused_until: 0,
                    election_ticks,
                    backlog: Vec::new(),
                    heartbeats: BTreeMap::new(),
                    leader: None,
                    generation: 0,
                    published: None,
                },
            );
        }
        let mut g = Group {
            cfg,
            rng,
            now: 0,
            net: Net::default(),
            members,
            workers: (0..cfg_workers).map(Worker::new).collect(),
            owners: HashMap::new(),
            setup: None,
            setup_failed: None,
            history: History::default(),
            report: Report::default(),
            next_value: 0,
            _dir: dir,
        };
        for id in 1..=g.cfg.replicas {
            g.start(id)?;
        }
        Ok(g)
    }

    fn start(&mut self, id: u64) -> Result<(), String> {
        let first_ticket = self.rng.random::<u64>() >> 1;
        let m = self.members.get_mut(&id).ok_or(format!("no replica {id}"))?;
        let tuning = Tuning { compact_every: self.cfg.compact_every, election_ticks: Some(m.election_ticks) };
        let r = Replica::open_tuned(&m.opts, first_ticket, &tuning)
            .map_err(|e| format!("replica {id} does not reopen its log: {e}"))?;
        m.replica = Some(r);
        m.paused_until = 0;
        m.backlog.clear();
        m.heartbeats.clear();
        m.leader = None;
        m.generation = 0;
        m.published = None;
        Ok(())
    }

    fn up(&self) -> Vec<u64> {
        self.members.iter().filter(|(_, m)| m.replica.is_some()).map(|(id, _)| *id).collect()
    }

    fn running(&self, id: u64) -> bool {
        self.members.get(&id).is_some_and(|m| m.replica.is_some() && m.paused_until <= self.now)
    }

    /// Every address on the network: replicas, then workers.
    fn addresses(&self) -> Vec<u64> {
        let workers = (0..self.workers.len() as u64).map(|i| WORKER_BASE + i);
        self.members.keys().copied().chain(workers).collect()
    }

    /// One fault, perhaps, drawn from the schedule's generator.
    fn weather_the_chaos(&mut self) -> Result<(), String> {
        let n = self.cfg.replicas;
        let roll: f64 = self.rng.random();
        let up = self.up();
        let down: Vec<u64> = self.members.keys().copied().filter(|id| !up.contains(id)).collect();
        if roll < 0.012 && down.len() as u64 <= n / 2 {
            // a kill: the replica's process is gone, its unanswered requests with it
            if let Some(&id) = up.choose(&mut self.rng) {
                if let Some(m) = self.members.get_mut(&id) {
                    m.replica = None;
                }
                self.report.kills += 1;
            }
        } else if roll < 0.04 {
            if let Some(&id) = down.choose(&mut self.rng) {
                self.start(id)?;
            }
        } else if roll < 0.05 {
            let running = self.running_replicas();
            if let Some(&id) = running.choose(&mut self.rng) {
                let until = self.now + self.rng.random_range(5..40);
                if let Some(m) = self.members.get_mut(&id) {
                    m.paused_until = until;
                }
                self.report.pauses += 1;
            }
        } else if roll < 0.06 {
            self.report.partitions += 1;
            let ids = self.addresses();
            if self.rng.random_bool(0.3) {
                let a = *ids.choose(&mut self.rng).unwrap_or(&1);
                let b = *ids.choose(&mut self.rng).unwrap_or(&2);
                if a != b {
                    self.net.cut_one_way(a, b);
                }
            } else {
                let (mut left, mut right) = (Vec::new(), Vec::new());
                for id in ids {
                    if self.rng.random_bool(0.5) {
                        left.push(id)
                    } else {
                        right.push(id)
                    }
                }
                self.net.partition(&[left, right]);
            }
        } else if roll < 0.08 {
            self.net.heal();
        } else if roll < 0.095 {
            self.net.weather = Weather {
                drop: *[0.0, 0.0, 0.05, 0.2, 0.5].choose(&mut self.rng).unwrap_or(&0.0),
                duplicate: *[0.0, 0.05, 0.2].choose(&mut self.rng).unwrap_or(&0.0),
                max_delay: *[0u64, 1, 3, 8, 30].choose(&mut self.rng).unwrap_or(&0),
            };
        } else if roll < 0.105 && !self.workers.is_empty() {
            // a worker's process dies, or one that died starts again (and registers)
            let i = self.rng.random_range(0..self.workers.len());
            let w = &mut self.workers[i];
            if w.up {
                self.report.worker_kills += 1;
            }
            w.up = !w.up;
            w.registered = false;
            w.waiting = None;
        }
        Ok(())
    }

    /// A client operation at a random running replica.
    fn client(&mut self) {
        let running = self.running_replicas();
        let Some(&id) = running.choose(&mut self.rng) else { return };
        let key = KEYS[self.rng.random_range(0..KEYS.len())];
        let write = self.rng.random_bool(0.6);
        self.operate(id, key, write);
    }

    fn operate(&mut self, id: u64, key: &str, write: bool) {
        self.next_value += 1;
        let v = self.next_value;
        let Some(r) = self.members.get_mut(&id).and_then(|m| m.replica.as_mut()) else { return };
        if write {
            let value = format!("{v:064x}");
            let t = r.propose(Command::AdmitNode { name: key.into(), fingerprint: value.clone(), admitted_ms: v });
            self.history.invoke((id, t), Kind::Write { key: key.into(), value });
        } else {
            let t = r.read();
            self.history.invoke((id, t), Kind::Read { key: key.into() });
        }
    }

    /// Proposes `cmd` at replica `id` for `owner`; the request, unless the replica is down.
    fn propose(&mut self, id: u64, cmd: Command, owner: Owner) -> Option<(u64, Ticket, u64)> {
        let r = self.members.get_mut(&id)?.replica.as_mut()?;
        let t = r.propose(cmd);
        self.owners.insert((id, t), owner);
        self.history.background((id, t));
        Some((id, t, self.now))
    }

    fn running_replicas(&self) -> Vec<u64> {
        self.up().into_iter().filter(|id| self.running(*id)).collect()
    }

    /// The published state of replica `id`.
    fn state_of(&self, id: u64) -> Option<std::sync::Arc<ClusterState>> {
        let r = self.members.get(&id)?.replica.as_ref()?;
        let p = r.published();
        let s = p.read().ok()?.1.clone();
        Some(s)
    }

    /// What the workers do this tick: heartbeat, register, report their stages ready.
    fn workers_act(&mut self) {
        let now = self.now;
        for i in 0..self.workers.len() {
            if !self.workers[i].up {
                continue;
            }
            if let Some((_, _, at)) = self.workers[i].waiting {
                if now < at + RETRY {
                    continue;
                }
                self.workers[i].waiting = None; // timed out: asked again below
            }
            let running = self.running_replicas();
            let Some(&at) = running.choose(&mut self.rng) else { continue };
            let name = self.workers[i].name.clone();
            if !self.workers[i].registered {
                let cmd = Command::RegisterNode { node: fleet::node_record(&name) };
                self.workers[i].waiting = self.propose(at, cmd, Owner::Register(i));
                continue;
            }
            if now % fleet::HEARTBEAT_EVERY == i as u64 % fleet::HEARTBEAT_EVERY {
                for r in self.members.keys().copied().collect::<Vec<_>>() {
                    self.net.send(&mut self.rng, now, WORKER_BASE + i as u64, r, Wire::Heartbeat(i));
                }
            }
            if now % fleet::WATCH_EVERY == i as u64 % fleet::WATCH_EVERY {
                // its assignments, from the replica it asks (perhaps behind the leader)
                if let Some(cmd) = self.state_of(at).and_then(|s| self.workers[i].report(&s)) {
                    self.workers[i].waiting = self.propose(at, cmd, Owner::Report(i));
                }
            }
        }
    }

    /// The recovery loop of the replica that leads, as `recover::leader_tasks` runs it: a step
    /// every few ticks, its commands replicated one after the other, the rest of a step dropped
    /// when one is not.
    fn leader_acts(&mut self, id: u64) {
        let now = self.now;
        let Some(m) = self.members.get_mut(&id) else { return };
        let Some(r) = m.replica.as_ref() else { return };
        if !r.is_leader() {
            m.leader = None;
            return;
        }
        let task = m.leader.get_or_insert_with(|| LeaderTask::new(now));
        if task.waiting.is_some_and(|(_, _, at)| now >= at + RETRY) {
            task.failed();
        }
        if task.waiting.is_some() {
            return;
        }
        if task.queue.is_empty() && now >= task.last_step + fleet::RECONCILE_EVERY {
            task.last_step = now;
            let published = r.published();
            let Ok(state) = published.read().map(|p| p.1.clone()) else { return };
            let heard = Heard { now, since: task.since, heartbeats: &m.heartbeats };
            for action in task.reconciler.step(fleet::TICK * now as u32, &state, &heard) {
                if let brigade_coordinator::reconcile::Action::Apply { command, .. } = action {
                    task.queue.push_back(*command);
                }
            }
        }
        let Some(cmd) = task.queue.pop_front() else { return };
        let waiting = self.propose(id, cmd, Owner::Leader);
        if let Some(task) = self.members.get_mut(&id).and_then(|m| m.leader.as_mut()) {
            task.waiting = waiting;
        }
    }

    /// One tick of the virtual clock: ticks, deliveries, readies, workers and leaders.
    fn turn(&mut self) -> Result<(), String> {
        self.now += 1;
        let now = self.now;
        let ids: Vec<u64> = self.members.keys().copied().collect();
        for id in &ids {
            if self.running(*id) {
                if let Some(r) = self.members.get_mut(id).and_then(|m| m.replica.as_mut()) {
                    r.tick();
                }
            }
        }
        for e in self.net.due(now) {
            if e.to >= WORKER_BASE {
                let w = self.workers.get_mut((e.to - WORKER_BASE) as usize);
                if let (Some(w), Wire::Reregister(true)) = (w, &e.message) {
                    if w.up && w.registered {
                        w.registered = false;
                    }
                }
                continue;
            }
            let running = self.running(e.to);
            let Some(m) = self.members.get_mut(&e.to) else { continue };
            match m.replica.is_some() {
                true if running => self.deliver(e.to, e.message),
                true => m.backlog.push(e.message),
                false => {} // a dead process's socket: lost
            }
        }
        for id in ids {
            if !self.running(id) {
                continue;
            }
            let backlog = self.members.get_mut(&id).map(|m| std::mem::take(&mut m.backlog)).unwrap_or_default();
            for w in backlog {
                self.deliver(id, w);
            }
            let Some(r) = self.members.get_mut(&id).and_then(|m| m.replica.as_mut()) else { continue };
            let effects = r.ready().map_err(|e| format!("replica {id} at tick {now}: {e}"))?;
            self.report.max_term = self.report.max_term.max(r.status().term);
            self.carry_out(id, effects);
            if !self.workers.is_empty() {
                self.leader_acts(id);
            }
        }
        if self.setup.is_none() {
            self.workers_act();
        }
        Ok(())
    }

    /// A message for replica `id`, which is running.
    fn deliver(&mut self, id: u64, w: Wire) {
        let now = self.now;
        let Some(m) = self.members.get_mut(&id) else { return };
        let Some(r) = m.replica.as_mut() else { return };
        match w {
            Wire::Raft(msg) => r.step(msg),
            Wire::Heartbeat(i) => {
                // `Control.Heartbeat`: the leader's alone (a follower refuses it)
                if !r.is_leader() {
                    return;
                }
                let Some(name) = self.workers.get(i).map(|w| w.name.clone()) else { return };
                let published = r.published();
                let known_up =
                    published.read().is_ok_and(|p| p.1.nodes.get(&name).is_some_and(|n| n.state == NodeState::Up));
                m.heartbeats.insert(name, now);
                self.net.send(&mut self.rng, now, id, WORKER_BASE + i as u64, Wire::Reregister(!known_up));
            }
            Wire::Reregister(_) => {}
        }
    }

    fn carry_out(&mut self, id: u64, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::Send(mut msgs) => {
                    // raft-rs walks its peers in a hash map's order: by recipient (stably, each
                    // one's messages in raft's order), so that a seed gives one schedule
                    msgs.sort_by_key(|m| m.to);
                    for m in msgs {
                        let to = m.to;
                        self.net.send(&mut self.rng, self.now, id, to, Wire::Raft(m));
                    }
                }
                Effect::Peer { .. } | Effect::Published => {}
                Effect::Applied { index, by } => self.history.applied(id, index, by),
                Effect::Answer { ticket, answer } => {
                    if let Some(owner) = self.owners.remove(&(id, ticket)) {
                        self.answered(owner, (id, ticket), answer);
                        continue;
                    }
                    let outcome = match answer {
                        Answer::Proposed(Ok(_)) => match self.history.placed((id, ticket)) {
                            Some(index) => Outcome::Wrote { index },
                            None => {
                                self.history.fail(format!("replica {id} acknowledged {ticket} before applying it"));
                                continue;
                            }
                        },
                        Answer::Proposed(Err(e)) | Answer::Read(Err(e)) | Answer::Changed(Err(e)) => {
                            Outcome::Failed(e.to_string())
                        }
                        Answer::Read(Ok(())) => {
                            let key = match self.history.op((id, ticket)).map(|o| &o.kind) {
                                Some(Kind::Read { key }) => key.clone(),
                                other => {
                                    self.history.fail(format!("replica {id} answered a read to {other:?}"));
                                    continue;
                                }
                            };
                            let Some(r) = self.members.get(&id).and_then(|m| m.replica.as_ref()) else { continue };
                            let published = r.published();
                            let Ok(p) = published.read() else { continue };
                            Outcome::Read { index: p.0, value: p.1.admitted.get(&key).map(|a| a.fingerprint.clone()) }
                        }
                        Answer::Changed(Ok(())) => {
                            self.history.fail(format!("replica {id} answered a configuration change nobody made"));
                            continue;
                        }
                    };
                    self.history.answer((id, ticket), outcome);
                }
            }
        }
        let Some(m) = self.members.get_mut(&id) else { return };
        let Some(r) = m.replica.as_ref() else { return };
        let published = r.published();
        let Ok(p) = published.read() else { return };
        if m.published.is_some_and(|(index, _)| index == p.0) {
            return; // (an incarnation publishes one state per index)
        }
        let (index, d) = (p.0, digest(&p.1));
        let generation = p.1.deployments.get(DEPLOYMENT).map_or(0, |d| d.generation);
        if generation < m.generation {
            let why =
                format!("replica {id} saw the deployment go back from generation {} to {generation}", m.generation);
            self.history.fail(why);
        }
        m.generation = generation;
        m.published = Some((index, d));
        self.history.published(id, index, d);
    }

    /// The answer to a request of the set-up, a leader or a worker.
    fn answered(&mut self, owner: Owner, (id, ticket): (u64, Ticket), answer: Answer) {
        let ok = match &answer {
            Answer::Proposed(r) => r.as_ref().map(|_| ()).map_err(|e| e.to_string()),
            other => Err(format!("{other:?}")),
        };
        let mine = |w: Option<(u64, Ticket, u64)>| w.is_some_and(|(r, t, _)| (r, t) == (id, ticket));
        match owner {
            Owner::Setup => {
                if self.setup == Some((id, ticket)) {
                    self.setup = None;
                }
                if let Err(e) = ok {
                    self.setup_failed.get_or_insert(e);
                }
            }
            Owner::Leader => {
                if let Some(task) = self.members.get_mut(&id).and_then(|m| m.leader.as_mut()) {
                    if mine(task.waiting) {
                        task.waiting = None;
                        if ok.is_err() {
                            task.failed();
                        }
                    }
                }
            }
            Owner::Register(i) | Owner::Report(i) => {
                let Some(w) = self.workers.get_mut(i) else { return };
                if mine(w.waiting) {
                    w.waiting = None;
                    if matches!(owner, Owner::Register(_)) && ok.is_ok() && w.up {
                        w.registered = true;
                    }
                }
            }
        }
    }

    /// The one leader every replica follows, once there is one.
    fn agreed_leader(&self) -> Option<u64> {
        let mut leaders = self.members.values().map(|m| m.replica.as_ref().map(|r| r.leader_id()));
        let first = leaders.next()??;
        let is = self.members.get(&first)?.replica.as_ref()?.is_leader();
        (first != 0 && is && leaders.all(|l| l == Some(first))).then_some(first)
    }

    /// Before the faults: the workers, the model and the deployment, one command after the
    /// other at the leader.
    fn set_up(&mut self) -> Result<(), String> {
        let mut commands: std::collections::VecDeque<Command> = fleet::setup(self.workers.len())?.into();
        let deadline = self.now + 500;
        while self.now < deadline {
            self.turn()?;
            if let Some(e) = &self.setup_failed {
                return Err(format!("set-up refused: {e}"));
            }
            if self.setup.is_some() {
                continue;
            }
            let Some(leader) = self.agreed_leader() else { continue };
            match commands.pop_front() {
                Some(cmd) => self.setup = self.propose(leader, cmd, Owner::Setup).map(|(r, t, _)| (r, t)),
                None => return Ok(()),
            }
        }
        Err(format!("no set-up in 500 calm ticks ({} commands left)", commands.len()))
    }

    /// Everything heals; every replica and all but a few workers come back; the group must
    /// agree on a leader, take a write at every replica and end on one state that knows which
    /// workers are up and serves the deployment from them (or says why it cannot).
    fn heal(&mut self) -> Result<(), String> {
        self.net.heal();
        self.net.weather = Weather::CALM;
        for id in self.members.keys().copied().collect::<Vec<_>>() {
            if self.members.get(&id).is_some_and(|m| m.replica.is_none()) {
                self.start(id)?;
            } else if let Some(m) = self.members.get_mut(&id) {
                m.paused_until = 0;
            }
        }
        let stay_down = if self.workers.is_empty() { 0 } else { self.rng.random_range(0..=2.min(self.workers.len())) };
        let mut order: Vec<usize> = (0..self.workers.len()).collect();
        order.shuffle(&mut self.rng);
        for (k, i) in order.into_iter().enumerate() {
            let w = &mut self.workers[i];
            let up = k >= stay_down;
            if up != w.up {
                w.up = up;
                w.registered = false;
                w.waiting = None;
            }
        }
        let deadline = self.now + self.cfg.calm_ticks;
        // each replica's final write: (the op, the tick it was made); one unanswered for
        // RETRY ticks is made again, as a client whose call timed out would (raft drops a
        // proposal forwarded to a leader that just stepped down, and says nothing)
        let mut finals: BTreeMap<u64, (usize, u64)> = BTreeMap::new();
        while self.now < deadline {
            self.turn()?;
            if self.agreed_leader().is_some() {
                for id in self.members.keys().copied().collect::<Vec<_>>() {
                    let stale = finals
                        .get(&id)
                        .is_none_or(|(i, at)| self.history.ops()[*i].answered.is_none() && self.now >= at + RETRY);
                    if stale {
                        self.operate(id, "k0", true);
                        finals.insert(id, (self.history.ops().len() - 1, self.now));
                    }
                }
            }
            let acked = finals.len() == self.members.len()
                && finals
                    .values()
                    .all(|(i, _)| matches!(self.history.ops()[*i].answered, Some((_, Outcome::Wrote { .. }))));
            if acked && self.converged() && self.serving().is_ok() {
                return Ok(());
            }
        }
        let leader = self.agreed_leader();
        let states: Vec<String> = self
            .members
            .iter()
            .map(|(id, m)| match &m.replica {
                Some(r) => format!("{id}: {:?}", r.status()),
                None => format!("{id}: down"),
            })
            .collect();
        let finals: Vec<String> = finals
            .values()
            .map(|(i, _)| {
                let op = &self.history.ops()[*i];
                format!("{:?} answered {:?}, in the log at {:?}", op.id, op.answered, self.history.placed(op.id))
            })
            .collect();
        Err(format!(
            "{} calm ticks after healing: leader {leader:?}, final writes {finals:?}, replicas {states:?}, cluster: {:?}",
            self.cfg.calm_ticks,
            self.serving().err()
        ))
    }

    /// Whether the leader's state knows which workers are up and serves the deployment from
    /// workers that are up — or, where they cannot hold it, says why; what is amiss if not.
    fn serving(&self) -> Result<(), String> {
        if self.workers.is_empty() {
            return Ok(());
        }
        let leader = self.agreed_leader().ok_or("no leader")?;
        let state = self.state_of(leader).ok_or("the leader is down")?;
        for w in &self.workers {
            let known = state.nodes.get(&w.name).map(|n| n.state);
            let want = if w.up { NodeState::Up } else { NodeState::Down };
            if known != Some(want) {
                return Err(format!("worker {} is {want:?}, the state says {known:?}", w.name));
            }
        }
        let d = state.deployments.get(DEPLOYMENT).ok_or("the deployment is gone")?;
        if fleet::placeable(&state) {
            let ready = state.deployment_state(d) == DeploymentState::Ready;
            let on_up = d.stages.iter().all(|s| self.workers.iter().any(|w| w.up && w.name == s.node));
            if !(ready && on_up) {
                return Err(format!(
                    "deployment at generation {} not ready on workers that are up: {:?}",
                    d.generation, d.stages
                ));
            }
        } else if d.note.is_empty() {
            return Err("the deployment cannot be placed on the workers up and its note does not say so".into());
        }
        Ok(())
    }

    fn converged(&self) -> bool {
        let mut seen = None;
        for m in self.members.values() {
            let (Some(_), Some(p)) = (&m.replica, m.published) else { return false };
            if *seen.get_or_insert(p) != p {
                return false;
            }
        }
        true
    }
}

/// One run of `cfg` from `seed`: the report, or the first violation (with the seed's name).
pub fn run(seed: u64, cfg: &Config) -> Result<Report, String> {
    let go = || -> Result<Report, String> {
        let mut g = Group::new(seed, cfg.clone())?;
        g.set_up()?;
        let end = g.now + cfg.chaos_ticks;
        while g.now < end {
            g.weather_the_chaos()?;
            g.turn()?;
            if g.rng.random_bool(cfg.op_rate) {
                g.client();
            }
        }
        g.heal()?;
        g.history.check()?;
        let mut report = g.report.clone();
        for op in g.history.ops() {
            match &op.answered {
                Some((_, Outcome::Wrote { .. })) => report.writes_acked += 1,
                Some((_, Outcome::Read { .. })) => report.reads_answered += 1,
                Some((_, Outcome::Failed(_))) => report.refused += 1,
                None => report.unanswered += 1,
            }
        }
        report.last_index = g.history.last_index();
        report.messages_lost = g.net.lost;
        report.workers_down = g.workers.iter().filter(|w| !w.up).count() as u64;
        if let Some(s) = g.agreed_leader().and_then(|l| g.state_of(l)) {
            let d = s.deployments.get(DEPLOYMENT);
            report.generation = d.map_or(0, |d| d.generation);
            report.degraded = d.is_some_and(|d| !d.note.is_empty());
        }
        Ok(report)
    };
    go().map_err(|e| format!("seed {seed} ({} replicas, {} workers): {e}", cfg.replicas, cfg.workers))
}
