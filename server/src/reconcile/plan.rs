//! Plans: what a desired change would do to each targeted device, decided
//! by the very functions a run decides with (`policy::blocked`,
//! `decide::first_look`) before anything moves; whether the state a plan
//! was computed on still holds when it is applied; and the rules of the
//! plan book (`book`). Pure: no IO, and time is an input.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use idem_protocol::api::Targeting;
use idem_protocol::{DeviceId, DeviceStatus, Generation, SpecDigest};
use serde_json::Value;
use uuid::Uuid;

use super::decide::{first_look, Desired, FirstLook};
use super::device::{DesiredState, DeviceEntry};
use super::owned::{NewSpecDigests, OwnedFields};
use super::policy::{blocked, Blocked};

/// Why a plan counts a device `skipped`: a run would not push to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanSkip {
    /// Blocked (offline, quarantined): the run skips it.
    Blocked(Blocked),
    /// It never reported: the run asks it for a report first and decides
    /// on the answer, so the plan cannot say.
    NoReport,
}

/// What applying the plan does to a device first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Its report already matches: `already_converged`, no push.
    Converged,
    /// The run pushes the new desired state.
    Push,
    Skipped(PlanSkip),
}

/// A run's first step for a device whose desired state would be
/// `desired`: the gate, then the fresh decision, as the engine takes them.
pub fn verdict(entry: &DeviceEntry, desired: &Desired, force: bool) -> Verdict {
    if let Some(blocked) = blocked(entry.status, entry.exempt, entry.online) {
        return Verdict::Skipped(PlanSkip::Blocked(blocked));
    }
    match first_look(desired, &entry.actual(), force) {
        FirstLook::AlreadyConverged => Verdict::Converged,
        FirstLook::Push => Verdict::Push,
        FirstLook::AskForReport => Verdict::Skipped(PlanSkip::NoReport),
    }
}

/// The desired generation a device would have after a change to a spec
/// whose own digest is `spec_digest` (`store::devices::set_desired` counts
/// up only when the whole spec's digest differs), and whether that is a new
/// one.
pub fn planned_generation(
    current: Option<&DesiredState>,
    spec_digest: SpecDigest,
) -> (Generation, bool) {
    match current {
        Some(d) if d.spec_digest == spec_digest => (d.generation, false),
        Some(d) => (d.generation.next(), true),
        None => (Generation::FIRST, true),
    }
}

/// The state of one device a plan was computed on; applying the plan
/// requires every one to be unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Basis {
    pub desired_generation: Option<Generation>,
    /// For display only ("reported since the plan"): a report that says
    /// the same again does not make the plan stale.
    pub reported_seq: Option<u64>,
    /// What the last report said, as far as a verdict reads it.
    pub reported: Option<ReportedBasis>,
    /// What it owns: its verdict compares the new spec without it.
    pub owned: Option<Arc<OwnedFields>>,
    pub online: Option<bool>,
    pub status: DeviceStatus,
    pub exempt: bool,
}

/// The parts of a report a verdict depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportedBasis {
    pub digest: SpecDigest,
    pub generation: Option<Generation>,
    pub rejected_generation: Option<Generation>,
}

impl Basis {
    pub fn of(entry: &DeviceEntry) -> Self {
        Self {
            desired_generation: entry.desired.as_ref().map(|d| d.generation),
            reported_seq: entry.reported_seq(),
            reported: entry.reported.as_ref().map(|r| ReportedBasis {
                digest: r.digest,
                generation: r.generation,
                rejected_generation: r.rejection.as_ref().map(|(g, _)| *g),
            }),
            owned: entry.owned.clone(),
            online: entry.online,
            status: entry.status,
            exempt: entry.exempt,
        }
    }
}

/// One targeted device in a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedDevice {
    pub id: DeviceId,
    pub verdict: Verdict,
    /// Its desired generation once the plan is applied.
    pub generation: Generation,
    /// Whether applying creates that generation (false: its desired spec
    /// is already this one).
    pub new_generation: bool,
    pub basis: Basis,
}

/// How many targeted devices get each verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanCounts {
    pub targets: u64,
    pub converged: u64,
    pub push: u64,
    pub offline: u64,
    pub quarantined: u64,
    pub exempt: u64,
    pub no_report: u64,
}

impl PlanCounts {
    pub fn skipped(&self) -> u64 {
        self.offline + self.quarantined + self.exempt + self.no_report
    }

    fn add(&mut self, verdict: Verdict) {
        self.targets += 1;
        match verdict {
            Verdict::Converged => self.converged += 1,
            Verdict::Push => self.push += 1,
            Verdict::Skipped(PlanSkip::Blocked(Blocked::Offline)) => self.offline += 1,
            Verdict::Skipped(PlanSkip::Blocked(Blocked::Quarantined)) => self.quarantined += 1,
            Verdict::Skipped(PlanSkip::Blocked(Blocked::Exempt)) => self.exempt += 1,
            Verdict::Skipped(PlanSkip::NoReport) => self.no_report += 1,
        }
    }
}

/// Every target's verdict for a change to `spec` (with `force`), judged
/// on `view`, in device-id order; each device compares the spec without
/// the fields it owns. A target `view` does not know (deleted since it was
/// resolved) is left out.
pub fn plan_devices(
    targets: &[DeviceId],
    view: impl Fn(&DeviceId) -> Option<DeviceEntry>,
    spec: &mut NewSpecDigests<'_>,
    force: bool,
) -> (Vec<PlannedDevice>, PlanCounts) {
    let mut devices = Vec::with_capacity(targets.len());
    let mut counts = PlanCounts::default();
    let mut seen = HashSet::with_capacity(targets.len());
    for id in targets {
        if !seen.insert(id) {
            continue;
        }
        let Some(entry) = view(id) else {
            continue;
        };
        let (generation, new_generation) = planned_generation(entry.desired.as_ref(), spec.full());
        let desired = Desired {
            generation,
            digest: spec.for_device(entry.owned.as_ref()),
        };
        let verdict = verdict(&entry, &desired, force);
        counts.add(verdict);
        devices.push(PlannedDevice {
            id: id.clone(),
            verdict,
            generation,
            new_generation,
            basis: Basis::of(&entry),
        });
    }
    devices.sort_unstable_by(|a, b| a.id.cmp(&b.id));
    (devices, counts)
}

