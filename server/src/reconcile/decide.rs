//! The decision core: given what should run, what the device last reported and
//! where this run's attempt stands, say what happens next.
//!
//! Pure: no IO, no clock reads, no logging. The engine feeds it facts (including
//! whether a deadline has passed) and carries out the `Decision`.

use std::sync::Arc;

use idem_protocol::{Generation, SpecDigest};

use super::diff::DriftPaths;
use super::outcome::{FailureReason, Outcome};

/// The operator's desired state for one device, as far as deciding needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    pub generation: Generation,
    pub digest: SpecDigest,
}

/// What the device last reported (the accepted report with the highest seq).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Actual {
    NeverReported,
    Reported(ReportedState),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportedState {
    pub seq: u64,
    pub digest: SpecDigest,
    /// The desired generation the device last applied.
    pub generation: Option<Generation>,
    /// The last push the device refused: `(generation, message)`.
    pub rejection: Option<(Generation, String)>,
    /// Where the report differs from the desired spec, as the ingest found
    /// when it stored it (`None`: it matched, or was not compared). For the
    /// `drifted` event only; deciding never reads it.
    pub drift: Option<Arc<DriftPaths>>,
}

/// Where this run's attempt on the device stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// Nothing done yet in this run. `force` pushes even when digests match.
    Fresh { force: bool },
    /// A `get` was sent; `expired` once the report deadline has passed.
    AwaitingReport { expired: bool },
    /// `generation` was pushed when the device's last report had `seq_at_push`;
    /// only a later report can confirm or reject it.
    Pushed {
        generation: Generation,
        seq_at_push: Option<u64>,
        expired: bool,
    },
}

/// What the engine does next for this device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The device's outcome for this run is known.
    Finish(Outcome),
    /// Publish the desired state (retained) and wait for confirmation.
    Push,
    /// Ask the device to report (`get`) and wait.
    AskForReport,
    /// Nothing to do until a report arrives or the deadline passes.
    Wait,
}

/// What a run's first look at a device decides (a fresh attempt): the
/// one step a plan predicts for it (`reconcile::plan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstLook {
    AlreadyConverged,
    Push,
    AskForReport,
}

impl From<FirstLook> for Decision {
    fn from(look: FirstLook) -> Self {
        match look {
            FirstLook::AlreadyConverged => Decision::Finish(Outcome::AlreadyConverged),
            FirstLook::Push => Decision::Push,
            FirstLook::AskForReport => Decision::AskForReport,
        }
    }
}

/// The decision on a fresh attempt (`Attempt::Fresh { force }`).
pub fn first_look(desired: &Desired, actual: &Actual, force: bool) -> FirstLook {
    match actual {
        Actual::NeverReported if force => FirstLook::Push,
        Actual::NeverReported => FirstLook::AskForReport,
        Actual::Reported(report) => check_before_dispatch(desired, report, force),
    }
}

pub fn decide(desired: &Desired, actual: &Actual, attempt: &Attempt) -> Decision {
    match attempt {
        Attempt::Fresh { force } => first_look(desired, actual, *force).into(),
        Attempt::AwaitingReport { expired } => match actual {
            Actual::NeverReported if *expired => {
                Decision::Finish(Outcome::Failed(FailureReason::NoReport))
            }
            Actual::NeverReported => Decision::Wait,
            Actual::Reported(report) => check_before_dispatch(desired, report, false).into(),
        },
        Attempt::Pushed {
            generation,
            seq_at_push,
            expired,
        } => {
            if *generation != desired.generation {
                return Decision::Finish(Outcome::Superseded);
            }
            let answer = match actual {
                Actual::Reported(report) if seq_at_push.is_none_or(|s| report.seq > s) => {
                    answer_to_push(desired, report, *generation)
                }
                Actual::Reported(_) | Actual::NeverReported => None,
            };
            match answer {
                Some(outcome) => Decision::Finish(outcome),
                None if *expired => Decision::Finish(Outcome::Failed(FailureReason::Timeout)),
                None => Decision::Wait,
            }
        }
    }
}

/// Check before dispatch: push only when the reported digest differs.
fn check_before_dispatch(desired: &Desired, report: &ReportedState, force: bool) -> FirstLook {
    if !force && report.digest == desired.digest {
        FirstLook::AlreadyConverged
    } else {
        FirstLook::Push
    }
}

