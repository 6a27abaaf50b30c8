//! The API's JSON error answer written as raw bytes, outside hyper
//! ([`RawError`]): the answers to connections refused at accept (written
//! straight to the socket) and to request heads refused for their size or
//! form, and the `Retry-After` value of a wait.

use std::io::{Read as _, Write as _};
use std::time::Duration;

use axum::http::{Response, StatusCode};
use axum::response::IntoResponse;
use idem_protocol::api::{ErrorBody, ErrorCode, ErrorDetail};
use tokio::net::TcpStream;

use super::limits::HttpLimits;
use super::{ConnectionRefusal, HeadRejection};
use super::{MAX_HEADER_FIELDS, MAX_HEAD_BYTES, MAX_URI_BYTES};
use crate::http::error::ApiError;

/// Most bytes a connection refused at accept may already have sent that are
/// read and discarded before it is closed (closing a socket with unread
/// data resets it, and a reset can make the client discard the answer).
const REFUSED_CONNECTION_DRAIN_BYTES: usize = 64 * 1024;

impl ConnectionRefusal {
    /// The JSON answer of a refused connection, written straight to its
    /// socket (no hyper connection is started for it).
    pub(super) fn answer(self, limits: &HttpLimits) -> Vec<u8> {
        let error = match self {
            ConnectionRefusal::PerPeer => RawError {
                status: StatusCode::TOO_MANY_REQUESTS,
                code: ErrorCode::TooManyConnectionsFromPeer,
                message: format!(
                    "too many connections from your address: at most {} may be open at once \
                     (--http-max-connections-per-peer / IDEM_HTTP_MAX_CONNECTIONS_PER_PEER); \
                     close idle connections or retry later",
                    limits.max_connections_per_peer
                ),
            },
            ConnectionRefusal::MaxConnections => RawError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                code: ErrorCode::TooManyConnections,
                message: format!(
                    "the server has its limit of {} connections open \
                     (--http-max-connections / IDEM_HTTP_MAX_CONNECTIONS); retry later",
                    limits.max_connections
                ),
            },
        };
        error.to_http(Some(limits.retry_after()))
    }
}

/// An error answer written as bytes, outside hyper: the same
/// `{"error": {"code", "message"}}` body as [`ApiError`], and
/// `Connection: close`.
pub(super) struct RawError {
    pub(super) status: StatusCode,
    pub(super) code: ErrorCode,
    pub(super) message: String,
}

impl RawError {
    pub(super) fn to_http(&self, retry_after: Option<Duration>) -> Vec<u8> {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.as_str().to_owned(),
                message: self.message.clone(),
            },
        };
        let body = serde_json::to_string(&body)
            .unwrap_or_else(|e| unreachable!("an error body of two strings serialises: {e}"));
        let retry_after = retry_after
            .map(|wait| format!("retry-after: {}\r\n", retry_after_seconds(wait)))
            .unwrap_or_default();
        format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             {retry_after}connection: close\r\n\r\n{body}",
            self.status.as_str(),
            self.status.canonical_reason().unwrap_or(""),
            body.len(),
        )
        .into_bytes()
    }
}

/// A `Retry-After` value: whole seconds, rounded up, at least 1.
pub fn retry_after_seconds(wait: Duration) -> u64 {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    seconds.max(1)
}

/// Answers a connection refused at accept with `answer` (plain HTTP only:
/// a TLS client could not read it) and closes it. The accept loop does this
/// itself, without a task, so a refused connection never holds a descriptor
/// past this call.
pub(super) fn refuse_connection(stream: TcpStream, answer: Option<&[u8]>) {
    let Some(answer) = answer else {
        drop(stream);
        return;
    };
    // The standard library's socket writes at once; tokio's `try_write`
    // would wait for the reactor's first readiness event.
    let Ok(stream) = stream.into_std() else {
        return;
    };
    // A new socket's send buffer is empty: an answer of a few hundred bytes
    // fits, and the non-blocking write takes it whole.
    let _ = (&stream).write(answer);
    // Closing a socket with unread data resets it, and a reset can make the
    // client discard the answer: read what it has sent already.
    let mut sink = [0_u8; 4_096];
    let mut drained = 0;
    while drained < REFUSED_CONNECTION_DRAIN_BYTES {
        match (&stream).read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

impl HeadRejection {
    pub(super) fn error(self) -> RawError {
        match self {
            HeadRejection::UriTooLong => RawError {
                status: StatusCode::URI_TOO_LONG,
                code: ErrorCode::UriTooLong,
                message: format!(
                    "the request target (path and query) is longer than {MAX_URI_BYTES} bytes"
                ),
            },
            HeadRejection::HeadersTooLarge => RawError {
                status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                code: ErrorCode::HeadersTooLarge,
                message: format!(
                    "the request head (request line and header fields) is larger than \
                     {MAX_HEAD_BYTES} bytes or has more than {MAX_HEADER_FIELDS} header fields"
                ),
            },
            HeadRejection::Malformed => RawError {
                status: StatusCode::BAD_REQUEST,
                code: ErrorCode::MalformedRequest,
                message: "the request is not valid HTTP/1.1".to_owned(),
            },
        }
    }
}

impl RawError {
    pub(super) fn into_response(self) -> Response<axum::body::Body> {
        ApiError::new(self.status, self.code, self.message).into_response()
    }
}
