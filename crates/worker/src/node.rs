//! What this node hosts, kept equal to what the coordinator assigns it: slices load (fetching what
//! is missing) when assigned, and stop when unassigned or replaced by another generation.

use crate::devices::Offered;
use crate::driver::DriveTarget;
use crate::experts::LinkedExperts;
use crate::fetch::{ensure_slice, FetchReport};
use crate::router::{Peer, Router};
use crate::stage::{StageHandle, StagePlace};
use crate::{WorkerConfig, WorkerError};
use brigade_core::cluster::{ActDtype, CarrierKind};
use brigade_core::{DeviceId, LayerRange};
use brigade_model::device::{activation_dtype, candle_device, is_out_of_memory};
use brigade_model::{ExpertShard, ExpertSplit, ModelError, ModelFiles, Slice};
use brigade_proto::convert::{act_dtype_from_proto, carrier_from_proto};
use brigade_proto::v1::{FileRange, PeerRef, SliceStatus, StageAssignment, StageState};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Semaphore;

/// The state of one hosted stage as the coordinator hears it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Load {
    Loading,
    Ready,
    Failed(String),
}

pub struct Hosted {
    pub assignment: StageAssignment,
    pub load: Load,
    pub handle: Option<StageHandle>,
    /// An expert stage's experts (served through the router, no stage thread).
    pub shard: Option<Arc<ExpertShard>>,
    pub fetched_bytes: u64,
    pub load_s: f64,
}

/// What a loaded assignment runs: a stage of the pipeline, or an expert stage's experts.
enum Started {
    Stage(Box<StageHandle>),
    Shard(Arc<ExpertShard>),
}

/// The result of loading a stage, for the coordinator.
pub struct Loaded {
    pub deployment: String,
    pub generation: u64,
    pub stage: u32,
    pub result: Result<(u64, u64, u64, f64), String>,
    /// The load ran out of device memory; the device's free bytes after it (0: unknown).
    pub out_of_memory: Option<u64>,
}

pub struct Node {
    pub cfg: WorkerConfig,
    /// The devices this worker offered when it registered: the only ones a stage may be put on.
    pub offered: Offered,
    pub router: Arc<Router>,
    pub hosted: Mutex<HashMap<(String, u32), Hosted>>,
    pub drive: Mutex<HashMap<String, (DriveTarget, tokio::sync::watch::Sender<bool>)>>,
    /// When the coordinator last answered a heartbeat.
    pub last_heartbeat: Mutex<Option<std::time::Instant>>,
    /// Unassigned stages still being stopped (their memory not yet returned).
    draining: Arc<(Mutex<usize>, std::sync::Condvar)>,
}

/// Longest a GPU load waits for unassigned stages to give their memory back.
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

pub fn peer(p: &Option<PeerRef>) -> Option<Peer> {
    p.as_ref().map(|p| Peer { node: p.node.clone(), address: p.address.clone() })
}

/// The assignment's activation type; a number that names none is taken as f32.
pub fn act_dtype(d: i32) -> ActDtype {
    act_dtype_from_proto(d).unwrap_or(ActDtype::F32)
}

/// The assignment's carrier; an unknown number is taken as QUIC.
pub fn carrier(c: i32) -> CarrierKind {
    carrier_from_proto(c).unwrap_or(CarrierKind::Quic)
}

impl Node {
    pub fn new(cfg: WorkerConfig, offered: Offered, router: Arc<Router>) -> Arc<Node> {
        Arc::new(Node {
            cfg,
            offered,
            router,
            hosted: Mutex::new(HashMap::new()),
            drive: Mutex::new(HashMap::new()),
            last_heartbeat: Mutex::new(None),
            draining: Arc::new((Mutex::new(0), std::sync::Condvar::new())),
        })
    }

    /// The stages as the heartbeat reports them.
    pub fn statuses(&self) -> Vec<SliceStatus> {
        let Ok(h) = self.hosted.lock() else { return vec![] };
        h.values()
            .map(|x| SliceStatus {
                deployment: x.assignment.deployment.clone(),
                generation: x.assignment.generation,
                stage: x.assignment.stage,
                state: match &x.load {
                    Load::Loading => StageState::Loading,
                    Load::Ready => StageState::Ready,
                    Load::Failed(_) => StageState::Failed,
                }
                .into(),
                weight_bytes: x
                    .handle
                    .as_ref()
                    .map(|s| s.weight_bytes)
                    .or(x.shard.as_ref().map(|s| s.weight_bytes()))
                    .unwrap_or(0),
                kv_bytes: x.handle.as_ref().map(StageHandle::kv_bytes_held).unwrap_or(0),
                active_sessions: x
                    .handle
                    .as_ref()
                    .map(|s| s.active.load(std::sync::atomic::Ordering::Relaxed))
                    .unwrap_or(0),
            })
            .collect()
    }

