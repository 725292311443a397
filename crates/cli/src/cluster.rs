//! Cluster mode from the command line: `coordinator` and `worker` (the two long-running
//! processes), and the clients `deploy`, `undeploy`, `generate`, `status`.

use crate::common::SamplingArgs;
use anyhow::{bail, Context, Result};
use brigade_sdk::{ActDtype, CarrierKind, DeployParams, Deployment, DeploymentState};
use brigade_sdk::{Client, ClientConfig, Event, GenerateParams};
use clap::Args;
use serde::Serialize;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Resolves when the process is asked to stop (Ctrl-C or SIGTERM).
pub async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// A size with an optional unit: `512MiB`, `2 GiB`, `1.5GB`, `1000000`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    brigade_planner::units::bytes("--memory", s).map_err(|e| e.to_string())
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct CoordinatorArgs {
    #[command(subcommand)]
    pub cmd: Option<CoordinatorCmd>,
    #[command(flatten)]
    pub replica: ReplicaArgs,
}

#[derive(clap::Subcommand, Debug)]
pub enum CoordinatorCmd {
    /// Create a cluster's CA and join token in a data dir (to copy into every replica's data dir
    /// before bootstrapping a group with --peers); prints the token.
    Init {
        #[arg(long)]
        data_dir: PathBuf,
        #[command(flatten)]
        token: TokenArgs,
    },
    /// Run a new replica that joins a running group through one of its replicas.
    Join {
        /// A replica of the group, host:port.
        #[arg(long)]
        via: String,
        /// The group's replica secret: the `replica-token` file of a replica's data dir (the
        /// workers' join token does not admit replicas).
        #[arg(long, env = "BRIGADE_REPLICA_TOKEN_FILE")]
        replica_token_file: PathBuf,
        #[command(flatten)]
        replica: Box<ReplicaArgs>,
    },
    /// Remove a replica from the group.
    Leave {
        #[command(flatten)]
        connect: Connect,
        /// The replica's id.
        #[arg(long)]
        id: u64,
    },
}

#[derive(Args, Debug)]
pub struct ReplicaArgs {
    /// Address to serve workers, clients and other replicas on (gRPC over TLS).
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Where the cluster's CA, join token and raft log live (created on first start).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[command(flatten)]
    pub token: TokenArgs,
    /// Start a new cluster although this data dir held a raft log that is now empty or gone
    /// (every node, model and deployment it knew is forgotten).
    #[arg(long)]
    pub force_new_cluster: bool,
    /// Extra names or IPs for the coordinator's certificate (what tools like grpcurl connect to).
    #[arg(long = "san")]
    pub sans: Vec<String>,
    /// API keys clients must present (`authorization: Bearer KEY`); repeatable. Without
    /// --admin-key they may also deploy; with it, they may only generate, chat and read status.
    #[arg(long = "api-key", env = "BRIGADE_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// Files of API keys, one per line (out of `ps`' sight); repeatable.
    #[arg(long = "api-key-file", env = "BRIGADE_API_KEY_FILE", value_delimiter = ',')]
    pub api_key_files: Vec<PathBuf>,
    /// Keys that may also deploy, undeploy, plan and remove replicas; repeatable.
    #[arg(long = "admin-key", env = "BRIGADE_ADMIN_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub admin_keys: Vec<String>,
    /// Files of admin keys, one per line; repeatable.
    #[arg(long = "admin-key-file", env = "BRIGADE_ADMIN_KEY_FILE", value_delimiter = ',')]
    pub admin_key_files: Vec<PathBuf>,
    /// Require an API key for the HTTP dashboard (`/`) and `/metrics` too (`/health` stays open).
    #[arg(long)]
    pub protect_metrics: bool,
    /// `deploy -m` may name only files under this directory (relative paths are taken from it).
    /// Without it, any file the coordinator can read may be deployed by a caller with an admin key.
    #[arg(long, env = "BRIGADE_MODELS_DIR")]
    pub models_dir: Option<PathBuf>,
    /// Seconds of silence after which a worker is marked down (and its layers re-placed).
    #[arg(long, default_value_t = 3.0)]
    pub node_timeout: f64,
    /// This replica's raft id (unique in its group).
    #[arg(long, default_value_t = 1)]
    pub id: u64,
    /// The replicas of a group bootstrapped together, this one included: 1=HOST:PORT,2=…,3=…
    #[arg(long)]
    pub peers: Option<String>,
    /// The address other replicas and workers reach this one at (default: --listen).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Milliseconds of one raft tick (elections take 10 to 20 ticks).
    #[arg(long, default_value_t = 100)]
    pub raft_tick_ms: u64,
    /// Also serve the OpenAI-compatible HTTP API (as `brigade serve`) for every deployment, on
    /// this address (plain HTTP; port 0 picks one, written to coordinator.http.addr in the data
    /// dir). The same --api-key keys apply.
    #[arg(long)]
    pub http: Option<SocketAddr>,
}

