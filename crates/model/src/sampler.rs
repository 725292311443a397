//! Token sampling in llama.cpp's order: penalties (repetition, frequency, presence), top-k, top-p,
//! min-p, temperature, then a draw from a seeded generator. Temperature 0 (or below) is greedy.
//!
//! [`Draw`] is how every engine draws a session's next id — the one box's batch and a cluster's
//! last stage alike: the format's mask, the sampling chain, the format told the id, the scores
//! from the logits as they came; [`draw_run`] walks a decode run's rows with it.

pub use brigade_core::SamplingParams;
use brigade_core::{Constraint, TokenLogprob};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub struct Sampler {
    cfg: SamplingParams,
    rng: ChaCha8Rng,
    candidates: Vec<(u32, f32)>,
    /// How often each token occurs in the penalty window (reused between calls).
    counts: std::collections::HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(cfg: SamplingParams) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Self { cfg, rng, candidates: Vec::new(), counts: Default::default() }
    }

    /// A sampler that goes on where one that drew `draws` ids stopped: its generator past the
    /// numbers those draws took (one each above temperature 0), so that a session resumed after
    /// a failover draws from the same logits what the uninterrupted one would.
    pub fn resumed(cfg: SamplingParams, draws: usize) -> Self {
        let mut s = Self::new(cfg);
        if s.cfg.temperature > 0.0 {
            for _ in 0..draws {
                let _: f32 = s.rng.random();
            }
        }
        s
    }

    pub fn config(&self) -> &SamplingParams {
        &self.cfg
    }

    /// Picks the next token from `logits` given the tokens so far (for the penalty).
    /// Non-finite logits are never picked unless every logit is non-finite.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let c = &self.cfg;
        // llama.cpp's penalties sampler: a token seen `n` times in the window has its logit
        // divided by the repeat penalty (multiplied when not positive), then `n × frequency +
        // presence` subtracted
        let penalise = c.penalises();
        let counts = &mut self.counts;
        counts.clear();
        if penalise {
            for &t in &history[history.len().saturating_sub(c.repeat_last_n)..] {
                *counts.entry(t).or_insert(0) += 1;
            }
        }
        let counts = &*counts;
        let adjusted = |id: usize, l: f32| -> f32 {
            match counts.get(&(id as u32)) {
                Some(&n) => {
                    let l = if l > 0.0 { l / c.repeat_penalty } else { l * c.repeat_penalty };
                    l - n as f32 * c.frequency_penalty - c.presence_penalty
                }
                None => l,
            }
        };

        if c.temperature <= 0.0 {
            let mut best = 0usize;
            let mut best_l = f32::NEG_INFINITY;
            for (i, &l) in logits.iter().enumerate() {
                let l = adjusted(i, l);
                if l > best_l {
                    best_l = l;
                    best = i;
                }
            }
            return best as u32;
        }

        let cands = &mut self.candidates;
        cands.clear();
        cands
            .extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as u32, adjusted(i, l))));
        if cands.is_empty() {
            return 0;
        }
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if c.top_k > 0 && c.top_k < cands.len() {
            cands.select_nth_unstable_by(c.top_k - 1, by_logit_desc);
            cands.truncate(c.top_k);
        }
        cands.sort_unstable_by(by_logit_desc);
        // softmax at temperature 1 for the nucleus and min-p cuts, as llama.cpp does
        let max = cands[0].1;
        let mut probs: Vec<f32> = cands.iter().map(|(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cands.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= c.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep);
            probs.truncate(keep);
        }
        if c.min_p > 0.0 {
            let cut = probs[0] * c.min_p;
            let keep = probs.iter().take_while(|&&p| p >= cut).count().max(1);
            cands.truncate(keep);
        }
        let weights: Vec<f32> = cands.iter().map(|(_, l)| ((l - max) / c.temperature).exp()).collect();
        let total: f32 = weights.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, w) in weights.iter().enumerate() {
            if r < *w {
                return cands[i].0;
            }
            r -= w;
        }
        cands[cands.len() - 1].0
    }
}

/// A session's drawing state: its sampler, every id the session has seen (the penalties'),
/// the format its answer must follow, how many alternatives to score.
pub struct Draw {
    sampler: Sampler,
    history: Vec<u32>,
    constraint: Option<Constraint>,
    logprobs: Option<usize>,
    /// The end-of-sequence id: what a format complete before the draw (the ids a failover
    /// resumed with finished it) answers.
    eos: Option<u32>,
}

/// An id drawn, with what the stop rules and the caller need to know of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    pub id: u32,
    /// The id completes the session's format.
    pub done: bool,
    /// Its log-probability and the most likely alternatives, when the session asked for them.
    pub scores: Option<TokenLogprob>,
}

/// A draw the session's format refused (its message), or a complete format with no
/// end-of-sequence id to answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DrawError(pub String);

