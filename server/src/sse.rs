//! `GET /v1/events`: the event log as Server-Sent Events. One CloudEvent
//! (structured JSON) per message, `id:` = its gap-free sequence. Resumes after
//! `Last-Event-ID` (or `?after=`) by replaying from PostgreSQL, then follows
//! the relay's live feed without gap or duplicate. A cursor older than what
//! the log retains first gets an explicit `reset` event.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::stream::{self, Stream};
use serde::Deserialize;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::broadcast::{self, error::RecvError};
use uuid::Uuid;

use crate::api::ApiError;
use crate::app::AppState;
use crate::store::events::{self, EventFilter, StoredEvent};

const REPLAY_PAGE: i64 = 500;

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

pub async fn events(
    State(state): State<Arc<AppState>>,
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
    let filter = EventFilter {
        run_id: query.run,
        event_type: query.event_type,
        subject: query.device,
    };
    // Subscribe before reading the log, so nothing committed in between is missed.
    let live = state.live_events.subscribe();
    let requested = last_event_id.or(query.after);
    let mut pending = VecDeque::new();
    let cursor = match requested {
        None => events::last_sequence(&state.pool).await?,
        Some(after) => {
            let oldest = events::oldest_sequence(&state.pool).await?;
            let last = events::last_sequence(&state.pool).await?;
            let first_retained = oldest.unwrap_or(last + 1);
            if after + 1 < first_retained {
                pending.push_back(reset_event(after, first_retained));
                first_retained - 1
            } else {
                after
            }
        }
    };
    let reader = Reader {
        pool: state.pool.clone(),
        filter,
        cursor,
        live,
        pending,
        replaying: requested.is_some(),
    };
    let stream = stream::unfold(reader, |mut reader| async move {
        let event = reader.next().await?;
        Some((Ok(event), reader))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
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

struct Reader {
    pool: PgPool,
    filter: EventFilter,
    /// Highest sequence already delivered or skipped.
    cursor: i64,
    live: broadcast::Receiver<Arc<StoredEvent>>,
    pending: VecDeque<Event>,
    /// Reading from the database until caught up with the live feed.
    replaying: bool,
}

impl Reader {
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if self.replaying {
                match events::read(&self.pool, self.cursor, &self.filter, REPLAY_PAGE).await {
                    Ok(rows) => {
                        self.replaying = rows.len() as i64 == REPLAY_PAGE;
                        for row in rows {
                            self.cursor = row.sequence;
                            self.pending.push_back(to_sse(&row));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "SSE replay failed; ending the stream so the client resumes");
                        return None;
                    }
                }
                continue;
            }
            match self.live.recv().await {
                Ok(row) => {
                    if row.sequence > self.cursor {
                        self.cursor = row.sequence;
                        if self.filter.matches(&row) {
                            return Some(to_sse(&row));
                        }
                    }
                }
                // Fell behind the live feed: catch up from the database.
                Err(RecvError::Lagged(_)) => self.replaying = true,
                Err(RecvError::Closed) => return None,
            }
        }
    }
}

fn to_sse(row: &StoredEvent) -> Event {
    Event::default()
        .id(row.sequence.to_string())
        .data(row.cloudevent.to_string())
}
