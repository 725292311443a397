//! `brigade`: the one binary. clap arguments become validated configuration, then library calls.
//!
//! Exit codes: 0 success, 1 any runtime error (bad model file, unavailable device, …), 2 usage.

mod bench;
mod cluster;
mod cluster_bench;
mod common;
mod http_bench;
mod local;
mod plan;
mod run;
mod serve;
mod synth;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "brigade",
    version,
    about = "Run language models too large for one device by splitting their layers across the devices at hand"
)]
struct Cli {
    /// Log filter (also RUST_LOG), for example `info` or `brigade_model=debug`.
    #[arg(long, global = true, default_value = "warn")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text on this box (CPU, or CPU + GPU split by layers).
    Run(run::RunArgs),
    /// Serve the OpenAI API on this box, decoding concurrent requests together.
    Serve(serve::ServeArgs),
    /// Measure prompt and generation speed, llama-bench style, over a sweep of GPU layers.
    Bench(bench::BenchArgs),
    /// Write a random-weight model of any Llama shape (GGUF or safetensors).
    Synth(synth::SynthArgs),
    /// Place a model's layers on a cluster's devices (what-if; nothing is loaded).
    Plan(plan::PlanArgs),
    /// Run a cluster's coordinator: admission, placement, assignments, the client API.
    Coordinator(cluster::CoordinatorArgs),
    /// Run a worker on this node: join a cluster, host the layers it is assigned.
    Worker(cluster::WorkerArgs),
    /// Deploy a model on a cluster (the planner places it unless --device-map says how).
    Deploy(cluster::DeployArgs),
    /// Remove a deployment from a cluster.
    Undeploy(cluster::UndeployArgs),
    /// Generate text with a model deployed on a cluster.
    Generate(cluster::GenerateArgs),
    /// A cluster's nodes, their measured figures, links and deployments.
    Status(cluster::StatusArgs),
    /// Clusters on this machine (`cluster local`).
    Cluster(local::ClusterArgs),
}

/// llama.cpp spells some options with one dash and several letters (`-ngl 8`); clap's short
/// options are single letters, so those are rewritten to their long names first.
fn rewrite_llama_cpp_flags(args: impl Iterator<Item = String>) -> Vec<String> {
    args.map(|a| {
        {
            let (short, long) = ("-ngl", "--n-gpu-layers");
            if a == short {
                return long.to_string();
            }
            if let Some(v) = a.strip_prefix(short).and_then(|r| r.strip_prefix('=')) {
                return format!("{long}={v}");
            }
        }
        a
    })
    .collect()
}

/// Sets the compute thread count before candle's pools start. Always set: without
/// `RAYON_NUM_THREADS`, candle asks `num_cpus` for the physical core count on every parallel op,
/// and that reads /proc/cpuinfo each time (measured: 10x slower decode on a small model).
fn set_threads(args: &[String]) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads().to_string();
        std::env::set_var("RAYON_NUM_THREADS", &n);
        std::env::set_var("CANDLE_NUM_THREADS", &n);
    }
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let v = if a == "-t" || a == "--threads" {
            it.next().cloned()
        } else {
            a.strip_prefix("--threads=").map(str::to_string)
        };
        if let Some(v) = v {
            // bench accepts a list; the first value sizes the pool
            if let Some(n) = v.split(',').next().and_then(|n| n.trim().parse::<usize>().ok()).filter(|&n| n > 0) {
                std::env::set_var("RAYON_NUM_THREADS", n.to_string());
                std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
            }
        }
    }
}

/// mimalloc: candle allocates every intermediate tensor afresh; glibc maps and unmaps the large
/// ones each time (a page fault per 4 KiB, 7% of a 500-token prompt), mimalloc keeps them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args = rewrite_llama_cpp_flags(std::env::args());
    set_threads(&args);
    let cli = Cli::parse_from(&args);
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| cli.log.clone());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.cmd {
        Cmd::Run(a) => run::run(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Synth(a) => synth::synth(a),
        Cmd::Plan(a) => plan::run_plan(a),
        Cmd::Coordinator(a) => cluster::coordinator(a),
        Cmd::Worker(a) => cluster::worker(a),
        Cmd::Deploy(a) => cluster::deploy(a),
        Cmd::Undeploy(a) => cluster::undeploy(a),
        Cmd::Generate(a) => cluster::generate(a),
        Cmd::Status(a) => cluster::status(a),
        Cmd::Cluster(a) => match a.cmd {
            local::ClusterCmd::Local(l) => local::local(l),
        },
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngl_is_rewritten() {
        let v = rewrite_llama_cpp_flags(
            ["brigade", "run", "-ngl", "8", "-ngl=auto", "-n", "5"].iter().map(|s| s.to_string()),
        );
        assert_eq!(v, ["brigade", "run", "--n-gpu-layers", "8", "--n-gpu-layers=auto", "-n", "5"]);
    }
}
