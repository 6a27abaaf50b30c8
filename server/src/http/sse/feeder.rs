//! The per-client feeder of an event stream: replays from the database at
//! a bounded rate (the `Pacer`), then forwards the live feed, into the
//! client's bounded queue; gives up on a client that does not keep up. It
//! never answers HTTP itself.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::Event;
use sqlx::PgPool;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::sync::mpsc::error::SendTimeoutError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{to_sse, DropReason, Queued, SseSettings};
use crate::http::connections::ConnectionCloser;
use crate::ops::metrics::Metrics;
use crate::store::events::{EventFilter, StoredEvent};
use crate::tuning::{SSE_DROP_GRACE, SSE_PACING_SLACK};

/// How a feeder stopped.
enum End {
    /// The client went away (or the server is stopping).
    Gone,
    /// Reading the log failed; the stream ends and the client resumes.
    Failed,
    Dropped(DropReason),
}

/// The per-client task: replays from the database at a bounded rate, then
/// forwards the live feed, into the client's bounded queue.
pub(super) struct Feeder {
    pub(super) pool: PgPool,
    pub(super) filter: EventFilter,
    /// Highest sequence already queued or skipped.
    pub(super) cursor: i64,
    pub(super) live: broadcast::Receiver<Arc<StoredEvent>>,
    /// Reading from the database until caught up with the live feed.
    pub(super) replaying: bool,
    pub(super) settings: SseSettings,
    pub(super) queue: mpsc::Sender<Queued>,
    pub(super) pacer: Pacer,
}

impl Feeder {
    pub(super) async fn run(
        mut self,
        first: VecDeque<Event>,
        drop_notice: oneshot::Sender<DropReason>,
        closer: Option<ConnectionCloser>,
        metrics: Arc<Metrics>,
        token: CancellationToken,
    ) {
        let queue = self.queue.clone();
        let end = tokio::select! {
            () = token.cancelled() => End::Gone,
            () = queue.closed() => End::Gone,
            end = self.feed(first) => end,
        };
        match end {
            End::Gone | End::Failed => {}
            End::Dropped(reason) => {
                metrics.sse_dropped(reason).increment(1);
                tracing::info!(
                    reason = reason.as_str(),
                    "SSE client dropped: it did not keep up with its stream"
                );
                let _ = drop_notice.send(reason);
                // A client that reads nothing never sees the final event:
                // close its connection so its buffers are freed.
                tokio::select! {
                    () = queue.closed() => {}
                    () = token.cancelled() => {}
                    () = tokio::time::sleep(SSE_DROP_GRACE) => {
                        if let Some(closer) = closer {
                            closer.close();
                        }
                    }
                }
            }
        }
    }

    async fn feed(&mut self, first: VecDeque<Event>) -> End {
        for event in first {
            if let Err(end) = self.send(None, event).await {
                return end;
            }
        }
        let page = self.settings.replay_page();
        loop {
            if self.replaying {
                // A fresh subscription before each page: what the relay sends
                // from now on is in it, what it sent before is in the page.
                self.live = self.live.resubscribe();
                let rows = match crate::events::log::read(
                    &self.pool,
                    self.cursor,
                    &self.filter,
                    page,
                )
                .await
                {
                    Ok(rows) => rows,
                    Err(e) => {
                        tracing::warn!(error = %e, "SSE replay failed; ending the stream so the client resumes");
                        return End::Failed;
                    }
                };
                self.replaying = i64::try_from(rows.len()).unwrap_or(i64::MAX) == page;
                for row in rows {
                    self.pacer.wait().await;
                    self.cursor = row.sequence;
                    if let Err(end) = self.send(Some(row.sequence), to_sse(&row)).await {
                        return end;
                    }
                }
                continue;
            }
            match self.live.recv().await {
                Ok(row) => {
                    if row.sequence <= self.cursor {
                        continue;
                    }
                    if self.live.len() > self.settings.client_buffer {
                        return End::Dropped(DropReason::Lagged);
                    }
                    self.cursor = row.sequence;
                    if self.filter.matches(&row) {
                        if let Err(end) = self.send(Some(row.sequence), to_sse(&row)).await {
                            return end;
                        }
                    }
                }
                Err(RecvError::Lagged(_)) => return End::Dropped(DropReason::Lagged),
                Err(RecvError::Closed) => return End::Gone,
            }
        }
    }

    async fn send(&self, sequence: Option<i64>, event: Event) -> Result<(), End> {
        match self
            .queue
            .send_timeout(Queued { sequence, event }, self.settings.send_timeout)
            .await
        {
            Ok(()) => Ok(()),
            Err(SendTimeoutError::Timeout(_)) => Err(End::Dropped(DropReason::SendTimeout)),
            Err(SendTimeoutError::Closed(_)) => Err(End::Gone),
        }
    }
}

/// Spaces replayed events evenly at `rate` per second.
pub(super) struct Pacer {
    interval: Duration,
    next: Instant,
}

impl Pacer {
    pub(super) fn new(rate: u32) -> Self {
        Self {
            interval: Duration::from_secs(1) / rate.max(1),
            next: Instant::now(),
        }
    }

    /// Waits until the next event may be sent.
    pub(super) async fn wait(&mut self) {
        let now = Instant::now();
        if self.next > now {
            tokio::time::sleep_until(self.next).await;
        } else if now.duration_since(self.next) > SSE_PACING_SLACK {
            // After a pause (slow client, slow query) no long burst.
            self.next = now - SSE_PACING_SLACK;
        }
        self.next += self.interval;
    }
}
