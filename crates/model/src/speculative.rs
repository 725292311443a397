//! Speculative decoding: a cheap guess at the next few tokens (a draft), checked by the model in
//! one pass instead of one pass per token.
//!
//! A session about to feed token `t` drafts `d1 … dk` — from its own text (prompt lookup: what
//! followed the last time its latest n-gram occurred) or from a small draft model of the same
//! vocabulary — and feeds `t, d1 … dk` as the decode rows of one pass
//! ([`Pipeline::forward_runs`]). Row `j`'s logits are, bit for bit, those plain decoding computes
//! after `t, d1 … dj`; the sampler draws from the rows in order, with the history plain decoding
//! gives it, and the walk stops at the first draw that is not the draft's next token ([`walk`]):
//! that draw is the next `t`, the rows past it are forgotten ([`crate::Session::truncate`]).
//! So every token is the one plain decoding draws — greedy or not, the sampler's random stream
//! is consumed the same way — and a draft only changes how many passes the text takes: an
//! accepted run of `k` costs one pass that reads each weight once, a rejected one the extra
//! rows' arithmetic.
//!
//! (Rejection sampling, which accepts a drafted token with probability `p_target / p_draft`,
//! accepts more at high temperatures but gives another text than plain decoding for a seed;
//! brigade keeps the promise that a seed's text does not depend on how it was computed.)

use crate::pipeline::PREFILL_CHUNK;
use crate::{Logits, ModelError, Pipeline, Session};
use brigade_core::stop::StopRules;
use std::sync::Arc;

/// Where drafts come from.
pub enum DraftSource {
    /// Prompt lookup (llama.cpp's `--spec-type ngram-simple`): the tokens that followed the most
    /// recent earlier occurrence of the text's last n tokens, for the longest `n` from `ngram.1`
    /// down to `ngram.0` that occurred. Free to compute; it drafts where text repeats (code
    /// edits, quotes of the prompt, lists).
    Lookup { ngram: (usize, usize) },
    /// A smaller model of the same vocabulary decodes the draft greedily (llama.cpp's
    /// `--model-draft`), in a session of its own per target session.
    Model(Arc<Pipeline>),
}

impl std::fmt::Debug for DraftSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftSource::Lookup { ngram } => write!(f, "Lookup {{ ngram: {ngram:?} }}"),
            DraftSource::Model(p) => write!(f, "Model {{ vocab: {} }}", p.vocab()),
        }
    }
}

/// How a session drafts.
#[derive(Debug)]
pub struct Speculation {
    pub source: DraftSource,
    /// Tokens a draft holds at most (llama.cpp's `--spec-draft-n-max`).
    pub n_max: usize,
}

impl Speculation {
    /// Checks the settings against the target's vocabulary of `vocab` ids: a draft model whose
    /// vocabulary is not the target's would draft ids that mean other text, or none at all.
    /// Every [`Drafter`] is made through this, so its drafts are ids the target takes.
    pub fn check(&self, vocab: usize) -> Result<(), ModelError> {
        if let DraftSource::Lookup { ngram: (lo, hi) } = self.source {
            if lo == 0 || lo > hi {
                return Err(ModelError::BadInput(format!(
                    "prompt lookup n-grams of {lo} to {hi} tokens: the smallest must be at least 1 and at most the largest"
                )));
            }
        }
        if let DraftSource::Model(d) = &self.source {
            if d.vocab() != vocab {
                return Err(ModelError::BadInput(format!(
                    "the draft model's vocabulary has {} tokens, the model's {vocab}: they must be the same",
                    d.vocab()
                )));
            }
        }
        Ok(())
    }
}

/// What one more row of a decode pass costs, as a share of a one-row pass: measured with
/// `Pipeline::forward_runs` on SmolLM2-135M Q4_1 (2-vCPU Xeon, AVX-512): 4.8 ms for one row,
/// 19.1 ms for 8 (2.0 ms a row more). A drafted token is worth its row where the chance that
/// the walk reaches and takes it is above this.
pub const ROW_COST: f64 = 0.4;

