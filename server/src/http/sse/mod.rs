//! `GET /v1/events`: the event log as Server-Sent Events. One CloudEvent
//! (structured JSON) per message, `id:` = its gap-free sequence. Without
//! `Last-Event-ID` or `?after=` a stream starts at the live tail; with them it
//! replays from PostgreSQL (in pages, at `--sse-replay-rate`), then follows
//! the relay's live feed without gap or duplicate. A cursor older than what
//! the log retains first gets an explicit `reset` event.
//!
//! Owns the SSE client cap (with a share per token and a reserve only admin
//! tokens may take) and one feeder task per client, which fills that
//! client's bounded queue; a client that does not drain it is dropped (a
//! final `dropped` event says where to resume). It must never hold more than
//! one replay page plus the client's queue per client, and never writes to
//! the database.

use idem_protocol::api::ErrorCode;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::stream::Stream;
use metrics::Gauge;
use serde::Deserialize;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::broadcast;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::http::auth::{Actor, Role};
use crate::http::connections::{retry_after_seconds, ConnectionCloser, PeerGroup};
use crate::http::error::ApiError;
use crate::http::extract::query_rejection;
use crate::ops::metrics::Metrics;
use crate::store::events::{self, EventFilter, StoredEvent};

mod feeder;
use feeder::{Feeder, Pacer};

impl SseSettings {
    fn replay_page(&self) -> i64 {
        (i64::from(self.replay_rate) / 4).clamp(1, SSE_REPLAY_PAGE)
    }
}

/// The SSE clients of one server: the slots and what every stream shares.
#[derive(Clone)]
pub struct SseClients {
    slots: Arc<Slots>,
    settings: SseSettings,
    /// Ends every stream when the HTTP server stops.
    token: CancellationToken,
}

impl SseClients {
    pub fn new(settings: SseSettings, token: CancellationToken) -> Self {
        Self {
            slots: Arc::new(Slots {
                settings,
                taken: Mutex::new(Taken::default()),
            }),
            settings,
            token,
        }
    }
}

/// Who a stream is counted under for `--sse-max-clients-per-token`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Holder {
    /// A token, by name.
    Token(String),
    /// Callers without a token (`--open-events`), by client address: each
    /// address gets the share of a token, and none of them the admin
    /// reserve. `None` only for a request that did not come through the
    /// HTTP server (tests calling the router directly).
    Anonymous(Option<PeerGroup>),
}

impl Holder {
    fn of(actor: Option<&Actor>, peer: Option<PeerGroup>) -> (Self, bool) {
        match actor {
            Some(actor) => (Holder::Token(actor.name.clone()), actor.role == Role::Admin),
            None => (Holder::Anonymous(peer), false),
        }
    }
}

/// The stream slots and who holds them.
struct Slots {
    settings: SseSettings,
    /// Locked for a check and an update only, never across an await.
    taken: Mutex<Taken>,
}

#[derive(Default)]
struct Taken {
    total: usize,
    /// Held by callers that are not admins.
    not_admin: usize,
    /// Held per token (or anonymous address); entries with streams only.
    per_holder: HashMap<Holder, usize>,
}

impl Slots {
    /// A slot for `holder`, or why there is none: the holder's share is
    /// taken, every slot is, or every slot but the admin reserve is and the
    /// caller is not an admin.
    fn try_take(
        self: &Arc<Self>,
        holder: Holder,
        admin: bool,
        gauge: Gauge,
    ) -> Result<ClientSlot, SseRefusal> {
        let settings = &self.settings;
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        let held = taken.per_holder.get(&holder).copied().unwrap_or(0);
        if held >= settings.max_clients_per_token {
            return Err(SseRefusal::PerToken);
        }
        if taken.total >= settings.max_clients {
            return Err(SseRefusal::MaxClients);
        }
        if !admin && taken.not_admin >= settings.max_clients - settings.admin_reserve {
            return Err(SseRefusal::AdminReserve);
        }
        taken.total += 1;
        if !admin {
            taken.not_admin += 1;
        }
        *taken.per_holder.entry(holder.clone()).or_insert(0) += 1;
        drop(taken);
        gauge.increment(1.0);
        Ok(ClientSlot {
            slots: self.clone(),
            holder,
            admin,
            gauge,
        })
    }

