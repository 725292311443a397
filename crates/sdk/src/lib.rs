//! The Rust client of a brigade cluster: connect to a coordinator, generate and chat as streams of
//! tokens, deploy and undeploy models, read the cluster's status.
//!
//! ```no_run
//! # async fn example() -> Result<(), brigade_sdk::SdkError> {
//! use brigade_sdk::{Client, ClientConfig, Event, GenerateParams};
//! let mut client = Client::connect(ClientConfig::from_env()?).await?;
//! let mut events = client.generate("stories", "Once upon a time", GenerateParams::greedy(32)).await?;
//! while let Some(ev) = events.next().await {
//!     if let Event::Token { text, .. } = ev? {
//!         print!("{text}");
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - [`ClientConfig`]: where the coordinator is, the cluster CA to trust, the API key; read from
//!   arguments, the environment, or the client config file `brigade cluster local` writes.
//! - [`Client`]: the calls; [`EventStream`]: a generation's events.
//! - [`types`]: the results as plain Rust types ([`Done`], [`Deployment`], [`ClusterStatus`], …)
//!   and [`DeployParams`]: no generated protobuf type is part of this crate's API.
//!
//! Deliberately lacking: any model code (the cluster computes), and raft (a coordinator address
//! list is tried in order).
#![forbid(unsafe_code)]
#![warn(unreachable_pub, missing_docs)]

pub use brigade_core::SamplingParams;
use brigade_proto::convert::sampling_to_proto;
use brigade_proto::v1;
use brigade_proto::v1::client_client::ClientClient;
use brigade_proto::v1::{
    generate_event, ChatMessage, ChatRequest, ClusterStatusRequest, GenerateOptions, GenerateRequest,
    ListModelsRequest, UndeployRequest,
};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

pub mod types;
pub use types::{
    ActDtype, CarrierKind, ClusterStatus, DeployParams, Deployment, DeploymentState, Device, Done, HopTiming,
    KernelRate, Link, ModelInfo, Node, NodeState, Plan, RaftStatus, Replica, Stage, StageState, StopReason, Timings,
};

/// The name in the coordinator's certificate.
pub const COORDINATOR_NAME: &str = "coordinator.brigade";

/// Why a call of this SDK failed.
#[derive(Debug, thiserror::Error)]
pub enum SdkError {
    /// The client configuration is missing or invalid (no coordinator address, an unreadable
    /// CA file, a malformed config file, a parameter refused before any call).
    #[error("{0}")]
    Config(String),
    /// No coordinator replica could be reached.
    #[error("cannot reach the coordinator at {addr}: {why}")]
    Connect {
        /// The address tried last, `host:port`.
        addr: String,
        /// What went wrong there.
        why: String,
    },
    /// The coordinator answered with an error status (its code and message are kept).
    #[error("{}: {}", status_name(.0.code()), .0.message())]
    Status(#[from] tonic::Status),
    /// A generation's stream ended before its `Done` event.
    #[error("the stream ended without a final event")]
    Truncated,
}

fn status_name(c: tonic::Code) -> &'static str {
    match c {
        tonic::Code::InvalidArgument => "invalid request",
        tonic::Code::NotFound => "not found",
        tonic::Code::AlreadyExists => "already exists",
        tonic::Code::PermissionDenied => "permission denied",
        tonic::Code::Unauthenticated => "unauthenticated",
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::FailedPrecondition => "failed precondition",
        tonic::Code::ResourceExhausted => "busy",
        tonic::Code::DeadlineExceeded => "timed out",
        _ => "error",
    }
}

/// Where and how to reach a cluster.
#[derive(Debug, Clone, Default)]
pub struct ClientConfig {
    /// Coordinator addresses, `host:port` (tried in order).
    pub endpoints: Vec<String>,
    /// PEM of the cluster CA the coordinator's certificate must chain to.
    pub ca_pem: String,
    /// An API key, sent as `authorization: Bearer KEY` with every call (for a coordinator
    /// started with API keys).
    pub api_key: Option<String>,
}

#[derive(Deserialize)]
struct FileConfig {
    coordinator: String,
    ca: PathBuf,
    api_key: Option<String>,
}

impl ClientConfig {
    /// The client config file: `$BRIGADE_CONFIG`, else `$XDG_CONFIG_HOME/brigade/client.toml`
    /// (`~/.config/brigade/client.toml`).
    pub fn default_path() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("BRIGADE_CONFIG") {
            return Some(PathBuf::from(p));
        }
        let base = std::env::var_os("XDG_CONFIG_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
        Some(base.join("brigade").join("client.toml"))
    }

