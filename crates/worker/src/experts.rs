//! Routed experts held on other nodes' expert stages, called from a pipeline stage's layers.
//!
//! A stage whose layers' experts are partly elsewhere loads its slice with an
//! [`ExpertSplit`] whose remote is [`LinkedExperts`]: in each mixture layer of a pass, the rows
//! routed to experts held elsewhere go, one EXPERTS frame per expert stage, over the links the
//! router keeps (QUIC with mTLS, or gRPC), and come back as EXPERTS_OUT in f32; the layer sums
//! them with the experts held here in its own order. Every routed expert is computed, none
//! dropped or substituted; a call that fails or times out fails the pass (its session), which
//! the driver resumes as it does when a stage dies.

use crate::node::peer;
use crate::router::{Peer, Router};
use crate::WorkerError;
use brigade_core::cluster::CarrierKind;
use brigade_core::LayerRange;
use brigade_model::{ExpertSplit, ExpertsCall, MatMul, ModelError, RemoteExperts};
use brigade_proto::v1::{FrameKind, StageAssignment};
use brigade_transport::frame::Frame;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// Longest a pass waits for its expert stages' answers (one deadline for all of them).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Most (expert, rows) pairs in one EXPERTS frame: they travel in its header, which is at
/// most [`brigade_transport::frame::MAX_HEADER`] bytes (a pair takes up to 10).
const MAX_PAIRS: usize = 256;

/// One expert stage's share of a call: its (expert, rows) pairs and their rows.
type Group = (Vec<(u32, usize)>, Vec<f32>);

/// The expert stages a pipeline stage calls, and which of them left a call unanswered.
struct Hosts {
    list: Vec<Host>,
    /// Per host, when a call to it last went unanswered (timed out, or its link closed): calls
    /// to it fail at once for `timeout` after, instead of each waiting that long (a
    /// batch's sessions one after another) while the driver resumes them and the coordinator
    /// re-places.
    down: std::sync::Mutex<Vec<Option<std::time::Instant>>>,
    /// How long a pass waits for its answers ([`CALL_TIMEOUT`]).
    timeout: Duration,
}

/// One expert stage: where it is and what it holds.
struct Host {
    peer: Peer,
    stage: u32,
    layers: LayerRange,
    ids: Range<u32>,
}

/// The expert stages a pipeline stage calls, over the router's links.
pub struct LinkedExperts {
    router: Arc<Router>,
    deployment: String,
    generation: u64,
    carrier: CarrierKind,
    hidden: usize,
    hosts: Arc<Hosts>,
    /// Most rows in one EXPERTS frame ([`max_rows`]).
    max_rows: usize,
    /// The experts' kernels compute each row alone ([`RemoteExperts::rows_independent`]): the
    /// model's experts pack on this CPU, and the expert stages run this build (an f32 carrier;
    /// a 16-bit one rounds the rows anyway, each row alone).
    rows_independent: bool,
}

impl LinkedExperts {
    /// The split of assignment `a` (a stage of the pipeline): `None` when all its layers'
    /// experts are held here.
    pub fn split(
        router: &Arc<Router>,
        a: &StageAssignment,
        carrier: CarrierKind,
        hidden: usize,
        rows_independent: bool,
    ) -> Result<Option<ExpertSplit>, WorkerError> {
        if a.experts_elsewhere.is_empty() {
            return Ok(None);
        }
        let mut hosts = Vec::with_capacity(a.experts_elsewhere.len());
        for h in &a.experts_elsewhere {
            let bad = |why: String| WorkerError::Manifest(format!("expert stage {}: {why}", h.stage));
            let layers =
                LayerRange::new(h.layer_start as usize, h.layer_end as usize).map_err(|e| bad(e.to_string()))?;
            if h.expert_start >= h.expert_end {
                return Err(bad(format!("experts {}..{}", h.expert_start, h.expert_end)));
            }
            let peer = peer(&h.node).ok_or_else(|| bad("no node".into()))?;
            hosts.push(Host { peer, stage: h.stage, layers, ids: h.expert_start..h.expert_end });
        }
        let elsewhere = hosts.iter().map(|h| (h.layers, h.ids.clone())).collect();
        let remote = Arc::new(LinkedExperts {
            router: router.clone(),
            deployment: a.deployment.clone(),
            generation: a.generation,
            carrier,
            hidden,
            hosts: Arc::new(Hosts {
                down: std::sync::Mutex::new(vec![None; hosts.len()]),
                list: hosts,
                timeout: CALL_TIMEOUT,
            }),
            max_rows: max_rows(hidden),
            rows_independent,
        });
        Ok(Some(ExpertSplit { elsewhere, remote }))
    }
}

