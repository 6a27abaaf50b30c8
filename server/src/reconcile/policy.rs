//! Pure policies around `decide`: which devices a run does not attempt (or
//! decides while it is created), how long to wait before retrying a failed
//! push, the device status an outcome leaves behind, and the one a report
//! alone sets. No IO, no clock, no randomness (jitter is an input).

use std::time::Duration;

pub use idem_protocol::DeviceStatus;

use std::collections::HashMap;

use idem_protocol::{Backoff, DeviceId, Generation, Health, SpecDigest};

use super::decide::{first_look, Desired, FirstLook};
use super::outcome::{Outcome, SkipReason};
use crate::reconcile::change::DeviceChange;
use crate::reconcile::device::DeviceEntry;
use crate::reconcile::owned::NewSpecDigests;

/// Why a device with a desired spec is not attempted, if it is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    Quarantined,
    /// An operator's exemption: drift is seen, never remediated.
    Exempt,
    Offline,
}

impl From<Blocked> for SkipReason {
    fn from(blocked: Blocked) -> Self {
        match blocked {
            Blocked::Quarantined => SkipReason::Quarantined,
            Blocked::Exempt => SkipReason::Exempt,
            Blocked::Offline => SkipReason::Offline,
        }
    }
}

/// Whether a device's status, exemption or connection keeps a run from
/// attempting it.
pub fn blocked(status: DeviceStatus, exempt: bool, online: Option<bool>) -> Option<Blocked> {
    if status == DeviceStatus::Quarantined {
        Some(Blocked::Quarantined)
    } else if exempt {
        Some(Blocked::Exempt)
    } else if online == Some(false) {
        Some(Blocked::Offline)
    } else {
        None
    }
}

/// Why a run does not attempt a device at all, if it does not.
pub fn gate(entry: &DeviceEntry) -> Option<SkipReason> {
    if let Some(blocked) = blocked(entry.status, entry.exempt, entry.online) {
        Some(blocked.into())
    } else if entry.desired.is_none() {
        Some(SkipReason::NoDesiredSpec)
    } else {
        None
    }
}

/// Whether a target's outcome is known the moment its run is created:
/// `AlreadyConverged`, exactly as the engine would decide it on a fresh,
/// unforced attempt (the gate lets it through and the reported digest is the
/// desired one). Such targets are decided in the transaction that creates
/// the run; the engine carries only the rest.
pub fn converged_at_creation(entry: &DeviceEntry, desired: &Desired, force: bool) -> bool {
    if force || blocked(entry.status, entry.exempt, entry.online).is_some() {
        return false;
    }
    match first_look(desired, &entry.actual(), force) {
        FirstLook::AlreadyConverged => true,
        FirstLook::Push | FirstLook::AskForReport => false,
    }
}

/// A target decided `already_converged` at creation.
#[derive(Debug, Clone, PartialEq)]
pub struct Converged {
    pub id: DeviceId,
    pub generation: Generation,
    pub health: Option<Health>,
    /// What its row must change (`None`: nothing; a converged device's
    /// row is not rewritten).
    pub change: Option<DeviceChange>,
}

/// The targets of a new run decided `already_converged` at its creation
/// ([`converged_at_creation`]), judged on `view` — the state machine's view
/// of each device (cache plus changes not yet written) — with the desired
/// change the run makes (`new_spec`, and the generations it gave each
/// device), and what each one's row must change.
pub fn converged_targets(
    view: impl Fn(&DeviceId) -> Option<DeviceEntry>,
    targets: &[DeviceId],
    force: bool,
    mut new_spec: Option<&mut NewSpecDigests<'_>>,
    new_generations: &HashMap<&DeviceId, Generation>,
) -> Vec<Converged> {
    // Targets are distinct (the API and the engine's own runs deduplicate).
    let mut converged = Vec::new();
    for id in targets {
        let Some(entry) = view(id) else {
            continue;
        };
        let desired = match (new_spec.as_deref_mut(), entry.desired_for_decision()) {
            (Some(new_spec), current) => Some(Desired {
                generation: new_generations
                    .get(id)
                    .copied()
                    .or(current.map(|d| d.generation))
                    .unwrap_or_default(),
                digest: new_spec.for_device(entry.owned.as_ref()),
            }),
            (None, current) => current,
        };
        let Some(desired) = desired.filter(|d| d.generation.names_a_spec()) else {
            continue;
        };
        if !converged_at_creation(&entry, &desired, force) {
            continue;
        }
        let change =
            (entry.status != DeviceStatus::Converged || entry.failures > 0).then(|| DeviceChange {
                status: Some(DeviceStatus::Converged),
                failures: (entry.failures > 0).then_some((0, None)),
                ..DeviceChange::default()
            });
        converged.push(Converged {
            id: id.clone(),
            generation: desired.generation,
            health: entry.health,
            change,
        });
    }
    converged
}

