//! `device-sim demo`: the newcomer demo against a running idem server.
//! Parses flags, shows progress bars (indicatif) and prints the report; the
//! work itself is `idem_device_sim::demo`. Exit status: 0 when the server's
//! outcomes match the ground truth, 2 when they do not, 1 on errors.

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use idem_device_sim::demo::Latency;
use idem_device_sim::memory::{format_bytes, peak_rss_bytes};
use idem_device_sim::{
    format_count, run_demo, ClientAuth, DemoObserver, DemoPhase, DemoReport, DemoRollout,
    DemoSettings, Fleet, RolloutReport, SecretString,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::{raise_fd_limit, FleetArgs};

/// Exit status when the server's outcomes differ from the ground truth.
const MISMATCH_EXIT: u8 = 2;

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub fleet: FleetArgs,

    /// The idem server's HTTP API (`http://` or `https://`).
    #[arg(long, env = "IDEM_SIM_SERVER", default_value = "http://127.0.0.1:8080")]
    pub server: String,

    /// Operator token for the API, sent as `Authorization: Bearer …`
    /// (prefer `--token-file`: a flag's value shows in the process list).
    #[arg(long, env = "IDEM_SIM_TOKEN", hide_env_values = true)]
    pub token: Option<SecretString>,

    /// A file holding the operator token (mode 0600; a trailing newline is
    /// ignored), instead of `--token`: the token stays off the command line
    /// and out of the environment.
    #[arg(long, env = "IDEM_SIM_TOKEN_FILE", conflicts_with = "token")]
    pub token_file: Option<PathBuf>,

    /// PEM CA file for an `https://` server; without it, the system trust store.
    #[arg(long, env = "IDEM_SIM_API_CA_FILE")]
    pub api_ca_file: Option<PathBuf>,

    /// Longest wait, in seconds, for the fleet to connect and report, and
    /// again for the run to complete.
    #[arg(long, env = "IDEM_SIM_TIMEOUT", default_value_t = 300)]
    pub timeout: u64,

    /// Devices registered per `POST /v1/devices` request.
    #[arg(long, env = "IDEM_SIM_REGISTER_CHUNK", default_value_t = 1_000)]
    pub register_chunk: usize,

    /// A shell command to run after registering the fleet and before
    /// connecting it, e.g. to regenerate the broker's password file from
    /// the accounts the server issued (see scripts/demo).
    #[arg(long, env = "IDEM_SIM_AFTER_REGISTER")]
    pub after_register: Option<String>,

    /// Print the report as JSON on stdout (no progress bars).
    #[arg(long, env = "IDEM_SIM_JSON", conflicts_with = "quiet")]
    pub json: bool,

    /// Print only the summary line (and problems).
    #[arg(long, env = "IDEM_SIM_QUIET")]
    pub quiet: bool,

    /// After the check, keep the fleet connected and answering until Ctrl-C
    /// (to explore the server with live devices).
    #[arg(long, env = "IDEM_SIM_KEEP_RUNNING")]
    pub keep_running: bool,

    /// Run the change as a staged rollout in these cumulative waves over
    /// the devices that need a push, e.g. `"1%,10%,100%"` or `"10,500,100%"`;
    /// a wave whose gate is breached pauses it, and the demo prints why and
    /// aborts it.
    #[arg(long, env = "IDEM_SIM_ROLLOUT")]
    pub rollout: Option<String>,

    /// The gate of every rollout wave: at most this fraction of a wave's
    /// devices may fail.
    #[arg(
        long,
        env = "IDEM_SIM_GATE_MAX_FAILURE_RATIO",
        default_value_t = 0.02,
        requires = "rollout"
    )]
    pub gate_max_failure_ratio: f64,
}

