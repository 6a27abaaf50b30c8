//! A private Mosquitto per test: the system `mosquitto` binary on a free
//! loopback port with its own config, logs and temporary directory, so fault
//! tests can stop and restart it without touching anyone else's broker.
//! [`PrivateMosquitto::builder`] adds a TLS listener (certificates made at
//! start with rcgen: `certs.rs`), required client certificates, a password
//! file (hashed with the system's `mosquitto_passwd`; with it, as in
//! docs/OPERATIONS.md §9, `use_username_as_clientid true` binds every
//! client id to its user name) and an ACL file.
//!
//! It owns exactly one child process and one temporary directory; it must
//! never signal any other process, nor use the machine's broker on 1883.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;

use crate::certs::{CertFiles, TestCa};
use crate::support::{
    find_binary_in, free_port, kill_and_reap, loopback_addr, tail, wait_for_tcp, LOOPBACK,
};

/// How long the broker gets to accept TCP connections after it is spawned.
const READY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `stop()` waits after SIGTERM before it sends SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// Log lines quoted in errors.
const TAIL_LINES: usize = 40;
/// Fresh ports tried when the broker cannot bind (another process took the
/// port between our probe and its bind).
const START_ATTEMPTS: usize = 3;

const MISSING_BINARY: &str = "mosquitto binary not found: install it with \
    `apt-get install mosquitto` or run scripts/test, which installs it";
const MISSING_PASSWD: &str = "mosquitto_passwd not found: install it with \
    `apt-get install mosquitto` (it ships the tool) or run scripts/test";

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit and returns
/// the new soft limit. Tests that open hundreds of MQTT clients need it, and
/// children spawned afterwards (the broker) inherit it.
pub fn raise_fd_limit() -> Result<u64> {
    rlimit::increase_nofile_limit(u64::MAX)
        .context("raising RLIMIT_NOFILE (the open-file limit) to its hard limit")
}

/// How a private broker is set up; made by [`PrivateMosquitto::builder`].
/// Every option is off by default: a plain, anonymous, non-persistent broker.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct MosquittoBuilder {
    persistent: bool,
    tls: bool,
    require_client_cert: bool,
    /// `(user, password)` accounts of the password file.
    accounts: Vec<(String, String)>,
    /// The text of an `acl_file`.
    acl: Option<String>,
    /// `max_queued_messages` / `max_inflight_messages`.
    queue: QueueLimits,
    /// The dynamic-security plugin with this `(admin, password)` account.
    dynsec: Option<(String, String)>,
    /// This broker is an edge bridged to a core broker.
    bridge: Option<BridgeToCore>,
}

/// How an edge broker forwards to the core broker the server connects to
/// (docs/ARCHITECTURE.md, "Edge brokers"): device reports and status (wills
/// included) go out to the core, desired and report requests come in. The
/// bridge keeps a persistent session at the core (`cleansession false`), so
/// what the core accepts for an edge's devices while the edge is away is
/// delivered when it is back, and it uses Mosquitto's bridge mode
/// (`try_private`), so the retain flag of every message survives the hop.
#[derive(Debug, Clone)]
pub struct BridgeToCore {
    /// The core broker's plain listener on 127.0.0.1.
    pub core_port: u16,
    /// The server's topic root.
    pub topic_root: String,
    /// The bridge's client id at the core (unique per edge).
    pub name: String,
    /// `Some(ids)`: the bridge subscribes at the core to these devices'
    /// `desired` and `get` topics only, so the core sends each edge only
    /// its own devices' messages. `None`: to `{root}/+/desired` and
    /// `{root}/+/get`, so every edge receives every device's messages.
    pub devices: Option<Vec<String>>,
}

impl BridgeToCore {
    /// The `connection` section of the edge's config.
    fn config(&self) -> String {
        let root = &self.topic_root;
        let mut section = format!(
            "connection {name}\n\
             address {LOOPBACK}:{port}\n\
             clientid {name}\n\
             cleansession false\n\
             try_private true\n\
             bridge_protocol_version mqttv311\n\
             restart_timeout 1 5\n\
             topic {root}/+/reported out 1\n\
             topic {root}/+/status out 1\n",
            name = self.name,
            port = self.core_port,
        );
        match &self.devices {
            None => section.push_str(&format!(
                "topic {root}/+/desired in 1\ntopic {root}/+/get in 1\n"
            )),
            Some(ids) => {
                for id in ids {
                    section.push_str(&format!(
                        "topic {root}/{id}/desired in 1\ntopic {root}/{id}/get in 1\n"
                    ));
                }
            }
        }
        section
    }
}

