//! A mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE): a router scores every
//! expert for each token, the `used` best are computed and their outputs summed by their softmax
//! weights (renormalised to sum 1 where the model says so), plus, for Qwen2-MoE, a shared
//! expert that every token goes through, weighed by a sigmoid.
//!
//! Each expert is a weight of its own built from its range of the file's stacked tensor
//! (`ffn_*_exps`, expert-major, so each expert's matrix is contiguous): the CPU kernels run on it
//! in place, packed or in the file's blocks, exactly as on a dense layer's weight.
//!
//! **Rows are grouped by expert**: the tokens of a pass (a prompt chunk, or the decode rows of
//! several sessions) that chose expert `e` go through `e` together, so each chosen expert's
//! weights are read once per pass, not once per token. The routing and the weighted sum run on
//! the host in f32, in a fixed order (a token's experts in the order of their rank, llama.cpp's
//! order), so a token's numbers do not depend on which other tokens share the pass as long as
//! the expert's kernel computes each row alone (packed weights at any row count; the file-layout
//! decode kernels up to `DECODE_ROWS`, which `Linear::forward_rows` keeps to).

use super::{GatedFfn as Expert, MatMul, Proj};
use crate::config::Moe;
use crate::weights::ModelFiles;
use crate::ModelError;
use brigade_core::LayerRange;
use brigade_format::tensors::LayerTensor as T;
use candle_core::{DType, Device, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// Computes routed experts held somewhere else (another node's [`ExpertShard`]): the rows of
/// the tokens routed to them go out and their outputs come back; the weighted sum stays with
/// the layer, so every routed expert is computed and the numbers are those of the expert's own
/// kernels, wherever it runs.
pub trait RemoteExperts: Send + Sync {
    /// Sends layer `layer`'s experts `calls[j].0`, each on its `calls[j].1` rows of `xs` (the
    /// calls' rows one after another, `hidden` values each), to run with the matmul `mm`; the
    /// layer computes the experts held here, then waits for the outputs ([`ExpertsCall::wait`]:
    /// in the same order and shape as `xs`).
    fn call(&self, layer: usize, calls: &[(u32, usize)], xs: &[f32], mm: MatMul) -> Result<ExpertsCall, ModelError>;

    /// Whether each row of a call's outputs is, bit for bit, what the row alone gives at any
    /// number of rows (the experts' kernels compute each row alone): a slice reads several
    /// sessions' prompts in one pass only then ([`crate::Slice::reads_prompts_together`]).
    fn rows_independent(&self) -> bool;
}

/// A call of experts held elsewhere, under way.
pub struct ExpertsCall(Box<dyn FnOnce() -> Result<Vec<f32>, ModelError> + Send>);

impl ExpertsCall {
    /// A call whose outputs are there already.
    pub fn ready(ys: Vec<f32>) -> Self {
        ExpertsCall(Box::new(move || Ok(ys)))
    }

    /// A call whose outputs `wait` will give.
    pub fn later(wait: impl FnOnce() -> Result<Vec<f32>, ModelError> + Send + 'static) -> Self {
        ExpertsCall(Box::new(wait))
    }

    /// Waits for the outputs.
    pub fn wait(self) -> Result<Vec<f32>, ModelError> {
        (self.0)()
    }
}

/// Which routed experts a slice leaves to [`RemoteExperts`]: per range of layers, a range of
/// expert ids held elsewhere. The slice loads every other expert of its layers.
#[derive(Clone)]
pub struct ExpertSplit {
    pub elsewhere: Vec<(LayerRange, Range<u32>)>,
    pub remote: Arc<dyn RemoteExperts>,
}

impl ExpertSplit {
    /// Split layers (llama.cpp's `--n-cpu-moe`): the routed experts of the layers of `layers`
    /// below `cpu_moe`, every id, held in host RAM by an [`ExpertShard`] in this process, with
    /// its bytes; `None` when no layer of `layers` is below `cpu_moe`. What
    /// `Pipeline::load_cpu_moe` and a worker's stage load beside the slice.
    pub fn in_ram(
        files: &ModelFiles,
        layers: LayerRange,
        cpu_moe: usize,
    ) -> Result<Option<(ExpertSplit, u64)>, ModelError> {
        let end = layers.end().min(cpu_moe);
        if end <= layers.start() {
            return Ok(None);
        }
        let host = LayerRange::new(layers.start(), end).map_err(|e| ModelError::BadSlice(e.to_string()))?;
        let cfg = files.config();
        let Some(spec) = cfg.moe else {
            return Err(ModelError::BadSlice(format!(
                "the experts of layers {host} in host memory asked for, but {:?} has no experts",
                cfg.arch
            )));
        };
        let ids = 0..spec.experts as u32;
        let shard = ExpertShard::load(files, host, ids.clone())?;
        let bytes = shard.weight_bytes();
        Ok(Some((ExpertSplit { elsewhere: vec![(host, ids)], remote: Arc::new(shard) }, bytes)))
    }

    fn is_elsewhere(&self, layer: usize, expert: u32) -> bool {
        self.elsewhere.iter().any(|(l, e)| l.contains(layer) && e.contains(&expert))
    }
}

/// The shared expert of Qwen2-MoE and its gate row.
pub(super) struct Shared {
    expert: Expert,
    /// `hidden` weights: `sigmoid(gate · x)` scales the shared expert's output.
    gate: Vec<f32>,
}

pub(super) struct MoeFfn {
    spec: Moe,
    hidden: usize,
    /// The layer's index in the model (what remote experts are asked for).
    layer: usize,
    /// `experts × hidden`, row-major, in f32 on the host (routing is decided there).
    router: Vec<f32>,
    /// By id; `None` for an expert held elsewhere (`remote` computes it).
    experts: Vec<Option<Expert>>,
    shared: Option<Shared>,
    remote: Option<Arc<dyn RemoteExperts>>,
}

/// An expert on `m` gathered rows (`m × hidden` values): one job of a pass's experts.
pub(super) type ExpertJob<'a> = (&'a Expert, usize, &'a [f32]);

/// The experts a token goes to, best first, and their weights.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Route {
    pub(super) experts: Vec<u32>,
    pub(super) weights: Vec<f32>,
}