    fn release(&self, holder: &Holder, admin: bool) {
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        taken.total = taken.total.saturating_sub(1);
        if !admin {
            taken.not_admin = taken.not_admin.saturating_sub(1);
        }
        if let Entry::Occupied(mut entry) = taken.per_holder.entry(holder.clone()) {
            let held = entry.get_mut();
            *held = held.saturating_sub(1);
            if *held == 0 {
                entry.remove();
            }
        }
    }
}

pub use crate::config::SseSettings;
pub use crate::ops::metrics::{DropReason, SseRefusal};
use crate::tuning::{SSE_KEEP_ALIVE, SSE_REFUSED_RETRY_AFTER, SSE_REPLAY_PAGE};

impl SseRefusal {
    fn answer(self, settings: &SseSettings, holder: &Holder) -> Response {
        let error = match self {
            SseRefusal::PerToken => {
                let who = match holder {
                    Holder::Token(name) => format!("the token {name:?} has"),
                    Holder::Anonymous(_) => {
                        "callers without a token from your address have".to_owned()
                    }
                };
                ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    ErrorCode::TooManySseClientsForToken,
                    format!(
                        "{who} {} event streams open, the most one token may hold \
                         (--sse-max-clients-per-token / IDEM_SSE_MAX_CLIENTS_PER_TOKEN); \
                         close one or retry later",
                        settings.max_clients_per_token
                    ),
                )
            }
            SseRefusal::AdminReserve => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::SseClientsReservedForAdmins,
                format!(
                    "the free event streams are kept for admin tokens: {} of the {} \
                     (--sse-max-clients / IDEM_SSE_MAX_CLIENTS) are reserved; retry later",
                    settings.admin_reserve, settings.max_clients
                ),
            ),
            SseRefusal::MaxClients => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::TooManySseClients,
                format!(
                    "too many event streams open: the limit is {} concurrent clients \
                     (--sse-max-clients / IDEM_SSE_MAX_CLIENTS); retry later",
                    settings.max_clients
                ),
            ),
        };
        let mut response = error.into_response();
        response.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_seconds(SSE_REFUSED_RETRY_AFTER)),
        );
        response
    }
}

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
#[utoipa::path(get, path = "/v1/events", tag = "events",
    params(
        ("type" = Option<String>, Query, description = "only events of this type"),
        ("device" = Option<String>, Query, description = "only events about this device"),
        ("run" = Option<uuid::Uuid>, Query, description = "only events of this run"),
        ("after" = Option<i64>, Query, minimum = 0, description = "start after this sequence (as Last-Event-ID does)"),
    ),
    responses((status = 200, content_type = "text/event-stream", body = String, description = "CloudEvents, one per SSE event"),
        (status = "4XX", body = idem_protocol::api::ErrorBody)))]
pub async fn events(
    State(state): State<SseState>,
    closer: Option<Extension<ConnectionCloser>>,
    actor: Option<Extension<Actor>>,
    peer: Option<Extension<PeerGroup>>,
    headers: HeaderMap,
    query: Result<Query<EventQuery>, QueryRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, Response> {
    let Query(query) = query.map_err(|rejection| query_rejection(&rejection).into_response())?;
    let caller = Caller {
        actor: actor.map(|Extension(a)| a),
        peer: peer.map(|Extension(p)| p),
    };
    stream_events(state, closer, caller, headers, query)
        .await
        .map_err(|refused| match refused {
            Refused::Api(error) => error.into_response(),
            Refused::Answered(response) => response,
        })
}

/// Who asks for a stream: the token's actor (none for callers without a
/// token) and the client address.
struct Caller {
    actor: Option<Actor>,
    peer: Option<PeerGroup>,
}

/// Why no stream was opened.
enum Refused {
    Api(ApiError),
    /// A refusal with its own headers (`Retry-After`).
    Answered(Response),
}

impl From<ApiError> for Refused {
    fn from(error: ApiError) -> Self {
        Refused::Api(error)
    }
}

async fn stream_events(
    state: SseState,
    closer: Option<Extension<ConnectionCloser>>,
    caller: Caller,
    headers: HeaderMap,
    query: EventQuery,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, Refused> {
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request(
                        ErrorCode::InvalidLastEventId,
                        "Last-Event-ID must be an event sequence number",
                    )
                })?,
        ),
    };
    for (name, text) in [("type", &query.event_type), ("device", &query.device)] {
        if let Some(text) = text {
            crate::http::input::check_query_text(name, text).map_err(ApiError::from)?;
        }
    }
    let sse = &state.clients;
    let (holder, admin) = Holder::of(caller.actor.as_ref(), caller.peer);
    let slot = match sse
        .slots
        .try_take(holder.clone(), admin, state.metrics.sse_clients.clone())
    {
        Ok(slot) => slot,
        Err(refusal) => {
            state.metrics.sse_refused(refusal).increment(1);
            return Err(Refused::Answered(refusal.answer(&sse.settings, &holder)));
        }
    };
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
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE)))
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

