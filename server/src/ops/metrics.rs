//! Prometheus metrics of one server instance: a private recorder (not the
//! process-global one, so several servers can share a test process) and
//! pre-registered handles, every label value initialised to 0. Each series'
//! name, kind and help text is written once, in the family table below.
//!
//! Never a device id as a label: per-device detail lives in Postgres and the
//! event stream.

use std::marker::PhantomData;

use idem_protocol::{DeviceStatus, OutcomeCounts, OutcomeKind};

use crate::reconcile::machine::AskReason;
use crate::reconcile::machine::RecheckTrigger;
use metrics::{
    Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder, SharedString, Unit,
};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

const METADATA: Metadata<'static> = Metadata::new("idem", Level::INFO, Some(module_path!()));

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
    const ALL: [ReportResult; 4] = [
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

/// Handles to every series the server writes.
pub struct Metrics {
    /// Renders what the handles below record (the recorder's shared state).
    handle: PrometheusHandle,
    outcomes: [Counter; OutcomeKind::ALL.len()],
    reports: [Counter; 4],
    rejects: [Counter; REJECT_REASONS.len()],
    refused_publishes: [Counter; REFUSED_PUBLISH_KINDS.len()],
    /// Applied reports whose `health` was not a protocol word.
    pub health_unknown: Counter,
    /// Report batches the database refused, split to isolate the refused report.
    pub ingest_batch_splits: Counter,
    auth_refusals: [Counter; AUTH_REFUSAL_REASONS.len()],
    /// Retained desired messages refreshed without a push (the device
    /// already ran the new desired spec, or was not attempted).
    pub retained_updates: Counter,
    pub pushes: Counter,
    pub report_requests: Counter,
    pub runs_started: Counter,
    pub runs_completed: Counter,
    pub run_duration: Histogram,
    pub convergence_latency: Histogram,
    pub db_batch_ingest: Histogram,
    pub db_batch_outcomes: Histogram,
    pub mqtt_connected: Gauge,
    pub mqtt_reconnects: Counter,
    asked_to_report: [Counter; AskReason::ALL.len()],
    /// Rechecks started, by what started them.
    rechecks: [Counter; RecheckTrigger::ALL.len()],
    /// The broker's own counters (`$SYS`), as last read.
    pub broker_messages_dropped: Gauge,
    pub broker_messages_stored: Gauge,
    /// Times the intake queue reached its byte budget (the server then
    /// stopped reading the broker until the ingest caught up).
    pub intake_full: Counter,
    /// Received messages waiting for the ingest, their bytes, the oldest's age.
    pub intake_messages: Gauge,
    pub intake_bytes: Gauge,
    pub intake_oldest: Gauge,
    pub attempts_in_flight: Gauge,
    pub pushes_in_flight: Gauge,
    pub push_queue_depth: Gauge,
    pub retries: Counter,
    pub quarantined: Counter,
    pub drifts: Counter,
    pub unhealthy_converged: Gauge,
    pub fleet_cache_bytes: Gauge,
    devices_by_status: [Gauge; DeviceStatus::ALL.len()],
    last_run: [Gauge; OutcomeKind::ALL.len()],
    pub events_committed: Counter,
    pub events_published: Counter,
    pub event_log_lag: Gauge,
    pub http_connections: Gauge,
    http_connections_refused: [Counter; ConnectionRefusal::ALL.len()],
    http_rejected: [Counter; BodyRejection::ALL.len()],
    http_head_rejected: [Counter; HeadRejection::ALL.len()],
    pub sse_clients: Gauge,
    sse_refused: [Counter; SseRefusal::ALL.len()],
    sse_dropped: [Counter; DropReason::ALL.len()],
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

const SECONDS_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const DB_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

// Every series the server exposes: name, kind and help text, once each.

const DEVICE_OUTCOMES: Family<Counter> = Family::new(
    "idem_device_outcomes_total",
    "Device outcomes decided, by outcome (one per device per run)",
);
const REPORTS: Family<Counter> = Family::new(
    "idem_reports_total",
    "Inbound device reports by result (applied, duplicate, stale, rejected)",
);
const REPORTS_REJECTED: Family<Counter> = Family::new(
    "idem_reports_rejected_total",
    "Inbound MQTT messages refused, by reason",
);
const PUBLISHES_REFUSED: Family<Counter> = Family::new(
    "idem_publishes_refused_total",
    "Messages not handed to the MQTT client because they exceed the size budget, by kind",
);
const REPORTS_HEALTH_UNKNOWN: Family<Counter> = Family::new(
    "idem_reports_health_unknown_total",
    "Applied reports whose health was not healthy, degraded or unhealthy (kept, health unknown)",
);
const HTTP_AUTH_REFUSALS: Family<Counter> = Family::new(
    "idem_http_auth_refusals_total",
    "API calls refused for a missing, unknown, expired or revoked token (401) or a too weak role (403)",
);
const INGEST_BATCH_SPLITS: Family<Counter> = Family::new(
    "idem_ingest_batch_splits_total",
    "Report batches the database refused, split to isolate the refused report",
);
const RETAINED_UPDATES: Family<Counter> = Family::new(
    "idem_retained_updates_total",
    "Retained desired messages refreshed without a push, so the retained state is always current",
);
const PUSHES: Family<Counter> =
    Family::new("idem_pushes_total", "Desired-state publishes to devices");
const REPORT_REQUESTS: Family<Counter> = Family::new(
    "idem_report_requests_total",
    "`get` requests sent to devices that had never reported",
);
const RUNS_STARTED: Family<Counter> =
    Family::new("idem_runs_started_total", "Reconciliation runs started");
const RUNS_COMPLETED: Family<Counter> =
    Family::new("idem_runs_completed_total", "Reconciliation runs completed");
const RUN_DURATION: Family<Histogram> = Family::new(
    "idem_run_duration_seconds",
    "Run duration from trigger to last outcome",
);
const CONVERGENCE_LATENCY: Family<Histogram> = Family::new(
    "idem_convergence_latency_seconds",
    "Desired-state write to device confirmation, for provisioned devices",
);
const DB_BATCH_DURATION: Family<Histogram> = Family::new(
    "idem_db_batch_duration_seconds",
    "Duration of one database write batch",
);
const MQTT_CONNECTED: Family<Gauge> = Family::new(
    "idem_mqtt_connected",
    "1 while the server's MQTT connection is up",
);
const MQTT_RECONNECTS: Family<Counter> = Family::new(
    "idem_mqtt_reconnects_total",
    "MQTT connections re-established after a loss",
);
const ASKED_TO_REPORT: Family<Counter> = Family::new(
    "idem_devices_asked_to_report_total",
    "Report requests sent to devices, by reason",
);
const RECHECKS: Family<Counter> = Family::new(
    "idem_rechecks_total",
    "FleetCache rechecks started because the broker may have dropped messages, by trigger",
);
const BROKER_DROPPED: Family<Gauge> = Family::new(
    "idem_broker_messages_dropped",
    "The broker's count of messages it dropped (Mosquitto $SYS/broker/publish/messages/dropped)",
);
const BROKER_STORED: Family<Gauge> = Family::new(
    "idem_broker_messages_stored",
    "Messages the broker holds (Mosquitto $SYS/broker/store/messages/count)",
);
const INTAKE_FULL: Family<Counter> = Family::new(
    "idem_mqtt_intake_full_total",
    "Times the MQTT intake reached --mqtt-intake-buffer-bytes and reading paused",
);
const INTAKE_MESSAGES: Family<Gauge> = Family::new(
    "idem_mqtt_intake_messages",
    "Received MQTT messages waiting for the ingest",
);
const INTAKE_BYTES: Family<Gauge> = Family::new(
    "idem_mqtt_intake_bytes",
    "Bytes of received MQTT messages waiting for the ingest",
);
const INTAKE_OLDEST: Family<Gauge> = Family::new(
    "idem_mqtt_intake_oldest_seconds",
    "How long the oldest received MQTT message has waited for the ingest",
);
const ATTEMPTS_IN_FLIGHT: Family<Gauge> = Family::new(
    "idem_attempts_in_flight",
    "Devices with a push or report request awaiting an answer",
);
const DEVICES: Family<Gauge> = Family::new("idem_devices", "Registered devices by status");
const LAST_RUN_DEVICES: Family<Gauge> = Family::new(
    "idem_last_run_devices",
    "Outcome counts of the most recently completed run",
);
const EVENTS_COMMITTED: Family<Counter> = Family::new(
    "idem_events_committed_total",
    "Outcome events committed to the event log",
);
const EVENTS_PUBLISHED: Family<Counter> = Family::new(
    "idem_events_published_total",
    "Committed events relayed to MQTT and live SSE streams",
);
const EVENT_LOG_LAG: Family<Gauge> = Family::new(
    "idem_event_log_lag_events",
    "Committed events not yet relayed",
);
const PUSHES_IN_FLIGHT: Family<Gauge> = Family::new(
    "idem_pushes_in_flight",
    "Pushes awaiting the device's confirmation",
);
const PUSH_QUEUE_DEPTH: Family<Gauge> = Family::new(
    "idem_push_queue_depth",
    "Pushes waiting for the rate limit or the in-flight cap",
);
const RETRIES: Family<Counter> = Family::new(
    "idem_retries_total",
    "Failed attempts scheduled for another try",
);
const QUARANTINED: Family<Counter> = Family::new(
    "idem_quarantined_total",
    "Devices quarantined after their last allowed attempt failed",
);
const DRIFT_DETECTED: Family<Counter> = Family::new(
    "idem_drift_detected_total",
    "Converged devices that reported a different spec",
);
const DEVICES_UNHEALTHY: Family<Gauge> = Family::new(
    "idem_devices_unhealthy",
    "Converged devices whose report says degraded or unhealthy",
);
const FLEET_CACHE_BYTES: Family<Gauge> = Family::new(
    "idem_fleet_cache_bytes",
    "Estimated bytes of the in-memory fleet cache (table slots, ids, refusal messages, distinct desired specs)",
);
const HTTP_CONNECTIONS: Family<Gauge> =
    Family::new("idem_http_connections", "Open HTTP connections");
const HTTP_CONNECTIONS_REFUSED: Family<Counter> = Family::new(
    "idem_http_connections_refused_total",
    "HTTP connections answered and closed at once because --http-max-connections were open, or --http-max-connections-per-peer from their address, by reason",
);
const HTTP_REQUESTS_REJECTED: Family<Counter> = Family::new(
    "idem_http_requests_rejected_total",
    "HTTP requests answered with an error by a head or body limit, by reason",
);
const SSE_CLIENTS: Family<Gauge> =
    Family::new("idem_sse_clients", "Connected SSE clients (GET /v1/events)");
const SSE_CLIENTS_REFUSED: Family<Counter> = Family::new(
    "idem_sse_clients_refused_total",
    "GET /v1/events requests refused a stream by the stream cap, the admin reserve or the per-token cap, by reason",
);
const SSE_CLIENTS_DROPPED: Family<Counter> = Family::new(
    "idem_sse_clients_dropped_total",
    "SSE clients disconnected because they did not keep up, by reason",
);

impl Metrics {
    pub fn new() -> Self {
        let builder = PrometheusBuilder::new();
        // Bucket lists are non-empty constants, so these cannot fail.
        let builder = builder
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Prefix("idem_db_".into()), &DB_BUCKETS))
            .unwrap_or_else(|_| unreachable!("bucket lists are non-empty"));
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        let r = &recorder;
        Self {
            outcomes: OutcomeKind::ALL
                .map(|k| DEVICE_OUTCOMES.register(r, &[("outcome", k.as_str())])),
            reports: ReportResult::ALL.map(|res| REPORTS.register(r, &[("result", res.as_str())])),
            rejects: REJECT_REASONS
                .map(|reason| REPORTS_REJECTED.register(r, &[("reason", reason)])),
            refused_publishes: REFUSED_PUBLISH_KINDS
                .map(|kind| PUBLISHES_REFUSED.register(r, &[("kind", kind)])),
            health_unknown: REPORTS_HEALTH_UNKNOWN.register(r, &[]),
            auth_refusals: AUTH_REFUSAL_REASONS
                .map(|reason| HTTP_AUTH_REFUSALS.register(r, &[("reason", reason)])),
            ingest_batch_splits: INGEST_BATCH_SPLITS.register(r, &[]),
            retained_updates: RETAINED_UPDATES.register(r, &[]),
            pushes: PUSHES.register(r, &[]),
            report_requests: REPORT_REQUESTS.register(r, &[]),
            runs_started: RUNS_STARTED.register(r, &[]),
            runs_completed: RUNS_COMPLETED.register(r, &[]),
            run_duration: RUN_DURATION.register(r, &[]),
            convergence_latency: CONVERGENCE_LATENCY.register(r, &[]),
            db_batch_ingest: DB_BATCH_DURATION.register(r, &[("batch", "ingest")]),
            db_batch_outcomes: DB_BATCH_DURATION.register(r, &[("batch", "outcomes")]),
            mqtt_connected: MQTT_CONNECTED.register(r, &[]),
            mqtt_reconnects: MQTT_RECONNECTS.register(r, &[]),
            intake_full: INTAKE_FULL.register(r, &[]),
            asked_to_report: AskReason::ALL
                .map(|reason| ASKED_TO_REPORT.register(r, &[("reason", reason.as_str())])),
            rechecks: RecheckTrigger::ALL
                .map(|trigger| RECHECKS.register(r, &[("trigger", trigger.as_str())])),
            broker_messages_dropped: BROKER_DROPPED.register(r, &[]),
            broker_messages_stored: BROKER_STORED.register(r, &[]),
            intake_messages: INTAKE_MESSAGES.register(r, &[]),
            intake_bytes: INTAKE_BYTES.register(r, &[]),
            intake_oldest: INTAKE_OLDEST.register(r, &[]),
            attempts_in_flight: ATTEMPTS_IN_FLIGHT.register(r, &[]),
            devices_by_status: DeviceStatus::ALL
                .map(|status| DEVICES.register(r, &[("status", status.as_str())])),
            last_run: OutcomeKind::ALL
                .map(|k| LAST_RUN_DEVICES.register(r, &[("outcome", k.as_str())])),
            events_committed: EVENTS_COMMITTED.register(r, &[]),
            events_published: EVENTS_PUBLISHED.register(r, &[]),
            event_log_lag: EVENT_LOG_LAG.register(r, &[]),
            pushes_in_flight: PUSHES_IN_FLIGHT.register(r, &[]),
            push_queue_depth: PUSH_QUEUE_DEPTH.register(r, &[]),
            retries: RETRIES.register(r, &[]),
            quarantined: QUARANTINED.register(r, &[]),
            drifts: DRIFT_DETECTED.register(r, &[]),
            unhealthy_converged: DEVICES_UNHEALTHY.register(r, &[]),
            fleet_cache_bytes: FLEET_CACHE_BYTES.register(r, &[]),
            http_connections: HTTP_CONNECTIONS.register(r, &[]),
            http_connections_refused: ConnectionRefusal::ALL
                .map(|reason| HTTP_CONNECTIONS_REFUSED.register(r, &[("reason", reason.as_str())])),
            http_rejected: BodyRejection::ALL
                .map(|reason| HTTP_REQUESTS_REJECTED.register(r, &[("reason", reason.as_str())])),
            http_head_rejected: HeadRejection::ALL
                .map(|reason| HTTP_REQUESTS_REJECTED.register(r, &[("reason", reason.as_str())])),
            sse_clients: SSE_CLIENTS.register(r, &[]),
            sse_refused: SseRefusal::ALL
                .map(|reason| SSE_CLIENTS_REFUSED.register(r, &[("reason", reason.as_str())])),
            sse_dropped: DropReason::ALL
                .map(|reason| SSE_CLIENTS_DROPPED.register(r, &[("reason", reason.as_str())])),
            handle,
        }
    }

    /// Sets `idem_devices{status}` from a count per status; statuses not in
    /// `counts` are 0.
    pub fn set_devices_by_status(&self, counts: &[(DeviceStatus, i64)]) {
        for (status, gauge) in DeviceStatus::ALL.iter().zip(&self.devices_by_status) {
            let n = counts
                .iter()
                .find(|(s, _)| s == status)
                .map_or(0, |(_, n)| *n);
            gauge.set(n as f64);
        }
    }

    pub fn outcome(&self, kind: OutcomeKind) -> &Counter {
        let index = match kind {
            OutcomeKind::AlreadyConverged => 0,
            OutcomeKind::Provisioned => 1,
            OutcomeKind::Failed => 2,
            OutcomeKind::Skipped => 3,
            OutcomeKind::Superseded => 4,
        };
        &self.outcomes[index]
    }

    /// Sets `idem_last_run_devices{outcome}` to a completed run's counts.
    pub fn set_last_run(&self, counts: &OutcomeCounts) {
        for (kind, gauge) in OutcomeKind::ALL.iter().zip(&self.last_run) {
            gauge.set(counts.get(*kind) as f64);
        }
    }

    pub fn report(&self, result: ReportResult) -> &Counter {
        let index = match result {
            ReportResult::Applied => 0,
            ReportResult::Duplicate => 1,
            ReportResult::Stale => 2,
            ReportResult::Rejected => 3,
        };
        &self.reports[index]
    }

    /// `idem_http_requests_rejected_total{reason}`.
    pub fn http_rejected(&self, rejection: BodyRejection) -> &Counter {
        let index = match rejection {
            BodyRejection::TooLarge => 0,
            BodyRejection::Timeout => 1,
        };
        &self.http_rejected[index]
    }

    /// `idem_http_requests_rejected_total{reason}` for a head limit.
    pub fn http_head_rejected(&self, rejection: HeadRejection) -> &Counter {
        let index = match rejection {
            HeadRejection::UriTooLong => 0,
            HeadRejection::HeadersTooLarge => 1,
            HeadRejection::Malformed => 2,
        };
        &self.http_head_rejected[index]
    }

    /// `idem_http_connections_refused_total{reason}`.
    pub fn http_connection_refused(&self, refusal: ConnectionRefusal) -> &Counter {
        let index = match refusal {
            ConnectionRefusal::MaxConnections => 0,
            ConnectionRefusal::PerPeer => 1,
        };
        &self.http_connections_refused[index]
    }

    /// `idem_sse_clients_refused_total{reason}`.
    pub fn sse_refused(&self, refusal: SseRefusal) -> &Counter {
        let index = match refusal {
            SseRefusal::MaxClients => 0,
            SseRefusal::AdminReserve => 1,
            SseRefusal::PerToken => 2,
        };
        &self.sse_refused[index]
    }

    /// `idem_sse_clients_dropped_total{reason}`.
    pub fn sse_dropped(&self, reason: DropReason) -> &Counter {
        let index = match reason {
            DropReason::SendTimeout => 0,
            DropReason::Lagged => 1,
        };
        &self.sse_dropped[index]
    }

    /// Counts a refused report under `reason` (one of [`REJECT_REASONS`]):
    /// `idem_reports_total{result="rejected"}` and the reason.
    pub fn reject_report(&self, reason: &str) {
        self.report(ReportResult::Rejected).increment(1);
        self.reject_message(reason);
    }

    /// Counts a refused message that is not a report (a status message, a
    /// topic outside the protocol): only the reason.
    pub fn reject_message(&self, reason: &str) {
        if let Some(i) = REJECT_REASONS.iter().position(|r| *r == reason) {
            self.rejects[i].increment(1);
        }
    }

    /// Counts a report request sent to a device.
    pub fn asked_to_report(&self, reason: AskReason) {
        if let Some(i) = AskReason::ALL.iter().position(|r| *r == reason) {
            self.asked_to_report[i].increment(1);
        }
    }

    /// Counts a recheck started by `trigger`.
    pub fn recheck_started(&self, trigger: RecheckTrigger) {
        if let Some(i) = RecheckTrigger::ALL.iter().position(|t| *t == trigger) {
            self.rechecks[i].increment(1);
        }
    }

    /// Counts an API call refused by authentication or authorisation (one
    /// of [`AUTH_REFUSAL_REASONS`]).
    pub fn auth_refused(&self, reason: &str) {
        if let Some(i) = AUTH_REFUSAL_REASONS.iter().position(|r| *r == reason) {
            self.auth_refusals[i].increment(1);
        }
    }

    /// Counts a message the publisher refused to send (one of
    /// [`REFUSED_PUBLISH_KINDS`]).
    pub fn publish_refused(&self, kind: &str) {
        if let Some(i) = REFUSED_PUBLISH_KINDS.iter().position(|k| *k == kind) {
            self.refused_publishes[i].increment(1);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.handle.render()
    }

    pub fn run_upkeep(&self) {
        self.handle.run_upkeep();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::from_static_parts(k, v))
        .collect();
    Key::from_parts(name, labels)
}

/// One metric family: its name and help text, and its kind as `M` (a
/// [`Counter`], [`Gauge`] or [`Histogram`]). Every histogram measures
/// seconds.
struct Family<M> {
    name: &'static str,
    help: &'static str,
    kind: PhantomData<fn() -> M>,
}

impl<M> Family<M> {
    const fn new(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            help,
            kind: PhantomData,
        }
    }

    fn help(&self) -> SharedString {
        SharedString::const_str(self.help)
    }
}

