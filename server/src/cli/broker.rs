//! `idem-server broker init|files`: setting a broker up for idem. `init`
//! uses the dynamic-security admin account (from `mosquitto_ctrl dynsec
//! init`) to create the server's and the dashboard readers' roles and
//! accounts; `files` writes a Mosquitto `password_file` and `acl_file` from
//! the device table for brokers without the plugin.
//!
//! Passwords are read from files or the environment, never echoed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Subcommand;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::Value;

use crate::broker::accounts::{self as accounts, CommandResult};
use crate::config::ValidConfig;
use crate::store;

#[derive(Debug, Clone, Subcommand)]
pub enum BrokerCommand {
    /// Create the `idem-server` and `idem-events-reader` roles and their
    /// accounts on a Mosquitto broker with the dynamic-security plugin
    /// (idempotent: safe to run again, e.g. to rotate a password). The
    /// server's account may connect only as `idem-server:{--instance}`, a
    /// reader's only with its user name as client id.
    Init {
        /// The plugin's admin account (`mosquitto_ctrl dynsec init … <user>`).
        #[arg(long, env = "IDEM_BROKER_ADMIN_USERNAME")]
        admin_username: String,
        /// A file holding the admin password.
        #[arg(long, env = "IDEM_BROKER_ADMIN_PASSWORD_FILE")]
        admin_password_file: PathBuf,
        /// The server's account to create (what `--mqtt-username` names).
        #[arg(long, default_value = "idem-server")]
        server_username: String,
        /// A file holding the server account's password.
        #[arg(long)]
        server_password_file: PathBuf,
        /// A read-only events account for dashboards, if wanted.
        #[arg(long)]
        reader_username: Option<String>,
        /// A file holding the reader's password.
        #[arg(long, requires = "reader_username")]
        reader_password_file: Option<PathBuf>,
    },
    /// Write `password_file` (the server's account and every device with
    /// issued credentials) and `acl_file` into a directory, for a Mosquitto
    /// without the dynamic-security plugin (`password_file` / `acl_file` in
    /// mosquitto.conf).
    Files {
        /// Directory to write into (created if missing).
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "idem-server")]
        server_username: String,
        /// A file holding the server account's password.
        #[arg(long)]
        server_password_file: PathBuf,
    },
}

fn read_secret(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the password file {}", path.display()))?;
    let secret = text.trim_end_matches(['\n', '\r']).to_owned();
    if secret.is_empty() {
        bail!("the password file {} is empty", path.display());
    }
    Ok(secret)
}

pub async fn run(config: &ValidConfig, command: BrokerCommand) -> anyhow::Result<()> {
    match command {
        BrokerCommand::Init {
            admin_username,
            admin_password_file,
            server_username,
            server_password_file,
            reader_username,
            reader_password_file,
        } => {
            let admin_password = read_secret(&admin_password_file)?;
            let server_password = read_secret(&server_password_file)?;
            let root = &config.fleet.topic_root;
            let reader = match (&reader_username, &reader_password_file) {
                (Some(user), Some(file)) => Some((user.clone(), read_secret(file)?)),
                _ => None,
            };
            let commands = init_commands(config, &server_username, &server_password, reader);
            let results = send_as_admin(config, &admin_username, &admin_password, commands).await?;
            refuse_failures(&results)?;
            eprintln!(
                "size the broker's queues for the fleet: max_queued_messages >= devices x {} (at least {}), max_inflight_messages 0 (docs/OPERATIONS.md, \"Sizing the broker's queues\")",
                crate::broker::sizing::MESSAGES_IN_FLIGHT_PER_DEVICE,
                crate::broker::sizing::MIN_QUEUED_MESSAGES
            );
            eprintln!(
                "broker ready for topic root {root}: role {} with account {server_username:?}{}",
                accounts::SERVER_ROLE,
                reader_username
                    .map(|u| format!(", role {} with account {u:?}", accounts::EVENTS_READER_ROLE))
                    .unwrap_or_default()
            );
        }
        BrokerCommand::Files {
            out,
            server_username,
            server_password_file,
        } => {
            let server_password = read_secret(&server_password_file)?;
            write_files(config, &out, &server_username, &server_password).await?;
        }
    }
    Ok(())
}

