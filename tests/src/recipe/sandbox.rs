//! The recipe's sandbox, standing for the machine's `/`: what Debian's
//! `mosquitto` package leaves there, the `systemctl` stand-in on `PATH`,
//! the paths a recipe names inside it, and the file modes it sets and reads.

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::substitutions::substitutions;
use super::{BrokerUser, RecipeMachine, TAIL_LINES};
use crate::support::{find_binary, free_port, tail};

impl RecipeMachine {
    /// A sandbox with what `apt-get install mosquitto` leaves on Debian
    /// (`/etc/mosquitto/{conf.d,certs}`, its main config, `/var/lib/mosquitto`
    /// and `/var/log/mosquitto` owned by `mosquitto`), a `systemctl`
    /// stand-in and `idem-server` on `PATH`. `recipe_text` is the mode's
    /// whole recipe.
    pub fn new(server_binary: &Path, database_url: &str, recipe_text: &str) -> Result<Self> {
        for (tool, package) in [
            ("bash", "bash"),
            ("openssl", "openssl"),
            ("mosquitto", "mosquitto"),
            ("mosquitto_ctrl", "mosquitto"),
            ("mosquitto_passwd", "mosquitto"),
        ] {
            if find_binary(tool, &[PathBuf::from("/usr/sbin").join(tool)]).is_none() {
                bail!("{tool} not found: the recipe needs it (apt-get install {package})");
            }
        }
        let dir = tempfile::Builder::new()
            .prefix("idem-recipe-")
            .tempdir()
            .context("creating the recipe's sandbox")?;
        // Mosquitto, once it dropped root, must reach its files inside.
        set_mode(dir.path(), 0o755)?;
        let broker_user = BrokerUser::detect()?;
        let broker_port = free_port()?;
        let substitutions = substitutions(
            dir.path(),
            broker_port,
            database_url,
            server_binary,
            &broker_user,
            recipe_text,
        )?;
        let machine = Self {
            server_binary: server_binary.to_path_buf(),
            broker_port,
            broker_user,
            substitutions,
            recipe_text: recipe_text.to_owned(),
            broker: None,
            server: None,
            ctl_errors: Vec::new(),
            runs: 0,
            dir,
        };
        machine.install_packages()?;
        Ok(machine)
    }

    /// The sandbox directory standing for `/`.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// `path` (absolute, as the recipe names it) inside the sandbox.
    pub fn path(&self, path: &str) -> PathBuf {
        self.root().join(path.trim_start_matches('/'))
    }

    /// The recipe's `$HOME`.
    pub fn home(&self) -> PathBuf {
        self.path("/root")
    }

    /// Mosquitto's log (Debian's `/var/log/mosquitto/mosquitto.log`).
    pub fn broker_log(&self) -> PathBuf {
        self.path("/var/log/mosquitto/mosquitto.log")
    }

    /// The last lines of Mosquitto's log and output, for messages.
    pub fn broker_log_tail(&self) -> String {
        format!(
            "--- mosquitto.log ---\n{}\n--- mosquitto stderr ---\n{}",
            tail(&self.broker_log(), TAIL_LINES),
            tail(&self.path("/var/log/mosquitto/stderr"), TAIL_LINES)
        )
    }

    fn install_packages(&self) -> Result<()> {
        for dir in [
            "/etc/mosquitto/conf.d",
            "/etc/mosquitto/certs",
            "/etc/systemd/system",
            "/var/lib/mosquitto",
            "/var/log/mosquitto",
            "/root",
            "/bin",
            "/ctl",
        ] {
            let path = self.path(dir);
            fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
            set_mode(&path, 0o755)?;
        }
        set_mode(&self.home(), 0o700)?;
        set_mode(&self.path("/ctl"), 0o700)?;
        for dir in ["/var/lib/mosquitto", "/var/log/mosquitto"] {
            self.give_to_broker(&self.path(dir))?;
        }
        // Debian's /etc/mosquitto/mosquitto.conf, its paths in the sandbox.
        let user = if nix::unistd::geteuid().is_root() && !self.broker_user.privileged {
            "user root\n"
        } else {
            ""
        };
        write(
            &self.path("/etc/mosquitto/mosquitto.conf"),
            &format!(
                "# Debian's /etc/mosquitto/mosquitto.conf, in the recipe test's sandbox\n\
                 {user}\
                 persistence true\n\
                 persistence_location {lib}/\n\
                 log_dest file {log}\n\
                 include_dir {confd}\n",
                lib = self.path("/var/lib/mosquitto").display(),
                log = self.broker_log().display(),
                confd = self.path("/etc/mosquitto/conf.d").display(),
            ),
            0o644,
        )?;
        // `systemctl ARGS…` asks the test (a request file) and waits for
        // its answer, at most a minute.
        write(
            &self.path("/bin/systemctl"),
            "#!/bin/sh\n\
             # systemctl of the recipe test: the test does what was asked\n\
             request=\"$RECIPE_CTL/$$.$(date +%s%N)\"\n\
             printf '%s\\n' \"$*\" > \"$request.tmp\" && mv \"$request.tmp\" \"$request.req\"\n\
             i=0\n\
             while [ ! -e \"$request.done\" ]; do\n\
             \x20 i=$((i + 1)); [ \"$i\" -le 1200 ] || { echo 'systemctl: the test did not answer' >&2; exit 1; }\n\
             \x20 sleep 0.05\n\
             done\n\
             exit \"$(cat \"$request.done\")\"\n",
            0o755,
        )?;
        std::os::unix::fs::symlink(&self.server_binary, self.path("/bin/idem-server"))
            .context("linking idem-server into the sandbox's PATH")?;
        Ok(())
    }

    /// `chown` to Mosquitto's user (a no-op when it runs as us).
    fn give_to_broker(&self, path: &Path) -> Result<()> {
        if self.broker_user.privileged {
            std::os::unix::fs::chown(path, Some(self.broker_user.uid), Some(self.broker_user.gid))
                .with_context(|| format!("chown mosquitto {}", path.display()))?;
        }
        Ok(())
    }
}

/// The permission bits of `path` (`0o600`, …).
pub fn mode_of(path: &Path) -> Result<u32> {
    Ok(fs::metadata(path)
        .with_context(|| format!("reading the mode of {}", path.display()))?
        .permissions()
        .mode()
        & 0o7777)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", path.display()))
}

pub(super) fn write(path: &Path, text: &str, mode: u32) -> Result<()> {
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    set_mode(path, mode)
}
