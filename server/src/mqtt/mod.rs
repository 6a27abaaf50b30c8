//! MQTT adapter: the connection's event loop and the publisher.
//!
//! The event loop is polled continuously and never awaits the database or its
//! own client: inbound publishes go to the intake queue (`crate::mqtt::intake`),
//! which it waits on only past its byte budget, so the keepalive is answered
//! through any ingest backlog; subscriptions are (re)made with
//! `try_subscribe_many` on every ConnAck, and a reconnect is logged with how
//! long the session was away. Manual acks: the
//! ingest acknowledges a report only after the batch holding it commits.
//!
//! No packet can break the connection: the client reads any packet MQTT
//! allows (payloads over the report limit are dropped right here, keeping
//! only their length for the ingest to count and acknowledge), and the
//! publisher refuses to hand the client anything larger than the budget.

pub mod adopt;
pub mod intake;
pub mod outbox;
pub mod recheck_signal;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_protocol::{Backoff, Channel, DeviceId, Generation, SpecBudget, TopicRoot, GET_PAYLOAD};
use rumqttc::{
    AsyncClient, ConnectionError, Event, EventLoop, MqttOptions, Outgoing, Packet, Publish, QoS,
    SubscribeFilter, TlsConfiguration, Transport,
};
use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::config::ShareGroup;
use crate::config::ValidConfig;
use crate::mqtt::outbox::Outbox;
use crate::ops::metrics::Metrics;
use intake::{Cancelled, IntakeSender};
use recheck_signal::{RecheckSignal, RecheckTrigger};

/// Outgoing QoS 1 publishes awaiting PUBACK at once.
const MAX_INFLIGHT: u16 = 1_000;
/// MQTT's own limit on a packet's remaining length: the client reads every
/// packet a broker can send, so none can make it drop the connection.
const MQTT_MAX_REMAINING_LENGTH: usize = 268_435_455;
/// The largest event payload published on MQTT; a larger event (a huge
/// `run.completed`) stays in the event log and on SSE only.
pub const MAX_EVENT_PAYLOAD_BYTES: usize = 1024 * 1024;

use crate::tuning::{MQTT_LONG_ABSENCE, MQTT_REPEAT_CONNECT_ERROR, MQTT_REQUEST_CHANNEL_CAPACITY};
pub use intake::{AckVia, Received};

/// Connection facts shared with readiness checks.
#[derive(Debug, Default)]
pub struct MqttStatus {
    connected: AtomicBool,
    subscribed: AtomicBool,
}

impl MqttStatus {
    /// Connected and subscribed: reports can flow.
    pub fn is_ready(&self) -> bool {
        self.connected.load(Ordering::Acquire) && self.subscribed.load(Ordering::Acquire)
    }
}

/// The server's MQTT client id, `idem-server:{instance}`: the `:` is outside
/// the device-id alphabet, so no device using its id as client id (as
/// `docs/PROTOCOL.md` §2 asks) can ever take over the server's session.
pub fn server_client_id(instance: &str) -> String {
    format!("idem-server:{instance}")
}

/// Builds the client and its event loop from the configuration: plain TCP
/// or TLS (`mqtts://`, the configuration's rustls client config, optionally
/// with a client certificate), with the configured credentials.
pub fn connect(config: &ValidConfig) -> (AsyncClient, EventLoop) {
    let options = options(
        config,
        server_client_id(&config.fleet.instance),
        SessionKind::Persistent,
    );
    AsyncClient::new(options, MQTT_REQUEST_CHANNEL_CAPACITY)
}

/// Whether a connection keeps its session on the broker while it is away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionKind {
    /// Reports published while the client is briefly away are delivered
    /// when it returns.
    Persistent,
    /// The broker drops the session (and whatever it held) at connect.
    Clean,
}