/// The most rows of `hidden` f32 an EXPERTS frame's payload holds.
fn max_rows(hidden: usize) -> usize {
    (brigade_transport::frame::DEFAULT_MAX_PAYLOAD as usize / 4 / hidden.max(1)).max(1)
}

/// One EXPERTS frame of a call under way: its answer's receiver and its rows. Dropped, it
/// forgets the call (a late answer is dropped).
struct Sent {
    router: Arc<Router>,
    /// Index of the host in the expert stages called ([`Hosts`]).
    host: usize,
    id: u64,
    rx: std::sync::mpsc::Receiver<Frame>,
    rows: usize,
    /// When it was sent.
    at: std::time::Instant,
}

impl Drop for Sent {
    fn drop(&mut self) {
        self.router.forget_call(self.id);
    }
}

/// One EXPERTS frame to send: its host (index), (expert, rows) pairs and rows.
type Part<'a> = (usize, Vec<(u32, usize)>, &'a [f32]);

/// The groups' (expert, rows) pairs and rows cut into frames of at most `max_rows` rows and
/// [`MAX_PAIRS`] pairs each (an expert's rows split across two frames where one would be too
/// long), in order: (host, pairs, rows).
fn frames_of(groups: &[Group], d: usize, max_rows: usize) -> Vec<Part<'_>> {
    let max_rows = max_rows.max(1);
    let mut out = Vec::new();
    for (h, (calls, xs)) in groups.iter().enumerate() {
        let (mut pairs, mut first, mut rows) = (Vec::new(), 0usize, 0usize);
        for &(e, m) in calls {
            let mut left = m;
            while left > 0 {
                let take = left.min(max_rows - rows);
                pairs.push((e, take));
                (rows, left) = (rows + take, left - take);
                if rows == max_rows || pairs.len() == MAX_PAIRS {
                    out.push((h, std::mem::take(&mut pairs), &xs[first * d..(first + rows) * d]));
                    (first, rows) = (first + rows, 0);
                }
            }
        }
        if !pairs.is_empty() {
            out.push((h, pairs, &xs[first * d..(first + rows) * d]));
        }
    }
    out
}

impl Hosts {
    /// Marks host `h` as unanswering.
    fn set_down(&self, h: usize) {
        if let Ok(mut m) = self.down.lock() {
            m[h] = Some(std::time::Instant::now());
        }
    }

    /// Host `h` answered a call sent at `sent_at`: no longer down, unless it was marked so
    /// after that call went (an older answer read late does not clear a newer mark).
    fn set_up(&self, h: usize, sent_at: std::time::Instant) {
        if let Ok(mut m) = self.down.lock() {
            if m[h].is_some_and(|t| t <= sent_at) {
                m[h] = None;
            }
        }
    }

    /// How long ago host `h` last left a call unanswered, if within the timeout.
    fn down_for(&self, h: usize) -> Option<Duration> {
        let since = self.down.lock().ok()?.get(h).copied().flatten()?;
        Some(since.elapsed()).filter(|&e| e < self.timeout)
    }

    /// Waits, until `deadline`, for a frame's answer: the outputs of its rows of `hidden`.
    fn answer(&self, sent: &Sent, hidden: usize, deadline: std::time::Instant) -> Result<Vec<f32>, ModelError> {
        let host = &self.list[sent.host];
        let node = &host.peer.node;
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let frame = sent.rx.recv_timeout(left).map_err(|e| {
            self.set_down(sent.host);
            let why = match e {
                std::sync::mpsc::RecvTimeoutError::Timeout => format!("did not answer within {:?}", self.timeout),
                std::sync::mpsc::RecvTimeoutError::Disconnected => "the call was dropped before its answer".into(),
            };
            ModelError::Remote(format!("{node} (expert stage {}) {why}", host.stage))
        })?;
        self.set_up(sent.host, sent.at);
        if frame.kind() == Some(FrameKind::Error) {
            return Err(ModelError::Remote(format!("{node} (expert stage {}): {}", host.stage, frame.header.text)));
        }
        // (the rows before the values: a short call's answer is not decoded whatever its size)
        if frame.header.rows as usize != sent.rows {
            return Err(ModelError::Remote(format!(
                "{node} (expert stage {}) answered {} rows for {}",
                host.stage, frame.header.rows, sent.rows
            )));
        }
        let ys = frame
            .expert_outputs(hidden)
            .map_err(|e| ModelError::Remote(format!("{node} (expert stage {}): {e}", host.stage)))?;
        if ys.len() != sent.rows * hidden {
            return Err(ModelError::Remote(format!(
                "{node} (expert stage {}) answered {} values for {} rows of {hidden}",
                host.stage,
                ys.len(),
                sent.rows
            )));
        }
        Ok(ys)
    }
}