/// The join token, from the command line, the environment or a file (a file keeps it out of
/// `ps` and of the environment).
#[derive(Args, Debug)]
pub struct TokenArgs {
    /// The join token workers present (default: generated on first start and printed once).
    /// Visible to other users in `ps`: prefer --join-token-file.
    #[arg(long, env = "BRIGADE_JOIN_TOKEN", hide_env_values = true, conflicts_with = "join_token_file")]
    pub join_token: Option<String>,
    /// A file holding the join token (first line).
    #[arg(long, env = "BRIGADE_JOIN_TOKEN_FILE")]
    pub join_token_file: Option<PathBuf>,
}

impl TokenArgs {
    pub fn resolve(self) -> Result<Option<String>> {
        match (self.join_token, self.join_token_file) {
            (Some(t), _) => Ok(Some(t)),
            (None, Some(p)) => Ok(Some(read_secret_file(&p)?)),
            (None, None) => Ok(None),
        }
    }
}

/// The first line of a secret file, trimmed; a clear error for a missing or empty one, never
/// its bytes in a message, and no unbounded read.
fn read_secret_file(p: &std::path::Path) -> Result<String> {
    let text = read_bounded_text(p, 4096)?;
    let line = text.lines().next().unwrap_or("").trim().to_string();
    if line.is_empty() {
        bail!("{} is empty: it should hold a token (`brg1-…`)", p.display());
    }
    Ok(line)
}

/// At most `limit` bytes of a text file (never its bytes in an error).
fn read_bounded_text(p: &std::path::Path, limit: u64) -> Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(p).with_context(|| format!("reading {}", p.display()))?;
    let mut text = String::new();
    f.take(limit).read_to_string(&mut text).with_context(|| format!("reading {}: not a text file", p.display()))?;
    Ok(text)
}

/// The keys given on the command line (or in the environment) and those in `files`: one key per
/// line, blank lines and `#` comments skipped; a file holding none is an error.
pub(crate) fn api_keys(given: Vec<String>, files: &[PathBuf]) -> Result<Vec<String>> {
    let mut keys: Vec<String> = given.into_iter().filter(|k| !k.is_empty()).collect();
    for p in files {
        let text = read_bounded_text(p, 64 << 10)?;
        let before = keys.len();
        keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_string));
        if keys.len() == before {
            bail!("{} holds no key (one per line)", p.display());
        }
    }
    Ok(keys)
}

fn coordinator_config(a: ReplicaArgs, join: Option<String>) -> Result<brigade_coordinator::CoordinatorConfig> {
    if !(a.node_timeout.is_finite() && a.node_timeout > 0.2) {
        bail!("--node-timeout {}: at least 0.2 s", a.node_timeout);
    }
    if !(10..=5000).contains(&a.raft_tick_ms) {
        bail!("--raft-tick-ms {}: 10 to 5000", a.raft_tick_ms);
    }
    let Some(data_dir) = a.data_dir else { bail!("--data-dir is required") };
    let peers = match &a.peers {
        Some(p) => brigade_coordinator::raft_service::parse_peers(p)?,
        None => Default::default(),
    };
    if !peers.is_empty() && !peers.contains_key(&a.id) {
        bail!("--peers does not name this replica's --id {}", a.id);
    }
    let advertise = a.advertise.or_else(|| peers.get(&a.id).cloned());
    Ok(brigade_coordinator::CoordinatorConfig {
        data_dir,
        join_token: a.token.resolve()?,
        force_new_cluster: a.force_new_cluster,
        sans: a.sans,
        node_timeout: Duration::from_secs_f64(a.node_timeout),
        heartbeat_interval: Duration::from_secs_f64((a.node_timeout / 4.0).clamp(0.1, 1.0)),
        keys: brigade_serve::ApiKeys::new(
            &api_keys(a.api_keys, &a.api_key_files)?,
            &api_keys(a.admin_keys, &a.admin_key_files)?,
        ),
        protect_metrics: a.protect_metrics,
        models_dir: a.models_dir,
        id: a.id,
        peers,
        advertise,
        join,
        raft_tick: Duration::from_millis(a.raft_tick_ms),
        http: a.http,
        ..Default::default()
    })
}

