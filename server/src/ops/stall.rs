//! Stuck-work detection for `/readyz`: a long-lived worker (the ingest, the
//! engine) marks when a write starts and when one commits, so readiness can
//! say "no write committed for 40 s while work waits" — whether the writes
//! fail and are retried or hang on a lock — even when a plain `SELECT 1`
//! still succeeds.
//!
//! Holds timestamps only; it never decides what to retry.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// One worker's waiting-since mark.
#[derive(Debug)]
pub struct Stall {
    /// How long a write may take (or keep failing) before the worker counts
    /// as stuck.
    threshold: Duration,
    waiting_since: Mutex<Option<Instant>>,
}

impl Stall {
    pub fn new(threshold: Duration) -> Self {
        Self {
            threshold,
            waiting_since: Mutex::new(None),
        }
    }

    /// A write starts (or is retried after a failure); the first one since
    /// the last commit starts the clock.
    pub fn writing(&self) {
        let mut since = self
            .waiting_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        since.get_or_insert_with(Instant::now);
    }

    /// A write committed: the worker is moving again. Returns how long it
    /// had waited for this commit.
    pub fn progressed(&self) -> Option<Duration> {
        self.waiting_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .map(|since| since.elapsed())
    }

    /// How long the worker has waited for a commit, once that exceeds the
    /// threshold at `now`.
    pub fn stuck_for(&self, now: Instant) -> Option<Duration> {
        let since = *self
            .waiting_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        since
            .map(|at| now.saturating_duration_since(at))
            .filter(|d| *d >= self.threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_is_stuck_only_after_waiting_for_the_threshold() {
        let stall = Stall::new(Duration::from_secs(10));
        assert_eq!(stall.stuck_for(Instant::now()), None);
        stall.writing();
        let now = Instant::now();
        assert_eq!(stall.stuck_for(now), None);
        let later = now + Duration::from_secs(11);
        assert!(stall.stuck_for(later).is_some());
        stall.writing();
        assert!(
            stall.stuck_for(later).is_some(),
            "a retried write keeps the first mark"
        );
        stall.progressed();
        assert_eq!(stall.stuck_for(later), None);
    }
}
