//! `idem-server` binary: everything is in the library (`idem_server::cli`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    idem_server::cli::run_from_env().await
}
