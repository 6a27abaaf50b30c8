//! The benchmark's steps, in order: register, connect, the write floor,
//! the converged pass, the normal and the forced run over the re-drifted
//! fleet, the full push, the same change as a ten-wave rollout, twelve
//! resync passes over the converged fleet and the ingest burst; then memory. Each step runs
//! through [`Bench::step`]; what they measure goes to the report.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use idem_device_sim::memory::MemoryField;
use idem_device_sim::{
    check_outcomes, format_count, BrokerAddr, ExpectedOutcome, Fleet, FleetConfig, RunView,
};
use idem_protocol::TopicRoot;
use idem_tests::{PrivateMosquitto, ProcessServer};
use serde_json::{json, Value};

use crate::bench::{
    details, diagnose, follow_run, run_details, start_extra_instances, wait_stored, Bench, Record,
    APPLIED, POLL, PUSHES, STEP_TIMEOUT,
};
use crate::counter::{Counter, COUNTER_USER};
use crate::fleet::{bench_plan, BenchFleet};
use crate::report::{report, Measured};

/// Runs every step and reports; returns the extra server instances of the
/// instances steps (none with `--instances 1`), still running.
pub async fn run_steps(
    bench: &Bench,
    core: &PrivateMosquitto,
    workers: Option<BenchFleet>,
    root: &TopicRoot,
    server_env: &[(String, String)],
    load_before: &str,
) -> Result<Vec<ProcessServer>> {
    let n = bench.args.devices;
    let k = bench.args.heartbeats;
    let plan = bench_plan(n, bench.args.drifted)?;
    let drifted_ids = plan.ids_expecting(ExpectedOutcome::Provisioned);
    let expected_summary = plan.expected_counts().summary();

    tokio::time::sleep(Duration::from_secs(1)).await;
    let server_idle_rss = bench.probe.server_memory(MemoryField::Rss);
    let sim_idle_rss = workers
        .as_ref()
        .and_then(BenchFleet::workers_idle_rss)
        .unwrap_or_else(|| idem_device_sim::memory::rss_bytes().unwrap_or(0));
    let mut record = Record::default();

    // Registration (not a target; reported for context).
    register_step(bench, &plan, &mut record).await?;
    let (mut fleet, connected_s, connect_wall) =
        connect_step(bench, core, workers, root, &plan, &mut record).await?;
    // Steady state with the fleet connected: after the ingest settled.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let server_connected_rss = bench.probe.server_memory(MemoryField::Rss);

    // PostgreSQL's write floor for one run over this fleet, in this run:
    // one outcome row and one event row per device by COPY.
    // (The same rows by UNNEST, for comparison.)
    let floors = idem_tests::write_floor::measure(bench.db.pool(), n, 3).await?;
    let write_floor = floors.copy;
    println!(
        "  write floor   {:.3} s   ({} outcome rows + {} event rows by COPY, best of 3; by UNNEST {:.3} s)",
        write_floor.as_secs_f64(),
        format_count(n as u64),
        format_count(n as u64),
        floors.unnest.as_secs_f64()
    );
    record.write_floor_unnest = Some(floors.unnest);

    // Converged pass: a normal run over the fleet with `drifted` devices off.
    let all = json!({"all": true});
    let (converged, converged_wall, _) =
        run_step(bench, &mut record, "converged", RunStart::Run(&all)).await?;
    if converged.summary != expected_summary {
        bail!(
            "converged pass summary {:?}, expected {expected_summary:?}",
            converged.summary
        );
    }
    let outcomes = bench.client.outcomes(converged.id).await?;
    let truth = check_outcomes(&plan, &outcomes);
    if !truth.passed() {
        bail!(
            "converged pass: outcomes differ from the simulators' ground truth for {:?}",
            truth
                .mismatching_devices()
                .iter()
                .take(10)
                .collect::<Vec<_>>()
        );
    }
    println!(
        "  converged pass: {} (every one of {} outcomes matches the simulators' ground truth)",
        converged.summary,
        format_count(outcomes.len() as u64)
    );

    // Payoff: the same fleet, re-drifted, reconciled normally, then forced.
    redrift(bench, &mut fleet, &drifted_ids, &plan.desired_spec).await?;
    let (normal, normal_wall, normal_pushes) =
        run_step(bench, &mut record, "normal", RunStart::Run(&all)).await?;
    if normal.summary != expected_summary {
        bail!(
            "normal run summary {:?}, expected {expected_summary:?}",
            normal.summary
        );
    }
    redrift(bench, &mut fleet, &drifted_ids, &plan.desired_spec).await?;
    let forced_body = json!({"all": true, "force": true});
    let (_, forced_wall, forced_pushes) =
        run_step(bench, &mut record, "forced", RunStart::Run(&forced_body)).await?;

    // Full push: a fleet-wide desired change; every device is pushed to.
    let new_spec = json!({"firmware": "2.5.0", "version": "2025.2",
        "telemetry": {"interval_s": 30, "metrics": ["temp", "rssi", "battery"]},
        "features": {"ota": true, "debug_log": false}});
    let desired_body = json!({"all": true, "spec": new_spec});
    let (full, full_wall, full_pushes) = run_step(
        bench,
        &mut record,
        "full_push",
        RunStart::Desired(&desired_body),
    )
    .await?;
    if full.counts.provisioned != n as u64 {
        bail!("full push: {}", full.summary);
    }

    // Rollout: the next fleet-wide change as a staged rollout, 100 % in
    // equal waves (ten unless told) without pauses or gates; its cost
    // against the full push above.
    let mut rollout_spec = new_spec.clone();
    rollout_spec["firmware"] = json!("2.6.0");
    let wave_count = bench.args.rollout_waves;
    let waves: Vec<String> = (1..=wave_count)
        .map(|i| format!("{}%", i * 100 / wave_count))
        .collect();
    let rollout_body = json!({"all": true, "spec": rollout_spec, "rollout": {"waves": waves}});
    let (rolled, rollout_wall, rollout_pushes) = run_step(
        bench,
        &mut record,
        "rollout",
        RunStart::Desired(&rollout_body),
    )
    .await?;
    if rolled.counts.provisioned != n as u64 {
        bail!("rollout: {}", rolled.summary);
    }

    // Resync: the periodic pass over a converged fleet, twelve times (an
    // hour of the default five-minute resync); what it grows the database by.
    resync_step(bench, &mut record).await?;

    // Ingest: every device publishes K reports at once; the server's stored
    // rate against a bare subscriber's received rate, same burst.
    let (total, sub_rate, server_rate) =
        ingest_step(bench, core, root, &mut fleet, &mut record).await?;
    let ingest_ratio = server_rate / sub_rate;

    // Instances: the converged pass and a full push again with every
    // instance sharing the fleet, against one instance in this same run.
    let extras = match bench.args.instances {
        1 => Vec::new(),
        _ => {
            instances_steps(
                bench,
                core,
                root,
                server_env,
                &mut record,
                full_wall,
                &new_spec,
            )
            .await?
        }
    };

    // Memory. The cache gauge is refreshed every 2 s.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let cache_bytes = bench.metric("idem_fleet_cache_bytes").await?;
    let server_peak = bench.probe.server_memory(MemoryField::PeakRss);
    let server_end_rss = bench.probe.server_memory(MemoryField::Rss);
    let sim_peak = fleet.peak_rss().await?;
    let stopping = Instant::now();
    let stats = fleet.shutdown().await?;
    let shutdown_s = stopping.elapsed().as_secs_f64();
    let per_device = |bytes: u64, idle: u64| bytes.saturating_sub(idle) as f64 / n as f64;
    let server_steady_per_device = per_device(server_connected_rss, server_idle_rss);
    let server_peak_per_device = per_device(server_peak, server_idle_rss);
    let sim_per_device = per_device(sim_peak, sim_idle_rss);

    let measured = Measured {
        n,
        k,
        total,
        connect_wall,
        connected_s,
        converged,
        converged_wall,
        write_floor,
        normal_wall,
        normal_server_ms: normal.duration_ms.unwrap_or(0),
        forced_wall,
        normal_pushes,
        forced_pushes,
        full_wall,
        full_pushes,
        rollout_wall,
        rollout_pushes,
        sub_rate,
        server_rate,
        ingest_ratio,
        server_idle_rss,
        server_connected_rss,
        server_end_rss,
        server_peak,
        server_steady_per_device,
        server_peak_per_device,
        sim_idle_rss,
        sim_peak,
        sim_per_device,
        stats,
        shutdown_s,
        cache_bytes,
    };
    report(bench, load_before, server_env, &record, measured)?;
    Ok(extras)
}

