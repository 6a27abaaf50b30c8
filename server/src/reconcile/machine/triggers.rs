//! The runs the engine starts itself: drift, reconnect (both debounced),
//! reconcile-all and the periodic resync.

use std::collections::BTreeSet;
use std::time::Instant;

use idem_protocol::DeviceId;

use super::flight::Phase;
use super::AskReason;
use super::{Debounced, Effect, Machine, Now};
use crate::reconcile::event_draft::EventDraft;
use crate::reconcile::outcome::{Outcome, SkipReason};
use crate::reconcile::policy::DeviceStatus;
use crate::reconcile::run::Trigger;
use idem_protocol::event::DeviceDriftedData;

impl Machine {
    /// A converged device whose new report differs from its desired state
    /// has drifted: record it and schedule a remediation run.
    pub(super) fn check_drift(&mut self, id: &DeviceId, now: Instant) {
        let Some(entry) = self.entry(id) else {
            return;
        };
        let (Some(desired), Some(reported)) = (&entry.desired, &entry.reported) else {
            return;
        };
        if entry.status != DeviceStatus::Converged || desired.digest == reported.digest {
            return;
        }
        let drift = reported
            .drift
            .as_deref()
            .filter(|drift| drift.against == desired.digest);
        self.record.tally.drifts += 1;
        self.record.device(id).status = Some(DeviceStatus::Drifted);
        self.record.drafts.push(EventDraft::device_drifted(
            id,
            desired.generation,
            DeviceDriftedData {
                desired_digest: desired.digest,
                reported_digest: reported.digest,
                reported_seq: reported.seq,
                exempt: entry.exempt,
                changed_paths: drift.map(|d| d.paths.clone()),
                more_changed_paths: drift.map_or(0, |d| d.more),
            },
        ));
        if !entry.exempt {
            self.debounce(Trigger::Drift, id.clone(), now);
        }
    }

    /// Exemptions now cover these devices: an attempt that has not pushed
    /// yet ends `skipped` (`exempt`); a push that left already is answered
    /// as any push is.
    pub(super) fn exemptions_started(
        &mut self,
        ids: Vec<DeviceId>,
        now: Now,
        out: &mut Vec<Effect>,
    ) {
        for id in ids {
            let waiting = matches!(
                self.in_flight.get(&id).map(|f| &f.phase),
                Some(
                    Phase::Fresh
                        | Phase::Queued
                        | Phase::RetryAt(_)
                        | Phase::AwaitingReport { .. }
                        | Phase::Held
                )
            );
            if waiting {
                self.push_queue.retain(|queued| *queued != id);
                let entry = self.entry(&id).unwrap_or_default();
                self.conclude(&id, Outcome::Skipped(SkipReason::Exempt), &entry, now, out);
            }
        }
    }

    /// Exemptions of these devices ended, or what they own changed: each
    /// one whose report differs from its desired spec now is reconciled
    /// like any drifted device (a drift run, debounced).
    pub(super) fn recheck_drift(&mut self, ids: Vec<DeviceId>, now: Instant) {
        for id in ids {
            let Some(entry) = self.entry(&id) else {
                continue;
            };
            if entry.exempt || self.in_flight.contains_key(&id) {
                continue;
            }
            let drifted = match (&entry.desired, &entry.reported) {
                (Some(desired), Some(reported)) => desired.digest != reported.digest,
                (Some(_), None) | (None, _) => false,
            };
            if drifted {
                self.debounce(Trigger::Drift, id, now);
            }
        }
    }

    /// What these devices own changed: a drifted one whose report matches
    /// its desired spec now is converged; one that differs now is
    /// reconciled like any drifted device.
    pub(super) fn owned_changed(&mut self, ids: Vec<DeviceId>, now: Instant) {
        let mut differing = Vec::new();
        for id in ids {
            let Some(entry) = self.entry(&id) else {
                continue;
            };
            if self.in_flight.contains_key(&id) {
                continue;
            }
            let matches = match (&entry.desired, &entry.reported) {
                (Some(desired), Some(reported)) => desired.digest == reported.digest,
                (Some(_), None) | (None, _) => continue,
            };
            if matches && entry.status == DeviceStatus::Drifted {
                self.record.device(&id).status = Some(DeviceStatus::Converged);
            } else if !matches {
                differing.push(id);
            }
        }
        self.recheck_drift(differing, now);
    }

    pub(super) fn connectivity_changed(&mut self, id: &DeviceId, online: bool, now: Instant) {
        let Some(entry) = self.entry(id) else {
            return;
        };
        if online {
            if entry.status == DeviceStatus::Offline {
                self.debounce(Trigger::Reconnect, id.clone(), now);
            }
        } else if !self.in_flight.contains_key(id) && entry.status != DeviceStatus::Quarantined {
            self.record.device(id).status = Some(DeviceStatus::Offline);
        }
    }

    pub(super) fn debounce(&mut self, trigger: Trigger, id: DeviceId, now: Instant) {
        let closes_at = now + self.settings.debounce;
        self.debounced
            .entry(trigger)
            .or_insert_with(|| Debounced {
                closes_at,
                devices: BTreeSet::new(),
            })
            .devices
            .insert(id);
    }

    pub(super) fn close_debounced(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let mut due: Vec<Trigger> = self
            .debounced
            .iter()
            .filter(|(_, d)| d.closes_at <= now)
            .map(|(t, _)| *t)
            .collect();
        due.sort_unstable();
        for trigger in due {
            if let Some(batch) = self.debounced.remove(&trigger) {
                out.push(Effect::StartRun {
                    trigger,
                    targets: batch.devices.into_iter().collect(),
                });
            }
        }
    }

    pub(super) fn reconcile_all(&mut self, trigger: Trigger, out: &mut Vec<Effect>) {
        let targets = self.fleet.ids_with_desired_state();
        if !targets.is_empty() {
            out.push(Effect::StartRun { trigger, targets });
        }
    }

    /// Periodic resync: asks devices with stale reports for a fresh one and
    /// re-checks every device against what it last reported.
    pub(super) fn resync(&mut self, now: Now, out: &mut Vec<Effect>) {
        let stale_cutoff = now.wall
            - chrono::Duration::from_std(self.settings.stale_after)
                .unwrap_or(chrono::Duration::MAX);
        let mut stale = self.fleet.ids_reported_before(stale_cutoff);
        stale.sort_unstable();
        for id in stale {
            let online = self.fleet.get(&id).and_then(|e| e.online);
            if online != Some(false) && !self.in_flight.contains_key(&id) {
                out.push(Effect::AskForReport {
                    device: id,
                    reason: AskReason::Stale,
                });
            }
        }
        self.reconcile_all(Trigger::Resync, out);
    }
}
