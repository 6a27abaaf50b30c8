//! The body of `/v1/owned-fields`: the spec paths devices own, server-wide
//! and per label selector.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::Selector;

/// `PUT /v1/owned-fields` (the whole declaration, replacing the last) and
/// `GET /v1/owned-fields`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct OwnedFieldsDeclaration {
    /// Paths every device owns: `uptime`, `net.rssi`, `labels["a.b"]`.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::owned_paths))]
    pub fields: Vec<String>,
    /// Paths the devices a selector matches own, besides `fields`.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(max_items = 16))]
    pub by_selector: Vec<OwnedBySelector>,
}

/// Paths owned by the devices whose labels contain the selector's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct OwnedBySelector {
    pub selector: Selector,
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::owned_paths))]
    pub fields: Vec<String>,
}

/// `GET /v1/owned-fields` and the answer to `PUT /v1/owned-fields`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OwnedFieldsView {
    pub fields: Vec<String>,
    pub by_selector: Vec<OwnedBySelector>,
    /// Who declared it (`null`: nothing was ever declared).
    pub updated_by: Option<String>,
    pub updated_at: Option<DateTime<Utc>>,
    /// Registered devices that own at least one path now.
    pub devices: u64,
    /// `PUT` only: devices whose owned paths the declaration changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices_changed: Option<u64>,
    /// `PUT` only: the run re-evaluating the fleet with the new declaration
    /// (`null` for an empty fleet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<Uuid>,
    /// Declarations waiting for another operator's approval (not in force),
    /// oldest first.
    #[serde(default)]
    pub proposals: Vec<OwnedFieldsProposal>,
}

/// A declaration that would change what devices an approval policy covers
/// own (or any device's, when every change needs approval): the answer
/// `202` to `PUT /v1/owned-fields`, in force once a token other than its
/// author's approves it (`POST /v1/owned-fields/proposals/{id}/approve`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OwnedFieldsProposal {
    pub id: Uuid,
    pub fields: Vec<String>,
    pub by_selector: Vec<OwnedBySelector>,
    pub author: String,
    pub created_at: DateTime<Utc>,
    /// Why it needs approval (the flag, or the policy and how many of the
    /// devices whose owned paths it changes it covers).
    pub reason: String,
    /// Devices whose owned paths it changes, as judged when proposed.
    pub devices_changed: u64,
}
