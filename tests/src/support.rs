//! Small process and network helpers shared by the fixtures: free ports,
//! binary lookup, log tails and readiness waits.
//!
//! Owns no service; it must not start or stop anything itself.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Every fixture binds to this address only.
pub(crate) const LOOPBACK: &str = "127.0.0.1";

/// Ports this process has already handed out, so two fixtures started in
/// parallel by the same test binary never get the same one (the OS may offer
/// a just-released port again).
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A TCP port on 127.0.0.1 that was free a moment ago: bound on port 0, read
/// back and released. Never returns the same port twice in one process.
pub(crate) fn free_port() -> Result<u16> {
    for _ in 0..64 {
        let listener =
            TcpListener::bind((LOOPBACK, 0)).context("binding 127.0.0.1:0 to find a free port")?;
        let port = listener
            .local_addr()
            .context("reading the port of a listener bound to 127.0.0.1:0")?
            .port();
        drop(listener);
        let mut guard = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.get_or_insert_with(HashSet::new).insert(port) {
            return Ok(port);
        }
    }
    bail!("could not find a free TCP port on 127.0.0.1 after 64 attempts")
}

/// `name` on `PATH`, else the first of `fallbacks` that is an executable file.
pub(crate) fn find_binary(name: &str, fallbacks: &[PathBuf]) -> Option<PathBuf> {
    find_binary_in(std::env::var_os("PATH").as_deref(), name, fallbacks)
}

/// [`find_binary`] with an explicit `PATH` value.
pub(crate) fn find_binary_in(
    path_var: Option<&OsStr>,
    name: &str,
    fallbacks: &[PathBuf],
) -> Option<PathBuf> {
    let on_path = path_var
        .map(|paths| {
            std::env::split_paths(paths)
                .map(|dir| dir.join(name))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(fallbacks.iter().cloned())
        .find(|candidate| is_executable(candidate))
}

pub(crate) fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The last `lines` lines of a log file, or a note saying why there are none.
pub(crate) fn tail(path: &Path, lines: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            let start = all.len().saturating_sub(lines);
            if all.is_empty() {
                format!("({} is empty)", path.display())
            } else {
                all[start..].join("\n")
            }
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Whether a TCP connection to `addr` succeeds within `timeout`.
pub(crate) fn accepts_tcp(addr: SocketAddr, timeout: Duration) -> bool {
    TcpStream::connect_timeout(&addr, timeout).is_ok()
}

/// Polls until `addr` accepts TCP connections. `check_alive` runs between
/// attempts and should fail fast when the process behind `addr` has died.
pub(crate) fn wait_for_tcp(
    addr: SocketAddr,
    timeout: Duration,
    mut check_alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if accepts_tcp(addr, Duration::from_millis(200)) {
            return Ok(());
        }
        check_alive()?;
        if Instant::now() >= deadline {
            bail!("{addr} did not accept TCP connections within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How long a helper command of a fixture (`initdb`, `pg_ctl`,
/// `mosquitto_passwd`, `promtool`, …) may run before it is killed.
pub(crate) const COMMAND_LIMIT: Duration = Duration::from_secs(120);

/// Runs `command` to its end with stdin closed and its output captured,
/// like `Command::output`, but kills it (by its own handle's pid, so only
/// that process) when it has not ended within `limit`; the error names
/// `what`. `input`, when given, is written to its stdin first.
pub(crate) fn output_within(
    command: &mut Command,
    input: Option<&[u8]>,
    limit: Duration,
    what: &str,
) -> Result<Output> {
    let mut child = command
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {what}"))?;
    let pid = child.id();
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        let input = input.to_vec();
        // A thread of its own: a child that reads slowly must not block
        // the deadline. Dropping stdin at its end closes the pipe.
        std::thread::spawn(move || {
            use std::io::Write;
            if let Err(e) = stdin.write_all(&input) {
                eprintln!("idem-tests: writing to the stdin of pid {pid}: {e}");
            }
        });
    }
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The receiver may be gone after a timeout: nothing to tell then.
        let _ = sender.send(child.wait_with_output());
    });
    match receiver.recv_timeout(limit) {
        Ok(output) => output.with_context(|| format!("waiting for {what}")),
        Err(_) => {
            // Not reaped yet (the waiting thread still holds it), so the pid
            // is still this child's.
            if let Ok(raw) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(raw),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = receiver.recv_timeout(Duration::from_secs(5));
            bail!("{what} (pid {pid}) did not finish within {limit:?} and was killed")
        }
    }
}

/// Kills and reaps a child this process owns (by its own handle, so only
/// that process), for `Drop` implementations: failures are reported on
/// stderr, never panicked on.
pub(crate) fn kill_and_reap(child: Option<std::process::Child>, what: &str) {
    let Some(mut child) = child else { return };
    let pid = child.id();
    if let Err(e) = child.kill() {
        eprintln!("idem-tests: killing {what} (pid {pid}) failed: {e}");
    }
    if let Err(e) = child.wait() {
        eprintln!("idem-tests: reaping {what} (pid {pid}) failed: {e}");
    }
}

pub(crate) fn loopback_addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_never_handed_out_twice() {
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let unique: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(unique.len(), ports.len());
    }

    #[test]
    fn tail_returns_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        fs::write(&path, "a\nb\nc\n").unwrap();
        assert_eq!(tail(&path, 2), "b\nc");
        assert!(tail(&dir.path().join("missing"), 2).contains("cannot read"));
    }
}
