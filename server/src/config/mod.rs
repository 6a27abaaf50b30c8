//! Server configuration: the `idem-server` flags, each with an `IDEM_*`
//! environment variable, in groups that `--help` shows under headings of
//! their own, one file per group: `fleet.rs`, `database.rs`, `mqtt.rs`,
//! `http.rs` (the API and its event streams), `security.rs`, `engine.rs`,
//! `changes.rs` (plans), `events.rs`, `retention.rs` and `readiness.rs`; the value parsers are in
//! `values.rs`. Each group's `validate` checks its flags and builds the
//! settings type its subsystem takes ("`0` = off" becomes `None` there), and
//! `Config::validate` collects them into a `ValidConfig`, failing fast with a
//! message that names the variable and says how to fix the value.
//!
//! A group's fields are named as their flags (`config.mqtt.mqtt_keep_alive`
//! is `--mqtt-keep-alive`), so a flag is found by its name.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use idem_protocol::limits::{MAX_MAX_SPEC_BYTES, MIN_MAX_SPEC_BYTES};

use crate::security::secret::SecretUrl;
use crate::security::tls::TlsError;

mod changes;
mod database;
mod engine;
mod events;
mod fleet;
mod http;
mod mqtt;
mod readiness;
mod retention;
mod security;
mod values;

pub use changes::{
    ChangesArgs, ChangesSettings, MAX_PLANS_KEPT, MAX_PLANS_PER_AUTHOR, PLAN_CONTENTS_CACHED,
};
pub use database::{DatabaseArgs, DatabaseSettings};
pub use engine::{EngineArgs, ReconcileSettings};
pub use events::{EventsArgs, EventsSettings, Retention};
pub use fleet::{FleetArgs, FleetSettings};
pub use http::{admin_reserve, HttpArgs, HttpLimits, HttpSettings, SseArgs, SseSettings};
pub use mqtt::{
    parse_mqtt_url, BrokerAddr, MqttArgs, MqttCredentials, MqttSettings, MqttUrlError, ShareGroup,
};
pub use readiness::{ReadinessArgs, ReadinessSettings};
pub use retention::{RetentionArgs, RunRetention};
pub use security::{
    password_file_accounts, AuthSettings, BrokerAccounts, SecurityArgs, SecuritySettings,
    BUILT_IN_RESERVED_USERNAMES,
};
pub use values::{
    parse_duration, parse_duration_or_off, parse_expiry, parse_rate_or_off, quarter_of,
};

/// Every flag of the server, by group (in the order `--help` shows them).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "idem-server",
    version,
    about = "idem fleet reconciliation server"
)]
pub struct Config {
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub mqtt: MqttArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub sse: SseArgs,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub changes: ChangesArgs,
    #[command(flatten)]
    pub events: EventsArgs,
    #[command(flatten)]
    pub retention: RetentionArgs,
    #[command(flatten)]
    pub readiness: ReadinessArgs,
}

/// A configuration that passed `validate`: each group's settings, in the
/// types the subsystems take.
#[derive(Debug, Clone)]
pub struct ValidConfig {
    pub fleet: FleetSettings,
    pub database: DatabaseSettings,
    pub mqtt: MqttSettings,
    /// The API's address, HTTPS, connection limits and SSE limits.
    pub http: HttpSettings,
    pub security: SecuritySettings,
    pub engine: ReconcileSettings,
    pub changes: ChangesSettings,
    pub events: EventsSettings,
    pub retention: RunRetention,
    pub readiness: ReadinessSettings,
}

impl Config {
    /// Checks every group and returns the settings the server runs with.
    pub fn validate(&self) -> Result<ValidConfig, ConfigError> {
        crate::security::tls::install_crypto_provider();
        let mqtt = self.mqtt.validate()?;
        let server_username = mqtt.credentials.as_ref().map(|c| c.username.as_str());
        let security = self.security.validate(server_username)?;
        Ok(ValidConfig {
            fleet: self.fleet.validate()?,
            database: self.database.validate()?,
            http: self.http.validate(&self.sse)?,
            security,
            engine: self.engine.validate()?,
            changes: self.changes.validate()?,
            events: self.events.validate()?,
            retention: self.retention.validate()?,
            readiness: self.readiness.validate()?,
            mqtt,
        })
    }

