//! The HTTP server's connection handling: our own accept loop (hyper HTTP/1.1,
//! optionally over TLS with tokio-rustls: the handshake runs in the
//! connection's task, bounded by the header timeout) with a cap on open
//! connections kept below the open-file limit, a header
//! read timeout, and a size limit and deadline on request bodies. On shutdown
//! it stops accepting, gives in-flight requests a short grace and closes what
//! is left.
//!
//! It owns sockets and connection tasks only: it knows no route and no
//! handler, and it never puts a deadline on a whole request (SSE streams last
//! as long as the client reads).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics::Gauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::api_error::ApiError;
use crate::metrics::Metrics;

/// Open files kept free for everything that is not an HTTP connection: the
/// database pool, the MQTT connection, the listener, logs, DNS, `/proc`.
pub const FD_RESERVE: u64 = 256;
/// How long in-flight requests may still run once shutdown begins.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Pause after an accept error that is not about one connection (e.g. the
/// process is out of file descriptors), so the loop never spins.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// The limits one server applies to its HTTP connections.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Open connections at most (already fitted to the open-file limit).
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub max_body_bytes: u64,
}

impl HttpLimits {
    /// The configured limits, with the connection cap lowered to fit the
    /// process's open-file limit (see [`fit_connection_cap`]).
    pub fn from_config(config: &crate::Config) -> Self {
        Self {
            max_connections: fit_connection_cap(config.http_max_connections),
            header_timeout: config.http_header_timeout,
            body_timeout: config.http_body_timeout,
            max_body_bytes: config.http_max_body_bytes,
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit and returns the
/// connection cap that fits under it: `configured`, or less (with a warning)
/// when the soft limit minus [`FD_RESERVE`] is smaller.
pub fn fit_connection_cap(configured: usize) -> usize {
    let soft = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(soft) => soft,
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the open-file limit; reading the current one");
            match rlimit::getrlimit(rlimit::Resource::NOFILE) {
                Ok((soft, _hard)) => soft,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the open-file limit; keeping --http-max-connections as configured");
                    return configured;
                }
            }
        }
    };
    let fitted = cap_for_fd_limit(configured, soft);
    if fitted < configured {
        tracing::warn!(
            configured,
            lowered_to = fitted,
            open_file_limit = soft,
            reserve = FD_RESERVE,
            "IDEM_HTTP_MAX_CONNECTIONS / --http-max-connections does not fit the open-file limit; \
             lowered it (raise `ulimit -n` / LimitNOFILE= to allow more)"
        );
    }
    fitted
}

/// The connection cap that leaves [`FD_RESERVE`] descriptors of `soft` free
/// (half of them when the limit is that small), never 0.
fn cap_for_fd_limit(configured: usize, soft: u64) -> usize {
    let budget = if soft > 2 * FD_RESERVE {
        soft - FD_RESERVE
    } else {
        soft / 2
    };
    let budget = usize::try_from(budget).unwrap_or(usize::MAX).max(1);
    configured.min(budget)
}

/// Lets a handler close the connection its request came on (e.g. an SSE
/// stream whose client stopped reading). Found in every request's extensions.
#[derive(Debug, Clone)]
pub struct ConnectionCloser(CancellationToken);

impl ConnectionCloser {
    pub fn close(&self) {
        self.0.cancel();
    }
}

pub use crate::metrics::BodyRejection;

impl BodyRejection {
    fn code(self) -> u8 {
        match self {
            BodyRejection::TooLarge => 1,
            BodyRejection::Timeout => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(BodyRejection::TooLarge),
            2 => Some(BodyRejection::Timeout),
            _ => None,
        }
    }

    fn response(self, limits: &HttpLimits) -> Response<axum::body::Body> {
        let error = match self {
            BodyRejection::TooLarge => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!(
                    "the request body is too large: the limit is {} bytes (--http-max-body-bytes / IDEM_HTTP_MAX_BODY_BYTES)",
                    limits.max_body_bytes
                ),
            ),
            BodyRejection::Timeout => ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
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

/// Serves `router` on `listener` until `token` is cancelled, then stops
/// accepting, lets in-flight requests finish for up to [`SHUTDOWN_GRACE`] and
/// closes the connections still open. With `tls`, every connection is TLS
/// (HTTPS); without, plain HTTP.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    tls: Option<Arc<rustls::ServerConfig>>,
    metrics: Arc<Metrics>,
    token: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let connections = TaskTracker::new();
    let tls = tls.map(TlsAcceptor::from);
    tracing::info!(
        max_connections = limits.max_connections,
        https = tls.is_some(),
        "HTTP server accepting connections"
    );
    loop {
        let accepted = tokio::select! {
            biased;
            () = token.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "accepting an HTTP connection failed; pausing briefly");
                tokio::select! {
                    () = token.cancelled() => break,
                    () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                }
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            // At the cap: close at once, so the client sees the refusal and
            // no descriptor is held.
            metrics.http_connections_refused.increment(1);
            drop(stream);
            continue;
        };
        let slot = ConnectionSlot::new(permit, metrics.http_connections.clone());
        connections.spawn(accept_connection(
            stream,
            tls.clone(),
            router.clone(),
            limits,
            metrics.clone(),
            token.clone(),
            slot,
        ));
    }
    drop(listener);
    connections.close();
    let open = connections.len();
    if open > 0 {
        tracing::info!(
            open,
            "HTTP server stopping; letting in-flight requests finish"
        );
    }
    // Every connection task bounds its own grace; this is a backstop.
    if tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(1), connections.wait())
        .await
        .is_err()
    {
        tracing::warn!("HTTP connections still open after the shutdown grace");
    }
}

