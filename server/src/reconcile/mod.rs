//! Reconciliation: the pure decision core (`decide`, `outcome`) and the
//! engine that carries decisions out (`engine`).

pub mod decide;
pub mod engine;
pub mod outcome;
pub mod policy;
pub mod runs;

pub use outcome::{FailureReason, Outcome, OutcomeCounts, OutcomeKind, SkipReason};
