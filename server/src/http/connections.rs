//! The HTTP server's connection handling: our own accept loop (hyper HTTP/1.1,
//! optionally over TLS with tokio-rustls: the handshake runs in the
//! connection's task, bounded by the header timeout) with a cap on open
//! connections kept below the open-file limit and a share of it per client
//! address, a header read timeout, limits on the request head, and a size
//! limit and deadline on request bodies. Every refusal it answers is the
//! API's JSON error, including the answers hyper writes itself for heads it
//! cannot take. On shutdown it stops accepting, gives in-flight requests a
//! short grace and closes what is left.
//!
//! It owns sockets and connection tasks only: it knows no route and no
//! handler, and it never puts a deadline on a whole request (SSE streams last
//! as long as the client reads).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::io::{self, IoSlice, Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use idem_protocol::api::{ErrorBody, ErrorCode, ErrorDetail};
use metrics::Gauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::http::error::ApiError;
use crate::ops::metrics::Metrics;

/// Open files kept free for everything that is not an HTTP connection: the
/// database pool, the MQTT connection, the listener, logs, DNS, `/proc`.
pub const FD_RESERVE: u64 = 256;
/// How long in-flight requests may still run once shutdown begins.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Pause after an accept error that is not about one connection (e.g. the
/// process is out of file descriptors), so the loop never spins.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// Longest request target (path and query) a request may have: longer ones
/// get `414` `uri_too_long`. The API's paths and queries stay far below it.
pub const MAX_URI_BYTES: usize = 8 * 1024;
/// Largest request head (request line and header fields, also chunked
/// trailers) hyper accepts; a larger one gets `431` `headers_too_large`.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields in one request (hyper's own limit, which it keeps on
/// the stack); more get `431` `headers_too_large`.
pub const MAX_HEADER_FIELDS: usize = 100;
/// How long a connection whose request head was refused is still read
/// (and what it sends discarded) after the answer, so that closing it does
/// not reset it before the client has read the answer.
const REFUSED_HEAD_LINGER: Duration = Duration::from_secs(2);
/// Most bytes read and discarded in that time.
const REFUSED_HEAD_LINGER_BYTES: usize = 1024 * 1024;
/// Most bytes a connection refused at accept may already have sent that are
/// read and discarded before it is closed (for the same reason).
const REFUSED_CONNECTION_DRAIN_BYTES: usize = 64 * 1024;

/// The limits one server applies to its HTTP connections.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Open connections at most (as configured, until
    /// [`HttpLimits::fitted_to_open_files`] lowers it).
    pub max_connections: usize,
    /// Open connections from one client address ([`PeerGroup`]) at most;
    /// never more than `max_connections`.
    pub max_connections_per_peer: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub max_body_bytes: u64,
}

impl HttpLimits {
    /// These limits with the connection cap lowered to fit the process's
    /// open-file limit (see [`fit_connection_cap`]) and the per-address
    /// share lowered with it, in proportion.
    pub fn fitted_to_open_files(self) -> Self {
        let max_connections = fit_connection_cap(self.max_connections);
        let configured_share = self.max_connections_per_peer;
        let max_connections_per_peer =
            fit_peer_share(configured_share, self.max_connections, max_connections);
        if max_connections_per_peer < configured_share {
            tracing::warn!(
                configured = configured_share,
                lowered_to = max_connections_per_peer,
                "IDEM_HTTP_MAX_CONNECTIONS_PER_PEER / --http-max-connections-per-peer lowered \
                 with the connection cap, in proportion"
            );
        }
        Self {
            max_connections,
            max_connections_per_peer,
            ..self
        }
    }

    /// What refused connections are told to wait: by then the idle
    /// connections open now have been closed by the header timeout.
    fn retry_after(&self) -> Duration {
        self.header_timeout
    }
}

/// The per-address share of a connection cap lowered from `configured_cap`
/// to `fitted_cap`: lowered in the same proportion (rounded up), at least 1
/// and never more than the fitted cap.
fn fit_peer_share(share: usize, configured_cap: usize, fitted_cap: usize) -> usize {
    let fitted_cap = fitted_cap.max(1);
    let share = if fitted_cap < configured_cap {
        share.saturating_mul(fitted_cap).div_ceil(configured_cap)
    } else {
        share
    };
    share.clamp(1, fitted_cap)
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

/// The client address a connection is counted under for
/// `--http-max-connections-per-peer`, and what `sse` groups callers without
/// a token by. Found in every request's extensions.
///
/// IPv6 clients are grouped by their /64 network: a single host or site is
/// normally given a whole /64 (SLAAC and privacy addresses pick any address
/// in it), so counting single addresses would give one client 2^64 shares.
/// Clients behind one /64 share one share, as clients behind one IPv4 NAT
/// share their address. IPv4-mapped IPv6 addresses (a dual-stack listener)
/// count as their IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerGroup {
    V4(Ipv4Addr),
    /// The upper 64 bits of the address.
    V6Network(u64),
}

