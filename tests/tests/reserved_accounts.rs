//! End to end: an operator token can never turn a device registration into
//! someone else's broker account. Against a real Mosquitto with dynamic
//! security (set up by `idem-server broker init`) and a real PostgreSQL,
//! and in password-file mode through `idem-server broker files`: device ids
//! naming the server's, the dashboards reader's, the broker admin's account
//! or one made on the broker directly are refused with 409, nothing is
//! written, and each of those accounts still logs in with its own password.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_device_sim::{Credentials, DeviceBehaviour, SimDevice};
use idem_protocol::DeviceId;
use idem_server::broker::accounts;
use idem_server::cli::broker::BrokerCommand;
use idem_server::config::BrokerAccounts;
use idem_tests::secured::start_secured;
use idem_tests::{PrivateMosquitto, Scenario, ServerSettings, TestServer};
use rumqttc::{AsyncClient, ConnectReturnCode, Event, Packet};
use serde_json::{json, Value};

/// What an operator would choose to take an account over.
const OPERATORS_PASSWORD: &str = "chosen-by-the-operator";

/// Whether the broker lets `user` in with `password` as `client_id`.
async fn logs_in(broker: &PrivateMosquitto, client_id: &str, user: &str, password: &str) -> bool {
    let mut options = broker.mqtt_options(client_id);
    options.set_credentials(user, password);
    let (client, mut eventloop) = AsyncClient::new(options, 8);
    let first = tokio::time::timeout(Duration::from_secs(10), eventloop.poll())
        .await
        .expect("no answer from the broker");
    let accepted = matches!(first, Ok(Event::Incoming(Packet::ConnAck(ack))) if ack.code == ConnectReturnCode::Success);
    if accepted {
        let _ = client.disconnect().await;
        let _ = tokio::time::timeout(Duration::from_secs(1), eventloop.poll()).await;
    }
    accepted
}

/// A registration of `id` with a password of the operator's choosing.
fn takeover(id: &str) -> Value {
    json!([{"id": id, "broker_password": OPERATORS_PASSWORD, "spec": {"fw": "evil"}}])
}

