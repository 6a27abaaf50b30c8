//! The shipped Grafana dashboards and Prometheus scrape config, checked for
//! real: the dashboard JSON is provisionable against the fixed datasource
//! uid, `promtool` accepts the server's exposition and the scrape config, and
//! every panel query, evaluated by a real Prometheus (Debian's `prometheus`)
//! that scraped a real server through a simulated run, returns data.

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use idem_device_sim::FleetPlan;
use idem_protocol::{OutcomeCounts, OutcomeKind};
use idem_tests::grafana::{self, DashboardFile, GrafanaVariables, DATASOURCE_TYPE, DATASOURCE_UID};
use idem_tests::prometheus::{self, QueryResult};
use idem_tests::{PrivatePrometheus, Scenario, ServerSettings};
use serde_json::Value;

/// The scrape job of dashboards/prometheus/prometheus.yml.
const JOB: &str = "idem";
/// The test's scrape interval.
const SCRAPE_INTERVAL: &str = "1s";
/// Scrapes after the run completed before panels are evaluated.
const SCRAPES_AFTER_RUN: usize = 3;

/// Grafana's built-in variables as the test sets them. `$__rate_interval` is
/// 60 scrapes at 1 s (Grafana's floor is 4): it spans the whole scenario, so
/// rates and quantiles cover the run.
const VARIABLES: GrafanaVariables = GrafanaVariables {
    interval: Duration::from_secs(5),
    rate_interval: Duration::from_secs(60),
    range: Duration::from_secs(300),
};

