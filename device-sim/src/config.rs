//! Fleet and per-device configuration: broker address (plain or TLS), MQTT
//! client tuning, connection ramp and reconnect backoff, the fleet's TLS
//! settings and per-device credentials. Plain data plus validation and
//! reading the files they come from; nothing here connects to anything.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idem_protocol::{DeviceId, Health, TopicRoot};
use serde_json::Value;

use crate::behaviour::DeviceBehaviour;
use crate::error::SimError;

/// Default MQTT port when a broker URL names none.
pub const DEFAULT_MQTT_PORT: u16 = 1883;
/// Default port of `mqtts://` (MQTT over TLS).
pub const DEFAULT_MQTTS_PORT: u16 = 8883;

/// Default bound on connection attempts in flight: Mosquitto's listen backlog
/// (100), so a fleet starting at once never overflows its accept queue.
/// Measured here with 10,000 devices: 2.5 s to connect at 100, 3.0 s at 64,
/// 3.3–4.0 s unbounded (thousands of handshakes dropped and retried 1 s later).
pub const DEFAULT_MAX_CONNECTING: usize = 100;

/// Where the broker listens: plain TCP (`mqtt://`) or TLS (`mqtts://`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddr {
    pub host: String,
    pub port: u16,
    /// The connection is TLS ([`FleetConfig::tls`] says what to trust).
    pub tls: bool,
}

impl BrokerAddr {
    /// A plain TCP broker.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
            tls: false,
        }
    }

    /// A TLS broker.
    pub fn tls(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
            tls: true,
        }
    }

    /// Parses `mqtt://host[:port]`, `tcp://host[:port]`, a bare
    /// `host[:port]` (plain, default port 1883) or `mqtts://host[:port]` /
    /// `ssl://…` (TLS, default port 8883); IPv6 hosts in brackets:
    /// `mqtt://[::1]:1883`.
    pub fn parse(url: &str) -> Result<Self, SimError> {
        // A password typed into the URL is never echoed.
        let shown = match url.rsplit_once('@') {
            Some((before, after)) => {
                let scheme = before.split_once("://").map_or("", |(s, _)| s);
                format!("{scheme}://***@{after}")
            }
            None => url.to_owned(),
        };
        let bad = |reason: &str| SimError::InvalidBrokerUrl {
            url: shown.clone(),
            reason: reason.to_owned(),
        };
        let (rest, tls) = match url.split_once("://") {
            Some(("mqtt" | "tcp", rest)) => (rest, false),
            Some(("mqtts" | "ssl", rest)) => (rest, true),
            Some(("ws" | "wss", _)) => {
                return Err(bad(
                    "websockets are not supported: use mqtt:// (plain TCP) or mqtts:// (TLS)",
                ))
            }
            Some((scheme, _)) => return Err(bad(&format!("unknown scheme {scheme:?}"))),
            None => (url, false),
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains('@') {
            return Err(bad(
                "credentials do not belong in the URL: use a credentials file (--credentials-file)",
            ));
        }
        if rest.contains(['/', '?']) {
            return Err(bad("paths and query strings are not supported"));
        }
        let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
            let (host, after) = bracketed
                .split_once(']')
                .ok_or_else(|| bad("unclosed '[' in IPv6 host"))?;
            let port = match after.strip_prefix(':') {
                Some(port) => Some(port),
                None if after.is_empty() => None,
                None => return Err(bad("unexpected text after IPv6 host")),
            };
            (host, port)
        } else {
            match rest.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            }
        };
        if host.is_empty() {
            return Err(bad("host is empty"));
        }
        let port = match port {
            None if tls => DEFAULT_MQTTS_PORT,
            None => DEFAULT_MQTT_PORT,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("port must be a number from 1 to 65535"))?,
        };
        Ok(Self {
            host: host.to_owned(),
            port,
            tls,
        })
    }
}

impl FromStr for BrokerAddr {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for BrokerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "mqtts" } else { "mqtt" };
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

/// A value that is never printed: `Debug` and `Display` show `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretString(String);

impl SecretString {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the one place it is sent (CONNECT, the HTTP header).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for SecretString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl FromStr for SecretString {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

/// The fleet's TLS client settings: what to trust (a CA file or the
/// system's trust store) and, optionally, one client certificate every
/// device presents. Loaded once, shared by every connection.
#[derive(Clone)]
pub struct SimTls {
    config: Arc<rustls::ClientConfig>,
    /// Where it came from, for `Debug` (never key material).
    source: String,
}

impl fmt::Debug for SimTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimTls({})", self.source)
    }
}

