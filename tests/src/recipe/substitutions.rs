//! The only changes the test makes to a recipe's text ([`Substitutions`],
//! each one required to match where the document must still say it) and
//! the refusal of a script that names a system path outside the sandbox.

use std::path::Path;

use anyhow::{bail, Result};

use super::BrokerUser;

/// Where Debian puts the plugin; the recipe names this path.
const DEBIAN_PLUGIN: &str = "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so";

/// Text replacements, in order; `required` ones must match the recipe at
/// least once (else the document changed under the test).
#[derive(Debug, Clone)]
pub struct Substitutions {
    rules: Vec<(String, String, bool)>,
}

impl Substitutions {
    pub fn new() -> Self {
        Self { rules: Vec::new() }
    }

    /// Replaces `from` by `to`; the recipe must contain `from`.
    pub fn required(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.rules.push((from.into(), to.into(), true));
        self
    }

    /// Replaces `from` by `to` where it occurs.
    pub fn optional(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.rules.push((from.into(), to.into(), false));
        self
    }

    /// `text` with every rule applied; `all_text` is the whole recipe of the
    /// mode, which the required rules must match.
    pub fn apply(&self, text: &str, all_text: &str) -> Result<String> {
        let mut out = text.to_owned();
        for (from, to, required) in &self.rules {
            if *required && !all_text.contains(from.as_str()) {
                bail!("the recipe no longer contains {from:?}, which the test replaces by {to:?}");
            }
            out = out.replace(from.as_str(), to);
        }
        Ok(out)
    }
}

impl Default for Substitutions {
    fn default() -> Self {
        Self::new()
    }
}

/// Refuses a script that still names a system path the sandbox stands for:
/// every `/etc/` and `/var/lib/` must lie under `root`, and no `~/`.
pub fn check_confined(script: &str, root: &Path) -> Result<()> {
    let root = root.to_string_lossy();
    for (n, line) in script.lines().enumerate() {
        for system in ["/etc/", "/var/lib/", "/usr/local/"] {
            let mut from = 0;
            while let Some(at) = line[from..].find(system) {
                let at = from + at;
                if !line[..at].ends_with(root.as_ref()) {
                    bail!(
                        "script line {}: {system} outside the sandbox ({}): {line}",
                        n + 1,
                        root
                    );
                }
                from = at + system.len();
            }
        }
        if line.contains("~/") {
            bail!("script line {}: `~/` (use $HOME): {line}", n + 1);
        }
    }
    Ok(())
}

/// The only changes the test makes to a recipe: the broker's port and name
/// (127.0.0.1, on a free port), the test database, the built server, the
/// plugin where this machine has it, the sandbox for `/etc/` and
/// `/var/lib/`, and, when Mosquitto cannot run as its own user, our user
/// for `mosquitto` in `chown` and `install`.
pub(super) fn substitutions(
    root: &Path,
    broker_port: u16,
    database_url: &str,
    server_binary: &Path,
    broker_user: &BrokerUser,
    recipe_text: &str,
) -> Result<Substitutions> {
    let root = root.display().to_string();
    let mut rules = Substitutions::new()
        .required("broker.example:8883", format!("127.0.0.1:{broker_port}"))
        .required("DNS:broker.example", "IP:127.0.0.1")
        .required("listener 8883", format!("listener {broker_port} 127.0.0.1"))
        .required("postgres://idem@db-host/idem", database_url)
        .required(
            "/usr/local/bin/idem-server",
            server_binary.display().to_string(),
        );
    if recipe_text.contains(DEBIAN_PLUGIN) {
        let plugin = crate::broker::dynsec_plugin()?;
        rules = rules.optional(DEBIAN_PLUGIN, plugin.display().to_string());
    }
    rules = rules
        .required("/etc/", format!("{root}/etc/"))
        .optional("/var/lib/", format!("{root}/var/lib/"));
    if !broker_user.privileged {
        let (uid, gid) = (broker_user.uid, broker_user.gid);
        rules = rules
            .optional("-o mosquitto -g mosquitto", format!("-o {uid} -g {gid}"))
            .optional("mosquitto:mosquitto", format!("{uid}:{gid}"));
    }
    Ok(rules)
}
