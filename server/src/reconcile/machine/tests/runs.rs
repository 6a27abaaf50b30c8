//! A run's targets, outcomes and completion: pushes only where the device
//! differs, attempts shared between runs, superseded generations, runs
//! larger than one write, targets decided at creation, resumed runs, and
//! the machine's counts in each run's completion.

use super::*;

#[test]
fn a_run_pushes_only_to_drifted_devices_and_completes_once_they_confirm() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(50, 4);
    let run = world.run(&fleet);
    assert_eq!(world.pushed(), fleet[..4].to_vec());
    assert!(!world.is_completed(run));
    for device in &fleet[..4] {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    assert_eq!(world.counts(run), counts(46, 4, 0));
    let ended = world.completion(run).map(|ended| ended.counts);
    assert_eq!(ended, Some(counts(46, 4, 0)), "the machine's counts");
    assert!(fleet
        .iter()
        .all(|d| world.status(d) == DeviceStatus::Converged));
}

#[test]
fn a_run_that_targets_a_device_being_pushed_shares_the_push_and_both_runs_get_its_outcome() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(2), Some(1));
    let first = world.run(std::slice::from_ref(&device));
    let second = world.run(std::slice::from_ref(&device));
    assert_eq!(
        world.pushed(),
        vec![device.clone()],
        "one push for both runs"
    );
    world.reports(&device, 2, Some(2));
    world.settle();
    for run in [first, second] {
        assert_eq!(
            world.kinds(run),
            vec![(device.clone(), OutcomeKind::Provisioned)]
        );
        assert!(world.is_completed(run));
    }
}

#[test]
fn a_desired_change_during_a_push_supersedes_it_and_a_late_ack_does_not_count() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(2), Some(1));
    let old = world.run(std::slice::from_ref(&device));
    world.wants(&device, 3, 3);
    let new = world.run(std::slice::from_ref(&device));
    assert_eq!(
        world.kinds(old),
        vec![(device.clone(), OutcomeKind::Superseded)]
    );
    assert_eq!(world.published.last().map(|p| p.1), Some(3));
    // The late confirmation of generation 2 answers nothing.
    world.reports(&device, 2, Some(2));
    world.settle();
    assert!(!world.is_completed(new));
    world.reports(&device, 3, Some(3));
    world.settle();
    assert_eq!(world.kinds(new), vec![(device, OutcomeKind::Provisioned)]);
}

#[test]
fn a_run_larger_than_one_write_is_started_in_slices() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(FLUSH_SIZE + 10, 0);
    let run = world.start(Trigger::Manual, fleet, false);
    assert_eq!(
        world.outcomes[&run].len(),
        FLUSH_SIZE,
        "the first slice is written before the rest is looked at"
    );
    world.settle();
    assert_eq!(world.counts(run), counts(FLUSH_SIZE as u64 + 10, 0, 0));
    assert!(world.is_completed(run));
}

#[test]
fn a_resumed_run_with_every_target_decided_completes_at_once() {
    let mut world = World::new(settings());
    let stored = counts(2, 3, 0);
    let run = RunSpec::resumed(Uuid::now_v7(), Trigger::Manual, false, stored, Vec::new());
    world.command(EngineCommand::StartRun(run.clone()));
    world.settle();
    let ended = world.completion(run.id).expect("completed");
    assert_eq!((ended.target_count, ended.counts), (5, stored));
}

#[test]
fn a_target_found_converged_at_creation_ends_an_older_attempt_and_refreshes_the_retained_message() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(2), Some(1));
    let old = world.run(std::slice::from_ref(&device));
    // The operator reverts to what the device runs, as generation 3; the
    // run's creation finds the device converged.
    world.wants(&device, 3, 1);
    let converged = vec![device.clone()];
    let run = RunSpec::created(
        Uuid::now_v7(),
        Trigger::Desired,
        false,
        Vec::new(),
        converged,
    );
    world.command(EngineCommand::StartRun(run.clone()));
    world.settle();
    assert_eq!(
        world.kinds(old),
        vec![(device.clone(), OutcomeKind::Superseded)]
    );
    let ended = world.completion(run.id).map(|ended| ended.counts);
    assert_eq!(ended, Some(counts(1, 0, 0)));
    assert_eq!(
        world.published.last(),
        Some(&(device, 3, PublishReason::RefreshRetained)),
        "the withdrawn generation 2 no longer retained"
    );
    assert_eq!(world.machine.stats(), MachineStats::default());
}

