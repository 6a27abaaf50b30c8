//! Rollouts in the machine: a rollout run's devices held until their wave
//! may push, each device's outcome counted in its wave, a rollout's steps
//! (waves started and completed, pauses, resumes, approvals, aborts) as
//! events and as the stored state its run row keeps, and operators'
//! actions on a rollout.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use idem_protocol::api::WaveState;
use idem_protocol::event::{EventType, RolloutApprovedData, RolloutWaveData};
use idem_protocol::DeviceId;
use uuid::Uuid;

use super::{Effect, Machine, Now, Phase, RolloutStats};
use crate::reconcile::device::DeviceEntry;
use crate::reconcile::event_draft::EventDraft;
use crate::reconcile::outcome::{Outcome, OutcomeKind, SkipReason};
use crate::reconcile::policy::DeviceStatus;
use crate::reconcile::rollout::{
    paused_view, wave_view, EarlyPushes, NotNow, PauseReason, Rollout, RolloutState, StoredPause,
    StoredRollout, Transition,
};
use crate::reconcile::run::{RolloutStart, RunRollout};

/// A rollout run the machine carries.
#[derive(Debug)]
pub(super) struct RolloutRun {
    pub rollout: Rollout,
    /// The wave of each of the run's devices still without its outcome.
    pub waves: HashMap<DeviceId, usize>,
    /// Carried on from an earlier process.
    pub restored: bool,
    /// The record that carries the rollout's current mark of early pushes
    /// ([`Rollout::early`]), once handed out: the marked pushes may skip
    /// their own write once it is written.
    pub early_in: Option<u64>,
    /// The mark before the current one, written: until the current one is,
    /// the pushes this one covers still skip their own write (a mark only
    /// grows).
    pub early_written: Option<EarlyPushes>,
    /// Devices of `unsent` the current mark covers: the mark's lead over
    /// the pushes.
    pub early_ahead: usize,
    /// The mark is to grow: a wave was let go, or the pushes caught up with
    /// it.
    pub mark_due: bool,
    /// The devices of `waves` not pushed yet in this run (a retry is not a
    /// first push), and how many of them each wave has: a wave with none
    /// left may hand over to the next ([`Rollout::hand_over`]).
    pub unsent: HashSet<DeviceId>,
    pub unsent_in: Vec<u64>,
}

impl RolloutRun {
    /// `id` was pushed (or ended): it no longer holds its wave back. When
    /// the pushes come within a chunk of the mark, it is to grow.
    fn sent(&mut self, id: &DeviceId) {
        if !self.unsent.remove(id) {
            return;
        }
        let Some(wave) = self.waves.get(id).copied() else {
            return;
        };
        if let Some(count) = self.unsent_in.get_mut(wave) {
            *count = count.saturating_sub(1);
        }
        let covered = self
            .rollout
            .early()
            .is_some_and(|early| early.covers(wave, id.as_str()));
        if covered {
            self.early_ahead = self.early_ahead.saturating_sub(1);
            if self.early_ahead + 1 == super::WRITE_AHEAD_CHUNK {
                self.mark_due = true;
            }
        }
    }

    /// The mark of early pushes known to be written, if any.
    fn written_mark(&self, records_written: u64) -> Option<&EarlyPushes> {
        match self.early_in {
            Some(record) if record <= records_written => self.rollout.early(),
            Some(_) | None => self.early_written.as_ref(),
        }
    }

    /// Replaces the mark (`None`: unmarks, at once), to be written with
    /// the next record.
    fn remark(&mut self, mark: Option<EarlyPushes>, records_written: u64) {
        self.early_written = match &mark {
            Some(_) => self.written_mark(records_written).cloned(),
            None => None,
        };
        self.rollout.mark_early(mark);
        self.early_in = None;
    }

