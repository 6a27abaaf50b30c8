//! The `mosquitto.conf` of one private broker: its loopback listener, TLS,
//! authentication, persistence, queue limits, logging and bridge, as its
//! settings say.

use std::fs;

use anyhow::{Context, Result};

use super::bridge::BridgeToCore;
use super::PrivateMosquitto;
use crate::support::LOOPBACK;

impl PrivateMosquitto {
    pub(super) fn write_config(&self) -> Result<()> {
        // When started as root, mosquitto switches to the `mosquitto` user
        // unless told otherwise; that user could not write our 0700 log dir.
        let user = if nix::unistd::geteuid().is_root() {
            "user root\n"
        } else {
            ""
        };
        let persistence = if self.settings.persistent {
            // Saved on SIGTERM (graceful stop); no periodic autosave, so a
            // kill() loses what a crash would lose.
            format!(
                "persistence true\n\
                 persistence_location {}/\n\
                 persistence_file mosquitto.db\n\
                 autosave_interval 0\n",
                self.dir.path().display()
            )
        } else {
            "persistence false\n".to_owned()
        };
        let tls = match &self.tls {
            None => String::new(),
            Some((ca, server)) => {
                let mut tls = format!(
                    "cafile {}\n\
                     certfile {}\n\
                     keyfile {}\n",
                    ca.ca_file().display(),
                    server.cert.display(),
                    server.key.display(),
                );
                if self.settings.require_client_cert {
                    tls.push_str("require_certificate true\nuse_identity_as_username true\n");
                } else {
                    tls.push_str("require_certificate false\n");
                }
                tls
            }
        };
        let anonymous = !self.settings.authenticates();
        let mut passwords = match &self.password_file {
            // The client id is the user name, whatever the client sends: a
            // device logged in with its own password cannot take another
            // device's session, nor the server's.
            Some(path) if self.settings.client_ids_chosen => {
                format!("password_file {}\n", path.display())
            }
            Some(path) => format!(
                "password_file {}\nuse_username_as_clientid true\n",
                path.display()
            ),
            None => String::new(),
        };
        if let Some(path) = &self.acl_file {
            passwords.push_str(&format!("acl_file {}\n", path.display()));
        }
        if let Some((plugin, state)) = &self.dynsec {
            passwords.push_str(&format!(
                "plugin {}\nplugin_opt_config_file {}\n",
                plugin.display(),
                state.display()
            ));
        }
        let bridge = self
            .settings
            .bridge
            .as_ref()
            .map(BridgeToCore::config)
            .unwrap_or_default();
        let config = format!(
            "# private broker of one idem test\n\
             {user}\
             listener {port} {LOOPBACK}\n\
             {tls}\
             allow_anonymous {anonymous}\n\
             {passwords}\
             {persistence}\
             max_queued_messages {max_queued}\n\
             max_inflight_messages {max_inflight}\n\
             sys_interval 1\n\
             set_tcp_nodelay true\n\
             log_dest file {log}\n\
             log_type error\n\
             log_type warning\n\
             log_type notice\n\
             log_type information\n\
             connection_messages true\n\
             log_timestamp_format %Y-%m-%dT%H:%M:%S\n\
             {bridge}",
            port = self.port,
            log = self.log.display(),
            max_queued = self.settings.queue.max_queued_messages,
            max_inflight = self.settings.queue.max_inflight_messages,
        );
        fs::write(&self.config, config)
            .with_context(|| format!("writing Mosquitto config {}", self.config.display()))
    }
}