/// The connection options of a server connection with `client_id`.
pub fn options(config: &ValidConfig, client_id: String, session: SessionKind) -> MqttOptions {
    let mut options = MqttOptions::new(
        client_id,
        config.mqtt.broker.host.clone(),
        config.mqtt.broker.port,
    );
    options
        .set_keep_alive(config.mqtt.keep_alive)
        .set_clean_session(session == SessionKind::Clean)
        .set_manual_acks(true)
        .set_inflight(MAX_INFLIGHT)
        .set_request_channel_capacity(MQTT_REQUEST_CHANNEL_CAPACITY)
        // Reading every packet MQTT allows means no inbound message can make
        // the connection fail (and be redelivered forever by our persistent
        // session); the publisher bounds what we send.
        .set_max_packet_size(MQTT_MAX_REMAINING_LENGTH, MQTT_MAX_REMAINING_LENGTH);
    if let Some(tls) = &config.mqtt.tls {
        options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
            tls.config.clone(),
        )));
    }
    if let Some(credentials) = &config.mqtt.credentials {
        // The one place the broker password leaves its `Secret`.
        options.set_credentials(
            credentials.username.clone(),
            credentials.password.expose().clone(),
        );
    }
    options
}

/// Marks the connection up (and counts a reconnect).
fn mark_connected(status: &MqttStatus, metrics: &Metrics, reconnect: bool) {
    status.connected.store(true, Ordering::Release);
    metrics.mqtt_connected.set(1.0);
    if reconnect {
        metrics.mqtt_reconnects.increment(1);
    }
}

/// Logs a lost connection once, and a failing connect once per kind of
/// failure (with the fix), the retries at debug level.
fn log_connection_error(
    e: &ConnectionError,
    status: &MqttStatus,
    failures: &mut ConnectFailures,
    broker: &str,
    delay: Duration,
) {
    if status.connected.swap(false, Ordering::AcqRel) {
        tracing::warn!(error = %e, "MQTT connection lost; reconnecting");
    } else if failures.should_log(e, tokio::time::Instant::now()) {
        // Not ready until this is fixed; say why, with the fix.
        tracing::error!(
            error = %e,
            broker,
            hint = connect_hint(e),
            "cannot connect to the MQTT broker; retrying"
        );
    } else {
        tracing::debug!(error = %e, "MQTT connect failed; retrying in {delay:?}");
    }
}

/// Mosquitto's count of messages it dropped (for any client), and of the
/// messages it holds: read when `--broker-sys-topics` is on.
pub const SYS_DROPPED_TOPIC: &str = "$SYS/broker/publish/messages/dropped";
pub const SYS_STORED_TOPIC: &str = "$SYS/broker/store/messages/count";
/// The dynamic-security plugin's command topic and the topic it answers on.
pub const CONTROL_TOPIC: &str = "$CONTROL/dynamic-security/v1";
pub const RESPONSE_TOPIC: &str = "$CONTROL/dynamic-security/v1/response";

/// What the event loop hands on besides reports and statuses.
pub struct EventLoopHooks {
    /// The dynamic-security answers, with `--broker-accounts dynsec`.
    pub control: Option<Arc<dyn ControlResponses>>,
    /// Raised on signs that the broker dropped messages for the server.
    pub recheck: Arc<RecheckSignal>,
    /// Subscribe to the broker's `$SYS` counters.
    pub sys_topics: bool,
    /// Subscribe to the fleet's messages through this shared-subscription group.
    pub share_group: Option<ShareGroup>,
    /// Where the PUBACKs the broker sends are counted.
    pub pub_acks: Arc<outbox::PubAcks>,
}

/// The filters of the fleet's `reported` and `status` messages, shared
/// through `group` when the server has one.
pub fn fleet_filters(root: &TopicRoot, group: Option<&ShareGroup>) -> [String; 2] {
    [Channel::Reported, Channel::Status].map(|channel| {
        let filter = root.filter(channel);
        match group {
            Some(group) => group.filter(&filter),
            None => filter,
        }
    })
}

