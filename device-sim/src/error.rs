//! Typed errors of the simulator library: configuration, planning and fleet
//! control. Nothing here performs IO.

use std::path::PathBuf;
use std::time::Duration;

use idem_protocol::{DeviceId, InvalidDeviceId, MqttUrlError};

/// What a refusal of `reason` adds after it: where credentials go instead.
fn broker_url_hint(reason: &MqttUrlError) -> &'static str {
    match reason {
        MqttUrlError::Credentials => {
            ", which do not belong in the URL: use a credentials file (--credentials-file)"
        }
        MqttUrlError::Scheme
        | MqttUrlError::Websockets
        | MqttUrlError::Path
        | MqttUrlError::Host
        | MqttUrlError::UnclosedIpv6Host
        | MqttUrlError::TextAfterIpv6Host
        | MqttUrlError::Port => "",
    }
}

/// Why a fleet could not be started or controlled.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(
        "broker URL {url:?} {reason}{} (expected e.g. mqtt://127.0.0.1:1883)",
        broker_url_hint(.reason)
    )]
    InvalidBrokerUrl {
        /// Redacted: a password typed into the URL is never echoed.
        url: String,
        reason: MqttUrlError,
    },
    #[error("device {0} appears more than once in the fleet; device ids must be unique")]
    DuplicateDevice(DeviceId),
    #[error("no device {0} in this fleet")]
    UnknownDevice(DeviceId),
    #[error("device {0} has stopped (the fleet is shutting down)")]
    DeviceStopped(DeviceId),
    #[error("Fleet::start must be called from inside a tokio runtime")]
    NoRuntime,
    #[error("keep-alive must be zero (off) or at least one second, got {0:?}")]
    InvalidKeepAlive(Duration),
    #[error("MQTT inflight window must be at least 1")]
    ZeroInflight,
    #[error(
        "timed out after {timeout:?} waiting for {wanted} connected devices; {connected} connected"
    )]
    ConnectTimeout {
        timeout: Duration,
        wanted: usize,
        connected: usize,
    },
    #[error(
        "{running} of {devices} device tasks were still running {limit:?} after the fleet was \
         told to shut down (each disconnects within about 2 s)"
    )]
    ShutdownTimeout {
        limit: Duration,
        devices: usize,
        running: usize,
    },
    #[error("TLS settings for {}: {reason}", path.display())]
    Tls { path: PathBuf, reason: String },
    #[error("TLS settings were given but the broker {0} is not mqtts://: use an mqtts:// broker URL or drop --ca-file / --client-cert")]
    TlsNeedsMqtts(String),
    #[error("credentials file {}{}: {reason}", path.display(), if *line > 0 { format!(", line {line}") } else { String::new() })]
    Credentials {
        path: PathBuf,
        /// 1-based; 0 when the file as a whole is the problem.
        line: usize,
        reason: String,
    },
    #[error("no broker password for device {device} ({missing} devices without one): add `{device}:password` lines to the credentials file")]
    MissingPassword { device: DeviceId, missing: usize },
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// Why a [`crate::FleetPlan`] cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "the plan asks for {requested} special devices (drifted + rejecting + silent + ignoring) \
         but the fleet has only {devices}; lower those counts or raise the device count"
    )]
    TooManySpecial { requested: usize, devices: usize },
    #[error("id prefix {prefix:?} does not give valid device ids ({source}); use letters, digits, '_', '.' or '-'")]
    InvalidPrefix {
        prefix: String,
        #[source]
        source: InvalidDeviceId,
    },
    #[error("apply latency range is inverted: min {min:?} > max {max:?}")]
    InvertedLatency { min: Duration, max: Duration },
}
