//! [`Generation`]: a device's desired generation, one type from the MQTT
//! payloads through the server's core and store to the API (`generation`
//! in desired and reported state, outcomes and history).
//!
//! It starts at 1 with the first desired spec and increases by one with each
//! change; 0 never names a stored desired state.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A desired generation; a JSON number on the wire.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct Generation(pub u64);

impl Generation {
    /// The generation of a device's first desired spec.
    pub const FIRST: Generation = Generation(1);

    pub fn get(self) -> u64 {
        self.0
    }

    /// The generation a change of the desired spec gives (saturating: the
    /// edges refuse generations past 2^63−1, so it never saturates there).
    pub fn next(self) -> Generation {
        Generation(self.0.saturating_add(1))
    }

    /// False only for 0, which never names a stored desired state.
    pub fn names_a_spec(self) -> bool {
        self.0 > 0
    }
}

impl From<u64> for Generation {
    fn from(n: u64) -> Self {
        Generation(n)
    }
}

impl From<Generation> for u64 {
    fn from(g: Generation) -> Self {
        g.0
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_is_a_plain_json_number() {
        assert_eq!(serde_json::to_string(&Generation(7)).unwrap(), "7");
        assert_eq!(
            serde_json::from_str::<Generation>("7").unwrap(),
            Generation(7)
        );
        assert!(serde_json::from_str::<Generation>("-1").is_err());
        assert!(serde_json::from_str::<Generation>("\"7\"").is_err());
    }

    #[test]
    fn generations_count_up_from_the_first_and_zero_names_no_spec() {
        assert_eq!(Generation::FIRST.next(), Generation(2));
        assert!(Generation::FIRST.names_a_spec());
        assert!(!Generation::default().names_a_spec());
        assert_eq!(Generation(u64::MAX).next(), Generation(u64::MAX));
    }
}
