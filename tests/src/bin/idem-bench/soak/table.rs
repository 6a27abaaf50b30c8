//! How the soak shows itself: the progress line of each sample, the table
//! of the samples at its tenths, and the verdicts against its targets.

use std::time::Duration;

use idem_device_sim::format_count;

use super::samples::Sample;
use super::{Checks, SoakRun};
use crate::args::Soak;

/// A figure "ends within" this fraction of its value after [`WARMED_UP`].
const DRIFT_ALLOWED: f64 = 0.10;
/// When the soak takes the figures the end is compared with.
const WARMED_UP: Duration = Duration::from_secs(300);

/// `06:10 / 60:00  rss 84.1 MiB  files 41  db 61.2 MiB  ...`
pub fn progress(sample: &Sample, total: Duration) -> String {
    format!(
        "soak {} / {}  rss {:.1} MiB  files {}  db {:.1} MiB  events {} in {} rows + {} slices  sse lag {}  runs {}  drifted {}  changes {}",
        clock(sample.elapsed),
        clock(total),
        mib(sample.server_rss as i64),
        sample.server_open_files,
        mib(sample.database_bytes),
        format_count(sample.events as u64),
        format_count(sample.event_rows as u64),
        format_count(sample.event_slices as u64),
        sample.sse_lag,
        sample.runs,
        sample.drifted,
        sample.changes,
    )
}

