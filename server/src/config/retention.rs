//! The retention group (`--help` heading "Retention"): how long completed
//! runs, attempt history and audit records are kept (the event log's
//! retention is in the events group). Validated into the limits the
//! periodic pruning takes.

use std::time::Duration;

use super::{parse_duration, ConfigError};

/// The configured limits.
#[derive(Debug, Clone, Copy)]
pub struct RunRetention {
    /// Completed runs that finished longer ago are deleted.
    pub max_age: Duration,
    /// Only the newest runs whose targets add up to this many are kept.
    pub max_targets: i64,
    /// Attempt history older than this is deleted.
    pub attempts_max_age: Duration,
    /// At most this many newest attempt rows are kept.
    pub attempts_max_count: i64,
    /// Audit records older than this are deleted.
    pub audit_max_age: Duration,
}

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Retention")]
pub struct RetentionArgs {
    /// Completed runs (with their per-device targets) older than this are
    /// pruned, e.g. `30d`.
    #[arg(long, env = "IDEM_RUN_RETENTION", default_value = "30d", value_parser = parse_duration)]
    pub run_retention: Duration,

    /// Only the newest completed runs whose targets add up to this many
    /// per-device rows are kept.
    #[arg(long, env = "IDEM_RUN_RETENTION_TARGETS", default_value_t = 1_000_000)]
    pub run_retention_targets: i64,

    /// Attempt history older than this is pruned.
    #[arg(long, env = "IDEM_ATTEMPT_RETENTION", default_value = "30d", value_parser = parse_duration)]
    pub attempt_retention: Duration,

    /// At most this many newest attempt-history rows are kept.
    #[arg(
        long,
        env = "IDEM_ATTEMPT_RETENTION_COUNT",
        default_value_t = 1_000_000
    )]
    pub attempt_retention_count: i64,

    /// Audit records older than this are pruned.
    #[arg(long, env = "IDEM_AUDIT_RETENTION", default_value = "90d", value_parser = parse_duration)]
    pub audit_retention: Duration,
}

impl RetentionArgs {
    pub fn validate(&self) -> Result<RunRetention, ConfigError> {
        if self.run_retention_targets < 1 {
            return Err(ConfigError::RunRetentionTargets(self.run_retention_targets));
        }
        if self.attempt_retention_count < 1 {
            return Err(ConfigError::AttemptRetentionCount(
                self.attempt_retention_count,
            ));
        }
        Ok(RunRetention {
            max_age: self.run_retention,
            max_targets: self.run_retention_targets,
            attempts_max_age: self.attempt_retention,
            attempts_max_count: self.attempt_retention_count,
            audit_max_age: self.audit_retention,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    #[test]
    fn retention_defaults_to_the_documented_values_and_refuses_keeping_nothing() {
        let retention = Config::defaults().validate().unwrap().retention;
        assert_eq!(retention.max_age, Duration::from_secs(30 * 86_400));
        assert_eq!(retention.max_targets, 1_000_000);
        assert_eq!(retention.attempts_max_age, Duration::from_secs(30 * 86_400));
        assert_eq!(retention.attempts_max_count, 1_000_000);
        assert_eq!(retention.audit_max_age, Duration::from_secs(90 * 86_400));

        let mut config = Config::defaults();
        config.retention.run_retention_targets = 0;
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_RUN_RETENTION_TARGETS"), "{err}");
        let mut config = Config::defaults();
        config.retention.attempt_retention_count = 0;
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_ATTEMPT_RETENTION_COUNT"), "{err}");
    }
}
