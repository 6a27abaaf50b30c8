//! What is pushed and when: the in-flight cap, forced runs, retained
//! messages refreshed without an attempt, and publishes the cache has moved
//! past.

use super::*;

#[test]
fn no_more_pushes_await_confirmation_than_the_in_flight_cap() {
    let mut settings = settings();
    settings.max_in_flight = 3;
    let mut world = World::new(settings);
    let fleet = world.fleet_of(10, 10);
    let run = world.run(&fleet);
    assert_eq!(world.pushed().len(), 3);
    assert_eq!(world.machine.stats().queued_pushes, 7);
    world.reports(&fleet[0], 2, Some(2));
    world.settle();
    assert_eq!(world.pushed().len(), 4, "a confirmation frees one slot");
    for device in &fleet {
        world.reports(device, 2, Some(2));
        world.settle();
    }
    assert_eq!(world.pushed(), fleet);
    assert_eq!(world.counts(run), counts(0, 10, 0));
}

#[test]
fn a_forced_run_pushes_to_devices_that_already_match() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(3, 0);
    let run = world.start(Trigger::Manual, fleet.clone(), true);
    world.settle();
    assert_eq!(world.pushed(), fleet);
    for device in &fleet {
        world.reports(device, 2, Some(2));
    }
    world.settle();
    assert_eq!(world.counts(run), counts(0, 3, 0));
}

#[test]
fn a_converged_device_with_an_old_retained_message_gets_it_refreshed_without_an_attempt() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(3), Some(3));
    let retained = DeviceChange {
        retained: Some(Generation(2)),
        ..DeviceChange::default()
    };
    world
        .fleet
        .apply_committed([FleetChange::Engine(device.clone(), retained)]);
    let run = world.run(std::slice::from_ref(&device));
    assert_eq!(
        world.kinds(run),
        vec![(device.clone(), OutcomeKind::AlreadyConverged)]
    );
    assert_eq!(
        world.published,
        vec![(device.clone(), 3, PublishReason::RefreshRetained)]
    );
    assert_eq!(
        world.fleet.get(&device).unwrap().retained_generation,
        Some(Generation(3))
    );
}

#[test]
fn publishes_for_a_generation_the_cache_has_moved_past_are_stale_retained_refreshes_included() {
    let mut world = World::new(settings());
    let pushed = world.device("pump", Some(3), Some(1));
    let current = world.device("valve", Some(2), Some(2));
    let refreshed = world.device("gauge", Some(4), Some(4));
    let publish = |device: &DeviceId, generation: u64, reason: PublishReason| Effect::Publish {
        device: device.clone(),
        generation: Generation(generation),
        spec: Arc::new(spec(generation)),
        reason,
    };
    let batch = vec![
        publish(&pushed, 2, PublishReason::Attempt),
        publish(&current, 2, PublishReason::RefreshRetained),
        publish(&refreshed, 3, PublishReason::RefreshRetained),
        Effect::AskForReport {
            device: pushed.clone(),
            reason: AskReason::Decide,
        },
    ];
    assert_eq!(world.machine.stale_pushes(&batch), vec![pushed, refreshed]);
}
