//! The pure core of reconciliation: the decision (`decide`, `outcome`,
//! `policy`), what the core knows of a device (`device`, `change`), runs
//! (`run`, and judging one at its creation: `creation`) and staged rollouts (`rollout`), push pacing (`pacer`), event drafts and the sans-IO state
//! machine (`machine`). No IO: `scripts/core-check` fails when anything here
//! imports beyond std, idem-protocol and a few pure crates. The loop that
//! feeds the machine and carries its effects out is `crate::engine`.

pub mod change;
pub mod creation;
pub mod decide;
pub mod device;
pub mod diff;
pub mod event_draft;
pub mod machine;
pub mod outcome;
pub mod owned;
pub mod pacer;
pub mod plan;
pub mod policy;
pub mod rollout;
pub mod run;