/// What changed since a plan was computed, device by device (each counted
/// once, under the first of: gone, desired, reported, owned fields,
/// connection, status or exemption),
/// plus devices its targeting matches now and did not then.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Staleness {
    pub gone: u64,
    pub desired: u64,
    pub reported: u64,
    pub connection: u64,
    pub status: u64,
    /// Devices whose owned fields changed (`PUT /v1/owned-fields`).
    pub owned: u64,
    pub joined: u64,
    /// Planned devices, still registered, that its targeting no longer
    /// matches (relabelled out of its selector).
    pub left: u64,
}

impl Staleness {
    pub fn is_fresh(&self) -> bool {
        *self == Staleness::default()
    }

    /// Adds the devices of `planned` whose state in `view` is not the one
    /// the plan was computed on.
    pub fn compare(
        &mut self,
        planned: &[PlannedDevice],
        view: impl Fn(&DeviceId) -> Option<DeviceEntry>,
    ) {
        for device in planned {
            let Some(entry) = view(&device.id) else {
                self.gone += 1;
                continue;
            };
            let now = Basis::of(&entry);
            let then = &device.basis;
            if now.desired_generation != then.desired_generation {
                self.desired += 1;
            } else if now.reported != then.reported {
                self.reported += 1;
            } else if now.owned != then.owned {
                self.owned += 1;
            } else if now.online != then.online {
                self.connection += 1;
            } else if now.status != then.status || now.exempt != then.exempt {
                self.status += 1;
            }
        }
    }
}

/// "3 devices reported a change since the plan; desired state changed for 1
/// device since the plan; re-plan".
impl fmt::Display for Staleness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let devices = |n: u64| match n {
            1 => "1 device".to_owned(),
            n => format!("{n} devices"),
        };
        let parts = [
            (
                self.reported,
                format!(
                    "{} reported a change since the plan",
                    devices(self.reported)
                ),
            ),
            (
                self.desired,
                format!(
                    "desired state changed for {} since the plan",
                    devices(self.desired)
                ),
            ),
            (
                self.connection,
                format!(
                    "{} connected or disconnected since the plan",
                    devices(self.connection)
                ),
            ),
            (
                self.status,
                format!(
                    "status or exemption changed for {} since the plan",
                    devices(self.status)
                ),
            ),
            (
                self.owned,
                format!(
                    "owned fields changed for {} since the plan",
                    devices(self.owned)
                ),
            ),
            (
                self.gone,
                format!("{} deleted since the plan", devices(self.gone)),
            ),
            (
                self.joined,
                format!("{} more matched by its targeting now", devices(self.joined)),
            ),
            (
                self.left,
                format!("{} no longer matched by its targeting", devices(self.left)),
            ),
        ];
        let said: Vec<String> = parts
            .into_iter()
            .filter(|(n, _)| *n > 0)
            .map(|(_, text)| text)
            .collect();
        if said.is_empty() {
            f.write_str("nothing changed since the plan")
        } else {
            write!(f, "{}; re-plan", said.join("; "))
        }
    }
}

/// A plan: a desired change computed and not applied (yet).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub id: Uuid,
    /// The operator token that made it.
    pub author: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub targeting: Targeting,
    pub spec: Arc<Value>,
    pub digest: SpecDigest,
    pub force: bool,
    /// Every target, in device-id order.
    pub devices: Vec<PlannedDevice>,
    pub counts: PlanCounts,
}

impl Plan {
    /// The planned devices after `after` (exclusive) whose verdict
    /// `wanted` accepts, at most `limit`, and whether more follow.
    pub fn page(
        &self,
        after: Option<&str>,
        wanted: impl Fn(Verdict) -> bool,
        limit: usize,
    ) -> (Vec<&PlannedDevice>, bool) {
        let start = match after {
            Some(after) => self.devices.partition_point(|d| d.id.as_str() <= after),
            None => 0,
        };
        let mut matching = self.devices[start..].iter().filter(|d| wanted(d.verdict));
        let page: Vec<&PlannedDevice> = matching.by_ref().take(limit).collect();
        let more = page.len() == limit && matching.next().is_some();
        (page, more)
    }
}

/// How the devices a plan's targeting matches `now` differ from those it
/// matched: `(joined, left)`, devices matched now and not then, and planned
/// devices `registered` still that it matches no more (a deleted one is
/// counted `gone` by [`Staleness::compare`]).
pub fn retargeted(
    plan: &Plan,
    now: &[DeviceId],
    registered: impl Fn(&DeviceId) -> bool,
) -> (u64, u64) {
    let planned: HashSet<&str> = plan.devices.iter().map(|d| d.id.as_str()).collect();
    let now_set: HashSet<&str> = now.iter().map(DeviceId::as_str).collect();
    let joined = now
        .iter()
        .filter(|id| !planned.contains(id.as_str()))
        .count() as u64;
    let left = plan
        .devices
        .iter()
        .filter(|d| !now_set.contains(d.id.as_str()) && registered(&d.id))
        .count() as u64;
    (joined, left)
}

pub mod book;

pub use book::{ApproveRefusal, PlanApproval, PlanState, Unusable};

#[cfg(test)]
mod tests;
