//! `idem-bench`'s command line (what `scripts/bench` passes through): the
//! flags with their defaults, parsed by clap, and the checks that turn them
//! into the [`Args`] a run uses. No flag reads an environment variable:
//! the environment's `IDEM_*` variables are the server's.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};

use crate::fleet::DEVICES_PER_PROCESS;

/// Reports in the ingest burst when `--heartbeats` is not given.
const DEFAULT_BURST: usize = 100_000;

/// The fleet-scale benchmark behind `scripts/bench`: a simulated fleet
/// against a real idem-server, a private Mosquitto and a fresh database.
#[derive(Debug, Parser)]
#[command(
    name = "idem-bench",
    // A flag given twice takes its last value (`scripts/bench` passes
    // `--server-bin` and `--out` before the caller's own flags).
    args_override_self = true,
    after_help = "Every IDEM_* variable (and RUST_LOG) in the environment is passed on to the server."
)]
struct Cli {
    /// The idem-server binary to benchmark (release build).
    #[arg(long, value_name = "PATH")]
    server_bin: PathBuf,

    /// Where to write the JSON results.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,

    /// Fleet size.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    devices: usize,

    /// Devices drifted for the converged pass.
    #[arg(long, value_name = "N", default_value_t = 4)]
    drifted: usize,

    /// Reports per device in the ingest burst (0, the default: a burst of
    /// 100,000 reports, 10 each at 10,000 devices).
    #[arg(long, value_name = "K", default_value_t = 0)]
    heartbeats: u32,

    /// New device connections per second (0 = all at once).
    #[arg(long, value_name = "R", default_value_t = 0)]
    connect_rate: u32,

    /// Connection attempts in flight (0 = unbounded).
    #[arg(long, value_name = "M", default_value_t = idem_device_sim::DEFAULT_MAX_CONNECTING)]
    max_connecting: usize,

    /// Equal waves of the rollout step (1 to 100): 1 measures writing
    /// pushes ahead, more add one wave boundary each.
    #[arg(long, value_name = "W", default_value_t = 10)]
    rollout_waves: u32,

    /// Server instances for the "instances" steps (1 to 5): with more than
    /// one, every instance shares the fleet's subscriptions, the converged
    /// pass and the full push run again with all of them, and the engine's
    /// holder is killed at the end to time the takeover.
    #[arg(long, value_name = "N", default_value_t = 1)]
    instances: usize,

    /// Run `perf record -g` during STEP (connect, converged, normal, forced,
    /// full_push, rollout, ingest); data in perf-STEP.data.
    #[arg(long, value_name = "STEP")]
    perf: Option<String>,

    /// Profile the server only, or all CPUs.
    #[arg(long, value_name = "S", value_enum, default_value_t = PerfScope::Server)]
    perf_scope: PerfScope,

    /// Keep the server's log there (e.g. with
    /// RUST_LOG=info,sqlx::query=debug for statement timings).
    #[arg(long, value_name = "FILE")]
    server_log: Option<PathBuf>,

    /// Edge brokers bridged to the core broker, one fleet worker process
    /// each (default: none up to 18,000 devices, else one per 18,000
    /// devices).
    #[arg(long, value_name = "E")]
    edges: Option<usize>,

    /// The deployment shape: TLS-only broker, the server and every device
    /// (and the counting subscriber) on their own password accounts,
    /// operator token on the API; without it: plain MQTT, anonymous, no
    /// tokens (--insecure-no-auth).
    #[arg(long)]
    secure: bool,

    /// Soak instead of the benchmark's steps (`scripts/soak`): the fleet
    /// stays connected for --duration while the server resyncs every
    /// --resync, --drift-percent of the fleet drifts each minute and the
    /// desired spec changes every --change-every; samples go to --out (CSV).
    #[arg(long)]
    soak: bool,

    /// How long the soak runs (e.g. 90s, 10m, 1h).
    #[arg(long, value_name = "D", default_value = "1h", value_parser = parse_duration)]
    duration: Duration,

    /// The server's resync interval during the soak.
    #[arg(long, value_name = "D", default_value = "60s", value_parser = parse_duration)]
    resync: Duration,

