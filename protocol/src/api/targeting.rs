//! Which devices a bulk call (`POST /v1/desired`, `POST /v1/runs`) is
//! about: the body as sent (`devices`, `selector` or `all`, plus `spec` and
//! `force`) and the [`Targeting`] it means, checked once.

use std::collections::BTreeMap;
use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{is_false, ErrorCode};
use crate::DeviceId;

/// `{"labels": {"key": "value", …}}`: devices carrying every label.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Selector {
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::selector_labels))]
    pub labels: BTreeMap<String, String>,
}

/// The body of `POST /v1/desired` (with `spec`) and `POST /v1/runs`
/// (without): exactly one of `devices`, `selector`, `all: true`.
///
/// Kept as sent so that a bad combination is answered with its own error
/// (400 `invalid_targets` …) rather than a generic decoding error; call
/// [`TargetedRequest::targeting`] for what it means.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TargetedRequest {
    /// Device ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<Selector>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub all: bool,
    /// The new desired spec (`POST /v1/desired` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<Value>,
    /// Push even to devices whose digest already matches.
    #[serde(default, skip_serializing_if = "is_false")]
    pub force: bool,
    /// Staged waves (`POST /v1/desired` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub rollout: Option<super::RolloutRequest>,
}

/// The devices a bulk call targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Targeting {
    /// These devices (each once, in the order first named).
    Devices(Vec<DeviceId>),
    /// Devices carrying every one of these labels.
    Selector(BTreeMap<String, String>),
    /// Every registered device.
    All,
}

/// The body that targets as `targeting` does (no spec, no force).
impl From<Targeting> for TargetedRequest {
    fn from(targeting: Targeting) -> Self {
        match targeting {
            Targeting::Devices(ids) => TargetedRequest {
                devices: Some(ids.iter().map(ToString::to_string).collect()),
                ..TargetedRequest::default()
            },
            Targeting::Selector(labels) => TargetedRequest {
                selector: Some(Selector { labels }),
                ..TargetedRequest::default()
            },
            Targeting::All => TargetedRequest {
                all: true,
                ..TargetedRequest::default()
            },
        }
    }
}

/// Why a bulk call's targets are not usable; the texts are the API's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetingError {
    #[error("give exactly one of `devices` (a list of ids), `selector` ({{\"labels\": {{...}}}}) or `all: true`")]
    NotExactlyOne,
    #[error("`devices` is empty")]
    EmptyDevices,
    /// More ids than the caller allows (the server's request limit).
    #[error("{got} devices; the limit is {limit}")]
    TooManyDevices { got: usize, limit: usize },
    #[error("{raw:?}: {reason}")]
    InvalidDeviceId { raw: String, reason: String },
    #[error("selector.labels is empty; name at least one label, or use `all: true`")]
    EmptySelector,
}

impl TargetingError {
    /// The `code` of the API's error answer.
    pub fn code(&self) -> ErrorCode {
        match self {
            TargetingError::NotExactlyOne => ErrorCode::InvalidTargets,
            TargetingError::EmptyDevices => ErrorCode::EmptyTargets,
            TargetingError::TooManyDevices { .. } => ErrorCode::TooManyItems,
            TargetingError::InvalidDeviceId { .. } => ErrorCode::InvalidDeviceId,
            TargetingError::EmptySelector => ErrorCode::EmptySelector,
        }
    }
}

impl TargetedRequest {
    /// A body naming `targeting` (no spec, no force).
    pub fn new(targeting: &Targeting) -> Self {
        let mut body = Self::default();
        match targeting {
            Targeting::Devices(ids) => {
                body.devices = Some(ids.iter().map(ToString::to_string).collect());
            }
            Targeting::Selector(labels) => {
                body.selector = Some(Selector {
                    labels: labels.clone(),
                });
            }
            Targeting::All => body.all = true,
        }
        body
    }

    /// The same body with `spec` as the new desired state.
    pub fn with_spec(mut self, spec: Value) -> Self {
        self.spec = Some(spec);
        self
    }

    /// The same body with `force`.
    pub fn forced(mut self, force: bool) -> Self {
        self.force = force;
        self
    }

    /// What the body targets: exactly one way, not empty, at most
    /// `max_devices` ids, each a valid id (duplicates named once).
    pub fn targeting(&self, max_devices: usize) -> Result<Targeting, TargetingError> {
        let ways = usize::from(self.devices.is_some())
            + usize::from(self.selector.is_some())
            + usize::from(self.all);
        if ways != 1 {
            return Err(TargetingError::NotExactlyOne);
        }
        if let Some(raw) = &self.devices {
            return device_ids(raw, max_devices).map(Targeting::Devices);
        }
        match &self.selector {
            Some(selector) if selector.labels.is_empty() => Err(TargetingError::EmptySelector),
            Some(selector) => Ok(Targeting::Selector(selector.labels.clone())),
            None => Ok(Targeting::All),
        }
    }
}

