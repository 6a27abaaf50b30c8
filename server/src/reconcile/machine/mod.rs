//! The engine's state machine: every attempt in flight (one [`Phase`] per
//! device), run progress, the push queue and its pacing, retries, debounce
//! windows and resync. Inputs and the time go in, [`Effect`]s come out: no
//! IO, no async, no clock reads, no database. It reads the fleet cache
//! through a read-only view plus its own not-yet-written changes; the
//! caller writes each [`Record`] and applies it to the cache after commit.
//!
//! It never judges a device itself: that is `decide` and `policy`.

mod effect;
mod ending;
mod flight;
mod fresh;
mod gaps;
pub mod record;
mod retained;
mod starting;
#[cfg(test)]
mod tests;
mod triggers;
mod waves;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Instant;

use idem_protocol::DeviceId;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::SeedableRng;
use uuid::Uuid;

use super::decide::{decide, Decision};
use super::outcome::{Outcome, SkipReason};
use super::pacer::PushPacer;
use super::policy::{self, gate, DeviceStatus};
use super::run::{RunProgress, RunSpec, Trigger};
pub use crate::reconcile::change::{DeviceChange, RememberedOutcome};
use crate::reconcile::device::{DesiredState, DeviceEntry, FleetRead};
use crate::tuning::{FLUSH_INTERVAL, FLUSH_SIZE, SCAN_INTERVAL, WRITE_AHEAD_CHUNK};
pub use effect::{
    AskReason, Effect, EngineCommand, EngineSettings, MachineStats, Now, PublishReason,
    RecheckTrigger, RolloutStats,
};
use flight::{converged_in_run, InFlight, Phase};
use gaps::Gaps;
pub use record::{AttemptRecord, OutcomeRecord, Record};
use waves::{FollowUp, RolloutHold, RolloutRun};
pub use waves::{RolloutAction, RolloutActionError};

/// Devices collected for one trigger until the debounce window closes.
#[derive(Debug)]
struct Debounced {
    closes_at: Instant,
    devices: BTreeSet<DeviceId>,
}

pub struct Machine {
    settings: EngineSettings,
    fleet: Arc<dyn FleetRead>,
    runs: HashMap<Uuid, RunProgress>,
    in_flight: HashMap<DeviceId, InFlight>,
    /// Targets of started runs not yet looked at (a large run starts in slices).
    starting: VecDeque<(Uuid, bool, DeviceId)>,
    /// Devices in [`Phase::Pushed`] (bounded by `max_in_flight`).
    pushed: HashSet<DeviceId>,
    /// The runs carried on from an earlier process, until they end: a
    /// target the earlier process pushed is awaited, not pushed again.
    resumed_runs: HashSet<Uuid>,
    push_queue: VecDeque<DeviceId>,
    pacer: PushPacer,
    debounced: HashMap<Trigger, Debounced>,
    next_scan: Instant,
    next_resync: Option<Instant>,
    /// Devices that came online and owe a report; a recheck in progress.
    gaps: Gaps,
    /// When the latest recheck started: a device that reported since then
    /// is not asked by it (its report carries everything it runs).
    recheck_since: Option<chrono::DateTime<chrono::Utc>>,
    record: Record,
    /// The device changes of records handed out and not yet reported
    /// written: neither in `record` nor (until the commit) in the cache, yet
    /// part of the device as the machine must see it.
    writing: BTreeMap<DeviceId, DeviceChange>,
    /// Manual runs still running, by id: whether forced, and every target,
    /// sorted (an identical re-check joins the run instead of starting one).
    manual: HashMap<Uuid, (bool, Vec<DeviceId>)>,
    last_write: Instant,
    rng: StdRng,
    /// Rollout runs in progress, by run id.
    rollouts: HashMap<Uuid, RolloutRun>,
    /// Rollouts that moved since the last record was handed out.
    rollouts_changed: BTreeSet<Uuid>,
    /// What rollout steps left to do once the current input is handled.
    rollout_work: Vec<(Uuid, FollowUp)>,
    /// Pushes of rollout waves, sent once the record that marks them
    /// pushed is handed out to be written first.
    write_ahead: Vec<Effect>,
    /// Records handed out to be written, and of those reported written
    /// (in order: the caller writes one at a time).
    records_handed_out: u64,
    records_written: u64,
    /// A rollout's mark of early pushes grew: the next record goes at once,
    /// so that the pushes it covers need no write of their own.
    marks_to_write: bool,
}