    /// Reads a client config file (`coordinator = "host:port"`, `ca = "path"`, `api_key`).
    pub fn from_file(path: &Path) -> Result<Self, SdkError> {
        let text = std::fs::read_to_string(path).map_err(|e| SdkError::Config(format!("{}: {e}", path.display())))?;
        let f: FileConfig = toml::from_str(&text).map_err(|e| SdkError::Config(format!("{}: {e}", path.display())))?;
        let ca = if f.ca.is_absolute() { f.ca } else { path.parent().unwrap_or(Path::new(".")).join(f.ca) };
        let ca_pem = std::fs::read_to_string(&ca).map_err(|e| SdkError::Config(format!("{}: {e}", ca.display())))?;
        Ok(ClientConfig {
            endpoints: f.coordinator.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
            ca_pem,
            api_key: f.api_key.or_else(|| std::env::var("BRIGADE_API_KEY").ok()),
        })
    }

    /// From explicit values, falling back to `BRIGADE_COORDINATOR`, `BRIGADE_CA`, `BRIGADE_API_KEY`
    /// and then the client config file.
    pub fn resolve(coordinator: Option<&str>, ca: Option<&Path>, api_key: Option<&str>) -> Result<Self, SdkError> {
        let env_coord = std::env::var("BRIGADE_COORDINATOR").ok();
        let env_ca = std::env::var_os("BRIGADE_CA").map(PathBuf::from);
        let file = Self::default_path().filter(|p| p.exists()).map(|p| Self::from_file(&p)).transpose()?;
        let endpoints: Vec<String> = match coordinator.map(str::to_string).or(env_coord) {
            Some(c) => c.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
            None => file.as_ref().map(|f| f.endpoints.clone()).unwrap_or_default(),
        };
        if endpoints.is_empty() {
            return Err(SdkError::Config(
                "no coordinator: give --coordinator HOST:PORT (or run `brigade cluster local`, which writes a client config)".into(),
            ));
        }
        let ca_pem = match ca.map(Path::to_path_buf).or(env_ca) {
            Some(p) => {
                std::fs::read_to_string(&p).map_err(|e| SdkError::Config(format!("--ca {}: {e}", p.display())))?
            }
            None => match &file {
                Some(f) => f.ca_pem.clone(),
                None => {
                    return Err(SdkError::Config(
                        "no cluster CA to trust: give --ca PATH (the coordinator's data dir has ca.pem)".into(),
                    ))
                }
            },
        };
        let api_key = api_key
            .map(str::to_string)
            .or_else(|| std::env::var("BRIGADE_API_KEY").ok())
            .or_else(|| file.and_then(|f| f.api_key));
        Ok(ClientConfig { endpoints, ca_pem, api_key })
    }

    /// [`ClientConfig::resolve`] with nothing explicit.
    pub fn from_env() -> Result<Self, SdkError> {
        Self::resolve(None, None, None)
    }
}

/// Sampling and length of one generation (llama.cpp's meaning for each).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    /// 0 = until an end-of-generation token or a full context.
    pub max_tokens: u32,
    /// How each token is drawn: the same settings give the same text as `brigade run`,
    /// `brigade serve` and the OpenAI API.
    pub sampling: SamplingParams,
    /// Keep generating past end-of-generation tokens (until `max_tokens` or a full context).
    pub ignore_eos: bool,
    /// Stop strings (at most 16, each at most 256 bytes): the answer ends before the earliest
    /// found, with `STOP_REASON_STOP`, and no token's text holds any of it (text that could
    /// still begin one comes in a later token, or in [`Done::text_tail`]).
    pub stop: Vec<String>,
    /// What the answer must be, enforced token by token (it ends where it is complete): a
    /// JSON schema as JSON text (`{"type": "object"}` for any object) ...
    pub json_schema: Option<String>,
    /// ... or a grammar in llguidance's Lark syntax. One of the two at most.
    pub grammar: Option<String>,
    /// Each token's log-probability and this many most likely alternatives (0 to 20), in
    /// [`Event::Token`].
    pub logprobs: Option<u32>,
}

