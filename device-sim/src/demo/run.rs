//! The demo's third step: check that nothing was pushed before the run,
//! trigger one run over the demo's devices and follow it to completion.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::api::{RunView, ServerClient};
use crate::fleet::Fleet;
use crate::plan::format_count;

use super::{DemoError, DemoObserver, DemoPhase, FLEET_LABEL};

/// Devices named in an error message, at most.
const EXAMPLES: usize = 10;

/// Nothing may have been pushed yet: otherwise the plan no longer
/// describes the fleet (retained leftovers, or someone else's run).
pub(super) fn refuse_early_pushes(fleet: &Fleet, topic_root: &str) -> Result<(), DemoError> {
    let early: Vec<String> = fleet
        .states()
        .into_iter()
        .filter(|s| s.desired_received > 0)
        .map(|s| s.id.to_string())
        .collect();
    if !early.is_empty() {
        return Err(DemoError::EarlyPush {
            count: early.len(),
            examples: examples(&early),
            topic_root: topic_root.to_owned(),
        });
    }

    Ok(())
}

/// Starts one run over the fleet and follows it to completion; returns it,
/// when it was triggered and how long it took.
pub(super) async fn follow_run(
    client: &ServerClient,
    run_body: &Value,
    devices: usize,
    timeout: Duration,
    poll_interval: Duration,
    observer: &dyn DemoObserver,
) -> Result<(RunView, Instant, Duration), DemoError> {
    observer.phase_started(DemoPhase::Run, devices as u64);
    let trigger = Instant::now();
    let run_started = client.start_run(&run_body).await?;
    if run_started.targets != devices as u64 {
        return Err(DemoError::TargetMismatch {
            run_id: run_started.run_id.to_string(),
            targets: run_started.targets,
            devices,
        });
    }
    let run_deadline = trigger + timeout;
    let run = loop {
        let run = client.run(&run_started.run_id).await?;
        observer.progress(DemoPhase::Run, run.counts.total());
        if run.is_completed() {
            break run;
        }
        if Instant::now() >= run_deadline {
            return Err(DemoError::RunTimeout {
                run_id: run.id.to_string(),
                timeout,
                done: run.counts.total(),
                targets: run_started.targets,
                summary: run.counts.summary(),
            });
        }
        tokio::time::sleep(poll_interval).await;
    };
    let run_time = trigger.elapsed();
    observer.phase_finished(DemoPhase::Run, run_time);

    Ok((run, trigger, run_time))
}

fn examples(ids: &[String]) -> String {
    let mut shown = ids
        .iter()
        .take(EXAMPLES)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > EXAMPLES {
        shown.push_str(&format!(
            " and {} more",
            format_count((ids.len() - EXAMPLES) as u64)
        ));
    }
    shown
}

/// The body for a run over every device the demo registered under `label`
/// (what [`run_demo`] sends when the server holds other devices too).
pub fn label_selector(label: &str) -> Value {
    json!({"selector": {"labels": { FLEET_LABEL: label }}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_examples_are_capped_at_ten_ids() {
        let ids: Vec<String> = (0..12).map(|i| format!("d{i}")).collect();
        assert_eq!(
            examples(&ids),
            "d0, d1, d2, d3, d4, d5, d6, d7, d8, d9 and 2 more"
        );
        assert_eq!(examples(&ids[..2]), "d0, d1");
    }

    #[test]
    fn the_label_selector_names_the_demo_label() {
        assert_eq!(
            label_selector("demo-1"),
            json!({"selector": {"labels": {"device-sim": "demo-1"}}})
        );
    }
}
