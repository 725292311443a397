//! The raft log on disk: entries, hard state, configuration and the latest snapshot in a redb
//! database (`raft.redb` in the data dir; redb commits are fsynced before they return), mirrored
//! in raft-rs's `MemStorage`, which serves the reads raft makes.
//!
//! A snapshot is the cluster state (JSON) at an applied index; one is written every
//! [`COMPACT_EVERY`] applied entries and the entries before it are dropped, which bounds the log.
//! On start the snapshot is loaded, then the entries after it: raft re-delivers the committed ones
//! and the state machine replays them, so no applied index needs storing.

use crate::CoordError;
use brigade_core::cluster::ClusterState;
use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::storage::MemStorage;
use raft::{GetEntriesContext, RaftState, Storage, StorageError};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

const ENTRIES: TableDefinition<u64, &[u8]> = TableDefinition::new("entries");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// Applied entries between snapshots.
pub const COMPACT_EVERY: u64 = 1024;

/// The index (and term) of the snapshot a bootstrapped group's log starts from.
pub const BOOTSTRAP_INDEX: u64 = 1;

/// The state machine as snapshots and readers see it: the applied index and the state at it,
/// published as one shared value (a reader takes the `Arc`, never a copy of the state).
pub type AppliedState = Arc<RwLock<(u64, Arc<ClusterState>)>>;

fn db_err(e: impl std::fmt::Display) -> CoordError {
    CoordError::Corrupt(format!("raft log: {e}"))
}

fn pb_err(what: &str, e: impl std::fmt::Display) -> CoordError {
    CoordError::Corrupt(format!("raft log: {what}: {e}"))
}

pub struct DiskStorage {
    mem: MemStorage,
    db: redb::Database,
    applied: AppliedState,
}

/// What was on disk when the log was opened.
pub struct Opened {
    pub storage: DiskStorage,
    /// The state the snapshot holds, and its index (0 and an empty state without one).
    pub snapshot_index: u64,
    pub state: ClusterState,
    /// Whether the log was empty (a replica that never ran).
    pub fresh: bool,
}

impl DiskStorage {
    /// Whether `dir` holds a raft log with anything in it (without keeping it open).
    pub fn holds_log(dir: &Path) -> Result<bool, CoordError> {
        let path = dir.join("raft.redb");
        match std::fs::metadata(&path) {
            Ok(m) if m.len() > 0 => {}
            Ok(_) => return Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(CoordError::io(&path, e)),
        }
        let db = redb::Database::open(&path).map_err(db_err)?;
        let tx = db.begin_read().map_err(db_err)?;
        let meta = match tx.open_table(META) {
            Ok(t) => t.get("hard_state").map_err(db_err)?.is_some() || t.get("snapshot").map_err(db_err)?.is_some(),
            Err(redb::TableError::TableDoesNotExist(_)) => false,
            Err(e) => return Err(db_err(e)),
        };
        let entries = match tx.open_table(ENTRIES) {
            Ok(t) => t.first().map_err(db_err)?.is_some(),
            Err(redb::TableError::TableDoesNotExist(_)) => false,
            Err(e) => return Err(db_err(e)),
        };
        Ok(meta || entries)
    }

