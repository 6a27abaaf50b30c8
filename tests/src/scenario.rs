//! A whole test world in one value: private broker, fresh database, server,
//! and a simulated fleet registered with the server. Fixtures are builders;
//! dropping a scenario stops everything it started.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use idem_device_sim::{BrokerAddr, Fleet, FleetConfig, Plan, SimDevice, SimTls};
use idem_protocol::api::DeviceRegistration;
use serde_json::{json, Value};

use crate::broker::{raise_fd_limit, PrivateMosquitto};
use crate::database::TestDatabase;
use crate::deadline::Deadline;
use crate::server::{ServerSettings, TestServer};

pub struct Scenario {
    pub server: TestServer,
    pub db: TestDatabase,
    pub broker: PrivateMosquitto,
}

impl Scenario {
    /// Broker, database and server, ready.
    pub async fn start(settings: ServerSettings) -> Result<Self> {
        raise_fd_limit().context("raising the open-file limit")?;
        let broker = PrivateMosquitto::start()?;
        Self::start_on(broker, settings).await
    }

    /// Like [`Scenario::start`] on a broker the test set up (TLS, passwords,
    /// client certificates: [`PrivateMosquitto::builder`]).
    pub async fn start_on(broker: PrivateMosquitto, settings: ServerSettings) -> Result<Self> {
        raise_fd_limit().context("raising the open-file limit")?;
        let db = TestDatabase::create_with(&idem_server::MIGRATOR).await?;
        let server = TestServer::start(&db, &broker, settings).await?;
        Ok(Self { server, db, broker })
    }

    /// A fleet configuration for `devices` on the scenario's broker and
    /// topic root: over TLS trusting the broker's CA when its listener is
    /// TLS. No credentials (set `credentials` for a password file broker).
    pub fn fleet_config(&self, devices: Vec<SimDevice>) -> Result<FleetConfig> {
        let (broker, tls) = match self.broker.ca_file() {
            Some(ca) => (
                BrokerAddr::tls(self.broker.host(), self.broker.port()),
                Some(SimTls::from_files(Some(ca), None).context("TLS settings for the fleet")?),
            ),
            None => (
                BrokerAddr::new(self.broker.host(), self.broker.port()),
                None,
            ),
        };
        let mut config = FleetConfig::new(broker, self.server.topic_root.clone(), devices);
        config.tls = tls;
        Ok(config)
    }

    /// Starts a fleet from `config` and waits until all its devices are
    /// connected.
    pub async fn start_fleet_with(&self, config: FleetConfig) -> Result<Fleet> {
        let n = config.devices.len();
        let fleet = Fleet::start(config).context("starting the simulated fleet")?;
        fleet
            .wait_connected(n, Duration::from_secs(30))
            .await
            .context("waiting for the fleet to connect")?;
        Ok(fleet)
    }

    /// Registers every device of `devices` with `desired` as its desired spec.
    pub async fn register(&self, devices: &[SimDevice], desired: &Value) -> Result<()> {
        let body: Vec<DeviceRegistration> = devices
            .iter()
            .map(|d| DeviceRegistration {
                id: d.id.to_string(),
                labels: None,
                spec: Some(desired.clone()),
                broker_password: None,
            })
            .collect();
        let (status, answer) = self.server.post("/v1/devices", &body).await?;
        if status != 200 {
            bail!("registering devices answered {status}: {answer}");
        }
        Ok(())
    }

    /// Starts simulated devices on the scenario's broker and topic root and
    /// waits until all are connected.
    pub async fn start_fleet(&self, devices: Vec<SimDevice>) -> Result<Fleet> {
        let config = self.fleet_config(devices)?;
        self.start_fleet_with(config).await
    }

    /// Registers the plan's devices, starts them, and waits until `reporting`
    /// of them have a stored report.
    pub async fn register_and_start(&self, plan: &Plan, reporting: usize) -> Result<Fleet> {
        self.register(&plan.devices, &plan.desired_spec).await?;
        let fleet = self.start_fleet(plan.devices.clone()).await?;
        self.wait_reports_stored(reporting, Duration::from_secs(30))
            .await?;
        Ok(fleet)
    }

    /// Waits until at least `n` devices have a stored report (a count that
    /// hangs counts against `timeout` too).
    pub async fn wait_reports_stored(&self, n: usize, timeout: Duration) -> Result<()> {
        self.wait_devices(
            "SELECT count(*) FROM devices WHERE reported_seq IS NOT NULL",
            "with a stored report",
            n,
            timeout,
        )
        .await
    }

    /// Waits until at least `n` devices are seen offline, by the ingest
    /// (`online`) and by the engine (`status`).
    pub async fn wait_offline(&self, n: usize, timeout: Duration) -> Result<()> {
        self.wait_devices(
            "SELECT count(*) FROM devices WHERE online = false AND status = 'offline'",
            "seen offline",
            n,
            timeout,
        )
        .await
    }

