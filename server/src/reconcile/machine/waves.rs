//! Rollouts in the machine: a rollout run's devices held until their wave
//! may push, each device's outcome counted in its wave, a rollout's steps
//! (waves started and completed, pauses, resumes, approvals, aborts) as
//! events and as the stored state its run row keeps, and operators'
//! actions on a rollout.

use std::collections::HashMap;
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
    paused_view, wave_view, NotNow, PauseReason, Rollout, RolloutState, StoredPause, StoredRollout,
    Transition,
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
                if wave == current {
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
        self.rollouts.insert(
            run_id,
            RolloutRun {
                rollout,
                waves: start.waves,
                restored,
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

    /// A device of a rollout carried on from an earlier process that was
    /// pushed its current generation there (its push is written before it
    /// is sent): it waits for that push's answer, as if this process had
    /// sent it at `now`, and is not pushed again.
    pub(super) fn pushed_before_restart(
        &self,
        run_id: Uuid,
        id: &DeviceId,
        entry: &DeviceEntry,
        now: Instant,
    ) -> Option<Phase> {
        let run = self.rollouts.get(&run_id)?;
        let desired = entry.desired.as_ref()?;
        let pushed = run.restored
            && run.waves.contains_key(id)
            && entry.status == DeviceStatus::Provisioning
            && entry.retained_generation == Some(desired.generation);
        pushed.then(|| Phase::Pushed {
            generation: desired.generation,
            // Any report since then may be its answer.
            seq_at_push: None,
            deadline: now + self.settings.push_timeout,
        })
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
        let Some(wave) = run.waves.remove(id) else {
            return;
        };
        let steps = run.rollout.record(wave, kind, now.at);
        self.rollout_stepped(run_id, steps, now);
        self.rollouts_changed.insert(run_id);
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
        for run_id in std::mem::take(&mut self.rollouts_changed) {
            if let Some(run) = self.rollouts.get(&run_id) {
                let stored = run.rollout.stored(now.at, now.wall);
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
                let Some(run) = self.rollouts.get(&run_id) else {
                    continue;
                };
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
                                Some(Phase::Pushed { .. })
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
                        (FollowUp::EndUnpushed, Some(Phase::Pushed { .. })) => {}
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
