//! `idem-server` binary: configuration, logging, signals; everything else is
//! the library.

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = idem_server::Config::parse();
    let valid = config.validate().context("invalid configuration")?;
    let pool =
        idem_server::store::connect(&valid.config.database_url, valid.config.db_max_connections)
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
    idem_server::run(valid, listener, pool, token)
        .await
        .context("server stopped with an error")?;
    tracing::info!("idem-server stopped");
    Ok(())
}

async fn cancel_on_signal(token: CancellationToken) {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
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
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutdown requested: stopping intake, flushing batches");
    token.cancel();
}
