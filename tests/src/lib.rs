//! Harness for idem's end-to-end tests: starts and owns the real services the
//! tests talk to — a private Mosquitto, fresh databases on the shared
//! PostgreSQL, throwaway PostgreSQL clusters for fault tests, and a private
//! Prometheus that checks the shipped Grafana dashboards against a real server.
//!
//! It holds no product logic and mocks nothing idem sells. Every fixture is
//! safe to use from many tests running in parallel in one test binary: ports
//! are picked free at run time and names are unique. A missing service is an
//! error that says what to install, never a silent skip. Every wait has a
//! deadline (`deadline`) and, when it passes, says what it waited for.

pub mod api_client;
pub mod broker;
pub mod certs;
pub mod database;
pub mod deadline;
pub mod grafana;
pub mod postgres;
pub mod process_server;
pub mod prometheus;
pub mod push_witness;
pub mod recipe;
pub mod scenario;
pub mod secured;
pub mod server;
pub mod sse_client;
mod support;
pub mod table_writes;
pub mod witness;
pub mod write_floor;

pub use api_client::{outcome_of, ApiClient};
pub use broker::{raise_fd_limit, BridgeToCore, MosquittoBuilder, PrivateMosquitto};
pub use certs::{CertFiles, TestCa};
pub use database::{admin_database_url, TestDatabase, DEFAULT_DATABASE_URL};
pub use deadline::{wait_until, within, Deadline};
pub use postgres::PrivatePostgres;
pub use process_server::ProcessServer;
pub use prometheus::PrivatePrometheus;
pub use push_witness::PushWitness;
pub use scenario::Scenario;
pub use server::{DesiredWatcher, ServerSettings, TestServer};
pub use sse_client::{SseClient, SseMessage, StalledSseClient};
pub use witness::ReportWitness;
