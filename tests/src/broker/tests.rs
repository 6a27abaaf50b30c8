//! Unit tests of the private broker: the config it writes for TLS,
//! passwords and client certificates, and a missing binary's error.

use std::fs;
use std::path::PathBuf;

use super::*;

#[test]
fn a_tls_broker_with_passwords_refuses_anonymous_clients_and_hashes_the_passwords() {
    let broker = PrivateMosquitto::builder()
        .tls()
        .password_file(&[("idem-server", "pw-1"), ("dev-1", "pw-2")])
        .start()
        .unwrap();
    assert!(broker.url().starts_with("mqtts://127.0.0.1:"));
    let config = fs::read_to_string(&broker.config).unwrap();
    for line in [
        "allow_anonymous false",
        "require_certificate false",
        "use_username_as_clientid true",
        &format!("cafile {}", broker.ca_file().unwrap().display()),
    ] {
        assert!(
            config.lines().any(|l| l == line),
            "missing {line:?} in\n{config}"
        );
    }
    let passwords = fs::read_to_string(broker.password_file.as_ref().unwrap()).unwrap();
    assert!(
        passwords.contains("idem-server:$") && !passwords.contains("pw-1"),
        "{passwords}"
    );

    let certs = PrivateMosquitto::builder()
        .require_client_cert()
        .start()
        .unwrap();
    let config = fs::read_to_string(&certs.config).unwrap();
    for line in [
        "require_certificate true",
        "use_identity_as_username true",
        "allow_anonymous false",
    ] {
        assert!(
            config.lines().any(|l| l == line),
            "missing {line:?} in\n{config}"
        );
    }
}

#[test]
fn a_missing_mosquitto_binary_is_an_error_that_says_what_to_install() {
    let empty = tempfile::tempdir().unwrap();
    let err = mosquitto_binary(
        Some(empty.path().as_os_str()),
        &[empty.path().join("mosquitto")],
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "mosquitto binary not found: install it with `apt-get install mosquitto` \
         or run scripts/test, which installs it"
    );
}

#[test]
fn the_config_listens_on_loopback_only_with_big_queues() {
    let dir = tempfile::tempdir().unwrap();
    let broker = PrivateMosquitto {
        child: None,
        settings: MosquittoBuilder::default(),
        tls: None,
        password_file: None,
        acl_file: None,
        dynsec: None,
        binary: PathBuf::from("mosquitto"),
        port: 41234,
        config: dir.path().join("mosquitto.conf"),
        log: dir.path().join("mosquitto.log"),
        stdout: dir.path().join("stdout.log"),
        stderr: dir.path().join("stderr.log"),
        dir,
    };
    broker.write_config().unwrap();
    let config = fs::read_to_string(&broker.config).unwrap();
    for line in [
        "listener 41234 127.0.0.1",
        "allow_anonymous true",
        "persistence false",
        "max_queued_messages 100000",
        "max_inflight_messages 0",
        "set_tcp_nodelay true",
    ] {
        assert!(
            config.lines().any(|l| l == line),
            "missing {line:?} in\n{config}"
        );
    }
}
