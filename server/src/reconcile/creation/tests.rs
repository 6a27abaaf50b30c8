use super::*;
use crate::reconcile::decide::ReportedState;
use crate::reconcile::device::DesiredState;
use crate::reconcile::owned::{parse_path, OwnedFields};
use crate::reconcile::plan::{plan_devices, Verdict};
use crate::reconcile::rollout::{WaveSize, WaveSpec};
use idem_protocol::api::Targeting;
use idem_protocol::event::EventType;
use idem_protocol::{DeviceStatus, SpecDigest};
use serde_json::{json, Value};
use std::sync::Arc;

fn id(name: &str) -> DeviceId {
    DeviceId::parse(name).unwrap()
}

fn ids(names: &[&str]) -> Vec<DeviceId> {
    names.iter().map(|name| id(name)).collect()
}

fn spec(version: u64) -> Value {
    json!({ "fw": version, "name": "cloud" })
}

fn digest(version: u64) -> SpecDigest {
    SpecDigest::of(&spec(version))
}

/// An online device at desired generation 1 (version 1) that reported
/// `reported` (a version), status `converged`.
fn device(reported: Option<u64>) -> DeviceEntry {
    DeviceEntry {
        desired: Some(DesiredState::new(
            Generation(1),
            digest(1),
            Arc::new(spec(1)),
            None,
        )),
        reported: reported.map(|version| reporting(digest(version))),
        online: Some(true),
        status: DeviceStatus::Converged,
        ..DeviceEntry::default()
    }
}

fn reporting(digest: SpecDigest) -> ReportedState {
    ReportedState {
        seq: 7,
        digest,
        generation: Some(Generation(1)),
        rejection: None,
        drift: None,
    }
}

type Fleet = HashMap<DeviceId, DeviceEntry>;

fn fleet(devices: &[(&str, DeviceEntry)]) -> Fleet {
    devices
        .iter()
        .map(|(name, entry)| (id(name), entry.clone()))
        .collect()
}

/// A run over `targets` (in that order) changing every desired spec to
/// version `version` as generation 2.
fn changing_to<'a>(version_spec: &'a Value, targets: &'a [DeviceId]) -> RunToJudge<'a> {
    RunToJudge {
        id: Uuid::now_v7(),
        trigger: Trigger::Desired,
        force: false,
        started_by: Some("ops".into()),
        targets: targets.to_vec(),
        new_spec: Some(NewSpecDigests::new(
            version_spec,
            SpecDigest::of(version_spec),
        )),
        new_generations: targets.iter().map(|id| (id, Generation(2))).collect(),
        rollout: None,
    }
}

fn judge(run: RunToJudge<'_>, fleet: &Fleet) -> JudgedRun {
    judge_new_run(run, |id| fleet.get(id).cloned(), Instant::now(), Utc::now())
}

fn names(ids: impl IntoIterator<Item = DeviceId>) -> Vec<String> {
    ids.into_iter().map(|id| id.to_string()).collect()
}

fn carried_names(judged: &JudgedRun) -> Vec<String> {
    names(judged.carried().map(|c| c.id.clone()))
}

#[test]
fn a_target_already_reporting_the_new_spec_is_decided_converged_at_creation_with_its_event() {
    let fleet = fleet(&[
        ("matches", device(Some(2))),
        ("differs", device(Some(1))),
        ("silent", device(None)),
    ]);
    let new_spec = spec(2);
    let targets = ids(&["matches", "differs", "silent"]);
    let run = changing_to(&new_spec, &targets);
    let run_id = run.id;
    let judged = judge(run, &fleet);

    assert_eq!(judged.converged.len(), 1);
    let converged = &judged.converged[0];
    assert_eq!(
        (converged.id.as_str(), converged.generation),
        ("matches", Generation(2))
    );
    assert_eq!(converged.change, None, "a converged row is not rewritten");
    assert_eq!(carried_names(&judged), ["differs", "silent"]);
    assert_eq!(
        judged.carried().map(|c| c.differed).collect::<Vec<_>>(),
        [true, false],
        "only a target with a report that differs was provisioned if found converged later"
    );

    let started = &judged.started;
    assert_eq!(started.event_type, EventType::RunStarted);
    assert_eq!(
        (started.run_id, started.data["target_count"].as_u64()),
        (Some(run_id), Some(3))
    );

    assert_eq!(names(judged.spec.targets.clone()), ["differs", "silent"]);
    assert_eq!(names(judged.spec.converged.clone()), ["matches"]);
    assert_eq!(judged.spec.decided.total(), 1);
    assert!(judged.spec.differed.contains(&id("differs")));
    assert!(judged.spec.rollout.is_none() && judged.stored_rollout.is_none());
}

