//! Stuck-work detection for `/readyz`: a long-lived worker (the ingest, the
//! engine) marks when its writes start failing and when one commits again,
//! so readiness can say "no progress for 40 s while work waits" even when a
//! plain `SELECT 1` still succeeds.
//!
//! Holds timestamps only; it never decides what to retry.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long writes may keep failing before the worker counts as stuck.
pub const STUCK_AFTER: Duration = Duration::from_secs(10);

/// One worker's failing-since mark.
#[derive(Debug, Default)]
pub struct Stall {
    failing_since: Mutex<Option<Instant>>,
}

impl Stall {
    /// A write failed and will be retried; the first failure starts the clock.
    pub fn failing(&self) {
        let mut since = self
            .failing_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        since.get_or_insert_with(Instant::now);
    }

    /// A write committed: the worker is moving again.
    pub fn progressed(&self) {
        *self
            .failing_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// How long the worker has been failing, once that exceeds
    /// [`STUCK_AFTER`] at `now`.
    pub fn stuck_for(&self, now: Instant) -> Option<Duration> {
        let since = *self
            .failing_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        since
            .map(|at| now.saturating_duration_since(at))
            .filter(|d| *d >= STUCK_AFTER)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_is_stuck_only_after_failing_for_the_threshold() {
        let stall = Stall::default();
        assert_eq!(stall.stuck_for(Instant::now()), None);
        stall.failing();
        let now = Instant::now();
        assert_eq!(stall.stuck_for(now), None);
        let later = now + STUCK_AFTER + Duration::from_secs(1);
        assert!(stall.stuck_for(later).is_some());
        stall.failing();
        assert!(
            stall.stuck_for(later).is_some(),
            "a repeated failure keeps the first mark"
        );
        stall.progressed();
        assert_eq!(stall.stuck_for(later), None);
    }
}
