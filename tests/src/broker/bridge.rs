//! An edge broker's bridge to the core broker ([`BridgeToCore`]) and the
//! `connection` section of the edge's config it makes.

use crate::support::LOOPBACK;

/// How an edge broker forwards to the core broker the server connects to
/// (docs/ARCHITECTURE.md, "Edge brokers"): device reports and status (wills
/// included) go out to the core, desired and report requests come in. The
/// bridge keeps a persistent session at the core (`cleansession false`), so
/// what the core accepts for an edge's devices while the edge is away is
/// delivered when it is back, and it uses Mosquitto's bridge mode
/// (`try_private`), so the retain flag of every message survives the hop.
#[derive(Debug, Clone)]
pub struct BridgeToCore {
    /// The core broker's plain listener on 127.0.0.1.
    pub core_port: u16,
    /// The server's topic root.
    pub topic_root: String,
    /// The bridge's client id at the core (unique per edge).
    pub name: String,
    /// `Some(ids)`: the bridge subscribes at the core to these devices'
    /// `desired` and `get` topics only, so the core sends each edge only
    /// its own devices' messages. `None`: to `{root}/+/desired` and
    /// `{root}/+/get`, so every edge receives every device's messages.
    pub devices: Option<Vec<String>>,
}

impl BridgeToCore {
    /// The `connection` section of the edge's config.
    pub(super) fn config(&self) -> String {
        let root = &self.topic_root;
        let mut section = format!(
            "connection {name}\n\
             address {LOOPBACK}:{port}\n\
             clientid {name}\n\
             cleansession false\n\
             try_private true\n\
             bridge_protocol_version mqttv311\n\
             restart_timeout 1 5\n\
             topic {root}/+/reported out 1\n\
             topic {root}/+/status out 1\n",
            name = self.name,
            port = self.core_port,
        );
        match &self.devices {
            None => section.push_str(&format!(
                "topic {root}/+/desired in 1\ntopic {root}/+/get in 1\n"
            )),
            Some(ids) => {
                for id in ids {
                    section.push_str(&format!(
                        "topic {root}/{id}/desired in 1\ntopic {root}/{id}/get in 1\n"
                    ));
                }
            }
        }
        section
    }
}
