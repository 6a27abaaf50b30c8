//! The Grafana dashboards shipped in `dashboards/`: loading them, walking
//! their panels (rows and the panels nested in collapsed rows included),
//! checking their structure, and turning each panel query into PromQL a bare
//! Prometheus can evaluate by substituting Grafana's built-in variables.
//!
//! Pure: no IO beyond reading the shipped files.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// The uid of the provisioned Prometheus datasource every panel must use.
pub const DATASOURCE_UID: &str = "idem-prometheus";
/// The datasource type every panel must use.
pub const DATASOURCE_TYPE: &str = "prometheus";
/// Grafana's dashboard grid is 24 columns wide.
const GRID_COLUMNS: u64 = 24;

/// The workspace root (the parent of the `tests` package).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from(".."), Path::to_path_buf)
}

/// `dashboards/` of the workspace.
pub fn dashboards_dir() -> PathBuf {
    workspace_root().join("dashboards")
}

/// One dashboard JSON file: its path, text and parsed model.
#[derive(Debug, Clone)]
pub struct DashboardFile {
    pub path: PathBuf,
    pub text: String,
    pub model: Value,
}

impl DashboardFile {
    pub fn title(&self) -> &str {
        self.model["title"].as_str().unwrap_or("(untitled)")
    }
}

/// Every `*.json` dashboard of `dir`, sorted by path. An empty directory is
/// an error: the tests must have something to check.
pub fn load_dashboards(dir: &Path) -> Result<Vec<DashboardFile>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("listing {}", dir.display()))?;
    paths.retain(|p| p.extension().is_some_and(|ext| ext == "json"));
    paths.sort();
    if paths.is_empty() {
        bail!("no *.json dashboard in {}", dir.display());
    }
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let model = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", path.display()))?;
            Ok(DashboardFile { path, text, model })
        })
        .collect()
}

/// Every panel of a dashboard model in display order: top-level panels,
/// rows, and the panels nested in (collapsed) rows right after their row.
pub fn panels(model: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in list.as_array().into_iter().flatten() {
            out.push(panel);
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&model["panels"], &mut out);
    out
}

fn is_row(panel: &Value) -> bool {
    panel["type"] == "row"
}

/// One query of one panel, as written in the dashboard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PanelQuery {
    pub panel_id: i64,
    pub panel_title: String,
    pub ref_id: String,
    pub expr: String,
}

impl fmt::Display for PanelQuery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "panel {:?} (id {}) query {}: {}",
            self.panel_title, self.panel_id, self.ref_id, self.expr
        )
    }
}

/// Every target expression of every non-row panel, in display order.
pub fn queries(model: &Value) -> Vec<PanelQuery> {
    panels(model)
        .into_iter()
        .filter(|p| !is_row(p))
        .flat_map(|panel| {
            panel["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |target| PanelQuery {
                    panel_id: panel["id"].as_i64().unwrap_or(-1),
                    panel_title: panel["title"].as_str().unwrap_or_default().to_owned(),
                    ref_id: target["refId"].as_str().unwrap_or_default().to_owned(),
                    expr: target["expr"].as_str().unwrap_or_default().to_owned(),
                })
        })
        .collect()
}

