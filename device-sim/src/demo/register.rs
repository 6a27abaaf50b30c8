//! The demo's first step: register the planned devices with their desired
//! spec through the API, in chunks, collecting the broker passwords the
//! server issues; then the optional after-register command.

use std::collections::HashMap;

use idem_protocol::DeviceId;
use serde_json::json;

use crate::api::ServerClient;
use crate::plan::Plan;

use super::{DemoError, DemoObserver, DemoPhase, FLEET_LABEL};

/// Registers the plan's devices with the desired spec, in chunks; returns
/// the broker passwords the server issued, if it issued any.
pub(super) async fn register_fleet(
    client: &ServerClient,
    plan: &Plan,
    label: &str,
    register_chunk: usize,
    observer: &dyn DemoObserver,
) -> Result<HashMap<DeviceId, String>, DemoError> {
    let labels = json!({ FLEET_LABEL: label });
    let mut registered = 0u64;
    let mut issued = HashMap::new();
    for chunk in plan.devices.chunks(register_chunk.max(1)) {
        let counts = client
            .register(
                chunk.iter().map(|d| d.id.as_str()),
                &labels,
                &plan.desired_spec,
            )
            .await?;
        let existing = chunk.len() as u64 - counts.created.min(chunk.len() as u64);
        if existing > 0 {
            return Err(DemoError::AlreadyRegistered {
                existing,
                example: chunk[0].id.to_string(),
            });
        }
        registered += chunk.len() as u64;
        for credential in counts.credentials {
            if let Ok(id) = DeviceId::parse(&credential.id) {
                issued.insert(id, credential.password);
            }
        }
        observer.progress(DemoPhase::Register, registered);
    }
    Ok(issued)
}

/// Runs `command` with `sh -c`, failing on a non-zero exit.
pub(super) async fn run_hook(command: &str) -> Result<(), DemoError> {
    let failed = |reason: String| DemoError::AfterRegister {
        command: command.to_owned(),
        reason,
    };
    let output = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| failed(e.to_string()))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(failed(format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}
