use super::*;
use crate::reconcile::decide::ReportedState;
use serde_json::json;
use std::collections::HashMap;

fn id(name: &str) -> DeviceId {
    DeviceId::parse(name).unwrap()
}

fn digest(version: u64) -> SpecDigest {
    SpecDigest::of(&json!({ "fw": version }))
}

fn desired(generation: u64, version: u64) -> DesiredState {
    DesiredState::new(
        Generation(generation),
        digest(version),
        Arc::new(json!({ "fw": version })),
        None,
    )
}

/// An online device wanting generation 1 (version 1) that reported `reported`.
fn entry(reported: Option<u64>) -> DeviceEntry {
    DeviceEntry {
        desired: Some(desired(1, 1)),
        reported: reported.map(|version| ReportedState {
            seq: 10,
            digest: digest(version),
            generation: Some(Generation(1)),
            rejection: None,
            drift: None,
        }),
        online: Some(true),
        status: DeviceStatus::Converged,
        ..DeviceEntry::default()
    }
}

fn wanting(version: u64) -> Desired {
    Desired {
        generation: Generation(2),
        digest: digest(version),
    }
}

#[test]
fn a_device_whose_report_matches_the_change_is_converged_and_one_that_differs_is_pushed() {
    assert_eq!(
        verdict(&entry(Some(2)), &wanting(2), false),
        Verdict::Converged
    );
    assert_eq!(verdict(&entry(Some(1)), &wanting(2), false), Verdict::Push);
}

#[test]
fn force_pushes_even_to_a_matching_device_and_to_one_that_never_reported() {
    assert_eq!(verdict(&entry(Some(2)), &wanting(2), true), Verdict::Push);
    assert_eq!(verdict(&entry(None), &wanting(2), true), Verdict::Push);
}

#[test]
fn a_device_that_never_reported_is_skipped_as_no_report() {
    assert_eq!(
        verdict(&entry(None), &wanting(2), false),
        Verdict::Skipped(PlanSkip::NoReport)
    );
}

#[test]
fn quarantined_and_offline_devices_are_skipped_before_anything_is_compared() {
    let quarantined = DeviceEntry {
        status: DeviceStatus::Quarantined,
        ..entry(Some(1))
    };
    let offline = DeviceEntry {
        online: Some(false),
        ..entry(Some(1))
    };
    for force in [false, true] {
        assert_eq!(
            verdict(&quarantined, &wanting(2), force),
            Verdict::Skipped(PlanSkip::Blocked(Blocked::Quarantined))
        );
        assert_eq!(
            verdict(&offline, &wanting(2), force),
            Verdict::Skipped(PlanSkip::Blocked(Blocked::Offline))
        );
    }
}

#[test]
fn the_planned_generation_counts_up_only_when_the_desired_digest_changes() {
    assert_eq!(
        planned_generation(Some(&desired(4, 1)), digest(1)),
        (Generation(4), false)
    );
    assert_eq!(
        planned_generation(Some(&desired(4, 1)), digest(2)),
        (Generation(5), true)
    );
    assert_eq!(planned_generation(None, digest(2)), (Generation(1), true));
}

fn fleet() -> HashMap<DeviceId, DeviceEntry> {
    HashMap::from([
        (id("c-converged"), entry(Some(2))),
        (id("a-drifted"), entry(Some(1))),
        (id("b-silent"), entry(None)),
        (
            id("d-offline"),
            DeviceEntry {
                online: Some(false),
                ..entry(Some(1))
            },
        ),
    ])
}

#[test]
fn a_plan_lists_every_known_target_in_id_order_with_counts_per_verdict() {
    let fleet = fleet();
    let targets = [
        id("c-converged"),
        id("gone"),
        id("a-drifted"),
        id("d-offline"),
        id("b-silent"),
        id("a-drifted"),
    ];
    let new_spec = json!({ "fw": 2 });
    let mut spec = NewSpecDigests::new(&new_spec, digest(2));
    let (devices, counts) = plan_devices(&targets, |id| fleet.get(id).cloned(), &mut spec, false);
    let listed: Vec<(&str, Verdict)> = devices.iter().map(|d| (d.id.as_str(), d.verdict)).collect();
    assert_eq!(
        listed,
        vec![
            ("a-drifted", Verdict::Push),
            ("b-silent", Verdict::Skipped(PlanSkip::NoReport)),
            ("c-converged", Verdict::Converged),
            (
                "d-offline",
                Verdict::Skipped(PlanSkip::Blocked(Blocked::Offline))
            ),
        ]
    );
    assert_eq!(counts.converged, 1);
    assert_eq!(counts.push, 1);
    assert_eq!(counts.skipped(), 2);
    assert!(devices
        .iter()
        .all(|d| d.generation == Generation(2) && d.new_generation));
}

