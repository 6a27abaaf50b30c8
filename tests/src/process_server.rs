//! The real `idem-server` command line as a child process, configured only
//! through `IDEM_*` environment variables, so fault tests can SIGKILL it like a
//! crash and start it again with the same identity (HTTP port, MQTT client id
//! `idem-server:{instance}`, database). Also a small JSON client for its API.
//!
//! It owns exactly one child process at a time and one temporary directory
//! (the server's log, stdout and stderr together); it must never signal any
//! other process. Dropping it SIGKILLs and reaps the child.

use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use idem_protocol::TopicRoot;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;
use tempfile::TempDir;

use crate::api_client::ApiClient;
use crate::support::{free_port, kill_and_reap, loopback_addr, tail};

/// How long a start gets to answer `GET /readyz` with 200 (migrations, cache
/// load, MQTT connect and subscribe, resumption of unfinished runs).
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `stop()` waits after SIGTERM before it sends SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Fresh ports tried when the server cannot bind its HTTP port.
const START_ATTEMPTS: usize = 3;
/// Log lines quoted in errors.
const TAIL_LINES: usize = 60;
/// What the server logs when it cannot bind `IDEM_HTTP_ADDR` (see `cli.rs`).
const BIND_FAILURE: &str = "cannot listen on";

/// An `idem-server` process owned by one test.
#[derive(Debug)]
pub struct ProcessServer {
    binary: PathBuf,
    /// Every variable the server gets besides `IDEM_HTTP_ADDR` (inherited
    /// `IDEM_*` variables are removed, so only these configure it).
    env: Vec<(String, String)>,
    port: u16,
    /// `None` while killed or stopped.
    child: Option<Child>,
    /// stdout and stderr of every start, appended, with a marker per start.
    log: PathBuf,
    /// How many times a process was spawned (for the log markers).
    spawns: usize,
    http: reqwest::Client,
    pub topic_root: TopicRoot,
    pub instance: String,
    /// The admin token the API client sends (`None` with
    /// `IDEM_INSECURE_NO_AUTH=true`).
    token: Option<String>,
    /// Held for its `Drop`, which removes the log.
    _dir: TempDir,
}

/// An admin token for a server that will run against `database_url`,
/// unless its environment turns authentication off.
async fn admin_token(
    database_url: &str,
    instance: &str,
    env: &[(String, String)],
) -> Result<Option<String>> {
    let insecure = env
        .iter()
        .any(|(k, v)| k == "IDEM_INSECURE_NO_AUTH" && v == "true");
    if insecure {
        return Ok(None);
    }
    let pool = sqlx::PgPool::connect(database_url)
        .await
        .context("connecting to the test database to create an admin token")?;
    // The server would apply them at start-up anyway; the token table must
    // exist before.
    idem_server::MIGRATOR
        .run(&pool)
        .await
        .context("migrating the test database")?;
    let name = format!("test-admin-{instance}");
    let token = crate::server::create_token(&pool, &name, "admin").await?;
    pool.close().await;
    Ok(Some(token))
}

impl ProcessServer {
    /// Spawns `binary` (the real server CLI) with `IDEM_DATABASE_URL`,
    /// `IDEM_MQTT_URL`, `IDEM_TOPIC_ROOT`, `IDEM_INSTANCE`, `IDEM_HTTP_ADDR`
    /// (a free port on 127.0.0.1) and `extra_env` (which may override any of
    /// them, e.g. `IDEM_PUSH_TIMEOUT` or `RUST_LOG`), and waits until
    /// `GET /readyz` answers 200.
    ///
    /// Keep `instance` fixed for the test: the MQTT client id `idem-server:{instance}`
    /// names the server's persistent session, which a restart must resume.
    pub async fn start(
        binary: &Path,
        database_url: &str,
        broker_url: &str,
        topic_root: &TopicRoot,
        instance: &str,
        extra_env: &[(&str, &str)],
    ) -> Result<Self> {
        let mut server = Self::new(
            binary,
            database_url,
            broker_url,
            topic_root,
            instance,
            extra_env,
        )?;
        server.token = admin_token(database_url, instance, &server.env).await?;
        server.port = free_port()?;
        server.start_on_some_port().await?;
        Ok(server)
    }

    /// Like [`ProcessServer::start`], but returns as soon as the process is
    /// spawned, ready or not: for tests of start-up failures and servers
    /// that must not become ready (read [`ProcessServer::log_text`],
    /// [`ProcessServer::wait_exit`], [`ProcessServer::readyz`]).
    pub fn launch(
        binary: &Path,
        database_url: &str,
        broker_url: &str,
        topic_root: &TopicRoot,
        instance: &str,
        extra_env: &[(&str, &str)],
    ) -> Result<Self> {
        let mut server = Self::new(
            binary,
            database_url,
            broker_url,
            topic_root,
            instance,
            extra_env,
        )?;
        server.port = free_port()?;
        server.spawn()?;
        Ok(server)
    }

