//! A private Prometheus per test — the system `prometheus` binary (Debian's
//! `prometheus` package) on a free loopback port with its own config and
//! throwaway TSDB directory — plus `promtool` checks and a small client for
//! Prometheus' HTTP query API.
//!
//! It owns exactly one child process and one temporary directory; dropping
//! [`PrivatePrometheus`] kills that process by its pid and deletes the
//! directory. A missing binary is an error that says what to install.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use tempfile::TempDir;

use crate::support::{
    find_binary, free_port, kill_and_reap, output_within, tail, COMMAND_LIMIT, LOOPBACK,
};

/// How long Prometheus gets to answer `/-/ready` after it is spawned.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Fresh ports tried when Prometheus cannot bind (another process took the
/// port between our probe and its bind).
const START_ATTEMPTS: usize = 3;
/// Log lines quoted in errors.
const TAIL_LINES: usize = 40;

const MISSING_PROMETHEUS: &str = "prometheus binary not found: install it with \
    `apt-get install prometheus` or run scripts/test, which installs it";
const MISSING_PROMTOOL: &str = "promtool binary not found: install it with \
    `apt-get install prometheus` or run scripts/test, which installs it";

/// The `prometheus` binary on `PATH` or in /usr/bin.
pub fn prometheus_binary() -> Result<PathBuf> {
    find_binary("prometheus", &[PathBuf::from("/usr/bin/prometheus")])
        .ok_or_else(|| anyhow!(MISSING_PROMETHEUS))
}

/// The `promtool` binary on `PATH` or in /usr/bin.
pub fn promtool_binary() -> Result<PathBuf> {
    find_binary("promtool", &[PathBuf::from("/usr/bin/promtool")])
        .ok_or_else(|| anyhow!(MISSING_PROMTOOL))
}

/// What a `promtool` run said: its exit status and everything it printed.
#[derive(Debug)]
pub struct PromtoolReport {
    pub status: ExitStatus,
    /// stdout followed by stderr.
    pub output: String,
}

impl PromtoolReport {
    pub fn passed(&self) -> bool {
        self.status.success()
    }
}

/// `promtool check metrics` on a text exposition, passed on stdin. promtool
/// exits 1 on a parse error and 3 on lint problems (missing help, a counter
/// without `_total`, non-base units, ...); both count as not passing.
pub fn promtool_check_metrics(exposition: &str) -> Result<PromtoolReport> {
    let promtool = promtool_binary()?;
    let output = output_within(
        Command::new(&promtool).args(["check", "metrics"]),
        Some(exposition.as_bytes()),
        COMMAND_LIMIT,
        &format!("{} check metrics", promtool.display()),
    )?;
    Ok(report(output))
}

/// `promtool check config FILE`.
pub fn promtool_check_config(config: &Path) -> Result<PromtoolReport> {
    promtool_check("config", config)
}

/// `promtool check rules FILE`.
pub fn promtool_check_rules(rules: &Path) -> Result<PromtoolReport> {
    promtool_check("rules", rules)
}

/// `promtool check WHAT FILE`.
fn promtool_check(what: &str, file: &Path) -> Result<PromtoolReport> {
    let promtool = promtool_binary()?;
    let output = output_within(
        Command::new(&promtool).args(["check", what]).arg(file),
        None,
        COMMAND_LIMIT,
        &format!("{} check {what} {}", promtool.display(), file.display()),
    )?;
    Ok(report(output))
}

fn report(output: std::process::Output) -> PromtoolReport {
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    PromtoolReport {
        status: output.status,
        output: text,
    }
}

