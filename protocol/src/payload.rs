//! Payload types of the v1 topics and their decoding rules.
//!
//! Decoding is strict about structure (unknown fields are ignored, wrong types
//! are not) and bounded in size; it never panics on any input.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Default upper bound for a report payload, in bytes.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 64 * 1024;

/// `{root}/{id}/reported`: what the device actually runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reported {
    /// Per-device, strictly increasing report counter; a report whose `seq` is
    /// not above the last stored one is a duplicate or stale and changes nothing.
    pub seq: u64,
    /// The desired generation the device last applied; absent if none yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// The configuration the device is running right now.
    pub spec: Value,
    /// The device's own verdict on how it runs with that configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<Health>,
    /// Set when the device refused a pushed generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Rejection>,
}

/// A device's refusal of one pushed generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// The desired generation that was refused.
    pub generation: u64,
    /// Human-readable reason, shown to operators as is.
    pub message: String,
}

/// Device-reported health after applying (or keeping) a configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Healthy,
    Degraded,
    Unhealthy,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Degraded => "degraded",
            Health::Unhealthy => "unhealthy",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        match raw {
            "healthy" => Some(Health::Healthy),
            "degraded" => Some(Health::Degraded),
            "unhealthy" => Some(Health::Unhealthy),
            _ => None,
        }
    }
}

/// `{root}/{id}/desired`: the configuration the device should run (retained).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Desired {
    /// Increases every time the operator changes this device's desired spec.
    pub generation: u64,
    pub spec: Value,
}

/// `{root}/{id}/status`: connection state, retained; `offline` is the LWT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    Online,
    Offline,
}

impl Status {
    pub fn as_payload(self) -> &'static [u8] {
        match self {
            Status::Online => b"online",
            Status::Offline => b"offline",
        }
    }

    pub fn decode(payload: &[u8]) -> Result<Self, DecodeError> {
        match payload {
            b"online" => Ok(Status::Online),
            b"offline" => Ok(Status::Offline),
            _ => Err(DecodeError::InvalidStatus),
        }
    }
}

/// The body of a `{root}/{id}/get` request. Devices ignore it; it exists so
/// the message is valid JSON for tools that expect JSON everywhere.
pub const GET_PAYLOAD: &[u8] = b"{}";

/// Why a payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload is {len} bytes; the limit is {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error("payload is not valid JSON of the expected shape: {0}")]
    Malformed(String),
    #[error("status payload must be exactly `online` or `offline`")]
    InvalidStatus,
}

impl DecodeError {
    /// Stable, low-cardinality name of the reason, for counters and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::TooLarge { .. } => "oversized",
            DecodeError::Malformed(_) => "malformed",
            DecodeError::InvalidStatus => "invalid_status",
        }
    }
}

impl Reported {
    /// Decodes a report, refusing payloads over `limit` bytes before parsing.
    pub fn decode(payload: &[u8], limit: usize) -> Result<Self, DecodeError> {
        decode_json(payload, limit)
    }

    pub fn encode(&self) -> Vec<u8> {
        encode_json(self)
    }
}

impl Desired {
    /// Decodes a desired message, refusing payloads over `limit` bytes.
    pub fn decode(payload: &[u8], limit: usize) -> Result<Self, DecodeError> {
        decode_json(payload, limit)
    }

    pub fn encode(&self) -> Vec<u8> {
        encode_json(self)
    }
}

fn decode_json<T: serde::de::DeserializeOwned>(
    payload: &[u8],
    limit: usize,
) -> Result<T, DecodeError> {
    if payload.len() > limit {
        return Err(DecodeError::TooLarge {
            len: payload.len(),
            limit,
        });
    }
    serde_json::from_slice(payload).map_err(|e| DecodeError::Malformed(e.to_string()))
}

fn encode_json<T: Serialize>(value: &T) -> Vec<u8> {
    // Both payload types hold only strings, integers and serde_json::Values,
    // whose serialisation cannot fail.
    serde_json::to_vec(value).unwrap_or_else(|_| unreachable!("payloads always serialise"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_minimal_report_decodes() {
        let r = Reported::decode(br#"{"seq":3,"spec":{"fw":"1.2"}}"#, 1024).unwrap();
        assert_eq!(r.seq, 3);
        assert_eq!(r.generation, None);
        assert_eq!(r.spec, json!({"fw": "1.2"}));
        assert_eq!(r.error, None);
    }

    #[test]
    fn a_rejecting_report_round_trips() {
        let r = Reported {
            seq: 9,
            generation: Some(1),
            spec: json!({"fw": "1.0"}),
            health: Some(Health::Degraded),
            error: Some(Rejection {
                generation: 2,
                message: "flash full".into(),
            }),
        };
        assert_eq!(Reported::decode(&r.encode(), 1024).unwrap(), r);
    }

    #[test]
    fn oversized_payloads_are_refused_before_parsing() {
        let err = Reported::decode(&[b' '; 100], 99).unwrap_err();
        assert_eq!(
            err,
            DecodeError::TooLarge {
                len: 100,
                limit: 99
            }
        );
        assert_eq!(err.reason(), "oversized");
    }

    #[test]
    fn malformed_and_mistyped_reports_are_refused() {
        for bad in [
            &b"{not json"[..],
            br#"{"spec":{}}"#,
            br#"{"seq":-1,"spec":{}}"#,
            br#"{"seq":"1","spec":{}}"#,
            br#"{"seq":1,"spec":{},"health":"fine"}"#,
            b"\xff\xfe",
        ] {
            let err = Reported::decode(bad, 1024).unwrap_err();
            assert_eq!(err.reason(), "malformed", "{bad:?}");
        }
    }

    #[test]
    fn status_accepts_only_the_two_words() {
        assert_eq!(Status::decode(b"online"), Ok(Status::Online));
        assert_eq!(Status::decode(b"offline"), Ok(Status::Offline));
        assert_eq!(Status::decode(b"ONLINE"), Err(DecodeError::InvalidStatus));
    }
}
