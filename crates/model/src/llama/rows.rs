//! One decode step of several sessions through a slice at once: the batch engine's forward pass
//! (see [`crate::batch`]).
//!
//! Row `i` is session `i`'s next token. The matmuls by the layer weights take every row at once,
//! through [`Linear::forward_rows`], which gives each row exactly the numbers a one-row call gives;
//! RoPE, the cache write and attention run per session on its own cache with the code of the
//! one-session path. So a row's numbers never depend on which other rows share the step: the
//! logits equal, bit for bit, those of [`Slice::forward`] for that session alone (on the CPU;
//! candle's CUDA kernels promise no such thing). On the CPU in f32 the step is the fused one
//! ([`super::fused`]), which computes the same numbers row by row.

use super::{attend, rms_norm, Slice, SliceCache, StageInput};
use crate::weights::Linear;
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
        let _g = self.span.enter();
        let n = caches.len();
        if n == 0 {
            return Err(ModelError::BadInput("a batch of no rows".into()));
        }
        for c in caches.iter() {
            if c.len + 1 > self.n_ctx.min(c.n_ctx) {
                return Err(ModelError::ContextFull { need: c.len + 1, n_ctx: self.n_ctx });
            }
        }
        let mut x = self.input(input, n)?;
        if x.dim(1)? != 1 {
            return Err(ModelError::BadInput(format!("{} positions per row: a decode step takes one", x.dim(1)?)));
        }
        for c in caches.iter_mut() {
            c.make_room(1)?;
        }
        if self.fused {
            x = self.decode_fused(caches, &x)?;
        } else {
            self.rows_through_blocks(caches, &mut x)?;
        }
        for c in caches.iter_mut() {
            c.len += 1;
        }
        match &self.head {
            None => Ok(x),
            Some(head) => {
                let x = rms_norm(&x, &head.norm, self.cfg.rms_eps)?;
                Ok(self.soft_cap_logits(head.out.forward_rows(&x)?.to_dtype(DType::F32)?)?)
            }
        }
    }

    /// The blocks of [`Slice::forward_rows`] as candle ops (where the fused step does not run).
    fn rows_through_blocks(&self, caches: &mut [&mut SliceCache], x: &mut Tensor) -> Result<(), ModelError> {
        let n = caches.len();
        let rope = |cos: &Tensor, sin: &Tensor| -> candle_core::Result<Vec<(Tensor, Tensor)>> {
            caches.iter().map(|c| Ok((cos.narrow(0, c.len, 1)?, sin.narrow(0, c.len, 1)?))).collect()
        };
        let global = rope(&self.cos, &self.sin)?;
        let local = match &self.local_rope {
            Some((cos, sin)) => Some(rope(cos, sin)?),
            None => None,
        };
        for (l, block) in self.blocks.iter().enumerate() {
            let _b = block.span.enter();
            let (q, k, v) = block.qkv(&self.cfg, x, Linear::forward_rows)?;
            let tables = match &local {
                Some(t) if block.local_rope => t,
                _ => &global,
            };
            let mut ys = Vec::with_capacity(n);
            for (i, (cache, (cos, sin))) in caches.iter_mut().zip(tables).enumerate() {
                let row = |t: &Tensor| t.narrow(0, i, 1);
                // the position in the layer's storage (a windowed layer's starts at its base)
                let pos = cache.len - cache.base_of(l);
                let qkv = (&row(&q)?, &row(&k)?, &row(&v)?);
                ys.push(attend(&self.cfg, block.window, qkv, &mut cache.kv[l], pos, (cos, sin), None)?);
            }
            *x = block.output(&self.cfg, x, &Tensor::cat(&ys, 0)?, Linear::forward_rows)?;
        }
        Ok(())
    }
}
