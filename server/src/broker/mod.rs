//! The broker as idem configures it: per-device accounts (`accounts`), the
//! dynamic-security commands that create them (`dynsec`) and how large its
//! queues must be for a fleet (`sizing`).

pub mod accounts;
pub(crate) mod dynsec;
pub mod sizing;

/// Mosquitto's count of messages it dropped (for any client), and of the
/// messages it holds: read when `--broker-sys-topics` is on.
pub const SYS_DROPPED_TOPIC: &str = "$SYS/broker/publish/messages/dropped";
pub const SYS_STORED_TOPIC: &str = "$SYS/broker/store/messages/count";
