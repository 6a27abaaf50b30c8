//! Bounds on operator input — specs, labels, bulk sizes, cursors — checked
//! before anything reaches PostgreSQL or the broker. Every refusal says the
//! limit it broke and how to change it, if it can be changed.
//!
//! Pure: no IO. The API turns an [`InputError`] into a 4xx answer.

use serde_json::{Map, Value};

use idem_protocol::api::ErrorCode;
use idem_protocol::{SpecBudget, SpecError};

pub use idem_protocol::api::bounds::{
    MAX_LABELS, MAX_LABEL_KEY_CHARS, MAX_LABEL_VALUE_CHARS, MAX_QUERY_TEXT_CHARS,
    MAX_REGISTRATIONS_PER_REQUEST, MAX_TARGET_IDS_PER_REQUEST,
};

/// Why operator input was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("{0} (the limit is set with --max-spec-bytes / IDEM_MAX_SPEC_BYTES)")]
    SpecTooLarge(SpecError),
    #[error("{0}")]
    InvalidSpec(SpecError),
    #[error("{0}")]
    InvalidLabels(String),
    #[error("{what}: at most {limit} per request (got {got}); send them in several requests")]
    TooManyItems {
        what: &'static str,
        limit: usize,
        got: usize,
    },
    #[error("query parameter `{name}` {problem}")]
    InvalidQuery { name: &'static str, problem: String },
}

impl InputError {
    /// Stable error code for the JSON answer.
    pub fn code(&self) -> ErrorCode {
        match self {
            InputError::SpecTooLarge(_) => ErrorCode::SpecTooLarge,
            InputError::InvalidSpec(_) => ErrorCode::InvalidSpec,
            InputError::InvalidLabels(_) => ErrorCode::InvalidLabels,
            InputError::TooManyItems { .. } => ErrorCode::TooManyItems,
            InputError::InvalidQuery { .. } => ErrorCode::InvalidQuery,
        }
    }

    /// Whether the answer is 413 (too large) rather than 400.
    pub fn is_too_large(&self) -> bool {
        match self {
            InputError::SpecTooLarge(_) | InputError::TooManyItems { .. } => true,
            InputError::InvalidSpec(_)
            | InputError::InvalidLabels(_)
            | InputError::InvalidQuery { .. } => false,
        }
    }
}

/// A spec within the budget, with no NUL anywhere.
pub fn check_spec(budget: SpecBudget, spec: &Value) -> Result<(), InputError> {
    match budget.check_spec(spec) {
        Ok(_) => Ok(()),
        Err(e @ SpecError::TooLarge { .. }) => Err(InputError::SpecTooLarge(e)),
        Err(e @ SpecError::Nul { .. }) => Err(InputError::InvalidSpec(e)),
    }
}

/// Labels: an object of at most [`MAX_LABELS`] string values, keys and
/// values bounded in length and free of NUL.
pub fn check_labels(labels: &Value) -> Result<(), InputError> {
    let Value::Object(map) = labels else {
        return Err(InputError::InvalidLabels(
            "labels must be an object of string values".to_owned(),
        ));
    };
    check_label_map(map)
}

fn check_label_map(map: &Map<String, Value>) -> Result<(), InputError> {
    if map.len() > MAX_LABELS {
        return Err(InputError::InvalidLabels(format!(
            "a device may carry at most {MAX_LABELS} labels (got {})",
            map.len()
        )));
    }
    for (key, value) in map {
        let Value::String(value) = value else {
            return Err(InputError::InvalidLabels(format!(
                "label {key:?} must have a string value"
            )));
        };
        check_label_pair(key, value)?;
    }
    Ok(())
}

/// One label (or label selector) key and value.
pub fn check_label_pair(key: &str, value: &str) -> Result<(), InputError> {
    let problem = if key.is_empty() {
        Some("label keys must not be empty".to_owned())
    } else if key.chars().count() > MAX_LABEL_KEY_CHARS {
        Some(format!(
            "label key of {} characters; the limit is {MAX_LABEL_KEY_CHARS}",
            key.chars().count()
        ))
    } else if value.chars().count() > MAX_LABEL_VALUE_CHARS {
        Some(format!(
            "label {:?} has a value of {} characters; the limit is {MAX_LABEL_VALUE_CHARS}",
            shorten(key),
            value.chars().count()
        ))
    } else if key.contains('\0') || value.contains('\0') {
        Some(format!(
            "label {:?} holds a NUL character (\\u0000)",
            shorten(key)
        ))
    } else {
        None
    };
    problem.map_or(Ok(()), |p| Err(InputError::InvalidLabels(p)))
}