/// Mosquitto's per-client queue limits.
#[derive(Debug, Clone, Copy)]
struct QueueLimits {
    max_queued_messages: u32,
    /// 0 = no limit.
    max_inflight_messages: u32,
}

impl Default for QueueLimits {
    fn default() -> Self {
        Self {
            max_queued_messages: 100_000,
            max_inflight_messages: 0,
        }
    }
}

impl MosquittoBuilder {
    /// Retained messages and persistent sessions survive `stop()` +
    /// `restart()` (see [`PrivateMosquitto::start_persistent`]).
    pub fn persistent(mut self) -> Self {
        self.persistent = true;
        self
    }

    /// The listener speaks TLS only (`mqtts://`), with a server certificate
    /// for 127.0.0.1 / localhost signed by the broker's own test CA
    /// ([`PrivateMosquitto::ca_file`]).
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Clients must present a certificate signed by the broker's CA
    /// (`require_certificate true`); its common name becomes the user name
    /// (`use_identity_as_username true`) and anonymous clients are refused.
    /// Implies [`MosquittoBuilder::tls`].
    pub fn require_client_cert(mut self) -> Self {
        self.tls = true;
        self.require_client_cert = true;
        self
    }

    /// A password file with these accounts; anonymous clients are refused
    /// (`allow_anonymous false`), and every client's user name is its
    /// client id (`use_username_as_clientid true`: no account can take over
    /// another's session). Can be called again to add accounts.
    pub fn password_file<U: AsRef<str>, P: AsRef<str>>(mut self, accounts: &[(U, P)]) -> Self {
        self.accounts.extend(
            accounts
                .iter()
                .map(|(u, p)| (u.as_ref().to_owned(), p.as_ref().to_owned())),
        );
        self
    }

    /// Mosquitto's per-client queue limits (default: 100,000 queued, no
    /// in-flight limit, as the fleet's configs size them). Small limits make
    /// the broker drop QoS 1 messages for a client that does not keep up.
    pub fn queue_limits(mut self, max_queued_messages: u32, max_inflight_messages: u32) -> Self {
        self.queue = QueueLimits {
            max_queued_messages,
            max_inflight_messages,
        };
        self
    }

    /// An `acl_file` with this text (e.g. what `idem-server broker files`
    /// writes: `idem_server::broker::accounts::static_acl_file`).
    pub fn acl_file(mut self, text: impl Into<String>) -> Self {
        self.acl = Some(text.into());
        self
    }

    /// Mosquitto's dynamic-security plugin (Debian's
    /// `mosquitto_dynamic_security.so`), initialised with `mosquitto_ctrl
    /// dynsec init` and this admin account; anonymous clients are refused.
    pub fn dynamic_security(mut self, admin: &str, password: &str) -> Self {
        self.dynsec = Some((admin.to_owned(), password.to_owned()));
        self
    }

    /// An edge broker: bridged to the core broker as `bridge` says.
    pub fn bridge_to(mut self, bridge: BridgeToCore) -> Self {
        self.bridge = Some(bridge);
        self
    }

    /// Starts the broker on a free port of 127.0.0.1 and waits until it
    /// accepts TCP connections.
    pub fn start(self) -> Result<PrivateMosquitto> {
        PrivateMosquitto::start_with(self)
    }

    fn authenticates(&self) -> bool {
        self.require_client_cert || !self.accounts.is_empty() || self.dynsec.is_some()
    }
}

/// A Mosquitto broker owned by one test. Dropping it kills and reaps the
/// child and deletes its directory.
#[derive(Debug)]
pub struct PrivateMosquitto {
    /// `None` while stopped.
    child: Option<Child>,
    settings: MosquittoBuilder,
    /// The broker's CA and server certificate, for a TLS listener.
    tls: Option<(TestCa, CertFiles)>,
    /// Written (hashed) at start when the settings have accounts.
    password_file: Option<PathBuf>,
    /// Written at start when the settings have an ACL.
    acl_file: Option<PathBuf>,
    /// The plugin library and its state file, with dynamic security.
    dynsec: Option<(PathBuf, PathBuf)>,
    binary: PathBuf,
    port: u16,
    config: PathBuf,
    log: PathBuf,
    stdout: PathBuf,
    stderr: PathBuf,
    /// Held for its `Drop`, which removes config and logs.
    dir: TempDir,
}

