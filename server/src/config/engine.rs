//! The engine group (`--help` heading "Engine"): how the engine pushes
//! (timeout, pace, in-flight cap), retries (attempts, backoff), batches
//! triggers (debounce), resyncs, starts up, asks silent devices for their
//! report, and rechecks the fleet when the broker may have dropped
//! messages. Validated into the machine's `EngineSettings`, with every
//! "`0` = off" flag as `None`.

use std::num::NonZeroU32;
use std::time::Duration;

use super::{parse_duration, parse_duration_or_off, parse_rate_or_off, ConfigError};
use crate::reconcile::machine::EngineSettings;
use crate::reconcile::policy::RetryPolicy;

// The "`0` = off" fields are written `std::option::Option`: clap then takes
// the type as one value (`value_parser` reads `0` as `None`) instead of
// making the flag optional.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Engine")]
pub struct EngineArgs {
    /// How long a device has to confirm a push (or answer a `get`) before it
    /// is `failed` with a timeout, e.g. `30s`, `500ms`, `2m`.
    #[arg(long, env = "IDEM_PUSH_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub push_timeout: Duration,

    /// Attempts per device before it is quarantined (1 = no retries).
    #[arg(long, env = "IDEM_MAX_ATTEMPTS", default_value_t = 5)]
    pub max_attempts: u32,

    /// First retry delay after a failed attempt; doubles per failure (with jitter).
    #[arg(long, env = "IDEM_RETRY_BACKOFF", default_value = "2s", value_parser = parse_duration)]
    pub retry_backoff: Duration,

    /// Longest retry delay.
    #[arg(long, env = "IDEM_RETRY_BACKOFF_MAX", default_value = "5m", value_parser = parse_duration)]
    pub retry_backoff_max: Duration,

    /// Pushes per second across the fleet (0 = unlimited).
    #[arg(long, env = "IDEM_PUSH_RATE", default_value = "5000", value_parser = parse_rate_or_off)]
    pub push_rate: std::option::Option<NonZeroU32>,

    /// Pushes awaiting device confirmation at once.
    #[arg(long, env = "IDEM_MAX_IN_FLIGHT", default_value_t = 5_000)]
    pub max_in_flight: usize,

    /// Drift and reconnect triggers arriving within this window become one run.
    #[arg(long, env = "IDEM_DEBOUNCE", default_value = "1s", value_parser = parse_duration)]
    pub debounce: Duration,

    /// Periodic re-check of every device (0 = off).
    #[arg(long, env = "IDEM_RESYNC_INTERVAL", default_value = "5m", value_parser = parse_duration_or_off)]
    pub resync_interval: std::option::Option<Duration>,

    /// At resync, devices whose last report is older than this are asked to report.
    #[arg(long, env = "IDEM_STALE_AFTER", default_value = "5m", value_parser = parse_duration)]
    pub stale_after: Duration,

    /// Run a full reconcile of every device with desired state at start-up.
    #[arg(long, env = "IDEM_STARTUP_RECONCILE", default_value_t = true, action = clap::ArgAction::Set)]
    pub startup_reconcile: bool,

    /// A device that comes online and sends no report for this long is
    /// asked for one (its first report, or a newer one, may have been
    /// dropped by the broker); `0` = never.
    #[arg(long, env = "IDEM_MISSING_REPORT_AFTER", default_value = "5s", value_parser = parse_duration_or_off)]
    pub missing_report_after: std::option::Option<Duration>,

    /// Report requests per second when the server rechecks the fleet
    /// because the broker may have dropped messages for it (its dropped
    /// counter rose, the session came back empty or after a long absence,
    /// or the ingest was held longer than `--recheck-after-stall`); `0` =
    /// no rechecks.
    #[arg(long, env = "IDEM_RECHECK_RATE", default_value = "1000", value_parser = parse_rate_or_off)]
    pub recheck_rate: std::option::Option<NonZeroU32>,

    /// An ingest write held (by locks or failures) at least this long
    /// starts a recheck once it commits: the broker may have dropped what
    /// it could not deliver meanwhile.
    #[arg(long, env = "IDEM_RECHECK_AFTER_STALL", default_value = "10s", value_parser = parse_duration)]
    pub recheck_after_stall: Duration,
}

/// The engine group, validated.
#[derive(Debug, Clone)]
pub struct ReconcileSettings {
    /// What the engine's state machine runs with.
    pub machine: EngineSettings,
    /// Reconcile every device with desired state at start-up.
    pub startup_reconcile: bool,
    /// An ingest write held this long starts a recheck (the ingest's setting).
    pub recheck_after_stall: Duration,
}