/// A copy of a scrape config with every target address replaced by
/// `target` and every `scrape_interval` and `scrape_timeout` set to
/// `interval` (a Prometheus duration such as `1s`); all else is kept.
///
/// Line-based, for configs laid out like dashboards/prometheus/prometheus.yml
/// (`scrape_interval: ...` keys and `- host:port` target items, one per
/// line). Fails when the config has no scrape interval or not exactly one
/// target, so a reshaped config cannot silently go untested.
pub fn scrape_config_for(shipped: &str, target: SocketAddr, interval: &str) -> Result<String> {
    let mut out = String::with_capacity(shipped.len() + 64);
    let mut intervals = 0;
    let mut targets = 0;
    let mut in_targets = false;
    let mut targets_indent = 0;
    for line in shipped.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let content = trimmed.split(" #").next().unwrap_or_default().trim_end();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            out.push_str(line);
        } else if let Some(key) = ["scrape_interval:", "scrape_timeout:"]
            .into_iter()
            .find(|key| content.starts_with(key))
        {
            intervals += usize::from(key == "scrape_interval:");
            out.push_str(&format!("{}{key} {interval}", &line[..indent]));
            in_targets = false;
        } else if let Some(rest) = content
            .strip_prefix("- targets:")
            .or_else(|| content.strip_prefix("targets:"))
        {
            let prefix = &line[..line.len() - trimmed.len() + (content.len() - rest.len())];
            let rest = rest.trim();
            if rest.is_empty() {
                in_targets = true;
                targets_indent = indent;
                out.push_str(prefix);
            } else {
                // Flow style: `targets: ["a:1", "b:2"]`.
                let count = rest.trim_matches(['[', ']']).split(',').count();
                targets += count;
                out.push_str(&format!("{prefix} [\"{target}\"]"));
            }
        } else if in_targets && indent > targets_indent && content.starts_with("- ") {
            targets += 1;
            out.push_str(&format!("{}- {target}", &line[..indent]));
        } else {
            in_targets = false;
            out.push_str(line);
        }
        out.push('\n');
    }
    if intervals == 0 {
        bail!("the scrape config sets no scrape_interval; the test cannot shorten it");
    }
    if targets != 1 {
        bail!(
            "the scrape config lists {targets} targets; expected exactly one `- host:port` \
             item under `targets:` to point at the test server"
        );
    }
    Ok(out)
}

/// The metric names (not series) of a text exposition: `idem_foo_bucket`,
/// `idem_foo_sum`, ... as they appear on sample lines.
pub fn exposed_metric_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// One sample of an instant vector.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The answer to an instant query that Prometheus evaluated.
#[derive(Debug, Clone, PartialEq)]
pub enum QueryResult {
    Vector(Vec<Sample>),
    Scalar(f64),
    /// A range vector or string: not something a panel can plot.
    Other {
        result_type: String,
        result: Value,
    },
}

impl QueryResult {
    /// Whether the answer holds no sample at all ("No data" in Grafana).
    pub fn is_empty(&self) -> bool {
        match self {
            QueryResult::Vector(samples) => samples.is_empty(),
            QueryResult::Scalar(_) => false,
            QueryResult::Other { result, .. } => result.as_array().is_some_and(Vec::is_empty),
        }
    }

    /// The sample values that are numbers (not NaN or infinite).
    pub fn finite_values(&self) -> Vec<f64> {
        match self {
            QueryResult::Vector(samples) => samples
                .iter()
                .map(|s| s.value)
                .filter(|v| v.is_finite())
                .collect(),
            QueryResult::Scalar(v) if v.is_finite() => vec![*v],
            QueryResult::Scalar(_) | QueryResult::Other { .. } => Vec::new(),
        }
    }
}

/// A Prometheus server owned by one test. Dropping it kills the child by its
/// pid, reaps it, and deletes its config and TSDB directory.
#[derive(Debug)]
pub struct PrivatePrometheus {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
    http: reqwest::Client,
    /// Held for its `Drop`, which removes config, data and log.
    dir: TempDir,
}

impl PrivatePrometheus {
    /// Writes `config` (prometheus.yml text) to a temporary directory, starts
    /// Prometheus on a free port of 127.0.0.1 with its TSDB there, and waits
    /// until it answers `/-/ready`.
    pub async fn start(config: &str) -> Result<Self> {
        Self::start_with_files(config, &[]).await
    }

    /// Like [`PrivatePrometheus::start`], with `files` (name, content)
    /// written next to the config first, e.g. the bearer-token file a
    /// scrape config refers to by a relative path.
    pub async fn start_with_files(config: &str, files: &[(&str, &str)]) -> Result<Self> {
        let binary = prometheus_binary()?;
        let dir = tempfile::Builder::new()
            .prefix("idem-prometheus-")
            .tempdir()
            .context("creating a temporary directory for a private Prometheus")?;
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config)
            .with_context(|| format!("writing {}", config_path.display()))?;
        for (name, content) in files {
            let path = dir.path().join(name);
            std::fs::write(&path, content)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .context("HTTP client for Prometheus")?;
        let mut prometheus = Self {
            child: None,
            port: 0,
            log: dir.path().join("prometheus.log"),
            http,
            dir,
        };
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            prometheus.port = free_port()?;
            match prometheus.spawn(&binary, &config_path).await {
                Ok(()) => return Ok(prometheus),
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error
            .unwrap_or_else(|| anyhow!("no start attempt was made"))
            .context(format!(
                "starting a private Prometheus failed {START_ATTEMPTS} times"
            )))
    }

