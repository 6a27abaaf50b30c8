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

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use idem_protocol::TopicRoot;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;

use crate::process_server::ProcessServer;
use crate::support::{find_binary, free_port, kill_and_reap, loopback_addr, tail, wait_for_tcp};

/// The broker modes the document has a recipe for.
pub const MODES: [&str; 2] = ["dynsec", "password-file"];
/// The phase text of blocks that run after the test registered devices.
const AFTER_REGISTRATION: &str = "after registering devices";
/// How long one run of a recipe's blocks may take.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long Mosquitto gets to listen after a (re)start.
const BROKER_READY: Duration = Duration::from_secs(10);
/// Log lines quoted in errors.
const TAIL_LINES: usize = 40;
/// Where Debian puts the plugin; the recipe names this path.
const DEBIAN_PLUGIN: &str = "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so";

/// When a block runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Setting the machine up, before any device is registered.
    Setup,
    /// After the test registered a device through the API.
    AfterRegistration,
}

/// One marked shell block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub modes: Vec<String>,
    pub phase: Phase,
    /// The block's text, without the fences.
    pub text: String,
    /// 1-based line of the marker in the document.
    pub line: usize,
}

/// Every marked block of `markdown`, in document order. A marker must be
/// followed (blank lines aside) by a ```` ```sh ```` block, name only known
/// modes and at most the phase [`AFTER_REGISTRATION`].
pub fn blocks(markdown: &str) -> Result<Vec<Block>> {
    let lines: Vec<&str> = markdown.lines().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        let Some(marker) = line
            .strip_prefix("<!-- recipe:")
            .and_then(|rest| rest.strip_suffix("-->"))
        else {
            i += 1;
            continue;
        };
        let at = i + 1;
        let (modes, phase) = match marker.split_once(';') {
            Some((modes, phase)) => (modes, Some(phase.trim())),
            None => (marker, None),
        };
        let phase = match phase {
            None => Phase::Setup,
            Some(AFTER_REGISTRATION) => Phase::AfterRegistration,
            Some(other) => bail!(
                "docs line {at}: unknown recipe phase {other:?} (known: {AFTER_REGISTRATION:?})"
            ),
        };
        let modes: Vec<String> = modes.split_whitespace().map(str::to_owned).collect();
        if modes.is_empty() {
            bail!("docs line {at}: a recipe marker names no mode");
        }
        if let Some(unknown) = modes.iter().find(|m| !MODES.contains(&m.as_str())) {
            bail!("docs line {at}: unknown recipe mode {unknown:?} (known: {MODES:?})");
        }
        let mut j = i + 1;
        while j < lines.len() && lines[j].trim().is_empty() {
            j += 1;
        }
        if lines.get(j).map(|l| l.trim()) != Some("```sh") {
            bail!("docs line {at}: a recipe marker must be followed by a ```sh block");
        }
        let start = j + 1;
        let end = (start..lines.len())
            .find(|&k| lines[k].trim() == "```")
            .ok_or_else(|| anyhow!("docs line {at}: the recipe's ```sh block is never closed"))?;
        found.push(Block {
            modes,
            phase,
            text: lines[start..end].join("\n") + "\n",
            line: at,
        });
        i = end + 1;
    }
    Ok(found)
}

/// The blocks of `mode` in `phase`, joined in document order into one
/// script (one terminal session: `umask`, variables and `cd` carry over).
pub fn script(blocks: &[Block], mode: &str, phase: Phase) -> String {
    blocks
        .iter()
        .filter(|b| b.phase == phase && b.modes.iter().any(|m| m == mode))
        .map(|b| format!("# --- docs/OPERATIONS.md line {} ---\n{}", b.line, b.text))
        .collect()
}

/// Text replacements, in order; `required` ones must match the recipe at
/// least once (else the document changed under the test).
#[derive(Debug, Clone)]
pub struct Substitutions {
    rules: Vec<(String, String, bool)>,
}

impl Substitutions {
    pub fn new() -> Self {
        Self { rules: Vec::new() }
    }

