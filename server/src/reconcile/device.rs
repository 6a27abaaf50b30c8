//! What the core knows of one device: its desired state, its last report,
//! connection, status and failures, as the fleet cache holds them, and the
//! read-only view of the fleet the state machine decides on
//! ([`FleetRead`]; the store's cache implements it).

use chrono::{DateTime, Utc};
use idem_protocol::{DeviceId, DeviceStatus, Generation, Health, SpecDigest};
use serde_json::Value;
use std::sync::Arc;

use crate::reconcile::change::DeviceChange;
use crate::reconcile::decide::{self, Actual, ReportedState};
use crate::reconcile::owned::OwnedFields;

/// The fleet as the state machine reads it: committed state only.
pub trait FleetRead: Send + Sync {
    /// A copy of one device's entry (`None`: not registered).
    fn get(&self, id: &DeviceId) -> Option<DeviceEntry>;
    /// Ids of every device with a desired spec, sorted.
    fn ids_with_desired_state(&self) -> Vec<DeviceId>;
    /// Ids whose retained desired message is behind their desired state.
    fn ids_with_retained_behind(&self) -> Vec<DeviceId>;
    /// Ids whose last report is older than `cutoff` (or who never reported).
    fn ids_reported_before(&self, cutoff: DateTime<Utc>) -> Vec<DeviceId>;
    /// Ids of every device not known to be offline, sorted.
    fn ids_not_offline(&self) -> Vec<DeviceId>;
}

/// Desired state of one device, with the spec kept for pushing.
#[derive(Debug, Clone)]
pub struct DesiredState {
    pub generation: Generation,
    /// The digest convergence compares: of `spec` without the paths the
    /// device owns (`spec_digest` when it owns none).
    pub digest: SpecDigest,
    /// The digest of the whole spec, as stored: a new desired spec is a new
    /// generation only when this differs.
    pub spec_digest: SpecDigest,
    /// Shared: a bulk change gives thousands of devices the same spec.
    pub spec: Arc<Value>,
}

impl DesiredState {
    /// The spec as a device that owns `owned` is sent it (shared, not
    /// copied, when there is nothing to leave out).
    pub fn published(&self, owned: Option<&OwnedFields>) -> Arc<Value> {
        match owned.map(|owned| owned.strip(&self.spec)) {
            Some(std::borrow::Cow::Owned(stripped)) => Arc::new(stripped),
            Some(std::borrow::Cow::Borrowed(_)) | None => self.spec.clone(),
        }
    }

    /// `spec` (whose own digest is `spec_digest`) as generation
    /// `generation` of a device that owns `owned`.
    pub fn new(
        generation: Generation,
        spec_digest: SpecDigest,
        spec: Arc<Value>,
        owned: Option<&OwnedFields>,
    ) -> Self {
        Self {
            generation,
            digest: crate::reconcile::owned::convergence_digest(&spec, spec_digest, owned),
            spec_digest,
            spec,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct DeviceEntry {
    pub desired: Option<DesiredState>,
    pub reported: Option<ReportedState>,
    /// When the last accepted report was stored (for staleness).
    pub reported_at: Option<DateTime<Utc>>,
    pub health: Option<Health>,
    pub online: Option<bool>,
    pub status: DeviceStatus,
    /// Consecutive failed attempts (reset by a success).
    pub failures: u32,
    /// An operator's exemption covers it now: its drift is detected and
    /// evented, never remediated (`policy::blocked`).
    pub exempt: bool,
    /// The spec paths the device owns (`reconcile::owned`): left out of
    /// both digests above, never published. `None`: it owns none.
    pub owned: Option<Arc<OwnedFields>>,
    /// Generation of the retained desired message on the broker (`None`:
    /// the broker holds none). Refreshed whenever it falls behind `desired`.
    pub retained_generation: Option<Generation>,
}

impl DeviceEntry {
    /// Mirrors an engine change in the fields the cache holds.
    pub fn apply(&mut self, change: &DeviceChange) {
        if let Some(status) = change.status {
            self.status = status;
        }
        if let Some((failures, _)) = change.failures {
            self.failures = failures;
        }
        if let Some(generation) = change.retained {
            self.retained_generation = Some(generation);
        }
    }

    pub fn actual(&self) -> Actual {
        match &self.reported {
            Some(r) => Actual::Reported(r.clone()),
            None => Actual::NeverReported,
        }
    }

    /// The desired state, when the broker's retained message is older than
    /// it (or of unknown generation) and so must be refreshed.
    pub fn retained_behind(&self) -> Option<&DesiredState> {
        let desired = self.desired.as_ref()?;
        match self.retained_generation {
            Some(retained) if retained != desired.generation => Some(desired),
            Some(_) | None => None,
        }
    }

    pub fn desired_for_decision(&self) -> Option<decide::Desired> {
        self.desired.as_ref().map(|d| decide::Desired {
            generation: d.generation,
            digest: d.digest,
        })
    }

    /// The desired spec as the device is sent it: without the paths it owns
    /// (shared, not copied, when there is nothing to leave out).
    pub fn spec_to_publish(&self, desired: &DesiredState) -> Arc<Value> {
        desired.published(self.owned.as_deref())
    }

    pub fn reported_seq(&self) -> Option<u64> {
        self.reported.as_ref().map(|r| r.seq)
    }
}
