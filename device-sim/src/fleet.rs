//! The running fleet: starts one task per device, exposes per-device
//! snapshots and fleet-wide counters, and controls devices (local spec
//! changes, offline/online, shutdown). Owns the shared state the device tasks
//! write; never holds a lock across `.await`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_protocol::{Channel, DeviceId, Health, Rejection, TopicRoot};
use rumqttc::{LastWill, MqttOptions, NetworkOptions, QoS, TlsConfiguration, Transport};
use serde_json::Value;
use tokio::sync::{mpsc, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::behaviour::{seq_base_now, DeviceState};
use crate::config::{FleetConfig, OfflineMode, SimDevice};
use crate::device_task::{Command, DeviceShared, DeviceTask, FleetCounters, Topics};
use crate::error::SimError;

/// A point-in-time copy of the fleet-wide counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct FleetStats {
    pub devices: usize,
    /// Devices connected right now (CONNACK received, not yet lost).
    pub connected: usize,
    /// Successful connects, including reconnects.
    pub connections: u64,
    /// Failed connects and dropped connections.
    pub connection_errors: u64,
    /// Reports handed to the MQTT clients.
    pub reports_sent: u64,
    pub desired_received: u64,
    pub get_received: u64,
    pub rejections: u64,
    /// `desired` payloads that could not be decoded (ignored).
    pub invalid_messages: u64,
}

/// A point-in-time copy of one device's state.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSnapshot {
    pub id: DeviceId,
    pub connected: bool,
    pub spec: Value,
    pub generation: Option<u64>,
    pub health: Health,
    /// `seq` of the last report built.
    pub seq: u64,
    pub reports_sent: u64,
    pub desired_received: u64,
    pub get_received: u64,
    pub rejections: u64,
    pub last_rejection: Option<Rejection>,
    /// When the last valid `desired` message arrived.
    pub desired_at: Option<std::time::Instant>,
    /// When the report confirming the last applied push was handed to the
    /// MQTT client.
    pub confirmed_at: Option<std::time::Instant>,
    /// Every generation whose (changed) spec the device installed, in order.
    pub installed: Vec<u64>,
}

struct DeviceHandle {
    shared: Arc<DeviceShared>,
    commands: mpsc::UnboundedSender<Command>,
}

/// How long [`Fleet::shutdown`] waits for every device task to end: each
/// bounds its own clean disconnect to about 2 s, and they run in parallel.
pub const SHUTDOWN_LIMIT: Duration = Duration::from_secs(30);

/// A running simulated fleet. Dropping it cancels every device (without
/// waiting); [`Fleet::shutdown`] disconnects them cleanly and waits.
pub struct Fleet {
    topic_root: TopicRoot,
    devices: Vec<DeviceHandle>,
    index: HashMap<DeviceId, usize>,
    counters: Arc<FleetCounters>,
    token: CancellationToken,
    tracker: TaskTracker,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("topic_root", &self.topic_root)
            .field("devices", &self.devices.len())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// One device's MQTT options: client id, keepalive, buffers, its Last
/// Will (`offline`, retained), TLS and credentials.
fn mqtt_options(
    config: &FleetConfig,
    device: &SimDevice,
    client_prefix: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> MqttOptions {
    let mut options = MqttOptions::new(
        format!("{client_prefix}{}", device.id),
        config.broker.host.clone(),
        config.broker.port,
    );
    options
        .set_keep_alive(config.keep_alive)
        .set_clean_session(true)
        .set_inflight(config.inflight)
        .set_request_channel_capacity(config.request_channel_capacity)
        .set_max_packet_size(config.max_packet_size, config.max_packet_size)
        .set_last_will(LastWill::new(
            config.topic_root.topic(&device.id, Channel::Status),
            "offline",
            QoS::AtLeastOnce,
            true,
        ));
    if let Some(tls) = tls {
        options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
            tls.clone(),
        )));
    }
    if let Some(credentials) = &config.credentials {
        // validate() checked that every device has a password.
        if let Some(password) = credentials.password(&device.id) {
            options.set_credentials(device.id.as_str(), password.expose());
        }
    }
    options
}