    /// Waits up to `timeout` for the process to exit; `None` if it still runs.
    /// (A launched server's API client sends no token.)
    pub async fn wait_exit(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<std::process::ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            let Some(child) = self.child.as_mut() else {
                bail!("idem-server is not running");
            };
            if let Some(status) = child.try_wait().context("checking idem-server")? {
                self.child = None;
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn new(
        binary: &Path,
        database_url: &str,
        broker_url: &str,
        topic_root: &TopicRoot,
        instance: &str,
        extra_env: &[(&str, &str)],
    ) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("idem-server-")
            .tempdir()
            .context("creating a temporary directory for an idem-server process")?;
        let mut env: Vec<(String, String)> = vec![
            ("IDEM_DATABASE_URL".into(), database_url.into()),
            ("IDEM_MQTT_URL".into(), broker_url.into()),
            ("IDEM_TOPIC_ROOT".into(), topic_root.as_str().into()),
            ("IDEM_INSTANCE".into(), instance.into()),
            ("RUST_LOG".into(), "info".into()),
            ("NO_COLOR".into(), "1".into()),
        ];
        for (key, value) in extra_env {
            env.retain(|(k, _)| k != key);
            env.push(((*key).into(), (*value).into()));
        }
        Ok(Self {
            token: None,
            binary: binary.to_path_buf(),
            env,
            port: 0,
            child: None,
            log: dir.path().join("server.log"),
            spawns: 0,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .context("building the HTTP client")?,
            topic_root: topic_root.clone(),
            instance: instance.into(),
            _dir: dir,
        })
    }

    /// `127.0.0.1:PORT` of the HTTP API.
    pub fn addr(&self) -> SocketAddr {
        loopback_addr(self.port)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr(), path)
    }

    /// The admin token its API client sends (for SSE streams of its own).
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The running child's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the child process is still running (false once it exited,
    /// crashed, or was killed).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Crash: SIGKILL to the child (by its PID, nobody else), then reaps it.
    /// The server gets no chance to flush, ack or disconnect. A no-op when
    /// no child is running.
    pub fn kill(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = child.id();
        let exited = child
            .try_wait()
            .with_context(|| format!("checking idem-server (pid {pid})"))?;
        if let Some(status) = exited {
            self.note(&format!("pid {pid} had already exited with {status}"));
            return Ok(());
        }
        // `Child::kill` sends SIGKILL to this child's PID; it cannot hit a
        // recycled PID because the child is not reaped before `wait`.
        child
            .kill()
            .with_context(|| format!("sending SIGKILL to idem-server (pid {pid})"))?;
        child
            .wait()
            .with_context(|| format!("reaping idem-server (pid {pid})"))?;
        self.note(&format!("killed pid {pid} with SIGKILL"));
        Ok(())
    }

    /// Graceful stop: SIGTERM (the server flushes, acks and disconnects),
    /// SIGKILL if it has not exited within 10 s. Blocks.
    pub fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let raw = child.id();
        let pid =
            Pid::from_raw(i32::try_from(raw).context("the server's pid does not fit in an i32")?);
        if matches!(child.try_wait(), Ok(None)) {
            if let Err(e) = kill(pid, Signal::SIGTERM) {
                // ESRCH: it exited between the check and the signal.
                if e != nix::errno::Errno::ESRCH {
                    return Err(e).context(format!("sending SIGTERM to idem-server (pid {pid})"));
                }
            }
        }
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if child
                .try_wait()
                .with_context(|| format!("waiting for idem-server (pid {pid})"))?
                .is_some()
            {
                self.note(&format!("pid {pid} stopped after SIGTERM"));
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        child
            .kill()
            .with_context(|| format!("killing idem-server (pid {pid}) after SIGTERM"))?;
        child
            .wait()
            .with_context(|| format!("reaping idem-server (pid {pid})"))?;
        bail!(
            "idem-server (pid {pid}) did not exit within {STOP_GRACE:?} of SIGTERM\n{}",
            self.log_tail()
        )
    }

