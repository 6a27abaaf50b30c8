//! Three instances on one broker and one database, 2,000 devices, a
//! fleet-wide desired change posted to an instance without the engine; the
//! instance carrying the run is SIGKILLed while pushes are in flight and
//! never restarted. Another takes the engine over and completes the run:
//! one outcome per device, every event on MQTT once, every report the broker
//! accepted stored, a gap-free SSE stream on a survivor, only the new
//! generation pushed, no deadlock.

use std::time::{Duration, Instant};

use idem_device_sim::{DeviceSnapshot, FleetPlan};
use idem_tests::{ProcessServer, PushWitness, ReportWitness, SseClient};
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::{
    event_witness, holder_of, private_services, register, run_progress, start_fleet, start_servers,
    take_all_offline, wait_decided, wait_each_published_since, wait_stored_equals_published,
    wait_witness_saw_final, SERIAL,
};

const DEVICES: usize = 2_000;
const LEASE: Duration = Duration::from_secs(3);
const PUSH_TIMEOUT: Duration = Duration::from_secs(10);
const HEARTBEAT: Duration = Duration::from_millis(250);

/// Returns just after the engine lease's holder renewed it.
async fn just_renewed(pool: &PgPool) {
    let renewed = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT renewed_at FROM leases WHERE name = 'engine'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let before = renewed().await;
    let deadline = Instant::now() + LEASE;
    while renewed().await == before {
        assert!(
            Instant::now() < deadline,
            "the engine lease was not renewed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// How long after `killed_at` the run's decided count first grew past what
/// the database held just after the kill: the new owner's first decision.
fn first_decision_after(
    pool: PgPool,
    run_id: String,
    killed_at: Instant,
) -> tokio::task::JoinHandle<Duration> {
    tokio::spawn(async move {
        let decided = || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM run_outcomes WHERE run_id = $1::uuid AND outcome IS NOT NULL",
            )
            .bind(&run_id)
            .fetch_one(&pool)
            .await
            .unwrap()
        };
        let at_kill = decided().await;
        loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if decided().await > at_kill {
                return killed_at.elapsed();
            }
            assert!(
                killed_at.elapsed() < Duration::from_secs(60),
                "no decision after the kill"
            );
        }
    })
}