async fn device_count(scenario: &Scenario) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM devices")
        .fetch_one(scenario.db.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_a_device_named_like_a_broker_account_is_refused_and_every_account_keeps_its_password(
) {
    let (scenario, accounts) = start_secured(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    // An account the broker's admin made directly, which idem never heard of.
    let (bot, bot_password) = ("ops-bot", "the-bots-own-password");
    let admin_config = {
        let mut config = idem_server::Config::defaults();
        config.mqtt.mqtt_url = scenario.broker.url().into();
        config.mqtt.mqtt_ca_file = scenario.broker.ca_file().map(std::path::Path::to_path_buf);
        config.validate().unwrap()
    };
    let made = idem_server::cli::broker::send_as_admin(
        &admin_config,
        &accounts.admin.0,
        &accounts.admin.1,
        vec![json!({"command": "createClient", "username": bot, "password": bot_password})],
    )
    .await
    .unwrap();
    assert!(made.iter().all(|r| r.is_ok()), "{made:?}");

    for id in [
        accounts.server.0.as_str(),
        accounts.reader.0.as_str(),
        accounts.admin.0.as_str(),
        bot,
    ] {
        let (status, answer) = server.post("/v1/devices", &takeover(id)).await.unwrap();
        assert_eq!(status, 409, "{id}: {answer}");
        assert_eq!(
            answer["error"]["code"], "reserved_broker_account",
            "{answer}"
        );
        assert!(
            answer["error"]["message"].as_str().unwrap().contains(id),
            "{answer}"
        );
        let (status, answer) = server
            .put(&format!("/v1/devices/{id}"), &json!({}))
            .await
            .unwrap();
        assert_eq!(status, 409, "PUT {id}: {answer}");
    }
    // A batch with one such id among good ones writes nothing at all.
    let mixed = json!([{"id": "pump-1"}, {"id": bot, "broker_password": OPERATORS_PASSWORD}]);
    let (status, answer) = server.post("/v1/devices", &mixed).await.unwrap();
    assert_eq!(status, 409, "{answer}");
    assert_eq!(device_count(&scenario).await, 0);

    // Every account still logs in with its own password, and with the
    // operator's with none.
    let server_client_id = format!("idem-server:{}", server.instance);
    let own = [
        (
            accounts.admin.0.as_str(),
            accounts.admin.1.as_str(),
            "broker-init-probe",
        ),
        (
            accounts.reader.0.as_str(),
            accounts.reader.1.as_str(),
            accounts.reader.0.as_str(),
        ),
        (bot, bot_password, bot),
    ];
    for (user, password, client_id) in own {
        assert!(
            logs_in(&scenario.broker, client_id, user, password).await,
            "{user} no longer logs in with its own password"
        );
        assert!(
            !logs_in(&scenario.broker, client_id, user, OPERATORS_PASSWORD).await,
            "{user} logs in with the operator's password"
        );
    }
    // The server's own account (bound to the server's client id) is
    // untouched: the server still manages accounts and ingests reports.
    assert!(
        !logs_in(
            &scenario.broker,
            &server_client_id,
            &accounts.server.0,
            OPERATORS_PASSWORD
        )
        .await
    );
    let (status, answer) = server
        .post(
            "/v1/devices",
            &json!([{"id": "pump-1", "spec": {"fw": "1"}}]),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let password = answer["credentials"][0]["password"]
        .as_str()
        .unwrap()
        .to_owned();
    let pump = SimDevice::new(DeviceId::parse("pump-1").unwrap(), json!({"fw": "1"}))
        .with_behaviour(DeviceBehaviour::Accept);
    let mut config = scenario.fleet_config(vec![pump]).unwrap();
    config.credentials = Some(Credentials::new(
        [(DeviceId::parse("pump-1").unwrap(), password)].into(),
    ));
    let _fleet = scenario.start_fleet_with(config).await.unwrap();
    scenario
        .wait_reports_stored(1, Duration::from_secs(20))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_row_named_like_a_foreign_account_never_re_passwords_or_deletes_it() {
    let (scenario, accounts) = start_secured(ServerSettings::default()).await.unwrap();
    let Scenario { server, db, broker } = scenario;
    let settings = ServerSettings {
        topic_root: Some(server.topic_root.to_string()),
        instance: Some(server.instance.clone()),
        mqtt_credentials: Some(accounts.server.clone()),
        broker_accounts: BrokerAccounts::Dynsec,
        ..ServerSettings::default()
    };
    server.stop().await.unwrap();
    // Rows as an older server could have written them, before names were
    // checked: the admin's and the server's names.
    let admin = accounts.admin.0.as_str();
    sqlx::query("INSERT INTO devices (id) VALUES ($1), ($2)")
        .bind(admin)
        .bind(&accounts.server.0)
        .execute(db.pool())
        .await
        .unwrap();
    let server = TestServer::start(&db, &broker, settings).await.unwrap();
    for id in [admin, accounts.server.0.as_str()] {
        let (status, answer) = server
            .post(
                &format!("/v1/devices/{id}/credentials"),
                &json!({"password": OPERATORS_PASSWORD}),
            )
            .await
            .unwrap();
        assert_eq!(status, 409, "{id}: {answer}");
        assert_eq!(answer["error"]["code"], "reserved_broker_account");
    }
    let (status, answer) = server
        .delete(&format!("/v1/devices/{admin}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["broker_account_removed"], false, "{answer}");
    assert!(logs_in(&broker, "probe-1", admin, &accounts.admin.1).await);
    assert!(!logs_in(&broker, "probe-2", admin, OPERATORS_PASSWORD).await);
    // The server's account still works: the server still answers ready.
    let (status, _) = server.get("/readyz").await.unwrap();
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_password_file_mode_reserved_and_listed_accounts_are_refused_and_broker_files_writes_each_once(
) {
    let dir = tempfile::tempdir().unwrap();
    let reader_password = "the-readers-own-password";
    let bot_password = "the-bots-own-password";
    // The broker's own accounts, as `mosquitto_passwd` writes them.
    let accounts_file = dir.path().join("broker-accounts");
    std::fs::write(
        &accounts_file,
        format!(
            "dashboards:{}\nops-bot:{}\n",
            accounts::mosquitto_hash(reader_password),
            accounts::mosquitto_hash(bot_password)
        ),
    )
    .unwrap();
    let server_password = "the-servers-own-password";
    let settings = ServerSettings {
        broker_accounts: BrokerAccounts::PasswordFile,
        broker_accounts_file: Some(accounts_file.clone()),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start(settings).await.unwrap();
    let server = &scenario.server;
    for id in ["idem-server", "dashboards", "broker-admin", "ops-bot"] {
        let (status, answer) = server.post("/v1/devices", &takeover(id)).await.unwrap();
        assert_eq!(status, 409, "{id}: {answer}");
        assert_eq!(answer["error"]["code"], "reserved_broker_account");
    }
    let (status, answer) = server
        .post("/v1/devices", &json!([{"id": "pump-1"}]))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let pump_password = answer["credentials"][0]["password"]
        .as_str()
        .unwrap()
        .to_owned();
    // A row written before names were checked, with an operator's hash.
    sqlx::query("INSERT INTO devices (id, broker_password_hash) VALUES ('idem-server', $1), ('ops-bot', $1)")
        .bind(accounts::mosquitto_hash(OPERATORS_PASSWORD))
        .execute(scenario.db.pool())
        .await
        .unwrap();

    let server_password_file = dir.path().join("server.pw");
    std::fs::write(&server_password_file, server_password).unwrap();
    let out = dir.path().join("broker");
    let mut config = idem_server::Config::defaults();
    config.database.database_url = scenario.db.url().into();
    config.security.broker_accounts_file = Some(accounts_file);
    let command = BrokerCommand::Files {
        out: out.clone(),
        server_username: "idem-server".into(),
        server_password_file,
    };
    idem_server::cli::broker::run(&config.validate().unwrap(), command)
        .await
        .unwrap();
    let written = std::fs::read_to_string(out.join("password_file")).unwrap();
    let lines: Vec<(&str, &str)> = written
        .lines()
        .map(|l| l.split_once(':').unwrap())
        .collect();
    let users: Vec<&str> = lines.iter().map(|(u, _)| *u).collect();
    assert_eq!(users, ["idem-server", "dashboards", "ops-bot", "pump-1"]);
    // Each account logs in with its own password only (Mosquitto's `$7$`
    // check, as the broker does it).
    let hash = |user: &str| lines.iter().find(|(u, _)| *u == user).unwrap().1;
    for (user, own) in [
        ("idem-server", server_password),
        ("dashboards", reader_password),
        ("ops-bot", bot_password),
        ("pump-1", pump_password.as_str()),
    ] {
        assert!(accounts::verify_mosquitto_hash(own, hash(user)), "{user}");
        assert!(
            !accounts::verify_mosquitto_hash(OPERATORS_PASSWORD, hash(user)),
            "{user} takes the operator's password"
        );
    }
}
