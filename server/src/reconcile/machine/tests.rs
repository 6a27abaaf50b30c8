//! The engine's state machine driven by hand: no broker, no database, a
//! clock the test moves. `World` plays the engine loop (commits every
//! record and applies it to the cache) and the devices (reports).

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use idem_protocol::SpecDigest;
use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::events::EventType;
use crate::reconcile::decide::ReportedState;
use crate::reconcile::outcome::{OutcomeCounts, OutcomeKind};
use crate::reconcile::policy::RetryPolicy;
use crate::store::cache::{DesiredState, FleetCache, FleetChange};

const PUSH_TIMEOUT: Duration = Duration::from_secs(5);

fn settings() -> EngineSettings {
    EngineSettings {
        push_timeout: PUSH_TIMEOUT,
        retry: RetryPolicy {
            max_attempts: 3,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(4),
        },
        push_rate: None,
        max_in_flight: 1_000,
        debounce: Duration::from_millis(500),
        resync_interval: None,
        stale_after: Duration::from_secs(3_600),
        missing_report_after: None,
        recheck_rate: None,
    }
}

fn id(name: &str) -> DeviceId {
    DeviceId::parse(name).unwrap()
}

fn spec(version: u64) -> Value {
    json!({ "fw": version })
}

/// The engine loop and the devices, around one machine.
struct World {
    fleet: Arc<FleetCache>,
    machine: Machine,
    clock: Instant,
    wall: DateTime<Utc>,
    /// Every publish, in order: `(device, generation, reason)`.
    published: Vec<(DeviceId, u64, PublishReason)>,
    asked: Vec<DeviceId>,
    /// Every run started, in order (also those the engine asked for).
    runs: Vec<RunSpec>,
    /// Committed outcomes: run → (device, kind).
    outcomes: BTreeMap<Uuid, Vec<(DeviceId, OutcomeKind, Option<String>)>>,
    completed: Vec<Uuid>,
    events: Vec<EventType>,
    seq: u64,
    /// Records handed out and not yet written (`None`: each is written at once).
    held: Option<Vec<Record>>,
    /// Every target of each run, those decided at its creation included.
    all_targets: BTreeMap<Uuid, Vec<DeviceId>>,
}

impl World {
    fn new(settings: EngineSettings) -> Self {
        let fleet = Arc::new(FleetCache::default());
        let clock = Instant::now();
        let machine = Machine::new(settings, fleet.clone(), clock, 7);
        Self {
            fleet,
            machine,
            clock,
            wall: Utc::now(),
            published: Vec::new(),
            asked: Vec::new(),
            runs: Vec::new(),
            outcomes: BTreeMap::new(),
            completed: Vec::new(),
            events: Vec::new(),
            seq: 0,
            held: None,
            all_targets: BTreeMap::new(),
        }
    }

    fn now(&self) -> Now {
        Now {
            at: self.clock,
            wall: self.wall,
        }
    }

    /// A registered, online device that wants `desired` and last reported `reported`.
    fn device(&mut self, name: &str, desired: Option<u64>, reported: Option<u64>) -> DeviceId {
        let device = id(name);
        let desired = desired.map(|v| DesiredState {
            generation: v,
            digest: SpecDigest::of(&spec(v)),
            spec: Arc::new(spec(v)),
        });
        let reported = reported.map(|v| {
            self.seq += 1;
            ReportedState {
                seq: self.seq,
                digest: SpecDigest::of(&spec(v)),
                generation: Some(v),
                rejection: None,
            }
        });
        let status = match (&desired, &reported) {
            (Some(d), Some(r)) if d.digest == r.digest => DeviceStatus::Converged,
            _ => DeviceStatus::Unknown,
        };
        let retained_generation = desired.as_ref().map(|d| d.generation);
        self.fleet.insert(
            device.clone(),
            DeviceEntry {
                desired,
                reported,
                online: Some(true),
                status,
                retained_generation,
                ..DeviceEntry::default()
            },
        );
        device
    }

    fn fleet_of(&mut self, n: usize, drifted: usize) -> Vec<DeviceId> {
        (0..n)
            .map(|i| {
                let reported = if i < drifted { 1 } else { 2 };
                self.device(&format!("d-{i:05}"), Some(2), Some(reported))
            })
            .collect()
    }

    fn carry(&mut self, effects: Vec<Effect>) {
        let mut asked_for = Vec::new();
        for effect in effects {
            match effect {
                Effect::Publish {
                    device,
                    generation,
                    reason,
                    ..
                } => self.published.push((device, generation, reason)),
                Effect::AskForReport { device, .. } => self.asked.push(device),
                Effect::StartRun { trigger, targets } => asked_for.push((trigger, targets)),
                Effect::Record(record) => match &mut self.held {
                    Some(held) => held.push(record),
                    None => self.commit(record),
                },
            }
        }
        for (trigger, targets) in asked_for {
            self.start(trigger, targets, false);
        }
    }

