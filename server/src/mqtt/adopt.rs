//! Draining the MQTT session of another instance that stopped or died while
//! sharing the fleet's subscriptions (`--share-group`): what the broker
//! queued in that session goes through this instance's ingest, then the
//! session stops collecting and is removed.
//!
//! A broker keeps handing a shared subscription's messages to a member whose
//! persistent session outlives its connection; they wait there until that
//! client id connects again. This connects with the gone instance's client
//! id (`idem-server:{instance}`, persistent), so the broker delivers what
//! waits, and at once unsubscribes the fleet's filters: the broker gives the
//! session no new messages but still delivers those it holds (MQTT lets a
//! broker finish delivering what it buffered for a client; Mosquitto does).
//! Each message is acknowledged on this connection once its batch committed
//! (a drain cut short leaves the rest in the session). When nothing arrived
//! for [`QUIET`] after the unsubscription and everything handed over is
//! acknowledged, it disconnects and connects once more with a clean
//! session, which removes the session from the broker.

use std::time::Duration;

use bytes::Bytes;
use rumqttc::{AsyncClient, ConnectionError, Event, Packet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{fleet_filters, options, server_client_id, SessionKind};
use crate::config::ValidConfig;
use crate::mqtt::intake::{AckVia, AdoptedAcks, IntakeSender, Received};

/// Nothing delivered for this long (and everything acknowledged): the
/// session's queue is empty.
pub const QUIET: Duration = Duration::from_secs(1);
/// A drain that has not ended by then gives up (the session keeps the rest,
/// and the instance's claim goes stale again for another try).
pub const DRAIN_LIMIT: Duration = Duration::from_secs(120);
/// How often the drain looks at the time while the connection is silent.
const TICK: Duration = Duration::from_millis(100);
/// Requests the drain's client may queue (acknowledgements, mostly).
const DRAIN_REQUESTS: usize = 1_000;

/// What a drain found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Drained {
    /// The broker still had a session for the client id.
    pub session_present: bool,
    /// Fleet messages handed to the ingest.
    pub messages: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error("connecting as {client_id} failed: {source}")]
    Connect {
        client_id: String,
        source: ConnectionError,
    },
    #[error(
        "the connection as {client_id} was lost while draining (another process connected with that client id, or the broker went away): {source}"
    )]
    Lost {
        client_id: String,
        source: ConnectionError,
    },
    #[error("the session of {client_id} was still delivering after {DRAIN_LIMIT:?}")]
    TimedOut { client_id: String },
    #[error("the server is stopping")]
    Cancelled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connecting,
    /// UNSUBSCRIBE sent (right after CONNACK); waiting for its acknowledgement.
    Unsubscribing,
    /// The session gets nothing new; what it held is being delivered.
    Unsubscribed,
    /// DISCONNECT sent; the broker closes the connection.
    Disconnecting,
}

