//! Running the server: its Prometheus metrics, stuck-work detection for
//! `/readyz` and retention of what grows with every run.

pub mod metrics;
pub(crate) mod retention;
pub(crate) mod stall;