impl GenerateParams {
    /// Greedy decoding (always the most likely token) of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        GenerateParams {
            max_tokens,
            sampling: SamplingParams::greedy(),
            ignore_eos: false,
            stop: Vec::new(),
            json_schema: None,
            grammar: None,
            logprobs: None,
        }
    }

    /// These parameters with stop strings.
    pub fn with_stop<S: Into<String>>(mut self, stop: impl IntoIterator<Item = S>) -> Self {
        self.stop = stop.into_iter().map(Into::into).collect();
        self
    }

    fn options(&self, resume: Vec<u32>) -> GenerateOptions {
        GenerateOptions {
            max_tokens: self.max_tokens,
            sampling: Some(sampling_to_proto(&self.sampling)),
            ignore_eos: self.ignore_eos,
            resume_ids: resume,
            stop: self.stop.clone(),
            json_schema: self.json_schema.clone().unwrap_or_default(),
            grammar: self.grammar.clone().unwrap_or_default(),
            logprobs: self.logprobs,
        }
    }
}

/// One event of a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt's ids as the model's tokenizer encoded it.
    Prompt(Vec<u32>),
    /// One generated token.
    Token {
        /// The token's id in the model's vocabulary.
        id: u32,
        /// The text this token completes (UTF-8 safe: empty while a character is incomplete).
        text: String,
        /// Its index among the generated tokens, from 0.
        index: u32,
        /// When [`GenerateParams::logprobs`] asked: the natural log of its probability under
        /// the model's distribution at that step.
        logprob: Option<f32>,
        /// The most likely ids at that step with their log-probabilities, most likely first.
        top_logprobs: Vec<(u32, f32)>,
    },
    /// The generation ended: why, the text held back, and its timings.
    Done(Done),
}

/// What a stream was asked for, to ask again after a failover.
#[derive(Clone)]
enum Call {
    Generate(GenerateRequest),
    Chat(ChatRequest),
}

/// Resumptions of one stream before its error is returned.
const MAX_RESUMES: u32 = 8;

/// A generation's events, in order; ends after [`Event::Done`]. When the coordinator replica
/// serving it dies, the stream reconnects to another replica and continues the session from the
/// ids already received (the cluster rebuilds the state from prompt + those ids): the caller sees
/// a pause, never a gap or a repeat.
pub struct EventStream {
    inner: tonic::Streaming<v1::GenerateEvent>,
    client: Client,
    call: Call,
    received: Vec<u32>,
    resumed: bool,
    resumes: u32,
    done: bool,
}

/// Whether a stream or call failed because of the replica or the pipeline (worth resuming
/// elsewhere), not because of the request.
fn transient(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::Aborted
            | tonic::Code::Internal
    )
}

impl EventStream {
    async fn resume(&mut self, why: SdkError) -> Result<(), SdkError> {
        if self.resumes >= MAX_RESUMES {
            return Err(why);
        }
        self.resumes += 1;
        tokio::time::sleep(Duration::from_millis(100 * u64::from(self.resumes))).await;
        self.client.reconnect_next().await?;
        let r = match &self.call {
            Call::Generate(g) => {
                let mut g = g.clone();
                if let Some(o) = g.options.as_mut() {
                    o.resume_ids.extend_from_slice(&self.received);
                }
                self.client.rpc.generate(g).await
            }
            Call::Chat(c) => {
                let mut c = c.clone();
                if let Some(o) = c.options.as_mut() {
                    o.resume_ids.extend_from_slice(&self.received);
                }
                self.client.rpc.chat(c).await
            }
        };
        match r {
            Ok(s) => {
                self.inner = s.into_inner();
                self.resumed = true;
                Ok(())
            }
            Err(s) if transient(&s) => Box::pin(self.resume(s.into())).await,
            Err(s) => Err(s.into()),
        }
    }

