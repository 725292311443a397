//! The OpenAI-compatible HTTP API on the coordinator (`brigade coordinator --http ADDR`):
//! `brigade-serve`'s server — the same parsing, chat templates, stop strings, usage, streaming and
//! API keys as `brigade serve` — over a backend that runs each completion as a session of its
//! deployment, relayed from the deployment's driver exactly as the gRPC `Generate` is (and resumed
//! on a new placement when a node dies under it). Every deployment is a model of the API.

use crate::client::start_session;
use crate::models::EMBEDDED;
use crate::server::Shared;
use brigade_core::cluster::ModelRecord;
use brigade_format::{ModelIndex, Tokenizer};
use brigade_proto::v1::{generate_event, DriveRequest, Sampling, StopReason};
use brigade_serve::{ApiError, Backend, EngineEvent, EngineRequest, Finish, ModelInfo};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// The cluster as a `brigade-serve` backend.
pub struct ClusterBackend {
    shared: Arc<Shared>,
    /// Tokenizers by model id, read once from the model's file on this machine.
    tokenizers: Mutex<HashMap<String, Arc<Tokenizer>>>,
}

impl ClusterBackend {
    pub fn new(shared: Arc<Shared>) -> Self {
        ClusterBackend { shared, tokenizers: Mutex::new(HashMap::new()) }
    }

    /// The model's tokenizer (the server tokenizes; the driver takes the ids as they are).
    fn tokenizer(&self, m: &ModelRecord) -> Option<Arc<Tokenizer>> {
        if let Some(t) = self.tokenizers.lock().ok()?.get(&m.id) {
            return Some(t.clone());
        }
        let index = if m.source == EMBEDDED { ModelIndex::embedded() } else { ModelIndex::open(Path::new(&m.source)) };
        match index {
            Ok(i) => {
                let t = i.tokenizer().clone();
                self.tokenizers.lock().ok()?.insert(m.id.clone(), t.clone());
                Some(t)
            }
            Err(e) => {
                tracing::warn!("model {} ({}): no tokenizer for the HTTP API: {e}", m.name, m.source);
                None
            }
        }
    }
}

impl Backend for ClusterBackend {
    fn models(&self) -> Vec<ModelInfo> {
        let state = self.shared.state();
        state
            .deployments
            .values()
            .filter_map(|d| {
                let m = state.models.get(&d.model_id)?;
                Some(ModelInfo {
                    id: d.name.clone(),
                    n_ctx: d.n_ctx,
                    tokenizer: self.tokenizer(m)?,
                    created: d.created_ms / 1000,
                    owned_by: "brigade".into(),
                })
            })
            .collect()
    }

    async fn complete(&self, req: EngineRequest) -> Result<mpsc::UnboundedReceiver<EngineEvent>, ApiError> {
        let s = &req.sampling;
        let drive = DriveRequest {
            prompt_ids: req.prompt,
            use_prompt_ids: true,
            max_tokens: u32::try_from(req.max_tokens).unwrap_or(u32::MAX),
            sampling: Some(Sampling {
                temperature: s.temperature,
                top_k: u32::try_from(s.top_k).unwrap_or(u32::MAX),
                top_p: s.top_p,
                min_p: s.min_p,
                repeat_penalty: s.repeat_penalty,
                repeat_last_n: u32::try_from(s.repeat_last_n).unwrap_or(u32::MAX),
                seed: s.seed,
                presence_penalty: s.presence_penalty,
                frequency_penalty: s.frequency_penalty,
            }),
            ignore_eos: req.ignore_eos,
            ..Default::default()
        };
        let mut upstream = start_session(&self.shared, &req.model, drive).await.map_err(|e| api_error(&e))?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let ev = tokio::select! {
                    ev = upstream.recv() => ev,
                    // the HTTP client went: dropping `upstream` ends the session on the driver
                    _ = tx.closed() => return,
                };
                let out = match ev {
                    Some(Ok(e)) => match e.event {
                        Some(generate_event::Event::Token(t)) => EngineEvent::Token(t.id),
                        Some(generate_event::Event::Done(d)) => EngineEvent::Done(match d.stop() {
                            StopReason::Eos => Finish::Stop,
                            _ => Finish::Length,
                        }),
                        Some(generate_event::Event::Prompt(_)) | None => continue,
                    },
                    Some(Err(e)) => EngineEvent::Error(e.message().to_string()),
                    None => EngineEvent::Error("the session's stream ended without a final event".into()),
                };
                let last = !matches!(out, EngineEvent::Token(_));
                if tx.send(out).is_err() || last {
                    return;
                }
            }
        });
        Ok(rx)
    }
}

/// A refused session in OpenAI's shape: the deployment not serving now is a 503 (retry), the
/// caller's mistakes are 400s.
fn api_error(e: &tonic::Status) -> ApiError {
    use tonic::Code;
    match e.code() {
        Code::Unavailable | Code::ResourceExhausted => ApiError::busy(e.message()),
        Code::InvalidArgument | Code::FailedPrecondition | Code::NotFound => ApiError::bad_request(e.message()),
        _ => ApiError::internal(e.message()),
    }
}
