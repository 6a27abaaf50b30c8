//! The soak's samples: what one sample holds (the servers' memory and open
//! files, the database, the event log, the SSE follower's lag), taking one,
//! and writing them all as CSV.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use idem_device_sim::memory::{process_memory, MemoryField};
use idem_tests::witness::ReportWitness;

use super::SoakRun;
use crate::bench::Bench;

/// One sample of the soak.
#[derive(Debug, Clone)]
pub struct Sample {
    pub elapsed: Duration,
    /// Summed over the instances.
    pub server_rss: u64,
    pub server_open_files: u64,
    pub database_bytes: i64,
    /// Rows of `events` and of `converged_event_slices`, and the events
    /// they hold together.
    pub event_rows: i64,
    pub event_slices: i64,
    pub events: i64,
    /// The newest sequence in the log minus the follower's last.
    pub sse_lag: i64,
    pub sse_gaps: u64,
    pub runs: i64,
    pub run_targets_held: i64,
    pub drifted: u64,
    pub changes: u64,
    pub reports_witnessed: u64,
    /// Live rows per table (PostgreSQL's estimate, `n_live_tup`).
    pub table_rows: BTreeMap<String, i64>,
    /// Bytes per table on disk, with its indexes and TOAST.
    pub table_bytes: BTreeMap<String, i64>,
}

/// What the follower saw.
#[derive(Default)]
pub struct Follower {
    pub last: AtomicI64,
    pub received: AtomicU64,
    pub gaps: AtomicU64,
    pub reconnects: AtomicU64,
}

/// The newest sequence in the event log minus the follower's last.
pub async fn lag(bench: &Bench, follower: &Follower) -> Result<i64> {
    let head: Option<i64> = sqlx::query_scalar(
        "SELECT greatest((SELECT max(sequence) FROM events), \
                         (SELECT max(last_sequence) FROM converged_event_slices))",
    )
    .fetch_one(bench.db.pool())
    .await
    .context("reading the event log's head")?;
    Ok(head.unwrap_or(0) - follower.last.load(Ordering::Relaxed))
}

pub async fn take_sample(
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
pub fn open_files(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| entries.count() as u64)
        .unwrap_or(0)
}

pub fn write_csv(path: &Path, samples: &[Sample]) -> Result<()> {
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
