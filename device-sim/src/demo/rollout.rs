//! The demo's run as a staged rollout (`device-sim demo --rollout`): the
//! registered desired spec sent again (`POST /v1/desired`) with waves over
//! the devices that need a push and a failure-ratio gate, followed until
//! it completes or pauses. A paused rollout is aborted (the devices not yet
//! pushed end `skipped`, `aborted`), and the pause — the gate and its
//! figures — is what the report shows.

use std::time::{Duration, Instant};

use idem_protocol::api::{PausedView, RolloutStateName, RunView, WaveView};
use serde::Serialize;
use serde_json::{json, Value};

use crate::api::ServerClient;
use crate::plan::Plan;

use super::{DemoError, DemoObserver, DemoPhase};

/// The waves and the gate of a demo rollout.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoRollout {
    /// Cumulative sizes as the API takes them: `"1%"`, `"10"`, `"100%"`.
    pub waves: Vec<String>,
    /// The gate of every wave: at most this ratio of a wave's devices fail.
    pub max_failure_ratio: f64,
}

impl DemoRollout {
    /// `"1%,10%,100%"` (or `"10,500,100%"`) with a gate of
    /// `max_failure_ratio`.
    pub fn parse(waves: &str, max_failure_ratio: f64) -> Result<Self, String> {
        let waves: Vec<String> = waves
            .split(',')
            .map(|w| w.trim().to_owned())
            .filter(|w| !w.is_empty())
            .collect();
        if waves.is_empty() {
            return Err("--rollout needs at least one wave, e.g. \"1%,10%,100%\"".to_owned());
        }
        if !(0.0..=1.0).contains(&max_failure_ratio) {
            return Err(format!(
                "--gate-max-failure-ratio must be within 0.0 and 1.0, got {max_failure_ratio}"
            ));
        }
        Ok(Self {
            waves,
            max_failure_ratio,
        })
    }

    /// The `rollout` of the request: counts as numbers, the rest as given
    /// (the server checks them and names a bad one).
    pub fn request(&self) -> Value {
        let waves: Vec<Value> = self
            .waves
            .iter()
            .map(|w| match w.parse::<u64>() {
                Ok(count) => json!(count),
                Err(_) => json!(w),
            })
            .collect();
        json!({"waves": waves, "gates": {"max_failure_ratio": self.max_failure_ratio}})
    }
}

/// How a demo rollout went: its waves as they ended, the pause that
/// stopped it (if one did) and whether the demo aborted it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolloutReport {
    pub state: RolloutStateName,
    pub waves: Vec<WaveView>,
    pub paused: Option<PausedView>,
    pub aborted: bool,
}

/// Starts the rollout over `targeting` and follows it: to completion, or
/// to a pause, which it aborts, then to completion.
pub(super) async fn follow_rollout(
    client: &ServerClient,
    targeting: &Value,
    plan: &Plan,
    rollout: &DemoRollout,
    (timeout, poll_interval): (Duration, Duration),
    observer: &dyn DemoObserver,
) -> Result<(RunView, Instant, Duration, RolloutReport), DemoError> {
    let devices = plan.devices.len();
    observer.phase_started(DemoPhase::Run, devices as u64);
    let mut body = targeting.clone();
    body["spec"] = plan.desired_spec.clone();
    body["rollout"] = rollout.request();
    let trigger = Instant::now();
    let started = client.set_desired(&body).await?;
    if started.targets != devices as u64 {
        return Err(DemoError::TargetMismatch {
            run_id: started.run_id.to_string(),
            targets: started.targets,
            devices,
        });
    }
    let deadline = trigger + timeout;
    let mut paused = None;
    let run = loop {
        let run = client.run(&started.run_id).await?;
        observer.progress(DemoPhase::Run, run.counts.total());
        if run.is_completed() {
            break run;
        }
        let pause = run.rollout.as_ref().and_then(|r| r.paused.clone());
        if let (None, Some(pause)) = (&paused, pause) {
            client.abort_rollout(&started.run_id).await?;
            paused = Some(pause);
        }
        if Instant::now() >= deadline {
            return Err(DemoError::RunTimeout {
                run_id: run.id.to_string(),
                timeout,
                done: run.counts.total(),
                targets: started.targets,
                summary: run.counts.summary(),
            });
        }
        tokio::time::sleep(poll_interval).await;
    };
    let run_time = trigger.elapsed();
    observer.phase_finished(DemoPhase::Run, run_time);
    let view = run.rollout.clone();
    let report = RolloutReport {
        state: view
            .as_ref()
            .map_or(RolloutStateName::Completed, |v| v.state),
        waves: view.map(|v| v.waves).unwrap_or_default(),
        aborted: paused.is_some(),
        paused,
    };
    Ok((run, trigger, run_time, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waves_are_read_from_a_comma_separated_list_counts_as_numbers() {
        let rollout = DemoRollout::parse("10, 5%,100%", 0.02).unwrap();
        assert_eq!(
            rollout.request(),
            json!({"waves": [10, "5%", "100%"], "gates": {"max_failure_ratio": 0.02}})
        );
        assert!(DemoRollout::parse(" , ", 0.02).is_err());
        assert!(DemoRollout::parse("100%", 1.5).is_err());
    }
}
