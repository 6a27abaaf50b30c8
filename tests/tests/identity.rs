//! End to end, the way an attacker would try it: against a real Mosquitto
//! with a TLS listener and the dynamic-security plugin, set up by
//! `idem-server broker init`, with every device on its own account created
//! by the server at registration. Each attack from the field — forged
//! reports, desired messages, status and events, a stolen client id,
//! anonymous and wrong-password logins — is refused by the broker and
//! changes nothing in idem. The same takeover attempts against a Mosquitto
//! with a password file and the `acl_file` of `idem-server broker files`
//! show what `use_username_as_clientid true` (docs/OPERATIONS.md §9)
//! guards.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem_device_sim::{Credentials, DeviceBehaviour, SimDevice};
use idem_protocol::{Channel, DeviceId, TopicRoot};
use idem_tests::secured::start_secured;
use idem_tests::{PrivateMosquitto, Scenario, ServerSettings};
use rumqttc::{AsyncClient, ConnectReturnCode, Event, MqttOptions, Packet, QoS};
use serde_json::{json, Value};

/// What happened to one connection attempt and its publishes.
#[derive(Debug, PartialEq, Eq)]
enum Login {
    Refused(String),
    Accepted,
}

/// Connects as `username`/`password` with `client_id` (TLS with the
/// broker's CA) and reports whether the broker let it in.
async fn try_login(
    broker: &PrivateMosquitto,
    client_id: &str,
    credentials: Option<(&str, &str)>,
) -> (Login, Option<(AsyncClient, tokio::task::JoinHandle<()>)>) {
    let mut options: MqttOptions = broker.mqtt_options(client_id);
    if let Some((user, password)) = credentials {
        options.set_credentials(user, password);
    }
    let (client, mut eventloop) = AsyncClient::new(options, 32);
    let first = tokio::time::timeout(Duration::from_secs(10), eventloop.poll())
        .await
        .expect("no answer from the broker");
    match first {
        Ok(Event::Incoming(Packet::ConnAck(ack))) if ack.code == ConnectReturnCode::Success => {
            let pump = tokio::spawn(async move { while eventloop.poll().await.is_ok() {} });
            (Login::Accepted, Some((client, pump)))
        }
        Ok(other) => (Login::Refused(format!("{other:?}")), None),
        Err(e) => (Login::Refused(e.to_string()), None),
    }
}

/// A `seq` the server accepts (within its day-ahead ceiling), so only the
/// broker stands between a forged report and idem.
fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

