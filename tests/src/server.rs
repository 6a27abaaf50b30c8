//! An idem server running in-process on port 0 against a harness database and
//! broker, with a small JSON client for its API and a watcher that records
//! every desired-state publish the broker delivers.
//!
//! Owns the server task: dropping `TestServer` cancels it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use idem_protocol::{Channel, TopicRoot};
use rumqttc::{AsyncClient, Event, Packet, QoS};
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::broker::PrivateMosquitto;
use crate::database::TestDatabase;

/// A running server and a client for its API.
pub struct TestServer {
    pub addr: SocketAddr,
    pub topic_root: TopicRoot,
    /// The server's instance name (CloudEvents source `/idem/{instance}`).
    pub instance: String,
    http: reqwest::Client,
    token: CancellationToken,
    task: Option<JoinHandle<Result<(), idem_server::ServerError>>>,
}

/// Settings a test may change; everything else is the server's default.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub push_timeout: Duration,
    pub auto_register: bool,
    pub max_payload_bytes: usize,
    /// 1 = no retries (a failure quarantines at once).
    pub max_attempts: u32,
    pub retry_backoff: Duration,
    /// Pushes per second, 0 = unlimited.
    pub push_rate: u32,
    pub debounce: Duration,
    /// Zero = no periodic resync.
    pub resync_interval: Duration,
    pub instance: Option<String>,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            push_timeout: Duration::from_secs(10),
            auto_register: false,
            max_payload_bytes: 64 * 1024,
            max_attempts: 1,
            retry_backoff: Duration::from_millis(100),
            push_rate: 0,
            debounce: Duration::from_millis(200),
            resync_interval: Duration::ZERO,
            instance: None,
        }
    }
}

