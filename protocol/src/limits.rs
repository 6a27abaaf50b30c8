//! The wire contract's bounds: one spec budget from which every size limit
//! derives (API, desired message, report, MQTT packet), and the value checks
//! that keep every accepted value storable (no NUL in any string, integers
//! within a signed 64-bit range).
//!
//! Pure: sizes and checks only. Callers decide what to do with a refusal.

use serde_json::Value;

use crate::digest::canonical_json;

/// Default spec budget: the largest canonical spec, in bytes.
pub const DEFAULT_MAX_SPEC_BYTES: usize = 64 * 1024;
/// The smallest spec budget a server may be configured with.
pub const MIN_MAX_SPEC_BYTES: usize = 256;
/// The largest spec budget: keeps every derived MQTT packet below MQTT's own
/// 256 MiB limit.
pub const MAX_MAX_SPEC_BYTES: usize = 64 * 1024 * 1024;
/// Room in a report for everything besides the spec (`seq`, `generation`,
/// `health`, `error`).
pub const REPORT_ENVELOPE_BYTES: usize = 8 * 1024;
/// Room in a desired message besides the spec (`{"generation":…,"spec":}`).
pub const DESIRED_ENVELOPE_BYTES: usize = 64;
/// Room in an MQTT packet besides its payload: fixed header, topic (a root
/// and a device id), packet id.
pub const PACKET_OVERHEAD_BYTES: usize = 1024;
/// Highest `seq` and `generation`: PostgreSQL's `bigint`.
pub const MAX_COUNTER: u64 = i64::MAX as u64;
/// Longest `error.message` kept from a report; longer ones are cut.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 1024;
/// How far ahead of the server's clock (in Unix microseconds) a `seq` may
/// be: one day. Both counter schemes of `docs/PROTOCOL.md` §6.4 stay far
/// below it, and a report that claims a `seq` beyond it is refused, so no
/// single report can make a device's later reports stale for longer.
pub const SEQ_FUTURE_WINDOW_MICROS: u64 = 86_400_000_000;

/// The highest `seq` accepted when the server's clock reads `unix_micros`.
pub fn seq_ceiling(unix_micros: u64) -> u64 {
    unix_micros
        .saturating_add(SEQ_FUTURE_WINDOW_MICROS)
        .min(MAX_COUNTER)
}

/// The one size budget of a deployment, in canonical spec bytes (see
/// `docs/PROTOCOL.md` §5.5). Every other limit is derived from it, so
/// nothing the API accepts can be unpushable or unconfirmable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecBudget {
    max_spec_bytes: usize,
}

impl Default for SpecBudget {
    fn default() -> Self {
        Self {
            max_spec_bytes: DEFAULT_MAX_SPEC_BYTES,
        }
    }
}

impl SpecBudget {
    /// A budget of `max_spec_bytes`, clamped to
    /// [`MIN_MAX_SPEC_BYTES`]..=[`MAX_MAX_SPEC_BYTES`] (configuration
    /// validation refuses values outside that range before this is built).
    pub fn new(max_spec_bytes: usize) -> Self {
        Self {
            max_spec_bytes: max_spec_bytes.clamp(MIN_MAX_SPEC_BYTES, MAX_MAX_SPEC_BYTES),
        }
    }

    /// The largest spec, in canonical JSON bytes.
    pub fn max_spec_bytes(self) -> usize {
        self.max_spec_bytes
    }

    /// The largest report payload, in raw bytes: twice the budget (a device
    /// may escape non-ASCII characters or print less compactly than the
    /// canonical form) plus the envelope.
    pub fn max_report_bytes(self) -> usize {
        2 * self.max_spec_bytes + REPORT_ENVELOPE_BYTES
    }

    /// The largest desired message the server publishes.
    pub fn max_desired_bytes(self) -> usize {
        self.max_spec_bytes + DESIRED_ENVELOPE_BYTES
    }

    /// The largest MQTT packet the server's own messages need: a maximal
    /// report (or desired message) with its topic and header.
    pub fn max_packet_bytes(self) -> usize {
        self.max_report_bytes() + PACKET_OVERHEAD_BYTES
    }

    /// Checks a spec against the budget and the storable-value rules;
    /// returns its canonical length.
    pub fn check_spec(self, spec: &Value) -> Result<usize, SpecError> {
        if let Some(path) = nul_path(spec) {
            return Err(SpecError::Nul { path });
        }
        let bytes = canonical_json(spec).len();
        if bytes > self.max_spec_bytes {
            return Err(SpecError::TooLarge {
                bytes,
                limit: self.max_spec_bytes,
            });
        }
        Ok(bytes)
    }
}

/// Why a spec cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("spec is {bytes} bytes in canonical form; the limit is {limit} bytes")]
    TooLarge { bytes: usize, limit: usize },
    #[error("spec holds a NUL character (\\u0000) at {path}, which cannot be stored")]
    Nul { path: String },
}

/// Where the first NUL character in any string or object key of `value` is,
/// as a JSON pointer (`/a/0/b`), or `None` if there is none.
pub fn nul_path(value: &Value) -> Option<String> {
    nul_pointer(value).map(|path| {
        if path.is_empty() {
            "/".to_owned()
        } else {
            path
        }
    })
}