    /// The next mark: the current one moved on over the devices not yet
    /// pushed of waves up to `last_wave`, in the order they go, until it
    /// leads the pushes by two chunks; with the number of devices it adds.
    /// `None` when it would add none.
    fn grown_mark(&self, last_wave: usize) -> Option<(EarlyPushes, usize)> {
        let wanted = (2 * super::WRITE_AHEAD_CHUNK).checked_sub(self.early_ahead)?;
        let current = self.rollout.early();
        let mut beyond: Vec<(usize, &DeviceId)> = self
            .unsent
            .iter()
            .filter_map(|id| {
                let wave = *self.waves.get(id)?;
                let covered = current.is_some_and(|early| early.covers(wave, id.as_str()));
                (wave <= last_wave && !covered).then_some((wave, id))
            })
            .collect();
        let added = wanted.min(beyond.len());
        let index = added.checked_sub(1)?;
        let (_, (wave, last), _) = beyond.select_nth_unstable(index);
        let mark = EarlyPushes {
            wave: *wave,
            last: last.as_str().to_owned(),
        };
        Some((mark, added))
    }
}

/// What a rollout's step leaves the machine to do once the input that
/// caused it is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FollowUp {
    /// Devices held for a wave that may push now go on.
    Release,
    /// Devices not yet pushed end `skipped` (`aborted`).
    EndUnpushed,
}

/// Whether a device may be pushed for the rollouts its attempt serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RolloutHold {
    Free,
    /// Its wave has not started, or the rollout is paused.
    UntilWave,
    /// The rollout was aborted: it is pushed no more.
    Aborted,
}

/// An operator's action on a rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RolloutAction {
    Resume,
    Abort,
    /// By this token (which must not be the rollout's author).
    Approve {
        by: String,
    },
}

/// Why an action on a rollout was refused.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum RolloutActionError {
    /// This process carries no unfinished rollout with this run id.
    #[error("no rollout of this run is in progress")]
    NotInProgress,
    /// This instance does not hold the engine lease: another carries every
    /// rollout.
    #[error("this instance does not carry reconciliation now")]
    CarriedElsewhere,
    #[error(transparent)]
    NotNow(#[from] NotNow),
}

impl Machine {
    /// The unfinished rollouts, summed (a few per fleet: read per input).
    pub(super) fn rollout_stats(&self) -> RolloutStats {
        let mut stats = RolloutStats::default();
        for run in self.rollouts.values() {
            let rollout = &run.rollout;
            let count = match rollout.state() {
                RolloutState::Running { .. } => &mut stats.running,
                RolloutState::Paused { reason, .. } => match reason {
                    PauseReason::Gate(_) => &mut stats.paused_gate,
                    PauseReason::Manual => &mut stats.paused_manual,
                    PauseReason::Approval => &mut stats.paused_approval,
                    PauseReason::Timed { .. } => &mut stats.paused_timed,
                },
                RolloutState::Completed | RolloutState::Aborted => continue,
            };
            *count += 1;
            let current = rollout.current_wave();
            for (wave, counts) in rollout.counts().iter().enumerate() {
                // A wave handed over to the next one is open until its
                // last answers are in.
                if wave == current || (wave < current && !counts.is_done()) {
                    stats.wave_devices += counts.size;
                    stats.wave_decided += counts.decided().min(counts.size);
                } else if wave > current {
                    stats.waiting += counts.size.saturating_sub(counts.decided());
                }
            }
        }
        stats
    }

    /// Starts carrying run `run_id`'s rollout (new: its first wave starts).
    pub(super) fn start_rollout(
        &mut self,
        run_id: Uuid,
        start: RunRollout,
        needing: u64,
        now: Now,
    ) {
        let (rollout, steps, restored) = match start.start {
            RolloutStart::New { spec, author } => {
                let (rollout, steps) = Rollout::start(spec, needing, author);
                (rollout, steps, false)
            }
            RolloutStart::Restored(rollout) => (rollout, Vec::new(), true),
        };
        let mut unsent_in = vec![0; rollout.counts().len()];
        for wave in start.waves.values() {
            if let Some(count) = unsent_in.get_mut(*wave) {
                *count += 1;
            }
        }
        let unsent: HashSet<DeviceId> = start.waves.keys().cloned().collect();
        // A restored mark was written by the earlier process.
        let early_written = rollout.early().cloned();
        let early_ahead = early_written.as_ref().map_or(0, |early| {
            start
                .waves
                .iter()
                .filter(|(id, wave)| early.covers(**wave, id.as_str()))
                .count()
        });
        self.rollouts.insert(
            run_id,
            RolloutRun {
                rollout,
                waves: start.waves,
                restored,
                early_in: None,
                early_written,
                early_ahead,
                mark_due: true,
                unsent,
                unsent_in,
            },
        );
        self.rollout_stepped(run_id, steps, now);
        self.rollouts_changed.insert(run_id);
    }

