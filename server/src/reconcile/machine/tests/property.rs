//! The property test: any sequence of inputs — runs and staged rollouts
//! created on the machine's view, reports, rejections, desired changes
//! (which supersede), connectivity, deletions, time, held writes,
//! restarts, and an operator's resumes, aborts and approvals of rollouts —
//! ends every run once, with exactly one outcome per target and the
//! machine's counts equal to the tally of its outcomes.

use super::*;

/// One thing that can happen to the engine.
#[derive(Debug, Clone)]
pub(super) enum Step {
    Run {
        targets: Vec<usize>,
        force: bool,
    },
    /// Device reports running its desired spec, answering its generation.
    Confirms(usize),
    /// Device reports running some other spec.
    Drifts(usize),
    /// Device refuses its desired generation.
    Rejects(usize),
    NewDesired(usize),
    Online(usize, bool),
    Remove(usize),
    Wait(u64),
    /// The machine's writes stop committing for a while.
    HoldWrites,
    /// The held writes commit.
    CommitHeld,
    /// The process dies (held writes are lost) and a new one resumes the
    /// unfinished runs.
    Restart,
    /// A staged rollout over the targets in waves `1`, `50%`, `100%`; with
    /// `gated`, any failure in a wave pauses it; after the first wave a
    /// manual pause (`after_first` 1) or an approval (2), or neither (0).
    Rollout {
        targets: Vec<usize>,
        gated: bool,
        after_first: u8,
    },
    /// An operator resumes, aborts or approves (as the rollout's author,
    /// which is refused, or as someone else) the k-th rollout created;
    /// refusals are part of the game.
    Resume(usize),
    Abort(usize),
    Approve(usize, bool),
}

pub(super) const DEVICES: usize = 6;

pub(super) fn step() -> impl Strategy<Value = Step> {
    let device = 0..DEVICES;
    prop_oneof![
        3 => (proptest::collection::vec(0..DEVICES, 0..8), any::<bool>())
            .prop_map(|(targets, force)| Step::Run { targets, force }),
        3 => device.clone().prop_map(Step::Confirms),
        1 => device.clone().prop_map(Step::Drifts),
        1 => device.clone().prop_map(Step::Rejects),
        1 => device.clone().prop_map(Step::NewDesired),
        1 => (device.clone(), any::<bool>()).prop_map(|(d, online)| Step::Online(d, online)),
        1 => device.prop_map(Step::Remove),
        2 => (0u64..3_000).prop_map(Step::Wait),
        1 => Just(Step::HoldWrites),
        1 => Just(Step::CommitHeld),
        1 => Just(Step::Restart),
        2 => (proptest::collection::vec(0..DEVICES, 0..8), any::<bool>(), 0u8..3)
            .prop_map(|(targets, gated, after_first)| Step::Rollout { targets, gated, after_first }),
        1 => (0usize..4).prop_map(Step::Resume),
        1 => (0usize..4).prop_map(Step::Abort),
        1 => ((0usize..4), any::<bool>()).prop_map(|(k, by_author)| Step::Approve(k, by_author)),
    ]
}

/// Waves `1`, `50%`, `100%` as [`Step::Rollout`] describes them.
fn rollout_spec(gated: bool, after_first: u8) -> crate::reconcile::rollout::RolloutSpec {
    use crate::reconcile::rollout::{FailureLimit, Gates, Pause, RolloutSpec, WaveSize, WaveSpec};
    let gates = Gates {
        max_failures: gated.then_some(FailureLimit::Count(0)),
        ..Gates::default()
    };
    let wave = |size| WaveSpec {
        gates,
        ..WaveSpec::sized(size)
    };
    let first = WaveSpec {
        pause: if after_first == 1 {
            Pause::Manual
        } else {
            Pause::None
        },
        approve: after_first == 2,
        ..wave(WaveSize::Count(1))
    };
    let waves = vec![
        first,
        wave(WaveSize::Percent(50.0)),
        wave(WaveSize::Percent(100.0)),
    ];
    // Increasing and ending at 100 %: always valid.
    RolloutSpec::new(waves).unwrap_or_else(|e| panic!("{e}"))
}

