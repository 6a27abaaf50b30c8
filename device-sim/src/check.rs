//! The ground-truth check: compares the per-device outcomes a server
//! reported for a run with what the simulator knows each device must end
//! with ([`Plan::expected`]). Pure: it judges rows it is given and performs
//! no IO, so a test can feed it fabricated answers.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use idem_protocol::{DeviceId, OutcomeKind};
use serde::Serialize;

use crate::api::OutcomeRow;
use crate::behaviour::DeviceBehaviour;
use crate::plan::{ExpectedOutcome, Plan};

/// One device whose outcome differs from the ground truth.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    pub device: String,
    /// What the simulator knows the outcome must be; `None` for a device the
    /// simulator does not know (the server reported an outcome for a device
    /// outside the simulated fleet).
    pub expected: Option<ExpectedOutcome>,
    /// What the server said: an outcome name, `undecided`, or `None` when the
    /// device is missing from the run's outcomes.
    pub actual: Option<String>,
    /// The server's reason, when it gave one.
    pub reason: Option<String>,
    /// Why this counts as a mismatch, in words.
    pub problem: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.device, self.problem)?;
        if let Some(reason) = &self.reason {
            write!(f, " (server's reason: {reason})")?;
        }
        Ok(())
    }
}

/// The verdict over a whole run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GroundTruthCheck {
    /// Devices of the plan that were checked.
    pub checked: usize,
    /// Every difference, sorted by device id.
    pub mismatches: Vec<Mismatch>,
}

impl GroundTruthCheck {
    pub fn passed(&self) -> bool {
        self.mismatches.is_empty()
    }

    /// The mismatching device ids, sorted.
    pub fn mismatching_devices(&self) -> Vec<&str> {
        self.mismatches.iter().map(|m| m.device.as_str()).collect()
    }
}

/// Checks `rows` (a run's outcomes as the server reported them) against the
/// plan's ground truth:
///
/// * every planned device must have exactly one row, with a decided outcome
///   equal to [`Plan::expected`];
/// * a device that rejects pushes must fail *because it rejected*: the
///   server's reason must quote the device's own message;
/// * rows for devices outside the plan, and duplicate rows, are mismatches.
pub fn check_outcomes(plan: &Plan, rows: &[OutcomeRow]) -> GroundTruthCheck {
    let reject_messages: BTreeMap<&DeviceId, &str> = plan
        .devices
        .iter()
        .filter_map(|d| match &d.behaviour {
            DeviceBehaviour::Reject { message } => Some((&d.id, message.as_str())),
            DeviceBehaviour::Accept
            | DeviceBehaviour::RejectTimes { .. }
            | DeviceBehaviour::IgnorePushes
            | DeviceBehaviour::Silent => None,
        })
        .collect();
    let mut by_device: BTreeMap<&str, &OutcomeRow> = BTreeMap::new();
    let mut mismatches = Vec::new();
    let mut duplicates = BTreeSet::new();
    for row in rows {
        if by_device.insert(row.device_id.as_str(), row).is_some() {
            duplicates.insert(row.device_id.as_str());
        }
    }
    for device in duplicates {
        mismatches.push(Mismatch {
            device: device.to_owned(),
            expected: DeviceId::parse(device)
                .ok()
                .and_then(|id| plan.expected(&id)),
            actual: None,
            reason: None,
            problem: "the server listed this device more than once in one run".to_owned(),
        });
    }
    for (id, want) in &plan.expected {
        let Some(row) = by_device.remove(id.as_str()) else {
            mismatches.push(Mismatch {
                device: id.to_string(),
                expected: Some(*want),
                actual: None,
                reason: None,
                problem: format!("expected {want}, but the run has no outcome for it"),
            });
            continue;
        };
        let problem = match row.outcome {
            None => Some(format!("expected {want}, but it is still undecided")),
            Some(got) if ground_truth_of(got) != Some(*want) => {
                Some(format!("expected {want}, server says {got}"))
            }
            Some(_) => reject_messages.get(id).and_then(|message| {
                let quoted = row.reason.as_deref().is_some_and(|r| r.contains(message));
                (!quoted).then(|| {
                    format!("failed as expected, but not with the device's rejection {message:?}")
                })
            }),
        };
        if let Some(problem) = problem {
            mismatches.push(Mismatch {
                device: id.to_string(),
                expected: Some(*want),
                actual: Some(
                    row.outcome
                        .map_or("undecided", OutcomeKind::as_str)
                        .to_owned(),
                ),
                reason: row.reason.clone(),
                problem,
            });
        }
    }
    for (device, row) in by_device {
        mismatches.push(Mismatch {
            device: device.to_owned(),
            expected: None,
            actual: row.outcome.map(|kind| kind.as_str().to_owned()),
            reason: row.reason.clone(),
            problem: "not part of the simulated fleet, yet the run has an outcome for it"
                .to_owned(),
        });
    }
    mismatches.sort_by(|a, b| a.device.cmp(&b.device));
    GroundTruthCheck {
        checked: plan.expected.len(),
        mismatches,
    }
}