/// Reads one `$SYS` counter message: sets its gauge and raises a recheck
/// when the dropped count rose since the last reading (the first reading
/// is the baseline).
fn on_sys_counter(
    topic: &str,
    payload: &[u8],
    last_dropped: &mut Option<u64>,
    metrics: &Metrics,
    recheck: &RecheckSignal,
) {
    let Some(value) = std::str::from_utf8(payload)
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
    else {
        tracing::debug!(topic, "unreadable $SYS counter");
        return;
    };
    match topic {
        SYS_DROPPED_TOPIC => {
            metrics.broker_messages_dropped.set(value as f64);
            if last_dropped.is_some_and(|last| value > last) {
                tracing::warn!(dropped = value, "the broker reports dropped messages");
                recheck.raise(RecheckTrigger::BrokerDropped);
            }
            *last_dropped = Some(value);
        }
        SYS_STORED_TOPIC => metrics.broker_messages_stored.set(value as f64),
        _ => {}
    }
}

/// Takes the broker's answers on a control topic the server subscribes to
/// (Mosquitto's dynamic-security responses), from the event loop.
pub trait ControlResponses: Send + Sync {
    /// The topic the answers arrive on.
    fn topic(&self) -> &str;
    /// One answer; must not block.
    fn on_response(&self, payload: &[u8]);
}

