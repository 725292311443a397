//! Driving one session from this node: the ring S1 → … → Sn → driver → S1.
//!
//! The driver tokenizes the request, opens the session on every stage, feeds the prompt to the
//! first stage in chunks (so stages overlap on a long prompt), and then, for each sampled id the
//! last stage sends back, decides — with the [`Generation`] every engine's sessions go by, so
//! greedy output equals `brigade run`'s — whether to stop or to feed the id to the first stage. Events go to the caller (the coordinator relays them to
//! the client) through a channel: the caller is never on the token loop's path. The decisions are [`SessionCore`]'s, without IO (frames in,
//! tokens and frames out); [`drive`] moves its frames and events.

use crate::router::{Peer, Router};
use crate::stage::{now_us, FLAG_DONE, FLAG_DRAFT, FLAG_EOG, FLAG_LAST};
use crate::WorkerError;
use brigade_core::cluster::CarrierKind;
use brigade_core::stop::{StopReason as CoreStop, StopRules, Verdict};
use brigade_model::generation::Generation;
use brigade_model::speculative::{Drafter, Speculation};
use brigade_model::Tokenizer;
use brigade_proto::convert::stop_to_proto;
use brigade_proto::v1::{
    generate_event, Done, DriveRequest, FrameKind, GenerateEvent, HopTiming, PromptIds, SessionSpec, StopReason,
    Timings, Token, TokenScores, TopLogprob,
};
use brigade_transport::frame::Frame;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Semaphore};
use tonic::Status;

/// How long a session waits for its next frame before it fails (a dead stage, a lost link).
pub const STALL: Duration = Duration::from_secs(120);
/// How long a request waits for a free session slot.
pub const QUEUE_WAIT: Duration = Duration::from_secs(120);

/// What the driver knows of a deployment it drives.
#[derive(Clone)]
pub struct DriveTarget {
    pub deployment: String,
    pub generation: u64,
    pub n_stages: u32,
    pub n_ctx: usize,
    pub vocab: usize,
    pub carrier: CarrierKind,
    pub first: Peer,
    /// The nodes of the deployment's stages: only their frames reach this driver's sessions.
    pub stage_nodes: Arc<Vec<String>>,
    pub tokenizer: Arc<Tokenizer>,
    /// The tokenizer's vocabulary for the grammar engine (a request's format is compiled here
    /// first, so a bad one is the caller's error before any stage sees it).
    pub vocabulary: crate::stage::VocabularyCell,
    pub permits: Arc<Semaphore>,
    /// Prompt tokens per chunk into the first stage.
    pub ubatch: usize,
    /// Bytes of one token's hidden state between stages (hidden size × activation type).
    pub hidden_bytes: u64,
    /// Turns true when this generation of the deployment stops being served here (re-placed
    /// or removed): its sessions end at once, and the coordinator resumes them elsewhere.
    pub cancel: tokio::sync::watch::Receiver<bool>,
    /// Speculative decoding by prompt lookup (the worker's `--spec-type ngram-simple`): each
    /// decode step sends the drawn id and a draft through the stages once (`FLAG_DRAFT`), and
    /// the last stage answers with every id its draws took — one trip round the ring per
    /// accepted run instead of per token, the text unchanged.
    pub drafting: Option<Arc<Speculation>>,
    /// Tokens one decode run may hold: the model's sliding-window pass, [`crate::stage::MAX_RUN`].
    pub max_run: usize,
}

type Events = mpsc::Sender<Result<GenerateEvent, Status>>;

fn ev(e: generate_event::Event) -> Result<GenerateEvent, Status> {
    Ok(GenerateEvent { event: Some(e) })
}