impl SimTls {
    /// Trusts the CA(s) in `ca_file` (PEM), or the system trust store when
    /// `None`; presents `client` (certificate chain, key; PEM) when given.
    pub fn from_files(
        ca_file: Option<&Path>,
        client: Option<(&Path, &Path)>,
    ) -> Result<Self, SimError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        // Err: a provider is installed already, which is then used.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bad = |path: &Path, reason: String| SimError::Tls {
            path: path.to_path_buf(),
            reason,
        };
        let read = |path: &Path| {
            std::fs::read(path).map_err(|e| bad(path, format!("cannot read it: {e}")))
        };
        let certs = |path: &Path| -> Result<Vec<CertificateDer<'static>>, SimError> {
            let pem = read(path)?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(path, e.to_string()))?;
            if certs.is_empty() {
                return Err(bad(path, "no PEM certificate in it".to_owned()));
            }
            Ok(certs)
        };
        let mut roots = rustls::RootCertStore::empty();
        match ca_file {
            Some(path) => {
                for cert in certs(path)? {
                    roots.add(cert).map_err(|e| bad(path, e.to_string()))?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(SimError::Tls {
                        path: PathBuf::from("(system trust store)"),
                        reason: "no usable CA certificate; pass --ca-file".to_owned(),
                    });
                }
            }
        }
        let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
        let config = match client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certs(cert)?;
                let key_pem = read(key)?;
                let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
                    .map_err(|e| bad(key, format!("no unencrypted PEM private key in it ({e})")))?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    bad(cert, format!("certificate and key do not go together: {e}"))
                })?
            }
        };
        let source = match (ca_file, client) {
            (Some(ca), None) => format!("ca {}", ca.display()),
            (Some(ca), Some((cert, _))) => {
                format!("ca {}, client cert {}", ca.display(), cert.display())
            }
            (None, None) => "system roots".to_owned(),
            (None, Some((cert, _))) => format!("system roots, client cert {}", cert.display()),
        };
        Ok(Self {
            config: Arc::new(config),
            source,
        })
    }

    /// An existing rustls configuration.
    pub fn from_config(config: Arc<rustls::ClientConfig>) -> Self {
        Self {
            config,
            source: "rustls config".to_owned(),
        }
    }

    pub fn config(&self) -> Arc<rustls::ClientConfig> {
        self.config.clone()
    }
}

/// Per-device broker passwords; the user name is the device id. `Debug`
/// shows how many, never a password.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    passwords: HashMap<DeviceId, SecretString>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credentials({} devices)", self.passwords.len())
    }
}

impl Credentials {
    pub fn new(passwords: HashMap<DeviceId, String>) -> Self {
        Self {
            passwords: passwords
                .into_iter()
                .map(|(id, pw)| (id, SecretString::new(pw)))
                .collect(),
        }
    }

    /// Reads `id:password` lines (blank lines and `#` comments skipped;
    /// the password is everything after the first `:`).
    pub fn from_file(path: &Path) -> Result<Self, SimError> {
        let bad = |line: usize, reason: String| SimError::Credentials {
            path: path.to_path_buf(),
            line,
            reason,
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| bad(0, format!("cannot read it: {e}")))?;
        let mut passwords = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((id, password)) = line.split_once(':') else {
                return Err(bad(n + 1, "expected `device-id:password`".to_owned()));
            };
            let id =
                DeviceId::parse(id).map_err(|e| bad(n + 1, format!("invalid device id: {e}")))?;
            if passwords
                .insert(id.clone(), SecretString::new(password))
                .is_some()
            {
                return Err(bad(n + 1, format!("device {id} appears twice")));
            }
        }
        Ok(Self { passwords })
    }

    pub fn password(&self, id: &DeviceId) -> Option<&SecretString> {
        self.passwords.get(id)
    }

    pub fn len(&self) -> usize {
        self.passwords.len()
    }

    pub fn is_empty(&self) -> bool {
        self.passwords.is_empty()
    }
}

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

