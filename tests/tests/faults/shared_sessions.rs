//! Two instances sharing the fleet's subscriptions (`--share-group`): the
//! broker hands each report to one of them. One is SIGKILLed and never
//! restarted; the broker goes on queueing its share in its persistent
//! session. The survivor drains that session once the dead instance's
//! claim is stale, so every report the broker accepted is stored — on a
//! plain broker, and in the secured setup OPERATIONS documents for several
//! instances (TLS, a password file shared by the instances, the ACL of
//! `idem-server broker files`).

use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::{Credentials, DeviceSnapshot, FleetPlan};
use idem_protocol::TopicRoot;
use idem_tests::{PrivateMosquitto, ProcessServer, ReportWitness, TestDatabase};

use crate::{
    private_services, register, start_fleet_as, take_all_offline, wait_each_published_since,
    wait_reports_stored, wait_stored_equals_published, wait_witness_saw_final, SERIAL, SERVER_BIN,
};

/// The value of an unlabelled counter in a Prometheus text exposition.
fn counter(exposition: &str, name: &str) -> f64 {
    idem_device_sim::api::metric_value(exposition, name)
        .unwrap()
        .unwrap_or_else(|| panic!("{name} is not in the exposition"))
}

/// The broker and logins a run of the scenario uses: the plain broker of
/// `private_services`, or the secured one OPERATIONS documents for several
/// instances.
struct Setup {
    broker: PrivateMosquitto,
    db: TestDatabase,
    tag: String,
    root: TopicRoot,
    /// Extra environment of both instances (the broker login).
    env: Vec<(String, String)>,
    witness_login: Option<(String, String)>,
    device_logins: Option<Credentials>,
}

const DEVICES: usize = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_queued_for_a_killed_instance_that_never_returns_are_stored_by_the_survivor() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, tag, root) = private_services("idem-shared").await;
    survivor_drains_the_dead_instances_session(Setup {
        broker,
        db,
        tag,
        root,
        env: Vec::new(),
        witness_login: None,
        device_logins: None,
    })
    .await;
}

/// The same over TLS with every client logged in, under the ACL of
/// `idem-server broker files`, as OPERATIONS "Running N instances" says
/// for several instances: they share one account whose client ids are
/// their own choice, so the survivor may connect with the dead instance's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_secured_setup_the_survivor_drains_the_killed_instances_session_with_its_own_rights()
{
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    idem_tests::raise_fd_limit().unwrap();
    let tag = crate::unique_tag();
    let root = TopicRoot::new(format!("idem-shared-tls/{tag}")).unwrap();
    let password = |who: &str| format!("{who}-{tag}");
    let plan = FleetPlan::new("secured-shared-", DEVICES)
        .seed(7)
        .build()
        .unwrap();
    let mut accounts = vec![
        ("idem-server".to_owned(), password("server")),
        ("witness".to_owned(), password("witness")),
    ];
    accounts.extend(
        plan.devices
            .iter()
            .map(|d| (d.id.to_string(), password(d.id.as_str()))),
    );
    let r = root.as_str();
    // The server's lines of `broker files` as they are: Mosquitto checks
    // a `$share/{group}/…` subscription against the filter after the group.
    let acl = format!(
        "{}\nuser witness\ntopic read {r}/+/reported\n",
        idem_server::broker::accounts::static_acl_file(&root, "idem-server"),
    );
    let broker = PrivateMosquitto::builder()
        .tls()
        .password_file(&accounts)
        .client_ids_chosen_by_clients()
        .acl_file(acl)
        .start()
        .unwrap();
    let db = TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let ca = broker.ca_file().unwrap().display().to_string();
    let device_logins = Credentials::new(
        plan.devices
            .iter()
            .map(|d| (d.id.clone(), password(d.id.as_str())))
            .collect(),
    );
    survivor_drains_the_dead_instances_session(Setup {
        broker,
        db,
        tag: tag.clone(),
        root,
        env: vec![
            ("IDEM_MQTT_USERNAME".to_owned(), "idem-server".to_owned()),
            ("IDEM_MQTT_PASSWORD".to_owned(), password("server")),
            ("IDEM_MQTT_CA_FILE".to_owned(), ca),
        ],
        witness_login: Some(("witness".to_owned(), password("witness"))),
        device_logins: Some(device_logins),
    })
    .await;
}

async fn survivor_drains_the_dead_instances_session(setup: Setup) {
    const HEARTBEAT: Duration = Duration::from_millis(200);
    let Setup {
        broker,
        db,
        tag,
        root,
        env: login_env,
        witness_login,
        device_logins,
    } = setup;
    let group = format!("g{tag}");
    let mut env: Vec<(&str, &str)> = vec![
        ("IDEM_SHARE_GROUP", group.as_str()),
        ("IDEM_INSTANCE_LEASE", "2s"),
    ];
    env.extend(login_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let witness = ReportWitness::start_as(
        &broker,
        &root,
        witness_login
            .as_ref()
            .map(|(u, p)| (u.as_str(), p.as_str())),
    )
    .await
    .unwrap();
    let survivor = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("survivor-{tag}"),
        &env,
    )
    .await
    .unwrap();
    let prefix = if device_logins.is_some() {
        "secured-shared-"
    } else {
        "shared-"
    };
    let plan = FleetPlan::new(prefix, DEVICES).seed(7).build().unwrap();
    register(&survivor, &plan).await;
    // Started after the registration, so its fleet cache holds the devices.
    let mut doomed = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("doomed-{tag}"),
        &env,
    )
    .await
    .unwrap();
    let fleet = start_fleet_as(
        &broker,
        &root,
        plan.devices.clone(),
        Some(HEARTBEAT),
        device_logins,
    )
    .await;
    wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;

    doomed.kill().unwrap();
    let killed_at = Instant::now();
    // Every device reports again while the dead instance's claim is still
    // live: part of those reports wait in its session.
    let highest_at_kill = witness.highest();
    wait_each_published_since(&witness, &fleet, &highest_at_kill, "after the kill").await;
    let finals: Vec<DeviceSnapshot> = take_all_offline(&fleet).await;
    wait_witness_saw_final(&witness, &finals).await;
    wait_stored_equals_published(db.pool(), &survivor, &finals, Duration::from_secs(30)).await;

    let stored_at = killed_at.elapsed();
    // The claim is deleted once the drained session is removed too.
    let deadline = Instant::now() + Duration::from_secs(15);
    let metrics = loop {
        let metrics = survivor.api().metrics().await.unwrap();
        if counter(&metrics, "idem_sessions_drained_total") >= 1.0 {
            break metrics;
        }
        assert!(
            Instant::now() < deadline,
            "the survivor drained no session 15 s after the reports were stored\n{}",
            survivor.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(counter(&metrics, "idem_sessions_drained_total"), 1.0);
    let drained = counter(&metrics, "idem_drained_messages_total");
    assert!(
        drained > 0.0,
        "the dead instance's session held nothing: the test did not exercise the drain"
    );
    let (status, cluster) = survivor.get("/v1/cluster").await.unwrap();
    assert_eq!(status, 200, "{cluster}");
    let names: Vec<&str> = cluster["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["name"].as_str())
        .collect();
    assert_eq!(names, [format!("survivor-{tag}")], "{cluster}");
    assert_eq!(survivor.panics(), Vec::<String>::new());
    println!(
        "shared sessions: {} reports seen, {drained} waited in the killed instance's session, \
         all stored {stored_at:?} after the kill",
        witness.reports(),
    );
    fleet.shutdown().await.unwrap();
}
