//! The event relay: tails the committed event log in sequence order and hands
//! each event to the MQTT event topics and to live SSE streams. Also prunes
//! relayed events past the retention limits.
//!
//! Reads only what is committed, so nothing is emitted that was not. Its
//! cursor is persisted after each batch, so a restart neither skips nor
//! republishes (but for the part of a batch a crash, or a shutdown past its
//! limit, cut short). Cancelled at shutdown, once every writer of this
//! process has stopped, it first relays what is committed by then.

use std::sync::Arc;
use std::time::Duration;

use rumqttc::QoS;
use sqlx::PgPool;
use tokio::sync::{broadcast, Notify};
use tokio_util::sync::CancellationToken;

use crate::mqtt::Publisher;
use crate::ops::metrics::Metrics;
use crate::store::events::{self, EventFilter, StoredEvent};

const CURSOR_NAME: &str = "relay";
const READ_BATCH: i64 = 2_000;
/// Fallback poll when no commit woke the relay (e.g. another instance wrote).
const POLL_INTERVAL: Duration = Duration::from_millis(500);
const PRUNE_INTERVAL: Duration = Duration::from_secs(60);

/// Retention of the event log.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    pub max_age: Duration,
    pub max_count: i64,
}

pub struct EventRelay {
    pub pool: PgPool,
    /// `None` when events over MQTT are switched off.
    pub mqtt: Option<(Publisher, QoS)>,
    pub live: broadcast::Sender<Arc<StoredEvent>>,
    pub wake: Arc<Notify>,
    pub metrics: Arc<Metrics>,
    pub retention: Retention,
}

impl EventRelay {
    pub async fn run(self, token: CancellationToken) {
        let mut cursor = loop {
            match events::load_cursor(&self.pool, CURSOR_NAME).await {
                Ok(c) => break c.unwrap_or(0),
                Err(e) => {
                    tracing::warn!(error = %e, "event relay cannot read its cursor; retrying");
                    if sleep_or_cancel(&token, Duration::from_secs(1)).await {
                        return;
                    }
                }
            }
        };
        let mut last_prune = tokio::time::Instant::now();
        loop {
            match self.relay_batch(cursor).await {
                Ok(Some(next)) => {
                    cursor = next;
                    continue;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "event relay read failed; retrying"),
            }
            if last_prune.elapsed() >= PRUNE_INTERVAL {
                last_prune = tokio::time::Instant::now();
                self.prune(cursor).await;
            }
            tokio::select! {
                () = token.cancelled() => break,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(POLL_INTERVAL) => {}
            }
        }
        self.catch_up(cursor).await;
    }

    /// Relays batch after batch until none is left, or until a read fails
    /// (the rest then goes out at the next start, from the cursor).
    async fn catch_up(&self, mut cursor: i64) {
        loop {
            match self.relay_batch(cursor).await {
                Ok(Some(next)) => cursor = next,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "the event relay stops before it caught up; it relays the rest at the next start"
                    );
                    return;
                }
            }
        }
    }

    /// Relays the next batch after `cursor`; `Some(new cursor)` if there was one.
    async fn relay_batch(&self, cursor: i64) -> Result<Option<i64>, crate::store::StoreError> {
        let batch = events::read(&self.pool, cursor, &EventFilter::default(), READ_BATCH).await?;
        let Some(last) = batch.last().map(|e| e.sequence) else {
            let committed = events::last_sequence(&self.pool).await?;
            self.metrics
                .event_log_lag
                .set((committed - cursor).max(0) as f64);
            return Ok(None);
        };
        for event in batch {
            if let Some((publisher, qos)) = &self.mqtt {
                let topic = publisher
                    .root()
                    .event_topic(&event.event_type, &event.subject);
                publisher
                    .publish_event(topic, *qos, event.cloudevent.to_string().into_bytes())
                    .await;
            }
            // No live subscriber is fine.
            let _ = self.live.send(Arc::new(event));
            self.metrics.events_published.increment(1);
        }
        events::save_cursor(&self.pool, CURSOR_NAME, last).await?;
        let committed = events::last_sequence(&self.pool).await?;
        self.metrics
            .event_log_lag
            .set((committed - last).max(0) as f64);
        Ok(Some(last))
    }

    async fn prune(&self, relayed: i64) {
        match events::prune(
            &self.pool,
            relayed,
            self.retention.max_age,
            self.retention.max_count,
        )
        .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, "pruned the event log"),
            Err(e) => tracing::warn!(error = %e, "pruning the event log failed"),
        }
    }
}

/// Sleeps; true if cancelled first.
async fn sleep_or_cancel(token: &CancellationToken, duration: Duration) -> bool {
    tokio::select! {
        () = token.cancelled() => true,
        () = tokio::time::sleep(duration) => false,
    }
}
