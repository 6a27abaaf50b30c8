//! The property test: any sequence of inputs — runs created on the
//! machine's view, reports, rejections, desired changes, connectivity,
//! deletions, time, held writes and restarts — ends every run once, with
//! exactly one outcome per target and the machine's counts equal to the
//! tally of its outcomes.

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
    ]
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
                    self.reports(&fleet[*i], generation, Some(generation));
                }
            }
            Step::Drifts(i) => {
                if self.fleet.contains(&fleet[*i]) {
                    self.reports(&fleet[*i], 999, None);
                }
            }
            Step::Rejects(i) => {
                if let Some(generation) = desired(self, *i) {
                    self.rejects(&fleet[*i], generation, 1);
                }
            }
            Step::NewDesired(i) => {
                if let Some(generation) = desired(self, *i) {
                    let next = generation + 1;
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