impl DemoArgs {
    /// The operator token: `--token`, or the content of `--token-file`
    /// (one line, its trailing newline removed); `None` without either.
    pub fn api_token(&self) -> anyhow::Result<Option<SecretString>> {
        match (&self.token, &self.token_file) {
            (Some(token), _) => Ok(Some(token.clone())),
            (None, Some(path)) => read_token_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }
}

/// Reads a token file; the error names the file, never its content.
fn read_token_file(path: &Path) -> anyhow::Result<SecretString> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "cannot read the token file {} (--token-file / IDEM_SIM_TOKEN_FILE)",
            path.display()
        )
    })?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.trim().is_empty() {
        anyhow::bail!(
            "the token file {} is empty: write the operator token into it \
             (`idem-server token create … > FILE`)",
            path.display()
        );
    }
    if token.contains(['\n', '\r']) {
        anyhow::bail!(
            "the token file {} holds more than one line: it must hold only the operator token",
            path.display()
        );
    }
    Ok(SecretString::new(token))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    Text,
    Quiet,
    Json,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let output = if args.json {
        Output::Json
    } else if args.quiet {
        Output::Quiet
    } else {
        Output::Text
    };
    let plan = args.fleet.plan()?;
    let config = args.fleet.fleet_config(&plan)?;
    let fd_limit = raise_fd_limit(plan.devices.len());
    let mut settings = DemoSettings::new(
        args.server.clone(),
        plan,
        config.broker.clone(),
        config.topic_root.clone(),
    );
    settings.fleet = config;
    settings.timeout = Duration::from_secs(args.timeout.max(1));
    settings.register_chunk = args.register_chunk.max(1);
    settings.auth = ClientAuth {
        token: args.api_token()?,
        ca_file: args.api_ca_file.clone(),
    };
    settings.after_register = args.after_register.clone();
    settings.rollout = args
        .rollout
        .as_deref()
        .map(|waves| DemoRollout::parse(waves, args.gate_max_failure_ratio))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if output == Output::Text {
        print_intro(&args, &settings, fd_limit);
    }
    let show_bars = output == Output::Text && std::io::stdout().is_terminal();
    let observer = Bars::new(show_bars);
    let demo = run_demo(settings, &observer)
        .await
        .context("the demo could not finish")?;
    let report = demo.report;
    let fleet = demo.fleet;
    print_report(&report, output)?;

    if args.keep_running {
        if output != Output::Json {
            println!(
                "keeping {} devices connected; Ctrl-C to stop",
                format_count(fleet.len() as u64)
            );
        }
        super::run::shutdown_signal().await?;
    }
    shutdown(fleet, output).await;
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(MISMATCH_EXIT)
    })
}

/// What the demo is about to do, and what a correct server's run reads.
fn print_intro(args: &DemoArgs, settings: &DemoSettings, fd_limit: u64) {
    let f = &args.fleet;
    println!(
        "device-sim demo: {} devices ({} drifted, {} rejecting, {} silent; seed {}) against {}",
        format_count(f.devices as u64),
        f.drifted_count().unwrap_or(f.drifted),
        f.reject_count().unwrap_or(f.reject),
        f.silent,
        f.seed,
        args.server,
    );
    println!(
        "  broker {} · topic root {} · open-file limit {fd_limit}",
        settings.fleet.broker, settings.fleet.topic_root
    );
    match &settings.rollout {
        None => println!(
            "  a correct server's run reads: {}",
            settings.plan.expected_counts()
        ),
        Some(rollout) => {
            let expected = settings.plan.expected_counts();
            println!(
                "  a staged rollout in waves {} (gate: at most {} of a wave failing) over the \
                 {} devices that need a push; {} already converged are decided at the start",
                rollout.waves.join(", "),
                rollout.max_failure_ratio,
                format_count((expected.provisioned + expected.failed) as u64),
                format_count(expected.already_converged as u64),
            )
        }
    }
}

/// The report in the chosen output form.
fn print_report(report: &DemoReport, output: Output) -> anyhow::Result<()> {
    let peak_rss = peak_rss_bytes();
    match output {
        Output::Json => {
            let mut value = serde_json::to_value(report).context("encoding the report")?;
            value["passed"] = report.passed().into();
            value["simulator_peak_rss_bytes"] = peak_rss.into();
            println!(
                "{}",
                serde_json::to_string_pretty(&value).context("encoding the report")?
            );
        }
        Output::Quiet => {
            println!("{}", report.summary);
            for line in problem_lines(report) {
                eprintln!("{line}");
            }
        }
        Output::Text => {
            for line in text_lines(report, peak_rss) {
                println!("{line}");
            }
        }
    }

    Ok(())
}