/// Polls the event loop, forwarding every inbound publish, until `token`
/// is cancelled or, after [`Publisher::disconnect`], the broker closed the
/// connection on the DISCONNECT it was sent: MQTT has the broker close the
/// connection once it has read DISCONNECT, which it reads after everything
/// the server wrote before it.
#[allow(clippy::too_many_arguments)]
pub async fn run_event_loop(
    mut eventloop: EventLoop,
    client: AsyncClient,
    root: TopicRoot,
    budget: SpecBudget,
    intake: IntakeSender,
    status: Arc<MqttStatus>,
    metrics: Arc<Metrics>,
    hooks: EventLoopHooks,
    token: CancellationToken,
) {
    let EventLoopHooks {
        control,
        recheck,
        sys_topics,
        share_group,
        pub_acks,
    } = hooks;
    let (broker_host, broker_port) = eventloop.mqtt_options.broker_address();
    let mut filters: Vec<SubscribeFilter> = fleet_filters(&root, share_group.as_ref())
        .into_iter()
        .map(|filter| SubscribeFilter::new(filter, QoS::AtLeastOnce))
        .collect();
    let control_topic = control.as_ref().map(|c| c.topic().to_owned());
    if let Some(topic) = &control_topic {
        filters.push(SubscribeFilter::new(topic.clone(), QoS::AtLeastOnce));
    }
    if sys_topics {
        for topic in [SYS_DROPPED_TOPIC, SYS_STORED_TOPIC] {
            filters.push(SubscribeFilter::new(topic.to_owned(), QoS::AtMostOnce));
        }
    }
    let mut last_dropped = None;
    let mut ever_connected = false;
    // When the connection was lost, until the next ConnAck.
    let mut lost_at: Option<tokio::time::Instant> = None;
    let intake_budget = intake.budget_bytes();
    let mut backoff = Backoff::store_and_broker();
    let mut failures = ConnectFailures::default();
    // DISCONNECT was written: the next error is the broker closing.
    let mut disconnected = false;
    loop {
        let event = tokio::select! {
            () = token.cancelled() => break,
            event = eventloop.poll() => event,
        };
        match event {
            Ok(Event::Incoming(Packet::Publish(publish)))
                if control_topic.as_deref() == Some(publish.topic.as_str()) =>
            {
                if let Some(control) = &control {
                    control.on_response(&publish.payload);
                }
                if let Err(e) = client.try_ack(&publish) {
                    tracing::debug!(error = %e, "could not acknowledge a dynamic-security answer");
                }
            }
            Ok(Event::Incoming(Packet::Publish(publish))) if publish.topic.starts_with("$SYS/") => {
                on_sys_counter(
                    &publish.topic,
                    &publish.payload,
                    &mut last_dropped,
                    &metrics,
                    &recheck,
                );
                if let Err(e) = client.try_ack(&publish) {
                    tracing::debug!(error = %e, "could not acknowledge a $SYS message");
                }
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                let received =
                    Received::bounded(publish, budget.max_report_bytes(), AckVia::Server);
                // Past the budget: stop reading until the ingest caught up
                // (the broker holds the rest meanwhile).
                let on_full = || {
                    metrics.intake_full.increment(1);
                    tracing::warn!(
                        budget_bytes = intake_budget,
                        "the intake holds its --mqtt-intake-buffer-bytes; not reading the broker until the ingest stores half of it"
                    );
                };
                if let Err(Cancelled) = intake.push_and_make_room(received, &token, on_full).await {
                    break;
                }
            }
            Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                match lost_at.take() {
                    Some(at) => {
                        let away = at.elapsed();
                        tracing::warn!(
                            session_present = ack.session_present,
                            away_ms = u64::try_from(away.as_millis()).unwrap_or(u64::MAX),
                            "reconnected to the MQTT broker"
                        );
                        // A session that came back empty kept nothing; a long
                        // absence may have filled its queue. (Drops during a
                        // short one show in the broker's dropped counter.)
                        if !ack.session_present || away >= MQTT_LONG_ABSENCE {
                            recheck.raise(RecheckTrigger::SessionLost);
                        }
                    }
                    None => tracing::info!(
                        session_present = ack.session_present,
                        "connected to MQTT broker"
                    ),
                }
                mark_connected(&status, &metrics, ever_connected);
                ever_connected = true;
                backoff.reset();
                failures = ConnectFailures::default();
                if let Err(e) = client.try_subscribe_many(filters.clone()) {
                    tracing::error!(error = %e, "could not queue subscriptions");
                }
            }
            Ok(Event::Incoming(Packet::SubAck(_))) => {
                status.subscribed.store(true, Ordering::Release);
            }
            Ok(Event::Incoming(Packet::PubAck(_))) => pub_acks.received(),
            Ok(Event::Outgoing(Outgoing::Disconnect)) => {
                tracing::debug!("DISCONNECT sent; waiting for the broker to close the connection");
                disconnected = true;
            }
            Ok(Event::Incoming(_) | Event::Outgoing(_)) => {}
            Err(e) if disconnected => {
                tracing::debug!(error = %e, "the broker closed the connection after DISCONNECT");
                break;
            }
            Err(e) => {
                if ever_connected && lost_at.is_none() {
                    lost_at = Some(tokio::time::Instant::now());
                }
                let delay = backoff.next_delay();
                let broker = format!("{broker_host}:{broker_port}");
                log_connection_error(&e, &status, &mut failures, &broker, delay);
                status.subscribed.store(false, Ordering::Release);
                metrics.mqtt_connected.set(0.0);
                tokio::select! {
                    () = token.cancelled() => break,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    status.connected.store(false, Ordering::Release);
    status.subscribed.store(false, Ordering::Release);
    metrics.mqtt_connected.set(0.0);
}

/// Decides which failed connection attempts are worth an error line: the
/// first, each one whose error differs from the last, and the same one
/// again once a minute (the rest go to debug).
#[derive(Debug, Default)]
struct ConnectFailures {
    last: Option<(String, tokio::time::Instant)>,
}

impl ConnectFailures {
    fn should_log(&mut self, error: &ConnectionError, now: tokio::time::Instant) -> bool {
        let text = error.to_string();
        let log = match &self.last {
            None => true,
            Some((last, at)) => {
                *last != text || now.duration_since(*at) >= MQTT_REPEAT_CONNECT_ERROR
            }
        };
        if log {
            self.last = Some((text, now));
        }
        log
    }
}

/// What an operator should check for a failed connection attempt.
pub fn connect_hint(error: &ConnectionError) -> &'static str {
    use rumqttc::ConnectReturnCode as Code;
    // rumqttc passes TLS failures on as text inside I/O and state errors;
    // the rustls alert names tell the cases apart.
    let text = error.to_string();
    if text.contains("CertificateRequired") {
        return "the broker requires a client certificate: set IDEM_MQTT_CLIENT_CERT and \
                IDEM_MQTT_CLIENT_KEY (PEM, signed by a CA the broker trusts)";
    }
    if [
        "BadCertificate",
        "UnknownCA",
        "CertificateUnknown",
        "CertificateExpired",
    ]
    .iter()
    .any(|alert| text.contains(alert))
    {
        return "the broker refused the server's client certificate: check that \
                IDEM_MQTT_CLIENT_CERT is signed by a CA the broker trusts (its cafile) and \
                has not expired";
    }
    if text.contains("invalid peer certificate") {
        return "the broker's certificate is not trusted: check that IDEM_MQTT_CA_FILE holds the \
                CA that signed the broker's certificate (without it, the system trust store is \
                used) and that the host in IDEM_MQTT_URL is named in that certificate";
    }
    match error {
        ConnectionError::ConnectionRefused(Code::BadUserNamePassword | Code::NotAuthorized) => {
            "the broker refused the server's credentials: check IDEM_MQTT_USERNAME and \
             IDEM_MQTT_PASSWORD / IDEM_MQTT_PASSWORD_FILE (or the client certificate's identity) \
             and the broker's accounts"
        }
        ConnectionError::ConnectionRefused(Code::BadClientId) => {
            "the broker refused the client id idem-server:{instance}: check IDEM_INSTANCE and the broker's client id rules"
        }
        ConnectionError::ConnectionRefused(
            Code::Success | Code::RefusedProtocolVersion | Code::ServiceUnavailable,
        ) => "the broker refused the connection: see the broker's log",
        ConnectionError::Tls(_) => {
            "TLS failed: check that IDEM_MQTT_CA_FILE holds the CA that signed the broker's \
             certificate, that the host in IDEM_MQTT_URL is named in that certificate, and \
             IDEM_MQTT_CLIENT_CERT / IDEM_MQTT_CLIENT_KEY if the broker requires a client certificate"
        }
        ConnectionError::Io(_) | ConnectionError::NetworkTimeout | ConnectionError::FlushTimeout => {
            "cannot reach the broker or it closed the connection: check the host and port in \
             IDEM_MQTT_URL, whether the listener expects TLS (mqtts://), and whether it requires a \
             client certificate (IDEM_MQTT_CLIENT_CERT / IDEM_MQTT_CLIENT_KEY)"
        }
        ConnectionError::MqttState(_) | ConnectionError::NotConnAck(_) | ConnectionError::RequestsDone => {
            "the connection failed after it was opened: check the broker's log"
        }
    }
}

/// Publishes desired state, report requests and events.
#[derive(Clone)]
pub struct Publisher {
    client: AsyncClient,
    /// Where sends that found the client's channel full wait, in order.
    outbox: Arc<Outbox>,
    root: TopicRoot,
    budget: SpecBudget,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Publisher({})", self.root)
    }
}

#[derive(Serialize)]
struct DesiredMessage<'a> {
    generation: Generation,
    spec: &'a Value,
}