    /// Replaces `from` by `to`; the recipe must contain `from`.
    pub fn required(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.rules.push((from.into(), to.into(), true));
        self
    }

    /// Replaces `from` by `to` where it occurs.
    pub fn optional(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.rules.push((from.into(), to.into(), false));
        self
    }

    /// `text` with every rule applied; `all_text` is the whole recipe of the
    /// mode, which the required rules must match.
    pub fn apply(&self, text: &str, all_text: &str) -> Result<String> {
        let mut out = text.to_owned();
        for (from, to, required) in &self.rules {
            if *required && !all_text.contains(from.as_str()) {
                bail!("the recipe no longer contains {from:?}, which the test replaces by {to:?}");
            }
            out = out.replace(from.as_str(), to);
        }
        Ok(out)
    }
}

impl Default for Substitutions {
    fn default() -> Self {
        Self::new()
    }
}

/// Refuses a script that still names a system path the sandbox stands for:
/// every `/etc/` and `/var/lib/` must lie under `root`, and no `~/`.
pub fn check_confined(script: &str, root: &Path) -> Result<()> {
    let root = root.to_string_lossy();
    for (n, line) in script.lines().enumerate() {
        for system in ["/etc/", "/var/lib/", "/usr/local/"] {
            let mut from = 0;
            while let Some(at) = line[from..].find(system) {
                let at = from + at;
                if !line[..at].ends_with(root.as_ref()) {
                    bail!(
                        "script line {}: {system} outside the sandbox ({}): {line}",
                        n + 1,
                        root
                    );
                }
                from = at + system.len();
            }
        }
        if line.contains("~/") {
            bail!("script line {}: `~/` (use $HOME): {line}", n + 1);
        }
    }
    Ok(())
}

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

    /// What systemd would do for `systemctl ARGS`.
    async fn systemctl(&mut self, args: &[String]) -> Result<()> {
        let words: Vec<&str> = args.iter().map(String::as_str).collect();
        let unit = |name: &str| name.trim_end_matches(".service").to_owned();
        match words.as_slice() {
            ["daemon-reload"] => Ok(()),
            ["restart" | "start", name] | ["enable", "--now", name]
                if unit(name) == "mosquitto" =>
            {
                self.start_broker()
            }
            ["reload", name] if unit(name) == "mosquitto" => self.reload_broker(),
            ["restart" | "start", name] | ["enable", "--now", name] if unit(name) == "idem" => {
                self.start_server().await
            }
            _ => bail!("the recipe test does not stand in for this systemctl call"),
        }
    }

    /// (Re)starts Mosquitto as its unit does, with the umask of the unit's
    /// drop-ins (`UMask=`, systemd's default 0022 without one).
    fn start_broker(&mut self) -> Result<()> {
        if let Some(mut child) = self.broker.take() {
            stop(&mut child, "mosquitto")?;
        }
        let umask = self
            .unit_settings("mosquitto", "UMask")?
            .pop()
            .unwrap_or_else(|| "0022".to_owned());
        if umask.is_empty() || !umask.chars().all(|c| c.is_digit(8)) {
            bail!("UMask={umask:?} is not an octal mode");
        }
        let binary = find_binary("mosquitto", &[PathBuf::from("/usr/sbin/mosquitto")])
            .ok_or_else(|| anyhow!("mosquitto not found (apt-get install mosquitto)"))?;
        let stderr = self.path("/var/log/mosquitto/stderr");
        let out =
            File::create(&stderr).with_context(|| format!("creating {}", stderr.display()))?;
        let err = out.try_clone().context("duplicating mosquitto's output")?;
        // `exec`: the child's pid is Mosquitto's own.
        let mut child = Command::new("sh")
            .args(["-c", "umask \"$1\" && exec \"$2\" -c \"$3\"", "sh", &umask])
            .arg(&binary)
            .arg(self.path("/etc/mosquitto/mosquitto.conf"))
            .current_dir(self.root())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .context("starting mosquitto")?;
        let ready = wait_for_tcp(
            loopback_addr(self.broker_port),
            BROKER_READY,
            || match child.try_wait() {
                Ok(None) => Ok(()),
                Ok(Some(status)) => bail!("mosquitto exited with {status}"),
                Err(e) => Err(e).context("checking mosquitto"),
            },
        );
        match ready {
            Ok(()) => {
                self.broker = Some(child);
                Ok(())
            }
            Err(e) => {
                kill_and_reap(Some(child), "the recipe's mosquitto");
                Err(e.context(self.broker_log_tail()))
            }
        }
    }

    /// SIGHUP to Mosquitto (its unit's `ExecReload`).
    fn reload_broker(&mut self) -> Result<()> {
        let child = self
            .broker
            .as_mut()
            .ok_or_else(|| anyhow!("mosquitto is not running"))?;
        if child.try_wait().context("checking mosquitto")?.is_some() {
            bail!("mosquitto has exited\n{}", self.broker_log_tail());
        }
        let pid = Pid::from_raw(i32::try_from(child.id()).context("mosquitto's pid")?);
        kill(pid, Signal::SIGHUP).context("sending SIGHUP to mosquitto")
    }

    /// Starts the unit `idem.service` of the recipe: its `ExecStart` (the
    /// server binary, no arguments) with `Environment=` and then
    /// `EnvironmentFile=` settings, as systemd does.
    async fn start_server(&mut self) -> Result<()> {
        if let Some(mut server) = self.server.take() {
            server.stop()?;
        }
        let unit = self.path("/etc/systemd/system/idem.service");
        let exec = self.unit_settings("idem", "ExecStart")?;
        let [exec] = exec.as_slice() else {
            bail!("{} must have one ExecStart=, has {exec:?}", unit.display());
        };
        if Path::new(exec) != self.server_binary {
            bail!("ExecStart={exec} is not the idem-server binary without arguments");
        }
        let mut env = BTreeMap::new();
        for assignment in self.unit_settings("idem", "Environment")? {
            if let Some((k, v)) = assignment.split_once('=') {
                env.insert(k.trim().to_owned(), unquote(v.trim()).to_owned());
            }
        }
        for file in self.unit_settings("idem", "EnvironmentFile")? {
            let optional = file.starts_with('-');
            let file = file.trim_start_matches('-');
            match fs::read_to_string(file) {
                Ok(text) => env.extend(environment_file(&text)),
                Err(_) if optional => {}
                Err(e) => bail!("EnvironmentFile={file}: {e}"),
            }
        }
        let database_url = env
            .get("IDEM_DATABASE_URL")
            .cloned()
            .ok_or_else(|| anyhow!("the unit sets no IDEM_DATABASE_URL"))?;
        let broker_url = env
            .get("IDEM_MQTT_URL")
            .cloned()
            .ok_or_else(|| anyhow!("the unit sets no IDEM_MQTT_URL"))?;
        let root = TopicRoot::new(
            env.get("IDEM_TOPIC_ROOT")
                .map_or(idem_protocol::DEFAULT_TOPIC_ROOT, String::as_str),
        )
        .context("IDEM_TOPIC_ROOT")?;
        let instance = env
            .get("IDEM_INSTANCE")
            .cloned()
            .unwrap_or_else(|| "idem-1".to_owned());
        let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let server = ProcessServer::start(
            &self.server_binary,
            &database_url,
            &broker_url,
            &root,
            &instance,
            &extra,
        )
        .await
        .context("starting idem.service")?;
        self.server = Some(server);
        Ok(())
    }

    /// The values of `key=` in the `[Service]` section of unit `name`
    /// (`/etc/systemd/system/{name}.service`) and its drop-ins
    /// (`{name}.service.d/*.conf`, in name order), in that order.
    fn unit_settings(&self, name: &str, key: &str) -> Result<Vec<String>> {
        let system = self.path("/etc/systemd/system");
        let mut files = vec![system.join(format!("{name}.service"))];
        let dropins = system.join(format!("{name}.service.d"));
        if let Ok(entries) = fs::read_dir(&dropins) {
            let mut confs: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "conf"))
                .collect();
            confs.sort();
            files.extend(confs);
        }
        let mut values = Vec::new();
        for file in files.iter().filter(|f| f.is_file()) {
            let text =
                fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            let mut in_service = false;
            for line in text.lines().map(str::trim) {
                if line.starts_with('[') {
                    in_service = line == "[Service]";
                } else if in_service {
                    if let Some((k, v)) = line.split_once('=') {
                        if k.trim() == key {
                            values.push(v.trim().to_owned());
                        }
                    }
                }
            }
        }
        Ok(values)
    }

    /// The server the recipe started.
    pub fn server(&self) -> Result<&ProcessServer> {
        self.server
            .as_ref()
            .ok_or_else(|| anyhow!("the recipe never started idem.service"))
    }
}

