//! brigade's coordinator: the control plane of a cluster.
//!
//! It admits workers that know the join token and issues their certificates, keeps the cluster
//! state (nodes, what they measured, links, models, deployments) durable in its data dir, places
//! deployments with `brigade-planner` from the workers' own measurements, streams each worker its
//! assignments, and serves the client API — relaying each session's events from the worker that
//! drives it, never sitting on the token loop itself.
//!
//! # Layout
//! - [`raft`]: the replicated log (raft-rs, redb): every change is a `Command` applied by
//!   `brigade_core::cluster::ClusterState::apply` on every replica, durable before it is
//!   acknowledged; a single coordinator is a group of one. [`raft_service`]: raft messages
//!   between replicas and new replicas joining.
//! - [`reconcile`]: the leader's decisions, pure — liveness checks, re-placement of a dead node's
//!   stages, rebalancing — as `Reconciler::step(now, &state, &liveness) -> Vec<Action>`;
//!   [`recover`]: the loop that drives it (reads, replicates, logs).
//! - [`pki`]: the cluster CA, the join token, the coordinator's certificate.
//! - [`models`]: models opened through `brigade-format`, their manifests, their bytes for fetches.
//! - [`placement`]: the planner's inventory from measured figures; planned or hand-given maps.
//! - [`assign`]: what each node must host, as the `Watch` stream sends it.
//! - [`control`]: the `Control` service workers call.
//! - [`client`]: the `Client` service users call; sessions relayed from their drivers.
//! - [`shared`]: what the services and the leader's loop share (configuration, the raft handle,
//!   soft state from heartbeats, measured figures, channels to workers); it imports none of them.
//! - [`server`]: the gRPC server (TLS, reflection, health) and the background tasks: it wires the
//!   services to [`shared::Shared`].
//! - [`http`]: the OpenAI-compatible HTTP API (`brigade-serve`'s server) over the deployments.
//!
//! Deliberately lacking: candle (a `cargo tree` test checks it), any model computation, and
//! sessions' state (it lives on the workers).

#![forbid(unsafe_code)]

pub mod assign;
pub mod client;
pub mod control;
mod error;
pub mod http;
pub mod models;
pub mod pki;
pub mod placement;
pub mod raft;
pub mod raft_service;
pub mod reconcile;
pub mod recover;
pub mod server;
pub mod shared;

pub use error::CoordError;
pub use server::run;
pub use shared::{CoordinatorConfig, LEADER_METADATA_KEY};
