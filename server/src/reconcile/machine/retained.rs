//! The retained desired message of each device: refreshed after an
//! attempt that pushed nothing, republished when the broker lost it, so a
//! device that reboots applies the current generation.

use super::*;

impl Machine {
    /// Republishes the current desired state as the retained message when
    /// the broker's copy is behind it, without starting an attempt: the
    /// device already runs it or is not attempted now, but a reboot must
    /// never bring it a withdrawn generation.
    pub(super) fn refresh_retained(&mut self, id: &DeviceId, out: &mut Vec<Effect>) {
        if let Some(entry) = self.entry(id) {
            self.refresh_retained_from(id, &entry, out);
        }
    }

    /// [`Machine::refresh_retained`] with the device as already looked up.
    /// Never to a device waiting on a rollout: its wave brings it the
    /// change.
    pub(super) fn refresh_retained_from(
        &mut self,
        id: &DeviceId,
        entry: &DeviceEntry,
        out: &mut Vec<Effect>,
    ) {
        if self.in_rollout(id) {
            return;
        }
        if let Some(desired) = entry.retained_behind() {
            self.publish_retained(id, entry, desired, out);
        }
    }

    /// Publishes the retained desired message again at its generation (what
    /// the device owns changed what it holds), if the broker holds one.
    pub(super) fn republish_retained(&mut self, id: &DeviceId, out: &mut Vec<Effect>) {
        let Some(entry) = self.entry(id) else {
            return;
        };
        if let (Some(desired), Some(_)) = (&entry.desired, entry.retained_generation) {
            self.publish_retained(id, &entry, desired, out);
        }
    }

    /// `desired` as the device's retained desired message, recorded. Never
    /// to an exempt device: a device applies its retained message, so that
    /// would remediate it; its message is brought up to date when the
    /// exemption ends.
    pub(super) fn publish_retained(
        &mut self,
        id: &DeviceId,
        entry: &DeviceEntry,
        desired: &DesiredState,
        out: &mut Vec<Effect>,
    ) {
        if entry.exempt {
            return;
        }
        self.record.device(id).retained = Some(desired.generation);
        out.push(Effect::Publish {
            device: id.clone(),
            generation: desired.generation,
            spec: entry.spec_to_publish(desired),
            reason: PublishReason::RefreshRetained,
        });
    }
}