#[test]
fn a_run_created_while_a_quarantine_is_still_being_written_sees_the_device_quarantined() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(2), Some(1));
    world.run(std::slice::from_ref(&device));
    world.rejects(&device, 2, 1);
    world.wait(Duration::from_millis(1_100));
    world.rejects(&device, 2, 1);
    world.wait(Duration::from_millis(2_100));
    world.hold_writes();
    world.rejects(&device, 2, 1);
    world.settle();
    assert_ne!(
        world.status(&device),
        DeviceStatus::Quarantined,
        "the quarantine has not committed yet"
    );
    // The device now runs its desired spec: on the cache alone, a new run
    // would find it converged and clear the quarantine being written.
    world.reports(&device, 2, Some(2));
    let machine = &world.machine;
    let converged = crate::reconcile::policy::converged_targets(
        |id| machine.view(id),
        std::slice::from_ref(&device),
        false,
        None,
        &std::collections::HashMap::new(),
    );
    assert!(
        converged.is_empty(),
        "judged converged at creation though the machine has quarantined it"
    );
    world.commit_held();
    assert_eq!(world.status(&device), DeviceStatus::Quarantined);
}

#[test]
fn a_run_ends_in_the_record_of_its_last_outcome_with_the_counts_of_every_target() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(10, 3);
    // Seven found converged at creation, three pushed.
    let run = world.create(fleet.clone(), false);
    assert_eq!(world.pushed(), fleet[..3].to_vec());
    world.reports(&fleet[0], 2, Some(2));
    world.rejects(&fleet[1], 2, 1);
    world.settle();
    world
        .fleet
        .apply_committed([FleetChange::Removed(fleet[2].clone())]);
    world.hold_writes();
    world.command(EngineCommand::DevicesRemoved(vec![fleet[2].clone()]));
    world.settle();
    assert!(!world.is_completed(run), "only once the retry ends");
    world.wait(Duration::from_millis(1_100));
    world.reports(&fleet[1], 2, Some(2));
    world.settle();
    let held = world.held.as_ref().expect("writes held");
    let last = held
        .iter()
        .find(|record| !record.completed.is_empty())
        .expect("a record ends the run");
    assert!(
        last.outcomes
            .iter()
            .any(|row| row.run_id == run && row.device == fleet[1]),
        "the run ends in the record of its last outcome"
    );
    world.commit_held();
    let ended = world.completion(run).expect("completed");
    let expected = OutcomeCounts {
        skipped: 1,
        ..counts(7, 2, 0)
    };
    assert_eq!((ended.target_count, ended.counts), (10, expected));
    assert_eq!(world.counts(run), expected, "the outcome rows' tally");
    assert_eq!(world.stored[&run], expected, "the run row's counts");
}

#[test]
fn a_resumed_run_counts_on_from_its_stored_counts() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(4, 2);
    let run = world.create(fleet.clone(), false);
    world.reports(&fleet[0], 2, Some(2));
    world.settle();
    assert_eq!(world.stored[&run], counts(2, 1, 0));
    // fleet[1] is still pushed when the process dies; the new one awaits
    // that push's answer instead of pushing it again, and counts on from
    // the row's counts.
    world.restart();
    assert_eq!(world.pushed(), &fleet[..2]);
    world.reports(&fleet[1], 2, Some(2));
    world.settle();
    let ended = world
        .completion(run)
        .map(|ended| (ended.target_count, ended.counts));
    assert_eq!(ended, Some((4, counts(2, 2, 0))));
    assert_eq!(world.counts(run), counts(2, 2, 0));
}

#[test]
fn a_resumed_run_pushes_again_without_a_failure_a_device_that_never_answered_the_earlier_push() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(3, 1);
    let run = world.create(fleet.clone(), false);
    world.settle();
    world.restart();
    assert_eq!(world.pushed(), &fleet[..1]);
    // The earlier push may never have reached the device: once its answer
    // is overdue the attempt starts afresh, with nothing counted failed.
    world.wait(PUSH_TIMEOUT + SCAN_INTERVAL);
    assert_eq!(world.pushed(), [&fleet[..1], &fleet[..1]].concat());
    assert_eq!(world.counts(run), counts(2, 0, 0));
    world.reports(&fleet[0], 2, Some(2));
    world.settle();
    assert_eq!(world.counts(run), counts(2, 1, 0));
    assert!(world.completion(run).is_some());
}

#[test]
fn a_device_that_answered_a_push_just_before_a_restart_counts_provisioned_not_already_converged() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(3, 1);
    let run = world.create(fleet.clone(), false);
    world.settle();
    // The report is stored, but the process dies before the outcome it
    // decided commits.
    world.hold_writes();
    world.reports(&fleet[0], 2, Some(2));
    world.restart();
    world.settle();
    assert_eq!(world.pushed(), &fleet[..1]);
    assert_eq!(world.counts(run), counts(2, 1, 0));
    assert!(world.completion(run).is_some());
}