/// Errors about one connection that went away before we accepted it.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// One of the `--http-max-connections` slots, counted in `idem_http_connections`.
struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl ConnectionSlot {
    fn new(permit: OwnedSemaphorePermit, gauge: Gauge) -> Self {
        gauge.increment(1.0);
        Self {
            _permit: permit,
            gauge,
        }
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
    }
}

/// Completes the TLS handshake (when serving HTTPS) within the header
/// timeout, so a client that never finishes one holds its slot no longer
/// than one that never sends a request, then serves the connection.
async fn accept_connection(
    stream: TcpStream,
    tls: Option<TlsAcceptor>,
    router: Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    token: CancellationToken,
    slot: ConnectionSlot,
) {
    let _ = stream.set_nodelay(true);
    let Some(acceptor) = tls else {
        return serve_connection(stream, router, limits, metrics, token, slot).await;
    };
    let handshake = tokio::select! {
        () = token.cancelled() => return,
        done = tokio::time::timeout(limits.header_timeout, acceptor.accept(stream)) => done,
    };
    match handshake {
        Ok(Ok(stream)) => serve_connection(stream, router, limits, metrics, token, slot).await,
        // A failed or slow handshake ends one connection; it is the
        // client's business (wrong CA, plain HTTP to the HTTPS port, …).
        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
        Err(_) => tracing::debug!("TLS handshake not completed within the header timeout"),
    }
}

async fn serve_connection<S>(
    stream: S,
    router: Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    token: CancellationToken,
    slot: ConnectionSlot,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let _slot = slot;
    let closer = CancellationToken::new();
    let request_closer = ConnectionCloser(closer.clone());
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        handle(
            request,
            router.clone(),
            limits,
            metrics.clone(),
            request_closer.clone(),
        )
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = closer.cancelled() => return,
        () = token.cancelled() => {
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                result = connection.as_mut() => result,
                () = tokio::time::sleep(SHUTDOWN_GRACE) => return,
                () = closer.cancelled() => return,
            }
        }
    };
    if let Err(e) = result {
        // Header timeouts, resets and malformed requests end one connection;
        // they are the client's business.
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}

/// Applies the body limits around one request and hands it to the router.
async fn handle(
    request: Request<Incoming>,
    router: Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    closer: ConnectionCloser,
) -> Result<Response<axum::body::Body>, Infallible> {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes) {
        metrics.http_rejected(BodyRejection::TooLarge).increment(1);
        return Ok(BodyRejection::TooLarge.response(&limits));
    }
    let tripped = Arc::new(AtomicU8::new(0));
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(closer);
    let body = GuardedBody {
        inner: body,
        remaining: limits.max_body_bytes,
        deadline: Box::pin(tokio::time::sleep(limits.body_timeout)),
        limits,
        tripped: tripped.clone(),
    };
    let request = Request::from_parts(parts, axum::body::Body::new(body));
    let response = match router.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    match BodyRejection::from_code(tripped.load(Ordering::Acquire)) {
        // The handler saw a failed body read; answer what really happened.
        Some(rejection) => {
            metrics.http_rejected(rejection).increment(1);
            Ok(rejection.response(&limits))
        }
        None => Ok(response),
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
/// and records which limit it hit for [`handle`].
struct GuardedBody {
    inner: Incoming,
    /// Bytes the body may still carry.
    remaining: u64,
    /// The whole body must have arrived by then (a trickling client cannot
    /// hold a connection by sending a byte now and then).
    deadline: Pin<Box<tokio::time::Sleep>>,
    limits: HttpLimits,
    tripped: Arc<AtomicU8>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_cap_leaves_the_reserve_of_the_open_file_limit_free() {
        assert_eq!(cap_for_fd_limit(4_096, 1_048_576), 4_096);
        assert_eq!(cap_for_fd_limit(4_096, 1_024), 1_024 - 256);
        assert_eq!(cap_for_fd_limit(4_096, 4_352), 4_096);
        assert_eq!(cap_for_fd_limit(4_096, 4_351), 4_095);
    }

    #[test]
    fn a_tiny_open_file_limit_still_allows_a_connection() {
        assert_eq!(cap_for_fd_limit(4_096, 300), 150);
        assert_eq!(cap_for_fd_limit(4_096, 1), 1);
        assert_eq!(cap_for_fd_limit(4_096, 0), 1);
    }

    #[test]
    fn rejection_codes_round_trip() {
        for rejection in BodyRejection::ALL {
            assert_eq!(BodyRejection::from_code(rejection.code()), Some(rejection));
        }
        assert_eq!(BodyRejection::from_code(0), None);
    }
}
