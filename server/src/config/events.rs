//! The events group (`--help` heading "Events"): whether committed outcome
//! events are also published over MQTT, at which QoS, and how long the
//! event log keeps them. Validated into what the event relay takes.

use std::time::Duration;

use rumqttc::QoS;

use super::{parse_duration, ConfigError};

/// Retention of the event log.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    pub max_age: Duration,
    pub max_count: i64,
}

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Events")]
pub struct EventsArgs {
    /// Publish every committed outcome event to `{root}/events/{type}/{subject}`.
    #[arg(long, env = "IDEM_MQTT_EVENTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub mqtt_events: bool,

    /// QoS of the event publishes (0 or 1).
    #[arg(long, env = "IDEM_MQTT_EVENTS_QOS", default_value_t = 0)]
    pub mqtt_events_qos: u8,

    /// Events older than this are pruned from the event log (once relayed), e.g. `7d`.
    #[arg(long, env = "IDEM_EVENT_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub event_retention: Duration,

    /// At most this many newest events are kept in the event log.
    #[arg(long, env = "IDEM_EVENT_RETENTION_COUNT", default_value_t = 1_000_000)]
    pub event_retention_count: i64,
}

/// The events group, validated.
#[derive(Debug, Clone, Copy)]
pub struct EventsSettings {
    /// The QoS events are published over MQTT with; `None`: they are not.
    pub mqtt: Option<QoS>,
    pub retention: Retention,
}

impl EventsArgs {
    pub fn validate(&self) -> Result<EventsSettings, ConfigError> {
        let qos = match self.mqtt_events_qos {
            0 => QoS::AtMostOnce,
            1 => QoS::AtLeastOnce,
            other => return Err(ConfigError::EventsQos(other)),
        };
        if self.event_retention_count < 1 {
            return Err(ConfigError::RetentionCount(self.event_retention_count));
        }
        Ok(EventsSettings {
            mqtt: self.mqtt_events.then_some(qos),
            retention: Retention {
                max_age: self.event_retention,
                max_count: self.event_retention_count,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    #[test]
    fn events_go_over_mqtt_at_the_configured_qos_unless_switched_off() {
        let mut config = Config::defaults();
        assert_eq!(
            config.validate().unwrap().events.mqtt,
            Some(QoS::AtMostOnce)
        );
        config.events.mqtt_events_qos = 1;
        assert_eq!(
            config.validate().unwrap().events.mqtt,
            Some(QoS::AtLeastOnce)
        );
        config.events.mqtt_events = false;
        assert_eq!(config.validate().unwrap().events.mqtt, None);
        config.events.mqtt_events_qos = 2;
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_MQTT_EVENTS_QOS"), "{err}");
    }

    #[test]
    fn an_event_log_kept_to_no_events_is_refused_naming_the_variable() {
        let mut config = Config::defaults();
        config.events.event_retention_count = 0;
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_EVENT_RETENTION_COUNT"), "{err}");
    }
}