fn run_replica(listen: SocketAddr, cfg: brigade_coordinator::CoordinatorConfig) -> Result<()> {
    let rt = runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
        brigade_coordinator::run(cfg, listener, stop_signal()).await?;
        Ok(())
    })
}

pub fn coordinator(a: CoordinatorArgs) -> Result<()> {
    match a.cmd {
        None => {
            let listen = a.replica.listen;
            run_replica(listen, coordinator_config(a.replica, None)?)
        }
        Some(CoordinatorCmd::Join { via, replica_token_file, replica }) => {
            let listen = replica.listen;
            let secret = read_secret_file(&replica_token_file)?;
            let cfg = coordinator_config(*replica, Some(via))?;
            run_replica(listen, brigade_coordinator::CoordinatorConfig { replica_secret: Some(secret), ..cfg })
        }
        Some(CoordinatorCmd::Init { data_dir, token }) => {
            let token = token.resolve()?;
            let o = brigade_coordinator::pki::Pki::load_or_create(&data_dir, token.as_deref(), &[], false)?;
            let files = "copy ca.pem, ca.key, token and replica-token into the data dir of every replica of the group; workers need the token only, and replica-token (what admits new replicas and opens the CA key) stays with the replicas";
            match o.new_token {
                Some(t) => println!(
                    "cluster CA and join token created in {}; the token (shown once):\n\n    {t}\n\n{files}",
                    data_dir.display()
                ),
                None if o.new_replica_secret => {
                    println!(
                        "{} already holds a cluster CA and token; replica-token created. {files}",
                        data_dir.display()
                    )
                }
                None => println!("{} already holds a cluster CA and token", data_dir.display()),
            }
            Ok(())
        }
        Some(CoordinatorCmd::Leave { connect, id }) => runtime()?.block_on(async move {
            // any replica but the one leaving takes the request
            let cfg = ClientConfig::resolve(
                connect.coordinator.as_deref(),
                connect.ca.as_deref(),
                connect.api_key.as_deref(),
            )?;
            let mut last = None;
            for addr in &cfg.endpoints {
                let one = ClientConfig { endpoints: vec![addr.clone()], ..cfg.clone() };
                let Ok(mut c) = Client::connect(one).await else { continue };
                match c.remove_replica(id).await {
                    Ok(peers) => {
                        println!("replica {id} left the group; the group is now {}", peers.join(", "));
                        return Ok(());
                    }
                    Err(e) => last = Some(e),
                }
            }
            match last {
                Some(e) => Err(e.into()),
                None => bail!("no replica of the group answered"),
            }
        }),
    }
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The coordinator replicas, host:port, comma separated (the worker follows the leader).
    #[arg(long)]
    pub coordinator: String,
    /// Address for QUIC (UDP) and gRPC (TCP) from peers; port 0 picks a free one.
    #[arg(long, default_value = "0.0.0.0:7071")]
    pub listen: SocketAddr,
    /// The address peers reach this node at (needed when listening on 0.0.0.0).
    #[arg(long)]
    pub advertise: Option<String>,
    /// This node's name in the cluster.
    #[arg(long)]
    pub name: String,
    /// The cluster's join token (needed on the first start only).
    #[command(flatten)]
    pub token: TokenArgs,
    /// Where model files are (a full copy is used in place) and fetched slices are cached.
    #[arg(long)]
    pub models_dir: Option<PathBuf>,
    /// Where this node's certificate, key and measured figures live.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Compute threads.
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Memory this node offers for slices (e.g. `8GiB`); default: what is available.
    #[arg(long, value_parser = parse_size)]
    pub memory: Option<u64>,
    /// The devices to offer: `all` (the CPU and every CUDA device), or names such as
    /// `cpu,cuda0` (`cuda0` alone keeps the CPU out of placement).
    #[arg(long, default_value = "all")]
    pub devices: String,
    /// Memory each GPU offers for slices (e.g. `20GiB`); default: what it has free.
    #[arg(long, value_parser = parse_size)]
    pub gpu_memory: Option<u64>,
    /// How thoroughly to measure the node's kernels: `full` (a few seconds, cached) or `quick`.
    #[arg(long, default_value = "full")]
    pub measure: brigade_worker::measure::Effort,
    /// Serve `/metrics` (Prometheus' text format: per stage compute, hop bytes, sessions, KV
    /// cache and weight bytes, heartbeat age) on this address; port 0 picks one (printed).
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
    /// Seconds after which a stage session that received no frame is ended and its KV cache
    /// freed (a driver that went away holds no slot for ever).
    #[arg(long, default_value_t = 120.0)]
    pub session_idle_s: f64,
    /// Speculative decoding of the sessions this node drives (prompt lookup).
    #[command(flatten)]
    pub spec: crate::common::LookupArgs,
}

