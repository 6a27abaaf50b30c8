//! Device-owned fields: spec paths that belong to the device (`uptime`,
//! `net.rssi`), declared server-wide and per label selector. They are left
//! out of the convergence digest (so a change there is never a drift and
//! never causes a push), removed from every spec the server publishes, and
//! shown as ignored in diffs. Pure: parsing, matching and stripping.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use idem_protocol::api::bounds::{MAX_OWNED_FIELDS, MAX_OWNED_PATH_CHARS, MAX_OWNED_SELECTORS};
use idem_protocol::api::OwnedFieldsDeclaration;
use idem_protocol::SpecDigest;
use serde_json::Value;

use super::diff::{diff, FieldChange, FieldPath, PathStep};

/// Why a declared path is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("{0:?} is empty; name a key, e.g. `uptime` or `net.rssi`")]
    Empty(String),
    #[error("{0:?} is not a path: write keys joined by `.` (`net.rssi`), or a quoted key in brackets (`labels[\"a.b\"]`)")]
    Syntax(String),
    #[error("{0:?} names an array item; an owned field is an object key")]
    Index(String),
}

/// Reads `net.rssi`, `labels["a.b"]`, `["odd key"].x` — the way diffs
/// name paths — keys only.
pub fn parse_path(text: &str) -> Result<FieldPath, PathError> {
    if text.is_empty() {
        return Err(PathError::Empty(text.to_owned()));
    }
    let syntax = || PathError::Syntax(text.to_owned());
    let mut steps = Vec::new();
    let mut rest = text;
    let mut first = true;
    while !rest.is_empty() {
        if let Some(quoted) = rest.strip_prefix('[') {
            if quoted.starts_with(|c: char| c.is_ascii_digit()) {
                return Err(PathError::Index(text.to_owned()));
            }
            // A JSON string, then `]`.
            let mut stream = serde_json::Deserializer::from_str(quoted).into_iter::<String>();
            let key = match stream.next() {
                Some(Ok(key)) => key,
                Some(Err(_)) | None => return Err(syntax()),
            };
            let after = &quoted[stream.byte_offset()..];
            rest = after.strip_prefix(']').ok_or_else(syntax)?;
            steps.push(PathStep::Key(key));
        } else {
            let word = if first {
                rest
            } else {
                rest.strip_prefix('.').ok_or_else(syntax)?
            };
            let end = word.find(['.', '[']).unwrap_or(word.len());
            let key = &word[..end];
            if !is_word(key) {
                return Err(syntax());
            }
            steps.push(PathStep::Key(key.to_owned()));
            rest = &word[end..];
        }
        first = false;
    }
    Ok(FieldPath(steps))
}

fn is_word(key: &str) -> bool {
    let mut chars = key.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
}

/// The owned paths of one device, sorted and without repeats.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct OwnedFields {
    paths: Vec<FieldPath>,
}

impl OwnedFields {
    pub fn new(mut paths: Vec<FieldPath>) -> Self {
        paths.sort();
        paths.dedup();
        Self { paths }
    }

    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    /// The owned paths, sorted.
    pub fn paths(&self) -> &[FieldPath] {
        &self.paths
    }

    /// Whether `path` is an owned path or lies under one.
    pub fn covers(&self, path: &FieldPath) -> bool {
        self.paths
            .iter()
            .any(|owned| path.0.len() >= owned.0.len() && path.0[..owned.0.len()] == owned.0[..])
    }

