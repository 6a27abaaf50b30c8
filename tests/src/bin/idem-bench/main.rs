//! `idem-bench`: the fleet-scale benchmark behind `scripts/bench` (not part of
//! the test suite). On this machine, in one run, against a real `idem-server`
//! process, a private Mosquitto and a fresh database, with a simulated fleet
//! in this process, it measures:
//!
//! * connect — the fleet connects and the server stores every first report;
//! * converged pass — a run over the fleet with 4 devices drifted;
//! * check-before-dispatch payoff — the same (re-drifted) fleet reconciled
//!   normally and then as a forced run: ratios of durations and publishes;
//! * full push — a fleet-wide desired change, every device pushed;
//! * ingest ratio — reports/s the server stores ÷ reports/s a bare counting
//!   subscriber on the same broker receives from the same burst;
//! * memory — server and simulator RSS, bytes per device above idle;
//!
//! plus the CPU seconds the server, broker, PostgreSQL and this process
//! spent in each step (from `/proc`), to say where the time goes, and the
//! rows each step inserted, updated and deleted per table (from
//! PostgreSQL's `pg_stat_user_tables`). It prints a
//! table and writes JSON. Optionally it runs `perf record` over one step.
//!
//! A fleet above one process's open-file limit (`--devices 100000`) runs
//! behind edge brokers: one edge Mosquitto per 18,000 devices, bridged to
//! the core broker the server and the bare subscriber connect to, and one
//! fleet worker process per edge (`fleet.rs`; docs/ARCHITECTURE.md, "Edge
//! brokers").
//!
//! It owns every process it starts (brokers, server, fleet workers, perf)
//! and stops them by PID; its load is bounded (a fixed fleet and burst) and
//! local to 127.0.0.1.

mod args;
mod bench;
mod counter;
mod fleet;
mod perf;
mod probe;
mod report;
mod soak;
mod steps;
mod targets;

use anyhow::{bail, Context, Result};
use idem_device_sim::{format_count, ServerClient};
use idem_protocol::TopicRoot;
use idem_tests::{raise_fd_limit, BridgeToCore, PrivateMosquitto, ProcessServer, TestDatabase};

use args::Args;
use bench::Bench;
use counter::COUNTER_USER;
use fleet::{bench_plan, slice, BenchFleet, WORKER_FLAG};
use probe::{processes, Probe};
use steps::run_steps;

