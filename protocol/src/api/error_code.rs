//! Every `code` of the API's error answer (`{"error": {"code", "message"}}`),
//! defined once: the server answers with these, the OpenAPI document lists
//! them (schema `ErrorCode`), clients match on them. The message beside a
//! code is for people and may change; the code does not.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Declares the enum, its `ALL` list and its wire names from one list, so a
/// code cannot be spelled two ways.
macro_rules! error_codes {
    ($( $(#[doc = $doc:literal])* $variant:ident = $name:literal, )+) => {
        /// A stable, machine-readable error code of the API.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(rename_all = "snake_case")]
        pub enum ErrorCode {
            $( $(#[doc = $doc])* $variant, )+
        }

        impl ErrorCode {
            /// Every code, in the order they are declared.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),+];

            /// The code as it appears in an answer.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $name,)+
                }
            }
        }
    };
}

error_codes! {
    // The request as HTTP.
    /// The body is not JSON.
    InvalidJson = "invalid_json",
    /// The body is JSON of the wrong shape (a missing, unknown or mistyped field).
    InvalidBody = "invalid_body",
    /// The query string does not fit the route's parameters.
    InvalidQuery = "invalid_query",
    /// A path segment does not fit the route's parameter.
    InvalidPath = "invalid_path",
    /// A body was sent without `Content-Type: application/json`.
    UnsupportedMediaType = "unsupported_media_type",
    /// The body is larger than `--http-max-body-bytes`.
    BodyTooLarge = "body_too_large",
    /// The body did not arrive within `--http-body-timeout`.
    BodyTimeout = "body_timeout",
    /// The request line is too long.
    UriTooLong = "uri_too_long",
    /// The request headers are too large.
    HeadersTooLarge = "headers_too_large",
    /// Not an HTTP/1.1 request the server can read.
    MalformedRequest = "malformed_request",
    /// The route exists, but not with this method (the `Allow` header lists those it has).
    MethodNotAllowed = "method_not_allowed",
    /// No route has this path.
    NotFound = "not_found",
    // Access.
    /// No token, or one that is unknown, expired or revoked.
    Unauthorized = "unauthorized",
    /// The token's role is below the one the route needs.
    Forbidden = "forbidden",
    // Limits.
    /// The server has `--http-max-connections` open.
    TooManyConnections = "too_many_connections",
    /// This client address has `--http-max-connections-per-peer` open.
    TooManyConnectionsFromPeer = "too_many_connections_from_peer",
    /// The server has `--sse-max-clients` event streams open.
    TooManySseClients = "too_many_sse_clients",
    /// This token has `--sse-max-clients-per-token` event streams open.
    TooManySseClientsForToken = "too_many_sse_clients_for_token",
    /// The free event-stream slots are kept for admin tokens.
    SseClientsReservedForAdmins = "sse_clients_reserved_for_admins",
    /// A list in the request is longer than its limit.
    TooManyItems = "too_many_items",
    // Values in the request.
    /// A device id breaks the id rules.
    InvalidDeviceId = "invalid_device_id",
    /// A registration names a device twice.
    DuplicateDeviceId = "duplicate_device_id",
    /// `labels` is not a flat object of bounded strings.
    InvalidLabels = "invalid_labels",
    /// A `label` filter is not `key:value`.
    InvalidLabel = "invalid_label",
    /// A spec is not a JSON object the protocol can carry.
    InvalidSpec = "invalid_spec",
    /// A spec is larger than `--max-spec-bytes` in canonical JSON.
    SpecTooLarge = "spec_too_large",
    /// `POST /v1/desired` without `spec`.
    MissingSpec = "missing_spec",
    /// `POST /v1/runs` with a `spec` (set desired state with `POST /v1/desired`).
    UnexpectedSpec = "unexpected_spec",
    /// Not exactly one of `devices`, `selector`, `all: true`.
    InvalidTargets = "invalid_targets",
    /// `devices` is empty.
    EmptyTargets = "empty_targets",
    /// `selector.labels` is empty.
    EmptySelector = "empty_selector",
    /// A `status` filter that is no device status.
    InvalidStatus = "invalid_status",
    /// A `health` filter that is no health.
    InvalidHealth = "invalid_health",
    /// An `outcome` filter that is no outcome kind.
    InvalidOutcome = "invalid_outcome",
    /// A page `limit` outside 1..=1000.
    InvalidLimit = "invalid_limit",
    /// A run id that is not a UUID.
    InvalidRunId = "invalid_run_id",
    /// An exemption id that is not a UUID.
    InvalidExemptionId = "invalid_exemption_id",
    /// An exemption's reason is empty or too long.
    InvalidReason = "invalid_reason",
    /// An exemption without `expires_in`.
    MissingExpiry = "missing_expiry",
    /// A plan id that is not a UUID.
    InvalidPlanId = "invalid_plan_id",
    /// An owned-field path that is no path, too long, or a list or a
    /// selector count beyond its bound.
    InvalidOwnedFields = "invalid_owned_fields",
    /// A `Last-Event-ID` (or `after`) that is not an event sequence number.
    InvalidLastEventId = "invalid_last_event_id",
    /// A token name that breaks the name rules.
    InvalidTokenName = "invalid_token_name",
    /// A role that is not `viewer`, `operator` or `admin`.
    InvalidRole = "invalid_role",
    /// An `expires_in` that is not a duration such as `30d`.
    InvalidExpiry = "invalid_expiry",
    /// A broker password that breaks the password rules.
    InvalidBrokerPassword = "invalid_broker_password",
    /// An approval policy id that is not a UUID.
    InvalidApprovalPolicyId = "invalid_approval_policy_id",
    /// A `rollout` whose waves do not increase, do not end at `"100%"`,
    /// or whose pause or gates are out of range (the message names the
    /// field).
    InvalidRollout = "invalid_rollout",
    // State.
    /// No device with this id is registered.
    UnknownDevice = "unknown_device",
    /// No run has this id.
    UnknownRun = "unknown_run",
    /// No token has this name.
    UnknownToken = "unknown_token",
    /// A token with this name exists.
    TokenExists = "token_exists",
    /// The device is not quarantined (nothing to retry).
    NotQuarantined = "not_quarantined",
    /// None of the run's devices is quarantined.
    NothingQuarantined = "nothing_quarantined",
    /// The selector matches no registered device.
    NoMatchingDevices = "no_matching_devices",
    /// No exemption in force has this id.
    UnknownExemption = "unknown_exemption",
    /// As many exemptions are in force as the server allows.
    TooManyExemptions = "too_many_exemptions",
    /// No plan has this id (a plan is kept until it expired as long ago as
    /// it lived).
    UnknownPlan = "unknown_plan",
    /// The operator keeps as many plans in use as one may, or the server as
    /// many as it keeps of all operators together.
    TooManyPlans = "too_many_plans",
    /// The token has as many large reads (plan or device pages) in
    /// progress as one token may: wait for one to finish.
    TooManyLargeReads = "too_many_large_reads",
    /// As many large reads are in progress as the server serves at once,
    /// and none ended in time: retry later.
    LargeReadsBusy = "large_reads_busy",
    /// The plan is past its `expires_at`: re-plan.
    PlanExpired = "plan_expired",
    /// What the plan was computed on changed (the message says what), or
    /// it was applied already: re-plan.
    PlanStale = "plan_stale",
    /// The run was not started with a `rollout`.
    NotARollout = "not_a_rollout",
    /// The rollout's state does not allow the action (the message says
    /// which state it is in).
    RolloutState = "rollout_state",
    /// An operator tried to approve their own change; another operator's
    /// token must.
    SelfApproval = "self_approval",
    /// The change needs another operator's approval: make a plan
    /// (`POST /v1/plans`), have it approved (`POST /v1/plans/{id}/approve`),
    /// then apply it.
    ApprovalRequired = "approval_required",
    /// The plan or exemption was approved already (the message says by
    /// whom).
    AlreadyApproved = "already_approved",
    /// No declaration of owned fields waiting for approval has this id.
    UnknownOwnedFieldsProposal = "unknown_owned_fields_proposal",
    /// The path's proposal id is not a UUID.
    InvalidOwnedFieldsProposalId = "invalid_owned_fields_proposal_id",
    /// The declaration in force changed since the proposal was made:
    /// propose again against the one in force.
    OwnedFieldsChanged = "owned_fields_changed",
    /// As many declarations wait for approval as the server keeps.
    TooManyOwnedFieldsProposals = "too_many_owned_fields_proposals",
    /// No approval policy has this id.
    UnknownApprovalPolicy = "unknown_approval_policy",
    /// As many approval policies exist as the server allows.
    TooManyApprovalPolicies = "too_many_approval_policies",
    /// The device id is the user name of another broker account.
    ReservedBrokerAccount = "reserved_broker_account",
    /// The server does not manage broker accounts (`--broker-accounts none`).
    BrokerAccountsUnmanaged = "broker_accounts_unmanaged",
    /// The broker refused or failed an account change.
    BrokerAccountsFailed = "broker_accounts_failed",
    /// `--broker-accounts-file` could not be read.
    BrokerAccountsFileUnreadable = "broker_accounts_file_unreadable",
    // The server.
    /// PostgreSQL is unavailable; retry later.
    DatabaseUnavailable = "database_unavailable",
    /// The server is stopping.
    ShuttingDown = "shutting_down",
    /// The instance holding the engine did not take up or answer an action
    /// asked through another instance in time (the message says which).
    EngineNotAnswering = "engine_not_answering",
    /// A fault of the server; the details are in its log.
    Internal = "internal",
}

impl ErrorCode {
    /// The code named `raw`, if it is one.
    pub fn parse(raw: &str) -> Option<Self> {
        ErrorCode::ALL.iter().copied().find(|c| c.as_str() == raw)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_written_as_serde_writes_it_and_parses_back() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, serde_json::Value::from(code.as_str()), "{code:?}");
            assert_eq!(ErrorCode::parse(code.as_str()), Some(*code));
        }
        assert_eq!(ErrorCode::parse("no_such_code"), None);
    }

    #[test]
    fn no_two_codes_share_a_name() {
        let mut names: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len());
    }
}