impl Drop for RecipeMachine {
    fn drop(&mut self) {
        // The server goes first (its own Drop kills it), then the broker.
        self.server = None;
        kill_and_reap(self.broker.take(), "the recipe's mosquitto");
    }
}

/// The only changes the test makes to a recipe: the broker's port and name
/// (127.0.0.1, on a free port), the test database, the built server, the
/// plugin where this machine has it, the sandbox for `/etc/` and
/// `/var/lib/`, and, when Mosquitto cannot run as its own user, our user
/// for `mosquitto` in `chown` and `install`.
fn substitutions(
    root: &Path,
    broker_port: u16,
    database_url: &str,
    server_binary: &Path,
    broker_user: &BrokerUser,
    recipe_text: &str,
) -> Result<Substitutions> {
    let root = root.display().to_string();
    let mut rules = Substitutions::new()
        .required("broker.example:8883", format!("127.0.0.1:{broker_port}"))
        .required("DNS:broker.example", "IP:127.0.0.1")
        .required("listener 8883", format!("listener {broker_port} 127.0.0.1"))
        .required("postgres://idem@db-host/idem", database_url)
        .required(
            "/usr/local/bin/idem-server",
            server_binary.display().to_string(),
        );
    if recipe_text.contains(DEBIAN_PLUGIN) {
        let plugin = crate::broker::dynsec_plugin()?;
        rules = rules.optional(DEBIAN_PLUGIN, plugin.display().to_string());
    }
    rules = rules
        .required("/etc/", format!("{root}/etc/"))
        .optional("/var/lib/", format!("{root}/var/lib/"));
    if !broker_user.privileged {
        let (uid, gid) = (broker_user.uid, broker_user.gid);
        rules = rules
            .optional("-o mosquitto -g mosquitto", format!("-o {uid} -g {gid}"))
            .optional("mosquitto:mosquitto", format!("{uid}:{gid}"));
    }
    Ok(rules)
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

/// SIGTERM, then SIGKILL after 5 s; reaps.
fn stop(child: &mut Child, what: &str) -> Result<()> {
    let pid = Pid::from_raw(i32::try_from(child.id()).context("a pid beyond i32")?);
    if child.try_wait().context("checking a child")?.is_none() {
        // ESRCH: it exited in between.
        if let Err(e) = kill(pid, Signal::SIGTERM) {
            if e != nix::errno::Errno::ESRCH {
                return Err(e).context(format!("sending SIGTERM to {what} (pid {pid})"));
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if child.try_wait().context("waiting for a child")?.is_some() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().with_context(|| format!("killing {what}"))?;
    child.wait().with_context(|| format!("reaping {what}"))?;
    Ok(())
}

/// `KEY=VALUE` lines as systemd's `EnvironmentFile=` reads them: blank
/// lines and `#` / `;` comments skipped, one pair of quotes removed.
pub fn environment_file(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with(';'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), unquote(v.trim()).to_owned()))
        .collect()
}

fn unquote(value: &str) -> &str {
    for quote in ['\'', '"'] {
        if let Some(inner) = value
            .strip_prefix(quote)
            .and_then(|v| v.strip_suffix(quote))
        {
            return inner;
        }
    }
    value
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

fn write(path: &Path, text: &str, mode: u32) -> Result<()> {
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    set_mode(path, mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "intro\n\
        <!-- recipe: dynsec password-file -->\n\
        ```sh\n\
        umask 077\n\
        ```\n\
        text\n\
        <!-- recipe: dynsec -->\n\
        \n\
        ```sh\n\
        echo dynsec\n\
        ```\n\
        ```sh\n\
        echo unmarked\n\
        ```\n\
        <!-- recipe: password-file; after registering devices -->\n\
        ```sh\n\
        echo again\n\
        ```\n";

    #[test]
    fn the_markers_choose_each_modes_blocks_and_phase_in_document_order() {
        let found = blocks(DOC).unwrap();
        assert_eq!(found.len(), 3);
        let dynsec = script(&found, "dynsec", Phase::Setup);
        assert!(dynsec.contains("umask 077\n") && dynsec.contains("echo dynsec\n"));
        assert!(dynsec.find("umask").unwrap() < dynsec.find("echo dynsec").unwrap());
        assert!(!dynsec.contains("unmarked") && !dynsec.contains("again"));
        let file = script(&found, "password-file", Phase::Setup);
        assert!(file.contains("umask 077") && !file.contains("echo dynsec"));
        assert_eq!(
            script(&found, "password-file", Phase::AfterRegistration),
            "# --- docs/OPERATIONS.md line 15 ---\necho again\n"
        );
    }

    #[test]
    fn a_marker_with_an_unknown_mode_or_phase_or_without_a_shell_block_is_an_error() {
        for (doc, expected) in [
            (
                "<!-- recipe: mqtt -->\n```sh\nx\n```\n",
                "unknown recipe mode",
            ),
            (
                "<!-- recipe: dynsec; later -->\n```sh\nx\n```\n",
                "unknown recipe phase",
            ),
            ("<!-- recipe: dynsec -->\n```text\nx\n```\n", "```sh block"),
            ("<!-- recipe: dynsec -->\n```sh\nx\n", "never closed"),
            ("<!-- recipe: -->\n```sh\nx\n```\n", "no mode"),
        ] {
            let err = blocks(doc).unwrap_err().to_string();
            assert!(err.contains(expected), "{doc:?}: {err}");
        }
    }

    #[test]
    fn a_required_substitution_the_recipe_lacks_is_an_error_and_the_rest_apply_in_order() {
        let rules = Substitutions::new()
            .required("/etc/", "/sandbox/etc/")
            .optional("absent", "x");
        assert_eq!(
            rules.apply("cat /etc/a", "cat /etc/a").unwrap(),
            "cat /sandbox/etc/a"
        );
        let err = Substitutions::new()
            .required("listener 8883", "listener 1")
            .apply("x", "x")
            .unwrap_err();
        assert!(err.to_string().contains("listener 8883"), "{err}");
    }

    #[test]
    fn a_script_naming_a_system_path_outside_the_sandbox_is_refused() {
        let root = Path::new("/tmp/sandbox");
        check_confined("cat /tmp/sandbox/etc/idem/x /tmp/sandbox/var/lib/y", root).unwrap();
        for script in [
            "cat /etc/passwd",
            "x=/tmp/sandbox/etc/a:/etc/b",
            "ls /var/lib/mosquitto",
            "cp x /usr/local/bin/",
            "cat ~/.token",
        ] {
            assert!(check_confined(script, root).is_err(), "{script}");
        }
    }

    #[test]
    fn an_environment_file_is_read_as_systemd_reads_it() {
        let env = environment_file(
            "# comment\n\nIDEM_DATABASE_URL='postgres://a@b/c?x=1&y=2'\nIDEM_INSTANCE=\"i-1\"\nIDEM_X=plain\n",
        );
        assert_eq!(env["IDEM_DATABASE_URL"], "postgres://a@b/c?x=1&y=2");
        assert_eq!(env["IDEM_INSTANCE"], "i-1");
        assert_eq!(env["IDEM_X"], "plain");
        assert_eq!(env.len(), 3);
    }
}