#[test]
fn a_converged_target_whose_row_says_otherwise_gets_its_status_and_failures_reset() {
    let fleet = fleet(&[(
        "recovered",
        DeviceEntry {
            status: DeviceStatus::Failed,
            failures: 3,
            ..device(Some(2))
        },
    )]);
    let new_spec = spec(2);
    let targets = ids(&["recovered"]);
    let judged = judge(changing_to(&new_spec, &targets), &fleet);
    let change = judged.converged[0].change.clone().expect("its row changes");
    assert_eq!(change.status, Some(DeviceStatus::Converged));
    assert_eq!(change.failures, Some((0, None)));
}

#[test]
fn a_forced_run_decides_nothing_at_creation() {
    let fleet = fleet(&[("matches", device(Some(2)))]);
    let new_spec = spec(2);
    let targets = ids(&["matches"]);
    let mut run = changing_to(&new_spec, &targets);
    run.force = true;
    let judged = judge(run, &fleet);
    assert_eq!(judged.converged.len(), 0);
    assert_eq!(carried_names(&judged), ["matches"]);
    assert_eq!(judged.started.event_type, EventType::RunStarted);
}

#[test]
fn a_run_without_a_desired_change_judges_each_target_on_its_current_desired_state() {
    let fleet = fleet(&[("converged", device(Some(1))), ("behind", device(Some(0)))]);
    let run = RunToJudge {
        new_spec: None,
        new_generations: HashMap::new(),
        trigger: Trigger::Manual,
        ..changing_to(&Value::Null, &ids(&["converged", "behind"]))
    };
    let judged = judge(run, &fleet);
    assert_eq!(names(judged.spec.converged.clone()), ["converged"]);
    assert_eq!(judged.converged[0].generation, Generation(1));
    assert_eq!(carried_names(&judged), ["behind"]);
}

#[test]
fn an_exempt_offline_or_quarantined_target_is_never_converged_at_creation() {
    let fleet = fleet(&[
        (
            "exempt",
            DeviceEntry {
                exempt: true,
                ..device(Some(2))
            },
        ),
        (
            "offline",
            DeviceEntry {
                online: Some(false),
                ..device(Some(2))
            },
        ),
        (
            "quarantined",
            DeviceEntry {
                status: DeviceStatus::Quarantined,
                ..device(Some(2))
            },
        ),
    ]);
    let new_spec = spec(2);
    let judged = judge(
        changing_to(&new_spec, &ids(&["exempt", "offline", "quarantined"])),
        &fleet,
    );
    assert_eq!(judged.converged.len(), 0);
    assert_eq!(carried_names(&judged), ["exempt", "offline", "quarantined"]);
}

#[test]
fn a_device_that_owns_a_field_is_converged_when_the_rest_of_the_new_spec_matches() {
    let owns_name = Arc::new(OwnedFields::new(vec![parse_path("name").unwrap()]));
    let new_spec = spec(2);
    let without_name = owns_name.digest(&new_spec);
    let reports_without_name = |owned: Option<Arc<OwnedFields>>| DeviceEntry {
        reported: Some(reporting(without_name)),
        owned,
        ..device(None)
    };
    let fleet = fleet(&[
        ("owner", reports_without_name(Some(owns_name.clone()))),
        ("not-owner", reports_without_name(None)),
    ]);
    let targets = ids(&["owner", "not-owner"]);
    let judged = judge(changing_to(&new_spec, &targets), &fleet);
    assert_eq!(names(judged.spec.converged.clone()), ["owner"]);
    assert_eq!(carried_names(&judged), ["not-owner"]);
}

