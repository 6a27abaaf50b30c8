//! Where an MQTT broker listens, and the one parser of broker URLs that the
//! server (`--mqtt-url`) and the simulator (`--broker`) share:
//! `mqtt://host[:port]` (also `tcp://`) for plain TCP, `mqtts://host[:port]`
//! (also `ssl://`) for TLS, IPv6 hosts in brackets.
//!
//! Pure: parsing and display only; nothing here resolves or connects.
//! Errors never contain the URL (it may carry a password): callers show it
//! redacted, with their own hint where the credentials belong instead.

use std::fmt;

/// Default port of `mqtt://` (and of a bare `host` without a port).
pub const DEFAULT_MQTT_PORT: u16 = 1883;
/// Default port of `mqtts://` (MQTT over TLS).
pub const DEFAULT_MQTTS_PORT: u16 = 8883;

/// Where the broker listens: plain TCP (`mqtt://`) or TLS (`mqtts://`).
/// `Display` writes it back as a URL that parses to the same address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddr {
    pub host: String,
    pub port: u16,
    /// The connection is TLS.
    pub tls: bool,
}

impl BrokerAddr {
    /// A plain TCP broker.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
            tls: false,
        }
    }

    /// A TLS broker.
    pub fn tls(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
            tls: true,
        }
    }
}

impl fmt::Display for BrokerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "mqtts" } else { "mqtt" };
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

/// Why a broker URL was refused. Each message is a predicate about the URL,
/// written to follow it (`--mqtt-url "…" has no host`), and says what to
/// write instead, except [`MqttUrlError::Credentials`]: where credentials
/// belong depends on the program, which adds that itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MqttUrlError {
    /// A scheme other than the four MQTT ones (or, where one is required,
    /// none at all).
    #[error("has an unknown scheme: use mqtt:// (plain) or mqtts:// (TLS)")]
    Scheme,
    /// `ws://` or `wss://`.
    #[error(
        "is a websocket URL, which is not supported: use mqtt:// (plain TCP) or mqtts:// (TLS)"
    )]
    Websockets,
    /// A user name (and maybe a password) before an `@`.
    #[error("carries credentials")]
    Credentials,
    /// Anything after the host and port: a path, a query, a fragment.
    #[error("has a path or query: write only mqtt[s]://host[:port]")]
    Path,
    /// An empty host, or a bracket outside an IPv6 host.
    #[error("has no host")]
    Host,
    /// A `[` with no `]`.
    #[error("has an unclosed '[' in its IPv6 host: write mqtt[s]://[address]:port")]
    UnclosedIpv6Host,
    /// Something other than `:port` after an IPv6 host's `]`.
    #[error("has text after its IPv6 host: write mqtt[s]://[address]:port")]
    TextAfterIpv6Host,
    /// A port that is empty, not a number, 0 or above 65535.
    #[error("has a port that is not a number from 1 to 65535")]
    Port,
}

/// Parses a broker URL, which must have a scheme: `mqtt://host[:port]`
/// (also `tcp://`), `mqtts://host[:port]` (also `ssl://`); IPv6 hosts in
/// brackets (`mqtt://[::1]:1883`); one trailing `/` is allowed. Ports
/// default to [`DEFAULT_MQTT_PORT`] and [`DEFAULT_MQTTS_PORT`].
pub fn parse_mqtt_url(url: &str) -> Result<BrokerAddr, MqttUrlError> {
    parse(url, WithoutScheme::Refused)
}

/// Like [`parse_mqtt_url`], and a bare `host[:port]` (no scheme) is a plain
/// TCP broker, default port [`DEFAULT_MQTT_PORT`].
pub fn parse_mqtt_url_or_bare_host(text: &str) -> Result<BrokerAddr, MqttUrlError> {
    parse(text, WithoutScheme::Plain)
}

/// What text without `scheme://` means.
#[derive(Clone, Copy)]
enum WithoutScheme {
    Refused,
    Plain,
}

