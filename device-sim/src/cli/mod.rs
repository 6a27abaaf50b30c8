//! Command-line interface of `device-sim`: argument definitions (every flag
//! has an `IDEM_SIM_*` variable), validation with fix-it messages, and the
//! dispatch to one module per subcommand. Binary-only: errors are anyhow here.

mod demo;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use idem_device_sim::{
    default_desired_spec, BrokerAddr, Credentials, FleetConfig, FleetPlan, Plan, SimTls,
    DEFAULT_REJECT_MESSAGE,
};
use idem_protocol::TopicRoot;
use serde_json::Value;

/// Virtual MQTT devices speaking the idem protocol: thousands of them, one
/// connection each, with a known mix of drifted, rejecting and silent devices.
#[derive(Debug, Parser)]
#[command(name = "device-sim", version)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `idem_device_sim=debug`.
    #[arg(
        long,
        env = "IDEM_SIM_LOG",
        default_value = "warn,idem_device_sim=info",
        global = true
    )]
    pub log: String,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start the fleet and keep it connected and answering until Ctrl-C,
    /// printing periodic stats.
    Run(run::RunArgs),
    /// Register the fleet with an idem server, connect it, trigger one run,
    /// print the summary and timings, and check every device's outcome
    /// against the simulator's ground truth (exit 2 on a mismatch).
    Demo(demo::DemoArgs),
}

/// Runs the chosen subcommand.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Run(args) => run::run(args).await.map(|()| ExitCode::SUCCESS),
        Command::Demo(args) => demo::run(args).await,
    }
}