async fn wait_until(what: &str, mut ok: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !ok().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_forgery_and_takeover_is_refused_by_the_broker_and_changes_nothing() {
    let (scenario, accounts) = start_secured(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let root = server.topic_root.clone();
    let desired = json!({"fw": "2.0", "ssh": "closed"});
    let devices: Vec<SimDevice> = (1..=4)
        .map(|i| {
            SimDevice::new(
                DeviceId::parse(&format!("vb-{i}")).unwrap(),
                desired.clone(),
            )
            .with_behaviour(DeviceBehaviour::Accept)
        })
        .collect();
    // vb-5 is the attacker: a registered device whose (own) credentials
    // are used to try what no device may do.
    let body: Vec<Value> = devices
        .iter()
        .map(|d| json!({"id": d.id, "spec": desired}))
        .chain([json!({"id": "vb-5", "spec": desired})])
        .collect();
    let (status, answer) = server
        .post("/v1/devices", &Value::Array(body))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let passwords: HashMap<DeviceId, String> = answer["credentials"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c["username"], c["id"]);
            (
                DeviceId::parse(c["id"].as_str().unwrap()).unwrap(),
                c["password"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(passwords.len(), 5, "{answer}");
    let mut config = scenario.fleet_config(devices).unwrap();
    let mut fleet_passwords = passwords.clone();
    fleet_passwords.remove(&DeviceId::parse("vb-5").unwrap());
    config.credentials = Some(Credentials::new(fleet_passwords));
    let fleet = scenario.start_fleet_with(config).await.unwrap();
    scenario
        .wait_reports_stored(4, Duration::from_secs(20))
        .await
        .unwrap();
    // A dashboard reader on the event topics, to see what a forged event
    // would reach.
    let mut options = scenario.broker.mqtt_options(&accounts.reader.0);
    options.set_credentials(&accounts.reader.0, &accounts.reader.1);
    options.set_max_packet_size(1 << 20, 1 << 20);
    let (reader, mut reader_loop) = AsyncClient::new(options, 32);
    reader
        .subscribe(root.events_filter(), QoS::AtLeastOnce)
        .await
        .unwrap();
    let sources = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = sources.clone();
    let reader_task = tokio::spawn(async move {
        while let Ok(event) = reader_loop.poll().await {
            if let Event::Incoming(Packet::Publish(p)) = event {
                let event: Value = serde_json::from_slice(&p.payload).unwrap_or_default();
                let source = event["source"].as_str().unwrap_or("?").to_owned();
                sink.lock().unwrap().push(source);
            }
        }
    });
    let id = |n: u8| DeviceId::parse(&format!("vb-{n}")).unwrap();
    let topic = |n: u8, channel| root.topic(&id(n), channel);

    // Anonymous, unknown and wrong-password logins are refused.
    for credentials in [
        None,
        Some(("attacker-A", "guess")),
        Some(("vb-1", "not-its-password")),
        Some((accounts.server.0.as_str(), "not-its-password")),
    ] {
        let (login, _) = try_login(&scenario.broker, "attacker-A", credentials).await;
        assert!(
            matches!(login, Login::Refused(_)),
            "{credentials:?}: {login:?}"
        );
    }
    // A device's own account, with another client id, is refused too: the
    // client id is bound to the account.
    let (login, _) = try_login(
        &scenario.broker,
        "attacker-A",
        Some(("vb-1", &passwords[&id(1)])),
    )
    .await;
    assert!(matches!(login, Login::Refused(_)), "{login:?}");
    // Nobody takes over the server's session: not a device, not a reader.
    let server_client_id = format!("idem-server:{}", server.instance);
    for (user, password) in [
        ("vb-1", passwords[&id(1)].as_str()),
        (accounts.reader.0.as_str(), accounts.reader.1.as_str()),
    ] {
        let (login, _) =
            try_login(&scenario.broker, &server_client_id, Some((user, password))).await;
        assert!(matches!(login, Login::Refused(_)), "{user}: {login:?}");
    }

    // vb-5, logged in legitimately, tries everything it must not do.
    let (login, client) =
        try_login(&scenario.broker, "vb-5", Some(("vb-5", &passwords[&id(5)]))).await;
    assert_eq!(login, Login::Accepted);
    let (attacker, _pump) = client.unwrap();
    let stored_seq_of_vb2 =
        server.get("/v1/devices/vb-2").await.unwrap().1["reported"]["seq"].clone();
    let forged_report = json!({"seq": now_micros() + 10_000_000, "spec": {"fw": "0.1-vulnerable"}});
    let forgeries: Vec<(String, bool, Vec<u8>)> = vec![
        (topic(2, Channel::Reported), false, forged_report.to_string().into_bytes()),
        (
            topic(3, Channel::Desired),
            true,
            json!({"generation": 9_000_000_000_000_000_u64, "spec": {"fw": "evil", "ssh": "open"}})
                .to_string()
                .into_bytes(),
        ),
        (topic(4, Channel::Status), true, b"offline".to_vec()),
        (
            root.event_topic("io.idem.device.provisioned", "vb-2"),
            false,
            json!({"specversion": "1.0", "type": "io.idem.device.provisioned", "source": "/idem/forged", "id": "x", "subject": "vb-2"})
                .to_string()
                .into_bytes(),
        ),
    ];
    for (topic, retain, payload) in &forgeries {
        attacker
            .publish(topic.clone(), QoS::AtLeastOnce, *retain, payload.clone())
            .await
            .unwrap();
    }
    // A message vb-5 may send, after the forgeries: once it is stored, the
    // broker has handled everything before it.
    let own = fleet.state(&id(1)).unwrap().seq + 1_000;
    attacker
        .publish(
            topic(5, Channel::Reported),
            QoS::AtLeastOnce,
            false,
            json!({"seq": own, "spec": desired})
                .to_string()
                .into_bytes(),
        )
        .await
        .unwrap();
    wait_until("vb-5's own report is stored", async || {
        server.get("/v1/devices/vb-5").await.unwrap().1["reported"]["seq"] == own
    })
    .await;

    let (_, vb2) = server.get("/v1/devices/vb-2").await.unwrap();
    assert_eq!(
        vb2["reported"]["seq"], stored_seq_of_vb2,
        "a forged report reached idem"
    );
    assert_eq!(vb2["reported"]["spec"], desired);
    let vb3 = fleet.state(&id(3)).unwrap();
    assert_eq!(vb3.spec, desired, "vb-3 applied a forged desired spec");
    assert!(vb3.installed.is_empty(), "{:?}", vb3.installed);
    let (_, vb4) = server.get("/v1/devices/vb-4").await.unwrap();
    assert_eq!(vb4["online"], true, "a forged offline reached idem: {vb4}");
    let run_id = server
        .start_run(&json!({"devices": ["vb-1", "vb-2", "vb-3", "vb-4"]}))
        .await
        .unwrap();
    let run = server
        .wait_run_completed(&run_id, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        run["summary"], "4 already converged, 0 provisioned, 0 failed",
        "{run}"
    );
    // The server itself was never kicked off the broker.
    assert_eq!(
        server.metric("idem_mqtt_reconnects_total").await.unwrap(),
        0.0
    );
    // The reader got the run's real events, and no forged one.
    wait_until("the reader saw the run's events", async || {
        sources.lock().unwrap().len() >= 6
    })
    .await;
    let sources = sources.lock().unwrap().clone();
    let real = format!("/idem/{}", server.instance);
    assert!(
        sources.iter().all(|s| *s == real),
        "an event not from the server reached a dashboard: {sources:?}"
    );
    reader_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_device_loses_its_broker_account_and_new_credentials_replace_old_ones() {
    let (scenario, _accounts) = start_secured(ServerSettings::default()).await.unwrap();
    let server = &scenario.server;
    let (status, answer) = server
        .post("/v1/devices", &json!([{"id": "acct-1", "spec": {"v": 1}}, {"id": "acct-2", "broker_password": "chosen-by-ops-1"}]))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let first = answer["credentials"][0]["password"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(answer["credentials"][1]["password"], "chosen-by-ops-1");
    assert!(!answer["credentials"].to_string().is_empty());
    let login = |id: &'static str, password: String| {
        let broker = &scenario.broker;
        async move { try_login(broker, id, Some((id, &password))).await.0 }
    };
    assert_eq!(login("acct-1", first.clone()).await, Login::Accepted);
    assert_eq!(
        login("acct-2", "chosen-by-ops-1".into()).await,
        Login::Accepted
    );

    // A new password replaces the old one at once.
    let (status, rotated) = server
        .post("/v1/devices/acct-1/credentials", &json!({}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{rotated}");
    let second = rotated["password"].as_str().unwrap().to_owned();
    assert_ne!(second, first);
    assert!(matches!(login("acct-1", first).await, Login::Refused(_)));
    assert_eq!(login("acct-1", second.clone()).await, Login::Accepted);

    // Deleting the device removes its account.
    let (status, deleted) = server.delete("/v1/devices/acct-1").await.unwrap();
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["broker_account_removed"], true, "{deleted}");
    assert!(matches!(login("acct-1", second).await, Login::Refused(_)));

    // Passwords never reach the audit trail.
    let (_, audit) = server.get("/v1/audit").await.unwrap();
    let text = audit.to_string();
    assert!(!text.contains("chosen-by-ops-1"), "{text}");
    assert!(
        !text.contains(rotated["password"].as_str().unwrap()),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_500_device_demo_runs_over_tls_with_the_accounts_the_server_created() {
    let (scenario, _accounts) = start_secured(ServerSettings::default()).await.unwrap();
    let plan = idem_device_sim::FleetPlan::new("sec-", 500)
        .drifted(5)
        .rejecting(2)
        .seed(17)
        .build()
        .unwrap();
    let fleet = scenario.fleet_config(Vec::new()).unwrap();
    let mut demo = idem_device_sim::DemoSettings::new(
        scenario.server.url(""),
        plan.clone(),
        fleet.broker.clone(),
        scenario.server.topic_root.clone(),
    );
    demo.fleet.tls = fleet.tls;
    demo.auth.token = scenario
        .server
        .token()
        .map(idem_device_sim::SecretString::new);
    demo.timeout = Duration::from_secs(60);
    demo.register_chunk = 100;
    let started = Instant::now();
    let run = idem_device_sim::run_demo(demo, &()).await.unwrap();
    println!(
        "secured demo, 500 devices over TLS with their own accounts: {:?} total; connect {:.2} s, run {:.3} s",
        started.elapsed(),
        run.report.timings.connect_s,
        run.report.timings.run_s
    );
    assert_eq!(
        run.report.summary,
        "493 already converged, 5 provisioned, 2 failed"
    );
    assert!(
        run.report.check.passed(),
        "{:#?}",
        run.report.check.mismatches
    );
    assert_eq!(run.report.check.checked, 500);
}

/// Lines of the broker's log saying that a connection took over the
/// session of `client_id` (Mosquitto: "Client X already connected, closing
/// old connection.").
fn takeovers_of(broker: &PrivateMosquitto, client_id: &str) -> Vec<String> {
    let needle = format!("Client {client_id} already connected");
    std::fs::read_to_string(broker.log_path())
        .unwrap_or_default()
        .lines()
        .filter(|line| line.contains(&needle))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_password_file_broker_a_device_with_its_own_password_takes_neither_another_devices_session_nor_the_servers(
) {
    let unique = uuid::Uuid::new_v4().simple().to_string();
    let root = TopicRoot::new(format!("idem-pwfile/{}", &unique[..12])).unwrap();
    let password = |who: &str| format!("{who}-{unique}");
    // The deployment of OPERATIONS §9 "Mosquitto with a password file":
    // TLS, one account each, the ACL that `broker files` writes, and (the
    // harness's default with a password file) `use_username_as_clientid`.
    let broker = PrivateMosquitto::builder()
        .tls()
        .password_file(&[
            ("idem-server", password("server")),
            ("pf-1", password("pf-1")),
            ("pf-2", password("pf-2")),
        ])
        .acl_file(idem_server::broker::accounts::static_acl_file(
            &root,
            "idem-server",
        ))
        .start()
        .unwrap();
    let settings = ServerSettings {
        topic_root: Some(root.as_str().to_owned()),
        mqtt_credentials: Some(("idem-server".to_owned(), password("server"))),
        ..ServerSettings::default()
    };
    let scenario = Scenario::start_on(broker, settings).await.unwrap();
    let server = &scenario.server;
    let broker = &scenario.broker;
    // With the setting, the server's session is its user name, not the
    // `idem-server:{instance}` it asks for.
    let log = std::fs::read_to_string(broker.log_path()).unwrap();
    assert!(
        log.contains(" as idem-server (") && log.contains("u'idem-server'"),
        "the server's session is not named after its user:\n{log}"
    );
    let spec = json!({"fw": "1.0"});
    let (status, answer) = server
        .post(
            "/v1/devices",
            &json!([{"id": "pf-1", "spec": spec}, {"id": "pf-2", "spec": spec}]),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    let id = |name: &str| DeviceId::parse(name).unwrap();
    let report = |seq: u64| json!({"seq": seq, "spec": spec}).to_string().into_bytes();
    let stored_seq = async |device: &str| -> Value {
        server
            .get(&format!("/v1/devices/{device}"))
            .await
            .unwrap()
            .1["reported"]["seq"]
            .clone()
    };

    // pf-2 is online with its own session and has reported.
    let (login, client) = try_login(broker, "pf-2", Some(("pf-2", &password("pf-2")))).await;
    assert_eq!(login, Login::Accepted);
    let (pf2, pf2_pump) = client.unwrap();
    let pf2_seq = now_micros();
    pf2.publish(
        root.topic(&id("pf-2"), Channel::Reported),
        QoS::AtLeastOnce,
        false,
        report(pf2_seq),
    )
    .await
    .unwrap();
    wait_until("pf-2's own report is stored", async || {
        stored_seq("pf-2").await == pf2_seq
    })
    .await;

    // pf-1, with its own password, asks for pf-2's client id. The broker
    // lets it in under its own (client id = user name): pf-2 stays
    // connected, and pf-1 may still publish only as pf-1.
    let (login, client) = try_login(broker, "pf-2", Some(("pf-1", &password("pf-1")))).await;
    assert_eq!(login, Login::Accepted, "pf-1's own login was refused");
    let (attacker, _attacker_pump) = client.unwrap();
    attacker
        .publish(
            root.topic(&id("pf-2"), Channel::Reported),
            QoS::AtLeastOnce,
            false,
            report(pf2_seq + 10_000_000),
        )
        .await
        .unwrap();
    let own = now_micros();
    attacker
        .publish(
            root.topic(&id("pf-1"), Channel::Reported),
            QoS::AtLeastOnce,
            false,
            report(own),
        )
        .await
        .unwrap();
    wait_until("pf-1's own report is stored", async || {
        stored_seq("pf-1").await == own
    })
    .await;
    assert_eq!(
        takeovers_of(broker, "pf-2"),
        Vec::<String>::new(),
        "pf-1 took over pf-2's session (is `use_username_as_clientid true` set?)\n{}",
        broker.log_tail()
    );
    assert!(
        !pf2_pump.is_finished(),
        "pf-2 was disconnected when pf-1 connected with its client id\n{}",
        broker.log_tail()
    );
    assert_eq!(
        stored_seq("pf-2").await,
        pf2_seq,
        "a report pf-1 published on pf-2's topic reached idem"
    );

    // Nor the server's session: neither its own client id nor the one the
    // broker gives it with `use_username_as_clientid` (its user name).
    let mut seq = own;
    for client_id in [
        format!("idem-server:{}", server.instance),
        "idem-server".to_owned(),
    ] {
        let (login, client) =
            try_login(broker, &client_id, Some(("pf-1", &password("pf-1")))).await;
        assert_eq!(login, Login::Accepted, "{client_id}");
        let (attacker, _pump) = client.unwrap();
        seq += 1;
        attacker
            .publish(
                root.topic(&id("pf-1"), Channel::Reported),
                QoS::AtLeastOnce,
                false,
                report(seq),
            )
            .await
            .unwrap();
        // Stored means the server's own session is still receiving.
        wait_until("pf-1's report is stored", async || {
            stored_seq("pf-1").await == seq
        })
        .await;
        for session in [client_id.as_str(), "idem-server"] {
            assert_eq!(
                takeovers_of(broker, session),
                Vec::<String>::new(),
                "pf-1, asking for client id {client_id:?}, took over the server's session\n{}",
                broker.log_tail()
            );
        }
    }
    assert_eq!(
        server.metric("idem_mqtt_reconnects_total").await.unwrap(),
        0.0,
        "the server was kicked off the broker"
    );
    assert!(!pf2_pump.is_finished(), "pf-2 lost its connection");
}
