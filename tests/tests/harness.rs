//! Proves the harness itself: private brokers and clusters start, answer,
//! stop and restart, and test databases appear and disappear. If these fail,
//! no end-to-end result means anything.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use idem_tests::{PrivateMosquitto, PrivatePostgres, TestDatabase};
use rumqttc::{AsyncClient, Event, EventLoop, Incoming, QoS};
use sqlx::{Connection, PgConnection};

/// Polls a fresh client until the broker's CONNACK (true) or a connection
/// error (false).
async fn mqtt_connects(broker: &PrivateMosquitto, client_id: &str) -> bool {
    let (_client, mut eventloop) = AsyncClient::new(broker.mqtt_options(client_id), 10);
    let attempt = async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Incoming::ConnAck(_))) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .unwrap_or(false)
}

/// Drives `eventloop` until a PUBLISH arrives; returns (topic, payload).
async fn next_publish(eventloop: &mut EventLoop) -> Result<(String, Vec<u8>)> {
    loop {
        if let Event::Incoming(Incoming::Publish(p)) = eventloop.poll().await? {
            return Ok((p.topic, p.payload.to_vec()));
        }
    }
}

/// Drives `eventloop` until SUBACK.
async fn until_suback(eventloop: &mut EventLoop) -> Result<()> {
    loop {
        if let Event::Incoming(Incoming::SubAck(_)) = eventloop.poll().await? {
            return Ok(());
        }
    }
}

async fn database_exists(admin_url: &str, name: &str) -> Result<bool> {
    let mut admin = PgConnection::connect(admin_url).await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&mut admin)
            .await?;
    admin.close().await?;
    Ok(exists)
}

async fn select_one(url: &str) -> Result<i32> {
    let mut conn = PgConnection::connect(url).await?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut conn).await?;
    conn.close().await?;
    Ok(one)
}

#[tokio::test]
async fn private_mosquitto_accepts_an_mqtt_connection() -> Result<()> {
    let broker = PrivateMosquitto::start()?;
    assert_ne!(broker.port(), 1883, "must not use the system broker's port");
    assert_eq!(broker.url(), format!("mqtt://127.0.0.1:{}", broker.port()));
    assert!(
        mqtt_connects(&broker, "harness-connect").await,
        "no CONNACK from the private broker\n{}",
        broker.log_tail()
    );
    Ok(())
}

#[tokio::test]
async fn a_message_published_on_the_private_broker_reaches_a_subscriber() -> Result<()> {
    let broker = PrivateMosquitto::start()?;
    let (subscriber, mut sub_loop) = AsyncClient::new(broker.mqtt_options("harness-sub"), 10);
    subscriber
        .subscribe("harness/+/echo", QoS::AtLeastOnce)
        .await?;
    tokio::time::timeout(Duration::from_secs(5), until_suback(&mut sub_loop))
        .await
        .context("no SUBACK within 5 s")??;

    let (publisher, mut pub_loop) = AsyncClient::new(broker.mqtt_options("harness-pub"), 10);
    let pub_task = tokio::spawn(async move {
        // Keep the publisher's connection driven until the test ends.
        while pub_loop.poll().await.is_ok() {}
    });
    publisher
        .publish(
            "harness/dev-1/echo",
            QoS::AtLeastOnce,
            false,
            b"{\"hello\":1}".to_vec(),
        )
        .await?;

    let (topic, payload) =
        tokio::time::timeout(Duration::from_secs(5), next_publish(&mut sub_loop))
            .await
            .context("the subscriber received nothing within 5 s")??;
    assert_eq!(topic, "harness/dev-1/echo");
    assert_eq!(payload, b"{\"hello\":1}");
    pub_task.abort();
    Ok(())
}