    /// Opens (or creates) the log in `dir`. A fresh log of a bootstrapping replica starts with a
    /// snapshot at [`BOOTSTRAP_INDEX`] holding the group's members (`bootstrap`, id → address) as
    /// its configuration and state; a replica joining a running group passes none and learns
    /// everything from the leader.
    ///
    /// The members are in a snapshot, not in a configuration beside an empty log, because a
    /// joining replica replays the log from where it starts: a log whose first entries are the
    /// group's later changes ("add replica 4") would leave the newcomer with a configuration of
    /// itself alone, a group of one that elects itself and serves stale reads once the leader
    /// it followed goes away. With the log starting after a snapshot, the leader sends the
    /// snapshot, and the configuration in it, to every newcomer (raft-rs's own examples start
    /// their first node the same way).
    pub fn open(dir: &Path, bootstrap: &BTreeMap<u64, String>, applied: AppliedState) -> Result<Opened, CoordError> {
        let path = dir.join("raft.redb");
        let db = redb::Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => CoordError::FailedPrecondition(format!(
                "another coordinator process is using {} (one data dir per replica)",
                dir.display()
            )),
            e => db_err(e),
        })?;
        let mem = MemStorage::new();
        let mut snapshot_index = 0;
        let mut state = ClusterState::new();
        let (snap, hs, cs, entries) = {
            let tx = db.begin_read().map_err(db_err)?;
            let meta = match tx.open_table(META) {
                Ok(t) => Some(t),
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(db_err(e)),
            };
            let get = |k: &str| -> Result<Option<Vec<u8>>, CoordError> {
                match &meta {
                    Some(t) => Ok(t.get(k).map_err(db_err)?.map(|v| v.value().to_vec())),
                    None => Ok(None),
                }
            };
            let snap = get("snapshot")?;
            let hs = get("hard_state")?;
            let cs = get("conf_state")?;
            let mut entries = Vec::new();
            match tx.open_table(ENTRIES) {
                Ok(t) => {
                    for kv in t.iter().map_err(db_err)? {
                        let (_, v) = kv.map_err(db_err)?;
                        entries.push(Entry::parse_from_bytes(v.value()).map_err(|e| pb_err("entry", e))?);
                    }
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(db_err(e)),
            }
            (snap, hs, cs, entries)
        };
        let fresh = snap.is_none() && hs.is_none() && cs.is_none() && entries.is_empty();
        let storage = DiskStorage { mem, db, applied };
        if fresh {
            if !bootstrap.is_empty() {
                state.replicas = bootstrap.clone();
                let data = serde_json::to_vec(&state).map_err(|e| pb_err("bootstrap state", e))?;
                let mut s = Snapshot { data: data.into(), ..Default::default() };
                let m = s.mut_metadata();
                m.index = BOOTSTRAP_INDEX;
                m.term = BOOTSTRAP_INDEX;
                m.set_conf_state(ConfState { voters: bootstrap.keys().copied().collect(), ..Default::default() });
                storage.apply_snapshot(s)?;
                snapshot_index = BOOTSTRAP_INDEX;
            }
            return Ok(Opened { storage, snapshot_index, state, fresh });
        }
        {
            let mut core = storage.mem.wl();
            if let Some(bytes) = snap {
                let s = Snapshot::parse_from_bytes(&bytes).map_err(|e| pb_err("snapshot", e))?;
                snapshot_index = s.get_metadata().index;
                state = serde_json::from_slice(&s.data).map_err(|e| pb_err("snapshot state", e))?;
                core.apply_snapshot(s).map_err(|e| pb_err("snapshot", e))?;
            }
            // entries the snapshot covers may remain from before a crash between the two writes
            let entries: Vec<Entry> = entries.into_iter().filter(|e| e.index > snapshot_index).collect();
            core.append(&entries).map_err(|e| pb_err("entries", e))?;
            if let Some(bytes) = cs {
                core.set_conf_state(ConfState::parse_from_bytes(&bytes).map_err(|e| pb_err("conf state", e))?);
            }
            if let Some(bytes) = hs {
                core.set_hardstate(HardState::parse_from_bytes(&bytes).map_err(|e| pb_err("hard state", e))?);
            }
        }
        Ok(Opened { storage, snapshot_index, state, fresh })
    }

    fn put_meta(&self, key: &str, bytes: &[u8]) -> Result<(), CoordError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut t = tx.open_table(META).map_err(db_err)?;
            t.insert(key, bytes).map_err(db_err)?;
        }
        tx.commit().map_err(db_err)
    }

    /// Appends entries (replacing any suffix they conflict with), durably.
    pub fn append(&self, entries: &[Entry]) -> Result<(), CoordError> {
        let Some(first) = entries.first() else { return Ok(()) };
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut t = tx.open_table(ENTRIES).map_err(db_err)?;
            t.retain_in(first.index.., |_, _| false).map_err(db_err)?;
            for e in entries {
                let bytes = e.write_to_bytes().map_err(|x| pb_err("entry", x))?;
                t.insert(e.index, bytes.as_slice()).map_err(db_err)?;
            }
        }
        tx.commit().map_err(db_err)?;
        self.mem.wl().append(entries).map_err(|e| pb_err("entries", e))
    }

    pub fn set_hardstate(&self, hs: HardState) -> Result<(), CoordError> {
        self.put_meta("hard_state", &hs.write_to_bytes().map_err(|e| pb_err("hard state", e))?)?;
        self.mem.wl().set_hardstate(hs);
        Ok(())
    }

    /// Records the commit index (after `advance`, raft may commit without a new hard state).
    pub fn set_commit(&self, commit: u64) -> Result<(), CoordError> {
        let mut hs = self.mem.rl().hard_state().clone();
        if commit > hs.commit {
            hs.commit = commit;
            self.set_hardstate(hs)?;
        }
        Ok(())
    }

    pub fn set_conf_state(&self, cs: ConfState) -> Result<(), CoordError> {
        self.put_meta("conf_state", &cs.write_to_bytes().map_err(|e| pb_err("conf state", e))?)?;
        self.mem.wl().set_conf_state(cs);
        Ok(())
    }

    pub fn conf_state(&self) -> ConfState {
        self.mem.initial_state().map(|s| s.conf_state).unwrap_or_default()
    }

    /// A snapshot received from the leader replaces the log.
    pub fn apply_snapshot(&self, s: Snapshot) -> Result<(), CoordError> {
        let index = s.get_metadata().index;
        let bytes = s.write_to_bytes().map_err(|e| pb_err("snapshot", e))?;
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut m = tx.open_table(META).map_err(db_err)?;
            m.insert("snapshot", bytes.as_slice()).map_err(db_err)?;
            let cs = s.get_metadata().get_conf_state().write_to_bytes().map_err(|e| pb_err("conf state", e))?;
            m.insert("conf_state", cs.as_slice()).map_err(db_err)?;
            let mut t = tx.open_table(ENTRIES).map_err(db_err)?;
            t.retain_in(..=index, |_, _| false).map_err(db_err)?;
        }
        tx.commit().map_err(db_err)?;
        self.mem.wl().apply_snapshot(s).map_err(|e| pb_err("snapshot", e))
    }

    /// Writes a snapshot of the applied state and drops the entries it covers.
    pub fn compact(&self) -> Result<u64, CoordError> {
        let snap = self.build_snapshot().map_err(|e| pb_err("snapshot", e))?;
        let index = snap.get_metadata().index;
        let bytes = snap.write_to_bytes().map_err(|e| pb_err("snapshot", e))?;
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut m = tx.open_table(META).map_err(db_err)?;
            m.insert("snapshot", bytes.as_slice()).map_err(db_err)?;
            let mut t = tx.open_table(ENTRIES).map_err(db_err)?;
            t.retain_in(..index, |_, _| false).map_err(db_err)?;
        }
        tx.commit().map_err(db_err)?;
        self.mem.wl().compact(index).map_err(|e| pb_err("compact", e))?;
        Ok(index)
    }

    /// The applied state as a snapshot (its index, that entry's term, the configuration).
    fn build_snapshot(&self) -> raft::Result<Snapshot> {
        let (index, data) = {
            let a =
                self.applied.read().map_err(|_| raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable))?;
            let data = serde_json::to_vec(&*a.1)
                .map_err(|_| raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable))?;
            (a.0, data)
        };
        let term = self.mem.term(index)?;
        let mut s = Snapshot { data: data.into(), ..Default::default() };
        let m = s.mut_metadata();
        m.index = index;
        m.term = term;
        m.set_conf_state(self.conf_state());
        Ok(s)
    }

    pub fn first_index(&self) -> u64 {
        Storage::first_index(&self.mem).unwrap_or(1)
    }
}

