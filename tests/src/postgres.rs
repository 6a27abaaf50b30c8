//! A throwaway PostgreSQL cluster per fault test: made with the system's
//! `initdb` and run with `pg_ctl` in a temporary directory on a free loopback
//! port, with trust auth, so a test can stop and start "the database" without
//! touching the machine's shared PostgreSQL. [`PrivatePostgres::builder`]
//! adds TLS (`ssl = on`, a certificate from a test CA, plain TCP refused)
//! and a superuser password (scram-sha-256 over TCP).
//!
//! It owns one data directory and the postmaster started from it; it must
//! never stop or configure any other cluster. As root, the cluster runs as
//! the `postgres` user (initdb refuses root) via `runuser`.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use tempfile::TempDir;

use crate::certs::TestCa;
use crate::support::{
    accepts_tcp, find_binary, free_port, is_executable, loopback_addr, output_within, tail,
    COMMAND_LIMIT, LOOPBACK,
};

/// Seconds `pg_ctl` waits for start-up or shutdown.
const PG_CTL_TIMEOUT_SECS: &str = "60";
const TAIL_LINES: usize = 40;
const START_ATTEMPTS: usize = 3;
/// The cluster's superuser, also the OS user that runs it when we are root.
const CLUSTER_USER: &str = "postgres";

const MISSING_BINARIES: &str = "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH \
    or in /usr/lib/postgresql/*/bin: install them with `apt-get install postgresql` or run \
    scripts/test, which installs it";

/// How a private cluster is set up; made by [`PrivatePostgres::builder`].
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct PostgresBuilder {
    tls: bool,
    password: Option<String>,
}

impl PostgresBuilder {
    /// TCP connections must use TLS (`hostssl`; plain `host` is rejected),
    /// with a server certificate for 127.0.0.1 / localhost signed by the
    /// cluster's own test CA ([`PrivatePostgres::ca_file`]).
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// The superuser `postgres` gets this password and TCP clients must
    /// give it (scram-sha-256); local socket connections stay trusted.
    pub fn password(mut self, password: &str) -> Self {
        self.password = Some(password.to_owned());
        self
    }

    /// Creates and starts the cluster (see [`PrivatePostgres::start`]).
    pub fn start(self) -> Result<PrivatePostgres> {
        PrivatePostgres::start_with(self)
    }
}

/// A private PostgreSQL cluster. Dropping it stops the server (`immediate`)
/// and deletes the data directory.
#[derive(Debug)]
pub struct PrivatePostgres {
    settings: PostgresBuilder,
    /// The cluster's CA, with TLS.
    ca: Option<TestCa>,
    bin_dir: PathBuf,
    /// `Some(runuser)` when we are root and must run the cluster as `postgres`.
    runuser: Option<PathBuf>,
    port: u16,
    data: PathBuf,
    log: PathBuf,
    running: bool,
    /// Held for its `Drop`, which removes the cluster's files.
    dir: TempDir,
}

impl PrivatePostgres {
    /// Creates a cluster in a temporary directory, starts it on a free port
    /// of 127.0.0.1 and waits until it accepts connections. Blocks for a few
    /// seconds (initdb).
    pub fn start() -> Result<Self> {
        Self::builder().start()
    }

    /// Options for a cluster with TLS or a password:
    /// `PrivatePostgres::builder().tls().password("pw").start()`.
    pub fn builder() -> PostgresBuilder {
        PostgresBuilder::default()
    }

