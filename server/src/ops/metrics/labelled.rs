//! The [`Metrics`] methods that reach a labelled series: the handle for one
//! label value, counting under a reason named by a string, and the gauges
//! set for every label at once.

use idem_protocol::{DeviceStatus, OutcomeCounts, OutcomeKind};
use metrics::Counter;

use super::labels::{
    BodyRejection, ConnectionRefusal, DropReason, HeadRejection, ReportResult, SseRefusal,
    AUTH_REFUSAL_REASONS, PLAN_ACTIONS, REFUSED_PUBLISH_KINDS, REJECT_REASONS, ROLLOUT_STEP_NAMES,
};
use super::Metrics;
use crate::reconcile::machine::{AskReason, RecheckTrigger, RolloutStats};

impl Metrics {
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

    /// Counts a plan action (one of [`PLAN_ACTIONS`]).
    pub fn plan(&self, action: &str) {
        if let Some(i) = PLAN_ACTIONS.iter().position(|a| *a == action) {
            self.plans[i].increment(1);
        }
    }

    /// Counts a message the publisher refused to send (one of
    /// [`REFUSED_PUBLISH_KINDS`]).
    pub fn publish_refused(&self, kind: &str) {
        if let Some(i) = REFUSED_PUBLISH_KINDS.iter().position(|k| *k == kind) {
            self.refused_publishes[i].increment(1);
        }
    }

    /// Sets the rollout gauges to `stats`.
    pub fn set_rollouts(&self, stats: &RolloutStats) {
        let by_state = [
            stats.running,
            stats.paused_gate,
            stats.paused_manual,
            stats.paused_approval,
            stats.paused_timed,
        ];
        for (gauge, n) in self.rollouts.iter().zip(by_state) {
            gauge.set(n as f64);
        }
        self.rollout_wave_size.set(stats.wave_devices as f64);
        self.rollout_wave_decided.set(stats.wave_decided as f64);
        self.rollout_waiting.set(stats.waiting as f64);
    }

    /// Counts a rollout step, by its event's type (other events are not
    /// rollout steps and are not counted).
    pub fn rollout_step(&self, event_type: &str) {
        let Some(step) = event_type.strip_prefix("io.idem.rollout.") else {
            return;
        };
        if let Some(i) = ROLLOUT_STEP_NAMES.iter().position(|s| *s == step) {
            self.rollout_steps[i].increment(1);
        }
    }
}