    /// Percent of the fleet that drifts each minute of the soak (at least
    /// one device).
    #[arg(long, value_name = "P", default_value_t = 0.1)]
    drift_percent: f64,

    /// How often the soak changes the fleet's desired spec.
    #[arg(long, value_name = "D", default_value = "10m", value_parser = parse_duration)]
    change_every: Duration,

    /// How often the soak samples memory, files, the database and lag.
    #[arg(long, value_name = "D", default_value = "10s", value_parser = parse_duration)]
    sample_every: Duration,
}

/// `90s`, `10m`, `1h` (a whole number and one unit) as a duration.
fn parse_duration(raw: &str) -> Result<Duration, String> {
    let split = raw
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{raw:?}: give a unit (s, m or h), e.g. 90s, 10m, 1h"))?;
    let (number, unit) = raw.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{raw:?}: expected a whole number before the unit"))?;
    let seconds = match unit {
        "s" => Some(number),
        "m" => number.checked_mul(60),
        "h" => number.checked_mul(3_600),
        _ => return Err(format!("{raw:?}: the unit must be s, m or h")),
    }
    .ok_or_else(|| format!("{raw:?}: too long"))?;
    if seconds == 0 {
        return Err(format!("{raw:?}: must be longer than zero"));
    }
    Ok(Duration::from_secs(seconds))
}

/// What `--perf` profiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PerfScope {
    /// The server process only.
    Server,
    /// Every CPU of the machine.
    All,
}

/// A run's settings: the flags, checked, with the defaults that depend on
/// other flags filled in.
#[derive(Debug, Clone)]
pub struct Args {
    pub server_bin: PathBuf,
    pub out: Option<PathBuf>,
    pub devices: usize,
    pub drifted: usize,
    /// At least 1.
    pub heartbeats: u32,
    pub connect_rate: u32,
    pub max_connecting: usize,
    /// 1 to 100.
    pub rollout_waves: u32,
    /// 1 to 5.
    pub instances: usize,
    pub perf: Option<String>,
    pub edges: Option<usize>,
    pub secure: bool,
    /// `perf record` profiles every CPU, not only the server.
    pub perf_all: bool,
    pub server_log: Option<PathBuf>,
    /// `--soak`: its settings; `None` runs the benchmark's steps.
    pub soak: Option<Soak>,
}

/// The soak's settings (`--soak`).
#[derive(Debug, Clone)]
pub struct Soak {
    pub duration: Duration,
    pub resync: Duration,
    /// Devices that drift each minute: at least one.
    pub drift_per_minute: usize,
    pub change_every: Duration,
    pub sample_every: Duration,
}

impl Args {
    /// The process's arguments; `--help` and clap's refusals exit here.
    pub fn from_command_line() -> Result<Self> {
        Self::checked(Cli::parse())
    }

    /// What `argv` (with the program name first) asks for.
    #[cfg(test)]
    fn parse_from<I: AsRef<str>>(argv: impl IntoIterator<Item = I>) -> Result<Self> {
        let argv = argv.into_iter().map(|arg| arg.as_ref().to_owned());
        Self::checked(Cli::try_parse_from(argv)?)
    }