impl Machine {
    /// `seed` feeds the retry jitter.
    pub fn new(
        settings: EngineSettings,
        fleet: Arc<dyn FleetRead>,
        now: Instant,
        seed: u64,
    ) -> Self {
        let pacer = PushPacer::new(settings.push_rate, now);
        let next_resync = settings.resync_interval.map(|i| now + i);
        let gaps = Gaps::new(settings.missing_report_after, settings.recheck_rate);
        Self {
            settings,
            fleet,
            runs: HashMap::new(),
            in_flight: HashMap::new(),
            starting: VecDeque::new(),
            pushed: HashSet::new(),
            resumed_runs: HashSet::new(),
            push_queue: VecDeque::new(),
            pacer,
            debounced: HashMap::new(),
            next_scan: now + SCAN_INTERVAL,
            next_resync,
            gaps,
            recheck_since: None,
            record: Record::default(),
            writing: BTreeMap::new(),
            manual: HashMap::new(),
            last_write: now,
            rng: StdRng::seed_from_u64(seed),
            rollouts: HashMap::new(),
            rollouts_changed: BTreeSet::new(),
            rollout_work: Vec::new(),
            write_ahead: Vec::new(),
            records_handed_out: 0,
            records_written: 0,
            marks_to_write: false,
        }
    }

    /// Handles one command.
    pub fn on_command(&mut self, command: EngineCommand, now: Now) -> Vec<Effect> {
        let mut out = Vec::new();
        match command {
            EngineCommand::StartRun(spec) => self.start_run(spec, now, &mut out),
            EngineCommand::RunNotStarted { trigger, targets } => {
                for id in targets {
                    self.debounce(trigger, id, now.at);
                }
            }
            EngineCommand::ReportsApplied(ids) => self.reports_applied(ids, now, &mut out),
            EngineCommand::Connectivity(changes) => {
                for (id, online) in changes {
                    if online {
                        self.gaps.came_online(&id, now.at);
                    } else {
                        self.gaps.settled(&id);
                    }
                    self.connectivity_changed(&id, online, now.at);
                }
            }
            EngineCommand::ExemptionsStarted(ids) => self.exemptions_started(ids, now, &mut out),
            EngineCommand::ExemptionsEnded(ids) => {
                for id in &ids {
                    if !self.in_flight.contains_key(id) {
                        self.refresh_retained(id, &mut out);
                    }
                }
                self.recheck_drift(ids, now.at);
            }
            EngineCommand::OwnedChanged { changed, republish } => {
                for id in republish {
                    self.republish_retained(&id, &mut out);
                }
                self.owned_changed(changed, now.at);
            }
            EngineCommand::Recheck => {
                self.recheck_since = Some(now.wall);
                self.gaps.recheck(self.fleet.ids_not_offline());
            }
            EngineCommand::ReconcileAll(trigger) => self.reconcile_all(trigger, &mut out),
            EngineCommand::DesiredChanged(ids) => {
                for id in ids {
                    if let Some(Phase::Held) = self.in_flight.get(&id).map(|f| &f.phase) {
                        // A rollout's device waiting for its wave: the
                        // newer change takes its remaining waves over.
                        let entry = self.entry(&id).unwrap_or_default();
                        self.supersede_older_attempt(&id, &entry, now, &mut out);
                    }
                    if self.in_flight.contains_key(&id) {
                        // An attempt for the old generation ends superseded.
                        self.advance(&id, false, now, &mut out);
                    }
                    if !self.in_flight.contains_key(&id) {
                        self.refresh_retained(&id, &mut out);
                    }
                }
            }
            EngineCommand::DevicesRemoved(ids) => {
                for id in ids {
                    self.push_queue.retain(|queued| *queued != id);
                    for debounced in self.debounced.values_mut() {
                        debounced.devices.remove(&id);
                    }
                    let outcome = Outcome::Skipped(SkipReason::Deleted);
                    self.finish(&id, outcome, &DeviceEntry::default(), None, now, &mut out);
                }
            }
            EngineCommand::SyncRetained => {
                for id in self.fleet.ids_with_retained_behind() {
                    if !self.in_flight.contains_key(&id) {
                        self.refresh_retained(&id, &mut out);
                    }
                }
            }
        }
        self.after_input(now, &mut out);
        out
    }

