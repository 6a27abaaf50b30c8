//! The newcomer demo as a library (`device-sim demo` is a thin CLI around
//! it, and the end-to-end tests call it directly): register a planned fleet
//! and its desired spec through the server's API, start the devices, wait
//! until every one is connected and its first report is stored, trigger one
//! run over the fleet, follow it to completion, and check every device's
//! outcome against the simulator's own ground truth.
//!
//! It owns the fleet it starts (handed back in [`DemoRun`]) and talks to the
//! server only through its public HTTP API; it never touches the server's
//! database. Progress goes to a [`DemoObserver`]; printing is the caller's.

use std::time::{Duration, Instant};

use idem_protocol::{OutcomeCounts, OutcomeKind, TopicRoot};
use serde::Serialize;
use serde_json::{json, Value};

use crate::api::{ApiError, ClientAuth, OutcomeRow, RunView, ServerClient};
use crate::check::{check_outcomes, GroundTruthCheck};
use crate::config::{BrokerAddr, FleetConfig};
use crate::error::SimError;
use crate::fleet::{Fleet, FleetStats};
use crate::plan::{format_count, ExpectedCounts, ExpectedOutcome, Plan};

/// Label key the demo puts on its devices; the value names one demo.
pub const FLEET_LABEL: &str = "device-sim";
/// The `/metrics` series counting reports the server accepted.
pub const APPLIED_REPORTS: &str = "idem_reports_total{result=\"applied\"}";
/// Devices named in an error message, at most.
const EXAMPLES: usize = 10;

/// The steps of a demo, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DemoPhase {
    /// Registering devices and their desired spec (`POST /v1/devices`).
    Register,
    /// Devices connecting to the broker.
    Connect,
    /// Waiting until the server has stored every device's first report.
    Report,
    /// The run, from trigger to completed.
    Run,
}

impl DemoPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            DemoPhase::Register => "register",
            DemoPhase::Connect => "connect",
            DemoPhase::Report => "report",
            DemoPhase::Run => "run",
        }
    }
}

/// Receives progress. Every method has a do-nothing default; `()` observes
/// nothing.
pub trait DemoObserver: Send + Sync {
    /// `phase` begins; `total` units of work (devices) are expected.
    fn phase_started(&self, _phase: DemoPhase, _total: u64) {}
    /// `done` of the phase's units are done.
    fn progress(&self, _phase: DemoPhase, _done: u64) {}
    /// `phase` ended after `elapsed`.
    fn phase_finished(&self, _phase: DemoPhase, _elapsed: Duration) {}
}

impl DemoObserver for () {}

/// Everything a demo needs.
#[derive(Debug, Clone)]
pub struct DemoSettings {
    /// The idem HTTP API, e.g. `http://127.0.0.1:8080`.
    pub server_url: String,
    pub plan: Plan,
    /// Broker, topic root and client tuning; its `devices` are the plan's.
    pub fleet: FleetConfig,
    /// Value of the [`FLEET_LABEL`] label on every device of this demo, so
    /// the run can target exactly them on a server that has other devices.
    pub label: String,
    /// Devices per `POST /v1/devices` request.
    pub register_chunk: usize,
    /// Longest wait for each of: connecting + first reports, and the run.
    pub timeout: Duration,
    /// How often the server is polled for progress.
    pub poll_interval: Duration,
    /// Operator token and CA for the API.
    pub auth: ClientAuth,
    /// A shell command run after registration, before the devices connect
    /// (e.g. to regenerate the broker's password file from the accounts the
    /// server just issued); the demo fails if it fails.
    pub after_register: Option<String>,
}

impl DemoSettings {
    /// Defaults: chunks of 1,000, a 5-minute timeout per phase, polling
    /// every 20 ms, and a label unique to this demo.
    pub fn new(
        server_url: impl Into<String>,
        plan: Plan,
        broker: BrokerAddr,
        topic_root: TopicRoot,
    ) -> Self {
        let fleet = FleetConfig::new(broker, topic_root, plan.devices.clone());
        Self {
            server_url: server_url.into(),
            plan,
            fleet,
            label: format!("demo-{}", crate::behaviour::seq_base_now()),
            register_chunk: 1_000,
            timeout: Duration::from_secs(300),
            poll_interval: Duration::from_millis(20),
            auth: ClientAuth::default(),
            after_register: None,
        }
    }
}