pub fn init_tracing(global: &GlobalArgs) {
    let filter = tracing_subscriber::EnvFilter::try_new(&global.log).unwrap_or_else(|error| {
        eprintln!(
            "device-sim: invalid --log / IDEM_SIM_LOG filter {:?} ({error}); using `warn`",
            global.log
        );
        tracing_subscriber::EnvFilter::new("warn")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// The simulated fleet: size, broker, naming and the mix of device states and
/// behaviours. Shared by every subcommand that starts devices.
#[derive(Debug, Clone, Args)]
pub struct FleetArgs {
    /// Number of simulated devices (one MQTT connection each).
    #[arg(long, env = "IDEM_SIM_DEVICES", default_value_t = 10_000)]
    pub devices: usize,

    /// MQTT broker: `mqtt://host:port` (plain TCP) or `mqtts://host:port`
    /// (TLS, default port 8883).
    #[arg(
        long,
        env = "IDEM_SIM_BROKER",
        default_value = "mqtt://127.0.0.1:1883",
        value_parser = idem_device_sim::parse_broker_url
    )]
    pub broker: BrokerAddr,

    /// PEM CA file the broker's certificate must chain to (`mqtts://`);
    /// without it, the system trust store.
    #[arg(long, env = "IDEM_SIM_CA_FILE")]
    pub ca_file: Option<PathBuf>,

    /// PEM client certificate every device presents (`mqtts://`); needs
    /// `--client-key`.
    #[arg(long, env = "IDEM_SIM_CLIENT_CERT", requires = "client_key")]
    pub client_cert: Option<PathBuf>,

    /// PEM private key of `--client-cert`.
    #[arg(long, env = "IDEM_SIM_CLIENT_KEY", requires = "client_cert")]
    pub client_key: Option<PathBuf>,

    /// File of `device-id:password` lines: each device logs in to the broker
    /// with its id as user name and its password (every device needs one).
    #[arg(long, env = "IDEM_SIM_CREDENTIALS_FILE")]
    pub credentials_file: Option<PathBuf>,

    /// Topic root shared with the server.
    #[arg(long, env = "IDEM_SIM_TOPIC_ROOT", default_value = idem_protocol::DEFAULT_TOPIC_ROOT)]
    pub topic_root: TopicRoot,

    /// Device ids are this prefix plus a zero-padded index (`sim-00042`).
    #[arg(long, env = "IDEM_SIM_ID_PREFIX", default_value = "sim-")]
    pub id_prefix: String,

    /// Devices that start on a spec other than the desired one (and accept the push).
    #[arg(long, env = "IDEM_SIM_DRIFTED", default_value_t = 0)]
    pub drifted: usize,

    /// Fraction of the devices (0.0–1.0) that start drifted; replaces `--drifted`.
    #[arg(long, env = "IDEM_SIM_DRIFT_RATIO", conflicts_with = "drifted")]
    pub drift_ratio: Option<f64>,

    /// Devices that start off-spec and reject every push.
    #[arg(long, env = "IDEM_SIM_REJECT", default_value_t = 0)]
    pub reject: usize,

    /// Fraction of the devices (0.0–1.0) that start off-spec and reject
    /// every push; replaces `--reject`.
    #[arg(long, env = "IDEM_SIM_REJECT_RATIO", conflicts_with = "reject")]
    pub reject_ratio: Option<f64>,

    /// Reason rejecting devices give.
    #[arg(long, env = "IDEM_SIM_REJECT_MESSAGE", default_value = DEFAULT_REJECT_MESSAGE)]
    pub reject_message: String,

    /// Devices that never report nor answer (the server must time them out).
    #[arg(long, env = "IDEM_SIM_SILENT", default_value_t = 0)]
    pub silent: usize,

    /// Devices that start off-spec, report, but ignore pushes.
    #[arg(long, env = "IDEM_SIM_IGNORE_PUSHES", default_value_t = 0)]
    pub ignore_pushes: usize,

    /// Seed choosing which devices drift, reject, … (same seed, same devices).
    #[arg(long, env = "IDEM_SIM_SEED", default_value_t = 1)]
    pub seed: u64,

    /// Desired spec (JSON) the non-drifted devices run; drifted ones run it
    /// with another "version".
    #[arg(long, env = "IDEM_SIM_DESIRED_SPEC", value_parser = parse_json)]
    pub desired_spec: Option<Value>,

    /// Generation reported by devices already on the desired spec.
    #[arg(long, env = "IDEM_SIM_INITIAL_GENERATION", default_value_t = 1)]
    pub initial_generation: u64,

    /// Delay before a device answers a push, in ms: `N` or a range `MIN-MAX`.
    #[arg(long, env = "IDEM_SIM_APPLY_LATENCY_MS", default_value = "0", value_parser = parse_latency)]
    pub apply_latency_ms: (Duration, Duration),

    /// New connections per second while starting; 0 = as fast as possible.
    #[arg(long, env = "IDEM_SIM_CONNECT_RATE", default_value_t = 0)]
    pub connect_rate: u32,

    /// Connection attempts in flight at once (0 = unbounded); keep it at or
    /// below the broker's listen backlog (Mosquitto: 100) so no handshake is
    /// dropped and retried a second later.
    #[arg(long, env = "IDEM_SIM_MAX_CONNECTING", default_value_t = idem_device_sim::DEFAULT_MAX_CONNECTING)]
    pub max_connecting: usize,

    /// MQTT keep-alive in seconds (0 = off).
    #[arg(long, env = "IDEM_SIM_KEEP_ALIVE_SECS", default_value_t = 60)]
    pub keep_alive_secs: u64,

    /// Send a report every N seconds per device (heartbeat); 0 = off.
    #[arg(long, env = "IDEM_SIM_REPORT_INTERVAL_SECS", default_value_t = 0)]
    pub report_interval_secs: u64,

    /// MQTT client id prefix; default is `{topic-root}/`, so the client id
    /// is `{topic-root}/{device-id}`.
    #[arg(long, env = "IDEM_SIM_CLIENT_ID_PREFIX")]
    pub client_id_prefix: Option<String>,
}

impl FleetArgs {
    /// `--drifted`, or `--drift-ratio` of `--devices` rounded to a whole device.
    pub fn drifted_count(&self) -> anyhow::Result<usize> {
        match self.drift_ratio {
            None => Ok(self.drifted),
            Some(r) if (0.0..=1.0).contains(&r) => Ok((r * self.devices as f64).round() as usize),
            Some(r) => anyhow::bail!("--drift-ratio must be between 0.0 and 1.0, got {r}"),
        }
    }

    /// `--reject`, or `--reject-ratio` of `--devices` rounded to a whole device.
    pub fn reject_count(&self) -> anyhow::Result<usize> {
        match self.reject_ratio {
            None => Ok(self.reject),
            Some(r) if (0.0..=1.0).contains(&r) => Ok((r * self.devices as f64).round() as usize),
            Some(r) => anyhow::bail!("--reject-ratio must be between 0.0 and 1.0, got {r}"),
        }
    }

    /// The plan (device configs + ground truth) these arguments describe.
    pub fn plan(&self) -> anyhow::Result<Plan> {
        FleetPlan::new(self.id_prefix.clone(), self.devices)
            .desired_spec(self.desired_spec.clone().unwrap_or_else(default_desired_spec))
            .drifted(self.drifted_count()?)
            .rejecting(self.reject_count()?)
            .reject_message(self.reject_message.clone())
            .silent(self.silent)
            .ignoring_pushes(self.ignore_pushes)
            .seed(self.seed)
            .initial_generation(Some(self.initial_generation))
            .apply_latency(self.apply_latency_ms.0, self.apply_latency_ms.1)
            .build()
            .context("invalid fleet (check --devices, --drifted, --reject, --silent, --ignore-pushes, --id-prefix)")
    }

    /// The fleet configuration for `plan`'s devices.
    pub fn fleet_config(&self, plan: &Plan) -> anyhow::Result<FleetConfig> {
        let mut config = FleetConfig::new(
            self.broker.clone(),
            self.topic_root.clone(),
            plan.devices.clone(),
        );
        config.keep_alive = Duration::from_secs(self.keep_alive_secs);
        config.connect_rate = self.connect_rate;
        config.max_connecting = self.max_connecting;
        config.report_interval =
            (self.report_interval_secs > 0).then(|| Duration::from_secs(self.report_interval_secs));
        config.client_id_prefix = self.client_id_prefix.clone();
        if self.broker.tls {
            let client = self.client_cert.as_deref().zip(self.client_key.as_deref());
            config.tls =
                Some(SimTls::from_files(self.ca_file.as_deref(), client).context(
                    "invalid TLS settings (check --ca-file, --client-cert, --client-key)",
                )?);
        } else if self.ca_file.is_some() || self.client_cert.is_some() {
            anyhow::bail!(
                "--ca-file / --client-cert apply to TLS only: use an mqtts:// --broker, or drop them"
            );
        }
        if let Some(path) = &self.credentials_file {
            config.credentials = Some(Credentials::from_file(path)?);
        }
        config.validate().context("invalid fleet configuration")?;
        Ok(config)
    }
}

fn parse_json(raw: &str) -> Result<Value, String> {
    serde_json::from_str(raw).map_err(|e| format!("not valid JSON: {e}"))
}

/// `"50"` → 50..=50 ms, `"10-200"` → 10..=200 ms.
fn parse_latency(raw: &str) -> Result<(Duration, Duration), String> {
    let ms = |s: &str| {
        s.trim()
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|_| format!("{s:?} is not a whole number of milliseconds"))
    };
    let (min, max) = match raw.split_once('-') {
        Some((min, max)) => (ms(min)?, ms(max)?),
        None => {
            let v = ms(raw)?;
            (v, v)
        }
    };
    if min > max {
        return Err(format!("range {raw:?} is inverted; write MIN-MAX"));
    }
    Ok((min, max))
}

