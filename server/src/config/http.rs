//! The HTTP groups: the API's address, HTTPS and connection limits
//! (`--help` heading "HTTP API") and the limits of its event streams
//! (`GET /v1/events`, heading "Event streams (SSE)"). Validated together,
//! since every stream holds a connection, into the `HttpLimits` and
//! `SseSettings` that the HTTP server and the SSE clients take.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::{parse_duration, quarter_of, ConfigError};
use crate::security::tls::{CertKeyFiles, ServerTls};

/// Header and body timeouts.
const TIMEOUTS: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(100)..=Duration::from_secs(3_600);

/// The limits one server applies to its HTTP connections.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Open connections at most (as configured, until
    /// `HttpLimits::fitted_to_open_files` (`http/connections/limits.rs`) lowers it).
    pub max_connections: usize,
    /// Open connections from one client address ([`crate::http::connections::PeerGroup`]) at most;
    /// never more than `max_connections`.
    pub max_connections_per_peer: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub max_body_bytes: u64,
}

/// Limits for the SSE clients of one server (built by the configuration,
/// `SseArgs`).
#[derive(Debug, Clone, Copy)]
pub struct SseSettings {
    pub max_clients: usize,
    /// Streams one token (callers without a token: one client address) may
    /// hold at once.
    pub max_clients_per_token: usize,
    /// Slots only admin tokens may take, so that viewers and operators
    /// together never hold every stream.
    pub admin_reserve: usize,
    /// Events queued per client.
    pub client_buffer: usize,
    /// A client whose queue stays full this long is dropped.
    pub send_timeout: Duration,
    /// Events per second while replaying from the database.
    pub replay_rate: u32,
}

/// The slots of `max_clients` only admin tokens may take: a quarter,
/// rounded, at least one; none when there is a single slot (keeping it
/// would refuse every other caller).
pub fn admin_reserve(max_clients: usize) -> usize {
    if max_clients < 2 {
        return 0;
    }
    quarter_of(max_clients).min(max_clients - 1)
}

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "HTTP API")]
pub struct HttpArgs {
    /// Address of the HTTP API.
    #[arg(long, env = "IDEM_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,

    /// PEM certificate (chain) for serving the API over HTTPS; needs
    /// `--tls-key`. Without both, the API is plain HTTP.
    #[arg(long, env = "IDEM_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of `--tls-cert` (unencrypted).
    #[arg(long, env = "IDEM_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

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
}

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Event streams (SSE)")]
pub struct SseArgs {
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
}

/// The HTTP groups, validated.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    pub addr: SocketAddr,
    /// Loaded when the API is served over HTTPS.
    pub tls: Option<ServerTls>,
    /// As configured: the server fits them to the open-file limit when it
    /// starts serving (`HttpLimits::fitted_to_open_files`).
    pub limits: HttpLimits,
    pub sse: SseSettings,
}

impl HttpArgs {
    /// Checks the HTTP and SSE limits and loads the HTTPS files.
    pub fn validate(&self, sse: &SseArgs) -> Result<HttpSettings, ConfigError> {
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
        let sse = sse.validate(self.http_max_connections)?;
        Ok(HttpSettings {
            addr: self.http_addr,
            tls: self.tls()?,
            limits: HttpLimits {
                max_connections: self.http_max_connections,
                max_connections_per_peer: self.http_connections_per_peer(),
                header_timeout: self.http_header_timeout,
                body_timeout: self.http_body_timeout,
                max_body_bytes: self.http_max_body_bytes,
            },
            sse,
        })
    }

    /// `--http-max-connections-per-peer`, or its default: a quarter of the
    /// connection cap.
    fn http_connections_per_peer(&self) -> usize {
        self.http_max_connections_per_peer
            .unwrap_or_else(|| quarter_of(self.http_max_connections))
    }