    fn commit(&mut self, record: Record) {
        self.fleet.apply_committed(
            record
                .devices
                .into_iter()
                .map(|(id, change)| FleetChange::Engine(id, change)),
        );
        for row in record.outcomes {
            self.outcomes
                .entry(row.run_id)
                .or_default()
                .push((row.device, row.kind, row.reason));
        }
        self.events
            .extend(record.drafts.iter().map(|draft| draft.event_type));
        self.completed
            .extend(record.completed.iter().map(|run| run.id));
        self.machine.record_written(self.clock);
    }

    /// From now on the records the machine hands out wait, as a write that
    /// has not committed yet.
    fn hold_writes(&mut self) {
        self.held.get_or_insert_with(Vec::new);
    }

    /// The held writes commit, in order; later ones are written at once.
    fn commit_held(&mut self) {
        for record in self.held.take().unwrap_or_default() {
            self.commit(record);
        }
    }

    /// A run created as the engine creates one: its targets judged on the
    /// machine's view (`policy::converged_targets`), those already
    /// converged decided in the creating "transaction", the rest started.
    fn create(&mut self, targets: Vec<DeviceId>, force: bool) -> Uuid {
        let machine = &self.machine;
        let converged = crate::reconcile::policy::converged_targets(
            |id| machine.view(id),
            &targets,
            force,
            None,
            &std::collections::HashMap::new(),
        );
        let run_id = Uuid::now_v7();
        let decided: Vec<DeviceId> = converged.iter().map(|c| c.id.clone()).collect();
        for c in converged {
            self.outcomes.entry(run_id).or_default().push((
                c.id.clone(),
                OutcomeKind::AlreadyConverged,
                None,
            ));
            if let Some(change) = c.change {
                self.fleet
                    .apply_committed([FleetChange::Engine(c.id.clone(), change)]);
            }
        }
        let spec = RunSpec {
            id: run_id,
            trigger: Trigger::Manual,
            targets: targets
                .iter()
                .filter(|id| !decided.contains(id))
                .cloned()
                .collect(),
            force,
            decided: decided.len(),
            converged: decided,
        };
        self.all_targets.insert(run_id, targets);
        self.runs.push(spec.clone());
        self.command(EngineCommand::StartRun(spec));
        run_id
    }

    fn command(&mut self, command: EngineCommand) {
        let effects = self.machine.on_command(command, self.now());
        self.carry(effects);
    }

    fn start(&mut self, trigger: Trigger, targets: Vec<DeviceId>, force: bool) -> Uuid {
        let spec = RunSpec {
            id: Uuid::now_v7(),
            trigger,
            targets,
            force,
            decided: 0,
            converged: Vec::new(),
        };
        self.runs.push(spec.clone());
        self.command(EngineCommand::StartRun(spec.clone()));
        spec.id
    }

    fn run(&mut self, targets: &[DeviceId]) -> Uuid {
        let run = self.start(Trigger::Manual, targets.to_vec(), false);
        self.settle();
        run
    }

    /// Moves the clock on by `by`, in scan-sized steps.
    fn wait(&mut self, by: Duration) {
        let until = self.clock + by;
        while self.clock < until {
            self.clock = (self.clock + SCAN_INTERVAL).min(until);
            self.wall += chrono::Duration::from_std(SCAN_INTERVAL).unwrap();
            let effects = self.machine.on_tick(self.now());
            self.carry(effects);
        }
    }

    /// Lets pending results be written.
    fn settle(&mut self) {
        self.wait(FLUSH_INTERVAL * 2);
    }

    /// The device reports running `version`, as the answer to `generation` if given.
    fn reports(&mut self, device: &DeviceId, version: u64, generation: Option<u64>) {
        self.seq += 1;
        let reported = ReportedState {
            seq: self.seq,
            digest: SpecDigest::of(&spec(version)),
            generation,
            rejection: None,
        };
        self.deliver(device, reported);
    }

    /// The ingest stored `reported` for `device` and told the engine.
    fn deliver(&mut self, device: &DeviceId, reported: ReportedState) {
        self.fleet.apply_committed([FleetChange::Reported {
            id: device.clone(),
            reported,
            health: None,
        }]);
        let effects = self.machine.on_command(
            EngineCommand::ReportsApplied(vec![device.clone()]),
            self.now(),
        );
        self.carry(effects);
    }

