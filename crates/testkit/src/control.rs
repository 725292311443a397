//! The coordinator's control plane under faults. A group of raft replicas — the production
//! [`Replica`], each with its redb log in its own directory — runs on a virtual clock over a
//! [`Net`]. Clients write and read registers (`AdmitNode` commands: the node name is the key,
//! the certificate fingerprint the value) at any replica, while a schedule drawn from one seed
//! kills and restarts replicas (a restart reopens the log from disk), pauses them, partitions
//! the network (both ways and one way), and changes its weather (loss, duplication, delay).
//! Then the network heals, every replica comes back, and the group must elect a leader, take a
//! write at every replica and converge on one state. The [`History`] of what clients saw must be
//! linearizable throughout.

use crate::history::{History, Kind, Outcome};
use crate::net::{Net, Weather};
use brigade_coordinator::raft::{Answer, Effect, Message, RaftOptions, Replica, Tuning};
use brigade_core::cluster::Command;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
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
}

impl Default for Config {
    fn default() -> Self {
        Config { replicas: 3, chaos_ticks: 300, calm_ticks: 200, compact_every: 16, op_rate: 0.3 }
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
    backlog: Vec<Message>,
}

struct Group {
    cfg: Config,
    rng: ChaCha8Rng,
    now: u64,
    net: Net<Message>,
    members: BTreeMap<u64, Member>,
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
            members.insert(id, Member { opts, replica: None, paused_until: 0, election_ticks, backlog: Vec::new() });
        }
        let mut g = Group {
            cfg,
            rng,
            now: 0,
            net: Net::default(),
            members,
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
        Ok(())
    }

    fn up(&self) -> Vec<u64> {
        self.members.iter().filter(|(_, m)| m.replica.is_some()).map(|(id, _)| *id).collect()
    }

    fn running(&self, id: u64) -> bool {
        self.members.get(&id).is_some_and(|m| m.replica.is_some() && m.paused_until <= self.now)
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
            let running: Vec<u64> = up.iter().copied().filter(|id| self.running(*id)).collect();
            if let Some(&id) = running.choose(&mut self.rng) {
                let until = self.now + self.rng.random_range(5..40);
                if let Some(m) = self.members.get_mut(&id) {
                    m.paused_until = until;
                }
                self.report.pauses += 1;
            }
        } else if roll < 0.06 {
            self.report.partitions += 1;
            let ids: Vec<u64> = self.members.keys().copied().collect();
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
        }
        Ok(())
    }

    /// A client operation at a random running replica.
    fn client(&mut self) {
        let running: Vec<u64> = self.up().into_iter().filter(|id| self.running(*id)).collect();
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

    /// One tick of the virtual clock: ticks, deliveries, readies.
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
            let running = self.running(e.to);
            let Some(m) = self.members.get_mut(&e.to) else { continue };
            match m.replica.as_mut() {
                Some(r) if running => r.step(e.message),
                Some(_) => m.backlog.push(e.message),
                None => {} // a dead process's socket: lost
            }
        }
        for id in ids {
            if !self.running(id) {
                continue;
            }
            let Some(m) = self.members.get_mut(&id) else { continue };
            let Some(r) = m.replica.as_mut() else { continue };
            for msg in std::mem::take(&mut m.backlog) {
                r.step(msg);
            }
            let effects = r.ready().map_err(|e| format!("replica {id} at tick {now}: {e}"))?;
            self.report.max_term = self.report.max_term.max(r.status().term);
            self.carry_out(id, effects);
        }
        Ok(())
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
                        self.net.send(&mut self.rng, self.now, id, to, m);
                    }
                }
                Effect::Peer { .. } | Effect::Published => {}
                Effect::Applied { index, by } => self.history.applied(id, index, by),
                Effect::Answer { ticket, answer } => {
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
        if let Some(r) = self.members.get(&id).and_then(|m| m.replica.as_ref()) {
            if let Ok(p) = r.published().read() {
                let (index, d) = (p.0, digest(&p.1));
                self.history.published(id, index, d);
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

    /// Everything heals; every replica must come back, agree on a leader, take a write and end
    /// on one state.
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
            if acked && self.converged() {
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
            "{} calm ticks after healing: leader {leader:?}, final writes {finals:?}, replicas {states:?}",
            self.cfg.calm_ticks
        ))
    }

    fn converged(&self) -> bool {
        let mut seen = None;
        for m in self.members.values() {
            let Some(r) = &m.replica else { return false };
            let Ok(p) = r.published().read().map(|p| (p.0, digest(&p.1))) else { return false };
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
        while g.now < cfg.chaos_ticks {
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
        Ok(report)
    };
    go().map_err(|e| format!("seed {seed} ({} replicas): {e}", cfg.replicas))
}
