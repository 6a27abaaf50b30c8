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
//!
//! The accept loop and the connection cap are here; the rest by topic:
//! `limits` (the configured limits, fitted under the open-file limit),
//! `peers` (client addresses and each one's share of the cap),
//! `connection` (one connection: TLS handshake, hyper, per-request limits),
//! `body_limits` (the size limit and deadline of request bodies),
//! `error_answers` (the API's JSON error written as raw bytes, outside hyper)
//! and `hyper_head_errors` (hyper's own answers to heads it refused,
//! replaced by that JSON error).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use metrics::Gauge;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::ops::metrics::Metrics;

mod body_limits;
mod connection;
mod error_answers;
mod hyper_head_errors;
mod limits;
mod peers;
#[cfg(test)]
mod tests;

pub use connection::ConnectionCloser;
pub use error_answers::retry_after_seconds;
pub use limits::HttpLimits;
pub use peers::PeerGroup;
// Why connections, heads and bodies are refused: label values of the metrics.
pub use crate::ops::metrics::{BodyRejection, ConnectionRefusal, HeadRejection};

use crate::tuning::{ACCEPT_ERROR_PAUSE, HTTP_SHUTDOWN_GRACE};
use connection::{accept_connection, Connection};
use error_answers::refuse_connection;
use peers::{PeerConnections, PeerSlot};

/// Longest request target (path and query) a request may have: longer ones
/// get `414` `uri_too_long`. The API's paths and queries stay far below it.
pub const MAX_URI_BYTES: usize = 8 * 1024;
/// Largest request head (request line and header fields, also chunked
/// trailers) hyper accepts; a larger one gets `431` `headers_too_large`.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields in one request (hyper's own limit, which it keeps on
/// the stack); more get `431` `headers_too_large`.
pub const MAX_HEADER_FIELDS: usize = 100;

/// Serves `router` on `listener` until `token` is cancelled, then stops
/// accepting, lets in-flight requests finish for up to [`HTTP_SHUTDOWN_GRACE`] and
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
    if tokio::time::timeout(
        HTTP_SHUTDOWN_GRACE + Duration::from_secs(1),
        connections.wait(),
    )
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
