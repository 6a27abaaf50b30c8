//! PostgreSQL adapter: the only module that speaks SQL. Writes are batched
//! (`COPY` for bulk inserts of run targets and events, `UNNEST` arrays for
//! updates, one statement per batch) and skip no-op updates.
//!
//! Holds no business rules: callers decide, this module persists.

pub mod access;
pub mod approvals;
pub mod cache;
pub mod copy;
pub mod device_rows;
pub mod devices;
pub mod events;
pub mod exemptions;
pub mod follow;
pub mod instances;
pub mod leases;
pub mod owned;
pub mod plans;
pub mod rollout_actions;
pub mod runs;
pub mod writer;

use std::time::Duration;

use idem_protocol::sql::UnknownName;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

pub use writer::{DeviceTx, DeviceWriter, Followed};

/// Which devices a cache refresh (`exemptions::refresh`, `owned::refresh`)
/// brings up to date: every one, or those listed (ids as stored).
#[derive(Debug, Clone, Copy)]
pub enum Scope<'a> {
    All,
    Devices(&'a [idem_protocol::DeviceId]),
}

impl<'a> Scope<'a> {
    /// The listed ids (`None`: every device), as the queries bind them.
    pub fn ids(self) -> Option<&'a [idem_protocol::DeviceId]> {
        match self {
            Scope::All => None,
            Scope::Devices(ids) => Some(ids),
        }
    }
}

/// The schema, embedded from `migrations/` (the only schema source).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error while {context}: {source}")]
    Db {
        context: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("could not apply database migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A row the database returned breaks an invariant the server wrote it
    /// with (a hand edit): an error with context, never a silently dropped row.
    #[error("corrupt data while {context}: {detail}")]
    Corrupt {
        context: &'static str,
        detail: String,
    },
    /// A write fenced by a lease found the lease no longer this holder's
    /// (it expired, or another instance took it): nothing was written.
    #[error("the {lease:?} lease is no longer held by this instance (epoch {epoch}); the write is refused")]
    LeaseLost { lease: &'static str, epoch: i64 },
}

impl StoreError {
    /// PostgreSQL refused the data itself (SQLSTATE classes 22 data
    /// exception, 23 integrity violation, 54 program limit exceeded):
    /// retrying the same rows can never succeed.
    pub fn is_refused_data(&self) -> bool {
        match self {
            StoreError::Db {
                source: sqlx::Error::Database(e),
                ..
            } => e
                .code()
                .is_some_and(|code| matches!(code.get(..2), Some("22" | "23" | "54"))),
            StoreError::Db { .. }
            | StoreError::Migrate(_)
            | StoreError::Corrupt { .. }
            | StoreError::LeaseLost { .. } => false,
        }
    }

    /// The database could not be reached or answered with a transient
    /// error (as opposed to refusing the request).
    // sqlx::Error is #[non_exhaustive]: a catch-all arm is required.
    #[allow(clippy::wildcard_enum_match_arm)]
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Db { source, .. } => match source {
                sqlx::Error::Database(e) => e
                    .code()
                    .is_some_and(|code| matches!(code.get(..2), Some("08" | "53" | "57" | "40"))),
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => true,
                _ => false,
            },
            StoreError::Migrate(_) | StoreError::Corrupt { .. } | StoreError::LeaseLost { .. } => {
                false
            }
        }
    }
}

/// A device id the database returned, parsed: one that breaks the id rules
/// (a hand edit) is an error naming it, never a silently dropped row.
pub fn device_id(raw: &str, context: &'static str) -> Result<idem_protocol::DeviceId, StoreError> {
    idem_protocol::DeviceId::parse(raw).map_err(|e| StoreError::Corrupt {
        context,
        detail: format!("device id {raw:?}: {e}"),
    })
}

/// [`device_id`] of every id, in order.
pub fn device_ids<S: AsRef<str>>(
    raw: &[S],
    context: &'static str,
) -> Result<Vec<idem_protocol::DeviceId>, StoreError> {
    raw.iter()
        .map(|id| device_id(id.as_ref(), context))
        .collect()
}

