//! [`Generation`]: a device's desired generation, as the API shows it
//! (`generation` in desired and reported state, outcomes and history).
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
    pub fn get(self) -> u64 {
        self.0
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
}
