//! A small client for the idem server's HTTP API: the calls the demo and the
//! benchmark make (register devices, start and follow runs, page through
//! outcomes and devices, read `/metrics`). It sends and decodes the API's
//! own types (`idem_protocol::api`) and turns every failure into a typed
//! [`ApiError`]; it holds no demo logic and never retries on its own.

use std::time::Duration;

use idem_protocol::api::{DevicePage, DeviceRegistration, OutcomePage};
pub use idem_protocol::api::{
    DeviceView as DeviceRow, IssuedCredential, OutcomeRow, Registered as RegisterCounts,
    RunStarted, RunView,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::SecretString;

/// How long one HTTP request may take before it fails.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The server's largest page (`limit`) for list endpoints.
pub const MAX_PAGE: usize = 1_000;

/// Why a call to the idem API failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("invalid server URL {url:?}: expected e.g. http://127.0.0.1:8080")]
    InvalidUrl { url: String },
    #[error("could not build the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("the API CA file {path}: {reason}")]
    CaFile { path: String, reason: String },
    #[error("the API token cannot be sent in an HTTP header (it holds characters outside visible ASCII)")]
    InvalidToken,
    #[error("{method} {url} failed: {source} (is idem-server running there? set --server)")]
    Request {
        method: &'static str,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{method} {url} answered {status}: {body}")]
    Status {
        method: &'static str,
        url: String,
        status: u16,
        body: String,
    },
    #[error("{method} {url}: unexpected answer ({source}): {body}")]
    Decode {
        method: &'static str,
        url: String,
        body: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("/metrics series {series} has a value that is not a number: {value:?}")]
    MetricValue { series: String, value: String },
}

#[derive(Debug, Deserialize)]
struct FleetView {
    #[serde(default)]
    devices: u64,
}

/// How a [`ServerClient`] authenticates to the API and what it trusts.
#[derive(Debug, Clone, Default)]
pub struct ClientAuth {
    /// Operator token, sent as `Authorization: Bearer …`.
    pub token: Option<SecretString>,
    /// PEM CA file for an `https://` server; `None`: the system trust store.
    pub ca_file: Option<std::path::PathBuf>,
}

/// A client for one idem server.
#[derive(Debug, Clone)]
pub struct ServerClient {
    base: String,
    http: reqwest::Client,
}

impl ServerClient {
    /// `base_url` like `http://127.0.0.1:8080` (a trailing `/` is ignored).
    pub fn new(base_url: &str) -> Result<Self, ApiError> {
        Self::with_auth(base_url, &ClientAuth::default())
    }

    /// Like [`ServerClient::new`], sending `auth.token` as
    /// `Authorization: Bearer …` with every request and, for `https://`,
    /// trusting `auth.ca_file` instead of the system's trust store.
    pub fn with_auth(base_url: &str, auth: &ClientAuth) -> Result<Self, ApiError> {
        let base = base_url.trim_end_matches('/').to_owned();
        let rest = base
            .strip_prefix("http://")
            .or_else(|| base.strip_prefix("https://"));
        if rest.is_none_or(|r| r.is_empty() || r.contains('/')) {
            return Err(ApiError::InvalidUrl {
                url: base_url.to_owned(),
            });
        }
        let mut builder = reqwest::Client::builder().timeout(REQUEST_TIMEOUT);
        if let Some(token) = &auth.token {
            let mut value =
                reqwest::header::HeaderValue::from_str(&format!("Bearer {}", token.expose()))
                    .map_err(|_| ApiError::InvalidToken)?;
            // Kept out of reqwest's Debug output and HTTP/2 header tables.
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        match &auth.ca_file {
            Some(path) => {
                let bad = |reason: String| ApiError::CaFile {
                    path: path.display().to_string(),
                    reason,
                };
                let pem = std::fs::read(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
                let certs = reqwest::Certificate::from_pem_bundle(&pem)
                    .map_err(|e| bad(format!("not a PEM certificate bundle: {e}")))?;
                if certs.is_empty() {
                    return Err(bad("no PEM certificate in it".to_owned()));
                }
                builder = builder.tls_built_in_root_certs(false);
                for cert in certs {
                    builder = builder.add_root_certificate(cert);
                }
            }
            None if base.starts_with("https://") => {
                // The system's trust store (there is no bundled one).
                builder = builder.tls_built_in_root_certs(false);
                for cert in rustls_native_certs::load_native_certs().certs {
                    if let Ok(cert) = reqwest::Certificate::from_der(&cert) {
                        builder = builder.add_root_certificate(cert);
                    }
                }
            }
            None => {}
        }
        let http = builder.build().map_err(ApiError::Client)?;
        Ok(Self { base, http })
    }

    /// The server's base URL, without a trailing `/`.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Whether `GET /readyz` answers 200 (database and broker reachable).
    pub async fn is_ready(&self) -> Result<bool, ApiError> {
        let url = self.url("/readyz");
        let response = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|source| ApiError::Request {
                method: "GET",
                url,
                source,
            })?;
        Ok(response.status().is_success())
    }

    /// `POST /v1/devices` for one chunk: every id with `labels` and `spec`
    /// as its desired state.
    pub async fn register<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a str>,
        labels: &Value,
        spec: &Value,
    ) -> Result<RegisterCounts, ApiError> {
        let body: Vec<DeviceRegistration> = ids
            .into_iter()
            .map(|id| DeviceRegistration {
                id: id.to_owned(),
                labels: Some(labels.clone()),
                spec: Some(spec.clone()),
                broker_password: None,
            })
            .collect();
        self.post("/v1/devices", &body).await
    }

    /// `POST /v1/runs`: re-check the targets in `body` (a
    /// `idem_protocol::api::TargetedRequest`, or its JSON: `{"all": true}`,
    /// `{"selector": …}` or `{"devices": […]}`, optional `"force"`).
    pub async fn start_run(&self, body: &impl Serialize) -> Result<RunStarted, ApiError> {
        self.post("/v1/runs", body).await
    }

    /// `POST /v1/desired`: change the desired spec of the targets in `body`.
    pub async fn set_desired(&self, body: &impl Serialize) -> Result<RunStarted, ApiError> {
        self.post("/v1/desired", body).await
    }

    /// `POST /v1/rollouts/{run_id}/abort`: nothing more is pushed.
    pub async fn abort_rollout(
        &self,
        run_id: impl std::fmt::Display,
    ) -> Result<idem_protocol::api::RolloutActed, ApiError> {
        self.post(
            &format!("/v1/rollouts/{run_id}/abort"),
            &serde_json::json!({}),
        )
        .await
    }

    /// `GET /v1/runs/{id}`.
    pub async fn run(&self, run_id: impl std::fmt::Display) -> Result<RunView, ApiError> {
        self.get(&format!("/v1/runs/{run_id}")).await
    }

    /// Every outcome row of a run, all pages, in device-id order.
    pub async fn outcomes(
        &self,
        run_id: impl std::fmt::Display,
    ) -> Result<Vec<OutcomeRow>, ApiError> {
        self.all_pages(
            &format!("/v1/runs/{run_id}/outcomes?limit={MAX_PAGE}"),
            |p: OutcomePage| (p.outcomes, p.next_after),
        )
        .await
    }

    /// Every device carrying label `key: value`, all pages.
    pub async fn devices_with_label(
        &self,
        key: &str,
        value: &str,
    ) -> Result<Vec<DeviceRow>, ApiError> {
        let label = query_escape(&format!("{key}:{value}"));
        self.all_pages(
            &format!("/v1/devices?label={label}&limit={MAX_PAGE}"),
            |p: DevicePage| (p.devices, p.next_after),
        )
        .await
    }

    /// Follows `next_after` cursors from `first` (a path with a query) until
    /// the last page; `split` takes a page apart into rows and cursor.
    async fn all_pages<P: DeserializeOwned, T>(
        &self,
        first: &str,
        split: impl Fn(P) -> (Vec<T>, Option<String>),
    ) -> Result<Vec<T>, ApiError> {
        let mut rows = Vec::new();
        let mut path = first.to_owned();
        loop {
            let (page, next) = split(self.get(&path).await?);
            rows.extend(page);
            match next {
                Some(after) => path = format!("{first}&after={after}"),
                None => return Ok(rows),
            }
        }
    }

    /// Registered devices, from `GET /v1/fleet`.
    pub async fn device_count(&self) -> Result<u64, ApiError> {
        let fleet: FleetView = self.get("/v1/fleet").await?;
        Ok(fleet.devices)
    }

    /// The `/metrics` text.
    pub async fn metrics_text(&self) -> Result<String, ApiError> {
        let url = self.url("/metrics");
        let response = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|source| ApiError::Request {
                method: "GET",
                url: url.clone(),
                source,
            })?;
        let status = response.status().as_u16();
        let body = response.text().await.map_err(|source| ApiError::Request {
            method: "GET",
            url: url.clone(),
            source,
        })?;
        if status != 200 {
            return Err(ApiError::Status {
                method: "GET",
                url,
                status,
                body,
            });
        }
        Ok(body)
    }

    /// The value of one series, e.g. `idem_reports_total{result="applied"}`;
    /// `None` when the server does not expose it.
    pub async fn metric(&self, series: &str) -> Result<Option<f64>, ApiError> {
        let text = self.metrics_text().await?;
        metric_value(&text, series)
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ApiError> {
        let url = self.url(path);
        let request = self.http.get(&url);
        self.send("GET", url, request).await
    }

    async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<T, ApiError> {
        let url = self.url(path);
        let request = self.http.post(&url).json(body);
        self.send("POST", url, request).await
    }

    async fn send<T: DeserializeOwned>(
        &self,
        method: &'static str,
        url: String,
        request: reqwest::RequestBuilder,
    ) -> Result<T, ApiError> {
        let response = request.send().await.map_err(|source| ApiError::Request {
            method,
            url: url.clone(),
            source,
        })?;
        let status = response.status().as_u16();
        let body = response.text().await.map_err(|source| ApiError::Request {
            method,
            url: url.clone(),
            source,
        })?;
        if !(200..300).contains(&status) {
            return Err(ApiError::Status {
                method,
                url,
                status,
                body,
            });
        }
        serde_json::from_str(&body).map_err(|source| ApiError::Decode {
            method,
            url,
            body: truncate(&body, 500),
            source,
        })
    }
}

/// The value of `series` (name plus exact label set) in Prometheus text.
/// The `instance` label every series of a server carries (its
/// `--instance` name) is left out of the comparison, so one series reads
/// the same from any instance.
pub fn metric_value(text: &str, series: &str) -> Result<Option<f64>, ApiError> {
    let wanted = without_instance_label(series);
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((name_and_labels, value)) = split_sample(line) else {
            continue;
        };
        if without_instance_label(name_and_labels) != wanted {
            continue;
        }
        let value = value.trim();
        return value.parse().map(Some).map_err(|_| ApiError::MetricValue {
            series: series.to_owned(),
            value: value.to_owned(),
        });
    }
    Ok(None)
}