    /// Waits until `count` (a SQL count of devices, `what` they are) reaches
    /// `n`; a count that hangs counts against `timeout` too.
    async fn wait_devices(
        &self,
        count: &str,
        what: &str,
        n: usize,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Deadline::after(timeout);
        let mut last = None;
        loop {
            let counted = deadline
                .run(
                    format!(
                        "{n} devices {what} (last count: {})",
                        last.map_or_else(|| "none yet".to_owned(), |s: i64| s.to_string())
                    ),
                    sqlx::query_scalar::<_, i64>(count).fetch_one(self.db.pool()),
                )
                .await?
                .with_context(|| format!("counting devices {what}"))?;
            if usize::try_from(counted).unwrap_or(0) >= n {
                return Ok(());
            }
            last = Some(counted);
            if deadline.has_passed() {
                bail!("only {counted} of {n} devices {what} after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts a manual run over every device and waits for it to complete.
    pub async fn run_all(&self, timeout: Duration) -> Result<(String, Value)> {
        let (status, started) = self.server.post("/v1/runs", &json!({"all": true})).await?;
        if status != 200 {
            bail!("POST /v1/runs answered {status}: {started}");
        }
        let run_id = started["run_id"]
            .as_str()
            .context("run_id in answer")?
            .to_owned();
        let run = self.server.wait_run_completed(&run_id, timeout).await?;
        Ok((run_id, run))
    }

    /// Appends `count` events straight to the event log (as committed
    /// outcomes would be), each carrying `padding` bytes of data, and returns
    /// the sequence of the last one. The relay picks them up like any commit.
    pub async fn append_events(&self, count: usize, padding: usize) -> Result<i64> {
        append_events_to(self.db.pool(), count, padding).await
    }

    /// Event log entries of one run: type → count.
    pub async fn event_counts(
        &self,
        run_id: &str,
    ) -> Result<std::collections::BTreeMap<String, i64>> {
        let run: uuid::Uuid = run_id.parse().context("run id")?;
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT type, count(*) FROM event_log WHERE run_id = $1 GROUP BY type")
                .bind(run)
                .fetch_all(self.db.pool())
                .await
                .context("counting events")?;
        Ok(rows.into_iter().collect())
    }

    /// The `data` of every event of type `kind` about `device`, in
    /// sequence order.
    pub async fn event_data(&self, kind: &str, device: &str) -> Result<Vec<Value>> {
        let filter = idem_server::store::events::EventFilter {
            run_id: None,
            event_type: Some(kind.to_owned()),
            subject: Some(device.to_owned()),
        };
        let events = idem_server::events::log::read(self.db.pool(), 0, &filter, 100_000)
            .await
            .context("reading a device's events")?;
        Ok(events
            .into_iter()
            .map(|event| event.cloudevent["data"].clone())
            .collect())
    }

    /// `GET /v1/devices/{id}`, which must answer 200.
    pub async fn device(&self, id: &str) -> Result<Value> {
        let (status, view) = self.server.get(&format!("/v1/devices/{id}")).await?;
        if status != 200 {
            bail!("GET /v1/devices/{id}: {status} {view}");
        }
        Ok(view)
    }
}

/// Appends the `already_converged` outcomes of `count` devices
/// (`filler-00000`, …) in run `run` straight to the event log of `pool`'s
/// database, stored as a new run's converged targets are (slices), and
/// returns the sequence of the last one.
pub async fn append_converged_to(
    pool: &sqlx::PgPool,
    run: uuid::Uuid,
    count: usize,
) -> Result<i64> {
    use idem_protocol::{DeviceId, Generation, Health};
    use idem_server::store::events::reserve_sequences;
    use idem_server::store::runs::ConvergedTarget;
    let devices: Vec<DeviceId> = (0..count)
        .map(|i| DeviceId::parse(&format!("filler-{i:05}")))
        .collect::<Result<_, _>>()
        .context("filler device ids")?;
    let targets: Vec<ConvergedTarget<'_>> = devices
        .iter()
        .zip(0_u64..)
        .map(|(device, i)| ConvergedTarget {
            device_id: device,
            generation: Generation(1 + i % 3),
            health: (i % 2 == 0).then_some(Health::Healthy),
        })
        .collect();
    let mut tx = pool.begin().await.context("starting a transaction")?;
    let first = reserve_sequences(&mut tx, count)
        .await
        .context("reserving sequences")?;
    idem_server::events::log::append_converged(
        &mut tx,
        run,
        &targets,
        first,
        "/idem/test-filler",
        chrono::Utc::now(),
    )
    .await
    .context("appending converged outcomes")?;
    tx.commit().await.context("committing events")?;
    let first = i64::try_from(first).context("sequence out of range")?;
    Ok(first + i64::try_from(count).unwrap_or(i64::MAX) - 1)
}

/// Appends `count` events straight to the event log of `pool`'s database
/// (as committed outcomes would be), each carrying `padding` bytes of data,
/// and returns the sequence of the last one; the relay picks them up like
/// any commit. Each event's CloudEvent `id` is its sequence.
pub async fn append_events_to(pool: &sqlx::PgPool, count: usize, padding: usize) -> Result<i64> {
    use idem_server::store::events::{insert, reserve_sequences, EventRow};
    let mut tx = pool.begin().await.context("starting a transaction")?;
    let first = reserve_sequences(&mut tx, count)
        .await
        .context("reserving sequences")?;
    let first = i64::try_from(first).context("sequence out of range")?;
    let pad = "x".repeat(padding);
    let rows: Vec<EventRow> = (0..count)
        .map(|i| {
            let sequence = first + i64::try_from(i).unwrap_or(i64::MAX);
            let subject = format!("filler-{}", i % 100);
            EventRow {
                sequence,
                id: uuid::Uuid::new_v4(),
                event_type: "io.idem.device.already_converged".to_owned(),
                subject: subject.clone(),
                run_id: None,
                time: chrono::Utc::now(),
                cloudevent: json!({
                    "specversion": "1.0",
                    "type": "io.idem.device.already_converged",
                    "source": "/idem/test-filler",
                    "id": sequence.to_string(),
                    "subject": subject,
                    "sequence": sequence.to_string(),
                    "data": {"padding": pad},
                }),
            }
        })
        .collect();
    for chunk in rows.chunks(5_000) {
        insert(&mut tx, chunk).await.context("appending events")?;
    }
    tx.commit().await.context("committing events")?;
    Ok(first + i64::try_from(count).unwrap_or(i64::MAX) - 1)
}
