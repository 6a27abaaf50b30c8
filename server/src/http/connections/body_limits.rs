//! The size limit and deadline of request bodies: a body that fails once it
//! exceeds either ([`GuardedBody`]), the error its reader sees
//! ([`BodyError`]) and the answer the client gets (`413` / `408`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::http::{header, HeaderValue, Response, StatusCode};
use axum::response::IntoResponse;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use idem_protocol::api::ErrorCode;

use super::limits::HttpLimits;
use super::BodyRejection;
use crate::http::error::ApiError;

impl BodyRejection {
    pub(super) fn code(self) -> u8 {
        match self {
            BodyRejection::TooLarge => 1,
            BodyRejection::Timeout => 2,
        }
    }

    pub(super) fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(BodyRejection::TooLarge),
            2 => Some(BodyRejection::Timeout),
            _ => None,
        }
    }

    pub(super) fn response(self, limits: &HttpLimits) -> Response<axum::body::Body> {
        let error = match self {
            BodyRejection::TooLarge => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorCode::BodyTooLarge,
                format!(
                    "the request body is too large: the limit is {} bytes (--http-max-body-bytes / IDEM_HTTP_MAX_BODY_BYTES)",
                    limits.max_body_bytes
                ),
            ),
            BodyRejection::Timeout => ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                ErrorCode::BodyTimeout,
                format!(
                    "the request body did not arrive within {:?} (--http-body-timeout / IDEM_HTTP_BODY_TIMEOUT)",
                    limits.body_timeout
                ),
            ),
        };
        let mut response = error.into_response();
        // The rest of the body is not read: the connection cannot be reused.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    }
}

/// Why a guarded body stopped yielding data.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(
        "request body larger than {limit} bytes (--http-max-body-bytes / IDEM_HTTP_MAX_BODY_BYTES)"
    )]
    TooLarge { limit: u64 },
    #[error("request body not received within {timeout:?} (--http-body-timeout / IDEM_HTTP_BODY_TIMEOUT)")]
    Timeout { timeout: Duration },
    #[error("reading the request body: {0}")]
    Transport(#[source] hyper::Error),
}

/// A request body that fails once it exceeds the size limit or its deadline,
/// and records which limit it hit for the connection's `handle`.
pub(super) struct GuardedBody {
    pub(super) inner: Incoming,
    /// Bytes the body may still carry.
    pub(super) remaining: u64,
    /// The whole body must have arrived by then (a trickling client cannot
    /// hold a connection by sending a byte now and then).
    pub(super) deadline: Pin<Box<tokio::time::Sleep>>,
    pub(super) limits: HttpLimits,
    pub(super) tripped: Arc<AtomicU8>,
}

impl GuardedBody {
    fn trip(&self, rejection: BodyRejection) -> BodyError {
        self.tripped.store(rejection.code(), Ordering::Release);
        match rejection {
            BodyRejection::TooLarge => BodyError::TooLarge {
                limit: self.limits.max_body_bytes,
            },
            BodyRejection::Timeout => BodyError::Timeout {
                timeout: self.limits.body_timeout,
            },
        }
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if this.inner.is_end_stream() {
            return Poll::Ready(None);
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(this.trip(BodyRejection::Timeout))));
        }
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            None => return Poll::Ready(None),
            Some(Err(e)) => return Poll::Ready(Some(Err(BodyError::Transport(e)))),
            Some(Ok(frame)) => frame,
        };
        if let Some(data) = frame.data_ref() {
            let len = u64::try_from(data.len()).unwrap_or(u64::MAX);
            if len > this.remaining {
                return Poll::Ready(Some(Err(this.trip(BodyRejection::TooLarge))));
            }
            this.remaining -= len;
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