/// Why a demo could not produce a verdict. A verdict that the server got
/// something wrong is not an error: see [`DemoReport::passed`].
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error(transparent)]
    Sim(#[from] SimError),
    #[error("the demo needs at least one device")]
    NoDevices,
    #[error("the after-register command {command:?} failed: {reason}")]
    AfterRegister { command: String, reason: String },
    #[error(
        "the idem server at {url} is not ready (GET /readyz is not 200): check that it can \
         reach its database and the broker"
    )]
    NotReady { url: String },
    #[error(
        "{existing} of the demo's devices were already registered on the server (e.g. {example}); \
         their stored state, not the simulator's plan, would decide the outcome. Run the demo \
         against a fresh database (scripts/demo creates one) or pick another --id-prefix"
    )]
    AlreadyRegistered { existing: u64, example: String },
    #[error(
        "timed out after {timeout:?}: only {stored} of {wanted} devices have a stored first \
         report (does the server use topic root {topic_root:?} and the same broker?)"
    )]
    ReportTimeout {
        timeout: Duration,
        stored: usize,
        wanted: usize,
        topic_root: String,
    },
    #[error(
        "{count} devices received desired state before the run was triggered (e.g. {examples}): \
         retained messages from an earlier demo on topic root {topic_root:?}, or another run \
         touched them. Use a fresh broker, another --topic-root, or another --id-prefix"
    )]
    EarlyPush {
        count: usize,
        examples: String,
        topic_root: String,
    },
    #[error("run {run_id} targets {targets} devices, but the demo has {devices}")]
    TargetMismatch {
        run_id: String,
        targets: u64,
        devices: usize,
    },
    #[error(
        "run {run_id} did not complete within {timeout:?}: {done} of {targets} devices decided \
         ({summary})"
    )]
    RunTimeout {
        run_id: String,
        timeout: Duration,
        done: u64,
        targets: u64,
        summary: String,
    },
}

/// Latency percentiles over a set of devices (nearest-rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Latency {
    /// `None` for no samples.
    pub fn of(mut samples: Vec<Duration>) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let rank = |p: f64| {
            let index = ((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
            ms(samples[index])
        };
        Some(Self {
            samples: samples.len(),
            p50_ms: rank(0.50),
            p99_ms: rank(0.99),
            max_ms: ms(samples[samples.len() - 1]),
        })
    }
}

/// How long each step took (seconds unless the name says otherwise).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoTimings {
    pub register_s: f64,
    /// Fleet start → every device connected.
    pub connect_s: f64,
    /// Fleet start → the server's applied-reports counter covers every
    /// reporting device (it counts a report as it enters the batch that
    /// stores it, milliseconds before the commit).
    pub reports_counted_s: f64,
    /// Fleet start → every reporting device's first report confirmed stored
    /// through `GET /v1/devices` (includes paging through the fleet).
    pub reports_stored_s: f64,
    /// `POST /v1/runs` sent → run seen completed (simulator clock, polled).
    pub run_s: f64,
    /// The run's own duration as the server recorded it.
    pub server_run_ms: Option<u64>,
    /// Per provisioned device, simulator clock: run trigger → the device
    /// handed its confirming report to MQTT.
    pub convergence: Option<Latency>,
    /// Per provisioned device, simulator clock: desired state received →
    /// confirming report handed to MQTT (the device's own share).
    pub apply: Option<Latency>,
}

/// A device the server reported as failed, with its reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailedDevice {
    pub device: String,
    pub reason: Option<String>,
}

/// What a demo saw and concluded.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoReport {
    pub server: String,
    pub broker: String,
    pub topic_root: String,
    pub devices: usize,
    /// The counts the simulator's plan says a correct server reaches.
    pub expected: ExpectedCounts,
    pub expected_summary: String,
    pub run_id: String,
    /// `all` or `label` (when the server holds devices besides the demo's).
    pub targeting: &'static str,
    /// The run summary exactly as the server rendered it.
    pub summary: String,
    pub counts: OutcomeCounts,
    pub timings: DemoTimings,
    /// Devices the server reported failed, with reasons, by id.
    pub failed: Vec<FailedDevice>,
    /// Per-device comparison with the ground truth.
    pub check: GroundTruthCheck,
    pub fleet: FleetStats,
}

