//! Rows each step inserted, updated and deleted, per table, as PostgreSQL
//! itself counted them (`pg_stat_user_tables`), not as the server's own
//! counters say: what a step costs the database in rows.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use sqlx::PgPool;

/// How long a backend may keep its counts before PostgreSQL publishes them:
/// an idle backend flushes its pending statistics within a second
/// (PostgreSQL 15's `PGSTAT_MIN_INTERVAL`), so a snapshot waits a little
/// longer for the server's connections to go idle and flush.
const STATISTICS_FLUSH: Duration = Duration::from_millis(1_500);

/// Rows inserted, updated and deleted in one table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rows {
    pub inserted: i64,
    pub updated: i64,
    pub deleted: i64,
}

impl Rows {
    fn minus(self, before: Rows) -> Rows {
        Rows {
            inserted: self.inserted - before.inserted,
            updated: self.updated - before.updated,
            deleted: self.deleted - before.deleted,
        }
    }

    fn is_zero(self) -> bool {
        self == Rows::default()
    }
}

/// The cumulative counts of every table of the database at one moment.
#[derive(Debug, Clone, Default)]
pub struct TableWrites(BTreeMap<String, Rows>);

impl TableWrites {
    /// The counts once every write before this call has been published.
    pub async fn snapshot(pool: &PgPool) -> Result<Self> {
        tokio::time::sleep(STATISTICS_FLUSH).await;
        let mut conn = pool.acquire().await.context("reading table statistics")?;
        // A new snapshot of the statistics, not one cached by this session.
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *conn)
            .await
            .context("clearing the statistics snapshot")?;
        let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
            "SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables",
        )
        .fetch_all(&mut *conn)
        .await
        .context("reading pg_stat_user_tables")?;
        Ok(Self(
            rows.into_iter()
                .map(|(table, inserted, updated, deleted)| {
                    (
                        table,
                        Rows {
                            inserted,
                            updated,
                            deleted,
                        },
                    )
                })
                .collect(),
        ))
    }

    /// What was written between `before` and this snapshot, tables with no
    /// write left out.
    pub fn since(&self, before: &TableWrites) -> BTreeMap<String, Rows> {
        self.0
            .iter()
            .map(|(table, now)| {
                let then = before.0.get(table).copied().unwrap_or_default();
                (table.clone(), now.minus(then))
            })
            .filter(|(_, rows)| !rows.is_zero())
            .collect()
    }
}

/// The step's writes as JSON: `{table: {inserted, updated, deleted}}`.
pub fn to_json(writes: &BTreeMap<String, Rows>) -> Value {
    writes
        .iter()
        .map(|(table, rows)| {
            (
                table.clone(),
                json!({"inserted": rows.inserted, "updated": rows.updated, "deleted": rows.deleted}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// One line: `run_targets +10000/~0/-0, events +10001/~0/-0` (inserted,
/// updated, deleted), or `none`.
pub fn summary(writes: &BTreeMap<String, Rows>) -> String {
    if writes.is_empty() {
        return "none".to_owned();
    }
    writes
        .iter()
        .map(|(table, r)| format!("{table} +{}/~{}/-{}", r.inserted, r.updated, r.deleted))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(tables: &[(&str, i64, i64, i64)]) -> TableWrites {
        TableWrites(
            tables
                .iter()
                .map(|(t, i, u, d)| {
                    (
                        (*t).to_owned(),
                        Rows {
                            inserted: *i,
                            updated: *u,
                            deleted: *d,
                        },
                    )
                })
                .collect(),
        )
    }

    #[test]
    fn a_step_is_charged_the_difference_and_untouched_tables_are_left_out() {
        let before = counts(&[("devices", 10, 5, 0), ("events", 100, 0, 0)]);
        let after = counts(&[
            ("devices", 10, 9, 0),
            ("events", 104, 0, 2),
            ("runs", 1, 1, 0),
        ]);
        let writes = after.since(&before);
        assert_eq!(
            summary(&writes),
            "devices +0/~4/-0, events +4/~0/-2, runs +1/~1/-0"
        );
        assert_eq!(to_json(&writes)["events"]["inserted"], 4);
        assert_eq!(summary(&after.since(&after)), "none");
    }
}
