//! The device status the server stores and shows: `devices.status`, `status`
//! in `GET /v1/devices`, the keys of `by_status` in `GET /v1/fleet` and the
//! label values of `idem_devices{status}`.
//!
//! Names only; which outcome leaves which status is the server's policy.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Device status, as stored and shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DeviceStatus {
    #[default]
    Unknown,
    Converged,
    Drifted,
    Provisioning,
    Failed,
    Offline,
    Quarantined,
}

impl DeviceStatus {
    pub const ALL: [DeviceStatus; 7] = [
        DeviceStatus::Unknown,
        DeviceStatus::Converged,
        DeviceStatus::Drifted,
        DeviceStatus::Provisioning,
        DeviceStatus::Failed,
        DeviceStatus::Offline,
        DeviceStatus::Quarantined,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeviceStatus::Unknown => "unknown",
            DeviceStatus::Converged => "converged",
            DeviceStatus::Drifted => "drifted",
            DeviceStatus::Provisioning => "provisioning",
            DeviceStatus::Failed => "failed",
            DeviceStatus::Offline => "offline",
            DeviceStatus::Quarantined => "quarantined",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        DeviceStatus::ALL.into_iter().find(|s| s.as_str() == raw)
    }
}

impl fmt::Display for DeviceStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_through_their_names() {
        for s in DeviceStatus::ALL {
            assert_eq!(DeviceStatus::parse(s.as_str()), Some(s));
            assert_eq!(s.to_string(), s.as_str());
        }
        assert_eq!(DeviceStatus::parse("online"), None);
    }

    #[test]
    fn statuses_are_json_strings_with_their_names() {
        for s in DeviceStatus::ALL {
            let json = serde_json::to_value(s).unwrap();
            assert_eq!(json, serde_json::Value::from(s.as_str()));
            assert_eq!(serde_json::from_value::<DeviceStatus>(json).unwrap(), s);
        }
    }
}
