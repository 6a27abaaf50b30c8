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
//! for [`DRAIN_QUIET`] after the unsubscription and everything handed over is
//! acknowledged, it disconnects and connects once more with a clean
//! session, which removes the session from the broker.

use rumqttc::{AsyncClient, ConnectionError, Event, Packet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{fleet_filters, options, server_client_id, SessionKind};
use crate::config::ValidConfig;
use crate::mqtt::intake::{AckVia, AdoptedAcks, Cancelled, IntakeSender, Received};
use crate::tuning::{DRAIN_LIMIT, DRAIN_QUIET, DRAIN_REQUESTS, DRAIN_TICK};

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

/// Where a drain stands, from what its connection brought; it sends
/// nothing itself (the loop of [`drain_session`] does).
#[derive(Debug)]
struct Progress {
    phase: Phase,
    last_delivery: Instant,
    unsubacks_due: usize,
}

/// What the end of the drain's connection means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    /// After our DISCONNECT: the session is empty and may be removed.
    Finished,
    /// Before the broker accepted the connection.
    NeverConnected,
    /// In the middle: what the session still holds stays there.
    CutShort,
}

impl Progress {
    /// A drain that will unsubscribe `filters` fleet filters.
    fn new(filters: usize, now: Instant) -> Self {
        Self {
            phase: Phase::Connecting,
            last_delivery: now,
            unsubacks_due: filters,
        }
    }

    /// The broker accepted the connection: `true` the first time, when the
    /// UNSUBSCRIBEs are to be sent.
    fn connected(&mut self, now: Instant) -> bool {
        if self.phase != Phase::Connecting {
            return false;
        }
        self.phase = Phase::Unsubscribing;
        self.last_delivery = now;
        true
    }

    /// A message of the session arrived.
    fn delivered(&mut self, now: Instant) {
        self.last_delivery = now;
    }

    /// The broker acknowledged one UNSUBSCRIBE; the session is unsubscribed
    /// once every filter was.
    fn unsubscribed_one(&mut self, now: Instant) {
        if self.phase != Phase::Unsubscribing {
            return;
        }
        self.unsubacks_due = self.unsubacks_due.saturating_sub(1);
        if self.unsubacks_due == 0 {
            self.phase = Phase::Unsubscribed;
            self.last_delivery = now;
        }
    }

    /// Whether to disconnect now (`true` once): unsubscribed, nothing
    /// delivered for [`DRAIN_QUIET`], and all that was handed over acknowledged.
    fn time_to_disconnect(&mut self, now: Instant, unacked: usize) -> bool {
        let quiet =
            now.saturating_duration_since(self.last_delivery) >= DRAIN_QUIET && unacked == 0;
        match self.phase {
            Phase::Unsubscribed if quiet => {
                self.phase = Phase::Disconnecting;
                true
            }
            Phase::Connecting
            | Phase::Unsubscribing
            | Phase::Unsubscribed
            | Phase::Disconnecting => false,
        }
    }

