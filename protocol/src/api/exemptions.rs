//! Bodies of `/v1/exemptions`: an operator's drift exemption for one device
//! or the devices a label selector matches, with a reason and an expiry.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{Approval, Selector};

/// The body of `POST /v1/exemptions`: exactly one of `device`, `selector`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExemptionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<Selector>,
    /// Why: shown with the exemption and in the audit trail.
    #[serde(default)]
    pub reason: String,
    /// How long it lasts, e.g. `4h`, `7d` (required; at most the server's
    /// `--exemption-max`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in: Option<String>,
}

/// An exemption as `POST /v1/exemptions` and `GET /v1/exemptions` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExemptionView {
    pub id: Uuid,
    pub device: Option<String>,
    pub selector: Option<Selector>,
    pub reason: String,
    /// The operator token that made it.
    pub author: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// Registered devices it covers now.
    pub devices: u64,
    /// Whether it needs another operator's approval (made while an approval
    /// policy covered one of its devices, or every change needs approval),
    /// and who gave it. Until approved, it exempts no device; one that did
    /// not need approval exempts no device a policy covers until approved.
    pub approval: Approval,
}

/// `GET /v1/exemptions`: every exemption that has not expired, soonest to
/// expire first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExemptionList {
    pub exemptions: Vec<ExemptionView>,
}

#[cfg(feature = "openapi")]
pub mod schema {
    use std::borrow::Cow;

    use utoipa::openapi::schema::{
        AdditionalProperties, ObjectBuilder, OneOfBuilder, Schema, Type,
    };
    use utoipa::openapi::RefOr;

    use crate::api::bounds::schema as bounds;

    /// `POST /v1/exemptions`.
    pub struct ExemptionRequest;

    impl utoipa::PartialSchema for ExemptionRequest {
        fn schema() -> RefOr<Schema> {
            RefOr::T(
                OneOfBuilder::new()
                    .item(way("device"))
                    .item(way("selector"))
                    .description(Some(
                        "exactly one of `device` (an id) and `selector`, a non-empty `reason` \
                         and `expires_in` (required, at most the server's `--exemption-max`)",
                    ))
                    .into(),
            )
        }
    }
    impl utoipa::ToSchema for ExemptionRequest {
        fn name() -> Cow<'static, str> {
            Cow::Borrowed("ExemptionRequest")
        }
    }

    fn way(way: &str) -> Schema {
        let null: Schema = ObjectBuilder::new().schema_type(Type::Null).into();
        let selector: Schema = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property("labels", bounds::selector_labels())
            .required("labels")
            .additional_properties(Some(AdditionalProperties::FreeForm(false)))
            .into();
        let (target, other, other_name) = if way == "device" {
            (bounds::device_id(), null, "selector")
        } else {
            (selector, null, "device")
        };
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(way, target)
            .required(way)
            .property(other_name, other)
            .property("reason", bounds::exemption_reason())
            .required("reason")
            .property("expires_in", bounds::exemption_lifetime())
            .required("expires_in")
            .additional_properties(Some(AdditionalProperties::FreeForm(false)))
            .into()
    }
}