impl Draw {
    /// Draws with `sampler` after `history` (the session's tokens so far), masked by
    /// `constraint`, scoring `logprobs` alternatives; `eos` answers a format already complete.
    pub fn new(
        sampler: Sampler,
        history: Vec<u32>,
        constraint: Option<Constraint>,
        logprobs: Option<usize>,
        eos: Option<u32>,
    ) -> Self {
        Draw { sampler, history, constraint, logprobs, eos }
    }

    /// The next id from `logits`, which follow the session's history; the id joins the history.
    pub fn draw(&mut self, logits: &[f32]) -> Result<Drawn, DrawError> {
        let complete = self.constraint.as_ref().is_some_and(|Constraint(c)| c.is_done());
        let (id, done) = match self.constraint.as_mut() {
            Some(_) if complete => {
                let id = self.eos.ok_or_else(|| {
                    DrawError("the format is complete and the model names no end-of-sequence id".into())
                })?;
                (id, true)
            }
            None => (self.sampler.sample(logits, &self.history), false),
            Some(Constraint(c)) => {
                let mut masked = logits.to_vec();
                c.mask(&mut masked).map_err(DrawError)?;
                let id = self.sampler.sample(&masked, &self.history);
                c.commit(id).map_err(DrawError)?;
                (id, c.is_done())
            }
        };
        if !complete {
            self.history.push(id);
        }
        let scores = self.logprobs.map(|n| TokenLogprob::of(logits, id, n));
        Ok(Drawn { id, done, scores })
    }
}

