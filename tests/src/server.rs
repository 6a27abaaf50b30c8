//! An idem server running in-process on port 0 against a harness database and
//! broker, with a small JSON client for its API and a watcher that records
//! every desired-state publish the broker delivers.
//!
//! Owns the server task: dropping `TestServer` cancels it.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use idem_protocol::{Channel, TopicRoot};
use rumqttc::{AsyncClient, Event, Packet};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api_client::ApiClient;
use crate::broker::{subscribe_acknowledged, PrivateMosquitto};
use crate::certs::CertFiles;
use crate::database::TestDatabase;
use crate::deadline::{within, Deadline};

/// How long [`TestServer::stop`] waits for a graceful stop: the server's
/// own bounds (HTTP grace, flushing batches) end well inside it.
pub const STOP_LIMIT: Duration = Duration::from_secs(30);

/// A running server; its API client is reached through `Deref`
/// (`server.get("/v1/fleet")`).
pub struct TestServer {
    pub addr: SocketAddr,
    pub topic_root: TopicRoot,
    /// The server's instance name (CloudEvents source `/idem/{instance}`).
    pub instance: String,
    api: ApiClient,
    token: CancellationToken,
    task: Option<JoinHandle<Result<(), idem_server::ServerError>>>,
}

/// Settings a test may change; everything else is the server's default.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// `--insecure-no-auth`; otherwise the harness creates an admin token
    /// that the server's API client sends.
    pub insecure_no_auth: bool,
    /// `--open-metrics`.
    pub open_metrics: bool,
    /// `--open-events`.
    pub open_events: bool,
    pub push_timeout: Duration,
    pub auto_register: bool,
    /// The spec budget (`--max-spec-bytes`).
    pub max_spec_bytes: usize,
    /// 1 = no retries (a failure quarantines at once).
    pub max_attempts: u32,
    pub retry_backoff: Duration,
    /// Pushes per second, 0 = unlimited.
    pub push_rate: u32,
    pub debounce: Duration,
    /// Zero = no periodic resync.
    pub resync_interval: Duration,
    /// At resync, devices whose last report is older are asked to report.
    pub stale_after: Duration,
    /// Reuse this topic root (e.g. a second server over the same fleet).
    pub topic_root: Option<String>,
    pub instance: Option<String>,
    /// `--share-group`.
    pub share_group: Option<String>,
    /// A worker whose write has not committed for this long makes `/readyz` fail.
    pub stuck_after: Duration,
    /// `--http-max-connections`.
    pub http_max_connections: usize,
    /// `--http-header-timeout`: idle and never-sending connections are closed after it.
    pub http_header_timeout: Duration,
    /// `--http-body-timeout`.
    pub http_body_timeout: Duration,
    /// `--http-max-body-bytes`.
    pub http_max_body_bytes: u64,
    /// `--sse-max-clients`.
    pub sse_max_clients: usize,
    /// `--sse-client-buffer` (events).
    pub sse_client_buffer: usize,
    /// `--sse-send-timeout`.
    pub sse_send_timeout: Duration,
    /// `--sse-replay-rate` (events per second per client).
    pub sse_replay_rate: u32,
    /// `--mqtt-username` / `--mqtt-password`.
    pub mqtt_credentials: Option<(String, String)>,
    /// `--broker-accounts`.
    pub broker_accounts: idem_server::config::BrokerAccounts,
    /// `--broker-accounts-file`: the broker's own accounts, not devices.
    pub broker_accounts_file: Option<PathBuf>,
    /// `--mqtt-keep-alive`.
    pub mqtt_keep_alive: Duration,
    /// `--mqtt-intake-buffer-bytes`.
    pub mqtt_intake_buffer_bytes: usize,
    /// `--mqtt-events-qos`.
    pub mqtt_events_qos: u8,
    /// `--ready-max-intake-age`.
    pub ready_max_intake_age: Duration,
    /// `--recheck-after-stall`.
    pub recheck_after_stall: Duration,
    /// `--recheck-rate`.
    pub recheck_rate: u32,
    /// `--mqtt-ca-file`; `None` takes the broker's test CA when its
    /// listener is TLS.
    pub mqtt_ca_file: Option<PathBuf>,
    /// `--mqtt-client-cert` / `--mqtt-client-key`.
    pub mqtt_client_cert: Option<CertFiles>,
    /// `--tls-cert` / `--tls-key` with the CA that signed them: the API is
    /// served over HTTPS and the test client trusts that CA.
    pub https: Option<(CertFiles, PathBuf)>,
    /// How long `start` waits for `/readyz` to answer 200.
    pub ready_timeout: Duration,
    /// `--plan-ttl`.
    pub plan_ttl: Duration,
    /// `--require-approval`.
    pub require_approval: bool,
}