/// Everything wrong with one dashboard file for provisioning against the
/// datasource `uid`: an empty list means it is fine.
///
/// Checked: a uid and a title; no `__inputs` and no `${DS_...}` import
/// placeholders; unique integer panel ids (nested panels included); every
/// non-row panel has a type, a unique title, a grid position inside the 24
/// columns, the Prometheus datasource `uid` (on the panel and on any target
/// that names one) and at least one target, each with a refId unique in the
/// panel and a non-empty `expr`; expanded rows hold no nested panels
/// (Grafana only keeps nested panels of collapsed rows).
pub fn structure_problems(file: &DashboardFile, uid: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let model = &file.model;
    if !model.is_object() {
        return vec!["the dashboard JSON is not an object".to_owned()];
    }
    if model["uid"].as_str().is_none_or(str::is_empty) {
        problems.push("no dashboard uid".to_owned());
    }
    if model["title"].as_str().is_none_or(str::is_empty) {
        problems.push("no dashboard title".to_owned());
    }
    if model.get("__inputs").is_some() {
        problems.push(
            "`__inputs` present: this is an export for sharing, not a provisionable dashboard"
                .to_owned(),
        );
    }
    if file.text.contains("${DS_") {
        problems.push("`${DS_...}` datasource placeholder present".to_owned());
    }
    let all = panels(model);
    if all.iter().all(|p| is_row(p)) {
        problems.push("no panels".to_owned());
    }
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    for panel in all {
        let title = panel["title"].as_str().unwrap_or_default();
        let name = format!("panel {title:?} (id {})", panel["id"]);
        match panel["id"].as_i64() {
            Some(id) if ids.insert(id) => {}
            Some(id) => problems.push(format!("{name}: panel id {id} is used twice")),
            None => problems.push(format!("{name}: no integer panel id")),
        }
        check_grid(panel, &name, &mut problems);
        if is_row(panel) {
            let nested = panel["panels"].as_array().map_or(0, Vec::len);
            if panel["collapsed"] != true && nested > 0 {
                problems.push(format!(
                    "{name}: expanded row holds {nested} nested panels, which Grafana ignores"
                ));
            }
            continue;
        }
        if title.is_empty() {
            problems.push(format!("{name}: no title"));
        } else if !titles.insert(title) {
            problems.push(format!("{name}: title used by another panel"));
        }
        if panel["type"].as_str().is_none_or(str::is_empty) {
            problems.push(format!("{name}: no panel type"));
        }
        check_datasource(&panel["datasource"], uid, &name, &mut problems);
        let targets = panel["targets"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        if targets.is_empty() {
            problems.push(format!("{name}: no targets"));
        }
        let mut ref_ids = BTreeSet::new();
        for target in targets {
            let ref_id = target["refId"].as_str().unwrap_or_default();
            let tname = format!("{name} target {ref_id:?}");
            if ref_id.is_empty() {
                problems.push(format!("{tname}: no refId"));
            } else if !ref_ids.insert(ref_id) {
                problems.push(format!("{tname}: refId used twice in the panel"));
            }
            if target["expr"].as_str().is_none_or(|e| e.trim().is_empty()) {
                problems.push(format!("{tname}: no PromQL expr"));
            }
            if !target["datasource"].is_null() {
                check_datasource(&target["datasource"], uid, &tname, &mut problems);
            }
        }
    }
    problems
}

fn check_datasource(datasource: &Value, uid: &str, name: &str, problems: &mut Vec<String>) {
    if datasource["uid"] != uid || datasource["type"] != DATASOURCE_TYPE {
        problems.push(format!(
            "{name}: datasource is {datasource}, not {{\"type\":\"{DATASOURCE_TYPE}\",\"uid\":\"{uid}\"}}"
        ));
    }
}

fn check_grid(panel: &Value, name: &str, problems: &mut Vec<String>) {
    let grid = &panel["gridPos"];
    let field = |key: &str| grid[key].as_u64();
    match (field("x"), field("y"), field("w"), field("h")) {
        (Some(x), Some(_), Some(w), Some(h)) if w > 0 && h > 0 && x + w <= GRID_COLUMNS => {}
        _ => problems.push(format!(
            "{name}: gridPos {grid} is not a box inside the {GRID_COLUMNS}-column grid"
        )),
    }
}

/// The values Grafana gives its built-in interval variables when it sends a
/// query, fixed for a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrafanaVariables {
    /// `$__interval`: the step of a range query.
    pub interval: Duration,
    /// `$__rate_interval`: Grafana uses max(`$__interval` + scrape interval,
    /// 4 × scrape interval).
    pub rate_interval: Duration,
    /// `$__range`: the dashboard's time range.
    pub range: Duration,
}

