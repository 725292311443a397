//! What clients saw of a replicated register store, and the check that it is linearizable.
//!
//! The log orders every write: a write's linearization point is its log index, a read's is the
//! applied index of the state it returned. The history is linearizable in that order when
//! (1) the replicas agree on the proposal at every index, and no proposal sits at two;
//! (2) every acknowledged write is in the log where its acknowledgement said, and a refused one
//! is nowhere; (3) real time is respected: an operation invoked after a write was acknowledged
//! or a read answered sits after it (a write strictly, a read at or after); (4) every read
//! returned the value of the last write to its key at or before its index.

use std::collections::{BTreeMap, HashMap};

/// A proposal's name in the log: the proposing replica and its ticket.
pub type ProposalId = (u64, u64);

/// What an operation did.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    Write { key: String, value: String },
    Read { key: String },
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Acknowledged, applied at this index.
    Wrote { index: u64 },
    /// Answered with the state at this applied index.
    Read { index: u64, value: Option<String> },
    /// Refused (the write must not be in the log).
    Failed(String),
}

#[derive(Debug, Clone)]
pub struct Op {
    pub id: ProposalId,
    pub kind: Kind,
    /// Logical times (one counter for every invocation and answer).
    pub invoked: u64,
    pub answered: Option<(u64, Outcome)>,
}

/// The record of one run.
#[derive(Debug, Default)]
pub struct History {
    clock: u64,
    ops: Vec<Op>,
    by_id: HashMap<ProposalId, usize>,
    /// index → the proposal there (`None`: a leader's empty entry), as replicas applied it.
    log: BTreeMap<u64, Option<ProposalId>>,
    placed: HashMap<ProposalId, u64>,
    /// Proposals of the cluster's own (set-up, workers, the leader's recovery): in the log,
    /// touching no client's key.
    background: std::collections::HashSet<ProposalId>,
    /// applied index → a digest of the state there, as replicas published it.
    states: BTreeMap<u64, (u64, u64)>,
    /// The first disagreement seen while recording.
    broken: Option<String>,
}

impl History {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// A client asked replica `id.0` (ticket `id.1`).
    pub fn invoke(&mut self, id: ProposalId, kind: Kind) {
        let invoked = self.tick();
        self.by_id.insert(id, self.ops.len());
        self.ops.push(Op { id, kind, invoked, answered: None });
    }

    /// A proposal of the cluster's own, made at replica `id.0` with ticket `id.1`.
    pub fn background(&mut self, id: ProposalId) {
        self.background.insert(id);
    }

    pub fn op(&self, id: ProposalId) -> Option<&Op> {
        self.by_id.get(&id).map(|i| &self.ops[*i])
    }

    /// The answer to `id`; an answer to nothing asked, or a second answer, is a violation.
    pub fn answer(&mut self, id: ProposalId, outcome: Outcome) {
        let at = self.tick();
        let Some(i) = self.by_id.get(&id).copied() else {
            return self.fail(format!("an answer to {id:?}, which nobody asked: {outcome:?}"));
        };
        if let Some(before) = &self.ops[i].answered {
            return self.fail(format!("{id:?} answered twice: {before:?}, then {outcome:?}"));
        }
        self.ops[i].answered = Some((at, outcome));
    }

    /// Replica `replica` applied `by` at `index`.
    pub fn applied(&mut self, replica: u64, index: u64, by: Option<ProposalId>) {
        match self.log.get(&index) {
            Some(seen) if *seen != by => {
                return self.fail(format!(
                    "replicas disagree on log index {index}: {seen:?} before, {by:?} on replica {replica}"
                ))
            }
            Some(_) => {}
            None => {
                self.log.insert(index, by);
            }
        }
        if let Some(p) = by {
            match self.placed.insert(p, index) {
                Some(other) if other != index => {
                    self.fail(format!("proposal {p:?} is in the log twice, at {other} and {index}"))
                }
                _ => {}
            }
        }
    }

    /// Where proposal `p` sits in the log, as far as any replica applied it.
    pub fn placed(&self, p: ProposalId) -> Option<u64> {
        self.placed.get(&p).copied()
    }

