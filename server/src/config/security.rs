//! The security group (`--help` heading "Security"): who may call the API
//! without a token, who manages the devices' broker accounts, and which
//! broker user names no device id may take. Validated into the API's
//! `AuthSettings` and the account settings the registration and
//! `idem-server broker files` read.

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::ConfigError;

/// How the server decides access. The default is the secure one: tokens
/// needed everywhere but `/healthz` and `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AuthSettings {
    /// `--insecure-no-auth`: everyone is an anonymous admin.
    pub disabled: bool,
    pub open_metrics: bool,
    pub open_events: bool,
}

/// Broker user names no device may take whatever the configuration: the
/// server's default account, the dashboards' reader and the usual names of
/// a broker's admin account. The server's own `--mqtt-username` and
/// `--reserved-broker-usernames` add to them.
pub const BUILT_IN_RESERVED_USERNAMES: [&str; 4] =
    ["idem-server", "dashboards", "broker-admin", "admin"];

/// The user names of a Mosquitto `password_file` (`user:hash` lines;
/// blank lines and `#` comments skipped), each with its line.
pub fn password_file_accounts(text: &str) -> Result<Vec<(&str, &str)>, String> {
    text.lines()
        .enumerate()
        .map(|(n, line)| (n, line.trim_end_matches('\r')))
        .filter(|(_, line)| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|(n, line)| match line.split_once(':') {
            Some((user, hash)) if !user.is_empty() && !hash.is_empty() => Ok((user, line)),
            _ => Err(format!("line {} is not `user:hash`", n + 1)),
        })
        .collect()
}

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Security")]
pub struct SecurityArgs {
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

/// The security group, validated.
#[derive(Debug, Clone)]
pub struct SecuritySettings {
    pub auth: AuthSettings,
    pub broker_accounts: BrokerAccounts,
    /// `--broker-accounts-file`, read again at every registration.
    pub broker_accounts_file: Option<PathBuf>,
    /// The built-in names, the server's own and `--reserved-broker-usernames`.
    reserved_broker_usernames: BTreeSet<String>,
}

impl SecurityArgs {
    /// Checks the reserved names and reads `--broker-accounts-file` once;
    /// `server_username` (`--mqtt-username`) is reserved too.
    pub fn validate(&self, server_username: Option<&str>) -> Result<SecuritySettings, ConfigError> {
        if self
            .reserved_broker_usernames
            .iter()
            .any(|n| n.trim().is_empty())
        {
            return Err(ConfigError::ReservedUsername);
        }
        let settings = SecuritySettings {
            auth: AuthSettings {
                disabled: self.insecure_no_auth,
                open_metrics: self.open_metrics,
                open_events: self.open_events,
            },
            broker_accounts: self.broker_accounts,
            broker_accounts_file: self.broker_accounts_file.clone(),
            reserved_broker_usernames: BUILT_IN_RESERVED_USERNAMES
                .iter()
                .map(|n| (*n).to_owned())
                .chain(server_username.map(str::to_owned))
                .chain(
                    self.reserved_broker_usernames
                        .iter()
                        .map(|n| n.trim().to_owned()),
                )
                .collect(),
        };
        settings.broker_accounts_file_names()?;
        Ok(settings)
    }
}

impl SecuritySettings {
    /// Broker user names no device may take: the built-in ones, the
    /// server's own and `--reserved-broker-usernames`.
    pub fn reserved_broker_usernames(&self) -> BTreeSet<String> {
        self.reserved_broker_usernames.clone()
    }

    /// The user names of `--broker-accounts-file` (none without it), read
    /// now.
    pub fn broker_accounts_file_names(&self) -> Result<BTreeSet<String>, ConfigError> {
        let Some(path) = &self.broker_accounts_file else {
            return Ok(Default::default());
        };
        let error = |reason: String| ConfigError::BrokerAccountsFile {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
        let accounts = password_file_accounts(&text).map_err(error)?;
        Ok(accounts
            .into_iter()
            .map(|(user, _)| user.to_owned())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    #[test]
    fn reserved_names_are_the_built_in_ones_the_servers_own_and_the_listed_ones_trimmed() {
        let mut config = Config::defaults();
        config.mqtt.mqtt_username = Some("idem-main".into());
        config.security.reserved_broker_usernames = vec!["ops-bot".into(), " backup ".into()];
        let reserved = config
            .validate()
            .unwrap()
            .security
            .reserved_broker_usernames();
        for name in [
            "idem-server",
            "dashboards",
            "idem-main",
            "ops-bot",
            "backup",
        ] {
            assert!(
                reserved.contains(name),
                "{name} is not reserved: {reserved:?}"
            );
        }
        config.security.reserved_broker_usernames = vec!["ops-bot".into(), " ".into()];
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_RESERVED_BROKER_USERNAMES"), "{err}");
    }

    #[test]
    fn an_unreadable_broker_accounts_file_is_refused_at_start_naming_the_variable() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::defaults();
        config.security.broker_accounts_file = Some(dir.path().join("missing"));
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_BROKER_ACCOUNTS_FILE"), "{err}");
    }

    #[test]
    fn the_api_needs_tokens_unless_opened_and_only_managed_accounts_get_passwords() {
        let valid = Config::defaults().validate().unwrap();
        assert_eq!(
            valid.security.auth,
            AuthSettings {
                disabled: false,
                open_metrics: false,
                open_events: false,
            }
        );
        assert!(!valid.security.broker_accounts.issues_passwords());
        assert!(BrokerAccounts::Dynsec.issues_passwords());
        assert!(BrokerAccounts::PasswordFile.issues_passwords());
    }
}
