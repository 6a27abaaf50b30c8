//! Instance names are claimed in the database: a second live server with a
//! name in use refuses to start naming the holder, a SIGKILLed one's name is
//! taken at once by its restart on the same host, and a name whose holder
//! stopped beating elsewhere is taken after its lease. `GET /v1/cluster`
//! lists the claims.

use std::path::Path;
use std::time::Duration;

use idem_protocol::TopicRoot;
use idem_tests::{PrivateMosquitto, ProcessServer, TestDatabase};

use crate::{unique_tag, SERIAL, SERVER_BIN};

/// A private broker, a fresh database, a unique topic root, and a unique
/// instance name starting with `prefix`.
async fn services_and_a_name(prefix: &str) -> (PrivateMosquitto, TestDatabase, TopicRoot, String) {
    let broker = PrivateMosquitto::start().unwrap();
    let db = TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let tag = unique_tag();
    let root = TopicRoot::new(format!("idem-names/{tag}")).unwrap();
    (broker, db, root, format!("{prefix}-{tag}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_server_with_a_name_in_use_exits_non_zero_naming_the_holder() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, root, name) = services_and_a_name("names").await;
    let lease = [("IDEM_INSTANCE_LEASE", "2s")];
    let mut first = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &name,
        &lease,
    )
    .await
    .unwrap();
    let holder_pid = first.pid().unwrap();
    let (status, cluster) = first.get("/v1/cluster").await.unwrap();
    assert_eq!(status, 200, "{cluster}");
    assert_eq!(cluster["instance"], name.as_str(), "{cluster}");
    let listed = &cluster["instances"][0];
    assert_eq!(listed["name"], name.as_str(), "{cluster}");
    assert_eq!(listed["pid"], holder_pid, "{cluster}");
    assert_eq!(listed["live"], true, "{cluster}");
    assert_eq!(listed["lease_ms"], 2000, "{cluster}");
    assert!(
        listed["heartbeat_age_ms"].as_u64().unwrap() < 2000,
        "{cluster}"
    );

    let mut second = ProcessServer::launch(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &name,
        &lease,
    )
    .unwrap();
    // It waits up to the holder's lease (2 s) to see whether the holder
    // still beats, then gives up.
    let status = second
        .wait_exit(Duration::from_secs(20))
        .await
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "a second server with a name in use kept running:\n{}",
                second.log_tail()
            )
        });
    assert!(!status.success(), "{status}\n{}", second.log_tail());
    let log = second.log_text();
    assert!(
        log.contains(&format!(
            "the instance name {name:?} is in use by a live idem-server (pid {holder_pid}"
        )),
        "the refusal does not name the live holder:\n{log}"
    );
    // The holder was never disturbed: still ready, still its name's holder.
    assert!(first.is_running(), "{}", first.log_tail());
    let (status, body) = first.readyz().await.unwrap();
    assert_eq!(status, 200, "{body}");
    let (pid,): (i32,) = sqlx::query_as("SELECT pid FROM instances WHERE name = $1")
        .bind(&name)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(u32::try_from(pid).unwrap(), holder_pid);

    // SIGKILLed: no release, but the restart on this host sees the holder's
    // PID is gone and takes the name at once.
    first.kill().unwrap();
    first.restart().await.unwrap();
    let log = first.log_text();
    assert!(
        log.contains("the instance name's holder on this host is gone")
            && !log.contains("waiting up to its lease"),
        "the restart did not take its dead predecessor's name at once:\n{log}"
    );
    let (pid,): (i32,) = sqlx::query_as("SELECT pid FROM instances WHERE name = $1")
        .bind(&name)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(u32::try_from(pid).unwrap(), first.pid().unwrap());

    // A graceful stop gives the name up.
    first.stop().unwrap();
    let (left,): (i64,) = sqlx::query_as("SELECT count(*) FROM instances WHERE name = $1")
        .bind(&name)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(left, 0, "a graceful stop left its claim behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_whose_holder_on_another_host_stopped_beating_is_taken_after_its_lease() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, root, name) = services_and_a_name("stale").await;
    // A holder on another host whose last heartbeat is 1 s old, with a 2 s
    // lease: live now, stale a second later.
    sqlx::query(
        "INSERT INTO instances (name, holder, host, pid, heartbeat_at, lease_ms) \
         VALUES ($1, gen_random_uuid(), 'elsewhere.example', 4242, now() - interval '1 second', 2000)",
    )
    .bind(&name)
    .execute(db.pool())
    .await
    .unwrap();
    let server = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &name,
        &[],
    )
    .await
    .unwrap();
    assert!(
        server
            .log_text()
            .contains("waiting up to its lease to see whether the holder is alive"),
        "the start did not wait for the stale holder:\n{}",
        server.log_tail()
    );
    let (host, pid): (String, i32) =
        sqlx::query_as("SELECT host, pid FROM instances WHERE name = $1")
            .bind(&name)
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert_ne!(host, "elsewhere.example");
    assert_eq!(u32::try_from(pid).unwrap(), server.pid().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_approval_setting_differs_from_a_live_ones_refuses_to_start() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let (broker, db, root, name) = services_and_a_name("approval").await;
    let strict = [("IDEM_REQUIRE_APPROVAL", "true")];
    let mut first = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("{name}-a"),
        &strict,
    )
    .await
    .unwrap();
    let mut lax = ProcessServer::launch(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("{name}-b"),
        &[],
    )
    .unwrap();
    let status = lax
        .wait_exit(Duration::from_secs(20))
        .await
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "an instance without --require-approval started beside one with it:\n{}",
                lax.log_tail()
            )
        });
    assert!(!status.success(), "{status}\n{}", lax.log_tail());
    let log = lax.log_text();
    assert!(
        log.contains(&format!(
            "the live instance \"{name}-a\" runs with --require-approval=true and this one with \
             --require-approval=false"
        )),
        "the refusal does not name the instance it disagrees with:\n{log}"
    );
    // Its claim was given back; the first instance was not disturbed.
    let (claims,): (i64,) = sqlx::query_as("SELECT count(*) FROM instances")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(claims, 1);
    assert!(first.is_running(), "{}", first.log_tail());
    // The same setting: it starts.
    let mut agreeing = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("{name}-b"),
        &strict,
    )
    .await
    .unwrap();
    agreeing.stop().unwrap();
    first.stop().unwrap();
}
