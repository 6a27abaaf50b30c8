//! Fleet and per-device configuration: the broker address (plain or TLS),
//! MQTT client tuning, connection ramp and reconnect backoff, and the
//! simulated devices; plain data plus validation. The broker URL parser
//! (`broker`), the fleet's TLS settings (`tls`) and its secrets
//! (`credentials`) are submodules; nothing here connects to anything.

pub(crate) mod broker;
mod credentials;
mod tls;

use std::sync::Arc;
use std::time::Duration;

use idem_protocol::{DeviceId, Health, TopicRoot};
use serde_json::Value;

use crate::behaviour::DeviceBehaviour;
use crate::error::SimError;

pub use broker::parse_broker_url;
pub use credentials::{Credentials, SecretString};
pub use idem_protocol::{Backoff, BrokerAddr, DEFAULT_MQTTS_PORT, DEFAULT_MQTT_PORT};
pub use tls::SimTls;

/// Default bound on connection attempts in flight: Mosquitto's listen backlog
/// (100), so a fleet starting at once never overflows its accept queue.
/// Measured here with 10,000 devices: 2.5 s to connect at 100, 3.0 s at 64,
/// 3.3–4.0 s unbounded (thousands of handshakes dropped and retried 1 s later).
pub const DEFAULT_MAX_CONNECTING: usize = 100;

/// One simulated device.
#[derive(Debug, Clone, PartialEq)]
pub struct SimDevice {
    pub id: DeviceId,
    /// The spec the device runs when the simulator starts.
    pub spec: Value,
    /// The desired generation it last applied before the simulator started.
    pub generation: Option<u64>,
    pub behaviour: DeviceBehaviour,
    /// Delay between receiving a `desired` message and answering it.
    pub apply_latency: Duration,
    /// Health reported with every report.
    pub health: Health,
    /// Overrides [`DeviceBehaviour::reports_on_connect_by_default`].
    pub report_on_connect: Option<bool>,
    /// Start disconnected; [`crate::Fleet::bring_online`] connects it.
    pub start_offline: bool,
}

impl SimDevice {
    /// An accepting, healthy device running `spec` with no applied generation.
    pub fn new(id: DeviceId, spec: Value) -> Self {
        Self {
            id,
            spec,
            generation: None,
            behaviour: DeviceBehaviour::Accept,
            apply_latency: Duration::ZERO,
            health: Health::Healthy,
            report_on_connect: None,
            start_offline: false,
        }
    }

    pub fn with_generation(mut self, generation: Option<u64>) -> Self {
        self.generation = generation;
        self
    }

    pub fn with_behaviour(mut self, behaviour: DeviceBehaviour) -> Self {
        self.behaviour = behaviour;
        self
    }

    pub fn with_apply_latency(mut self, latency: Duration) -> Self {
        self.apply_latency = latency;
        self
    }

    pub fn with_health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    pub fn with_report_on_connect(mut self, report: bool) -> Self {
        self.report_on_connect = Some(report);
        self
    }

    pub fn starting_offline(mut self) -> Self {
        self.start_offline = true;
        self
    }

    /// Whether this device reports right after each (re)connect.
    pub fn reports_on_connect(&self) -> bool {
        self.report_on_connect
            .unwrap_or_else(|| self.behaviour.reports_on_connect_by_default())
    }
}

/// Everything [`crate::Fleet::start`] needs.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub broker: BrokerAddr,
    pub topic_root: TopicRoot,
    /// MQTT client id = prefix + device id. `None` uses `"{topic_root}/"`, so a
    /// client id names exactly one device on the wire and a restarted
    /// simulator takes over its predecessor's connections.
    pub client_id_prefix: Option<String>,
    pub keep_alive: Duration,
    /// New connections per second during the start-up ramp; 0 = no limit.
    /// Reconnects after errors use `backoff` instead.
    pub connect_rate: u32,
    /// Connection attempts (TCP connect until CONNACK) in flight at once when
    /// a device (re)starts its session; 0 = unbounded. Why: Mosquitto listens
    /// with a backlog of 100, so thousands of simultaneous connects overflow
    /// its accept queue, and every dropped handshake waits out the kernel's
    /// 1 s retransmission timeout. Reconnects inside a session use `backoff`.
    pub max_connecting: usize,
    /// Delays between reconnect attempts after connection errors, each
    /// scaled by a random jitter factor; counted from zero every session.
    pub backoff: Backoff,
    /// TCP connect + CONNACK timeout per attempt.
    pub connect_timeout: Duration,
    /// Periodic report (heartbeat) interval; `None` = report only on connect,
    /// `get`, pushes and local changes.
    pub report_interval: Option<Duration>,
    /// Why small: the request channel is pre-allocated per client; 10,000
    /// clients must fit in memory.
    pub request_channel_capacity: usize,
    /// Outgoing QoS 1 messages awaiting PUBACK per client.
    pub inflight: u16,
    /// Largest MQTT packet accepted or sent: the packet limit of the
    /// default spec budget (a maximal report with topic and header).
    pub max_packet_size: usize,
    /// TLS settings for an `mqtts://` broker; `None` there trusts the
    /// system's trust store.
    pub tls: Option<SimTls>,
    /// Broker passwords per device (user name = device id); `None`:
    /// devices connect without credentials.
    pub credentials: Option<Credentials>,
    pub devices: Vec<SimDevice>,
}