/// The prompt's ids as the request gives them: ids, a chat, or text.
pub fn prompt_ids(t: &DriveTarget, req: &DriveRequest) -> Result<Vec<u32>, WorkerError> {
    let tk = &t.tokenizer;
    let ids = if req.use_prompt_ids {
        if let Some(&bad) = req.prompt_ids.iter().find(|&&i| i as usize >= t.vocab) {
            return Err(WorkerError::BadRequest(format!("token id {bad} is outside the vocabulary of {}", t.vocab)));
        }
        req.prompt_ids.clone()
    } else if !req.chat.is_empty() {
        let msgs: Vec<(String, String)> = req.chat.iter().map(|m| (m.role.clone(), m.content.clone())).collect();
        let rendered = tk.apply_chat_template(&msgs)?;
        tk.encode_chat(&rendered)?
    } else {
        tk.encode(&req.prompt, true)?
    };
    if ids.is_empty() {
        return Err(WorkerError::BadRequest("the prompt is empty and this model adds no BOS token".into()));
    }
    Ok(ids)
}

/// A request's format (brigade-grammar's `Format` as JSON) read and compiled against the model's
/// vocabulary, off the async threads: what cannot be used is the caller's error.
async fn check_format(t: &DriveTarget, format: &str) -> Result<(), WorkerError> {
    let format: brigade_grammar::Format =
        serde_json::from_str(format).map_err(|e| WorkerError::BadRequest(format!("the format: {e}")))?;
    let (cell, tk) = (t.vocabulary.clone(), t.tokenizer.clone());
    tokio::task::spawn_blocking(move || {
        let vocab = crate::stage::vocabulary_of(&cell, &tk).map_err(|e| WorkerError::BadRequest(e.to_string()))?;
        vocab.compile(&format).map(drop).map_err(|e| WorkerError::BadRequest(format!("the format cannot be used: {e}")))
    })
    .await
    .map_err(|e| WorkerError::Failed(format!("format task: {e}")))?
}

/// A token's scores as the last stage sent them, checked: as many ids as log-probabilities, at
/// most [`brigade_core::MAX_TOP_LOGPROBS`], every id in the vocabulary.
fn scores(s: &TokenScores, vocab: usize) -> Result<(Option<f32>, Vec<TopLogprob>), WorkerError> {
    if s.top_ids.len() != s.top_logprobs.len() || s.top_ids.len() > brigade_core::MAX_TOP_LOGPROBS {
        return Err(WorkerError::Failed(format!(
            "the last stage sent {} ids and {} log-probabilities (at most {})",
            s.top_ids.len(),
            s.top_logprobs.len(),
            brigade_core::MAX_TOP_LOGPROBS
        )));
    }
    if let Some(&bad) = s.top_ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(WorkerError::Failed(format!("the last stage scored id {bad}, outside the vocabulary of {vocab}")));
    }
    let top = s.top_ids.iter().zip(&s.top_logprobs).map(|(&id, &logprob)| TopLogprob { id, logprob }).collect();
    Ok((Some(s.logprob), top))
}

/// `frame` addressed to `session` of the target's generation, at the first stage.
fn addressed(t: &DriveTarget, frame: Frame, session: u64) -> Frame {
    frame.in_session(&t.deployment, t.generation, session)
}

fn tokens_frame(t: &DriveTarget, session: u64, step: u64, first_position: u64, ids: &[u32], last: bool) -> Frame {
    let frame = Frame::tokens(step, first_position, ids).with_flags(if last { FLAG_LAST } else { 0 });
    addressed(t, frame, session)
}

/// Per-stage sums over the decode steps of a session.
#[derive(Default)]
struct HopSums {
    steps: u64,
    compute_us: Vec<u64>,
    transfer_us: Vec<u64>,
}

impl HopSums {
    fn add(&mut self, trace: &[brigade_proto::v1::StageTrace], sent_us: u64, received_us: u64) {
        let n = trace.len();
        if n == 0 {
            return;
        }
        if self.compute_us.len() < n {
            self.compute_us.resize(n, 0);
            self.transfer_us.resize(n, 0);
        }
        self.steps += 1;
        for (i, s) in trace.iter().enumerate() {
            self.compute_us[i] += s.compute_us;
            let arrive = if i + 1 < n { trace[i + 1].received_us } else { received_us };
            let mut transfer = arrive.saturating_sub(s.sent_us);
            if i + 1 == n {
                // the ring closes through the driver: its send to the first stage counts here
                transfer += trace[0].received_us.saturating_sub(sent_us);
            }
            self.transfer_us[i] += transfer;
        }
    }