    /// Time passed: deadlines, retries, debounce windows, resync, the push
    /// queue and the write interval.
    pub fn on_tick(&mut self, now: Now) -> Vec<Effect> {
        let mut out = Vec::new();
        if now.at >= self.next_scan {
            self.scan(now, &mut out);
            self.ask_for_missing(now.at, &mut out);
            self.next_scan = now.at + SCAN_INTERVAL;
        }
        if let (Some(at), Some(interval)) = (self.next_resync, self.settings.resync_interval) {
            if now.at >= at {
                self.resync(now, &mut out);
                self.next_resync = Some(now.at + interval);
            }
        }
        self.close_debounced(now.at, &mut out);
        self.tick_rollouts(now);
        self.after_input(now, &mut out);
        out
    }

    /// The write of the last [`Effect::Record`] committed (or was given up)
    /// at `now`; the next write waits a flush interval from here.
    pub fn record_written(&mut self, now: Instant) {
        self.last_write = now;
        self.writing.clear();
        self.records_written += 1;
    }

    /// Everything not yet written, whatever its size or age (shutdown).
    pub fn take_record(&mut self, now: Now) -> Option<Record> {
        self.store_changed_rollouts(now);
        (!self.record.is_empty()).then(|| self.hand_out_record(now))
    }

    /// The record, handed out to be written, with the rollouts that moved;
    /// its device changes stay in the machine's view until
    /// [`Machine::record_written`].
    fn hand_out_record(&mut self, now: Now) -> Record {
        self.store_changed_rollouts(now);
        self.records_handed_out += 1;
        let record = std::mem::take(&mut self.record);
        for (id, change) in &record.devices {
            self.writing
                .entry(id.clone())
                .or_default()
                .merge(change.clone());
        }
        record
    }

    /// The device as the machine sees it (the cache, plus the changes
    /// handed out to be written and those not yet handed out): the one
    /// view every judgement of a device is made on, also the creation of a
    /// run ([`crate::reconcile::policy::converged_targets`]).
    pub fn view(&self, id: &DeviceId) -> Option<DeviceEntry> {
        self.entry(id)
    }

    /// When the machine next has something to do without new input.
    pub fn next_wake(&self) -> Instant {
        let mut wake = self.next_scan;
        if let Some(at) = self.next_resync {
            wake = wake.min(at);
        }
        if !self.push_queue.is_empty() && self.pushed.len() < self.settings.max_in_flight {
            wake = wake.min(self.pacer.next_slot());
        }
        for d in self.debounced.values() {
            wake = wake.min(d.closes_at);
        }
        if !self.record.is_empty() {
            wake = wake.min(self.last_write + FLUSH_INTERVAL);
        }
        if !self.starting.is_empty() {
            wake = wake.min(self.last_write);
        }
        for run in self.rollouts.values() {
            if let Some(at) = run.rollout.next_wake() {
                wake = wake.min(at);
            }
        }
        wake
    }

    pub fn stats(&self) -> MachineStats {
        MachineStats {
            queued_pushes: self.push_queue.len(),
            pushes_in_flight: self.pushed.len(),
            attempts_in_flight: self.in_flight.len(),
            rollouts: self.rollout_stats(),
        }
    }

    /// Work every input ends with: continue starting runs, drain the push
    /// queue, and hand over the record when it is due.
    fn after_input(&mut self, now: Now, out: &mut Vec<Effect>) {
        self.settle_rollouts(now, out);
        self.continue_starting(now, out);
        self.settle_rollouts(now, out);
        self.mark_early_pushes();
        self.drain_push_queue(now, out);
        if self.hand_over_sent_waves(now) {
            self.settle_rollouts(now, out);
            self.mark_early_pushes();
            self.drain_push_queue(now, out);
        }
        let moved = !self.rollouts_changed.is_empty();
        let due = self.record.outcomes.len() >= FLUSH_SIZE
            || ((!self.record.is_empty() || moved) && now.at >= self.last_write + FLUSH_INTERVAL);
        if due || self.marks_to_write || !self.write_ahead.is_empty() {
            let record = self.hand_out_record(now);
            out.push(Effect::Record(record));
        }
        out.append(&mut self.write_ahead);
    }