fn home_dir(sub: &str) -> PathBuf {
    let base = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("brigade").join(sub)
}

pub fn worker(a: WorkerArgs) -> Result<()> {
    let data_dir = a.data_dir.unwrap_or_else(|| home_dir(&format!("worker-{}", a.name)));
    let models_dir = a.models_dir.unwrap_or_else(|| home_dir("models"));
    // main set this process's compute pools from -t
    let threads = brigade_model::threads::current();
    let cfg = brigade_worker::WorkerConfig {
        name: a.name,
        coordinator: a.coordinator,
        listen: a.listen,
        advertise: a.advertise,
        join_token: a.token.resolve()?,
        models_dir,
        data_dir,
        threads,
        memory: a.memory.unwrap_or(0),
        devices: brigade_worker::devices::parse_devices(&a.devices)?,
        gpu_memory: a.gpu_memory.unwrap_or(0),
        measure: a.measure,
        metrics: a.metrics,
        session_idle: Duration::from_secs_f64(a.session_idle_s.max(0.1)),
        drafting: a.spec.lookup()?,
    };
    let rt = runtime()?;
    rt.block_on(brigade_worker::run(cfg, stop_signal()))?;
    Ok(())
}

/// How a client command reaches the cluster.
#[derive(Args, Debug, Clone)]
pub struct Connect {
    /// Coordinator address(es), host:port, comma separated (default: BRIGADE_COORDINATOR, then the
    /// client config `brigade cluster local` writes).
    #[arg(long)]
    pub coordinator: Option<String>,
    /// The cluster CA to trust (the coordinator's data dir has ca.pem).
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// API key, if the coordinator requires one (also BRIGADE_API_KEY).
    #[arg(long = "api-key")]
    pub api_key: Option<String>,
}

impl Connect {
    pub async fn client(&self) -> Result<Client> {
        let cfg = ClientConfig::resolve(self.coordinator.as_deref(), self.ca.as_deref(), self.api_key.as_deref())?;
        Ok(Client::connect(cfg).await?)
    }
}