/// At most `limit` items of `what` in one request.
pub fn check_count(what: &'static str, got: usize, limit: usize) -> Result<(), InputError> {
    if got > limit {
        return Err(InputError::TooManyItems { what, limit, got });
    }
    Ok(())
}

/// A free-text query parameter (cursor, filter): bounded, no NUL.
pub fn check_query_text(name: &'static str, text: &str) -> Result<(), InputError> {
    if text.chars().count() > MAX_QUERY_TEXT_CHARS {
        return Err(InputError::InvalidQuery {
            name,
            problem: format!(
                "is {} characters; the limit is {MAX_QUERY_TEXT_CHARS}",
                text.chars().count()
            ),
        });
    }
    if text.contains('\0') {
        return Err(InputError::InvalidQuery {
            name,
            problem: "holds a NUL character".to_owned(),
        });
    }
    Ok(())
}

/// A key shown in an error message, cut so the message stays readable.
fn shorten(text: &str) -> String {
    idem_protocol::limits::storable_text(text, 64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_spec_over_the_budget_names_the_limit_and_the_flag() {
        let err = check_spec(SpecBudget::new(256), &json!({"x": "y".repeat(300)})).unwrap_err();
        assert!(err.is_too_large());
        let message = err.to_string();
        assert!(message.contains("the limit is 256 bytes"), "{message}");
        assert!(message.contains("IDEM_MAX_SPEC_BYTES"), "{message}");
    }

    #[test]
    fn a_nul_in_a_spec_is_a_bad_request() {
        let err = check_spec(SpecBudget::default(), &json!({"x": "\u{0}"})).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidSpec);
        assert!(!err.is_too_large());
    }

    #[test]
    fn labels_are_bounded_in_count_length_and_content() {
        assert!(check_labels(&json!({"site": "north"})).is_ok());
        let many: Map<String, Value> = (0..=MAX_LABELS)
            .map(|i| (format!("k{i}"), json!("v")))
            .collect();
        let err = check_labels(&Value::Object(many)).unwrap_err();
        assert!(err.to_string().contains("at most 64 labels"), "{err}");
        let err = check_labels(&json!({"k": "v".repeat(300)})).unwrap_err();
        assert!(err.to_string().contains("the limit is 256"), "{err}");
        let err = check_labels(&json!({"k".repeat(200): "v"})).unwrap_err();
        assert!(err.to_string().contains("the limit is 128"), "{err}");
        let err = check_labels(&json!({"k": "a\u{0}b"})).unwrap_err();
        assert!(err.to_string().contains("NUL"), "{err}");
        assert!(check_labels(&json!({"k": 1})).is_err());
        assert!(check_labels(&json!(["k"])).is_err());
        assert!(check_labels(&json!({"": "v"})).is_err());
    }

    #[test]
    fn labels_exactly_at_each_limit_are_accepted() {
        let most: Map<String, Value> = (0..MAX_LABELS)
            .map(|i| (format!("k{i}"), json!("v")))
            .collect();
        assert!(check_labels(&Value::Object(most)).is_ok());
        let longest_key = "k".repeat(MAX_LABEL_KEY_CHARS);
        assert!(check_label_pair(&longest_key, "v").is_ok());
        assert!(check_label_pair(&format!("{longest_key}k"), "v").is_err());
        let longest_value = "v".repeat(MAX_LABEL_VALUE_CHARS);
        assert!(check_label_pair("k", &longest_value).is_ok());
        assert!(check_label_pair("k", &format!("{longest_value}v")).is_err());
    }

    #[test]
    fn a_refused_label_is_named_by_its_key_cut_to_a_readable_length() {
        let err = check_label_pair("site", &"v".repeat(300)).unwrap_err();
        assert!(
            err.to_string().contains(r#"label "site" has a value"#),
            "{err}"
        );
        let long_key = format!("{}\0", "k".repeat(100));
        let err = check_label_pair(&long_key, "v").unwrap_err();
        let shown = format!("label {:?} holds a NUL", "k".repeat(64));
        assert!(err.to_string().contains(&shown), "{err}");
    }

    #[test]
    fn counts_and_query_text_are_bounded() {
        assert!(check_count("devices", 10, 10).is_ok());
        let err = check_count("devices", 11, 10).unwrap_err();
        assert!(err.to_string().contains("at most 10 per request (got 11)"));
        assert!(check_query_text("after", "dev-1").is_ok());
        assert!(check_query_text("after", "a\u{0}").is_err());
        assert!(check_query_text("after", &"a".repeat(300)).is_err());
        assert!(check_query_text("after", &"a".repeat(MAX_QUERY_TEXT_CHARS)).is_ok());
        assert!(check_query_text("after", &"a".repeat(MAX_QUERY_TEXT_CHARS + 1)).is_err());
    }
}
