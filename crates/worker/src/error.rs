//! The worker's one error type, and its one mapping to gRPC status codes: nothing else in the
//! worker builds a `tonic::Status` (`tests/architecture.rs` checks).

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("{0}")]
    BadRequest(String),
    #[error("bad frame: {0}")]
    Frame(String),
    #[error("{0}")]
    Busy(String),
    #[error("bad manifest: {0}")]
    Manifest(String),
    #[error("fetch: {0}")]
    Fetch(String),
    #[error("link: {0}")]
    Link(String),
    #[error("coordinator: {0}")]
    Control(String),
    #[error("not the coordinator leader (the leader: {0:?})")]
    NotLeader(Option<String>),
    #[error("join refused: {0}")]
    Join(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(transparent)]
    Model(#[from] brigade_model::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A slice did not fit on its device (starts with [`brigade_core::cluster::OUT_OF_MEMORY`]).
    #[error("out of memory on {device} ({free} bytes free after the attempt): {why}")]
    OutOfMemory { device: String, free: u64, why: String },
    #[error("tls: {0}")]
    Tls(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// A session's pipeline failed (an ERROR from a stage, an answer the driver did not ask
    /// for): the relay may resume it elsewhere.
    #[error("{0}")]
    Failed(String),
    #[error("{0}")]
    Unavailable(String),
    /// No answer from the pipeline in time.
    #[error("{0}")]
    Stalled(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
}

impl From<brigade_model::FormatError> for WorkerError {
    fn from(e: brigade_model::FormatError) -> Self {
        WorkerError::Model(e.into())
    }
}

/// A frame whose ids or values cannot be read is a bad frame.
impl From<brigade_transport::frame::FrameError> for WorkerError {
    fn from(e: brigade_transport::frame::FrameError) -> Self {
        WorkerError::Frame(e.to_string())
    }
}

/// A draw the session's format refused is the request's error.
impl From<brigade_model::sampler::DrawError> for WorkerError {
    fn from(e: brigade_model::sampler::DrawError) -> Self {
        WorkerError::BadRequest(e.0)
    }
}

impl WorkerError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        WorkerError::Io { path: path.display().to_string(), source }
    }
}

impl From<WorkerError> for tonic::Status {
    fn from(e: WorkerError) -> Self {
        let msg = e.to_string();
        match e {
            WorkerError::BadRequest(_) => tonic::Status::invalid_argument(msg),
            WorkerError::Model(ref m)
                if matches!(
                    m,
                    brigade_model::ModelError::BadInput(_) | brigade_model::ModelError::ContextFull { .. }
                ) =>
            {
                tonic::Status::invalid_argument(msg)
            }
            // what the model's tokenizer cannot do with the request (no chat template, a text
            // it cannot encode) is the request's problem: nothing to retry elsewhere
            WorkerError::Model(brigade_model::ModelError::Tokenizer(_)) => tonic::Status::failed_precondition(msg),
            WorkerError::Busy(_) => tonic::Status::resource_exhausted(msg),
            WorkerError::Link(_) | WorkerError::Control(_) => tonic::Status::unavailable(msg),
            WorkerError::Join(_) | WorkerError::PermissionDenied(_) => tonic::Status::permission_denied(msg),
            WorkerError::Unavailable(_) => tonic::Status::unavailable(msg),
            WorkerError::Stalled(_) => tonic::Status::deadline_exceeded(msg),
            WorkerError::Unauthenticated(_) => tonic::Status::unauthenticated(msg),
            _ => tonic::Status::internal(msg),
        }
    }
}