impl PrivateMosquitto {
    /// Starts a broker on a free port of 127.0.0.1 and waits until it accepts
    /// TCP connections. Nothing is persisted: a restarted broker has no
    /// retained messages and no sessions.
    pub fn start() -> Result<Self> {
        Self::builder().start()
    }

    /// Options for a broker with TLS, client certificates or passwords:
    /// `PrivateMosquitto::builder().tls().password_file(&[("idem-server", "pw")]).start()`.
    pub fn builder() -> MosquittoBuilder {
        MosquittoBuilder::default()
    }

    /// Like [`PrivateMosquitto::start`], but with persistence on, like a
    /// production broker: retained messages and persistent sessions are saved
    /// on a graceful `stop()` and restored by `restart()` (not after `kill()`).
    pub fn start_persistent() -> Result<Self> {
        Self::builder().persistent().start()
    }

    fn start_with(settings: MosquittoBuilder) -> Result<Self> {
        raise_fd_limit()?;
        let binary = mosquitto_binary(
            std::env::var_os("PATH").as_deref(),
            &[PathBuf::from("/usr/sbin/mosquitto")],
        )?;
        let dir = tempfile::Builder::new()
            .prefix("idem-mosquitto-")
            .tempdir()
            .context("creating a temporary directory for a private Mosquitto")?;
        let tls = if settings.tls {
            let ca = TestCa::create(dir.path(), "idem test broker CA")?;
            let server = ca.issue_server("server")?;
            Some((ca, server))
        } else {
            None
        };
        let password_file = if settings.accounts.is_empty() {
            None
        } else {
            let path = dir.path().join("passwords");
            write_password_file(&path, &settings.accounts)?;
            Some(path)
        };
        let acl_file = match &settings.acl {
            None => None,
            Some(text) => {
                let path = dir.path().join("acl");
                fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
                Some(path)
            }
        };
        let dynsec = match &settings.dynsec {
            None => None,
            Some((admin, password)) => {
                let state = dir.path().join("dynamic-security.json");
                init_dynamic_security(&state, admin, password)?;
                Some((dynsec_plugin()?, state))
            }
        };
        let mut broker = Self {
            child: None,
            settings,
            tls,
            password_file,
            acl_file,
            dynsec,
            binary,
            port: 0,
            config: dir.path().join("mosquitto.conf"),
            log: dir.path().join("mosquitto.log"),
            stdout: dir.path().join("stdout.log"),
            stderr: dir.path().join("stderr.log"),
            dir,
        };
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            broker.port = free_port()?;
            broker.write_config()?;
            match broker.spawn() {
                Ok(()) => return Ok(broker),
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error
            .unwrap_or_else(|| anyhow!("no start attempt was made"))
            .context(format!(
                "starting a private Mosquitto failed {START_ATTEMPTS} times"
            )))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn host(&self) -> &str {
        LOOPBACK
    }

    /// `mqtt://127.0.0.1:PORT`, or `mqtts://…` for a TLS listener.
    pub fn url(&self) -> String {
        let scheme = if self.is_tls() { "mqtts" } else { "mqtt" };
        format!("{scheme}://{LOOPBACK}:{}", self.port)
    }

    /// Whether the listener speaks TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The CA certificate that signed the broker's certificate (TLS only).
    pub fn ca_file(&self) -> Option<&Path> {
        self.tls.as_ref().map(|(ca, _)| ca.ca_file())
    }

    /// The broker's test CA (TLS only), to issue more client certificates.
    pub fn ca(&self) -> Option<&TestCa> {
        self.tls.as_ref().map(|(ca, _)| ca)
    }

    /// A client certificate signed by the broker's CA, with `common_name`
    /// as its identity (the user name when client certificates are
    /// required). Fails on a broker without TLS.
    pub fn client_cert(&self, common_name: &str) -> Result<CertFiles> {
        self.ca()
            .ok_or_else(|| anyhow!("this private broker has no TLS listener: use builder().tls()"))?
            .issue_client(common_name)
    }

    /// rumqttc options for a client of this broker (keep-alive 5 s), over
    /// TLS trusting the broker's CA when the listener is TLS. No
    /// credentials: see [`PrivateMosquitto::mqtt_options_as`].
    pub fn mqtt_options(&self, client_id: impl Into<String>) -> rumqttc::MqttOptions {
        let mut options = rumqttc::MqttOptions::new(client_id, LOOPBACK, self.port);
        options.set_keep_alive(Duration::from_secs(5));
        if let Some((ca, _)) = &self.tls {
            match ca.client_config(None) {
                Ok(config) => {
                    options.set_transport(rumqttc::Transport::tls_with_config(
                        rumqttc::TlsConfiguration::Rustls(config),
                    ));
                }
                // The CA file was just written by us; a failure here shows
                // up as a failed connection naming TLS.
                Err(e) => eprintln!("idem-tests: no TLS client config for the broker: {e:#}"),
            }
        }
        options
    }

    /// Like [`PrivateMosquitto::mqtt_options`], logged in as `username`.
    pub fn mqtt_options_as(
        &self,
        client_id: impl Into<String>,
        username: &str,
        password: &str,
    ) -> rumqttc::MqttOptions {
        let mut options = self.mqtt_options(client_id);
        options.set_credentials(username, password);
        options
    }

    /// The broker's own log file (all of its log types are written there).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of the broker's log, for assertion messages.
    pub fn log_tail(&self) -> String {
        tail(&self.log, TAIL_LINES)
    }

    /// Whether the child process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Graceful stop: SIGTERM, then SIGKILL if it has not exited within 5 s;
    /// waits for the process to be reaped. Blocks; a no-op when stopped.
    pub fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = Pid::from_raw(
            i32::try_from(child.id()).context("the broker's pid does not fit in an i32")?,
        );
        if matches!(child.try_wait(), Ok(None)) {
            // ESRCH means it exited between the check and the signal: fine.
            if let Err(e) = kill(pid, Signal::SIGTERM) {
                if e != nix::errno::Errno::ESRCH {
                    return Err(e).context(format!("sending SIGTERM to mosquitto (pid {pid})"));
                }
            }
        }
        let deadline = Instant::now() + STOP_GRACE;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(e).context(format!("waiting for mosquitto (pid {pid}) to exit"))
                }
            }
        }
        child
            .kill()
            .context(format!("killing mosquitto (pid {pid}) after SIGTERM"))?;
        child
            .wait()
            .context(format!("reaping mosquitto (pid {pid})"))?;
        Ok(())
    }

    /// Abrupt stop (SIGKILL), like a broker crash: sessions are not saved.
    pub fn kill(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = child.id();
        child
            .kill()
            .context(format!("killing mosquitto (pid {pid})"))?;
        child
            .wait()
            .context(format!("reaping mosquitto (pid {pid})"))?;
        Ok(())
    }

    /// Starts the broker again on the same port with the same config (stops
    /// it first if it is running) and waits until it accepts connections.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.spawn().context(format!(
            "restarting the private Mosquitto on port {}",
            self.port
        ))
    }

    fn write_config(&self) -> Result<()> {
        // When started as root, mosquitto switches to the `mosquitto` user
        // unless told otherwise; that user could not write our 0700 log dir.
        let user = if nix::unistd::geteuid().is_root() {
            "user root\n"
        } else {
            ""
        };
        let persistence = if self.settings.persistent {
            // Saved on SIGTERM (graceful stop); no periodic autosave, so a
            // kill() loses what a crash would lose.
            format!(
                "persistence true\n\
                 persistence_location {}/\n\
                 persistence_file mosquitto.db\n\
                 autosave_interval 0\n",
                self.dir.path().display()
            )
        } else {
            "persistence false\n".to_owned()
        };
        let tls = match &self.tls {
            None => String::new(),
            Some((ca, server)) => {
                let mut tls = format!(
                    "cafile {}\n\
                     certfile {}\n\
                     keyfile {}\n",
                    ca.ca_file().display(),
                    server.cert.display(),
                    server.key.display(),
                );
                if self.settings.require_client_cert {
                    tls.push_str("require_certificate true\nuse_identity_as_username true\n");
                } else {
                    tls.push_str("require_certificate false\n");
                }
                tls
            }
        };
        let anonymous = !self.settings.authenticates();
        let mut passwords = match &self.password_file {
            // The client id is the user name, whatever the client sends: a
            // device logged in with its own password cannot take another
            // device's session, nor the server's.
            Some(path) => format!(
                "password_file {}\nuse_username_as_clientid true\n",
                path.display()
            ),
            None => String::new(),
        };
        if let Some(path) = &self.acl_file {
            passwords.push_str(&format!("acl_file {}\n", path.display()));
        }
        if let Some((plugin, state)) = &self.dynsec {
            passwords.push_str(&format!(
                "plugin {}\nplugin_opt_config_file {}\n",
                plugin.display(),
                state.display()
            ));
        }
        let bridge = self
            .settings
            .bridge
            .as_ref()
            .map(BridgeToCore::config)
            .unwrap_or_default();
        let config = format!(
            "# private broker of one idem test\n\
             {user}\
             listener {port} {LOOPBACK}\n\
             {tls}\
             allow_anonymous {anonymous}\n\
             {passwords}\
             {persistence}\
             max_queued_messages {max_queued}\n\
             max_inflight_messages {max_inflight}\n\
             sys_interval 1\n\
             set_tcp_nodelay true\n\
             log_dest file {log}\n\
             log_type error\n\
             log_type warning\n\
             log_type notice\n\
             log_type information\n\
             connection_messages true\n\
             log_timestamp_format %Y-%m-%dT%H:%M:%S\n\
             {bridge}",
            port = self.port,
            log = self.log.display(),
            max_queued = self.settings.queue.max_queued_messages,
            max_inflight = self.settings.queue.max_inflight_messages,
        );
        fs::write(&self.config, config)
            .with_context(|| format!("writing Mosquitto config {}", self.config.display()))
    }

    fn spawn(&mut self) -> Result<()> {
        let stdout = append(&self.stdout)?;
        let stderr = append(&self.stderr)?;
        let mut child = Command::new(&self.binary)
            .arg("-c")
            .arg(&self.config)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("spawning {}", self.binary.display()))?;
        let addr = loopback_addr(self.port);
        let ready = wait_for_tcp(addr, READY_TIMEOUT, || match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => bail!("mosquitto exited early with {status}"),
            Err(e) => Err(e).context("checking whether mosquitto is still running"),
        });
        match ready {
            Ok(()) => {
                self.child = Some(child);
                Ok(())
            }
            Err(e) => {
                // Never leave a half-started child behind.
                kill_and_reap(Some(child), "half-started private mosquitto");
                Err(e.context(format!(
                    "private Mosquitto on {addr} did not become ready\n\
                     --- {} ---\n{}\n--- stderr ---\n{}",
                    self.log.display(),
                    tail(&self.log, TAIL_LINES),
                    tail(&self.stderr, TAIL_LINES),
                )))
            }
        }
    }
}