    /// `spec` without the owned paths, and without the objects on the way
    /// to one that are (or are left) empty, on either side alike: a device
    /// reporting `{"net": {"rssi": -61}}` for a desired spec without `net`
    /// owns all of the difference. Borrowed when there is nothing to take.
    pub fn strip<'a>(&self, spec: &'a Value) -> Cow<'a, Value> {
        if !self.paths.iter().any(|path| touches(spec, &path.0)) {
            return Cow::Borrowed(spec);
        }
        let mut stripped = spec.clone();
        for path in &self.paths {
            remove(&mut stripped, &path.0);
        }
        Cow::Owned(stripped)
    }

    /// For each change of `changes` (the diff from `old` to `new`), whether
    /// it lies wholly in what the device owns: under an owned path, or in
    /// nothing the diff of the stripped specs still holds (`net` removed
    /// when all `net` held was the owned `net.rssi`).
    pub fn ignored(&self, old: &Value, new: &Value, changes: &[FieldChange]) -> Vec<bool> {
        let kept = diff(&self.strip(old), &self.strip(new));
        let related = |a: &FieldPath, b: &FieldPath| {
            let n = a.0.len().min(b.0.len());
            a.0[..n] == b.0[..n]
        };
        changes
            .iter()
            .map(|change| {
                let path = change.path();
                self.covers(path) || !kept.iter().any(|k| related(k.path(), path))
            })
            .collect()
    }

    /// The digest convergence compares: of `spec` without the owned paths.
    pub fn digest(&self, spec: &Value) -> SpecDigest {
        SpecDigest::of(&self.strip(spec))
    }
}

/// Whether stripping `steps` changes `value`: it has something there, or
/// an empty object on the way.
fn touches(value: &Value, steps: &[PathStep]) -> bool {
    match steps.split_first() {
        None => true,
        Some((PathStep::Key(key), rest)) => value
            .as_object()
            .and_then(|map| map.get(key))
            .is_some_and(|inner| {
                rest.is_empty()
                    || inner.as_object().is_some_and(serde_json::Map::is_empty)
                    || touches(inner, rest)
            }),
        Some((PathStep::Index(_), _)) => false,
    }
}

/// Removes what `steps` names from `value`, and every object on the way
/// that is empty afterwards (the spec itself stays).
fn remove(value: &mut Value, steps: &[PathStep]) {
    let Some(map) = value.as_object_mut() else {
        return;
    };
    match steps {
        [PathStep::Key(last)] => {
            map.remove(last);
        }
        [PathStep::Key(key), rest @ ..] => {
            if let Some(inner) = map.get_mut(key) {
                remove(inner, rest);
                if inner.as_object().is_some_and(serde_json::Map::is_empty) {
                    map.remove(key);
                }
            }
        }
        [PathStep::Index(_), ..] | [] => {}
    }
}

/// The declared owned fields: server-wide, and per label selector (a device
/// whose labels contain every pair of a selector owns its paths too).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnedFieldSet {
    pub everywhere: Vec<FieldPath>,
    pub by_selector: Vec<(BTreeMap<String, String>, Vec<FieldPath>)>,
}

impl OwnedFieldSet {
    pub fn is_empty(&self) -> bool {
        self.everywhere.is_empty() && self.by_selector.iter().all(|(_, p)| p.is_empty())
    }

    /// What a device without labels owns (one registered by its first
    /// report): the server-wide paths.
    pub fn unlabelled(&self) -> Option<Arc<OwnedFields>> {
        (!self.everywhere.is_empty()).then(|| Arc::new(OwnedFields::new(self.everywhere.clone())))
    }

    /// The set a declaration names, every path parsed and every list within
    /// its bound; the first thing wrong is the error.
    pub fn from_declaration(
        declaration: &OwnedFieldsDeclaration,
    ) -> Result<Self, DeclarationError> {
        if declaration.by_selector.len() > MAX_OWNED_SELECTORS {
            return Err(DeclarationError::TooManySelectors(
                declaration.by_selector.len(),
            ));
        }
        let everywhere = paths("fields", &declaration.fields)?;
        let by_selector = declaration
            .by_selector
            .iter()
            .enumerate()
            .map(|(i, owned)| {
                let paths = paths(&format!("by_selector[{i}].fields"), &owned.fields)?;
                Ok((owned.selector.labels.clone(), paths))
            })
            .collect::<Result<_, DeclarationError>>()?;
        Ok(Self {
            everywhere,
            by_selector,
        })
    }
}