impl DemoReport {
    /// The server's summary equals the plan's, and every device's outcome
    /// matches the ground truth.
    pub fn passed(&self) -> bool {
        self.summary == self.expected_summary && self.check.passed()
    }
}

/// A finished demo: the report, and the fleet (still connected) for the
/// caller to shut down or keep running.
#[derive(Debug)]
pub struct DemoRun {
    pub report: DemoReport,
    pub fleet: Fleet,
}

/// Runs the demo described by `settings`. See the module docs for the steps.
pub async fn run_demo(
    settings: DemoSettings,
    observer: &dyn DemoObserver,
) -> Result<DemoRun, DemoError> {
    let DemoSettings {
        server_url,
        plan,
        fleet: mut fleet_config,
        label,
        register_chunk,
        timeout,
        poll_interval,
        auth,
        after_register,
    } = settings;
    let devices = plan.devices.len();
    if devices == 0 {
        return Err(DemoError::NoDevices);
    }
    let client = ServerClient::with_auth(&server_url, &auth)?;
    if !client.is_ready().await? {
        return Err(DemoError::NotReady { url: server_url });
    }
    let broker = fleet_config.broker.to_string();
    let topic_root = fleet_config.topic_root.to_string();

    // 1. Registration, with the desired spec, in chunks.
    let started = Instant::now();
    observer.phase_started(DemoPhase::Register, devices as u64);
    let issued = register_fleet(&client, &plan, &label, register_chunk, observer).await?;
    // The server issued broker accounts: the devices connect with them.
    if fleet_config.credentials.is_none() && !issued.is_empty() {
        fleet_config.credentials = Some(crate::config::Credentials::new(issued));
    }
    if let Some(command) = after_register {
        run_hook(&command).await?;
    }
    let register_time = started.elapsed();
    observer.phase_finished(DemoPhase::Register, register_time);
    let (targeting, run_body) = if client.device_count().await? == devices as u64 {
        ("all", json!({"all": true}))
    } else {
        ("label", label_selector(&label))
    };

    // 2. Connect, and wait for the first reports to be stored.
    let (fleet, connect_time, counted_time, reports_time) = connect_fleet(
        &client,
        &plan,
        fleet_config,
        &label,
        (timeout, poll_interval),
        &topic_root,
        observer,
    )
    .await?;

    refuse_early_pushes(&fleet, &topic_root)?;

    // 3. One run over the fleet, followed to completion.
    let (run, trigger, run_time) = follow_run(
        &client,
        &run_body,
        devices,
        timeout,
        poll_interval,
        observer,
    )
    .await?;

    // 4. Every device's outcome against the ground truth.
    let times = PhaseTimes {
        register: register_time,
        connect: connect_time,
        reports_counted: counted_time,
        reports_stored: reports_time,
        run: run_time,
    };
    let setting = (broker, topic_root, targeting);
    let report = judge(&client, &plan, &fleet, &run, trigger, times, setting).await?;
    Ok(DemoRun { report, fleet })
}

/// How long each phase of a demo took.
struct PhaseTimes {
    register: Duration,
    connect: Duration,
    reports_counted: Duration,
    reports_stored: Duration,
    run: Duration,
}

