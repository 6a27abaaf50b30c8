//! idem-server: reconciles each device's reported state (MQTT) with the
//! desired state (PostgreSQL), pushing only where they differ and recording
//! one outcome per device per run.
//!
//! `app::run(config, listener, pool, token)` is the whole server; the binary
//! only parses configuration and handles signals.

pub mod api;
pub mod api_error;
pub mod app;
pub mod auth;
pub mod broker_accounts;
pub mod broker_cli;
pub mod broker_sizing;
pub mod cli;
pub mod config;
pub mod dynsec;
pub mod events;
pub mod fleet;
pub mod http;
pub mod ingest;
pub mod input;
pub mod intake;
pub mod metrics;
pub mod mqtt;
pub mod outbox;
pub mod recheck;
pub mod reconcile;
pub mod relay;
pub mod retention;
pub mod retry;
pub mod secret;
pub mod sse;
pub mod stall;
pub mod state;
pub mod store;
pub mod tls;
pub mod token_cli;

pub use app::{run, ServerError};
pub use config::{Config, ValidConfig};
pub use state::AppState;
pub use store::MIGRATOR;