/// Whether a stored report makes a device `converged` without a run: it
/// was never reconciled (`unknown`) and the report carries its desired
/// digest. The state machine records that status when the report arrives
/// (`Machine::reports_applied`), so the fleet's
/// first run has no row to rewrite for it.
pub fn converged_by_report(
    status: DeviceStatus,
    desired: Option<&Desired>,
    reported: &SpecDigest,
) -> bool {
    status == DeviceStatus::Unknown
        && desired.is_some_and(|d| d.generation.names_a_spec() && d.digest == *reported)
}

/// Retry schedule for failed attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per device before it is quarantined (1 = no retries).
    pub max_attempts: u32,
    pub base: Duration,
    pub cap: Duration,
}

/// What to do after the `failures`-th consecutive failed attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AfterFailure {
    RetryAfter(Duration),
    Quarantine,
}

impl RetryPolicy {
    /// Quarantine at `max_attempts` failures; before that, the workspace's
    /// one backoff ([`Backoff`]): `base · 2^(failures-1)` up to `cap`, scaled
    /// by `jitter`, clamped into [`Backoff::JITTER_FACTORS`] (50 % to 100 %).
    pub fn after_failure(&self, failures: u32, jitter: f64) -> AfterFailure {
        if failures >= self.max_attempts {
            return AfterFailure::Quarantine;
        }
        AfterFailure::RetryAfter(
            Backoff::new(self.base, self.cap).jittered_delay_after(failures, jitter),
        )
    }
}

/// The device status an outcome leaves behind (`None` keeps the current one).
fn status_after(outcome: &Outcome) -> Option<DeviceStatus> {
    match outcome {
        Outcome::Provisioned | Outcome::AlreadyConverged => Some(DeviceStatus::Converged),
        Outcome::Failed(_) => Some(DeviceStatus::Failed),
        Outcome::Skipped(SkipReason::Offline) => Some(DeviceStatus::Offline),
        Outcome::Skipped(SkipReason::Quarantined) => Some(DeviceStatus::Quarantined),
        Outcome::Skipped(
            SkipReason::NoDesiredSpec
            | SkipReason::Deleted
            | SkipReason::Exempt
            | SkipReason::Aborted,
        )
        | Outcome::Superseded => None,
    }
}

