//! `idem-bench --soak`, behind `scripts/soak`: the fleet stays connected for
//! an hour (by default) while the server resyncs it every minute, a tenth of
//! a percent of it drifts each minute and its desired spec changes every ten
//! minutes. Every few seconds it samples the servers' memory and open files,
//! the database's size and rows per table, the event log and the lag of an
//! SSE follower; it checks each run once it completed (exactly one outcome
//! per target) and, at the end, that every report an independent witness
//! saw the broker accept is stored. It prints progress, then a table, and
//! writes every sample as CSV (the plot is `scripts/lib/soak_plot.py`'s).

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use idem_device_sim::memory::{process_memory, MemoryField};
use idem_device_sim::{format_count, Plan};
use idem_protocol::{DeviceId, TopicRoot};
use idem_tests::witness::ReportWitness;
use idem_tests::{PrivateMosquitto, ProcessServer, SseClient};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::args::Soak;
use crate::bench::{Bench, Record};
use crate::fleet::{bench_plan, BenchFleet};
use crate::steps::{connect_step, register_step};

/// How long the end waits for runs to finish and reports to be stored.
const SETTLE: Duration = Duration::from_secs(120);
/// A figure "ends within" this fraction of its value after [`WARMED_UP`].
const DRIFT_ALLOWED: f64 = 0.10;
/// When the soak takes the figures the end is compared with.
const WARMED_UP: Duration = Duration::from_secs(300);

/// What the soak needs besides the [`Bench`].
pub struct SoakRun<'a> {
    pub bench: &'a Bench,
    pub core: &'a PrivateMosquitto,
    pub root: &'a TopicRoot,
    pub workers: Option<BenchFleet>,
    /// The first instance's base URL and operator token, for the follower.
    pub server_url: String,
    pub token: Option<String>,
    /// Every server instance's PID (the first one first).
    pub server_pids: Vec<u32>,
    /// The server's event and run retention counts, for the verdicts.
    pub event_retention: i64,
    pub run_retention: i64,
}

/// One sample of the soak.
#[derive(Debug, Clone)]
struct Sample {
    elapsed: Duration,
    /// Summed over the instances.
    server_rss: u64,
    server_open_files: u64,
    database_bytes: i64,
    /// Rows of `events` and of `converged_event_slices`, and the events
    /// they hold together.
    event_rows: i64,
    event_slices: i64,
    events: i64,
    /// The newest sequence in the log minus the follower's last.
    sse_lag: i64,
    sse_gaps: u64,
    runs: i64,
    run_targets_held: i64,
    drifted: u64,
    changes: u64,
    reports_witnessed: u64,
    /// Live rows per table (PostgreSQL's estimate, `n_live_tup`).
    table_rows: BTreeMap<String, i64>,
    /// Bytes per table on disk, with its indexes and TOAST.
    table_bytes: BTreeMap<String, i64>,
}

/// What the follower saw.
#[derive(Default)]
struct Follower {
    last: AtomicI64,
    received: AtomicU64,
    gaps: AtomicU64,
    reconnects: AtomicU64,
}

/// Runs the soak; fails when a run is not exact, a witnessed report is not
/// stored or the follower saw a gap. The figures' targets are verdicts in
/// the table, not failures.
pub async fn run_soak(mut soak: SoakRun<'_>, settings: &Soak, csv: &Path) -> Result<()> {
    let bench = soak.bench;
    let n = bench.args.devices;
    let plan = bench_plan(n, bench.args.drifted)?;
    let mut record = Record::default();
    let witness = ReportWitness::start(soak.core, soak.root)
        .await
        .context("starting the report witness")?;
    register_step(bench, &plan, &mut record).await?;
    let (mut fleet, _, connect_wall) = connect_step(
        bench,
        soak.core,
        soak.workers.take(),
        soak.root,
        &plan,
        &mut record,
    )
    .await?;
    eprintln!(
        "soak: {} devices connected in {:.1} s; {} server instance(s) for {}, resync every {}, {} drifting a minute, a desired change every {}",
        format_count(n as u64),
        connect_wall.as_secs_f64(),
        soak.server_pids.len(),
        human(settings.duration),
        human(settings.resync),
        settings.drift_per_minute,
        human(settings.change_every),
    );
    let follower = Arc::new(Follower::default());
    let following = follow(
        Arc::clone(&follower),
        format!("{}/v1/events", soak.server_url.trim_end_matches('/')),
        soak.token.clone(),
    );
    let outcome = drive(&soak, settings, &plan, &mut fleet, &witness, &follower).await;
    following.abort();
    let stopping = fleet.shutdown().await;
    let (samples, checks) = outcome?;
    stopping?;
    write_csv(csv, &samples)?;
    print_table(&samples, &checks, &soak, settings);
    witness.check_intact()?;
    checks.failures()
}