/// The ground truth a server's outcome stands for; `None` for outcomes no
/// planned device may end its first run with (it is online, has a desired
/// spec and nothing supersedes the run).
fn ground_truth_of(kind: OutcomeKind) -> Option<ExpectedOutcome> {
    match kind {
        OutcomeKind::AlreadyConverged => Some(ExpectedOutcome::AlreadyConverged),
        OutcomeKind::Provisioned => Some(ExpectedOutcome::Provisioned),
        OutcomeKind::Failed => Some(ExpectedOutcome::Failed),
        OutcomeKind::Skipped | OutcomeKind::Superseded => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{FleetPlan, DEFAULT_REJECT_MESSAGE};

    fn plan() -> Plan {
        FleetPlan::new("d-", 20)
            .drifted(3)
            .rejecting(2)
            .seed(5)
            .build()
            .unwrap()
    }

    /// What a correct server answers for `plan`.
    fn correct_answer(plan: &Plan) -> Vec<OutcomeRow> {
        plan.expected
            .iter()
            .map(|(id, outcome)| OutcomeRow {
                device_id: id.to_string(),
                outcome: Some(outcome.kind()),
                reason: (*outcome == ExpectedOutcome::Failed)
                    .then(|| format!("rejected by device: {DEFAULT_REJECT_MESSAGE}")),
                generation: None,
                health: None,
                decided_at: None,
            })
            .collect()
    }

    #[test]
    fn a_correct_server_answer_passes_the_check() {
        let plan = plan();
        let check = check_outcomes(&plan, &correct_answer(&plan));
        assert!(check.passed(), "{:?}", check.mismatches);
        assert_eq!(check.checked, 20);
    }

    #[test]
    fn the_checker_catches_a_fabricated_server_answer_and_names_the_devices() {
        let plan = plan();
        let mut rows = correct_answer(&plan);
        let drifted = plan.ids_expecting(ExpectedOutcome::Provisioned);
        let converged = plan.ids_expecting(ExpectedOutcome::AlreadyConverged);
        let rejecting = plan.ids_expecting(ExpectedOutcome::Failed);
        for row in &mut rows {
            // The classic lie: "provisioned" for a device that needed nothing…
            if row.device_id == converged[0].as_str() {
                row.outcome = Some(OutcomeKind::Provisioned);
            }
            // …"already converged" for one that was off-spec…
            if row.device_id == drifted[0].as_str() {
                row.outcome = Some(OutcomeKind::AlreadyConverged);
            }
            // …a failure blamed on something the device never said…
            if row.device_id == rejecting[0].as_str() {
                row.reason = Some("timeout: device did not confirm".into());
            }
            // …and a device left undecided.
            if row.device_id == converged[1].as_str() {
                row.outcome = None;
            }
        }
        // A device dropped from the answer and one that is not ours.
        rows.retain(|r| r.device_id != converged[2].as_str());
        rows.push(OutcomeRow {
            device_id: "stranger-1".into(),
            outcome: Some(OutcomeKind::Provisioned),
            reason: None,
            generation: None,
            health: None,
            decided_at: None,
        });

        let check = check_outcomes(&plan, &rows);
        assert!(!check.passed());
        let mut named = vec![
            converged[0].as_str(),
            converged[1].as_str(),
            converged[2].as_str(),
            drifted[0].as_str(),
            rejecting[0].as_str(),
            "stranger-1",
        ];
        named.sort_unstable();
        assert_eq!(check.mismatching_devices(), named);
        let lie = check
            .mismatches
            .iter()
            .find(|m| m.device == converged[0].as_str())
            .unwrap();
        assert_eq!(
            lie.to_string(),
            format!(
                "{}: expected already_converged, server says provisioned",
                converged[0]
            )
        );
        let missing = check
            .mismatches
            .iter()
            .find(|m| m.device == converged[2].as_str())
            .unwrap();
        assert_eq!(missing.actual, None);
    }

    #[test]
    fn a_device_listed_twice_is_a_mismatch() {
        let plan = plan();
        let mut rows = correct_answer(&plan);
        rows.push(rows[0].clone());
        let check = check_outcomes(&plan, &rows);
        assert_eq!(check.mismatching_devices(), [rows[0].device_id.as_str()]);
    }
}
