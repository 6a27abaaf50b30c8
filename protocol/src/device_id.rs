//! Device identifiers: the one validated type every topic and table key uses.
//!
//! Rule: `^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`. This excludes the MQTT
//! separators and wildcards (`/ + #`), `$`, NUL and anything non-ASCII, so an
//! id can always be placed in a topic level verbatim.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Longest allowed device id, in bytes.
pub const MAX_DEVICE_ID_LEN: usize = 128;

/// Ids that match the rule but name a topic level the protocol itself uses
/// (`{root}/events/...` carries the outcome events).
pub const RESERVED_DEVICE_IDS: [&str; 1] = ["events"];

/// [`DeviceId`]'s rules as a regular expression (ECMA-262, as
/// OpenAPI uses): a letter or digit, then letters, digits, `_`, `.`, `-`;
/// not a reserved id. Checked against the parser by a test.
pub const DEVICE_ID_PATTERN: &str = "^(?!events$)[A-Za-z0-9][A-Za-z0-9_.-]*$";

/// A device id that is known to satisfy the protocol's id rule.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId(String);

/// Why a string is not a valid device id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidDeviceId {
    #[error("device id is empty")]
    Empty,
    #[error("device id is {len} bytes long; the limit is {MAX_DEVICE_ID_LEN}")]
    TooLong { len: usize },
    #[error("device id must start with a letter or digit, not {0:?}")]
    BadFirstCharacter(char),
    #[error("device id contains {0:?}; allowed are letters, digits, '_', '.' and '-'")]
    BadCharacter(char),
    #[error("device id {0:?} is reserved by the protocol (its topics would overlap `{{root}}/events/#`)")]
    Reserved(&'static str),
}

impl DeviceId {
    /// Validates `raw` against the id rule.
    pub fn parse(raw: &str) -> Result<Self, InvalidDeviceId> {
        validate(raw)?;
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

fn validate(raw: &str) -> Result<(), InvalidDeviceId> {
    let mut chars = raw.chars();
    let first = chars.next().ok_or(InvalidDeviceId::Empty)?;
    if raw.len() > MAX_DEVICE_ID_LEN {
        return Err(InvalidDeviceId::TooLong { len: raw.len() });
    }
    if !first.is_ascii_alphanumeric() {
        return Err(InvalidDeviceId::BadFirstCharacter(first));
    }
    if let Some(bad) = chars.find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(InvalidDeviceId::BadCharacter(bad));
    }
    match RESERVED_DEVICE_IDS.iter().find(|r| **r == raw) {
        Some(reserved) => Err(InvalidDeviceId::Reserved(reserved)),
        None => Ok(()),
    }
}

/// In the OpenAPI document a device id is a string of the id rules.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for DeviceId {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::RefOr::T(schema())
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for DeviceId {}

/// The JSON Schema of a device id: these rules, for the OpenAPI document.
#[cfg(feature = "openapi")]
pub fn schema() -> utoipa::openapi::schema::Schema {
    utoipa::openapi::schema::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .min_length(Some(1))
        .max_length(Some(MAX_DEVICE_ID_LEN))
        .pattern(Some(DEVICE_ID_PATTERN))
        .description(Some(
            "a device id: a letter or digit, then letters, digits, '_', '.', '-'",
        ))
        .into()
}

impl TryFrom<String> for DeviceId {
    type Error = InvalidDeviceId;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        validate(&raw)?;
        Ok(Self(raw))
    }
}

impl std::str::FromStr for DeviceId {
    type Err = InvalidDeviceId;
    fn from_str(raw: &str) -> Result<Self, Self::Err> {
        Self::parse(raw)
    }
}

impl AsRef<str> for DeviceId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for DeviceId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceId({})", self.0)
    }
}

