//! Wiring: builds the shared state, starts the MQTT loop, the ingest, the
//! engine and the HTTP server (`crate::http`), and shuts them down in order when the token is
//! cancelled. Takes an injected listener, pool and token so tests can run the
//! whole server in-process on port 0.

pub mod instance;
pub mod session_drains;

use std::sync::Arc;

use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, Notify};
use tokio_util::sync::CancellationToken;

use crate::config::ValidConfig;
use crate::engine::seat::EngineSeat;
use crate::engine::{
    EngineCommand, EngineContext, EngineInbox, EngineStats, RolloutRequest, RunRequest,
};
use crate::events::relay::EventRelay;
use crate::http::sse::SseClients;
use crate::http::state::{AppState, Stalls};
use crate::ingest::Ingest;
use crate::mqtt::intake::{intake, IntakeGauge, IntakeReceiver, IntakeSender};
use crate::mqtt::{self, MqttStatus, Publisher};
use crate::ops::metrics::Metrics;
use crate::store::cache::FleetCache;
use crate::store::{self, DeviceWriter, StoreError};
use crate::tuning::{ENGINE_CAPACITY, LIVE_EVENTS_CAPACITY, RUN_REQUESTS_CAPACITY};

/// How long each of the last two shutdown steps may take: the event relay
/// passing on what was committed, then MQTT writing what was handed to it
/// and the broker closing the connection on our DISCONNECT. A step still
/// running then (the broker unreachable, say) is cut short: the relay's
/// cursor brings what it had not relayed at the next start, the broker's
/// persistent session redelivers unacknowledged reports, unfinished runs
/// resume; event publishes not written are lost to MQTT subscribers only.
pub const SHUTDOWN_FLUSH_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Instance(#[from] instance::InstanceError),
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
    let claim = instance::claim(&pool, &config.fleet.instance, config.fleet.instance_lease).await?;
    instance::agree_on_approval(&pool, &claim, config.changes.require_approval).await?;
    tracing::info!(instance = %claim.name, "instance name claimed");
    // The claim's heartbeat runs until the very end (after the MQTT
    // session closed), on its own token; it stops the server through
    // `token` if another process took the name over.
    let beats = CancellationToken::new();
    let at_stop = match config.mqtt.share_group {
        Some(_) => instance::AtStop::LeaveForDrain,
        None => instance::AtStop::Release,
    };
    let keeper = tokio::spawn(instance::keep(
        pool.clone(),
        claim,
        at_stop,
        beats.clone(),
        token.clone(),
    ));
    // Read before the load: the cache then follows other writers from here
    // (a row changed in between is read once more, as it is by then).
    let seen = store::writer::versions_high(&pool).await?;
    let rows = store::devices::load_all(&pool).await?;
    let owned = store::owned::declared_set(&pool).await?;
    let mut resolver = crate::reconcile::owned::OwnedResolver::new(owned.clone());
    let mut entries = store::device_rows::cache_entries(&rows, &mut resolver)?;
    drop(rows);
    let exempt: std::collections::HashSet<idem_protocol::DeviceId> =
        store::exemptions::exempt_devices(&pool, None)
            .await?
            .into_iter()
            .collect();
    for (id, entry) in &mut entries {
        entry.exempt = exempt.contains(id);
    }
    let fleet = Arc::new(FleetCache::from_entries(entries).with_owned_set(owned));
    tracing::info!(devices = fleet.len(), "device cache loaded");

    let (client, eventloop) = mqtt::connect(&config);
    let (engine_tx, engine_rx) = mpsc::channel(ENGINE_CAPACITY);
    let (runs_tx, runs_rx) = mpsc::channel(RUN_REQUESTS_CAPACITY);
    let (rollouts_tx, rollouts_rx) = mpsc::channel(RUN_REQUESTS_CAPACITY);
    let (intake_tx, intake_rx, intake_gauge) = intake(config.mqtt.intake_buffer_bytes);
    let state = Arc::new(shared_state(
        config,
        pool,
        (fleet, seen),
        &client,
        (engine_tx, runs_tx, rollouts_tx),
        intake_gauge,
        &token,
    ));
    let mut workers = Workers::start(
        &state,
        (client, eventloop),
        (intake_tx, intake_rx),
        EngineInbox {
            commands: engine_rx,
            runs: runs_rx,
            rollouts: rollouts_rx,
        },
        &token,
    );

    // Unfinished runs, retained desired messages left behind and the
    // start-up reconcile are the engine lease holder's (`engine::seat`);
    // the API opens once the seat knows whether that is this instance and,
    // if so, has committed what it does at start-up.
    workers.seat_settled().await;

    // Body size is limited (with our own 413) by the HTTP layer, not by
    // axum's 2 MB default.
    let app =
        crate::http::api::router(state.clone()).layer(axum::extract::DefaultBodyLimit::disable());
    crate::http::connections::serve(
        listener,
        app,
        state.config.http.limits.fitted_to_open_files(),
        state.config.http.tls.as_ref().map(|tls| tls.config.clone()),
        state.metrics.clone(),
        token.clone(),
    )
    .await;

    workers.stop(&state.publisher).await;
    drop(state);
    beats.cancel();
    if let Err(e) = keeper.await {
        tracing::warn!(error = %e, "the instance heartbeat task failed");
    }
    Ok(())
}