/// The table: the figures after five minutes, every tenth of the soak and
/// at the end; then the verdicts.
pub fn print_table(samples: &[Sample], checks: &Checks, soak: &SoakRun<'_>, settings: &Soak) {
    let Some(last) = samples.last() else { return };
    let warmed = samples
        .iter()
        .find(|s| s.elapsed >= WARMED_UP.min(settings.duration / 2))
        .unwrap_or(last);
    let mut shown: Vec<&Sample> = vec![&samples[0], warmed];
    for tenth in 1..=10 {
        let at = settings.duration * tenth / 10;
        if let Some(s) = samples.iter().find(|s| s.elapsed >= at) {
            if !shown.iter().any(|x| std::ptr::eq(*x, s)) {
                shown.push(s);
            }
        }
    }
    if !shown.iter().any(|x| std::ptr::eq(*x, last)) {
        shown.push(last);
    }
    shown.sort_by_key(|s| s.elapsed);
    println!(
        "\nsoak: {} devices, {} instance(s), {}, resync every {}, {} devices drifting a minute, a desired change every {}",
        format_count(soak.bench.args.devices as u64),
        soak.server_pids.len(),
        human(settings.duration),
        human(settings.resync),
        settings.drift_per_minute,
        human(settings.change_every)
    );
    println!(
        "{:>7} {:>10} {:>6} {:>10} {:>11} {:>10} {:>8} {:>7} {:>6} {:>12} {:>8}",
        "at",
        "RSS MiB",
        "files",
        "db MiB",
        "events",
        "event rows",
        "slices",
        "sse lag",
        "runs",
        "run targets",
        "drifted"
    );
    for s in &shown {
        println!(
            "{:>7} {:>10.1} {:>6} {:>10.1} {:>11} {:>10} {:>8} {:>7} {:>6} {:>12} {:>8}",
            clock(s.elapsed),
            mib(s.server_rss as i64),
            s.server_open_files,
            mib(s.database_bytes),
            format_count(s.events as u64),
            format_count(s.event_rows as u64),
            format_count(s.event_slices as u64),
            s.sse_lag,
            s.runs,
            format_count(s.run_targets_held as u64),
            s.drifted
        );
    }
    let biggest: Vec<String> = {
        let mut rows: Vec<(&String, &i64)> = last.table_rows.iter().collect();
        rows.sort_by(|a, b| b.1.cmp(a.1));
        rows.iter()
            .take(8)
            .map(|(t, r)| format!("{t} {}", format_count(**r as u64)))
            .collect()
    };
    println!(
        "rows per table at the end (live, largest first): {}",
        biggest.join(", ")
    );
    let mut grown: Vec<(&String, i64, i64)> = last
        .table_bytes
        .iter()
        .map(|(t, end)| (t, warmed.table_bytes.get(t).copied().unwrap_or(0), *end))
        .collect();
    grown.sort_by_key(|(_, start, end)| std::cmp::Reverse(end - start));
    println!(
        "bytes per table (with indexes and TOAST), at {} -> at the end, largest growth first: {}",
        clock(warmed.elapsed),
        grown
            .iter()
            .take(6)
            .map(|(t, start, end)| format!("{t} {:.1} -> {:.1} MiB", mib(*start), mib(*end)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let within = |end: f64, start: f64| start > 0.0 && (end - start).abs() <= start * DRIFT_ALLOWED;
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let rss_ok = within(last.server_rss as f64, warmed.server_rss as f64);
    let files_ok = within(
        last.server_open_files as f64,
        warmed.server_open_files as f64,
    );
    let peak_events = samples.iter().map(|s| s.events).max().unwrap_or(0);
    let peak_targets = samples
        .iter()
        .map(|s| s.run_targets_held)
        .max()
        .unwrap_or(0);
    // Retention prunes every interval: between two prunes a desired
    // change and a resync pass (a fleet's worth each) may come on top.
    let n = soak.bench.args.devices as i64;
    let events_bounded = peak_events <= soak.event_retention + 2 * n;
    let targets_bounded = peak_targets <= soak.run_retention + 2 * n;
    println!(
        "server RSS {:.1} MiB at {} -> {:.1} MiB at the end ({:+.1} %), target within 10 %: {}",
        mib(warmed.server_rss as i64),
        clock(warmed.elapsed),
        mib(last.server_rss as i64),
        percent(last.server_rss as f64, warmed.server_rss as f64),
        verdict(rss_ok)
    );
    println!(
        "server open files {} at {} -> {} at the end ({:+.1} %), target within 10 %: {}",
        warmed.server_open_files,
        clock(warmed.elapsed),
        last.server_open_files,
        percent(
            last.server_open_files as f64,
            warmed.server_open_files as f64
        ),
        verdict(files_ok)
    );
    println!(
        "database {:.1} MiB at {} -> {:.1} MiB at the end; event log at most {} events (retention {}), runs at most {} targets (retention {}): {}",
        mib(warmed.database_bytes),
        clock(warmed.elapsed),
        mib(last.database_bytes),
        format_count(peak_events as u64),
        format_count(soak.event_retention as u64),
        format_count(peak_targets as u64),
        format_count(soak.run_retention as u64),
        verdict(events_bounded && targets_bounded)
    );
    println!(
        "reports: {} witnessed, {} not stored: {}",
        format_count(checks.reports_witnessed),
        checks.reports_lost.len(),
        verdict(checks.reports_lost.is_empty())
    );
    println!(
        "runs: {} checked as they completed, {} without exactly one outcome per target: {} ({})",
        checks.runs_checked,
        checks.runs_inexact.len(),
        verdict(checks.runs_inexact.is_empty()),
        checks
            .outcomes
            .iter()
            .map(|(k, v)| format!("{} {k}", format_count(*v as u64)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "SSE follower: {} events, {} gaps, {} reconnects (the server dropped {}), {} behind at the end: {}",
        format_count(checks.sse_received),
        checks.sse_gaps,
        checks.sse_reconnects,
        checks
            .sse_dropped
            .iter()
            .map(|(reason, n)| format!("{n} {reason}"))
            .collect::<Vec<_>>()
            .join(", "),
        checks.sse_final_lag,
        verdict(checks.sse_gaps == 0 && checks.sse_final_lag == 0)
    );
}

fn percent(end: f64, start: f64) -> f64 {
    if start > 0.0 {
        (end - start) / start * 100.0
    } else {
        0.0
    }
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// `mm:ss`.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    format!("{:02}:{:02}", s / 60, s % 60)
}

/// `1h`, `10m`, `90s`.
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    if s % 3_600 == 0 {
        format!("{}h", s / 3_600)
    } else if s % 60 == 0 {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}