/// The device status `outcome` leaves `entry` in (`None` keeps the current
/// one): [`status_after`], except that a converged device skipped as exempt
/// while its report differs from its desired spec is `drifted`: its status
/// never claims a convergence it does not have (it is remediated once its
/// exemption ends).
pub fn status_left(outcome: &Outcome, entry: &DeviceEntry) -> Option<DeviceStatus> {
    let exempt_and_differing = matches!(outcome, Outcome::Skipped(SkipReason::Exempt))
        && entry.status == DeviceStatus::Converged
        && match (&entry.desired, &entry.reported) {
            (Some(desired), Some(reported)) => desired.digest != reported.digest,
            (Some(_), None) | (None, _) => false,
        };
    if exempt_and_differing {
        Some(DeviceStatus::Drifted)
    } else {
        status_after(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::decide::{Actual, ReportedState};
    use crate::reconcile::outcome::FailureReason;
    use idem_protocol::SpecDigest;

    fn reporting(version: u64) -> Actual {
        Actual::Reported(ReportedState {
            seq: 1,
            digest: SpecDigest::of(&serde_json::json!({ "v": version })),
            generation: Some(Generation(version)),
            rejection: None,
            drift: None,
        })
    }

    fn wanting(version: u64) -> Desired {
        Desired {
            generation: Generation(version),
            digest: SpecDigest::of(&serde_json::json!({ "v": version })),
        }
    }

    #[test]
    fn only_a_never_reconciled_device_reporting_its_desired_digest_is_converged_by_that_report() {
        let digest = wanting(2).digest;
        assert!(converged_by_report(
            DeviceStatus::Unknown,
            Some(&wanting(2)),
            &digest
        ));
        assert!(!converged_by_report(
            DeviceStatus::Unknown,
            Some(&wanting(3)),
            &digest
        ));
        assert!(!converged_by_report(DeviceStatus::Unknown, None, &digest));
        let never_desired = Desired {
            generation: Generation(0),
            ..wanting(2)
        };
        assert!(!converged_by_report(
            DeviceStatus::Unknown,
            Some(&never_desired),
            &digest
        ));
        for status in DeviceStatus::ALL {
            if status != DeviceStatus::Unknown {
                assert!(
                    !converged_by_report(status, Some(&wanting(2)), &digest),
                    "{status:?}"
                );
            }
        }
    }

    /// A device with `status` and connection `online` that last reported
    /// `actual`.
    fn device(status: DeviceStatus, online: Option<bool>, actual: Actual) -> DeviceEntry {
        DeviceEntry {
            status,
            online,
            reported: match actual {
                Actual::Reported(report) => Some(report),
                Actual::NeverReported => None,
            },
            ..DeviceEntry::default()
        }
    }

    #[test]
    fn only_a_device_that_reports_its_desired_spec_and_may_be_attempted_is_converged_at_creation() {
        let online = Some(true);
        let converged = DeviceStatus::Converged;
        let wants = wanting(2);
        let at_creation =
            |entry: DeviceEntry, force: bool| converged_at_creation(&entry, &wants, force);
        assert!(at_creation(device(converged, online, reporting(2)), false));
        assert!(at_creation(
            device(DeviceStatus::Unknown, None, reporting(2)),
            false
        ));
        assert!(!at_creation(device(converged, online, reporting(1)), false));
        assert!(!at_creation(
            device(converged, online, Actual::NeverReported),
            false
        ));
        assert!(
            !at_creation(device(converged, online, reporting(2)), true),
            "forced"
        );
        assert!(
            !at_creation(device(converged, Some(false), reporting(2)), false),
            "offline"
        );
        assert!(
            !at_creation(
                device(DeviceStatus::Quarantined, online, reporting(2)),
                false
            ),
            "quarantined"
        );
        let exempt = DeviceEntry {
            exempt: true,
            ..device(converged, online, reporting(2))
        };
        assert!(!at_creation(exempt, false), "exempt");
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 4,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(3),
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_quarantines_at_max_attempts() {
        let p = policy();
        assert_eq!(
            p.after_failure(1, 1.0),
            AfterFailure::RetryAfter(Duration::from_secs(1))
        );
        assert_eq!(
            p.after_failure(2, 1.0),
            AfterFailure::RetryAfter(Duration::from_secs(2))
        );
        assert_eq!(
            p.after_failure(3, 1.0),
            AfterFailure::RetryAfter(Duration::from_secs(3))
        );
        assert_eq!(p.after_failure(4, 1.0), AfterFailure::Quarantine);
        assert_eq!(p.after_failure(9, 1.0), AfterFailure::Quarantine);
    }

    #[test]
    fn jitter_shortens_the_delay_by_at_most_half() {
        assert_eq!(
            policy().after_failure(2, 0.5),
            AfterFailure::RetryAfter(Duration::from_secs(1))
        );
        assert_eq!(
            policy().after_failure(2, 0.0),
            AfterFailure::RetryAfter(Duration::from_secs(1))
        );
    }

    #[test]
    fn one_attempt_means_no_retry() {
        let p = RetryPolicy {
            max_attempts: 1,
            ..policy()
        };
        assert_eq!(p.after_failure(1, 1.0), AfterFailure::Quarantine);
    }

    /// A device with `status`, connection `online`, an exemption or not,
    /// and a desired spec or not.
    fn gated(
        status: DeviceStatus,
        online: Option<bool>,
        exempt: bool,
        desired: bool,
    ) -> DeviceEntry {
        let spec = serde_json::json!({ "v": 1 });
        DeviceEntry {
            status,
            online,
            exempt,
            desired: desired.then(|| {
                crate::reconcile::device::DesiredState::new(
                    Generation(1),
                    SpecDigest::of(&spec),
                    std::sync::Arc::new(spec),
                    None,
                )
            }),
            ..DeviceEntry::default()
        }
    }

    #[test]
    fn quarantined_exempt_and_offline_devices_are_not_attempted() {
        let cases = [
            (
                gated(DeviceStatus::Quarantined, Some(true), true, true),
                Some(SkipReason::Quarantined),
            ),
            (
                gated(DeviceStatus::Drifted, Some(false), true, true),
                Some(SkipReason::Exempt),
            ),
            (
                gated(DeviceStatus::Converged, Some(false), false, true),
                Some(SkipReason::Offline),
            ),
            (
                gated(DeviceStatus::Unknown, None, false, false),
                Some(SkipReason::NoDesiredSpec),
            ),
            (gated(DeviceStatus::Failed, None, false, true), None),
            (gated(DeviceStatus::Offline, Some(true), false, true), None),
        ];
        for (entry, expected) in cases {
            assert_eq!(gate(&entry), expected, "{entry:?}");
        }
    }

    #[test]
    fn both_kinds_of_success_leave_the_device_converged() {
        assert_eq!(
            status_after(&Outcome::AlreadyConverged),
            Some(DeviceStatus::Converged)
        );
        assert_eq!(
            status_after(&Outcome::Provisioned),
            Some(DeviceStatus::Converged)
        );
        assert_eq!(
            status_after(&Outcome::Failed(FailureReason::Timeout)),
            Some(DeviceStatus::Failed)
        );
        assert_eq!(status_after(&Outcome::Superseded), None);
    }
}
