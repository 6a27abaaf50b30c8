//! Noticing what the broker may have dropped. A device that comes online and
//! has not reported within `missing_report_after` is asked for a report; a
//! recheck (the server saw signs that the broker dropped messages for it)
//! asks every device not known to be offline and not heard from since, paced at
//! `recheck_rate`, so a newer report that never arrived is sent again. Answers are ordinary
//! reports, judged by `seq` like any other.
//!
//! Pure bookkeeping over ids and instants: the machine decides what an ask
//! is and carries it out.

use std::collections::{HashMap, HashSet, VecDeque};
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use idem_protocol::DeviceId;

/// Devices waiting for a report, and the recheck still to be sent.
#[derive(Debug)]
pub(super) struct Gaps {
    /// How long a device that came online may stay silent (`None`: off).
    missing_after: Option<Duration>,
    /// Asks per second of a recheck (`None`: rechecks off).
    recheck_rate: Option<NonZeroU32>,
    /// When each device that came online is asked, unless it reports first.
    awaiting: HashMap<DeviceId, Instant>,
    /// The same in deadline order (deadlines only grow: one grace period
    /// after a monotonic `now`); entries whose device reported are skipped.
    deadlines: VecDeque<(Instant, DeviceId)>,
    /// Devices a recheck still asks, in order, and the same as a set.
    recheck: VecDeque<DeviceId>,
    queued: HashSet<DeviceId>,
    /// Asks the recheck may still send (carried between scans).
    allowance: f64,
    last_paced: Option<Instant>,
}

impl Gaps {
    pub(super) fn new(missing_after: Option<Duration>, recheck_rate: Option<NonZeroU32>) -> Self {
        Self {
            missing_after,
            recheck_rate,
            awaiting: HashMap::new(),
            deadlines: VecDeque::new(),
            recheck: VecDeque::new(),
            queued: HashSet::new(),
            allowance: 0.0,
            last_paced: None,
        }
    }

    /// `id` came online at `now`: it should report within the grace period.
    pub(super) fn came_online(&mut self, id: &DeviceId, now: Instant) {
        let Some(after) = self.missing_after else {
            return;
        };
        let deadline = now + after;
        self.awaiting.insert(id.clone(), deadline);
        self.deadlines.push_back((deadline, id.clone()));
    }

    /// `id` reported or went offline: nothing is missing from it.
    pub(super) fn settled(&mut self, id: &DeviceId) {
        self.awaiting.remove(id);
    }

    /// Devices whose grace period ended at `now` without a report.
    pub(super) fn silent(&mut self, now: Instant) -> Vec<DeviceId> {
        let mut due = Vec::new();
        while let Some((deadline, _)) = self.deadlines.front() {
            if *deadline > now {
                break;
            }
            let Some((deadline, id)) = self.deadlines.pop_front() else {
                break;
            };
            if self.awaiting.get(&id) == Some(&deadline) {
                self.awaiting.remove(&id);
                due.push(id);
            }
        }
        due
    }

    /// Queues `ids` for a recheck (each once, in the given order).
    pub(super) fn recheck(&mut self, ids: impl IntoIterator<Item = DeviceId>) {
        if self.recheck_rate.is_none() {
            return;
        }
        for id in ids {
            if self.queued.insert(id.clone()) {
                self.recheck.push_back(id);
            }
        }
    }

    /// The recheck's asks due at `now` (at most `recheck_rate` per second).
    pub(super) fn paced_recheck(&mut self, now: Instant) -> Vec<DeviceId> {
        if self.recheck.is_empty() {
            self.last_paced = None;
            self.allowance = 0.0;
            return Vec::new();
        }
        let rate = self.recheck_rate.map_or(0.0, |r| f64::from(r.get()));
        let elapsed = self
            .last_paced
            .map_or(0.05, |at| now.saturating_duration_since(at).as_secs_f64());
        self.last_paced = Some(now);
        // At most one second's worth at once, never less than one ask.
        self.allowance = (self.allowance + elapsed * rate).min(rate.max(1.0));
        let n = (self.allowance.floor() as usize).min(self.recheck.len());
        self.allowance -= n as f64;
        let asked: Vec<DeviceId> = self.recheck.drain(..n).collect();
        for id in &asked {
            self.queued.remove(id);
        }
        asked
    }

    /// Devices still waiting for a report or a recheck's ask.
    #[cfg(test)]
    pub(super) fn pending(&self) -> (usize, usize) {
        (self.awaiting.len(), self.recheck.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: usize) -> DeviceId {
        DeviceId::parse(&format!("d-{n}")).unwrap()
    }

    #[test]
    fn a_device_that_comes_online_and_stays_silent_is_due_after_the_grace_period_once() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(5);
        let mut gaps = Gaps::new(Some(grace), NonZeroU32::new(100));
        gaps.came_online(&id(1), t0);
        gaps.came_online(&id(2), t0);
        gaps.settled(&id(2)); // it reported
        assert!(gaps.silent(t0 + Duration::from_secs(4)).is_empty());
        assert_eq!(gaps.silent(t0 + grace), [id(1)]);
        assert!(gaps.silent(t0 + grace * 2).is_empty(), "asked once");
    }

    #[test]
    fn coming_online_again_restarts_the_grace_period() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(5);
        let mut gaps = Gaps::new(Some(grace), NonZeroU32::new(100));
        gaps.came_online(&id(1), t0);
        gaps.came_online(&id(1), t0 + Duration::from_secs(3));
        assert!(gaps.silent(t0 + grace).is_empty());
        assert_eq!(gaps.silent(t0 + Duration::from_secs(8)), [id(1)]);
    }

    #[test]
    fn without_a_grace_period_nothing_is_ever_missing() {
        let t0 = Instant::now();
        let mut gaps = Gaps::new(None, NonZeroU32::new(100));
        gaps.came_online(&id(1), t0);
        assert!(gaps.silent(t0 + Duration::from_secs(3_600)).is_empty());
    }

    #[test]
    fn a_recheck_asks_each_device_once_at_its_rate() {
        let t0 = Instant::now();
        let mut gaps = Gaps::new(None, NonZeroU32::new(100));
        gaps.recheck((0..250).map(id));
        gaps.recheck((0..10).map(id)); // already queued
        let mut asked = Vec::new();
        let mut at = t0;
        for _ in 0..20 {
            at += Duration::from_millis(50);
            asked.extend(gaps.paced_recheck(at));
        }
        // One second at 100/s (the first scan counts 50 ms too).
        assert!((95..=105).contains(&asked.len()), "{}", asked.len());
        for _ in 0..40 {
            at += Duration::from_millis(50);
            asked.extend(gaps.paced_recheck(at));
        }
        assert_eq!(asked.len(), 250);
        let unique: HashSet<&DeviceId> = asked.iter().collect();
        assert_eq!(unique.len(), 250);
        assert_eq!(gaps.pending(), (0, 0));
    }

    #[test]
    fn without_a_recheck_rate_rechecks_are_off() {
        let mut gaps = Gaps::new(None, None);
        gaps.recheck((0..5).map(id));
        assert!(gaps.paced_recheck(Instant::now()).is_empty());
    }
}