/// Drains the session of `instance` into `intake`, then removes it from
/// the broker.
pub async fn drain_session(
    config: &ValidConfig,
    instance: &str,
    intake: &IntakeSender,
    token: &CancellationToken,
) -> Result<Drained, DrainError> {
    let client_id = server_client_id(instance);
    let (client, mut eventloop) = AsyncClient::new(
        options(config, client_id.clone(), SessionKind::Persistent),
        DRAIN_REQUESTS,
    );
    let acks = AdoptedAcks::new(client.clone());
    let filters = fleet_filters(&config.fleet.topic_root, config.mqtt.share_group.as_ref());
    let budget = config.fleet.budget;
    let deadline = Instant::now() + DRAIN_LIMIT;
    let mut drained = Drained::default();
    let mut phase = Phase::Connecting;
    let mut last_delivery = Instant::now();
    let mut unsubacks_due = filters.len();
    loop {
        let event = tokio::select! {
            () = token.cancelled() => return Err(DrainError::Cancelled),
            () = tokio::time::sleep_until(deadline) => {
                return Err(DrainError::TimedOut { client_id });
            }
            event = tokio::time::timeout(TICK, eventloop.poll()) => event,
        };
        match event {
            Err(_silent) => {}
            Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) if phase == Phase::Connecting => {
                drained.session_present = ack.session_present;
                for filter in &filters {
                    if let Err(e) = client.try_unsubscribe(filter.clone()) {
                        tracing::warn!(error = %e, filter, "could not queue an UNSUBSCRIBE of a drained session");
                    }
                }
                phase = Phase::Unsubscribing;
                last_delivery = Instant::now();
            }
            Ok(Ok(Event::Incoming(Packet::Publish(mut publish)))) => {
                last_delivery = Instant::now();
                if publish.topic.starts_with('$') {
                    // `$SYS` counters and dynamic-security answers meant for
                    // the gone instance: nothing for the ingest.
                    if let Err(e) = client.try_ack(&publish) {
                        tracing::debug!(error = %e, "could not acknowledge a control message of a drained session");
                    }
                    continue;
                }
                let len = publish.payload.len();
                let oversized = (len > budget.max_report_bytes()).then(|| {
                    publish.payload = Bytes::new();
                    len
                });
                acks.handed_over();
                drained.messages += 1;
                let within = intake.push(Received {
                    publish,
                    oversized,
                    ack_via: AckVia::Adopted(acks.clone()),
                });
                if !within {
                    tokio::select! {
                        () = token.cancelled() => return Err(DrainError::Cancelled),
                        () = intake.wait_for_room() => {}
                    }
                }
            }
            Ok(Ok(Event::Incoming(Packet::UnsubAck(_)))) if phase == Phase::Unsubscribing => {
                unsubacks_due = unsubacks_due.saturating_sub(1);
                if unsubacks_due == 0 {
                    phase = Phase::Unsubscribed;
                    last_delivery = Instant::now();
                }
            }
            Ok(Ok(Event::Incoming(_) | Event::Outgoing(_))) => {}
            Ok(Err(_closed)) if phase == Phase::Disconnecting => break,
            Ok(Err(source)) if phase == Phase::Connecting => {
                return Err(DrainError::Connect { client_id, source });
            }
            Ok(Err(source)) => return Err(DrainError::Lost { client_id, source }),
        }
        let quiet = last_delivery.elapsed() >= QUIET && acks.unacked() == 0;
        match phase {
            Phase::Unsubscribed if quiet => {
                if let Err(e) = client.try_disconnect() {
                    tracing::warn!(error = %e, "could not queue the DISCONNECT of a drained session");
                }
                phase = Phase::Disconnecting;
            }
            Phase::Connecting
            | Phase::Unsubscribing
            | Phase::Unsubscribed
            | Phase::Disconnecting => {}
        }
    }
    remove_session(config, &client_id, token).await?;
    Ok(drained)
}

/// Connects once with a clean session, which makes the broker discard the
/// session of `client_id`, and disconnects.
async fn remove_session(
    config: &ValidConfig,
    client_id: &str,
    token: &CancellationToken,
) -> Result<(), DrainError> {
    let (client, mut eventloop) = AsyncClient::new(
        options(config, client_id.to_owned(), SessionKind::Clean),
        DRAIN_REQUESTS,
    );
    let deadline = Instant::now() + DRAIN_LIMIT;
    let mut disconnecting = false;
    loop {
        let event = tokio::select! {
            () = token.cancelled() => return Err(DrainError::Cancelled),
            () = tokio::time::sleep_until(deadline) => {
                return Err(DrainError::TimedOut { client_id: client_id.to_owned() });
            }
            event = eventloop.poll() => event,
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                if let Err(e) = client.try_disconnect() {
                    tracing::warn!(error = %e, "could not queue the DISCONNECT after removing a session");
                }
                disconnecting = true;
            }
            Ok(Event::Incoming(_) | Event::Outgoing(_)) => {}
            Err(_closed) if disconnecting => return Ok(()),
            Err(source) => {
                return Err(DrainError::Connect {
                    client_id: client_id.to_owned(),
                    source,
                })
            }
        }
    }
}
