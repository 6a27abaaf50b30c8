//! One device row's merged change from the engine: what PostgreSQL writes in
//! one statement and the fleet cache mirrors after the commit.

use chrono::{DateTime, Utc};
use idem_protocol::{DeviceStatus, Generation, OutcomeKind};
use uuid::Uuid;

/// The last outcome a device row remembers (its `last_run_id`,
/// `last_outcome` and `last_outcome_reason` columns), as a change writes
/// it; the API shows it to clients as `idem_protocol::api::LastOutcome`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RememberedOutcome {
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
    pub last_outcome: Option<RememberedOutcome>,
    /// Generation of the desired message now retained on the broker.
    pub retained: Option<Generation>,
}

impl DeviceChange {
    /// Adds a later change on top: each field it sets wins.
    pub fn merge(&mut self, later: DeviceChange) {
        let DeviceChange {
            status,
            failures,
            last_error,
            last_outcome,
            retained,
        } = later;
        if status.is_some() {
            self.status = status;
        }
        if failures.is_some() {
            self.failures = failures;
        }
        if last_error.is_some() {
            self.last_error = last_error;
        }
        if last_outcome.is_some() {
            self.last_outcome = last_outcome;
        }
        if retained.is_some() {
            self.retained = retained;
        }
    }
}
