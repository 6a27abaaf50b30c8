//! `idem-server` binary: everything is in the library (`idem_server::cli`);
//! this file picks the allocator.

/// mimalloc returns freed memory to the system: after a large run the
/// server's resident size falls back instead of staying at its peak.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    idem_server::cli::run_from_env().await
}