    fn closed(&self) -> Closed {
        match self.phase {
            Phase::Disconnecting => Closed::Finished,
            Phase::Connecting => Closed::NeverConnected,
            Phase::Unsubscribing | Phase::Unsubscribed => Closed::CutShort,
        }
    }
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
    let max_payload_bytes = config.fleet.budget.max_report_bytes();
    let deadline = Instant::now() + DRAIN_LIMIT;
    let mut drained = Drained::default();
    let mut progress = Progress::new(filters.len(), Instant::now());
    loop {
        let event = tokio::select! {
            () = token.cancelled() => return Err(DrainError::Cancelled),
            () = tokio::time::sleep_until(deadline) => {
                return Err(DrainError::TimedOut { client_id });
            }
            event = tokio::time::timeout(DRAIN_TICK, eventloop.poll()) => event,
        };
        match event {
            Err(_silent) => {}
            Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => {
                if progress.connected(Instant::now()) {
                    drained.session_present = ack.session_present;
                    for filter in &filters {
                        if let Err(e) = client.try_unsubscribe(filter.clone()) {
                            tracing::warn!(error = %e, filter, "could not queue an UNSUBSCRIBE of a drained session");
                        }
                    }
                }
            }
            Ok(Ok(Event::Incoming(Packet::Publish(publish)))) => {
                progress.delivered(Instant::now());
                if publish.topic.starts_with('$') {
                    // `$SYS` counters and dynamic-security answers meant for
                    // the gone instance: nothing for the ingest.
                    if let Err(e) = client.try_ack(&publish) {
                        tracing::debug!(error = %e, "could not acknowledge a control message of a drained session");
                    }
                    continue;
                }
                acks.handed_over();
                drained.messages += 1;
                let received =
                    Received::bounded(publish, max_payload_bytes, AckVia::Adopted(acks.clone()));
                if let Err(Cancelled) = intake.push_and_make_room(received, token, || {}).await {
                    return Err(DrainError::Cancelled);
                }
            }
            Ok(Ok(Event::Incoming(Packet::UnsubAck(_)))) => {
                progress.unsubscribed_one(Instant::now());
            }
            Ok(Ok(Event::Incoming(_) | Event::Outgoing(_))) => {}
            Ok(Err(source)) => match progress.closed() {
                Closed::Finished => break,
                Closed::NeverConnected => return Err(DrainError::Connect { client_id, source }),
                Closed::CutShort => return Err(DrainError::Lost { client_id, source }),
            },
        }
        if progress.time_to_disconnect(Instant::now(), acks.unacked()) {
            if let Err(e) = client.try_disconnect() {
                tracing::warn!(error = %e, "could not queue the DISCONNECT of a drained session");
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_FILTERS: usize = 2;

    /// A drain whose connection was accepted and whose filters were all
    /// unsubscribed at `at`.
    fn unsubscribed_at(at: Instant) -> Progress {
        let mut progress = Progress::new(TWO_FILTERS, at);
        assert!(progress.connected(at));
        progress.unsubscribed_one(at);
        progress.unsubscribed_one(at);
        progress
    }

    #[test]
    fn a_drain_unsubscribes_on_its_first_connack_only() {
        let start = Instant::now();
        let mut progress = Progress::new(TWO_FILTERS, start);
        assert!(
            progress.connected(start),
            "the first CONNACK sends the UNSUBSCRIBEs"
        );
        assert!(
            !progress.connected(start + DRAIN_QUIET),
            "a second one sends nothing"
        );
    }

    #[test]
    fn the_session_is_unsubscribed_only_once_every_filter_was_acknowledged() {
        let start = Instant::now();
        let mut progress = Progress::new(TWO_FILTERS, start);
        progress.connected(start);
        progress.unsubscribed_one(start);
        assert!(
            !progress.time_to_disconnect(start + DRAIN_QUIET * 5, 0),
            "one filter still routes messages into the session"
        );
        progress.unsubscribed_one(start + DRAIN_QUIET * 5);
        assert!(!progress.time_to_disconnect(start + DRAIN_QUIET * 5, 0));
        assert!(progress.time_to_disconnect(start + DRAIN_QUIET * 6, 0));
    }

    #[test]
    fn an_unsubscription_ack_before_the_connack_changes_nothing() {
        let start = Instant::now();
        let mut progress = Progress::new(TWO_FILTERS, start);
        progress.unsubscribed_one(start);
        progress.unsubscribed_one(start);
        assert!(progress.connected(start));
        assert!(!progress.time_to_disconnect(start + DRAIN_QUIET * 5, 0));
    }

    #[test]
    fn a_drain_disconnects_once_after_a_quiet_second_with_nothing_left_to_acknowledge() {
        let start = Instant::now();
        let mut progress = unsubscribed_at(start);
        assert!(!progress.time_to_disconnect(start, 0), "just unsubscribed");
        assert!(
            !progress.time_to_disconnect(start + DRAIN_QUIET / 2, 0),
            "not quiet yet"
        );
        assert!(
            !progress.time_to_disconnect(start + DRAIN_QUIET, 1),
            "one message handed over is not acknowledged"
        );
        assert!(
            progress.time_to_disconnect(start + DRAIN_QUIET, 0),
            "quiet for exactly DRAIN_QUIET"
        );
        assert!(
            !progress.time_to_disconnect(start + DRAIN_QUIET * 2, 0),
            "DISCONNECT is sent once"
        );
        assert_eq!(progress.closed(), Closed::Finished);
    }

    #[test]
    fn each_delivery_restarts_the_quiet_second() {
        let start = Instant::now();
        let mut progress = unsubscribed_at(start);
        progress.delivered(start + DRAIN_QUIET / 2);
        assert!(!progress.time_to_disconnect(start + DRAIN_QUIET, 0));
        assert!(progress.time_to_disconnect(start + DRAIN_QUIET / 2 + DRAIN_QUIET, 0));
    }

    #[test]
    fn a_late_unsubscription_ack_neither_delays_nor_undoes_the_disconnect() {
        let start = Instant::now();
        let mut progress = unsubscribed_at(start);
        progress.unsubscribed_one(start + DRAIN_QUIET / 2);
        assert!(progress.time_to_disconnect(start + DRAIN_QUIET, 0));
        progress.unsubscribed_one(start + DRAIN_QUIET * 2);
        assert_eq!(progress.closed(), Closed::Finished);
    }

    #[test]
    fn a_connection_that_ends_before_our_disconnect_keeps_what_the_session_holds() {
        let start = Instant::now();
        let mut progress = Progress::new(TWO_FILTERS, start);
        assert_eq!(progress.closed(), Closed::NeverConnected);
        progress.connected(start);
        assert_eq!(progress.closed(), Closed::CutShort, "unsubscribing");
        progress.unsubscribed_one(start);
        progress.unsubscribed_one(start);
        assert_eq!(progress.closed(), Closed::CutShort, "still delivering");
    }
}
