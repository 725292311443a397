//! One hosted stage: a slice of layers on a device, its sessions' KV caches, and the thread that
//! computes. The stage itself is [`StageCore`], without IO: frames in (`step`), what to send out
//! ([`Out`]); [`StageHandle`] starts the thread that takes frames from the stage's queue, steps
//! the core and sends what it produced through the router.
//!
//! Frames arrive in order on one channel (from the previous stage's link, or from the driver on
//! this node for the first stage). Decode steps of different sessions that are waiting together
//! (up to `DECODE_ROWS`) are computed in one forward pass (`Slice::forward_rows`: the weights
//! are read once for all of them, and on the CPU each row's numbers are those it gets alone);
//! everything else is processed one frame at a time: while this stage computes one
//! session's token the next stage computes another's, so concurrent sessions pipeline, and the
//! chunks of a long prompt overlap across stages (this stage computes chunk k+1 while the next
//! computes chunk k). Per frame:
//! - `OPEN`: a KV cache for the session (from a pool of freed ones); the last stage also makes
//!   the session's [`Draw`] (the one box's batch draws with the same). Forwarded down the chain.
//! - `TOKENS` (first stage) / `HIDDEN`: the slice runs over the rows, appending to the session's
//!   cache; the hidden state goes to the next stage, or — on the last stage, after a prompt's last
//!   chunk or a decode step — the sampled id goes back to the driver, never the logits.
//! - `CLOSE`: the cache returns to the pool; forwarded down the chain.
//!
//! When the next stage is hosted on this node too (two stages of one node: `node1:cuda0:24,
//! node1:cpu:8`), the hidden state is handed to it as the tensor this stage computed
//! ([`Inbound::rows`]): no bytes, no activation type of the wire; the next slice moves it to its
//! own device exactly as the single box's pipeline does (`Slice::forward` with a hidden state
//! from another device), so the hop is a device copy — or nothing, when both are the CPU.
//!
//! A frame this stage cannot process (unknown session, a position that does not follow the cache,
//! a failed forward) ends the session here and sends the driver an `ERROR` naming why.

use crate::router::{Peer, Router};
use crate::WorkerError;
use brigade_core::cluster::{ActDtype, CarrierKind};
use brigade_core::{Constraint, TokenConstraint, MAX_TOP_LOGPROBS};
use brigade_grammar::{Format, Vocabulary};
use brigade_model::pipeline::PREFILL_CHUNK;
use brigade_model::sampler::{draw_run, Draw, Drawn};
use brigade_model::{Logits, Sampler, Slice, SliceCache, StageInput, Tokenizer};
use brigade_proto::convert::sampling_from_proto;
use brigade_proto::v1::{FrameHeader, FrameKind, SessionSpec, StageTrace, TokenScores};
use brigade_transport::frame::Frame;
use prost::Message;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

pub use brigade_transport::frame::{FLAG_DONE, FLAG_DRAFT, FLAG_EOG, FLAG_LAST};
/// How often an idle stage looks whether its handle was dropped.
const STOP_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// Decode steps of different sessions computed in one pass, at most (the CPU kernels' rows).
const MAX_BATCH: usize = brigade_model::cpu_matmul::DECODE_ROWS;

/// Bytes a stage's input may hold waiting (payloads plus [`FRAME_OVERHEAD`] each) before frames
/// are refused: a sender faster than the stage cannot grow the worker's memory without bound.
pub const STAGE_QUEUE_BYTES: u64 = 1 << 30;
/// What a waiting frame costs beyond its payload (the header and the queue's bookkeeping).
const FRAME_OVERHEAD: u64 = 512;

/// What a stage's input carries: a frame as a link (or the driver) delivered it, or — from the
/// stage before, hosted on this node — a HIDDEN frame's header with the rows themselves in
/// `rows` (shape `(1, rows, hidden)`, on the sending stage's device) and no payload.
#[derive(Debug)]
pub struct Inbound {
    pub frame: Frame,
    pub rows: Option<candle_core::Tensor>,
}

impl From<Frame> for Inbound {
    fn from(frame: Frame) -> Self {
        Inbound { frame, rows: None }
    }
}

fn queued_cost(item: &Inbound) -> u64 {
    let rows = item.rows.as_ref().map_or(0, |t| (t.elem_count() * t.dtype().size_in_bytes()) as u64);
    item.frame.payload.len() as u64 + rows + FRAME_OVERHEAD
}

/// A frame a stage's input did not take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InputRefused {
    #[error("the stage's input holds {queued} bytes waiting, {budget} at most")]
    Full { queued: u64, budget: u64 },
    #[error("the stage stopped")]
    Stopped,
}

/// The sending side of a stage's input: a channel bounded by the bytes it holds.
#[derive(Debug, Clone)]
pub struct StageInbox {
    tx: mpsc::Sender<Inbound>,
    queued: Arc<AtomicU64>,
    budget: u64,
}

/// The stage thread's side of its input.
pub struct StageQueue {
    rx: mpsc::Receiver<Inbound>,
    queued: Arc<AtomicU64>,
}

/// A stage input holding at most `budget` bytes waiting.
pub fn stage_queue(budget: u64) -> (StageInbox, StageQueue) {
    let (tx, rx) = mpsc::channel();
    let queued = Arc::new(AtomicU64::new(0));
    (StageInbox { tx, queued: queued.clone(), budget }, StageQueue { rx, queued })
}

impl StageInbox {
    /// Queues `frame` (or rows handed over in process), or refuses it (never waits: the callers
    /// are async link readers).
    pub fn offer(&self, frame: impl Into<Inbound>) -> Result<(), InputRefused> {
        let frame = frame.into();
        let cost = queued_cost(&frame);
        let before = self.queued.fetch_add(cost, Ordering::AcqRel);
        if before + cost > self.budget {
            self.queued.fetch_sub(cost, Ordering::AcqRel);
            return Err(InputRefused::Full { queued: before, budget: self.budget });
        }
        if self.tx.send(frame).is_err() {
            self.queued.fetch_sub(cost, Ordering::AcqRel);
            return Err(InputRefused::Stopped);
        }
        Ok(())
    }
}

impl StageQueue {
    fn took(&self, frame: Inbound) -> Inbound {
        self.queued.fetch_sub(queued_cost(&frame), Ordering::AcqRel);
        frame
    }

    pub fn recv_timeout(&self, timeout: std::time::Duration) -> Result<Inbound, mpsc::RecvTimeoutError> {
        self.rx.recv_timeout(timeout).map(|f| self.took(f))
    }

    pub fn try_recv(&self) -> Result<Inbound, mpsc::TryRecvError> {
        self.rx.try_recv().map(|f| self.took(f))
    }
}

/// Where a stage sits and whom it talks to.
#[derive(Debug, Clone)]
pub struct StagePlace {
    pub deployment: String,
    pub generation: u64,
    pub stage: u32,
    pub n_stages: u32,
    pub next: Option<Peer>,
    pub driver: Peer,
    pub act_dtype: ActDtype,
    pub carrier: CarrierKind,
    pub max_sessions: usize,
    /// A session that receives no frame this long is ended.
    pub session_idle: std::time::Duration,
}

/// What a stage did since it started, for the worker's `/metrics` (atomics: the stage's thread
/// writes, the metrics endpoint reads).
#[derive(Default)]
pub struct StageCounters {
    /// KV caches this stage holds: in use or kept in its pool for the next session (a GPU
    /// stage allocates every session's at load).
    pub caches: AtomicU64,
    /// Frames computed, and the rows (tokens) in them.
    pub frames: AtomicU64,
    pub rows: AtomicU64,
    /// Rows computed in passes of several sessions' decode steps.
    pub batched_rows: AtomicU64,
    /// Prompt rows read in passes of several sessions' prompt chunks.
    pub prompt_rows_together: AtomicU64,
    /// Nanoseconds in forward passes (and sampling, on the last stage).
    pub compute_ns: AtomicU64,
    /// Bytes sent over a link to the next hop (the next stage, or the driver; none when it is
    /// on this node), and nanoseconds spent handing frames over (serialization and the send).
    pub sent_bytes: AtomicU64,
    pub send_ns: AtomicU64,
    /// Hidden states handed to the next stage on this node as tensors (no bytes sent).
    pub handed_over: AtomicU64,
}

fn add_ns(a: &AtomicU64, d: std::time::Duration) {
    a.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
}

struct SessionState {
    /// When the session's last frame arrived.
    touched: Instant,
    cache: SliceCache,
    /// Last stage only: how the session's next id is drawn.
    sampler: Option<Draw>,
    /// Where the session's last decode run (a drawn id and its draft) started: the cache may go
    /// back to any position after it, where the draft was not taken.
    run_from: Option<u64>,
}

impl SessionState {
    /// The last stage's sampling state.
    fn draw(&mut self) -> Result<&mut Draw, WorkerError> {
        self.sampler
            .as_mut()
            .ok_or_else(|| WorkerError::Internal("the last stage has no sampler for the session".into()))
    }
}

