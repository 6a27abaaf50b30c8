//! Publishes of desired state decided on a view of the fleet that another
//! instance's write has overtaken: once the caller has brought the fleet
//! cache up to date, the pushes and retained refreshes whose generation is
//! no longer the device's desired one, which must not be sent (the device
//! is re-decided as after any desired change).

use idem_protocol::DeviceId;

use super::{Effect, Machine, PublishReason};

impl Machine {
    /// The devices of the publishes in `effects` (push attempts and
    /// retained refreshes alike: an online device applies either) whose
    /// generation the fleet's desired state, as the cache holds it now, has
    /// moved past.
    pub fn stale_pushes(&self, effects: &[Effect]) -> Vec<DeviceId> {
        effects
            .iter()
            .filter_map(|effect| match effect {
                Effect::Publish {
                    device,
                    generation,
                    reason: PublishReason::Attempt | PublishReason::RefreshRetained,
                    ..
                } => {
                    let current = self
                        .fleet
                        .get(device)
                        .and_then(|entry| entry.desired.map(|d| d.generation));
                    (current != Some(*generation)).then(|| device.clone())
                }
                Effect::AskForReport { .. } | Effect::StartRun { .. } | Effect::Record(_) => None,
            })
            .collect()
    }
}
