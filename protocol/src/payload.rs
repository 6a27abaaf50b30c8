//! Payload types of the v1 topics and their decoding rules.
//!
//! Decoding is strict about structure (a report is a JSON object; unknown
//! fields are ignored, wrong types are not), bounded in size by the spec
//! budget, and refuses every value the server could not store (NUL in a
//! string, counters beyond a signed 64-bit integer). It never panics on any
//! input.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::generation::Generation;
use crate::limits::{nul_path, storable_text, SpecBudget, MAX_COUNTER, MAX_ERROR_MESSAGE_BYTES};

/// `{root}/{id}/reported`: what the device actually runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reported {
    /// Per-device, strictly increasing report counter; a report whose `seq` is
    /// not above the last stored one is a duplicate or stale and changes nothing.
    pub seq: u64,
    /// The desired generation the device last applied; absent if none yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<Generation>,
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
    pub generation: Generation,
    /// Human-readable reason, shown to operators as is.
    pub message: String,
}

/// Device-reported health after applying (or keeping) a configuration.
///
/// A report whose `health` is not one of the three words is kept, with its
/// health recorded as `Unknown` (a newer firmware's vocabulary must not cost
/// the server the spec it reported).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Healthy,
    Degraded,
    Unhealthy,
    /// The device sent a health value the protocol does not define.
    Unknown,
}

impl Health {
    pub const ALL: [Health; 4] = [
        Health::Healthy,
        Health::Degraded,
        Health::Unhealthy,
        Health::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Degraded => "degraded",
            Health::Unhealthy => "unhealthy",
            Health::Unknown => "unknown",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        Health::ALL.into_iter().find(|h| h.as_str() == raw)
    }
}

impl<'de> Deserialize<'de> for Health {
    /// Any value but the three protocol words (and `null`, handled by
    /// `Option`) becomes [`Health::Unknown`].
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        Ok(match value.as_str().and_then(Health::parse) {
            Some(Health::Unknown) | None => Health::Unknown,
            Some(known) => known,
        })
    }
}

/// `{root}/{id}/desired`: the configuration the device should run (retained).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Desired {
    /// Increases every time the operator changes this device's desired spec.
    pub generation: Generation,
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
    #[error("spec is {bytes} bytes in canonical form; the limit is {limit}")]
    SpecTooLarge { bytes: usize, limit: usize },
    #[error("payload is not valid JSON of the expected shape: {0}")]
    Malformed(String),
    #[error("spec holds a NUL character (\\u0000) at {path}, which cannot be stored")]
    Nul { path: String },
    #[error("status payload must be exactly `online` or `offline`")]
    InvalidStatus,
}

impl DecodeError {
    /// Stable, low-cardinality name of the reason, for counters and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::TooLarge { .. } | DecodeError::SpecTooLarge { .. } => "oversized",
            DecodeError::Malformed(_) => "malformed",
            DecodeError::Nul { .. } => "nul_character",
            DecodeError::InvalidStatus => "invalid_status",
        }
    }
}

impl Reported {
    /// Decodes a report under `budget`: the raw size is checked before
    /// parsing ([`SpecBudget::max_report_bytes`]), then the shape (a JSON
    /// object), then the values: `seq`, `generation` and `error.generation`
    /// at most 2^63−1, no NUL in the spec, the spec within the budget in
    /// canonical form. `error.message` is kept storable (NUL replaced, cut
    /// to 1 KiB) rather than costing the report.
    pub fn decode(payload: &[u8], budget: SpecBudget) -> Result<Self, DecodeError> {
        Self::decode_with_digest(payload, budget).map(|(report, _)| report)
    }

    /// [`Reported::decode`], also returning the spec's digest: the canonical
    /// form is built once for both the size check and the digest.
    pub fn decode_with_digest(
        payload: &[u8],
        budget: SpecBudget,
    ) -> Result<(Self, crate::SpecDigest), DecodeError> {
        check_size(payload, budget.max_report_bytes())?;
        require_object(payload)?;
        let mut report: Reported =
            serde_json::from_slice(payload).map_err(|e| DecodeError::Malformed(e.to_string()))?;
        check_counter("seq", Some(report.seq))?;
        check_counter("generation", report.generation.map(Generation::get))?;
        check_counter(
            "error.generation",
            report.error.as_ref().map(|e| e.generation.get()),
        )?;
        if let Some(path) = nul_path(&report.spec) {
            return Err(DecodeError::Nul { path });
        }
        let (digest, bytes) = crate::SpecDigest::of_with_len(&report.spec);
        if bytes > budget.max_spec_bytes() {
            return Err(DecodeError::SpecTooLarge {
                bytes,
                limit: budget.max_spec_bytes(),
            });
        }
        if let Some(error) = &mut report.error {
            error.message = storable_text(&error.message, MAX_ERROR_MESSAGE_BYTES);
        }
        Ok((report, digest))
    }

