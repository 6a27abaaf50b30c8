//! End to end: the audit trail is written in the transaction of the change
//! it records, so a server killed (SIGKILL, like a crash) in the middle of a
//! burst of desired changes leaves an audit row for every change that
//! committed — counted in PostgreSQL after the kill.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_protocol::TopicRoot;
use idem_tests::{raise_fd_limit, PrivateMosquitto, ProcessServer, TestDatabase};
use serde_json::json;

const SERVER_BIN: &str = env!("CARGO_BIN_EXE_idem-server-under-test");
const DEVICES: usize = 20;
/// Concurrent callers changing desired state.
const CALLERS: usize = 16;
/// Answered changes before each kill, at least.
const CHANGES_BEFORE_KILL: usize = 40;
/// Bursts, each ended by a kill; the server is restarted in between.
const KILLS: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_desired_change_committed_before_a_kill_9_has_its_audit_row() {
    raise_fd_limit().unwrap();
    let broker = PrivateMosquitto::start().unwrap();
    let db = TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let root = TopicRoot::new(format!("idem-audit/{tag}")).unwrap();
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("audit-{tag}"),
        &[],
    )
    .await
    .unwrap();
    let ids: Vec<String> = (0..DEVICES).map(|i| format!("audited-{i:02}")).collect();
    let registration: Vec<_> = ids.iter().map(|id| json!({"id": id})).collect();
    let (status, answer) = server
        .post("/v1/devices", &json!(registration))
        .await
        .unwrap();
    assert_eq!(status, 200, "{answer}");

    // Devices are offline: each change commits a run that ends at once, so
    // the callers keep the server's transactions busy until the kill.
    let mut answered = 0;
    for kill in 0..KILLS {
        if kill > 0 {
            server.restart().await.unwrap();
        }
        answered += burst_until_killed(&mut server, &ids, kill).await;
    }

    let pool = db.pool();
    // Every change to a new spec raised its device's generation by one.
    let committed: i64 =
        sqlx::query_scalar("SELECT COALESCE(sum(desired_generation), 0)::int8 FROM devices")
            .fetch_one(pool)
            .await
            .unwrap();
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE route = '/v1/devices/{id}/desired' AND status = 200",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let runs_without_audit: Vec<(uuid::Uuid,)> = sqlx::query_as(
        "SELECT r.id FROM runs r WHERE r.started_by IS NOT NULL \
         AND NOT EXISTS (SELECT 1 FROM audit_log a WHERE a.run_id = r.id)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    eprintln!("answered {answered}, committed {committed}, audited {audited}");
    assert!(
        committed >= answered as i64,
        "{committed} committed < {answered} answered"
    );
    assert_eq!(
        committed, audited,
        "{committed} desired changes committed, {audited} audit rows for them"
    );
    assert!(
        runs_without_audit.is_empty(),
        "runs started through the API without an audit row: {runs_without_audit:?}"
    );
}

/// Changes desired state from [`CALLERS`] callers at once until
/// [`CHANGES_BEFORE_KILL`] were answered, then SIGKILLs the server with
/// requests in flight. Returns how many were answered.
async fn burst_until_killed(server: &mut ProcessServer, ids: &[String], burst: usize) -> usize {
    let answered = Arc::new(AtomicUsize::new(0));
    let callers: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let api = server.api();
            let ids = ids.to_vec();
            let answered = answered.clone();
            tokio::spawn(async move {
                for n in 0.. {
                    let id = &ids[(caller + n * CALLERS) % ids.len()];
                    let body = json!({"spec": {"burst": burst, "caller": caller, "n": n}});
                    match api.put(&format!("/v1/devices/{id}/desired"), &body).await {
                        Ok((200, _)) => {
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) | Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                    }
                }
            })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while answered.load(Ordering::Relaxed) < CHANGES_BEFORE_KILL {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} changes answered in 60 s\n{}",
            answered.load(Ordering::Relaxed),
            server.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.kill().unwrap();
    for caller in callers {
        caller.abort();
    }
    answered.load(Ordering::Relaxed)
}