    /// The API's HTTPS configuration, when `--tls-cert` and `--tls-key` are set.
    fn tls(&self) -> Result<Option<ServerTls>, ConfigError> {
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
}

impl SseArgs {
    /// The SSE limits, checked against the HTTP connection cap.
    fn validate(&self, http_max_connections: usize) -> Result<SseSettings, ConfigError> {
        if self.sse_max_clients < 1 || self.sse_max_clients > http_max_connections {
            return Err(ConfigError::SseMaxClients {
                clients: self.sse_max_clients,
                max_connections: http_max_connections,
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
        Ok(SseSettings {
            max_clients: self.sse_max_clients,
            max_clients_per_token: self.sse_clients_per_token(),
            admin_reserve: admin_reserve(self.sse_max_clients),
            client_buffer: self.sse_client_buffer,
            send_timeout: self.sse_send_timeout,
            replay_rate: self.sse_replay_rate,
        })
    }

    /// `--sse-max-clients-per-token`, or its default: a quarter of the
    /// stream cap.
    fn sse_clients_per_token(&self) -> usize {
        self.sse_max_clients_per_token
            .unwrap_or_else(|| quarter_of(self.sse_max_clients))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    #[test]
    fn http_and_sse_limits_out_of_range_fail_with_a_message_naming_the_variable() {
        type Change = fn(&mut Config);
        let cases: [(Change, &str); 11] = [
            (
                |c| c.http.http_max_connections = 0,
                "IDEM_HTTP_MAX_CONNECTIONS",
            ),
            (
                |c| c.http.http_max_connections_per_peer = Some(0),
                "IDEM_HTTP_MAX_CONNECTIONS_PER_PEER",
            ),
            (
                |c| c.http.http_max_connections_per_peer = Some(4_097),
                "IDEM_HTTP_MAX_CONNECTIONS_PER_PEER",
            ),
            (
                |c| c.sse.sse_max_clients_per_token = Some(65),
                "IDEM_SSE_MAX_CLIENTS_PER_TOKEN",
            ),
            (
                |c| c.http.http_header_timeout = Duration::from_millis(5),
                "IDEM_HTTP_HEADER_TIMEOUT",
            ),
            (
                |c| c.http.http_body_timeout = Duration::ZERO,
                "IDEM_HTTP_BODY_TIMEOUT",
            ),
            (
                |c| c.http.http_max_body_bytes = 10,
                "IDEM_HTTP_MAX_BODY_BYTES",
            ),
            (|c| c.sse.sse_max_clients = 5_000, "IDEM_SSE_MAX_CLIENTS"),
            (|c| c.sse.sse_client_buffer = 0, "IDEM_SSE_CLIENT_BUFFER"),
            (
                |c| c.sse.sse_send_timeout = Duration::ZERO,
                "IDEM_SSE_SEND_TIMEOUT",
            ),
            (|c| c.sse.sse_replay_rate = 0, "IDEM_SSE_REPLAY_RATE"),
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
        let valid = Config::defaults().validate().unwrap();
        let limits = valid.http.limits;
        assert_eq!(valid.http.addr, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(limits.max_connections, 4_096);
        assert_eq!(limits.max_connections_per_peer, 1_024);
        assert_eq!(limits.header_timeout, Duration::from_secs(10));
        assert_eq!(limits.body_timeout, Duration::from_secs(30));
        assert_eq!(limits.max_body_bytes, 16 * 1024 * 1024);
        let sse = valid.http.sse;
        assert_eq!(sse.max_clients, 64);
        assert_eq!(sse.max_clients_per_token, 16);
        assert_eq!(sse.admin_reserve, 16);
        assert_eq!(sse.client_buffer, 4_096);
        assert_eq!(sse.send_timeout, Duration::from_secs(10));
        assert_eq!(sse.replay_rate, 5_000);
    }

    #[test]
    fn the_per_client_shares_default_to_a_quarter_of_their_cap_and_may_equal_it() {
        let mut c = Config::defaults();
        c.http.http_max_connections = 10;
        c.sse.sse_max_clients = 10;
        let valid = c.validate().unwrap();
        assert_eq!(valid.http.limits.max_connections_per_peer, 3);
        assert_eq!(valid.http.sse.max_clients_per_token, 3);
        c.http.http_max_connections_per_peer = Some(10);
        c.sse.sse_max_clients_per_token = Some(10);
        let valid = c.validate().unwrap();
        assert_eq!(valid.http.limits.max_connections_per_peer, 10);
        assert_eq!(valid.http.sse.max_clients_per_token, 10);
        c.http.http_max_connections_per_peer = Some(11);
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("between 1 and IDEM_HTTP_MAX_CONNECTIONS (10)") && err.contains("unset"),
            "{err}"
        );
    }

    #[test]
    fn https_needs_both_files_and_a_real_key() {
        let dir = tempfile::tempdir().unwrap();
        let (cert_path, key_path) = crate::config::tests::self_signed(dir.path());
        let mut config = Config::defaults();
        config.http.tls_cert = Some(cert_path.clone());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_TLS_KEY"), "{err}");
        config.http.tls_key = Some(key_path);
        assert!(config.validate().unwrap().http.tls.is_some());
        config.http.tls_key = Some(cert_path);
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("IDEM_TLS_CERT") && err.contains("private key"),
            "{err}"
        );
    }
}