    /// Makes the hosted stages equal to `want`. Returns the stages that must be loaded now.
    pub fn reconcile(&self, want: &[StageAssignment]) -> Vec<StageAssignment> {
        let mut to_load = Vec::new();
        let mut dropped = Vec::new();
        {
            let Ok(mut hosted) = self.hosted.lock() else { return vec![] };
            let keys: Vec<(String, u32)> = hosted.keys().cloned().collect();
            for k in keys {
                let keep = want.iter().any(|a| a.deployment == k.0 && a.stage == k.1 && hosted[&k].assignment == *a);
                if !keep {
                    if let Some(h) = hosted.remove(&k) {
                        self.router.remove_stage(&k.0, k.1);
                        tracing::info!(deployment = %k.0, stage = k.1, "stage unassigned");
                        dropped.push(h);
                    }
                }
            }
            for a in want {
                let k = (a.deployment.clone(), a.stage);
                if let std::collections::hash_map::Entry::Vacant(e) = hosted.entry(k) {
                    e.insert(Hosted {
                        assignment: a.clone(),
                        load: Load::Loading,
                        handle: None,
                        shard: None,
                        fetched_bytes: 0,
                        load_s: 0.0,
                    });
                    to_load.push(a.clone());
                }
            }
        }
        if let Ok(mut d) = self.drive.lock() {
            d.retain(|dep, (t, cancel)| {
                let keep = want.iter().any(|a| &a.deployment == dep && a.generation == t.generation && a.is_driver);
                if !keep {
                    let _ = cancel.send(true);
                }
                keep
            });
        }
        // stopping a stage joins its thread: not on the async runtime
        if !dropped.is_empty() {
            let draining = self.draining.clone();
            if let Ok(mut n) = draining.0.lock() {
                *n += 1;
            }
            std::thread::spawn(move || {
                drop(dropped);
                if let Ok(mut n) = draining.0.lock() {
                    *n -= 1;
                }
                draining.1.notify_all();
            });
        }
        to_load
    }

    /// Loads one assigned stage (blocking: fetch, open, load), starts it and returns what to report.
    pub fn load(
        self: &Arc<Self>,
        a: &StageAssignment,
        fetch: impl FnMut(&FileRange) -> Result<Vec<u8>, WorkerError>,
    ) -> Loaded {
        let t0 = Instant::now();
        let result = self.load_inner(a, fetch, t0);
        let out_of_memory = match &result {
            Err(WorkerError::OutOfMemory { free, .. }) => Some(*free),
            _ => None,
        };
        let mut hosted = match self.hosted.lock() {
            Ok(h) => h,
            Err(p) => p.into_inner(),
        };
        let key = (a.deployment.clone(), a.stage);
        let report = match result {
            Ok((started, report)) => match hosted.get_mut(&key) {
                Some(h) if h.assignment == *a => {
                    let (w, kv) = match started {
                        Started::Stage(handle) => {
                            let kv = handle.kv_bytes_per_session * u64::from(a.max_sessions);
                            // the stage before sends this stage its frames; the driver sends the first its
                            let from = a
                                .prev
                                .as_ref()
                                .or(a.driver.as_ref())
                                .map_or(self.cfg.name.as_str(), |p| p.node.as_str());
                            self.router.add_stage(&a.deployment, a.stage, handle.input.clone(), from);
                            let w = handle.weight_bytes;
                            h.handle = Some(*handle);
                            (w, kv)
                        }
                        Started::Shard(shard) => {
                            let w = shard.weight_bytes();
                            // the pipeline's stages call it
                            let callers = a.stage_nodes.clone();
                            self.router.add_shard(&a.deployment, a.stage, a.generation, shard.clone(), callers);
                            h.shard = Some(shard);
                            (w, 0)
                        }
                    };
                    h.load = Load::Ready;
                    h.fetched_bytes = report.fetched_bytes;
                    h.load_s = t0.elapsed().as_secs_f64();
                    Ok((w, kv, report.fetched_bytes, h.load_s))
                }
                // unassigned while loading: dropped here
                _ => Err("unassigned while loading".to_string()),
            },
            Err(e) => {
                tracing::warn!(deployment = %a.deployment, stage = a.stage, "loading failed: {e}");
                if let Some(h) = hosted.get_mut(&key) {
                    if h.assignment == *a {
                        h.load = Load::Failed(e.to_string());
                    }
                }
                Err(e.to_string())
            }
        };
        Loaded {
            deployment: a.deployment.clone(),
            generation: a.generation,
            stage: a.stage,
            result: report,
            out_of_memory,
        }
    }