fn parse(url: &str, without_scheme: WithoutScheme) -> Result<BrokerAddr, MqttUrlError> {
    let (rest, tls) = match (url.split_once("://"), without_scheme) {
        (Some(("mqtt" | "tcp", rest)), _) => (rest, false),
        (Some(("mqtts" | "ssl", rest)), _) => (rest, true),
        (Some(("ws" | "wss", _)), _) => return Err(MqttUrlError::Websockets),
        (Some(_), _) | (None, WithoutScheme::Refused) => return Err(MqttUrlError::Scheme),
        (None, WithoutScheme::Plain) => (url, false),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('@') {
        return Err(MqttUrlError::Credentials);
    }
    if rest.contains(['/', '?', '#']) {
        return Err(MqttUrlError::Path);
    }
    let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or(MqttUrlError::UnclosedIpv6Host)?;
        match after.strip_prefix(':') {
            Some(port) => (host, Some(port)),
            None if after.is_empty() => (host, None),
            None => return Err(MqttUrlError::TextAfterIpv6Host),
        }
    } else {
        match rest.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (rest, None),
        }
    };
    if host.is_empty() || host.contains(['[', ']']) {
        return Err(MqttUrlError::Host);
    }
    let port = match port {
        None if tls => DEFAULT_MQTTS_PORT,
        None => DEFAULT_MQTT_PORT,
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|port| *port != 0)
            .ok_or(MqttUrlError::Port)?,
    };
    Ok(BrokerAddr {
        host: host.to_owned(),
        port,
        tls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(host: &str, port: u16) -> BrokerAddr {
        BrokerAddr::new(host, port)
    }

    fn tls(host: &str, port: u16) -> BrokerAddr {
        BrokerAddr::tls(host, port)
    }

    #[test]
    fn mqtt_urls_default_to_port_1883_and_mqtts_to_8883() {
        let cases = [
            ("mqtt://broker.local", plain("broker.local", 1883)),
            ("mqtt://127.0.0.1:1883", plain("127.0.0.1", 1883)),
            ("tcp://h:2000/", plain("h", 2000)),
            ("tcp://broker.local:2883/", plain("broker.local", 2883)),
            ("mqtts://broker.local", tls("broker.local", 8883)),
            ("mqtts://10.0.0.1:9883", tls("10.0.0.1", 9883)),
            ("ssl://127.0.0.1:9999", tls("127.0.0.1", 9999)),
            ("ssl://[::1]:8884", tls("::1", 8884)),
            ("mqtt://[::1]", plain("::1", 1883)),
            ("mqtt://[::1]:1884", plain("::1", 1884)),
        ];
        for (url, expected) in cases {
            assert_eq!(parse_mqtt_url(url), Ok(expected.clone()), "{url}");
            assert_eq!(parse_mqtt_url_or_bare_host(url), Ok(expected), "{url}");
        }
    }

    #[test]
    fn a_bare_host_is_a_plain_broker_only_where_a_scheme_may_be_left_out() {
        let cases = [
            ("localhost:1999", plain("localhost", 1999)),
            ("broker", plain("broker", 1883)),
            ("[::1]", plain("::1", 1883)),
            ("[::1]:1884", plain("::1", 1884)),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_mqtt_url_or_bare_host(text), Ok(expected), "{text}");
            assert_eq!(parse_mqtt_url(text), Err(MqttUrlError::Scheme), "{text}");
        }
    }

    #[test]
    fn malformed_urls_are_refused_with_the_reason_by_either_parser() {
        let refused = [
            ("mqtt://h:notaport", MqttUrlError::Port),
            ("mqtt://h:0", MqttUrlError::Port),
            ("mqtt://x:99999", MqttUrlError::Port),
            ("mqtt://h:", MqttUrlError::Port),
            ("http://h", MqttUrlError::Scheme),
            ("ws://x:8883", MqttUrlError::Websockets),
            ("wss://x", MqttUrlError::Websockets),
            ("mqtt://", MqttUrlError::Host),
            ("mqtt://:1883", MqttUrlError::Host),
            ("mqtt://a]b", MqttUrlError::Host),
            ("mqtt://h/x", MqttUrlError::Path),
            ("mqtt://x:1883/path", MqttUrlError::Path),
            ("mqtt://h?x=1", MqttUrlError::Path),
            ("mqtt://h#x", MqttUrlError::Path),
            ("mqtt://user@h", MqttUrlError::Credentials),
            ("mqtt://u:p@x", MqttUrlError::Credentials),
            ("mqtts://user:pw@h:8883", MqttUrlError::Credentials),
            ("mqtt://[::1", MqttUrlError::UnclosedIpv6Host),
            ("mqtt://[::1]1883", MqttUrlError::TextAfterIpv6Host),
            ("mqtt://[]:1883", MqttUrlError::Host),
        ];
        for (url, reason) in refused {
            assert_eq!(parse_mqtt_url(url), Err(reason), "{url}");
            assert_eq!(parse_mqtt_url_or_bare_host(url), Err(reason), "{url}");
        }
        assert_eq!(parse_mqtt_url("broker:1883"), Err(MqttUrlError::Scheme));
        assert_eq!(
            parse_mqtt_url_or_bare_host("user@broker"),
            Err(MqttUrlError::Credentials)
        );
    }

    #[test]
    fn every_refusal_but_credentials_says_what_to_write_instead() {
        for reason in [
            MqttUrlError::Scheme,
            MqttUrlError::Websockets,
            MqttUrlError::Path,
            MqttUrlError::UnclosedIpv6Host,
            MqttUrlError::TextAfterIpv6Host,
        ] {
            let message = reason.to_string();
            assert!(
                message.contains("mqtt://") || message.contains("mqtt[s]://"),
                "{message}"
            );
        }
        assert_eq!(MqttUrlError::Credentials.to_string(), "carries credentials");
    }

    #[test]
    fn broker_addresses_display_as_urls_that_parse_back() {
        let cases = [
            (plain("127.0.0.1", 1883), "mqtt://127.0.0.1:1883"),
            (plain("::1", 1), "mqtt://[::1]:1"),
            (tls("127.0.0.1", 8884), "mqtts://127.0.0.1:8884"),
            (tls("::1", 8883), "mqtts://[::1]:8883"),
        ];
        for (addr, url) in cases {
            assert_eq!(addr.to_string(), url);
            assert_eq!(parse_mqtt_url(url), Ok(addr), "{url}");
        }
    }
}