impl PeerGroup {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => PeerGroup::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerGroup::V4(v4),
                None => {
                    let [network @ .., _, _, _, _, _, _, _, _] = v6.octets();
                    PeerGroup::V6Network(u64::from_be_bytes(network))
                }
            },
        }
    }
}

impl fmt::Display for PeerGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerGroup::V4(v4) => write!(f, "{v4}"),
            PeerGroup::V6Network(network) => {
                let address = std::net::Ipv6Addr::from(u128::from(*network) << 64);
                write!(f, "{address}/64")
            }
        }
    }
}

/// Open connections per [`PeerGroup`], capped at a share of the connection
/// cap. Entries exist only while their address has a connection open, so
/// the table never holds more entries than there are open connections.
struct PeerConnections {
    max_per_peer: usize,
    /// Locked only for a lookup and an increment or decrement; never across
    /// an await.
    open: Mutex<HashMap<PeerGroup, usize>>,
}

impl PeerConnections {
    fn new(max_per_peer: usize) -> Arc<Self> {
        Arc::new(Self {
            max_per_peer,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for one more connection from `group`, or `None` when it has
    /// its share open.
    fn try_admit(self: &Arc<Self>, group: PeerGroup) -> Option<PeerSlot> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let count = open.entry(group).or_insert(0);
        if *count >= self.max_per_peer {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: self.clone(),
            group,
        })
    }
}

/// One connection of a [`PeerGroup`]'s share; released on drop.
struct PeerSlot {
    peers: Arc<PeerConnections>,
    group: PeerGroup,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self
            .peers
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Entry::Occupied(mut entry) = open.entry(self.group) {
            let count = entry.get_mut();
            *count = count.saturating_sub(1);
            if *count == 0 {
                entry.remove();
            }
        }
    }
}

pub use crate::ops::metrics::{BodyRejection, ConnectionRefusal, HeadRejection};

