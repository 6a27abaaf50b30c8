//! The demo's second step: start the fleet, wait until every device is
//! connected, then until the server has stored every reporting device's
//! first report (watching its counter, then confirming through the API).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::api::ServerClient;
use crate::config::FleetConfig;
use crate::error::SimError;
use crate::fleet::Fleet;
use crate::plan::Plan;

use super::{DemoError, DemoObserver, DemoPhase, APPLIED_REPORTS, FLEET_LABEL};

/// Starts the fleet and waits until every device is connected and its
/// first report stored; returns the fleet and the connect, reports-counted
/// and reports-stored times.
pub(super) async fn connect_fleet(
    client: &ServerClient,
    plan: &Plan,
    fleet_config: FleetConfig,
    label: &str,
    (timeout, poll_interval): (Duration, Duration),
    topic_root: &str,
    observer: &dyn DemoObserver,
) -> Result<(Fleet, Duration, Duration, Duration), DemoError> {
    let devices = plan.devices.len();
    let baseline = client.metric(APPLIED_REPORTS).await?.unwrap_or(0.0);
    let reporting: Vec<&str> = plan
        .devices
        .iter()
        .filter(|d| d.reports_on_connect() && !d.start_offline)
        .map(|d| d.id.as_str())
        .collect();
    let fleet = Fleet::start(fleet_config)?;
    let fleet_started = Instant::now();
    let deadline = fleet_started + timeout;
    observer.phase_started(DemoPhase::Connect, devices as u64);
    let connect_time =
        wait_connected(&fleet, devices, deadline, timeout, poll_interval, observer).await?;
    observer.phase_finished(DemoPhase::Connect, connect_time);
    observer.phase_started(DemoPhase::Report, reporting.len() as u64);
    let (counted_time, reports_time) = wait_reports_stored(
        client,
        &reporting,
        baseline,
        label,
        ReportWait {
            since: fleet_started,
            deadline,
            timeout,
            poll_interval,
            topic_root,
        },
        observer,
    )
    .await?;
    observer.phase_finished(DemoPhase::Report, reports_time);
    Ok((fleet, connect_time, counted_time, reports_time))
}

async fn wait_connected(
    fleet: &Fleet,
    devices: usize,
    deadline: Instant,
    timeout: Duration,
    poll_interval: Duration,
    observer: &dyn DemoObserver,
) -> Result<Duration, DemoError> {
    let started = Instant::now();
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(poll_interval, fleet.wait_connected(devices, remaining)).await {
            Ok(Ok(())) => {
                observer.progress(DemoPhase::Connect, devices as u64);
                return Ok(started.elapsed());
            }
            Ok(Err(SimError::ConnectTimeout { connected, .. })) => {
                return Err(SimError::ConnectTimeout {
                    timeout,
                    wanted: devices,
                    connected,
                }
                .into())
            }
            Ok(Err(other)) => return Err(other.into()),
            Err(_) => observer.progress(DemoPhase::Connect, fleet.connected_count() as u64),
        }
    }
}

struct ReportWait<'a> {
    since: Instant,
    deadline: Instant,
    timeout: Duration,
    poll_interval: Duration,
    topic_root: &'a str,
}

/// Waits until the server has stored a report of every device in
/// `reporting`: first by watching the applied-reports counter (cheap), then
/// by confirming each device through `GET /v1/devices` (exact). Returns the
/// times since `wait.since` at which the counter, and the confirmation,
/// covered every device.
async fn wait_reports_stored(
    client: &ServerClient,
    reporting: &[&str],
    baseline: f64,
    label: &str,
    wait: ReportWait<'_>,
    observer: &dyn DemoObserver,
) -> Result<(Duration, Duration), DemoError> {
    let wanted = reporting.len();
    let mut stored = 0;
    let mut counted_at = None;
    loop {
        let applied = client
            .metric(APPLIED_REPORTS)
            .await?
            .map(|v| (v - baseline).max(0.0) as usize);
        // Without the counter, confirm through the API every time.
        let counter_says_done = applied.is_none_or(|n| n >= wanted);
        if counter_says_done && counted_at.is_none() {
            counted_at = Some(wait.since.elapsed());
        }
        if let Some(n) = applied {
            stored = stored.max(n.min(wanted));
        }
        if counter_says_done {
            let rows = client.devices_with_label(FLEET_LABEL, label).await?;
            let with_report: HashSet<&str> = rows
                .iter()
                .filter(|r| r.reported.is_some())
                .map(|r| r.id.as_str())
                .collect();
            let confirmed = reporting
                .iter()
                .filter(|id| with_report.contains(*id))
                .count();
            stored = confirmed;
            if confirmed == wanted {
                observer.progress(DemoPhase::Report, wanted as u64);
                let confirmed_at = wait.since.elapsed();
                return Ok((counted_at.unwrap_or(confirmed_at), confirmed_at));
            }
        }
        observer.progress(DemoPhase::Report, stored as u64);
        if Instant::now() >= wait.deadline {
            return Err(DemoError::ReportTimeout {
                timeout: wait.timeout,
                stored,
                wanted,
                topic_root: wait.topic_root.to_owned(),
            });
        }
        tokio::time::sleep(wait.poll_interval).await;
    }
}