    /// Replica `replica` published the state of digest `digest` at applied index `index`.
    pub fn published(&mut self, replica: u64, index: u64, digest: u64) {
        match self.states.get(&index) {
            Some((r, d)) if *d != digest => self.fail(format!(
                "replicas {r} and {replica} hold different states at applied index {index} ({d:016x} ≠ {digest:016x})"
            )),
            Some(_) => {}
            None => {
                self.states.insert(index, (replica, digest));
            }
        }
    }

    pub fn fail(&mut self, why: String) {
        if self.broken.is_none() {
            self.broken = Some(why);
        }
    }

    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The highest index any replica applied.
    pub fn last_index(&self) -> u64 {
        self.log.keys().next_back().copied().unwrap_or(0)
    }

    /// Checks the whole history (see the module's doc); the first violation found.
    pub fn check(&self) -> Result<(), String> {
        if let Some(b) = &self.broken {
            return Err(b.clone());
        }
        // the log has no hole: every index up to the last was applied somewhere (a replica
        // that took a snapshot got it from one that applied the entries)
        if let Some(first) = self.log.keys().next() {
            let want = self.last_index() - first + 1;
            if self.log.len() as u64 != want {
                let missing = (*first..=self.last_index()).find(|i| !self.log.contains_key(i));
                return Err(format!("log index {missing:?} was applied on no replica"));
            }
        }
        for (index, by) in &self.log {
            if let Some(p) = by.filter(|p| !self.background.contains(p)) {
                match self.op(p) {
                    Some(Op { kind: Kind::Write { .. }, .. }) => {}
                    other => return Err(format!("log index {index} holds {p:?}, which nobody proposed: {other:?}")),
                }
            }
        }
        // (2) acknowledged writes where they were acknowledged, refused ones nowhere
        for op in &self.ops {
            match (&op.kind, &op.answered) {
                (Kind::Write { .. }, Some((_, Outcome::Wrote { index }))) if self.placed(op.id) != Some(*index) => {
                    return Err(format!(
                        "write {:?} was acknowledged at index {index} but the log holds it at {:?}",
                        op.id,
                        self.placed(op.id)
                    ))
                }
                (Kind::Write { .. }, Some((_, Outcome::Failed(why)))) if self.placed(op.id).is_some() => {
                    return Err(format!("write {:?} was refused ({why}) yet applied", op.id))
                }
                (Kind::Write { .. }, Some((_, Outcome::Read { .. })))
                | (Kind::Read { .. }, Some((_, Outcome::Wrote { .. }))) => {
                    return Err(format!("{:?} got the wrong kind of answer: {:?}", op.id, op.answered))
                }
                _ => {}
            }
        }
        // (3) real time: sweep the invocations and answers in logical time, carrying the highest
        // index answered so far
        let mut events: Vec<(u64, usize, bool)> = Vec::new();
        for (i, op) in self.ops.iter().enumerate() {
            events.push((op.invoked, i, true));
            if let Some((at, _)) = &op.answered {
                events.push((*at, i, false));
            }
        }
        events.sort_unstable();
        let mut floor = 0u64;
        let mut floor_of: Vec<u64> = vec![0; self.ops.len()];
        for (_, i, invoke) in events {
            let op = &self.ops[i];
            if invoke {
                floor_of[i] = floor;
                continue;
            }
            match &op.answered {
                Some((_, Outcome::Wrote { index })) | Some((_, Outcome::Read { index, .. })) => {
                    floor = floor.max(*index);
                }
                _ => {}
            }
        }
        for (i, op) in self.ops.iter().enumerate() {
            let floor = floor_of[i];
            match (&op.kind, &op.answered) {
                (Kind::Write { .. }, _) => {
                    if let Some(index) = self.placed(op.id).filter(|ix| *ix <= floor) {
                        return Err(format!(
                            "write {:?} sits at index {index}, but before it was invoked a client had seen index {floor}",
                            op.id
                        ));
                    }
                }
                (Kind::Read { .. }, Some((_, Outcome::Read { index, .. }))) if *index < floor => {
                    return Err(format!(
                        "stale read {:?}: it returned the state at index {index}, but before it was invoked a client had seen index {floor}",
                        op.id
                    ));
                }
                _ => {}
            }
        }
        // (4) every read returned the last write to its key at or before its index
        let mut writes: HashMap<&str, BTreeMap<u64, &str>> = HashMap::new();
        for (index, by) in &self.log {
            if let Some(Op { kind: Kind::Write { key, value }, .. }) = by.and_then(|p| self.op(p)) {
                writes.entry(key).or_default().insert(*index, value);
            }
        }
        for op in &self.ops {
            if let (Kind::Read { key }, Some((_, Outcome::Read { index, value }))) = (&op.kind, &op.answered) {
                let want = writes.get(key.as_str()).and_then(|w| w.range(..=*index).next_back()).map(|(_, v)| *v);
                if value.as_deref() != want {
                    return Err(format!(
                        "read {:?} of `{key}` at index {index} returned {value:?}; the log says {want:?}",
                        op.id
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(key: &str, value: &str) -> Kind {
        Kind::Write { key: key.into(), value: value.into() }
    }

    fn r(key: &str) -> Kind {
        Kind::Read { key: key.into() }
    }

    /// Two replicas; a write acknowledged at index 2, then a read.
    fn base() -> History {
        let mut h = History::default();
        h.invoke((1, 1), w("k", "a"));
        h.applied(1, 2, Some((1, 1)));
        h.applied(2, 2, Some((1, 1)));
        h.answer((1, 1), Outcome::Wrote { index: 2 });
        h
    }

    #[test]
    fn a_linearizable_history_passes() {
        let mut h = base();
        h.invoke((2, 1), r("k"));
        h.answer((2, 1), Outcome::Read { index: 2, value: Some("a".into()) });
        h.invoke((2, 2), w("k", "b"));
        h.applied(2, 3, None);
        h.applied(2, 4, Some((2, 2)));
        h.invoke((1, 2), r("k"));
        // a read concurrent with the write may see either
        h.answer((1, 2), Outcome::Read { index: 3, value: Some("a".into()) });
        h.answer((2, 2), Outcome::Wrote { index: 4 });
        assert_eq!(h.check(), Ok(()));
    }

    #[test]
    fn a_stale_read_is_caught() {
        let mut h = base();
        h.applied(1, 1, None);
        h.invoke((2, 1), r("k"));
        h.answer((2, 1), Outcome::Read { index: 1, value: None });
        let e = h.check().unwrap_err();
        assert!(e.contains("stale read"), "{e}");
    }

    #[test]
    fn a_read_of_a_value_the_log_does_not_hold_there_is_caught() {
        let mut h = base();
        h.invoke((2, 1), r("k"));
        h.answer((2, 1), Outcome::Read { index: 2, value: Some("z".into()) });
        let e = h.check().unwrap_err();
        assert!(e.contains("the log says"), "{e}");
    }

    #[test]
    fn a_lost_or_moved_acknowledged_write_is_caught() {
        let mut h = History::default();
        h.invoke((1, 1), w("k", "a"));
        h.answer((1, 1), Outcome::Wrote { index: 2 });
        let e = h.check().unwrap_err();
        assert!(e.contains("acknowledged at index 2"), "{e}");
    }

    #[test]
    fn disagreement_and_double_placement_are_caught() {
        let mut h = base();
        h.invoke((2, 5), w("k", "b"));
        h.applied(2, 2, Some((2, 5)));
        assert!(h.check().unwrap_err().contains("disagree on log index 2"));
        let mut h = base();
        h.applied(2, 3, Some((1, 1)));
        assert!(h.check().unwrap_err().contains("in the log twice"));
        let mut h = base();
        h.published(1, 2, 7);
        h.published(2, 2, 8);
        assert!(h.check().unwrap_err().contains("different states"));
    }

    #[test]
    fn a_write_placed_before_what_a_client_already_saw_is_caught() {
        let mut h = base();
        h.invoke((2, 1), w("k", "b"));
        h.applied(2, 1, Some((2, 1)));
        let e = h.check().unwrap_err();
        assert!(e.contains("had seen index 2"), "{e}");
    }

    #[test]
    fn holes_and_unknown_entries_are_caught() {
        let mut h = base();
        h.applied(1, 4, None);
        assert!(h.check().unwrap_err().contains("index Some(3)"));
        let mut h = base();
        h.applied(1, 3, Some((9, 9)));
        assert!(h.check().unwrap_err().contains("nobody proposed"));
        let mut h = base();
        h.background((9, 9));
        h.applied(1, 3, Some((9, 9)));
        assert_eq!(h.check(), Ok(()), "the cluster's own proposals");
    }
}
