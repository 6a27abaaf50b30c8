//! The body of `GET /v1/cluster`: the server instances sharing this
//! database, as their claims in it say.

use serde::{Deserialize, Serialize};

/// `GET /v1/cluster`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterView {
    /// The name of the instance that answered.
    pub instance: String,
    /// Every claimed instance name, by name.
    pub instances: Vec<ClusterInstance>,
    /// Work one instance does at a time (`relay`: publishing the event log
    /// to MQTT), and who holds it.
    pub leases: Vec<ClusterLease>,
}

/// One lease and its holder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterLease {
    pub name: String,
    /// The instance name that renewed it last.
    pub holder: String,
    /// Grows by one each time the lease changes hands.
    pub epoch: i64,
    /// Renewed within its time to live.
    pub live: bool,
    /// Milliseconds since its last renewal (absent once released).
    pub renewed_age_ms: Option<u64>,
    pub ttl_ms: u64,
}

/// One instance name's claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterInstance {
    pub name: String,
    pub host: String,
    pub pid: u32,
    /// Its heartbeat is younger than its lease.
    pub live: bool,
    /// Milliseconds since its last heartbeat, by the database's clock.
    pub heartbeat_age_ms: u64,
    /// How long its claim lasts without a heartbeat.
    pub lease_ms: u64,
    /// Seconds since it claimed the name.
    pub uptime_s: u64,
    /// The instance draining this one's MQTT session (it stopped or died
    /// while sharing the fleet's subscriptions); host and pid are then the
    /// drainer's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained_by: Option<String>,
}
