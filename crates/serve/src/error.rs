//! API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
//! HTTP status that goes with them. Every error the server answers is built here.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// OpenAI's `code`.
    pub code: Option<&'static str>,
    /// The request field at fault.
    pub param: Option<String>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, code, param: None }
    }

    /// 400: a body that is not the request it should be.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, message)
    }

    /// 400 naming the field at fault.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_string()), ..Self::bad_request(message) }
    }

    /// 400: the prompt does not fit in the context.
    pub fn context_exceeded(prompt: usize, n_ctx: usize) -> Self {
        let m = format!(
            "the prompt is {prompt} tokens and the context holds {n_ctx}: \
             at most {} leave room for an answer (raise -c)",
            n_ctx.saturating_sub(1)
        );
        ApiError {
            param: Some("messages".into()),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded"), m)
        }
    }

    /// 401.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", Some("invalid_api_key"), message)
    }

    /// 404: a model this server does not serve.
    pub fn model_not_found(model: &str, served: &[String]) -> Self {
        let m = match (model, served.is_empty()) {
            ("", true) => "this server has no model yet".to_string(),
            (_, true) => format!("the model `{model}` does not exist; this server has no model yet"),
            _ => format!("the model `{model}` does not exist; this server has: {}", served.join(", ")),
        };
        ApiError {
            param: Some("model".into()),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found"), m)
        }
    }

    /// 404: no such route.
    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", Some("unknown_url"), format!("no route {path}"))
    }

    /// 413: a body over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
            format!("the request body is larger than {limit} bytes"),
        )
    }

    /// 408: a body that did not arrive in time.
    pub fn body_timeout(secs: u64, got: usize) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            Some("request_timeout"),
            format!("the request body did not arrive within {secs} s ({got} bytes came)"),
        )
    }

    /// 503: every slot is busy and the queue is full.
    pub fn busy(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("server_busy"), message)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let b = Body {
            error: Inner { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code },
        };
        serde_json::to_value(b).unwrap_or_default()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, "{}", self.message);
        } else {
            tracing::debug!(status = %self.status, "{}", self.message);
        }
        (self.status, axum::Json(self.body())).into_response()
    }
}