impl FleetConfig {
    /// Defaults: keep-alive 60 s, no connect-rate limit, at most
    /// [`DEFAULT_MAX_CONNECTING`] connects in flight, backoff 250 ms..30 s,
    /// connect timeout 10 s, no heartbeats, channel 10, inflight 10, packets up
    /// to the default spec budget's packet limit (137 KiB).
    pub fn new(broker: BrokerAddr, topic_root: TopicRoot, devices: Vec<SimDevice>) -> Self {
        Self {
            broker,
            topic_root,
            client_id_prefix: None,
            keep_alive: Duration::from_secs(60),
            connect_rate: 0,
            backoff: Backoff::device_reconnect(),
            max_connecting: DEFAULT_MAX_CONNECTING,
            connect_timeout: Duration::from_secs(10),
            report_interval: None,
            request_channel_capacity: 10,
            inflight: 10,
            max_packet_size: idem_protocol::SpecBudget::default().max_packet_bytes(),
            tls: None,
            credentials: None,
            devices,
        }
    }

    /// The TLS client configuration devices use, `None` for a plain broker.
    pub fn effective_tls(&self) -> Result<Option<Arc<rustls::ClientConfig>>, SimError> {
        match (&self.tls, self.broker.tls) {
            (_, false) => Ok(None),
            (Some(tls), true) => Ok(Some(tls.config())),
            (None, true) => Ok(Some(SimTls::from_files(None, None)?.config())),
        }
    }

    /// The client-id prefix in effect (see [`FleetConfig::client_id_prefix`]).
    pub fn effective_client_id_prefix(&self) -> String {
        self.client_id_prefix.clone().unwrap_or_else(|| {
            if self.credentials.is_some() {
                // Devices with their own accounts connect as the protocol
                // says: client id = user name = device id (brokers bind the
                // two).
                String::new()
            } else {
                format!("{}/", self.topic_root)
            }
        })
    }

    /// Checks what rumqttc would otherwise panic on, and duplicate ids.
    pub fn validate(&self) -> Result<(), SimError> {
        if !self.keep_alive.is_zero() && self.keep_alive < Duration::from_secs(1) {
            return Err(SimError::InvalidKeepAlive(self.keep_alive));
        }
        if self.inflight == 0 {
            return Err(SimError::ZeroInflight);
        }
        let mut seen = std::collections::HashSet::with_capacity(self.devices.len());
        for d in &self.devices {
            if !seen.insert(d.id.as_str()) {
                return Err(SimError::DuplicateDevice(d.id.clone()));
            }
        }
        if self.tls.is_some() && !self.broker.tls {
            return Err(SimError::TlsNeedsMqtts(self.broker.to_string()));
        }
        if let Some(credentials) = &self.credentials {
            let missing: Vec<&DeviceId> = self
                .devices
                .iter()
                .map(|d| &d.id)
                .filter(|id| credentials.password(id).is_none())
                .collect();
            if let Some(first) = missing.first() {
                return Err(SimError::MissingPassword {
                    device: (*first).clone(),
                    missing: missing.len(),
                });
            }
        }
        Ok(())
    }
}

/// How [`crate::Fleet::take_offline`] disconnects a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfflineMode {
    /// Publish retained `offline`, then send MQTT DISCONNECT (no Last Will).
    Clean,
    /// Drop the TCP connection without DISCONNECT: the broker publishes the
    /// Last Will (`offline`), like a device losing power.
    Abrupt,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_fleet_with_duplicate_ids_or_bad_keep_alive_is_refused() {
        let id = DeviceId::parse("d1").unwrap();
        let dev = SimDevice::new(id, json!({}));
        let mut cfg = FleetConfig::new(
            BrokerAddr::new("localhost", 1883),
            TopicRoot::default(),
            vec![dev.clone(), dev],
        );
        assert!(matches!(cfg.validate(), Err(SimError::DuplicateDevice(_))));
        cfg.devices.truncate(1);
        assert!(cfg.validate().is_ok());
        cfg.keep_alive = Duration::from_millis(500);
        assert!(matches!(cfg.validate(), Err(SimError::InvalidKeepAlive(_))));
    }

    #[test]
    fn the_default_client_id_is_the_topic_root_and_device_id() {
        let cfg = FleetConfig::new(
            BrokerAddr::new("localhost", 1883),
            TopicRoot::new("t/1").unwrap(),
            vec![],
        );
        assert_eq!(cfg.effective_client_id_prefix(), "t/1/");
    }

    #[test]
    fn silent_devices_do_not_report_on_connect_unless_told_to() {
        let id = DeviceId::parse("d1").unwrap();
        let silent = SimDevice::new(id, json!({})).with_behaviour(DeviceBehaviour::Silent);
        assert!(!silent.reports_on_connect());
        assert!(silent.with_report_on_connect(true).reports_on_connect());
    }
}
