//! Pushes decided on a view of the fleet that another instance's write has
//! overtaken: once the caller has brought the fleet cache up to date, the
//! pushes whose generation is no longer the device's desired one, which
//! must not be sent (the device is re-decided as after any desired change).

use idem_protocol::DeviceId;

use super::{Effect, Machine, PublishReason};

impl Machine {
    /// The devices of the push attempts in `effects` whose generation the
    /// fleet's desired state (as the cache holds it now) has moved past.
    /// Retained refreshes are not judged: they follow the desired state
    /// themselves.
    pub fn stale_pushes(&self, effects: &[Effect]) -> Vec<DeviceId> {
        effects
            .iter()
            .filter_map(|effect| match effect {
                Effect::Publish {
                    device,
                    generation,
                    reason: PublishReason::Attempt,
                    ..
                } => {
                    let current = self
                        .fleet
                        .get(device)
                        .and_then(|entry| entry.desired.map(|d| d.generation));
                    (current != Some(*generation)).then(|| device.clone())
                }
                Effect::Publish {
                    reason: PublishReason::RefreshRetained,
                    ..
                }
                | Effect::AskForReport { .. }
                | Effect::StartRun { .. }
                | Effect::Record(_) => None,
            })
            .collect()
    }
}
