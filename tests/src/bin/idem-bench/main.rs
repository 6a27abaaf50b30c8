//! `idem-bench`: the fleet-scale benchmark behind `scripts/bench` (not part of
//! the test suite). On this machine, in one run, against a real `idem-server`
//! process, a private Mosquitto and a fresh database, with a simulated fleet
//! in this process, it measures:
//!
//! * connect — the fleet connects and the server stores every first report;
//! * converged pass — a run over the fleet with 4 devices drifted;
//! * check-before-dispatch payoff — the same (re-drifted) fleet reconciled
//!   normally and then as a forced run: ratios of durations and publishes;
//! * full push — a fleet-wide desired change, every device pushed;
//! * ingest ratio — reports/s the server stores ÷ reports/s a bare counting
//!   subscriber on the same broker receives from the same burst;
//! * memory — server and simulator RSS, bytes per device above idle;
//!
//! plus the CPU seconds the server, broker, PostgreSQL and this process
//! spent in each step (from `/proc`), to say where the time goes. It prints a
//! table and writes JSON. Optionally it runs `perf record` over one step.
//!
//! A fleet above one process's open-file limit (`--devices 100000`) runs
//! behind edge brokers: one edge Mosquitto per 18,000 devices, bridged to
//! the core broker the server and the bare subscriber connect to, and one
//! fleet worker process per edge (`fleet.rs`; docs/ARCHITECTURE.md, "Edge
//! brokers").
//!
//! It owns every process it starts (brokers, server, fleet workers, perf)
//! and stops them by PID; its load is bounded (a fixed fleet and burst) and
//! local to 127.0.0.1.

mod fleet;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fleet::{bench_plan, slice, BenchFleet, DEVICES_PER_PROCESS, WORKER_FLAG};
use idem_device_sim::memory::{format_bytes, process_memory, MemoryField};
use idem_device_sim::{
    check_outcomes, format_count, BrokerAddr, ExpectedOutcome, Fleet, FleetConfig, RunView,
    ServerClient,
};
use idem_protocol::{Channel, TopicRoot};
use idem_tests::{raise_fd_limit, BridgeToCore, PrivateMosquitto, ProcessServer, TestDatabase};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde::Serialize;
use serde_json::{json, Value};

const USAGE: &str = "\
usage: idem-bench --server-bin PATH [--out FILE] [--devices N] [--drifted N]
                  [--heartbeats K] [--perf STEP] [--perf-scope server|all]
                  [--connect-rate R] [--max-connecting M] [--server-log FILE]
                  [--edges E] [--secure]

  --server-bin PATH   the idem-server binary to benchmark (release build)
  --out FILE          where to write the JSON results
  --devices N         fleet size (default 10000)
  --drifted N         devices drifted for the converged pass (default 4)
  --heartbeats K      reports per device in the ingest burst (default: a
                      burst of 100,000 reports, 10 each at 10,000 devices)
  --connect-rate R    new device connections per second (default 0 = all at once)
  --max-connecting M  connection attempts in flight (default 100; 0 = unbounded)
  --perf STEP         run `perf record -g` during STEP (connect, converged,
                      normal, forced, full_push, ingest); data in perf-STEP.data
  --perf-scope S      profile the server only (default) or all CPUs
  --server-log FILE   keep the server's log there (e.g. with
                      RUST_LOG=info,sqlx::query=debug for statement timings)
  --edges E           edge brokers bridged to the core broker, one fleet
                      worker process each (default: none up to 18,000
                      devices, else one per 18,000 devices)
  --secure            the deployment shape: TLS-only broker, the server and
                      every device (and the counting subscriber) on their own
                      password accounts, operator token on the API; without
                      it: plain MQTT, anonymous, no tokens (--insecure-no-auth)

Every IDEM_* variable (and RUST_LOG) in the environment is passed on to the
server.";

/// Linux's fixed `USER_HZ`: /proc reports CPU time in these ticks.
const TICKS_PER_SECOND: f64 = 100.0;
/// How often progress is polled.
const POLL: Duration = Duration::from_millis(10);
/// Longest wait for any one step.
const STEP_TIMEOUT: Duration = Duration::from_secs(300);
const APPLIED: &str = "idem_reports_total{result=\"applied\"}";
/// The bare counting subscriber's client id and (with `--secure`) user.
const COUNTER_USER: &str = "idem-bench-counter";
const PUSHES: &str = "idem_pushes_total";

#[derive(Debug, Clone)]
struct Args {
    server_bin: PathBuf,
    out: Option<PathBuf>,
    devices: usize,
    drifted: usize,
    heartbeats: u32,
    connect_rate: u32,
    max_connecting: usize,
    perf: Option<String>,
    edges: Option<usize>,
    secure: bool,
    perf_all: bool,
    server_log: Option<PathBuf>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        server_bin: PathBuf::new(),
        out: None,
        devices: 10_000,
        drifted: 4,
        heartbeats: 0,
        connect_rate: 0,
        max_connecting: idem_device_sim::DEFAULT_MAX_CONNECTING,
        perf: None,
        edges: None,
        secure: false,
        perf_all: false,
        server_log: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .with_context(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--server-bin" => args.server_bin = PathBuf::from(value()?),
            "--out" => args.out = Some(PathBuf::from(value()?)),
            "--devices" => args.devices = value()?.parse().context("--devices")?,
            "--drifted" => args.drifted = value()?.parse().context("--drifted")?,
            "--heartbeats" => args.heartbeats = value()?.parse().context("--heartbeats")?,
            "--connect-rate" => args.connect_rate = value()?.parse().context("--connect-rate")?,
            "--max-connecting" => {
                args.max_connecting = value()?.parse().context("--max-connecting")?
            }
            "--perf" => args.perf = Some(value()?),
            "--secure" => args.secure = true,
            "--edges" => args.edges = Some(value()?.parse().context("--edges")?),
            "--server-log" => args.server_log = Some(PathBuf::from(value()?)),
            "--perf-scope" => {
                args.perf_all = match value()?.as_str() {
                    "all" => true,
                    "server" => false,
                    other => bail!("--perf-scope {other:?}: use server or all"),
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if args.heartbeats == 0 {
        args.heartbeats = u32::try_from((100_000 / args.devices.max(1)).max(1)).unwrap_or(1);
    }
    if args.server_bin.as_os_str().is_empty() {
        bail!("--server-bin is required\n{USAGE}");
    }
    if args.devices == 0 || args.drifted == 0 || args.drifted > args.devices {
        bail!("need 0 < --drifted <= --devices");
    }
    if args.secure && args.edge_count() > 0 {
        bail!(
            "--secure runs on one broker: use at most {DEVICES_PER_PROCESS} devices and no --edges"
        );
    }
    if args.edge_count() > args.devices {
        bail!("--edges must not exceed --devices");
    }
    Ok(args)
}

impl Args {
    /// Edge brokers (and fleet worker processes) this run uses.
    fn edge_count(&self) -> usize {
        self.edges.unwrap_or(if self.devices > DEVICES_PER_PROCESS {
            self.devices.div_ceil(DEVICES_PER_PROCESS)
        } else {
            0
        })
    }

    /// Devices one simulator process holds.
    fn devices_per_process(&self) -> usize {
        self.devices.div_ceil(self.edge_count().max(1))
    }
}

// ---------- CPU accounting from /proc ----------

/// `utime + stime` of a process, in seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may
    // contain spaces: state ppid … utime(14th field) stime(15th).
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

/// `(pid, ppid, comm)` of every process.
fn processes() -> Vec<(u32, u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let open = stat.find('(')?;
            let close = stat.rfind(')')?;
            let comm = stat.get(open + 1..close)?.to_owned();
            let ppid = stat
                .get(close + 1..)?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid, comm))
        })
        .collect()
}

