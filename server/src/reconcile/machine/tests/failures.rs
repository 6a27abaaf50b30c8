//! How attempts fail: retries with backoff, quarantine and the operator's
//! retry, a push never confirmed, a device that never reports, a device
//! deleted while its push waits.

use super::*;

#[test]
fn a_rejecting_device_is_retried_with_backoff_then_quarantined_until_an_operator_retry() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(2), Some(1));
    let run = world.run(std::slice::from_ref(&device));
    world.rejects(&device, 2, 1);
    world.settle();
    assert_eq!(world.status(&device), DeviceStatus::Failed);
    assert_eq!(world.pushed().len(), 1, "no retry before the backoff");
    world.wait(Duration::from_millis(1_100));
    assert_eq!(world.pushed().len(), 2, "retried after the first backoff");
    world.rejects(&device, 2, 1);
    world.wait(Duration::from_millis(2_100));
    assert_eq!(world.pushed().len(), 3, "retried after a doubled backoff");
    assert!(!world.is_completed(run), "retries belong to the same run");
    world.rejects(&device, 2, 1);
    world.settle();
    assert_eq!(world.status(&device), DeviceStatus::Quarantined);
    assert_eq!(world.counts(run), counts(0, 0, 1));
    assert!(world.is_completed(run));
    assert_eq!(
        world
            .events
            .iter()
            .filter(|e| **e == EventType::DeviceQuarantined)
            .count(),
        1
    );

    let skipped = world.run(std::slice::from_ref(&device));
    assert_eq!(
        world.kinds(skipped),
        vec![(device.clone(), OutcomeKind::Skipped)]
    );
    assert_eq!(
        world.pushed().len(),
        3,
        "a quarantined device is not pushed"
    );

    // What the operator retry commits before it starts its run.
    world
        .fleet
        .apply_committed([FleetChange::Released(device.clone())]);
    let retry = world.start(Trigger::Retry, vec![device.clone()], false);
    assert_eq!(world.pushed().len(), 4);
    world.reports(&device, 2, Some(2));
    world.settle();
    assert_eq!(
        world.kinds(retry),
        vec![(device.clone(), OutcomeKind::Provisioned)]
    );
    assert_eq!(world.fleet.get(&device).unwrap().failures, 0);
}

#[test]
fn a_push_that_is_never_confirmed_fails_with_a_timeout_after_its_retries() {
    let mut settings = settings();
    settings.retry.max_attempts = 1;
    let mut world = World::new(settings);
    let device = world.device("pump", Some(2), Some(1));
    let run = world.run(std::slice::from_ref(&device));
    world.wait(PUSH_TIMEOUT - Duration::from_millis(100));
    assert!(!world.is_completed(run), "not before the deadline");
    world.wait(Duration::from_millis(200));
    let rows = &world.outcomes[&run];
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1, OutcomeKind::Failed);
    assert!(
        rows[0].2.as_deref().unwrap().contains("confirm"),
        "{rows:?}"
    );
}

#[test]
fn a_device_that_never_reported_is_asked_and_fails_when_it_stays_silent() {
    let mut settings = settings();
    settings.retry.max_attempts = 1;
    let mut world = World::new(settings);
    let device = world.device("quiet", Some(2), None);
    let run = world.run(std::slice::from_ref(&device));
    assert_eq!(world.asked, vec![device.clone()]);
    assert!(world.pushed().is_empty());
    world.wait(PUSH_TIMEOUT + SCAN_INTERVAL);
    assert_eq!(world.counts(run), counts(0, 0, 1));
}

#[test]
fn a_device_deleted_while_its_push_waits_ends_skipped() {
    let mut world = World::new(settings());
    let device = world.device("gone", Some(2), Some(1));
    let run = world.run(std::slice::from_ref(&device));
    world
        .fleet
        .apply_committed([FleetChange::Removed(device.clone())]);
    world.command(EngineCommand::DevicesRemoved(vec![device.clone()]));
    world.settle();
    assert_eq!(world.kinds(run), vec![(device, OutcomeKind::Skipped)]);
    assert!(world.is_completed(run));
}
