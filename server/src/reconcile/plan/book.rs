//! The rules of the plan book, over the plans as they are stored
//! (`store::plans` persists them, so every instance sees the same book):
//! which kept plans a new one forgets and when it is refused, where a plan
//! stands, and whether it can be approved or claimed for an apply. Pure:
//! time is an input.

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// A claim on a plan (one call starting its run) older than this is taken
/// for the claim of a call that died: the plan is open again, unless a run
/// applied it (`store::plans` looks that up before these rules see it).
pub const CLAIM_LAPSE: chrono::Duration = chrono::Duration::minutes(2);

/// Where a plan stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanState {
    Open,
    /// Applied by this run.
    Applied(Uuid),
    Expired,
}

/// Why a plan cannot be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    Unknown,
    Expired(DateTime<Utc>),
    Applied(Uuid),
    /// Another call is applying it now.
    Applying,
}

/// A plan's approval by a token other than its author's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanApproval {
    pub by: String,
    pub at: DateTime<Utc>,
}

/// Why a plan cannot be approved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApproveRefusal {
    Unusable(Unusable),
    /// The approving token is the plan's author.
    SelfApproval,
    Approved(PlanApproval),
}

/// A kept plan's own state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Open,
    /// Claimed by a call that is starting its run, at `since`.
    Applying {
        since: DateTime<Utc>,
    },
    Applied(Uuid),
}

/// A kept plan as the book's rules read it: everything but its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptPlan {
    pub id: Uuid,
    pub author: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub slot: Slot,
    pub approval: Option<PlanApproval>,
}

/// Why a new plan is not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BookRefusal {
    /// Its author keeps `per_author` plans in use already; the oldest of
    /// them expires at `oldest_expires`.
    AuthorFull {
        per_author: usize,
        oldest_expires: DateTime<Utc>,
    },
    /// `capacity` plans of all authors together are in use.
    BookFull { capacity: usize },
}

impl KeptPlan {
    /// Kept until it expired as long ago as it lived, so that applying it
    /// late says "expired", not "unknown".
    pub fn forget_at(&self) -> DateTime<Utc> {
        self.expires_at + (self.expires_at - self.created_at)
    }

    fn claimed(&self, now: DateTime<Utc>) -> bool {
        matches!(self.slot, Slot::Applying { since } if now < since + CLAIM_LAPSE)
    }

    /// Open and not expired, or being applied: it takes a place in the book.
    pub fn in_use(&self, now: DateTime<Utc>) -> bool {
        match self.slot {
            Slot::Open | Slot::Applying { .. } if self.claimed(now) => true,
            Slot::Open | Slot::Applying { .. } => now < self.expires_at,
            Slot::Applied(_) => false,
        }
    }

    pub fn state(&self, now: DateTime<Utc>) -> PlanState {
        match self.slot {
            Slot::Applied(run) => PlanState::Applied(run),
            Slot::Open | Slot::Applying { .. } if now >= self.expires_at => PlanState::Expired,
            Slot::Open | Slot::Applying { .. } => PlanState::Open,
        }
    }

    /// Why it cannot be approved or applied now, if it cannot.
    fn unusable(&self, now: DateTime<Utc>) -> Option<Unusable> {
        match self.slot {
            Slot::Applied(run) => Some(Unusable::Applied(run)),
            Slot::Applying { .. } if self.claimed(now) => Some(Unusable::Applying),
            Slot::Open | Slot::Applying { .. } if now >= self.expires_at => {
                Some(Unusable::Expired(self.expires_at))
            }
            Slot::Open | Slot::Applying { .. } => None,
        }
    }
}

/// Whether `author` may keep a new plan beside `kept` (every plan stored),
/// and if so which kept plans to forget first: every one past
/// [`KeptPlan::forget_at`] (but for one being applied), and, when the book
/// would hold `capacity`, those only kept to say they expired or were
/// applied. A plan in use is never forgotten: an author with `per_author`
/// of them, or a book with `capacity` of all authors together, is refused.
pub fn admit(
    kept: &[KeptPlan],
    author: &str,
    now: DateTime<Utc>,
    per_author: usize,
    capacity: usize,
) -> Result<Vec<Uuid>, BookRefusal> {
    let (per_author, capacity) = (per_author.max(1), capacity.max(1));
    let (mut forget, mut staying): (Vec<&KeptPlan>, Vec<&KeptPlan>) = kept
        .iter()
        .partition(|k| !k.claimed(now) && now >= k.forget_at());
    let authors: Vec<&KeptPlan> = staying
        .iter()
        .copied()
        .filter(|k| k.author == author && k.in_use(now))
        .collect();
    if authors.len() >= per_author {
        let oldest_expires = authors.iter().map(|k| k.expires_at).min().unwrap_or(now);
        return Err(BookRefusal::AuthorFull {
            per_author,
            oldest_expires,
        });
    }
    if staying.len() >= capacity {
        let (used, spent): (Vec<&KeptPlan>, Vec<&KeptPlan>) =
            staying.into_iter().partition(|k| k.in_use(now));
        forget.extend(spent);
        staying = used;
    }
    if staying.len() >= capacity {
        return Err(BookRefusal::BookFull { capacity });
    }
    Ok(forget.into_iter().map(|k| k.id).collect())
}

/// The approval of `kept` (`None`: no such plan) by `by`, who must not be
/// its author; an approval is given once, to a plan that is open.
pub fn approve(
    kept: Option<&KeptPlan>,
    by: &str,
    now: DateTime<Utc>,
) -> Result<PlanApproval, ApproveRefusal> {
    let Some(kept) = kept else {
        return Err(ApproveRefusal::Unusable(Unusable::Unknown));
    };
    if let Some(unusable) = kept.unusable(now) {
        return Err(ApproveRefusal::Unusable(unusable));
    }
    if kept.author == by {
        return Err(ApproveRefusal::SelfApproval);
    }
    if let Some(given) = &kept.approval {
        return Err(ApproveRefusal::Approved(given.clone()));
    }
    Ok(PlanApproval {
        by: by.to_owned(),
        at: now,
    })
}

/// Whether one call may claim `kept` to apply it now: an open plan, not
/// expired and not claimed by a call still starting its run. With its
/// approval, if it has one.
pub fn claim(
    kept: Option<&KeptPlan>,
    now: DateTime<Utc>,
) -> Result<Option<PlanApproval>, Unusable> {
    let Some(kept) = kept else {
        return Err(Unusable::Unknown);
    };
    match kept.unusable(now) {
        Some(unusable) => Err(unusable),
        None => Ok(kept.approval.clone()),
    }
}

#[cfg(test)]
mod tests;
