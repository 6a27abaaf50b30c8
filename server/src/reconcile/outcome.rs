//! The `Outcome` of one device in one run and its reasons. The names shared
//! with clients (`OutcomeKind`, `OutcomeCounts` and the summary line) live in
//! `idem_protocol::outcome` and are re-exported here.
//!
//! Every consumer matches `Outcome` exhaustively, with no `_ =>` arm, so that a
//! new variant makes the compiler list each place that must learn about it.

use std::fmt;

pub use idem_protocol::outcome::{OutcomeCounts, OutcomeKind};

/// What happened to one device in one run. Exactly one per device per run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Pushed, and the device confirmed the desired generation.
    Provisioned,
    /// The reported spec already matched: nothing was pushed.
    AlreadyConverged,
    /// Rejected by the device, timed out, or retries exhausted.
    Failed(FailureReason),
    /// Not attempted.
    Skipped(SkipReason),
    /// The desired state changed before this attempt finished.
    Superseded,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureReason {
    /// The device refused the pushed generation, with its own message.
    Rejected { message: String },
    /// The device did not confirm the pushed generation in time.
    Timeout,
    /// The device was asked to report (`get`) and never did.
    NoReport,
    /// The device claims the pushed generation but reports a different spec.
    AppliedSpecDiffers,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    Offline,
    Quarantined,
    /// An operator exempted the device from remediation (`POST /v1/exemptions`).
    Exempt,
    /// The device has no desired spec, so there is nothing to reconcile.
    NoDesiredSpec,
    /// The device was deleted while the run waited for it.
    Deleted,
    /// An operator aborted the rollout before the device was pushed.
    Aborted,
}

impl Outcome {
    pub fn kind(&self) -> OutcomeKind {
        match self {
            Outcome::Provisioned => OutcomeKind::Provisioned,
            Outcome::AlreadyConverged => OutcomeKind::AlreadyConverged,
            Outcome::Failed(_) => OutcomeKind::Failed,
            Outcome::Skipped(_) => OutcomeKind::Skipped,
            Outcome::Superseded => OutcomeKind::Superseded,
        }
    }

    /// Human-readable reason for failures and skips; `None` otherwise.
    pub fn reason(&self) -> Option<String> {
        match self {
            Outcome::Provisioned | Outcome::AlreadyConverged | Outcome::Superseded => None,
            Outcome::Failed(reason) => Some(reason.to_string()),
            Outcome::Skipped(reason) => Some(reason.to_string()),
        }
    }

    /// Success for success rates: both ways of ending converged count.
    pub fn is_success(&self) -> bool {
        match self {
            Outcome::Provisioned | Outcome::AlreadyConverged => true,
            Outcome::Failed(_) | Outcome::Skipped(_) | Outcome::Superseded => false,
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureReason::Rejected { message } => write!(f, "rejected by device: {message}"),
            FailureReason::Timeout => {
                f.write_str("timeout: device did not confirm the pushed generation in time")
            }
            FailureReason::NoReport => f.write_str("timeout: device never reported its state"),
            FailureReason::AppliedSpecDiffers => {
                f.write_str("device reported the pushed generation with a different spec")
            }
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SkipReason::Offline => "offline",
            SkipReason::Quarantined => "quarantined",
            SkipReason::Exempt => "exempt",
            SkipReason::NoDesiredSpec => "no desired spec",
            SkipReason::Deleted => "device deleted",
            SkipReason::Aborted => "aborted",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn already_converged_counts_as_success() {
        assert!(Outcome::AlreadyConverged.is_success());
        assert!(Outcome::Provisioned.is_success());
        assert!(!Outcome::Failed(FailureReason::Timeout).is_success());
        assert!(!Outcome::Skipped(SkipReason::Offline).is_success());
        assert!(!Outcome::Superseded.is_success());
    }

    #[test]
    fn failures_and_skips_carry_the_reason_operators_read() {
        let cases = [
            (
                Outcome::Failed(FailureReason::Rejected {
                    message: "flash full".to_owned(),
                }),
                Some("rejected by device: flash full"),
            ),
            (
                Outcome::Failed(FailureReason::Timeout),
                Some("timeout: device did not confirm the pushed generation in time"),
            ),
            (
                Outcome::Failed(FailureReason::NoReport),
                Some("timeout: device never reported its state"),
            ),
            (
                Outcome::Failed(FailureReason::AppliedSpecDiffers),
                Some("device reported the pushed generation with a different spec"),
            ),
            (Outcome::Skipped(SkipReason::Offline), Some("offline")),
            (
                Outcome::Skipped(SkipReason::Quarantined),
                Some("quarantined"),
            ),
            (
                Outcome::Skipped(SkipReason::NoDesiredSpec),
                Some("no desired spec"),
            ),
            (
                Outcome::Skipped(SkipReason::Deleted),
                Some("device deleted"),
            ),
            (Outcome::Skipped(SkipReason::Aborted), Some("aborted")),
            (Outcome::Provisioned, None),
            (Outcome::AlreadyConverged, None),
            (Outcome::Superseded, None),
        ];
        for (outcome, reason) in cases {
            assert_eq!(outcome.reason().as_deref(), reason, "{outcome:?}");
        }
    }
}