    /// Whether `id`'s attempt may push now, for every rollout it serves.
    pub(super) fn rollout_hold(&self, id: &DeviceId) -> RolloutHold {
        let Some(flight) = self.in_flight.get(id) else {
            return RolloutHold::Free;
        };
        let mut hold = RolloutHold::Free;
        for run_id in &flight.runs {
            let Some(run) = self.rollouts.get(run_id) else {
                continue;
            };
            let Some(wave) = run.waves.get(id) else {
                continue;
            };
            match run.rollout.state() {
                RolloutState::Aborted => return RolloutHold::Aborted,
                RolloutState::Running { .. }
                | RolloutState::Paused { .. }
                | RolloutState::Completed => {
                    if !run.rollout.may_push(*wave) {
                        hold = RolloutHold::UntilWave;
                    }
                }
            }
        }
        hold
    }

    /// A target of a run carried on from an earlier process (a restart or
    /// a takeover) that the earlier process pushed its current generation:
    /// it waits for that push's answer, as if this process had sent it at
    /// `now`, and is not pushed again. A rollout's push is written before
    /// it is sent, so its answer is awaited as a push's (unanswered, it
    /// fails); one marked as pushed early ([`EarlyPushes`]), and a plain
    /// run's push (written after it was sent, so the record says it went
    /// out), may be what it answers: awaited as long, it starts afresh
    /// without one, with no failure counted. Either way a matching answer
    /// counts `provisioned`, even when it came in before this process.
    pub(super) fn pushed_before_restart(
        &self,
        run_id: Uuid,
        id: &DeviceId,
        entry: &DeviceEntry,
        now: Instant,
    ) -> Option<Phase> {
        let desired = entry.desired.as_ref()?;
        let deadline = now + self.settings.push_timeout;
        let pushed = entry.status == DeviceStatus::Provisioning
            && entry.retained_generation == Some(desired.generation);
        let maybe = Phase::MaybePushed {
            generation: desired.generation,
            deadline,
        };
        let Some(run) = self.rollouts.get(&run_id) else {
            return (pushed && self.resumed_runs.contains(&run_id)).then_some(maybe);
        };
        let wave = run.waves.get(id).filter(|_| run.restored)?;
        if pushed {
            return Some(Phase::Pushed {
                generation: desired.generation,
                // Any report since then may be its answer.
                seq_at_push: None,
                deadline,
            });
        }
        let marked = run
            .rollout
            .early()
            .is_some_and(|early| early.covers(*wave, id.as_str()));
        marked.then_some(maybe)
    }

    /// Whether `id` may be pushed without a write of its own: every
    /// rollout it waits on marked it as pushed ahead of its wave, in a
    /// record already written.
    pub(super) fn marked_early(&self, id: &DeviceId) -> bool {
        let Some(flight) = self.in_flight.get(id) else {
            return false;
        };
        let mut marked = false;
        for run_id in &flight.runs {
            let Some(run) = self.rollouts.get(run_id) else {
                continue;
            };
            let Some(wave) = run.waves.get(id) else {
                continue;
            };
            let covered = run
                .written_mark(self.records_written)
                .is_some_and(|e| e.covers(*wave, id.as_str()));
            if !covered {
                return false;
            }
            marked = true;
        }
        marked
    }