impl Publisher {
    /// The publisher of `client`; its outbox drains until
    /// [`Publisher::disconnect`].
    pub fn new(
        client: AsyncClient,
        root: TopicRoot,
        budget: SpecBudget,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            outbox: Outbox::start(client.clone()),
            client,
            root,
            budget,
            metrics,
        }
    }

    /// Publishes `{generation, spec}` retained with QoS 1 on the device's
    /// desired topic. A failure is logged: the attempt then times out.
    pub fn push(&self, device: &DeviceId, generation: Generation, spec: &Value) {
        let payload = match serde_json::to_vec(&DesiredMessage { generation, spec }) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(%device, error = %e, "could not encode desired state");
                return;
            }
        };
        if payload.len() > self.budget.max_desired_bytes() {
            // The API refuses such specs; this one predates the limit.
            self.metrics.publish_refused("desired");
            tracing::error!(
                %device,
                bytes = payload.len(),
                limit = self.budget.max_desired_bytes(),
                "desired state over the spec budget is not published; lower the spec or raise IDEM_MAX_SPEC_BYTES"
            );
            return;
        }
        let topic = self.root.topic(device, Channel::Desired);
        self.outbox
            .publish(topic, QoS::AtLeastOnce, true, payload, "desired state");
    }

    /// Sends one message of dynamic-security commands (waits for room in
    /// the client's channel: never called from the engine or the ingest).
    pub async fn publish_control(&self, payload: Vec<u8>) -> Result<(), String> {
        // Through the outbox, as every QoS 1 publish: its ticket keeps the
        // count of PUBACKs exact (`outbox::PubAcks`).
        self.outbox.publish(
            CONTROL_TOPIC.to_owned(),
            QoS::AtLeastOnce,
            false,
            payload,
            "a dynamic-security command",
        );
        Ok(())
    }

    /// The PUBACKs counted for this publisher's client.
    pub fn pub_acks(&self) -> Arc<outbox::PubAcks> {
        self.outbox.acks()
    }

    /// Clears the retained `desired` and `status` messages of a deleted
    /// device (an empty retained publish removes a retained message).
    pub fn clear_retained(&self, device: &DeviceId) {
        for channel in [Channel::Desired, Channel::Status] {
            let topic = self.root.topic(device, channel);
            self.outbox.publish(
                topic,
                QoS::AtLeastOnce,
                true,
                Vec::new(),
                "retained message removal",
            );
        }
    }

    /// Asks the device to report now.
    pub fn ask_for_report(&self, device: &DeviceId) {
        let topic = self.root.topic(device, Channel::Get);
        self.outbox.publish(
            topic,
            QoS::AtLeastOnce,
            false,
            GET_PAYLOAD.to_vec(),
            "report request",
        );
    }

    /// Publishes one CloudEvent (structured JSON) on an event topic. With
    /// QoS 1, through the outbox, and its ticket is returned
    /// (`outbox::PubAcks::wait_through`); with QoS 0, once the client's
    /// channel has room (the relay goes no faster than the client sends).
    pub async fn publish_event(&self, topic: String, qos: QoS, payload: Vec<u8>) -> Option<u64> {
        if payload.len() > MAX_EVENT_PAYLOAD_BYTES {
            self.metrics.publish_refused("event");
            tracing::warn!(
                %topic,
                bytes = payload.len(),
                "event too large for MQTT; it stays in the event log and on SSE"
            );
            return None;
        }
        match qos {
            QoS::AtMostOnce => {
                if let Err(e) = self.client.publish(topic, qos, false, payload).await {
                    tracing::warn!(error = %e, "could not publish an event");
                }
                None
            }
            QoS::AtLeastOnce | QoS::ExactlyOnce => {
                self.outbox.publish(topic, qos, false, payload, "an event")
            }
        }
    }

    /// Acknowledges an inbound publish (manual acks), without waiting.
    pub fn ack(&self, publish: &Publish) {
        self.outbox.ack(publish);
    }

    pub fn root(&self) -> &TopicRoot {
        &self.root
    }

    /// Shutdown, once nothing sends any more: hands every send still
    /// waiting in the outbox to the client, then queues DISCONNECT behind
    /// them. The event loop ends once the broker has closed the connection
    /// on it (see [`run_event_loop`]), so everything sent before has been
    /// written by then.
    pub async fn disconnect(&self) {
        self.outbox.close().await;
        if let Err(e) = self.client.disconnect().await {
            tracing::warn!(error = %e, "could not queue the MQTT DISCONNECT");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_id_can_be_the_servers_client_id() {
        for instance in ["idem-1", "a", "prod_east-2"] {
            let id = server_client_id(instance);
            assert!(DeviceId::parse(&id).is_err(), "{id} is a valid device id");
        }
    }
}