    /// The next event, `None` once the stream has ended. A failure of the replica or the
    /// pipeline under the stream (not of the request) is resumed, on another replica if need
    /// be, from the ids already received: no token is lost or repeated.
    pub async fn next(&mut self) -> Option<Result<Event, SdkError>> {
        loop {
            if self.done {
                return None;
            }
            let failure = match self.inner.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(generate_event::Event::Prompt(_)) if self.resumed => continue,
                    Some(generate_event::Event::Prompt(p)) => return Some(Ok(Event::Prompt(p.ids))),
                    Some(generate_event::Event::Token(t)) => {
                        self.received.push(t.id);
                        let top_logprobs = t.top_logprobs.iter().map(|x| (x.id, x.logprob)).collect();
                        return Some(Ok(Event::Token {
                            id: t.id,
                            text: t.text,
                            index: t.index,
                            logprob: t.logprob,
                            top_logprobs,
                        }));
                    }
                    Some(generate_event::Event::Done(d)) => {
                        self.done = true;
                        return Some(Ok(Event::Done(d.into())));
                    }
                    None => SdkError::Truncated,
                },
                Ok(None) => SdkError::Truncated,
                Err(s) if transient(&s) => SdkError::Status(s),
                Err(s) => {
                    self.done = true;
                    return Some(Err(s.into()));
                }
            };
            if let Err(e) = self.resume(failure).await {
                self.done = true;
                return Some(Err(e));
            }
        }
    }
}

#[derive(Clone)]
struct Auth {
    key: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let mut req = brigade_proto::with_version(req);
        if let Some(k) = &self.key {
            req.metadata_mut().insert("authorization", k.clone());
        }
        Ok(req)
    }
}

type Rpc = ClientClient<tonic::codegen::InterceptedService<Channel, Auth>>;

/// A connection to a cluster's coordinator (any replica; it moves to another when its replica
/// stops answering).
#[derive(Clone)]
pub struct Client {
    rpc: Rpc,
    cfg: ClientConfig,
    /// The index in `cfg.endpoints` of the replica this client talks to.
    at: usize,
    /// The coordinator replica this client talks to now, `host:port`.
    pub endpoint: String,
}

