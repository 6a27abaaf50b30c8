//! The MQTT adapter for one simulated device: a logic task that turns broker
//! messages and fleet commands into reports (via the pure functions in
//! `behaviour`), and a poller task that owns the rumqttc `EventLoop`.
//!
//! Why two tasks: the event loop must be polled continuously and its `poll()`
//! must not be cancelled mid-flight by a `select!` (a request taken from the
//! channel could be lost). The poller only polls, backs off after errors and
//! forwards the few events that matter; the logic task never awaits the
//! client, it hands requests over with `try_*` and retries from its own
//! outbox. No lock is held across `.await`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use idem_protocol::{Channel, Desired, DeviceId, SpecBudget, Status, TopicRoot};
use rand::Rng;
use rumqttc::{
    AsyncClient, Event, EventLoop, MqttOptions, NetworkOptions, Outgoing, Packet, Publish, QoS,
    SubscribeFilter,
};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{sleep, sleep_until, Instant};
use tokio_util::sync::CancellationToken;

use crate::behaviour::{respond_to_desired, DeviceBehaviour, DeviceState};
use crate::config::{Backoff, OfflineMode};

/// State shared between one device task and the fleet handle (`crate::fleet::Fleet`).
pub(crate) struct DeviceShared {
    pub(crate) id: DeviceId,
    pub(crate) state: Mutex<DeviceState>,
    /// True between CONNACK and the next connection loss or disconnect.
    pub(crate) connected: AtomicBool,
}

impl DeviceShared {
    /// Locks the state; a poisoned lock still holds consistent plain data.
    pub(crate) fn lock(&self) -> MutexGuard<'_, DeviceState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Fleet-wide counters, updated by device tasks without locks.
#[derive(Default)]
pub(crate) struct FleetCounters {
    pub(crate) connected: AtomicUsize,
    pub(crate) connections: AtomicU64,
    pub(crate) connection_errors: AtomicU64,
    pub(crate) reports_sent: AtomicU64,
    pub(crate) desired_received: AtomicU64,
    pub(crate) get_received: AtomicU64,
    pub(crate) rejections: AtomicU64,
    pub(crate) invalid_messages: AtomicU64,
    /// Woken on every connect/disconnect, for `Fleet::wait_connected`.
    pub(crate) connected_changed: Notify,
}

impl FleetCounters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// How long a clean disconnect may take before the connection is dropped.
const DISCONNECT_GRACE: Duration = Duration::from_secs(2);
/// Retry delay for requests the client's (full) channel refused.
const OUTBOX_RETRY: Duration = Duration::from_millis(20);
/// Events buffered between poller and logic task.
const WIRE_CAPACITY: usize = 16;

/// Fleet → device commands.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Command {
    Report,
    Offline(OfflineMode),
    Online,
}

/// The device's topics, built once.
pub(crate) struct Topics {
    reported: String,
    desired: String,
    status: String,
    get: String,
}

impl Topics {
    pub(crate) fn new(root: &TopicRoot, id: &DeviceId) -> Self {
        Self {
            reported: root.topic(id, Channel::Reported),
            desired: root.topic(id, Channel::Desired),
            status: root.topic(id, Channel::Status),
            get: root.topic(id, Channel::Get),
        }
    }
}

/// Poller → logic task events. Small on purpose (boxed payload, error as
/// text): tokio's channel allocates 32 slots per device.
enum Wire {
    Connected,
    Disconnected(String),
    Message(Box<Publish>),
    DisconnectSent,
}

/// A request waiting for room in the client's channel.
enum Request {
    Subscribe,
    Publish {
        topic: String,
        retain: bool,
        payload: Vec<u8>,
        is_report: bool,
        /// Answers an applied push: stamps `confirmed_at` when handed over.
        confirms: bool,
    },
}

/// Why a session (one client + event loop) ended.
enum SessionEnd {
    Cancelled,
    Offline(OfflineMode),
    /// The poller stopped unexpectedly; start a fresh session.
    Restart,
}