#[tokio::test]
async fn a_stopped_broker_refuses_connections_and_a_restarted_one_accepts_them() -> Result<()> {
    let mut broker = PrivateMosquitto::start()?;
    let port = broker.port();
    assert!(mqtt_connects(&broker, "before-stop").await);

    broker.stop()?;
    assert!(!broker.is_running());
    assert!(
        !mqtt_connects(&broker, "while-stopped").await,
        "a stopped broker still accepted a connection"
    );

    broker.restart()?;
    assert_eq!(broker.port(), port, "restart must keep the port");
    assert!(
        mqtt_connects(&broker, "after-restart").await,
        "the restarted broker refused a connection\n{}",
        broker.log_tail()
    );

    broker.kill()?;
    assert!(!mqtt_connects(&broker, "after-kill").await);
    broker.restart()?;
    assert!(mqtt_connects(&broker, "after-kill-restart").await);
    Ok(())
}

/// Publishes one retained message and waits until the broker has it.
async fn publish_retained(broker: &PrivateMosquitto, topic: &str, payload: &[u8]) -> Result<()> {
    let (client, mut eventloop) = AsyncClient::new(broker.mqtt_options("retained-pub"), 10);
    client
        .publish(topic, QoS::AtLeastOnce, true, payload.to_vec())
        .await?;
    let acked = async {
        loop {
            if let Event::Incoming(Incoming::PubAck(_)) = eventloop.poll().await? {
                return Ok::<(), anyhow::Error>(());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), acked)
        .await
        .context("no PUBACK within 5 s")??;
    client.disconnect().await?;
    // Drive the DISCONNECT out before the client goes away.
    let _ = tokio::time::timeout(Duration::from_millis(200), eventloop.poll()).await;
    Ok(())
}

/// Subscribes to `topic` and returns the retained payload, if the broker
/// delivers one within a second.
async fn retained_payload(broker: &PrivateMosquitto, topic: &str) -> Result<Option<Vec<u8>>> {
    let (client, mut eventloop) = AsyncClient::new(broker.mqtt_options("retained-sub"), 10);
    client.subscribe(topic, QoS::AtLeastOnce).await?;
    tokio::time::timeout(Duration::from_secs(5), until_suback(&mut eventloop))
        .await
        .context("no SUBACK within 5 s")??;
    match tokio::time::timeout(Duration::from_secs(1), next_publish(&mut eventloop)).await {
        Ok(received) => Ok(Some(received?.1)),
        Err(_) => Ok(None),
    }
}

#[tokio::test]
async fn a_persistent_broker_keeps_retained_messages_across_a_graceful_restart() -> Result<()> {
    let mut broker = PrivateMosquitto::start_persistent()?;
    publish_retained(&broker, "harness/dev-1/desired", b"{\"generation\":1}").await?;
    broker.stop()?;
    broker.restart()?;
    assert_eq!(
        retained_payload(&broker, "harness/dev-1/desired").await?,
        Some(b"{\"generation\":1}".to_vec()),
        "{}",
        broker.log_tail()
    );
    Ok(())
}

#[tokio::test]
async fn a_default_broker_forgets_retained_messages_when_restarted() -> Result<()> {
    let mut broker = PrivateMosquitto::start()?;
    publish_retained(&broker, "harness/dev-1/desired", b"{}").await?;
    assert_eq!(
        retained_payload(&broker, "harness/dev-1/desired").await?,
        Some(b"{}".to_vec())
    );
    broker.restart()?;
    assert_eq!(
        retained_payload(&broker, "harness/dev-1/desired").await?,
        None
    );
    Ok(())
}

#[tokio::test]
async fn the_private_broker_writes_its_log_into_its_own_directory() -> Result<()> {
    let broker = PrivateMosquitto::start()?;
    let log = broker.log_tail();
    assert!(
        log.contains(&format!("port {}", broker.port())),
        "the log does not mention the listener:\n{log}"
    );
    Ok(())
}

#[tokio::test]
async fn many_private_brokers_run_side_by_side_on_distinct_ports() -> Result<()> {
    let brokers = (0..4)
        .map(|_| PrivateMosquitto::start())
        .collect::<Result<Vec<_>>>()?;
    let mut ports: Vec<u16> = brokers.iter().map(PrivateMosquitto::port).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), brokers.len());
    for (i, broker) in brokers.iter().enumerate() {
        assert!(mqtt_connects(broker, &format!("side-by-side-{i}")).await);
    }
    Ok(())
}

