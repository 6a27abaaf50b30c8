//! The deployment recipes of docs/OPERATIONS.md §9, run as written: the
//! shell blocks marked `<!-- recipe: MODE… -->` are read from the document
//! at test time and run by `bash` in a sandbox directory that stands for the
//! machine's `/etc`, `/var/lib` and `$HOME`, with only the substitutions a
//! test needs (a free port, the sandbox's paths, the test database, the
//! built server binary). A `systemctl` stand-in on `PATH` hands every
//! `systemctl …` of the recipe to this module, which plays systemd: it
//! starts the private Mosquitto from Debian's main config and the recipe's
//! `conf.d` file (with the umask of the recipe's drop-in), sends it SIGHUP,
//! and starts the real `idem-server` from the recipe's unit file and its
//! `EnvironmentFile`.
//!
//! Markers: `<!-- recipe: dynsec password-file -->` (the modes the next
//! ```` ```sh ```` block belongs to) and `<!-- recipe: password-file; after
//! registering devices -->` (run once the test has registered a device).
//!
//! It owns the sandbox directory, the `bash` it runs, the Mosquitto it
//! starts and the server process, each killed by its own handle when
//! dropped; it never touches a path outside the sandbox (every `/etc/` and
//! `/var/lib/` of a recipe must have been substituted, or it refuses to run).
//!
//! Here: the machine ([`RecipeMachine`]) and who owns the broker's files
//! ([`BrokerUser`]). By topic: `document` (the marked blocks of the
//! document), `substitutions` (what the test changes in a recipe, and the
//! check that it stays in the sandbox), `sandbox` (the sandbox as Debian's
//! packages leave it), `script_runner` (the recipe's `bash` and the
//! `systemctl` requests it sends) and `systemd` (what systemd does for them).

use std::path::PathBuf;
use std::process::Child;

use anyhow::{Context, Result};
use tempfile::TempDir;

use crate::process_server::ProcessServer;
use crate::support::kill_and_reap;

mod document;
mod sandbox;
mod script_runner;
mod substitutions;
mod systemd;
#[cfg(test)]
mod tests;

pub use document::{blocks, script, Block, Phase, MODES};
pub use sandbox::mode_of;
pub use substitutions::{check_confined, Substitutions};
pub use systemd::environment_file;

/// Log lines quoted in errors.
const TAIL_LINES: usize = 40;

/// Who owns the files Mosquitto must read: its own user, as on Debian,
/// when we are root and the user exists; else we, and Mosquitto runs as us.
#[derive(Debug, Clone)]
pub struct BrokerUser {
    /// Mosquitto drops root to the `mosquitto` user, as in production.
    pub privileged: bool,
    uid: u32,
    gid: u32,
}

impl BrokerUser {
    pub fn detect() -> Result<Self> {
        let root = nix::unistd::geteuid().is_root();
        let mosquitto =
            nix::unistd::User::from_name("mosquitto").context("looking up the `mosquitto` user")?;
        Ok(match (root, mosquitto) {
            (true, Some(user)) => Self {
                privileged: true,
                uid: user.uid.as_raw(),
                gid: user.gid.as_raw(),
            },
            _ => Self {
                privileged: false,
                uid: nix::unistd::geteuid().as_raw(),
                gid: nix::unistd::getegid().as_raw(),
            },
        })
    }

    pub fn uid(&self) -> u32 {
        self.uid
    }
}

/// A machine for one recipe run: the sandbox, the services systemd would
/// run, and the recipe's script runner.
pub struct RecipeMachine {
    dir: TempDir,
    server_binary: PathBuf,
    /// The port that stands for the recipe's 8883.
    pub broker_port: u16,
    pub broker_user: BrokerUser,
    substitutions: Substitutions,
    /// The whole recipe of the mode, for the required substitutions.
    recipe_text: String,
    broker: Option<Child>,
    /// The `idem-server` the recipe's unit runs.
    server: Option<ProcessServer>,
    /// What went wrong while playing systemd, for the error of the script.
    ctl_errors: Vec<String>,
    runs: usize,
}

impl std::fmt::Debug for RecipeMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecipeMachine")
            .field("root", &self.dir.path())
            .field("broker_port", &self.broker_port)
            .finish_non_exhaustive()
    }
}

impl Drop for RecipeMachine {
    fn drop(&mut self) {
        // The server goes first (its own Drop kills it), then the broker.
        self.server = None;
        kill_and_reap(self.broker.take(), "the recipe's mosquitto");
    }
}
