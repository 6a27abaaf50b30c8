//! The benchmark's output: the targets table and the CPU breakdown per step
//! on stdout, and the JSON results (`--out`), from what the steps measured.

use std::time::Duration;

use anyhow::{Context, Result};
use idem_device_sim::RunView;
use serde_json::json;

use crate::bench::{Bench, Record, Step};
use crate::targets::{targets, Target};

/// Prints the targets table and writes the JSON results.
pub fn report(
    bench: &Bench,
    load_before: &str,
    server_env: &[(String, String)],
    record: &Record,
    measured: Measured,
) -> Result<()> {
    let targets = targets(bench, &measured);
    let &Measured {
        n,
        k,
        write_floor,
        server_idle_rss,
        server_connected_rss,
        server_end_rss,
        server_peak,
        sim_idle_rss,
        sim_peak,
        stats,
        shutdown_s,
        ..
    } = &measured;
    print_tables(&targets, &record.steps);
    for file in &record.perf_files {
        println!(
            "perf data: {} (perf report -i {} --no-children)",
            file.display(),
            file.display()
        );
    }

    let output = json!({
        "machine": {
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "load_average_before": load_before.trim(),
            "mem_total": std::fs::read_to_string("/proc/meminfo").ok()
                .and_then(|m| m.lines().next().map(str::to_owned)),
        },
        "settings": {
            "devices": n,
            "drifted": bench.args.drifted,
            "heartbeats_per_device": k,
            "secure": bench.args.secure,
            "server_env": server_env
                .iter()
                .map(|(k, v)| {
                    if k.contains("PASSWORD") {
                        format!("{k}=***")
                    } else {
                        format!("{k}={v}")
                    }
                })
                .collect::<Vec<_>>(),
            "simulator": match bench.args.edge_count() {
                0 => "one rumqttc v4 client per device in this process, on the core broker".to_owned(),
                edges => format!(
                    "one rumqttc v4 client per device in {edges} fleet worker processes, \
                     each on its own edge broker bridged to the core broker"
                ),
            },
            "edge_brokers": bench.args.edge_count(),
            "devices_per_process": bench.args.devices_per_process(),
            "connect_rate_per_s": bench.args.connect_rate,
            "max_connecting": bench.args.max_connecting,
        },
        "targets": targets,
        "steps": record.steps,
        "memory": {
            "server_idle_rss_bytes": server_idle_rss,
            "server_connected_rss_bytes": server_connected_rss,
            "server_end_rss_bytes": server_end_rss,
            "server_peak_rss_bytes": server_peak,
            "server_fleet_cache_bytes": measured.cache_bytes,
            "simulator_idle_rss_bytes": sim_idle_rss,
            "simulator_peak_rss_bytes": sim_peak,
        },
        "fleet": stats,
        "fleet_shutdown_s": shutdown_s,
        "write_floor_s": write_floor.as_secs_f64(),
        "write_floor_unnest_s": record.write_floor_unnest.map(|d| d.as_secs_f64()),
    });
    if let Some(out) = &bench.args.out {
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(out, serde_json::to_string_pretty(&output)?)
            .with_context(|| format!("writing {}", out.display()))?;
        println!("results written to {}", out.display());
    }
    Ok(())
}

/// What `run_steps` measured, for the table and the JSON.
pub struct Measured {
    pub n: usize,
    pub k: u32,
    pub total: u64,
    pub connect_wall: Duration,
    pub connected_s: f64,
    pub converged: RunView,
    pub converged_wall: Duration,
    pub write_floor: Duration,
    pub normal_wall: Duration,
    /// The normal run's duration as the server measured it.
    pub normal_server_ms: u64,
    pub forced_wall: Duration,
    pub normal_pushes: f64,
    pub forced_pushes: f64,
    pub full_wall: Duration,
    pub full_pushes: f64,
    /// The next change as a rollout in `--rollout-waves` waves, no pauses.
    pub rollout_wall: Duration,
    pub rollout_pushes: f64,
    pub sub_rate: f64,
    pub server_rate: f64,
    pub ingest_ratio: f64,
    pub server_idle_rss: u64,
    pub server_connected_rss: u64,
    pub server_end_rss: u64,
    pub server_peak: u64,
    pub server_steady_per_device: f64,
    pub server_peak_per_device: f64,
    pub sim_idle_rss: u64,
    pub sim_peak: u64,
    pub sim_per_device: f64,
    pub stats: idem_device_sim::FleetStats,
    pub shutdown_s: f64,
    /// `idem_fleet_cache_bytes` at the end.
    pub cache_bytes: f64,
}

fn print_tables(targets: &[Target], steps: &[Step]) {
    let width = targets.iter().map(|t| t.measure.len()).max().unwrap_or(10);
    println!();
    println!(
        "{:<width$} | {:<70} | {:<18} | met",
        "measure", "result", "target"
    );
    println!("{}", "-".repeat(width + 70 + 18 + 12));
    for t in targets {
        let met = match t.met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "-",
        };
        println!(
            "{:<width$} | {:<70} | {:<18} | {met}",
            t.measure, t.result, t.target
        );
    }
    println!();
    println!("where the time goes (CPU seconds per step; 2 cores = 2 CPU-s per wall second)");
    println!(
        "{:<10} | {:>8} | {:>8} | {:>8} | {:>8} | {:>9} | {:>6} | {:>6}",
        "step", "wall s", "server", "broker", "postgres", "simulator", "other", "steal"
    );
    for s in steps {
        let c = &s.cpu_s;
        println!(
            "{:<10} | {:>8.3} | {:>8.2} | {:>8.2} | {:>8.2} | {:>9.2} | {:>6.2} | {:>6.2}",
            s.name, s.wall_s, c.server, c.broker, c.postgres, c.simulator, c.other, c.steal
        );
    }
    println!();
}
