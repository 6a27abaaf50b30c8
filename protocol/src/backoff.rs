//! The one backoff of everything in idem that retries after a failure (the
//! server's store and broker loops and device pushes, a device's broker
//! reconnects): a delay that doubles with every consecutive failure up to a
//! cap, optionally shortened by a jitter factor the caller draws.
//!
//! Pure: it computes delays and never sleeps, reads no clock and draws no
//! random numbers; callers wait themselves (and stop waiting on shutdown).
//! Arithmetic saturates: no start, cap or failure count overflows.

use std::ops::RangeInclusive;
use std::time::Duration;

/// Consecutive-failure backoff: `start`, `2·start`, `4·start`, … up to `cap`.
///
/// Two ways to use it: as a pure schedule ([`Backoff::delay_after`] the
/// `n`-th consecutive failure, the caller counting), or as the counter
/// itself ([`Backoff::next_delay`] after each failure, [`Backoff::reset`]
/// after a success). Both give the same delays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    start: Duration,
    cap: Duration,
    /// Consecutive failures counted by `next_delay` since the last reset.
    failures: u32,
}

impl Backoff {
    /// The factors a jittered delay may be scaled by: 50 % to 100 % of the
    /// un-jittered delay. Draw one uniformly from here (e.g.
    /// `rng.random_range(Backoff::JITTER_FACTORS)`) so that many clients
    /// failing together do not retry in lockstep.
    pub const JITTER_FACTORS: RangeInclusive<f64> = 0.5..=1.0;

    /// `start` first, doubling up to `cap` (a `start` above `cap` waits `cap`).
    pub const fn new(start: Duration, cap: Duration) -> Self {
        Self {
            start,
            cap,
            failures: 0,
        }
    }

    /// The backoff of the server's store and broker loops (ingest writes,
    /// the MQTT connection): 100 ms, doubling up to 5 s.
    pub const fn store_and_broker() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }

    /// The backoff of a device reconnecting to its broker (the simulator's
    /// default): 250 ms, doubling up to 30 s.
    pub const fn device_reconnect() -> Self {
        Self::new(Duration::from_millis(250), Duration::from_secs(30))
    }

    /// The delay after the first failure, as given (even above the cap).
    pub const fn start(&self) -> Duration {
        self.start
    }

    /// The longest delay.
    pub const fn cap(&self) -> Duration {
        self.cap
    }

    /// Consecutive failures [`Backoff::next_delay`] has counted since the
    /// last [`Backoff::reset`].
    pub const fn failures(&self) -> u32 {
        self.failures
    }

    /// The delay after the `failures`-th consecutive failure (1 = the
    /// first; 0 counts as 1): `start · 2^(failures-1)`, at most `cap`.
    pub fn delay_after(&self, failures: u32) -> Duration {
        let mut delay = self.start.min(self.cap);
        // Bounded whatever `failures` is: every round doubles a non-zero
        // delay below the cap, and Duration::MAX is below 2^94 ns, so the
        // loop breaks after at most 94 rounds.
        for _ in 1..failures {
            if delay.is_zero() || delay >= self.cap {
                break;
            }
            delay = delay.saturating_mul(2).min(self.cap);
        }
        delay
    }

    /// [`Backoff::delay_after`] scaled by `factor`, which is clamped into
    /// [`Backoff::JITTER_FACTORS`]; a factor that is not a finite number
    /// counts as 1 (no jitter).
    pub fn jittered_delay_after(&self, failures: u32, factor: f64) -> Duration {
        scale_by_jitter(self.delay_after(failures), factor)
    }

    /// The delay to wait after this failure; the next one waits twice as
    /// long, up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.delay_after(self.failures)
    }

    /// [`Backoff::next_delay`] scaled by `factor`, as in
    /// [`Backoff::jittered_delay_after`].
    pub fn next_jittered_delay(&mut self, factor: f64) -> Duration {
        scale_by_jitter(self.next_delay(), factor)
    }

    /// After a success: the next failure waits `start` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

