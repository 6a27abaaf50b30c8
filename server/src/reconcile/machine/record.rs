//! What one write of the engine's results holds: outcomes, attempt
//! history, events, one merged change per device row, the runs that
//! completed, and the counts metrics take once it has committed.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use idem_protocol::DeviceId;
use uuid::Uuid;

use crate::events::EventDraft;
use crate::reconcile::change::DeviceChange;
use crate::reconcile::outcome::OutcomeCounts;
use crate::reconcile::run::RunProgress;
use crate::store::devices::AttemptRow;
use crate::store::runs::OutcomeRow;

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
    pub outcomes: Vec<OutcomeRow>,
    /// Per run, the counts the outcomes above add.
    pub per_run: HashMap<Uuid, OutcomeCounts>,
    pub attempts: Vec<AttemptRow>,
    /// Events of this write (device outcomes, drift, quarantine);
    /// `run.completed` events are added by the writer from the committed counts.
    pub drafts: Vec<EventDraft>,
    pub devices: BTreeMap<DeviceId, DeviceChange>,
    /// Runs whose last outcome is in this write.
    pub completed: Vec<RunProgress>,
    pub tally: Tally,
}

impl Record {
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
            && self.attempts.is_empty()
            && self.drafts.is_empty()
            && self.devices.is_empty()
            && self.completed.is_empty()
    }

    /// The change to `id`'s row, created empty on first use.
    pub fn device(&mut self, id: &DeviceId) -> &mut DeviceChange {
        self.devices.entry(id.clone()).or_default()
    }
}
