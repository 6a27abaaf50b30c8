//! The fleet group (`--help` heading "Fleet"): what the server shares with
//! its devices (the topic root and the spec budget), the instance name, and
//! whether unknown devices register themselves.

use idem_protocol::limits::{MAX_MAX_SPEC_BYTES, MIN_MAX_SPEC_BYTES};
use idem_protocol::{SpecBudget, TopicRoot, DEFAULT_MAX_SPEC_BYTES};

use std::time::Duration;

use super::{parse_duration, ConfigError};

/// Shortest and longest `--instance-lease`.
pub const INSTANCE_LEASE_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(600);

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Fleet")]
pub struct FleetArgs {
    /// Name of this server instance: CloudEvents `source` is `/idem/{instance}`
    /// and the MQTT client id is `idem-server:{instance}`.
    /// Two live processes never share a name: the name is claimed in the
    /// database at start-up and kept by a heartbeat.
    #[arg(long, env = "IDEM_INSTANCE", default_value = "idem-1")]
    pub instance: String,

    /// How long the instance name stays claimed without a heartbeat (beats
    /// every quarter of it), e.g. `10s` (1s to 10m). A process starting with
    /// a name whose holder stopped beating waits at most this long for the
    /// claim to go stale; one whose holder still beats refuses to start.
    #[arg(long, env = "IDEM_INSTANCE_LEASE", default_value = "10s", value_parser = parse_duration)]
    pub instance_lease: Duration,

    /// How often the instance catches up with the device rows other
    /// instances wrote when no notification woke it, e.g. `1s` (100ms to
    /// 10m). Its own writes catch up too, and the engine before any push.
    #[arg(long, env = "IDEM_FOLLOW_EVERY", default_value = "1s", value_parser = parse_duration)]
    pub follow_every: Duration,

    /// Wake on PostgreSQL's notification of another instance's device
    /// write (`LISTEN idem_devices`); off, only the catch-up every
    /// `--follow-every` and the instance's own writes follow them.
    #[arg(long, env = "IDEM_FOLLOW_NOTIFICATIONS", default_value_t = true, action = clap::ArgAction::Set)]
    pub follow_notifications: bool,

    /// Topic root shared with the devices.
    #[arg(long, env = "IDEM_TOPIC_ROOT", default_value = idem_protocol::DEFAULT_TOPIC_ROOT)]
    pub topic_root: String,

    /// The spec budget: the largest desired or reported spec, in canonical
    /// JSON bytes. The API refuses larger specs, reports may be up to
    /// `2 × budget + 8 KiB` raw, and the MQTT packet limits derive from it.
    #[arg(long, env = "IDEM_MAX_SPEC_BYTES", default_value_t = DEFAULT_MAX_SPEC_BYTES)]
    pub max_spec_bytes: usize,

    /// Accept reports from device ids that were never registered, registering them.
    #[arg(long, env = "IDEM_AUTO_REGISTER", default_value_t = false)]
    pub auto_register: bool,
}

/// The fleet group, validated.
#[derive(Debug, Clone)]
pub struct FleetSettings {
    /// 1-64 letters, digits, `-` or `_`.
    pub instance: String,
    /// The instance name's claim lasts this long without a heartbeat.
    pub instance_lease: Duration,
    /// The catch-up with other instances' device writes, at least this often.
    pub follow_every: Duration,
    /// Whether their notifications wake the catch-up.
    pub follow_notifications: bool,
    pub topic_root: TopicRoot,
    /// The one size budget every limit derives from.
    pub budget: SpecBudget,
    pub auto_register: bool,
}

impl FleetSettings {
    /// The CloudEvents `source` of this server's events.
    pub fn event_source(&self) -> String {
        format!("/idem/{}", self.instance)
    }
}

impl FleetArgs {
    pub fn validate(&self) -> Result<FleetSettings, ConfigError> {
        let topic_root = TopicRoot::new(self.topic_root.clone())
            .map_err(|_| ConfigError::TopicRoot(self.topic_root.clone()))?;
        let instance_ok = !self.instance.is_empty()
            && self.instance.len() <= 64
            && self
                .instance
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !instance_ok {
            return Err(ConfigError::Instance(self.instance.clone()));
        }
        if !INSTANCE_LEASE_RANGE.contains(&self.instance_lease) {
            return Err(ConfigError::InstanceLease(self.instance_lease));
        }
        if !(Duration::from_millis(100)..=Duration::from_secs(600)).contains(&self.follow_every) {
            return Err(ConfigError::FollowEvery(self.follow_every));
        }
        if !(MIN_MAX_SPEC_BYTES..=MAX_MAX_SPEC_BYTES).contains(&self.max_spec_bytes) {
            return Err(ConfigError::MaxSpec(self.max_spec_bytes));
        }
        Ok(FleetSettings {
            instance: self.instance.clone(),
            instance_lease: self.instance_lease,
            follow_every: self.follow_every,
            follow_notifications: self.follow_notifications,
            topic_root,
            budget: SpecBudget::new(self.max_spec_bytes),
            auto_register: self.auto_register,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::Config;

    #[test]
    fn an_instance_name_outside_the_alphabet_or_too_long_is_refused_naming_the_variable() {
        for bad in ["", "idem 1", "idem:1", &"x".repeat(65)] {
            let mut config = Config::defaults();
            config.fleet.instance = bad.to_owned();
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains("IDEM_INSTANCE"), "{bad:?}: {err}");
        }
        let mut config = Config::defaults();
        config.fleet.instance = "idem_2-b".into();
        let valid = config.validate().unwrap();
        assert_eq!(valid.fleet.event_source(), "/idem/idem_2-b");
    }

    #[test]
    fn a_spec_budget_outside_its_range_is_refused_naming_the_variable() {
        let mut config = Config::defaults();
        config.fleet.max_spec_bytes = 10;
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_MAX_SPEC_BYTES"), "{err}");
    }

    #[test]
    fn an_instance_lease_outside_one_second_to_ten_minutes_is_refused_naming_the_variable() {
        for bad in [Duration::from_millis(999), Duration::from_secs(601)] {
            let mut config = Config::defaults();
            config.fleet.instance_lease = bad;
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains("IDEM_INSTANCE_LEASE"), "{err}");
        }
        let config = Config::defaults();
        assert_eq!(
            config.validate().unwrap().fleet.instance_lease,
            Duration::from_secs(10)
        );
    }
}
