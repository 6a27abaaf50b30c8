//! A run's one home: why it started (`Trigger`), what it covers (`RunSpec`),
//! how far it is (`RunProgress`, which owns its counts and completion) and
//! what the machine knows of it once it ended (`CompletedRun`, with the data
//! of its `run.completed` event).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use idem_protocol::DeviceId;
pub use idem_protocol::Trigger;
use uuid::Uuid;

use super::outcome::{OutcomeCounts, OutcomeKind};
use super::rollout::{Rollout, RolloutSpec};
use crate::reconcile::event_draft::EventDraft;
use idem_protocol::event::RunCompletedData;

/// Most device outcomes listed in a `run.completed` event; the full list
/// stays queryable through the API.
pub const COMPLETED_EVENT_OUTCOME_CAP: usize = 1_000;

/// A run's rollout as the machine starts it: new, or as it stood before a
/// restart.
#[derive(Debug, Clone, PartialEq)]
pub enum RolloutStart {
    New {
        spec: RolloutSpec,
        /// The token that started the run (the one that cannot approve it).
        author: Option<String>,
    },
    Restored(Rollout),
}

/// The rollout of a run: how it starts, and the wave of each target still
/// to decide (fixed when the run was created, stored with its targets).
#[derive(Debug, Clone, PartialEq)]
pub struct RunRollout {
    pub start: RolloutStart,
    pub waves: HashMap<DeviceId, usize>,
}

/// A committed run, as the engine starts it.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub id: Uuid,
    pub trigger: Trigger,
    /// The targets still to decide (all of them for a new run).
    pub targets: Vec<DeviceId>,
    pub force: bool,
    /// The outcomes of the targets decided before the machine starts the
    /// run: at its creation (`already_converged`, one per `converged`), or
    /// before a restart (a resumed run: the run row's stored counts).
    pub decided: OutcomeCounts,
    /// The targets decided `already_converged` when the run was created
    /// (counted in `decided`).
    pub converged: Vec<DeviceId>,
    /// Its waves, for a staged rollout (boxed: most runs have none).
    pub rollout: Option<Box<RunRollout>>,
    /// Carried on from an earlier process (after a restart or a takeover).
    pub resumed: bool,
    /// Targets whose report differed from their desired spec when the run
    /// was created: one found converged later in the run got there during
    /// it (by a push of the run, perhaps one an earlier engine sent), so it
    /// counts `provisioned`, never `already_converged`.
    pub differed: HashSet<DeviceId>,
}

impl RunSpec {
    /// A run just created: `targets` to decide, `converged` decided
    /// `already_converged` by its creation.
    pub fn created(
        id: Uuid,
        trigger: Trigger,
        force: bool,
        targets: Vec<DeviceId>,
        converged: Vec<DeviceId>,
    ) -> Self {
        RunSpec {
            id,
            trigger,
            targets,
            force,
            decided: OutcomeCounts {
                already_converged: converged.len() as u64,
                ..OutcomeCounts::default()
            },
            converged,
            rollout: None,
            resumed: false,
            differed: HashSet::new(),
        }
    }

    /// The run as a staged rollout.
    pub fn with_rollout(mut self, rollout: RunRollout) -> Self {
        self.rollout = Some(Box::new(rollout));
        self
    }

    /// A run resumed after a restart, from its stored row's counts and its
    /// undecided targets.
    pub fn resumed(
        id: Uuid,
        trigger: Trigger,
        force: bool,
        decided: OutcomeCounts,
        undecided: Vec<DeviceId>,
    ) -> Self {
        RunSpec {
            id,
            trigger,
            targets: undecided,
            force,
            decided,
            converged: Vec::new(),
            rollout: None,
            resumed: true,
            differed: HashSet::new(),
        }
    }

    /// The run with `differed`, the targets whose report differed from
    /// their desired spec at its creation.
    pub fn with_differed(mut self, differed: HashSet<DeviceId>) -> Self {
        self.differed = differed;
        self
    }

    /// Every target: those still to decide and those decided.
    pub fn target_count(&self) -> u64 {
        self.targets.len() as u64 + self.decided.total()
    }

    /// Whether the run was just created, not resumed: nothing is decided
    /// but what its creation found converged.
    pub fn is_new(&self) -> bool {
        self.decided.total() == self.converged.len() as u64
    }
}

/// A sample of a run's outcomes, device → outcome, capped at
/// [`COMPLETED_EVENT_OUTCOME_CAP`], and whether it leaves devices out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutcomeSample {
    pub outcomes: BTreeMap<String, OutcomeKind>,
    pub truncated: bool,
}

impl OutcomeSample {
    fn add(&mut self, device: &DeviceId, kind: OutcomeKind) {
        if self.outcomes.len() < COMPLETED_EVENT_OUTCOME_CAP {
            self.outcomes.insert(device.to_string(), kind);
        } else {
            self.truncated = true;
        }
    }
}

/// A running run: its targets, its outcome counts so far and a sample of
/// its outcomes. The counts are the machine's, seeded with what was decided
/// before it started the run ([`RunSpec::decided`]); the run row's counts
/// in PostgreSQL add up the same outcomes.
#[derive(Debug, Clone)]
pub struct RunProgress {
    pub id: Uuid,
    pub trigger: Trigger,
    target_count: u64,
    counts: OutcomeCounts,
    started: Instant,
    sample: OutcomeSample,
    /// [`RunSpec::differed`].
    differed: HashSet<DeviceId>,
}

impl RunProgress {
    pub fn new(spec: &RunSpec, now: Instant) -> Self {
        let mut sample = OutcomeSample::default();
        for id in &spec.converged {
            sample.add(id, OutcomeKind::AlreadyConverged);
        }
        // A resumed run's earlier outcomes are not in the sample.
        sample.truncated |= spec.decided.total() > sample.outcomes.len() as u64;
        Self {
            id: spec.id,
            trigger: spec.trigger,
            target_count: spec.target_count(),
            counts: spec.decided,
            started: now,
            sample,
            differed: HashSet::new(),
        }
    }