fn plan_of(fleet: &HashMap<DeviceId, DeviceEntry>, created_at: DateTime<Utc>) -> Plan {
    let targets: Vec<DeviceId> = fleet.keys().cloned().collect();
    let new_spec = json!({ "fw": 2 });
    let mut spec = NewSpecDigests::new(&new_spec, digest(2));
    let (devices, counts) = plan_devices(&targets, |id| fleet.get(id).cloned(), &mut spec, false);
    Plan {
        id: Uuid::now_v7(),
        author: "ops".into(),
        created_at,
        expires_at: created_at + chrono::Duration::hours(1),
        targeting: Targeting::All,
        spec: Arc::new(json!({ "fw": 2 })),
        digest: digest(2),
        force: false,
        devices,
        counts,
    }
}

#[test]
fn a_plan_is_fresh_while_nothing_it_was_computed_on_changes() {
    let fleet = fleet();
    let plan = plan_of(&fleet, Utc::now());
    let mut staleness = Staleness::default();
    staleness.compare(&plan.devices, |id| fleet.get(id).cloned());
    assert!(staleness.is_fresh(), "{staleness}");
}

#[test]
fn staleness_counts_each_changed_device_once_and_says_what_changed() {
    let mut fleet = fleet();
    let plan = plan_of(&fleet, Utc::now());
    let reported = fleet.get_mut(&id("a-drifted")).unwrap();
    let report = reported.reported.as_mut().unwrap();
    report.seq += 1;
    report.digest = digest(5);
    reported.status = DeviceStatus::Drifted;
    let report = fleet
        .get_mut(&id("c-converged"))
        .unwrap()
        .reported
        .as_mut()
        .unwrap();
    report.seq += 1;
    report.generation = Some(Generation(2));
    fleet.get_mut(&id("b-silent")).unwrap().desired = Some(desired(2, 3));
    fleet.get_mut(&id("d-offline")).unwrap().online = Some(true);
    let mut staleness = Staleness::default();
    staleness.compare(&plan.devices, |id| fleet.get(id).cloned());
    (staleness.joined, staleness.left) = retargeted(
        &plan,
        &[
            id("a-drifted"),
            id("b-silent"),
            id("c-converged"),
            id("d-offline"),
            id("new-one"),
        ],
        |id| fleet.contains_key(id),
    );
    assert_eq!(
        staleness,
        Staleness {
            reported: 2,
            desired: 1,
            connection: 1,
            joined: 1,
            ..Staleness::default()
        }
    );
    assert_eq!(
        staleness.to_string(),
        "2 devices reported a change since the plan; desired state changed for 1 device since the plan; \
         1 device connected or disconnected since the plan; 1 device more matched by its \
         targeting now; re-plan"
    );
}

#[test]
fn a_deleted_target_makes_the_plan_stale() {
    let mut fleet = fleet();
    let plan = plan_of(&fleet, Utc::now());
    fleet.remove(&id("a-drifted"));
    let mut staleness = Staleness::default();
    staleness.compare(&plan.devices, |id| fleet.get(id).cloned());
    assert_eq!(staleness.gone, 1);
    assert_eq!(
        staleness.to_string(),
        "1 device deleted since the plan; re-plan"
    );
}

