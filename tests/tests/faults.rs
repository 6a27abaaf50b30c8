//! Fault tolerance end to end (at-least-once ingest): the real
//! `idem-server` binary as a child process that is SIGKILLed mid-run, and a
//! private PostgreSQL cluster that is stopped mid-run — against a private
//! Mosquitto and simulated devices. Every fault is injected into a service
//! the harness started and owns; nothing else is touched.
//!
//! "Published" is measured, not assumed. The simulator's snapshot `seq` is
//! the seq of the last report a device *built* (handed to its MQTT client),
//! which need not have reached the broker. In the SIGKILL test a
//! [`ReportWitness`], subscribed to every `reported` topic before the devices
//! start, records the highest `seq` the broker accepted per device; once a
//! device is cleanly offline it builds nothing more, and the test first
//! checks that the witness saw exactly the snapshot's seq ("last built" =
//! "last published"), then that Postgres holds exactly that seq. Only the
//! newest report can be checked this way, and only it matters: a report
//! with a lower seq is stale by protocol. Half of the devices leave while
//! the server is down, so their newest report exists only in the server's
//! persistent MQTT session. In the Postgres test devices send no
//! heartbeats, so each device's newest report is the one it sent last —
//! for the drifted ones, while the database was down.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use idem_device_sim::{
    BrokerAddr, DeviceSnapshot, ExpectedOutcome, Fleet, FleetConfig, FleetPlan, OfflineMode, Plan,
    SimDevice,
};
use idem_protocol::{OutcomeKind, TopicRoot};
use idem_tests::{
    raise_fd_limit, PrivateMosquitto, PrivatePostgres, ProcessServer, ReportWitness, TestDatabase,
};
use serde_json::{json, Value};
use sqlx::PgPool;

/// The real server command line, built by this package.
const SERVER_BIN: &str = env!("CARGO_BIN_EXE_idem-server-under-test");

/// Fault tests measure timings (a run must still be in flight when the fault
/// hits); running them one at a time keeps them from starving each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A short unique tag for topic roots and instance names.
fn unique_tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// Registers the plan's devices with the plan's desired spec.
async fn register(server: &ProcessServer, plan: &Plan) {
    let body: Vec<Value> = plan
        .devices
        .iter()
        .map(|d| json!({"id": d.id, "spec": plan.desired_spec}))
        .collect();
    let (status, answer) = server
        .post("/v1/devices", &Value::Array(body))
        .await
        .unwrap();
    assert_eq!(status, 200, "registering devices: {answer}");
}

/// Starts `devices` on the broker (with heartbeats every `heartbeat`, if
/// any) and waits until all are connected.
async fn start_fleet(
    broker: &PrivateMosquitto,
    root: &TopicRoot,
    devices: Vec<SimDevice>,
    heartbeat: Option<Duration>,
) -> Fleet {
    let n = devices.len();
    let mut config = FleetConfig::new(
        BrokerAddr::new(broker.host(), broker.port()),
        root.clone(),
        devices,
    );
    config.report_interval = heartbeat;
    let fleet = Fleet::start(config).unwrap();
    fleet
        .wait_connected(n, Duration::from_secs(30))
        .await
        .unwrap();
    fleet
}

/// Takes every device of `fleet` offline with a clean disconnect (retained
/// `offline`, then DISCONNECT after everything queued before it) and waits
/// until none is connected. Afterwards no device builds another report, so
/// the snapshots' `seq` are final.
async fn take_all_offline(fleet: &Fleet) -> Vec<DeviceSnapshot> {
    let ids: Vec<_> = fleet.device_ids().cloned().collect();
    for id in &ids {
        fleet.take_offline(id, OfflineMode::Clean).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while fleet.connected_count() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} devices still connected 15 s after being taken offline",
            fleet.connected_count()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fleet.states()
}