/// How long the extra instances settle after the first converged pass
/// with them, before the pass the ratio is taken on.
const SETTLE_AFTER_JOINING: Duration = Duration::from_secs(3);

/// Starts the extra instances (sharing the fleet's subscriptions, as the
/// first one does), then times a converged pass with one instance and with
/// all (right after they joined, and once they settled: the ratio is the
/// settled one's), and a full push with all against the full push with one
/// (`full_one`). Prints the ratios (one ÷ all: 1 means no cost).
async fn instances_steps(
    bench: &Bench,
    core: &PrivateMosquitto,
    root: &TopicRoot,
    server_env: &[(String, String)],
    record: &mut Record,
    full_one: Duration,
    spec: &Value,
) -> Result<Vec<ProcessServer>> {
    let all = json!({"all": true});
    let (_, converged_one, _) =
        run_step(bench, record, "converged_one", RunStart::Run(&all)).await?;
    let extras = start_extra_instances(bench, core, root, server_env, "bench").await?;
    let n = bench.args.instances;
    // The first pass right after the instances joined carries their
    // start-up; it is timed and printed, and the ratio is taken on a pass
    // once they settled.
    let (_, joined_all, _) =
        run_step(bench, record, "converged_just_joined", RunStart::Run(&all)).await?;
    tokio::time::sleep(SETTLE_AFTER_JOINING).await;
    let (converged, converged_all, _) =
        run_step(bench, record, "converged_instances", RunStart::Run(&all)).await?;
    let mut next = spec.clone();
    next["firmware"] = json!("2.7.0");
    let body = json!({"all": true, "spec": next});
    let (full, full_all, _) = run_step(
        bench,
        record,
        "full_push_instances",
        RunStart::Desired(&body),
    )
    .await?;
    if full.counts.provisioned != bench.args.devices as u64 {
        bail!("full push with {n} instances: {}", full.summary);
    }
    let ratio = |one: Duration, all: Duration| one.as_secs_f64() / all.as_secs_f64().max(1e-9);
    println!(
        "  instances {n}: converged pass {:.3} s vs {:.3} s with one (ratio {:.2}; {}; \
         {:.3} s right after the instances joined, ratio {:.2}), \
         full push {:.3} s vs {:.3} s (ratio {:.2}); target >= 0.8 each",
        converged_all.as_secs_f64(),
        converged_one.as_secs_f64(),
        ratio(converged_one, converged_all),
        converged.summary,
        joined_all.as_secs_f64(),
        ratio(converged_one, joined_all),
        full_all.as_secs_f64(),
        full_one.as_secs_f64(),
        ratio(full_one, full_all),
    );
    Ok(extras)
}

