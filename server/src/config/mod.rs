//! Server configuration: every flag has an `IDEM_*` environment variable, and
//! `validate` fails fast with a message that says how to fix the value.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use idem_protocol::limits::{MAX_MAX_SPEC_BYTES, MIN_MAX_SPEC_BYTES};
use idem_protocol::{SpecBudget, TopicRoot, DEFAULT_MAX_SPEC_BYTES};

use crate::security::secret::{Secret, SecretUrl};
use crate::security::tls::{CertKeyFiles, ClientTls, ServerTls, TlsError};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "idem-server",
    version,
    about = "idem fleet reconciliation server"
)]
pub struct Config {
    /// PostgreSQL connection URL (the database must exist; migrations run at
    /// start-up). TLS with `?sslmode=require` or `verify-full` (with
    /// `sslrootcert=/path/ca.pem`). Its password is never printed.
    #[arg(
        long,
        env = "IDEM_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/idem",
        hide_env_values = true
    )]
    pub database_url: SecretUrl,

    /// MQTT broker URL: `mqtt://host:port` (default port 1883) or, with TLS,
    /// `mqtts://host:port` (default port 8883). Credentials go in
    /// `--mqtt-username` / `--mqtt-password`, not in the URL.
    #[arg(long, env = "IDEM_MQTT_URL", default_value = "mqtt://127.0.0.1:1883")]
    pub mqtt_url: SecretUrl,

    /// Topic root shared with the devices.
    #[arg(long, env = "IDEM_TOPIC_ROOT", default_value = idem_protocol::DEFAULT_TOPIC_ROOT)]
    pub topic_root: String,

    /// Address of the HTTP API.
    #[arg(long, env = "IDEM_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,

    /// How long a device has to confirm a push (or answer a `get`) before it
    /// is `failed` with a timeout, e.g. `30s`, `500ms`, `2m`.
    #[arg(long, env = "IDEM_PUSH_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub push_timeout: Duration,

    /// Name of this server instance: CloudEvents `source` is `/idem/{instance}`
    /// and the MQTT client id is `idem-server:{instance}`.
    #[arg(long, env = "IDEM_INSTANCE", default_value = "idem-1")]
    pub instance: String,

    /// The spec budget: the largest desired or reported spec, in canonical
    /// JSON bytes. The API refuses larger specs, reports may be up to
    /// `2 × budget + 8 KiB` raw, and the MQTT packet limits derive from it.
    #[arg(long, env = "IDEM_MAX_SPEC_BYTES", default_value_t = DEFAULT_MAX_SPEC_BYTES)]
    pub max_spec_bytes: usize,

    /// Accept reports from device ids that were never registered, registering them.
    #[arg(long, env = "IDEM_AUTO_REGISTER", default_value_t = false)]
    pub auto_register: bool,

    /// Attempts per device before it is quarantined (1 = no retries).
    #[arg(long, env = "IDEM_MAX_ATTEMPTS", default_value_t = 5)]
    pub max_attempts: u32,

    /// First retry delay after a failed attempt; doubles per failure (with jitter).
    #[arg(long, env = "IDEM_RETRY_BACKOFF", default_value = "2s", value_parser = parse_duration)]
    pub retry_backoff: Duration,

    /// Longest retry delay.
    #[arg(long, env = "IDEM_RETRY_BACKOFF_MAX", default_value = "5m", value_parser = parse_duration)]
    pub retry_backoff_max: Duration,

    /// Pushes per second across the fleet (0 = unlimited).
    #[arg(long, env = "IDEM_PUSH_RATE", default_value_t = 5_000)]
    pub push_rate: u32,

    /// Pushes awaiting device confirmation at once.
    #[arg(long, env = "IDEM_MAX_IN_FLIGHT", default_value_t = 5_000)]
    pub max_in_flight: usize,

    /// Drift and reconnect triggers arriving within this window become one run.
    #[arg(long, env = "IDEM_DEBOUNCE", default_value = "1s", value_parser = parse_duration)]
    pub debounce: Duration,

    /// Periodic re-check of every device (0 = off).
    #[arg(long, env = "IDEM_RESYNC_INTERVAL", default_value = "5m", value_parser = parse_duration)]
    pub resync_interval: Duration,

    /// At resync, devices whose last report is older than this are asked to report.
    #[arg(long, env = "IDEM_STALE_AFTER", default_value = "5m", value_parser = parse_duration)]
    pub stale_after: Duration,

    /// Run a full reconcile of every device with desired state at start-up.
    #[arg(long, env = "IDEM_STARTUP_RECONCILE", default_value_t = true, action = clap::ArgAction::Set)]
    pub startup_reconcile: bool,

    /// Publish every committed outcome event to `{root}/events/{type}/{subject}`.
    #[arg(long, env = "IDEM_MQTT_EVENTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub mqtt_events: bool,

    /// QoS of the event publishes (0 or 1).
    #[arg(long, env = "IDEM_MQTT_EVENTS_QOS", default_value_t = 0)]
    pub mqtt_events_qos: u8,

    /// Events older than this are pruned from the event log (once relayed), e.g. `7d`.
    #[arg(long, env = "IDEM_EVENT_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub event_retention: Duration,

    /// At most this many newest events are kept in the event log.
    #[arg(long, env = "IDEM_EVENT_RETENTION_COUNT", default_value_t = 1_000_000)]
    pub event_retention_count: i64,

    /// A worker (ingest, engine) whose write has not committed for this long
    /// — failing and retried, or hanging — makes `/readyz` fail.
    #[arg(long, env = "IDEM_STUCK_AFTER", default_value = "30s", value_parser = parse_duration)]
    pub stuck_after: Duration,

    /// MQTT keepalive of the server's connection: a ping every this long,
    /// and the connection counts as lost when the broker has not answered
    /// the previous one. The broker's answer waits behind every message it
    /// queued for the server, so this must cover the longest such queue:
    /// 100,000 devices connecting at once on two cores took over 30 s.
    /// (The server reads its connection through any ingest backlog: this
    /// need not cover database stalls.)
    #[arg(long, env = "IDEM_MQTT_KEEP_ALIVE", default_value = "120s", value_parser = parse_duration)]
    pub mqtt_keep_alive: Duration,

    /// Bytes of received MQTT messages the server holds for the ingest
    /// (topic, payload and about 160 bytes each). Below it the connection
    /// is read on whatever the database does; past it the server stops
    /// reading until half of it is stored (the broker queues meanwhile).
    #[arg(long, env = "IDEM_MQTT_INTAKE_BUFFER_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub mqtt_intake_buffer_bytes: usize,

    /// `/readyz` fails while the oldest received message has waited longer
    /// than this for the ingest (the answer says how many wait, and since
    /// when).
    #[arg(long, env = "IDEM_READY_MAX_INTAKE_AGE", default_value = "30s", value_parser = parse_duration)]
    pub ready_max_intake_age: Duration,

    /// A device that comes online and sends no report for this long is
    /// asked for one (its first report, or a newer one, may have been
    /// dropped by the broker); `0` = never.
    #[arg(long, env = "IDEM_MISSING_REPORT_AFTER", default_value = "5s", value_parser = parse_duration)]
    pub missing_report_after: Duration,

    /// Report requests per second when the server rechecks the fleet
    /// because the broker may have dropped messages for it (its dropped
    /// counter rose, the session came back empty or after a long absence,
    /// or the ingest was held longer than `--recheck-after-stall`); `0` =
    /// no rechecks.
    #[arg(long, env = "IDEM_RECHECK_RATE", default_value_t = 1_000)]
    pub recheck_rate: u32,

    /// An ingest write held (by locks or failures) at least this long
    /// starts a recheck once it commits: the broker may have dropped what
    /// it could not deliver meanwhile.
    #[arg(long, env = "IDEM_RECHECK_AFTER_STALL", default_value = "10s", value_parser = parse_duration)]
    pub recheck_after_stall: Duration,

    /// Subscribe to the broker's `$SYS` counters (Mosquitto: messages
    /// dropped, messages stored), export them as metrics and recheck when
    /// the dropped counter rises. The server's broker account needs read
    /// access to them.
    #[arg(long, env = "IDEM_BROKER_SYS_TOPICS", default_value_t = true, action = clap::ArgAction::Set)]
    pub broker_sys_topics: bool,

    /// Completed runs (with their per-device targets) older than this are
    /// pruned, e.g. `30d`.
    #[arg(long, env = "IDEM_RUN_RETENTION", default_value = "30d", value_parser = parse_duration)]
    pub run_retention: Duration,

    /// Only the newest completed runs whose targets add up to this many
    /// per-device rows are kept.
    #[arg(long, env = "IDEM_RUN_RETENTION_TARGETS", default_value_t = 1_000_000)]
    pub run_retention_targets: i64,

    /// Attempt history older than this is pruned.
    #[arg(long, env = "IDEM_ATTEMPT_RETENTION", default_value = "30d", value_parser = parse_duration)]
    pub attempt_retention: Duration,

    /// At most this many newest attempt-history rows are kept.
    #[arg(
        long,
        env = "IDEM_ATTEMPT_RETENTION_COUNT",
        default_value_t = 1_000_000
    )]
    pub attempt_retention_count: i64,

    /// Who manages the devices' broker accounts: `none` (someone else),
    /// `dynsec` (the server creates and deletes them through Mosquitto's
    /// dynamic-security plugin; its own account needs the `idem-server`
    /// role from `idem-server broker init`), or `password-file` (the server
    /// issues passwords and keeps their hashes for `idem-server broker files`).
    #[arg(long, env = "IDEM_BROKER_ACCOUNTS", value_enum, default_value_t = BrokerAccounts::None)]
    pub broker_accounts: BrokerAccounts,

    /// Broker user names no device id may take (comma-separated), besides
    /// the built-in `idem-server`, `dashboards`, `broker-admin`, `admin` and
    /// the server's own `--mqtt-username`: e.g. the accounts of other
    /// services on the same broker.
    #[arg(long, env = "IDEM_RESERVED_BROKER_USERNAMES", value_delimiter = ',')]
    pub reserved_broker_usernames: Vec<String>,

    /// A Mosquitto `password_file` of the broker's own accounts that are not
    /// devices (a dashboards reader, an admin, other services): no device
    /// may be registered under one of its names, and `idem-server broker
    /// files` copies its lines into the `password_file` it writes. Read at
    /// every registration, so an account added to it is reserved at once.
    #[arg(long, env = "IDEM_BROKER_ACCOUNTS_FILE")]
    pub broker_accounts_file: Option<PathBuf>,

    /// Open access: no token needed, every caller is an anonymous admin.
    /// For local experiments only; the server logs a warning at start.
    #[arg(long, env = "IDEM_INSECURE_NO_AUTH", default_value_t = false)]
    pub insecure_no_auth: bool,

    /// Serve `GET /metrics` without a token (e.g. for a Prometheus that
    /// cannot send one).
    #[arg(long, env = "IDEM_OPEN_METRICS", default_value_t = false)]
    pub open_metrics: bool,

    /// Serve `GET /v1/events` without a token.
    #[arg(long, env = "IDEM_OPEN_EVENTS", default_value_t = false)]
    pub open_events: bool,

    /// Audit records older than this are pruned.
    #[arg(long, env = "IDEM_AUDIT_RETENTION", default_value = "90d", value_parser = parse_duration)]
    pub audit_retention: Duration,

    /// Most connections in the database pool.
    #[arg(long, env = "IDEM_DB_MAX_CONNECTIONS", default_value_t = 8)]
    pub db_max_connections: u32,

    /// Most open HTTP connections; one more is accepted and closed at once.
    /// Lowered at start-up (with a warning) to fit the open-file limit.
    #[arg(long, env = "IDEM_HTTP_MAX_CONNECTIONS", default_value_t = 4_096)]
    pub http_max_connections: usize,

    /// Most open HTTP connections from one client address (IPv6: one /64);
    /// more are answered 429 `too_many_connections_from_peer` and closed.
    /// Default: a quarter of `--http-max-connections`, so one address never
    /// holds the whole cap. Behind a reverse proxy every client is the
    /// proxy's address: set it to `--http-max-connections` there.
    #[arg(long, env = "IDEM_HTTP_MAX_CONNECTIONS_PER_PEER")]
    pub http_max_connections_per_peer: Option<usize>,

    /// A connection must send a complete request head within this time
    /// (also after each keep-alive response), or it is closed.
    #[arg(long, env = "IDEM_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,

    /// A request body must arrive completely within this time after its head.
    #[arg(long, env = "IDEM_HTTP_BODY_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub http_body_timeout: Duration,

    /// Largest accepted request body, in bytes (larger: 413 `body_too_large`).
    #[arg(long, env = "IDEM_HTTP_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub http_max_body_bytes: u64,

    /// Most concurrent `GET /v1/events` streams (more: 503 `too_many_sse_clients`).
    #[arg(long, env = "IDEM_SSE_MAX_CLIENTS", default_value_t = 64)]
    pub sse_max_clients: usize,

    /// Most concurrent `GET /v1/events` streams of one token (callers
    /// without a token: of one client address); more: 429
    /// `too_many_sse_clients_for_token`. Default: a quarter of
    /// `--sse-max-clients`. A quarter of the streams is kept for admin
    /// tokens in any case.
    #[arg(long, env = "IDEM_SSE_MAX_CLIENTS_PER_TOKEN")]
    pub sse_max_clients_per_token: Option<usize>,

    /// Events queued per SSE client; a client that falls further behind is dropped.
    #[arg(long, env = "IDEM_SSE_CLIENT_BUFFER", default_value_t = 4_096)]
    pub sse_client_buffer: usize,

    /// An SSE client whose queue stays full this long is dropped.
    #[arg(long, env = "IDEM_SSE_SEND_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub sse_send_timeout: Duration,

    /// Events per second one SSE client is sent while it replays the event log.
    #[arg(long, env = "IDEM_SSE_REPLAY_RATE", default_value_t = 5_000)]
    pub sse_replay_rate: u32,

    // --- TLS and credentials of the server's own connections ---
    /// User name the server presents to the broker.
    #[arg(long, env = "IDEM_MQTT_USERNAME")]
    pub mqtt_username: Option<String>,

    /// Password the server presents to the broker (prefer
    /// `--mqtt-password-file`: a flag's value is visible in the process list).
    #[arg(long, env = "IDEM_MQTT_PASSWORD", hide_env_values = true)]
    pub mqtt_password: Option<Secret<String>>,

    /// File holding the broker password (one line; a trailing newline is
    /// ignored). Instead of `--mqtt-password`.
    #[arg(long, env = "IDEM_MQTT_PASSWORD_FILE")]
    pub mqtt_password_file: Option<PathBuf>,

    /// PEM file of the CA(s) that signed the broker's certificate
    /// (`mqtts://` only). Without it, the system trust store is used.
    #[arg(long, env = "IDEM_MQTT_CA_FILE")]
    pub mqtt_ca_file: Option<PathBuf>,

    /// PEM client certificate (chain) for mutual TLS with the broker; needs
    /// `--mqtt-client-key`.
    #[arg(long, env = "IDEM_MQTT_CLIENT_CERT")]
    pub mqtt_client_cert: Option<PathBuf>,

    /// PEM private key of `--mqtt-client-cert` (unencrypted).
    #[arg(long, env = "IDEM_MQTT_CLIENT_KEY")]
    pub mqtt_client_key: Option<PathBuf>,

    /// PEM certificate (chain) for serving the API over HTTPS; needs
    /// `--tls-key`. Without both, the API is plain HTTP.
    #[arg(long, env = "IDEM_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of `--tls-cert` (unencrypted).
    #[arg(long, env = "IDEM_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
}