impl GrafanaVariables {
    fn value(&self, name: &str) -> Option<String> {
        let ms = |d: Duration| d.as_millis().to_string();
        let prom = |d: Duration| format!("{}ms", d.as_millis());
        Some(match name {
            "__interval" => prom(self.interval),
            "__interval_ms" => ms(self.interval),
            "__rate_interval" => prom(self.rate_interval),
            "__rate_interval_ms" => ms(self.rate_interval),
            "__range" => prom(self.range),
            "__range_ms" => ms(self.range),
            "__range_s" => self.range.as_secs().to_string(),
            _ => return None,
        })
    }

    /// `expr` with every `$name` / `${name}` replaced by its value. Any other
    /// variable (a dashboard template variable, a typo) is an error, since a
    /// bare Prometheus could not evaluate it.
    pub fn substitute(&self, expr: &str) -> Result<String> {
        let mut out = String::with_capacity(expr.len());
        let mut rest = expr;
        while let Some(start) = rest.find('$') {
            out.push_str(&rest[..start]);
            let after = &rest[start + 1..];
            let (name, consumed) = if let Some(braced) = after.strip_prefix('{') {
                let end = braced
                    .find('}')
                    .with_context(|| format!("unclosed `${{` in {expr}"))?;
                (&braced[..end], end + 2)
            } else {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                (&after[..end], end)
            };
            let value = self
                .value(name)
                .with_context(|| format!("unknown Grafana variable `${name}` in {expr}"))?;
            out.push_str(&value);
            rest = &after[consumed..];
        }
        out.push_str(rest);
        if out.contains("[[") {
            bail!("old-style `[[variable]]` in {expr}");
        }
        Ok(out)
    }
}