#[test]
fn only_the_targets_left_for_the_engine_are_assigned_to_waves() {
    let mut entries = vec![("converged-0".to_owned(), device(Some(2)))];
    entries.extend((0..4).map(|n| (format!("needs-{n}"), device(Some(1)))));
    let fleet: Fleet = entries
        .iter()
        .map(|(name, entry)| (id(name), entry.clone()))
        .collect();
    let new_spec = spec(2);
    let targets: Vec<DeviceId> = entries.iter().map(|(name, _)| id(name)).collect();
    let mut run = changing_to(&new_spec, &targets);
    run.rollout = Some(
        RolloutSpec::new(vec![
            WaveSpec::sized(WaveSize::Count(1)),
            WaveSpec::sized(WaveSize::Percent(100.0)),
        ])
        .unwrap(),
    );
    let judged = judge(run, &fleet);

    let mut waves: Vec<Option<usize>> = judged.carried().map(|c| c.wave).collect();
    waves.sort();
    assert_eq!(
        waves,
        [Some(0), Some(1), Some(1), Some(1)],
        "one canary, then the rest"
    );
    let rollout = judged.spec.rollout.as_ref().expect("a staged run");
    assert_eq!(rollout.waves.len(), 4);
    assert!(!rollout.waves.contains_key(&id("converged-0")));
    let stored = judged.stored_rollout.as_ref().expect("stored at creation");
    let sizes: Vec<u64> = stored.counts.iter().map(|c| c.size).collect();
    assert_eq!(sizes, [1, 3], "the waves count the four that need a push");
}

#[test]
fn a_plan_is_fresh_only_while_its_devices_and_its_targeting_are_as_they_were() {
    let mut fleet = fleet(&[("a", device(Some(1))), ("b", device(Some(1)))]);
    let new_spec = spec(2);
    let targets = [id("a"), id("b")];
    let mut digests = NewSpecDigests::new(&new_spec, SpecDigest::of(&new_spec));
    let (devices, counts) =
        plan_devices(&targets, |id| fleet.get(id).cloned(), &mut digests, false);
    assert!(devices.iter().all(|d| d.verdict == Verdict::Push));
    let plan = Plan {
        id: Uuid::now_v7(),
        author: "ops".into(),
        created_at: Utc::now(),
        expires_at: Utc::now() + chrono::Duration::hours(1),
        targeting: Targeting::All,
        spec: Arc::new(new_spec.clone()),
        digest: SpecDigest::of(&new_spec),
        force: false,
        devices,
        counts,
    };
    let view = |fleet: &Fleet| {
        let fleet = fleet.clone();
        move |id: &DeviceId| fleet.get(id).cloned()
    };
    assert_eq!(plan_freshness(&plan, &targets, view(&fleet)), Ok(()));

    let joined = plan_freshness(&plan, &[id("a"), id("b"), id("c")], |id| {
        fleet
            .get(id)
            .cloned()
            .or_else(|| (id.as_str() == "c").then(|| device(None)))
    });
    assert_eq!(
        joined.map_err(|s| s.joined),
        Err(1),
        "a device the targeting matches now"
    );

    fleet.insert(id("b"), device(Some(2)));
    let stale = plan_freshness(&plan, &targets, view(&fleet)).unwrap_err();
    assert_eq!(stale.reported, 1, "b reported since: {stale}");
}

#[test]
fn a_quarantine_release_keeps_only_the_targets_it_released() {
    let quarantined: HashSet<DeviceId> = [id("b"), id("c")].into();
    let kept = released_targets(vec![id("a"), id("b"), id("c")], &quarantined);
    assert_eq!(kept.map(names), Some(vec!["b".to_owned(), "c".to_owned()]));
    assert_eq!(released_targets(vec![id("a")], &quarantined), None);
}