    async fn spawn(&mut self, binary: &Path, config: &Path) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let log_err = log.try_clone().context("duplicating the log handle")?;
        let data = self.dir.path().join("data");
        let mut child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", data.display()))
            .arg(format!("--web.listen-address={LOOPBACK}:{}", self.port))
            .arg("--log.level=info")
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .with_context(|| format!("spawning {}", binary.display()))?;
        let ready = self.wait_ready(&mut child).await;
        match ready {
            Ok(()) => {
                self.child = Some(child);
                Ok(())
            }
            Err(e) => {
                // Never leave a half-started child behind.
                kill_and_reap(Some(child), "half-started private prometheus");
                Err(e.context(format!(
                    "private Prometheus on port {} did not become ready\n--- {} ---\n{}",
                    self.port,
                    self.log.display(),
                    tail(&self.log, TAIL_LINES),
                )))
            }
        }
    }

    async fn wait_ready(&self, child: &mut Child) -> Result<()> {
        let mut alive = || match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => bail!("prometheus exited early with {status}"),
            Err(e) => Err(e).context("checking whether prometheus is still running"),
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(response) = self.http.get(self.url("/-/ready")).send().await {
                if response.status().is_success() {
                    return Ok(());
                }
            }
            alive()?;
            if Instant::now() > deadline {
                bail!("/-/ready did not answer 200 within {READY_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{LOOPBACK}:{}{path}", self.port)
    }

    /// The last lines of Prometheus' log, for assertion messages.
    pub fn log_tail(&self) -> String {
        tail(&self.log, TAIL_LINES)
    }

    /// Evaluates `expr` now through `/api/v1/query`. An expression Prometheus
    /// refuses (parse error, bad types) is an error carrying its message.
    pub async fn query(&self, expr: &str) -> Result<QueryResult> {
        self.query_at(expr, SystemTime::now()).await
    }

    /// Evaluates `expr` at `time` through `/api/v1/query`.
    pub async fn query_at(&self, expr: &str, time: SystemTime) -> Result<QueryResult> {
        let time = time
            .duration_since(UNIX_EPOCH)
            .context("query time before 1970")?
            .as_secs_f64();
        let response = self
            .http
            .post(self.url("/api/v1/query"))
            .form(&[("query", expr), ("time", &format!("{time:.3}"))])
            .send()
            .await
            .with_context(|| format!("POST /api/v1/query for {expr}"))?;
        let status = response.status();
        let text = response
            .text()
            .await
            .context("reading the /api/v1/query answer")?;
        let body: Value = serde_json::from_str(&text)
            .with_context(|| format!("/api/v1/query answered {status} with non-JSON: {text}"))?;
        if body["status"] != "success" {
            bail!(
                "Prometheus refused the query ({status}, {}): {}",
                body["errorType"].as_str().unwrap_or("no errorType"),
                body["error"].as_str().unwrap_or(&text)
            );
        }
        parse_result(&body["data"])
            .with_context(|| format!("decoding the /api/v1/query answer {text}"))
    }

    /// Waits until Prometheus holds at least `count` samples of
    /// `up{job="<job>"}` scraped after `since`, the newest of them 1 (the
    /// scrape succeeded). On timeout the error quotes `/api/v1/targets`.
    pub async fn wait_for_scrapes(
        &self,
        job: &str,
        since: SystemTime,
        count: usize,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let now = SystemTime::now();
            let window = now
                .duration_since(since)
                .unwrap_or(Duration::ZERO)
                .as_millis()
                .max(1);
            let scraped = self
                .query_at(
                    &format!("count_over_time(up{{job=\"{job}\"}}[{window}ms])"),
                    now,
                )
                .await;
            let up = self.query_at(&format!("up{{job=\"{job}\"}}"), now).await;
            let last = match (scraped, up) {
                (Ok(scraped), Ok(up)) => {
                    let n = scraped.finite_values().into_iter().fold(0.0, f64::max);
                    let is_up = up.finite_values() == [1.0];
                    if n >= count as f64 && is_up {
                        return Ok(());
                    }
                    format!("{n} scrapes since the mark, up = {up:?}")
                }
                (Err(e), _) | (_, Err(e)) => format!("{e:#}"),
            };
            if Instant::now() > deadline {
                let targets = self.targets().await.unwrap_or_else(|e| format!("{e:#}"));
                bail!(
                    "Prometheus did not scrape job {job:?} {count} times within {timeout:?} \
                     (last: {last})\n--- /api/v1/targets ---\n{targets}\n--- log ---\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `/api/v1/targets` as text: scrape URLs, health and last errors.
    pub async fn targets(&self) -> Result<String> {
        self.http
            .get(self.url("/api/v1/targets"))
            .send()
            .await
            .context("GET /api/v1/targets")?
            .text()
            .await
            .context("reading /api/v1/targets")
    }
}

fn parse_result(data: &Value) -> Result<QueryResult> {
    let result_type = data["resultType"]
        .as_str()
        .context("no resultType in the answer")?;
    let result = &data["result"];
    match result_type {
        "vector" => {
            let items = result.as_array().context("vector result is not a list")?;
            items
                .iter()
                .map(|item| {
                    let labels = item["metric"]
                        .as_object()
                        .map(|m| {
                            m.iter()
                                .map(|(k, v)| {
                                    (k.clone(), v.as_str().unwrap_or_default().to_owned())
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    Ok(Sample {
                        labels,
                        value: sample_value(&item["value"])?,
                    })
                })
                .collect::<Result<Vec<_>>>()
                .map(QueryResult::Vector)
        }
        "scalar" => sample_value(result).map(QueryResult::Scalar),
        other => Ok(QueryResult::Other {
            result_type: other.to_owned(),
            result: result.clone(),
        }),
    }
}

/// `[timestamp, "value"]` → value (`"NaN"`, `"+Inf"` included).
fn sample_value(pair: &Value) -> Result<f64> {
    let text = pair[1]
        .as_str()
        .with_context(|| format!("sample {pair} has no string value"))?;
    match text {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        _ => text
            .parse()
            .with_context(|| format!("sample value {text:?} is not a number")),
    }
}

impl Drop for PrivatePrometheus {
    fn drop(&mut self) {
        kill_and_reap(self.child.take(), "private prometheus");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHIPPED: &str = include_str!("../../dashboards/prometheus/prometheus.yml");

    #[test]
    fn the_test_config_changes_only_the_target_and_the_intervals() {
        let target: SocketAddr = "127.0.0.1:41999".parse().unwrap();
        let derived = scrape_config_for(SHIPPED, target, "1s").unwrap();
        let changed: Vec<(&str, &str)> = SHIPPED
            .lines()
            .zip(derived.lines())
            .filter(|(a, b)| a != b)
            .collect();
        assert_eq!(SHIPPED.lines().count(), derived.lines().count());
        assert!(
            changed
                .iter()
                .all(|(_, b)| b.ends_with("1s") || b.trim() == "- 127.0.0.1:41999"),
            "{changed:#?}"
        );
        assert!(derived.contains("    scrape_interval: 1s\n"), "{derived}");
        assert!(derived.contains("- 127.0.0.1:41999\n"), "{derived}");
        assert!(derived.contains("metrics_path: /metrics\n"), "{derived}");
        assert!(derived.contains("job_name: idem\n"), "{derived}");
    }

    #[test]
    fn flow_style_targets_are_replaced_too() {
        let config = "global:\n  scrape_interval: 15s\nscrape_configs:\n  - job_name: x\n    \
                      static_configs:\n      - targets: [\"a:1\"]  # note\n";
        let derived = scrape_config_for(config, "127.0.0.1:9".parse().unwrap(), "1s").unwrap();
        assert!(
            derived.contains("      - targets: [\"127.0.0.1:9\"]\n"),
            "{derived}"
        );
        assert!(derived.contains("  scrape_interval: 1s\n"), "{derived}");
    }

    #[test]
    fn a_config_with_two_targets_is_refused() {
        let config = "global:\n  scrape_interval: 15s\nscrape_configs:\n  - job_name: x\n    \
                      static_configs:\n      - targets:\n          - a:1\n          - b:2\n";
        let err = scrape_config_for(config, "127.0.0.1:9".parse().unwrap(), "1s").unwrap_err();
        assert!(err.to_string().contains("lists 2 targets"), "{err}");
    }

    #[test]
    fn exposed_names_include_histogram_parts() {
        let text = "# HELP a_seconds x\n# TYPE a_seconds histogram\n\
                    a_seconds_bucket{le=\"1\"} 0\na_seconds_sum 0\na_seconds_count 0\nb_total 3\n";
        let names: Vec<String> = exposed_metric_names(text).into_iter().collect();
        assert_eq!(
            names,
            [
                "a_seconds_bucket",
                "a_seconds_count",
                "a_seconds_sum",
                "b_total"
            ]
        );
    }

    #[test]
    fn query_answers_decode_vectors_scalars_and_nan() {
        let vector = serde_json::json!({"resultType": "vector", "result": [
            {"metric": {"outcome": "failed"}, "value": [1.5, "2"]},
            {"metric": {}, "value": [1.5, "NaN"]},
        ]});
        let decoded = parse_result(&vector).unwrap();
        assert_eq!(decoded.finite_values(), [2.0]);
        assert!(!decoded.is_empty());
        let scalar = serde_json::json!({"resultType": "scalar", "result": [1.5, "+Inf"]});
        assert_eq!(
            parse_result(&scalar).unwrap(),
            QueryResult::Scalar(f64::INFINITY)
        );
        let empty = serde_json::json!({"resultType": "vector", "result": []});
        assert!(parse_result(&empty).unwrap().is_empty());
    }
}
