//! `perf record` over one step (`--perf STEP`): started before the step,
//! stopped with SIGINT by PID after it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

/// A `perf record` child covering one step; stopped with SIGINT by PID.
pub struct Perf {
    pub child: Child,
    pub output: PathBuf,
}

impl Perf {
    pub fn start(step: &str, server_pid: u32, all: bool) -> Result<Self> {
        let output = PathBuf::from(format!("perf-{step}.data"));
        let mut command = Command::new("perf");
        command
            .args(["record", "-F", "499", "-g", "-o"])
            .arg(&output);
        if all {
            command.arg("-a");
        } else {
            command.args(["-p", &server_pid.to_string()]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting `perf record` (is linux-perf installed?)")?;
        // perf needs a moment to attach before the step starts.
        std::thread::sleep(Duration::from_millis(500));
        Ok(Self { child, output })
    }

    pub fn stop(mut self) -> Result<PathBuf> {
        let pid = nix::unistd::Pid::from_raw(
            i32::try_from(self.child.id()).context("perf's pid does not fit in an i32")?,
        );
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT)
            .context("stopping perf record")?;
        self.child.wait().context("waiting for perf record")?;
        Ok(self.output)
    }
}