    /// Grows, for each rollout whose mark is due, the mark of early
    /// pushes ([`EarlyPushes`]) over its devices not yet pushed, in the
    /// order they go: those of the running wave, and those of the next one
    /// when nothing can stop it from starting once this one is done. The
    /// mark is written with the next record (handed out at once); from
    /// then on, the pushes it covers leave without a write of their own,
    /// and a restart awaits their answers instead of pushing them again.
    /// It leads the pushes by one to two chunks, so a restart waits a push
    /// timeout for at most that many devices never sent.
    pub(super) fn mark_early_pushes(&mut self) {
        let Self {
            rollouts,
            rollouts_changed,
            records_written,
            marks_to_write,
            ..
        } = self;
        for (run_id, run) in rollouts.iter_mut() {
            if !std::mem::take(&mut run.mark_due) {
                continue;
            }
            let last_wave = match run.rollout.state() {
                RolloutState::Running { wave } if run.rollout.follows_at_once(wave) => wave + 1,
                RolloutState::Running { wave } => wave,
                // Paused: nothing is pushed, the mark stays as written.
                RolloutState::Paused { .. } | RolloutState::Completed | RolloutState::Aborted => {
                    continue
                }
            };
            if let Some((mark, added)) = run.grown_mark(last_wave) {
                run.remark(Some(mark), *records_written);
                run.early_ahead += added;
                rollouts_changed.insert(*run_id);
                *marks_to_write = true;
            }
        }
    }

    /// Whether `id` waits on an unfinished rollout: nothing is published to
    /// it outside its wave's push, not even a retained refresh (a device
    /// applies its retained message).
    pub(super) fn in_rollout(&self, id: &DeviceId) -> bool {
        self.rollouts.values().any(|run| run.waves.contains_key(id))
    }

    /// `id` ended `kind` in run `run_id`: counted in its wave, if the run is
    /// a rollout.
    pub(super) fn count_in_wave(
        &mut self,
        run_id: Uuid,
        id: &DeviceId,
        kind: OutcomeKind,
        now: Now,
    ) {
        let Some(run) = self.rollouts.get_mut(&run_id) else {
            return;
        };
        run.sent(id);
        let Some(wave) = run.waves.remove(id) else {
            return;
        };
        let steps = run.rollout.record(wave, kind, now.at);
        self.rollout_stepped(run_id, steps, now);
        self.rollouts_changed.insert(run_id);
    }

    /// `id` was pushed for every rollout run its attempt serves (or `run_id`
    /// joined an attempt already pushed): none of their waves waits for it
    /// to be sent any more.
    pub(super) fn sent_for(&mut self, runs: &[Uuid], id: &DeviceId) {
        for run_id in runs {
            if let Some(run) = self.rollouts.get_mut(run_id) {
                run.sent(id);
            }
        }
    }

    /// Hands each running wave that has nothing left to send over to the
    /// next wave, when no answer of it could hold that one back
    /// ([`Rollout::hands_over`]): the pipeline of pushes never drains at
    /// such a wave's end. True when a wave started.
    pub(super) fn hand_over_sent_waves(&mut self, now: Now) -> bool {
        let mut due: Vec<(Uuid, usize)> = self
            .rollouts
            .iter()
            .filter_map(|(run_id, run)| match run.rollout.state() {
                RolloutState::Running { wave }
                    if run.unsent_in.get(wave) == Some(&0) && run.rollout.hands_over(wave) =>
                {
                    Some((*run_id, wave))
                }
                RolloutState::Running { .. }
                | RolloutState::Paused { .. }
                | RolloutState::Completed
                | RolloutState::Aborted => None,
            })
            .collect();
        due.sort_unstable();
        let mut started = false;
        for (run_id, wave) in due {
            let Some(run) = self.rollouts.get_mut(&run_id) else {
                continue;
            };
            let steps = run.rollout.hand_over(wave, now.at);
            if steps.is_empty() {
                continue;
            }
            started = true;
            self.rollout_stepped(run_id, steps, now);
            self.rollouts_changed.insert(run_id);
        }
        started
    }

