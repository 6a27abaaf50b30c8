//! What one write of the engine's results holds: outcomes, attempt
//! history, events, one merged change per device row, the runs that
//! completed, and the counts metrics take once it has committed.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_protocol::DeviceId;
use uuid::Uuid;

use crate::events::EventDraft;
use crate::fleet::DeviceEntry;
use crate::reconcile::outcome::{OutcomeCounts, OutcomeKind};
use crate::reconcile::policy::DeviceStatus;
use crate::reconcile::run::RunProgress;
use crate::store::devices::AttemptRow;
use crate::store::runs::OutcomeRow;

/// The last outcome a device row remembers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastOutcome {
    pub run_id: Uuid,
    pub kind: OutcomeKind,
    pub reason: Option<String>,
}

/// Every change the engine makes to one device's row in one write, merged:
/// the single path by which the engine's device status reaches PostgreSQL
/// and the fleet cache. `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceChange {
    pub status: Option<DeviceStatus>,
    /// Consecutive failed attempts, and when the next attempt is due.
    pub failures: Option<(u32, Option<DateTime<Utc>>)>,
    pub last_error: Option<String>,
    pub last_outcome: Option<LastOutcome>,
    /// Generation of the desired message now retained on the broker.
    pub retained: Option<u64>,
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

impl DeviceChange {
    /// Mirrors the change in a cache entry (the fields the cache holds).
    pub fn apply_to(&self, entry: &mut DeviceEntry) {
        if let Some(status) = self.status {
            entry.status = status;
        }
        if let Some((failures, _)) = self.failures {
            entry.failures = failures;
        }
        if let Some(generation) = self.retained {
            entry.retained_generation = Some(generation);
        }
    }
}
