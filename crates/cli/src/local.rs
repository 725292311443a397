//! `brigade cluster local`: a coordinator and N workers on this machine, as separate processes
//! talking over loopback sockets with TLS — the real cluster, not an imitation — with a model
//! deployed across all of them and a client config written, so that `brigade generate` works next.

use crate::cluster::{runtime, stop_signal};
use anyhow::{bail, Context, Result};
use brigade_sdk::{CarrierKind, DeployParams, DeploymentState, NodeState};
use brigade_sdk::{Client, ClientConfig};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct ClusterArgs {
    #[command(subcommand)]
    pub cmd: ClusterCmd,
}

#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// A coordinator and N workers on this machine, with a model deployed across them.
    Local(LocalArgs),
}

#[derive(Args, Debug)]
pub struct LocalArgs {
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Model to deploy across them (default: the small model built into brigade).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The deployment's name (default: `stories` for the built-in model, else the file's stem).
    #[arg(long)]
    pub name: Option<String>,
    /// Where the processes keep their data and logs (default: a fresh folder under the temp dir).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Coordinator address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: std::net::SocketAddr,
    /// Compute threads per worker.
    #[arg(short = 't', long = "threads", default_value_t = 1)]
    pub threads: usize,
    /// How activations travel between the workers.
    #[arg(long, default_value = "quic", value_parser = ["quic", "grpc"])]
    pub transport: String,
    /// How thoroughly each worker measures its kernels (quick: a fraction of a second).
    #[arg(long, default_value = "quick", value_parser = ["quick", "full"])]
    pub measure: String,
    /// Where to write the client config (default: BRIGADE_CONFIG or ~/.config/brigade/client.toml).
    #[arg(long)]
    pub client_config: Option<PathBuf>,
    /// Start, deploy, print, and exit leaving the processes running (their PIDs are printed).
    #[arg(long)]
    pub detach: bool,
    /// Also serve the OpenAI-compatible HTTP API on the coordinator at this address (port 0: a
    /// free one, printed).
    #[arg(long)]
    pub http: Option<std::net::SocketAddr>,
}

/// Children killed when this process ends, however it ends.
struct Children(Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
        }
        for (_, c) in &mut self.0 {
            let _ = c.wait();
        }
    }
}

#[allow(unsafe_code)]
fn spawn(name: &str, args: &[String], log: &Path, detach: bool) -> Result<Child> {
    let exe = std::env::current_exe().context("finding the brigade binary")?;
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err).env_remove("BRIGADE_JOIN_TOKEN");
    if !detach {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to signal the child when
        // this process dies, so a killed `cluster local` leaves no orphans
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
    }
    cmd.spawn().with_context(|| format!("starting {name}"))
}