impl Family<Counter> {
    /// Describes the family and registers the series with `labels`, at 0.
    fn register(&self, r: &PrometheusRecorder, labels: &[(&'static str, &'static str)]) -> Counter {
        r.describe_counter(self.name.into(), None, self.help());
        let counter = r.register_counter(&key(self.name, labels), &METADATA);
        counter.increment(0);
        counter
    }
}

impl Family<Gauge> {
    /// Describes the family and registers the series with `labels`, at 0.
    fn register(&self, r: &PrometheusRecorder, labels: &[(&'static str, &'static str)]) -> Gauge {
        r.describe_gauge(self.name.into(), None, self.help());
        let gauge = r.register_gauge(&key(self.name, labels), &METADATA);
        gauge.set(0.0);
        gauge
    }
}

impl Family<Histogram> {
    /// Describes the family and registers the series with `labels`.
    fn register(
        &self,
        r: &PrometheusRecorder,
        labels: &[(&'static str, &'static str)],
    ) -> Histogram {
        r.describe_histogram(self.name.into(), Some(Unit::Seconds), self.help());
        r.register_histogram(&key(self.name, labels), &METADATA)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_series_is_exposed_at_zero_before_any_run() {
        let metrics = Metrics::new();
        let text = metrics.render();
        for kind in OutcomeKind::ALL {
            let line = format!(
                "idem_device_outcomes_total{{outcome=\"{}\"}} 0",
                kind.as_str()
            );
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
        assert!(text.contains("idem_reports_total{result=\"duplicate\"} 0"));
    }

    #[test]
    fn every_exposed_family_has_its_help_text() {
        let text = Metrics::new().render();
        let typed: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        assert_eq!(typed.len(), 44, "{text}");
        for name in typed {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("# HELP {name} ")) && l.len() > name.len() + 8),
                "no help text for {name} in\n{text}"
            );
        }
        assert!(text.contains("# TYPE idem_run_duration_seconds histogram"));
    }

    #[test]
    fn http_and_sse_series_are_exposed_at_zero_with_every_reason() {
        let text = Metrics::new().render();
        for line in [
            "idem_http_connections 0",
            "idem_http_connections_refused_total{reason=\"max_connections\"} 0",
            "idem_http_connections_refused_total{reason=\"max_connections_per_peer\"} 0",
            "idem_http_requests_rejected_total{reason=\"body_too_large\"} 0",
            "idem_http_requests_rejected_total{reason=\"body_timeout\"} 0",
            "idem_http_requests_rejected_total{reason=\"uri_too_long\"} 0",
            "idem_http_requests_rejected_total{reason=\"headers_too_large\"} 0",
            "idem_http_requests_rejected_total{reason=\"malformed_request\"} 0",
            "idem_sse_clients 0",
            "idem_sse_clients_refused_total{reason=\"max_clients\"} 0",
            "idem_sse_clients_refused_total{reason=\"admin_reserve\"} 0",
            "idem_sse_clients_refused_total{reason=\"per_token\"} 0",
            "idem_sse_clients_dropped_total{reason=\"send_timeout\"} 0",
            "idem_sse_clients_dropped_total{reason=\"lagged\"} 0",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn a_rejected_report_counts_both_the_result_and_the_reason() {
        let metrics = Metrics::new();
        metrics.reject_report("oversized");
        let text = metrics.render();
        assert!(
            text.contains("idem_reports_total{result=\"rejected\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("idem_reports_rejected_total{reason=\"oversized\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn a_refused_status_message_is_not_counted_as_a_report() {
        let metrics = Metrics::new();
        metrics.reject_message("invalid_status");
        let text = metrics.render();
        assert!(
            text.contains("idem_reports_total{result=\"rejected\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("idem_reports_rejected_total{reason=\"invalid_status\"} 1"),
            "{text}"
        );
    }
}
