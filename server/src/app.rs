//! Wiring: builds the shared state, starts the MQTT loop, the ingest, the
//! engine and the HTTP server, and shuts them down in order when the token is
//! cancelled. Takes an injected listener, pool and token so tests can run the
//! whole server in-process on port 0.

use std::sync::Arc;

use idem_protocol::DeviceId;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use crate::config::ValidConfig;
use crate::fleet::Fleet;
use crate::ingest::Ingest;
use crate::metrics::Metrics;
use crate::mqtt::{self, MqttStatus, Publisher};
use crate::reconcile::engine::{Engine, EngineCommand, EngineNotice};
use crate::store::{self, StoreError};

/// Inbound MQTT messages buffered between the event loop and the ingest.
const INBOUND_CAPACITY: usize = 16_384;
const ENGINE_CAPACITY: usize = 1_024;

/// What every handler and task shares.
pub struct AppState {
    pub pool: PgPool,
    pub fleet: Arc<Fleet>,
    pub metrics: Arc<Metrics>,
    pub engine: mpsc::Sender<EngineCommand>,
    pub notices: broadcast::Sender<EngineNotice>,
    pub mqtt: Arc<MqttStatus>,
    pub event_source: String,
    pub config: ValidConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("HTTP server failed: {0}")]
    Http(#[source] std::io::Error),
}

/// Runs the server until `token` is cancelled: migrations, cache load,
/// resumption of unfinished runs, then serving. Returns after a graceful stop.
pub async fn run(
    config: ValidConfig,
    listener: TcpListener,
    pool: PgPool,
    token: CancellationToken,
) -> Result<(), ServerError> {
    store::migrate(&pool).await?;
    let rows = store::devices::load_all(&pool).await?;
    let fleet = Arc::new(Fleet::from_rows(&rows));
    drop(rows);
    tracing::info!(devices = fleet.len(), "device cache loaded");

    let metrics = Arc::new(Metrics::new());
    let mqtt_status = Arc::new(MqttStatus::default());
    let (client, eventloop) = mqtt::connect(&config);
    let publisher = Publisher::new(client.clone(), config.topic_root.clone());
    let (inbound_tx, inbound_rx) = mpsc::channel(INBOUND_CAPACITY);
    let (engine_tx, engine_rx) = mpsc::channel(ENGINE_CAPACITY);
    let (notices, _) = broadcast::channel(1_024);
    let event_source = format!("/idem/{}", config.config.instance);

    // Stop order: HTTP and intake first, then the engine flushes, then MQTT.
    let intake_token = token.child_token();
    let engine_token = CancellationToken::new();
    let mqtt_token = CancellationToken::new();

    let mqtt_task = tokio::spawn(mqtt::run_event_loop(
        eventloop,
        client,
        config.topic_root.clone(),
        inbound_tx,
        mqtt_status.clone(),
        metrics.clone(),
        mqtt_token.clone(),
    ));
    let engine = Engine::new(
        pool.clone(),
        fleet.clone(),
        metrics.clone(),
        publisher.clone(),
        notices.clone(),
        config.config.push_timeout,
        event_source.clone(),
    );
    let engine_task = tokio::spawn(engine.run(engine_rx, engine_token.clone()));
    let ingest = Ingest {
        pool: pool.clone(),
        fleet: fleet.clone(),
        metrics: metrics.clone(),
        publisher: publisher.clone(),
        engine: engine_tx.clone(),
        root: config.topic_root.clone(),
        max_payload: config.config.max_payload_bytes,
        auto_register: config.config.auto_register,
    };
    let ingest_task = tokio::spawn(ingest.run(inbound_rx, intake_token.clone()));
    let upkeep_task = tokio::spawn(metrics_upkeep(metrics.clone(), intake_token.clone()));

    resume_unfinished_runs(&pool, &engine_tx).await?;

    let state = Arc::new(AppState {
        pool,
        fleet,
        metrics,
        engine: engine_tx,
        notices,
        mqtt: mqtt_status,
        event_source,
        config,
    });
    let app = crate::api::router(state.clone());
    let http_token = token.clone();
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move { http_token.cancelled().await })
        .await;

    intake_token.cancel();
    let _ = ingest_task.await;
    let _ = upkeep_task.await;
    engine_token.cancel();
    let _ = engine_task.await;
    publisher.disconnect().await;
    // Give the event loop a moment to send DISCONNECT before it stops.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    mqtt_token.cancel();
    let _ = mqtt_task.await;
    drop(state);
    served.map_err(ServerError::Http)
}

/// Runs left `running` by an earlier process continue with their undecided
/// targets.
async fn resume_unfinished_runs(
    pool: &PgPool,
    engine: &mpsc::Sender<EngineCommand>,
) -> Result<(), ServerError> {
    for run in store::runs::unfinished(pool).await? {
        let undecided = store::runs::undecided_targets(pool, run.id).await?;
        let targets: Vec<DeviceId> = undecided
            .iter()
            .filter_map(|id| DeviceId::parse(id).ok())
            .collect();
        let decided = usize::try_from(run.target_count)
            .unwrap_or(0)
            .saturating_sub(targets.len());
        tracing::info!(run_id = %run.id, undecided = targets.len(), "resuming unfinished run");
        let command = EngineCommand::StartRun {
            run_id: run.id,
            trigger: run.trigger,
            targets,
            force: run.force,
            decided,
        };
        if engine.send(command).await.is_err() {
            break;
        }
    }
    Ok(())
}

async fn metrics_upkeep(metrics: Arc<Metrics>, token: CancellationToken) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
    loop {
        tokio::select! {
            () = token.cancelled() => break,
            _ = tick.tick() => metrics.run_upkeep(),
        }
    }
}
