//! The `Outcome` of one device in one run, its reasons, and the per-run counts
//! and summary line built from outcomes.
//!
//! Every consumer matches `Outcome` exhaustively, with no `_ =>` arm, so that a
//! new variant makes the compiler list each place that must learn about it.

use std::fmt;

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
    /// The device has no desired spec, so there is nothing to reconcile.
    NoDesiredSpec,
    /// The device was deleted while the run waited for it.
    Deleted,
}

/// The outcome without its reason: the label value used in storage,
/// metrics and event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OutcomeKind {
    AlreadyConverged,
    Provisioned,
    Failed,
    Skipped,
    Superseded,
}

impl OutcomeKind {
    /// All kinds, in summary order.
    pub const ALL: [OutcomeKind; 5] = [
        OutcomeKind::AlreadyConverged,
        OutcomeKind::Provisioned,
        OutcomeKind::Failed,
        OutcomeKind::Skipped,
        OutcomeKind::Superseded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeKind::AlreadyConverged => "already_converged",
            OutcomeKind::Provisioned => "provisioned",
            OutcomeKind::Failed => "failed",
            OutcomeKind::Skipped => "skipped",
            OutcomeKind::Superseded => "superseded",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        OutcomeKind::ALL.into_iter().find(|k| k.as_str() == raw)
    }
}

impl fmt::Display for OutcomeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
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
            SkipReason::NoDesiredSpec => "no desired spec",
            SkipReason::Deleted => "device deleted",
        })
    }
}

/// Number of devices per outcome in one run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OutcomeCounts {
    pub already_converged: u64,
    pub provisioned: u64,
    pub failed: u64,
    pub skipped: u64,
    pub superseded: u64,
}

impl OutcomeCounts {
    pub fn add(&mut self, kind: OutcomeKind) {
        *self.slot(kind) += 1;
    }

    pub fn get(&self, kind: OutcomeKind) -> u64 {
        match kind {
            OutcomeKind::AlreadyConverged => self.already_converged,
            OutcomeKind::Provisioned => self.provisioned,
            OutcomeKind::Failed => self.failed,
            OutcomeKind::Skipped => self.skipped,
            OutcomeKind::Superseded => self.superseded,
        }
    }

    fn slot(&mut self, kind: OutcomeKind) -> &mut u64 {
        match kind {
            OutcomeKind::AlreadyConverged => &mut self.already_converged,
            OutcomeKind::Provisioned => &mut self.provisioned,
            OutcomeKind::Failed => &mut self.failed,
            OutcomeKind::Skipped => &mut self.skipped,
            OutcomeKind::Superseded => &mut self.superseded,
        }
    }

    pub fn total(&self) -> u64 {
        OutcomeKind::ALL.iter().map(|k| self.get(*k)).sum()
    }

    /// The summary line (see `idem_protocol::summary::summary_line`).
    pub fn summary(&self) -> String {
        idem_protocol::summary::summary_line(
            self.already_converged,
            self.provisioned,
            self.failed,
            self.skipped,
            self.superseded,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_the_three_main_outcomes_even_when_zero() {
        let counts = OutcomeCounts {
            already_converged: 9_996,
            provisioned: 4,
            ..OutcomeCounts::default()
        };
        assert_eq!(
            counts.summary(),
            "9,996 already converged, 4 provisioned, 0 failed"
        );
    }

    #[test]
    fn summary_adds_skipped_and_superseded_only_when_non_zero() {
        let counts = OutcomeCounts {
            already_converged: 1,
            provisioned: 2,
            failed: 3,
            skipped: 4,
            superseded: 0,
        };
        assert_eq!(
            counts.summary(),
            "1 already converged, 2 provisioned, 3 failed, 4 skipped"
        );
        let counts = OutcomeCounts {
            superseded: 1_000_000,
            ..OutcomeCounts::default()
        };
        assert_eq!(
            counts.summary(),
            "0 already converged, 0 provisioned, 0 failed, 1,000,000 superseded"
        );
    }

    #[test]
    fn already_converged_counts_as_success() {
        assert!(Outcome::AlreadyConverged.is_success());
        assert!(Outcome::Provisioned.is_success());
        assert!(!Outcome::Failed(FailureReason::Timeout).is_success());
        assert!(!Outcome::Skipped(SkipReason::Offline).is_success());
        assert!(!Outcome::Superseded.is_success());
    }

    #[test]
    fn counts_add_up_per_kind_and_in_total() {
        let mut counts = OutcomeCounts::default();
        for (kind, n) in OutcomeKind::ALL.into_iter().zip(1..) {
            for _ in 0..n {
                counts.add(kind);
            }
        }
        assert_eq!(
            counts,
            OutcomeCounts {
                already_converged: 1,
                provisioned: 2,
                failed: 3,
                skipped: 4,
                superseded: 5,
            }
        );
        for (kind, n) in OutcomeKind::ALL.into_iter().zip(1..) {
            assert_eq!(counts.get(kind), n, "{kind}");
        }
        assert_eq!(counts.total(), 15);
        assert_eq!(OutcomeCounts::default().total(), 0);
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
            (Outcome::Provisioned, None),
            (Outcome::AlreadyConverged, None),
            (Outcome::Superseded, None),
        ];
        for (outcome, reason) in cases {
            assert_eq!(outcome.reason().as_deref(), reason, "{outcome:?}");
        }
    }

    #[test]
    fn outcome_kinds_round_trip_through_their_names() {
        for kind in OutcomeKind::ALL {
            assert_eq!(OutcomeKind::parse(kind.as_str()), Some(kind));
            assert_eq!(kind.to_string(), kind.as_str());
        }
        assert_eq!(OutcomeKind::parse("converged"), None);
    }
}