/// Machine-wide `(busy, steal)` CPU seconds from the first line of
/// `/proc/stat` (busy = user + nice + system + irq + softirq).
fn machine_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let at = |i: usize| fields.get(i).copied().unwrap_or(0.0);
    let busy = at(0) + at(1) + at(2) + at(5) + at(6);
    (busy / TICKS_PER_SECOND, at(7) / TICKS_PER_SECOND)
}

/// CPU seconds so far of the parts of the system under test.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Cpu {
    server: f64,
    /// The core broker and the edge brokers.
    broker: f64,
    /// Every `postgres` process on the machine (backends of the server and
    /// of this benchmark, plus background workers).
    postgres: f64,
    /// This process and the fleet workers: the simulated fleet (and the
    /// bare subscriber).
    simulator: f64,
    /// Everything else on the machine (busy CPU not spent by the four above):
    /// a noisy neighbour shows up here.
    other: f64,
    /// CPU time the hypervisor took away.
    steal: f64,
}

impl Cpu {
    fn minus(self, earlier: Cpu) -> Cpu {
        Cpu {
            server: self.server - earlier.server,
            broker: self.broker - earlier.broker,
            postgres: self.postgres - earlier.postgres,
            simulator: self.simulator - earlier.simulator,
            other: self.other - earlier.other,
            steal: self.steal - earlier.steal,
        }
    }
}

struct Probe {
    server_pid: u32,
    /// The core broker and every edge broker.
    broker_pids: Vec<u32>,
    /// Fleet worker processes (the fleet runs in this process without).
    worker_pids: Vec<u32>,
}

impl Probe {
    fn sample(&self) -> Cpu {
        let postgres = processes()
            .iter()
            .filter(|(_, _, comm)| comm == "postgres")
            .filter_map(|(pid, _, _)| cpu_seconds(*pid))
            .sum();
        let server = cpu_seconds(self.server_pid).unwrap_or(0.0);
        let broker = self
            .broker_pids
            .iter()
            .filter_map(|p| cpu_seconds(*p))
            .sum();
        let simulator = std::iter::once(std::process::id())
            .chain(self.worker_pids.iter().copied())
            .filter_map(cpu_seconds)
            .sum();
        let (busy, steal) = machine_cpu();
        Cpu {
            server,
            broker,
            postgres,
            simulator,
            // Cumulative totals; only differences between samples mean anything.
            other: busy - server - broker - postgres - simulator,
            steal,
        }
    }

    fn server_memory(&self, field: MemoryField) -> u64 {
        process_memory(Some(self.server_pid), field).unwrap_or(0)
    }
}

// ---------- results ----------

#[derive(Debug, Clone, Serialize)]
struct Step {
    name: &'static str,
    wall_s: f64,
    cpu_s: Cpu,
    /// Step-specific numbers.
    details: BTreeMap<&'static str, Value>,
}

#[derive(Debug, Clone, Serialize)]
struct Target {
    measure: &'static str,
    result: String,
    target: &'static str,
    met: Option<bool>,
}

// ---------- perf ----------

/// A `perf record` child covering one step; stopped with SIGINT by PID.
struct Perf {
    child: Child,
    output: PathBuf,
}

impl Perf {
    fn start(step: &str, server_pid: u32, all: bool) -> Result<Self> {
        let output = PathBuf::from(format!("perf-{step}.data"));
        let mut command = Command::new("perf");
        command
            .args(["record", "-F", "499", "-g", "-o"])
            .arg(&output);
        if all {
            command.arg("-a");
        } else {
            command.args(["-p", &server_pid.to_string()]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting `perf record` (is linux-perf installed?)")?;
        // perf needs a moment to attach before the step starts.
        std::thread::sleep(Duration::from_millis(500));
        Ok(Self { child, output })
    }

    fn stop(mut self) -> Result<PathBuf> {
        let pid = nix::unistd::Pid::from_raw(
            i32::try_from(self.child.id()).context("perf's pid does not fit in an i32")?,
        );
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT)
            .context("stopping perf record")?;
        self.child.wait().context("waiting for perf record")?;
        Ok(self.output)
    }
}

// ---------- the bare counting subscriber ----------

/// A minimal rumqttc client subscribed (QoS 1) to `{root}/+/reported` that
/// only counts publishes and remembers when the `target`-th arrived.
struct Counter {
    count: Arc<AtomicU64>,
    reached: Arc<Mutex<Option<Instant>>>,
    client: AsyncClient,
    task: tokio::task::JoinHandle<()>,
}

impl Counter {
    async fn start(
        broker: &PrivateMosquitto,
        root: &TopicRoot,
        target: u64,
        password: Option<&str>,
    ) -> Result<Self> {
        let mut options: MqttOptions = broker.mqtt_options(COUNTER_USER);
        options.set_keep_alive(Duration::from_secs(30));
        if let Some(password) = password {
            options.set_credentials(COUNTER_USER, password);
        }
        let (client, mut eventloop) = AsyncClient::new(options, 10);
        client
            .subscribe(root.filter(Channel::Reported), QoS::AtLeastOnce)
            .await
            .context("subscribing the counter")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let event = tokio::time::timeout_at(deadline.into(), eventloop.poll())
                .await
                .context("no SUBACK for the counter within 10 s")?
                .context("counter connection")?;
            if let Event::Incoming(Packet::SubAck(_)) = event {
                break;
            }
        }
        let count = Arc::new(AtomicU64::new(0));
        let reached = Arc::new(Mutex::new(None));
        let (c, r) = (Arc::clone(&count), Arc::clone(&reached));
        let task = tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                if let Event::Incoming(Packet::Publish(_)) = event {
                    if c.fetch_add(1, Ordering::Relaxed) + 1 == target {
                        *r.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
                    }
                }
            }
        });
        Ok(Self {
            count,
            reached,
            client,
            task,
        })
    }

    fn reached(&self) -> Option<Instant> {
        *self.reached.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn stop(self) {
        // Best effort: the task is aborted either way.
        let _ = self.client.disconnect().await;
        self.task.abort();
    }
}

