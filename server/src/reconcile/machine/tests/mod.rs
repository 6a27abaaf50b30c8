//! The engine's state machine driven by hand: no broker, no database, a
//! clock the test moves. `World` plays the engine loop (commits every
//! record and applies it to the cache, keeps the run rows' counts, restarts
//! the machine as a new process would) and the devices (reports). The tests
//! are by topic: `runs.rs` (a run's targets, outcomes and completion),
//! `pushes.rs` (the in-flight cap, forced runs, retained refreshes),
//! `failures.rs` (retries, quarantine, timeouts, deleted devices),
//! `triggers.rs` (runs and report requests the machine starts itself),
//! `property.rs` (any sequence of inputs) and `plans.rs` (a plan predicts
//! what applying it does) and `rollouts.rs` (waves, gates, pauses,
//! approvals and aborts of a staged rollout).

mod failures;
mod plans;
mod property;
mod pushes;
mod rollouts;
mod runs;
mod triggers;

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use idem_protocol::{Generation, SpecDigest};
use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::events::EventType;
use crate::reconcile::decide::ReportedState;
use crate::reconcile::outcome::{OutcomeCounts, OutcomeKind};
use crate::reconcile::policy::RetryPolicy;
use crate::reconcile::run::CompletedRun;
use crate::store::cache::{DesiredState, FleetCache, FleetChange};
use std::time::Duration;

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
    settings: EngineSettings,
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
    /// The run rows' counts: what each run's creation decided, plus the
    /// `per_run` counts of every committed record.
    stored: BTreeMap<Uuid, OutcomeCounts>,
    /// Every committed run completion, in order.
    completed: Vec<CompletedRun>,
    events: Vec<EventType>,
    /// The data of every `io.idem.device.drifted` event, in order.
    drifted: Vec<(String, Value)>,
    seq: u64,
    /// Records handed out and not yet written (`None`: each is written at once).
    held: Option<Vec<Record>>,
    /// Every target of each run, those decided at its creation included.
    all_targets: BTreeMap<Uuid, Vec<DeviceId>>,
    /// Each rollout as its run row keeps it, from the committed records.
    rollouts: BTreeMap<Uuid, crate::reconcile::rollout::StoredRollout>,
    /// Each rollout run's wave per target, as its target rows keep it.
    waves: BTreeMap<Uuid, std::collections::HashMap<DeviceId, usize>>,
    /// Every committed `io.idem.rollout.*` event: type and data.
    rollout_events: Vec<(EventType, Value)>,
    /// Every push to a device of a rollout, as it left.
    rollout_sends: Vec<RolloutSend>,
}

/// A push to a device of a rollout as it left: whether a committed write
/// already said it went out (status `provisioning` at its generation), and
/// whether the rollout's committed mark of early pushes covered it.
#[derive(Debug, Clone)]
struct RolloutSend {
    device: DeviceId,
    written: bool,
    marked: bool,
}

/// What the machine's counts must be: a tally of outcome rows.
fn tally<'a>(kinds: impl IntoIterator<Item = &'a OutcomeKind>) -> OutcomeCounts {
    let mut counts = OutcomeCounts::default();
    for kind in kinds {
        counts.add(*kind);
    }
    counts
}

impl World {
    fn new(settings: EngineSettings) -> Self {
        let fleet = Arc::new(FleetCache::default());
        let clock = Instant::now();
        let machine = Machine::new(settings.clone(), fleet.clone(), clock, 7);
        Self {
            fleet,
            settings,
            machine,
            clock,
            wall: Utc::now(),
            published: Vec::new(),
            asked: Vec::new(),
            runs: Vec::new(),
            outcomes: BTreeMap::new(),
            stored: BTreeMap::new(),
            completed: Vec::new(),
            events: Vec::new(),
            drifted: Vec::new(),
            seq: 0,
            held: None,
            all_targets: BTreeMap::new(),
            rollouts: BTreeMap::new(),
            waves: BTreeMap::new(),
            rollout_events: Vec::new(),
            rollout_sends: Vec::new(),
        }
    }

