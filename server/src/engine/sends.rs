//! What the engine hands the broker: desired-state publishes and report
//! requests. Each run of them between two writes leaves under a hold on
//! desired changes, once the publishes another instance's change has
//! overtaken are taken out, so no push or retained refresh leaves for a
//! generation that was replaced before it left.

use std::collections::HashSet;

use idem_protocol::DeviceId;

use super::Engine;
use crate::reconcile::machine::{Effect, PublishReason};
use crate::store::writer::DesiredHold;
use crate::tuning::DESIRED_HOLD_TRIES;

impl Engine {
    /// Sends `outgoing` (publishes and report requests, in order; `carry`
    /// keeps runs and records for itself) unless the engine lease may have
    /// lapsed. The devices whose publishes were withdrawn as overtaken are
    /// added to `withdrawn`, for the machine to decide again.
    pub(super) async fn send(&mut self, mut outgoing: Vec<Effect>, withdrawn: &mut Vec<DeviceId>) {
        if outgoing.is_empty() {
            return;
        }
        let hold = self.hold_fresh(&mut outgoing, withdrawn).await;
        for effect in outgoing {
            match effect {
                Effect::Publish { .. } | Effect::AskForReport { .. } if self.lease_lapsed() => {}
                Effect::Publish {
                    device,
                    generation,
                    spec,
                    reason,
                } => {
                    self.ctx.publisher.push(&device, generation, &spec);
                    match reason {
                        PublishReason::Attempt => self.ctx.metrics.pushes.increment(1),
                        PublishReason::RefreshRetained => {
                            self.ctx.metrics.retained_updates.increment(1)
                        }
                    }
                }
                Effect::AskForReport { device, reason } => {
                    self.ctx.publisher.ask_for_report(&device);
                    self.ctx.metrics.report_requests.increment(1);
                    self.ctx.metrics.asked_to_report(reason);
                }
                // Never in `outgoing`: `carry` handles them in order.
                Effect::StartRun { .. } | Effect::Record(_) => {}
            }
        }
        if let Some(hold) = hold {
            // Handed to the client: the changes held back may commit. The
            // engine goes on meanwhile.
            tokio::spawn(async move {
                if let Err(e) = hold.release().await {
                    tracing::warn!(error = %e, "could not release the hold on desired changes (its connection's end releases it)");
                }
            });
        }
    }

    /// Takes out of `outgoing` the publishes of desired state (pushes and
    /// retained refreshes) for a generation that is no longer desired, and
    /// returns the hold under which the rest is to be sent. A hold is asked
    /// for up to [`DESIRED_HOLD_TRIES`] times; each time the cache lacks a
    /// change another instance committed (one no notification or catch-up
    /// brought in yet), it catches up first. Then the machine names the
    /// publishes the cache has moved past. When the database cannot say,
    /// or other instances kept changing desired state, the publishes are
    /// judged on the cache as it is and go without a hold.
    async fn hold_fresh(
        &self,
        outgoing: &mut Vec<Effect>,
        withdrawn: &mut Vec<DeviceId>,
    ) -> Option<DesiredHold> {
        if !outgoing
            .iter()
            .any(|effect| matches!(effect, Effect::Publish { .. }))
        {
            return None;
        }
        let hold = self.hold_after_catching_up().await;
        self.withdraw_stale(outgoing, withdrawn);
        hold
    }

    /// A hold on desired changes, the cache caught up first each time it
    /// lacks a committed change; `None` (with the reason logged) when the
    /// database cannot give one or [`DESIRED_HOLD_TRIES`] catch-ups were
    /// overtaken again.
    async fn hold_after_catching_up(&self) -> Option<DesiredHold> {
        for _ in 0..DESIRED_HOLD_TRIES {
            match self.ctx.writer.hold_desired().await {
                Ok(Some(hold)) => return Some(hold),
                Ok(None) => {
                    if let Err(e) = self.ctx.writer.follow().await {
                        tracing::warn!(error = %e, "could not catch up with other instances' writes before pushing; publishes go without a hold, judged on the cache as it is");
                        return None;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not hold desired changes before pushing; publishes go without a hold, judged on the cache as it is");
                    return None;
                }
            }
        }
        tracing::warn!("other instances kept changing desired state; publishes go without a hold, judged on the cache as it is");
        None
    }

    /// Takes out of `outgoing` the publishes the machine names stale and
    /// adds their devices to `withdrawn` (`carry` makes each appear once).
    fn withdraw_stale(&self, outgoing: &mut Vec<Effect>, withdrawn: &mut Vec<DeviceId>) {
        let stale = self.machine.stale_pushes(outgoing);
        if stale.is_empty() {
            return;
        }
        let devices: HashSet<&DeviceId> = stale.iter().collect();
        outgoing.retain(|effect| match effect {
            Effect::Publish { device, .. } => !devices.contains(device),
            Effect::AskForReport { .. } | Effect::StartRun { .. } | Effect::Record(_) => true,
        });
        self.ctx.metrics.stale_pushes.increment(stale.len() as u64);
        tracing::info!(
            publishes = stale.len(),
            "pushes withdrawn: another instance changed these devices' desired state since they were decided"
        );
        withdrawn.extend(stale);
    }
}