/// How a run step starts its run.
#[derive(Clone, Copy)]
enum RunStart<'a> {
    /// `POST /v1/runs` with this body.
    Run(&'a Value),
    /// `POST /v1/desired` with this body.
    Desired(&'a Value),
}

/// Step `name`: starts a run and follows it until completed. Returns the
/// run, the step's duration and the publishes the server made meanwhile.
async fn run_step(
    bench: &Bench,
    record: &mut Record,
    name: &'static str,
    start: RunStart<'_>,
) -> Result<(RunView, Duration, f64)> {
    let client = &bench.client;
    let pushes_before = bench.metric(PUSHES).await?;
    let (run, wall) = bench
        .step(record, name, async {
            let started = match start {
                RunStart::Run(body) => client.start_run(body).await?,
                RunStart::Desired(body) => client.set_desired(body).await?,
            };
            let run = follow_run(client, &started.run_id).await?;
            Ok((run, BTreeMap::new()))
        })
        .await?;
    let pushes = bench.metric(PUSHES).await? - pushes_before;
    record.annotate_last(run_details(&run, pushes));
    Ok((run, wall, pushes))
}

/// Passes of the resync step: an hour of resyncs at the default interval.
pub const RESYNC_PASSES: usize = 12;

/// The database's size on disk and its tables' (with indexes and TOAST),
/// in bytes.
async fn database_bytes(bench: &Bench) -> Result<(i64, i64)> {
    sqlx::query_as(
        "SELECT pg_database_size(current_database()), \
                (SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::int8 \
                   FROM pg_stat_user_tables)",
    )
    .fetch_one(bench.db.pool())
    .await
    .context("measuring the database's size")
}

/// Resync: [`RESYNC_PASSES`] runs over the whole (converged) fleet, one
/// after the other, each of which must find every device already
/// converged; records how much the database and its tables grew.
async fn resync_step(bench: &Bench, record: &mut Record) -> Result<()> {
    let n = bench.args.devices as u64;
    let client = &bench.client;
    let all = json!({"all": true});
    let (database_before, tables_before) = database_bytes(bench).await?;
    let (server_ms, _) = bench
        .step(record, "resync", async {
            let mut server_ms = Vec::with_capacity(RESYNC_PASSES);
            for pass in 1..=RESYNC_PASSES {
                let started = client.start_run(&all).await?;
                let run = follow_run(client, &started.run_id).await?;
                if run.counts.already_converged != n {
                    bail!(
                        "resync pass {pass}: {}, expected every device already converged",
                        run.summary
                    );
                }
                server_ms.push(run.duration_ms.unwrap_or(0));
            }
            Ok((
                server_ms.clone(),
                details(&[
                    ("passes", json!(RESYNC_PASSES)),
                    ("server_duration_ms", json!(server_ms)),
                ]),
            ))
        })
        .await?;
    let (database_after, tables_after) = database_bytes(bench).await?;
    let grown = database_after - database_before;
    let tables_grown = tables_after - tables_before;
    record.annotate_last(details(&[
        ("database_growth_bytes", json!(grown)),
        ("table_growth_bytes", json!(tables_grown)),
    ]));
    println!(
        "  resync: {RESYNC_PASSES} passes over the converged fleet (server {} ms each) grew the database by {:.1} MiB (its tables by {:.1} MiB)",
        server_ms.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
        grown as f64 / 1_048_576.0,
        tables_grown as f64 / 1_048_576.0,
    );
    Ok(())
}

/// Registers the plan's devices, 1,000 per request.
pub async fn register_step(
    bench: &Bench,
    plan: &idem_device_sim::Plan,
    record: &mut Record,
) -> Result<()> {
    let labels = json!({"bench": "1"});
    let client = &bench.client;
    bench
        .step(record, "register", async {
            for chunk in plan.devices.chunks(1_000) {
                client
                    .register(
                        chunk.iter().map(|d| d.id.as_str()),
                        &labels,
                        &plan.desired_spec,
                    )
                    .await?;
            }
            Ok(((), details(&[("devices", json!(plan.devices.len()))])))
        })
        .await?;
    Ok(())
}

/// The in-process fleet's configuration: every device on `broker`, with
/// TLS and passwords when the benchmark is `--secure`.
fn in_process_config(
    bench: &Bench,
    broker: &PrivateMosquitto,
    root: &TopicRoot,
    plan: &idem_device_sim::Plan,
) -> Result<FleetConfig> {
    let broker_addr = match broker.ca_file() {
        Some(_) => BrokerAddr::tls(broker.host(), broker.port()),
        None => BrokerAddr::new(broker.host(), broker.port()),
    };
    let mut config = FleetConfig::new(broker_addr, root.clone(), plan.devices.clone());
    if let (Some(passwords), Some(ca)) = (&bench.passwords, broker.ca_file()) {
        config.tls = Some(idem_device_sim::SimTls::from_files(Some(ca), None)?);
        let devices: HashMap<idem_protocol::DeviceId, String> = plan
            .devices
            .iter()
            .filter_map(|d| {
                passwords
                    .get(d.id.as_str())
                    .map(|p| (d.id.clone(), p.clone()))
            })
            .collect();
        config.credentials = Some(idem_device_sim::Credentials::new(devices));
    }
    config.connect_rate = bench.args.connect_rate;
    config.max_connecting = bench.args.max_connecting;
    Ok(config)
}

/// Connect: every device connected and its first report stored. The fleet
/// starts in this process on the core broker, or in the (already spawned)
/// `workers` on the edges. Returns the fleet, when all were connected and
/// the step's duration.
pub async fn connect_step(
    bench: &Bench,
    core: &PrivateMosquitto,
    workers: Option<BenchFleet>,
    root: &TopicRoot,
    plan: &idem_device_sim::Plan,
    record: &mut Record,
) -> Result<(BenchFleet, f64, Duration)> {
    let n = plan.devices.len();
    let baseline = bench.metric(APPLIED).await?;
    let config = match workers {
        Some(_) => None,
        None => Some(in_process_config(bench, core, root, plan)?),
    };
    let ((fleet, connected_s), connect_wall) = bench
        .step(record, "connect", async {
            let started = Instant::now();
            let mut fleet = match (workers, config) {
                (Some(mut workers), _) => {
                    workers.start().await?;
                    workers
                }
                (None, Some(config)) => BenchFleet::InProcess(Fleet::start(config)?),
                (None, None) => bail!("neither fleet workers nor a fleet configuration"),
            };
            let connected = async {
                fleet.wait_connected(n, STEP_TIMEOUT).await?;
                anyhow::Ok(started.elapsed().as_secs_f64())
            };
            let stored = wait_stored(
                bench,
                baseline,
                n as u64,
                "SELECT count(*) FROM devices WHERE reported_seq IS NOT NULL",
                n as i64,
            );
            let (connected, stored) = tokio::join!(connected, stored);
            let connected_s = connected?;
            stored?;
            let stats = fleet.stats().await?;
            Ok((
                (fleet, connected_s),
                details(&[
                    ("all_connected_s", json!(connected_s)),
                    ("connection_errors", json!(stats.connection_errors)),
                    ("connections", json!(stats.connections)),
                ]),
            ))
        })
        .await?;
    Ok((fleet, connected_s, connect_wall))
}

/// The ingest step: every device publishes `heartbeats` reports at once;
/// returns how many, and the rates a bare subscriber received and the
/// server stored them at.
async fn ingest_step(
    bench: &Bench,
    broker: &PrivateMosquitto,
    root: &TopicRoot,
    fleet: &mut BenchFleet,
    record: &mut Record,
) -> Result<(u64, f64, f64)> {
    let n = bench.args.devices;
    let k = bench.args.heartbeats;
    let total = n as u64 * u64::from(k);
    let counter_password = bench
        .passwords
        .as_ref()
        .and_then(|p| p.get(COUNTER_USER))
        .map(String::as_str);
    let counter = Counter::start(broker, root, total, counter_password).await?;
    let baseline = bench.metric(APPLIED).await?;
    let final_seqs: Vec<(String, i64)> = fleet
        .seqs()
        .await?
        .into_iter()
        .map(|(id, seq)| (id, seq.saturating_add(i64::from(k))))
        .collect();
    let ids: Vec<String> = final_seqs.iter().map(|(id, _)| id.clone()).collect();
    let seqs: Vec<i64> = final_seqs.iter().map(|(_, s)| *s).collect();
    let db = bench.db.pool().clone();
    let ingest = async {
        let t0 = Instant::now();
        fleet.request_reports(k).await?;
        // At least 120 s, and 1,000 reports/s more than that.
        let deadline = t0 + Duration::from_secs(120 + total / 1_000);
        let subscriber = async {
            loop {
                if let Some(at) = counter.reached() {
                    return anyhow::Ok(at - t0);
                }
                if Instant::now() > deadline {
                    bail!(
                        "the bare subscriber got {} of {total} reports",
                        counter.count.load(Ordering::Relaxed)
                    );
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        let server_stored = async {
            loop {
                let applied = bench.metric(APPLIED).await? - baseline;
                if applied >= total as f64 {
                    let stored: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM devices d \
                         JOIN UNNEST($1::text[], $2::int8[]) AS s(id, seq) ON d.id = s.id \
                         WHERE d.reported_seq >= s.seq",
                    )
                    .bind(&ids)
                    .bind(&seqs)
                    .fetch_one(&db)
                    .await
                    .context("counting stored final reports")?;
                    if stored == n as i64 {
                        return anyhow::Ok(t0.elapsed());
                    }
                }
                if Instant::now() > deadline {
                    bail!(
                        "the server applied {applied} of {total} reports\n{}",
                        diagnose(bench).await
                    );
                }
                tokio::time::sleep(POLL).await;
            }
        };
        let (subscriber, server_stored) = tokio::join!(subscriber, server_stored);
        let (subscriber, server_stored) = (subscriber?, server_stored?);
        let sub_rate = total as f64 / subscriber.as_secs_f64();
        let server_rate = total as f64 / server_stored.as_secs_f64();
        Ok((
            (sub_rate, server_rate),
            details(&[
                ("reports", json!(total)),
                ("subscriber_s", json!(subscriber.as_secs_f64())),
                ("server_stored_s", json!(server_stored.as_secs_f64())),
                ("subscriber_reports_per_s", json!(sub_rate)),
                ("server_reports_per_s", json!(server_rate)),
            ]),
        ))
    };
    let ((sub_rate, server_rate), _) = bench.step(record, "ingest", ingest).await?;
    counter.stop().await;
    Ok((total, sub_rate, server_rate))
}

/// Makes `ids` run a spec other than desired again and waits until the
/// server has stored their reports.
async fn redrift(
    bench: &Bench,
    fleet: &mut BenchFleet,
    ids: &[idem_protocol::DeviceId],
    desired: &Value,
) -> Result<()> {
    fleet.redrift(ids, desired).await?;
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let off = bench
            .scalar(
                "SELECT count(*) FROM devices WHERE reported_digest IS DISTINCT FROM desired_digest",
            )
            .await?;
        if off >= ids.len() as i64 {
            // Let the engine see the reports before the next run starts.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("only {off} of {} re-drifted devices stored", ids.len());
        }
        tokio::time::sleep(POLL).await;
    }
}