pub(crate) struct DeviceTask {
    pub(crate) shared: Arc<DeviceShared>,
    pub(crate) counters: Arc<FleetCounters>,
    pub(crate) behaviour: DeviceBehaviour,
    pub(crate) reports_on_connect: bool,
    pub(crate) apply_latency: Duration,
    pub(crate) start_offline: bool,
    pub(crate) topics: Topics,
    pub(crate) options: MqttOptions,
    pub(crate) network: NetworkOptions,
    pub(crate) backoff: Backoff,
    pub(crate) report_interval: Option<Duration>,
    /// This device's slot in the connection ramp.
    pub(crate) start_at: Instant,
    /// Bounds connection attempts in flight across the fleet (see
    /// `FleetConfig::max_connecting`); `None` = unbounded.
    pub(crate) connect_gate: Option<Arc<Semaphore>>,
    pub(crate) token: CancellationToken,
    pub(crate) commands: mpsc::UnboundedReceiver<Command>,
}

impl DeviceTask {
    pub(crate) async fn run(mut self) {
        let mut online = !self.start_offline;
        if online {
            tokio::select! {
                _ = self.token.cancelled() => return,
                _ = sleep_until(self.start_at) => {}
            }
        }
        loop {
            if online {
                match self.session().await {
                    SessionEnd::Cancelled => return,
                    SessionEnd::Offline(_) => online = false,
                    SessionEnd::Restart => {
                        tokio::select! {
                            _ = self.token.cancelled() => return,
                            _ = sleep(self.backoff.start()) => {}
                        }
                    }
                }
            } else {
                tokio::select! {
                    _ = self.token.cancelled() => return,
                    command = self.commands.recv() => match command {
                        None => return,
                        Some(Command::Online) => online = true,
                        // Offline devices report when they next connect.
                        Some(Command::Report | Command::Offline(_)) => {}
                    },
                }
            }
        }
    }

    /// One MQTT client lifetime: connect, reconnect as needed, until
    /// cancelled or taken offline.
    async fn session(&mut self) -> SessionEnd {
        // Held from before the connect until CONNACK or the first failure.
        let connecting = match self.connect_gate.clone() {
            None => None,
            Some(gate) => tokio::select! {
                _ = self.token.cancelled() => return SessionEnd::Cancelled,
                permit = gate.acquire_owned() => permit.ok(),
            },
        };
        let (client, mut eventloop) = AsyncClient::new(
            self.options.clone(),
            self.options.request_channel_capacity(),
        );
        eventloop.set_network_options(self.network.clone());
        let (wire_tx, mut wire) = mpsc::channel(WIRE_CAPACITY);
        let poller = tokio::spawn(poll_loop(
            eventloop,
            wire_tx,
            self.backoff,
            Arc::clone(&self.counters),
            self.shared.id.clone(),
        ));
        let mut s = Session {
            client,
            outbox: VecDeque::new(),
            retry_at: None,
            applies: VecDeque::new(),
            next_heartbeat: None,
            connecting,
        };

        let end = loop {
            let apply_due = s.applies.front().map(|(at, _)| *at);
            tokio::select! {
                biased;
                _ = self.token.cancelled() => break SessionEnd::Cancelled,
                command = self.commands.recv() => match command {
                    None => break SessionEnd::Cancelled,
                    Some(Command::Offline(mode)) => break SessionEnd::Offline(mode),
                    Some(Command::Online) => {}
                    Some(Command::Report) => {
                        if self.is_connected() && self.behaviour.sends_reports() {
                            self.queue_report(&mut s);
                        }
                    }
                },
                event = wire.recv() => match event {
                    None => break SessionEnd::Restart,
                    Some(event) => self.on_wire(&mut s, event),
                },
                _ = sleep_until(far_or(apply_due)), if apply_due.is_some() => {
                    if let Some((_, desired)) = s.applies.pop_front() {
                        self.apply(&mut s, &desired);
                    }
                },
                _ = sleep_until(far_or(s.next_heartbeat)), if s.next_heartbeat.is_some() => {
                    if let Some(interval) = self.report_interval {
                        s.next_heartbeat = Some(Instant::now() + interval);
                    }
                    if self.is_connected() && self.behaviour.sends_reports() {
                        self.queue_report(&mut s);
                    }
                },
                _ = sleep_until(far_or(s.retry_at)), if s.retry_at.is_some() => {
                    s.retry_at = None;
                },
            }
            if self.is_connected() {
                self.flush(&mut s);
            }
        };

        match end {
            SessionEnd::Cancelled | SessionEnd::Offline(OfflineMode::Clean) => {
                if self.is_connected() {
                    self.disconnect_cleanly(&s.client, &mut wire).await;
                }
                poller.abort();
            }
            SessionEnd::Offline(OfflineMode::Abrupt) | SessionEnd::Restart => poller.abort(),
        }
        self.set_connected(false);
        end
    }