/// Attaches what we were doing to a sqlx error.
pub(crate) trait Context<T> {
    fn context(self, context: &'static str) -> Result<T, StoreError>;
}

impl<T> Context<T> for Result<T, sqlx::Error> {
    /// A stored word that names no value of its enum (`idem_protocol::sql`,
    /// the one mapping of each) is corrupt data, not a database error.
    fn context(self, context: &'static str) -> Result<T, StoreError> {
        self.map_err(|source| match unknown_name(&source) {
            Some(unknown) => StoreError::Corrupt {
                context,
                detail: unknown.to_string(),
            },
            None => StoreError::Db { context, source },
        })
    }
}

/// The unknown enum word a column failed to decode with, if that is why.
fn unknown_name(error: &sqlx::Error) -> Option<&UnknownName> {
    if let sqlx::Error::ColumnDecode { source, .. } = error {
        source.downcast_ref::<UnknownName>()
    } else {
        None
    }
}

/// Connects a pool; the server keeps retrying start-up elsewhere.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, StoreError> {
    connect_with_idle_limit(url, max_connections, None).await
}

/// Connects a pool whose sessions PostgreSQL ends when one sits idle inside
/// a transaction for longer than `idle_in_transaction`: a process paused
/// (or cut off) while it holds the device-writes lock then holds it that
/// long at most, and the other instances' writes, and their takeover of
/// its leases, go on.
pub async fn connect_with_idle_limit(
    url: &str,
    max_connections: u32,
    idle_in_transaction: Option<Duration>,
) -> Result<PgPool, StoreError> {
    let mut options: PgConnectOptions = url.parse().context("parsing the database URL")?;
    // No JIT compilation: idem's statements are short, and PostgreSQL
    // judges some of them (a LATERAL over a table it has no statistics for
    // yet, such as an empty `approval_policies`) worth compiling. That cost
    // 25 to 420 ms on a statement that runs in 0.3 ms without it, once per
    // desired change.
    options = options.options([("jit", "off")]);
    if let Some(limit) = idle_in_transaction {
        let millis = limit.as_millis().to_string();
        options = options.options([("idle_in_transaction_session_timeout", millis.as_str())]);
    }
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .context("connecting to PostgreSQL")
}

pub async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// `SELECT 1`, for readiness.
pub async fn ping(pool: &PgPool) -> Result<(), StoreError> {
    sqlx::query("SELECT 1")
        .execute(pool)
        .await
        .context("pinging the database")?;
    Ok(())
}

/// u64 counters from the protocol are stored as bigint; values past i64::MAX
/// are refused at ingest, so this saturates only on corrupt input.
pub(crate) fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

pub(crate) fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// Device ids as PostgreSQL takes them (`text[]`).
pub(crate) fn raw_ids(ids: &[idem_protocol::DeviceId]) -> Vec<&str> {
    ids.iter().map(idem_protocol::DeviceId::as_str).collect()
}

/// A stored (bigint) generation.
pub(crate) fn generation(n: i64) -> idem_protocol::Generation {
    idem_protocol::Generation(to_u64(n))
}

/// A generation as it is stored (bigint; past i64::MAX is refused at the
/// edges, see [`to_i64`]).
pub(crate) fn stored_generation(g: idem_protocol::Generation) -> i64 {
    to_i64(g.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_stored_word_is_corrupt_data_with_its_context() {
        let decoding: Result<(), sqlx::Error> = Err(sqlx::Error::ColumnDecode {
            index: "\"status\"".to_owned(),
            source: Box::new(UnknownName {
                kind: "device status",
                name: "online".to_owned(),
            }),
        });
        match decoding.context("loading all devices") {
            Err(StoreError::Corrupt { context, detail }) => {
                assert_eq!(context, "loading all devices");
                assert_eq!(detail, "unknown device status \"online\"");
            }
            other => panic!("expected corrupt data, got {other:?}"),
        }
    }

    #[test]
    fn other_decoding_errors_stay_database_errors() {
        let decoding: Result<(), sqlx::Error> = Err(sqlx::Error::ColumnDecode {
            index: "\"status\"".to_owned(),
            source: "not text".into(),
        });
        assert!(matches!(
            decoding.context("loading all devices"),
            Err(StoreError::Db { .. })
        ));
    }
}
