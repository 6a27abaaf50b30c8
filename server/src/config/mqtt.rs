//! The MQTT group (`--help` heading "MQTT broker"): the server's own
//! connection to the broker — its address (`mqtt://` or `mqtts://`), TLS,
//! credentials and keep-alive — how much received traffic it holds for the
//! ingest, and whether it reads the broker's `$SYS` counters. Owns the
//! parser of `--mqtt-url` and the reading of `--mqtt-password-file`.

use std::path::PathBuf;
use std::time::Duration;

use super::{parse_duration, ConfigError};
use crate::security::secret::{Secret, SecretUrl};
use crate::security::tls::{CertKeyFiles, ClientTls};

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "MQTT broker")]
pub struct MqttArgs {
    /// MQTT broker URL: `mqtt://host:port` (default port 1883) or, with TLS,
    /// `mqtts://host:port` (default port 8883). Credentials go in
    /// `--mqtt-username` / `--mqtt-password`, not in the URL.
    #[arg(long, env = "IDEM_MQTT_URL", default_value = "mqtt://127.0.0.1:1883")]
    pub mqtt_url: SecretUrl,

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

    /// Subscribe to the broker's `$SYS` counters (Mosquitto: messages
    /// dropped, messages stored), export them as metrics and recheck when
    /// the dropped counter rises. The server's broker account needs read
    /// access to them.
    #[arg(long, env = "IDEM_BROKER_SYS_TOPICS", default_value_t = true, action = clap::ArgAction::Set)]
    pub broker_sys_topics: bool,

    /// Share the fleet's `reported` and `status` messages with every
    /// instance started with the same group: each subscribes to
    /// `$share/{group}/{root}/+/reported` (and `status`) and the broker hands
    /// each message to one of them. Needed for several instances on one
    /// broker; letters, digits, `-` and `_`, at most 64. Without it the
    /// server subscribes to every message itself.
    #[arg(long, env = "IDEM_SHARE_GROUP")]
    pub share_group: Option<String>,
}

/// The MQTT group, validated: what the server's connection needs.
#[derive(Debug, Clone)]
pub struct MqttSettings {
    /// `--mqtt-url` as given (prints without a password), for messages.
    pub url: SecretUrl,
    pub broker: BrokerAddr,
    /// What the server presents to the broker, if anything.
    pub credentials: Option<MqttCredentials>,
    /// Loaded for `mqtts://`.
    pub tls: Option<ClientTls>,
    /// Between 1 s and 65535 s.
    pub keep_alive: Duration,
    /// At least 1 MiB.
    pub intake_buffer_bytes: usize,
    pub sys_topics: bool,
    /// `--share-group`, checked.
    pub share_group: Option<ShareGroup>,
}

/// A shared-subscription group name: 1–64 of `[A-Za-z0-9_-]`, so it can
/// never hold the `/`, `+` or `#` an MQTT share name must not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareGroup(String);

