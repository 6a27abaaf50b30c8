//! A run's one home: why it started (`Trigger`), what it covers (`RunSpec`),
//! how far it is (`RunProgress`, which owns completion) and the data of its
//! `run.completed` event.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use idem_protocol::DeviceId;
pub use idem_protocol::Trigger;
use uuid::Uuid;

use super::outcome::{OutcomeCounts, OutcomeKind};
use crate::reconcile::event_draft::EventDraft;
use idem_protocol::event::RunCompletedData;

/// Most device outcomes listed in a `run.completed` event; the full list
/// stays queryable through the API.
pub const COMPLETED_EVENT_OUTCOME_CAP: usize = 1_000;

/// A committed run, as the engine starts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSpec {
    pub id: Uuid,
    pub trigger: Trigger,
    /// The targets still to decide (all of them for a new run).
    pub targets: Vec<DeviceId>,
    pub force: bool,
    /// Targets that already have outcomes: decided when the run was
    /// created, or before a restart (a resumed run).
    pub decided: usize,
    /// The targets decided `already_converged` when the run was created
    /// (part of `decided`).
    pub converged: Vec<DeviceId>,
}

impl RunSpec {
    /// A run resumed after a restart, from its stored row and undecided
    /// targets.
    pub fn resumed(
        id: Uuid,
        trigger: Trigger,
        force: bool,
        target_count: usize,
        undecided: Vec<DeviceId>,
    ) -> Self {
        RunSpec {
            id,
            trigger,
            decided: target_count.saturating_sub(undecided.len()),
            targets: undecided,
            force,
            converged: Vec::new(),
        }
    }
}

/// A running run: how many targets are still undecided, and a sample of
/// the outcomes for its `run.completed` event.
#[derive(Debug, Clone)]
pub struct RunProgress {
    pub id: Uuid,
    pub trigger: Trigger,
    remaining: usize,
    started: Instant,
    /// Device → outcome, capped at [`COMPLETED_EVENT_OUTCOME_CAP`].
    sample: BTreeMap<String, OutcomeKind>,
    sample_truncated: bool,
}

impl RunProgress {
    pub fn new(spec: &RunSpec, now: Instant) -> Self {
        let sample: BTreeMap<String, OutcomeKind> = spec
            .converged
            .iter()
            .take(COMPLETED_EVENT_OUTCOME_CAP)
            .map(|id| (id.to_string(), OutcomeKind::AlreadyConverged))
            .collect();
        Self {
            id: spec.id,
            trigger: spec.trigger,
            remaining: spec.targets.len(),
            started: now,
            // A resumed run's earlier outcomes are not in the sample.
            sample_truncated: spec.decided > sample.len(),
            sample,
        }
    }

    /// True once every target has its outcome.
    pub fn is_complete(&self) -> bool {
        self.remaining == 0
    }

    /// Records one target's outcome.
    pub fn record(&mut self, device: &DeviceId, kind: OutcomeKind) {
        self.remaining = self.remaining.saturating_sub(1);
        if self.sample.len() < COMPLETED_EVENT_OUTCOME_CAP {
            self.sample.insert(device.to_string(), kind);
        } else {
            self.sample_truncated = true;
        }
    }

    /// How long the run has taken by `now`.
    pub fn elapsed(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.started)
    }

    /// The `run.completed` event, from the committed run's counts.
    pub fn completed_event(
        &self,
        target_count: i32,
        counts: &OutcomeCounts,
        now: Instant,
    ) -> EventDraft {
        EventDraft::run_completed(
            self.id,
            RunCompletedData {
                trigger: self.trigger,
                target_count: u64::try_from(target_count).unwrap_or(0),
                counts: *counts,
                summary: counts.summary(),
                duration_ms: Some(self.elapsed(now).as_millis() as u64),
                outcomes: Some(self.sample.clone()),
                outcomes_truncated: self.sample_truncated,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(targets: usize, decided: usize) -> RunSpec {
        RunSpec {
            id: Uuid::now_v7(),
            trigger: Trigger::Manual,
            targets: (0..targets)
                .map(|i| DeviceId::parse(&format!("d-{i}")).unwrap())
                .collect(),
            force: false,
            decided,
            converged: Vec::new(),
        }
    }

    #[test]
    fn a_run_is_complete_once_each_target_has_an_outcome() {
        let spec = spec(2, 0);
        let mut progress = RunProgress::new(&spec, Instant::now());
        assert!(!progress.is_complete());
        progress.record(&spec.targets[0], OutcomeKind::AlreadyConverged);
        assert!(!progress.is_complete());
        progress.record(&spec.targets[1], OutcomeKind::Provisioned);
        assert!(progress.is_complete());
    }

    #[test]
    fn the_completed_event_lists_the_sample_and_says_when_it_is_cut() {
        let spec = spec(1, 0);
        let started = Instant::now();
        let mut progress = RunProgress::new(&spec, started);
        progress.record(&spec.targets[0], OutcomeKind::Provisioned);
        let counts = OutcomeCounts {
            provisioned: 1,
            ..OutcomeCounts::default()
        };
        let event = progress.completed_event(1, &counts, started + Duration::from_millis(42));
        assert_eq!(event.data["duration_ms"], 42);
        assert_eq!(event.data["outcomes"]["d-0"], "provisioned");
        assert_eq!(event.data["outcomes_truncated"], false);
        assert_eq!(event.data["trigger"], "manual");

        let resumed = RunProgress::new(&self::spec(1, 3), started);
        let event = resumed.completed_event(4, &counts, started);
        assert_eq!(event.data["outcomes_truncated"], true);
    }
}
