//! What this node computes with, measured by [`brigade_model::measure`] (the CLI's `-ngl auto`,
//! `plan` and `doctor` measure the same way): the CPU's read bandwidth and, per weight type,
//! brigade's own kernels; cached in the worker's data dir.

pub use brigade_model::measure::{cpu_features, measure_cpu, type_name, Effort};
