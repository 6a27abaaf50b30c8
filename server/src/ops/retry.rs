//! The backoff of loops that retry the database or the broker after a
//! failure: a delay that doubles with every consecutive failure up to a cap,
//! and starts over after a success.
//!
//! Pure: it computes delays and never sleeps; the loops wait themselves (and
//! stop waiting on shutdown).

use std::time::Duration;

/// Consecutive-failure backoff: `start`, `2·start`, `4·start`, … up to `cap`.
#[derive(Debug, Clone)]
pub struct Backoff {
    start: Duration,
    cap: Duration,
    /// The delay the next failure waits.
    next: Duration,
}

impl Backoff {
    /// `start` first, doubling up to `cap` (a `start` above `cap` waits `cap`).
    pub fn new(start: Duration, cap: Duration) -> Self {
        Self {
            start,
            cap,
            next: start.min(cap),
        }
    }

    /// The backoff of the store and broker loops (ingest writes, the MQTT
    /// connection): 100 ms, doubling up to 5 s.
    pub fn store_and_broker() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }

    /// The delay to wait after this failure; the next one waits twice as
    /// long, up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = delay.saturating_mul(2).min(self.cap);
        delay
    }

    /// After a success: the next failure waits `start` again.
    pub fn reset(&mut self) {
        self.next = self.start.min(self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delays(backoff: &mut Backoff, n: usize) -> Vec<Duration> {
        (0..n).map(|_| backoff.next_delay()).collect()
    }

    #[test]
    fn delays_double_from_the_start_up_to_the_cap_and_stay_there() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            delays(&mut backoff, 7),
            [
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1000),
                ms(1000),
                ms(1000)
            ]
        );
    }

    #[test]
    fn a_reset_starts_the_doubling_over() {
        let mut backoff = Backoff::store_and_broker();
        delays(&mut backoff, 20);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
        assert_eq!(backoff.next_delay(), Duration::from_millis(200));
    }

    #[test]
    fn the_store_and_broker_backoff_goes_from_100_ms_to_5_s() {
        let mut backoff = Backoff::store_and_broker();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            delays(&mut backoff, 8),
            [
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(3200),
                ms(5000),
                ms(5000)
            ]
        );
    }

    #[test]
    fn doubling_never_overflows_and_a_start_above_the_cap_waits_the_cap() {
        let mut huge = Backoff::new(Duration::MAX / 2 + Duration::from_secs(1), Duration::MAX);
        huge.next_delay();
        assert_eq!(huge.next_delay(), Duration::MAX);
        let mut inverted = Backoff::new(Duration::from_secs(9), Duration::from_secs(2));
        assert_eq!(delays(&mut inverted, 2), [Duration::from_secs(2); 2]);
    }
}
