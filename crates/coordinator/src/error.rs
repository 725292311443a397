//! The coordinator's one error type, and its one mapping to gRPC status codes: the services
//! raise `CoordError`s and nothing else builds a `tonic::Status` (`tests/architecture.rs`
//! checks).

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Busy(String),
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A call only the leader serves reached another replica: the leader's id and address when
    /// one is known (the status names it in metadata, for the caller to follow).
    #[error("{}", match leader {
        Some((id, addr)) => format!("not the leader; the leader is replica {id} at {addr}"),
        None => "no coordinator leader yet; retry".to_string(),
    })]
    NotLeader { leader: Option<(u64, String)> },
    #[error("corrupt data dir: {0}")]
    Corrupt(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(transparent)]
    State(#[from] brigade_core::cluster::StateError),
    #[error(transparent)]
    Core(#[from] brigade_core::CoreError),
    #[error(transparent)]
    Plan(#[from] brigade_planner::PlanError),
    #[error("model: {0}")]
    Model(#[from] brigade_format::FormatError),
    #[error("tls: {0}")]
    Tls(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl CoordError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        CoordError::Io { path: path.display().to_string(), source }
    }
}

impl From<CoordError> for tonic::Status {
    fn from(e: CoordError) -> Self {
        use brigade_core::cluster::StateError as S;
        let msg = e.to_string();
        match e {
            CoordError::BadRequest(_) | CoordError::Core(_) | CoordError::Model(_) => {
                tonic::Status::invalid_argument(msg)
            }
            CoordError::Plan(_) => tonic::Status::failed_precondition(msg),
            CoordError::NotFound(_) => tonic::Status::not_found(msg),
            CoordError::Unauthenticated(_) => tonic::Status::unauthenticated(msg),
            CoordError::PermissionDenied(_) => tonic::Status::permission_denied(msg),
            CoordError::Unavailable(_) => tonic::Status::unavailable(msg),
            CoordError::FailedPrecondition(_) => tonic::Status::failed_precondition(msg),
            CoordError::Busy(_) => tonic::Status::resource_exhausted(msg),
            CoordError::Aborted(_) => tonic::Status::aborted(msg),
            CoordError::AlreadyExists(_) => tonic::Status::already_exists(msg),
            CoordError::DeadlineExceeded(_) => tonic::Status::deadline_exceeded(msg),
            CoordError::NotLeader { leader } => {
                let mut st = tonic::Status::unavailable(msg);
                if let Some(v) = leader.and_then(|(_, addr)| addr.parse().ok()) {
                    st.metadata_mut().insert(crate::LEADER_METADATA_KEY, v);
                }
                st.metadata_mut().insert("retry-after-ms", tonic::metadata::MetadataValue::from(200u32));
                st
            }
            CoordError::State(ref s) => match s {
                S::UnknownNode(_) | S::UnknownDeployment(_) | S::UnknownModel(_) | S::UnknownStage { .. } => {
                    tonic::Status::not_found(msg)
                }
                S::DeploymentExists(_) => tonic::Status::already_exists(msg),
                S::NodeDown(_) => tonic::Status::unavailable(msg),
                S::StaleGeneration { .. } | S::NodeInUse { .. } => tonic::Status::failed_precondition(msg),
                S::NotStageOwner { .. } => tonic::Status::permission_denied(msg),
                _ => tonic::Status::invalid_argument(msg),
            },
            CoordError::Corrupt(_) | CoordError::Io { .. } | CoordError::Tls(_) | CoordError::Internal(_) => {
                tonic::Status::internal(msg)
            }
        }
    }
}
