//! What one node must host, from the cluster state: its stages with everything a worker needs to
//! load and connect them (the slice's manifest, the next stage, the driver), and the peers whose
//! links it should measure.

use crate::models::{expert_ranges, slice_ranges};
use brigade_core::cluster::{ClusterState, ExpertIds, NodeState};
use brigade_core::LayerRange;
use brigade_proto::convert::{act_dtype_to_proto, carrier_to_proto};
use brigade_proto::v1::{
    AdmittedCert, Assignments, ExpertHost, FileRange, ModelFile, PeerRef, SliceManifest, StageAssignment,
};

/// Prompt tokens per chunk into the first stage: one chunk when the pipeline has one stage; small
/// chunks when there are several, so that stages overlap on a long prompt.
pub fn ubatch(n_stages: usize) -> u32 {
    if n_stages <= 1 {
        512
    } else {
        64
    }
}

fn peer(state: &ClusterState, node: &str) -> PeerRef {
    PeerRef { node: node.to_string(), address: state.nodes.get(node).map(|n| n.address.clone()).unwrap_or_default() }
}

/// The assignments of `node`.
pub fn for_node(state: &ClusterState, node: &str) -> Assignments {
    let threads =
        state.nodes.get(node).and_then(|n| n.devices.iter().find(|d| d.name == "cpu")).map(|d| d.threads).unwrap_or(0);
    let mut stages = Vec::new();
    for (d, i) in state.stages_of(node) {
        let Some(model) = state.models.get(&d.model_id) else { continue };
        let Some(s) = d.stage(i) else { continue };
        let n = d.stages.len();
        // the experts of this stage's layers that expert stages hold
        let elsewhere: Vec<(LayerRange, ExpertIds)> = match s.experts {
            Some(_) => Vec::new(),
            None => d.expert_stages.iter().filter_map(|e| Some((e.layers, e.experts?))).collect(),
        };
        let ranges = match s.experts {
            Some(ids) => expert_ranges(model, s.layers, ids),
            None => slice_ranges(model, s.layers, &elsewhere),
        };
        let manifest = SliceManifest {
            model_id: model.id.clone(),
            model_name: model.name.clone(),
            files: model.files.iter().map(|(p, size)| ModelFile { path: p.clone(), size: *size }).collect(),
            ranges: ranges
                .into_iter()
                .map(|r| FileRange {
                    file: r.file,
                    offset: r.offset,
                    length: r.length,
                    sha256: r.sha256,
                    tensor: r.tensor,
                })
                .collect(),
            sources: vec!["coordinator".into()],
        };
        // the expert stages holding experts of this stage's layers (none for an expert stage)
        let experts_elsewhere = match s.experts {
            Some(_) => Vec::new(),
            None => d
                .expert_stages
                .iter()
                .enumerate()
                .filter(|(_, e)| e.layers.start() < s.layers.end() && s.layers.start() < e.layers.end())
                .filter_map(|(j, e)| {
                    let ids = e.experts?;
                    Some(ExpertHost {
                        node: Some(peer(state, &e.node)),
                        stage: (n + j) as u32,
                        layer_start: e.layers.start() as u32,
                        layer_end: e.layers.end() as u32,
                        expert_start: ids.start,
                        expert_end: ids.end,
                    })
                })
                .collect(),
        };
        let in_pipeline = i < n;
        stages.push(StageAssignment {
            deployment: d.name.clone(),
            generation: d.generation,
            stage: i as u32,
            n_stages: n as u32,
            device: s.device.clone(),
            layer_start: s.layers.start() as u32,
            layer_end: s.layers.end() as u32,
            n_layers: d.n_layers as u32,
            n_ctx: d.n_ctx as u32,
            max_sessions: d.sessions as u32,
            activation_dtype: act_dtype_to_proto(d.act_dtype) as i32,
            carrier: carrier_to_proto(d.carrier) as i32,
            manifest: Some(manifest),
            next: d.stages.get(i + 1).map(|x| peer(state, &x.node)),
            driver: Some(peer(state, &d.driver)),
            threads,
            first: Some(peer(state, &d.stages[0].node)),
            ubatch: if d.ubatch > 0 { d.ubatch.min(4096) as u32 } else { ubatch(n) },
            is_driver: in_pipeline && d.driver == node,
            prev: i.checked_sub(1).filter(|_| in_pipeline).map(|p| peer(state, &d.stages[p].node)),
            stage_nodes: d.stages.iter().map(|x| x.node.clone()).collect(),
            expert_start: s.experts.map_or(0, |e| e.start),
            expert_end: s.experts.map_or(0, |e| e.end),
            experts_elsewhere,
            cpu_moe: d.cpu_moe as u32,
        });
    }
    let peers = state
        .nodes
        .values()
        .filter(|n| n.name != node && n.state == NodeState::Up)
        .map(|n| PeerRef { node: n.name.clone(), address: n.address.clone() })
        .collect();
    let admitted = state
        .admitted
        .iter()
        .map(|(node, a)| AdmittedCert { node: node.clone(), fingerprint: a.fingerprint.clone() })
        .collect();
    Assignments { stages, peers, admitted }
}
