//! `brigade serve`: llama-server on this box — the model loaded once (the same split options
//! as `run`), the batch engine decoding up to `--parallel` sessions together, and the
//! OpenAI-compatible API of `brigade-serve` in front of it.

use crate::cluster::{runtime, stop_signal};
use crate::common::{check_cpu_memory, detect_gpus, load_with_retry, GpuLayers, ModelArgs, Placed, SpecArgs};
use anyhow::{Context, Result};
use brigade_model::batch::{Batch, Engine, EngineConfig, Job, Output, Sink};
use brigade_model::Pipeline;
use brigade_serve::{
    ApiError, Backend, DeploymentView, DeviceView, EngineEvent, EngineRequest, Finish, Load, ModelInfo, NodeView,
    Overview, ServeConfig, StageView,
};
use clap::Args;
use std::io::Write;
use std::sync::Arc;
use tokio::sync::mpsc;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub common: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// The model's name in the API (default: its file name).
    #[arg(long = "alias")]
    pub alias: Option<String>,
    /// Sessions decoded together, each with its own KV cache of the full context.
    #[arg(long = "parallel", default_value_t = 4)]
    pub parallel: usize,
    /// Requests that may wait for a free session; more are answered 503.
    #[arg(long = "queue", default_value_t = 64)]
    pub queue: usize,
    #[arg(long = "host", default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (printed).
    #[arg(long = "port", default_value_t = 8080)]
    pub port: u16,
    /// API keys clients must present (`Authorization: Bearer KEY`); repeatable.
    #[arg(long = "api-key", env = "BRIGADE_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// Files of API keys, one per line (out of `ps`' sight); repeatable.
    #[arg(long = "api-key-file", env = "BRIGADE_API_KEY_FILE", value_delimiter = ',')]
    pub api_key_files: Vec<std::path::PathBuf>,
    /// Require an API key for the dashboard (`/`) and `/metrics` too (`/health` stays open).
    #[arg(long)]
    pub protect_metrics: bool,
    /// A Jinja chat template to use instead of the model's (llama-server's flag): for a file
    /// whose template is old, or shows no tools.
    #[arg(long = "chat-template-file")]
    pub chat_template_file: Option<std::path::PathBuf>,
}

/// The batch engine as the API's backend.
struct Local {
    engine: Engine,
    info: ModelInfo,
    pipeline: Arc<Pipeline>,
    parallel: usize,
}

/// Delivers a job's outputs to the request's channel.
struct ToChannel(mpsc::UnboundedSender<EngineEvent>);

