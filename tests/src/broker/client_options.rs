//! How a test reaches a private broker: its address and URL, its test CA
//! and client certificates (TLS), rumqttc options for a client, and a
//! subscription awaited to its acknowledgement under a deadline.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use rumqttc::{AsyncClient, Event, EventLoop, Packet, QoS};

use super::PrivateMosquitto;
use crate::certs::{CertFiles, TestCa};
use crate::deadline::Deadline;
use crate::support::LOOPBACK;

/// How long the broker may take to acknowledge a test client's subscriptions.
const SUBACK_TIMEOUT: Duration = Duration::from_secs(5);

impl PrivateMosquitto {
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn host(&self) -> &str {
        LOOPBACK
    }

    /// `mqtt://127.0.0.1:PORT`, or `mqtts://…` for a TLS listener.
    pub fn url(&self) -> String {
        let scheme = if self.is_tls() { "mqtts" } else { "mqtt" };
        format!("{scheme}://{LOOPBACK}:{}", self.port)
    }

    /// Whether the listener speaks TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The CA certificate that signed the broker's certificate (TLS only).
    pub fn ca_file(&self) -> Option<&Path> {
        self.tls.as_ref().map(|(ca, _)| ca.ca_file())
    }

    /// The broker's test CA (TLS only), to issue more client certificates.
    pub fn ca(&self) -> Option<&TestCa> {
        self.tls.as_ref().map(|(ca, _)| ca)
    }

    /// A client certificate signed by the broker's CA, with `common_name`
    /// as its identity (the user name when client certificates are
    /// required). Fails on a broker without TLS.
    pub fn client_cert(&self, common_name: &str) -> Result<CertFiles> {
        self.ca()
            .ok_or_else(|| anyhow!("this private broker has no TLS listener: use builder().tls()"))?
            .issue_client(common_name)
    }

    /// rumqttc options for a client of this broker (keep-alive 5 s), over
    /// TLS trusting the broker's CA when the listener is TLS. No
    /// credentials: see [`PrivateMosquitto::mqtt_options_as`].
    pub fn mqtt_options(&self, client_id: impl Into<String>) -> rumqttc::MqttOptions {
        let mut options = rumqttc::MqttOptions::new(client_id, LOOPBACK, self.port);
        options.set_keep_alive(Duration::from_secs(5));
        if let Some((ca, _)) = &self.tls {
            match ca.client_config(None) {
                Ok(config) => {
                    options.set_transport(rumqttc::Transport::tls_with_config(
                        rumqttc::TlsConfiguration::Rustls(config),
                    ));
                }
                // The CA file was just written by us; a failure here shows
                // up as a failed connection naming TLS.
                Err(e) => eprintln!("idem-tests: no TLS client config for the broker: {e:#}"),
            }
        }
        options
    }

    /// Like [`PrivateMosquitto::mqtt_options`], logged in as `username`.
    pub fn mqtt_options_as(
        &self,
        client_id: impl Into<String>,
        username: &str,
        password: &str,
    ) -> rumqttc::MqttOptions {
        let mut options = self.mqtt_options(client_id);
        options.set_credentials(username, password);
        options
    }
}

/// Subscribes `client` to `filters` (QoS 1) and polls `eventloop` until the
/// broker acknowledged every one, within 5 s; the error names `who`, the
/// filters and how many acknowledgements came. What is published after this
/// returns reaches the subscriber.
pub async fn subscribe_acknowledged(
    client: &AsyncClient,
    eventloop: &mut EventLoop,
    filters: &[String],
    who: &str,
) -> Result<()> {
    for filter in filters {
        client
            .subscribe(filter.as_str(), QoS::AtLeastOnce)
            .await
            .with_context(|| format!("queueing the subscription of {who} to {filter}"))?;
    }
    let deadline = Deadline::after(SUBACK_TIMEOUT);
    let mut acknowledged = 0;
    while acknowledged < filters.len() {
        let awaited = format!(
            "the broker acknowledging the subscription of {who} to {filters:?} \
             ({acknowledged} of {} acknowledged)",
            filters.len()
        );
        let event = deadline
            .run(awaited, eventloop.poll())
            .await?
            .with_context(|| format!("the connection of {who}"))?;
        match event {
            Event::Incoming(Packet::SubAck(ack)) => {
                let refused = ack
                    .return_codes
                    .iter()
                    .any(|code| matches!(code, rumqttc::SubscribeReasonCode::Failure));
                if refused {
                    bail!("the broker refused the subscription of {who} to {filters:?}: {ack:?}");
                }
                acknowledged += 1;
            }
            Event::Incoming(_) | Event::Outgoing(_) => {}
        }
    }
    Ok(())
}
