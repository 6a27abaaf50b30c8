//! What every step shares: the [`Bench`] (arguments, API client, database,
//! probe, passwords), the [`Record`] of finished steps, running one step
//! with CPU accounting (and perf), and the waits and diagnostics the steps
//! use.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use idem_device_sim::memory::MemoryField;
use idem_device_sim::{RunView, ServerClient};
use idem_protocol::TopicRoot;
use idem_tests::{PrivateMosquitto, ProcessServer, TestDatabase};
use serde::Serialize;
use serde_json::{json, Value};

use crate::args::Args;
use crate::perf::Perf;
use crate::probe::{Cpu, Probe};
use idem_tests::table_writes::{self, TableWrites};

/// How often progress is polled.
pub const POLL: Duration = Duration::from_millis(10);
/// Longest wait for any one step.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// The `/metrics` series counting reports the server stored.
pub const APPLIED: &str = "idem_reports_total{result=\"applied\"}";
/// The `/metrics` series counting the server's pushes (publishes).
pub const PUSHES: &str = "idem_pushes_total";

/// One finished step: its wall time, CPU seconds and details (JSON).
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub name: &'static str,
    pub wall_s: f64,
    pub cpu_s: Cpu,
    /// Step-specific numbers.
    pub details: BTreeMap<&'static str, Value>,
}

/// What every step uses; shared, never mutated.
pub struct Bench {
    pub args: Args,
    pub client: ServerClient,
    pub db: TestDatabase,
    pub probe: Probe,
    /// Broker passwords by user name (`--secure`).
    pub passwords: Option<std::collections::HashMap<String, String>>,
}

/// What the steps produce.
#[derive(Default)]
pub struct Record {
    pub steps: Vec<Step>,
    pub perf_files: Vec<PathBuf>,
    /// The write floor's rows by `UNNEST` instead of `COPY`.
    pub write_floor_unnest: Option<Duration>,
}

impl Record {
    /// Adds `extra` to the last step's details.
    pub fn annotate_last(&mut self, extra: BTreeMap<&'static str, Value>) {
        if let Some(step) = self.steps.last_mut() {
            step.details.extend(extra);
        }
    }
}

