//! Several slices in one process: the single-box form of a placement. A hop between stages is a
//! device copy of the hidden state, not a socket.
//!
//! A [`Session`]'s tokens are exactly what its caches hold: a forward pass that fails in any stage
//! leaves every stage's cache as it was before the call (or, where a sliding-window cache has
//! already let go of keys that point needs — a chunk read in several passes failed after the
//! first —, empty: [`Session::keepable`]), and the last token `generate` samples without
//! feeding is returned in [`GenerationStats::unfed`], not recorded as fed.

use crate::device::{activation_dtype, candle_device};
use crate::generation::Generation;
use crate::llama::{ExpertSplit, Logits, Slice, SliceCache, StageInput};
use crate::sampler::Sampler;
use crate::speculative::Drafter;
use crate::weights::ModelFiles;
use crate::ModelError;
pub use brigade_core::stop::StopReason;
use brigade_core::stop::{StopRules, Verdict};
use brigade_core::{DeviceId, Stage};
use candle_core::{Device, Tensor};
use serde::Serialize;
use std::time::{Duration, Instant};

/// Prompt tokens per forward pass: `generate` prefills in chunks of this many, and so does the
/// batch engine (its greedy output equals `generate`'s).
pub const PREFILL_CHUNK: usize = 512;

/// What one stage holds.
#[derive(Debug, Clone, Serialize)]
pub struct StageReport {
    pub device: DeviceId,
    pub layers: (usize, usize),
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    /// Bytes of the stage's routed experts held in host RAM apart from its layers
    /// ([`Pipeline::load_cpu_moe`]); 0 when the stage holds all of its experts.
    pub host_expert_bytes: u64,
}

pub struct Pipeline {
    stages: Vec<(DeviceId, Slice)>,
    /// Per stage, the bytes of its experts held in host RAM by an [`ExpertShard`].
    host_experts: Vec<u64>,
    n_ctx: usize,
    /// Decode steps (one token per session) and each stage's nanoseconds in them, for the
    /// operator's figures (`brigade serve`'s `/metrics`). On a GPU the time is until candle
    /// returns, which may be before the kernels finish.
    decode: DecodeTiming,
}

#[derive(Default)]
struct DecodeTiming {
    steps: std::sync::atomic::AtomicU64,
    stage_ns: Vec<std::sync::atomic::AtomicU64>,
}

impl DecodeTiming {
    fn new(stages: usize) -> Self {
        DecodeTiming { steps: Default::default(), stage_ns: (0..stages).map(|_| Default::default()).collect() }
    }

