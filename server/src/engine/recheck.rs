//! Rechecks after the broker may have dropped messages for the server. A
//! broker drops QoS 1 messages for a client past its queue limits, after the
//! publisher already has its PUBACK, so the server must notice on its own:
//! it hears the signs here (the broker's `$SYS` dropped counter rising, a
//! reconnect that found the session empty or after a long absence, an
//! ingest write held longer than `--recheck-after-stall`) and,
//! at most once per [`RECHECK_COOLDOWN`], tells the engine to ask every
//! device not known to be offline and not heard from since for a report,
//! paced, and re-reads the retained status of every device not known to be
//! online, a chunk at a time.
//!
//! It owns the cooldown only (the signal is `mqtt/recheck_signal.rs`);
//! what is asked, and how fast, is the engine's.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use idem_protocol::{Channel, DeviceId, TopicRoot};
use rumqttc::{AsyncClient, QoS, SubscribeFilter};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::engine::EngineCommand;
use crate::mqtt::recheck_signal::RecheckSignal;
use crate::ops::metrics::Metrics;
use crate::store::cache::FleetCache;
use crate::tuning::{RECHECK_COOLDOWN, STATUS_REREAD_CHUNK};

/// What carries out rechecks.
pub struct Rechecker {
    pub signal: Arc<RecheckSignal>,
    /// For the status re-reads.
    pub client: AsyncClient,
    pub root: TopicRoot,
    pub fleet: Arc<FleetCache>,
    pub engine: mpsc::Sender<EngineCommand>,
    pub metrics: Arc<Metrics>,
    /// `--recheck-rate`: requests and status re-reads per second; `None`:
    /// rechecks are off.
    pub rate: Option<NonZeroU32>,
}

/// Carries out raised rechecks until cancelled.
pub async fn run(rechecker: Rechecker, token: CancellationToken) {
    let Rechecker {
        signal,
        client,
        root,
        fleet,
        engine,
        metrics,
        rate,
    } = rechecker;
    let Some(rate) = rate else {
        return; // `--recheck-rate 0`: rechecks are off
    };
    let pause = Duration::from_secs_f64(STATUS_REREAD_CHUNK as f64 / f64::from(rate.get()));
    loop {
        tokio::select! {
            () = token.cancelled() => return,
            () = signal.raised() => {}
        }
        let Some(trigger) = signal.take() else {
            continue;
        };
        metrics.recheck_started(trigger);
        tracing::warn!(
            trigger = trigger.as_str(),
            "the broker may have dropped messages for the server: asking devices for reports and re-reading the statuses not known online"
        );
        if engine.send(EngineCommand::Recheck).await.is_err() {
            return;
        }
        let unknown = fleet.ids_not_online();
        tokio::select! {
            () = token.cancelled() => return,
            () = reread_statuses(&client, &root, &unknown, pause) => {}
        }
        tokio::select! {
            () = token.cancelled() => return,
            () = tokio::time::sleep(RECHECK_COOLDOWN) => {}
        }
    }
}

/// Subscribes to each device's own status topic for a moment, a chunk at a
/// time: the broker re-sends the retained status of each (a status message
/// it dropped hid that the device is online). The wildcard subscription
/// stays; a status arriving twice changes nothing.
async fn reread_statuses(
    client: &AsyncClient,
    root: &TopicRoot,
    ids: &[DeviceId],
    pause: Duration,
) {
    for chunk in ids.chunks(STATUS_REREAD_CHUNK) {
        let topics: Vec<String> = chunk
            .iter()
            .map(|id| root.topic(id, Channel::Status))
            .collect();
        let filters = topics
            .iter()
            .map(|t| SubscribeFilter::new(t.clone(), QoS::AtLeastOnce));
        if let Err(e) = client.subscribe_many(filters).await {
            tracing::warn!(error = %e, "could not re-read device statuses");
            return;
        }
        tokio::time::sleep(pause).await;
        for topic in topics {
            if client.unsubscribe(topic).await.is_err() {
                return;
            }
        }
    }
}
