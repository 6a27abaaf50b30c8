//! How an attempt ends: retry policy applied to a decided outcome, then one
//! outcome row and event per waiting run, the device's merged change, and
//! how a run ends once its last target has its outcome (`run_ended`).

use idem_protocol::{Backoff, DeviceId};
use rand::Rng;
use uuid::Uuid;

use super::record::{AttemptRecord, OutcomeRecord};
use super::{Effect, Machine, Now, Phase, RememberedOutcome};
use crate::reconcile::device::DeviceEntry;
use crate::reconcile::event_draft::EventDraft;
use crate::reconcile::outcome::{Outcome, OutcomeKind};
use crate::reconcile::policy::{status_left, AfterFailure, DeviceStatus};
use crate::reconcile::run::RunProgress;
use idem_protocol::event::{DeviceOutcomeData, DeviceQuarantinedData};

impl Machine {
    /// Applies retry policy to a decided outcome, then finishes or retries.
    pub(super) fn conclude(
        &mut self,
        id: &DeviceId,
        outcome: Outcome,
        entry: &DeviceEntry,
        now: Now,
        out: &mut Vec<Effect>,
    ) {
        let Some(flight) = self.in_flight.get(id) else {
            return;
        };
        let run_id = flight.runs.first().copied().unwrap_or_default();
        let generation = flight.generation;
        let attempt = entry.failures + 1;
        self.pushed.remove(id);
        let history = |result: OutcomeKind, reason: Option<String>| AttemptRecord {
            device: id.clone(),
            run_id,
            attempt,
            generation,
            result,
            reason,
        };
        match &outcome {
            Outcome::Failed(reason) => {
                let jitter = self.rng.random_range(Backoff::JITTER_FACTORS);
                let after = self.settings.retry.after_failure(attempt, jitter);
                self.record
                    .attempts
                    .push(history(OutcomeKind::Failed, Some(reason.to_string())));
                let change = self.record.device(id);
                change.last_error = Some(reason.to_string());
                match after {
                    AfterFailure::RetryAfter(delay) => {
                        let next = now.wall + chrono::Duration::from_std(delay).unwrap_or_default();
                        change.failures = Some((attempt, Some(next)));
                        change.status = Some(DeviceStatus::Failed);
                        self.record.tally.retries += 1;
                        self.set_phase(id, Phase::RetryAt(now.at + delay));
                    }
                    AfterFailure::Quarantine => {
                        change.failures = Some((attempt, None));
                        self.record.tally.quarantines += 1;
                        self.record.drafts.push(EventDraft::device_quarantined(
                            id,
                            run_id,
                            generation,
                            DeviceQuarantinedData {
                                attempts: attempt,
                                last_error: reason.to_string(),
                            },
                        ));
                        let status = Some(DeviceStatus::Quarantined);
                        self.finish(id, outcome, entry, status, now, out);
                    }
                }
            }
            Outcome::Provisioned | Outcome::Superseded => {
                let failures = match outcome {
                    Outcome::Provisioned => 0,
                    Outcome::AlreadyConverged
                    | Outcome::Failed(_)
                    | Outcome::Skipped(_)
                    | Outcome::Superseded => entry.failures,
                };
                self.record.attempts.push(history(outcome.kind(), None));
                self.record.device(id).failures = Some((failures, None));
                self.finish(id, outcome, entry, None, now, out);
            }
            Outcome::AlreadyConverged => {
                if entry.failures > 0 {
                    self.record.device(id).failures = Some((0, None));
                }
                self.finish(id, outcome, entry, None, now, out);
            }
            Outcome::Skipped(_) => self.finish(id, outcome, entry, None, now, out),
        }
    }

    /// Records `outcome` for every run waiting on this device's attempt.
    pub(super) fn finish(
        &mut self,
        id: &DeviceId,
        outcome: Outcome,
        entry: &DeviceEntry,
        status: Option<DeviceStatus>,
        now: Now,
        out: &mut Vec<Effect>,
    ) {
        let Some(flight) = self.in_flight.remove(id) else {
            return;
        };
        self.pushed.remove(id);
        let kind = outcome.kind();
        let status = status.or_else(|| status_left(&outcome, entry));
        let reason = outcome.reason();
        let generation = flight.generation;
        let health = entry.health;
        match &outcome {
            Outcome::Provisioned => {
                let latency = now.at.saturating_duration_since(flight.since);
                self.record.tally.convergence.push(latency);
            }
            Outcome::AlreadyConverged
            | Outcome::Failed(_)
            | Outcome::Skipped(_)
            | Outcome::Superseded => {}
        }
        match &outcome {
            // Nothing was pushed in this attempt: the broker may still hold
            // an older generation retained, which a reboot would apply.
            Outcome::AlreadyConverged | Outcome::Failed(_) | Outcome::Skipped(_) => {
                self.refresh_retained(id, out);
            }
            // Pushed (the retained message is current), or another attempt
            // for the newer generation takes over.
            Outcome::Provisioned | Outcome::Superseded => {}
        }
        self.remember_outcome(id, flight.runs.last().copied(), &outcome, status);
        for run_id in flight.runs {
            self.record.outcomes.push(OutcomeRecord {
                run_id,
                device: id.clone(),
                kind,
                reason: reason.clone(),
                generation,
                health,
            });
            self.record.drafts.push(EventDraft::device_outcome(
                id,
                run_id,
                generation,
                DeviceOutcomeData {
                    outcome: kind,
                    reason: reason.clone(),
                    health,
                    success: outcome.is_success(),
                },
            ));
            self.record.per_run.entry(run_id).or_default().add(kind);
            self.count_in_wave(run_id, id, kind, now);
            if let Some(run) = self.runs.get_mut(&run_id) {
                run.record(id, kind);
                if run.is_complete() {
                    if let Some(run) = self.runs.remove(&run_id) {
                        self.run_ended(run, now);
                    }
                }
            }
        }
    }

    /// A run whose last outcome was just recorded ends, in the same call:
    /// it leaves, with the machine's counts, in the record being collected
    /// ([`super::Record::completed`]). What follows the end of a run starts
    /// here.
    pub(super) fn run_ended(&mut self, run: RunProgress, now: Now) {
        self.resumed_runs.remove(&run.id);
        self.rollout_ended(run.id, now);
        self.record.completed.push(run.complete(now.at));
    }

    /// The device row's share of an outcome: status, last outcome, last error.
    fn remember_outcome(
        &mut self,
        id: &DeviceId,
        last_run: Option<Uuid>,
        outcome: &Outcome,
        status: Option<DeviceStatus>,
    ) {
        let reason = outcome.reason();
        let change = self.record.device(id);
        if let Some(status) = status {
            change.status = Some(status);
        }
        if let Some(run_id) = last_run {
            change.last_outcome = Some(RememberedOutcome {
                run_id,
                kind: outcome.kind(),
                reason: reason.clone(),
            });
        }
        match outcome {
            Outcome::Failed(_) => change.last_error = reason,
            Outcome::Provisioned
            | Outcome::AlreadyConverged
            | Outcome::Skipped(_)
            | Outcome::Superseded => {}
        }
    }
}
