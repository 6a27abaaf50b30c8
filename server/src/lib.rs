//! idem-server: reconciles each device's reported state (MQTT) with the
//! desired state (PostgreSQL), pushing only where they differ and recording
//! one outcome per device per run.
//!
//! `app::run(config, listener, pool, token)` is the whole server; the binary
//! only parses configuration and handles signals. One folder per layer:
//! `reconcile` (the pure core), `engine` (the loop around it), `ingest`,
//! `mqtt`, `http` (API, SSE, auth), `events`, `store` (PostgreSQL and the
//! fleet cache), `broker` (accounts on the broker), `ops` (metrics, stalls,
//! retention), `security`, `config`, `cli` and `app` (the wiring).

pub mod app;
pub mod broker;
pub mod cli;
pub mod config;
pub(crate) mod engine;
pub mod events;
pub mod http;
pub mod ingest;
pub(crate) mod mqtt;
pub mod ops;
pub(crate) mod reconcile;
pub mod security;
pub mod store;
pub mod tuning;

pub use app::{run, ServerError};
pub use config::{Config, ValidConfig};
pub use store::MIGRATOR;
