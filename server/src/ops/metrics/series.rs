//! Every series the server exposes: name, kind and help text, once each.

use metrics::{Counter, Gauge, Histogram};

use super::family::Family;

pub(super) const DEVICE_OUTCOMES: Family<Counter> = Family::new(
    "idem_device_outcomes_total",
    "Device outcomes decided, by outcome (one per device per run)",
);
pub(super) const REPORTS: Family<Counter> = Family::new(
    "idem_reports_total",
    "Inbound device reports by result (applied, duplicate, stale, rejected)",
);
pub(super) const REPORTS_REJECTED: Family<Counter> = Family::new(
    "idem_reports_rejected_total",
    "Inbound MQTT messages refused, by reason",
);
pub(super) const PUBLISHES_REFUSED: Family<Counter> = Family::new(
    "idem_publishes_refused_total",
    "Messages not handed to the MQTT client because they exceed the size budget, by kind",
);
pub(super) const REPORTS_HEALTH_UNKNOWN: Family<Counter> = Family::new(
    "idem_reports_health_unknown_total",
    "Applied reports whose health was not healthy, degraded or unhealthy (kept, health unknown)",
);
pub(super) const HTTP_AUTH_REFUSALS: Family<Counter> = Family::new(
    "idem_http_auth_refusals_total",
    "API calls refused for a missing, unknown, expired or revoked token (401) or a too weak role (403)",
);
pub(super) const PLANS: Family<Counter> = Family::new(
    "idem_plans_total",
    "Plans (POST /v1/plans) by action: created, approved, applied, refused_stale (changed since, or applied already), refused_expired, refused_unapproved (a change needing approval made without an approved plan)",
);
pub(super) const INGEST_BATCH_SPLITS: Family<Counter> = Family::new(
    "idem_ingest_batch_splits_total",
    "Report batches the database refused, split to isolate the refused report",
);
pub(super) const RETAINED_UPDATES: Family<Counter> = Family::new(
    "idem_retained_updates_total",
    "Retained desired messages refreshed without a push, so the retained state is always current",
);
pub(super) const STALE_PUSHES: Family<Counter> = Family::new(
    "idem_stale_pushes_total",
    "Pushes and retained refreshes not sent because another instance changed the device's desired state after they were decided (the device is re-decided)",
);
pub(super) const PUSHES: Family<Counter> =
    Family::new("idem_pushes_total", "Desired-state publishes to devices");
pub(super) const REPORT_REQUESTS: Family<Counter> = Family::new(
    "idem_report_requests_total",
    "`get` requests sent to devices that had never reported",
);
pub(super) const SESSIONS_DRAINED: Family<Counter> = Family::new(
    "idem_sessions_drained_total",
    "MQTT sessions of stopped or dead instances this instance drained (shared subscriptions)",
);
pub(super) const DRAINED_MESSAGES: Family<Counter> = Family::new(
    "idem_drained_messages_total",
    "Messages found waiting in drained sessions of other instances, handed to the ingest",
);
pub(super) const RUNS_STARTED: Family<Counter> =
    Family::new("idem_runs_started_total", "Reconciliation runs started");
pub(super) const RUNS_COMPLETED: Family<Counter> =
    Family::new("idem_runs_completed_total", "Reconciliation runs completed");
pub(super) const RUN_DURATION: Family<Histogram> = Family::new(
    "idem_run_duration_seconds",
    "Run duration from trigger to last outcome",
);
pub(super) const CONVERGENCE_LATENCY: Family<Histogram> = Family::new(
    "idem_convergence_latency_seconds",
    "Desired-state write to device confirmation, for provisioned devices",
);
pub(super) const DB_BATCH_DURATION: Family<Histogram> = Family::new(
    "idem_db_batch_duration_seconds",
    "Duration of one database write batch",
);
pub(super) const MQTT_CONNECTED: Family<Gauge> = Family::new(
    "idem_mqtt_connected",
    "1 while the server's MQTT connection is up",
);
pub(super) const MQTT_RECONNECTS: Family<Counter> = Family::new(
    "idem_mqtt_reconnects_total",
    "MQTT connections re-established after a loss",
);
pub(super) const ASKED_TO_REPORT: Family<Counter> = Family::new(
    "idem_devices_asked_to_report_total",
    "Report requests sent to devices, by reason",
);
pub(super) const RECHECKS: Family<Counter> = Family::new(
    "idem_rechecks_total",
    "FleetCache rechecks started because the broker may have dropped messages, by trigger",
);
pub(super) const BROKER_DROPPED: Family<Gauge> = Family::new(
    "idem_broker_messages_dropped",
    "The broker's count of messages it dropped (Mosquitto $SYS/broker/publish/messages/dropped)",
);
pub(super) const BROKER_STORED: Family<Gauge> = Family::new(
    "idem_broker_messages_stored",
    "Messages the broker holds (Mosquitto $SYS/broker/store/messages/count)",
);
pub(super) const INTAKE_FULL: Family<Counter> = Family::new(
    "idem_mqtt_intake_full_total",
    "Times the MQTT intake reached --mqtt-intake-buffer-bytes and reading paused",
);
pub(super) const INTAKE_MESSAGES: Family<Gauge> = Family::new(
    "idem_mqtt_intake_messages",
    "Received MQTT messages waiting for the ingest",
);
pub(super) const INTAKE_BYTES: Family<Gauge> = Family::new(
    "idem_mqtt_intake_bytes",
    "Bytes of received MQTT messages waiting for the ingest",
);
pub(super) const INTAKE_OLDEST: Family<Gauge> = Family::new(
    "idem_mqtt_intake_oldest_seconds",
    "How long the oldest received MQTT message has waited for the ingest",
);
pub(super) const ATTEMPTS_IN_FLIGHT: Family<Gauge> = Family::new(
    "idem_attempts_in_flight",
    "Devices with a push or report request awaiting an answer",
);
pub(super) const DEVICES: Family<Gauge> =
    Family::new("idem_devices", "Registered devices by status");
