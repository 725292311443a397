//! The replicated coordinator: a raft-rs group whose log entries are the cluster state's
//! [`Command`]s, applied by the pure `ClusterState::apply` on every replica at the same index.
//!
//! [`replica`] is one replica's raft without IO: the `RawNode`, its log and the state machine,
//! driven by calls and answering with effects. In production one task drives it ([`node`]);
//! everything else talks to it through a [`RaftHandle`]:
//! `propose` a command and await its result once it is committed and applied (any replica may
//! propose: a follower's proposal is forwarded to the leader by raft and answered when the
//! follower applies it), `read_barrier` before a read that must be current (raft's read index),
//! `change_replicas` to add or remove a replica. The log is durable ([`storage`]); raft messages
//! between replicas travel as opaque bytes over gRPC ([`transport`]).
//!
//! A single coordinator is a group of one: the same code, committing as soon as its own write is
//! durable.

pub mod node;
pub mod replica;
pub mod storage;
pub mod transport;

pub use node::{RaftHandle, RaftOptions, RaftStatusView};
pub use raft::eraftpb::{ConfChangeType, Message, MessageType};
pub use replica::{Answer, Effect, Replica, Ticket, Tuning};

/// Routes raft-rs's slog records to `tracing` (target `raft`).
pub(crate) struct TracingDrain;

impl slog::Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &slog::Record<'_>, _: &slog::OwnedKVList) -> Result<(), slog::Never> {
        match record.level() {
            slog::Level::Critical | slog::Level::Error => tracing::error!(target: "raft", "{}", record.msg()),
            slog::Level::Warning => tracing::warn!(target: "raft", "{}", record.msg()),
            slog::Level::Info => tracing::info!(target: "raft", "{}", record.msg()),
            _ => tracing::trace!(target: "raft", "{}", record.msg()),
        }
        Ok(())
    }
}

pub(crate) fn logger() -> slog::Logger {
    slog::Logger::root(TracingDrain, slog::o!())
}
