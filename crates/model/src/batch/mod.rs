//! Continuous batching on one box: up to `parallel` sessions, each with its own KV caches,
//! decoded together.
//!
//! [`Batch`] is the synchronous core; [`Engine`] runs one on its own thread for concurrent
//! callers. Call [`Batch::handle_submit`] / [`Batch::handle_cancel`] with input, then
//! [`Batch::step`] repeatedly; each step
//! 1. admits waiting jobs into free slots (new requests join between steps);
//! 2. prefills one chunk's worth of the admitted prompts (round robin over the prompts being
//!    read): one chunk of one prompt, or — where [`Pipeline::reads_prompts_together`] — the next
//!    chunks of several in one pass while they fit in [`PREFILL_BUDGET_CHUNKS`]; so a long prompt
//!    costs the others one chunk's time per step, not its whole length; the chunks are the ones
//!    [`Pipeline::generate`] uses ([`PREFILL_CHUNK`] tokens from the start of the prompt),
//!    whoever else is in the batch;
//! 3. decodes one token for every session past its prompt, all in one forward pass
//!    ([`Pipeline::forward_runs`]: each weight is read once per step for the whole batch, up to
//!    [`crate::cpu_matmul::DECODE_ROWS`] (8) rows per pass on the CPU) — with speculative
//!    decoding ([`Batch::with_speculation`]) a session's token and its draft, the rows the
//!    batch leaves free.
//!
//! **Batch invariance**: a row's numbers never depend on which other rows share the step (see
//! [`crate::llama::Slice::forward_rows`]), and a job draws with [`crate::sampler::Draw`] (as a
//! cluster's last stage does) and is judged, its runs made, by a [`Generation`] (as `generate`
//! and a cluster's driver are), so a job's output is the one it gets alone, and greedy output
//! equals `brigade run`'s.
//!
//! **Prompt cache**: a slot keeps its last conversation's caches. A job goes to the free slot
//! whose cache begins with the longest run of the job's prompt in whole chunks that the slot's
//! previous prompt was read in (from its start, [`PREFILL_CHUNK`] each), and reads its prompt
//! from there: those chunks' cache entries are exactly what reading them again would compute,
//! so the output is unchanged (a follow-up turn of a chat resends the conversation; its earlier
//! turns' whole chunks are not read again). Tokens that were decoded, or read in a last partial
//! chunk, are read again: the prompt kernels round differently from the decode kernels and a
//! chunk's shape changes its rounding.

mod engine;

pub use engine::{Busy, Engine, EngineConfig, Load, Sink};

use crate::generation::Generation;
use crate::pipeline::{StopReason, PREFILL_CHUNK};
use crate::sampler::{draw_run, Draw, DrawError, Drawn};
use crate::speculative::{Drafter, Speculation};
use crate::{Logits, ModelError, Pipeline, Sampler, SamplingParams, Session};
use brigade_core::stop::{StopRules, Verdict};
use brigade_core::{Constraint, TokenLogprob};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Prompt tokens one step reads at most, together, in chunks' worth: one chunk (512 tokens). On
/// a CPU the prompt's matmuls are compute-bound from a few dozen rows on, so more rows per step
/// only make the decoding sessions wait longer: 8 clients sending 100-token prompts at once to
/// a 1.5B-parameter Q4_K model (`brigade bench -m q4k-1b.gguf --concurrency 1,8 --prompt-tokens
/// 100 -n 32`, 2-vCPU Xeon with AVX-512, one run each way with `BRIGADE_PREFILL_TOGETHER=off`):
/// TTFT p95 4.34 s against 5.21 s one prompt a step, aggregate 34.6 against 31.1 tokens/s,
/// p50 equal; a budget of four chunks read all eight prompts in one step and made p50 1.5×
/// worse for a p95 only 3% better.
pub const PREFILL_BUDGET_CHUNKS: usize = 1;

/// `BRIGADE_PREFILL_TOGETHER=off` reads one prompt per step even where they could be read
/// together (to measure the difference), here and at a cluster's stages.
pub fn together_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("BRIGADE_PREFILL_TOGETHER").map_or(true, |v| v != "off" && v != "0"))
}

/// A job's key, chosen by the caller.
pub type JobId = u64;

/// One completion to compute.
#[derive(Debug, Clone)]
pub struct Job {
    /// Prompt token ids (not empty; at most the context).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    pub sampler: SamplingParams,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
    /// What the answer must spell: each step's logits are masked by it before the draw, and
    /// the job ends when it is complete.
    pub constraint: Option<Constraint>,
    /// Report each token's log-probability and this many most likely alternatives (OpenAI's
    /// `logprobs` / `top_logprobs`), from the step's logits before any mask or penalty.
    pub logprobs: Option<usize>,
}