/// The last stage's sampling state for a session: its sampler, and its format compiled
/// against the model's vocabulary (which has taken the ids generated before a failover).
fn draw_for(spec: &SessionSpec, tokenizer: &Tokenizer, vocabulary: &VocabularyCell) -> Result<Draw, WorkerError> {
    let cfg = sampling_from_proto(spec.sampling.as_ref())
        .map_err(|e| WorkerError::Frame(format!("OPEN frame: sampling {e}")))?;
    let logprobs = match spec.logprobs {
        Some(n) if n as usize > MAX_TOP_LOGPROBS => {
            return Err(WorkerError::BadRequest(format!(
                "logprobs: at most {MAX_TOP_LOGPROBS} alternatives per token, asked for {n}"
            )))
        }
        n => n.map(|n| n as usize),
    };
    // the ids generated before a failover, at the prompt's end
    let resumed = spec.resumed as usize;
    let Some(start) = spec.prompt_ids.len().checked_sub(resumed) else {
        return Err(WorkerError::Frame(format!(
            "OPEN frame: {resumed} resumed ids of a prompt of {}",
            spec.prompt_ids.len()
        )));
    };
    let grammar = if spec.format.is_empty() {
        None
    } else {
        let format: Format = serde_json::from_str(&spec.format)
            .map_err(|e| WorkerError::BadRequest(format!("the session's format: {e}")))?;
        let vocab = vocabulary_of(vocabulary, tokenizer)?;
        let mut g = vocab
            .compile(&format)
            .map_err(|e| WorkerError::BadRequest(format!("the session's format cannot be used: {e}")))?;
        for &id in &spec.prompt_ids[start..] {
            g.commit(id).map_err(|e| WorkerError::BadRequest(format!("resuming the session's format: {e}")))?;
        }
        Some(g)
    };
    // resumed after a failover: the generator goes on past the draws of the ids resumed
    let sampler = Sampler::resumed(cfg, resumed);
    let constraint = grammar.map(|g| Constraint(Box::new(g)));
    Ok(Draw::new(sampler, spec.prompt_ids.clone(), constraint, logprobs, tokenizer.eos))
}

/// A model's vocabulary for the grammar engine, built once (or the reason it cannot be).
pub(crate) type VocabularyCell = Arc<std::sync::OnceLock<Result<Arc<Vocabulary>, String>>>;

/// The vocabulary in `cell`, built now if no one has (a second caller waits for the first).
pub(crate) fn vocabulary_of(cell: &VocabularyCell, tokenizer: &Tokenizer) -> Result<Arc<Vocabulary>, WorkerError> {
    cell.get_or_init(|| Vocabulary::new(tokenizer).map(Arc::new).map_err(|e| e.to_string()))
        .clone()
        .map_err(WorkerError::BadRequest)
}

/// What a pass of several sessions gives each frame: its output, and its draws (last stage).
type FrameOut = (candle_core::Tensor, Result<Vec<Drawn>, WorkerError>);

/// A pass's input: the frames' ids (first stage) or their joined rows.
fn input_of<'a>(ids: &'a [u32], rows: Option<&'a candle_core::Tensor>) -> StageInput<'a> {
    match rows {
        Some(t) => StageInput::Hidden(t),
        None => StageInput::Tokens(ids),
    }
}

/// Most rows of a decode run (the last drawn id and a draft of at most 64).
pub const MAX_RUN: usize = 65;

/// What a stage's core asks its host to send, in order.
#[derive(Debug)]
pub enum Out {
    /// To the next stage (its header names it): over the link to its node.
    Next(Frame),
    /// To the next stage hosted on this node: the rows themselves, no bytes.
    HandOver(Inbound),
    /// Back to the session's driver: an id drawn, or why the session ended here.
    Driver(Frame),
}

/// A stage without IO: the slice, its sessions' caches and samplers, and every check and
/// decision on the frames that reach it — generation, session and position checks, which frames
/// go through the slice together, what each produces. It takes frames (`step`) and answers with
/// what to send ([`Out`]); the host ([`StageHost`]) owns the thread, the queue and the router,
/// and sends. No socket, no queue, no thread: a test drives a chain of cores by hand.
pub struct StageCore {
    place: StagePlace,
    slice: Slice,
    /// The model's tokenizer: end-of-generation ids, and the vocabulary a format is compiled
    /// against (a last stage builds it on a thread of its own when it starts).
    tokenizer: Arc<Tokenizer>,
    vocabulary: VocabularyCell,
    sessions: HashMap<u64, SessionState>,
    pool: Vec<SliceCache>,
    /// This node's name: a peer of this name is reached in process.
    me: String,
    active: Arc<AtomicU32>,
    counters: Arc<StageCounters>,
    out: Vec<Out>,
}

/// The stage's thread: its core, the queue it takes frames from, the router it sends through.
struct StageHost {
    core: StageCore,
    router: Arc<Router>,
    /// Set when the handle is dropped: the thread ends even while others (the router) still hold
    /// senders of its channel.
    stop: Arc<AtomicBool>,
}

/// The handle the node keeps: the stage's input and how many sessions it holds.
pub struct StageHandle {
    pub place: StagePlace,
    pub input: StageInbox,
    pub active: Arc<AtomicU32>,
    pub weight_bytes: u64,
    pub kv_bytes_per_session: u64,
    pub counters: Arc<StageCounters>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StageHandle {
    /// Bytes of KV cache this stage holds now: every cache it allocated (in use, or pooled for
    /// the next session — memory the process keeps either way).
    pub fn kv_bytes_held(&self) -> u64 {
        self.kv_bytes_per_session * self.counters.caches.load(Ordering::Relaxed)
    }
}

impl StageHandle {
    /// Starts the stage's thread.
    pub fn start(
        place: StagePlace,
        slice: Slice,
        caches: Vec<SliceCache>,
        tokenizer: Arc<Tokenizer>,
        router: Arc<Router>,
    ) -> Result<StageHandle, WorkerError> {
        StageHandle::start_on(place, slice, caches, tokenizer, router, stage_queue(STAGE_QUEUE_BYTES))
    }

