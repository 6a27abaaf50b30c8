//! Running the server: its Prometheus metrics, stuck-work detection for
//! `/readyz`, retention of what grows with every run, and the backoff of
//! loops that retry the database or the broker.

pub mod metrics;
pub(crate) mod retention;
pub(crate) mod retry;
pub(crate) mod stall;