/// A sample line split into its series (name and labels) and its value.
fn split_sample(line: &str) -> Option<(&str, &str)> {
    let end = match line.find('{') {
        Some(open) => open + closing_brace(&line[open..])? + 1,
        None => line.find(' ')?,
    };
    let (series, rest) = line.split_at(end);
    Some((series, rest.strip_prefix(' ')?))
}

/// The offset of the `}` that closes the label set `labels` starts (at its
/// `{`), quoted values skipped.
fn closing_brace(labels: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (at, c) in labels.char_indices() {
        match (quoted, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => quoted = !quoted,
            (false, _, '}') => return Some(at),
            _ => {}
        }
    }
    None
}

/// `series` (`name` or `name{labels}`) without its `instance` label.
fn without_instance_label(series: &str) -> String {
    let Some(open) = series.find('{') else {
        return series.to_owned();
    };
    let name = &series[..open];
    let labels = &series[open + 1..];
    let mut rest = labels.strip_suffix('}').unwrap_or(labels);
    let mut kept = Vec::new();
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim_start_matches(',').trim();
        let after = &rest[eq + 1..];
        let len = quoted_len(after).unwrap_or(after.len());
        if key != "instance" {
            kept.push(format!("{key}={}", &after[..len]));
        }
        rest = &after[len..];
    }
    if kept.is_empty() {
        name.to_owned()
    } else {
        format!("{name}{{{}}}", kept.join(","))
    }
}