    /// The device refuses the pushed `generation`, still running `version`.
    fn rejects(&mut self, device: &DeviceId, generation: u64, version: u64) {
        self.seq += 1;
        let reported = ReportedState {
            seq: self.seq,
            digest: SpecDigest::of(&spec(version)),
            generation: Some(version),
            rejection: Some((generation, "no space left".into())),
        };
        self.deliver(device, reported);
    }

    /// The operator sets desired `generation`, whose spec is version `version`.
    fn wants(&self, device: &DeviceId, generation: u64, version: u64) {
        self.fleet.apply_committed([FleetChange::Desired(
            device.clone(),
            DesiredState {
                generation,
                digest: SpecDigest::of(&spec(version)),
                spec: Arc::new(spec(version)),
            },
        )]);
    }

    /// Every device that received a push (reason `Attempt`), in order.
    fn pushed(&self) -> Vec<DeviceId> {
        self.published
            .iter()
            .filter(|(_, _, reason)| *reason == PublishReason::Attempt)
            .map(|(device, _, _)| device.clone())
            .collect()
    }

    fn kinds(&self, run: Uuid) -> Vec<(DeviceId, OutcomeKind)> {
        let mut kinds: Vec<_> = self
            .outcomes
            .get(&run)
            .map(|rows| rows.iter().map(|(d, k, _)| (d.clone(), *k)).collect())
            .unwrap_or_default();
        kinds.sort();
        kinds
    }

    fn counts(&self, run: Uuid) -> OutcomeCounts {
        let mut counts = OutcomeCounts::default();
        for (_, kind) in self.kinds(run) {
            counts.add(kind);
        }
        counts
    }

    fn status(&self, device: &DeviceId) -> DeviceStatus {
        self.fleet.get(device).unwrap().status
    }

    fn is_completed(&self, run: Uuid) -> bool {
        self.completed.contains(&run)
    }
}

fn counts(already_converged: u64, provisioned: u64, failed: u64) -> OutcomeCounts {
    OutcomeCounts {
        already_converged,
        provisioned,
        failed,
        ..OutcomeCounts::default()
    }
}

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
    assert!(world.is_completed(run));
    assert_eq!(world.counts(run), counts(46, 4, 0));
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

#[test]
fn a_converged_device_with_an_old_retained_message_gets_it_refreshed_without_an_attempt() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(3), Some(3));
    let retained = DeviceChange {
        retained: Some(2),
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
        Some(3)
    );
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
    let run = RunSpec::resumed(Uuid::now_v7(), Trigger::Manual, false, 5, Vec::new());
    world.command(EngineCommand::StartRun(run.clone()));
    world.settle();
    assert!(world.is_completed(run.id));
}

#[test]
fn a_target_found_converged_at_creation_ends_an_older_attempt_and_refreshes_the_retained_message() {
    let mut world = World::new(settings());
    let device = world.device("pump", Some(2), Some(1));
    let old = world.run(std::slice::from_ref(&device));
    // The operator reverts to what the device runs, as generation 3; the
    // run's creation finds the device converged.
    world.wants(&device, 3, 1);
    let run = RunSpec {
        id: Uuid::now_v7(),
        trigger: Trigger::Desired,
        targets: Vec::new(),
        force: false,
        decided: 1,
        converged: vec![device.clone()],
    };
    world.command(EngineCommand::StartRun(run.clone()));
    world.settle();
    assert_eq!(
        world.kinds(old),
        vec![(device.clone(), OutcomeKind::Superseded)]
    );
    assert!(world.is_completed(run.id));
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

/// One thing that can happen to the engine.
#[derive(Debug, Clone)]
enum Step {
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
}

const DEVICES: usize = 6;

fn step() -> impl Strategy<Value = Step> {
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
    ]
}

impl World {
    fn play(&mut self, fleet: &[DeviceId], step: &Step) {
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
        }
    }
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
            // also while a write was pending) or by the machine, never both.
            let mut expected: Vec<&DeviceId> = world
                .all_targets
                .get(&run.id)
                .map_or_else(|| run.targets.iter().collect(), |all| all.iter().collect());
            expected.sort();
            let mut decided: Vec<&DeviceId> = world
                .outcomes
                .get(&run.id)
                .map(|rows| rows.iter().map(|(d, _, _)| d).collect())
                .unwrap_or_default();
            decided.sort();
            prop_assert_eq!(decided, expected, "run {:?} of {:?}", run.id, run.trigger);
            prop_assert_eq!(
                world.completed.iter().filter(|id| **id == run.id).count(),
                1,
                "run completed exactly once"
            );
        }
        prop_assert_eq!(world.machine.stats(), MachineStats::default());
    }
}