    /// Starts the server again with the same environment, on the same HTTP
    /// port when it is still free (else a fresh one), and waits until it is
    /// ready. Kills a running child first.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill()?;
        self.start_on_some_port().await
    }

    /// The whole log of every start (stdout and stderr).
    pub fn log_text(&self) -> String {
        fs::read(&self.log)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// The last lines of the log, for assertion messages.
    pub fn log_tail(&self) -> String {
        tail(&self.log, TAIL_LINES)
    }

    /// Log lines that report a panic (`thread '…' panicked at …`), from any
    /// start. A panic in a spawned task does not end the process, so this is
    /// how a test notices one.
    pub fn panics(&self) -> Vec<String> {
        self.log_text()
            .lines()
            .filter(|line| line.contains("panicked"))
            .map(str::to_owned)
            .collect()
    }

    /// `GET /readyz`: status and body.
    pub async fn readyz(&self) -> Result<(u16, Value)> {
        self.get("/readyz").await
    }

    /// Polls `GET /readyz` until it answers 200; fails early if the process
    /// exits.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match self
                .http
                .get(self.url("/readyz"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
            {
                Ok(response) if response.status().is_success() => return Ok(()),
                Ok(response) => {
                    let status = response.status();
                    let body = response.text().await.unwrap_or_default();
                    format!("{status}: {body}")
                }
                Err(e) => e.to_string(),
            };
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child
                    .try_wait()
                    .context("checking whether idem-server is running")?
                {
                    bail!(
                        "idem-server exited with {status} before it was ready\n--- log ---\n{}",
                        self.log_tail()
                    );
                }
            } else {
                bail!("idem-server is not running");
            }
            if Instant::now() > deadline {
                bail!(
                    "idem-server on {} not ready after {timeout:?} (last answer: {last})\n\
                     --- log ---\n{}",
                    self.addr(),
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A client for the API at the current port.
    pub fn api(&self) -> ApiClient {
        ApiClient::with_client(self.addr(), self.http.clone()).with_token(self.token.as_deref())
    }

    /// GET, returning status and JSON body (`Null` when empty).
    pub async fn get(&self, path: &str) -> Result<(u16, Value)> {
        self.api().get(path).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        self.api().post(path, body).await
    }

    /// `POST /v1/runs` with `body`; returns the run id.
    pub async fn start_run(&self, body: &Value) -> Result<String> {
        self.api().start_run(body).await
    }

    /// Polls `GET /v1/runs/{id}` until the run is completed; the error
    /// carries the server log's tail.
    pub async fn wait_run_completed(&self, run_id: &str, timeout: Duration) -> Result<Value> {
        self.api()
            .wait_run_completed(run_id, timeout)
            .await
            .with_context(|| format!("--- server log ---\n{}", self.log_tail()))
    }

    /// Spawns on `self.port`, falling back to fresh ports when the server
    /// reports that it cannot bind.
    async fn start_on_some_port(&mut self) -> Result<()> {
        let mut last_error = None;
        for attempt in 0..START_ATTEMPTS {
            if attempt > 0 {
                self.port = free_port()?;
            }
            let log_start = fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0);
            self.spawn()?;
            match self.wait_ready(READY_TIMEOUT).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    // Never leave a half-started child behind.
                    self.kill()?;
                    let this_start = fs::read(&self.log)
                        .map(|b| {
                            let from = usize::try_from(log_start).unwrap_or(0).min(b.len());
                            String::from_utf8_lossy(&b[from..]).into_owned()
                        })
                        .unwrap_or_default();
                    if !this_start.contains(BIND_FAILURE) {
                        return Err(e);
                    }
                    last_error = Some(e);
                }
            }
        }
        Err(last_error
            .unwrap_or_else(|| anyhow!("no start attempt was made"))
            .context(format!(
                "idem-server could not bind an HTTP port in {START_ATTEMPTS} attempts"
            )))
    }

    fn spawn(&mut self) -> Result<()> {
        self.spawns += 1;
        self.note(&format!(
            "start #{} on 127.0.0.1:{} ({})",
            self.spawns,
            self.port,
            self.binary.display()
        ));
        let stdout = append(&self.log)?;
        let stderr = stdout
            .try_clone()
            .context("duplicating the server log handle for stderr")?;
        let mut command = Command::new(&self.binary);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("IDEM_") {
                command.env_remove(key);
            }
        }
        command
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("IDEM_HTTP_ADDR", self.addr().to_string())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        let child = command
            .spawn()
            .with_context(|| format!("spawning {}", self.binary.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Appends a harness marker line to the log.
    fn note(&self, message: &str) {
        if let Ok(mut file) = append(&self.log) {
            // Best effort: the marker only helps reading the log.
            let _ = writeln!(file, "=== idem-tests: {message} ===");
        }
    }
}

impl Drop for ProcessServer {
    fn drop(&mut self) {
        kill_and_reap(self.child.take(), "idem-server");
    }
}

fn append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {} for the server's output", path.display()))
}