/// Device id → stored `reported_seq`.
async fn stored_seqs(pool: &PgPool) -> HashMap<String, Option<i64>> {
    sqlx::query_as::<_, (String, Option<i64>)>("SELECT id, reported_seq FROM devices")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Waits until at least `n` devices have a stored report.
async fn wait_reports_stored(pool: &PgPool, n: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let stored = stored_seqs(pool)
            .await
            .values()
            .filter(|s| s.is_some())
            .count();
        if stored >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {stored} of {n} devices have a stored report after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many of a run's targets have an outcome, and the run's state.
async fn run_progress(pool: &PgPool, run_id: &str) -> (i64, String) {
    let id: uuid::Uuid = run_id.parse().unwrap();
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM run_targets WHERE run_id = $1 AND outcome IS NOT NULL), \
                (SELECT state FROM runs WHERE id = $1)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until `run_id` has at least `decided` outcomes stored.
async fn wait_decided(pool: &PgPool, run_id: &str, decided: i64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let (done, state) = run_progress(pool, run_id).await;
        if done >= decided {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "run {run_id} has {done} of the expected {decided} outcomes after {timeout:?} \
             (state {state})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One row of `runs`, as the tests look at it.
#[derive(Debug, sqlx::FromRow)]
struct RunRow {
    id: uuid::Uuid,
    trigger: String,
    state: String,
    target_count: i32,
    already_converged: i32,
    provisioned: i32,
    failed: i32,
    skipped: i32,
    superseded: i32,
}

impl RunRow {
    fn decided(&self) -> i32 {
        self.already_converged + self.provisioned + self.failed + self.skipped + self.superseded
    }
}

/// Waits until every run in `runs` is `completed`; returns them all.
async fn wait_all_runs_completed(
    pool: &PgPool,
    server: &ProcessServer,
    timeout: Duration,
) -> Vec<RunRow> {
    let deadline = Instant::now() + timeout;
    loop {
        let runs: Vec<RunRow> = sqlx::query_as(
            "SELECT id, trigger, state, target_count, already_converged, provisioned, failed, \
                    skipped, superseded FROM runs ORDER BY started_at",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        if runs.iter().all(|r| r.state == "completed") {
            return runs;
        }
        assert!(
            Instant::now() < deadline,
            "runs still unfinished {timeout:?} after the restart: {:#?}\n--- server log ---\n{}",
            runs.iter()
                .filter(|r| r.state != "completed")
                .collect::<Vec<_>>(),
            server.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the witness has seen, for every device of `fleet`, a report
/// with a higher seq than `before` holds for it: each device published again.
async fn wait_each_published_since(
    witness: &ReportWitness,
    fleet: &Fleet,
    before: &HashMap<String, u64>,
    when: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        witness.check_intact().unwrap();
        let seen = witness.highest();
        let silent: Vec<&str> = fleet
            .device_ids()
            .map(|id| id.as_str())
            .filter(|id| seen.get(*id) <= before.get(*id))
            .collect();
        if silent.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} devices published nothing {when} within 15 s, e.g. {:?}",
            silent.len(),
            &silent[..silent.len().min(10)]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the witness has seen, for every device, exactly the seq of
/// its last built report: every report a device built reached the broker.
async fn wait_witness_saw_final(witness: &ReportWitness, finals: &[DeviceSnapshot]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        witness.check_intact().unwrap();
        let seen = witness.highest();
        let missing: Vec<String> = finals
            .iter()
            .filter(|d| seen.get(d.id.as_str()) != Some(&d.seq))
            .map(|d| {
                format!(
                    "{}: built up to {}, broker delivered up to {:?}",
                    d.id,
                    d.seq,
                    seen.get(d.id.as_str())
                )
            })
            .collect();
        if missing.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the simulator built reports that never reached the broker (a harness or \
             simulator fault, not the server's) for {} devices, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(10)]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until Postgres holds, for every device, exactly the seq of its last
/// published report; fails listing the devices that differ.
async fn wait_stored_equals_published(
    pool: &PgPool,
    server: &ProcessServer,
    finals: &[DeviceSnapshot],
    timeout: Duration,
) {
    let deadline = Instant::now() + timeout;
    loop {
        let stored = stored_seqs(pool).await;
        let wrong: Vec<String> = finals
            .iter()
            .filter_map(|d| {
                let have = stored.get(d.id.as_str()).copied().flatten();
                let want = i64::try_from(d.seq).unwrap();
                (have != Some(want)).then(|| format!("{}: published {want}, stored {have:?}", d.id))
            })
            .collect();
        if wrong.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} devices do not have their last published report stored after \
             {timeout:?}, e.g. {:?}\n--- server log ---\n{}",
            wrong.len(),
            finals.len(),
            &wrong[..wrong.len().min(10)],
            server.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_while_200_devices_report_loses_no_report_and_leaves_no_run_unfinished() {
    const DEVICES: usize = 200;
    const DRIFTED: usize = 20;
    const HEARTBEAT: Duration = Duration::from_millis(250);
    let _serial = SERIAL.lock().await;
    let began = Instant::now();
    raise_fd_limit().unwrap();
    let broker = PrivateMosquitto::start().unwrap();
    let db = TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let tag = unique_tag();
    let root = TopicRoot::new(format!("idem-faults/{tag}")).unwrap();
    // Fixed for the whole test: the restarted process must resume the MQTT
    // session `idem-kill-{tag}` that holds what was published meanwhile.
    let instance = format!("kill-{tag}");
    let witness = ReportWitness::start(&broker, &root).await.unwrap();
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &instance,
        &[],
    )
    .await
    .unwrap();

    // The drifted devices apply a push only after 2–3 s, so the run is
    // still in flight when the server dies.
    let plan = FleetPlan::new("kill-", DEVICES)
        .drifted(DRIFTED)
        .apply_latency(Duration::from_secs(2), Duration::from_secs(3))
        .seed(5)
        .build()
        .unwrap();
    register(&server, &plan).await;
    // Half of the converged devices leave (cleanly) while the server is
    // down, so their last report is one the server can only get from its
    // persistent session. The rest, with every drifted device, keep
    // reporting across the restart.
    let (mut leaving, mut staying) = (Vec::new(), Vec::new());
    for device in plan.devices.iter().cloned() {
        let converged = plan.expected(&device.id) == Some(ExpectedOutcome::AlreadyConverged);
        if converged && leaving.len() < DEVICES / 2 {
            leaving.push(device);
        } else {
            staying.push(device);
        }
    }
    let leaving_fleet = start_fleet(&broker, &root, leaving, Some(HEARTBEAT)).await;
    let staying_fleet = start_fleet(&broker, &root, staying, Some(HEARTBEAT)).await;
    wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;

    let run_id = server.start_run(&json!({"all": true})).await.unwrap();
    let converged = i64::try_from(DEVICES - DRIFTED).unwrap();
    wait_decided(db.pool(), &run_id, converged, Duration::from_secs(20)).await;
    let published_before_kill = witness.reports();
    let highest_at_kill = witness.highest();

    server.kill().unwrap();
    let killed_at = Instant::now();
    let (decided_at_kill, state_at_kill) = run_progress(db.pool(), &run_id).await;
    assert_eq!(
        state_at_kill, "running",
        "the run finished before the kill: this test did not crash the server mid-run"
    );
    assert!(
        decided_at_kill < i64::try_from(DEVICES).unwrap(),
        "{decided_at_kill}"
    );

    // Every leaving device publishes while the server is down: its newest
    // report then exists only in the server's persistent session.
    wait_each_published_since(
        &witness,
        &leaving_fleet,
        &highest_at_kill,
        "while the server was down",
    )
    .await;
    let leaving_final = take_all_offline(&leaving_fleet).await;
    let published_while_down = witness.reports() - published_before_kill;
    for device in &leaving_final {
        let at_kill = highest_at_kill.get(device.id.as_str()).copied();
        assert!(
            Some(device.seq) > at_kill,
            "{} published nothing while the server was down ({:?} at the kill, {} now)",
            device.id,
            at_kill,
            device.seq
        );
    }

    let restarting = Instant::now();
    server.restart().await.unwrap();
    let restart_to_ready = restarting.elapsed();
    let outage = killed_at.elapsed();

    // No run stays unfinished: the crashed one is resumed at start-up (and
    // any run the new process starts itself must end too).
    let runs = wait_all_runs_completed(db.pool(), &server, Duration::from_secs(60)).await;
    let resumed_done = killed_at.elapsed();
    let crashed_run = runs
        .iter()
        .find(|r| r.id.to_string() == run_id)
        .expect("the run started before the kill");
    assert_eq!(crashed_run.target_count, i32::try_from(DEVICES).unwrap());
    assert_eq!(
        crashed_run.decided(),
        crashed_run.target_count,
        "every target has exactly one outcome: {crashed_run:?}"
    );
    assert_eq!(crashed_run.failed, 0, "{crashed_run:?}");
    let undecided: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM run_targets WHERE outcome IS NULL AND run_id = $1",
    )
    .bind(crashed_run.id)
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(undecided, 0);

    // Heartbeats keep flowing into the restarted server (each staying
    // device publishes again), then the remaining devices leave too and
    // every seq is final.
    let highest_after_restart = witness.highest();
    wait_each_published_since(
        &witness,
        &staying_fleet,
        &highest_after_restart,
        "after the restart",
    )
    .await;
    let staying_final = take_all_offline(&staying_fleet).await;
    let finals: Vec<DeviceSnapshot> = leaving_final.into_iter().chain(staying_final).collect();
    assert_eq!(finals.len(), DEVICES);
    wait_witness_saw_final(&witness, &finals).await;
    wait_stored_equals_published(db.pool(), &server, &finals, Duration::from_secs(30)).await;

    assert!(
        server.is_running(),
        "the restarted server exited\n{}",
        server.log_tail()
    );
    assert_eq!(
        server.panics(),
        Vec::<String>::new(),
        "panics in the server log"
    );
    assert_eq!(witness.invalid(), 0);
    println!(
        "SIGKILL test: outage {outage:?} (restart to ready {restart_to_ready:?}), \
         {published_while_down} reports published while down, crashed run resumed and all \
         {} runs ({:?}) completed {resumed_done:?} after the kill (crashed run: {} already \
         converged, {} provisioned), {} reports seen in total, test took {:?}",
        runs.len(),
        runs.iter().map(|r| r.trigger.as_str()).collect::<Vec<_>>(),
        crashed_run.already_converged,
        crashed_run.provisioned,
        witness.reports(),
        began.elapsed()
    );
    leaving_fleet.shutdown().await;
    staying_fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_postgres_mid_run_makes_the_server_not_ready_and_the_run_still_completes_with_exact_counts(
) {
    const DEVICES: usize = 50;
    const DRIFTED: usize = 10;
    /// How long the database stays down.
    const OUTAGE: Duration = Duration::from_secs(3);
    let _serial = SERIAL.lock().await;
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
            "SELECT device_id, outcome FROM run_targets WHERE run_id = $1",
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
        "SELECT type, count(*) FROM events WHERE run_id = $1 GROUP BY type",
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
    fleet.shutdown().await;
}

/// The guarantee "a report is acknowledged on MQTT only after the batch that
/// holds it has committed", checked where it matters: the server receives
/// reports it cannot commit (another client holds the devices table), the
/// devices then **stop** reporting, and the server is SIGKILLed before any
/// commit. After the restart, every report the broker accepted (and
/// PUBACKed to its device) must be stored: it can only come from the
/// server's persistent session, which keeps exactly the unacknowledged
/// messages. An ingest that acknowledged first would have lost them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_the_broker_accepted_survive_a_server_killed_before_it_could_store_them() {
    const DEVICES: usize = 40;
    let _serial = SERIAL.lock().await;
    raise_fd_limit().unwrap();
    let broker = PrivateMosquitto::start().unwrap();
    let db = TestDatabase::create_with(&idem_server::MIGRATOR)
        .await
        .unwrap();
    let tag = unique_tag();
    let root = TopicRoot::new(format!("idem-faults/{tag}")).unwrap();
    let instance = format!("ack-{tag}");
    let witness = ReportWitness::start(&broker, &root).await.unwrap();
    let mut server = ProcessServer::start(
        Path::new(SERVER_BIN),
        db.url(),
        &broker.url(),
        &root,
        &instance,
        &[("IDEM_STARTUP_RECONCILE", "false")],
    )
    .await
    .unwrap();
    let plan = FleetPlan::new("ack-", DEVICES).seed(9).build().unwrap();
    register(&server, &plan).await;
    let fleet = start_fleet(&broker, &root, plan.devices.clone(), None).await;
    wait_reports_stored(db.pool(), DEVICES, Duration::from_secs(30)).await;
    let api = server.api();
    let applied_before = api
        .metric("idem_reports_total{result=\"applied\"}")
        .await
        .unwrap();

    // From here on no report can commit.
    let mut blocker = db.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE devices IN EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    for id in fleet.device_ids() {
        fleet.request_report(id).unwrap();
    }
    // The devices stop reporting; each one's newest report is final.
    let finals = take_all_offline(&fleet).await;
    wait_witness_saw_final(&witness, &finals).await;
    // The server has taken reports into a batch (it classifies, then waits
    // to commit).
    let deadline = Instant::now() + Duration::from_secs(10);
    while api
        .metric("idem_reports_total{result=\"applied\"}")
        .await
        .unwrap()
        <= applied_before
    {
        assert!(
            Instant::now() < deadline,
            "the server never received the new reports\n{}",
            server.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stored_before_kill = stored_seqs(db.pool()).await;

    server.kill().unwrap();
    blocker.rollback().await.unwrap();
    // Nothing of the new reports was committed before the kill.
    for device in &finals {
        let stored = stored_before_kill
            .get(device.id.as_str())
            .copied()
            .flatten();
        assert!(
            stored.is_some_and(|s| (s as u64) < device.seq),
            "{}: stored {stored:?} before the kill, final {}",
            device.id,
            device.seq
        );
    }
    server.restart().await.unwrap();
    wait_stored_equals_published(db.pool(), &server, &finals, Duration::from_secs(20)).await;
    assert_eq!(server.panics(), Vec::<String>::new());
    fleet.shutdown().await;
}