/// What every handler and task shares.
fn shared_state(
    config: ValidConfig,
    pool: PgPool,
    (fleet, seen): (Arc<FleetCache>, i64),
    client: &rumqttc::AsyncClient,
    (engine, run_requests, rollout_requests): (
        mpsc::Sender<EngineCommand>,
        mpsc::Sender<RunRequest>,
        mpsc::Sender<RolloutRequest>,
    ),
    intake: IntakeGauge,
    token: &CancellationToken,
) -> AppState {
    let metrics = Arc::new(Metrics::for_instance(&config.fleet.instance));
    let publisher = Publisher::new(
        client.clone(),
        config.fleet.topic_root.clone(),
        config.fleet.budget,
        metrics.clone(),
    );
    let dynsec = match config.security.broker_accounts {
        crate::config::BrokerAccounts::Dynsec => {
            Some(crate::broker::dynsec::Dynsec::new(publisher.clone()))
        }
        crate::config::BrokerAccounts::None | crate::config::BrokerAccounts::PasswordFile => None,
    };
    let auth = config.security.auth;
    if auth.disabled {
        tracing::warn!("--insecure-no-auth: the API answers everyone as an admin, without a token");
    }
    let (live_events, _) = broadcast::channel(LIVE_EVENTS_CAPACITY);
    let writer = Arc::new(DeviceWriter::new(pool.clone(), fleet.clone(), seen));
    AppState {
        pool,
        fleet,
        writer,
        metrics,
        engine,
        live_events,
        events_wake: Arc::new(Notify::new()),
        relay_held: Arc::default(),
        engine_held: Arc::default(),
        mqtt: Arc::new(MqttStatus::default()),
        publisher,
        engine_stats: Arc::new(EngineStats::default()),
        event_source: config.fleet.event_source(),
        sse: SseClients::new(config.http.sse, token.clone()),
        stalls: Stalls::new(config.readiness.stuck_after),
        intake,
        config,
        run_requests,
        rollout_requests,
        auth,
        dynsec,
        plans: crate::store::plans::PlanContents::new(crate::config::PLAN_CONTENTS_CACHED),
        large_reads: crate::http::large_reads::LargeReads::default(),
    }
}

/// The event relay of this process, from what the state shares.
fn event_relay(state: &AppState) -> EventRelay {
    let settings = &state.config.events;
    let fleet = &state.config.fleet;
    EventRelay {
        pool: state.pool.clone(),
        mqtt: settings.mqtt.map(|qos| (state.publisher.clone(), qos)),
        live: state.live_events.clone(),
        wake: state.events_wake.clone(),
        metrics: state.metrics.clone(),
        retention: settings.retention,
        lease: crate::store::leases::LeaseHolder {
            instance: fleet.instance.clone(),
            id: uuid::Uuid::new_v4(),
            ttl: crate::store::leases::time_to_live(fleet.instance_lease),
        },
        held: state.relay_held.clone(),
    }
}

/// The server's tasks and the tokens that stop them.
struct Workers {
    /// Fired once the engine seat made its first try for the lease (and,
    /// holding it, took up what start-up asks).
    settled: Option<tokio::sync::oneshot::Receiver<()>>,
    intake_token: CancellationToken,
    engine_token: CancellationToken,
    relay_token: CancellationToken,
    mqtt_token: CancellationToken,
    /// The ingest and the periodic jobs.
    intake: Vec<tokio::task::JoinHandle<()>>,
    engine: tokio::task::JoinHandle<()>,
    relay: tokio::task::JoinHandle<()>,
    mqtt: tokio::task::JoinHandle<()>,
}