#[derive(Args, Debug)]
pub struct DeployArgs {
    #[command(flatten)]
    pub connect: Connect,
    /// The model: a path on the coordinator's machine, or `embedded`.
    #[arg(short = 'm', long = "model", default_value = "embedded")]
    pub model: String,
    /// The name clients use for this deployment.
    #[arg(long)]
    pub name: String,
    /// latency | throughput | max-context | energy
    #[arg(long, default_value = "latency")]
    pub objective: String,
    /// Context length (default: the model's, at most 4096).
    #[arg(short = 'c', long = "ctx")]
    pub ctx: Option<u32>,
    /// Concurrent sessions each stage holds a KV cache for.
    #[arg(long, default_value_t = 4)]
    pub sessions: u32,
    /// Place by hand: NODE:DEVICE:LAYERS,… (e.g. w1:cpu:3,w2:cpu:2); one entry may say `all`
    /// for the layers the others leave (gpu1:cuda0:all,edge1:cpu:8). For a mixture of experts,
    /// NODE:cpu:experts=A..B entries hold routed experts A..B-1 of every layer on that node,
    /// called by the layers' stages (w1:cpu:all,w2:cpu:experts=0..64,w3:cpu:experts=64..128).
    #[arg(long)]
    pub device_map: Option<String>,
    /// Element type of hidden states between stages.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    pub activation_dtype: String,
    /// How activations travel: quic, or grpc where UDP is blocked.
    #[arg(long, default_value = "quic", value_parser = ["quic", "grpc"])]
    pub transport: String,
    /// The node that drives sessions (default: the first stage's).
    #[arg(long)]
    pub driver: Option<String>,
    /// Share of each device's memory left free.
    #[arg(long, default_value_t = 0.10)]
    pub headroom: f64,
    /// Prompt tokens per chunk into the first stage (default: one chunk of 512 for one stage,
    /// chunks of 64 that overlap across several).
    #[arg(long, default_value_t = 0)]
    pub ubatch: u32,
    // split layers (each worker holds the experts of its layers below N in its RAM)
    #[command(flatten)]
    pub split: crate::common::SplitArgs,
    /// Seconds to wait for every stage to load (0: return at once).
    #[arg(long, default_value_t = 600)]
    pub wait: u32,
    /// Print the plan only; deploy nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn deploy_request(a: &DeployArgs) -> DeployParams {
    DeployParams {
        objective: a.objective.clone(),
        ctx: a.ctx.unwrap_or(0),
        device_map: a.device_map.clone().unwrap_or_default(),
        sessions: a.sessions,
        activation_dtype: match a.activation_dtype.as_str() {
            "f16" => ActDtype::F16,
            "bf16" => ActDtype::Bf16,
            _ => ActDtype::F32,
        },
        carrier: if a.transport == "grpc" { CarrierKind::Grpc } else { CarrierKind::Quic },
        driver: a.driver.clone().unwrap_or_default(),
        wait_s: a.wait,
        headroom: a.headroom,
        ubatch: a.ubatch,
        cpu_moe: a.split.layers().map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        // neither flag: the coordinator searches the split, as `plan` does
        cpu_moe_auto: a.split.layers().is_none(),
        ..DeployParams::new(&a.name, &a.model)
    }
}

fn print_deployment(d: &Deployment) {
    print!("{}", d.plan_text);
    println!("deployment `{}`: {} (generation {})", d.name, d.state, d.generation);
    for s in d.stages.iter().chain(&d.expert_stages) {
        println!(
            "  stage {} on {}/{} {}layers {}–{}: {}{}{}",
            s.index,
            s.node,
            s.device,
            s.experts.map(|(a, b)| format!("experts {a}..{b} of ")).unwrap_or_default(),
            s.layer_start,
            s.layer_end.saturating_sub(1),
            s.state,
            if s.fetched_bytes > 0 {
                format!(", fetched {}", crate::common::human_bytes(s.fetched_bytes))
            } else {
                String::new()
            },
            if s.error.is_empty() { String::new() } else { format!(": {}", s.error) }
        );
    }
}

pub fn deploy(a: DeployArgs) -> Result<()> {
    runtime()?.block_on(async move {
        let mut c = a.connect.client().await?;
        let req = deploy_request(&a);
        if a.dry_run {
            let p = c.plan(&req).await?;
            if a.json {
                println!("{}", p.json);
            } else {
                print!("{}", p.text);
            }
            return Ok(());
        }
        let d = c.deploy(&req).await?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&deployment_json(&d))?);
        } else {
            print_deployment(&d);
        }
        match d.state {
            DeploymentState::Ready => Ok(()),
            DeploymentState::Loading if a.wait == 0 => Ok(()),
            s => bail!(
                "deployment `{}` is {s}{}",
                d.name,
                if d.error.is_empty() { String::new() } else { format!(": {}", d.error) }
            ),
        }
    })
}

#[derive(Args, Debug)]
pub struct UndeployArgs {
    #[command(flatten)]
    pub connect: Connect,
    /// The deployment's name.
    pub name: String,
}