async fn shutdown(fleet: Fleet, output: Output) {
    let devices = fleet.len();
    let started = std::time::Instant::now();
    if let Err(e) = fleet.shutdown().await {
        // The report above stands; a fleet that does not stop is the
        // simulator's own fault, said but not counted against the server.
        eprintln!("device-sim: {e}");
        return;
    }
    if output == Output::Text {
        println!(
            "disconnected {} devices in {:.2} s",
            format_count(devices as u64),
            started.elapsed().as_secs_f64()
        );
    }
}

/// The human-readable report.
fn text_lines(report: &DemoReport, peak_rss: Option<u64>) -> Vec<String> {
    let t = &report.timings;
    let n = format_count(report.devices as u64);
    let mut lines = vec![
        format!(
            "registered {n} devices with their desired spec in {:.2} s",
            t.register_s
        ),
        format!(
            "connected {n} devices in {:.2} s; server stored their first reports after {:.2} s \
             (its applied-reports counter; confirmed device by device through the API at {:.2} s)",
            t.connect_s, t.reports_counted_s, t.reports_stored_s
        ),
        format!(
            "run {} ({} devices, targeting {}):",
            report.run_id, n, report.targeting
        ),
        String::new(),
        format!("    {}", report.summary),
        String::new(),
    ];
    if let Some(rollout) = &report.rollout {
        lines.extend(rollout_lines(rollout, report));
    }
    let server_ms = t
        .server_run_ms
        .map(|ms| format!(" (server: {ms} ms)"))
        .unwrap_or_default();
    lines.push(format!(
        "run duration {:.3} s from trigger to completed{server_ms}",
        t.run_s
    ));
    match (&t.convergence, &t.apply) {
        (Some(c), apply) => lines.push(format!(
            "convergence {} (simulator clock, run trigger → device sent its confirming report){}",
            latency_text(c),
            apply
                .as_ref()
                .map(|a| format!(
                    "; on the device, desired received → confirmed: {}",
                    latency_text(a)
                ))
                .unwrap_or_default()
        )),
        (None, _) => lines.push("convergence: no device was provisioned".to_owned()),
    }
    if !report.failed.is_empty() {
        lines.push(format!(
            "failed devices ({}):",
            format_count(report.failed.len() as u64)
        ));
        for f in &report.failed {
            lines.push(format!(
                "  {} — {}",
                f.device,
                f.reason.as_deref().unwrap_or("no reason given")
            ));
        }
    }
    if report.passed() {
        lines.push(format!(
            "ground truth: all {} outcomes match what the simulator knows",
            format_count(report.check.checked as u64)
        ));
    } else {
        lines.extend(problem_lines(report));
    }
    if let Some(peak) = peak_rss {
        lines.push(format!(
            "simulator peak RSS {} ({} per device)",
            format_bytes(peak as f64),
            format_bytes(peak as f64 / report.devices.max(1) as f64)
        ));
    }
    lines
}

