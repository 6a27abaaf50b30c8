//! The `idem-server` command line: configuration from flags/environment,
//! logging (through a writer that scrubs the configuration's secrets from
//! every line), signal handling, and the exit status. Shared by the binary
//! and by the test harness's out-of-process server; holds no server logic.

pub mod broker;
pub(crate) mod token;

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::security::secret::{RedactingMakeWriter, SecretValues};
use crate::Config;

/// `idem-server [flags]` runs the server; `idem-server token …` manages
/// operator tokens; `idem-server broker …` sets a broker up.
#[derive(Debug, clap::Parser)]
#[command(
    name = "idem-server",
    version,
    about = "idem fleet reconciliation server"
)]
struct Cli {
    #[command(flatten)]
    config: Config,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Create, list or revoke operator tokens (needs only the database).
    #[command(subcommand)]
    Token(crate::cli::token::TokenCommand),
    /// Set a broker up for idem (dynamic-security roles and accounts, or a
    /// password file and ACL file).
    #[command(subcommand)]
    Broker(crate::cli::broker::BrokerCommand),
}

/// Parses the process arguments and runs the server until SIGINT/SIGTERM.
/// An error is printed (secrets scrubbed) and ends the process with status 1.
pub async fn run_from_env() -> ExitCode {
    let secrets = SecretValues::global();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        // Logs on stderr: stdout is for what a command prints (a new token).
        .with_writer(RedactingMakeWriter::new(std::io::stderr, secrets.clone()))
        .init();
    let cli = Cli::parse();
    secrets.add(cli.config.secret_values());
    let result = match cli.command {
        Some(Command::Token(command)) => {
            crate::cli::token::run(cli.config.database.database_url.expose(), command).await
        }
        Some(Command::Broker(command)) => match cli.config.validate() {
            Ok(valid) => crate::cli::broker::run(&valid, command).await,
            Err(e) => Err(anyhow::Error::new(e).context("invalid configuration")),
        },
        None => run(cli.config, &secrets).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Our messages carry no secret; third-party error text might.
            eprintln!("Error: {}", secrets.scrub(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config, secrets: &Arc<SecretValues>) -> anyhow::Result<()> {
    let valid = config.validate().context("invalid configuration")?;
    if let Some(credentials) = &valid.mqtt.credentials {
        secrets.add([credentials.password.expose().clone()]);
    }
    let database = &valid.database;
    // A session idle inside a transaction for a whole lease is a process
    // paused or cut off while it may hold the device-writes lock: ended by
    // PostgreSQL, so the other instances' writes and takeovers go on.
    let pool = crate::store::connect_with_idle_limit(
        database.url.expose(),
        database.max_connections,
        Some(valid.fleet.instance_lease),
    )
    .await
        .with_context(|| {
            format!(
                "cannot reach PostgreSQL at {} (password not shown): start it (scripts/demo does) or set IDEM_DATABASE_URL",
                database.url
            )
        })?;
    let listener = tokio::net::TcpListener::bind(valid.http.addr)
        .await
        .with_context(|| format!("cannot listen on {} (set IDEM_HTTP_ADDR)", valid.http.addr))?;
    tracing::info!(
        addr = %valid.http.addr,
        https = valid.http.tls.is_some(),
        broker = %valid.mqtt.url,
        mqtt_tls = valid.mqtt.tls.is_some(),
        mqtt_client_cert = valid.mqtt.tls.as_ref().is_some_and(|t| t.client.is_some()),
        mqtt_username = valid.mqtt.credentials.as_ref().map(|c| c.username.as_str()),
        database = %valid.database.url,
        "idem-server starting"
    );

    let token = CancellationToken::new();
    tokio::spawn(cancel_on_signal(token.clone()));
    crate::run(valid, listener, pool, token)
        .await
        .context("server stopped with an error")?;
    tracing::info!("idem-server stopped");
    Ok(())
}

async fn cancel_on_signal(token: CancellationToken) {
    let interrupt = tokio::signal::ctrl_c();
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutdown requested: stopping intake, flushing batches");
    token.cancel();
}