/// Who manages the devices' broker accounts (`--broker-accounts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BrokerAccounts {
    None,
    Dynsec,
    PasswordFile,
}

impl BrokerAccounts {
    /// Whether registering a device issues it a broker password.
    pub fn issues_passwords(self) -> bool {
        match self {
            BrokerAccounts::None => false,
            BrokerAccounts::Dynsec | BrokerAccounts::PasswordFile => true,
        }
    }
}

/// A configuration value that cannot work, with the fix in the message.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("IDEM_MQTT_URL / --mqtt-url {url:?} {reason} (examples: mqtt://127.0.0.1:1883, mqtts://broker.example:8883)")]
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
    #[error("IDEM_PUSH_TIMEOUT / --push-timeout must be at least 10ms (got {0:?})")]
    PushTimeout(Duration),
    #[error(
        "IDEM_INSTANCE / --instance {0:?} must be 1-64 characters of letters, digits, '-' or '_'"
    )]
    Instance(String),
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

/// Broker address parsed from `mqtt://host:port` or `mqtts://host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddr {
    pub host: String,
    pub port: u16,
    /// `mqtts://`: the connection is TLS.
    pub tls: bool,
}

/// Default port of `mqtt://`.
pub const MQTT_PORT: u16 = 1883;
/// Default port of `mqtts://`.
pub const MQTTS_PORT: u16 = 8883;