    /// Per stage: compute and hop seconds per step, and the bytes its hop puts on a link per
    /// token — the hidden state to the next stage, the sampled id from the last to the driver
    /// (`driver`'s node), none where both ends are one node (the hop is in process).
    fn timings(&self, hidden_bytes: u64, stage_nodes: &[String], driver: &str) -> Vec<HopTiming> {
        let n = self.steps.max(1) as f64;
        let stages = self.compute_us.len();
        (0..stages)
            .map(|i| {
                let (to, bytes) = if i + 1 < stages {
                    (stage_nodes.get(i + 1).map(String::as_str), hidden_bytes)
                } else {
                    (Some(driver), 4)
                };
                let here = to.is_some_and(|to| stage_nodes.get(i).is_some_and(|from| from == to));
                HopTiming {
                    stage: i as u32,
                    compute_s: self.compute_us[i] as f64 / n / 1e6,
                    transfer_s: self.transfer_us[i] as f64 / n / 1e6,
                    bytes_per_token: if here { 0 } else { bytes },
                    ..Default::default()
                }
            })
            .collect()
    }
}

/// Runs one session to its end, streaming events to `out`.
pub async fn drive(router: Arc<Router>, t: DriveTarget, req: DriveRequest, hidden_bytes: u64, out: Events) {
    let started = Instant::now();
    let prompt = match prompt_ids(&t, &req) {
        Ok(p) => p,
        Err(e) => {
            let _ = out.send(Err(e.into())).await;
            return;
        }
    };
    if let Some(n) = req.logprobs.filter(|&n| n as usize > brigade_core::MAX_TOP_LOGPROBS) {
        let _ = out
            .send(Err(WorkerError::BadRequest(format!(
                "logprobs: at most {} alternatives per token, asked for {n}",
                brigade_core::MAX_TOP_LOGPROBS
            ))
            .into()))
            .await;
        return;
    }
    if !req.format.is_empty() {
        if let Err(e) = check_format(&t, &req.format).await {
            let _ = out.send(Err(e.into())).await;
            return;
        }
    }
    let mut feed = prompt.clone();
    feed.extend_from_slice(&req.resume_ids);
    if feed.len() >= t.n_ctx {
        let _ = out
            .send(Err(WorkerError::BadRequest(format!(
                "the prompt is {} tokens, the context of {} holds at most {} with room to generate",
                feed.len(),
                t.deployment,
                t.n_ctx.saturating_sub(1)
            ))
            .into()))
            .await;
        return;
    }
    let permit = match tokio::time::timeout(QUEUE_WAIT, t.permits.clone().acquire_owned()).await {
        Ok(Ok(p)) => p,
        _ => {
            let _ = out
                .send(Err(WorkerError::Busy(format!(
                    "every session of {} stayed busy for {}s",
                    t.deployment,
                    QUEUE_WAIT.as_secs()
                ))
                .into()))
                .await;
            return;
        }
    };
    let session: u64 = rand::random();
    let mut rx = router.register_driver(session, t.stage_nodes.clone());
    let result = run_session(&router, &t, &req, session, &prompt, &feed, &mut rx, started, hidden_bytes, &out).await;
    // every stage frees the session's cache, whatever happened
    let close = addressed(&t, Frame::close(), session);
    let _ = router.send(&t.first, t.carrier, close).await;
    router.unregister_driver(session);
    drop(permit);
    if let Err(e) = result {
        let _ = out.send(Err(e)).await;
    }
}