#[test]
fn raising_the_fd_limit_reaches_the_hard_limit() -> Result<()> {
    let soft = idem_tests::raise_fd_limit()?;
    let (_, hard) = rlimit::Resource::NOFILE.get()?;
    assert_eq!(soft, hard);
    Ok(())
}

#[tokio::test]
async fn a_test_database_answers_queries_and_is_gone_after_drop() -> Result<()> {
    let db = TestDatabase::create().await?;
    let name = db.name().to_owned();
    assert!(name.starts_with("idem_test_"));

    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(db.pool()).await?;
    assert_eq!(one, 1);
    assert_eq!(select_one(db.url()).await?, 1, "url() must connect to it");
    let current: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(db.pool())
        .await?;
    assert_eq!(current, name);

    let admin = idem_tests::admin_database_url();
    assert!(database_exists(&admin, &name).await?);
    drop(db);
    assert!(
        !database_exists(&admin, &name).await?,
        "{name} still exists after drop"
    );
    Ok(())
}

#[tokio::test]
async fn a_test_database_runs_the_migrations_it_is_given() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("0001_harness_probe.sql"),
        "CREATE TABLE harness_probe (id BIGINT PRIMARY KEY);",
    )?;
    let migrator = sqlx::migrate::Migrator::new(dir.path()).await?;
    let db = TestDatabase::create_with(&migrator).await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM harness_probe")
        .fetch_one(db.pool())
        .await?;
    assert_eq!(rows, 0);
    Ok(())
}

#[tokio::test]
async fn parallel_test_databases_get_distinct_names() -> Result<()> {
    let (a, b, c) = tokio::try_join!(
        TestDatabase::create(),
        TestDatabase::create(),
        TestDatabase::create()
    )?;
    assert_ne!(a.name(), b.name());
    assert_ne!(b.name(), c.name());
    assert_ne!(a.name(), c.name());
    Ok(())
}

#[tokio::test]
async fn an_unreachable_postgres_fails_with_a_message_saying_what_to_do() -> Result<()> {
    // A port nothing listens on: reserved by binding, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let Err(e) = TestDatabase::create_on(&url, None).await else {
        bail!("creating a database on a closed port succeeded");
    };
    let message = format!("{e:#}");
    assert!(
        message.contains("PostgreSQL is not reachable") && message.contains("scripts/test"),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn a_private_postgres_answers_stops_and_restarts_on_the_same_port() -> Result<()> {
    let mut pg = PrivatePostgres::start()?;
    let port = pg.port();
    assert_ne!(port, 5432, "must not use the shared cluster's port");
    assert_eq!(select_one(&pg.url()).await?, 1, "{}", pg.log_tail());

    pg.stop()?;
    assert!(!pg.is_running());
    assert!(
        select_one(&pg.url()).await.is_err(),
        "a stopped cluster still answered"
    );

    pg.restart()?;
    assert_eq!(pg.port(), port);
    assert_eq!(select_one(&pg.url()).await?, 1, "{}", pg.log_tail());

    // A test database on the private cluster works too.
    let db = TestDatabase::create_on(&pg.url(), None).await?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(db.pool()).await?;
    assert_eq!(one, 1);
    drop(db);

    pg.kill()?;
    assert!(select_one(&pg.url()).await.is_err());
    pg.restart()?;
    assert_eq!(select_one(&pg.url()).await?, 1, "{}", pg.log_tail());
    Ok(())
}

#[tokio::test]
async fn a_test_database_with_the_server_migrations_has_the_schema() -> Result<()> {
    let db = TestDatabase::create_with(&idem_server::MIGRATOR).await?;
    let devices: i64 = sqlx::query_scalar("SELECT count(*) FROM devices")
        .fetch_one(db.pool())
        .await?;
    assert_eq!(devices, 0);
    Ok(())
}
