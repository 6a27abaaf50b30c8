//! Push pacing: spaces pushes evenly at the configured rate and never lets
//! more than `rate` of them into any pacing window. Pure: the caller passes
//! the time.

use crate::tuning::{PACING_CATCH_UP, PACING_WINDOW};
use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

/// Spaces pushes evenly at the configured rate, and never lets more than
/// `rate` of them into any [`PACING_WINDOW`] (exact sliding window).
pub struct PushPacer {
    rate: usize,
    spacing: Option<Duration>,
    next_slot: Instant,
    /// Send times of the last `rate` pushes.
    recent: VecDeque<Instant>,
}

impl PushPacer {
    pub fn new(rate: Option<NonZeroU32>, now: Instant) -> Self {
        let rate = rate.map(NonZeroU32::get);
        Self {
            rate: rate.map_or(0, |r| r as usize),
            spacing: rate.map(|r| PACING_WINDOW / r),
            next_slot: now,
            recent: VecDeque::new(),
        }
    }

    /// When the next slot opens (for sleeping until then).
    pub fn next_slot(&self) -> Instant {
        match self.recent.front() {
            Some(oldest) if self.recent.len() >= self.rate => {
                self.next_slot.max(*oldest + PACING_WINDOW)
            }
            Some(_) | None => self.next_slot,
        }
    }

    /// Takes a slot if one is due.
    pub fn try_take(&mut self, now: Instant) -> bool {
        let Some(spacing) = self.spacing else {
            return true;
        };
        if now < self.next_slot() {
            return false;
        }
        let earliest = now.checked_sub(PACING_CATCH_UP).unwrap_or(now);
        self.next_slot = self.next_slot.max(earliest) + spacing;
        if self.recent.len() >= self.rate {
            self.recent.pop_front();
        }
        self.recent.push_back(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slots a 200/s pacer hands out when woken every `step_ms` for
    /// `total_ms`, the first wake-up `late_ms` after it was created.
    fn slots_taken_from(late_ms: u64, step_ms: usize, total_ms: u64) -> Vec<Instant> {
        let mut pacer = PushPacer::new(NonZeroU32::new(200), Instant::now());
        let start = pacer.next_slot() + Duration::from_millis(late_ms);
        let mut taken = Vec::new();
        for ms in (0..total_ms).step_by(step_ms) {
            let now = start + Duration::from_millis(ms);
            let before = taken.len();
            while pacer.try_take(now) {
                taken.push(now);
                assert!(
                    taken.len() - before <= 200,
                    "more than a window's worth of slots at one instant"
                );
            }
        }
        taken
    }

    /// Slots a 200/s pacer hands out when woken every `step_ms` for `total_ms`.
    fn slots_taken(step_ms: usize, total_ms: u64) -> Vec<Instant> {
        slots_taken_from(0, step_ms, total_ms)
    }

    /// The most slots within any [`PACING_WINDOW`].
    fn peak_per_window(taken: &[Instant]) -> usize {
        (0..taken.len())
            .map(|i| {
                taken[i..]
                    .iter()
                    .take_while(|u| **u < taken[i] + PACING_WINDOW)
                    .count()
            })
            .max()
            .unwrap_or(0)
    }

    /// The most slots within any one-second window.
    fn peak_per_second(taken: &[Instant]) -> usize {
        (0..taken.len())
            .map(|i| {
                taken[i..]
                    .iter()
                    .take_while(|u| **u < taken[i] + Duration::from_secs(1))
                    .count()
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn pacing_never_allows_more_than_the_rate_in_any_second() {
        // Woken every 1 ms (tokio's timer granularity) for 3 s.
        let taken = slots_taken(1, 3_000);
        assert!(peak_per_second(&taken) <= 200);
        assert!(
            taken.len() >= 540,
            "pacing too slow: {} in 3 s",
            taken.len()
        );
    }

    #[test]
    fn late_wake_ups_catch_up_without_breaking_the_window() {
        // Woken only every 8 ms, as if each wake-up followed a database write.
        let taken = slots_taken(8, 5_000);
        assert!(peak_per_second(&taken) <= 200);
        assert!(
            taken.len() >= 850,
            "catch-up too weak: {} in 5 s",
            taken.len()
        );
    }

    #[test]
    fn a_slot_opens_exactly_one_spacing_after_the_last() {
        let mut pacer = PushPacer::new(NonZeroU32::new(200), Instant::now());
        let first = pacer.next_slot();
        assert!(pacer.try_take(first));
        assert!(!pacer.try_take(first), "one slot per spacing");
        let second = pacer.next_slot();
        assert_eq!(second, first + PACING_WINDOW / 200);
        assert!(!pacer.try_take(second - Duration::from_nanos(1)));
        assert!(pacer.try_take(second));
    }

    #[test]
    fn the_sliding_window_holds_when_catching_up_on_a_late_start() {
        // Woken first 10 ms late, the pacer catches up on that lateness
        // with a small burst; spacing alone would then fit 202 slots into
        // one window, the window keeps it at the rate.
        let taken = slots_taken_from(10, 1, 3_000);
        assert!(taken.len() >= 540, "pacing too slow: {}", taken.len());
        assert_eq!(peak_per_window(&taken), 200);
    }

    #[test]
    fn no_rate_means_no_pacing() {
        let mut pacer = PushPacer::new(None, Instant::now());
        let now = Instant::now();
        assert!((0..10_000).all(|_| pacer.try_take(now)));
    }
}
