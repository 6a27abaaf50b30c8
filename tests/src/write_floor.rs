//! PostgreSQL's write floor for one run: the least a database can spend
//! storing one outcome row and one CloudEvent row (~450 B of jsonb) per
//! device, measured with `COPY` into scratch tables in one transaction.
//! The benchmark reports idem's figures as ratios to it.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sqlx::PgPool;
use uuid::Uuid;

/// Scratch tables shaped like `run_targets` and `events`, without the
/// foreign keys (the floor owes nothing to other rows).
const SCRATCH_TABLES: &str = "\
    DROP TABLE IF EXISTS floor_outcomes, floor_events; \
    CREATE TABLE floor_outcomes (run_id uuid NOT NULL, device_id text NOT NULL, \
        outcome text, reason text, generation bigint, health text, decided_at timestamptz, \
        PRIMARY KEY (run_id, device_id)); \
    CREATE TABLE floor_events (sequence bigint PRIMARY KEY, id uuid NOT NULL, type text NOT NULL, \
        subject text NOT NULL, run_id uuid, time timestamptz NOT NULL, cloudevent jsonb NOT NULL)";

/// The write floor both ways, best of the same number of tries each.
#[derive(Debug, Clone, Copy)]
pub struct WriteFloor {
    /// The floor: both tables by `COPY`.
    pub copy: Duration,
    /// The same rows by `INSERT … SELECT FROM UNNEST(arrays)`, for comparison.
    pub unnest: Duration,
}

/// The fastest of `tries` transactions that each write `devices` outcome
/// rows and `devices` event rows (fresh tables each time), by `COPY` and by
/// `UNNEST`.
pub async fn measure(pool: &PgPool, devices: usize, tries: usize) -> Result<WriteFloor> {
    let rows = rows(devices);
    let mut floor = WriteFloor {
        copy: Duration::MAX,
        unnest: Duration::MAX,
    };
    for _ in 0..tries.max(1) {
        floor.copy = floor.copy.min(timed(pool, by_copy(pool, &rows)).await?);
        floor.unnest = floor.unnest.min(timed(pool, by_unnest(pool, &rows)).await?);
    }
    sqlx::raw_sql("DROP TABLE IF EXISTS floor_outcomes, floor_events")
        .execute(pool)
        .await
        .context("dropping the write-floor scratch tables")?;
    Ok(floor)
}

/// Fresh scratch tables, then `write`, timed.
async fn timed(
    pool: &PgPool,
    write: impl std::future::Future<Output = Result<()>>,
) -> Result<Duration> {
    sqlx::raw_sql(SCRATCH_TABLES)
        .execute(pool)
        .await
        .context("creating the write-floor scratch tables")?;
    let started = Instant::now();
    write.await?;
    Ok(started.elapsed())
}

async fn by_copy(pool: &PgPool, rows: &Rows) -> Result<()> {
    let mut tx = pool
        .begin()
        .await
        .context("starting the floor transaction")?;
    copy_into(
        &mut tx,
        "COPY floor_outcomes (run_id, device_id, outcome, reason, generation, health, decided_at) FROM STDIN",
        &rows.outcomes_copy_text(),
    )
    .await?;
    copy_into(
        &mut tx,
        "COPY floor_events (sequence, id, type, subject, run_id, time, cloudevent) FROM STDIN",
        &rows.events_copy_text(),
    )
    .await?;
    tx.commit()
        .await
        .context("committing the floor transaction")
}

async fn copy_into(tx: &mut sqlx::PgConnection, statement: &str, text: &str) -> Result<()> {
    let mut copy = tx
        .copy_in_raw(statement)
        .await
        .with_context(|| format!("starting {statement}"))?;
    copy.send(text.as_bytes()).await?;
    copy.finish()
        .await
        .with_context(|| format!("finishing {statement}"))?;
    Ok(())
}

async fn by_unnest(pool: &PgPool, rows: &Rows) -> Result<()> {
    let mut tx = pool
        .begin()
        .await
        .context("starting the floor transaction")?;
    sqlx::query(
        "INSERT INTO floor_outcomes (run_id, device_id, outcome, generation, health, decided_at) \
         SELECT $1, d, 'already_converged', 3, 'ok', now() FROM UNNEST($2::text[]) AS d",
    )
    .bind(rows.run_id)
    .bind(&rows.devices)
    .execute(&mut *tx)
    .await
    .context("UNNEST into floor_outcomes")?;
    let sequences: Vec<i64> = (0..rows.devices.len() as i64).collect();
    sqlx::query(
        "INSERT INTO floor_events (sequence, id, type, subject, run_id, time, cloudevent) \
         SELECT s, i, 'io.idem.device.already_converged', d, $1, now(), c::jsonb \
         FROM UNNEST($2::int8[], $3::uuid[], $4::text[], $5::text[]) AS x(s, i, d, c)",
    )
    .bind(rows.run_id)
    .bind(&sequences)
    .bind(&rows.event_ids)
    .bind(&rows.devices)
    .bind(&rows.events)
    .execute(&mut *tx)
    .await
    .context("UNNEST into floor_events")?;
    tx.commit()
        .await
        .context("committing the floor transaction")
}

/// One run's outcomes and events, as a run would write them.
struct Rows {
    run_id: Uuid,
    devices: Vec<String>,
    event_ids: Vec<Uuid>,
    /// CloudEvent JSON, one per device.
    events: Vec<String>,
}

const TIME: &str = "2026-12-01 00:00:00+00";

impl Rows {
    fn outcomes_copy_text(&self) -> String {
        let mut text = String::with_capacity(self.devices.len() * 100);
        for device in &self.devices {
            text.push_str(&format!(
                "{}\t{device}\talready_converged\t\\N\t3\tok\t{TIME}\n",
                self.run_id
            ));
        }
        text
    }

    fn events_copy_text(&self) -> String {
        let mut text = String::with_capacity(self.devices.len() * 600);
        for (i, ((device, id), event)) in self
            .devices
            .iter()
            .zip(&self.event_ids)
            .zip(&self.events)
            .enumerate()
        {
            text.push_str(&format!(
                "{i}\t{id}\tio.idem.device.already_converged\t{device}\t{}\t{TIME}\t{event}\n",
                self.run_id
            ));
        }
        text
    }
}

fn rows(devices: usize) -> Rows {
    let run_id = Uuid::now_v7();
    let devices: Vec<String> = (0..devices).map(|i| format!("bench-{i:06}")).collect();
    let event_ids: Vec<Uuid> = devices.iter().map(|_| Uuid::now_v7()).collect();
    let events = devices
        .iter()
        .zip(&event_ids)
        .enumerate()
        .map(|(i, (device, id))| {
            format!(
                r#"{{"specversion":"1.0","id":"{id}","source":"/idem/bench","type":"io.idem.device.already_converged","subject":"{device}","time":"2026-12-01T00:00:00Z","datacontenttype":"application/json","sequence":{i},"runid":"{run_id}","generation":3,"data":{{"outcome":"already_converged","reason":null,"health":"ok","success":true}}}}"#
            )
        })
        .collect();
    Rows {
        run_id,
        devices,
        event_ids,
        events,
    }
}
