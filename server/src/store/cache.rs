//! In-memory view of every device's desired and reported state (a DashMap),
//! so a run over 10,000 devices is a memory walk, not 10,000 queries.
//!
//! Postgres stays the source of truth: entries change only after the write
//! that they mirror has committed. Never hold a guard across `.await`.

use std::sync::{Arc, RwLock};

use chrono::{DateTime, Utc};
use dashmap::DashMap;
use idem_protocol::{DeviceId, DeviceStatus, Generation, Health, SpecDigest};
use serde_json::Value;

use crate::reconcile::change::DeviceChange;
use crate::reconcile::decide::ReportedState;
use crate::reconcile::device::FleetRead;
pub use crate::reconcile::device::{DesiredState, DeviceEntry};
use crate::reconcile::owned::{OwnedFieldSet, OwnedFields};

/// A committed change to mirror in the cache. [`FleetCache::apply`] is the only
/// way the cache changes, always after the transaction that wrote the change
/// has committed: the one place a cross-instance invalidation hooks into.
#[derive(Debug, Clone)]
pub enum FleetChange {
    /// A device registered (an existing entry is kept as it is).
    Registered(DeviceId),
    Desired(DeviceId, DesiredState),
    /// An accepted report (its seq is the device's highest).
    Reported {
        id: DeviceId,
        reported: ReportedState,
        health: Option<Health>,
    },
    Online(DeviceId, bool),
    /// An exemption now covers the device (`true`) or no longer does.
    Exempt(DeviceId, bool),
    /// The declared owned fields changed (`PUT /v1/owned-fields`).
    OwnedSet(Arc<OwnedFieldSet>),
    /// What the device owns now, and its report's digest as convergence
    /// compares it without those paths (`None`: it has no report); its
    /// desired digest is recomputed from the desired spec. `retained_stale`:
    /// the retained desired message holds what it now owns, and is to be
    /// published again.
    Owned {
        id: DeviceId,
        owned: Option<Arc<OwnedFields>>,
        reported_digest: Option<SpecDigest>,
        retained_stale: bool,
    },
    /// An operator reset the device's reported state.
    ReportedCleared(DeviceId),
    /// An operator released a quarantined device: `failed`, no failures counted.
    Released(DeviceId),
    Removed(DeviceId),
    /// The device's row as another writer left it (`DeviceWriter` following
    /// the table): replaces the entry.
    Followed(DeviceId, DeviceEntry),
    /// The engine's merged change of one device.
    Engine(DeviceId, DeviceChange),
    /// The reported columns and connection state of a device's row as
    /// another writer's reports left them (`DeviceWriter` following the
    /// table): replaces those parts of an entry the cache holds.
    FollowedReport(DeviceId, FollowedReport),
}

/// A device's reported state as its row holds it (`DeviceWriter`
/// following another writer's reports).
#[derive(Debug, Clone)]
pub struct FollowedReport {
    pub reported: Option<ReportedState>,
    pub reported_at: Option<DateTime<Utc>>,
    pub health: Option<Health>,
    pub online: Option<bool>,
}

impl FleetChange {
    /// The device it changes (`None`: every device's owned fields).
    pub fn device(&self) -> Option<&DeviceId> {
        match self {
            FleetChange::Registered(id)
            | FleetChange::Desired(id, _)
            | FleetChange::Reported { id, .. }
            | FleetChange::Online(id, _)
            | FleetChange::Exempt(id, _)
            | FleetChange::Owned { id, .. }
            | FleetChange::ReportedCleared(id)
            | FleetChange::Released(id)
            | FleetChange::Removed(id)
            | FleetChange::Followed(id, _)
            | FleetChange::Engine(id, _)
            | FleetChange::FollowedReport(id, _) => Some(id),
            FleetChange::OwnedSet(_) => None,
        }
    }
}

/// The state machine reads the cache through the core's [`FleetRead`].
impl FleetRead for FleetCache {
    fn get(&self, id: &DeviceId) -> Option<DeviceEntry> {
        FleetCache::get(self, id)
    }

    fn ids_with_desired_state(&self) -> Vec<DeviceId> {
        FleetCache::ids_with_desired_state(self)
    }

    fn ids_with_retained_behind(&self) -> Vec<DeviceId> {
        FleetCache::ids_with_retained_behind(self)
    }

    fn ids_reported_before(&self, cutoff: DateTime<Utc>) -> Vec<DeviceId> {
        FleetCache::ids_reported_before(self, cutoff)
    }

    fn ids_not_offline(&self) -> Vec<DeviceId> {
        FleetCache::ids_not_offline(self)
    }
}

/// Every registered device, by id.
#[derive(Debug, Default)]
pub struct FleetCache {
    devices: DashMap<DeviceId, DeviceEntry>,
    /// The declared owned fields each entry's `owned` was resolved from.
    owned_set: RwLock<Arc<OwnedFieldSet>>,
}

impl FleetCache {
    /// The cache of the devices `store::device_rows::cache_entries` read.
    pub fn from_entries(entries: Vec<(DeviceId, DeviceEntry)>) -> Self {
        let devices = DashMap::with_capacity(entries.len());
        for (id, entry) in entries {
            devices.insert(id, entry);
        }
        Self {
            devices,
            owned_set: RwLock::default(),
        }
    }

