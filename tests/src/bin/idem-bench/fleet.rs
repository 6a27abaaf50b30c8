//! The benchmark's simulated fleet, in this process or spread over child
//! processes: one process may hold at most ~20,000 open files here, so a
//! fleet larger than [`DEVICES_PER_PROCESS`] runs as one `idem-bench
//! --fleet-worker` child per edge broker, each driven over its stdin and
//! stdout by one JSON line per command and answer. [`BenchFleet`] hides
//! which of the two it is; [`run_worker`] is the child's side.

use std::ops::Range;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use idem_device_sim::memory::{peak_rss_bytes, rss_bytes};
use idem_device_sim::{
    drifted_spec, BrokerAddr, ExpectedOutcome, Fleet, FleetConfig, FleetPlan, FleetStats, Plan,
};
use idem_protocol::{DeviceId, TopicRoot};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// The first argument that makes `idem-bench` a fleet worker.
pub const WORKER_FLAG: &str = "--fleet-worker";
/// Devices one process (simulator or edge broker) holds at most: below the
/// 20,000 open files a process may have here, with room for the rest.
pub const DEVICES_PER_PROCESS: usize = 18_000;
/// Longest wait for a worker's answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);

/// The benchmark's fleet plan: `devices`, `drifted` of them drifted, seed 1.
/// The parent and every worker build the same one.
pub fn bench_plan(devices: usize, drifted: usize) -> Result<Plan> {
    Ok(FleetPlan::new("bench-", devices)
        .drifted(drifted)
        .seed(1)
        .build()?)
}

/// The devices (indices into the plan) of worker `index` of `count`.
pub fn slice(devices: usize, index: usize, count: usize) -> Range<usize> {
    devices * index / count..devices * (index + 1) / count
}

/// What the parent asks a worker, one JSON line each.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WorkerCommand {
    /// Start the fleet: every device connects.
    Start,
    /// Answer once every device of the worker is connected.
    WaitConnected,
    /// The worker's drifted devices run a spec other than `desired` again.
    Redrift {
        desired: Value,
    },
    /// Those of `ids` the worker holds run a spec other than `desired`.
    Drift {
        ids: Vec<String>,
        desired: Value,
    },
    /// The `seq` of each device's last report.
    Seqs,
    /// Every device of the worker reports `times` times, at once.
    Report {
        times: u32,
    },
    Stats,
    Shutdown,
}

/// What a worker answers, one JSON line each.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WorkerAnswer {
    /// Sent once, before the fleet starts.
    Ready {
        idle_rss: u64,
    },
    Started,
    Connected,
    Redrifted,
    Drifted {
        count: usize,
    },
    Seqs {
        seqs: Vec<(String, i64)>,
    },
    Reporting,
    Stats {
        stats: FleetStats,
        peak_rss: u64,
    },
    Stopped {
        stats: FleetStats,
    },
    Failed {
        error: String,
    },
}

/// A fleet worker: `idem-bench --fleet-worker PORT ROOT DEVICES DRIFTED
/// INDEX COUNT` runs slice INDEX of COUNT of the bench plan against the
/// broker on 127.0.0.1:PORT (once told to start) and answers commands from
/// stdin until `shutdown` or end of input (the parent is gone).
pub async fn run_worker(args: &[String]) -> Result<()> {
    let [port, root, devices, drifted, index, count] = args else {
        bail!("usage: idem-bench {WORKER_FLAG} PORT ROOT DEVICES DRIFTED INDEX COUNT");
    };
    idem_tests::raise_fd_limit()?;
    let devices: usize = devices.parse().context("DEVICES")?;
    let plan = bench_plan(devices, drifted.parse().context("DRIFTED")?)?;
    let range = slice(
        devices,
        index.parse().context("INDEX")?,
        count.parse().context("COUNT")?,
    );
    let mine = plan
        .devices
        .get(range)
        .context("INDEX out of range")?
        .to_vec();
    let drifted: Vec<DeviceId> = plan
        .ids_expecting(ExpectedOutcome::Provisioned)
        .into_iter()
        .filter(|id| mine.iter().any(|d| d.id == *id))
        .collect();
    let mut stdout = tokio::io::stdout();
    answer(
        &mut stdout,
        &WorkerAnswer::Ready {
            idle_rss: rss_bytes().unwrap_or(0),
        },
    )
    .await?;
    let broker = BrokerAddr::new("127.0.0.1", port.parse().context("PORT")?);
    let config = FleetConfig::new(broker, TopicRoot::new(root.as_str())?, mine);
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut config = Some(config);
    let mut fleet = None;
    while let Some(line) = lines.next_line().await? {
        let command: WorkerCommand =
            serde_json::from_str(&line).with_context(|| format!("a worker command: {line:?}"))?;
        let result = match (command, &fleet) {
            (WorkerCommand::Shutdown, _) => break,
            (WorkerCommand::Start, None) => match config.take() {
                Some(config) => Fleet::start(config)
                    .map(|started| fleet = Some(started))
                    .map(|()| WorkerAnswer::Started)
                    .map_err(anyhow::Error::from),
                None => Err(anyhow::anyhow!("the fleet failed to start before")),
            },
            (command, Some(running)) => obey(running, &drifted, command).await,
            (command, None) => Err(anyhow::anyhow!("{command:?} before the fleet started")),
        };
        let reply = result.unwrap_or_else(|e| WorkerAnswer::Failed {
            error: format!("{e:#}"),
        });
        answer(&mut stdout, &reply).await?;
    }
    let stats = match fleet {
        Some(fleet) => match fleet.shutdown().await {
            Ok(stats) => stats,
            Err(e) => {
                let error = format!("stopping the fleet: {e}");
                return answer(&mut stdout, &WorkerAnswer::Failed { error }).await;
            }
        },
        None => FleetStats::default(),
    };
    answer(&mut stdout, &WorkerAnswer::Stopped { stats }).await
}