impl Fleet {
    /// Validates `config` and spawns one task per device on the current tokio
    /// runtime. Returns at once; devices connect in the background, paced by
    /// `config.connect_rate`.
    pub fn start(mut config: FleetConfig) -> Result<Fleet, SimError> {
        config.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| SimError::NoRuntime)?;
        let client_prefix = config.effective_client_id_prefix();
        let counters = Arc::new(FleetCounters::default());
        let token = CancellationToken::new();
        let tracker = TaskTracker::new();
        let seq_base = seq_base_now();
        let t0 = Instant::now();
        let connect_gate =
            (config.max_connecting > 0).then(|| Arc::new(Semaphore::new(config.max_connecting)));
        // One TLS configuration shared by every connection (Arc).
        let tls = config.effective_tls()?;
        let mut network = NetworkOptions::new();
        network.set_connection_timeout(config.connect_timeout.as_secs().max(1));

        let sims = std::mem::take(&mut config.devices);
        let mut devices = Vec::with_capacity(sims.len());
        let mut index = HashMap::with_capacity(sims.len());
        for (i, device) in sims.into_iter().enumerate() {
            let topics = Topics::new(&config.topic_root, &device.id);
            let options = mqtt_options(&config, &device, &client_prefix, tls.as_ref());
            let start_at = match config.connect_rate {
                0 => t0,
                rate => t0 + Duration::from_secs_f64(i as f64 / f64::from(rate)),
            };
            let shared = Arc::new(DeviceShared {
                id: device.id.clone(),
                state: Mutex::new(DeviceState::new(
                    device.spec.clone(),
                    device.generation,
                    device.health,
                    seq_base,
                )),
                connected: AtomicBool::new(false),
            });
            let (commands, commands_rx) = mpsc::unbounded_channel();
            let task = DeviceTask {
                shared: Arc::clone(&shared),
                counters: Arc::clone(&counters),
                reports_on_connect: device.reports_on_connect(),
                behaviour: device.behaviour,
                apply_latency: device.apply_latency,
                start_offline: device.start_offline,
                topics,
                options,
                network: network.clone(),
                backoff: config.backoff,
                report_interval: config.report_interval,
                start_at,
                connect_gate: connect_gate.clone(),
                token: token.clone(),
                commands: commands_rx,
            };
            tracker.spawn_on(task.run(), &runtime);
            index.insert(device.id, i);
            devices.push(DeviceHandle { shared, commands });
        }
        tracker.close();
        Ok(Fleet {
            topic_root: config.topic_root,
            devices,
            index,
            counters,
            token,
            tracker,
        })
    }

    pub fn topic_root(&self) -> &TopicRoot {
        &self.topic_root
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Device ids in configuration order.
    pub fn device_ids(&self) -> impl Iterator<Item = &DeviceId> + '_ {
        self.devices.iter().map(|d| &d.shared.id)
    }

    /// Devices connected right now (after CONNACK).
    pub fn connected_count(&self) -> usize {
        self.counters.connected.load(Ordering::Relaxed)
    }

    /// Waits until at least `n` devices are connected at once.
    pub async fn wait_connected(&self, n: usize, timeout: Duration) -> Result<(), SimError> {
        let deadline = Instant::now() + timeout;
        loop {
            let changed = self.counters.connected_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.connected_count() >= n {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(SimError::ConnectTimeout {
                    timeout,
                    wanted: n,
                    connected: self.connected_count(),
                });
            }
        }
    }

    /// Fleet-wide counters.
    pub fn stats(&self) -> FleetStats {
        let c = &self.counters;
        FleetStats {
            devices: self.devices.len(),
            connected: c.connected.load(Ordering::Relaxed),
            connections: c.connections.load(Ordering::Relaxed),
            connection_errors: c.connection_errors.load(Ordering::Relaxed),
            reports_sent: c.reports_sent.load(Ordering::Relaxed),
            desired_received: c.desired_received.load(Ordering::Relaxed),
            get_received: c.get_received.load(Ordering::Relaxed),
            rejections: c.rejections.load(Ordering::Relaxed),
            invalid_messages: c.invalid_messages.load(Ordering::Relaxed),
        }
    }

    /// One device's current state, or `None` for an unknown id.
    pub fn state(&self, id: &DeviceId) -> Option<DeviceSnapshot> {
        self.handle(id).ok().map(|h| snapshot(&h.shared))
    }

    /// Every device's current state, in configuration order.
    pub fn states(&self) -> Vec<DeviceSnapshot> {
        self.devices.iter().map(|h| snapshot(&h.shared)).collect()
    }

    /// Changes the spec a device runs (keeping its applied generation), as if
    /// someone reconfigured it locally, and makes it report (unless it is
    /// silent; an offline device reports when it next connects).
    pub fn set_local_spec(&self, id: &DeviceId, spec: Value) -> Result<(), SimError> {
        let handle = self.handle(id)?;
        handle.shared.lock().spec = spec;
        send(handle, id, Command::Report)
    }

    /// Changes the health a device reports, and makes it report.
    pub fn set_health(&self, id: &DeviceId, health: Health) -> Result<(), SimError> {
        let handle = self.handle(id)?;
        handle.shared.lock().health = health;
        send(handle, id, Command::Report)
    }

    /// Makes a device report its current state now (if connected and not
    /// silent).
    pub fn request_report(&self, id: &DeviceId) -> Result<(), SimError> {
        send(self.handle(id)?, id, Command::Report)
    }

    /// Disconnects a device until [`Fleet::bring_online`].
    pub fn take_offline(&self, id: &DeviceId, mode: OfflineMode) -> Result<(), SimError> {
        send(self.handle(id)?, id, Command::Offline(mode))
    }

    /// Reconnects a device taken offline (or started offline).
    pub fn bring_online(&self, id: &DeviceId) -> Result<(), SimError> {
        send(self.handle(id)?, id, Command::Online)
    }

    /// Disconnects every device cleanly (retained `offline`, then DISCONNECT,
    /// at most ~2 s per device, all in parallel), waits for all tasks (at
    /// most [`SHUTDOWN_LIMIT`]) and returns the final counters.
    pub async fn shutdown(self) -> Result<FleetStats, SimError> {
        self.shutdown_within(SHUTDOWN_LIMIT).await
    }

    /// [`Fleet::shutdown`], waiting at most `limit` for the device tasks;
    /// past it the error says how many still run (they stay cancelled and
    /// end with the runtime).
    pub async fn shutdown_within(self, limit: Duration) -> Result<FleetStats, SimError> {
        self.token.cancel();
        if tokio::time::timeout(limit, self.tracker.wait())
            .await
            .is_err()
        {
            return Err(SimError::ShutdownTimeout {
                limit,
                devices: self.devices.len(),
                running: self.tracker.len(),
            });
        }
        Ok(self.stats())
    }

    fn handle(&self, id: &DeviceId) -> Result<&DeviceHandle, SimError> {
        self.index
            .get(id)
            .and_then(|i| self.devices.get(*i))
            .ok_or_else(|| SimError::UnknownDevice(id.clone()))
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

fn send(handle: &DeviceHandle, id: &DeviceId, command: Command) -> Result<(), SimError> {
    handle
        .commands
        .send(command)
        .map_err(|_| SimError::DeviceStopped(id.clone()))
}

fn snapshot(shared: &DeviceShared) -> DeviceSnapshot {
    let connected = shared.connected.load(Ordering::Relaxed);
    let state = shared.lock();
    DeviceSnapshot {
        id: shared.id.clone(),
        connected,
        spec: state.spec.clone(),
        generation: state.generation,
        health: state.health,
        seq: state.seq,
        reports_sent: state.reports_sent,
        desired_received: state.desired_received,
        get_received: state.get_received,
        rejections: state.rejections,
        last_rejection: state.last_rejection.clone(),
        desired_at: state.desired_at,
        confirmed_at: state.confirmed_at,
        installed: state.installed.clone(),
    }
}