fn device_ids(raw: &[String], max: usize) -> Result<Vec<DeviceId>, TargetingError> {
    if raw.is_empty() {
        return Err(TargetingError::EmptyDevices);
    }
    if raw.len() > max {
        return Err(TargetingError::TooManyDevices {
            got: raw.len(),
            limit: max,
        });
    }
    let mut seen = HashSet::with_capacity(raw.len());
    let mut ids = Vec::with_capacity(raw.len());
    for r in raw {
        let id = DeviceId::parse(r).map_err(|e| TargetingError::InvalidDeviceId {
            raw: r.clone(),
            reason: e.to_string(),
        })?;
        if seen.insert(id.clone()) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// The request schemas of the two bulk calls: exactly one of `devices`,
/// `selector`, `all: true` (the others absent, `null` or `false`), with
/// `spec` required by `POST /v1/desired` and refused by `POST /v1/runs`.
#[cfg(feature = "openapi")]
pub mod schema {
    use std::borrow::Cow;

    use utoipa::openapi::schema::{
        AdditionalProperties, ObjectBuilder, OneOfBuilder, Schema, Type,
    };
    use utoipa::openapi::RefOr;

    use crate::api::bounds::schema as bounds;

    /// `POST /v1/desired`.
    pub struct DesiredRequest;
    /// `POST /v1/runs`.
    pub struct RunRequest;

    impl utoipa::PartialSchema for DesiredRequest {
        fn schema() -> RefOr<Schema> {
            RefOr::T(targeted(true))
        }
    }
    impl utoipa::ToSchema for DesiredRequest {
        fn name() -> Cow<'static, str> {
            Cow::Borrowed("DesiredRequest")
        }
    }
    impl utoipa::PartialSchema for RunRequest {
        fn schema() -> RefOr<Schema> {
            RefOr::T(targeted(false))
        }
    }
    impl utoipa::ToSchema for RunRequest {
        fn name() -> Cow<'static, str> {
            Cow::Borrowed("RunRequest")
        }
    }

    fn null() -> Schema {
        ObjectBuilder::new().schema_type(Type::Null).into()
    }

    fn boolean(only: Option<bool>) -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::Boolean)
            .enum_values(only.map(|b| [b]))
            .into()
    }

    fn selector() -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property("labels", bounds::selector_labels())
            .required("labels")
            .additional_properties(Some(AdditionalProperties::FreeForm(false)))
            .into()
    }

    /// One way of targeting (`way` is required, the other two are absent,
    /// `null` or `false`).
    fn way(way: &str, with_spec: bool) -> Schema {
        let targeted = match way {
            "devices" => bounds::target_ids(),
            "selector" => selector(),
            _ => boolean(Some(true)),
        };
        let mut object = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(way, targeted)
            .required(way)
            .property("force", boolean(None))
            .additional_properties(Some(AdditionalProperties::FreeForm(false)));
        for other in ["devices", "selector", "all"] {
            if other != way {
                let absent = if other == "all" {
                    boolean(Some(false))
                } else {
                    null()
                };
                object = object.property(other, absent);
            }
        }
        object = if with_spec {
            object
                .property("spec", bounds::spec_not_null())
                .required("spec")
                .property("rollout", crate::api::rollouts::schema::optional_rollout())
        } else {
            object.property("spec", null()).property("rollout", null())
        };
        object.into()
    }

    fn targeted(with_spec: bool) -> Schema {
        let description = if with_spec {
            "exactly one of `devices`, `selector`, `all: true`, and the new desired `spec`; `force` pushes even to devices whose digest matches"
        } else {
            "exactly one of `devices`, `selector`, `all: true`; `force` pushes even to devices whose digest matches"
        };
        OneOfBuilder::new()
            .item(way("devices", with_spec))
            .item(way("selector", with_spec))
            .item(way("all", with_spec))
            .description(Some(description))
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(value: Value) -> TargetedRequest {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn each_way_of_targeting_reads_from_the_json_it_always_had() {
        assert_eq!(
            body(json!({"devices": ["a", "b", "a"]})).targeting(10),
            Ok(Targeting::Devices(vec![
                DeviceId::parse("a").unwrap(),
                DeviceId::parse("b").unwrap()
            ]))
        );
        let labels = BTreeMap::from([("site".to_owned(), "north".to_owned())]);
        assert_eq!(
            body(json!({"selector": {"labels": {"site": "north"}}})).targeting(10),
            Ok(Targeting::Selector(labels))
        );
        assert_eq!(
            body(json!({"all": true, "force": true})).targeting(10),
            Ok(Targeting::All)
        );
    }

    #[test]
    fn bad_combinations_are_refused_with_the_api_texts() {
        for bad in [
            json!({}),
            json!({"all": false}),
            json!({"all": true, "devices": ["a"]}),
            json!({"selector": {"labels": {"a": "b"}}, "devices": ["a"]}),
        ] {
            let error = body(bad.clone()).targeting(10).unwrap_err();
            assert_eq!(error, TargetingError::NotExactlyOne, "{bad}");
            assert_eq!(error.code(), ErrorCode::InvalidTargets);
        }
        assert_eq!(
            TargetingError::NotExactlyOne.to_string(),
            "give exactly one of `devices` (a list of ids), `selector` ({\"labels\": {...}}) or `all: true`"
        );
        assert_eq!(
            body(json!({"devices": []})).targeting(10),
            Err(TargetingError::EmptyDevices)
        );
        assert_eq!(
            body(json!({"selector": {"labels": {}}})).targeting(10),
            Err(TargetingError::EmptySelector)
        );
        assert_eq!(
            body(json!({"devices": ["a", "b"]})).targeting(1),
            Err(TargetingError::TooManyDevices { got: 2, limit: 1 })
        );
        assert!(matches!(
            body(json!({"devices": ["a/b"]})).targeting(10),
            Err(TargetingError::InvalidDeviceId { .. })
        ));
    }

    #[test]
    fn a_targeting_is_sent_as_the_json_the_api_reads() {
        let all = TargetedRequest::new(&Targeting::All).forced(true);
        assert_eq!(
            serde_json::to_value(&all).unwrap(),
            json!({"all": true, "force": true})
        );
        let ids = Targeting::Devices(vec![DeviceId::parse("a").unwrap()]);
        let desired = TargetedRequest::new(&ids).with_spec(json!({"v": 1}));
        assert_eq!(
            serde_json::to_value(&desired).unwrap(),
            json!({"devices": ["a"], "spec": {"v": 1}})
        );
        assert_eq!(desired.targeting(10), Ok(ids));
    }
}