    fn add(&self, stage: usize, t: Duration) {
        if let Some(a) = self.stage_ns.get(stage) {
            a.fetch_add(u64::try_from(t.as_nanos()).unwrap_or(u64::MAX), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// Decode steps so far and each stage's compute seconds in them (see [`Pipeline::decode_timing`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeTimes {
    pub steps: u64,
    pub stage_s: Vec<f64>,
}

/// One conversation's state across all stages.
pub struct Session {
    caches: Vec<SliceCache>,
    tokens: Vec<u32>,
}

impl Session {
    /// Every token fed so far (prompt and generated), in order: what every stage's cache holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// Tokens each stage's cache holds, in stage order (all equal to [`Session::len`]).
    pub fn cache_lens(&self) -> Vec<usize> {
        self.caches.iter().map(SliceCache::len).collect()
    }
    /// The longest prefix of at most `n` tokens the session can go back to (see
    /// [`SliceCache::keepable`]: a sliding-window cache may have let go of what `n` needs).
    pub fn keepable(&self, n: usize) -> usize {
        self.caches.iter().map(|c| c.keepable(n)).fold(n.min(self.tokens.len()), usize::min)
    }
    /// Forgets every token after the first [`Session::keepable`]`(n)`, keeping the caches'
    /// storage; returns how many tokens are kept.
    pub fn truncate(&mut self, n: usize) -> usize {
        let n = self.keepable(n);
        for c in &mut self.caches {
            c.truncate(n);
        }
        self.tokens.truncate(n);
        n
    }
    /// Forgets every token, keeping the caches' storage for the next conversation.
    pub fn reset(&mut self) {
        for c in &mut self.caches {
            c.truncate(0);
        }
        self.tokens.clear();
    }
}

/// Runs a pass of several sessions: on success session `i` has taken `fed[i]`; on error every
/// session's caches go back to its tokens (as [`Pipeline::forward`]), whichever stage failed.
fn all_or_none(
    sessions: &mut [&mut Session],
    fed: &[&[u32]],
    pass: impl FnOnce(&mut [&mut Session]) -> Result<Vec<Vec<f32>>, ModelError>,
) -> Result<Vec<Vec<f32>>, ModelError> {
    match pass(sessions) {
        Ok(logits) => {
            for (s, f) in sessions.iter_mut().zip(fed) {
                s.tokens.extend_from_slice(f);
            }
            Ok(logits)
        }
        Err(e) => {
            for s in sessions.iter_mut() {
                let before = s.tokens.len();
                s.truncate(before);
            }
            Err(e)
        }
    }
}

impl Pipeline {
    /// Loads each stage's slice onto its device, in the device's activation type
    /// ([`activation_dtype`]); `progress` is told after each stage.
    pub fn load(
        files: &ModelFiles,
        stages: &[Stage],
        n_ctx: usize,
        progress: impl FnMut(usize, &Stage),
    ) -> Result<Self, ModelError> {
        Self::load_cpu_moe(files, stages, n_ctx, 0, progress)
    }

    /// [`Pipeline::load`] with split layers (llama.cpp's `--n-cpu-moe N`; `--cpu-moe` is every
    /// layer): the routed experts of layers `[0, cpu_moe)` are held in host RAM and computed on
    /// the CPU, by one [`ExpertShard`] per stage, while the rest of those layers (attention,
    /// norms, router, shared expert) stays on the stage's device. The shard computes an expert
    /// with the kernels a CPU slice would run, so the numbers are those of the experts in place.
    /// A stage on the CPU gets a shard too: the same memory, the same numbers.
    pub fn load_cpu_moe(
        files: &ModelFiles,
        stages: &[Stage],
        n_ctx: usize,
        cpu_moe: usize,
        mut progress: impl FnMut(usize, &Stage),
    ) -> Result<Self, ModelError> {
        check_cover(stages.iter().map(|s| (s.layers.start(), s.layers.end())), files.config().n_layers)?;
        let mut out = Vec::with_capacity(stages.len());
        let mut host_experts = Vec::with_capacity(stages.len());
        for (i, s) in stages.iter().enumerate() {
            let dev = candle_device(s.device)?;
            let (split, host) = ExpertSplit::in_ram(files, s.layers, cpu_moe)?.unzip();
            host_experts.push(host.unwrap_or(0));
            let slice = Slice::load_split(files, s.layers, &dev, activation_dtype(s.device, files), n_ctx, split)?;
            out.push((s.device, slice));
            progress(i, s);
        }
        let decode = DecodeTiming::new(out.len());
        Ok(Pipeline { stages: out, host_experts, n_ctx, decode })
    }

    /// A pipeline of slices loaded by the caller, in order (in any activation type: a GPU's type
    /// on the CPU runs the numbers a GPU computes); its context is the smallest of theirs.
    pub fn from_slices(stages: Vec<(DeviceId, Slice)>) -> Result<Self, ModelError> {
        let n_layers = stages.first().map_or(0, |(_, s)| s.config().n_layers);
        check_cover(stages.iter().map(|(_, s)| (s.layers().start(), s.layers().end())), n_layers)?;
        let n_ctx = stages.iter().map(|(_, s)| s.n_ctx()).min().unwrap_or(0);
        let decode = DecodeTiming::new(stages.len());
        Ok(Pipeline { host_experts: vec![0; stages.len()], stages, n_ctx, decode })
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Turns the fused CPU decode step on or off on every stage (see [`Slice::set_fused_decode`]:
    /// the same numbers either way; for measuring it); returns how many stages run it.
    pub fn set_fused_decode(&mut self, on: bool) -> usize {
        self.stages.iter_mut().filter_map(|(_, s)| s.set_fused_decode(on).then_some(())).count()
    }

    /// Decode steps so far (a one-token `forward` or a `forward_rows` of any number of sessions)
    /// and the seconds each stage computed in them.
    pub fn decode_timing(&self) -> DecodeTimes {
        use std::sync::atomic::Ordering::Relaxed;
        DecodeTimes {
            steps: self.decode.steps.load(Relaxed),
            stage_s: self.decode.stage_ns.iter().map(|a| a.load(Relaxed) as f64 / 1e9).collect(),
        }
    }

    pub fn stages(&self) -> impl Iterator<Item = (DeviceId, &Slice)> {
        self.stages.iter().map(|(d, s)| (*d, s))
    }

    pub fn report(&self) -> Vec<StageReport> {
        self.stages
            .iter()
            .zip(&self.host_experts)
            .map(|((d, s), &host)| StageReport {
                device: *d,
                layers: (s.layers().start(), s.layers().end()),
                weight_bytes: s.weight_bytes(),
                kv_bytes: s.kv_bytes(),
                host_expert_bytes: host,
            })
            .collect()
    }

    pub fn new_session(&self) -> Result<Session, ModelError> {
        let caches = self.stages.iter().map(|(_, s)| s.new_cache()).collect::<Result<_, _>>()?;
        Ok(Session { caches, tokens: Vec::new() })
    }

    /// Feeds `tokens` through every stage and returns the logits of the last position (or of all
    /// positions), `(positions, vocab)` in f32 on the CPU. On an error, every stage's cache is
    /// truncated back to where it was (or to nothing, see [`Session::keepable`]), so the
    /// session stays usable and its tokens stay true.
    pub fn forward(&self, session: &mut Session, tokens: &[u32], which: Logits) -> Result<Tensor, ModelError> {
        let before = session.tokens.len();
        match self.forward_stages(session, tokens, which) {
            Ok(logits) => {
                session.tokens.extend_from_slice(tokens);
                Ok(logits)
            }
            Err(e) => {
                // (a pass that failed after others of the same chunk may leave less to keep)
                session.truncate(before);
                Err(e)
            }
        }
    }

    fn forward_stages(&self, session: &mut Session, tokens: &[u32], which: Logits) -> Result<Tensor, ModelError> {
        let mut hidden: Option<Tensor> = None;
        let decoding = tokens.len() == 1;
        for (i, ((_, slice), cache)) in self.stages.iter().zip(session.caches.iter_mut()).enumerate() {
            let input = match &hidden {
                None => StageInput::Tokens(tokens),
                Some(h) => StageInput::Hidden(h),
            };
            let t = Instant::now();
            hidden = Some(slice.forward(cache, input, which)?);
            if decoding {
                self.decode.add(i, t.elapsed());
            }
        }
        if decoding {
            self.decode.steps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let logits = hidden.ok_or_else(|| ModelError::BadSlice("empty pipeline".into()))?;
        Ok(logits.squeeze(0)?.to_device(&Device::Cpu)?)
    }

    /// One decode step of several sessions at once: `tokens[i]` is fed to `sessions[i]`. Returns
    /// each session's logits, equal bit for bit to what [`Pipeline::forward`] gives for that
    /// session alone (on the CPU; see [`Slice::forward_rows`]). On error no session changes.
    pub fn forward_rows(&self, sessions: &mut [&mut Session], tokens: &[u32]) -> Result<Vec<Vec<f32>>, ModelError> {
        if sessions.len() != tokens.len() {
            return Err(ModelError::BadInput(format!("{} tokens for {} sessions", tokens.len(), sessions.len())));
        }
        let runs: Vec<&[u32]> = tokens.iter().map(std::slice::from_ref).collect();
        self.forward_runs(sessions, &runs)
    }

    /// A decode step where session `i` takes the tokens `runs[i]` (one or more), each as a decode
    /// row of its own ([`Slice::forward_runs`]): returns every row's logits, sessions in order
    /// and a session's rows in position order, each equal bit for bit to what feeding that
    /// session its run one token at a time with [`Pipeline::forward`] gives (on the CPU). The
    /// verifying pass of speculative decoding: a draft of `k` tokens costs one pass, not `k`.
    /// On error no session changes.
    pub fn forward_runs(&self, sessions: &mut [&mut Session], runs: &[&[u32]]) -> Result<Vec<Vec<f32>>, ModelError> {
        if sessions.len() != runs.len() {
            return Err(ModelError::BadInput(format!("{} runs of tokens for {} sessions", runs.len(), sessions.len())));
        }
        all_or_none(sessions, runs, |s| self.forward_runs_stages(s, runs))
    }

    fn forward_runs_stages(&self, sessions: &mut [&mut Session], runs: &[&[u32]]) -> Result<Vec<Vec<f32>>, ModelError> {
        let lens: Vec<usize> = runs.iter().map(|r| r.len()).collect();
        let ids = runs.concat();
        let mut hidden: Option<Tensor> = None;
        for (i, (_, slice)) in self.stages.iter().enumerate() {
            let mut caches: Vec<&mut SliceCache> = sessions.iter_mut().map(|s| &mut s.caches[i]).collect();
            let input = match &hidden {
                None => StageInput::Tokens(&ids),
                Some(h) => StageInput::Hidden(h),
            };
            let t = Instant::now();
            hidden = Some(slice.forward_runs(&mut caches, input, &lens)?);
            self.decode.add(i, t.elapsed());
        }
        self.decode.steps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let logits = hidden.ok_or_else(|| ModelError::BadSlice("empty pipeline".into()))?;
        Ok(logits.squeeze(1)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?)
    }

    /// Token ids the model takes (the first slice's embedding rows).
    pub fn vocab(&self) -> usize {
        self.stages.first().map_or(0, |(_, s)| s.config().vocab)
    }

    /// Whether every stage reads several sessions' prompt chunks in one pass with each session's
    /// numbers its own ([`Slice::reads_prompts_together`]).
    pub fn reads_prompts_together(&self) -> bool {
        self.stages.iter().all(|(_, s)| s.reads_prompts_together())
    }

    /// Prompt chunks of several sessions in one pass per stage: `chunks[i]` fed to
    /// `sessions[i]`. Returns each session's logits at its chunk's last position, equal bit for
    /// bit to what [`Pipeline::forward`] gives that session alone. Only where
    /// [`Pipeline::reads_prompts_together`]. On error no session changes.
    pub fn forward_ragged(
        &self,
        sessions: &mut [&mut Session],
        chunks: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if sessions.len() != chunks.len() {
            return Err(ModelError::BadInput(format!("{} chunks for {} sessions", chunks.len(), sessions.len())));
        }
        all_or_none(sessions, chunks, |s| self.forward_ragged_stages(s, chunks))
    }

    fn forward_ragged_stages(
        &self,
        sessions: &mut [&mut Session],
        chunks: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        let ids: Vec<u32> = chunks.concat();
        let mut hidden: Option<Tensor> = None;
        for (i, (_, slice)) in self.stages.iter().enumerate() {
            let mut caches: Vec<&mut SliceCache> = sessions.iter_mut().map(|s| &mut s.caches[i]).collect();
            let input = match &hidden {
                None => StageInput::Tokens(&ids),
                Some(h) => StageInput::Hidden(h),
            };
            hidden = Some(slice.forward_ragged(&mut caches, input, &lens)?);
        }
        let logits = hidden.ok_or_else(|| ModelError::BadSlice("empty pipeline".into()))?;
        Ok(logits.squeeze(1)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?)
    }

    /// Feeds a prompt in chunks of at most `n_batch` tokens; returns the last position's logits.
    pub fn prefill(&self, session: &mut Session, tokens: &[u32], n_batch: usize) -> Result<Vec<f32>, ModelError> {
        let mut last = None;
        for chunk in tokens.chunks(n_batch.max(1)) {
            last = Some(self.forward(session, chunk, Logits::Last)?);
        }
        let l = last.ok_or_else(|| {
            ModelError::BadInput("empty prompt: nothing to start from (the model adds no BOS)".into())
        })?;
        let n = l.dim(0)?;
        Ok(l.get(n - 1)?.to_vec1::<f32>()?)
    }

    /// Prefills `prompt`, then samples up to `n_predict` tokens (`usize::MAX`: until an
    /// end-of-generation token or a full context), calling `on_token` with each (return `false`
    /// from it to stop). Stops early at an end-of-generation token unless `ignore_eos`. The last
    /// token given to `on_token` is not fed (nothing needs its logits): the session's caches end
    /// before it, and [`GenerationStats::unfed`] holds it.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &self,
        session: &mut Session,
        prompt: &[u32],
        n_predict: usize,
        sampler: &mut Sampler,
        is_eog: impl Fn(u32) -> bool,
        ignore_eos: bool,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<GenerationStats, ModelError> {
        self.generate_with(session, prompt, n_predict, sampler, is_eog, ignore_eos, None, on_token)
    }

    /// [`Pipeline::generate`], drafting with `drafter` where one is given (speculative
    /// decoding, [`crate::speculative`]): the same tokens, in fewer passes where drafts are
    /// taken.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_with(
        &self,
        session: &mut Session,
        prompt: &[u32],
        n_predict: usize,
        sampler: &mut Sampler,
        is_eog: impl Fn(u32) -> bool,
        ignore_eos: bool,
        mut drafter: Option<&mut Drafter>,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<GenerationStats, ModelError> {
        let t0 = Instant::now();
        // the rows to draw from: row j follows the session's tokens but the last `len - 1 - j`
        let mut rows = vec![self.prefill(session, prompt, PREFILL_CHUNK)?];
        let prompt_time = t0.elapsed();
        let t1 = Instant::now();
        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            prompt_time,
            generated: 0,
            decode_steps: 0,
            decoded: 0,
            drafted: 0,
            accepted: 0,
            gen_time: Duration::ZERO,
            stop: StopReason::Length,
            unfed: None,
        };
        let rules = StopRules { max_tokens: n_predict, n_ctx: self.n_ctx, ignore_eos, generated: 0 };
        let mut generation = Generation::new(session.tokens().to_vec(), rules, self.max_run())?;
        let mut stop = (n_predict == 0).then_some(StopReason::Length);
        while stop.is_none() {
            let start = session.len() + 1 - rows.len();
            let run = generation.run().to_vec();
            let used = crate::speculative::walk(&run, &rows, |j, logits| {
                if stats.decode_steps > 0 {
                    stats.decoded += 1;
                }
                let id = sampler.sample(logits, &session.tokens()[..start + j]);
                let verdict = generation.judge(id, is_eog(id), false);
                if verdict == Verdict::Unsent {
                    stop = verdict.stop();
                    return None;
                }
                stats.unfed = Some(id);
                stop = if on_token(id) { verdict.stop() } else { Some(StopReason::Caller) };
                stop.is_none().then_some(id)
            });
            stats.accepted += used - 1;
            generation.ran(drafter.as_deref_mut(), used);
            let keep = start - 1 + used;
            if session.truncate(keep) != keep {
                return Err(ModelError::BadSlice(format!("a session cannot go back to {keep} tokens after a draft")));
            }
            if stop.is_some() {
                break;
            }
            let run = generation.next_run(drafter.as_deref_mut(), usize::MAX)?.to_vec();
            stats.drafted += run.len() - 1;
            stats.unfed = None;
            rows = self.forward_runs(&mut [&mut *session], &[&run])?;
            stats.decode_steps += 1;
        }
        stats.stop = stop.unwrap_or(StopReason::Length);
        stats.generated = generation.generated();
        stats.gen_time = t1.elapsed();
        Ok(stats)
    }

    /// Tokens one session may take in one pass of [`Pipeline::forward_runs`]: a model with
    /// sliding-window layers reads at most one [`crate::config::ModelConfig::pass`] at a time.
    pub fn max_run(&self) -> usize {
        self.stages.iter().filter_map(|(_, s)| s.config().pass()).min().unwrap_or(usize::MAX).max(1)
    }
}

#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated: usize,
    /// Decode passes timed in `gen_time` (the first token comes from the prefill): one token
    /// each, or with speculative decoding a token and its draft.
    pub decode_steps: usize,
    /// Tokens drawn from the decode passes' rows (the first token comes from the prefill).
    pub decoded: usize,
    /// Drafted tokens fed, and of them those the model's own draws confirmed (speculative
    /// decoding; 0 without).
    pub drafted: usize,
    pub accepted: usize,
    pub gen_time: Duration,
    pub stop: StopReason,
    /// The last token given to `on_token`, which was not fed: the session's caches end before it
    /// (feed it first to continue the conversation). `None` when generation stopped at an
    /// end-of-generation token or generated nothing.
    pub unfed: Option<u32>,
}

impl GenerationStats {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }
    /// Tokens per second of the decode phase: tokens drawn from its passes' rows.
    pub fn gen_tps(&self) -> f64 {
        if self.decode_steps == 0 {
            return 0.0;
        }
        self.decoded as f64 / self.gen_time.as_secs_f64().max(1e-9)
    }
}

/// Checks that stage ranges `[a, b)` cover `[0, n_layers)` in order, each starting where the
/// previous one ended.
fn check_cover(ranges: impl Iterator<Item = (usize, usize)>, n_layers: usize) -> Result<(), ModelError> {
    let mut next = 0;
    let mut any = false;
    for (a, b) in ranges {
        if a != next {
            return Err(ModelError::BadSlice(format!(
                "stage [{a}, {b}) does not start where the previous one ended ({next})"
            )));
        }
        next = b;
        any = true;
    }
    if next != n_layers || !any {
        return Err(ModelError::BadSlice(format!("stages cover {next} of {n_layers} layers")));
    }
    Ok(())
}