/// Why an MQTT URL was refused; the message says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MqttUrlError {
    #[error("has an unknown scheme: use mqtt:// (plain) or mqtts:// (TLS)")]
    Scheme,
    #[error("carries credentials: put the user name in --mqtt-username / IDEM_MQTT_USERNAME and the password in --mqtt-password-file / IDEM_MQTT_PASSWORD_FILE (or --mqtt-password / IDEM_MQTT_PASSWORD)")]
    Credentials,
    #[error("has a path or query: write only mqtt[s]://host[:port]")]
    Path,
    #[error("has no host")]
    Host,
    #[error("has a port that is not a number from 1 to 65535")]
    Port,
}

/// Credentials the server presents to the broker.
#[derive(Debug, Clone)]
pub struct MqttCredentials {
    pub username: String,
    /// Empty: the CONNECT carries a user name only.
    pub password: Secret<String>,
}

impl Config {
    /// Checks every value and returns the parsed pieces the server needs.
    pub fn validate(&self) -> Result<ValidConfig, ConfigError> {
        crate::security::tls::install_crypto_provider();
        let broker =
            parse_mqtt_url(self.mqtt_url.expose()).map_err(|reason| ConfigError::MqttUrl {
                url: self.mqtt_url.redacted(),
                reason,
            })?;
        let topic_root = TopicRoot::new(self.topic_root.clone())
            .map_err(|_| ConfigError::TopicRoot(self.topic_root.clone()))?;
        let database_url = self.database_url.expose();
        if !(database_url.starts_with("postgres://") || database_url.starts_with("postgresql://")) {
            return Err(ConfigError::DatabaseUrl(self.database_url.clone()));
        }
        if self.push_timeout < Duration::from_millis(10) {
            return Err(ConfigError::PushTimeout(self.push_timeout));
        }
        let instance_ok = !self.instance.is_empty()
            && self.instance.len() <= 64
            && self
                .instance
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !instance_ok {
            return Err(ConfigError::Instance(self.instance.clone()));
        }
        if !(MIN_MAX_SPEC_BYTES..=MAX_MAX_SPEC_BYTES).contains(&self.max_spec_bytes) {
            return Err(ConfigError::MaxSpec(self.max_spec_bytes));
        }
        if self.max_attempts < 1 {
            return Err(ConfigError::MaxAttempts(self.max_attempts));
        }
        if self.max_in_flight < 1 {
            return Err(ConfigError::MaxInFlight(self.max_in_flight));
        }
        if self.retry_backoff_max < self.retry_backoff {
            return Err(ConfigError::Backoff {
                base: self.retry_backoff,
                max: self.retry_backoff_max,
            });
        }
        if self.mqtt_events_qos > 1 {
            return Err(ConfigError::EventsQos(self.mqtt_events_qos));
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(65_535)).contains(&self.mqtt_keep_alive) {
            return Err(ConfigError::MqttKeepAlive(self.mqtt_keep_alive));
        }
        if self.mqtt_intake_buffer_bytes < 1024 * 1024 {
            return Err(ConfigError::MqttIntakeBuffer(self.mqtt_intake_buffer_bytes));
        }
        if self
            .reserved_broker_usernames
            .iter()
            .any(|n| n.trim().is_empty())
        {
            return Err(ConfigError::ReservedUsername);
        }
        self.broker_accounts_file_names()?;
        if self.event_retention_count < 1 {
            return Err(ConfigError::RetentionCount(self.event_retention_count));
        }
        if self.run_retention_targets < 1 {
            return Err(ConfigError::RunRetentionTargets(self.run_retention_targets));
        }
        if self.attempt_retention_count < 1 {
            return Err(ConfigError::AttemptRetentionCount(
                self.attempt_retention_count,
            ));
        }
        if self.stuck_after < Duration::from_millis(100) {
            return Err(ConfigError::StuckAfter(self.stuck_after));
        }
        if self.db_max_connections < 2 {
            return Err(ConfigError::DbConnections(self.db_max_connections));
        }
        self.validate_http()?;
        let mqtt_credentials = self.mqtt_credentials()?;
        let mqtt_tls = self.mqtt_tls(&broker)?;
        let http_tls = self.http_tls()?;
        Ok(ValidConfig {
            config: self.clone(),
            broker,
            topic_root,
            budget: SpecBudget::new(self.max_spec_bytes),
            mqtt_credentials,
            mqtt_tls,
            http_tls,
        })
    }