    /// Notes a push to `device` if it belongs to a rollout run's waves.
    fn note_rollout_send(&mut self, device: &DeviceId, generation: u64) {
        let mut in_rollout = false;
        let mut marked = false;
        for (run, waves) in &self.waves {
            let Some(wave) = waves.get(device) else {
                continue;
            };
            in_rollout = true;
            let early = self.rollouts.get(run).and_then(|r| r.early.as_ref());
            marked |= early.is_some_and(|e| e.covers(*wave, device.as_str()));
        }
        if !in_rollout {
            return;
        }
        let written = self.fleet.get(device).is_some_and(|entry| {
            entry.status == DeviceStatus::Provisioning
                && entry.retained_generation == Some(Generation(generation))
        });
        self.rollout_sends.push(RolloutSend {
            device: device.clone(),
            written,
            marked,
        });
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
        let desired = desired.map(|v| {
            DesiredState::new(
                Generation(v),
                SpecDigest::of(&spec(v)),
                Arc::new(spec(v)),
                None,
            )
        });
        let reported = reported.map(|v| {
            self.seq += 1;
            ReportedState {
                seq: self.seq,
                digest: SpecDigest::of(&spec(v)),
                generation: Some(Generation(v)),
                rejection: None,
                drift: None,
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
                } => {
                    if reason == PublishReason::Attempt {
                        self.note_rollout_send(&device, generation.get());
                    }
                    self.published.push((device, generation.get(), reason));
                }
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
        for (run_id, added) in record.per_run {
            // As `store::runs::record_outcomes` adds them to the run row.
            let OutcomeCounts {
                already_converged,
                provisioned,
                failed,
                skipped,
                superseded,
            } = added;
            let stored = self.stored.entry(run_id).or_default();
            stored.already_converged += already_converged;
            stored.provisioned += provisioned;
            stored.failed += failed;
            stored.skipped += skipped;
            stored.superseded += superseded;
        }
        self.events
            .extend(record.drafts.iter().map(|draft| draft.event_type));
        self.drifted.extend(
            record
                .drafts
                .iter()
                .filter(|draft| draft.event_type == EventType::DeviceDrifted)
                .map(|draft| (draft.subject.clone(), draft.data.clone())),
        );
        self.rollout_events.extend(
            record
                .drafts
                .iter()
                .filter(|draft| draft.event_type.as_str().starts_with("io.idem.rollout."))
                .map(|draft| (draft.event_type, draft.data.clone())),
        );
        self.rollouts.extend(record.rollouts);
        self.completed.extend(record.completed);
        self.machine.record_written(self.clock);
    }

    /// The process dies and a new one starts: the writes not yet committed
    /// are lost, a new machine reads the same fleet, and every run not
    /// completed is resumed from its row's counts and its targets without
    /// an outcome (as `app::resume_unfinished_runs` does).
    fn restart(&mut self) {
        self.held = None;
        self.machine = Machine::new(self.settings.clone(), self.fleet.clone(), self.clock, 11);
        let unfinished: Vec<RunSpec> = self
            .runs
            .iter()
            .filter(|run| !self.is_completed(run.id))
            .cloned()
            .collect();
        for run in unfinished {
            let decided: Vec<&DeviceId> = self
                .outcomes
                .get(&run.id)
                .map(|rows| rows.iter().map(|(d, _, _)| d).collect())
                .unwrap_or_default();
            let undecided = self.all_targets[&run.id]
                .iter()
                .filter(|id| !decided.contains(id))
                .cloned()
                .collect();
            let counts = self.stored.get(&run.id).copied().unwrap_or_default();
            let mut spec = RunSpec::resumed(run.id, run.trigger, run.force, counts, undecided);
            if let Some(stored) = self.rollouts.get(&run.id) {
                // As `app::resume_unfinished_runs` restores it.
                let rollout = crate::reconcile::rollout::Rollout::restore(
                    stored.clone(),
                    self.clock,
                    self.wall,
                )
                .unwrap();
                let waves = self.waves[&run.id]
                    .iter()
                    .filter(|(id, _)| spec.targets.contains(id))
                    .map(|(id, wave)| (id.clone(), *wave))
                    .collect();
                spec = spec.with_rollout(crate::reconcile::run::RunRollout {
                    start: crate::reconcile::run::RolloutStart::Restored(rollout),
                    waves,
                });
            }
            self.command(EngineCommand::StartRun(spec));
        }
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
        self.create_with(targets, force, None)
    }

    /// [`World::create`] as a staged rollout by `author`: the devices that
    /// need a push take the waves in id order, as the engine assigns them.
    fn create_rollout(
        &mut self,
        targets: Vec<DeviceId>,
        rollout: crate::reconcile::rollout::RolloutSpec,
        author: &str,
    ) -> Uuid {
        self.create_with(targets, false, Some((rollout, author.to_owned())))
    }

    fn create_with(
        &mut self,
        targets: Vec<DeviceId>,
        force: bool,
        rollout: Option<(crate::reconcile::rollout::RolloutSpec, String)>,
    ) -> Uuid {
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
        let created = counts(decided.len() as u64, 0, 0);
        self.stored.insert(run_id, created);
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
        let undecided: Vec<DeviceId> = targets
            .iter()
            .filter(|id| !decided.contains(id))
            .cloned()
            .collect();
        let mut spec = RunSpec::created(run_id, Trigger::Manual, force, undecided, decided);
        if let Some((rollout, author)) = rollout {
            let waves = crate::reconcile::rollout::assign_waves(&rollout, &spec.targets);
            self.waves.insert(run_id, waves.clone());
            spec = spec.with_rollout(crate::reconcile::run::RunRollout {
                start: crate::reconcile::run::RolloutStart::New {
                    spec: rollout,
                    author: Some(author),
                },
                waves,
            });
        }
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
        let spec = RunSpec::created(Uuid::now_v7(), trigger, force, targets, Vec::new());
        self.all_targets.insert(spec.id, spec.targets.clone());
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
            generation: generation.map(Generation),
            rejection: None,
            drift: None,
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
            generation: Some(Generation(version)),
            rejection: Some((Generation(generation), "no space left".into())),
            drift: None,
        };
        self.deliver(device, reported);
    }

    /// The operator sets desired `generation`, whose spec is version `version`.
    fn wants(&self, device: &DeviceId, generation: u64, version: u64) {
        self.wants_spec(device, generation, spec(version));
    }

    /// The operator sets desired `generation` to `spec` (the cache leaves
    /// out what the device owns, as it does for every desired change).
    fn wants_spec(&self, device: &DeviceId, generation: u64, spec: Value) {
        self.fleet.apply_committed([FleetChange::Desired(
            device.clone(),
            DesiredState::new(
                Generation(generation),
                SpecDigest::of(&spec),
                Arc::new(spec),
                None,
            ),
        )]);
    }

    /// `device` owns the paths `owned` from now on, as a declaration of
    /// owned fields leaves it (its reports hold none of them).
    fn owns(&self, device: &DeviceId, owned: &Arc<crate::reconcile::owned::OwnedFields>) {
        self.fleet.apply_committed([FleetChange::Owned {
            id: device.clone(),
            owned: Some(owned.clone()),
            reported_digest: None,
            retained_stale: false,
        }]);
    }

    /// An operator's exemption now covers `device` (`true`) or has ended.
    fn exempt(&mut self, device: &DeviceId, exempt: bool) {
        self.fleet
            .apply_committed([FleetChange::Exempt(device.clone(), exempt)]);
        if exempt {
            self.command(EngineCommand::ExemptionsStarted(vec![device.clone()]));
        } else {
            self.command(EngineCommand::ExemptionsEnded(vec![device.clone()]));
        }
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

    /// The tally of the run's committed outcome rows.
    fn counts(&self, run: Uuid) -> OutcomeCounts {
        tally(self.kinds(run).iter().map(|(_, kind)| kind))
    }

    /// The run's committed completion: the machine's counts.
    fn completion(&self, run: Uuid) -> Option<&CompletedRun> {
        self.completed.iter().find(|ended| ended.id == run)
    }

    fn status(&self, device: &DeviceId) -> DeviceStatus {
        self.fleet.get(device).unwrap().status
    }

    fn is_completed(&self, run: Uuid) -> bool {
        self.completion(run).is_some()
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