impl Workers {
    /// Starts the MQTT event loop, the engine, the ingest, the relay and
    /// the periodic jobs.
    fn start(
        state: &AppState,
        (client, eventloop): (rumqttc::AsyncClient, rumqttc::EventLoop),
        (intake_tx, intake_rx): (IntakeSender, IntakeReceiver),
        engine_inbox: EngineInbox,
        token: &CancellationToken,
    ) -> Self {
        // Stop order: HTTP and intake first, then the engine writes, then MQTT.
        let intake_token = token.child_token();
        let engine_token = CancellationToken::new();
        let relay_token = CancellationToken::new();
        let mqtt_token = CancellationToken::new();
        let config = &state.config;
        let recheck = crate::mqtt::recheck_signal::RecheckSignal::new();
        let drains =
            config
                .mqtt
                .share_group
                .is_some()
                .then(|| crate::app::session_drains::SessionDrains {
                    pool: state.pool.clone(),
                    config: config.clone(),
                    intake: intake_tx.another(),
                    metrics: state.metrics.clone(),
                });
        let mqtt = tokio::spawn(mqtt::run_event_loop(
            eventloop,
            client.clone(),
            config.fleet.topic_root.clone(),
            config.fleet.budget,
            intake_tx,
            state.mqtt.clone(),
            state.metrics.clone(),
            mqtt::EventLoopHooks {
                control: state
                    .dynsec
                    .clone()
                    .map(|d| d as Arc<dyn mqtt::ControlResponses>),
                recheck: recheck.clone(),
                sys_topics: config.mqtt.sys_topics,
                share_group: config.mqtt.share_group.clone(),
                pub_acks: state.publisher.pub_acks(),
            },
            mqtt_token.clone(),
        ));
        let rechecks = tokio::spawn(crate::engine::recheck::run(
            crate::engine::recheck::Rechecker {
                signal: recheck.clone(),
                client,
                root: config.fleet.topic_root.clone(),
                fleet: state.fleet.clone(),
                engine: state.engine.clone(),
                metrics: state.metrics.clone(),
                rate: config.engine.machine.recheck_rate,
            },
            intake_token.clone(),
        ));
        let (settled_tx, settled) = tokio::sync::oneshot::channel();
        let seat = EngineSeat {
            ctx: EngineContext {
                fleet: state.fleet.clone(),
                metrics: state.metrics.clone(),
                publisher: state.publisher.clone(),
                events_wake: state.events_wake.clone(),
                stats: state.engine_stats.clone(),
                event_source: state.event_source.clone(),
                settings: config.engine.machine.clone(),
                writer: state.writer.clone(),
                stall: state.stalls.engine.clone(),
            },
            pool: state.pool.clone(),
            lease: crate::store::leases::LeaseHolder {
                instance: config.fleet.instance.clone(),
                id: uuid::Uuid::new_v4(),
                ttl: crate::store::leases::time_to_live(config.fleet.instance_lease),
            },
            held: state.engine_held.clone(),
            startup_reconcile: config.engine.startup_reconcile,
            settled: std::sync::Mutex::new(Some(settled_tx)),
            rollout_requests: state.rollout_requests.clone(),
        };
        let engine = tokio::spawn(seat.run(engine_inbox, engine_token.clone()));
        let ingest = Ingest {
            pool: state.pool.clone(),
            fleet: state.fleet.clone(),
            metrics: state.metrics.clone(),
            publisher: state.publisher.clone(),
            engine: state.engine.clone(),
            root: config.fleet.topic_root.clone(),
            budget: config.fleet.budget,
            auto_register: config.fleet.auto_register,
            writer: state.writer.clone(),
            stall: state.stalls.ingest.clone(),
            recheck,
            recheck_after_stall: config.engine.recheck_after_stall,
        };
        let intake = vec![
            tokio::spawn(ingest.run(intake_rx, intake_token.clone())),
            rechecks,
            tokio::spawn(metrics_upkeep(
                state.metrics.clone(),
                state.pool.clone(),
                state.fleet.clone(),
                state.intake.clone(),
                intake_token.clone(),
            )),
            tokio::spawn(crate::ops::retention::run(
                state.pool.clone(),
                config.retention,
                intake_token.clone(),
            )),
            tokio::spawn(crate::ops::exemptions::run(
                crate::ops::exemptions::Sweeper {
                    pool: state.pool.clone(),
                    writer: state.writer.clone(),
                    fleet: state.fleet.clone(),
                    engine: state.engine.clone(),
                },
                intake_token.clone(),
            )),
        ];
        let mut intake = intake;
        let following = crate::store::follow::Following {
            every: config.fleet.follow_every,
            notifications: config.fleet.follow_notifications,
        };
        intake.push(tokio::spawn(crate::store::follow::run(
            state.writer.clone(),
            state.pool.clone(),
            following,
            intake_token.clone(),
        )));
        intake.push(tokio::spawn(tell_engine_what_others_wrote(
            &state.writer,
            state.engine.clone(),
            intake_token.clone(),
        )));
        if let Some(drains) = drains {
            intake.push(tokio::spawn(drains.run(intake_token.clone())));
        }
        let relay = event_relay(state);
        let relay = tokio::spawn(relay.run(relay_token.clone()));
        Self {
            settled: Some(settled),
            intake_token,
            engine_token,
            relay_token,
            mqtt_token,
            intake,
            engine,
            relay,
            mqtt,
        }
    }

    /// Waits until the engine seat settled (or ended).
    async fn seat_settled(&mut self) {
        if let Some(settled) = self.settled.take() {
            let _ = settled.await;
        }
    }

