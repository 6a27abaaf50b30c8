//! The field-level diff between two specs: every changed leaf as a path
//! (`net.wifi.ssid`, `servers[2]`), with its old and new value, added and
//! removed keys marked. Leaves compare in the digest's canonical form, so
//! key order does not matter and `1.0` equals `1`; two specs with the same
//! digest have an empty diff. Pure: no IO.

use std::fmt;

use idem_protocol::{canonical_json, SpecDigest};
use serde_json::{Map, Value};

/// Paths a [`DriftPaths`] names at most.
pub const MAX_DRIFT_PATHS: usize = 32;
/// Characters of one path a [`DriftPaths`] keeps (a device chooses its
/// keys; a longer path is cut and ends in `…`).
pub const MAX_DRIFT_PATH_CHARS: usize = 200;

/// Where a report differs from the desired spec it was compared with
/// (`against`, its digest): paths only, never values (a spec may hold
/// secrets), the first [`MAX_DRIFT_PATHS`] in path order, and how many more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriftPaths {
    pub against: SpecDigest,
    pub paths: Vec<String>,
    pub more: u64,
}

/// The [`DriftPaths`] of `reported` against `desired`, whose digest is
/// `against`, leaving out the paths `ignored` names (fields the device
/// owns).
pub fn drift_paths(
    reported: &Value,
    desired: &Value,
    against: SpecDigest,
    ignored: impl Fn(&FieldPath) -> bool,
) -> DriftPaths {
    let mut changes = diff(reported, desired);
    changes.retain(|change| !ignored(change.path()));
    let more = changes.len().saturating_sub(MAX_DRIFT_PATHS) as u64;
    let paths = changes
        .iter()
        .take(MAX_DRIFT_PATHS)
        .map(|change| {
            let path = change.path().to_string();
            if path.chars().count() <= MAX_DRIFT_PATH_CHARS {
                path
            } else {
                let mut cut: String = path.chars().take(MAX_DRIFT_PATH_CHARS - 1).collect();
                cut.push('…');
                cut
            }
        })
        .collect();
    DriftPaths {
        against,
        paths,
        more,
    }
}

/// One step of a path into a JSON value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathStep {
    Key(String),
    Index(usize),
}

/// Where a change is: the steps from the root (none: the whole value).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct FieldPath(pub Vec<PathStep>);

impl FieldPath {
    fn child(&self, step: PathStep) -> Self {
        let mut steps = self.0.clone();
        steps.push(step);
        FieldPath(steps)
    }
}

/// `net.wifi.ssid`, `servers[2].host`; a key that is not a plain word is
/// quoted (`labels["a.b"]`); the root is `$`.
impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("$");
        }
        for (i, step) in self.0.iter().enumerate() {
            match step {
                PathStep::Index(n) => write!(f, "[{n}]")?,
                PathStep::Key(key) if is_plain_word(key) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    f.write_str(key)?;
                }
                PathStep::Key(key) => {
                    let quoted = serde_json::to_string(key).map_err(|_| fmt::Error)?;
                    write!(f, "[{quoted}]")?;
                }
            }
        }
        Ok(())
    }
}

fn is_plain_word(key: &str) -> bool {
    let mut chars = key.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
}

/// One changed leaf.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldChange {
    /// A key or array item the new value has and the old one does not.
    Added { path: FieldPath, new: Value },
    /// A key or array item the old value has and the new one does not.
    Removed { path: FieldPath, old: Value },
    /// The same place holds another value (or another kind of value).
    Changed {
        path: FieldPath,
        old: Value,
        new: Value,
    },
}

impl FieldChange {
    pub fn path(&self) -> &FieldPath {
        match self {
            FieldChange::Added { path, .. }
            | FieldChange::Removed { path, .. }
            | FieldChange::Changed { path, .. } => path,
        }
    }
}

/// What changes `old` into `new`, in path order. Objects are compared key
/// by key and arrays item by item; anything else (and a change of kind) is
/// one change of the whole value at its path.
pub fn diff(old: &Value, new: &Value) -> Vec<FieldChange> {
    let mut changes = Vec::new();
    diff_at(&FieldPath::default(), old, new, &mut changes);
    changes
}

fn diff_at(path: &FieldPath, old: &Value, new: &Value, out: &mut Vec<FieldChange>) {
    match (old, new) {
        (Value::Object(old), Value::Object(new)) => diff_objects(path, old, new, out),
        (Value::Array(old), Value::Array(new)) => {
            for (i, (o, n)) in old.iter().zip(new).enumerate() {
                diff_at(&path.child(PathStep::Index(i)), o, n, out);
            }
            for (i, o) in old.iter().enumerate().skip(new.len()) {
                out.push(FieldChange::Removed {
                    path: path.child(PathStep::Index(i)),
                    old: o.clone(),
                });
            }
            for (i, n) in new.iter().enumerate().skip(old.len()) {
                out.push(FieldChange::Added {
                    path: path.child(PathStep::Index(i)),
                    new: n.clone(),
                });
            }
        }
        _ => {
            if canonical_json(old) != canonical_json(new) {
                out.push(FieldChange::Changed {
                    path: path.clone(),
                    old: old.clone(),
                    new: new.clone(),
                });
            }
        }
    }
}