impl World {
    pub(super) fn play(&mut self, fleet: &[DeviceId], step: &Step) {
        let desired = |world: &World, i: usize| {
            world
                .fleet
                .get(&fleet[i])
                .and_then(|e| e.desired)
                .map(|d| d.generation)
        };
        match step {
            Step::Run { targets, force } => {
                let mut targets: Vec<DeviceId> =
                    targets.iter().map(|i| fleet[*i].clone()).collect();
                // Targets are distinct (the API and the engine deduplicate).
                targets.sort();
                targets.dedup();
                self.create(targets, *force);
            }
            Step::Confirms(i) => {
                if let Some(generation) = desired(self, *i) {
                    self.reports(&fleet[*i], generation.get(), Some(generation.get()));
                }
            }
            Step::Drifts(i) => {
                if self.fleet.contains(&fleet[*i]) {
                    self.reports(&fleet[*i], 999, None);
                }
            }
            Step::Rejects(i) => {
                if let Some(generation) = desired(self, *i) {
                    self.rejects(&fleet[*i], generation.get(), 1);
                }
            }
            Step::NewDesired(i) => {
                if let Some(generation) = desired(self, *i) {
                    let next = generation.get() + 1;
                    self.wants(&fleet[*i], next, next);
                    self.command(EngineCommand::DesiredChanged(vec![fleet[*i].clone()]));
                }
            }
            Step::Online(i, online) => {
                if self.fleet.online(&fleet[*i]).is_some() {
                    self.fleet
                        .apply_committed([FleetChange::Online(fleet[*i].clone(), *online)]);
                    let change = vec![(fleet[*i].clone(), *online)];
                    self.command(EngineCommand::Connectivity(change));
                }
            }
            Step::Remove(i) => {
                self.fleet
                    .apply_committed([FleetChange::Removed(fleet[*i].clone())]);
                self.command(EngineCommand::DevicesRemoved(vec![fleet[*i].clone()]));
            }
            Step::Wait(ms) => self.wait(Duration::from_millis(*ms)),
            Step::HoldWrites => self.hold_writes(),
            Step::CommitHeld => self.commit_held(),
            Step::Restart => self.restart(),
            Step::Rollout {
                targets,
                gated,
                after_first,
            } => {
                let mut targets: Vec<DeviceId> =
                    targets.iter().map(|i| fleet[*i].clone()).collect();
                targets.sort();
                targets.dedup();
                self.create_rollout(targets, rollout_spec(*gated, *after_first), "author");
            }
            Step::Resume(k) => self.act_on_rollout(*k, RolloutAction::Resume),
            Step::Abort(k) => self.act_on_rollout(*k, RolloutAction::Abort),
            Step::Approve(k, by_author) => {
                let by = if *by_author { "author" } else { "second" };
                self.act_on_rollout(*k, RolloutAction::Approve { by: by.to_owned() });
            }
        }
    }

    /// `action` on the `k`-th rollout created (none: nothing happens); a
    /// refusal changes nothing.
    fn act_on_rollout(&mut self, k: usize, action: RolloutAction) {
        let rollouts: Vec<Uuid> = self.waves.keys().copied().collect();
        if rollouts.is_empty() {
            return;
        }
        let run = rollouts[k % rollouts.len()];
        if let Ok((effects, _)) = self.machine.act_on_rollout(run, action, self.now()) {
            self.carry(effects);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_sequence_of_inputs_ends_every_run_with_exactly_one_outcome_per_target(
        initial in proptest::collection::vec((1u64..3, proptest::option::of(1u64..3)), DEVICES),
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        let mut world = World::new(settings());
        let fleet: Vec<DeviceId> = initial
            .iter()
            .enumerate()
            .map(|(i, (desired, reported))| world.device(&format!("p-{i}"), Some(*desired), *reported))
            .collect();
        for step in &steps {
            world.play(&fleet, step);
        }
        world.commit_held();
        // Long enough for every deadline, retry and debounce window.
        for _ in 0..40 {
            world.wait(Duration::from_secs(2));
        }
        // A rollout left paused (or waiting for approval) would wait for
        // an operator forever: one aborts each, and the rest plays out.
        let rollouts: Vec<Uuid> = world.waves.keys().copied().collect();
        for k in 0..rollouts.len() {
            world.act_on_rollout(k, RolloutAction::Abort);
        }
        for _ in 0..40 {
            world.wait(Duration::from_secs(2));
        }
        for run in &world.runs {
            // Each target once: decided at creation (on the machine's view,
            // also while a write was pending), by the machine or, after a
            // restart, by the next one, never twice.
            let mut expected: Vec<&DeviceId> = world.all_targets[&run.id].iter().collect();
            expected.sort();
            let rows = world.outcomes.get(&run.id).map(Vec::as_slice).unwrap_or_default();
            let mut decided: Vec<&DeviceId> = rows.iter().map(|(d, _, _)| d).collect();
            decided.sort();
            let target_count = expected.len() as u64;
            prop_assert_eq!(decided, expected, "run {:?} of {:?}", run.id, run.trigger);
            let ends: Vec<&CompletedRun> =
                world.completed.iter().filter(|ended| ended.id == run.id).collect();
            prop_assert_eq!(ends.len(), 1, "run completed exactly once");
            // The machine's counts are the tally of the run's outcome rows,
            // and so are the run row's.
            let rows = tally(rows.iter().map(|(_, kind, _)| kind));
            prop_assert_eq!(
                (ends[0].target_count, ends[0].counts),
                (target_count, rows),
                "the machine's (target count, counts) of run {:?}", run.id
            );
            prop_assert_eq!(world.stored.get(&run.id).copied().unwrap_or_default(), rows);
        }
        prop_assert_eq!(world.machine.stats(), MachineStats::default());
    }
}
