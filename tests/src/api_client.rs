//! A small JSON client for the idem HTTP API, shared by the in-process and
//! the out-of-process test servers. Bodies are the API's types
//! (`idem_protocol::api`) or raw JSON; answers come back as JSON (so tests
//! can check shapes) or, with [`ApiClient::get_as`], as the API's types.
//!
//! Owns no server; it only speaks HTTP to one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use idem_protocol::api::RunStarted;
use idem_protocol::OutcomeKind;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::deadline::Deadline;

/// How long connecting to a server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one request may take, answer body included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The `outcome` of an outcome row (`GET /v1/runs/{id}/outcomes`) as the
/// enum; `None` while the device is undecided.
pub fn outcome_of(row: &Value) -> Result<Option<OutcomeKind>> {
    serde_json::from_value(row["outcome"].clone())
        .with_context(|| format!("the outcome of row {row}"))
}

/// Requests to one server's API, with an operator token when it has one.
#[derive(Debug, Clone)]
pub struct ApiClient {
    base: String,
    http: reqwest::Client,
    /// Sent as `Authorization: Bearer …` with every request.
    token: Option<String>,
}

impl ApiClient {
    pub fn new(addr: SocketAddr) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .context("building the HTTP client")?;
        Ok(Self {
            base: format!("http://{addr}"),
            http,
            token: None,
        })
    }

    /// A client for `https://addr` trusting only the CA in `ca_file` (PEM).
    pub fn https(addr: SocketAddr, ca_file: &std::path::Path) -> Result<Self> {
        let pem = std::fs::read(ca_file)
            .with_context(|| format!("reading the CA file {}", ca_file.display()))?;
        let ca = reqwest::Certificate::from_pem(&pem).context("parsing the CA certificate")?;
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca)
            .build()
            .context("building the HTTPS client")?;
        Ok(Self {
            base: format!("https://{addr}"),
            http,
            token: None,
        })
    }

    /// A client for `addr` reusing an existing HTTP connection pool.
    pub fn with_client(addr: SocketAddr, http: reqwest::Client) -> Self {
        Self {
            base: format!("http://{addr}"),
            http,
            token: None,
        }
    }

    /// The same client sending `token` (or none) with every request.
    pub fn with_token(&self, token: Option<&str>) -> Self {
        Self {
            token: token.map(str::to_owned),
            ..self.clone()
        }
    }

    /// The operator token this client sends, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// A request to `path` with this client's token.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, self.url(path));
        match &self.token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }

    /// GET, returning status and JSON body (`Null` when empty).
    pub async fn get(&self, path: &str) -> Result<(u16, Value)> {
        let response = self
            .request(reqwest::Method::GET, path)
            .send()
            .await
            .with_context(|| format!("GET {path}"))?;
        decode(response).await
    }

    /// GET of a 200 answer, decoded as the API's type `T`.
    pub async fn get_as<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        let (status, body) = self.get(path).await?;
        if status != 200 {
            bail!("GET {path} answered {status}: {body}");
        }
        serde_json::from_value(body.clone())
            .with_context(|| format!("GET {path}: unexpected answer {body}"))
    }

    pub async fn post(&self, path: &str, body: &impl Serialize) -> Result<(u16, Value)> {
        let response = self
            .request(reqwest::Method::POST, path)
            .json(body)
            .send()
            .await
            .with_context(|| format!("POST {path}"))?;
        decode(response).await
    }

    pub async fn put(&self, path: &str, body: &impl Serialize) -> Result<(u16, Value)> {
        let response = self
            .request(reqwest::Method::PUT, path)
            .json(body)
            .send()
            .await
            .with_context(|| format!("PUT {path}"))?;
        decode(response).await
    }

    pub async fn delete(&self, path: &str) -> Result<(u16, Value)> {
        let response = self
            .request(reqwest::Method::DELETE, path)
            .send()
            .await
            .with_context(|| format!("DELETE {path}"))?;
        decode(response).await
    }

    /// Sends `body` with `method` (`POST` or `PUT`) and checks it is
    /// refused with `status` and error `code`, its message naming `named`.
    pub async fn expect_refused(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &Value,
        (status, code, named): (u16, &str, &str),
    ) -> Result<()> {
        let (got, answer) = if method == reqwest::Method::PUT {
            self.put(path, body).await?
        } else {
            self.post(path, body).await?
        };
        if (got, &answer["error"]["code"]) != (status, &Value::from(code)) {
            bail!("{method} {path} {body}: expected {status} {code}, got {got} {answer}");
        }
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        if !message.contains(named) {
            bail!("{method} {path} {body}: the message does not name {named:?}: {message}");
        }
        Ok(())
    }

    /// POST with a raw body, for malformed-input tests.
    pub async fn post_raw(&self, path: &str, body: &'static str) -> Result<(u16, Value)> {
        let response = self
            .request(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .with_context(|| format!("POST {path}"))?;
        decode(response).await
    }

    /// The `/metrics` text.
    pub async fn metrics(&self) -> Result<String> {
        let response = self
            .request(reqwest::Method::GET, "/metrics")
            .send()
            .await
            .context("GET /metrics")?;
        response.text().await.context("reading /metrics")
    }

    /// The value of one exposed series, e.g. `idem_reports_total{result="stale"}`
    /// (the server's `instance` label left out).
    pub async fn metric(&self, series: &str) -> Result<f64> {
        let text = self.metrics().await?;
        match idem_device_sim::api::metric_value(&text, series) {
            Ok(Some(value)) => Ok(value),
            Ok(None) => bail!("series {series} not found in /metrics"),
            Err(e) => Err(e).context("reading /metrics"),
        }
    }

    /// `POST /v1/runs` with `body` (a `TargetedRequest` or its JSON);
    /// returns the run id.
    pub async fn start_run(&self, body: &impl Serialize) -> Result<String> {
        let (status, answer) = self.post("/v1/runs", body).await?;
        if status != 200 {
            bail!("POST /v1/runs answered {status}: {answer}");
        }
        let started: RunStarted = serde_json::from_value(answer.clone())
            .with_context(|| format!("no run_id in {answer}"))?;
        Ok(started.run_id.to_string())
    }

    /// Polls `GET /v1/runs/{id}` until the run is completed, all within
    /// `timeout` (a request that hangs counts against it too).
    pub async fn wait_run_completed(&self, run_id: &str, timeout: Duration) -> Result<Value> {
        let deadline = Deadline::after(timeout);
        let path = format!("/v1/runs/{run_id}");
        let mut last = Value::Null;
        loop {
            let (status, run) = deadline
                .run(
                    format!("run {run_id} completed (last answer: {last})"),
                    self.get(&path),
                )
                .await??;
            if status == 200 && run["state"] == "completed" {
                return Ok(run);
            }
            if deadline.has_passed() {
                bail!("run {run_id} not completed after {timeout:?}: {run}");
            }
            last = run;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Every outcome of a run, across pages: device id → outcome row.
    pub async fn run_outcomes(&self, run_id: &str) -> Result<HashMap<String, Value>> {
        let mut out = HashMap::new();
        let mut after: Option<String> = None;
        loop {
            let path = match &after {
                Some(a) => format!("/v1/runs/{run_id}/outcomes?limit=1000&after={a}"),
                None => format!("/v1/runs/{run_id}/outcomes?limit=1000"),
            };
            let (status, page) = self.get(&path).await?;
            if status != 200 {
                bail!("GET {path} answered {status}: {page}");
            }
            for row in page["outcomes"].as_array().cloned().unwrap_or_default() {
                let id = row["device_id"].as_str().unwrap_or_default().to_owned();
                out.insert(id, row);
            }
            match page["next_after"].as_str() {
                Some(next) => after = Some(next.to_owned()),
                None => return Ok(out),
            }
        }
    }
}

async fn decode(response: reqwest::Response) -> Result<(u16, Value)> {
    let status = response.status().as_u16();
    let text = response.text().await.context("reading the response body")?;
    let body = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).with_context(|| format!("response is not JSON: {text}"))?
    };
    Ok((status, body))
}