/// Draws along a decode run ([`crate::speculative::walk`]: `run` the ids fed, the id drawn last
/// then a draft; `rows[j]` the logits after `run[..=j]`): a draw from each row in order, on to
/// the next row only where the draw is the run's next id and is neither an end-of-generation id
/// nor completes the format (the stop rules end the answer there). Each row's draw is the one
/// plain decoding makes: its logits are those one token at a time gives.
pub fn draw_run(
    draw: &mut Draw,
    run: &[u32],
    rows: &[Vec<f32>],
    is_eog: impl Fn(u32) -> bool,
) -> Result<Vec<Drawn>, DrawError> {
    let mut out: Vec<Drawn> = Vec::with_capacity(rows.len());
    let mut failed = None;
    crate::speculative::walk(run, rows, |_, l| match draw.draw(l) {
        Ok(d) => {
            let (id, stop) = (d.id, d.done || is_eog(d.id));
            out.push(d);
            (!stop).then_some(id)
        }
        Err(e) => {
            failed = Some(e);
            None
        }
    });
    failed.map_or(Ok(out), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_and_penalty_moves_it() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&logits, &[]), 1);
        let mut s = Sampler::new(SamplingParams { repeat_penalty: 1.5, ..SamplingParams::greedy() });
        assert_eq!(s.sample(&logits, &[1]), 2);
    }

    #[test]
    fn frequency_and_presence_penalties_as_llama_cpp() {
        // token 1 seen twice, token 2 once: 3.0 - 2×0.6 - 0.5 = 1.3 < 2.9 - 0.6 - 0.5 = 1.8 < 2.0
        let logits = [0.1, 3.0, 2.9, 2.0];
        let cfg = SamplingParams { frequency_penalty: 0.6, presence_penalty: 0.5, ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(cfg.clone()).sample(&logits, &[1, 2, 1]), 3);
        // only the window counts, and presence alone moves the choice by a fixed amount
        let cfg = SamplingParams { repeat_last_n: 1, ..cfg };
        assert_eq!(Sampler::new(cfg).sample(&logits, &[1, 2, 1]), 2);
        let cfg = SamplingParams { presence_penalty: 0.05, ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(cfg.clone()).sample(&logits, &[1]), 1);
        assert_eq!(Sampler::new(SamplingParams { presence_penalty: 0.2, ..cfg }).sample(&logits, &[1]), 2);
        // a negative logit seen before: multiplied by the repeat penalty, then shifted
        let logits = [-1.0, -1.5];
        let cfg = SamplingParams { repeat_penalty: 2.0, frequency_penalty: 0.1, ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(cfg).sample(&logits, &[0]), 1);
    }

    #[test]
    fn a_resumed_sampler_draws_what_the_uninterrupted_one_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.71).cos() * 3.0).collect();
        let cfg = SamplingParams { temperature: 0.8, top_k: 20, seed: 5, ..Default::default() };
        let mut whole = Sampler::new(cfg.clone());
        let ids: Vec<u32> = (0..30).map(|_| whole.sample(&logits, &[])).collect();
        let mut resumed = Sampler::resumed(cfg.clone(), 12);
        let rest: Vec<u32> = (12..30).map(|_| resumed.sample(&logits, &[])).collect();
        assert_eq!(rest[..], ids[12..]);
        let mut fresh = Sampler::new(cfg);
        assert_ne!((12..30).map(|_| fresh.sample(&logits, &[])).collect::<Vec<_>>(), rest, "skipping matters");
    }

    #[test]
    fn same_seed_same_tokens_and_cuts_hold() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let cfg = SamplingParams { temperature: 1.0, top_k: 5, top_p: 1.0, min_p: 0.0, seed: 42, ..Default::default() };
        let draw = |cfg: &SamplingParams| {
            let mut s = Sampler::new(cfg.clone());
            (0..200).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        let a = draw(&cfg);
        assert_eq!(a, draw(&cfg));
        assert_ne!(a, draw(&SamplingParams { seed: 43, ..cfg.clone() }));
        let mut top5: Vec<u32> = (0..100).collect();
        top5.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
        top5.truncate(5);
        assert!(a.iter().all(|t| top5.contains(t)));
        // several distinct tokens are drawn at temperature 1
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() >= 3);
        // min-p 1.0 keeps only the best
        let mut s =
            Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 1.0, ..Default::default() });
        assert_eq!(s.sample(&logits, &[]), top5[0]);
        // top-p tiny keeps only the best
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.0001,
            min_p: 0.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&logits, &[]), top5[0]);
    }

    /// One hot logit per row: a greedy draw takes it.
    fn rows(hot: &[usize]) -> Vec<Vec<f32>> {
        hot.iter()
            .map(|&h| {
                let mut l = vec![0.0f32; 8];
                l[h] = 5.0;
                l
            })
            .collect()
    }

    #[test]
    fn a_run_is_drawn_while_the_draws_follow_its_draft() {
        let greedy = || Draw::new(Sampler::new(SamplingParams::greedy()), vec![1], None, Some(1), None);
        // run [2, 3, 4]: the draw after 2 is 3 (taken), after 3 is 6 (not the draft's 4): stop
        let mut d = greedy();
        let got = draw_run(&mut d, &[2, 3, 4], &rows(&[3, 6, 4]), |_| false).unwrap();
        assert_eq!(got.iter().map(|d| d.id).collect::<Vec<_>>(), [3, 6]);
        assert_eq!(d.history, [1, 3, 6], "the draws join the history");
        let s = got[0].scores.as_ref().unwrap();
        assert_eq!((s.top[0].0, s.top.len()), (3, 1));
        // an end-of-generation draw ends the walk even where it is the draft's
        let got = draw_run(&mut greedy(), &[2, 7, 4], &rows(&[7, 4, 4]), |id| id == 7).unwrap();
        assert_eq!(got.len(), 1);
    }

    /// A format: the ids it allows, in order; done after the last.
    struct Script(Vec<u32>, usize);

    impl brigade_core::TokenConstraint for Script {
        fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
            let want = *self.0.get(self.1).ok_or("past the end")?;
            logits.iter_mut().enumerate().filter(|(i, _)| *i as u32 != want).for_each(|(_, l)| *l = f32::NEG_INFINITY);
            Ok(())
        }
        fn commit(&mut self, id: u32) -> Result<(), String> {
            self.1 += 1;
            (Some(&id) == self.0.get(self.1 - 1)).then_some(()).ok_or_else(|| format!("{id} is not allowed"))
        }
        fn is_done(&self) -> bool {
            self.1 == self.0.len()
        }
        fn boxed_clone(&self) -> Box<dyn brigade_core::TokenConstraint> {
            Box::new(Script(self.0.clone(), self.1))
        }
    }

    #[test]
    fn a_format_masks_the_draw_ends_the_walk_and_a_complete_one_answers_eos() {
        let with = |script: Vec<u32>, at: usize, eos: Option<u32>| {
            let c = Some(Constraint(Box::new(Script(script, at))));
            Draw::new(Sampler::new(SamplingParams::greedy()), vec![], c, Some(1), eos)
        };
        // the mask beats the logits; the draw that completes the format ends the walk
        let mut d = with(vec![5, 6], 0, Some(7));
        let got = draw_run(&mut d, &[1, 5, 6], &rows(&[2, 2, 2]), |_| false).unwrap();
        assert_eq!(
            got,
            vec![
                Drawn { id: 5, done: false, scores: Some(TokenLogprob::of(&rows(&[2])[0], 5, 1)) },
                Drawn { id: 6, done: true, scores: Some(TokenLogprob::of(&rows(&[2])[0], 6, 1)) },
            ]
        );
        // complete before the draw (a failover resumed with its end): the end-of-sequence id
        let mut d = with(vec![5], 1, Some(7));
        assert_eq!(d.draw(&rows(&[2])[0]).unwrap().id, 7);
        assert!(d.history.is_empty(), "the end is not the format's: the history does not take it");
        assert!(with(vec![5], 1, None).draw(&rows(&[2])[0]).unwrap_err().0.contains("no end-of-sequence"));
        // a format that refuses: the draw's error
        assert_eq!(with(vec![5], 2, None).draw(&rows(&[2])[0]).unwrap_err(), DrawError("past the end".into()));
    }
}
