//! The `idem-server` command line: configuration from flags/environment,
//! logging, signal handling. Shared by the binary and by the test harness's
//! out-of-process server; holds no server logic.

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::Config;

/// `idem-server [flags]` runs the server; `idem-server token …` manages
/// operator tokens.
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
    Token(crate::token_cli::TokenCommand),
    /// Set a broker up for idem (dynamic-security roles and accounts, or a
    /// password file and ACL file).
    #[command(subcommand)]
    Broker(crate::broker_cli::BrokerCommand),
}

/// Parses the process arguments and runs the server until SIGINT/SIGTERM.
pub async fn run_from_env() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // Logs on stderr: stdout is for what a command prints (a new token).
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Token(command)) => {
            return crate::token_cli::run(&cli.config.database_url, command).await;
        }
        Some(Command::Broker(command)) => {
            let valid = cli.config.validate().context("invalid configuration")?;
            return crate::broker_cli::run(&valid, command).await;
        }
        None => {}
    }
    let config = cli.config;
    let valid = config.validate().context("invalid configuration")?;
    let pool = crate::store::connect(&valid.config.database_url, valid.config.db_max_connections)
        .await
        .with_context(|| {
            format!(
                "cannot reach PostgreSQL at {}: start it (scripts/demo does) or set IDEM_DATABASE_URL",
                valid.config.database_url
            )
        })?;
    let listener = tokio::net::TcpListener::bind(valid.config.http_addr)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (set IDEM_HTTP_ADDR)",
                valid.config.http_addr
            )
        })?;
    tracing::info!(addr = %valid.config.http_addr, broker = %valid.config.mqtt_url, "idem-server starting");

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