/// Why a declaration of owned fields is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeclarationError {
    #[error("`{list}[{index}]`: {error}")]
    Path {
        list: String,
        index: usize,
        error: PathError,
    },
    #[error(
        "`{list}[{index}]` is {chars} characters long; a path has at most {MAX_OWNED_PATH_CHARS}"
    )]
    PathTooLong {
        list: String,
        index: usize,
        chars: usize,
    },
    #[error("`{list}` names {count} paths; a list holds at most {MAX_OWNED_FIELDS}")]
    TooManyPaths { list: String, count: usize },
    #[error("`by_selector` has {0} selectors; at most {MAX_OWNED_SELECTORS} are allowed")]
    TooManySelectors(usize),
}

fn paths(list: &str, raw: &[String]) -> Result<Vec<FieldPath>, DeclarationError> {
    if raw.len() > MAX_OWNED_FIELDS {
        return Err(DeclarationError::TooManyPaths {
            list: list.to_owned(),
            count: raw.len(),
        });
    }
    raw.iter()
        .enumerate()
        .map(|(index, text)| {
            let chars = text.chars().count();
            if chars > MAX_OWNED_PATH_CHARS {
                return Err(DeclarationError::PathTooLong {
                    list: list.to_owned(),
                    index,
                    chars,
                });
            }
            parse_path(text).map_err(|error| DeclarationError::Path {
                list: list.to_owned(),
                index,
                error,
            })
        })
        .collect()
}

/// Each device's [`OwnedFields`] from its labels, shared between devices
/// that match the same selectors.
#[derive(Debug, Default)]
pub struct OwnedResolver {
    set: OwnedFieldSet,
    shared: HashMap<Vec<usize>, Option<Arc<OwnedFields>>>,
}

impl OwnedResolver {
    pub fn new(set: OwnedFieldSet) -> Self {
        Self {
            set,
            shared: HashMap::new(),
        }
    }

    /// What a device with `labels` (a JSON object of strings) owns; `None`
    /// when nothing.
    pub fn for_labels(&mut self, labels: &Value) -> Option<Arc<OwnedFields>> {
        let matched: Vec<usize> = self
            .set
            .by_selector
            .iter()
            .enumerate()
            .filter(|(_, (selector, _))| {
                selector
                    .iter()
                    .all(|(k, v)| labels.get(k).and_then(Value::as_str) == Some(v.as_str()))
            })
            .map(|(i, _)| i)
            .collect();
        let set = &self.set;
        self.shared
            .entry(matched)
            .or_insert_with_key(|matched| {
                let mut paths = set.everywhere.clone();
                for i in matched {
                    paths.extend(set.by_selector[*i].1.iter().cloned());
                }
                (!paths.is_empty()).then(|| Arc::new(OwnedFields::new(paths)))
            })
            .clone()
    }
}

/// A new desired spec's convergence digest for each device, computed once
/// per distinct set of owned paths (a fleet shares a handful).
#[derive(Debug)]
pub struct NewSpecDigests<'a> {
    spec: &'a Value,
    full: SpecDigest,
    by_owned: HashMap<Arc<OwnedFields>, SpecDigest>,
}

impl<'a> NewSpecDigests<'a> {
    /// `spec`, whose own digest is `full`.
    pub fn new(spec: &'a Value, full: SpecDigest) -> Self {
        Self {
            spec,
            full,
            by_owned: HashMap::new(),
        }
    }

    /// The digest of the whole spec.
    pub fn full(&self) -> SpecDigest {
        self.full
    }

    /// The digest convergence compares for a device that owns `owned`.
    pub fn for_device(&mut self, owned: Option<&Arc<OwnedFields>>) -> SpecDigest {
        match owned {
            Some(owned) if !owned.is_empty() => *self
                .by_owned
                .entry(owned.clone())
                .or_insert_with(|| owned.digest(self.spec)),
            Some(_) | None => self.full,
        }
    }
}

/// The convergence digest of `spec` for a device that owns `owned`:
/// `full` (the spec's own digest) when it owns nothing.
pub fn convergence_digest(
    spec: &Value,
    full: SpecDigest,
    owned: Option<&OwnedFields>,
) -> SpecDigest {
    match owned {
        Some(owned) if !owned.is_empty() => owned.digest(spec),
        Some(_) | None => full,
    }
}

#[cfg(test)]
mod tests;
