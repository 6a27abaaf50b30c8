//! A private PostgreSQL cluster stopped mid-run: the server says it is not
//! ready while the database is down, and the run still completes with
//! exact counts once it is back.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::FleetPlan;
use idem_protocol::{OutcomeKind, TopicRoot};
use idem_tests::{raise_fd_limit, PrivateMosquitto, PrivatePostgres, ProcessServer, TestDatabase};
use serde_json::{json, Value};

use crate::{
    register, run_progress, start_fleet, unique_tag, wait_decided, wait_reports_stored,
    wait_stored_equals_published, SERIAL, SERVER_BIN,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_postgres_mid_run_makes_the_server_not_ready_and_the_run_still_completes_with_exact_counts(
) {
    const DEVICES: usize = 50;
    const DRIFTED: usize = 10;
    /// How long the database stays down.
    const OUTAGE: Duration = Duration::from_secs(3);
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let began = Instant::now();
    raise_fd_limit().unwrap();
    let mut pg = tokio::task::block_in_place(PrivatePostgres::start).unwrap();
    let broker = PrivateMosquitto::start().unwrap();
    let db = TestDatabase::create_on(&pg.url(), Some(&idem_server::MIGRATOR))
        .await
        .unwrap();
    let tag = unique_tag();
    let root = TopicRoot::new(format!("idem-faults/{tag}")).unwrap();
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &format!("pgdown-{tag}"),
        // Long enough that the outage itself never times a push out.
        &[("IDEM_PUSH_TIMEOUT", "30s")],
    )
    .await
    .unwrap();

    // The drifted devices confirm a push only after 2–3 s: their answers
    // arrive while the database is down.
    let plan = FleetPlan::new("pgdown-", DEVICES)
        .drifted(DRIFTED)
        .apply_latency(Duration::from_secs(2), Duration::from_secs(3))
        .seed(9)
        .build()
        .unwrap();
    register(&server, &plan).await;
    let fleet = start_fleet(&broker, &root, plan.devices.clone(), None).await;
    wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;

    let run_id = server.start_run(&json!({"all": true})).await.unwrap();
    let converged = i64::try_from(DEVICES - DRIFTED).unwrap();
    wait_decided(db.pool(), &run_id, converged, Duration::from_secs(20)).await;
    let (decided_at_stop, state_at_stop) = run_progress(db.pool(), &run_id).await;
    assert_eq!(
        (decided_at_stop, state_at_stop.as_str()),
        (converged, "running"),
        "the pushes must still be in flight when the database stops"
    );

    tokio::task::block_in_place(|| pg.stop()).unwrap();
    let stopped_at = Instant::now();
    // Poll readiness one request at a time for the whole outage (the
    // database is restarted only after the last answer). Every answer must
    // be "not ready, database down", and the first must come while the
    // database is still down: a probe that hangs until the database is back
    // has told nobody anything.
    let mut answers: Vec<(Duration, u16, Value)> = Vec::new();
    while stopped_at.elapsed() < OUTAGE {
        let asked = stopped_at.elapsed();
        let (status, body) = tokio::time::timeout(Duration::from_secs(10), server.readyz())
            .await
            .unwrap_or_else(|_| {
                panic!("GET /readyz asked {asked:?} after the database stopped hung for 10 s")
            })
            .unwrap();
        assert_eq!(
            (status, &body["database"], &body["ready"]),
            (503, &Value::Bool(false), &Value::Bool(false)),
            "/readyz asked {asked:?} after the database stopped: {body}"
        );
        answers.push((stopped_at.elapsed(), status, body));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first_not_ready = answers[0].0;
    assert!(
        first_not_ready < OUTAGE,
        "the first /readyz answer came {first_not_ready:?} after the database stopped, \
         later than the {OUTAGE:?} outage lasts"
    );
    assert!(
        server.is_running(),
        "the server exited while the database was down\n{}",
        server.log_tail()
    );
    tokio::task::block_in_place(|| pg.restart()).unwrap();
    let outage = stopped_at.elapsed();

    let restarted_at = Instant::now();
    server.wait_ready(Duration::from_secs(30)).await.unwrap();
    let ready_again = restarted_at.elapsed();
    let run = server
        .wait_run_completed(&run_id, Duration::from_secs(60))
        .await
        .unwrap();
    let completed_after = restarted_at.elapsed();
    assert_eq!(
        run["summary"], "40 already converged, 10 provisioned, 0 failed",
        "{run}"
    );

    // Each device got the outcome the plan says, once.
    let outcomes: BTreeMap<String, Option<OutcomeKind>> =
        sqlx::query_as::<_, (String, Option<String>)>(
            "SELECT device_id, outcome FROM run_outcomes WHERE run_id = $1",
        )
        .bind(run_id.parse::<uuid::Uuid>().unwrap())
        .fetch_all(db.pool())
        .await
        .unwrap()
        .into_iter()
        .map(|(id, outcome)| {
            let kind = outcome.map(|o| OutcomeKind::parse(&o).unwrap_or_else(|| panic!("{o}")));
            (id, kind)
        })
        .collect();
    assert_eq!(outcomes.len(), DEVICES);
    for (id, expected) in &plan.expected {
        assert_eq!(outcomes[id.as_str()], Some(expected.kind()), "device {id}");
    }
    // One event per outcome plus the run's boundaries: nothing was written
    // twice by a retried batch, nothing lost.
    let events: BTreeMap<String, i64> = sqlx::query_as::<_, (String, i64)>(
        "SELECT type, count(*) FROM event_log WHERE run_id = $1 GROUP BY type",
    )
    .bind(run_id.parse::<uuid::Uuid>().unwrap())
    .fetch_all(db.pool())
    .await
    .unwrap()
    .into_iter()
    .collect();
    let expected_events: BTreeMap<String, i64> = [
        ("io.idem.device.already_converged", 40),
        ("io.idem.device.provisioned", 10),
        ("io.idem.run.started", 1),
        ("io.idem.run.completed", 1),
    ]
    .into_iter()
    .map(|(t, n)| (t.to_owned(), n))
    .collect();
    assert_eq!(events, expected_events);

    // Reports sent while the database was down were stored once it was
    // back (none was acknowledged without a commit and then lost): without
    // heartbeats, each device's last report is the one that must be there.
    let finals = fleet.states();
    wait_stored_equals_published(db.pool(), &server, &finals, Duration::from_secs(10)).await;

    assert!(
        server.is_running(),
        "the server exited\n{}",
        server.log_tail()
    );
    assert_eq!(
        server.panics(),
        Vec::<String>::new(),
        "panics in the server log"
    );
    println!(
        "Postgres outage test: database down {outage:?}, /readyz said not ready {first_not_ready:?} \
         after the stop ({} answers, all 503), ready again {ready_again:?} and the run completed \
         {completed_after:?} after the restart ({}); test took {:?}",
        answers.len(),
        run["summary"],
        began.elapsed()
    );
    fleet.shutdown().await.unwrap();
}
