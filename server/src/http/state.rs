//! `AppState`: what the HTTP handlers and the server's tasks share (pool,
//! fleet cache, engine channel, publisher, settings). It names the types it
//! holds and imports no handler or middleware, so `api`, `auth` and `sse`
//! can all depend on it without a cycle; `app` builds it.

use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::{broadcast, mpsc, Notify};

use crate::config::ValidConfig;
use crate::engine::{EngineCommand, EngineStats, RolloutRequest, RunRequest};
use crate::http::sse::SseClients;
use crate::mqtt::{MqttStatus, Publisher};
use crate::ops::metrics::Metrics;
use crate::ops::stall::Stall;
use crate::store::cache::FleetCache;
use crate::store::events::StoredEvent;
use crate::store::DeviceWriter;

/// What every handler and task shares.
pub struct AppState {
    pub pool: PgPool,
    /// The fleet cache, to read; it changes only through `writer`.
    pub fleet: Arc<FleetCache>,
    /// The one writer of device rows and of the cache.
    pub writer: Arc<DeviceWriter>,
    pub metrics: Arc<Metrics>,
    pub engine: mpsc::Sender<EngineCommand>,
    /// Committed events, in sequence order, from the relay (for SSE).
    pub live_events: broadcast::Sender<Arc<StoredEvent>>,
    /// Wakes the relay after a commit that wrote events.
    pub events_wake: Arc<Notify>,
    /// Set while this instance's relay holds the `relay` lease (`/readyz`).
    pub relay_held: Arc<std::sync::atomic::AtomicBool>,
    /// This instance holds the `engine` lease (`engine::seat`).
    pub engine_held: Arc<std::sync::atomic::AtomicBool>,
    pub mqtt: Arc<MqttStatus>,
    /// For clearing a deleted device's retained messages.
    pub publisher: Publisher,
    pub engine_stats: Arc<EngineStats>,
    pub event_source: String,
    /// The SSE client cap and settings (`GET /v1/events`).
    pub sse: SseClients,
    pub config: ValidConfig,
    /// Failing-write marks of the ingest and the engine, for `/readyz`.
    pub stalls: Stalls,
    /// What waits between the MQTT event loop and the ingest, for `/readyz`.
    pub intake: crate::mqtt::intake::IntakeGauge,
    /// How the API decides access.
    pub auth: crate::http::auth::AuthSettings,
    /// Creates and removes device accounts on the broker (`--broker-accounts dynsec`).
    pub dynsec: Option<Arc<crate::broker::dynsec::Dynsec>>,
    /// Runs asked for by API calls: the engine creates and starts them.
    pub run_requests: mpsc::Sender<RunRequest>,
    /// Operators' resumes, aborts and approvals of rollouts, to the engine.
    pub rollout_requests: mpsc::Sender<RolloutRequest>,
    /// The contents of plans read lately (`POST /v1/plans`; the plans
    /// themselves are in PostgreSQL).
    pub plans: crate::store::plans::PlanContents,
    /// Turns of the reads whose answers can be large (plan and device pages).
    pub large_reads: crate::http::large_reads::LargeReads,
}

/// The workers whose stuck writes make the server not ready.
#[derive(Debug, Clone)]
pub struct Stalls {
    pub ingest: Arc<Stall>,
    pub engine: Arc<Stall>,
}

impl Stalls {
    pub(crate) fn new(threshold: std::time::Duration) -> Self {
        Self {
            ingest: Arc::new(Stall::new(threshold)),
            engine: Arc::new(Stall::new(threshold)),
        }
    }
}

/// The streams' share of the server's state (cheap clones: a pool, a
/// sender and shared counters).
impl axum::extract::FromRef<Arc<AppState>> for crate::http::sse::SseState {
    fn from_ref(state: &Arc<AppState>) -> Self {
        crate::http::sse::SseState {
            pool: state.pool.clone(),
            clients: state.sse.clone(),
            live_events: state.live_events.clone(),
            metrics: state.metrics.clone(),
        }
    }
}
