//! The event relay: tails the committed event log in sequence order and hands
//! each event to the MQTT event topics and to live SSE streams. Also prunes
//! relayed events past the retention limits.
//!
//! Every instance follows the log for its own SSE streams (an instance
//! without the lease and without a stream reads only the log's tail, not
//! its events); only the holder of
//! the `relay` lease (`store::leases`) publishes to MQTT, saves the shared
//! cursor and prunes, so an event leaves over MQTT once however many
//! instances run. The cursor is saved fenced by the lease's epoch: a holder
//! paused past its lease saves nothing, and the next holder starts from the
//! last saved cursor (what a paused holder published after it again: at
//! least once, at most one batch).
//!
//! Reads only what is committed, so nothing is emitted that was not. Its
//! cursor is persisted after each batch, so a restart neither skips nor
//! republishes (but for the part of a batch a crash, or a shutdown past its
//! limit, cut short). Cancelled at shutdown, once every writer of this
//! process has stopped, it first relays what is committed by then, then
//! lets its lease expire at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rumqttc::QoS;
use sqlx::PgPool;
use tokio::sync::{broadcast, Notify};
use tokio_util::sync::CancellationToken;

use crate::mqtt::Publisher;
use crate::ops::metrics::Metrics;
use crate::store::events::{self, EventFilter, StoredEvent};
use crate::store::leases::{self, Held, LeaseHolder};

pub use crate::config::Retention;
use crate::tuning::{
    RELAY_ACKED_WITHIN, RELAY_POLL_INTERVAL, RELAY_PRUNE_INTERVAL, RELAY_READ_BATCH,
};

const CURSOR_NAME: &str = "relay";
/// The lease whose holder publishes the log to MQTT.
pub const RELAY_LEASE: &str = "relay";

pub struct EventRelay {
    pub pool: PgPool,
    /// `None` when events over MQTT are switched off.
    pub mqtt: Option<(Publisher, QoS)>,
    pub live: broadcast::Sender<Arc<StoredEvent>>,
    pub wake: Arc<Notify>,
    pub metrics: Arc<Metrics>,
    pub retention: Retention,
    /// This process's claim on the `relay` lease.
    pub lease: LeaseHolder,
    /// Mirrors whether the lease is held, for `/readyz`.
    pub held: Arc<AtomicBool>,
}

/// Where the relay has got to.
#[derive(Debug, Clone, Copy)]
struct Cursors {
    /// The last event handed to this process's SSE streams.
    live: i64,
    /// While holding the lease: the epoch, and the last event published
    /// to MQTT (the shared cursor).
    held: Option<(Held, i64)>,
}