impl Storage for DiskStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.mem.initial_state()
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        ctx: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.mem.entries(low, high, max_size, ctx)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        self.mem.term(idx)
    }

    fn first_index(&self) -> raft::Result<u64> {
        self.mem.first_index()
    }

    fn last_index(&self) -> raft::Result<u64> {
        self.mem.last_index()
    }

    /// The applied state, for a follower too far behind for entries.
    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let applied = self.applied.read().map(|a| a.0).unwrap_or(0);
        if applied < request_index {
            return Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable));
        }
        self.build_snapshot()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry { index, term, data: data.to_vec().into(), ..Default::default() }
    }

    /// A data dir and an empty applied state, as a replica starts with.
    fn scratch() -> (tempfile::TempDir, AppliedState) {
        (tempfile::tempdir().unwrap(), Arc::new(RwLock::new((0, Arc::new(ClusterState::new())))))
    }

    fn members(ids: &[u64]) -> BTreeMap<u64, String> {
        ids.iter().map(|i| (*i, format!("10.0.0.{i}:7070"))).collect()
    }

    #[test]
    fn a_bootstrapped_log_starts_from_a_snapshot_that_names_the_members() {
        let (dir, applied) = scratch();
        let o = DiskStorage::open(dir.path(), &members(&[1, 2, 3]), applied.clone()).unwrap();
        assert!(o.fresh);
        assert_eq!(o.snapshot_index, BOOTSTRAP_INDEX);
        assert_eq!(o.state.replicas, members(&[1, 2, 3]));
        let s = o.storage;
        // nothing before the snapshot can be sent as entries: a newcomer gets the snapshot
        assert_eq!(s.first_index(), BOOTSTRAP_INDEX + 1);
        assert!(s.entries(BOOTSTRAP_INDEX, BOOTSTRAP_INDEX + 1, None, GetEntriesContext::empty(false)).is_err());
        *applied.write().unwrap() = (o.snapshot_index, Arc::new(o.state.clone()));
        let snap = s.snapshot(0, 4).unwrap();
        assert_eq!(snap.get_metadata().get_conf_state().voters, vec![1, 2, 3]);
        let sent: ClusterState = serde_json::from_slice(&snap.data).unwrap();
        assert_eq!(sent.replicas, members(&[1, 2, 3]));
        // and a restart finds the same
        drop(s);
        let o = DiskStorage::open(dir.path(), &BTreeMap::new(), applied).unwrap();
        assert!(!o.fresh);
        assert_eq!((o.snapshot_index, o.state.replicas), (BOOTSTRAP_INDEX, members(&[1, 2, 3])));
        assert_eq!(o.storage.initial_state().unwrap().conf_state.voters, vec![1, 2, 3]);
        // a joining replica starts empty: no configuration until the leader's snapshot
        let (dir, applied) = scratch();
        let o = DiskStorage::open(dir.path(), &BTreeMap::new(), applied).unwrap();
        assert_eq!(o.snapshot_index, 0);
        assert!(o.storage.initial_state().unwrap().conf_state.voters.is_empty());
    }

    #[test]
    fn a_log_bootstrapped_by_an_older_build_hands_newcomers_a_snapshot_once_compacted() {
        // the older layout: the members in a configuration beside a log that starts at 1
        let (dir, applied) = scratch();
        let s = DiskStorage::open(dir.path(), &BTreeMap::new(), applied.clone()).unwrap().storage;
        s.set_conf_state(ConfState { voters: vec![1, 2, 3], ..Default::default() }).unwrap();
        s.append(&[entry(1, 1, b""), entry(2, 1, b"x")]).unwrap();
        // what the raft task checks when a replica is added
        assert_eq!(s.first_index(), 1, "entries from 1 would be sent to a newcomer");
        let mut state = ClusterState::new();
        state.replicas = members(&[1, 2, 3, 4]);
        *applied.write().unwrap() = (2, Arc::new(state));
        s.set_conf_state(ConfState { voters: vec![1, 2, 3, 4], ..Default::default() }).unwrap();
        assert_eq!(s.compact().unwrap(), 2);
        assert!(s.first_index() > 1);
        assert!(s.entries(1, 2, None, GetEntriesContext::empty(false)).is_err(), "entry 1 is gone");
        let snap = s.snapshot(0, 4).unwrap();
        assert_eq!(snap.get_metadata().get_conf_state().voters, vec![1, 2, 3, 4]);
    }

    #[test]
    fn the_log_survives_reopening_and_compaction() {
        let (dir, applied) = scratch();
        let o = DiskStorage::open(dir.path(), &members(&[1, 2, 3]), applied.clone()).unwrap();
        assert!(o.fresh);
        let s = o.storage;
        s.append(&[entry(2, 2, b"a"), entry(3, 2, b"b"), entry(4, 2, b"c")]).unwrap();
        // a new leader's entries replace a conflicting suffix
        s.append(&[entry(4, 3, b"C"), entry(5, 3, b"D")]).unwrap();
        let hs = HardState { term: 3, vote: 3, commit: 4, ..Default::default() };
        s.set_hardstate(hs.clone()).unwrap();
        drop(s);
        let o = DiskStorage::open(dir.path(), &members(&[9]), applied.clone()).unwrap();
        assert!(!o.fresh);
        let s = o.storage;
        let st = s.initial_state().unwrap();
        assert_eq!(st.hard_state, hs);
        assert_eq!(st.conf_state.voters, vec![1, 2, 3], "the stored configuration, not the argument");
        let got = s.entries(2, 6, None, GetEntriesContext::empty(false)).unwrap();
        assert_eq!(
            got.iter().map(|e| (e.index, e.term, e.data.to_vec())).collect::<Vec<_>>(),
            vec![(2, 2, b"a".to_vec()), (3, 2, b"b".to_vec()), (4, 3, b"C".to_vec()), (5, 3, b"D".to_vec())]
        );
        // a snapshot at the applied index 4 drops entries 2 and 3 and carries the state
        let mut state = ClusterState::new();
        state.next_generation = 42;
        *applied.write().unwrap() = (4, Arc::new(state.clone()));
        assert_eq!(s.compact().unwrap(), 4);
        assert_eq!(s.first_index(), 4, "entries before the snapshot index are dropped");
        drop(s);
        let o = DiskStorage::open(dir.path(), &BTreeMap::new(), applied).unwrap();
        assert_eq!(o.snapshot_index, 4);
        assert_eq!(o.state, state);
        assert_eq!(o.storage.last_index().unwrap(), 5);
        assert_eq!(o.storage.term(4).unwrap(), 3);
    }
}