impl Serialize for DeviceId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for DeviceId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        DeviceId::try_from(raw).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-written matcher for [`DEVICE_ID_PATTERN`] (the protocol crate
    /// has no regex engine): the pattern's character classes, spelled out.
    fn matches_device_id_pattern(raw: &str) -> bool {
        let mut chars = raw.chars();
        let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
        first_ok
            && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
            && raw != "events"
    }

    #[test]
    fn the_device_id_pattern_says_what_the_parser_accepts() {
        assert!(DEVICE_ID_PATTERN.contains("[A-Za-z0-9][A-Za-z0-9_.-]*"));
        for reserved in RESERVED_DEVICE_IDS {
            assert!(
                DEVICE_ID_PATTERN.contains(&format!("(?!{reserved}$)")),
                "{reserved}"
            );
        }
        let samples = [
            "a", "A9", "0", "pump-7", "x.y_z", "events", "eventsx", "-a", "_a", ".a", "a b", "a/b",
            "ä", "a+", "", "Z-", "9.",
        ];
        for raw in samples {
            let short_enough = raw.len() <= MAX_DEVICE_ID_LEN;
            assert_eq!(
                DeviceId::parse(raw).is_ok(),
                matches_device_id_pattern(raw) && short_enough,
                "{raw:?}"
            );
        }
    }

    #[test]
    fn ordinary_ids_are_accepted() {
        for id in ["a", "sensor-0001", "Pump_7.rev2", "0", &"x".repeat(128)] {
            assert!(DeviceId::parse(id).is_ok(), "{id} should be valid");
        }
    }

    #[test]
    fn ids_that_would_break_a_topic_are_rejected() {
        assert_eq!(DeviceId::parse(""), Err(InvalidDeviceId::Empty));
        assert_eq!(
            DeviceId::parse("a/b"),
            Err(InvalidDeviceId::BadCharacter('/'))
        );
        assert_eq!(
            DeviceId::parse("a+"),
            Err(InvalidDeviceId::BadCharacter('+'))
        );
        assert_eq!(
            DeviceId::parse("a#"),
            Err(InvalidDeviceId::BadCharacter('#'))
        );
        assert_eq!(
            DeviceId::parse("$SYS"),
            Err(InvalidDeviceId::BadFirstCharacter('$'))
        );
        assert_eq!(
            DeviceId::parse("a\0b"),
            Err(InvalidDeviceId::BadCharacter('\0'))
        );
        assert_eq!(
            DeviceId::parse("-lead"),
            Err(InvalidDeviceId::BadFirstCharacter('-'))
        );
        assert_eq!(
            DeviceId::parse("caf\u{e9}"),
            Err(InvalidDeviceId::BadCharacter('\u{e9}'))
        );
        assert_eq!(
            DeviceId::parse(&"x".repeat(129)),
            Err(InvalidDeviceId::TooLong { len: 129 })
        );
    }

    #[test]
    fn the_events_level_is_reserved() {
        assert_eq!(
            DeviceId::parse("events"),
            Err(InvalidDeviceId::Reserved("events"))
        );
        assert!(DeviceId::parse("Events").is_ok());
        assert!(DeviceId::parse("events-1").is_ok());
    }

    #[test]
    fn an_id_shows_its_text_through_every_view() {
        let id = DeviceId::parse("pump-7").unwrap();
        let as_ref: &str = id.as_ref();
        assert_eq!(as_ref, "pump-7");
        assert_eq!(id.to_string(), "pump-7");
        assert_eq!(format!("{id:?}"), "DeviceId(pump-7)");
        // `Borrow<str>` lets maps keyed by ids be queried with plain text.
        let known: std::collections::HashSet<DeviceId> = [id.clone()].into();
        assert!(known.contains("pump-7"));
        assert!(!known.contains("pump-8"));
        assert_eq!(id.into_string(), "pump-7");
    }

    #[test]
    fn deserializing_an_invalid_id_fails() {
        assert!(serde_json::from_str::<DeviceId>("\"a/b\"").is_err());
        assert_eq!(
            serde_json::from_str::<DeviceId>("\"ok-1\"")
                .unwrap()
                .as_str(),
            "ok-1"
        );
    }
}
