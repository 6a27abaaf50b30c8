//! A fresh, uniquely named database per test on a running PostgreSQL (the
//! machine's, at `DATABASE_URL`), optionally migrated, dropped again when the
//! fixture is dropped.
//!
//! It owns only the database it created; it must never drop or alter any
//! other database, and never runs migrations it was not given.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Executor, PgConnection};

use crate::deadline::within;

/// The shared PostgreSQL used when `DATABASE_URL` is not set.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Connections in each test database's pool: enough for a test's own
/// queries, small enough for many tests in parallel.
const POOL_SIZE: u32 = 5;
/// How long each step of making a test database (connecting, creating,
/// migrating) and each wait for a pooled connection may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `Drop` waits for the server to drop the database.
const DROP_TIMEOUT: Duration = Duration::from_secs(30);
/// `CREATE DATABASE` can fail with `object_in_use` (SQLSTATE 55006) when
/// another session touches the template at the same moment; retried.
const CREATE_ATTEMPTS: usize = 5;

/// `DATABASE_URL`, or [`DEFAULT_DATABASE_URL`] when unset or empty.
pub fn admin_database_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| !url.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned())
}

/// A database that exists for the lifetime of this value.
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    /// The server's maintenance database, used to create and drop ours.
    admin_url: String,
    url: String,
    pool: PgPool,
}

impl TestDatabase {
    /// A fresh database on `DATABASE_URL`'s server, with no schema at all.
    pub async fn create() -> Result<Self> {
        Self::create_on(&admin_database_url(), None).await
    }

    /// A fresh database on `DATABASE_URL`'s server with `migrator` applied
    /// (e.g. `&idem_server::MIGRATOR`).
    pub async fn create_with(migrator: &Migrator) -> Result<Self> {
        Self::create_on(&admin_database_url(), Some(migrator)).await
    }

    /// A fresh database on the server at `admin_url` (any database there that
    /// we may connect to, e.g. a [`crate::PrivatePostgres`]'s `url()`),
    /// migrated with `migrator` when given.
    pub async fn create_on(admin_url: &str, migrator: Option<&Migrator>) -> Result<Self> {
        let name = format!("idem_test_{}", uuid::Uuid::new_v4().simple());
        let admin_options = PgConnectOptions::from_str(admin_url)
            .with_context(|| format!("DATABASE_URL {admin_url:?} is not a PostgreSQL URL"))?;
        let mut admin = within(
            SETUP_TIMEOUT,
            format!("connecting to PostgreSQL at {admin_url}"),
            PgConnection::connect_with(&admin_options),
        )
        .await?
        .with_context(|| {
            format!(
                "PostgreSQL is not reachable at {admin_url}: start it or run \
                 scripts/test, which installs and starts it"
            )
        })?;
        within(
            SETUP_TIMEOUT,
            format!("creating test database {name}"),
            create_database(&mut admin, &name),
        )
        .await??;
        if let Err(e) = admin.close().await {
            eprintln!("idem-tests: closing the admin connection failed: {e}");
        }

        let options = admin_options.database(&name);
        let url = options.to_url_lossy().to_string();
        let db = match PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(SETUP_TIMEOUT)
            .connect_with(options)
            .await
        {
            Ok(pool) => Self {
                name,
                admin_url: admin_url.to_owned(),
                url,
                pool,
            },
            Err(e) => {
                drop_database_blocking(admin_url, &name);
                return Err(e).context(format!("connecting to the new test database {name}"));
            }
        };
        if let Some(migrator) = migrator {
            let what = format!("running migrations on test database {}", db.name);
            within(SETUP_TIMEOUT, &what, migrator.run(&db.pool))
                .await?
                .context(what)?;
        }
        Ok(db)
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A URL that connects to this database.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The database's name (`idem_test_<uuid>`).
    pub fn name(&self) -> &str {
        &self.name
    }
}

async fn create_database(admin: &mut PgConnection, name: &str) -> Result<()> {
    // `name` is ours: `idem_test_` + 32 hex digits, safe to quote verbatim.
    let statement = format!("CREATE DATABASE \"{name}\"");
    let mut attempt = 0;
    loop {
        attempt += 1;
        match admin.execute(statement.as_str()).await {
            Ok(_) => return Ok(()),
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some("55006") && attempt < CREATE_ATTEMPTS =>
            {
                tokio::time::sleep(Duration::from_millis(50 * attempt as u64)).await;
            }
            Err(e) => return Err(e).context(format!("creating test database {name}")),
        }
    }
}

/// Drops `name` on the server at `admin_url`, from a separate thread with its
/// own runtime (so it works from `Drop`, inside or outside a runtime). Never
/// panics; reports failures on stderr.
fn drop_database_blocking(admin_url: &str, name: &str) {
    let admin_url = admin_url.to_owned();
    let name = name.to_owned();
    let worker = std::thread::Builder::new()
        .name(format!("drop-{name}"))
        .spawn(move || {
            if let Err(e) = drop_database_on_own_runtime(&admin_url, &name) {
                eprintln!("idem-tests: could not drop test database {name}: {e:#}");
            }
        });
    match worker {
        Ok(handle) => {
            if handle.join().is_err() {
                eprintln!("idem-tests: the thread dropping a test database panicked");
            }
        }
        Err(e) => eprintln!("idem-tests: could not spawn a thread to drop a test database: {e}"),
    }
}

fn drop_database_on_own_runtime(admin_url: &str, name: &str) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building a runtime to drop the test database")?;
    runtime.block_on(async {
        tokio::time::timeout(DROP_TIMEOUT, async {
            let mut admin = PgConnection::connect(admin_url)
                .await
                .with_context(|| format!("connecting to {admin_url}"))?;
            admin
                .execute(format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)").as_str())
                .await
                .context("DROP DATABASE")?;
            admin
                .close()
                .await
                .context("closing the admin connection")?;
            Ok::<(), anyhow::Error>(())
        })
        .await
        .map_err(|_| anyhow!("timed out after {DROP_TIMEOUT:?}"))?
    })
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        drop_database_blocking(&self.admin_url, &self.name);
    }
}
