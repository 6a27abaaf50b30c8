//! What the machine starts by itself: reconnect and drift runs (debounced),
//! and report requests for devices that came online and stayed silent or
//! that a recheck asks.

use super::*;

#[test]
fn an_offline_device_is_skipped_and_its_reconnect_starts_one_reconnect_run() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(2), Some(1));
    world.command(EngineCommand::Connectivity(vec![(device.clone(), false)]));
    world.settle();
    assert_eq!(world.status(&device), DeviceStatus::Offline);
    world
        .fleet
        .apply_committed([FleetChange::Online(device.clone(), false)]);
    let run = world.run(std::slice::from_ref(&device));
    assert_eq!(
        world.kinds(run),
        vec![(device.clone(), OutcomeKind::Skipped)]
    );
    assert!(world.pushed().is_empty());

    world
        .fleet
        .apply_committed([FleetChange::Online(device.clone(), true)]);
    world.command(EngineCommand::Connectivity(vec![(device.clone(), true)]));
    world.wait(Duration::from_millis(400));
    assert_eq!(
        world.runs.len(),
        1,
        "no run before the debounce window closes"
    );
    world.wait(Duration::from_millis(200));
    assert_eq!(world.runs.len(), 2);
    assert_eq!(world.runs[1].trigger, Trigger::Reconnect);
    assert_eq!(world.pushed(), vec![device]);
}

#[test]
fn drifting_devices_within_one_debounce_window_get_one_drift_run() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(3, 0);
    world.reports(&fleet[0], 9, Some(2));
    world.wait(Duration::from_millis(300));
    world.reports(&fleet[1], 9, Some(2));
    world.settle();
    assert_eq!(world.status(&fleet[0]), DeviceStatus::Drifted);
    let drifted = world
        .events
        .iter()
        .filter(|e| **e == EventType::DeviceDrifted)
        .count();
    assert_eq!(drifted, 2);
    world.wait(Duration::from_millis(500));
    assert_eq!(world.runs.len(), 1);
    assert_eq!(world.runs[0].trigger, Trigger::Drift);
    assert_eq!(world.runs[0].targets, fleet[..2].to_vec());
    assert_eq!(world.pushed(), fleet[..2].to_vec());
}

#[test]
fn a_device_that_comes_online_and_stays_silent_is_asked_once_for_its_report() {
    let mut world = World::new(EngineSettings {
        missing_report_after: Some(Duration::from_secs(5)),
        ..settings()
    });
    let silent = world.device("silent-1", None, None);
    let talker = world.device("talker-1", None, None);
    world.command(EngineCommand::Connectivity(vec![
        (silent.clone(), true),
        (talker.clone(), true),
    ]));
    world.reports(&talker, 1, None);
    world.wait(Duration::from_secs(4));
    assert!(
        world.asked.is_empty(),
        "asked before the grace period ended"
    );
    world.wait(Duration::from_secs(2));
    assert_eq!(world.asked, std::slice::from_ref(&silent));
    world.wait(Duration::from_secs(30));
    assert_eq!(world.asked, [silent], "asked once");
}

#[test]
fn a_recheck_asks_every_device_not_known_offline_and_not_heard_from_since_at_its_rate() {
    let mut world = World::new(EngineSettings {
        recheck_rate: NonZeroU32::new(100),
        ..settings()
    });
    let quiet: Vec<DeviceId> = (0..150)
        .map(|i| world.device(&format!("q-{i:03}"), None, Some(1)))
        .collect();
    let offline = world.device("gone-1", None, Some(1));
    world
        .fleet
        .apply_committed([FleetChange::Online(offline.clone(), false)]);
    let fresh = world.device("fresh-1", None, None);
    world.command(EngineCommand::Recheck);
    world.wall += chrono::Duration::milliseconds(1);
    world.reports(&fresh, 1, None);
    world.wait(Duration::from_secs(1));
    let after_one_second = world.asked.len();
    assert!(
        (90..=110).contains(&after_one_second),
        "{after_one_second} asked in the first second at 100/s"
    );
    world.wait(Duration::from_secs(2));
    let mut asked = world.asked.clone();
    asked.sort();
    assert_eq!(
        asked, quiet,
        "each quiet device once; not the offline one, not the one that reported since"
    );
}