async fn connect_one(cfg: &ClientConfig, addr: &str) -> Result<Rpc, SdkError> {
    let key = match &cfg.api_key {
        Some(k) => Some(
            format!("Bearer {k}")
                .parse()
                .map_err(|_| SdkError::Config("the API key has characters a header cannot carry".into()))?,
        ),
        None => None,
    };
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&cfg.ca_pem)).domain_name(COORDINATOR_NAME);
    let ep = Endpoint::from_shared(format!("https://{addr}"))
        .and_then(|e| e.tls_config(tls))
        .map_err(|e| SdkError::Config(format!("{addr}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    match ep.connect().await {
        Ok(ch) => Ok(ClientClient::with_interceptor(ch, Auth { key }).max_decoding_message_size(64 << 20)),
        Err(e) => {
            let mut why = e.to_string();
            let mut src: Option<&dyn std::error::Error> = std::error::Error::source(&e);
            while let Some(s) = src {
                why = format!("{why}: {s}");
                src = s.source();
            }
            Err(SdkError::Connect { addr: addr.to_string(), why })
        }
    }
}

impl Client {
    /// Connects to the first coordinator of `cfg.endpoints` that answers.
    pub async fn connect(cfg: ClientConfig) -> Result<Client, SdkError> {
        let mut last = SdkError::Config("no coordinator address".into());
        for (i, addr) in cfg.endpoints.iter().enumerate() {
            match connect_one(&cfg, addr).await {
                Ok(rpc) => return Ok(Client { rpc, endpoint: addr.clone(), at: i, cfg: cfg.clone() }),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Moves to the next replica that answers (trying each once, this one last).
    async fn reconnect_next(&mut self) -> Result<(), SdkError> {
        let n = self.cfg.endpoints.len().max(1);
        let mut last = SdkError::Config("no coordinator address".into());
        for k in 1..=n {
            let i = (self.at + k) % n;
            let Some(addr) = self.cfg.endpoints.get(i).cloned() else { break };
            match connect_one(&self.cfg, &addr).await {
                Ok(rpc) => {
                    self.rpc = rpc;
                    self.at = i;
                    self.endpoint = addr;
                    return Ok(());
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Runs a unary call, moving to another replica (a few times) while replicas are down.
    async fn retry<T, F, Fut>(&mut self, mut f: F) -> Result<T, SdkError>
    where
        F: FnMut(Rpc) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut tries = 0;
        loop {
            match f(self.rpc.clone()).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) if s.code() == tonic::Code::Unavailable && tries < 2 * self.cfg.endpoints.len().max(1) + 4 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(150 * tries as u64)).await;
                    // a transport failure means this replica is gone; "no leader yet" passes
                    if s.message().contains("transport")
                        || s.message().contains("connect")
                        || s.message().contains("broken pipe")
                    {
                        self.reconnect_next().await?;
                    }
                }
                Err(s) => return Err(s.into()),
            }
        }
    }

    /// Generates from a text prompt.
    pub async fn generate(&mut self, model: &str, prompt: &str, p: GenerateParams) -> Result<EventStream, SdkError> {
        self.generate_request(GenerateRequest {
            model: model.to_string(),
            prompt: prompt.to_string(),
            options: Some(p.options(Vec::new())),
            prompt_ids: Vec::new(),
        })
        .await
    }

    /// Generates from a prompt given as token ids of the deployment's model.
    pub async fn generate_ids(&mut self, model: &str, ids: &[u32], p: GenerateParams) -> Result<EventStream, SdkError> {
        self.generate_request(GenerateRequest {
            model: model.to_string(),
            prompt: String::new(),
            options: Some(p.options(Vec::new())),
            prompt_ids: ids.to_vec(),
        })
        .await
    }

    async fn generate_request(&mut self, req: GenerateRequest) -> Result<EventStream, SdkError> {
        let r = req.clone();
        let s = self
            .retry(|mut rpc| {
                let r = r.clone();
                async move { rpc.generate(r).await }
            })
            .await?;
        Ok(self.stream(s, Call::Generate(req)))
    }

    fn stream(&self, inner: tonic::Streaming<v1::GenerateEvent>, call: Call) -> EventStream {
        EventStream { inner, client: self.clone(), call, received: Vec::new(), resumed: false, resumes: 0, done: false }
    }

    /// A conversation of `(role, content)` messages, rendered with the model's chat template.
    pub async fn chat(
        &mut self,
        model: &str,
        messages: &[(&str, &str)],
        p: GenerateParams,
    ) -> Result<EventStream, SdkError> {
        let req = ChatRequest {
            model: model.to_string(),
            messages: messages
                .iter()
                .map(|(r, c)| ChatMessage { role: r.to_string(), content: c.to_string() })
                .collect(),
            options: Some(p.options(Vec::new())),
        };
        let r = req.clone();
        let s = self
            .retry(|mut rpc| {
                let r = r.clone();
                async move { rpc.chat(r).await }
            })
            .await?;
        Ok(self.stream(s, Call::Chat(req)))
    }

    /// Deploys; the deployment as it stands when the call returns (after `wait_s` at most).
    pub async fn deploy(&mut self, p: &DeployParams) -> Result<Deployment, SdkError> {
        let req = p.to_proto();
        let r = self
            .retry(|mut rpc| {
                let req = req.clone();
                async move { rpc.deploy(req).await }
            })
            .await?;
        r.deployment.map(Into::into).ok_or(SdkError::Truncated)
    }

    /// What [`Client::deploy`] would do, without doing it.
    pub async fn plan(&mut self, p: &DeployParams) -> Result<Plan, SdkError> {
        let req = p.to_proto();
        let r = self
            .retry(|mut rpc| {
                let req = req.clone();
                async move { rpc.plan(req).await }
            })
            .await?;
        Ok(Plan { text: r.plan_text, json: r.plan_json })
    }

    /// Removes the deployment `name` (its stages stop on their workers).
    pub async fn undeploy(&mut self, name: &str) -> Result<(), SdkError> {
        let name = name.to_string();
        self.retry(|mut rpc| {
            let name = name.clone();
            async move { rpc.undeploy(UndeployRequest { name }).await }
        })
        .await?;
        Ok(())
    }

    /// The cluster as the coordinator sees it: nodes with their devices, links, deployments,
    /// and the coordinator's replicas (what `brigade status` prints).
    pub async fn status(&mut self) -> Result<ClusterStatus, SdkError> {
        Ok(self.retry(|mut rpc| async move { rpc.cluster_status(ClusterStatusRequest {}).await }).await?.into())
    }

    /// The models the cluster serves (its deployments).
    pub async fn list_models(&mut self) -> Result<Vec<ModelInfo>, SdkError> {
        let r = self.retry(|mut rpc| async move { rpc.list_models(ListModelsRequest {}).await }).await?;
        Ok(r.models.into_iter().map(Into::into).collect())
    }

    /// Removes a coordinator replica from its group; the group's replicas after it.
    pub async fn remove_replica(&mut self, id: u64) -> Result<Vec<String>, SdkError> {
        Ok(self.retry(|mut rpc| async move { rpc.remove_replica(v1::RemoveReplicaRequest { id }).await }).await?.peers)
    }
}