/// Every device's outcome of `run` against the ground truth, as the report.
/// `setting`: the broker, the topic root and how the run targeted the fleet.
async fn judge(
    client: &ServerClient,
    plan: &Plan,
    fleet: &Fleet,
    run: &RunView,
    trigger: Instant,
    times: PhaseTimes,
    (broker, topic_root, targeting): (String, String, &'static str),
) -> Result<DemoReport, DemoError> {
    let devices = plan.devices.len();
    let outcomes = client.outcomes(&run.id).await?;
    let check = check_outcomes(plan, &outcomes);
    let failed = failed_devices(&outcomes);
    let (convergence, apply) = latencies(fleet, plan, trigger);
    let expected = plan.expected_counts();
    let summary = if run.summary.is_empty() {
        run.counts.summary()
    } else {
        run.summary.clone()
    };
    Ok(DemoReport {
        server: client.base_url().to_owned(),
        broker,
        topic_root,
        devices,
        expected,
        expected_summary: expected.summary(),
        run_id: run.id.to_string(),
        targeting,
        summary,
        counts: run.counts,
        timings: DemoTimings {
            register_s: times.register.as_secs_f64(),
            connect_s: times.connect.as_secs_f64(),
            reports_counted_s: times.reports_counted.as_secs_f64(),
            reports_stored_s: times.reports_stored.as_secs_f64(),
            run_s: times.run.as_secs_f64(),
            server_run_ms: run.duration_ms.and_then(|ms| u64::try_from(ms).ok()),
            convergence,
            apply,
        },
        failed,
        check,
        fleet: fleet.stats(),
    })
}

/// Starts the fleet and waits until every device is connected and its
/// first report stored; returns the fleet and the connect, reports-counted
/// and reports-stored times.
async fn connect_fleet(
    client: &ServerClient,
    plan: &Plan,
    fleet_config: FleetConfig,
    label: &str,
    (timeout, poll_interval): (Duration, Duration),
    topic_root: &str,
    observer: &dyn DemoObserver,
) -> Result<(Fleet, Duration, Duration, Duration), DemoError> {
    let devices = plan.devices.len();
    let baseline = client.metric(APPLIED_REPORTS).await?.unwrap_or(0.0);
    let reporting: Vec<&str> = plan
        .devices
        .iter()
        .filter(|d| d.reports_on_connect() && !d.start_offline)
        .map(|d| d.id.as_str())
        .collect();
    let fleet = Fleet::start(fleet_config)?;
    let fleet_started = Instant::now();
    let deadline = fleet_started + timeout;
    observer.phase_started(DemoPhase::Connect, devices as u64);
    let connect_time =
        wait_connected(&fleet, devices, deadline, timeout, poll_interval, observer).await?;
    observer.phase_finished(DemoPhase::Connect, connect_time);
    observer.phase_started(DemoPhase::Report, reporting.len() as u64);
    let (counted_time, reports_time) = wait_reports_stored(
        client,
        &reporting,
        baseline,
        label,
        ReportWait {
            since: fleet_started,
            deadline,
            timeout,
            poll_interval,
            topic_root,
        },
        observer,
    )
    .await?;
    observer.phase_finished(DemoPhase::Report, reports_time);
    Ok((fleet, connect_time, counted_time, reports_time))
}

/// Registers the plan's devices with the desired spec, in chunks; returns
/// the broker passwords the server issued, if it issued any.
async fn register_fleet(
    client: &ServerClient,
    plan: &Plan,
    label: &str,
    register_chunk: usize,
    observer: &dyn DemoObserver,
) -> Result<std::collections::HashMap<idem_protocol::DeviceId, String>, DemoError> {
    let labels = json!({ FLEET_LABEL: label });
    let mut registered = 0u64;
    let mut issued = std::collections::HashMap::new();
    for chunk in plan.devices.chunks(register_chunk.max(1)) {
        let counts = client
            .register(
                chunk.iter().map(|d| d.id.as_str()),
                &labels,
                &plan.desired_spec,
            )
            .await?;
        let existing = chunk.len() as u64 - counts.created.min(chunk.len() as u64);
        if existing > 0 {
            return Err(DemoError::AlreadyRegistered {
                existing,
                example: chunk[0].id.to_string(),
            });
        }
        registered += chunk.len() as u64;
        for credential in counts.credentials {
            if let Ok(id) = idem_protocol::DeviceId::parse(&credential.id) {
                issued.insert(id, credential.password);
            }
        }
        observer.progress(DemoPhase::Register, registered);
    }
    Ok(issued)
}

/// Nothing may have been pushed yet: otherwise the plan no longer
/// describes the fleet (retained leftovers, or someone else's run).
fn refuse_early_pushes(fleet: &Fleet, topic_root: &str) -> Result<(), DemoError> {
    let early: Vec<String> = fleet
        .states()
        .into_iter()
        .filter(|s| s.desired_received > 0)
        .map(|s| s.id.to_string())
        .collect();
    if !early.is_empty() {
        return Err(DemoError::EarlyPush {
            count: early.len(),
            examples: examples(&early),
            topic_root: topic_root.to_owned(),
        });
    }

    Ok(())
}

/// Starts one run over the fleet and follows it to completion; returns it,
/// when it was triggered and how long it took.
async fn follow_run(
    client: &ServerClient,
    run_body: &Value,
    devices: usize,
    timeout: Duration,
    poll_interval: Duration,
    observer: &dyn DemoObserver,
) -> Result<(RunView, Instant, Duration), DemoError> {
    observer.phase_started(DemoPhase::Run, devices as u64);
    let trigger = Instant::now();
    let run_started = client.start_run(&run_body).await?;
    if run_started.targets != devices as u64 {
        return Err(DemoError::TargetMismatch {
            run_id: run_started.run_id.to_string(),
            targets: run_started.targets,
            devices,
        });
    }
    let run_deadline = trigger + timeout;
    let run = loop {
        let run = client.run(&run_started.run_id).await?;
        observer.progress(DemoPhase::Run, run.counts.total());
        if run.is_completed() {
            break run;
        }
        if Instant::now() >= run_deadline {
            return Err(DemoError::RunTimeout {
                run_id: run.id.to_string(),
                timeout,
                done: run.counts.total(),
                targets: run_started.targets,
                summary: run.counts.summary(),
            });
        }
        tokio::time::sleep(poll_interval).await;
    };
    let run_time = trigger.elapsed();
    observer.phase_finished(DemoPhase::Run, run_time);

    Ok((run, trigger, run_time))
}

/// The devices whose outcome is `failed`, with the reason.
fn failed_devices(outcomes: &[OutcomeRow]) -> Vec<FailedDevice> {
    outcomes
        .iter()
        .filter(|o| match o.outcome {
            Some(OutcomeKind::Failed) => true,
            Some(
                OutcomeKind::AlreadyConverged
                | OutcomeKind::Provisioned
                | OutcomeKind::Skipped
                | OutcomeKind::Superseded,
            )
            | None => false,
        })
        .map(|o| FailedDevice {
            device: o.device_id.clone(),
            reason: o.reason.clone(),
        })
        .collect()
}

async fn wait_connected(
    fleet: &Fleet,
    devices: usize,
    deadline: Instant,
    timeout: Duration,
    poll_interval: Duration,
    observer: &dyn DemoObserver,
) -> Result<Duration, DemoError> {
    let started = Instant::now();
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(poll_interval, fleet.wait_connected(devices, remaining)).await {
            Ok(Ok(())) => {
                observer.progress(DemoPhase::Connect, devices as u64);
                return Ok(started.elapsed());
            }
            Ok(Err(SimError::ConnectTimeout { connected, .. })) => {
                return Err(SimError::ConnectTimeout {
                    timeout,
                    wanted: devices,
                    connected,
                }
                .into())
            }
            Ok(Err(other)) => return Err(other.into()),
            Err(_) => observer.progress(DemoPhase::Connect, fleet.connected_count() as u64),
        }
    }
}