#[test]
fn an_exempt_device_that_drifts_is_evented_as_exempt_and_not_remediated_until_its_exemption_ends() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(2, 0);
    world.exempt(&fleet[0], true);
    world.reports(&fleet[0], 9, Some(2));
    world.wait(Duration::from_secs(2));
    assert_eq!(world.status(&fleet[0]), DeviceStatus::Drifted);
    assert_eq!(world.drifted.len(), 1);
    assert_eq!(world.drifted[0].0, fleet[0].as_str());
    assert_eq!(world.drifted[0].1["exempt"], true, "{:?}", world.drifted);
    assert!(world.runs.is_empty(), "no drift run for an exempt device");

    // A run over it skips it, for the exemption.
    let run = world.create(fleet.clone(), false);
    world.settle();
    let outcomes = &world.outcomes[&run];
    let skipped = outcomes.iter().find(|(d, _, _)| *d == fleet[0]).unwrap();
    assert_eq!(
        (skipped.1, skipped.2.as_deref()),
        (OutcomeKind::Skipped, Some("exempt"))
    );
    assert!(world.pushed().is_empty());

    // Once it ends, the device is reconciled like any drifted one.
    world.exempt(&fleet[0], false);
    world.wait(Duration::from_secs(2));
    let last = world.runs.last().unwrap();
    assert_eq!(
        (last.trigger, last.targets.clone()),
        (Trigger::Drift, vec![fleet[0].clone()])
    );
    assert_eq!(world.pushed(), vec![fleet[0].clone()]);
}

#[test]
fn a_drifted_event_names_the_changed_paths_the_ingest_found_against_the_current_desired_spec() {
    let mut world = World::new(settings());
    let fleet = world.fleet_of(2, 0);
    let desired = world.fleet.get(&fleet[0]).unwrap().desired.unwrap();
    let with_drift = |world: &mut World, against: SpecDigest| {
        world.seq += 1;
        ReportedState {
            seq: world.seq,
            digest: SpecDigest::of(&spec(9)),
            generation: Some(Generation(2)),
            rejection: None,
            drift: Some(Arc::new(crate::reconcile::diff::DriftPaths {
                against,
                paths: vec!["fw".into()],
                more: 0,
            })),
        }
    };
    let report = with_drift(&mut world, desired.digest);
    world.deliver(&fleet[0], report);
    // Compared with a desired spec that is no longer the device's: no paths.
    let report = with_drift(&mut world, SpecDigest::of(&spec(1)));
    world.deliver(&fleet[1], report);
    world.settle();
    let paths: Vec<(String, Value)> = world
        .drifted
        .iter()
        .map(|(device, data)| (device.clone(), data["changed_paths"].clone()))
        .collect();
    assert_eq!(
        paths,
        vec![
            (fleet[0].to_string(), json!(["fw"])),
            (fleet[1].to_string(), Value::Null)
        ]
    );
}