async fn obey(fleet: &Fleet, drifted: &[DeviceId], command: WorkerCommand) -> Result<WorkerAnswer> {
    Ok(match command {
        WorkerCommand::WaitConnected => {
            fleet.wait_connected(fleet.len(), ANSWER_TIMEOUT).await?;
            WorkerAnswer::Connected
        }
        WorkerCommand::Redrift { desired } => {
            drift(fleet, drifted, &desired)?;
            WorkerAnswer::Redrifted
        }
        WorkerCommand::Drift { ids, desired } => {
            let held: std::collections::HashSet<&str> =
                fleet.device_ids().map(DeviceId::as_str).collect();
            let mine: Vec<DeviceId> = ids
                .iter()
                .filter(|id| held.contains(id.as_str()))
                .map(|id| DeviceId::parse(id))
                .collect::<Result<_, _>>()?;
            drift(fleet, &mine, &desired)?;
            WorkerAnswer::Drifted { count: mine.len() }
        }
        WorkerCommand::Seqs => WorkerAnswer::Seqs { seqs: seqs(fleet) },
        WorkerCommand::Report { times } => {
            request_reports(fleet, times)?;
            WorkerAnswer::Reporting
        }
        WorkerCommand::Stats => WorkerAnswer::Stats {
            stats: fleet.stats(),
            peak_rss: peak_rss_bytes().unwrap_or(0),
        },
        WorkerCommand::Start => bail!("the fleet has started already"),
        WorkerCommand::Shutdown => bail!("shutdown is handled by the loop"),
    })
}

/// `ids` run a spec other than `desired` and report it.
fn drift(fleet: &Fleet, ids: &[DeviceId], desired: &Value) -> Result<()> {
    let spec = drifted_spec(desired);
    for id in ids {
        fleet.set_local_spec(id, spec.clone())?;
    }
    Ok(())
}

/// The `seq` of each device's last report.
fn seqs(fleet: &Fleet) -> Vec<(String, i64)> {
    fleet
        .states()
        .into_iter()
        .map(|s| (s.id.to_string(), i64::try_from(s.seq).unwrap_or(i64::MAX)))
        .collect()
}

/// Every device of `fleet` reports `times` times, queued at once.
fn request_reports(fleet: &Fleet, times: u32) -> Result<()> {
    let ids: Vec<DeviceId> = fleet.device_ids().cloned().collect();
    for _ in 0..times {
        for id in &ids {
            fleet.request_report(id)?;
        }
    }
    Ok(())
}

async fn answer(stdout: &mut tokio::io::Stdout, answer: &WorkerAnswer) -> Result<()> {
    let mut line = serde_json::to_string(answer)?;
    line.push('\n');
    stdout.write_all(line.as_bytes()).await?;
    stdout.flush().await.context("writing to the parent")
}

/// One worker child, owned: killed (by PID, with its fleet) when dropped.
pub struct Worker {
    index: usize,
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    idle_rss: u64,
}

