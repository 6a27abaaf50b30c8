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
//!
//! The steps live in one submodule each: `register` (devices, desired spec,
//! the after-register hook), `connect` (devices connected, first reports
//! stored), `run` (one run, followed to completion), `rollout` (the run as
//! a staged rollout, aborted when its gate pauses it) and `report` (the
//! verdict against the ground truth, with timings and latencies).

mod connect;
mod register;
mod report;
mod rollout;
mod run;

use std::time::{Duration, Instant};

use idem_protocol::TopicRoot;
use serde::Serialize;
use serde_json::json;

use crate::api::{ApiError, ClientAuth, ServerClient};
use crate::config::{BrokerAddr, FleetConfig};
use crate::error::SimError;
use crate::fleet::Fleet;
use crate::plan::Plan;

pub use report::{DemoReport, DemoTimings, FailedDevice, Latency};
pub use rollout::{DemoRollout, RolloutReport};
pub use run::label_selector;

use connect::connect_fleet;
use register::{register_fleet, run_hook};
use report::{judge, PhaseTimes};
use rollout::follow_rollout;
use run::{follow_run, refuse_early_pushes};

/// Label key the demo puts on its devices; the value names one demo.
pub const FLEET_LABEL: &str = "device-sim";
/// The `/metrics` series counting reports the server accepted.
pub const APPLIED_REPORTS: &str = "idem_reports_total{result=\"applied\"}";

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
    /// Run the change as a staged rollout in these waves (see `rollout`);
    /// `None`: one run over the whole fleet.
    pub rollout: Option<DemoRollout>,
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
            rollout: None,
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
        rollout,
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

    // 3. One run over the fleet, followed to completion; or a rollout,
    // aborted if its gate pauses it.
    let (run, trigger, run_time, rollout_report) = match &rollout {
        None => {
            let (run, trigger, run_time) = follow_run(
                &client,
                &run_body,
                devices,
                timeout,
                poll_interval,
                observer,
            )
            .await?;
            (run, trigger, run_time, None)
        }
        Some(rollout) => {
            let waits = (timeout, poll_interval);
            let (run, trigger, run_time, report) =
                follow_rollout(&client, &run_body, &plan, rollout, waits, observer).await?;
            (run, trigger, run_time, Some(report))
        }
    };

    // 4. Every device's outcome against the ground truth.
    let times = PhaseTimes {
        register: register_time,
        connect: connect_time,
        reports_counted: counted_time,
        reports_stored: reports_time,
        run: run_time,
    };
    let setting = (broker, topic_root, targeting);
    let report = judge(&client, &plan, &fleet, &run, trigger, times, setting)
        .await?
        .with_rollout(rollout_report);
    Ok(DemoRun { report, fleet })
}
