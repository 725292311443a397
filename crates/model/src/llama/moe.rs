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
use brigade_format::tensors::LayerTensor as T;
use candle_core::{DType, Device, Tensor};

/// The shared expert of Qwen2-MoE and its gate row.
pub(super) struct Shared {
    expert: Expert,
    /// `hidden` weights: `sigmoid(gate · x)` scales the shared expert's output.
    gate: Vec<f32>,
}

pub(super) struct MoeFfn {
    spec: Moe,
    hidden: usize,
    /// `experts × hidden`, row-major, in f32 on the host (routing is decided there).
    router: Vec<f32>,
    experts: Vec<Expert>,
    shared: Option<Shared>,
}

/// The experts a token goes to, best first, and their weights.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Route {
    pub(super) experts: Vec<u32>,
    pub(super) weights: Vec<f32>,
}

impl MoeFfn {
    /// Loads layer `i`'s router, experts and shared expert.
    pub(super) fn load(
        files: &ModelFiles,
        i: usize,
        spec: Moe,
        device: &Device,
        dtype: DType,
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
        let experts = (0..spec.experts)
            .map(|e| {
                let gate_up = match files.expert_gate_up(i, e, device, dtype)? {
                    Some(l) => Proj::Stacked(l, vec![spec.ffn, spec.ffn]),
                    None => Proj::Separate(vec![
                        files.expert(i, T::FfnGateExps, e, device, dtype)?,
                        files.expert(i, T::FfnUpExps, e, device, dtype)?,
                    ]),
                };
                Ok(Expert { gate_up, down: files.expert(i, T::FfnDownExps, e, device, dtype)? })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
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
        Ok(MoeFfn { spec, hidden, router, experts, shared })
    }

    pub(super) fn bytes(&self) -> u64 {
        let router = (self.router.len() + self.shared.as_ref().map_or(0, |s| s.gate.len())) as u64 * 4;
        router
            + self.experts.iter().map(Expert::bytes).sum::<u64>()
            + self.shared.as_ref().map_or(0, |s| s.expert.bytes())
    }

    pub(super) fn rows_independent(&self) -> bool {
        self.experts.iter().all(Expert::rows_independent)
            && self.shared.as_ref().is_none_or(|s| s.expert.rows_independent())
    }

    pub(super) fn runs_on_slices(&self) -> bool {
        self.experts.iter().all(Expert::runs_on_slices)
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
    /// `run(expert, m, xs, ys)` computes an expert on `m` gathered rows. Each chosen expert
    /// runs once on every row that chose it; a row's outputs are then summed in the order of
    /// its experts' ranks, each times its weight, then the shared expert's, times its gate.
    pub(super) fn combine(
        &self,
        n: usize,
        h: &[f32],
        out: &mut [f32],
        mut run: impl FnMut(&Expert, usize, &[f32], &mut [f32]) -> candle_core::Result<()>,
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
        // every (row, rank)'s expert output
        let mut each = vec![0f32; n * k * d];
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for (e, rows) in chosen.iter().enumerate().filter(|(_, rows)| !rows.is_empty()) {
            let m = rows.len();
            xs.clear();
            for &(r, _) in rows {
                xs.extend_from_slice(&h[r * d..(r + 1) * d]);
            }
            ys.clear();
            ys.resize(m * d, 0.0);
            run(&self.experts[e], m, &xs, &mut ys)?;
            for (j, &(r, rank)) in rows.iter().enumerate() {
                each[(r * k + rank) * d..][..d].copy_from_slice(&ys[j * d..(j + 1) * d]);
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
            let mut ys = vec![0f32; n * d];
            run(&s.expert, n, h, &mut ys)?;
            for (r, (o, y)) in out.chunks_exact_mut(d).zip(ys.chunks_exact(d)).enumerate() {
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
        self.combine(n, &host, &mut out, |expert, m, xs, ys| {
            let x = Tensor::from_slice(xs, (m, 1, d), &device)?.to_dtype(dtype)?;
            let y = expert.forward(&x, mm, gelu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            if y.len() != ys.len() {
                candle_core::bail!("an expert gave {} values for {} rows of {d}", y.len(), m)
            }
            ys.copy_from_slice(&y);
            Ok(())
        })?;
        Tensor::from_vec(out, (b, t, d), h.device())?.to_dtype(dtype)
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
            router,
            experts: Vec::new(),
            shared: None,
        }
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
        let run = |_: &Expert, m: usize, xs: &[f32], ys: &mut [f32]| {
            assert_eq!(xs.len(), m * 16);
            ys.iter_mut().zip(xs).for_each(|(y, x)| *y = 2.0 * x);
            Ok(())
        };
        // no experts to index: give the block stand-ins
        let f = MoeFfn { experts: (0..8).map(|_| stand_in()).collect(), ..f };
        f.combine(3, &rows, &mut got, run).unwrap();
        let mut alone = vec![0f32; 16];
        f.combine(1, &rows[16..32], &mut alone, run).unwrap();
        assert_eq!(&got[16..32], &alone[..]);
        // weights sum to 1: twice the row
        for (g, x) in got.iter().zip(&rows) {
            assert!((g - 2.0 * x).abs() < 1e-5, "{g} {x}");
        }
    }

    fn stand_in() -> Expert {
        let w = Tensor::zeros((1, 1), DType::F32, &Device::Cpu).unwrap();
        let l = Linear::dense_for_tests(w);
        Expert { gate_up: Proj::Separate(vec![l.clone(), l.clone()]), down: l }
    }
}
