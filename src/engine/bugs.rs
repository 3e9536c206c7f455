//! Test-only switches, each putting back one bug that a review found, so that the
//! simulator (`src/engine/sim/`) can show it finds them (issue 37). Outside `cfg(test)`
//! every switch reads false and compiles away; in tests a switch is on for the current
//! thread only (the simulator is single-threaded), inside [`with`].

/// A bug to put back.
// `MaxRule` is only ever named by tests: its switch lives in `room::state`.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bug {
    /// The reference design's state rule: `max()` over the states, where `Failed = 0`,
    /// so a late "transferring" resurrects a failed room, whose work the sender then
    /// skips (DESIGN §1; the rule is in `room::state`).
    MaxRule,
    /// Over RDMA an abort's acknowledgement goes while writes into its destination are
    /// still in flight (invariant 6; the reason `Acks` exists).
    AckWithWritesInFlight,
    /// A failure's acknowledgement is queued for the engine whose abort failed the room
    /// too, so that engine is acknowledged twice (aesthetics review 2026-12-05 §2).
    AckTheOrigin,
    /// A tombstone (an abort held before its room) is adopted by whichever use of the
    /// id is created next, whatever its generation (invariants review 2026-12 F3).
    TombstoneAnyGeneration,
    /// A decode room's destination goes out although the room failed first, so the
    /// room drains at once ("never sent") while the prefill is about to write into its
    /// pages (invariants review 2026-12 F1).
    DestinationAfterFailure,
    /// A decode room takes a run into pages it already took, so its completion counts
    /// bytes, not pages: a page sent twice stands in for one never sent (invariants
    /// review 2026-12-05 F8).
    CountsBytes,
    /// Any prefill engine's Abort fails a decode room, not only its own engines'
    /// (invariants review 2026-12-05 F3).
    AnyPrefillAborts,
    /// A chunk handed on while the room's earlier chunks wait (for its worker) or are
    /// planned is held back only by queued batches: its caller plans it at once, past
    /// them (the orders `prefill/planning/tests.rs` pins, and the simulator's `InOrder`
    /// checks).
    HandOnPastWaiting,
}

#[cfg(test)]
thread_local! {
    static ON: std::cell::Cell<Option<Bug>> = const { std::cell::Cell::new(None) };
}

/// Whether `bug` is put back on this thread.
#[inline]
pub(crate) fn on(bug: Bug) -> bool {
    #[cfg(test)]
    {
        ON.with(|b| b.get() == Some(bug))
    }
    #[cfg(not(test))]
    {
        let _ = bug;
        false
    }
}

/// Runs `f` with `bug` (if any) put back on this thread.
#[cfg(test)]
pub(crate) fn with<R>(bug: Option<Bug>, f: impl FnOnce() -> R) -> R {
    struct Reset(Option<Bug>);
    impl Drop for Reset {
        fn drop(&mut self) {
            ON.with(|b| b.set(self.0));
        }
    }
    struct Rule(bool);
    impl Drop for Rule {
        fn drop(&mut self) {
            crate::room::state::MAX_RULE.with(|m| m.set(self.0));
        }
    }
    let _reset = Reset(ON.with(|b| b.replace(bug)));
    let max = bug == Some(Bug::MaxRule);
    let _rule = Rule(crate::room::state::MAX_RULE.with(|m| m.replace(max)));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_is_on_only_inside_with_and_only_for_its_bug() {
        assert!(!on(Bug::CountsBytes));
        with(Some(Bug::CountsBytes), || {
            assert!(on(Bug::CountsBytes));
            assert!(!on(Bug::AckTheOrigin));
        });
        assert!(!on(Bug::CountsBytes));
    }
}