pub fn undeploy(a: UndeployArgs) -> Result<()> {
    runtime()?.block_on(async move {
        a.connect.client().await?.undeploy(&a.name).await?;
        println!("undeployed `{}`", a.name);
        Ok(())
    })
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub connect: Connect,
    /// The deployment to generate with.
    #[arg(long)]
    pub model: String,
    #[arg(short = 'p', long = "prompt", default_value = "")]
    pub prompt: String,
    /// Tokens to generate (-1: until end of text or a full context).
    #[arg(short = 'n', long = "n-predict", default_value_t = 128, allow_negative_numbers = true)]
    pub n_predict: i64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Treat the prompt as a user message and render the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long)]
    pub ignore_eos: bool,
    /// A stop string (repeatable): the answer ends before the earliest one found.
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// The answer is JSON valid under this schema (llama.cpp's `--json-schema`).
    #[arg(long = "json-schema", value_name = "SCHEMA", conflicts_with = "grammar_file")]
    pub json_schema: Option<String>,
    /// The answer follows this grammar, in llguidance's Lark syntax.
    #[arg(long = "grammar-file", value_name = "FILE")]
    pub grammar_file: Option<std::path::PathBuf>,
    /// One JSON object instead of streamed text (the fields of `brigade run --json`, plus `hops`).
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, Default)]
struct GenTimings {
    prompt_tokens: u32,
    prompt_ms: f64,
    prompt_tokens_per_s: f64,
    generated_tokens: u32,
    generation_ms: f64,
    generation_tokens_per_s: f64,
    ttft_ms: f64,
    decode_passes: u32,
    drafted_tokens: u32,
    accepted_tokens: u32,
}

#[derive(Serialize)]
struct HopOut {
    stage: u32,
    node: String,
    device: String,
    compute_ms_per_token: f64,
    transfer_ms_per_token: f64,
    bytes_per_token: u64,
}

#[derive(Serialize)]
struct GenerateOut {
    model: String,
    text: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    stop: String,
    seed: u64,
    timings: GenTimings,
    hops: Vec<HopOut>,
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    if a.n_predict < -1 {
        bail!("-n {}: a token count, or -1 for no limit", a.n_predict);
    }
    let sampling = a.sampling.params()?;
    let seed = sampling.seed;
    let params = GenerateParams {
        max_tokens: if a.n_predict < 0 { 0 } else { u32::try_from(a.n_predict).context("-n is too large")? },
        sampling,
        ignore_eos: a.ignore_eos,
        stop: a.stop.clone(),
        json_schema: a.json_schema.clone(),
        grammar: match &a.grammar_file {
            Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?),
            None => None,
        },
        logprobs: None,
    };
    if a.n_predict == 0 {
        bail!("-n 0 generates nothing");
    }
    runtime()?.block_on(async move {
        let mut c = a.connect.client().await?;
        let mut events = if a.chat {
            c.chat(&a.model, &[("user", a.prompt.as_str())], params).await?
        } else {
            c.generate(&a.model, &a.prompt, params).await?
        };
        let mut out = GenerateOut {
            model: a.model.clone(),
            text: String::new(),
            prompt_ids: vec![],
            generated_ids: vec![],
            stop: String::new(),
            seed,
            timings: GenTimings::default(),
            hops: vec![],
        };
        let mut stdout = std::io::stdout().lock();
        if !a.json && !a.chat {
            let _ = write!(stdout, "{}", a.prompt);
            let _ = stdout.flush();
        }
        while let Some(ev) = events.next().await {
            match ev? {
                Event::Prompt(ids) => out.prompt_ids = ids,
                Event::Token { id, text, .. } => {
                    out.generated_ids.push(id);
                    out.text.push_str(&text);
                    if !a.json && write!(stdout, "{text}").and_then(|_| stdout.flush()).is_err() {
                        return Ok(());
                    }
                }
                Event::Done(d) => {
                    out.text.push_str(&d.text_tail);
                    out.stop = d.stop.name().to_string();
                    if let Some(t) = d.timings {
                        out.timings = GenTimings {
                            prompt_tokens: t.prompt_tokens,
                            prompt_ms: t.prompt_s * 1e3,
                            prompt_tokens_per_s: t.prompt_tokens_per_s,
                            generated_tokens: t.generated_tokens,
                            generation_ms: t.generate_s * 1e3,
                            generation_tokens_per_s: t.generate_tokens_per_s,
                            ttft_ms: t.ttft_s * 1e3,
                            decode_passes: t.decode_passes,
                            drafted_tokens: t.drafted_tokens,
                            accepted_tokens: t.accepted_tokens,
                        };
                        out.hops = t
                            .hops
                            .iter()
                            .map(|h| HopOut {
                                stage: h.stage,
                                node: h.node.clone(),
                                device: h.device.clone(),
                                compute_ms_per_token: h.compute_s * 1e3,
                                transfer_ms_per_token: h.transfer_s * 1e3,
                                bytes_per_token: h.bytes_per_token,
                            })
                            .collect();
                    }
                    if !a.json {
                        let _ = writeln!(stdout, "{}", d.text_tail);
                    }
                }
            }
        }
        drop(stdout);
        if a.json {
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            let t = &out.timings;
            eprintln!(
                "prompt: {} tokens, {:.1} tokens/s; generation: {} tokens, {:.1} tokens/s ({})",
                t.prompt_tokens, t.prompt_tokens_per_s, t.generated_tokens, t.generation_tokens_per_s, out.stop
            );
            for h in &out.hops {
                eprintln!(
                    "  stage {} {}/{}: compute {:.3} ms/token, to next {:.3} ms/token",
                    h.stage, h.node, h.device, h.compute_ms_per_token, h.transfer_ms_per_token
                );
            }
        }
        Ok(())
    })
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub connect: Connect,
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct StatusOut {
    version: String,
    raft: serde_json::Value,
    nodes: Vec<serde_json::Value>,
    links: Vec<serde_json::Value>,
    deployments: Vec<serde_json::Value>,
}

