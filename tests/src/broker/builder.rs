//! How a private broker is set up ([`MosquittoBuilder`]): persistence, TLS
//! and client certificates, accounts, ACL, queue limits, dynamic security
//! and a bridge to a core broker, each off by default.

use anyhow::Result;

use super::bridge::BridgeToCore;
use super::PrivateMosquitto;

/// How a private broker is set up; made by [`PrivateMosquitto::builder`].
/// Every option is off by default: a plain, anonymous, non-persistent broker.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct MosquittoBuilder {
    pub(super) persistent: bool,
    pub(super) tls: bool,
    pub(super) require_client_cert: bool,
    /// `(user, password)` accounts of the password file.
    pub(super) accounts: Vec<(String, String)>,
    /// With a password file, clients choose their client ids (no
    /// `use_username_as_clientid`).
    pub(super) client_ids_chosen: bool,
    /// The text of an `acl_file`.
    pub(super) acl: Option<String>,
    /// `max_queued_messages` / `max_inflight_messages`.
    pub(super) queue: QueueLimits,
    /// The dynamic-security plugin with this `(admin, password)` account.
    pub(super) dynsec: Option<(String, String)>,
    /// This broker is an edge bridged to a core broker.
    pub(super) bridge: Option<BridgeToCore>,
}

/// Mosquitto's per-client queue limits.
#[derive(Debug, Clone, Copy)]
pub(super) struct QueueLimits {
    pub(super) max_queued_messages: u32,
    /// 0 = no limit.
    pub(super) max_inflight_messages: u32,
}

impl Default for QueueLimits {
    fn default() -> Self {
        Self {
            max_queued_messages: 100_000,
            max_inflight_messages: 0,
        }
    }
}

impl MosquittoBuilder {
    /// Retained messages and persistent sessions survive `stop()` +
    /// `restart()` (see [`PrivateMosquitto::start_persistent`]).
    pub fn persistent(mut self) -> Self {
        self.persistent = true;
        self
    }

    /// The listener speaks TLS only (`mqtts://`), with a server certificate
    /// for 127.0.0.1 / localhost signed by the broker's own test CA
    /// ([`PrivateMosquitto::ca_file`]).
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Clients must present a certificate signed by the broker's CA
    /// (`require_certificate true`); its common name becomes the user name
    /// (`use_identity_as_username true`) and anonymous clients are refused.
    /// Implies [`MosquittoBuilder::tls`].
    pub fn require_client_cert(mut self) -> Self {
        self.tls = true;
        self.require_client_cert = true;
        self
    }

    /// A password file with these accounts; anonymous clients are refused
    /// (`allow_anonymous false`), and every client's user name is its
    /// client id (`use_username_as_clientid true`: no account can take over
    /// another's session). Can be called again to add accounts.
    pub fn password_file<U: AsRef<str>, P: AsRef<str>>(mut self, accounts: &[(U, P)]) -> Self {
        self.accounts.extend(
            accounts
                .iter()
                .map(|(u, p)| (u.as_ref().to_owned(), p.as_ref().to_owned())),
        );
        self
    }

    /// Mosquitto's per-client queue limits (default: 100,000 queued, no
    /// in-flight limit, as the fleet's configs size them). Small limits make
    /// the broker drop QoS 1 messages for a client that does not keep up.
    /// With [`MosquittoBuilder::password_file`], every client keeps the
    /// client id it asks for (no `use_username_as_clientid`): the setup
    /// OPERATIONS gives several server instances sharing one account, so
    /// that a survivor may connect with a dead instance's client id.
    pub fn client_ids_chosen_by_clients(mut self) -> Self {
        self.client_ids_chosen = true;
        self
    }

    pub fn queue_limits(mut self, max_queued_messages: u32, max_inflight_messages: u32) -> Self {
        self.queue = QueueLimits {
            max_queued_messages,
            max_inflight_messages,
        };
        self
    }

    /// An `acl_file` with this text (e.g. what `idem-server broker files`
    /// writes: `idem_server::broker::accounts::static_acl_file`).
    pub fn acl_file(mut self, text: impl Into<String>) -> Self {
        self.acl = Some(text.into());
        self
    }

    /// Mosquitto's dynamic-security plugin (Debian's
    /// `mosquitto_dynamic_security.so`), initialised with `mosquitto_ctrl
    /// dynsec init` and this admin account; anonymous clients are refused.
    pub fn dynamic_security(mut self, admin: &str, password: &str) -> Self {
        self.dynsec = Some((admin.to_owned(), password.to_owned()));
        self
    }

    /// An edge broker: bridged to the core broker as `bridge` says.
    pub fn bridge_to(mut self, bridge: BridgeToCore) -> Self {
        self.bridge = Some(bridge);
        self
    }

    /// Starts the broker on a free port of 127.0.0.1 and waits until it
    /// accepts TCP connections.
    pub fn start(self) -> Result<PrivateMosquitto> {
        PrivateMosquitto::start_with(self)
    }

    pub(super) fn authenticates(&self) -> bool {
        self.require_client_cert || !self.accounts.is_empty() || self.dynsec.is_some()
    }
}