impl Sink for ToChannel {
    fn deliver(&mut self, out: Output) -> bool {
        let ev = match out {
            Output::Started { cached_tokens } => EngineEvent::Started { cached_tokens },
            Output::Token(t, lp) => EngineEvent::Token(t, lp),
            Output::Done(s) => EngineEvent::Done(Finish::of(s.stop)),
            Output::Error(e) => EngineEvent::Error(e),
        };
        self.0.send(ev).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

impl Backend for Local {
    fn models(&self) -> Vec<ModelInfo> {
        vec![self.info.clone()]
    }

    async fn complete(&self, req: EngineRequest) -> Result<mpsc::UnboundedReceiver<EngineEvent>, ApiError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let job = Job {
            prompt: req.prompt,
            max_tokens: req.max_tokens,
            sampler: req.sampling,
            ignore_eos: req.ignore_eos,
            constraint: req.constraint,
            logprobs: req.logprobs,
        };
        self.engine.submit(job, Box::new(ToChannel(tx))).map_err(|b| ApiError::busy(b.to_string()))?;
        Ok(rx)
    }

    fn constrains(&self) -> bool {
        true
    }

    fn scores(&self) -> bool {
        true
    }

    fn load(&self) -> Option<Load> {
        let l = self.engine.load();
        Some(Load { slots: l.parallel, processing: l.active, waiting: l.waiting })
    }

    async fn overview(&self) -> Option<Overview> {
        Some(self.overview_now())
    }
}

impl Local {
    /// This box as the dashboard and `/metrics` show it: one node, the pipeline's stages (each
    /// with its KV caches for every session slot), their compute seconds in decode steps.
    fn overview_now(&self) -> Overview {
        let cpu = brigade_model::devices::cpu_info();
        let gpus = detect_gpus();
        let timing = self.pipeline.decode_timing();
        let report = self.pipeline.report();
        let mut devices = vec![DeviceView {
            name: "cpu".into(),
            model: cpu.name.clone(),
            memory_total: cpu.memory_total,
            memory_free: cpu.memory_available,
            features: format!("{} threads", brigade_model::threads::current()),
            kind: "cpu".into(),
            ..Default::default()
        }];
        devices.extend(gpus.iter().map(|g| DeviceView {
            name: format!("cuda{}", g.ordinal),
            model: g.name.clone(),
            memory_total: g.memory_total,
            memory_free: g.memory_free,
            kind: "cuda".into(),
            ..Default::default()
        }));
        let steps = timing.steps;
        let stages: Vec<StageView> = report
            .iter()
            .enumerate()
            .map(|(i, r)| StageView {
                index: i,
                node: "this box".into(),
                device: r.device.to_string(),
                layers: (r.layers.0 as u32, r.layers.1 as u32),
                state: "ready".into(),
                weight_bytes: r.weight_bytes,
                kv_bytes: r.kv_bytes.saturating_mul(self.parallel as u64),
                compute_s_total: timing.stage_s.get(i).copied().unwrap_or(0.0),
                ..Default::default()
            })
            .collect();
        let total: f64 = timing.stage_s.iter().sum();
        let (drafted, accepted) = self.engine.drafts();
        Overview {
            source: format!("brigade serve {}", env!("CARGO_PKG_VERSION")),
            nodes: vec![NodeView {
                name: "this box".into(),
                address: String::new(),
                state: "up".into(),
                heartbeat_age_s: 0.0,
                devices,
            }],
            links: Vec::new(),
            deployments: vec![DeploymentView {
                name: self.info.id.clone(),
                state: "ready".into(),
                measured_decode_s: if steps == 0 { 0.0 } else { total / steps as f64 },
                decode_steps: steps,
                drafted_tokens: drafted,
                accepted_tokens: accepted,
                stages,
                ..Default::default()
            }],
        }
    }
}

pub fn serve(a: ServeArgs) -> Result<()> {
    if a.parallel == 0 || a.parallel > 256 {
        anyhow::bail!("--parallel {}: 1 to 256 sessions", a.parallel);
    }
    let Placed { files, n_ctx, placement, .. } = a.common.open_and_place()?;
    let retry = a.common.ngl == Some(GpuLayers::Auto);
    let n_layers = files.config.n_layers;
    let cpu_moe = placement.cpu_moe;
    // every slot's KV cache is allocated up front: `parallel` contexts
    check_cpu_memory(&files, &placement.stages, n_ctx.saturating_mul(a.parallel), cpu_moe)?;
    let (pipeline, stages, notes) = load_with_retry(n_layers, placement.stages, retry, |st| {
        Pipeline::load_cpu_moe(&files, st, n_ctx, cpu_moe, |_, _| {})
    })
    .context("loading the model")?;
    for n in &notes {
        eprintln!("{n}");
    }
    let id = a.alias.clone().unwrap_or_else(|| match &a.common.model {
        Some(p) => p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string()),
        None => "stories260K.gguf".into(),
    });
    let tokenizer = match &a.chat_template_file {
        None => files.tokenizer.clone(),
        Some(path) => {
            let template = std::fs::read_to_string(path)
                .with_context(|| format!("reading the chat template {}", path.display()))?;
            let mut tk = (*files.tokenizer).clone();
            // a template that does not render is refused now, not at the first request
            tk.render_chat_template(&template, &[("user".into(), "hello".into())])
                .with_context(|| format!("the chat template {}", path.display()))?;
            tk.chat_template = Some(template);
            Arc::new(tk)
        }
    };
    drop(files);
    let tk = tokenizer.clone();
    let cfg = EngineConfig { parallel: a.parallel, queue: a.queue };
    let pipeline = Arc::new(pipeline);
    let mut batch = Batch::new(pipeline.clone(), cfg.parallel, move |t| tk.is_eog(t))?;
    if let Some(spec) = a.spec.speculation(&tokenizer, n_ctx)? {
        batch = batch.with_speculation(spec)?;
    }
    let engine = Engine::start_batch(batch, cfg)?;
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let info = ModelInfo { id: id.clone(), n_ctx, tokenizer, created, owned_by: "brigade".into() };
    let backend = Arc::new(Local { engine, info, pipeline, parallel: a.parallel });
    let serve_cfg = ServeConfig {
        keys: brigade_serve::ApiKeys::new(&crate::cluster::api_keys(a.api_keys, &a.api_key_files)?, &[]),
        protect_metrics: a.protect_metrics,
        ..Default::default()
    };
    let placed: Vec<String> = stages.iter().map(|s| format!("{} on {}", s.layers, s.device)).collect();
    let rt = runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("binding {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        println!(
            "brigade serve: listening on http://{addr} (model {id}, layers {}, {} sessions of {n_ctx} tokens)",
            placed.join(", "),
            a.parallel
        );
        let _ = std::io::stdout().flush();
        brigade_serve::serve(listener, backend, serve_cfg, stop_signal()).await?;
        anyhow::Ok(())
    })
}