    fn on_wire(&self, s: &mut Session, event: Wire) {
        match event {
            Wire::Connected => {
                s.connecting = None;
                // Count first: `set_connected` wakes waiters that read stats.
                FleetCounters::bump(&self.counters.connections);
                self.set_connected(true);
                // Whatever was queued for the lost connection is superseded by
                // the fresh subscribe + status + report below.
                s.outbox.clear();
                s.retry_at = None;
                s.outbox.push_back(Request::Subscribe);
                s.outbox.push_back(Request::Publish {
                    topic: self.topics.status.clone(),
                    retain: true,
                    payload: Status::Online.as_payload().to_vec(),
                    is_report: false,
                    confirms: false,
                });
                if self.reports_on_connect {
                    self.queue_report(s);
                }
                if let Some(interval) = self.report_interval {
                    // Spread heartbeats so a fleet that connected together
                    // does not report in lockstep.
                    let first = interval.mul_f64(rand::rng().random_range(0.1..=1.0));
                    s.next_heartbeat = Some(Instant::now() + first);
                }
            }
            Wire::Disconnected(error) => {
                s.connecting = None;
                if self.is_connected() {
                    tracing::debug!(device = %self.shared.id, %error, "connection lost");
                } else {
                    tracing::trace!(device = %self.shared.id, %error, "connect failed");
                }
                self.set_connected(false);
                s.next_heartbeat = None;
            }
            Wire::DisconnectSent => {}
            Wire::Message(publish) => self.on_message(s, &publish),
        }
    }

    fn on_message(&self, s: &mut Session, publish: &Publish) {
        if publish.topic == self.topics.desired {
            if publish.payload.is_empty() {
                // The server cleared the retained desired message (the device
                // was deleted): nothing to apply, nothing to answer.
                return;
            }
            let desired = match Desired::decode(&publish.payload, SpecBudget::default()) {
                Ok(desired) => desired,
                Err(error) => {
                    FleetCounters::bump(&self.counters.invalid_messages);
                    tracing::warn!(device = %self.shared.id, %error, "ignoring invalid desired payload");
                    return;
                }
            };
            {
                let mut state = self.shared.lock();
                state.desired_received += 1;
                state.desired_at = Some(std::time::Instant::now());
            }
            FleetCounters::bump(&self.counters.desired_received);
            if !self.behaviour.answers_desired() {
                return;
            }
            if self.apply_latency.is_zero() {
                self.apply(s, &desired);
            } else {
                s.applies
                    .push_back((Instant::now() + self.apply_latency, desired));
            }
        } else if publish.topic == self.topics.get {
            self.shared.lock().get_received += 1;
            FleetCounters::bump(&self.counters.get_received);
            if self.behaviour.answers_get() {
                self.queue_report(s);
            }
        } else {
            tracing::debug!(device = %self.shared.id, topic = %publish.topic, "ignoring message on unexpected topic");
        }
    }

    fn apply(&self, s: &mut Session, desired: &Desired) {
        let report = {
            let mut state = self.shared.lock();
            respond_to_desired(&mut state, &self.behaviour, desired)
        };
        let Some(report) = report else { return };
        let confirms = report.error.is_none();
        if !confirms {
            FleetCounters::bump(&self.counters.rejections);
        }
        s.outbox.push_back(Request::Publish {
            topic: self.topics.reported.clone(),
            retain: false,
            payload: report.encode(),
            is_report: true,
            confirms,
        });
    }

    fn queue_report(&self, s: &mut Session) {
        let report = self.shared.lock().report();
        s.outbox.push_back(Request::Publish {
            topic: self.topics.reported.clone(),
            retain: false,
            payload: report.encode(),
            is_report: true,
            confirms: false,
        });
    }