    pub fn encode(&self) -> Vec<u8> {
        encode_json(self)
    }
}

impl Desired {
    /// Decodes a desired message (a JSON object) of at most
    /// `budget.max_report_bytes()` bytes — generous on purpose: a device
    /// must not refuse what a server with a larger budget sends.
    pub fn decode(payload: &[u8], budget: SpecBudget) -> Result<Self, DecodeError> {
        check_size(payload, budget.max_report_bytes())?;
        require_object(payload)?;
        let desired: Desired =
            serde_json::from_slice(payload).map_err(|e| DecodeError::Malformed(e.to_string()))?;
        check_counter("generation", Some(desired.generation.get()))?;
        Ok(desired)
    }

    pub fn encode(&self) -> Vec<u8> {
        encode_json(self)
    }
}

fn check_size(payload: &[u8], limit: usize) -> Result<(), DecodeError> {
    if payload.len() > limit {
        return Err(DecodeError::TooLarge {
            len: payload.len(),
            limit,
        });
    }
    Ok(())
}

/// serde maps a JSON array onto a struct's fields in order; the protocol
/// only has objects.
fn require_object(payload: &[u8]) -> Result<(), DecodeError> {
    match payload.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Ok(()),
        Some(_) | None => Err(DecodeError::Malformed(
            "the payload must be a JSON object".to_owned(),
        )),
    }
}

