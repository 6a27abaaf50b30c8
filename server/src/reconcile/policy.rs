//! Pure policies around `decide`: which devices a run does not attempt (or
//! decides while it is created), how long to wait before retrying a failed
//! push, the device status an outcome leaves behind, and the one a report
//! alone sets. No IO, no clock, no randomness (jitter is an input).

use std::time::Duration;

pub use idem_protocol::DeviceStatus;

use std::collections::HashMap;

use idem_protocol::{Backoff, DeviceId, Health, SpecDigest};

use super::decide::{first_look, Actual, Desired, FirstLook};
use super::outcome::{Outcome, SkipReason};
use crate::reconcile::change::DeviceChange;
use crate::reconcile::device::DeviceEntry;

/// Why a device with a desired spec is not attempted, if it is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    Quarantined,
    Offline,
}

impl From<Blocked> for SkipReason {
    fn from(blocked: Blocked) -> Self {
        match blocked {
            Blocked::Quarantined => SkipReason::Quarantined,
            Blocked::Offline => SkipReason::Offline,
        }
    }
}

/// Whether a device's status or connection keeps a run from attempting it.
pub fn blocked(status: DeviceStatus, online: Option<bool>) -> Option<Blocked> {
    if status == DeviceStatus::Quarantined {
        Some(Blocked::Quarantined)
    } else if online == Some(false) {
        Some(Blocked::Offline)
    } else {
        None
    }
}

/// Why a run does not attempt a device at all, if it does not.
pub fn gate(status: DeviceStatus, online: Option<bool>, has_desired: bool) -> Option<SkipReason> {
    if let Some(blocked) = blocked(status, online) {
        Some(blocked.into())
    } else if !has_desired {
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
pub fn converged_at_creation(
    status: DeviceStatus,
    online: Option<bool>,
    desired: Option<&Desired>,
    actual: &Actual,
    force: bool,
) -> bool {
    let Some(desired) = desired else {
        return false;
    };
    if force || gate(status, online, true).is_some() {
        return false;
    }
    match first_look(desired, actual, force) {
        FirstLook::AlreadyConverged => true,
        FirstLook::Push | FirstLook::AskForReport => false,
    }
}

/// A target decided `already_converged` at creation.
pub struct Converged {
    pub id: DeviceId,
    pub generation: u64,
    pub health: Option<Health>,
    /// What its row must change (`None`: nothing; a converged device's
    /// row is not rewritten).
    pub change: Option<DeviceChange>,
}

/// The targets of a new run decided `already_converged` at its creation
/// ([`converged_at_creation`]), judged on `view` — the state machine's view
/// of each device (cache plus changes not yet written) — with the desired
/// change the run makes (`new_digest`, and the generations it gave each
/// device), and what each one's row must change.
pub fn converged_targets(
    view: impl Fn(&DeviceId) -> Option<DeviceEntry>,
    targets: &[DeviceId],
    force: bool,
    new_digest: Option<SpecDigest>,
    new_generations: &HashMap<&str, u64>,
) -> Vec<Converged> {
    // Targets are distinct (the API and the engine's own runs deduplicate).
    let mut converged = Vec::new();
    for id in targets {
        let Some(entry) = view(id) else {
            continue;
        };
        let desired = match (new_digest, entry.desired_for_decision()) {
            (Some(digest), current) => Some(Desired {
                generation: new_generations
                    .get(id.as_str())
                    .copied()
                    .or(current.map(|d| d.generation))
                    .unwrap_or(0),
                digest,
            }),
            (None, current) => current,
        };
        let Some(desired) = desired.filter(|d| d.generation > 0) else {
            continue;
        };
        if !converged_at_creation(
            entry.status,
            entry.online,
            Some(&desired),
            &entry.actual(),
            force,
        ) {
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
        && desired.is_some_and(|d| d.generation > 0 && d.digest == *reported)
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
pub fn status_after(outcome: &Outcome) -> Option<DeviceStatus> {
    match outcome {
        Outcome::Provisioned | Outcome::AlreadyConverged => Some(DeviceStatus::Converged),
        Outcome::Failed(_) => Some(DeviceStatus::Failed),
        Outcome::Skipped(SkipReason::Offline) => Some(DeviceStatus::Offline),
        Outcome::Skipped(SkipReason::Quarantined) => Some(DeviceStatus::Quarantined),
        Outcome::Skipped(SkipReason::NoDesiredSpec | SkipReason::Deleted) | Outcome::Superseded => {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::decide::ReportedState;
    use crate::reconcile::outcome::FailureReason;
    use idem_protocol::SpecDigest;

    fn reporting(version: u64) -> Actual {
        Actual::Reported(ReportedState {
            seq: 1,
            digest: SpecDigest::of(&serde_json::json!({ "v": version })),
            generation: Some(version),
            rejection: None,
        })
    }

    fn wanting(version: u64) -> Desired {
        Desired {
            generation: version,
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
            generation: 0,
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

    #[test]
    fn only_a_device_that_reports_its_desired_spec_and_may_be_attempted_is_converged_at_creation() {
        let online = Some(true);
        let converged = DeviceStatus::Converged;
        assert!(converged_at_creation(
            converged,
            online,
            Some(&wanting(2)),
            &reporting(2),
            false
        ));
        assert!(converged_at_creation(
            DeviceStatus::Unknown,
            None,
            Some(&wanting(2)),
            &reporting(2),
            false
        ));
        assert!(!converged_at_creation(
            converged,
            online,
            Some(&wanting(2)),
            &reporting(1),
            false
        ));
        assert!(!converged_at_creation(
            converged,
            online,
            Some(&wanting(2)),
            &Actual::NeverReported,
            false
        ));
        assert!(
            !converged_at_creation(converged, online, Some(&wanting(2)), &reporting(2), true),
            "forced"
        );
        assert!(
            !converged_at_creation(
                converged,
                Some(false),
                Some(&wanting(2)),
                &reporting(2),
                false
            ),
            "offline"
        );
        assert!(!converged_at_creation(
            DeviceStatus::Quarantined,
            online,
            Some(&wanting(2)),
            &reporting(2),
            false
        ));
        assert!(
            !converged_at_creation(converged, online, None, &reporting(2), false),
            "no desired spec"
        );
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

    #[test]
    fn quarantined_and_offline_devices_are_not_attempted() {
        assert_eq!(
            gate(DeviceStatus::Quarantined, Some(true), true),
            Some(SkipReason::Quarantined)
        );
        assert_eq!(
            gate(DeviceStatus::Converged, Some(false), true),
            Some(SkipReason::Offline)
        );
        assert_eq!(
            gate(DeviceStatus::Unknown, None, false),
            Some(SkipReason::NoDesiredSpec)
        );
        assert_eq!(gate(DeviceStatus::Failed, None, true), None);
        assert_eq!(gate(DeviceStatus::Offline, Some(true), true), None);
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
