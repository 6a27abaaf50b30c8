//! What systemd does for the recipe's `systemctl` calls: it (re)starts and
//! reloads Mosquitto from its unit's settings and starts `idem.service`
//! from its unit file, `Environment=` and `EnvironmentFile=`.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use idem_protocol::TopicRoot;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::RecipeMachine;
use crate::process_server::ProcessServer;
use crate::support::{find_binary, kill_and_reap, loopback_addr, wait_for_tcp};

/// How long Mosquitto gets to listen after a (re)start.
const BROKER_READY: Duration = Duration::from_secs(10);

impl RecipeMachine {
    /// What systemd would do for `systemctl ARGS`.
    pub(super) async fn systemctl(&mut self, args: &[String]) -> Result<()> {
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