    /// Time passed: timed pauses that are over start their next wave.
    pub(super) fn tick_rollouts(&mut self, now: Now) {
        let mut due: Vec<Uuid> = self
            .rollouts
            .iter()
            .filter(|(_, run)| run.rollout.next_wake().is_some_and(|at| at <= now.at))
            .map(|(id, _)| *id)
            .collect();
        due.sort_unstable();
        for run_id in due {
            if let Some(run) = self.rollouts.get_mut(&run_id) {
                let steps = run.rollout.tick(now.at);
                self.rollout_stepped(run_id, steps, now);
                self.rollouts_changed.insert(run_id);
            }
        }
    }

    /// An operator's action on run `run_id`'s rollout; what follows it is
    /// handed out to be written at once. Returns the rollout as it stands.
    pub fn act_on_rollout(
        &mut self,
        run_id: Uuid,
        action: RolloutAction,
        now: Now,
    ) -> Result<(Vec<Effect>, StoredRollout), RolloutActionError> {
        let run = self
            .rollouts
            .get_mut(&run_id)
            .ok_or(RolloutActionError::NotInProgress)?;
        let steps = match action {
            RolloutAction::Resume => run.rollout.resume(now.at)?,
            RolloutAction::Abort => run.rollout.abort()?,
            RolloutAction::Approve { by } => run.rollout.approve(&by, now.at, now.wall)?,
        };
        let stored = run.rollout.stored(now.at, now.wall);
        self.rollout_stepped(run_id, steps, now);
        self.rollouts_changed.insert(run_id);
        let mut out = Vec::new();
        self.after_input(now, &mut out);
        if !self.record.is_empty() {
            let record = self.hand_out_record(now);
            out.push(Effect::Record(record));
        }
        // After an abort the run may have ended with this very action.
        let stored = self
            .rollouts
            .get(&run_id)
            .map(|run| run.rollout.stored(now.at, now.wall))
            .unwrap_or(stored);
        Ok((out, stored))
    }

    /// The rollouts that moved since the last write, as stored, into the
    /// record being handed out.
    pub(super) fn store_changed_rollouts(&mut self, now: Now) {
        // The number of the record these go into.
        let record = self.records_handed_out + 1;
        self.marks_to_write = false;
        for run_id in std::mem::take(&mut self.rollouts_changed) {
            if let Some(run) = self.rollouts.get_mut(&run_id) {
                let stored = run.rollout.stored(now.at, now.wall);
                if stored.early.is_some() && run.early_in.is_none() {
                    run.early_in = Some(record);
                }
                self.record.rollouts.insert(run_id, stored);
            }
        }
    }

    /// Run `run_id` ended: its rollout's last state goes with the record.
    pub(super) fn rollout_ended(&mut self, run_id: Uuid, now: Now) {
        if let Some(run) = self.rollouts.remove(&run_id) {
            self.rollouts_changed.remove(&run_id);
            let stored = run.rollout.stored(now.at, now.wall);
            self.record.rollouts.insert(run_id, stored);
        }
    }