    /// The device as the machine must see it: the cache plus the changes
    /// of the record not yet written.
    fn entry(&self, id: &DeviceId) -> Option<DeviceEntry> {
        let mut entry = self.fleet.get(id)?;
        if let Some(change) = self.writing.get(id) {
            entry.apply(change);
        }
        if let Some(change) = self.record.devices.get(id) {
            entry.apply(change);
        }
        Some(entry)
    }

    /// The manual run still running over exactly `targets` (in any order)
    /// with the same `force`, if there is one.
    pub fn identical_manual_run(&self, targets: &[DeviceId], force: bool) -> Option<Uuid> {
        let mut sorted = targets.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        self.manual
            .iter()
            .find(|(run_id, (forced, run_targets))| {
                *forced == force && *run_targets == sorted && self.runs.contains_key(run_id)
            })
            .map(|(run_id, _)| *run_id)
    }

    fn reports_applied(&mut self, ids: Vec<DeviceId>, now: Now, out: &mut Vec<Effect>) {
        for id in ids {
            self.gaps.settled(&id);
            if self.in_flight.contains_key(&id) {
                self.advance(&id, false, now, out);
            } else if !self.converged_by_report(&id) {
                self.check_drift(&id, now.at);
            }
        }
    }

    /// A device never reconciled whose report carries its desired digest
    /// is `converged` without a run ([`policy::converged_by_report`]), so
    /// the fleet's first run has no row to rewrite for it.
    fn converged_by_report(&mut self, id: &DeviceId) -> bool {
        let Some(entry) = self.entry(id) else {
            return false;
        };
        let Some(reported) = &entry.reported else {
            return false;
        };
        let converged = policy::converged_by_report(
            entry.status,
            entry.desired_for_decision().as_ref(),
            &reported.digest,
        );
        if converged {
            self.record.device(id).status = Some(DeviceStatus::Converged);
        }
        converged
    }

    /// Decides for one in-flight device and carries the decision out.
    /// `permit`: a push slot was already taken for this device.
    fn advance(&mut self, id: &DeviceId, permit: bool, now: Now, out: &mut Vec<Effect>) {
        let entry = self.entry(id).unwrap_or_default();
        let Some(desired) = entry.desired_for_decision() else {
            let outcome = Outcome::Skipped(SkipReason::NoDesiredSpec);
            self.conclude(id, outcome, &entry, now, out);
            return;
        };
        let Some(flight) = self.in_flight.get(id) else {
            return;
        };
        match flight.phase {
            Phase::Queued if !permit => return,
            Phase::RetryAt(_) => return,
            Phase::Fresh
            | Phase::Queued
            | Phase::AwaitingReport { .. }
            | Phase::Pushed { .. }
            | Phase::MaybePushed { .. }
            | Phase::Held => {}
        }
        match decide(&desired, &entry.actual(), &flight.attempt(now.at)) {
            Decision::Finish(outcome) => {
                let outcome = converged_in_run(outcome, flight.differed);
                self.conclude(id, outcome, &entry, now, out)
            }
            Decision::Push => {
                match self.rollout_hold(id) {
                    RolloutHold::Free => {}
                    RolloutHold::UntilWave => {
                        self.set_phase(id, Phase::Held);
                        return;
                    }
                    RolloutHold::Aborted => {
                        let outcome = Outcome::Skipped(SkipReason::Aborted);
                        self.finish(id, outcome, &entry, None, now, out);
                        return;
                    }
                }
                let chunk_full = self.write_ahead.len() >= WRITE_AHEAD_CHUNK
                    && self.in_rollout(id)
                    && !self.marked_early(id);
                let may_push = !chunk_full
                    && (permit
                        || (self.push_queue.is_empty()
                            && self.pushed.len() < self.settings.max_in_flight
                            && self.pacer.try_take(now.at)));
                if !may_push {
                    self.set_phase(id, Phase::Queued);
                    self.push_queue.push_back(id.clone());
                    return;
                }
                self.push(id, &entry, now.at, out);
            }
            Decision::AskForReport => {
                let deadline = now.at + self.settings.push_timeout;
                self.set_phase(id, Phase::AwaitingReport { deadline });
                out.push(Effect::AskForReport {
                    device: id.clone(),
                    reason: AskReason::Decide,
                });
            }
            Decision::Wait => {}
        }
    }