    fn checked(cli: Cli) -> Result<Self> {
        let heartbeats = match cli.heartbeats {
            0 => u32::try_from((DEFAULT_BURST / cli.devices.max(1)).max(1)).unwrap_or(1),
            given => given,
        };
        let args = Self {
            server_bin: cli.server_bin,
            out: cli.out,
            devices: cli.devices,
            drifted: cli.drifted,
            heartbeats,
            connect_rate: cli.connect_rate,
            max_connecting: cli.max_connecting,
            rollout_waves: cli.rollout_waves,
            instances: cli.instances,
            perf: cli.perf,
            edges: cli.edges,
            secure: cli.secure,
            perf_all: cli.perf_scope == PerfScope::All,
            server_log: cli.server_log,
            soak: cli.soak.then(|| Soak {
                duration: cli.duration,
                resync: cli.resync,
                drift_per_minute: ((cli.devices as f64 * cli.drift_percent / 100.0).round()
                    as usize)
                    .max(1),
                change_every: cli.change_every,
                sample_every: cli.sample_every,
            }),
        };
        if !(cli.drift_percent > 0.0 && cli.drift_percent <= 100.0) {
            bail!("--drift-percent must be above 0 and at most 100");
        }
        if args.server_bin.as_os_str().is_empty() {
            bail!("--server-bin is required (the idem-server binary to benchmark)");
        }
        if args.devices == 0 || args.drifted == 0 || args.drifted > args.devices {
            bail!("need 0 < --drifted <= --devices");
        }
        if !(1..=100).contains(&args.rollout_waves) {
            bail!("--rollout-waves must be 1 to 100");
        }
        if !(1..=5).contains(&args.instances) {
            bail!("--instances must be 1 to 5");
        }
        if args.secure && args.edge_count() > 0 {
            bail!(
                "--secure runs on one broker: use at most {DEVICES_PER_PROCESS} devices and no --edges"
            );
        }
        if args.edge_count() > args.devices {
            bail!("--edges must not exceed --devices");
        }
        Ok(args)
    }

    /// Edge brokers (and fleet worker processes) this run uses.
    pub fn edge_count(&self) -> usize {
        self.edges.unwrap_or(if self.devices > DEVICES_PER_PROCESS {
            self.devices.div_ceil(DEVICES_PER_PROCESS)
        } else {
            0
        })
    }

