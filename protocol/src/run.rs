//! A run's vocabulary: why it was started ([`Trigger`], `trigger` in the API,
//! in the `io.idem.run.*` events and in `runs.trigger`) and how far it is
//! ([`RunState`], `state` in the API and `runs.state`).
//!
//! Names only; when the server starts which run is its policy.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a run was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// An operator changed desired state.
    Desired,
    /// An operator asked for a re-check.
    Manual,
    /// The server started and checked the fleet.
    Startup,
    /// The periodic re-check.
    Resync,
    /// Converged devices reported a different spec.
    Drift,
    /// Devices that were offline came back.
    Reconnect,
    /// An operator released quarantined devices.
    Retry,
}

impl Trigger {
    pub const ALL: [Trigger; 7] = [
        Trigger::Desired,
        Trigger::Manual,
        Trigger::Startup,
        Trigger::Resync,
        Trigger::Drift,
        Trigger::Reconnect,
        Trigger::Retry,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Desired => "desired",
            Trigger::Manual => "manual",
            Trigger::Startup => "startup",
            Trigger::Resync => "resync",
            Trigger::Drift => "drift",
            Trigger::Reconnect => "reconnect",
            Trigger::Retry => "retry",
        }
    }

    /// The trigger named `raw` (`None` for a word this version does not know).
    pub fn parse(raw: &str) -> Option<Self> {
        Trigger::ALL.into_iter().find(|t| t.as_str() == raw)
    }
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a run still has undecided targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Running,
    /// Every target has its outcome.
    Completed,
}

impl RunState {
    pub const ALL: [RunState; 2] = [RunState::Running, RunState::Completed];

    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::Completed => "completed",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        RunState::ALL.into_iter().find(|s| s.as_str() == raw)
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_trigger_parses_back_from_its_name() {
        for trigger in Trigger::ALL {
            assert_eq!(Trigger::parse(trigger.as_str()), Some(trigger));
            assert_eq!(trigger.to_string(), trigger.as_str());
        }
        assert_eq!(Trigger::parse("sometimes"), None);
    }

    #[test]
    fn triggers_are_json_strings_with_their_names() {
        for trigger in Trigger::ALL {
            let json = serde_json::to_value(trigger).unwrap();
            assert_eq!(json, serde_json::Value::from(trigger.as_str()));
            assert_eq!(serde_json::from_value::<Trigger>(json).unwrap(), trigger);
        }
    }

    #[test]
    fn run_states_round_trip_through_their_names_and_json() {
        for state in RunState::ALL {
            assert_eq!(RunState::parse(state.as_str()), Some(state));
            let json = serde_json::to_value(state).unwrap();
            assert_eq!(json, serde_json::Value::from(state.as_str()));
            assert_eq!(serde_json::from_value::<RunState>(json).unwrap(), state);
        }
        assert_eq!(RunState::parse("paused"), None);
    }
}