/// [`nul_path`] with the root as the empty pointer.
fn nul_pointer(value: &Value) -> Option<String> {
    match value {
        Value::Null | Value::Bool(_) | Value::Number(_) => None,
        Value::String(s) => s.contains('\0').then(String::new),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| nul_pointer(item).map(|rest| format!("/{i}{rest}"))),
        Value::Object(map) => map.iter().find_map(|(key, item)| {
            if key.contains('\0') {
                Some(format!("/{}", pointer_escape(key)))
            } else {
                nul_pointer(item).map(|rest| format!("/{}{rest}", pointer_escape(key)))
            }
        }),
    }
}

/// RFC 6901 escaping of one pointer token, with NUL shown as `\u0000`.
fn pointer_escape(key: &str) -> String {
    key.replace('~', "~0")
        .replace('/', "~1")
        .replace('\0', "\\u0000")
}

/// `text` cut to at most `max` bytes at a character boundary, with NUL
/// characters replaced by U+FFFD; unchanged when it already fits.
pub fn storable_text(text: &str, max: usize) -> String {
    let mut text = text.replace('\0', "\u{fffd}");
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_derived_limit_leaves_room_for_a_spec_at_the_budget() {
        let budget = SpecBudget::new(1000);
        assert_eq!(budget.max_spec_bytes(), 1000);
        assert!(budget.max_report_bytes() >= 2 * 1000);
        assert!(budget.max_desired_bytes() > 1000);
        assert!(budget.max_packet_bytes() > budget.max_report_bytes());
        assert!(
            SpecBudget::new(MAX_MAX_SPEC_BYTES).max_packet_bytes() < 268_435_455,
            "the largest budget must fit in one MQTT packet"
        );
    }

    #[test]
    fn the_limits_are_the_ones_the_protocol_documents() {
        // docs/PROTOCOL.md §5.5, with the default 64 KiB budget.
        let budget = SpecBudget::default();
        assert_eq!(budget.max_spec_bytes(), 65_536);
        assert_eq!(budget.max_desired_bytes(), 65_600, "budget + 64 bytes");
        assert_eq!(budget.max_report_bytes(), 139_264, "2 × budget + 8 KiB");
        assert_eq!(
            budget.max_packet_bytes(),
            140_288,
            "a report payload + 1 KiB"
        );
        // Configurable from 256 bytes to 64 MiB.
        assert_eq!(SpecBudget::new(0).max_spec_bytes(), 256);
        assert_eq!(SpecBudget::new(usize::MAX).max_spec_bytes(), 67_108_864);
        let small = SpecBudget::new(1000);
        assert_eq!(small.max_report_bytes(), 2 * 1000 + 8 * 1024);
        assert_eq!(small.max_desired_bytes(), 1000 + 64);
    }

    #[test]
    fn budgets_outside_the_range_are_clamped() {
        assert_eq!(SpecBudget::new(1).max_spec_bytes(), MIN_MAX_SPEC_BYTES);
        assert_eq!(
            SpecBudget::new(usize::MAX).max_spec_bytes(),
            MAX_MAX_SPEC_BYTES
        );
    }

    #[test]
    fn a_spec_is_measured_in_canonical_bytes() {
        let budget = SpecBudget::new(256);
        let spec = json!({"b": 1, "a": "x"});
        assert_eq!(budget.check_spec(&spec), Ok(r#"{"a":"x","b":1}"#.len()));
        // Exactly at the budget is accepted, one byte more is not.
        let at_limit = json!({"x": "y".repeat(256 - r#"{"x":""}"#.len())});
        assert_eq!(budget.check_spec(&at_limit), Ok(256));
        let over = json!({"x": "y".repeat(257 - r#"{"x":""}"#.len())});
        assert_eq!(
            budget.check_spec(&over),
            Err(SpecError::TooLarge {
                bytes: 257,
                limit: 256
            })
        );
        let big = json!({"x": "y".repeat(300)});
        assert_eq!(
            budget.check_spec(&big),
            Err(SpecError::TooLarge {
                bytes: 308,
                limit: 256
            })
        );
    }

    #[test]
    fn a_nul_anywhere_is_found_with_its_path() {
        assert_eq!(
            nul_path(&json!({"a": [1, {"b": "x\u{0}"}]})).as_deref(),
            Some("/a/1/b")
        );
        assert_eq!(
            nul_path(&json!({"k\u{0}": 1})).as_deref(),
            Some("/k\\u0000")
        );
        assert_eq!(nul_path(&json!("\u{0}")).as_deref(), Some("/"));
        assert_eq!(nul_path(&json!({"a/b~": ["ok"]})), None);
        assert!(matches!(
            SpecBudget::default().check_spec(&json!({"x": "\u{0}"})),
            Err(SpecError::Nul { .. })
        ));
    }

    #[test]
    fn the_seq_ceiling_is_a_day_ahead_of_the_clock_and_never_above_bigint() {
        assert_eq!(seq_ceiling(1_000), 1_000 + SEQ_FUTURE_WINDOW_MICROS);
        assert_eq!(seq_ceiling(u64::MAX), MAX_COUNTER);
    }

    #[test]
    fn storable_text_cuts_at_a_character_boundary_and_replaces_nul() {
        assert_eq!(storable_text("héllo", 2), "h");
        assert_eq!(storable_text("héllo", 3), "hé");
        assert_eq!(storable_text("a\u{0}b", 10), "a\u{fffd}b");
        assert_eq!(storable_text("short", 100), "short");
    }
}
