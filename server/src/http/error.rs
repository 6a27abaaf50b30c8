//! The API's error answer (`{"error": {"code", "message"}}` with a fitting
//! status and an `ErrorCode`) and the conversions from the server's typed
//! errors into it. Shared
//! by the handlers, the auth middleware, SSE and the HTTP layer; it imports
//! nothing of theirs.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_protocol::api::{ErrorBody, ErrorCode, ErrorDetail, TargetingError};

use crate::events;
use crate::http::input::InputError;
use crate::store::StoreError;

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: ErrorCode,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    pub(crate) fn bad_request(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    pub(crate) fn not_found(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
    pub(crate) fn code(&self) -> ErrorCode {
        self.code
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.as_str().to_owned(),
                message: self.message,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

/// Database errors are logged with their detail and answered without it:
/// SQL text and PostgreSQL messages never reach a client.
impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(error = %e, "request failed on the database");
        if e.is_unavailable() {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::DatabaseUnavailable,
                "the database is unavailable; try again later (details are in the server log)",
            )
        } else {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::Internal,
                "the database refused the request (details are in the server log)",
            )
        }
    }
}

impl From<events::EventError> for ApiError {
    fn from(e: events::EventError) -> Self {
        tracing::error!(error = %e, "building an event failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            "an event could not be built (details are in the server log)",
        )
    }
}

impl From<InputError> for ApiError {
    fn from(e: InputError) -> Self {
        let status = if e.is_too_large() {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

/// A bulk call's targets that cannot be used; too many ids is the same
/// refusal as every other count limit.
impl From<TargetingError> for ApiError {
    fn from(e: TargetingError) -> Self {
        match e {
            TargetingError::TooManyDevices { got, limit } => {
                ApiError::from(InputError::TooManyItems {
                    what: "devices",
                    limit,
                    got,
                })
            }
            TargetingError::NotExactlyOne
            | TargetingError::EmptyDevices
            | TargetingError::InvalidDeviceId { .. }
            | TargetingError::EmptySelector => ApiError::bad_request(e.code(), e.to_string()),
        }
    }
}
