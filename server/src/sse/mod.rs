//! `GET /v1/events`: the event log as Server-Sent Events. One CloudEvent
//! (structured JSON) per message, `id:` = its gap-free sequence. Without
//! `Last-Event-ID` or `?after=` a stream starts at the live tail; with them it
//! replays from PostgreSQL (in pages, at `--sse-replay-rate`), then follows
//! the relay's live feed without gap or duplicate. A cursor older than what
//! the log retains first gets an explicit `reset` event.
//!
//! Owns the SSE client cap and one feeder task per client, which fills that
//! client's bounded queue; a client that does not drain it is dropped (a
//! final `dropped` event says where to resume). It must never hold more than
//! one replay page plus the client's queue per client, and never writes to
//! the database.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::Extension;
use futures::stream::Stream;
use metrics::Gauge;
use serde::Deserialize;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::broadcast;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::api_error::ApiError;
use crate::http::ConnectionCloser;
use crate::metrics::Metrics;
use crate::store::events::{self, EventFilter, StoredEvent};

mod feeder;
use feeder::{Feeder, Pacer};

/// Most events one replay query reads (fewer at low replay rates, so that a
/// page is sent within about a quarter of a second).
const REPLAY_PAGE: i64 = 500;
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Limits for the SSE clients of one server.
#[derive(Debug, Clone, Copy)]
pub struct SseSettings {
    pub max_clients: usize,
    /// Events queued per client.
    pub client_buffer: usize,
    /// A client whose queue stays full this long is dropped.
    pub send_timeout: Duration,
    /// Events per second while replaying from the database.
    pub replay_rate: u32,
}

impl SseSettings {
    pub fn from_config(config: &crate::Config) -> Self {
        Self {
            max_clients: config.sse_max_clients,
            client_buffer: config.sse_client_buffer,
            send_timeout: config.sse_send_timeout,
            replay_rate: config.sse_replay_rate,
        }
    }

    fn replay_page(&self) -> i64 {
        (i64::from(self.replay_rate) / 4).clamp(1, REPLAY_PAGE)
    }
}

/// The SSE clients of one server: the cap and what every stream shares.
#[derive(Clone)]
pub struct SseClients {
    slots: Arc<Semaphore>,
    settings: SseSettings,
    /// Ends every stream when the HTTP server stops.
    token: CancellationToken,
}

impl SseClients {
    pub fn new(settings: SseSettings, token: CancellationToken) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(settings.max_clients)),
            settings,
            token,
        }
    }
}

pub use crate::metrics::DropReason;

#[derive(Debug, Deserialize)]
pub struct EventQuery {
    /// Only this CloudEvents type, e.g. `io.idem.device.provisioned`.
    #[serde(rename = "type")]
    event_type: Option<String>,
    /// Only events about this device (the CloudEvents subject).
    device: Option<String>,
    /// Only events of this run.
    run: Option<Uuid>,
    /// Start after this sequence (as `Last-Event-ID` does); default: only new events.
    after: Option<i64>,
}

/// What `GET /v1/events` needs: the event log, the live feed, the client
/// cap and the client gauge; narrower than the handlers' state.
#[derive(Clone)]
pub struct SseState {
    pub pool: PgPool,
    pub clients: SseClients,
    pub live_events: broadcast::Sender<Arc<StoredEvent>>,
    pub metrics: Arc<Metrics>,
}

/// Where a stream starts: the live tail without a cursor, else after the
/// requested sequence; a cursor older than the log's first event starts at
/// that event, with a reset event queued in `first`.
async fn start_cursor(
    pool: &PgPool,
    requested: Option<i64>,
    first: &mut VecDeque<Event>,
) -> Result<i64, ApiError> {
    let Some(after) = requested else {
        return Ok(events::last_sequence(pool).await?);
    };
    let oldest = events::oldest_sequence(pool).await?;
    let last = events::last_sequence(pool).await?;
    let first_retained = oldest.unwrap_or(last + 1);
    if after + 1 < first_retained {
        first.push_back(reset_event(after, first_retained));
        Ok(first_retained - 1)
    } else {
        Ok(after)
    }
}

/// `GET /v1/events`: committed events as server-sent events, live or
/// resumed from a sequence.
pub async fn events(
    State(state): State<SseState>,
    closer: Option<Extension<ConnectionCloser>>,
    headers: HeaderMap,
    Query(query): Query<EventQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "invalid_last_event_id",
                        "Last-Event-ID must be an event sequence number",
                    )
                })?,
        ),
    };
    for (name, text) in [("type", &query.event_type), ("device", &query.device)] {
        if let Some(text) = text {
            crate::input::check_query_text(name, text)?;
        }
    }
    let sse = &state.clients;
    let Ok(permit) = sse.slots.clone().try_acquire_owned() else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_sse_clients",
            format!(
                "too many event streams open: the limit is {} concurrent clients (--sse-max-clients / IDEM_SSE_MAX_CLIENTS); retry later",
                sse.settings.max_clients
            ),
        ));
    };
    let slot = ClientSlot::new(permit, state.metrics.sse_clients.clone());
    let filter = EventFilter {
        run_id: query.run,
        event_type: query.event_type,
        subject: query.device,
    };
    // Subscribe before reading the log, so nothing committed in between is missed.
    let live = state.live_events.subscribe();
    let requested = last_event_id.or(query.after);
    let mut first = VecDeque::new();
    let cursor = start_cursor(&state.pool, requested, &mut first).await?;
    let (queue, receiver) = mpsc::channel(sse.settings.client_buffer);
    let (drop_notice, dropped) = oneshot::channel();
    let feeder = Feeder {
        pool: state.pool.clone(),
        filter,
        cursor,
        live,
        replaying: requested.is_some(),
        settings: sse.settings,
        queue,
        pacer: Pacer::new(sse.settings.replay_rate),
    };
    tokio::spawn(feeder.run(
        first,
        drop_notice,
        closer.map(|Extension(c)| c),
        state.metrics.clone(),
        sse.token.clone(),
    ));
    let stream = ClientStream {
        receiver,
        dropped: Some(dropped),
        last_delivered: cursor,
        done: false,
        _slot: slot,
    };
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)))
}