impl EventRelay {
    pub async fn run(self, token: CancellationToken) {
        let start = loop {
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
        let mut cursors = Cursors {
            live: start,
            held: None,
        };
        let renew_every = self.lease.ttl / 3;
        let mut last_renewal: Option<tokio::time::Instant> = None;
        let mut last_prune = tokio::time::Instant::now();
        loop {
            // A holder renews every third of the lease; the others try to
            // take it at most once a poll, not on every wake-up.
            let renewal_due = match cursors.held {
                Some(_) => renew_every,
                None => RELAY_POLL_INTERVAL,
            };
            if last_renewal.is_none_or(|at| at.elapsed() >= renewal_due) {
                cursors = self.renew(cursors).await;
                last_renewal = Some(tokio::time::Instant::now());
                self.held.store(cursors.held.is_some(), Ordering::Relaxed);
            }
            match self.relay_batch(cursors).await {
                Ok(Some(next)) => {
                    cursors = next;
                    self.held.store(cursors.held.is_some(), Ordering::Relaxed);
                    continue;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "event relay read failed; retrying"),
            }
            if let Some((_, published)) = cursors.held {
                if last_prune.elapsed() >= RELAY_PRUNE_INTERVAL {
                    last_prune = tokio::time::Instant::now();
                    self.prune(published).await;
                }
            }
            tokio::select! {
                () = token.cancelled() => break,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(RELAY_POLL_INTERVAL) => {}
            }
        }
        self.catch_up(cursors).await;
        if cursors.held.is_some() {
            self.held.store(false, Ordering::Relaxed);
            if let Err(e) = leases::release(&self.pool, RELAY_LEASE, self.lease.id).await {
                tracing::warn!(error = %e, "could not release the relay lease; it expires after its time");
            }
        }
    }

    /// Takes or renews the lease. Taking it starts publishing from the
    /// shared cursor; losing it stops publishing.
    async fn renew(&self, cursors: Cursors) -> Cursors {
        let held = match leases::acquire_or_renew(&self.pool, RELAY_LEASE, &self.lease).await {
            Ok(held) => held,
            Err(e) => {
                tracing::warn!(error = %e, "could not renew the relay lease; retrying");
                return cursors;
            }
        };
        match (cursors.held, held) {
            (Some((was, published)), Some(now)) if was == now => Cursors {
                held: Some((now, published)),
                ..cursors
            },
            (_, Some(now)) => match events::load_cursor(&self.pool, CURSOR_NAME).await {
                Ok(published) => {
                    tracing::info!(
                        epoch = now.epoch,
                        "this instance relays the event log to MQTT"
                    );
                    Cursors {
                        held: Some((now, published.unwrap_or(0))),
                        ..cursors
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "event relay cannot read its cursor; retrying");
                    Cursors {
                        held: None,
                        ..cursors
                    }
                }
            },
            (Some(_), None) => {
                tracing::warn!("another instance took the relay lease; this one no longer publishes events to MQTT");
                Cursors {
                    held: None,
                    ..cursors
                }
            }
            (None, None) => cursors,
        }
    }

    /// Relays batch after batch until none is left, or until a read fails
    /// (the rest then goes out at the next start, from the cursor).
    async fn catch_up(&self, mut cursors: Cursors) {
        loop {
            match self.relay_batch(cursors).await {
                Ok(Some(next)) => cursors = next,
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

    /// Relays the next batch after the cursors: to MQTT what is past the
    /// shared cursor (while holding the lease), to SSE what is past the live
    /// one. `Some(new cursors)` if there was a batch.
    async fn relay_batch(
        &self,
        cursors: Cursors,
    ) -> Result<Option<Cursors>, crate::store::StoreError> {
        if cursors.held.is_none() && self.live.receiver_count() == 0 {
            // Not publishing, and no stream to hand events to: nothing to
            // read. The committed tail is read *before* looking for streams
            // again, so a stream that subscribes after that look starts at
            // or after it (its start reads the tail later), and one that
            // subscribed before it keeps the events coming.
            let committed = events::last_sequence(&self.pool).await?;
            if self.live.receiver_count() == 0 {
                self.metrics.event_log_lag.set(0.0);
                return Ok((committed > cursors.live).then_some(Cursors {
                    live: committed,
                    held: None,
                }));
            }
        }
        let from = match cursors.held {
            Some((_, published)) => published.min(cursors.live),
            None => cursors.live,
        };
        let batch =
            super::log::read(&self.pool, from, &EventFilter::default(), RELAY_READ_BATCH).await?;
        let Some(last) = batch.last().map(|e| e.sequence) else {
            let committed = events::last_sequence(&self.pool).await?;
            self.metrics
                .event_log_lag
                .set((committed - from).max(0) as f64);
            return Ok(None);
        };
        let publish_after = cursors.held.map(|(_, published)| published);
        let mut last_ticket = None;
        for event in batch {
            if publish_after.is_some_and(|after| event.sequence > after) {
                if let Some((publisher, qos)) = &self.mqtt {
                    let topic = publisher
                        .root()
                        .event_topic(&event.event_type, &event.subject);
                    let ticket = publisher
                        .publish_event(topic, *qos, event.cloudevent.to_string().into_bytes())
                        .await;
                    last_ticket = ticket.or(last_ticket);
                }
                self.metrics.events_published.increment(1);
            }
            if event.sequence > cursors.live {
                // No live subscriber is fine.
                let _ = self.live.send(Arc::new(event));
            }
        }
        // The cursor moves past the batch only once the broker has it: a
        // holder killed with publishes still in its client leaves them to
        // the next holder (published twice, at most this one batch), never
        // skipped.
        if let (Some(ticket), Some((publisher, _))) = (last_ticket, &self.mqtt) {
            let acks = publisher.pub_acks();
            if !acks.wait_through(ticket, RELAY_ACKED_WITHIN).await {
                // Published again; that time the cursor is saved after it
                // whatever the count says (a publish the client dropped is
                // never answered, and would hold every batch back).
                acks.forgive(ticket);
                tracing::warn!(
                    "the broker did not acknowledge a batch of events within {RELAY_ACKED_WITHIN:?}; \
                     publishing it again"
                );
                // Live streams have the batch; MQTT gets it again.
                return Ok(Some(Cursors {
                    live: last.max(cursors.live),
                    held: cursors.held,
                }));
            }
        }
        let held = match cursors.held {
            Some((lease, _)) => {
                let saved = events::save_cursor_fenced(
                    &self.pool,
                    CURSOR_NAME,
                    last,
                    RELAY_LEASE,
                    self.lease.id,
                    lease.epoch,
                )
                .await?;
                if saved {
                    Some((lease, last))
                } else {
                    tracing::warn!("the relay lease changed hands; this instance no longer publishes events to MQTT");
                    None
                }
            }
            None => None,
        };
        let committed = events::last_sequence(&self.pool).await?;
        self.metrics
            .event_log_lag
            .set((committed - last).max(0) as f64);
        Ok(Some(Cursors {
            live: last.max(cursors.live),
            held,
        }))
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