/// The dynamic-security commands that create the server's and readers'
/// roles and accounts (idempotent).
fn init_commands(
    config: &ValidConfig,
    server_username: &str,
    server_password: &str,
    reader: Option<(String, String)>,
) -> Vec<serde_json::Value> {
    let root = &config.fleet.topic_root;
    let mut commands = accounts::ensure_role(accounts::SERVER_ROLE, &accounts::server_acls(root));
    commands.extend(accounts::ensure_role(
        accounts::EVENTS_READER_ROLE,
        &accounts::events_reader_acls(root),
    ));
    // Bound to the server's client id (one account per instance), so
    // no other account can take over the server's session.
    let server_client_id = crate::mqtt::server_client_id(&config.fleet.instance);
    commands.extend(accounts::ensure_client(
        server_username,
        server_password,
        accounts::SERVER_ROLE,
        Some(&server_client_id),
    ));
    if let Some((user, password)) = &reader {
        // A reader connects with its user name as client id.
        commands.extend(accounts::ensure_client(
            user,
            password,
            accounts::EVENTS_READER_ROLE,
            Some(user),
        ));
    }
    commands
}

/// An error naming the first refused command, if any was refused.
fn refuse_failures(results: &[CommandResult]) -> anyhow::Result<()> {
    let failed: Vec<&CommandResult> = results.iter().filter(|r| !r.is_acceptable()).collect();
    if let Some(first) = failed.first() {
        bail!(
            "{} of {} commands failed, first: {}: {}",
            failed.len(),
            results.len(),
            first.command,
            first.error.clone().unwrap_or_default()
        );
    }
    Ok(())
}

/// Writes `password_file` and `acl_file` into `out` from the device table:
/// the server's account, the lines of `--broker-accounts-file`, then every
/// device with issued credentials whose id names none of those accounts
/// nor a reserved one (such a device is left out and named on stderr: no
/// device line can ever stand for another account).
async fn write_files(
    config: &ValidConfig,
    out: &Path,
    server_username: &str,
    server_password: &str,
) -> anyhow::Result<()> {
    let accounts_file = match &config.security.broker_accounts_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading the broker accounts file {}", path.display()))?,
        None => String::new(),
    };
    let pool = store::connect(config.database.url.expose(), 2)
        .await
        .context("cannot reach PostgreSQL: start it or set IDEM_DATABASE_URL")?;
    store::migrate(&pool).await.context("applying migrations")?;
    let devices = store::devices::broker_password_hashes(&pool).await?;
    let mut reserved = config.security.reserved_broker_usernames();
    reserved.insert(server_username.to_owned());
    let file = PasswordFile::build(
        server_username,
        &accounts::mosquitto_hash(server_password),
        &accounts_file,
        &reserved,
        &devices,
    )
    .map_err(anyhow::Error::msg)
    .context("reading the broker accounts file")?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_private(&out.join("password_file"), &file.text)?;
    write_private(
        &out.join("acl_file"),
        &accounts::static_acl_file(&config.fleet.topic_root, server_username),
    )?;
    // Not secret, but kept beside the others: include it from mosquitto.conf.
    write_private(
        &out.join("queues.conf"),
        &crate::broker::sizing::mosquitto_queue_settings(devices.len() as u64),
    )?;
    for id in &file.left_out {
        eprintln!(
            "left out device {id:?}: its id names a broker account that is not a device's (delete the device and register it under another id)"
        );
    }
    eprintln!(
        "wrote {}/password_file ({} devices, {} other accounts and {server_username:?}), {}/acl_file and {}/queues.conf (max_queued_messages {})",
        out.display(),
        file.devices,
        file.accounts,
        out.display(),
        out.display(),
        crate::broker::sizing::queued_messages_for(devices.len() as u64)
    );
    Ok(())
}

/// The text of a Mosquitto `password_file`, with what it holds.
#[derive(Debug)]
struct PasswordFile {
    text: String,
    devices: usize,
    accounts: usize,
    /// Devices whose id names another account, left out.
    left_out: Vec<String>,
}

impl PasswordFile {
    /// The server's line, the other accounts' lines (`accounts_file`, as
    /// `mosquitto_passwd` writes them), then the devices' lines, each user
    /// name once: a device named like an account or a `reserved` name is
    /// left out.
    fn build(
        server_username: &str,
        server_hash: &str,
        accounts_file: &str,
        reserved: &std::collections::BTreeSet<String>,
        devices: &[(String, String)],
    ) -> Result<Self, String> {
        let accounts = accounts::password_file_accounts(accounts_file)?;
        let mut written = std::collections::BTreeSet::from([server_username]);
        let mut text = format!("{server_username}:{server_hash}\n");
        let mut kept_accounts = 0;
        for (user, line) in &accounts {
            // The server's line is the one written above; each name once.
            if written.insert(user) {
                text.push_str(line);
                text.push('\n');
                kept_accounts += 1;
            }
        }
        let mut left_out = Vec::new();
        let mut kept_devices = 0;
        for (id, hash) in devices {
            if written.contains(id.as_str()) || reserved.contains(id) {
                left_out.push(id.clone());
            } else {
                text.push_str(&format!("{id}:{hash}\n"));
                written.insert(id);
                kept_devices += 1;
            }
        }
        Ok(Self {
            text,
            devices: kept_devices,
            accounts: kept_accounts,
            left_out,
        })
    }
}