    /// Every secret value this configuration holds (database URL password,
    /// broker password), for scrubbing log text.
    pub fn secret_values(&self) -> Vec<String> {
        let mut values = self.database.secret_values();
        values.extend(self.mqtt.secret_values());
        values.retain(|v| !v.is_empty());
        values
    }

    /// A configuration with every default, for embedding and tests.
    pub fn defaults() -> Self {
        // Parsing only the program name cannot fail: every field has a default.
        Config::try_parse_from(["idem-server"])
            .unwrap_or_else(|e| unreachable!("defaults parse: {e}"))
    }
}

/// A configuration value that cannot work, with the fix in the message.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("IDEM_MQTT_URL / --mqtt-url {url:?} {reason}{} (examples: mqtt://127.0.0.1:1883, mqtts://broker.example:8883)", mqtt::mqtt_url_hint(.reason))]
    MqttUrl {
        /// Redacted: a password typed into the URL is never echoed.
        url: String,
        reason: MqttUrlError,
    },
    #[error("{0}")]
    Credentials(&'static str),
    #[error("{flag}: {source}")]
    Tls {
        flag: &'static str,
        #[source]
        source: TlsError,
    },
    #[error("IDEM_MQTT_PASSWORD_FILE / --mqtt-password-file {}: {reason}", path.display())]
    PasswordFile { path: PathBuf, reason: String },
    #[error("IDEM_TOPIC_ROOT / --topic-root {0:?} is invalid: use levels like `idem/v1`, without leading or trailing '/', '+', '#'")]
    TopicRoot(String),
    #[error("IDEM_DATABASE_URL / --database-url must start with postgres:// or postgresql:// (got {0:?})")]
    DatabaseUrl(SecretUrl),
    #[error("IDEM_PLAN_TTL / --plan-ttl must be between 1s and 7d (got {0:?})")]
    PlanTtl(Duration),
    #[error("IDEM_EXEMPTION_MAX / --exemption-max must be between 1s and 365d (got {0:?})")]
    ExemptionMax(Duration),
    #[error("IDEM_PUSH_TIMEOUT / --push-timeout must be at least 10ms (got {0:?})")]
    PushTimeout(Duration),
    #[error(
        "IDEM_INSTANCE / --instance {0:?} must be 1-64 characters of letters, digits, '-' or '_'"
    )]
    Instance(String),
    #[error("IDEM_INSTANCE_LEASE / --instance-lease must be between 1s and 10m (got {0:?})")]
    InstanceLease(Duration),
    #[error("IDEM_FOLLOW_EVERY / --follow-every must be between 100ms and 10m (got {0:?})")]
    FollowEvery(Duration),
    #[error(
        "IDEM_MAX_SPEC_BYTES / --max-spec-bytes must be between {MIN_MAX_SPEC_BYTES} and {MAX_MAX_SPEC_BYTES} (got {0})"
    )]
    MaxSpec(usize),
    #[error("IDEM_MAX_ATTEMPTS / --max-attempts must be at least 1 (got {0})")]
    MaxAttempts(u32),
    #[error("IDEM_MAX_IN_FLIGHT / --max-in-flight must be at least 1 (got {0})")]
    MaxInFlight(usize),
    #[error(
        "IDEM_MQTT_KEEP_ALIVE / --mqtt-keep-alive must be between 1 s and 65535 s (got {0:?})"
    )]
    MqttKeepAlive(Duration),
    #[error("IDEM_MQTT_INTAKE_BUFFER_BYTES / --mqtt-intake-buffer-bytes must be at least 1048576 (1 MiB; got {0})")]
    MqttIntakeBuffer(usize),
    #[error("IDEM_SHARE_GROUP / --share-group {0:?}: use 1 to 64 letters, digits, '-' or '_' (the same on every instance that shares the fleet's messages)")]
    ShareGroup(String),
    #[error("IDEM_BROKER_ACCOUNTS_FILE / --broker-accounts-file {path}: {reason} (a Mosquitto password file: `user:hash` lines, as `mosquitto_passwd` writes them)")]
    BrokerAccountsFile { path: String, reason: String },
    #[error("IDEM_RESERVED_BROKER_USERNAMES / --reserved-broker-usernames holds an empty name: list names separated by commas, without empty entries")]
    ReservedUsername,
    #[error(
        "IDEM_RETRY_BACKOFF_MAX must not be shorter than IDEM_RETRY_BACKOFF ({max:?} < {base:?})"
    )]
    Backoff { base: Duration, max: Duration },
    #[error("IDEM_MQTT_EVENTS_QOS / --mqtt-events-qos must be 0 or 1 (got {0})")]
    EventsQos(u8),
    #[error("IDEM_EVENT_RETENTION_COUNT / --event-retention-count must be at least 1 (got {0})")]
    RetentionCount(i64),
    #[error("IDEM_RUN_RETENTION_TARGETS / --run-retention-targets must be at least 1 (got {0})")]
    RunRetentionTargets(i64),
    #[error(
        "IDEM_ATTEMPT_RETENTION_COUNT / --attempt-retention-count must be at least 1 (got {0})"
    )]
    AttemptRetentionCount(i64),
    #[error("IDEM_STUCK_AFTER / --stuck-after must be at least 100ms (got {0:?})")]
    StuckAfter(Duration),
    #[error("IDEM_DB_MAX_CONNECTIONS / --db-max-connections must be at least 2 (got {0})")]
    DbConnections(u32),
    #[error("IDEM_HTTP_MAX_CONNECTIONS / --http-max-connections must be between 1 and 1000000 (got {0})")]
    HttpMaxConnections(usize),
    #[error("IDEM_HTTP_MAX_CONNECTIONS_PER_PEER / --http-max-connections-per-peer must be between 1 and IDEM_HTTP_MAX_CONNECTIONS ({max_connections}) (got {per_peer}); leave it unset for a quarter of the connection cap")]
    HttpMaxConnectionsPerPeer {
        per_peer: usize,
        max_connections: usize,
    },
    #[error(
        "IDEM_HTTP_HEADER_TIMEOUT / --http-header-timeout must be between 100ms and 1h (got {0:?})"
    )]
    HttpHeaderTimeout(Duration),
    #[error(
        "IDEM_HTTP_BODY_TIMEOUT / --http-body-timeout must be between 100ms and 1h (got {0:?})"
    )]
    HttpBodyTimeout(Duration),
    #[error("IDEM_HTTP_MAX_BODY_BYTES / --http-max-body-bytes must be between 1024 and 1073741824 (1 GiB) (got {0})")]
    HttpMaxBody(u64),
    #[error("IDEM_SSE_MAX_CLIENTS / --sse-max-clients must be at least 1 and at most IDEM_HTTP_MAX_CONNECTIONS ({max_connections}), since every stream holds a connection (got {clients})")]
    SseMaxClients {
        clients: usize,
        max_connections: usize,
    },
    #[error("IDEM_SSE_MAX_CLIENTS_PER_TOKEN / --sse-max-clients-per-token must be between 1 and IDEM_SSE_MAX_CLIENTS ({max_clients}) (got {per_token}); leave it unset for a quarter of the stream cap")]
    SseMaxClientsPerToken {
        per_token: usize,
        max_clients: usize,
    },
    #[error("IDEM_SSE_CLIENT_BUFFER / --sse-client-buffer must be between 1 and 1000000 events (got {0})")]
    SseClientBuffer(usize),
    #[error("IDEM_SSE_SEND_TIMEOUT / --sse-send-timeout must be between 10ms and 1h (got {0:?})")]
    SseSendTimeout(Duration),
    #[error(
        "IDEM_SSE_REPLAY_RATE / --sse-replay-rate must be at least 1 event per second (got {0})"
    )]
    SseReplayRate(u32),
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A self-signed certificate and its key, written into `dir`.
    pub(crate) fn self_signed(dir: &std::path::Path) -> (PathBuf, PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let cert_path = dir.join("cert.pem");
        let key_path = dir.join("key.pem");
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    }

    #[test]
    fn the_defaults_are_valid() {
        let valid = Config::defaults().validate().unwrap();
        assert_eq!(
            valid.mqtt.broker,
            BrokerAddr {
                host: "127.0.0.1".into(),
                port: 1883,
                tls: false,
            }
        );
        assert!(valid.mqtt.credentials.is_none() && valid.mqtt.tls.is_none());
        assert!(valid.http.tls.is_none());
        assert_eq!(valid.fleet.topic_root.as_str(), "idem/v1");
        assert_eq!(valid.database.max_connections, 8);
    }

    #[test]
    fn bad_values_fail_with_a_message_naming_the_variable() {
        let mut config = Config::defaults();
        config.mqtt.mqtt_url = "http://broker".into();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_MQTT_URL"), "{err}");

        let mut config = Config::defaults();
        config.fleet.topic_root = "idem/#".into();
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("IDEM_TOPIC_ROOT"));

        let mut config = Config::defaults();
        config.database.database_url = "mysql://x".into();
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("IDEM_DATABASE_URL"));
    }

    #[test]
    fn the_database_url_password_is_never_printed() {
        let mut config = Config::defaults();
        config.database.database_url = "postgres://idem:db-secret-9@db/idem".into();
        config.mqtt.mqtt_password = Some("mqtt-secret-7".into());
        config.mqtt.mqtt_username = Some("idem-server".into());
        let shown = format!("{config:?}");
        assert!(!shown.contains("db-secret-9"), "{shown}");
        assert!(!shown.contains("mqtt-secret-7"), "{shown}");
        let valid = config.validate().unwrap();
        let shown = format!("{valid:?}");
        assert!(!shown.contains("db-secret-9") && !shown.contains("mqtt-secret-7"));
        let secrets = config.secret_values();
        assert!(secrets.contains(&"db-secret-9".to_owned()));
        assert!(secrets.contains(&"mqtt-secret-7".to_owned()));

        config.database.database_url = "mysql://idem:db-secret-9@db".into();
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("IDEM_DATABASE_URL") && !err.contains("db-secret-9"),
            "{err}"
        );
    }

    #[test]
    fn help_never_shows_secret_values_from_the_environment() {
        use clap::CommandFactory;
        let command = Config::command();
        for id in ["database_url", "mqtt_password"] {
            let arg = command.get_arguments().find(|a| a.get_id() == id).unwrap();
            assert!(arg.is_hide_env_values_set(), "--{id} shows its env value");
        }
        for arg in command.get_arguments() {
            let env = arg.get_env().and_then(|e| e.to_str()).unwrap_or("");
            assert!(
                env.starts_with("IDEM_") || ["help", "version"].contains(&arg.get_id().as_str()),
                "--{} has no IDEM_* variable",
                arg.get_id()
            );
        }
    }

    #[test]
    fn every_flag_is_shown_under_the_heading_of_its_group() {
        use clap::CommandFactory;
        let command = Config::command();
        let heading = |long: &str| {
            command
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .and_then(|a| a.get_help_heading())
                .map(str::to_owned)
        };
        assert_eq!(heading("database-url").as_deref(), Some("Database"));
        assert_eq!(heading("mqtt-keep-alive").as_deref(), Some("MQTT broker"));
        assert_eq!(heading("tls-cert").as_deref(), Some("HTTP API"));
        assert_eq!(
            heading("sse-replay-rate").as_deref(),
            Some("Event streams (SSE)")
        );
        assert_eq!(heading("push-rate").as_deref(), Some("Engine"));
        assert_eq!(heading("broker-accounts").as_deref(), Some("Security"));
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            assert!(
                arg.get_help_heading().is_some() || ["help", "version"].contains(&id),
                "--{id} is under no heading"
            );
        }
    }
}
