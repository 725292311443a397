//! One decode step of several sessions through a slice at once: the batch engine's forward pass
//! (see [`crate::batch`]).
//!
//! Row `i` is session `i`'s next token. The matmuls by the layer weights take every row at once,
//! through [`crate::weights::Linear::forward_rows`], which gives each row exactly the numbers a one-row call gives;
//! RoPE, the cache write and attention run per session on its own cache with the code of the
//! one-session path. So a row's numbers never depend on which other rows share the step: the
//! logits equal, bit for bit, those of [`Slice::forward`] for that session alone (on the CPU;
//! candle's CUDA kernels promise no such thing). On the CPU in f32 the step is the fused one
//! ([`super::fused`]), which computes the same numbers row by row.

use super::{attend, rms_norm, MatMul, Slice, SliceCache, StageInput};

use crate::ModelError;
use candle_core::{DType, Tensor};

impl Slice {
    /// Runs one token per session: `caches[i]` is session `i`'s cache for this slice and `input`
    /// its token (first slice: `caches.len()` ids) or hidden state (`(rows, 1, hidden)`). Appends
    /// to every cache. Returns the hidden state `(rows, 1, hidden)` for the next stage or, on the
    /// last slice, logits `(rows, 1, vocab)` in f32.
    ///
    /// Every cache is checked for room before anything is computed: on error no cache's length
    /// changes (entries past a cache's length may have been written; they are never read).
    pub fn forward_rows(&self, caches: &mut [&mut SliceCache], input: StageInput<'_>) -> Result<Tensor, ModelError> {
        let runs = vec![1; caches.len()];
        self.forward_runs(caches, input, &runs)
    }

    /// [`Slice::forward_rows`] where session `i` takes `runs[i]` consecutive tokens, each a
    /// decode row of its own (rows in session order, a session's in position order): row `j` of
    /// a session's run is at position `len + j` and sees the run's rows before it, so its
    /// numbers are, bit for bit, those of feeding the run one token at a time — the verifying
    /// pass of speculative decoding, which reads each weight once for a whole draft.
    pub fn forward_runs(
        &self,
        caches: &mut [&mut SliceCache],
        input: StageInput<'_>,
        runs: &[usize],
    ) -> Result<Tensor, ModelError> {
        let _g = self.span.enter();
        if caches.is_empty() || runs.len() != caches.len() || runs.contains(&0) {
            return Err(ModelError::BadInput(format!(
                "runs of {runs:?} rows for {} sessions: each session takes at least one",
                caches.len()
            )));
        }
        let n: usize = runs.iter().sum();
        for (c, &r) in caches.iter().zip(runs) {
            if c.len + r > self.n_ctx.min(c.n_ctx) {
                return Err(ModelError::ContextFull { need: c.len + r, n_ctx: self.n_ctx });
            }
        }
        let mut x = self.input(input, n)?;
        if x.dim(1)? != 1 {
            return Err(ModelError::BadInput(format!("{} positions per row: a decode step takes one", x.dim(1)?)));
        }
        for (c, &r) in caches.iter_mut().zip(runs) {
            c.make_room(r)?;
        }
        // each row's session and position
        let rows: Vec<(usize, usize)> = caches
            .iter()
            .zip(runs)
            .enumerate()
            .flat_map(|(i, (c, &r))| (c.len..c.len + r).map(move |p| (i, p)))
            .collect();
        if self.fused {
            x = self.decode_fused(caches, &rows, &x)?;
        } else {
            self.rows_through_blocks(caches, &rows, &mut x)?;
        }
        for (c, &r) in caches.iter_mut().zip(runs) {
            c.len += r;
        }
        match &self.head {
            None => Ok(x),
            Some(head) => {
                let x = rms_norm(&x, &head.norm, self.cfg.rms_eps)?;
                Ok(self.soft_cap_logits(head.out.forward_rows(&x)?.to_dtype(DType::F32)?)?)
            }
        }
    }

    /// The blocks of [`Slice::forward_runs`] as candle ops (where the fused step does not run):
    /// `rows[r]` is row `r`'s session and position, a session's rows in position order.
    fn rows_through_blocks(
        &self,
        caches: &mut [&mut SliceCache],
        rows: &[(usize, usize)],
        x: &mut Tensor,
    ) -> Result<(), ModelError> {
        let rope = |cos: &Tensor, sin: &Tensor| -> candle_core::Result<Vec<(Tensor, Tensor)>> {
            rows.iter().map(|&(_, p)| Ok((cos.narrow(0, p, 1)?, sin.narrow(0, p, 1)?))).collect()
        };
        let global = rope(&self.cos, &self.sin)?;
        let local = match &self.local_rope {
            Some((cos, sin)) => Some(rope(cos, sin)?),
            None => None,
        };
        for (l, block) in self.blocks.iter().enumerate() {
            let _b = block.span.enter();
            let (q, k, v) = block.qkv(&self.cfg, x, MatMul::Rows)?;
            let tables = match &local {
                Some(t) if block.local_rope => t,
                _ => &global,
            };
            let mut ys = Vec::with_capacity(rows.len());
            // (in row order: a row's keys are in the cache before the session's next row reads them)
            for (r, (&(i, p), (cos, sin))) in rows.iter().zip(tables).enumerate() {
                let row = |t: &Tensor| t.narrow(0, r, 1);
                let cache = &mut caches[i];
                // the position in the layer's storage (a windowed layer's starts at its base)
                let pos = p - cache.base_of(l);
                let qkv = (&row(&q)?, &row(&k)?, &row(&v)?);
                ys.push(attend(&self.cfg, block.window, qkv, &mut cache.kv[l], pos, (cos, sin), None)?);
            }
            *x = block.output(&self.cfg, x, &Tensor::cat(&ys, 0)?, MatMul::Rows)?;
        }
        Ok(())
    }
}