/// Capped exponential reconnect backoff with jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Upper bound for any delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// Delay before reconnect attempt number `failures` (1 = after the first
    /// failure): `initial * 2^(failures-1)` capped at `max`, scaled by
    /// `jitter` ∈ [0, 1] into the range [50 %, 100 %] of that value so that
    /// thousands of devices dropped together do not reconnect in lockstep.
    pub fn delay(&self, failures: u32, jitter: f64) -> Duration {
        let exp = failures.saturating_sub(1).min(31);
        let base = self.initial.saturating_mul(1u32 << exp).min(self.max);
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            1.0
        };
        base.mul_f64(0.5 + 0.5 * jitter)
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
            backoff: Backoff::default(),
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
    fn broker_urls_parse_with_and_without_scheme_and_port() {
        let cases = [
            ("mqtt://127.0.0.1:1883", "127.0.0.1", 1883),
            ("tcp://broker.local:2883/", "broker.local", 2883),
            ("mqtt://broker", "broker", 1883),
            ("localhost:1999", "localhost", 1999),
            ("mqtt://[::1]:1884", "::1", 1884),
            ("[::1]", "::1", 1883),
        ];
        for (url, host, port) in cases {
            assert_eq!(
                BrokerAddr::parse(url).unwrap(),
                BrokerAddr::new(host, port),
                "{url}"
            );
        }
    }

    #[test]
    fn unsupported_or_malformed_broker_urls_are_refused() {
        for url in [
            "ws://x:8883",
            "http://x",
            "mqtt://",
            "mqtt://x:0",
            "mqtt://x:99999",
            "mqtt://x:1883/path",
            "mqtt://u:p@x",
            "mqtt://[::1",
        ] {
            assert!(BrokerAddr::parse(url).is_err(), "{url} should be refused");
        }
    }

    #[test]
    fn mqtts_urls_are_tls_brokers_on_port_8883_by_default() {
        assert_eq!(
            BrokerAddr::parse("mqtts://broker").unwrap(),
            BrokerAddr::tls("broker", 8883)
        );
        assert_eq!(
            BrokerAddr::parse("ssl://127.0.0.1:9999").unwrap(),
            BrokerAddr::tls("127.0.0.1", 9999)
        );
        assert_eq!(
            BrokerAddr::tls("127.0.0.1", 8884).to_string(),
            "mqtts://127.0.0.1:8884"
        );
        let err = BrokerAddr::parse("mqtts://dev:pw@x")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("credentials file") && !err.contains("pw@"),
            "{err}"
        );
    }

    #[test]
    fn a_credentials_file_maps_device_ids_to_passwords() {
        let dir = std::env::temp_dir().join(format!("idem-sim-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("creds");
        std::fs::write(&path, "# comment\nd1:pw:with:colons\n\nd2:second\r\n").unwrap();
        let creds = Credentials::from_file(&path).unwrap();
        let d1 = DeviceId::parse("d1").unwrap();
        assert_eq!(creds.password(&d1).unwrap().expose(), "pw:with:colons");
        assert_eq!(
            creds
                .password(&DeviceId::parse("d2").unwrap())
                .unwrap()
                .expose(),
            "second"
        );
        assert_eq!(format!("{creds:?}"), "Credentials(2 devices)");

        std::fs::write(&path, "d1\n").unwrap();
        let err = Credentials::from_file(&path).unwrap_err().to_string();
        assert!(
            err.contains("line 1") && err.contains("device-id:password"),
            "{err}"
        );

        let mut cfg = FleetConfig::new(
            BrokerAddr::new("localhost", 1883),
            TopicRoot::default(),
            vec![
                SimDevice::new(d1, json!({})),
                SimDevice::new(DeviceId::parse("d3").unwrap(), json!({})),
            ],
        );
        cfg.credentials = Some(creds);
        std::fs::write(&path, "d1:a\nd2:b\n").unwrap();
        cfg.credentials = Some(Credentials::from_file(&path).unwrap());
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("d3"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn broker_addresses_display_as_urls() {
        assert_eq!(
            BrokerAddr::new("127.0.0.1", 1883).to_string(),
            "mqtt://127.0.0.1:1883"
        );
        assert_eq!(BrokerAddr::new("::1", 1).to_string(), "mqtt://[::1]:1");
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_jitter_stays_within_half() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        assert_eq!(b.delay(1, 1.0), Duration::from_millis(100));
        assert_eq!(b.delay(2, 1.0), Duration::from_millis(200));
        assert_eq!(b.delay(4, 1.0), Duration::from_millis(800));
        assert_eq!(b.delay(5, 1.0), Duration::from_secs(1));
        assert_eq!(b.delay(500, 1.0), Duration::from_secs(1));
        assert_eq!(b.delay(1, 0.0), Duration::from_millis(50));
        assert_eq!(b.delay(1, f64::NAN), Duration::from_millis(100));
    }

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