    /// User name and password for the broker, from the flags or the file.
    fn mqtt_credentials(&self) -> Result<Option<MqttCredentials>, ConfigError> {
        let password = match (&self.mqtt_password, &self.mqtt_password_file) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Credentials(
                    "IDEM_MQTT_PASSWORD / --mqtt-password and IDEM_MQTT_PASSWORD_FILE / --mqtt-password-file are both set: keep one",
                ))
            }
            (Some(password), None) => Some(password.clone()),
            (None, Some(path)) => Some(read_password_file(path)?),
            (None, None) => None,
        };
        match (&self.mqtt_username, password) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(ConfigError::Credentials(
                "a broker password needs a user name: set IDEM_MQTT_USERNAME / --mqtt-username",
            )),
            (Some(username), _) if username.is_empty() => Err(ConfigError::Credentials(
                "IDEM_MQTT_USERNAME / --mqtt-username is empty: set a user name or unset it",
            )),
            (Some(username), password) => Ok(Some(MqttCredentials {
                username: username.clone(),
                password: password.unwrap_or_default(),
            })),
        }
    }

    /// The MQTT client's TLS configuration, for `mqtts://` only.
    fn mqtt_tls(&self, broker: &BrokerAddr) -> Result<Option<ClientTls>, ConfigError> {
        let client = match (&self.mqtt_client_cert, &self.mqtt_client_key) {
            (Some(cert), Some(key)) => Some(CertKeyFiles {
                cert: cert.clone(),
                key: key.clone(),
            }),
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                return Err(ConfigError::Credentials(
                    "IDEM_MQTT_CLIENT_CERT / --mqtt-client-cert and IDEM_MQTT_CLIENT_KEY / --mqtt-client-key go together: set both or neither",
                ))
            }
        };
        if !broker.tls {
            if self.mqtt_ca_file.is_some() || client.is_some() {
                return Err(ConfigError::Credentials(
                    "IDEM_MQTT_CA_FILE / IDEM_MQTT_CLIENT_CERT / IDEM_MQTT_CLIENT_KEY apply to TLS only: use an mqtts:// IDEM_MQTT_URL, or unset them",
                ));
            }
            return Ok(None);
        }
        let flag = if client.is_some() {
            "IDEM_MQTT_CA_FILE / IDEM_MQTT_CLIENT_CERT / IDEM_MQTT_CLIENT_KEY"
        } else {
            "IDEM_MQTT_CA_FILE / --mqtt-ca-file"
        };
        let config =
            crate::security::tls::client_config(self.mqtt_ca_file.as_deref(), client.as_ref())
                .map_err(|source| ConfigError::Tls { flag, source })?;
        Ok(Some(ClientTls {
            config,
            ca_file: self.mqtt_ca_file.clone(),
            client,
        }))
    }

    /// The API's HTTPS configuration, when `--tls-cert` and `--tls-key` are set.
    fn http_tls(&self) -> Result<Option<ServerTls>, ConfigError> {
        let files = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => CertKeyFiles {
                cert: cert.clone(),
                key: key.clone(),
            },
            (None, None) => return Ok(None),
            (Some(_), None) | (None, Some(_)) => {
                return Err(ConfigError::Credentials(
                    "IDEM_TLS_CERT / --tls-cert and IDEM_TLS_KEY / --tls-key go together: set both for HTTPS, or neither for plain HTTP",
                ))
            }
        };
        let config =
            crate::security::tls::server_config(&files).map_err(|source| ConfigError::Tls {
                flag: "IDEM_TLS_CERT / IDEM_TLS_KEY",
                source,
            })?;
        Ok(Some(ServerTls { config, files }))
    }

    /// Every secret value this configuration holds (database URL password,
    /// broker password), for scrubbing log text.
    pub fn secret_values(&self) -> Vec<String> {
        let mut values = self.database_url.passwords();
        values.extend(self.mqtt_url.passwords());
        if let Some(password) = &self.mqtt_password {
            values.push(password.expose().clone());
        }
        if let Some(path) = &self.mqtt_password_file {
            if let Ok(password) = read_password_file(path) {
                values.push(password.expose().clone());
            }
        }
        values.retain(|v| !v.is_empty());
        values
    }

    /// The HTTP and SSE limits.
    fn validate_http(&self) -> Result<(), ConfigError> {
        const TIMEOUTS: std::ops::RangeInclusive<Duration> =
            Duration::from_millis(100)..=Duration::from_secs(3_600);
        if !(1..=1_000_000).contains(&self.http_max_connections) {
            return Err(ConfigError::HttpMaxConnections(self.http_max_connections));
        }
        if let Some(per_peer) = self.http_max_connections_per_peer {
            if !(1..=self.http_max_connections).contains(&per_peer) {
                return Err(ConfigError::HttpMaxConnectionsPerPeer {
                    per_peer,
                    max_connections: self.http_max_connections,
                });
            }
        }
        if !TIMEOUTS.contains(&self.http_header_timeout) {
            return Err(ConfigError::HttpHeaderTimeout(self.http_header_timeout));
        }
        if !TIMEOUTS.contains(&self.http_body_timeout) {
            return Err(ConfigError::HttpBodyTimeout(self.http_body_timeout));
        }
        if !(1_024..=1_073_741_824).contains(&self.http_max_body_bytes) {
            return Err(ConfigError::HttpMaxBody(self.http_max_body_bytes));
        }
        if self.sse_max_clients < 1 || self.sse_max_clients > self.http_max_connections {
            return Err(ConfigError::SseMaxClients {
                clients: self.sse_max_clients,
                max_connections: self.http_max_connections,
            });
        }
        if let Some(per_token) = self.sse_max_clients_per_token {
            if !(1..=self.sse_max_clients).contains(&per_token) {
                return Err(ConfigError::SseMaxClientsPerToken {
                    per_token,
                    max_clients: self.sse_max_clients,
                });
            }
        }
        if !(1..=1_000_000).contains(&self.sse_client_buffer) {
            return Err(ConfigError::SseClientBuffer(self.sse_client_buffer));
        }
        if !(Duration::from_millis(10)..=Duration::from_secs(3_600))
            .contains(&self.sse_send_timeout)
        {
            return Err(ConfigError::SseSendTimeout(self.sse_send_timeout));
        }
        if self.sse_replay_rate < 1 {
            return Err(ConfigError::SseReplayRate(self.sse_replay_rate));
        }
        Ok(())
    }

    /// Broker user names no device may take: the built-in ones, the
    /// server's own and `--reserved-broker-usernames`.
    pub fn reserved_broker_usernames(&self) -> std::collections::BTreeSet<String> {
        crate::broker::accounts::BUILT_IN_RESERVED_USERNAMES
            .iter()
            .map(|n| (*n).to_owned())
            .chain(self.mqtt_username.iter().cloned())
            .chain(
                self.reserved_broker_usernames
                    .iter()
                    .map(|n| n.trim().to_owned()),
            )
            .collect()
    }

    /// The user names of `--broker-accounts-file` (none without it), read
    /// now.
    pub fn broker_accounts_file_names(
        &self,
    ) -> Result<std::collections::BTreeSet<String>, ConfigError> {
        let Some(path) = &self.broker_accounts_file else {
            return Ok(Default::default());
        };
        let error = |reason: String| ConfigError::BrokerAccountsFile {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
        let accounts = crate::broker::accounts::password_file_accounts(&text).map_err(error)?;
        Ok(accounts
            .into_iter()
            .map(|(user, _)| user.to_owned())
            .collect())
    }

    /// `--http-max-connections-per-peer`, or its default: a quarter of the
    /// connection cap.
    pub fn http_connections_per_peer(&self) -> usize {
        self.http_max_connections_per_peer
            .unwrap_or_else(|| quarter_of(self.http_max_connections))
    }

    /// `--sse-max-clients-per-token`, or its default: a quarter of the
    /// stream cap.
    pub fn sse_clients_per_token(&self) -> usize {
        self.sse_max_clients_per_token
            .unwrap_or_else(|| quarter_of(self.sse_max_clients))
    }

    /// A configuration with every default, for embedding and tests.
    pub fn defaults() -> Self {
        // Parsing only the program name cannot fail: every field has a default.
        Config::try_parse_from(["idem-server"])
            .unwrap_or_else(|e| unreachable!("defaults parse: {e}"))
    }
}