    /// The same cache, its entries' owned fields resolved from `set`.
    pub fn with_owned_set(self, set: OwnedFieldSet) -> Self {
        Self {
            owned_set: RwLock::new(Arc::new(set)),
            ..self
        }
    }

    /// The declared owned fields.
    pub fn owned_set(&self) -> Arc<OwnedFieldSet> {
        // A poisoned lock still holds a whole `Arc`: it is only ever replaced.
        self.owned_set
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Whether any device owns a path.
    pub fn any_owned(&self) -> bool {
        self.devices.iter().any(|e| e.value().owned.is_some())
    }

    /// How many devices own a path.
    pub fn count_owning(&self) -> usize {
        self.devices
            .iter()
            .filter(|e| e.value().owned.is_some())
            .count()
    }

    /// The paths one device owns.
    pub fn owned(&self, id: &DeviceId) -> Option<Arc<OwnedFields>> {
        self.owned_if_known(id).flatten()
    }

    /// The paths a known device owns (`Some(None)`: none); `None` for a
    /// device the cache does not hold.
    pub fn owned_if_known(&self, id: &DeviceId) -> Option<Option<Arc<OwnedFields>>> {
        self.devices.get(id).map(|e| e.value().owned.clone())
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    pub fn contains(&self, id: &DeviceId) -> bool {
        self.devices.contains_key(id)
    }

    /// A copy of one entry (the guard is released before returning).
    pub fn get(&self, id: &DeviceId) -> Option<DeviceEntry> {
        self.devices.get(id).map(|e| e.value().clone())
    }

    /// One device's desired state (its spec shared, not copied).
    pub fn desired(&self, id: &DeviceId) -> Option<DesiredState> {
        self.devices.get(id).and_then(|e| e.value().desired.clone())
    }

    /// Records a desired change, its convergence digest leaving out what
    /// the device owns.
    fn set_desired(&self, id: &DeviceId, desired: DesiredState) {
        if let Some(mut entry) = self.devices.get_mut(id) {
            let desired = match entry.owned.as_deref() {
                Some(owned) => DesiredState::new(
                    desired.generation,
                    desired.spec_digest,
                    desired.spec,
                    Some(owned),
                ),
                None => desired,
            };
            entry.desired = Some(desired);
        }
    }

    /// Records an accepted report (caller ensured its seq is the highest).
    fn set_reported(&self, id: &DeviceId, reported: ReportedState, health: Option<Health>) {
        let mut entry = self.devices.entry(id.clone()).or_default();
        entry.reported = Some(reported);
        entry.reported_at = Some(Utc::now());
        entry.health = health;
    }

    /// Forgets a device's reported state (an operator reset).
    fn clear_reported(&self, id: &DeviceId) {
        if let Some(mut entry) = self.devices.get_mut(id) {
            entry.reported = None;
            entry.reported_at = None;
            entry.health = None;
        }
    }

    /// Mirrors committed changes, in order: only the device writer calls
    /// it, when the transaction that made them has committed.
    pub(super) fn apply(&self, changes: impl IntoIterator<Item = FleetChange>) {
        for change in changes {
            match change {
                FleetChange::Registered(id) => {
                    self.devices.entry(id).or_default();
                }
                FleetChange::Desired(id, desired) => self.set_desired(&id, desired),
                FleetChange::Reported {
                    id,
                    reported,
                    health,
                } => self.set_reported(&id, reported, health),
                FleetChange::Online(id, online) => self.set_online(&id, online),
                FleetChange::FollowedReport(id, report) => {
                    if let Some(mut entry) = self.devices.get_mut(&id) {
                        entry.reported = report.reported;
                        entry.reported_at = report.reported_at;
                        entry.health = report.health;
                        entry.online = report.online;
                    }
                }
                FleetChange::OwnedSet(set) => {
                    *self
                        .owned_set
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = set;
                }
                FleetChange::Owned {
                    id,
                    owned,
                    reported_digest,
                    retained_stale,
                } => {
                    if let Some(mut entry) = self.devices.get_mut(&id) {
                        let entry = &mut *entry;
                        entry.owned = owned;
                        if let Some(desired) = &mut entry.desired {
                            *desired = DesiredState::new(
                                desired.generation,
                                desired.spec_digest,
                                desired.spec.clone(),
                                entry.owned.as_deref(),
                            );
                        }
                        if let (Some(reported), Some(digest)) =
                            (&mut entry.reported, reported_digest)
                        {
                            reported.digest = digest;
                        }
                        if retained_stale && entry.retained_generation.is_some() {
                            entry.retained_generation = Some(Generation::default());
                        }
                    }
                }
                FleetChange::Exempt(id, exempt) => {
                    if let Some(mut entry) = self.devices.get_mut(&id) {
                        entry.exempt = exempt;
                    }
                }
                FleetChange::ReportedCleared(id) => self.clear_reported(&id),
                FleetChange::Released(id) => {
                    if let Some(mut entry) = self.devices.get_mut(&id) {
                        entry.status = DeviceStatus::Failed;
                        entry.failures = 0;
                    }
                }
                FleetChange::Removed(id) => {
                    self.devices.remove(&id);
                }
                FleetChange::Followed(id, entry) => {
                    self.devices.insert(id, entry);
                }
                FleetChange::Engine(id, change) => {
                    if let Some(mut entry) = self.devices.get_mut(&id) {
                        entry.apply(&change);
                    }
                }
            }
        }
    }

    /// Mirrors changes a test's world committed (the state machine's tests
    /// stand in for the device writer).
    #[cfg(test)]
    pub(crate) fn apply_committed(&self, changes: impl IntoIterator<Item = FleetChange>) {
        self.apply(changes);
    }

    /// Adds or replaces one entry (a test's device with known state).
    #[cfg(test)]
    pub(crate) fn insert(&self, id: DeviceId, entry: DeviceEntry) {
        self.devices.insert(id, entry);
    }

    /// Ids of every device.
    pub fn ids(&self) -> Vec<DeviceId> {
        self.devices.iter().map(|e| e.key().clone()).collect()
    }

    /// Ids of every device an exemption covers.
    pub fn ids_exempt(&self) -> Vec<DeviceId> {
        self.devices
            .iter()
            .filter(|e| e.value().exempt)
            .map(|e| e.key().clone())
            .collect()
    }

    /// Ids of every device with a desired spec, sorted.
    pub fn ids_with_desired_state(&self) -> Vec<DeviceId> {
        let mut ids: Vec<DeviceId> = self
            .devices
            .iter()
            .filter(|e| e.value().desired.is_some())
            .map(|e| e.key().clone())
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Ids whose retained desired message is behind their desired state.
    pub fn ids_with_retained_behind(&self) -> Vec<DeviceId> {
        self.devices
            .iter()
            .filter(|e| e.value().retained_behind().is_some())
            .map(|e| e.key().clone())
            .collect()
    }

    /// Ids whose last report is older than `cutoff` (or who never reported).
    pub fn ids_reported_before(&self, cutoff: DateTime<Utc>) -> Vec<DeviceId> {
        self.devices
            .iter()
            .filter(|e| e.value().reported_at.is_none_or(|at| at < cutoff))
            .map(|e| e.key().clone())
            .collect()
    }

    /// Ids of every device not known to be offline, sorted.
    pub fn ids_not_offline(&self) -> Vec<DeviceId> {
        self.ids_where(|e| e.online != Some(false))
    }

    /// Ids of every device not known to be online, sorted.
    pub fn ids_not_online(&self) -> Vec<DeviceId> {
        self.ids_where(|e| e.online != Some(true))
    }

    fn ids_where(&self, wanted: impl Fn(&DeviceEntry) -> bool) -> Vec<DeviceId> {
        let mut ids: Vec<DeviceId> = self
            .devices
            .iter()
            .filter(|e| wanted(e.value()))
            .map(|e| e.key().clone())
            .collect();
        ids.sort_unstable();
        ids
    }

    fn set_online(&self, id: &DeviceId, online: bool) {
        if let Some(mut entry) = self.devices.get_mut(id) {
            entry.online = Some(online);
        }
    }

    /// The device's last known connection state (`None`: unknown or not registered).
    pub fn online(&self, id: &DeviceId) -> Option<bool> {
        self.devices.get(id).and_then(|e| e.online)
    }

    pub fn reported_seq(&self, id: &DeviceId) -> Option<Option<u64>> {
        self.devices.get(id).map(|e| e.reported_seq())
    }

    /// An estimate of the bytes the cache holds: every table slot (id and
    /// entry, plus the hash table's control byte), each id's and refusal
    /// message's heap allocation, and each distinct desired spec once, at
    /// its JSON length. `idem_fleet_cache_bytes`; the benchmark divides it
    /// by the fleet size.
    pub fn footprint_bytes(&self) -> usize {
        let slot = std::mem::size_of::<DeviceId>() + std::mem::size_of::<DeviceEntry>() + 1;
        let mut bytes = self.devices.capacity() * slot;
        let mut specs = std::collections::HashSet::new();
        for entry in self.devices.iter() {
            bytes += heap_allocation(entry.key().as_str().len());
            let device = entry.value();
            if let Some((_, message)) = device.reported.as_ref().and_then(|r| r.rejection.as_ref())
            {
                bytes += heap_allocation(message.len());
            }
            if let Some(desired) = &device.desired {
                if specs.insert(Arc::as_ptr(&desired.spec)) {
                    bytes += json_length(&desired.spec);
                }
            }
        }
        bytes
    }
}

/// The length of `value` as JSON, counted without building the text.
fn json_length(value: &Value) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Serialising a `Value` into a writer that never fails cannot fail.
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

/// What glibc's malloc takes for `len` bytes: 8 bytes of header, rounded up
/// to 16, at least 32.
fn heap_allocation(len: usize) -> usize {
    match len {
        0 => 0,
        len => (len + 8).max(32).next_multiple_of(16),
    }
}