fn shipped_dashboards() -> Vec<DashboardFile> {
    grafana::load_dashboards(&grafana::dashboards_dir().join("grafana/dashboards"))
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// The bearer-token file the shipped scrape config names, relative to it.
const TOKEN_FILE: &str = "idem-viewer.token";

/// The alert rules the shipped scrape config loads, relative to it.
const RULES_FILE: &str = "idem-alerts.yml";

fn shipped_alert_rules() -> String {
    let path = grafana::dashboards_dir()
        .join("prometheus")
        .join(RULES_FILE);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn shipped_scrape_config() -> String {
    let path = grafana::dashboards_dir().join("prometheus/prometheus.yml");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[test]
fn every_shipped_dashboard_is_provisionable_with_the_fixed_prometheus_datasource() {
    let dashboards = shipped_dashboards();
    let mut uids = BTreeSet::new();
    let mut panel_uids = BTreeSet::new();
    for dashboard in &dashboards {
        let problems = grafana::structure_problems(dashboard, DATASOURCE_UID);
        assert!(
            problems.is_empty(),
            "{} has problems:\n  {}",
            dashboard.path.display(),
            problems.join("\n  ")
        );
        let uid = dashboard.model["uid"].as_str().unwrap();
        assert!(
            uids.insert(uid.to_owned()),
            "dashboard uid {uid:?} of {} is used by another dashboard",
            dashboard.path.display()
        );
        for panel in grafana::panels(&dashboard.model) {
            if let Some(uid) = panel["datasource"]["uid"].as_str() {
                panel_uids.insert(uid.to_owned());
            }
        }
    }
    assert_eq!(panel_uids, BTreeSet::from([DATASOURCE_UID.to_owned()]));

    let datasources = grafana::dashboards_dir().join("grafana/provisioning/datasources/idem.yaml");
    let yaml = std::fs::read_to_string(&datasources).unwrap();
    let provisioned = grafana::provisioned_datasource_uids(&yaml).unwrap();
    assert!(
        provisioned.values().any(|uid| uid == DATASOURCE_UID),
        "{} provisions {provisioned:?}, but the panels use uid {DATASOURCE_UID:?}",
        datasources.display()
    );
    assert!(
        yaml.lines()
            .any(|l| l.trim() == format!("type: {DATASOURCE_TYPE}")),
        "{} does not provision a {DATASOURCE_TYPE} datasource",
        datasources.display()
    );
    let provider = grafana::dashboards_dir().join("grafana/provisioning/dashboards/idem.yaml");
    let provider = std::fs::read_to_string(&provider).unwrap();
    for line in ["type: file", "path: /var/lib/grafana/dashboards/idem"] {
        assert!(
            provider.lines().any(|l| l.trim() == line),
            "the dashboard provider lacks {line:?}"
        );
    }

    // The fleet dashboard leads with the latest run's counts as big numbers.
    let fleet = dashboards
        .iter()
        .find(|d| d.model["uid"] == "idem-fleet")
        .expect("the idem-fleet dashboard");
    assert_eq!(fleet.title(), "Fleet reconciliation");
    let stats: Vec<&str> = grafana::panels(&fleet.model)
        .into_iter()
        .filter(|p| p["type"] == "stat")
        .filter_map(|p| p["title"].as_str())
        .collect();
    for title in ["Already converged", "Provisioned", "Failed"] {
        assert!(
            stats.contains(&title),
            "no stat panel {title:?} in {stats:?}"
        );
    }
}

#[test]
fn the_shipped_scrape_config_and_the_tests_copy_of_it_pass_promtool() {
    // Checked as shipped, beside the token file it names (promtool checks
    // that the file exists).
    let dir = tempfile::tempdir().unwrap();
    let shipped = dir.path().join("shipped.yml");
    std::fs::write(&shipped, shipped_scrape_config()).unwrap();
    std::fs::write(dir.path().join(TOKEN_FILE), "idem_placeholder").unwrap();
    std::fs::write(dir.path().join(RULES_FILE), shipped_alert_rules()).unwrap();
    let report = prometheus::promtool_check_config(&shipped).unwrap();
    assert!(report.passed(), "{}:\n{}", report.status, report.output);

    let copy = dir.path().join("prometheus.yml");
    let derived = prometheus::scrape_config_for(
        &shipped_scrape_config(),
        "127.0.0.1:1".parse().unwrap(),
        SCRAPE_INTERVAL,
    )
    .unwrap();
    std::fs::write(&copy, &derived).unwrap();
    let report = prometheus::promtool_check_config(&copy).unwrap();
    assert!(
        report.passed(),
        "{}:\n{}\n--- config ---\n{derived}",
        report.status,
        report.output
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_alert_rules_pass_promtool_and_read_only_series_the_server_exposes() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join(RULES_FILE);
    std::fs::write(&rules, shipped_alert_rules()).unwrap();
    let report = prometheus::promtool_check_rules(&rules).unwrap();
    assert!(report.passed(), "{}:\n{}", report.status, report.output);
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let exposed = prometheus::exposed_metric_names(&scenario.server.metrics().await.unwrap());
    let text = shipped_alert_rules();
    let exprs: Vec<&str> = text
        .lines()
        .filter_map(|line| line.trim().strip_prefix("expr:"))
        .collect();
    assert_eq!(exprs.len(), 3, "{text}");
    for expr in exprs {
        let names = grafana::idem_metric_names(expr);
        assert!(!names.is_empty(), "{expr} reads no idem series");
        for name in names {
            assert!(
                exposed.contains(&name),
                "{expr} reads {name}, which /metrics does not expose"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_check_metrics_accepts_the_servers_exposition_before_and_after_a_run() {
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let before = scenario.server.metrics().await.unwrap();
    let report = prometheus::promtool_check_metrics(&before).unwrap();
    assert!(
        report.passed(),
        "promtool check metrics on /metrics before any run: {}\n{}\n--- /metrics ---\n{before}",
        report.status,
        report.output
    );

    let plan = FleetPlan::new("prom-", 6)
        .drifted(1)
        .rejecting(1)
        .seed(11)
        .build()
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 6).await.unwrap();
    scenario.run_all(Duration::from_secs(30)).await.unwrap();
    let after = scenario.server.metrics().await.unwrap();
    let report = prometheus::promtool_check_metrics(&after).unwrap();
    println!(
        "promtool check metrics after a run: {}\n{}",
        report.status, report.output
    );
    assert!(
        report.passed(),
        "promtool check metrics on /metrics after a run: {}\n{}\n--- /metrics ---\n{after}",
        report.status,
        report.output
    );
    fleet.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_query_returns_data_from_a_real_prometheus_after_a_run() {
    let started = Instant::now();
    let scenario = Scenario::start(ServerSettings::default()).await.unwrap();
    let config = prometheus::scrape_config_for(
        &shipped_scrape_config(),
        scenario.server.addr,
        SCRAPE_INTERVAL,
    )
    .unwrap();
    let token = scenario
        .server
        .client_for_role("prometheus", "viewer")
        .await
        .unwrap();
    let prom = PrivatePrometheus::start_with_files(
        &config,
        &[
            (TOKEN_FILE, token.token().unwrap()),
            (RULES_FILE, &shipped_alert_rules()),
        ],
    )
    .await
    .unwrap();
    // A baseline before the run, so rates over the window see the run's
    // increments.
    prom.wait_for_scrapes(JOB, SystemTime::now(), 2, Duration::from_secs(30))
        .await
        .unwrap();

    let plan = FleetPlan::new("dash-", 20)
        .drifted(2)
        .rejecting(1)
        .seed(5)
        .build()
        .unwrap();
    let fleet = scenario.register_and_start(&plan, 20).await.unwrap();
    let (_, run) = scenario.run_all(Duration::from_secs(30)).await.unwrap();
    let completed = SystemTime::now();
    assert_eq!(
        run["summary"],
        plan.expected_counts().summary(),
        "the run did not reach the plan's outcomes: {run}"
    );
    prom.wait_for_scrapes(JOB, completed, SCRAPES_AFTER_RUN, Duration::from_secs(30))
        .await
        .unwrap();
    let runs = prom
        .query(&format!("idem_runs_completed_total{{job=\"{JOB}\"}}"))
        .await
        .unwrap();
    // The latest-run panels are compared with this run's counts, so it must
    // be the only run.
    assert_eq!(
        runs.finite_values(),
        [1.0],
        "expected Prometheus to see exactly the test's run completed: {runs:?}"
    );
    // The shipped job keeps the server's own `instance` label (its
    // `--instance` name), not the scraped address.
    let QueryResult::Vector(samples) = &runs else {
        panic!("idem_runs_completed_total is not a vector: {runs:?}")
    };
    let instances: Vec<Option<&String>> =
        samples.iter().map(|s| s.labels.get("instance")).collect();
    assert_eq!(
        instances,
        [Some(&scenario.server.instance)],
        "Prometheus does not keep the server's instance label: {runs:?}"
    );
    let exposed = prometheus::exposed_metric_names(&scenario.server.metrics().await.unwrap());

    let mut failures = Vec::new();
    let mut evaluated = 0;
    for dashboard in shipped_dashboards() {
        let queries = grafana::queries(&dashboard.model);
        assert!(!queries.is_empty(), "{} has no queries", dashboard.title());
        for query in queries {
            evaluated += 1;
            let what = format!("dashboard {:?} {query}", dashboard.title());
            for name in grafana::idem_metric_names(&query.expr) {
                if !exposed.contains(&name) {
                    failures.push(format!(
                        "{what}\n    reads {name}, which /metrics does not expose"
                    ));
                }
            }
            let expr = match VARIABLES.substitute(&query.expr) {
                Ok(expr) => expr,
                Err(e) => {
                    failures.push(format!("{what}\n    {e:#}"));
                    continue;
                }
            };
            match prom.query(&expr).await {
                Err(e) => failures.push(format!("{what}\n    evaluated as {expr}\n    {e:#}")),
                Ok(result) => {
                    println!(
                        "{:>40} {}: {}",
                        query.panel_title,
                        query.ref_id,
                        shown(&result)
                    );
                    if let Some(problem) = problem_with(&result, &query.expr, &run) {
                        failures.push(format!(
                            "{what}\n    evaluated as {expr}\n    {problem}: {result:?}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {evaluated} panel queries failed against Prometheus:\n  {}",
        failures.len(),
        failures.join("\n  "),
    );
    println!(
        "{evaluated} panel queries returned data; whole test took {:?}",
        started.elapsed()
    );
    fleet.shutdown().await.unwrap();
}

/// `{labels} value, ...`, compactly, for the test's output.
fn shown(result: &QueryResult) -> String {
    match result {
        QueryResult::Vector(samples) => samples
            .iter()
            .map(|s| {
                let labels: Vec<String> = s
                    .labels
                    .iter()
                    .filter(|(k, _)| !matches!(k.as_str(), "job" | "instance"))
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                format!("{{{}}} {:.4}", labels.join(","), s.value)
            })
            .collect::<Vec<_>>()
            .join("  "),
        QueryResult::Scalar(v) => format!("scalar {v}"),
        QueryResult::Other { result_type, .. } => result_type.clone(),
    }
}

/// Why a panel's answer would not show the run, if it would not.
fn problem_with(result: &QueryResult, expr: &str, run: &Value) -> Option<String> {
    if let QueryResult::Other { result_type, .. } = result {
        return Some(format!("a {result_type}, which a panel cannot plot"));
    }
    if result.is_empty() {
        return Some("no data".to_owned());
    }
    let values = result.finite_values();
    if values.is_empty() {
        return Some("no finite value (only NaN or ±Inf)".to_owned());
    }
    // The latest-run stats must show exactly the run's counts.
    let counts: OutcomeCounts = serde_json::from_value(run["counts"].clone()).unwrap_or_default();
    for outcome in OutcomeKind::ALL {
        if expr.contains(&format!("idem_last_run_devices{{outcome=\"{outcome}\"}}")) {
            let want = counts.get(outcome) as f64;
            if values != [want] {
                return Some(format!(
                    "the last run had {want} {outcome}, the panel shows {values:?}"
                ));
            }
        }
    }
    None
}
