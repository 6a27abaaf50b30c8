use super::*;

fn hours(n: i64) -> chrono::Duration {
    chrono::Duration::hours(n)
}

/// A plan of `author`'s made at `at`, open for an hour.
fn kept(author: &str, at: DateTime<Utc>) -> KeptPlan {
    KeptPlan {
        id: Uuid::now_v7(),
        author: author.to_owned(),
        created_at: at,
        expires_at: at + hours(1),
        slot: Slot::Open,
        approval: None,
    }
}

#[test]
fn an_author_with_every_place_in_use_is_refused_and_no_other_authors_plan_is_forgotten() {
    let now = Utc::now();
    let bobs = kept("bob", now);
    let mut book = vec![bobs.clone()];
    for _ in 0..2 {
        assert_eq!(admit(&book, "alice", now, 2, 8), Ok(vec![]));
        book.push(kept("alice", now));
    }
    assert_eq!(
        admit(&book, "alice", now, 2, 8),
        Err(BookRefusal::AuthorFull {
            per_author: 2,
            oldest_expires: now + hours(1),
        })
    );
    // Bob still has room of his own.
    assert_eq!(admit(&book, "bob", now, 2, 8), Ok(vec![]));
}

#[test]
fn an_authors_expired_and_applied_plans_leave_room_for_new_ones() {
    let now = Utc::now();
    let expired = kept("alice", now - hours(1));
    let applied = KeptPlan {
        slot: Slot::Applied(Uuid::now_v7()),
        ..kept("alice", now)
    };
    assert_eq!(admit(&[expired, applied], "alice", now, 2, 8), Ok(vec![]));
}

#[test]
fn a_book_full_of_plans_in_use_refuses_and_forgets_the_spent_ones_first() {
    let now = Utc::now();
    let open: Vec<KeptPlan> = ["a", "b", "c"].iter().map(|a| kept(a, now)).collect();
    assert_eq!(
        admit(&open, "d", now, 2, 3),
        Err(BookRefusal::BookFull { capacity: 3 })
    );
    let applied = KeptPlan {
        slot: Slot::Applied(Uuid::now_v7()),
        ..open[0].clone()
    };
    let book = vec![applied.clone(), open[1].clone(), open[2].clone()];
    assert_eq!(admit(&book, "d", now, 2, 3), Ok(vec![applied.id]));
}

#[test]
fn a_plan_is_forgotten_once_expired_as_long_as_it_lived_unless_a_call_is_applying_it() {
    let now = Utc::now();
    let long_expired = kept("alice", now - hours(2));
    let applying = KeptPlan {
        slot: Slot::Applying { since: now },
        ..kept("bob", now - hours(2))
    };
    let just_expired = kept("carol", now - hours(1) - chrono::Duration::minutes(30));
    assert_eq!(
        admit(
            &[long_expired.clone(), applying, just_expired],
            "dave",
            now,
            2,
            8
        ),
        Ok(vec![long_expired.id])
    );
}

#[test]
fn a_plan_expires_and_once_applied_cannot_be_applied_again() {
    let now = Utc::now();
    let plan = kept("alice", now);
    assert_eq!(
        claim(Some(&plan), plan.expires_at),
        Err(Unusable::Expired(plan.expires_at))
    );
    assert_eq!(claim(Some(&plan), now), Ok(None));
    let run = Uuid::now_v7();
    let applied = KeptPlan {
        slot: Slot::Applied(run),
        ..plan
    };
    assert_eq!(claim(Some(&applied), now), Err(Unusable::Applied(run)));
    assert_eq!(applied.state(now), PlanState::Applied(run));
    assert_eq!(claim(None, now), Err(Unusable::Unknown));
}

#[test]
fn a_plan_is_claimed_by_one_call_at_a_time_until_the_claim_lapses() {
    let now = Utc::now();
    let claimed = KeptPlan {
        slot: Slot::Applying { since: now },
        ..kept("alice", now)
    };
    assert_eq!(claim(Some(&claimed), now), Err(Unusable::Applying));
    assert_eq!(claimed.state(now), PlanState::Open);
    // The claiming call died without a run: the plan is open again.
    assert_eq!(claim(Some(&claimed), now + CLAIM_LAPSE), Ok(None));
}

#[test]
fn a_plan_is_approved_once_by_a_token_other_than_its_author_and_claimed_with_that_approval() {
    let now = Utc::now();
    let plan = kept("alice", now);
    assert_eq!(
        approve(Some(&plan), "alice", now),
        Err(ApproveRefusal::SelfApproval)
    );
    let approval = approve(Some(&plan), "second-operator", now).unwrap();
    assert_eq!(approval.by, "second-operator");
    let approved = KeptPlan {
        approval: Some(approval.clone()),
        ..plan
    };
    assert_eq!(
        approve(Some(&approved), "third-operator", now),
        Err(ApproveRefusal::Approved(approval.clone()))
    );
    assert_eq!(claim(Some(&approved), now), Ok(Some(approval)));
}

#[test]
fn an_expired_applied_or_unknown_plan_cannot_be_approved() {
    let now = Utc::now();
    let plan = kept("alice", now);
    assert_eq!(
        approve(Some(&plan), "second-operator", plan.expires_at),
        Err(ApproveRefusal::Unusable(Unusable::Expired(plan.expires_at)))
    );
    let run = Uuid::now_v7();
    let applied = KeptPlan {
        slot: Slot::Applied(run),
        ..plan
    };
    assert_eq!(
        approve(Some(&applied), "second-operator", now),
        Err(ApproveRefusal::Unusable(Unusable::Applied(run)))
    );
    assert_eq!(
        approve(None, "second-operator", now),
        Err(ApproveRefusal::Unusable(Unusable::Unknown))
    );
}
