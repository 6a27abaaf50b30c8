//! The fixed label values of the labelled series: why a message, a request,
//! a connection or a stream was refused or dropped, and what became of a
//! report. Each table or enum lists every value, so each series is
//! registered at 0 for all of them.

/// Why an inbound MQTT message was refused; label values of
/// `idem_reports_rejected_total`.
pub const REJECT_REASONS: [&str; 10] = [
    "malformed",
    "oversized",
    "nul_character",
    "seq_out_of_range",
    "invalid_device_id",
    "invalid_topic",
    "unknown_channel",
    "unknown_device",
    "invalid_status",
    "db_refused",
];

/// What the server refused to hand its MQTT client; label values of
/// `idem_publishes_refused_total`.
pub const REFUSED_PUBLISH_KINDS: [&str; 2] = ["desired", "event"];

/// Results of an inbound report; label values of `idem_reports_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportResult {
    Applied,
    Duplicate,
    Stale,
    Rejected,
}

impl ReportResult {
    pub(super) const ALL: [ReportResult; 4] = [
        ReportResult::Applied,
        ReportResult::Duplicate,
        ReportResult::Stale,
        ReportResult::Rejected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReportResult::Applied => "applied",
            ReportResult::Duplicate => "duplicate",
            ReportResult::Stale => "stale",
            ReportResult::Rejected => "rejected",
        }
    }
}

/// The `action` values of `idem_plans_total`: plans made, approved,
/// applied, and refused at apply (stale or applied already; expired); and
/// desired changes refused because they need an approval they lack.
pub const PLAN_ACTIONS: [&str; 6] = [
    "created",
    "approved",
    "applied",
    "refused_stale",
    "refused_expired",
    "refused_unapproved",
];

/// Why an API call was refused by authentication or authorisation: label
/// values of `idem_http_auth_refusals_total` (`auth::Refusal::reason`).
pub const AUTH_REFUSAL_REASONS: [&str; 5] =
    ["missing", "unknown", "expired", "revoked", "forbidden"];

/// Why a request was answered before (or instead of) its handler's answer;
/// label values of `idem_http_requests_rejected_total` (answered by `http`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyRejection {
    TooLarge,
    Timeout,
}

impl BodyRejection {
    pub const ALL: [BodyRejection; 2] = [BodyRejection::TooLarge, BodyRejection::Timeout];

    pub fn as_str(self) -> &'static str {
        match self {
            BodyRejection::TooLarge => "body_too_large",
            BodyRejection::Timeout => "body_timeout",
        }
    }
}

/// Why a request was answered with an error before it reached a handler,
/// for its head (request line and headers); label values of
/// `idem_http_requests_rejected_total` next to [`BodyRejection`]'s
/// (answered by `http`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadRejection {
    /// 414: the request target is longer than the server accepts.
    UriTooLong,
    /// 431: the head is larger, or has more header fields, than accepted.
    HeadersTooLarge,
    /// 400: the head is not HTTP/1.1.
    Malformed,
}

impl HeadRejection {
    pub const ALL: [HeadRejection; 3] = [
        HeadRejection::UriTooLong,
        HeadRejection::HeadersTooLarge,
        HeadRejection::Malformed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            HeadRejection::UriTooLong => "uri_too_long",
            HeadRejection::HeadersTooLarge => "headers_too_large",
            HeadRejection::Malformed => "malformed_request",
        }
    }
}

/// Why a connection was answered and closed as soon as it was accepted;
/// label values of `idem_http_connections_refused_total` (refused by `http`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionRefusal {
    /// `--http-max-connections` were open.
    MaxConnections,
    /// Its client address (IPv6: its /64) had
    /// `--http-max-connections-per-peer` open.
    PerPeer,
}

impl ConnectionRefusal {
    pub const ALL: [ConnectionRefusal; 2] = [
        ConnectionRefusal::MaxConnections,
        ConnectionRefusal::PerPeer,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ConnectionRefusal::MaxConnections => "max_connections",
            ConnectionRefusal::PerPeer => "max_connections_per_peer",
        }
    }
}

/// Why `GET /v1/events` was refused a stream; label values of
/// `idem_sse_clients_refused_total` (refused by `sse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SseRefusal {
    /// `--sse-max-clients` streams were open.
    MaxClients,
    /// Only the slots kept for admin tokens were free.
    AdminReserve,
    /// The caller's token (without a token: its address) had
    /// `--sse-max-clients-per-token` streams open.
    PerToken,
}

impl SseRefusal {
    pub const ALL: [SseRefusal; 3] = [
        SseRefusal::MaxClients,
        SseRefusal::AdminReserve,
        SseRefusal::PerToken,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SseRefusal::MaxClients => "max_clients",
            SseRefusal::AdminReserve => "admin_reserve",
            SseRefusal::PerToken => "per_token",
        }
    }
}

/// Why an SSE client was dropped; label values of
/// `idem_sse_clients_dropped_total` (dropped by `sse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Its queue stayed full for `--sse-send-timeout`.
    SendTimeout,
    /// It fell further behind the live feed than its buffer holds.
    Lagged,
}

impl DropReason {
    pub const ALL: [DropReason; 2] = [DropReason::SendTimeout, DropReason::Lagged];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::SendTimeout => "send_timeout",
            DropReason::Lagged => "lagged",
        }
    }
}

/// The `state` values of `idem_rollouts`.
pub const ROLLOUT_STATES: [&str; 5] = [
    "running",
    "paused_gate",
    "paused_manual",
    "paused_approval",
    "paused_timed",
];

/// The `step` values of `idem_rollout_steps_total`: the rollout events'
/// types without their `io.idem.rollout.` prefix.
pub const ROLLOUT_STEP_NAMES: [&str; 6] = [
    "wave_started",
    "wave_completed",
    "paused",
    "resumed",
    "approved",
    "aborted",
];