/// What a report sent after the push says about the pushed generation, if
/// anything: it may still be about an older state.
fn answer_to_push(
    desired: &Desired,
    report: &ReportedState,
    pushed: Generation,
) -> Option<Outcome> {
    if let Some((rejected, message)) = &report.rejection {
        if *rejected == pushed {
            return Some(Outcome::Failed(FailureReason::Rejected {
                message: message.clone(),
            }));
        }
    }
    if report.generation != Some(pushed) {
        return None;
    }
    if report.digest == desired.digest {
        Some(Outcome::Provisioned)
    } else {
        Some(Outcome::Failed(FailureReason::AppliedSpecDiffers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::outcome::OutcomeKind;
    use proptest::prelude::*;
    use serde_json::json;

    fn digest(version: u64) -> SpecDigest {
        SpecDigest::of(&json!({ "firmware": version }))
    }

    fn desired() -> Desired {
        Desired {
            generation: Generation(2),
            digest: digest(2),
        }
    }

    /// The five situations a device can be in when deciding, for a device that
    /// had generation 2 pushed after its report with seq 10.
    #[derive(Debug, Clone, Copy)]
    enum Situation {
        NoReport,
        MatchingDigest,
        DifferentDigest,
        DeviceError,
        Timeout,
    }

    const ALL_SITUATIONS: [Situation; 5] = [
        Situation::NoReport,
        Situation::MatchingDigest,
        Situation::DifferentDigest,
        Situation::DeviceError,
        Situation::Timeout,
    ];

    /// Actual state and expiry for a situation; reports are newer than the push.
    fn facts(situation: Situation) -> (Actual, bool) {
        let report = |d: SpecDigest, generation, rejection| {
            Actual::Reported(ReportedState {
                seq: 11,
                digest: d,
                generation,
                rejection,
                drift: None,
            })
        };
        match situation {
            Situation::NoReport => (Actual::NeverReported, false),
            Situation::MatchingDigest => (report(digest(2), Some(Generation(2)), None), false),
            Situation::DifferentDigest => (report(digest(1), Some(Generation(1)), None), false),
            Situation::DeviceError => (
                report(
                    digest(1),
                    Some(Generation(1)),
                    Some((Generation(2), "flash full".to_owned())),
                ),
                false,
            ),
            Situation::Timeout => (report(digest(1), Some(Generation(1)), None), true),
        }
    }

    fn rejected() -> Decision {
        Decision::Finish(Outcome::Failed(FailureReason::Rejected {
            message: "flash full".to_owned(),
        }))
    }

    #[test]
    fn a_fresh_attempt_pushes_only_when_digests_differ() {
        for situation in ALL_SITUATIONS {
            let (actual, _) = facts(situation);
            let expected = match situation {
                Situation::NoReport => Decision::AskForReport,
                Situation::MatchingDigest => Decision::Finish(Outcome::AlreadyConverged),
                // An old rejection or an old deadline does not stop a new attempt.
                Situation::DifferentDigest | Situation::DeviceError | Situation::Timeout => {
                    Decision::Push
                }
            };
            let got = decide(&desired(), &actual, &Attempt::Fresh { force: false });
            assert_eq!(got, expected, "{situation:?}");
        }
    }

    #[test]
    fn a_forced_attempt_pushes_in_every_situation() {
        for situation in ALL_SITUATIONS {
            let (actual, _) = facts(situation);
            let got = decide(&desired(), &actual, &Attempt::Fresh { force: true });
            assert_eq!(got, Decision::Push, "{situation:?}");
        }
    }

    #[test]
    fn an_attempt_awaiting_a_report_decides_once_the_report_arrives() {
        for situation in ALL_SITUATIONS {
            let (actual, expired) = facts(situation);
            let expected = match situation {
                Situation::NoReport => Decision::Wait,
                Situation::MatchingDigest => Decision::Finish(Outcome::AlreadyConverged),
                Situation::DifferentDigest | Situation::DeviceError | Situation::Timeout => {
                    Decision::Push
                }
            };
            let got = decide(&desired(), &actual, &Attempt::AwaitingReport { expired });
            assert_eq!(got, expected, "{situation:?}");
        }
    }

    #[test]
    fn a_device_that_never_reports_fails_when_the_report_deadline_passes() {
        let got = decide(
            &desired(),
            &Actual::NeverReported,
            &Attempt::AwaitingReport { expired: true },
        );
        assert_eq!(
            got,
            Decision::Finish(Outcome::Failed(FailureReason::NoReport))
        );
    }

    #[test]
    fn a_pushed_attempt_ends_on_confirmation_rejection_or_timeout() {
        for situation in ALL_SITUATIONS {
            let (actual, expired) = facts(situation);
            let expected = match situation {
                Situation::NoReport | Situation::DifferentDigest => Decision::Wait,
                Situation::MatchingDigest => Decision::Finish(Outcome::Provisioned),
                Situation::DeviceError => rejected(),
                Situation::Timeout => Decision::Finish(Outcome::Failed(FailureReason::Timeout)),
            };
            let attempt = Attempt::Pushed {
                generation: Generation(2),
                seq_at_push: Some(10),
                expired,
            };
            assert_eq!(
                decide(&desired(), &actual, &attempt),
                expected,
                "{situation:?}"
            );
        }
    }

    #[test]
    fn reports_older_than_the_push_never_confirm_it() {
        let old = Actual::Reported(ReportedState {
            seq: 10,
            digest: digest(2),
            generation: Some(Generation(2)),
            rejection: None,
            drift: None,
        });
        let attempt = Attempt::Pushed {
            generation: Generation(2),
            seq_at_push: Some(10),
            expired: false,
        };
        assert_eq!(decide(&desired(), &old, &attempt), Decision::Wait);
    }

    #[test]
    fn a_changed_desired_generation_supersedes_the_push_in_flight() {
        let (actual, _) = facts(Situation::MatchingDigest);
        let attempt = Attempt::Pushed {
            generation: Generation(1),
            seq_at_push: Some(10),
            expired: false,
        };
        assert_eq!(
            decide(&desired(), &actual, &attempt),
            Decision::Finish(Outcome::Superseded)
        );
    }

    #[test]
    fn a_rejection_of_another_generation_is_not_an_answer() {
        let actual = Actual::Reported(ReportedState {
            seq: 11,
            digest: digest(1),
            generation: Some(Generation(1)),
            rejection: Some((Generation(1), "old news".to_owned())),
            drift: None,
        });
        let attempt = Attempt::Pushed {
            generation: Generation(2),
            seq_at_push: Some(10),
            expired: false,
        };
        assert_eq!(decide(&desired(), &actual, &attempt), Decision::Wait);
    }

    #[test]
    fn claiming_the_generation_with_another_spec_is_a_failure() {
        let actual = Actual::Reported(ReportedState {
            seq: 11,
            digest: digest(7),
            generation: Some(Generation(2)),
            rejection: None,
            drift: None,
        });
        let attempt = Attempt::Pushed {
            generation: Generation(2),
            seq_at_push: Some(10),
            expired: false,
        };
        assert_eq!(
            decide(&desired(), &actual, &attempt),
            Decision::Finish(Outcome::Failed(FailureReason::AppliedSpecDiffers))
        );
    }

    fn arb_actual() -> impl Strategy<Value = Actual> {
        let report = (
            0u64..1_000,
            0u64..4,
            proptest::option::of(0u64..4),
            proptest::option::of((0u64..4, "[a-z]{0,6}")),
        )
            .prop_map(|(seq, spec, generation, rejection)| {
                Actual::Reported(ReportedState {
                    seq,
                    digest: digest(spec),
                    generation: generation.map(Generation),
                    rejection: rejection.map(|(g, message)| (Generation(g), message)),
                    drift: None,
                })
            });
        prop_oneof![Just(Actual::NeverReported), report]
    }

    /// The device's state after it applied `desired` and reported.
    fn apply_push(desired: &Desired, before: &Actual) -> Actual {
        let seq = match before {
            Actual::NeverReported => 0,
            Actual::Reported(r) => r.seq + 1,
        };
        Actual::Reported(ReportedState {
            seq,
            digest: desired.digest,
            generation: Some(desired.generation),
            rejection: None,
            drift: None,
        })
    }

    fn seq_of(actual: &Actual) -> Option<u64> {
        match actual {
            Actual::NeverReported => None,
            Actual::Reported(r) => Some(r.seq),
        }
    }

    proptest! {
        #[test]
        fn applying_a_push_and_deciding_again_yields_already_converged(
            generation in 1u64..4,
            spec in 0u64..4,
            actual in arb_actual(),
            force in any::<bool>(),
        ) {
            let desired = Desired { generation: Generation(generation), digest: digest(spec) };
            let decision = decide(&desired, &actual, &Attempt::Fresh { force });
            if decision == Decision::Push {
                let after = apply_push(&desired, &actual);
                let confirm = Attempt::Pushed {
                    generation: Generation(generation),
                    seq_at_push: seq_of(&actual),
                    expired: false,
                };
                prop_assert_eq!(decide(&desired, &after, &confirm), Decision::Finish(Outcome::Provisioned));
                prop_assert_eq!(
                    decide(&desired, &after, &Attempt::Fresh { force: false }),
                    Decision::Finish(Outcome::AlreadyConverged)
                );
            }
        }

        #[test]
        fn every_expired_attempt_finishes(
            spec in 0u64..4,
            actual in arb_actual(),
            pushed in 1u64..4,
        ) {
            let desired = Desired { generation: Generation(2), digest: digest(spec) };
            for attempt in [
                Attempt::AwaitingReport { expired: true },
                Attempt::Pushed { generation: Generation(pushed), seq_at_push: seq_of(&actual), expired: true },
            ] {
                let decision = decide(&desired, &actual, &attempt);
                let finished_or_retried = match &decision {
                    Decision::Finish(outcome) => outcome.kind() != OutcomeKind::Skipped,
                    Decision::Push => matches!(attempt, Attempt::AwaitingReport { .. }),
                    Decision::AskForReport | Decision::Wait => false,
                };
                prop_assert!(finished_or_retried, "{:?} then {:?}", attempt, decision);
            }
        }
    }
}
