//! The simulator's `--broker` address: idem-protocol's broker URL parser,
//! where a bare `host[:port]` means a plain TCP broker too, with errors that
//! name the simulator's credentials file and never echo a password.

use idem_protocol::{parse_mqtt_url_or_bare_host, BrokerAddr};

use crate::error::SimError;

/// Parses `mqtt://host[:port]`, `tcp://host[:port]`, a bare `host[:port]`
/// (plain, default port 1883) or `mqtts://host[:port]` / `ssl://…` (TLS,
/// default port 8883); IPv6 hosts in brackets: `mqtt://[::1]:1883`.
pub fn parse_broker_url(url: &str) -> Result<BrokerAddr, SimError> {
    parse_mqtt_url_or_bare_host(url).map_err(|reason| SimError::InvalidBrokerUrl {
        url: redacted(url),
        reason,
    })
}

/// `url` with everything before its last `@` after the scheme replaced by
/// `***`: a password typed into the URL is never echoed.
fn redacted(url: &str) -> String {
    match url.rsplit_once('@') {
        Some((before, after)) => {
            let scheme = before.split_once("://").map_or("", |(scheme, _)| scheme);
            format!("{scheme}://***@{after}")
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_urls_parse_with_and_without_scheme_and_port() {
        let cases = [
            ("mqtt://127.0.0.1:1883", "127.0.0.1", 1883),
            ("tcp://broker.local:2883/", "broker.local", 2883),
            ("mqtt://broker", "broker", 1883),
            ("localhost:1999", "localhost", 1999),
            ("mqtt://[::1]:1884", "::1", 1884),
            ("[::1]", "::1", 1883),
        ];
        for (url, host, port) in cases {
            assert_eq!(
                parse_broker_url(url).unwrap(),
                BrokerAddr::new(host, port),
                "{url}"
            );
        }
    }

    #[test]
    fn unsupported_or_malformed_broker_urls_are_refused() {
        for url in [
            "ws://x:8883",
            "http://x",
            "mqtt://",
            "mqtt://x:0",
            "mqtt://x:99999",
            "mqtt://x:1883/path",
            "mqtt://u:p@x",
            "mqtt://[::1",
        ] {
            assert!(parse_broker_url(url).is_err(), "{url} should be refused");
        }
    }

    #[test]
    fn mqtts_urls_are_tls_brokers_on_port_8883_by_default() {
        assert_eq!(
            parse_broker_url("mqtts://broker").unwrap(),
            BrokerAddr::tls("broker", 8883)
        );
        assert_eq!(
            parse_broker_url("ssl://127.0.0.1:9999").unwrap(),
            BrokerAddr::tls("127.0.0.1", 9999)
        );
    }

    #[test]
    fn credentials_in_the_url_are_refused_without_echoing_the_password() {
        let err = parse_broker_url("mqtts://dev:pw@x")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("credentials file") && !err.contains("pw@"),
            "{err}"
        );
        assert!(err.contains("\"mqtts://***@x\""), "{err}");
        let bare = parse_broker_url("dev:pw@x").unwrap_err().to_string();
        assert!(!bare.contains("pw@"), "{bare}");
    }

    #[test]
    fn a_refusal_names_the_url_and_gives_an_example() {
        let err = parse_broker_url("mqtt://x:0").unwrap_err().to_string();
        assert_eq!(
            err,
            "broker URL \"mqtt://x:0\" has a port that is not a number from 1 to 65535 \
             (expected e.g. mqtt://127.0.0.1:1883)"
        );
    }
}
