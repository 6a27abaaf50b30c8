//! Running the server: its Prometheus metrics, stuck-work detection for
//! `/readyz`, retention of what grows with every run, and the backoff of
//! loops that retry the database or the broker.

pub mod metrics;
pub mod retention;
pub mod retry;
pub mod stall;