impl ConnectionRefusal {
    /// The JSON answer of a refused connection, written straight to its
    /// socket (no hyper connection is started for it).
    fn answer(self, limits: &HttpLimits) -> Vec<u8> {
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
struct RawError {
    status: StatusCode,
    code: ErrorCode,
    message: String,
}

impl RawError {
    fn to_http(&self, retry_after: Option<Duration>) -> Vec<u8> {
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
fn refuse_connection(stream: TcpStream, answer: Option<&[u8]>) {
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
    let peers = PeerConnections::new(limits.max_connections_per_peer);
    let connections = TaskTracker::new();
    let tls = tls.map(TlsAcceptor::from);
    // Refusals are answered in plain HTTP only; over HTTPS they are closed
    // unanswered (a TLS handshake per refusal would cost what refusing saves).
    let answers = tls
        .is_none()
        .then(|| ConnectionRefusal::ALL.map(|refusal| (refusal, refusal.answer(&limits))));
    let answer_for = |refusal: ConnectionRefusal| {
        answers.as_ref().and_then(|answers| {
            answers
                .iter()
                .find(|(r, _)| *r == refusal)
                .map(|(_, bytes)| bytes.as_slice())
        })
    };
    tracing::info!(
        max_connections = limits.max_connections,
        max_connections_per_peer = limits.max_connections_per_peer,
        https = tls.is_some(),
        "HTTP server accepting connections"
    );
    loop {
        let accepted = tokio::select! {
            biased;
            () = token.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "accepting an HTTP connection failed; pausing briefly");
                tokio::select! {
                    () = token.cancelled() => break,
                    () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                }
            }
        };
        // The address's share first: a connection over it never takes one
        // of the global slots, so one address cannot fill the global cap
        // and the slots beyond its share stay for everyone else.
        let group = PeerGroup::of(peer.ip());
        let Some(peer_slot) = peers.try_admit(group) else {
            metrics
                .http_connection_refused(ConnectionRefusal::PerPeer)
                .increment(1);
            tracing::debug!(peer = %group, "connection refused: its address has its share open");
            refuse_connection(stream, answer_for(ConnectionRefusal::PerPeer));
            continue;
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            // At the cap: answer and close at once, so the client sees the
            // refusal and no descriptor is held.
            drop(peer_slot);
            metrics
                .http_connection_refused(ConnectionRefusal::MaxConnections)
                .increment(1);
            refuse_connection(stream, answer_for(ConnectionRefusal::MaxConnections));
            continue;
        };
        let connection = Connection {
            peer: group,
            router: router.clone(),
            limits,
            metrics: metrics.clone(),
            token: token.clone(),
            _slot: ConnectionSlot::new(permit, peer_slot, metrics.http_connections.clone()),
        };
        connections.spawn(accept_connection(stream, tls.clone(), connection));
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

/// One of the `--http-max-connections` slots and of its address's share,
/// counted in `idem_http_connections`.
struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    _peer: PeerSlot,
    gauge: Gauge,
}

impl ConnectionSlot {
    fn new(permit: OwnedSemaphorePermit, peer: PeerSlot, gauge: Gauge) -> Self {
        gauge.increment(1.0);
        Self {
            _permit: permit,
            _peer: peer,
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
async fn accept_connection(stream: TcpStream, tls: Option<TlsAcceptor>, connection: Connection) {
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
struct Connection {
    peer: PeerGroup,
    router: Router,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    token: CancellationToken,
    /// Held until the connection is closed.
    _slot: ConnectionSlot,
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
                        () = tokio::time::sleep(SHUTDOWN_GRACE) => Err(Ended::Closed),
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

impl HeadRejection {
    fn error(self) -> RawError {
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
    fn into_response(self) -> Response<axum::body::Body> {
        ApiError::new(self.status, self.code, self.message).into_response()
    }
}

/// A connection's stream as hyper sees it. hyper answers a request head it
/// cannot take itself, before any handler runs and with an empty body: `400`
/// for one it cannot parse, `431` for a head over [`MAX_HEAD_BYTES`] or with
/// more than [`MAX_HEADER_FIELDS`] fields, `414` for a target over 65,534
/// bytes (which cannot fit in such a head; recognised all the same). This wrapper recognises such an answer as hyper writes it (one
/// of those statuses with `content-length: 0` at the start of a write: the
/// API's own error answers always carry a JSON body, and JSON and SSE bodies
/// never hold a bare CR LF) and writes the API's JSON error in its place;
/// hyper closes the connection after it.
struct JsonHeadErrors<S> {
    inner: S,
    /// Our answer in place of hyper's, and how much of it is written.
    replacement: Option<(Vec<u8>, usize)>,
    /// Set once hyper's answer was replaced.
    replaced: Option<HeadRejection>,
}

impl<S> JsonHeadErrors<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            replacement: None,
            replaced: None,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> JsonHeadErrors<S> {
    /// Takes `head` (hyper's answer) as written when it is one to replace.
    fn replace(&mut self, head: &[u8]) -> Option<usize> {
        if self.replaced.is_some() {
            return None;
        }
        let (rejection, len) = hyper_error_answer(head)?;
        self.replaced = Some(rejection);
        self.replacement = Some((rejection.error().to_http(None), 0));
        Some(len)
    }

    /// Writes what is left of the replacement answer.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((answer, written)) = self.replacement.as_mut() {
            if *written == answer.len() {
                self.replacement = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &answer[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        Poll::Ready(Ok(()))
    }

    /// After a replaced answer: writes what is left of it, then reads and
    /// discards what the client still sends for a while, so that closing
    /// does not reset the connection before the client has read the answer.
    async fn finish_refusal(&mut self) {
        let sent = async {
            std::future::poll_fn(|cx| self.poll_replacement(cx)).await?;
            self.inner.flush().await?;
            self.inner.shutdown().await
        };
        if !matches!(
            tokio::time::timeout(REFUSED_HEAD_LINGER, sent).await,
            Ok(Ok(()))
        ) {
            return;
        }
        let mut sink = vec![0_u8; 8_192];
        let mut drained = 0;
        let drain = async {
            while drained < REFUSED_HEAD_LINGER_BYTES {
                match self.inner.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => drained += n,
                }
            }
        };
        let _ = tokio::time::timeout(REFUSED_HEAD_LINGER, drain).await;
    }
}

/// hyper's own answer to a head it refused, at the start of `written`:
/// which one it is and its length (it has no body).
fn hyper_error_answer(written: &[u8]) -> Option<(HeadRejection, usize)> {
    let status = written
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| written.strip_prefix(b"HTTP/1.0 "))?;
    let rejection = match status.get(..4)? {
        b"400 " => HeadRejection::Malformed,
        b"414 " => HeadRejection::UriTooLong,
        b"431 " => HeadRejection::HeadersTooLarge,
        _ => return None,
    };
    let end = written.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = written[..end].to_ascii_lowercase();
    let empty = head
        .windows(b"\r\ncontent-length: 0\r\n".len())
        .any(|w| w == b"\r\ncontent-length: 0\r\n");
    empty.then_some((rejection, end))
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonHeadErrors<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for JsonHeadErrors<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        if let Some(taken) = this.replace(buf) {
            return Poll::Ready(Ok(taken));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        // hyper keeps a message head in a buffer of its own: it is the first
        // slice of a write.
        if let Some(first) = bufs.iter().find(|b| !b.is_empty()) {
            if let Some(taken) = this.replace(first) {
                return Poll::Ready(Ok(taken));
            }
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
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
    fn ipv6_clients_are_grouped_by_their_64_network_and_mapped_ipv4_by_its_address() {
        let group = |ip: &str| PeerGroup::of(ip.parse().unwrap());
        assert_eq!(group("2001:db8:1:2::1"), group("2001:db8:1:2:ffff::9"));
        assert_ne!(group("2001:db8:1:2::1"), group("2001:db8:1:3::1"));
        assert_eq!(group("::ffff:192.0.2.7"), group("192.0.2.7"));
        assert_ne!(group("192.0.2.7"), group("192.0.2.8"));
        assert_eq!(group("2001:db8:1:2::1").to_string(), "2001:db8:1:2::/64");
    }

    #[test]
    fn an_address_gets_its_share_of_connections_and_a_closed_one_frees_its_place() {
        let peers = PeerConnections::new(2);
        let a = PeerGroup::of("127.0.0.3".parse().unwrap());
        let b = PeerGroup::of("127.0.0.4".parse().unwrap());
        let first = peers.try_admit(a).unwrap();
        let second = peers.try_admit(a).unwrap();
        assert!(peers.try_admit(a).is_none());
        assert!(peers.try_admit(b).is_some());
        drop(first);
        assert!(peers.try_admit(a).is_some());
        drop(second);
        assert!(
            peers.open.lock().unwrap().is_empty(),
            "no entry is kept for an address without connections"
        );
    }

    #[test]
    fn the_peer_share_shrinks_with_a_lowered_connection_cap_and_never_exceeds_it() {
        assert_eq!(fit_peer_share(1_024, 4_096, 4_096), 1_024);
        assert_eq!(fit_peer_share(1_024, 4_096, 768), 192);
        assert_eq!(fit_peer_share(4_096, 4_096, 768), 768);
        assert_eq!(fit_peer_share(1, 4_096, 10), 1);
    }

    #[test]
    fn hypers_empty_error_answers_are_recognised_and_the_apis_own_are_not() {
        let hyper_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\n\r\n";
        assert_eq!(
            hyper_error_answer(hyper_431),
            Some((HeadRejection::HeadersTooLarge, hyper_431.len()))
        );
        let hyper_400 = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(
            hyper_error_answer(hyper_400).map(|(r, _)| r),
            Some(HeadRejection::Malformed)
        );
        let ours = RawError {
            status: StatusCode::BAD_REQUEST,
            code: ErrorCode::InvalidJson,
            message: "x".to_owned(),
        }
        .to_http(None);
        assert_eq!(hyper_error_answer(&ours), None);
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(hyper_error_answer(ok), None);
        assert_eq!(hyper_error_answer(b"HTTP/1.1 431 Request"), None);
    }

    #[test]
    fn a_refusal_at_accept_is_a_json_error_with_retry_after_and_connection_close() {
        let limits = HttpLimits {
            max_connections: 40,
            max_connections_per_peer: 10,
            header_timeout: Duration::from_millis(1_500),
            body_timeout: Duration::from_secs(1),
            max_body_bytes: 1_024,
        };
        let answer = String::from_utf8(ConnectionRefusal::PerPeer.answer(&limits)).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 429 Too Many Requests\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nretry-after: 2\r\n"), "{head}");
        assert!(head.contains("\r\nconnection: close"), "{head}");
        assert!(
            head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
            "{head}"
        );
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "too_many_connections_from_peer");
        let answer = ConnectionRefusal::MaxConnections.answer(&limits);
        assert!(answer.starts_with(b"HTTP/1.1 503 Service Unavailable\r\n"));
    }

    #[test]
    fn rejection_codes_round_trip() {
        for rejection in BodyRejection::ALL {
            assert_eq!(BodyRejection::from_code(rejection.code()), Some(rejection));
        }
        assert_eq!(BodyRejection::from_code(0), None);
    }
}