#[test]
fn a_device_drifted_only_in_a_field_it_now_owns_is_converged_and_one_differing_elsewhere_is_reconciled(
) {
    use crate::reconcile::owned::{parse_path, OwnedFields};
    let mut world = World::new(settings());
    let fleet = world.fleet_of(2, 0);
    // Exempt, so the drift stays unremediated until the owned fields change.
    world.exempt(&fleet[0], true);
    let mut with_uptime = spec(2);
    with_uptime["uptime"] = serde_json::json!(5);
    world.seq += 1;
    let report = ReportedState {
        seq: world.seq,
        digest: SpecDigest::of(&with_uptime),
        generation: Some(Generation(2)),
        rejection: None,
        drift: None,
    };
    world.deliver(&fleet[0], report);
    world.wait(Duration::from_secs(2));
    assert_eq!(world.status(&fleet[0]), DeviceStatus::Drifted);

    let uptime = Arc::new(OwnedFields::new(vec![parse_path("uptime").unwrap()]));
    world.fleet.apply_committed([
        FleetChange::Owned {
            id: fleet[0].clone(),
            owned: Some(uptime.clone()),
            reported_digest: Some(uptime.digest(&with_uptime)),
            retained_stale: false,
        },
        // The other one's report now compares as another version (say a
        // path it owned is its own no more): it differs.
        FleetChange::Owned {
            id: fleet[1].clone(),
            owned: None,
            reported_digest: Some(SpecDigest::of(&spec(7))),
            retained_stale: false,
        },
    ]);
    world.command(EngineCommand::OwnedChanged {
        changed: fleet.clone(),
        republish: Vec::new(),
    });
    world.wait(Duration::from_secs(2));
    assert_eq!(world.status(&fleet[0]), DeviceStatus::Converged);
    let last = world.runs.last().unwrap();
    assert_eq!(
        (last.trigger, last.targets.clone()),
        (Trigger::Drift, vec![fleet[1].clone()])
    );
}

#[test]
fn nothing_is_published_to_an_exempt_device_not_even_its_retained_message_until_the_exemption_ends()
{
    let mut world = World::new(settings());
    let fleet = world.fleet_of(2, 0);
    // Both have a retained message at generation 2 from an earlier push.
    for device in &fleet {
        world.fleet.apply_committed([FleetChange::Engine(
            device.clone(),
            crate::reconcile::change::DeviceChange {
                retained: Some(Generation(2)),
                ..Default::default()
            },
        )]);
    }
    world.exempt(&fleet[0], true);
    // A new desired spec, and the run that applies it.
    for device in &fleet {
        world.wants(device, 3, 3);
    }
    world.command(EngineCommand::DesiredChanged(fleet.clone()));
    let run = world.create(fleet.clone(), false);
    world.settle();
    let to = |world: &World, device: &DeviceId| {
        world
            .published
            .iter()
            .filter(|(d, _, _)| d == device)
            .count()
    };
    assert_eq!(to(&world, &fleet[0]), 0, "{:?}", world.published);
    assert!(to(&world, &fleet[1]) > 0);
    let skipped = world.outcomes[&run]
        .iter()
        .find(|(d, _, _)| *d == fleet[0])
        .cloned()
        .unwrap();
    assert_eq!(skipped.2.as_deref(), Some("exempt"));

    // Once it ends, the device gets generation 3.
    world.exempt(&fleet[0], false);
    world.wait(Duration::from_secs(2));
    assert!(
        world
            .published
            .iter()
            .any(|(d, g, _)| *d == fleet[0] && *g == 3),
        "{:?}",
        world.published
    );
}

#[test]
fn an_exemption_that_starts_while_an_attempt_waits_ends_it_skipped_exempt_without_a_push() {
    let mut world = World::new(settings());
    // Never reported: the run asks it for a report and waits.
    let silent = world.device("silent", Some(2), None);
    let run = world.create(vec![silent.clone()], false);
    world.settle();
    assert!(world.asked.contains(&silent));
    world.exempt(&silent, true);
    // Its report arrives now: still no push.
    world.reports(&silent, 1, Some(1));
    world.settle();
    assert!(world.pushed().is_empty(), "{:?}", world.published);
    let outcome = world.outcomes[&run]
        .iter()
        .find(|(d, _, _)| *d == silent)
        .cloned()
        .unwrap();
    assert_eq!(
        (outcome.1, outcome.2.as_deref()),
        (OutcomeKind::Skipped, Some("exempt"))
    );
}