/// One of the `--sse-max-clients` slots, held by `holder`, counted in
/// `idem_sse_clients`; released on drop.
struct ClientSlot {
    slots: Arc<Slots>,
    holder: Holder,
    admin: bool,
    gauge: Gauge,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.slots.release(&self.holder, self.admin);
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
    use crate::config::admin_reserve;
    use std::time::Duration;
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
            max_clients_per_token: 1,
            admin_reserve: 0,
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
        let slots = test_slots(1, 1);
        let metrics = Metrics::new();
        let slot = slots
            .try_take(token("a"), true, metrics.sse_clients.clone())
            .unwrap();
        let mut stream = ClientStream {
            receiver,
            dropped: Some(dropped),
            last_delivered: 10,
            done: false,
            _slot: slot,
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
        assert_eq!(slots.taken.lock().unwrap().total, 0);
        assert!(metrics.render().contains("idem_sse_clients 0"));
    }

    fn test_slots(max_clients: usize, max_clients_per_token: usize) -> Arc<Slots> {
        let settings = SseSettings {
            max_clients,
            max_clients_per_token,
            admin_reserve: admin_reserve(max_clients),
            client_buffer: 1,
            send_timeout: Duration::from_secs(1),
            replay_rate: 1,
        };
        SseClients::new(settings, CancellationToken::new()).slots
    }

    fn token(name: &str) -> Holder {
        Holder::Token(name.to_owned())
    }

    #[test]
    fn the_admin_reserve_is_a_quarter_of_the_slots_and_never_all_of_them() {
        assert_eq!(admin_reserve(1), 0);
        assert_eq!(admin_reserve(2), 1);
        assert_eq!(admin_reserve(8), 2);
        assert_eq!(admin_reserve(64), 16);
    }

    #[test]
    fn one_token_holds_at_most_its_share_and_a_released_slot_is_reusable() {
        let slots = test_slots(8, 2);
        let gauge = Metrics::new().sse_clients.clone();
        let first = slots.try_take(token("v"), false, gauge.clone()).unwrap();
        let _second = slots.try_take(token("v"), false, gauge.clone()).unwrap();
        let third = slots.try_take(token("v"), false, gauge.clone());
        assert_eq!(third.err(), Some(SseRefusal::PerToken));
        assert!(slots.try_take(token("w"), false, gauge.clone()).is_ok());
        drop(first);
        assert!(slots.try_take(token("v"), false, gauge).is_ok());
    }

    #[test]
    fn callers_that_are_not_admins_never_take_the_reserve() {
        let slots = test_slots(8, 8);
        let gauge = Metrics::new().sse_clients.clone();
        let viewers: Vec<_> = (0..6)
            .map(|i| slots.try_take(token(&format!("v{i}")), false, gauge.clone()))
            .collect::<Result<_, _>>()
            .unwrap();
        let refused = slots.try_take(token("v9"), false, gauge.clone());
        assert_eq!(refused.err(), Some(SseRefusal::AdminReserve));
        let anonymous = slots.try_take(Holder::Anonymous(None), false, gauge.clone());
        assert_eq!(anonymous.err(), Some(SseRefusal::AdminReserve));
        let admins: Vec<_> = (0..2)
            .map(|_| slots.try_take(token("root"), true, gauge.clone()))
            .collect::<Result<_, _>>()
            .unwrap();
        let full = slots.try_take(token("root2"), true, gauge.clone());
        assert_eq!(full.err(), Some(SseRefusal::MaxClients));
        drop((viewers, admins));
        assert_eq!(slots.taken.lock().unwrap().per_holder.len(), 0);
    }
}
