//! The canonical spec digest: the single definition of "same configuration".
//!
//! A spec is any JSON value. Its canonical form is compact JSON with object
//! keys sorted by their UTF-8 bytes, no insignificant whitespace, strings
//! escaped as JSON requires, and numbers written in their shortest form, with
//! integral floats inside ±2^53 written as integers (so `1.0` and `1` are the
//! same number). The digest is `sha256:` followed by the lowercase hex SHA-256
//! of the canonical form. Key order and formatting therefore never change the
//! digest, while array order and every value do.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

/// Floats with an integral value up to this magnitude are written as integers.
const MAX_EXACT_INTEGER_IN_F64: f64 = 9_007_199_254_740_992.0;

/// SHA-256 of a spec's canonical JSON; written `sha256:<64 hex digits>`.
///
/// Kept as the 32 raw bytes (the server holds two per device in memory) and
/// rendered as text only at the edges (JSON, database, logs).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpecDigest([u8; 32]);

const PREFIX: &str = "sha256:";

/// A string that is not `sha256:` followed by 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a spec digest (expected `sha256:` and 64 hex digits): {0:?}")]
pub struct InvalidDigest(pub String);

impl SpecDigest {
    /// Digest of `spec` in its canonical form.
    pub fn of(spec: &Value) -> Self {
        Self::of_with_len(spec).0
    }

    /// The digest and the length of the canonical form, from one pass.
    pub fn of_with_len(spec: &Value) -> (Self, usize) {
        let canonical = canonical_json(spec);
        (
            Self(Sha256::digest(canonical.as_bytes()).into()),
            canonical.len(),
        )
    }

    /// Parses the text form, e.g. a digest read back from storage.
    pub fn parse(text: &str) -> Result<Self, InvalidDigest> {
        let invalid = || InvalidDigest(text.to_owned());
        let hex_digits = text.strip_prefix(PREFIX).ok_or_else(invalid)?;
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(hex_digits, &mut bytes).map_err(|_| invalid())?;
        Ok(Self(bytes))
    }
}

impl fmt::Display for SpecDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PREFIX}{}", hex::encode(self.0))
    }
}

impl fmt::Debug for SpecDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first 6 bytes are plenty to tell digests apart in logs.
        write!(f, "SpecDigest({PREFIX}{}…)", hex::encode(&self.0[..6]))
    }
}

impl Serialize for SpecDigest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SpecDigest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        SpecDigest::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The canonical JSON text of `value` (see the module docs for the rules).
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(key, out);
                out.push(':');
                write_canonical(item, out);
            }
            out.push('}');
        }
    }
}

fn write_number(n: &serde_json::Number, out: &mut String) {
    if n.is_f64() {
        if let Some(f) = n.as_f64() {
            if f.fract() == 0.0 && f.abs() <= MAX_EXACT_INTEGER_IN_F64 {
                // Exact: |f| ≤ 2^53 and integral, so the cast loses nothing.
                out.push_str(&(f as i64).to_string());
                return;
            }
        }
    }
    out.push_str(&n.to_string());
}

fn write_string(s: &str, out: &mut String) {
    // serde_json's string escaping is the JSON standard's; serialising a str
    // cannot fail.
    match serde_json::to_string(s) {
        Ok(escaped) => out.push_str(&escaped),
        Err(_) => unreachable!("serialising a &str to JSON is infallible"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn digest_of(text: &str) -> SpecDigest {
        SpecDigest::of(&serde_json::from_str(text).unwrap())
    }

    #[test]
    fn key_order_and_whitespace_do_not_change_the_digest() {
        assert_eq!(
            digest_of(r#"{"a":1,"b":[1,2]}"#),
            digest_of(r#"{ "b" : [1,2], "a" : 1 }"#)
        );
    }

    #[test]
    fn array_order_changes_the_digest() {
        assert_ne!(
            digest_of(r#"{"a":1,"b":[1,2]}"#),
            digest_of(r#"{"a":1,"b":[2,1]}"#)
        );
    }

    #[test]
    fn canonical_form_sorts_nested_keys_and_drops_whitespace() {
        let spec = json!({"z": {"y": 1, "b": [true, null]}, "a": "x\"y"});
        assert_eq!(
            canonical_json(&spec),
            r#"{"a":"x\"y","z":{"b":[true,null],"y":1}}"#
        );
    }

    #[test]
    fn integral_floats_equal_integers_but_fractions_do_not() {
        assert_eq!(digest_of(r#"{"n":1.0}"#), digest_of(r#"{"n":1}"#));
        assert_eq!(digest_of(r#"{"n":1e2}"#), digest_of(r#"{"n":100}"#));
        assert_ne!(digest_of(r#"{"n":1.5}"#), digest_of(r#"{"n":1}"#));
    }

    #[test]
    fn digest_has_the_documented_shape_and_parses_back() {
        let d = digest_of("{}");
        let text = d.to_string();
        assert!(text.starts_with("sha256:"));
        assert_eq!(text.len(), "sha256:".len() + 64);
        assert_eq!(SpecDigest::parse(&text), Ok(d));
        assert_eq!(
            serde_json::to_value(d).unwrap(),
            serde_json::Value::String(text.clone())
        );
        assert_eq!(
            serde_json::from_value::<SpecDigest>(text.into()).unwrap(),
            d
        );
        assert!(SpecDigest::parse("md5:abc").is_err());
        assert!(SpecDigest::parse("sha256:xyz").is_err());
    }

    #[test]
    fn a_digest_in_a_log_line_shows_its_first_six_bytes() {
        let d = digest_of("{}");
        let hex = &d.to_string()["sha256:".len()..];
        assert_eq!(
            format!("{d:?}"),
            format!("SpecDigest(sha256:{}…)", &hex[..12])
        );
    }

    #[test]
    fn a_float_survives_its_canonical_form_exactly() {
        // Found by the fuzz target: without exact float parsing, the
        // canonical text of this number parsed back to a neighbouring
        // float, so a device echoing a pushed spec faithfully got another
        // digest.
        let value = json!({"n": 3.991_172_167_600_980_6e-19_f64});
        let reparsed: Value = serde_json::from_str(&canonical_json(&value)).unwrap();
        assert_eq!(SpecDigest::of(&reparsed), SpecDigest::of(&value));
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            "[a-z\"\\\\ ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z]{1,4}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn canonical_form_parses_back_to_the_same_value(v in arb_json()) {
            let reparsed: Value = serde_json::from_str(&canonical_json(&v)).unwrap();
            prop_assert_eq!(reparsed, v);
        }

        #[test]
        fn pretty_printing_never_changes_the_digest(v in arb_json()) {
            let pretty = serde_json::to_string_pretty(&v).unwrap();
            prop_assert_eq!(digest_of(&pretty), SpecDigest::of(&v));
        }
    }
}