impl TestServer {
    /// Starts a server with a unique topic root and instance name and waits
    /// until it is ready (database reachable, MQTT subscribed).
    pub async fn start(
        db: &TestDatabase,
        broker: &PrivateMosquitto,
        settings: ServerSettings,
    ) -> Result<Self> {
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let mut config = idem_server::Config::defaults();
        config.database_url = db.url().to_owned();
        config.mqtt_url = broker.url();
        config.topic_root = format!("idem-test/{}", &unique[..12]);
        config.instance = format!("test-{}", &unique[..12]);
        config.push_timeout = settings.push_timeout;
        config.auto_register = settings.auto_register;
        config.max_payload_bytes = settings.max_payload_bytes;
        config.max_attempts = settings.max_attempts;
        config.retry_backoff = settings.retry_backoff;
        config.retry_backoff_max = settings.retry_backoff.max(Duration::from_secs(1));
        config.push_rate = settings.push_rate;
        config.debounce = settings.debounce;
        config.resync_interval = settings.resync_interval;
        if let Some(instance) = settings.instance {
            config.instance = instance;
        }
        let valid = config.validate().context("test server configuration")?;
        let topic_root = valid.topic_root.clone();
        let instance = valid.config.instance.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the API port")?;
        let addr = listener.local_addr().context("reading the API address")?;
        let token = CancellationToken::new();
        let pool = db.pool().clone();
        let task = tokio::spawn(idem_server::run(valid, listener, pool, token.clone()));
        let server = Self {
            addr,
            topic_root,
            instance,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .context("HTTP client")?,
            token,
            task: Some(task),
        };
        server.wait_ready(Duration::from_secs(15)).await?;
        Ok(server)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(response) = self.http.get(self.url("/readyz")).send().await {
                if response.status().is_success() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("idem server at {} not ready after {timeout:?}", self.addr);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// GET, returning status and JSON body.
    pub async fn get(&self, path: &str) -> Result<(u16, Value)> {
        let response = self
            .http
            .get(self.url(path))
            .send()
            .await
            .with_context(|| format!("GET {path}"))?;
        decode(response).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        let response = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .with_context(|| format!("POST {path}"))?;
        decode(response).await
    }

    pub async fn put(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        let response = self
            .http
            .put(self.url(path))
            .json(body)
            .send()
            .await
            .with_context(|| format!("PUT {path}"))?;
        decode(response).await
    }

    /// POST with a raw body, for malformed-input tests.
    pub async fn post_raw(&self, path: &str, body: &'static str) -> Result<(u16, Value)> {
        let response = self
            .http
            .post(self.url(path))
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
            .http
            .get(self.url("/metrics"))
            .send()
            .await
            .context("GET /metrics")?;
        response.text().await.context("reading /metrics")
    }

    /// The value of one exposed series, e.g. `idem_reports_total{result="stale"}`.
    pub async fn metric(&self, series: &str) -> Result<f64> {
        let text = self.metrics().await?;
        for line in text.lines() {
            if let Some(value) = line
                .strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
            {
                return value
                    .trim()
                    .parse()
                    .with_context(|| format!("parsing {series} value {value:?}"));
            }
        }
        bail!("series {series} not found in /metrics")
    }

    /// Polls `GET /v1/runs/{id}` until the run is completed.
    pub async fn wait_run_completed(&self, run_id: &str, timeout: Duration) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let (status, run) = self.get(&format!("/v1/runs/{run_id}")).await?;
            if status == 200 && run["state"] == "completed" {
                return Ok(run);
            }
            if Instant::now() > deadline {
                bail!("run {run_id} not completed after {timeout:?}: {run}");
            }
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

    /// Stops the server gracefully and returns how it ended.
    pub async fn stop(mut self) -> Result<()> {
        self.token.cancel();
        if let Some(task) = self.task.take() {
            task.await
                .context("server task panicked")?
                .context("server returned an error")?;
        }
        Ok(())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.token.cancel();
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

/// Counts desired-state publishes per device, as a separate subscriber on
/// `{root}/+/desired` sees them.
pub struct DesiredWatcher {
    seen: Arc<Mutex<HashMap<String, usize>>>,
    /// When each publish arrived, in arrival order.
    arrivals: Arc<Mutex<Vec<Instant>>>,
    client: AsyncClient,
    task: JoinHandle<()>,
}

impl DesiredWatcher {
    /// Subscribes and waits for the SUBACK, so nothing published afterwards
    /// is missed.
    pub async fn start(broker: &PrivateMosquitto, root: &TopicRoot) -> Result<Self> {
        let options =
            broker.mqtt_options(format!("desired-watch-{}", uuid::Uuid::new_v4().simple()));
        let (client, mut eventloop) = AsyncClient::new(options, 100);
        client
            .subscribe(root.filter(Channel::Desired), QoS::AtLeastOnce)
            .await
            .context("subscribing")?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let event = tokio::time::timeout_at(deadline.into(), eventloop.poll())
                .await
                .context("no SUBACK from the broker within 5 s")?
                .context("desired watcher connection")?;
            if let Event::Incoming(Packet::SubAck(_)) = event {
                break;
            }
        }
        let seen = Arc::new(Mutex::new(HashMap::new()));
        let sink = seen.clone();
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let arrivals_sink = arrivals.clone();
        let root = root.clone();
        let task = tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                if let Event::Incoming(Packet::Publish(p)) = event {
                    arrivals_sink
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(Instant::now());
                    if let Ok(parsed) = root.parse(&p.topic) {
                        let mut seen = sink.lock().unwrap_or_else(PoisonError::into_inner);
                        *seen.entry(parsed.device.to_string()).or_insert(0) += 1;
                    }
                }
            }
        });
        Ok(Self {
            seen,
            arrivals,
            client,
            task,
        })
    }

    /// Device id → number of desired publishes seen so far.
    pub fn seen(&self) -> HashMap<String, usize> {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The most publishes that arrived within any one-second window.
    pub fn max_per_second(&self) -> usize {
        let arrivals = self
            .arrivals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut best = 0;
        let mut start = 0;
        for end in 0..arrivals.len() {
            while arrivals[end].duration_since(arrivals[start]) >= Duration::from_secs(1) {
                start += 1;
            }
            best = best.max(end - start + 1);
        }
        best
    }

    /// Total publishes seen.
    pub fn total(&self) -> usize {
        self.seen().values().sum()
    }
}

impl Drop for DesiredWatcher {
    fn drop(&mut self) {
        let _ = self.client.try_disconnect();
        self.task.abort();
    }
}