// ---------- the benchmark ----------

/// What every step uses; shared, never mutated.
struct Bench {
    args: Args,
    client: ServerClient,
    db: TestDatabase,
    probe: Probe,
    /// Broker passwords by user name (`--secure`).
    passwords: Option<std::collections::HashMap<String, String>>,
}

/// What the steps produce.
#[derive(Default)]
struct Record {
    steps: Vec<Step>,
    perf_files: Vec<PathBuf>,
    /// The write floor's rows by `UNNEST` instead of `COPY`.
    write_floor_unnest: Option<Duration>,
}

impl Record {
    /// Adds `extra` to the last step's details.
    fn annotate_last(&mut self, extra: BTreeMap<&'static str, Value>) {
        if let Some(step) = self.steps.last_mut() {
            step.details.extend(extra);
        }
    }
}

impl Bench {
    /// Runs `f` as step `name`, with CPU accounting (and perf, if asked).
    async fn step<T, F>(
        &self,
        record: &mut Record,
        name: &'static str,
        f: F,
    ) -> Result<(T, Duration)>
    where
        F: std::future::Future<Output = Result<(T, BTreeMap<&'static str, Value>)>>,
    {
        let perf = match &self.args.perf {
            Some(step) if step == name => Some(Perf::start(
                name,
                self.probe.server_pid,
                self.args.perf_all,
            )?),
            Some(_) | None => None,
        };
        let cpu_before = self.probe.sample();
        let started = Instant::now();
        let result = f.await;
        let wall = started.elapsed();
        let cpu = self.probe.sample().minus(cpu_before);
        if let Some(perf) = perf {
            record.perf_files.push(perf.stop()?);
        }
        let (value, mut details) = result.with_context(|| format!("step {name}"))?;
        details.insert(
            "server_rss_after_bytes",
            json!(self.probe.server_memory(MemoryField::Rss)),
        );
        details.insert(
            "server_peak_rss_after_bytes",
            json!(self.probe.server_memory(MemoryField::PeakRss)),
        );
        eprintln!(
            "  {name:<10} {:>8.3} s   cpu: server {:.2} s, broker {:.2} s, postgres {:.2} s, simulator {:.2} s, other {:.2} s, steal {:.2} s",
            wall.as_secs_f64(),
            cpu.server,
            cpu.broker,
            cpu.postgres,
            cpu.simulator,
            cpu.other,
            cpu.steal
        );
        record.steps.push(Step {
            name,
            wall_s: wall.as_secs_f64(),
            cpu_s: cpu,
            details,
        });
        Ok((value, wall))
    }

    async fn metric(&self, series: &str) -> Result<f64> {
        Ok(self.client.metric(series).await?.unwrap_or(0.0))
    }

    async fn scalar(&self, sql: &str) -> Result<i64> {
        sqlx::query_scalar(sql)
            .fetch_one(self.db.pool())
            .await
            .with_context(|| format!("querying: {sql}"))
    }
}

/// Polls `GET /v1/runs/{id}` until completed.
async fn follow_run(client: &ServerClient, run_id: &uuid::Uuid) -> Result<RunView> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let run = client.run(run_id).await?;
        if run.is_completed() {
            return Ok(run);
        }
        if Instant::now() > deadline {
            bail!(
                "run {run_id} not completed after {STEP_TIMEOUT:?}: {}\n{}",
                diagnose_client(client).await,
                run.counts.summary()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until the applied-reports counter grew by `n` since `baseline`,
/// then until `confirm` (a SQL count) reaches `expected`.
async fn wait_stored(
    bench: &Bench,
    baseline: f64,
    n: u64,
    confirm: &str,
    expected: i64,
) -> Result<()> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let applied = bench.metric(APPLIED).await? - baseline;
        if applied >= n as f64 && bench.scalar(confirm).await? >= expected {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "server stored {applied} of {n} reports after {STEP_TIMEOUT:?} ({confirm} < {expected})"
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `pid, state, wait_event_type, wait_event, query` of a database session.
type Session = (
    i32,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// What the server and its database are doing, for a step that timed out:
/// the database sessions of the test database (state, lock waits, query)
/// and the server's in-flight gauges.
async fn diagnose(bench: &Bench) -> String {
    let sessions: Vec<Session> = sqlx::query_as(
        "SELECT pid, state, wait_event_type, wait_event, left(query, 160) \
             FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(bench.db.pool())
    .await
    .unwrap_or_default();
    let mut out = String::from("--- database sessions ---\n");
    for (pid, state, wait_type, wait, query) in sessions {
        out.push_str(&format!(
            "{pid} {} {}/{} {}\n",
            state.unwrap_or_default(),
            wait_type.unwrap_or_default(),
            wait.unwrap_or_default(),
            query.unwrap_or_default().replace('\n', " ")
        ));
    }
    out.push_str(&diagnose_client(&bench.client).await);
    out
}

/// The server's in-flight gauges and report counters from `/metrics`.
async fn diagnose_client(client: &ServerClient) -> String {
    let text = client.metrics_text().await.unwrap_or_default();
    let mut out = String::from("--- server gauges ---\n");
    for line in text.lines().filter(|l| {
        !l.starts_with('#')
            && [
                "idem_reports_total",
                "idem_attempts_in_flight",
                "idem_pushes_in_flight",
                "idem_push_queue_depth",
                "idem_mqtt_connected",
                "idem_event_log_lag_events",
                "idem_pushes_total",
            ]
            .iter()
            .any(|m| l.starts_with(m))
    }) {
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn details(pairs: &[(&'static str, Value)]) -> BTreeMap<&'static str, Value> {
    pairs.iter().cloned().collect()
}

fn run_details(run: &RunView, pushes: f64) -> BTreeMap<&'static str, Value> {
    details(&[
        ("summary", json!(run.summary)),
        ("server_duration_ms", json!(run.duration_ms)),
        ("publishes", json!(pushes)),
    ])
}

#[tokio::main]
async fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(WORKER_FLAG) {
        return fleet::run_worker(&argv[2..]).await;
    }
    let args = parse_args()?;
    let fd_limit = raise_fd_limit()?;
    let per_process = args.devices_per_process();
    if fd_limit < per_process as u64 + 200 {
        bail!(
            "open-file limit {fd_limit} is too low for {per_process} devices in one process: \
             raise it (ulimit -n) or spread the fleet over more edges (--edges)"
        );
    }
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!(
        "idem-bench ({}): {} devices, {} drifted, {} heartbeats each; load average {}",
        if args.secure {
            "secure: TLS, per-client accounts, operator token"
        } else {
            "plain: no TLS, anonymous, no tokens"
        },
        format_count(args.devices as u64),
        args.drifted,
        args.heartbeats,
        load_before
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );

    // The system under test: private broker, fresh database, server process.
    // With --secure, every client has its own password account, bound to its
    // client id (the harness adds `use_username_as_clientid true` to every
    // broker with a password file, as docs/OPERATIONS.md §9 does).
    let passwords = args.secure.then(|| {
        let secret = uuid::Uuid::new_v4().simple().to_string();
        let mut passwords: std::collections::HashMap<String, String> =
            bench_plan(args.devices, args.drifted)
                .map(|plan| {
                    plan.devices
                        .iter()
                        .map(|d| (d.id.to_string(), format!("{}-{secret}", d.id)))
                        .collect()
                })
                .unwrap_or_default();
        passwords.insert("idem-server".into(), format!("server-{secret}"));
        passwords.insert(COUNTER_USER.into(), format!("counter-{secret}"));
        passwords
    });
    // The server's queue sized for the fleet, as docs/OPERATIONS.md says.
    let queued = queued_messages(args.devices);
    let broker = match &passwords {
        None => PrivateMosquitto::builder().queue_limits(queued, 0).start(),
        Some(passwords) => {
            let accounts: Vec<(&String, &String)> = passwords.iter().collect();
            PrivateMosquitto::builder()
                .tls()
                .password_file(&accounts)
                .queue_limits(queued, 0)
                .start()
        }
    }
    .context("starting a private Mosquitto")?;
    let db = TestDatabase::create()
        .await
        .context("creating a fresh database")?;
    let root = TopicRoot::new(format!(
        "bench/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ))
    .context("topic root")?;
    let edges = start_edges(&args, &broker, &root)?;
    let mut server_env: Vec<(String, String)> = vec![
        // Unlimited push rate: the full push measures the server, not the pacer.
        ("IDEM_PUSH_RATE".into(), "0".into()),
        // Re-drifted devices must wait for our runs, not start their own.
        ("IDEM_DEBOUNCE".into(), "1h".into()),
        ("IDEM_RESYNC_INTERVAL".into(), "0".into()),
        ("RUST_LOG".into(), "warn,idem_server=info".into()),
    ];
    match (&passwords, broker.ca_file()) {
        (Some(passwords), Some(ca)) => {
            server_env.push(("IDEM_MQTT_CA_FILE".into(), ca.display().to_string()));
            server_env.push(("IDEM_MQTT_USERNAME".into(), "idem-server".into()));
            server_env.push((
                "IDEM_MQTT_PASSWORD".into(),
                passwords["idem-server"].clone(),
            ));
        }
        _ => server_env.push(("IDEM_INSECURE_NO_AUTH".into(), "true".into())),
    }
    for (key, value) in std::env::vars() {
        if (key.starts_with("IDEM_") && !key.starts_with("IDEM_BENCH")) || key == "RUST_LOG" {
            server_env.retain(|(k, _)| *k != key);
            server_env.push((key, value));
        }
    }
    let env_refs: Vec<(&str, &str)> = server_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut server = ProcessServer::start(
        &args.server_bin,
        db.url(),
        &broker.url(),
        &root,
        "bench",
        &env_refs,
    )
    .await
    .context("starting idem-server")?;
    let server_pid = server.pid().context("server pid")?;
    let broker_pids = processes()
        .into_iter()
        .filter(|(_, ppid, comm)| *ppid == std::process::id() && comm == "mosquitto")
        .map(|(pid, _, _)| pid)
        .collect();
    // Fleet workers wait for the connect step to start their devices.
    let edge_ports: Vec<u16> = edges.iter().map(PrivateMosquitto::port).collect();
    let workers = if edge_ports.is_empty() {
        None
    } else {
        Some(BenchFleet::spawn_workers(&edge_ports, &root, args.devices, args.drifted).await?)
    };
    let auth = idem_device_sim::ClientAuth {
        token: server.api().token().map(idem_device_sim::SecretString::new),
        ca_file: None,
    };
    let client = ServerClient::with_auth(&server.url(""), &auth)?;
    let bench = Bench {
        args: args.clone(),
        client,
        db,
        probe: Probe {
            server_pid,
            broker_pids,
            worker_pids: workers
                .as_ref()
                .map(BenchFleet::worker_pids)
                .unwrap_or_default(),
        },
        passwords,
    };
    // The core broker: the server and the bare subscriber, and the fleet
    // itself when it has no edges.
    let result = run_steps(&bench, &broker, workers, &root, &server_env, &load_before).await;
    let log_tail = server.log_tail();
    if let Some(path) = &args.server_log {
        std::fs::write(path, server.log_text())
            .with_context(|| format!("writing the server log to {}", path.display()))?;
    }
    let panics = server.panics();
    if let Err(e) = server.stop() {
        eprintln!("idem-bench: stopping the server: {e:#}");
    }
    drop(edges);
    drop(broker);
    match result {
        Ok(()) if panics.is_empty() => Ok(()),
        Ok(()) => bail!("the server panicked:\n{}", panics.join("\n")),
        Err(e) => Err(e.context(format!("--- server log ---\n{log_tail}"))),
    }
}

/// One edge broker per fleet worker, bridged to `core`: each bridge
/// subscribes at the core to its own devices' `desired` and `get` topics
/// only, so the core sends every message to one edge, not to all.
fn start_edges(
    args: &Args,
    core: &PrivateMosquitto,
    root: &TopicRoot,
) -> Result<Vec<PrivateMosquitto>> {
    let count = args.edge_count();
    if count == 0 {
        return Ok(Vec::new());
    }
    let plan = bench_plan(args.devices, args.drifted)?;
    (0..count)
        .map(|index| {
            let ids = plan.devices[slice(args.devices, index, count)]
                .iter()
                .map(|d| d.id.to_string())
                .collect();
            PrivateMosquitto::builder()
                .queue_limits(queued_messages(args.devices), 0)
                .bridge_to(BridgeToCore {
                    core_port: core.port(),
                    topic_root: root.as_str().to_owned(),
                    name: format!("idem-bench-edge-{index}"),
                    devices: Some(ids),
                })
                .start()
                .with_context(|| format!("starting edge broker {index}"))
        })
        .collect()
}

async fn run_steps(
    bench: &Bench,
    core: &PrivateMosquitto,
    workers: Option<BenchFleet>,
    root: &TopicRoot,
    server_env: &[(String, String)],
    load_before: &str,
) -> Result<()> {
    let n = bench.args.devices;
    let k = bench.args.heartbeats;
    let plan = bench_plan(n, bench.args.drifted)?;
    let drifted_ids = plan.ids_expecting(ExpectedOutcome::Provisioned);
    let expected_summary = plan.expected_counts().summary();

    tokio::time::sleep(Duration::from_secs(1)).await;
    let server_idle_rss = bench.probe.server_memory(MemoryField::Rss);
    let sim_idle_rss = workers
        .as_ref()
        .and_then(BenchFleet::workers_idle_rss)
        .unwrap_or_else(|| idem_device_sim::memory::rss_bytes().unwrap_or(0));
    let mut record = Record::default();

    // Registration (not a target; reported for context).
    register_step(bench, &plan, &mut record).await?;
    let (mut fleet, connected_s, connect_wall) =
        connect_step(bench, core, workers, root, &plan, &mut record).await?;
    // Steady state with the fleet connected: after the ingest settled.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let server_connected_rss = bench.probe.server_memory(MemoryField::Rss);

    // PostgreSQL's write floor for one run over this fleet, in this run:
    // one outcome row and one event row per device by COPY.
    // (The same rows by UNNEST, for comparison.)
    let floors = idem_tests::write_floor::measure(bench.db.pool(), n, 3).await?;
    let write_floor = floors.copy;
    println!(
        "  write floor   {:.3} s   ({} outcome rows + {} event rows by COPY, best of 3; by UNNEST {:.3} s)",
        write_floor.as_secs_f64(),
        format_count(n as u64),
        format_count(n as u64),
        floors.unnest.as_secs_f64()
    );
    record.write_floor_unnest = Some(floors.unnest);

    // Converged pass: a normal run over the fleet with `drifted` devices off.
    let all = json!({"all": true});
    let (converged, converged_wall, _) =
        run_step(bench, &mut record, "converged", RunStart::Run(&all)).await?;
    if converged.summary != expected_summary {
        bail!(
            "converged pass summary {:?}, expected {expected_summary:?}",
            converged.summary
        );
    }
    let outcomes = bench.client.outcomes(converged.id).await?;
    let truth = check_outcomes(&plan, &outcomes);
    if !truth.passed() {
        bail!(
            "converged pass: outcomes differ from the simulators' ground truth for {:?}",
            truth
                .mismatching_devices()
                .iter()
                .take(10)
                .collect::<Vec<_>>()
        );
    }
    println!(
        "  converged pass: {} (every one of {} outcomes matches the simulators' ground truth)",
        converged.summary,
        format_count(outcomes.len() as u64)
    );

    // Payoff: the same fleet, re-drifted, reconciled normally, then forced.
    redrift(bench, &mut fleet, &drifted_ids, &plan.desired_spec).await?;
    let (normal, normal_wall, normal_pushes) =
        run_step(bench, &mut record, "normal", RunStart::Run(&all)).await?;
    if normal.summary != expected_summary {
        bail!(
            "normal run summary {:?}, expected {expected_summary:?}",
            normal.summary
        );
    }
    redrift(bench, &mut fleet, &drifted_ids, &plan.desired_spec).await?;
    let forced_body = json!({"all": true, "force": true});
    let (_, forced_wall, forced_pushes) =
        run_step(bench, &mut record, "forced", RunStart::Run(&forced_body)).await?;

    // Full push: a fleet-wide desired change; every device is pushed to.
    let new_spec = json!({"firmware": "2.5.0", "version": "2025.2",
        "telemetry": {"interval_s": 30, "metrics": ["temp", "rssi", "battery"]},
        "features": {"ota": true, "debug_log": false}});
    let desired_body = json!({"all": true, "spec": new_spec});
    let (full, full_wall, full_pushes) = run_step(
        bench,
        &mut record,
        "full_push",
        RunStart::Desired(&desired_body),
    )
    .await?;
    if full.counts.provisioned != n as u64 {
        bail!("full push: {}", full.summary);
    }

    // Ingest: every device publishes K reports at once; the server's stored
    // rate against a bare subscriber's received rate, same burst.
    let (total, sub_rate, server_rate) =
        ingest_step(bench, core, root, &mut fleet, &mut record).await?;
    let ingest_ratio = server_rate / sub_rate;

    // Memory. The cache gauge is refreshed every 2 s.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let cache_bytes = bench.metric("idem_fleet_cache_bytes").await?;
    let server_peak = bench.probe.server_memory(MemoryField::PeakRss);
    let server_end_rss = bench.probe.server_memory(MemoryField::Rss);
    let sim_peak = fleet.peak_rss().await?;
    let stopping = Instant::now();
    let stats = fleet.shutdown().await?;
    let shutdown_s = stopping.elapsed().as_secs_f64();
    let per_device = |bytes: u64, idle: u64| bytes.saturating_sub(idle) as f64 / n as f64;
    let server_steady_per_device = per_device(server_connected_rss, server_idle_rss);
    let server_peak_per_device = per_device(server_peak, server_idle_rss);
    let sim_per_device = per_device(sim_peak, sim_idle_rss);

    let measured = Measured {
        n,
        k,
        total,
        connect_wall,
        connected_s,
        converged,
        converged_wall,
        write_floor,
        normal_wall,
        normal_server_ms: normal.duration_ms.unwrap_or(0),
        forced_wall,
        normal_pushes,
        forced_pushes,
        full_wall,
        full_pushes,
        sub_rate,
        server_rate,
        ingest_ratio,
        server_idle_rss,
        server_connected_rss,
        server_end_rss,
        server_peak,
        server_steady_per_device,
        server_peak_per_device,
        sim_idle_rss,
        sim_peak,
        sim_per_device,
        stats,
        shutdown_s,
        cache_bytes,
    };
    report(bench, load_before, server_env, &record, measured)
}

/// How a run step starts its run.
#[derive(Clone, Copy)]
enum RunStart<'a> {
    /// `POST /v1/runs` with this body.
    Run(&'a Value),
    /// `POST /v1/desired` with this body.
    Desired(&'a Value),
}

/// Step `name`: starts a run and follows it until completed. Returns the
/// run, the step's duration and the publishes the server made meanwhile.
async fn run_step(
    bench: &Bench,
    record: &mut Record,
    name: &'static str,
    start: RunStart<'_>,
) -> Result<(RunView, Duration, f64)> {
    let client = &bench.client;
    let pushes_before = bench.metric(PUSHES).await?;
    let (run, wall) = bench
        .step(record, name, async {
            let started = match start {
                RunStart::Run(body) => client.start_run(body).await?,
                RunStart::Desired(body) => client.set_desired(body).await?,
            };
            let run = follow_run(client, &started.run_id).await?;
            Ok((run, BTreeMap::new()))
        })
        .await?;
    let pushes = bench.metric(PUSHES).await? - pushes_before;
    record.annotate_last(run_details(&run, pushes));
    Ok((run, wall, pushes))
}

/// Registers the plan's devices, 1,000 per request.
async fn register_step(
    bench: &Bench,
    plan: &idem_device_sim::Plan,
    record: &mut Record,
) -> Result<()> {
    let labels = json!({"bench": "1"});
    let client = &bench.client;
    bench
        .step(record, "register", async {
            for chunk in plan.devices.chunks(1_000) {
                client
                    .register(
                        chunk.iter().map(|d| d.id.as_str()),
                        &labels,
                        &plan.desired_spec,
                    )
                    .await?;
            }
            Ok(((), details(&[("devices", json!(plan.devices.len()))])))
        })
        .await?;
    Ok(())
}

/// The in-process fleet's configuration: every device on `broker`, with
/// TLS and passwords when the benchmark is `--secure`.
fn in_process_config(
    bench: &Bench,
    broker: &PrivateMosquitto,
    root: &TopicRoot,
    plan: &idem_device_sim::Plan,
) -> Result<FleetConfig> {
    let broker_addr = match broker.ca_file() {
        Some(_) => BrokerAddr::tls(broker.host(), broker.port()),
        None => BrokerAddr::new(broker.host(), broker.port()),
    };
    let mut config = FleetConfig::new(broker_addr, root.clone(), plan.devices.clone());
    if let (Some(passwords), Some(ca)) = (&bench.passwords, broker.ca_file()) {
        config.tls = Some(idem_device_sim::SimTls::from_files(Some(ca), None)?);
        let devices: std::collections::HashMap<idem_protocol::DeviceId, String> = plan
            .devices
            .iter()
            .filter_map(|d| {
                passwords
                    .get(d.id.as_str())
                    .map(|p| (d.id.clone(), p.clone()))
            })
            .collect();
        config.credentials = Some(idem_device_sim::Credentials::new(devices));
    }
    config.connect_rate = bench.args.connect_rate;
    config.max_connecting = bench.args.max_connecting;
    Ok(config)
}

/// Connect: every device connected and its first report stored. The fleet
/// starts in this process on the core broker, or in the (already spawned)
/// `workers` on the edges. Returns the fleet, when all were connected and
/// the step's duration.
async fn connect_step(
    bench: &Bench,
    core: &PrivateMosquitto,
    workers: Option<BenchFleet>,
    root: &TopicRoot,
    plan: &idem_device_sim::Plan,
    record: &mut Record,
) -> Result<(BenchFleet, f64, Duration)> {
    let n = plan.devices.len();
    let baseline = bench.metric(APPLIED).await?;
    let config = match workers {
        Some(_) => None,
        None => Some(in_process_config(bench, core, root, plan)?),
    };
    let ((fleet, connected_s), connect_wall) = bench
        .step(record, "connect", async {
            let started = Instant::now();
            let mut fleet = match (workers, config) {
                (Some(mut workers), _) => {
                    workers.start().await?;
                    workers
                }
                (None, Some(config)) => BenchFleet::InProcess(Fleet::start(config)?),
                (None, None) => bail!("neither fleet workers nor a fleet configuration"),
            };
            let connected = async {
                fleet.wait_connected(n, STEP_TIMEOUT).await?;
                anyhow::Ok(started.elapsed().as_secs_f64())
            };
            let stored = wait_stored(
                bench,
                baseline,
                n as u64,
                "SELECT count(*) FROM devices WHERE reported_seq IS NOT NULL",
                n as i64,
            );
            let (connected, stored) = tokio::join!(connected, stored);
            let connected_s = connected?;
            stored?;
            let stats = fleet.stats().await?;
            Ok((
                (fleet, connected_s),
                details(&[
                    ("all_connected_s", json!(connected_s)),
                    ("connection_errors", json!(stats.connection_errors)),
                    ("connections", json!(stats.connections)),
                ]),
            ))
        })
        .await?;
    Ok((fleet, connected_s, connect_wall))
}

/// The ingest step: every device publishes `heartbeats` reports at once;
/// returns how many, and the rates a bare subscriber received and the
/// server stored them at.
async fn ingest_step(
    bench: &Bench,
    broker: &PrivateMosquitto,
    root: &TopicRoot,
    fleet: &mut BenchFleet,
    record: &mut Record,
) -> Result<(u64, f64, f64)> {
    let n = bench.args.devices;
    let k = bench.args.heartbeats;
    let total = n as u64 * u64::from(k);
    let counter_password = bench
        .passwords
        .as_ref()
        .and_then(|p| p.get(COUNTER_USER))
        .map(String::as_str);
    let counter = Counter::start(broker, root, total, counter_password).await?;
    let baseline = bench.metric(APPLIED).await?;
    let final_seqs: Vec<(String, i64)> = fleet
        .seqs()
        .await?
        .into_iter()
        .map(|(id, seq)| (id, seq.saturating_add(i64::from(k))))
        .collect();
    let ids: Vec<String> = final_seqs.iter().map(|(id, _)| id.clone()).collect();
    let seqs: Vec<i64> = final_seqs.iter().map(|(_, s)| *s).collect();
    let db = bench.db.pool().clone();
    let ingest = async {
        let t0 = Instant::now();
        fleet.request_reports(k).await?;
        // At least 120 s, and 1,000 reports/s more than that.
        let deadline = t0 + Duration::from_secs(120 + total / 1_000);
        let subscriber = async {
            loop {
                if let Some(at) = counter.reached() {
                    return anyhow::Ok(at - t0);
                }
                if Instant::now() > deadline {
                    bail!(
                        "the bare subscriber got {} of {total} reports",
                        counter.count.load(Ordering::Relaxed)
                    );
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        let server_stored = async {
            loop {
                let applied = bench.metric(APPLIED).await? - baseline;
                if applied >= total as f64 {
                    let stored: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM devices d \
                         JOIN UNNEST($1::text[], $2::int8[]) AS s(id, seq) ON d.id = s.id \
                         WHERE d.reported_seq >= s.seq",
                    )
                    .bind(&ids)
                    .bind(&seqs)
                    .fetch_one(&db)
                    .await
                    .context("counting stored final reports")?;
                    if stored == n as i64 {
                        return anyhow::Ok(t0.elapsed());
                    }
                }
                if Instant::now() > deadline {
                    bail!(
                        "the server applied {applied} of {total} reports\n{}",
                        diagnose(bench).await
                    );
                }
                tokio::time::sleep(POLL).await;
            }
        };
        let (subscriber, server_stored) = tokio::join!(subscriber, server_stored);
        let (subscriber, server_stored) = (subscriber?, server_stored?);
        let sub_rate = total as f64 / subscriber.as_secs_f64();
        let server_rate = total as f64 / server_stored.as_secs_f64();
        Ok((
            (sub_rate, server_rate),
            details(&[
                ("reports", json!(total)),
                ("subscriber_s", json!(subscriber.as_secs_f64())),
                ("server_stored_s", json!(server_stored.as_secs_f64())),
                ("subscriber_reports_per_s", json!(sub_rate)),
                ("server_reports_per_s", json!(server_rate)),
            ]),
        ))
    };
    let ((sub_rate, server_rate), _) = bench.step(record, "ingest", ingest).await?;
    counter.stop().await;
    Ok((total, sub_rate, server_rate))
}

/// Prints the targets table and writes the JSON results.
fn report(
    bench: &Bench,
    load_before: &str,
    server_env: &[(String, String)],
    record: &Record,
    measured: Measured,
) -> Result<()> {
    let targets = targets(bench, &measured);
    let &Measured {
        n,
        k,
        write_floor,
        server_idle_rss,
        server_connected_rss,
        server_end_rss,
        server_peak,
        sim_idle_rss,
        sim_peak,
        stats,
        shutdown_s,
        ..
    } = &measured;
    print_tables(&targets, &record.steps);
    for file in &record.perf_files {
        println!(
            "perf data: {} (perf report -i {} --no-children)",
            file.display(),
            file.display()
        );
    }

    let output = json!({
        "machine": {
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "load_average_before": load_before.trim(),
            "mem_total": std::fs::read_to_string("/proc/meminfo").ok()
                .and_then(|m| m.lines().next().map(str::to_owned)),
        },
        "settings": {
            "devices": n,
            "drifted": bench.args.drifted,
            "heartbeats_per_device": k,
            "secure": bench.args.secure,
            "server_env": server_env
                .iter()
                .map(|(k, v)| {
                    if k.contains("PASSWORD") {
                        format!("{k}=***")
                    } else {
                        format!("{k}={v}")
                    }
                })
                .collect::<Vec<_>>(),
            "simulator": match bench.args.edge_count() {
                0 => "one rumqttc v4 client per device in this process, on the core broker".to_owned(),
                edges => format!(
                    "one rumqttc v4 client per device in {edges} fleet worker processes, \
                     each on its own edge broker bridged to the core broker"
                ),
            },
            "edge_brokers": bench.args.edge_count(),
            "devices_per_process": bench.args.devices_per_process(),
            "connect_rate_per_s": bench.args.connect_rate,
            "max_connecting": bench.args.max_connecting,
        },
        "targets": targets,
        "steps": record.steps,
        "memory": {
            "server_idle_rss_bytes": server_idle_rss,
            "server_connected_rss_bytes": server_connected_rss,
            "server_end_rss_bytes": server_end_rss,
            "server_peak_rss_bytes": server_peak,
            "server_fleet_cache_bytes": measured.cache_bytes,
            "simulator_idle_rss_bytes": sim_idle_rss,
            "simulator_peak_rss_bytes": sim_peak,
        },
        "fleet": stats,
        "fleet_shutdown_s": shutdown_s,
        "write_floor_s": write_floor.as_secs_f64(),
        "write_floor_unnest_s": record.write_floor_unnest.map(|d| d.as_secs_f64()),
    });
    if let Some(out) = &bench.args.out {
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(out, serde_json::to_string_pretty(&output)?)
            .with_context(|| format!("writing {}", out.display()))?;
        println!("results written to {}", out.display());
    }
    Ok(())
}

/// The benchmark's targets and what this run measured for each.
fn targets(bench: &Bench, measured: &Measured) -> Vec<Target> {
    let &Measured {
        n,
        total,
        connect_wall,
        connected_s,
        ref converged,
        converged_wall,
        write_floor,
        normal_wall,
        normal_server_ms,
        forced_wall,
        normal_pushes,
        forced_pushes,
        full_wall,
        full_pushes,
        sub_rate,
        server_rate,
        ingest_ratio,
        server_idle_rss,
        server_connected_rss,
        server_peak,
        server_steady_per_device,
        server_peak_per_device,
        sim_peak,
        sim_per_device,
        cache_bytes,
        ..
    } = measured;
    // The table.
    let connect_s = connect_wall.as_secs_f64();
    let duration_ratio = forced_wall.as_secs_f64() / normal_wall.as_secs_f64();
    let publish_ratio = forced_pushes / normal_pushes.max(1.0);
    let full_rate = n as f64 / full_wall.as_secs_f64();
    let nf = format_count(n as u64);
    // The targets: connect 2 s per 10,000 devices; the ingest ratio
    // may fall to 0.9 at 100,000 (edges and bridges in between).
    let connect_limit = 2.0 * n as f64 / 10_000.0;
    let ingest_floor = if n >= 100_000 { 0.9 } else { 0.95 };
    vec![
        Target {
            measure: "connect: all connected + first reports stored",
            result: format!(
                "{connect_s:.2} s ({:.0} devices/s; all connected after {connected_s:.2} s; {})",
                n as f64 / connect_s,
                match (bench.args.connect_rate, bench.args.max_connecting) {
                    (0, 0) => "no ramp, unbounded".to_owned(),
                    (0, m) => format!("<= {m} connecting at once"),
                    (rate, 0) => format!("ramp {rate}/s"),
                    (rate, m) => format!("ramp {rate}/s, <= {m} at once"),
                }
            ),
            target: if n >= 100_000 {
                "<= 20 s"
            } else {
                "<= 2 s per 10,000"
            },
            met: Some(connect_s <= connect_limit),
        },
        Target {
            measure: "converged pass (trigger -> run completed)",
            result: format!(
                "{:.3} s (server {} ms): {}",
                converged_wall.as_secs_f64(),
                converged.duration_ms.unwrap_or(0),
                converged.summary
            ),
            target: "(reported)",
            met: None,
        },
        Target {
            measure: "converged pass (first run), server / write floor",
            result: {
                let server_ms = converged.duration_ms.unwrap_or(0) as f64;
                let floor_ms = write_floor.as_secs_f64() * 1_000.0;
                format!(
                    "{:.1}x (server {server_ms:.0} ms vs floor {floor_ms:.0} ms)",
                    server_ms / floor_ms.max(1.0)
                )
            },
            target: "<= 1.5x",
            met: Some(
                converged.duration_ms.unwrap_or(0) as f64
                    <= 1.5 * write_floor.as_secs_f64() * 1_000.0,
            ),
        },
        Target {
            measure: "re-confirming pass (normal run), server / write floor",
            result: {
                let floor_ms = write_floor.as_secs_f64() * 1_000.0;
                format!(
                    "{:.1}x (server {normal_server_ms} ms vs floor {floor_ms:.0} ms; converged rows not rewritten)",
                    normal_server_ms as f64 / floor_ms.max(1.0)
                )
            },
            target: "<= 1.5x",
            met: Some(normal_server_ms as f64 <= 1.5 * write_floor.as_secs_f64() * 1_000.0),
        },
        Target {
            measure: "full push (all drifted -> all provisioned)",
            result: format!(
                "{:.2} s, {full_rate:.0} pushes/s ({} publishes)",
                full_wall.as_secs_f64(),
                format_count(full_pushes as u64)
            ),
            target: ">= 10,000 pushes/s",
            met: Some(full_rate >= 10_000.0),
        },
        Target {
            measure: "ingest ratio (server stored / bare subscriber)",
            result: format!(
                "{ingest_ratio:.2} ({server_rate:.0} vs {sub_rate:.0} reports/s, {} reports)",
                format_count(total)
            ),
            target: if n >= 100_000 { ">= 0.9" } else { ">= 0.95" },
            met: Some(ingest_ratio >= ingest_floor),
        },
        Target {
            measure: "payoff: forced / normal run duration",
            result: format!(
                "{duration_ratio:.1}x ({:.3} s vs {:.3} s)",
                forced_wall.as_secs_f64(),
                normal_wall.as_secs_f64()
            ),
            target: ">= 10x",
            met: Some(duration_ratio >= 10.0),
        },
        Target {
            measure: "payoff: forced / normal publishes",
            result: format!(
                "{publish_ratio:.0}x ({} vs {})",
                format_count(forced_pushes as u64),
                format_count(normal_pushes as u64)
            ),
            target: ">= 2,500x",
            met: Some(publish_ratio >= 2_500.0),
        },
        Target {
            measure: "server RSS per device above idle (steady, after connect)",
            result: format!(
                "{} ({} idle -> {} with {nf} devices)",
                format_bytes(server_steady_per_device),
                format_bytes(server_idle_rss as f64),
                format_bytes(server_connected_rss as f64)
            ),
            target: "<= 1 KiB",
            met: Some(server_steady_per_device <= 1024.0),
        },
        Target {
            measure: "server peak RSS per device above idle (VmHWM)",
            result: format!(
                "{} (peak {})",
                format_bytes(server_peak_per_device),
                format_bytes(server_peak as f64)
            ),
            target: "<= 2 KiB",
            met: Some(server_peak_per_device <= 2048.0),
        },
        Target {
            measure: "server fleet cache per device (idem_fleet_cache_bytes)",
            result: format!(
                "{} ({} in all)",
                format_bytes(cache_bytes / n as f64),
                format_bytes(cache_bytes)
            ),
            target: "(reported)",
            met: None,
        },
        Target {
            measure: "simulator peak RSS (VmHWM), per device",
            result: format!(
                "{} ({} per device)",
                format_bytes(sim_peak as f64),
                format_bytes(sim_per_device)
            ),
            target: "(reported)",
            met: None,
        },
    ]
}

/// What `run_steps` measured, for the table and the JSON.
struct Measured {
    n: usize,
    k: u32,
    total: u64,
    connect_wall: Duration,
    connected_s: f64,
    converged: RunView,
    converged_wall: Duration,
    write_floor: Duration,
    normal_wall: Duration,
    /// The normal run's duration as the server measured it.
    normal_server_ms: i64,
    forced_wall: Duration,
    normal_pushes: f64,
    forced_pushes: f64,
    full_wall: Duration,
    full_pushes: f64,
    sub_rate: f64,
    server_rate: f64,
    ingest_ratio: f64,
    server_idle_rss: u64,
    server_connected_rss: u64,
    server_end_rss: u64,
    server_peak: u64,
    server_steady_per_device: f64,
    server_peak_per_device: f64,
    sim_idle_rss: u64,
    sim_peak: u64,
    sim_per_device: f64,
    stats: idem_device_sim::FleetStats,
    shutdown_s: f64,
    /// `idem_fleet_cache_bytes` at the end.
    cache_bytes: f64,
}

/// Makes `ids` run a spec other than desired again and waits until the
/// server has stored their reports.
async fn redrift(
    bench: &Bench,
    fleet: &mut BenchFleet,
    ids: &[idem_protocol::DeviceId],
    desired: &Value,
) -> Result<()> {
    fleet.redrift(ids, desired).await?;
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let off = bench
            .scalar(
                "SELECT count(*) FROM devices WHERE reported_digest IS DISTINCT FROM desired_digest",
            )
            .await?;
        if off >= ids.len() as i64 {
            // Let the engine see the reports before the next run starts.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("only {off} of {} re-drifted devices stored", ids.len());
        }
        tokio::time::sleep(POLL).await;
    }
}

fn print_tables(targets: &[Target], steps: &[Step]) {
    let width = targets.iter().map(|t| t.measure.len()).max().unwrap_or(10);
    println!();
    println!(
        "{:<width$} | {:<70} | {:<18} | met",
        "measure", "result", "target"
    );
    println!("{}", "-".repeat(width + 70 + 18 + 12));
    for t in targets {
        let met = match t.met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "-",
        };
        println!(
            "{:<width$} | {:<70} | {:<18} | {met}",
            t.measure, t.result, t.target
        );
    }
    println!();
    println!("where the time goes (CPU seconds per step; 2 cores = 2 CPU-s per wall second)");
    println!(
        "{:<10} | {:>8} | {:>8} | {:>8} | {:>8} | {:>9} | {:>6} | {:>6}",
        "step", "wall s", "server", "broker", "postgres", "simulator", "other", "steal"
    );
    for s in steps {
        let c = &s.cpu_s;
        println!(
            "{:<10} | {:>8.3} | {:>8.2} | {:>8.2} | {:>8.2} | {:>9.2} | {:>6.2} | {:>6.2}",
            s.name, s.wall_s, c.server, c.broker, c.postgres, c.simulator, c.other, c.steal
        );
    }
    println!();
}

/// `max_queued_messages` for a fleet of `devices` (the formula of
/// `idem_server::broker_sizing`), as the broker's `u32` setting.
fn queued_messages(devices: usize) -> u32 {
    let queued = idem_server::broker_sizing::queued_messages_for(devices as u64);
    u32::try_from(queued).unwrap_or(u32::MAX)
}