    /// The run's [`RunSpec::differed`], taken from its spec.
    pub fn with_differed(mut self, differed: HashSet<DeviceId>) -> Self {
        self.differed = differed;
        self
    }

    /// Whether `device`'s report differed from its desired spec when the
    /// run was created.
    pub fn differed(&self, device: &DeviceId) -> bool {
        self.differed.contains(device)
    }

    /// True once every target has its outcome.
    pub fn is_complete(&self) -> bool {
        self.counts.total() >= self.target_count
    }

    /// Records one target's outcome.
    pub fn record(&mut self, device: &DeviceId, kind: OutcomeKind) {
        self.counts.add(kind);
        self.sample.add(device, kind);
    }

    /// The run as it ended at `now`, its last outcome recorded.
    pub fn complete(self, now: Instant) -> CompletedRun {
        CompletedRun {
            id: self.id,
            trigger: self.trigger,
            target_count: self.target_count,
            counts: self.counts,
            elapsed: now.saturating_duration_since(self.started),
            sample: self.sample,
        }
    }
}

/// A run whose every target has its outcome, as the machine ends it in the
/// call that recorded the last one: what its `run.completed` event, the
/// metrics and the log say of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedRun {
    pub id: Uuid,
    pub trigger: Trigger,
    pub target_count: u64,
    pub counts: OutcomeCounts,
    /// From the machine starting the run to its last outcome.
    pub elapsed: Duration,
    pub sample: OutcomeSample,
}

impl CompletedRun {
    /// The `run.completed` event.
    pub fn event(&self) -> EventDraft {
        EventDraft::run_completed(
            self.id,
            RunCompletedData {
                trigger: self.trigger,
                target_count: self.target_count,
                counts: self.counts,
                summary: self.counts.summary(),
                duration_ms: Some(self.elapsed.as_millis() as u64),
                outcomes: Some(self.sample.outcomes.clone()),
                outcomes_truncated: self.sample.truncated,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<DeviceId> {
        (0..n)
            .map(|i| DeviceId::parse(&format!("d-{i}")).unwrap())
            .collect()
    }

    fn spec(targets: usize) -> RunSpec {
        RunSpec::created(
            Uuid::now_v7(),
            Trigger::Manual,
            false,
            ids(targets),
            Vec::new(),
        )
    }

    #[test]
    fn a_run_is_complete_once_each_target_has_an_outcome() {
        let spec = spec(2);
        let mut progress = RunProgress::new(&spec, Instant::now());
        assert!(!progress.is_complete());
        progress.record(&spec.targets[0], OutcomeKind::AlreadyConverged);
        assert!(!progress.is_complete());
        progress.record(&spec.targets[1], OutcomeKind::Provisioned);
        assert!(progress.is_complete());
    }

    #[test]
    fn a_run_counts_its_targets_converged_at_creation_and_those_decided_before_a_restart() {
        let created = RunSpec::created(Uuid::now_v7(), Trigger::Manual, false, ids(1), ids(3));
        assert!(created.is_new());
        let mut progress = RunProgress::new(&created, Instant::now());
        progress.record(&created.targets[0], OutcomeKind::Failed);
        let ended = progress.complete(Instant::now());
        assert_eq!(ended.target_count, 4);
        assert_eq!(
            ended.counts,
            OutcomeCounts {
                already_converged: 3,
                failed: 1,
                ..OutcomeCounts::default()
            }
        );

        let stored = OutcomeCounts {
            provisioned: 2,
            skipped: 1,
            ..OutcomeCounts::default()
        };
        let resumed = RunSpec::resumed(Uuid::now_v7(), Trigger::Drift, false, stored, ids(1));
        assert!(!resumed.is_new());
        let mut progress = RunProgress::new(&resumed, Instant::now());
        assert!(!progress.is_complete());
        progress.record(&resumed.targets[0], OutcomeKind::Provisioned);
        let ended = progress.complete(Instant::now());
        assert_eq!(ended.target_count, 4);
        assert_eq!(
            ended.counts,
            OutcomeCounts {
                provisioned: 3,
                skipped: 1,
                ..OutcomeCounts::default()
            }
        );
    }

    #[test]
    fn the_completed_event_lists_the_sample_and_says_when_it_is_cut() {
        let spec = spec(1);
        let started = Instant::now();
        let mut progress = RunProgress::new(&spec, started);
        progress.record(&spec.targets[0], OutcomeKind::Provisioned);
        let event = progress
            .complete(started + Duration::from_millis(42))
            .event();
        assert_eq!(event.data["duration_ms"], 42);
        assert_eq!(event.data["target_count"], 1);
        assert_eq!(event.data["counts"]["provisioned"], 1);
        assert_eq!(
            event.data["summary"],
            "0 already converged, 1 provisioned, 0 failed"
        );
        assert_eq!(event.data["outcomes"]["d-0"], "provisioned");
        assert_eq!(event.data["outcomes_truncated"], false);
        assert_eq!(event.data["trigger"], "manual");

        let stored = OutcomeCounts {
            provisioned: 3,
            ..OutcomeCounts::default()
        };
        let resumed = RunSpec::resumed(Uuid::now_v7(), Trigger::Manual, false, stored, ids(1));
        let mut progress = RunProgress::new(&resumed, started);
        progress.record(&resumed.targets[0], OutcomeKind::Provisioned);
        let event = progress.complete(started).event();
        assert_eq!(event.data["outcomes_truncated"], true);
        assert_eq!(event.data["target_count"], 4);
    }
}