fn reset_event(requested: i64, first_retained: i64) -> Event {
    Event::default().event("reset").data(
        json!({
            "reason": "the requested position is older than the retained event log",
            "requested_after": requested,
            "resuming_from": first_retained,
        })
        .to_string(),
    )
}

fn dropped_event(reason: DropReason, resume_after: i64) -> Event {
    Event::default().event("dropped").data(
        json!({
            "reason": reason.as_str(),
            "resume_after": resume_after,
        })
        .to_string(),
    )
}

fn to_sse(row: &StoredEvent) -> Event {
    Event::default()
        .id(row.sequence.to_string())
        .data(row.cloudevent.to_string())
}

/// One queued message; `sequence` is `None` for control events (`reset`).
struct Queued {
    sequence: Option<i64>,
    event: Event,
}

/// One of the `--sse-max-clients` slots, counted in `idem_sse_clients`.
struct ClientSlot {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl ClientSlot {
    fn new(permit: OwnedSemaphorePermit, gauge: Gauge) -> Self {
        gauge.increment(1.0);
        Self {
            _permit: permit,
            gauge,
        }
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
    }
}

/// The response body's side of a client: drains the queue, remembers the
/// last sequence handed to the connection, and ends with a `dropped` event
/// when the feeder gives up on the client.
struct ClientStream {
    receiver: mpsc::Receiver<Queued>,
    /// `None` once the feeder ended without dropping the client.
    dropped: Option<oneshot::Receiver<DropReason>>,
    /// Highest sequence delivered (or the starting cursor): where to resume.
    last_delivered: i64,
    done: bool,
    /// Held for as long as the response lives.
    _slot: ClientSlot,
}

impl Stream for ClientStream {
    type Item = Result<Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(dropped) = this.dropped.as_mut() {
            match Pin::new(dropped).poll(cx) {
                Poll::Ready(Ok(reason)) => {
                    // What is still queued is discarded: the client resumes
                    // after the last event it was actually sent.
                    this.done = true;
                    this.receiver.close();
                    return Poll::Ready(Some(Ok(dropped_event(reason, this.last_delivered))));
                }
                Poll::Ready(Err(_)) => this.dropped = None,
                Poll::Pending => {}
            }
        }
        match this.receiver.poll_recv(cx) {
            Poll::Ready(Some(queued)) => {
                if let Some(sequence) = queued.sequence {
                    this.last_delivered = sequence;
                }
                Poll::Ready(Some(Ok(queued.event)))
            }
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    #[tokio::test(start_paused = true)]
    async fn the_pacer_sends_at_most_the_rate_per_second() {
        let mut pacer = Pacer::new(100);
        let start = Instant::now();
        for _ in 0..300 {
            pacer.wait().await;
        }
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(2_980), "{elapsed:?}");
        assert!(elapsed <= Duration::from_millis(3_010), "{elapsed:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_pause_the_pacer_bursts_at_most_its_slack() {
        let mut pacer = Pacer::new(1_000);
        pacer.wait().await;
        tokio::time::advance(Duration::from_secs(5)).await;
        let start = Instant::now();
        for _ in 0..100 {
            pacer.wait().await;
        }
        // 20 ms of slack = 20 events at once, the other 80 at 1 ms each.
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(75), "{elapsed:?}");
    }

    #[test]
    fn replay_pages_shrink_with_the_rate() {
        let settings = |replay_rate| SseSettings {
            max_clients: 1,
            client_buffer: 1,
            send_timeout: Duration::from_secs(1),
            replay_rate,
        };
        assert_eq!(settings(5_000).replay_page(), 500);
        assert_eq!(settings(200).replay_page(), 50);
        assert_eq!(settings(1).replay_page(), 1);
    }

    #[tokio::test]
    async fn a_dropped_stream_ends_with_where_to_resume_and_discards_the_queue() {
        let (queue, receiver) = mpsc::channel(8);
        let (notice, dropped) = oneshot::channel();
        let slots = Arc::new(Semaphore::new(1));
        let permit = slots.clone().try_acquire_owned().unwrap();
        let metrics = Metrics::new();
        let mut stream = ClientStream {
            receiver,
            dropped: Some(dropped),
            last_delivered: 10,
            done: false,
            _slot: ClientSlot::new(permit, metrics.sse_clients.clone()),
        };
        for sequence in [11, 12] {
            queue
                .send(Queued {
                    sequence: Some(sequence),
                    event: Event::default().data("x"),
                })
                .await
                .unwrap();
        }
        use futures::StreamExt;
        assert!(stream.next().await.is_some());
        assert_eq!(stream.last_delivered, 11);
        notice.send(DropReason::SendTimeout).unwrap();
        assert!(stream.next().await.is_some());
        assert!(stream.next().await.is_none());
        assert_eq!(stream.last_delivered, 11);
        assert!(queue.is_closed());
        drop(stream);
        assert_eq!(slots.available_permits(), 1);
    }
}
