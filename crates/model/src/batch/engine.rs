//! [`Engine`]: a [`Batch`] on its own thread, for callers on other threads (the HTTP server's).
//! Jobs arrive through a channel and join between steps; each job's outputs go to its [`Sink`];
//! a sink whose receiver is gone cancels its job before the next step, which frees the slot.

use super::{Batch, Job, JobId, Output};
use crate::{ModelError, Pipeline};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

/// Where a job's outputs go.
pub trait Sink: Send {
    /// Delivers one output; false when the receiver is gone (the job is then cancelled).
    fn deliver(&mut self, out: Output) -> bool;
    /// Whether the receiver is gone; checked before every step.
    fn is_closed(&self) -> bool;
}

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Sessions decoded together (each with its KV caches allocated at start).
    pub parallel: usize,
    /// Jobs that may wait for a slot when every slot is busy; more are refused ([`Busy`]).
    pub queue: usize,
}

/// Every slot is busy and the queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("all {parallel} slots are busy and {queue} requests are waiting already")]
pub struct Busy {
    pub parallel: usize,
    pub queue: usize,
}

/// Jobs in the engine now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    pub parallel: usize,
    /// Jobs in a slot.
    pub active: usize,
    /// Jobs submitted and not yet in a slot.
    pub waiting: usize,
}

struct Shared {
    /// Jobs submitted and not finished.
    outstanding: AtomicUsize,
    /// Jobs in a slot, as of the last step.
    active: AtomicUsize,
    next_id: AtomicU64,
    /// [`Batch::drafts`], as of the last step.
    drafted: AtomicU64,
    accepted: AtomicU64,
}

enum Command {
    Submit(JobId, Job, Box<dyn Sink>),
}

/// A batch engine thread. Dropping it ends the thread after the step in progress.
pub struct Engine {
    tx: Option<mpsc::Sender<Command>>,
    shared: Arc<Shared>,
    cfg: EngineConfig,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Allocates `cfg.parallel` sessions on `pipeline` and starts the thread.
    pub fn start(
        pipeline: Arc<Pipeline>,
        cfg: EngineConfig,
        is_eog: impl Fn(u32) -> bool + Send + 'static,
    ) -> Result<Engine, ModelError> {
        Engine::start_batch(Batch::new(pipeline, cfg.parallel, is_eog)?, cfg)
    }

    /// Starts the thread on a batch built by the caller (with speculative decoding, say); its
    /// slots are the engine's, whatever `cfg.parallel` says.
    pub fn start_batch(batch: Batch, cfg: EngineConfig) -> Result<Engine, ModelError> {
        let cfg = EngineConfig { parallel: batch.parallel(), ..cfg };
        let shared = Arc::new(Shared {
            outstanding: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            drafted: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        });
        let (tx, rx) = mpsc::channel();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("brigade-batch".into())
            .spawn(move || candle_core::Device::Cpu.with_context(move || run(batch, rx, &sh)))
            .map_err(|e| ModelError::BadInput(format!("cannot start the batch thread: {e}")))?;
        Ok(Engine { tx: Some(tx), shared, cfg, thread: Some(thread) })
    }

    /// Queues a job whose outputs go to `sink`; refused when `parallel + queue` jobs are in the
    /// engine already.
    pub fn submit(&self, job: Job, sink: Box<dyn Sink>) -> Result<JobId, Busy> {
        let cap = self.cfg.parallel + self.cfg.queue;
        let busy = Busy { parallel: self.cfg.parallel, queue: self.cfg.queue };
        self.shared
            .outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1))
            .map_err(|_| busy)?;
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let sent = self.tx.as_ref().is_some_and(|tx| tx.send(Command::Submit(id, job, sink)).is_ok());
        if !sent {
            // the thread is gone (it only ends when the engine is dropped)
            self.shared.outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(busy);
        }
        Ok(id)
    }

    pub fn load(&self) -> Load {
        let outstanding = self.shared.outstanding.load(Ordering::Acquire);
        let active = self.shared.active.load(Ordering::Acquire).min(outstanding);
        Load { parallel: self.cfg.parallel, active, waiting: outstanding - active }
    }

    /// Drafted tokens fed and of them taken, over the engine's life (speculative decoding).
    pub fn drafts(&self) -> (u64, u64) {
        (self.shared.drafted.load(Ordering::Relaxed), self.shared.accepted.load(Ordering::Relaxed))
    }

    pub fn config(&self) -> EngineConfig {
        self.cfg
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut batch: Batch, rx: mpsc::Receiver<Command>, shared: &Shared) {
    let mut sinks: HashMap<JobId, Box<dyn Sink>> = HashMap::new();
    let finished = |sinks: &mut HashMap<JobId, Box<dyn Sink>>, id: JobId| {
        if sinks.remove(&id).is_some() {
            shared.outstanding.fetch_sub(1, Ordering::AcqRel);
        }
    };
    loop {
        if batch.is_idle() {
            // nothing to compute: sleep until a job arrives (or the engine is dropped)
            match rx.recv() {
                Ok(Command::Submit(id, job, sink)) => {
                    sinks.insert(id, sink);
                    batch.handle_submit(id, job);
                }
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(Command::Submit(id, job, sink)) => {
                    sinks.insert(id, sink);
                    batch.handle_submit(id, job);
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        let gone: Vec<JobId> = sinks.iter().filter(|(_, s)| s.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            tracing::debug!(job = id, "receiver gone: job cancelled");
            batch.handle_cancel(id);
            finished(&mut sinks, id);
        }
        let outs = batch.step();
        shared.active.store(batch.active(), Ordering::Release);
        let (drafted, accepted) = batch.drafts();
        shared.drafted.store(drafted, Ordering::Relaxed);
        shared.accepted.store(accepted, Ordering::Relaxed);
        for (id, out) in outs {
            let last = out.is_last();
            let delivered = sinks.get_mut(&id).is_some_and(|s| s.deliver(out));
            if !delivered {
                batch.handle_cancel(id);
            }
            if last || !delivered {
                finished(&mut sinks, id);
            }
        }
        shared.active.store(batch.active(), Ordering::Release);
    }
}
