//! Runs a recipe's script in `bash` inside the sandbox and answers the
//! `systemctl` requests its stand-in sends (request files under `/ctl`)
//! until the script exits or times out.

use std::fs::{self, File};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::sandbox::write;
use super::substitutions::check_confined;
use super::{RecipeMachine, TAIL_LINES};
use crate::support::{kill_and_reap, tail};

/// How long one run of a recipe's blocks may take.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);

impl RecipeMachine {
    /// Runs `script` (a recipe's blocks, substituted here) in `bash -e`,
    /// playing systemd for it, until it exits; an error carries its output.
    pub async fn run(&mut self, script: &str) -> Result<()> {
        let script = self.substitutions.apply(script, &self.recipe_text)?;
        check_confined(&script, self.root())?;
        self.runs += 1;
        let log = self.root().join(format!("script-{}.log", self.runs));
        write(
            &self.root().join(format!("script-{}.sh", self.runs)),
            &script,
            0o600,
        )?;
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone().context("duplicating the script log")?;
        let path = format!(
            "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            self.path("/bin").display()
        );
        let child = Command::new("bash")
            .args(["--noprofile", "--norc", "-euo", "pipefail", "-c", &script])
            .env_clear()
            .env("PATH", path)
            .env("HOME", self.home())
            .env("LANG", "C.UTF-8")
            .env("NO_COLOR", "1")
            .env("RECIPE_CTL", self.path("/ctl"))
            .current_dir(self.home())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .context("spawning bash for the recipe")?;
        let mut bash = Owned(Some(child));
        let deadline = Instant::now() + SCRIPT_TIMEOUT;
        let status = loop {
            self.serve_systemctl().await?;
            if let Some(status) = bash.try_wait()? {
                break status;
            }
            if Instant::now() > deadline {
                bail!(
                    "the recipe did not finish within {SCRIPT_TIMEOUT:?}\n--- its output ---\n{}",
                    tail(&log, TAIL_LINES)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if !status.success() {
            bail!(
                "the recipe failed ({status})\n--- script ---\n{script}\n--- its output ---\n{}\n\
                 --- systemctl ---\n{}\n{}",
                tail(&log, TAIL_LINES),
                self.ctl_errors.join("\n"),
                self.broker_log_tail()
            );
        }
        Ok(())
    }

    /// Answers every pending `systemctl` request, in order.
    async fn serve_systemctl(&mut self) -> Result<()> {
        let ctl = self.path("/ctl");
        let mut requests: Vec<PathBuf> = fs::read_dir(&ctl)
            .with_context(|| format!("reading {}", ctl.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "req"))
            .collect();
        requests.sort();
        for request in requests {
            let args = fs::read_to_string(&request)
                .with_context(|| format!("reading {}", request.display()))?;
            let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
            let status = match self.systemctl(&args).await {
                Ok(()) => 0,
                Err(e) => {
                    self.ctl_errors
                        .push(format!("systemctl {}: {e:#}", args.join(" ")));
                    1
                }
            };
            let done = request.with_extension("done");
            let tmp = request.with_extension("answer");
            fs::write(&tmp, status.to_string())
                .with_context(|| format!("writing {}", tmp.display()))?;
            fs::rename(&tmp, &done).with_context(|| format!("writing {}", done.display()))?;
            fs::remove_file(&request).with_context(|| format!("removing {}", request.display()))?;
        }
        Ok(())
    }
}

/// A child process killed and reaped when dropped.
struct Owned(Option<Child>);

impl Owned {
    fn try_wait(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match self.0.as_mut() {
            Some(child) => child.try_wait().context("checking the recipe's bash"),
            None => bail!("no child"),
        }
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
        }
        kill_and_reap(self.0.take(), "the recipe's bash");
    }
}
