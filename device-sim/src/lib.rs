//! idem-device-sim: virtual MQTT devices speaking the idem protocol v1, for
//! demos, end-to-end tests and load.
//!
//! Each simulated device has its own MQTT connection (one rumqttc client and
//! event loop per device, MQTT 3.1.1, plain TCP or TLS, optionally with a
//! per-device password), its own current spec, and a
//! [`DeviceBehaviour`] deciding how it answers pushed configuration. A
//! [`FleetPlan`] builds a fleet with a known mix of drifted, rejecting and
//! silent devices plus the ground truth ([`ExpectedOutcome`]) a correct server
//! must reach; [`Fleet::start`] runs it. [`demo::run_demo`] drives a whole
//! demo against a server's HTTP API ([`api::ServerClient`]) and checks the
//! server's per-device outcomes against that ground truth
//! ([`check::check_outcomes`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_device_sim::SimError> {
//! use std::time::Duration;
//! use idem_device_sim::{parse_broker_url, Fleet, FleetConfig, FleetPlan};
//! use idem_protocol::TopicRoot;
//!
//! let plan = FleetPlan::new("sim-", 50).drifted(4).seed(1).build()?;
//! let config = FleetConfig::new(
//!     parse_broker_url("mqtt://127.0.0.1:1883")?,
//!     TopicRoot::new("test-1/idem/v1").expect("valid root"),
//!     plan.devices.clone(),
//! );
//! let fleet = Fleet::start(config)?;
//! fleet.wait_connected(50, Duration::from_secs(10)).await?;
//! // … drive the server, compare its outcomes with `plan.expected` …
//! fleet.shutdown().await?;
//! # Ok(()) }
//! ```

pub mod api;
pub mod behaviour;
pub mod check;
pub mod config;
pub mod demo;
mod device_task;
pub mod error;
pub mod fleet;
pub mod memory;
pub mod plan;

pub use api::{ApiError, ClientAuth, OutcomeRow, RunView, ServerClient};
pub use behaviour::{respond_to_desired, seq_base_now, DeviceBehaviour, DeviceState};
pub use check::{check_outcomes, GroundTruthCheck, Mismatch};
pub use config::{
    parse_broker_url, Backoff, BrokerAddr, Credentials, FleetConfig, OfflineMode, SecretString,
    SimDevice, SimTls, DEFAULT_MAX_CONNECTING, DEFAULT_MQTTS_PORT, DEFAULT_MQTT_PORT,
};
pub use demo::{
    run_demo, DemoError, DemoObserver, DemoPhase, DemoReport, DemoRollout, DemoRun, DemoSettings,
    RolloutReport,
};
pub use error::{PlanError, SimError};
pub use fleet::{DeviceSnapshot, Fleet, FleetStats};
pub use plan::{
    default_desired_spec, drifted_spec, format_count, ExpectedCounts, ExpectedOutcome, FleetPlan,
    Plan, DEFAULT_REJECT_MESSAGE,
};