/// One session's drafter (for a draft model, the draft's own session, allocated once).
///
/// Drafts are sized by how often this session's drafted tokens were taken (a moving average
/// over the last few dozen): a draft of `k` pays `k` rows for the expected run of taken tokens,
/// so it grows while `rate^k` (the chance its `k`-th token is reached and taken) stays above
/// [`ROW_COST`]; text that does not repeat drafts nothing, but for one token now and then to
/// notice when it starts to.
pub struct Drafter {
    spec: Arc<Speculation>,
    session: Option<Session>,
    /// The moving average of drafted tokens taken (each token the walk reached).
    rate: f64,
    /// Passes since the last draft.
    idle: u32,
    /// Tokens drafted and of them accepted, over the drafter's life.
    pub drafted: u64,
    pub accepted: u64,
}

/// Passes without a draft after which a drafter that expects nothing drafts one token anyway.
const PROBE_EVERY: u32 = 8;

impl Drafter {
    /// A drafter for a target of `vocab` ids ([`Speculation::check`]ed against it).
    pub fn new(spec: Arc<Speculation>, vocab: usize) -> Result<Self, ModelError> {
        spec.check(vocab)?;
        let session = match &spec.source {
            DraftSource::Model(p) => Some(p.new_session()?),
            DraftSource::Lookup { .. } => None,
        };
        Ok(Drafter { spec, session, rate: 0.5, idle: 0, drafted: 0, accepted: 0 })
    }

    /// The draft length worth its rows now: the largest `k` with `rate^k > ROW_COST`.
    fn worth(&self) -> usize {
        let mut k = 0;
        let mut reach = self.rate;
        while reach > ROW_COST && k < self.spec.n_max {
            k += 1;
            reach *= self.rate;
        }
        k
    }

    /// At most `max` tokens (and the settings' `n_max`, and what the session's record of taken
    /// drafts makes worth it) that may follow `context`: the session's tokens and then the
    /// token about to be fed.
    pub fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, ModelError> {
        let mut want = self.worth();
        if want == 0 && self.idle >= PROBE_EVERY {
            want = 1;
        }
        let max = max.min(want);
        if max == 0 || context.is_empty() {
            self.idle += 1;
            return Ok(Vec::new());
        }
        let d = match (&self.spec.source, self.session.as_mut()) {
            (DraftSource::Lookup { ngram }, _) => lookup(context, *ngram, max),
            (DraftSource::Model(p), Some(s)) => draft_greedy(p, s, context, max)?,
            (DraftSource::Model(_), None) => Vec::new(),
        };
        self.idle = if d.is_empty() { self.idle + 1 } else { 0 };
        Ok(d)
    }

    /// The next decode run of a generation judged by `rules` (its counts as of the id drawn
    /// last): `context`'s last id — the one drawn last, after the tokens the session holds —
    /// then a draft that fits [`room`] for one pass of `max_run` tokens, and `cap` tokens.
    pub fn run(
        &mut self,
        context: &[u32],
        rules: &StopRules,
        max_run: usize,
        cap: usize,
    ) -> Result<Vec<u32>, ModelError> {
        let Some(&next) = context.last() else { return Ok(Vec::new()) };
        let left = rules.max_tokens.saturating_sub(rules.generated + 1);
        let room = cap.min(room(rules.n_ctx, context.len(), left, max_run));
        let mut run = vec![next];
        run.extend(self.draft(context, room)?);
        Ok(run)
    }

    /// Records a verified draft: `drafted` tokens fed, the first `accepted` of them taken.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        // the walk reached the taken tokens and the first refused one
        let reached = (accepted + 1).min(drafted);
        for i in 0..reached {
            let taken = if i < accepted { 1.0 } else { 0.0 };
            self.rate = 0.9 * self.rate + 0.1 * taken;
        }
    }
}

/// The longest draft a run may carry: its rows stay inside the context of `n_ctx` (a context of
/// `context` tokens, the one about to be fed included), the generation's `left` draws after that
/// token's, and one pass of `max_run` tokens.
pub fn room(n_ctx: usize, context: usize, left: usize, max_run: usize) -> usize {
    n_ctx.saturating_sub(context).min(left).min(max_run.saturating_sub(1))
}