/// The rollout's waves as they ended, and why it stopped.
fn rollout_lines(rollout: &RolloutReport, report: &DemoReport) -> Vec<String> {
    let needing: u64 = rollout.waves.iter().map(|w| w.size).sum();
    let mut lines = vec![format!(
        "rollout over the {} devices that needed a push ({} already converged at the start, in no wave):",
        format_count(needing),
        format_count(report.counts.already_converged),
    )];
    let total = rollout.waves.len();
    for wave in &rollout.waves {
        let mut parts = Vec::new();
        for (n, what) in [
            (wave.provisioned, "provisioned"),
            (wave.failed, "failed"),
            (wave.skipped, "skipped"),
            (wave.already_converged, "already converged"),
            (wave.superseded, "superseded"),
        ] {
            if n > 0 {
                parts.push(format!("{} {what}", format_count(n)));
            }
        }
        let outcomes = if parts.is_empty() {
            "nothing decided".to_owned()
        } else {
            parts.join(", ")
        };
        let state = serde_json::to_value(wave.state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        lines.push(format!(
            "  wave {}/{total}: {} devices — {outcomes} — {state}",
            wave.index + 1,
            format_count(wave.size),
        ));
    }
    match &rollout.paused {
        Some(paused) => {
            let wave = rollout.waves.get(paused.wave as usize);
            let figures = match (&paused.gate, paused.limit, paused.observed, wave) {
                (Some(gate), Some(limit), Some(observed), Some(wave)) => format!(
                    "gate {gate} breached (observed {observed:.3}, limit {limit}); the wave \
                     ended with {} of its {} devices failed",
                    format_count(wave.failed),
                    format_count(wave.size),
                ),
                _ => format!("paused ({})", paused.reason),
            };
            lines.push(format!(
                "STOPPED in wave {}: {figures}; nothing more was pushed",
                paused.wave + 1
            ));
            if rollout.aborted {
                lines.push(
                    "aborted by the demo: the devices not yet pushed end skipped (aborted)"
                        .to_owned(),
                );
            }
        }
        None => lines.push("every wave passed its gate".to_owned()),
    }
    lines.push(String::new());
    lines
}

fn latency_text(l: &Latency) -> String {
    format!(
        "p50 {:.1} ms, p99 {:.1} ms over {} device{}",
        l.p50_ms,
        l.p99_ms,
        l.samples,
        if l.samples == 1 { "" } else { "s" }
    )
}

/// What went wrong, naming the devices; empty when the demo passed.
fn problem_lines(report: &DemoReport) -> Vec<String> {
    let mut lines = Vec::new();
    if report.summary != report.expected_summary {
        lines.push(format!(
            "MISMATCH: the server's summary is {:?}, the simulator expected {:?}",
            report.summary, report.expected_summary
        ));
    }
    if !report.check.passed() {
        lines.push(format!(
            "MISMATCH: {} of {} devices differ from the ground truth:",
            format_count(report.check.mismatches.len() as u64),
            format_count(report.check.checked as u64)
        ));
        lines.extend(report.check.mismatches.iter().map(|m| format!("  {m}")));
    }
    lines
}

/// Progress bars, one per phase, on stderr; hidden when not wanted.
struct Bars {
    visible: bool,
    current: Mutex<Option<ProgressBar>>,
}

impl Bars {
    fn new(visible: bool) -> Self {
        Self {
            visible,
            current: Mutex::new(None),
        }
    }

    fn with_bar(&self, f: impl FnOnce(&ProgressBar)) {
        let guard = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(bar) = guard.as_ref() {
            f(bar);
        }
    }
}

impl DemoObserver for Bars {
    fn phase_started(&self, phase: DemoPhase, total: u64) {
        let bar = if self.visible {
            ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        let style = ProgressStyle::with_template(
            "{prefix:>10} [{bar:40}] {human_pos}/{human_len} {elapsed_precise} {per_sec}",
        )
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(match phase {
            DemoPhase::Register => "register",
            DemoPhase::Connect => "connect",
            DemoPhase::Report => "reports",
            DemoPhase::Run => "run",
        });
        bar.enable_steady_tick(Duration::from_millis(100));
        let mut guard = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(old) = guard.replace(bar) {
            old.finish_and_clear();
        }
    }

    fn progress(&self, _phase: DemoPhase, done: u64) {
        self.with_bar(|bar| bar.set_position(done));
    }

    fn phase_finished(&self, _phase: DemoPhase, _elapsed: Duration) {
        let mut guard = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(bar) = guard.take() {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_device_sim::{FleetPlan, FleetStats, GroundTruthCheck, Mismatch};
    use idem_protocol::OutcomeCounts;

    fn report() -> DemoReport {
        let plan = FleetPlan::new("d-", 10).drifted(1).build().unwrap();
        let expected = plan.expected_counts();
        DemoReport {
            server: "http://127.0.0.1:8080".into(),
            broker: "mqtt://127.0.0.1:1883".into(),
            topic_root: "idem/v1".into(),
            devices: 10,
            expected,
            expected_summary: expected.summary(),
            run_id: "r1".into(),
            targeting: "all",
            summary: "9 already converged, 1 provisioned, 0 failed".into(),
            counts: OutcomeCounts {
                already_converged: 9,
                provisioned: 1,
                ..OutcomeCounts::default()
            },
            timings: idem_device_sim::demo::DemoTimings {
                register_s: 0.1,
                connect_s: 0.2,
                reports_counted_s: 0.25,
                reports_stored_s: 0.3,
                run_s: 0.05,
                server_run_ms: Some(40),
                convergence: None,
                apply: None,
            },
            failed: vec![],
            check: GroundTruthCheck {
                checked: 10,
                mismatches: vec![],
            },
            fleet: FleetStats::default(),
            rollout: None,
        }
    }

    /// A file in the system's temporary directory, removed when dropped.
    struct TempFile(PathBuf);

    impl TempFile {
        fn with(name: &str, content: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "device-sim-{}-{}-{name}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            ));
            std::fs::write(&path, content).unwrap();
            Self(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn demo_args(extra: &[&str]) -> Result<DemoArgs, clap::Error> {
        use clap::Parser as _;
        let cli = super::super::Cli::try_parse_from(["device-sim", "demo"].iter().chain(extra))?;
        match cli.command {
            super::super::Command::Demo(args) => Ok(args),
            super::super::Command::Run(_) => panic!("parsed as another subcommand"),
        }
    }

    #[test]
    fn the_token_file_is_read_without_its_trailing_newline_and_never_shown() {
        let file = TempFile::with("token", "idem_0123abcd\n");
        let path = file.0.to_str().unwrap();
        let args = demo_args(&["--token-file", path]).unwrap();
        let token = args.api_token().unwrap().unwrap();
        assert_eq!(token.expose(), "idem_0123abcd");
        assert!(!format!("{args:?}").contains("idem_0123abcd"));
        let crlf = TempFile::with("token-crlf", "idem_0123abcd\r\n");
        let args = demo_args(&["--token-file", crlf.0.to_str().unwrap()]).unwrap();
        assert_eq!(args.api_token().unwrap().unwrap().expose(), "idem_0123abcd");
        // Without either, no token; --token alone is used as given.
        assert!(demo_args(&[]).unwrap().api_token().unwrap().is_none());
        let args = demo_args(&["--token", "tok-1"]).unwrap();
        assert_eq!(args.api_token().unwrap().unwrap().expose(), "tok-1");
    }

    #[test]
    fn a_token_and_a_token_file_together_are_refused() {
        let file = TempFile::with("token-both", "idem_x\n");
        let err =
            demo_args(&["--token", "tok-1", "--token-file", file.0.to_str().unwrap()]).unwrap_err();
        assert_eq!(
            err.kind(),
            clap::error::ErrorKind::ArgumentConflict,
            "{err}"
        );
    }

    #[test]
    fn an_empty_missing_or_multi_line_token_file_is_an_error_naming_the_file() {
        let empty = TempFile::with("token-empty", "\n");
        let path = empty.0.to_str().unwrap();
        let err = demo_args(&["--token-file", path])
            .unwrap()
            .api_token()
            .unwrap_err()
            .to_string();
        assert!(err.contains(path) && err.contains("is empty"), "{err}");

        let missing = std::env::temp_dir().join("device-sim-no-such-token-file");
        let missing = missing.to_str().unwrap();
        let err = demo_args(&["--token-file", missing])
            .unwrap()
            .api_token()
            .unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("cannot read the token file") && text.contains(missing),
            "{text}"
        );

        let two = TempFile::with("token-two", "idem_a\nidem_b\n");
        let err = demo_args(&["--token-file", two.0.to_str().unwrap()])
            .unwrap()
            .api_token()
            .unwrap_err()
            .to_string();
        assert!(err.contains("more than one line"), "{err}");
        assert!(!err.contains("idem_a"), "{err}");
    }

    #[test]
    fn a_passing_report_prints_the_server_summary_on_its_own_line() {
        let lines = text_lines(&report(), None);
        assert!(lines
            .iter()
            .any(|l| l.trim() == "9 already converged, 1 provisioned, 0 failed"));
        assert!(lines.iter().any(|l| l.starts_with("ground truth: all 10")));
        assert!(problem_lines(&report()).is_empty());
    }

    #[test]
    fn a_failing_report_names_every_mismatching_device() {
        let mut report = report();
        report.summary = "0 already converged, 10 provisioned, 0 failed".into();
        report.check.mismatches = vec![Mismatch {
            device: "d-00003".into(),
            expected: Some(idem_device_sim::ExpectedOutcome::AlreadyConverged),
            actual: Some("provisioned".into()),
            reason: None,
            problem: "expected already_converged, server says provisioned".into(),
        }];
        assert!(!report.passed());
        let lines = problem_lines(&report);
        assert!(lines[0].contains("the simulator expected"), "{lines:?}");
        assert!(lines
            .iter()
            .any(|l| l == "  d-00003: expected already_converged, server says provisioned"));
    }
}
