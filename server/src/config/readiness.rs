//! The readiness group (`--help` heading "Readiness"): when `/readyz`
//! reports the server stuck — a worker whose write has not committed, or
//! received messages waiting too long for the ingest.

use std::time::Duration;

use super::{parse_duration, ConfigError};

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Readiness")]
pub struct ReadinessArgs {
    /// A worker (ingest, engine) whose write has not committed for this long
    /// — failing and retried, or hanging — makes `/readyz` fail.
    #[arg(long, env = "IDEM_STUCK_AFTER", default_value = "30s", value_parser = parse_duration)]
    pub stuck_after: Duration,

    /// `/readyz` fails while the oldest received message has waited longer
    /// than this for the ingest (the answer says how many wait, and since
    /// when).
    #[arg(long, env = "IDEM_READY_MAX_INTAKE_AGE", default_value = "30s", value_parser = parse_duration)]
    pub ready_max_intake_age: Duration,
}

/// The readiness group, validated.
#[derive(Debug, Clone, Copy)]
pub struct ReadinessSettings {
    /// At least 100 ms.
    pub stuck_after: Duration,
    pub max_intake_age: Duration,
}

impl ReadinessArgs {
    pub fn validate(&self) -> Result<ReadinessSettings, ConfigError> {
        if self.stuck_after < Duration::from_millis(100) {
            return Err(ConfigError::StuckAfter(self.stuck_after));
        }
        Ok(ReadinessSettings {
            stuck_after: self.stuck_after,
            max_intake_age: self.ready_max_intake_age,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    #[test]
    fn a_stuck_threshold_under_100ms_is_refused_naming_the_variable() {
        let mut config = Config::defaults();
        config.readiness.stuck_after = Duration::from_millis(99);
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_STUCK_AFTER"), "{err}");
        config.readiness.stuck_after = Duration::from_millis(100);
        let readiness = config.validate().unwrap().readiness;
        assert_eq!(readiness.stuck_after, Duration::from_millis(100));
        assert_eq!(readiness.max_intake_age, Duration::from_secs(30));
    }
}