    fn load_inner(
        self: &Arc<Self>,
        a: &StageAssignment,
        fetch: impl FnMut(&FileRange) -> Result<Vec<u8>, WorkerError>,
        t0: Instant,
    ) -> Result<(Started, FetchReport), WorkerError> {
        let manifest =
            a.manifest.clone().ok_or_else(|| WorkerError::Manifest("the assignment has no manifest".into()))?;
        let (files, report) = if manifest.model_id == "embedded" {
            let f = ModelFiles::from_static_gguf(brigade_model::embedded_model(), brigade_model::EMBEDDED_MODEL_NAME)?;
            (f, FetchReport::default())
        } else {
            let report = ensure_slice(&self.cfg.models_dir, &manifest, fetch)?;
            (ModelFiles::open(&report.path)?, report)
        };
        let n_layers = files.config.n_layers;
        if n_layers != a.n_layers as usize {
            return Err(WorkerError::Manifest(format!(
                "the model has {n_layers} layers, the assignment says {}",
                a.n_layers
            )));
        }
        let layers = LayerRange::new(a.layer_start as usize, a.layer_end as usize)
            .map_err(|e| WorkerError::BadRequest(e.to_string()))?;
        if a.expert_end > a.expert_start {
            if self.offered.check(&a.device)? != DeviceId::Cpu {
                return Err(WorkerError::BadRequest(format!(
                    "expert stage on {}: experts are held on the CPU",
                    a.device
                )));
            }
            let shard = ExpertShard::load(&files, layers, a.expert_start..a.expert_end)?;
            tracing::info!(
                deployment = %a.deployment,
                stage = a.stage,
                "experts {}..{} of layers {layers} ready in {:.2}s ({} bytes, {} fetched)",
                a.expert_start,
                a.expert_end,
                t0.elapsed().as_secs_f64(),
                shard.weight_bytes(),
                report.fetched_bytes
            );
            return Ok((Started::Shard(Arc::new(shard)), report));
        }
        // a device this worker offered (in a build without CUDA only the CPU is), computing in
        // the type the single box computes in there
        let device = self.offered.check(&a.device)?;
        if matches!(device, DeviceId::Cuda(_)) {
            // a re-placement onto the same GPU: the stages it replaces give their memory back
            // first, or the load would run out of it (and lower the GPU's figure for nothing)
            self.wait_drained(DRAIN_WAIT);
        }
        let on = candle_device(device)?;
        let max_sessions = a.max_sessions.max(1) as usize;
        let free_before = gpu_free(device);
        // split layers: the experts of layers below `cpu_moe` in this node's RAM, computed by its
        // CPU (a shard in this process, as `Pipeline::load_cpu_moe` holds them on one box)
        let split = if let Some((split, bytes)) = ExpertSplit::in_ram(&files, layers, a.cpu_moe as usize)? {
            if !a.experts_elsewhere.is_empty() {
                return Err(WorkerError::Manifest("split layers and experts on other nodes in one stage".into()));
            }
            tracing::info!(
                deployment = %a.deployment,
                stage = a.stage,
                "experts of layers {} in RAM ({bytes} bytes), the rest of layers {layers} on {}",
                split.elsewhere[0].0,
                a.device
            );
            Some(split)
        } else {
            LinkedExperts::split(&self.router, a, carrier(a.carrier), files.config.hidden, files.experts_pack_here())?
        };
        let slice = Slice::load_split(&files, layers, &on, activation_dtype(device, &files), a.n_ctx as usize, split)
            .map_err(|e| out_of_memory(device, e))?;
        // On a GPU every session's KV cache is allocated now: running out of memory fails the
        // load (which the coordinator re-plans), never a client's session later; and what the
        // device lost is then all the stage will hold, to be checked against the prediction.
        let caches = match device {
            DeviceId::Cpu => Vec::new(),
            DeviceId::Cuda(_) => match (0..max_sessions).map(|_| slice.new_cache()).collect::<Result<Vec<_>, _>>() {
                Ok(c) => c,
                Err(e) => {
                    // what is free is read with this stage's weights gone: the coordinator
                    // lowers the device to it, which must not count this failed stage
                    drop(slice);
                    return Err(out_of_memory(device, e));
                }
            },
        };
        if let (Some(before), Some(after)) = (free_before, gpu_free(device)) {
            let lost = before.saturating_sub(after);
            let predicted = slice.weight_bytes() + slice.kv_bytes() * max_sessions as u64;
            // the device's allocator rounds and keeps workspaces: 10% and 256 MiB of slack
            if lost > predicted + predicted / 10 + (256 << 20) {
                tracing::warn!(
                    deployment = %a.deployment,
                    stage = a.stage,
                    "{device} lost {lost} bytes to layers {layers}, more than the {predicted} predicted: \
                     the plan undercounts this device"
                );
            } else {
                tracing::info!(
                    deployment = %a.deployment,
                    stage = a.stage,
                    "{device} lost {lost} bytes to layers {layers}; predicted {predicted}"
                );
            }
        }
        let tokenizer = files.tokenizer.clone();
        let place = StagePlace {
            deployment: a.deployment.clone(),
            generation: a.generation,
            stage: a.stage,
            n_stages: a.n_stages,
            next: peer(&a.next),
            driver: peer(&a.driver).ok_or_else(|| WorkerError::Manifest("the assignment names no driver".into()))?,
            act_dtype: act_dtype(a.activation_dtype),
            carrier: carrier(a.carrier),
            max_sessions,
            session_idle: self.cfg.session_idle,
        };
        let hidden = files.config.hidden;
        let vocab = files.config.vocab;
        let handle = StageHandle::start(place.clone(), slice, caches, tokenizer.clone(), self.router.clone())?;
        if a.is_driver {
            let first =
                peer(&a.first).ok_or_else(|| WorkerError::Manifest("the assignment names no first stage".into()))?;
            let (cancel_tx, cancel_rx) = tokio::sync::watch::channel(false);
            let t = DriveTarget {
                deployment: a.deployment.clone(),
                generation: a.generation,
                n_stages: a.n_stages,
                n_ctx: a.n_ctx as usize,
                vocab,
                carrier: place.carrier,
                first,
                stage_nodes: Arc::new(a.stage_nodes.clone()),
                tokenizer,
                vocabulary: Default::default(),
                permits: Arc::new(Semaphore::new(a.max_sessions.max(1) as usize)),
                ubatch: a.ubatch.max(1) as usize,
                hidden_bytes: (hidden * place.act_dtype.size()) as u64,
                cancel: cancel_rx,
                drafting: self.cfg.drafting.clone(),
                max_run: files.config.pass().unwrap_or(usize::MAX).min(crate::stage::MAX_RUN),
            };
            if let Ok(mut d) = self.drive.lock() {
                // still assigned? (it may have been re-placed while this slice loaded)
                let current = self
                    .hosted
                    .lock()
                    .map(|h| h.get(&(a.deployment.clone(), a.stage)).is_some_and(|x| x.assignment == *a))
                    .unwrap_or(false);
                if current {
                    if let Some((_, old)) = d.insert(a.deployment.clone(), (t, cancel_tx)) {
                        let _ = old.send(true);
                    }
                }
            }
        }
        tracing::info!(
            deployment = %a.deployment,
            stage = a.stage,
            "layers {layers} ready in {:.2}s ({} fetched)",
            t0.elapsed().as_secs_f64(),
            report.fetched_bytes
        );
        Ok((Started::Stage(Box::new(handle)), report))
    }
}