/// Writes a file only its owner may read (it holds password hashes): mode
/// 0600, also when the file existed before with a wider mode.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    // `mode` applies only to a file this call creates.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private (mode 0600)", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Sends `commands` with the admin account and returns the answers (also
/// for tests that set a broker up as its admin would).
pub async fn send_as_admin(
    config: &ValidConfig,
    username: &str,
    password: &str,
    commands: Vec<Value>,
) -> anyhow::Result<Vec<CommandResult>> {
    let mut options = MqttOptions::new(
        format!("idem-broker-init:{}", uuid::Uuid::new_v4().simple()),
        config.mqtt.broker.host.clone(),
        config.mqtt.broker.port,
    );
    options
        .set_credentials(username, password)
        .set_keep_alive(Duration::from_secs(30))
        .set_max_packet_size(1 << 24, 1 << 24);
    // Same TLS as the server's own connection (`--mqtt-ca-file`, client
    // certificate), so `broker init` works against an mqtts:// listener.
    if let Some(tls) = &config.mqtt.tls {
        options.set_transport(rumqttc::Transport::tls_with_config(
            rumqttc::TlsConfiguration::Rustls(tls.config.clone()),
        ));
    }
    let (client, mut eventloop) = AsyncClient::new(options, 16);
    client
        .subscribe(accounts::RESPONSE_TOPIC, QoS::AtLeastOnce)
        .await
        .context("subscribing to the dynamic-security answers")?;
    let batch = uuid::Uuid::new_v4().simple().to_string();
    let payload = accounts::command_payload(&commands, &batch);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut sent = false;
    loop {
        let event = tokio::time::timeout_at(deadline, eventloop.poll())
            .await
            .context(
                "the broker did not answer within 20 s (is the dynamic-security plugin loaded?)",
            )?
            .with_context(|| format!("connecting to {} as {username:?}", config.mqtt.url))?;
        match event {
            Event::Incoming(Packet::SubAck(_)) if !sent => {
                client
                    .publish(
                        accounts::CONTROL_TOPIC,
                        QoS::AtLeastOnce,
                        false,
                        payload.clone(),
                    )
                    .await
                    .context("sending the commands")?;
                sent = true;
            }
            Event::Incoming(Packet::Publish(p)) if p.topic == accounts::RESPONSE_TOPIC => {
                let results = accounts::parse_responses(&p.payload).map_err(anyhow::Error::msg)?;
                if results
                    .iter()
                    .any(|r| r.correlation.as_deref() == Some(&batch))
                {
                    let _ = client.disconnect().await;
                    return Ok(results);
                }
            }
            Event::Incoming(_) | Event::Outgoing(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn reserved() -> BTreeSet<String> {
        ["idem-server", "dashboards", "broker-admin", "admin"]
            .map(str::to_owned)
            .into()
    }

    #[test]
    fn a_device_named_like_the_server_a_reader_or_an_account_of_the_file_is_left_out_of_the_password_file(
    ) {
        let devices = [
            ("dev-1", "$7$h1"),
            ("idem-server", "$7$operator"),
            ("dashboards", "$7$operator"),
            ("ops-bot", "$7$operator"),
            ("dev-2", "$7$h2"),
        ]
        .map(|(id, hash)| (id.to_owned(), hash.to_owned()));
        let accounts =
            "# the broker's own\ndashboards:$7$reader\nops-bot:$7$bot\nidem-server:$7$stale\n";
        let file = PasswordFile::build("idem-server", "$7$server", accounts, &reserved(), &devices)
            .unwrap();
        assert_eq!(
            file.text,
            "idem-server:$7$server\ndashboards:$7$reader\nops-bot:$7$bot\ndev-1:$7$h1\ndev-2:$7$h2\n"
        );
        assert_eq!(file.left_out, ["idem-server", "dashboards", "ops-bot"]);
        assert_eq!((file.devices, file.accounts), (2, 2));
        let users: Vec<&str> = file
            .text
            .lines()
            .filter_map(|l| l.split(':').next())
            .collect();
        let unique: BTreeSet<&str> = users.iter().copied().collect();
        assert_eq!(users.len(), unique.len(), "every user name once: {users:?}");
    }

    #[test]
    fn an_accounts_file_that_is_not_a_password_file_is_refused() {
        let err = PasswordFile::build("idem-server", "$7$s", "just text\n", &reserved(), &[])
            .unwrap_err();
        assert!(err.contains("line 1"), "{err}");
    }

    #[test]
    fn files_with_passwords_are_made_private_also_when_they_existed_readable_by_all() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir =
            std::env::temp_dir().join(format!("idem-private-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("password_file");
        std::fs::write(&path, "old\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_private(&path, "new\n").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