/// What the soak checked besides the samples.
#[derive(Default)]
struct Checks {
    runs_checked: u64,
    runs_inexact: Vec<String>,
    outcomes: BTreeMap<&'static str, i64>,
    reports_witnessed: u64,
    reports_lost: Vec<String>,
    sse_gaps: u64,
    sse_received: u64,
    sse_reconnects: u64,
    sse_final_lag: i64,
    /// The first instance's `idem_sse_clients_dropped_total`, by reason.
    sse_dropped: Vec<(&'static str, f64)>,
}

impl Checks {
    fn failures(&self) -> Result<()> {
        let mut failed = Vec::new();
        if !self.runs_inexact.is_empty() {
            failed.push(format!(
                "{} runs without exactly one outcome per target: {}",
                self.runs_inexact.len(),
                self.runs_inexact.join("; ")
            ));
        }
        if !self.reports_lost.is_empty() {
            failed.push(format!(
                "{} witnessed reports not stored, e.g. {}",
                self.reports_lost.len(),
                self.reports_lost
                    .iter()
                    .take(5)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if self.sse_gaps > 0 || self.sse_final_lag != 0 {
            failed.push(format!(
                "the SSE follower saw {} gaps and ended {} events behind",
                self.sse_gaps, self.sse_final_lag
            ));
        }
        if failed.is_empty() {
            Ok(())
        } else {
            bail!("the soak failed:\n  {}", failed.join("\n  "))
        }
    }
}

/// The soak's loop: samples, drift, desired changes, run checks; then the
/// end's settling and checks.
async fn drive(
    soak: &SoakRun<'_>,
    settings: &Soak,
    plan: &Plan,
    fleet: &mut BenchFleet,
    witness: &ReportWitness,
    follower: &Follower,
) -> Result<(Vec<Sample>, Checks)> {
    let bench = soak.bench;
    let started = Instant::now();
    let end = started + settings.duration;
    let mut samples = Vec::new();
    let mut checks = Checks::default();
    let mut checked_runs = HashSet::new();
    let mut desired = plan.desired_spec.clone();
    let mut picker = Picker::new(plan.devices.len());
    let (mut drifted, mut changes) = (0_u64, 0_u64);
    let mut sample_tick = tokio::time::interval(settings.sample_every);
    let mut drift_tick = interval_after(Duration::from_secs(60));
    let mut change_tick = interval_after(settings.change_every);
    loop {
        tokio::select! {
            _ = sample_tick.tick() => {
                check_runs(bench, &mut checked_runs, &mut checks).await?;
                let sample = take_sample(soak, started, follower, witness, drifted, changes).await?;
                eprintln!("{}", progress(&sample, settings.duration));
                samples.push(sample);
                if Instant::now() >= end {
                    break;
                }
            }
            _ = drift_tick.tick() => {
                let ids: Vec<DeviceId> = (0..settings.drift_per_minute)
                    .map(|_| plan.devices[picker.next()].id.clone())
                    .collect();
                drifted += fleet.drift(&ids, &desired).await? as u64;
            }
            _ = change_tick.tick() => {
                changes += 1;
                desired["firmware"] = json!(format!("3.{changes}.0"));
                bench
                    .client
                    .set_desired(&json!({"all": true, "spec": desired}))
                    .await
                    .with_context(|| format!("desired change {changes}"))?;
            }
        }
    }
    settle(soak, fleet, witness, &mut checks).await?;
    check_runs(bench, &mut checked_runs, &mut checks).await?;
    checks.sse_final_lag = lag(bench, follower).await?;
    checks.sse_gaps = follower.gaps.load(Ordering::Relaxed);
    checks.sse_received = follower.received.load(Ordering::Relaxed);
    checks.sse_reconnects = follower.reconnects.load(Ordering::Relaxed);
    for reason in ["lagged", "send_timeout"] {
        let series = format!("idem_sse_clients_dropped_total{{reason=\"{reason}\"}}");
        checks
            .sse_dropped
            .push((reason, bench.metric(&series).await?));
    }
    let last = take_sample(soak, started, follower, witness, drifted, changes).await?;
    samples.push(last);
    Ok((samples, checks))
}

/// An interval whose first tick is one `period` from now.
fn interval_after(period: Duration) -> tokio::time::Interval {
    tokio::time::interval_at(tokio::time::Instant::now() + period, period)
}

/// Deterministic device picks (xorshift), so two soaks drift alike.
struct Picker {
    state: u64,
    devices: usize,
}

impl Picker {
    fn new(devices: usize) -> Self {
        Self {
            state: 0x9e37_79b9_7f4a_7c15,
            devices: devices.max(1),
        }
    }

    fn next(&mut self) -> usize {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state % self.devices as u64) as usize
    }
}

/// Follows `GET /v1/events` from now on, reconnecting with the last id it
/// saw; counts every id that is not its predecessor plus one as a gap.
fn follow(follower: Arc<Follower>, url: String, token: Option<String>) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let last = follower.last.load(Ordering::Relaxed);
            let resume = (last > 0).then_some(last);
            match SseClient::connect(&url, token.as_deref(), resume).await {
                Ok(mut client) => {
                    // A read error or the end of the stream: reconnect.
                    while let Ok(Some(message)) = client.next_within(Duration::from_secs(120)).await
                    {
                        let Some(id) = message.id else { continue };
                        let last = follower.last.swap(id, Ordering::Relaxed);
                        if last > 0 && id != last + 1 {
                            follower.gaps.fetch_add(1, Ordering::Relaxed);
                            eprintln!("soak: the SSE follower got event {id} after {last}");
                        }
                        follower.received.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) => eprintln!("soak: the SSE follower could not connect: {e:#}"),
            }
            follower.reconnects.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// The newest sequence in the event log minus the follower's last.
async fn lag(bench: &Bench, follower: &Follower) -> Result<i64> {
    let head: Option<i64> = sqlx::query_scalar(
        "SELECT greatest((SELECT max(sequence) FROM events), \
                         (SELECT max(last_sequence) FROM converged_event_slices))",
    )
    .fetch_one(bench.db.pool())
    .await
    .context("reading the event log's head")?;
    Ok(head.unwrap_or(0) - follower.last.load(Ordering::Relaxed))
}

async fn take_sample(
    soak: &SoakRun<'_>,
    started: Instant,
    follower: &Follower,
    witness: &ReportWitness,
    drifted: u64,
    changes: u64,
) -> Result<Sample> {
    let pool = soak.bench.db.pool();
    let (database_bytes, event_rows, event_slices, events, runs, run_targets_held): (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ) = sqlx::query_as(
        "SELECT pg_database_size(current_database()), \
                (SELECT count(*) FROM events), \
                (SELECT count(*) FROM converged_event_slices), \
                (SELECT count(*) FROM events) + \
                (SELECT coalesce(sum(last_sequence - first_sequence + 1), 0)::int8 \
                   FROM converged_event_slices), \
                (SELECT count(*) FROM runs), \
                (SELECT coalesce(sum(target_count), 0)::int8 FROM runs)",
    )
    .fetch_one(pool)
    .await
    .context("sampling the database")?;
    let tables: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, n_live_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables",
    )
    .fetch_all(pool)
    .await
    .context("sampling rows and bytes per table")?;
    let sse_lag = lag(soak.bench, follower).await?;
    let memory = |pid: u32| process_memory(Some(pid), MemoryField::Rss).unwrap_or(0);
    Ok(Sample {
        elapsed: started.elapsed(),
        server_rss: soak.server_pids.iter().map(|p| memory(*p)).sum(),
        server_open_files: soak.server_pids.iter().map(|p| open_files(*p)).sum(),
        database_bytes,
        event_rows,
        event_slices,
        events,
        sse_lag,
        sse_gaps: follower.gaps.load(Ordering::Relaxed),
        runs,
        run_targets_held,
        drifted,
        changes,
        reports_witnessed: witness.reports(),
        table_rows: tables
            .iter()
            .map(|(t, rows, _)| (t.clone(), *rows))
            .collect(),
        table_bytes: tables.into_iter().map(|(t, _, bytes)| (t, bytes)).collect(),
    })
}

/// Entries of `/proc/PID/fd`: the process's open files and sockets.
fn open_files(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| entries.count() as u64)
        .unwrap_or(0)
}

/// `06:10 / 60:00  rss 84.1 MiB  files 41  db 61.2 MiB  ...`
fn progress(sample: &Sample, total: Duration) -> String {
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

/// Checks every completed run not checked yet: exactly one decided
/// outcome per target, and the counts adding up to the targets.
async fn check_runs(
    bench: &Bench,
    checked: &mut HashSet<uuid::Uuid>,
    checks: &mut Checks,
) -> Result<()> {
    let done: Vec<uuid::Uuid> = checked.iter().copied().collect();
    type RunRow = (uuid::Uuid, i32, i64, i64, i64, i64, i64, i64, i64);
    let rows: Vec<RunRow> = sqlx::query_as(
        "WITH fresh AS ( \
             SELECT * FROM runs WHERE state = 'completed' AND NOT (id = ANY($1)) \
         ), outcomes AS ( \
             SELECT run_id, count(*) AS outcomes, count(DISTINCT device_id) AS devices, \
                    count(*) FILTER (WHERE outcome IS NULL) AS undecided \
             FROM run_outcomes WHERE run_id IN (SELECT id FROM fresh) GROUP BY run_id \
         ) \
         SELECT f.id, f.target_count, \
                (f.already_converged + f.provisioned + f.failed + f.skipped + f.superseded)::int8, \
                coalesce(o.outcomes, 0), coalesce(o.devices, 0), coalesce(o.undecided, 0), \
                f.already_converged::int8, f.provisioned::int8, f.failed::int8 \
         FROM fresh f LEFT JOIN outcomes o ON o.run_id = f.id",
    )
    .bind(&done)
    .fetch_all(bench.db.pool())
    .await
    .context("checking completed runs")?;
    for (id, targets, counted, outcomes, devices, undecided, converged, provisioned, failed) in rows
    {
        checked.insert(id);
        checks.runs_checked += 1;
        let targets = i64::from(targets);
        if counted != targets || outcomes != targets || devices != targets || undecided != 0 {
            checks.runs_inexact.push(format!(
                "run {id}: {targets} targets, counts add up to {counted}, {outcomes} outcomes for {devices} devices, {undecided} undecided"
            ));
        }
        *checks.outcomes.entry("already converged").or_default() += converged;
        *checks.outcomes.entry("provisioned").or_default() += provisioned;
        *checks.outcomes.entry("failed").or_default() += failed;
    }
    Ok(())
}

/// The end: waits until no run is in flight and every device's last
/// witnessed report is stored (or [`SETTLE`] passed), then records what
/// is not.
async fn settle(
    soak: &SoakRun<'_>,
    fleet: &mut BenchFleet,
    witness: &ReportWitness,
    checks: &mut Checks,
) -> Result<()> {
    let pool = soak.bench.db.pool();
    let deadline = Instant::now() + SETTLE;
    loop {
        let running: i64 =
            sqlx::query_scalar("SELECT count(*) FROM runs WHERE state <> 'completed'")
                .fetch_one(pool)
                .await
                .context("counting running runs")?;
        let highest = witness.highest();
        let ids: Vec<String> = highest.keys().cloned().collect();
        let seqs: Vec<i64> = highest
            .values()
            .map(|s| i64::try_from(*s).unwrap_or(i64::MAX))
            .collect();
        let lost: Vec<(String, Option<i64>, i64)> = sqlx::query_as(
            "SELECT w.id, d.reported_seq, w.seq FROM UNNEST($1::text[], $2::int8[]) AS w(id, seq) \
             LEFT JOIN devices d ON d.id = w.id \
             WHERE d.reported_seq IS NULL OR d.reported_seq < w.seq",
        )
        .bind(&ids)
        .bind(&seqs)
        .fetch_all(pool)
        .await
        .context("comparing stored reports with the witness")?;
        if (running == 0 && lost.is_empty()) || Instant::now() >= deadline {
            checks.reports_witnessed = witness.reports();
            checks.reports_lost = lost
                .into_iter()
                .map(|(id, stored, seen)| format!("{id}: stored seq {stored:?}, witnessed {seen}"))
                .collect();
            if running > 0 {
                checks.runs_inexact.push(format!(
                    "{running} runs still running {SETTLE:?} after the end"
                ));
            }
            // The fleet's own view, for the table.
            let stats = fleet.stats().await?;
            if stats.rejections > 0 || stats.invalid_messages > 0 {
                eprintln!(
                    "soak: the fleet counted {} rejections and {} invalid messages",
                    stats.rejections, stats.invalid_messages
                );
            }
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn write_csv(path: &Path, samples: &[Sample]) -> Result<()> {
    let tables: Vec<String> = samples
        .iter()
        .flat_map(|s| s.table_rows.keys().cloned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut out = String::from(
        "elapsed_s,server_rss_bytes,server_open_files,database_bytes,event_rows,event_slices,events,\
         sse_lag_events,sse_gaps,runs,run_targets_held,drifted,desired_changes,reports_witnessed",
    );
    for table in &tables {
        let _ = write!(out, ",rows_{table}");
    }
    for table in &tables {
        let _ = write!(out, ",bytes_{table}");
    }
    out.push('\n');
    for s in samples {
        let _ = write!(
            out,
            "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            s.elapsed.as_secs_f64(),
            s.server_rss,
            s.server_open_files,
            s.database_bytes,
            s.event_rows,
            s.event_slices,
            s.events,
            s.sse_lag,
            s.sse_gaps,
            s.runs,
            s.run_targets_held,
            s.drifted,
            s.changes,
            s.reports_witnessed
        );
        for table in &tables {
            let _ = write!(out, ",{}", s.table_rows.get(table).copied().unwrap_or(0));
        }
        for table in &tables {
            let _ = write!(out, ",{}", s.table_bytes.get(table).copied().unwrap_or(0));
        }
        out.push('\n');
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// The table: the figures after five minutes, every tenth of the soak and
/// at the end; then the verdicts.
fn print_table(samples: &[Sample], checks: &Checks, soak: &SoakRun<'_>, settings: &Soak) {
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
fn human(d: Duration) -> String {
    let s = d.as_secs();
    if s % 3_600 == 0 {
        format!("{}h", s / 3_600)
    } else if s % 60 == 0 {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

/// The value of `key` in the server's environment, as a count.
pub fn env_count(env: &[(String, String)], key: &str, default: i64) -> i64 {
    env.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// Starts instances 2..=`count` (sharing the fleet's subscriptions).
pub async fn start_extra_instances(
    bench: &Bench,
    core: &PrivateMosquitto,
    root: &TopicRoot,
    env: &[(String, String)],
    count: usize,
) -> Result<Vec<ProcessServer>> {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut extras = Vec::new();
    for index in 2..=count {
        extras.push(
            ProcessServer::start(
                &bench.args.server_bin,
                bench.db.url(),
                &core.url(),
                root,
                &format!("soak-{index}"),
                &env,
            )
            .await
            .with_context(|| format!("starting instance {index}"))?,
        );
    }
    Ok(extras)
}