    /// A rollout stepped: each step's event now, its follow-up once the
    /// input is handled.
    fn rollout_stepped(&mut self, run_id: Uuid, steps: Vec<Transition>, now: Now) {
        let Some(run) = self.rollouts.get(&run_id) else {
            return;
        };
        let size = |wave: usize| run.rollout.counts().get(wave).map_or(0, |c| c.size);
        for step in steps {
            let wave_data = |wave: usize| RolloutWaveData {
                wave: wave as u32,
                size: size(wave),
            };
            let (event_type, data, follow_up) = match step {
                Transition::WaveStarted { wave } => (
                    EventType::RolloutWaveStarted,
                    serde_json::to_value(wave_data(wave)),
                    Some(FollowUp::Release),
                ),
                Transition::WaveCompleted { wave, counts } => (
                    EventType::RolloutWaveCompleted,
                    serde_json::to_value(wave_view(wave, &counts, WaveState::Completed)),
                    None,
                ),
                Transition::Paused { wave, reason } => (
                    EventType::RolloutPaused,
                    serde_json::to_value(paused_view(
                        wave,
                        &StoredPause::of(reason, now.at, now.wall),
                    )),
                    None,
                ),
                Transition::Resumed { wave } => (
                    EventType::RolloutResumed,
                    serde_json::to_value(wave_data(wave)),
                    Some(FollowUp::Release),
                ),
                Transition::Approved { wave } => {
                    let by = run.rollout.approvals().last().map(|a| a.by.clone());
                    let data = RolloutApprovedData {
                        wave: wave as u32,
                        by: by.unwrap_or_default(),
                    };
                    (
                        EventType::RolloutApproved,
                        serde_json::to_value(data),
                        Some(FollowUp::Release),
                    )
                }
                Transition::Aborted => (
                    EventType::RolloutAborted,
                    serde_json::to_value(wave_data(run.rollout.current_wave())),
                    Some(FollowUp::EndUnpushed),
                ),
                // The run's own `run.completed` says it.
                Transition::Completed => continue,
            };
            // Invariant: the data are plain derived-`Serialize` structs,
            // which `serde_json::to_value` never refuses.
            let data = data.unwrap_or_else(|e| unreachable!("rollout event data is JSON: {e}"));
            self.record
                .drafts
                .push(EventDraft::rollout_step(event_type, run_id, &data));
            if let Some(follow_up) = follow_up {
                self.rollout_work.push((run_id, follow_up));
            }
        }
    }

    /// Carries out the follow-ups of rollout steps: held devices whose
    /// wave may push go on; after an abort, those not yet pushed end.
    pub(super) fn settle_rollouts(&mut self, now: Now, out: &mut Vec<Effect>) {
        while !self.rollout_work.is_empty() {
            let work = std::mem::take(&mut self.rollout_work);
            for (run_id, follow_up) in work {
                let Some(run) = self.rollouts.get_mut(&run_id) else {
                    continue;
                };
                match follow_up {
                    FollowUp::Release => run.mark_due = true,
                    FollowUp::EndUnpushed => {
                        if run.rollout.early().is_some() {
                            run.remark(None, self.records_written);
                            run.early_ahead = 0;
                            self.rollouts_changed.insert(run_id);
                        }
                    }
                }
                let mut ids: Vec<DeviceId> = run.waves.keys().cloned().collect();
                ids.sort_unstable();
                if follow_up == FollowUp::EndUnpushed {
                    // Out of the queue at once (one pass, not one per device).
                    let ending: std::collections::HashSet<&DeviceId> = ids.iter().collect();
                    let in_flight = &self.in_flight;
                    self.push_queue.retain(|queued| {
                        !ending.contains(queued)
                            || matches!(
                                in_flight.get(queued).map(|f| &f.phase),
                                Some(Phase::Pushed { .. } | Phase::MaybePushed { .. })
                            )
                    });
                }
                for id in ids {
                    let phase = self.in_flight.get(&id).map(|f| f.phase.clone());
                    match (follow_up, phase) {
                        (FollowUp::Release, Some(Phase::Held)) => {
                            if self.rollout_hold(&id) == RolloutHold::Free {
                                self.set_phase(&id, Phase::Fresh);
                                self.advance(&id, false, now, out);
                            }
                        }
                        // Maybe sent: its answer counts; without one it
                        // starts afresh and ends aborted then.
                        (
                            FollowUp::EndUnpushed,
                            Some(Phase::Pushed { .. } | Phase::MaybePushed { .. }),
                        ) => {}
                        (FollowUp::EndUnpushed, Some(_)) => {
                            let entry = self.entry(&id).unwrap_or_default();
                            let outcome = Outcome::Skipped(SkipReason::Aborted);
                            self.finish(&id, outcome, &entry, None, now, out);
                        }
                        (FollowUp::Release, Some(_)) | (_, None) => {}
                    }
                }
            }
        }
    }
}