/// `delay · factor`, the factor clamped into [`Backoff::JITTER_FACTORS`]
/// (1 when it is not finite).
fn scale_by_jitter(delay: Duration, factor: f64) -> Duration {
    let factor = if factor.is_finite() {
        factor.clamp(
            *Backoff::JITTER_FACTORS.start(),
            *Backoff::JITTER_FACTORS.end(),
        )
    } else {
        1.0
    };
    // The same product as `Duration::mul_f64`, which panics where this keeps
    // the un-jittered delay: a delay so close to Duration::MAX that the
    // product, rounded through f64, no longer fits.
    Duration::try_from_secs_f64(delay.as_secs_f64() * factor).unwrap_or(delay)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn delays(backoff: &mut Backoff, n: usize) -> Vec<Duration> {
        (0..n).map(|_| backoff.next_delay()).collect()
    }

    #[test]
    fn delays_double_from_the_start_up_to_the_cap_and_stay_there() {
        let mut backoff = Backoff::new(ms(100), Duration::from_secs(1));
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
        assert_eq!(backoff.failures(), 20);
        backoff.reset();
        assert_eq!(backoff.failures(), 0);
        assert_eq!(backoff.next_delay(), ms(100));
        assert_eq!(backoff.next_delay(), ms(200));
    }

    #[test]
    fn the_store_and_broker_backoff_goes_from_100_ms_to_5_s() {
        let mut backoff = Backoff::store_and_broker();
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
    fn the_device_reconnect_backoff_goes_from_250_ms_to_30_s() {
        let backoff = Backoff::device_reconnect();
        assert_eq!((backoff.start(), backoff.cap()), (ms(250), ms(30_000)));
        assert_eq!(backoff.delay_after(1), ms(250));
        assert_eq!(backoff.delay_after(8), ms(30_000));
    }

    #[test]
    fn doubling_never_overflows_and_a_start_above_the_cap_waits_the_cap() {
        let mut huge = Backoff::new(Duration::MAX / 2 + Duration::from_secs(1), Duration::MAX);
        huge.next_delay();
        assert_eq!(huge.next_delay(), Duration::MAX);
        let mut inverted = Backoff::new(Duration::from_secs(9), Duration::from_secs(2));
        assert_eq!(delays(&mut inverted, 2), [Duration::from_secs(2); 2]);
        assert_eq!(inverted.start(), Duration::from_secs(9));
    }

    #[test]
    fn the_nth_failure_waits_what_the_nth_next_delay_waits() {
        for (start, cap) in [
            (ms(100), ms(5000)),
            (ms(7), ms(3)),
            (Duration::ZERO, ms(10)),
        ] {
            let backoff = Backoff::new(start, cap);
            let mut counting = backoff;
            for failures in 1..=40 {
                assert_eq!(
                    counting.next_delay(),
                    backoff.delay_after(failures),
                    "{start:?}..{cap:?}, failure {failures}"
                );
            }
        }
    }

    #[test]
    fn no_failures_yet_waits_the_start_like_the_first() {
        let backoff = Backoff::new(ms(100), Duration::from_secs(1));
        assert_eq!(backoff.delay_after(0), ms(100));
        assert_eq!(backoff.delay_after(1), ms(100));
    }

    #[test]
    fn any_number_of_failures_waits_at_most_the_cap_and_returns_at_once() {
        let tiny_start = Backoff::new(Duration::from_nanos(1), Duration::MAX);
        assert_eq!(tiny_start.delay_after(u32::MAX), Duration::MAX);
        assert_eq!(tiny_start.delay_after(33), Duration::from_nanos(1 << 32));
        let zero = Backoff::new(Duration::ZERO, Duration::from_secs(1));
        assert_eq!(zero.delay_after(u32::MAX), Duration::ZERO);
        let mut saturated = Backoff::new(ms(1), ms(2));
        for _ in 0..3 {
            saturated.failures = u32::MAX;
            assert_eq!(saturated.next_delay(), ms(2));
        }
    }

    #[test]
    fn jitter_shortens_a_delay_by_at_most_half_and_never_lengthens_it() {
        let backoff = Backoff::new(ms(100), Duration::from_secs(1));
        assert_eq!(backoff.jittered_delay_after(1, 1.0), ms(100));
        assert_eq!(backoff.jittered_delay_after(1, 0.5), ms(50));
        assert_eq!(backoff.jittered_delay_after(2, 0.75), ms(150));
        assert_eq!(backoff.jittered_delay_after(1, 0.0), ms(50), "clamped up");
        assert_eq!(
            backoff.jittered_delay_after(1, 7.0),
            ms(100),
            "clamped down"
        );
        assert_eq!(backoff.jittered_delay_after(5, 1.0), Duration::from_secs(1));
    }

    #[test]
    fn a_jitter_factor_that_is_not_a_number_means_no_jitter() {
        let backoff = Backoff::new(ms(100), Duration::from_secs(1));
        for factor in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(backoff.jittered_delay_after(1, factor), ms(100), "{factor}");
        }
    }

    #[test]
    fn jitter_on_the_longest_delay_does_not_panic() {
        let backoff = Backoff::new(Duration::MAX, Duration::MAX);
        assert_eq!(backoff.jittered_delay_after(1, 1.0), Duration::MAX);
        assert!(backoff.jittered_delay_after(1, 0.5) < Duration::MAX);
    }

    #[test]
    fn the_counting_jittered_delay_counts_the_failure_too() {
        let mut backoff = Backoff::new(ms(100), Duration::from_secs(1));
        assert_eq!(backoff.next_jittered_delay(0.5), ms(50));
        assert_eq!(backoff.next_jittered_delay(1.0), ms(200));
        assert_eq!(backoff.failures(), 2);
    }
}