async fn deadlocks(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_instance_carrying_a_run_killed_and_never_restarted_loses_nothing() {
    let _serial = idem_tests::deadline::turn(&SERIAL, "fault tests")
        .await
        .unwrap();
    let began = Instant::now();
    let (broker, db, tag, root) = private_services("idem-trio").await;
    let group = format!("trio{tag}");
    let lease = format!("{}ms", LEASE.as_millis());
    let push_timeout = format!("{}s", PUSH_TIMEOUT.as_secs());
    let env = [
        ("IDEM_SHARE_GROUP", group.as_str()),
        ("IDEM_INSTANCE_LEASE", lease.as_str()),
        ("IDEM_PUSH_TIMEOUT", push_timeout.as_str()),
    ];
    let reports = ReportWitness::start(&broker, &root).await.unwrap();
    let events = event_witness(&broker, &root).await;
    let mut servers = start_servers(&["a", "b", "c"], (&broker, &db, &tag, &root), &env).await;
    let deadlocks_before = deadlocks(db.pool()).await;
    // Every device runs v1 and applies a push after 1–3 s, so the run is
    // in flight when its carrier dies.
    let plan = FleetPlan::new("trio-", DEVICES)
        .apply_latency(Duration::from_secs(1), Duration::from_secs(3))
        .seed(22)
        .build()
        .unwrap();
    register(&servers[0], &plan).await;
    let mut v2 = plan.desired_spec.clone();
    v2["fleet_change"] = json!("v2");
    // A few devices run v2 already (already converged in the run) and
    // report every 250 ms; right after the kill they report once more and
    // leave, so a third of their last reports exist only in the dead
    // instance's session.
    let (mut leaving, staying): (Vec<_>, Vec<_>) = plan
        .devices
        .iter()
        .cloned()
        .partition(|d| d.id.as_str() < "trio-00150");
    for device in &mut leaving {
        device.spec = v2.clone();
    }
    let leaving_fleet = start_fleet(&broker, &root, leaving, Some(HEARTBEAT)).await;
    let fleet = start_fleet(&broker, &root, staying, None).await;
    crate::wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(60)).await;

    let owner = holder_of(&servers, "engine", Duration::from_secs(10)).await;
    let poster = (owner + 1) % 3;
    let watcher = (owner + 2) % 3;
    let pushes = PushWitness::start(&broker, &root).await.unwrap();
    let last_event: i64 = sqlx::query_scalar("SELECT coalesce(max(sequence), 0) FROM event_log")
        .fetch_one(db.pool())
        .await
        .unwrap();
    let mut sse = SseClient::connect(
        &servers[watcher].url("/v1/events"),
        servers[watcher].token(),
        Some(last_event),
    )
    .await
    .unwrap();
    let (status, body) = servers[poster]
        .post("/v1/desired", &json!({"all": true, "spec": v2}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let run_id = body["run_id"].as_str().unwrap().to_owned();
    wait_decided(db.pool(), &run_id, 200, Duration::from_secs(30)).await;

    // Killed just after it renewed the engine lease: the longest the
    // lease then lives on, so the takeover bound is tried at its worst.
    just_renewed(db.pool()).await;
    servers[owner].kill().unwrap();
    let killed_at = Instant::now();
    let first_decision = first_decision_after(db.pool().clone(), run_id.clone(), killed_at);
    let highest_at_kill = reports.highest();
    wait_each_published_since(&reports, &leaving_fleet, &highest_at_kill, "after the kill").await;
    let leaving_final = take_all_offline(&leaving_fleet).await;
    let left_after = killed_at.elapsed();
    assert!(
        left_after < LEASE,
        "the leaving devices took {left_after:?} to report and leave: their last reports may \
         not have waited in the dead instance's session"
    );
    let (decided_at_kill, state_at_kill) = run_progress(db.pool(), &run_id).await;
    assert_eq!(state_at_kill, "running", "the run ended before the kill");
    let survivors: Vec<ProcessServer> = servers
        .into_iter()
        .enumerate()
        .filter_map(|(i, s)| (i != owner).then_some(s))
        .collect();
    let new_owner = holder_of(&survivors, "engine", LEASE * 3).await;
    let takeover = killed_at.elapsed();
    let deadline = killed_at + LEASE + PUSH_TIMEOUT + Duration::from_secs(30);
    let run = loop {
        let (_, run) = survivors[new_owner]
            .get(&format!("/v1/runs/{run_id}"))
            .await
            .unwrap();
        if run["state"] == "completed" {
            break run;
        }
        assert!(
            Instant::now() < deadline,
            "the run is not completed {:?} after the kill: {run}",
            killed_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let completed_after = killed_at.elapsed();
    // Taken over within the configured lease: from the kill to the new
    // owner's first decision (an outcome the dead one did not write).
    let takeover_decided = first_decision.await.unwrap();
    assert!(
        takeover_decided <= LEASE,
        "the new owner decided first {takeover_decided:?} after the kill; the lease is {LEASE:?}"
    );

    // Exactly one outcome per device, and the summary says so.
    let counts = &run["counts"];
    let total: u64 = [
        "already_converged",
        "provisioned",
        "failed",
        "skipped",
        "superseded",
    ]
    .iter()
    .map(|k| counts[k].as_u64().unwrap())
    .sum();
    assert_eq!(total, DEVICES as u64, "{run}");
    assert_eq!(run["target_count"], DEVICES, "{run}");
    assert_eq!(counts["failed"], 0, "{run}");
    // Honest outcomes across the takeover: the 150 devices that ran v2 before
    // the change are the only ones already converged; one the dead instance
    // pushed, and which applied the push before the survivor looked, counts
    // provisioned.
    let ran_v2_before = DEVICES as u64 - fleet.len() as u64;
    assert_eq!(counts["already_converged"], ran_v2_before, "{run}");
    assert_eq!(counts["provisioned"], fleet.len() as u64, "{run}");
    let undecided: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM run_targets WHERE run_id = $1::uuid AND outcome IS NULL",
    )
    .bind(&run_id)
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(undecided, 0);

    // Every report the broker accepted is stored, those it had queued for
    // the dead instance included.
    let finals: Vec<DeviceSnapshot> = leaving_final
        .into_iter()
        .chain(take_all_offline(&fleet).await)
        .collect();
    assert_eq!(finals.len(), DEVICES);
    wait_witness_saw_final(&reports, &finals).await;
    wait_stored_equals_published(db.pool(), &survivors[0], &finals, Duration::from_secs(30)).await;

    // The survivor's SSE stream: from the change to the run's completion,
    // every id once and none skipped.
    let sse_ids: Vec<i64> = sse
        .read_until(
            Duration::from_secs(30),
            &format!("the run.completed event of run {run_id}"),
            |message| {
                let event: Value = serde_json::from_str(&message.data).unwrap();
                event["type"] == "io.idem.run.completed" && event["runid"] == run_id.as_str()
            },
        )
        .await
        .unwrap()
        .iter()
        .map(|message| message.id.expect("an SSE event without an id"))
        .collect();
    let expected: Vec<i64> = (last_event + 1..=last_event + sse_ids.len() as i64).collect();
    assert_eq!(
        sse_ids, expected,
        "the survivor's SSE stream has a gap or a repeat"
    );

    // Every event reached MQTT exactly once (the relay lease moves to a
    // survivor within its lease); each device's outcome once.
    let deadline = Instant::now() + LEASE * 3;
    loop {
        let missing = {
            let published = events.lock().unwrap();
            sse_ids
                .iter()
                .filter(|id| !published.by_id.contains_key(id))
                .count()
        };
        if missing == 0 || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Room for a repeat to show.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (by_id, outcomes) = {
        let published = events.lock().unwrap();
        assert_eq!(
            published.lost, None,
            "the event witness lost its connection"
        );
        (published.by_id.clone(), published.outcomes.clone())
    };
    let repeated: Vec<_> = by_id.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        repeated.is_empty(),
        "events on MQTT more than once: {repeated:?}"
    );
    for id in &sse_ids {
        assert!(by_id.contains_key(id), "event {id} never reached MQTT");
    }
    let outcomes: Vec<_> = outcomes
        .iter()
        .filter(|((run, _), _)| *run == run_id)
        .collect();
    assert_eq!(outcomes.len(), DEVICES, "outcome events of the run on MQTT");
    assert!(outcomes.iter().all(|(_, n)| **n == 1));

    // Only the new generation was pushed, whoever pushed it.
    let generations: std::collections::BTreeSet<u64> =
        pushes.pushes().unwrap().keys().map(|(_, g)| *g).collect();
    assert_eq!(generations, [2].into(), "generations pushed");
    assert_eq!(deadlocks(db.pool()).await, deadlocks_before, "deadlocks");
    // A drain is counted once it ended (a second without messages, then
    // the session removed), which may come after the run completed.
    let counted = |name: &'static str| {
        let survivors = &survivors;
        async move {
            let mut sum = 0.0;
            for survivor in survivors {
                let metrics = survivor.api().metrics().await.unwrap();
                sum += idem_device_sim::api::metric_value(&metrics, name)
                    .unwrap()
                    .unwrap_or(0.0);
            }
            sum
        }
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while counted("idem_sessions_drained_total").await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "no survivor finished draining the dead instance's session"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained = counted("idem_drained_messages_total").await;
    for survivor in &survivors {
        assert_eq!(survivor.panics(), Vec::<String>::new());
    }
    assert!(
        drained > 0.0,
        "no survivor drained a message from the dead instance's session: the reports the \
         leaving devices sent after the kill never waited there, so that path went untested"
    );
    println!(
        "three instances, {DEVICES} devices: the carrier was killed with {decided_at_kill} \
         outcomes decided; the engine was taken over {takeover:?} after the kill (lease {LEASE:?}) \
         and its first decision came {takeover_decided:?} after it \
         and the run completed {completed_after:?} after it ({}); {} events relayed once each; \
         {drained} messages drained from the dead instance's session; test took {:?}",
        run["summary"],
        sse_ids.len(),
        began.elapsed()
    );
    fleet.shutdown().await.unwrap();
    leaving_fleet.shutdown().await.unwrap();
}