impl Bench {
    /// Runs `f` as step `name`, with CPU accounting (and perf, if asked).
    pub async fn step<T, F>(
        &self,
        record: &mut Record,
        name: &'static str,
        f: F,
    ) -> Result<(T, Duration)>
    where
        F: std::future::Future<Output = Result<(T, BTreeMap<&'static str, Value>)>>,
    {
        let perf = match &self.args.perf {
            Some(step) if step == name => Some(Perf::start(
                name,
                self.probe.server_pid,
                self.args.perf_all,
            )?),
            Some(_) | None => None,
        };
        let tables_before = TableWrites::snapshot(self.db.pool()).await?;
        let cpu_before = self.probe.sample();
        let started = Instant::now();
        let result = f.await;
        let wall = started.elapsed();
        let cpu = self.probe.sample().minus(cpu_before);
        if let Some(perf) = perf {
            record.perf_files.push(perf.stop()?);
        }
        let (value, mut details) = result.with_context(|| format!("step {name}"))?;
        // Read after the wall time is taken: the wait for PostgreSQL's
        // statistics is not the step's.
        let written = TableWrites::snapshot(self.db.pool())
            .await?
            .since(&tables_before);
        details.insert("table_rows", table_writes::to_json(&written));
        details.insert(
            "server_rss_after_bytes",
            json!(self.probe.server_memory(MemoryField::Rss)),
        );
        details.insert(
            "server_peak_rss_after_bytes",
            json!(self.probe.server_memory(MemoryField::PeakRss)),
        );
        eprintln!(
            "  {name:<10} {:>8.3} s   cpu: server {:.2} s, broker {:.2} s, postgres {:.2} s, simulator {:.2} s, other {:.2} s, steal {:.2} s",
            wall.as_secs_f64(),
            cpu.server,
            cpu.broker,
            cpu.postgres,
            cpu.simulator,
            cpu.other,
            cpu.steal
        );
        eprintln!(
            "  {:<10} rows written: {}",
            "",
            table_writes::summary(&written)
        );
        record.steps.push(Step {
            name,
            wall_s: wall.as_secs_f64(),
            cpu_s: cpu,
            details,
        });
        Ok((value, wall))
    }

    pub async fn metric(&self, series: &str) -> Result<f64> {
        Ok(self.client.metric(series).await?.unwrap_or(0.0))
    }

    pub async fn scalar(&self, sql: &str) -> Result<i64> {
        sqlx::query_scalar(sql)
            .fetch_one(self.db.pool())
            .await
            .with_context(|| format!("querying: {sql}"))
    }
}

/// Starts server instances 2..=`--instances` on `core` with `env` (the
/// first instance's, so they share the fleet's subscriptions), named
/// `{name}-2`, `{name}-3`, ...
pub async fn start_extra_instances(
    bench: &Bench,
    core: &PrivateMosquitto,
    root: &TopicRoot,
    env: &[(String, String)],
    name: &str,
) -> Result<Vec<ProcessServer>> {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut extras = Vec::new();
    for index in 2..=bench.args.instances {
        extras.push(
            ProcessServer::start(
                &bench.args.server_bin,
                bench.db.url(),
                &core.url(),
                root,
                &format!("{name}-{index}"),
                &env,
            )
            .await
            .with_context(|| format!("starting instance {index}"))?,
        );
    }
    Ok(extras)
}

/// Polls `GET /v1/runs/{id}` until completed.
pub async fn follow_run(client: &ServerClient, run_id: &uuid::Uuid) -> Result<RunView> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let run = client.run(run_id).await?;
        if run.is_completed() {
            return Ok(run);
        }
        if Instant::now() > deadline {
            bail!(
                "run {run_id} not completed after {STEP_TIMEOUT:?}: {}\n{}",
                diagnose_client(client).await,
                run.counts.summary()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until the applied-reports counter grew by `n` since `baseline`,
/// then until `confirm` (a SQL count) reaches `expected`.
pub async fn wait_stored(
    bench: &Bench,
    baseline: f64,
    n: u64,
    confirm: &str,
    expected: i64,
) -> Result<()> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let applied = bench.metric(APPLIED).await? - baseline;
        if applied >= n as f64 && bench.scalar(confirm).await? >= expected {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "server stored {applied} of {n} reports after {STEP_TIMEOUT:?} ({confirm} < {expected})"
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `pid, state, wait_event_type, wait_event, query` of a database session.
type Session = (
    i32,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// What the server and its database are doing, for a step that timed out:
/// the database sessions of the test database (state, lock waits, query)
/// and the server's in-flight gauges.
pub async fn diagnose(bench: &Bench) -> String {
    let sessions: Vec<Session> = sqlx::query_as(
        "SELECT pid, state, wait_event_type, wait_event, left(query, 160) \
             FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(bench.db.pool())
    .await
    .unwrap_or_default();
    let mut out = String::from("--- database sessions ---\n");
    for (pid, state, wait_type, wait, query) in sessions {
        out.push_str(&format!(
            "{pid} {} {}/{} {}\n",
            state.unwrap_or_default(),
            wait_type.unwrap_or_default(),
            wait.unwrap_or_default(),
            query.unwrap_or_default().replace('\n', " ")
        ));
    }
    out.push_str(&diagnose_client(&bench.client).await);
    out
}

/// The server's in-flight gauges and report counters from `/metrics`.
async fn diagnose_client(client: &ServerClient) -> String {
    let text = client.metrics_text().await.unwrap_or_default();
    let mut out = String::from("--- server gauges ---\n");
    for line in text.lines().filter(|l| {
        !l.starts_with('#')
            && [
                "idem_reports_total",
                "idem_attempts_in_flight",
                "idem_pushes_in_flight",
                "idem_push_queue_depth",
                "idem_mqtt_connected",
                "idem_event_log_lag_events",
                "idem_pushes_total",
            ]
            .iter()
            .any(|m| l.starts_with(m))
    }) {
        out.push_str(line);
        out.push('\n');
    }
    out
}

pub fn details(pairs: &[(&'static str, Value)]) -> BTreeMap<&'static str, Value> {
    pairs.iter().cloned().collect()
}

pub fn run_details(run: &RunView, pushes: f64) -> BTreeMap<&'static str, Value> {
    details(&[
        ("summary", json!(run.summary)),
        ("server_duration_ms", json!(run.duration_ms)),
        ("publishes", json!(pushes)),
    ])
}
