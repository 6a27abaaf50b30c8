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
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use idem_device_sim::{format_count, Plan};
use idem_protocol::{DeviceId, TopicRoot};
use idem_tests::witness::ReportWitness;
use idem_tests::{PrivateMosquitto, SseClient};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::args::Soak;
use crate::bench::{Bench, Record};
use crate::fleet::{bench_plan, BenchFleet};
use crate::steps::{connect_step, register_step};

mod samples;
mod table;

use samples::{lag, take_sample, write_csv, Follower, Sample};
use table::{human, print_table, progress};

/// How long the end waits for runs to finish and reports to be stored.
const SETTLE: Duration = Duration::from_secs(120);

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
pub struct Checks {
    pub runs_checked: u64,
    pub runs_inexact: Vec<String>,
    pub outcomes: BTreeMap<&'static str, i64>,
    pub reports_witnessed: u64,
    pub reports_lost: Vec<String>,
    pub sse_gaps: u64,
    pub sse_received: u64,
    pub sse_reconnects: u64,
    pub sse_final_lag: i64,
    /// The first instance's `idem_sse_clients_dropped_total`, by reason.
    pub sse_dropped: Vec<(&'static str, f64)>,
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

/// The value of `key` in the server's environment, as a count.
pub fn env_count(env: &[(String, String)], key: &str, default: i64) -> i64 {
    env.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}