fn wait_file(p: &Path, child: &mut Child, what: &str, log: &Path) -> Result<String> {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(p) {
            if !s.trim().is_empty() {
                return Ok(s.trim().to_string());
            }
        }
        if let Ok(Some(st)) = child.try_wait() {
            bail!(
                "{what} exited ({st}); its log {}:\n{}",
                log.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("{what} did not start in 60 s; its log is {}", log.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An even split of `n_layers` over `workers` nodes named w1..wN, as a device map.
pub fn even_map(n_layers: usize, workers: usize) -> String {
    let base = n_layers / workers;
    let extra = n_layers % workers;
    (0..workers).map(|i| format!("w{}:cpu:{}", i + 1, base + usize::from(i < extra))).collect::<Vec<_>>().join(",")
}

pub fn local(a: LocalArgs) -> Result<()> {
    if a.workers == 0 || a.workers > 64 {
        bail!("--workers {}: 1 to 64", a.workers);
    }
    let (model_arg, n_layers, default_name) = match &a.model {
        None => {
            let f = brigade_model::ModelFiles::from_static_gguf(
                brigade_model::embedded_model(),
                brigade_model::EMBEDDED_MODEL_NAME,
            )?;
            ("embedded".to_string(), f.config.n_layers, "stories".to_string())
        }
        Some(p) => {
            let f = brigade_model::ModelFiles::open(p).with_context(|| format!("cannot load model {}", p.display()))?;
            let abs = std::fs::canonicalize(p)?;
            let stem = p.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "model".into());
            let stem: String =
                stem.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '-' }).collect();
            (abs.display().to_string(), f.config.n_layers, stem)
        }
    };
    if a.workers > n_layers {
        bail!("--workers {}: the model has only {n_layers} layers to share", a.workers);
    }
    let name = a.name.clone().unwrap_or(default_name);
    let dir = match &a.data_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("brigade-local-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let token = brigade_transport::join::new_join_token();
    let mut children = Children(Vec::new());
    let cdir = dir.join("coordinator");
    let _ = std::fs::remove_file(cdir.join("coordinator.addr"));
    let clog = dir.join("coordinator.log");
    let coord_args: Vec<String> = vec![
        "coordinator".into(),
        "--listen".into(),
        a.listen.to_string(),
        "--data-dir".into(),
        cdir.display().to_string(),
        "--join-token".into(),
        token.clone(),
    ];
    let mut coord_args = coord_args;
    if let Some(h) = a.http {
        let _ = std::fs::remove_file(cdir.join("coordinator.http.addr"));
        coord_args.extend(["--http".into(), h.to_string()]);
    }
    children.0.push(("coordinator".into(), spawn("the coordinator", &coord_args, &clog, a.detach)?));
    let addr = {
        let (_, c) = children.0.last_mut().context("no coordinator")?;
        wait_file(&cdir.join("coordinator.addr"), c, "the coordinator", &clog)?
    };
    for i in 1..=a.workers {
        let w = format!("w{i}");
        let wdir = dir.join(&w);
        let args: Vec<String> = vec![
            "worker".into(),
            "--coordinator".into(),
            addr.clone(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--name".into(),
            w.clone(),
            "--join-token".into(),
            token.clone(),
            "--data-dir".into(),
            wdir.display().to_string(),
            "--models-dir".into(),
            wdir.join("models").display().to_string(),
            "-t".into(),
            a.threads.to_string(),
            "--measure".into(),
            a.measure.clone(),
        ];
        let log = dir.join(format!("{w}.log"));
        children.0.push((w.clone(), spawn(&w, &args, &log, a.detach)?));
    }
    let ca = cdir.join("ca.pem");
    let cfg_path = a.client_config.clone().or_else(ClientConfig::default_path);
    let rt = runtime()?;
    rt.block_on(async {
        let cfg = ClientConfig { endpoints: vec![addr.clone()], ca_pem: std::fs::read_to_string(&ca)?, api_key: None };
        let mut client = Client::connect(cfg).await?;
        let t0 = Instant::now();
        loop {
            let s = client.status().await?;
            let up = s.nodes.iter().filter(|n| n.state == NodeState::Up).count();
            if up >= a.workers {
                break;
            }
            for (n, c) in children.0.iter_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    let log = dir.join(format!("{n}.log"));
                    bail!(
                        "{n} exited ({st}); its log {}:\n{}",
                        log.display(),
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
            }
            if t0.elapsed() > Duration::from_secs(120) {
                bail!("{up} of {} workers registered in 120 s; logs are in {}", a.workers, dir.display());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let req = DeployParams {
            device_map: even_map(n_layers, a.workers),
            sessions: 16,
            carrier: if a.transport == "grpc" { CarrierKind::Grpc } else { CarrierKind::Quic },
            wait_s: 600,
            ..DeployParams::new(&name, &model_arg)
        };
        let d = client.deploy(&req).await?;
        if d.state != DeploymentState::Ready {
            bail!("deploying {name}: {} {}; logs are in {}", d.state, d.error, dir.display());
        }
        print!("{}", d.plan_text);
        anyhow::Ok(())
    })?;
    if let Some(p) = &cfg_path {
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(p, format!("coordinator = \"{addr}\"\nca = \"{}\"\n", ca.display()))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    println!(
        "\ncluster ready: coordinator at {addr}, {} workers, `{name}` deployed across them (data and logs in {})",
        a.workers,
        dir.display()
    );
    if a.http.is_some() {
        let http = std::fs::read_to_string(cdir.join("coordinator.http.addr")).unwrap_or_default();
        println!("OpenAI-compatible API: http://{}/v1 (model `{name}`)", http.trim());
    }
    match &cfg_path {
        Some(p) => {
            println!("client config: {}\ntry:  brigade generate --model {name} -p \"Once upon a time\"", p.display())
        }
        None => println!(
            "try:  brigade generate --coordinator {addr} --ca {} --model {name} -p \"Once upon a time\"",
            ca.display()
        ),
    }
    if a.detach {
        let pids: Vec<String> = children.0.iter().map(|(n, c)| format!("{n}={}", c.id())).collect();
        println!("processes: {}", pids.join(" "));
        std::mem::forget(children);
        return Ok(());
    }
    println!("Ctrl-C stops the cluster.");
    rt.block_on(async {
        tokio::select! {
            _ = stop_signal() => {}
            _ = async {
                loop {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if children.0.iter_mut().any(|(_, c)| matches!(c.try_wait(), Ok(Some(_)))) {
                        break;
                    }
                }
            } => eprintln!("a cluster process exited; stopping the others (logs in {})", dir.display()),
        }
    });
    drop(children);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_maps_cover_every_layer() {
        assert_eq!(even_map(5, 3), "w1:cpu:2,w2:cpu:2,w3:cpu:1");
        assert_eq!(even_map(16, 2), "w1:cpu:8,w2:cpu:8");
        assert_eq!(even_map(3, 3), "w1:cpu:1,w2:cpu:1,w3:cpu:1");
    }
}
