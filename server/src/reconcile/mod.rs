//! Reconciliation: the pure decision core (`decide`, `outcome`, `policy`),
//! the engine's state machine (`machine`, with `pacer` and `run`), the loop
//! that carries its effects out (`engine`), and starting runs (`runs`).

pub mod change;
pub mod decide;
pub mod device;
pub mod event_draft;
pub mod machine;
pub mod outcome;
pub mod pacer;
pub mod policy;
pub mod run;

pub use outcome::{FailureReason, Outcome, OutcomeCounts, OutcomeKind, SkipReason};
