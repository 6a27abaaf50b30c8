//! The broker as idem configures it: per-device accounts (`accounts`), the
//! dynamic-security commands that create them (`dynsec`) and how large its
//! queues must be for a fleet (`sizing`).

pub mod accounts;
pub(crate) mod dynsec;
pub mod sizing;

pub use crate::mqtt::{SYS_DROPPED_TOPIC, SYS_STORED_TOPIC};
