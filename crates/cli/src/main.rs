//! `brigade`: the one binary. clap arguments become validated configuration, then library calls.
//!
//! Exit codes: 0 success, 1 any runtime error (bad model file, unavailable device, …), 2 usage.
//!
//! # Layout
//! - this file: the subcommands, llama.cpp's `-ngl` spelling (for `run`, `bench`, `serve`), the
//!   process's compute threads from the subcommand's `-t`;
//! - `run`, `bench` (+ `bench_report`), `plan`, `synth`, `doctor`: this box;
//! - `common`: what they share (models, placements, llama.cpp's `-c`/`-n`), `machine`: this box
//!   measured, as the planner sees it;
//! - `cluster`, `cluster_bench`, `local`: cluster mode.
//!
//! Deliberately absent: tensors (candle is reached only through `brigade-model`) and any
//! placement logic of its own (the planner places, with measured figures).
#![deny(unsafe_code)] // three start-up calls below allow it: process set-up, not kernels

mod bench;
mod bench_report;
mod cluster;
mod cluster_bench;
mod common;
mod doctor;
mod http_bench;
mod local;
mod machine;
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
    /// Place a model's layers on this box or a cluster's devices (what-if; nothing is loaded).
    Plan(plan::PlanArgs),
    /// This machine as brigade sees it: CPU, kernels, memory, bandwidth, GPUs, CUDA libraries.
    Doctor(doctor::DoctorArgs),
    /// Run a cluster's coordinator: admission, placement, assignments, the client API.
    Coordinator(Box<cluster::CoordinatorArgs>),
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

/// The subcommands that take llama.cpp's `-ngl`.
const TAKES_NGL: [&str; 3] = ["run", "bench", "serve"];

/// The index of the subcommand in `args` (the first word after the program and its global
/// options; `--log` is the one that takes a value).
fn subcommand_index(args: &[String]) -> Option<usize> {
    let mut i = 1;
    while let Some(a) = args.get(i) {
        if a == "--log" {
            i += 2;
        } else if a.starts_with('-') {
            i += 1;
        } else {
            return Some(i);
        }
    }
    None
}

/// llama.cpp spells some options with one dash and several letters (`-ngl 8`); clap's short
/// options are single letters, so those are rewritten to their long names first, for the
/// subcommands that take them only (elsewhere `-ngl` stays an error).
fn rewrite_llama_cpp_flags(args: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut args: Vec<String> = args.into_iter().collect();
    let Some(sub) = subcommand_index(&args) else {
        return args;
    };
    if !TAKES_NGL.contains(&args[sub].as_str()) {
        return args;
    }
    let (short, long) = ("-ngl", "--n-gpu-layers");
    for a in &mut args[sub + 1..] {
        if a == short {
            *a = long.to_string();
        } else if let Some(v) = a.strip_prefix(short).and_then(|r| r.strip_prefix('=')) {
            *a = format!("{long}={v}");
        }
    }
    args
}

/// The `-t` of the subcommand, for the subcommands that compute here (`bench` with several
/// counts runs each in a child process and computes nothing itself).
fn requested_threads(cmd: &Cmd) -> Option<i64> {
    match cmd {
        Cmd::Run(a) => a.common.threads,
        Cmd::Bench(a) if a.threads.len() == 1 => a.threads.first().copied(),
        Cmd::Doctor(a) => a.threads,
        Cmd::Serve(a) => a.common.threads,
        Cmd::Worker(a) => a.threads.map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
        _ => None,
    }
}

/// mimalloc: candle allocates every intermediate tensor afresh; glibc maps and unmaps the large
/// ones each time (a page fault per 4 KiB, 7% of a 500-token prompt), mimalloc keeps them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc's v2 and v3 headers (the Rust bindings do not name it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Lets mimalloc keep freed memory for a second before it gives it back to the system (its
/// default is 10 ms): a prompt chunk's attention scores (33 MB a layer for 512 tokens on a
/// 1B model) are freed and allocated again layer after layer, and each time the pages came back
/// mapped afresh and cleared by the kernel — pp512 175–177 t/s with the default, 195–205 with
/// the pages kept (llama-1b q4_k, 2 threads, AMD EPYC AVX-512). Memory a pass no longer uses is
/// still returned once the process idles. `MIMALLOC_PURGE_DELAY` in the environment wins.
#[allow(unsafe_code)]
fn keep_freed_memory_briefly() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: reading and setting a mimalloc option; the value is only used if the option at
    // that index has the purge delay's documented default, so a renumbered enum changes nothing
    unsafe {
        if libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) == 10 {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 1000);
        }
    }
}

#[allow(unsafe_code)]
fn main() {
    keep_freed_memory_briefly();
    let args = rewrite_llama_cpp_flags(std::env::args());
    let cli = Cli::parse_from(&args);
    match brigade_model::threads::resolve(requested_threads(&cli.cmd)) {
        // SAFETY: nothing but this thread runs yet (clap spawns none, the pools start later).
        Ok(n) => unsafe { brigade_model::threads::set_for_process(n) },
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
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
        Cmd::Doctor(a) => doctor::doctor(a),
        Cmd::Coordinator(a) => cluster::coordinator(*a),
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

    fn argv(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn ngl_is_rewritten_for_the_subcommands_that_take_it() {
        let v = rewrite_llama_cpp_flags(argv(&["brigade", "run", "-ngl", "8", "-ngl=auto", "-n", "5"]));
        assert_eq!(v, ["brigade", "run", "--n-gpu-layers", "8", "--n-gpu-layers=auto", "-n", "5"]);
        let v = rewrite_llama_cpp_flags(argv(&["brigade", "--log", "info", "bench", "-ngl", "0,4"]));
        assert_eq!(v, ["brigade", "--log", "info", "bench", "--n-gpu-layers", "0,4"]);
        // other subcommands keep it, and clap refuses it there
        for sub in ["plan", "generate", "worker", "doctor"] {
            let v = rewrite_llama_cpp_flags(argv(&["brigade", sub, "-ngl", "8"]));
            assert_eq!(v[2], "-ngl", "{sub}");
        }
        assert!(Cli::try_parse_from(rewrite_llama_cpp_flags(argv(&["brigade", "doctor", "-ngl", "8"]))).is_err());
        // a prompt that happens to be `-ngl` after a value-taking global option is left alone
        let v = rewrite_llama_cpp_flags(argv(&["brigade", "--log", "run"]));
        assert_eq!(v, ["brigade", "--log", "run"]);
    }

    #[test]
    fn threads_come_from_the_subcommand() {
        let t = |a: &[&str]| requested_threads(&Cli::try_parse_from(rewrite_llama_cpp_flags(argv(a))).unwrap().cmd);
        assert_eq!(t(&["brigade", "run", "-t", "3"]), Some(3));
        assert_eq!(t(&["brigade", "run", "-t", "0"]), Some(0));
        assert_eq!(t(&["brigade", "run", "-t", "-1"]), Some(-1));
        assert_eq!(t(&["brigade", "run"]), None);
        assert_eq!(t(&["brigade", "bench", "-t", "2"]), Some(2));
        assert_eq!(t(&["brigade", "bench", "-t", "1,2"]), None, "a sweep computes in child processes");
        // `plan` has no -t: a `-t` there is a usage error, not a silent thread count
        assert!(Cli::try_parse_from(argv(&["brigade", "plan", "-t", "4", "--shape", "llama-1b"])).is_err());
    }
}
