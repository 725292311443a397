//! brigade's deterministic test layer (dev-only), between the pure unit tests and the tests that
//! start real processes: the cluster's sans-IO cores driven in one thread on a virtual clock
//! over a seeded, faulty in-memory network, with checkers for what clients saw. A run is a
//! function of its seed: a failing seed reproduces (`BRIGADE_SEED=N`), and a thousand seeds run
//! in CI time.
//!
//! - [`net`]: the virtual network (loss, duplication, delay and reordering, partitions).
//! - [`history`]: what clients saw, and the check that it is linearizable.
//! - [`control`]: the coordinator's control plane — its raft replicas, with their logs on disk
//!   — under kills, restarts, pauses, partitions and bad weather.

#![forbid(unsafe_code)]

pub mod control;
pub mod fleet;
pub mod history;
pub mod net;
