//! Prometheus metrics of one server instance: a private recorder (not the
//! process-global one, so several servers can share a test process) and
//! pre-registered handles, every label value initialised to 0. Each series'
//! name, kind and help text is written once, in the family table (`series`).
//!
//! Never a device id as a label: per-device detail lives in Postgres and the
//! event stream.
//!
//! Here: the handles ([`Metrics`]), their registration and the exposition.
//! By topic: `labels` (the fixed label values: reasons, kinds, results),
//! `series` (the family table), `family` (how a family registers a series
//! on the recorder) and `labelled` (the handle of one label value).

use idem_protocol::{DeviceStatus, OutcomeKind};
use metrics::{Counter, Gauge, Histogram, Level, Metadata};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::reconcile::machine::AskReason;
use crate::reconcile::machine::RecheckTrigger;

mod family;
mod labelled;
mod labels;
mod series;
#[cfg(test)]
mod tests;

pub use labels::{
    BodyRejection, ConnectionRefusal, DropReason, HeadRejection, ReportResult, SseRefusal,
    AUTH_REFUSAL_REASONS, PLAN_ACTIONS, REFUSED_PUBLISH_KINDS, REJECT_REASONS, ROLLOUT_STATES,
    ROLLOUT_STEP_NAMES,
};
use series::*;

/// The metadata of every series (`module_path!()` names this module).
const METADATA: Metadata<'static> = Metadata::new("idem", Level::INFO, Some(module_path!()));

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
    plans: [Counter; PLAN_ACTIONS.len()],
    /// Retained desired messages refreshed without a push (the device
    /// already ran the new desired spec, or was not attempted).
    pub retained_updates: Counter,
    /// Pushes withdrawn: decided on a desired state another instance had changed.
    pub stale_pushes: Counter,
    pub pushes: Counter,
    pub report_requests: Counter,
    pub sessions_drained: Counter,
    pub drained_messages: Counter,
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
    /// Devices an exemption covers now.
    pub exempt_devices: Gauge,
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
    rollouts: [Gauge; ROLLOUT_STATES.len()],
    rollout_wave_size: Gauge,
    rollout_wave_decided: Gauge,
    rollout_waiting: Gauge,
    rollout_steps: [Counter; ROLLOUT_STEP_NAMES.len()],
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

impl Metrics {
    /// The series without an `instance` label (for tests of one process).
    pub fn new() -> Self {
        Self::with_builder(PrometheusBuilder::new())
    }

    /// The series of the instance named `instance`: each carries it as its
    /// `instance` label, so the series of several instances behind one
    /// scrape job stay apart (Prometheus keeps it with `honor_labels`).
    pub fn for_instance(instance: &str) -> Self {
        Self::with_builder(PrometheusBuilder::new().add_global_label("instance", instance))
    }

    fn with_builder(builder: PrometheusBuilder) -> Self {
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
            plans: PLAN_ACTIONS.map(|action| PLANS.register(r, &[("action", action)])),
            ingest_batch_splits: INGEST_BATCH_SPLITS.register(r, &[]),
            retained_updates: RETAINED_UPDATES.register(r, &[]),
            stale_pushes: STALE_PUSHES.register(r, &[]),
            pushes: PUSHES.register(r, &[]),
            report_requests: REPORT_REQUESTS.register(r, &[]),
            sessions_drained: SESSIONS_DRAINED.register(r, &[]),
            drained_messages: DRAINED_MESSAGES.register(r, &[]),
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
            exempt_devices: DEVICES_EXEMPT.register(r, &[]),
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
            rollouts: ROLLOUT_STATES.map(|state| ROLLOUTS.register(r, &[("state", state)])),
            rollout_wave_size: ROLLOUT_WAVE_DEVICES.register(r, &[("progress", "size")]),
            rollout_wave_decided: ROLLOUT_WAVE_DEVICES.register(r, &[("progress", "decided")]),
            rollout_waiting: ROLLOUT_DEVICES_WAITING.register(r, &[]),
            rollout_steps: ROLLOUT_STEP_NAMES
                .map(|step| ROLLOUT_STEPS.register(r, &[("step", step)])),
            handle,
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