/// The tokens that followed the most recent earlier occurrence of `context`'s last `n` tokens,
/// `max` at most, for the longest `n` in `ngram.0..=ngram.1` that occurred before.
pub fn lookup(context: &[u32], (lo, hi): (usize, usize), max: usize) -> Vec<u32> {
    let len = context.len();
    for n in (lo.max(1)..=hi).rev() {
        if len <= n {
            continue;
        }
        let tail = &context[len - n..];
        if let Some(i) = (0..len - n).rev().find(|&i| &context[i..i + n] == tail) {
            let from = i + n;
            return context[from..(from + max).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// The draft model's greedy continuation of `context`, `max` tokens at most (fewer where its
/// context ends): its session keeps what it shares with `context` and reads the rest.
fn draft_greedy(p: &Pipeline, s: &mut Session, context: &[u32], max: usize) -> Result<Vec<u32>, ModelError> {
    let max = max.min(p.n_ctx().saturating_sub(context.len()));
    if max == 0 {
        return Ok(Vec::new());
    }
    let common = s.tokens().iter().zip(context).take_while(|(a, b)| a == b).count();
    // (the last token is read again when it is all that is new: its logits start the draft)
    let kept = s.truncate(common.min(context.len() - 1));
    let mut logits = p.prefill(s, &context[kept..], PREFILL_CHUNK)?;
    let mut out = Vec::with_capacity(max);
    loop {
        let t = argmax(&logits);
        out.push(t);
        if out.len() == max {
            return Ok(out);
        }
        logits = p.forward(s, &[t], Logits::Last)?.get(0)?.to_vec1::<f32>()?;
    }
}

/// The first index of the largest finite value (0 when there is none).
fn argmax(l: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &v) in l.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0 as u32
}

/// Walks the rows of a verifying pass: `run` is what the pass fed (the token drawn last, then the
/// draft) and `rows[j]` the logits after `run[..=j]`; `draw(j, rows[j])` draws the token that
/// follows and says whether generation goes on (`None`: it ended at that draw). Returns how
/// many rows were used: the draw from row `j` is taken, and the walk goes on to row `j + 1` only
/// when that draw is `run[j + 1]` — so `run[..used]` are the tokens to keep in the caches.
pub fn walk(run: &[u32], rows: &[Vec<f32>], mut draw: impl FnMut(usize, &[f32]) -> Option<u32>) -> usize {
    for (j, row) in rows.iter().enumerate() {
        match draw(j, row) {
            Some(id) if run.get(j + 1) == Some(&id) => continue,
            _ => return j + 1,
        }
    }
    rows.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_takes_the_longest_ngram_seen_last() {
        // ends in "9 2 3": that 3-gram last occurred at 4 (then 5 1), the 2-gram "2 3" last at 9
        // (then 6 9): the longest n-gram that occurred wins
        let ctx = [8, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3, 6, 9, 2, 3];
        assert_eq!(lookup(&ctx, (1, 3), 2), vec![5, 1]);
        assert_eq!(lookup(&ctx, (1, 2), 2), vec![6, 9]);
        // up to the end of the text
        assert_eq!(lookup(&ctx, (2, 2), 8), vec![6, 9, 2, 3]);
        // nothing repeats
        assert!(lookup(&[1, 2, 3, 4], (1, 3), 4).is_empty());
        // a draft may run into the text's own end: "7 7" after "7 7 7"
        assert_eq!(lookup(&[7, 7, 7], (1, 2), 5), vec![7]);
        assert!(lookup(&[], (1, 3), 4).is_empty());
        assert!(lookup(&[5], (1, 3), 4).is_empty());
    }

    #[test]
    fn walk_stops_at_the_first_draw_off_the_draft() {
        let rows = vec![vec![0.0]; 4];
        // draws 5, 6, 8: the run was 4, 5, 6, 7: two drafted tokens kept, the third's row used
        let draws = [5, 6, 8, 9];
        assert_eq!(walk(&[4, 5, 6, 7], &rows, |j, _| Some(draws[j])), 3);
        // every draft taken: all rows used (the last row's draw is the next token)
        assert_eq!(walk(&[4, 5, 6, 7], &rows, |j, _| Some([5, 6, 7, 1][j])), 4);
        // generation ends at the second draw
        let mut seen = Vec::new();
        let used = walk(&[4, 5, 6, 7], &rows, |j, _| {
            seen.push(j);
            (j == 0).then_some(5)
        });
        assert_eq!((used, seen), (2, vec![0, 1]));
        // a run of one token (no draft)
        assert_eq!(walk(&[4], &rows[..1], |_, _| Some(4)), 1);
    }
}
