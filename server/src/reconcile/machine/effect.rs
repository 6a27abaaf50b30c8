//! What goes into the engine's state machine and what comes out: commands,
//! the time, effects for the caller to carry out, settings and live numbers.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use idem_protocol::{DeviceId, Generation};
use serde_json::Value;

use super::Record;
use crate::reconcile::policy::RetryPolicy;
use crate::reconcile::run::{RunSpec, Trigger};

/// The time, as the caller read it: monotonic for deadlines, wall clock
/// for what is stored.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    pub at: Instant,
    pub wall: DateTime<Utc>,
}

/// What the rest of the server tells the engine.
#[derive(Debug)]
pub enum EngineCommand {
    /// A run was committed; decide its targets.
    StartRun(RunSpec),
    /// A run the engine asked for ([`Effect::StartRun`]) could not be
    /// committed: its devices wait a debounce window and are tried again.
    RunNotStarted {
        trigger: Trigger,
        targets: Vec<DeviceId>,
    },
    /// These devices' reports were committed and are in the fleet cache.
    ReportsApplied(Vec<DeviceId>),
    /// These devices' connection state changed (committed, in the cache).
    Connectivity(Vec<(DeviceId, bool)>),
    /// Start a run over every device that has desired state.
    ReconcileAll(Trigger),
    /// These devices' desired state changed without a run (registration
    /// with a spec): their retained desired message must follow.
    DesiredChanged(Vec<DeviceId>),
    /// These devices were deleted (committed, gone from the cache): their
    /// attempts end `skipped`, nothing more is published to them.
    DevicesRemoved(Vec<DeviceId>),
    /// Exemptions of these devices ended (committed, in the cache): a
    /// drifted one is reconciled like any drifted device.
    ExemptionsEnded(Vec<DeviceId>),
    /// Exemptions now cover these devices (committed, in the cache): an
    /// attempt on one that has not pushed yet ends `skipped` (`exempt`).
    ExemptionsStarted(Vec<DeviceId>),
    /// The fields devices own changed (committed, in the cache, with the
    /// digests that follow). `changed`: a device that differs now is
    /// reconciled like any drifted device, a drifted one that matches now
    /// is converged. `republish`: their retained desired message held a
    /// path now owned, or lacked one no longer owned; it is published again
    /// at its generation.
    OwnedChanged {
        changed: Vec<DeviceId>,
        republish: Vec<DeviceId>,
    },
    /// Refresh every retained desired message that is behind (start-up).
    SyncRetained,
    /// The broker may have dropped messages for the server: ask every
    /// device not known to be offline (its status may be the message that
    /// was dropped) and not heard from since for a report, paced.
    Recheck,
}

/// Why a device is asked for a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskReason {
    /// A run must decide it and it never reported.
    Decide,
    /// Its last report is older than `stale_after` (resync).
    Stale,
    /// It came online and did not report within `missing_report_after`.
    Missing,
    /// A recheck after the broker may have dropped messages.
    Recheck,
}

impl AskReason {
    /// The label value of `idem_devices_asked_to_report_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            AskReason::Decide => "decide",
            AskReason::Stale => "stale",
            AskReason::Missing => "missing",
            AskReason::Recheck => "recheck",
        }
    }

    pub const ALL: [AskReason; 4] = [
        AskReason::Decide,
        AskReason::Stale,
        AskReason::Missing,
        AskReason::Recheck,
    ];
}

/// Why desired state is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishReason {
    /// An attempt pushes it and waits for the device's confirmation.
    Attempt,
    /// The retained message fell behind; no attempt waits on it.
    RefreshRetained,
}

/// What the caller carries out, in order.
#[derive(Debug)]
pub enum Effect {
    /// Publish `{generation, spec}` retained on the device's desired topic.
    Publish {
        device: DeviceId,
        generation: Generation,
        spec: Arc<Value>,
        reason: PublishReason,
    },
    /// Send a `get` to the device.
    AskForReport { device: DeviceId, reason: AskReason },
    /// Commit a run the engine starts itself, then hand it back as
    /// [`EngineCommand::StartRun`] (or [`EngineCommand::RunNotStarted`]).
    StartRun {
        trigger: Trigger,
        targets: Vec<DeviceId>,
    },
    /// Write this in one transaction, apply its device changes to the fleet
    /// cache once committed, then call [`Machine::record_written`]. Always
    /// the last effect of a call: the machine is not called again before.
    /// The runs in its `completed` ended with its outcomes: mark them
    /// completed and announce them with the counts they carry.
    Record(Record),
}

/// Engine tunables (from the configuration).
#[derive(Debug, Clone)]
pub struct EngineSettings {
    pub push_timeout: Duration,
    pub retry: RetryPolicy,
    /// Pushes per second; `None` = unlimited.
    pub push_rate: Option<NonZeroU32>,
    /// Pushes awaiting confirmation at once.
    pub max_in_flight: usize,
    /// Drift and reconnect triggers within this window make one run.
    pub debounce: Duration,
    /// Periodic full re-check; `None` = off.
    pub resync_interval: Option<Duration>,
    /// At resync, devices whose last report is older than this are asked for a new one.
    pub stale_after: Duration,
    /// A device that came online and sent no report for this long is
    /// asked for one; `None` = never.
    pub missing_report_after: Option<Duration>,
    /// Asks per second of a recheck; `None` = rechecks off.
    pub recheck_rate: Option<NonZeroU32>,
}

/// Live numbers for the API and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MachineStats {
    pub queued_pushes: usize,
    pub pushes_in_flight: usize,
    pub attempts_in_flight: usize,
    pub rollouts: RolloutStats,
}

/// The unfinished rollouts the machine carries, summed: how many are in
/// each state and how far their current waves are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RolloutStats {
    pub running: u64,
    pub paused_gate: u64,
    pub paused_manual: u64,
    pub paused_approval: u64,
    pub paused_timed: u64,
    /// Devices in the open waves of each rollout (the current one, and one
    /// handed over to it still waiting for answers), and how many of them
    /// have their outcome.
    pub wave_devices: u64,
    pub wave_decided: u64,
    /// Devices of later waves still to be pushed.
    pub waiting: u64,
}

/// What made the server suspect that the broker dropped messages for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecheckTrigger {
    /// The broker's `$SYS` dropped counter rose.
    BrokerDropped,
    /// The session came back empty, or after a long absence.
    SessionLost,
    /// An ingest write was held longer than `--recheck-after-stall`.
    IngestStalled,
}

impl RecheckTrigger {
    pub const ALL: [RecheckTrigger; 3] = [
        RecheckTrigger::BrokerDropped,
        RecheckTrigger::SessionLost,
        RecheckTrigger::IngestStalled,
    ];

    /// The label value of `idem_rechecks_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecheckTrigger::BrokerDropped => "broker_dropped",
            RecheckTrigger::SessionLost => "session_lost",
            RecheckTrigger::IngestStalled => "ingest_stalled",
        }
    }
}