struct ReportWait<'a> {
    since: Instant,
    deadline: Instant,
    timeout: Duration,
    poll_interval: Duration,
    topic_root: &'a str,
}

/// Waits until the server has stored a report of every device in
/// `reporting`: first by watching the applied-reports counter (cheap), then
/// by confirming each device through `GET /v1/devices` (exact). Returns the
/// times since `wait.since` at which the counter, and the confirmation,
/// covered every device.
async fn wait_reports_stored(
    client: &ServerClient,
    reporting: &[&str],
    baseline: f64,
    label: &str,
    wait: ReportWait<'_>,
    observer: &dyn DemoObserver,
) -> Result<(Duration, Duration), DemoError> {
    let wanted = reporting.len();
    let mut stored = 0;
    let mut counted_at = None;
    loop {
        let applied = client
            .metric(APPLIED_REPORTS)
            .await?
            .map(|v| (v - baseline).max(0.0) as usize);
        // Without the counter, confirm through the API every time.
        let counter_says_done = applied.is_none_or(|n| n >= wanted);
        if counter_says_done && counted_at.is_none() {
            counted_at = Some(wait.since.elapsed());
        }
        if let Some(n) = applied {
            stored = stored.max(n.min(wanted));
        }
        if counter_says_done {
            let rows = client.devices_with_label(FLEET_LABEL, label).await?;
            let with_report: std::collections::HashSet<&str> = rows
                .iter()
                .filter(|r| r.reported.is_some())
                .map(|r| r.id.as_str())
                .collect();
            let confirmed = reporting
                .iter()
                .filter(|id| with_report.contains(*id))
                .count();
            stored = confirmed;
            if confirmed == wanted {
                observer.progress(DemoPhase::Report, wanted as u64);
                let confirmed_at = wait.since.elapsed();
                return Ok((counted_at.unwrap_or(confirmed_at), confirmed_at));
            }
        }
        observer.progress(DemoPhase::Report, stored as u64);
        if Instant::now() >= wait.deadline {
            return Err(DemoError::ReportTimeout {
                timeout: wait.timeout,
                stored,
                wanted,
                topic_root: wait.topic_root.to_owned(),
            });
        }
        tokio::time::sleep(wait.poll_interval).await;
    }
}