impl Node {
    /// Waits (at most `limit`) until every unassigned stage has stopped and dropped its slice.
    fn wait_drained(&self, limit: std::time::Duration) {
        let (lock, cv) = &*self.draining;
        let Ok(n) = lock.lock() else { return };
        if let Ok((n, timeout)) = cv.wait_timeout_while(n, limit, |n| *n > 0) {
            if timeout.timed_out() {
                tracing::warn!("{} unassigned stages still stopping after {limit:?}; loading anyway", *n);
            }
        }
    }
}

/// Free memory of a GPU now (`None` for the CPU, or where it cannot be read).
fn gpu_free(device: DeviceId) -> Option<u64> {
    match device {
        DeviceId::Cpu => None,
        DeviceId::Cuda(i) => brigade_model::devices::cuda_free_memory(i),
    }
}

/// A load's error, named as running out of memory on `device` where it is that (the
/// coordinator lowers the device's memory by it and re-places).
fn out_of_memory(device: DeviceId, e: ModelError) -> WorkerError {
    if is_out_of_memory(&e) {
        WorkerError::OutOfMemory { device: device.to_string(), free: gpu_free(device).unwrap_or(0), why: e.to_string() }
    } else {
        e.into()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The worker's out-of-memory error is what the coordinator recognises (its text starts
    /// with [`brigade_core::cluster::OUT_OF_MEMORY`]); any other load error stays what it was.
    #[test]
    fn a_load_that_runs_out_of_device_memory_is_named_so() {
        let cuda = ModelError::from(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ));
        let e = out_of_memory(DeviceId::Cuda(0), cuda);
        assert!(matches!(&e, WorkerError::OutOfMemory { device, .. } if device == "cuda0"), "{e:?}");
        let text = e.to_string();
        assert!(text.starts_with(brigade_core::cluster::OUT_OF_MEMORY), "{text}");
        assert!(text.contains("cuda0") && text.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{text}");
        let other =
            out_of_memory(DeviceId::Cuda(0), ModelError::from(candle_core::Error::Msg("shape mismatch".into())));
        assert!(!matches!(other, WorkerError::OutOfMemory { .. }), "{other:?}");
        assert!(!other.to_string().starts_with(brigade_core::cluster::OUT_OF_MEMORY));
    }
}
