//! idem wire contract v1, shared by the server and every device: topic layout,
//! payload types, device-id rules and the canonical spec digest; and the
//! vocabulary the server's API and events share with every client (outcome
//! kinds and counts, the summary line, device status, event types and their
//! data); the HTTP API's request and answer bodies (`api`); and the two
//! client mechanics every party shares: broker URLs (`broker_address`) and
//! the retry backoff (`backoff`).
//!
//! This crate is pure: serde only, no IO, no async runtime. With the
//! `openapi` feature the API types also derive `utoipa::ToSchema`; with the
//! `sqlx` feature the enums are PostgreSQL `text` (`sql`), the server's one
//! database mapping of them. `docs/PROTOCOL.md`
//! is the normative prose copy of what is encoded here.

pub mod api;
pub mod backoff;
pub mod broker_address;
pub mod device_id;
pub mod device_status;
pub mod digest;
pub mod event;
pub mod generation;
pub mod limits;
pub mod outcome;
pub mod payload;
pub mod run;
#[cfg(feature = "sqlx")]
pub mod sql;
pub mod topic;

pub use backoff::Backoff;
pub use broker_address::{
    parse_mqtt_url, parse_mqtt_url_or_bare_host, BrokerAddr, MqttUrlError, DEFAULT_MQTTS_PORT,
    DEFAULT_MQTT_PORT,
};
pub use device_id::{DeviceId, InvalidDeviceId};
pub use device_status::DeviceStatus;
pub use digest::{canonical_json, InvalidDigest, SpecDigest};
pub use generation::Generation;
pub use limits::{SpecBudget, SpecError, DEFAULT_MAX_SPEC_BYTES, MAX_COUNTER};
pub use outcome::{OutcomeCounts, OutcomeKind};
pub use payload::{DecodeError, Desired, Health, Rejection, Reported, Status, GET_PAYLOAD};
pub use run::{RunState, Trigger};
pub use topic::{Channel, ParsedTopic, TopicError, TopicRoot, DEFAULT_TOPIC_ROOT};
