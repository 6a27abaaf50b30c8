//! The demo's verdict: every device's outcome of the run against the
//! simulator's ground truth, the server's summary against the plan's, and
//! how long each phase took, with convergence and apply latencies.

use std::time::{Duration, Instant};

use idem_protocol::{OutcomeCounts, OutcomeKind};
use serde::Serialize;

use crate::api::{OutcomeRow, RunView, ServerClient};
use crate::check::{check_outcomes, GroundTruthCheck, Mismatch};
use crate::fleet::{Fleet, FleetStats};
use crate::plan::{ExpectedCounts, ExpectedOutcome, Plan};

use super::{DemoError, RolloutReport};

/// Latency percentiles over a set of devices (nearest-rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Latency {
    /// `None` for no samples.
    pub fn of(mut samples: Vec<Duration>) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let rank = |p: f64| {
            let index = ((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
            ms(samples[index])
        };
        Some(Self {
            samples: samples.len(),
            p50_ms: rank(0.50),
            p99_ms: rank(0.99),
            max_ms: ms(samples[samples.len() - 1]),
        })
    }
}

/// How long each step took (seconds unless the name says otherwise).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoTimings {
    pub register_s: f64,
    /// Fleet start → every device connected.
    pub connect_s: f64,
    /// Fleet start → the server's applied-reports counter covers every
    /// reporting device (it counts a report as it enters the batch that
    /// stores it, milliseconds before the commit).
    pub reports_counted_s: f64,
    /// Fleet start → every reporting device's first report confirmed stored
    /// through `GET /v1/devices` (includes paging through the fleet).
    pub reports_stored_s: f64,
    /// `POST /v1/runs` sent → run seen completed (simulator clock, polled).
    pub run_s: f64,
    /// The run's own duration as the server recorded it.
    pub server_run_ms: Option<u64>,
    /// Per provisioned device, simulator clock: run trigger → the device
    /// handed its confirming report to MQTT.
    pub convergence: Option<Latency>,
    /// Per provisioned device, simulator clock: desired state received →
    /// confirming report handed to MQTT (the device's own share).
    pub apply: Option<Latency>,
}

/// A device the server reported as failed, with its reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailedDevice {
    pub device: String,
    pub reason: Option<String>,
}

/// What a demo saw and concluded.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoReport {
    pub server: String,
    pub broker: String,
    pub topic_root: String,
    pub devices: usize,
    /// The counts the simulator's plan says a correct server reaches.
    pub expected: ExpectedCounts,
    pub expected_summary: String,
    pub run_id: String,
    /// `all` or `label` (when the server holds devices besides the demo's).
    pub targeting: &'static str,
    /// The run summary exactly as the server rendered it.
    pub summary: String,
    pub counts: OutcomeCounts,
    pub timings: DemoTimings,
    /// Devices the server reported failed, with reasons, by id.
    pub failed: Vec<FailedDevice>,
    /// Per-device comparison with the ground truth.
    pub check: GroundTruthCheck,
    pub fleet: FleetStats,
    /// How the rollout went, when the demo ran one (`--rollout`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutReport>,
}

impl DemoReport {
    /// The server's summary equals the plan's, and every device's outcome
    /// matches the ground truth. After an aborted rollout, a device the
    /// plan expects pushed may instead be `skipped` (`aborted`) — it was
    /// never pushed — and the summary is then judged device by device.
    pub fn passed(&self) -> bool {
        let aborted = self.rollout.as_ref().is_some_and(|r| r.aborted);
        let summary_matches = if aborted {
            self.counts.already_converged == self.expected.already_converged as u64
        } else {
            self.summary == self.expected_summary
        };
        summary_matches && self.check.passed()
    }

    /// With the rollout the demo ran: after an abort, the devices skipped
    /// as `aborted` that the plan expects pushed are no mismatch.
    pub fn with_rollout(mut self, rollout: Option<RolloutReport>) -> Self {
        if rollout.as_ref().is_some_and(|r| r.aborted) {
            self.check.mismatches.retain(|m| !never_pushed(m));
        }
        self.rollout = rollout;
        self
    }
}