fn diff_objects(
    path: &FieldPath,
    old: &Map<String, Value>,
    new: &Map<String, Value>,
    out: &mut Vec<FieldChange>,
) {
    let mut keys: Vec<&String> = old.keys().chain(new.keys()).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let at = path.child(PathStep::Key(key.clone()));
        match (old.get(key), new.get(key)) {
            (Some(o), Some(n)) => diff_at(&at, o, n, out),
            (Some(o), None) => out.push(FieldChange::Removed {
                path: at,
                old: o.clone(),
            }),
            (None, Some(n)) => out.push(FieldChange::Added {
                path: at,
                new: n.clone(),
            }),
            (None, None) => {}
        }
    }
}

/// Why a diff does not fit the value it is applied to.
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the diff does not fit the value at {0}")]
pub struct DoesNotFit(pub String);

/// `old` with `changes` applied: `apply(old, &diff(old, new))` is `new`
/// (in the canonical form). The tests' proof that a diff is complete.
#[cfg(test)]
pub fn apply(old: &Value, changes: &[FieldChange]) -> Result<Value, DoesNotFit> {
    let mut value = old.clone();
    // Removals last and deepest-last-index first, so an array shrinks from
    // its end and no index moves under a later change.
    let (removals, others): (Vec<&FieldChange>, Vec<&FieldChange>) = changes
        .iter()
        .partition(|c| matches!(c, FieldChange::Removed { .. }));
    for change in others {
        match change {
            FieldChange::Added { path, new } | FieldChange::Changed { path, new, .. } => {
                set(&mut value, &path.0, new.clone())
                    .ok_or_else(|| DoesNotFit(path.to_string()))?;
            }
            FieldChange::Removed { .. } => {}
        }
    }
    let mut removals: Vec<&FieldPath> = removals.iter().map(|c| c.path()).collect();
    removals.sort_unstable_by(|a, b| b.cmp(a));
    for path in removals {
        remove(&mut value, &path.0).ok_or_else(|| DoesNotFit(path.to_string()))?;
    }
    Ok(value)
}

#[cfg(test)]
fn set(value: &mut Value, steps: &[PathStep], new: Value) -> Option<()> {
    let Some((last, parents)) = steps.split_last() else {
        *value = new;
        return Some(());
    };
    let parent = walk(value, parents)?;
    match (parent, last) {
        (Value::Object(map), PathStep::Key(key)) => {
            map.insert(key.clone(), new);
            Some(())
        }
        (Value::Array(items), PathStep::Index(i)) if *i < items.len() => {
            items[*i] = new;
            Some(())
        }
        (Value::Array(items), PathStep::Index(i)) if *i == items.len() => {
            items.push(new);
            Some(())
        }
        _ => None,
    }
}

#[cfg(test)]
fn remove(value: &mut Value, steps: &[PathStep]) -> Option<()> {
    let (last, parents) = steps.split_last()?;
    match (walk(value, parents)?, last) {
        (Value::Object(map), PathStep::Key(key)) => map.remove(key).map(|_| ()),
        (Value::Array(items), PathStep::Index(i)) if *i + 1 == items.len() => {
            items.pop().map(|_| ())
        }
        _ => None,
    }
}

