//! The API's error answer (`{"error": {"code", "message"}}` with a fitting
//! status), the conversions from the server's typed errors into it, and
//! `ApiJson`, the body extractor whose rejections are such answers. Shared
//! by the handlers, the auth middleware, SSE and the HTTP layer; it imports
//! nothing of theirs.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_protocol::api::{ErrorBody, ErrorDetail, TargetingError};
use serde::de::DeserializeOwned;

use crate::events;
use crate::http::input::InputError;
use crate::store::StoreError;

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    pub(crate) fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    pub(crate) fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
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
                "database_unavailable",
                "the database is unavailable; try again later (details are in the server log)",
            )
        } else {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
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
            "internal",
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

/// `Json<T>` whose rejections are our JSON errors.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(ApiJson(value)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

// JsonRejection is #[non_exhaustive], so a catch-all arm is required here.
#[allow(clippy::wildcard_enum_match_arm)]
fn json_rejection(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as JSON with `Content-Type: application/json`",
        ),
        JsonRejection::JsonSyntaxError(e) => ApiError::bad_request("invalid_json", e.body_text()),
        JsonRejection::JsonDataError(e) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
            e.body_text(),
        ),
        other => ApiError::bad_request("invalid_body", other.body_text()),
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