fn check_counter(field: &str, value: Option<u64>) -> Result<(), DecodeError> {
    match value {
        Some(n) if n > MAX_COUNTER => Err(DecodeError::Malformed(format!(
            "{field} {n} is above the maximum {MAX_COUNTER}"
        ))),
        Some(_) | None => Ok(()),
    }
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

    fn budget() -> SpecBudget {
        SpecBudget::new(1024)
    }

    #[test]
    fn a_minimal_report_decodes() {
        let r = Reported::decode(br#"{"seq":3,"spec":{"fw":"1.2"}}"#, budget()).unwrap();
        assert_eq!(r.seq, 3);
        assert_eq!(r.generation, None);
        assert_eq!(r.spec, json!({"fw": "1.2"}));
        assert_eq!(r.error, None);
    }

    #[test]
    fn a_rejecting_report_round_trips() {
        let r = Reported {
            seq: 9,
            generation: Some(Generation(1)),
            spec: json!({"fw": "1.0"}),
            health: Some(Health::Degraded),
            error: Some(Rejection {
                generation: Generation(2),
                message: "flash full".into(),
            }),
        };
        assert_eq!(Reported::decode(&r.encode(), budget()).unwrap(), r);
    }

    #[test]
    fn a_desired_message_round_trips() {
        let d = Desired {
            generation: Generation(7),
            spec: json!({"fw": "2.0", "fans": [1, 2]}),
        };
        assert_eq!(Desired::decode(&d.encode(), budget()).unwrap(), d);
    }

    #[test]
    fn a_payload_of_exactly_the_report_limit_is_accepted() {
        let limit = budget().max_report_bytes();
        let report = br#"{"seq":1,"spec":{}}"#;
        let mut payload = report.to_vec();
        payload.resize(limit, b' ');
        assert_eq!(Reported::decode(&payload, budget()).unwrap().seq, 1);
        payload.push(b' ');
        assert!(matches!(
            Reported::decode(&payload, budget()),
            Err(DecodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_reported_spec_of_exactly_the_budget_is_accepted() {
        let spec = json!({"x": "y".repeat(1024 - r#"{"x":""}"#.len())});
        assert_eq!(budget().check_spec(&spec), Ok(1024));
        let payload = format!(r#"{{"seq":1,"spec":{spec}}}"#);
        let report = Reported::decode(payload.as_bytes(), budget()).unwrap();
        assert_eq!(report.spec, spec);
    }

    #[test]
    fn oversized_payloads_are_refused_before_parsing() {
        let limit = budget().max_report_bytes();
        let err = Reported::decode(&vec![b' '; limit + 1], budget()).unwrap_err();
        assert_eq!(
            err,
            DecodeError::TooLarge {
                len: limit + 1,
                limit
            }
        );
        assert_eq!(err.reason(), "oversized");
    }

    #[test]
    fn a_spec_over_the_budget_is_oversized_even_when_the_payload_fits() {
        let payload = format!(r#"{{"seq":1,"spec":"{}"}}"#, "x".repeat(1100));
        let err = Reported::decode(payload.as_bytes(), budget()).unwrap_err();
        assert!(
            matches!(err, DecodeError::SpecTooLarge { limit: 1024, .. }),
            "{err}"
        );
        assert_eq!(err.reason(), "oversized");
    }

    #[test]
    fn a_faithful_confirmation_of_a_spec_at_the_budget_fits() {
        // The largest spec the API accepts, echoed back pretty-printed with
        // every character escaped, still fits the report limit.
        let spec = json!({"x": "é".repeat(490)});
        assert!(budget().check_spec(&spec).is_ok());
        let escaped: String = serde_json::to_string_pretty(&spec)
            .unwrap()
            .replace('é', "\\u00e9");
        let payload = format!(
            r#"{{"seq": 1, "generation": 9223372036854775807, "health": "healthy", "spec": {escaped}}}"#
        );
        assert!(
            payload.len() > 2 * 1024,
            "the test must exceed the budget raw"
        );
        let report = Reported::decode(payload.as_bytes(), budget()).unwrap();
        assert_eq!(report.spec, spec);
    }

    #[test]
    fn malformed_and_mistyped_reports_are_refused() {
        for bad in [
            &b"{not json"[..],
            br#"{"spec":{}}"#,
            br#"{"seq":-1,"spec":{}}"#,
            br#"{"seq":"1","spec":{}}"#,
            br#"{"seq":1,"seq":2,"spec":{}}"#,
            br#"{"seq":1.0,"spec":{}}"#,
            br#"{"seq":9223372036854775808,"spec":{}}"#,
            br#"{"seq":1,"generation":9223372036854775808,"spec":{}}"#,
            br#"{"seq":1,"spec":{},"error":{"generation":9223372036854775808,"message":"x"}}"#,
            br#"[1, null, {}]"#,
            br#"  [1, {}]"#,
            br#""a string""#,
            b"",
            b"\xff\xfe",
        ] {
            let err = Reported::decode(bad, budget()).unwrap_err();
            assert_eq!(
                err.reason(),
                "malformed",
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn a_nul_in_the_spec_refuses_the_report_with_its_own_reason() {
        let err = Reported::decode(br#"{"seq":1,"spec":{"x":"\u0000"}}"#, budget()).unwrap_err();
        assert_eq!(err.reason(), "nul_character");
        assert!(err.to_string().contains("/x"), "{err}");
    }

    #[test]
    fn an_unknown_health_word_keeps_the_report() {
        for raw in [r#""HEALTHY""#, r#""fine""#, "3", r#"{"cpu":1}"#] {
            let payload = format!(r#"{{"seq":1,"spec":{{"a":1}},"health":{raw}}}"#);
            let r = Reported::decode(payload.as_bytes(), budget()).unwrap();
            assert_eq!(r.health, Some(Health::Unknown), "{raw}");
            assert_eq!(r.spec, json!({"a": 1}));
        }
        let r = Reported::decode(br#"{"seq":1,"spec":1,"health":null}"#, budget()).unwrap();
        assert_eq!(r.health, None);
        let r = Reported::decode(br#"{"seq":1,"spec":1,"health":"degraded"}"#, budget()).unwrap();
        assert_eq!(r.health, Some(Health::Degraded));
    }

    #[test]
    fn a_device_error_message_is_kept_storable() {
        let long = "é".repeat(2000);
        let payload =
            format!(r#"{{"seq":1,"spec":1,"error":{{"generation":2,"message":"a\u0000{long}"}}}}"#);
        let r = Reported::decode(payload.as_bytes(), SpecBudget::new(4096)).unwrap();
        let message = r.error.unwrap().message;
        assert!(message.len() <= MAX_ERROR_MESSAGE_BYTES);
        assert!(message.starts_with("a\u{fffd}é"));
    }

    #[test]
    fn desired_messages_must_be_objects() {
        let d = Desired::decode(br#"{"generation":2,"spec":{"a":1}}"#, budget()).unwrap();
        assert_eq!(d.generation, Generation(2));
        assert!(Desired::decode(br#"[2,{"a":1}]"#, budget()).is_err());
        assert!(Desired::decode(b"", budget()).is_err());
    }

    #[test]
    fn status_payloads_are_the_bare_words_and_decode_back() {
        assert_eq!(Status::Online.as_payload(), b"online");
        assert_eq!(Status::Offline.as_payload(), b"offline");
        for status in [Status::Online, Status::Offline] {
            assert_eq!(Status::decode(status.as_payload()), Ok(status));
        }
    }

    #[test]
    fn status_accepts_only_the_two_words() {
        assert_eq!(Status::decode(b"online"), Ok(Status::Online));
        assert_eq!(Status::decode(b"offline"), Ok(Status::Offline));
        assert_eq!(Status::decode(b"ONLINE"), Err(DecodeError::InvalidStatus));
    }
}