/// A configuration that passed `validate`.
#[derive(Debug, Clone)]
pub struct ValidConfig {
    pub config: Config,
    pub broker: BrokerAddr,
    pub topic_root: TopicRoot,
    /// The one size budget every limit derives from.
    pub budget: SpecBudget,
    /// What the server presents to the broker, if anything.
    pub mqtt_credentials: Option<MqttCredentials>,
    /// Loaded for `mqtts://`.
    pub mqtt_tls: Option<ClientTls>,
    /// Loaded when the API is served over HTTPS.
    pub http_tls: Option<ServerTls>,
}

/// Parses `mqtt://host[:port]` (also `tcp://`) and `mqtts://host[:port]`
/// (also `ssl://`); IPv6 hosts in brackets.
pub fn parse_mqtt_url(url: &str) -> Result<BrokerAddr, MqttUrlError> {
    let (scheme, rest) = url.split_once("://").ok_or(MqttUrlError::Scheme)?;
    let (tls, default_port) = match scheme {
        "mqtt" | "tcp" => (false, MQTT_PORT),
        "mqtts" | "ssl" => (true, MQTTS_PORT),
        _ => return Err(MqttUrlError::Scheme),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('@') {
        return Err(MqttUrlError::Credentials);
    }
    if rest.contains(['/', '?', '#']) {
        return Err(MqttUrlError::Path);
    }
    let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or(MqttUrlError::Host)?;
        match after.strip_prefix(':') {
            Some(port) => (host, Some(port)),
            None if after.is_empty() => (host, None),
            None => return Err(MqttUrlError::Port),
        }
    } else {
        match rest.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (rest, None),
        }
    };
    if host.is_empty() || host.contains(['[', ']']) {
        return Err(MqttUrlError::Host);
    }
    let port = match port {
        None => default_port,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or(MqttUrlError::Port)?,
    };
    Ok(BrokerAddr {
        host: host.to_owned(),
        port,
        tls,
    })
}