/// Convergence (trigger → confirming report) and apply (desired received →
/// confirming report) latencies of the devices expected to be provisioned.
fn latencies(fleet: &Fleet, plan: &Plan, trigger: Instant) -> (Option<Latency>, Option<Latency>) {
    let mut convergence = Vec::new();
    let mut apply = Vec::new();
    for id in plan.ids_expecting(ExpectedOutcome::Provisioned) {
        let Some(state) = fleet.state(&id) else {
            continue;
        };
        let Some(confirmed) = state.confirmed_at.filter(|at| *at >= trigger) else {
            continue;
        };
        convergence.push(confirmed - trigger);
        if let Some(received) = state.desired_at.filter(|at| *at <= confirmed) {
            apply.push(confirmed - received);
        }
    }
    (Latency::of(convergence), Latency::of(apply))
}

fn examples(ids: &[String]) -> String {
    let mut shown = ids
        .iter()
        .take(EXAMPLES)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > EXAMPLES {
        shown.push_str(&format!(
            " and {} more",
            format_count((ids.len() - EXAMPLES) as u64)
        ));
    }
    shown
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

/// The body for a run over every device the demo registered under `label`
/// (what [`run_demo`] sends when the server holds other devices too).
pub fn label_selector(label: &str) -> Value {
    json!({"selector": {"labels": { FLEET_LABEL: label }}})
}

/// Runs `command` with `sh -c`, failing on a non-zero exit.
async fn run_hook(command: &str) -> Result<(), DemoError> {
    let failed = |reason: String| DemoError::AfterRegister {
        command: command.to_owned(),
        reason,
    };
    let output = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| failed(e.to_string()))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(failed(format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles_use_the_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let l = Latency::of(samples).unwrap();
        assert_eq!(l.samples, 100);
        assert_eq!(l.p50_ms, 50.0);
        assert_eq!(l.p99_ms, 99.0);
        assert_eq!(l.max_ms, 100.0);
        let four = Latency::of(vec![
            Duration::from_millis(40),
            Duration::from_millis(10),
            Duration::from_millis(30),
            Duration::from_millis(20),
        ])
        .unwrap();
        assert_eq!((four.p50_ms, four.p99_ms), (20.0, 40.0));
        assert_eq!(Latency::of(Vec::new()), None);
    }

    #[test]
    fn error_examples_are_capped_at_ten_ids() {
        let ids: Vec<String> = (0..12).map(|i| format!("d{i}")).collect();
        assert_eq!(
            examples(&ids),
            "d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 and 2 more"
        );
        assert_eq!(examples(&ids[..2]), "d0, d1");
    }

    #[test]
    fn the_label_selector_names_the_demo_label() {
        assert_eq!(
            label_selector("demo-1"),
            json!({"selector": {"labels": {"device-sim": "demo-1"}}})
        );
    }
}
