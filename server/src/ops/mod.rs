//! Running the server: its Prometheus metrics, stuck-work detection for
//! `/readyz`, retention of what grows with every run, and the end of
//! drift exemptions that expire.

pub(crate) mod exemptions;
pub mod metrics;
pub(crate) mod retention;
pub(crate) mod stall;
