//! How a run starts in the machine: its targets converged at creation are
//! counted, the rest join an attempt in flight (or supersede an older
//! one) or start one, a chunk at a time.

use super::*;

impl Machine {
    pub(super) fn start_run(&mut self, mut spec: RunSpec, now: Now, out: &mut Vec<Effect>) {
        let differed = std::mem::take(&mut spec.differed);
        let progress = RunProgress::new(&spec, now.at).with_differed(differed);
        if spec.trigger == Trigger::Manual && spec.is_new() && !progress.is_complete() {
            let runs = &self.runs;
            self.manual.retain(|run_id, _| runs.contains_key(run_id));
            let mut targets: Vec<DeviceId> = spec
                .targets
                .iter()
                .chain(&spec.converged)
                .cloned()
                .collect();
            targets.sort_unstable();
            self.manual.insert(spec.id, (spec.force, targets));
        }
        for id in &spec.converged {
            self.converged_at_creation(id, now, out);
        }
        if spec.resumed {
            self.resumed_runs.insert(spec.id);
        }
        if let Some(rollout) = spec.rollout {
            self.start_rollout(spec.id, *rollout, spec.targets.len() as u64, now);
        }
        if progress.is_complete() {
            self.run_ended(progress, now);
            return;
        }
        self.runs.insert(spec.id, progress);
        self.starting
            .extend(spec.targets.into_iter().map(|id| (spec.id, spec.force, id)));
        self.continue_starting(now, out);
    }

    /// Starts waiting targets until the record holds a write's worth.
    pub(super) fn continue_starting(&mut self, now: Now, out: &mut Vec<Effect>) {
        while self.record.outcomes.len() < FLUSH_SIZE {
            let Some((run_id, force, id)) = self.starting.pop_front() else {
                return;
            };
            let entry = self.entry(&id).unwrap_or_default();
            let differed = self.runs.get(&run_id).is_some_and(|run| run.differed(&id));
            if self.join_attempt_in_flight(&id, run_id, &entry, now, out) {
                if let Some(flight) = self.in_flight.get_mut(&id) {
                    flight.differed |= differed;
                }
                continue;
            }
            self.in_flight.insert(
                id.clone(),
                InFlight {
                    runs: vec![run_id],
                    force,
                    generation: entry.desired.as_ref().map(|d| d.generation),
                    since: now.at,
                    phase: Phase::Fresh,
                    differed,
                },
            );
            if let Some(phase) = self.pushed_before_restart(run_id, &id, &entry, now.at) {
                self.set_phase(&id, phase);
                self.pushed.insert(id.clone());
                self.sent_for(&[run_id], &id);
                self.advance(&id, false, now, out);
            } else if let Some(skip) = gate(&entry) {
                self.finish(&id, Outcome::Skipped(skip), &entry, None, now, out);
            } else {
                self.advance(&id, false, now, out);
            }
        }
    }

    /// A target the run's creation found converged: an attempt in flight for
    /// an older generation ends `Superseded` (as when a run joins it), and a
    /// retained message that fell behind is refreshed, as after any
    /// `AlreadyConverged`.
    pub(super) fn converged_at_creation(&mut self, id: &DeviceId, now: Now, out: &mut Vec<Effect>) {
        let entry = self.entry(id).unwrap_or_default();
        if !self.supersede_older_attempt(id, &entry, now, out) {
            self.refresh_retained_from(id, &entry, out);
        }
    }

    /// Lets `run_id` share the attempt already in flight for `id` when it
    /// works towards the current desired generation; otherwise the run
    /// starts afresh.
    pub(super) fn join_attempt_in_flight(
        &mut self,
        id: &DeviceId,
        run_id: Uuid,
        entry: &DeviceEntry,
        now: Now,
        out: &mut Vec<Effect>,
    ) -> bool {
        if !self.supersede_older_attempt(id, entry, now, out) {
            return false;
        }
        let mut pushed = false;
        if let Some(flight) = self.in_flight.get_mut(id) {
            flight.runs.push(run_id);
            pushed = matches!(
                flight.phase,
                Phase::Pushed { .. } | Phase::MaybePushed { .. }
            );
        }
        if pushed {
            self.sent_for(&[run_id], id);
        }
        true
    }

    /// Ends an attempt in flight for an older desired generation
    /// (`Superseded`); true when one for the current generation is in flight.
    pub(super) fn supersede_older_attempt(
        &mut self,
        id: &DeviceId,
        entry: &DeviceEntry,
        now: Now,
        out: &mut Vec<Effect>,
    ) -> bool {
        let current = entry.desired.as_ref().map(|d| d.generation);
        let Some(flight) = self.in_flight.get(id) else {
            return false;
        };
        if flight.generation == current {
            return true;
        }
        self.conclude(id, Outcome::Superseded, entry, now, out);
        false
    }
}