impl Worker {
    async fn spawn(
        edge_port: u16,
        root: &TopicRoot,
        plan: (usize, usize),
        index: usize,
        count: usize,
    ) -> Result<Self> {
        let exe = std::env::current_exe().context("the benchmark's own path")?;
        let mut child = Command::new(exe)
            .arg(WORKER_FLAG)
            .arg(edge_port.to_string())
            .arg(root.as_str())
            .arg(plan.0.to_string())
            .arg(plan.1.to_string())
            .arg(index.to_string())
            .arg(count.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting a fleet worker")?;
        let stdin = child.stdin.take().context("the worker's stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("the worker's stdout")?).lines();
        let mut worker = Self {
            index,
            child,
            stdin,
            stdout,
            idle_rss: 0,
        };
        let answer = worker.read().await?;
        let WorkerAnswer::Ready { idle_rss } = answer else {
            bail!("fleet worker {index} started with {answer:?}");
        };
        worker.idle_rss = idle_rss;
        Ok(worker)
    }

    async fn read(&mut self) -> Result<WorkerAnswer> {
        let line = tokio::time::timeout(ANSWER_TIMEOUT, self.stdout.next_line())
            .await
            .with_context(|| {
                format!(
                    "fleet worker {} did not answer within {ANSWER_TIMEOUT:?}",
                    self.index
                )
            })?
            .with_context(|| format!("reading fleet worker {}", self.index))?
            .with_context(|| format!("fleet worker {} exited", self.index))?;
        let answer: WorkerAnswer = serde_json::from_str(&line)
            .with_context(|| format!("fleet worker {} answered {line:?}", self.index))?;
        if let WorkerAnswer::Failed { error } = answer {
            bail!("fleet worker {}: {error}", self.index);
        }
        Ok(answer)
    }

    async fn ask(&mut self, command: &WorkerCommand) -> Result<WorkerAnswer> {
        let mut line = serde_json::to_string(command)?;
        line.push('\n');
        self.stdin
            .write_all(line.as_bytes())
            .await
            .with_context(|| format!("writing to fleet worker {}", self.index))?;
        self.read().await
    }
}

/// The simulated fleet of one benchmark run.
pub enum BenchFleet {
    /// Every device in this process, on one broker.
    InProcess(Fleet),
    /// One worker process per edge broker.
    Workers(Vec<Worker>),
}

impl BenchFleet {
    /// One worker per edge broker in `edge_ports`, each with its slice of
    /// the bench plan of `devices` (`drifted` drifted), started and ready.
    pub async fn spawn_workers(
        edge_ports: &[u16],
        root: &TopicRoot,
        devices: usize,
        drifted: usize,
    ) -> Result<Self> {
        let count = edge_ports.len();
        let spawns = edge_ports
            .iter()
            .enumerate()
            .map(|(index, port)| Worker::spawn(*port, root, (devices, drifted), index, count));
        Ok(Self::Workers(futures::future::try_join_all(spawns).await?))
    }

    /// Waits until all `n` devices are connected.
    pub async fn wait_connected(&mut self, n: usize, timeout: Duration) -> Result<()> {
        match self {
            Self::InProcess(fleet) => Ok(fleet.wait_connected(n, timeout).await?),
            Self::Workers(workers) => {
                for answer in ask_all(workers, &WorkerCommand::WaitConnected).await? {
                    expect(matches!(answer, WorkerAnswer::Connected), &answer)?;
                }
                Ok(())
            }
        }
    }

    /// Makes the plan's drifted devices (`ids`) run a spec other than
    /// `desired` again.
    pub async fn redrift(&mut self, ids: &[DeviceId], desired: &Value) -> Result<()> {
        match self {
            Self::InProcess(fleet) => drift(fleet, ids, desired),
            Self::Workers(workers) => {
                let command = WorkerCommand::Redrift {
                    desired: desired.clone(),
                };
                for answer in ask_all(workers, &command).await? {
                    expect(matches!(answer, WorkerAnswer::Redrifted), &answer)?;
                }
                Ok(())
            }
        }
    }

    /// Makes `ids` (any devices of the fleet) run a spec other than
    /// `desired` and report it; returns how many did.
    pub async fn drift(&mut self, ids: &[DeviceId], desired: &Value) -> Result<usize> {
        match self {
            Self::InProcess(fleet) => {
                drift(fleet, ids, desired)?;
                Ok(ids.len())
            }
            Self::Workers(workers) => {
                let command = WorkerCommand::Drift {
                    ids: ids.iter().map(ToString::to_string).collect(),
                    desired: desired.clone(),
                };
                let mut count = 0;
                for answer in ask_all(workers, &command).await? {
                    let WorkerAnswer::Drifted { count: drifted } = answer else {
                        return Err(unexpected(&answer));
                    };
                    count += drifted;
                }
                Ok(count)
            }
        }
    }

    /// Starts the fleet: every device connects.
    pub async fn start(&mut self) -> Result<()> {
        match self {
            Self::InProcess(_) => Ok(()),
            Self::Workers(workers) => {
                for answer in ask_all(workers, &WorkerCommand::Start).await? {
                    expect(matches!(answer, WorkerAnswer::Started), &answer)?;
                }
                Ok(())
            }
        }
    }

    /// The `seq` of each device's last report.
    pub async fn seqs(&mut self) -> Result<Vec<(String, i64)>> {
        match self {
            Self::InProcess(fleet) => Ok(seqs(fleet)),
            Self::Workers(workers) => {
                let mut all = Vec::new();
                for answer in ask_all(workers, &WorkerCommand::Seqs).await? {
                    let WorkerAnswer::Seqs { seqs } = answer else {
                        return Err(unexpected(&answer));
                    };
                    all.extend(seqs);
                }
                Ok(all)
            }
        }
    }

    /// Every device reports `times` times, queued at once.
    pub async fn request_reports(&mut self, times: u32) -> Result<()> {
        match self {
            Self::InProcess(fleet) => request_reports(fleet, times),
            Self::Workers(workers) => {
                for answer in ask_all(workers, &WorkerCommand::Report { times }).await? {
                    expect(matches!(answer, WorkerAnswer::Reporting), &answer)?;
                }
                Ok(())
            }
        }
    }

    /// The fleet's counters, summed over workers.
    pub async fn stats(&mut self) -> Result<FleetStats> {
        match self {
            Self::InProcess(fleet) => Ok(fleet.stats()),
            Self::Workers(workers) => {
                let mut total = FleetStats::default();
                for answer in ask_all(workers, &WorkerCommand::Stats).await? {
                    let WorkerAnswer::Stats { stats, .. } = answer else {
                        return Err(unexpected(&answer));
                    };
                    add(&mut total, &stats);
                }
                Ok(total)
            }
        }
    }

    /// The workers' resident memory before their fleets started, summed;
    /// `None` for an in-process fleet (the caller measured itself before).
    pub fn workers_idle_rss(&self) -> Option<u64> {
        match self {
            Self::InProcess(_) => None,
            Self::Workers(workers) => Some(workers.iter().map(|w| w.idle_rss).sum()),
        }
    }

    /// The simulator's peak resident memory (summed over workers).
    pub async fn peak_rss(&mut self) -> Result<u64> {
        match self {
            Self::InProcess(_) => Ok(peak_rss_bytes().unwrap_or(0)),
            Self::Workers(workers) => {
                let mut total = 0;
                for answer in ask_all(workers, &WorkerCommand::Stats).await? {
                    let WorkerAnswer::Stats { peak_rss, .. } = answer else {
                        return Err(unexpected(&answer));
                    };
                    total += peak_rss;
                }
                Ok(total)
            }
        }
    }

    /// The worker processes' PIDs (none for an in-process fleet).
    pub fn worker_pids(&self) -> Vec<u32> {
        match self {
            Self::InProcess(_) => Vec::new(),
            Self::Workers(workers) => workers.iter().filter_map(|w| w.child.id()).collect(),
        }
    }

    /// Disconnects every device cleanly; workers exit.
    pub async fn shutdown(self) -> Result<FleetStats> {
        match self {
            Self::InProcess(fleet) => Ok(fleet.shutdown().await?),
            Self::Workers(mut workers) => {
                let mut total = FleetStats::default();
                for answer in ask_all(&mut workers, &WorkerCommand::Shutdown).await? {
                    let WorkerAnswer::Stopped { stats } = answer else {
                        return Err(unexpected(&answer));
                    };
                    add(&mut total, &stats);
                }
                for worker in &mut workers {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    tokio::time::timeout_at(deadline.into(), worker.child.wait())
                        .await
                        .with_context(|| format!("fleet worker {} did not exit", worker.index))??;
                }
                Ok(total)
            }
        }
    }
}

/// Sends `command` to every worker at once and collects the answers.
async fn ask_all(workers: &mut [Worker], command: &WorkerCommand) -> Result<Vec<WorkerAnswer>> {
    futures::future::try_join_all(workers.iter_mut().map(|w| w.ask(command))).await
}

fn expect(ok: bool, answer: &WorkerAnswer) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(unexpected(answer))
    }
}

fn unexpected(answer: &WorkerAnswer) -> anyhow::Error {
    anyhow::anyhow!("unexpected answer from a fleet worker: {answer:?}")
}

fn add(total: &mut FleetStats, more: &FleetStats) {
    total.devices += more.devices;
    total.connected += more.connected;
    total.connections += more.connections;
    total.connection_errors += more.connection_errors;
    total.reports_sent += more.reports_sent;
    total.desired_received += more.desired_received;
    total.get_received += more.get_received;
    total.rejections += more.rejections;
    total.invalid_messages += more.invalid_messages;
}

#[cfg(test)]
mod tests {
    use super::slice;

    #[test]
    fn slices_cover_every_device_exactly_once() {
        for (devices, count) in [(100_000, 6), (10, 3), (7, 7), (18_001, 2)] {
            let mut next = 0;
            for index in 0..count {
                let range = slice(devices, index, count);
                assert_eq!(range.start, next);
                next = range.end;
            }
            assert_eq!(next, devices);
        }
    }
}
