//! The signs that the broker may have dropped messages for the server,
//! raised without waiting by whoever sees one (the event loop: the broker's
//! dropped counter rising, a session found lost; the ingest: a write held
//! too long) and taken by the engine's rechecker (`engine/recheck.rs`).

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

pub use crate::reconcile::machine::RecheckTrigger;

/// The signs, raised from anywhere without waiting.
#[derive(Debug, Default)]
pub struct RecheckSignal {
    /// The first trigger raised since the last recheck started.
    pending: Mutex<Option<RecheckTrigger>>,
    raised: Notify,
}

impl RecheckSignal {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Asks for a recheck because of `trigger`; never blocks.
    pub fn raise(&self, trigger: RecheckTrigger) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(trigger);
        self.raised.notify_one();
    }

    /// Waits until a sign is raised (one raised before the wait counts).
    pub async fn raised(&self) {
        self.raised.notified().await;
    }

    /// The trigger raised first since the last take, if any.
    pub fn take(&self) -> Option<RecheckTrigger> {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_raised_before_a_recheck_starts_make_one_with_the_first_trigger() {
        let signal = RecheckSignal::default();
        signal.raise(RecheckTrigger::IngestStalled);
        signal.raise(RecheckTrigger::BrokerDropped);
        assert_eq!(signal.take(), Some(RecheckTrigger::IngestStalled));
        assert_eq!(signal.take(), None);
    }
}