impl ShareGroup {
    pub const MAX_LEN: usize = 64;

    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        let valid = !name.is_empty()
            && name.len() <= Self::MAX_LEN
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if valid {
            Ok(Self(name.to_owned()))
        } else {
            Err(ConfigError::ShareGroup(name.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The shared form of `filter`: `$share/{group}/{filter}`.
    pub fn filter(&self, filter: &str) -> String {
        format!("$share/{}/{filter}", self.0)
    }
}

impl MqttArgs {
    /// Parses the URL, checks the limits and reads the password file and
    /// the TLS files.
    pub fn validate(&self) -> Result<MqttSettings, ConfigError> {
        let broker =
            parse_mqtt_url(self.mqtt_url.expose()).map_err(|reason| ConfigError::MqttUrl {
                url: self.mqtt_url.redacted(),
                reason,
            })?;
        if !(Duration::from_secs(1)..=Duration::from_secs(65_535)).contains(&self.mqtt_keep_alive) {
            return Err(ConfigError::MqttKeepAlive(self.mqtt_keep_alive));
        }
        if self.mqtt_intake_buffer_bytes < 1024 * 1024 {
            return Err(ConfigError::MqttIntakeBuffer(self.mqtt_intake_buffer_bytes));
        }
        let credentials = self.credentials()?;
        let tls = self.tls(&broker)?;
        let share_group = self
            .share_group
            .as_deref()
            .map(ShareGroup::parse)
            .transpose()?;
        Ok(MqttSettings {
            url: self.mqtt_url.clone(),
            broker,
            credentials,
            tls,
            keep_alive: self.mqtt_keep_alive,
            intake_buffer_bytes: self.mqtt_intake_buffer_bytes,
            sys_topics: self.broker_sys_topics,
            share_group,
        })
    }

    /// User name and password for the broker, from the flags or the file.
    fn credentials(&self) -> Result<Option<MqttCredentials>, ConfigError> {
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
    fn tls(&self, broker: &BrokerAddr) -> Result<Option<ClientTls>, ConfigError> {
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

    /// Passwords in the broker URL and the broker password (from the flag
    /// or the file), for scrubbing logs.
    pub fn secret_values(&self) -> Vec<String> {
        let mut values = self.mqtt_url.passwords();
        if let Some(password) = &self.mqtt_password {
            values.push(password.expose().clone());
        }
        if let Some(path) = &self.mqtt_password_file {
            if let Ok(password) = read_password_file(path) {
                values.push(password.expose().clone());
            }
        }
        values
    }
}

pub use idem_protocol::{parse_mqtt_url, BrokerAddr, MqttUrlError};

/// Credentials the server presents to the broker.
#[derive(Debug, Clone)]
pub struct MqttCredentials {
    pub username: String,
    /// Empty: the CONNECT carries a user name only.
    pub password: Secret<String>,
}

/// What the server adds after a refused URL's reason: where credentials go.
pub(super) fn mqtt_url_hint(reason: &MqttUrlError) -> &'static str {
    match reason {
        MqttUrlError::Credentials => {
            ": put the user name in --mqtt-username / IDEM_MQTT_USERNAME and the password in --mqtt-password-file / IDEM_MQTT_PASSWORD_FILE (or --mqtt-password / IDEM_MQTT_PASSWORD)"
        }
        MqttUrlError::Scheme
        | MqttUrlError::Websockets
        | MqttUrlError::Path
        | MqttUrlError::Host
        | MqttUrlError::UnclosedIpv6Host
        | MqttUrlError::TextAfterIpv6Host
        | MqttUrlError::Port => "",
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    #[test]
    fn credentials_in_the_mqtt_url_are_refused_without_echoing_the_password() {
        let mut config = Config::defaults();
        config.mqtt.mqtt_url = "mqtt://idem:hunter2-secret@broker:1883".into();
        let err = config.validate().unwrap_err().to_string();
        assert!(!err.contains("hunter2-secret"), "{err}");
        assert!(err.contains("--mqtt-username"), "{err}");
        assert!(err.contains("mqtt://idem:***@broker:1883"), "{err}");
        config.mqtt.mqtt_url = "mqtt://idem@broker".into();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("--mqtt-username"), "{err}");
    }

    #[test]
    fn keep_alive_and_intake_buffer_out_of_range_fail_with_a_message_naming_the_variable() {
        type Change = fn(&mut MqttArgs);
        let cases: [(Change, &str); 3] = [
            (
                |m| m.mqtt_keep_alive = Duration::from_millis(500),
                "IDEM_MQTT_KEEP_ALIVE",
            ),
            (
                |m| m.mqtt_keep_alive = Duration::from_secs(65_536),
                "IDEM_MQTT_KEEP_ALIVE",
            ),
            (
                |m| m.mqtt_intake_buffer_bytes = 1024 * 1024 - 1,
                "IDEM_MQTT_INTAKE_BUFFER_BYTES",
            ),
        ];
        for (change, variable) in cases {
            let mut config = Config::defaults();
            change(&mut config.mqtt);
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(variable), "{variable}: {err}");
        }
    }

    #[test]
    fn a_share_group_is_a_plain_name_and_makes_shared_filters() {
        let mut config = Config::defaults();
        assert_eq!(config.validate().unwrap().mqtt.share_group, None);
        config.mqtt.share_group = Some("idem-fleet_1".into());
        let group = config.validate().unwrap().mqtt.share_group.unwrap();
        assert_eq!(
            group.filter("idem/v1/+/reported"),
            "$share/idem-fleet_1/idem/v1/+/reported"
        );
        for bad in ["", "a/b", "a+", "#", "with space", &"g".repeat(65)] {
            config.mqtt.share_group = Some(bad.to_owned());
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains("IDEM_SHARE_GROUP"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn broker_credentials_come_from_the_flag_or_the_file_never_both() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "from-file\n").unwrap();

        let mut config = Config::defaults();
        config.mqtt.mqtt_username = Some("idem-server".into());
        config.mqtt.mqtt_password_file = Some(file.clone());
        let creds = config.validate().unwrap().mqtt.credentials.unwrap();
        assert_eq!(creds.username, "idem-server");
        assert_eq!(creds.password.expose(), "from-file");

        config.mqtt.mqtt_password = Some("flag".into());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("both set"), "{err}");

        config.mqtt.mqtt_password_file = None;
        config.mqtt.mqtt_username = None;
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_MQTT_USERNAME"), "{err}");

        let mut config = Config::defaults();
        config.mqtt.mqtt_username = Some("idem-server".into());
        config.mqtt.mqtt_password_file = Some(dir.path().join("missing"));
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("IDEM_MQTT_PASSWORD_FILE") && err.contains("cannot read"),
            "{err}"
        );
        std::fs::write(&file, "").unwrap();
        config.mqtt.mqtt_password_file = Some(file.clone());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
        std::fs::write(&file, "a\nb\n").unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("more than one line"), "{err}");

        // A user name alone is allowed (brokers that check only names).
        let mut config = Config::defaults();
        config.mqtt.mqtt_username = Some("idem-server".into());
        let creds = config.validate().unwrap().mqtt.credentials.unwrap();
        assert!(creds.password.expose().is_empty());
    }

    #[test]
    fn tls_files_need_mqtts_and_come_in_pairs() {
        let dir = tempfile::tempdir().unwrap();
        let (cert_path, key_path) = crate::config::tests::self_signed(dir.path());

        let mut config = Config::defaults();
        config.mqtt.mqtt_ca_file = Some(cert_path.clone());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("mqtts://"), "{err}");

        config.mqtt.mqtt_url = "mqtts://127.0.0.1".into();
        let valid = config.validate().unwrap();
        assert_eq!(valid.mqtt.broker.port, 8883);
        assert!(valid.mqtt.tls.unwrap().client.is_none());

        config.mqtt.mqtt_client_cert = Some(cert_path.clone());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("set both or neither"), "{err}");
        config.mqtt.mqtt_client_key = Some(key_path);
        assert!(config
            .validate()
            .unwrap()
            .mqtt
            .tls
            .unwrap()
            .client
            .is_some());

        config.mqtt.mqtt_ca_file = Some(dir.path().join("missing.pem"));
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("IDEM_MQTT_CA_FILE") && err.contains("missing.pem"),
            "{err}"
        );
    }
}