/// A device the plan expects pushed that an aborted rollout skipped.
fn never_pushed(m: &Mismatch) -> bool {
    let pushed = matches!(
        m.expected,
        Some(ExpectedOutcome::Provisioned | ExpectedOutcome::Failed)
    );
    pushed && m.actual.as_deref() == Some("skipped") && m.reason.as_deref() == Some("aborted")
}

/// How long each phase of a demo took.
pub(super) struct PhaseTimes {
    pub(super) register: Duration,
    pub(super) connect: Duration,
    pub(super) reports_counted: Duration,
    pub(super) reports_stored: Duration,
    pub(super) run: Duration,
}

/// Every device's outcome of `run` against the ground truth, as the report.
/// `setting`: the broker, the topic root and how the run targeted the fleet.
pub(super) async fn judge(
    client: &ServerClient,
    plan: &Plan,
    fleet: &Fleet,
    run: &RunView,
    trigger: Instant,
    times: PhaseTimes,
    (broker, topic_root, targeting): (String, String, &'static str),
) -> Result<DemoReport, DemoError> {
    let devices = plan.devices.len();
    let outcomes = client.outcomes(&run.id).await?;
    let check = check_outcomes(plan, &outcomes);
    let failed = failed_devices(&outcomes);
    let (convergence, apply) = latencies(fleet, plan, trigger);
    let expected = plan.expected_counts();
    let summary = if run.summary.is_empty() {
        run.counts.summary()
    } else {
        run.summary.clone()
    };
    Ok(DemoReport {
        server: client.base_url().to_owned(),
        broker,
        topic_root,
        devices,
        expected,
        expected_summary: expected.summary(),
        run_id: run.id.to_string(),
        targeting,
        summary,
        counts: run.counts,
        timings: DemoTimings {
            register_s: times.register.as_secs_f64(),
            connect_s: times.connect.as_secs_f64(),
            reports_counted_s: times.reports_counted.as_secs_f64(),
            reports_stored_s: times.reports_stored.as_secs_f64(),
            run_s: times.run.as_secs_f64(),
            server_run_ms: run.duration_ms,
            convergence,
            apply,
        },
        failed,
        check,
        fleet: fleet.stats(),
        rollout: None,
    })
}

/// The devices whose outcome is `failed`, with the reason.
fn failed_devices(outcomes: &[OutcomeRow]) -> Vec<FailedDevice> {
    outcomes
        .iter()
        .filter(|o| match o.outcome {
            Some(OutcomeKind::Failed) => true,
            Some(
                OutcomeKind::AlreadyConverged
                | OutcomeKind::Provisioned
                | OutcomeKind::Skipped
                | OutcomeKind::Superseded,
            )
            | None => false,
        })
        .map(|o| FailedDevice {
            device: o.device_id.clone(),
            reason: o.reason.clone(),
        })
        .collect()
}

/// Convergence (trigger → confirming report) and apply (desired received →
/// confirming report) latencies of the devices expected to be provisioned.
fn latencies(fleet: &Fleet, plan: &Plan, trigger: Instant) -> (Option<Latency>, Option<Latency>) {
    let mut convergence = Vec::new();
    let mut apply = Vec::new();
    for id in plan.ids_expecting(ExpectedOutcome::Provisioned) {
        let Some(state) = fleet.state(&id) else {
            continue;
        };
        let Some(confirmed) = state.confirmed_at.filter(|at| *at >= trigger) else {
            continue;
        };
        convergence.push(confirmed - trigger);
        if let Some(received) = state.desired_at.filter(|at| *at <= confirmed) {
            apply.push(confirmed - received);
        }
    }
    (Latency::of(convergence), Latency::of(apply))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles_use_the_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let l = Latency::of(samples).unwrap();
        assert_eq!(l.samples, 100);
        assert_eq!(l.p50_ms, 50.0);
        assert_eq!(l.p99_ms, 99.0);
        assert_eq!(l.max_ms, 100.0);
        let four = Latency::of(vec![
            Duration::from_millis(40),
            Duration::from_millis(10),
            Duration::from_millis(30),
            Duration::from_millis(20),
        ])
        .unwrap();
        assert_eq!((four.p50_ms, four.p99_ms), (20.0, 40.0));
        assert_eq!(Latency::of(Vec::new()), None);
    }
}