    /// Devices one simulator process holds.
    pub fn devices_per_process(&self) -> usize {
        self.devices.div_ceil(self.edge_count().max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn args(flags: &[&str]) -> Result<Args> {
        Args::parse_from(["idem-bench"].iter().chain(flags))
    }

    #[test]
    fn only_the_server_binary_is_required_and_the_rest_has_the_documented_defaults() {
        let a = args(&["--server-bin", "target/release/idem-server"]).unwrap();
        assert_eq!(a.server_bin, PathBuf::from("target/release/idem-server"));
        assert_eq!((a.devices, a.drifted, a.heartbeats), (10_000, 4, 10));
        assert_eq!((a.connect_rate, a.max_connecting), (0, 100));
        assert_eq!(a.rollout_waves, 10);
        assert!(args(&["--server-bin", "s", "--rollout-waves", "0"]).is_err());
        assert_eq!(a.instances, 1);
        assert!(args(&["--server-bin", "s", "--instances", "0"]).is_err());
        assert!(args(&["--server-bin", "s", "--instances", "6"]).is_err());
        assert!(args(&["--server-bin", "s", "--rollout-waves", "101"]).is_err());
        assert_eq!(
            args(&["--server-bin", "s", "--rollout-waves", "1"])
                .unwrap()
                .rollout_waves,
            1
        );
        assert_eq!(
            (&a.out, &a.perf, a.edges, &a.server_log),
            (&None, &None, None, &None)
        );
        assert!(!a.secure && !a.perf_all);
        assert_eq!((a.edge_count(), a.devices_per_process()), (0, 10_000));
        assert!(args(&[]).is_err());
        assert!(args(&["--server-bin", ""]).is_err());
    }

    #[test]
    fn every_flag_sets_its_value() {
        let a = args(&[
            "--server-bin=s",
            "--out",
            "o.json",
            "--devices",
            "2000",
            "--drifted",
            "7",
            "--heartbeats",
            "3",
            "--connect-rate",
            "500",
            "--max-connecting",
            "0",
            "--perf",
            "full_push",
            "--perf-scope",
            "all",
            "--server-log",
            "server.log",
            "--edges",
            "2",
        ])
        .unwrap();
        assert_eq!(a.out, Some(PathBuf::from("o.json")));
        assert_eq!((a.devices, a.drifted, a.heartbeats), (2000, 7, 3));
        assert_eq!((a.connect_rate, a.max_connecting), (500, 0));
        assert_eq!(a.perf.as_deref(), Some("full_push"));
        assert!(a.perf_all);
        assert_eq!(a.server_log, Some(PathBuf::from("server.log")));
        assert_eq!((a.edge_count(), a.devices_per_process()), (2, 1000));
        let secure = args(&["--server-bin", "s", "--secure", "--perf-scope", "server"]).unwrap();
        assert!(secure.secure && !secure.perf_all);
    }

    #[test]
    fn a_flag_given_twice_takes_its_last_value_as_scripts_bench_relies_on() {
        let a = args(&[
            "--server-bin",
            "first",
            "--out",
            "default.json",
            "--secure",
            "--out",
            "mine.json",
            "--server-bin",
            "second",
            "--secure",
        ])
        .unwrap();
        assert_eq!(a.server_bin, PathBuf::from("second"));
        assert_eq!(a.out, Some(PathBuf::from("mine.json")));
        assert!(a.secure);
    }

    #[test]
    fn the_ingest_burst_defaults_to_100000_reports_and_at_least_one_per_device() {
        let heartbeats = |devices: &str| {
            args(&[
                "--server-bin",
                "s",
                "--devices",
                devices,
                "--heartbeats",
                "0",
            ])
            .unwrap()
            .heartbeats
        };
        assert_eq!(heartbeats("10000"), 10);
        assert_eq!(heartbeats("2000"), 50);
        assert_eq!(heartbeats("100000"), 1);
        assert_eq!(heartbeats("300000"), 1);
    }

    #[test]
    fn large_fleets_spread_over_one_edge_per_18000_devices() {
        let a = args(&[
            "--server-bin",
            "s",
            "--devices",
            "100000",
            "--drifted",
            "40",
        ])
        .unwrap();
        assert_eq!((a.edge_count(), a.devices_per_process()), (6, 16_667));
    }

    #[test]
    fn inconsistent_flags_are_refused_with_the_fix() {
        let refusal = |flags: &[&str]| {
            let mut argv = vec!["--server-bin", "s"];
            argv.extend_from_slice(flags);
            args(&argv).unwrap_err().to_string()
        };
        assert!(refusal(&["--drifted", "0"]).contains("0 < --drifted <= --devices"));
        assert!(refusal(&["--devices", "3", "--drifted", "4"]).contains("--drifted <= --devices"));
        assert!(refusal(&["--secure", "--edges", "1"]).contains("at most 18000 devices"));
        assert!(refusal(&["--devices", "4", "--edges", "5"]).contains("must not exceed"));
        assert!(args(&["--server-bin", "s", "--perf-scope", "cores"]).is_err());
        assert!(args(&["--server-bin", "s", "--frobnicate"]).is_err());
    }

    #[test]
    fn the_soak_defaults_to_an_hour_resyncing_every_minute_with_a_tenth_of_a_percent_drifting() {
        assert!(args(&["--server-bin", "s"]).unwrap().soak.is_none());
        let soak = args(&["--server-bin", "s", "--soak"])
            .unwrap()
            .soak
            .unwrap();
        assert_eq!(soak.duration, Duration::from_secs(3_600));
        assert_eq!(soak.resync, Duration::from_secs(60));
        assert_eq!(soak.drift_per_minute, 10);
        assert_eq!(soak.change_every, Duration::from_secs(600));
        assert_eq!(soak.sample_every, Duration::from_secs(10));
        let small = args(&[
            "--server-bin",
            "s",
            "--soak",
            "--devices",
            "20",
            "--drifted",
            "1",
        ])
        .unwrap()
        .soak
        .unwrap();
        assert_eq!(small.drift_per_minute, 1);
        let short = args(&[
            "--server-bin",
            "s",
            "--soak",
            "--duration",
            "90s",
            "--change-every",
            "2m",
        ])
        .unwrap()
        .soak
        .unwrap();
        assert_eq!(
            (short.duration, short.change_every),
            (Duration::from_secs(90), Duration::from_secs(120))
        );
        assert!(args(&["--server-bin", "s", "--duration", "1d"]).is_err());
        assert!(args(&["--server-bin", "s", "--duration", "0s"]).is_err());
        assert!(args(&["--server-bin", "s", "--duration", "10"]).is_err());
        assert!(args(&["--server-bin", "s", "--drift-percent", "0"]).is_err());
    }

    #[test]
    fn no_flag_reads_the_environment() {
        for arg in Cli::command().get_arguments() {
            assert_eq!(arg.get_env(), None, "--{}", arg.get_id());
        }
    }
}