    /// Hands queued requests to the client until its channel is full.
    fn flush(&self, s: &mut Session) {
        while let Some(request) = s.outbox.front() {
            let sent = match request {
                Request::Subscribe => s
                    .client
                    .try_subscribe_many([
                        SubscribeFilter::new(self.topics.desired.clone(), QoS::AtLeastOnce),
                        SubscribeFilter::new(self.topics.get.clone(), QoS::AtLeastOnce),
                    ])
                    .is_ok(),
                Request::Publish {
                    topic,
                    retain,
                    payload,
                    is_report,
                    confirms,
                } => {
                    let ok = s
                        .client
                        .try_publish(topic.clone(), QoS::AtLeastOnce, *retain, payload.clone())
                        .is_ok();
                    if ok && *is_report {
                        let mut state = self.shared.lock();
                        state.reports_sent += 1;
                        if *confirms {
                            state.confirmed_at = Some(std::time::Instant::now());
                        }
                        drop(state);
                        FleetCounters::bump(&self.counters.reports_sent);
                    }
                    ok
                }
            };
            if !sent {
                s.retry_at = Some(Instant::now() + OUTBOX_RETRY);
                return;
            }
            s.outbox.pop_front();
        }
    }

    /// Retained `offline`, then DISCONNECT (so the broker skips the Last
    /// Will), bounded by [`DISCONNECT_GRACE`].
    async fn disconnect_cleanly(&self, client: &AsyncClient, wire: &mut mpsc::Receiver<Wire>) {
        let send = async {
            // Errors here mean the poller is gone; the abort below covers it.
            let _ = client
                .publish(
                    self.topics.status.clone(),
                    QoS::AtLeastOnce,
                    true,
                    Status::Offline.as_payload(),
                )
                .await;
            let _ = client.disconnect().await;
        };
        let sent = async {
            while let Some(event) = wire.recv().await {
                if matches!(event, Wire::DisconnectSent | Wire::Disconnected(_)) {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(DISCONNECT_GRACE, async { tokio::join!(send, sent) }).await;
    }

    fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
    }

    fn set_connected(&self, connected: bool) {
        if self.shared.connected.swap(connected, Ordering::Relaxed) != connected {
            if connected {
                self.counters.connected.fetch_add(1, Ordering::Relaxed);
            } else {
                self.counters.connected.fetch_sub(1, Ordering::Relaxed);
            }
            self.counters.connected_changed.notify_waiters();
        }
    }
}

/// Per-session mutable state of the logic task.
struct Session {
    client: AsyncClient,
    /// Requests not yet accepted by the client's channel, in order.
    outbox: VecDeque<Request>,
    /// When to retry the outbox after the channel was full.
    retry_at: Option<Instant>,
    /// Desired messages waiting out the apply latency, in arrival order
    /// (one latency per device, so deadlines are sorted).
    applies: VecDeque<(Instant, Desired)>,
    next_heartbeat: Option<Instant>,
    /// The fleet-wide connect permit, until this session's first CONNACK or
    /// failure.
    connecting: Option<OwnedSemaphorePermit>,
}

/// A deadline for disabled `select!` branches, whose futures are still built.
fn far_or(deadline: Option<Instant>) -> Instant {
    deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400))
}

/// Polls the event loop, forwarding what the logic task needs and sleeping
/// with capped exponential backoff + jitter after each error. Ends once a
/// DISCONNECT has been written, when the logic task drops its receiver, or
/// when it aborts this task.
async fn poll_loop(
    mut eventloop: EventLoop,
    wire: mpsc::Sender<Wire>,
    mut backoff: Backoff,
    counters: Arc<FleetCounters>,
    id: DeviceId,
) {
    // Every session counts its consecutive failures from none.
    backoff.reset();
    loop {
        let event = match eventloop.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                backoff.reset();
                Some(Wire::Connected)
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => Some(Wire::Message(Box::new(publish))),
            Ok(Event::Outgoing(Outgoing::Disconnect)) => {
                // Deliberate disconnect: stop here instead of reconnecting.
                let _ = wire.send(Wire::DisconnectSent).await;
                return;
            }
            Ok(Event::Incoming(_) | Event::Outgoing(_)) => None,
            Err(error) => {
                FleetCounters::bump(&counters.connection_errors);
                if wire
                    .send(Wire::Disconnected(error.to_string()))
                    .await
                    .is_err()
                {
                    return;
                }
                let jitter = rand::rng().random_range(Backoff::JITTER_FACTORS);
                let delay = backoff.next_jittered_delay(jitter);
                let failures = backoff.failures();
                tracing::trace!(device = %id, ?delay, failures, "reconnecting after backoff");
                sleep(delay).await;
                continue;
            }
        };
        if let Some(event) = event {
            if wire.send(event).await.is_err() {
                return;
            }
        }
    }
}