/// Writes `accounts` as `user:password` lines and hashes the file in place
/// with `mosquitto_passwd -U` (one call for any number of accounts).
const MISSING_DYNSEC: &str = "Mosquitto's dynamic-security plugin \
    (mosquitto_dynamic_security.so) or mosquitto_ctrl not found: install Debian's \
    `mosquitto` and `mosquitto-clients` packages, or run scripts/test, which installs them";

/// Where Debian and other distributions put the plugin.
pub(crate) fn dynsec_plugin() -> Result<PathBuf> {
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so",
        "/usr/lib/aarch64-linux-gnu/mosquitto_dynamic_security.so",
        "/usr/lib/mosquitto_dynamic_security.so",
        "/usr/lib64/mosquitto_dynamic_security.so",
        "/usr/local/lib/mosquitto_dynamic_security.so",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!(MISSING_DYNSEC))
}

/// `mosquitto_ctrl dynsec init <state> <admin> <password>`.
fn init_dynamic_security(state: &Path, admin: &str, password: &str) -> Result<()> {
    let ctrl = find_binary_in(
        std::env::var_os("PATH").as_deref(),
        "mosquitto_ctrl",
        &[PathBuf::from("/usr/bin/mosquitto_ctrl")],
    )
    .ok_or_else(|| anyhow!(MISSING_DYNSEC))?;
    let output = Command::new(&ctrl)
        .args(["dynsec", "init"])
        .arg(state)
        .arg(admin)
        .arg(password)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} dynsec init", ctrl.display()))?;
    if !output.status.success() || !state.is_file() {
        bail!(
            "{} dynsec init failed with {}: {}",
            ctrl.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

fn write_password_file(path: &Path, accounts: &[(String, String)]) -> Result<()> {
    let passwd = find_binary_in(
        std::env::var_os("PATH").as_deref(),
        "mosquitto_passwd",
        &[PathBuf::from("/usr/bin/mosquitto_passwd")],
    )
    .ok_or_else(|| anyhow!(MISSING_PASSWD))?;
    let mut plain = String::new();
    for (user, password) in accounts {
        if user.contains(':') || user.contains('\n') || password.contains('\n') {
            bail!(
                "account {user:?}: user names cannot hold ':' or newlines, passwords no newlines"
            );
        }
        plain.push_str(&format!("{user}:{password}\n"));
    }
    fs::write(path, plain).with_context(|| format!("writing {}", path.display()))?;
    let output = Command::new(&passwd)
        .arg("-U")
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} -U", passwd.display()))?;
    if !output.status.success() {
        bail!(
            "{} -U {} failed with {}: {}",
            passwd.display(),
            path.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// The mosquitto binary on `path_var`, else among `fallbacks`; the error
/// says what to install.
fn mosquitto_binary(path_var: Option<&OsStr>, fallbacks: &[PathBuf]) -> Result<PathBuf> {
    find_binary_in(path_var, "mosquitto", fallbacks).ok_or_else(|| anyhow!(MISSING_BINARY))
}

fn append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {} for the broker's output", path.display()))
}

impl Drop for PrivateMosquitto {
    fn drop(&mut self) {
        kill_and_reap(self.child.take(), "private mosquitto");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tls_broker_with_passwords_refuses_anonymous_clients_and_hashes_the_passwords() {
        let broker = PrivateMosquitto::builder()
            .tls()
            .password_file(&[("idem-server", "pw-1"), ("dev-1", "pw-2")])
            .start()
            .unwrap();
        assert!(broker.url().starts_with("mqtts://127.0.0.1:"));
        let config = fs::read_to_string(&broker.config).unwrap();
        for line in [
            "allow_anonymous false",
            "require_certificate false",
            "use_username_as_clientid true",
            &format!("cafile {}", broker.ca_file().unwrap().display()),
        ] {
            assert!(
                config.lines().any(|l| l == line),
                "missing {line:?} in\n{config}"
            );
        }
        let passwords = fs::read_to_string(broker.password_file.as_ref().unwrap()).unwrap();
        assert!(
            passwords.contains("idem-server:$") && !passwords.contains("pw-1"),
            "{passwords}"
        );

        let certs = PrivateMosquitto::builder()
            .require_client_cert()
            .start()
            .unwrap();
        let config = fs::read_to_string(&certs.config).unwrap();
        for line in [
            "require_certificate true",
            "use_identity_as_username true",
            "allow_anonymous false",
        ] {
            assert!(
                config.lines().any(|l| l == line),
                "missing {line:?} in\n{config}"
            );
        }
    }

    #[test]
    fn a_missing_mosquitto_binary_is_an_error_that_says_what_to_install() {
        let empty = tempfile::tempdir().unwrap();
        let err = mosquitto_binary(
            Some(empty.path().as_os_str()),
            &[empty.path().join("mosquitto")],
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "mosquitto binary not found: install it with `apt-get install mosquitto` \
             or run scripts/test, which installs it"
        );
    }

    #[test]
    fn the_config_listens_on_loopback_only_with_big_queues() {
        let dir = tempfile::tempdir().unwrap();
        let broker = PrivateMosquitto {
            child: None,
            settings: MosquittoBuilder::default(),
            tls: None,
            password_file: None,
            acl_file: None,
            dynsec: None,
            binary: PathBuf::from("mosquitto"),
            port: 41234,
            config: dir.path().join("mosquitto.conf"),
            log: dir.path().join("mosquitto.log"),
            stdout: dir.path().join("stdout.log"),
            stderr: dir.path().join("stderr.log"),
            dir,
        };
        broker.write_config().unwrap();
        let config = fs::read_to_string(&broker.config).unwrap();
        for line in [
            "listener 41234 127.0.0.1",
            "allow_anonymous true",
            "persistence false",
            "max_queued_messages 100000",
            "max_inflight_messages 0",
            "set_tcp_nodelay true",
        ] {
            assert!(
                config.lines().any(|l| l == line),
                "missing {line:?} in\n{config}"
            );
        }
    }
}