/// One session's driving without IO: what to send the first stage to open it and read its
/// prompt, and, for each frame the last stage sends back, the tokens to stream and either the
/// next run to send or why the generation stops — by a [`Generation`], as the one box's engines
/// decide, and the request's stop strings. The async loop below ([`drive`]) moves its frames and
/// events; a test drives it by hand against stage cores.
pub struct SessionCore<'a> {
    t: &'a DriveTarget,
    req: &'a DriveRequest,
    session: u64,
    prompt_len: usize,
    feed_len: usize,
    /// The answer's text (stop strings).
    text: brigade_model::tokenizer::AnswerText<'a>,
    /// The generation's decisions: the ids the rules take, the run sent last (the prompt's last
    /// token counts as a run of one) and the next.
    generation: Generation,
    drafter: Option<Drafter>,
    decoded: u64,
    first_token_at: Option<Instant>,
    last_token_at: Instant,
    hops: HopSums,
    sent_us: u64,
    /// The step and position of the answer awaited: the last stage echoes the step of the run
    /// it answers and names the position of its first id.
    awaiting: (u64, u64),
}

/// What the driver does after a frame from the last stage.
#[derive(Debug)]
pub enum Then {
    /// Send this run to the first stage.
    Send(Box<Frame>),
    /// The generation ends.
    Stop(StopReason),
}

/// How a session opens.
pub enum Opened<'a> {
    /// The frames for the first stage: OPEN, then the prompt's chunks.
    Run(Box<SessionCore<'a>>, Vec<Frame>),
    /// Nothing to generate: the ids the client has after a failover completed a stop string.
    Done(Done),
}

