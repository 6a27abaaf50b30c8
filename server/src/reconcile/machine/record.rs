//! What one write of the engine's results holds: outcomes, attempt
//! history, events, one merged change per device row, the runs that
//! completed, the rollouts that moved, and the counts metrics take once it has committed.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use idem_protocol::{DeviceId, Generation, Health};
use uuid::Uuid;

use crate::reconcile::change::DeviceChange;
use crate::reconcile::event_draft::EventDraft;
use crate::reconcile::outcome::{OutcomeCounts, OutcomeKind};
use crate::reconcile::rollout::StoredRollout;
use crate::reconcile::run::CompletedRun;

/// One device's outcome in one run, for the store.
#[derive(Debug, Clone)]
pub struct OutcomeRecord {
    pub run_id: Uuid,
    pub device: DeviceId,
    pub kind: OutcomeKind,
    pub reason: Option<String>,
    pub generation: Option<Generation>,
    pub health: Option<Health>,
}

/// One ended attempt, for a device's attempt history.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub device: DeviceId,
    pub run_id: Uuid,
    /// Which attempt this was (1 = first since the last success).
    pub attempt: u32,
    pub generation: Option<Generation>,
    /// `Failed`, `Provisioned` or `Superseded`.
    pub result: OutcomeKind,
    pub reason: Option<String>,
}

/// Counts for metrics, taken once the write has committed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    pub retries: u64,
    pub quarantines: u64,
    pub drifts: u64,
    /// From a run's start to each `provisioned` outcome.
    pub convergence: Vec<Duration>,
}

/// Results waiting to be written together, in one transaction.
#[derive(Debug, Default)]
pub struct Record {
    pub outcomes: Vec<OutcomeRecord>,
    /// Per run, the counts the outcomes above add to the run row (the same
    /// outcomes [`CompletedRun::counts`] adds up in the machine).
    pub per_run: HashMap<Uuid, OutcomeCounts>,
    pub attempts: Vec<AttemptRecord>,
    /// Events of this write (device outcomes, drift, quarantine); each
    /// run's `run.completed` is [`CompletedRun::event`], added by the writer
    /// once the write has marked the run completed.
    pub drafts: Vec<EventDraft>,
    pub devices: BTreeMap<DeviceId, DeviceChange>,
    /// The runs that ended with this write's outcomes, with the machine's
    /// counts: the one place where the end of a run is handed out.
    pub completed: Vec<CompletedRun>,
    /// Rollouts that moved (an outcome counted, a wave, a pause, an
    /// action), as their run rows keep them, consistent with the outcomes
    /// of this write and those before it.
    pub rollouts: BTreeMap<Uuid, StoredRollout>,
    pub tally: Tally,
}

impl Record {
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
            && self.attempts.is_empty()
            && self.drafts.is_empty()
            && self.devices.is_empty()
            && self.completed.is_empty()
            && self.rollouts.is_empty()
    }

    /// The change to `id`'s row, created empty on first use.
    pub fn device(&mut self, id: &DeviceId) -> &mut DeviceChange {
        self.devices.entry(id.clone()).or_default()
    }
}