#[test]
fn a_page_continues_after_the_last_id_and_filters_by_verdict() {
    let plan = plan_of(&fleet(), Utc::now());
    let any = |_: Verdict| true;
    let (first, more) = plan.page(None, any, 2);
    let first: Vec<&str> = first.iter().map(|d| d.id.as_str()).collect();
    assert_eq!((first, more), (vec!["a-drifted", "b-silent"], true));
    let (rest, more) = plan.page(Some("b-silent"), any, 2);
    let rest: Vec<&str> = rest.iter().map(|d| d.id.as_str()).collect();
    assert_eq!((rest, more), (vec!["c-converged", "d-offline"], false));
    let skipped = |v: Verdict| matches!(v, Verdict::Skipped(_));
    let (page, more) = plan.page(None, skipped, 10);
    let page: Vec<&str> = page.iter().map(|d| d.id.as_str()).collect();
    assert_eq!((page, more), (vec!["b-silent", "d-offline"], false));
}

#[test]
fn a_plan_is_stale_when_what_a_device_owns_changed() {
    let mut fleet = fleet();
    let plan = plan_of(&fleet, Utc::now());
    // Same report, same generation, same digests: only what the device owns
    // changed, which changes what the new spec is compared without.
    fleet.get_mut(&id("c-converged")).unwrap().owned =
        Some(Arc::new(crate::reconcile::owned::OwnedFields::new(vec![
            crate::reconcile::owned::parse_path("b").unwrap(),
        ])));
    let mut staleness = Staleness::default();
    staleness.compare(&plan.devices, |id| fleet.get(id).cloned());
    assert_eq!(
        staleness,
        Staleness {
            owned: 1,
            ..Staleness::default()
        }
    );
    assert_eq!(
        staleness.to_string(),
        "owned fields changed for 1 device since the plan; re-plan"
    );
}

#[test]
fn a_device_differing_only_in_a_field_it_owns_is_planned_converged_with_its_generation_counted_on_the_whole_spec(
) {
    use crate::reconcile::owned::{parse_path, OwnedFields};
    let owned = Arc::new(OwnedFields::new(vec![parse_path("uptime").unwrap()]));
    let reported = json!({ "fw": 2, "uptime": 77 });
    let device = DeviceEntry {
        owned: Some(owned.clone()),
        reported: Some(ReportedState {
            seq: 10,
            digest: owned.digest(&reported),
            generation: Some(Generation(1)),
            rejection: None,
            drift: None,
        }),
        ..entry(None)
    };
    let fleet: HashMap<DeviceId, DeviceEntry> = [(id("owner"), device)].into();
    let new_spec = json!({ "fw": 2, "uptime": 0 });
    let mut spec = NewSpecDigests::new(&new_spec, SpecDigest::of(&new_spec));
    let (devices, counts) = plan_devices(
        &[id("owner")],
        |id| fleet.get(id).cloned(),
        &mut spec,
        false,
    );
    assert_eq!(devices[0].verdict, Verdict::Converged);
    assert_eq!((counts.converged, counts.push), (1, 0));
    // The stored spec changes, so the generation counts up all the same.
    assert_eq!(
        (devices[0].generation, devices[0].new_generation),
        (Generation(2), true)
    );
}

#[test]
fn a_planned_device_relabelled_out_of_its_selector_makes_the_plan_stale_a_deleted_one_counts_gone()
{
    let mut fleet = fleet();
    let plan = plan_of(&fleet, Utc::now());
    fleet.remove(&id("d-offline"));
    // Matched now: all but c-converged (relabelled) and d-offline (deleted).
    let now = [id("a-drifted"), id("b-silent")];
    let (joined, left) = retargeted(&plan, &now, |id| fleet.contains_key(id));
    let mut staleness = Staleness {
        joined,
        left,
        ..Staleness::default()
    };
    staleness.compare(&plan.devices, |id| fleet.get(id).cloned());
    assert_eq!(
        (staleness.left, staleness.gone, staleness.joined),
        (1, 1, 0)
    );
    assert_eq!(
        staleness.to_string(),
        "1 device deleted since the plan; 1 device no longer matched by its targeting; re-plan"
    );
}

#[test]
fn a_report_that_says_the_same_again_leaves_the_plan_fresh() {
    let mut fleet = fleet();
    let plan = plan_of(&fleet, Utc::now());
    // The resync asks quiet devices for a report every few minutes.
    for entry in fleet.values_mut() {
        if let Some(report) = entry.reported.as_mut() {
            report.seq += 1;
        }
    }
    let mut staleness = Staleness::default();
    staleness.compare(&plan.devices, |id| fleet.get(id).cloned());
    assert!(staleness.is_fresh(), "{staleness}");
}