/// Reads a password file: its content without one trailing newline.
fn read_password_file(path: &std::path::Path) -> Result<Secret<String>, ConfigError> {
    let bad = |reason: String| ConfigError::PasswordFile {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let password = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(&text);
    if password.is_empty() {
        return Err(bad("it is empty; write the password into it".to_owned()));
    }
    if password.contains(['\n', '\r']) {
        return Err(bad(
            "it has more than one line; the whole file is the password (one line)".to_owned(),
        ));
    }
    Ok(Secret::new(password.to_owned()))
}

/// A quarter of `total`, rounded to the nearest whole number, at least 1
/// and at most `total` (when it is at least 1): the default share of one
/// client in the HTTP connection and SSE stream caps.
pub fn quarter_of(total: usize) -> usize {
    (total.saturating_add(2) / 4).clamp(1, total.max(1))
}

/// Parses `250ms`, `30s`, `5m`, `1h`, `7d` (a bare number means seconds).
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (number, unit) = raw.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{raw:?} is not a duration; write e.g. 500ms, 30s, 5m or 1h"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "" | "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        "d" => Ok(Duration::from_secs(n * 86_400)),
        other => Err(format!(
            "unknown duration unit {other:?} in {raw:?}; use ms, s, m or h"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        let valid = Config::defaults().validate().unwrap();
        assert_eq!(
            valid.broker,
            BrokerAddr {
                host: "127.0.0.1".into(),
                port: 1883,
                tls: false,
            }
        );
        assert!(valid.mqtt_credentials.is_none() && valid.mqtt_tls.is_none());
        assert!(valid.http_tls.is_none());
        assert_eq!(valid.topic_root.as_str(), "idem/v1");
    }

    #[test]
    fn durations_accept_the_documented_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert!(parse_duration("5 minutes")
            .unwrap_err()
            .contains("unknown duration unit"));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn bad_values_fail_with_a_message_naming_the_variable() {
        let mut config = Config::defaults();
        config.mqtt_url = "http://broker".into();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_MQTT_URL"), "{err}");

        let mut config = Config::defaults();
        config.topic_root = "idem/#".into();
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("IDEM_TOPIC_ROOT"));

        let mut config = Config::defaults();
        config.database_url = "mysql://x".into();
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("IDEM_DATABASE_URL"));
    }

    #[test]
    fn http_and_sse_limits_out_of_range_fail_with_a_message_naming_the_variable() {
        type Change = fn(&mut Config);
        let cases: [(Change, &str); 11] = [
            (|c| c.http_max_connections = 0, "IDEM_HTTP_MAX_CONNECTIONS"),
            (
                |c| c.http_max_connections_per_peer = Some(0),
                "IDEM_HTTP_MAX_CONNECTIONS_PER_PEER",
            ),
            (
                |c| c.http_max_connections_per_peer = Some(4_097),
                "IDEM_HTTP_MAX_CONNECTIONS_PER_PEER",
            ),
            (
                |c| c.sse_max_clients_per_token = Some(65),
                "IDEM_SSE_MAX_CLIENTS_PER_TOKEN",
            ),
            (
                |c| c.http_header_timeout = Duration::from_millis(5),
                "IDEM_HTTP_HEADER_TIMEOUT",
            ),
            (
                |c| c.http_body_timeout = Duration::ZERO,
                "IDEM_HTTP_BODY_TIMEOUT",
            ),
            (|c| c.http_max_body_bytes = 10, "IDEM_HTTP_MAX_BODY_BYTES"),
            (|c| c.sse_max_clients = 5_000, "IDEM_SSE_MAX_CLIENTS"),
            (|c| c.sse_client_buffer = 0, "IDEM_SSE_CLIENT_BUFFER"),
            (
                |c| c.sse_send_timeout = Duration::ZERO,
                "IDEM_SSE_SEND_TIMEOUT",
            ),
            (|c| c.sse_replay_rate = 0, "IDEM_SSE_REPLAY_RATE"),
        ];
        for (change, variable) in cases {
            let mut config = Config::defaults();
            change(&mut config);
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(variable), "{variable}: {err}");
        }
    }

    #[test]
    fn the_http_limits_default_to_the_documented_values() {
        let c = Config::defaults();
        assert_eq!(c.http_max_connections, 4_096);
        assert_eq!(c.http_header_timeout, Duration::from_secs(10));
        assert_eq!(c.http_body_timeout, Duration::from_secs(30));
        assert_eq!(c.http_max_body_bytes, 16 * 1024 * 1024);
        assert_eq!(c.sse_max_clients, 64);
        assert_eq!(c.sse_client_buffer, 4_096);
        assert_eq!(c.sse_send_timeout, Duration::from_secs(10));
        assert_eq!(c.sse_replay_rate, 5_000);
        assert_eq!(c.http_max_connections_per_peer, None);
        assert_eq!(c.http_connections_per_peer(), 1_024);
        assert_eq!(c.sse_max_clients_per_token, None);
        assert_eq!(c.sse_clients_per_token(), 16);
    }

    #[test]
    fn the_per_client_shares_default_to_a_quarter_rounded_and_never_exceed_the_cap() {
        assert_eq!(quarter_of(1), 1);
        assert_eq!(quarter_of(2), 1);
        assert_eq!(quarter_of(3), 1);
        assert_eq!(quarter_of(6), 2);
        assert_eq!(quarter_of(50), 13);
        assert_eq!(quarter_of(4_096), 1_024);
        let mut c = Config::defaults();
        c.http_max_connections = 10;
        c.sse_max_clients = 10;
        assert_eq!(c.http_connections_per_peer(), 3);
        assert_eq!(c.sse_clients_per_token(), 3);
        c.http_max_connections_per_peer = Some(10);
        c.sse_max_clients_per_token = Some(10);
        assert!(c.validate().is_ok(), "a share equal to the cap is allowed");
        c.http_max_connections_per_peer = Some(11);
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("between 1 and IDEM_HTTP_MAX_CONNECTIONS (10)") && err.contains("unset"),
            "{err}"
        );
    }

    #[test]
    fn mqtt_urls_default_to_port_1883_and_mqtts_to_8883() {
        let addr = |host: &str, port, tls| BrokerAddr {
            host: host.into(),
            port,
            tls,
        };
        let cases = [
            ("mqtt://broker.local", addr("broker.local", 1883, false)),
            ("tcp://h:2000/", addr("h", 2000, false)),
            ("mqtts://broker.local", addr("broker.local", 8883, true)),
            ("mqtts://10.0.0.1:9883", addr("10.0.0.1", 9883, true)),
            ("ssl://[::1]:8884", addr("::1", 8884, true)),
            ("mqtt://[::1]", addr("::1", 1883, false)),
        ];
        for (url, expected) in cases {
            assert_eq!(parse_mqtt_url(url), Ok(expected), "{url}");
        }
        let refused = [
            ("mqtt://h:notaport", MqttUrlError::Port),
            ("mqtt://h:0", MqttUrlError::Port),
            ("http://h", MqttUrlError::Scheme),
            ("broker:1883", MqttUrlError::Scheme),
            ("mqtt://", MqttUrlError::Host),
            ("mqtt://h/x", MqttUrlError::Path),
            ("mqtt://user@h", MqttUrlError::Credentials),
            ("mqtts://user:pw@h:8883", MqttUrlError::Credentials),
        ];
        for (url, reason) in refused {
            assert_eq!(parse_mqtt_url(url), Err(reason), "{url}");
        }
    }

    #[test]
    fn credentials_in_the_mqtt_url_are_refused_without_echoing_the_password() {
        let mut config = Config::defaults();
        config.mqtt_url = "mqtt://idem:hunter2-secret@broker:1883".into();
        let err = config.validate().unwrap_err().to_string();
        assert!(!err.contains("hunter2-secret"), "{err}");
        assert!(err.contains("--mqtt-username"), "{err}");
        assert!(err.contains("mqtt://idem:***@broker:1883"), "{err}");
        config.mqtt_url = "mqtt://idem@broker".into();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("--mqtt-username"), "{err}");
    }

    #[test]
    fn the_database_url_password_is_never_printed() {
        let mut config = Config::defaults();
        config.database_url = "postgres://idem:db-secret-9@db/idem".into();
        config.mqtt_password = Some("mqtt-secret-7".into());
        config.mqtt_username = Some("idem-server".into());
        let shown = format!("{config:?}");
        assert!(!shown.contains("db-secret-9"), "{shown}");
        assert!(!shown.contains("mqtt-secret-7"), "{shown}");
        let valid = config.validate().unwrap();
        let shown = format!("{valid:?}");
        assert!(!shown.contains("db-secret-9") && !shown.contains("mqtt-secret-7"));
        let secrets = config.secret_values();
        assert!(secrets.contains(&"db-secret-9".to_owned()));
        assert!(secrets.contains(&"mqtt-secret-7".to_owned()));

        config.database_url = "mysql://idem:db-secret-9@db".into();
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("IDEM_DATABASE_URL") && !err.contains("db-secret-9"),
            "{err}"
        );
    }

    #[test]
    fn broker_credentials_come_from_the_flag_or_the_file_never_both() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "from-file\n").unwrap();

        let mut config = Config::defaults();
        config.mqtt_username = Some("idem-server".into());
        config.mqtt_password_file = Some(file.clone());
        let creds = config.validate().unwrap().mqtt_credentials.unwrap();
        assert_eq!(creds.username, "idem-server");
        assert_eq!(creds.password.expose(), "from-file");

        config.mqtt_password = Some("flag".into());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("both set"), "{err}");

        config.mqtt_password_file = None;
        config.mqtt_username = None;
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_MQTT_USERNAME"), "{err}");

        let mut config = Config::defaults();
        config.mqtt_username = Some("idem-server".into());
        config.mqtt_password_file = Some(dir.path().join("missing"));
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("IDEM_MQTT_PASSWORD_FILE") && err.contains("cannot read"),
            "{err}"
        );
        std::fs::write(&file, "").unwrap();
        config.mqtt_password_file = Some(file.clone());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
        std::fs::write(&file, "a\nb\n").unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("more than one line"), "{err}");

        // A user name alone is allowed (brokers that check only names).
        let mut config = Config::defaults();
        config.mqtt_username = Some("idem-server".into());
        let creds = config.validate().unwrap().mqtt_credentials.unwrap();
        assert!(creds.password.expose().is_empty());
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
    fn tls_files_need_mqtts_and_come_in_pairs() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let cert_path = dir.path().join("cert.pem");
        let key_path = dir.path().join("key.pem");
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();

        let mut config = Config::defaults();
        config.mqtt_ca_file = Some(cert_path.clone());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("mqtts://"), "{err}");

        config.mqtt_url = "mqtts://127.0.0.1".into();
        let valid = config.validate().unwrap();
        assert_eq!(valid.broker.port, 8883);
        assert!(valid.mqtt_tls.unwrap().client.is_none());

        config.mqtt_client_cert = Some(cert_path.clone());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("set both or neither"), "{err}");
        config.mqtt_client_key = Some(key_path.clone());
        assert!(config
            .validate()
            .unwrap()
            .mqtt_tls
            .unwrap()
            .client
            .is_some());

        config.mqtt_ca_file = Some(dir.path().join("missing.pem"));
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("IDEM_MQTT_CA_FILE") && err.contains("missing.pem"),
            "{err}"
        );

        let mut config = Config::defaults();
        config.tls_cert = Some(cert_path.clone());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_TLS_KEY"), "{err}");
        config.tls_key = Some(key_path);
        assert!(config.validate().unwrap().http_tls.is_some());
        config.tls_key = Some(cert_path);
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("IDEM_TLS_CERT") && err.contains("private key"),
            "{err}"
        );
    }
}
