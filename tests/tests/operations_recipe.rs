//! docs/OPERATIONS.md §9 "Setting up the broker, step by step", followed
//! word for word: each broker mode's recipe is read from the document at
//! test time and run in a sandbox (`idem_tests::recipe`) against the real
//! Mosquitto and the real `idem-server` binary, with only a free port, the
//! sandbox's paths and the test database put in. Then a device registered
//! through the API with the recipe's admin token connects over TLS with the
//! password it was issued and is reconciled, and every file holding a
//! secret is mode 0600. Also: `idem-server broker files` makes files that
//! existed world-readable private.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::{
    BrokerAddr, Credentials, DeviceBehaviour, Fleet, FleetConfig, SimDevice, SimTls,
};
use idem_protocol::{DeviceId, TopicRoot};
use idem_tests::recipe::{self, mode_of, Phase, RecipeMachine};
use idem_tests::{ApiClient, TestDatabase};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, TlsConfiguration, Transport};
use serde_json::json;

const SERVER_BIN: &str = env!("CARGO_BIN_EXE_idem-server-under-test");
const OPERATIONS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/OPERATIONS.md");
/// The whole recipe, the device and its run.
const TEST_TIMEOUT: Duration = Duration::from_secs(240);

/// Whether the broker accepts a TLS login with these credentials.
async fn accepts(port: u16, tls: &SimTls, client_id: &str, login: Option<(&str, &str)>) -> bool {
    let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
    options.set_keep_alive(Duration::from_secs(5));
    options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
        tls.config(),
    )));
    if let Some((user, password)) = login {
        options.set_credentials(user, password);
    }
    let (client, mut eventloop) = AsyncClient::new(options, 10);
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(_))) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    })
    .await
    .expect("no CONNACK and no error within 10 s");
    let _ = client.disconnect().await;
    answer
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir` (recursively) has mode 0600.
fn assert_private_tree(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            assert_private_tree(&path);
        } else {
            assert_private(&path);
        }
    }
}

fn assert_private(path: &Path) {
    let mode = mode_of(path).unwrap();
    assert_eq!(mode, 0o600, "{} is mode {mode:o}, not 600", path.display());
}

async fn follow_the_recipe(mode: &str) {
    let started = Instant::now();
    let doc = read(Path::new(OPERATIONS));
    let blocks = recipe::blocks(&doc).unwrap();
    let setup = recipe::script(&blocks, mode, Phase::Setup);
    let after_registration = recipe::script(&blocks, mode, Phase::AfterRegistration);
    assert!(!setup.is_empty(), "docs/OPERATIONS.md has no {mode} recipe");
    let db = TestDatabase::create().await.unwrap();
    let mut machine = RecipeMachine::new(
        Path::new(SERVER_BIN),
        db.url(),
        &format!("{setup}{after_registration}"),
    )
    .unwrap();
    machine
        .run(&setup)
        .await
        .unwrap_or_else(|e| panic!("the {mode} recipe: {e:#}"));
    let setup_s = started.elapsed().as_secs_f64();

    // The recipe's admin token, from the header file it wrote for curl.
    let header_file = machine.home().join("idem-admin.header");
    assert_eq!(
        mode_of(&header_file).unwrap(),
        0o600,
        "the token header file"
    );
    let header = read(&header_file);
    let token = header
        .trim_end()
        .strip_prefix("Authorization: Bearer ")
        .unwrap_or_else(|| panic!("not an Authorization header: {header:?}"));
    assert!(token.starts_with("idem_"), "{header:?}");
    let api = ApiClient::new(machine.server().unwrap().addr())
        .unwrap()
        .with_token(Some(token));

    // Register a device; its password comes in the answer.
    let desired = json!({"firmware": "1.2.0"});
    let (status, answer) = api
        .post("/v1/devices", &json!([{"id": "dev-01", "spec": desired}]))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["credentials"][0]["username"], "dev-01", "{answer}");
    let password = answer["credentials"][0]["password"]
        .as_str()
        .unwrap_or_else(|| panic!("no password issued: {answer}"))
        .to_owned();
    if !after_registration.is_empty() {
        machine
            .run(&after_registration)
            .await
            .unwrap_or_else(|e| panic!("the {mode} recipe after registration: {e:#}"));
    }

    // The device connects as the recipe says: mqtts, the CA the broker's
    // certificate chains to, user name = client id = its id.
    let ca = machine.path("/etc/mosquitto/certs/ca.pem");
    let tls = SimTls::from_files(Some(&ca), None).unwrap();
    let id = DeviceId::parse("dev-01").unwrap();
    let device = SimDevice::new(id.clone(), json!({"firmware": "1.0.0"}))
        .with_behaviour(DeviceBehaviour::Accept);
    let mut config = FleetConfig::new(
        BrokerAddr::tls("127.0.0.1", machine.broker_port),
        TopicRoot::new(idem_protocol::DEFAULT_TOPIC_ROOT).unwrap(),
        vec![device],
    );
    config.tls = Some(tls.clone());
    config.credentials = Some(Credentials::new(HashMap::from([(
        id.clone(),
        password.clone(),
    )])));
    let fleet = Fleet::start(config).unwrap();
    if let Err(e) = fleet.wait_connected(1, Duration::from_secs(30)).await {
        panic!(
            "dev-01 did not connect: {e:#}\n{}",
            machine.broker_log_tail()
        );
    }
    // Its report (a drifted spec) and its online status reach the server;
    // a run pushes the desired spec to it over the broker.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, device) = api.get("/v1/devices/dev-01").await.unwrap();
        if device["reported"]["spec"] == json!({"firmware": "1.0.0"}) && device["online"] == true {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server never stored dev-01's report and status: {device}\n--- server log ---\n{}",
            machine.server().unwrap().log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let run = api
        .start_run(&json!({"devices": ["dev-01"]}))
        .await
        .unwrap();
    let run = api
        .wait_run_completed(&run, Duration::from_secs(30))
        .await
        .unwrap();
    let outcomes = api
        .get(&format!(
            "/v1/runs/{}/outcomes",
            run["id"].as_str().unwrap()
        ))
        .await
        .unwrap()
        .1;
    assert_eq!(
        run["summary"], "0 already converged, 1 provisioned, 0 failed",
        "{run}\n{outcomes}"
    );
    assert_eq!(fleet.state(&id).unwrap().spec, desired);

    // Only accounts get in; the dashboards account the recipe made does,
    // but with its own password it takes over no one's session: neither
    // the device's nor the server's (its client id, or its user name, which
    // is its client id with `use_username_as_clientid`).
    let port = machine.broker_port;
    assert!(!accepts(port, &tls, "anonymous", None).await);
    assert!(!accepts(port, &tls, "dev-01", Some(("dev-01", "not-its-password"))).await);
    let dashboards = read(&machine.path("/etc/idem/dashboards.pw"));
    let dashboards = Some(("dashboards", dashboards.trim_end()));
    assert!(
        accepts(port, &tls, "dashboards", dashboards).await,
        "the dashboards account cannot log in\n{}",
        machine.broker_log_tail()
    );
    for session in ["dev-01", "idem-server:idem-1", "idem-server"] {
        // Refused (dynamic security binds the client id) or let in under
        // its own client id (the password file's broker): either way, no
        // takeover.
        accepts(port, &tls, session, dashboards).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let takeovers: Vec<String> = read(&machine.broker_log())
        .lines()
        .filter(|l| l.contains("already connected, closing old connection"))
        .map(str::to_owned)
        .collect();
    assert_eq!(takeovers, Vec::<String>::new(), "sessions were taken over");
    assert_eq!(fleet.stats().connections, 1, "dev-01 had to reconnect");
    assert_eq!(
        api.metric("idem_mqtt_reconnects_total").await.unwrap(),
        0.0,
        "the server had to reconnect"
    );
    fleet.shutdown().await.unwrap();

    // Every file that holds a secret is its owner's only.
    let broker_uid = machine.broker_user.uid();
    match mode {
        "dynsec" => {
            // Rewritten by the plugin when the server created dev-01's
            // account: still 0600, still Mosquitto's.
            let state = machine.path("/var/lib/mosquitto/dynamic-security.json");
            assert!(read(&state).contains("idem-device:dev-01"));
            assert_private(&state);
            assert_eq!(std::fs::metadata(&state).unwrap().uid(), broker_uid);
        }
        _ => {
            assert_private_tree(&machine.path("/etc/mosquitto/idem"));
            let passwords = read(&machine.path("/etc/mosquitto/idem/password_file"));
            let users: Vec<&str> = passwords
                .lines()
                .filter_map(|l| l.split(':').next())
                .collect();
            assert_eq!(
                users,
                ["idem-server", "dashboards", "dev-01"],
                "{passwords}"
            );
        }
    }
    let broker_key = machine.path("/etc/mosquitto/certs/broker.key");
    assert_private(&broker_key);
    assert_eq!(std::fs::metadata(&broker_key).unwrap().uid(), broker_uid);
    assert_private_tree(&machine.path("/etc/idem"));
    assert_private_tree(&machine.path("/var/lib/mosquitto"));
    println!(
        "the {mode} recipe: set up in {setup_s:.1} s, device reconciled, all in {:.1} s \
         (Mosquitto as its own user: {})",
        started.elapsed().as_secs_f64(),
        machine.broker_user.privileged
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dynamic_security_recipe_of_operations_runs_word_for_word_and_its_device_is_reconciled_over_tls(
) {
    tokio::time::timeout(TEST_TIMEOUT, follow_the_recipe("dynsec"))
        .await
        .expect("the recipe took too long");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_file_recipe_of_operations_runs_word_for_word_and_its_device_is_reconciled_over_tls(
) {
    tokio::time::timeout(TEST_TIMEOUT, follow_the_recipe("password-file"))
        .await
        .expect("the recipe took too long");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_files_makes_a_password_file_and_an_acl_file_that_existed_world_readable_private() {
    use std::os::unix::fs::PermissionsExt as _;
    let db = TestDatabase::create().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("broker");
    std::fs::create_dir(&out).unwrap();
    for name in ["password_file", "acl_file"] {
        let path = out.join(name);
        std::fs::write(&path, "stale\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let server_pw = dir.path().join("server.pw");
    std::fs::write(&server_pw, "a-server-password\n").unwrap();
    let mut command = tokio::process::Command::new(SERVER_BIN);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("IDEM_") {
            command.env_remove(key);
        }
    }
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        command
            .env("IDEM_DATABASE_URL", db.url())
            .args(["broker", "files", "--out"])
            .arg(&out)
            .arg("--server-password-file")
            .arg(&server_pw)
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .expect("broker files took more than 60 s")
    .unwrap();
    assert!(
        output.status.success(),
        "broker files failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    for name in ["password_file", "acl_file"] {
        let path = out.join(name);
        assert_eq!(
            mode_of(&path).unwrap(),
            0o600,
            "{name} kept the mode it had before `broker files` rewrote it"
        );
        assert_ne!(read(&path), "stale\n", "{name} was not rewritten");
    }
    assert!(read(&out.join("password_file")).starts_with("idem-server:$7$"));
    let acl = read(&out.join("acl_file"));
    assert!(acl.contains("pattern write idem/v1/%u/reported"), "{acl}");
}
