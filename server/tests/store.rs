//! Store tests against the real PostgreSQL (`DATABASE_URL`, set by
//! scripts/test): batched writes, no-op skipping, gap-free event sequences
//! handed out in commit order.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_protocol::{DeviceId, Generation, SpecDigest};
use idem_server::store::cache::FleetCache;
use idem_server::store::cache::{DesiredState, FleetChange};
use idem_server::store::devices::{self, Registration, ReportRow};
use idem_server::store::events;
use idem_server::store::{DeviceTx, DeviceWriter};
use serde_json::json;
use sqlx::PgPool;

fn id(name: &str) -> DeviceId {
    DeviceId::parse(name).unwrap()
}

/// A device writer of its own, as another server process would have.
fn writer(pool: &PgPool) -> DeviceWriter {
    DeviceWriter::new(pool.clone(), std::sync::Arc::new(FleetCache::default()), 0)
}

/// Returns `task` once it waits on a database lock; fails with `finished`'s
/// message if it finishes instead (it was not held back), or after 10 s.
async fn waits_on_a_lock<T: std::fmt::Display>(
    pool: &PgPool,
    task: tokio::task::JoinHandle<T>,
    finished: impl Fn(T) -> String,
) -> tokio::task::JoinHandle<T> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return task;
        }
        if task.is_finished() {
            panic!("{}", finished(task.await.unwrap()));
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the second writer neither waited nor finished"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

async fn register(pool: &PgPool, ids: &[&str]) {
    let writer = writer(pool);
    let mut tx = writer.begin().await.unwrap();
    let registrations: Vec<Registration> = ids
        .iter()
        .map(|name| Registration {
            id: id(name),
            labels: None,
        })
        .collect();
    devices::register(&mut tx, &registrations).await.unwrap();
    tx.commit("test writes").await.unwrap();
}

fn report(id: &str, seq: u64, firmware: &str) -> ReportRow {
    ReportRow {
        id: self::id(id),
        seq,
        spec: json!({ "firmware": firmware }),
        digest: format!("digest-{firmware}"),
        generation: None,
        error_generation: None,
        error: None,
        health: None,
    }
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn the_desired_generation_increases_only_when_the_spec_changes(pool: PgPool) {
    register(&pool, &["a", "b"]).await;
    let ids = vec![id("a"), id("b")];
    let writer = writer(&pool);
    let mut tx = writer.begin().await.unwrap();
    let first = devices::set_desired(&mut tx, &ids, &json!({"v": 1}), "d1")
        .await
        .unwrap();
    let same = devices::set_desired(&mut tx, &ids, &json!({"v": 1}), "d1")
        .await
        .unwrap();
    let changed = devices::set_desired(&mut tx, &ids[..1], &json!({"v": 2}), "d2")
        .await
        .unwrap();
    tx.commit("test writes").await.unwrap();
    assert_eq!(
        first.iter().map(|w| w.generation).collect::<Vec<_>>(),
        vec![Generation(1), Generation(1)]
    );
    assert!(same.is_empty(), "an unchanged spec writes nothing");
    assert_eq!(changed.len(), 1);
    assert_eq!(changed[0].generation, Generation(2));
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn a_report_with_a_lower_or_equal_seq_never_overwrites_a_newer_one(pool: PgPool) {
    register(&pool, &["a"]).await;
    for (seq, firmware, expect_changed) in
        [(5, "new", 1), (5, "dup", 0), (4, "old", 0), (6, "newer", 1)]
    {
        let writer = writer(&pool);
        let mut tx = writer.begin().await.unwrap();
        let changed = devices::apply_reports(&mut tx, &[&report("a", seq, firmware)], false)
            .await
            .unwrap();
        tx.commit("test writes").await.unwrap();
        assert_eq!(changed, expect_changed, "seq {seq}");
    }
    let row = devices::get(&pool, &id("a")).await.unwrap().unwrap();
    assert_eq!(row.reported_seq, Some(6));
    assert_eq!(row.reported_spec, Some(json!({"firmware": "newer"})));
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn reports_from_unregistered_devices_are_stored_only_with_auto_register(pool: PgPool) {
    let writer = writer(&pool);
    let mut tx = writer.begin().await.unwrap();
    assert_eq!(
        devices::apply_reports(&mut tx, &[&report("new", 1, "x")], false)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        devices::apply_reports(&mut tx, &[&report("new", 1, "x")], true)
            .await
            .unwrap(),
        1
    );
    tx.commit("test writes").await.unwrap();
    assert!(devices::get(&pool, &id("new")).await.unwrap().is_some());
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn event_sequences_stay_gap_free_when_a_transaction_rolls_back(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(events::reserve_sequences(&mut tx, 3).await.unwrap(), 1);
    tx.commit().await.unwrap();

    let mut rolled_back = pool.begin().await.unwrap();
    assert_eq!(
        events::reserve_sequences(&mut rolled_back, 10)
            .await
            .unwrap(),
        4
    );
    rolled_back.rollback().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        events::reserve_sequences(&mut tx, 1).await.unwrap(),
        4,
        "the rolled-back range is reused"
    );
    tx.commit().await.unwrap();
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn a_second_event_writer_waits_for_the_first_to_commit_so_sequences_commit_in_order(
    pool: PgPool,
) {
    let mut first = pool.begin().await.unwrap();
    assert_eq!(events::reserve_sequences(&mut first, 2).await.unwrap(), 1);
    // Were the second writer not held back, it could commit sequence 3
    // while 1 and 2 are still invisible, and a reader tailing the log past
    // 3 (the relay, an SSE client) would never see them.
    let second = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let got = events::reserve_sequences(&mut tx, 1).await.unwrap();
            tx.commit().await.unwrap();
            got
        }
    });
    let second = waits_on_a_lock(&pool, second, |got| {
        format!("the second writer reserved sequence {got} while the first had not committed")
    })
    .await;
    first.commit().await.unwrap();
    assert_eq!(second.await.unwrap(), 3);
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn a_device_writer_of_another_process_waits_until_the_first_commits(pool: PgPool) {
    register(&pool, &["a"]).await;
    let ours = writer(&pool);
    let mut first = ours.begin().await.unwrap();
    devices::set_desired(&mut first, &[id("a")], &json!({"v": 1}), "d1")
        .await
        .unwrap();
    // A second server process has its own writer: only the database-wide
    // lock keeps its transaction from interleaving with ours.
    let second = tokio::spawn({
        let pool = pool.clone();
        async move {
            let theirs = writer(&pool);
            let tx = theirs.begin().await.unwrap();
            let visible: i64 =
                sqlx::query_scalar("SELECT desired_generation FROM devices WHERE id = 'a'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            tx.commit("the other process's write").await.unwrap();
            visible
        }
    });
    let second = waits_on_a_lock(&pool, second, |got| {
        format!("the other process's writer began while ours was open (it saw generation {got})")
    })
    .await;
    first.commit("our write").await.unwrap();
    assert_eq!(
        second.await.unwrap(),
        1,
        "the other process's writer began after our commit"
    );
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn events_with_backslashes_tabs_line_breaks_and_copy_markers_in_their_data_are_stored_exactly(
    pool: PgPool,
) {
    use idem_server::events::{finalize, EventDraft, EventType};
    // Events are written with COPY's text format, where a raw tab ends a
    // field, a raw newline ends a row and backslash sequences mean
    // something: a device's refusal message may hold any of them.
    let awkward = "tab\there\nnew line \\ backslash \\N \\. \r \"quoted\" é 🚀 \u{1}";
    let data = json!({ "reason": awkward, "nested": { "list": [awkward, "\\t"] } });
    let drafts = vec![
        EventDraft {
            event_type: EventType::Device(idem_protocol::OutcomeKind::Failed),
            subject: "dev-awkward".to_owned(),
            run_id: Some(uuid::Uuid::now_v7()),
            generation: Some(Generation(7)),
            data: data.clone(),
        },
        EventDraft {
            event_type: EventType::RunStarted,
            subject: "run-plain".to_owned(),
            run_id: None,
            generation: None,
            data: json!({}),
        },
    ];
    let mut tx = pool.begin().await.unwrap();
    let first = events::reserve_sequences(&mut tx, 2).await.unwrap();
    let rows = finalize(drafts, first, "/idem/test", chrono::Utc::now()).unwrap();
    events::insert(&mut tx, &rows).await.unwrap();
    tx.commit().await.unwrap();

    let stored = idem_server::events::log::read(&pool, 0, &events::EventFilter::default(), 10)
        .await
        .unwrap();
    assert_eq!(stored.len(), 2);
    for (row, stored) in rows.iter().zip(&stored) {
        assert_eq!(stored.sequence, row.sequence);
        assert_eq!(stored.event_type, row.event_type);
        assert_eq!(stored.subject, row.subject);
        assert_eq!(stored.run_id, row.run_id);
        assert_eq!(stored.cloudevent, row.cloudevent);
    }
    assert_eq!(stored[0].cloudevent["data"], data);
    let time: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT time FROM events WHERE sequence = $1")
            .bind(rows[0].sequence)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(time.timestamp_micros(), rows[0].time.timestamp_micros());
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn events_spanning_many_copy_chunks_are_all_stored_in_sequence(pool: PgPool) {
    // ~200 B each: 5,000 of them are several of COPY's 256 KiB chunks.
    append_events(&pool, 5_000, chrono::Duration::zero()).await;
    let (count, first, last, subjects): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), min(sequence), max(sequence), count(DISTINCT subject) FROM events",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((count, first, last, subjects), (5_000, 1, 5_000, 5_000));
}

async fn append_events(pool: &PgPool, count: usize, age: chrono::Duration) {
    use idem_server::events::{finalize, EventDraft, EventType};
    let drafts = (0..count)
        .map(|i| EventDraft {
            event_type: EventType::RunStarted,
            subject: format!("run-{i}"),
            run_id: None,
            generation: None,
            data: json!({}),
        })
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let first = events::reserve_sequences(&mut tx, count).await.unwrap();
    let rows = finalize(drafts, first, "/idem/test", chrono::Utc::now() - age).unwrap();
    events::insert(&mut tx, &rows).await.unwrap();
    tx.commit().await.unwrap();
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn pruning_keeps_unrelayed_events_and_removes_old_or_excess_ones(pool: PgPool) {
    append_events(&pool, 5, chrono::Duration::days(10)).await; // sequences 1..=5, old
    append_events(&pool, 5, chrono::Duration::zero()).await; // 6..=10, fresh
    let week = std::time::Duration::from_secs(7 * 86_400);

    // Only events up to the relay's cursor may go: 1..=3 of the old ones.
    assert_eq!(events::prune(&pool, 3, week, 1_000).await.unwrap(), 3);
    assert_eq!(events::oldest_sequence(&pool).await.unwrap(), Some(4));
    // Everything relayed: the rest of the old ones, then the count limit.
    assert_eq!(events::prune(&pool, 10, week, 1_000).await.unwrap(), 2);
    assert_eq!(events::prune(&pool, 10, week, 3).await.unwrap(), 2);
    assert_eq!(events::oldest_sequence(&pool).await.unwrap(), Some(8));
    assert_eq!(events::last_sequence(&pool).await.unwrap(), 10);
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn a_write_whose_commit_fails_leaves_the_cache_as_the_database_has_it(pool: PgPool) {
    let ours = writer(&pool);
    let device = id("a");
    let mut tx = ours.begin().await.unwrap();
    register_mirrored(&mut tx, &device).await;
    set_desired(&mut tx, &device, 1).await;
    tx.commit("the first write").await.unwrap();
    let desired = |writer: &DeviceWriter| {
        writer
            .cache()
            .get(&device)
            .and_then(|entry| entry.desired.map(|d| d.generation))
    };
    assert_eq!(
        desired(&ours),
        Some(Generation(1)),
        "a committed write is mirrored"
    );

    // Every statement of the write succeeds; PostgreSQL refuses the commit.
    for statement in [
        "CREATE FUNCTION refuse_commit() RETURNS trigger LANGUAGE plpgsql \
         AS $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$",
        "CREATE CONSTRAINT TRIGGER refused_at_commit AFTER INSERT ON device_changes \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_commit()",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let mut tx = ours.begin().await.unwrap();
    set_desired(&mut tx, &device, 2).await;
    let refused = tx.commit("a write PostgreSQL refuses at commit").await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| format!("{e:?}").contains("refused at commit")),
        "{refused:?}"
    );

    let stored: Option<i64> =
        sqlx::query_scalar("SELECT desired_generation FROM devices WHERE id = 'a'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(stored, Some(1), "the database kept nothing of the write");
    assert_eq!(
        desired(&ours),
        Some(Generation(1)),
        "the cache mirrored a write that never committed"
    );
}

/// A registration of `device` as the API writes it: the row, and the cache
/// change to mirror once it committed.
async fn register_mirrored(tx: &mut DeviceTx<'_>, device: &DeviceId) {
    let registration = Registration {
        id: device.clone(),
        labels: None,
    };
    devices::register(tx, &[registration]).await.unwrap();
    tx.mirror([FleetChange::Registered(device.clone())]);
}

/// A desired change of `device` as the API writes it: the row, and the
/// cache change to mirror once it committed.
async fn set_desired(tx: &mut DeviceTx<'_>, device: &DeviceId, version: u64) {
    let spec = json!({ "v": version });
    let digest = SpecDigest::of(&spec);
    let rows = devices::set_desired(tx, std::slice::from_ref(device), &spec, &digest.to_string())
        .await
        .unwrap();
    let desired = DesiredState::new(rows[0].generation, digest, std::sync::Arc::new(spec), None);
    tx.mirror([FleetChange::Desired(device.clone(), desired)]);
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn a_desired_change_waits_for_a_hold_and_a_hold_says_when_the_cache_lacks_one(pool: PgPool) {
    let ours = writer(&pool);
    let device = id("a");
    let mut tx = ours.begin().await.unwrap();
    register_mirrored(&mut tx, &device).await;
    tx.commit("registering").await.unwrap();

    let hold = ours.hold_desired().await.unwrap();
    let hold = hold.expect("the cache has every change: the hold is given");
    // Another process changes the device's desired state meanwhile.
    let theirs = tokio::spawn({
        let pool = pool.clone();
        let device = device.clone();
        async move {
            let theirs = writer(&pool);
            let mut tx = theirs.begin().await.unwrap();
            set_desired(&mut tx, &device, 1).await;
            tx.commit("the other process's desired change")
                .await
                .unwrap();
            "committed"
        }
    });
    let theirs = waits_on_a_lock(&pool, theirs, |got| {
        format!("the other process's desired change {got} while the hold was held")
    })
    .await;
    hold.release().await.unwrap();
    assert_eq!(theirs.await.unwrap(), "committed");

    assert!(
        ours.hold_desired().await.unwrap().is_none(),
        "the cache lacks the other process's change: no hold"
    );
    ours.follow().await.unwrap();
    let hold = ours.hold_desired().await.unwrap();
    assert!(hold.is_some(), "caught up: the hold is given");
}

#[tokio::test]
async fn the_servers_sessions_never_jit_compile_a_statement() {
    let url = std::env::var("DATABASE_URL")
        .expect("DATABASE_URL must name the test PostgreSQL (scripts/test sets it)");
    let pool = idem_server::store::connect(&url, 1).await.unwrap();
    let jit: String = sqlx::query_scalar("SHOW jit")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jit, "off");
}

/// Commits `drafts` as rows and then `converged` (of `run`) as converged
/// slices, numbered after them, in one transaction; returns the first
/// sequence of the converged ones.
async fn append_with_converged(
    pool: &PgPool,
    drafts: Vec<idem_server::events::EventDraft>,
    run: uuid::Uuid,
    converged: &[(DeviceId, Option<idem_protocol::Health>)],
) -> i64 {
    use idem_server::store::runs::ConvergedTarget;
    let mut tx = pool.begin().await.unwrap();
    let first = events::reserve_sequences(&mut tx, drafts.len() + converged.len())
        .await
        .unwrap();
    let time = idem_server::events::log::event_time(chrono::Utc::now());
    let count = drafts.len() as u64;
    let rows = idem_server::events::finalize(drafts, first, "/idem/test", time).unwrap();
    events::insert(&mut tx, &rows).await.unwrap();
    let targets: Vec<ConvergedTarget<'_>> = converged
        .iter()
        .enumerate()
        .map(|(i, (device, health))| ConvergedTarget {
            device_id: device,
            generation: Generation(i as u64 + 1),
            health: *health,
        })
        .collect();
    idem_server::events::log::append_converged(
        &mut tx,
        run,
        &targets,
        first + count,
        "/idem/test",
        time,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    (first + count) as i64
}

fn started(run: uuid::Uuid) -> idem_server::events::EventDraft {
    idem_server::events::EventDraft {
        event_type: idem_server::events::EventType::RunStarted,
        subject: run.to_string(),
        run_id: Some(run),
        generation: None,
        data: json!({}),
    }
}

fn device_event(
    kind: idem_protocol::OutcomeKind,
    device: &str,
    run: Option<uuid::Uuid>,
) -> idem_server::events::EventDraft {
    idem_server::events::EventDraft {
        event_type: idem_server::events::EventType::Device(kind),
        subject: device.to_owned(),
        run_id: run,
        generation: Some(Generation(1)),
        data: json!({"outcome": kind.as_str()}),
    }
}

fn fleet_of(count: usize) -> Vec<(DeviceId, Option<idem_protocol::Health>)> {
    (0..count)
        .map(|i| {
            let health = (i % 3 == 0).then_some(idem_protocol::Health::Healthy);
            (id(&format!("dev-{i:04}")), health)
        })
        .collect()
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn the_log_reads_rows_and_converged_slices_as_one_gap_free_sequence_under_every_filter(
    pool: PgPool,
) {
    use idem_protocol::OutcomeKind;
    use idem_server::events::log::read;
    use idem_server::store::events::{EventFilter, StoredEvent};
    let (a, b, c) = (
        uuid::Uuid::now_v7(),
        uuid::Uuid::now_v7(),
        uuid::Uuid::now_v7(),
    );
    // Run a: started, nothing converged. Run b: started, 2,500 converged
    // (three slices). Then a failed outcome in b and a drift outside any
    // run, and run c with three converged.
    append_with_converged(&pool, vec![started(a)], a, &[]).await;
    append_with_converged(&pool, vec![started(b)], b, &fleet_of(2_500)).await;
    append_with_converged(
        &pool,
        vec![
            device_event(OutcomeKind::Failed, "dev-0007", Some(b)),
            device_event(OutcomeKind::Provisioned, "dev-0001", None),
        ],
        b,
        &[],
    )
    .await;
    append_with_converged(&pool, vec![started(c)], c, &fleet_of(3)).await;
    assert_eq!(
        events::last_sequence(&pool).await.unwrap(),
        1 + 1 + 2_500 + 2 + 1 + 3
    );

    let everything = read(&pool, 0, &EventFilter::default(), 100_000)
        .await
        .unwrap();
    let sequences: Vec<i64> = everything.iter().map(|e| e.sequence).collect();
    assert_eq!(
        sequences,
        (1..=2_508).collect::<Vec<i64>>(),
        "gap-free, in order"
    );
    for event in &everything {
        assert_eq!(event.cloudevent["sequence"], event.sequence);
        assert_eq!(event.cloudevent["type"], event.event_type.as_str());
        assert_eq!(event.cloudevent["subject"], event.subject.as_str());
    }
    let converged = &everything[2];
    assert_eq!(
        (converged.subject.as_str(), converged.run_id),
        ("dev-0000", Some(b))
    );
    assert_eq!(converged.event_type, "io.idem.device.already_converged");
    assert_eq!(converged.cloudevent["runid"], b.to_string());
    assert_eq!(converged.cloudevent["generation"], 1);
    assert_eq!(
        converged.cloudevent["data"],
        json!({"outcome": "already_converged", "reason": null, "health": "healthy", "success": true})
    );
    assert_eq!(everything[3].cloudevent["data"]["health"], json!(null));
    let ids: std::collections::HashSet<&str> = everything
        .iter()
        .map(|e| e.cloudevent["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), everything.len(), "every event has its own id");
    let again = read(&pool, 0, &EventFilter::default(), 100_000)
        .await
        .unwrap();
    assert_eq!(
        again.iter().map(|e| &e.cloudevent).collect::<Vec<_>>(),
        everything.iter().map(|e| &e.cloudevent).collect::<Vec<_>>(),
        "a slice reads back as the same events every time"
    );

    let filter = |run_id, event_type: Option<&str>, subject: Option<&str>| EventFilter {
        run_id,
        event_type: event_type.map(str::to_owned),
        subject: subject.map(str::to_owned),
    };
    let filters = [
        EventFilter::default(),
        filter(Some(b), None, None),
        filter(Some(c), None, None),
        filter(None, Some("io.idem.device.already_converged"), None),
        filter(None, Some("io.idem.device.failed"), None),
        filter(None, Some("io.idem.run.started"), None),
        filter(None, None, Some("dev-0001")),
        filter(
            None,
            Some("io.idem.device.already_converged"),
            Some("dev-0002"),
        ),
        filter(Some(b), None, Some("dev-0007")),
        filter(Some(a), Some("io.idem.device.already_converged"), None),
    ];
    let key = |events: &[StoredEvent]| -> Vec<(i64, String)> {
        events
            .iter()
            .map(|e| (e.sequence, e.cloudevent["id"].as_str().unwrap().to_owned()))
            .collect()
    };
    for filter in &filters {
        let wanted: Vec<StoredEvent> = everything
            .iter()
            .filter(|e| filter.matches(e))
            .cloned()
            .collect();
        for after in [0, 1, 2, 3, 1_025, 1_026, 2_000, 2_502, 2_505, 2_508] {
            for limit in [1, 7, 500, 2_000, 5_000] {
                let expected: Vec<StoredEvent> = wanted
                    .iter()
                    .filter(|e| e.sequence > after)
                    .take(limit)
                    .cloned()
                    .collect();
                let got = read(&pool, after, filter, limit as i64).await.unwrap();
                assert_eq!(
                    key(&got),
                    key(&expected),
                    "{filter:?} after {after}, at most {limit}"
                );
            }
        }
    }
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn pruning_counts_the_events_of_a_converged_slice_and_takes_it_only_whole(pool: PgPool) {
    let run = uuid::Uuid::now_v7();
    // 1: run.started; 2..=1,201: converged (slices 2..=1,025, 1,026..=1,201).
    append_with_converged(&pool, vec![started(run)], run, &fleet_of(1_200)).await;
    append_events(&pool, 10, chrono::Duration::zero()).await; // 1,202..=1,211
    let week = std::time::Duration::from_secs(7 * 86_400);
    // Keep the newest 1,000: the line is 211, inside the first slice.
    assert_eq!(events::prune(&pool, 1_211, week, 1_000).await.unwrap(), 1);
    assert_eq!(events::oldest_sequence(&pool).await.unwrap(), Some(2));
    // Keep the newest 100: the line is 1,111, past the first slice.
    assert_eq!(events::prune(&pool, 1_211, week, 100).await.unwrap(), 1_024);
    assert_eq!(events::oldest_sequence(&pool).await.unwrap(), Some(1_026));
    // Unrelayed events stay, whatever the count says.
    assert_eq!(events::prune(&pool, 1_200, week, 0).await.unwrap(), 0);
    assert_eq!(
        events::prune(&pool, 1_211, week, 0).await.unwrap(),
        176 + 10
    );
    assert_eq!(events::oldest_sequence(&pool).await.unwrap(), None);
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn a_runs_outcomes_page_through_its_rows_and_its_converged_slices_by_device(pool: PgPool) {
    use idem_protocol::OutcomeKind;
    use idem_server::store::runs::{self, ConvergedTarget, NewRunRow};
    let run = uuid::Uuid::now_v7();
    let fleet = fleet_of(2_100);
    // Every seventh device is carried by the engine; the rest converged.
    let (carried, converged): (Vec<_>, Vec<_>) =
        fleet.iter().enumerate().partition(|(i, _)| i % 7 == 0);
    let undecided: Vec<(DeviceId, Option<usize>, bool)> = carried
        .iter()
        .map(|(_, (device, _))| (device.clone(), None, false))
        .collect();
    // In reverse: the store sorts them.
    let targets: Vec<ConvergedTarget<'_>> = converged
        .iter()
        .rev()
        .map(|(_, (device, health))| ConvergedTarget {
            device_id: device,
            generation: Generation(4),
            health: *health,
        })
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let row = NewRunRow {
        id: run,
        trigger: idem_protocol::Trigger::Manual,
        force: false,
        started_by: None,
        plan_id: None,
        approval: None,
    };
    runs::create(&mut tx, row, &undecided, &targets)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let slices: i64 = sqlx::query_scalar("SELECT count(*) FROM run_converged")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(slices, 2, "1,800 converged targets in slices of 1,024");

    let page_through = |outcome: Option<OutcomeKind>, limit: i64| {
        let pool = pool.clone();
        async move {
            let mut seen = Vec::new();
            let mut after: Option<String> = None;
            loop {
                let page = runs::outcomes(&pool, run, outcome, after.as_deref(), limit)
                    .await
                    .unwrap();
                assert!(page.len() as i64 <= limit);
                let Some(last) = page.last() else { break };
                after = Some(last.device_id.clone());
                seen.extend(page);
            }
            seen
        }
    };
    let all = page_through(None, 333).await;
    let names: Vec<&str> = all.iter().map(|t| t.device_id.as_str()).collect();
    let expected: Vec<String> = fleet.iter().map(|(d, _)| d.to_string()).collect();
    assert_eq!(names, expected, "every target once, by device id");
    for (i, target) in all.iter().enumerate() {
        if i % 7 == 0 {
            assert_eq!((target.outcome, target.generation), (None, None), "{i}");
        } else {
            assert_eq!(target.outcome, Some(OutcomeKind::AlreadyConverged), "{i}");
            assert_eq!(target.generation, Some(4));
            assert_eq!(target.health, fleet[i].1);
            assert!(target.decided_at.is_some());
        }
    }
    let converged_only = page_through(Some(OutcomeKind::AlreadyConverged), 1_000).await;
    assert_eq!(converged_only.len(), 1_800);
    let provisioned = page_through(Some(OutcomeKind::Provisioned), 50).await;
    assert!(provisioned.is_empty());
    let viewed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM run_outcomes WHERE run_id = $1 AND outcome = 'already_converged'",
    )
    .bind(run)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(viewed, 1_800, "the view has one row per target");
}

#[sqlx::test(migrator = "idem_server::MIGRATOR")]
async fn the_engine_learns_which_of_the_runs_it_carries_are_completed_and_only_those(pool: PgPool) {
    use idem_server::store::runs::{self, NewRunRow};
    let new_run = |id| NewRunRow {
        id,
        trigger: idem_protocol::Trigger::Manual,
        force: false,
        started_by: None,
        plan_id: None,
        approval: None,
    };
    let (finished, running, never_committed) = (
        uuid::Uuid::now_v7(),
        uuid::Uuid::now_v7(),
        uuid::Uuid::now_v7(),
    );
    let mut tx = pool.begin().await.unwrap();
    for id in [finished, running] {
        runs::create(&mut tx, new_run(id), &[], &[]).await.unwrap();
    }
    tx.commit().await.unwrap();
    sqlx::query("UPDATE runs SET state = 'completed', finished_at = now() WHERE id = $1")
        .bind(finished)
        .execute(&pool)
        .await
        .unwrap();
    let completed = runs::completed_among(&pool, &[finished, running, never_committed])
        .await
        .unwrap();
    assert_eq!(
        completed,
        vec![finished],
        "a running run and one not committed yet stay carried"
    );
    assert!(runs::completed_among(&pool, &[]).await.unwrap().is_empty());
}
