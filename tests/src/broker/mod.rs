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
//!
//! Here: the broker ([`PrivateMosquitto`]) and its process: start, stop,
//! kill, restart, its log. By topic: `builder` (the options), `bridge` (an
//! edge broker's bridge to the core), `config_file` (the `mosquitto.conf`
//! they make), `accounts` (password file and dynamic security) and
//! `client_options` (how a test reaches the broker: URL, TLS, rumqttc).

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
use crate::support::{find_binary_in, free_port, kill_and_reap, loopback_addr, tail, wait_for_tcp};

mod accounts;
mod bridge;
mod builder;
mod client_options;
mod config_file;
mod retained_probe;
#[cfg(test)]
mod tests;

pub(crate) use accounts::dynsec_plugin;
pub use bridge::BridgeToCore;
pub use builder::MosquittoBuilder;
pub use client_options::subscribe_acknowledged;

use accounts::{init_dynamic_security, write_password_file};

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

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit and returns
/// the new soft limit. Tests that open hundreds of MQTT clients need it, and
/// children spawned afterwards (the broker) inherit it.
pub fn raise_fd_limit() -> Result<u64> {
    rlimit::increase_nofile_limit(u64::MAX)
        .context("raising RLIMIT_NOFILE (the open-file limit) to its hard limit")
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