    /// [`StageHandle::start`] on a queue made by the caller (which may hold frames already).
    fn start_on(
        place: StagePlace,
        slice: Slice,
        caches: Vec<SliceCache>,
        tokenizer: Arc<Tokenizer>,
        router: Arc<Router>,
        (tx, rx): (StageInbox, StageQueue),
    ) -> Result<StageHandle, WorkerError> {
        let active = Arc::new(AtomicU32::new(0));
        let counters = Arc::new(StageCounters::default());
        counters.caches.store(caches.len() as u64, Ordering::Relaxed);
        let stop = Arc::new(AtomicBool::new(false));
        let weight_bytes = slice.weight_bytes();
        let kv_bytes_per_session = slice.kv_bytes();
        let vocabulary = VocabularyCell::default();
        if place.stage + 1 == place.n_stages {
            // the last stage compiles sessions' formats: their vocabulary is ready before the
            // first, off the stage's thread (a large vocabulary takes a moment)
            let (cell, tk) = (vocabulary.clone(), tokenizer.clone());
            let built = std::thread::Builder::new().name("vocabulary".into()).spawn(move || {
                let _ = vocabulary_of(&cell, &tk);
            });
            if let Err(e) = built {
                tracing::debug!("no thread for the vocabulary ({e}): the first format builds it");
            }
        }
        let core = StageCore::new(
            place.clone(),
            slice,
            caches,
            tokenizer,
            vocabulary.clone(),
            router.me().to_string(),
            (active.clone(), counters.clone()),
        );
        let host = StageHost { core, router, stop: stop.clone() };
        let name = format!("stage-{}-{}", place.deployment, place.stage);
        let thread = std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(move || host.run(rx))
            .map_err(|e| WorkerError::Internal(format!("cannot start the stage thread: {e}")))?;
        Ok(StageHandle {
            place,
            input: tx,
            active,
            weight_bytes,
            kv_bytes_per_session,
            counters,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for StageHandle {
    fn drop(&mut self) {
        // the thread ends after the frame it is on (within STOP_POLL when idle: the router may
        // still hold a sender, so the channel need not close); the slice and caches go with it
        self.stop.store(true, Ordering::Release);
        let (dead, _) = stage_queue(0);
        self.input = dead;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn now_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

impl StageHost {
    fn run(mut self, rx: StageQueue) {
        let place = &self.core.place;
        let _span = tracing::debug_span!("stage", deployment = %place.deployment, stage = place.stage).entered();
        let mut pending: std::collections::VecDeque<(Inbound, u64)> = std::collections::VecDeque::new();
        let mut swept = Instant::now();
        loop {
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            if swept.elapsed() >= STOP_POLL {
                let expired = self.core.expire_idle(Instant::now());
                self.send(expired);
                swept = Instant::now();
            }
            if pending.is_empty() {
                match rx.recv_timeout(STOP_POLL) {
                    Ok(f) => pending.push_back((f, now_us())),
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            // whatever else has arrived meanwhile: decode steps of other sessions go together
            while pending.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(f) => pending.push_back((f, now_us())),
                    Err(_) => break,
                }
            }
            let out = self.core.step(&mut pending);
            self.send(out);
        }
        tracing::debug!("stage {} of {} stopped", self.core.place.stage, self.core.place.deployment);
    }

    /// Sends what the core produced, in order. A frame the router cannot encode ends its
    /// session (the core tells the driver why); a closed link is the recovery's business.
    fn send(&mut self, out: Vec<Out>) {
        let mut out: std::collections::VecDeque<Out> = out.into();
        let (carrier, counters) = (self.core.place.carrier, self.core.counters.clone());
        while let Some(o) = out.pop_front() {
            let t = Instant::now();
            let (to, frame, next) = match o {
                Out::HandOver(item) => {
                    self.router.hand_over(item);
                    counters.handed_over.fetch_add(1, Ordering::Relaxed);
                    add_ns(&counters.send_ns, t.elapsed());
                    continue;
                }
                Out::Next(frame) => match &self.core.place.next {
                    Some(next) => (next, frame, true),
                    None => continue,
                },
                Out::Driver(frame) => (&self.core.place.driver, frame, false),
            };
            let bytes = if to.node == self.core.me { 0 } else { frame.payload.len() as u64 };
            let session = frame.header.session;
            match self.router.send_blocking(to, carrier, frame) {
                // the router's check: this frame cannot be encoded
                Err(e @ WorkerError::Frame(_)) if next => {
                    out.extend(self.core.fail(session, &e.to_string()));
                    continue;
                }
                Err(e) if next => tracing::warn!("to stage {}: {e}", self.core.place.stage + 1),
                Err(e) => tracing::warn!("to the driver: {e}"),
                Ok(()) => {}
            }
            counters.sent_bytes.fetch_add(bytes, Ordering::Relaxed);
            add_ns(&counters.send_ns, t.elapsed());
        }
    }
}

impl StageCore {
    /// A stage's core: `place` on this node `me`, its slice and the caches allocated for it
    /// (`active` and `counters` shared with the node, which reports them).
    pub fn new(
        place: StagePlace,
        slice: Slice,
        caches: Vec<SliceCache>,
        tokenizer: Arc<Tokenizer>,
        vocabulary: VocabularyCell,
        me: String,
        (active, counters): (Arc<AtomicU32>, Arc<StageCounters>),
    ) -> StageCore {
        StageCore {
            place,
            slice,
            tokenizer,
            vocabulary,
            sessions: HashMap::new(),
            pool: caches,
            me,
            active,
            counters,
            out: Vec::new(),
        }
    }

    /// Takes what to compute next from the front of `pending` — several sessions' decode steps
    /// or prompt chunks in one pass where they wait together, else one frame — and returns what
    /// to send.
    pub fn step(&mut self, pending: &mut std::collections::VecDeque<(Inbound, u64)>) -> Vec<Out> {
        let n = self.batchable(pending);
        let prompts = if n >= 2 { 0 } else { self.prompts_together(pending) };
        if n >= 2 {
            let batch: Vec<(Inbound, u64)> = pending.drain(..n).collect();
            self.process_together(batch, false);
        } else if prompts >= 2 {
            let batch: Vec<(Inbound, u64)> = pending.drain(..prompts).collect();
            self.process_together(batch, true);
        } else if let Some((frame, received)) = pending.pop_front() {
            self.process(frame, received);
        }
        std::mem::take(&mut self.out)
    }

    /// Ends `session` here and tells its driver why (a frame of it could not be sent on).
    pub fn fail(&mut self, session: u64, why: &str) -> Vec<Out> {
        tracing::warn!(session, "stage {} of {}: {why}", self.place.stage, self.place.deployment);
        self.end(session);
        self.fail_to_driver(session, why);
        std::mem::take(&mut self.out)
    }

    /// Sessions open here.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Ends the sessions that received no frame for `session_idle` before `now`, telling their
    /// drivers.
    pub fn expire_idle(&mut self, now: Instant) -> Vec<Out> {
        let idle = self.place.session_idle;
        let expired: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.touched) >= idle)
            .map(|(id, _)| *id)
            .collect();
        for session in expired {
            tracing::warn!(
                session,
                "stage {} of {}: no frame for {idle:?}; session ended",
                self.place.stage,
                self.place.deployment
            );
            self.end(session);
            self.fail_to_driver(
                session,
                &format!("session {session} received no frame for {:.0} s and was ended", idle.as_secs_f64()),
            );
        }
        std::mem::take(&mut self.out)
    }

    /// One frame, its failure ending its session here and told to the driver.
    fn process(&mut self, frame: Inbound, received: u64) {
        let session = frame.frame.header.session;
        if let Some(s) = self.sessions.get_mut(&session) {
            s.touched = Instant::now();
        }
        if let Err(e) = self.handle(frame, received) {
            tracing::warn!(session, "stage {} of {}: {e}", self.place.stage, self.place.deployment);
            self.end(session);
            self.fail_to_driver(session, &e.to_string());
        }
    }

    /// How many frames at the front of `pending` are one decode step each of distinct open
    /// sessions, each at its cache's end: those are computed in one pass.
    fn batchable(&self, pending: &std::collections::VecDeque<(Inbound, u64)>) -> usize {
        let want = if self.place.stage == 0 { FrameKind::Tokens } else { FrameKind::Hidden };
        let mut seen = std::collections::HashSet::new();
        pending
            .iter()
            .take_while(|(f, _)| {
                let h = &f.frame.header;
                h.kind == want as i32
                    && h.generation == self.place.generation
                    && h.rows == 1
                    && h.flags & FLAG_LAST != 0
                    && seen.insert(h.session)
                    && self.sessions.get(&h.session).is_some_and(|s| s.cache.len() as u64 == h.first_position)
            })
            .count()
    }

    /// How many frames at the front of `pending` are prompt chunks of distinct open sessions,
    /// each at its cache's end, of [`PREFILL_CHUNK`] rows together at most: where the slice
    /// reads several sessions' prompts with each one's numbers its own
    /// ([`Slice::reads_prompts_together`]), those are read in one pass — prompts that arrive
    /// together, from several drivers, cost one pass per stage instead of one each.
    fn prompts_together(&self, pending: &std::collections::VecDeque<(Inbound, u64)>) -> usize {
        if !self.slice.reads_prompts_together() || !brigade_model::batch::together_allowed() {
            return 0;
        }
        let want = if self.place.stage == 0 { FrameKind::Tokens } else { FrameKind::Hidden };
        let mut seen = std::collections::HashSet::new();
        let mut rows = 0usize;
        pending
            .iter()
            .take_while(|(f, _)| {
                let h = &f.frame.header;
                let take = h.kind == want as i32
                    && h.generation == self.place.generation
                    && h.rows >= 1
                    && h.flags & FLAG_DRAFT == 0
                    // (a decode step: one row, after the prompt's last chunk)
                    && !(h.rows == 1 && h.flags & FLAG_LAST != 0)
                    && rows + h.rows as usize <= PREFILL_CHUNK
                    && seen.insert(h.session)
                    && self.sessions.get(&h.session).is_some_and(|s| s.cache.len() as u64 == h.first_position);
                rows += if take { h.rows as usize } else { 0 };
                take
            })
            .count()
    }

    /// Frames of several sessions in one pass — decode steps (`Slice::forward_rows`) or, with
    /// `prompts`, prompt chunks (`Slice::forward_ragged`); on the CPU each session's numbers
    /// are those it gets alone — then each frame goes on as it would alone. If the pass fails
    /// (no cache changed), each frame goes alone, so that each failure is its own session's.
    fn process_together(&mut self, batch: Vec<(Inbound, u64)>, prompts: bool) {
        let computed = if prompts { self.compute_prompts(&batch) } else { self.compute_batch(&batch) };
        match computed {
            Ok((outputs, computed)) => {
                let here = self.next_is_here();
                for ((frame, received), (out, sampled)) in batch.into_iter().zip(outputs) {
                    let session = frame.frame.header.session;
                    // rows handed over in process are their own tensor: a view of the pass's
                    // output would keep every row alive while they wait in the next queue
                    let out = if here { out.copy().map_err(WorkerError::from) } else { Ok(out) };
                    let sent = out.and_then(|out| {
                        sampled.and_then(|s| self.emit(frame.frame.header, out, s, received, computed))
                    });
                    if let Err(e) = sent {
                        tracing::warn!(session, "stage {} of {}: {e}", self.place.stage, self.place.deployment);
                        self.end(session);
                        self.fail_to_driver(session, &e.to_string());
                    }
                }
            }
            Err(e) => {
                // nothing was appended to any cache: each frame goes alone, its failure its own
                tracing::debug!("a pass of {} sessions failed ({e}); each goes alone", batch.len());
                for (frame, received) in batch {
                    self.process(frame, received);
                }
            }
        }
    }

    /// The decode pass: per frame its output row and sampled id.
    fn compute_batch(&mut self, batch: &[(Inbound, u64)]) -> Result<(Vec<FrameOut>, std::time::Duration), WorkerError> {
        let t0 = Instant::now();
        let (ids, rows) = self.joined_input(batch, 0)?;
        let last = self.is_last();
        let outputs = self.with_sessions(
            batch,
            |slice, caches| slice.forward_rows(caches, input_of(&ids, rows.as_ref())),
            |i, out, st| {
                let row = out.narrow(0, i, 1)?;
                // once the pass is in every cache, a row's draw that fails (its format) is its
                // own session's failure, not the batch's
                let sampled = match st.sampler.as_mut() {
                    Some(draw) if last => brigade_model::rows::logits_row(&row)
                        .map_err(WorkerError::from)
                        .and_then(|l| draw.draw(&l).map_err(WorkerError::from))
                        .map(|s| vec![s]),
                    _ => Ok(Vec::new()),
                };
                Ok((row, sampled))
            },
        )?;
        let computed = t0.elapsed();
        self.count_pass(batch.len(), batch.len(), computed);
        self.counters.batched_rows.fetch_add(batch.len() as u64, Ordering::Relaxed);
        Ok((outputs, computed))
    }

    /// The prompt pass: per frame its output (the chunk's rows; on the last stage the logits
    /// of its last row) and, after a prompt's last chunk on the last stage, its draw.
    fn compute_prompts(
        &mut self,
        batch: &[(Inbound, u64)],
    ) -> Result<(Vec<FrameOut>, std::time::Duration), WorkerError> {
        let t0 = Instant::now();
        let lens: Vec<usize> = batch.iter().map(|(f, _)| f.frame.header.rows as usize).collect();
        let starts: Vec<usize> = lens.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let (ids, rows) = self.joined_input(batch, 1)?;
        let last = self.is_last();
        let outputs = self.with_sessions(
            batch,
            |slice, caches| slice.forward_ragged(caches, input_of(&ids, rows.as_ref()), &lens),
            |i, out, st| {
                st.run_from = None;
                if !last {
                    return Ok((out.narrow(1, starts[i], lens[i])?, Ok(Vec::new())));
                }
                let row = out.narrow(0, i, 1)?;
                let sampled = if batch[i].0.frame.header.flags & FLAG_LAST != 0 {
                    let logits = brigade_model::rows::logits_row(&row)?;
                    st.draw().and_then(|d| Ok(vec![d.draw(&logits)?]))
                } else {
                    Ok(Vec::new())
                };
                Ok((row, sampled))
            },
        )?;
        let computed = t0.elapsed();
        let total: usize = lens.iter().sum();
        self.count_pass(batch.len(), total, computed);
        self.counters.prompt_rows_together.fetch_add(total as u64, Ordering::Relaxed);
        Ok((outputs, computed))
    }

    /// The frames' input for one pass: their ids on the first stage, else their rows joined
    /// along `dim` (0: decode rows, `(n, 1, hidden)`; 1: prompt chunks, `(1, Σ rows, hidden)`).
    fn joined_input(
        &self,
        batch: &[(Inbound, u64)],
        dim: usize,
    ) -> Result<(Vec<u32>, Option<candle_core::Tensor>), WorkerError> {
        if self.place.stage == 0 {
            let mut ids = Vec::new();
            for (f, _) in batch {
                ids.extend(f.frame.token_ids()?);
            }
            return Ok((ids, None));
        }
        let hidden = self.slice.config().hidden;
        let rows = batch.iter().map(|(f, _)| self.hidden_rows(f, hidden)).collect::<Result<Vec<_>, _>>()?;
        Ok((Vec::new(), Some(candle_core::Tensor::cat(&rows, dim)?)))
    }

    /// Runs `pass` over the caches of the frames' sessions (out of the map for the pass, one
    /// mutable borrow each, and always put back), then `each` for every frame with the pass's
    /// output and the frame's session.
    fn with_sessions<T>(
        &mut self,
        batch: &[(Inbound, u64)],
        pass: impl FnOnce(&Slice, &mut [&mut SliceCache]) -> Result<candle_core::Tensor, brigade_model::ModelError>,
        mut each: impl FnMut(usize, &candle_core::Tensor, &mut SessionState) -> Result<T, WorkerError>,
    ) -> Result<Vec<T>, WorkerError> {
        let mut states = Vec::with_capacity(batch.len());
        for (f, _) in batch {
            match self.sessions.remove(&f.frame.header.session) {
                Some(mut s) => {
                    s.touched = Instant::now();
                    states.push((f.frame.header.session, s));
                }
                None => break,
            }
        }
        let result = if states.len() == batch.len() {
            let mut caches: Vec<&mut SliceCache> = states.iter_mut().map(|(_, s)| &mut s.cache).collect();
            pass(&self.slice, &mut caches).map_err(WorkerError::from)
        } else {
            Err(WorkerError::Frame("a session of the pass is not open".into()))
        };
        let outputs =
            result.and_then(|out| states.iter_mut().enumerate().map(|(i, (_, st))| each(i, &out, st)).collect());
        for (id, st) in states {
            self.sessions.insert(id, st);
        }
        outputs
    }

    /// A pass's frames, rows and time in the stage's counters.
    fn count_pass(&self, frames: usize, rows: usize, computed: std::time::Duration) {
        add_ns(&self.counters.compute_ns, computed);
        self.counters.frames.fetch_add(frames as u64, Ordering::Relaxed);
        self.counters.rows.fetch_add(rows as u64, Ordering::Relaxed);
    }

    /// A HIDDEN input's rows `(1, rows, hidden)`: those handed over by the stage before on this
    /// node (checked against the header and the model; the slice moves them to its device), or
    /// those read from the frame's payload, onto this slice's device.
    fn hidden_rows(&self, item: &Inbound, hidden: usize) -> Result<candle_core::Tensor, WorkerError> {
        let h = &item.frame.header;
        match &item.rows {
            Some(t) => {
                if t.dims() != [1, h.rows as usize, hidden] || h.rows == 0 {
                    return Err(WorkerError::Frame(format!(
                        "rows handed over of shape {:?} for a frame of {} rows; this model's hidden size is {hidden}",
                        t.dims(),
                        h.rows
                    )));
                }
                Ok(t.clone())
            }
            None => {
                let values = item.frame.hidden_values(hidden)?;
                Ok(brigade_model::rows::hidden_from_rows(values, h.rows as usize, hidden, self.slice.device())?)
            }
        }
    }

    /// Whether `to` is this node (the router delivers to it in process).
    fn is_here(&self, to: &crate::router::Peer) -> bool {
        to.node == self.me
    }

    /// Whether the next stage is hosted on this node (its hop is in process).
    fn next_is_here(&self) -> bool {
        self.place.next.as_ref().is_some_and(|n| self.is_here(n))
    }

    fn is_last(&self) -> bool {
        self.place.stage + 1 == self.place.n_stages
    }

    /// `frame` addressed to `session` of this stage's deployment generation.
    fn addressed(&self, frame: Frame, session: u64) -> Frame {
        frame.in_session(&self.place.deployment, self.place.generation, session)
    }

    /// Tells the driver that `session` failed here, and why.
    fn fail_to_driver(&mut self, session: u64, why: &str) {
        let text = format!("stage {} ({}): {why}", self.place.stage, self.place.deployment);
        self.send_back(self.addressed(Frame::error(&text), session));
    }

    /// Sends to the next stage (a frame that cannot be encoded ends its session: the host's
    /// [`StageCore::fail`]).
    fn send_on(&mut self, mut frame: Frame) -> Result<(), WorkerError> {
        if self.place.next.is_none() {
            return Ok(());
        }
        frame.header.stage = self.place.stage + 1;
        self.out.push(Out::Next(frame));
        Ok(())
    }

    fn send_back(&mut self, mut frame: Frame) {
        frame.header.stage = self.place.n_stages;
        self.out.push(Out::Driver(frame));
    }

    fn end(&mut self, session: u64) {
        if let Some(s) = self.sessions.remove(&session) {
            let mut cache = s.cache;
            cache.truncate(0);
            self.pool.push(cache);
            self.active.store(self.sessions.len() as u32, Ordering::Relaxed);
        }
    }

    fn handle(&mut self, item: Inbound, received: u64) -> Result<(), WorkerError> {
        let h = &item.frame.header;
        if h.generation != self.place.generation {
            return Err(WorkerError::Frame(format!(
                "frame of generation {}, this stage serves generation {}",
                h.generation, self.place.generation
            )));
        }
        let kind = FrameKind::try_from(h.kind).unwrap_or(FrameKind::Unspecified);
        if item.rows.is_some() && kind != FrameKind::Hidden {
            return Err(WorkerError::Frame(format!("rows handed over with a {kind:?} frame")));
        }
        match kind {
            FrameKind::Open => self.open(item.frame),
            FrameKind::Close => {
                let s = item.frame.header.session;
                self.end(s);
                self.send_on(item.frame)
            }
            FrameKind::Tokens | FrameKind::Hidden => self.compute(item, kind, received),
            other => Err(WorkerError::Frame(format!("a stage does not take {other:?} frames"))),
        }
    }

    fn open(&mut self, frame: Frame) -> Result<(), WorkerError> {
        let session = frame.header.session;
        if self.sessions.contains_key(&session) {
            return Err(WorkerError::Frame(format!("session {session} is open already")));
        }
        if self.sessions.len() >= self.place.max_sessions {
            return Err(WorkerError::Busy(format!(
                "all {} sessions of this stage are in use",
                self.place.max_sessions
            )));
        }
        let spec =
            SessionSpec::decode(frame.payload.as_ref()).map_err(|e| WorkerError::Frame(format!("OPEN frame: {e}")))?;
        let sampler = if self.is_last() { Some(draw_for(&spec, &self.tokenizer, &self.vocabulary)?) } else { None };
        let cache = match self.pool.pop() {
            Some(c) => c,
            None => {
                let c = self.slice.new_cache()?;
                self.counters.caches.fetch_add(1, Ordering::Relaxed);
                c
            }
        };
        self.sessions.insert(session, SessionState { touched: Instant::now(), cache, sampler, run_from: None });
        self.active.store(self.sessions.len() as u32, Ordering::Relaxed);
        // (a failure here ends the session again: `process`)
        self.send_on(frame)
    }

    fn compute(&mut self, item: Inbound, kind: FrameKind, received: u64) -> Result<(), WorkerError> {
        let t0 = Instant::now();
        let tensor =
            if kind == FrameKind::Hidden { Some(self.hidden_rows(&item, self.slice.config().hidden)?) } else { None };
        let first = self.place.stage == 0;
        let mut token_ids = if kind == FrameKind::Tokens && first { Some(item.frame.token_ids()?) } else { None };
        let h = item.frame.header;
        let session = h.session;
        let last = self.is_last();
        let rows = h.rows;
        let tokenizer = &self.tokenizer;
        // the session's state is borrowed for the forward pass (and the sample) only
        let (out, sampled) = {
            let st = self
                .sessions
                .get_mut(&session)
                .ok_or_else(|| WorkerError::Frame(format!("session {session} is not open on this stage")))?;
            let len = st.cache.len() as u64;
            // a draft not taken: the cache goes back to where the driver goes on
            let back = st.run_from.is_some_and(|r| r < h.first_position && h.first_position < len);
            if back && st.cache.truncate(h.first_position as usize) as u64 != h.first_position {
                return Err(WorkerError::Frame(format!("the cache cannot go back to position {}", h.first_position)));
            }
            if !back && h.first_position != len {
                return Err(WorkerError::Frame(format!(
                    "rows start at position {}, the session's cache holds {len}",
                    h.first_position
                )));
            }
            let run = h.flags & FLAG_DRAFT != 0;
            if run && (h.draft.len() != rows as usize || h.draft.is_empty() || h.draft.len() > MAX_RUN) {
                return Err(WorkerError::Frame(format!(
                    "a decode run of {rows} rows with {} ids (1 to {MAX_RUN})",
                    h.draft.len()
                )));
            }
            let ids;
            let input = match (kind, first, &tensor) {
                (FrameKind::Tokens, true, _) => {
                    ids = token_ids.take().unwrap_or_default();
                    if run && ids != h.draft {
                        return Err(WorkerError::Frame("a decode run whose ids are not its rows'".into()));
                    }
                    StageInput::Tokens(&ids)
                }
                (FrameKind::Hidden, false, Some(t)) => StageInput::Hidden(t),
                (k, _, _) => {
                    return Err(WorkerError::Frame(format!("stage {} does not take {k:?} frames", self.place.stage)))
                }
            };
            if run {
                // each row a decode row of its own ((rows, 1, hidden) through the slice)
                let n = rows as usize;
                let input = match input {
                    StageInput::Hidden(t) => StageInput::Hidden(&t.reshape((n, 1, t.dim(2)?))?),
                    tokens => tokens,
                };
                let out = self.slice.forward_runs(&mut [&mut st.cache], input, &[n])?;
                st.run_from = Some(h.first_position);
                let sampled = if last {
                    let rows = out.squeeze(1)?.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
                    draw_run(st.draw()?, &h.draft, &rows, |id| tokenizer.is_eog(id))?
                } else {
                    Vec::new()
                };
                let hidden = out.dim(2)?;
                (out.reshape((1, n, hidden))?, sampled)
            } else {
                let out = self.slice.forward(&mut st.cache, input, Logits::Last)?;
                st.run_from = None;
                let sampled = if last && h.flags & FLAG_LAST != 0 {
                    let logits = brigade_model::rows::logits_row(&out)?;
                    vec![st.draw()?.draw(&logits)?]
                } else {
                    Vec::new()
                };
                (out, sampled)
            }
        };
        let computed = t0.elapsed();
        add_ns(&self.counters.compute_ns, computed);
        self.counters.frames.fetch_add(1, Ordering::Relaxed);
        self.counters.rows.fetch_add(u64::from(rows), Ordering::Relaxed);
        self.emit(h, out, sampled, received, computed)
    }

    /// Sends a computed frame on: the hidden state to the next stage, or (last stage) the
    /// sampled id back to the driver; each stamped with this stage's times.
    fn emit(
        &mut self,
        h: FrameHeader,
        out: candle_core::Tensor,
        sampled: Vec<Drawn>,
        received: u64,
        computed: std::time::Duration,
    ) -> Result<(), WorkerError> {
        let session = h.session;
        let draft = h.draft;
        let rows = h.rows;
        let hidden = self.slice.config().hidden;
        // a frame at stage s carries the timings of stages 0..s at most: a longer list (a peer's
        // bug or a hostile one) is cut here, so that what this stage sends on stays in bounds
        let mut trace = h.trace;
        trace.truncate(self.place.stage as usize);
        let compute_us = computed.as_micros() as u64;
        let stamp = StageTrace { stage: self.place.stage, received_us: received, sent_us: 0, compute_us };
        if self.next_is_here() {
            // the single box's hop: the tensor itself, as computed (device, type), no bytes
            let mut next = self.addressed(Frame::handed_over(h.step, h.first_position, rows, hidden as u64), session);
            next.header.flags = h.flags;
            next.header.draft = draft;
            next.header.stage = self.place.stage + 1;
            trace.push(StageTrace { sent_us: now_us(), ..stamp });
            next.header.trace = trace;
            self.out.push(Out::HandOver(Inbound { frame: next, rows: Some(out) }));
            return Ok(());
        }
        if !self.is_last() {
            let values = brigade_model::rows::hidden_to_rows(&out)?;
            let dtype = brigade_proto::convert::act_dtype_to_proto(self.place.act_dtype);
            let next =
                Frame::hidden_f32(h.step, h.first_position, rows, hidden as u64, &values, dtype)?.with_flags(h.flags);
            trace.push(StageTrace { sent_us: now_us(), ..stamp });
            let mut next = self.addressed(next, session);
            next.header.trace = trace;
            next.header.draft = draft;
            return self.send_on(next);
        }
        // a prompt chunk before the last fills the cache; there is nothing to sample yet (a
        // decode run's ids are the draws along it: the flags and scores are its last's)
        let ids: Vec<u32> = sampled.iter().map(|s| s.id).collect();
        let Some(Drawn { id, done, scores }) = sampled.into_iter().next_back() else { return Ok(()) };
        let mut flags = if self.tokenizer.is_eog(id) { FLAG_EOG } else { 0 };
        if done {
            flags |= FLAG_DONE;
        }
        // the first id drawn follows the frame's last row (a decode run's: its first row)
        let at = h.first_position + if h.flags & FLAG_DRAFT != 0 { 1 } else { u64::from(rows) };
        let back = Frame::tokens(h.step, at, &ids).with_flags(flags);
        trace.push(StageTrace { sent_us: now_us(), ..stamp });
        let mut back = self.addressed(back, session);
        back.header.trace = trace;
        back.header.scores = scores.map(|s| TokenScores {
            logprob: s.logprob,
            top_ids: s.top.iter().map(|t| t.0).collect(),
            top_logprobs: s.top.iter().map(|t| t.1).collect(),
        });
        self.send_back(back);
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn frame(bytes: usize) -> Frame {
        let mut f = brigade_transport::Frame::tokens(0, 0, &[]);
        f.payload = bytes::Bytes::from(vec![0u8; bytes]);
        f
    }

    /// The last stage's draw: a session's format after a failover has taken the ids generated
    /// before it, so the answer goes on where it was; its scores are the logits' own; a resumed
    /// id the format refuses, or a format that does not compile, is refused at OPEN.
    #[test]
    fn a_resumed_session_continues_its_format_and_scores_its_tokens() {
        let files = brigade_model::ModelFiles::from_static_gguf(brigade_model::embedded_model(), "stories").unwrap();
        let tk = files.tokenizer.clone();
        let vocab = VocabularyCell::default();
        let prompt = tk.encode("Say it:", true).unwrap();
        let answer = tk.encode("Once upon a time", false).unwrap();
        let format = serde_json::to_string(&Format::Lark("start: \" Once upon a time\"".into())).unwrap();
        let greedy = brigade_proto::convert::sampling_to_proto(&brigade_core::SamplingParams::greedy());
        let spec = |done: usize| SessionSpec {
            sampling: Some(greedy),
            prompt_ids: [&prompt[..], &answer[..done]].concat(),
            format: format.clone(),
            logprobs: Some(2),
            resumed: done as u32,
            ..Default::default()
        };
        // flat logits but for one id the format never allows: the mask decides every draw
        let vocab_n = tk.vocab_size();
        for done in [0, 2, answer.len() - 1] {
            let mut d = draw_for(&spec(done), &tk, &vocab).unwrap();
            let mut got = answer[..done].to_vec();
            let mut logits = vec![0.0f32; vocab_n];
            logits[5] = 9.0;
            for _ in 0..64 {
                let s = d.draw(&logits).unwrap();
                got.push(s.id);
                let lp = s.scores.unwrap();
                assert_eq!(lp.top[0].0, 5, "scores come from the logits, not the mask");
                assert!(lp.logprob < lp.top[0].1);
                if s.done {
                    break;
                }
            }
            assert_eq!(tk.decode(&got, prompt.last().copied()), " Once upon a time", "resumed after {done}");
        }
        // resumed with the whole answer (the last driver died before its end): the end at once
        let mut d = draw_for(&spec(answer.len()), &tk, &vocab).unwrap();
        let s = d.draw(&vec![0.0f32; vocab_n]).unwrap();
        assert!(s.done && Some(s.id) == tk.eos && tk.is_eog(s.id));
        // a resumed id the format refuses; more resumed ids than the prompt has; a bad format
        let mut bad = spec(2);
        bad.prompt_ids.push(3 + u32::from(b'Z')); // the byte token of `Z`
        bad.resumed = 3;
        assert!(draw_for(&bad, &tk, &vocab).is_err());
        let mut bad = spec(0);
        bad.resumed = 1000;
        assert!(matches!(draw_for(&bad, &tk, &vocab), Err(WorkerError::Frame(_))));
        let mut bad = spec(0);
        bad.format = serde_json::to_string(&Format::Lark("start: nowhere".into())).unwrap();
        assert!(matches!(draw_for(&bad, &tk, &vocab), Err(WorkerError::BadRequest(_))));
        let mut bad = spec(0);
        bad.logprobs = Some(21);
        assert!(draw_for(&bad, &tk, &vocab).is_err());
    }

    #[test]
    fn a_stage_input_holds_its_byte_budget_and_no_more() {
        let (input, queue) = stage_queue(3 * (1000 + FRAME_OVERHEAD));
        for _ in 0..3 {
            assert_eq!(input.offer(frame(1000)), Ok(()));
        }
        let refused = input.offer(frame(1000));
        assert_eq!(refused, Err(InputRefused::Full { queued: 3 * (1000 + FRAME_OVERHEAD), budget: 3 * 1512 }));
        // taking a frame frees its bytes
        assert!(queue.try_recv().is_ok());
        assert_eq!(input.offer(frame(1000)), Ok(()));
        assert!(input.offer(frame(0)).is_err());
        drop(queue);
        let (input, queue) = stage_queue(1 << 20);
        drop(queue);
        assert_eq!(input.offer(frame(10)), Err(InputRefused::Stopped));
        assert_eq!(input.queued.load(Ordering::Acquire), 0);
    }

    /// Rows handed over in process carry no payload, but their tensor counts against the next
    /// stage's budget as its bytes, and taking them frees exactly that.
    #[test]
    fn rows_handed_over_count_their_tensor_against_the_budget() {
        let rows = |n: usize| Inbound {
            frame: Frame::handed_over(1, 0, n as u32, 64),
            rows: Some(
                candle_core::Tensor::zeros((1, n, 64), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
            ),
        };
        let one = 4 * 64 * 4 + FRAME_OVERHEAD;
        let (input, queue) = stage_queue(2 * one);
        assert_eq!(input.offer(rows(4)), Ok(()));
        assert_eq!(input.queued.load(Ordering::Acquire), one);
        assert_eq!(input.offer(rows(4)), Ok(()));
        assert!(matches!(input.offer(rows(1)), Err(InputRefused::Full { .. })), "the budget holds");
        let took = queue.try_recv().unwrap();
        assert_eq!(took.rows.as_ref().map(|t| t.dims().to_vec()), Some(vec![1, 4, 64]));
        assert!(took.frame.payload.is_empty());
        assert_eq!(input.queued.load(Ordering::Acquire), one);
    }

    /// A random Q4_K model of two layers (its weights packed on CPUs with int8 kernels).
    fn q4k_model(dir: &tempfile::TempDir) -> brigade_model::ModelFiles {
        q4k_layers(dir, 2)
    }

    /// A random Q4_K model of `layers` layers (hidden 256, vocabulary 300).
    pub(crate) fn q4k_layers(dir: &tempfile::TempDir, layers: usize) -> brigade_model::ModelFiles {
        synth_layers(dir, layers, brigade_model::synth::SynthType::Q4K)
    }

    /// A random model of `layers` layers of weights `ty` (hidden 256, vocabulary 300).
    pub(crate) fn synth_layers(
        dir: &tempfile::TempDir,
        layers: usize,
        ty: brigade_model::synth::SynthType,
    ) -> brigade_model::ModelFiles {
        let path = dir.path().join(format!("{ty:?}-{layers}.gguf"));
        let shape = brigade_model::synth::Shape {
            layers,
            hidden: 256,
            ffn: 512,
            heads: 4,
            kv_heads: 2,
            vocab: 300,
            context: 256,
            rope_theta: 1e4,
        };
        brigade_model::synth::write_gguf(&path, &shape, brigade_model::synth::SynthType::Q4K, 3, |_, _| {}).unwrap();
        brigade_model::ModelFiles::open(&path).unwrap()
    }

    pub(crate) fn load(files: &brigade_model::ModelFiles, (a, b): (usize, usize)) -> Slice {
        let layers = brigade_core::LayerRange::new(a, b).unwrap();
        Slice::load(files, layers, &candle_core::Device::Cpu, candle_core::DType::F32, 256).unwrap()
    }

    /// A router for node `w1`, which hosts every stage of deployment `d` and drives it.
    fn router() -> Arc<Router> {
        let ca = brigade_transport::ClusterCa::generate("test").unwrap();
        let identity = ca.new_identity("w1", brigade_transport::Role::Node).unwrap();
        let quic =
            brigade_transport::QuicEndpoint::bind("127.0.0.1:0".parse().unwrap(), &identity, ca.cert_pem()).unwrap();
        Router::new("w1".into(), crate::identity::Creds { identity, ca_pem: ca.cert_pem().to_string() }, quic)
    }

    /// Stage `stage` of `n` of deployment `d` (generation 1) on `w1`.
    fn place(stage: u32, n: u32) -> StagePlace {
        let me = crate::router::Peer { node: "w1".into(), address: String::new() };
        StagePlace {
            deployment: "d".into(),
            generation: 1,
            stage,
            n_stages: n,
            next: (stage + 1 < n).then(|| me.clone()),
            driver: me,
            act_dtype: ActDtype::F32,
            carrier: CarrierKind::Quic,
            max_sessions: 8,
            session_idle: std::time::Duration::from_secs(60),
        }
    }

    /// OPEN for `session`: greedy, scoring the draw's log-probability.
    fn open_frame(session: u64, prompt: &[u32]) -> Frame {
        let greedy = brigade_proto::convert::sampling_to_proto(&brigade_core::SamplingParams::greedy());
        let spec = SessionSpec {
            sampling: Some(greedy),
            prompt_ids: prompt.to_vec(),
            logprobs: Some(1),
            ..Default::default()
        };
        Frame::open(&spec).in_session("d", 1, session)
    }

    /// `ids` at `position` for `session`: a prompt's last chunk, or with `run` a decode run.
    fn tokens_at(session: u64, position: u64, ids: &[u32], run: bool) -> Frame {
        let mut f = Frame::tokens(1, position, ids).with_flags(FLAG_LAST).in_session("d", 1, session);
        if run {
            f.header.flags |= FLAG_DRAFT;
            f.header.draft = ids.to_vec();
        }
        f
    }

    async fn answer(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Frame>) -> Frame {
        tokio::time::timeout(std::time::Duration::from_secs(60), rx.recv()).await.unwrap().unwrap()
    }

    /// A stage's core on node `me` for `files`' layers `cut` (stage `stage` of `n` on `w1`).
    fn core(files: &brigade_model::ModelFiles, cut: (usize, usize), stage: u32, n: u32, me: &str) -> StageCore {
        let tokenizer = files.tokenizer().clone();
        let counters = (Arc::new(AtomicU32::new(0)), Arc::new(StageCounters::default()));
        StageCore::new(
            place(stage, n),
            load(files, cut),
            vec![],
            tokenizer,
            VocabularyCell::default(),
            me.into(),
            counters,
        )
    }

    /// One frame through a core; what it asks to send.
    fn step(core: &mut StageCore, item: impl Into<Inbound>) -> Vec<Out> {
        let mut pending = std::collections::VecDeque::from([(item.into(), 0)]);
        let out = core.step(&mut pending);
        assert!(pending.is_empty());
        out
    }

    /// The stage without IO: two cores driven by hand, no router, no thread. A prompt's rows go
    /// to the next stage as the tensor (the next on this node) or as a HIDDEN frame (another
    /// node), and the last stage's draw is the whole model's greedy id; a frame of another
    /// generation, one whose position does not follow the cache, and a session idle past its
    /// limit each end the session with one ERROR to the driver and nothing sent on.
    #[test]
    fn a_chain_of_stage_cores_answers_what_the_whole_model_answers_and_refuses_what_does_not_follow() {
        let dir = tempfile::tempdir().unwrap();
        let files = q4k_model(&dir);
        let prompt: Vec<u32> = (0..11u32).map(|i| 3 + (i * 53) % 290).collect();
        let whole = {
            let s = load(&files, (0, 2));
            let l = s.forward(&mut s.new_cache().unwrap(), StageInput::Tokens(&prompt), Logits::Last).unwrap();
            Sampler::new(brigade_core::SamplingParams::greedy())
                .sample(&brigade_model::rows::logits_row(&l).unwrap(), &prompt)
        };
        let error_of = |out: &[Out]| match out {
            [Out::Driver(f)] if f.header.kind == FrameKind::Error as i32 => f.header.text.clone(),
            other => panic!("not one ERROR to the driver: {other:?}"),
        };
        for me in ["w1", "w0"] {
            let (mut first, mut last) = (core(&files, (0, 1), 0, 2, me), core(&files, (1, 2), 1, 2, "w1"));
            let open = step(&mut first, open_frame(7, &prompt));
            let [Out::Next(open)] = &open[..] else { panic!("OPEN not sent on: {open:?}") };
            assert_eq!(open.header.stage, 1);
            assert!(step(&mut last, open.clone()).is_empty(), "the last stage sends OPEN nowhere");
            let rows = step(&mut first, tokens_at(7, 0, &prompt, false));
            let item = match (me, rows.into_iter().next()) {
                ("w1", Some(Out::HandOver(item))) => item,
                ("w0", Some(Out::Next(f))) => {
                    assert_eq!((f.header.kind, f.header.rows), (FrameKind::Hidden as i32, prompt.len() as u32));
                    Inbound::from(f)
                }
                (_, other) => panic!("on {me}: {other:?}"),
            };
            let back = step(&mut last, item);
            let [Out::Driver(f)] = &back[..] else { panic!("no draw: {back:?}") };
            let ids = f.token_ids().unwrap();
            assert_eq!((ids, f.header.first_position), (vec![whole], prompt.len() as u64), "on {me}");
            // another generation: refused, the session ended here
            let mut stale = tokens_at(7, prompt.len() as u64, &[whole], false);
            stale.header.generation = 2;
            assert!(error_of(&step(&mut first, stale)).contains("generation 2"));
            assert_eq!(first.sessions(), 0);
            // a position the cache does not hold
            let gap = tokens_at(7, prompt.len() as u64 + 3, &[whole], false);
            assert!(error_of(&step(&mut last, Inbound::from(gap))).contains("position"));
            assert_eq!(last.sessions(), 0);
            // idle past the limit
            step(&mut first, open_frame(8, &prompt));
            assert!(first.expire_idle(Instant::now()).is_empty());
            let later = Instant::now() + std::time::Duration::from_secs(61);
            assert!(error_of(&first.expire_idle(later)).contains("received no frame"));
            assert_eq!(first.sessions(), 0);
        }
    }

    /// A driver's target for `files` on two stages of node `w1`, prompts in chunks of 4.
    fn target(files: &brigade_model::ModelFiles) -> crate::driver::DriveTarget {
        let (_, cancel) = tokio::sync::watch::channel(false);
        crate::driver::DriveTarget {
            deployment: "d".into(),
            generation: 1,
            n_stages: 2,
            n_ctx: 256,
            vocab: 300,
            carrier: CarrierKind::Quic,
            first: crate::router::Peer { node: "w1".into(), address: String::new() },
            stage_nodes: Arc::new(vec!["w1".into(), "w1".into()]),
            tokenizer: files.tokenizer().clone(),
            vocabulary: VocabularyCell::default(),
            permits: Arc::new(tokio::sync::Semaphore::new(1)),
            ubatch: 4,
            hidden_bytes: 1024,
            cancel,
            drafting: None,
            max_run: MAX_RUN,
        }
    }

    /// What a ring run gave: the ids streamed, and the stop or the failure's text.
    type Ring = (Vec<u32>, Result<brigade_proto::v1::StopReason, String>);

    /// One session of `req` around the whole ring without IO — a driver's
    /// [`crate::driver::SessionCore`] and two fresh stage cores, frames moved by hand — with the
    /// `twice`-th run the driver sends delivered twice.
    fn ring(files: &brigade_model::ModelFiles, req: &brigade_proto::v1::DriveRequest, twice: Option<usize>) -> Ring {
        use crate::driver::{Opened, SessionCore, Then};
        let target = target(files);
        let (mut first, mut last) = (core(files, (0, 1), 0, 2, "w1"), core(files, (1, 2), 1, 2, "w1"));
        let mut feed = req.prompt_ids.clone();
        feed.extend(&req.resume_ids);
        let Opened::Run(mut session, frames) = SessionCore::open(&target, req, 7, &req.prompt_ids, &feed).unwrap()
        else {
            panic!("nothing to generate")
        };
        assert_eq!(frames.len(), 1 + feed.len().div_ceil(4), "OPEN and the prompt in chunks of 4");
        // the first stage's output to the last, the last's to the driver
        let around = |f: Frame, first: &mut StageCore, last: &mut StageCore| -> Vec<Frame> {
            let mut back = Vec::new();
            for o in step(first, f) {
                let item = match o {
                    Out::HandOver(item) => item,
                    Out::Next(f) => Inbound::from(f),
                    Out::Driver(f) => {
                        back.push(f);
                        continue;
                    }
                };
                back.extend(step(last, item).into_iter().map(|o| match o {
                    Out::Driver(f) => f,
                    other => panic!("the last stage sent {other:?} on"),
                }));
            }
            back
        };
        let mut answers: Vec<Frame> = frames.into_iter().flat_map(|f| around(f, &mut first, &mut last)).collect();
        let (mut ids, mut sent) = (Vec::new(), 0);
        let outcome = loop {
            let Some(f) = answers.pop() else { break Err("no answer".to_string()) };
            match session.on_frame(f, 0) {
                Err(e) => break Err(e.to_string()),
                Ok(None) => {}
                Ok(Some((tokens, then))) => {
                    ids.extend(tokens.iter().map(|t| t.id));
                    match then {
                        Then::Stop(s) => break Ok(s),
                        Then::Send(f) => {
                            sent += 1;
                            if twice == Some(sent) {
                                answers.extend(around((*f).clone(), &mut first, &mut last));
                            }
                            answers.extend(around(*f, &mut first, &mut last));
                        }
                    }
                }
            }
        };
        (ids, outcome)
    }

    /// A request for `n` ids after `prompt`, sampled by `sampling`, end-of-text ignored.
    pub(crate) fn request(
        prompt: &[u32],
        n: u32,
        sampling: brigade_core::SamplingParams,
    ) -> brigade_proto::v1::DriveRequest {
        brigade_proto::v1::DriveRequest {
            prompt_ids: prompt.to_vec(),
            use_prompt_ids: true,
            max_tokens: n,
            ignore_eos: true,
            sampling: Some(brigade_proto::convert::sampling_to_proto(&sampling)),
            ..Default::default()
        }
    }

    /// The whole ring without IO gives the single box's greedy ids (the prompt read in chunks
    /// of 4); a frame delivered twice makes the stage refuse it and the session fail with that
    /// reason, never with other text.
    #[test]
    fn a_session_core_and_stage_cores_generate_what_the_single_box_generates() {
        use brigade_proto::v1::StopReason;
        let dir = tempfile::tempdir().unwrap();
        let files = q4k_model(&dir);
        let prompt: Vec<u32> = (0..10u32).map(|i| 5 + (i * 71) % 280).collect();
        const N: usize = 12;
        let whole: Vec<u32> = {
            let s = load(&files, (0, 2));
            let mut cache = s.new_cache().unwrap();
            let mut sampler = Sampler::new(brigade_core::SamplingParams::greedy());
            let (mut ids, mut input) = (Vec::new(), prompt.clone());
            for _ in 0..N {
                let l = s.forward(&mut cache, StageInput::Tokens(&input), Logits::Last).unwrap();
                let id = sampler.sample(&brigade_model::rows::logits_row(&l).unwrap(), &prompt);
                ids.push(id);
                input = vec![id];
            }
            ids
        };
        let req = request(&prompt, N as u32, brigade_core::SamplingParams::greedy());
        assert_eq!(ring(&files, &req, None), (whole.clone(), Ok(StopReason::Length)));
        let (ids, outcome) = ring(&files, &req, Some(5));
        let e = outcome.unwrap_err();
        assert!(e.contains("position"), "{e}");
        assert_eq!(ids[..], whole[..ids.len()], "what came before the failure is the same text");
        assert!(ids.len() <= 6, "{} ids after the duplicate at run 5", ids.len());
    }

    /// A session resumed after a failover (the ids the client has replayed as `resume_ids`)
    /// goes on as if nothing had happened — with seeded sampling too: the last stage's
    /// generator skips the draws the resumed ids took.
    #[test]
    fn a_resumed_seeded_session_goes_on_as_the_uninterrupted_one() {
        use brigade_proto::v1::StopReason;
        let dir = tempfile::tempdir().unwrap();
        let files = q4k_model(&dir);
        let prompt: Vec<u32> = (0..7u32).map(|i| 9 + (i * 41) % 280).collect();
        let seeded = brigade_core::SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed: 77,
            repeat_penalty: 1.1,
            ..brigade_core::SamplingParams::default()
        };
        for sampling in [brigade_core::SamplingParams::greedy(), seeded] {
            let (whole, outcome) = ring(&files, &request(&prompt, 16, sampling.clone()), None);
            assert_eq!((whole.len(), outcome), (16, Ok(StopReason::Length)));
            for k in [1, 5, 11] {
                let mut req = request(&prompt, 16, sampling.clone());
                req.resume_ids = whole[..k].to_vec();
                let (rest, outcome) = ring(&files, &req, None);
                assert_eq!(outcome, Ok(StopReason::Length));
                assert_eq!(rest[..], whole[k..], "resumed after {k} ids at temperature {}", sampling.temperature);
            }
        }
    }

    /// Prompts of three sessions waiting together at a stage are read in one pass
    /// (`forward_ragged`), and each session's first draw and its log-probability are, bit for
    /// bit, what its prompt read alone gives: on one stage (the last: the draws of the pass's
    /// rows), and on the first of two on one node (each chunk's rows handed on alone).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn prompts_waiting_together_are_read_in_one_pass_with_their_own_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let files = q4k_model(&dir);
        let prompts: Vec<Vec<u32>> =
            [5usize, 17, 9].iter().map(|&n| (0..n as u32).map(|i| 3 + (i * 37 + n as u32) % 290).collect()).collect();
        // alone: each prompt read by a fresh cache, its logits' greedy id and log-probability
        let alone: Vec<(u32, f32)> = prompts
            .iter()
            .map(|p| {
                let s = load(&files, (0, 2));
                let mut c = s.new_cache().unwrap();
                let l = s.forward(&mut c, StageInput::Tokens(p), Logits::Last).unwrap();
                let l = brigade_model::rows::logits_row(&l).unwrap();
                let id = Sampler::new(brigade_core::SamplingParams::greedy()).sample(&l, p);
                (id, brigade_core::TokenLogprob::of(&l, id, 1).logprob)
            })
            .collect();
        for cuts in [vec![(0, 2)], vec![(0, 1), (1, 2)]] {
            let router = router();
            let n = cuts.len() as u32;
            let (inbox, queue) = stage_queue(1 << 24);
            let mut answers = Vec::new();
            // every frame waits in the first stage's queue before its thread starts
            for (k, p) in prompts.iter().enumerate() {
                inbox.offer(open_frame(100 + k as u64, p)).unwrap();
                answers.push(router.register_driver(100 + k as u64, Arc::new(vec!["w1".into()])));
            }
            for (k, p) in prompts.iter().enumerate() {
                inbox.offer(tokens_at(100 + k as u64, 0, p, false)).unwrap();
            }
            let tk = files.tokenizer.clone();
            // the later stages first (their inputs known to the router), then the first
            let mut later = Vec::new();
            for (i, &cut) in cuts.iter().enumerate().skip(1) {
                let h =
                    StageHandle::start(place(i as u32, n), load(&files, cut), Vec::new(), tk.clone(), router.clone())
                        .unwrap();
                router.add_stage("d", i as u32, h.input.clone(), "w1");
                later.push(h);
            }
            let slice = load(&files, cuts[0]);
            let together = slice.reads_prompts_together() && brigade_model::batch::together_allowed();
            let first =
                StageHandle::start_on(place(0, n), slice, Vec::new(), tk, router.clone(), (inbox, queue)).unwrap();
            for (k, rx) in answers.iter_mut().enumerate() {
                let f = answer(rx).await;
                assert_eq!(f.header.kind, FrameKind::Tokens as i32, "{cuts:?}, session {k}: {}", f.header.text);
                let ids = f.token_ids().unwrap();
                let lp = f.header.scores.as_ref().unwrap().logprob;
                assert_eq!(ids, vec![alone[k].0], "{cuts:?}, session {k}");
                assert!(
                    lp == alone[k].1,
                    "{cuts:?}, session {k}: log-probability {lp} read together, {} alone",
                    alone[k].1
                );
            }
            // the first stage read the three prompts in one pass (where its slice can)
            let rows = first.counters.prompt_rows_together.load(Ordering::Relaxed);
            assert_eq!(rows, if together { 31 } else { 0 }, "{cuts:?}: prompt rows read together");
            drop((first, later));
        }
    }

    /// Decode runs that do not add up end their own session with an error naming what is wrong,
    /// and no other: ids in the header that are not the rows', a header of another length, a
    /// run past `MAX_RUN`, a frame going back before the last run or with no run to go back
    /// to. A session beside them decodes a run, goes back into it and on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn malformed_decode_runs_end_their_session_only() {
        let dir = tempfile::tempdir().unwrap();
        let files = q4k_model(&dir);
        let router = router();
        let handle =
            StageHandle::start(place(0, 1), load(&files, (0, 2)), Vec::new(), files.tokenizer.clone(), router.clone())
                .unwrap();
        let prompt: Vec<u32> = (3..13).collect();
        let mut rx = Vec::new();
        for s in 0..6u64 {
            rx.push(router.register_driver(s, Arc::new(vec!["w1".into()])));
            handle.input.offer(open_frame(s, &prompt)).unwrap();
            handle.input.offer(tokens_at(s, 0, &prompt, false)).unwrap();
            let f = answer(&mut rx[s as usize]).await;
            assert_eq!(f.header.kind, FrameKind::Tokens as i32, "{}", f.header.text);
        }
        let at = prompt.len() as u64;
        let bad = |s: u64, f: Frame| {
            handle.input.offer(f).unwrap();
            s
        };
        let mut wrong_ids = tokens_at(0, at, &[5, 6, 7], true);
        wrong_ids.header.draft = vec![5, 6, 8];
        let mut short = tokens_at(1, at, &[5, 6, 7], true);
        short.header.draft = vec![5, 6];
        let long: Vec<u32> = (0..MAX_RUN as u32 + 1).map(|i| 3 + i % 200).collect();
        let cases = [
            (bad(0, wrong_ids), "not its rows'"),
            (bad(1, short), "3 rows with 2 ids"),
            (bad(2, tokens_at(2, at, &long, true)), "1 to 65"),
            (bad(3, tokens_at(3, at - 2, &[5], false)), "cache holds"),
        ];
        for (s, why) in cases {
            let f = answer(&mut rx[s as usize]).await;
            assert_eq!(f.header.kind, FrameKind::Error as i32, "session {s}");
            assert!(f.header.text.contains(why), "session {s}: {}", f.header.text);
        }
        // session 4 runs 4 rows, goes back to its second (the draft's first token taken) and on;
        // a frame of session 5 before its run's first position is refused
        for s in [4u64, 5] {
            handle.input.offer(tokens_at(s, at, &[20, 21, 22, 23], true)).unwrap();
            let f = answer(&mut rx[s as usize]).await;
            assert_eq!(f.header.kind, FrameKind::Tokens as i32, "session {s}: {}", f.header.text);
        }
        handle.input.offer(tokens_at(4, at + 2, &[30], false)).unwrap();
        let f = answer(&mut rx[4]).await;
        assert_eq!(f.header.kind, FrameKind::Tokens as i32, "session 4 after going back: {}", f.header.text);
        handle.input.offer(tokens_at(5, at, &[30], false)).unwrap();
        let f = answer(&mut rx[5]).await;
        assert!(f.header.kind == FrameKind::Error as i32 && f.header.text.contains("cache holds"), "{}", f.header.text);
    }

    /// Hidden states crossing a stage boundary as f16 or bf16 instead of f32, against the f32
    /// path, on a random-weight model (the worst case: trained models' hidden states are smoother).
    ///
    /// The tolerance: rounding a hidden state to f16 (11 significant bits) perturbs each element
    /// by at most 2^-11 ≈ 4.9e-4 of its size, bf16 (8 bits) by 2^-8 ≈ 3.9e-3. The next stage
    /// starts with an RMS norm (scale-free) and the layers after are smooth maps, so the logits
    /// move by about that relative amount times the amplification of the remaining layers; we
    /// allow 20× the rounding (1e-2 of the largest logit for f16, 8e-2 for bf16) and measured
    /// well under that (the test prints the figures).
    #[test]
    fn half_precision_activations_stay_close_to_f32() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let shape = brigade_model::synth::Shape {
            layers: 4,
            hidden: 256,
            ffn: 512,
            heads: 8,
            kv_heads: 4,
            vocab: 512,
            context: 128,
            rope_theta: 1e4,
        };
        brigade_model::synth::write_gguf(&path, &shape, brigade_model::synth::SynthType::F32, 7, |_, _| {}).unwrap();
        let files = brigade_model::ModelFiles::open(&path).unwrap();
        let cpu = candle_core::Device::Cpu;
        let a = Slice::load(&files, brigade_core::LayerRange::new(0, 2).unwrap(), &cpu, candle_core::DType::F32, 64)
            .unwrap();
        let b = Slice::load(&files, brigade_core::LayerRange::new(2, 4).unwrap(), &cpu, candle_core::DType::F32, 64)
            .unwrap();
        let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 512).collect();
        let mut ca = a.new_cache().unwrap();
        let h = a.forward(&mut ca, StageInput::Tokens(&ids), Logits::All).unwrap();
        let logits = |dtype: ActDtype| -> Vec<f32> {
            let values = brigade_model::rows::hidden_to_rows(&h).unwrap();
            let rows = ids.len() as u32;
            let frame =
                Frame::hidden_f32(0, 0, rows, 256, &values, brigade_proto::convert::act_dtype_to_proto(dtype)).unwrap();
            let back = frame.hidden_values(256).unwrap();
            let back = brigade_model::rows::hidden_from_rows(back, ids.len(), 256, &cpu).unwrap();
            let mut cb = b.new_cache().unwrap();
            b.forward(&mut cb, StageInput::Hidden(&back), Logits::All)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let exact = logits(ActDtype::F32);
        let scale = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
        // f32 on the wire is exact
        let direct: Vec<f32> = {
            let mut cb = b.new_cache().unwrap();
            b.forward(&mut cb, StageInput::Hidden(&h), Logits::All).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        assert_eq!(exact, direct);
        for (dtype, tol) in [(ActDtype::F16, 1e-2f32), (ActDtype::Bf16, 8e-2)] {
            let got = logits(dtype);
            let worst = exact.iter().zip(&got).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale;
            let argmax = |v: &[f32]| -> Vec<usize> {
                v.chunks(512)
                    .map(|r| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap_or(0))
                    .collect()
            };
            let same = argmax(&exact).iter().zip(argmax(&got)).filter(|(x, y)| **x == *y).count();
            eprintln!("{dtype:?}: largest logit error {worst:.2e} of the largest logit; argmax equal at {same} of {} positions", ids.len());
            assert!(worst < tol, "{dtype:?}: {worst} of the largest logit (allowed {tol})");
        }
    }
}