/// The `idem_*` metric names an expression reads (label values in quotes
/// are not names).
pub fn idem_metric_names(expr: &str) -> BTreeSet<String> {
    let mut unquoted = String::with_capacity(expr.len());
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in expr.chars() {
        match quote {
            Some(q) => {
                if !escaped && c == q {
                    quote = None;
                }
                escaped = !escaped && c == '\\';
                unquoted.push(' ');
            }
            None if matches!(c, '"' | '\'' | '`') => {
                quote = Some(c);
                unquoted.push(' ');
            }
            None => unquoted.push(c),
        }
    }
    let mut names = BTreeSet::new();
    let mut rest = unquoted.as_str();
    while let Some(start) = rest.find("idem_") {
        let preceded_by_ident = rest[..start]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !preceded_by_ident {
            names.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

/// The `uid` of every datasource in a Grafana datasource provisioning file,
/// by datasource name. Line-based, for files laid out like
/// dashboards/grafana/provisioning/datasources/idem.yaml.
pub fn provisioned_datasource_uids(yaml: &str) -> Result<BTreeMap<String, String>> {
    let mut uids = BTreeMap::new();
    let mut name: Option<String> = None;
    for line in yaml.lines() {
        let content = line
            .trim()
            .trim_start_matches("- ")
            .split(" #")
            .next()
            .unwrap_or_default()
            .trim();
        let unquote = |v: &str| v.trim().trim_matches(['"', '\'']).to_owned();
        if let Some(value) = content.strip_prefix("name:") {
            name = Some(unquote(value));
        } else if let Some(value) = content.strip_prefix("uid:") {
            let owner = name.clone().context("a datasource uid before its name")?;
            uids.insert(owner, unquote(value));
        }
    }
    if uids.is_empty() {
        bail!("no datasource with a uid in the provisioning file");
    }
    Ok(uids)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const DS: &str = r#"{"type": "prometheus", "uid": "idem-prometheus"}"#;

    fn file(model: Value) -> DashboardFile {
        DashboardFile {
            path: PathBuf::from("test.json"),
            text: model.to_string(),
            model,
        }
    }

    fn panel(id: i64, title: &str, expr: &str) -> Value {
        json!({
            "id": id, "type": "timeseries", "title": title,
            "gridPos": {"x": 0, "y": 0, "w": 12, "h": 8},
            "datasource": serde_json::from_str::<Value>(DS).unwrap(),
            "targets": [{"refId": "A", "expr": expr}],
        })
    }

    #[test]
    fn a_well_formed_dashboard_has_no_problems() {
        let model = json!({"uid": "u", "title": "t", "panels": [panel(1, "a", "up")]});
        assert_eq!(
            structure_problems(&file(model), DATASOURCE_UID),
            Vec::<String>::new()
        );
    }

    #[test]
    fn panels_nested_in_collapsed_rows_are_checked_too() {
        let mut nested = panel(3, "nested", "");
        nested["datasource"] = json!({"type": "prometheus", "uid": "${DS_PROMETHEUS}"});
        let model = json!({"uid": "u", "title": "t", "__inputs": [], "panels": [
            panel(1, "a", "up"),
            {"id": 2, "type": "row", "title": "r", "collapsed": true,
             "gridPos": {"x": 0, "y": 8, "w": 24, "h": 1}, "panels": [nested, panel(1, "a", "up")]},
        ]});
        let problems = structure_problems(&file(model), DATASOURCE_UID);
        let expected = [
            "`__inputs` present",
            "`${DS_...}` datasource placeholder present",
            "panel \"nested\" (id 3): datasource is",
            "panel \"nested\" (id 3) target \"A\": no PromQL expr",
            "panel \"a\" (id 1): panel id 1 is used twice",
            "panel \"a\" (id 1): title used by another panel",
        ];
        for want in expected {
            assert!(
                problems.iter().any(|p| p.starts_with(want)),
                "missing {want:?} in {problems:#?}"
            );
        }
        assert_eq!(problems.len(), expected.len(), "{problems:#?}");
    }

    #[test]
    fn a_panel_without_targets_or_datasource_is_a_problem() {
        let mut bare = panel(1, "bare", "up");
        bare["targets"] = json!([]);
        bare["datasource"] = Value::Null;
        let model = json!({"uid": "u", "title": "t", "panels": [bare]});
        let problems = structure_problems(&file(model), DATASOURCE_UID);
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(problems[0].contains("datasource is null"), "{problems:#?}");
        assert!(problems[1].ends_with("no targets"), "{problems:#?}");
    }

    #[test]
    fn queries_come_from_nested_panels_in_display_order() {
        let model = json!({"panels": [
            panel(1, "a", "x"),
            {"id": 2, "type": "row", "title": "r", "collapsed": true,
             "panels": [panel(3, "b", "y")]},
        ]});
        let found: Vec<String> = queries(&model).into_iter().map(|q| q.expr).collect();
        assert_eq!(found, ["x", "y"]);
    }

    #[test]
    fn grafana_variables_are_substituted_and_unknown_ones_refused() {
        let vars = GrafanaVariables {
            interval: Duration::from_secs(5),
            rate_interval: Duration::from_secs(60),
            range: Duration::from_secs(3600),
        };
        assert_eq!(
            vars.substitute("rate(a[$__rate_interval]) / $__interval_ms + ${__range_s}")
                .unwrap(),
            "rate(a[60000ms]) / 5000 + 3600"
        );
        assert_eq!(
            vars.substitute("increase(a[$__range])").unwrap(),
            "increase(a[3600000ms])"
        );
        let err = vars.substitute("a{instance=~\"$instance\"}").unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown Grafana variable `$instance`"),
            "{err}"
        );
    }

    #[test]
    fn metric_names_are_found_inside_expressions() {
        let names = idem_metric_names(
            "histogram_quantile(0.5, sum by (le) (rate(idem_run_duration_seconds_bucket[1m]))) \
             + my_idem_other + idem_devices{status=\"idem_x\\\"y\"} + idem_z",
        );
        let names: Vec<String> = names.into_iter().collect();
        assert_eq!(
            names,
            ["idem_devices", "idem_run_duration_seconds_bucket", "idem_z"]
        );
    }

    #[test]
    fn datasource_uids_are_read_by_name() {
        let yaml = "apiVersion: 1\ndatasources:\n  - name: p  # c\n    type: prometheus\n    \
                    uid: \"idem-prometheus\"\n";
        let uids = provisioned_datasource_uids(yaml).unwrap();
        assert_eq!(uids["p"], "idem-prometheus");
    }
}