/// What a job produces, in order: `Started` when a slot takes it, tokens, then one `Done` or
/// `Error` (a job refused before it gets a slot has only the `Error`, one of 0 tokens only the
/// `Done`).
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// The job has a slot; `cached_tokens` of its prompt are kept from the slot's last job.
    Started {
        cached_tokens: usize,
    },
    /// A generated id, with its log-probabilities when the job asked for them.
    Token(u32, Option<TokenLogprob>),
    Done(JobStats),
    Error(String),
}

impl Output {
    /// Whether nothing follows this output.
    pub fn is_last(&self) -> bool {
        matches!(self, Output::Done(_) | Output::Error(_))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobStats {
    pub prompt_tokens: usize,
    pub generated: usize,
    /// `Length` (max tokens), `Eos` or `Context` (the context is full).
    pub stop: StopReason,
    /// From submission to admission into a slot.
    pub queued: Duration,
    /// From admission to the first token.
    pub prompt_time: Duration,
    /// From the first token to the last.
    pub gen_time: Duration,
    /// Prompt tokens whose cache entries were kept from the slot's previous job (not read).
    pub cached_tokens: usize,
}

enum Phase {
    /// `fed` prompt tokens are in the caches.
    Prompt { fed: usize },
    /// The generation's last id was drawn and is fed at the next decode step.
    Decode,
}

struct Active {
    id: JobId,
    /// The prompt, `max_tokens` and the rest ([`Job::constraint`] has moved into `draw`).
    job: Job,
    draw: Draw,
    generation: Generation,
    phase: Phase,
    queued: Duration,
    admitted: Instant,
    first_token: Option<Instant>,
    /// Prompt tokens kept from the slot's previous job.
    cached: usize,
}

struct Slot {
    session: Session,
    active: Option<Active>,
    /// Leading tokens of the session that its last job read as whole prompt chunks from the
    /// start (the part of its cache a later job may keep).
    chunked: usize,
    /// When the slot last took a job ([`Batch::admitted`]): a job that keeps nothing goes to
    /// the slot used longest ago, whose cache is least likely to be wanted.
    used: u64,
    /// Drafts for the slot's decoding ([`Batch::with_speculation`]).
    drafter: Option<Drafter>,
}

/// The batch: slots with preallocated sessions, the jobs waiting for one, and the step.
pub struct Batch {
    pipeline: Arc<Pipeline>,
    slots: Vec<Slot>,
    waiting: VecDeque<(JobId, Job, Instant)>,
    is_eog: Box<dyn Fn(u32) -> bool + Send>,
    chunk: usize,
    /// The slot whose prompt is read next, if it still has one (round robin).
    cursor: usize,
    /// Jobs admitted so far.
    admitted: u64,
}

impl Batch {
    /// `parallel` slots, each with its KV caches allocated now; `is_eog` says which tokens end
    /// a generation (the tokenizer's).
    pub fn new(
        pipeline: Arc<Pipeline>,
        parallel: usize,
        is_eog: impl Fn(u32) -> bool + Send + 'static,
    ) -> Result<Self, ModelError> {
        if parallel == 0 {
            return Err(ModelError::BadInput("a batch of 0 slots".into()));
        }
        let slots = (0..parallel)
            .map(|_| Ok(Slot { session: pipeline.new_session()?, active: None, chunked: 0, used: 0, drafter: None }))
            .collect::<Result<_, ModelError>>()?;
        Ok(Batch {
            pipeline,
            slots,
            waiting: VecDeque::new(),
            is_eog: Box::new(is_eog),
            chunk: PREFILL_CHUNK,
            cursor: 0,
            admitted: 0,
        })
    }

    /// Prompt chunks of `n` tokens instead of [`PREFILL_CHUNK`] (tests; outputs then equal
    /// those of [`Pipeline::prefill`] with `n`, not `generate`'s).
    pub fn with_prefill_chunk(mut self, n: usize) -> Self {
        self.chunk = n.max(1);
        self
    }

    /// Speculative decoding ([`crate::speculative`]): each slot drafts (a draft model gets a
    /// session per slot, allocated now) and a decode pass verifies the drafts with the tokens,
    /// in the rows one pass reads each weight for ([`crate::cpu_matmul::DECODE_ROWS`], shared
    /// evenly by the decoding sessions: a full batch drafts nothing). Every job's text is the
    /// one it gets without.
    pub fn with_speculation(mut self, spec: Arc<Speculation>) -> Result<Self, ModelError> {
        let vocab = self.pipeline.vocab();
        for s in &mut self.slots {
            s.drafter = Some(Drafter::new(spec.clone(), vocab)?);
        }
        Ok(self)
    }

    /// Tokens drafted and of them accepted, over every slot's life.
    pub fn drafts(&self) -> (u64, u64) {
        self.slots.iter().filter_map(|s| s.drafter.as_ref()).fold((0, 0), |(d, a), x| (d + x.drafted, a + x.accepted))
    }

    /// Queues a job; it is admitted at the start of a step when a slot is free.
    pub fn handle_submit(&mut self, id: JobId, job: Job) {
        self.waiting.push_back((id, job, Instant::now()));
    }

    /// Drops a job, waiting or running; its slot is free for the next step. False if unknown.
    pub fn handle_cancel(&mut self, id: JobId) -> bool {
        if let Some(i) = self.waiting.iter().position(|w| w.0 == id) {
            self.waiting.remove(i);
            return true;
        }
        match self.slots.iter_mut().find(|s| s.active.as_ref().is_some_and(|a| a.id == id)) {
            Some(s) => {
                s.active = None;
                true
            }
            None => false,
        }
    }

    /// Slots and jobs in them.
    pub fn parallel(&self) -> usize {
        self.slots.len()
    }
    pub fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.active.is_some()).count()
    }
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
    /// Nothing to compute: no job running or waiting.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.slots.iter().all(|s| s.active.is_none())
    }

    /// One step (admit, prompt chunks, one decode pass); returns what each job produced.
    pub fn step(&mut self) -> Vec<(JobId, Output)> {
        let mut out = Vec::new();
        self.admit(&mut out);
        if self.pipeline.reads_prompts_together() && together_allowed() {
            self.prefill_together(&mut out);
        } else {
            self.prefill_one(&mut out);
        }
        self.decode(&mut out);
        out
    }

    fn admit(&mut self, out: &mut Vec<(JobId, Output)>) {
        let n_ctx = self.pipeline.n_ctx();
        while self.slots.iter().any(|s| s.active.is_none()) {
            let Some((id, job, t)) = self.waiting.pop_front() else { break };
            let queued = t.elapsed();
            if job.prompt.is_empty() {
                out.push((id, Output::Error("empty prompt: nothing to start from".into())));
                continue;
            }
            // an id past the model's vocabulary fails its job here, not a pass it shares
            let vocab = self.pipeline.vocab();
            if let Some(&bad) = job.prompt.iter().find(|&&t| t as usize >= vocab) {
                let e = ModelError::BadInput(format!("token id {bad} is outside the vocabulary of {vocab}"));
                out.push((id, Output::Error(e.to_string())));
                continue;
            }
            if job.prompt.len() > n_ctx {
                let e = ModelError::ContextFull { need: job.prompt.len(), n_ctx };
                out.push((id, Output::Error(e.to_string())));
                continue;
            }
            if job.max_tokens == 0 {
                let stats = JobStats {
                    prompt_tokens: job.prompt.len(),
                    generated: 0,
                    stop: StopReason::Length,
                    queued,
                    prompt_time: Duration::ZERO,
                    gen_time: Duration::ZERO,
                    cached_tokens: 0,
                };
                out.push((id, Output::Done(stats)));
                continue;
            }
            let rules = StopRules { max_tokens: job.max_tokens, n_ctx, ignore_eos: job.ignore_eos, generated: 0 };
            let generation = match Generation::new(job.prompt.clone(), rules, self.pipeline.max_run()) {
                Ok(g) => g,
                Err(e) => {
                    out.push((id, Output::Error(e.to_string())));
                    continue;
                }
            };
            let mut job = job;
            let sampler = Sampler::new(job.sampler.clone());
            let draw = Draw::new(sampler, job.prompt.clone(), job.constraint.take(), job.logprobs, None);
            let (i, cached) = self.best_slot(&job.prompt);
            self.admitted += 1;
            let slot = &mut self.slots[i];
            let cached = slot.session.truncate(cached);
            slot.chunked = job.prompt.len() / self.chunk * self.chunk;
            slot.used = self.admitted;
            slot.active = Some(Active {
                id,
                draw,
                generation,
                job,
                phase: Phase::Prompt { fed: cached },
                queued,
                admitted: Instant::now(),
                first_token: None,
                cached,
            });
            out.push((id, Output::Started { cached_tokens: cached }));
        }
    }

    /// The free slot whose cache holds the longest run of whole chunks that begin `prompt` (of
    /// those that hold none, the one used longest ago), and that run's length: at most the
    /// chunks the slot's last prompt was read in, and short of the whole prompt (its last chunk
    /// gives the logits). There is a free slot.
    fn best_slot(&self, prompt: &[u32]) -> (usize, usize) {
        let mut best: Option<(usize, usize, u64)> = None;
        for (i, s) in self.slots.iter().enumerate().filter(|(_, s)| s.active.is_none()) {
            let common = s.session.tokens().iter().zip(prompt).take_while(|(a, b)| a == b).count();
            let keep = common.min(s.chunked).min(prompt.len().saturating_sub(1)) / self.chunk * self.chunk;
            // (a sliding-window cache may no longer hold what that prefix needs)
            let keep = s.session.keepable(keep);
            if best.is_none_or(|(_, k, used)| keep > k || (keep == k && s.used < used)) {
                best = Some((i, keep, s.used));
            }
        }
        best.map_or((0, 0), |(i, k, _)| (i, k))
    }

    fn prefill_one(&mut self, out: &mut Vec<(JobId, Output)>) {
        let n = self.slots.len();
        let reading = |s: &Slot| matches!(s.active, Some(Active { phase: Phase::Prompt { .. }, .. }));
        let Some(i) = (0..n).map(|k| (self.cursor + k) % n).find(|&i| reading(&self.slots[i])) else {
            return;
        };
        self.cursor = (i + 1) % n;
        let slot = &mut self.slots[i];
        let Some(a) = slot.active.as_mut() else { return };
        let Phase::Prompt { fed } = a.phase else { return };
        let end = (fed + self.chunk).min(a.job.prompt.len());
        let r = self.pipeline.forward(&mut slot.session, &a.job.prompt[fed..end], Logits::Last);
        let logits = r.and_then(|l| {
            let last = l.dim(0)? - 1;
            Ok(l.get(last)?.to_vec1::<f32>()?)
        });
        match logits {
            Err(e) => fail(slot, &e, out),
            Ok(_) if end < a.job.prompt.len() => a.phase = Phase::Prompt { fed: end },
            Ok(l) => {
                let drawn = a.draw.draw(&l).map(|d| vec![d]);
                self.answered(i, drawn, out);
            }
        }
    }

    /// The next chunk of every slot reading a prompt, from the cursor on, while the step's
    /// budget of [`PREFILL_BUDGET_CHUNKS`] chunks' tokens holds (one chunk at least), in one
    /// pass ([`Pipeline::forward_ragged`]): prompts that arrive together are read together, and
    /// each chunk is the one it would be alone (same boundaries, same numbers).
    fn prefill_together(&mut self, out: &mut Vec<(JobId, Output)>) {
        let n = self.slots.len();
        let mut budget = self.chunk * PREFILL_BUDGET_CHUNKS;
        // (slot, fed, end)
        let mut picked: Vec<(usize, usize, usize)> = Vec::new();
        for i in (0..n).map(|k| (self.cursor + k) % n) {
            let Some(Active { phase: Phase::Prompt { fed }, job, .. }) = &self.slots[i].active else { continue };
            let end = (fed + self.chunk).min(job.prompt.len());
            if !picked.is_empty() && end - fed > budget {
                break;
            }
            budget = budget.saturating_sub(end - fed);
            picked.push((i, *fed, end));
        }
        let Some(&(last, _, _)) = picked.last() else { return };
        if picked.len() == 1 {
            // alone: the one-session pass (its fused step for a one-token chunk), the same slot
            return self.prefill_one(out);
        }
        self.cursor = (last + 1) % n;
        // (in slot order: a row's numbers do not depend on where it is in the pass)
        picked.sort_unstable();
        let chunks: Vec<Vec<u32>> = picked
            .iter()
            .map(|&(i, fed, end)| self.slots[i].active.as_ref().map_or(Vec::new(), |a| a.job.prompt[fed..end].to_vec()))
            .collect();
        let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
        let result = {
            let mut sessions: Vec<&mut Session> = self
                .slots
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| picked.iter().any(|p| p.0 == *i))
                .map(|(_, s)| &mut s.session)
                .collect();
            self.pipeline.forward_ragged(&mut sessions, &refs)
        };
        match result {
            Err(e) => {
                for &(i, _, _) in &picked {
                    fail(&mut self.slots[i], &e, out);
                }
            }
            Ok(logits) => {
                for (&(i, _, end), l) in picked.iter().zip(logits) {
                    let Some(a) = self.slots[i].active.as_mut() else { continue };
                    if end < a.job.prompt.len() {
                        a.phase = Phase::Prompt { fed: end };
                    } else {
                        let drawn = a.draw.draw(&l).map(|d| vec![d]);
                        self.answered(i, drawn, out);
                    }
                }
            }
        }
    }

    fn decode(&mut self, out: &mut Vec<(JobId, Output)>) {
        let n = self.slots.iter().filter(|s| matches!(s.active, Some(Active { phase: Phase::Decode, .. }))).count();
        if n == 0 {
            return;
        }
        // drafts fill the rows one pass reads each weight for (DECODE_ROWS), shared out evenly
        let spare = crate::cpu_matmul::DECODE_ROWS.saturating_sub(n) / n;
        // (slot, its run: the token drawn last, then its draft)
        let mut decoding: Vec<usize> = Vec::with_capacity(n);
        let mut runs: Vec<Vec<u32>> = Vec::with_capacity(n);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(a) = slot.active.as_mut() else { continue };
            let Phase::Decode = a.phase else { continue };
            decoding.push(i);
            // (a draft that cannot be made is no draft: the job goes on without)
            let run = match a.generation.next_run(slot.drafter.as_mut(), spare) {
                Ok(run) => run.to_vec(),
                Err(_) => a.generation.run().to_vec(),
            };
            runs.push(run);
        }
        let result = {
            let mut sessions: Vec<&mut Session> = self
                .slots
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| decoding.contains(i))
                .map(|(_, s)| &mut s.session)
                .collect();
            let refs: Vec<&[u32]> = runs.iter().map(Vec::as_slice).collect();
            self.pipeline.forward_runs(&mut sessions, &refs)
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                for i in decoding {
                    fail(&mut self.slots[i], &e, out);
                }
                return;
            }
        };
        let mut rows = logits.into_iter();
        for (i, run) in decoding.into_iter().zip(runs) {
            let rows: Vec<Vec<f32>> = rows.by_ref().take(run.len()).collect();
            let start = self.slots[i].session.len() + 1 - run.len();
            let slot = &mut self.slots[i];
            let Some(a) = slot.active.as_mut() else { continue };
            let drawn = draw_run(&mut a.draw, &run, &rows, &self.is_eog);
            // the rows whose draws were taken (on a failure, the run's first: the job ends)
            let used = drawn.as_ref().map_or(1, Vec::len);
            a.generation.ran(slot.drafter.as_mut(), used);
            let keep = start - 1 + used;
            if slot.session.truncate(keep) != keep {
                let e = ModelError::BadSlice(format!("a session cannot go back to {keep} tokens after a draft"));
                fail(slot, &e, out);
                continue;
            }
            self.answered(i, drawn, out);
        }
    }

    /// Slot `i`'s draws from its last pass judged by the job's [`Generation`]: the tokens of
    /// the answer go out, and the job ends where the rules say or goes on from its last.
    fn answered(&mut self, i: usize, drawn: Result<Vec<Drawn>, DrawError>, out: &mut Vec<(JobId, Output)>) {
        let slot = &mut self.slots[i];
        let drawn = match drawn {
            Ok(d) => d,
            Err(e) => return fail(slot, &ModelError::BadInput(e.0), out),
        };
        let Some(a) = slot.active.as_mut() else { return };
        let first = *a.first_token.get_or_insert_with(Instant::now);
        let mut stop = None;
        for d in drawn {
            let verdict = a.generation.judge(d.id, (self.is_eog)(d.id), d.done);
            if verdict != Verdict::Unsent {
                // the last token is not fed (as `generate`): the session's tokens stay its caches'
                out.push((a.id, Output::Token(d.id, d.scores)));
                a.phase = Phase::Decode;
            }
            stop = verdict.stop();
            if stop.is_some() {
                break;
            }
        }
        if let Some(stop) = stop {
            let stats = JobStats {
                prompt_tokens: a.job.prompt.len(),
                generated: a.generation.generated(),
                stop,
                queued: a.queued,
                prompt_time: first - a.admitted,
                gen_time: first.elapsed(),
                cached_tokens: a.cached,
            };
            out.push((a.id, Output::Done(stats)));
            slot.active = None;
        }
    }
}

fn fail(slot: &mut Slot, e: &ModelError, out: &mut Vec<(JobId, Output)>) {
    if let Some(a) = slot.active.take() {
        out.push((a.id, Output::Error(e.to_string())));
    }
}
