//! The deployment shape idem is meant to run in, for tests: a private
//! Mosquitto with a TLS listener and the dynamic-security plugin, set up by
//! the real `idem-server broker init` code (the server's and a dashboard
//! reader's accounts), and a server that manages the devices' accounts
//! (`--broker-accounts dynsec`) and authenticates operators with tokens.
//!
//! Owns nothing beyond what the `Scenario` it returns owns; the secrets it
//! hands out exist only for the test.

use std::time::Duration;

use anyhow::{Context, Result};
use idem_server::cli::broker::BrokerCommand;
use idem_server::config::BrokerAccounts;

use crate::broker::PrivateMosquitto;
use crate::database::TestDatabase;
use crate::scenario::Scenario;
use crate::server::{ServerSettings, TestServer};

/// The accounts of a secured broker.
#[derive(Debug, Clone)]
pub struct BrokerAccountsForTest {
    pub admin: (String, String),
    pub server: (String, String),
    pub reader: (String, String),
}

fn password(label: &str) -> String {
    format!("{label}-{}", uuid::Uuid::new_v4().simple())
}

/// A TLS broker with dynamic security, a fresh database and a server using
/// its own account and managing the devices', ready.
pub async fn start_secured(settings: ServerSettings) -> Result<(Scenario, BrokerAccountsForTest)> {
    crate::broker::raise_fd_limit().context("raising the open-file limit")?;
    let accounts = BrokerAccountsForTest {
        admin: ("broker-admin".into(), password("admin")),
        server: ("idem-server".into(), password("server")),
        reader: ("dashboards".into(), password("reader")),
    };
    let broker = PrivateMosquitto::builder()
        .tls()
        .dynamic_security(&accounts.admin.0, &accounts.admin.1)
        .start()?;
    let unique = uuid::Uuid::new_v4().simple().to_string();
    let root = format!("idem-secure/{}", &unique[..12]);
    let instance = format!("secure-{}", &unique[..12]);
    broker_init(&broker, &root, &instance, &accounts).await?;
    let settings = ServerSettings {
        topic_root: Some(root),
        instance: Some(instance),
        mqtt_credentials: Some(accounts.server.clone()),
        broker_accounts: BrokerAccounts::Dynsec,
        ..settings
    };
    let db = TestDatabase::create_with(&idem_server::MIGRATOR).await?;
    let server = TestServer::start(&db, &broker, settings).await?;
    Ok((Scenario { server, db, broker }, accounts))
}

/// `idem-server broker init` against `broker` for the topic root `root`.
pub async fn broker_init(
    broker: &PrivateMosquitto,
    root: &str,
    instance: &str,
    accounts: &BrokerAccountsForTest,
) -> Result<()> {
    let dir = tempfile::tempdir().context("a directory for the password files")?;
    let write = |name: &str, secret: &str| -> Result<std::path::PathBuf> {
        let path = dir.path().join(name);
        std::fs::write(&path, secret).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    };
    let mut config = idem_server::Config::defaults();
    config.mqtt.mqtt_url = broker.url().into();
    config.fleet.topic_root = root.to_owned();
    config.fleet.instance = instance.to_owned();
    config.mqtt.mqtt_ca_file = broker.ca_file().map(std::path::Path::to_path_buf);
    let valid = config.validate().context("broker init configuration")?;
    let command = BrokerCommand::Init {
        admin_username: accounts.admin.0.clone(),
        admin_password_file: write("admin", &accounts.admin.1)?,
        server_username: accounts.server.0.clone(),
        server_password_file: write("server", &accounts.server.1)?,
        reader_username: Some(accounts.reader.0.clone()),
        reader_password_file: Some(write("reader", &accounts.reader.1)?),
    };
    tokio::time::timeout(
        Duration::from_secs(30),
        idem_server::cli::broker::run(&valid, command),
    )
    .await
    .context("broker init took more than 30 s")?
    .context("idem-server broker init")
}