fn deployment_json(d: &Deployment) -> serde_json::Value {
    serde_json::json!({
        "name": d.name,
        "source": d.source,
        "model_id": d.model_id,
        "generation": d.generation,
        "state": d.state.name(),
        "error": d.error,
        "n_layers": d.n_layers,
        "n_ctx": d.n_ctx,
        "sessions": d.sessions,
        "objective": d.objective,
        "driver": d.driver,
        "predicted_decode_ms": d.predicted_decode_s * 1e3,
        "measured_decode_ms": d.measured_decode_s * 1e3,
        "tokens_generated": d.tokens_generated,
        "stages": d.stages.iter().map(stage_json).collect::<Vec<_>>(),
        "expert_stages": d.expert_stages.iter().map(stage_json).collect::<Vec<_>>(),
        "plan": d.plan_text,
    })
}

fn stage_json(s: &brigade_sdk::Stage) -> serde_json::Value {
    let mut v = serde_json::json!({
        "index": s.index, "node": s.node, "device": s.device, "address": s.address,
        "layers": [s.layer_start, s.layer_end], "state": s.state.name(), "error": s.error,
        "weight_bytes": s.weight_bytes, "kv_bytes": s.kv_bytes, "fetched_bytes": s.fetched_bytes,
        "predicted_ms": s.predicted_s * 1e3, "measured_ms": s.measured_s * 1e3,
    });
    if let Some((a, b)) = s.experts {
        v["experts"] = serde_json::json!([a, b]);
    }
    v
}

