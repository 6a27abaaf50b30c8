//! One metric family (name, help text, kind) and how it registers a series
//! on the server's private recorder: described, keyed by its labels, and
//! set to 0.

use std::marker::PhantomData;

use metrics::{Counter, Gauge, Histogram, Key, Label, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::PrometheusRecorder;

use super::METADATA;

fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::from_static_parts(k, v))
        .collect();
    Key::from_parts(name, labels)
}

/// One metric family: its name and help text, and its kind as `M` (a
/// [`Counter`], [`Gauge`] or [`Histogram`]). Every histogram measures
/// seconds.
pub(super) struct Family<M> {
    name: &'static str,
    help: &'static str,
    kind: PhantomData<fn() -> M>,
}

impl<M> Family<M> {
    pub(super) const fn new(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            help,
            kind: PhantomData,
        }
    }

    fn help(&self) -> SharedString {
        SharedString::const_str(self.help)
    }
}

impl Family<Counter> {
    /// Describes the family and registers the series with `labels`, at 0.
    pub(super) fn register(
        &self,
        r: &PrometheusRecorder,
        labels: &[(&'static str, &'static str)],
    ) -> Counter {
        r.describe_counter(self.name.into(), None, self.help());
        let counter = r.register_counter(&key(self.name, labels), &METADATA);
        counter.increment(0);
        counter
    }
}

impl Family<Gauge> {
    /// Describes the family and registers the series with `labels`, at 0.
    pub(super) fn register(
        &self,
        r: &PrometheusRecorder,
        labels: &[(&'static str, &'static str)],
    ) -> Gauge {
        r.describe_gauge(self.name.into(), None, self.help());
        let gauge = r.register_gauge(&key(self.name, labels), &METADATA);
        gauge.set(0.0);
        gauge
    }
}

impl Family<Histogram> {
    /// Describes the family and registers the series with `labels`.
    pub(super) fn register(
        &self,
        r: &PrometheusRecorder,
        labels: &[(&'static str, &'static str)],
    ) -> Histogram {
        r.describe_histogram(self.name.into(), Some(Unit::Seconds), self.help());
        r.register_histogram(&key(self.name, labels), &METADATA)
    }
}