    fn set_phase(&mut self, id: &DeviceId, phase: Phase) {
        if let Some(flight) = self.in_flight.get_mut(id) {
            flight.phase = phase;
        }
    }

    fn push(&mut self, id: &DeviceId, entry: &DeviceEntry, now: Instant, out: &mut Vec<Effect>) {
        let Some(desired) = &entry.desired else {
            return;
        };
        let Some(flight) = self.in_flight.get_mut(id) else {
            return;
        };
        flight.phase = Phase::Pushed {
            generation: desired.generation,
            seq_at_push: entry.reported_seq(),
            deadline: now + self.settings.push_timeout,
        };
        flight.generation = Some(desired.generation);
        if !self.rollouts.is_empty() {
            let runs = flight.runs.clone();
            self.sent_for(&runs, id);
        }
        self.pushed.insert(id.clone());
        let change = self.record.device(id);
        change.status = Some(DeviceStatus::Provisioning);
        change.retained = Some(desired.generation);
        let publish = Effect::Publish {
            device: id.clone(),
            generation: desired.generation,
            spec: entry.spec_to_publish(desired),
            reason: PublishReason::Attempt,
        };
        if self.in_rollout(id) && !self.marked_early(id) {
            // Written before it is sent: a restart knows it went out.
            self.write_ahead.push(publish);
        } else {
            out.push(publish);
        }
    }

    /// Pushes queued devices as pacing and the in-flight cap allow.
    fn drain_push_queue(&mut self, now: Now, out: &mut Vec<Effect>) {
        while !self.push_queue.is_empty() && self.pushed.len() < self.settings.max_in_flight {
            // The next chunk goes once this one is written (the machine
            // wakes at once while the queue can drain).
            if self.write_ahead.len() >= WRITE_AHEAD_CHUNK {
                break;
            }
            if !self.pacer.try_take(now.at) {
                break;
            }
            let Some(id) = self.push_queue.pop_front() else {
                break;
            };
            if let Some(Phase::Queued) = self.in_flight.get(&id).map(|f| &f.phase) {
                self.advance(&id, true, now, out);
            }
        }
    }

    /// Expires deadlines and starts due retries.
    /// Asks the devices that came online and stayed silent, and the next
    /// paced slice of a recheck; a device an attempt already asks is left
    /// to it.
    fn ask_for_missing(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let silent = self
            .gaps
            .silent(now)
            .into_iter()
            .map(|id| (id, AskReason::Missing));
        let rechecked = self
            .gaps
            .paced_recheck(now)
            .into_iter()
            .map(|id| (id, AskReason::Recheck));
        for (device, reason) in silent.chain(rechecked).collect::<Vec<_>>() {
            let Some(entry) = self.fleet.get(&device) else {
                continue;
            };
            let wanted = match reason {
                AskReason::Missing => entry.online == Some(true),
                AskReason::Decide | AskReason::Stale => entry.online != Some(false),
                AskReason::Recheck => {
                    let heard_since = match (entry.reported_at, self.recheck_since) {
                        (Some(at), Some(since)) => at >= since,
                        (None, _) | (_, None) => false,
                    };
                    entry.online != Some(false) && !heard_since
                }
            };
            if wanted && !self.in_flight.contains_key(&device) {
                out.push(Effect::AskForReport { device, reason });
            }
        }
    }

    fn scan(&mut self, now: Now, out: &mut Vec<Effect>) {
        let mut due: Vec<DeviceId> = Vec::new();
        for (id, flight) in &mut self.in_flight {
            if flight.is_due(now.at) {
                match flight.phase {
                    Phase::RetryAt(_) => flight.phase = Phase::Fresh,
                    // Not answered: it was never sent (nothing failed).
                    Phase::MaybePushed { .. } => {
                        flight.phase = Phase::Fresh;
                        self.pushed.remove(id);
                    }
                    Phase::Fresh
                    | Phase::Queued
                    | Phase::AwaitingReport { .. }
                    | Phase::Pushed { .. }
                    | Phase::Held => {}
                }
                due.push(id.clone());
            }
        }
        // The same order on every run, whatever the map's.
        due.sort_unstable();
        for id in due {
            self.advance(&id, false, now, out);
        }
    }
}