#[tokio::main]
async fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(WORKER_FLAG) {
        return fleet::run_worker(&argv[2..]).await;
    }
    let args = Args::from_command_line()?;
    let fd_limit = raise_fd_limit()?;
    let per_process = args.devices_per_process();
    if fd_limit < per_process as u64 + 200 {
        bail!(
            "open-file limit {fd_limit} is too low for {per_process} devices in one process: \
             raise it (ulimit -n) or spread the fleet over more edges (--edges)"
        );
    }
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!(
        "idem-bench ({}): {} devices, {} drifted, {} heartbeats each; load average {}",
        if args.secure {
            "secure: TLS, per-client accounts, operator token"
        } else {
            "plain: no TLS, anonymous, no tokens"
        },
        format_count(args.devices as u64),
        args.drifted,
        args.heartbeats,
        load_before
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );

    // The system under test: private broker, fresh database, server process.
    // With --secure, every client has its own password account, bound to its
    // client id (the harness adds `use_username_as_clientid true` to every
    // broker with a password file, as docs/OPERATIONS.md §9 does).
    let passwords = args.secure.then(|| {
        let secret = uuid::Uuid::new_v4().simple().to_string();
        let mut passwords: std::collections::HashMap<String, String> =
            bench_plan(args.devices, args.drifted)
                .map(|plan| {
                    plan.devices
                        .iter()
                        .map(|d| (d.id.to_string(), format!("{}-{secret}", d.id)))
                        .collect()
                })
                .unwrap_or_default();
        passwords.insert("idem-server".into(), format!("server-{secret}"));
        passwords.insert(COUNTER_USER.into(), format!("counter-{secret}"));
        passwords
    });
    // The server's queue sized for the fleet, as docs/OPERATIONS.md says.
    let queued = queued_messages(args.devices);
    let broker = match &passwords {
        None => PrivateMosquitto::builder().queue_limits(queued, 0).start(),
        Some(passwords) => {
            let accounts: Vec<(&String, &String)> = passwords.iter().collect();
            PrivateMosquitto::builder()
                .tls()
                .password_file(&accounts)
                .queue_limits(queued, 0)
                .start()
        }
    }
    .context("starting a private Mosquitto")?;
    let db = TestDatabase::create()
        .await
        .context("creating a fresh database")?;
    let root = TopicRoot::new(format!(
        "bench/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ))
    .context("topic root")?;
    let edges = start_edges(&args, &broker, &root)?;
    let mut server_env: Vec<(String, String)> = match &args.soak {
        None => vec![
            // Unlimited push rate: the full push measures the server, not the pacer.
            ("IDEM_PUSH_RATE".into(), "0".into()),
            // Re-drifted devices must wait for our runs, not start their own.
            ("IDEM_DEBOUNCE".into(), "1h".into()),
            ("IDEM_RESYNC_INTERVAL".into(), "0".into()),
            ("RUST_LOG".into(), "warn,idem_server=info".into()),
        ],
        // The soak runs the server's defaults but for the resync interval
        // and retention counts small enough to be reached within the soak
        // (twenty resync passes' worth of events and of run targets, two
        // fleet-wide pushes' worth of attempt history).
        Some(soak) => vec![
            (
                "IDEM_RESYNC_INTERVAL".into(),
                format!("{}s", soak.resync.as_secs()),
            ),
            (
                "IDEM_EVENT_RETENTION_COUNT".into(),
                (20 * args.devices).to_string(),
            ),
            (
                "IDEM_RUN_RETENTION_TARGETS".into(),
                (20 * args.devices).to_string(),
            ),
            (
                "IDEM_ATTEMPT_RETENTION_COUNT".into(),
                (2 * args.devices).to_string(),
            ),
            ("RUST_LOG".into(), "warn,idem_server=info".into()),
        ],
    };
    if args.instances > 1 {
        // Every instance, the first one too, shares the fleet's messages.
        server_env.push(("IDEM_SHARE_GROUP".into(), "bench".into()));
    }
    match (&passwords, broker.ca_file()) {
        (Some(passwords), Some(ca)) => {
            server_env.push(("IDEM_MQTT_CA_FILE".into(), ca.display().to_string()));
            server_env.push(("IDEM_MQTT_USERNAME".into(), "idem-server".into()));
            server_env.push((
                "IDEM_MQTT_PASSWORD".into(),
                passwords["idem-server"].clone(),
            ));
        }
        _ => server_env.push(("IDEM_INSECURE_NO_AUTH".into(), "true".into())),
    }
    for (key, value) in std::env::vars() {
        if (key.starts_with("IDEM_") && !key.starts_with("IDEM_BENCH")) || key == "RUST_LOG" {
            server_env.retain(|(k, _)| *k != key);
            server_env.push((key, value));
        }
    }
    let env_refs: Vec<(&str, &str)> = server_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut server = ProcessServer::start(
        &args.server_bin,
        db.url(),
        &broker.url(),
        &root,
        "bench",
        &env_refs,
    )
    .await
    .context("starting idem-server")?;
    let server_pid = server.pid().context("server pid")?;
    let broker_pids = processes()
        .into_iter()
        .filter(|(_, ppid, comm)| *ppid == std::process::id() && comm == "mosquitto")
        .map(|(pid, _, _)| pid)
        .collect();
    // Fleet workers wait for the connect step to start their devices.
    let edge_ports: Vec<u16> = edges.iter().map(PrivateMosquitto::port).collect();
    let workers = if edge_ports.is_empty() {
        None
    } else {
        Some(BenchFleet::spawn_workers(&edge_ports, &root, args.devices, args.drifted).await?)
    };
    let auth = idem_device_sim::ClientAuth {
        token: server.api().token().map(idem_device_sim::SecretString::new),
        ca_file: None,
    };
    let client = ServerClient::with_auth(&server.url(""), &auth)?;
    let bench = Bench {
        args: args.clone(),
        client,
        db,
        probe: Probe {
            server_pid,
            broker_pids,
            worker_pids: workers
                .as_ref()
                .map(BenchFleet::worker_pids)
                .unwrap_or_default(),
        },
        passwords,
    };
    if let Some(settings) = &args.soak {
        let result = soak_with_instances(
            &bench,
            &broker,
            &root,
            workers,
            &server,
            &server_env,
            settings,
        )
        .await;
        let panics = server.panics();
        let log_tail = server.log_tail();
        if let Err(e) = server.stop() {
            eprintln!("idem-bench: stopping the server: {e:#}");
        }
        drop(edges);
        drop(broker);
        return match result {
            Ok(()) if panics.is_empty() => Ok(()),
            Ok(()) => bail!("the server panicked:\n{}", panics.join("\n")),
            Err(e) => Err(e.context(format!("--- server log ---\n{log_tail}"))),
        };
    }
    // The core broker: the server and the bare subscriber, and the fleet
    // itself when it has no edges.
    let result = match run_steps(&bench, &broker, workers, &root, &server_env, &load_before).await {
        Ok(extras) if extras.is_empty() => Ok(()),
        Ok(mut extras) => takeover(&mut server, &mut extras).await,
        Err(e) => Err(e),
    };
    let log_tail = server.log_tail();
    if let Some(path) = &args.server_log {
        std::fs::write(path, server.log_text())
            .with_context(|| format!("writing the server log to {}", path.display()))?;
    }
    let panics = server.panics();
    if let Err(e) = server.stop() {
        eprintln!("idem-bench: stopping the server: {e:#}");
    }
    drop(edges);
    drop(broker);
    match result {
        Ok(()) if panics.is_empty() => Ok(()),
        Ok(()) => bail!("the server panicked:\n{}", panics.join("\n")),
        Err(e) => Err(e.context(format!("--- server log ---\n{log_tail}"))),
    }
}

/// The soak with every instance of `--instances` running (the first is
/// `server`); the extra instances are stopped at the end.
async fn soak_with_instances(
    bench: &Bench,
    broker: &PrivateMosquitto,
    root: &TopicRoot,
    workers: Option<BenchFleet>,
    server: &ProcessServer,
    server_env: &[(String, String)],
    settings: &args::Soak,
) -> Result<()> {
    let mut extras = bench::start_extra_instances(bench, broker, root, server_env, "soak").await?;
    let mut server_pids = vec![bench.probe.server_pid];
    server_pids.extend(extras.iter().filter_map(ProcessServer::pid));
    let csv = bench
        .args
        .out
        .clone()
        .unwrap_or_else(|| std::path::PathBuf::from("bench-results/soak.csv"));
    let run = soak::SoakRun {
        bench,
        core: broker,
        root,
        workers,
        server_url: server.url(""),
        token: server.api().token().map(str::to_owned),
        server_pids,
        event_retention: soak::env_count(server_env, "IDEM_EVENT_RETENTION_COUNT", 1_000_000),
        run_retention: soak::env_count(server_env, "IDEM_RUN_RETENTION_TARGETS", 1_000_000),
    };
    let result = soak::run_soak(run, settings, &csv).await;
    for extra in &mut extras {
        if let Err(e) = extra.stop() {
            eprintln!("idem-bench: stopping an instance: {e:#}");
        }
    }
    result
}

/// Kills the instance holding the engine lease and times how long until
/// another one holds it; prints it, then stops the rest.
async fn takeover(first: &mut ProcessServer, extras: &mut [ProcessServer]) -> Result<()> {
    let owns_engine = |ready: &serde_json::Value| {
        ready["owns"]
            .as_array()
            .is_some_and(|owns| owns.iter().any(|o| o == "engine"))
    };
    let mut instances: Vec<&mut ProcessServer> =
        std::iter::once(first).chain(extras.iter_mut()).collect();
    let mut owner = None;
    for (index, instance) in instances.iter().enumerate() {
        if instance
            .readyz()
            .await
            .is_ok_and(|(_, ready)| owns_engine(&ready))
        {
            owner = Some(index);
        }
    }
    let owner = owner.context("no instance holds the engine lease")?;
    instances[owner].kill()?;
    let killed = std::time::Instant::now();
    let deadline = killed + std::time::Duration::from_secs(60);
    loop {
        for (index, instance) in instances.iter().enumerate() {
            if index != owner
                && instance
                    .readyz()
                    .await
                    .is_ok_and(|(_, ready)| owns_engine(&ready))
            {
                println!(
                    "  takeover: the engine lease's holder (instance {}) killed; instance {} held it {:.2} s later (--instance-lease {})",
                    owner + 1,
                    index + 1,
                    killed.elapsed().as_secs_f64(),
                    std::env::var("IDEM_INSTANCE_LEASE").unwrap_or_else(|_| "10s".into())
                );
                // The first instance is stopped by the caller.
                for (index, instance) in instances.iter_mut().enumerate() {
                    if index != owner && index != 0 {
                        instance.stop()?;
                    }
                }
                return Ok(());
            }
        }
        if std::time::Instant::now() >= deadline {
            bail!("no instance took the engine lease over within 60 s of the kill");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// One edge broker per fleet worker, bridged to `core`: each bridge
/// subscribes at the core to its own devices' `desired` and `get` topics
/// only, so the core sends every message to one edge, not to all.
fn start_edges(
    args: &Args,
    core: &PrivateMosquitto,
    root: &TopicRoot,
) -> Result<Vec<PrivateMosquitto>> {
    let count = args.edge_count();
    if count == 0 {
        return Ok(Vec::new());
    }
    let plan = bench_plan(args.devices, args.drifted)?;
    (0..count)
        .map(|index| {
            let ids = plan.devices[slice(args.devices, index, count)]
                .iter()
                .map(|d| d.id.to_string())
                .collect();
            PrivateMosquitto::builder()
                .queue_limits(queued_messages(args.devices), 0)
                .bridge_to(BridgeToCore {
                    core_port: core.port(),
                    topic_root: root.as_str().to_owned(),
                    name: format!("idem-bench-edge-{index}"),
                    devices: Some(ids),
                })
                .start()
                .with_context(|| format!("starting edge broker {index}"))
        })
        .collect()
}

/// `max_queued_messages` for a fleet of `devices` (the formula of
/// `idem_server::broker::sizing`), as the broker's `u32` setting.
fn queued_messages(devices: usize) -> u32 {
    let queued = idem_server::broker::sizing::queued_messages_for(devices as u64);
    u32::try_from(queued).unwrap_or(u32::MAX)
}