impl RemoteExperts for LinkedExperts {
    fn rows_independent(&self) -> bool {
        self.rows_independent
    }

    /// EXPERTS frames to each expert stage concerned (one each, or several where one would be
    /// longer than a frame may be), all sent now; the answers are awaited by the returned call
    /// and put back in the calls' order.
    fn call(&self, layer: usize, calls: &[(u32, usize)], xs: &[f32], mm: MatMul) -> Result<ExpertsCall, ModelError> {
        let d = self.hidden;
        // each call's host, and each host's calls and rows in the order they come
        let mut groups: Vec<Group> = self.hosts.list.iter().map(|_| Default::default()).collect();
        let mut order = Vec::with_capacity(calls.len());
        let mut at = 0usize;
        for &(e, m) in calls {
            let h = self
                .hosts
                .list
                .iter()
                .position(|h| h.layers.contains(layer) && h.ids.contains(&e))
                .ok_or_else(|| ModelError::Remote(format!("no expert stage holds expert {e} of layer {layer}")))?;
            let span = at.checked_add(m).and_then(|end| Some(at.checked_mul(d)?..end.checked_mul(d)?));
            let rows = span.and_then(|span| xs.get(span)).ok_or_else(|| {
                ModelError::Remote(format!("{} values for rows {at}..{} of {d}", xs.len(), at.saturating_add(m)))
            })?;
            groups[h].0.push((e, m));
            groups[h].1.extend_from_slice(rows);
            order.push((h, m));
            at += m;
        }
        for (h, _) in groups.iter().enumerate().filter(|(_, g)| !g.0.is_empty()) {
            if let Some(ago) = self.hosts.down_for(h) {
                let host = &self.hosts.list[h];
                return Err(ModelError::Remote(format!(
                    "{} (expert stage {}) left a call unanswered {:.1} s ago",
                    host.peer.node,
                    host.stage,
                    ago.as_secs_f64()
                )));
            }
        }
        let mut sent: Vec<Sent> = Vec::new();
        for (h, pairs, rows) in frames_of(&groups, d, self.max_rows) {
            let host = &self.hosts.list[h];
            let mut frame = Frame::experts(layer as u32, &pairs, rows, d as u64, mm == MatMul::Rows)
                .map_err(|e| ModelError::Remote(format!("expert stage {}: {e}", host.stage)))?;
            let (id, rx) = self.router.new_call(&host.peer.node);
            frame = frame.in_session(&self.deployment, self.generation, id);
            frame.header.stage = host.stage;
            let at = std::time::Instant::now();
            sent.push(Sent { router: self.router.clone(), host: h, id, rx, rows: rows.len() / d, at });
            if let Err(e) = self.router.send_blocking(&host.peer, self.carrier, frame) {
                // (a frame this node cannot encode is no fault of the host's)
                if matches!(e, WorkerError::Link(_)) {
                    self.hosts.set_down(h);
                }
                return Err(ModelError::Remote(format!("{} (expert stage {}): {e}", host.peer.node, host.stage)));
            }
        }
        let deadline = std::time::Instant::now() + self.hosts.timeout;
        let hosts = self.hosts.clone();
        Ok(ExpertsCall::later(move || {
            // each host's answers, its frames' in order
            let mut answers: Vec<Vec<f32>> = hosts.list.iter().map(|_| Vec::new()).collect();
            for s in &sent {
                // (an error drops `sent`: the calls not waited for forget their late answers)
                let ys = hosts.answer(s, d, deadline)?;
                answers[s.host].extend_from_slice(&ys);
            }
            // back in the calls' order
            let mut out = Vec::with_capacity(order.iter().map(|(_, m)| m * d).sum());
            let mut cursor = vec![0usize; answers.len()];
            for (h, m) in order {
                out.extend_from_slice(&answers[h][cursor[h] * d..(cursor[h] + m) * d]);
                cursor[h] += m;
            }
            Ok(out)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_cut_by_rows_and_pairs_in_order() {
        let d = 2;
        let rows = |n: usize, from: f32| (0..n * d).map(|i| from + i as f32).collect::<Vec<f32>>();
        let groups: Vec<Group> = vec![(vec![(1, 5), (2, 3)], rows(8, 0.0)), (Vec::new(), Vec::new())];
        let got = frames_of(&groups, d, 4);
        let pairs: Vec<_> = got.iter().map(|(h, p, xs)| (*h, p.clone(), xs.len())).collect();
        assert_eq!(pairs, vec![(0, vec![(1, 4)], 8), (0, vec![(1, 1), (2, 3)], 8)]);
        assert_eq!(got[1].2[0], 8.0, "the second frame starts at row 4");
        // pairs past MAX_PAIRS go in a frame of their own
        let many: Vec<(u32, usize)> = (0..MAX_PAIRS as u32 + 3).map(|e| (e, 1)).collect();
        let n = many.len();
        let groups: Vec<Group> = vec![(many, rows(n, 0.0))];
        let got = frames_of(&groups, d, 1 << 20);
        assert_eq!(got.iter().map(|f| f.1.len()).collect::<Vec<_>>(), vec![MAX_PAIRS, 3]);
        assert_eq!(got.iter().map(|f| f.2.len()).sum::<usize>(), n * d);
    }

    /// An expert stage's answers, over several frames (rows cut 3 by 3), are the shard's; a host
    /// that leaves a call unanswered fails it at the timeout, and the next calls to it at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_cut_into_frames_compute_what_the_shard_does_and_a_silent_host_fails_fast() {
        let dir = tempfile::tempdir().unwrap();
        let shard = crate::router::tests::tiny_shard(dir.path(), 0..4);
        let layers = LayerRange::new(0, 2).unwrap();
        let (r, _) = crate::router::tests::router("w2");
        r.add_shard("d", 3, 7, shard.clone(), vec!["w2".into()]);
        let host = |node: &str, stage: u32| Host {
            peer: crate::router::Peer { node: node.into(), address: "127.0.0.1:9".into() },
            stage,
            layers,
            ids: 0..4,
        };
        let linked = |hosts: Vec<Host>, timeout: Duration| LinkedExperts {
            router: r.clone(),
            deployment: "d".into(),
            generation: 7,
            carrier: CarrierKind::Quic,
            hidden: 64,
            hosts: Arc::new(Hosts { down: std::sync::Mutex::new(vec![None; hosts.len()]), list: hosts, timeout }),
            max_rows: 3,
            rows_independent: true,
        };
        let here = linked(vec![host("w2", 3)], Duration::from_secs(10));
        let silent = linked(vec![host("w9", 3)], Duration::from_millis(300));
        let calls = [(1u32, 2usize), (3, 5)];
        let xs: Vec<f32> = (0..7 * 64).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
        tokio::task::spawn_blocking(move || {
            let got = here.call(1, &calls, &xs, MatMul::Rows).unwrap().wait().unwrap();
            assert_eq!(got, shard.compute(1, &calls, &xs, MatMul::Rows).unwrap());
            let t0 = std::time::Instant::now();
            let e = silent.call(1, &calls, &xs, MatMul::Rows).unwrap().wait().unwrap_err().to_string();
            assert!(e.contains("w9 (expert stage 3) did not answer within 300ms"), "{e}");
            assert!(t0.elapsed() < Duration::from_secs(5), "one deadline for every frame: {:?}", t0.elapsed());
            let t0 = std::time::Instant::now();
            let e = silent.call(1, &calls, &xs, MatMul::Rows).err().unwrap().to_string();
            assert!(e.contains("w9 (expert stage 3) left a call unanswered"), "{e}");
            assert!(t0.elapsed() < Duration::from_millis(100));
        })
        .await
        .unwrap();
    }
}
