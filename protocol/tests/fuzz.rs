//! Time-bounded fuzzing of everything the protocol crate parses from the
//! wire: topics, reports (bytes straight off MQTT) and the canonical digest.
//! Inputs come from proptest generators that mix well-formed structure with
//! random bytes, NUL characters, huge numbers and hostile shapes; failures
//! shrink to a minimal input.
//!
//! Each target runs for `IDEM_FUZZ_SECONDS` seconds (default 3; `scripts/test`
//! sets 20), in parallel with the others. The properties: nothing panics,
//! and nothing `docs/PROTOCOL.md` calls invalid is ever accepted.

use std::time::{Duration, Instant};

use idem_protocol::limits::{nul_path, MAX_ERROR_MESSAGE_BYTES};
use idem_protocol::{
    canonical_json, DeviceId, Reported, SpecBudget, SpecDigest, TopicRoot, MAX_COUNTER,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Map, Value};

fn fuzz_duration() -> Duration {
    let seconds = std::env::var("IDEM_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(3);
    Duration::from_secs(seconds)
}

/// Runs `test` on inputs from `strategy` until the time budget is spent;
/// panics with the shrunk failing input if a property breaks.
fn fuzz<S>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    let budget = fuzz_duration();
    let started = Instant::now();
    let inputs = std::sync::atomic::AtomicU64::new(0);
    let counted = |value: S::Value| {
        inputs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        test(value)
    };
    while started.elapsed() < budget || inputs.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        // A fresh runner per round: a runner counts its cases across runs.
        let mut runner = TestRunner::new(Config {
            cases: 256,
            failure_persistence: None,
            ..Config::default()
        });
        if let Err(e) = runner.run(&strategy, counted) {
            panic!("fuzz target {name} failed: {e}");
        }
    }
    println!(
        "fuzz target {name}: {} inputs in {:?}",
        inputs.into_inner(),
        started.elapsed()
    );
}

/// Strings with the characters that break things: NUL, quotes, escapes,
/// slashes, wildcards, non-ASCII, lone control characters.
fn nasty_string() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9_.-]{0,12}",
        "[\\x00-\\x1f\"\\\\/+#$ a-zA-Z0-9é😀]{0,12}",
        Just("events".to_owned()),
        Just("\u{0}".to_owned()),
        any::<String>(),
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        Just(json!(MAX_COUNTER)),
        Just(json!(MAX_COUNTER + 1)),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        nasty_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((nasty_string(), inner), 0..6)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A report-shaped object whose fields may be missing, mistyped or hostile.
fn report_like() -> impl Strategy<Value = Value> {
    (
        prop::option::of(prop_oneof![number(), json_value()]),
        prop::option::of(json_value()),
        prop::option::of(prop_oneof![number(), json_value()]),
        prop::option::of(prop_oneof![
            Just(json!("healthy")),
            Just(json!("HEALTHY")),
            json_value()
        ]),
        prop::option::of(prop_oneof![
            (number(), nasty_string()).prop_map(|(g, m)| json!({"generation": g, "message": m})),
            json_value()
        ]),
    )
        .prop_map(|(seq, spec, generation, health, error)| {
            let mut map = Map::new();
            for (key, value) in [
                ("seq", seq),
                ("spec", spec),
                ("generation", generation),
                ("health", health),
                ("error", error),
            ] {
                if let Some(value) = value {
                    map.insert(key.to_owned(), value);
                }
            }
            Value::Object(map)
        })
}

/// Bytes: raw noise, a JSON text, or a JSON text with a few bytes changed.
fn payload() -> impl Strategy<Value = Vec<u8>> {
    let text = prop_oneof![report_like(), json_value()].prop_map(|v| v.to_string().into_bytes());
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        text.clone(),
        (
            text,
            prop::collection::vec((any::<usize>(), any::<u8>()), 1..4)
        )
            .prop_map(|(mut bytes, edits)| {
                for (at, byte) in edits {
                    if !bytes.is_empty() {
                        let i = at % bytes.len();
                        bytes[i] = byte;
                    }
                }
                bytes
            }),
    ]
}

#[test]
fn report_decoding_never_panics_and_never_accepts_what_the_protocol_refuses() {
    let budget = SpecBudget::new(512);
    fuzz("report", payload(), |bytes| {
        let Ok(report) = Reported::decode(&bytes, budget) else {
            return Ok(());
        };
        prop_assert!(bytes.len() <= budget.max_report_bytes());
        let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
        prop_assert_eq!(first, Some(&b'{'), "only objects are reports");
        prop_assert!(report.seq <= MAX_COUNTER);
        prop_assert!(report.generation.is_none_or(|g| g.get() <= MAX_COUNTER));
        prop_assert_eq!(nul_path(&report.spec), None, "NUL in an accepted spec");
        prop_assert!(canonical_json(&report.spec).len() <= budget.max_spec_bytes());
        if let Some(error) = &report.error {
            prop_assert!(error.generation.get() <= MAX_COUNTER);
            prop_assert!(error.message.len() <= MAX_ERROR_MESSAGE_BYTES);
            prop_assert!(!error.message.contains('\0'));
        }
        let again = Reported::decode(&report.encode(), budget);
        prop_assert_eq!(again.as_ref(), Ok(&report), "encode/decode round trip");
        Ok(())
    });
}

fn topic() -> impl Strategy<Value = String> {
    let level = prop_oneof![
        "[A-Za-z0-9][A-Za-z0-9_.-]{0,6}",
        nasty_string(),
        Just(String::new())
    ];
    let channel = prop_oneof![
        Just("reported".to_owned()),
        Just("status".to_owned()),
        Just("desired".to_owned()),
        Just("get".to_owned()),
        nasty_string(),
    ];
    prop_oneof![
        (level.clone(), channel.clone()).prop_map(|(id, ch)| format!("idem/v1/{id}/{ch}")),
        (level.clone(), level, channel).prop_map(|(a, b, ch)| format!("idem/v1/{a}/{b}/{ch}")),
        any::<String>(),
    ]
}

#[test]
fn topic_parsing_never_panics_and_accepts_only_valid_device_topics() {
    let root = TopicRoot::new("idem/v1").expect("a valid root");
    fuzz("topic", topic(), |topic| {
        let Ok(parsed) = root.parse(&topic) else {
            return Ok(());
        };
        prop_assert!(DeviceId::parse(parsed.device.as_str()).is_ok());
        prop_assert_ne!(parsed.device.as_str(), "events");
        prop_assert_eq!(root.topic(&parsed.device, parsed.channel), topic);
        Ok(())
    });
}

#[test]
fn the_digest_ignores_formatting_and_key_order_but_nothing_else() {
    fuzz("digest", json_value(), |value| {
        let digest = SpecDigest::of(&value);
        let canonical = canonical_json(&value);
        let reparsed: Value = serde_json::from_str(&canonical)
            .map_err(|e| TestCaseError::fail(format!("canonical form is not JSON: {e}")))?;
        prop_assert_eq!(
            SpecDigest::of(&reparsed),
            digest,
            "canonical form is stable"
        );
        let pretty =
            serde_json::to_string_pretty(&value).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let from_pretty: Value =
            serde_json::from_str(&pretty).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(
            SpecDigest::of(&from_pretty),
            digest,
            "whitespace matters not"
        );
        let wrapped = json!([value]);
        prop_assert_ne!(SpecDigest::of(&wrapped), digest, "structure matters");
        Ok(())
    });
}