/// Expert `e` of layer `i`, from its ranges of the stacked tensors.
fn load_expert(
    files: &ModelFiles,
    i: usize,
    e: usize,
    spec: &Moe,
    device: &Device,
    dtype: DType,
) -> Result<Expert, ModelError> {
    let gate_up = match files.expert_gate_up(i, e, device, dtype)? {
        Some(l) => Proj::Stacked(l, vec![spec.ffn, spec.ffn]),
        None => Proj::Separate(vec![
            files.expert(i, T::FfnGateExps, e, device, dtype)?,
            files.expert(i, T::FfnUpExps, e, device, dtype)?,
        ]),
    };
    Ok(Expert { gate_up, down: files.expert(i, T::FfnDownExps, e, device, dtype)? })
}

/// Refuses a range of expert ids the model does not have.
fn check_ids(ids: &Range<u32>, spec: &Moe) -> Result<(), ModelError> {
    if ids.start >= ids.end || ids.end as usize > spec.experts {
        return Err(ModelError::BadSlice(format!(
            "experts {}..{} of a model with {} experts per layer",
            ids.start, ids.end, spec.experts
        )));
    }
    Ok(())
}

impl MoeFfn {
    /// Loads layer `i`'s router, experts (those `split` does not leave elsewhere) and shared
    /// expert.
    pub(super) fn load(
        files: &ModelFiles,
        i: usize,
        spec: Moe,
        device: &Device,
        dtype: DType,
        split: Option<&ExpertSplit>,
    ) -> Result<Self, ModelError> {
        let hidden = files.config().hidden;
        let host = |name: String| -> Result<Vec<f32>, ModelError> {
            Ok(files.dense(&name, &Device::Cpu, DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        let router = host(T::FfnGateInp.name(i))?;
        if router.len() != spec.experts * hidden {
            return Err(ModelError::BadSlice(format!(
                "{}: {} weights for {} experts of {hidden}",
                T::FfnGateInp.name(i),
                router.len(),
                spec.experts
            )));
        }
        if let Some(s) = split {
            s.elsewhere.iter().try_for_each(|(_, ids)| check_ids(ids, &spec))?;
        }
        let experts = (0..spec.experts)
            .map(|e| match split {
                Some(s) if s.is_elsewhere(i, e as u32) => Ok(None),
                _ => load_expert(files, i, e, &spec, device, dtype).map(Some),
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let remote = split.filter(|_| experts.iter().any(Option::is_none)).map(|s| s.remote.clone());
        let shared = match spec.shared_ffn {
            None => None,
            Some(_) => {
                let gate = host(T::FfnGateInpShexp.name(i))?;
                let names = [T::FfnGateShexp.name(i), T::FfnUpShexp.name(i)];
                let gate_up = Proj::load(files, &names, None, device, dtype)?;
                let down = files.linear(&T::FfnDownShexp.name(i), None, device, dtype)?;
                Some(Shared { expert: Expert { gate_up, down }, gate })
            }
        };
        Ok(MoeFfn { spec, hidden, layer: i, router, experts, shared, remote })
    }

    pub(super) fn bytes(&self) -> u64 {
        let router = (self.router.len() + self.shared.as_ref().map_or(0, |s| s.gate.len())) as u64 * 4;
        router
            + self.experts.iter().flatten().map(Expert::bytes).sum::<u64>()
            + self.shared.as_ref().map_or(0, |s| s.expert.bytes())
    }

    pub(super) fn rows_independent(&self) -> bool {
        self.experts.iter().flatten().all(Expert::rows_independent)
            && self.shared.as_ref().is_none_or(|s| s.expert.rows_independent())
            && self.remote.as_ref().is_none_or(|r| r.rows_independent())
    }

    pub(super) fn runs_on_slices(&self) -> bool {
        self.experts.iter().flatten().all(Expert::runs_on_slices)
            && self.shared.as_ref().is_none_or(|s| s.expert.runs_on_slices() && s.gate.len() == self.hidden)
    }

    /// The experts token row `x` (`hidden` values) goes to: softmax of the router's scores over
    /// every expert, the `used` largest (ties to the lower id), renormalised where the model
    /// says so (llama.cpp's and transformers' order of operations).
    pub(super) fn route(&self, x: &[f32]) -> Route {
        let scores: Vec<f32> = self.router.chunks_exact(self.hidden).map(|w| dot(w, x)).collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        let probs: Vec<f32> = exps.iter().map(|e| e / sum).collect();
        let mut order: Vec<u32> = (0..probs.len() as u32).collect();
        // a stable sort by a total order: equal weights keep the lower id first; NaN (a broken
        // model) counts as −∞ and sorts last
        let key = |e: u32| Some(probs[e as usize]).filter(|p| !p.is_nan()).unwrap_or(f32::NEG_INFINITY);
        order.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
        order.truncate(self.spec.used);
        let mut weights: Vec<f32> = order.iter().map(|&e| probs[e as usize]).collect();
        if self.spec.norm_topk {
            let s: f32 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= s);
        }
        Route { experts: order, weights }
    }

    /// The block's output for `n` rows `h` (`n × hidden`, normed), into `out` (`n × hidden`):
    /// `run(jobs, outs)` computes the experts held here, each on its gathered rows, at once; the experts
    /// held elsewhere go to the remote in one call per pass, made while the ones here run,
    /// with the matmul `mm` the pass runs. Each chosen expert runs once on every row that chose
    /// it; a row's outputs are then summed in the order of its experts' ranks, each times its
    /// weight, then the shared expert's, times its gate.
    pub(super) fn combine(
        &self,
        n: usize,
        h: &[f32],
        out: &mut [f32],
        mm: MatMul,
        mut run: impl FnMut(&[ExpertJob<'_>], &mut [Vec<f32>]) -> candle_core::Result<()>,
    ) -> candle_core::Result<()> {
        let (d, k) = (self.hidden, self.spec.used);
        if h.len() != n * d || out.len() != n * d {
            candle_core::bail!("{n} rows of {d}: {} inputs, {} outputs", h.len(), out.len())
        }
        let routes: Vec<Route> = h.chunks_exact(d).map(|x| self.route(x)).collect();
        // (row, rank) of every row that chose each expert, rows in order
        let mut chosen: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.experts.len()];
        for (r, route) in routes.iter().enumerate() {
            for (rank, &e) in route.experts.iter().enumerate() {
                chosen[e as usize].push((r, rank));
            }
        }
        let gather = |rows: &[(usize, usize)], xs: &mut Vec<f32>| {
            for &(r, _) in rows {
                xs.extend_from_slice(&h[r * d..(r + 1) * d]);
            }
        };
        // every (row, rank)'s expert output
        let mut each = vec![0f32; n * k * d];
        let mut scatter = |rows: &[(usize, usize)], ys: &[f32]| {
            for (j, &(r, rank)) in rows.iter().enumerate() {
                each[(r * k + rank) * d..][..d].copy_from_slice(&ys[j * d..(j + 1) * d]);
            }
        };
        let used = || chosen.iter().enumerate().filter(|(_, rows)| !rows.is_empty());
        let away: Vec<(u32, usize)> =
            used().filter(|(e, _)| self.experts[*e].is_none()).map(|(e, rows)| (e as u32, rows.len())).collect();
        let mut away_xs = Vec::new();
        for &(e, _) in &away {
            gather(&chosen[e as usize], &mut away_xs);
        }
        let remote = match (&self.remote, away.is_empty()) {
            (_, true) => None,
            (Some(r), false) => Some(r),
            (None, false) => candle_core::bail!("layer {}: experts {away:?} are held nowhere", self.layer),
        };
        let remote_err = |e: ModelError| candle_core::Error::Msg(format!("layer {}: {e}", self.layer));
        let pending = remote.map(|r| r.call(self.layer, &away, &away_xs, mm)).transpose().map_err(remote_err)?;
        // the experts held here, each on the rows that chose it, in one call
        let here: Vec<(&Expert, &[(usize, usize)])> =
            used().filter_map(|(e, rows)| Some((self.experts[e].as_ref()?, rows.as_slice()))).collect();
        let xs: Vec<Vec<f32>> = here
            .iter()
            .map(|(_, rows)| {
                let mut x = Vec::with_capacity(rows.len() * d);
                gather(rows, &mut x);
                x
            })
            .collect();
        let jobs: Vec<ExpertJob<'_>> =
            here.iter().zip(&xs).map(|((e, rows), x)| (*e, rows.len(), x.as_slice())).collect();
        let mut ys: Vec<Vec<f32>> = here.iter().map(|(_, rows)| vec![0f32; rows.len() * d]).collect();
        run(&jobs, &mut ys)?;
        for ((_, rows), y) in here.iter().zip(&ys) {
            scatter(rows, y);
        }
        let away_ys = pending.map(ExpertsCall::wait).transpose().map_err(remote_err)?;
        if let Some(ys) = away_ys {
            let m: usize = away.iter().map(|(_, m)| m).sum();
            if ys.len() != m * d {
                candle_core::bail!("layer {}: remote experts gave {} values for {m} rows of {d}", self.layer, ys.len())
            }
            let mut at = 0;
            for &(e, m) in &away {
                scatter(&chosen[e as usize], &ys[at * d..(at + m) * d]);
                at += m;
            }
        }
        for (r, route) in routes.iter().enumerate() {
            let o = &mut out[r * d..(r + 1) * d];
            for (rank, w) in route.weights.iter().enumerate() {
                let y = &each[(r * k + rank) * d..][..d];
                if rank == 0 {
                    o.iter_mut().zip(y).for_each(|(o, y)| *o = y * w);
                } else {
                    o.iter_mut().zip(y).for_each(|(o, y)| *o += y * w);
                }
            }
        }
        if let Some(s) = &self.shared {
            let mut ys = [vec![0f32; n * d]];
            run(&[(&s.expert, n, h)], &mut ys)?;
            for (r, (o, y)) in out.chunks_exact_mut(d).zip(ys[0].chunks_exact(d)).enumerate() {
                let g = 1.0 / (1.0 + (-dot(&s.gate, &h[r * d..(r + 1) * d])).exp());
                o.iter_mut().zip(y).for_each(|(o, y)| *o += y * g);
            }
        }
        Ok(())
    }

    /// [`MoeFfn::combine`] of `h: (b, t, hidden)` with candle's ops for the experts (any device;
    /// the rows cross to the host for routing and the sum). `mm` is the caller's matmul
    /// (`Linear::forward_rows` for decode rows).
    pub(super) fn forward(&self, h: &Tensor, mm: MatMul, gelu: bool) -> candle_core::Result<Tensor> {
        let (b, t, d) = h.dims3()?;
        let n = b * t;
        let host: Vec<f32> = h.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let mut out = vec![0f32; n * d];
        let (device, dtype) = (h.device().clone(), h.dtype());
        self.combine(n, &host, &mut out, mm, |jobs, outs| {
            jobs.iter().zip(outs).try_for_each(|((e, m, xs), ys)| e.on_host(*m, xs, ys, mm, gelu, &device, dtype))
        })?;
        Tensor::from_vec(out, (b, t, d), h.device())?.to_dtype(dtype)
    }
}

impl Expert {
    /// The expert on `m` host rows `xs` (`m × hidden`) into `ys`, with candle's ops on `device`
    /// in `dtype` (rows shaped `(m, 1, hidden)`, as a pass's decode rows are).
    #[allow(clippy::too_many_arguments)]
    fn on_host(
        &self,
        m: usize,
        xs: &[f32],
        ys: &mut [f32],
        mm: MatMul,
        gelu: bool,
        device: &Device,
        dtype: DType,
    ) -> candle_core::Result<()> {
        let d = xs.len() / m.max(1);
        let x = Tensor::from_slice(xs, (m, 1, d), device)?.to_dtype(dtype)?;
        let y = self.forward(&x, mm, gelu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        if y.len() != ys.len() {
            candle_core::bail!("an expert gave {} values for {m} rows of {d}", y.len())
        }
        ys.copy_from_slice(&y);
        Ok(())
    }
}

/// A node's share of a mixture's routed experts: experts `ids` of layers `layers`, nothing else
/// of those layers (no attention, no router), on the CPU. It computes what a layer elsewhere
/// sends it ([`RemoteExperts`]) with the kernels a slice holding the experts would run, so a
/// token's numbers do not depend on where its experts are.
pub struct ExpertShard {
    layers: LayerRange,
    ids: Range<u32>,
    hidden: usize,
    gelu: bool,
    /// By layer of `layers`, then by id of `ids`.
    experts: Vec<Vec<Expert>>,
    weight_bytes: u64,
}

impl ExpertShard {
    /// Loads experts `ids` of layers `layers` from `files` (a mixture-of-experts model).
    pub fn load(files: &ModelFiles, layers: LayerRange, ids: Range<u32>) -> Result<Self, ModelError> {
        let cfg = files.config();
        let Some(spec) = cfg.moe else {
            return Err(ModelError::BadSlice(format!("{:?} has no experts to hold", cfg.arch)));
        };
        if layers.end() > cfg.n_layers {
            return Err(ModelError::BadSlice(format!("layers {layers} of a model with {} layers", cfg.n_layers)));
        }
        check_ids(&ids, &spec)?;
        let experts = layers
            .iter()
            .map(|i| {
                ids.clone()
                    .map(|e| load_expert(files, i, e as usize, &spec, &Device::Cpu, DType::F32))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let weight_bytes = experts.iter().flatten().map(Expert::bytes).sum();
        Ok(ExpertShard { layers, ids, hidden: cfg.hidden, gelu: cfg.layer.gelu, experts, weight_bytes })
    }

    pub fn layers(&self) -> LayerRange {
        self.layers
    }

    pub fn ids(&self) -> Range<u32> {
        self.ids.clone()
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }
}

impl RemoteExperts for ExpertShard {
    /// Computes the call at once (a shard in this process).
    fn call(&self, layer: usize, calls: &[(u32, usize)], xs: &[f32], mm: MatMul) -> Result<ExpertsCall, ModelError> {
        self.compute(layer, calls, xs, mm).map(ExpertsCall::ready)
    }

    fn rows_independent(&self) -> bool {
        self.experts.iter().flatten().all(Expert::rows_independent)
    }
}

impl ExpertShard {
    /// Layer `layer`'s experts `calls[j].0`, each on its `calls[j].1` rows of `xs`, with the
    /// matmul `mm`: their outputs in the same order and shape. The call is checked whole (layer,
    /// ids, row counts, values) before any of it is computed.
    pub fn compute(
        &self,
        layer: usize,
        calls: &[(u32, usize)],
        xs: &[f32],
        mm: MatMul,
    ) -> Result<Vec<f32>, ModelError> {
        let d = self.hidden;
        if !self.layers.contains(layer) {
            return Err(ModelError::BadSlice(format!("layer {layer}: this shard holds layers {}", self.layers)));
        }
        let mut m = 0usize;
        for &(e, rows) in calls {
            if !self.ids.contains(&e) {
                return Err(ModelError::BadSlice(format!(
                    "expert {e}: this shard holds experts {}..{}",
                    self.ids.start, self.ids.end
                )));
            }
            if rows == 0 {
                return Err(ModelError::BadSlice(format!("expert {e}: a call with no rows")));
            }
            m = m.saturating_add(rows);
        }
        if m.checked_mul(d) != Some(xs.len()) {
            return Err(ModelError::BadSlice(format!("{} values for {m} rows of {d}", xs.len())));
        }
        let experts = &self.experts[layer - self.layers.start()];
        let mut at = 0;
        let jobs: Vec<ExpertJob<'_>> = calls
            .iter()
            .map(|&(e, rows)| {
                at += rows;
                (&experts[(e - self.ids.start) as usize], rows, &xs[(at - rows) * d..at * d])
            })
            .collect();
        let mut ys: Vec<Vec<f32>> = calls.iter().map(|&(_, rows)| vec![0f32; rows * d]).collect();
        // the kernels a slice's pass would run: the fused step's for decode rows, else candle's
        if mm == MatMul::Rows && jobs.iter().all(|(e, _, _)| e.runs_on_slices()) {
            Expert::rows_many(&jobs, &mut ys, self.gelu)?;
        } else {
            for ((e, m, x), y) in jobs.iter().zip(ys.iter_mut()) {
                e.on_host(*m, x, y, mm, self.gelu, &Device::Cpu, DType::F32)?;
            }
        }
        Ok(ys.concat())
    }
}

/// `Σ a·b` in f32 over eight running sums (the compiler keeps them in one vector register).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Linear;

    fn ffn(experts: usize, used: usize, norm_topk: bool, router: Vec<f32>) -> MoeFfn {
        MoeFfn {
            spec: Moe { experts, used, ffn: 1, norm_topk, shared_ffn: None },
            hidden: router.len() / experts,
            layer: 0,
            router,
            experts: Vec::new(),
            shared: None,
            remote: None,
        }
    }

    /// Experts held elsewhere whose kernels compute each row alone, or not.
    struct Away(bool);

    impl RemoteExperts for Away {
        fn call(&self, _: usize, _: &[(u32, usize)], _: &[f32], _: MatMul) -> Result<ExpertsCall, ModelError> {
            Ok(ExpertsCall::ready(Vec::new()))
        }
        fn rows_independent(&self) -> bool {
            self.0
        }
    }

    /// A layer whose experts are all elsewhere reads several sessions' rows in one pass only
    /// when the experts elsewhere compute each row alone: its own (none) promise nothing.
    #[test]
    fn rows_are_independent_only_where_the_experts_elsewhere_are() {
        for away in [false, true] {
            let mut f = ffn(4, 2, false, vec![0.0; 4]);
            f.experts = vec![None, None, None, None];
            f.remote = Some(Arc::new(Away(away)));
            assert_eq!(f.rows_independent(), away);
        }
        assert!(ffn(4, 2, false, vec![0.0; 4]).rows_independent(), "no experts, no remote");
    }

    #[test]
    fn routes_take_the_softmax_top_k_and_renormalise_when_asked() {
        // scores 1, 3, 2, 3: experts 1 and 3 tie, the lower id first
        let router = vec![1.0, 3.0, 2.0, 3.0];
        let r = ffn(4, 2, false, router.clone()).route(&[1.0]);
        assert_eq!(r.experts, vec![1, 3]);
        let z: f32 = [1.0f32, 3.0, 2.0, 3.0].iter().map(|s| (s - 3.0).exp()).sum();
        assert!((r.weights[0] - 1.0 / z).abs() < 1e-6 && (r.weights[1] - 1.0 / z).abs() < 1e-6);
        let r = ffn(4, 3, true, router).route(&[1.0]);
        assert_eq!(r.experts, vec![1, 3, 2]);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(r.weights[2] < r.weights[0]);
    }

    #[test]
    fn a_row_routes_the_same_alone_and_among_others() {
        let router: Vec<f32> = (0..8 * 16).map(|i| ((i * 37 % 11) as f32 - 5.0) / 7.0).collect();
        let f = ffn(8, 2, true, router);
        let rows: Vec<f32> = (0..3 * 16).map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0).collect();
        let mut got = vec![0f32; 3 * 16];
        // the "expert" of this test doubles its rows and adds the expert count seen
        let run = |jobs: &[ExpertJob<'_>], outs: &mut [Vec<f32>]| {
            for ((_, m, xs), ys) in jobs.iter().zip(outs) {
                assert_eq!(xs.len(), m * 16);
                ys.iter_mut().zip(xs.iter()).for_each(|(y, x)| *y = 2.0 * x);
            }
            Ok(())
        };
        // no experts to index: give the block stand-ins
        let f = MoeFfn { experts: (0..8).map(|_| Some(stand_in())).collect(), ..f };
        f.combine(3, &rows, &mut got, MatMul::Rows, run).unwrap();
        let mut alone = vec![0f32; 16];
        f.combine(1, &rows[16..32], &mut alone, MatMul::Rows, run).unwrap();
        assert_eq!(&got[16..32], &alone[..]);
        // weights sum to 1: twice the row
        for (g, x) in got.iter().zip(&rows) {
            assert!((g - 2.0 * x).abs() < 1e-5, "{g} {x}");
        }
    }

    #[test]
    fn an_expert_held_nowhere_fails_the_pass() {
        let router: Vec<f32> = (0..4 * 8).map(|i| (i % 5) as f32).collect();
        let mut f = ffn(4, 2, true, router);
        f.experts = vec![Some(stand_in()), None, Some(stand_in()), None];
        let run = |_: &[ExpertJob<'_>], _: &mut [Vec<f32>]| Ok(());
        let mut out = vec![0f32; 8];
        let e = f.combine(1, &[1.0; 8], &mut out, MatMul::Batch, run).unwrap_err().to_string();
        assert!(e.contains("held nowhere"), "{e}");
    }

    fn stand_in() -> Expert {
        let w = Tensor::zeros((1, 1), DType::F32, &Device::Cpu).unwrap();
        let l = Linear::dense_for_tests(w);
        Expert { gate_up: Proj::Separate(vec![l.clone(), l.clone()]), down: l }
    }
}