#[cfg(test)]
fn walk<'a>(value: &'a mut Value, steps: &[PathStep]) -> Option<&'a mut Value> {
    steps.iter().try_fold(value, |at, step| match (at, step) {
        (Value::Object(map), PathStep::Key(key)) => map.get_mut(key),
        (Value::Array(items), PathStep::Index(i)) => items.get_mut(*i),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn paths(changes: &[FieldChange]) -> Vec<String> {
        changes.iter().map(|c| c.path().to_string()).collect()
    }

    #[test]
    fn drift_paths_name_at_most_thirty_two_paths_without_values_and_count_the_rest() {
        let reported: Value = (0..40)
            .map(|i| (format!("k{i:02}"), json!("secret")))
            .collect::<Map<_, _>>()
            .into();
        let desired = json!({});
        let drift = drift_paths(&reported, &desired, SpecDigest::of(&desired), |_| false);
        assert_eq!(drift.paths.len(), MAX_DRIFT_PATHS);
        assert_eq!(drift.more, 8);
        assert_eq!(drift.paths[0], "k00");
        assert!(drift.paths.iter().all(|p| !p.contains("secret")));
    }

    #[test]
    fn drift_paths_leave_out_the_paths_ignored() {
        let reported = json!({"uptime": 5, "net": {"rssi": -60, "ssid": "home"}});
        let desired = json!({"net": {"rssi": -40, "ssid": "office"}});
        let owned =
            |path: &FieldPath| path.to_string() == "uptime" || path.to_string() == "net.rssi";
        let drift = drift_paths(&reported, &desired, SpecDigest::of(&desired), owned);
        assert_eq!(drift.paths, vec!["net.ssid".to_owned()]);
        assert_eq!(drift.more, 0);
    }

    #[test]
    fn a_drift_path_longer_than_its_bound_is_cut() {
        let key = "k".repeat(500);
        let reported = json!({ key: 1 });
        let desired = json!({});
        let drift = drift_paths(&reported, &desired, SpecDigest::of(&desired), |_| false);
        assert_eq!(drift.paths[0].chars().count(), MAX_DRIFT_PATH_CHARS);
        assert!(drift.paths[0].ends_with('…'));
    }

    #[test]
    fn a_changed_leaf_is_named_by_its_dotted_path_with_old_and_new_value() {
        let old = json!({"net": {"wifi": {"ssid": "home", "channel": 6}}});
        let new = json!({"net": {"wifi": {"ssid": "office", "channel": 6}}});
        assert_eq!(
            diff(&old, &new),
            vec![FieldChange::Changed {
                path: FieldPath(vec![
                    PathStep::Key("net".into()),
                    PathStep::Key("wifi".into()),
                    PathStep::Key("ssid".into()),
                ]),
                old: json!("home"),
                new: json!("office"),
            }]
        );
        assert_eq!(paths(&diff(&old, &new)), ["net.wifi.ssid"]);
    }

    #[test]
    fn added_and_removed_keys_and_array_items_are_marked() {
        let old = json!({"a": 1, "gone": true, "list": [1, 2, 3]});
        let new = json!({"a": 1, "fresh": {"x": 1}, "list": [1, 9]});
        let changes = diff(&old, &new);
        assert_eq!(
            changes,
            vec![
                FieldChange::Added {
                    path: FieldPath(vec![PathStep::Key("fresh".into())]),
                    new: json!({"x": 1}),
                },
                FieldChange::Removed {
                    path: FieldPath(vec![PathStep::Key("gone".into())]),
                    old: json!(true),
                },
                FieldChange::Changed {
                    path: FieldPath(vec![PathStep::Key("list".into()), PathStep::Index(1)]),
                    old: json!(2),
                    new: json!(9),
                },
                FieldChange::Removed {
                    path: FieldPath(vec![PathStep::Key("list".into()), PathStep::Index(2)]),
                    old: json!(3),
                },
            ]
        );
        assert_eq!(paths(&changes), ["fresh", "gone", "list[1]", "list[2]"]);
    }

    #[test]
    fn key_order_and_number_spelling_follow_the_digest_so_they_are_no_change() {
        let old: Value =
            serde_json::from_str(r#"{"b": 1.0, "a": [2.50, {"y": 1, "x": 0}]}"#).unwrap();
        let new: Value = serde_json::from_str(r#"{"a": [2.5, {"x": 0, "y": 1}], "b": 1}"#).unwrap();
        assert_eq!(diff(&old, &new), vec![]);
    }

    #[test]
    fn a_change_of_kind_or_of_the_whole_value_is_one_change() {
        assert_eq!(
            paths(&diff(&json!({"a": {"b": 1}}), &json!({"a": [1]}))),
            ["a"]
        );
        assert_eq!(paths(&diff(&json!("v1"), &json!({"v": 2}))), ["$"]);
        assert_eq!(
            paths(&diff(&json!(null), &json!(null))),
            Vec::<String>::new()
        );
    }

    #[test]
    fn keys_that_are_not_plain_words_are_quoted_in_the_path() {
        let changes = diff(
            &json!({"labels": {}}),
            &json!({"labels": {"a.b": "x", "": 1}}),
        );
        assert_eq!(paths(&changes), [r#"labels[""]"#, r#"labels["a.b"]"#]);
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            (-5i64..5).prop_map(Value::from),
            (-2.0f64..2.0).prop_map(|f| json!((f * 4.0).round() / 4.0)),
            "[a-c]{0,2}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-d.]{1,2}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn the_diff_of_a_spec_with_itself_is_empty(v in arb_json()) {
            prop_assert_eq!(diff(&v, &v), vec![]);
        }

        #[test]
        fn applying_the_diff_to_the_old_value_gives_the_new_one(old in arb_json(), new in arb_json()) {
            let changes = diff(&old, &new);
            let applied = apply(&old, &changes).unwrap();
            prop_assert_eq!(canonical_json(&applied), canonical_json(&new));
            prop_assert_eq!(changes.is_empty(), canonical_json(&old) == canonical_json(&new));
        }
    }
}
