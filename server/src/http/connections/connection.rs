//! One accepted connection: its TLS handshake (bounded by the header
//! timeout), hyper's HTTP/1.1 on it until it ends or shutdown's grace runs
//! out, and the limits on each request's target and body before the router
//! sees it.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use axum::http::{header, HeaderValue, Request, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::body_limits::GuardedBody;
use super::hyper_head_errors::JsonHeadErrors;
use super::limits::HttpLimits;
use super::peers::PeerGroup;
use super::{BodyRejection, HeadRejection};
use super::{ConnectionSlot, MAX_HEAD_BYTES, MAX_URI_BYTES};
use crate::ops::metrics::Metrics;
use crate::tuning::HTTP_SHUTDOWN_GRACE;

/// Lets a handler close the connection its request came on (e.g. an SSE
/// stream whose client stopped reading). Found in every request's extensions.
#[derive(Debug, Clone)]
pub struct ConnectionCloser(CancellationToken);

impl ConnectionCloser {
    pub fn close(&self) {
        self.0.cancel();
    }
}

/// Completes the TLS handshake (when serving HTTPS) within the header
/// timeout, so a client that never finishes one holds its slot no longer
/// than one that never sends a request, then serves the connection.
pub(super) async fn accept_connection(
    stream: TcpStream,
    tls: Option<TlsAcceptor>,
    connection: Connection,
) {
    let _ = stream.set_nodelay(true);
    let Some(acceptor) = tls else {
        return connection.serve(stream).await;
    };
    let handshake = tokio::select! {
        () = connection.token.cancelled() => return,
        done = tokio::time::timeout(connection.limits.header_timeout, acceptor.accept(stream)) => done,
    };
    match handshake {
        Ok(Ok(stream)) => connection.serve(stream).await,
        // A failed or slow handshake ends one connection; it is the
        // client's business (wrong CA, plain HTTP to the HTTPS port, …).
        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
        Err(_) => tracing::debug!("TLS handshake not completed within the header timeout"),
    }
}

/// What one accepted connection is served with.
pub(super) struct Connection {
    pub(super) peer: PeerGroup,
    pub(super) router: Router,
    pub(super) limits: HttpLimits,
    pub(super) metrics: Arc<Metrics>,
    pub(super) token: CancellationToken,
    /// Held until the connection is closed.
    pub(super) _slot: ConnectionSlot,
}

/// How hyper's side of a connection ended.
enum Ended {
    /// hyper finished (the client closed, a timeout, an error).
    Finished,
    /// A handler closed it, or the shutdown grace ran out.
    Closed,
}

impl Connection {
    async fn serve<S>(self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let closer = CancellationToken::new();
        let request_closer = ConnectionCloser(closer.clone());
        let (router, limits, metrics, peer) = (
            self.router.clone(),
            self.limits,
            self.metrics.clone(),
            self.peer,
        );
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            handle(
                request,
                router.clone(),
                limits,
                metrics.clone(),
                request_closer.clone(),
                peer,
            )
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_header_size(MAX_HEAD_BYTES)
            .keep_alive(true);
        let mut io = JsonHeadErrors::new(stream);
        let ended = {
            let connection = builder.serve_connection(TokioIo::new(&mut io), service);
            tokio::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => Ok(result),
                () = closer.cancelled() => Err(Ended::Closed),
                () = self.token.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    tokio::select! {
                        result = connection.as_mut() => Ok(result),
                        () = tokio::time::sleep(HTTP_SHUTDOWN_GRACE) => Err(Ended::Closed),
                        () = closer.cancelled() => Err(Ended::Closed),
                    }
                }
            };
            match result {
                Ok(Ok(())) => Ended::Finished,
                Ok(Err(e)) => {
                    // Header timeouts, resets and malformed requests end one
                    // connection; they are the client's business.
                    tracing::debug!(error = %e, "HTTP connection ended with an error");
                    Ended::Finished
                }
                Err(closed) => closed,
            }
        };
        match (ended, io.replaced) {
            (Ended::Finished, Some(rejection)) => {
                self.metrics.http_head_rejected(rejection).increment(1);
                tokio::select! {
                    () = self.token.cancelled() => {}
                    () = io.finish_refusal() => {}
                }
            }
            (Ended::Finished, None) | (Ended::Closed, _) => {}
        }
    }
}

/// Applies the target and body limits around one request and hands it to
/// the router.
async fn handle(
    request: Request<Incoming>,
    router: Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    closer: ConnectionCloser,
    peer: PeerGroup,
) -> Result<Response<axum::body::Body>, Infallible> {
    let uri = request.uri();
    let target_len = uri.path_and_query().map_or(0, |p| p.as_str().len())
        + uri.authority().map_or(0, |a| a.as_str().len());
    if target_len > MAX_URI_BYTES {
        metrics
            .http_head_rejected(HeadRejection::UriTooLong)
            .increment(1);
        let mut response = HeadRejection::UriTooLong.error().into_response();
        // The body (if any) is not read: the connection cannot be reused.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Ok(response);
    }
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
    parts.extensions.insert(peer);
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
