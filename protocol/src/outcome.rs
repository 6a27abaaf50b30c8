//! The outcome vocabulary shared by the server, the simulator and the tests:
//! the kind of outcome a device reaches in a run, the per-run counts, and the
//! run summary line built from them (`9,996 already converged, 4 provisioned,
//! 0 failed`).
//!
//! Pure names and arithmetic. The server's `Outcome` (with its reasons) maps
//! onto [`OutcomeKind`]; every consumer matches the kind exhaustively, with no
//! `_ =>` arm, so that a new kind makes the compiler list each place that must
//! learn about it.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The outcome of one device in one run, without its reason: the value of
/// `outcome` in the API and in events, the label value of metrics and the
/// last part of a device event's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKind {
    AlreadyConverged,
    Provisioned,
    Failed,
    Skipped,
    Superseded,
}

impl OutcomeKind {
    /// All kinds, in summary order.
    pub const ALL: [OutcomeKind; 5] = [
        OutcomeKind::AlreadyConverged,
        OutcomeKind::Provisioned,
        OutcomeKind::Failed,
        OutcomeKind::Skipped,
        OutcomeKind::Superseded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeKind::AlreadyConverged => "already_converged",
            OutcomeKind::Provisioned => "provisioned",
            OutcomeKind::Failed => "failed",
            OutcomeKind::Skipped => "skipped",
            OutcomeKind::Superseded => "superseded",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        OutcomeKind::ALL.into_iter().find(|k| k.as_str() == raw)
    }
}

impl fmt::Display for OutcomeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Number of devices per outcome in one run (`counts` in the API and in
/// `run.completed`). A field missing from a decoded answer counts 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct OutcomeCounts {
    pub already_converged: u64,
    pub provisioned: u64,
    pub failed: u64,
    pub skipped: u64,
    pub superseded: u64,
}

impl OutcomeCounts {
    pub fn add(&mut self, kind: OutcomeKind) {
        *self.slot(kind) += 1;
    }

    pub fn get(&self, kind: OutcomeKind) -> u64 {
        match kind {
            OutcomeKind::AlreadyConverged => self.already_converged,
            OutcomeKind::Provisioned => self.provisioned,
            OutcomeKind::Failed => self.failed,
            OutcomeKind::Skipped => self.skipped,
            OutcomeKind::Superseded => self.superseded,
        }
    }

    fn slot(&mut self, kind: OutcomeKind) -> &mut u64 {
        match kind {
            OutcomeKind::AlreadyConverged => &mut self.already_converged,
            OutcomeKind::Provisioned => &mut self.provisioned,
            OutcomeKind::Failed => &mut self.failed,
            OutcomeKind::Skipped => &mut self.skipped,
            OutcomeKind::Superseded => &mut self.superseded,
        }
    }

    /// Devices with an outcome.
    pub fn total(&self) -> u64 {
        OutcomeKind::ALL.iter().map(|k| self.get(*k)).sum()
    }

    /// The summary line: `N already converged, N provisioned, N failed`,
    /// then `, N skipped` and `, N superseded` only when non-zero; numbers
    /// with `,` thousands separators.
    pub fn summary(&self) -> String {
        let mut line = format!(
            "{} already converged, {} provisioned, {} failed",
            with_thousands(self.already_converged),
            with_thousands(self.provisioned),
            with_thousands(self.failed)
        );
        for (n, words) in [(self.skipped, "skipped"), (self.superseded, "superseded")] {
            if n > 0 {
                line.push_str(&format!(", {} {words}", with_thousands(n)));
            }
        }
        line
    }
}

/// `9996` → `9,996`.
pub fn with_thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_the_three_main_outcomes_even_when_zero() {
        let counts = OutcomeCounts {
            already_converged: 9_996,
            provisioned: 4,
            ..OutcomeCounts::default()
        };
        assert_eq!(
            counts.summary(),
            "9,996 already converged, 4 provisioned, 0 failed"
        );
    }

    #[test]
    fn summary_adds_skipped_and_superseded_only_when_non_zero() {
        let counts = OutcomeCounts {
            already_converged: 1,
            provisioned: 2,
            failed: 3,
            skipped: 4,
            superseded: 0,
        };
        assert_eq!(
            counts.summary(),
            "1 already converged, 2 provisioned, 3 failed, 4 skipped"
        );
        let counts = OutcomeCounts {
            superseded: 1_000_000,
            ..OutcomeCounts::default()
        };
        assert_eq!(
            counts.summary(),
            "0 already converged, 0 provisioned, 0 failed, 1,000,000 superseded"
        );
        let counts = OutcomeCounts {
            skipped: 1_200,
            ..OutcomeCounts::default()
        };
        assert_eq!(
            counts.summary(),
            "0 already converged, 0 provisioned, 0 failed, 1,200 skipped"
        );
    }

    #[test]
    fn thousands_separators_are_placed_every_three_digits() {
        assert_eq!(with_thousands(0), "0");
        assert_eq!(with_thousands(999), "999");
        assert_eq!(with_thousands(1_000), "1,000");
        assert_eq!(with_thousands(12_345_678), "12,345,678");
    }

    #[test]
    fn counts_add_up_per_kind_and_in_total() {
        let mut counts = OutcomeCounts::default();
        for (kind, n) in OutcomeKind::ALL.into_iter().zip(1..) {
            for _ in 0..n {
                counts.add(kind);
            }
        }
        assert_eq!(
            counts,
            OutcomeCounts {
                already_converged: 1,
                provisioned: 2,
                failed: 3,
                skipped: 4,
                superseded: 5,
            }
        );
        for (kind, n) in OutcomeKind::ALL.into_iter().zip(1..) {
            assert_eq!(counts.get(kind), n, "{kind}");
        }
        assert_eq!(counts.total(), 15);
        assert_eq!(OutcomeCounts::default().total(), 0);
    }

    #[test]
    fn outcome_kinds_round_trip_through_their_names() {
        for kind in OutcomeKind::ALL {
            assert_eq!(OutcomeKind::parse(kind.as_str()), Some(kind));
            assert_eq!(kind.to_string(), kind.as_str());
        }
        assert_eq!(OutcomeKind::parse("converged"), None);
    }

    #[test]
    fn outcome_kinds_are_json_strings_with_their_names() {
        for kind in OutcomeKind::ALL {
            let json = serde_json::to_value(kind).unwrap();
            assert_eq!(json, serde_json::Value::from(kind.as_str()));
            assert_eq!(serde_json::from_value::<OutcomeKind>(json).unwrap(), kind);
        }
        assert!(serde_json::from_str::<OutcomeKind>("\"converged\"").is_err());
    }

    #[test]
    fn counts_are_a_json_object_with_one_field_per_kind() {
        let counts = OutcomeCounts {
            already_converged: 1,
            provisioned: 2,
            failed: 3,
            skipped: 4,
            superseded: 5,
        };
        assert_eq!(
            serde_json::to_string(&counts).unwrap(),
            r#"{"already_converged":1,"provisioned":2,"failed":3,"skipped":4,"superseded":5}"#
        );
        let partial: OutcomeCounts = serde_json::from_str(r#"{"provisioned":7}"#).unwrap();
        assert_eq!(
            partial,
            OutcomeCounts {
                provisioned: 7,
                ..OutcomeCounts::default()
            }
        );
    }
}