    fn start_with(settings: PostgresBuilder) -> Result<Self> {
        let bin_dir = find_bin_dir()?;
        let runuser = if nix::unistd::geteuid().is_root() {
            Some(
                find_binary(
                    "runuser",
                    &[
                        PathBuf::from("/usr/sbin/runuser"),
                        PathBuf::from("/sbin/runuser"),
                    ],
                )
                .ok_or_else(|| {
                    anyhow!(
                        "running as root, a private PostgreSQL must run as user `postgres`, \
                         but `runuser` was not found: install util-linux"
                    )
                })?,
            )
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix("idem-pg-")
            .tempdir()
            .context("creating a temporary directory for a private PostgreSQL")?;
        if runuser.is_some() {
            chown_to_cluster_user(dir.path())?;
        }
        let mut cluster = Self {
            settings,
            ca: None,
            bin_dir,
            runuser,
            port: 0,
            data: dir.path().join("data"),
            log: dir.path().join("postgres.log"),
            running: false,
            dir,
        };
        cluster.initdb()?;
        cluster.write_auth()?;
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            cluster.port = free_port()?;
            cluster.write_settings()?;
            match cluster.pg_ctl_start() {
                Ok(()) => return Ok(cluster),
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error
            .unwrap_or_else(|| anyhow!("no start attempt was made"))
            .context(format!(
                "starting a private PostgreSQL failed {START_ATTEMPTS} times"
            )))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn host(&self) -> &str {
        LOOPBACK
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres` (trust auth), with
    /// the password when the cluster has one. No TLS parameters: add
    /// `?sslmode=…` (see [`PrivatePostgres::ca_file`]).
    pub fn url(&self) -> String {
        let password = self
            .settings
            .password
            .as_ref()
            .map(|p| format!(":{p}"))
            .unwrap_or_default();
        format!(
            "postgres://{CLUSTER_USER}{password}@{LOOPBACK}:{}/postgres",
            self.port
        )
    }

    /// The CA that signed the cluster's certificate (TLS clusters only).
    pub fn ca_file(&self) -> Option<&Path> {
        self.ca.as_ref().map(TestCa::ca_file)
    }

    /// The last lines of the server log, for assertion messages.
    pub fn log_tail(&self) -> String {
        tail(&self.log, TAIL_LINES)
    }

    /// Whether the server was started and not stopped since.
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Fast shutdown (`pg_ctl stop -m fast`: clients are disconnected); waits
    /// until the server is gone. A no-op when stopped.
    pub fn stop(&mut self) -> Result<()> {
        self.pg_ctl_stop("fast")
    }

    /// Crash-like shutdown (`pg_ctl stop -m immediate`): no checkpoint.
    pub fn kill(&mut self) -> Result<()> {
        self.pg_ctl_stop("immediate")
    }

    /// Starts the same cluster again on the same port (stopping it first if
    /// it is running) and waits until it accepts connections.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.pg_ctl_start().context(format!(
            "restarting the private PostgreSQL on port {}",
            self.port
        ))
    }

    fn initdb(&self) -> Result<()> {
        let mut command = self.command("initdb");
        command.arg("-D").arg(&self.data).args([
            "-U",
            CLUSTER_USER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        if let Some(password) = &self.settings.password {
            let pwfile = self.dir.path().join("pwfile");
            fs::write(&pwfile, format!("{password}\n"))
                .with_context(|| format!("writing {}", pwfile.display()))?;
            self.give_to_cluster_user(&pwfile)?;
            command.arg(format!("--pwfile={}", pwfile.display()));
        }
        let output = output_within(&mut command, None, COMMAND_LIMIT, "initdb")?;
        check(&output, "initdb")
    }

    /// `pg_hba.conf` for the settings, and the TLS files: local sockets
    /// trusted; TCP over TLS only (`hostssl`) when TLS is on, with a
    /// password when one is set.
    fn write_auth(&mut self) -> Result<()> {
        let method = if self.settings.password.is_some() {
            "scram-sha-256"
        } else {
            "trust"
        };
        let mut hba = String::from("# private cluster of one idem test\nlocal all all trust\n");
        if self.settings.tls {
            hba.push_str(&format!(
                "hostssl all all 127.0.0.1/32 {method}\nhostssl all all ::1/128 {method}\n\
                 host all all 127.0.0.1/32 reject\nhost all all ::1/128 reject\n"
            ));
            let ca = TestCa::create(self.dir.path(), "idem test PostgreSQL CA")?;
            let server = ca.issue_server("pg-server")?;
            // PostgreSQL refuses a key others can read.
            self.give_to_cluster_user(&server.cert)?;
            self.give_to_cluster_user(&server.key)?;
            fs::set_permissions(&server.key, fs::Permissions::from_mode(0o600))
                .with_context(|| format!("chmod 600 {}", server.key.display()))?;
            let tls = format!(
                "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
                server.cert.display(),
                server.key.display()
            );
            let path = self.data.join("idem_tls.conf");
            fs::write(&path, tls).with_context(|| format!("writing {}", path.display()))?;
            self.give_to_cluster_user(&path)?;
            self.append_include("include 'idem_tls.conf'\n")?;
            self.ca = Some(ca);
        } else {
            hba.push_str(&format!(
                "host all all 127.0.0.1/32 {method}\nhost all all ::1/128 {method}\n"
            ));
        }
        let path = self.data.join("pg_hba.conf");
        fs::write(&path, hba).with_context(|| format!("writing {}", path.display()))?;
        self.give_to_cluster_user(&path)
    }

    /// Makes a file we wrote readable by the cluster when it runs as
    /// `postgres` (we are root); a no-op otherwise.
    fn give_to_cluster_user(&self, path: &Path) -> Result<()> {
        if self.runuser.is_some() {
            chown_to_cluster_user(path)?;
        }
        Ok(())
    }

    fn append_include(&self, include: &str) -> Result<()> {
        let main_conf = self.data.join("postgresql.conf");
        let current = fs::read_to_string(&main_conf)
            .with_context(|| format!("reading {}", main_conf.display()))?;
        if !current.contains(include) {
            OpenOptions::new()
                .append(true)
                .open(&main_conf)
                .and_then(|mut file| file.write_all(format!("\n{include}").as_bytes()))
                .with_context(|| format!("appending an include to {}", main_conf.display()))?;
        }
        Ok(())
    }

    /// Our settings live in their own file, rewritten for each port tried;
    /// `postgresql.conf` includes it once.
    fn write_settings(&self) -> Result<()> {
        let settings = format!(
            "# private cluster of one idem test\n\
             listen_addresses = '{LOOPBACK}'\n\
             port = {port}\n\
             unix_socket_directories = '{socket_dir}'\n\
             max_connections = 200\n\
             fsync = off\n\
             synchronous_commit = off\n\
             full_page_writes = off\n\
             logging_collector = off\n",
            port = self.port,
            socket_dir = self.dir.path().display(),
        );
        let settings_path = self.data.join("idem_harness.conf");
        fs::write(&settings_path, settings)
            .with_context(|| format!("writing {}", settings_path.display()))?;
        self.append_include("include 'idem_harness.conf'\n")
    }

    fn pg_ctl_start(&mut self) -> Result<()> {
        let mut command = self.command("pg_ctl");
        command
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(&self.log)
            .args(["-w", "-t", PG_CTL_TIMEOUT_SECS, "start"]);
        let output = output_within(&mut command, None, COMMAND_LIMIT, "pg_ctl start")?;
        if let Err(e) = check(&output, "pg_ctl start") {
            // A postmaster that failed half-way must not linger.
            let _ = self.pg_ctl("immediate");
            return Err(e.context(format!(
                "private PostgreSQL on port {} did not start\n--- {} ---\n{}",
                self.port,
                self.log.display(),
                self.log_tail()
            )));
        }
        self.running = true;
        if !accepts_tcp(loopback_addr(self.port), Duration::from_secs(5)) {
            bail!(
                "private PostgreSQL started but does not accept TCP on port {}\n--- log ---\n{}",
                self.port,
                self.log_tail()
            );
        }
        Ok(())
    }

    fn pg_ctl_stop(&mut self, mode: &str) -> Result<()> {
        if !self.running {
            return Ok(());
        }
        self.pg_ctl(mode)?;
        self.running = false;
        Ok(())
    }

    fn pg_ctl(&self, mode: &str) -> Result<()> {
        let mut command = self.command("pg_ctl");
        command.arg("-D").arg(&self.data).args([
            "-m",
            mode,
            "-w",
            "-t",
            PG_CTL_TIMEOUT_SECS,
            "stop",
        ]);
        let what = format!("pg_ctl stop -m {mode}");
        let output = output_within(&mut command, None, COMMAND_LIMIT, &what)?;
        check(&output, &format!("pg_ctl stop -m {mode}"))
    }

    /// `bin_dir/program`, run as the cluster user when we are root, from the
    /// cluster's directory (the `postgres` user may not read our cwd).
    fn command(&self, program: &str) -> Command {
        let program = self.bin_dir.join(program);
        let mut command = match &self.runuser {
            Some(runuser) => {
                let mut c = Command::new(runuser);
                c.args(["-u", CLUSTER_USER, "--"]).arg(program);
                c
            }
            None => Command::new(program),
        };
        command
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .env("LC_ALL", "C");
        command
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if let Err(e) = self.pg_ctl_stop("immediate") {
            eprintln!(
                "idem-tests: stopping private PostgreSQL on port {} failed: {e:#}",
                self.port
            );
        }
    }
}

fn check(output: &Output, what: &str) -> Result<()> {
    if output.status.success() {
        return Ok(());
    }
    bail!(
        "{what} failed with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout).trim_end(),
        String::from_utf8_lossy(&output.stderr).trim_end()
    )
}

/// The directory holding `initdb`, `pg_ctl` and `postgres`: from `PATH`
/// (following symlinks such as Debian's wrappers in /usr/local/bin), else the
/// newest `/usr/lib/postgresql/<version>/bin`.
fn find_bin_dir() -> Result<PathBuf> {
    let complete = |dir: &Path| {
        ["initdb", "pg_ctl", "postgres"]
            .iter()
            .all(|b| is_executable(&dir.join(b)))
    };
    if let Some(initdb) = find_binary("initdb", &[]) {
        if let Some(dir) = fs::canonicalize(&initdb)
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf))
        {
            if complete(&dir) {
                return Ok(dir);
            }
        }
    }
    let mut versioned: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| complete(dir))
        .collect();
    versioned.sort();
    versioned
        .pop()
        .map(|(_, dir)| dir)
        .ok_or_else(|| anyhow!(MISSING_BINARIES))
}

fn chown_to_cluster_user(dir: &Path) -> Result<()> {
    let user = nix::unistd::User::from_name(CLUSTER_USER)
        .context("looking up the `postgres` user")?
        .ok_or_else(|| {
            anyhow!(
                "running as root, a private PostgreSQL must run as user `postgres`, which does \
                 not exist: install it with `apt-get install postgresql` or run scripts/test"
            )
        })?;
    std::os::unix::fs::chown(dir, Some(user.uid.as_raw()), Some(user.gid.as_raw()))
        .with_context(|| format!("giving {} to the `postgres` user", dir.display()))
}