/// Raises this process's open-file soft limit to the hard limit: every device
/// is one socket. Returns the limit now in effect.
pub fn raise_fd_limit(devices: usize) -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => {
            if limit < devices as u64 + 64 {
                tracing::warn!(
                    limit,
                    devices,
                    "open-file limit is below the device count; raise it (e.g. `ulimit -n 65536`) or use fewer devices"
                );
            }
            limit
        }
        Err(error) => {
            tracing::warn!(%error, "could not raise the open-file limit");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_drift_ratio_picks_that_share_of_the_fleet() {
        let cli = Cli::try_parse_from([
            "device-sim",
            "run",
            "--devices",
            "10000",
            "--drift-ratio",
            "0.0004",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("expected run")
        };
        assert_eq!(args.fleet.drifted_count().unwrap(), 4);
        assert_eq!(args.fleet.plan().unwrap().expected_counts().provisioned, 4);
        let cli = Cli::try_parse_from(["device-sim", "run", "--drift-ratio", "1.5"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("expected run")
        };
        assert!(args.fleet.drifted_count().is_err());
        assert!(Cli::try_parse_from([
            "device-sim",
            "run",
            "--drifted",
            "1",
            "--drift-ratio",
            "0.1"
        ])
        .is_err());
    }

    #[test]
    fn every_flag_has_an_idem_sim_environment_variable() {
        let cmd = Cli::command();
        for sub in cmd.get_subcommands() {
            for arg in sub.get_arguments() {
                if arg.get_id() == "help" || arg.get_id() == "version" {
                    continue;
                }
                let env = arg.get_env().and_then(|e| e.to_str()).unwrap_or("");
                assert!(
                    env.starts_with("IDEM_SIM_"),
                    "--{} has no IDEM_SIM_* variable",
                    arg.get_id()
                );
            }
        }
    }

    #[test]
    fn latency_accepts_a_value_or_a_range() {
        let ms = Duration::from_millis;
        assert_eq!(parse_latency("50"), Ok((ms(50), ms(50))));
        assert_eq!(parse_latency("10-200"), Ok((ms(10), ms(200))));
        assert!(parse_latency("200-10").is_err());
        assert!(parse_latency("fast").is_err());
    }

    #[test]
    fn run_defaults_describe_a_10000_device_fleet_on_the_local_broker() {
        let cli = Cli::try_parse_from(["device-sim", "run", "--drifted", "4"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("parsed as another subcommand")
        };
        assert_eq!(args.fleet.devices, 10_000);
        assert_eq!(args.fleet.broker, BrokerAddr::new("127.0.0.1", 1883));
        let plan = args.fleet.plan().unwrap();
        assert_eq!(
            plan.expected_counts().summary(),
            "9,996 already converged, 4 provisioned, 0 failed"
        );
    }

    #[test]
    fn demo_defaults_target_the_local_server_with_10000_devices() {
        let cli = Cli::try_parse_from(["device-sim", "demo", "--drifted", "4"]).unwrap();
        let Command::Demo(args) = cli.command else {
            panic!("parsed as another subcommand")
        };
        assert_eq!(args.server, "http://127.0.0.1:8080");
        assert_eq!(args.fleet.devices, 10_000);
        assert!(!args.json && !args.quiet && !args.keep_running);
        assert_eq!(
            args.fleet.plan().unwrap().expected_counts().summary(),
            "9,996 already converged, 4 provisioned, 0 failed"
        );
        assert!(Cli::try_parse_from(["device-sim", "demo", "--json", "--quiet"]).is_err());
    }

    #[test]
    fn a_bad_broker_url_is_refused_with_a_hint() {
        let err = Cli::try_parse_from(["device-sim", "run", "--broker", "ws://x"]).unwrap_err();
        assert!(err.to_string().contains("mqtts://"), "{err}");
    }

    #[test]
    fn tls_and_credential_flags_parse_and_tls_files_need_mqtts() {
        let cli = Cli::try_parse_from([
            "device-sim",
            "demo",
            "--broker",
            "mqtts://127.0.0.1",
            "--ca-file",
            "/tmp/ca.pem",
            "--credentials-file",
            "/tmp/creds",
            "--token",
            "tok-123",
        ])
        .unwrap();
        let Command::Demo(args) = cli.command else {
            panic!("parsed as another subcommand")
        };
        assert_eq!(args.fleet.broker, BrokerAddr::tls("127.0.0.1", 8883));
        assert_eq!(args.token.as_ref().map(|t| t.expose()), Some("tok-123"));
        assert!(!format!("{args:?}").contains("tok-123"));
        assert!(Cli::try_parse_from(["device-sim", "run", "--client-cert", "/tmp/c.pem"]).is_err());

        let cli = Cli::try_parse_from([
            "device-sim",
            "run",
            "--devices",
            "1",
            "--ca-file",
            "/tmp/ca.pem",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("parsed as another subcommand")
        };
        let plan = args.fleet.plan().unwrap();
        let err = args.fleet.fleet_config(&plan).unwrap_err().to_string();
        assert!(err.contains("mqtts://"), "{err}");
    }
}
