//! The changes group (`--help` heading "Changes"): how long a plan
//! (`POST /v1/plans`) can be applied, how many the server keeps, and the
//! longest drift exemption (`POST /v1/exemptions`), and whether every
//! desired change needs a second operator's approval.

use std::time::Duration;

use super::{parse_duration, ConfigError};

/// Plans in use (open, or being applied) the server keeps at most, of all
/// operators together (each holds one entry per targeted device).
pub const MAX_PLANS_KEPT: usize = 32;

/// Plans in use one operator token keeps at most: a new one beyond is
/// refused until one of its own is applied or expires, and never makes
/// room by forgetting another operator's.
pub const MAX_PLANS_PER_AUTHOR: usize = 8;

/// Plan contents an instance holds in memory for reading their pages
/// (each an entry per targeted device); the rest are read from PostgreSQL.
pub const PLAN_CONTENTS_CACHED: usize = 4;

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Changes")]
pub struct ChangesArgs {
    /// How long a plan can be applied after it was made, e.g. `1h`, `15m`
    /// (at least 1s, at most 7d). Applying a later one is refused as
    /// expired: re-plan.
    #[arg(long, env = "IDEM_PLAN_TTL", default_value = "1h", value_parser = parse_duration)]
    pub plan_ttl: Duration,

    /// The longest drift exemption an operator may ask for, e.g. `30d`
    /// (at least 1s, at most 365d).
    #[arg(long, env = "IDEM_EXEMPTION_MAX", default_value = "30d", value_parser = parse_duration)]
    pub exemption_max: Duration,

    /// Every desired change needs approval: it is applied only through a
    /// plan (`POST /v1/plans`) that a token other than its author's
    /// approved (`POST /v1/plans/{id}/approve`). Without it, only changes
    /// to devices an approval policy covers do (`POST /v1/approval-policies`).
    #[arg(long, env = "IDEM_REQUIRE_APPROVAL", default_value_t = false)]
    pub require_approval: bool,
}

/// The changes group, validated.
#[derive(Debug, Clone, Copy)]
pub struct ChangesSettings {
    pub plan_ttl: Duration,
    pub exemption_max: Duration,
    pub require_approval: bool,
}

impl ChangesArgs {
    pub fn validate(&self) -> Result<ChangesSettings, ConfigError> {
        let allowed = Duration::from_secs(1)..=Duration::from_secs(7 * 24 * 3600);
        if !allowed.contains(&self.plan_ttl) {
            return Err(ConfigError::PlanTtl(self.plan_ttl));
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(365 * 24 * 3600))
            .contains(&self.exemption_max)
        {
            return Err(ConfigError::ExemptionMax(self.exemption_max));
        }
        Ok(ChangesSettings {
            plan_ttl: self.plan_ttl,
            exemption_max: self.exemption_max,
            require_approval: self.require_approval,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;
    use clap::Parser;

    #[test]
    fn plans_can_be_applied_for_an_hour_unless_configured_otherwise() {
        let config = Config::defaults().validate().unwrap();
        assert_eq!(config.changes.plan_ttl, Duration::from_secs(3600));
        let config = Config::try_parse_from(["idem-server", "--plan-ttl", "15m"]).unwrap();
        assert_eq!(
            config.validate().unwrap().changes.plan_ttl,
            Duration::from_secs(900)
        );
    }

    #[test]
    fn exemptions_last_at_most_thirty_days_unless_configured_otherwise() {
        let config = Config::defaults().validate().unwrap();
        assert_eq!(
            config.changes.exemption_max,
            Duration::from_secs(30 * 24 * 3600)
        );
        let config = Config::try_parse_from(["idem-server", "--exemption-max", "400d"]).unwrap();
        let error = config.validate().unwrap_err().to_string();
        assert!(
            error.contains("IDEM_EXEMPTION_MAX / --exemption-max"),
            "{error}"
        );
    }

    #[test]
    fn a_plan_lifetime_outside_a_second_to_a_week_is_refused_naming_the_variable() {
        for ttl in ["500ms", "8d"] {
            let config = Config::try_parse_from(["idem-server", "--plan-ttl", ttl]).unwrap();
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains("IDEM_PLAN_TTL / --plan-ttl"), "{error}");
        }
    }
}
