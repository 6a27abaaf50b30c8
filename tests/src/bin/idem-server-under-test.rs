//! The real `idem-server` command line, built inside this package so that
//! fault tests can run the server as a separate process (and SIGKILL it):
//! Cargo gives integration tests the path of their own package's binaries.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    idem_server::cli::run_from_env().await
}