impl<'a> SessionCore<'a> {
    /// Opens `session` for `req`: `prompt` its ids, `feed` them and the ids resumed after a
    /// failover.
    pub fn open(
        t: &'a DriveTarget,
        req: &'a DriveRequest,
        session: u64,
        prompt: &[u32],
        feed: &[u32],
    ) -> Result<Opened<'a>, WorkerError> {
        // after a failover the text's state is rebuilt from the ids the client already has
        // (their text is not sent again), so a stop string that began before is still found
        let mut text = t.tokenizer.answer(prompt.last().copied(), req.stop.clone());
        text.replay(&req.resume_ids);
        if text.stopped() {
            let timings = Timings { prompt_tokens: prompt.len() as u32, ..Default::default() };
            return Ok(Opened::Done(Done {
                stop: StopReason::Stop as i32,
                timings: Some(timings),
                text_tail: String::new(),
            }));
        }
        let spec = SessionSpec {
            sampling: req.sampling,
            prompt_ids: feed.to_vec(),
            max_tokens: req.max_tokens,
            format: req.format.clone(),
            logprobs: req.logprobs,
            resumed: req.resume_ids.len() as u32,
        };
        let mut frames = vec![addressed(t, Frame::open(&spec), session)];
        let chunks: Vec<&[u32]> = feed.chunks(t.ubatch.max(1)).collect();
        let mut pos = 0u64;
        for (i, c) in chunks.iter().enumerate() {
            frames.push(tokens_frame(t, session, 0, pos, c, i + 1 == chunks.len()));
            pos += c.len() as u64;
        }
        // (logprobs score one id per answer: a session that asks for them does not draft)
        let drafter = match (&t.drafting, req.logprobs) {
            (Some(s), None) => Some(Drafter::new(s.clone(), t.vocab).map_err(|e| WorkerError::Failed(e.to_string()))?),
            _ => None,
        };
        let rules = StopRules {
            max_tokens: if req.max_tokens > 0 { req.max_tokens as usize } else { usize::MAX },
            n_ctx: t.n_ctx,
            ignore_eos: req.ignore_eos,
            generated: req.resume_ids.len(),
        };
        let generation = Generation::new(feed.to_vec(), rules, t.max_run)?;
        let core = SessionCore {
            t,
            req,
            session,
            prompt_len: prompt.len(),
            feed_len: feed.len(),
            text,
            generation,
            drafter,
            decoded: 0,
            first_token_at: None,
            last_token_at: Instant::now(),
            hops: HopSums::default(),
            sent_us: now_us(),
            awaiting: (0, feed.len() as u64),
        };
        Ok(Opened::Run(Box::new(core), frames))
    }

    /// A frame from the last stage (`received_us` when it arrived): the tokens to stream and
    /// what next; `None` for a frame that says nothing (not TOKENS). An ERROR, or ids the run
    /// did not ask for, is the session's failure.
    pub fn on_frame(&mut self, frame: Frame, received_us: u64) -> Result<Option<(Vec<Token>, Then)>, WorkerError> {
        let kind = FrameKind::try_from(frame.header.kind).unwrap_or(FrameKind::Unspecified);
        if kind == FrameKind::Error {
            return Err(WorkerError::Failed(frame.header.text.clone()));
        }
        if kind != FrameKind::Tokens {
            return Ok(None);
        }
        let (t, req) = (self.t, self.req);
        let (step, at) = (frame.header.step, frame.header.first_position);
        if step < self.awaiting.0 {
            // an answer to a run answered before (a link delivered it twice): taking it as the
            // next run's answer would put its ids in the text twice
            return Ok(None);
        }
        if (step, at) != self.awaiting {
            return Err(WorkerError::Failed(format!(
                "the last stage answered step {step} at position {at}; the session waits for step {} at {}",
                self.awaiting.0, self.awaiting.1
            )));
        }
        let ids = frame.token_ids().map_err(|e| WorkerError::Failed(e.to_string()))?;
        // one id per row of the run at most: the draws that took the draft, then one more
        let run = self.generation.run();
        if ids.is_empty() || ids.len() > run.len() || ids[..ids.len() - 1] != run[1..ids.len()] {
            return Err(WorkerError::Failed(format!(
                "the last stage sent {} ids for a run of {}, or ids the draft did not hold",
                ids.len(),
                run.len()
            )));
        }
        let now = Instant::now();
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
        } else {
            self.hops.add(&frame.header.trace, self.sent_us, received_us);
            self.decoded += ids.len() as u64;
        }
        self.last_token_at = now;
        self.generation.ran(self.drafter.as_mut(), ids.len());
        let mut tokens = Vec::with_capacity(ids.len());
        let mut stop = None;
        for (k, &id) in ids.iter().enumerate() {
            let last = k + 1 == ids.len();
            let eog = (last && frame.header.flags & FLAG_EOG != 0) || t.tokenizer.is_eog(id);
            let done = last && frame.header.flags & FLAG_DONE != 0;
            let index = self.generation.generated() as u32;
            let verdict = self.generation.judge(id, eog, done);
            if verdict == Verdict::Unsent {
                stop = verdict.stop();
                break;
            }
            let (logprob, top_logprobs) = match (&frame.header.scores, req.logprobs) {
                (Some(s), Some(_)) => scores(s, t.vocab)?,
                (None, Some(_)) => return Err(WorkerError::Failed("the last stage sent no scores for a token".into())),
                _ => (None, Vec::new()),
            };
            tokens.push(Token { id, text: self.text.push(id), index, logprob, top_logprobs });
            // (a stop string ends the answer before anything the rules say)
            stop = if self.text.stopped() { Some(CoreStop::Stop) } else { verdict.stop() };
            if stop.is_some() {
                break;
            }
        }
        if let Some(stop) = stop {
            return Ok(Some((tokens, Then::Stop(stop_to_proto(stop)))));
        }
        // the next run: the id drawn last, then a draft where one is worth its rows
        let fed = self.generation.context().len() - 1;
        let run = self
            .generation
            .next_run(self.drafter.as_mut(), usize::MAX)
            .map_err(|e| WorkerError::Failed(e.to_string()))?
            .to_vec();
        self.sent_us = now_us();
        let step = self.generation.generated() as u64;
        self.awaiting = (step, fed as u64 + 1);
        let mut f = tokens_frame(t, self.session, step, fed as u64, &run, true);
        if run.len() > 1 {
            f.header.flags |= FLAG_DRAFT;
            f.header.draft = run;
        }
        Ok(Some((tokens, Then::Send(Box::new(f)))))
    }

    /// The final event: why the generation stopped and its figures (`started` when the request
    /// came; `me` this node, the driver).
    pub fn done(mut self, stop: StopReason, started: Instant, hidden_bytes: u64, me: &str) -> Done {
        let first = self.first_token_at.unwrap_or(self.last_token_at);
        let prompt_s = first.duration_since(started).as_secs_f64();
        let generate_s = self.last_token_at.duration_since(first).as_secs_f64();
        let decode_steps = self.hops.steps;
        let timings = Timings {
            prompt_tokens: self.prompt_len as u32,
            // (this attempt's: the rules count the ids resumed too)
            generated_tokens: (self.generation.generated() - self.req.resume_ids.len()) as u32,
            prompt_s,
            generate_s,
            prompt_tokens_per_s: self.feed_len as f64 / prompt_s.max(1e-9),
            generate_tokens_per_s: if decode_steps > 0 { self.decoded as f64 / generate_s.max(1e-9) } else { 0.0 },
            ttft_s: prompt_s,
            hops: self.hops.timings(hidden_bytes, &self.t.stage_nodes, me),
            decode_passes: decode_steps as u32,
            drafted_tokens: self.drafter.as_ref().map_or(0, |d| d.drafted as u32),
            accepted_tokens: self.drafter.as_ref().map_or(0, |d| d.accepted as u32),
        };
        let text_tail = self.text.finish();
        let stop = if self.text.stopped() && stop != StopReason::Cancelled { StopReason::Stop } else { stop };
        Done { stop: stop as i32, timings: Some(timings), text_tail }
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_session(
    router: &Arc<Router>,
    t: &DriveTarget,
    req: &DriveRequest,
    session: u64,
    prompt: &[u32],
    feed: &[u32],
    rx: &mut mpsc::UnboundedReceiver<Frame>,
    started: Instant,
    hidden_bytes: u64,
    out: &Events,
) -> Result<(), Status> {
    let link_err = |e: WorkerError| WorkerError::Unavailable(e.to_string());
    let (mut core, frames) = match SessionCore::open(t, req, session, prompt, feed)? {
        Opened::Run(core, frames) => (core, frames),
        Opened::Done(done) => {
            let _ = out.send(ev(generate_event::Event::Done(done))).await;
            return Ok(());
        }
    };
    for f in frames {
        router.send(&t.first, t.carrier, f).await.map_err(link_err)?;
    }
    if out.send(ev(generate_event::Event::Prompt(PromptIds { ids: prompt.to_vec() }))).await.is_err() {
        return Ok(());
    }
    let mut cancel = t.cancel.clone();
    let stop = 'session: loop {
        let frame = tokio::select! {
            _ = cancel.wait_for(|c| *c) => return Err(WorkerError::Unavailable(format!(
                "{} is being re-placed; the session resumes on the new placement", t.deployment
            )).into()),
            f = tokio::time::timeout(STALL, rx.recv()) => match f {
                Ok(Some(f)) => f,
                Ok(None) => return Err(WorkerError::Failed("the session's channel closed".into()).into()),
                Err(_) => return Err(WorkerError::Stalled(format!(
                    "no answer from the pipeline of {} for {}s (a stage or link is down)", t.deployment, STALL.as_secs()
                )).into()),
            },
            _ = out.closed() => break StopReason::Cancelled,
        };
        let Some((tokens, then)) = core.on_frame(frame, now_us())? else { continue };
        for token in tokens {
            if out.send(ev(generate_event::Event::Token(token))).await.is_err() {
                break 'session StopReason::Cancelled;
            }
        }
        match then {
            Then::Stop(stop) => break stop,
            Then::Send(f) => router.send(&t.first, t.carrier, *f).await.map_err(link_err)?,
        }
    };
    let done = core.done(stop, started, hidden_bytes, router.me());
    let _ = out.send(ev(generate_event::Event::Done(done))).await;
    Ok(())
}