/// The length of the quoted label value `text` starts with, its quotes
/// included.
fn quoted_len(text: &str) -> Option<usize> {
    let mut escaped = false;
    for (at, c) in text.char_indices().skip(1) {
        match (escaped, c) {
            (true, _) => escaped = false,
            (false, '\\') => escaped = true,
            (false, '"') => return Some(at + 1),
            (false, _) => {}
        }
    }
    None
}

/// Percent-encodes what may not appear raw in a query value.
fn query_escape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for b in raw.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b':') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_values_are_found_by_name_and_labels() {
        let text = "# HELP x\nidem_reports_total{result=\"applied\"} 10001\n\
                    idem_reports_total{result=\"stale\"} 3\nidem_pushes_total 4\n";
        assert_eq!(
            metric_value(text, "idem_reports_total{result=\"applied\"}").unwrap(),
            Some(10_001.0)
        );
        assert_eq!(metric_value(text, "idem_pushes_total").unwrap(), Some(4.0));
        assert_eq!(metric_value(text, "idem_pushes").unwrap(), None);
        assert!(metric_value("idem_x NaNx\n", "idem_x").is_err());
    }

    #[test]
    fn a_series_is_found_whatever_instance_label_the_server_adds() {
        let text = "idem_reports_total{result=\"applied\",instance=\"a\"} 7\n\
                    idem_pushes_total{instance=\"a \\\"b\\\"\"} 4\n\
                    idem_reports_total{instance=\"a\",result=\"stale\"} 3\n";
        assert_eq!(
            metric_value(text, "idem_reports_total{result=\"applied\"}").unwrap(),
            Some(7.0)
        );
        assert_eq!(
            metric_value(text, "idem_reports_total{result=\"stale\"}").unwrap(),
            Some(3.0)
        );
        assert_eq!(metric_value(text, "idem_pushes_total").unwrap(), Some(4.0));
        assert_eq!(
            metric_value(text, "idem_reports_total{result=\"x\"}").unwrap(),
            None
        );
    }

    #[test]
    fn server_urls_must_be_http_without_a_path() {
        assert!(ServerClient::new("http://127.0.0.1:8080/").is_ok());
        assert_eq!(
            ServerClient::new("http://127.0.0.1:8080/")
                .unwrap()
                .base_url(),
            "http://127.0.0.1:8080"
        );
        for bad in ["127.0.0.1:8080", "mqtt://x", "http://", "http://x/v1"] {
            assert!(ServerClient::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn label_filters_are_escaped_for_the_query_string() {
        assert_eq!(query_escape("device-sim:sim-"), "device-sim:sim-");
        assert_eq!(query_escape("a b&c"), "a%20b%26c");
    }
}