    /// Stops in order, each step once the one before has ended: intake
    /// first, then the engine writes what it holds, the relay passes on
    /// what was committed, and MQTT sends what it was handed, then
    /// disconnects. The last two are bounded by [`SHUTDOWN_FLUSH_LIMIT`].
    async fn stop(mut self, publisher: &Publisher) {
        self.intake_token.cancel();
        for task in self.intake {
            let _ = task.await;
        }
        // The ingest is gone: every report it stored has its ack queued.
        self.engine_token.cancel();
        let _ = self.engine.await;
        // Nothing of this process writes events any more: the relay relays
        // what is committed and ends.
        self.relay_token.cancel();
        if tokio::time::timeout(SHUTDOWN_FLUSH_LIMIT, &mut self.relay)
            .await
            .is_err()
        {
            tracing::warn!(
                "the event relay had not caught up {SHUTDOWN_FLUSH_LIMIT:?} into the shutdown; \
                 it relays the rest at the next start"
            );
            self.relay.abort();
            let _ = (&mut self.relay).await;
        }
        // The outbox hands over what waits, DISCONNECT is queued behind it,
        // and the event loop ends once the broker closed the connection.
        let disconnected = tokio::time::timeout(SHUTDOWN_FLUSH_LIMIT, async {
            publisher.disconnect().await;
            let _ = (&mut self.mqtt).await;
        })
        .await;
        if disconnected.is_err() {
            tracing::warn!(
                "the MQTT connection had not closed {SHUTDOWN_FLUSH_LIMIT:?} after the shutdown's \
                 DISCONNECT; stopping it with what it has not sent"
            );
            self.mqtt_token.cancel();
            let _ = self.mqtt.await;
        }
    }
}

/// Passes what the cache learnt from other instances' device writes to the
/// engine as it would have heard it from this instance's own ingest and API:
/// stored reports, connection changes, deletions. (Desired changes reach it
/// with the runs that make them.)
fn tell_engine_what_others_wrote(
    writer: &DeviceWriter,
    engine: mpsc::Sender<EngineCommand>,
    token: CancellationToken,
) -> impl std::future::Future<Output = ()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<store::Followed>();
    writer.on_followed(Box::new(move |followed| {
        // The receiver is gone only at shutdown.
        let _ = tx.send(followed);
    }));
    async move {
        loop {
            let followed = tokio::select! {
                () = token.cancelled() => return,
                followed = rx.recv() => match followed {
                    Some(followed) => followed,
                    None => return,
                },
            };
            let mut commands = Vec::with_capacity(5);
            if !followed.reported.is_empty() {
                commands.push(EngineCommand::ReportsApplied(followed.reported));
            }
            if !followed.online.is_empty() {
                commands.push(EngineCommand::Connectivity(followed.online));
            }
            if !followed.removed.is_empty() {
                commands.push(EngineCommand::DevicesRemoved(followed.removed));
            }
            // Ended by an instance that does not hold the engine (its own
            // engine drops the command): the holder hears it here.
            if !followed.exemptions_started.is_empty() {
                commands.push(EngineCommand::ExemptionsStarted(
                    followed.exemptions_started,
                ));
            }
            if !followed.exemptions_ended.is_empty() {
                commands.push(EngineCommand::ExemptionsEnded(followed.exemptions_ended));
            }
            for command in commands {
                if engine.send(command).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Periodic metric work: histogram upkeep, the devices-by-status gauges
/// (one grouped count, not a per-device label) and the fleet cache's size.
async fn metrics_upkeep(
    metrics: Arc<Metrics>,
    pool: PgPool,
    fleet: Arc<FleetCache>,
    intake: IntakeGauge,
    token: CancellationToken,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(2));
    loop {
        tokio::select! {
            () = token.cancelled() => break,
            _ = tick.tick() => {
                metrics.run_upkeep();
                metrics.fleet_cache_bytes.set(fleet.footprint_bytes() as f64);
                metrics.exempt_devices.set(fleet.ids_exempt().len() as f64);
                let backlog = intake.backlog(std::time::Instant::now());
                metrics.intake_messages.set(backlog.messages as f64);
                metrics.intake_bytes.set(backlog.bytes as f64);
                metrics.intake_oldest.set(backlog.oldest.as_secs_f64());
                match store::devices::count_by_status(&pool).await {
                    Ok(counts) => metrics.set_devices_by_status(&counts),
                    Err(e) => tracing::debug!(error = %e, "devices-by-status gauge not refreshed"),
                }
                match store::devices::count_unhealthy_converged(&pool).await {
                    Ok(n) => metrics.unhealthy_converged.set(n as f64),
                    Err(e) => tracing::debug!(error = %e, "unhealthy gauge not refreshed"),
                }
            }
        }
    }
}