pub fn status(a: StatusArgs) -> Result<()> {
    runtime()?.block_on(async move {
        let s = a.connect.client().await?.status().await?;
        if a.json {
            let raft = s.raft.as_ref().map(|r| serde_json::json!({
                "id": r.id, "role": r.role, "term": r.term, "leader": r.leader,
                "leader_address": r.leader_address, "commit_index": r.commit_index,
                "applied_index": r.applied_index, "voters": r.voters,
                "replicas": r.replicas.iter().map(|x| serde_json::json!({
                    "id": x.id, "address": x.address, "role": x.role, "match_index": x.match_index,
                    "is_self": x.is_self })).collect::<Vec<_>>(),
            })).unwrap_or_default();
            let out = StatusOut {
                raft,
                version: s.version.clone(),
                nodes: s
                    .nodes
                    .iter()
                    .map(|n| {
                        serde_json::json!({
                            "name": n.name, "address": n.address, "state": n.state.name(),
                            "heartbeat_age_ms": n.heartbeat_age_ms, "version": n.version,
                            "devices": n.devices.iter().map(|d| serde_json::json!({
                                "name": d.name, "kind": d.kind, "model": d.model, "memory_total": d.memory_total,
                                "host_link_bandwidth": d.host_link_bandwidth,
                                "host_link_latency_s": d.host_link_latency_s,
                                "memory_free": d.memory_free, "read_bandwidth": d.mem_bandwidth,
                                "flops": d.flops, "threads": d.threads, "features": d.features,
                                "kernels": d.kernels.iter().map(|k| serde_json::json!({
                                    "type": k.weight_type, "decode_bytes_per_s": k.decode_bytes_per_s,
                                    "prompt_flops": k.prompt_flops })).collect::<Vec<_>>(),
                            })).collect::<Vec<_>>(),
                        })
                    })
                    .collect(),
                links: s
                    .links
                    .iter()
                    .map(|l| serde_json::json!({"from": l.from, "to": l.to, "latency_ms": l.latency_s * 1e3, "bandwidth_bytes_per_s": l.bandwidth}))
                    .collect(),
                deployments: s.deployments.iter().map(deployment_json).collect(),
            };
            println!("{}", serde_json::to_string_pretty(&out)?);
            return Ok(());
        }
        if let Some(r) = &s.raft {
            println!(
                "coordinator: replica {} ({}), term {}, leader {} {}, commit {}, applied {}",
                r.id, r.role, r.term, r.leader, r.leader_address, r.commit_index, r.applied_index
            );
            for x in &r.replicas {
                println!("  replica {} at {}: {}, log at {}{}", x.id, x.address, x.role, x.match_index, if x.is_self { " (this one)" } else { "" });
            }
        }
        println!("nodes:");
        for n in &s.nodes {
            println!("  {} {} at {} (heartbeat {} ms ago)", n.name, n.state, n.address, n.heartbeat_age_ms);
            for d in &n.devices {
                let head = format!(
                    "    {} {}: {} free of {}",
                    d.name,
                    d.model,
                    crate::common::human_bytes(d.memory_free),
                    crate::common::human_bytes(d.memory_total)
                );
                if d.kind == "cuda" {
                    println!(
                        "{head}, copies {:.0} GB/s, {:.1} TFLOP/s, host link {:.1} GB/s {:.0} µs",
                        d.mem_bandwidth / 1e9,
                        d.flops / 1e12,
                        d.host_link_bandwidth / 1e9,
                        d.host_link_latency_s * 1e6
                    );
                    continue;
                }
                let q4k = d.kernels.iter().find(|k| k.weight_type == "q4_k");
                println!(
                    "{head}, read {:.1} GB/s{}, {} threads [{}]",
                    d.mem_bandwidth / 1e9,
                    q4k.map(|k| format!(", q4_k decode {:.1} GB/s", k.decode_bytes_per_s / 1e9)).unwrap_or_default(),
                    d.threads,
                    d.features
                );
            }
        }
        if !s.links.is_empty() {
            println!("links:");
            for l in &s.links {
                println!("  {} → {}: {:.3} ms, {:.1} MB/s", l.from, l.to, l.latency_s * 1e3, l.bandwidth / 1e6);
            }
        }
        println!("deployments:");
        for d in &s.deployments {
            println!(
                "  {} ({}): {}{}, generation {}; decode predicted {:.3} ms/token, measured {}",
                d.name,
                d.source,
                d.state,
                if d.error.is_empty() { String::new() } else { format!(" ({})", d.error) },
                d.generation,
                d.predicted_decode_s * 1e3,
                if d.measured_decode_s > 0.0 { format!("{:.3} ms/token", d.measured_decode_s * 1e3) } else { "—".into() }
            );
            for st in &d.stages {
                println!(
                    "    stage {} {}/{} layers {}–{}: {}",
                    st.index,
                    st.node,
                    st.device,
                    st.layer_start,
                    st.layer_end.saturating_sub(1),
                    st.state
                );
            }
        }
        Ok(())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Deploy {
        #[command(flatten)]
        args: DeployArgs,
    }

    /// `deploy` without a split flag asks the coordinator to search the split; with one, that
    /// split (`--cpu-moe`: every layer).
    #[test]
    fn deploy_searches_the_split_unless_asked() {
        let split = |flags: &[&str]| {
            let a = Deploy::try_parse_from([&["deploy", "--name", "x"][..], flags].concat()).unwrap().args;
            let r = deploy_request(&a);
            (r.cpu_moe, r.cpu_moe_auto)
        };
        assert_eq!(split(&[]), (0, true));
        assert_eq!(split(&["--n-cpu-moe", "6"]), (6, false));
        assert_eq!(split(&["--n-cpu-moe", "0"]), (0, false));
        assert_eq!(split(&["--cpu-moe"]), (u32::MAX, false));
    }
}