impl EngineArgs {
    pub fn validate(&self) -> Result<ReconcileSettings, ConfigError> {
        if self.push_timeout < Duration::from_millis(10) {
            return Err(ConfigError::PushTimeout(self.push_timeout));
        }
        if self.max_attempts < 1 {
            return Err(ConfigError::MaxAttempts(self.max_attempts));
        }
        if self.max_in_flight < 1 {
            return Err(ConfigError::MaxInFlight(self.max_in_flight));
        }
        if self.retry_backoff_max < self.retry_backoff {
            return Err(ConfigError::Backoff {
                base: self.retry_backoff,
                max: self.retry_backoff_max,
            });
        }
        Ok(ReconcileSettings {
            machine: EngineSettings {
                push_timeout: self.push_timeout,
                retry: RetryPolicy {
                    max_attempts: self.max_attempts,
                    base: self.retry_backoff,
                    cap: self.retry_backoff_max,
                },
                push_rate: self.push_rate,
                max_in_flight: self.max_in_flight,
                debounce: self.debounce,
                resync_interval: self.resync_interval,
                stale_after: self.stale_after,
                missing_report_after: self.missing_report_after,
                recheck_rate: self.recheck_rate,
            },
            startup_reconcile: self.startup_reconcile,
            recheck_after_stall: self.recheck_after_stall,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    fn parse(args: &[&str]) -> EngineSettings {
        let argv = std::iter::once("idem-server").chain(args.iter().copied());
        let config = <Config as clap::Parser>::try_parse_from(argv).unwrap();
        config.validate().unwrap().engine.machine
    }

    #[test]
    fn the_engine_defaults_to_the_documented_values() {
        let machine = parse(&[]);
        assert_eq!(machine.push_timeout, Duration::from_secs(30));
        assert_eq!(
            machine.retry,
            RetryPolicy {
                max_attempts: 5,
                base: Duration::from_secs(2),
                cap: Duration::from_secs(300),
            }
        );
        assert_eq!(machine.push_rate, NonZeroU32::new(5_000));
        assert_eq!(machine.max_in_flight, 5_000);
        assert_eq!(machine.debounce, Duration::from_secs(1));
        assert_eq!(machine.resync_interval, Some(Duration::from_secs(300)));
        assert_eq!(machine.stale_after, Duration::from_secs(300));
        assert_eq!(machine.missing_report_after, Some(Duration::from_secs(5)));
        assert_eq!(machine.recheck_rate, NonZeroU32::new(1_000));
    }

    #[test]
    fn zero_turns_the_push_pace_resync_silence_check_and_rechecks_off() {
        let machine = parse(&[
            "--push-rate",
            "0",
            "--resync-interval",
            "0",
            "--missing-report-after",
            "0s",
            "--recheck-rate",
            "0",
        ]);
        assert_eq!(machine.push_rate, None);
        assert_eq!(machine.resync_interval, None);
        assert_eq!(machine.missing_report_after, None);
        assert_eq!(machine.recheck_rate, None);
        let machine = parse(&["--push-rate", "7", "--resync-interval", "90s"]);
        assert_eq!(machine.push_rate, NonZeroU32::new(7));
        assert_eq!(machine.resync_interval, Some(Duration::from_secs(90)));
    }

    #[test]
    fn a_flag_that_is_not_a_rate_or_a_duration_is_refused_naming_the_flag() {
        let argv = ["idem-server", "--push-rate", "fast"];
        let err = <Config as clap::Parser>::try_parse_from(argv)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--push-rate") && err.contains("0 = off"),
            "{err}"
        );
        let argv = ["idem-server", "--resync-interval", "999999999999999999d"];
        let err = <Config as clap::Parser>::try_parse_from(argv)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--resync-interval") && err.contains("too long"),
            "{err}"
        );
    }

    #[test]
    fn engine_values_out_of_range_fail_with_a_message_naming_the_variable() {
        type Change = fn(&mut EngineArgs);
        let cases: [(Change, &str); 4] = [
            (
                |e| e.push_timeout = Duration::from_millis(9),
                "IDEM_PUSH_TIMEOUT",
            ),
            (|e| e.max_attempts = 0, "IDEM_MAX_ATTEMPTS"),
            (|e| e.max_in_flight = 0, "IDEM_MAX_IN_FLIGHT"),
            (
                |e| e.retry_backoff_max = Duration::from_secs(1),
                "IDEM_RETRY_BACKOFF_MAX",
            ),
        ];
        for (change, variable) in cases {
            let mut config = Config::defaults();
            change(&mut config.engine);
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(variable), "{variable}: {err}");
        }
    }
}
