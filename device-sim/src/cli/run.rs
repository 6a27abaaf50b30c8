//! `device-sim run`: start the fleet, keep it connected and answering until
//! Ctrl-C / SIGTERM, print periodic stats, then disconnect cleanly.

use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use idem_device_sim::{format_count, Fleet, FleetStats};
use tokio::time::{interval, Instant, MissedTickBehavior};

use super::{raise_fd_limit, FleetArgs};

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub fleet: FleetArgs,

    /// Seconds between stats lines.
    #[arg(long, env = "IDEM_SIM_STATS_INTERVAL_SECS", default_value_t = 5)]
    pub stats_interval_secs: u64,
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let plan = args.fleet.plan()?;
    let config = args.fleet.fleet_config(&plan)?;
    let fd_limit = raise_fd_limit(plan.devices.len());
    let counts = plan.expected_counts();
    println!(
        "device-sim: {} devices on {} under {}/ ({} drifted, {} rejecting, {} silent, {} ignoring pushes; seed {}; fd limit {})",
        format_count(plan.devices.len() as u64),
        config.broker,
        config.topic_root,
        args.fleet.drifted_count().unwrap_or(args.fleet.drifted),
        args.fleet.reject,
        args.fleet.silent,
        args.fleet.ignore_pushes,
        args.fleet.seed,
        fd_limit,
    );
    println!("device-sim: a correct server's first run reads: {counts}");

    let started = Instant::now();
    let fleet = Fleet::start(config).context("could not start the fleet")?;
    let total = fleet.len();
    let mut ticker = interval(Duration::from_secs(args.stats_interval_secs.max(1)));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut all_connected_reported = total == 0;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);

    loop {
        tokio::select! {
            result = &mut shutdown => {
                result?;
                break;
            }
            _ = ticker.tick() => println!("{}", stats_line(started.elapsed(), &fleet.stats())),
            result = fleet.wait_connected(total, Duration::from_secs(3600)), if !all_connected_reported => {
                if result.is_ok() {
                    all_connected_reported = true;
                    println!(
                        "device-sim: all {} devices connected in {:.2}s",
                        format_count(total as u64),
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }

    println!(
        "device-sim: stopping; disconnecting {} devices cleanly",
        format_count(total as u64)
    );
    let stopping = Instant::now();
    let stats = fleet.shutdown().await.context("stopping the fleet")?;
    println!("{}", stats_line(started.elapsed(), &stats));
    println!(
        "device-sim: stopped in {:.2}s",
        stopping.elapsed().as_secs_f64()
    );
    Ok(())
}

fn stats_line(elapsed: Duration, s: &FleetStats) -> String {
    format!(
        "[{:>8.1}s] connected {}/{} · connects {} · conn errors {} · reports {} · desired {} · get {} · rejected {} · invalid {}",
        elapsed.as_secs_f64(),
        format_count(s.connected as u64),
        format_count(s.devices as u64),
        format_count(s.connections),
        format_count(s.connection_errors),
        format_count(s.reports_sent),
        format_count(s.desired_received),
        format_count(s.get_received),
        format_count(s.rejections),
        format_count(s.invalid_messages),
    )
}

/// Resolves on Ctrl-C or SIGTERM.
pub(super) async fn shutdown_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("could not install the SIGTERM handler")?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result.context("could not listen for Ctrl-C"),
        _ = term.recv() => Ok(()),
    }
}
