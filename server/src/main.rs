//! `idem-server` binary: everything is in the library (`idem_server::cli`);
//! this file picks the allocator.

/// With `--features mimalloc`; glibc's malloc otherwise (it measured
/// smaller here, see `scripts/bench --compare-allocator`).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    idem_server::cli::run_from_env().await
}
