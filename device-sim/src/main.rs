//! `device-sim`: command-line entry point. Parses arguments, sets up logging
//! and hands over to the subcommand in `cli`; nothing else lives here.

mod cli;

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let args = cli::Cli::parse();
    cli::init_tracing(&args.global);
    cli::run(args).await
}
