//! A linearizability checker in the manner of Knossos and Porcupine (the Wing–Gong–Lowe search
//! with memoised states), over a small model of the cluster state: for each deployment name,
//! whether it exists. Histories are split by name (operations on different names commute), and
//! each part is searched for an order that respects real time (an operation that returned
//! before another was invoked comes first) and the model.
//!
//! An operation whose outcome is unknown (a timeout, a replica that died under it) may have
//! taken effect at any time after its invocation, or never: it is given no return time and the
//! model accepts it with or without its effect.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// Deploy refused: the name exists.
    Exists,
    /// Undeploy refused: the name does not exist.
    Missing,
    /// No answer, or an error that says nothing of the state.
    Unknown,
}

#[derive(Debug, Clone)]
pub enum Op {
    Deploy(String, Outcome),
    Undeploy(String, Outcome),
    /// A read that promises the current state: the names that exist.
    Read(Vec<String>),
}

#[derive(Debug, Clone)]
pub struct Event {
    pub op: Op,
    pub call: Instant,
    /// `None` when the outcome is unknown.
    pub ret: Option<Instant>,
    pub client: usize,
}

/// One name's part of a history, for the search.
#[derive(Debug, Clone, Copy)]
enum KeyOp {
    Deploy(Outcome),
    Undeploy(Outcome),
    Read(bool),
}

/// The states an operation can leave when applied in state `exists` (none: it cannot be applied
/// there).
fn step(exists: bool, op: KeyOp) -> Vec<bool> {
    match op {
        KeyOp::Deploy(Outcome::Ok) if !exists => vec![true],
        KeyOp::Deploy(Outcome::Exists) if exists => vec![true],
        // took effect (possible only when absent), or did not
        KeyOp::Deploy(Outcome::Unknown) => {
            if exists {
                vec![true]
            } else {
                vec![true, false]
            }
        }
        KeyOp::Undeploy(Outcome::Ok) if exists => vec![false],
        KeyOp::Undeploy(Outcome::Missing) if !exists => vec![false],
        KeyOp::Undeploy(Outcome::Unknown) => {
            if exists {
                vec![false, true]
            } else {
                vec![false]
            }
        }
        KeyOp::Read(seen) if seen == exists => vec![exists],
        _ => vec![],
    }
}

/// Whether one name's operations can be ordered consistently.
fn check_key(ops: &[(Instant, Option<Instant>, KeyOp)]) -> bool {
    let words = ops.len().div_ceil(64).max(1);
    let has = |set: &[u64], i: usize| set[i / 64] & (1 << (i % 64)) != 0;
    let full = |set: &[u64]| (0..ops.len()).all(|i| has(set, i));
    let mut seen: HashSet<(Vec<u64>, bool)> = HashSet::new();
    let mut stack: Vec<(Vec<u64>, bool)> = vec![(vec![0; words], false)];
    while let Some((done, exists)) = stack.pop() {
        if full(&done) {
            return true;
        }
        if !seen.insert((done.clone(), exists)) {
            continue;
        }
        // the earliest return among the operations not yet placed: anything placed next must
        // have been invoked before it
        let horizon = ops.iter().enumerate().filter(|(i, _)| !has(&done, *i)).filter_map(|(_, o)| o.1).min();
        for (i, o) in ops.iter().enumerate() {
            if has(&done, i) || horizon.is_some_and(|h| o.0 > h) {
                continue;
            }
            for n in step(exists, o.2) {
                let mut next = done.clone();
                next[i / 64] |= 1 << (i % 64);
                stack.push((next, n));
            }
        }
    }
    false
}

/// Checks a whole history; `Err` names the first deployment whose operations cannot be
/// linearized, with its operations.
pub fn check(history: &[Event]) -> Result<usize, String> {
    let mut by_key: BTreeMap<String, Vec<(Instant, Option<Instant>, KeyOp)>> = BTreeMap::new();
    let keys: HashSet<String> = history
        .iter()
        .filter_map(|e| match &e.op {
            Op::Deploy(k, _) | Op::Undeploy(k, _) => Some(k.clone()),
            Op::Read(_) => None,
        })
        .collect();
    for e in history {
        match &e.op {
            Op::Deploy(k, o) => by_key.entry(k.clone()).or_default().push((e.call, e.ret, KeyOp::Deploy(*o))),
            Op::Undeploy(k, o) => by_key.entry(k.clone()).or_default().push((e.call, e.ret, KeyOp::Undeploy(*o))),
            Op::Read(names) => {
                for k in &keys {
                    by_key.entry(k.clone()).or_default().push((e.call, e.ret, KeyOp::Read(names.contains(k))));
                }
            }
        }
    }
    let mut checked = 0;
    for (k, ops) in &by_key {
        if !check_key(ops) {
            return Err(format!("operations on `{k}` are not linearizable: {ops:#?}"));
        }
        checked += ops.len();
    }
    Ok(checked)
}

/// Prints what a recorded history holds, requires at least `min` acknowledged changes and
/// `min` current reads, and checks it (`logs` on failure: the cluster's).
pub fn assert_linearizable(h: &[Event], under: &str, min: usize, logs: impl FnOnce() -> String) {
    let acked = h.iter().filter(|e| matches!(e.op, Op::Deploy(_, Outcome::Ok) | Op::Undeploy(_, Outcome::Ok))).count();
    let reads = h.iter().filter(|e| matches!(e.op, Op::Read(_))).count();
    let unknown = h.iter().filter(|e| e.ret.is_none()).count();
    eprintln!(
        "{} operations ({acked} acknowledged changes, {reads} current reads, {unknown} unknown) under {under}",
        h.len()
    );
    assert!(acked >= min && reads >= min, "too little happened to check: {acked} changes, {reads} reads");
    match check(h) {
        Ok(n) => eprintln!("linearizable: {n} operation instances"),
        Err(e) => panic!("{e}\n{}", logs()),
    }
}
