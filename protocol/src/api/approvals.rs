//! Bodies of `/v1/approval-policies…`: a policy that desired changes to the
//! devices its selector matches need another operator's approval, and the
//! list of them.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::Selector;

/// The body of `POST /v1/approval-policies`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ApprovalPolicyRequest {
    pub selector: Selector,
    /// Why: shown with the policy and in the audit trail.
    #[cfg_attr(feature = "openapi", schema(schema_with = crate::api::bounds::schema::exemption_reason))]
    pub reason: String,
}

/// An approval policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApprovalPolicyView {
    pub id: Uuid,
    pub selector: Selector,
    pub reason: String,
    /// The admin token that made it.
    pub author: String,
    pub created_at: DateTime<Utc>,
    /// Registered devices it covers now.
    pub devices: u64,
}

/// `GET /v1/approval-policies`: every policy, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApprovalPolicyList {
    pub policies: Vec<ApprovalPolicyView>,
}
