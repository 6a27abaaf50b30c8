//! TLS and credentials end to end, against real Mosquitto brokers with TLS
//! listeners, password files and required client certificates (certificates
//! made at test time), the real server (in-process and as its own process,
//! whose whole log is read), and simulated devices over TLS.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::{run_demo, Credentials, DemoSettings, FleetPlan, SimTls};
use idem_protocol::{DeviceId, TopicRoot};
use idem_tests::{PrivateMosquitto, ProcessServer, Scenario, ServerSettings, TestCa, TestDatabase};
use rumqttc::{AsyncClient, ConnectionError, Event, MqttOptions, Packet};
use serde_json::json;

const SERVER_BIN: &str = env!("CARGO_BIN_EXE_idem-server-under-test");
const SERVER_USER: &str = "idem-server";

/// A password no log line could contain by chance.
fn secret(tag: &str) -> String {
    format!("{tag}-{}", uuid::Uuid::new_v4().simple())
}

fn unique_root() -> TopicRoot {
    TopicRoot::new(format!(
        "idem-tls/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    ))
    .unwrap()
}

/// One password per device, keyed by id.
fn device_passwords(plan: &idem_device_sim::Plan) -> HashMap<DeviceId, String> {
    plan.devices
        .iter()
        .map(|d| (d.id.clone(), secret(d.id.as_str())))
        .collect()
}

/// A private TLS-only Mosquitto whose password file holds every device's
/// account and the server's.
fn tls_broker_with_accounts(
    passwords: &HashMap<DeviceId, String>,
    server_password: &str,
) -> PrivateMosquitto {
    let mut accounts: Vec<(String, String)> = passwords
        .iter()
        .map(|(id, pw)| (id.to_string(), pw.clone()))
        .collect();
    accounts.push((SERVER_USER.to_owned(), server_password.to_owned()));
    PrivateMosquitto::builder()
        .tls()
        .password_file(&accounts)
        .start()
        .unwrap()
}

/// Connects once with `options`: the broker's CONNACK, or why not.
async fn try_connect(options: MqttOptions) -> Result<(), ConnectionError> {
    let (_client, mut eventloop) = AsyncClient::new(options, 10);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let event = tokio::time::timeout_at(deadline.into(), eventloop.poll())
            .await
            .expect("no CONNACK or error within 5 s")?;
        if let Event::Incoming(Packet::ConnAck(_)) = event {
            return Ok(());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_connects_over_mqtts_with_a_password_and_a_run_over_tls_devices_completes() {
    let server_password = secret("server");
    let plan = FleetPlan::new("tls-pw-", 20)
        .drifted(2)
        .seed(5)
        .build()
        .unwrap();
    let passwords = device_passwords(&plan);
    let broker = tls_broker_with_accounts(&passwords, &server_password);
    assert!(broker.url().starts_with("mqtts://127.0.0.1:"));

    // Anonymous clients, wrong passwords and plain TCP are all refused.
    let anonymous = try_connect(broker.mqtt_options("anonymous-probe")).await;
    assert!(
        matches!(anonymous, Err(ConnectionError::ConnectionRefused(_))),
        "{anonymous:?}"
    );
    let wrong = try_connect(broker.mqtt_options_as("wrong-probe", SERVER_USER, "nope")).await;
    assert!(
        matches!(wrong, Err(ConnectionError::ConnectionRefused(_))),
        "{wrong:?}"
    );
    let mut plain = MqttOptions::new("plain-probe", broker.host(), broker.port());
    plain.set_credentials(SERVER_USER, server_password.as_str());
    assert!(try_connect(plain).await.is_err());

    let settings = ServerSettings {
        mqtt_credentials: Some((SERVER_USER.to_owned(), server_password.clone())),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start_on(broker, settings).await.unwrap();
    scenario
        .register(&plan.devices, &plan.desired_spec)
        .await
        .unwrap();
    let mut config = scenario.fleet_config(plan.devices.clone()).unwrap();
    config.credentials = Some(Credentials::new(passwords));
    let fleet = scenario.start_fleet_with(config).await.unwrap();
    scenario
        .wait_reports_stored(20, Duration::from_secs(30))
        .await
        .unwrap();
    let (_, run) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        run["summary"], "18 already converged, 2 provisioned, 0 failed",
        "{run}"
    );
    let log = std::fs::read_to_string(scenario.broker.log_path()).unwrap();
    assert!(
        log.contains(&format!("u'{SERVER_USER}'")),
        "the broker saw no login as {SERVER_USER}:\n{}",
        scenario.broker.log_tail()
    );
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_connects_with_a_client_certificate_when_the_broker_requires_one() {
    let broker = PrivateMosquitto::builder()
        .require_client_cert()
        .start()
        .unwrap();
    let server_cert = broker.client_cert(SERVER_USER).unwrap();
    let fleet_cert = broker.client_cert("tls-fleet").unwrap();
    // Without a certificate the broker lets nobody in.
    assert!(try_connect(broker.mqtt_options("no-cert-probe"))
        .await
        .is_err());

    let settings = ServerSettings {
        mqtt_client_cert: Some(server_cert),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start_on(broker, settings).await.unwrap();
    let plan = FleetPlan::new("tls-cert-", 3).seed(2).build().unwrap();
    scenario
        .register(&plan.devices, &plan.desired_spec)
        .await
        .unwrap();
    let mut config = scenario.fleet_config(plan.devices.clone()).unwrap();
    config.tls = Some(
        SimTls::from_files(
            scenario.broker.ca_file(),
            Some((&fleet_cert.cert, &fleet_cert.key)),
        )
        .unwrap(),
    );
    let fleet = scenario.start_fleet_with(config).await.unwrap();
    scenario
        .wait_reports_stored(3, Duration::from_secs(30))
        .await
        .unwrap();
    let (_, run) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        run["summary"],
        "3 already converged, 0 provisioned, 0 failed"
    );
    // use_identity_as_username: the certificate's common name logged in.
    let log = std::fs::read_to_string(scenario.broker.log_path()).unwrap();
    assert!(
        log.contains(&format!("u'{SERVER_USER}'")),
        "{}",
        scenario.broker.log_tail()
    );
    fleet.shutdown().await.unwrap();
}

/// Launches the server binary against `broker`, waits until its log says
/// it cannot connect to the broker, checks it is not ready, and returns
/// its whole log.
async fn log_of_a_server_that_cannot_connect(
    db: &TestDatabase,
    broker: &PrivateMosquitto,
    env: &[(&str, &str)],
) -> String {
    let mut server = ProcessServer::launch(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &unique_root(),
        "tls-refused",
        env,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !server
        .log_text()
        .contains("cannot connect to the MQTT broker")
    {
        assert!(
            Instant::now() < deadline,
            "no connect error logged:\n{}",
            server.log_tail()
        );
        assert!(server.is_running(), "exited:\n{}", server.log_tail());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The HTTP API is up (the log line comes after start-up) but not ready.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (status, body) = loop {
        match server.readyz().await {
            Ok(answer) => break answer,
            Err(e) => {
                assert!(Instant::now() < deadline, "{e:#}\n{}", server.log_tail());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["mqtt"], false, "{body}");
    server.kill().unwrap();
    server.log_text()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_broker_login_leaves_the_server_not_ready_with_a_clear_error_and_no_password_in_the_log(
) {
    let right = secret("right");
    let wrong = secret("wrong");
    let broker = PrivateMosquitto::builder()
        .tls()
        .password_file(&[(SERVER_USER, right.as_str())])
        .start()
        .unwrap();
    let db = TestDatabase::create().await.unwrap();
    let ca = broker.ca_file().unwrap().to_str().unwrap().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("mqtt-password");
    std::fs::write(&password_file, format!("{wrong}\n")).unwrap();

    // The password from the environment, then from a file.
    for password_env in [
        ("IDEM_MQTT_PASSWORD", wrong.clone()),
        (
            "IDEM_MQTT_PASSWORD_FILE",
            password_file.to_str().unwrap().to_owned(),
        ),
    ] {
        let log = log_of_a_server_that_cannot_connect(
            &db,
            &broker,
            &[
                ("IDEM_MQTT_CA_FILE", &ca),
                ("IDEM_MQTT_USERNAME", SERVER_USER),
                (password_env.0, &password_env.1),
                ("RUST_LOG", "debug"),
            ],
        )
        .await;
        assert!(
            log.contains("refused the server's credentials"),
            "no hint in:\n{log}"
        );
        assert!(!log.contains(&wrong), "the password is in the log:\n{log}");
        assert!(!log.contains(&right));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_client_certificate_or_an_untrusted_broker_leaves_the_server_not_ready_with_a_tls_hint(
) {
    let broker = PrivateMosquitto::builder()
        .require_client_cert()
        .start()
        .unwrap();
    let db = TestDatabase::create().await.unwrap();
    let ca = broker.ca_file().unwrap().to_str().unwrap().to_owned();

    // No client certificate.
    let log =
        log_of_a_server_that_cannot_connect(&db, &broker, &[("IDEM_MQTT_CA_FILE", &ca)]).await;
    assert!(log.contains("IDEM_MQTT_CLIENT_CERT"), "no hint in:\n{log}");

    // A CA that did not sign the broker's certificate.
    let other = tempfile::tempdir().unwrap();
    let other_ca = TestCa::create(other.path(), "some other CA").unwrap();
    let cert = broker.client_cert(SERVER_USER).unwrap();
    let log = log_of_a_server_that_cannot_connect(
        &db,
        &broker,
        &[
            ("IDEM_MQTT_CA_FILE", other_ca.ca_file().to_str().unwrap()),
            ("IDEM_MQTT_CLIENT_CERT", cert.cert.to_str().unwrap()),
            ("IDEM_MQTT_CLIENT_KEY", cert.key.to_str().unwrap()),
        ],
    )
    .await;
    assert!(
        log.contains("UnknownIssuer") || log.contains("invalid peer certificate"),
        "{log}"
    );
    assert!(
        log.contains("IDEM_MQTT_CA_FILE holds the CA"),
        "no hint in:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_over_https_answers_healthz_and_plain_http_gets_no_answer() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::create(dir.path(), "idem API test CA").unwrap();
    let identity = ca.issue_server("api").unwrap();
    let settings = ServerSettings {
        https: Some((identity, ca.ca_file().to_path_buf())),
        ..ServerSettings::default()
    };
    // TestServer::start waited for /readyz over HTTPS already.
    let scenario = Scenario::start(settings).await.unwrap();
    let (status, body) = scenario.server.get("/healthz").await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(scenario.server.url("/healthz").starts_with("https://"));
    let (status, _) = scenario
        .server
        .post("/v1/devices", &json!([{"id": "https-1"}]))
        .await
        .unwrap();
    assert_eq!(status, 200);

    // Plain HTTP to the HTTPS port: the handshake fails, nothing is served.
    let plain = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let answer = plain
        .get(format!("http://{}/healthz", scenario.server.addr))
        .send()
        .await;
    assert!(answer.is_err(), "{answer:?}");
    // A client that does not trust the CA refuses the server.
    let untrusting = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .tls_built_in_root_certs(false)
        .build()
        .unwrap();
    let answer = untrusting
        .get(format!("https://{}/healthz", scenario.server.addr))
        .send()
        .await;
    assert!(answer.is_err(), "{answer:?}");
    // The server still serves trusting clients afterwards.
    assert_eq!(scenario.server.get("/healthz").await.unwrap().0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_over_tls_with_100_devices_and_their_own_passwords_reports_exact_counts() {
    let server_password = secret("server");
    let plan = FleetPlan::new("tls-demo-", 100)
        .drifted(3)
        .rejecting(1)
        .seed(7)
        .build()
        .unwrap();
    let passwords = device_passwords(&plan);
    let broker = tls_broker_with_accounts(&passwords, &server_password);
    let settings = ServerSettings {
        mqtt_credentials: Some((SERVER_USER.to_owned(), server_password)),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start_on(broker, settings).await.unwrap();
    let fleet = scenario.fleet_config(plan.devices.clone()).unwrap();
    let mut demo = DemoSettings::new(
        scenario.server.url(""),
        plan,
        fleet.broker.clone(),
        scenario.server.topic_root.clone(),
    );
    demo.fleet.tls = fleet.tls;
    demo.fleet.credentials = Some(Credentials::new(passwords));
    demo.timeout = Duration::from_secs(60);
    demo.register_chunk = 50;
    demo.auth.token = scenario
        .server
        .token()
        .map(idem_device_sim::SecretString::new);
    let started = Instant::now();
    let run = run_demo(demo, &()).await.unwrap();
    println!(
        "demo over TLS, 100 devices with passwords: {:?} total; connect {:.2} s, run {:.3} s",
        started.elapsed(),
        run.report.timings.connect_s,
        run.report.timings.run_s
    );
    assert_eq!(
        run.report.summary, "96 already converged, 3 provisioned, 1 failed",
        "{:#?}",
        run.report
    );
    assert!(run.report.passed(), "{:#?}", run.report.check.mismatches);
    run.fleet.shutdown().await.unwrap();
}

/// Asserts that none of `secrets` occurs in `log`.
fn assert_no_secret(log: &str, secrets: &[&str], what: &str) {
    for secret in secrets {
        assert!(
            !log.contains(secret),
            "{what}: a secret appears in the server log:\n{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_appears_in_the_server_log_after_start_up_failures_or_a_run() {
    let db_password = secret("db");
    let mqtt_password = secret("mqtt");
    let url_password = secret("inurl");
    let secrets = [
        db_password.as_str(),
        mqtt_password.as_str(),
        url_password.as_str(),
    ];
    let root = unique_root();
    let verbose = "trace,hyper=debug,h2=info";

    // 1. PostgreSQL is not there: the start-up error names the URL without
    //    its password.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = nobody.local_addr().unwrap().port();
    drop(nobody);
    let dead_db = format!("postgres://idem:{db_password}@127.0.0.1:{dead_port}/idem");
    let mut server = ProcessServer::launch(
        Path::new(SERVER_BIN),
        &dead_db,
        "mqtt://127.0.0.1:1",
        &root,
        "no-secrets",
        &[
            ("IDEM_MQTT_USERNAME", SERVER_USER),
            ("IDEM_MQTT_PASSWORD", &mqtt_password),
            ("RUST_LOG", verbose),
        ],
    )
    .unwrap();
    let status = server.wait_exit(Duration::from_secs(30)).await.unwrap();
    assert!(status.is_some_and(|s| !s.success()), "{status:?}");
    let log = server.log_text();
    assert!(
        log.contains(&format!(
            "cannot reach PostgreSQL at postgres://idem:***@127.0.0.1:{dead_port}/idem"
        )),
        "{log}"
    );
    assert_no_secret(&log, &secrets, "database unreachable");

    // 2. Credentials typed into the broker URL are refused, not echoed.
    let mut server = ProcessServer::launch(
        Path::new(SERVER_BIN),
        &dead_db,
        &format!("mqtt://idem:{url_password}@127.0.0.1:1883"),
        &root,
        "no-secrets",
        &[("RUST_LOG", verbose)],
    )
    .unwrap();
    let status = server.wait_exit(Duration::from_secs(30)).await.unwrap();
    assert!(status.is_some_and(|s| !s.success()), "{status:?}");
    let log = server.log_text();
    assert!(log.contains("--mqtt-username"), "{log}");
    assert_no_secret(&log, &secrets, "credentials in the broker URL");

    // 3. A run over TLS with every secret in use, logging everything.
    let plan = FleetPlan::new("tls-quiet-", 5)
        .drifted(1)
        .seed(3)
        .build()
        .unwrap();
    let passwords = device_passwords(&plan);
    let broker = tls_broker_with_accounts(&passwords, &mqtt_password);
    let db = TestDatabase::create().await.unwrap();
    // The shared PostgreSQL trusts local connections, so a password in the
    // URL is accepted (and ignored) there: it must still never be printed.
    let db_url = db.url().replacen(
        "postgres://postgres@",
        &format!("postgres://postgres:{db_password}@"),
        1,
    );
    assert_ne!(db_url, db.url(), "unexpected database URL {}", db.url());
    let ca = broker.ca_file().unwrap().to_str().unwrap().to_owned();
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        &db_url,
        &broker.url(),
        &root,
        "no-secrets",
        &[
            ("IDEM_MQTT_CA_FILE", &ca),
            ("IDEM_MQTT_USERNAME", SERVER_USER),
            ("IDEM_MQTT_PASSWORD", &mqtt_password),
            ("RUST_LOG", verbose),
        ],
    )
    .await
    .unwrap();
    let body: Vec<_> = plan
        .devices
        .iter()
        .map(|d| json!({"id": d.id, "spec": plan.desired_spec}))
        .collect();
    let (status, answer) = server.post("/v1/devices", &json!(body)).await.unwrap();
    assert_eq!(status, 200, "{answer}");
    let mut config = idem_device_sim::FleetConfig::new(
        idem_device_sim::BrokerAddr::tls(broker.host(), broker.port()),
        root.clone(),
        plan.devices.clone(),
    );
    config.tls = Some(SimTls::from_files(broker.ca_file(), None).unwrap());
    config.credentials = Some(Credentials::new(passwords.clone()));
    let fleet = idem_device_sim::Fleet::start(config).unwrap();
    fleet
        .wait_connected(5, Duration::from_secs(30))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while server
        .api()
        .metric("idem_reports_total{result=\"applied\"}")
        .await
        .unwrap()
        < 5.0
    {
        assert!(Instant::now() < deadline, "{}", server.log_tail());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let run_id = server.start_run(&json!({"all": true})).await.unwrap();
    let run = server
        .wait_run_completed(&run_id, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(
        run["summary"],
        "4 already converged, 1 provisioned, 0 failed"
    );
    // Operator tokens are secrets too: the admin token every call above
    // sent, and one created (and shown once) through the API.
    let (status, created) = server
        .post("/v1/tokens", &json!({"name": "ci", "role": "operator"}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{created}");
    let ci_token = created["token"].as_str().unwrap().to_owned();
    let (status, _) = server
        .api()
        .with_token(Some(&ci_token))
        .get("/v1/fleet")
        .await
        .unwrap();
    assert_eq!(status, 200);
    let admin_token = server.api().token().unwrap().to_owned();
    fleet.shutdown().await.unwrap();
    server.stop().unwrap();
    let log = server.log_text();
    assert!(log.contains("connected to MQTT broker"), "{log}");
    let device_secrets: Vec<&str> = passwords.values().map(String::as_str).collect();
    assert_no_secret(&log, &secrets, "a run over TLS");
    assert_no_secret(&log, &device_secrets, "a run over TLS");
    assert_no_secret(&log, &[&admin_token, &ci_token], "operator tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_reaches_postgresql_over_verified_tls_with_a_password_it_never_prints() {
    let db_password = secret("pg");
    let pg = tokio::task::spawn_blocking({
        let pw = db_password.clone();
        move || {
            idem_tests::PrivatePostgres::builder()
                .tls()
                .password(&pw)
                .start()
        }
    })
    .await
    .unwrap()
    .unwrap();
    let ca = pg.ca_file().unwrap().to_str().unwrap().to_owned();
    assert!(pg.url().contains(&db_password));

    // The cluster refuses plain TCP, so being ready proves TLS.
    let plain = sqlx::PgPool::connect(&format!("{}?sslmode=disable", pg.url())).await;
    let refused = plain.unwrap_err().to_string();
    assert!(refused.contains("pg_hba.conf"), "{refused}");

    let broker = PrivateMosquitto::start().unwrap();
    let root = unique_root();
    let url = format!("{}?sslmode=verify-full&sslrootcert={ca}", pg.url());
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        &url,
        &broker.url(),
        &root,
        "pg-tls",
        &[("RUST_LOG", "debug")],
    )
    .await
    .unwrap();
    let (status, body) = server.readyz().await.unwrap();
    assert_eq!(status, 200, "{body}");
    // Every connection of the server's pool is encrypted.
    let check = sqlx::PgPool::connect(&url).await.unwrap();
    let (all, encrypted): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a \
         JOIN pg_stat_ssl s USING (pid) WHERE a.backend_type = 'client backend' \
         AND a.pid <> pg_backend_pid()",
    )
    .fetch_one(&check)
    .await
    .unwrap();
    assert!(
        all >= 1 && encrypted == all,
        "{encrypted} of {all} encrypted"
    );
    check.close().await;
    server.stop().unwrap();
    let log = server.log_text();
    assert!(log.contains("sslmode=verify-full"), "{log}");
    assert_no_secret(&log, &[&db_password], "PostgreSQL over TLS");

    // A CA that did not sign the cluster's certificate: refused, clearly.
    let other = tempfile::tempdir().unwrap();
    let other_ca = TestCa::create(other.path(), "some other CA").unwrap();
    let untrusted = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        pg.url(),
        other_ca.ca_file().display()
    );
    let mut server = ProcessServer::launch(
        Path::new(SERVER_BIN),
        &untrusted,
        &broker.url(),
        &root,
        "pg-tls",
        &[],
    )
    .unwrap();
    let status = server.wait_exit(Duration::from_secs(30)).await.unwrap();
    assert!(status.is_some_and(|s| !s.success()), "{status:?}");
    let log = server.log_text();
    assert!(log.contains("cannot reach PostgreSQL"), "{log}");
    assert!(log.to_lowercase().contains("certificate"), "{log}");
    assert_no_secret(&log, &[&db_password], "untrusted PostgreSQL certificate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_against_a_postgresql_without_tls_fails_clearly_without_the_password() {
    let db_password = secret("pg");
    let pg = tokio::task::spawn_blocking({
        let pw = db_password.clone();
        move || idem_tests::PrivatePostgres::builder().password(&pw).start()
    })
    .await
    .unwrap()
    .unwrap();
    let mut server = ProcessServer::launch(
        Path::new(SERVER_BIN),
        &format!("{}?sslmode=require", pg.url()),
        "mqtt://127.0.0.1:1",
        &unique_root(),
        "pg-no-tls",
        &[("RUST_LOG", "trace")],
    )
    .unwrap();
    let status = server.wait_exit(Duration::from_secs(30)).await.unwrap();
    assert!(status.is_some_and(|s| !s.success()), "{status:?}");
    let log = server.log_text();
    assert!(
        log.contains("cannot reach PostgreSQL at postgres://postgres:***@127.0.0.1"),
        "{log}"
    );
    assert!(log.contains("TLS"), "no word of TLS in:\n{log}");
    assert_no_secret(&log, &[&db_password], "sslmode=require without TLS");
}
