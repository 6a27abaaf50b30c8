//! CPU and memory accounting from `/proc`: the CPU seconds so far of the
//! server, the brokers, every PostgreSQL process, this process and its
//! fleet workers, the rest of the machine and the hypervisor's steal; and
//! the server's RSS. Reads only; Linux only.

use idem_device_sim::memory::{process_memory, MemoryField};
use serde::Serialize;

/// Linux's fixed `USER_HZ`: /proc reports CPU time in these ticks.
const TICKS_PER_SECOND: f64 = 100.0;

/// `utime + stime` of a process, in seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may
    // contain spaces: state ppid … utime(14th field) stime(15th).
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

/// `(pid, ppid, comm)` of every process.
pub fn processes() -> Vec<(u32, u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let open = stat.find('(')?;
            let close = stat.rfind(')')?;
            let comm = stat.get(open + 1..close)?.to_owned();
            let ppid = stat
                .get(close + 1..)?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid, comm))
        })
        .collect()
}

/// Machine-wide `(busy, steal)` CPU seconds from the first line of
/// `/proc/stat` (busy = user + nice + system + irq + softirq).
fn machine_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let at = |i: usize| fields.get(i).copied().unwrap_or(0.0);
    let busy = at(0) + at(1) + at(2) + at(5) + at(6);
    (busy / TICKS_PER_SECOND, at(7) / TICKS_PER_SECOND)
}

/// CPU seconds so far of the parts of the system under test.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Cpu {
    pub server: f64,
    /// The core broker and the edge brokers.
    pub broker: f64,
    /// Every `postgres` process on the machine (backends of the server and
    /// of this benchmark, plus background workers).
    pub postgres: f64,
    /// This process and the fleet workers: the simulated fleet (and the
    /// bare subscriber).
    pub simulator: f64,
    /// Everything else on the machine (busy CPU not spent by the four above):
    /// a noisy neighbour shows up here.
    pub other: f64,
    /// CPU time the hypervisor took away.
    pub steal: f64,
}

impl Cpu {
    pub fn minus(self, earlier: Cpu) -> Cpu {
        Cpu {
            server: self.server - earlier.server,
            broker: self.broker - earlier.broker,
            postgres: self.postgres - earlier.postgres,
            simulator: self.simulator - earlier.simulator,
            other: self.other - earlier.other,
            steal: self.steal - earlier.steal,
        }
    }
}

pub struct Probe {
    pub server_pid: u32,
    /// The core broker and every edge broker.
    pub broker_pids: Vec<u32>,
    /// Fleet worker processes (the fleet runs in this process without).
    pub worker_pids: Vec<u32>,
}

impl Probe {
    pub fn sample(&self) -> Cpu {
        let postgres = processes()
            .iter()
            .filter(|(_, _, comm)| comm == "postgres")
            .filter_map(|(pid, _, _)| cpu_seconds(*pid))
            .sum();
        let server = cpu_seconds(self.server_pid).unwrap_or(0.0);
        let broker = self
            .broker_pids
            .iter()
            .filter_map(|p| cpu_seconds(*p))
            .sum();
        let simulator = std::iter::once(std::process::id())
            .chain(self.worker_pids.iter().copied())
            .filter_map(cpu_seconds)
            .sum();
        let (busy, steal) = machine_cpu();
        Cpu {
            server,
            broker,
            postgres,
            simulator,
            // Cumulative totals; only differences between samples mean anything.
            other: busy - server - broker - postgres - simulator,
            steal,
        }
    }

    pub fn server_memory(&self, field: MemoryField) -> u64 {
        process_memory(Some(self.server_pid), field).unwrap_or(0)
    }
}
