//! One generation's decisions without IO, the same for every engine: the one box's
//! [`crate::Pipeline::generate`] and batch ([`crate::batch`]), and a cluster's session driver
//! (`brigade-worker`'s `SessionCore`), which only move what it decides.
//!
//! A [`Generation`] holds the session's tokens up to the id drawn last and the stop rules with
//! their count ([`StopRules`]); the engine keeps the session's drafter (a batch slot's outlives
//! its jobs) and lends it. Each pass feeds its [`Generation::run`] (the id
//! drawn last, then a draft); the engine draws from the pass's rows (`sampler::draw_run`, or
//! the cluster's last stage), tells it how many rows were used ([`Generation::ran`]) and hands
//! it the ids one by one ([`Generation::judge`]): an id is the answer's or ends it, as the rules
//! say. Then [`Generation::next_run`] is the next pass's run. How the ids are drawn, streamed
//! and fed is the engine's.

use crate::speculative::Drafter;
use crate::ModelError;
use brigade_core::stop::{StopRules, Verdict};

/// One generation's state (see the module documentation).
pub struct Generation {
    rules: StopRules,
    /// The session's tokens through the first id of the run fed last, then every id the rules
    /// took since: the logits of the next id to judge follow all of them.
    context: Vec<u32>,
    /// The run fed last: the id drawn before it, then its draft.
    run: Vec<u32>,
    /// Tokens one pass may hold for one session ([`crate::Pipeline::max_run`]).
    max_run: usize,
}

impl Generation {
    /// A generation after `context` (the session's tokens, all fed: the prompt, and after a
    /// failover the ids resumed), judged by `rules`, its runs at most `max_run` tokens. Its
    /// first run is the context's last token, whose row gives the first draw.
    pub fn new(context: Vec<u32>, rules: StopRules, max_run: usize) -> Result<Self, ModelError> {
        let Some(&last) = context.last() else {
            return Err(ModelError::BadInput("empty prompt: nothing to start from (the model adds no BOS)".into()));
        };
        Ok(Generation { rules, context, run: vec![last], max_run: max_run.max(1) })
    }

    /// The run fed last (or to feed now): the id drawn last, then its draft.
    pub fn run(&self) -> &[u32] {
        &self.run
    }

    /// The session's tokens through the run's first, then the ids taken since.
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// Ids of the answer so far (after a failover, those resumed count).
    pub fn generated(&self) -> usize {
        self.rules.generated
    }

    /// The pass over [`Generation::run`] gave draws from its first `used` rows (each row's draw
    /// was the draft's next id, but for the last): the drafter that drafted it learns what it
    /// had right.
    pub fn ran(&self, drafter: Option<&mut Drafter>, used: usize) {
        if let Some(d) = drafter {
            d.verified(self.run.len() - 1, used.saturating_sub(1));
        }
    }

    /// The next id of the answer, drawn in order after those judged before: `eog` whether it
    /// ends a generation, `done` whether it completes the answer's format. The rules say whether
    /// it is the answer's and whether the answer ends with it; one that is joins the context.
    pub fn judge(&mut self, id: u32, eog: bool, done: bool) -> Verdict {
        let verdict = self.rules.judge(eog, done, self.context.len());
        if verdict != Verdict::Unsent {
            self.context.push(id);
        }
        verdict
    }

    /// The next pass's run: the id taken last, then (with a drafter) a draft that fits the
    /// context, the answer's `max_tokens`, one pass and `cap` rows more.
    pub fn next_run(&mut self, drafter: Option<&mut Drafter>, cap: usize) -> Result<&[u32], ModelError> {
        let last = self.context[self.context.len() - 1];
        // (a draft that cannot be made leaves the run at the id alone)
        self.run = vec![last];
        if let Some(d) = drafter {
            self.run = d.run(&self.context, &self.rules, self.max_run, cap)?;
        }
        Ok(&self.run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::{DraftSource, Speculation};
    use brigade_core::stop::StopReason;
    use std::sync::Arc;

    fn rules(max_tokens: usize) -> StopRules {
        StopRules { max_tokens, n_ctx: 64, ignore_eos: false, generated: 0 }
    }

    #[test]
    fn the_ids_taken_join_the_context_and_the_next_run_starts_with_the_last() {
        let mut g = Generation::new(vec![1, 2, 3], rules(3), 8).unwrap();
        assert_eq!(g.run(), [3]);
        assert_eq!(g.judge(7, false, false), Verdict::Next);
        assert_eq!(g.next_run(None, 8).unwrap(), [7]);
        assert_eq!(g.judge(8, false, false), Verdict::Next);
        assert_eq!(g.judge(9, false, false), Verdict::Last(StopReason::Length));
        assert_eq!((g.context(), g.generated()), (&[1, 2, 3, 7, 8, 9][..], 3));
        // an end-of-generation id is not the answer's
        let mut g = Generation::new(vec![1], rules(9), 8).unwrap();
        assert_eq!(g.judge(0, true, false), Verdict::Unsent);
        assert_eq!((g.context(), g.generated()), (&[1][..], 0));
        assert!(Generation::new(Vec::new(), rules(9), 8).is_err());
    }

    #[test]
    fn a_run_carries_a_draft_within_the_answers_length_and_the_drafter_learns_what_was_taken() {
        let spec = Arc::new(Speculation { source: DraftSource::Lookup { ngram: (1, 3) }, n_max: 16 });
        let mut d = Drafter::new(spec, 100).unwrap();
        // "5 6 7 5 6": prompt lookup drafts "7 5 6 …" after the 6
        let mut g = Generation::new(vec![5, 6, 7, 5], rules(4), 65).unwrap();
        g.judge(6, false, false);
        let run = g.next_run(Some(&mut d), usize::MAX).unwrap().to_vec();
        assert_eq!(run[0], 6);
        assert!(run.len() <= 4, "the draft stays within max_tokens: {run:?}");
        assert!(run.len() > 1, "the repeat is drafted: {run:?}");
        g.ran(Some(&mut d), 2);
        assert_eq!((d.drafted, d.accepted), ((run.len() - 1) as u64, 1));
        // a cap of no rows: no draft
        assert_eq!(g.next_run(Some(&mut d), 0).unwrap().len(), 1);
    }
}
