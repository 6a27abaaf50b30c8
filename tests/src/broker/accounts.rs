//! The broker's accounts: a password file hashed with the system's
//! `mosquitto_passwd`, and the dynamic-security plugin with its state
//! initialised by `mosquitto_ctrl`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};

use crate::support::{find_binary_in, output_within, COMMAND_LIMIT};

const MISSING_PASSWD: &str = "mosquitto_passwd not found: install it with \
    `apt-get install mosquitto` (it ships the tool) or run scripts/test";
const MISSING_DYNSEC: &str = "Mosquitto's dynamic-security plugin \
    (mosquitto_dynamic_security.so) or mosquitto_ctrl not found: install Debian's \
    `mosquitto` and `mosquitto-clients` packages, or run scripts/test, which installs them";

/// Where Debian and other distributions put the plugin.
pub(crate) fn dynsec_plugin() -> Result<PathBuf> {
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so",
        "/usr/lib/aarch64-linux-gnu/mosquitto_dynamic_security.so",
        "/usr/lib/mosquitto_dynamic_security.so",
        "/usr/lib64/mosquitto_dynamic_security.so",
        "/usr/local/lib/mosquitto_dynamic_security.so",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!(MISSING_DYNSEC))
}

/// `mosquitto_ctrl dynsec init <state> <admin> <password>`.
pub(super) fn init_dynamic_security(state: &Path, admin: &str, password: &str) -> Result<()> {
    let ctrl = find_binary_in(
        std::env::var_os("PATH").as_deref(),
        "mosquitto_ctrl",
        &[PathBuf::from("/usr/bin/mosquitto_ctrl")],
    )
    .ok_or_else(|| anyhow!(MISSING_DYNSEC))?;
    let output = output_within(
        Command::new(&ctrl)
            .args(["dynsec", "init"])
            .arg(state)
            .arg(admin)
            .arg(password),
        None,
        COMMAND_LIMIT,
        &format!("{} dynsec init", ctrl.display()),
    )?;
    if !output.status.success() || !state.is_file() {
        bail!(
            "{} dynsec init failed with {}: {}",
            ctrl.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Writes `accounts` as `user:password` lines and hashes the file in place
/// with `mosquitto_passwd -U` (one call for any number of accounts).
pub(super) fn write_password_file(path: &Path, accounts: &[(String, String)]) -> Result<()> {
    let passwd = find_binary_in(
        std::env::var_os("PATH").as_deref(),
        "mosquitto_passwd",
        &[PathBuf::from("/usr/bin/mosquitto_passwd")],
    )
    .ok_or_else(|| anyhow!(MISSING_PASSWD))?;
    let mut plain = String::new();
    for (user, password) in accounts {
        if user.contains(':') || user.contains('\n') || password.contains('\n') {
            bail!(
                "account {user:?}: user names cannot hold ':' or newlines, passwords no newlines"
            );
        }
        plain.push_str(&format!("{user}:{password}\n"));
    }
    fs::write(path, plain).with_context(|| format!("writing {}", path.display()))?;
    let output = output_within(
        Command::new(&passwd).arg("-U").arg(path),
        None,
        COMMAND_LIMIT,
        &format!("{} -U", passwd.display()),
    )?;
    if !output.status.success() {
        bail!(
            "{} -U {} failed with {}: {}",
            passwd.display(),
            path.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}