pub(super) const LAST_RUN_DEVICES: Family<Gauge> = Family::new(
    "idem_last_run_devices",
    "Outcome counts of the most recently completed run",
);
pub(super) const EVENTS_COMMITTED: Family<Counter> = Family::new(
    "idem_events_committed_total",
    "Outcome events committed to the event log",
);
pub(super) const EVENTS_PUBLISHED: Family<Counter> = Family::new(
    "idem_events_published_total",
    "Committed events this instance relayed holding the relay lease (to MQTT when events go there, and to live SSE streams)",
);
pub(super) const EVENT_LOG_LAG: Family<Gauge> = Family::new(
    "idem_event_log_lag_events",
    "Committed events not yet relayed",
);
pub(super) const PUSHES_IN_FLIGHT: Family<Gauge> = Family::new(
    "idem_pushes_in_flight",
    "Pushes awaiting the device's confirmation",
);
pub(super) const PUSH_QUEUE_DEPTH: Family<Gauge> = Family::new(
    "idem_push_queue_depth",
    "Pushes waiting for the rate limit or the in-flight cap",
);
pub(super) const RETRIES: Family<Counter> = Family::new(
    "idem_retries_total",
    "Failed attempts scheduled for another try",
);
pub(super) const QUARANTINED: Family<Counter> = Family::new(
    "idem_quarantined_total",
    "Devices quarantined after their last allowed attempt failed",
);
pub(super) const DRIFT_DETECTED: Family<Counter> = Family::new(
    "idem_drift_detected_total",
    "Converged devices that reported a different spec",
);
pub(super) const DEVICES_UNHEALTHY: Family<Gauge> = Family::new(
    "idem_devices_unhealthy",
    "Converged devices whose report says degraded or unhealthy",
);
pub(super) const DEVICES_EXEMPT: Family<Gauge> = Family::new(
    "idem_devices_exempt",
    "Devices a drift exemption covers now (drift seen, not remediated)",
);
pub(super) const FLEET_CACHE_BYTES: Family<Gauge> = Family::new(
    "idem_fleet_cache_bytes",
    "Estimated bytes of the in-memory fleet cache (table slots, ids, refusal messages, distinct desired specs)",
);
pub(super) const HTTP_CONNECTIONS: Family<Gauge> =
    Family::new("idem_http_connections", "Open HTTP connections");
pub(super) const HTTP_CONNECTIONS_REFUSED: Family<Counter> = Family::new(
    "idem_http_connections_refused_total",
    "HTTP connections answered and closed at once because --http-max-connections were open, or --http-max-connections-per-peer from their address, by reason",
);
pub(super) const HTTP_REQUESTS_REJECTED: Family<Counter> = Family::new(
    "idem_http_requests_rejected_total",
    "HTTP requests answered with an error by a head or body limit, by reason",
);
pub(super) const SSE_CLIENTS: Family<Gauge> =
    Family::new("idem_sse_clients", "Connected SSE clients (GET /v1/events)");
pub(super) const SSE_CLIENTS_REFUSED: Family<Counter> = Family::new(
    "idem_sse_clients_refused_total",
    "GET /v1/events requests refused a stream by the stream cap, the admin reserve or the per-token cap, by reason",
);
pub(super) const SSE_CLIENTS_DROPPED: Family<Counter> = Family::new(
    "idem_sse_clients_dropped_total",
    "SSE clients disconnected because they did not keep up, by reason",
);
pub(super) const ROLLOUTS: Family<Gauge> = Family::new(
    "idem_rollouts",
    "Staged rollouts in progress, by state: running, paused_gate, paused_manual, paused_approval, paused_timed",
);
pub(super) const ROLLOUT_WAVE_DEVICES: Family<Gauge> = Family::new(
    "idem_rollout_wave_devices",
    "Devices of the open waves (the current one, and one handed over to it still waiting for answers) of every rollout in progress (progress=size), and those of them with their outcome (progress=decided)",
);
pub(super) const ROLLOUT_DEVICES_WAITING: Family<Gauge> = Family::new(
    "idem_rollout_devices_waiting",
    "Devices of rollouts in progress waiting for a later wave",
);
pub(super) const ROLLOUT_STEPS: Family<Counter> = Family::new(
    "idem_rollout_steps_total",
    "Steps of staged rollouts, by step: wave_started, wave_completed, paused, resumed, approved, aborted",
);
