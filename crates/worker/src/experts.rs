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

/// Longest a pass waits for an expert stage's answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// One expert stage's share of a call: its (expert, rows) pairs and their rows.
type Group = (Vec<(u32, usize)>, Vec<f32>);

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
    hosts: Vec<Host>,
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
            hosts,
            rows_independent,
        });
        Ok(Some(ExpertSplit { elsewhere, remote }))
    }
}

/// One expert stage's part of a call under way: its answer's receiver and its rows.
struct Sent {
    node: String,
    stage: u32,
    id: u64,
    rx: std::sync::mpsc::Receiver<Frame>,
    rows: usize,
}

/// Waits for a part's answer: the outputs of its rows.
fn answer(router: &Router, sent: &Sent, hidden: usize) -> Result<Vec<f32>, ModelError> {
    let node = &sent.node;
    let frame = sent.rx.recv_timeout(CALL_TIMEOUT).map_err(|_| {
        router.forget_call(sent.id);
        ModelError::Remote(format!("{node} (expert stage {}) did not answer within {CALL_TIMEOUT:?}", sent.stage))
    })?;
    if frame.kind() == Some(FrameKind::Error) {
        return Err(ModelError::Remote(format!("{node}: {}", frame.header.text)));
    }
    let ys = frame.expert_outputs(hidden).map_err(|e| ModelError::Remote(format!("{node}: {e}")))?;
    if ys.len() != sent.rows * hidden {
        return Err(ModelError::Remote(format!(
            "{node} answered {} values for {} rows of {hidden}",
            ys.len(),
            sent.rows
        )));
    }
    Ok(ys)
}

impl RemoteExperts for LinkedExperts {
    fn rows_independent(&self) -> bool {
        self.rows_independent
    }

    /// One EXPERTS frame to each expert stage concerned, all sent now; the answers are awaited
    /// by the returned call and put back in the calls' order.
    fn call(&self, layer: usize, calls: &[(u32, usize)], xs: &[f32], mm: MatMul) -> Result<ExpertsCall, ModelError> {
        let d = self.hidden;
        // each call's host, and each host's calls and rows in the order they come
        let mut groups: Vec<Group> = self.hosts.iter().map(|_| Default::default()).collect();
        let mut order = Vec::with_capacity(calls.len());
        let mut at = 0usize;
        for &(e, m) in calls {
            let h = self
                .hosts
                .iter()
                .position(|h| h.layers.contains(layer) && h.ids.contains(&e))
                .ok_or_else(|| ModelError::Remote(format!("no expert stage holds expert {e} of layer {layer}")))?;
            let rows = xs
                .get(at * d..(at + m) * d)
                .ok_or_else(|| ModelError::Remote(format!("{} values for the calls' rows of {d}", xs.len())))?;
            groups[h].0.push((e, m));
            groups[h].1.extend_from_slice(rows);
            order.push((h, m));
            at += m;
        }
        let mut sent: Vec<Option<Sent>> = self.hosts.iter().map(|_| None).collect();
        let forget = |sent: &[Option<Sent>]| sent.iter().flatten().for_each(|s| self.router.forget_call(s.id));
        for (h, (calls, rows)) in groups.iter().enumerate().filter(|(_, g)| !g.0.is_empty()) {
            let host = &self.hosts[h];
            let mut frame = Frame::experts(layer as u32, calls, rows, d as u64, mm == MatMul::Rows)
                .map_err(|e| ModelError::Remote(e.to_string()))?;
            let (id, rx) = self.router.new_call();
            frame = frame.in_session(&self.deployment, self.generation, id);
            frame.header.stage = host.stage;
            let part = Sent { node: host.peer.node.clone(), stage: host.stage, id, rx, rows: rows.len() / d };
            sent[h] = Some(part);
            if let Err(e) = self.router.send_blocking(&host.peer, self.carrier, frame) {
                forget(&sent);
                return Err(ModelError::Remote(format!("{}: {e}", host.peer.node)));
            }
        }
        let router = self.router.clone();
        Ok(ExpertsCall::later(move || {
            let mut answers = Vec::with_capacity(sent.len());
            for s in &sent {
                match s.as_ref().map(|s| answer(&router, s, d)).transpose() {
                    Ok(a) => answers.push(a),
                    Err(e) => {
                        // the calls not waited for: their late answers are dropped
                        sent.iter().flatten().for_each(|s| router.forget_call(s.id));
                        return Err(e);
                    }
                }
            }
            // back in the calls' order
            let mut out = Vec::with_capacity(order.iter().map(|(_, m)| m * d).sum());
            let mut cursor = vec![0usize; answers.len()];
            for (h, m) in order {
                let ys = answers[h].as_deref().unwrap_or_default();
                out.extend_from_slice(&ys[cursor[h] * d..(cursor[h] + m) * d]);
                cursor[h] += m;
            }
            Ok(out)
        }))
    }
}