impl Default for ServerSettings {
    fn default() -> Self {
        let server = idem_server::Config::defaults();
        Self {
            insecure_no_auth: false,
            open_metrics: false,
            open_events: false,
            push_timeout: Duration::from_secs(10),
            auto_register: false,
            max_spec_bytes: 64 * 1024,
            max_attempts: 1,
            retry_backoff: Duration::from_millis(100),
            push_rate: 0,
            debounce: Duration::from_millis(200),
            resync_interval: Duration::ZERO,
            stale_after: Duration::from_secs(300),
            topic_root: None,
            instance: None,
            share_group: None,
            stuck_after: Duration::from_secs(30),
            http_max_connections: server.http.http_max_connections,
            http_header_timeout: server.http.http_header_timeout,
            http_body_timeout: server.http.http_body_timeout,
            http_max_body_bytes: server.http.http_max_body_bytes,
            sse_max_clients: server.sse.sse_max_clients,
            sse_client_buffer: server.sse.sse_client_buffer,
            sse_send_timeout: server.sse.sse_send_timeout,
            sse_replay_rate: server.sse.sse_replay_rate,
            mqtt_credentials: None,
            broker_accounts: idem_server::config::BrokerAccounts::None,
            broker_accounts_file: None,
            mqtt_keep_alive: server.mqtt.mqtt_keep_alive,
            mqtt_intake_buffer_bytes: server.mqtt.mqtt_intake_buffer_bytes,
            mqtt_events_qos: server.events.mqtt_events_qos,
            ready_max_intake_age: server.readiness.ready_max_intake_age,
            recheck_after_stall: server.engine.recheck_after_stall,
            recheck_rate: server.engine.recheck_rate.map_or(0, NonZeroU32::get),
            mqtt_ca_file: None,
            mqtt_client_cert: None,
            https: None,
            ready_timeout: Duration::from_secs(15),
            plan_ttl: server.changes.plan_ttl,
            require_approval: false,
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
        config.database.database_url = db.url().into();
        config.mqtt.mqtt_url = broker.url().into();
        config.fleet.topic_root = format!("idem-test/{}", &unique[..12]);
        config.fleet.instance = format!("test-{}", &unique[..12]);
        config.engine.push_timeout = settings.push_timeout;
        config.security.insecure_no_auth = settings.insecure_no_auth;
        config.security.open_metrics = settings.open_metrics;
        config.security.open_events = settings.open_events;
        config.fleet.auto_register = settings.auto_register;
        config.fleet.max_spec_bytes = settings.max_spec_bytes;
        config.engine.max_attempts = settings.max_attempts;
        config.engine.retry_backoff = settings.retry_backoff;
        config.engine.retry_backoff_max = settings.retry_backoff.max(Duration::from_secs(1));
        config.engine.push_rate = NonZeroU32::new(settings.push_rate);
        config.engine.debounce = settings.debounce;
        config.engine.resync_interval = Some(settings.resync_interval).filter(|d| !d.is_zero());
        config.engine.stale_after = settings.stale_after;
        config.readiness.stuck_after = settings.stuck_after;
        config.changes.plan_ttl = settings.plan_ttl;
        config.changes.require_approval = settings.require_approval;
        config.http.http_max_connections = settings.http_max_connections;
        config.http.http_header_timeout = settings.http_header_timeout;
        config.http.http_body_timeout = settings.http_body_timeout;
        config.http.http_max_body_bytes = settings.http_max_body_bytes;
        config.sse.sse_max_clients = settings.sse_max_clients;
        config.sse.sse_client_buffer = settings.sse_client_buffer;
        config.sse.sse_send_timeout = settings.sse_send_timeout;
        config.sse.sse_replay_rate = settings.sse_replay_rate;
        if let Some(root) = settings.topic_root {
            config.fleet.topic_root = root;
        }
        config.mqtt.share_group = settings.share_group;
        if let Some(instance) = settings.instance {
            config.fleet.instance = instance;
        }
        config.security.broker_accounts = settings.broker_accounts;
        config.security.broker_accounts_file = settings.broker_accounts_file;
        config.mqtt.mqtt_keep_alive = settings.mqtt_keep_alive;
        config.mqtt.mqtt_intake_buffer_bytes = settings.mqtt_intake_buffer_bytes;
        config.events.mqtt_events_qos = settings.mqtt_events_qos;
        config.readiness.ready_max_intake_age = settings.ready_max_intake_age;
        config.engine.recheck_after_stall = settings.recheck_after_stall;
        config.engine.recheck_rate = NonZeroU32::new(settings.recheck_rate);
        if let Some((username, password)) = settings.mqtt_credentials {
            config.mqtt.mqtt_username = Some(username);
            config.mqtt.mqtt_password = Some(password.into());
        }
        config.mqtt.mqtt_ca_file = settings
            .mqtt_ca_file
            .or_else(|| broker.ca_file().map(Path::to_path_buf));
        if let Some(client) = settings.mqtt_client_cert {
            config.mqtt.mqtt_client_cert = Some(client.cert);
            config.mqtt.mqtt_client_key = Some(client.key);
        }
        if let Some((identity, _)) = &settings.https {
            config.http.tls_cert = Some(identity.cert.clone());
            config.http.tls_key = Some(identity.key.clone());
        }
        let valid = config.validate().context("test server configuration")?;
        let topic_root = valid.fleet.topic_root.clone();
        let instance = valid.fleet.instance.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the API port")?;
        let addr = listener.local_addr().context("reading the API address")?;
        let admin_token = if settings.insecure_no_auth {
            None
        } else {
            Some(create_token(db.pool(), &format!("test-admin-{}", &unique[..12]), "admin").await?)
        };
        let token = CancellationToken::new();
        let pool = db.pool().clone();
        let task = tokio::spawn(idem_server::run(valid, listener, pool, token.clone()));
        let api = match &settings.https {
            Some((_, ca)) => ApiClient::https(addr, ca)?,
            None => ApiClient::new(addr)?,
        };
        let server = Self {
            addr,
            topic_root,
            instance,
            api: api.with_token(admin_token.as_deref()),
            token,
            task: Some(task),
        };
        server.wait_ready(settings.ready_timeout).await?;
        Ok(server)
    }

    async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Deadline::after(timeout);
        let mut last = String::from("no answer yet");
        loop {
            let answer = deadline
                .run(
                    format!("idem server at {} ready ({last})", self.addr),
                    self.api.get("/readyz"),
                )
                .await?;
            match answer {
                Ok((200, _)) => return Ok(()),
                Ok((status, body)) => last = format!("last answer: {status} {body}"),
                Err(e) => last = format!("last error: {e:#}"),
            }
            if deadline.has_passed() {
                bail!(
                    "idem server at {} not ready after {timeout:?} ({last})",
                    self.addr
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the server gracefully and returns how it ended; fails when it
    /// has not ended within [`STOP_LIMIT`].
    pub async fn stop(mut self) -> Result<()> {
        self.token.cancel();
        if let Some(task) = self.task.take() {
            within(
                STOP_LIMIT,
                format!("the server at {} stopping after it was told to", self.addr),
                task,
            )
            .await?
            .context("server task panicked")?
            .context("server returned an error")?;
        }
        Ok(())
    }
}

/// Creates an operator token directly in the database (as
/// `idem-server token create` does) and returns its secret.
pub async fn create_token(pool: &sqlx::PgPool, name: &str, role: &str) -> Result<String> {
    let token = idem_server::http::auth::generate_token();
    idem_server::store::access::create_token(
        pool,
        &idem_server::store::access::NewToken {
            name,
            role,
            hash: &token.hash,
            created_by: Some("test harness"),
            expires_at: None,
        },
    )
    .await
    .context("creating an operator token")?
    .with_context(|| format!("a token named {name:?} exists already"))?;
    Ok(token.secret)
}

impl TestServer {
    /// A client of this server's API sending `token` (or none).
    pub fn client_with(&self, token: Option<&str>) -> ApiClient {
        self.api.with_token(token)
    }

    /// Creates a token with `role` through the API (as the harness's admin)
    /// and returns a client that sends it.
    pub async fn client_for_role(&self, name: &str, role: &str) -> Result<ApiClient> {
        let (status, body) = self
            .api
            .post(
                "/v1/tokens",
                &serde_json::json!({"name": name, "role": role}),
            )
            .await?;
        if status != 201 {
            bail!("POST /v1/tokens answered {status}: {body}");
        }
        let token = body["token"].as_str().context("token in the answer")?;
        Ok(self.api.with_token(Some(token)))
    }
}

impl std::ops::Deref for TestServer {
    type Target = ApiClient;
    fn deref(&self) -> &ApiClient {
        &self.api
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// Counts desired-state publishes per device, as a separate subscriber on
/// `{root}/+/desired` sees them. It also follows the server's
/// `io.idem.run.completed` events, the marker that every push of a run has
/// been delivered (see [`DesiredWatcher::wait_for_run_completed`]).
pub struct DesiredWatcher {
    seen: Arc<Mutex<HashMap<String, usize>>>,
    /// When each publish arrived, in arrival order.
    arrivals: Arc<Mutex<Vec<Instant>>>,
    /// Run ids whose `io.idem.run.completed` event arrived.
    completed_runs: Arc<Mutex<HashSet<String>>>,
    client: AsyncClient,
    task: JoinHandle<()>,
}

impl DesiredWatcher {
    /// Subscribes and waits for the SUBACK, so nothing published afterwards
    /// is missed.
    pub async fn start(broker: &PrivateMosquitto, root: &TopicRoot) -> Result<Self> {
        let mut options =
            broker.mqtt_options(format!("desired-watch-{}", uuid::Uuid::new_v4().simple()));
        // A run.completed event lists up to 1,000 outcomes: far over
        // rumqttc's default 10 KiB packet limit.
        options.set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 100);
        // `{root}/events/io.idem.run.completed/`, followed by the run id.
        let completed_prefix = root.event_topic("io.idem.run.completed", "");
        subscribe_acknowledged(
            &client,
            &mut eventloop,
            &[
                root.filter(Channel::Desired),
                format!("{completed_prefix}+"),
            ],
            "the desired watcher",
        )
        .await?;
        let seen = Arc::new(Mutex::new(HashMap::new()));
        let sink = seen.clone();
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let arrivals_sink = arrivals.clone();
        let completed_runs = Arc::new(Mutex::new(HashSet::new()));
        let completed_sink = completed_runs.clone();
        let root = root.clone();
        let task = tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                let Event::Incoming(Packet::Publish(p)) = event else {
                    continue;
                };
                if let Some(run_id) = p.topic.strip_prefix(&completed_prefix) {
                    completed_sink
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(run_id.to_owned());
                    continue;
                }
                arrivals_sink
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(Instant::now());
                if let Ok(parsed) = root.parse(&p.topic) {
                    let mut seen = sink.lock().unwrap_or_else(PoisonError::into_inner);
                    *seen.entry(parsed.device.to_string()).or_insert(0) += 1;
                }
            }
        });
        Ok(Self {
            seen,
            arrivals,
            completed_runs,
            client,
            task,
        })
    }

    /// Waits until the server's `io.idem.run.completed` event for `run_id`
    /// has arrived here. The server sends desired state and events over one
    /// MQTT connection, in order, and relays the event only after the run's
    /// last outcome committed: once it is here, so is every push the run
    /// made. (Order could break only under back-pressure: a push the server
    /// hands over while its MQTT request queue is full goes out from a task
    /// of its own, and a QoS 0 event could overtake QoS 1 publishes queued
    /// for this subscriber if its in-flight window were full. The tests'
    /// fleets fill neither; this subscriber acknowledges at once.)
    pub async fn wait_for_run_completed(&self, run_id: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self
                .completed_runs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(run_id)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the run.completed event of run {run_id} did not arrive over MQTT within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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
